//! `kvferry.Producer` / `kvferry.Consumer`: the verified path (docs/design.md §4) from Python, over
//! kvferry-p2p. A producer publishes a prompt's blocks (checksummed then, held under a lease); a
//! consumer asks for them, the producer WRITEs them into the consumer's KV tensors and replies
//! with the checksum payload, and the consumer verifies the landed blocks and applies the policy
//! before `load` returns. Each rank gets its own transfer engine, with its tensors registered.
//! Calls block with the GIL released, on the module's tokio runtime, each under a deadline.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvferry_checksum::policy::{LoadFailurePolicy, Policy};
use kvferry_p2p::{
    Consumer as P2pConsumer, ConsumerConfig, Landed, LoadError, LoadGroup, LoadSpec,
    Producer as P2pProducer, ProducerConfig, ProducerTimeouts, ReleaseReason,
};
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::layer::Rank;
use crate::repr::{bool_repr, opt_str_repr, str_repr};
use crate::runtime::{block_on, seconds};
use crate::side::{build_side, Side};
use crate::verdict::{action_name, KVChecksumVerdict};

fn block_table(blocks: Vec<Option<i64>>, what: &str) -> PyResult<Vec<Option<u64>>> {
    blocks
        .into_iter()
        .map(|b| match b {
            None => Ok(None),
            Some(id) if id >= 0 => Ok(Some(id as u64)),
            Some(id) => Err(PyValueError::new_err(format!(
                "{what}: block id {id} (null blocks are None)"
            ))),
        })
        .collect()
}

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
    inner: RwLock<Option<Arc<P2pProducer>>>,
    endpoint: String,
    segments: Vec<String>,
    transport: String,
    side: RwLock<Option<Side>>,
}

/// Waits without the GIL until `p` has no other owner (the publishes in flight returned), for at
/// most `deadline`; None when one is still running then.
fn wait_sole_owner(
    py: Python<'_>,
    mut p: Arc<P2pProducer>,
    deadline: Duration,
) -> Option<P2pProducer> {
    py.detach(|| {
        let until = std::time::Instant::now() + deadline;
        loop {
            match Arc::try_unwrap(p) {
                Ok(owned) => return Some(owned),
                Err(shared) if std::time::Instant::now() < until => {
                    p = shared;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(_) => return None,
            }
        }
    })
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
        let segments = side
            .workers
            .iter()
            .map(|w| w.engine.segment_name())
            .collect();
        let transport = side.workers[0].engine.transport_name().to_string();
        let workers = side.workers.clone();
        let started = block_on(py, Duration::from_secs(30), || {
            P2pProducer::start(config, workers)
        })?
        .map_err(|_| PyTimeoutError::new_err("starting the producer took over 30 s"))?
        .map_err(|e| match e {
            kvferry_p2p::P2pError::Workers(_) | kvferry_p2p::P2pError::Config(_) => {
                PyValueError::new_err(e.to_string())
            }
            other => PyRuntimeError::new_err(other.to_string()),
        })?;
        Ok(Producer {
            endpoint: started.endpoint().to_string(),
            inner: RwLock::new(Some(Arc::new(started))),
            segments,
            transport,
            side: RwLock::new(Some(side)),
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

    /// publish(request_id, blocks, num_tokens, *, timeout=60.0, load_key=None) -> PublishInfo
    ///
    /// A prompt's KV is complete: checksums its blocks now (tokens ``[0, num_tokens)`` of every
    /// rank, docs/design.md §2.5), then holds them under the lease until a consumer loads them or the
    /// lease expires. ``blocks[g]`` is KV cache group ``g``'s block table: the block id at each
    /// request position (None for a null block); every group id of the ranks needs an entry.
    /// GPU KV must be written before this call (synchronise the stream that wrote it).
    ///
    /// Raises ValueError: a missing block table, a negative block id, a duplicate request id;
    /// RuntimeError: the producer is shut down; TimeoutError: not done within ``timeout``
    /// seconds. A rank that fails to checksum makes the load travel without checksums
    /// (``PublishInfo.warning``). ``load_key``: the lease's load key (default: a fresh random
    /// one, returned in ``PublishInfo.load_key``); a load must carry it to be served.
    #[pyo3(signature = (request_id, blocks, num_tokens, *, timeout=60.0, load_key=None))]
    fn publish(
        &self,
        py: Python<'_>,
        request_id: &str,
        blocks: Vec<Vec<Option<i64>>>,
        num_tokens: u64,
        timeout: f64,
        load_key: Option<String>,
    ) -> PyResult<PublishInfo> {
        let deadline = seconds(timeout, "timeout")?;
        let tables = blocks
            .into_iter()
            .enumerate()
            .map(|(g, b)| block_table(b, &format!("blocks[{g}]")))
            .collect::<PyResult<Vec<_>>>()?;
        let producer = self
            .inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the producer is shut down"))?;
        let info = block_on(py, deadline, || async {
            match &load_key {
                Some(k) => {
                    producer
                        .publish_with_key(request_id, tables, num_tokens, k)
                        .await
                }
                None => producer.publish(request_id, tables, num_tokens).await,
            }
        })?
        .map_err(|_| {
            PyTimeoutError::new_err(format!(
                "publish {request_id:?}: not done within {deadline:?}"
            ))
        })?
        .map_err(|e| match e {
            kvferry_p2p::P2pError::Closed => PyRuntimeError::new_err(e.to_string()),
            other => PyValueError::new_err(other.to_string()),
        })?;
        Ok(PublishInfo {
            load_key: info.load_key,
            checksummed: info.checksummed,
            checksum_seconds: info.checksum_seconds,
            payload_bytes: info.payload_bytes,
            warning: info.warning,
        })
    }

    /// released() -> list[tuple[str, str]]
    ///
    /// Takes the leases released since the last call as ``(request_id, reason)``, reason
    /// ``"served"``, ``"expired"`` or ``"failed: <why>"``: their blocks may be reused now.
    fn released(&self) -> Vec<(String, String)> {
        let Some(p) = self.inner.read().unwrap_or_else(|p| p.into_inner()).clone() else {
            return Vec::new();
        };
        p.released()
            .into_iter()
            .map(|r| {
                let reason = match r.reason {
                    ReleaseReason::Served => "served".to_string(),
                    ReleaseReason::Expired => "expired".to_string(),
                    ReleaseReason::Failed(why) => format!("failed: {why}"),
                };
                (r.request_id, reason)
            })
            .collect()
    }

    /// shutdown(timeout=10.0): stops serving (loads in flight get no reply), closes the control
    /// socket and unregisters the tensors. Idempotent. TimeoutError when the event loop did not
    /// stop within ``timeout`` seconds (the memory is unregistered all the same).
    #[pyo3(signature = (timeout=10.0))]
    fn shutdown(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let deadline = seconds(timeout, "timeout")?;
        let taken = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        let stopped = match taken {
            // A publish in flight holds a clone; it ends within its own timeout.
            Some(p) => match wait_sole_owner(py, p, deadline) {
                Some(p) => block_on(py, deadline, || p.shutdown())?,
                None => Err(()),
            },
            None => Ok(()),
        };
        let side = self.side.write().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(|| drop(side));
        stopped
            .map_err(|_| PyTimeoutError::new_err(format!("shutdown not done within {deadline:?}")))
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

/// The result of ``Consumer.load``.
///
/// - request_id: the request.
/// - landed: whether the blocks landed (False: the transfer failed, see ``error``).
/// - verdict: the KVChecksumVerdict (docs/design.md §2.6), None when checksums are off or the load
///   did not land.
/// - action: ``"complete"`` (use the loaded KV), ``"fail"`` (end the request with an error) or
///   ``"recompute"`` (discard the loaded KV, recompute the prompt), from the policy (§2.7); a
///   load that did not land is never ``"complete"``.
/// - error: why the load did not land, else None.
/// - bytes: KV bytes the producer wrote.
/// - transfer_seconds: from sending the request to the producer's FINISH.
/// - checksum_seconds: checksumming the landed blocks and comparing.
#[pyclass(frozen, get_all, module = "kvferry")]
pub struct LoadOutcome {
    /// The request.
    request_id: String,
    /// Whether the blocks landed (False: the transfer failed, see ``error``).
    landed: bool,
    /// The KVChecksumVerdict, None when checksums are off or the load did not land.
    verdict: Option<Py<KVChecksumVerdict>>,
    /// ``"complete"``, ``"fail"`` or ``"recompute"`` (docs/design.md §2.7).
    action: &'static str,
    /// Why the load did not land, else None.
    error: Option<String>,
    /// KV bytes the producer wrote.
    bytes: u64,
    /// Seconds from sending the request to the producer's FINISH.
    transfer_seconds: f64,
    /// Seconds spent checksumming the landed blocks and comparing.
    checksum_seconds: f64,
}

#[pymethods]
impl LoadOutcome {
    fn __repr__(&self, py: Python<'_>) -> String {
        let verdict = self
            .verdict
            .as_ref()
            .map(|v| str_repr(py, v.bind(py).get().status()))
            .unwrap_or_else(|| "None".into());
        format!(
            "LoadOutcome({}, landed={}, verdict={verdict}, action={}, bytes={}, error={})",
            str_repr(py, &self.request_id),
            bool_repr(self.landed),
            str_repr(py, self.action),
            self.bytes,
            opt_str_repr(py, self.error.as_deref())
        )
    }
}

/// The landed hook as Python sees it: a dict per call.
fn landed_dict<'py>(py: Python<'py>, landed: &Landed) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("request_id", &landed.request_id)?;
    let groups = landed
        .groups
        .iter()
        .map(|g| {
            let gd = PyDict::new(py);
            gd.set_item("group_id", g.group_id)?;
            gd.set_item("positions", g.positions.clone())?;
            gd.set_item("local_blocks", g.local_blocks.clone())?;
            Ok(gd)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("groups", groups)?;
    Ok(d)
}

/// The consumer (decode) side: loads published KV into its ranks' tensors and verifies it.
///
/// Consumer(ranks, *, host="127.0.0.1", protocol="auto", rdma_devices="", checksums=True,
///          fail_closed=False, load_failure_policy="fail", reply_timeout=30.0, max_wait=120.0,
///          checksum_timeout=30.0, connect_timeout=5.0, secret_file=None, engine_ports=None)
///
/// - ranks: list of Rank, every rank of the side's TP x PP grid exactly once (TP and PP may
///   differ from the producer's: KV heads are mapped between ranks). The tensors are
///   registered with one transfer engine per rank and must stay allocated while the consumer
///   lives (it keeps references). See ``Producer`` for one rank per process.
/// - host, protocol, rdma_devices, secret_file, engine_ports: as for ``Producer``; the producer
///   WRITEs to ``host``.
/// - checksums: verify loads.
/// - fail_closed, load_failure_policy: the policy (``KVChecksumPolicy``). Fail-open by default,
///   as in the checksum series (vLLM's ``kv_checksum_fail_closed`` is opt-in):
///   ``load`` returns every landed load as ``"complete"`` and the caller reads
///   ``out.verdict``; ``fail_closed=True`` fails a mismatched or unverified load instead (the
///   vLLM connector defaults to it: a server should not decode from KV known to differ).
/// - reply_timeout: longest silence from the producer while a load waits; max_wait: longest a
///   load waits in all; checksum_timeout: one rank's checksums of landed blocks;
///   connect_timeout: connecting to a producer. Seconds.
///
/// Raises ValueError: bad ranks, policy, protocol or timeouts; RuntimeError: an engine could not
/// start, a registration failed, GPU KV without a usable CUDA checksum backend.
#[pyclass(frozen, module = "kvferry")]
pub struct Consumer {
    inner: P2pConsumer,
    policy: Policy,
    max_wait: Duration,
    segments: Vec<String>,
    transport: String,
    _side: Side,
}

#[pymethods]
impl Consumer {
    #[new]
    #[pyo3(signature = (ranks, *, host="127.0.0.1", protocol="auto", rdma_devices="", checksums=true, fail_closed=false, load_failure_policy="fail", reply_timeout=30.0, max_wait=120.0, checksum_timeout=30.0, connect_timeout=5.0, secret_file=None, engine_ports=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        ranks: Vec<Py<Rank>>,
        host: &str,
        protocol: &str,
        rdma_devices: &str,
        checksums: bool,
        fail_closed: bool,
        load_failure_policy: &str,
        reply_timeout: f64,
        max_wait: f64,
        checksum_timeout: f64,
        connect_timeout: f64,
        secret_file: Option<&str>,
        engine_ports: Option<&str>,
    ) -> PyResult<Consumer> {
        let policy = Policy {
            fail_closed,
            load_failure: load_failure_policy
                .parse::<LoadFailurePolicy>()
                .map_err(PyValueError::new_err)?,
        };
        let config = ConsumerConfig {
            policy,
            checksums,
            reply_timeout: seconds(reply_timeout, "reply_timeout")?,
            max_wait: seconds(max_wait, "max_wait")?,
            checksum_timeout: seconds(checksum_timeout, "checksum_timeout")?,
            connect_timeout: seconds(connect_timeout, "connect_timeout")?,
            ..ConsumerConfig::default()
        };
        let max_wait = config.max_wait + config.connect_timeout + config.checksum_timeout;
        let side = build_side(
            py,
            ranks,
            host,
            protocol,
            rdma_devices,
            secret_file,
            engine_ports,
        )?;
        let segments = side
            .workers
            .iter()
            .map(|w| w.engine.segment_name())
            .collect();
        let transport = side.workers[0].engine.transport_name().to_string();
        let inner = P2pConsumer::new(config, side.workers.clone())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Consumer {
            inner,
            policy,
            max_wait,
            segments,
            transport,
            _side: side,
        })
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

    /// Whether loads are verified (checksums on).
    #[getter]
    fn checksums_enabled(&self) -> bool {
        self.inner.checksums_enabled()
    }

    /// set_landed_hook(hook): installs ``hook(landed)`` (None removes it), called after each
    /// load's transfer finished and before its verification: fault injection (tests corrupt a
    /// landed byte here). ``landed`` is a dict ``{"request_id": str, "groups": [{"group_id":
    /// int, "positions": [int], "local_blocks": [int]}]}`` (the consumer blocks written at each
    /// request position). It runs on a kvferry thread with the GIL held; writes to GPU KV must be
    /// complete when it returns (synchronise). An exception in it is reported through
    /// ``sys.unraisablehook`` and the load goes on.
    #[pyo3(signature = (hook))]
    fn set_landed_hook(&self, hook: Option<Py<PyAny>>) {
        let hook = hook.map(|h| -> kvferry_p2p::LandedHook {
            Arc::new(move |landed: &Landed| {
                Python::attach(|py| {
                    let r = landed_dict(py, landed).and_then(|d| h.call1(py, (d,)));
                    if let Err(e) = r {
                        tracing::error!(request_id = landed.request_id, "landed hook raised: {e}");
                        e.write_unraisable(py, Some(h.bind(py)));
                    }
                })
            })
        });
        self.inner.set_landed_hook(hook);
    }

    /// load(request_id, producer, remote_blocks, local_blocks, num_tokens, *,
    ///      num_local_computed=0, timeout=None, load_key=None) -> LoadOutcome
    ///
    /// Loads a request's KV: asks ``producer`` (its ``endpoint``) to WRITE the blocks, waits for
    /// its reply, runs the landed hook, checksums the landed blocks on every rank (tokens
    /// ``[num_local_computed, num_tokens)``), compares with the producer's payload, logs the
    /// verdict and applies the policy before it returns. ``remote_blocks[g]`` /
    /// ``local_blocks[g]``: KV cache group ``g``'s block tables on the producer (as it published
    /// them) and here, block id per request position (None for a null block); groups given as
    /// an empty list are not loaded. A load is never retried (KV is fetched at most once).
    ///
    /// ``timeout`` (seconds, default: max_wait + connect_timeout + checksum_timeout) bounds the
    /// whole call. A load that does not land (unreachable producer, ERROR, no reply, timeout) is
    /// returned with ``landed=False``, ``error`` set and the failure action. Raises ValueError
    /// for a bad spec (unknown group, a local block without a producer block, nothing to load).
    /// ``load_key``: the lease's load key (``PublishInfo.load_key``); without the right one the
    /// producer answers ERROR and the load does not land.
    /// ``remote_block_sizes[g]``: the producer's block size of group ``g`` (tokens per block of
    /// ``remote_blocks[g]``, as it announced it); default: the same as this side's. Where it
    /// differs, this side's blocks are filled token by token and verified by chunk sums
    /// (a state group, with no per-token blocks, is refused: ValueError).
    #[pyo3(signature = (request_id, producer, remote_blocks, local_blocks, num_tokens, *, num_local_computed=0, timeout=None, load_key=None, remote_block_sizes=None))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        &self,
        py: Python<'_>,
        request_id: &str,
        producer: &str,
        remote_blocks: Vec<Vec<Option<i64>>>,
        local_blocks: Vec<Vec<Option<i64>>>,
        num_tokens: u64,
        num_local_computed: u64,
        timeout: Option<f64>,
        load_key: Option<String>,
        remote_block_sizes: Option<Vec<u64>>,
    ) -> PyResult<LoadOutcome> {
        let deadline = match timeout {
            Some(t) => seconds(t, "timeout")?,
            None => self.max_wait,
        };
        if remote_blocks.len() != local_blocks.len() {
            return Err(PyValueError::new_err(format!(
                "remote_blocks has {} groups, local_blocks {}",
                remote_blocks.len(),
                local_blocks.len()
            )));
        }
        if let Some(sizes) = &remote_block_sizes {
            if sizes.len() != remote_blocks.len() {
                return Err(PyValueError::new_err(format!(
                    "remote_block_sizes has {} groups, remote_blocks {}",
                    sizes.len(),
                    remote_blocks.len()
                )));
            }
        }
        let mut groups = Vec::new();
        for (g, (remote, local)) in remote_blocks.into_iter().zip(local_blocks).enumerate() {
            if remote.is_empty() && local.is_empty() {
                continue;
            }
            groups.push(LoadGroup {
                remote_block_size: remote_block_sizes.as_ref().map(|s| s[g]),
                group_id: g as u32,
                remote_blocks: block_table(remote, &format!("remote_blocks[{g}]"))?,
                local_blocks: block_table(local, &format!("local_blocks[{g}]"))?,
            });
        }
        let spec = LoadSpec {
            request_id: request_id.to_string(),
            producer: producer.to_string(),
            groups,
            num_local_computed,
            num_tokens,
            load_key,
        };
        let on_error = |error: String| LoadOutcome {
            request_id: request_id.to_string(),
            landed: false,
            verdict: None,
            // A load that did not land is never completed (docs/design.md §2.7).
            action: match self.policy.load_failure {
                LoadFailurePolicy::Fail => "fail",
                LoadFailurePolicy::Recompute => "recompute",
            },
            error: Some(error),
            bytes: 0,
            transfer_seconds: 0.0,
            checksum_seconds: 0.0,
        };
        let result = match block_on(py, deadline, || self.inner.load(spec))? {
            Err(()) => return Ok(on_error(format!("load not done within {deadline:?}"))),
            Ok(r) => r,
        };
        match result {
            Ok(o) => Ok(LoadOutcome {
                request_id: o.request_id,
                landed: true,
                verdict: o
                    .verdict
                    .map(|v| Py::new(py, KVChecksumVerdict { inner: v }))
                    .transpose()?,
                action: action_name(o.action),
                error: None,
                bytes: o.bytes,
                transfer_seconds: o.transfer_seconds,
                checksum_seconds: o.checksum_seconds,
            }),
            Err(e @ LoadError::Spec { .. }) => Err(PyValueError::new_err(e.to_string())),
            Err(e) => Ok(on_error(e.to_string())),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Consumer(transport={}, {} ranks, checksums={})",
            str_repr(py, &self.transport),
            self.segments.len(),
            bool_repr(self.inner.checksums_enabled())
        )
    }
}

/// Registers the classes of this file. The runtime starts at the first Producer or Consumer,
/// not at import (a process may fork after importing kvferry).
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Producer>()?;
    m.add_class::<PublishInfo>()?;
    m.add_class::<Consumer>()?;
    m.add_class::<LoadOutcome>()?;
    Ok(())
}
