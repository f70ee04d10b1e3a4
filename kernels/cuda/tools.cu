// Helper kernels for kvferry's GPU tests and benchmark (not on the checksum path):
// random fill, a plain read-bandwidth reduction (the benchmark's baseline, METHOD.md),
// the same reduction over a list of byte ranges, and a spin kernel that keeps a stream
// busy (the asynchrony test).

typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// words[i] = splitmix64(seed + i) for i < n.
extern "C" __global__ void kvf_fill(u64* words, u64 n, u64 seed) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        words[i] = splitmix64(seed + i);
}

// *out += sum of the n 16-byte vectors at v (both halves), mod 2^64. 16-byte loads,
// four in flight per thread, grid-stride; one atomicAdd per block.
extern "C" __global__ void __launch_bounds__(256) kvf_read_sum(const ulonglong2* __restrict__ v, u64 n, u64* out) {
    __shared__ u64 sh[8];
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const ulonglong2 a = __ldcs(v + i), b = __ldcs(v + i + stride);
        const ulonglong2 c = __ldcs(v + i + 2 * stride), d = __ldcs(v + i + 3 * stride);
        acc += a.x + a.y + b.x + b.y + c.x + c.y + d.x + d.y;
    }
    for (; i < n; i += stride) {
        const ulonglong2 a = __ldcs(v + i);
        acc += a.x + a.y;
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 t = 0;
        for (u32 w = 0; w < (blockDim.x >> 5); ++w) t += sh[w];
        atomicAdd(out, t);
    }
}

// *out += sum over the ranges (addr[r], addr[r] + len[r]) of their 16-byte vectors
// (addresses and lengths multiples of 16). One block per range, grid-stride over ranges.
extern "C" __global__ void __launch_bounds__(256) kvf_read_ranges(const u64* __restrict__ addr, const u64* __restrict__ len,
                                                                 u32 n_ranges, u64* out) {
    __shared__ u64 sh[8];
    u64 acc = 0;
    for (u32 r = blockIdx.x; r < n_ranges; r += gridDim.x) {
        const ulonglong2* v = (const ulonglong2*)addr[r];
        const u64 n = len[r] >> 4;
        u64 i = threadIdx.x;
        for (; i + 3 * blockDim.x < n; i += 4 * blockDim.x) {
            const ulonglong2 a = __ldcs(v + i), b = __ldcs(v + i + blockDim.x);
            const ulonglong2 c = __ldcs(v + i + 2 * blockDim.x), d = __ldcs(v + i + 3 * blockDim.x);
            acc += a.x + a.y + b.x + b.y + c.x + c.y + d.x + d.y;
        }
        for (; i < n; i += blockDim.x) {
            const ulonglong2 a = __ldcs(v + i);
            acc += a.x + a.y;
        }
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 t = 0;
        for (u32 w = 0; w < (blockDim.x >> 5); ++w) t += sh[w];
        atomicAdd(out, t);
    }
}

// Spins for `ns` nanoseconds of %globaltimer, then writes 1 to *flag.
extern "C" __global__ void kvf_spin(u64 ns, u64* flag) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    if (threadIdx.x == 0 && blockIdx.x == 0) *flag = 1;
}
