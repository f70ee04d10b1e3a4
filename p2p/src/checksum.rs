//! Running the checksums of one side (docs/design.md §2.3, §2.5): each worker checksums
//! its own layers of the selected blocks on its backend and reports a record; the
//! caller (the side's coordinator) sums the records with the checksum crate.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvferry_checksum::fingerprint::layer_fingerprint;
use kvferry_checksum::group::SkipReason;
use kvferry_checksum::record::{GroupRecord, WorkerRecord};
use kvferry_checksum::select::BlockSelection;
use kvferry_kernels::{GroupJob, GroupResult, KernelError, Location, PendingChecksums};

use crate::worker::{Worker, WorkerGroup};

/// One rank's part of a group's fingerprint: the sum of its layers' fingerprints
/// for `block_size` (§2.3); `None` when a layer has no kind or dtype.
pub fn group_fingerprint(group: &WorkerGroup) -> Option<u64> {
    group.layers.iter().try_fold(0u64, |acc, l| {
        let (kind, dtype) = (l.spec.kind.as_deref()?, l.spec.dtype.as_deref()?);
        Some(acc.wrapping_add(layer_fingerprint(
            &l.spec.name,
            kind,
            group.block_size,
            dtype,
        )))
    })
}

/// Checksums the blocks `select(group)` picks (`None` or empty: the group is left
/// out of the record) of every group of `worker`, tokens `< num_tokens`, on the
/// worker's backend, and returns the worker's record. Skipped groups are reported
/// skipped. `after`: the stream whose queued work writes the KV (the checksums run after it,
/// it is never synchronised), or `None`.
/// Errors: [`ChecksumError`] when the backend fails or exceeds `timeout`.
pub async fn worker_record(
    worker: &Worker,
    select: &(dyn Fn(&WorkerGroup) -> Option<BlockSelection> + Sync),
    num_tokens: u64,
    timeout: Duration,
    after: Option<CallerStream>,
) -> Result<WorkerRecord, ChecksumError> {
    let mut jobs = rank_jobs(worker, select, num_tokens, &|_, _| true, &group_fingerprint);
    let results = run_jobs(worker, std::mem::take(&mut jobs.jobs), timeout, after).await?;
    jobs.record(worker, results)
}

/// One rank's checksum jobs over some of its layers, and what its record needs besides their
/// results ([`rank_jobs`]).
pub(crate) struct RankJobs {
    /// One job per group with selected blocks, in the rank's group order.
    pub(crate) jobs: Vec<GroupJob>,
    skipped: Vec<(u32, SkipReason)>,
    /// Group id → (block size, fingerprint) of each group with a job.
    meta: BTreeMap<u32, (u64, Option<u64>)>,
}

/// The jobs that checksum the blocks `select(group)` picks of every group of `worker` (as
/// [`worker_record`]), over the layers `keep(group id, layer index)` keeps (a job may have
/// none). `fingerprint`: the group's fingerprint for the record ([`group_fingerprint`], or the
/// same value remembered: it hashes every layer of the group).
pub(crate) fn rank_jobs(
    worker: &Worker,
    select: &(dyn Fn(&WorkerGroup) -> Option<BlockSelection> + Sync),
    num_tokens: u64,
    keep: &dyn Fn(u32, usize) -> bool,
    fingerprint: &dyn Fn(&WorkerGroup) -> Option<u64>,
) -> RankJobs {
    let mut out = RankJobs {
        jobs: Vec::new(),
        skipped: Vec::new(),
        meta: BTreeMap::new(),
    };
    for g in &worker.groups {
        if let Some(reason) = g.skipped {
            out.skipped.push((g.group_id, reason));
            continue;
        }
        let Some(selection) = select(g).filter(|s| !s.block_ids.is_empty()) else {
            continue;
        };
        out.meta.insert(g.group_id, (g.block_size, fingerprint(g)));
        let layers = g.layers.iter().enumerate();
        out.jobs.push(GroupJob {
            group_id: g.group_id,
            block_size: g.block_size,
            layers: layers
                .filter(|(i, _)| keep(g.group_id, *i))
                .map(|(_, l)| l.clone())
                .collect(),
            selection,
            num_tokens,
            device: worker.device,
        });
    }
    out
}

impl RankJobs {
    /// The rank's record from the `results` of its jobs (one per job, over all of each
    /// group's layers). Errors: [`ChecksumError::Unasked`] for a result of a group without
    /// a job.
    pub(crate) fn record(
        self,
        worker: &Worker,
        results: Vec<GroupResult>,
    ) -> Result<WorkerRecord, ChecksumError> {
        let mut record = WorkerRecord {
            rank: worker.rank,
            groups: Vec::new(),
            skipped: self.skipped,
        };
        for r in results {
            let Some(&(block_size, fingerprint)) = self.meta.get(&r.group_id) else {
                return Err(ChecksumError::Unasked(r.group_id));
            };
            record.groups.push(GroupRecord {
                group_id: r.group_id,
                block_size,
                start: r.start,
                fingerprint,
                values: r.values,
            });
        }
        Ok(record)
    }
}

/// Runs `jobs` on `worker`'s backend (none: no result), ordered after `after`. Errors as
/// [`worker_record`].
pub(crate) async fn run_jobs(
    worker: &Worker,
    jobs: Vec<GroupJob>,
    timeout: Duration,
    after: Option<CallerStream>,
) -> Result<Vec<GroupResult>, ChecksumError> {
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    if matches!(worker.device, Location::Cuda(_)) {
        device_results(worker, jobs, timeout, after).await
    } else {
        host_results(worker, jobs, timeout, after).await
    }
}

/// How long a device checksum is waited for by yielding to the runtime between polls of its
/// completion event before sleeping between polls: a load's kernels take well under this
/// (0.13 ms for 512 MiB on an H200), and a timer sleep costs a millisecond of tokio's timer
/// granularity, several times the kernel.
const DEVICE_SPIN: Duration = Duration::from_millis(2);
/// The poll interval past [`DEVICE_SPIN`] (tokio's timer rounds it up to its 1 ms tick).
const DEVICE_POLL: Duration = Duration::from_micros(100);

/// Device memory: the backend enqueues the kernels and returns at once (no host work to hand
/// off), so the jobs are submitted on this task and their completion event polled from it,
/// yielding to the runtime in between: no blocking-pool hand-off and no sleep in the common
/// case. Errors: the backend's, or [`ChecksumError::Timeout`] after `timeout` (the pending
/// work is dropped; its buffers are reused only once the device is done with them).
async fn device_results(
    worker: &Worker,
    jobs: Vec<GroupJob>,
    timeout: Duration,
    after: Option<CallerStream>,
) -> Result<Vec<GroupResult>, ChecksumError> {
    let start = Instant::now();
    let pending = submit_device(worker, jobs, after)?;
    wait_device(pending, start, timeout).await
}

/// Submits `jobs` to a device worker's backend, ordered after `after`, and returns at once
/// (the backend only enqueues: no host wait). Errors: the backend's.
pub(crate) fn submit_device(
    worker: &Worker,
    jobs: Vec<GroupJob>,
    after: Option<CallerStream>,
) -> Result<PendingChecksums, ChecksumError> {
    Ok(match after {
        // SAFETY: as below, and a CallerStream is 0 or a live stream of the device.
        Some(stream) => unsafe { worker.backend.submit_after(jobs, stream.raw()) }?,
        // SAFETY: every LayerInput describes memory the embedder keeps valid while the
        // worker is in use (the Worker contract); the result is taken by [`wait_device`] or the
        // pending work dropped, which keeps its buffers until the device is done.
        None => unsafe { worker.backend.submit(jobs) }?,
    })
}

/// Submits `jobs` to a device worker's backend, ordered on the device after each of `points`
/// (events after a transport's copies into the layers: `submit_strided_with_points`), and
/// returns at once: the kernels start when the copies end, with no host round trip. Errors:
/// the backend's.
pub(crate) fn submit_device_after_points(
    worker: &Worker,
    jobs: Vec<GroupJob>,
    points: &[kvferry_transfer::StreamPoint],
) -> Result<PendingChecksums, ChecksumError> {
    let events: Vec<&kvferry_kernels::cuda::driver::Event> = points.iter().map(|p| &**p).collect();
    // SAFETY: as in `submit_device`; each point is an event the transport recorded on a stream
    // of the worker's device (its primary context) after copies into its memory.
    Ok(unsafe { worker.backend.submit_after_events(jobs, &events) }?)
}

/// Waits for device checksums submitted at `start` ([`submit_device`]) until `start +
/// timeout`: polls their completion, yielding to the runtime between polls for the first
/// [`DEVICE_SPIN`] of this wait (however long ago they were submitted), then every
/// [`DEVICE_POLL`]. Errors: the backend's, or [`ChecksumError::Timeout`] (the pending work is
/// dropped).
pub(crate) async fn wait_device(
    mut pending: PendingChecksums,
    start: Instant,
    timeout: Duration,
) -> Result<Vec<GroupResult>, ChecksumError> {
    let spin_until = Instant::now() + DEVICE_SPIN;
    loop {
        if let Some(r) = pending.poll() {
            return Ok(r?);
        }
        let (now, waited) = (Instant::now(), start.elapsed());
        if waited >= timeout {
            return Err(ChecksumError::Timeout(timeout));
        }
        if now < spin_until {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(DEVICE_POLL.min(timeout - waited)).await;
        }
    }
}

/// Host memory: the backend computes on threads and a wait blocks, so it runs on the blocking
/// pool. Errors as [`device_results`].
async fn host_results(
    worker: &Worker,
    jobs: Vec<GroupJob>,
    timeout: Duration,
    after: Option<CallerStream>,
) -> Result<Vec<GroupResult>, ChecksumError> {
    let backend = worker.backend.clone();
    let run = tokio::task::spawn_blocking(move || {
        let pending = match after {
            // SAFETY: as below, and a CallerStream is 0 or a live stream of the device.
            Some(stream) => unsafe { backend.submit_after(jobs, stream.raw()) }?,
            // SAFETY: every LayerInput describes memory the embedder keeps valid while the
            // worker is in use (the Worker contract); the result is taken here.
            None => unsafe { backend.submit(jobs) }?,
        };
        pending.wait(timeout)
    });
    match tokio::time::timeout(timeout + Duration::from_secs(1), run).await {
        Err(_) => Err(ChecksumError::Timeout(timeout)),
        Ok(Err(join)) => Err(ChecksumError::Task(join)),
        Ok(Ok(r)) => Ok(r?),
    }
}

/// A caller's CUDA stream that checksums and copies are ordered after (never synchronised):
/// a raw `CUstream` handle, 0 for the legacy default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallerStream(u64);

impl CallerStream {
    /// Wraps a raw stream handle.
    ///
    /// # Safety
    /// `raw` is 0 or a live stream of the device of every CUDA worker it is used with, for as
    /// long as it is used.
    pub unsafe fn new(raw: u64) -> CallerStream {
        CallerStream(raw)
    }

    /// The raw handle.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// Why a rank's checksums produced no record.
#[derive(Debug, thiserror::Error)]
pub enum ChecksumError {
    /// The backend refused or failed the jobs.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The backend did not finish in time.
    #[error("checksums did not finish within {0:?}")]
    Timeout(Duration),
    /// The blocking task running the backend ended abnormally (it panicked or was cancelled).
    #[error("checksum task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The backend returned a group that was not asked for.
    #[error("backend returned group {0} that was not asked for")]
    Unasked(u32),
}

/// Runs [`worker_record`] on every worker concurrently. Returns the records of
/// the workers that reported and, for each that did not, its rank and why.
pub async fn all_records(
    workers: &[Worker],
    select: &(dyn Fn(&WorkerGroup) -> Option<BlockSelection> + Sync),
    num_tokens: u64,
    timeout: Duration,
    after: Option<CallerStream>,
) -> (Vec<WorkerRecord>, Vec<String>) {
    let runs = workers.iter().map(|w| async move {
        let r = worker_record(w, select, num_tokens, timeout, after).await;
        (w.rank, r)
    });
    let mut records = Vec::new();
    let mut missing = Vec::new();
    for (rank, r) in futures::future::join_all(runs).await {
        match r {
            Ok(rec) => records.push(rec),
            Err(e) => missing.push(format!(
                "tp_rank={} pp_rank={}: {e}",
                rank.tp_rank, rank.pp_rank
            )),
        }
    }
    (records, missing)
}
