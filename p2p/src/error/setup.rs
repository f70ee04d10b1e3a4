//! The typed causes of [`crate::P2pError`]'s setup and publish errors: [`WorkersFault`],
//! [`ConfigFault`], [`BindFailure`] and [`PublishFailure`]; and of a load refused before it
//! starts, [`LoadSpecFault`].

use std::time::Duration;

use kvferry_checksum::group::RankInfo;
use kvferry_checksum::policy::NoCarrierError;

use crate::proto::consumer::ShellError;
use crate::proto::producer_effects::PublishError;
use crate::proto::request::SpecError;
use crate::proto::spec_checks::TableError;

/// Why the workers do not form one TP×PP grid with agreeing groups and memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkersFault {
    /// No worker was given.
    #[error("no workers")]
    NoWorkers,
    /// A TP or PP size of 0.
    #[error("tp_size {tp} / pp_size {pp} must be at least 1")]
    ZeroSize {
        /// The first worker's TP size.
        tp: u32,
        /// Its PP size.
        pp: u32,
    },
    /// Another number of workers than the grid has ranks.
    #[error("{workers} workers for TP {tp} × PP {pp}")]
    Count {
        /// Workers given.
        workers: usize,
        /// The grid's TP size.
        tp: u32,
        /// Its PP size.
        pp: u32,
    },
    /// A worker with other sizes than the first, or a rank missing or given twice.
    #[error("worker {rank:?} does not fit a TP {tp} × PP {pp} grid (each rank exactly once)")]
    OffGrid {
        /// The worker's rank.
        rank: RankInfo,
        /// The grid's TP size.
        tp: u32,
        /// Its PP size.
        pp: u32,
    },
    /// A group id listed twice by the first worker.
    #[error("a group id appears twice")]
    DuplicateGroup,
    /// A worker whose groups (ids and block sizes, in order) differ from rank 0's.
    #[error("rank {rank:?} has groups {groups:?}, rank 0 has {reference:?} (ids and block sizes must agree)")]
    GroupsDiffer {
        /// The worker's rank.
        rank: RankInfo,
        /// Its `(group_id, block_size)` list.
        groups: Vec<(u32, u64)>,
        /// Rank 0's.
        reference: Vec<(u32, u64)>,
    },
    /// A group with a block size of 0 tokens.
    #[error("group {group}: block_size 0")]
    ZeroBlockSize {
        /// The group id.
        group: u32,
    },
    /// A layer whose geometry spans more bytes than its memory holds.
    #[error("layer {layer}: geometry spans {spans} bytes but len is {len}")]
    LayerTooShort {
        /// The layer's name.
        layer: String,
        /// Bytes its geometry spans.
        spans: u64,
        /// Bytes its memory holds.
        len: u64,
    },
    /// A layer whose geometry's block size (tokens) differs from its group's.
    #[error(
        "layer {layer}: block size {layer_block_size} but group {group} has {group_block_size}"
    )]
    BlockSizeDiffers {
        /// The layer's name.
        layer: String,
        /// Its geometry's block size, in tokens.
        layer_block_size: u64,
        /// The group id.
        group: u32,
        /// The group's block size, in tokens.
        group_block_size: u64,
    },
}

/// A configuration that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigFault {
    /// Checksums are on and fail-closed but nothing carries them.
    #[error(transparent)]
    NoCarrier(#[from] NoCarrierError),
    /// Some workers' transfer engines have another shared secret (or none) than the others.
    #[error("the workers' transfer engines do not all have the same shared secret")]
    SecretsDiffer,
    /// `ReadMode::Always` with a shared secret: over TCP or RDMA the producer's engines grant
    /// no READ in secret mode, so every load read would fail.
    #[error("reads on every path (ReadMode::Always) need open engines: with a shared secret only CUDA IPC serves reads (use ReadMode::Auto)")]
    AlwaysReadWithSecret,
}

/// Why the control socket could not be bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindFailure {
    /// The bind did not finish within this time.
    #[error("timed out after {0:?}")]
    TimedOut(Duration),
    /// The socket's own error.
    #[error("{0}")]
    Socket(#[source] ShellError),
}

/// Why a publish was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishFailure {
    /// A load key of 0 bytes or more than the limit.
    #[error("load key of {bytes} bytes (1..={max})")]
    KeyLength {
        /// The key's length in bytes.
        bytes: usize,
        /// The most allowed.
        max: usize,
    },
    /// No block table for a group the workers have.
    #[error("no block table for group {0}")]
    NoTable(u32),
    /// A block table that does not cover the tokens or names blocks outside the cache.
    #[error("{0}")]
    Table(#[source] TableError),
    /// Ordering after the caller's stream failed (the engine's error, or its task's).
    #[error("ordering after the caller's stream: {0}")]
    Order(#[source] ShellError),
    /// No random load key could be made (the OS's random source failed).
    #[error("no load key: {0}")]
    NoKey(#[source] ShellError),
    /// The producer refused it (e.g. the request id is already published).
    #[error("{0}")]
    Refused(#[source] PublishError),
}

/// Why a load spec was refused before any request was sent (nothing landed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadSpecFault {
    /// The spec does not fit the workers (unknown group, block outside the cache, ...).
    #[error("{0}")]
    Spec(#[source] SpecError),
    /// The engines could not grant write access to the load's blocks (their error).
    #[error("granting the load's blocks: {0}")]
    Grant(#[source] ShellError),
}
