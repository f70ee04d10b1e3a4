//! Failure policy (docs/design.md §2.7; the seed's "Failure semantics" and "Carrier").
//!
//! Fail-open (the default) logs mismatched and unverified loads and completes them; fail-closed
//! makes them a load failure, handled by the load failure policy: `fail` ends the request with an
//! error, `recompute` discards the loaded KV and recomputes the prompt locally (kvferry reports
//! the action; the embedder performs it). KV is never fetched twice for one request.

use thiserror::Error;

use crate::verdict::Verdict;

/// What a load failure leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LoadFailurePolicy {
    /// The request ends with an error.
    #[default]
    Fail,
    /// The consumer discards the loaded KV and recomputes the whole prompt.
    Recompute,
}

impl std::str::FromStr for LoadFailurePolicy {
    type Err = String;
    /// Parses `fail` or `recompute`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fail" => Ok(LoadFailurePolicy::Fail),
            "recompute" => Ok(LoadFailurePolicy::Recompute),
            other => Err(format!(
                "load failure policy {other:?}: expected fail or recompute"
            )),
        }
    }
}

/// The checksum failure policy of one side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Policy {
    /// Fail-closed: a mismatch or unverified load is a load failure. Default false (fail-open).
    pub fail_closed: bool,
    /// How a load failure is handled.
    pub load_failure: LoadFailurePolicy,
}

/// What to do with a load after its verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Use the loaded KV.
    Complete,
    /// End the request with an error.
    Fail,
    /// Discard the loaded KV and recompute the prompt locally.
    Recompute,
}

/// Whether checksums can run in a setup, decided at startup ([`Policy::check_carrier`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CarrierCheck {
    /// A carrier exists: checksums are enabled.
    Enabled,
    /// No carrier, fail-open: checksums are disabled; the caller logs this warning text.
    DisabledWithWarning(&'static str),
}

/// Checksums enabled with no carrier under fail-closed: every load would fail.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("KV checksums are enabled and fail-closed, but this setup has no checksum carrier, so no load could be verified")]
pub struct NoCarrierError;

impl Policy {
    /// The action for a load with `verdict`: `Complete` when verified or fail-open; otherwise
    /// `Fail` or `Recompute` per the load failure policy.
    pub fn decide(&self, verdict: &Verdict) -> Action {
        if verdict.is_verified() || !self.fail_closed {
            return Action::Complete;
        }
        self.on_load_error()
    }

    /// The action for a load that did not land at all (bad spec, unreachable producer, ERROR
    /// reply, no reply, a deadline): `Fail` or `Recompute` per the load failure policy,
    /// fail-open or not (a load that did not land is never completed).
    pub fn on_load_error(&self) -> Action {
        match self.load_failure {
            LoadFailurePolicy::Fail => Action::Fail,
            LoadFailurePolicy::Recompute => Action::Recompute,
        }
    }

    /// Startup check for enabling checksums: with a carrier, enabled; without one, an error when
    /// fail-closed and a warning (checksums disabled) when fail-open.
    pub fn check_carrier(&self, has_carrier: bool) -> Result<CarrierCheck, NoCarrierError> {
        if has_carrier {
            Ok(CarrierCheck::Enabled)
        } else if self.fail_closed {
            Err(NoCarrierError)
        } else {
            Ok(CarrierCheck::DisabledWithWarning(
                "KV checksums are enabled but this setup has no checksum carrier: checksums disabled",
            ))
        }
    }
}
