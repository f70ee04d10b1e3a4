//! The producer's plan and the consumer's request, checked without a network: two sides of
//! plain rank layouts over simulated memory, the copies applied byte by byte, and every
//! consumer head compared with the producer's bytes of the same global head.

use kvferry_checksum::group::{LayerSpec, RankInfo, ReplicaKey};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_kernels::LayerInput;

use super::layout::{RankLayout, WorkerGroup};
use super::request::{build_request, grant_ranges, LoadGroup, LoadSpec, SpecError};
use super::serve::{plan, LayerError, Published, RankPlan, ServeError};
use crate::proto::msg::LoadRequest;

const BLOCK: u64 = 4; // tokens per block
const BLOCKS: u64 = 6; // blocks per layer array
const LAYERS: u32 = 3;

/// One side: `tp` × `pp` ranks over `kv_heads` KV heads (replicated when fewer than `tp`),
/// layers split among PP stages; rank `i`'s memory starts at `(side + 1) << 40 | i << 32`.
fn side(side: u64, tp: u32, pp: u32, kv_heads: u64) -> Vec<RankLayout> {
    side_with(side, tp, pp, kv_heads, "KV B N H D", BLOCK, BLOCK, BLOCKS)
}

/// As [`side`], with a layout, block size, tokens per kernel block and blocks per array.
#[allow(clippy::too_many_arguments)]
fn side_with(
    side: u64,
    tp: u32,
    pp: u32,
    kv_heads: u64,
    layout: &str,
    block: u64,
    per_kernel_block: u64,
    blocks: u64,
) -> Vec<RankLayout> {
    let per_rank = (kv_heads / tp as u64).max(1);
    let mut ranks = Vec::new();
    for pp_rank in 0..pp {
        for tp_rank in 0..tp {
            let i = ranks.len() as u64;
            let first = tp_rank as u64 * kv_heads / tp as u64;
            let mut addr = ((side + 1) << 40) | (i << 32);
            let layers = (0..LAYERS)
                .filter(|l| l % pp == pp_rank)
                .map(|layer| {
                    let kpb = block / per_kernel_block;
                    let geometry = Geometry::contiguous(
                        Layout::parse(layout).unwrap(),
                        blocks * kpb,
                        per_kernel_block,
                        per_rank,
                        8,
                        ElemBytes::new(2).unwrap(),
                        kpb,
                    )
                    .unwrap();
                    let len = geometry.byte_len();
                    let l = LayerInput {
                        spec: LayerSpec {
                            name: format!("model.layers.{layer}.attn"),
                            layer,
                            head_offset: first as u32,
                            geometry,
                            kind: None,
                            dtype: None,
                            replica: ReplicaKey::NONE,
                        },
                        addr,
                        len,
                    };
                    addr += len;
                    l
                })
                .collect();
            ranks.push(RankLayout {
                rank: RankInfo {
                    tp_rank,
                    tp_size: tp,
                    pp_rank,
                    pp_size: pp,
                },
                segment: format!("10.0.{side}.{i}:7000"),
                groups: vec![WorkerGroup {
                    group_id: 0,
                    block_size: block,
                    layers,
                    sliding_window: None,
                    skipped: None,
                }],
            });
        }
    }
    ranks
}

/// The value of byte `k` of global head `head` of `layer` in the block at `position`.
fn byte(layer: u32, head: u64, position: u64, k: usize) -> u8 {
    (layer as u64 * 131 + head * 31 + position * 7 + k as u64) as u8
}

/// Simulated memory: each layer array of each rank, by base address.
struct Memory(Vec<(u64, Vec<u8>)>);

impl Memory {
    fn of(ranks: &[RankLayout]) -> Memory {
        let arrays = ranks.iter().flat_map(|r| &r.groups[0].layers);
        Memory(arrays.map(|l| (l.addr, vec![0; l.len as usize])).collect())
    }

    fn at(&mut self, addr: u64, len: u64) -> &mut [u8] {
        let (base, bytes) = self
            .0
            .iter_mut()
            .find(|(b, v)| addr >= *b && addr + len <= *b + v.len() as u64)
            .expect("a copy inside one array");
        let off = (addr - *base) as usize;
        &mut bytes[off..off + len as usize]
    }

    /// Writes (or with `check`, compares) every head of `blocks` (position, block id) of
    /// every layer of `ranks`; returns false on the first difference.
    fn heads(&mut self, ranks: &[RankLayout], blocks: &[(u64, u64)], check: bool) -> bool {
        for l in ranks.iter().flat_map(|r| &r.groups[0].layers) {
            let g = &l.spec.geometry;
            for &(position, block) in blocks {
                for j in 0..g.heads {
                    let head = l.spec.head_offset as u64 + j;
                    let mut k = 0;
                    for r in g.block_head_byte_ranges(block, j..j + 1) {
                        for b in self.at(l.addr + r.start, r.end - r.start) {
                            let want = byte(l.spec.layer, head, position, k);
                            if check && *b != want {
                                return false;
                            }
                            *b = want;
                            k += 1;
                        }
                    }
                }
            }
        }
        true
    }
}

fn spec(remote: &[u64], local: &[u64], num_tokens: u64) -> LoadSpec {
    LoadSpec {
        request_id: "r".into(),
        producer: "tcp://127.0.0.1:1".into(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: remote.iter().map(|&b| Some(b)).collect(),
            local_blocks: local.iter().map(|&b| Some(b)).collect(),
        }],
        num_local_computed: 0,
        num_tokens,
        load_key: None,
    }
}

fn published(remote: &[u64]) -> Published {
    Published {
        blocks: vec![remote.iter().map(|&b| Some(b)).collect()],
        num_tokens: remote.len() as u64 * BLOCK,
        payload: None,
    }
}

fn request(consumer: &[RankLayout], remote: &[u64], local: &[u64]) -> LoadRequest {
    let (tp, pp) = (consumer[0].rank.tp_size, consumer[0].rank.pp_size);
    let tokens = remote.len() as u64 * BLOCK;
    build_request(consumer, tp, pp, &spec(remote, local, tokens))
        .unwrap()
        .0
}

/// Plans a load between the two sides, applies the copies, and says whether every
/// consumer head holds the producer's bytes of that head at the same position.
fn lands(producer: &[RankLayout], consumer: &[RankLayout]) -> (bool, Vec<RankPlan>) {
    let (remote, local) = ([4u64, 0, 5], [1u64, 3, 2]);
    let req = request(consumer, &remote, &local);
    let plans = plan(producer, &published(&remote), &req).unwrap();
    let mut src = Memory::of(producer);
    src.heads(producer, &[(0, 4), (1, 0), (2, 5)], false);
    let mut dst = Memory::of(consumer);
    for p in &plans {
        assert_eq!(
            consumer.iter().filter(|r| r.segment == p.segment).count(),
            1
        );
        for c in &p.all_copies() {
            let bytes = src.at(c.src, c.len).to_vec();
            dst.at(c.dst, c.len).copy_from_slice(&bytes);
        }
    }
    (dst.heads(consumer, &[(0, 1), (1, 3), (2, 2)], true), plans)
}

/// (producer rank, consumer segment) of each plan.
fn pairs(plans: &[RankPlan]) -> Vec<(usize, String)> {
    plans.iter().map(|p| (p.rank, p.segment.clone())).collect()
}

#[test]
fn equal_sides_write_rank_to_rank() {
    let (ok, plans) = lands(&side(0, 2, 1, 4), &side(1, 2, 1, 4));
    assert!(ok);
    assert_eq!(
        pairs(&plans),
        [(0, "10.0.1.0:7000".into()), (1, "10.0.1.1:7000".into())]
    );
}

#[test]
fn other_tp_and_pp_sizes_land_every_head() {
    for (p, c) in [
        ((2, 1), (1, 1)),
        ((1, 1), (4, 1)),
        ((4, 1), (2, 3)),
        ((1, 3), (2, 1)),
        ((2, 2), (4, 3)),
    ] {
        let (ok, _) = lands(&side(0, p.0, p.1, 4), &side(1, c.0, c.1, 4));
        assert!(ok, "producer TP×PP {p:?}, consumer {c:?}");
    }
}

/// `side` with layer 1's arrays holding two blocks more on every rank (moved past the others):
/// its value plane starts elsewhere, so its block 0 ranges differ from the other layers'.
fn side_with_a_longer_layer(side_no: u64, tp: u32, kv_heads: u64) -> Vec<RankLayout> {
    let mut ranks = side(side_no, tp, 1, kv_heads);
    for r in &mut ranks {
        let l = &mut r.groups[0].layers[1];
        let g = &l.spec.geometry;
        l.spec.geometry = Geometry::contiguous(
            Layout::parse("KV B N H D").unwrap(),
            BLOCKS + 2,
            g.tokens_per_kernel_block,
            g.heads,
            g.head_dim,
            ElemBytes::new(2).unwrap(),
            1,
        )
        .unwrap();
        l.addr += 1 << 30;
        l.len = l.spec.geometry.byte_len();
    }
    ranks
}

/// Layers whose arrays differ in shape on either side each get their own ranges (the plan
/// works block 0's ranges out once per pair of shapes, not once per layer).
#[test]
fn a_layer_shaped_unlike_the_others_lands_on_either_side() {
    for (p, c) in [(1, 1), (2, 1), (1, 2)] {
        let (ok, _) = lands(&side_with_a_longer_layer(0, p, 4), &side(1, c, 1, 4));
        assert!(
            ok,
            "producer TP {p}, consumer TP {c}: producer layer longer"
        );
        let (ok, _) = lands(&side(0, p, 1, 4), &side_with_a_longer_layer(1, c, 4));
        assert!(
            ok,
            "producer TP {p}, consumer TP {c}: consumer layer longer"
        );
    }
}

#[test]
fn replicated_heads_are_taken_from_the_c_mod_n_th_holder() {
    // Producer TP 4 over 2 KV heads: ranks 0,1 hold head 0, ranks 2,3 head 1.
    let producer = side(0, 4, 1, 2);
    let (ok, plans) = lands(&producer, &side(1, 4, 1, 2));
    assert!(ok);
    let want: Vec<(usize, String)> = (0..4).map(|i| (i, format!("10.0.1.{i}:7000"))).collect();
    assert_eq!(pairs(&plans), want, "equal TP: rank to rank");
    // Consumer TP 2 holds one head per rank: rank 1 takes head 1 from holder 1 % 2 = rank 3.
    let (ok, plans) = lands(&producer, &side(1, 2, 1, 2));
    assert!(ok);
    assert_eq!(
        pairs(&plans),
        [(0, "10.0.1.0:7000".into()), (3, "10.0.1.1:7000".into())]
    );
}

#[test]
fn requests_that_do_not_match_the_lease_are_refused() {
    let (producer, consumer) = (side(0, 2, 1, 4), side(1, 1, 1, 4));
    let (remote, local) = ([4u64, 0], [1u64, 3]);
    let lease = published(&remote);
    let req = request(&consumer, &remote, &local);
    assert!(plan(&producer, &lease, &req).is_ok());

    let mut r = req.clone();
    r.num_tokens = lease.num_tokens + 1;
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::TooManyTokens { .. })
    ));
    // A consumer rank naming one of the producer's own segments: the producer would write
    // the lease over its own KV.
    let mut r = req.clone();
    r.ranks[0].segment = producer[1].segment.clone();
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::OwnSegment { .. })
    ));
    let mut r = req.clone();
    r.blocks[0].remote_blocks[1] = 5;
    assert_eq!(
        plan(&producer, &lease, &r),
        Err(ServeError::WrongBlock {
            group: 0,
            position: 1,
            expected: 5,
            held: Some(0)
        })
    );
    let mut r = req.clone();
    r.blocks[0].block_size = 8;
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::BlockSize { .. })
    ));
    let mut r = req.clone();
    r.ranks.push(r.ranks[0].clone());
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::RankCount { named: 2, .. })
    ));
    // A layer listed again: its blocks would be written twice (and each listing planned).
    let mut r = req.clone();
    let again = r.ranks[0].groups[0].layers[0].clone();
    r.ranks[0].groups[0].layers.push(again.clone());
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::LayerTwice { name, group: 0, .. }) if name == again.name
    ));
    let mut r = req.clone();
    r.blocks[0].local_blocks[0] = BLOCKS;
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::Layer {
            source: LayerError::BlockOutside { local: BLOCKS, .. },
            ..
        })
    ));
}

#[test]
fn the_first_block_outside_the_arrays_is_named_not_the_highest() {
    let (producer, consumer) = (side(0, 1, 1, 4), side(1, 1, 1, 4));
    let (remote, local) = ([4u64, 0, 2], [1u64, 3, 5]);
    let lease = published(&remote);
    let mut r = request(&consumer, &remote, &local);
    r.blocks[0].local_blocks[1] = BLOCKS;
    r.blocks[0].local_blocks[2] = BLOCKS + 7;
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::Layer {
            source: LayerError::BlockOutside {
                local: BLOCKS,
                remote: 0,
                ..
            },
            ..
        })
    ));
}

#[test]
fn each_layer_s_wire_geometry_is_read_not_only_the_first() {
    let (producer, consumer) = (side(0, 1, 1, 4), side(1, 1, 1, 4));
    let (remote, local) = ([4u64, 0], [1u64, 3]);
    let lease = published(&remote);
    let req = request(&consumer, &remote, &local);
    assert!(plan(&producer, &lease, &req).is_ok());
    // Layer 1 says it is one byte shorter than its geometry: refused by name.
    let mut r = req.clone();
    let l1 = &mut r.ranks[0].groups[0].layers[1];
    l1.len -= 1;
    let name = l1.name.clone();
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::Layer { name: n, source: LayerError::PastArray(_) }) if n == name
    ));
    // Layer 2's geometry does not parse while layers 0 and 1 share one that does.
    let mut r = req.clone();
    let l2 = &mut r.ranks[0].groups[0].layers[2];
    l2.geometry.layout = "KV B Q H D".into();
    let name = l2.name.clone();
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::Layer { name: n, source: LayerError::Geometry(_) }) if n == name
    ));
    // Layer 2 with other strides (the same layout): its own geometry is used, and it does not
    // match the producer's.
    let mut r = req.clone();
    let g = &mut r.ranks[0].groups[0].layers[2].geometry;
    g.strides[1] *= 2;
    assert!(plan(&producer, &lease, &r).is_err());
}

/// `ranges` as sorted, merged `[start, end)` intervals.
fn intervals(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut r: Vec<(u64, u64)> = ranges.iter().map(|&(a, n)| (a, a + n)).collect();
    r.sort();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (a, e) in r {
        match out.last_mut() {
            Some(m) if a <= m.1 => m.1 = m.1.max(e),
            _ => out.push((a, e)),
        }
    }
    out
}

#[test]
fn the_grant_covers_the_loaded_blocks_ascending_and_joined() {
    let mut consumer = side(1, 1, 1, 4);
    let (remote, local) = ([4u64, 0, 5, 2], [3u64, 1, 2, 5]);
    let req = request(&consumer, &remote, &local);
    let want: Vec<(u64, u64)> = consumer[0].groups[0]
        .layers
        .iter()
        .flat_map(|l| {
            local.iter().flat_map(move |&b| {
                let g = &l.spec.geometry;
                g.block_byte_ranges(b)
                    .into_iter()
                    .map(move |r| (l.addr + r.start, r.end - r.start))
            })
        })
        .collect();
    // Layers listed in either address order: the same ranges, ascending, blocks 1, 2, 3 of
    // each part of each layer joined into one range (and block 5 one of its own).
    for reversed in [false, true] {
        if reversed {
            consumer[0].groups[0].layers.reverse();
        }
        let got = grant_ranges(&consumer[0], &req);
        assert_eq!(intervals(&got), intervals(&want));
        assert!(got.windows(2).all(|w| w[0].0 + w[0].1 < w[1].0), "{got:?}");
        assert_eq!(got.len(), LAYERS as usize * 2 * 2, "{got:?}");
    }
}

#[test]
fn a_consumer_of_another_model_is_refused() {
    let producer = side(0, 2, 1, 4);
    let (remote, local) = ([4u64], [1u64]);
    let lease = published(&remote);
    // Fewer KV heads: the consumer's ranks hold 2 of the producer's 4.
    let req = request(&side(1, 1, 1, 2), &remote, &local);
    assert!(matches!(
        plan(&producer, &lease, &req),
        Err(ServeError::HeadCount {
            consumer: 2,
            producer: 4,
            ..
        })
    ));
    // More KV heads than the producer holds.
    let req = request(&side(1, 1, 1, 8), &remote, &local);
    assert!(matches!(
        plan(&producer, &lease, &req),
        Err(ServeError::Layer {
            source: LayerError::HeadsPastProducer { held_end: 4, .. },
            ..
        })
    ));
    // A layer the producer lacks, and one the consumer lacks.
    let mut req = request(&side(1, 1, 1, 4), &remote, &local);
    req.ranks[0].groups[0].layers[2].name = "other".into();
    assert!(matches!(
        plan(&producer, &lease, &req),
        Err(ServeError::NoProducerLayer { .. })
    ));
    req.ranks[0].groups[0].layers.pop();
    assert!(matches!(
        plan(&producer, &lease, &req),
        Err(ServeError::NoConsumerLayer { .. })
    ));
}

/// The request built in two steps (blocks, then the ranks' layers) is the one built at once,
/// and its slots are found from the layouts alone as from its ranks, on every TP × PP grid.
#[test]
fn blocks_then_ranks_build_the_same_request_and_slots() {
    for (tp, pp) in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)] {
        let consumer = side(1, tp, pp, 8);
        let s = spec(&[4, 0, 5, 2], &[1, 3, 2, 0], 3 * BLOCK + 1);
        let (whole, landed) = build_request(&consumer, tp, pp, &s).unwrap();
        let (mut blocks, landed_too) =
            crate::proto::request::build_blocks(&consumer, tp, pp, &s).unwrap();
        assert!(blocks.ranks.is_empty());
        assert_eq!(landed, landed_too);
        assert_eq!(
            crate::proto::progress::layer_slots_of(&consumer, &blocks.blocks),
            crate::proto::progress::layer_slots(&whole),
            "tp {tp} pp {pp}"
        );
        blocks.ranks = crate::proto::request::wire_ranks(&consumer, &blocks);
        assert_eq!(blocks, whole);
    }
}

#[test]
fn the_request_leaves_out_the_local_prefix_and_null_blocks() {
    let consumer = side(1, 2, 1, 4);
    let mut s = spec(&[4, 0, 5, 2], &[1, 3, 2, 0], 3 * BLOCK + 1);
    s.num_local_computed = BLOCK; // block 0 is a local prefix hit
    s.groups[0].local_blocks[2] = None;
    let (req, landed) = build_request(&consumer, 2, 1, &s).unwrap();
    assert_eq!(req.blocks[0].positions, [1, 3]);
    assert_eq!(req.blocks[0].remote_blocks, [0, 2]);
    assert_eq!(landed.groups[0].local_blocks, [3, 0]);
    assert_eq!(req.ranks.len(), 2);
    assert_eq!(req.ranks[1].segment, "10.0.1.1:7000");
    assert_eq!(req.ranks[1].groups[0].layers[0].head_offset, 2);

    s.groups[0].remote_blocks[3] = None;
    assert_eq!(
        build_request(&consumer, 2, 1, &s).map(|_| ()),
        Err(SpecError::NoProducerBlock {
            group: 0,
            position: 3
        })
    );
    s.groups.push(s.groups[0].clone());
    s.groups[0].remote_blocks[3] = Some(2);
    assert_eq!(
        build_request(&consumer, 2, 1, &s).map(|_| ()),
        Err(SpecError::GroupTwice(0))
    );
    s.groups[0].group_id = 7;
    assert_eq!(
        build_request(&consumer, 2, 1, &s).map(|_| ()),
        Err(SpecError::NoGroup(7))
    );
    s.num_local_computed = s.num_tokens;
    assert!(matches!(
        build_request(&consumer, 2, 1, &s),
        Err(SpecError::NothingToLoad { .. })
    ));
}

/// The value of byte `e` of element `d` of part `part` of global head `head` of `layer` at
/// request token `t`: every cell of the request distinct.
fn cell_byte(layer: u32, head: u64, t: u64, part: u64, d: u64, e: u64) -> u8 {
    (layer as u64 * 131 + head * 31 + t * 7 + part * 101 + d * 3 + e * 17 + t / 5) as u8
}

impl Memory {
    /// Writes (or with `check`, compares) the cells of tokens `tokens` of every layer of `ranks`,
    /// token `t` in block `table[t / block_size]` (a null block: not touched); returns false
    /// on the first difference.
    fn cells(
        &mut self,
        ranks: &[RankLayout],
        table: &[Option<u64>],
        tokens: std::ops::Range<u64>,
        check: bool,
    ) -> bool {
        for l in ranks.iter().flat_map(|r| &r.groups[0].layers) {
            let g = &l.spec.geometry;
            let (bs, n) = (g.block_size(), g.tokens_per_kernel_block);
            for t in tokens.clone() {
                let Some(block) = table[(t / bs) as usize] else {
                    continue;
                };
                let kb = block * g.kernel_blocks_per_block + (t % bs) / n;
                for h in 0..g.heads {
                    let head = l.spec.head_offset as u64 + h;
                    for part in 0..g.parts() {
                        for d in 0..g.head_dim {
                            for e in 0..g.elem.get() {
                                let at = l.addr + g.byte_offset(part, kb, (t % bs) % n, h, d) + e;
                                let want = cell_byte(l.spec.layer, head, t, part, d, e);
                                let b = &mut self.at(at, 1)[0];
                                if check && *b != want {
                                    return false;
                                }
                                *b = want;
                            }
                        }
                    }
                }
            }
        }
        true
    }
}

/// Loads tokens `[lc, num_tokens)` from `producer` (table `remote`) into `consumer` (table
/// `local`, told the producer's block size `rbs`), applying the planned copies; says whether
/// every consumer cell of tokens `[check_from, num_tokens)` holds the producer's.
#[allow(clippy::too_many_arguments)]
fn lands_by_tokens(
    producer: &[RankLayout],
    consumer: &[RankLayout],
    remote: &[Option<u64>],
    local: &[Option<u64>],
    rbs: u64,
    lc: u64,
    num_tokens: u64,
    check_from: u64,
) -> Result<bool, String> {
    let (tp, pp) = (consumer[0].rank.tp_size, consumer[0].rank.pp_size);
    let mut s = spec(&[], &[], num_tokens);
    s.groups[0].remote_blocks = remote.to_vec();
    s.groups[0].local_blocks = local.to_vec();
    s.groups[0].remote_block_size = Some(rbs);
    s.num_local_computed = lc;
    let req = build_request(consumer, tp, pp, &s)
        .map_err(|e| e.to_string())?
        .0;
    let lease = Published {
        blocks: vec![remote.to_vec()],
        num_tokens,
        payload: None,
    };
    let plans = plan(producer, &lease, &req).map_err(|e| e.to_string())?;
    let mut src = Memory::of(producer);
    src.cells(producer, remote, 0..num_tokens, false);
    let mut dst = Memory::of(consumer);
    for p in &plans {
        for c in &p.all_copies() {
            let bytes = src.at(c.src, c.len).to_vec();
            dst.at(c.dst, c.len).copy_from_slice(&bytes);
        }
    }
    Ok(dst.cells(consumer, local, check_from..num_tokens, true))
}

/// A block table of `n` scattered blocks of an array of `blocks`.
fn table(n: u64, blocks: u64, salt: u64) -> Vec<Option<u64>> {
    (0..n).map(|i| Some((i * 5 + salt) % blocks)).collect()
}

#[test]
fn different_block_sizes_fill_consumer_blocks_token_by_token() {
    // (block size, tokens per kernel block) of producer and consumer: both ratios, and kernel
    // blocks that do not line up with the other side's blocks.
    let shapes = [
        ((4, 4), (8, 8)),
        ((8, 8), (4, 4)),
        ((8, 4), (4, 2)),
        ((4, 2), (16, 8)),
        ((16, 16), (4, 4)),
    ];
    let layouts = ["KV B N H D", "B KV N H D", "B KV H N D", "B H N KV D"];
    let grids = [
        ((1, 1), (1, 1)),
        ((2, 1), (1, 1)),
        ((1, 1), (4, 1)),
        ((2, 2), (1, 3)),
    ];
    for layout in layouts {
        for ((pbs, pn), (cbs, cn)) in shapes {
            for ((ptp, ppp), (ctp, cpp)) in grids {
                let num_tokens: u64 = 37;
                let producer = side_with(0, ptp, ppp, 4, layout, pbs, pn, 16);
                let consumer = side_with(1, ctp, cpp, 4, layout, cbs, cn, 16);
                let remote = table(num_tokens.div_ceil(pbs), 16, 3);
                let local = table(num_tokens.div_ceil(cbs), 16, 7);
                let what =
                    format!("{layout} {pbs}/{cbs} N {pn}/{cn} TP×PP {ptp}×{ppp} → {ctp}×{cpp}");
                assert_eq!(
                    lands_by_tokens(&producer, &consumer, &remote, &local, pbs, 0, num_tokens, 0),
                    Ok(true),
                    "{what}"
                );
                // A local prefix hit of one consumer block: the rest lands.
                assert_eq!(
                    lands_by_tokens(
                        &producer, &consumer, &remote, &local, pbs, cbs, num_tokens, cbs
                    ),
                    Ok(true),
                    "{what}, prefix hit"
                );
            }
        }
    }
}

#[test]
fn different_block_sizes_are_checked_against_the_lease() {
    let producer = side_with(0, 1, 1, 4, "KV B N H D", 8, 8, 16);
    let consumer = side_with(1, 1, 1, 4, "KV B N H D", 4, 4, 16);
    // 20 tokens: 3 producer blocks of 8, 5 consumer blocks of 4 (tables cover them exactly).
    let (remote, local) = (table(3, 16, 3), table(5, 16, 7));
    // The consumer was told another producer block size (and a table of 2 blocks of 16).
    assert!(
        lands_by_tokens(&producer, &consumer, &table(2, 16, 3), &local, 16, 0, 20, 0)
            .unwrap_err()
            .contains("the producer's hold 8")
    );
    // A null producer block inside a full-attention group is a spec error; in a sliding-window
    // group those tokens are outside the window and are not loaded.
    let mut holed = remote.clone();
    holed[0] = None;
    assert_eq!(
        lands_by_tokens(&producer, &consumer, &holed, &local, 8, 0, 20, 0),
        Err(SpecError::NoProducerBlock {
            group: 0,
            position: 0
        }
        .to_string())
    );
    let mut windowed = consumer.clone();
    for r in &mut windowed {
        r.groups[0].sliding_window = Some(8);
    }
    assert_eq!(
        lands_by_tokens(&producer, &windowed, &holed, &local, 8, 0, 20, 8),
        Ok(true)
    );
    // Producer positions out of order are refused; a consumer that names no producer block
    // size must have the producer's.
    let mut s = spec(&[], &[], 20);
    s.groups[0].remote_blocks = remote.clone();
    s.groups[0].local_blocks = local.clone();
    s.groups[0].remote_block_size = Some(8);
    let req = build_request(&consumer, 1, 1, &s).unwrap().0;
    let lease = Published {
        blocks: vec![remote.clone()],
        num_tokens: 20,
        payload: None,
    };
    assert!(plan(&producer, &lease, &req).is_ok());
    let mut r = req.clone();
    r.blocks[0].remote_positions.swap(0, 1);
    r.blocks[0].remote_blocks.swap(0, 1);
    assert_eq!(plan(&producer, &lease, &r), Err(ServeError::RemoteOrder(0)));
    // A consumer position named twice (into two distinct local blocks) would copy one
    // producer block twice: refused, as is a descending order.
    let mut r = req.clone();
    r.blocks[0].positions[1] = r.blocks[0].positions[0];
    assert_eq!(
        plan(&producer, &lease, &r),
        Err(ServeError::PositionOrder(0))
    );
    let mut r = req.clone();
    r.blocks[0].positions.swap(0, 1);
    r.blocks[0].local_blocks.swap(0, 1);
    assert_eq!(
        plan(&producer, &lease, &r),
        Err(ServeError::PositionOrder(0))
    );
    let mut r = req.clone();
    r.blocks[0].remote_block_size = 0;
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::BlockSize {
            consumer: 4,
            producer: 8,
            ..
        })
    ));
    let mut r = req.clone();
    r.blocks[0].remote_blocks[1] = 15;
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::WrongBlock { position: 1, .. })
    ));
}

/// A plan cut at layer groups (`proto::progress`): each part copies only into the consumer
/// layers of its slots, the parts together copy every byte once and land every head, and the
/// bytes per slot add up to the plan's, for one group, a few, and one per layer.
#[test]
fn layer_parts_copy_each_layer_once_into_its_own_slots() {
    use super::progress::{layer_groups, layer_slots};
    for (p, c) in [
        ((1, 1), (1, 1)),
        ((2, 1), (1, 1)),
        ((1, 1), (2, 1)),
        ((2, 2), (1, 3)),
    ] {
        let (producer, consumer) = (side(0, p.0, p.1, 4), side(1, c.0, c.1, 4));
        let (remote, local) = ([4u64, 0, 5], [1u64, 3, 2]);
        let req = request(&consumer, &remote, &local);
        let plans = plan(&producer, &published(&remote), &req).unwrap();
        let slots = layer_slots(&req);
        let mut bytes = vec![0u64; slots.len()];
        for pl in &plans {
            pl.add_slot_bytes(&mut bytes);
        }
        let total: u64 = plans
            .iter()
            .flat_map(|p| p.all_copies())
            .map(|c| c.len)
            .sum();
        assert_eq!(bytes.iter().sum::<u64>(), total);
        let per = total / slots.len() as u64;
        let mut splits: Vec<Vec<std::ops::Range<u32>>> = [0, total, 2 * per, per, 1]
            .iter()
            .map(|&g| layer_groups(&bytes, g))
            .collect();
        splits.push((0..slots.len() as u32).map(|i| i..i + 1).collect());
        assert!(splits.iter().any(|s| s.len() > 2), "{splits:?}");
        for groups in splits {
            let mut src = Memory::of(&producer);
            src.heads(&producer, &[(0, 4), (1, 0), (2, 5)], false);
            let mut dst = Memory::of(&consumer);
            let mut copied = 0;
            for g in &groups {
                let layers: Vec<_> = slots[g.start as usize..g.end as usize]
                    .iter()
                    .map(|s| {
                        let rg = &req.ranks[s.rank].groups;
                        let l = &rg.iter().find(|x| x.group_id == s.group_id).unwrap();
                        (l.layers[s.layer].addr, l.layers[s.layer].len)
                    })
                    .collect();
                for pl in &plans {
                    for c in pl.layer_part(g).all_copies() {
                        let inside = |&(a, n): &(u64, u64)| c.dst >= a && c.dst + c.len <= a + n;
                        assert!(layers.iter().any(inside), "{c:?} outside {g:?}");
                        copied += c.len;
                        let b = src.at(c.src, c.len).to_vec();
                        dst.at(c.dst, c.len).copy_from_slice(&b);
                    }
                }
            }
            assert_eq!(copied, total, "{groups:?}");
            assert!(dst.heads(&consumer, &[(0, 1), (1, 3), (2, 2)], true));
        }
    }
}

/// A consumer array whose address plus length overflows (a peer's request) is refused with a
/// typed reason before any address in it is computed (the sum overflowed: a panic in a debug
/// build, a wrapped address in a release one).
#[test]
fn a_consumer_array_past_the_end_of_the_address_space_is_refused() {
    let (producer, consumer) = (side(0, 1, 1, 4), side(1, 1, 1, 4));
    let (remote, local) = ([4u64, 0, 2], [1u64, 3, 5]);
    let lease = published(&remote);
    let mut r = request(&consumer, &remote, &local);
    for l in &mut r.ranks[0].groups[0].layers {
        l.addr = u64::MAX - 100;
    }
    assert!(matches!(
        plan(&producer, &lease, &r),
        Err(ServeError::Layer {
            source: LayerError::AddressWraps {
                addr,
                ..
            },
            ..
        }) if addr == u64::MAX - 100
    ));
}

/// Requests with numbers a peer chose (extremes and random values in addresses, lengths,
/// geometries, block ids and positions) are planned or refused, never a panic, and a plan's
/// layer parts cut without one either.
#[test]
fn mutated_requests_never_panic_the_plan() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let extremes = [
        0u64,
        1,
        2,
        3,
        7,
        16,
        63,
        64,
        1 << 20,
        u32::MAX as u64,
        (1u64 << 63),
        u64::MAX - 1,
        u64::MAX,
    ];
    for round in 0..5000 {
        let (producer, consumer) = (side(0, 2, 1, 4), side(1, 1, 1, 4));
        let (remote, local) = ([4u64, 0, 2], [1u64, 3, 5]);
        let lease = published(&remote);
        let mut r = request(&consumer, &remote, &local);
        let n = rng.random_range(1..4);
        for _ in 0..n {
            let v = if rng.random_bool(0.6) {
                extremes[rng.random_range(0..extremes.len())]
            } else {
                rng.random::<u64>() >> rng.random_range(0..64)
            };
            let l = &mut r.ranks[0].groups[0].layers[rng.random_range(0..2)];
            let b = &mut r.blocks[0];
            match rng.random_range(0..18) {
                0 => l.addr = v,
                1 => l.len = v,
                2 => l.head_offset = v as u32,
                3 => l.geometry.num_kernel_blocks = v,
                4 => l.geometry.tokens_per_kernel_block = v,
                5 => l.geometry.heads = v,
                6 => l.geometry.head_dim = v,
                7 => l.geometry.elem_bytes = v,
                8 => l.geometry.kernel_blocks_per_block = v,
                9 => {
                    if !l.geometry.strides.is_empty() {
                        let i = rng.random_range(0..l.geometry.strides.len());
                        l.geometry.strides[i] = v
                    }
                }
                10 => b.block_size = v,
                11 => b.remote_block_size = v,
                12 => {
                    let i = rng.random_range(0..b.remote_blocks.len());
                    b.remote_blocks[i] = v
                }
                13 => {
                    let i = rng.random_range(0..b.local_blocks.len());
                    b.local_blocks[i] = v
                }
                14 => r.num_tokens = v,
                15 => {
                    b.remote_positions = vec![v, v.wrapping_add(1)];
                }
                16 => {
                    let i = rng.random_range(0..b.positions.len());
                    b.positions[i] = v
                }
                _ => r.num_local_computed = v,
            }
        }
        let res = std::panic::catch_unwind(|| {
            let p = plan(&producer, &lease, &r);
            if let Ok(plans) = &p {
                let mut slot_bytes = vec![0u64; crate::proto::progress::layer_slots(&r).len()];
                for q in plans {
                    q.add_slot_bytes(&mut slot_bytes);
                }
                let g = crate::proto::progress::layer_groups(&slot_bytes, 1);
                for q in plans {
                    for gg in &g {
                        let _ = q.layer_part(gg);
                    }
                }
            }
        });
        if res.is_err() {
            panic!("round {round}: {:?}", r.blocks[0]);
        }
    }
}

/// A request that lists a group twice (no consumer builds one: `build_request` refuses it) is
/// refused: each listing would copy the lease's blocks again, so one lease could make the
/// producer write its bytes thousands of times (up to `MAX_GROUPS` listings).
#[test]
fn a_group_listed_twice_is_refused() {
    let (producer, consumer) = (side(0, 1, 1, 4), side(1, 1, 1, 4));
    let (remote, local) = ([4u64, 0, 2], [1u64, 3, 5]);
    let lease = published(&remote);
    let mut r = request(&consumer, &remote, &local);
    let once = plan(&producer, &lease, &r).unwrap();
    let copies = |p: &[RankPlan]| p.iter().map(|p| p.copy_count()).sum::<usize>();
    assert!(copies(&once) > 0);
    let b = r.blocks[0].clone();
    r.blocks.extend(std::iter::repeat_n(b, 63));
    let r = plan(&producer, &lease, &r);
    assert!(
        matches!(r, Err(ServeError::GroupTwice(0))),
        "{:?}",
        r.map(|p| copies(&p))
    );
}

/// A read's template gives the very copies the turned-round plan gives, for every layout, grid
/// and block list tried: the blocks' pairs from each part's bases and strides.
#[test]
fn a_read_template_gives_the_turned_round_plans_copies() {
    use super::read_plan::{read_plans, ReadTemplate};
    let layouts = ["KV B N H D", "B KV N H D", "B KV H N D", "B H N KV D"];
    let grids = [
        ((1, 1), (1, 1)),
        ((2, 1), (1, 1)),
        ((1, 1), (2, 1)),
        ((2, 2), (1, 3)),
        ((4, 1), (2, 1)),
    ];
    for layout in layouts {
        for ((ptp, ppp), (ctp, cpp)) in grids {
            let producer = side_with(0, ptp, ppp, 4, layout, BLOCK, BLOCK, 16);
            let consumer = side_with(1, ctp, cpp, 4, layout, BLOCK, BLOCK, 16);
            let segments: Vec<String> = consumer.iter().map(|r| r.segment.clone()).collect();
            let what = format!("{layout} TP×PP {ptp}×{ppp} → {ctp}×{cpp}");
            let shape = request(&consumer, &[1, 2], &[3, 4]);
            let t = ReadTemplate::of(&producer, &segments, &shape).expect(&what);
            for (remote, local) in [
                (vec![4u64, 0, 5], vec![1u64, 3, 2]),
                (vec![15, 14, 0, 7, 9], vec![0, 15, 1, 2, 3]),
                (vec![6], vec![6]),
            ] {
                let req = request(&consumer, &remote, &local);
                let want = read_plans(&producer, &segments, &req).unwrap().unwrap();
                let got = t.reads(&req);
                let copies = |p: &[RankPlan]| -> Vec<_> {
                    p.iter()
                        .map(|p| (p.rank, p.segment.clone(), p.all_copies()))
                        .collect()
                };
                assert_eq!(copies(&got), copies(&want), "{what} {remote:?}");
                let runs = |p: &[RankPlan]| -> Vec<Vec<(u32, usize)>> {
                    p.iter()
                        .map(|p| p.strided.iter().flat_map(|s| s.layers.clone()).collect())
                        .collect()
                };
                assert_eq!(runs(&got), runs(&want), "{what} {remote:?}");
            }
        }
    }
}

/// No template where block sizes differ (token copies), and the plan's errors stay the plan's.
#[test]
fn a_read_template_needs_equal_block_sizes() {
    use super::read_plan::ReadTemplate;
    let producer = side_with(0, 1, 1, 4, "KV B N H D", 8, 8, 16);
    let consumer = side_with(1, 1, 1, 4, "KV B N H D", 4, 4, 16);
    let segments: Vec<String> = consumer.iter().map(|r| r.segment.clone()).collect();
    let mut req = request(&consumer, &[1, 2], &[3, 4]);
    assert_eq!(ReadTemplate::of(&producer, &segments, &req), None);
    req.blocks[0].remote_positions = vec![0];
    assert_eq!(ReadTemplate::of(&producer, &segments, &req), None);
}

/// A producer's layout survives the wire: the consumer plans with what it reads back exactly
/// the copies the producer would; a layout that cannot be planned with is refused by name.
#[test]
fn a_producers_layout_read_back_plans_the_same_copies_and_bad_ones_are_refused() {
    use super::msg_read::{layout_from_wire, layout_to_wire, LayoutFromWireError};
    for ((ptp, ppp), (ctp, cpp)) in [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((2, 2), (1, 3))] {
        let producer = side(0, ptp, ppp, 4);
        let consumer = side(1, ctp, cpp, 4);
        let back = layout_from_wire(&layout_to_wire(&producer)).unwrap();
        let (remote, local) = ([4u64, 0, 5], [1u64, 3, 2]);
        let req = request(&consumer, &remote, &local);
        let copies =
            |p: Vec<RankPlan>| -> Vec<_> { p.iter().map(|p| (p.rank, p.all_copies())).collect() };
        assert_eq!(
            copies(plan(&back, &published(&remote), &req).unwrap()),
            copies(plan(&producer, &published(&remote), &req).unwrap())
        );
    }
    let good = layout_to_wire(&side(0, 2, 1, 4));
    assert!(matches!(
        layout_from_wire(&[]),
        Err(LayoutFromWireError::RankCount(0))
    ));
    let mut twice = good.clone();
    twice[1].tp_rank = 0;
    assert!(matches!(
        layout_from_wire(&twice),
        Err(LayoutFromWireError::RankTwice {
            tp_rank: 0,
            pp_rank: 0
        })
    ));
    let mut short = good.clone();
    short[0].groups[0].layers[0].len -= 1;
    assert!(matches!(
        layout_from_wire(&short),
        Err(LayoutFromWireError::Array { .. })
    ));
    let mut wraps = good.clone();
    wraps[0].groups[0].layers[0].addr = u64::MAX - 8;
    assert!(matches!(
        layout_from_wire(&wraps),
        Err(LayoutFromWireError::Array { .. })
    ));
    let mut odd = good.clone();
    odd[0].groups[0].layers[0].geometry.layout = "KV B X".into();
    assert!(matches!(
        layout_from_wire(&odd),
        Err(LayoutFromWireError::Geometry { .. })
    ));
    let mut sized = good;
    sized[0].groups[0].block_size += 1;
    assert!(matches!(
        layout_from_wire(&sized),
        Err(LayoutFromWireError::BlockSize { .. })
    ));
}
