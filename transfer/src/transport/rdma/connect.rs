//! The Connect frame bodies (docs/design.md §3: QP numbers, PSNs, GIDs, LIDs and active MTUs
//! exchanged): the request, its reply and the close notice, JSON in `Connect` handshake
//! frames, and the check of a request's shape before any verbs call.

use serde::{Deserialize, Serialize};

use super::device::PortInfo;
use super::verbs;
use crate::error::{ProtocolError, Result, TransferError};

/// Version of the Connect frame body.
pub(crate) const CONNECT_VERSION: u32 = 1;
/// Most QPs one Connect may ask for.
const MAX_QPS: usize = 64;

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

/// Validates a Connect request's shape before any verbs call. Errors: `Protocol`.
pub(crate) fn check_request(req: &ConnectRequest, devices: usize) -> Result<()> {
    if req.version != CONNECT_VERSION {
        return Err(TransferError::Protocol(ProtocolError::Version {
            what: "RDMA connect",
            got: req.version,
            speaks: CONNECT_VERSION,
        }));
    }
    if req.qps.is_empty() || req.qps.len() > MAX_QPS {
        return Err(TransferError::Protocol(ProtocolError::Mismatch {
            what: "RDMA connect's QPs".into(),
            got: req.qps.len() as u64,
            expected: format!("1..={MAX_QPS}"),
        }));
    }
    if req.device >= devices {
        return Err(TransferError::Protocol(ProtocolError::Mismatch {
            what: "RDMA connect's device index".into(),
            got: req.device as u64,
            expected: format!("below {devices} (this engine's devices)"),
        }));
    }
    if verbs::mtu_from_bytes(req.port.active_mtu).is_none() {
        return Err(verbs::not_an_ib_mtu(
            "RDMA connect MTU".into(),
            req.port.active_mtu,
        ));
    }
    if req.qps.iter().any(|q| q.qpn > 0x00ff_ffff) {
        return Err(TransferError::Protocol(ProtocolError::BadField {
            what: "RDMA connect QP number".into(),
            value: "over 24 bits".into(),
            expected: "a 24-bit QP number",
        }));
    }
    Ok(())
}
