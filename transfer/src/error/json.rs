//! [`JsonError`]: serde_json's error made `Clone` and `Eq`.

use std::sync::Arc;

/// A JSON error (serde_json's), shared so that a [`ProtocolError`] stays `Clone`; its
/// `source()` is the JSON error itself, for a caller that downcasts. Two are equal when they
/// say the same (serde_json's errors have no equality of their own).
#[derive(Debug, Clone)]
pub struct JsonError(pub Arc<serde_json::Error>);

impl From<serde_json::Error> for JsonError {
    fn from(e: serde_json::Error) -> Self {
        JsonError(Arc::new(e))
    }
}

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for JsonError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.0.as_ref())
    }
}

impl PartialEq for JsonError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for JsonError {}
