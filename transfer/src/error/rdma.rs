//! Why an RDMA operation failed: the cause carried by
//! [`TransferError::Rdma`](super::TransferError::Rdma).

use std::sync::Arc;

use super::io::{chain, Shared};

/// An RDMA-specific failure (`transport::rdma`).
#[derive(Debug, Clone, thiserror::Error)]
pub enum RdmaError {
    /// A verbs call failed: `op` names the device and the call; `source` is the verbs
    /// library's error (whose own source is the OS error).
    #[error("{op}: {}", chain(source.0.as_ref()))]
    Verbs {
        /// Device and call (`"rxe0: create QP"`).
        op: String,
        /// The verbs library's error.
        #[source]
        source: Shared,
    },
    /// The device has no ACTIVE port.
    #[error("{device}: no ACTIVE port")]
    NoActivePort {
        /// The device's name.
        device: String,
    },
    /// The device's active port has no usable GID.
    #[error("{device} port {port}: no usable GID (gid_index {gid_index:?})")]
    NoUsableGid {
        /// The device's name.
        device: String,
        /// The port number.
        port: u8,
        /// `RdmaConfig::gid_index`.
        gid_index: Option<u32>,
    },
    /// A device listed a moment ago is gone when opened (unplugged, driver reloaded).
    #[error("device {device} disappeared")]
    DeviceGone {
        /// The device's name.
        device: String,
    },
    /// The transport shut down before the slice finished.
    #[error("RDMA transport shut down")]
    ShutDown,
    /// A failure with no underlying error (its words: a missing rkey, a region over the
    /// device's limit, a work completion's status).
    #[error("{0}")]
    Other(String),
}

impl RdmaError {
    /// A verbs call `op` failed with `source`.
    pub fn verbs(
        op: impl std::fmt::Display,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        RdmaError::Verbs {
            op: op.to_string(),
            source: Shared(Arc::new(source)),
        }
    }
}
