//! The consumer's plan of a load it reads (docs/design.md §4.10): the producer's plan
//! ([`super::serve::plan`]) turned round, each copy's consumer address local and the producer's
//! remote, and its [`ReadTemplate`]: for equal block sizes a load's copies depend on its blocks
//! only through each layer's bases and block strides, so they are worked out once per request
//! shape (its ranks and groups) and each later load of that shape only lists its blocks' pairs.

use super::layout::RankLayout;
use super::msg::LoadRequest;
use super::plan::Copy;
use super::progress::layer_slots;
use super::serve::{plan, push_run, BlockCopies, Published, RankPlan, ServeError};

/// Most positions of one group's table the consumer builds to plan a read (16M tokens at block
/// size 16).
pub const MAX_OWN_POSITIONS: u64 = 1 << 20;

/// The lease as the consumer sees it: its own request's block tables and tokens, so that the
/// plan checks the request's shape (the producer checks it against the real lease). `None`
/// past [`MAX_OWN_POSITIONS`] or [`super::msg::MAX_GROUPS`].
pub fn own_view(request: &LoadRequest) -> Option<Published> {
    let groups = request
        .blocks
        .iter()
        .map(|b| b.group_id)
        .max()
        .map_or(0, |g| g as usize + 1);
    if groups > super::msg::MAX_GROUPS {
        return None;
    }
    let mut blocks: Vec<Vec<Option<u64>>> = vec![Vec::new(); groups];
    for b in &request.blocks {
        let positions = if b.remote_positions.is_empty() {
            &b.positions
        } else {
            &b.remote_positions
        };
        let end = positions.iter().max().map_or(0, |p| p.saturating_add(1));
        if end > MAX_OWN_POSITIONS {
            return None;
        }
        let table = blocks.get_mut(b.group_id as usize)?;
        table.resize(end as usize, None);
        for (&p, &r) in positions.iter().zip(&b.remote_blocks) {
            table[p as usize] = Some(r);
        }
    }
    Some(Published {
        blocks,
        num_tokens: request.num_tokens,
        payload: None,
    })
}

/// `p` (a producer rank's copies into one consumer segment) as the consumer's reads: `rank`
/// the index of the first of `consumer` (the consumer's segments, by worker) naming `p`'s
/// segment, `segment` the producer rank's, and every copy turned round (`src` local, the
/// consumer's address; `dst` remote, the producer's). `None` when no worker has that segment.
pub fn reversed(p: RankPlan, producer: &[RankLayout], consumer: &[String]) -> Option<RankPlan> {
    let rank = consumer.iter().position(|s| *s == p.segment)?;
    let segment = producer.get(p.rank)?.segment.clone();
    let swap = |c: Copy| Copy {
        src: c.dst,
        dst: c.src,
        len: c.len,
    };
    Some(RankPlan {
        rank,
        segment,
        copies: p.copies.into_iter().map(swap).collect(),
        copy_layers: p.copy_layers,
        strided: p
            .strided
            .into_iter()
            .map(|s| BlockCopies {
                ranges: s.ranges.into_iter().map(swap).collect(),
                blocks: s.blocks.into_iter().map(|(p, c)| (c, p)).collect(),
                layers: s.layers,
            })
            .collect(),
    })
}

/// The consumer's reads of `request` from `producer` ([`plan`] on [`own_view`], each plan
/// [`reversed`]). Errors: the plan's; `None` inside when a plan names no consumer segment.
pub fn read_plans(
    producer: &[RankLayout],
    consumer: &[String],
    request: &LoadRequest,
) -> Result<Option<Vec<RankPlan>>, ServeError> {
    let Some(published) = own_view(request) else {
        return Ok(None);
    };
    let plans = plan(producer, &published, request)?;
    Ok(plans
        .into_iter()
        .map(|p| reversed(p, producer, consumer))
        .collect())
}

/// One (layer, head run) of a template entry: its layer slot, the index of its group in the
/// request's `blocks`, and the local (consumer) and remote (producer) base and block stride.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Part {
    slot: u32,
    group: usize,
    local: (u64, u64),
    remote: (u64, u64),
}

/// A strided entry less its blocks: block 0's ranges and the parts whose blocks it copies.
type Entry = (Vec<Copy>, Vec<Part>);

/// A request shape's reads less their blocks: per reversed plan, its worker, the producer's
/// segment and its strided entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadTemplate {
    plans: Vec<(usize, String, Vec<Entry>)>,
}

impl ReadTemplate {
    /// The template of `request`'s shape, from the reads of two one-block requests of that
    /// shape (block 0, then block 1, on both sides): their difference is each part's strides.
    /// `None` where the shape has none: block sizes differ (token copies), an array holds fewer
    /// than two blocks, or a plan fails.
    pub fn of(
        producer: &[RankLayout],
        consumer: &[String],
        request: &LoadRequest,
    ) -> Option<ReadTemplate> {
        if request
            .blocks
            .iter()
            .any(|b| !b.remote_positions.is_empty())
        {
            return None;
        }
        let tokens = request
            .blocks
            .iter()
            .map(|b| b.block_size)
            .max()?
            .checked_mul(2)?;
        let one = |id: u64| {
            let mut r = request.clone();
            r.num_local_computed = 0;
            r.num_tokens = tokens;
            for b in &mut r.blocks {
                (b.positions, b.remote_blocks, b.local_blocks) = (vec![id], vec![id], vec![id]);
            }
            read_plans(producer, consumer, &r).ok().flatten()
        };
        let (p0, p1) = (one(0)?, one(1)?);
        let slots = layer_slots(request);
        let group_of = |slot: u32| {
            let g = slots.get(slot as usize)?.group_id;
            request.blocks.iter().position(|b| b.group_id == g)
        };
        let mut plans = Vec::with_capacity(p0.len());
        for (a, b) in p0.into_iter().zip(p1) {
            let same = (a.rank, &a.segment) == (b.rank, &b.segment);
            if !same || !a.copies.is_empty() || !b.copies.is_empty() {
                return None;
            }
            if a.strided.len() != b.strided.len() {
                return None;
            }
            let mut entries = Vec::with_capacity(a.strided.len());
            for (x, y) in a.strided.into_iter().zip(b.strided) {
                if x.ranges != y.ranges || x.layers != y.layers || x.blocks.len() != y.blocks.len()
                {
                    return None;
                }
                // One block each: one block pair per (layer, head run), in the runs' order.
                let mut slot_of = Vec::with_capacity(x.blocks.len());
                for &(slot, n) in &x.layers {
                    slot_of.extend(std::iter::repeat_n(slot, n));
                }
                if slot_of.len() != x.blocks.len() {
                    return None;
                }
                let mut parts = Vec::with_capacity(x.blocks.len());
                for ((&(l0, r0), &(l1, r1)), slot) in x.blocks.iter().zip(&y.blocks).zip(slot_of) {
                    parts.push(Part {
                        slot,
                        group: group_of(slot)?,
                        local: (l0, l1.checked_sub(l0)?),
                        remote: (r0, r1.checked_sub(r0)?),
                    });
                }
                entries.push((x.ranges, parts));
            }
            plans.push((a.rank, a.segment, entries));
        }
        Some(ReadTemplate { plans })
    }

    /// The reads of `request`, of this template's shape: each part's block pairs from its bases
    /// and strides, in the order [`read_plans`] gives them. Addresses wrap rather than fail: the
    /// consumer's blocks were checked against its arrays when its request was built, and the
    /// engine checks every remote range against the producer's registered memory.
    pub fn reads(&self, request: &LoadRequest) -> Vec<RankPlan> {
        let pairs = |g: usize| {
            request
                .blocks
                .get(g)
                .map(|b| (&b.remote_blocks[..], &b.local_blocks[..]))
                .unwrap_or_default()
        };
        let mut out = Vec::with_capacity(self.plans.len());
        for (rank, segment, entries) in &self.plans {
            let mut strided = Vec::with_capacity(entries.len());
            for (ranges, parts) in entries {
                let n: usize = parts
                    .iter()
                    .map(|p| {
                        let (r, l) = pairs(p.group);
                        r.len().min(l.len())
                    })
                    .sum();
                let mut s = BlockCopies {
                    ranges: ranges.clone(),
                    blocks: Vec::with_capacity(n),
                    layers: Vec::new(),
                };
                for p in parts {
                    let (remote, local) = pairs(p.group);
                    let before = s.blocks.len();
                    s.blocks.extend(remote.iter().zip(local).map(|(&r, &l)| {
                        (
                            p.local.0.wrapping_add(l.wrapping_mul(p.local.1)),
                            p.remote.0.wrapping_add(r.wrapping_mul(p.remote.1)),
                        )
                    }));
                    push_run(&mut s.layers, p.slot, s.blocks.len() - before);
                }
                if !s.blocks.is_empty() {
                    strided.push(s);
                }
            }
            if !strided.is_empty() {
                out.push(RankPlan {
                    rank: *rank,
                    segment: segment.clone(),
                    copies: Vec::new(),
                    copy_layers: Vec::new(),
                    strided,
                });
            }
        }
        out
    }
}
