//! Foreign errors made `Clone` and given what was being done: [`IoError`] (an
//! `std::io::Error` with its operation), [`Shared`] (any error, shared) and [`PeerText`] (a
//! peer's own words, bounded).

use std::sync::Arc;

/// An `std::io::Error` with what was being done. `Clone` (an error reaches every slice of a
/// frame): a clone is rebuilt from the original's OS error code, else its kind and text.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {source}")]
pub struct IoError {
    /// What was being done (`"connect to 1.2.3.4:5"`, `"reply from segment h:p"`).
    pub op: String,
    /// The io error.
    #[source]
    pub source: std::io::Error,
}

impl IoError {
    /// `source` while doing `op`.
    pub fn new(op: impl std::fmt::Display, source: std::io::Error) -> Self {
        IoError {
            op: op.to_string(),
            source,
        }
    }
}

impl Clone for IoError {
    fn clone(&self) -> Self {
        let source = match self.source.raw_os_error() {
            Some(code) => std::io::Error::from_raw_os_error(code),
            None => std::io::Error::new(self.source.kind(), self.source.to_string()),
        };
        IoError {
            op: self.op.clone(),
            source,
        }
    }
}

/// An error of any type made `Clone` by sharing it. Its `source()` is the error itself, so a
/// walk down the chain reaches the original and can downcast to its type (an `Arc` in the
/// chain would stand in for it and hide the type).
#[derive(Debug, Clone)]
pub struct Shared(pub Arc<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Shared {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.0.as_ref())
    }
}

/// `e` and its sources, joined by `": "` (verbs errors carry the errno text as a source).
pub(super) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// Text a peer sent (an error frame's words), kept for messages and logs: at most
/// [`PeerText::MAX_CHARS`] characters, invalid UTF-8 replaced and control characters escaped,
/// so a peer can neither flood a log line nor break it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerText(String);

impl PeerText {
    /// Characters kept; the rest is cut and marked with `...`.
    pub const MAX_CHARS: usize = 512;

    /// The peer's bytes, decoded (lossy), escaped and cut to [`PeerText::MAX_CHARS`].
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let text = String::from_utf8_lossy(bytes);
        let mut out = String::new();
        for (i, c) in text.chars().enumerate() {
            if i == Self::MAX_CHARS {
                out.push_str("...");
                break;
            }
            if c.is_control() {
                out.extend(c.escape_debug());
            } else {
                out.push(c);
            }
        }
        PeerText(out)
    }

    /// The text as kept.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for PeerText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
