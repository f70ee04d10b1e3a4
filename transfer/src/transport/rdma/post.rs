//! Posting: moves an endpoint's pending slices onto its QPs as work requests while the QPs and
//! the device's CQ have room (the lkey and rkey lookups, the staged-mirror translation, and the
//! refusal of slices that cannot be posted).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::queue_pair::{
    PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags,
};

use super::endpoint::Endpoint;
use super::{err_src, lock, CompletionSink, InFlight, Shared, Work};
use crate::error::TransferError;
use crate::types::Op;

/// Largest single work request this transport posts, bytes (slices are far smaller; the IB
/// limit is 2^31).
const MAX_WR_BYTES: u64 = 1 << 30;

impl Shared {
    /// Posts pending slices of `ep` while its QPs and its device's CQ have room.
    pub(super) fn pump(self: &Arc<Self>, ep: &Arc<Endpoint>) {
        let mut refused: Vec<(Work, TransferError)> = Vec::new();
        let mut broke = None;
        {
            let mut pending = ep.lock_pending();
            while !ep.is_broken() && !pending.is_empty() {
                let Some(qi) = ep.pick_qp() else { break };
                if !ep.dev.take_credit() {
                    break;
                }
                let Some(work) = pending.pop_front() else {
                    ep.dev.return_credit();
                    break;
                };
                // A cancelled batch (timed out, freed) sends none of its remaining slices.
                if work.sink.is_cancelled() {
                    ep.dev.return_credit();
                    refused.push((work, CompletionSink::cancelled_error()));
                    continue;
                }
                let sl = work.slice;
                // Staged GPU memory: the work request uses the mirror at the same offset. A
                // region registered anew since `post` (another mirror, or none) is not the one
                // whose mirror the stager filled: the slice is not registered.
                let local = match &work.mirror {
                    Some(m) => m.translate(sl.local_addr, sl.len),
                    None => Some(sl.local_addr),
                };
                let mr = local.and_then(|_| {
                    lock(&self.regions)
                        .get(&sl.local_region.addr)
                        .filter(|r| match (&r.mirror, &work.mirror) {
                            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                            (a, b) => a.is_none() && b.is_none(),
                        })
                        .and_then(|r| r.mrs.get(ep.dev.index).cloned())
                });
                let local_addr = local.unwrap_or(sl.local_addr);
                let remote = work.peer.buffers.get(sl.remote_buffer).and_then(|b| {
                    let rkey = *b.keys.rkeys.get(ep.key.remote_dev)?;
                    let addr = match b.keys.staging_addr {
                        Some(base) => {
                            base.checked_add(sl.remote_addr.checked_sub(b.region.addr)?)?
                        }
                        None => sl.remote_addr,
                    };
                    Some((rkey, addr))
                });
                let (mr, (rkey, remote_addr)) = match (mr, remote) {
                    (Some(m), Some(r)) if sl.len > 0 && sl.len <= MAX_WR_BYTES => (m, r),
                    (None, _) => {
                        ep.dev.return_credit();
                        refused.push((
                            work,
                            TransferError::NotRegistered {
                                addr: sl.local_addr,
                                len: sl.len,
                            },
                        ));
                        continue;
                    }
                    (_, None) => {
                        ep.dev.return_credit();
                        let e = TransferError::Rdma(format!(
                            "segment {} buffer {} has no rkey for its device {} (or a bad \
                             staging address)",
                            work.peer.name, sl.remote_buffer, ep.key.remote_dev
                        ));
                        refused.push((work, e));
                        continue;
                    }
                    _ => {
                        ep.dev.return_credit();
                        let e = TransferError::InvalidArgument(format!(
                            "slice of {} bytes (1..={MAX_WR_BYTES})",
                            sl.len
                        ));
                        refused.push((work, e));
                        continue;
                    }
                };
                let lkey = mr.lkey();
                let q = &ep.qps[qi];
                q.outstanding.fetch_add(1, Ordering::AcqRel);
                let wr_id = ep.dev.lock_inflight().insert(InFlight {
                    ep: ep.clone(),
                    qp: qi,
                    work,
                    rkey,
                    _mr: mr,
                    posted: Instant::now(),
                });
                let res = {
                    let mut qp = lock(&q.qp);
                    let mut g = qp.start_post_send();
                    let h = g.construct_wr(wr_id, WorkRequestFlags::Signaled);
                    let h = match sl.op {
                        Op::Write => h.setup_write(rkey, remote_addr),
                        Op::Read => h.setup_read(rkey, remote_addr),
                    };
                    // SAFETY: [local_addr, +len) lies in a region (or its mirror) registered as
                    // `mr`, which the in-flight entry keeps alive until the completion.
                    unsafe { h.setup_sge(lkey, local_addr, sl.len as u32) };
                    g.post()
                };
                if let Err(e) = res {
                    q.outstanding.fetch_sub(1, Ordering::AcqRel);
                    ep.dev.return_credit();
                    if let Some(inf) = ep.dev.lock_inflight().remove(wr_id) {
                        pending.push_front(inf.work);
                    }
                    broke = Some(format!(
                        "post on {} QP {:#x} to {}: {e}: {}",
                        ep.dev.info.name,
                        q.qpn,
                        ep.key.peer,
                        err_src(&e)
                    ));
                    break;
                }
            }
        }
        for (w, e) in refused {
            w.sink.complete(w.slice.id, Err(e));
        }
        if let Some(reason) = broke {
            self.endpoint_failed(ep, reason);
        }
    }
}
