//! The strided piece kernel: the copies of many blocks that share one list of byte ranges,
//! expanded on the device from a table of O(ranges + blocks) entries (`kernels/strided.cu`).

use std::ffi::c_void;

use cudarc::driver::sys;

use super::piece::{Copy, LoadedKernel, PieceTable};
use crate::driver::DriverResult;
use crate::error::CudaError;

/// Ranges longer than this are cut into ranges of at most this many bytes (one warp copies
/// one piece: a long one would keep it busy while the others idle).
pub const STRIDED_PIECE_MAX: u64 = 64 << 10;

/// The strided kernel's source (compiled with NVRTC on first use per device).
pub const STRIDED_SRC: &str = include_str!("../../kernels/strided.cu");

/// One group of a strided launch: every range of `ranges` (`dst`, `src` offsets and `len`
/// bytes) copied for every pair of `bases` (`(dst base, src base)`), block-major.
#[derive(Debug, Clone, Copy)]
pub struct StridedCopies<'a> {
    /// Offsets from a base pair (`dst`, `src`) and lengths (> 0).
    pub ranges: &'a [Copy],
    /// `(dst base, src base)` of each block.
    pub bases: &'a [(u64, u64)],
}

/// The kernel's table for `groups`, as u64 words: the group headers `{first piece, first
/// range, ranges, first base}`, then the ranges `{dst, src, len}` (long ones cut at
/// [`STRIDED_PIECE_MAX`]), then the bases `{dst, src}`; with the word offsets of the ranges
/// and bases, the number of groups and the number of pieces. Groups without ranges or bases
/// are left out.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StridedTable {
    /// The words, in the order above.
    pub words: Vec<u64>,
    /// Word offset of the ranges.
    pub ranges_at: usize,
    /// Word offset of the bases.
    pub bases_at: usize,
    /// Groups in the table.
    pub groups: u32,
    /// Pieces in all: what the kernel copies.
    pub pieces: u64,
}

/// Lays out `groups` for the kernel. Errors: `Invalid` for more than `u32::MAX` groups.
pub fn strided_table(groups: &[StridedCopies<'_>]) -> DriverResult<StridedTable> {
    let live: Vec<&StridedCopies<'_>> = groups
        .iter()
        .filter(|g| !g.ranges.is_empty() && !g.bases.is_empty())
        .collect();
    let n = u32::try_from(live.len())
        .map_err(|_| CudaError::Invalid(format!("{} strided groups in one launch", live.len())))?;
    let cut = |c: &Copy| (c.len as u64).div_ceil(STRIDED_PIECE_MAX).max(1);
    let n_ranges: u64 = live.iter().flat_map(|g| g.ranges).map(cut).sum();
    let n_bases: usize = live.iter().map(|g| g.bases.len()).sum();
    let ranges_at = 4 * live.len();
    let bases_at = ranges_at + 3 * n_ranges as usize;
    let mut words = vec![0u64; bases_at + 2 * n_bases];
    let (mut r_at, mut b_at, mut first) = (0u64, 0u64, 0u64);
    for (i, g) in live.iter().enumerate() {
        let r0 = r_at;
        for c in g.ranges {
            let mut off = 0u64;
            loop {
                let len = (c.len as u64 - off).min(STRIDED_PIECE_MAX);
                let w = ranges_at + 3 * r_at as usize;
                words[w] = c.dst + off;
                words[w + 1] = c.src + off;
                words[w + 2] = len;
                r_at += 1;
                off += len;
                if off >= c.len as u64 {
                    break;
                }
            }
        }
        let nr = r_at - r0;
        words[4 * i..4 * i + 4].copy_from_slice(&[first, r0, nr, b_at]);
        for &(d, s) in g.bases {
            let w = bases_at + 2 * b_at as usize;
            words[w] = d;
            words[w + 1] = s;
            b_at += 1;
        }
        first += nr * g.bases.len() as u64;
    }
    Ok(StridedTable {
        words,
        ranges_at,
        bases_at,
        groups: n,
        pieces: first,
    })
}

/// The strided kernel loaded in one device's context. Shared by any number of enqueues at
/// once; each brings its own [`PieceTable`].
pub struct StridedKernel(LoadedKernel);

impl StridedKernel {
    /// Compiles and loads the kernel for `ordinal`'s device. Errors: NVRTC missing or failing,
    /// the driver's.
    pub fn new(ordinal: u32) -> DriverResult<StridedKernel> {
        LoadedKernel::load(ordinal, STRIDED_SRC, "strided.cu", "kvf_copy_strided")
            .map(StridedKernel)
    }

    /// Enqueues the copies of `groups` on `stream`: the table goes up with an async copy, then
    /// one launch. Returns the pieces copied (0: nothing enqueued).
    ///
    /// # Safety
    /// Every copy (base + range) is valid device memory until the stream's work completes;
    /// `stream` belongs to this kernel's context; `table`'s previous launch has completed and
    /// `table` lives until this one has.
    pub unsafe fn enqueue(
        &self,
        groups: &[StridedCopies<'_>],
        table: &mut PieceTable,
        stream: sys::CUstream,
    ) -> DriverResult<u64> {
        let t = strided_table(groups)?;
        if t.pieces == 0 {
            return Ok(0);
        }
        let k = &self.0;
        k.bind()?;
        let fill = |words: &mut [u64]| words.copy_from_slice(&t.words);
        // SAFETY: forwarded from this function's contract; the context is bound above.
        let dev = unsafe { k.upload(table, t.words.len(), fill, stream) }?;
        let mut groups_ptr = dev;
        let mut ng = t.groups;
        let mut ranges_ptr = dev + 8 * t.ranges_at as u64;
        let mut bases_ptr = dev + 8 * t.bases_at as u64;
        let mut total = t.pieces;
        // One warp per piece at a time: 8 pieces per block of 256 threads.
        let grid = t.pieces.div_ceil(8).min(k.grid_max as u64) as u32;
        // SAFETY: the kernel's arguments are device pointers, a u32 and a u64, as its
        // signature; the table they name lives until the launch completed (contract).
        unsafe {
            k.launch(
                stream,
                grid,
                &mut [
                    &mut groups_ptr as *mut u64 as *mut c_void,
                    &mut ng as *mut u32 as *mut c_void,
                    &mut ranges_ptr as *mut u64 as *mut c_void,
                    &mut bases_ptr as *mut u64 as *mut c_void,
                    &mut total as *mut u64 as *mut c_void,
                ],
            )?;
        }
        Ok(t.pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernel copies, piece by piece, emulated with its own index arithmetic.
    fn kernel_pieces(t: &StridedTable) -> Vec<(u64, u64, u64)> {
        let w = &t.words;
        (0..t.pieces)
            .map(|p| {
                let (mut lo, mut hi) = (0usize, t.groups as usize);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    if w[4 * mid] <= p {
                        lo = mid
                    } else {
                        hi = mid
                    }
                }
                let g = &w[4 * lo..4 * lo + 4];
                let q = p - g[0];
                let (b, r) = (q / g[2], q % g[2]);
                let rg = t.ranges_at + 3 * (g[1] + r) as usize;
                let bs = t.bases_at + 2 * (g[3] + b) as usize;
                (w[bs] + w[rg], w[bs + 1] + w[rg + 1], w[rg + 2])
            })
            .collect()
    }

    #[test]
    fn the_kernels_pieces_are_the_groups_copies_with_long_ranges_cut() {
        let c = |dst, src, len| Copy { dst, src, len };
        let r1 = [
            c(0, 100, 16),
            c(200, 300, STRIDED_PIECE_MAX as usize * 2 + 5),
        ];
        let r2 = [c(8, 8, 32)];
        let b1 = [(1 << 30, 1 << 20), (2 << 30, 2 << 20)];
        let b2 = [(7, 9), (11, 13), (17, 19)];
        let groups = [
            StridedCopies {
                ranges: &r1,
                bases: &b1,
            },
            StridedCopies {
                ranges: &[],
                bases: &b1,
            },
            StridedCopies {
                ranges: &r2,
                bases: &b2,
            },
        ];
        let t = strided_table(&groups).unwrap();
        assert_eq!(t.groups, 2, "the empty group is left out");
        let mut want = Vec::new();
        for g in [&groups[0], &groups[2]] {
            for &(d, s) in g.bases {
                for r in g.ranges {
                    let mut off = 0;
                    while off < r.len as u64 {
                        let len = (r.len as u64 - off).min(STRIDED_PIECE_MAX);
                        want.push((d + r.dst + off, s + r.src + off, len));
                        off += len;
                    }
                }
            }
        }
        assert_eq!(t.pieces as usize, want.len());
        assert_eq!(kernel_pieces(&t), want);
        assert_eq!(strided_table(&[]).unwrap().pieces, 0);
    }
}
