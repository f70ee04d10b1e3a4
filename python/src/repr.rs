//! Values written as Python writes them in a `__repr__`: `'text'`, `None`, `True`/`False`
//! (Rust's `{:?}` would give `"text"`, `Some("...")` and `true`).

use pyo3::prelude::*;
use pyo3::types::PyString;

/// Python's `repr()` of a str (quotes and escapes as Python chooses them).
pub(crate) fn str_repr(py: Python<'_>, s: &str) -> String {
    PyString::new(py, s)
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| format!("{s:?}"))
}

/// `None`, or Python's `repr()` of the str.
pub(crate) fn opt_str_repr(py: Python<'_>, s: Option<&str>) -> String {
    s.map_or_else(|| "None".to_string(), |s| str_repr(py, s))
}

/// `True` or `False`.
pub(crate) fn bool_repr(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}
