//! Verifying a load's layers as they land (docs/design.md §4.9): on each progress reply the
//! consumer starts the checksums of the layers it names on every rank (the kernels run while
//! the producer copies the next layers); after the FINISH it checksums the layers no progress
//! named, adds each group's parts with `GroupResult::absorb` (a group's value is the sum of its
//! layers', so the parts add up to the whole-request checksum bit for bit) and builds each
//! rank's record as `checksum::worker_record` would have.
//!
//! Bogus progress (`proto::progress::ProgressError`, or a span that does not follow on from
//! the ones started here) voids the early checksums: every layer is then checksummed after the
//! FINISH, so no verdict counts a layer checked before it landed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kvferry_checksum::record::WorkerRecord;
use kvferry_checksum::select::{consumer_blocks, BlockSelection};
use kvferry_kernels::GroupResult;
use tokio::task::JoinHandle;

use crate::checksum::{rank_jobs, run_jobs, ChecksumError};
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

    /// The blocks of `g` the load verifies (`None`: the group is not loaded or has none).
    pub(crate) fn select(&self, g: &WorkerGroup) -> Option<BlockSelection> {
        let t = self.tables.get(&g.group_id)?;
        let (lc, nt) = (self.num_local_computed, self.num_tokens);
        consumer_blocks(t, lc, nt, g.block_size, g.sliding_window)
    }
}

/// Per worker: its groups' results over the part's layers, or why it has none.
type PartResult = Vec<Result<Vec<GroupResult>, ChecksumError>>;

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
    tasks: Vec<JoinHandle<PartResult>>,
}

impl Drop for Parts {
    fn drop(&mut self) {
        // A load that ends without a verdict leaves no checksum running (a device part's
        // pending work keeps its buffers until the device is done with them).
        for t in &self.tasks {
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
            tasks: Vec::new(),
        }
    }

    /// Parts started (0 once void).
    pub(crate) fn started(&self) -> usize {
        self.tasks.len()
    }

    /// Layers the parts started cover (0 once void).
    pub(crate) fn covered(&self) -> u32 {
        self.covered
    }

    /// The producer's progress: starts the checksums of the layers that landed, or voids the
    /// parts (bogus progress, a span that does not follow on). Past [`MAX_PARTS`], progress
    /// is ignored: those layers are checksummed after the FINISH.
    pub(crate) fn progress(&mut self, p: LoadProgress) {
        let span = match p {
            _ if self.void => return,
            LoadProgress::Void(_) => return self.drop_parts(),
            LoadProgress::Landed(_) if self.full => return,
            LoadProgress::Landed(span) => span,
        };
        let slots = self.slots.len().min(u32::MAX as usize) as u32;
        if check_progress(self.covered, slots, span).is_err() {
            return self.drop_parts();
        }
        let layers = &self.slots[span.first as usize..span.end as usize];
        if self.tasks.len() >= MAX_PARTS {
            self.full = true;
            return;
        }
        let keep = per_worker(layers, self.workers.len());
        let (workers, select, timeout) = (self.workers.clone(), self.select.clone(), self.timeout);
        self.tasks.push(tokio::spawn(async move {
            let runs = workers.iter().zip(&keep).map(|(w, keep)| {
                let sel = |g: &WorkerGroup| select.select(g);
                let mut jobs =
                    rank_jobs(w, &sel, select.num_tokens, &|g, l| keep.contains(&(g, l)));
                jobs.jobs.retain(|j| !j.layers.is_empty());
                run_jobs(w, std::mem::take(&mut jobs.jobs), timeout, None)
            });
            futures::future::join_all(runs).await
        }));
        self.covered = span.end;
    }

    fn drop_parts(&mut self) {
        self.void = true;
        self.covered = 0;
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }

    /// After the FINISH: checksums the layers no part covered, adds the parts, and returns the
    /// records of the workers that reported and, for each that did not, its rank and why (as
    /// `checksum::all_records`).
    pub(crate) async fn finish(mut self) -> (Vec<WorkerRecord>, Vec<String>) {
        let n = self.workers.len();
        // Each worker's group results over the layers the parts covered.
        let mut merged: Vec<Result<BTreeMap<u32, GroupResult>, String>> =
            (0..n).map(|_| Ok(BTreeMap::new())).collect();
        let limit = self.timeout + Duration::from_secs(1);
        for task in std::mem::take(&mut self.tasks) {
            let part = match tokio::time::timeout(limit, task).await {
                Ok(Ok(part)) => part,
                Ok(Err(e)) => vec![Err(ChecksumError::Task(e))],
                Err(_) => vec![Err(ChecksumError::Timeout(self.timeout))],
            };
            // A part that failed as a whole (its task) leaves every worker without a record.
            let whole = part.len() != n;
            for (i, m) in merged.iter_mut().enumerate() {
                let r = if whole { &part[0] } else { &part[i] };
                // A failure stays in `m`: that worker reports none.
                let _ = add_part(m, r);
            }
        }
        let keep = per_worker(&self.slots[..self.covered as usize], n);
        let select = self.select.clone();
        let runs = self
            .workers
            .iter()
            .zip(merged)
            .zip(&keep)
            .map(|((w, m), keep)| {
                let select = select.clone();
                async move {
                    let m = m?;
                    let sel = |g: &WorkerGroup| select.select(g);
                    let mut jobs =
                        rank_jobs(w, &sel, select.num_tokens, &|g, l| !keep.contains(&(g, l)));
                    let order: Vec<u32> = jobs.jobs.iter().map(|j| j.group_id).collect();
                    // A job whose layers the parts all covered is left out; one with no layer at
                    // all, and no part, still runs (as the whole-request checksum does).
                    jobs.jobs
                        .retain(|j| !j.layers.is_empty() || !m.contains_key(&j.group_id));
                    let rest = run_jobs(w, std::mem::take(&mut jobs.jobs), self.timeout, None)
                        .await
                        .map_err(|e| e.to_string())?;
                    let mut m = m;
                    add_part(&mut Ok(&mut m), &Ok(rest))?;
                    let mut results = Vec::with_capacity(order.len());
                    for g in order {
                        results.extend(m.remove(&g));
                    }
                    if let Some((&g, _)) = m.iter().next() {
                        return Err(ChecksumError::Unasked(g).to_string());
                    }
                    jobs.record(w, results).map_err(|e| e.to_string())
                }
            });
        let mut records = Vec::new();
        let mut missing = Vec::new();
        for (w, r) in self
            .workers
            .iter()
            .zip(futures::future::join_all(runs).await)
        {
            match r {
                Ok(rec) => records.push(rec),
                Err(e) => missing.push(format!(
                    "tp_rank={} pp_rank={}: {e}",
                    w.rank.tp_rank, w.rank.pp_rank
                )),
            }
        }
        (records, missing)
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
