//! A side's block allocator for the demo and the two roles (docs/design.md §6): a fixed set of
//! block ids handed out scattered, as a serving engine's allocator does after a while.

use rand::SeedableRng;

/// A fixed pool of block ids (a side's block allocator), handing out scattered ids.
pub struct BlockPool {
    free: Vec<u64>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, shuffled with `seed` so requests get scattered blocks.
    pub fn new(num_blocks: u64, seed: u64) -> BlockPool {
        use rand::seq::SliceRandom;
        let mut free: Vec<u64> = (0..num_blocks).collect();
        free.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed));
        BlockPool { free }
    }

    /// As [`BlockPool::new`], or `None` when the `num_blocks` ids (8 bytes each) cannot be
    /// allocated: a block count taken from flags (requests times tokens) can ask for more
    /// than any machine holds, which `new` would abort on.
    pub fn try_new(num_blocks: u64, seed: u64) -> Option<BlockPool> {
        use rand::seq::SliceRandom;
        let mut free: Vec<u64> = Vec::new();
        free.try_reserve_exact(usize::try_from(num_blocks).ok()?)
            .ok()?;
        free.extend(0..num_blocks);
        free.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed));
        Some(BlockPool { free })
    }

    /// Takes `n` blocks, or `None` when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u64>> {
        if n > self.free.len() {
            return None;
        }
        Some(self.free.split_off(self.free.len() - n))
    }

    /// Returns blocks to the pool.
    pub fn free(&mut self, blocks: &[u64]) {
        self.free.extend_from_slice(blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_too_large_to_allocate_is_none_not_an_abort() {
        assert!(BlockPool::try_new(u64::MAX, 1).is_none());
        assert!(BlockPool::try_new(1 << 61, 1).is_none());
        let mut p = BlockPool::try_new(4, 1).unwrap();
        let mut got = p.alloc(4).unwrap();
        got.sort_unstable();
        assert_eq!(got, vec![0, 1, 2, 3]);
    }

    #[test]
    fn pool_hands_out_distinct_blocks() {
        let mut p = BlockPool::new(10, 3);
        let a = p.alloc(4).unwrap();
        let b = p.alloc(6).unwrap();
        assert!(p.alloc(1).is_none());
        let mut all: Vec<_> = a.iter().chain(&b).copied().collect();
        all.sort();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        p.free(&a);
        assert_eq!(p.alloc(4).unwrap().len(), 4);
    }
}
