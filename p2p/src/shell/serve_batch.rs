//! The engine batches a serve submits ([`super::serve`]): a plan's copies as the engine's
//! requests, cut into batches, each opened and submitted on the calling thread.

use std::sync::OnceLock;
use std::time::Instant;

use kvferry_transfer::{
    BatchId, Op, StreamPoint, StridedRange, StridedRequest, Token, TransferPath, TransferRequest,
};

use crate::proto::plan::Copy;
use crate::proto::serve::{BlockCopies, RankPlan};
use crate::proto::serve_error::{WriteError, WriteErrorKind};
use crate::worker::Worker;

/// What one submit made: the rank's index into the workers, the batch, and its device points
/// where they were asked for and cover the whole batch
/// (`TransferEngine::submit_strided_with_points`).
pub(super) type Submitted = (usize, BatchId, Option<Vec<StreamPoint>>);

/// One batch of a group: the rank's index into the workers, the consumer segment, the requests.
pub(super) struct Job {
    pub(super) rank: usize,
    pub(super) segment: String,
    pub(super) requests: Submission,
}

/// Opens the job's segment and submits its batch, on the calling thread (which may block),
/// asking for its device points if `points`. Returns the rank's index, the batch and its points.
pub(super) fn submit_job(
    workers: &[Worker],
    job: Job,
    token: Option<Token>,
    carried: &OnceLock<TransferPath>,
    points: bool,
) -> Result<Submitted, WriteError> {
    let w = &workers[job.rank];
    submit_blocking(
        &w.engine,
        job.segment,
        &job.requests,
        token,
        carried,
        points,
    )
    .map(|(b, p)| (job.rank, b, p))
    .map_err(|kind| WriteError { rank: w.rank, kind })
}

/// Bytes of a plan's copies.
pub(super) fn plan_bytes(p: &RankPlan) -> u64 {
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
pub(super) fn per_batch(n: usize) -> usize {
    n.div_ceil(batches_for(n))
}

/// The whole-block copies as the engine's strided requests (one per entry): `op` (a copy's
/// `src` offsets and block bases are local, its `dst` ones remote).
pub(super) fn strided_requests(strided: Vec<BlockCopies>, op: Op) -> Vec<StridedRequest> {
    strided
        .into_iter()
        .map(|s| StridedRequest {
            op,
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
pub(super) enum Submission {
    Plain(Vec<TransferRequest>),
    Strided(Vec<StridedRequest>),
}

/// Plain copies as the engine's requests: `op`, each copy's `src` local and `dst` remote.
pub(super) fn requests(copies: &[Copy], op: Op) -> Vec<TransferRequest> {
    copies
        .iter()
        .map(|c| TransferRequest {
            op,
            local_addr: c.src,
            remote_addr: c.dst,
            len: c.len,
        })
        .collect()
}

/// Opens `segment` on `engine` (with the consumer's grant `token`, if any) and submits
/// `requests` as one batch, on the calling thread (which may block: an open may connect); sets
/// `carried` to the path of the batch's first copy unless it is set. With `points`, a strided
/// batch's device points where it has them (`TransferEngine::submit_strided_with_points`;
/// plain copies have none).
pub(super) fn submit_blocking(
    engine: &kvferry_transfer::TransferEngine,
    segment: String,
    requests: &Submission,
    token: Option<Token>,
    carried: &OnceLock<TransferPath>,
    points: bool,
) -> Result<(BatchId, Option<Vec<StreamPoint>>), WriteErrorKind> {
    let handle = match token {
        Some(t) => engine.open_segment_with_token(&segment, t),
        None => engine.open_segment(&segment),
    }
    .map_err(|source| WriteErrorKind::Open {
        segment: segment.clone(),
        source,
    })?;
    if carried.get().is_none() {
        if let Some(Ok(p)) = first_copy(requests).map(|(l, r)| engine.transfer_path(&handle, l, r))
        {
            let _ = carried.set(p);
        }
    }
    let t = Instant::now();
    let (r, n) = match requests {
        Submission::Plain(r) => (engine.submit(&handle, r).map(|b| (b, None)), r.len()),
        Submission::Strided(r) if points => {
            (engine.submit_strided_with_points(&handle, r), r.len())
        }
        Submission::Strided(r) => (
            engine.submit_strided(&handle, r).map(|b| (b, None)),
            r.len(),
        ),
    };
    let r = r.map_err(|source| WriteErrorKind::Submit { segment, source });
    tracing::debug!(
        target: "kvferry::timing",
        requests = n,
        submit_us = t.elapsed().as_micros() as u64,
        "serve submitted"
    );
    r
}

/// The local and remote address of a batch's first copy (`None`: no copy, or one whose
/// address does not fit in 64 bits).
pub(super) fn first_copy(requests: &Submission) -> Option<(u64, u64)> {
    match requests {
        Submission::Plain(r) => r.first().map(|r| (r.local_addr, r.remote_addr)),
        Submission::Strided(r) => {
            let r = r.first()?;
            let (range, (local, remote)) = (r.ranges.first()?, r.blocks.first()?);
            Some((
                local.checked_add(range.local)?,
                remote.checked_add(range.remote)?,
            ))
        }
    }
}

/// Frees `batch` when its wait ended in a timeout (`r`): the engine keeps a timed-out batch
/// for a later wait, but a serve never waits past its deadline, so without this every load
/// that timed out would leave its batches in the engine's table for the producer's life.
/// Freeing also skips the batch's slices not yet sent.
pub(super) fn free_if_timed_out(w: &Worker, batch: BatchId, r: &kvferry_transfer::Result<()>) {
    if matches!(r, Err(kvferry_transfer::TransferError::Timeout(_))) {
        w.engine.free_batch(batch);
    }
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
