//! The checksum definition of DESIGN.md §2.1 (from the seed, "What a checksum is").
//!
//! A slice (one layer, one KV head, the tokens of one block) has checksum
//! `s = Σ_j x_j·(2j+1) mod 2^64`, x_j the little-endian 8-byte piece `p` of the cell of
//! request token `t`, `j = t·P + p`. A block's value is `c = Σ m·s`, `m = 2(layer·H + head) + 1`.
//!
//! The fast form used everywhere is `Σ x_j(2j+1) = (2j₀+1)·Σx + 2·Σ i·x` (i relative to the
//! first piece), with `Σ i·x` obtained from running sums of running sums: only additions in
//! the per-piece loop, which vectorizes. The direct form is kept as the reference for tests.

use crate::group::LayerSpec;
use crate::layout::{Dim, Geometry};

/// `H` of §2.1: a fixed bound on any layer's KV heads, so that head factors do not depend
/// on the model's head counts or its TP split.
pub const MAX_KV_HEADS_PER_LAYER: u64 = 65536;

/// The odd head factor `m = 2·(layer·H + head) + 1 mod 2^64` of §2.1 (`head` is the global KV head).
pub fn head_factor(layer: u32, head: u32) -> u64 {
    (layer as u64 * MAX_KV_HEADS_PER_LAYER + head as u64)
        .wrapping_mul(2)
        .wrapping_add(1)
}

const LANES: usize = 8;

/// Slice checksum `Σ_i x_i·(2(j₀+i)+1) mod 2^64` of consecutive `pieces` whose first has
/// index `j₀ = first_piece_index` (fast additive form, §2.1).
pub fn slice_checksum(pieces: &[u64], first_piece_index: u64) -> u64 {
    // Lane l holds pieces i = k·LANES + l; Σ_k k·x over a lane is K·A_l − Q_l, where A_l is the
    // lane's sum and Q_l the sum of its running sums.
    let mut acc = [0u64; LANES];
    let mut tot = [0u64; LANES];
    let chunks = pieces.chunks_exact(LANES);
    let rest = chunks.remainder();
    let k = chunks.len() as u64;
    for c in chunks {
        for l in 0..LANES {
            acc[l] = acc[l].wrapping_add(c[l]);
            tot[l] = tot[l].wrapping_add(acc[l]);
        }
    }
    let mut sum = 0u64;
    let mut weighted = 0u64; // Σ i·x_i, i relative
    for l in 0..LANES {
        sum = sum.wrapping_add(acc[l]);
        let lane_k = k.wrapping_mul(acc[l]).wrapping_sub(tot[l]);
        weighted = weighted
            .wrapping_add(lane_k.wrapping_mul(LANES as u64))
            .wrapping_add((l as u64).wrapping_mul(acc[l]));
    }
    let base = k * LANES as u64;
    for (i, &x) in rest.iter().enumerate() {
        sum = sum.wrapping_add(x);
        weighted = weighted.wrapping_add((base + i as u64).wrapping_mul(x));
    }
    first_piece_index
        .wrapping_mul(2)
        .wrapping_add(1)
        .wrapping_mul(sum)
        .wrapping_add(weighted.wrapping_mul(2))
}

/// Slice checksum by the direct form `Σ x_j·(2j+1)` (reference for tests).
pub fn slice_checksum_direct(pieces: &[u64], first_piece_index: u64) -> u64 {
    pieces.iter().enumerate().fold(0u64, |s, (i, &x)| {
        let j = first_piece_index.wrapping_add(i as u64);
        s.wrapping_add(x.wrapping_mul(j.wrapping_mul(2).wrapping_add(1)))
    })
}

/// Tokens of block `position` (block size `bs`) that lie before `num_tokens`.
fn tokens_in_block(position: u64, bs: u64, num_tokens: u64) -> u64 {
    num_tokens
        .saturating_sub(position.saturating_mul(bs))
        .min(bs)
}

/// Whether `layer_block_checksum` can read logical block `block_id` of a `len`-byte array
/// with this geometry: the cell is whole pieces, the block exists and the array fits in `len`.
pub fn can_read(geometry: &Geometry, len: u64, block_id: u64) -> bool {
    geometry.pieces_per_cell().is_some()
        && block_id < geometry.num_blocks()
        && geometry.byte_len() <= len
}

/// This layer's contribution `Σ_{heads} m·s` (mod 2^64) to the block at `position`, reading
/// logical block `block_id` of `bytes` (the layer's whole array, laid out by
/// `layer.geometry`), over request tokens `< num_tokens` only (§2.1, fast form).
///
/// Returns 0 when the block holds no token before `num_tokens`. Panics unless
/// [`can_read`]`(geometry, bytes.len(), block_id)` holds (callers check it first).
pub fn layer_block_checksum(
    layer: &LayerSpec,
    bytes: &[u8],
    block_id: u64,
    position: u64,
    num_tokens: u64,
) -> u64 {
    let g = &layer.geometry;
    assert!(
        can_read(g, bytes.len() as u64, block_id),
        "layer {} cannot read block {block_id}",
        layer.name
    );
    let bs = g.block_size();
    let n = tokens_in_block(position, bs, num_tokens);
    if n == 0 {
        return 0;
    }
    let p = g.pieces_per_cell().unwrap_or(0);
    let row_bytes = g.head_dim * g.elem.get();
    let heads = g.heads;
    let kb0 = block_id * g.kernel_blocks_per_block;
    let nk = g.tokens_per_kernel_block;
    let parts = g.parts();
    let mut acc = vec![0u64; (heads * p) as usize];
    let mut tot = vec![0u64; (heads * p) as usize];
    let contiguous_rows =
        row_bytes % 8 == 0 && (g.head_dim == 1 || g.stride_of(Dim::D) == g.elem.get());
    if contiguous_rows {
        // Column sums C[part, head, q] (q = 0..Q pieces of a part's row) and, per (part, head),
        // running sums of the token row sums R_t: Σ_t x·(2j+1) = Σ_q (2(t0·P + part·Q + q)+1)·C
        // + 2P·Σ_t t·R_t. One add per piece into C and one into a register row sum.
        let q = row_bytes / 8;
        let merged = heads == 1 || g.stride_of(Dim::H) == row_bytes;
        let (row_groups, heads_per_row) = if merged { (1, heads) } else { (heads, 1) };
        let mut colsum = vec![0u64; (parts * heads * q) as usize];
        let mut ra = vec![0u64; (parts * heads) as usize];
        let mut rs = vec![0u64; (parts * heads) as usize];
        let mut offsets = vec![0usize; n as usize];
        for k in 0..parts {
            for hg in 0..row_groups {
                let stride_n = g.stride_of(Dim::N) as usize;
                for (i, kb_offsets) in offsets.chunks_mut(nk as usize).enumerate() {
                    let base = g.byte_offset(k, kb0 + i as u64, 0, hg, 0) as usize;
                    for (tt, off) in kb_offsets.iter_mut().enumerate() {
                        *off = base + tt * stride_n;
                    }
                }
                let h0 = (k * heads + hg) as usize;
                let hn = heads_per_row as usize;
                rows(
                    bytes,
                    &offsets,
                    q as usize,
                    &mut colsum[h0 * q as usize..(h0 + hn) * q as usize],
                    &mut ra[h0..h0 + hn],
                    &mut rs[h0..h0 + hn],
                );
            }
        }
        let t0 = position * bs;
        let two_p = p.wrapping_mul(2);
        let mut c = 0u64;
        for h in 0..heads {
            let mut s = 0u64;
            for k in 0..parts {
                let kh = (k * heads + h) as usize;
                for qq in 0..q {
                    let piece = k * q + qq;
                    let w = t0
                        .wrapping_mul(p)
                        .wrapping_add(piece)
                        .wrapping_mul(2)
                        .wrapping_add(1);
                    s = s.wrapping_add(w.wrapping_mul(colsum[kh * q as usize + qq as usize]));
                }
                let weighted = n.wrapping_mul(ra[kh]).wrapping_sub(rs[kh]); // Σ_t t·R_t
                s = s.wrapping_add(two_p.wrapping_mul(weighted));
            }
            let head = layer.head_offset.wrapping_add(h as u32);
            c = c.wrapping_add(head_factor(layer.layer, head).wrapping_mul(s));
        }
        c
    } else {
        // Pieces may straddle elements of K and V or D may be strided: gather each cell.
        let elem = g.elem.get() as usize;
        let mut cell = vec![0u8; g.cell_bytes() as usize];
        for t in 0..n {
            let (kb, tt) = (kb0 + t / nk, t % nk);
            for h in 0..heads {
                for k in 0..parts {
                    for d in 0..g.head_dim {
                        let off = g.byte_offset(k, kb, tt, h, d) as usize;
                        let at = ((k * g.head_dim + d) as usize) * elem;
                        cell[at..at + elem].copy_from_slice(&bytes[off..off + elem]);
                    }
                }
                let base = (h * p) as usize;
                accumulate(
                    &cell,
                    &mut acc[base..base + p as usize],
                    &mut tot[base..base + p as usize],
                );
            }
        }
        combine(
            layer,
            position * bs,
            n,
            p,
            |h, piece| (h * p + piece) as usize,
            &acc,
            &tot,
        )
    }
}

/// For rows starting at `offsets` (one per token, in token order) that hold `ra.len()` heads of
/// `q` pieces each: adds each piece into its column sum `colsum[head·q + i]`; per head, adds the
/// row's sum R_t into `ra` and `ra` into `rs` (so `n·ra − rs = Σ_t t·R_t`). The inner loop is
/// loads and adds over 8 lanes, which vectorizes.
#[inline(always)]
fn rows(
    bytes: &[u8],
    offsets: &[usize],
    q: usize,
    colsum: &mut [u64],
    ra: &mut [u64],
    rs: &mut [u64],
) {
    if q % 8 == 0 {
        rows_by_chunks(bytes, offsets, q / 8, colsum, ra, rs);
        return;
    }
    for &off in offsets {
        for (h, (c, (a, s))) in colsum
            .chunks_exact_mut(q)
            .zip(ra.iter_mut().zip(rs.iter_mut()))
            .enumerate()
        {
            let row = &bytes[off + h * q * 8..off + (h + 1) * q * 8];
            let mut r = [0u64; 8];
            let whole = q / 8 * 8;
            let (c_main, c_rest) = c.split_at_mut(whole);
            for (x, cc) in row[..whole * 8]
                .chunks_exact(64)
                .zip(c_main.chunks_exact_mut(8))
            {
                for l in 0..8 {
                    let v = u64::from_le_bytes(x[l * 8..l * 8 + 8].try_into().expect("8 bytes"));
                    cc[l] = cc[l].wrapping_add(v);
                    r[l] = r[l].wrapping_add(v);
                }
            }
            let mut sum = r.iter().fold(0u64, |a, b| a.wrapping_add(*b));
            for (x, cc) in row[whole * 8..].chunks_exact(8).zip(c_rest.iter_mut()) {
                let v = u64::from_le_bytes(x.try_into().expect("8 bytes"));
                *cc = cc.wrapping_add(v);
                sum = sum.wrapping_add(v);
            }
            *a = a.wrapping_add(sum);
            *s = s.wrapping_add(*a);
        }
    }
}

/// Sum of 8 lanes as a tree (vectorizes).
#[inline(always)]
fn fold8(r: &[u64; 8]) -> u64 {
    let a: [u64; 4] = std::array::from_fn(|i| r[i].wrapping_add(r[i + 4]));
    let b: [u64; 2] = std::array::from_fn(|i| a[i].wrapping_add(a[i + 2]));
    b[0].wrapping_add(b[1])
}

/// Bytes of rows taken per tile: a tile is read from memory once (row sums) and then from L1
/// (column sums).
const TILE_BYTES: usize = 16 << 10;

/// [`rows`] when a head's row is whole 8-piece chunks (the hot loop of the CPU backend). Rows
/// are taken a tile at a time, in two passes with only loads and adds: first each row in memory
/// order with its head sums in registers (as fast as a plain read, and it brings the tile into
/// L1), then the column sums, 8 columns at a time in registers, from L1.
#[inline(always)]
fn rows_by_chunks(
    bytes: &[u8],
    offsets: &[usize],
    chunks_per_head: usize,
    colsum: &mut [u64],
    ra: &mut [u64],
    rs: &mut [u64],
) {
    let len = colsum.len() * 8;
    let tile = (TILE_BYTES / len.max(1)).max(1);
    for tile_offsets in offsets.chunks(tile) {
        let first = tile_offsets[0];
        let contiguous = tile_offsets
            .iter()
            .enumerate()
            .all(|(i, &o)| o == first + i * len);
        if contiguous {
            // Rows back to back (token-major within a kernel block): one flat pass over the tile,
            // each head's sum folded every `chunks_per_head` chunks.
            let region = &bytes[first..first + tile_offsets.len() * len];
            let heads = ra.len();
            let mut r = [0u64; 8];
            let (mut h, mut k) = (0usize, 0usize);
            for x in region.chunks_exact(64) {
                for l in 0..8 {
                    r[l] = r[l].wrapping_add(u64::from_le_bytes(
                        x[l * 8..l * 8 + 8].try_into().expect("8 bytes"),
                    ));
                }
                k += 1;
                if k == chunks_per_head {
                    ra[h] = ra[h].wrapping_add(fold8(&r));
                    rs[h] = rs[h].wrapping_add(ra[h]);
                    r = [0u64; 8];
                    k = 0;
                    h += 1;
                    if h == heads {
                        h = 0;
                    }
                }
            }
        } else {
            for &off in tile_offsets {
                let row = &bytes[off..off + len];
                for ((head, a), s) in row
                    .chunks_exact(chunks_per_head * 64)
                    .zip(ra.iter_mut())
                    .zip(rs.iter_mut())
                {
                    let mut r = [0u64; 8];
                    for x in head.chunks_exact(64) {
                        for l in 0..8 {
                            r[l] = r[l].wrapping_add(u64::from_le_bytes(
                                x[l * 8..l * 8 + 8].try_into().expect("8 bytes"),
                            ));
                        }
                    }
                    *a = a.wrapping_add(fold8(&r));
                    *s = s.wrapping_add(*a);
                }
            }
        }
        for (ci, cc) in colsum.chunks_exact_mut(8).enumerate() {
            let mut c = [0u64; 8];
            for &off in tile_offsets {
                let x = &bytes[off + ci * 64..off + ci * 64 + 64];
                for l in 0..8 {
                    c[l] = c[l].wrapping_add(u64::from_le_bytes(
                        x[l * 8..l * 8 + 8].try_into().expect("8 bytes"),
                    ));
                }
            }
            for l in 0..8 {
                cc[l] = cc[l].wrapping_add(c[l]);
            }
        }
    }
}

/// Adds one token's row of pieces into per-column sums `acc` and sums of running sums `tot`.
#[inline(always)]
fn accumulate(row: &[u8], acc: &mut [u64], tot: &mut [u64]) {
    debug_assert_eq!(row.len(), acc.len() * 8);
    for ((c, a), s) in row.chunks_exact(8).zip(acc.iter_mut()).zip(tot.iter_mut()) {
        *a = a.wrapping_add(u64::from_le_bytes([
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7],
        ]));
        *s = s.wrapping_add(*a);
    }
}

/// Folds per-column sums into `Σ_h m_h·s_h`. For column (head h, piece p) over the block's `n`
/// tokens starting at request token `t0`: `Σ_t x_t(2((t0+t)P+p)+1) = (2(t0·P+p)+1+2Pn)·A − 2P·Q`,
/// since `Σ_t t·x_t = n·A − Q` (A the column sum, Q the sum of its running sums).
fn combine(
    layer: &LayerSpec,
    t0: u64,
    n: u64,
    p: u64,
    index: impl Fn(u64, u64) -> usize,
    acc: &[u64],
    tot: &[u64],
) -> u64 {
    let mut c = 0u64;
    let two_p = p.wrapping_mul(2);
    for h in 0..layer.geometry.heads {
        let mut s = 0u64;
        for piece in 0..p {
            let i = index(h, piece);
            let w = t0
                .wrapping_mul(p)
                .wrapping_add(piece)
                .wrapping_mul(2)
                .wrapping_add(1)
                .wrapping_add(two_p.wrapping_mul(n));
            s = s
                .wrapping_add(w.wrapping_mul(acc[i]))
                .wrapping_sub(two_p.wrapping_mul(tot[i]));
        }
        let head = layer.head_offset.wrapping_add(h as u32);
        c = c.wrapping_add(head_factor(layer.layer, head).wrapping_mul(s));
    }
    c
}

/// The same value as [`layer_block_checksum`] by the direct form: each cell gathered element
/// by element, each piece weighted by `2j+1` (reference for tests; slow).
pub fn layer_block_checksum_direct(
    layer: &LayerSpec,
    bytes: &[u8],
    block_id: u64,
    position: u64,
    num_tokens: u64,
) -> u64 {
    let g = &layer.geometry;
    assert!(
        can_read(g, bytes.len() as u64, block_id),
        "layer {} cannot read block {block_id}",
        layer.name
    );
    let bs = g.block_size();
    let p = g.pieces_per_cell().unwrap_or(0);
    let elem = g.elem.get() as usize;
    let mut c = 0u64;
    for h in 0..g.heads {
        let mut s = 0u64;
        for t in 0..bs {
            let req_token = position * bs + t;
            if req_token >= num_tokens {
                break;
            }
            let kb = block_id * g.kernel_blocks_per_block + t / g.tokens_per_kernel_block;
            let tt = t % g.tokens_per_kernel_block;
            let mut cell = Vec::with_capacity(g.cell_bytes() as usize);
            for k in 0..g.parts() {
                for d in 0..g.head_dim {
                    let off = g.byte_offset(k, kb, tt, h, d) as usize;
                    cell.extend_from_slice(&bytes[off..off + elem]);
                }
            }
            for (pi, piece) in cell.chunks(8).enumerate() {
                let x = u64::from_le_bytes(piece.try_into().expect("whole pieces"));
                let j = req_token * p + pi as u64;
                s = s.wrapping_add(x.wrapping_mul(2 * j + 1));
            }
        }
        c = c.wrapping_add(head_factor(layer.layer, layer.head_offset + h as u32).wrapping_mul(s));
    }
    c
}
