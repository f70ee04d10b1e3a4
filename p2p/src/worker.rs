//! One TP/PP rank of a producer or consumer (docs/design.md §4 "Ranks"): its transfer
//! engine, its KV memory (groups → layers) and its checksum backend.

use std::sync::Arc;

use kvferry_checksum::group::{RankInfo, SkipReason};
use kvferry_kernels::{ChecksumBackend, Location};
use kvferry_transfer::TransferEngine;

use crate::error::{P2pError, WorkersFault};
use crate::proto::layout::RankLayout;
pub use crate::proto::layout::WorkerGroup;

/// One TP/PP rank.
#[derive(Clone)]
pub struct Worker {
    /// TP/PP place of this rank.
    pub rank: RankInfo,
    /// The rank's transfer engine; its memory regions must cover every layer array.
    pub engine: Arc<TransferEngine>,
    /// Where the layer arrays live (checksum jobs run there).
    pub device: Location,
    /// The rank's KV cache groups.
    pub groups: Vec<WorkerGroup>,
    /// The rank's checksum backend (CPU or CUDA).
    pub backend: Arc<dyn ChecksumBackend>,
}

impl Worker {
    /// The rank as the protocol sees it: place, segment and groups, without the engine.
    pub fn layout(&self) -> RankLayout {
        RankLayout {
            rank: self.rank,
            segment: self.engine.segment_name(),
            groups: self.groups.clone(),
        }
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("rank", &self.rank)
            .field("segment", &self.engine.segment_name())
            .field("device", &self.device)
            .field("groups", &self.groups)
            .field("backend", &self.backend.name())
            .finish()
    }
}

/// Checks that `workers` are exactly the ranks of one TP×PP grid, each once, in
/// any order, that they agree on group ids and block sizes, and that each layer's
/// length covers its geometry. Returns (tp_size, pp_size) and the workers sorted
/// by (pp_rank, tp_rank).
pub fn validate(mut workers: Vec<Worker>) -> Result<(u32, u32, Vec<Worker>), P2pError> {
    let first = workers
        .first()
        .ok_or(P2pError::Workers(WorkersFault::NoWorkers))?;
    let (tp, pp) = (first.rank.tp_size, first.rank.pp_size);
    if tp == 0 || pp == 0 {
        return Err(P2pError::Workers(WorkersFault::ZeroSize { tp, pp }));
    }
    if workers.len() as u64 != tp as u64 * pp as u64 {
        return Err(P2pError::Workers(WorkersFault::Count {
            workers: workers.len(),
            tp,
            pp,
        }));
    }
    workers.sort_by_key(|w| (w.rank.pp_rank, w.rank.tp_rank));
    for (i, w) in workers.iter().enumerate() {
        let want = ((i as u32) / tp, (i as u32) % tp);
        if w.rank.tp_size != tp || w.rank.pp_size != pp || (w.rank.pp_rank, w.rank.tp_rank) != want
        {
            return Err(P2pError::Workers(WorkersFault::OffGrid {
                rank: w.rank,
                tp,
                pp,
            }));
        }
    }
    let groups = |w: &Worker| {
        w.groups
            .iter()
            .map(|g| (g.group_id, g.block_size))
            .collect::<Vec<_>>()
    };
    let reference = groups(&workers[0]);
    let mut ids: Vec<u32> = reference.iter().map(|g| g.0).collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.len() != reference.len() {
        return Err(P2pError::Workers(WorkersFault::DuplicateGroup));
    }
    for w in &workers {
        if groups(w) != reference {
            return Err(P2pError::Workers(WorkersFault::GroupsDiffer {
                rank: w.rank,
                groups: groups(w),
                reference,
            }));
        }
        for g in &w.groups {
            if g.block_size == 0 {
                return Err(P2pError::Workers(WorkersFault::ZeroBlockSize {
                    group: g.group_id,
                }));
            }
            for l in &g.layers {
                let geo = &l.spec.geometry;
                if geo.byte_len() > l.len {
                    return Err(P2pError::Workers(WorkersFault::LayerTooShort {
                        layer: l.spec.name.clone(),
                        spans: geo.byte_len(),
                        len: l.len,
                    }));
                }
                // A state group (Mamba-type: no per-token blocks) holds one state per block,
                // whatever its block size in tokens.
                let state = g.skipped == Some(SkipReason::NoPerTokenBlocks);
                if !state && geo.block_size() != g.block_size {
                    return Err(P2pError::Workers(WorkersFault::BlockSizeDiffers {
                        layer: l.spec.name.clone(),
                        layer_block_size: geo.block_size(),
                        group: g.group_id,
                        group_block_size: g.block_size,
                    }));
                }
            }
        }
    }
    Ok((tp, pp, workers))
}
