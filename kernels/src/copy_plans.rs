//! Copy launches planned ahead ([`CopyPlans`]): a request shape's [`CopyJob`]s checked and
//! turned into launch plans once, then given each load's blocks with only the block checks
//! made again. A consumer that reads every load of a shape in one pass plans its layers once,
//! not per load: what differs between its loads is which blocks they copy.

use crate::cuda::view::{copy_plan, LaunchPlan, PlanError};
use crate::job::{
    plan_error, validate_job_on, validate_layers, CopyJob, JobFault, KernelError, LayerInput,
    Location,
};
use kvferry_checksum::group::LayerSpec;

/// Copy launches checked and planned for one device: one plan per job, in order. Made only by
/// [`CopyPlans::new`] (every check of [`crate::ChecksumBackend::submit_copying`]) or
/// [`CopyPlans::with_blocks`] (the same launches over other blocks, checked against the
/// layers' and sources' block counts), so a plan here always passed those checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlans {
    device: Location,
    jobs: Vec<PlannedJob>,
}

/// One job of a [`CopyPlans`]: its launch, and the fewest blocks among its layers and among
/// its sources (with the name of a layer that has them), what a block id must stay below.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PlannedJob {
    group_id: u32,
    plan: LaunchPlan,
    layers: (u64, String),
    sources: (u64, String),
}

/// One load's blocks for a job of [`CopyPlans::with_blocks`]: the consumer's block at each
/// position from `start` and the source's block at the same positions, and the request's
/// tokens (later tokens are neither copied nor checksummed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobBlocks {
    /// Position of `block_ids[0]`.
    pub start: u64,
    /// The layers' block at each position.
    pub block_ids: Vec<u64>,
    /// The sources' block at each position (as many as `block_ids`).
    pub src_block_ids: Vec<u64>,
    /// Request tokens.
    pub num_tokens: u64,
}

impl CopyPlans {
    /// Checks and plans `jobs` for `device`, as [`crate::ChecksumBackend::submit_copying`]
    /// does before it queues anything. Errors: [`KernelError::InvalidJob`] (a job for another
    /// device, a layer or source that fails [`crate::validate_job`]'s checks, a source that does not
    /// pair up with its layer: [`copy_plan`]).
    pub fn new(device: Location, jobs: &[CopyJob]) -> Result<CopyPlans, KernelError> {
        let mut out = Vec::with_capacity(jobs.len());
        for CopyJob {
            job,
            sources,
            source_blocks,
        } in jobs
        {
            let group_id = job.group_id;
            validate_job_on(job, device)?;
            validate_layers(group_id, job.block_size, sources, source_blocks)?;
            let layers: Vec<(&LayerSpec, u64, u64)> =
                job.layers.iter().map(LayerInput::as_plan_layer).collect();
            let from: Vec<(&LayerSpec, u64, u64)> =
                sources.iter().map(LayerInput::as_plan_layer).collect();
            let (ids, start) = (&job.selection.block_ids, job.selection.start);
            let plan = copy_plan(&layers, &from, ids, source_blocks, start, job.num_tokens)
                .map_err(plan_error(group_id))?;
            out.push(PlannedJob {
                group_id,
                plan,
                layers: fewest_blocks(&job.layers),
                sources: fewest_blocks(sources),
            });
        }
        Ok(CopyPlans { device, jobs: out })
    }

    /// The same launches over `blocks` (one per job, in order): only the blocks and tokens
    /// change. Errors: [`KernelError::InvalidJob`] for a count that differs (jobs, or source
    /// blocks per block), a block id at or past a layer's or a source's block count, or more
    /// blocks or tiles than the kernel counts.
    pub fn with_blocks(&self, blocks: Vec<JobBlocks>) -> Result<CopyPlans, KernelError> {
        let count = |group_id| KernelError::InvalidJob {
            group_id,
            why: JobFault::Plan(PlanError::Source {
                layer: "(group)".to_string(),
                what: "count (jobs, source blocks per block)",
            }),
        };
        if blocks.len() != self.jobs.len() {
            return Err(count(self.jobs.first().map_or(0, |j| j.group_id)));
        }
        let mut out = Vec::with_capacity(self.jobs.len());
        for (j, b) in self.jobs.iter().zip(blocks) {
            let group_id = j.group_id;
            if b.src_block_ids.len() != b.block_ids.len() {
                return Err(count(group_id));
            }
            in_range(group_id, &j.layers, &b.block_ids)?;
            in_range(group_id, &j.sources, &b.src_block_ids)?;
            let range = |what, value| KernelError::InvalidJob {
                group_id,
                why: JobFault::Plan(PlanError::Range {
                    layer: "(group)".to_string(),
                    what,
                    value,
                }),
            };
            let nb = b.block_ids.len() as u64;
            u32::try_from(nb).map_err(|_| range("blocks", nb))?;
            let tiles = nb * j.plan.tiles_per_group as u64;
            let total_tiles = u32::try_from(tiles).map_err(|_| range("tiles", tiles))?;
            out.push(PlannedJob {
                plan: LaunchPlan {
                    views: j.plan.views.clone(),
                    block_ids: b.block_ids,
                    src_block_ids: b.src_block_ids,
                    start: b.start,
                    num_tokens: b.num_tokens,
                    keys: j.plan.keys.clone(),
                    tiles_per_group: j.plan.tiles_per_group,
                    total_tiles,
                },
                group_id,
                layers: j.layers.clone(),
                sources: j.sources.clone(),
            });
        }
        Ok(CopyPlans {
            device: self.device,
            jobs: out,
        })
    }

    /// The device the plans are for.
    pub fn device(&self) -> Location {
        self.device
    }

    /// The group of the first job (0 with none): what an error about the whole plans names.
    pub(crate) fn first_group(&self) -> u32 {
        self.jobs.first().map_or(0, |j| j.group_id)
    }

    /// The launches, one per job: (group id, plan).
    pub(crate) fn into_launches(self) -> Vec<(u32, LaunchPlan)> {
        self.jobs
            .into_iter()
            .map(|j| (j.group_id, j.plan))
            .collect()
    }
}

/// The fewest blocks among `layers`' arrays and the name of a layer with that many (none:
/// `u64::MAX`, no block id is refused: a job without layers reads nothing).
fn fewest_blocks(layers: &[crate::LayerInput]) -> (u64, String) {
    layers
        .iter()
        .map(|l| (l.spec.geometry.num_blocks(), &l.spec.name))
        .min_by_key(|(n, _)| *n)
        .map_or((u64::MAX, String::new()), |(n, name)| (n, name.clone()))
}

/// Every id of `ids` below `limit`'s block count; else the first one that is not, named as
/// [`crate::validate_job`] names it.
fn in_range(group_id: u32, limit: &(u64, String), ids: &[u64]) -> Result<(), KernelError> {
    let blocks = limit.0;
    match ids.iter().copied().find(|&id| id >= blocks) {
        None => Ok(()),
        Some(id) => Err(KernelError::InvalidJob {
            group_id,
            why: JobFault::BlockOutOfRange {
                layer: limit.1.clone(),
                id,
                blocks,
            },
        }),
    }
}

#[cfg(test)]
#[path = "copy_plans_tests.rs"]
mod tests;
