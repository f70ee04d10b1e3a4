//! The parts of a load's checksums on the CPU backend: however the layers are cut (one part
//! per layer, a few, none, past the part cap), the records equal the whole-request checksum
//! bit for bit; bogus progress drops the parts, so layers whose bytes changed after a false
//! "landed" are checksummed as they are at the FINISH.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_checksum::group::{LayerSpec, RankInfo, ReplicaKey};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_kernels::{
    ChecksumBackend, CpuBackend, GroupJob, GroupResult, KernelError, LayerInput, Location, Pending,
    PendingChecksums,
};
use kvferry_transfer::{EngineConfig, TransferEngine, TransportKind};

use super::verify_parts::{Parts, Selector, MAX_PARTS};
use crate::checksum::all_records;
use crate::proto::msg::LayerSpan;
use crate::proto::progress::{ProgressError, Slot};
use crate::proto::request::{LoadGroup, LoadSpec};
use crate::shell::connection::LoadProgress;
use crate::worker::{Worker, WorkerGroup};

const LAYERS: usize = 20;
const BLOCKS: u64 = 6;

/// One CPU rank of `LAYERS` layers of seeded bytes (the buffers are returned to keep them).
fn rank() -> (Worker, Vec<Box<[u8]>>) {
    let engine = TransferEngine::new(EngineConfig {
        host: "127.0.0.1".into(),
        port: 0,
        transport: TransportKind::Tcp,
        ..EngineConfig::default()
    })
    .unwrap();
    let layout = Layout::parse("KV B N H D").unwrap();
    let g = Geometry::contiguous(layout, BLOCKS, 16, 2, 8, ElemBytes::Two, 1).unwrap();
    let mut bufs = Vec::new();
    let mut layers = Vec::new();
    for l in 0..LAYERS {
        let mut z = l as u64 + 1;
        let buf: Box<[u8]> = (0..g.byte_len())
            .map(|_| {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (z >> 33) as u8
            })
            .collect();
        layers.push(LayerInput {
            spec: LayerSpec {
                name: format!("model.layers.{l}.attn"),
                layer: l as u32,
                head_offset: 0,
                geometry: g.clone(),
                kind: Some("FullAttentionSpec".into()),
                dtype: Some("torch.bfloat16".into()),
                replica: ReplicaKey::NONE,
            },
            addr: buf.as_ptr() as u64,
            len: buf.len() as u64,
        });
        bufs.push(buf);
    }
    let worker = Worker {
        rank: RankInfo::SINGLE,
        engine,
        device: Location::Cpu,
        groups: vec![WorkerGroup {
            group_id: 0,
            block_size: 16,
            layers,
            sliding_window: None,
            skipped: None,
        }],
        backend: Arc::new(CpuBackend::new(2)),
    };
    (worker, bufs)
}

fn spec() -> LoadSpec {
    LoadSpec {
        request_id: "r".into(),
        producer: "tcp://127.0.0.1:1".into(),
        groups: vec![LoadGroup {
            group_id: 0,
            remote_blocks: vec![Some(0), Some(1), Some(2)],
            local_blocks: vec![Some(4), Some(1), Some(3)],
            remote_block_size: None,
        }],
        num_local_computed: 0,
        num_tokens: 40,
        load_key: None,
    }
}

fn parts(workers: &Arc<Vec<Worker>>) -> Parts {
    let slots = (0..LAYERS)
        .map(|layer| Slot {
            rank: 0,
            group_id: 0,
            layer,
        })
        .collect();
    let select = Arc::new(Selector::new(&spec()));
    Parts::new(workers.clone(), select, slots, Duration::from_secs(10))
}

fn landed(first: u32, end: u32) -> LoadProgress {
    LoadProgress::Landed(LayerSpan { first, end })
}

/// The whole-request records of `workers` now.
async fn whole(workers: &Arc<Vec<Worker>>) -> Vec<kvferry_checksum::record::WorkerRecord> {
    let selector = Selector::new(&spec());
    let select = |g: &WorkerGroup| selector.select(g);
    let (records, missing) = all_records(workers, &select, 40, Duration::from_secs(10), None).await;
    assert!(missing.is_empty(), "{missing:?}");
    records
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_add_up_to_the_whole_request_checksum_for_any_cut() {
    let (w, _bufs) = rank();
    let workers = Arc::new(vec![w]);
    let want = whole(&workers).await;
    let n = LAYERS as u32;
    let cuts: Vec<Vec<(u32, u32)>> = vec![
        vec![],
        vec![(0, n)],
        vec![(0, 5)],
        vec![(0, 5), (5, 10), (10, 15)],
        vec![(0, 1), (1, 19)],
        (0..n).map(|i| (i, i + 1)).collect(), // past the part cap
    ];
    for cut in cuts {
        let mut p = parts(&workers);
        for &(a, b) in &cut {
            p.progress(landed(a, b));
        }
        // Past the cap, the layers of the later spans wait for the FINISH.
        let covered = cut[..cut.len().min(MAX_PARTS)].last().map_or(0, |c| c.1);
        assert_eq!(p.covered(), covered, "{cut:?}");
        let f = p.finish().await;
        assert!(f.missing.is_empty(), "{:?}", f.missing);
        assert_eq!(f.records, want, "{cut:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bogus_progress_drops_the_parts() {
    let bogus = [
        vec![landed(0, 4), landed(2, 6)],
        vec![landed(0, 4), landed(5, 6)],
        vec![landed(0, 4), landed(4, 4)],
        vec![landed(0, 4), landed(4, 21)],
        vec![
            landed(0, 4),
            LoadProgress::Void(ProgressError::Empty { first: 4, end: 4 }),
        ],
    ];
    for steps in bogus {
        let (w, mut bufs) = rank();
        let workers = Arc::new(vec![w]);
        let mut p = parts(&workers);
        p.progress(steps[0]);
        // The part checksums layers 0-3 as they are now ...
        tokio::time::sleep(Duration::from_millis(50)).await;
        // ... but the bytes of layer 1 had not landed: they change before the FINISH.
        bufs[1][5] ^= 0x40;
        for s in &steps[1..] {
            p.progress(*s);
        }
        assert_eq!(p.covered(), 0, "{steps:?}");
        // Later progress is not taken either.
        p.progress(landed(0, 2));
        assert_eq!(p.covered(), 0, "{steps:?}");
        let records = p.finish().await.records;
        assert_eq!(records, whole(&workers).await, "{steps:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_heard_after_the_finish_goes_with_the_rest() {
    let (w, _bufs) = rank();
    let workers = Arc::new(vec![w]);
    let want = whole(&workers).await;
    let mut p = parts(&workers);
    p.progress(landed(0, 5));
    p.late(landed(5, 10));
    p.late(landed(10, 15));
    // No part was started for the late spans: their layers are checksummed with the rest.
    assert_eq!((p.started(), p.covered()), (1, 5));
    let f = p.finish().await;
    assert!(f.missing.is_empty(), "{:?}", f.missing);
    assert_eq!(f.rest_layers, LAYERS - 5);
    assert_eq!(f.records, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bogus_progress_heard_after_the_finish_drops_the_parts() {
    let bogus = [
        vec![landed(6, 8)],
        vec![landed(4, 8), landed(4, 8)],
        vec![landed(4, 21)],
        vec![LoadProgress::Void(ProgressError::Empty {
            first: 4,
            end: 4,
        })],
    ];
    for late in bogus {
        let (w, mut bufs) = rank();
        let workers = Arc::new(vec![w]);
        let mut p = parts(&workers);
        p.progress(landed(0, 4));
        // The part checksums layers 0-3 as they are now ...
        tokio::time::sleep(Duration::from_millis(50)).await;
        // ... but the bytes of layer 1 had not landed: they change before the FINISH.
        bufs[1][5] ^= 0x40;
        for s in &late {
            p.late(*s);
        }
        assert_eq!(p.covered(), 0, "{late:?}");
        let f = p.finish().await;
        assert_eq!(f.rest_layers, LAYERS, "{late:?}");
        assert_eq!(f.records, whole(&workers).await, "{late:?}");
    }
}

/// Counts submissions; the first one's results are held back until a second submission came
/// (or a few seconds passed), and it records whether one did.
struct Gated {
    inner: CpuBackend,
    submits: Arc<AtomicUsize>,
    rest_while_part_ran: Arc<AtomicBool>,
}

struct GatedPending {
    inner: Option<PendingChecksums>,
    first: bool,
    submits: Arc<AtomicUsize>,
    rest_while_part_ran: Arc<AtomicBool>,
}

impl Pending for GatedPending {
    fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>> {
        if self.first && self.submits.load(Ordering::SeqCst) < 2 {
            return None;
        }
        self.inner.as_mut()?.poll()
    }
    fn wait(&mut self, timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        if self.first {
            let until = Instant::now() + Duration::from_secs(3);
            while self.submits.load(Ordering::SeqCst) < 2 && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.rest_while_part_ran
                .store(self.submits.load(Ordering::SeqCst) >= 2, Ordering::SeqCst);
        }
        match self.inner.take() {
            Some(p) => p.wait(timeout),
            None => Err(KernelError::Lost),
        }
    }
}

impl ChecksumBackend for Gated {
    fn name(&self) -> &'static str {
        "gated"
    }
    unsafe fn submit(&self, jobs: Vec<GroupJob>) -> Result<PendingChecksums, KernelError> {
        let n = self.submits.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded from this function's contract.
        let inner = unsafe { self.inner.submit(jobs) }?;
        Ok(PendingChecksums::new(Box::new(GatedPending {
            inner: Some(inner),
            first: n == 0,
            submits: self.submits.clone(),
            rest_while_part_ran: self.rest_while_part_ran.clone(),
        })))
    }
}

/// The rest is submitted before the parts are waited for: on a device its kernels queue
/// behind the parts' instead of waiting for their results to come back to the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rest_is_submitted_while_a_part_still_runs() {
    let (mut w, _bufs) = rank();
    // The same seeded bytes, checksummed whole on a rank of its own.
    let (twin, _twin_bufs) = rank();
    let want = whole(&Arc::new(vec![twin])).await;
    let (submits, seen) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    w.backend = Arc::new(Gated {
        inner: CpuBackend::new(2),
        submits: submits.clone(),
        rest_while_part_ran: seen.clone(),
    });
    let workers = Arc::new(vec![w]);
    let mut p = parts(&workers);
    p.progress(landed(0, 5));
    let f = p.finish().await;
    assert!(f.missing.is_empty(), "{:?}", f.missing);
    assert_eq!(f.records, want);
    assert_eq!(submits.load(Ordering::SeqCst), 2);
    assert!(seen.load(Ordering::SeqCst), "the rest waited for the part");
}

/// A "device" backend for tests: runs the jobs on the CPU backend (as host jobs) and counts
/// how often their results are polled.
struct Polled {
    inner: CpuBackend,
    polls: Arc<AtomicUsize>,
}

struct PolledPending {
    inner: PendingChecksums,
    polls: Arc<AtomicUsize>,
}

impl Pending for PolledPending {
    fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>> {
        self.polls.fetch_add(1, Ordering::SeqCst);
        self.inner.poll()
    }
    fn wait(&mut self, _timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        Err(KernelError::Lost)
    }
}

impl ChecksumBackend for Polled {
    fn name(&self) -> &'static str {
        "polled"
    }
    unsafe fn submit(&self, mut jobs: Vec<GroupJob>) -> Result<PendingChecksums, KernelError> {
        for j in &mut jobs {
            j.device = Location::Cpu;
        }
        // SAFETY: forwarded from this function's contract (the memory is host memory).
        let inner = unsafe { self.inner.submit(jobs) }?;
        Ok(PendingChecksums::new(Box::new(PolledPending {
            inner,
            polls: self.polls.clone(),
        })))
    }
}

/// On a device, a part is submitted when its layers land and polled only after the FINISH: no
/// task spins on it while the copies run (each poll takes the driver's locks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_part_is_polled_only_after_the_finish() {
    let (mut w, _bufs) = rank();
    let (twin, _twin_bufs) = rank();
    let want = whole(&Arc::new(vec![twin])).await;
    let polls = Arc::new(AtomicUsize::new(0));
    w.device = Location::Cuda(0);
    w.backend = Arc::new(Polled {
        inner: CpuBackend::new(2),
        polls: polls.clone(),
    });
    let workers = Arc::new(vec![w]);
    let mut p = parts(&workers);
    p.progress(landed(0, 5));
    p.progress(landed(5, 12));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        polls.load(Ordering::SeqCst),
        0,
        "a part was polled before the FINISH"
    );
    let f = p.finish().await;
    assert!(f.missing.is_empty(), "{:?}", f.missing);
    assert_eq!(f.records, want);
    assert!(polls.load(Ordering::SeqCst) > 0);
}

/// A span queued on host memory voids the parts: a host checksum started then would read the
/// layers before their copies end (only device work can be ordered after the copies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_span_queued_on_host_memory_voids_the_parts() {
    let (w, _bufs) = rank();
    let workers = Arc::new(vec![w]);
    let want = whole(&workers).await;
    let mut p = parts(&workers);
    p.queued(LayerSpan { first: 0, end: 4 }, &[Some(Vec::new())]);
    assert_eq!((p.started(), p.covered()), (0, 0));
    p.progress(landed(0, 4));
    assert_eq!(p.covered(), 0, "void parts take nothing later");
    assert_eq!(p.finish().await.records, want);
}

/// Counts the submissions ordered after device points and the unordered ones.
struct Ordered {
    inner: CpuBackend,
    after_points: Arc<AtomicUsize>,
    unordered: Arc<AtomicUsize>,
}

impl ChecksumBackend for Ordered {
    fn name(&self) -> &'static str {
        "ordered"
    }
    unsafe fn submit(&self, mut jobs: Vec<GroupJob>) -> Result<PendingChecksums, KernelError> {
        self.unordered.fetch_add(1, Ordering::SeqCst);
        for j in &mut jobs {
            j.device = Location::Cpu;
        }
        // SAFETY: forwarded from this function's contract (the memory is host memory).
        unsafe { self.inner.submit(jobs) }
    }
    unsafe fn submit_after_events(
        &self,
        mut jobs: Vec<GroupJob>,
        _events: &[&kvferry_kernels::cuda::driver::Event],
    ) -> Result<PendingChecksums, KernelError> {
        self.after_points.fetch_add(1, Ordering::SeqCst);
        for j in &mut jobs {
            j.device = Location::Cpu;
        }
        // SAFETY: forwarded from this function's contract (the memory is host memory).
        unsafe { self.inner.submit(jobs) }
    }
}

/// A device rank on the [`Ordered`] backend, its counters, and the records of the whole
/// request on a twin of its bytes.
struct OrderedRank {
    workers: Arc<Vec<Worker>>,
    want: Vec<kvferry_checksum::record::WorkerRecord>,
    after_points: Arc<AtomicUsize>,
    unordered: Arc<AtomicUsize>,
    _bufs: Vec<Box<[u8]>>,
}

impl OrderedRank {
    async fn new() -> OrderedRank {
        let (mut w, bufs) = rank();
        let (twin, _twin_bufs) = rank();
        let want = whole(&Arc::new(vec![twin])).await;
        let (after_points, unordered) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        w.device = Location::Cuda(0);
        w.backend = Arc::new(Ordered {
            inner: CpuBackend::new(2),
            after_points: after_points.clone(),
            unordered: unordered.clone(),
        });
        OrderedRank {
            workers: Arc::new(vec![w]),
            want,
            after_points,
            unordered,
            _bufs: bufs,
        }
    }
}

/// On a device, a queued span's checksums are submitted ordered after the worker's points,
/// a landed span's unordered; the parts add up to the whole-request checksum as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_span_is_checksummed_after_its_points() {
    let o = OrderedRank::new().await;
    let (workers, want) = (&o.workers, &o.want);
    let (after_points, unordered) = (&o.after_points, &o.unordered);
    let mut p = parts(workers);
    p.queued(LayerSpan { first: 0, end: 5 }, &[Some(Vec::new())]);
    p.queued(LayerSpan { first: 5, end: 9 }, &[Some(Vec::new())]);
    p.progress(landed(9, 12));
    assert_eq!((p.started(), p.covered()), (3, 12));
    assert_eq!(after_points.load(Ordering::SeqCst), 2);
    assert_eq!(unordered.load(Ordering::SeqCst), 1);
    let f = p.finish().await;
    assert!(f.missing.is_empty(), "{:?}", f.missing);
    assert_eq!(&f.records, want);
}

/// A queued span with layers to checksum on a worker whose engine submitted none of its copies
/// (no points: another worker's engine may be writing its memory) voids the parts: nothing
/// of it is checksummed before the FINISH, and the records still equal the whole request's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_span_without_a_workers_points_voids_the_parts() {
    let o = OrderedRank::new().await;
    let (workers, want) = (&o.workers, &o.want);
    let after_points = &o.after_points;
    for points in [&[None][..], &[]] {
        let mut p = parts(workers);
        p.queued(LayerSpan { first: 0, end: 5 }, points);
        assert_eq!((p.started(), p.covered()), (0, 0), "{} lists", points.len());
        let f = p.finish().await;
        assert_eq!(&f.records, want);
    }
    assert_eq!(
        after_points.load(Ordering::SeqCst),
        0,
        "no part was started"
    );
}

/// A verdict is worked out before the reads' task ends only when every layer is a part's:
/// never while a layer is still to land, nor after bogus progress (the rest would read
/// layers that may not have landed), nor for a load of no layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_are_complete_only_when_they_cover_every_layer() {
    let (w, _bufs) = rank();
    let workers = Arc::new(vec![w]);
    let n = LAYERS as u32;
    let mut p = parts(&workers);
    assert!(!p.complete());
    p.progress(landed(0, n - 1));
    assert!(!p.complete(), "one layer still to land");
    p.progress(landed(n - 1, n));
    assert!(p.complete());
    // Bogus progress after: void, so not complete.
    p.progress(landed(0, 1));
    assert!(!p.complete());
    // Past the parts' cap, later layers go with the rest: not complete.
    let mut p = parts(&workers);
    for l in 0..n {
        p.progress(landed(l, l + 1));
    }
    assert_eq!(p.complete(), n as usize <= MAX_PARTS);
    let none = Parts::new(
        workers.clone(),
        Arc::new(Selector::new(&spec())),
        Vec::new(),
        Duration::from_secs(10),
    );
    assert!(!none.complete());
}

/// A one-pass read's results (one part over every layer, `Parts::copied`) are the records as
/// they are, each layer counted once, nothing checksummed again; results that cannot be the
/// load's (another worker count) or that come after parts started void them, and every layer
/// is checksummed from memory instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copied_results_are_the_whole_load_counted_once() {
    let (w, mut bufs) = rank();
    let workers = Arc::new(vec![w]);
    let want = whole(&workers).await;
    let mut p = parts(&workers);
    let jobs = p.whole_jobs();
    assert_eq!(jobs[0][0].layers.len(), LAYERS);
    // SAFETY: the jobs' layers are `bufs`, alive until the wait below.
    let results = unsafe { workers[0].backend.submit(jobs[0].clone()) }
        .unwrap()
        .wait(Duration::from_secs(10))
        .unwrap();
    p.copied(vec![results.clone()]);
    assert_eq!(p.covered(), LAYERS as u32);
    assert!(p.complete());
    // A byte changed after the kernel is not seen: nothing is read again.
    bufs[3][519] ^= 1;
    let f = p.finish().await;
    assert!(f.missing.is_empty(), "{:?}", f.missing);
    assert_eq!(f.records, want, "the copied results, counted once");
    bufs[3][519] ^= 1;

    // Results for another number of workers: void, checksummed from memory.
    let mut p = parts(&workers);
    p.copied(vec![results.clone(), results.clone()]);
    assert_eq!(p.covered(), 0);
    bufs[3][519] ^= 1;
    let changed = whole(&workers).await;
    assert_ne!(changed, want);
    assert_eq!(p.finish().await.records, changed);
    bufs[3][519] ^= 1;

    // Results of a group the load did not ask for: not taken as the record (that worker
    // reports none, as when a part's results name another group).
    let mut p = parts(&workers);
    let mut other = results.clone();
    other[0].group_id = 9;
    p.copied(vec![other]);
    let f = p.finish().await;
    assert!(f.records.is_empty());
    assert_eq!(f.missing.len(), 1, "{:?}", f.missing);

    // After a part started: void as well.
    let mut p = parts(&workers);
    p.progress(landed(0, 5));
    p.copied(vec![results]);
    assert_eq!(p.covered(), 0);
    assert_eq!(p.finish().await.records, want);
}

/// A one-pass launch planned ahead takes each load's selections instead of its jobs: the same
/// groups, in the same order, with the same blocks, whatever groups a worker skips or the load
/// does not name.
#[test]
fn selections_are_the_whole_jobs_without_their_layers() {
    let (mut w, _bufs) = rank();
    let first = w.groups[0].clone();
    w.groups.insert(
        0,
        WorkerGroup {
            group_id: 5,
            skipped: Some(kvferry_checksum::group::SkipReason::Compressed),
            ..first.clone()
        },
    );
    // Not named by the load: nothing selected.
    w.groups.push(WorkerGroup {
        group_id: 6,
        ..first
    });
    let workers = Arc::new(vec![w]);
    // The load names the skipped group too: it still has no job.
    let mut named = spec();
    named.groups.push(LoadGroup {
        group_id: 5,
        ..named.groups[0].clone()
    });
    let mut p = Parts::new(
        workers.clone(),
        Arc::new(Selector::new(&named)),
        Vec::new(),
        Duration::from_secs(10),
    );
    let jobs = p.whole_jobs();
    let want: Vec<Vec<(u32, kvferry_checksum::select::BlockSelection)>> = jobs
        .iter()
        .map(|js| {
            js.iter()
                .map(|j| (j.group_id, j.selection.clone()))
                .collect()
        })
        .collect();
    assert_eq!(want[0].len(), 1);
    assert_eq!(p.selections(), want);
    assert_eq!(p.num_tokens(), jobs[0][0].num_tokens);
}
