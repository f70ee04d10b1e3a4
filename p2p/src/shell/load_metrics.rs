//! A load's labels in the process's metrics (`kvferry_transfer::metrics`): its verdict (or
//! `failed` with why), its load and checksum times, a recompute.

use kvferry_checksum::policy::Action;
use kvferry_checksum::verdict::Verdict;

use crate::error::LoadError;

/// The first word of a `Debug` name in snake case (`NoChecksums(..)` -> `no_checksums`).
fn snake(debug: &str) -> String {
    let mut out = String::new();
    for (i, c) in debug
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .enumerate()
    {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// What the metrics need of a finished load (`LoadOutcome`'s fields).
pub(crate) struct Loaded<'a> {
    pub(crate) verdict: Option<&'a Verdict>,
    pub(crate) action: Action,
    pub(crate) transfer_seconds: f64,
    pub(crate) checksum_seconds: f64,
}

/// A load's verdict label and reason for the metrics.
fn verdict_labels(r: &Result<Loaded<'_>, &LoadError>) -> (&'static str, String) {
    match r {
        Ok(o) => match o.verdict {
            None => ("unchecked", String::new()),
            Some(Verdict::Verified) => ("verified", String::new()),
            Some(Verdict::Mismatch { .. }) => ("mismatch", String::new()),
            Some(Verdict::Unverified(v)) => (
                "unverified",
                v.first()
                    .map(|(_, why)| snake(&format!("{why:?}")))
                    .unwrap_or_default(),
            ),
        },
        Err(e) => (
            "failed",
            match e {
                LoadError::Spec { .. } => "spec".into(),
                LoadError::Connect { .. } => "connect".into(),
                LoadError::Read { .. } => "read".into(),
                LoadError::Failed { reason, .. } => snake(&format!("{reason:?}")),
            },
        ),
    }
}

/// Counts one load (its verdict or failure, times, a recompute) in the process's metrics.
pub(crate) fn record_load(r: &Result<Loaded<'_>, &LoadError>) {
    let m = kvferry_transfer::metrics::global();
    let (verdict, reason) = verdict_labels(r);
    match r {
        Ok(o) => {
            let checked = o.verdict.is_some().then_some(o.checksum_seconds);
            m.load(verdict, &reason, Some(o.transfer_seconds), checked);
            if o.action == Action::Recompute {
                m.recomputed();
            }
        }
        Err(_) => m.load(verdict, &reason, None, None),
    }
}
