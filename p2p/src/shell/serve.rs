//! Serving one load on the producer (docs/design.md §4): plan the copies with
//! [`crate::proto::serve::plan`] and WRITE them through each producer rank's engine.

use std::sync::Arc;
use std::time::Instant;

use std::ops::Range;

use kvferry_transfer::{BatchId, Op, StridedRange, StridedRequest, Token, TransferRequest};
use tracing::debug;

use crate::proto::layout::RankLayout;
use crate::proto::msg::{LayerSpan, LoadRequest};
use crate::proto::plan::Copy;
use crate::proto::progress::{layer_groups, layer_slots};
use crate::proto::serve::{plan, BlockCopies, Published, RankPlan};
use crate::proto::serve_error::{ServeFailure, WriteError, WriteErrorKind};
use crate::worker::Worker;

/// How serving one load ended ([`serve_load`]).
#[derive(Debug)]
pub(crate) enum ServeEnd {
    /// The WRITEs ran: the bytes written and the lease's checksum payload (for the reply), or
    /// why they failed (the lease ends: bytes may have landed).
    Ran(Result<(u64, Option<Vec<u8>>), ServeFailure>),
    /// Refused before any WRITE (a grant token that does not parse, a request the plan
    /// refuses): why, and the lease, untouched, to be held again.
    Refused(ServeFailure, Published),
}

/// Serves one load (a `Serve` effect of the producer machine): parses the request's grant
/// token, plans the copies from `lease` to the consumer's ranks (`layouts`: the workers as the
/// planner sees them, same order) and WRITEs them by `deadline`: in layer groups of about
/// `group_bytes` ([`write_grouped`], `progress` told as each but the last lands), or in one
/// go ([`write_all`]). A token that does not parse or a request the plan refuses gives the
/// lease back ([`ServeEnd::Refused`]); otherwise the WRITEs' result ([`ServeEnd::Ran`]).
pub(crate) async fn serve_load(
    workers: Arc<Vec<Worker>>,
    layouts: Arc<Vec<RankLayout>>,
    lease: Published,
    request: LoadRequest,
    deadline: Instant,
    group_bytes: u64,
    progress: impl Fn(LayerSpan) + Send,
) -> ServeEnd {
    let token = match request.token.as_deref().map(str::parse::<Token>) {
        None => None,
        Some(Ok(t)) => Some(t),
        Some(Err(e)) => return ServeEnd::Refused(ServeFailure::Token(e), lease),
    };
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
    let written = if groups.len() > 1 {
        write_grouped(workers, plan, &groups, deadline, token, progress).await
    } else {
        write_all(workers, plan, deadline, token).await
    }
    .map_err(ServeFailure::from);
    debug!(
        target: "kvferry::timing",
        request_id = request.request_id,
        serve_us = t_plan.elapsed().as_micros() as u64,
        "serve done"
    );
    ServeEnd::Ran(written.map(|bytes| (bytes, lease.payload)))
}

/// WRITEs every plan through its producer rank's engine, all concurrently, all
/// done by `deadline`. Returns the bytes written.
/// `token`: the consumer's grant token for this load, attached to every WRITE (`None`: the
/// consumer granted nothing; only an open consumer accepts the WRITEs then).
pub(crate) async fn write_all(
    workers: Arc<Vec<Worker>>,
    plans: Vec<RankPlan>,
    deadline: Instant,
    token: Option<Token>,
) -> Result<u64, WriteError> {
    let runs = plans.into_iter().map(|p| {
        let workers = workers.clone();
        async move {
            let w = &workers[p.rank];
            let (strided, copies) = futures::future::join(
                write_strided(w, p.segment.clone(), p.strided, deadline, token),
                write_rank(w, p.segment, p.copies, deadline, token),
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

/// WRITEs the plans in layer groups (`groups`: slot spans, in order, covering every slot): each
/// group's copies as batches of their own, submitted in order (so that, on one stream, the
/// first group lands first), then waited for in order, `progress` told as each group but the
/// last has landed (the FINISH says the last). Every batch submitted is waited for, a failure
/// or not, all by `deadline`. Returns the bytes written.
pub(crate) async fn write_grouped(
    workers: Arc<Vec<Worker>>,
    plans: Vec<RankPlan>,
    groups: &[Range<u32>],
    deadline: Instant,
    token: Option<Token>,
    progress: impl Fn(LayerSpan),
) -> Result<u64, WriteError> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let submit = async {
        let mut bytes = 0u64;
        for (i, g) in groups.iter().enumerate() {
            let parts = plans
                .iter()
                .map(|p| p.layer_part(g))
                .filter(|p| !p.is_empty());
            let submits = parts.map(|p| {
                let w = &workers[p.rank];
                bytes = bytes.saturating_add(plan_bytes(&p));
                let plain = p.copies.chunks(per_batch(p.copies.len()).max(1));
                let plain: Vec<_> = plain.map(|c| Submission::Plain(requests(c))).collect();
                let strided = (!p.strided.is_empty()).then(|| strided_requests(p.strided));
                let all = strided.map(Submission::Strided).into_iter().chain(plain);
                let seg = p.segment;
                futures::future::join_all(all.map(move |s| {
                    let seg = seg.clone();
                    async move { (w, submit(w, seg, s, deadline, token).await) }
                }))
            });
            let submitted: Vec<_> = futures::future::join_all(submits).await;
            let submitted: Vec<_> = submitted.into_iter().flatten().collect();
            // No later group is submitted after a failure; those submitted are waited for.
            let failed = submitted.iter().any(|(_, b)| b.is_err());
            let _ = tx.send((i, submitted));
            if failed {
                break;
            }
        }
        drop(tx);
        bytes
    };
    let wait = async {
        let mut failed = None;
        while let Some((i, batches)) = rx.recv().await {
            for (w, batch) in batches {
                let r = match batch {
                    Ok(b) => wait_batch(w, b, deadline).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    failed.get_or_insert(e);
                }
            }
            if failed.is_none() && i + 1 < groups.len() {
                progress(LayerSpan {
                    first: groups[i].start,
                    end: groups[i].end,
                });
            }
        }
        failed
    };
    let (bytes, failed) = futures::future::join(submit, wait).await;
    match failed {
        Some(e) => Err(e),
        None => Ok(bytes),
    }
}

/// Bytes of a plan's copies.
fn plan_bytes(p: &RankPlan) -> u64 {
    let plain = p.copies.iter().fold(0u64, |a, c| a.saturating_add(c.len));
    p.strided.iter().fold(plain, |a, s| {
        let per = s.ranges.iter().fold(0u64, |a, r| a.saturating_add(r.len));
        a.saturating_add(per.saturating_mul(s.blocks.len() as u64))
    })
}

/// Requests per engine batch of one rank's WRITEs: a load of many small copies (scattered
/// blocks, per-token head slices) is cut into batches of this many, submitted on threads of
/// their own, so that the host work per request (validation, slicing, the copy descriptors)
/// runs on several cores and the first batch's copies start while later ones are prepared.
const REQUESTS_PER_BATCH: usize = 2048;
/// At most this many batches per rank and load (one per core of a typical host, with room).
const MAX_BATCHES: usize = 8;

/// How many batches `n` requests go in: one up to [`REQUESTS_PER_BATCH`], then one per
/// [`REQUESTS_PER_BATCH`] up to [`MAX_BATCHES`].
fn batches_for(n: usize) -> usize {
    n.div_ceil(REQUESTS_PER_BATCH).clamp(1, MAX_BATCHES)
}

/// Requests in each batch of `n` ([`batches_for`]).
fn per_batch(n: usize) -> usize {
    n.div_ceil(batches_for(n))
}

async fn write_rank(
    w: &Worker,
    segment: String,
    copies: Vec<Copy>,
    deadline: Instant,
    token: Option<Token>,
) -> Result<u64, WriteError> {
    if copies.is_empty() {
        return Ok(0);
    }
    let bytes: u64 = copies.iter().map(|c| c.len).sum();
    let per = per_batch(copies.len());
    let runs = copies
        .chunks(per)
        .map(|part| write_batch(w, segment.clone(), part, deadline, token));
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
) -> Result<u64, WriteError> {
    if strided.iter().all(BlockCopies::is_empty) {
        return Ok(0);
    }
    let requests = strided_requests(strided);
    let bytes = requests
        .iter()
        .fold(0u64, |a, r| a.saturating_add(r.bytes()));
    submit_and_wait(w, segment, Submission::Strided(requests), deadline, token).await?;
    Ok(bytes)
}

/// The whole-block copies as the engine's strided requests (one per entry).
fn strided_requests(strided: Vec<BlockCopies>) -> Vec<StridedRequest> {
    strided
        .into_iter()
        .map(|s| StridedRequest {
            op: Op::Write,
            ranges: s
                .ranges
                .iter()
                .map(|r| StridedRange {
                    local: r.src,
                    remote: r.dst,
                    len: r.len,
                })
                .collect(),
            blocks: s.blocks,
        })
        .collect()
}

/// What one engine batch carries.
enum Submission {
    Plain(Vec<TransferRequest>),
    Strided(Vec<StridedRequest>),
}

/// Submits `copies` as one engine batch (off the event loop) and waits for it, by `deadline`.
async fn write_batch(
    w: &Worker,
    segment: String,
    copies: &[Copy],
    deadline: Instant,
    token: Option<Token>,
) -> Result<(), WriteError> {
    let requests = requests(copies);
    submit_and_wait(w, segment, Submission::Plain(requests), deadline, token).await
}

/// Plain copies as the engine's WRITE requests.
fn requests(copies: &[Copy]) -> Vec<TransferRequest> {
    copies
        .iter()
        .map(|c| TransferRequest {
            op: Op::Write,
            local_addr: c.src,
            remote_addr: c.dst,
            len: c.len,
        })
        .collect()
}

/// Submits one batch (off the event loop) and waits for it, by `deadline`.
async fn submit_and_wait(
    w: &Worker,
    segment: String,
    requests: Submission,
    deadline: Instant,
    token: Option<Token>,
) -> Result<(), WriteError> {
    let batch = submit(w, segment, requests, deadline, token).await?;
    wait_batch(w, batch, deadline).await
}

/// Submits one batch (off the event loop) by `deadline`, and returns its id.
async fn submit(
    w: &Worker,
    segment: String,
    requests: Submission,
    deadline: Instant,
    token: Option<Token>,
) -> Result<BatchId, WriteError> {
    let rank = w.rank;
    let at = |kind: WriteErrorKind| WriteError { rank, kind };
    let engine = w.engine.clone();
    let submit = tokio::task::spawn_blocking(move || {
        let handle = match token {
            Some(t) => engine.open_segment_with_token(&segment, t),
            None => engine.open_segment(&segment),
        }
        .map_err(|source| WriteErrorKind::Open {
            segment: segment.clone(),
            source,
        })?;
        let t = Instant::now();
        let (r, n) = match &requests {
            Submission::Plain(r) => (engine.submit(&handle, r), r.len()),
            Submission::Strided(r) => (engine.submit_strided(&handle, r), r.len()),
        };
        let r = r.map_err(|source| WriteErrorKind::Submit { segment, source });
        tracing::debug!(
            target: "kvferry::timing",
            requests = n,
            submit_us = t.elapsed().as_micros() as u64,
            "serve submitted"
        );
        r
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
    w.engine
        .wait_async(batch, left)
        .await
        .map_err(|e| at(WriteErrorKind::Transfer(e)))?;
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

    #[test]
    fn small_loads_go_in_one_batch_large_ones_in_a_bounded_number() {
        assert_eq!(batches_for(1), 1);
        assert_eq!(batches_for(REQUESTS_PER_BATCH), 1);
        assert_eq!(batches_for(REQUESTS_PER_BATCH + 1), 2);
        assert_eq!(batches_for(16384), MAX_BATCHES);
        assert_eq!(batches_for(1 << 20), MAX_BATCHES);
    }
}
