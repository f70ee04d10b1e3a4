//! The CUDA checksum backend (docs/design.md §5).
//!
//! * Kernels are CUDA C (`kernels/cuda/*.cu`), compiled at run time by NVRTC for the
//!   device's architecture; the driver and NVRTC are loaded dynamically (cudarc), and
//!   their absence is detected, never a panic ([`CudaBackend::new`] returns an error and
//!   `backend_for` falls back to the CPU backend).
//! * One launch per group checksums every layer of the group over its block list
//!   ([`view`] builds the table of layer views the kernel reads).
//! * Asynchrony: work runs on the backend's side streams, ordered after the caller's
//!   stream by an event when one is given ([`CudaBackend::submit_after`]); parameters go
//!   up and results come back through pinned host memory, and an event recorded after
//!   the copy back is polled ([`CudaPending::poll`]). Nothing synchronises the caller's
//!   stream and nothing blocks the host on the submit path.

/// The driver objects, from the one CUDA layer (kvferry-cuda).
pub use kvferry_cuda::driver;
pub mod load;
/// Helper kernels for the GPU tests and the benchmark (feature `test-tools`).
#[cfg(feature = "test-tools")]
pub mod tools;
pub mod view;

use crate::backend::{ChecksumBackend, Pending, PendingChecksums};
use crate::sync::MutexExt;
use crate::{CopyJob, GroupJob, GroupResult, JobFault, Keep, KernelError, Location};
use cudarc::driver::sys;
use driver::{Context, Event, EventState, Function, Module, Stream};
use kvferry_checksum::group::ReplicaKey;
use kvferry_cuda::staging::Staging;
use kvferry_cuda::CudaError;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use view::LaunchPlan;

/// Source of the checksum kernel (`kernels/cuda/checksum.cu`).
pub const CHECKSUM_SRC: &str = include_str!("../../cuda/checksum.cu");
/// Source of the test/benchmark helper kernels (`kernels/cuda/tools.cu`).
pub const TOOLS_SRC: &str = include_str!("../../cuda/tools.cu");

/// A raw CUDA stream handle of the caller (e.g. PyTorch's `torch.cuda.current_stream().cuda_stream`
/// cast to a pointer). The null handle is the legacy default stream.
pub type RawStream = sys::CUstream;

const THREADS: u32 = 256;

/// Which build of the checksum kernel a backend launches. All compute the same values;
/// they differ in loads in flight per thread on the regular path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelVariant {
    /// Four 16-byte loads in flight per thread (`kvf_checksum`).
    Unroll4,
    /// Eight 16-byte loads in flight per thread (`kvf_checksum_u8`).
    Unroll8,
    /// Per launch: `Unroll4` when no thread has more than four chunks per tile, else
    /// `Unroll8` (an unroll past a thread's chunks only adds predicated-off loads).
    Auto,
}

impl KernelVariant {
    /// Every variant (for tests and the benchmark).
    pub const ALL: [KernelVariant; 3] = [
        KernelVariant::Auto,
        KernelVariant::Unroll4,
        KernelVariant::Unroll8,
    ];
    /// The default.
    pub const DEFAULT: KernelVariant = KernelVariant::Auto;
}

/// Chunks one thread reads per tile, at most, over the plan's vector-path layers.
fn chunks_per_thread(plan: &LaunchPlan) -> u32 {
    plan.views
        .iter()
        .filter(|v| v.mode != view::MODE_GENERIC)
        .map(|v| {
            let r = v.d * v.elem / if v.mode == view::MODE_VEC16 { 16 } else { 8 };
            (v.n_outer as u64 * v.n_inner as u64 * r as u64).div_ceil(THREADS as u64) as u32
        })
        .max()
        .unwrap_or(0)
}

fn kerr(e: CudaError) -> KernelError {
    KernelError::Cuda(e)
}

/// Why CUDA cannot be used here, or `None` when the driver and NVRTC load and at least
/// one device exists. Never panics.
pub fn unavailable_reason() -> Option<CudaError> {
    if !load::driver_library_present() {
        return Some(CudaError::DriverLibraryMissing);
    }
    if !load::nvrtc_library_present() {
        return Some(CudaError::NvrtcLibraryMissing);
    }
    match kvferry_cuda::cuda_available() {
        Ok(0) => Some(CudaError::NoSuchDevice {
            ordinal: 0,
            count: 0,
        }),
        Ok(_) => None,
        Err(e) => Some(e),
    }
}

/// Side streams of a backend unless `KVFERRY_CHECKSUM_STREAMS` says otherwise (1 to 16).
/// Two let one launch start while the one before drains its last tiles: with 16 loads in
/// flight on an H200 the demo's defaults went from 0.45-0.47 to 0.55-0.56 of the device copy
/// (4 streams: 0.52-0.54).
const SIDE_STREAMS: usize = 2;

/// The side streams a backend made now takes: [`SIDE_STREAMS`], or `KVFERRY_CHECKSUM_STREAMS`
/// when it holds a number from 1 to 16 (anything else is ignored).
fn side_stream_count() -> usize {
    side_stream_count_of(std::env::var("KVFERRY_CHECKSUM_STREAMS").ok().as_deref())
}

/// [`side_stream_count`] for the variable's value `v`.
fn side_stream_count_of(v: Option<&str>) -> usize {
    v.and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| (1..=16).contains(n))
        .unwrap_or(SIDE_STREAMS)
}

mod enqueue;
mod slots;
use slots::{Pool, Slot, PREALLOCATED_BYTES, PREALLOCATED_SLOTS};

// Field order is drop order: the context goes last.
struct Inner {
    /// The side streams the checksums run on, taken in turn: a launch does not wait for the
    /// previous one's last tiles, which a single stream would serialise.
    streams: Vec<Stream>,
    /// The stream of submissions ordered after a writer's events (`submit_after_events`): its
    /// waits hold back only work that waits too, never a checksum of bytes already in place
    /// queued behind them on a shared stream.
    ordered: Stream,
    /// The next of `streams` to take.
    next: AtomicUsize,
    _module: Module,
    /// `kvf_checksum` (unroll 4) and `kvf_checksum_u8`, with their grid caps.
    kernels: [(Function, u32); 2],
    /// `kvf_copy_checksum` (unroll 4) and `kvf_copy_checksum_u8`, with their grid caps.
    copy_kernels: [(Function, u32); 2],
    variant: KernelVariant,
    pool: Mutex<Pool>,
    timing: AtomicBool,
    ctx: Context,
}

/// The CUDA checksum backend for one device. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

struct PendingGroup {
    group_id: u32,
    start: u64,
    keys: Vec<ReplicaKey>,
    blocks: usize,
    out_off: usize,
}

/// Checksums submitted to a [`CudaBackend`] and not yet taken. Dropping it before it
/// completes is safe: its buffers are reused only after the device is done with them.
pub struct CudaPending {
    inner: Arc<Inner>,
    slot: Option<Slot>,
    groups: Vec<PendingGroup>,
    kernel_ms: Option<f32>,
}

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl CudaBackend {
    /// Opens device `ordinal`: loads the driver and NVRTC, retains the primary context,
    /// creates the side streams, allocates the slots ahead and compiles the kernel for the
    /// device's architecture.
    /// Errors (never panics) when any of that fails, e.g. on a machine without CUDA.
    pub fn new(ordinal: u32) -> Result<CudaBackend, KernelError> {
        CudaBackend::with_variant(ordinal, KernelVariant::DEFAULT)
    }

    /// [`CudaBackend::new`] launching kernel `variant`.
    pub fn with_variant(ordinal: u32, variant: KernelVariant) -> Result<CudaBackend, KernelError> {
        CudaBackend::build(ordinal, variant, PREALLOCATED_SLOTS)
    }

    /// [`CudaBackend::new`] with only `slots` slots allocated ahead, so that tests reach the
    /// allocations on the submit path and the slots retired behind dropped results.
    #[cfg(feature = "test-tools")]
    pub fn with_slots(ordinal: u32, slots: usize) -> Result<CudaBackend, KernelError> {
        CudaBackend::build(ordinal, KernelVariant::DEFAULT, slots)
    }

    fn build(
        ordinal: u32,
        variant: KernelVariant,
        ahead: usize,
    ) -> Result<CudaBackend, KernelError> {
        if let Some(why) = unavailable_reason() {
            return Err(kerr(why));
        }
        load::guarded("cuda backend", || {
            let ctx = Context::new(ordinal)?;
            let cc = ctx.compute_capability()?;
            let image = load::compile(CHECKSUM_SRC, "checksum.cu", cc)?;
            let module = Module::load(&ctx, &image)?;
            let sms = ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                .max(1) as u32;
            let k4 = module.function("kvf_checksum")?;
            let k8 = module.function("kvf_checksum_u8")?;
            let kernels = [
                (k4, sms * k4.occupancy(THREADS)?),
                (k8, sms * k8.occupancy(THREADS)?),
            ];
            let c4 = module.function("kvf_copy_checksum")?;
            let c8 = module.function("kvf_copy_checksum_u8")?;
            let copy_kernels = [
                (c4, sms * c4.occupancy(THREADS)?),
                (c8, sms * c8.occupancy(THREADS)?),
            ];
            let streams = (0..side_stream_count())
                .map(|_| Stream::new(&ctx))
                .collect::<Result<Vec<_>, _>>()?;
            let ordered = Stream::new(&ctx)?;
            let inner = Inner {
                ctx,
                streams,
                ordered,
                next: AtomicUsize::new(0),
                _module: module,
                kernels,
                copy_kernels,
                variant,
                pool: Mutex::new(Pool::default()),
                timing: AtomicBool::new(false),
            };
            // Allocate slots now: allocating pinned or device memory may synchronise the
            // device, which must not happen on the submit path.
            let slots = Staging::ahead(&inner.ctx, PREALLOCATED_BYTES, ahead)?
                .into_iter()
                .map(|mem| slots::slot_in(&inner.ctx, mem))
                .collect::<Result<Vec<_>, _>>()?;
            inner.pool.locked().free.extend(slots);
            Ok(CudaBackend {
                inner: Arc::new(inner),
            })
        })
        .map_err(kerr)
    }

    /// The process-wide backend of device `ordinal`, created on first use (compiling
    /// the kernel once). Errors as [`CudaBackend::new`]; a failure is remembered.
    pub fn shared(ordinal: u32) -> Result<CudaBackend, KernelError> {
        static ALL: OnceLock<Mutex<HashMap<u32, Result<CudaBackend, KernelError>>>> =
            OnceLock::new();
        let mut all = ALL.get_or_init(Default::default).locked();
        all.entry(ordinal)
            .or_insert_with(|| CudaBackend::new(ordinal))
            .clone()
    }

    /// The device's context (for allocating test data and the tools).
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The side streams the checksums run on (taken in turn by the submissions, and last the
    /// one of those ordered after a writer's events): waiting for every one of them covers
    /// every checksum queued so far.
    pub fn side_streams(&self) -> Vec<RawStream> {
        let all = self.inner.streams.iter().chain([&self.inner.ordered]);
        all.map(Stream::raw).collect()
    }

    /// Records device-side kernel time for each later submission ([`CudaPending::kernel_ms`]);
    /// for benchmarks.
    pub fn set_kernel_timing(&self, on: bool) {
        self.inner.timing.store(on, Ordering::Relaxed);
    }
}

impl CudaPending {
    /// The results if the device has finished (never blocks): `None` while running,
    /// `Some(Ok(results))` once, in job order; later calls give `Some(Err(..))`.
    pub fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>> {
        let Some(slot) = self.slot.as_ref() else {
            return Some(Err(KernelError::Taken));
        };
        if let Err(e) = self.inner.ctx.bind() {
            return Some(Err(kerr(e)));
        }
        match slot.done.query() {
            Ok(EventState::Pending) => None,
            Err(e) => {
                let slot = self.slot.take().expect("checked above");
                slots::retire(&self.inner.pool, slot);
                Some(Err(kerr(e)))
            }
            Ok(EventState::Done) => {
                let slot = self.slot.take().expect("checked above");
                if slot.timed {
                    self.kernel_ms = Event::elapsed_ms(&slot.kstart, &slot.kend).ok();
                }
                let host = slot.mem.host();
                let results = self
                    .groups
                    .iter()
                    .map(|g| {
                        let ns = g.keys.len();
                        let mut values = BTreeMap::new();
                        for (k, key) in g.keys.iter().enumerate() {
                            let v: Vec<u64> = (0..g.blocks)
                                // SAFETY: the event after the copy back has completed, so `host`
                                // (the slot's pinned buffer) holds `g.blocks * ns` u64 values
                                // from `g.out_off`, inside the slot's capacity (the plan sized
                                // it).
                                .map(|b| unsafe {
                                    std::ptr::read_unaligned(
                                        host.add(g.out_off + (b * ns + k) * 8) as *const u64
                                    )
                                })
                                .collect();
                            values.insert(*key, v);
                        }
                        GroupResult {
                            group_id: g.group_id,
                            start: g.start,
                            values,
                        }
                    })
                    .collect();
                slots::give_back(&self.inner.pool, slot);
                Some(Ok(results))
            }
        }
    }

    /// Waits up to `timeout` for the results (polling the completion event, yielding the
    /// thread between polls for the first 2 ms, then sleeping briefly between polls). Errors with [`KernelError::Timeout`] when the deadline passes.
    pub fn wait(mut self, timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        self.wait_mut(timeout)
    }

    /// [`CudaPending::wait`] without consuming the value (so [`CudaPending::kernel_ms`] can be read after).
    pub fn wait_mut(&mut self, timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        let start = Instant::now();
        let deadline = start + timeout;
        loop {
            if let Some(r) = self.poll() {
                return r;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(KernelError::Timeout(timeout));
            }
            // Yield for the first 2 ms (a load's kernels take a fraction of that), then sleep:
            // a 20 µs sleep costs 50-80 µs of timer slack, half a 512 MiB checksum.
            if now - start < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Makes `stream` wait (on the device) until these results are in host memory,
    /// without blocking the host. For callers that order later device work after the
    /// checksums, and for benchmarks.
    ///
    /// # Safety
    /// `stream` is a live stream of this device's primary context.
    pub unsafe fn order_before(&self, stream: RawStream) -> Result<(), KernelError> {
        match &self.slot {
            // SAFETY: `stream` is live in this context (this function's contract); the event is
            // the slot's, alive while this pending value is.
            Some(s) => unsafe { driver::stream_wait(stream, &s.done) }.map_err(kerr),
            None => Ok(()),
        }
    }

    /// Device time of the kernel launches in milliseconds, once the results were taken
    /// and only when kernel timing was on ([`CudaBackend::set_kernel_timing`]).
    pub fn kernel_ms(&self) -> Option<f32> {
        self.kernel_ms
    }
}

impl Drop for CudaPending {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            slots::retire(&self.inner.pool, slot);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // Buffers may still be in use by queued work: wait for the side streams before freeing.
        for s in self.streams.iter().chain([&self.ordered]) {
            let _ = s.synchronize();
        }
    }
}

impl Pending for CudaPending {
    fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>> {
        CudaPending::poll(self)
    }
    fn wait(&mut self, timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        self.wait_mut(timeout)
    }
}

impl ChecksumBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    /// [`CudaBackend::submit_after`] with no caller stream: the KV must already be in place
    /// as far as the host knows (landed by RDMA/TCP, or its writer's stream synchronised).
    /// Callers that write KV on a stream use `submit_after` with that stream.
    unsafe fn submit(&self, jobs: Vec<GroupJob>) -> Result<PendingChecksums, KernelError> {
        Ok(PendingChecksums::new(Box::new(
            // SAFETY: forwarded from `submit`'s contract; no caller stream.
            unsafe { self.submit_after(jobs, None) }?,
        )))
    }

    unsafe fn submit_after(
        &self,
        jobs: Vec<GroupJob>,
        after: u64,
    ) -> Result<PendingChecksums, KernelError> {
        Ok(PendingChecksums::new(Box::new(
            // SAFETY: forwarded from the trait's contract: `after` is a live stream or 0.
            unsafe { CudaBackend::submit_after(self, jobs, Some(after as RawStream)) }?,
        )))
    }

    unsafe fn submit_after_events(
        &self,
        jobs: Vec<GroupJob>,
        events: &[&Event],
    ) -> Result<PendingChecksums, KernelError> {
        Ok(PendingChecksums::new(Box::new(
            // SAFETY: forwarded from the trait's contract: recorded events of this device.
            unsafe { CudaBackend::submit_after_events(self, jobs, events) }?,
        )))
    }

    unsafe fn submit_copying(
        &self,
        jobs: Vec<CopyJob>,
        keep: Keep,
    ) -> Result<PendingChecksums, KernelError> {
        Ok(PendingChecksums::new(Box::new(
            // SAFETY: forwarded from the trait's contract.
            unsafe { CudaBackend::submit_copying(self, jobs, keep) }?,
        )))
    }

    unsafe fn submit_planned(
        &self,
        plans: crate::CopyPlans,
        keep: Keep,
    ) -> Result<PendingChecksums, KernelError> {
        Ok(PendingChecksums::new(Box::new(
            // SAFETY: forwarded from the trait's contract.
            unsafe { CudaBackend::submit_planned(self, plans, keep) }?,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::{side_stream_count_of, SIDE_STREAMS};

    /// The override takes 1 to 16 streams; anything else (none, 0, too many, not a number)
    /// leaves the default.
    #[test]
    fn side_streams_take_the_override_within_bounds_only() {
        assert_eq!(side_stream_count_of(None), SIDE_STREAMS);
        assert_eq!(side_stream_count_of(Some("1")), 1);
        assert_eq!(side_stream_count_of(Some(" 4 ")), 4);
        assert_eq!(side_stream_count_of(Some("16")), 16);
        for bad in ["0", "17", "-1", "two", "", "99999999999999999999"] {
            assert_eq!(side_stream_count_of(Some(bad)), SIDE_STREAMS, "{bad:?}");
        }
    }
}
