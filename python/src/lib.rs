//! kvferry's Python extension module `kvferry._kvferry` (re-exported by the pure-Python
//! package `kvferry`, `python/kvferry/__init__.py`).
//!
//! One file per Python-facing job:
//! - `engine.rs`: `TransferEngine`, Mooncake's Python API over `kvferry_transfer::TransferEngine`.
//! - `pylog.rs`: kvferry's `tracing` events forwarded to Python's `logging` (logger `kvferry`).
//!
//! Every method that can block releases the GIL; no method panics on any input.

use pyo3::prelude::*;

mod engine;
mod pylog;

/// The extension module: registers every class and function the package re-exports.
#[pymodule]
fn _kvferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    pylog::install();
    engine::register(m)?;
    Ok(())
}
