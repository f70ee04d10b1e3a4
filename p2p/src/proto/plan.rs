//! Pairing a block's source byte ranges (producer layer) with its destination
//! byte ranges (consumer layer) into transfer requests. Both sides list the
//! block's bytes in the same logical order (same layout), but the arrays may
//! hold different numbers of blocks, so the ranges may be cut differently.

use std::ops::Range;

/// One WRITE: `len` bytes from producer address `src` to consumer address `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    /// Absolute source address (producer memory).
    pub src: u64,
    /// Absolute destination address (consumer memory).
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// Errors pairing ranges.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The two sides' ranges for one block do not cover the same number of bytes.
    #[error("block spans {src} bytes on the producer but {dst} bytes on the consumer")]
    LengthDiffers {
        /// Producer bytes.
        src: u64,
        /// Consumer bytes.
        dst: u64,
    },
    /// An address computation overflowed.
    #[error("address overflow pairing block ranges")]
    Overflow,
}

/// Pairs `src` ranges (offsets from `src_base`) with `dst` ranges (offsets from
/// `dst_base`), cutting at every boundary of either side, and appends the copies
/// to `out`, merging a copy that continues the previous one on both sides.
pub fn pair_ranges(
    src_base: u64,
    src: &[Range<u64>],
    dst_base: u64,
    dst: &[Range<u64>],
    out: &mut Vec<Copy>,
) -> Result<u64, PlanError> {
    let total = |r: &[Range<u64>]| r.iter().map(|r| r.end.saturating_sub(r.start)).sum::<u64>();
    let (src_len, dst_len) = (total(src), total(dst));
    if src_len != dst_len {
        return Err(PlanError::LengthDiffers {
            src: src_len,
            dst: dst_len,
        });
    }
    let (mut i, mut j) = (0usize, 0usize);
    let (mut si, mut dj) = (0u64, 0u64); // bytes consumed of src[i], dst[j]
    while i < src.len() && j < dst.len() {
        let s_left = src[i].end.saturating_sub(src[i].start) - si;
        let d_left = dst[j].end.saturating_sub(dst[j].start) - dj;
        if s_left == 0 {
            i += 1;
            si = 0;
            continue;
        }
        if d_left == 0 {
            j += 1;
            dj = 0;
            continue;
        }
        let len = s_left.min(d_left);
        let s = src_base
            .checked_add(src[i].start)
            .and_then(|a| a.checked_add(si))
            .ok_or(PlanError::Overflow)?;
        let d = dst_base
            .checked_add(dst[j].start)
            .and_then(|a| a.checked_add(dj))
            .ok_or(PlanError::Overflow)?;
        match out.last_mut() {
            Some(last) if last.src + last.len == s && last.dst + last.len == d => last.len += len,
            _ => out.push(Copy {
                src: s,
                dst: d,
                len,
            }),
        }
        si += len;
        dj += len;
    }
    Ok(src_len)
}
