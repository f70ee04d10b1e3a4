//! Batches (docs/design.md §3 "Batches"): how a submit's requests are cut into slices (local
//! covers, slicing at every region boundary of either side), and the table of batches the
//! engine tracks by id until they are waited on or freed.

use crate::sync::MutexExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::batch_meter::BatchMeter;
use crate::error::{ArgumentError, Result, TransferError};
use crate::ids::NumMap;
use crate::memory::{Covers, MemoryRegion, MemoryRegistry};
use crate::transport::completion::BatchState;
use crate::transport::Slice;
use crate::types::{BatchId, TransferRequest};

/// The batches of one engine by id, each with its meter until its end is recorded. Ids start
/// at 1 and are never reused.
pub(crate) struct BatchTable {
    batches: Mutex<NumMap<Entry>>,
    next: AtomicU64,
}

struct Entry {
    state: Arc<BatchState>,
    /// `None` once its end was recorded (a wait that timed out).
    meter: Option<BatchMeter>,
}

impl BatchTable {
    pub(crate) fn new() -> Self {
        BatchTable {
            batches: Mutex::new(NumMap::default()),
            next: AtomicU64::new(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, NumMap<Entry>> {
        self.batches.locked()
    }

    /// A new batch of `slices` slices, tracked under a fresh id, with its meter.
    pub(crate) fn start(&self, slices: u32, meter: BatchMeter) -> (BatchId, Arc<BatchState>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let state = BatchState::new(slices);
        let entry = Entry {
            state: state.clone(),
            meter: Some(meter),
        };
        self.lock().insert(id, entry);
        (BatchId(id), state)
    }

    /// The batch `id`. Errors: `UnknownBatch` for an id never issued or already freed.
    pub(crate) fn get(&self, id: BatchId) -> Result<Arc<BatchState>> {
        self.lock()
            .get(&id.0)
            .map(|e| e.state.clone())
            .ok_or(TransferError::UnknownBatch(id.0))
    }

    /// Ends a wait for batch `id` with `r`: records its meter (once: a batch waited for again
    /// after a timeout is not recorded again) and, unless it timed out, forgets and cancels
    /// it, under one lock.
    pub(crate) fn end(&self, id: BatchId, r: &Result<()>) {
        let mut table = self.lock();
        let (meter, gone) = if matches!(r, Err(TransferError::Timeout(_))) {
            (table.get_mut(&id.0).and_then(|e| e.meter.take()), None)
        } else {
            match table.remove(&id.0) {
                Some(mut e) => (e.meter.take(), Some(e.state)),
                None => (None, None),
            }
        };
        drop(table);
        if let Some(state) = gone {
            state.cancel();
        }
        if let Some(m) = meter {
            m.record(r);
        }
    }

    /// Forgets batch `id` unrecorded and cancels it: its slices not yet sent are skipped.
    pub(crate) fn free(&self, id: BatchId) {
        let b = self.lock().remove(&id.0);
        if let Some(b) = b {
            b.state.cancel();
        }
    }
}

/// The local covers `(addr, len, region)` of every request's local range, in order.
/// Errors: `InvalidArgument` for a request of length 0; `NotRegistered` for one some byte of
/// which no registered region holds.
pub(crate) fn local_covers(
    registry: &MemoryRegistry,
    requests: &[TransferRequest],
) -> Result<Covers<MemoryRegion>> {
    if let Some(r) = requests.iter().find(|r| r.len == 0) {
        return Err(ArgumentError::ZeroLengthRequest {
            local_addr: r.local_addr,
        }
        .into());
    }
    registry
        .cover_regions(requests.iter().map(|r| (r.local_addr, r.len)))
        .map_err(|i| TransferError::NotRegistered {
            addr: requests[i].local_addr,
            len: requests[i].len,
        })
}

/// The slices of `requests` (ids 0..n in request order), given each request's local and
/// remote covers (`local_covers`, `SegmentDescriptor::remote_covers`). `slice_size(local
/// region, remote buffer)` is the slice size of a run between those two (> 0; the transport's
/// choice, `Transport::slice_size`); it is asked once per pair of one submit.
/// Errors: `InvalidArgument` when the batch would have more than `u32::MAX` slices.
pub(crate) fn slice_requests<L, R>(
    requests: &[TransferRequest],
    local: &[L],
    remote: &[R],
    mut slice_size: impl FnMut(&MemoryRegion, usize) -> u64,
) -> Result<Slices>
where
    L: AsRef<[(u64, u64, MemoryRegion)]>,
    R: AsRef<[(u64, u64, usize)]>,
{
    let mut slices = Slices::with_capacity(requests.len());
    // Submits name few pairs of regions: the last answer is almost always the one wanted.
    let mut sizes: smallvec::SmallVec<[(u64, usize, u64); 2]> = smallvec::SmallVec::new();
    let mut size_of = |region: &MemoryRegion, buffer: usize| -> u64 {
        if let Some(&(_, _, s)) = sizes
            .iter()
            .rev()
            .find(|(a, b, _)| *a == region.addr && *b == buffer)
        {
            return s;
        }
        let s = slice_size(region, buffer).max(1);
        sizes.push((region.addr, buffer, s));
        s
    };
    for ((r, l), rc) in requests.iter().zip(local).zip(remote) {
        let (l, rc) = (l.as_ref(), rc.as_ref());
        let est = (l.len() + rc.len()) as u64;
        if slices.len() as u64 + est > u32::MAX as u64 {
            return Err(too_many_slices());
        }
        cut_request(r, l, rc, &mut size_of, &mut slices)?;
    }
    Ok(slices)
}

/// Cuts `[0, len)` of one request at every boundary of either side, then each run into slices
/// of its `slice_size` (a tail of at most `slice_size/4` merged into the previous slice).
/// `local`/`remote` are the covers `(addr, len, item)` of the two sides, in order.
fn cut_request(
    req: &TransferRequest,
    local: &[(u64, u64, MemoryRegion)],
    remote: &[(u64, u64, usize)],
    slice_size: &mut impl FnMut(&MemoryRegion, usize) -> u64,
    out: &mut Slices,
) -> Result<()> {
    let (mut li, mut ri) = (0usize, 0usize);
    let (mut lo, mut ro) = (0u64, 0u64); // offsets consumed within the current pieces
    let mut off = 0u64;
    while off < req.len {
        let (_, llen, region) = local[li];
        let (_, rlen, buffer) = remote[ri];
        let size = slice_size(&region, buffer);
        let chunk = (llen - lo).min(rlen - ro);
        if chunk <= size {
            // One slice (the common case of small requests): no division.
            if out.len() as u64 + 1 > u32::MAX as u64 {
                return Err(too_many_slices());
            }
            out.push(Slice {
                id: out.len() as u32,
                op: req.op,
                local_addr: req.local_addr + off,
                local_region: region,
                remote_addr: req.remote_addr + off,
                remote_buffer: buffer,
                len: chunk,
            });
        } else {
            cut_run(req, off, chunk, size, region, buffer, out)?;
        }
        off += chunk;
        lo += chunk;
        ro += chunk;
        if lo == llen {
            li += 1;
            lo = 0;
        }
        if ro == rlen {
            ri += 1;
            ro = 0;
        }
    }
    Ok(())
}

/// Cuts a run of `chunk` bytes at offset `off` of `req`, between `region` and the peer's
/// `buffer`, into slices of `size` (a tail of at most `size/4` merged into the last one).
fn cut_run(
    req: &TransferRequest,
    off: u64,
    chunk: u64,
    size: u64,
    region: MemoryRegion,
    buffer: usize,
    out: &mut Slices,
) -> Result<()> {
    let mut at = 0u64;
    let full = chunk / size;
    let rem = chunk % size;
    let merge_tail = full >= 1 && rem > 0 && rem <= size / 4;
    if out.len() as u64 + full + 1 > u32::MAX as u64 {
        return Err(too_many_slices());
    }
    while at < chunk {
        let mut n = (chunk - at).min(size);
        if merge_tail && chunk - at == size + rem {
            n = size + rem;
        }
        out.push(Slice {
            id: out.len() as u32,
            op: req.op,
            local_addr: req.local_addr + off + at,
            local_region: region,
            remote_addr: req.remote_addr + off + at,
            remote_buffer: buffer,
            len: n,
        });
        at += n;
    }
    Ok(())
}

/// A batch's slices (inline for one: a contiguous request on a device-copy route is one).
pub(crate) type Slices = smallvec::SmallVec<[Slice; 1]>;

/// A batch of more slices than its `u32` slice ids can count.
fn too_many_slices() -> TransferError {
    ArgumentError::TooManySlices {
        limit: u64::from(u32::MAX),
    }
    .into()
}

/// The start addresses of the local regions `slices` use, each run of slices sharing a region
/// adding its region once (slices of one region are adjacent, as `slice_requests` cuts them).
pub(crate) fn region_starts(slices: &[Slice]) -> smallvec::SmallVec<[u64; 2]> {
    let mut starts: smallvec::SmallVec<[u64; 2]> = smallvec::SmallVec::new();
    for s in slices {
        if starts.last() != Some(&s.local_region.addr) {
            starts.push(s.local_region.addr);
        }
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{BatchStatus, Location, Op};

    fn region(addr: u64, len: u64) -> MemoryRegion {
        MemoryRegion {
            addr,
            len,
            location: Location::Cpu,
        }
    }

    #[test]
    fn cut_respects_both_sides_boundaries_and_merges_small_tails() {
        let req = TransferRequest {
            op: Op::Write,
            local_addr: 1000,
            remote_addr: 5000,
            len: 300,
        };
        // local: two regions split at offset 100; remote: split at offset 250
        let local = [
            (1000, 100, region(900, 200)),
            (1100, 200, region(1100, 200)),
        ];
        let remote = [(5000, 250, 0usize), (5250, 50, 1usize)];
        let mut out = Slices::new();
        cut_request(&req, &local, &remote, &mut |_, _| 64, &mut out).unwrap();
        let spans: Vec<(u64, u64)> = out.iter().map(|s| (s.local_addr - 1000, s.len)).collect();
        // chunk [0,100): 64 + 36 (36 > 16, not merged); [100,250): 64+64+22; [250,300): 50
        assert_eq!(
            spans,
            vec![
                (0, 64),
                (64, 36),
                (100, 64),
                (164, 64),
                (228, 22),
                (250, 50)
            ]
        );
        assert!(out.iter().enumerate().all(|(i, s)| s.id as usize == i));
        assert_eq!(out[5].remote_buffer, 1);
        assert_eq!(out[2].local_region.addr, 1100);
        // a tail of at most slice/4 merges into the previous slice
        let req = TransferRequest {
            len: 64 * 3 + 16,
            ..req
        };
        let mut out = Slices::new();
        cut_request(
            &req,
            &[(1000, req.len, region(1000, 1000))],
            &[(5000, req.len, 0)],
            &mut |_, _| 64,
            &mut out,
        )
        .unwrap();
        assert_eq!(
            out.iter().map(|s| s.len).collect::<Vec<_>>(),
            vec![64, 64, 80]
        );
        assert_eq!(out.iter().map(|s| s.len).sum::<u64>(), req.len);
    }

    #[test]
    fn each_pair_of_regions_gets_the_transports_slice_size() {
        // Region A (local 0..1000) pairs with buffer 0 at 64-byte slices; region B (local
        // 1000..2000) with buffer 1 in whole runs (a device-copy transport's choice).
        let req = TransferRequest {
            op: Op::Write,
            local_addr: 0,
            remote_addr: 10_000,
            len: 2000,
        };
        let local = [vec![
            (0, 1000, region(0, 1000)),
            (1000, 1000, region(1000, 1000)),
        ]];
        let remote = [vec![(10_000, 1000, 0usize), (11_000, 1000, 1usize)]];
        let mut asked = Vec::new();
        let s = slice_requests(
            &[req, req],
            &[local[0].clone(), local[0].clone()],
            &[remote[0].clone(), remote[0].clone()],
            |r, b| {
                asked.push((r.addr, b));
                if b == 1 {
                    u64::MAX
                } else {
                    64
                }
            },
        )
        .unwrap();
        let per_request: Vec<u64> = s.iter().take(s.len() / 2).map(|s| s.len).collect();
        // Region A: 15 slices of 64 and a tail of 40 (over a quarter: not merged).
        assert_eq!(per_request.len(), 15 + 1 + 1, "{per_request:?}");
        assert_eq!(per_request[15], 40);
        assert_eq!(
            *per_request.last().unwrap(),
            1000,
            "region B's run is one slice"
        );
        assert_eq!(s.iter().map(|s| s.len).sum::<u64>(), 4000);
        assert_eq!(asked, vec![(0, 0), (1000, 1)], "asked once per pair");
    }

    #[test]
    fn slices_of_several_requests_are_numbered_in_request_order() {
        let req = |local_addr, len| TransferRequest {
            op: Op::Read,
            local_addr,
            remote_addr: local_addr + 10_000,
            len,
        };
        let reqs = [req(0, 100), req(500, 30)];
        let local = vec![
            vec![(0, 100, region(0, 1000))],
            vec![(500, 30, region(0, 1000))],
        ];
        let remote = vec![vec![(10_000, 100, 0)], vec![(10_500, 30, 0)]];
        let s = slice_requests(&reqs, &local, &remote, |_, _| 64).unwrap();
        let got: Vec<(u32, u64, u64)> = s.iter().map(|s| (s.id, s.local_addr, s.len)).collect();
        assert_eq!(got, vec![(0, 0, 64), (1, 64, 36), (2, 500, 30)]);
        assert!(s.iter().all(|s| s.op == Op::Read));
    }

    #[test]
    fn zero_length_and_unregistered_requests_are_refused() {
        let reg = MemoryRegistry::new();
        reg.insert(region(1000, 100), |_| Ok(Default::default()))
            .unwrap();
        let req = |local_addr, len| TransferRequest {
            op: Op::Write,
            local_addr,
            remote_addr: 0,
            len,
        };
        assert!(matches!(
            local_covers(&reg, &[req(1000, 0)]),
            Err(TransferError::InvalidArgument(_))
        ));
        assert!(matches!(
            local_covers(&reg, &[req(1050, 100)]),
            Err(TransferError::NotRegistered { .. })
        ));
        assert_eq!(local_covers(&reg, &[req(1050, 50)]).unwrap()[0].len(), 1);
    }

    #[test]
    fn a_freed_batch_is_unknown_and_ids_are_never_reused() {
        let t = BatchTable::new();
        let (a, _) = t.start(0, meter());
        let (b, sb) = t.start(3, meter());
        assert_ne!(a, b);
        assert_eq!(t.get(b).unwrap().status(), sb.status());
        assert_eq!(sb.status(), BatchStatus::Waiting);
        t.free(b);
        assert!(matches!(t.get(b), Err(TransferError::UnknownBatch(_))));
        let (c, _) = t.start(1, meter());
        assert!(c.0 > b.0);
    }

    fn meter() -> BatchMeter {
        crate::batch_meter::SeriesCache::default().start_with(
            std::time::Instant::now(),
            "tcp",
            "batch-table-test:1",
            Op::Write,
            1,
            1,
        )
    }

    #[test]
    fn a_batch_ends_once_and_one_that_timed_out_stays() {
        let t = BatchTable::new();
        let (a, sa) = t.start(1, meter());
        t.end(a, &Err(TransferError::Timeout(std::time::Duration::ZERO)));
        assert!(t.lock().get(&a.0).is_some_and(|e| e.meter.is_none()));
        assert!(
            !sa.is_cancelled(),
            "a timed-out batch stays, uncancelled by its end"
        );
        let (b, sb) = t.start(1, meter());
        t.end(b, &Ok(()));
        assert!(matches!(t.get(b), Err(TransferError::UnknownBatch(_))));
        assert!(sb.is_cancelled());
    }
}
