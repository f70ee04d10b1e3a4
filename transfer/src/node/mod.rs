//! What this node's RDMA devices offer the transfer engine (for `kvferry doctor`): every device,
//! its ports (state, link layer, active MTU), their GIDs with their types, and the port and GID
//! the RDMA transport would use, found by the transport's own choice code
//! (`transport::rdma`), so the report and the engine can never disagree.

mod facts;

pub use facts::{ChosenPort, GidFacts, RdmaDeviceFacts, RdmaFacts, RdmaPortFacts};

use crate::config::RdmaConfig;

/// Inspects the RDMA devices with `config`'s device list, GID index and MTU cap. Never fails
/// and never panics: where libibverbs is absent or the build has no RDMA transport,
/// `list_error` says so and `devices` is empty.
pub fn rdma_facts(config: &RdmaConfig) -> RdmaFacts {
    #[cfg(feature = "rdma")]
    {
        match crate::transport::rdma::inventory(config) {
            Ok(devices) => RdmaFacts {
                built: true,
                list_error: None,
                devices,
            },
            Err(e) => RdmaFacts {
                built: true,
                list_error: Some(e.to_string()),
                devices: Vec::new(),
            },
        }
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = config;
        RdmaFacts {
            built: false,
            list_error: Some("this build has no RDMA transport (cargo feature `rdma`)".into()),
            devices: Vec::new(),
        }
    }
}
