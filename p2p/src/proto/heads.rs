//! The head map (docs/design.md §4 "Ranks", §2.3 replicas): which rank holds which global KV
//! heads of which layer. TP splits a layer's KV heads among ranks, or replicates them when
//! the KV heads are fewer than the TP ranks (GQA with a large TP, MLA's single latent head),
//! and PP splits the layers; the producer's planner and the CLI's side comparison both ask
//! this one map who holds head `h` of layer `name`.

use std::collections::BTreeMap;

use kvferry_checksum::group::LayerSpec;

/// One rank's array of one layer: where it sits in the caller's lists, and its spec (name,
/// first global head `head_offset`, `geometry.heads` heads).
#[derive(Debug, Clone, Copy)]
pub struct Holder<'a> {
    /// Index of the rank in the caller's rank list.
    pub rank: usize,
    /// Index of the layer in that rank's layer list.
    pub layer: usize,
    /// The layer as the rank holds it.
    pub spec: &'a LayerSpec,
}

impl Holder<'_> {
    /// First global KV head held.
    pub fn first(&self) -> u64 {
        self.spec.head_offset as u64
    }

    /// One past the last global KV head held.
    pub fn end(&self) -> u64 {
        self.first().saturating_add(self.spec.geometry.heads)
    }

    /// Whether global KV head `h` is among the held heads.
    pub fn holds(&self, h: u64) -> bool {
        h >= self.first() && h < self.end()
    }
}

/// Layer name → the ranks' arrays of that layer, in the order they were given.
#[derive(Debug, Clone, Default)]
pub struct HeadMap<'a> {
    layers: BTreeMap<&'a str, Vec<Holder<'a>>>,
}

impl<'a> HeadMap<'a> {
    /// Builds the map from every (rank, layer) array of one side, e.g. one KV cache group of
    /// each TP/PP rank. The order of `holders` fixes the order replicas are picked in.
    pub fn new(holders: impl IntoIterator<Item = Holder<'a>>) -> HeadMap<'a> {
        let mut layers: BTreeMap<&'a str, Vec<Holder<'a>>> = BTreeMap::new();
        for h in holders {
            layers.entry(h.spec.name.as_str()).or_default().push(h);
        }
        HeadMap { layers }
    }

    /// The map of `ranks`, each given as its list of layer specs.
    pub fn of_ranks<R, L>(ranks: R) -> HeadMap<'a>
    where
        R: IntoIterator<Item = L>,
        L: IntoIterator<Item = &'a LayerSpec>,
    {
        HeadMap::new(ranks.into_iter().enumerate().flat_map(|(rank, layers)| {
            layers
                .into_iter()
                .enumerate()
                .map(move |(layer, spec)| Holder { rank, layer, spec })
        }))
    }

    /// Layer names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.layers.keys().copied()
    }

    /// Number of distinct layers the map holds.
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// Every array of layer `name` (empty when no rank holds it).
    pub fn holders(&self, name: &str) -> &[Holder<'a>] {
        self.layers.get(name).map_or(&[], Vec::as_slice)
    }

    /// One past the highest global KV head of layer `name` any rank holds (0: none).
    pub fn heads_end(&self, name: &str) -> u64 {
        self.holders(name)
            .iter()
            .map(Holder::end)
            .max()
            .unwrap_or(0)
    }

    /// The array a reader at TP rank `tp_rank` takes global KV head `head` of layer `name`
    /// from: of the `n` arrays holding it, the `(tp_rank mod n)`-th (rank to rank when both
    /// sides have the same TP size). `None` when no rank holds the head.
    pub fn pick(&self, name: &str, head: u64, tp_rank: u32) -> Option<Holder<'a>> {
        pick_from(self.holders(name), head, tp_rank)
    }
}

/// [`HeadMap::pick`] among `holders`, the arrays of one layer ([`HeadMap::holders`]): for a
/// caller that picks many heads of one layer and looks the layer up once.
pub fn pick_from<'a>(holders: &[Holder<'a>], head: u64, tp_rank: u32) -> Option<Holder<'a>> {
    let n = holders.iter().filter(|h| h.holds(head)).count();
    if n == 0 {
        return None;
    }
    holders
        .iter()
        .filter(|h| h.holds(head))
        .nth(tp_rank as usize % n)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};

    fn spec(name: &str, head_offset: u32, heads: u64) -> LayerSpec {
        let g = Geometry::contiguous(
            Layout::parse("KV B N H D").unwrap(),
            4,
            4,
            heads,
            8,
            ElemBytes::new(2).unwrap(),
            1,
        )
        .unwrap();
        LayerSpec {
            name: name.into(),
            layer: 0,
            head_offset,
            geometry: g,
            kind: None,
            dtype: None,
            replica: kvferry_checksum::group::ReplicaKey::NONE,
        }
    }

    #[test]
    fn split_heads_have_one_holder_each() {
        // TP 2 over 4 heads: rank 0 holds 0..2, rank 1 holds 2..4.
        let ranks = [vec![spec("l0", 0, 2)], vec![spec("l0", 2, 2)]];
        let m = HeadMap::of_ranks(ranks.iter().map(|r| r.iter()));
        assert_eq!(m.heads_end("l0"), 4);
        for (h, want) in [(0, 0), (1, 0), (2, 1), (3, 1)] {
            for tp in 0..4 {
                assert_eq!(m.pick("l0", h, tp).unwrap().rank, want);
            }
        }
        assert!(m.pick("l0", 4, 0).is_none());
        assert!(m.pick("l1", 0, 0).is_none());
        assert_eq!(m.heads_end("l1"), 0);
    }

    #[test]
    fn replicas_are_taken_round_robin_by_tp_rank() {
        // TP 4 over 2 heads: ranks 0,1 hold head 0; ranks 2,3 hold head 1.
        let ranks = [
            vec![spec("l0", 0, 1)],
            vec![spec("l0", 0, 1)],
            vec![spec("l0", 1, 1)],
            vec![spec("l0", 1, 1)],
        ];
        let m = HeadMap::of_ranks(ranks.iter().map(|r| r.iter()));
        let picks: Vec<usize> = (0..4).map(|tp| m.pick("l0", 0, tp).unwrap().rank).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
        let picks: Vec<usize> = (0..4).map(|tp| m.pick("l0", 1, tp).unwrap().rank).collect();
        assert_eq!(picks, [2, 3, 2, 3]);
    }

    #[test]
    fn layers_of_pp_stages_map_to_their_stage() {
        let ranks = [
            vec![spec("l0", 0, 2)],
            vec![spec("l1", 0, 2), spec("l2", 0, 2)],
        ];
        let m = HeadMap::of_ranks(ranks.iter().map(|r| r.iter()));
        assert_eq!(m.names().collect::<Vec<_>>(), ["l0", "l1", "l2"]);
        let h = m.pick("l2", 1, 0).unwrap();
        assert_eq!((h.rank, h.layer), (1, 1));
    }
}
