//! Why an RDMA operation failed: the cause carried by
//! [`TransferError::Rdma`](super::TransferError::Rdma).

use std::sync::Arc;

use kvferry_cuda::Location;

use super::io::{chain, IoError, Shared};

mod work;
pub use work::{EndpointFailure, FailedWork, WcStatus, WorkOp, WorkRequest};

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
    /// A region larger than a device can register as one memory region.
    #[error("region of {len} bytes exceeds {device}'s largest memory region ({max} bytes)")]
    RegionOverDeviceLimit {
        /// The region's length.
        len: u64,
        /// The device's name.
        device: String,
        /// Its largest memory region (`max_mr_size`), bytes.
        max: u64,
    },
    /// The host mirror of a staged region could not be mapped.
    #[error(
        "cannot map a {len}-byte host mirror for the {location} region at {addr:#x}: {source}"
    )]
    MirrorMap {
        /// The mirror's length.
        len: u64,
        /// Where the staged region lives.
        location: Location,
        /// The staged region's start.
        addr: u64,
        /// The mapping's error.
        #[source]
        source: IoError,
    },
    /// A peer's buffer has no rkey for the device the endpoint uses (or a staged address that
    /// does not translate).
    #[error(
        "segment {segment} buffer {buffer} has no rkey for its device {device} (or a bad \
         staging address)"
    )]
    NoRkey {
        /// The peer's segment name.
        segment: String,
        /// The buffer's index in its descriptor.
        buffer: usize,
        /// The peer's device index.
        device: usize,
    },
    /// Staged GPU memory: the copy between the device and the host mirror failed on this side
    /// (`way`: `"to"` or `"from"` the device).
    #[error("staged GPU memory: copy {way} the device failed: {source}")]
    StagedCopy {
        /// `"to"` or `"from"`.
        way: &'static str,
        /// The copy's error.
        #[source]
        source: Shared,
    },
    /// Staged GPU memory of a peer: the sync asking it to copy between its device and its
    /// mirror failed (its refusal, its copy error, or why it could not be reached in time).
    #[error(
        "staged GPU memory of segment {peer}: sync asking it to copy {way} its device failed: \
         {source}"
    )]
    StagedSync {
        /// The peer's segment name.
        peer: String,
        /// `"to"` or `"from"`.
        way: &'static str,
        /// The sync's error.
        #[source]
        source: Shared,
    },
    /// The transport shut down before the slice finished.
    #[error("RDMA transport shut down")]
    ShutDown,
    /// A work request whose completion came back with an error status (see [`FailedWork`]:
    /// the request, the status, and what flushed it).
    #[error("{0}")]
    WorkFailed(#[source] Box<FailedWork>),
    /// Connecting to a peer (the RDMA `Connect` handshake, or setting up the QPs) failed:
    /// `source` is the engine's error for it (a `TransferError`).
    #[error("RDMA connect to {peer}: {source}")]
    Connect {
        /// The peer's segment name.
        peer: String,
        /// Why (a `TransferError`, shared).
        #[source]
        source: Shared,
    },
    /// A slice failed on every attempt: `last` is the last failure, `first` the first when it
    /// differs; each attempt went to a fresh endpoint (`RdmaConfig::max_retries`).
    #[error(
        "{last} (after {retries} retries{})",
        match .first { Some(first) => format!("; first failure: {first}"), None => String::new() }
    )]
    Retried {
        /// The last attempt's failure.
        #[source]
        last: Box<RdmaError>,
        /// Attempts after the first.
        retries: u32,
        /// The first attempt's failure, when its text differs from the last's.
        first: Option<Box<RdmaError>>,
    },
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
