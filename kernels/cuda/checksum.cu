// kvferry GPU checksum kernel (DESIGN.md §2.1, §5), compiled at run time by NVRTC.
//
// One launch checksums one KV cache group: every layer of the group over a list of
// logical blocks. The work is cut into tiles; a tile is one (layer, block, kernel
// block, part) for the vector paths, one (layer, block, kernel block) for the generic
// path. Each thread sums m * x_j * (2j + 1) mod 2^64 over the pieces it reads in
// registers, each warp reduces with shuffles, and one atomicAdd per warp and tile adds
// the sum into out[block index * num_slots + replica slot]. Addition mod 2^64 is
// associative and commutative, so the result does not depend on the order.
//
// Definition (seed, DESIGN.md §2.1): token t of the request, piece p of its cell (the
// cell is the head's K elements then its V elements, split into little-endian 8-byte
// pieces, P per cell) has index j = t*P + p; s = sum x_j (2j+1); c = sum m*s with
// m = 2(layer*65536 + head) + 1.

typedef unsigned long long u64;
typedef unsigned int u32;

#define KVF_THREADS 256
// Layer tables up to this many layers are staged in shared memory.
#define KVF_SMEM_LAYERS 64

// Mirrors `LayerView` in kernels/src/cuda/view.rs (repr(C), 112 bytes).
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
    u32 tile_begin; // first tile index of this layer in the launch
    u32 slot;       // replica-key slot of this layer's output
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

__device__ __forceinline__ Tile decode(const LayerView* tab, u32 num_layers, u32 tile) {
    Tile t;
    t.layer = find_layer(tab, num_layers, tile);
    const LayerView& L = tab[t.layer];
    const u32 local = tile - L.tile_begin;
    t.bidx = local / L.tiles_per_block;
    const u32 r = local - t.bidx * L.tiles_per_block;
    if (L.mode == 2) { t.kk = r; t.part = 0; } else { t.kk = r / L.parts; t.part = r - t.kk * L.parts; }
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
template <int V, int U>
__device__ __forceinline__ u64 tile_vec(const LayerView& L, u64 base, u32 part, u64 t0, u32 nt) {
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
                x[k] = (o < n_o && n < nt) ? __ldcs((const ulonglong2*)(base + (u64)o * s_o + (u64)i * s_i + (u64)c * 16))
                                           : make_ulonglong2(0ull, 0ull);
                KVF_STEP();
            }
            c = c0; i = i0; o = o0;
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const u32 n = ot ? o : i;
                const u32 h = ot ? i : o;
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
                x[k] = (o < n_o && n < nt) ? __ldcs((const u64*)(base + (u64)o * s_o + (u64)i * s_i + (u64)c * 8)) : 0ull;
                KVF_STEP();
            }
            c = c0; i = i0; o = o0;
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const u32 n = ot ? o : i;
                const u32 h = ot ? i : o;
                const u64 j = (t0 + n) * P + p_part + (u64)c;
                acc += (mb + 2ull * h) * (x[k] * (2ull * j + 1ull));
                KVF_STEP();
            }
        }
    }
    return acc;
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

// layers: num_layers views sorted by tile_begin; block_ids: num_blocks logical block
// ids, block_ids[b] at position start + b; out: num_blocks * num_slots u64, zeroed
// before the launch. Grid-stride over total_tiles tiles; the next tile's block id is
// loaded while the current tile is read. Each warp adds its sum with one atomicAdd:
// no barrier inside the loop, so warps run ahead independently.
template <int U>
__device__ __forceinline__ void checksum_tiles(const LayerView* __restrict__ layers, u32 num_layers,
                                               const u64* __restrict__ block_ids, u32 num_blocks, u64 start,
                                               u64 num_tokens, u32 num_slots, u32 total_tiles,
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
    u32 tile = blockIdx.x;
    if (tile >= total_tiles) return;
    Tile cur = decode(tab, num_layers, tile);
    u64 bid = block_ids[cur.bidx];
    const u32 lane = threadIdx.x & 31u;
    for (;;) {
        const u32 nt_tile = tile + gridDim.x;
        const bool more = nt_tile < total_tiles;
        Tile nxt = cur;
        u64 nbid = 0;
        if (more) {
            nxt = decode(tab, num_layers, nt_tile);
            nbid = block_ids[nxt.bidx];
        }
        const LayerView& L = tab[cur.layer];
        const u64 block_size = (u64)L.kb_per_block * L.tokens;
        const u64 t0 = (start + cur.bidx) * block_size + (u64)cur.kk * L.tokens;
        if (t0 < num_tokens && cur.bidx < num_blocks) {  // uniform across the block
            const u64 left = num_tokens - t0;
            const u32 nt = left < (u64)L.tokens ? (u32)left : L.tokens;
            const u64 kb = bid * L.kb_per_block + cur.kk;
            const u64 base = L.base + kb * L.s_block + (u64)cur.part * L.s_part;
            u64 acc;
            if (L.mode == 0) acc = tile_vec<16, U>(L, base, cur.part, t0, nt);
            else if (L.mode == 1) acc = tile_vec<8, U>(L, base, cur.part, t0, nt);
            else acc = tile_generic(L, base, t0, nt);
            acc = warp_sum(acc);
            if (lane == 0 && acc != 0) atomicAdd(&out[(u64)cur.bidx * num_slots + L.slot], acc);
        }
        if (!more) break;
        tile = nt_tile;
        cur = nxt;
        bid = nbid;
    }
}

// Four 16-byte loads in flight per thread.
extern "C" __global__ void __launch_bounds__(KVF_THREADS)
kvf_checksum(const LayerView* __restrict__ layers, u32 num_layers, const u64* __restrict__ block_ids, u32 num_blocks,
             u64 start, u64 num_tokens, u32 num_slots, u32 total_tiles, u64* __restrict__ out) {
    checksum_tiles<4>(layers, num_layers, block_ids, num_blocks, start, num_tokens, num_slots, total_tiles, out);
}

// Eight 16-byte loads in flight per thread.
extern "C" __global__ void __launch_bounds__(KVF_THREADS, 4)
kvf_checksum_u8(const LayerView* __restrict__ layers, u32 num_layers, const u64* __restrict__ block_ids, u32 num_blocks,
                u64 start, u64 num_tokens, u32 num_slots, u32 total_tiles, u64* __restrict__ out) {
    checksum_tiles<8>(layers, num_layers, block_ids, num_blocks, start, num_tokens, num_slots, total_tiles, out);
}
