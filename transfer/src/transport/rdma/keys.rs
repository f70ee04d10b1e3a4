//! The RDMA transport's own keys for a registered region, published opaquely in the region's
//! `RegionKeys::transport` (docs/design.md §3.7): the engine never reads them.

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::memory::TransportKeys;

/// The RDMA keys of one region: `{"rkeys": [u32...], "staging_addr": u64?}` in the descriptor.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaRegionKeys {
    /// One rkey per device of the owner's device list (`RdmaPeerInfo::devices`), in that order.
    pub rkeys: Vec<u32>,
    /// With `RegistrationPath::Staged`: the address of the pinned host mirror that work
    /// requests target instead of the region's own address (offsets are the same). A peer that
    /// WRITEs there asks the owner to copy the range to the device before it reports the slice
    /// done, and asks it to copy the range from the device before it READs (§3.8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging_addr: Option<u64>,
}

impl RdmaRegionKeys {
    /// The opaque form published in the segment descriptor. Errors: none in practice (the type
    /// always encodes to an object); `Config` if it ever did not.
    pub fn encode(&self) -> Result<TransportKeys> {
        TransportKeys::encode(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{RegionKeys, RegistrationPath};

    #[test]
    fn region_keys_json_keeps_the_descriptor_shape() {
        let keys = RegionKeys::new(
            RegistrationPath::Staged,
            RdmaRegionKeys {
                rkeys: vec![7, 9],
                staging_addr: Some(4096),
            }
            .encode()
            .unwrap(),
        );
        let v = serde_json::to_value(&keys).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"path": "staged", "rkeys": [7, 9], "staging_addr": 4096})
        );
        let back: RegionKeys = serde_json::from_value(v).unwrap();
        assert_eq!(back, keys);
        let rdma: RdmaRegionKeys = back.transport.decode().unwrap();
        assert_eq!(rdma.rkeys, vec![7, 9]);
        assert_eq!(rdma.staging_addr, Some(4096));
    }

    #[test]
    fn bad_rdma_keys_are_refused_by_name() {
        for (json, field) in [
            (serde_json::json!({"path": "host"}), "rkeys"),
            (serde_json::json!({"rkeys": "x"}), "invalid type"),
            (
                serde_json::json!({"rkeys": [1], "staging_addr": -1}),
                "invalid value",
            ),
        ] {
            let keys: RegionKeys = serde_json::from_value(json.clone()).unwrap();
            let e = keys
                .transport
                .decode::<RdmaRegionKeys>()
                .expect_err(&format!("{json} decoded"));
            assert!(e.to_string().contains(field), "{json}: {e}");
        }
    }
}
