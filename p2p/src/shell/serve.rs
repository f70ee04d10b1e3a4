//! Serving one load on the producer (docs/design.md §4): WRITE the copies planned by
//! [`crate::proto::serve::plan`] through each producer rank's engine.

use std::sync::Arc;
use std::time::Instant;

use kvferry_transfer::{Op, Token, TransferRequest as EngineRequest};

use crate::proto::plan::Copy;
use crate::proto::serve::RankPlan;
use crate::proto::serve_error::{WriteError, WriteErrorKind};
use crate::worker::Worker;

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
        async move { write_rank(&workers[p.rank], p.segment, p.copies, deadline, token).await }
    });
    let mut total = 0u64;
    for r in futures::future::join_all(runs).await {
        total += r?;
    }
    Ok(total)
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
    let rank = w.rank;
    let at = |kind: WriteErrorKind| WriteError { rank, kind };
    let bytes: u64 = copies.iter().map(|c| c.len).sum();
    let engine = w.engine.clone();
    let requests: Vec<EngineRequest> = copies
        .iter()
        .map(|c| EngineRequest {
            op: Op::Write,
            local_addr: c.src,
            remote_addr: c.dst,
            len: c.len,
        })
        .collect();
    let submit = tokio::task::spawn_blocking(move || {
        let handle = match token {
            Some(t) => engine.open_segment_with_token(&segment, t),
            None => engine.open_segment(&segment),
        }
        .map_err(|source| WriteErrorKind::Open {
            segment: segment.clone(),
            source,
        })?;
        engine
            .submit(&handle, &requests)
            .map_err(|source| WriteErrorKind::Submit { segment, source })
    });
    let left = deadline.saturating_duration_since(Instant::now());
    let batch = match tokio::time::timeout(left, submit).await {
        Err(_) => return Err(at(WriteErrorKind::OpenTimeout(left))),
        Ok(Err(e)) => return Err(at(WriteErrorKind::Task(e.to_string()))),
        Ok(Ok(r)) => r.map_err(at)?,
    };
    let left = deadline.saturating_duration_since(Instant::now());
    w.engine
        .wait_async(batch, left)
        .await
        .map_err(|e| at(WriteErrorKind::Transfer(e)))?;
    Ok(bytes)
}
