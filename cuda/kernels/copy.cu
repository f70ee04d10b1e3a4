// Gather/scatter copy of many device pieces in one launch (docs/design.md §3.10): the CUDA IPC
// transport's small pieces (scattered KV blocks, per-token head slices when TP sizes differ)
// would cost a driver call of several microseconds each as separate copies.
//
// pieces: n entries {dst, src, len} in device memory. One block copies one piece at a time
// (pieces b, b + gridDim.x, ...), up to four 16-byte loads in flight per thread where the
// piece's addresses and length allow 16-byte access, bytes otherwise. The host cuts long
// pieces so that there are enough of them for every resident block.

struct KvfPiece {
    unsigned long long dst;
    unsigned long long src;
    unsigned long long len;
};

extern "C" __global__ void __launch_bounds__(256)
kvf_copy_pieces(const KvfPiece* __restrict__ pieces, unsigned int n) {
    for (unsigned int p = blockIdx.x; p < n; p += gridDim.x) {
        const KvfPiece pc = pieces[p];
        if (((pc.dst | pc.src | pc.len) & 15ull) == 0) {
            uint4* d = reinterpret_cast<uint4*>(pc.dst);
            const uint4* s = reinterpret_cast<const uint4*>(pc.src);
            const unsigned long long n16 = pc.len >> 4;
            const unsigned int b = blockDim.x;
            unsigned long long i = threadIdx.x;
            for (; i + 3 * b < n16; i += 4 * b) {
                const uint4 x0 = s[i];
                const uint4 x1 = s[i + b];
                const uint4 x2 = s[i + 2 * b];
                const uint4 x3 = s[i + 3 * b];
                d[i] = x0;
                d[i + b] = x1;
                d[i + 2 * b] = x2;
                d[i + 3 * b] = x3;
            }
            for (; i < n16; i += b) d[i] = s[i];
        } else {
            char* d = reinterpret_cast<char*>(pc.dst);
            const char* s = reinterpret_cast<const char*>(pc.src);
            for (unsigned long long i = threadIdx.x; i < pc.len; i += blockDim.x) d[i] = s[i];
        }
    }
}
