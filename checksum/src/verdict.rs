//! Comparison and verdicts (docs/design.md §2.6; the seed's "Verdicts" and block-size commit).
//!
//! Each group is compared on its own, at positions both sides checksummed. With different block
//! sizes, where one divides the other, both sides' blocks are summed into chunks of the larger
//! size (consecutive blocks add up, §2.1) and chunks both cover whole, holding the same number of
//! tokens, are compared; blocks past the last token count as zero.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::{Mutex, OnceLock};

use crate::payload::{Payload, PayloadError, PayloadGroup};
use crate::record::{ConsumerGroup, ConsumerSums};
pub use crate::unverified::UnverifiedReason;

/// A group whose values differ at some compared positions (the consumer's block positions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// KV cache group id.
    pub group_id: u32,
    /// Consumer block positions in differing chunks, ascending.
    pub positions: Vec<u64>,
}

/// The outcome of comparing one load (§2.6). A mismatch anywhere wins over unverified groups,
/// and still carries the unverified findings of the other groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every compared position of every compared group matches.
    Verified,
    /// Some positions differ.
    Mismatch {
        /// Groups with differing positions.
        mismatches: Vec<Mismatch>,
        /// Other groups that could not be compared (group id, reason).
        unverified: Vec<(Option<u32>, UnverifiedReason)>,
    },
    /// Nothing differs but some group (`Some(id)`) or the whole load (`None`) could not be compared.
    Unverified(Vec<(Option<u32>, UnverifiedReason)>),
}

impl Verdict {
    /// Whether the load verified.
    pub fn is_verified(&self) -> bool {
        matches!(self, Verdict::Verified)
    }

    /// All unverified findings (of either non-verified variant).
    pub fn unverified(&self) -> &[(Option<u32>, UnverifiedReason)] {
        match self {
            Verdict::Verified => &[],
            Verdict::Mismatch { unverified, .. } | Verdict::Unverified(unverified) => unverified,
        }
    }
}

/// Sums `values` (blocks of `bs` tokens from position `start`) into chunks of `l` tokens: chunk
/// q → (sum, tokens in chunk) for chunks whose blocks holding tokens `< num_tokens` are all present.
/// Returned densely: the first chunk `q0` and, for each chunk from it, its entry or `None` (a chunk
/// left out); at most `values.len() + 1` entries (`l` is a multiple of `bs`), so a lookup is an
/// index, not a tree walk (a 4096-token load compares 256 chunks per check).
fn chunk_sums(
    values: &[u64],
    start: u64,
    bs: u64,
    l: u64,
    num_tokens: u64,
) -> (u64, Vec<Option<(u64, u64)>>) {
    let per = l / bs;
    let end = start + values.len() as u64;
    if values.is_empty() {
        return (0, Vec::new());
    }
    let (q0, q1) = (start * bs / l, (end * bs).div_ceil(l));
    let mut out = Vec::with_capacity((q1 - q0) as usize);
    for q in q0..q1 {
        let tokens = num_tokens.saturating_sub(q * l).min(l);
        if tokens == 0 {
            out.push(None);
            continue;
        }
        let mut sum = 0u64;
        let mut whole = true;
        for pos in q * per..(q + 1) * per {
            if pos * bs >= num_tokens {
                break; // past the last token: counts zero
            }
            if pos < start || pos >= end {
                whole = false;
                break;
            }
            sum = sum.wrapping_add(values[(pos - start) as usize]);
        }
        out.push(whole.then_some((sum, tokens)));
    }
    (q0, out)
}

/// Whether `len` blocks of `bs` tokens from position `start`, rounded up to chunks of `l`
/// tokens, end at a token offset a `u64` holds (what [`chunk_sums`] computes with).
fn positions_fit(start: u64, len: usize, bs: u64, l: u64) -> bool {
    start
        .checked_add(len as u64)
        .and_then(|end| end.checked_mul(bs))
        .and_then(|t| t.checked_add(l))
        .is_some()
}

/// Compares one group present on both sides; `Ok(positions)` lists mismatching consumer positions.
fn compare_group(
    p: &PayloadGroup,
    p_tokens: u64,
    c: &ConsumerGroup,
    c_tokens: u64,
) -> Result<Vec<u64>, UnverifiedReason> {
    let ConsumerGroup::Checked {
        block_size: cbs,
        start: cstart,
        fingerprint,
        checks,
    } = c
    else {
        return Err(UnverifiedReason::OneSideOnly);
    };
    let (pbs, cbs, cstart) = (p.block_size, *cbs, *cstart);
    // The layer fingerprint hashes the block size (§2.3), so it is comparable only between equal
    // block sizes; with different ones the per-position values alone decide.
    if pbs == cbs && p.fingerprint != *fingerprint {
        return Err(UnverifiedReason::FingerprintDiffers);
    }
    if cbs == 0 || pbs == 0 {
        return Err(UnverifiedReason::BlockSizesIncompatible);
    }
    let l = pbs.max(cbs);
    if l % pbs.min(cbs) != 0 {
        return Err(UnverifiedReason::BlockSizesIncompatible);
    }
    // The producer's start and block size come off the wire: positions whose token offsets do
    // not fit in a u64 are not what a producer writes (chunk_sums' arithmetic would overflow).
    if !positions_fit(p.start, p.values.len(), pbs, l) {
        return Err(UnverifiedReason::InvalidChecksums);
    }
    if checks
        .iter()
        .any(|c| !positions_fit(cstart, c.len(), cbs, l))
    {
        return Err(UnverifiedReason::NoCommonPosition);
    }
    if cbs < pbs && (cstart * cbs) % pbs != 0 {
        return Err(UnverifiedReason::UnalignedStart);
    }
    let (p0, prod) = chunk_sums(&p.values, p.start, pbs, l, p_tokens);
    let mut bad: BTreeSet<u64> = BTreeSet::new();
    let mut compared = false;
    for check in checks {
        let (c0, cons) = chunk_sums(check, cstart, cbs, l, c_tokens);
        for (q, c) in (c0..).zip(&cons) {
            let Some((csum, ctok)) = c else {
                continue;
            };
            let at = q.checked_sub(p0).and_then(|i| usize::try_from(i).ok());
            let Some((psum, ptok)) = at.and_then(|i| prod.get(i)).copied().flatten() else {
                continue;
            };
            if ptok != *ctok {
                continue;
            }
            compared = true;
            if psum != *csum {
                bad.insert(q);
            }
        }
    }
    if !compared {
        return Err(UnverifiedReason::NoCommonPosition);
    }
    let per = l / cbs;
    let cend = cstart + checks.first().map_or(0, |c| c.len() as u64);
    Ok(bad
        .iter()
        .flat_map(|q| (q * per..(q + 1) * per).filter(|pos| *pos >= cstart && *pos < cend))
        .collect())
}

/// Compares the producer's payload (`Err`: it failed to decode; `Ok(None)`: none arrived) with the
/// consumer's sums (§2.6). Groups skipped on both sides are left out; skipped or present on one
/// side only is [`UnverifiedReason::OneSideOnly`].
pub fn compare(
    expected: Result<Option<&Payload>, &PayloadError>,
    consumer: &ConsumerSums,
) -> Verdict {
    let payload = match expected {
        Err(_) => return Verdict::Unverified(vec![(None, UnverifiedReason::InvalidChecksums)]),
        Ok(None) => return Verdict::Unverified(vec![(None, UnverifiedReason::NoChecksums)]),
        Ok(Some(p)) => p,
    };
    let mut producer: BTreeMap<u32, &PayloadGroup> = BTreeMap::new();
    let mut unverified = Vec::new();
    for g in &payload.groups {
        if producer.insert(g.group_id, g).is_some() {
            // The same group twice: the payload is not what a producer writes.
            return Verdict::Unverified(vec![(None, UnverifiedReason::InvalidChecksums)]);
        }
    }
    let ids: BTreeSet<u32> = producer
        .keys()
        .chain(consumer.groups.keys())
        .copied()
        .collect();
    let mut mismatches = Vec::new();
    for id in ids {
        let result = match (producer.get(&id), consumer.groups.get(&id)) {
            (None, None) => continue,
            (None, Some(ConsumerGroup::Skipped(_))) => continue,
            (_, Some(ConsumerGroup::Unverified(r))) => Err(*r),
            (Some(_), Some(ConsumerGroup::Skipped(_))) | (Some(_), None) | (None, Some(_)) => {
                Err(UnverifiedReason::OneSideOnly)
            }
            (Some(p), Some(c)) => compare_group(p, payload.num_tokens, c, consumer.num_tokens),
        };
        match result {
            Err(r) => unverified.push((Some(id), r)),
            Ok(pos) if pos.is_empty() => {}
            Ok(positions) => mismatches.push(Mismatch {
                group_id: id,
                positions,
            }),
        }
    }
    if !mismatches.is_empty() {
        Verdict::Mismatch {
            mismatches,
            unverified,
        }
    } else if !unverified.is_empty() {
        Verdict::Unverified(unverified)
    } else {
        Verdict::Verified
    }
}

/// Logs a verdict for `request_id` through `tracing` (§2.6): a mismatch as an error with group ids
/// and positions; each unverified reason once per process at warn; per-request details at debug.
pub fn log_verdict(request_id: &str, verdict: &Verdict) {
    static WARNED: OnceLock<Mutex<HashSet<UnverifiedReason>>> = OnceLock::new();
    if let Verdict::Mismatch { mismatches, .. } = verdict {
        for m in mismatches {
            tracing::error!(request_id, group_id = m.group_id, positions = ?m.positions, "KV checksum mismatch");
        }
    }
    for (group, reason) in verdict.unverified() {
        let first = WARNED
            .get_or_init(Default::default)
            .lock()
            .map(|mut s| s.insert(*reason))
            .unwrap_or(false);
        if first {
            tracing::warn!(reason = %reason, "KV load unverified (logged once per reason; details at debug)");
        }
        tracing::debug!(request_id, group_id = ?group, reason = %reason, "KV load unverified");
    }
    if verdict.is_verified() {
        tracing::debug!(request_id, "KV load verified");
    }
}
