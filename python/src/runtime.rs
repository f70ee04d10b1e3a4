//! The tokio runtime the module owns (the p2p layer is async), and deadlines for blocking calls:
//! every call that waits releases the GIL and ends by its deadline.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// The module's runtime: started on first use, two worker threads (the p2p shells are I/O-bound;
/// checksums and transfers run on their own threads), kept for the process's life.
pub fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<std::io::Result<tokio::runtime::Runtime>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvferry-rt")
            .enable_all()
            .build()
    })
    .as_ref()
    .map_err(|e| PyRuntimeError::new_err(format!("starting kvferry's async runtime: {e}")))
}

/// A duration from a number of seconds given by Python: finite and above zero (at most a day).
/// Errors: ValueError naming `what`.
pub fn seconds(s: f64, what: &str) -> PyResult<Duration> {
    if !(s.is_finite() && s > 0.0 && s <= 86400.0) {
        return Err(PyValueError::new_err(format!(
            "{what} = {s}: expected seconds above 0 and at most 86400"
        )));
    }
    Ok(Duration::from_secs_f64(s))
}

/// Runs the future `make` returns on the module's runtime with the GIL released; `Err(())` when
/// `deadline` passed first (the future is then dropped, which cancels it). The future is made
/// on the calling thread once the GIL is released, so it need not be `Send`.
pub fn block_on<M, F>(
    py: Python<'_>,
    deadline: Duration,
    make: M,
) -> PyResult<Result<F::Output, ()>>
where
    M: FnOnce() -> F + Send,
    F: Future,
    F::Output: Send,
{
    let rt = runtime()?;
    Ok(py.detach(|| {
        let f = make();
        rt.block_on(async { tokio::time::timeout(deadline, f).await.map_err(|_| ()) })
    }))
}
