//! Worker records and the coordinator's sums (docs/design.md §2.3; the seed's "Design" of the
//! replica commit).
//!
//! Each TP/PP worker reports, per group, its partial value per block position keyed by replica
//! key, its part of the fingerprint, and the groups it skipped. The coordinator needs every
//! worker's record. The producer sums replica 0 only (any copy describes the same KV); the
//! consumer builds one check per replica — check k sums copy `k mod R` of each layer replicated
//! on R ranks — so every copy is compared, since each was written by its own transfer.

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

use crate::group::{RankInfo, ReplicaKey, SkipReason};
use crate::payload::{Payload, PayloadGroup, PAYLOAD_VERSION};
use crate::select::BlockSelection;
use crate::unverified::UnverifiedReason;

/// One worker's values for one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord {
    /// KV cache group id.
    pub group_id: u32,
    /// Tokens per block on this side.
    pub block_size: u64,
    /// Position of the first value.
    pub start: u64,
    /// Sum of this worker's layer fingerprints (mod 2^64); `None` when a layer has no kind or dtype.
    pub fingerprint: Option<u64>,
    /// Replica key → one partial value per position from `start` (every vector the same length).
    /// A producer's replicas other than 0 report no entry.
    pub values: BTreeMap<ReplicaKey, Vec<u64>>,
}

/// What one worker reports for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRecord {
    /// The worker's TP/PP place.
    pub rank: RankInfo,
    /// Groups it checksummed.
    pub groups: Vec<GroupRecord>,
    /// Groups it could not checksum, with the reason.
    pub skipped: Vec<(u32, SkipReason)>,
}

/// Why the producer's coordinator cannot build a payload (the producer then sends no checksums,
/// with a warning).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RecordError {
    /// The worker at (tp_rank, pp_rank) did not report.
    #[error("worker tp_rank={tp_rank} pp_rank={pp_rank} did not report")]
    MissingWorker {
        /// TP rank of the absent worker (0-based, below `tp_size`).
        tp_rank: u32,
        /// PP rank of the absent worker (0-based, below `pp_size`).
        pp_rank: u32,
    },
    /// A record for a rank outside `tp_size × pp_size`, or two records for one rank.
    #[error("unexpected record for tp_rank={tp_rank} pp_rank={pp_rank}")]
    UnexpectedWorker {
        /// TP rank the record claims.
        tp_rank: u32,
        /// PP rank the record claims.
        pp_rank: u32,
    },
    /// Workers disagree on a group's blocks (block size, start, count) or one lacks the group.
    #[error("group {group_id}: workers checksummed other blocks")]
    OtherBlocks {
        /// The KV cache group's id.
        group_id: u32,
    },
}

/// Index records by (pp, tp); every rank of `tp_size × pp_size` exactly once.
fn index_records(
    records: &[WorkerRecord],
    tp: u32,
    pp: u32,
) -> Result<BTreeMap<(u32, u32), &WorkerRecord>, RecordError> {
    let mut by_rank = BTreeMap::new();
    for r in records {
        let (t, p) = (r.rank.tp_rank, r.rank.pp_rank);
        if t >= tp || p >= pp || by_rank.insert((p, t), r).is_some() {
            return Err(RecordError::UnexpectedWorker {
                tp_rank: t,
                pp_rank: p,
            });
        }
    }
    for p in 0..pp {
        for t in 0..tp {
            if !by_rank.contains_key(&(p, t)) {
                return Err(RecordError::MissingWorker {
                    tp_rank: t,
                    pp_rank: p,
                });
            }
        }
    }
    Ok(by_rank)
}

/// Per group: every worker's record of it, or the skip reason if any worker skipped it.
enum Gathered<'a> {
    Skipped(SkipReason),
    Records(Vec<(RankInfo, &'a GroupRecord)>),
}

/// Every group id any worker mentions → its gathered records, or `None` when workers
/// checksummed other blocks (disagree on block size, start or count, or one lacks the group).
fn gather<'a>(
    by_rank: &BTreeMap<(u32, u32), &'a WorkerRecord>,
) -> BTreeMap<u32, Option<Gathered<'a>>> {
    let mut ids = BTreeSet::new();
    for r in by_rank.values() {
        ids.extend(r.groups.iter().map(|g| g.group_id));
        ids.extend(r.skipped.iter().map(|s| s.0));
    }
    let mut out = BTreeMap::new();
    'ids: for id in ids {
        if let Some(reason) = by_rank
            .values()
            .find_map(|r| r.skipped.iter().find(|s| s.0 == id).map(|s| s.1))
        {
            out.insert(id, Some(Gathered::Skipped(reason)));
            continue;
        }
        let mut recs = Vec::new();
        for r in by_rank.values() {
            let mut mine = r.groups.iter().filter(|g| g.group_id == id);
            match (mine.next(), mine.next()) {
                (Some(g), None) => recs.push((r.rank, g)),
                _ => {
                    out.insert(id, None);
                    continue 'ids;
                }
            }
        }
        let first = recs[0].1;
        let lens: BTreeSet<usize> = recs
            .iter()
            .flat_map(|(_, g)| g.values.values().map(Vec::len))
            .collect();
        let same = recs
            .iter()
            .all(|(_, g)| g.block_size == first.block_size && g.start == first.start);
        out.insert(
            id,
            (same && lens.len() <= 1 && first.block_size > 0).then_some(Gathered::Records(recs)),
        );
    }
    out
}

/// Number of positions of a gathered group (0 when no worker holds values).
fn positions(recs: &[(RankInfo, &GroupRecord)]) -> usize {
    recs.iter()
        .flat_map(|(_, g)| g.values.values().map(Vec::len))
        .next()
        .unwrap_or(0)
}

/// The group's fingerprint: one TP rank's part per PP stage, summed over stages (every TP rank
/// of a stage holds the same layers). 0 when any part is unknown.
fn group_fingerprint(recs: &[(RankInfo, &GroupRecord)]) -> u64 {
    let mut per_stage: BTreeMap<u32, Option<u64>> = BTreeMap::new();
    for (rank, g) in recs {
        per_stage.entry(rank.pp_rank).or_insert(g.fingerprint);
    }
    per_stage
        .values()
        .try_fold(0u64, |acc, f| f.map(|f| acc.wrapping_add(f)))
        .unwrap_or(0)
}

/// The producer's coordinator: sums replica 0 of every group over all `tp_size × pp_size`
/// workers into a [`Payload`] for tokens `[0, num_tokens)`; groups any worker skipped are left
/// out. Errors: a missing or unexpected worker, or workers that checksummed other blocks.
pub fn producer_payload(
    records: &[WorkerRecord],
    tp_size: u32,
    pp_size: u32,
    num_tokens: u64,
) -> Result<Payload, RecordError> {
    let by_rank = index_records(records, tp_size, pp_size)?;
    let mut groups = Vec::new();
    for (id, g) in gather(&by_rank) {
        let recs = match g {
            None => return Err(RecordError::OtherBlocks { group_id: id }),
            Some(Gathered::Skipped(_)) => continue,
            Some(Gathered::Records(recs)) => recs,
        };
        let n = positions(&recs);
        let mut values = vec![0u64; n];
        for (_, rec) in &recs {
            for (key, vals) in &rec.values {
                if key.index != 0 {
                    continue;
                }
                for (acc, v) in values.iter_mut().zip(vals) {
                    *acc = acc.wrapping_add(*v);
                }
            }
        }
        let first = recs[0].1;
        groups.push(PayloadGroup {
            group_id: id,
            fingerprint: group_fingerprint(&recs),
            block_size: first.block_size,
            start: first.start,
            values,
        });
    }
    Ok(Payload {
        version: PAYLOAD_VERSION,
        tp_size,
        num_tokens,
        groups,
    })
}

/// One group on the consumer side after summing the workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsumerGroup {
    /// Summed: one check per replica, each one value per position from `start`.
    Checked {
        /// Tokens per block on the consumer.
        block_size: u64,
        /// Position of the first value.
        start: u64,
        /// Group fingerprint (0 when unknown).
        fingerprint: u64,
        /// `checks[k][i]`: copy `k mod R` of every layer, position `start + i`.
        checks: Vec<Vec<u64>>,
    },
    /// Some worker skipped the group.
    Skipped(SkipReason),
    /// The group cannot be compared (other blocks, a replica not checksummed).
    Unverified(UnverifiedReason),
}

/// The consumer coordinator's sums for one load (§2.3): per group, block size, start,
/// fingerprint and one check per replica; plus the tokens the consumer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerSums {
    /// Tokens the consumer holds after the load (`num_computed`).
    pub num_tokens: u64,
    /// Per group id.
    pub groups: BTreeMap<u32, ConsumerGroup>,
}

impl ConsumerSums {
    /// Marks group `group_id` [`UnverifiedReason::OtherBlocks`] when its checked positions are not
    /// exactly `scheduled` (the blocks the coordinator asked the workers to checksum).
    pub fn expect_blocks(&mut self, group_id: u32, scheduled: &BlockSelection) {
        if let Some(g) = self.groups.get_mut(&group_id) {
            if let ConsumerGroup::Checked { start, checks, .. } = g {
                let len = checks.first().map(Vec::len).unwrap_or(0);
                if *start != scheduled.start || len != scheduled.block_ids.len() {
                    *g = ConsumerGroup::Unverified(UnverifiedReason::OtherBlocks);
                }
            }
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Most replica checks a group may need; TP sizes keep it far below this.
const MAX_CHECKS: u64 = 4096;

/// The consumer's coordinator: sums all `tp_size × pp_size` workers' records, one check per
/// replica per group (check k sums copy `k mod R` of each layer on R ranks, k < lcm of the R).
/// A group whose replica copies were not all reported (per PP stage, copy i of R must come from
/// `tp_size / R` workers) is [`UnverifiedReason::ReplicaNotChecksummed`]; workers disagreeing on a
/// group's blocks make it [`UnverifiedReason::OtherBlocks`]. Err
/// ([`UnverifiedReason::NotEveryWorkerReported`]) when a worker is missing or unexpected.
pub fn consumer_sums(
    records: &[WorkerRecord],
    tp_size: u32,
    pp_size: u32,
    num_tokens: u64,
) -> Result<ConsumerSums, UnverifiedReason> {
    let by_rank = index_records(records, tp_size, pp_size)
        .map_err(|_| UnverifiedReason::NotEveryWorkerReported)?;
    let groups = gather(&by_rank)
        .into_iter()
        .map(|(id, g)| (id, sum_group(g, tp_size)))
        .collect();
    Ok(ConsumerSums { num_tokens, groups })
}

fn sum_group(g: Option<Gathered<'_>>, tp_size: u32) -> ConsumerGroup {
    let recs = match g {
        None => return ConsumerGroup::Unverified(UnverifiedReason::OtherBlocks),
        Some(Gathered::Skipped(r)) => return ConsumerGroup::Skipped(r),
        Some(Gathered::Records(r)) => r,
    };
    // Every copy of every replicated layer must be reported, per PP stage.
    let mut counts: BTreeMap<(u32, u32), BTreeMap<u32, u32>> = BTreeMap::new(); // (pp, R) → index → workers
    for (rank, g) in &recs {
        for key in g.values.keys() {
            *counts
                .entry((rank.pp_rank, key.replicas))
                .or_default()
                .entry(key.index)
                .or_default() += 1;
        }
    }
    for ((_, r), idx) in &counts {
        let want = if *r == 0 || !tp_size.is_multiple_of(*r) {
            u32::MAX
        } else {
            tp_size / r
        };
        if (0..*r).any(|i| idx.get(&i).copied() != Some(want)) || idx.keys().any(|i| i >= r) {
            return ConsumerGroup::Unverified(UnverifiedReason::ReplicaNotChecksummed);
        }
    }
    let checks_n = counts.keys().fold(1u64, |l, &(_, r)| {
        let r = r as u64;
        (l / gcd(l, r) * r).min(MAX_CHECKS + 1)
    });
    if checks_n > MAX_CHECKS {
        return ConsumerGroup::Unverified(UnverifiedReason::ReplicaNotChecksummed);
    }
    let n = positions(&recs);
    let mut checks = vec![vec![0u64; n]; checks_n as usize];
    for (k, check) in checks.iter_mut().enumerate() {
        for (_, g) in &recs {
            for (key, vals) in &g.values {
                if k as u32 % key.replicas != key.index {
                    continue;
                }
                for (acc, v) in check.iter_mut().zip(vals) {
                    *acc = acc.wrapping_add(*v);
                }
            }
        }
    }
    let first = recs[0].1;
    ConsumerGroup::Checked {
        block_size: first.block_size,
        start: first.start,
        fingerprint: group_fingerprint(&recs),
        checks,
    }
}
