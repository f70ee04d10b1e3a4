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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::tests::port;
    use crate::transport::TransportInfo;

    /// A descriptor of segment "peer:1" whose RDMA details are `details`.
    fn descriptor_with(details: serde_json::Value) -> SegmentDescriptor {
        SegmentDescriptor {
            name: "peer:1".into(),
            instance_id: 7,
            transport: TransportInfo {
                kind: "rdma".into(),
                details,
            },
            buffers: Vec::new(),
        }
    }

    #[test]
    fn rdma_peer_info_decodes_what_local_info_publishes() {
        let devices = vec![port(1024), port(4096)];
        let d = descriptor_with(serde_json::json!({ "devices": devices }));
        let info = RdmaPeerInfo::decode(&d).unwrap();
        assert_eq!(info.devices, devices);
    }

    #[test]
    fn rdma_peer_info_missing_or_bad_fields_are_refused_by_name() {
        let full = serde_json::to_value(port(1024)).unwrap();
        let without = |field: &str| {
            let mut dev = full.clone();
            dev.as_object_mut().unwrap().remove(field);
            serde_json::json!({ "devices": [dev] })
        };
        let with = |field: &str, v: serde_json::Value| {
            let mut dev = full.clone();
            dev[field] = v;
            serde_json::json!({ "devices": [dev] })
        };
        let cases = [
            (without("active_mtu"), "active_mtu"),
            (without("gid"), "gid"),
            (serde_json::json!({}), "devices"),
            (serde_json::json!({ "devices": [] }), "no device"),
            (with("active_mtu", 1000.into()), "active_mtu 1000"),
            (with("gid", "not a gid".into()), "devices[0].gid"),
        ];
        for (details, field) in cases {
            let e = RdmaPeerInfo::decode(&descriptor_with(details.clone()))
                .expect_err(&format!("{details} was accepted"));
            assert!(matches!(e, TransferError::Protocol(_)), "{e:?}");
            let text = e.to_string();
            assert!(text.contains(field), "{details}: {text}");
            assert!(text.contains("peer:1"), "{text}");
        }
    }
}
