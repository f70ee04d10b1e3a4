//! The checksum definition of docs/design.md §2.1 (from the seed, "What a checksum is").
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

/// `H` of §2.1 (defined with the global head numbering it bounds, in `crate::group`).
pub use crate::group::MAX_KV_HEADS_PER_LAYER;

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
    let contiguous_rows =
        row_bytes.is_multiple_of(8) && (g.head_dim == 1 || g.stride_of(Dim::D) == g.elem.get());
    if contiguous_rows {
        // Each (part, head) is a run of n rows of q pieces. Rows are read in memory order, a
        // token's rows of all heads together when they are back to back, each (part, head)'s
        // sums kept per lane (see `Lanes`); one pass over memory.
        let q = row_bytes / 8;
        let merged = heads == 1 || g.stride_of(Dim::H) == row_bytes;
        let rows = RowGroups {
            bytes,
            g,
            kb0,
            n,
            row_bytes: row_bytes as usize,
            heads_per_row: if merged { heads as usize } else { 1 },
        };
        let mut s = vec![0u64; heads as usize];
        match q % 8 {
            0 => rows.slice_sums::<8>(p, position * bs, &mut s),
            4 => rows.slice_sums::<4>(p, position * bs, &mut s),
            2 | 6 => rows.slice_sums::<2>(p, position * bs, &mut s),
            _ => rows.slice_sums::<1>(p, position * bs, &mut s),
        }
        s.iter().enumerate().fold(0u64, |c, (h, &s)| {
            let head = layer.head_offset.wrapping_add(h as u32);
            c.wrapping_add(head_factor(layer.layer, head).wrapping_mul(s))
        })
    } else {
        // Pieces may straddle elements of K and V or D may be strided: gather each cell.
        let mut acc = vec![0u64; (heads * p) as usize];
        let mut tot = vec![0u64; (heads * p) as usize];
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

/// The rows of one block for [`layer_block_checksum`]: tokens `< n` of the block whose first
/// kernel block is `kb0`; each (part, head, token) row is `row_bytes` contiguous bytes of q
/// pieces, and `heads_per_row` heads' rows lie back to back (all heads, or 1).
struct RowGroups<'a> {
    bytes: &'a [u8],
    g: &'a Geometry,
    kb0: u64,
    n: u64,
    row_bytes: usize,
    heads_per_row: usize,
}

impl RowGroups<'_> {
    /// Adds each head's slice checksum part `Σ_t Σ_q x·(2((t0+t)P + kQ + q) + 1)` over both
    /// parts k into `s[head]` (mod 2^64). Requires `row_bytes % (8·L) == 0`.
    ///
    /// Per (part, head), from the lane sums: `A = Σ x`, `B = Σ_t t·R_t` (R_t the row's sum),
    /// `Cq = Σ q·x`; the part adds `(2(t0·P + kQ) + 1)·A + 2P·B + 2·Cq`.
    fn slice_sums<const L: usize>(&self, p: u64, t0: u64, s: &mut [u64]) {
        let g = self.g;
        let nk = g.tokens_per_kernel_block;
        let stride_n = g.stride_of(Dim::N) as usize;
        let q = (self.row_bytes / 8) as u64;
        // Rows of all heads back to back: both parts' rows of a token are read together (two
        // streams); else one (part, head) run at a time.
        let (groups, parts_per_group) = if self.heads_per_row == s.len() {
            (1, g.parts())
        } else {
            (g.parts() * s.len() as u64, 1)
        };
        let per_group = self.heads_per_row * parts_per_group as usize;
        let mut lanes = vec![Lanes::<L>::default(); per_group];
        let mut firsts = [0usize; 2];
        for gi in 0..groups {
            let (k0, h0) = if groups == 1 {
                (0, 0)
            } else {
                (gi / s.len() as u64, (gi % s.len() as u64) as usize)
            };
            lanes.fill(Lanes::default());
            for i in 0..self.n.div_ceil(nk) {
                for (j, f) in firsts.iter_mut().take(parts_per_group as usize).enumerate() {
                    *f = g.byte_offset(k0 + j as u64, self.kb0 + i, 0, h0 as u64, 0) as usize;
                }
                let count = (self.n - i * nk).min(nk) as usize;
                add_rows(
                    &mut lanes,
                    self.bytes,
                    &firsts[..parts_per_group as usize],
                    count,
                    stride_n,
                    self.row_bytes,
                );
            }
            for (j, part_lanes) in lanes.chunks_exact(self.heads_per_row).enumerate() {
                let k = k0 + j as u64;
                let w = t0
                    .wrapping_mul(p)
                    .wrapping_add(k * q)
                    .wrapping_mul(2)
                    .wrapping_add(1);
                for (st, sh) in part_lanes.iter().zip(&mut s[h0..]) {
                    let (a, b, cq) = st.sums(self.n, q);
                    *sh = sh
                        .wrapping_add(w.wrapping_mul(a))
                        .wrapping_add(p.wrapping_mul(2).wrapping_mul(b))
                        .wrapping_add(cq.wrapping_mul(2));
                }
            }
        }
    }
}

/// The hot loop of the CPU backend: for `count` tokens and each group start `f` of `firsts`,
/// the rows of `lanes.len() / firsts.len()` heads back to back at `f + i·stride`; each byte
/// loaded once. Kept out of line and updating the lanes in place: with the sums in locals, or
/// inlined into the caller, LLVM (after the local ThinLTO of a release build) left the loop
/// scalar, 3× slower.
#[inline(never)]
fn add_rows<const L: usize>(
    lanes: &mut [Lanes<L>],
    bytes: &[u8],
    firsts: &[usize],
    count: usize,
    stride: usize,
    row_bytes: usize,
) {
    let per_group = lanes.len() / firsts.len();
    let len = per_group * row_bytes;
    for i in 0..count {
        for (&f, group) in firsts.iter().zip(lanes.chunks_exact_mut(per_group)) {
            let off = f + i * stride;
            for (st, row) in group
                .iter_mut()
                .zip(bytes[off..off + len].chunks_exact(row_bytes))
            {
                for x in row.chunks_exact(8 * L) {
                    for l in 0..L {
                        let v =
                            u64::from_le_bytes(x[l * 8..l * 8 + 8].try_into().expect("8 bytes"));
                        st.r[l] = st.r[l].wrapping_add(v);
                        st.w[l] = st.w[l].wrapping_add(st.r[l]);
                    }
                }
                for l in 0..L {
                    st.rs[l] = st.rs[l].wrapping_add(st.r[l]);
                }
            }
        }
    }
}

/// Per-lane running sums of one (part, head) run of rows (see [`Lanes::sums`]).
#[derive(Clone, Copy)]
struct Lanes<const L: usize> {
    r: [u64; L],
    w: [u64; L],
    rs: [u64; L],
}

impl<const L: usize> Default for Lanes<L> {
    fn default() -> Self {
        Lanes {
            r: [0; L],
            w: [0; L],
            rs: [0; L],
        }
    }
}

impl<const L: usize> Lanes<L> {
    /// `(A, B, Cq)` of a run of `n` rows of `q` pieces: `A = Σ x`, `B = Σ_t t·R_t` (R_t the
    /// row's sum), `Cq = Σ_t Σ_q q·x_{t,q}`, all mod 2^64.
    ///
    /// Lane l holds pieces `q ≡ l (mod L)`: per chunk of L pieces `r += x; w += r`, per row
    /// `rs += r`. With K chunks in all and chunk index c = t·q/L + i, `Σ_c c·X_c = K·r − w`
    /// per lane, hence `Σ (t·q + q')·x = L·Σ(K·r − w) + Σ l·r`; and `Σ rs = n·A − B`.
    fn sums(&self, n: u64, q: u64) -> (u64, u64, u64) {
        let chunks = n.wrapping_mul(q / L as u64);
        let (mut a, mut y, mut srs) = (0u64, 0u64, 0u64);
        for l in 0..L {
            a = a.wrapping_add(self.r[l]);
            srs = srs.wrapping_add(self.rs[l]);
            let lane = chunks.wrapping_mul(self.r[l]).wrapping_sub(self.w[l]);
            y = y
                .wrapping_add(lane.wrapping_mul(L as u64))
                .wrapping_add((l as u64).wrapping_mul(self.r[l]));
        }
        let b = n.wrapping_mul(a).wrapping_sub(srs);
        (a, b, y.wrapping_sub(q.wrapping_mul(b)))
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
