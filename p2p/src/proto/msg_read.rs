//! Wire forms of consumer-driven reads (docs/design.md §4.10): the producer's layout, sent in a
//! FINISH to a consumer that asks for it, and the consumer's `read_done`, which ends the lease
//! of a load it read itself. Bounded as every control message ([`super::msg`]).

use serde::{Deserialize, Serialize};

use kvferry_checksum::group::{LayerSpec, RankInfo, ReplicaKey, SkipReason};
use kvferry_checksum::layout::LayoutError;
use kvferry_kernels::LayerInput;

use super::layout::{RankLayout, WorkerGroup};
use super::msg_body::{WireLayer, MAX_RANKS, PROTOCOL_VERSION};
use super::wire::{from_wire, to_wire_layer};

/// `kind` of a consumer → producer `read_done`.
pub const KIND_READ_DONE: &str = "read_done";

/// Most KV cache groups of one rank in a producer's layout.
pub const MAX_LAYOUT_GROUPS: usize = 256;
/// Most layers of one group of one rank in a producer's layout.
pub const MAX_LAYOUT_LAYERS: usize = 4096;

/// One KV cache group of one producer rank, as a consumer that reads needs it to plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireProducerGroup {
    /// KV cache group id.
    pub group_id: u32,
    /// The producer's block size (tokens).
    pub block_size: u64,
    /// Whether the group holds one state per block (Mamba-type) instead of per-token KV: it
    /// moves only between equal block sizes.
    #[serde(default)]
    pub state: bool,
    /// The rank's layers of the group: name, array address and length in the producer's
    /// memory, head offset, geometry and element type.
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_LAYOUT_LAYERS>")]
    pub layers: Vec<WireLayer>,
}

/// One producer rank: its engine's segment and its KV memory (the producer's half of what the
/// plan reads, `proto::layout::RankLayout`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireProducerRank {
    /// TP rank.
    pub tp_rank: u32,
    /// PP rank.
    pub pp_rank: u32,
    /// The rank's transfer engine segment name (`host:port`), where a consumer reads.
    pub segment: String,
    /// The rank's groups.
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_LAYOUT_GROUPS>")]
    pub groups: Vec<WireProducerGroup>,
}

/// The producer's whole layout on the wire, its ranks in its own order (at most [`MAX_RANKS`]).
pub type WireProducerLayout = Vec<WireProducerRank>;

/// Consumer → producer: "I have read load `load_id` of `request_id`; its lease may end". Only
/// the session that loads it may end it; anything else is ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadDone {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// [`KIND_READ_DONE`].
    pub kind: String,
    /// The request read.
    pub request_id: String,
    /// The load ([`super::msg::LoadRequest::load_id`]).
    pub load_id: u64,
}

impl ReadDone {
    /// The message for load `load_id` of `request_id`.
    pub fn new(request_id: &str, load_id: u64) -> ReadDone {
        ReadDone {
            version: PROTOCOL_VERSION,
            kind: KIND_READ_DONE.to_string(),
            request_id: request_id.to_string(),
            load_id,
        }
    }
}

/// `ranks` (a producer's, as its shell built them) in their wire form.
pub fn layout_to_wire(ranks: &[RankLayout]) -> WireProducerLayout {
    ranks
        .iter()
        .map(|r| WireProducerRank {
            tp_rank: r.rank.tp_rank,
            pp_rank: r.rank.pp_rank,
            segment: r.segment.clone(),
            groups: r
                .groups
                .iter()
                .map(|g| WireProducerGroup {
                    group_id: g.group_id,
                    block_size: g.block_size,
                    state: g.skipped == Some(SkipReason::NoPerTokenBlocks),
                    layers: g.layers.iter().map(to_wire_layer).collect(),
                })
                .collect(),
        })
        .collect()
}

/// The digest of a producer's layout as a read request names it
/// ([`super::msg::LoadRequest::layout_digest`]): HMAC-SHA256 under a fixed label of its
/// msgpack form, 32 bytes. Not a secret: it only tells a layout from another.
pub fn layout_digest(layout: &WireProducerLayout) -> [u8; 32] {
    let bytes = rmp_serde::to_vec_named(layout).unwrap_or_default();
    kvferry_transfer::auth::hmac_sha256(b"kvferry/layout/v1", &[&bytes])
}

/// Why a producer's layout cannot be planned with ([`layout_from_wire`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutFromWireError {
    /// No rank, or more than [`MAX_RANKS`].
    #[error("the producer's layout lists {0} ranks")]
    RankCount(usize),
    /// A layer's geometry does not parse.
    #[error("producer layer {name:?}: {source}")]
    Geometry {
        /// The layer.
        name: String,
        /// Why.
        #[source]
        source: LayoutError,
    },
    /// Two ranks at one TP/PP place.
    #[error("the producer's layout lists rank tp={tp_rank} pp={pp_rank} twice")]
    RankTwice {
        /// TP rank.
        tp_rank: u32,
        /// PP rank.
        pp_rank: u32,
    },
    /// A layer whose array's blocks hold another number of tokens than its group's blocks.
    #[error(
        "producer layer {name:?}: its array's blocks hold {array} tokens, its group's {group}"
    )]
    BlockSize {
        /// The layer.
        name: String,
        /// Tokens per block of the array (kernel blocks per block × tokens per kernel block).
        array: u64,
        /// The group's block size.
        group: u64,
    },
    /// A layer's array does not fit its length, or its end does not fit in 64 bits.
    #[error("producer layer {name:?}: {len} bytes at {addr:#x} do not hold its geometry")]
    Array {
        /// The layer.
        name: String,
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
    },
}

/// The producer's layout as the plan reads it. Only what the plan uses is filled: a layer's
/// number, kind and replica key are not sent (the checksums are each side's own). Errors: a
/// geometry that does not parse, an array shorter than its geometry or past the address space.
pub fn layout_from_wire(w: &[WireProducerRank]) -> Result<Vec<RankLayout>, LayoutFromWireError> {
    if w.is_empty() || w.len() > MAX_RANKS {
        return Err(LayoutFromWireError::RankCount(w.len()));
    }
    let mut places = std::collections::HashSet::with_capacity(w.len());
    if let Some(r) = w.iter().find(|r| !places.insert((r.tp_rank, r.pp_rank))) {
        return Err(LayoutFromWireError::RankTwice {
            tp_rank: r.tp_rank,
            pp_rank: r.pp_rank,
        });
    }
    let (tp_size, pp_size) = w.iter().fold((0, 0), |(t, p), r| {
        (
            t.max(r.tp_rank.saturating_add(1)),
            p.max(r.pp_rank.saturating_add(1)),
        )
    });
    w.iter()
        .map(|r| {
            let groups = r
                .groups
                .iter()
                .map(|g| {
                    let layers = g
                        .layers
                        .iter()
                        .map(|l| {
                            let geometry = from_wire(&l.geometry).map_err(|source| {
                                LayoutFromWireError::Geometry {
                                    name: l.name.clone(),
                                    source,
                                }
                            })?;
                            // A state group's arrays hold one state per block, not tokens.
                            if !g.state && geometry.block_size() != g.block_size {
                                return Err(LayoutFromWireError::BlockSize {
                                    name: l.name.clone(),
                                    array: geometry.block_size(),
                                    group: g.block_size,
                                });
                            }
                            if geometry.byte_len() > l.len || l.addr.checked_add(l.len).is_none() {
                                return Err(LayoutFromWireError::Array {
                                    name: l.name.clone(),
                                    addr: l.addr,
                                    len: l.len,
                                });
                            }
                            Ok(LayerInput {
                                spec: LayerSpec {
                                    name: l.name.clone(),
                                    layer: 0,
                                    head_offset: l.head_offset,
                                    geometry,
                                    kind: None,
                                    dtype: l.dtype.clone(),
                                    replica: ReplicaKey::NONE,
                                },
                                addr: l.addr,
                                len: l.len,
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok(WorkerGroup {
                        group_id: g.group_id,
                        block_size: g.block_size,
                        layers,
                        sliding_window: None,
                        skipped: g.state.then_some(SkipReason::NoPerTokenBlocks),
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(RankLayout {
                rank: RankInfo {
                    tp_rank: r.tp_rank,
                    tp_size,
                    pp_rank: r.pp_rank,
                    pp_size,
                },
                segment: r.segment.clone(),
                groups,
            })
        })
        .collect()
}
