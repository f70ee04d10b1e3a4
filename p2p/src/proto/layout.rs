//! What the protocol knows of a rank (docs/design.md §4 "Ranks"): its TP/PP place, its
//! segment and the KV memory of each group, as plain data. The shells build these from
//! their workers once; the planner and the request builder read nothing else.

use kvferry_checksum::group::{RankInfo, SkipReason};
use kvferry_kernels::LayerInput;

use crate::proto::heads::HeadMap;

/// One KV cache group as one rank holds it.
#[derive(Debug, Clone)]
pub struct WorkerGroup {
    /// KV cache group id (the index into the block tables passed to publish/load).
    pub group_id: u32,
    /// Tokens per block (same on every rank of one side).
    pub block_size: u64,
    /// The rank's layers of this group: spec (name, layer number, head offset,
    /// geometry, replica key) plus the base address and byte length of the layer's
    /// array. The memory is owned by the embedder and must stay valid (and
    /// registered with the worker's engine) while the worker is in use.
    pub layers: Vec<LayerInput>,
    /// Sliding window in tokens, `None` for full attention (§2.5).
    pub sliding_window: Option<u64>,
    /// `Some(reason)` when the group cannot be checksummed (§2.3): its blocks are
    /// still transferred, the record reports it skipped.
    pub skipped: Option<SkipReason>,
}

/// One TP/PP rank as the protocol sees it.
#[derive(Debug, Clone)]
pub struct RankLayout {
    /// TP/PP place of the rank.
    pub rank: RankInfo,
    /// The segment name of the rank's transfer engine (`host:port`), where peers write.
    pub segment: String,
    /// The rank's KV cache groups.
    pub groups: Vec<WorkerGroup>,
}

impl RankLayout {
    /// The rank's group `group_id`, if it holds one.
    pub fn group(&self, group_id: u32) -> Option<&WorkerGroup> {
        self.groups.iter().find(|g| g.group_id == group_id)
    }
}

/// The head map of group `group_id` over `ranks` (rank indices into `ranks`, layer indices
/// into each rank's group). `Err(i)`: rank `i` has no such group.
pub fn group_heads(ranks: &[RankLayout], group_id: u32) -> Result<HeadMap<'_>, usize> {
    let mut layers = Vec::with_capacity(ranks.len());
    for (i, r) in ranks.iter().enumerate() {
        let g = r.group(group_id).ok_or(i)?;
        layers.push(g.layers.iter().map(|l| &l.spec));
    }
    Ok(HeadMap::of_ranks(layers))
}
