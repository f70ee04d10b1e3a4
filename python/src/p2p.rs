//! `kvferry.Producer`: the verified path (docs/design.md §4) from Python, over kvferry-p2p
//! (`kvferry.Consumer`: consumer.rs). A producer publishes a prompt's blocks (checksummed then, held under a lease); a
//! consumer asks for them, the producer WRITEs them into the consumer's KV tensors and replies
//! with the checksum payload, and the consumer verifies the landed blocks and applies the policy
//! before `load` returns. Each rank gets its own transfer engine, with its tensors registered.
//! Calls block with the GIL released, on the module's tokio runtime, each under a deadline.

use std::convert::Infallible;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvferry_p2p::{Producer as P2pProducer, ProducerConfig, ProducerTimeouts, ReleaseReason};
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

use crate::layer::Rank;
use crate::repr::{bool_repr, opt_str_repr, str_repr};
use crate::runtime::{block_on, seconds, Blocked};
use crate::side::{block_table, build_side, Side};
use kvferry_transfer::sync::RwLockExt;

/// What ``Producer.publish`` did.
///
/// - checksummed: whether a checksum payload travels with the load.
/// - checksum_seconds: seconds spent checksumming (all ranks concurrently).
/// - payload_bytes: size of the encoded payload (0 without one).
/// - warning: why no payload will be sent when checksums are on but none will be, else None.
/// - load_key: the lease's load key; only a ``Consumer.load(..., load_key=...)`` carrying it is
///   served (request ownership; in vLLM it travels in ``kv_transfer_params``).
#[pyclass(frozen, get_all, module = "kvferry")]
pub struct PublishInfo {
    /// The lease's load key: only a load carrying it is served.
    load_key: String,
    /// Whether a checksum payload travels with the load.
    checksummed: bool,
    /// Seconds spent checksumming (all ranks concurrently).
    checksum_seconds: f64,
    /// Size of the encoded payload in bytes (0 without one).
    payload_bytes: usize,
    /// Why no payload will be sent when checksums are on but none will be, else None.
    warning: Option<String>,
}

#[pymethods]
impl PublishInfo {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "PublishInfo(checksummed={}, checksum_seconds={:.6}, payload_bytes={}, warning={})",
            bool_repr(self.checksummed),
            self.checksum_seconds,
            self.payload_bytes,
            opt_str_repr(py, self.warning.as_deref())
        )
    }
}

/// The producer (prefill) side: serves published KV blocks to consumers on a ZeroMQ ROUTER.
///
/// Producer(ranks, *, bind="tcp://127.0.0.1:0", host="127.0.0.1", protocol="auto",
///          rdma_devices="", checksums=True, lease=120.0, transfer_timeout=30.0,
///          checksum_timeout=30.0, secret_file=None, engine_ports=None)
///
/// - ranks: list of Rank, every rank of the side's TP x PP grid exactly once (any order), with
///   the same group ids and block sizes. Their tensors are registered with one transfer engine
///   per rank and must stay allocated until ``shutdown`` (the producer keeps references).
/// - bind: the control endpoint (port 0: any free port; ``endpoint`` gives the real one).
/// - host: the address the ranks' transfer engines listen on and name to peers (reachable by
///   the consumer; not 0.0.0.0). protocol: ``"auto"`` (the default, as the CLI's and the
///   vLLM connector's: RDMA where a usable device exists, else TCP), ``"tcp"`` or ``"rdma"``;
///   rdma_devices: comma-separated device names.
/// - checksums: checksum published blocks and send the payload with each load.
/// - lease: seconds published blocks are held for a consumer that has not come.
/// - transfer_timeout: seconds one load's WRITEs may take; checksum_timeout: seconds one
///   rank's checksums may take at publish.
/// - secret_file: a file holding the shared secret (16..4096 bytes), the same on both sides:
///   the engines authenticate each other and every load writes under a per-load grant. None:
///   open engines (any peer that reaches their ports may read and write the registered
///   memory), trusted networks only.
/// - engine_ports: ``"LO-HI"`` (or one port): each rank's transfer engine listens on the lowest
///   free ports of the range, one for its handshake and, over TCP, one for data, so a firewall
///   can list them. None: ports the OS picks (ephemeral). ValueError for a malformed range,
///   RuntimeError naming the range when no port of it is free.
///
/// One vLLM worker process per TP rank: the p2p layer sums the checksums of every rank of a
/// side inside one Producer, so a process holding a single rank gives its Producer one Rank
/// with the default ``tp_size=1, pp_size=1`` and its layers' global ``head_offset``, and pairs
/// it with a Consumer (in the decode worker of the same TP rank) built the same way. Each such
/// pair verifies the KV heads of its rank (its partial checksums are compared); both sides must
/// then split heads alike (same TP size). Different TP or PP sizes on the two sides need every
/// rank of each side in one Producer / Consumer.
///
/// Raises ValueError: bad ranks (not one grid, groups that disagree), a bad protocol or
/// timeout; RuntimeError: an engine or the control socket could not start, a registration
/// failed, GPU KV without a usable CUDA checksum backend.
#[pyclass(frozen, module = "kvferry")]
pub struct Producer {
    // The lock is held only to clone or take the Arc, never across a wait: a publish waiting
    // without the GIL must not hold what shutdown (or released) takes with the GIL held.
    inner: RwLock<Option<Arc<Serving>>>,
    endpoint: String,
    segments: Vec<String>,
    transport: String,
}

/// The core producer with the ranks it serves: publishes in flight hold a clone, so the
/// engines and registered tensors go only when the last of them returned.
struct Serving {
    producer: P2pProducer,
    _side: Side,
}

#[pymethods]
impl Producer {
    #[new]
    #[pyo3(signature = (ranks, *, bind="tcp://127.0.0.1:0", host="127.0.0.1", protocol="auto", rdma_devices="", checksums=true, lease=120.0, transfer_timeout=30.0, checksum_timeout=30.0, secret_file=None, engine_ports=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        ranks: Vec<Py<Rank>>,
        bind: &str,
        host: &str,
        protocol: &str,
        rdma_devices: &str,
        checksums: bool,
        lease: f64,
        transfer_timeout: f64,
        checksum_timeout: f64,
        secret_file: Option<&str>,
        engine_ports: Option<&str>,
    ) -> PyResult<Producer> {
        let config = ProducerConfig {
            bind: bind.to_string(),
            timeouts: ProducerTimeouts {
                lease: seconds(lease, "lease")?,
                ..ProducerTimeouts::default()
            },
            transfer_timeout: seconds(transfer_timeout, "transfer_timeout")?,
            checksum_timeout: seconds(checksum_timeout, "checksum_timeout")?,
            checksums,
            ..ProducerConfig::default()
        };
        let side = build_side(
            py,
            ranks,
            host,
            protocol,
            rdma_devices,
            secret_file,
            engine_ports,
        )?;
        let (segments, transport) = (side.segments.clone(), side.transport.clone());
        let workers = side.workers.clone();
        let started = block_on(py, Duration::from_secs(30), || {
            P2pProducer::start(config, workers)
        })
        .map_err(|b| match b {
            Blocked::Runtime(e) => e,
            Blocked::TimedOut => PyTimeoutError::new_err("starting the producer took over 30 s"),
            Blocked::Failed(
                e @ (kvferry_p2p::P2pError::Workers(_) | kvferry_p2p::P2pError::Config(_)),
            ) => PyValueError::new_err(e.to_string()),
            Blocked::Failed(other) => PyRuntimeError::new_err(other.to_string()),
        })?;
        Ok(Producer {
            endpoint: started.endpoint().to_string(),
            inner: RwLock::new(Some(Arc::new(Serving {
                producer: started,
                _side: side,
            }))),
            segments,
            transport,
        })
    }

    /// The bound control endpoint, e.g. ``"tcp://127.0.0.1:40123"``: what consumers load from.
    #[getter]
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The ranks' transfer engine segment names (``"host:port"``), in (pp_rank, tp_rank) order.
    #[getter]
    fn segments(&self) -> Vec<String> {
        self.segments.clone()
    }

    /// The transport the engines use: ``"tcp"`` or ``"rdma"``.
    #[getter]
    fn transport(&self) -> &str {
        &self.transport
    }

    /// publish(request_id, blocks, num_tokens, *, timeout=60.0, load_key=None, stream=None) -> PublishInfo
    ///
    /// A prompt's KV is complete: checksums its blocks now (tokens ``[0, num_tokens)`` of every
    /// rank, docs/design.md §2.5), then holds them under the lease until a consumer loads them or the
    /// lease expires. ``blocks[g]`` is KV cache group ``g``'s block table: the block id at each
    /// request position (None for a null block); every group id of the ranks needs an entry.
    /// GPU KV: pass ``stream``, the CUDA stream (an int ``cudaStream_t``, 0 for the legacy
    /// default stream) whose queued work writes it: an event is recorded on it, the checksums
    /// run after it and the ranks' engines order their copies of the KV after it (the CUDA IPC
    /// copy stream waits for the event on the device), without synchronising it. Without
    /// ``stream`` the KV must be written before this call (synchronise the stream that wrote it).
    ///
    /// Raises ValueError: a missing block table, a negative block id, a duplicate request id;
    /// RuntimeError: the producer is shut down; TimeoutError: not done within ``timeout``
    /// seconds. A rank that fails to checksum makes the load travel without checksums
    /// (``PublishInfo.warning``). ``load_key``: the lease's load key (default: a fresh random
    /// one, returned in ``PublishInfo.load_key``); a load must carry it to be served.
    #[pyo3(signature = (request_id, blocks, num_tokens, *, timeout=60.0, load_key=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn publish(
        &self,
        py: Python<'_>,
        request_id: &str,
        blocks: Vec<Vec<Option<i64>>>,
        num_tokens: u64,
        timeout: f64,
        load_key: Option<String>,
        stream: Option<u64>,
    ) -> PyResult<PublishInfo> {
        let deadline = seconds(timeout, "timeout")?;
        let tables = blocks
            .into_iter()
            .enumerate()
            .map(|(g, b)| block_table(b, &format!("blocks[{g}]")))
            .collect::<PyResult<Vec<_>>>()?;
        let serving = self
            .inner
            .read_locked()
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the producer is shut down"))?;
        let published = block_on(py, deadline, || async {
            let p = &serving.producer;
            match (&load_key, stream) {
                (Some(k), None) => p.publish_with_key(request_id, tables, num_tokens, k).await,
                (None, None) => p.publish(request_id, tables, num_tokens).await,
                (k, Some(s)) => {
                    let key = match k {
                        Some(k) => k.clone(),
                        None => kvferry_transfer::Token::random()
                            .map_err(|e| kvferry_p2p::P2pError::Publish {
                                request_id: request_id.to_string(),
                                why: kvferry_p2p::PublishFailure::NoKey(kvferry_transfer::Shared(
                                    std::sync::Arc::new(e),
                                )),
                            })?
                            .to_string(),
                    };
                    // SAFETY: the caller's contract (documented): `stream` is 0 or a live
                    // stream of the ranks' device.
                    unsafe { p.publish_after_stream(request_id, tables, num_tokens, &key, s) }.await
                }
            }
        });
        // After a shutdown this may be the last owner of the engines: unregister without the GIL.
        py.detach(|| drop(serving));
        let info = published.map_err(|b| match b {
            Blocked::Runtime(e) => e,
            Blocked::TimedOut => PyTimeoutError::new_err(format!(
                "publish {request_id:?}: not done within {deadline:?}"
            )),
            Blocked::Failed(e @ kvferry_p2p::P2pError::Closed) => {
                PyRuntimeError::new_err(e.to_string())
            }
            Blocked::Failed(other) => PyValueError::new_err(other.to_string()),
        })?;
        Ok(PublishInfo {
            load_key: info.load_key,
            checksummed: info.checksummed,
            checksum_seconds: info.checksum_seconds,
            payload_bytes: info.payload_bytes,
            warning: info.warning,
        })
    }

    /// released() -> list[tuple[str, kvferry.ReleaseReason]]
    ///
    /// Takes the leases released since the last call as ``(request_id, reason)``: their blocks
    /// may be reused now. ``reason.kind`` is a ``kvferry.Release`` (served, expired, failed);
    /// a failed one's ``reason.why`` is the failure's text.
    fn released<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
        let Some(p) = self.inner.read_locked().clone() else {
            return Ok(Vec::new());
        };
        // The class first: once taken, the leases exist only in this call's result.
        let reason_class = py.import("kvferry.outcomes")?.getattr("ReleaseReason")?;
        let released = p.producer.released();
        // After a shutdown this may be the last owner of the engines: unregister without the GIL.
        py.detach(|| drop(p));
        released
            .into_iter()
            .map(|r| {
                let (kind, why) = match r.reason {
                    ReleaseReason::Served => ("served", None),
                    ReleaseReason::Expired => ("expired", None),
                    ReleaseReason::Failed(e) => ("failed", Some(e.to_string())),
                };
                Ok((r.request_id, reason_class.call1((kind, why))?))
            })
            .collect()
    }

    /// shutdown(timeout=10.0): stops serving (loads in flight get no reply), closes the control
    /// socket and unregisters the tensors (a publish still running fails and the tensors go
    /// when it returns). Idempotent. TimeoutError when the event loop did not stop within
    /// ``timeout`` seconds (the memory is unregistered all the same).
    #[pyo3(signature = (timeout=10.0))]
    fn shutdown(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let deadline = seconds(timeout, "timeout")?;
        let Some(serving) = self.inner.write_locked().take() else {
            return Ok(());
        };
        let stopped = block_on(py, deadline, || async {
            serving.producer.shutdown().await;
            Ok::<_, Infallible>(())
        });
        py.detach(|| drop(serving));
        stopped.map_err(|b| match b {
            Blocked::Runtime(e) => e,
            Blocked::TimedOut | Blocked::Failed(_) => {
                PyTimeoutError::new_err(format!("shutdown not done within {deadline:?}"))
            }
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.shutdown(py, 10.0)?;
        Ok(false)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Producer(endpoint={}, transport={}, {} ranks)",
            str_repr(py, &self.endpoint),
            str_repr(py, &self.transport),
            self.segments.len()
        )
    }
}

/// Registers the classes of this file. The runtime starts at the first Producer, not at
/// import (a process may fork after importing kvferry).
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Producer>()?;
    m.add_class::<PublishInfo>()?;
    Ok(())
}
