//! What `demo` and `load` share about a series of loads: the producer's and consumer's
//! settings from the common options (every wait bounded by `--timeout`), the seeded prompt
//! lengths both sides replay, and the verdict and action counts they report.

use std::time::Duration;

use kvferry_checksum::policy::{Action, LoadFailurePolicy, Policy};
use kvferry_checksum::verdict::Verdict;
use kvferry_p2p::{ConsumerConfig, LoadGroup, ProducerConfig, ReadCheck};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::cli::{CommonArgs, FailurePolicyArg, ReadCheckArg};
use crate::models::ModelShape;

/// The consumer's settings for the common options: every wait bounded by `--timeout`.
pub(crate) fn consumer_config(c: &CommonArgs) -> ConsumerConfig {
    let timeout = Duration::from_secs_f64(c.timeout);
    ConsumerConfig {
        policy: policy_of(c),
        reply_timeout: timeout,
        max_wait: timeout,
        connect_timeout: timeout.min(Duration::from_secs(5)),
        read_group_bytes: c.read_group_mib.saturating_mul(1 << 20),
        read_check: match c.read_check {
            ReadCheckArg::OnePass => ReadCheck::OnePass,
            ReadCheckArg::AfterLanding => ReadCheck::AfterLanding,
        },
        ..ConsumerConfig::default()
    }
}

/// The producer's settings for the common options: a load's WRITEs may take half of
/// `--timeout`. The consumer's budget is `--timeout` less at most 1 s, and the producer
/// starts no transfer unless its whole transfer deadline fits in that budget, so a
/// fixed deadline (30 s by default) would refuse every load under a shorter `--timeout`.
pub(crate) fn producer_config(c: &CommonArgs) -> ProducerConfig {
    ProducerConfig {
        transfer_timeout: Duration::from_secs_f64(c.timeout / 2.0),
        ..ProducerConfig::default()
    }
}

/// Verdict and action counts of a series of loads (shared by `demo` and `load`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct LoadCounts {
    /// Loads whose verdict was Verified.
    pub verified: u32,
    /// Loads whose verdict was Mismatch.
    pub mismatch: u32,
    /// Loads whose verdict was Unverified (or that ran without checksums).
    pub unverified: u32,
    /// Loads that ended with an error (fail-closed + `fail`, or a transport failure).
    pub failed: u32,
    /// Loads the consumer recomputed (fail-closed + `recompute`).
    pub recomputed: u32,
    /// Loads that completed (the loaded KV used).
    pub completed: u32,
}

impl LoadCounts {
    /// Counts one finished load's verdict and action.
    pub fn record(&mut self, verdict: Option<&Verdict>, action: Action) {
        match verdict {
            Some(Verdict::Verified) => self.verified += 1,
            Some(Verdict::Mismatch { .. }) => self.mismatch += 1,
            Some(Verdict::Unverified(_)) | None => self.unverified += 1,
        }
        match action {
            Action::Complete => self.completed += 1,
            Action::Fail => self.failed += 1,
            Action::Recompute => self.recomputed += 1,
        }
    }
}

pub(crate) fn policy_of(c: &CommonArgs) -> Policy {
    Policy {
        fail_closed: c.fail_closed,
        load_failure: match c.load_failure_policy {
            FailurePolicyArg::Fail => LoadFailurePolicy::Fail,
            FailurePolicyArg::Recompute => LoadFailurePolicy::Recompute,
        },
    }
}

/// Prompt lengths of `n` requests, spread over [min, max] (seeded).
pub fn prompt_lengths(n: u32, min: u64, max: u64, seed: u64) -> Vec<u64> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0x5eed_1e57);
    (0..n).map(|_| rng.random_range(min..=max)).collect()
}

/// The groups of a load of `model`'s KV: for each KV cache group, the producer's block table
/// (`remote`, blocks of `remote_block_size` tokens) and the consumer's (`local`), as
/// [`crate::world::request_tables`] gives them (indexed by group id).
pub(crate) fn load_groups(
    model: &ModelShape,
    remote: &[Vec<Option<u64>>],
    local: &[Vec<Option<u64>>],
    remote_block_size: u64,
) -> Vec<LoadGroup> {
    model
        .groups()
        .into_iter()
        .map(|g| LoadGroup {
            remote_block_size: Some(remote_block_size),
            group_id: g,
            remote_blocks: remote[g as usize].clone(),
            local_blocks: local[g as usize].clone(),
        })
        .collect()
}
