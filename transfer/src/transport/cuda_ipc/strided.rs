//! Strided groups on the CUDA IPC path (`Transport::post_strided`): each group's blocks checked
//! against the owner's live table once per block, then all groups of a device in one launch of
//! the strided kernel, whose table holds the groups' ranges and block bases (O(ranges +
//! blocks)), never one entry per copy.

use std::sync::Arc;

use smallvec::SmallVec;

use kvferry_cuda::driver::Event;
use kvferry_cuda::ipc::{self, StridedCopies};

use super::keys::{within, IpcRegionKeys, Route};
use super::state::{gpu_err, Lane};
use super::transport::CudaIpcTransport;
use crate::descriptor::SegmentDescriptor;
use crate::error::{Refusal, Result, TransferError, UnsupportedError};
use crate::memory::MemoryRegion;
use crate::strided::{base_bounds, StridedGroup};
use crate::sync::MutexExt;
use crate::transport::CompletionSink;
use crate::types::{Location, Op};

/// One group resolved to device addresses: ranges as (dst, src) offsets; its blocks (the
/// group's own list, borrowed) with the shift of the remote bases into this process's mapping
/// and which side is the destination.
struct Resolved<'g> {
    id: u32,
    ranges: SmallVec<[ipc::Copy; 2]>,
    blocks: &'g [(u64, u64)],
    /// Write: the remote base (second of a block's pair) is the destination.
    dst_second: bool,
    shift: (u64, u64),
    bytes: u64,
}

impl CudaIpcTransport {
    /// Whether the pair goes over CUDA IPC now and the local device has the strided kernel.
    pub(super) fn takes_strided_pair(
        &self,
        peer: &SegmentDescriptor,
        local: &MemoryRegion,
        remote_buffer: usize,
    ) -> bool {
        let Location::Cuda(dev) = local.location else {
            return false;
        };
        matches!(
            self.route_keys(peer, None, local, remote_buffer).0,
            Route::Ipc | Route::InProcess
        ) && self.lane(dev).is_ok_and(|l| l.strided.is_some())
    }

    /// `Transport::post_strided`: every group one id, completed by the event after its launch.
    pub(super) fn post_strided_groups(
        &self,
        peer: &Arc<SegmentDescriptor>,
        groups: &[StridedGroup],
        done: CompletionSink,
    ) {
        if done.is_cancelled() {
            done.fail_all(
                groups.iter().map(|g| g.id),
                &CompletionSink::cancelled_error(),
            );
            return;
        }
        // The route was decided at submit; a descriptor change meanwhile fails the group
        // (the per-copy path would have retried it on the fallback transport).
        // Inline for the few groups of a common post (no allocation per post).
        let mut work: SmallVec<[Work<'_>; 2]> = SmallVec::with_capacity(groups.len());
        for g in groups {
            let (route, k) = self.route_keys(peer, Some(peer), &g.local_region, g.remote_buffer);
            match (k, g.local_region.location, route) {
                (Some(Ok(k)), Location::Cuda(d), Route::Ipc | Route::InProcess) => {
                    work.push((g, k, d))
                }
                _ => done.complete(g.id, Err(not_over_ipc(g.remote_buffer))),
            }
        }
        let Some(first) = work.first().map(|w| w.1.clone()) else {
            return;
        };
        let host = &first.host;
        if self.peer_gone(host, std::time::Instant::now()) {
            self.drop_instance(&peer.name, peer.instance_id);
            let e = TransferError::Refused {
                segment: peer.name.clone(),
                why: Refusal::ProcessExited { pid: host.pid },
            };
            done.fail_all(work.iter().map(|w| w.0.id), &e);
            return;
        }
        let mut devices: SmallVec<[u32; 2]> = work.iter().map(|w| w.2).collect();
        devices.sort_unstable();
        devices.dedup();
        done.expect_soon();
        for dev in devices {
            let part: SmallVec<[&Work<'_>; 2]> = work.iter().filter(|w| w.2 == dev).collect();
            let ids = || part.iter().map(|w| w.0.id);
            if let Err(e) = self.post_device(peer, dev, &part, &done) {
                done.fail_all(ids(), &e);
            }
        }
    }

    /// The groups of one local device: imports what is missing, checks and resolves every
    /// group (failing those outside the live table), enqueues one launch and hands the job to
    /// the completion thread. An `Err` fails the groups not reported yet.
    fn post_device(
        &self,
        peer: &Arc<SegmentDescriptor>,
        dev: u32,
        part: &[&Work<'_>],
        done: &CompletionSink,
    ) -> Result<()> {
        let t0 = std::time::Instant::now();
        let lane = self.lane(dev)?;
        // The peers' lock is held on to resolve the groups when nothing is missing (the
        // common case): one lock per post.
        let mut peers = self.peers.locked();
        let missing: Vec<&IpcRegionKeys> = {
            let p = peers
                .get(&peer.name)
                .filter(|p| p.instance_id == peer.instance_id);
            let mut out: Vec<&IpcRegionKeys> = Vec::new();
            for (_, k, _) in part.iter().copied() {
                if out.iter().any(|m| m.alloc_base == k.alloc_base) {
                    continue;
                }
                if p.is_none_or(|p| !p.mapped.contains_key(&(dev, k.alloc_base))) {
                    out.push(k);
                }
            }
            out
        };
        if !missing.is_empty() {
            drop(peers);
            let imported = self.import(peer, &missing, dev, None);
            peers = self.peers.locked();
            if let Err(e) = imported {
                drop(peers);
                // Failed allocations: later submits of these pairs take the per-copy path (to
                // the fallback); a timeout leaves them to the next post.
                self.import_failed(peer, dev, &missing, &e);
                return Err(e);
            }
        }
        let mut keep = super::state::Keep::new();
        let mut resolved: SmallVec<[Resolved<'_>; 2]> = SmallVec::with_capacity(part.len());
        {
            // Only this instance's entry: a restarted peer's is not ours to use.
            let p = peers
                .get(&peer.name)
                .filter(|p| p.instance_id == peer.instance_id)
                .ok_or_else(|| not_over_ipc(part[0].0.remote_buffer))?;
            let mut live = p.live.snapshot();
            for (g, k, _) in part.iter().copied() {
                let Some((size, m)) = p.mapped.get(&(dev, k.alloc_base)) else {
                    done.complete(g.id, Err(not_over_ipc(g.remote_buffer)));
                    continue;
                };
                // Every copy's remote side lies in the block's span, which lies in one buffer
                // (checked at submit): the span inside the live table and inside the
                // allocation as mapped (a peer's keys may claim more) covers every copy.
                let lo = g.ranges.iter().map(|r| r.remote).min().unwrap_or(0);
                let hi = g.ranges.iter().map(|r| r.remote + r.len).max().unwrap_or(0);
                let outside = first_dead_block(&mut live, &g.blocks, lo, hi).or_else(|| {
                    first_block_outside_mapping(&g.blocks, lo, hi, k.alloc_base, *size)
                });
                if let Some(rb) = outside {
                    done.complete(
                        g.id,
                        Err(TransferError::RemoteOutOfRange {
                            segment: peer.name.clone(),
                            addr: rb + lo,
                            len: hi - lo,
                        }),
                    );
                    continue;
                }
                if !keep.iter().any(|x| Arc::ptr_eq(x, m)) {
                    keep.push(m.clone());
                }
                // The block's remote base moved into this process's mapping (wrapping: a base
                // may lie below the allocation when every range starts past it).
                let shift = m.ptr().wrapping_sub(k.alloc_base);
                let ranges = g
                    .ranges
                    .iter()
                    .map(|r| match g.op {
                        Op::Write => ipc::Copy {
                            dst: r.remote,
                            src: r.local,
                            len: r.len as usize,
                        },
                        Op::Read => ipc::Copy {
                            dst: r.local,
                            src: r.remote,
                            len: r.len as usize,
                        },
                    })
                    .collect();
                let (dst_second, shift) = match g.op {
                    Op::Write => (true, (shift, 0)),
                    Op::Read => (false, (0, shift)),
                };
                let per: u64 = g.ranges.iter().map(|r| r.len).sum();
                resolved.push(Resolved {
                    id: g.id,
                    ranges,
                    blocks: &g.blocks,
                    dst_second,
                    shift,
                    bytes: per.saturating_mul(g.blocks.len() as u64),
                });
            }
        }
        // Not held across the driver calls.
        drop(peers);
        if resolved.is_empty() {
            return Ok(());
        }
        let ids: super::state::JobIds = resolved.iter().map(|r| r.id).collect();
        let bytes = resolved.iter().fold(0u64, |a, r| a.saturating_add(r.bytes));
        let launch: SmallVec<[StridedCopies<'_>; 2]> = resolved
            .iter()
            .map(|r| StridedCopies {
                ranges: &r.ranges,
                bases: r.blocks,
                dst_second: r.dst_second,
                shift: r.shift,
            })
            .collect();
        // No clock read for the timing line when it is off.
        let timing = tracing::enabled!(target: "kvferry::timing", tracing::Level::DEBUG);
        let us = || t0.elapsed().as_micros() as u64;
        let resolve_us = if timing { us() } else { 0 };
        let enqueued = self.enqueue_strided(dev, &lane, &launch);
        let enqueue_us = if timing { us() - resolve_us } else { 0 };
        match enqueued {
            Ok((event, table)) => {
                self.enqueue_job(&lane, done, (ids, bytes, t0), (event, Some(table)), keep)
            }
            Err(e) => done.fail_all(ids, &e),
        }
        // Where a strided post's host time goes: imports, checks and table inputs; the table
        // written and the launch enqueued; the hand-off to the completion thread.
        if timing {
            tracing::debug!(
                target: "kvferry::timing",
                resolve_us,
                enqueue_us,
                job_us = us() - resolve_us - enqueue_us,
                "cuda ipc strided post"
            );
        }
        Ok(())
    }

    /// `Transport::mapped`: each range's allocation as mapped for `dev`, after the same checks
    /// a strided post makes (one buffer of the peer, its live table, the mapping's bounds),
    /// under one lock of the peers.
    pub(super) fn mapped_ranges(
        &self,
        peer: &Arc<SegmentDescriptor>,
        dev: u32,
        ranges: &[(u64, u64)],
    ) -> Option<Result<Vec<crate::transport::MappedRange>>> {
        let mut keys = Vec::with_capacity(ranges.len());
        for &(addr, len) in ranges {
            let outside = TransferError::RemoteOutOfRange {
                segment: peer.name.clone(),
                addr,
                len,
            };
            let Some(buffer) = peer
                .buffers
                .iter()
                .position(|b| b.region.contains(addr, len))
            else {
                return Some(Err(outside));
            };
            let Some(Ok(k)) = self.keys_of(peer, Some(peer), buffer) else {
                return None;
            };
            keys.push((k, outside));
        }
        let peers = self.peers.locked();
        // Only this instance's entry: a restarted peer's is not ours to use.
        let p = peers
            .get(&peer.name)
            .filter(|p| p.instance_id == peer.instance_id)?;
        let mut live = p.live.snapshot();
        let mut out = Vec::with_capacity(ranges.len());
        for (&(addr, len), (k, outside)) in ranges.iter().zip(keys) {
            let (size, m) = p.mapped.get(&(dev, k.alloc_base))?;
            if !within(k.alloc_base, *size, addr, len) || !live.covers(addr, len) {
                return Some(Err(outside));
            }
            let ptr = m.ptr().wrapping_add(addr - k.alloc_base);
            out.push(crate::transport::MappedRange::new(ptr, m.clone()));
        }
        Some(Ok(out))
    }

    /// One launch of the strided kernel for `groups` on the lane's stream, and an event after.
    fn enqueue_strided(
        &self,
        dev: u32,
        lane: &Lane,
        groups: &[StridedCopies<'_>],
    ) -> Result<(Event, ipc::PieceTable)> {
        let kernel = lane.strided.as_ref().ok_or(TransferError::Unsupported(
            UnsupportedError::NoStridedKernel { ordinal: dev },
        ))?;
        lane.ctx.bind().map_err(gpu_err)?;
        let s = lane.stream.raw();
        let mut t = lane.take_table();
        // SAFETY: every copy lies inside registered local memory or a peer allocation mapped
        // here (checked at submit and against the live table; kept alive by the job until the
        // event completes); the table is ours until the job returns it after the event.
        unsafe { kernel.enqueue(groups, &mut t, s) }.map_err(gpu_err)?;
        Ok((lane.record_event()?, t))
    }
}

/// The remote base of the first block whose remote span `[base + lo, base + hi)` the live
/// table does not hold, `None` when it holds every block's. One lookup for the hull of all
/// the spans (a live region is an interval: holding the hull, it holds every span), one per
/// block only when the hull is not inside one region.
fn first_dead_block(
    live: &mut super::live::LiveSnapshot,
    blocks: &[(u64, u64)],
    lo: u64,
    hi: u64,
) -> Option<u64> {
    first_block_outside(blocks, lo, hi, |a, n| live.covers(a, n))
}

/// As [`first_dead_block`], against the allocation mapped here, `[base, base + size)`: the
/// bytes a copy may touch, whatever the peer's keys and live table say of its regions.
fn first_block_outside_mapping(
    blocks: &[(u64, u64)],
    lo: u64,
    hi: u64,
    base: u64,
    size: u64,
) -> Option<u64> {
    first_block_outside(blocks, lo, hi, |a, n| within(base, size, a, n))
}

/// The remote base of the first block whose span `[base + lo, base + hi)` `covers` refuses
/// (an interval test: asked once for the hull of all spans, then per block).
fn first_block_outside(
    blocks: &[(u64, u64)],
    lo: u64,
    hi: u64,
    mut covers: impl FnMut(u64, u64) -> bool,
) -> Option<u64> {
    let (_, (r0, r1)) = base_bounds(blocks);
    let hull = r0
        .checked_add(lo)
        .zip(r1.checked_add(hi))
        .filter(|(a, e)| a < e);
    if let Some((a, e)) = hull {
        if covers(a, e - a) {
            return None;
        }
    }
    blocks
        .iter()
        .find(|(_, rb)| rb.checked_add(lo).is_none_or(|a| !covers(a, hi - lo)))
        .map(|&(_, rb)| rb)
}

/// A group of a strided post with the keys of its peer buffer and its local device.
type Work<'g> = (&'g StridedGroup, Arc<IpcRegionKeys>, u32);

fn not_over_ipc(buffer: usize) -> TransferError {
    TransferError::Unsupported(UnsupportedError::NotOverCudaIpc { buffer })
}

#[cfg(test)]
mod tests {
    use super::super::live::{LiveTable, LiveView};
    use super::*;

    #[test]
    fn a_block_outside_the_live_regions_is_found_with_or_without_the_hull() {
        let mut t = LiveTable::new().unwrap();
        let v = LiveView::open(&t.fd()).unwrap();
        t.publish(&[(0x10000, 0x1000), (0x20000, 0x1000)]).unwrap();
        // Spans [base + 0x10, base + 0x90).
        let (lo, hi) = (0x10, 0x90);
        let b = |rb: u64| (0u64, rb);
        // All in the first region: the hull is.
        assert_eq!(
            first_dead_block(
                &mut v.snapshot(),
                &[b(0x10000), b(0x10f00), b(0x10100)],
                lo,
                hi
            ),
            None
        );
        // In two regions: the hull is in none, every block is in one.
        assert_eq!(
            first_dead_block(&mut v.snapshot(), &[b(0x10000), b(0x20f00)], lo, hi),
            None
        );
        // Past the end of the first region by one byte (0x10f71 + 0x90 = 0x11001).
        assert_eq!(
            first_dead_block(
                &mut v.snapshot(),
                &[b(0x10000), b(0x10f71), b(0x20000)],
                lo,
                hi
            ),
            Some(0x10f71)
        );
        // Between the two regions.
        assert_eq!(
            first_dead_block(
                &mut v.snapshot(),
                &[b(0x10000), b(0x18000), b(0x20000)],
                lo,
                hi
            ),
            Some(0x18000)
        );
        // A region unregistered since: its blocks are refused.
        t.publish(&[(0x20000, 0x1000)]).unwrap();
        assert_eq!(
            first_dead_block(&mut v.snapshot(), &[b(0x20000), b(0x10000)], lo, hi),
            Some(0x10000)
        );
        // Ends past u64::MAX: refused, no overflow.
        assert_eq!(
            first_dead_block(&mut v.snapshot(), &[b(u64::MAX - 0x20)], lo, hi),
            Some(u64::MAX - 0x20)
        );
    }

    /// A peer's keys can claim an allocation larger than the one mapped here (two buffers of
    /// one base with different sizes): blocks past the mapping are refused, whatever the live
    /// table says.
    #[test]
    fn a_block_past_the_mapped_allocation_is_found() {
        let (lo, hi) = (0x10, 0x90);
        let b = |rb: u64| (0u64, rb);
        let (base, size) = (0x10000, 0x1000);
        assert_eq!(
            first_block_outside_mapping(&[b(0x10000), b(0x10f00)], lo, hi, base, size),
            None
        );
        // 0x10f71 + 0x90 = 0x11001: one byte past the mapping.
        assert_eq!(
            first_block_outside_mapping(&[b(0x10000), b(0x10f71)], lo, hi, base, size),
            Some(0x10f71)
        );
        // Below the base.
        assert_eq!(
            first_block_outside_mapping(&[b(0xff00), b(0x10000)], lo, hi, base, size),
            Some(0xff00)
        );
        assert!(within(base, size, 0x10000, 0x1000));
        assert!(!within(base, size, 0x10000, 0x1001));
        assert!(
            !within(u64::MAX - 4, 8, u64::MAX - 4, 4),
            "end past u64::MAX"
        );
    }
}
