//! What is wrong with what a peer advertised or answered, once it decoded: [`RdmaInfoFault`]
//! (a segment's RDMA peer info and buffer keys) and [`CudaIpcReplyFault`] (a CUDA IPC reply).

use kvferry_cuda::ipc::AllocationKind;

use super::json::JsonError;

/// What is wrong with a segment's advertised RDMA peer info (`devices`) or a buffer's RDMA
/// keys; indexes count from 0 in the descriptor's order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RdmaInfoFault {
    /// `devices` is empty.
    #[error("no device in `devices`")]
    NoDevice,
    /// `devices[device].active_mtu` (bytes) is not an IB MTU (256, 512, ..., 4096).
    #[error("devices[{device}].active_mtu {mtu} is not an IB MTU")]
    BadMtu {
        /// The device's index.
        device: usize,
        /// The MTU as advertised, in bytes.
        mtu: u32,
    },
    /// `devices[device].gid` is not IPv6 address text.
    #[error("devices[{device}].gid {gid:?}: {source}")]
    BadGid {
        /// The device's index.
        device: usize,
        /// The GID as advertised.
        gid: String,
        /// The parser's error.
        #[source]
        source: std::net::AddrParseError,
    },
    /// `buffers[buffer].keys` do not decode as RDMA keys (`source`: the decoder's error,
    /// naming the field).
    #[error("buffers[{buffer}].keys: {source}")]
    BadKeys {
        /// The buffer's index.
        buffer: usize,
        /// The JSON decoder's error.
        #[source]
        source: JsonError,
    },
    /// `buffers[buffer].keys` has another number of rkeys than the segment has devices.
    #[error("buffers[{buffer}].keys has {rkeys} rkeys for {devices} devices")]
    RkeyCount {
        /// The buffer's index.
        buffer: usize,
        /// Its number of rkeys.
        rkeys: usize,
        /// The segment's number of devices.
        devices: usize,
    },
}

/// What is wrong with a peer's CUDA IPC reply for one allocation (`base`: its base address).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaIpcReplyFault {
    /// The reply does not list the allocation.
    #[error("no entry for allocation {base:#x}")]
    NotListed {
        /// The allocation's base address.
        base: u64,
    },
    /// The reply lists the allocation without the handle its kind needs (a legacy handle for
    /// `Legacy`, a file descriptor ticket for `VmmFd`).
    #[error("no {kind:?} handle for allocation {base:#x}")]
    NoHandle {
        /// The allocation's base address.
        base: u64,
        /// The allocation's kind, as the descriptor says.
        kind: AllocationKind,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{ProtocolError, TransferError};
    use std::error::Error as _;

    /// A CUDA IPC reply's fault stays typed under the protocol error: a caller walking
    /// `source()` finds which allocation and which handle was missing.
    #[test]
    fn cuda_ipc_reply_fault_survives_as_the_source() {
        for fault in [
            CudaIpcReplyFault::NotListed { base: 0x1000 },
            CudaIpcReplyFault::NoHandle {
                base: 0x1000,
                kind: AllocationKind::VmmFd,
            },
        ] {
            let e = TransferError::Protocol(ProtocolError::CudaIpcReply {
                peer: "h:1".into(),
                fault: fault.clone(),
            });
            let text = e.to_string();
            assert!(text.contains("CUDA IPC reply from h:1"), "{text}");
            assert!(text.contains("allocation 0x1000"), "{text}");
            let protocol = e.source().expect("protocol error");
            let below = protocol.source().expect("the fault");
            assert_eq!(below.downcast_ref::<CudaIpcReplyFault>(), Some(&fault));
        }
    }
}
