//! Host side of one checksum launch (docs/design.md §5): the table of layer views the kernel
//! in `kernels/cuda/checksum.cu` reads, built and checked from a group's layers.
//!
//! Pure (no CUDA): the tests in `view_replay_tests.rs` replay the kernel's index arithmetic on the
//! CPU against `kvferry_checksum::definition`, so the plan is tested on machines without a GPU.

use kvferry_checksum::definition::head_factor;
use kvferry_checksum::group::{LayerSpec, ReplicaKey};
use kvferry_checksum::layout::Dim;

/// One layer as the kernel sees it. Mirrors `struct LayerView` in
/// `kernels/cuda/checksum.cu` field for field (`repr(C)`, 144 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerView {
    /// Device address of the layer's array.
    pub base: u64,
    /// Byte stride of the kernel-block dimension `B`.
    pub s_block: u64,
    /// Byte stride of `KV` (0 with one part).
    pub s_part: u64,
    /// Byte stride of the outer row dimension (`N` or `H`).
    pub s_outer: u64,
    /// Byte stride of the inner row dimension (`H` or `N`).
    pub s_inner: u64,
    /// Byte stride of `D`.
    pub s_d: u64,
    /// Head factor `m` of local head 0 (§2.1); head `h` has `m_base + 2h`.
    pub m_base: u64,
    /// `P`: 8-byte pieces per cell.
    pub pieces: u64,
    /// Size of the outer row dimension.
    pub n_outer: u32,
    /// Size of the inner row dimension.
    pub n_inner: u32,
    /// 1 when the outer row dimension is `N` (tokens), 0 when it is `H`.
    pub outer_is_token: u32,
    /// `D`: elements per head per part.
    pub d: u32,
    /// Element size in bytes.
    pub elem: u32,
    /// 2 with a `KV` dimension, else 1.
    pub parts: u32,
    /// `N`: tokens per kernel block.
    pub tokens: u32,
    /// Kernel blocks per logical block.
    pub kb_per_block: u32,
    /// Load path, one of [`MODE_VEC16`], [`MODE_VEC8`], [`MODE_GENERIC`].
    pub mode: u32,
    /// Tiles per logical block: `kb_per_block * parts` on the vector paths, `kb_per_block` on the generic one.
    pub tiles_per_block: u32,
    /// Index of this layer's first tile among one block's tiles (tiles are block-major).
    pub tile_begin: u32,
    /// Output slot (index of this layer's replica key in [`LaunchPlan::keys`]).
    pub slot: u32,
    /// 0, or `1 | log2(R) << 8 | log2(n_inner) << 16` when rows of `R` chunks and the
    /// inner dimension tile the 256 threads exactly (the kernel's regular path).
    pub regular: u32,
    /// Keeps the size a multiple of 8.
    pub pad: u32,
    /// Copy launches ([`copy_plan`]): device address of the array the layer's chunks are
    /// copied from (0 otherwise).
    pub src_base: u64,
    /// Its byte stride of `B` (its block count may differ from the layer's).
    pub src_s_block: u64,
    /// Its byte stride of `KV`.
    pub src_s_part: u64,
}

/// Threads per block of the checksum kernel (`KVF_THREADS` in checksum.cu).
pub const THREADS: u32 = 256;

/// Rows are whole 16-byte vectors, 16-byte aligned: 128-bit loads.
pub const MODE_VEC16: u32 = 0;
/// Rows are whole 8-byte pieces, 8-byte aligned: 64-bit loads.
pub const MODE_VEC8: u32 = 1;
/// Anything else (strided `D`, pieces straddling K and V, odd alignment): bytes gathered one by one.
pub const MODE_GENERIC: u32 = 2;

/// A group's launch: its views (`tile_begin` ascending), block ids, replica keys (one
/// output slot each) and tile counts. Tile `t` is block `t / tiles_per_group`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchPlan {
    /// One view per layer, in the job's layer order.
    pub views: Vec<LayerView>,
    /// Logical block ids; `block_ids[b]` sits at position `start + b`.
    pub block_ids: Vec<u64>,
    /// Copy launches ([`copy_plan`]): the source's block id at each position of `block_ids`
    /// (empty otherwise).
    pub src_block_ids: Vec<u64>,
    /// Position of `block_ids[0]`.
    pub start: u64,
    /// Tokens of the request; later tokens are not checksummed.
    pub num_tokens: u64,
    /// Distinct replica keys, ascending; the output holds `block_ids.len() * keys.len()` values.
    pub keys: Vec<ReplicaKey>,
    /// Tiles of one block over all layers.
    pub tiles_per_group: u32,
    /// Tiles in the launch: `block_ids.len() * tiles_per_group`.
    pub total_tiles: u32,
}

/// Why a layer cannot be checksummed by the CUDA kernel; `layer` is the layer's spec name
/// (`"(group)"` for a count over the whole group).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A count above the kernel's 32-bit counters (`what`: blocks, tiles, tiles per block,
    /// or a stride or size of the layer).
    #[error("layer {layer}: {what} = {value} exceeds the kernel's 32-bit range")]
    Range {
        /// The layer.
        layer: String,
        /// What is counted.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// A cell whose bytes are not whole 8-byte pieces.
    #[error("layer {layer}: cell of {cell_bytes} bytes is not whole 8-byte pieces")]
    Cell {
        /// The layer.
        layer: String,
        /// Bytes of one cell.
        cell_bytes: u64,
    },
    /// The array is longer than the memory given for it.
    #[error("layer {layer}: array spans {spans} bytes but only {given} are given")]
    Short {
        /// The layer.
        layer: String,
        /// Bytes the array spans.
        spans: u64,
        /// Bytes given.
        given: u64,
    },
    /// A dimension of size 0.
    #[error("layer {0}: zero-sized dimension")]
    ZeroDim(String),
    /// D × element bytes overflows u64.
    #[error("layer {0}: D * elem overflows")]
    RowOverflow(String),
    /// A block id at or past the layer's block count.
    #[error("layer {layer}: block id {id} outside its {blocks} blocks")]
    BlockOutOfRange {
        /// The layer.
        layer: String,
        /// The block id.
        id: u64,
        /// Blocks in the layer.
        blocks: u64,
    },
    /// The layer's last head index does not fit in u32.
    #[error("layer {0}: head index past u32")]
    HeadIndex(String),
    /// A copy launch's source cannot be copied chunk for chunk into the layer: `what` of the
    /// two differs (a dimension, a stride inside a block, the layer or head numbers, the
    /// load path), or the layer is read byte by byte (the copy needs the vector paths), or
    /// the sources and block lists do not pair up with the layers and blocks.
    #[error("layer {layer}: its source differs in {what}")]
    Source {
        /// The layer.
        layer: String,
        /// What differs.
        what: &'static str,
    },
}

fn to_u32(what: &'static str, layer: &str, v: u64) -> Result<u32, PlanError> {
    u32::try_from(v).map_err(|_| PlanError::Range {
        layer: layer.to_string(),
        what,
        value: v,
    })
}

/// Builds the view of one layer whose array starts at device address `addr` and spans
/// `len` bytes. Errors when the cell is not whole pieces, the array does not fit in
/// `len`, or a size exceeds the kernel's 32-bit counters.
pub fn layer_view(spec: &LayerSpec, addr: u64, len: u64) -> Result<LayerView, PlanError> {
    let g = &spec.geometry;
    let name = spec.name.as_str();
    let pieces = g.pieces_per_cell().ok_or_else(|| PlanError::Cell {
        layer: name.to_string(),
        cell_bytes: g.cell_bytes(),
    })?;
    if g.byte_len() > len {
        return Err(PlanError::Short {
            layer: name.to_string(),
            spans: g.byte_len(),
            given: len,
        });
    }
    if g.kernel_blocks_per_block == 0
        || g.tokens_per_kernel_block == 0
        || g.heads == 0
        || g.head_dim == 0
    {
        return Err(PlanError::ZeroDim(name.to_string()));
    }
    let e = g.elem.get();
    let parts = g.parts();
    let heads = g.heads;
    let tokens = g.tokens_per_kernel_block;
    let d = g.head_dim;
    let row_bytes = d
        .checked_mul(e)
        .ok_or_else(|| PlanError::RowOverflow(name.to_string()))?;
    let (s_block, s_part, s_tok, s_head, s_d) = (
        g.stride_of(Dim::B),
        g.stride_of(Dim::Kv),
        g.stride_of(Dim::N),
        g.stride_of(Dim::H),
        g.stride_of(Dim::D),
    );
    // Rows are (token, head) pairs; the one with the smaller stride goes inner so a warp's
    // chunks are adjacent in memory.
    let outer_is_token = heads > 1 && s_head <= s_tok;
    let (n_outer, n_inner, s_outer, s_inner) = if outer_is_token {
        (tokens, heads, s_tok, s_head)
    } else {
        (heads, tokens, s_head, s_tok)
    };
    let contiguous_d = d == 1 || s_d == e;
    let aligned = |a: u64| {
        addr.is_multiple_of(a)
            && s_block % a == 0
            && (parts == 1 || s_part % a == 0)
            && (tokens == 1 || s_tok % a == 0)
            && (heads == 1 || s_head % a == 0)
    };
    let mode = if contiguous_d && row_bytes % 16 == 0 && aligned(16) {
        MODE_VEC16
    } else if contiguous_d && row_bytes % 8 == 0 && aligned(8) {
        MODE_VEC8
    } else {
        MODE_GENERIC
    };
    let kbpb = g.kernel_blocks_per_block;
    let tiles_per_block = if mode == MODE_GENERIC {
        kbpb
    } else {
        kbpb * parts
    };
    // The generic path counts (row, piece) pairs of a kernel block in 32 bits.
    to_u32(
        "tokens * heads * pieces",
        name,
        tokens.saturating_mul(heads).saturating_mul(pieces),
    )?;
    Ok(LayerView {
        base: addr,
        s_block,
        s_part,
        s_outer,
        s_inner,
        s_d,
        m_base: head_factor(spec.layer, spec.head_offset),
        pieces,
        n_outer: to_u32("rows", name, n_outer)?,
        n_inner: to_u32("rows", name, n_inner)?,
        outer_is_token: outer_is_token as u32,
        d: to_u32("D", name, d)?,
        elem: e as u32,
        parts: parts as u32,
        tokens: to_u32("N", name, tokens)?,
        kb_per_block: to_u32("kernel blocks per block", name, kbpb)?,
        mode,
        tiles_per_block: to_u32("tiles per block", name, tiles_per_block)?,
        tile_begin: 0,
        slot: 0,
        regular: regular(mode, row_bytes, n_inner),
        pad: 0,
        src_base: 0,
        src_s_block: 0,
        src_s_part: 0,
        // row_bytes fits because d and e do and D*e was checked above
    })
    .and_then(|v| {
        to_u32("D * elem", name, row_bytes)?;
        Ok(v)
    })
}

/// The regular-path code of a layer (see [`LayerView::regular`]).
fn regular(mode: u32, row_bytes: u64, n_inner: u64) -> u32 {
    let v = match mode {
        MODE_VEC16 => 16,
        MODE_VEC8 => 8,
        _ => return 0,
    };
    let r = row_bytes / v;
    let t = THREADS as u64;
    if r.is_power_of_two() && r <= t && n_inner.is_power_of_two() && (t / r).is_multiple_of(n_inner)
    {
        1 | (r.trailing_zeros() << 8) | (n_inner.trailing_zeros() << 16)
    } else {
        0
    }
}

/// Builds a group's launch from its layers `(spec, device address, byte length)` and
/// block list. Errors on any layer [`layer_view`] refuses, on a block id outside a
/// layer's array, on a head index past `u32`, and when the tiles exceed `u32`.
pub fn launch_plan(
    layers: &[(&LayerSpec, u64, u64)],
    block_ids: &[u64],
    start: u64,
    num_tokens: u64,
) -> Result<LaunchPlan, PlanError> {
    let mut keys: Vec<ReplicaKey> = layers.iter().map(|(s, _, _)| s.replica).collect();
    keys.sort();
    keys.dedup();
    let nb = block_ids.len() as u64;
    to_u32("blocks", "(group)", nb)?;
    let mut views = Vec::with_capacity(layers.len());
    let mut tiles: u64 = 0;
    let largest = block_ids.iter().copied().max();
    for (spec, addr, len) in layers {
        let mut v = layer_view(spec, *addr, *len)?;
        check_blocks(spec, block_ids, largest)?;
        if spec.head_offset as u64 + spec.geometry.heads - 1 > u32::MAX as u64 {
            return Err(PlanError::HeadIndex(spec.name.clone()));
        }
        v.tile_begin = to_u32("tiles", "(group)", tiles)?;
        v.slot = keys.binary_search(&spec.replica).unwrap_or(0) as u32;
        tiles += v.tiles_per_block as u64;
        views.push(v);
    }
    let tiles_per_group = to_u32("tiles per block", "(group)", tiles)?;
    let total_tiles = to_u32("tiles", "(group)", tiles * nb)?;
    Ok(LaunchPlan {
        views,
        block_ids: block_ids.to_vec(),
        src_block_ids: Vec::new(),
        start,
        num_tokens,
        keys,
        tiles_per_group,
        total_tiles,
    })
}

/// Every id of `block_ids` (the largest: `largest`, found once for all layers) inside the
/// layer's blocks.
fn check_blocks(
    spec: &LayerSpec,
    block_ids: &[u64],
    largest: Option<u64>,
) -> Result<(), PlanError> {
    let blocks = spec.geometry.num_blocks();
    if largest.is_none_or(|m| m < blocks) {
        return Ok(());
    }
    let id = block_ids
        .iter()
        .copied()
        .find(|&b| b >= blocks)
        .unwrap_or(0);
    Err(PlanError::BlockOutOfRange {
        layer: spec.name.clone(),
        id,
        blocks,
    })
}

/// As [`launch_plan`], for a launch that first copies every chunk it checksums from a source
/// array into the layer, then sums the stored values: layer `l`'s chunk of block
/// `block_ids[b]` comes from `sources[l]` (`(spec, device address, byte length)`: the source
/// array as this process reaches it) at block `src_block_ids[b]`, at the same offset within
/// the block. Only tokens before `num_tokens` are copied, the bytes the checksum covers.
///
/// The source must have the layer's layout in every respect but its block count (so also
/// its `B` and `KV` strides): the same layer and head numbers, dimensions, element size,
/// strides within a block and load path (alignment included); layers read byte by byte are
/// refused. Errors: what [`launch_plan`] refuses for the layers and for the sources (a
/// source's block id past its blocks included), and [`PlanError::Source`].
pub fn copy_plan(
    layers: &[(&LayerSpec, u64, u64)],
    sources: &[(&LayerSpec, u64, u64)],
    block_ids: &[u64],
    src_block_ids: &[u64],
    start: u64,
    num_tokens: u64,
) -> Result<LaunchPlan, PlanError> {
    let mut plan = launch_plan(layers, block_ids, start, num_tokens)?;
    let name = |i: usize| {
        layers
            .get(i)
            .map_or("(group)", |l| l.0.name.as_str())
            .to_string()
    };
    if sources.len() != layers.len() || src_block_ids.len() != block_ids.len() {
        return Err(PlanError::Source {
            layer: name(0),
            what: "count (sources per layer, source blocks per block)",
        });
    }
    let largest = src_block_ids.iter().copied().max();
    for (i, (v, (spec, addr, len))) in plan.views.iter_mut().zip(sources).enumerate() {
        let s = layer_view(spec, *addr, *len)?;
        check_blocks(spec, src_block_ids, largest)?;
        let mine = layers[i].0;
        let differs = if v.mode == MODE_GENERIC {
            Some("load path (the layer is read byte by byte)")
        } else if (spec.layer, spec.head_offset) != (mine.layer, mine.head_offset) {
            Some("layer or head numbers")
        } else if s.mode != v.mode || s.regular != v.regular {
            Some("load path")
        } else if (s.s_outer, s.s_inner, s.s_d) != (v.s_outer, v.s_inner, v.s_d) {
            Some("strides within a block")
        } else if (
            s.n_outer,
            s.n_inner,
            s.outer_is_token,
            s.d,
            s.elem,
            s.parts,
            s.tokens,
        ) != (
            v.n_outer,
            v.n_inner,
            v.outer_is_token,
            v.d,
            v.elem,
            v.parts,
            v.tokens,
        ) || (s.kb_per_block, s.pieces, s.m_base) != (v.kb_per_block, v.pieces, v.m_base)
        {
            Some("dimensions")
        } else {
            None
        };
        if let Some(what) = differs {
            return Err(PlanError::Source {
                layer: name(i),
                what,
            });
        }
        v.src_base = s.base;
        v.src_s_block = s.s_block;
        v.src_s_part = s.s_part;
    }
    plan.src_block_ids = src_block_ids.to_vec();
    Ok(plan)
}

#[cfg(test)]
#[path = "view_replay_tests.rs"]
mod replay;
