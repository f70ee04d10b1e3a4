//! The sizes of a handshake `Hello` and why a body of one cannot be decoded: what
//! `crate::error` needs from the handshake, kept apart so that it depends on nothing here.

/// Longest segment name a `Hello` carries, bytes (a `host:port`, or a DNS name and port).
pub const MAX_NAME_BYTES: usize = 1024;
/// Length of a handshake nonce, bytes.
pub const NONCE_BYTES: usize = 32;

/// Why a handshake `Hello` request or reply body cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// The body ends before the field `0` is complete.
    #[error("Hello body ends inside its {0}")]
    Truncated(&'static str),
    /// A name longer than [`MAX_NAME_BYTES`].
    #[error("Hello names a segment of {0} bytes (at most {MAX_NAME_BYTES})")]
    NameTooLong(usize),
    /// A name that is not UTF-8.
    #[error("Hello names a segment that is not UTF-8")]
    NotUtf8,
    /// Bytes after the last field.
    #[error("{0} bytes after the end of the Hello body")]
    Trailing(usize),
    /// A reply that is neither `nonce[32]` nor `nonce[32] ‖ proof[32]`.
    #[error("Hello reply of {0} bytes (expected 32 or 64)")]
    ReplyLength(usize),
}
