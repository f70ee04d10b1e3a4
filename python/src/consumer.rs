//! `kvferry.Consumer`: the decode side of the verified path from Python (see p2p.rs). A load
//! asks the producer for the blocks, waits for them to land in the ranks' KV tensors, verifies
//! them and applies the policy before `Consumer.load` returns, under one deadline (the core's
//! `ConsumerConfig::load_deadline` unless the caller gives one), with the GIL released.

use std::sync::Arc;
use std::time::Duration;

use kvferry_checksum::policy::{Action, LoadFailurePolicy, Policy};
use kvferry_p2p::{
    Consumer as P2pConsumer, ConsumerConfig, Landed, LoadError, LoadGroup, LoadSpec,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::layer::Rank;
use crate::repr::{bool_repr, opt_str_repr, str_repr};
use crate::runtime::{block_on, seconds, Blocked};
use crate::side::{block_table, build_side, Side};
use crate::verdict::{action_name, KVChecksumVerdict};

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
/// - read: whether this consumer read the blocks itself (same-host GPU KV over CUDA IPC,
///   docs/design.md §4.10) instead of the producer writing them.
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
    /// Whether this consumer read the blocks itself (docs/design.md §4.10).
    read: bool,
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
    /// `load`'s default deadline ([`ConsumerConfig::load_deadline`]).
    load_deadline: Duration,
    segments: Vec<String>,
    transport: String,
    _side: Side,
}

/// A consumer's settings with these timeouts (seconds; ValueError for a bad one), the rest
/// as the core's defaults.
fn consumer_timeouts(
    reply_timeout: f64,
    max_wait: f64,
    checksum_timeout: f64,
    connect_timeout: f64,
) -> PyResult<ConsumerConfig> {
    Ok(ConsumerConfig {
        reply_timeout: seconds(reply_timeout, "reply_timeout")?,
        max_wait: seconds(max_wait, "max_wait")?,
        checksum_timeout: seconds(checksum_timeout, "checksum_timeout")?,
        connect_timeout: seconds(connect_timeout, "connect_timeout")?,
        ..ConsumerConfig::default()
    })
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
            ..consumer_timeouts(reply_timeout, max_wait, checksum_timeout, connect_timeout)?
        };
        let load_deadline = config.load_deadline();
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
        let inner = P2pConsumer::new(config, side.workers.clone())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Consumer {
            inner,
            policy,
            load_deadline,
            segments,
            transport,
            _side: side,
        })
    }

    /// load_deadline_for(*, reply_timeout=30.0, max_wait=120.0, checksum_timeout=30.0,
    ///                   connect_timeout=5.0) -> float
    ///
    /// The longest one load of a ``Consumer`` built with these timeouts may take, in seconds:
    /// connecting and the producer's welcome (``connect_timeout`` each), handing the request
    /// over (5 s), the overall wait (``max_wait``, never less than ``reply_timeout``), then the
    /// checksums (``checksum_timeout``). ``load``'s default deadline; an embedder's own
    /// deadline for a load should be taken from it. Raises ValueError for a bad timeout.
    #[staticmethod]
    #[pyo3(signature = (*, reply_timeout=30.0, max_wait=120.0, checksum_timeout=30.0, connect_timeout=5.0))]
    fn load_deadline_for(
        reply_timeout: f64,
        max_wait: f64,
        checksum_timeout: f64,
        connect_timeout: f64,
    ) -> PyResult<f64> {
        let config = consumer_timeouts(reply_timeout, max_wait, checksum_timeout, connect_timeout)?;
        Ok(config.load_deadline().as_secs_f64())
    }

    /// The longest one load of this consumer may take, in seconds (``load``'s default
    /// deadline; see ``load_deadline_for``).
    #[getter]
    fn load_deadline(&self) -> f64 {
        self.load_deadline.as_secs_f64()
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
    /// ``timeout`` (seconds, default: ``load_deadline``) bounds the
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
            None => self.load_deadline,
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
        let failed = |error: String, action: Action| LoadOutcome {
            request_id: request_id.to_string(),
            landed: false,
            verdict: None,
            action: action_name(action),
            error: Some(error),
            bytes: 0,
            transfer_seconds: 0.0,
            checksum_seconds: 0.0,
            read: false,
        };
        match block_on(py, deadline, || self.inner.load(spec)) {
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
                read: o.read,
            }),
            Err(Blocked::Runtime(e)) => Err(e),
            // The call's own deadline: the load did not land, as any failed load.
            Err(Blocked::TimedOut) => Ok(failed(
                format!("load not done within {deadline:?}"),
                self.policy.on_load_error(),
            )),
            Err(Blocked::Failed(e @ LoadError::Spec { .. })) => {
                Err(PyValueError::new_err(e.to_string()))
            }
            Err(Blocked::Failed(e)) => Ok(failed(e.to_string(), e.action(&self.policy))),
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

/// Registers the classes of this file. The runtime starts at the first Consumer, not at import.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Consumer>()?;
    m.add_class::<LoadOutcome>()?;
    Ok(())
}
