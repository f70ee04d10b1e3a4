//! The CPU checksum backend: the fast additive form of kvferry-checksum (§2.1) over host memory,
//! layers spread over a few threads.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvferry_checksum::definition::layer_block_checksum;
use kvferry_checksum::group::ReplicaKey;

use crate::backend::{
    validate_job, Channel, ChecksumBackend, Device, GroupJob, GroupResult, KernelError, Pending,
    PendingChecksums,
};

/// Checksums host-memory KV on `threads` threads (one job's layers are split between them).
#[derive(Debug, Clone)]
pub struct CpuBackend {
    /// Threads used per submission (at least 1).
    pub threads: usize,
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
        }
    }
}

/// One layer's values for every selected block.
///
/// # Safety
/// `[addr, addr+len)` must be valid readable host memory for the duration of the call.
unsafe fn layer_values(job: &GroupJob, layer: usize) -> (ReplicaKey, Vec<u64>) {
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

/// Runs one validated job, spreading its layers over `threads`.
///
/// # Safety
/// As [`ChecksumBackend::submit`].
unsafe fn run_job(job: &GroupJob, threads: usize) -> GroupResult {
    let n = job.selection.block_ids.len();
    let per_layer: Vec<(ReplicaKey, Vec<u64>)> = if threads <= 1 || job.layers.len() <= 1 {
        (0..job.layers.len())
            .map(|i| unsafe { layer_values(job, i) })
            .collect()
    } else {
        let chunk = job.layers.len().div_ceil(threads);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..job.layers.len())
                .step_by(chunk)
                .map(|from| {
                    s.spawn(move || {
                        (from..(from + chunk).min(job.layers.len()))
                            .map(|i| unsafe { layer_values(job, i) })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        })
    };
    let mut values: BTreeMap<ReplicaKey, Vec<u64>> = BTreeMap::new();
    for (key, vals) in per_layer {
        let acc = values.entry(key).or_insert_with(|| vec![0; n]);
        for (a, v) in acc.iter_mut().zip(vals) {
            *a = a.wrapping_add(v);
        }
    }
    GroupResult {
        group_id: job.group_id,
        start: job.selection.start,
        values,
    }
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
            if job.device != Device::Cpu {
                return Err(KernelError::InvalidJob {
                    group_id: job.group_id,
                    why: format!("the CPU backend reads host memory, not {:?}", job.device),
                });
            }
            validate_job(job)?;
        }
        let threads = self.threads;
        let (tx, rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("kvferry-cpu-checksum".into())
            .spawn(move || {
                // SAFETY: forwarded from `submit`'s contract; `CpuPending` joins this thread on drop.
                let out = jobs
                    .iter()
                    .map(|j| unsafe { run_job(j, threads) })
                    .collect();
                let _ = tx.send(Ok(out));
            })
            .map_err(|e| KernelError::Device(format!("cannot start a checksum thread: {e}")))?;
        Ok(PendingChecksums::new(Box::new(CpuPending {
            results: Channel::new(rx),
            handle: Some(handle),
        })))
    }
}
