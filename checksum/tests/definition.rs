//! The definition (docs/design.md §2.1) and layout model (§2.2): the fast form against the direct
//! form and against an oracle computed from logical KV, over random geometries; the properties
//! the seed claims (any single piece change detected, swaps detected, blocks add up, slots past
//! num_tokens ignored); block byte ranges.

use kvferry_checksum::definition::{
    can_read, head_factor, layer_block_checksum, layer_block_checksum_direct, slice_checksum,
    slice_checksum_direct, MAX_KV_HEADS_PER_LAYER,
};
use kvferry_checksum::group::{LayerSpec, ReplicaKey};
use kvferry_checksum::layout::{Dim, ElemBytes, Geometry, Layout, LayoutError, StrideFault};
use proptest::prelude::*;

fn spec(layer: u32, head_offset: u32, geometry: Geometry) -> LayerSpec {
    LayerSpec {
        name: format!("model.layers.{layer}.self_attn.attn"),
        layer,
        head_offset,
        geometry,
        kind: None,
        dtype: None,
        replica: ReplicaKey::NONE,
    }
}

/// Logical KV of one layer: `elem(token_slot_global, head, part, d)` for slot
/// (kernel block, token) and head; stored independently of any Geometry code.
#[derive(Debug, Clone)]
struct Logical {
    b: u64,
    n: u64,
    h: u64,
    d: u64,
    parts: u64,
    elem: usize,
    data: Vec<u8>, // [b][n][h][part][d][elem]
}

impl Logical {
    fn random(b: u64, n: u64, h: u64, d: u64, parts: u64, elem: usize, seed: u64) -> Logical {
        let len = (b * n * h * parts * d) as usize * elem;
        let mut z = seed;
        let data = (0..len)
            .map(|_| {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (z >> 33) as u8
            })
            .collect();
        Logical {
            b,
            n,
            h,
            d,
            parts,
            elem,
            data,
        }
    }
    fn at(&self, kb: u64, t: u64, h: u64, part: u64, d: u64) -> usize {
        ((((kb * self.n + t) * self.h + h) * self.parts + part) * self.d + d) as usize * self.elem
    }
    /// The C-contiguous array in `dims` order (index math written here, not Geometry's).
    fn to_array(&self, dims: &[Dim]) -> Vec<u8> {
        let size = |d: Dim| match d {
            Dim::Kv => 2,
            Dim::B => self.b,
            Dim::N => self.n,
            Dim::H => self.h,
            Dim::D => self.d,
        };
        let mut out = vec![0u8; self.data.len()];
        for kb in 0..self.b {
            for t in 0..self.n {
                for h in 0..self.h {
                    for part in 0..self.parts {
                        for d in 0..self.d {
                            let mut idx = 0u64;
                            for &dim in dims {
                                let i = match dim {
                                    Dim::Kv => part,
                                    Dim::B => kb,
                                    Dim::N => t,
                                    Dim::H => h,
                                    Dim::D => d,
                                };
                                idx = idx * size(dim) + i;
                            }
                            let o = idx as usize * self.elem;
                            let s = self.at(kb, t, h, part, d);
                            out[o..o + self.elem].copy_from_slice(&self.data[s..s + self.elem]);
                        }
                    }
                }
            }
        }
        out
    }
    /// §2.1 from the logical KV: logical block `block_id` of `kpb` kernel blocks at `position`.
    fn oracle(
        &self,
        layer: u32,
        head_offset: u32,
        kpb: u64,
        block_id: u64,
        position: u64,
        num_tokens: u64,
    ) -> u64 {
        let bs = kpb * self.n;
        let p = (self.parts * self.d) as usize * self.elem / 8;
        let mut c = 0u64;
        for h in 0..self.h {
            let mut s = 0u64;
            for t in 0..bs {
                let tok = position * bs + t;
                if tok >= num_tokens {
                    continue;
                }
                let (kb, tt) = (block_id * kpb + t / self.n, t % self.n);
                let mut cell = Vec::new();
                for part in 0..self.parts {
                    for d in 0..self.d {
                        let at = self.at(kb, tt, h, part, d);
                        cell.extend_from_slice(&self.data[at..at + self.elem]);
                    }
                }
                for (i, piece) in cell.chunks(8).enumerate() {
                    let x = u64::from_le_bytes(piece.try_into().unwrap());
                    s = s.wrapping_add(x.wrapping_mul(2 * (tok * p as u64 + i as u64) + 1));
                }
            }
            let m = 2 * (layer as u64 * 65536 + head_offset as u64 + h) + 1;
            c = c.wrapping_add(m.wrapping_mul(s));
        }
        c
    }
}

/// A random permutation of dims: B, N, D always; KV when `parts == 2`; H when `with_h`.
fn dims_strategy() -> impl Strategy<Value = (Vec<Dim>, bool, bool)> {
    (any::<bool>(), any::<bool>(), any::<u64>()).prop_map(|(kv, with_h, seed)| {
        let mut dims = vec![Dim::B, Dim::N, Dim::D];
        if kv {
            dims.push(Dim::Kv);
        }
        if with_h {
            dims.push(Dim::H);
        }
        let mut z = seed;
        for i in (1..dims.len()).rev() {
            z = z.wrapping_mul(6364136223846793005).wrapping_add(1);
            dims.swap(i, (z >> 33) as usize % (i + 1));
        }
        (dims, kv, with_h)
    })
}

#[derive(Debug, Clone)]
struct Case {
    dims: Vec<Dim>,
    logical: Logical,
    kpb: u64,
    elem: ElemBytes,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        dims_strategy(),
        0usize..4,
        1u64..4,
        1u64..5,
        1u64..4,
        1u64..7,
        1u64..3,
        any::<u64>(),
    )
        .prop_filter_map(
            "whole pieces",
            |((dims, kv, with_h), e, blocks, n, h, d, kpb, seed)| {
                let elem = [
                    ElemBytes::One,
                    ElemBytes::Two,
                    ElemBytes::Four,
                    ElemBytes::Eight,
                ][e];
                let parts = if kv { 2 } else { 1 };
                let h = if with_h { h } else { 1 };
                if !(parts * d * elem.get()).is_multiple_of(8) {
                    return None;
                }
                let logical =
                    Logical::random(blocks * kpb, n, h, d, parts, elem.get() as usize, seed);
                Some(Case {
                    dims,
                    logical,
                    kpb,
                    elem,
                })
            },
        )
}

impl Case {
    fn geometry(&self) -> Geometry {
        let l = &self.logical;
        Geometry::contiguous(
            Layout::from_dims(self.dims.clone()).unwrap(),
            l.b,
            l.n,
            l.h,
            l.d,
            self.elem,
            self.kpb,
        )
        .unwrap()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn fast_slice_form_equals_direct(pieces in proptest::collection::vec(any::<u64>(), 0..70), j0 in any::<u64>()) {
        prop_assert_eq!(slice_checksum(&pieces, j0), slice_checksum_direct(&pieces, j0));
    }

    #[test]
    fn layer_value_equals_oracle_in_any_layout(c in case_strategy(), layer in 0u32..100, head_offset in 0u32..64, extra in 0u64..40) {
        let g = c.geometry();
        let bytes = c.logical.to_array(&c.dims);
        prop_assert_eq!(g.byte_len() as usize, bytes.len());
        let s = spec(layer, head_offset, g.clone());
        let bs = g.block_size();
        for block_id in 0..g.num_blocks() {
            for position in [0, 1, 5] {
                let num_tokens = position * bs + extra % (bs + 2);
                let want = c.logical.oracle(layer, head_offset, c.kpb, block_id, position, num_tokens);
                prop_assert_eq!(layer_block_checksum(&s, &bytes, block_id, position, num_tokens), want);
                prop_assert_eq!(layer_block_checksum_direct(&s, &bytes, block_id, position, num_tokens), want);
            }
        }
    }

    #[test]
    fn padded_strides_give_the_same_values(c in case_strategy(), pad in proptest::collection::vec(0u64..3, 5)) {
        // Each dim's stride grows by pad·elem·(inner span): the array gets gaps filled with junk.
        let g = c.geometry();
        let dims = c.dims.clone();
        let elem = c.elem.get();
        let mut strides = vec![0u64; dims.len()];
        let mut span = elem;
        for i in (0..dims.len()).rev() {
            strides[i] = span + pad[i] * elem;
            span = strides[i] * g.size_of(dims[i]);
        }
        let gs = g.clone().with_strides(strides).unwrap();
        let dense = c.logical.to_array(&dims);
        let mut sparse = vec![0xA5u8; gs.byte_len() as usize];
        for kb in 0..g.num_kernel_blocks { for t in 0..g.tokens_per_kernel_block { for h in 0..g.heads {
            for part in 0..g.parts() { for d in 0..g.head_dim {
                let (a, b) = (g.byte_offset(part, kb, t, h, d) as usize, gs.byte_offset(part, kb, t, h, d) as usize);
                sparse[b..b + elem as usize].copy_from_slice(&dense[a..a + elem as usize]);
            }}
        }}}
        let (s1, s2) = (spec(3, 1, g.clone()), spec(3, 1, gs));
        for block_id in 0..g.num_blocks() {
            let n = g.block_size() * 2 - 1;
            prop_assert_eq!(layer_block_checksum(&s2, &sparse, block_id, 1, n), layer_block_checksum(&s1, &dense, block_id, 1, n));
            prop_assert_eq!(layer_block_checksum_direct(&s2, &sparse, block_id, 1, n), layer_block_checksum(&s1, &dense, block_id, 1, n));
        }
    }

    #[test]
    fn any_single_changed_piece_changes_the_value(c in case_strategy(), which in any::<u64>(), delta in 1u8..=255) {
        let g = c.geometry();
        let bs = g.block_size();
        let num_tokens = bs * 3 - 1; // block at position 2 is partial
        let s = spec(7, 2, g.clone());
        let mut logical = c.logical.clone();
        let before: Vec<u64> = (0..g.num_blocks()).map(|b| layer_block_checksum(&s, &logical.to_array(&c.dims), b, 2, num_tokens)).collect();
        // Change one byte of one element of a slot inside the tokens of block `b`.
        let elem_count = logical.data.len() as u64 / c.elem.get();
        let e = which % elem_count;
        let byte = (e * c.elem.get() + (which >> 40) % c.elem.get()) as usize;
        logical.data[byte] = logical.data[byte].wrapping_add(delta);
        let per_slot = g.heads * g.parts() * g.head_dim;
        let slot = e / per_slot; // kb * n + t
        let (kb, t) = (slot / g.tokens_per_kernel_block, slot % g.tokens_per_kernel_block);
        let block = kb / c.kpb;
        let tok_in_block = (kb % c.kpb) * g.tokens_per_kernel_block + t;
        let counted = 2 * bs + tok_in_block < num_tokens;
        let after: Vec<u64> = (0..g.num_blocks()).map(|b| layer_block_checksum(&s, &logical.to_array(&c.dims), b, 2, num_tokens)).collect();
        for b in 0..g.num_blocks() {
            if b == block && counted {
                prop_assert_ne!(before[b as usize], after[b as usize]);
            } else {
                prop_assert_eq!(before[b as usize], after[b as usize], "slot past num_tokens or other block");
            }
        }
    }
}

#[test]
fn swapped_tokens_heads_and_layers_change_the_value() {
    let layout = Layout::parse("KV B N H D").unwrap();
    let g = Geometry::contiguous(layout, 2, 8, 4, 8, ElemBytes::Two, 1).unwrap();
    let logical = Logical::random(2, 8, 4, 8, 2, 2, 42);
    let dims = g.layout.dims().to_vec();
    let base = logical.to_array(&dims);
    let s = spec(5, 0, g.clone());
    let c0 = layer_block_checksum(&s, &base, 1, 0, 8);
    // Swap tokens 2 and 6 of block 1 (all heads).
    let mut swapped = logical.clone();
    for h in 0..4 {
        for part in 0..2 {
            for d in 0..8 {
                let (a, b) = (swapped.at(1, 2, h, part, d), swapped.at(1, 6, h, part, d));
                for k in 0..2 {
                    swapped.data.swap(a + k, b + k);
                }
            }
        }
    }
    assert_ne!(
        layer_block_checksum(&s, &swapped.to_array(&dims), 1, 0, 8),
        c0,
        "tokens"
    );
    // Swap heads 1 and 3 (all tokens).
    let mut swapped = logical.clone();
    for t in 0..8 {
        for part in 0..2 {
            for d in 0..8 {
                let (a, b) = (swapped.at(1, t, 1, part, d), swapped.at(1, t, 3, part, d));
                for k in 0..2 {
                    swapped.data.swap(a + k, b + k);
                }
            }
        }
    }
    assert_ne!(
        layer_block_checksum(&s, &swapped.to_array(&dims), 1, 0, 8),
        c0,
        "heads"
    );
    // Two layers' KV exchanged: layer 5 holding B and layer 6 holding A differs from the reverse.
    let other = Logical::random(2, 8, 4, 8, 2, 2, 43).to_array(&dims);
    let s6 = spec(6, 0, g.clone());
    let ab = layer_block_checksum(&s, &base, 1, 0, 8)
        .wrapping_add(layer_block_checksum(&s6, &other, 1, 0, 8));
    let ba = layer_block_checksum(&s, &other, 1, 0, 8)
        .wrapping_add(layer_block_checksum(&s6, &base, 1, 0, 8));
    assert_ne!(ab, ba, "layers");
    // K and V exchanged.
    let mut kv = logical.clone();
    for t in 0..8 {
        for h in 0..4 {
            for d in 0..8 {
                let (a, b) = (kv.at(1, t, h, 0, d), kv.at(1, t, h, 1, d));
                for k in 0..2 {
                    kv.data.swap(a + k, b + k);
                }
            }
        }
    }
    assert_ne!(
        layer_block_checksum(&s, &kv.to_array(&dims), 1, 0, 8),
        c0,
        "K/V"
    );
}

#[test]
fn consecutive_blocks_add_up_to_the_larger_block() {
    // The same tokens held in 16-token blocks (N=16) and in 32-token blocks made of two 16-token
    // kernel blocks and of one 32-token kernel block.
    let logical = Logical::random(8, 16, 2, 16, 2, 2, 9);
    let dims = Layout::parse("B KV H N D").unwrap().dims().to_vec();
    let bytes = logical.to_array(&dims);
    let g16 = Geometry::contiguous(
        Layout::from_dims(dims.clone()).unwrap(),
        8,
        16,
        2,
        16,
        ElemBytes::Two,
        1,
    )
    .unwrap();
    let g32 = g16.clone();
    let g32 = Geometry {
        kernel_blocks_per_block: 2,
        ..g32
    };
    let (s16, s32) = (spec(1, 0, g16), spec(1, 0, g32));
    for num_tokens in [128, 100, 70, 33] {
        for q in 0..4u64 {
            let small = layer_block_checksum(&s16, &bytes, 2 * q, 2 * q, num_tokens).wrapping_add(
                layer_block_checksum(&s16, &bytes, 2 * q + 1, 2 * q + 1, num_tokens),
            );
            assert_eq!(
                small,
                layer_block_checksum(&s32, &bytes, q, q, num_tokens),
                "q={q} n={num_tokens}"
            );
        }
    }
}

#[test]
fn head_factor_is_the_definition() {
    assert_eq!(MAX_KV_HEADS_PER_LAYER, 65536);
    assert_eq!(head_factor(0, 0), 1);
    assert_eq!(head_factor(12, 3), 2 * (12 * 65536 + 3) + 1);
    assert_eq!(
        head_factor(u32::MAX, u32::MAX),
        (2 * (u32::MAX as u64 * 65536 + u32::MAX as u64) + 1)
    );
}

#[test]
fn layouts_parse_and_reject_bad_text() {
    for text in [
        "KV B N H D",
        "B KV N H D",
        "B KV H N D",
        "B H N KV D",
        "B N D",
        "b n h d",
    ] {
        let l = Layout::parse(text).unwrap();
        assert_eq!(l.to_string(), text.to_uppercase());
    }
    assert!(matches!(
        Layout::parse("B N X D"),
        Err(LayoutError::UnknownDim { .. })
    ));
    assert!(matches!(
        Layout::parse("B N N D"),
        Err(LayoutError::DuplicateDim { .. })
    ));
    assert!(matches!(
        Layout::parse("KV B H D"),
        Err(LayoutError::MissingDim { .. })
    ));
    assert!(matches!(ElemBytes::new(3), Err(LayoutError::ElemBytes(3))));
    let l = Layout::parse("B N D").unwrap();
    assert!(
        Geometry::contiguous(l.clone(), 4, 16, 2, 64, ElemBytes::Two, 1).is_err(),
        "H without an H dim"
    );
    assert!(Geometry::contiguous(l.clone(), 0, 16, 1, 64, ElemBytes::Two, 1).is_err());
    let g = Geometry::contiguous(l, 4, 16, 1, 64, ElemBytes::Two, 1).unwrap();
    assert!(matches!(
        g.clone().with_strides(vec![1, 2]),
        Err(LayoutError::BadStrides(StrideFault::Count {
            given: 2,
            dims: 3,
            ..
        }))
    ));
    assert_eq!(
        g.clone().with_strides(vec![0, 128, 2]).err(),
        Some(LayoutError::BadStrides(StrideFault::Zero {
            index: 0,
            dim: Dim::B
        }))
    );
    assert!(matches!(
        g.with_strides(vec![u64::MAX / 2, 128, 2]),
        Err(LayoutError::BadStrides(StrideFault::Overflow {
            index: 0,
            ..
        }))
    ));
}

#[test]
fn geometry_sizes() {
    let g = Geometry::contiguous(
        Layout::parse("KV B N H D").unwrap(),
        10,
        16,
        8,
        128,
        ElemBytes::Two,
        2,
    )
    .unwrap();
    assert_eq!(g.byte_len(), 2 * 10 * 16 * 8 * 128 * 2);
    assert_eq!(
        (
            g.block_size(),
            g.num_blocks(),
            g.parts(),
            g.cell_bytes(),
            g.pieces_per_cell()
        ),
        (32, 5, 2, 512, Some(64))
    );
    let odd = Geometry::contiguous(
        Layout::parse("B N D").unwrap(),
        1,
        1,
        1,
        3,
        ElemBytes::Two,
        1,
    )
    .unwrap();
    assert_eq!(odd.pieces_per_cell(), None);
    assert!(!can_read(&odd, 1 << 20, 0));
    assert!(!can_read(&g, g.byte_len() - 1, 0));
    assert!(!can_read(&g, g.byte_len(), 5));
    assert!(can_read(&g, g.byte_len(), 4));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// The ranges of a block are exactly its elements' bytes, coalesced and ascending; moving
    /// just those bytes moves the block's value and nothing else.
    #[test]
    fn block_byte_ranges_are_exactly_the_block(c in case_strategy(), pad in proptest::collection::vec(0u64..2, 5)) {
        let g0 = c.geometry();
        let elem = c.elem.get();
        let mut strides = vec![0u64; c.dims.len()];
        let mut span = elem;
        for i in (0..c.dims.len()).rev() {
            strides[i] = span + pad[i] * elem;
            span = strides[i] * g0.size_of(c.dims[i]);
        }
        let g = g0.with_strides(strides).unwrap();
        for block in 0..g.num_blocks() {
            let ranges = g.block_byte_ranges(block);
            for w in ranges.windows(2) {
                prop_assert!(w[0].end < w[1].start, "coalesced and ascending");
            }
            let mut want = vec![false; g.byte_len() as usize];
            for kb in block * c.kpb..(block + 1) * c.kpb { for t in 0..g.tokens_per_kernel_block { for h in 0..g.heads {
                for part in 0..g.parts() { for d in 0..g.head_dim {
                    let o = g.byte_offset(part, kb, t, h, d) as usize;
                    for k in 0..elem as usize { want[o + k] = true; }
                }}
            }}}
            let mut got = vec![false; g.byte_len() as usize];
            for r in &ranges { for i in r.clone() { got[i as usize] = true; } }
            prop_assert_eq!(got, want);
        }
        prop_assert!(g.block_byte_ranges(g.num_blocks()).is_empty());
    }

    /// Every block's ranges (any head range, padded strides) are block 0's moved by
    /// `block * block_stride()`: what the planners rely on to compute block 0's once per layer.
    #[test]
    fn block_ranges_are_block_zeros_moved_by_the_block_stride(c in case_strategy(), pad in proptest::collection::vec(0u64..2, 5), split in 0u64..8, len in 1u64..8) {
        let g0 = c.geometry();
        let elem = c.elem.get();
        let mut strides = vec![0u64; c.dims.len()];
        let mut span = elem;
        for i in (0..c.dims.len()).rev() {
            strides[i] = span + pad[i] * elem;
            span = strides[i] * g0.size_of(c.dims[i]);
        }
        let g = g0.with_strides(strides).unwrap();
        let lo = split % g.heads;
        let hi = (lo + len).min(g.heads);
        let first = g.block_head_byte_ranges(0, lo..hi);
        prop_assert!(!first.is_empty());
        for block in 0..g.num_blocks() {
            let moved: Vec<_> = first
                .iter()
                .map(|r| r.start + block * g.block_stride()..r.end + block * g.block_stride())
                .collect();
            prop_assert_eq!(g.block_head_byte_ranges(block, lo..hi), moved);
        }
    }

    /// The ranges of a head range of a block are exactly those heads' bytes (a TP rank of the
    /// other side holding some of this rank's heads), and they list the bytes in the same
    /// logical order on two arrays of different head counts: pairing them moves head `h` of
    /// one to head `h - offset` of the other.
    #[test]
    fn block_head_byte_ranges_are_exactly_those_heads(c in case_strategy(), split in 0u64..8, len in 1u64..8) {
        let g = c.geometry();
        let elem = c.elem.get();
        let lo = split % g.heads;
        let hi = (lo + len).min(g.heads);
        for block in 0..g.num_blocks() {
            let ranges = g.block_head_byte_ranges(block, lo..hi);
            for w in ranges.windows(2) {
                prop_assert!(w[0].end < w[1].start, "coalesced and ascending");
            }
            let mut want = vec![false; g.byte_len() as usize];
            let mut order = Vec::new();
            for kb in block * c.kpb..(block + 1) * c.kpb { for t in 0..g.tokens_per_kernel_block { for h in lo..hi {
                for part in 0..g.parts() { for d in 0..g.head_dim {
                    let o = g.byte_offset(part, kb, t, h, d);
                    order.push((o, (part, kb - block * c.kpb, t, h - lo, d)));
                    for k in 0..elem as usize { want[o as usize + k] = true; }
                }}
            }}}
            let mut got = vec![false; g.byte_len() as usize];
            for r in &ranges { for i in r.clone() { got[i as usize] = true; } }
            prop_assert_eq!(got, want);

            // The same heads alone in an array of their own: the i-th byte listed holds the same
            // logical element on both.
            let sub = Geometry::contiguous(Layout::from_dims(c.dims.clone()).unwrap(), g.num_kernel_blocks, g.tokens_per_kernel_block,
                hi - lo, g.head_dim, c.elem, c.kpb).unwrap();
            order.sort_unstable();
            type Coord = (u64, u64, u64, u64, u64);
            let mut sub_order: Vec<(u64, Coord)> = Vec::new();
            for kb in block * c.kpb..(block + 1) * c.kpb { for t in 0..g.tokens_per_kernel_block { for h in 0..hi - lo {
                for part in 0..g.parts() { for d in 0..g.head_dim {
                    sub_order.push((sub.byte_offset(part, kb, t, h, d), (part, kb - block * c.kpb, t, h, d)));
                }}
            }}}
            sub_order.sort_unstable();
            let logical: Vec<_> = order.iter().map(|x| x.1).collect();
            let sub_logical: Vec<_> = sub_order.iter().map(|x| x.1).collect();
            prop_assert_eq!(logical, sub_logical, "same logical order on both sides");
            let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
            let sub_total: u64 = sub.block_byte_ranges(block).iter().map(|r| r.end - r.start).sum();
            prop_assert_eq!(total, sub_total);
        }
        prop_assert!(g.block_head_byte_ranges(0, lo..lo).is_empty());
        prop_assert!(g.block_head_byte_ranges(0, 0..g.heads + 1).is_empty());
        prop_assert_eq!(g.block_head_byte_ranges(0, 0..g.heads), g.block_byte_ranges(0));
    }

    /// The ranges of a token range of one kernel block and a head range are exactly those
    /// cells' bytes (filling a block token by token from blocks of another size), and the whole
    /// token range of a block's kernel blocks is the block's head range.
    #[test]
    fn token_head_byte_ranges_are_exactly_those_cells(c in case_strategy(), t0 in 0u64..8, tl in 1u64..8, split in 0u64..8, len in 1u64..8) {
        let g = c.geometry();
        let elem = c.elem.get();
        let n = g.tokens_per_kernel_block;
        let (lo, hi) = (split % g.heads, (split % g.heads + len).min(g.heads));
        let (a, b) = (t0 % n, (t0 % n + tl).min(n));
        for kb in 0..g.num_kernel_blocks {
            let ranges = g.token_head_byte_ranges(kb, a..b, lo..hi);
            for w in ranges.windows(2) {
                prop_assert!(w[0].end < w[1].start, "coalesced and ascending");
            }
            let mut want = vec![false; g.byte_len() as usize];
            for t in a..b { for h in lo..hi { for part in 0..g.parts() { for d in 0..g.head_dim {
                let o = g.byte_offset(part, kb, t, h, d) as usize;
                for k in 0..elem as usize { want[o + k] = true; }
            }}}}
            let mut got = vec![false; g.byte_len() as usize];
            for r in &ranges { for i in r.clone() { got[i as usize] = true; } }
            prop_assert_eq!(got, want);
        }
        if c.kpb == 1 {
            prop_assert_eq!(g.token_head_byte_ranges(0, 0..n, lo..hi), g.block_head_byte_ranges(0, lo..hi));
        }
        prop_assert!(g.token_head_byte_ranges(0, a..a, lo..hi).is_empty());
        prop_assert!(g.token_head_byte_ranges(0, 0..n + 1, lo..hi).is_empty());
        prop_assert!(g.token_head_byte_ranges(g.num_kernel_blocks, a..b, lo..hi).is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Rows of whole 8-piece chunks (the CPU hot loop), including rows longer than a tile, in
    /// every layout: fast form equals the oracle.
    #[test]
    fn wide_rows_equal_oracle(dims in dims_strategy(), e in 0usize..4, d_chunks in 1u64..5, h in 1u64..48, n in 1u64..5, seed in any::<u64>()) {
        let (dims, kv, with_h) = dims;
        let elem = [ElemBytes::One, ElemBytes::Two, ElemBytes::Four, ElemBytes::Eight][e];
        let d = d_chunks * 64 / elem.get();
        let h = if with_h { h } else { 1 };
        let parts = if kv { 2 } else { 1 };
        let logical = Logical::random(2, n, h, d, parts, elem.get() as usize, seed);
        let g = Geometry::contiguous(Layout::from_dims(dims.clone()).unwrap(), 2, n, h, d, elem, 1).unwrap();
        let bytes = logical.to_array(&dims);
        let s = spec(9, 4, g);
        for (block, position, num_tokens) in [(0, 0, n), (1, 3, 3 * n + n / 2), (1, 0, 1)] {
            prop_assert_eq!(layer_block_checksum(&s, &bytes, block, position, num_tokens), logical.oracle(9, 4, 1, block, position, num_tokens));
        }
    }
}

#[test]
fn rows_longer_than_a_tile_equal_oracle() {
    // 48 heads × 128 bf16 = 12 KiB per token row: the fast path takes one row per tile.
    for (layout, h, d, elem) in [
        ("KV B N H D", 48, 128, ElemBytes::Two),
        ("B N H D", 64, 64, ElemBytes::Four),
        ("B KV N H D", 20, 512, ElemBytes::One),
    ] {
        let dims = Layout::parse(layout).unwrap().dims().to_vec();
        let parts = if layout.contains("KV") { 2 } else { 1 };
        let logical = Logical::random(3, 6, h, d, parts, elem.get() as usize, 77);
        let g = Geometry::contiguous(Layout::parse(layout).unwrap(), 3, 6, h, d, elem, 1).unwrap();
        let bytes = logical.to_array(&dims);
        let s = spec(2, 8, g);
        for (block, position, num_tokens) in [(2, 0, 6), (1, 5, 34), (0, 1, 7)] {
            assert_eq!(
                layer_block_checksum(&s, &bytes, block, position, num_tokens),
                logical.oracle(2, 8, 1, block, position, num_tokens),
                "{layout}"
            );
        }
    }
}
