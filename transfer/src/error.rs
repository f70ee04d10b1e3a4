//! The one error type of the transfer engine (docs/design.md §3).

use std::time::Duration;

/// Every failure the transfer engine reports. Variants carry a human-readable text that names
/// the address, segment or peer involved; no variant is ever produced by a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The engine configuration is unusable (bad host, port in use, forced RDMA without a device).
    #[error("configuration error: {0}")]
    Config(String),
    /// A caller argument is invalid (zero length, overlapping region, unknown address, bad name).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
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
    /// The handshake with a peer failed (connect refused, bad reply, peer error text).
    #[error("handshake with {peer} failed: {reason}")]
    Handshake {
        /// The peer's handshake address (`host:port`, the segment name it was opened as).
        peer: String,
        /// What went wrong, or the peer's own error text.
        reason: String,
    },
    /// A peer sent bytes that break the wire protocol (bad length, unknown frame type, bad JSON).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A socket operation failed (the text names the peer and the operation).
    #[error("I/O error: {0}")]
    Io(String),
    /// A wait ran past its deadline.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The transport cannot do what was asked (e.g. GPU memory over TCP without the GPU backend).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The batch id is unknown (never issued, or already freed by a finished wait).
    #[error("unknown batch id {0}")]
    UnknownBatch(u64),
    /// The peer refused the request for want of authorization (no live grant for the token,
    /// an op or range outside the grant, a failed secret proof); see `crate::auth`.
    #[error("not authorized: {0}")]
    Unauthorized(String),
    /// Some slices of a batch failed; the text is the first failure (and how many failed).
    #[error("transfer failed: {0}")]
    Failed(String),
    /// An RDMA-specific failure (verbs call, QP state, work completion status).
    #[error("rdma: {0}")]
    Rdma(String),
}

impl TransferError {
    /// Wraps an `std::io::Error` with what was being done (`"connect to 1.2.3.4:5"`).
    pub fn io(context: impl std::fmt::Display, err: std::io::Error) -> Self {
        TransferError::Io(format!("{context}: {err}"))
    }
}

/// Result alias used across the crate.
pub type Result<T, E = TransferError> = std::result::Result<T, E>;
