//! A load's progress, layer group by layer group (docs/design.md §4.9): the producer cuts a
//! large load's copies at layer boundaries into a few groups by bytes, submits them in order and
//! says on a CONTINUE reply ([`super::msg::Reply::landed`]) which layers have landed as each
//! group's copies complete, so that the consumer checksums those layers while the later ones
//! are still being copied. The FINISH still ends the load: the consumer verifies the layers no
//! progress named after it, and compares once.
//!
//! Layers are named by their *slot*: their index in the request's layers in the order the
//! producer plans them ([`layer_slots`]: each consumer rank of the request in turn, each group of
//! the request's `blocks` in turn, each of that rank's layers of the group in turn). A progress
//! reply names a span `[first, end)` of slots; one load's spans follow each other from slot 0
//! ([`check_progress`]), so every layer is named at most once and never before the ones planned
//! ahead of it.

use std::ops::Range;

use super::layout::RankLayout;
use super::msg::{LayerSpan, LoadRequest, WireBlocks};

/// One layer of a request: where it sits in the request's lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Index of the consumer rank in the request's `ranks` (the consumer's worker index).
    pub rank: usize,
    /// The KV cache group.
    pub group_id: u32,
    /// Index of the layer in the rank's layers of the group (`WireRankGroup::layers`).
    pub layer: usize,
}

/// The layers of `req` in slot order (what [`super::serve::plan`] numbers them by). A rank that
/// does not hold a group of `blocks` contributes no slot for it (the plan refuses such a
/// request).
pub fn layer_slots(req: &LoadRequest) -> Vec<Slot> {
    slots_by(req.ranks.len(), &req.blocks, |rank, group| {
        let groups = &req.ranks.get(rank)?.groups;
        Some(groups.iter().find(|g| g.group_id == group)?.layers.len())
    })
}

/// [`layer_slots`] of a request with `blocks` into `ranks` (this side's layouts, which its
/// `ranks` are built from: [`super::request::wire_ranks`]), without building them.
pub fn layer_slots_of(ranks: &[RankLayout], blocks: &[WireBlocks]) -> Vec<Slot> {
    slots_by(ranks.len(), blocks, |rank, group| {
        Some(ranks.get(rank)?.group(group)?.layers.len())
    })
}

/// The slots of `ranks` ranks over `blocks`' groups in slot order, `layers(rank, group)` being
/// how many layers of the group the rank holds (`None`: it does not hold the group).
fn slots_by(
    ranks: usize,
    blocks: &[WireBlocks],
    layers: impl Fn(usize, u32) -> Option<usize>,
) -> Vec<Slot> {
    let mut slots = Vec::new();
    for rank in 0..ranks {
        for b in blocks {
            let Some(n) = layers(rank, b.group_id) else {
                continue;
            };
            slots.extend((0..n).map(|layer| Slot {
                rank,
                group_id: b.group_id,
                layer,
            }));
        }
    }
    slots
}

/// Why a progress reply cannot be taken ([`check_progress`]): the peer names layers it cannot
/// have landed in this order. The load's early checksums are then dropped and every layer is
/// verified after the FINISH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProgressError {
    /// A span without a layer (`end <= first`).
    #[error("progress names the empty layer span [{first}, {end})")]
    Empty {
        /// The span's first slot.
        first: u32,
        /// One past its last.
        end: u32,
    },
    /// A span past the request's layers.
    #[error("progress names layers [{first}, {end}) of a request of {slots} layers")]
    OutOfRange {
        /// The span's first slot.
        first: u32,
        /// One past its last.
        end: u32,
        /// Layers of the request.
        slots: u32,
    },
    /// A span that names layers an earlier progress named.
    #[error("progress names layers [{first}, {end}) again: layers below {landed} already landed")]
    Twice {
        /// The span's first slot.
        first: u32,
        /// One past its last.
        end: u32,
        /// One past the last layer named before.
        landed: u32,
    },
    /// A span that skips layers planned before it.
    #[error("progress names layers [{first}, {end}) out of order: layers from {landed} did not land yet")]
    OutOfOrder {
        /// The span's first slot.
        first: u32,
        /// One past its last.
        end: u32,
        /// One past the last layer named before.
        landed: u32,
    },
}

/// Checks the progress `span` of a load of `slots` layers whose layers below `landed` were named
/// before: it must start at `landed` and end past it, within the request. Returns the new
/// `landed` (the span's end). Errors: [`ProgressError`].
pub fn check_progress(landed: u32, slots: u32, span: LayerSpan) -> Result<u32, ProgressError> {
    let LayerSpan { first, end } = span;
    if end <= first {
        return Err(ProgressError::Empty { first, end });
    }
    if end > slots {
        return Err(ProgressError::OutOfRange { first, end, slots });
    }
    if first < landed {
        return Err(ProgressError::Twice { first, end, landed });
    }
    if first > landed {
        return Err(ProgressError::OutOfOrder { first, end, landed });
    }
    Ok(end)
}

/// Default bytes of one layer group: a load of less than twice this is copied in one group
/// (no progress reply, nothing extra to pay); larger ones in up to [`MAX_LAYER_GROUPS`].
pub const DEFAULT_LAYER_GROUP_BYTES: u64 = 64 << 20;

/// Most layer groups a load is cut into: each costs a batch submit, a wait and a reply.
pub const MAX_LAYER_GROUPS: u64 = 4;

/// Cuts the slots `0..slot_bytes.len()` (`slot_bytes[i]`: the bytes layer slot `i` copies) into
/// contiguous groups of about equal bytes: `total / group_bytes` groups (at least 1, at most
/// [`MAX_LAYER_GROUPS`] and the number of slots; 1 when `group_bytes` is 0). Each group is
/// non-empty, and together they cover every slot once, in order.
pub fn layer_groups(slot_bytes: &[u64], group_bytes: u64) -> Vec<Range<u32>> {
    let n = slot_bytes.len().min(u32::MAX as usize) as u32;
    let total: u128 = slot_bytes.iter().map(|&b| b as u128).sum();
    let groups = match group_bytes {
        0 => 1,
        g => (total / g as u128).clamp(1, MAX_LAYER_GROUPS as u128) as u32,
    }
    .min(n.max(1));
    let mut out = Vec::with_capacity(groups as usize);
    let (mut start, mut sum) = (0u32, 0u128);
    for (i, &b) in slot_bytes.iter().enumerate().take(n as usize) {
        sum += b as u128;
        let k = out.len() as u128 + 1;
        let (i, left) = (i as u32 + 1, groups as usize - out.len() - 1);
        // Cut once this group holds its share, leaving a slot for each group still to come
        // (and at the latest when only that many are left).
        let (share, room) = (sum * groups as u128 >= k * total, n - i);
        if left > 0 && (room == left as u32 || (share && room >= left as u32)) {
            out.push(start..i);
            start = i;
        }
    }
    out.push(start..n);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_must_follow_on_from_what_landed() {
        let span = |first, end| LayerSpan { first, end };
        assert_eq!(check_progress(0, 32, span(0, 8)), Ok(8));
        assert_eq!(check_progress(8, 32, span(8, 32)), Ok(32));
        assert_eq!(
            check_progress(8, 32, span(8, 8)),
            Err(ProgressError::Empty { first: 8, end: 8 })
        );
        assert_eq!(
            check_progress(8, 32, span(8, 33)),
            Err(ProgressError::OutOfRange {
                first: 8,
                end: 33,
                slots: 32
            })
        );
        assert_eq!(
            check_progress(8, 32, span(4, 12)),
            Err(ProgressError::Twice {
                first: 4,
                end: 12,
                landed: 8
            })
        );
        assert_eq!(
            check_progress(8, 32, span(9, 12)),
            Err(ProgressError::OutOfOrder {
                first: 9,
                end: 12,
                landed: 8
            })
        );
    }

    #[test]
    fn groups_by_bytes_cover_every_slot_once() {
        const M: u64 = 1 << 20;
        // A small load: one group, nothing extra.
        assert_eq!(layer_groups(&[M; 32], 64 * M), vec![0..32]);
        assert_eq!(layer_groups(&[], 64 * M), vec![0..0]);
        assert_eq!(layer_groups(&[M; 32], 0), vec![0..32]);
        // 512 MiB over 32 layers: 4 groups of 8.
        assert_eq!(
            layer_groups(&[16 * M; 32], 64 * M),
            vec![0..8, 8..16, 16..24, 24..32]
        );
        // 128 MiB: 2 groups.
        assert_eq!(layer_groups(&[4 * M; 32], 64 * M), vec![0..16, 16..32]);
        // Fewer slots than groups: one each.
        assert_eq!(layer_groups(&[400 * M; 2], 64 * M), vec![0..1, 1..2]);
        // Uneven layers: every group non-empty, contiguous, covering all.
        for bytes in [
            vec![300 * M, M, M, M, M],
            vec![M, M, M, M, 300 * M],
            vec![0, 0, 200 * M, 0, 0, 100 * M],
        ] {
            let g = layer_groups(&bytes, 64 * M);
            assert!(g.len() > 1 && g.len() as u64 <= MAX_LAYER_GROUPS);
            assert_eq!(g.first().unwrap().start, 0);
            assert_eq!(g.last().unwrap().end, bytes.len() as u32);
            assert!(g.iter().all(|r| r.start < r.end), "{g:?}");
            assert!(g.windows(2).all(|w| w[0].end == w[1].start), "{g:?}");
        }
    }
}
