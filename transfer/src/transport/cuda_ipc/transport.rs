//! The CUDA IPC transport: wraps the engine's network transport (TCP or RDMA) and moves the
//! slices whose both sides are device memory of processes on this host as device copies,
//! handing every other slice to the wrapped transport. Its `kind` and descriptor facts are the
//! wrapped transport's, so it talks to peers without CUDA IPC as before.
//!
//! * **Owner side.** `register` lets the wrapped transport register the region, then exports
//!   the allocation holding it (legacy handle or file descriptor, once per allocation) and
//!   publishes [`IpcRegionKeys`] under `cuda_ipc` in the region's keys, and the region in the
//!   live table; memory that cannot be exported publishes `cuda_ipc_refused` with the reason's
//!   text (the typed error stays here for `TransferEngine::region_cuda_ipc`) instead (or is refused, with [`CudaIpcMode::Required`]). A `Connect` frame
//!   `{"cuda_ipc": {...}}` asks for the handles of named allocations: legacy handles come in
//!   the reply, file descriptors (and the live table's) as tickets for the Unix socket.
//! * **Initiator side.** Per peer (name and instance id), each allocation is opened once and
//!   kept until the peer's descriptor changes, the segment is closed, the peer process is gone
//!   or the transport shuts down. Before each copy every slice is checked against the owner's
//!   live table. The engine cuts runs between two such regions into slices of up to 64 MiB
//!   (`Transport::slice_size`; less when the wrapped transport's frames are smaller, since a
//!   slice whose allocation cannot be imported goes to it), not 64 KiB: a device copy costs
//!   host work per slice, not wire time. Slices are coalesced where both sides continue each other, then enqueued on
//!   the local device's stream of this transport (never a caller's stream): copies of 16 MiB
//!   and more one driver call each, the rest in one launch of the piece kernel; an event
//!   recorded after them completes the slices (a completion thread polls it, with a deadline).

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use kvferry_cuda::driver::{Context, Stream};
use kvferry_cuda::ipc::{self, PieceKernel};
use smallvec::SmallVec;

use super::fdpass::FdServer;
use super::keys::{HostIdentity, IpcRegionKeys, OwnEngines, Route};
use super::live::LiveTable;
use super::state::{
    complete_jobs, gpu_err, Export, Job, Lane, Nonces, Peer, TABLES_AHEAD, TABLE_AHEAD_BYTES,
};
use crate::auth::AuthState;
use crate::config::CudaIpcMode;
use crate::descriptor::SegmentDescriptor;
use crate::error::{ConfigError, Result, Shared, TransferError, UnsupportedError};
use crate::memory::{MemoryRegion, RegionKeys};
use crate::sync::MutexExt;
use crate::transport::{
    wait_point, CompletionSink, Slice, StreamPoint, Transport, TransportContext, TransportInfo,
    TransportStats,
};
use crate::types::{Location, TransportKind};

/// The key of a region's CUDA IPC facts in its keys.
pub const KEYS_FIELD: &str = "cuda_ipc";
/// The key of the reason (text, for peers and logs) a `cuda:N` region was not exported; the
/// typed error stays here (`Transport::not_exported`).
pub const REFUSED_FIELD: &str = "cuda_ipc_refused";

/// The transport (see the module doc).
pub struct CudaIpcTransport {
    pub(super) inner: Arc<dyn Transport>,
    /// This engine's segment name and instance id, noted in [`OwnEngines`] while it lives.
    pub(super) own: (String, u64),
    pub(super) mode: CudaIpcMode,
    pub(super) me: Option<HostIdentity>,
    pub(super) auth: Arc<AuthState>,
    pub(super) handshake_timeout: Duration,
    pub(super) exports: Mutex<HashMap<u64, Export>>,
    /// Exported regions (addr → len): what the live table lists.
    pub(super) live_lens: Mutex<HashMap<u64, u64>>,
    pub(super) live: Mutex<Option<LiveTable>>,
    pub(super) fd_server: OnceLock<Result<FdServer>>,
    pub(super) peers: Mutex<HashMap<String, Peer>>,
    pub(super) nonces: Mutex<Nonces>,
    pub(super) lanes: Mutex<HashMap<u32, Arc<Lane>>>,
    /// One import of a peer's allocations at a time, per peer (see [`super::gate`]).
    pub(super) importing: super::gate::ImportGates,
    pub(super) jobs: Mutex<Option<mpsc::Sender<Job>>>,
    pub(super) completer: Mutex<Option<std::thread::JoinHandle<()>>>,
    pub(super) credential: Option<crate::auth::Credential>,
    /// Slice size (bytes) for runs that take CUDA IPC (see the module doc).
    pub(super) ipc_slice: u64,
    /// Peers' region keys as decoded, per descriptor (its address, kept valid by the `Weak`)
    /// and buffer index: a descriptor does not change, and decoding its JSON per submit
    /// costs microseconds.
    pub(super) decoded: Mutex<HashMap<usize, DecodedOf>>,
    /// Whether local device `a` reaches the device of UUID `b` (a fact of this host that
    /// costs several driver calls to find), by local device, then UUID (looked up by `&str`:
    /// no key is built per submit).
    pub(super) access: Mutex<HashMap<u32, HashMap<String, bool>>>,
    /// Caller-stream points (`Transport::order_after`) per local device that slices handed to
    /// the wrapped transport have not waited for yet: it reads device memory from the host.
    fallback_order: Mutex<HashMap<u32, (StreamPoint, Duration)>>,
    /// Why each registered `cuda:N` region that is not exported could not be (base address →
    /// the export's error): one entry per registered region at most, removed at deregister.
    refused: Mutex<HashMap<u64, TransferError>>,
    /// The devices (ordinals) of the `cuda:N` regions exported so far: where a warm-up
    /// (`Transport::warm_up`) imports a peer's allocations. Never more than the devices.
    pub(super) devices: Mutex<Vec<u32>>,
    /// Peer processes (pid) seen alive, and when (`peer_gone`).
    pub(super) alive: Mutex<Vec<(u32, std::time::Instant)>>,
    /// Routes decided lately (`route_keys`): a submit asks for the route of a pair twice (its
    /// slice size, then its post), and the next submit for the same pair again.
    pub(super) routes: Mutex<SmallVec<[RouteMemo; ROUTES_KEPT]>>,
    /// Bumped whenever what a route depends on beside the descriptor and the two regions
    /// changes (a peer's failed imports, a peer forgotten or replaced): routes remembered
    /// before are decided again.
    pub(super) route_epoch: std::sync::atomic::AtomicU64,
}

/// A route remembered (`CudaIpcTransport::route_keys`): of the pair (`local`, the buffer
/// `buffer` of the descriptor `desc` points at), decided at `epoch`, with the buffer's keys.
pub(super) struct RouteMemo {
    /// Whose buffer: a live `Weak` also says that the descriptor at its address is this one.
    pub(super) desc: std::sync::Weak<SegmentDescriptor>,
    pub(super) local: MemoryRegion,
    pub(super) buffer: usize,
    pub(super) epoch: u64,
    pub(super) route: Route,
    pub(super) keys: Decoded,
}

/// Routes remembered at most (the oldest goes first).
pub(super) const ROUTES_KEPT: usize = 8;

/// A pair's keys when it goes over CUDA IPC, `None` when it goes to the wrapped transport.
type RouteKeys = Option<Arc<IpcRegionKeys>>;
/// A peer's keys as `decode_keys` gives them: shared, so that a submit's route lookups copy
/// no host identity (four strings) per call.
pub(super) type Decoded = Option<std::result::Result<Arc<IpcRegionKeys>, ()>>;
/// The decoded keys of one descriptor's buffers.
pub(super) type DecodedOf = (std::sync::Weak<SegmentDescriptor>, HashMap<usize, Decoded>);
/// Descriptors and device pairs remembered at most (more start the memory afresh).
pub(super) const DECODED_KEPT: usize = 64;
/// Pairs of regions one post looks up by a search of its list before it builds a map.
const PAIRS_SEARCHED: usize = 8;

/// The largest slice asked for on a CUDA IPC route: large enough that host work per slice is
/// nothing beside the copy (a 64 MiB copy takes about 30 µs on an H200).
const IPC_SLICE_MAX: u64 = 64 << 20;

/// The slice size of CUDA IPC runs: `IPC_SLICE_MAX`, less when the wrapped transport takes
/// smaller slices (TCP: a slice and its merged tail of a quarter fit one frame), never less
/// than the engine's `slice_size`.
fn ipc_slice_size(config: &crate::config::EngineConfig, inner: TransportKind) -> u64 {
    let limit = match inner {
        TransportKind::Tcp => config.tcp.max_frame_payload / 5 * 4,
        _ => IPC_SLICE_MAX,
    };
    IPC_SLICE_MAX.min(limit).max(config.slice_size)
}

impl CudaIpcTransport {
    /// Wraps `inner`. Errors: none yet (CUDA is probed at the first `cuda:N` registration).
    pub fn new(ctx: &TransportContext, inner: Arc<dyn Transport>) -> Result<Arc<Self>> {
        let inner_kind = inner.kind();
        let (tx, rx) = mpsc::channel::<Job>();
        let completer = std::thread::Builder::new()
            .name("kvferry-cuda-ipc-done".into())
            .spawn(move || complete_jobs(rx))
            .map_err(|e| TransferError::io("start the CUDA IPC completion thread", e))?;
        OwnEngines::add(&ctx.segment_name, ctx.instance_id);
        Ok(Arc::new(CudaIpcTransport {
            inner,
            own: (ctx.segment_name.clone(), ctx.instance_id),
            mode: ctx.config.cuda_ipc,
            me: HostIdentity::local(),
            auth: ctx.auth.clone(),
            handshake_timeout: ctx.config.handshake_timeout,
            exports: Mutex::new(HashMap::new()),
            live_lens: Mutex::new(HashMap::new()),
            live: Mutex::new(None),
            fd_server: OnceLock::new(),
            peers: Mutex::new(HashMap::new()),
            nonces: Mutex::new((HashSet::new(), VecDeque::new())),
            lanes: Mutex::new(HashMap::new()),
            importing: Default::default(),
            jobs: Mutex::new(Some(tx)),
            completer: Mutex::new(Some(completer)),
            credential: ctx.auth.credential(None),
            ipc_slice: ipc_slice_size(&ctx.config, inner_kind),
            decoded: Mutex::new(HashMap::new()),
            access: Mutex::new(HashMap::new()),
            fallback_order: Mutex::new(HashMap::new()),
            refused: Mutex::new(HashMap::new()),
            devices: Mutex::new(Vec::new()),
            alive: Mutex::new(Vec::new()),
            routes: Mutex::new(SmallVec::new()),
            route_epoch: Default::default(),
        }))
    }

    pub(super) fn fd_server(&self) -> Result<&FdServer> {
        self.fd_server
            .get_or_init(FdServer::start)
            .as_ref()
            .map_err(|e| UnsupportedError::IpcSocket(Shared(Arc::new(e.clone()))).into())
    }

    pub(super) fn lane(&self, ordinal: u32) -> Result<Arc<Lane>> {
        // Held while a lane is made (once per device, at its first registration): two first
        // users must not both allocate its tables, each allocation waiting for the device.
        let mut lanes = self.lanes.locked();
        if let Some(l) = lanes.get(&ordinal) {
            return Ok(l.clone());
        }
        let made = kvferry_cuda::guarded("CUDA IPC lane", || {
            let ctx = Context::new(ordinal)?;
            let stream = Stream::new(&ctx)?;
            let kernel = match PieceKernel::new(ordinal) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(
                        "cuda:{ordinal}: no piece kernel ({e}); small CUDA IPC copies go one driver call each"
                    );
                    None
                }
            };
            let strided = match ipc::StridedKernel::new(ordinal) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(
                        "cuda:{ordinal}: no strided kernel ({e}); strided requests go one slice per copy"
                    );
                    None
                }
            };
            // Tables for the launches of the first submits, allocated now: an allocation
            // synchronises the device, which must not happen while others' copies run.
            let ahead = if kernel.is_some() || strided.is_some() {
                ipc::PieceTable::ahead(&ctx, TABLE_AHEAD_BYTES, TABLES_AHEAD).unwrap_or_else(|e| {
                    tracing::warn!("cuda:{ordinal}: no tables allocated ahead ({e}); each is allocated on its first launch");
                    Vec::new()
                })
            } else {
                Vec::new()
            };
            Ok(Lane {
                ctx,
                stream,
                kernel,
                strided,
                tables: Mutex::new(ahead),
                late_tables: Default::default(),
                events: Mutex::new(Vec::new()),
            })
        })
        .map_err(gpu_err)?;
        let l = Arc::new(made);
        lanes.insert(ordinal, l.clone());
        Ok(l)
    }
}

impl CudaIpcTransport {
    /// Before the wrapped transport reads device memory from the host: waits for the caller
    /// stream points of the slices' devices not waited for yet (a point stays until it is
    /// reached, so a timeout fails every later such post too).
    fn wait_fallback_order(&self, slices: &[Slice]) -> Result<()> {
        let mut devices: Vec<u32> = Vec::new();
        for s in slices {
            if let Location::Cuda(n) = s.local_region.location {
                if !devices.contains(&n) {
                    devices.push(n);
                }
            }
        }
        for n in devices {
            let Some((point, deadline)) = self.fallback_order.locked().get(&n).cloned() else {
                continue;
            };
            wait_point(&point, deadline)?;
            let mut pending = self.fallback_order.locked();
            if pending.get(&n).is_some_and(|(p, _)| Arc::ptr_eq(p, &point)) {
                pending.remove(&n);
            }
        }
        Ok(())
    }
}

impl Transport for CudaIpcTransport {
    fn path(
        &self,
        peer: &SegmentDescriptor,
        local: &MemoryRegion,
        remote_buffer: usize,
    ) -> crate::types::TransferPath {
        match self.route_keys(peer, None, local, remote_buffer).0 {
            Route::Ipc | Route::InProcess => crate::types::TransferPath::CudaIpc,
            Route::Fallback(_) => self.inner.path(peer, local, remote_buffer),
        }
    }

    fn slice_size(
        &self,
        peer: &SegmentDescriptor,
        local: &MemoryRegion,
        remote_buffer: usize,
        default: u64,
    ) -> u64 {
        match self.route_keys(peer, None, local, remote_buffer).0 {
            Route::Ipc | Route::InProcess => self.ipc_slice.max(default),
            Route::Fallback(_) => self.inner.slice_size(peer, local, remote_buffer, default),
        }
    }

    fn takes_strided(
        &self,
        peer: &SegmentDescriptor,
        local: &MemoryRegion,
        remote_buffer: usize,
    ) -> bool {
        self.takes_strided_pair(peer, local, remote_buffer)
    }

    fn post_strided(
        &self,
        peer: &Arc<SegmentDescriptor>,
        groups: &[crate::strided::StridedGroup],
        done: CompletionSink,
    ) {
        self.post_strided_groups(peer, groups, done)
    }

    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn not_exported(&self, addr: u64) -> Option<TransferError> {
        self.refused.locked().get(&addr).cloned()
    }

    fn local_info(&self) -> TransportInfo {
        self.inner.local_info()
    }

    fn register(&self, region: &MemoryRegion) -> Result<RegionKeys> {
        let mut keys = self.inner.register(region)?;
        let Location::Cuda(ordinal) = region.location else {
            return Ok(keys);
        };
        let exported = self.export(region, ordinal).and_then(|k| {
            let regs = self.live_regions(Some(region), None);
            self.publish_live(&regs)?;
            self.live_lens.locked().insert(region.addr, region.len);
            Ok(k)
        });
        match exported {
            Ok(k) => {
                let mut devices = self.devices.locked();
                if !devices.contains(&ordinal) {
                    devices.push(ordinal);
                }
                drop(devices);
                keys.transport.insert(
                    KEYS_FIELD,
                    serde_json::to_value(&k).map_err(|e| {
                        TransferError::Config(ConfigError::KeysEncode {
                            transport: "CUDA IPC",
                            source: Arc::new(e),
                        })
                    })?,
                );
            }
            Err(e) if self.mode == CudaIpcMode::Required => {
                self.unexport(region);
                let _ = self.inner.deregister(region);
                return Err(e);
            }
            Err(e) => {
                self.unexport(region);
                tracing::warn!(
                    "[{:#x}, +{}) on {}: not exported for CUDA IPC ({e}); peers on this host move it over {}",
                    region.addr,
                    region.len,
                    region.location,
                    self.inner.kind()
                );
                keys.transport
                    .insert(REFUSED_FIELD, serde_json::Value::String(e.to_string()));
                self.refused.locked().insert(region.addr, e);
            }
        }
        Ok(keys)
    }

    fn deregister(&self, region: &MemoryRegion) -> Result<()> {
        if region.location != Location::Cpu {
            self.live_lens.locked().remove(&region.addr);
            let regs = self.live_regions(None, Some(region.addr));
            if let Err(e) = self.publish_live(&regs) {
                tracing::warn!("CUDA IPC live table: {e}");
            }
            self.unexport(region);
            self.refused.locked().remove(&region.addr);
        }
        self.inner.deregister(region)
    }

    fn on_handshake(&self, peer: SocketAddr, body: &[u8]) -> Result<Vec<u8>> {
        if body.starts_with(b"{\"cuda_ipc\"") {
            return self.handle_request(body);
        }
        self.inner.on_handshake(peer, body)
    }

    fn post(
        &self,
        peer: &Arc<SegmentDescriptor>,
        slices: &[Slice],
        done: CompletionSink,
        token: Option<crate::auth::Token>,
    ) {
        // The route depends on the two regions only: decided once per pair (a submit names
        // few pairs, and consecutive slices almost always share one: the last pair is tried
        // first). `which[i]`: the index in `routes` of slice i's pair.
        // Inline for the few pairs and slices of a common post: no allocation per post.
        let mut routes: SmallVec<[((u64, usize), RouteKeys); 2]> = SmallVec::new();
        let mut which: SmallVec<[u32; 8]> = SmallVec::with_capacity(slices.len());
        let mut index: HashMap<(u64, usize), usize> = HashMap::new();
        let mut last = usize::MAX;
        for s in slices {
            let pair = (s.local_region.addr, s.remote_buffer);
            if routes.get(last).is_none_or(|(p, _)| *p != pair) {
                // A few pairs are searched in place; the map (no allocation until then) only
                // past `PAIRS_SEARCHED`.
                let found = if routes.len() <= PAIRS_SEARCHED {
                    routes.iter().position(|(p, _)| *p == pair)
                } else {
                    index.get(&pair).copied()
                };
                last = match found {
                    Some(i) => i,
                    None => {
                        let (route, k) =
                            self.route_keys(peer, Some(peer), &s.local_region, s.remote_buffer);
                        let d = match route {
                            Route::Ipc | Route::InProcess => k.and_then(|r| r.ok()),
                            Route::Fallback(_) => None,
                        };
                        routes.push((pair, d));
                        if routes.len() > PAIRS_SEARCHED {
                            if index.is_empty() {
                                index.extend(routes.iter().enumerate().map(|(i, (p, _))| (*p, i)));
                            } else {
                                index.insert(pair, routes.len() - 1);
                            }
                        }
                        routes.len() - 1
                    }
                };
            }
            which.push(last as u32);
        }
        let mut fallback = Vec::new();
        let mut ipc_slices: super::state::IpcSlices = SmallVec::with_capacity(slices.len());
        for (&s, w) in slices.iter().zip(which) {
            match &routes[w as usize].1 {
                Some(k) => ipc_slices.push((s, &**k)),
                None => fallback.push(s),
            }
        }
        if !ipc_slices.is_empty() {
            if fallback.is_empty() {
                done.expect_soon();
            }
            fallback.extend(self.post_ipc(peer, ipc_slices, &done));
        }
        if !fallback.is_empty() {
            if let Err(e) = self.wait_fallback_order(&fallback) {
                done.fail_all(fallback.iter().map(|s| s.id), &e);
                return;
            }
            self.inner.post(peer, &fallback, done, token);
        }
    }

    fn warm_up(&self, peer: &Arc<SegmentDescriptor>) -> Result<usize> {
        let warmed = self.warm(peer)?;
        Ok(warmed + self.inner.warm_up(peer)?)
    }

    fn mapped(
        &self,
        peer: &Arc<SegmentDescriptor>,
        device: u32,
        ranges: &[(u64, u64)],
    ) -> Option<Result<Vec<crate::transport::MappedRange>>> {
        self.mapped_ranges(peer, device, ranges)
    }

    fn order_after(&self, device: u32, point: &StreamPoint, deadline: Duration) -> Result<()> {
        let lane = self.lane(device)?;
        // SAFETY: the lane's stream and the event are live; a stream may wait for an event of
        // another context of the same device.
        unsafe { kvferry_cuda::driver::stream_wait(lane.stream.raw(), point) }.map_err(gpu_err)?;
        self.fallback_order
            .locked()
            .insert(device, (point.clone(), deadline));
        Ok(())
    }

    fn disconnect(&self, name: &str) {
        self.drop_peer(name);
        self.inner.disconnect(name);
    }

    fn forget_idle(&self, name: &str) {
        // Copies in flight hold their mappings until their events complete.
        self.drop_peer(name);
        self.inner.forget_idle(name);
    }

    fn stats(&self) -> TransportStats {
        let mut s = self.inner.stats();
        let peers = self.peers.locked();
        s.peers += peers.len();
        s.connections += peers.values().map(|p| p.mapped.len()).sum::<usize>();
        s
    }

    fn shutdown(&self) {
        self.jobs.locked().take();
        if let Some(t) = self.completer.locked().take() {
            let _ = t.join();
        }
        self.peers.locked().clear();
        self.routes_changed();
        self.inner.shutdown();
    }
}

impl Drop for CudaIpcTransport {
    fn drop(&mut self) {
        OwnEngines::remove(&self.own.0, self.own.1);
    }
}

#[cfg(test)]
#[path = "transport_tests.rs"]
pub(super) mod tests;
