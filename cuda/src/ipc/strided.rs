//! The strided piece kernel: the copies of many blocks that share one list of byte ranges,
//! expanded on the device from a table of O(ranges + blocks) entries (`kernels/strided.cu`).

use std::ffi::c_void;

use cudarc::driver::sys;

use super::piece::{Copy, LoadedKernel, PieceTable};
use crate::driver::DriverResult;
use crate::error::{CudaError, InvalidArg};

/// Ranges longer than this are cut into ranges of at most this many bytes (one warp copies
/// one piece: a long one would keep it busy while the others idle).
pub const STRIDED_PIECE_MAX: u64 = 64 << 10;
/// The shortest cut: long ranges are cut no finer than this (a warp moves 2 KiB per round of
/// its loads; finer pieces spend more on finding them than on copying).
pub const STRIDED_PIECE_MIN: u64 = 8 << 10;
/// Pieces wanted per launch: a warp each, 8 per block of 256 threads, so 1024 blocks: about
/// what an H100/H200 keeps resident (132 multiprocessors × 8 blocks), every multiprocessor
/// with many loads in flight. With fewer, 16 MiB of 64 KiB ranges were 256 pieces: 256 warps
/// on 32 multiprocessors, a quarter of the device's bandwidth.
pub const STRIDED_PIECES_WANTED: u64 = 8192;

/// The strided kernel's source (compiled with NVRTC on first use per device).
pub const STRIDED_SRC: &str = include_str!("../../kernels/strided.cu");

/// One group of a strided launch: every range of `ranges` (`dst`, `src` offsets and `len`
/// bytes) copied for every pair of `bases`, block-major. A pair `(a, b)` names the block's
/// destination base `a` and source base `b` (`b` and `a` with `dst_second`), each moved by
/// `shift` (`(destination, source)`, wrapping adds): the caller's block list goes to the
/// table as it is, without a list of moved bases of its own.
#[derive(Debug, Clone, Copy)]
pub struct StridedCopies<'a> {
    /// Offsets from a base pair (`dst`, `src`) and lengths (> 0).
    pub ranges: &'a [Copy],
    /// Each block's pair of bases (see the type's doc).
    pub bases: &'a [(u64, u64)],
    /// Whether the second of a pair is the destination base.
    pub dst_second: bool,
    /// Added to every destination and source base (wrapping).
    pub shift: (u64, u64),
}

impl StridedCopies<'_> {
    fn live(&self) -> bool {
        !self.ranges.is_empty() && !self.bases.is_empty()
    }
}

/// The kernel's table for `groups`, as u64 words: the group headers `{first piece, first
/// range, ranges, first base}`, then the ranges `{dst, src, len}` (long ones cut at
/// [`strided_cut`]), then the bases `{dst, src}`; with the word offsets of the ranges
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

/// Where the parts of a table lie (words), how long ranges are cut, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    cut: u64,
    words: usize,
    ranges_at: usize,
    bases_at: usize,
    groups: u32,
    pieces: u64,
}

/// The length long ranges of `groups` are cut at: about [`STRIDED_PIECES_WANTED`] pieces for
/// all their bytes (a power of two between [`STRIDED_PIECE_MIN`] and [`STRIDED_PIECE_MAX`]).
pub fn strided_cut(groups: &[StridedCopies<'_>]) -> u64 {
    let bytes = groups.iter().fold(0u64, |a, g| {
        let per = g
            .ranges
            .iter()
            .fold(0u64, |a, c| a.saturating_add(c.len as u64));
        a.saturating_add(per.saturating_mul(g.bases.len() as u64))
    });
    (bytes / STRIDED_PIECES_WANTED)
        .clamp(STRIDED_PIECE_MIN, STRIDED_PIECE_MAX)
        .next_power_of_two()
        .min(STRIDED_PIECE_MAX)
}

fn layout(groups: &[StridedCopies<'_>]) -> DriverResult<Layout> {
    let n = groups.iter().filter(|g| g.live()).count();
    let n = u32::try_from(n).map_err(|_| {
        CudaError::Invalid(InvalidArg::TooMany {
            what: "strided groups",
            count: n,
        })
    })?;
    let cut = strided_cut(groups);
    let pieces_of = |c: &Copy| (c.len as u64).div_ceil(cut).max(1);
    let (mut n_ranges, mut n_bases, mut pieces) = (0u64, 0usize, 0u64);
    for g in groups.iter().filter(|g| g.live()) {
        let nr: u64 = g.ranges.iter().map(pieces_of).sum();
        n_ranges += nr;
        n_bases += g.bases.len();
        pieces += nr * g.bases.len() as u64;
    }
    let ranges_at = 4 * n as usize;
    let bases_at = ranges_at + 3 * n_ranges as usize;
    Ok(Layout {
        cut,
        words: bases_at + 2 * n_bases,
        ranges_at,
        bases_at,
        groups: n,
        pieces,
    })
}

/// Writes the table of `groups` laid out as `t` into `words` (`t.words` long).
fn fill(groups: &[StridedCopies<'_>], t: &Layout, words: &mut [u64]) {
    let (mut r_at, mut b_at, mut first) = (0u64, 0u64, 0u64);
    for (i, g) in groups.iter().filter(|g| g.live()).enumerate() {
        let r0 = r_at;
        for c in g.ranges {
            let mut off = 0u64;
            loop {
                let len = (c.len as u64 - off).min(t.cut);
                let w = t.ranges_at + 3 * r_at as usize;
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
        let at = t.bases_at + 2 * b_at as usize;
        let out = &mut words[at..at + 2 * g.bases.len()];
        let (sd, ss) = g.shift;
        for (w, &(a, b)) in out.chunks_exact_mut(2).zip(g.bases) {
            let (d, s) = if g.dst_second { (b, a) } else { (a, b) };
            w[0] = d.wrapping_add(sd);
            w[1] = s.wrapping_add(ss);
        }
        b_at += g.bases.len() as u64;
        first += nr * g.bases.len() as u64;
    }
}

/// Lays out `groups` for the kernel. Errors: `Invalid` for more than `u32::MAX` groups.
pub fn strided_table(groups: &[StridedCopies<'_>]) -> DriverResult<StridedTable> {
    let t = layout(groups)?;
    let mut words = vec![0u64; t.words];
    fill(groups, &t, &mut words);
    Ok(StridedTable {
        words,
        ranges_at: t.ranges_at,
        bases_at: t.bases_at,
        groups: t.groups,
        pieces: t.pieces,
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
        let t = layout(groups)?;
        if t.pieces == 0 {
            return Ok(0);
        }
        let k = &self.0;
        k.bind()?;
        // Written straight into the pinned table: no list of words of its own first.
        let write = |words: &mut [u64]| fill(groups, &t, words);
        // SAFETY: forwarded from this function's contract; the context is bound above.
        let dev = unsafe { k.upload(table, t.words, write, stream) }?;
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
                (
                    w[bs].wrapping_add(w[rg]),
                    w[bs + 1].wrapping_add(w[rg + 1]),
                    w[rg + 2],
                )
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
                dst_second: false,
                shift: (0, 0),
            },
            StridedCopies {
                ranges: &[],
                bases: &b1,
                dst_second: false,
                shift: (0, 0),
            },
            StridedCopies {
                ranges: &r2,
                bases: &b2,
                // The destination is the second of each pair, moved down (a wrapping add).
                dst_second: true,
                shift: (5u64.wrapping_neg(), 1000),
            },
        ];
        let t = strided_table(&groups).unwrap();
        assert_eq!(t.groups, 2, "the empty group is left out");
        let cut = strided_cut(&groups);
        assert_eq!(cut, STRIDED_PIECE_MIN, "few bytes: the finest cut");
        let mut want = Vec::new();
        for g in [&groups[0], &groups[2]] {
            for &(a, b) in g.bases {
                let (d, s) = if g.dst_second { (b, a) } else { (a, b) };
                let (d, s) = (d.wrapping_add(g.shift.0), s.wrapping_add(g.shift.1));
                for r in g.ranges {
                    let mut off = 0;
                    while off < r.len as u64 {
                        let len = (r.len as u64 - off).min(cut);
                        want.push((d + r.dst + off, s + r.src + off, len));
                        off += len;
                    }
                }
            }
        }
        assert_eq!(t.pieces as usize, want.len());
        assert_eq!(kernel_pieces(&t), want);
        assert!(
            want.contains(&(13 - 5 + 8, 11 + 1000 + 8, 32)),
            "block (11, 13) of the second group"
        );
        assert_eq!(strided_table(&[]).unwrap().pieces, 0);
    }

    #[test]
    fn long_ranges_are_cut_for_about_the_pieces_wanted() {
        let range = [Copy {
            dst: 0,
            src: 0,
            len: 64 << 10,
        }];
        let cut_of = |mib: u64| {
            let bases = vec![(0u64, 0u64); (mib << 20 >> 16) as usize];
            strided_cut(&[StridedCopies {
                ranges: &range,
                bases: &bases,
                dst_second: false,
                shift: (0, 0),
            }])
        };
        // 16 MiB of 64 KiB ranges: 2048 pieces of 8 KiB, not 256 of 64 KiB (256 warps).
        assert_eq!(cut_of(16), STRIDED_PIECE_MIN);
        assert_eq!(cut_of(64), STRIDED_PIECE_MIN);
        assert_eq!(cut_of(256), 32 << 10);
        assert_eq!(cut_of(512), STRIDED_PIECE_MAX);
        assert_eq!(cut_of(1024), STRIDED_PIECE_MAX, "never longer");
        // Where the finest cut does not bind, about the pieces wanted.
        for mib in [64, 256, 512] {
            assert!((mib << 20) / cut_of(mib) >= STRIDED_PIECES_WANTED / 2);
        }
    }
}
