//! Serving one load on the producer (docs/design.md §4): check the consumer's request
//! against the published lease, pair every block's producer bytes with the
//! consumer's (KV heads mapped between ranks, so TP and PP sizes may differ), and
//! WRITE them through each producer rank's engine.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use kvferry_transfer::{Op, Token, TransferRequest as EngineRequest};

use kvferry_kernels::LayerInput;

use crate::proto::msg::{TransferRequest, WireBlocks, WireLayer, WireRank};
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

/// The WRITEs one producer rank makes into one consumer rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RankPlan {
    /// Index of the producer worker (into the sorted workers).
    pub worker: usize,
    /// The consumer rank's segment.
    pub segment: String,
    /// The copies, producer address → consumer address.
    pub copies: Vec<Copy>,
}

/// Builds the copies that serve `req` (docs/design.md §4). Each layer of each consumer rank is
/// paired with the producer layers of the same name, and each of its global KV heads is
/// written by one producer rank that holds that head: so TP and PP sizes may differ between
/// the sides. Where several producer ranks hold a head (replicas: GQA with TP above the head
/// count, MLA), consumer TP rank `c` takes it from the `c mod n`-th of them, which is rank to
/// rank when the TP sizes are equal. Errors name the first problem.
pub(crate) fn plan(
    workers: &[Worker],
    published: &Published,
    req: &TransferRequest,
) -> Result<Vec<RankPlan>, String> {
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
                let holds =
                    held.map_or_else(|| "no block there".to_string(), |h| format!("block {h}"));
                return Err(format!(
                    "group {} position {pos}: consumer expects producer block {remote}, the producer holds {holds}",
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
    check_ranks(req)?;
    let mut plans: Vec<RankPlan> = Vec::new();
    for target in &req.ranks {
        for b in &req.blocks {
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
            for wl in &tg.layers {
                layer_copies(workers, target, b, wl, &mut plans)?;
            }
        }
    }
    // Every producer layer must land somewhere, and the consumer's ranks must hold as many of
    // its KV heads as the producer's: else the consumer runs another model.
    for b in &req.blocks {
        // layer name → one past the last global head held, over all ranks of a side
        let mut producer: BTreeMap<&str, u64> = BTreeMap::new();
        for w in workers {
            let Some(g) = w.groups.iter().find(|g| g.group_id == b.group_id) else {
                return Err(format!("rank {:?} has no group {}", w.rank, b.group_id));
            };
            for l in &g.layers {
                let end = l.spec.head_offset as u64 + l.spec.geometry.heads;
                let e = producer.entry(&l.spec.name).or_default();
                *e = (*e).max(end);
            }
        }
        let mut consumer: HashMap<&str, u64> = HashMap::new();
        for r in &req.ranks {
            for tg in r.groups.iter().filter(|tg| tg.group_id == b.group_id) {
                for wl in &tg.layers {
                    let end = (wl.head_offset as u64).saturating_add(wl.geometry.heads);
                    let e = consumer.entry(&wl.name).or_default();
                    *e = (*e).max(end);
                }
            }
        }
        for (name, &producer_end) in &producer {
            let Some(&consumer_end) = consumer.get(name) else {
                return Err(format!(
                    "consumer has no layer {name:?} in group {}",
                    b.group_id
                ));
            };
            if consumer_end != producer_end {
                return Err(format!(
                    "layer {name:?}: the consumer's ranks hold {consumer_end} KV heads, the producer's {producer_end}"
                ));
            }
        }
    }
    Ok(plans)
}

/// The consumer's ranks: each of its TP × PP grid exactly once.
fn check_ranks(req: &TransferRequest) -> Result<(), String> {
    let (tp, pp) = (req.tp_size, req.pp_size);
    if tp == 0 || pp == 0 || req.ranks.len() as u64 != tp as u64 * pp as u64 {
        return Err(format!(
            "consumer names {} ranks for TP {tp} × PP {pp}",
            req.ranks.len()
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for r in &req.ranks {
        if r.tp_rank >= tp || r.pp_rank >= pp || !seen.insert((r.tp_rank, r.pp_rank)) {
            return Err(format!(
                "consumer must name rank tp={} pp={} exactly once, inside TP {tp} × PP {pp}",
                r.tp_rank, r.pp_rank
            ));
        }
    }
    Ok(())
}

/// Appends the copies that fill consumer layer `wl` of rank `target` for blocks `b`.
fn layer_copies(
    workers: &[Worker],
    target: &WireRank,
    b: &WireBlocks,
    wl: &WireLayer,
    plans: &mut Vec<RankPlan>,
) -> Result<(), String> {
    let theirs = from_wire(&wl.geometry)
        .map_err(|e| format!("layer {}: consumer geometry: {e}", wl.name))?;
    if theirs.byte_len() > wl.len {
        return Err(format!(
            "layer {}: consumer geometry spans more than its {} bytes",
            wl.name, wl.len
        ));
    }
    // Producer ranks holding this layer, with the global heads each holds.
    let mut holders: Vec<(usize, &LayerInput)> = Vec::new();
    for (i, w) in workers.iter().enumerate() {
        let Some(g) = w.groups.iter().find(|g| g.group_id == b.group_id) else {
            return Err(format!("rank {:?} has no group {}", w.rank, b.group_id));
        };
        for l in g.layers.iter().filter(|l| l.spec.name == wl.name) {
            compatible(&l.spec.geometry, &theirs).map_err(|e| format!("layer {}: {e}", wl.name))?;
            holders.push((i, l));
        }
    }
    if holders.is_empty() {
        return Err(format!(
            "producer has no layer {:?} in group {}",
            wl.name, b.group_id
        ));
    }
    let first = wl.head_offset as u64;
    let end = first
        .checked_add(theirs.heads)
        .ok_or_else(|| format!("layer {}: head offset overflows", wl.name))?;
    let held_end = holders
        .iter()
        .map(|(_, l)| l.spec.head_offset as u64 + l.spec.geometry.heads)
        .max()
        .unwrap_or(0);
    if end > held_end {
        return Err(format!(
            "layer {}: consumer rank tp={} holds KV heads {first}..{end}, the producer's ranks only 0..{held_end}",
            wl.name, target.tp_rank
        ));
    }
    // Runs of consecutive global heads taken from one producer layer.
    let mut runs: Vec<(usize, u64, u64)> = Vec::new(); // (holder, first head, end head)
    for h in first..end {
        let cands: Vec<usize> = holders
            .iter()
            .enumerate()
            .filter(|(_, (_, l))| {
                let o = l.spec.head_offset as u64;
                h >= o && h < o + l.spec.geometry.heads
            })
            .map(|(k, _)| k)
            .collect();
        if cands.is_empty() {
            return Err(format!(
                "layer {}: no producer rank holds KV head {h} (consumer rank tp={} holds heads {first}..{end})",
                wl.name, target.tp_rank
            ));
        }
        let k = cands[target.tp_rank as usize % cands.len()];
        match runs.last_mut() {
            Some((hk, _, e)) if *hk == k && *e == h => *e = h + 1,
            _ => runs.push((k, h, h + 1)),
        }
    }
    for (k, h0, h1) in runs {
        let (wi, layer) = holders[k];
        let ours = &layer.spec.geometry;
        let po = layer.spec.head_offset as u64;
        let (ph, ch) = (h0 - po..h1 - po, h0 - first..h1 - first);
        let plan = match plans
            .iter_mut()
            .position(|p| p.worker == wi && p.segment == target.segment)
        {
            Some(i) => &mut plans[i],
            None => {
                plans.push(RankPlan {
                    worker: wi,
                    segment: target.segment.clone(),
                    copies: Vec::new(),
                });
                plans.last_mut().expect("just pushed")
            }
        };
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
                &ours.block_head_byte_ranges(remote, ph.clone()),
                wl.addr,
                &theirs.block_head_byte_ranges(local, ch.clone()),
                &mut plan.copies,
            )
            .map_err(|e| format!("layer {}: {e}", wl.name))?;
        }
    }
    Ok(())
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
) -> Result<u64, String> {
    let runs = plans.into_iter().map(|p| {
        let workers = workers.clone();
        async move { write_rank(&workers[p.worker], p.segment, p.copies, deadline, token).await }
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
        let handle = match token {
            Some(t) => engine.open_segment_with_token(&segment, t),
            None => engine.open_segment(&segment),
        }
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
