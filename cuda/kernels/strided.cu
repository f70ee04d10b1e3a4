// Strided gather/scatter copy (docs/design.md §3.10): the copies of many KV blocks that share
// one list of byte ranges (block 0's, each block's moved by its pair of bases), expanded on the
// device, so the host writes O(ranges + blocks) table entries instead of one per copy.
//
// groups: ng entries {first piece, first range, ranges, first base}; piece p of a group is
// range p mod ranges of base p div ranges (block-major). One warp copies one piece at a time
// (pieces w, w + warps, ...), up to four 16-byte loads in flight per lane where the piece's
// addresses and length allow 16-byte access, bytes otherwise. The host cuts long ranges so that
// one piece does not keep one warp busy while the others idle.

struct KvfGroup {
    unsigned long long first;
    unsigned long long r0;
    unsigned long long nr;
    unsigned long long b0;
};

struct KvfRange {
    unsigned long long dst;
    unsigned long long src;
    unsigned long long len;
};

struct KvfBase {
    unsigned long long dst;
    unsigned long long src;
};

extern "C" __global__ void __launch_bounds__(256)
kvf_copy_strided(const KvfGroup* __restrict__ groups, unsigned int ng,
                 const KvfRange* __restrict__ ranges, const KvfBase* __restrict__ bases,
                 unsigned long long total) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned long long warp =
        ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const unsigned long long warps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;
    for (unsigned long long p = warp; p < total; p += warps) {
        // The group holding piece p: the last one whose first piece is at most p.
        unsigned int lo = 0, hi = ng;
        while (hi - lo > 1) {
            const unsigned int mid = lo + (hi - lo) / 2;
            if (groups[mid].first <= p) lo = mid; else hi = mid;
        }
        const KvfGroup g = groups[lo];
        const unsigned long long q = p - g.first;
        const unsigned long long b = q / g.nr;
        const unsigned long long r = q - b * g.nr;
        const KvfRange rg = ranges[g.r0 + r];
        const KvfBase bs = bases[g.b0 + b];
        const unsigned long long dst = bs.dst + rg.dst;
        const unsigned long long src = bs.src + rg.src;
        const unsigned long long len = rg.len;
        if (((dst | src | len) & 15ull) == 0) {
            uint4* d = reinterpret_cast<uint4*>(dst);
            const uint4* s = reinterpret_cast<const uint4*>(src);
            const unsigned long long n16 = len >> 4;
            unsigned long long i = lane;
            for (; i + 96 < n16; i += 128) {
                const uint4 x0 = s[i];
                const uint4 x1 = s[i + 32];
                const uint4 x2 = s[i + 64];
                const uint4 x3 = s[i + 96];
                d[i] = x0;
                d[i + 32] = x1;
                d[i + 64] = x2;
                d[i + 96] = x3;
            }
            for (; i < n16; i += 32) d[i] = s[i];
        } else {
            char* d = reinterpret_cast<char*>(dst);
            const char* s = reinterpret_cast<const char*>(src);
            for (unsigned long long i = lane; i < len; i += 32) d[i] = s[i];
        }
    }
}
