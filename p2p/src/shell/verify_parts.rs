//! Verifying a load's layers as they land (docs/design.md §4.9): on each progress reply the
//! consumer starts the checksums of the layers it names on every rank (the kernels run while
//! the producer copies the next layers; on a device they are only submitted then, and their
//! results polled after the FINISH); after the FINISH it checksums the layers no progress
//! named, adds each group's parts with `GroupResult::absorb` (a group's value is the sum of its
//! layers', so the parts add up to the whole-request checksum bit for bit) and builds each
//! rank's record as `checksum::worker_record` would have.
//!
//! Bogus progress (`proto::progress::ProgressError`, or a span that does not follow on from
//! the ones started here) voids the early checksums: every layer is then checksummed after the
//! FINISH, so no verdict counts a layer checked before it landed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_checksum::record::WorkerRecord;
use kvferry_checksum::select::{consumer_blocks, BlockSelection};
use kvferry_kernels::{GroupJob, GroupResult, Location, PendingChecksums};
use tokio::task::JoinHandle;

use kvferry_transfer::StreamPoint;

use crate::checksum::{
    group_fingerprint, rank_jobs, run_jobs, submit_device, submit_device_after_points, wait_device,
    ChecksumError, RankJobs,
};
use crate::proto::msg::LayerSpan;
use crate::proto::progress::{check_progress, Slot};
use crate::proto::request::{LoadGroup, LoadSpec};
use crate::shell::connection::LoadProgress;
use crate::worker::{Worker, WorkerGroup};

/// Most parts one load's checksums are started in; progress past it is left for after the
/// FINISH (a producer naming one layer at a time costs no more than this many tasks).
pub(crate) const MAX_PARTS: usize = 16;

/// Which blocks of each group a load verifies (what `consumer_blocks` selects from the load's
/// tables), owned so that part tasks can take it along.
pub(crate) struct Selector {
    tables: HashMap<u32, Vec<Option<u64>>>,
    num_local_computed: u64,
    num_tokens: u64,
}

impl Selector {
    /// The selection of `spec`'s groups.
    pub(crate) fn new(spec: &LoadSpec) -> Selector {
        Selector {
            tables: spec
                .groups
                .iter()
                .map(|g: &LoadGroup| (g.group_id, g.local_blocks.clone()))
                .collect(),
            num_local_computed: spec.num_local_computed,
            num_tokens: spec.num_tokens,
        }
    }

    /// The jobs of `w` over the layers `keep(group id, layer index)` keeps, its groups'
    /// fingerprints taken from `fps` where known (`checksum::rank_jobs`).
    fn jobs(
        &self,
        w: &Worker,
        fps: Option<&HashMap<u32, Option<u64>>>,
        keep: &dyn Fn(u32, usize) -> bool,
    ) -> RankJobs {
        let sel = |g: &WorkerGroup| self.select(g);
        let fp = |g: &WorkerGroup| fingerprint_of(fps, g);
        rank_jobs(w, &sel, self.num_tokens, keep, &fp)
    }

    /// The blocks of `g` the load verifies (`None`: the group is not loaded or has none).
    pub(crate) fn select(&self, g: &WorkerGroup) -> Option<BlockSelection> {
        let t = self.tables.get(&g.group_id)?;
        let (lc, nt) = (self.num_local_computed, self.num_tokens);
        consumer_blocks(t, lc, nt, g.block_size, g.sliding_window)
    }
}

/// One worker's checksums of one part.
enum Running {
    /// Submitted to the worker's device; polled only after the FINISH (no task spins on it
    /// while the copies run, nor takes the driver's locks the producer's submits need).
    Device(PendingChecksums),
    /// Host memory: computed on the blocking pool by a task of its own.
    Task(JoinHandle<Result<Vec<GroupResult>, ChecksumError>>),
    /// Already known: nothing to checksum, a result taken early, or why it failed.
    Done(Result<Vec<GroupResult>, ChecksumError>),
}

impl Running {
    /// Takes the result if it is there (never waits); whether it is.
    fn try_finish(&mut self) -> bool {
        match self {
            Running::Done(_) => true,
            Running::Task(t) => t.is_finished(),
            Running::Device(pending) => match pending.poll() {
                None => false,
                Some(r) => {
                    *self = Running::Done(r.map_err(ChecksumError::from));
                    true
                }
            },
        }
    }

    /// The result, by `timeout` after the wait starts (a task: plus a second for the task
    /// itself). Counted from the wait, not the submission: a part submitted at a CONTINUE
    /// waits through the rest of the copy first, which may take longer than `timeout`.
    async fn result(self, timeout: Duration) -> Result<Vec<GroupResult>, ChecksumError> {
        match self {
            Running::Done(r) => r,
            Running::Device(pending) => wait_device(pending, Instant::now(), timeout).await,
            Running::Task(t) => {
                match tokio::time::timeout(timeout + Duration::from_secs(1), t).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(e)) => Err(ChecksumError::Task(e)),
                    Err(_) => Err(ChecksumError::Timeout(timeout)),
                }
            }
        }
    }

    fn abort(&self) {
        if let Running::Task(t) = self {
            t.abort();
        }
    }
}

/// A load's checksums started as its layers land.
pub(crate) struct Parts {
    workers: Arc<Vec<Worker>>,
    select: Arc<Selector>,
    slots: Vec<Slot>,
    timeout: Duration,
    /// One past the last slot whose checksums were started.
    covered: u32,
    /// Bogus progress came: the parts are dropped.
    void: bool,
    /// [`MAX_PARTS`] were started: later progress is left for after the FINISH.
    full: bool,
    /// One past the last slot of the progress heard after the FINISH ([`Parts::late`]).
    heard: Option<u32>,
    /// Per part, per worker.
    tasks: Vec<Vec<Running>>,
    /// Per worker, its groups' fingerprints (`checksum::group_fingerprint`, a SHA-256 per
    /// layer), computed once per load at its first part, not at each part and again after the
    /// FINISH.
    fingerprints: Option<Fingerprints>,
    /// Per worker, its jobs over no layer (the load's selections and what its record names),
    /// worked out once when a one-pass read asks for the selections ([`Parts::selections`])
    /// and taken for its records ([`Parts::finish`]).
    selected: Option<Vec<RankJobs>>,
}

/// Per worker (indexed as the workers), its groups' fingerprints ([`worker_fingerprints`]).
pub(crate) type Fingerprints = Arc<Vec<HashMap<u32, Option<u64>>>>;

/// Each worker's group fingerprints (a SHA-256 per layer): fixed by the workers, so a
/// consumer computes them once for all its loads ([`Parts::with_fingerprints`]).
pub(crate) fn worker_fingerprints(workers: &[Worker]) -> Fingerprints {
    Arc::new(
        workers
            .iter()
            .map(|w| {
                w.groups
                    .iter()
                    .map(|g| (g.group_id, group_fingerprint(g)))
                    .collect()
            })
            .collect(),
    )
}

impl Drop for Parts {
    fn drop(&mut self) {
        // A load that ends without a verdict leaves no checksum running (a device part's
        // pending work keeps its buffers until the device is done with them).
        for t in self.tasks.iter().flatten() {
            t.abort();
        }
    }
}

impl Parts {
    /// No part yet, for a request of `slots` layers (`proto::progress::layer_slots`).
    pub(crate) fn new(
        workers: Arc<Vec<Worker>>,
        select: Arc<Selector>,
        slots: Vec<Slot>,
        timeout: Duration,
    ) -> Parts {
        Parts {
            workers,
            select,
            slots,
            timeout,
            covered: 0,
            void: false,
            full: false,
            heard: None,
            tasks: Vec::new(),
            fingerprints: None,
            selected: None,
        }
    }

    /// These parts with the workers' fingerprints computed already ([`worker_fingerprints`]
    /// of the same workers), instead of once per load.
    pub(crate) fn with_fingerprints(mut self, fps: Fingerprints) -> Parts {
        self.fingerprints = Some(fps);
        self
    }

    /// Parts started (0 once void).
    pub(crate) fn started(&self) -> usize {
        self.tasks.len()
    }

    /// Layers the parts started cover (0 once void).
    pub(crate) fn covered(&self) -> u32 {
        self.covered
    }

    /// Whether a part covers every layer (none is void): [`Parts::finish`] then reads no
    /// layer itself, and each part's checksums were started after its layers landed or are
    /// ordered after their copies on the device, so the verdict may be worked out before the
    /// host has seen the copies end.
    pub(crate) fn complete(&self) -> bool {
        !self.void && !self.slots.is_empty() && self.covered as usize == self.slots.len()
    }

    /// Each worker's jobs (indexed as the workers) over every layer of the load: what a
    /// one-pass read copies and checksums (`consumer_copy`).
    pub(crate) fn whole_jobs(&mut self) -> Vec<Vec<GroupJob>> {
        let fps = fingerprints(&mut self.fingerprints, &self.workers);
        self.workers
            .iter()
            .enumerate()
            .map(|(i, w)| self.select.jobs(w, fps.get(i), &|_, _| true).jobs)
            .collect()
    }

    /// Each worker's selected blocks per group (indexed as the workers), in the order and for
    /// the groups of [`Parts::whole_jobs`] (the same jobs, over no layer), without the jobs'
    /// layers: what a one-pass launch planned ahead needs of a load. The jobs are kept for
    /// the load's records.
    pub(crate) fn selections(&mut self) -> Vec<Vec<(u32, BlockSelection)>> {
        let jobs = self.selected_jobs();
        let out = jobs
            .iter()
            .map(|j| {
                j.jobs
                    .iter()
                    .map(|g| (g.group_id, g.selection.clone()))
                    .collect()
            })
            .collect();
        self.selected = Some(jobs);
        out
    }

    /// Each worker's jobs over no layer: those [`Parts::selections`] kept, or worked out now.
    fn selected_jobs(&mut self) -> Vec<RankJobs> {
        if let Some(jobs) = self.selected.take() {
            return jobs;
        }
        let fps = fingerprints(&mut self.fingerprints, &self.workers);
        (self.workers.iter().enumerate())
            .map(|(i, w)| self.select.jobs(w, fps.get(i), &|_, _| false))
            .collect()
    }

    /// The load's tokens (every job's `num_tokens`).
    pub(crate) fn num_tokens(&self) -> u64 {
        self.select.num_tokens
    }

    /// Every layer's checksums came with its copy (a one-pass read): `results[i]` is worker
    /// `i`'s, over all of [`Parts::whole_jobs`], one part covering every layer. Where parts
    /// were started before (nothing of a one-pass read starts any), they are voided instead,
    /// and every layer is checksummed from the landed bytes after the FINISH.
    pub(crate) fn copied(&mut self, results: Vec<Vec<GroupResult>>) {
        if self.void || !self.tasks.is_empty() || results.len() != self.workers.len() {
            self.drop_parts();
            return;
        }
        let part = results.into_iter().map(|r| Running::Done(Ok(r))).collect();
        self.tasks.push(part);
        self.covered = self.slots.len().min(u32::MAX as usize) as u32;
    }

    /// The producer's progress: starts the checksums of the layers that landed, or voids the
    /// parts (bogus progress, a span that does not follow on). Past [`MAX_PARTS`], progress
    /// is ignored: those layers are checksummed after the FINISH.
    pub(crate) fn progress(&mut self, p: LoadProgress) {
        self.start(p, None);
    }

    /// The layers of `span` are being copied into this side's device memory by its own
    /// transport, and in place once the device reaches each worker's `points` (indexed as the
    /// workers; `None` for a worker whose engine submitted none of the span's copies): starts
    /// their checksums now, ordered after those points on the device, so that they run as
    /// soon as the copies end. A span that does not follow on voids the parts, as in
    /// [`Parts::progress`]; so does a worker whose memory is not device memory (its host
    /// checksum would run before the copies end), and one with layers to checksum in `span`
    /// but no points (what writes its memory is not known here).
    pub(crate) fn queued(&mut self, span: LayerSpan, points: &[Option<Vec<StreamPoint>>]) {
        self.start(LoadProgress::Landed(span), Some(points));
    }

    /// [`Parts::progress`], or [`Parts::queued`] with `points`.
    fn start(&mut self, p: LoadProgress, points: Option<&[Option<Vec<StreamPoint>>]>) {
        let Some(span) = self.follow_on(p, self.covered) else {
            return;
        };
        if points.is_some()
            && self
                .workers
                .iter()
                .any(|w| !matches!(w.device, Location::Cuda(_)))
        {
            self.drop_parts();
            return;
        }
        let layers = &self.slots[span.first as usize..span.end as usize];
        if self.tasks.len() >= MAX_PARTS {
            self.full = true;
            return;
        }
        let keep = per_worker(layers, self.workers.len());
        let fps = fingerprints(&mut self.fingerprints, &self.workers);
        let jobs: Vec<Vec<GroupJob>> = self
            .workers
            .iter()
            .zip(&keep)
            .enumerate()
            .map(|(i, (w, keep))| {
                let mut jobs = self
                    .select
                    .jobs(w, fps.get(i), &|g, l| keep.contains(&(g, l)));
                jobs.jobs.retain(|j| !j.layers.is_empty());
                std::mem::take(&mut jobs.jobs)
            })
            .collect();
        // Queued: a worker with layers to checksum whose engine submitted none of the span's
        // copies has no points of its own to wait for (another's copies may write its memory):
        // nothing is started early, every layer waits for the FINISH.
        let unordered = |(i, jobs): (usize, &Vec<GroupJob>)| {
            !jobs.is_empty() && !matches!(points.and_then(|p| p.get(i)), Some(Some(_)))
        };
        if points.is_some() && jobs.iter().enumerate().any(unordered) {
            self.drop_parts();
            return;
        }
        let part = self
            .workers
            .iter()
            .zip(jobs)
            .enumerate()
            .map(|(i, (w, jobs))| {
                if jobs.is_empty() {
                    return Running::Done(Ok(Vec::new()));
                }
                if matches!(w.device, Location::Cuda(_)) {
                    // On this task: the backend only enqueues.
                    let submitted = match points.and_then(|p| p.get(i)) {
                        Some(Some(p)) => submit_device_after_points(w, jobs, p),
                        _ => submit_device(w, jobs, None),
                    };
                    return match submitted {
                        Ok(pending) => Running::Device(pending),
                        Err(e) => Running::Done(Err(e)),
                    };
                }
                let (workers, timeout) = (self.workers.clone(), self.timeout);
                Running::Task(tokio::spawn(async move {
                    run_jobs(&workers[i], jobs, timeout, None).await
                }))
            })
            .collect();
        self.tasks.push(part);
        self.covered = span.end;
    }

    fn drop_parts(&mut self) {
        self.void = true;
        self.covered = 0;
        for t in self.tasks.drain(..).flatten() {
            t.abort();
        }
    }

    /// Progress heard after the FINISH: bogus progress still voids the parts; a span that
    /// landed is left for [`Parts::finish`], which checksums every layer no part started in
    /// one submission (a part of its own would be one more launch and one more task to wait
    /// for, queued behind the others, before the rest could start).
    pub(crate) fn late(&mut self, p: LoadProgress) {
        // Checked as a part's span would be: what it names must follow on from what was heard.
        if let Some(span) = self.follow_on(p, self.heard.unwrap_or(self.covered)) {
            self.heard = Some(span.end);
        }
    }

    /// The span `p` names when it lands right after slot `from` and within the slots; `None`
    /// when there is nothing to take: the parts are void or full, or `p` voids them (a Void,
    /// or a span that does not follow on from `from`, which drops the parts here).
    fn follow_on(&mut self, p: LoadProgress, from: u32) -> Option<LayerSpan> {
        let span = match p {
            _ if self.void => return None,
            LoadProgress::Void(_) => {
                self.drop_parts();
                return None;
            }
            LoadProgress::Landed(_) if self.full => return None,
            LoadProgress::Landed(span) => span,
        };
        let slots = self.slots.len().min(u32::MAX as usize) as u32;
        if check_progress(from, slots, span).is_err() {
            self.drop_parts();
            return None;
        }
        Some(span)
    }

    /// After the FINISH: checksums the layers no part covered, adds the parts, and returns the
    /// records of the workers that reported and, for each that did not, its rank and why (as
    /// `checksum::all_records`). The rest is submitted before the parts are waited for: on a
    /// device its kernels queue on the backend's side streams beside or behind the parts'
    /// instead of starting only once the last part's results are back on the host.
    pub(crate) async fn finish(mut self) -> Finished {
        if let Some(f) = self.finish_copied() {
            return f;
        }
        let t0 = Instant::now();
        let n = self.workers.len();
        let keep = per_worker(&self.slots[..self.covered as usize], n);
        let rest_layers = self.slots.len() - self.covered as usize;
        let select = self.select.clone();
        let timeout = self.timeout;
        let fps = fingerprints(&mut self.fingerprints, &self.workers);
        let mut tasks = std::mem::take(&mut self.tasks);
        let parts_done = tasks
            .iter_mut()
            .filter_map(|p| p.iter_mut().all(Running::try_finish).then_some(()))
            .count();
        let rests = self
            .workers
            .iter()
            .zip(&keep)
            .enumerate()
            .map(|(i, (w, keep))| {
                // Groups some part checksummed layers of (on this worker): their results come from
                // the parts.
                let parted: HashSet<u32> = keep.iter().map(|(g, _)| *g).collect();
                let mut jobs = select.jobs(w, fps.get(i), &|g, l| !keep.contains(&(g, l)));
                let order: Vec<u32> = jobs.jobs.iter().map(|j| j.group_id).collect();
                // A job whose layers the parts all covered is left out; one with no layer at all,
                // and no part, still runs (as the whole-request checksum does).
                jobs.jobs
                    .retain(|j| !j.layers.is_empty() || !parted.contains(&j.group_id));
                let run = std::mem::take(&mut jobs.jobs);
                async move {
                    let r = run_jobs(w, run, timeout, None).await;
                    (r, jobs, order, t0.elapsed())
                }
            });
        // Polled first, so that the rest is submitted before any part is waited for.
        let rests = futures::future::join_all(rests);
        let parts = async move {
            // Each worker's group results over the layers the parts covered.
            let mut merged: Vec<Result<BTreeMap<u32, GroupResult>, String>> =
                (0..n).map(|_| Ok(BTreeMap::new())).collect();
            for part in tasks {
                let part = futures::future::join_all(part.into_iter().map(|r| r.result(timeout)));
                for (m, r) in merged.iter_mut().zip(part.await) {
                    // A failure stays in `m`: that worker reports none.
                    let _ = add_part(m, &r);
                }
            }
            (merged, t0.elapsed())
        };
        let (rests, (merged, parts_waited)) = futures::future::join(rests, parts).await;
        let mut records = Vec::new();
        let mut missing = Vec::new();
        let mut rest_waited = Duration::ZERO;
        for ((w, m), (rest, jobs, order, waited)) in self.workers.iter().zip(merged).zip(rests) {
            rest_waited = rest_waited.max(waited);
            let r = m.and_then(|mut m| {
                let rest = rest.map_err(|e| e.to_string())?;
                add_part(&mut Ok(&mut m), &Ok(rest))?;
                let mut results = Vec::with_capacity(order.len());
                for g in order {
                    results.extend(m.remove(&g));
                }
                if let Some((&g, _)) = m.iter().next() {
                    return Err(ChecksumError::Unasked(g).to_string());
                }
                jobs.record(w, results).map_err(|e| e.to_string())
            });
            match r {
                Ok(rec) => records.push(rec),
                Err(e) => missing.push(format!(
                    "tp_rank={} pp_rank={}: {e}",
                    w.rank.tp_rank, w.rank.pp_rank
                )),
            }
        }
        Finished {
            records,
            missing,
            rest_layers,
            parts_done,
            parts_us: parts_waited.as_micros() as u64,
            rest_us: rest_waited.as_micros() as u64,
        }
    }

    /// [`Parts::finish`] for one part over every layer whose results are in (a one-pass read,
    /// [`Parts::copied`]): each worker's record is its results as they are, nothing merged and
    /// nothing left to checksum. `None` (the general path then) unless every worker's results
    /// are one per group of its jobs, in their order.
    fn finish_copied(&mut self) -> Option<Finished> {
        let t0 = Instant::now();
        let whole = !self.void
            && !self.slots.is_empty()
            && self.covered as usize == self.slots.len()
            && self.tasks.len() == 1
            && self.tasks[0].len() == self.workers.len();
        if !whole {
            return None;
        }
        let jobs = self.selected_jobs();
        let fits = self.tasks[0].iter().zip(&jobs).all(|(r, j)| {
            matches!(r, Running::Done(Ok(res)) if res.len() == j.jobs.len()
                && res.iter().zip(&j.jobs).all(|(a, b)| a.group_id == b.group_id))
        });
        if !fits {
            return None;
        }
        let part = self.tasks.pop().unwrap_or_default();
        let (mut records, mut missing) = (Vec::new(), Vec::new());
        for ((w, r), jobs) in self.workers.iter().zip(part).zip(jobs) {
            let Running::Done(Ok(results)) = r else {
                continue; // checked above
            };
            match jobs.record(w, results) {
                Ok(rec) => records.push(rec),
                Err(e) => missing.push(format!(
                    "tp_rank={} pp_rank={}: {e}",
                    w.rank.tp_rank, w.rank.pp_rank
                )),
            }
        }
        Some(Finished {
            records,
            missing,
            rest_layers: 0,
            parts_done: 1,
            parts_us: t0.elapsed().as_micros() as u64,
            rest_us: 0,
        })
    }
}

/// What [`Parts::finish`] gives: the records, the workers without one, and its timing.
pub(crate) struct Finished {
    /// The records of the workers that reported.
    pub(crate) records: Vec<WorkerRecord>,
    /// For each worker that did not report: its rank and why.
    pub(crate) missing: Vec<String>,
    /// Layer slots checksummed after the FINISH that no part covered: every slot when no
    /// part started, and 0 for a load not verified as its layers land (a landed hook runs
    /// between landing and verifying): its slots are not numbered, and all its layers go
    /// after the FINISH.
    pub(crate) rest_layers: usize,
    /// Parts whose checksums had ended when the call came (the FINISH).
    pub(crate) parts_done: usize,
    /// Microseconds from the call until every part's results were in.
    pub(crate) parts_us: u64,
    /// Microseconds from the call until the last worker's rest was in.
    pub(crate) rest_us: u64,
}

/// Each worker's group fingerprints (`cache`, computed on first use: a SHA-256 per layer).
fn fingerprints<'a>(
    cache: &'a mut Option<Fingerprints>,
    workers: &[Worker],
) -> &'a [HashMap<u32, Option<u64>>] {
    cache.get_or_insert_with(|| worker_fingerprints(workers))
}

/// `g`'s fingerprint from a worker's remembered ones (`None`, or a group not in them: computed).
fn fingerprint_of(known: Option<&HashMap<u32, Option<u64>>>, g: &WorkerGroup) -> Option<u64> {
    match known.and_then(|k| k.get(&g.group_id)) {
        Some(&fp) => fp,
        None => group_fingerprint(g),
    }
}

/// Per worker (of `n`), the (group id, layer index) of `slots`.
fn per_worker(slots: &[Slot], n: usize) -> Vec<HashSet<(u32, usize)>> {
    let mut keep = vec![HashSet::new(); n];
    for s in slots {
        if let Some(k) = keep.get_mut(s.rank) {
            k.insert((s.group_id, s.layer));
        }
    }
    keep
}

/// Adds a part's results (or its failure) into a worker's merged results; a result that does
/// not add (another group's blocks) is the worker's failure.
fn add_part<M: std::borrow::BorrowMut<BTreeMap<u32, GroupResult>>>(
    merged: &mut Result<M, String>,
    part: &Result<Vec<GroupResult>, ChecksumError>,
) -> Result<(), String> {
    let m = match merged {
        Ok(m) => m.borrow_mut(),
        Err(e) => return Err(e.clone()),
    };
    let why = match part {
        Err(e) => e.to_string(),
        Ok(results) => {
            let mut failed = None;
            for r in results {
                let r = r.clone();
                match m.get_mut(&r.group_id) {
                    Some(have) => {
                        if let Err(e) = have.absorb(r) {
                            failed = Some(e.to_string());
                            break;
                        }
                    }
                    None => {
                        m.insert(r.group_id, r);
                    }
                }
            }
            match failed {
                None => return Ok(()),
                Some(e) => e,
            }
        }
    };
    *merged = Err(why.clone());
    Err(why)
}
