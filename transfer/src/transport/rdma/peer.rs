//! What an RDMA peer advertises in its segment descriptor, decoded once per batch into a typed
//! value: its devices (`TransportInfo::details`) and each buffer's RDMA keys (rkeys in device
//! order, staging mirror), from the buffers' opaque `RegionKeys::transport`.

use serde::{Deserialize, Serialize};

use super::device::PortInfo;
use super::keys::RdmaRegionKeys;
use super::verbs;
use crate::descriptor::SegmentDescriptor;
use crate::error::{ProtocolError, RdmaInfoFault, Result, TransferError};

/// The RDMA part of a segment descriptor: `{"devices": [PortInfo...]}` (wire format of
/// `RdmaTransport::local_info`), plus the RDMA keys of every buffer, decoded from the buffers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaPeerInfo {
    /// The peer's devices (at least one), each with every field present.
    pub devices: Vec<PortInfo>,
    /// `buffers[i]`: the keys of the descriptor's buffer `i`; `rkeys[d]` refers to
    /// `devices[d]`. Not part of `details`: filled by [`RdmaPeerInfo::decode`].
    #[serde(skip)]
    pub buffers: Vec<RdmaRegionKeys>,
}

impl RdmaPeerInfo {
    /// Decodes and checks `peer`'s RDMA peer info and buffer keys. Errors: `Protocol` naming the
    /// segment and the missing or bad field (a device without `gid` or `active_mtu`, a GID that
    /// is not IPv6 text, an MTU that is not an IB MTU, no device at all; a buffer without
    /// `rkeys`, or with another number of rkeys than devices); nothing is defaulted.
    pub fn decode(peer: &SegmentDescriptor) -> Result<RdmaPeerInfo> {
        let mut info: RdmaPeerInfo = peer.transport.decode(&peer.name)?;
        let bad = |fault: RdmaInfoFault| {
            TransferError::Protocol(ProtocolError::RdmaPeerInfo {
                segment: peer.name.clone(),
                fault,
            })
        };
        if info.devices.is_empty() {
            return Err(bad(RdmaInfoFault::NoDevice));
        }
        for (device, d) in info.devices.iter().enumerate() {
            if verbs::mtu_from_bytes(d.active_mtu).is_none() {
                return Err(bad(RdmaInfoFault::BadMtu {
                    device,
                    mtu: d.active_mtu,
                }));
            }
            d.parse_gid().map_err(|source| {
                bad(RdmaInfoFault::BadGid {
                    device,
                    gid: d.gid.clone(),
                    source,
                })
            })?;
        }
        for (buffer, b) in peer.buffers.iter().enumerate() {
            let keys: RdmaRegionKeys = b.keys.transport.decode().map_err(|e| {
                bad(RdmaInfoFault::BadKeys {
                    buffer,
                    source: e.into(),
                })
            })?;
            // A missing rkey would only surface when a slice to that device is posted.
            if keys.rkeys.len() != info.devices.len() {
                return Err(bad(RdmaInfoFault::RkeyCount {
                    buffer,
                    rkeys: keys.rkeys.len(),
                    devices: info.devices.len(),
                }));
            }
            info.buffers.push(keys);
        }
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::TransportInfo;
    use crate::transport::rdma::tests::port;

    /// A descriptor of segment "peer:1" whose RDMA details are `details`.
    fn descriptor_with(details: serde_json::Value) -> SegmentDescriptor {
        SegmentDescriptor {
            name: "peer:1".into(),
            instance_id: 7,
            transport: TransportInfo {
                kind: crate::types::TransportKind::Rdma,
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

    #[test]
    fn buffer_keys_are_decoded_once_and_bad_ones_refused_by_name() {
        let with_buffers = |keys: Vec<serde_json::Value>| {
            let mut d = descriptor_with(serde_json::json!({ "devices": [port(1024), port(4096)] }));
            d.buffers = keys
                .into_iter()
                .enumerate()
                .map(|(i, k)| {
                    serde_json::from_value(serde_json::json!({
                        "region": {"addr": 4096 * (i + 1), "len": 4096, "location": "cpu"},
                        "keys": k,
                    }))
                    .unwrap()
                })
                .collect();
            d
        };
        let good = serde_json::json!({"path": "host", "rkeys": [5, 6]});
        let staged = serde_json::json!({"path": "staged", "rkeys": [7, 8], "staging_addr": 65536});
        let info = RdmaPeerInfo::decode(&with_buffers(vec![good.clone(), staged])).unwrap();
        assert_eq!(info.buffers.len(), 2);
        assert_eq!(info.buffers[0].rkeys, vec![5, 6]);
        assert_eq!(info.buffers[1].staging_addr, Some(65536));
        let cases = [
            (
                serde_json::json!({"path": "host"}),
                "buffers[1].keys: missing field `rkeys`",
            ),
            (
                serde_json::json!({"rkeys": [1]}),
                "buffers[1].keys has 1 rkeys for 2 devices",
            ),
            (
                serde_json::json!({"rkeys": [1, 2, 3]}),
                "has 3 rkeys for 2 devices",
            ),
            (
                serde_json::json!({"rkeys": [1, 2], "staging_addr": "x"}),
                "buffers[1].keys: invalid type",
            ),
        ];
        for (bad, text) in cases {
            let e = RdmaPeerInfo::decode(&with_buffers(vec![good.clone(), bad.clone()]))
                .expect_err(&format!("{bad} was accepted"));
            assert!(matches!(e, TransferError::Protocol(_)), "{e:?}");
            assert!(e.to_string().contains(text), "{bad}: {e}");
            assert!(e.to_string().contains("peer:1"), "{e}");
        }
    }

    /// Each refusal keeps its typed cause: the segment, the fault with its index and values,
    /// and for a bad GID the field check it came from (walkable through `source()`).
    #[test]
    fn rdma_peer_info_refusals_are_typed_faults() {
        use std::error::Error as _;
        let fault = |d: &SegmentDescriptor| match RdmaPeerInfo::decode(d) {
            Err(TransferError::Protocol(ProtocolError::RdmaPeerInfo { segment, fault })) => {
                assert_eq!(segment, "peer:1");
                fault
            }
            other => panic!("{other:?}"),
        };
        let no_device = descriptor_with(serde_json::json!({ "devices": [] }));
        assert_eq!(fault(&no_device), RdmaInfoFault::NoDevice);
        let mut dev = port(1024);
        dev.active_mtu = 1000;
        let bad_mtu = descriptor_with(serde_json::json!({ "devices": [port(1024), dev] }));
        assert_eq!(
            fault(&bad_mtu),
            RdmaInfoFault::BadMtu {
                device: 1,
                mtu: 1000
            }
        );
        let mut dev = port(1024);
        dev.gid = "not a gid".into();
        let bad_gid = descriptor_with(serde_json::json!({ "devices": [dev] }));
        let f = fault(&bad_gid);
        match &f {
            RdmaInfoFault::BadGid { device: 0, gid, .. } => assert_eq!(gid, "not a gid"),
            other => panic!("{other:?}"),
        }
        let below = f.source().expect("a bad GID has a source");
        assert!(
            below.downcast_ref::<std::net::AddrParseError>().is_some(),
            "{below:?}"
        );

        let with_keys = |k: serde_json::Value| {
            let mut d = descriptor_with(serde_json::json!({ "devices": [port(1024)] }));
            d.buffers = vec![serde_json::from_value(serde_json::json!({
                "region": {"addr": 4096, "len": 4096, "location": "cpu"},
                "keys": k,
            }))
            .unwrap()];
            d
        };
        match fault(&with_keys(serde_json::json!({"path": "host"}))) {
            RdmaInfoFault::BadKeys { buffer: 0, source } => {
                assert!(source.0.is_data(), "{source:?}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            fault(&with_keys(serde_json::json!({"rkeys": [1, 2]}))),
            RdmaInfoFault::RkeyCount {
                buffer: 0,
                rkeys: 2,
                devices: 1
            }
        );
    }
}
