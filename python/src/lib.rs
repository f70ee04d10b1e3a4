//! kvferry's Python extension module `kvferry._kvferry` (re-exported by the pure-Python
//! package `kvferry`, `python/kvferry/__init__.py`).
//!
//! One file per Python-facing job:
//! - `engine.rs`: `TransferEngine`, Mooncake's Python API over `kvferry_transfer::TransferEngine`;
//!   `mooncake.rs`: Mooncake's argument forms and return codes.
//! - `pylog.rs`: kvferry's `tracing` events forwarded to Python's `logging` (logger `kvferry`).
//! - `tensor.rs`: reading KV tensors (`__dlpack__`, `data_ptr()`, `__array_interface__`).
//! - `layer.rs`: `KVCacheLayer`, `KVCacheGroup`, `Rank`: KV tensors with their layout.
//! - `checksum.rs`: block checksums of KV tensors (CPU, CUDA on the caller's stream), fingerprints.
//! - `payload.rs`: `KVChecksumPayload`, `KVChecksumGroup` (the seed's wire format).
//! - `verdict.rs`: `compare`, `KVChecksumVerdict`, `KVChecksumPolicy`, `decide`.
//! - `p2p.rs`: `Producer`, `consumer.rs`: `Consumer` (verified loads over kvferry-p2p);
//!   `side.rs`: the ranks' engines and registered tensors of one side.
//! - `runtime.rs`: the module's tokio runtime and call deadlines.
//!
//! Every method that can block releases the GIL; no method panics on any input.

use pyo3::prelude::*;

mod checksum;
mod consumer;
mod engine;
mod layer;
mod mooncake;
mod p2p;
mod payload;
mod pylog;
mod repr;
mod runtime;
mod side;
mod tensor;
mod verdict;

/// The process's kvferry metrics in the Prometheus/OpenMetrics text format (what a
/// Prometheus scrape of `/metrics` returns; ends with `# EOF`): transfers per path and peer,
/// loads by verdict, checksum and load times (names in `docs/design.md` §6 "Metrics").
#[pyfunction]
fn metrics_text() -> String {
    kvferry_transfer::metrics::encode_text()
}

/// The extension module: registers every class and function the package re-exports.
#[pymodule]
fn _kvferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    pylog::install();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    engine::register(m)?;
    layer::register(m)?;
    checksum::register(m)?;
    payload::register(m)?;
    verdict::register(m)?;
    p2p::register(m)?;
    consumer::register(m)?;
    m.add_function(wrap_pyfunction!(metrics_text, m)?)?;
    Ok(())
}
