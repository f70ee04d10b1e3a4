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

/// An error made `Clone` (and `Eq`) by sharing it: `Shared<E>` holds an `E` behind an `Arc`;
/// plain `Shared` holds an error of any type. Its `source()` is the error itself, so a walk
/// down the chain reaches the original and can downcast to its type (an `Arc` in the chain
/// would stand in for it and hide the type).
///
/// Two are equal when they are the same shared error or say the same: foreign errors (io,
/// serde's, the decoder's) have no equality of their own, and an error is compared so that a
/// state machine's outputs holding one can be compared in tests.
#[derive(Debug)]
pub struct Shared<E: ?Sized = dyn std::error::Error + Send + Sync>(pub Arc<E>);

impl<E: ?Sized> Clone for Shared<E> {
    fn clone(&self) -> Self {
        Shared(Arc::clone(&self.0))
    }
}

impl<E> Shared<E> {
    /// `e`, shared.
    pub fn new(e: E) -> Self {
        Shared(Arc::new(e))
    }
}

impl<E> From<E> for Shared<E> {
    fn from(e: E) -> Self {
        Shared::new(e)
    }
}

impl<E: std::fmt::Display + ?Sized> std::fmt::Display for Shared<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<E: AsError + std::fmt::Debug + std::fmt::Display + ?Sized> std::error::Error for Shared<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.0.as_error())
    }
}

impl<E: std::fmt::Display + ?Sized> PartialEq for Shared<E> {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl<E: std::fmt::Display + ?Sized> Eq for Shared<E> {}

/// An error seen as `dyn Error` (what [`Shared`]'s `source()` returns): every sized error
/// type, and the unsized `dyn Error + Send + Sync` of plain `Shared`.
pub trait AsError {
    /// `self` as a `dyn Error`.
    fn as_error(&self) -> &(dyn std::error::Error + 'static);
}

impl<E: std::error::Error + 'static> AsError for E {
    fn as_error(&self) -> &(dyn std::error::Error + 'static) {
        self
    }
}

impl AsError for dyn std::error::Error + Send + Sync {
    fn as_error(&self) -> &(dyn std::error::Error + 'static) {
        self
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_is_equal_to_its_clone_and_to_an_error_saying_the_same() {
        let a: Shared = Shared(Arc::new(std::io::Error::other("disk gone")));
        assert_eq!(a, a.clone());
        let same_words: Shared = Shared(Arc::new(std::io::Error::other("disk gone")));
        assert_eq!(a, same_words);
        let other: Shared = Shared(Arc::new(std::io::Error::other("link down")));
        assert_ne!(a, other);
    }

    #[test]
    fn shared_source_is_the_error_itself_typed_or_not() {
        let typed = Shared::new(std::io::Error::other("x"));
        let source = std::error::Error::source(&typed).expect("a source");
        assert!(source.downcast_ref::<std::io::Error>().is_some());
        let plain: Shared = Shared(Arc::new(std::io::Error::other("x")));
        let source = std::error::Error::source(&plain).expect("a source");
        assert!(source.downcast_ref::<std::io::Error>().is_some());
    }
}
