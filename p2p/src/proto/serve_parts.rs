//! A rank plan cut at layer boundaries (docs/design.md §4.9): the bytes each layer slot
//! copies, and the part of a plan that copies a span of slots, so that the producer submits a
//! large load in layer groups and reports each as it lands (`proto::progress`).

use std::ops::Range;

use crate::proto::serve::{push_run, BlockCopies, RankPlan};

/// The items of `runs` (`(slot, items)` in order) whose slot lies in `slots`, as a range of
/// item indices, and their runs.
fn runs_in(runs: &[(u32, usize)], slots: &Range<u32>) -> (Range<usize>, Vec<(u32, usize)>) {
    let (mut at, mut first, mut end) = (0usize, None, 0usize);
    let mut kept = Vec::new();
    for &(slot, n) in runs {
        if slots.contains(&slot) {
            first.get_or_insert(at);
            end = at + n;
            kept.push((slot, n));
        }
        at += n;
    }
    let first = first.unwrap_or(0);
    (first..end.max(first), kept)
}

impl RankPlan {
    /// Adds the bytes this plan copies for each layer slot to `bytes[slot]` (slots past its end
    /// are left out).
    pub fn add_slot_bytes(&self, bytes: &mut [u64]) {
        for s in &self.strided {
            let per = s.ranges.iter().fold(0u64, |a, r| a.saturating_add(r.len));
            for &(slot, n) in &s.layers {
                if let Some(b) = bytes.get_mut(slot as usize) {
                    *b = b.saturating_add(per.saturating_mul(n as u64));
                }
            }
        }
        let mut copies = self.copies.iter();
        for &(slot, n) in &self.copy_layers {
            let sum = copies
                .by_ref()
                .take(n)
                .fold(0u64, |a, c| a.saturating_add(c.len));
            if let Some(b) = bytes.get_mut(slot as usize) {
                *b = b.saturating_add(sum);
            }
        }
    }

    /// The copies of this plan that fill the layers of `slots`, in the same order (a plan's
    /// slots ascend through each of its lists, so they are one run of each).
    pub fn layer_part(&self, slots: &Range<u32>) -> RankPlan {
        let (copies, copy_layers) = runs_in(&self.copy_layers, slots);
        let strided = self
            .strided
            .iter()
            .filter_map(|s| {
                let (blocks, layers) = runs_in(&s.layers, slots);
                (!blocks.is_empty()).then(|| BlockCopies {
                    ranges: s.ranges.clone(),
                    blocks: s.blocks[blocks].to_vec(),
                    layers,
                })
            })
            .collect();
        let mut part = RankPlan {
            rank: self.rank,
            segment: self.segment.clone(),
            copies: self.copies[copies].to_vec(),
            copy_layers: Vec::new(),
            strided,
        };
        for (slot, n) in copy_layers {
            push_run(&mut part.copy_layers, slot, n);
        }
        part
    }

    /// Whether the plan copies nothing.
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty() && self.strided.iter().all(BlockCopies::is_empty)
    }
}
