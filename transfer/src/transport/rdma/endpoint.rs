//! Endpoints: the RC QPs between one local device and one device of a peer segment, and the
//! Connect handshake that sets them up (docs/design.md §3: QP numbers, PSNs, GIDs, LIDs and active
//! MTUs exchanged; path MTU = the smaller side's, so mixed-MTU peers work; random PSNs).

use crate::sync::MutexExt;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use sideway::ibverbs::memory_region::MemoryRegion as VerbsMr;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};

use super::connect::{ConnectReply, ConnectRequest, QpInfo, CONNECT_VERSION};
use super::device::Device;
use super::qp::{connect_qp, create_qp, fail_qp, path_mtu};
use super::verbs;
use super::work::Work;
use crate::config::RdmaConfig;
use crate::error::{EndpointFailure, ProtocolError, Result, TransferError};

/// One QP of an endpoint with its count of work requests not yet completed.
pub(crate) struct Qp {
    pub qp: Mutex<BasicQueuePair>,
    pub qpn: u32,
    pub outstanding: AtomicUsize,
    /// The wr_ids on its send queue, in posting order. Only the last work request of a posted
    /// chain is signalled: an RC send queue completes in order, so a completion (success,
    /// error or flush) also finishes every work request posted before it on the QP.
    pub sent: Mutex<VecDeque<u64>>,
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
    pub first_error: OnceLock<EndpointFailure>,
    /// Slices accepted but not yet posted (no room on the QPs or the CQ).
    pub pending: Mutex<VecDeque<Work>>,
    /// Memory regions of work requests taken back after a partly refused post (their slices
    /// went on elsewhere, the provider may still read them): released with the endpoint, after
    /// its QPs (declared after `qps`).
    pub retired: Mutex<Vec<Arc<VerbsMr>>>,
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
        let id = crate::ids::random_u64();
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
        let body = serde_json::to_vec(&req).map_err(|e| {
            TransferError::Protocol(ProtocolError::Encode {
                what: "RDMA connect request",
                source: e.into(),
            })
        })?;
        let reply = exchange(&body)?;
        let reply: ConnectReply =
            serde_json::from_slice(&reply).map_err(|e| TransferError::Handshake {
                peer: key.peer.clone(),
                source: crate::error::HandshakeError::BadJson {
                    what: "RDMA connect reply",
                    source: std::sync::Arc::new(e),
                },
            })?;
        if reply.version != CONNECT_VERSION
            || reply.endpoint_id != id
            || reply.qps.len() != qps.len()
        {
            return Err(TransferError::Handshake {
                peer: key.peer.clone(),
                source: crate::error::HandshakeError::ConnectReplyMismatch {
                    version: reply.version,
                    endpoint: reply.endpoint_id,
                    qps: reply.qps.len(),
                    asked_qps: qps.len(),
                },
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
                    sent: Mutex::new(VecDeque::new()),
                })
                .collect(),
            dev,
            path_mtu: mtu,
            max_wr: max_wr as usize,
            next_qp: AtomicUsize::new(0),
            broken: AtomicBool::new(false),
            first_error: OnceLock::new(),
            pending: Mutex::new(VecDeque::new()),
            retired: Mutex::new(Vec::new()),
            last_used: Mutex::new(Instant::now()),
        })
    }

    /// Marks the endpoint used now.
    pub fn touch(&self) {
        *self.last_used.locked() = Instant::now();
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
            && self.last_used.locked().elapsed() >= idle
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    pub fn lock_pending(&self) -> std::sync::MutexGuard<'_, VecDeque<Work>> {
        self.pending.locked()
    }

    /// Marks the endpoint failed (first call only: returns the slices still pending, and moves
    /// the QPs to ERR so their outstanding work requests flush); later calls return None.
    pub fn mark_broken(&self, reason: &EndpointFailure) -> Option<Vec<Work>> {
        let drained = {
            let mut p = self.lock_pending();
            if self.broken.swap(true, Ordering::AcqRel) {
                return None;
            }
            let _ = self.first_error.set(reason.clone());
            p.drain(..).collect::<Vec<_>>()
        };
        for q in &self.qps {
            fail_qp(&mut q.qp.locked());
        }
        Some(drained)
    }

    /// The QP one pump puts its work requests on (`home_qp`), `None` to spread them round
    /// robin: see `home_qp`.
    pub fn home_qp(&self) -> Option<usize> {
        let loads: Vec<usize> = self
            .qps
            .iter()
            .map(|q| q.outstanding.load(Ordering::Acquire))
            .collect();
        home_qp(
            &loads,
            self.next_qp.fetch_add(1, Ordering::Relaxed),
            self.max_wr,
        )
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

/// The QP a pump (one submission's slices, or what waited for room) puts its work requests
/// on, given the work requests outstanding per QP (`loads`), a rotating `start` and the room
/// per QP (`max_wr`): `None` (spread round robin) when every QP is idle, so a lone batch uses
/// them all; else the least loaded QP with room (ties: the first from `start` on), so that
/// batches in flight together go to different QPs instead of each spreading over all of them.
/// Why: a batch spread over every QP couples the submitters: each waits for the others' work
/// on every QP (and on soft-RoCE the protocol runs inside `ibv_post_send`, on whichever thread
/// posts to a busy QP first). `None` as well when no QP has room (the pump then finds none).
pub(super) fn home_qp(loads: &[usize], start: usize, max_wr: usize) -> Option<usize> {
    if loads.iter().all(|&l| l == 0) {
        return None;
    }
    let n = loads.len();
    (0..n)
        .map(|k| (start + k) % n)
        .filter(|&i| loads[i] < max_wr)
        .min_by_key(|&i| loads[i])
}

/// An endpoint cache entry (`Shared::endpoints`): slices waiting while the connect thread sets
/// the endpoint up, or the endpoint.
pub(super) enum Slot {
    Connecting(Vec<Work>),
    Ready(Arc<Endpoint>),
}

#[cfg(test)]
mod tests {
    use super::home_qp;

    #[test]
    fn a_pump_spreads_over_idle_qps_and_keeps_to_the_least_loaded_one_otherwise() {
        // an idle endpoint: a lone batch is spread over every QP
        assert_eq!(home_qp(&[0, 0], 0, 256), None);
        assert_eq!(home_qp(&[0, 0, 0, 0], 7, 256), None);
        // another batch in flight: the new one goes to the QP it does not load
        assert_eq!(home_qp(&[32, 0], 0, 256), Some(1));
        assert_eq!(home_qp(&[0, 32], 1, 256), Some(0));
        // spread over both already: the least loaded one
        assert_eq!(home_qp(&[20, 12], 0, 256), Some(1));
        // ties go round robin from `start`
        assert_eq!(home_qp(&[5, 5, 9], 0, 256), Some(0));
        assert_eq!(home_qp(&[5, 5, 9], 1, 256), Some(1));
        assert_eq!(home_qp(&[5, 5, 9], 2, 256), Some(0));
        // a full QP is never the home, however loaded the others are
        assert_eq!(home_qp(&[256, 300], 0, 256), None);
        assert_eq!(home_qp(&[1, 256], 1, 256), Some(0));
    }
}
