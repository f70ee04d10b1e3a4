//! Posting: moves an endpoint's pending slices onto its QPs as work requests while the QPs and
//! the device's CQ have room (the lkey and rkey lookups, the staged-mirror translation, and the
//! refusal of slices that cannot be posted).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::memory_region::MemoryRegion as VerbsMr;
use sideway::ibverbs::queue_pair::{
    PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags,
};

use super::endpoint::Endpoint;
use super::{err_src, lock, CompletionSink, InFlight, Shared, Work};
use crate::error::{Result, TransferError};
use crate::types::Op;

/// Largest single work request this transport posts, bytes (slices are far smaller; the IB
/// limit is 2^31).
const MAX_WR_BYTES: u64 = 1 << 30;

/// A slice ready to post: its local memory region and address, its remote key and address.
struct WorkRequest {
    mr: Arc<VerbsMr>,
    local_addr: u64,
    rkey: u32,
    remote_addr: u64,
}

impl Shared {
    /// Posts pending slices of `ep` while its QPs and its device's CQ have room. A slice that
    /// cannot be posted (cancelled, not registered, no rkey, bad length) is reported failed; a
    /// failed post retires the endpoint (its slice goes back to the front of the queue).
    pub(super) fn pump(self: &Arc<Self>, ep: &Arc<Endpoint>) {
        let mut refused: Vec<(Work, TransferError)> = Vec::new();
        let mut broke = None;
        {
            let mut pending = ep.lock_pending();
            while !ep.is_broken() && !pending.is_empty() {
                let Some((qi, work)) = take_next(ep, &mut pending) else {
                    break;
                };
                let wr = match self.prepare(ep, &work) {
                    Ok(wr) => wr,
                    Err(e) => {
                        ep.dev.return_credit();
                        refused.push((work, e));
                        continue;
                    }
                };
                if let Some(reason) = post_one(ep, qi, work, wr, &mut pending) {
                    broke = Some(reason);
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

    /// Resolves both sides of `work` into a work request, or the error to report it with
    /// (nothing is posted for it).
    fn prepare(&self, ep: &Endpoint, work: &Work) -> Result<WorkRequest> {
        // A cancelled batch (timed out, freed) sends none of its remaining slices.
        if work.sink.is_cancelled() {
            return Err(CompletionSink::cancelled_error());
        }
        let sl = work.slice;
        match (self.local_side(ep, work), remote_side(ep, work)) {
            (Some((mr, local_addr)), Some((rkey, remote_addr)))
                if sl.len > 0 && sl.len <= MAX_WR_BYTES =>
            {
                Ok(WorkRequest {
                    mr,
                    local_addr,
                    rkey,
                    remote_addr,
                })
            }
            (None, _) => Err(TransferError::NotRegistered {
                addr: sl.local_addr,
                len: sl.len,
            }),
            (_, None) => Err(TransferError::rdma(format!(
                "segment {} buffer {} has no rkey for its device {} (or a bad staging address)",
                work.peer.name, sl.remote_buffer, ep.key.remote_dev
            ))),
            _ => Err(TransferError::InvalidArgument(format!(
                "slice of {} bytes (1..={MAX_WR_BYTES})",
                sl.len
            ))),
        }
    }

    /// The local memory region (on `ep`'s device) and address of `work`'s local side.
    /// Staged GPU memory: the work request uses the mirror at the same offset. A region
    /// registered anew since `post` (another mirror, or none) is not the one whose mirror the
    /// stager filled: the slice is not registered (`None`).
    fn local_side(&self, ep: &Endpoint, work: &Work) -> Option<(Arc<VerbsMr>, u64)> {
        let sl = work.slice;
        let local = match &work.mirror {
            Some(m) => m.translate(sl.local_addr, sl.len),
            None => Some(sl.local_addr),
        }?;
        let mr = lock(&self.regions)
            .get(&sl.local_region.addr)
            .filter(|r| match (&r.mirror, &work.mirror) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (a, b) => a.is_none() && b.is_none(),
            })
            .and_then(|r| r.mrs.get(ep.dev.index).cloned())?;
        Some((mr, local))
    }
}

/// Room for one more work request on `ep` (a QP below `max_wr` and a CQ credit of its device)
/// and the next pending slice; `None` (nothing taken, the credit returned) when either is
/// missing.
fn take_next(ep: &Endpoint, pending: &mut VecDeque<Work>) -> Option<(usize, Work)> {
    let qi = ep.pick_qp()?;
    if !ep.dev.take_credit() {
        return None;
    }
    let Some(work) = pending.pop_front() else {
        ep.dev.return_credit();
        return None;
    };
    Some((qi, work))
}

/// The rkey (for `ep`'s remote device) and remote address of `work`'s remote side: the peer's
/// address, or the same offset in its host mirror when the peer staged the buffer. `None` when
/// the buffer has no rkey for that device or the staging address does not fit.
fn remote_side(ep: &Endpoint, work: &Work) -> Option<(u32, u64)> {
    let sl = work.slice;
    let b = work.peer.buffers.get(sl.remote_buffer)?;
    let keys = work.peer_info.buffers.get(sl.remote_buffer)?;
    let rkey = *keys.rkeys.get(ep.key.remote_dev)?;
    let addr = match keys.staging_addr {
        Some(base) => base.checked_add(sl.remote_addr.checked_sub(b.region.addr)?)?,
        None => sl.remote_addr,
    };
    Some((rkey, addr))
}

/// Posts `work` on QP `qi` of `ep` as a signalled work request; the in-flight entry keeps
/// `wr.mr` registered until the completion. Returns `None` when posted; on a failed post the
/// slice goes back to the front of `pending` and the reason the endpoint broke (for
/// `endpoint_failed`) is returned.
fn post_one(
    ep: &Arc<Endpoint>,
    qi: usize,
    work: Work,
    wr: WorkRequest,
    pending: &mut VecDeque<Work>,
) -> Option<String> {
    let sl = work.slice;
    let lkey = wr.mr.lkey();
    let q = &ep.qps[qi];
    q.outstanding.fetch_add(1, Ordering::AcqRel);
    let wr_id = ep.dev.lock_inflight().insert(InFlight {
        ep: ep.clone(),
        qp: qi,
        work,
        rkey: wr.rkey,
        _mr: wr.mr,
        posted: Instant::now(),
    });
    let res = {
        let mut qp = lock(&q.qp);
        let mut g = qp.start_post_send();
        let h = g.construct_wr(wr_id, WorkRequestFlags::Signaled);
        let h = match sl.op {
            Op::Write => h.setup_write(wr.rkey, wr.remote_addr),
            Op::Read => h.setup_read(wr.rkey, wr.remote_addr),
        };
        // SAFETY: [local_addr, +len) lies in a region (or its mirror) registered as `mr`
        // (`local_side` found it there), which the in-flight entry keeps alive until the
        // completion; `len` <= MAX_WR_BYTES fits the u32.
        unsafe { h.setup_sge(lkey, wr.local_addr, sl.len as u32) };
        g.post()
    };
    if let Err(e) = res {
        q.outstanding.fetch_sub(1, Ordering::AcqRel);
        ep.dev.return_credit();
        if let Some(inf) = ep.dev.lock_inflight().remove(wr_id) {
            pending.push_front(inf.work);
        }
        return Some(format!(
            "post on {} QP {:#x} to {}: {e}: {}",
            ep.dev.info.name,
            q.qpn,
            ep.key.peer,
            err_src(&e)
        ));
    }
    None
}
