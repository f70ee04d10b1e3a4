//! The error types of the transfer engine (docs/design.md §3), nested in rustls's style: one
//! [`TransferError`] whose variants carry the typed cause ([`ConfigError`], [`ArgumentError`],
//! [`UnsupportedError`], [`HandshakeError`], [`AuthError`], [`RegistrationError`],
//! [`RdmaError`], an `std::io::Error`, the first failed slice of a batch) with the values as
//! fields (which key, which limit, what was given) and expose it through
//! `std::error::Error::source`, so a caller can walk to the root (an io error's `kind()`, the
//! peer's own refusal text). A peer's own words are kept as [`PeerText`] or bounded by the
//! frame that carried them; [`mooncake::code`] maps a cause to Mooncake's return code.
//!
//! Every error is `Clone` (a batch reports one cause to many slices), so io and JSON sources
//! are held in an `Arc`. The `Display` of an outer error includes its cause's text, as the
//! flat texts did: logs that print only `{e}` lose nothing.

use std::sync::Arc;
use std::time::Duration;

mod argument;
mod config;
mod io;
mod json;
pub mod mooncake;
mod peer_info;
mod rdma;
mod refusal;
mod unsupported;
pub use argument::{ArgumentError, SyncBound};
pub use config::{ConfigError, NoRdma, SecretFileError};
pub use io::{AsError, IoError, PeerText, Shared};
pub use json::JsonError;
pub use peer_info::{CudaIpcReplyFault, RdmaInfoFault};
pub use rdma::{EndpointFailure, FailedWork, RdmaError, WcStatus, WorkOp, WorkRequest};
pub use refusal::Refusal;
pub use unsupported::UnsupportedError;

/// Every failure the transfer engine reports. Variants name the address, segment or peer
/// involved; no variant is ever produced by a panic.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransferError {
    /// The engine configuration is unusable (see [`ConfigError`]: which key, what was given,
    /// what is allowed).
    #[error("configuration error: {0}")]
    Config(#[source] ConfigError),
    /// A listener could not be bound (port in use, address not local); `op` names the
    /// listener and the address (`"bind handshake listener on h:p"`).
    #[error("configuration error: cannot {0}")]
    Bind(#[source] IoError),
    /// A caller argument (or a peer's request for this side's memory) is invalid (see
    /// [`ArgumentError`]: the address, length or limit).
    #[error("invalid argument: {0}")]
    InvalidArgument(#[source] ArgumentError),
    /// A segment name (a peer's handshake address) that is not `host:port` with a nonempty
    /// host and a port in 1..=65535: the name as given.
    #[error("invalid argument: segment name {0:?} is not host:port")]
    BadSegmentName(String),
    /// A memory region could not be registered (see [`RegistrationError`]).
    #[error("invalid argument: {0}")]
    Registration(#[source] RegistrationError),
    /// The local side of a request is not inside memory registered with this engine.
    #[error("local range [{addr:#x}, +{len}) is not inside registered memory")]
    NotRegistered {
        /// Local start address (virtual address in this process), as in the request.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// The remote side of a request is not inside a buffer the peer advertised
    /// (checked by the initiator before sending) or the peer refused it (checked by the target).
    #[error("remote range [{addr:#x}, +{len}) is not inside a buffer of segment {segment}")]
    RemoteOutOfRange {
        /// The target segment's name (`host:port`).
        segment: String,
        /// Remote start address (virtual address in the peer's process).
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// The handshake with a peer failed (see [`HandshakeError`]).
    #[error("handshake with {peer} failed: {source}")]
    Handshake {
        /// The peer's handshake address (`host:port`, the segment name it was opened as).
        peer: String,
        /// What went wrong.
        #[source]
        source: HandshakeError,
    },
    /// A peer sent bytes that break the wire protocol (see [`ProtocolError`]).
    #[error("protocol error: {0}")]
    Protocol(#[source] ProtocolError),
    /// A socket operation failed; the io error's `kind()` says how (`UnexpectedEof` for a
    /// connection the peer closed, `TimedOut` for a passed deadline).
    #[error("I/O error: {0}")]
    Io(#[source] IoError),
    /// A wait ran past its deadline.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The transport cannot do what was asked (see [`UnsupportedError`]: GPU memory without
    /// the GPU backend, a peer of another transport, a budget spent).
    #[error("unsupported: {0}")]
    Unsupported(#[source] UnsupportedError),
    /// The batch id is unknown (never issued, or already freed by a finished wait).
    #[error("unknown batch id {0}")]
    UnknownBatch(u64),
    /// The request was refused for want of authorization (see [`AuthError`], `crate::auth`).
    #[error("not authorized: {0}")]
    Auth(#[source] AuthError),
    /// The target segment refused a request for a reason of its own (see [`Refusal`]: its
    /// words, or the CUDA IPC transport's case).
    #[error("segment {segment} refused the request: {why}")]
    Refused {
        /// The target segment's name.
        segment: String,
        /// Why.
        why: Refusal,
    },
    /// The target is another instance than the descriptor names (it restarted): the engine
    /// fetches the descriptor again and retries.
    #[error("segment {segment}: {text}")]
    Stale {
        /// The target segment's name.
        segment: String,
        /// The target's error text (bounded, escaped).
        text: PeerText,
    },
    /// A slice failed, was retried on a fresh descriptor, and failed again or could not be:
    /// `source` is its first failure, `retry` what happened on the retry.
    #[error("{source}; {retry}")]
    Retry {
        /// The slice's first failure.
        #[source]
        source: Box<TransferError>,
        /// What happened when it was retried.
        retry: RetryOutcome,
    },
    /// Some slices of a batch failed; `first` is the first failure reported.
    #[error("transfer failed: {first}{}", if *.failed > 1 { format!(" (and {} more failed slices of {})", .failed - 1, .total) } else { String::new() })]
    Failed {
        /// The first slice failure reported.
        #[source]
        first: Box<TransferError>,
        /// How many slices failed.
        failed: u32,
        /// Slices in the batch.
        total: u32,
    },
    /// The batch timed out or was freed before this slice was sent (so it never was).
    #[error("batch timed out or was freed before this slice was sent")]
    Cancelled,
    /// A region could not be unregistered: batches still move bytes from or into it (it stays
    /// registered; the caller must not free it yet). Mooncake's `ERR_BATCH_BUSY`.
    #[error(
        "memory region {addr:#x} is in use by {batches} batch(es) in flight after waiting {waited:?}; it stays registered"
    )]
    InUse {
        /// Start address of the region.
        addr: u64,
        /// Batches whose slices use it.
        batches: usize,
        /// How long unregistering waited for them.
        waited: std::time::Duration,
    },
    /// An RDMA-specific failure (see [`RdmaError`]).
    #[error("rdma: {0}")]
    Rdma(#[source] RdmaError),
    /// A GPU memory operation failed (the CUDA layer's error; see `crate::gpu`).
    #[error("GPU: {0}")]
    Gpu(#[source] Shared),
}

impl TransferError {
    /// A short stable name of the failure's kind (the `cause` label of
    /// `kvferry_num_failed_transfers_total`): `timeout`, `io`, `rdma`, `refused`, ...; a batch
    /// failure or a failed retry is named by the failure under it.
    pub fn cause(&self) -> &'static str {
        match self {
            TransferError::Config(_) => "config",
            TransferError::Bind(_) => "bind",
            TransferError::InvalidArgument(_) | TransferError::BadSegmentName(_) => {
                "invalid_argument"
            }
            TransferError::Registration(_) => "registration",
            TransferError::NotRegistered { .. } => "not_registered",
            TransferError::RemoteOutOfRange { .. } => "remote_out_of_range",
            TransferError::Handshake { .. } => "handshake",
            TransferError::Protocol(_) => "protocol",
            TransferError::Io(_) => "io",
            TransferError::Timeout(_) => "timeout",
            TransferError::Unsupported(_) => "unsupported",
            TransferError::UnknownBatch(_) => "unknown_batch",
            TransferError::Auth(_) => "auth",
            TransferError::Refused { .. } => "refused",
            TransferError::Stale { .. } => "stale",
            TransferError::Retry { source, .. } => source.cause(),
            TransferError::Failed { first, .. } => first.cause(),
            TransferError::Cancelled => "cancelled",
            TransferError::InUse { .. } => "in_use",
            TransferError::Rdma(_) => "rdma",
            TransferError::Gpu(_) => "gpu",
        }
    }

    /// Wraps an `std::io::Error` with what was being done (`"connect to 1.2.3.4:5"`).
    pub fn io(op: impl std::fmt::Display, err: std::io::Error) -> Self {
        TransferError::Io(IoError::new(op, err))
    }

    /// Wraps the CUDA layer's error (a typed error, or its text until it has one).
    pub fn gpu(err: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        TransferError::Gpu(Shared(Arc::from(err.into())))
    }

    /// An io failure of `kind` that has no OS error behind it (`UnexpectedEof`: the peer
    /// closed the connection; `TimedOut`: our deadline passed).
    pub fn io_kind(
        op: impl std::fmt::Display,
        kind: std::io::ErrorKind,
        why: &'static str,
    ) -> Self {
        Self::io(op, std::io::Error::new(kind, why))
    }

    /// The io error kind at the root of this error's source chain, if it has one.
    pub fn io_error_kind(&self) -> Option<std::io::ErrorKind> {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cur {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                return Some(io.kind());
            }
            cur = e.source();
        }
        None
    }
}

/// What happened when a failed slice was retried on a fresh descriptor
/// ([`TransferError::Retry`]).
#[derive(Debug, Clone, thiserror::Error)]
pub enum RetryOutcome {
    /// The descriptor could not be fetched again.
    #[error("fetching its descriptor again: {0}")]
    Refetch(Box<TransferError>),
    /// The descriptor fetched again holds no buffer for the slice's remote range.
    #[error(
        "the descriptor fetched again has no buffer holding [{addr:#x}, +{len}) (instance \
         {instance:#x})"
    )]
    NotInDescriptor {
        /// The slice's remote start.
        addr: u64,
        /// Its length.
        len: u64,
        /// The peer instance the new descriptor names.
        instance: u64,
    },
}

impl From<ArgumentError> for TransferError {
    fn from(e: ArgumentError) -> Self {
        TransferError::InvalidArgument(e)
    }
}

impl From<UnsupportedError> for TransferError {
    fn from(e: UnsupportedError) -> Self {
        TransferError::Unsupported(e)
    }
}

impl From<ConfigError> for TransferError {
    fn from(e: ConfigError) -> Self {
        TransferError::Config(e)
    }
}

impl From<RdmaError> for TransferError {
    fn from(e: RdmaError) -> Self {
        TransferError::Rdma(e)
    }
}

/// Why a handshake (descriptor query, RDMA connect, authentication) with a peer failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HandshakeError {
    /// The request body is over `handshake::MAX_FRAME_BODY`.
    #[error("request body of {0} bytes exceeds the limit")]
    BodyTooLarge(usize),
    /// The peer name did not resolve.
    #[error("cannot resolve: {0}")]
    Resolve(#[source] IoError),
    /// The name resolved to no address (or the deadline passed before any connect).
    #[error("no address")]
    NoAddress,
    /// Connecting failed (the last address tried: `op` is `"connect to <addr>"`).
    #[error("{0}")]
    Connect(#[source] IoError),
    /// Sending the request or reading the reply failed (io, deadline, malformed frame).
    #[error("{0}")]
    Exchange(#[source] Box<TransferError>),
    /// The peer closed the connection before replying.
    #[error("connection closed before the reply")]
    Closed,
    /// The peer answered with an error frame: its text (bounded, escaped).
    #[error("{0}")]
    Refused(PeerText),
    /// The reply has another frame type than the request.
    #[error("reply has frame type {got}, expected {expected}")]
    UnexpectedReply {
        /// The reply's frame type.
        got: u8,
        /// The request's frame type.
        expected: u8,
    },
    /// The `Hello` reply is malformed.
    #[error("{0}")]
    BadHello(#[source] crate::auth::HelloError),
    /// The target did not prove the shared secret in its `Hello` reply (an open engine, a
    /// wrong secret, or a relay): nothing of this side's was sent to it.
    #[error("the target did not prove the shared secret; nothing was sent to it")]
    TargetUnproven,
    /// A reply is not the JSON it should be (`what`: `"descriptor"`, `"RDMA connect reply"`).
    #[error("{what} is not valid JSON: {source}")]
    BadJson {
        /// Which reply.
        what: &'static str,
        /// The JSON error.
        #[source]
        source: Arc<serde_json::Error>,
    },
    /// The descriptor is inconsistent (see [`DescriptorError`]).
    #[error("invalid descriptor: {0}")]
    InvalidDescriptor(#[source] DescriptorError),
    /// The RDMA `Connect` reply answers another request than ours (what it says, what we
    /// asked).
    #[error(
        "RDMA connect reply does not match the request (version {version}, endpoint \
         {endpoint:#x}, {qps} QPs for {asked_qps})"
    )]
    ConnectReplyMismatch {
        /// The reply's protocol version.
        version: u32,
        /// The endpoint id it names.
        endpoint: u64,
        /// QPs it describes.
        qps: usize,
        /// QPs the request described.
        asked_qps: usize,
    },
}

/// How a peer's descriptor is inconsistent: which buffer (by its start address).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// `addr + len` overflows the address space.
    #[error("buffer {addr:#x} wraps")]
    Wraps {
        /// The buffer's start.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A buffer of length 0.
    #[error("buffer {addr:#x} has zero length")]
    ZeroLength {
        /// The buffer's start.
        addr: u64,
    },
    /// A buffer that starts inside the one before it (by address).
    #[error("buffer {addr:#x} overlaps the previous one (which ends at {prev_end:#x})")]
    Overlaps {
        /// The buffer's start.
        addr: u64,
        /// The end of the buffer before it.
        prev_end: u64,
    },
}

/// How bytes from a peer (or a message of ours) break the wire protocol: the data frames of
/// the TCP transport, handshake frames, the transports' `Connect` exchanges and advertised peer
/// info. `what` names the frame, message or field (`"data request"`, `"RDMA connect"`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Fewer bytes than the message's header needs.
    #[error("short {0}")]
    Short(&'static str),
    /// A magic number that is not this protocol's.
    #[error("{what} with bad magic {magic:#010x}")]
    BadMagic {
        /// The frame.
        what: &'static str,
        /// The magic number read.
        magic: u32,
    },
    /// A length or count over its limit.
    #[error("{what}: {len}, at most {limit}")]
    TooLarge {
        /// What was counted (`"frame body bytes"`, `"CUDA IPC allocations"`).
        what: String,
        /// The value read.
        len: u64,
        /// The largest allowed.
        limit: u64,
    },
    /// A length or count outside its bounds, or that disagrees with another.
    #[error("{what}: {got}, expected {expected}")]
    Mismatch {
        /// What was counted.
        what: String,
        /// The value read.
        got: u64,
        /// What it should be (a value or a range, as text).
        expected: String,
    },
    /// An op code of no known operation.
    #[error("unknown op {0}")]
    UnknownOp(u8),
    /// A message version this engine does not speak.
    #[error("{what} version {got}, this engine speaks {speaks}")]
    Version {
        /// The message.
        what: &'static str,
        /// The version read.
        got: u32,
        /// The version this engine speaks.
        speaks: u32,
    },
    /// A field whose value is not valid (`value`: as read, `expected`: its form).
    #[error("{what} {value}: expected {expected}")]
    BadField {
        /// The field.
        what: String,
        /// Its value as read.
        value: String,
        /// The form it must have.
        expected: &'static str,
    },
    /// A segment's RDMA peer info or buffer keys that decode but say something they cannot.
    #[error("segment {segment} advertises bad rdma peer info: {fault}")]
    RdmaPeerInfo {
        /// The segment's name (`"h:p"`).
        segment: String,
        /// What is wrong, naming the field.
        #[source]
        fault: RdmaInfoFault,
    },
    /// A CUDA IPC reply that decodes but lacks what an allocation needs.
    #[error("CUDA IPC reply from {peer}: {fault}")]
    CudaIpcReply {
        /// The peer's segment name (`"h:p"`).
        peer: String,
        /// What is missing.
        #[source]
        fault: CudaIpcReplyFault,
    },
    /// A segment whose CUDA IPC keys name more than one process (a segment is one process).
    #[error(
        "segment {segment}'s CUDA IPC keys name more than one process (pids {first} and {other})"
    )]
    CudaIpcMixedProcesses {
        /// The segment's name (`"h:p"`).
        segment: String,
        /// The pid the first key names.
        first: u32,
        /// The pid of a key that names another process (or the same pid on another host).
        other: u32,
    },
    /// A JSON message that does not decode (`source`: the decoder's error, naming the field).
    #[error("{what}: {source}")]
    BadJson {
        /// The message (`"CUDA IPC reply from h:p"`, `"segment h:p's rdma peer info"`).
        what: String,
        /// The JSON decoder's error.
        #[source]
        source: JsonError,
    },
    /// One of this engine's own messages could not be encoded.
    #[error("encode {what}: {source}")]
    Encode {
        /// The message.
        what: &'static str,
        /// The JSON encoder's error.
        #[source]
        source: JsonError,
    },
    /// A frame of a type that is not a request where a request was expected.
    #[error("a {0} frame is not a request")]
    NotARequest(&'static str),
    /// Handling a frame failed inside this engine (a panic caught at the frame's boundary).
    #[error("internal error while handling the frame")]
    Internal,
    /// A batch's completion arrived in a state it cannot be in.
    #[error("batch in an unexpected state")]
    UnexpectedBatchState,
}

/// Why a request was refused for want of authorization (`crate::auth`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// A handshake `Auth` frame failed (`what`: which check).
    #[error("handshake: {0}")]
    Handshake(&'static str),
    /// A descriptor or connect request on a connection that has not passed `Auth`.
    #[error(
        "this segment is authenticated: prove the shared secret or present a grant token \
         (Hello, Auth) first"
    )]
    NotAuthenticated,
    /// The target refused a data frame (its words: no live grant, op or range outside it).
    #[error("segment {segment} refused the request: {text}")]
    Refused {
        /// The target segment's name.
        segment: String,
        /// The target's refusal text (bounded, escaped).
        text: PeerText,
    },
}

/// Why a memory region could not be registered (`MemoryRegistry::insert`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistrationError {
    /// The region has zero length.
    #[error("memory region at {addr:#x} has zero length")]
    ZeroLength {
        /// Start address.
        addr: u64,
    },
    /// `addr + len` overflows the address space.
    #[error("memory region [{addr:#x}, +{len}) wraps the address space")]
    Wraps {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// The region overlaps one already registered.
    #[error("memory region [{addr:#x}, +{len}) overlaps registered region [{with_addr:#x}, +{with_len})")]
    Overlaps {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
        /// Start of the registered region it overlaps.
        with_addr: u64,
        /// Length of that region.
        with_len: u64,
    },
    /// Host memory not mapped readable and writable in this process (`/proc/self/maps`).
    #[error("memory region [{addr:#x}, +{len}) is not mapped readable and writable in this process (from {at:#x})")]
    NotMapped {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
        /// The first byte that is not.
        at: u64,
    },
    /// `/proc/self/maps` could not be read to check a host range.
    #[error("cannot read /proc/self/maps to check the range: {kind}")]
    MapsUnreadable {
        /// The I/O error's kind (kept alone so that the error stays comparable).
        kind: std::io::ErrorKind,
    },
}

/// Result alias used across the crate.
pub type Result<T, E = TransferError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn an_io_errors_kind_survives_through_the_source_chain() {
        let io = TransferError::io_kind(
            "reply from segment h:1",
            std::io::ErrorKind::UnexpectedEof,
            "connection closed by peer",
        );
        let batch = TransferError::Failed {
            first: Box::new(TransferError::Retry {
                source: Box::new(io),
                retry: RetryOutcome::Refetch(Box::new(TransferError::Cancelled)),
            }),
            failed: 3,
            total: 8,
        };
        let text = batch.to_string();
        assert!(text.contains("connection closed by peer"), "{text}");
        assert!(text.contains("and 2 more failed slices of 8"), "{text}");
        // walk the chain by hand: Failed -> Retry -> Io -> IoError -> std::io::Error
        let retry = batch.source().expect("the batch keeps its first failure");
        let io = retry.source().expect("the retry keeps the slice's failure");
        let op = io.source().expect("the io failure keeps its operation");
        assert!(op.to_string().starts_with("reply from segment h:1"), "{op}");
        let root = op.source().expect("the operation keeps its io error");
        let root = root
            .downcast_ref::<std::io::Error>()
            .expect("the root is the io error");
        assert_eq!(root.kind(), std::io::ErrorKind::UnexpectedEof);
        assert_eq!(
            batch.io_error_kind(),
            Some(std::io::ErrorKind::UnexpectedEof)
        );
        let hs = TransferError::Handshake {
            peer: "h:1".into(),
            source: HandshakeError::Exchange(Box::new(batch)),
        };
        assert_eq!(hs.io_error_kind(), Some(std::io::ErrorKind::UnexpectedEof));
        assert_eq!(TransferError::Cancelled.io_error_kind(), None);
        // a clone (every slice of a frame gets one) keeps the OS error and its kind
        let refused = TransferError::io(
            "connect to 127.0.0.1:1",
            std::io::Error::from_raw_os_error(libc::ECONNREFUSED),
        );
        let copy = refused.clone();
        assert_eq!(copy.to_string(), refused.to_string());
        assert_eq!(
            copy.io_error_kind(),
            Some(std::io::ErrorKind::ConnectionRefused)
        );
    }

    #[test]
    fn a_peers_text_is_bounded_and_kept_on_one_line() {
        let flood = format!("no\nlive grant{}", "x".repeat(1 << 20));
        let e = TransferError::Handshake {
            peer: "h:1".into(),
            source: HandshakeError::Refused(PeerText::from_bytes(flood.as_bytes())),
        };
        let text = e.to_string();
        assert!(
            text.starts_with("handshake with h:1 failed: no\\nlive grant"),
            "{}",
            &text[..64]
        );
        assert!(!text.contains('\n'));
        assert!(
            text.len() < PeerText::MAX_CHARS + 64,
            "{} bytes",
            text.len()
        );
        assert!(text.ends_with("..."));
    }

    #[test]
    fn shared_causes_stay_reachable_by_type() {
        // a verbs call's OS error, and the GPU layer's error, can be downcast from the chain
        let verbs: TransferError = RdmaError::verbs(
            "rxe0: create QP",
            std::io::Error::from_raw_os_error(libc::ENOMEM),
        )
        .into();
        assert!(verbs.to_string().contains("rxe0: create QP"), "{verbs}");
        assert_eq!(verbs.io_error_kind(), Some(std::io::ErrorKind::OutOfMemory));
        let gpu = TransferError::gpu(std::io::Error::from(std::io::ErrorKind::Unsupported));
        assert_eq!(
            gpu.clone().io_error_kind(),
            Some(std::io::ErrorKind::Unsupported)
        );
    }
}
