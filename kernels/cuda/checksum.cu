// kvferry GPU checksum kernel (docs/design.md §2.1, §5), compiled at run time by NVRTC.
//
// One launch checksums one KV cache group: every layer of the group over a list of
// logical blocks. The work is cut into tiles; a tile is one (layer, block, kernel
// block, part) for the vector paths, one (layer, block, kernel block) for the generic
// path. Each thread sums m * x_j * (2j + 1) mod 2^64 over the pieces it reads in
// registers, each warp reduces with shuffles, and one atomicAdd per warp and tile adds
// the sum into out[block index * num_slots + replica slot]. Addition mod 2^64 is
// associative and commutative, so the result does not depend on the order.
//
// The copy variants (kvf_copy_checksum*) first copy each chunk they checksum from a source
// array of the same layout (another process's KV mapped here, say): every chunk is loaded
// from the source, stored into the layer, and the stored registers are summed. Only the
// vector paths copy; the host never sends a generic-path layer with a source.
//
// Definition (seed, docs/design.md §2.1): token t of the request, piece p of its cell (the
// cell is the head's K elements then its V elements, split into little-endian 8-byte
// pieces, P per cell) has index j = t*P + p; s = sum x_j (2j+1); c = sum m*s with
// m = 2(layer*65536 + head) + 1.

typedef unsigned long long u64;
typedef unsigned int u32;

#define KVF_THREADS 256
// Layer tables up to this many layers are staged in shared memory.
#define KVF_SMEM_LAYERS 64

// Mirrors `LayerView` in kernels/src/cuda/view.rs (repr(C), 144 bytes).
struct LayerView {
    u64 base;       // device address of the layer's array
    u64 s_block;    // byte stride of the kernel-block dim B
    u64 s_part;     // byte stride of KV (0 when the cache has one part)
    u64 s_outer;    // byte stride of the outer row dim (N or H)
    u64 s_inner;    // byte stride of the inner row dim (H or N)
    u64 s_d;        // byte stride of D
    u64 m_base;     // head factor m of local head 0: 2(layer*65536 + head_offset) + 1
    u64 pieces;     // P, 8-byte pieces per cell
    u32 n_outer;    // size of the outer row dim
    u32 n_inner;    // size of the inner row dim
    u32 outer_is_token;  // 1: outer = N (tokens), inner = H; 0: outer = H, inner = N
    u32 d;          // elements per head per part
    u32 elem;       // element size in bytes
    u32 parts;      // 2 with KV, else 1
    u32 tokens;     // N, tokens per kernel block
    u32 kb_per_block;
    u32 mode;       // 0: 16-byte vector loads, 1: 8-byte loads, 2: generic byte gather
    u32 tiles_per_block;
    u32 tile_begin; // first tile of this layer within a block's tiles
    u32 slot;       // replica-key slot of this layer's output
    u32 regular;    // 0, or 1 | log2(R) << 8 | log2(n_inner) << 16 when each thread keeps
                    // one chunk column and inner index for the whole tile (see tile_regular)
    u32 pad;
    u64 src_base;     // copy variants: device address of the source array (same layout)
    u64 src_s_block;  // its byte stride of B
    u64 src_s_part;   // its byte stride of KV
};

__device__ __forceinline__ u64 warp_sum(u64 v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

// Last layer whose tile_begin <= tile (tile_begin strictly increases).
__device__ __forceinline__ u32 find_layer(const LayerView* layers, u32 n, u32 tile) {
    u32 lo = 0, hi = n;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) >> 1;
        if (layers[mid].tile_begin <= tile) lo = mid; else hi = mid;
    }
    return lo;
}

struct Tile {
    u32 layer, bidx, kk, part;
};

// Tiles are numbered block-major: tile = bidx * tiles_per_group + r, where r runs over
// every layer's tiles of that block (layer l owns r in [tile_begin, tile_begin + tiles_per_block)).
__device__ __forceinline__ Tile decode(const LayerView* tab, u32 num_layers, u32 tiles_per_group, u32 tile) {
    Tile t;
    t.bidx = tile / tiles_per_group;
    const u32 r = tile - t.bidx * tiles_per_group;
    t.layer = find_layer(tab, num_layers, r);
    const LayerView& L = tab[t.layer];
    const u32 local = r - L.tile_begin;
    if (L.mode == 2) { t.kk = local; t.part = 0; } else { t.kk = local / L.parts; t.part = local - t.kk * L.parts; }
    return t;
}

// Advance (o, i, c) by blockDim.x chunks in the flattened (outer, inner, chunk) order.
#define KVF_STEP()                                  \
    do {                                            \
        c += sc;                                    \
        u32 carry_ = 0;                             \
        if (c >= R) { c -= R; carry_ = 1; }         \
        i += si + carry_;                           \
        o += so;                                    \
        if (i >= n_i) { i -= n_i; o += 1; }         \
    } while (0)

// One part of one kernel block: rows (outer, inner) of D contiguous elements, read in
// V-byte chunks. Consecutive threads take consecutive chunks of a row, then the next
// row along the inner (smaller-stride) dim, so a warp's loads are coalesced. U loads per
// thread are issued before the first is used; the index walk is replayed to weight them
// (cheaper in registers than keeping U weights alive across the loads).
//
// C: each chunk is loaded from `src` (the same offset from it as from `base`) and stored at
// `base` once the U loads are in flight; the sum is of the stored registers. The stores are
// streaming (evict-first): nothing here reads the landed bytes again.
template <int V, int U, bool C>
__device__ __forceinline__ u64 tile_vec(const LayerView& L, u64 base, u64 src, u32 part, u64 t0, u32 nt) {
    const u64 from = C ? src : base;
    const u32 R = (L.d * L.elem) / V;  // chunks per row
    const u64 p_part = (u64)part * ((L.d * L.elem) >> 3);
    const bool ot = L.outer_is_token != 0;
    const u32 n_o = ot ? nt : L.n_outer;
    const u32 n_i = L.n_inner;
    const u64 s_o = L.s_outer, s_i = L.s_inner, P = L.pieces, mb = L.m_base;
    u32 c = threadIdx.x % R;
    const u32 row = threadIdx.x / R;
    u32 i = row % n_i;
    u32 o = row / n_i;
    const u32 sc = blockDim.x % R, srows = blockDim.x / R;
    const u32 si = srows % n_i, so = srows / n_i;
    u64 acc = 0;
    while (o < n_o) {
        const u32 c0 = c, i0 = i, o0 = o;
        if (V == 16) {
            ulonglong2 x[U];
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const u32 n = ot ? o : i;
                x[k] = (o < n_o && n < nt) ? __ldcs((const ulonglong2*)(from + (u64)o * s_o + (u64)i * s_i + (u64)c * 16))
                                           : make_ulonglong2(0ull, 0ull);
                KVF_STEP();
            }
            c = c0; i = i0; o = o0;
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const u32 n = ot ? o : i;
                const u32 h = ot ? i : o;
                if (C && o < n_o && n < nt) __stcs((ulonglong2*)(base + (u64)o * s_o + (u64)i * s_i + (u64)c * 16), x[k]);
                const u64 j = (t0 + n) * P + p_part + (u64)c * 2;
                // x0 (2j+1) + x1 (2j+3) = (x0 + x1)(2j+1) + 2 x1; masked lanes loaded zeros.
                const u64 s = (x[k].x + x[k].y) * (2ull * j + 1ull) + 2ull * x[k].y;
                acc += (mb + 2ull * h) * s;
                KVF_STEP();
            }
        } else {
            u64 x[U];
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const u32 n = ot ? o : i;
                x[k] = (o < n_o && n < nt) ? __ldcs((const u64*)(from + (u64)o * s_o + (u64)i * s_i + (u64)c * 8)) : 0ull;
                KVF_STEP();
            }
            c = c0; i = i0; o = o0;
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const u32 n = ot ? o : i;
                const u32 h = ot ? i : o;
                if (C && o < n_o && n < nt) __stcs((u64*)(base + (u64)o * s_o + (u64)i * s_i + (u64)c * 8), x[k]);
                const u64 j = (t0 + n) * P + p_part + (u64)c;
                acc += (mb + 2ull * h) * (x[k] * (2ull * j + 1ull));
                KVF_STEP();
            }
        }
    }
    return acc;
}

// The regular case of tile_vec: rows of R = 2^rs chunks, an inner dim of n_i = 2^nis,
// and blockDim.x a multiple of R * n_i. Each thread then keeps one chunk column c and
// one inner index i for the whole tile while the outer index o steps by `so`, so the
// weights factor out of the loop: the thread sums y = x0 + x1 (the chunk's two pieces),
// o*y, x1 and o*x1 with additions and one small multiply each, and applies m and
// (2j + 1) once at the end. OT: the outer dim is the token (inner is the head).
//   term = m_h * (y * (2j + 1) + 2 x1),  j = (t0 + n) * P + q,  q = part * D*elem/8 + c * V/8
//   OT:  sum = M * ((2 t0 P + 2q + 1) U + 2P W + 2X)            (M = m of head i)
//   !OT: sum = m0 (J U + 2X) + 2 (J W + 2Y)                     (J = 2 (t0 + i) P + 2q + 1)
// with U = sum y, W = sum o y, X = sum x1, Y = sum o x1 (x1 = 0 when V = 8).
// C: loads from `src`, stores at `base` (as tile_vec).
template <int V, int U, bool OT, bool C>
__device__ __forceinline__ u64 tile_regular(const LayerView& L, u64 base, u64 src, u32 part, u64 t0, u32 nt) {
    const u32 rs = (L.regular >> 8) & 0xffu, nis = (L.regular >> 16) & 0xffu;
    const u32 c = threadIdx.x & ((1u << rs) - 1u);
    const u32 row = threadIdx.x >> rs;
    const u32 i = row & ((1u << nis) - 1u);
    u32 o = row >> nis;
    const u32 so = (blockDim.x >> rs) >> nis;
    const u32 n_o = OT ? nt : L.n_outer;
    if (!OT && i >= nt) return 0;  // this thread's token is past num_tokens
    const u64 step = (u64)so * L.s_outer;
    const u64 rel = (u64)o * L.s_outer + (u64)i * L.s_inner + (u64)c * V;
    u64 a = base + rel;
    u64 sa = (C ? src : base) + rel;
    u64 su = 0, sw = 0, sx = 0, sy = 0;
    while (o < n_o) {
        if (V == 16) {
            ulonglong2 x[U];
#pragma unroll
            for (int k = 0; k < U; ++k)
                x[k] = (o + k * so < n_o) ? __ldcs((const ulonglong2*)(sa + k * step)) : make_ulonglong2(0ull, 0ull);
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const u64 ok = o + k * so;
                if (C && ok < n_o) __stcs((ulonglong2*)(a + k * step), x[k]);
                const u64 y = x[k].x + x[k].y;
                su += y;
                sw += ok * y;
                sx += x[k].y;
                if (!OT) sy += ok * x[k].y;
            }
        } else {
            u64 x[U];
#pragma unroll
            for (int k = 0; k < U; ++k) x[k] = (o + k * so < n_o) ? __ldcs((const u64*)(sa + k * step)) : 0ull;
#pragma unroll
            for (int k = 0; k < U; ++k) {
                if (C && o + k * so < n_o) __stcs((u64*)(a + k * step), x[k]);
                su += x[k];
                sw += (u64)(o + k * so) * x[k];
            }
        }
        o += U * so;
        a += U * step;
        sa += U * step;
    }
    const u64 P = L.pieces;
    const u64 q = (u64)part * ((L.d * L.elem) >> 3) + (u64)c * (V / 8);
    if (OT) {
        const u64 M = L.m_base + 2ull * i;
        return M * ((2ull * t0 * P + 2ull * q + 1ull) * su + 2ull * P * sw + 2ull * sx);
    } else {
        const u64 J = 2ull * (t0 + i) * P + 2ull * q + 1ull;
        return L.m_base * (J * su + 2ull * sx) + 2ull * (J * sw + 2ull * sy);
    }
}

template <int V, int U, bool C>
__device__ __forceinline__ u64 tile_fast(const LayerView& L, u64 base, u64 src, u32 part, u64 t0, u32 nt) {
    if (L.regular) {
        return L.outer_is_token ? tile_regular<V, U, true, C>(L, base, src, part, t0, nt)
                                : tile_regular<V, U, false, C>(L, base, src, part, t0, nt);
    }
    return tile_vec<V, 4, C>(L, base, src, part, t0, nt);
}

// Any strides and any D*elem: each piece is gathered byte by byte (pieces may straddle
// K and V, elements may be strided). Correct everywhere, fast nowhere; used only when
// the vector paths' conditions fail.
__device__ u64 tile_generic(const LayerView& L, u64 base, u64 t0, u32 nt) {
    const u32 P = (u32)L.pieces;
    const u32 part_bytes = L.d * L.elem;
    const u32 n_o = L.outer_is_token ? nt : L.n_outer;
    const u32 total = n_o * L.n_inner * P;
    u64 acc = 0;
    for (u32 q = threadIdx.x; q < total; q += blockDim.x) {
        const u32 row = q / P, p = q - row * P;
        const u32 o = row / L.n_inner, i = row - o * L.n_inner;
        const u32 n = L.outer_is_token ? o : i;
        const u32 h = L.outer_is_token ? i : o;
        if (n >= nt) continue;
        const u64 rb = base + (u64)o * L.s_outer + (u64)i * L.s_inner;
        u64 x = 0;
#pragma unroll
        for (u32 b = 0; b < 8; ++b) {
            const u32 off = p * 8 + b;
            const u32 part = off / part_bytes;
            const u32 rem = off - part * part_bytes;
            const u32 d = rem / L.elem;
            const u32 eb = rem - d * L.elem;
            const unsigned char* a =
                (const unsigned char*)(rb + (u64)part * L.s_part + (u64)d * L.s_d + eb);
            x |= (u64)(*a) << (8 * b);
        }
        const u64 jj = (t0 + n) * L.pieces + p;
        acc += (L.m_base + 2ull * h) * (x * (2ull * jj + 1ull));
    }
    return acc;
}

// C: the source lines of the tile that follows `tile` (layer `layer`, local tile `local`,
// block index `bidx`) in this thread block's range, asked into L2 before this tile's loads are
// waited for, so that twice the bytes are in flight per thread (the copy kernels keep fewer
// threads resident than the checksum kernels: each holds its loaded chunks until stored).
// Regular layers only, in tile_regular's order: one lane in every 128 bytes of a row asks (a
// row not aligned to 128 bytes may leave a line unasked: the load then waits for it as
// before). A prefetch is a hint: it changes no value, and it asks only for lines the next
// tile loads.
__device__ __forceinline__ void prefetch_next(const LayerView* tab, u32 num_layers, u32 layer, u32 local, u32 bidx,
                                              const u64* __restrict__ src_block_ids, u64 start, u64 num_tokens) {
    u32 nl = layer, nloc = local + 1, nb = bidx;
    if (nloc == tab[layer].tiles_per_block) {
        nloc = 0;
        if (++nl == num_layers) { nl = 0; ++nb; }
    }
    const LayerView& N = tab[nl];
    if (!N.regular || N.mode == 2) return;
    const u32 kk = N.parts == 2 ? nloc >> 1 : nloc;
    const u32 part = nloc - kk * N.parts;
    const u64 t0 = (start + nb) * ((u64)N.kb_per_block * N.tokens) + (u64)kk * N.tokens;
    if (t0 >= num_tokens) return;
    const u64 left = num_tokens - t0;
    const u32 nt = left < (u64)N.tokens ? (u32)left : N.tokens;
    const u32 V = N.mode == 0 ? 16u : 8u;
    const u32 rs = (N.regular >> 8) & 0xffu, nis = (N.regular >> 16) & 0xffu;
    const u32 c = threadIdx.x & ((1u << rs) - 1u);
    if (((c * V) & 127u) != 0) return;
    const u32 row = threadIdx.x >> rs;
    const u32 i = row & ((1u << nis) - 1u);
    u32 o = row >> nis;
    if (!N.outer_is_token && i >= nt) return;
    const u32 so = (blockDim.x >> rs) >> nis;
    const u32 n_o = N.outer_is_token ? nt : N.n_outer;
    const u64 src = N.src_base + (src_block_ids[nb] * N.kb_per_block + kk) * N.src_s_block + (u64)part * N.src_s_part;
    u64 a = src + (u64)o * N.s_outer + (u64)i * N.s_inner + (u64)c * V;
    const u64 step = (u64)so * N.s_outer;
    for (; o < n_o; o += so, a += step) asm volatile("prefetch.global.L2 [%0];" :: "l"(a));
}

__device__ __forceinline__ void flush(u64 acc, u64 oi, u64* out) {
    acc = warp_sum(acc);
    if ((threadIdx.x & 31u) == 0 && acc != 0 && oi != ~0ull) atomicAdd(&out[oi], acc);
}

// layers: num_layers views (tile_begin ascending); block_ids: num_blocks logical block
// ids, block_ids[b] at position start + b; C: src_block_ids[b], the source's block at that
// position (each layer's chunks are copied from its src_base view first); out: num_blocks * num_slots u64, zeroed
// before the launch. The num_blocks * tiles_per_group tiles are split into one
// contiguous range per thread block; tiles are block-major, so consecutive tiles mostly
// add into the same output: each thread keeps a running sum in a register and its warp
// flushes it (shuffle reduction, one atomicAdd) only when the output changes. No
// barrier inside the loop: warps run ahead independently.
template <int U, bool C>
__device__ __forceinline__ void checksum_tiles(const LayerView* __restrict__ layers, u32 num_layers,
                                               const u64* __restrict__ block_ids,
                                               const u64* __restrict__ src_block_ids, u32 num_blocks, u64 start,
                                               u64 num_tokens, u32 num_slots, u32 tiles_per_group,
                                               u64* __restrict__ out) {
    __shared__ LayerView sl[KVF_SMEM_LAYERS];
    const LayerView* tab = layers;
    if (num_layers <= KVF_SMEM_LAYERS) {
        const u64* src = (const u64*)layers;
        u64* dst = (u64*)sl;
        const u32 words = num_layers * (u32)(sizeof(LayerView) / 8);
        for (u32 w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
        __syncthreads();
        tab = sl;
    }
    const u64 total = (u64)num_blocks * tiles_per_group;
    const u32 lo = (u32)((u64)blockIdx.x * total / gridDim.x);
    const u32 hi = (u32)((u64)(blockIdx.x + 1) * total / gridDim.x);
    u64 acc = 0, oi = ~0ull, bid = 0, sbid = 0;
    u32 last_bidx = ~0u;
    if (lo >= hi) return;
    // Full decode of the first tile; later tiles advance (layer, local, bidx) by one.
    const Tile first = decode(tab, num_layers, tiles_per_group, lo);
    u32 bidx = first.bidx, layer = first.layer, local = lo - first.bidx * tiles_per_group - tab[first.layer].tile_begin;
    for (u32 tile = lo; tile < hi; ++tile) {
        const LayerView& L = tab[layer];
        u32 kk, part;
        if (L.mode == 2) { kk = local; part = 0; } else { kk = L.parts == 2 ? local >> 1 : local; part = local - kk * L.parts; }
        const u64 o = (u64)bidx * num_slots + L.slot;
        if (o != oi) {
            flush(acc, oi, out);
            acc = 0;
            oi = o;
        }
        const u64 block_size = (u64)L.kb_per_block * L.tokens;
        const u64 t0 = (start + bidx) * block_size + (u64)kk * L.tokens;
        if (t0 < num_tokens) {  // uniform across the block
            if (bidx != last_bidx) {
                bid = block_ids[bidx];
                if (C) sbid = src_block_ids[bidx];
                last_bidx = bidx;
            }
            const u64 left = num_tokens - t0;
            const u32 nt = left < (u64)L.tokens ? (u32)left : L.tokens;
            const u64 kb = bid * L.kb_per_block + kk;
            const u64 base = L.base + kb * L.s_block + (u64)part * L.s_part;
            const u64 src = C ? L.src_base + (sbid * L.kb_per_block + kk) * L.src_s_block + (u64)part * L.src_s_part : 0;
            if (C && tile + 1 < hi) prefetch_next(tab, num_layers, layer, local, bidx, src_block_ids, start, num_tokens);
            if (L.mode == 0) acc += tile_fast<16, U, C>(L, base, src, part, t0, nt);
            else if (L.mode == 1) acc += tile_fast<8, U, C>(L, base, src, part, t0, nt);
            else if (!C) acc += tile_generic(L, base, t0, nt);
        }
        if (++local == L.tiles_per_block) {
            local = 0;
            if (++layer == num_layers) { layer = 0; ++bidx; }
        }
    }
    flush(acc, oi, out);
}

// Four loads in flight per thread on the regular path.
extern "C" __global__ void __launch_bounds__(KVF_THREADS)
kvf_checksum(const LayerView* __restrict__ layers, u32 num_layers, const u64* __restrict__ block_ids, u32 num_blocks,
             u64 start, u64 num_tokens, u32 num_slots, u32 tiles_per_group, u64* __restrict__ out) {
    checksum_tiles<4, false>(layers, num_layers, block_ids, nullptr, num_blocks, start, num_tokens, num_slots, tiles_per_group, out);
}

// Eight loads in flight per thread on the regular path.
extern "C" __global__ void __launch_bounds__(KVF_THREADS)
kvf_checksum_u8(const LayerView* __restrict__ layers, u32 num_layers, const u64* __restrict__ block_ids, u32 num_blocks,
                u64 start, u64 num_tokens, u32 num_slots, u32 tiles_per_group, u64* __restrict__ out) {
    checksum_tiles<8, false>(layers, num_layers, block_ids, nullptr, num_blocks, start, num_tokens, num_slots, tiles_per_group, out);
}

// kvf_checksum, copying each chunk from the layer's source first.
extern "C" __global__ void __launch_bounds__(KVF_THREADS)
kvf_copy_checksum(const LayerView* __restrict__ layers, u32 num_layers, const u64* __restrict__ block_ids,
                  const u64* __restrict__ src_block_ids, u32 num_blocks, u64 start, u64 num_tokens, u32 num_slots,
                  u32 tiles_per_group, u64* __restrict__ out) {
    checksum_tiles<4, true>(layers, num_layers, block_ids, src_block_ids, num_blocks, start, num_tokens, num_slots, tiles_per_group, out);
}

// kvf_checksum_u8, copying each chunk from the layer's source first.
extern "C" __global__ void __launch_bounds__(KVF_THREADS)
kvf_copy_checksum_u8(const LayerView* __restrict__ layers, u32 num_layers, const u64* __restrict__ block_ids,
                     const u64* __restrict__ src_block_ids, u32 num_blocks, u64 start, u64 num_tokens, u32 num_slots,
                     u32 tiles_per_group, u64* __restrict__ out) {
    checksum_tiles<8, true>(layers, num_layers, block_ids, src_block_ids, num_blocks, start, num_tokens, num_slots, tiles_per_group, out);
}
