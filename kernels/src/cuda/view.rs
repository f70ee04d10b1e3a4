//! Host side of one checksum launch (docs/design.md §5): the table of layer views the kernel
//! in `kernels/cuda/checksum.cu` reads, built and checked from a group's layers.
//!
//! Pure (no CUDA): the tests below replay the kernel's index arithmetic on the CPU
//! against `kvferry_checksum::definition`, so the plan is tested on machines without a GPU.

use kvferry_checksum::definition::head_factor;
use kvferry_checksum::group::{LayerSpec, ReplicaKey};
use kvferry_checksum::layout::Dim;

/// One layer as the kernel sees it. Mirrors `struct LayerView` in
/// `kernels/cuda/checksum.cu` field for field (`repr(C)`, 120 bytes).
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
    /// Output slot (index of this layer's replica key in [`GroupPlan::keys`]).
    pub slot: u32,
    /// 0, or `1 | log2(R) << 8 | log2(n_inner) << 16` when rows of `R` chunks and the
    /// inner dimension tile the 256 threads exactly (the kernel's regular path).
    pub regular: u32,
    /// Keeps the size a multiple of 8.
    pub pad: u32,
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
pub struct GroupPlan {
    /// One view per layer, in the job's layer order.
    pub views: Vec<LayerView>,
    /// Logical block ids; `block_ids[b]` sits at position `start + b`.
    pub block_ids: Vec<u64>,
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

/// Why a layer cannot be checksummed by the CUDA kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanError(pub String);

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn to_u32(what: &str, layer: &str, v: u64) -> Result<u32, PlanError> {
    u32::try_from(v).map_err(|_| {
        PlanError(format!(
            "layer {layer}: {what} = {v} exceeds the kernel's 32-bit range"
        ))
    })
}

/// Builds the view of one layer whose array starts at device address `addr` and spans
/// `len` bytes. Errors when the cell is not whole pieces, the array does not fit in
/// `len`, or a size exceeds the kernel's 32-bit counters.
pub fn layer_view(spec: &LayerSpec, addr: u64, len: u64) -> Result<LayerView, PlanError> {
    let g = &spec.geometry;
    let name = spec.name.as_str();
    let pieces = g.pieces_per_cell().ok_or_else(|| {
        PlanError(format!(
            "layer {name}: cell of {} bytes is not whole 8-byte pieces",
            g.cell_bytes()
        ))
    })?;
    if g.byte_len() > len {
        return Err(PlanError(format!(
            "layer {name}: array spans {} bytes but only {len} are given",
            g.byte_len()
        )));
    }
    if g.kernel_blocks_per_block == 0
        || g.tokens_per_kernel_block == 0
        || g.heads == 0
        || g.head_dim == 0
    {
        return Err(PlanError(format!("layer {name}: zero-sized dimension")));
    }
    let e = g.elem.get();
    let parts = g.parts();
    let heads = g.heads;
    let tokens = g.tokens_per_kernel_block;
    let d = g.head_dim;
    let row_bytes = d
        .checked_mul(e)
        .ok_or_else(|| PlanError(format!("layer {name}: D * elem overflows")))?;
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
pub fn group_plan(
    layers: &[(&LayerSpec, u64, u64)],
    block_ids: &[u64],
    start: u64,
    num_tokens: u64,
) -> Result<GroupPlan, PlanError> {
    let mut keys: Vec<ReplicaKey> = layers.iter().map(|(s, _, _)| s.replica).collect();
    keys.sort();
    keys.dedup();
    let nb = block_ids.len() as u64;
    to_u32("blocks", "(group)", nb)?;
    let mut views = Vec::with_capacity(layers.len());
    let mut tiles: u64 = 0;
    for (spec, addr, len) in layers {
        let mut v = layer_view(spec, *addr, *len)?;
        let nblocks = spec.geometry.num_blocks();
        if let Some(&bad) = block_ids.iter().find(|&&b| b >= nblocks) {
            return Err(PlanError(format!(
                "layer {}: block id {bad} outside its {nblocks} blocks",
                spec.name
            )));
        }
        if spec.head_offset as u64 + spec.geometry.heads - 1 > u32::MAX as u64 {
            return Err(PlanError(format!(
                "layer {}: head index past u32",
                spec.name
            )));
        }
        v.tile_begin = to_u32("tiles", "(group)", tiles)?;
        v.slot = keys.binary_search(&spec.replica).unwrap_or(0) as u32;
        tiles += v.tiles_per_block as u64;
        views.push(v);
    }
    let tiles_per_group = to_u32("tiles per block", "(group)", tiles)?;
    let total_tiles = to_u32("tiles", "(group)", tiles * nb)?;
    Ok(GroupPlan {
        views,
        block_ids: block_ids.to_vec(),
        start,
        num_tokens,
        keys,
        tiles_per_group,
        total_tiles,
    })
}

#[cfg(test)]
mod tests {
    //! Replays the kernel (`kernels/cuda/checksum.cu`) thread by thread on the CPU and
    //! compares with the definition's reference, so index arithmetic and the plan are
    //! checked here, without a GPU.
    use super::*;
    use kvferry_checksum::definition::layer_block_checksum_direct;
    use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const THREADS: u32 = 256;
    const UNROLL: usize = 4;

    fn rd(mem: &[u8], base: u64, addr: u64, n: usize) -> u64 {
        let o = (addr - base) as usize;
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(&mem[o..o + n]);
        u64::from_le_bytes(b)
    }

    /// CPU replay of tile_vec<V> for one thread.
    #[allow(clippy::too_many_arguments)]
    fn tile_vec(
        l: &LayerView,
        mem: &[u8],
        base: u64,
        part: u32,
        t0: u64,
        nt: u32,
        v: u32,
        tid: u32,
    ) -> u64 {
        let r = l.d * l.elem / v;
        let p_part = part as u64 * ((l.d * l.elem) >> 3) as u64;
        let n_o = if l.outer_is_token != 0 { nt } else { l.n_outer };
        let n_i = l.n_inner;
        let mut c = tid % r;
        let row = tid / r;
        let mut i = row % n_i;
        let mut o = row / n_i;
        let (sc, srows) = (THREADS % r, THREADS / r);
        let (si, so) = (srows % n_i, srows / n_i);
        let mut acc = 0u64;
        while o < n_o {
            for _ in 0..UNROLL {
                let n = if l.outer_is_token != 0 { o } else { i };
                let h = if l.outer_is_token != 0 { i } else { o };
                let ok = o < n_o && n < nt;
                let addr = base + o as u64 * l.s_outer + i as u64 * l.s_inner + c as u64 * v as u64;
                let j = (t0 + n as u64) * l.pieces + p_part + c as u64 * (v as u64 / 8);
                let m = l.m_base.wrapping_add(2 * h as u64);
                if ok {
                    let x0 = rd(mem, l.base, addr, 8);
                    let s = if v == 16 {
                        let x1 = rd(mem, l.base, addr + 8, 8);
                        x0.wrapping_add(x1)
                            .wrapping_mul(j.wrapping_mul(2).wrapping_add(1))
                            .wrapping_add(x1.wrapping_mul(2))
                    } else {
                        x0.wrapping_mul(j.wrapping_mul(2).wrapping_add(1))
                    };
                    acc = acc.wrapping_add(m.wrapping_mul(s));
                }
                c += sc;
                let mut carry = 0;
                if c >= r {
                    c -= r;
                    carry = 1;
                }
                i += si + carry;
                o += so;
                if i >= n_i {
                    i -= n_i;
                    o += 1;
                }
            }
        }
        acc
    }

    fn tile_generic(l: &LayerView, mem: &[u8], base: u64, t0: u64, nt: u32, tid: u32) -> u64 {
        let p = l.pieces as u32;
        let part_bytes = l.d * l.elem;
        let n_o = if l.outer_is_token != 0 { nt } else { l.n_outer };
        let total = n_o * l.n_inner * p;
        let mut acc = 0u64;
        let mut q = tid;
        while q < total {
            let (row, pc) = (q / p, q % p);
            let (o, i) = (row / l.n_inner, row % l.n_inner);
            let n = if l.outer_is_token != 0 { o } else { i };
            let h = if l.outer_is_token != 0 { i } else { o };
            if n < nt {
                let rb = base + o as u64 * l.s_outer + i as u64 * l.s_inner;
                let mut x = 0u64;
                for b in 0..8u32 {
                    let off = pc * 8 + b;
                    let part = off / part_bytes;
                    let rem = off - part * part_bytes;
                    let d = rem / l.elem;
                    let eb = rem - d * l.elem;
                    let a = rb + part as u64 * l.s_part + d as u64 * l.s_d + eb as u64;
                    x |= rd(mem, l.base, a, 1) << (8 * b);
                }
                let jj = (t0 + n as u64) * l.pieces + pc as u64;
                acc = acc.wrapping_add(
                    l.m_base
                        .wrapping_add(2 * h as u64)
                        .wrapping_mul(x.wrapping_mul(jj.wrapping_mul(2).wrapping_add(1))),
                );
            }
            q += THREADS;
        }
        acc
    }

    /// CPU replay of tile_regular for one thread.
    #[allow(clippy::too_many_arguments)]
    fn tile_regular(
        l: &LayerView,
        mem: &[u8],
        base: u64,
        part: u32,
        t0: u64,
        nt: u32,
        v: u32,
        tid: u32,
    ) -> u64 {
        let rs = (l.regular >> 8) & 0xff;
        let nis = (l.regular >> 16) & 0xff;
        let c = tid & ((1 << rs) - 1);
        let row = tid >> rs;
        let i = row & ((1 << nis) - 1);
        let mut o = row >> nis;
        let so = (THREADS >> rs) >> nis;
        // The kernel would never advance: the plan must not mark such a layer regular.
        assert!(
            so > 0,
            "regular layer whose rows x inner groups exceed the block: {l:?}"
        );
        let ot = l.outer_is_token != 0;
        let n_o = if ot { nt } else { l.n_outer };
        if !ot && i >= nt {
            return 0;
        }
        let (mut su, mut sw, mut sx, mut sy) = (0u64, 0u64, 0u64, 0u64);
        while o < n_o {
            let a = base + o as u64 * l.s_outer + i as u64 * l.s_inner + c as u64 * v as u64;
            let x0 = rd(mem, l.base, a, 8);
            let x1 = if v == 16 {
                rd(mem, l.base, a + 8, 8)
            } else {
                0
            };
            let y = x0.wrapping_add(x1);
            su = su.wrapping_add(y);
            sw = sw.wrapping_add((o as u64).wrapping_mul(y));
            sx = sx.wrapping_add(x1);
            sy = sy.wrapping_add((o as u64).wrapping_mul(x1));
            o += so;
        }
        let p = l.pieces;
        let q = part as u64 * ((l.d * l.elem) >> 3) as u64 + c as u64 * (v as u64 / 8);
        if ot {
            let m = l.m_base.wrapping_add(2 * i as u64);
            let k = (2u64.wrapping_mul(t0).wrapping_mul(p)).wrapping_add(2 * q + 1);
            m.wrapping_mul(
                k.wrapping_mul(su)
                    .wrapping_add(2u64.wrapping_mul(p).wrapping_mul(sw))
                    .wrapping_add(sx.wrapping_mul(2)),
            )
        } else {
            let j = 2u64
                .wrapping_mul(t0 + i as u64)
                .wrapping_mul(p)
                .wrapping_add(2 * q + 1);
            l.m_base
                .wrapping_mul(j.wrapping_mul(su).wrapping_add(sx.wrapping_mul(2)))
                .wrapping_add(
                    2u64.wrapping_mul(j.wrapping_mul(sw).wrapping_add(sy.wrapping_mul(2))),
                )
        }
    }

    /// CPU replay of kvf_checksum over all tiles; `mems[l]` backs layer l.
    fn replay(plan: &GroupPlan, mems: &[&[u8]]) -> Vec<u64> {
        let ns = plan.keys.len();
        let mut out = vec![0u64; plan.block_ids.len() * ns];
        for tile in 0..plan.total_tiles {
            let bidx = tile / plan.tiles_per_group;
            let r = tile % plan.tiles_per_group;
            let li = plan.views.iter().rposition(|v| v.tile_begin <= r).unwrap();
            let l = &plan.views[li];
            let local = r - l.tile_begin;
            let (kk, part) = if l.mode == MODE_GENERIC {
                (local, 0)
            } else {
                (local / l.parts, local % l.parts)
            };
            let bs = l.kb_per_block as u64 * l.tokens as u64;
            let t0 = (plan.start + bidx as u64) * bs + kk as u64 * l.tokens as u64;
            if t0 >= plan.num_tokens {
                continue;
            }
            let nt = (plan.num_tokens - t0).min(l.tokens as u64) as u32;
            let kb = plan.block_ids[bidx as usize] * l.kb_per_block as u64 + kk as u64;
            let base = l.base + kb * l.s_block + part as u64 * l.s_part;
            let mut sum = 0u64;
            for tid in 0..THREADS {
                let a = match l.mode {
                    MODE_VEC16 if l.regular != 0 => {
                        tile_regular(l, mems[li], base, part, t0, nt, 16, tid)
                    }
                    MODE_VEC8 if l.regular != 0 => {
                        tile_regular(l, mems[li], base, part, t0, nt, 8, tid)
                    }
                    MODE_VEC16 => tile_vec(l, mems[li], base, part, t0, nt, 16, tid),
                    MODE_VEC8 => tile_vec(l, mems[li], base, part, t0, nt, 8, tid),
                    _ => tile_generic(l, mems[li], base, t0, nt, tid),
                };
                sum = sum.wrapping_add(a);
            }
            let o = bidx as usize * ns + l.slot as usize;
            out[o] = out[o].wrapping_add(sum);
        }
        out
    }

    const LAYOUTS: [&str; 7] = [
        "KV B N H D",
        "B KV N H D",
        "B KV H N D",
        "B H N KV D",
        "B N D",
        "B N H D",
        "H B N KV D",
    ];

    fn random_spec(rng: &mut ChaCha8Rng, layer: u32, replica: ReplicaKey) -> LayerSpec {
        loop {
            let layout = Layout::parse(LAYOUTS[rng.random_range(0..LAYOUTS.len())]).unwrap();
            let elem = [
                ElemBytes::One,
                ElemBytes::Two,
                ElemBytes::Four,
                ElemBytes::Eight,
            ][rng.random_range(0..4)];
            // Mostly small; sometimes rows of 64+ chunks with 4-8 inner rows, where one
            // pass of the 256 threads does not cover whole inner groups.
            let big = rng.random_bool(0.15);
            let d = if big {
                [128u64, 256][rng.random_range(0..2)]
            } else {
                [1u64, 2, 3, 4, 8, 16, 24, 64][rng.random_range(0..8)]
            };
            let h = if !layout.has_heads() {
                1
            } else if big {
                [4u64, 8][rng.random_range(0..2)]
            } else {
                rng.random_range(1..4)
            };
            let n = if big {
                [4u64, 8, 16][rng.random_range(0..3)]
            } else {
                rng.random_range(1..6)
            };
            let kbpb = rng.random_range(1..4);
            let b = kbpb * rng.random_range(1..5);
            let g = Geometry::contiguous(layout, b, n, h, d, elem, kbpb).unwrap();
            if g.pieces_per_cell().is_none() {
                continue;
            }
            // Sometimes pad the strides: the outermost stays, others grow by a multiple of 8 (or 1).
            let g = if rng.random_bool(0.4) {
                let pad = [1u64, 8, 16][rng.random_range(0..3)];
                let dims = g.layout.dims().to_vec();
                let mut strides = vec![0u64; dims.len()];
                let mut span = elem as u64;
                for k in (0..dims.len()).rev() {
                    strides[k] = span
                        + if k + 1 == dims.len() {
                            0
                        } else {
                            pad * rng.random_range(0..2)
                        };
                    span = strides[k] * g.size_of(dims[k]);
                }
                match g.clone().with_strides(strides) {
                    Ok(g2) => g2,
                    Err(_) => g,
                }
            } else {
                g
            };
            return LayerSpec {
                name: format!("model.layers.{layer}.self_attn.attn"),
                layer,
                head_offset: rng.random_range(0..100),
                geometry: g,
                kind: None,
                dtype: None,
                replica,
            };
        }
    }

    #[test]
    fn replayed_kernel_matches_definition() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut modes = [0usize; 3];
        let mut regular = 0usize;
        let mut regular_head_outer = 0usize;
        for case in 0..300 {
            let nl = rng.random_range(1..4);
            let rk = if rng.random_bool(0.3) {
                ReplicaKey {
                    replicas: 2,
                    index: 1,
                }
            } else {
                ReplicaKey::NONE
            };
            let specs: Vec<LayerSpec> = (0..nl)
                .map(|l| {
                    random_spec(
                        &mut rng,
                        l as u32 * 3 + 1,
                        if l == 0 { ReplicaKey::NONE } else { rk },
                    )
                })
                .collect();
            // Base addresses: 16-aligned, or shifted by 8 to force the 8-byte / generic paths.
            let shift = [0u64, 8, 1][rng.random_range(0..3)];
            let mems: Vec<Vec<u8>> = specs
                .iter()
                .map(|s| {
                    (0..s.geometry.byte_len())
                        .map(|_| rng.random::<u8>())
                        .collect()
                })
                .collect();
            let bases: Vec<u64> = (0..nl as u64)
                .map(|l| (l + 1) * (1 << 40) + shift)
                .collect();
            let nblocks = specs.iter().map(|s| s.geometry.num_blocks()).min().unwrap();
            let count = rng.random_range(0..=nblocks);
            let block_ids: Vec<u64> = (0..count).map(|_| rng.random_range(0..nblocks)).collect();
            let start = rng.random_range(0..3);
            let bs = specs[0].geometry.block_size();
            let num_tokens = ((start + count) * bs).saturating_sub(rng.random_range(0..bs.max(1)));
            let layers: Vec<(&LayerSpec, u64, u64)> = specs
                .iter()
                .zip(&bases)
                .zip(&mems)
                .map(|((s, &b), m)| (s, b, m.len() as u64))
                .collect();
            let plan = group_plan(&layers, &block_ids, start, num_tokens).unwrap();
            for v in &plan.views {
                modes[v.mode as usize] += 1;
                regular += (v.regular != 0) as usize;
                regular_head_outer +=
                    (v.regular != 0 && v.outer_is_token == 0 && v.n_outer > 1) as usize;
            }
            let slices: Vec<&[u8]> = mems.iter().map(|m| m.as_slice()).collect();
            let got = replay(&plan, &slices);
            let ns = plan.keys.len();
            for (bi, &b) in block_ids.iter().enumerate() {
                for (k, key) in plan.keys.iter().enumerate() {
                    let mut want = 0u64;
                    for (s, m) in specs.iter().zip(&mems) {
                        if s.replica == *key {
                            want = want.wrapping_add(layer_block_checksum_direct(
                                s,
                                m,
                                b,
                                start + bi as u64,
                                num_tokens,
                            ));
                        }
                    }
                    assert_eq!(
                        got[bi * ns + k],
                        want,
                        "case {case} block {bi} key {key:?} views {:?}",
                        plan.views
                    );
                }
            }
        }
        // Every load path was exercised.
        assert!(modes.iter().all(|&m| m > 10), "modes {modes:?}");
        assert!(
            regular > 10 && regular_head_outer > 5,
            "regular {regular}, with heads outer {regular_head_outer}"
        );
    }

    #[test]
    fn refuses_bad_blocks_and_short_arrays() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let s = random_spec(&mut rng, 0, ReplicaKey::NONE);
        let len = s.geometry.byte_len();
        let nb = s.geometry.num_blocks();
        assert!(group_plan(&[(&s, 0, len)], &[nb], 0, 100).is_err());
        assert!(group_plan(&[(&s, 0, len - 1)], &[0], 0, 100).is_err());
        assert!(group_plan(&[(&s, 0, len)], &[nb - 1], 0, 100).is_ok());
    }

    #[test]
    fn view_is_120_bytes() {
        assert_eq!(std::mem::size_of::<LayerView>(), 120);
    }
}
