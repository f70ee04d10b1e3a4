//! The producer's plan for one load (docs/design.md §4): check the consumer's request against
//! the published lease, and pair every block's producer bytes with the consumer's, KV heads
//! mapped between ranks through the [`HeadMap`] (so TP and PP sizes may differ). Pure: the
//! producer's ranks come as [`RankLayout`]s, the result is a list of copies per rank pair.

use std::collections::{HashMap, HashSet};

use crate::proto::heads::{pick_from, HeadMap};
use crate::proto::layout::{group_heads, RankLayout};
use crate::proto::msg::{LoadRequest, WireBlocks, WireGeometry, WireLayer, WireRank};
use crate::proto::plan::{pair_ranges, Copy};
pub use crate::proto::serve_error::{LayerError, ServeError};
use crate::proto::serve_ranges::RangeCache;
use crate::proto::spec_checks::{check_distinct, check_dtype};
use crate::proto::wire::{compatible, compatible_cells, from_wire};
use kvferry_checksum::group::SkipReason;
use kvferry_checksum::layout::Geometry;

/// What a lease holds: the published block tables, token count and checksum payload.
#[derive(Debug, Clone)]
pub struct Published {
    /// `blocks[group_id]`: the group's block table (position → block id, `None` = null block).
    pub blocks: Vec<Vec<Option<u64>>>,
    /// Tokens of the request's KV.
    pub num_tokens: u64,
    /// The encoded checksum payload, `None` when the producer sends no checksums.
    pub payload: Option<Vec<u8>>,
}

/// The WRITEs one producer rank makes into one consumer rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    /// Index of the producer rank (into the ranks given to [`plan`]).
    pub rank: usize,
    /// The consumer rank's segment.
    pub segment: String,
    /// The copies cut token by token (block sizes differ), producer address → consumer
    /// address.
    pub copies: Vec<Copy>,
    /// The layer slot (`proto::progress`) of `copies`, in runs: `(slot, copies)` in order.
    pub copy_layers: Vec<(u32, usize)>,
    /// The whole-block copies, one entry per run of layers sharing block 0's ranges.
    pub strided: Vec<BlockCopies>,
}

/// Whole-block copies of one or more layers: every range of `ranges` (`src`, `dst` offsets from
/// a block's bases, `len` bytes) copied for every `(producer base, consumer base)` of `blocks`,
/// block by block, each block's ranges in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCopies {
    /// Block 0's copies as offsets from its bases (the same for every block of the layers).
    pub ranges: Vec<Copy>,
    /// Each block's `(producer base, consumer base)`: the layer's array address plus the
    /// block's offset (`Geometry::block_stride` × block id).
    pub blocks: Vec<(u64, u64)>,
    /// The layer slot (`proto::progress`) of `blocks`, in runs: `(slot, blocks)` in order.
    pub layers: Vec<(u32, usize)>,
}

/// Appends `n` items of layer `slot` to `runs` (`(slot, items)` in order).
pub(crate) fn push_run(runs: &mut Vec<(u32, usize)>, slot: u32, n: usize) {
    match runs.last_mut() {
        _ if n == 0 => {}
        Some((s, m)) if *s == slot => *m += n,
        _ => runs.push((slot, n)),
    }
}

impl BlockCopies {
    /// Number of copies: ranges × blocks.
    pub fn len(&self) -> usize {
        self.ranges.len() * self.blocks.len()
    }

    /// Whether there is no copy.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl RankPlan {
    /// Every copy of the plan as plain copies, a copy that continues the previous one on both
    /// sides merged into it: the strided ones (block by block) then the token-by-token ones.
    pub fn all_copies(&self) -> Vec<Copy> {
        let mut out: Vec<Copy> = Vec::new();
        for s in &self.strided {
            for &(src, dst) in &s.blocks {
                for r in &s.ranges {
                    let c = Copy {
                        src: src + r.src,
                        dst: dst + r.dst,
                        len: r.len,
                    };
                    match out.last_mut() {
                        Some(l) if l.src + l.len == c.src && l.dst + l.len == c.dst => {
                            l.len += c.len
                        }
                        _ => out.push(c),
                    }
                }
            }
        }
        out.extend_from_slice(&self.copies);
        out
    }

    /// Number of copies before merging (strided and token by token).
    pub fn copy_count(&self) -> usize {
        self.copies.len() + self.strided.iter().map(BlockCopies::len).sum::<usize>()
    }
}

/// Builds the copies that serve `req` from `producer`'s ranks (docs/design.md §4). Each layer
/// of each consumer rank is paired with the producer layers of the same name, and each of its
/// global KV heads is written by the producer rank the [`HeadMap`] picks for it: consumer TP
/// rank `c` takes a head held by `n` producer ranks (replicas: GQA with TP above the head
/// count, MLA) from the `c mod n`-th of them, which is rank to rank when the TP sizes are
/// equal. So TP and PP sizes may differ between the sides. Errors name the first problem.
pub fn plan(
    producer: &[RankLayout],
    published: &Published,
    req: &LoadRequest,
) -> Result<Vec<RankPlan>, ServeError> {
    check_lease(producer, published, req)?;
    check_ranks(req)?;
    // Never a write into the producer's own memory, whatever a consumer names.
    if let Some(r) = req
        .ranks
        .iter()
        .find(|r| producer.iter().any(|p| p.segment == r.segment))
    {
        return Err(ServeError::OwnSegment {
            tp_rank: r.tp_rank,
            pp_rank: r.pp_rank,
            segment: r.segment.clone(),
        });
    }
    let without = |i: usize, group: u32| ServeError::ProducerRankWithoutGroup {
        rank: producer[i].rank,
        group,
    };
    // The head map of each listed group, built once (when first needed, so that the errors
    // come in the same order) for every consumer rank and the check.
    let mut group_maps: Vec<Option<HeadMap<'_>>> = vec![None; req.blocks.len()];
    let mut out = Planned::default();
    // Each layer's slot, in `proto::progress::layer_slots`'s order.
    let mut slot = 0u32;
    for target in &req.ranks {
        for (b, heads) in req.blocks.iter().zip(group_maps.iter_mut()) {
            let tg = target
                .groups
                .iter()
                .find(|g| g.group_id == b.group_id)
                .ok_or(ServeError::RankWithoutGroup {
                    tp_rank: target.tp_rank,
                    pp_rank: target.pp_rank,
                    group: b.group_id,
                })?;
            let heads = match heads {
                Some(h) => &*h,
                None => heads
                    .insert(group_heads(producer, b.group_id).map_err(|i| without(i, b.group_id))?),
            };
            let mut wire = WireCache::default();
            let ids = BlockIds::of(b);
            let mut listed = HashSet::with_capacity(tg.layers.len());
            for (i, wl) in tg.layers.iter().enumerate() {
                if !listed.insert(wl.name.as_str()) {
                    return Err(ServeError::LayerTwice {
                        tp_rank: target.tp_rank,
                        pp_rank: target.pp_rank,
                        name: wl.name.clone(),
                        group: b.group_id,
                    });
                }
                let theirs = wire.geometry(wl)?;
                let layer = ConsumerLayer {
                    slot,
                    wl,
                    theirs,
                    layers_left: (tg.layers.len() - i).min(heads.layer_count()),
                };
                layer_copies(
                    producer,
                    heads,
                    target,
                    &ids,
                    req.num_tokens,
                    &layer,
                    &mut out,
                )?;
                slot = slot.saturating_add(1);
            }
        }
    }
    // Every producer layer must land somewhere, and the consumer's ranks must hold as many of
    // its KV heads as the producer's: else the consumer runs another model.
    for (b, heads) in req.blocks.iter().zip(group_maps) {
        let heads = match heads {
            Some(h) => h,
            None => group_heads(producer, b.group_id).map_err(|i| without(i, b.group_id))?,
        };
        // layer name → one past the last global head the consumer's ranks hold
        let mut consumer: HashMap<&str, u64> = HashMap::new();
        for r in &req.ranks {
            for tg in r.groups.iter().filter(|tg| tg.group_id == b.group_id) {
                for wl in &tg.layers {
                    let end = (wl.head_offset as u64).saturating_add(wl.geometry.heads);
                    let e = consumer.entry(&wl.name).or_default();
                    *e = (*e).max(end);
                }
            }
        }
        for name in heads.names() {
            let producer_end = heads.heads_end(name);
            let Some(&consumer_end) = consumer.get(name) else {
                return Err(ServeError::NoConsumerLayer {
                    name: name.to_string(),
                    group: b.group_id,
                });
            };
            if consumer_end != producer_end {
                return Err(ServeError::HeadCount {
                    name: name.to_string(),
                    consumer: consumer_end,
                    producer: producer_end,
                });
            }
        }
    }
    Ok(out.plans)
}

/// One group's block lists with their highest ids (the paired lists, as far as both go), so
/// that each layer checks its arrays' bounds in O(1) and only a request that breaks them is
/// walked block by block.
struct BlockIds<'a> {
    blocks: &'a WireBlocks,
    highest_remote: u64,
    highest_local: u64,
}

impl<'a> BlockIds<'a> {
    fn of(blocks: &'a WireBlocks) -> BlockIds<'a> {
        let (highest_remote, highest_local) = blocks
            .remote_blocks
            .iter()
            .zip(&blocks.local_blocks)
            .fold((0, 0), |(r, l), (&a, &b)| (r.max(a), l.max(b)));
        BlockIds {
            blocks,
            highest_remote,
            highest_local,
        }
    }
}

/// A consumer layer of the request with its layer slot (`proto::progress`), its geometry
/// read from the wire, and how many of its rank's group's layers are left, itself included,
/// at most the producer's layers of the group (room is made for that many ahead: a request
/// that lists a layer again and again gets no more than a real model's layers).
struct ConsumerLayer<'a> {
    slot: u32,
    wl: &'a WireLayer,
    theirs: &'a Geometry,
    layers_left: usize,
}

/// What the plan has made so far: a plan per (producer rank, consumer segment), and the
/// ranges it worked out.
#[derive(Default)]
struct Planned {
    plans: Vec<RankPlan>,
    ranges: RangeCache,
}

/// The last wire geometry read and what it gave: the layers of one rank's group share one
/// geometry as a rule, so it is parsed once, not once per layer.
#[derive(Default)]
struct WireCache {
    last: Option<(WireGeometry, Geometry)>,
}

impl WireCache {
    /// `wl`'s geometry. Errors: the geometry does not parse ([`LayerError::Geometry`]).
    fn geometry(&mut self, wl: &WireLayer) -> Result<&Geometry, ServeError> {
        let last = match self.last.take() {
            Some((w, g)) if w == wl.geometry => (w, g),
            _ => {
                let g = from_wire(&wl.geometry).map_err(|e| ServeError::Layer {
                    name: wl.name.clone(),
                    source: LayerError::Geometry(e),
                })?;
                (wl.geometry.clone(), g)
            }
        };
        Ok(&self.last.insert(last).1)
    }
}

/// The request's tokens and block lists against the lease (what [`plan`] checks first, and all
/// that the producer checks of a request the consumer reads itself, docs/design.md §4.10):
/// no more tokens than published, each group once, and per group the lists' lengths, the
/// block sizes, the positions' order and at each position the block the lease holds. Errors
/// name the first problem.
pub fn check_lease(
    producer: &[RankLayout],
    published: &Published,
    req: &LoadRequest,
) -> Result<(), ServeError> {
    if req.num_tokens > published.num_tokens {
        return Err(ServeError::TooManyTokens {
            asked: req.num_tokens,
            published: published.num_tokens,
        });
    }
    // Each group once: a second listing would copy the lease's blocks again.
    let mut listed = HashSet::with_capacity(req.blocks.len());
    for b in &req.blocks {
        if !listed.insert(b.group_id) {
            return Err(ServeError::GroupTwice(b.group_id));
        }
        check_blocks(producer, published, b)?;
    }
    Ok(())
}

/// One group's block lists against the lease: lengths, block sizes, the blocks at each position.
fn check_blocks(
    producer: &[RankLayout],
    published: &Published,
    b: &WireBlocks,
) -> Result<(), ServeError> {
    let n = b.positions.len();
    let remote_n = if b.remote_positions.is_empty() {
        n
    } else {
        b.remote_positions.len()
    };
    if b.remote_blocks.len() != remote_n || b.local_blocks.len() != n {
        return Err(ServeError::ListLengths(b.group_id));
    }
    let table = published
        .blocks
        .get(b.group_id as usize)
        .ok_or(ServeError::NotPublished(b.group_id))?;
    let group = producer
        .first()
        .and_then(|r| r.group(b.group_id))
        .ok_or(ServeError::NoGroup(b.group_id))?;
    let pbs = group.block_size;
    // The producer block size the consumer was told (an older consumer sends none: then its
    // own must be the producer's), and a consumer block size to cut tokens with.
    let told = if b.remote_block_size == 0 {
        b.block_size
    } else {
        b.remote_block_size
    };
    if told != pbs || b.block_size == 0 {
        return Err(ServeError::BlockSize {
            group: b.group_id,
            consumer: told,
            producer: pbs,
        });
    }
    let by_tokens = !b.remote_positions.is_empty();
    if !by_tokens && b.block_size != pbs {
        return Err(ServeError::BlockSize {
            group: b.group_id,
            consumer: b.block_size,
            producer: pbs,
        });
    }
    if by_tokens && group.skipped == Some(SkipReason::NoPerTokenBlocks) {
        return Err(ServeError::StateBlockSize(b.group_id));
    }
    if by_tokens && b.remote_positions.windows(2).any(|w| w[0] >= w[1]) {
        return Err(ServeError::RemoteOrder(b.group_id));
    }
    if b.positions.windows(2).any(|w| w[0] >= w[1]) {
        return Err(ServeError::PositionOrder(b.group_id));
    }
    check_distinct(b.group_id, &b.positions, &b.local_blocks)?;
    let remote_positions = if by_tokens {
        &b.remote_positions
    } else {
        &b.positions
    };
    for (&pos, &remote) in remote_positions.iter().zip(&b.remote_blocks) {
        let held = table.get(pos as usize).copied().flatten();
        if held != Some(remote) {
            return Err(ServeError::WrongBlock {
                group: b.group_id,
                position: pos,
                expected: remote,
                held,
            });
        }
        if pos.saturating_mul(pbs) >= published.num_tokens {
            return Err(ServeError::PastTokens {
                group: b.group_id,
                position: pos,
            });
        }
    }
    Ok(())
}

/// The consumer's ranks: each of its TP × PP grid exactly once.
pub fn check_ranks(req: &LoadRequest) -> Result<(), ServeError> {
    let (tp, pp) = (req.tp_size, req.pp_size);
    if tp == 0 || pp == 0 || req.ranks.len() as u64 != tp as u64 * pp as u64 {
        return Err(ServeError::RankCount {
            named: req.ranks.len(),
            tp,
            pp,
        });
    }
    let mut seen = HashSet::new();
    for r in &req.ranks {
        if r.tp_rank >= tp || r.pp_rank >= pp || !seen.insert((r.tp_rank, r.pp_rank)) {
            return Err(ServeError::RankTwice {
                tp_rank: r.tp_rank,
                pp_rank: r.pp_rank,
                tp,
                pp,
            });
        }
    }
    Ok(())
}

/// Appends the copies that fill consumer layer `wl` (layer slot `slot`) of rank `target` for
/// blocks `b` (tokens below `num_tokens` when the block sizes differ); `heads` is the
/// producer's head map of `b`'s group.
fn layer_copies(
    producer: &[RankLayout],
    heads: &HeadMap<'_>,
    target: &WireRank,
    ids: &BlockIds<'_>,
    num_tokens: u64,
    consumer: &ConsumerLayer<'_>,
    out: &mut Planned,
) -> Result<(), ServeError> {
    let Planned {
        plans,
        ranges: cache,
    } = out;
    let (slot, wl, theirs) = (consumer.slot, consumer.wl, consumer.theirs);
    let b = ids.blocks;
    let at = |source: LayerError| ServeError::Layer {
        name: wl.name.clone(),
        source,
    };
    if theirs.byte_len() > wl.len {
        return Err(at(LayerError::PastArray(wl.len)));
    }
    // Every address planned below lies in `[addr, addr + byte_len)`: none overflows.
    if wl.addr.checked_add(wl.len).is_none() {
        return Err(at(LayerError::AddressWraps {
            addr: wl.addr,
            len: wl.len,
        }));
    }
    let holders = heads.holders(&wl.name);
    // Whole blocks are copied byte for byte between equal block geometries; with different
    // block sizes the cells are copied token by token, so only the cell layout must agree.
    let by_tokens = !b.remote_positions.is_empty();
    for h in holders {
        if by_tokens {
            compatible_cells(&h.spec.geometry, theirs)
        } else {
            compatible(&h.spec.geometry, theirs)
        }
        .map_err(|e| at(e.into()))?;
        check_dtype(h.spec.dtype.as_deref(), wl.dtype.as_deref()).map_err(|e| at(e.into()))?;
    }
    if holders.is_empty() {
        return Err(ServeError::NoProducerLayer {
            name: wl.name.clone(),
            group: b.group_id,
        });
    }
    let first = wl.head_offset as u64;
    let end = first
        .checked_add(theirs.heads)
        .ok_or(at(LayerError::HeadOverflow))?;
    let held_end = heads.heads_end(&wl.name);
    if end > held_end {
        return Err(at(LayerError::HeadsPastProducer {
            tp_rank: target.tp_rank,
            first,
            end,
            held_end,
        }));
    }
    // Runs of consecutive global heads taken from one producer array: (rank, layer, first, end).
    let mut runs: Vec<(usize, usize, u64, u64)> = Vec::new();
    for h in first..end {
        let Some(k) = pick_from(holders, h, target.tp_rank) else {
            return Err(at(LayerError::HeadNotHeld {
                head: h,
                tp_rank: target.tp_rank,
                first,
                end,
            }));
        };
        match runs.last_mut() {
            Some((r, l, _, e)) if (*r, *l) == (k.rank, k.layer) && *e == h => *e = h + 1,
            _ => runs.push((k.rank, k.layer, h, h + 1)),
        }
    }
    for (ri, li, h0, h1) in runs {
        // The head map was built from these ranks' groups, so both lookups succeed.
        let Some(layer) = producer[ri]
            .group(b.group_id)
            .and_then(|g| g.layers.get(li))
        else {
            return Err(ServeError::ProducerRankWithoutGroup {
                rank: producer[ri].rank,
                group: b.group_id,
            });
        };
        let ours = &layer.spec.geometry;
        let po = layer.spec.head_offset as u64;
        let (ph, ch) = (h0 - po..h1 - po, h0 - first..h1 - first);
        let i = match plans
            .iter()
            .position(|p| p.rank == ri && p.segment == target.segment)
        {
            Some(i) => i,
            None => {
                plans.push(RankPlan {
                    rank: ri,
                    segment: target.segment.clone(),
                    copies: Vec::new(),
                    copy_layers: Vec::new(),
                    strided: Vec::new(),
                });
                plans.len() - 1
            }
        };
        if by_tokens {
            let before = plans[i].copies.len();
            token_copies(
                layer.addr,
                ours,
                wl.addr,
                theirs,
                b,
                num_tokens,
                &ph,
                &ch,
                &mut plans[i].copies,
            )
            .map_err(at)?;
            let added = plans[i].copies.len() - before;
            push_run(&mut plans[i].copy_layers, slot, added);
            continue;
        }
        // Block 0's ranges once per layer; each block's are those moved by its offset. Layers
        // whose block 0 pairs alike (every layer of a model, as a rule) share one entry.
        let ranges = cache
            .pair(ours, &ph, theirs, &ch)
            .map_err(|e| at(e.into()))?;
        let (ps, cs) = (ours.block_stride(), theirs.block_stride());
        // Every block inside both arrays, checked before anything is planned: against the
        // highest ids, and block by block only to name the first outside.
        let (producer_blocks, consumer_blocks) = (ours.num_blocks(), theirs.num_blocks());
        let outside = |(&r, &l): &(&u64, &u64)| r >= producer_blocks || l >= consumer_blocks;
        if let Some((&remote, &local)) = (ids.highest_remote >= producer_blocks
            || ids.highest_local >= consumer_blocks)
            .then(|| b.remote_blocks.iter().zip(&b.local_blocks).find(outside))
            .flatten()
        {
            return Err(at(LayerError::BlockOutside {
                remote,
                local,
                producer_blocks,
                consumer_blocks,
            }));
        }
        let n = b.remote_blocks.len().min(b.local_blocks.len());
        if ranges.is_empty() || n == 0 {
            continue;
        }
        let strided = &mut plans[i].strided;
        if !matches!(strided.last(), Some(s) if s.ranges == ranges) {
            strided.push(BlockCopies {
                ranges: ranges.to_vec(),
                blocks: Vec::with_capacity(n),
                layers: Vec::new(),
            });
        }
        let Some(s) = strided.last_mut() else {
            continue; // pushed above
        };
        // A second layer sharing the entry: the rest of the group's layers will too, as a
        // rule, so their blocks are made room for at once, not by doubling layer by layer.
        // Only room asked for: where the memory is not there, the list grows as before (a
        // failed reservation must not abort the producer).
        if s.blocks.capacity() - s.blocks.len() < n {
            let _ = s.blocks.try_reserve(n.saturating_mul(consumer.layers_left));
        }
        // Inside the arrays (the blocks were checked against them): no overflow.
        let (pa, ca) = (layer.addr, wl.addr);
        s.blocks.extend(
            b.remote_blocks
                .iter()
                .zip(&b.local_blocks)
                .map(|(&remote, &local)| (pa + remote * ps, ca + local * cs)),
        );
        push_run(&mut s.layers, slot, n);
    }
    Ok(())
}

/// Appends the copies that fill the consumer blocks of `b` (block size `b.block_size`, array
/// `theirs` at `dst`, local heads `ch`) token by token from the producer blocks holding the same
/// tokens (`b.remote_positions`, block size `ours.block_size()`, array `ours` at `src`, local
/// heads `ph`): each consumer block gets its tokens below `num_tokens` that a listed producer
/// block holds, in runs cut at every block and kernel-block boundary of either side (within one
/// kernel block both sides list a token run's cells in the same logical order).
#[allow(clippy::too_many_arguments)]
fn token_copies(
    src: u64,
    ours: &Geometry,
    dst: u64,
    theirs: &Geometry,
    b: &WireBlocks,
    num_tokens: u64,
    ph: &std::ops::Range<u64>,
    ch: &std::ops::Range<u64>,
    out: &mut Vec<Copy>,
) -> Result<(), LayerError> {
    let (pbs, cbs) = (ours.block_size(), b.block_size);
    let (pn, cn) = (ours.tokens_per_kernel_block, theirs.tokens_per_kernel_block);
    if theirs.block_size() != cbs {
        return Err(LayerError::BlockSizeOfArray {
            array: theirs.block_size(),
            group: cbs,
        });
    }
    for (&position, &local) in b.positions.iter().zip(&b.local_blocks) {
        if local >= theirs.num_blocks() {
            return Err(LayerError::BlockOutside {
                remote: 0,
                local,
                producer_blocks: ours.num_blocks(),
                consumer_blocks: theirs.num_blocks(),
            });
        }
        let first = position.saturating_mul(cbs);
        let end = first.saturating_add(cbs).min(num_tokens);
        let mut t = first;
        while t < end {
            let q = t / pbs;
            let next_block = q.saturating_add(1).saturating_mul(pbs).min(end);
            let Ok(k) = b.remote_positions.binary_search(&q) else {
                t = next_block; // not listed: outside a sliding window
                continue;
            };
            let remote = b.remote_blocks[k];
            if remote >= ours.num_blocks() {
                return Err(LayerError::BlockOutside {
                    remote,
                    local,
                    producer_blocks: ours.num_blocks(),
                    consumer_blocks: theirs.num_blocks(),
                });
            }
            while t < next_block {
                let (pt, ct) = (t - q * pbs, t - first);
                let run = (next_block - t).min(pn - pt % pn).min(cn - ct % cn);
                let pkb = remote * ours.kernel_blocks_per_block + pt / pn;
                let ckb = local * theirs.kernel_blocks_per_block + ct / cn;
                pair_ranges(
                    src,
                    &ours.token_head_byte_ranges(pkb, pt % pn..pt % pn + run, ph.clone()),
                    dst,
                    &theirs.token_head_byte_ranges(ckb, ct % cn..ct % cn + run, ch.clone()),
                    out,
                )?;
                t += run;
            }
        }
    }
    Ok(())
}
