//! Serving one load on the producer (DESIGN.md §4): check the consumer's request
//! against the published lease, pair every block's producer bytes with the
//! consumer's, and WRITE them rank r → rank r through each rank's engine.

use std::sync::Arc;
use std::time::Instant;

use kvferry_transfer::{Op, TransferRequest as EngineRequest};

use crate::proto::msg::{TransferRequest, WireRank};
use crate::proto::plan::{pair_ranges, Copy};
use crate::wire::{compatible, from_wire};
use crate::worker::Worker;

/// What a lease holds: the published block tables, token count and checksum payload.
#[derive(Debug, Clone)]
pub(crate) struct Published {
    /// `blocks[group_id]`: the group's block table (position → block id, `None` = null block).
    pub blocks: Vec<Vec<Option<u64>>>,
    /// Tokens of the request's KV.
    pub num_tokens: u64,
    /// The encoded checksum payload, `None` when the producer sends no checksums.
    pub payload: Option<Vec<u8>>,
}

/// Builds each producer rank's copies for `req`. Errors name the first problem.
pub(crate) fn plan(
    workers: &[Worker],
    tp: u32,
    pp: u32,
    published: &Published,
    req: &TransferRequest,
) -> Result<Vec<(String, Vec<Copy>)>, String> {
    if (req.tp_size, req.pp_size) != (tp, pp) {
        return Err(format!(
            "consumer has TP {} × PP {}, producer TP {tp} × PP {pp}: different TP/PP sizes are not supported yet",
            req.tp_size, req.pp_size
        ));
    }
    if req.num_tokens > published.num_tokens {
        return Err(format!(
            "consumer asks for {} tokens, the producer published {}",
            req.num_tokens, published.num_tokens
        ));
    }
    for b in &req.blocks {
        let n = b.positions.len();
        if b.remote_blocks.len() != n || b.local_blocks.len() != n {
            return Err(format!(
                "group {}: positions and block lists differ in length",
                b.group_id
            ));
        }
        let table = published
            .blocks
            .get(b.group_id as usize)
            .ok_or_else(|| format!("group {} was not published", b.group_id))?;
        let group = workers[0]
            .groups
            .iter()
            .find(|g| g.group_id == b.group_id)
            .ok_or_else(|| format!("producer has no group {}", b.group_id))?;
        if group.block_size != b.block_size {
            return Err(format!(
                "group {}: consumer block size {} differs from the producer's {} (not supported yet)",
                b.group_id, b.block_size, group.block_size
            ));
        }
        for (&pos, &remote) in b.positions.iter().zip(&b.remote_blocks) {
            let held = table.get(pos as usize).copied().flatten();
            if held != Some(remote) {
                return Err(format!(
                    "group {} position {pos}: consumer expects producer block {remote}, the producer holds {held:?}",
                    b.group_id
                ));
            }
            if pos.saturating_mul(b.block_size) >= published.num_tokens {
                return Err(format!(
                    "group {} position {pos} is past the published tokens",
                    b.group_id
                ));
            }
        }
    }
    let mut out = Vec::new();
    for w in workers {
        let mut matching = req
            .ranks
            .iter()
            .filter(|r| r.tp_rank == w.rank.tp_rank && r.pp_rank == w.rank.pp_rank);
        let (Some(target), None) = (matching.next(), matching.next()) else {
            return Err(format!(
                "consumer must name rank tp={} pp={} exactly once",
                w.rank.tp_rank, w.rank.pp_rank
            ));
        };
        out.push((target.segment.clone(), rank_copies(w, target, req)?));
    }
    Ok(out)
}

fn rank_copies(w: &Worker, target: &WireRank, req: &TransferRequest) -> Result<Vec<Copy>, String> {
    let mut copies = Vec::new();
    for b in &req.blocks {
        let Some(group) = w.groups.iter().find(|g| g.group_id == b.group_id) else {
            return Err(format!("rank {:?} has no group {}", w.rank, b.group_id));
        };
        let tg = target
            .groups
            .iter()
            .find(|g| g.group_id == b.group_id)
            .ok_or_else(|| {
                format!(
                    "consumer rank tp={} pp={} sent no layers for group {}",
                    target.tp_rank, target.pp_rank, b.group_id
                )
            })?;
        if tg.layers.len() != group.layers.len() {
            return Err(format!(
                "group {}: consumer rank has {} layers, producer rank {}",
                b.group_id,
                tg.layers.len(),
                group.layers.len()
            ));
        }
        for layer in &group.layers {
            let wl = tg
                .layers
                .iter()
                .find(|l| l.name == layer.spec.name)
                .ok_or_else(|| {
                    format!(
                        "consumer has no layer {:?} in group {}",
                        layer.spec.name, b.group_id
                    )
                })?;
            let theirs = from_wire(&wl.geometry)
                .map_err(|e| format!("layer {}: consumer geometry: {e}", wl.name))?;
            let ours = &layer.spec.geometry;
            compatible(ours, &theirs).map_err(|e| format!("layer {}: {e}", wl.name))?;
            if theirs.byte_len() > wl.len {
                return Err(format!(
                    "layer {}: consumer geometry spans more than its {} bytes",
                    wl.name, wl.len
                ));
            }
            for (&remote, &local) in b.remote_blocks.iter().zip(&b.local_blocks) {
                if remote >= ours.num_blocks() || local >= theirs.num_blocks() {
                    return Err(format!(
                        "layer {}: block {remote} → {local} outside the arrays ({} / {} blocks)",
                        wl.name,
                        ours.num_blocks(),
                        theirs.num_blocks()
                    ));
                }
                pair_ranges(
                    layer.addr,
                    &ours.block_byte_ranges(remote),
                    wl.addr,
                    &theirs.block_byte_ranges(local),
                    &mut copies,
                )
                .map_err(|e| format!("layer {}: {e}", wl.name))?;
            }
        }
    }
    Ok(copies)
}

/// WRITEs every rank's copies through the rank's engine, ranks concurrently, all
/// done by `deadline`. Returns the bytes written.
pub(crate) async fn write_all(
    workers: Arc<Vec<Worker>>,
    plan: Vec<(String, Vec<Copy>)>,
    deadline: Instant,
) -> Result<u64, String> {
    let runs = plan.into_iter().enumerate().map(|(i, (segment, copies))| {
        let workers = workers.clone();
        async move { write_rank(&workers[i], segment, copies, deadline).await }
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
) -> Result<u64, String> {
    if copies.is_empty() {
        return Ok(0);
    }
    let rank = w.rank;
    let at = |what: String| format!("rank tp={} pp={}: {what}", rank.tp_rank, rank.pp_rank);
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
        let handle = engine
            .open_segment(&segment)
            .map_err(|e| format!("open segment {segment}: {e}"))?;
        engine
            .submit(&handle, &requests)
            .map_err(|e| format!("submit to {segment}: {e}"))
    });
    let left = deadline.saturating_duration_since(Instant::now());
    let batch = match tokio::time::timeout(left, submit).await {
        Err(_) => {
            return Err(at(format!(
                "opening the consumer segment took over {left:?}"
            )))
        }
        Ok(Err(e)) => return Err(at(e.to_string())),
        Ok(Ok(r)) => r.map_err(at)?,
    };
    let left = deadline.saturating_duration_since(Instant::now());
    w.engine
        .wait_async(batch, left)
        .await
        .map_err(|e| at(format!("transfer: {e}")))?;
    Ok(bytes)
}
