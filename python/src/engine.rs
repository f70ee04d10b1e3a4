//! `kvferry.TransferEngine`: Mooncake's Python `TransferEngine` API (skeleton; filled in by the
//! Python-package work).

use pyo3::prelude::*;

/// Registers the engine's classes on the extension module.
pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
