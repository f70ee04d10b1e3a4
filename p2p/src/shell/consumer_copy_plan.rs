//! The one-pass plan of a request shape (docs/design.md §4.10 "One pass"): which producer
//! layer each of this side's layers is copied from, checked to pair up chunk for chunk, and the
//! launches planned for the producer's memory as mapped here ([`CopyTemplate`]), and one
//! load's reads from it ([`CopyReads`]). Made once per shape; a load gives its blocks.

use std::collections::HashMap;
use std::sync::Arc;

use kvferry_checksum::select::BlockSelection;
use kvferry_kernels::cuda::view::{copy_plan, PlanError};
use kvferry_kernels::{
    CopyJob, CopyPlans, GroupJob, JobBlocks, JobFault, Keep, KernelError, LayerInput, Location,
};
use kvferry_transfer::sync::MutexExt;
use kvferry_transfer::TransferError;

use crate::proto::layout::RankLayout;
use crate::proto::msg::LoadRequest;
use crate::worker::Worker;

/// A request shape (its groups' id, block size and producer block size) and its one-pass
/// template (`None`: its layers do not pair up).
pub(super) type ShapeTemplate = (Vec<(u32, u64, u64)>, Option<Arc<CopyTemplate>>);

/// A load's one-pass reads: each worker's copy jobs over every layer of the load, and the
/// producer's mappings they read.
pub(super) struct CopyReads {
    /// Per worker (indexed as the workers): its launches, checked and planned.
    pub(super) plans: Vec<CopyPlans>,
    /// Per worker: what keeps the producer's memory mapped until its launches end.
    pub(super) keep: Vec<Keep>,
    /// Bytes the launches copy: the cells of the load's tokens.
    pub(super) bytes: u64,
}

/// Why a load is not read in one pass (it is read by the transport and checksummed after
/// landing).
#[derive(Debug, thiserror::Error)]
pub(super) enum NoCopy {
    /// A rank's KV is host memory.
    #[error("rank {0}'s KV is host memory")]
    Host(usize),
    /// A group of the load is not checksummed (its blocks move without a verdict).
    #[error("group {0} is not checksummed")]
    Unchecked(u32),
    /// A group's block sizes differ between the sides (its blocks are filled token by token).
    #[error("group {0}'s block sizes differ")]
    BlockSizes(u32),
    /// A group's checksummed blocks are not all the blocks the load moves (a sliding window
    /// clips them, or a local prefix), or a position has no producer block.
    #[error("group {0}: the blocks checksummed are not the blocks loaded")]
    Blocks(u32),
    /// A layer has no producer layer of the same name and heads (TP sizes differ).
    #[error("layer {0} has no producer layer of the same heads")]
    NoSource(String),
    /// The producer rank's segment is not open here (a load reads it only once it is).
    #[error("segment {0} is not open here")]
    NotOpen(String),
    /// The producer's memory is not mapped here for this device yet (a read maps it).
    #[error("segment {0}: its memory is not mapped here yet")]
    NotMapped(String),
    /// A load's jobs are not those of the request shape's template (this side's groups
    /// changed).
    #[error("the load's layer groups are not its shape's")]
    Shape,
    /// The producer's layers lie outside what it has registered and this side mapped.
    #[error("segment {segment}: {source}")]
    Map {
        /// The producer rank's segment.
        segment: String,
        /// Why.
        source: TransferError,
    },
    /// A layer cannot be copied chunk for chunk from its producer layer (its layout differs
    /// beyond its block count, or the kernel reads it byte by byte), or a block of the load is
    /// outside a layer's or its source's blocks.
    #[error(transparent)]
    Layout(#[from] PlanError),
    /// The backend refused the launch before queuing anything (no copy kernel in it, or a
    /// driver failure).
    #[error("the copy launch was refused: {0}")]
    Refused(kvferry_kernels::KernelError),
}

impl NoCopy {
    /// Whether every load of the request shape is refused the same way (the shape is then
    /// read in two passes without asking again); else it depends on the load or on the
    /// moment (a mapping not made yet, this load's blocks).
    pub(super) fn lasting(&self) -> bool {
        matches!(
            self,
            NoCopy::Host(_)
                | NoCopy::Unchecked(_)
                | NoCopy::BlockSizes(_)
                | NoCopy::NoSource(_)
                | NoCopy::Layout(_)
        )
    }
}

/// What a load's one-pass reads depend on besides its blocks, worked out once per request
/// shape (its groups and block sizes) and producer layout: which producer layer each of this
/// side's layers is copied from, checked to pair up chunk for chunk, and the launches planned
/// for the producer's memory as last mapped. Not the mappings: each load asks the engine for
/// those, checked against what the producer has registered then; where they moved, the
/// launches are planned again.
pub(super) struct CopyTemplate {
    /// Per worker (indexed as the workers).
    workers: Vec<WorkerTemplate>,
}

/// One worker's part of a [`CopyTemplate`].
struct WorkerTemplate {
    /// Per job (in the order its jobs come): the group id, its block size and the bytes of one
    /// token over its layers (each layer's heads × cell bytes).
    jobs: Vec<(u32, u64, u64)>,
    /// Per producer segment: (job index, layer index, the source layer at the producer's
    /// address).
    segments: Vec<(String, Vec<Source>)>,
    /// The launches last planned, with the sources' addresses here they were planned for (in
    /// the order of `segments`' layers): a later load whose sources are mapped at the same
    /// addresses gives them its blocks only ([`CopyPlans::with_blocks`]).
    planned: std::sync::Mutex<Option<(Vec<u64>, Arc<CopyPlans>)>>,
}

/// A layer's source in a [`WorkerTemplate`]: (job index, layer index, the producer's layer at
/// its address there, with this side's spec but the producer's geometry).
type Source = (usize, usize, LayerInput);

impl CopyTemplate {
    /// The template of `request`'s shape (`jobs`: per worker, its jobs over every layer) read
    /// from `producer` (its layout), where every layer pairs up; else why not.
    pub(super) fn of(
        workers: &[Worker],
        jobs: &[Vec<GroupJob>],
        producer: &[RankLayout],
        request: &LoadRequest,
    ) -> Result<CopyTemplate, NoCopy> {
        let mut out = Vec::with_capacity(workers.len());
        for (i, (w, jobs)) in workers.iter().zip(jobs).enumerate() {
            if !matches!(w.device, Location::Cuda(_)) {
                return Err(NoCopy::Host(i));
            }
            // Every group of the load this rank holds is checksummed over all its layers: the
            // copies then move all of it.
            for b in &request.blocks {
                let Some(g) = w.groups.iter().find(|g| g.group_id == b.group_id) else {
                    continue;
                };
                if g.skipped.is_some() {
                    return Err(NoCopy::Unchecked(g.group_id));
                }
                if !b.remote_positions.is_empty()
                    || ![0, b.block_size].contains(&b.remote_block_size)
                {
                    return Err(NoCopy::BlockSizes(g.group_id));
                }
                let job = jobs.iter().find(|j| j.group_id == g.group_id);
                if job.is_none_or(|j| j.layers.len() != g.layers.len()) {
                    return Err(NoCopy::Blocks(g.group_id));
                }
            }
            let mut segments: Vec<(String, Vec<Source>)> = Vec::new();
            for (j, job) in jobs.iter().enumerate() {
                let sources = pair(producer, job, w.rank.tp_rank)?;
                // Chunk for chunk, whatever the blocks (one block of each checks the layouts).
                let layers: Vec<_> = job.layers.iter().map(LayerInput::as_plan_layer).collect();
                let from: Vec<_> = sources.iter().map(|(_, l)| l.as_plan_layer()).collect();
                copy_plan(&layers, &from, &[0], &[0], 0, 1)?;
                for (k, (segment, l)) in sources.into_iter().enumerate() {
                    match segments.iter_mut().find(|(s, _)| *s == segment) {
                        Some((_, v)) => v.push((j, k, l)),
                        None => segments.push((segment, vec![(j, k, l)])),
                    }
                }
            }
            let token_bytes = |j: &GroupJob| {
                j.layers
                    .iter()
                    .map(|l| {
                        l.spec
                            .geometry
                            .heads
                            .saturating_mul(l.spec.geometry.cell_bytes())
                    })
                    .fold(0, u64::saturating_add)
            };
            out.push(WorkerTemplate {
                jobs: jobs
                    .iter()
                    .map(|j| (j.group_id, j.block_size, token_bytes(j)))
                    .collect(),
                segments,
                planned: std::sync::Mutex::new(None),
            });
        }
        Ok(CopyTemplate { workers: out })
    }

    /// The one-pass reads of `request` (of this template's shape; `selections`: per worker,
    /// each group's selected blocks, as its jobs come; `num_tokens`: the request's), where
    /// every block pairs up; else why not. Asks each worker's engine for the producer's memory
    /// as mapped here now, checked against what the producer has registered: never a
    /// handshake or an import. The launches are planned once per mapping; a load gives them
    /// its blocks, checked again.
    pub(super) fn reads(
        &self,
        workers: &[Worker],
        selections: Vec<Vec<(u32, BlockSelection)>>,
        num_tokens: u64,
        request: &LoadRequest,
    ) -> Result<CopyReads, NoCopy> {
        let mut out = CopyReads {
            plans: Vec::with_capacity(workers.len()),
            keep: Vec::with_capacity(workers.len()),
            bytes: 0,
        };
        for ((w, selections), t) in workers.iter().zip(selections).zip(&self.workers) {
            let Location::Cuda(dev) = w.device else {
                return Err(NoCopy::Host(0));
            };
            let same = selections.len() == t.jobs.len()
                && selections
                    .iter()
                    .zip(&t.jobs)
                    .all(|((g, _), &(tg, _, _))| *g == tg);
            if !same {
                return Err(NoCopy::Shape);
            }
            let mut addrs = Vec::new();
            let mut keep = Keep::new();
            for (segment, layers) in &t.segments {
                if !w.engine.has_segment(segment) {
                    return Err(NoCopy::NotOpen(segment.clone()));
                }
                let map = |source| NoCopy::Map {
                    segment: segment.clone(),
                    source,
                };
                let handle = w.engine.open_segment(segment).map_err(map)?;
                let ranges: Vec<(u64, u64)> =
                    layers.iter().map(|(_, _, l)| (l.addr, l.len)).collect();
                let mapped = w
                    .engine
                    .mapped(&handle, dev, &ranges)
                    .map_err(map)?
                    .ok_or_else(|| NoCopy::NotMapped(segment.clone()))?;
                for m in mapped {
                    addrs.push(m.ptr());
                    keep.push(m.keep());
                }
            }
            let mut blocks = Vec::with_capacity(selections.len());
            for ((group, sel), &(_, block_size, token_bytes)) in selections.into_iter().zip(&t.jobs)
            {
                let src_block_ids = source_blocks(group, &sel, request)?;
                out.bytes = out.bytes.saturating_add(
                    copied_tokens(&sel, block_size, num_tokens).saturating_mul(token_bytes),
                );
                blocks.push(JobBlocks {
                    start: sel.start,
                    block_ids: sel.block_ids,
                    src_block_ids,
                    num_tokens,
                });
            }
            let planned = t
                .planned
                .locked()
                .as_ref()
                .filter(|(at, _)| *at == addrs)
                .map(|(_, p)| p.clone());
            let plans = match planned {
                Some(p) => p.with_blocks(blocks),
                None => {
                    let jobs = t.copy_jobs(w, &addrs, blocks)?;
                    let p = CopyPlans::new(w.device, &jobs);
                    if let Ok(p) = &p {
                        *t.planned.locked() = Some((addrs, Arc::new(p.clone())));
                    }
                    p
                }
            };
            // What the backend checks before it queues anything, checked here: a refusal
            // then sends the load to two passes instead of failing it.
            out.plans.push(plans.map_err(|e| match e {
                KernelError::InvalidJob {
                    why: JobFault::Plan(p),
                    ..
                } => NoCopy::Layout(p),
                e => NoCopy::Refused(e),
            })?);
            out.keep.push(keep);
        }
        Ok(out)
    }
}

impl WorkerTemplate {
    /// The copy jobs of `w` over `blocks` (per job), its sources at `addrs` (as mapped here,
    /// in the order of `segments`' layers): what [`CopyPlans::new`] plans when the sources
    /// moved, or at the shape's first load.
    fn copy_jobs(
        &self,
        w: &Worker,
        addrs: &[u64],
        blocks: Vec<JobBlocks>,
    ) -> Result<Vec<CopyJob>, NoCopy> {
        let mut sources: Vec<Vec<Option<LayerInput>>> = Vec::with_capacity(self.jobs.len());
        let mut layers = Vec::with_capacity(self.jobs.len());
        for &(group, _, _) in &self.jobs {
            let g = w
                .groups
                .iter()
                .find(|g| g.group_id == group)
                .ok_or(NoCopy::Shape)?;
            sources.push(vec![None; g.layers.len()]);
            layers.push(g);
        }
        let all = self.segments.iter().flat_map(|(_, l)| l);
        for ((j, k, l), &addr) in all.zip(addrs) {
            let slot = sources
                .get_mut(*j)
                .and_then(|s| s.get_mut(*k))
                .ok_or(NoCopy::Shape)?;
            *slot = Some(LayerInput {
                spec: l.spec.clone(),
                addr,
                len: l.len,
            });
        }
        let mut jobs = Vec::with_capacity(blocks.len());
        for ((g, sources), b) in layers.into_iter().zip(sources).zip(blocks) {
            let sources: Option<Vec<LayerInput>> = sources.into_iter().collect();
            jobs.push(CopyJob {
                job: GroupJob {
                    group_id: g.group_id,
                    block_size: g.block_size,
                    layers: g.layers.clone(),
                    selection: BlockSelection {
                        start: b.start,
                        block_ids: b.block_ids,
                    },
                    num_tokens: b.num_tokens,
                    device: w.device,
                },
                sources: sources.ok_or(NoCopy::Shape)?,
                source_blocks: b.src_block_ids,
            });
        }
        Ok(jobs)
    }
}

/// The producer's block at each position group `group`'s selection `sel` checksums: those the
/// request names, all of them being the blocks the load moves; else [`NoCopy::Blocks`] (a
/// window or a local prefix clips what is checksummed, or a position has no producer block).
fn source_blocks(
    group: u32,
    sel: &BlockSelection,
    request: &LoadRequest,
) -> Result<Vec<u64>, NoCopy> {
    let ids = &sel.block_ids;
    let wire = request.blocks.iter().find(|b| b.group_id == group);
    let Some(wire) = wire.filter(|b| b.positions.len() == ids.len()) else {
        return Err(NoCopy::Blocks(group));
    };
    let start = sel.start;
    let positions = start..start + ids.len() as u64;
    // Mostly the positions in order: read straight off; else looked up.
    if wire.positions.iter().copied().eq(positions.clone()) && wire.remote_blocks.len() == ids.len()
    {
        return Ok(wire.remote_blocks.clone());
    }
    let remote: HashMap<u64, u64> = wire
        .positions
        .iter()
        .copied()
        .zip(wire.remote_blocks.iter().copied())
        .collect();
    positions
        .map(|p| remote.get(&p).copied())
        .collect::<Option<Vec<u64>>>()
        .ok_or(NoCopy::Blocks(group))
}

/// The producer layer (and its segment) each of `job`'s layers is copied from, as the
/// planners pick it for TP rank `tp_rank` (`proto::heads::pick_from`): of the `n` producer
/// layers of the same name that hold its first KV head (replicas: MLA, GQA with TP above the
/// head count), the `(tp_rank mod n)`-th, which must hold exactly its heads; as this side's
/// layer but for the producer's geometry (block count, strides), at the producer's address.
fn pair(
    producer: &[RankLayout],
    job: &GroupJob,
    tp_rank: u32,
) -> Result<Vec<(String, LayerInput)>, NoCopy> {
    job.layers
        .iter()
        .map(|l| {
            let head = l.spec.head_offset as u64;
            // Layers pair by name, as the planners pair them (a layout carries no layer numbers).
            let holders: Vec<(&RankLayout, &LayerInput)> = producer
                .iter()
                .filter_map(|r| {
                    let g = r.group(job.group_id)?;
                    let p = g.layers.iter().find(|p| p.spec.name == l.spec.name)?;
                    let held = p.spec.head_offset as u64
                        ..p.spec.head_offset as u64 + p.spec.geometry.heads;
                    held.contains(&head).then_some((r, p))
                })
                .collect();
            let picked = match holders.len() {
                0 => None,
                n => Some(holders[tp_rank as usize % n]),
            };
            let exact = |p: &&LayerInput| {
                (p.spec.head_offset, p.spec.geometry.heads)
                    == (l.spec.head_offset, l.spec.geometry.heads)
            };
            let (r, p) = picked
                .filter(|(_, p)| exact(p))
                .ok_or_else(|| NoCopy::NoSource(l.spec.name.clone()))?;
            let spec = kvferry_checksum::group::LayerSpec {
                geometry: p.spec.geometry.clone(),
                ..l.spec.clone()
            };
            let source = LayerInput {
                spec,
                addr: p.addr,
                len: p.len,
            };
            Ok((r.segment.clone(), source))
        })
        .collect()
}

/// Tokens a copy launch of `sel` (blocks of `block_size` tokens) moves: those of its blocks
/// before `num_tokens`.
fn copied_tokens(sel: &BlockSelection, block_size: u64, num_tokens: u64) -> u64 {
    let start = sel.start;
    let n = sel.block_ids.len() as u64;
    num_tokens
        .min(start.saturating_add(n).saturating_mul(block_size))
        .saturating_sub(start.saturating_mul(block_size))
}

#[cfg(test)]
#[path = "consumer_copy_tests.rs"]
mod tests;
