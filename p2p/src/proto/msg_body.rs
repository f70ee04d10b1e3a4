//! The parts of control messages that several message kinds share (docs/design.md §4.2): the
//! protocol version, the caps on every list, and a rank's KV memory on the wire (its layers'
//! addresses and geometry). Re-exported by [`super::msg`].

use serde::{Deserialize, Serialize};

/// Version of the control-channel protocol this crate speaks.
pub const PROTOCOL_VERSION: u32 = 2;

/// Largest control message accepted (bytes). Block tables of long prompts fit
/// easily; anything larger is refused before decoding.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Default largest ZeroMQ message (all its frames) or command a peer may send on the control
/// channel, in bytes: [`MAX_MESSAGE_BYTES`] and 4 KiB of envelope. A frame header declaring more
/// is refused by the ZMTP decoder before anything is reserved, and the connection is dropped
/// (`ProducerConfig::max_message_bytes`, `ConsumerConfig::max_message_bytes`).
pub const DEFAULT_MAX_ZMTP_MESSAGE: usize = MAX_MESSAGE_BYTES + 4096;

/// Most KV cache groups a request names (its `blocks`, a rank's `groups`).
pub const MAX_GROUPS: usize = 4096;
/// Most consumer ranks (TP × PP) a request lists.
pub const MAX_RANKS: usize = 4096;
/// Most layers of one group on one rank.
pub const MAX_LAYERS: usize = 65536;
/// Most blocks of one group in one request (16M tokens at block size 16).
pub const MAX_BLOCKS: usize = 1 << 20;
/// Most strides of a geometry (one per layout dimension; layouts have at most 5).
pub const MAX_STRIDES: usize = 16;

/// A layer's cache array geometry on the wire: the checksum crate's `Geometry`
/// (docs/design.md §2.2) flattened into plain numbers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireGeometry {
    /// Layout text, e.g. `"KV B N H D"`.
    pub layout: String,
    /// B: kernel blocks in the array.
    pub num_kernel_blocks: u64,
    /// N: tokens per kernel block.
    pub tokens_per_kernel_block: u64,
    /// H: KV heads on this rank (1 when the layout has none).
    pub heads: u64,
    /// D: elements per head.
    pub head_dim: u64,
    /// Bytes per element: 1, 2, 4 or 8.
    pub elem_bytes: u64,
    /// Kernel blocks per logical block.
    pub kernel_blocks_per_block: u64,
    /// Byte stride per layout dimension, outermost first.
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_STRIDES>")]
    pub strides: Vec<u64>,
}

/// One layer of one consumer rank: where its array lives and how it is laid out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireLayer {
    /// Layer name (`model.layers.12.self_attn.attn`); pairs the layer with the producer's.
    pub name: String,
    /// Base address of the layer's array in the consumer's memory (registered with its engine).
    pub addr: u64,
    /// Bytes the array spans.
    pub len: u64,
    /// Global KV head index of the array's head 0 on this rank (the checksum crate's
    /// `LayerSpec::head_offset`): the producer maps heads between ranks with it.
    pub head_offset: u32,
    /// The array's geometry on the consumer.
    pub geometry: WireGeometry,
    /// The layer's element type (e.g. `torch.bfloat16`, the checksum crate's
    /// `LayerSpec::dtype`), `None` when the consumer names none; the producer refuses a pair
    /// whose types differ (`proto::spec_checks`).
    #[serde(default)]
    pub dtype: Option<String>,
}

/// One KV cache group's layers on one consumer rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireRankGroup {
    /// KV cache group id.
    pub group_id: u32,
    /// Layers of the group held by this rank.
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_LAYERS>")]
    pub layers: Vec<WireLayer>,
}

/// One consumer rank: its transfer engine segment and its KV memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireRank {
    /// TP rank.
    pub tp_rank: u32,
    /// PP rank.
    pub pp_rank: u32,
    /// The rank's transfer engine segment name (`host:port`).
    pub segment: String,
    /// The rank's groups.
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_GROUPS>")]
    pub groups: Vec<WireRankGroup>,
}

/// Which blocks of one group to write: parallel lists, one entry per block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireBlocks {
    /// KV cache group id.
    pub group_id: u32,
    /// Block size (tokens) on the consumer.
    pub block_size: u64,
    /// The producer's block size (tokens) as the consumer was told it (vLLM: in the producer's
    /// `kv_transfer_params`); 0 (or absent): the same as `block_size`. The producer refuses a
    /// value other than its own. When the sizes differ, it fills each consumer block token by
    /// token from its own blocks (docs/design.md §4.5).
    #[serde(default)]
    pub remote_block_size: u64,
    /// Block positions in the request (block `p` holds tokens `[p·block_size, (p+1)·block_size)`).
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_BLOCKS>")]
    pub positions: Vec<u64>,
    /// The producer's block ids, as the consumer was told them: at each of `positions`, or,
    /// when `remote_positions` is not empty, at each of those.
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_BLOCKS>")]
    pub remote_blocks: Vec<u64>,
    /// With different block sizes: the producer block position (in producer blocks) of each of
    /// `remote_blocks`, ascending. Empty (or absent): `remote_blocks` is parallel to `positions`.
    #[serde(
        default,
        deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_BLOCKS>"
    )]
    pub remote_positions: Vec<u64>,
    /// The consumer's block id at each position (the write target).
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_BLOCKS>")]
    pub local_blocks: Vec<u64>,
}
