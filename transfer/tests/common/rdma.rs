//! Helpers of the RDMA integration tests (`tests/rdma_*.rs`): the device probe with its skip
//! rule, and engines on the RDMA transport.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use kvferry_transfer::{EngineConfig, MemoryAccess, RdmaConfig, TransferEngine, TransportKind};

/// Why the RDMA tests skip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRdma {
    /// The probe found no usable device.
    NoDevice,
    /// This build has no RDMA transport.
    NotBuilt,
}

impl std::fmt::Display for NoRdma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NoRdma::NoDevice => {
                "no usable RDMA device (no libibverbs, no device or no ACTIVE port)"
            }
            NoRdma::NotBuilt => "built without the `rdma` feature",
        })
    }
}

/// `Ok(device)` when an RDMA device is usable, else why not.
#[cfg(feature = "rdma")]
pub fn probe() -> Result<String, NoRdma> {
    kvferry_transfer::transport::rdma::probe(&RdmaConfig::default()).ok_or(NoRdma::NoDevice)
}

#[cfg(not(feature = "rdma"))]
pub fn probe() -> Result<String, NoRdma> {
    let _ = RdmaConfig::default();
    Err(NoRdma::NotBuilt)
}

/// True when an RDMA device is usable; else prints the skip reason (or panics when
/// `KVFERRY_REQUIRE_RDMA=1`, set in the soft-RoCE guest so CI cannot skip silently).
pub fn rdma_or_skip(test: &str) -> bool {
    match probe() {
        Ok(dev) => {
            eprintln!("{test}: RDMA device {dev}");
            true
        }
        Err(why) => {
            if std::env::var("KVFERRY_REQUIRE_RDMA").is_ok_and(|v| v == "1") {
                panic!("{test}: KVFERRY_REQUIRE_RDMA=1 but {why}");
            }
            crate::common::skipped(test, &why);
            false
        }
    }
}

/// An RDMA engine config on 127.0.0.1 with test deadlines.
pub fn config() -> EngineConfig {
    let mut c = EngineConfig {
        transport: TransportKind::Rdma,
        ..EngineConfig::default()
    };
    c.handshake_timeout = Duration::from_secs(5);
    c.transfer_timeout = Duration::from_secs(60);
    c
}

/// An RDMA engine with `f` applied to [`config`].
pub fn engine_with(f: impl FnOnce(&mut EngineConfig)) -> Arc<TransferEngine> {
    let mut c = config();
    f(&mut c);
    let e = TransferEngine::new(c).expect("RDMA engine starts");
    assert_eq!(e.transport_name(), "rdma");
    e
}

/// An RDMA engine with the default config.
pub fn engine() -> Arc<TransferEngine> {
    engine_with(|_| {})
}

/// An RDMA engine that copies non-host memory with `memory`, `f` applied to [`config`].
pub fn engine_with_memory(
    memory: Arc<dyn MemoryAccess>,
    f: impl FnOnce(&mut EngineConfig),
) -> Arc<TransferEngine> {
    let mut c = config();
    f(&mut c);
    let e = TransferEngine::with_memory_access(c, memory).expect("RDMA engine starts");
    assert_eq!(e.transport_name(), "rdma");
    e
}
