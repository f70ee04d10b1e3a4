//! The state every RDMA thread shares (devices, registered regions, the endpoint cache, the
//! passive table, counters), and the unit of work that moves through them: a slice on its way
//! (`Work`) and a posted work request (`InFlight`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sideway::ibverbs::memory_region::MemoryRegion as VerbsMr;

use super::device::Device;
use super::endpoint::{Endpoint, EpKey};
use super::endpoint_store::Slot;
use super::mirror::Mirror;
use super::passive::PassiveTable;
use super::peer::RdmaPeerInfo;
use super::registration::Registered;
use super::stager::StageJob;
use super::CompletionSink;
use crate::config::RdmaConfig;
use crate::descriptor::SegmentDescriptor;
use crate::memory::MemoryAccess;
use crate::transport::Slice;

/// One slice on its way: the engine's slice, its peer, where to report it, retries so far.
pub(crate) struct Work {
    pub slice: Slice,
    pub peer: Arc<SegmentDescriptor>,
    /// The peer's RDMA peer info, decoded from its descriptor once for the batch.
    pub peer_info: Arc<RdmaPeerInfo>,
    pub sink: CompletionSink,
    pub attempts: u32,
    /// The first failure's text (kept for the final error when a retry fails differently).
    pub first_error: Option<String>,
    /// The host mirror of the local region when it is staged GPU memory (`staging_sync.rs`).
    pub mirror: Option<Arc<Mirror>>,
}

/// A posted work request: what the completion thread needs to finish it.
pub(crate) struct InFlight {
    pub ep: Arc<Endpoint>,
    pub qp: usize,
    /// Its slices, in order, contiguous on both sides (one unless merged; never empty).
    pub works: Vec<Work>,
    /// Bytes of the work request (the slices' lengths summed).
    pub len: u64,
    pub rkey: u32,
    /// Keeps the local memory region registered until the work request completes.
    pub _mr: Arc<VerbsMr>,
    pub posted: Instant,
}

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
    /// Device copies for staged GPU memory.
    pub(super) memory: Arc<dyn MemoryAccess>,
    /// Jobs for the stager thread (`stager.rs`).
    pub(super) stager: Mutex<mpsc::Sender<StageJob>>,
}
