//! Posting: moves an endpoint's pending slices onto its QPs as work requests while the QPs and
//! the device's CQ have room (the lkey and rkey lookups, the staged-mirror translation, and the
//! refusal of slices that cannot be posted). Consecutive slices that continue each other on both
//! sides go out as one work request of up to `RdmaConfig::merge_bytes` (each slice is still
//! completed and retried on its own); the work requests of one pump go to one QP, the least
//! loaded, while other work is in flight on the endpoint, and are spread round robin over its
//! QPs when it is idle (`endpoint::home_qp` says why), and are posted per QP as chained lists of
//! up to `RdmaConfig::post_chain` (one `ibv_post_send`, one doorbell, per list), of which only
//! the last work request is signalled (the completion thread finishes the ones before it with
//! it, `Qp::sent`). The lists are built under the endpoint's pending lock and posted after it
//! is released.

use crate::sync::MutexExt;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::memory_region::MemoryRegion as VerbsMr;

use super::endpoint::Endpoint;
use super::inflight::InFlight;
use super::shared::Shared;
use super::verbs::{self, RawWr, MAX_WR_BYTES};
use super::work::Work;
use crate::error::{ArgumentError, EndpointFailure, IoError, RdmaError, Result, TransferError};
use crate::transport::CompletionSink;
use crate::types::Op;

/// A run of slices ready to post as one work request: its local memory region and address,
/// its remote key and address.
struct WorkRequest {
    mr: Arc<VerbsMr>,
    local_addr: u64,
    rkey: u32,
    remote_addr: u64,
}

/// Work requests built for one QP and not yet posted: (wr_id in the in-flight table, request).
type Chain = Vec<(u64, RawWr)>;

impl Shared {
    /// Posts pending slices of `ep` while its QPs and its device's CQ have room. A slice that
    /// cannot be posted (cancelled, not registered, no rkey, bad length) is reported failed; a
    /// failed post retires the endpoint (its unposted slices go back to the front of the queue).
    pub(super) fn pump(self: &Arc<Self>, ep: &Arc<Endpoint>) {
        let mut refused: Vec<(Vec<Work>, TransferError)> = Vec::new();
        let limit = self.config.post_chain.max(1);
        // Chains are built under the pending lock and posted after it is released: a post can
        // take long (soft-RoCE runs the protocol inside `ibv_post_send`), and the lock is what
        // the other submitters and the completion thread (`waiting_endpoints`) wait on.
        let mut ready: Vec<(usize, Chain)> = Vec::new();
        {
            let mut pending = ep.lock_pending();
            let home = ep.home_qp();
            let mut chains: Vec<Chain> = ep.qps.iter().map(|_| Vec::new()).collect();
            while !ep.is_broken() && !pending.is_empty() {
                let Some((qi, works, len)) =
                    take_run(ep, &mut pending, self.config.merge_bytes, home)
                else {
                    break;
                };
                let wr = match self.prepare(ep, &works[0], len) {
                    Ok(wr) => wr,
                    Err(e) => {
                        release(ep, qi);
                        refused.push((works, e));
                        continue;
                    }
                };
                chains[qi].push(in_flight(self, ep, qi, works, len, wr));
                if chains[qi].len() >= limit {
                    ready.push((qi, std::mem::take(&mut chains[qi])));
                }
            }
            ready.extend(
                chains
                    .into_iter()
                    .enumerate()
                    .filter(|(_, c)| !c.is_empty()),
            );
        }
        let mut broke = None;
        for (qi, chain) in ready {
            if broke.is_some() {
                unpost(self, ep, qi, &chain, &mut ep.lock_pending());
            } else if let Some(reason) = post_chain(self, ep, qi, chain) {
                broke = Some(reason);
            }
        }
        for (ws, e) in refused {
            for w in ws {
                w.sink.complete(w.slice.id, Err(e.clone()));
            }
        }
        if let Some(reason) = broke {
            self.endpoint_failed(ep, reason);
            // the endpoint may have been retired before (then its queue was drained already):
            // what went back into the queue since goes to a fresh endpoint
            let left: Vec<Work> = ep.lock_pending().drain(..).collect();
            if !left.is_empty() {
                self.dispatch(left);
            }
        }
    }

    /// Resolves both sides of a run of `len` bytes starting at `head` into a work request, or
    /// the error to report its slices with (nothing is posted for them).
    fn prepare(&self, ep: &Endpoint, head: &Work, len: u64) -> Result<WorkRequest> {
        // A cancelled batch (timed out, freed) sends none of its remaining slices.
        if head.sink.is_cancelled() {
            return Err(CompletionSink::cancelled_error());
        }
        let sl = crate::transport::Slice { len, ..head.slice };
        match (self.local_side(ep, head, &sl), remote_side(ep, head, &sl)) {
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
            (_, None) => Err(RdmaError::NoRkey {
                segment: head.peer.name.clone(),
                buffer: sl.remote_buffer,
                device: ep.key.remote_dev,
            }
            .into()),
            _ => Err(ArgumentError::SliceLength {
                len: sl.len,
                max: MAX_WR_BYTES,
            }
            .into()),
        }
    }

    /// The local memory region (on `ep`'s device) and address of `work`'s local side.
    /// Staged GPU memory: the work request uses the mirror at the same offset. A region
    /// registered anew since `post` (another mirror, or none) is not the one whose mirror the
    /// stager filled: the slice is not registered (`None`).
    fn local_side(
        &self,
        ep: &Endpoint,
        work: &Work,
        sl: &crate::transport::Slice,
    ) -> Option<(Arc<VerbsMr>, u64)> {
        let local = match &work.mirror {
            Some(m) => m.translate(sl.local_addr, sl.len),
            None => Some(sl.local_addr),
        }?;
        let mr = self
            .regions
            .locked()
            .get(&sl.local_region.addr)
            .filter(|r| match (&r.mirror, &work.mirror) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (a, b) => a.is_none() && b.is_none(),
            })
            .and_then(|r| r.mrs.get(ep.dev.index).cloned())?;
        Some((mr, local))
    }
}

/// Room for one more work request on `ep` (a QP below `max_wr`: `home` while it has room,
/// else the next one round robin; reserved, and a CQ credit of its device, taken) and the next
/// run of pending slices: the first one and those after it that continue it (`continues`)
/// within `merge_bytes` in all. Returns (QP index, slices, bytes); `None` (nothing taken or
/// reserved) when room or slices are missing.
fn take_run(
    ep: &Endpoint,
    pending: &mut VecDeque<Work>,
    merge_bytes: u64,
    home: Option<usize>,
) -> Option<(usize, Vec<Work>, u64)> {
    let qi = match home {
        Some(h) if ep.qps[h].outstanding.load(Ordering::Acquire) < ep.max_wr => h,
        _ => ep.pick_qp()?,
    };
    if pending.is_empty() || !ep.dev.take_credit() {
        return None;
    }
    ep.qps[qi].outstanding.fetch_add(1, Ordering::AcqRel);
    let head = pending.pop_front()?;
    let mut len = head.slice.len;
    let mut works = vec![head];
    while let Some(next) = pending.front() {
        let last = works.last()?;
        if len + next.slice.len > merge_bytes || !continues(last, next) {
            break;
        }
        len += next.slice.len;
        works.extend(pending.pop_front());
    }
    Some((qi, works, len))
}

/// True when `next` can share a work request with `prev` right after it: the same batch,
/// operation, local region (and staging mirror) and remote buffer, and contiguous on both
/// sides.
fn continues(prev: &Work, next: &Work) -> bool {
    let (a, b) = (&prev.slice, &next.slice);
    prev.sink.same_batch(&next.sink)
        && Arc::ptr_eq(&prev.peer, &next.peer)
        && a.op == b.op
        && a.local_region == b.local_region
        && a.remote_buffer == b.remote_buffer
        && a.local_addr.checked_add(a.len) == Some(b.local_addr)
        && a.remote_addr.checked_add(a.len) == Some(b.remote_addr)
        && match (&prev.mirror, &next.mirror) {
            (Some(x), Some(y)) => Arc::ptr_eq(x, y),
            (x, y) => x.is_none() && y.is_none(),
        }
}

/// Gives back the room `take_run` reserved on QP `qi` of `ep` and its CQ credit.
fn release(ep: &Endpoint, qi: usize) {
    ep.qps[qi].outstanding.fetch_sub(1, Ordering::AcqRel);
    ep.dev.return_credit();
}

/// The rkey (for `ep`'s remote device) and remote address of `sl` (a run starting at `work`):
/// the peer's address, or the same offset in its host mirror when the peer staged the buffer.
/// `None` when the buffer has no rkey for that device or the staging address does not fit.
fn remote_side(ep: &Endpoint, work: &Work, sl: &crate::transport::Slice) -> Option<(u32, u64)> {
    let b = work.peer.buffers.get(sl.remote_buffer)?;
    let keys = work.peer_info.buffers.get(sl.remote_buffer)?;
    let rkey = *keys.rkeys.get(ep.key.remote_dev)?;
    let addr = match keys.staging_addr {
        Some(base) => base.checked_add(sl.remote_addr.checked_sub(b.region.addr)?)?,
        None => sl.remote_addr,
    };
    Some((rkey, addr))
}

/// Enters a run of `len` bytes for QP `qi` in `s`'s in-flight table of `ep`'s device (which keeps
/// `wr.mr` registered until the completion) and returns it as a chain entry.
fn in_flight(
    s: &Shared,
    ep: &Arc<Endpoint>,
    qi: usize,
    works: Vec<Work>,
    len: u64,
    wr: WorkRequest,
) -> (u64, RawWr) {
    let raw = RawWr {
        wr_id: 0,
        read: works[0].slice.op == Op::Read,
        lkey: wr.mr.lkey(),
        local_addr: wr.local_addr,
        // `prepare` bounded it by MAX_WR_BYTES
        len: len as u32,
        rkey: wr.rkey,
        remote_addr: wr.remote_addr,
        signaled: false,
    };
    let wr_id = s.lock_inflight(&ep.dev).insert(InFlight {
        ep: ep.clone(),
        qp: qi,
        works,
        len,
        rkey: wr.rkey,
        _mr: wr.mr,
        posted: Instant::now(),
    });
    (wr_id, RawWr { wr_id, ..raw })
}

/// Posts `chain` on QP `qi` of `ep` in one call, only its last work request signalled, counting
/// the work requests posted in `s.posted`. Returns `None`
/// when all of it was posted; when the provider refused an entry, the entries from it on leave
/// the in-flight table, their slices go back to the front of `ep`'s pending queue, and the reason the
/// endpoint broke (for `endpoint_failed`) is returned. The entries posted before the refused
/// one carry no signal: they may complete without a work completion, so they are taken back
/// too (their slices retried: a WRITE or READ moved twice moves the same bytes), their memory
/// regions kept until the endpoint goes (`Endpoint::retired`).
fn post_chain(s: &Shared, ep: &Arc<Endpoint>, qi: usize, chain: Chain) -> Option<EndpointFailure> {
    let q = &ep.qps[qi];
    let mut wrs: Vec<RawWr> = chain.iter().map(|(_, w)| *w).collect();
    if let Some(last) = wrs.last_mut() {
        last.signaled = true;
    }
    // Counted before the post, as the chain goes on `sent`: under soft-RoCE the post runs the
    // protocol inline and its completion may be polled (and the batch seen complete) before the
    // post call returns; the entries the provider refuses are taken off below.
    s.posted.fetch_add(wrs.len() as u64, Ordering::Relaxed);
    let res = {
        let qp = q.qp.locked();
        // in the queue before the post: the completion thread may see a completion at once
        q.sent.locked().extend(chain.iter().map(|(id, _)| *id));
        // SAFETY: each entry's local range lies in a region (or its mirror) registered as the
        // MR its in-flight entry holds (`local_side` found it there), which keeps it alive
        // until the completion; the QP lives as long as `ep`.
        unsafe { verbs::post_send_list(&qp, &wrs) }
    };
    let (posted, errno) = match res {
        Ok(()) => return None,
        Err(e) => e,
    };
    // The refused entries were counted above.
    s.posted
        .fetch_sub((wrs.len() - posted) as u64, Ordering::Relaxed);
    // none of the chain's entries stays on `sent`: the refused ones were never posted, the
    // posted ones have no signalled entry after them
    q.sent
        .locked()
        .retain(|id| !chain.iter().any(|(c, _)| c == id));
    if posted > 0 {
        let mut retired = ep.retired.locked();
        for (wr_id, _) in &chain[..posted] {
            if let Some(inf) = s.lock_inflight(&ep.dev).get(*wr_id) {
                retired.push(inf._mr.clone());
            }
        }
    }
    unpost(s, ep, qi, &chain, &mut ep.lock_pending());
    Some(EndpointFailure::Post(IoError::new(
        format_args!(
            "post on {} QP {:#x} to {}",
            ep.dev.info.name, q.qpn, ep.key.peer
        ),
        std::io::Error::from_raw_os_error(errno),
    )))
}

/// Takes back chain entries that were never posted: out of the in-flight table, room and
/// credit returned, their slices to the front of `pending` in their order.
fn unpost(
    s: &Shared,
    ep: &Endpoint,
    qi: usize,
    chain: &[(u64, RawWr)],
    pending: &mut VecDeque<Work>,
) {
    for (wr_id, _) in chain.iter().rev() {
        release(ep, qi);
        if let Some(inf) = s.lock_inflight(&ep.dev).remove(*wr_id) {
            for w in inf.works.into_iter().rev() {
                pending.push_front(w);
            }
        }
    }
}
