//! Endpoints: the RC QPs between one local device and one device of a peer segment, and the
//! Connect handshake that sets them up (docs/design.md §3: QP numbers, PSNs, GIDs, LIDs and active
//! MTUs exchanged; path MTU = the smaller side's, so mixed-MTU peers work; random PSNs).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sideway::ibverbs::address::AddressHandleAttribute;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
};
use sideway::ibverbs::AccessFlags;

use super::device::{Device, PortInfo};
use super::verbs;
use super::Work;
use crate::config::RdmaConfig;
use crate::error::{Result, TransferError};

/// Version of the Connect frame body.
pub(crate) const CONNECT_VERSION: u32 = 1;
/// Most QPs one Connect may ask for.
const MAX_QPS: usize = 64;
/// Passive endpoints kept per transport at most (oldest dropped first).
const MAX_PASSIVE: usize = 4096;

/// One QP as announced in a Connect frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpInfo {
    /// The QP number (24 bits), as `ibv_qp.qp_num`.
    pub qpn: u32,
    /// First PSN of this QP's send queue (24 bits).
    pub psn: u32,
}

/// Connect request (initiator → target), JSON in a `Connect` handshake frame.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectRequest {
    /// Frame body version; must equal `CONNECT_VERSION` (1).
    pub version: u32,
    /// Initiator's segment name.
    pub initiator: String,
    /// Random id of the initiator's endpoint.
    pub endpoint_id: u64,
    /// An earlier endpoint of this initiator the target may drop (retry on a fresh endpoint).
    #[serde(default)]
    pub replaces: Option<u64>,
    /// Index of the target's device (in its descriptor's device list) to connect to.
    pub device: usize,
    /// The initiator engine's instance id: the target drops the passive endpoints of an
    /// earlier instance of the same initiator (it restarted). Absent from older initiators.
    #[serde(default)]
    pub initiator_instance: Option<u64>,
    /// The initiator's device port: name, GID, LID, active MTU (the path MTU is the smaller).
    pub port: PortInfo,
    /// The initiator's QPs (`qps_per_endpoint` of them, at most 64); the target creates one
    /// QP for each.
    pub qps: Vec<QpInfo>,
}

/// Close notice (initiator → target), JSON in a `Connect` handshake frame: the initiator
/// dropped these endpoints (idle), so the target drops their passive QPs. Best effort: the
/// reply is `{}` and its loss only delays the drop until the initiator restarts or the passive
/// table is full.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CloseNotice {
    /// Frame body version; `CONNECT_VERSION` (1).
    pub version: u32,
    /// Initiator's segment name.
    pub initiator: String,
    /// The endpoint ids (as in their `ConnectRequest::endpoint_id`) to drop; at most
    /// `MAX_CLOSE` are read.
    pub close: Vec<u64>,
}

/// Most endpoint ids one close notice names.
pub(crate) const MAX_CLOSE: usize = 1024;

/// Connect reply (target → initiator).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectReply {
    /// Frame body version; `CONNECT_VERSION` (1).
    pub version: u32,
    /// The request's `endpoint_id`, echoed (the initiator checks it).
    pub endpoint_id: u64,
    /// The target's device port: name, GID, LID, active MTU.
    pub port: PortInfo,
    /// The target's QPs, one per requested QP in request order (`qps[i]` pairs with the
    /// request's `qps[i]`).
    pub qps: Vec<QpInfo>,
}

/// Creates an RC QP on `dev` (send/recv CQ = the device CQ) and moves it to INIT with remote
/// read and write access.
pub(crate) fn create_qp(dev: &Device, max_wr: u32) -> Result<BasicQueuePair> {
    let mut qp = dev
        .pd
        .create_qp_builder()
        .setup_qp_type(QueuePairType::ReliableConnection)
        .setup_max_send_wr(max_wr)
        .setup_max_recv_wr(1)
        .setup_max_send_sge(1)
        .setup_max_recv_sge(1)
        .setup_send_cq(dev.cq.clone())
        .setup_recv_cq(dev.cq.clone())
        .build()
        .map_err(|e| {
            TransferError::Rdma(format!("{}: create QP: {e}: {}", dev.info.name, src(&e)))
        })?;
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::Init)
        .setup_pkey_index(0)
        .setup_port(dev.info.port)
        .setup_access_flags(
            AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
        );
    qp.modify(&a).map_err(|e| {
        TransferError::Rdma(format!("{}: QP to INIT: {e}: {}", dev.info.name, src(&e)))
    })?;
    Ok(qp)
}

fn src(e: &dyn std::error::Error) -> String {
    e.source().map(|s| s.to_string()).unwrap_or_default()
}

/// Moves an INIT QP to RTR then RTS towards `remote`'s QP `rq`.
pub(crate) fn connect_qp(
    qp: &mut BasicQueuePair,
    dev: &Device,
    local_psn: u32,
    remote: &PortInfo,
    rq: QpInfo,
    path_mtu: u32,
    config: &RdmaConfig,
) -> Result<()> {
    let mtu = verbs::mtu_from_bytes(path_mtu)
        .ok_or_else(|| TransferError::Protocol(format!("path MTU {path_mtu} is not an IB MTU")))?;
    let mut ah = AddressHandleAttribute::new();
    ah.setup_dest_lid(remote.lid)
        .setup_port(dev.info.port)
        .setup_service_level(0);
    if dev.info.ethernet || remote.lid == 0 {
        let gid = remote.gid_value()?;
        ah.setup_grh(&gid, 0, dev.info.gid_index.min(255) as u8, 64, 0);
    }
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::ReadyToReceive)
        .setup_path_mtu(mtu)
        .setup_dest_qp_num(rq.qpn)
        .setup_rq_psn(rq.psn & 0x00ff_ffff)
        .setup_max_dest_read_atomic(dev.max_rd_atomic)
        .setup_min_rnr_timer(12)
        .setup_address_vector(&ah);
    qp.modify(&a).map_err(|e| {
        TransferError::Rdma(format!(
            "{}: QP {:#x} to RTR (remote QP {:#x}, GID {}, MTU {path_mtu}): {e}: {}",
            dev.info.name,
            qp.qp_number(),
            rq.qpn,
            remote.gid,
            src(&e)
        ))
    })?;
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::ReadyToSend)
        .setup_sq_psn(local_psn & 0x00ff_ffff)
        .setup_timeout(config.qp_timeout)
        .setup_retry_cnt(config.retry_count.min(7))
        .setup_rnr_retry(config.retry_count.min(6))
        .setup_max_read_atomic(dev.max_rd_atomic);
    qp.modify(&a).map_err(|e| {
        TransferError::Rdma(format!(
            "{}: QP {:#x} to RTS: {e}: {}",
            dev.info.name,
            qp.qp_number(),
            src(&e)
        ))
    })?;
    Ok(())
}

/// Moves a QP to the error state: every outstanding work request completes with a flush error.
pub(crate) fn fail_qp(qp: &mut BasicQueuePair) {
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::Error);
    if let Err(e) = qp.modify(&a) {
        tracing::debug!("QP {:#x} to ERR: {e}", qp.qp_number());
    }
}

/// Path MTU of a connection: the smaller of both sides' advertised active MTUs.
pub(crate) fn path_mtu(local: u32, remote: u32) -> Result<u32> {
    let m = local.min(remote);
    verbs::mtu_from_bytes(m).map(|_| m).ok_or_else(|| {
        TransferError::Protocol(format!("MTUs {local}/{remote}: {m} is not an IB MTU"))
    })
}

/// One QP of an endpoint with its count of signalled work requests not yet completed.
pub(crate) struct Qp {
    pub qp: Mutex<BasicQueuePair>,
    pub qpn: u32,
    pub outstanding: AtomicUsize,
}

/// Key of the endpoint cache: peer segment (name + instance) and the device pair.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct EpKey {
    pub peer: String,
    pub instance: u64,
    pub local_dev: usize,
    pub remote_dev: usize,
}

/// An active endpoint: QPs from a local device to a peer's device, the slices waiting for room
/// on them, and its failure state (a failed endpoint is never used again).
pub(crate) struct Endpoint {
    pub id: u64,
    pub key: EpKey,
    pub dev: Arc<Device>,
    pub qps: Vec<Qp>,
    pub path_mtu: u32,
    pub max_wr: usize,
    next_qp: AtomicUsize,
    broken: AtomicBool,
    pub first_error: OnceLock<String>,
    /// Slices accepted but not yet posted (no room on the QPs or the CQ).
    pub pending: Mutex<VecDeque<Work>>,
    /// When work was last handed to the endpoint or completed on it (idle expiry).
    last_used: Mutex<Instant>,
}

impl Endpoint {
    /// Connects to `key.peer`: creates `config.qps_per_endpoint` QPs, sends the Connect frame
    /// with `exchange` (the handshake round trip), and moves the QPs to RTS.
    pub fn connect(
        dev: Arc<Device>,
        key: EpKey,
        local_segment: &str,
        local_instance: u64,
        replaces: Option<u64>,
        config: &RdmaConfig,
        exchange: impl FnOnce(&[u8]) -> Result<Vec<u8>>,
    ) -> Result<Endpoint> {
        let max_wr = (config.max_wr as u32).min(dev.max_qp_wr).max(1);
        let mut qps = Vec::with_capacity(config.qps_per_endpoint);
        let mut infos = Vec::with_capacity(config.qps_per_endpoint);
        for _ in 0..config.qps_per_endpoint {
            let qp = create_qp(&dev, max_wr)?;
            infos.push(QpInfo {
                qpn: qp.qp_number(),
                psn: verbs::random_psn(),
            });
            qps.push(qp);
        }
        let id = verbs::random_u64();
        let req = ConnectRequest {
            version: CONNECT_VERSION,
            initiator: local_segment.to_string(),
            endpoint_id: id,
            replaces,
            device: key.remote_dev,
            initiator_instance: Some(local_instance),
            port: dev.info.clone(),
            qps: infos.clone(),
        };
        let body = serde_json::to_vec(&req).map_err(|e| TransferError::Protocol(e.to_string()))?;
        let reply = exchange(&body)?;
        let reply: ConnectReply =
            serde_json::from_slice(&reply).map_err(|e| TransferError::Handshake {
                peer: key.peer.clone(),
                reason: format!("bad RDMA connect reply: {e}"),
            })?;
        if reply.version != CONNECT_VERSION
            || reply.endpoint_id != id
            || reply.qps.len() != qps.len()
        {
            return Err(TransferError::Handshake {
                peer: key.peer.clone(),
                reason: format!(
                    "RDMA connect reply does not match the request (version {}, endpoint {:#x}, {} QPs for {})",
                    reply.version,
                    reply.endpoint_id,
                    reply.qps.len(),
                    qps.len()
                ),
            });
        }
        let mtu = path_mtu(dev.info.active_mtu, reply.port.active_mtu)?;
        for ((qp, mine), theirs) in qps.iter_mut().zip(&infos).zip(&reply.qps) {
            connect_qp(qp, &dev, mine.psn, &reply.port, *theirs, mtu, config)?;
        }
        tracing::debug!(
            peer = %key.peer,
            device = %dev.info.name,
            remote_device = %reply.port.name,
            path_mtu = mtu,
            qps = ?infos.iter().map(|q| q.qpn).collect::<Vec<_>>(),
            "RDMA endpoint connected"
        );
        Ok(Endpoint {
            id,
            key,
            qps: qps
                .into_iter()
                .map(|q| Qp {
                    qpn: q.qp_number(),
                    qp: Mutex::new(q),
                    outstanding: AtomicUsize::new(0),
                })
                .collect(),
            dev,
            path_mtu: mtu,
            max_wr: max_wr as usize,
            next_qp: AtomicUsize::new(0),
            broken: AtomicBool::new(false),
            first_error: OnceLock::new(),
            pending: Mutex::new(VecDeque::new()),
            last_used: Mutex::new(Instant::now()),
        })
    }

    /// Marks the endpoint used now.
    pub fn touch(&self) {
        *self.last_used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// True when the endpoint works, holds no slice (pending or on its QPs) and was last used
    /// `idle` ago or longer.
    pub fn is_idle(&self, idle: std::time::Duration) -> bool {
        !self.is_broken()
            && self.lock_pending().is_empty()
            && self
                .qps
                .iter()
                .all(|q| q.outstanding.load(Ordering::Acquire) == 0)
            && self
                .last_used
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .elapsed()
                >= idle
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    pub fn lock_pending(&self) -> std::sync::MutexGuard<'_, VecDeque<Work>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the endpoint failed (first call only: returns the slices still pending, and moves
    /// the QPs to ERR so their outstanding work requests flush); later calls return None.
    pub fn mark_broken(&self, reason: &str) -> Option<Vec<Work>> {
        let drained = {
            let mut p = self.lock_pending();
            if self.broken.swap(true, Ordering::AcqRel) {
                return None;
            }
            let _ = self.first_error.set(reason.to_string());
            p.drain(..).collect::<Vec<_>>()
        };
        for q in &self.qps {
            fail_qp(&mut q.qp.lock().unwrap_or_else(|e| e.into_inner()));
        }
        Some(drained)
    }

    /// A QP index with room for one more work request, round robin.
    pub fn pick_qp(&self) -> Option<usize> {
        let n = self.qps.len();
        let start = self.next_qp.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| self.qps[i].outstanding.load(Ordering::Acquire) < self.max_wr)
    }
}

/// Target side of an endpoint: QPs that only respond (RDMA WRITE/READ need no receive work).
struct Passive {
    _qps: Vec<BasicQueuePair>,
    created: Instant,
    /// The initiator's instance id, when it sent one.
    instance: Option<u64>,
}

/// Passive endpoints by (initiator segment, endpoint id); bounded.
#[derive(Default)]
pub(crate) struct PassiveTable {
    map: HashMap<(String, u64), Passive>,
}

impl PassiveTable {
    /// Serves one Connect request on `dev`: QPs to RTS towards the initiator's; the reply.
    pub fn accept(
        &mut self,
        dev: &Device,
        req: &ConnectRequest,
        config: &RdmaConfig,
    ) -> Result<ConnectReply> {
        let mtu = path_mtu(dev.info.active_mtu, req.port.active_mtu)?;
        req.port.gid_value()?;
        let max_wr = (config.max_wr as u32).min(dev.max_qp_wr).max(1);
        let mut qps = Vec::with_capacity(req.qps.len());
        let mut infos = Vec::with_capacity(req.qps.len());
        for theirs in &req.qps {
            let mut qp = create_qp(dev, max_wr)?;
            let mine = QpInfo {
                qpn: qp.qp_number(),
                psn: verbs::random_psn(),
            };
            connect_qp(&mut qp, dev, mine.psn, &req.port, *theirs, mtu, config)?;
            infos.push(mine);
            qps.push(qp);
        }
        if let Some(old) = req.replaces {
            self.map.remove(&(req.initiator.clone(), old));
        }
        if let Some(inst) = req.initiator_instance {
            // the initiator restarted: its earlier instance's endpoints are dead
            self.map
                .retain(|k, p| k.0 != req.initiator || p.instance.is_none_or(|i| i == inst));
        }
        if self.map.len() >= MAX_PASSIVE {
            if let Some(oldest) = self
                .map
                .iter()
                .min_by_key(|(_, p)| p.created)
                .map(|(k, _)| k.clone())
            {
                tracing::warn!(initiator = %oldest.0, "too many RDMA endpoints: dropping the oldest");
                self.map.remove(&oldest);
            }
        }
        self.map.insert(
            (req.initiator.clone(), req.endpoint_id),
            Passive {
                _qps: qps,
                created: Instant::now(),
                instance: req.initiator_instance,
            },
        );
        tracing::debug!(
            initiator = %req.initiator,
            device = %dev.info.name,
            path_mtu = mtu,
            qps = ?infos.iter().map(|q| q.qpn).collect::<Vec<_>>(),
            "RDMA endpoint accepted"
        );
        Ok(ConnectReply {
            version: CONNECT_VERSION,
            endpoint_id: req.endpoint_id,
            port: dev.info.clone(),
            qps: infos,
        })
    }

    /// Drops the passive endpoints `ids` of initiator `name` (its close notice).
    pub fn close(&mut self, name: &str, ids: &[u64]) {
        for id in ids.iter().take(MAX_CLOSE) {
            self.map.remove(&(name.to_string(), *id));
        }
    }

    /// QPs held by passive endpoints.
    pub fn qps(&self) -> usize {
        self.map.values().map(|p| p._qps.len()).sum()
    }

    /// Drops every passive endpoint of initiator `name`.
    pub fn remove_initiator(&mut self, name: &str) {
        self.map.retain(|k, _| k.0 != name);
    }

    pub fn clear(&mut self) {
        self.map.clear();
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
}

/// Validates a Connect request's shape before any verbs call. Errors: `Protocol`.
pub(crate) fn check_request(req: &ConnectRequest, devices: usize) -> Result<()> {
    if req.version != CONNECT_VERSION {
        return Err(TransferError::Protocol(format!(
            "RDMA connect version {} (this engine speaks {CONNECT_VERSION})",
            req.version
        )));
    }
    if req.qps.is_empty() || req.qps.len() > MAX_QPS {
        return Err(TransferError::Protocol(format!(
            "RDMA connect asks for {} QPs (1..={MAX_QPS})",
            req.qps.len()
        )));
    }
    if req.device >= devices {
        return Err(TransferError::Protocol(format!(
            "RDMA connect names device {} but this engine has {devices}",
            req.device
        )));
    }
    if verbs::mtu_from_bytes(req.port.active_mtu).is_none() {
        return Err(TransferError::Protocol(format!(
            "RDMA connect MTU {} is not an IB MTU",
            req.port.active_mtu
        )));
    }
    if req.qps.iter().any(|q| q.qpn > 0x00ff_ffff) {
        return Err(TransferError::Protocol(
            "RDMA connect QP number over 24 bits".into(),
        ));
    }
    Ok(())
}
