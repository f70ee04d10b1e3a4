//! Which blocks each side checksums (docs/design.md §2.5, the seed's "Which blocks").
//!
//! `blocks[i]` is the block at position `i` of the request (tokens `[i·block_size,
//! (i+1)·block_size)`), `None` a null block (outside a sliding window).

/// The blocks of one group a side checksums: `block_ids[i]` is at position `start + i`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct BlockSelection {
    /// Position of `block_ids[0]` in the request.
    pub start: u64,
    /// Logical block ids, one per position from `start`.
    pub block_ids: Vec<u64>,
}

impl BlockSelection {
    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.block_ids.len()
    }

    /// Whether no block is selected.
    pub fn is_empty(&self) -> bool {
        self.block_ids.is_empty()
    }
}

fn div_ceil(a: u64, b: u64) -> u64 {
    a / b + u64::from(!a.is_multiple_of(b))
}

/// Positions `[first, end)` of `blocks` clipped by the window, then leading nulls dropped; a null
/// after a non-null leaves the group out (`None`), as does an empty result or missing blocks.
fn pick(
    blocks: &[Option<u64>],
    first: u64,
    end: u64,
    block_size: u64,
    window: Option<u64>,
) -> Option<BlockSelection> {
    if end > blocks.len() as u64 {
        return None;
    }
    let mut first = first;
    if let Some(w) = window {
        let keep = div_ceil(w, block_size) + 1;
        first = first.max(end.saturating_sub(keep));
    }
    let mut start = None;
    let mut ids = Vec::new();
    for pos in first..end {
        match (blocks[pos as usize], start) {
            (None, None) => {}
            (None, Some(_)) => return None,
            (Some(id), s) => {
                if s.is_none() {
                    start = Some(pos);
                }
                ids.push(id);
            }
        }
    }
    start.map(|start| BlockSelection {
        start,
        block_ids: ids,
    })
}

/// Producer side: the blocks holding tokens `[0, num_tokens)`; sliding-window groups keep their
/// last `⌈window/block_size⌉+1`; leading nulls dropped. `None` (group left out) when a null
/// follows a non-null, nothing remains, `blocks` is too short or `block_size` is 0.
pub fn producer_blocks(
    blocks: &[Option<u64>],
    num_tokens: u64,
    block_size: u64,
    sliding_window: Option<u64>,
) -> Option<BlockSelection> {
    if block_size == 0 {
        return None;
    }
    pick(
        blocks,
        0,
        div_ceil(num_tokens, block_size),
        block_size,
        sliding_window,
    )
}

/// Consumer side: the blocks a load writes, tokens `[num_local_computed, num_computed)` (a local
/// prefix hit is not compared); the window clip and null rules of [`producer_blocks`] apply.
pub fn consumer_blocks(
    blocks: &[Option<u64>],
    num_local_computed: u64,
    num_computed: u64,
    block_size: u64,
    sliding_window: Option<u64>,
) -> Option<BlockSelection> {
    if block_size == 0 || num_local_computed >= num_computed {
        return None;
    }
    pick(
        blocks,
        num_local_computed / block_size,
        div_ceil(num_computed, block_size),
        block_size,
        sliding_window,
    )
}
