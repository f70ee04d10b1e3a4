//! What an RDMA peer advertises in its segment descriptor (`TransportInfo::details`), decoded
//! once per batch into a typed value: its devices, in the order its buffers' rkeys follow.

use serde::{Deserialize, Serialize};

use super::device::PortInfo;
use super::verbs;
use crate::error::{Result, TransferError};
use crate::segment::SegmentDescriptor;

/// The RDMA part of a segment descriptor: `{"devices": [PortInfo...]}` (wire format of
/// `RdmaTransport::local_info`). `RegionKeys::rkeys[i]` of every buffer refers to `devices[i]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaPeerInfo {
    /// The peer's devices (at least one), each with every field present.
    pub devices: Vec<PortInfo>,
}

impl RdmaPeerInfo {
    /// Decodes and checks `peer`'s RDMA peer info. Errors: `Protocol` naming the segment and the
    /// missing or bad field (a device without `gid` or `active_mtu`, a GID that is not IPv6
    /// text, an MTU that is not an IB MTU, no device at all); nothing is defaulted.
    pub fn decode(peer: &SegmentDescriptor) -> Result<RdmaPeerInfo> {
        let info: RdmaPeerInfo = peer.transport.decode(&peer.name)?;
        let bad = |what: String| {
            TransferError::Protocol(format!(
                "segment {} advertises bad rdma peer info: {what}",
                peer.name
            ))
        };
        if info.devices.is_empty() {
            return Err(bad("no device in `devices`".into()));
        }
        for (i, d) in info.devices.iter().enumerate() {
            if verbs::mtu_from_bytes(d.active_mtu).is_none() {
                return Err(bad(format!(
                    "devices[{i}].active_mtu {} is not an IB MTU",
                    d.active_mtu
                )));
            }
            d.gid_value()
                .map_err(|e| bad(format!("devices[{i}].gid: {e}")))?;
        }
        Ok(info)
    }
}
