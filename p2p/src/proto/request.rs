//! The consumer's transfer request for one load (docs/design.md §4): which blocks of which
//! groups to load (positions from the request's first token, blocks wholly below the local
//! prefix hit left out) and every consumer rank's layers, from the ranks as plain data.

use std::collections::HashSet;

use kvferry_checksum::group::SkipReason;

use crate::proto::layout::RankLayout;
use crate::proto::msg::{
    LoadRequest, WireBlocks, WireRank, WireRankGroup, KIND_TRANSFER_REQUEST, PROTOCOL_VERSION,
};
use crate::proto::spec_checks::{
    blocks_needed, cache_blocks, check_distinct, check_table, TableError,
};
use crate::proto::wire::to_wire_layer;

/// One group of a load: the block tables of both sides, position by position
/// from the request's first token (`None` = null block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadGroup {
    /// KV cache group id.
    pub group_id: u32,
    /// The producer's block table, as it announced it (e.g. in kv_transfer_params).
    pub remote_blocks: Vec<Option<u64>>,
    /// The consumer's block table for the request.
    pub local_blocks: Vec<Option<u64>>,
    /// The producer's block size for this group (tokens per block of `remote_blocks`), as it
    /// announced it (vLLM: in `kv_transfer_params`); `None`: the same as the consumer's. When
    /// it differs, the producer fills each consumer block token by token from its own blocks
    /// (docs/design.md §4.5) and the verdict compares chunk sums (§2.6).
    pub remote_block_size: Option<u64>,
}

/// What to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSpec {
    /// The request whose KV is loaded.
    pub request_id: String,
    /// The producer's control endpoint ([`crate::Producer::endpoint`]).
    pub producer: String,
    /// Groups to load; groups of the workers not listed are not loaded.
    pub groups: Vec<LoadGroup>,
    /// Tokens the consumer already holds (a local prefix hit): blocks wholly below it are not loaded nor compared.
    pub num_local_computed: u64,
    /// Tokens of KV the consumer holds after the load (num_computed).
    pub num_tokens: u64,
    /// The lease's load key ([`crate::PublishInfo::load_key`], carried by the proxy in
    /// vLLM's `kv_transfer_params`): the producer serves the request only with it.
    pub load_key: Option<String>,
}

/// The blocks one group's load wrote (consumer block ids at request positions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LandedGroup {
    /// KV cache group id.
    pub group_id: u32,
    /// Block positions written.
    pub positions: Vec<u64>,
    /// The consumer block written at each position.
    pub local_blocks: Vec<u64>,
}

/// What the landed hook sees: the transfer finished, verification has not started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Landed {
    /// The request.
    pub request_id: String,
    /// Blocks written, per group.
    pub groups: Vec<LandedGroup>,
}

/// Why a load spec cannot be turned into a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The local prefix already covers the tokens to load.
    #[error("nothing to load: num_local_computed {num_local_computed} >= num_tokens {num_tokens}")]
    NothingToLoad {
        /// Tokens the consumer holds.
        num_local_computed: u64,
        /// Tokens after the load.
        num_tokens: u64,
    },
    /// The consumer's ranks have no such group.
    #[error("no group {0}")]
    NoGroup(u32),
    /// A group is listed twice.
    #[error("group {0} listed twice")]
    GroupTwice(u32),
    /// A block table breaks a table rule (`proto::spec_checks`): it does not cover
    /// `num_tokens` exactly, names a block outside the cache, or writes one block twice.
    #[error(transparent)]
    Table(#[from] TableError),
    /// A position with a consumer block to fill but no producer block.
    #[error("group {group} position {position}: a local block but no producer block")]
    NoProducerBlock {
        /// The group.
        group: u32,
        /// The block position (with different block sizes: the producer's block position
        /// holding tokens of a consumer block to fill).
        position: u64,
    },
    /// A state group (Mamba-type, no per-token blocks) between different block sizes.
    #[error("group {group}: a state group (no per-token KV blocks) moves only between equal block sizes; the consumer's is {local}, the producer's {remote}")]
    StateBlockSize {
        /// The group.
        group: u32,
        /// The consumer's block size (tokens).
        local: u64,
        /// The producer's block size (tokens).
        remote: u64,
    },
    /// A producer block size of 0.
    #[error("group {0}: producer block size 0")]
    RemoteBlockSizeZero(u32),
}

/// Builds the request that loads `spec` into `ranks` (a TP `tp` × PP `pp` grid, validated,
/// every rank with the same groups), and the blocks it will land. `budget_ms`, `token`,
/// `key_proof` and `proof` are left for the caller (the grants and the connection's state
/// machine, which binds them to its session).
/// Errors: [`SpecError`].
pub fn build_request(
    ranks: &[RankLayout],
    tp: u32,
    pp: u32,
    spec: &LoadSpec,
) -> Result<(LoadRequest, Landed), SpecError> {
    let (mut request, landed) = build_blocks(ranks, tp, pp, spec)?;
    request.ranks = wire_ranks(ranks, &request);
    Ok((request, landed))
}

/// [`build_request`] less the ranks' layers (`ranks` left empty, for [`wire_ranks`]): every
/// check of `spec` made, its blocks listed. A consumer that reads the producer's blocks itself
/// sends no layers; one that starts a copy before anything else needs only the blocks.
/// Errors: [`SpecError`].
pub fn build_blocks(
    ranks: &[RankLayout],
    tp: u32,
    pp: u32,
    spec: &LoadSpec,
) -> Result<(LoadRequest, Landed), SpecError> {
    if spec.num_local_computed >= spec.num_tokens {
        return Err(SpecError::NothingToLoad {
            num_local_computed: spec.num_local_computed,
            num_tokens: spec.num_tokens,
        });
    }
    let mut blocks = Vec::new();
    let mut landed = Landed {
        request_id: spec.request_id.clone(),
        groups: Vec::new(),
    };
    let mut seen = HashSet::new();
    for lg in &spec.groups {
        let g = ranks
            .first()
            .and_then(|r| r.group(lg.group_id))
            .ok_or(SpecError::NoGroup(lg.group_id))?;
        if !seen.insert(lg.group_id) {
            return Err(SpecError::GroupTwice(lg.group_id));
        }
        let bs = g.block_size;
        let rbs = lg.remote_block_size.unwrap_or(bs);
        if rbs == 0 {
            return Err(SpecError::RemoteBlockSizeZero(lg.group_id));
        }
        if rbs != bs && g.skipped == Some(SkipReason::NoPerTokenBlocks) {
            // A state block holds the state after its last token, not tokens: which producer
            // state a consumer block of another size takes is not defined.
            return Err(SpecError::StateBlockSize {
                group: lg.group_id,
                local: bs,
                remote: rbs,
            });
        }
        // Both tables cover the tokens exactly (each in its own block size); the local ids
        // lie inside this side's cache (the producer checks its own ids against its lease).
        let (num_blocks, _) = cache_blocks(ranks, lg.group_id)?;
        check_table(
            lg.group_id,
            &lg.local_blocks,
            spec.num_tokens,
            bs,
            num_blocks,
        )?;
        let needed = blocks_needed(spec.num_tokens, rbs).ok_or(TableError::NoCache(lg.group_id))?;
        if lg.remote_blocks.len() as u64 != needed {
            return Err(SpecError::Table(TableError::Coverage {
                group: lg.group_id,
                positions: lg.remote_blocks.len() as u64,
                num_tokens: spec.num_tokens,
                block_size: rbs,
                needed,
            }));
        }
        let mut wb = WireBlocks {
            group_id: lg.group_id,
            block_size: bs,
            remote_block_size: rbs,
            positions: Vec::new(),
            remote_blocks: Vec::new(),
            remote_positions: Vec::new(),
            local_blocks: Vec::new(),
        };
        // With different block sizes: the producer positions holding the tokens to fill.
        let mut remote = std::collections::BTreeMap::new();
        for (p, local) in lg.local_blocks.iter().enumerate() {
            let (Some(local), p) = (*local, p as u64) else {
                continue;
            };
            let first = p.saturating_mul(bs);
            if first.saturating_add(bs) <= spec.num_local_computed || first >= spec.num_tokens {
                continue;
            }
            let no_block = |position| SpecError::NoProducerBlock {
                group: lg.group_id,
                position,
            };
            if rbs == bs {
                let remote = lg.remote_blocks.get(p as usize).copied().flatten();
                wb.remote_blocks.push(remote.ok_or(no_block(p))?);
            } else {
                // Tokens [first, end) of this block come from the producer blocks holding them.
                // Outside a sliding window the producer may have freed some (null blocks):
                // those tokens are not attended to and are not loaded.
                let end = first.saturating_add(bs).min(spec.num_tokens);
                for q in first / rbs..end.div_ceil(rbs) {
                    match lg.remote_blocks.get(q as usize).copied().flatten() {
                        Some(b) => {
                            remote.insert(q, b);
                        }
                        None if g.sliding_window.is_some() => {}
                        None => return Err(no_block(q)),
                    }
                }
            }
            wb.positions.push(p);
            wb.local_blocks.push(local);
        }
        if rbs != bs {
            (wb.remote_positions, wb.remote_blocks) = remote.into_iter().unzip();
        }
        check_distinct(lg.group_id, &wb.positions, &wb.local_blocks)?;
        landed.groups.push(LandedGroup {
            group_id: lg.group_id,
            positions: wb.positions.clone(),
            local_blocks: wb.local_blocks.clone(),
        });
        blocks.push(wb);
    }
    let request = LoadRequest {
        version: PROTOCOL_VERSION,
        kind: KIND_TRANSFER_REQUEST.to_string(),
        request_id: spec.request_id.clone(),
        load_id: 0,
        tp_size: tp,
        pp_size: pp,
        num_local_computed: spec.num_local_computed,
        num_tokens: spec.num_tokens,
        budget_ms: 0, // set by the connection's state machine
        blocks,
        ranks: Vec::new(), // [`wire_ranks`]
        token: None,       // set by the caller with the grants
        key_proof: None,   // set with the session (the connection's state machine)
        proof: None,       // idem
        read: false,       // set by the consumer where it reads (§4.10)
        want_layout: false,
        layout_digest: None,
    };
    Ok((request, landed))
}

/// The request's `ranks`: every rank of `ranks` with its layers of the groups `request` loads
/// (in the ranks' order), as the producer's plan takes them.
pub fn wire_ranks(ranks: &[RankLayout], request: &LoadRequest) -> Vec<WireRank> {
    let seen: HashSet<u32> = request.blocks.iter().map(|b| b.group_id).collect();
    ranks
        .iter()
        .map(|r| WireRank {
            tp_rank: r.rank.tp_rank,
            pp_rank: r.rank.pp_rank,
            segment: r.segment.clone(),
            groups: r
                .groups
                .iter()
                .filter(|g| seen.contains(&g.group_id))
                .map(|g| WireRankGroup {
                    group_id: g.group_id,
                    layers: g.layers.iter().map(to_wire_layer).collect(),
                })
                .collect(),
        })
        .collect()
}

/// The bytes a load of `request` touches on `rank`: `(address, length)` of every whole block
/// the request writes, of the rank's heads, in every layer of the loaded groups the rank holds
/// (groups it does not hold give none). What the consumer grants the load's token WRITE on, so
/// that the producer can write exactly these bytes and nothing else.
///
/// Listed layer by layer in address order, each of block 0's ranges for the ascending blocks
/// in turn, and a range that starts where the one before ends joined to it: blocks that follow
/// each other in the cache give one range, and the list comes ascending for the layouts whose
/// parts lie one after another (the grant then merges it in one pass, without a sort).
pub fn grant_ranges(rank: &RankLayout, request: &LoadRequest) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for b in &request.blocks {
        let Some(g) = rank.group(b.group_id) else {
            continue;
        };
        let mut blocks = b.local_blocks.clone();
        blocks.sort_unstable();
        let mut layers: Vec<_> = g.layers.iter().collect();
        layers.sort_by_key(|l| l.addr);
        for l in layers {
            let geo = &l.spec.geometry;
            // Block 0's ranges once per layer, moved to each block.
            let first = geo.block_byte_ranges(0);
            let stride = geo.block_stride();
            let inside = blocks.partition_point(|&b| b < geo.num_blocks());
            for r in &first {
                let len = r.end - r.start;
                for &local in &blocks[..inside] {
                    let start = l.addr + local * stride + r.start;
                    match ranges.last_mut() {
                        Some(p) if p.0.checked_add(p.1) == Some(start) => {
                            match p.1.checked_add(len) {
                                Some(n) => p.1 = n,
                                None => ranges.push((start, len)),
                            }
                        }
                        _ => ranges.push((start, len)),
                    }
                }
            }
        }
    }
    ranges
}
