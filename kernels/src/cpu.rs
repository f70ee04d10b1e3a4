//! The CPU checksum backend: the fast additive form of kvferry-checksum (§2.1) over host memory,
//! layers spread over a few threads.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvferry_checksum::definition::layer_block_checksum;
use kvferry_checksum::group::ReplicaKey;

use crate::backend::{
    validate_job, Channel, ChecksumBackend, GroupJob, GroupResult, JobFault, KernelError, Location,
    Pending, PendingChecksums,
};

/// Checksums host-memory KV on `threads` threads (one job's layers are split between them).
#[derive(Debug, Clone)]
pub struct CpuBackend {
    /// Threads used per submission (at least 1).
    pub threads: usize,
    /// Test hook: the worker that reaches this layer index (of any job) panics.
    #[cfg(any(test, feature = "test-tools"))]
    panic_at_layer: Option<usize>,
    /// Test hook: the layers' worker threads ask for this stack size (bytes).
    #[cfg(any(test, feature = "test-tools"))]
    worker_stack: Option<usize>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
        )
    }
}

impl CpuBackend {
    /// A backend using `threads` threads (0 is taken as 1).
    pub fn new(threads: usize) -> CpuBackend {
        CpuBackend {
            threads: threads.max(1),
            #[cfg(any(test, feature = "test-tools"))]
            panic_at_layer: None,
            #[cfg(any(test, feature = "test-tools"))]
            worker_stack: None,
        }
    }

    /// Test hook (feature `test-tools`): the checksum worker that reaches layer index `layer`
    /// of a job panics, as a bug in the kernel would. The submission then ends in
    /// [`KernelError::WorkerPanicked`], never in values that miss the layer.
    #[cfg(any(test, feature = "test-tools"))]
    pub fn panicking_at_layer(mut self, layer: usize) -> CpuBackend {
        self.panic_at_layer = Some(layer);
        self
    }

    /// Test hook (feature `test-tools`): the threads a job's layers are spread over ask for a
    /// stack of `bytes`; one the OS cannot give (e.g. `1 << 60`) makes their start fail, as
    /// when it is out of threads. The submission then ends in [`KernelError::NoThread`].
    #[cfg(any(test, feature = "test-tools"))]
    pub fn with_worker_stack(mut self, bytes: usize) -> CpuBackend {
        self.worker_stack = Some(bytes);
        self
    }
}

/// What a submission's thread needs of the backend's settings (test hooks included).
#[derive(Debug, Clone, Copy)]
struct JobSettings {
    /// Threads a job's layers are spread over.
    threads: usize,
    /// Test hook: the layer index whose worker panics.
    panic_at: Option<usize>,
    /// Test hook: the layer workers' stack size.
    worker_stack: Option<usize>,
}

impl JobSettings {
    /// A thread for some of a job's layers.
    fn worker(&self) -> std::thread::Builder {
        let b = std::thread::Builder::new().name("kvferry-cpu-checksum-layers".into());
        match self.worker_stack {
            Some(bytes) => b.stack_size(bytes),
            None => b,
        }
    }
}

/// The text of a panic payload (`&str` or `String`; other payloads have none).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic payload".into())
}

/// One layer's values for every selected block.
///
/// # Safety
/// `[addr, addr+len)` must be valid readable host memory for the duration of the call.
unsafe fn layer_values(
    job: &GroupJob,
    layer: usize,
    panic_at: Option<usize>,
) -> (ReplicaKey, Vec<u64>) {
    if panic_at == Some(layer) {
        panic!("test hook: checksum worker panics at layer index {layer}");
    }
    let l = &job.layers[layer];
    // SAFETY: the caller of `ChecksumBackend::submit` guarantees the range is valid host memory
    // until the result is taken; `validate_job` checked it covers the geometry's bytes.
    let bytes = unsafe { std::slice::from_raw_parts(l.addr as usize as *const u8, l.len as usize) };
    let values = job
        .selection
        .block_ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            layer_block_checksum(
                &l.spec,
                bytes,
                id,
                job.selection.start + i as u64,
                job.num_tokens,
            )
        })
        .collect();
    (l.spec.replica, values)
}

/// Runs one validated job, spreading its layers over `settings.threads`. A worker thread that
/// panics makes the whole job fail ([`KernelError::WorkerPanicked`]): values missing its layers
/// would read as a mismatch. A worker thread the OS refuses fails it too
/// ([`KernelError::NoThread`]), after the workers already started have ended.
///
/// # Safety
/// As [`ChecksumBackend::submit`].
unsafe fn run_job(job: &GroupJob, settings: JobSettings) -> Result<GroupResult, KernelError> {
    let JobSettings {
        threads, panic_at, ..
    } = settings;
    let n = job.selection.block_ids.len();
    let per_layer: Vec<(ReplicaKey, Vec<u64>)> = if threads <= 1 || job.layers.len() <= 1 {
        (0..job.layers.len())
            // SAFETY: forwarded from this function's contract (the caller's `submit`).
            .map(|i| unsafe { layer_values(job, i, panic_at) })
            .collect()
    } else {
        let chunk = job.layers.len().div_ceil(threads);
        std::thread::scope(|s| {
            let mut handles = Vec::new();
            let mut refused = None;
            for from in (0..job.layers.len()).step_by(chunk) {
                let run = move || {
                    (from..(from + chunk).min(job.layers.len()))
                        // SAFETY: forwarded from this function's contract; the scope
                        // joins every thread before `run_job` returns.
                        .map(|i| unsafe { layer_values(job, i, panic_at) })
                        .collect::<Vec<_>>()
                };
                match settings.worker().spawn_scoped(s, run) {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        refused = Some(KernelError::NoThread(e.kind()));
                        break;
                    }
                }
            }
            // Join every handle (no early return) so no panic is left for the scope to rethrow.
            let mut out = Vec::with_capacity(job.layers.len());
            let mut panicked = None;
            for h in handles {
                match h.join() {
                    Ok(part) => out.extend(part),
                    Err(payload) => panicked = Some(panic_text(payload.as_ref())),
                }
            }
            match (panicked, refused) {
                (Some(text), _) => Err(KernelError::WorkerPanicked {
                    group_id: job.group_id,
                    why: text,
                }),
                (None, Some(e)) => Err(e),
                (None, None) => Ok(out),
            }
        })?
    };
    let mut values: BTreeMap<ReplicaKey, Vec<u64>> = BTreeMap::new();
    for (key, vals) in per_layer {
        let acc = values.entry(key).or_insert_with(|| vec![0; n]);
        for (a, v) in acc.iter_mut().zip(vals) {
            *a = a.wrapping_add(v);
        }
    }
    Ok(GroupResult {
        group_id: job.group_id,
        start: job.selection.start,
        values,
    })
}

/// In-flight CPU work; dropping it waits for the thread, so memory is never read after the drop.
struct CpuPending {
    results: Channel,
    handle: Option<JoinHandle<()>>,
}

impl Pending for CpuPending {
    fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>> {
        self.results.poll()
    }

    fn wait(&mut self, timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        self.results.wait(timeout)
    }
}

impl Drop for CpuPending {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl ChecksumBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    unsafe fn submit(&self, jobs: Vec<GroupJob>) -> Result<PendingChecksums, KernelError> {
        for job in &jobs {
            if job.device != Location::Cpu {
                return Err(KernelError::InvalidJob {
                    group_id: job.group_id,
                    why: JobFault::WrongDevice {
                        job: job.device,
                        backend: Location::Cpu,
                    },
                });
            }
            validate_job(job)?;
        }
        #[cfg(any(test, feature = "test-tools"))]
        let settings = JobSettings {
            threads: self.threads,
            panic_at: self.panic_at_layer,
            worker_stack: self.worker_stack,
        };
        #[cfg(not(any(test, feature = "test-tools")))]
        let settings = JobSettings {
            threads: self.threads,
            panic_at: None,
            worker_stack: None,
        };
        let (tx, rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("kvferry-cpu-checksum".into())
            .spawn(move || {
                // A panic on this thread (the one-thread path) is caught too: it is an error
                // with its text, not a lost worker.
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    jobs.iter()
                        // SAFETY: forwarded from `submit`'s contract; `CpuPending` joins this
                        // thread on drop, so the memory is not read after the caller lets go.
                        .map(|j| unsafe { run_job(j, settings) })
                        .collect::<Result<Vec<_>, _>>()
                }))
                .unwrap_or_else(|payload| {
                    Err(KernelError::WorkerPanicked {
                        group_id: jobs.first().map_or(0, |j| j.group_id),
                        why: panic_text(payload.as_ref()),
                    })
                });
                let _ = tx.send(out);
            })
            .map_err(|e| KernelError::NoThread(e.kind()))?;
        Ok(PendingChecksums::new(Box::new(CpuPending {
            results: Channel::new(rx),
            handle: Some(handle),
        })))
    }
}
