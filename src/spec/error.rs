//! Errors of `checksum --spec`: every message names the spec field or the file and its value.

use std::path::PathBuf;

use thiserror::Error;

/// Why a spec could not be evaluated. Every message names the file or the field and its value.
#[derive(Debug, Error)]
pub enum SpecError {
    /// The spec file itself cannot be read.
    #[error("cannot read spec {path}: {source}")]
    ReadSpec {
        /// The spec file's path, as given.
        path: PathBuf,
        /// The read error.
        source: std::io::Error,
    },
    /// The spec is not JSON of the expected shape.
    #[error("spec {path}: {msg}")]
    Json {
        /// The spec file's path, as given.
        path: PathBuf,
        /// serde_json's message (with line and column).
        msg: String,
    },
    /// A field holds a value that cannot be used.
    #[error("{field} = {value}: {why}")]
    Field {
        /// Where the field is in the spec, e.g. `groups[0].layers[1].dims.D`.
        field: String,
        /// The value found, as text.
        value: String,
        /// Why it cannot be used.
        why: String,
    },
    /// A tensor file is missing, unreadable or does not match the spec.
    #[error("{field}: file {path}: {why}")]
    File {
        /// The spec field that names the file, e.g. `groups[0].layers[1].path`.
        field: String,
        /// The tensor file's path (relative paths resolved against the spec's folder).
        path: PathBuf,
        /// What is wrong with it (missing, unreadable, wrong size, ...).
        why: String,
    },
}

/// Why a `.npy` or `.safetensors` file does not hold the KV a layer needs; the text says
/// which part of the file (magic, header, dtype, shape, length).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct FormatError(pub String);

impl From<&str> for FormatError {
    fn from(s: &str) -> FormatError {
        FormatError(s.to_string())
    }
}

impl From<String> for FormatError {
    fn from(s: String) -> FormatError {
        FormatError(s)
    }
}

/// A [`SpecError::Field`]: `field` holds `value`, which cannot be used because `why`.
pub(super) fn field_err(
    field: impl Into<String>,
    value: impl ToString,
    why: impl Into<String>,
) -> SpecError {
    SpecError::Field {
        field: field.into(),
        value: value.to_string(),
        why: why.into(),
    }
}
