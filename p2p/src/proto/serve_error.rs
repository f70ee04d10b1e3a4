//! Why a load cannot be served (docs/design.md §4): the request does not fit the lease or the
//! producer's ranks ([`ServeError`], from the plan), or a WRITE failed ([`WriteError`]). The
//! text of a [`ServeFailure`] goes to the consumer in the ERROR reply.

use std::time::Duration;

use kvferry_checksum::group::RankInfo;
use kvferry_checksum::layout::LayoutError;
use kvferry_transfer::TransferError;

use crate::proto::msg::ErrorReason;
use crate::proto::plan::PlanError;
use crate::proto::spec_checks::{DtypeError, TableError};
use crate::proto::wire::Incompatible;

/// Why a consumer's request cannot be served. The text goes to the consumer in the ERROR reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServeError {
    /// The request asks for more tokens than the lease holds.
    #[error("consumer asks for {asked} tokens, the producer published {published}")]
    TooManyTokens {
        /// Tokens asked for.
        asked: u64,
        /// Tokens published.
        published: u64,
    },
    /// A group's positions and block lists have different lengths.
    #[error("group {0}: positions and block lists differ in length")]
    ListLengths(u32),
    /// The lease has no block table for the group.
    #[error("group {0} was not published")]
    NotPublished(u32),
    /// The request lists a group's blocks more than once (each listing would copy the lease's
    /// blocks again).
    #[error("group {0} is listed more than once")]
    GroupTwice(u32),
    /// The producer's ranks have no such group.
    #[error("producer has no group {0}")]
    NoGroup(u32),
    /// The request's block lists break a table rule (`proto::spec_checks`).
    #[error(transparent)]
    Table(#[from] TableError),
    /// The consumer was told another producer block size than the producer's, or (from a
    /// consumer that names no producer block size) its own block size differs, or it is 0.
    #[error("group {group}: the consumer loads blocks of {consumer} tokens as the producer's, the producer's hold {producer}")]
    BlockSize {
        /// The group.
        group: u32,
        /// The producer block size the consumer names (tokens).
        consumer: u64,
        /// The producer's block size (tokens).
        producer: u64,
    },
    /// A state group (Mamba-type, no per-token blocks) asked for token by token.
    #[error(
        "group {0}: a state group (no per-token KV blocks) moves only between equal block sizes"
    )]
    StateBlockSize(u32),
    /// With different block sizes, the producer positions are not strictly ascending.
    #[error("group {0}: remote_positions not strictly ascending")]
    RemoteOrder(u32),
    /// The consumer's block positions are not strictly ascending: a position named twice
    /// would copy one producer block again for every repeat.
    #[error("group {0}: positions not strictly ascending")]
    PositionOrder(u32),
    /// The consumer names a producer block the lease does not hold at that position.
    #[error("group {group} position {position}: consumer expects producer block {expected}, the producer holds {}", .held.map_or_else(|| "no block there".to_string(), |h| format!("block {h}")))]
    WrongBlock {
        /// The group.
        group: u32,
        /// The block position.
        position: u64,
        /// The producer block the consumer named.
        expected: u64,
        /// The block the lease holds there (`None`: a null block or past the table).
        held: Option<u64>,
    },
    /// A position at or past the published tokens.
    #[error("group {group} position {position} is past the published tokens")]
    PastTokens {
        /// The group.
        group: u32,
        /// The block position.
        position: u64,
    },
    /// The consumer's ranks are not its TP × PP grid.
    #[error("consumer names {named} ranks for TP {tp} × PP {pp}")]
    RankCount {
        /// Ranks named.
        named: usize,
        /// The consumer's TP size.
        tp: u32,
        /// The consumer's PP size.
        pp: u32,
    },
    /// A consumer rank outside the grid or named twice.
    #[error(
        "consumer must name rank tp={tp_rank} pp={pp_rank} exactly once, inside TP {tp} × PP {pp}"
    )]
    RankTwice {
        /// The rank's TP index.
        tp_rank: u32,
        /// The rank's PP index.
        pp_rank: u32,
        /// The consumer's TP size.
        tp: u32,
        /// The consumer's PP size.
        pp: u32,
    },
    /// A consumer rank names one of the producer's own segments: the producer would write
    /// the lease's blocks over its own KV memory (inside one process, with no grant checked).
    #[error("consumer rank tp={tp_rank} pp={pp_rank} names the producer's own segment {segment}")]
    OwnSegment {
        /// The rank's TP index.
        tp_rank: u32,
        /// The rank's PP index.
        pp_rank: u32,
        /// The segment it names.
        segment: String,
    },
    /// A consumer rank sent no layers for a loaded group.
    #[error("consumer rank tp={tp_rank} pp={pp_rank} sent no layers for group {group}")]
    RankWithoutGroup {
        /// The rank's TP index.
        tp_rank: u32,
        /// The rank's PP index.
        pp_rank: u32,
        /// The group.
        group: u32,
    },
    /// A producer rank lacks a group the others have.
    #[error("rank {rank:?} has no group {group}")]
    ProducerRankWithoutGroup {
        /// The producer rank.
        rank: RankInfo,
        /// The group.
        group: u32,
    },
    /// A producer layer the consumer does not hold.
    #[error("consumer has no layer {name:?} in group {group}")]
    NoConsumerLayer {
        /// The layer.
        name: String,
        /// The group.
        group: u32,
    },
    /// A consumer rank listed a layer of a group twice (its blocks would be written twice).
    #[error("consumer rank tp={tp_rank} pp={pp_rank} lists layer {name:?} of group {group} twice")]
    LayerTwice {
        /// The rank's TP index.
        tp_rank: u32,
        /// The rank's PP index.
        pp_rank: u32,
        /// The layer.
        name: String,
        /// The group.
        group: u32,
    },
    /// A consumer layer the producer does not hold.
    #[error("producer has no layer {name:?} in group {group}")]
    NoProducerLayer {
        /// The layer.
        name: String,
        /// The group.
        group: u32,
    },
    /// The sides hold different numbers of KV heads of a layer (another model).
    #[error(
        "layer {name:?}: the consumer's ranks hold {consumer} KV heads, the producer's {producer}"
    )]
    HeadCount {
        /// The layer.
        name: String,
        /// KV heads over the consumer's ranks.
        consumer: u64,
        /// KV heads over the producer's ranks.
        producer: u64,
    },
    /// One layer cannot be paired.
    #[error("layer {name}: {source}")]
    Layer {
        /// The layer.
        name: String,
        /// Why.
        source: LayerError,
    },
}

/// Why one consumer layer cannot be paired with the producer's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayerError {
    /// The consumer's geometry does not decode.
    #[error("consumer geometry: {0}")]
    Geometry(#[source] LayoutError),
    /// The consumer's geometry spans more than its array.
    #[error("consumer geometry spans more than its {0} bytes")]
    PastArray(u64),
    /// The consumer's array runs past the end of the address space (`addr + len` overflows
    /// u64), so no address inside it can be computed.
    #[error("consumer array at {addr:#x} of {len} bytes runs past the end of the address space")]
    AddressWraps {
        /// The array's address.
        addr: u64,
        /// Its bytes.
        len: u64,
    },
    /// The two sides' arrays cannot be copied byte-for-byte.
    #[error(transparent)]
    Incompatible(#[from] Incompatible),
    /// The two sides' element types differ (`proto::spec_checks`).
    #[error(transparent)]
    Dtype(#[from] DtypeError),
    /// The head offset plus the head count overflows.
    #[error("head offset overflows")]
    HeadOverflow,
    /// The consumer rank holds heads past the producer's.
    #[error("consumer rank tp={tp_rank} holds KV heads {first}..{end}, the producer's ranks only 0..{held_end}")]
    HeadsPastProducer {
        /// The consumer rank's TP index.
        tp_rank: u32,
        /// Its first global KV head.
        first: u64,
        /// One past its last.
        end: u64,
        /// One past the producer's last.
        held_end: u64,
    },
    /// No producer rank holds a head the consumer rank holds.
    #[error("no producer rank holds KV head {head} (consumer rank tp={tp_rank} holds heads {first}..{end})")]
    HeadNotHeld {
        /// The head.
        head: u64,
        /// The consumer rank's TP index.
        tp_rank: u32,
        /// Its first global KV head.
        first: u64,
        /// One past its last.
        end: u64,
    },
    /// A block id outside a side's array.
    #[error("block {remote} → {local} outside the arrays ({producer_blocks} / {consumer_blocks} blocks)")]
    BlockOutside {
        /// The producer block.
        remote: u64,
        /// The consumer block.
        local: u64,
        /// Blocks of the producer's array.
        producer_blocks: u64,
        /// Blocks of the consumer's array.
        consumer_blocks: u64,
    },
    /// The consumer's array holds blocks of another size than its group's (different block
    /// sizes are filled token by token, which needs the consumer's own block size).
    #[error("consumer array holds blocks of {array} tokens, its group {group}")]
    BlockSizeOfArray {
        /// Tokens per block of the consumer's array (its geometry).
        array: u64,
        /// The consumer group's block size (tokens).
        group: u64,
    },
    /// The block's byte ranges cannot be paired.
    #[error(transparent)]
    Pair(#[from] PlanError),
}

/// Why one rank's copies failed: a producer rank's WRITEs into a consumer rank, or a consumer
/// rank's READs from a producer rank (docs/design.md §4.10).
#[derive(Debug, thiserror::Error)]
#[error("rank tp={} pp={}: {kind}", .rank.tp_rank, .rank.pp_rank)]
pub struct WriteError {
    /// The rank that copied: the producer's when it writes, the consumer's when it reads.
    pub rank: RankInfo,
    /// What failed.
    #[source]
    pub kind: WriteErrorKind,
}

/// What failed in a rank's WRITEs.
#[derive(Debug, thiserror::Error)]
pub enum WriteErrorKind {
    /// Opening the consumer's segment and submitting did not end within the load's deadline.
    #[error("opening the consumer segment took over {0:?}")]
    OpenTimeout(Duration),
    /// A large load's layer groups (submitted and waited for on a task of their own) did not
    /// all land within the load's deadline: some WRITE or its wait ran past it.
    #[error("the load's layer groups did not land within {0:?}")]
    GroupsTimeout(Duration),
    /// The load was dropped by its caller: the layer groups not yet submitted never will be.
    #[error("the load was dropped; its remaining layer groups were not submitted")]
    Stopped,
    /// The consumer's segment could not be opened.
    #[error("open segment {segment}: {source}")]
    Open {
        /// The consumer rank's segment.
        segment: String,
        /// Why.
        source: TransferError,
    },
    /// The WRITEs could not be submitted.
    #[error("submit to {segment}: {source}")]
    Submit {
        /// The consumer rank's segment.
        segment: String,
        /// Why.
        source: TransferError,
    },
    /// The blocking task that opened and submitted ended abnormally (it panicked or was
    /// cancelled).
    #[error("the task that opens and submits failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// A thread that opened and submitted one of a layer group's batches panicked.
    #[error("the thread that opens and submits a batch panicked")]
    SubmitPanicked,
    /// The OS refused a thread to open and submit one of a layer group's batches (out of
    /// threads or memory); the group's batches not yet started were not submitted.
    #[error("starting a thread to submit a batch: {0}")]
    NoThread(#[source] std::io::Error),
    /// The WRITEs failed or did not end within the deadline.
    #[error("transfer: {0}")]
    Transfer(#[source] TransferError),
    /// A one-pass read's kernel (it copies the producer's blocks and checksums what it
    /// stored, docs/design.md §4.10) could not be started or failed; every launch queued
    /// beside it was waited for (one that ran out of time is `GroupsTimeout` instead).
    #[error("the kernel that copies and checksums the load: {0}")]
    Copy(#[source] kvferry_kernels::KernelError),
}

impl WriteError {
    /// Whether copies it leaves may still land: every batch submitted was waited for to its
    /// end except where a wait ran out of time or the task that waits ended early (a copy of
    /// an ended wait is over: it succeeded or failed, and writes nothing more).
    pub fn may_still_land(&self) -> bool {
        matches!(
            self.kind,
            WriteErrorKind::OpenTimeout(_)
                | WriteErrorKind::GroupsTimeout(_)
                | WriteErrorKind::Task(_)
                | WriteErrorKind::Transfer(TransferError::Timeout(_))
        )
    }
}

impl ServeFailure {
    /// The typed reason its ERROR reply carries (`Reply::reason`), where it has one: a
    /// request that does not match the lease (a block it does not hold, a group never
    /// published, a layer whose KV cannot be copied byte for byte) is `LeaseMismatch`.
    pub fn reason(&self) -> Option<ErrorReason> {
        match self {
            ServeFailure::Plan(
                ServeError::WrongBlock { .. }
                | ServeError::NotPublished(_)
                | ServeError::Layer {
                    source: LayerError::Incompatible(_),
                    ..
                },
            ) => Some(ErrorReason::LeaseMismatch),
            _ => None,
        }
    }
}

/// Why serving one load failed, as the producer's state machine records it.
#[derive(Debug, thiserror::Error)]
pub enum ServeFailure {
    /// The consumer's grant token does not parse.
    #[error("bad grant token: {0}")]
    Token(#[source] TransferError),
    /// The request does not fit the lease or the ranks.
    #[error(transparent)]
    Plan(#[from] ServeError),
    /// A WRITE failed.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The serve task ended abnormally (it panicked or was cancelled).
    #[error("serve task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a wait that ran out of time (or never ran to its end) leaves copies that may still
    /// land; a failure the waits saw to its end leaves none.
    #[test]
    fn only_unfinished_waits_leave_copies_that_may_still_land() {
        let at = |kind| WriteError {
            rank: RankInfo::SINGLE,
            kind,
        };
        let d = Duration::from_secs(1);
        for kind in [
            WriteErrorKind::OpenTimeout(d),
            WriteErrorKind::GroupsTimeout(d),
            WriteErrorKind::Transfer(TransferError::Timeout(d)),
        ] {
            assert!(at(kind).may_still_land());
        }
        for kind in [
            WriteErrorKind::Stopped,
            WriteErrorKind::SubmitPanicked,
            WriteErrorKind::Transfer(TransferError::Cancelled),
            WriteErrorKind::Submit {
                segment: "127.0.0.1:1".into(),
                source: TransferError::UnknownBatch(1),
            },
        ] {
            assert!(!at(kind).may_still_land());
        }
    }
}
