//! Errors of the connector's API (docs/design.md §4): setup errors and load failures.

use kvferry_checksum::policy::{Action, Policy};

use crate::proto::consumer::FailReason;

mod setup;
pub use setup::{BindFailure, ConfigFault, LoadSpecFault, PublishFailure, WorkersFault};

/// Setup and publish errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum P2pError {
    /// The workers do not form a TP×PP grid, disagree on groups, or describe memory wrongly.
    #[error("workers: {0}")]
    Workers(#[source] WorkersFault),
    /// A configuration that cannot work (e.g. checksums fail-closed with no carrier).
    #[error("config: {0}")]
    Config(#[source] ConfigFault),
    /// The control socket could not be bound.
    #[error("bind {endpoint}: {why}")]
    Bind {
        /// The endpoint asked for.
        endpoint: String,
        /// Why.
        #[source]
        why: BindFailure,
    },
    /// A publish that cannot be accepted (duplicate id, wrong block table).
    #[error("publish {request_id:?}: {why}")]
    Publish {
        /// The request.
        request_id: String,
        /// Why.
        #[source]
        why: PublishFailure,
    },
    /// The producer's event loop is gone (shut down or crashed).
    #[error("producer is shut down")]
    Closed,
}

/// Why a load ended without an outcome. The blocks the load targeted hold no
/// usable KV; [`LoadError::action`] says what the embedder does (§2.7).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The load spec is inconsistent with the workers (unknown group, missing block, ...).
    #[error("load {request_id:?}: bad load spec: {why}")]
    Spec {
        /// The request.
        request_id: String,
        /// Why.
        #[source]
        why: LoadSpecFault,
    },
    /// The control connection could not be made.
    #[error("load {request_id:?}: cannot reach producer {producer}: {why}")]
    Connect {
        /// The request.
        request_id: String,
        /// The producer's endpoint.
        producer: String,
        /// Why.
        why: crate::proto::consumer::ConnectFailure,
    },
    /// Reading the producer's blocks failed (docs/design.md §4.10): the rank whose reads
    /// failed and why. Blocks may hold part of the KV: nothing of it is used.
    #[error("load {request_id:?}: reading the producer's blocks failed: {why}")]
    Read {
        /// The request.
        request_id: String,
        /// Which consumer rank's reads failed, and why.
        #[source]
        why: kvferry_transfer::Shared<crate::proto::serve_error::WriteError>,
    },
    /// The transfer failed: ERROR reply, no reply, or a lost connection.
    #[error("load {request_id:?}: {reason}")]
    Failed {
        /// The request.
        request_id: String,
        /// Why.
        reason: FailReason,
    },
}

impl LoadError {
    /// The request this error belongs to.
    pub fn request_id(&self) -> &str {
        match self {
            LoadError::Spec { request_id, .. }
            | LoadError::Connect { request_id, .. }
            | LoadError::Read { request_id, .. }
            | LoadError::Failed { request_id, .. } => request_id,
        }
    }

    /// What the embedder does about a failed load: the load failure policy
    /// (`fail` → [`Action::Fail`], `recompute` → [`Action::Recompute`]), fail-open
    /// or not — a load that did not land is never completed (§2.7).
    pub fn action(&self, policy: &Policy) -> Action {
        policy.on_load_error()
    }
}
