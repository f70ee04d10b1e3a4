//! Loads read in one pass (docs/design.md §4.10 "One pass"): where this consumer reads a
//! producer's KV over CUDA IPC and both hold every layer of the load in the same layout (block
//! counts aside), the checksum kernel itself copies each chunk it checksums from the
//! producer's blocks (mapped here) into this side's and sums the registers it stored. The
//! bytes cross device memory once for the copy and the checksum together, where a copy then a
//! checksum of the landed bytes read them twice.

use std::collections::HashMap;
use std::time::Instant;

use kvferry_kernels::cuda::view::{copy_plan, PlanError};
use kvferry_kernels::{CopyJob, GroupJob, GroupResult, Keep, LayerInput, Location};
use kvferry_transfer::TransferError;

use crate::checksum::{wait_device, ChecksumError};
use crate::proto::layout::RankLayout;
use crate::proto::msg::LoadRequest;
use crate::proto::serve_error::{WriteError, WriteErrorKind};
use crate::worker::Worker;

/// A load's one-pass reads: each worker's copy jobs over every layer of the load, and the
/// producer's mappings they read.
pub(super) struct CopyReads {
    /// Per worker (indexed as the workers).
    jobs: Vec<Vec<CopyJob>>,
    /// Per worker: what keeps the producer's memory mapped until its launches end.
    keep: Vec<Keep>,
    /// Bytes the launches copy: the cells of the load's tokens.
    bytes: u64,
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
    /// The producer's layers lie outside what it has registered and this side mapped.
    #[error("segment {segment}: {source}")]
    Map {
        /// The producer rank's segment.
        segment: String,
        /// Why.
        source: TransferError,
    },
    /// A layer cannot be copied chunk for chunk from its producer layer (its layout differs
    /// beyond its block count, or the kernel reads it byte by byte).
    #[error(transparent)]
    Layout(#[from] PlanError),
}

/// The one-pass reads of `request` (this side's block tables as `jobs` select them: per worker,
/// its jobs over every layer) from `producer` (its layout), where every layer and block pairs
/// up; else why not. Asks each worker's engine only for what is open and mapped already: never
/// blocks on a handshake or an import.
pub(super) fn plan_copy(
    workers: &[Worker],
    jobs: Vec<Vec<GroupJob>>,
    producer: &[RankLayout],
    request: &LoadRequest,
) -> Result<CopyReads, NoCopy> {
    let mut out = CopyReads {
        jobs: Vec::with_capacity(workers.len()),
        keep: Vec::with_capacity(workers.len()),
        bytes: 0,
    };
    let t0 = Instant::now();
    let (mut blocks_us, mut sources_us, mut check_us) = (0u128, 0u128, 0u128);
    for (i, (w, jobs)) in workers.iter().zip(jobs).enumerate() {
        let Location::Cuda(dev) = w.device else {
            return Err(NoCopy::Host(i));
        };
        let mut copies = Vec::with_capacity(jobs.len());
        let mut keep = Keep::new();
        // Every group of the load this rank holds is checksummed over all its layers and over
        // exactly the blocks the load moves: the copies then move all of it.
        for b in &request.blocks {
            let Some(g) = w.groups.iter().find(|g| g.group_id == b.group_id) else {
                continue;
            };
            if g.skipped.is_some() {
                return Err(NoCopy::Unchecked(g.group_id));
            }
            if !b.remote_positions.is_empty() || ![0, b.block_size].contains(&b.remote_block_size)
            {
                return Err(NoCopy::BlockSizes(g.group_id));
            }
            let job = jobs.iter().find(|j| j.group_id == g.group_id);
            if job.is_none_or(|j| j.layers.len() != g.layers.len()) {
                return Err(NoCopy::Blocks(g.group_id));
            }
        }
        for job in jobs {
            let group = job.group_id;
            let wire = request.blocks.iter().find(|b| b.group_id == group);
            let Some(wire) = wire.filter(|b| b.positions.len() == job.selection.block_ids.len())
            else {
                return Err(NoCopy::Blocks(group));
            };
            let remote: HashMap<u64, u64> = wire
                .positions
                .iter()
                .copied()
                .zip(wire.remote_blocks.iter().copied())
                .collect();
            let start = job.selection.start;
            let source_blocks = (start..start + job.selection.block_ids.len() as u64)
                .map(|p| remote.get(&p).copied())
                .collect::<Option<Vec<u64>>>()
                .ok_or(NoCopy::Blocks(group))?;
            let t = Instant::now();
            let sources = sources(w, dev, producer, &job, &mut keep)?;
            sources_us += t.elapsed().as_micros();
            let t = Instant::now();
            let layers: Vec<_> = job.layers.iter().map(triple).collect();
            let from: Vec<_> = sources.iter().map(triple).collect();
            let ids = &job.selection.block_ids;
            copy_plan(&layers, &from, ids, &source_blocks, start, job.num_tokens)?;
            check_us += t.elapsed().as_micros();
            out.bytes += copied_bytes(&job);
            copies.push(CopyJob {
                job,
                sources,
                source_blocks,
            });
        }
        out.jobs.push(copies);
        out.keep.push(keep);
    }
    blocks_us = t0.elapsed().as_micros() - sources_us - check_us - blocks_us;
    tracing::debug!(target: "kvferry::timing", blocks_us, sources_us, check_us, "one pass planned");
    Ok(out)
}

/// The producer layer each of `job`'s layers is copied from (the same name and heads), at the
/// address worker `w`'s device `dev` reads it, its mappings added to `keep`.
fn sources(
    w: &Worker,
    dev: u32,
    producer: &[RankLayout],
    job: &GroupJob,
    keep: &mut Keep,
) -> Result<Vec<LayerInput>, NoCopy> {
    // Per producer segment: the layers it holds (index into the job's) and their ranges.
    let mut by_segment: Vec<(&str, Vec<(usize, &LayerInput)>)> = Vec::new();
    for (k, l) in job.layers.iter().enumerate() {
        // Layers pair by name, as the planners pair them (a layout carries no layer numbers).
        let same = |p: &&LayerInput| {
            (&p.spec.name, p.spec.head_offset, p.spec.geometry.heads)
                == (&l.spec.name, l.spec.head_offset, l.spec.geometry.heads)
        };
        let found = producer.iter().find_map(|r| {
            let p = r.group(job.group_id)?.layers.iter().find(same)?;
            Some((r.segment.as_str(), p))
        });
        let (segment, p) = found.ok_or_else(|| NoCopy::NoSource(l.spec.name.clone()))?;
        match by_segment.iter_mut().find(|(s, _)| *s == segment) {
            Some((_, v)) => v.push((k, p)),
            None => by_segment.push((segment, vec![(k, p)])),
        }
    }
    let mut out: Vec<Option<LayerInput>> = vec![None; job.layers.len()];
    for (segment, layers) in by_segment {
        if !w.engine.has_segment(segment) {
            return Err(NoCopy::NotOpen(segment.to_string()));
        }
        let map = |source| NoCopy::Map {
            segment: segment.to_string(),
            source,
        };
        let handle = w.engine.open_segment(segment).map_err(map)?;
        let ranges: Vec<(u64, u64)> = layers.iter().map(|(_, p)| (p.addr, p.len)).collect();
        let mapped = w
            .engine
            .mapped(&handle, dev, &ranges)
            .map_err(map)?
            .ok_or_else(|| NoCopy::NotMapped(segment.to_string()))?;
        for ((k, p), m) in layers.into_iter().zip(mapped) {
            keep.push(m.keep());
            // This side's layer as the producer holds it: its own geometry (block count,
            // strides) at its address as mapped here.
            out[k] = Some(LayerInput {
                spec: kvferry_checksum::group::LayerSpec {
                    geometry: p.spec.geometry.clone(),
                    ..job.layers[k].spec.clone()
                },
                addr: m.ptr(),
                len: p.len,
            });
        }
    }
    Ok(out.into_iter().flatten().collect())
}

/// A layer as the launch plans take it.
fn triple(l: &LayerInput) -> (&kvferry_checksum::group::LayerSpec, u64, u64) {
    (&l.spec, l.addr, l.len)
}

/// Bytes a copy launch of `job` moves: each layer's cells of the selected blocks' tokens.
fn copied_bytes(job: &GroupJob) -> u64 {
    let bs = job.block_size;
    let start = job.selection.start;
    let n = job.selection.block_ids.len() as u64;
    let tokens = job
        .num_tokens
        .min((start + n).saturating_mul(bs))
        .saturating_sub(start.saturating_mul(bs));
    job.layers
        .iter()
        .map(|l| {
            let g = &l.spec.geometry;
            tokens.saturating_mul(g.heads).saturating_mul(g.cell_bytes())
        })
        .fold(0, u64::saturating_add)
}

impl CopyReads {
    /// Starts every worker's launches on this task (the backends only enqueue: no host wait)
    /// and returns what to wait for. A worker whose submit fails fails the reads; launches
    /// already queued still run to their end (their slots keep the producer's mappings).
    pub(super) fn submit(self, workers: &[Worker]) -> Submitted {
        let at = Instant::now();
        let mut pending = Vec::with_capacity(workers.len());
        for ((w, jobs), keep) in workers.iter().zip(self.jobs).zip(self.keep) {
            // SAFETY: the layers are this worker's KV (the Worker contract: valid and registered
            // while it is in use, and this load's blocks are its own until it ends); the sources
            // are the producer's registered memory as mapped here, checked against its live
            // table, and `keep` holds those mappings until the device is done with the launch.
            let p = unsafe { w.backend.submit_copying(jobs, keep) };
            let failed = p.is_err();
            pending.push((w.rank, p.map_err(ChecksumError::from)));
            if failed {
                break;
            }
        }
        Submitted {
            at,
            pending,
            bytes: self.bytes,
        }
    }
}

/// One-pass reads started ([`CopyReads::submit`]).
pub(super) struct Submitted {
    at: Instant,
    pending: Vec<(
        kvferry_checksum::group::RankInfo,
        Result<kvferry_kernels::PendingChecksums, ChecksumError>,
    )>,
    bytes: u64,
}

impl Submitted {
    /// Waits for every worker's launches until `deadline`: the bytes copied and each
    /// worker's results (indexed as the workers). Errors: the first worker's that failed or
    /// did not end in time; whatever still runs keeps its buffers and mappings until it ends.
    pub(super) async fn wait(
        self,
        deadline: Instant,
    ) -> Result<(u64, Vec<Vec<GroupResult>>), WriteError> {
        let timeout = deadline.saturating_duration_since(self.at);
        let mut out = Vec::with_capacity(self.pending.len());
        for (rank, p) in self.pending {
            let r = match p {
                Ok(p) => wait_device(p, self.at, timeout).await,
                Err(e) => Err(e),
            };
            let kind = match r {
                Ok(r) => {
                    out.push(r);
                    continue;
                }
                Err(ChecksumError::Timeout(t)) => WriteErrorKind::GroupsTimeout(t),
                Err(ChecksumError::Kernel(e)) => WriteErrorKind::Copy(e),
                // Not from a device wait; taken as a launch that may still run.
                Err(_) => WriteErrorKind::GroupsTimeout(timeout),
            };
            return Err(WriteError { rank, kind });
        }
        Ok((self.bytes, out))
    }
}
