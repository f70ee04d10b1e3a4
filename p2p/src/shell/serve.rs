//! Serving one load on the producer (docs/design.md §4): plan the copies with
//! [`crate::proto::serve::plan`] and WRITE them through each producer rank's engine.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use std::ops::Range;

use kvferry_transfer::{BatchId, Op, StreamPoint, Token, TransferPath};
use tracing::debug;

use super::serve_batch::{
    free_if_timed_out, per_batch, plan_bytes, requests, strided_requests, submit_blocking,
    submit_job, Job, Submission, Submitted,
};
use crate::proto::layout::RankLayout;
use crate::proto::msg::{LayerSpan, LoadRequest};
use crate::proto::plan::Copy;
use crate::proto::producer_effects::ServedLoad;
use crate::proto::progress::{layer_groups, layer_slots};
use crate::proto::serve::{check_lease, plan, BlockCopies, Published, RankPlan};
use crate::proto::serve_error::{ServeFailure, WriteError, WriteErrorKind};
use crate::worker::Worker;

/// How serving one load ended ([`serve_load`]).
#[derive(Debug)]
pub(crate) enum ServeEnd {
    /// The WRITEs ran: the bytes written, the lease's checksum payload and the path that
    /// carried the first batch submitted (for the reply), or why they failed (the lease ends:
    /// bytes may have landed).
    Ran(Result<ServedLoad, ServeFailure>),
    /// Refused before any WRITE (a grant token that does not parse, a request the plan
    /// refuses): why, and the lease, untouched, to be held again.
    Refused(ServeFailure, Published),
}

/// Serves one load (a `Serve` effect of the producer machine): parses the request's grant
/// token, plans the copies from `lease` to the consumer's ranks (`layouts`: the workers as the
/// planner sees them, same order) and WRITEs them by `deadline`: in layer groups of about
/// `group_bytes` ([`GroupedWrite`], `progress` told as each lands), or in one
/// go ([`write_all`]). A token that does not parse or a request the plan refuses gives the
/// lease back ([`ServeEnd::Refused`]); otherwise the WRITEs' result ([`ServeEnd::Ran`]).
pub(crate) async fn serve_load(
    workers: Arc<Vec<Worker>>,
    layouts: Arc<Vec<RankLayout>>,
    lease: Published,
    request: LoadRequest,
    deadline: Instant,
    group_bytes: u64,
    progress: impl Fn(LayerSpan) + Send + 'static,
) -> ServeEnd {
    let token = match request.token.as_deref().map(str::parse::<Token>) {
        None => None,
        Some(Ok(t)) => Some(t),
        Some(Err(e)) => return ServeEnd::Refused(ServeFailure::Token(e), lease),
    };
    if request.read {
        // The consumer reads the blocks itself: only the lease is checked, nothing is copied
        // here; the FINISH carries the payload, and the lease holds until the consumer's
        // read_done (docs/design.md §4.10).
        return match check_lease(&layouts, &lease, &request) {
            Ok(()) => ServeEnd::Ran(Ok((0, lease.payload, None))),
            Err(e) => ServeEnd::Refused(ServeFailure::Plan(e), lease),
        };
    }
    let t_plan = Instant::now();
    let planned = plan(&layouts, &lease, &request);
    debug!(
        target: "kvferry::timing",
        request_id = request.request_id,
        plan_us = t_plan.elapsed().as_micros() as u64,
        copies = planned.as_ref().map(|p| p.iter().map(|r| r.copy_count()).sum::<usize>()).unwrap_or(0),
        "serve planned"
    );
    let plan = match planned {
        Ok(plan) => plan,
        Err(e) => return ServeEnd::Refused(ServeFailure::Plan(e), lease),
    };
    let mut slot_bytes = vec![0u64; layer_slots(&request).len()];
    for p in &plan {
        p.add_slot_bytes(&mut slot_bytes);
    }
    let groups = layer_groups(&slot_bytes, group_bytes);
    let carried = Arc::new(OnceLock::new());
    let written = if groups.len() > 1 {
        let carried = carried.clone();
        let (write, stop) = (Op::Write, Arc::new(AtomicBool::new(false)));
        GroupedWrite::new(
            workers, plan, &groups, write, deadline, token, progress, None, carried, stop,
        )
        .finish()
        .await
    } else {
        write_all(workers, plan, deadline, token, carried.clone()).await
    }
    .map_err(ServeFailure::from);
    debug!(
        target: "kvferry::timing",
        request_id = request.request_id,
        serve_us = t_plan.elapsed().as_micros() as u64,
        "serve done"
    );
    let path = carried.get().copied();
    ServeEnd::Ran(written.map(|bytes| (bytes, lease.payload, path)))
}

/// WRITEs every plan through its producer rank's engine, all concurrently, all
/// done by `deadline`. Returns the bytes written.
/// `token`: the consumer's grant token for this load, attached to every WRITE (`None`: the
/// consumer granted nothing; only an open consumer accepts the WRITEs then). `carried`: set to
/// the path of the first batch submitted.
pub(crate) async fn write_all(
    workers: Arc<Vec<Worker>>,
    plans: Vec<RankPlan>,
    deadline: Instant,
    token: Option<Token>,
    carried: Arc<OnceLock<TransferPath>>,
) -> Result<u64, WriteError> {
    let runs = plans.into_iter().map(|p| {
        let workers = workers.clone();
        let carried = carried.clone();
        async move {
            let w = &workers[p.rank];
            let (strided, copies) = futures::future::join(
                write_strided(w, p.segment.clone(), p.strided, deadline, token, &carried),
                write_rank(w, p.segment, p.copies, deadline, token, &carried),
            )
            .await;
            Ok::<u64, WriteError>(strided? + copies?)
        }
    });
    let mut total = 0u64;
    for r in futures::future::join_all(runs).await {
        total += r?;
    }
    Ok(total)
}

/// A copy (`op`) of the plans in layer groups (`groups`: slot spans, in order, covering every
/// slot) from one blocking task, started at [`GroupedWrite::finish`] (not at the first poll:
/// the caller's own setup runs beside the first group's submit): each group's copies as
/// batches of their own, submitted in order (so that, on one stream, the first group lands
/// first; a group of several batches submits them side by side, on threads of their own and
/// this one), then waited for in order there, `progress` told from that thread as each group
/// has landed, the last one included: its CONTINUE reaches the consumer ahead of the FINISH,
/// which goes through the serve task and the loop first, so the consumer starts the last
/// group's checksums that much earlier. With `queued`, a group whose batches all have device
/// points is told there at its submit instead ([`Queued`]), and the caller may submit groups
/// on its own thread first ([`GroupedWrite::submit_here`]). One hop off the event loop per
/// load instead of one per batch. Every batch submitted is waited for, a failure or not, all
/// by `deadline`; no group is submitted after a failure. `finish`'s future gives the bytes
/// written; `carried` is set to the path of the first batch submitted.
pub(crate) struct GroupedWrite<P> {
    workers: Arc<Vec<Worker>>,
    plans: Vec<RankPlan>,
    groups: Vec<Range<u32>>,
    op: Op,
    deadline: Instant,
    token: Option<Token>,
    progress: P,
    queued: Option<Queued>,
    carried: Arc<OnceLock<TransferPath>>,
    stop: Arc<AtomicBool>,
    /// `None` once [`GroupedWrite::finish`]'s task took it.
    carry: Option<Carry>,
}

impl<P: Fn(LayerSpan) + Send + 'static> GroupedWrite<P> {
    /// Nothing submitted yet.
    #[allow(clippy::too_many_arguments)] // the load's parts, each its own
    pub(crate) fn new(
        workers: Arc<Vec<Worker>>,
        plans: Vec<RankPlan>,
        groups: &[Range<u32>],
        op: Op,
        deadline: Instant,
        token: Option<Token>,
        progress: P,
        queued: Option<Queued>,
        carried: Arc<OnceLock<TransferPath>>,
        stop: Arc<AtomicBool>,
    ) -> Self {
        let carry = Carry::new(queued.is_some());
        GroupedWrite {
            workers,
            plans,
            groups: groups.to_vec(),
            op,
            deadline,
            token,
            progress,
            queued,
            carried,
            stop,
            carry: Some(carry),
        }
    }

    /// Submits the next group on this thread, where its copies are told as queued device work
    /// (`queued`, and every group before it was) and it is one batch to a segment already
    /// open: a device submit only enqueues (tens of microseconds), less than a hop to the
    /// blocking pool, and the caller may queue the group's checksums from the same thread
    /// before the next group's copies (no two threads taking the driver's locks in turn).
    /// Whether it did: else that group and the rest go to the blocking task, as does
    /// everything after a failure. A submit may still block where the peer's memory is not
    /// mapped here yet (its first transfers import it, within the engine's handshake
    /// timeout): callers ask only where an earlier transfer to it succeeded.
    pub(crate) fn submit_here(&mut self) -> bool {
        let Some(carry) = self.carry.as_mut() else {
            return false;
        };
        if self.queued.is_none() || !carry.queueing || carry.failed.is_some() {
            return false;
        }
        let next = carry.next;
        let (workers, carried, token) = (&self.workers, &self.carried, self.token);
        let submit = |j| submit_job(workers, j, token, carried, true);
        let open = |j: &Job| workers[j.rank].engine.has_segment(&j.segment);
        GroupRun {
            workers,
            plans: &self.plans,
            groups: &self.groups,
            op: self.op,
            deadline: self.deadline,
            submit: &submit,
            progress: &self.progress,
            queued: self.queued.as_deref(),
            thread: submit_thread,
            stop: &self.stop,
        }
        .submit(carry, next + 1, Some(&open));
        carry.next > next && carry.failed.is_none()
    }

    /// The groups not submitted yet, submitted on a blocking task, and every group waited for
    /// there: the future gives the bytes written, or the first failure.
    pub(crate) fn finish(mut self) -> impl std::future::Future<Output = Result<u64, WriteError>> {
        let deadline = self.deadline;
        let first = self.plans.first().map(|p| self.workers[p.rank].rank);
        let run = first.map(|_| {
            tokio::task::spawn_blocking(move || {
                let Some(mut carry) = self.carry.take() else {
                    return Ok(0); // taken only here
                };
                let points = self.queued.is_some();
                let (workers, carried, token) = (&self.workers, &self.carried, self.token);
                let submit = |j| submit_job(workers, j, token, carried, points);
                let run = GroupRun {
                    workers,
                    plans: &self.plans,
                    groups: &self.groups,
                    op: self.op,
                    deadline,
                    submit: &submit,
                    progress: &self.progress,
                    queued: self.queued.as_deref(),
                    thread: submit_thread,
                    stop: &self.stop,
                };
                run.submit(&mut carry, self.groups.len(), None);
                run.settle_all(carry)
            })
        });
        async move {
            let (Some(first), Some(run)) = (first, run) else {
                return Ok(0);
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let at = |kind: WriteErrorKind| WriteError { rank: first, kind };
            match tokio::time::timeout(left, run).await {
                // The task still waits for what it submitted, by the same deadline.
                Err(_) => Err(at(WriteErrorKind::GroupsTimeout(left))),
                Ok(Err(e)) => Err(at(WriteErrorKind::Task(e))),
                Ok(Ok(r)) => r,
            }
        }
    }
}

impl<P> Drop for GroupedWrite<P> {
    /// Dropped before [`GroupedWrite::finish`] (its caller unwound): the batches submitted here
    /// are still waited for, by the deadline, on the blocking pool where a runtime runs (else
    /// here). Their copies may still land, and an engine keeps a batch until a wait ends it.
    fn drop(&mut self) {
        let Some(carry) = self.carry.take() else {
            return;
        };
        if carry.submitted.is_empty() {
            return;
        }
        let (workers, deadline) = (self.workers.clone(), self.deadline);
        let settle = move || {
            for (rank, batch) in carry.submitted.into_iter().flat_map(|g| g.1) {
                let w = &workers[rank];
                let r = w
                    .engine
                    .wait(batch, deadline.saturating_duration_since(Instant::now()));
                free_if_timed_out(w, batch, &r);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => drop(h.spawn_blocking(settle)),
            Err(_) => settle(),
        }
    }
}

/// Told that a layer group's copies were all enqueued as device work here, with the device
/// points after which they are in place, per worker whose engine submitted any (`None`: none
/// did, though another's may write its memory): work ordered after them on the device (the
/// group's checksums) may start before the copies end ([`GroupedWrite`]).
pub(crate) type Queued = Box<TellQueued<'static>>;

/// The function a [`Queued`] boxes: the group's span and its points per worker.
pub(crate) type TellQueued<'a> = dyn Fn(LayerSpan, Vec<Option<Vec<StreamPoint>>>) + Send + 'a;

/// A thread that opens and submits one batch of a layer group.
fn submit_thread() -> std::thread::Builder {
    std::thread::Builder::new().name("kvferry-submit".into())
}

/// A [`GroupedWrite`]'s work on one thread that may block: every group submitted, then each
/// waited for.
#[cfg(test)]
#[allow(clippy::too_many_arguments)] // the load's parts, each its own
fn write_groups_blocking(
    workers: &[Worker],
    plans: &[RankPlan],
    groups: &[Range<u32>],
    op: Op,
    deadline: Instant,
    submit: &(dyn Fn(Job) -> Result<Submitted, WriteError> + Sync),
    progress: &dyn Fn(LayerSpan),
    queued: Option<&TellQueued<'_>>,
    thread: fn() -> std::thread::Builder,
    stop: &AtomicBool,
) -> Result<u64, WriteError> {
    let run = GroupRun {
        workers,
        plans,
        groups,
        op,
        deadline,
        submit,
        progress,
        queued,
        thread,
        stop,
    };
    let mut carry = Carry::new(queued.is_some());
    run.submit(&mut carry, groups.len(), None);
    run.settle_all(carry)
}

/// A grouped write's parts ([`GroupedWrite`]). A group of several batches submits each but
/// the last on a thread from `thread`, the last on the calling one; a thread the OS refuses
/// fails the load ([`WriteErrorKind::NoThread`]) instead of the process.
struct GroupRun<'a> {
    workers: &'a [Worker],
    plans: &'a [RankPlan],
    groups: &'a [Range<u32>],
    op: Op,
    deadline: Instant,
    submit: &'a (dyn Fn(Job) -> Result<Submitted, WriteError> + Sync),
    progress: &'a dyn Fn(LayerSpan),
    queued: Option<&'a TellQueued<'a>>,
    thread: fn() -> std::thread::Builder,
    stop: &'a AtomicBool,
}

/// Where a grouped write stands between calls of [`GroupRun::submit`]: the bytes of the groups
/// submitted, the first failure, the groups not waited for yet (index, batches, told as
/// queued), whether groups are still told as queued, and the next group to submit.
struct Carry {
    bytes: u64,
    failed: Option<WriteError>,
    submitted: std::collections::VecDeque<SubmittedGroup>,
    queueing: bool,
    next: usize,
}

/// A group submitted and not yet waited for: its index, its batches (the rank's index into
/// the workers and the batch), and whether it was told as queued.
type SubmittedGroup = (usize, Vec<(usize, BatchId)>, bool);

impl Carry {
    fn new(queueing: bool) -> Carry {
        Carry {
            bytes: 0,
            failed: None,
            submitted: std::collections::VecDeque::new(),
            queueing,
            next: 0,
        }
    }
}

impl GroupRun<'_> {
    /// Waits for group `i`'s batches (by the deadline), then tells its progress unless something
    /// failed or it was told as queued.
    fn settle(&self, (i, batches, told): SubmittedGroup, failed: &mut Option<WriteError>) {
        for (rank, batch) in batches {
            let w = &self.workers[rank];
            let left = self.deadline.saturating_duration_since(Instant::now());
            let t = Instant::now();
            let r = w.engine.wait(batch, left);
            free_if_timed_out(w, batch, &r);
            tracing::debug!(
                target: "kvferry::timing",
                wait_us = t.elapsed().as_micros() as u64,
                "serve waited"
            );
            if let Err(e) = r {
                failed.get_or_insert(WriteError {
                    rank: w.rank,
                    kind: WriteErrorKind::Transfer(e),
                });
            }
        }
        if failed.is_none() && !told {
            (self.progress)(LayerSpan {
                first: self.groups[i].start,
                end: self.groups[i].end,
            });
        }
    }

    /// Waits for every group submitted and not waited for yet; the bytes written, or the first
    /// failure.
    fn settle_all(&self, mut c: Carry) -> Result<u64, WriteError> {
        for group in std::mem::take(&mut c.submitted) {
            self.settle(group, &mut c.failed);
        }
        match c.failed {
            Some(e) => Err(e),
            None => Ok(c.bytes),
        }
    }

    /// Submits groups `c.next..upto` in order (none after a failure, nor once the load is
    /// stopped), telling each as queued where it has every batch's device points, and waits
    /// for (and tells) the earlier groups that have landed meanwhile. With `only`, a group is
    /// submitted only if it is one batch that `only` accepts; else nothing more is, and
    /// `c.next` stays at it.
    fn submit(&self, c: &mut Carry, upto: usize, only: Option<&dyn Fn(&Job) -> bool>) {
        let (workers, submit) = (self.workers, self.submit);
        while c.next < upto.min(self.groups.len()) && c.failed.is_none() {
            let (i, g) = (c.next, &self.groups[c.next]);
            // Set when the load was dropped: no group is submitted after it (a consumer's reads
            // would land in blocks its caller may have given to another request).
            if self.stop.load(Ordering::Acquire) {
                if let Some(p) = self.plans.first() {
                    c.failed.get_or_insert(WriteError {
                        rank: workers[p.rank].rank,
                        kind: WriteErrorKind::Stopped,
                    });
                }
                break;
            }
            let mut jobs = Vec::new();
            let mut bytes = 0u64;
            for p in self
                .plans
                .iter()
                .map(|p| p.layer_part(g))
                .filter(|p| !p.is_empty())
            {
                bytes = bytes.saturating_add(plan_bytes(&p));
                if !p.strided.is_empty() {
                    let requests = Submission::Strided(strided_requests(p.strided, self.op));
                    jobs.push(Job {
                        rank: p.rank,
                        segment: p.segment.clone(),
                        requests,
                    });
                }
                for chunk in p.copies.chunks(per_batch(p.copies.len()).max(1)) {
                    jobs.push(Job {
                        rank: p.rank,
                        segment: p.segment.clone(),
                        requests: Submission::Plain(requests(chunk, self.op)),
                    });
                }
            }
            if let Some(only) = only {
                if jobs.len() != 1 || !only(&jobs[0]) {
                    return;
                }
            }
            c.bytes = c.bytes.saturating_add(bytes);
            c.next = i + 1;
            // A job run on this thread whose submit panics fails the load as one on a thread
            // of its own does, and the batches submitted before it are still waited for.
            let here = |j: Job| {
                let rank = workers[j.rank].rank;
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| submit(j))).unwrap_or(Err(
                    WriteError {
                        rank,
                        kind: WriteErrorKind::SubmitPanicked,
                    },
                ))
            };
            let results: Vec<_> = match jobs.len() {
                0 | 1 => jobs.into_iter().map(here).collect(),
                _ => std::thread::scope(|s| {
                    // The last job runs on this thread, beside the others: one thread fewer to
                    // start per group (a start costs tens of microseconds, about a device
                    // submit). A thread the OS refuses ends the group there: the jobs not yet
                    // started, the last one included, are never submitted; those started are
                    // waited for (below) as after any failure.
                    let last = jobs.pop();
                    let mut running = Vec::new();
                    let mut refused = None;
                    for j in jobs {
                        let rank = j.rank;
                        match (self.thread)().spawn_scoped(s, move || submit(j)) {
                            Ok(h) => running.push((rank, h)),
                            Err(e) => {
                                refused = Some(WriteError {
                                    rank: workers[rank].rank,
                                    kind: WriteErrorKind::NoThread(e),
                                });
                                break;
                            }
                        }
                    }
                    let inline = last.filter(|_| refused.is_none()).map(here);
                    let mut joined: Vec<_> = running
                        .into_iter()
                        .map(|(rank, h)| {
                            h.join().unwrap_or_else(|_| {
                                Err(WriteError {
                                    rank: workers[rank].rank,
                                    kind: WriteErrorKind::SubmitPanicked,
                                })
                            })
                        })
                        .collect();
                    joined.extend(inline);
                    joined.extend(refused.map(Err));
                    joined
                }),
            };
            let mut batches = Vec::with_capacity(results.len());
            let mut points: Vec<Option<Vec<StreamPoint>>> = vec![None; workers.len()];
            for r in results {
                match r {
                    Ok((rank, batch, p)) => {
                        batches.push((rank, batch));
                        match p {
                            Some(p) => points[rank].get_or_insert_with(Vec::new).extend(p),
                            None => c.queueing = false,
                        }
                    }
                    Err(e) => {
                        c.failed.get_or_insert(e);
                    }
                }
            }
            // Groups are told as queued while each has every batch's device points, from the
            // first on: a group told as landed must come before any later one is told (spans
            // follow on).
            let told = match self.queued {
                Some(tell) if c.queueing && c.failed.is_none() => {
                    tell(
                        LayerSpan {
                            first: g.start,
                            end: g.end,
                        },
                        points,
                    );
                    true
                }
                _ => false,
            };
            c.submitted.push_back((i, batches, told));
            if c.failed.is_some() {
                break;
            }
            // The earlier groups that have landed meanwhile are told now, not after the last
            // submit: their layers are checksummed while the rest is copied.
            while let Some(group) = c.submitted.pop_front() {
                let done = group
                    .1
                    .iter()
                    .all(|(rank, b)| workers[*rank].engine.status(*b).is_final());
                if !done || group.0 == i {
                    c.submitted.push_front(group);
                    break;
                }
                self.settle(group, &mut c.failed);
            }
        }
    }
}

async fn write_rank(
    w: &Worker,
    segment: String,
    copies: Vec<Copy>,
    deadline: Instant,
    token: Option<Token>,
    carried: &Arc<OnceLock<TransferPath>>,
) -> Result<u64, WriteError> {
    if copies.is_empty() {
        return Ok(0);
    }
    let bytes: u64 = copies.iter().map(|c| c.len).sum();
    let per = per_batch(copies.len());
    let runs = copies
        .chunks(per)
        .map(|part| write_batch(w, segment.clone(), part, deadline, token, carried));
    for r in futures::future::join_all(runs).await {
        r?;
    }
    Ok(bytes)
}

/// WRITEs the whole-block copies as one engine batch of strided requests (one per entry):
/// validated per block, and on the CUDA IPC path copied by one launch without a request per
/// copy; other transports get them cut into slices by the engine. Returns the bytes written.
async fn write_strided(
    w: &Worker,
    segment: String,
    strided: Vec<BlockCopies>,
    deadline: Instant,
    token: Option<Token>,
    carried: &Arc<OnceLock<TransferPath>>,
) -> Result<u64, WriteError> {
    if strided.iter().all(BlockCopies::is_empty) {
        return Ok(0);
    }
    let requests = strided_requests(strided, Op::Write);
    let bytes = requests
        .iter()
        .fold(0u64, |a, r| a.saturating_add(r.bytes()));
    let requests = Submission::Strided(requests);
    submit_and_wait(w, segment, requests, deadline, token, carried).await?;
    Ok(bytes)
}

/// Submits `copies` as one engine batch (off the event loop) and waits for it, by `deadline`.
async fn write_batch(
    w: &Worker,
    segment: String,
    copies: &[Copy],
    deadline: Instant,
    token: Option<Token>,
    carried: &Arc<OnceLock<TransferPath>>,
) -> Result<(), WriteError> {
    let requests = Submission::Plain(requests(copies, Op::Write));
    submit_and_wait(w, segment, requests, deadline, token, carried).await
}

/// Submits one batch (off the event loop) and waits for it, by `deadline`.
async fn submit_and_wait(
    w: &Worker,
    segment: String,
    requests: Submission,
    deadline: Instant,
    token: Option<Token>,
    carried: &Arc<OnceLock<TransferPath>>,
) -> Result<(), WriteError> {
    let batch = submit(w, segment, requests, deadline, token, carried.clone()).await?;
    wait_batch(w, batch, deadline).await
}

/// Submits one batch (off the event loop) by `deadline`, and returns its id.
async fn submit(
    w: &Worker,
    segment: String,
    requests: Submission,
    deadline: Instant,
    token: Option<Token>,
    carried: Arc<OnceLock<TransferPath>>,
) -> Result<BatchId, WriteError> {
    let rank = w.rank;
    let at = |kind: WriteErrorKind| WriteError { rank, kind };
    let engine = w.engine.clone();
    let submit = tokio::task::spawn_blocking(move || {
        submit_blocking(&engine, segment, &requests, token, &carried, false).map(|(b, _)| b)
    });
    let left = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout(left, submit).await {
        Err(_) => Err(at(WriteErrorKind::OpenTimeout(left))),
        Ok(Err(e)) => Err(at(WriteErrorKind::Task(e))),
        Ok(Ok(r)) => r.map_err(at),
    }
}

/// Waits for `batch` of `w`'s engine, by `deadline`.
async fn wait_batch(w: &Worker, batch: BatchId, deadline: Instant) -> Result<(), WriteError> {
    let rank = w.rank;
    let at = |kind: WriteErrorKind| WriteError { rank, kind };
    let left = deadline.saturating_duration_since(Instant::now());
    let t = Instant::now();
    let r = w.engine.wait_async(batch, left).await;
    free_if_timed_out(w, batch, &r);
    r.map_err(|e| at(WriteErrorKind::Transfer(e)))?;
    tracing::debug!(
        target: "kvferry::timing",
        wait_us = t.elapsed().as_micros() as u64,
        "serve waited"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_checksum::group::RankInfo;
    use kvferry_kernels::{CpuBackend, Location};
    use kvferry_transfer::{EngineConfig, TransferEngine, TransferRequest, TransportKind};

    /// An engine on a loopback TCP port the OS picks.
    fn loopback() -> Arc<TransferEngine> {
        TransferEngine::new(EngineConfig {
            host: "127.0.0.1".into(),
            port: 0,
            transport: TransportKind::Tcp,
            ..EngineConfig::default()
        })
        .unwrap()
    }

    /// The single rank's worker on `engine`, with host KV and one checksum thread.
    fn host_worker(engine: Arc<TransferEngine>) -> Worker {
        Worker {
            rank: RankInfo::SINGLE,
            engine,
            device: Location::Cpu,
            groups: Vec::new(),
            backend: Arc::new(CpuBackend::new(1)),
        }
    }

    /// A serve's wait that runs past its deadline frees the batch: the engine keeps a
    /// timed-out batch for a later wait, which a serve never makes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_whose_wait_timed_out_is_freed() {
        use kvferry_transfer::BatchStatus;
        let (a, b) = (loopback(), loopback());
        const LEN: u64 = 64 << 20;
        let (src, dst) = (vec![1u8; LEN as usize], vec![0u8; LEN as usize]);
        let (s, d) = (src.as_ptr() as u64, dst.as_ptr() as u64);
        // SAFETY: both buffers outlive the engines' use of them (unregistered below, which
        // waits for the accesses in flight, before they drop).
        unsafe {
            a.register_memory(s, LEN, Location::Cpu).unwrap();
            b.register_memory(d, LEN, Location::Cpu).unwrap();
        }
        let target = a.open_segment(&b.segment_name()).unwrap();
        let w = host_worker(a.clone());
        let copy = |i: u64| TransferRequest {
            op: Op::Write,
            local_addr: s + i * (LEN / 64),
            remote_addr: d + i * (LEN / 64),
            len: LEN / 64,
        };
        let requests: Vec<_> = (0..64).map(copy).collect();
        let batch = a.submit(&target, &requests).unwrap();
        // A deadline already passed: 64 MiB over loopback is not done the moment it is
        // submitted, so the wait times out.
        let r = wait_batch(&w, batch, Instant::now()).await;
        assert!(
            matches!(
                &r,
                Err(WriteError {
                    kind: WriteErrorKind::Transfer(kvferry_transfer::TransferError::Timeout(_)),
                    ..
                })
            ),
            "{r:?}"
        );
        assert_eq!(a.status(batch), BatchStatus::Invalid);
        a.unregister_memory(s).unwrap();
        b.unregister_memory(d).unwrap();
    }

    /// A builder whose thread the OS cannot start: a stack larger than any address space.
    fn refused_thread() -> std::thread::Builder {
        std::thread::Builder::new().stack_size(1 << 60)
    }

    /// A layer group of several batches whose submit thread the OS refuses fails the load
    /// with a typed error, submitting nothing more, instead of panicking the producer.
    #[test]
    fn a_submit_thread_the_os_refuses_fails_the_load() {
        let workers = vec![host_worker(loopback())];
        // One plain copy and one strided block in the same layer: two batches, two threads.
        let plan = two_copies(0);
        let (submitted, submit) = counting_submit();
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        let r = write_groups_blocking(
            &workers,
            &[plan],
            &[Range { start: 0, end: 1 }],
            Op::Write,
            deadline,
            &submit,
            &|_| {},
            None,
            refused_thread,
            &AtomicBool::new(false),
        );
        let e = r.unwrap_err();
        assert!(matches!(e.kind, WriteErrorKind::NoThread(_)), "{e:?}");
        assert!(e.to_string().contains("starting a thread"), "{e}");
        assert_eq!(submitted.load(Ordering::SeqCst), 0);
    }

    /// A load dropped by its caller (its stop flag set) submits no further layer group and
    /// fails with `Stopped`.
    #[test]
    fn a_stopped_load_submits_nothing_more() {
        let workers = vec![host_worker(loopback())];
        let (submitted, submit) = counting_submit();
        let r = write_groups_blocking(
            &workers,
            &[two_copies(1)],
            &[Range { start: 0, end: 1 }, Range { start: 1, end: 2 }],
            Op::Read,
            Instant::now() + std::time::Duration::from_secs(5),
            &submit,
            &|_| {},
            None,
            submit_thread,
            &AtomicBool::new(true),
        );
        let e = r.unwrap_err();
        assert!(matches!(e.kind, WriteErrorKind::Stopped), "{e:?}");
        assert_eq!(submitted.load(Ordering::SeqCst), 0);
    }

    /// One plain copy (layer slot 0) and one strided block (slot `strided_slot`) of one byte.
    fn two_copies(strided_slot: u32) -> RankPlan {
        let one = Copy {
            src: 0,
            dst: 0,
            len: 1,
        };
        RankPlan {
            rank: 0,
            segment: "127.0.0.1:1".into(),
            copies: vec![one],
            copy_layers: vec![(0, 1)],
            strided: vec![BlockCopies {
                ranges: vec![one],
                blocks: vec![(0, 0)],
                layers: vec![(strided_slot, 1)],
            }],
        }
    }

    /// A submit that counts its calls (the first value) and fails each.
    #[allow(clippy::type_complexity)] // a counter and a closure, for two tests
    fn counting_submit() -> (
        Arc<std::sync::atomic::AtomicUsize>,
        impl Fn(Job) -> Result<Submitted, WriteError> + Sync,
    ) {
        let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = n.clone();
        let submit = move |_job: Job| -> Result<Submitted, WriteError> {
            count.fetch_add(1, Ordering::SeqCst);
            Err(WriteError {
                rank: RankInfo::SINGLE,
                kind: WriteErrorKind::SubmitPanicked,
            })
        };
        (n, submit)
    }

    /// The first group goes on the caller's thread only when it is one batch that the caller
    /// accepts (a segment already open): otherwise nothing is submitted there, and the
    /// blocking task starts from that group.
    #[test]
    fn a_group_is_submitted_on_the_callers_thread_only_as_one_accepted_batch() {
        let workers = vec![host_worker(loopback())];
        let (submitted, submit) = counting_submit();
        let groups = [Range { start: 0, end: 1 }, Range { start: 1, end: 2 }];
        let stop = AtomicBool::new(false);
        let run = |plans| GroupRun {
            workers: &workers,
            plans,
            groups: &groups,
            op: Op::Read,
            deadline: Instant::now() + std::time::Duration::from_secs(5),
            submit: &submit,
            progress: &|_| {},
            queued: None,
            thread: submit_thread,
            stop: &stop,
        };
        let count = || submitted.load(Ordering::SeqCst);
        // Group 0 a plain copy (one batch), group 1 a strided block.
        let one = [two_copies(1)];
        let mut c = Carry::new(false);
        run(&one).submit(&mut c, 1, Some(&|_: &Job| false));
        assert_eq!((c.next, count()), (0, 0));
        run(&one).submit(&mut c, 1, Some(&|j: &Job| j.segment == "127.0.0.1:1"));
        assert_eq!((c.next, count()), (1, 1));
        // Its submit failed: nothing more is submitted, whoever asks.
        run(&one).submit(&mut c, 2, None);
        assert_eq!((c.next, count()), (1, 1));
        assert!(run(&one).settle_all(c).is_err());
        // Both copies in group 0: two batches, never on the caller's thread.
        let two = [two_copies(0)];
        let mut c = Carry::new(false);
        run(&two).submit(&mut c, 1, Some(&|_: &Job| true));
        assert_eq!((c.next, count()), (0, 1));
    }

    /// A producer engine `a` and a consumer engine `b` on loopback, each with [`GROUPED_LEN`]
    /// bytes registered (`src`: a pattern, `dst`: zeros), and the `plan` of two layer groups
    /// of two batches each: a plain copy and a strided block, a quarter of the bytes each.
    /// The producer's worker on `a`, and the batches its submits made (`submit`).
    struct Grouped {
        a: Arc<TransferEngine>,
        b: Arc<TransferEngine>,
        src: Vec<u8>,
        dst: Vec<u8>,
        plan: RankPlan,
        workers: Vec<Worker>,
        carried: OnceLock<TransferPath>,
        batches: std::sync::Mutex<Vec<BatchId>>,
    }

    impl Grouped {
        /// Submits `j` through the worker, noting the batch.
        fn submit(&self, j: Job) -> Result<Submitted, WriteError> {
            let r = submit_job(&self.workers, j, None, &self.carried, false);
            if let Ok((_, batch, _)) = &r {
                self.batches.lock().unwrap().push(*batch);
            }
            r
        }

        /// Writes the two groups through `submit` by a deadline 20 s away.
        fn run(
            &self,
            submit: &(dyn Fn(Job) -> Result<Submitted, WriteError> + Sync),
            progress: &dyn Fn(LayerSpan),
            queued: Option<&TellQueued<'_>>,
        ) -> Result<u64, WriteError> {
            write_groups_blocking(
                &self.workers,
                std::slice::from_ref(&self.plan),
                &[Range { start: 0, end: 1 }, Range { start: 1, end: 2 }],
                Op::Write,
                Instant::now() + std::time::Duration::from_secs(20),
                submit,
                progress,
                queued,
                submit_thread,
                &AtomicBool::new(false),
            )
        }

        /// The batches submitted; each, if waited for, is freed (`Invalid`) by now.
        fn batches_waited_for(&self) -> Vec<bool> {
            let batches = self.batches.lock().unwrap();
            let invalid = |b: &BatchId| self.a.status(*b) == kvferry_transfer::BatchStatus::Invalid;
            batches.iter().map(invalid).collect()
        }

        /// Unregisters both buffers (waiting for the accesses in flight); returns them.
        fn end(self) -> (Vec<u8>, Vec<u8>) {
            self.a.unregister_memory(self.src.as_ptr() as u64).unwrap();
            self.b.unregister_memory(self.dst.as_ptr() as u64).unwrap();
            (self.src, self.dst)
        }
    }

    /// A grouped write dropped before `finish` (its caller unwound between submits) still
    /// waits for the batches it submitted on the caller's thread: the engine frees each
    /// once waited for, and their copies end before the bytes could be reused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grouped_write_dropped_unfinished_waits_for_what_it_submitted() {
        let g = two_groups_of_two_batches();
        // One batch a group: the plain copies only.
        let mut plan = g.plan.clone();
        plan.strided.clear();
        g.a.open_segment(&plan.segment).unwrap();
        let queued: Queued = Box::new(|_, _| {});
        let mut w = GroupedWrite::new(
            Arc::new(g.workers.clone()),
            vec![plan],
            &[Range { start: 0, end: 1 }, Range { start: 1, end: 2 }],
            Op::Write,
            Instant::now() + std::time::Duration::from_secs(20),
            None,
            |_| {},
            Some(queued),
            Arc::new(OnceLock::new()),
            Arc::new(AtomicBool::new(false)),
        );
        assert!(w.submit_here(), "one batch to an open segment");
        // TCP gives no device points: the next group is not the caller's.
        assert!(!w.submit_here());
        let carry = w.carry.as_ref().unwrap();
        let batch = carry.submitted[0].1[0].1;
        drop(w);
        let until = Instant::now() + std::time::Duration::from_secs(10);
        while g.a.status(batch) != kvferry_transfer::BatchStatus::Invalid {
            assert!(Instant::now() < until, "never waited for");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        g.end();
    }

    /// Registers the buffers and plans the load of a [`Grouped`].
    fn two_groups_of_two_batches() -> Grouped {
        const Q: u64 = GROUPED_LEN / 4;
        let (a, b) = (loopback(), loopback());
        let src: Vec<u8> = (0..GROUPED_LEN).map(|i| (i % 251) as u8).collect();
        let dst = vec![0u8; GROUPED_LEN as usize];
        let (s, d) = (src.as_ptr() as u64, dst.as_ptr() as u64);
        // SAFETY: both buffers outlive the engines' use of them (the callers unregister them,
        // which waits for the accesses in flight, before they drop).
        unsafe {
            a.register_memory(s, GROUPED_LEN, Location::Cpu).unwrap();
            b.register_memory(d, GROUPED_LEN, Location::Cpu).unwrap();
        }
        let quarter = |i: u64| Copy {
            src: s + i * Q,
            dst: d + i * Q,
            len: Q,
        };
        let plan = RankPlan {
            rank: 0,
            segment: b.segment_name(),
            copies: vec![quarter(0), quarter(2)],
            copy_layers: vec![(0, 1), (1, 1)],
            strided: vec![BlockCopies {
                ranges: vec![Copy {
                    src: 0,
                    dst: 0,
                    len: Q,
                }],
                blocks: vec![(s + Q, d + Q), (s + 3 * Q, d + 3 * Q)],
                layers: vec![(0, 1), (1, 1)],
            }],
        };
        Grouped {
            workers: vec![host_worker(a.clone())],
            a,
            b,
            src,
            dst,
            plan,
            carried: OnceLock::new(),
            batches: std::sync::Mutex::new(Vec::new()),
        }
    }

    const GROUPED_LEN: u64 = 1 << 20;

    /// A load of two layer groups of two batches each (one submitted on a thread of its own,
    /// one on the groups' thread): both land, each group is told once and in order, every
    /// batch submitted is waited for (a waited batch is freed), and the bytes are equal.
    #[test]
    fn a_grouped_load_waits_for_every_batch_and_tells_each_group_in_order() {
        let g = two_groups_of_two_batches();
        let told = std::sync::Mutex::new(Vec::new());
        let r = g.run(
            &|j| g.submit(j),
            &|span| told.lock().unwrap().push((span.first, span.end)),
            None,
        );
        assert_eq!(r.unwrap(), GROUPED_LEN);
        assert_eq!(*told.lock().unwrap(), [(0, 1), (1, 2)]);
        assert_eq!(g.batches_waited_for(), [true; 4]);
        let (src, dst) = g.end();
        assert!(src == dst, "the bytes differ");
    }

    /// A group whose every batch has device points is told as queued at its submit, and not
    /// again as it lands; from the first group with a batch without them, every group is told
    /// as it lands (a span told as landed must come before any later one: spans follow on).
    #[test]
    fn groups_with_device_points_are_told_queued_once_until_one_has_none() {
        type Spans = Vec<(u32, u32)>;
        // The submit (0..4, two a group, the groups in turn) whose batch has no points: one of
        // group 1's makes that group a mixed one, which goes by landed.
        let cases: [(Option<usize>, Spans, Spans); 4] = [
            (None, vec![(0, 1), (1, 2)], vec![]),
            (Some(2), vec![(0, 1)], vec![(1, 2)]),
            (Some(3), vec![(0, 1)], vec![(1, 2)]),
            (Some(0), vec![], vec![(0, 1), (1, 2)]),
        ];
        for (without, want_queued, want_landed) in cases {
            let g = two_groups_of_two_batches();
            let n = std::sync::atomic::AtomicUsize::new(0);
            let submit = |j: Job| {
                let i = n.fetch_add(1, Ordering::SeqCst);
                let (rank, batch, _) = g.submit(j)?;
                Ok((rank, batch, (Some(i) != without).then(Vec::new)))
            };
            let (queued, landed) = (
                std::sync::Mutex::new(Vec::new()),
                std::sync::Mutex::new(Vec::new()),
            );
            let tell = |span: LayerSpan, points: Vec<Option<Vec<StreamPoint>>>| {
                assert_eq!(points.len(), 1, "one list a worker");
                assert!(
                    points[0].is_some(),
                    "the worker submitted the group's batches"
                );
                queued.lock().unwrap().push((span.first, span.end));
            };
            let r = g.run(
                &submit,
                &|span| landed.lock().unwrap().push((span.first, span.end)),
                Some(&tell),
            );
            assert_eq!(r.unwrap(), GROUPED_LEN);
            assert_eq!(*queued.lock().unwrap(), want_queued, "{without:?}");
            assert_eq!(*landed.lock().unwrap(), want_landed, "{without:?}");
            assert_eq!(
                g.batches_waited_for(),
                [true; 4],
                "every batch is still waited for"
            );
            let (src, dst) = g.end();
            assert!(src == dst, "the bytes differ");
        }
    }

    /// A submit that panics on the groups' own thread fails the load with a typed error, and
    /// the batch submitted beside it on a thread of its own is still waited for.
    #[test]
    fn a_submit_panicking_on_the_groups_thread_fails_the_load_and_waits_for_the_rest() {
        let g = two_groups_of_two_batches();
        // The plain copy is a group's last job (run on the groups' thread): it panics.
        let submit = |j: Job| {
            if matches!(j.requests, Submission::Plain(_)) {
                panic!("a submit that panics");
            }
            g.submit(j)
        };
        let e = g.run(&submit, &|_| {}, None).unwrap_err();
        assert!(matches!(e.kind, WriteErrorKind::SubmitPanicked), "{e:?}");
        // One batch, of the first group only: none is submitted after a failure.
        assert_eq!(g.batches_waited_for(), [true]);
        g.end();
    }

    /// A grouped load that runs past its deadline says so, not that opening the consumer's
    /// segment took too long (the groups' task opens, submits and waits).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grouped_load_past_its_deadline_names_the_groups() {
        let workers = Arc::new(vec![host_worker(loopback())]);
        // A segment whose listener never answers: the task's open waits for its handshake.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let plan = RankPlan {
            rank: 0,
            segment: silent.local_addr().unwrap().to_string(),
            copies: vec![Copy {
                src: 0,
                dst: 0,
                len: 1,
            }],
            copy_layers: vec![(0, 1)],
            strided: Vec::new(),
        };
        let groups = [Range { start: 0, end: 1 }];
        let carried = Arc::new(OnceLock::new());
        let r = GroupedWrite::new(
            workers,
            vec![plan],
            &groups,
            Op::Write,
            Instant::now(),
            None,
            |_| {},
            None,
            carried,
            Arc::new(AtomicBool::new(false)),
        )
        .finish();
        let r = r.await;
        let e = r.unwrap_err();
        assert!(matches!(e.kind, WriteErrorKind::GroupsTimeout(_)), "{e:?}");
        assert!(e.to_string().contains("layer groups did not land"), "{e}");
    }
}
