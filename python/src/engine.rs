//! `kvferry.TransferEngine`: Mooncake's Python `TransferEngine` (mooncake.engine, pybind11 module
//! built from `mooncake-integration/transfer_engine/transfer_engine_py.cpp`) over
//! `kvferry_transfer::TransferEngine`, so a connector written for Mooncake (vLLM's
//! MooncakeConnector, SGLang's MooncakeTransferEngine) changes only its import.
//!
//! Same method names, positional order, keyword names, defaults and return codes as Mooncake
//! 0.3.x (checked against `mooncake-transfer-engine-non-cuda` 0.3.13.post1 by
//! `python/tests/test_conformance.py`). Errors never raise: the method logs the reason (Python
//! logger `kvferry.python.engine`) and returns Mooncake's code. Codes that name a cause are
//! Mooncake's `error.h` values, mapped from the error's typed cause by
//! `kvferry_transfer::error::mooncake::code`: -1 invalid argument or failure, -3 address not
//! registered, -4 region busy, -7 overlapping registration, -101 unresolvable peer host or bad
//! name, -102 peer unreachable, -103 malformed reply.
//!
//! Every method that touches the engine releases the GIL (`py.detach`) before it can block:
//! registration (which waits for target-side accesses in progress), transfers, waits, probes.

use kvferry_transfer::sync::MutexExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvferry_transfer::{
    BatchId, BatchStatus, CudaIpcMode, EngineConfig, Op, TransferEngine, TransferRequest,
    TransportKind,
};
use pyo3::prelude::*;

use crate::mooncake::{
    code, op_name, parse_location, single, split_hostname, triples, ERR_INVALID_ARGUMENT,
    P2PHANDSHAKE,
};

/// Mooncake's Python `TransferEngine`, backed by kvferry's transfer engine (TCP, or RDMA where a
/// device is usable). Thread-safe: one engine may be used from many Python threads at once (as
/// vLLM's transfer thread pool does); every call that can block releases the GIL.
///
/// Lifecycle: `TransferEngine()` creates an empty handle; `initialize(...)` starts the engine
/// (handshake listener, transport). Other methods before a successful `initialize` log and
/// return their failure code. Dropping the object stops the engine.
///
/// Source: Mooncake `transfer_engine_py.cpp` (names, defaults, codes); kvferry docs/design.md §3
/// (the engine underneath).
#[pyclass(name = "TransferEngine", module = "kvferry", frozen)]
pub struct PyTransferEngine {
    engine: OnceLock<Arc<TransferEngine>>,
    /// Deadlines of batches submitted by the async calls, by batch id (Mooncake: 30 s +
    /// 1 ns per byte from submission, `MC_TRANSFER_TIMEOUT` overrides the 30 s).
    deadlines: Mutex<HashMap<u64, Instant>>,
}

impl PyTransferEngine {
    /// The started engine, or `None` with a log line naming the call.
    fn started(&self, call: &str) -> Option<Arc<TransferEngine>> {
        let e = self.engine.get().cloned();
        if e.is_none() {
            tracing::warn!("{call}: the engine is not initialized (call initialize first)");
        }
        e
    }

    /// A sync transfer of `reqs` with segment `target`: 0 or -1 (reason logged; `reqs` `None`:
    /// the call's lists did not match, said by [`triples`]).
    fn sync(
        &self,
        py: Python<'_>,
        call: &str,
        target: &str,
        op: Op,
        reqs: Option<Vec<(u64, u64, u64)>>,
    ) -> i32 {
        let Some(reqs) = reqs else {
            return -1;
        };
        let Some(e) = self.started(call) else {
            return -1;
        };
        py.detach(|| {
            let r = match op {
                Op::Write => e.batch_transfer_sync_write(target, &reqs),
                Op::Read => e.batch_transfer_sync_read(target, &reqs),
            };
            match r {
                Ok(()) => 0,
                Err(err) => {
                    tracing::warn!("{call} with {target}: {err}");
                    -1
                }
            }
        })
    }

    /// Submits `reqs` to `target` without waiting; the batch id, or 0 (reason logged; `reqs`
    /// `None` as [`Self::sync`]).
    fn submit(
        &self,
        py: Python<'_>,
        call: &str,
        target: &str,
        op: Op,
        reqs: Option<Vec<(u64, u64, u64)>>,
    ) -> u64 {
        let Some(reqs) = reqs else {
            return 0;
        };
        let Some(e) = self.started(call) else {
            return 0;
        };
        py.detach(|| {
            let requests: Vec<TransferRequest> = reqs
                .iter()
                .map(|&(local_addr, remote_addr, len)| TransferRequest {
                    op,
                    local_addr,
                    remote_addr,
                    len,
                })
                .collect();
            let bytes = reqs.iter().fold(0u64, |a, r| a.saturating_add(r.2));
            let started = Instant::now();
            let r = e
                .open_segment(target)
                .and_then(|seg| e.submit(&seg, &requests));
            match r {
                Ok(id) => {
                    let deadline = started + e.config().sync_timeout(bytes);
                    self.deadlines.locked().insert(id.0, deadline);
                    id.0
                }
                Err(err) => {
                    tracing::warn!("{call} ({}) with {target}: {err}", op_name(op));
                    0
                }
            }
        })
    }

    fn take_deadline(&self, id: u64) -> Option<Instant> {
        self.deadlines.locked().remove(&id)
    }
}

#[pymethods]
impl PyTransferEngine {
    /// `TransferEngine()`: an engine handle; call `initialize` before anything else.
    #[new]
    fn new() -> Self {
        PyTransferEngine {
            engine: OnceLock::new(),
            deadlines: Mutex::new(HashMap::new()),
        }
    }

    /// `initialize(local_hostname, metadata_server, protocol, device_name) -> int`
    ///
    /// Starts the engine. `local_hostname`: the address peers reach this engine at, `"host"`
    /// (the handshake port is picked by the OS; read it with `get_rpc_port()`) or
    /// `"host:port"`. `metadata_server`: must be `"P2PHANDSHAKE"` (peer-to-peer handshake;
    /// kvferry has no etcd/HTTP metadata service). `protocol`: `"tcp"`, or `"rdma"`/`"auto"`
    /// (RDMA when a usable device is found, else TCP with a warning, as Mooncake falls back),
    /// or Mooncake's same-host GPU name `"nvlink_intra"` (also `"cuda_ipc"`): device memory
    /// between processes of this host through CUDA IPC, a `cuda:N` region that cannot be
    /// exported refused at registration, everything else over TCP or RDMA as `"auto"`. With
    /// `"auto"` CUDA IPC is taken where it can be; `"tcp"` and `"rdma"` move everything over
    /// that protocol (no CUDA IPC). `device_name`: comma-separated RDMA device names (e.g.
    /// `"mlx5_0,mlx5_1"`), `""` = all.
    /// `MC_TRANSFER_TIMEOUT` (seconds, at least 5) sets the sync transfers' base deadline, as in
    /// Mooncake (default 30 s, plus 1 ns per byte). `KVFERRY_ENGINE_PORTS` (`"LO-HI"` or one
    /// port) is the range the engine's listeners take the lowest free ports of, as
    /// `engine_ports` of `Producer`/`Consumer`: the handshake port (unless `local_hostname`
    /// names one) and, over TCP, the data port, so a firewall can list them (Mooncake's API has
    /// no argument for it). Unset: ports the OS picks (ephemeral).
    ///
    /// Returns 0, or -1 (reason logged): unsupported metadata server or protocol, bad hostname,
    /// a malformed `KVFERRY_ENGINE_PORTS` or no free port in it, port in use, already
    /// initialized.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> i32 {
        if metadata_server != P2PHANDSHAKE {
            tracing::error!(
                "initialize: metadata_server {metadata_server:?} is not supported; kvferry supports only \"P2PHANDSHAKE\" (peer-to-peer handshake, no metadata service)"
            );
            return -1;
        }
        let mut cuda_ipc = CudaIpcMode::Auto;
        let (transport, rdma_requested) = match protocol.trim().to_ascii_lowercase().as_str() {
            // A named network protocol is what carries the bytes: no CUDA IPC beside it.
            "tcp" => {
                cuda_ipc = CudaIpcMode::Off;
                (TransportKind::Tcp, false)
            }
            "rdma" => {
                cuda_ipc = CudaIpcMode::Off;
                (TransportKind::Auto, true)
            }
            "auto" => (TransportKind::Auto, false),
            "nvlink_intra" | "cuda_ipc" => {
                cuda_ipc = CudaIpcMode::Required;
                (TransportKind::Auto, false)
            }
            other => {
                tracing::error!("initialize: protocol {other:?} is not supported; use \"tcp\", \"rdma\", \"auto\" or \"nvlink_intra\"");
                return -1;
            }
        };
        let (host, port) = match split_hostname(local_hostname) {
            Ok(hp) => hp,
            Err(why) => {
                tracing::error!("initialize: {why}");
                return -1;
            }
        };
        if self.engine.get().is_some() {
            tracing::error!("initialize: this TransferEngine is already initialized");
            return -1;
        }
        let listen_ports = match crate::side::engine_ports_from_env() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("initialize: {}: {e}", crate::side::ENGINE_PORTS_ENV);
                return -1;
            }
        };
        let mut config = EngineConfig {
            host,
            port,
            listen_ports,
            transport,
            cuda_ipc,
            ..EngineConfig::default()
        };
        config.rdma.devices = device_name
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect();
        if let Some(t) = std::env::var("MC_TRANSFER_TIMEOUT")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            config.transfer_timeout = Duration::from_secs(t.max(5));
        }
        let r = py.detach(|| TransferEngine::new(config));
        match r {
            Ok(e) => {
                if rdma_requested && e.transport_kind() != kvferry_transfer::TransportKind::Rdma {
                    tracing::warn!(
                        "initialize: protocol \"rdma\" requested but no RDMA device is usable here; using TCP"
                    );
                }
                if self.engine.set(e).is_err() {
                    tracing::error!("initialize: this TransferEngine is already initialized");
                    return -1;
                }
                0
            }
            Err(err) => {
                tracing::error!("initialize: {err}");
                -1
            }
        }
    }

    /// `get_rpc_port() -> int`: the port of this engine's handshake listener. Peers name this
    /// engine `"<local_hostname>:<port>"` (the session id / `target_hostname` of transfers).
    /// -1 before `initialize`.
    fn get_rpc_port(&self) -> i64 {
        let Some(e) = self.started("get_rpc_port") else {
            return -1;
        };
        e.segment_name()
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .map_or(-1, i64::from)
    }

    /// `register_memory(buffer_addr, capacity, location="*") -> int`
    ///
    /// Registers `capacity` bytes at address `buffer_addr` so peers may READ and WRITE them and
    /// local transfers may use them. `location`: `"*"` (detect: CUDA device memory of GPU N is
    /// `cuda:N`, anything else host memory), `"cpu"`/`"cpu:N"`, `"cuda:N"`. The memory must stay
    /// valid until `unregister_memory(buffer_addr)`. Returns 0; -7 when the range overlaps a
    /// registered one; -1 otherwise (zero capacity, unknown location, GPU memory without CUDA).
    #[pyo3(signature = (buffer_addr, capacity, location = "*"))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: u64,
        capacity: u64,
        location: &str,
    ) -> i32 {
        let Some(e) = self.started("register_memory") else {
            return -1;
        };
        py.detach(|| register_one(&e, buffer_addr, capacity, location))
    }

    /// `unregister_memory(buffer_addr) -> int`: unregisters the region registered at
    /// `buffer_addr` (after any target-side access in progress ended; peers' later requests to
    /// it fail), once no transfer of this engine uses it (waiting up to 5 s for those in
    /// flight, even of a batch whose wait timed out). Returns 0; -3 when no region was
    /// registered at that address; -4 (Mooncake's `ERR_BATCH_BUSY`) when transfers still use
    /// it: it stays registered and must not be freed yet; -1 for any other failure.
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: u64) -> i32 {
        let Some(e) = self.started("unregister_memory") else {
            return -1;
        };
        py.detach(|| unregister_one(&e, buffer_addr))
    }

    /// `batch_register_memory(buffer_addresses, capacities, location="*") -> int`
    ///
    /// Registers every `(buffer_addresses[i], capacities[i])` as `register_memory` does, all or
    /// nothing: on a failure the regions registered by this call are unregistered again.
    /// Returns 0, the failing registration's code (-7 overlap, -1 other), or -1 when the lists
    /// differ in length.
    #[pyo3(signature = (buffer_addresses, capacities, location = "*"))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: Vec<u64>,
        capacities: Vec<u64>,
        location: &str,
    ) -> i32 {
        let Some(e) = self.started("batch_register_memory") else {
            return -1;
        };
        if buffer_addresses.len() != capacities.len() {
            tracing::warn!(
                "batch_register_memory: {} addresses but {} capacities",
                buffer_addresses.len(),
                capacities.len()
            );
            return ERR_INVALID_ARGUMENT;
        }
        py.detach(|| {
            for (i, (&a, &n)) in buffer_addresses.iter().zip(&capacities).enumerate() {
                let code = register_one(&e, a, n, location);
                if code != 0 {
                    for &done in &buffer_addresses[..i] {
                        let _ = e.unregister_memory(done);
                    }
                    return code;
                }
            }
            0
        })
    }

    /// `batch_unregister_memory(buffer_addresses) -> int`: unregisters each address; returns 0,
    /// or -3 when any of them was not registered (the others are still unregistered).
    fn batch_unregister_memory(&self, py: Python<'_>, buffer_addresses: Vec<u64>) -> i32 {
        let Some(e) = self.started("batch_unregister_memory") else {
            return -1;
        };
        py.detach(|| {
            buffer_addresses
                .iter()
                .map(|&a| unregister_one(&e, a))
                .fold(0, |acc, c| if acc == 0 { c } else { acc })
        })
    }

    /// `transfer_sync_write(target_hostname, buffer, peer_buffer_address, length,
    /// transport_hint="") -> int`
    ///
    /// WRITEs `length` bytes from local `buffer` (registered here) to `peer_buffer_address` in
    /// the engine `target_hostname` (`"host:port"`, see `get_rpc_port`) and waits (deadline
    /// 30 s + 1 ns per byte). Returns 0, or -1 (reason logged: peer unreachable, range outside
    /// registered memory on either side, transfer failed or timed out). `transport_hint` is
    /// accepted for compatibility and ignored (as in Mooncake builds without TENT).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> i32 {
        let _ = transport_hint;
        let reqs = Some(single(buffer, peer_buffer_address, length));
        self.sync(py, "transfer_sync_write", target_hostname, Op::Write, reqs)
    }

    /// `transfer_sync_read(target_hostname, buffer, peer_buffer_address, length,
    /// transport_hint="") -> int`: READs `length` bytes from `peer_buffer_address` in
    /// `target_hostname` into local `buffer` and waits; codes as `transfer_sync_write`.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> i32 {
        let _ = transport_hint;
        let reqs = Some(single(buffer, peer_buffer_address, length));
        self.sync(py, "transfer_sync_read", target_hostname, Op::Read, reqs)
    }

    /// `batch_transfer_sync_write(target_hostname, buffers, peer_buffer_addresses, lengths,
    /// transport_hint="") -> int`
    ///
    /// WRITEs every `lengths[i]` bytes from `buffers[i]` to `peer_buffer_addresses[i]` in
    /// `target_hostname` as one batch and waits (deadline 30 s + 1 ns per byte of the batch).
    /// Returns 0, or -1 (reason logged): lists of different lengths, or as
    /// `transfer_sync_write`. Zero lengths are no-ops.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i32 {
        let _ = transport_hint;
        let call = "batch_transfer_sync_write";
        let reqs = triples(call, &buffers, &peer_buffer_addresses, &lengths);
        self.sync(py, call, target_hostname, Op::Write, reqs)
    }

    /// `batch_transfer_sync_read(target_hostname, buffers, peer_buffer_addresses, lengths,
    /// transport_hint="") -> int`: READs every `lengths[i]` bytes from
    /// `peer_buffer_addresses[i]` into `buffers[i]` as one batch and waits; codes as
    /// `batch_transfer_sync_write`.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i32 {
        let _ = transport_hint;
        let call = "batch_transfer_sync_read";
        let reqs = triples(call, &buffers, &peer_buffer_addresses, &lengths);
        self.sync(py, call, target_hostname, Op::Read, reqs)
    }

    /// `batch_transfer_async_write(target_hostname, buffers, peer_buffer_addresses, lengths,
    /// transport_hint="") -> int`
    ///
    /// Starts the WRITEs of `batch_transfer_sync_write` and returns at once with a batch id
    /// (> 0) for `get_batch_transfer_status`, or 0 on failure (reason logged: lists of
    /// different lengths, peer unreachable, a range outside registered memory).
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let call = "batch_transfer_async_write";
        let reqs = triples(call, &buffers, &peer_buffer_addresses, &lengths);
        self.submit(py, call, target_hostname, Op::Write, reqs)
    }

    /// `batch_transfer_async_read(target_hostname, buffers, peer_buffer_addresses, lengths,
    /// transport_hint="") -> int`: starts the READs of `batch_transfer_sync_read`; batch id
    /// or 0, as `batch_transfer_async_write`.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let call = "batch_transfer_async_read";
        let reqs = triples(call, &buffers, &peer_buffer_addresses, &lengths);
        self.submit(py, call, target_hostname, Op::Read, reqs)
    }

    /// `get_batch_transfer_status(batch_ids) -> int`
    ///
    /// Waits for every batch in `batch_ids` (ids from the async calls) until it completes or
    /// its deadline (30 s + 1 ns per byte from submission) passes, and frees it. Returns 0 when
    /// all completed; -1 at the first failed, timed-out or unknown batch (the remaining ones
    /// are freed, their outcome unobserved), as Mooncake.
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<u64>) -> i32 {
        let Some(e) = self.started("get_batch_transfer_status") else {
            return -1;
        };
        py.detach(|| {
            let mut code = 0;
            for &id in &batch_ids {
                let deadline = self.take_deadline(id);
                if code != 0 {
                    e.free_batch(BatchId(id));
                    continue;
                }
                let Some(deadline) = deadline else {
                    tracing::warn!("get_batch_transfer_status: unknown batch id {id}");
                    code = -1;
                    continue;
                };
                let left = deadline.saturating_duration_since(Instant::now());
                if let Err(err) = e.wait(BatchId(id), left) {
                    tracing::warn!("get_batch_transfer_status: batch {id}: {err}");
                    e.free_batch(BatchId(id));
                    code = -1;
                }
            }
            code
        })
    }

    /// `transfer_submit_write(target_hostname, buffer, peer_buffer_address, length,
    /// transport_hint="") -> int`: starts one WRITE (as `transfer_sync_write`) and returns
    /// its id (> 0) for `transfer_check_status`, or 0 on failure (reason logged).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let reqs = Some(single(buffer, peer_buffer_address, length));
        self.submit(
            py,
            "transfer_submit_write",
            target_hostname,
            Op::Write,
            reqs,
        )
    }

    /// `transfer_check_status(batch_id) -> int`: polls an id from `transfer_submit_write` (or
    /// an async batch) without waiting. 1 = completed (the id is freed), 0 = still in
    /// progress, -1 = failed or unknown id (freed; reason logged), -2 = its deadline passed
    /// (30 s + 1 ns per byte from submission; the id stays valid, as Mooncake's TIMEOUT).
    fn transfer_check_status(&self, py: Python<'_>, batch_id: u64) -> i32 {
        let Some(e) = self.started("transfer_check_status") else {
            return -1;
        };
        py.detach(|| {
            let id = BatchId(batch_id);
            match e.status(id) {
                BatchStatus::Completed => {
                    e.free_batch(id);
                    self.take_deadline(batch_id);
                    1
                }
                BatchStatus::Failed(why) => {
                    tracing::warn!("transfer_check_status: batch {batch_id} failed: {why}");
                    e.free_batch(id);
                    self.take_deadline(batch_id);
                    -1
                }
                BatchStatus::Timeout => -2,
                BatchStatus::Waiting | BatchStatus::Pending => {
                    let late = self
                        .deadlines
                        .locked()
                        .get(&batch_id)
                        .is_some_and(|d| Instant::now() > *d);
                    if late {
                        -2
                    } else {
                        0
                    }
                }
                BatchStatus::Invalid => {
                    tracing::warn!("transfer_check_status: unknown batch id {batch_id}");
                    -1
                }
            }
        })
    }

    /// `send_probe(peer_server_name) -> int`: checks that the engine `peer_server_name`
    /// (`"host:port"`) answers its handshake (deadline 5 s) and refreshes the cached copy of
    /// its registered memory (a peer that restarted or registered more memory is seen at
    /// once). Returns 0; -101 for a name that is not `host:port` or a host that does not
    /// resolve; -102 when the peer cannot be reached or does not answer in time; -103 when its
    /// reply does not parse; -1 otherwise (reason logged).
    fn send_probe(&self, py: Python<'_>, peer_server_name: &str) -> i32 {
        let Some(e) = self.started("send_probe") else {
            return -1;
        };
        py.detach(|| match e.refresh_segment(peer_server_name) {
            Ok(_) => 0,
            Err(err) => {
                tracing::warn!("send_probe {peer_server_name}: {err}");
                code(&err)
            }
        })
    }

    fn __repr__(&self) -> String {
        match self.engine.get() {
            Some(e) => format!(
                "<kvferry.TransferEngine {} transport={}>",
                e.segment_name(),
                e.transport_name()
            ),
            None => "<kvferry.TransferEngine (not initialized)>".into(),
        }
    }
}

fn register_one(e: &TransferEngine, addr: u64, len: u64, location: &str) -> i32 {
    let loc = match parse_location(location, addr) {
        Ok(l) => l,
        Err(why) => {
            tracing::warn!("register_memory {addr:#x}: {why}");
            return ERR_INVALID_ARGUMENT;
        }
    };
    // SAFETY: the caller promises (Mooncake's contract) that the range is valid memory of
    // that location until it unregisters it.
    match unsafe { e.register_memory(addr, len, loc) } {
        Ok(()) => 0,
        Err(err) => {
            tracing::warn!("register_memory [{addr:#x}, +{len}) at {loc}: {err}");
            code(&err)
        }
    }
}

fn unregister_one(e: &TransferEngine, addr: u64) -> i32 {
    match e.unregister_memory(addr) {
        Ok(()) => 0,
        Err(err) => {
            tracing::warn!("unregister_memory {addr:#x}: {err}");
            code(&err)
        }
    }
}

/// Registers the engine's classes on the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTransferEngine>()?;
    Ok(())
}
