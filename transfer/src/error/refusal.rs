//! Why a target segment refused a request ([`TransferError::Refused`](super::TransferError)):
//! its own words, or one of the refusals the CUDA IPC transport makes itself.

use super::io::PeerText;

/// Why a target refused a request: a remote target's words as it sent them (bounded, escaped),
/// or a refusal of the CUDA IPC transport, which knows the case.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The target's error frame: its words.
    #[error("{0}")]
    Peer(PeerText),
    /// The target refused a scattered WRITE (one of its pieces lies outside its buffers):
    /// its words.
    #[error("scattered WRITE: {0}")]
    Scattered(PeerText),
    /// CUDA IPC: the peer's process (on this host) has exited.
    #[error("its process {pid} has exited")]
    ProcessExited {
        /// The peer's process id.
        pid: u32,
    },
    /// CUDA IPC: a file descriptor was asked for with a ticket that is unknown, used or
    /// expired.
    #[error("CUDA IPC ticket unknown, used or expired")]
    UnknownTicket,
    /// CUDA IPC: the owner's descriptor socket answers only processes of its own user, and
    /// this process runs as another (or the kernel could not say which).
    #[error("the CUDA IPC owner hands descriptors only to processes of its own user")]
    OtherUser,
    /// CUDA IPC: the peer's keys name this very process, but the peer is none of this
    /// process's engines (its device addresses would be taken as ours).
    #[error("its CUDA IPC keys claim this process, but it is not one of this process's engines")]
    ForgedIdentity,
    /// CUDA IPC: a handle request names another instance of this engine's segment (the
    /// asker's descriptor is from before a restart).
    #[error("the request names instance {asked:#x}, this engine is instance {current:#x}")]
    OtherInstance {
        /// The instance id the asker's descriptor holds.
        asked: u64,
        /// This engine's instance id.
        current: u64,
    },
    /// CUDA IPC: a peer asked for an allocation this engine did not export.
    #[error("allocation {base:#x} is not exported for CUDA IPC")]
    NotExported {
        /// The allocation's base address.
        base: u64,
    },
}
