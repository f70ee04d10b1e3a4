//! Block 0's paired ranges for the producer's plan ([`crate::proto::serve::plan`]), worked
//! out once per pair of array shapes rather than once per layer.

use std::ops::Range;

use kvferry_checksum::layout::Geometry;

use crate::proto::plan::{pair_ranges, Copy, PlanError};

/// Block 0's paired ranges of the last few (producer geometry, producer heads, consumer
/// geometry, consumer heads) seen: every layer of a model pairs alike, so they are worked out
/// once per pair of arrays' shapes, not once per layer (with TP sizes that differ, a layer
/// pairs one consumer array with several producer ranks' in turn: several entries, not one).
#[derive(Default)]
pub(crate) struct RangeCache {
    entries: Vec<(RangeKey, Vec<Copy>)>,
}

/// What block 0's paired ranges depend on.
#[derive(PartialEq, Eq)]
struct RangeKey {
    ours: Geometry,
    ph: Range<u64>,
    theirs: Geometry,
    ch: Range<u64>,
}

impl RangeCache {
    /// Entries kept: a consumer layer takes its heads from one producer array per producer
    /// rank holding them, in turn, and every layer does the same; the cache holds that cycle
    /// up to 64 producer ranks (past that, the oldest entry goes, and each layer works its
    /// ranges out again: slower, not wrong). Each lookup compares at most this many keys.
    const ENTRIES: usize = 64;

    /// Block 0's ranges of `ours`' heads `ph` paired with `theirs`' heads `ch`
    /// ([`pair_ranges`]), from the cache or worked out and cached. Errors: as [`pair_ranges`].
    pub(crate) fn pair(
        &mut self,
        ours: &Geometry,
        ph: &Range<u64>,
        theirs: &Geometry,
        ch: &Range<u64>,
    ) -> Result<&[Copy], PlanError> {
        let hit = self.entries.iter().position(|(k, _)| {
            k.ph == *ph && k.ch == *ch && k.ours == *ours && k.theirs == *theirs
        });
        let at = match hit {
            Some(at) => at,
            None => {
                let (ours0, theirs0) = (
                    ours.block_head_byte_ranges(0, ph.clone()),
                    theirs.block_head_byte_ranges(0, ch.clone()),
                );
                let mut ranges = Vec::new();
                pair_ranges(0, &ours0, 0, &theirs0, &mut ranges)?;
                if self.entries.len() == Self::ENTRIES {
                    self.entries.remove(0);
                }
                let key = RangeKey {
                    ours: ours.clone(),
                    ph: ph.clone(),
                    theirs: theirs.clone(),
                    ch: ch.clone(),
                };
                self.entries.push((key, ranges));
                self.entries.len() - 1
            }
        };
        Ok(&self.entries[at].1)
    }
}
