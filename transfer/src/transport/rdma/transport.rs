//! The transport facade: `RdmaTransport` opens the devices, starts the worker threads and
//! implements `Transport` on top of the shared state (registration, handshake frames, posting,
//! stats, shutdown).

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use super::connect::{self, CloseNotice, ConnectRequest};
use super::device::{self, Device, PortInfo};
use super::endpoint::{Endpoint, Slot};
use super::keys::RdmaRegionKeys;
use super::mirror::Mirror;
use super::passive::PassiveTable;
use super::peer::RdmaPeerInfo;
use super::shared::{Registered, Shared};
use super::stager;
use super::staging_sync::SyncRequest;
use super::work::{StageJob, Work};
use super::workers::{run_completions, run_events};
use crate::descriptor::{SegmentDescriptor, TransportInfo};
use crate::error::{
    ArgumentError, ConfigError, EndpointFailure, ProtocolError, RdmaError, Result, TransferError,
};
use crate::memory::{MemoryRegion, RegionKeys, RegistrationPath};
use crate::transport::{CompletionSink, Slice, Transport, TransportContext, TransportStats};
use crate::types::{Location, TransportKind};

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
        let list = device::list_devices()
            .map_err(|e| TransferError::Config(ConfigError::RdmaDeviceList(e)))?;
        let mut devices = Vec::new();
        let mut why = Vec::new();
        for name in device::wanted_names(&list, &config) {
            match Device::open(devices.len(), &list, &name, &config) {
                Ok(d) => devices.push(Arc::new(d)),
                Err(e) => why.push(e),
            }
        }
        if devices.is_empty() {
            return Err(TransferError::Config(ConfigError::NoRdmaDevice {
                wanted: config.devices.clone(),
                tried: why,
            }));
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
        let inflight = devices.iter().map(|_| Mutex::default()).collect();
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
            posted: AtomicU64::new(0),
            completions: AtomicU64::new(0),
            memory: ctx.memory.clone(),
            stager: Mutex::new(stage_tx),
            inflight,
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
                t.threads.locked().push(h);
            }
        }
        let s = shared.clone();
        let h = std::thread::Builder::new()
            .name("kvferry-rdma-stager".into())
            .spawn(move || stager::run_stager(s, stage_rx))
            .map_err(|e| TransferError::io("spawn RDMA stager thread", e))?;
        t.threads.locked().push(h);
        Ok(t)
    }

    /// Path MTUs of the cached endpoints to segment `peer` (tests and diagnostics).
    pub fn path_mtus(&self, peer: &str) -> Vec<u32> {
        self.shared
            .endpoints
            .locked()
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
        self.shared.inflight.iter().map(|t| t.locked().count).sum()
    }

    /// Slices on the work requests in flight, over all devices (a merged work request carries
    /// several).
    pub fn slices_in_flight(&self) -> usize {
        self.shared
            .inflight
            .iter()
            .map(|t| t.locked().iter().map(|i| i.works.len()).sum::<usize>())
            .sum()
    }

    /// Work requests posted so far, over all devices.
    pub fn work_requests_posted(&self) -> u64 {
        self.shared.posted.load(Ordering::Relaxed)
    }

    /// Work completions polled so far, over all devices: one per posted chain when nothing
    /// fails (its unsignalled work requests complete with the signalled one after them on
    /// their QP), plus one per error or flush.
    pub fn work_completions(&self) -> u64 {
        self.shared.completions.load(Ordering::Relaxed)
    }

    /// Slices retried on a fresh endpoint so far.
    pub fn retried_slices(&self) -> u64 {
        self.shared.retried.load(Ordering::Relaxed)
    }

    /// Passive (target-side) endpoints held now.
    pub fn passive_endpoints(&self) -> usize {
        self.shared.passive.locked().len()
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Transport for RdmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn local_info(&self) -> TransportInfo {
        TransportInfo {
            kind: TransportKind::Rdma,
            details: serde_json::json!({ "devices": self.ports() }),
        }
    }

    fn register(&self, region: &MemoryRegion) -> Result<RegionKeys> {
        let s = &self.shared;
        for d in &s.devices {
            if region.len > d.max_mr_size {
                return Err(RdmaError::RegionOverDeviceLimit {
                    len: region.len,
                    device: d.info.name.clone(),
                    max: d.max_mr_size,
                }
                .into());
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
        let keys = RegionKeys::new(
            path,
            RdmaRegionKeys {
                rkeys: mrs.iter().map(|m| m.rkey()).collect(),
                staging_addr: mirror.as_ref().map(|m| m.addr()),
            }
            .encode()?,
        );
        if region.location != Location::Cpu {
            tracing::info!(
                "{} region [{:#x}, +{}) registered for RDMA via {path}",
                region.location,
                region.addr,
                region.len
            );
        }
        s.regions
            .locked()
            .insert(region.addr, Registered { mrs, mirror });
        Ok(keys)
    }

    fn deregister(&self, region: &MemoryRegion) -> Result<()> {
        let gone = self.shared.regions.locked().remove(&region.addr);
        match gone {
            Some(r) => {
                // a peer's sync may be copying into the device range on a handshake thread
                if let Some(m) = r.mirror {
                    m.retire();
                }
                Ok(())
            }
            None => Err(ArgumentError::NoRdmaRegistration { addr: region.addr }.into()),
        }
    }

    fn on_handshake(&self, peer: SocketAddr, body: &[u8]) -> Result<Vec<u8>> {
        let s = &self.shared;
        if let Some(sync) = SyncRequest::parse(body) {
            s.serve_sync(&sync?)?;
            return Ok(b"{}".to_vec());
        }
        if let Ok(n) = serde_json::from_slice::<CloseNotice>(body) {
            s.passive.locked().close(&n.initiator, &n.close);
            return Ok(b"{}".to_vec());
        }
        let req: ConnectRequest = serde_json::from_slice(body).map_err(|e| {
            TransferError::Protocol(ProtocolError::BadJson {
                what: format!("RDMA connect from {peer}"),
                source: e.into(),
            })
        })?;
        connect::check_request(&req, s.devices.len())?;
        let dev = &s.devices[req.device];
        let reply = s.passive.locked().accept(dev, &req, &s.config)?;
        serde_json::to_vec(&reply).map_err(|e| {
            TransferError::Protocol(ProtocolError::Encode {
                what: "RDMA connect reply",
                source: e.into(),
            })
        })
    }

    /// The token is not used: over RDMA the QP acceptance check (the engine answers `Connect`
    /// only on an authenticated handshake connection) is what protects the rkeys.
    fn post(
        &self,
        peer: &Arc<SegmentDescriptor>,
        slices: &[Slice],
        done: CompletionSink,
        _token: Option<crate::auth::Token>,
    ) {
        let s = &self.shared;
        let peer_info = match RdmaPeerInfo::decode(peer) {
            Ok(p) => Arc::new(p),
            Err(e) => return done.fail_all(slices.iter().map(|sl| sl.id), &e),
        };
        let mirrors: HashMap<u64, Arc<Mirror>> = s
            .regions
            .locked()
            .iter()
            .filter_map(|(a, r)| r.mirror.clone().map(|m| (*a, m)))
            .collect();
        let (mut direct, mut staged) = (Vec::with_capacity(slices.len()), Vec::new());
        for &slice in slices {
            let w = Work {
                slice,
                peer: peer.clone(),
                peer_info: peer_info.clone(),
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
        let eps = self.shared.endpoints.locked();
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
            served_connections: self.shared.passive.locked().qps(),
        }
    }

    fn disconnect(&self, name: &str) {
        let eps: Vec<Arc<Endpoint>> = self
            .shared
            .endpoints
            .locked()
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Ready(ep) if k.peer == name => Some(ep.clone()),
                _ => None,
            })
            .collect();
        for ep in eps {
            self.shared.endpoint_failed(
                &ep,
                EndpointFailure::Disconnected {
                    peer: name.to_string(),
                },
            );
        }
        self.shared.passive.locked().remove_initiator(name);
        self.shared.replaced.locked().retain(|k, _| k.peer != name);
    }

    fn shutdown(&self) {
        let s = &self.shared;
        if s.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        for t in self.threads.locked().drain(..) {
            let _ = t.join();
        }
        let gone = TransferError::Rdma(RdmaError::ShutDown);
        let slots: Vec<Slot> = s.endpoints.locked().drain().map(|(_, v)| v).collect();
        for slot in slots {
            match slot {
                Slot::Connecting(ws) => ws
                    .into_iter()
                    .for_each(|w| w.sink.complete(w.slice.id, Err(gone.clone()))),
                Slot::Ready(ep) => {
                    if let Some(ws) = ep.mark_broken(&EndpointFailure::ShutDown) {
                        ws.into_iter()
                            .for_each(|w| w.sink.complete(w.slice.id, Err(gone.clone())));
                    }
                }
            }
        }
        for t in &s.inflight {
            let left = t.locked().drain();
            for inf in left {
                for w in inf.works {
                    w.sink.complete(w.slice.id, Err(gone.clone()));
                }
            }
        }
        s.passive.locked().clear();
    }
}
