//! The state every RDMA thread shares: devices, registered regions, the endpoint cache, the
//! passive table, the in-flight tables, counters. Each part's methods on it live with the part
//! (`impl Shared` in endpoint_store, registration, stager, retry, workers); the types they
//! share sit below it (`work.rs`, `inflight.rs`, `endpoint.rs`), so nothing here is imported
//! back.

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sideway::ibverbs::memory_region::MemoryRegion as VerbsMr;

use super::device::Device;
use super::endpoint::{EpKey, Slot};
use super::inflight::InFlightTable;
use super::mirror::Mirror;
use super::passive::PassiveTable;
use super::work::StageJob;
use crate::config::RdmaConfig;
use crate::memory::MemoryAccess;

pub(super) struct Shared {
    pub(super) config: RdmaConfig,
    pub(super) handshake_timeout: Duration,
    /// What this engine proves on a peer's handshake listener before `Connect` frames: its
    /// shared secret in authenticated mode (`crate::auth`), nothing in open mode.
    pub(super) credential: Option<crate::auth::Credential>,
    pub(super) segment_name: String,
    /// This engine's instance id (sent in Connect frames: a target drops the endpoints of an
    /// earlier instance of ours).
    pub(super) instance_id: u64,
    /// An endpoint with no work for this long is dropped (`EngineConfig::peer_idle_timeout`).
    pub(super) idle_timeout: Duration,
    pub(super) devices: Vec<Arc<Device>>,
    pub(super) regions: Mutex<HashMap<u64, Registered>>,
    pub(super) endpoints: Mutex<HashMap<EpKey, Slot>>,
    /// Last failed endpoint id per key: the next Connect tells the target to drop it.
    pub(super) replaced: Mutex<HashMap<EpKey, u64>>,
    pub(super) passive: Mutex<PassiveTable>,
    pub(super) stop: AtomicBool,
    /// Slices re-dispatched after a failure (diagnostics and tests).
    pub(super) retried: AtomicU64,
    /// Work requests posted so far (diagnostics and tests: slices merged into fewer).
    pub(super) posted: AtomicU64,
    /// Work completions polled so far: one per signalled work request (the last of each posted
    /// chain), plus one per error or flush (diagnostics and tests).
    pub(super) completions: AtomicU64,
    /// Device copies for staged GPU memory.
    pub(super) memory: Arc<dyn MemoryAccess>,
    /// Jobs for the stager thread (`stager.rs`).
    pub(super) stager: Mutex<mpsc::Sender<StageJob>>,
    /// Work requests in flight, one table per device (`devices[i]` posts into `inflight[i]`).
    pub(super) inflight: Vec<Mutex<InFlightTable>>,
}

impl Shared {
    /// The in-flight table of `dev`.
    pub(super) fn lock_inflight(&self, dev: &Device) -> MutexGuard<'_, InFlightTable> {
        self.inflight[dev.index].locked()
    }
}

/// A registered region: one verbs memory region per device (of the region itself, or of its
/// host mirror when it is staged GPU memory).
pub(super) struct Registered {
    pub(super) mrs: Vec<Arc<VerbsMr>>,
    pub(super) mirror: Option<Arc<Mirror>>,
}
