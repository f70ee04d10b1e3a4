//! One side's ranks for `kvferry.Producer` / `kvferry.Consumer` (`p2p.rs`): a transfer engine
//! per rank with the rank's tensors registered, and its checksum backend, unregistered again
//! when the side is dropped.

use std::sync::Arc;

use kvferry_kernels::{try_backend_for, ChecksumBackend};
use kvferry_p2p::{Worker, WorkerGroup};
use kvferry_transfer::{
    EngineConfig, Location, PortRange, PortRangeError, TransferEngine, TransportKind,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::layer::{device_name, memory_ranges, Rank};

/// One side's ranks with their engines; unregisters the tensors' memory when dropped.
pub(crate) struct Side {
    pub(crate) workers: Vec<Worker>,
    /// The ranks' segment names, in rank order (what `segments` reports).
    pub(crate) segments: Vec<String>,
    /// The transport the engines chose (`"tcp"` or `"rdma"`; what `transport` reports).
    pub(crate) transport: String,
    registered: Vec<(Arc<TransferEngine>, u64)>,
    /// The ranks (and through them the tensors) stay alive as long as the side.
    _ranks: Vec<Py<Rank>>,
}

impl Drop for Side {
    fn drop(&mut self) {
        for (engine, addr) in &self.registered {
            let _ = engine.unregister_memory(*addr);
        }
    }
}

/// The environment variable `TransferEngine.initialize` reads its engine port range from
/// (Mooncake's API has no argument for it).
pub(crate) const ENGINE_PORTS_ENV: &str = "KVFERRY_ENGINE_PORTS";

/// The engine port range in `KVFERRY_ENGINE_PORTS` (`"LO-HI"` or one port); `None` when it is
/// unset or empty. Errors: a malformed range.
pub(crate) fn engine_ports_from_env() -> Result<Option<PortRange>, PortRangeError> {
    match std::env::var(ENGINE_PORTS_ENV) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse::<PortRange>().map(Some),
        _ => Ok(None),
    }
}

fn transport_of(protocol: &str) -> PyResult<TransportKind> {
    protocol.parse::<TransportKind>().map_err(|_| {
        PyValueError::new_err(format!("protocol {protocol:?}: expected tcp, rdma or auto"))
    })
}

/// Builds the p2p workers of `ranks`: one transfer engine per rank on `host` with `protocol`,
/// every tensor's memory registered with it, the rank's checksum backend (CUDA for GPU KV).
/// `secret_file`: the shared secret's file (docs/design.md §8.1: the engines authenticate and
/// loads use per-load grants), `None`: open engines. `engine_ports`: `"LO-HI"`, the range the
/// engines' listeners take their ports from (`None`: ephemeral); ValueError when malformed.
pub(crate) fn build_side(
    py: Python<'_>,
    ranks: Vec<Py<Rank>>,
    host: &str,
    protocol: &str,
    rdma_devices: &str,
    secret_file: Option<&str>,
    engine_ports: Option<&str>,
) -> PyResult<Side> {
    if ranks.is_empty() {
        return Err(PyValueError::new_err("no ranks given"));
    }
    let listen_ports = engine_ports
        .map(str::parse::<PortRange>)
        .transpose()
        .map_err(|e| PyValueError::new_err(format!("engine_ports: {e}")))?;
    let mut config = EngineConfig {
        host: host.to_string(),
        listen_ports,
        transport: transport_of(protocol)?,
        ..EngineConfig::default()
    };
    config.rdma.devices = rdma_devices
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(String::from)
        .collect();
    config.auth.secret_file = secret_file.map(std::path::PathBuf::from);
    if secret_file.is_some() {
        // Read once here, so a bad file is a ValueError naming it rather than one error per rank.
        config.auth.secret = config
            .auth
            .resolve()
            .map_err(|e| PyValueError::new_err(format!("secret_file: {e}")))?;
    }
    let mut side = Side {
        workers: Vec::new(),
        segments: Vec::new(),
        transport: String::new(),
        registered: Vec::new(),
        _ranks: Vec::new(),
    };
    for r in &ranks {
        let rank = r.bind(py).get();
        // No fallback: the CPU backend cannot read KV in GPU memory.
        let backend: Arc<dyn ChecksumBackend> = try_backend_for(rank.device).map_err(|e| {
            PyRuntimeError::new_err(format!(
                "rank {:?}: KV on {} but the CUDA checksum backend is unusable here: {e}",
                rank.rank,
                device_name(rank.device)
            ))
        })?;
        let cfg = config.clone();
        let engine = py
            .detach(|| TransferEngine::new(cfg))
            .map_err(|e| PyRuntimeError::new_err(format!("starting a transfer engine: {e}")))?;
        // One type for where memory lives: the rank's device is the engine's location.
        let location: Location = rank.device;
        for (addr, len) in memory_ranges(py, rank) {
            // SAFETY: the range is the span of tensors the Rank keeps alive; the Side keeps the
            // Rank and unregisters the range before it lets go of it (Drop above).
            unsafe { engine.register_memory(addr, len, location) }.map_err(|e| {
                PyRuntimeError::new_err(format!(
                    "registering {len} bytes of KV at 0x{addr:x} ({}): {e}",
                    device_name(rank.device)
                ))
            })?;
            side.registered.push((engine.clone(), addr));
        }
        let groups = rank
            .groups
            .iter()
            .map(|g| {
                let g = g.bind(py).get();
                WorkerGroup {
                    group_id: g.group_id,
                    block_size: g.block_size,
                    layers: g.layers.iter().map(|l| l.bind(py).get().input()).collect(),
                    sliding_window: g.sliding_window,
                    skipped: g.skipped,
                }
            })
            .collect();
        side.workers.push(Worker {
            rank: rank.rank,
            engine,
            device: rank.device,
            groups,
            backend,
        });
    }
    side.segments = side
        .workers
        .iter()
        .map(|w| w.engine.segment_name())
        .collect();
    // Every rank's engine has the one config: the first one's choice speaks for the side.
    side.transport = side.workers[0].engine.transport_name().to_string();
    side._ranks = ranks;
    Ok(side)
}

/// A Python block table (block ids, None for a null block) as the core's; ValueError naming
/// `what` for a negative id.
pub(crate) fn block_table(blocks: Vec<Option<i64>>, what: &str) -> PyResult<Vec<Option<u64>>> {
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
