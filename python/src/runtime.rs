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

/// Why [`block_on`] returned no value of the future's own.
pub enum Blocked<E> {
    /// The runtime could not start (a RuntimeError for Python).
    Runtime(PyErr),
    /// The deadline passed first; the future was dropped, which cancels it.
    TimedOut,
    /// The future ended with this error.
    Failed(E),
}

/// Runs the future `make` returns on the module's runtime with the GIL released, for at most
/// `deadline`: its value, or why not ([`Blocked`]). The future is made on the calling thread
/// once the GIL is released, so it need not be `Send`. A future that cannot fail returns
/// `Ok::<_, Infallible>(..)`.
pub fn block_on<M, F, T, E>(py: Python<'_>, deadline: Duration, make: M) -> Result<T, Blocked<E>>
where
    M: FnOnce() -> F + Send,
    F: Future<Output = Result<T, E>>,
    T: Send,
    E: Send,
{
    let rt = runtime().map_err(Blocked::Runtime)?;
    py.detach(|| {
        let f = make();
        match rt.block_on(async { tokio::time::timeout(deadline, f).await }) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Blocked::Failed(e)),
            Err(_) => Err(Blocked::TimedOut),
        }
    })
}
