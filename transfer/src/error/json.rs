//! [`JsonError`]: serde_json's error made `Clone` and `Eq`.

/// A JSON error (serde_json's), shared so that a [`ProtocolError`](super::ProtocolError) stays
/// `Clone`; its `source()` is the JSON error itself, for a caller that downcasts. Equality is
/// [`Shared`](super::Shared)'s (the same error, or the same text).
pub type JsonError = super::Shared<serde_json::Error>;
