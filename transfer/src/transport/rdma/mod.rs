//! The RDMA transport on `sideway` (docs/design.md §3 "RDMA transport"): RC QPs, several per
//! endpoint; RoCEv2 GID chosen automatically (IPv4-mapped first) or by `RdmaConfig::gid_index`;
//! one completion queue and one completion thread per device; bounded outstanding work requests
//! (per QP: `max_wr`; per device: the CQ depth); failed slices retried on a fresh endpoint up to
//! `max_retries` times, then handed to the engine (`CompletionSink::fail_peer`), which fetches
//! the peer's descriptor again and retries once (a restarted peer has new rkeys); an endpoint
//! cache whose endpoints idle for `EngineConfig::peer_idle_timeout` are dropped, with a close
//! notice so the target drops its passive QPs too (a restarted initiator's old passive QPs go
//! when its new instance connects); async events logged by a thread per device.
//!
//! Slices come from the engine already cut (never crossing a memory region) and checked against
//! the peer's advertised buffers; the NIC enforces the rest (rkey scope), and a remote access
//! error comes back as a failed slice naming the work completion status.
//!
//! GPU memory (`cuda:N` regions) is registered per `RdmaConfig::gpu_registration`: dma-buf,
//! else peer memory, else (with a warning) a pinned host mirror kept in step with the device
//! by copies that the initiator's syncs trigger (`staging.rs`, `stager.rs`). The path taken is
//! published in the region's keys and reported by `TransferEngine::region_path`.
//!
//! libibverbs is loaded at run time (rdma-mummy-sys `dlopen`s it): on a machine without it
//! [`probe`] returns `None` and [`create`] a `Config` error; nothing crashes.

mod device;
mod endpoint;
mod stager;
mod staging;
mod verbs;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sideway::ibverbs::memory_region::MemoryRegion as VerbsMr;
use sideway::ibverbs::queue_pair::{
    PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

pub use device::PortInfo;
pub use endpoint::{CloseNotice, ConnectReply, ConnectRequest, QpInfo};

use self::device::Device;
use self::endpoint::{Endpoint, EpKey, PassiveTable};
use self::stager::StageJob;
use self::staging::{Direction, Mirror, SyncRequest};
use super::{CompletionSink, Slice, Transport, TransportContext, TransportInfo, TransportStats};
use crate::config::{GpuRegistration, RdmaConfig};
use crate::error::{Result, TransferError};
use crate::handshake::{self, FrameType};
use crate::memory::{MemoryAccess, MemoryRegion, RegionKeys, RegistrationPath};
use crate::segment::SegmentDescriptor;
use crate::types::{Location, Op};

/// Largest single work request this transport posts, bytes (slices are far smaller; the IB
/// limit is 2^31).
const MAX_WR_BYTES: u64 = 1 << 30;
/// Completions taken per poll.
const POLL_BATCH: usize = 64;

/// `Some(one-line description of the first usable device)` when a device (restricted to
/// `config.devices` when non-empty) opens and has an ACTIVE port with a usable GID; `None`
/// otherwise (no libibverbs: a debug line says why; the engine logs the one info line on the
/// transport it chose). Quick, never panics, no lasting effects.
pub fn probe(config: &RdmaConfig) -> Option<String> {
    let list = match device::list_devices() {
        Ok(l) => l,
        Err(e) => {
            // The engine logs the one info line on the transport it chose.
            tracing::debug!("RDMA unavailable: {e}");
            return None;
        }
    };
    for name in device::wanted_names(&list, config) {
        let Some(dev) = list
            .iter()
            .find(|d| sideway::ibverbs::device::DeviceInfo::name(d) == name)
        else {
            continue;
        };
        let ctx = match dev.open() {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("RDMA device {name}: open: {e}");
                continue;
            }
        };
        match device::choose_port(&ctx, config) {
            Ok(c) => {
                let i = &c.info;
                return Some(format!(
                    "{} port {}, {} GID {} ({}), MTU {}",
                    i.name,
                    i.port,
                    if i.ethernet { "RoCE" } else { "InfiniBand" },
                    i.gid_index,
                    i.gid,
                    i.active_mtu
                ));
            }
            Err(why) => tracing::debug!("RDMA device unusable: {why}"),
        }
    }
    None
}

/// Creates the RDMA transport on every usable device (restricted to `config.rdma.devices`).
/// Errors: `Config` for bad RDMA settings or when no device is usable (with the reasons).
pub fn create(ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
    Ok(RdmaTransport::new(ctx)? as Arc<dyn Transport>)
}

/// dma-buf export of a GPU range: the fd and the range's offset inside the dma-buf.
/// Supplied by the GPU module (`cuMemGetHandleForAddressRange`), see [`set_dmabuf_exporter`].
pub struct DmabufRange {
    /// The dma-buf file descriptor (owned; closed on drop).
    pub fd: OwnedFd,
    /// Byte offset of the region's `addr` from the dma-buf's start (the export covers whole
    /// pages, so this is `addr` modulo the page size).
    pub offset: u64,
}

/// Exports `[region.addr, +region.len)` of a `cuda:N` region as a dma-buf.
pub type DmabufExporter = fn(&MemoryRegion) -> Result<DmabufRange>;

static DMABUF_EXPORTER: OnceLock<DmabufExporter> = OnceLock::new();

/// Installs the dma-buf exporter used to register `cuda:N` regions (docs/design.md §3 "GPU memory":
/// dma-buf first, then the peer-memory path, else a pinned host mirror, see `staging.rs`).
/// Returns false when one was already installed.
pub fn set_dmabuf_exporter(f: DmabufExporter) -> bool {
    DMABUF_EXPORTER.set(f).is_ok()
}

/// Registers a dma-buf range on one device (`ibv_reg_dmabuf_mr`), `iova` = the address peers
/// use for it. Safety: `fd` is a live dma-buf whose `[offset, +len)` stays valid while the
/// memory region exists.
unsafe fn reg_dmabuf(
    dev: &Device,
    fd: &OwnedFd,
    offset: u64,
    len: u64,
    iova: u64,
) -> Result<Arc<VerbsMr>> {
    // SAFETY: forwarded from the caller.
    unsafe {
        dev.pd
            .reg_dmabuf_mr(offset, len as usize, iova, fd.as_raw_fd(), access())
    }
    .map_err(|e| {
        TransferError::Rdma(format!(
            "{}: ibv_reg_dmabuf_mr: {e}: {}",
            dev.info.name,
            err_src(&e)
        ))
    })
}

fn access() -> AccessFlags {
    AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead
}

fn err_src(e: &dyn std::error::Error) -> String {
    e.source().map(|s| s.to_string()).unwrap_or_default()
}

/// One slice on its way: the engine's slice, its peer, where to report it, retries so far.
pub(crate) struct Work {
    pub slice: Slice,
    pub peer: Arc<SegmentDescriptor>,
    pub sink: CompletionSink,
    pub attempts: u32,
    /// The first failure's text (kept for the final error when a retry fails differently).
    pub first_error: Option<String>,
    /// The host mirror of the local region when it is staged GPU memory (`staging.rs`).
    pub mirror: Option<Arc<Mirror>>,
}

/// A posted work request: what the completion thread needs to finish it.
pub(crate) struct InFlight {
    pub ep: Arc<Endpoint>,
    pub qp: usize,
    pub work: Work,
    pub rkey: u32,
    /// Keeps the local memory region registered until the work request completes.
    pub _mr: Arc<VerbsMr>,
    pub posted: Instant,
}

/// A GPU region's registration: its memory regions (one per device), path and host mirror.
type GpuRegistered = (Vec<Arc<VerbsMr>>, RegistrationPath, Option<Arc<Mirror>>);

/// A registered region: one verbs memory region per device (of the region itself, or of its
/// host mirror when it is staged GPU memory).
struct Registered {
    mrs: Vec<Arc<VerbsMr>>,
    mirror: Option<Arc<Mirror>>,
}

enum Slot {
    Connecting(Vec<Work>),
    Ready(Arc<Endpoint>),
}

struct Shared {
    config: RdmaConfig,
    handshake_timeout: Duration,
    /// What this engine proves on a peer's handshake listener before `Connect` frames: its
    /// shared secret in authenticated mode (`crate::auth`), nothing in open mode.
    credential: Option<crate::auth::Credential>,
    segment_name: String,
    /// This engine's instance id (sent in Connect frames: a target drops the endpoints of an
    /// earlier instance of ours).
    instance_id: u64,
    /// An endpoint with no work for this long is dropped (`EngineConfig::peer_idle_timeout`).
    idle_timeout: Duration,
    devices: Vec<Arc<Device>>,
    regions: Mutex<HashMap<u64, Registered>>,
    endpoints: Mutex<HashMap<EpKey, Slot>>,
    /// Last failed endpoint id per key: the next Connect tells the target to drop it.
    replaced: Mutex<HashMap<EpKey, u64>>,
    passive: Mutex<PassiveTable>,
    stop: AtomicBool,
    /// Slices re-dispatched after a failure (diagnostics and tests).
    retried: AtomicU64,
    /// Device copies for staged GPU memory.
    memory: Arc<dyn MemoryAccess>,
    /// Jobs for the stager thread (`stager.rs`).
    stager: Mutex<mpsc::Sender<StageJob>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The RDMA transport (see the module docs).
pub struct RdmaTransport {
    shared: Arc<Shared>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl RdmaTransport {
    /// Opens the devices and starts a completion thread and an async-event thread per device.
    pub fn new(ctx: &TransportContext) -> Result<Arc<RdmaTransport>> {
        let config = ctx.config.rdma.clone();
        device::check_config(&config)?;
        let list = device::list_devices().map_err(|e| {
            TransferError::Config(format!("no usable RDMA device: cannot list devices: {e}"))
        })?;
        let mut devices = Vec::new();
        let mut why = Vec::new();
        for name in device::wanted_names(&list, &config) {
            match Device::open(devices.len(), &list, &name, &config) {
                Ok(d) => devices.push(Arc::new(d)),
                Err(e) => why.push(e.to_string()),
            }
        }
        if devices.is_empty() {
            return Err(TransferError::Config(format!(
                "no usable RDMA device{}{}",
                if config.devices.is_empty() {
                    String::new()
                } else {
                    format!(" among {:?}", config.devices)
                },
                if why.is_empty() {
                    String::new()
                } else {
                    format!(": {}", why.join("; "))
                }
            )));
        }
        for d in &devices {
            tracing::info!(
                "RDMA device {} port {}: GID {} ({}), LID {}, MTU {}, CQ depth {}",
                d.info.name,
                d.info.port,
                d.info.gid_index,
                d.info.gid,
                d.info.lid,
                d.info.active_mtu,
                d.cq_depth
            );
        }
        let (stage_tx, stage_rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            config,
            handshake_timeout: ctx.config.handshake_timeout,
            credential: ctx.auth.credential(None),
            segment_name: ctx.segment_name.clone(),
            instance_id: ctx.instance_id,
            idle_timeout: ctx.config.peer_idle_timeout,
            devices,
            regions: Mutex::new(HashMap::new()),
            endpoints: Mutex::new(HashMap::new()),
            replaced: Mutex::new(HashMap::new()),
            passive: Mutex::new(PassiveTable::default()),
            stop: AtomicBool::new(false),
            retried: AtomicU64::new(0),
            memory: ctx.memory.clone(),
            stager: Mutex::new(stage_tx),
        });
        let t = Arc::new(RdmaTransport {
            shared: shared.clone(),
            threads: Mutex::new(Vec::new()),
        });
        for d in &shared.devices {
            for (kind, f) in [
                ("cq", run_completions as fn(Arc<Shared>, Arc<Device>)),
                ("events", run_events),
            ] {
                let (s, dev) = (shared.clone(), d.clone());
                let h = std::thread::Builder::new()
                    .name(format!("kvferry-rdma-{kind}-{}", d.info.name))
                    .spawn(move || f(s, dev))
                    .map_err(|e| TransferError::io("spawn RDMA thread", e))?;
                lock(&t.threads).push(h);
            }
        }
        let s = shared.clone();
        let h = std::thread::Builder::new()
            .name("kvferry-rdma-stager".into())
            .spawn(move || stager::run_stager(s, stage_rx))
            .map_err(|e| TransferError::io("spawn RDMA stager thread", e))?;
        lock(&t.threads).push(h);
        Ok(t)
    }

    /// Path MTUs of the cached endpoints to segment `peer` (tests and diagnostics).
    pub fn path_mtus(&self, peer: &str) -> Vec<u32> {
        lock(&self.shared.endpoints)
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Ready(ep) if k.peer == peer => Some(ep.path_mtu),
                _ => None,
            })
            .collect()
    }

    /// The devices in use, in descriptor order.
    pub fn ports(&self) -> Vec<PortInfo> {
        self.shared.devices.iter().map(|d| d.info.clone()).collect()
    }

    /// Work requests posted and not yet completed, over all devices.
    pub fn work_requests_in_flight(&self) -> usize {
        self.shared
            .devices
            .iter()
            .map(|d| d.lock_inflight().count)
            .sum()
    }

    /// Slices retried on a fresh endpoint so far.
    pub fn retried_slices(&self) -> u64 {
        self.shared.retried.load(Ordering::Relaxed)
    }

    /// Passive (target-side) endpoints held now.
    pub fn passive_endpoints(&self) -> usize {
        lock(&self.shared.passive).len()
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn local_info(&self) -> TransportInfo {
        TransportInfo {
            kind: "rdma".into(),
            details: serde_json::json!({ "devices": self.ports() }),
        }
    }

    fn register(&self, region: &MemoryRegion) -> Result<RegionKeys> {
        let s = &self.shared;
        for d in &s.devices {
            if region.len > d.max_mr_size {
                return Err(TransferError::Rdma(format!(
                    "region of {} bytes exceeds {}'s largest memory region ({} bytes)",
                    region.len, d.info.name, d.max_mr_size
                )));
            }
        }
        let (mrs, path, mirror) = match region.location {
            Location::Cpu => (
                // SAFETY: the engine's register_memory contract: the range is valid host memory
                // for as long as it stays registered.
                unsafe { s.reg_host(region.addr, region.len) }?,
                RegistrationPath::Host,
                None,
            ),
            Location::Cuda(_) => s.register_gpu(region)?,
        };
        let keys = RegionKeys {
            rkeys: mrs.iter().map(|m| m.rkey()).collect(),
            path,
            staging_addr: mirror.as_ref().map(|m| m.addr()),
        };
        if region.location != Location::Cpu {
            tracing::info!(
                "{} region [{:#x}, +{}) registered for RDMA via {path}",
                region.location,
                region.addr,
                region.len
            );
        }
        lock(&s.regions).insert(region.addr, Registered { mrs, mirror });
        Ok(keys)
    }

    fn deregister(&self, region: &MemoryRegion) -> Result<()> {
        let gone = lock(&self.shared.regions).remove(&region.addr);
        match gone {
            Some(r) => {
                // a peer's sync may be copying into the device range on a handshake thread
                if let Some(m) = r.mirror {
                    m.retire();
                }
                Ok(())
            }
            None => Err(TransferError::InvalidArgument(format!(
                "no RDMA registration at {:#x}",
                region.addr
            ))),
        }
    }

    fn on_handshake(&self, peer: SocketAddr, body: &[u8]) -> Result<Vec<u8>> {
        let s = &self.shared;
        if let Some(sync) = SyncRequest::parse(body) {
            s.serve_sync(&sync?)?;
            return Ok(b"{}".to_vec());
        }
        if let Ok(n) = serde_json::from_slice::<CloseNotice>(body) {
            lock(&s.passive).close(&n.initiator, &n.close);
            return Ok(b"{}".to_vec());
        }
        let req: ConnectRequest = serde_json::from_slice(body)
            .map_err(|e| TransferError::Protocol(format!("RDMA connect from {peer}: {e}")))?;
        endpoint::check_request(&req, s.devices.len())?;
        let dev = &s.devices[req.device];
        let reply = lock(&s.passive).accept(dev, &req, &s.config)?;
        serde_json::to_vec(&reply).map_err(|e| TransferError::Protocol(e.to_string()))
    }

    /// The token is not used: over RDMA the QP acceptance check (the engine answers `Connect`
    /// only on an authenticated handshake connection) is what protects the rkeys.
    fn post(
        &self,
        peer: &Arc<SegmentDescriptor>,
        slices: Vec<Slice>,
        done: CompletionSink,
        _token: Option<crate::auth::Token>,
    ) {
        let s = &self.shared;
        let mirrors: HashMap<u64, Arc<Mirror>> = lock(&s.regions)
            .iter()
            .filter_map(|(a, r)| r.mirror.clone().map(|m| (*a, m)))
            .collect();
        let (mut direct, mut staged) = (Vec::with_capacity(slices.len()), Vec::new());
        for slice in slices {
            let w = Work {
                slice,
                peer: peer.clone(),
                sink: done.clone(),
                attempts: 0,
                first_error: None,
                mirror: mirrors.get(&slice.local_region.addr).cloned(),
            };
            if w.needs_before() {
                staged.push(w);
            } else {
                direct.push(w);
            }
        }
        if !staged.is_empty() {
            s.stage(StageJob::Before(staged));
        }
        if !direct.is_empty() {
            s.dispatch(direct);
        }
    }

    fn stats(&self) -> TransportStats {
        let eps = lock(&self.shared.endpoints);
        let mut peers: Vec<&str> = eps.keys().map(|k| k.peer.as_str()).collect();
        peers.sort_unstable();
        peers.dedup();
        TransportStats {
            peers: peers.len(),
            connections: eps
                .values()
                .map(|s| match s {
                    Slot::Ready(ep) => ep.qps.len(),
                    Slot::Connecting(_) => 0,
                })
                .sum(),
            served_connections: lock(&self.shared.passive).qps(),
        }
    }

    fn disconnect(&self, name: &str) {
        let eps: Vec<Arc<Endpoint>> = lock(&self.shared.endpoints)
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Ready(ep) if k.peer == name => Some(ep.clone()),
                _ => None,
            })
            .collect();
        for ep in eps {
            self.shared
                .endpoint_failed(&ep, format!("disconnected from {name}"));
        }
        lock(&self.shared.passive).remove_initiator(name);
        lock(&self.shared.replaced).retain(|k, _| k.peer != name);
    }

    fn shutdown(&self) {
        let s = &self.shared;
        if s.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
        let gone = TransferError::Rdma("RDMA transport shut down".into());
        let slots: Vec<Slot> = lock(&s.endpoints).drain().map(|(_, v)| v).collect();
        for slot in slots {
            match slot {
                Slot::Connecting(ws) => ws
                    .into_iter()
                    .for_each(|w| w.sink.complete(w.slice.id, Err(gone.clone()))),
                Slot::Ready(ep) => {
                    if let Some(ws) = ep.mark_broken("shut down") {
                        ws.into_iter()
                            .for_each(|w| w.sink.complete(w.slice.id, Err(gone.clone())));
                    }
                }
            }
        }
        for d in &s.devices {
            let left = d.lock_inflight().drain();
            for inf in left {
                inf.work.sink.complete(inf.work.slice.id, Err(gone.clone()));
            }
        }
        lock(&s.passive).clear();
    }
}

impl Shared {
    /// `ibv_reg_mr` of `[addr, +len)` on every device; on error nothing stays registered.
    ///
    /// # Safety
    /// The range is valid host memory (or peer memory the driver can pin) while registered.
    unsafe fn reg_host(&self, addr: u64, len: u64) -> Result<Vec<Arc<VerbsMr>>> {
        self.devices
            .iter()
            .map(|d| {
                // SAFETY: forwarded from the caller.
                unsafe { d.pd.reg_mr(addr as usize, len as usize, access()) }.map_err(|e| {
                    TransferError::Rdma(format!(
                        "{}: ibv_reg_mr [{addr:#x}, +{len}): {e}: {}",
                        d.info.name,
                        err_src(&e)
                    ))
                })
            })
            .collect()
    }

    /// Registers a `cuda:N` region per `config.gpu_registration` (docs/design.md §3 "GPU memory"):
    /// dma-buf, else peer memory, else a host mirror (with a warning naming why GPUDirect
    /// failed). Returns the memory regions (one per device), the path and the mirror.
    /// Errors: `Unsupported` with every path's failure when none works.
    fn register_gpu(&self, region: &MemoryRegion) -> Result<GpuRegistered> {
        let mode = self.config.gpu_registration;
        let mut why = Vec::new();
        if matches!(mode, GpuRegistration::Auto | GpuRegistration::DmaBuf) {
            match self.reg_dmabuf_all(region) {
                Ok(mrs) => return Ok((mrs, RegistrationPath::DmaBuf, None)),
                Err(e) => why.push(format!("dma-buf: {e}")),
            }
        }
        if matches!(mode, GpuRegistration::Auto | GpuRegistration::PeerMemory) {
            // SAFETY: with nvidia-peermem the driver pins the device range; without it this
            // fails (the kernel cannot pin memory the host cannot map).
            match unsafe { self.reg_host(region.addr, region.len) } {
                Ok(mrs) => return Ok((mrs, RegistrationPath::PeerMemory, None)),
                Err(e) => why.push(format!("peer memory: {e}")),
            }
        }
        if matches!(mode, GpuRegistration::Auto | GpuRegistration::Staged) {
            let staged = self.memory.check_region(region).and_then(|()| {
                let m = Mirror::new(region)?;
                // SAFETY: the mirror is host memory owned by `Registered` with the regions.
                let mrs = unsafe { self.reg_host(m.addr(), region.len) }?;
                Ok((mrs, m))
            });
            match staged {
                Ok((mrs, m)) => {
                    if mode == GpuRegistration::Auto {
                        tracing::warn!(
                            "{} region [{:#x}, +{}) cannot be registered with the NIC ({}); \
                             staging it through {} bytes of pinned host memory: every transfer \
                             adds a device copy",
                            region.location,
                            region.addr,
                            region.len,
                            why.join("; "),
                            region.len
                        );
                    }
                    return Ok((mrs, RegistrationPath::Staged, Some(m)));
                }
                Err(e) => why.push(format!("staging: {e}")),
            }
        }
        Err(TransferError::Unsupported(format!(
            "{} region [{:#x}, +{}) cannot be registered for RDMA (gpu_registration {mode:?}): {}",
            region.location,
            region.addr,
            region.len,
            why.join("; ")
        )))
    }

    /// dma-buf registration of a GPU region on every device (one export).
    fn reg_dmabuf_all(&self, region: &MemoryRegion) -> Result<Vec<Arc<VerbsMr>>> {
        let export = DMABUF_EXPORTER
            .get()
            .ok_or_else(|| TransferError::Unsupported("no exporter installed".into()))?;
        let buf = export(region)?;
        self.devices
            .iter()
            // SAFETY: the exporter returns a dma-buf covering the region; it stays registered
            // only while the region is.
            .map(|d| unsafe { reg_dmabuf(d, &buf.fd, buf.offset, region.len, region.addr) })
            .collect()
    }

    /// Serves a peer's staging sync: checks every range against this engine's staged regions,
    /// then copies them (mirror → device after the peer's WRITEs, device → mirror before its
    /// READs). Errors: `InvalidArgument` for a range outside them (nothing is copied), the
    /// first failed copy.
    fn serve_sync(&self, sync: &SyncRequest) -> Result<()> {
        let mirrors: Vec<Arc<Mirror>> = lock(&self.regions)
            .values()
            .filter_map(|r| r.mirror.clone())
            .collect();
        let body = &sync.staging_sync;
        let copies = staging::resolve(body, |a, l| {
            mirrors.iter().find(|m| m.region().contains(a, l)).cloned()
        })?;
        for (m, addr, len) in copies {
            match body.direction {
                Direction::ToDevice => m.to_device(&*self.memory, addr, len)?,
                Direction::ToHost => m.to_host(&*self.memory, addr, len)?,
            }
        }
        Ok(())
    }

    /// Number of devices a peer advertises (its descriptor's `devices` list).
    fn remote_devices(peer: &SegmentDescriptor) -> usize {
        peer.transport
            .details
            .get("devices")
            .and_then(|d| d.as_array())
            .map(|a| a.len())
            .unwrap_or(1)
            .max(1)
    }

    fn key_for(&self, w: &Work) -> EpKey {
        let local_dev = (w.slice.id as usize + w.attempts as usize) % self.devices.len();
        EpKey {
            peer: w.peer.name.clone(),
            instance: w.peer.instance_id,
            local_dev,
            remote_dev: local_dev % Self::remote_devices(&w.peer),
        }
    }

    /// Routes slices to their endpoints; connects (on a new thread) where none is ready.
    fn dispatch(self: &Arc<Self>, works: Vec<Work>) {
        let mut groups: HashMap<EpKey, Vec<Work>> = HashMap::new();
        for w in works {
            groups.entry(self.key_for(&w)).or_default().push(w);
        }
        for (key, ws) in groups {
            if self.stop.load(Ordering::SeqCst) {
                let e = TransferError::Rdma("RDMA transport shut down".into());
                ws.into_iter()
                    .for_each(|w| w.sink.complete(w.slice.id, Err(e.clone())));
                continue;
            }
            let mut eps = lock(&self.endpoints);
            let ws = match eps.get_mut(&key) {
                Some(Slot::Ready(ep)) => {
                    let ep = ep.clone();
                    let mut pending = ep.lock_pending();
                    if !ep.is_broken() {
                        ep.touch();
                        pending.extend(ws);
                        drop(pending);
                        drop(eps);
                        self.pump(&ep);
                        continue;
                    }
                    drop(pending);
                    eps.remove(&key);
                    ws
                }
                Some(Slot::Connecting(waiting)) => {
                    waiting.extend(ws);
                    continue;
                }
                None => ws,
            };
            let backoff = ws.iter().map(|w| w.attempts).max().unwrap_or(0);
            eps.insert(key.clone(), Slot::Connecting(ws));
            drop(eps);
            let s = self.clone();
            let k2 = key.clone();
            let spawned = std::thread::Builder::new()
                .name("kvferry-rdma-connect".into())
                .spawn(move || s.connect(k2, backoff));
            if let Err(e) = spawned {
                let err = TransferError::io("spawn RDMA connect thread", e);
                if let Some(Slot::Connecting(ws)) = lock(&self.endpoints).remove(&key) {
                    ws.into_iter()
                        .for_each(|w| w.sink.complete(w.slice.id, Err(err.clone())));
                }
            }
        }
    }

    /// Connect thread: handshake for `key`, then hands the waiting slices to the endpoint.
    fn connect(self: Arc<Self>, key: EpKey, backoff: u32) {
        if backoff > 0 {
            std::thread::sleep(Duration::from_millis(50 * backoff.min(20) as u64));
        }
        let dev = self.devices[key.local_dev].clone();
        let replaces = lock(&self.replaced).get(&key).copied();
        let timeout = self.handshake_timeout;
        let peer = key.peer.clone();
        let cred = self.credential.clone();
        let res = Endpoint::connect(
            dev,
            key.clone(),
            &self.segment_name,
            self.instance_id,
            replaces,
            &self.config,
            |body| handshake::request_with(&peer, FrameType::Connect, body, timeout, cred.as_ref()),
        );
        let mut eps = lock(&self.endpoints);
        let waiting = match eps.remove(&key) {
            Some(Slot::Connecting(w)) => w,
            Some(other) => {
                eps.insert(key.clone(), other);
                Vec::new()
            }
            None => Vec::new(),
        };
        match res {
            Ok(ep) if !self.stop.load(Ordering::SeqCst) => {
                let ep = Arc::new(ep);
                ep.lock_pending().extend(waiting);
                eps.insert(key, Slot::Ready(ep.clone()));
                drop(eps);
                self.pump(&ep);
            }
            Ok(_) => {
                drop(eps);
                let e = TransferError::Rdma("RDMA transport shut down".into());
                waiting
                    .into_iter()
                    .for_each(|w| w.sink.complete(w.slice.id, Err(e.clone())));
            }
            Err(e) => {
                drop(eps);
                tracing::warn!("RDMA connect to {} failed: {e}", key.peer);
                let text = format!("RDMA connect to {}: {e}", key.peer);
                for w in waiting {
                    self.retry_or_fail(w, text.clone(), true);
                }
            }
        }
    }

    /// Posts pending slices of `ep` while its QPs and its device's CQ have room.
    fn pump(self: &Arc<Self>, ep: &Arc<Endpoint>) {
        let mut refused: Vec<(Work, TransferError)> = Vec::new();
        let mut broke = None;
        {
            let mut pending = ep.lock_pending();
            while !ep.is_broken() && !pending.is_empty() {
                let Some(qi) = ep.pick_qp() else { break };
                if !ep.dev.take_credit() {
                    break;
                }
                let Some(work) = pending.pop_front() else {
                    ep.dev.return_credit();
                    break;
                };
                // A cancelled batch (timed out, freed) sends none of its remaining slices.
                if work.sink.is_cancelled() {
                    ep.dev.return_credit();
                    refused.push((work, CompletionSink::cancelled_error()));
                    continue;
                }
                let sl = work.slice;
                // Staged GPU memory: the work request uses the mirror at the same offset. A
                // region registered anew since `post` (another mirror, or none) is not the one
                // whose mirror the stager filled: the slice is not registered.
                let local = match &work.mirror {
                    Some(m) => m.translate(sl.local_addr, sl.len),
                    None => Some(sl.local_addr),
                };
                let mr = local.and_then(|_| {
                    lock(&self.regions)
                        .get(&sl.local_region.addr)
                        .filter(|r| match (&r.mirror, &work.mirror) {
                            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                            (a, b) => a.is_none() && b.is_none(),
                        })
                        .and_then(|r| r.mrs.get(ep.dev.index).cloned())
                });
                let local_addr = local.unwrap_or(sl.local_addr);
                let remote = work.peer.buffers.get(sl.remote_buffer).and_then(|b| {
                    let rkey = *b.keys.rkeys.get(ep.key.remote_dev)?;
                    let addr = match b.keys.staging_addr {
                        Some(base) => {
                            base.checked_add(sl.remote_addr.checked_sub(b.region.addr)?)?
                        }
                        None => sl.remote_addr,
                    };
                    Some((rkey, addr))
                });
                let (mr, (rkey, remote_addr)) = match (mr, remote) {
                    (Some(m), Some(r)) if sl.len > 0 && sl.len <= MAX_WR_BYTES => (m, r),
                    (None, _) => {
                        ep.dev.return_credit();
                        refused.push((
                            work,
                            TransferError::NotRegistered {
                                addr: sl.local_addr,
                                len: sl.len,
                            },
                        ));
                        continue;
                    }
                    (_, None) => {
                        ep.dev.return_credit();
                        let e = TransferError::Rdma(format!(
                            "segment {} buffer {} has no rkey for its device {} (or a bad \
                             staging address)",
                            work.peer.name, sl.remote_buffer, ep.key.remote_dev
                        ));
                        refused.push((work, e));
                        continue;
                    }
                    _ => {
                        ep.dev.return_credit();
                        let e = TransferError::InvalidArgument(format!(
                            "slice of {} bytes (1..={MAX_WR_BYTES})",
                            sl.len
                        ));
                        refused.push((work, e));
                        continue;
                    }
                };
                let lkey = mr.lkey();
                let q = &ep.qps[qi];
                q.outstanding.fetch_add(1, Ordering::AcqRel);
                let wr_id = ep.dev.lock_inflight().insert(InFlight {
                    ep: ep.clone(),
                    qp: qi,
                    work,
                    rkey,
                    _mr: mr,
                    posted: Instant::now(),
                });
                let res = {
                    let mut qp = lock(&q.qp);
                    let mut g = qp.start_post_send();
                    let h = g.construct_wr(wr_id, WorkRequestFlags::Signaled);
                    let h = match sl.op {
                        Op::Write => h.setup_write(rkey, remote_addr),
                        Op::Read => h.setup_read(rkey, remote_addr),
                    };
                    // SAFETY: [local_addr, +len) lies in a region (or its mirror) registered as
                    // `mr`, which the in-flight entry keeps alive until the completion.
                    unsafe { h.setup_sge(lkey, local_addr, sl.len as u32) };
                    g.post()
                };
                if let Err(e) = res {
                    q.outstanding.fetch_sub(1, Ordering::AcqRel);
                    ep.dev.return_credit();
                    if let Some(inf) = ep.dev.lock_inflight().remove(wr_id) {
                        pending.push_front(inf.work);
                    }
                    broke = Some(format!(
                        "post on {} QP {:#x} to {}: {e}: {}",
                        ep.dev.info.name,
                        q.qpn,
                        ep.key.peer,
                        err_src(&e)
                    ));
                    break;
                }
            }
        }
        for (w, e) in refused {
            w.sink.complete(w.slice.id, Err(e));
        }
        if let Some(reason) = broke {
            self.endpoint_failed(ep, reason);
        }
    }

    /// Retires a failed endpoint (first failure only): out of the cache, QPs to ERR (their
    /// outstanding work requests flush and are retried as they complete), pending slices
    /// re-dispatched to a fresh endpoint.
    fn endpoint_failed(self: &Arc<Self>, ep: &Arc<Endpoint>, reason: String) {
        let Some(pending) = ep.mark_broken(&reason) else {
            return;
        };
        tracing::warn!(peer = %ep.key.peer, device = %ep.dev.info.name, "RDMA endpoint failed: {reason}");
        {
            let mut eps = lock(&self.endpoints);
            if matches!(eps.get(&ep.key), Some(Slot::Ready(e)) if e.id == ep.id) {
                eps.remove(&ep.key);
            }
        }
        lock(&self.replaced).insert(ep.key.clone(), ep.id);
        if !pending.is_empty() {
            self.dispatch(pending);
        }
    }

    /// Retries a failed slice on a fresh endpoint while it has retries left (and the failure
    /// can change on retry), else reports it failed with `text`.
    fn retry_or_fail(self: &Arc<Self>, mut w: Work, text: String, retryable: bool) {
        if retryable
            && w.attempts < self.config.max_retries
            && !w.sink.is_cancelled()
            && !self.stop.load(Ordering::SeqCst)
        {
            w.attempts += 1;
            self.retried.fetch_add(1, Ordering::Relaxed);
            if w.first_error.is_none() {
                w.first_error = Some(text.clone());
            }
            tracing::debug!(
                slice = w.slice.id,
                attempt = w.attempts,
                "retrying RDMA slice: {text}"
            );
            self.dispatch(vec![w]);
        } else {
            let msg = match (&w.first_error, w.attempts) {
                (_, 0) => text,
                (Some(first), n) if *first != text => {
                    format!("{text} (after {n} retries; first failure: {first})")
                }
                (_, n) => format!("{text} (after {n} retries)"),
            };
            // a connect or QP failure may mean the peer restarted (new instance, ports and
            // rkeys): the engine fetches its descriptor again and retries the slice once
            w.sink.fail_peer(w.slice.id, TransferError::Rdma(msg));
        }
    }

    /// Handles one work completion.
    fn complete(self: &Arc<Self>, dev: &Device, wc: &verbs::WorkCompletion) {
        let Some(inf) = dev.lock_inflight().remove(wc.wr_id) else {
            tracing::warn!(
                wr_id = wc.wr_id,
                "RDMA completion for an unknown work request"
            );
            return;
        };
        let ep = inf.ep;
        ep.touch();
        ep.qps[inf.qp].outstanding.fetch_sub(1, Ordering::AcqRel);
        dev.return_credit();
        let w = inf.work;
        if wc.status == verbs::wc::SUCCESS {
            if w.needs_after() {
                self.stage(StageJob::After(w));
            } else {
                w.sink.complete(w.slice.id, Ok(()));
            }
            return;
        }
        let sl = &w.slice;
        let what = format!(
            "RDMA {} of {} bytes between local {:#x} and {} remote {:#x} (rkey {:#x}) on {} QP {:#x}",
            match sl.op {
                Op::Write => "WRITE",
                Op::Read => "READ",
            },
            sl.len,
            sl.local_addr,
            w.peer.name,
            sl.remote_addr,
            inf.rkey,
            dev.info.name,
            ep.qps[inf.qp].qpn
        );
        let status = verbs::wc_status_text(wc.status);
        let text = match (wc.status, ep.first_error.get()) {
            (verbs::wc::WR_FLUSH_ERR, Some(first)) => format!("{what}: {status}, after: {first}"),
            _ => format!("{what}: work completion status {status}"),
        };
        self.endpoint_failed(&ep, text.clone());
        // errors a retry cannot change: the request itself is wrong
        let retryable = !matches!(
            wc.status,
            verbs::wc::REM_ACCESS_ERR
                | verbs::wc::REM_INV_REQ_ERR
                | verbs::wc::LOC_PROT_ERR
                | verbs::wc::LOC_LEN_ERR
                | verbs::wc::LOC_ACCESS_ERR
        );
        self.retry_or_fail(w, text, retryable);
    }

    /// Endpoints on device `dev` with slices waiting.
    fn waiting_endpoints(&self, dev: usize) -> Vec<Arc<Endpoint>> {
        lock(&self.endpoints)
            .values()
            .filter_map(|s| match s {
                Slot::Ready(ep) if ep.key.local_dev == dev && !ep.lock_pending().is_empty() => {
                    Some(ep.clone())
                }
                _ => None,
            })
            .collect()
    }

    /// Drops this device's endpoints that held no work for `idle_timeout` (their QPs are
    /// destroyed) and tells each target, best effort, to drop its side (`CloseNotice`).
    /// Forgotten replacements of peers with no endpoint left are announced the same way.
    fn expire_idle(self: &Arc<Self>, dev: &Device) {
        let (idle, forgotten) = {
            let mut eps = lock(&self.endpoints);
            let keys: Vec<EpKey> = eps
                .iter()
                .filter_map(|(k, s)| match s {
                    Slot::Ready(ep)
                        if k.local_dev == dev.index && ep.is_idle(self.idle_timeout) =>
                    {
                        Some(k.clone())
                    }
                    _ => None,
                })
                .collect();
            let idle: Vec<Arc<Endpoint>> = keys
                .iter()
                .filter_map(|k| match eps.remove(k) {
                    Some(Slot::Ready(ep)) => Some(ep),
                    _ => None,
                })
                .collect();
            let mut forgotten = Vec::new();
            lock(&self.replaced).retain(|k, id| {
                let keep = k.local_dev != dev.index || eps.contains_key(k);
                if !keep {
                    forgotten.push((k.peer.clone(), *id));
                }
                keep
            });
            (idle, forgotten)
        };
        if idle.is_empty() && forgotten.is_empty() {
            return;
        }
        let mut by_peer: HashMap<String, Vec<u64>> = HashMap::new();
        for ep in &idle {
            // a dispatch that took the endpoint before it left the cache re-dispatches
            if let Some(pending) = ep.mark_broken("idle") {
                if !pending.is_empty() {
                    self.dispatch(pending);
                }
            }
            by_peer.entry(ep.key.peer.clone()).or_default().push(ep.id);
        }
        for (peer, id) in forgotten {
            by_peer.entry(peer).or_default().push(id);
        }
        tracing::debug!(device = %dev.info.name, endpoints = idle.len(), "RDMA endpoints idle: dropped");
        drop(idle);
        for (peer, ids) in by_peer {
            let notice = CloseNotice {
                version: endpoint::CONNECT_VERSION,
                initiator: self.segment_name.clone(),
                close: ids,
            };
            let Ok(body) = serde_json::to_vec(&notice) else {
                continue;
            };
            let (timeout, cred) = (self.handshake_timeout, self.credential.clone());
            let spawned = std::thread::Builder::new()
                .name("kvferry-rdma-close".into())
                .spawn(move || {
                    let r = handshake::request_with(
                        &peer,
                        FrameType::Connect,
                        &body,
                        timeout,
                        cred.as_ref(),
                    );
                    if let Err(e) = r {
                        tracing::debug!(%peer, "RDMA close notice not delivered: {e}");
                    }
                });
            if let Err(e) = spawned {
                tracing::debug!("cannot spawn an RDMA close thread: {e}");
            }
        }
    }

    /// Fails endpoints whose oldest work request waited past `completion_timeout`, and drops
    /// idle ones (`expire_idle`).
    fn watchdog(self: &Arc<Self>, dev: &Device) {
        self.expire_idle(dev);
        let limit = self.config.completion_timeout;
        let stale: Vec<Arc<Endpoint>> = {
            let t = dev.lock_inflight();
            let mut v: Vec<Arc<Endpoint>> = Vec::new();
            for inf in t.iter() {
                if inf.posted.elapsed() > limit
                    && !inf.ep.is_broken()
                    && !v.iter().any(|e| e.id == inf.ep.id)
                {
                    v.push(inf.ep.clone());
                }
            }
            v
        };
        for ep in stale {
            self.endpoint_failed(
                &ep,
                format!("no work completion within {limit:?} on {}", dev.info.name),
            );
        }
    }
}

/// Completion thread of one device: polls the CQ, sleeps on its channel when idle, runs the
/// watchdog once a second. Exits when the transport stops.
fn run_completions(s: Arc<Shared>, dev: Arc<Device>) {
    let mut wcs: Vec<verbs::WorkCompletion> = Vec::with_capacity(POLL_BATCH);
    let mut last_watch = Instant::now();
    let mut armed = false;
    while !s.stop.load(Ordering::SeqCst) {
        let n = match verbs::poll_cq(&dev.cq, &mut wcs) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!("{}: ibv_poll_cq failed (errno {e})", dev.info.name);
                std::thread::sleep(Duration::from_millis(100));
                0
            }
        };
        if n > 0 {
            armed = false;
            for wc in wcs.iter() {
                s.complete(&dev, wc);
            }
            for ep in s.waiting_endpoints(dev.index) {
                s.pump(&ep);
            }
        } else if !armed {
            // arm, then poll once more: a completion between the poll and the arm raises no event
            if let Err(e) = verbs::req_notify_cq(&dev.cq) {
                tracing::error!("{}: ibv_req_notify_cq failed ({e})", dev.info.name);
            }
            armed = true;
            continue;
        } else {
            if verbs::wait_cq_event(&dev.channel, Duration::from_millis(100)) {
                armed = false;
            }
        }
        if last_watch.elapsed() >= Duration::from_secs(1) {
            last_watch = Instant::now();
            s.watchdog(&dev);
        }
    }
}

/// Async event thread of one device: logs every event (errors at warn).
fn run_events(s: Arc<Shared>, dev: Arc<Device>) {
    let fd = verbs::async_fd(&dev.ctx);
    while !s.stop.load(Ordering::SeqCst) {
        if !verbs::wait_readable(fd, Duration::from_millis(200)) {
            continue;
        }
        while let Some((t, element)) = verbs::take_async_event(&dev.ctx) {
            let name = verbs::async_event_name(t);
            match t {
                4 | 9 | 11 | 17 | 18 | 20 => {
                    tracing::info!(device = %dev.info.name, element, "RDMA async event: {name}")
                }
                _ => {
                    tracing::warn!(device = %dev.info.name, element, "RDMA async event: {name} ({t})")
                }
            }
        }
    }
}
