//! The CUDA IPC data path (initiator side): slices checked against the owner's live table,
//! coalesced where both sides continue each other, enqueued on this transport's stream of the
//! local device (never a caller's), and handed to the completion thread with their event.

use std::collections::HashMap;
use std::sync::{mpsc, Arc};

use smallvec::SmallVec;
use std::time::{Duration, Instant};

use kvferry_cuda::driver::Event;
use kvferry_cuda::ipc::{self, PieceTable};

use super::keys::{within, IpcRegionKeys};
use super::state::{gpu_err, IpcSlices, Job, JobIds, Keep, Lane, Mapped, COPY_DEADLINE};
use super::transport::CudaIpcTransport;
use crate::descriptor::SegmentDescriptor;
use crate::error::{Refusal, Result, TransferError, UnsupportedError};
use crate::sync::MutexExt;
use crate::transport::{CompletionSink, Slice};
use crate::types::{Location, Op};

/// Slices of one post that take CUDA IPC, resolved to device addresses.
pub(super) struct Planned {
    pub(super) id: u32,
    pub(super) dst: u64,
    pub(super) src: u64,
    pub(super) len: u64,
}

/// Merges consecutive slices (in id order) whose both sides continue each other.
pub(super) fn coalesce(planned: &[Planned]) -> SmallVec<[ipc::Copy; 2]> {
    let mut out: SmallVec<[ipc::Copy; 2]> = SmallVec::new();
    for p in planned {
        if let Some(last) = out.last_mut() {
            if last.dst + last.len as u64 == p.dst && last.src + last.len as u64 == p.src {
                last.len += p.len as usize;
                continue;
            }
        }
        out.push(ipc::Copy {
            dst: p.dst,
            src: p.src,
            len: p.len as usize,
        });
    }
    out
}

impl CudaIpcTransport {
    /// Starts the CUDA IPC slices; returns those that must go to the fallback transport
    /// (their allocation could not be imported).
    pub(super) fn post_ipc(
        &self,
        peer: &Arc<SegmentDescriptor>,
        slices: IpcSlices<'_>,
        done: &CompletionSink,
    ) -> Vec<Slice> {
        let fail = |ids: &mut dyn Iterator<Item = u32>, e: &TransferError| done.fail_all(ids, e);
        // One clock read per post: the liveness check's and the jobs' deadlines.
        let now = Instant::now();
        if done.is_cancelled() {
            fail(
                &mut slices.iter().map(|(s, _)| s.id),
                &CompletionSink::cancelled_error(),
            );
            return Vec::new();
        }
        // A reference into the post's keys (which outlive `slices`): no copy of its strings.
        let host = &slices[0].1.host;
        if self.peer_gone(host, now) {
            self.drop_instance(&peer.name, peer.instance_id);
            let e = TransferError::Refused {
                segment: peer.name.clone(),
                why: Refusal::ProcessExited { pid: host.pid },
            };
            fail(&mut slices.iter().map(|(s, _)| s.id), &e);
            return Vec::new();
        }
        // One local device per post in practice: no regrouping then.
        let dev_of = |s: &Slice| match s.local_region.location {
            Location::Cuda(d) => d,
            _ => unreachable!("routed to CUDA IPC only with device memory on both sides"),
        };
        let first = dev_of(&slices[0].0);
        type Group<'k> = IpcSlices<'k>;
        let by_dev: SmallVec<[(u32, Group); 1]> = if slices.iter().all(|(s, _)| dev_of(s) == first)
        {
            smallvec::smallvec![(first, slices)]
        } else {
            let mut m: HashMap<u32, Group> = HashMap::new();
            for (s, k) in slices {
                m.entry(dev_of(&s)).or_default().push((s, k));
            }
            m.into_iter().collect()
        };
        let mut fallback = Vec::new();
        for (dev, group) in by_dev {
            let lane = match self.lane(dev) {
                Ok(l) => l,
                Err(e) => {
                    fail(&mut group.iter().map(|(s, _)| s.id), &e);
                    continue;
                }
            };
            // Import what is missing, once per allocation. The peer found is kept to plan
            // the copies when nothing is missing (the common case): one lock and one lookup
            // per post.
            let mut peers = self.peers.locked();
            let found = peers
                .get(&peer.name)
                .filter(|p| p.instance_id == peer.instance_id);
            let missing: Vec<&IpcRegionKeys> = {
                // Slices of one allocation come in runs: each allocation is looked at once
                // per run, not once per slice.
                let mut seen: SmallVec<[u64; 4]> = SmallVec::new();
                let mut out = Vec::new();
                let mut prev = None;
                for (_, k) in &group {
                    if prev == Some(k.alloc_base) {
                        continue;
                    }
                    prev = Some(k.alloc_base);
                    if seen.contains(&k.alloc_base) {
                        continue;
                    }
                    seen.push(k.alloc_base);
                    if found.is_none_or(|p| !p.mapped.contains_key(&(dev, k.alloc_base))) {
                        out.push(*k);
                    }
                }
                out
            };
            let mut planned: SmallVec<[Planned; 2]> = SmallVec::with_capacity(group.len());
            let mut keep = Keep::new();
            {
                let found = match (missing.is_empty(), found) {
                    (true, Some(p)) => Some(p),
                    _ => {
                        drop(peers);
                        if let Err(e) = self.import(peer, &missing, dev, None) {
                            if !self.import_failed(peer, dev, &missing, &e) {
                                fail(&mut group.iter().map(|(s, _)| s.id), &e);
                                continue;
                            }
                            tracing::warn!(peer = %peer.name, "CUDA IPC handshake failed ({e}); these slices go over {}", self.inner.kind());
                            fallback.extend(group.into_iter().map(|(s, _)| s));
                            continue;
                        }
                        peers = self.peers.locked();
                        // Only this instance's entry: a restarted peer's is not ours to use.
                        peers
                            .get(&peer.name)
                            .filter(|p| p.instance_id == peer.instance_id)
                    }
                };
                let Some(p) = found else {
                    fallback.extend(group.into_iter().map(|(s, _)| s));
                    continue;
                };
                let mut live = p.live.snapshot();
                let mut last: Option<(u64, u64, &Arc<Mapped>)> = None;
                for (s, k) in group {
                    let (size, m) = match last {
                        Some((b, size, m)) if b == k.alloc_base => (size, m),
                        _ => {
                            let Some((size, m)) = p.mapped.get(&(dev, k.alloc_base)) else {
                                fallback.push(s);
                                continue;
                            };
                            if !keep.iter().any(|x| Arc::ptr_eq(x, m)) {
                                keep.push(m.clone());
                            }
                            last = Some((k.alloc_base, *size, m));
                            (*size, m)
                        }
                    };
                    // Inside the peer's live regions and inside the allocation as mapped here:
                    // a peer's keys for another buffer of the same base may claim more bytes.
                    if !live.covers(s.remote_addr, s.len)
                        || !within(k.alloc_base, size, s.remote_addr, s.len)
                    {
                        done.complete(
                            s.id,
                            Err(TransferError::RemoteOutOfRange {
                                segment: peer.name.clone(),
                                addr: s.remote_addr,
                                len: s.len,
                            }),
                        );
                        continue;
                    }
                    let remote = m.ptr() + (s.remote_addr - k.alloc_base);
                    let (dst, src) = match s.op {
                        Op::Write => (remote, s.local_addr),
                        Op::Read => (s.local_addr, remote),
                    };
                    planned.push(Planned {
                        id: s.id,
                        dst,
                        src,
                        len: s.len,
                    });
                }
            }
            // Not held across the driver calls.
            drop(peers);
            if planned.is_empty() {
                continue;
            }
            let timing = tracing::enabled!(target: "kvferry::timing", tracing::Level::DEBUG);
            let t_enq = timing.then(Instant::now);
            // Slices come in id order unless a post mixed devices: check before sorting.
            if !planned.is_sorted_by_key(|p| p.id) {
                planned.sort_by_key(|p| p.id);
            }
            let copies = coalesce(&planned);
            let ids: JobIds = planned.iter().map(|p| p.id).collect();
            let bytes: u64 = planned.iter().map(|p| p.len).sum();
            let enqueued = self.enqueue(&lane, &copies);
            if let Some(t_enq) = t_enq {
                tracing::debug!(
                    target: "kvferry::timing",
                    planned = planned.len(),
                    copies = copies.len(),
                    enqueue_us = t_enq.elapsed().as_micros() as u64,
                    "cuda ipc enqueue"
                );
            }
            match enqueued {
                Ok(launched) => self.enqueue_job(&lane, done, (ids, bytes, now), launched, keep),
                Err(e) => fail(&mut ids.into_iter(), &e),
            }
        }
        fallback
    }

    /// After a post's import of `missing` for local device `dev` failed with `e`: whether
    /// the allocations failed (marked so for `dev`: its later posts send their slices to the
    /// fallback transport at once). A
    /// `Timeout` (the turn behind another import, or a deadline) is a wait that ended, not
    /// an allocation that failed: `false`, nothing is marked, and the next post asks again.
    pub(super) fn import_failed(
        &self,
        peer: &SegmentDescriptor,
        dev: u32,
        missing: &[&IpcRegionKeys],
        e: &TransferError,
    ) -> bool {
        if matches!(e, TransferError::Timeout(_)) {
            return false;
        }
        let mut peers = self.peers.locked();
        if let Some(p) = peers
            .get_mut(&peer.name)
            .filter(|p| p.instance_id == peer.instance_id)
        {
            p.failed.extend(missing.iter().map(|k| (dev, k.alloc_base)));
            self.routes_changed();
        }
        true
    }

    /// Enqueues `copies` on the lane's stream and records an event after them.
    pub(super) fn enqueue(
        &self,
        lane: &Lane,
        copies: &[ipc::Copy],
    ) -> Result<(Event, Option<PieceTable>)> {
        lane.ctx.bind().map_err(gpu_err)?;
        let s = lane.stream.raw();
        if let [one] = copies {
            // One run (a contiguous request): one driver copy, as the plan would make it,
            // without the plan's lists, a table or the kernel's own context switch.
            // SAFETY: the range lies inside registered local memory or a peer allocation
            // mapped here (kept alive by the job until the event completes).
            unsafe { ipc::copy_batch_async(std::slice::from_ref(one), s) }.map_err(gpu_err)?;
            return Ok((lane.record_event()?, None));
        }
        let plan = ipc::plan_copies(copies);
        let mut table = None;
        match &lane.kernel {
            Some(k) => {
                let mut t = lane.take_table();
                // SAFETY: every range lies inside registered local memory or a peer
                // allocation mapped here (kept alive by the job until the event completes);
                // the table is ours until the job returns it after the event.
                unsafe { k.enqueue(&plan, &mut t, s) }.map_err(gpu_err)?;
                table = Some(t);
            }
            None => {
                let all: Vec<ipc::Copy> = plan.direct.iter().chain(&plan.pieces).copied().collect();
                // SAFETY: as above.
                unsafe { ipc::copy_batch_async(&all, s) }.map_err(gpu_err)?;
            }
        }
        Ok((lane.record_event()?, table))
    }

    /// Hands the copies enqueued on `lane` (`launched`: their event and table) to the
    /// completion thread, which reports `ids` on `done` when the event completes or fails them
    /// at the deadline (`COPY_DEADLINE` plus 1 ns per byte of `bytes` after `now`, a moment
    /// before they were enqueued); `keep` lives until then. When the transport shut down
    /// meanwhile, waits for the copies (their memory must outlive them) and fails `ids`.
    pub(super) fn enqueue_job(
        &self,
        lane: &Arc<Lane>,
        done: &CompletionSink,
        (ids, bytes, now): (JobIds, u64, Instant),
        (event, table): (Event, Option<PieceTable>),
        keep: Keep,
    ) {
        let event = Arc::new(event);
        done.add_point(&event, ids.len() as u32);
        let job = Job {
            event,
            done: done.clone(),
            ids,
            deadline: now + COPY_DEADLINE + Duration::from_nanos(bytes),
            // 4 KiB per ns: twice what an H200 copies (about 2 GB per ms, 16 MiB in 8 µs).
            ready_at: now + Duration::from_nanos(bytes / 4096),
            lane: lane.clone(),
            table,
            _keep: keep,
        };
        let tx = self.jobs.locked().clone();
        let refused = match tx {
            Some(tx) => tx.send(job).err().map(|mpsc::SendError(j)| j),
            None => Some(job),
        };
        if let Some(j) = refused {
            // Shut down meanwhile: let the copies end before their memory goes.
            let _ = j.event.synchronize();
            j.done.fail_all(
                j.ids.iter().copied(),
                &TransferError::Unsupported(UnsupportedError::ShutDown {
                    transport: "CUDA IPC",
                }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_slices_merge_and_gaps_do_not() {
        let p = |id, dst, src, len| Planned { id, dst, src, len };
        let c = coalesce(&[
            p(0, 1000, 5000, 100),
            p(1, 1100, 5100, 100),
            p(2, 1300, 5200, 100), // gap on the destination side
            p(3, 1400, 5300, 50),
            p(4, 1450, 9000, 50), // gap on the source side
        ]);
        let got: Vec<(u64, u64, usize)> = c.iter().map(|c| (c.dst, c.src, c.len)).collect();
        assert_eq!(
            got,
            vec![(1000, 5000, 200), (1300, 5200, 150), (1450, 9000, 50)]
        );
    }
}
