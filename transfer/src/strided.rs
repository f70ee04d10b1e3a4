//! Strided requests (docs/design.md §3 "Strided requests"): the copies of many blocks that share
//! one list of byte ranges (block 0's, each block's moved by its pair of offsets), described once
//! and validated per block in O(ranges + blocks) instead of once per copy.
//!
//! Validation is exact: a block whose whole span (the hull of its ranges) lies inside one
//! registered local region and one advertised remote buffer has every byte of every copy inside
//! them. When some block's span does not fit one region and one buffer (its ranges straddle two
//! adjacent regions, or a gap they do not touch), or the transport takes no strided groups for
//! the pair, the submit falls back to the per-copy path with the expanded copies, which accepts
//! and refuses exactly what it always did. So a strided submit accepts exactly the requests the
//! per-copy submit of the same copies accepts (the property test below checks it).

use std::sync::Arc;

use crate::error::{ArgumentError, Result, TransferError};
use crate::memory::MemoryRegion;
use crate::types::{Op, TransferRequest};

/// One byte range of block 0 of a [`StridedRequest`]: offsets from a block's pair of bases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StridedRange {
    /// Offset of the local side from the block's local base (bytes).
    pub local: u64,
    /// Offset of the remote side from the block's remote base (bytes).
    pub remote: u64,
    /// Bytes; must be > 0.
    pub len: u64,
}

/// The copies of many blocks sharing one list of ranges: copy `(b, r)` moves `ranges[r].len`
/// bytes between local `blocks[b].0 + ranges[r].local` and remote `blocks[b].1 +
/// ranges[r].remote`, in the direction of `op`. The copies are ordered block by block, each
/// block's in range order (what [`StridedRequest::copies`] lists).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StridedRequest {
    /// Direction: `Write` local → remote, `Read` remote → local.
    pub op: Op,
    /// Block 0's ranges (offsets from a block's bases).
    pub ranges: Vec<StridedRange>,
    /// Each block's `(local base, remote base)`, as absolute addresses.
    pub blocks: Vec<(u64, u64)>,
}

impl StridedRequest {
    /// Number of copies: `ranges.len() × blocks.len()`.
    pub fn copy_count(&self) -> u64 {
        self.ranges.len() as u64 * self.blocks.len() as u64
    }

    /// Bytes of all copies (saturating).
    pub fn bytes(&self) -> u64 {
        let per = self
            .ranges
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.len));
        per.saturating_mul(self.blocks.len() as u64)
    }

    /// The copies as plain requests, in order, a copy that continues the previous one on both
    /// sides merged into it (as the per-copy path would cut them anyway). Errors:
    /// `InvalidArgument` for a range of length 0 or an address that overflows `u64`.
    pub fn copies(&self) -> Result<Vec<TransferRequest>> {
        let mut out: Vec<TransferRequest> = Vec::with_capacity(self.copy_count() as usize);
        for &(lb, rb) in &self.blocks {
            for r in &self.ranges {
                let (l, rm) = ends(lb, rb, r)?;
                match out.last_mut() {
                    Some(p)
                        if p.local_addr + p.len == l
                            && p.remote_addr + p.len == rm
                            && p.len.checked_add(r.len).is_some() =>
                    {
                        p.len += r.len
                    }
                    _ => out.push(TransferRequest {
                        op: self.op,
                        local_addr: l,
                        remote_addr: rm,
                        len: r.len,
                    }),
                }
            }
        }
        Ok(out)
    }
}

/// The start addresses of copy `r` of the block with bases `(lb, rb)`; errors as `copies`.
fn ends(lb: u64, rb: u64, r: &StridedRange) -> Result<(u64, u64)> {
    if r.len == 0 {
        return Err(TransferError::InvalidArgument(
            ArgumentError::StridedZeroLength,
        ));
    }
    let l = lb
        .checked_add(r.local)
        .filter(|a| a.checked_add(r.len).is_some());
    let rm = rb
        .checked_add(r.remote)
        .filter(|a| a.checked_add(r.len).is_some());
    match (l, rm) {
        (Some(l), Some(rm)) => Ok((l, rm)),
        (None, _) => Err(overflow(lb, r.local)),
        _ => Err(overflow(rb, r.remote)),
    }
}

/// The span of one block's ranges on each side: `[lo, hi)` offsets from the block's bases.
#[derive(Debug, Clone, Copy)]
struct Hull {
    local: (u64, u64),
    remote: (u64, u64),
}

/// The hull of `ranges`; `None` for no ranges. Errors: a range of length 0 or whose end
/// overflows.
fn hull(ranges: &[StridedRange]) -> Result<Option<Hull>> {
    let mut h: Option<Hull> = None;
    for r in ranges {
        let (l_end, r_end) = ends(0, 0, r).and_then(|_| {
            match (r.local.checked_add(r.len), r.remote.checked_add(r.len)) {
                (Some(a), Some(b)) => Ok((a, b)),
                (None, _) => Err(overflow(r.local, r.len)),
                _ => Err(overflow(r.remote, r.len)),
            }
        })?;
        h = Some(match h {
            None => Hull {
                local: (r.local, l_end),
                remote: (r.remote, r_end),
            },
            Some(h) => Hull {
                local: (h.local.0.min(r.local), h.local.1.max(l_end)),
                remote: (h.remote.0.min(r.remote), h.remote.1.max(r_end)),
            },
        });
    }
    Ok(h)
}

/// One unit of a strided submit as the transport gets it (`Transport::post_strided`): blocks
/// of one request whose every copy lies inside `local_region` (registered here) and the peer's
/// buffer `remote_buffer`. Reported to the sink as one id: `Ok` only when all its copies are in
/// place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StridedGroup {
    /// Index of this group within its `post_strided` call: 0..groups.len().
    pub id: u32,
    /// `Write`: local → remote. `Read`: remote → local.
    pub op: Op,
    /// The registered local region that holds every copy's local side.
    pub local_region: MemoryRegion,
    /// Index into `peer.buffers` of the buffer that holds every copy's remote side.
    pub remote_buffer: usize,
    /// The ranges shared by the group's blocks (offsets from a block's bases; each len > 0).
    pub ranges: Arc<[StridedRange]>,
    /// The group's blocks: `(local base, remote base)`.
    pub blocks: Vec<(u64, u64)>,
}

/// What the compact validation decided.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Validated {
    /// Every block fits one region and one buffer the transport takes strided groups for.
    Compact(Vec<StridedGroup>),
    /// Some block does not: the copies go the per-copy way.
    Expand,
}

/// Validates `requests` in O(ranges + blocks) region and buffer lookups. `local(addr, len)`:
/// the registered region that wholly holds the range; `remote(addr, len)`: the index and
/// region of the peer's buffer that wholly holds it; `takes(region, buffer)`: whether the transport takes
/// strided groups between the two. Errors: `InvalidArgument` for a range of length 0, a copy
/// that overflows the address space, more than `u32::MAX` groups.
pub(crate) fn validate(
    requests: &[StridedRequest],
    mut local: impl FnMut(u64, u64) -> Option<MemoryRegion>,
    mut remote: impl FnMut(u64, u64) -> Option<(usize, MemoryRegion)>,
    mut takes: impl FnMut(&MemoryRegion, usize) -> bool,
) -> Result<Validated> {
    let mut hulls = Vec::with_capacity(requests.len());
    for r in requests {
        // A request without blocks has no copies: nothing of it is refused (as per copy).
        hulls.push(if r.blocks.is_empty() {
            None
        } else {
            hull(&r.ranges)?
        });
    }
    let mut groups: Vec<StridedGroup> = Vec::new();
    let mut expand = false;
    let mut last_local: Option<MemoryRegion> = None;
    let mut last_remote: Option<(usize, MemoryRegion)> = None;
    let mut taken: Vec<(u64, usize, bool)> = Vec::new();
    let mut takes_pair = |region: &MemoryRegion, buffer: usize| match taken
        .iter()
        .find(|(a, b, _)| *a == region.addr && *b == buffer)
    {
        Some(&(_, _, ok)) => ok,
        None => {
            let ok = takes(region, buffer);
            taken.push((region.addr, buffer, ok));
            ok
        }
    };
    for (req, h) in requests.iter().zip(hulls) {
        let Some(h) = h else { continue };
        let ranges: Arc<[StridedRange]> = req.ranges.as_slice().into();
        let first_group = groups.len();
        if !expand {
            let whole = whole_request(
                &req.blocks,
                &h,
                &mut |a, n| match last_local.filter(|g| g.contains(a, n)) {
                    Some(g) => Some(g),
                    None => local(a, n),
                },
                &mut |a, n| match last_remote.filter(|(_, g)| g.contains(a, n)) {
                    Some(b) => Some(b),
                    None => remote(a, n),
                },
            )
            .filter(|(region, (buffer, _))| takes_pair(region, *buffer));
            if let Some((region, buffer)) = whole {
                // Every block lies in this pair: the per-block loop below would make them
                // one group, in order.
                last_local = Some(region);
                last_remote = Some(buffer);
                groups.push(StridedGroup {
                    id: group_id(groups.len())?,
                    op: req.op,
                    local_region: region,
                    remote_buffer: buffer.0,
                    ranges,
                    blocks: req.blocks.clone(),
                });
                continue;
            }
        }
        for &(lb, rb) in &req.blocks {
            // Both ends of the block's span are ends of some copy: checked here as there.
            let (la, ra) = match (lb.checked_add(h.local.0), rb.checked_add(h.remote.0)) {
                (Some(a), Some(b)) => (a, b),
                (None, _) => return Err(overflow(lb, h.local.0)),
                _ => return Err(overflow(rb, h.remote.0)),
            };
            let (ll, rl) = (h.local.1 - h.local.0, h.remote.1 - h.remote.0);
            if la.checked_add(ll).is_none() {
                return Err(overflow(lb, h.local.1));
            }
            if ra.checked_add(rl).is_none() {
                return Err(overflow(rb, h.remote.1));
            }
            if expand {
                continue; // still check every block's arithmetic: the error wins over Expand
            }
            let region = match last_local.filter(|g| g.contains(la, ll)) {
                Some(g) => Some(g),
                None => local(la, ll),
            };
            let buffer = match last_remote.filter(|(_, g)| g.contains(ra, rl)) {
                Some(b) => Some(b),
                None => remote(ra, rl),
            };
            let (Some(region), Some(buffer)) = (region, buffer) else {
                expand = true;
                continue;
            };
            last_local = Some(region);
            last_remote = Some(buffer);
            let buffer = buffer.0;
            if !takes_pair(&region, buffer) {
                expand = true;
                continue;
            }
            match groups[first_group..].last_mut() {
                Some(g) if g.local_region == region && g.remote_buffer == buffer => {
                    g.blocks.push((lb, rb))
                }
                _ => {
                    groups.push(StridedGroup {
                        id: group_id(groups.len())?,
                        op: req.op,
                        local_region: region,
                        remote_buffer: buffer,
                        ranges: ranges.clone(),
                        blocks: vec![(lb, rb)],
                    });
                }
            }
        }
    }
    Ok(if expand {
        Validated::Expand
    } else {
        Validated::Compact(groups)
    })
}

/// The id of the group at index `i`. Errors: more than `u32::MAX` groups.
fn group_id(i: usize) -> Result<u32> {
    u32::try_from(i).map_err(|_| {
        TransferError::InvalidArgument(ArgumentError::TooManySlices {
            limit: u32::MAX as u64,
        })
    })
}

/// The one pair (local region, remote buffer) holding every block of a request whose ranges'
/// span is `h`, found from the hull of all its blocks' spans (the lowest base plus the span's
/// start to the highest base plus its end) with one lookup per side: a region or buffer is an
/// interval, so holding the hull it holds every block. `None` when the hull lies in no one
/// region or buffer (the blocks may still fit one by one), or some block's end overflows
/// (the per-block check names it): then the caller checks block by block. O(blocks) of
/// arithmetic, no lookup per block.
fn whole_request(
    blocks: &[(u64, u64)],
    h: &Hull,
    local: &mut dyn FnMut(u64, u64) -> Option<MemoryRegion>,
    remote: &mut dyn FnMut(u64, u64) -> Option<(usize, MemoryRegion)>,
) -> Option<(MemoryRegion, (usize, MemoryRegion))> {
    let ((l0, l1), (r0, r1)) = base_bounds(blocks);
    let la = l0.checked_add(h.local.0)?;
    let le = l1.checked_add(h.local.1)?;
    let ra = r0.checked_add(h.remote.0)?;
    let re = r1.checked_add(h.remote.1)?;
    // Spans are not empty (every range has a length), so the ends lie past the starts.
    let region = local(la, le.checked_sub(la)?)?;
    let buffer = remote(ra, re.checked_sub(ra)?)?;
    Some((region, buffer))
}

/// The lowest and highest base of `blocks` (local, remote) pairs, per side: `((local low,
/// local high), (remote low, remote high))`; `((u64::MAX, 0), (u64::MAX, 0))` when empty. The
/// hull of the blocks' spans starts at a low base and ends past a high one.
pub(crate) fn base_bounds(blocks: &[(u64, u64)]) -> ((u64, u64), (u64, u64)) {
    blocks.iter().fold(
        ((u64::MAX, 0), (u64::MAX, 0)),
        |((l0, l1), (r0, r1)), &(lb, rb)| ((l0.min(lb), l1.max(lb)), (r0.min(rb), r1.max(rb))),
    )
}

fn overflow(base: u64, offset: u64) -> TransferError {
    TransferError::InvalidArgument(ArgumentError::StridedOverflow { base, offset })
}

/// Every request's copies, in order (`StridedRequest::copies`).
pub(crate) fn expand(requests: &[StridedRequest]) -> Result<Vec<TransferRequest>> {
    let mut out = Vec::new();
    for r in requests {
        out.extend(r.copies()?);
    }
    Ok(out)
}

#[cfg(test)]
#[path = "strided_tests.rs"]
mod tests;
