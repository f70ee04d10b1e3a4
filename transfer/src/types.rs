//! Small value types of the transfer API (docs/interfaces.md, docs/design.md §3).

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{ArgumentError, Shared, TransferError};

/// Where a memory region lives: defined once in kvferry-cuda and used by every crate.
pub use kvferry_cuda::Location;

/// The transport kind (defined in a module of its own that imports nothing of the crate, so
/// that the error types can name it).
pub use crate::transport_kind::TransportKind;

impl FromStr for TransportKind {
    type Err = TransferError;
    /// Parses `"auto"`, `"tcp"` or `"rdma"` (case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportKind::Auto),
            "tcp" => Ok(TransportKind::Tcp),
            "rdma" => Ok(TransportKind::Rdma),
            _ => Err(ArgumentError::unknown_transport(s).into()),
        }
    }
}

/// Which path carries a transfer between a local region and a peer's, as the engine reports
/// it (`TransferEngine::transfer_path`): written `"cuda-ipc"`, `"tcp"` or `"rdma"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransferPath {
    /// Device copies between processes of one host through CUDA IPC (or inside one process).
    CudaIpc,
    /// The TCP transport.
    Tcp,
    /// The RDMA transport.
    Rdma,
}

impl std::fmt::Display for TransferPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransferPath::CudaIpc => "cuda-ipc",
            TransferPath::Tcp => "tcp",
            TransferPath::Rdma => "rdma",
        })
    }
}

/// Direction of a transfer, seen from the initiator: `Write` moves local → remote,
/// `Read` moves remote → local (Mooncake's opcode WRITE/READ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Remote → local: the initiator reads the target's memory.
    Read,
    /// Local → remote: the initiator writes the target's memory.
    Write,
}

/// One request of a batch: `len` bytes between `local_addr` (in memory registered with this
/// engine) and `remote_addr` (in a buffer the target segment advertised). Addresses are
/// virtual addresses in the owning process (device pointers for `cuda:N` regions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRequest {
    /// Direction: `Write` local → remote, `Read` remote → local.
    pub op: Op,
    /// Start of the local side, inside memory registered with this engine.
    pub local_addr: u64,
    /// Start of the remote side, inside a buffer the target segment advertised.
    pub remote_addr: u64,
    /// Bytes; must be > 0.
    pub len: u64,
}

/// Handle of a submitted batch (returned by `TransferEngine::submit`). Ids are never reused
/// within one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub u64);

/// State of a batch (Mooncake's WAITING / PENDING / COMPLETED / FAILED / TIMEOUT / INVALID).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchStatus {
    /// Submitted; no slice has finished yet.
    Waiting,
    /// Some but not all slices have finished.
    Pending,
    /// Every slice succeeded: the bytes are in place at the target (TCP: applied before the ACK;
    /// RDMA: the work completion arrived).
    Completed,
    /// Every slice finished and at least one failed: the batch's error
    /// ([`TransferError::Failed`]: the first slice failure, and how many failed of how many),
    /// shared so that the status stays `Clone` and `Eq`.
    Failed(Shared<TransferError>),
    /// A `wait` on the batch ran past its deadline. Slices still in flight may land later.
    Timeout,
    /// Unknown id (never issued, or freed after a finished wait).
    Invalid,
}

impl BatchStatus {
    /// True for `Completed`, `Failed`, `Timeout` and `Invalid`: nothing more will change.
    pub fn is_final(&self) -> bool {
        !matches!(self, BatchStatus::Waiting | BatchStatus::Pending)
    }
}

/// What an engine holds for peers (`TransferEngine::stats`): what must return to its starting
/// values once peers die or go idle (churn must not leak).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Peer descriptors cached (`open_segment`).
    pub cached_segments: usize,
    /// Peers the transport holds connection state for (TCP connection pools, RDMA peers with
    /// endpoints).
    pub peers: usize,
    /// Connections this engine opened: TCP data connections, RDMA QPs of its endpoints.
    pub connections: usize,
    /// Connections peers opened to this engine and it serves now: TCP data connections, RDMA
    /// QPs of passive endpoints.
    pub served_connections: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_text_round_trips_and_rejects_junk() {
        for l in [Location::Cpu, Location::Cuda(0), Location::Cuda(7)] {
            assert_eq!(l.to_string().parse::<Location>().unwrap(), l);
            let j = serde_json::to_string(&l).unwrap();
            assert_eq!(serde_json::from_str::<Location>(&j).unwrap(), l);
        }
        assert_eq!(
            serde_json::to_string(&Location::Cuda(3)).unwrap(),
            "\"cuda:3\""
        );
        for bad in ["", "gpu", "cuda:", "cuda:x", "cuda:-1", "cuda"] {
            assert!(bad.parse::<Location>().is_err(), "{bad}");
        }
    }

    #[test]
    fn transport_kind_parses() {
        assert_eq!("TCP".parse::<TransportKind>().unwrap(), TransportKind::Tcp);
        assert_eq!(
            "rdma".parse::<TransportKind>().unwrap(),
            TransportKind::Rdma
        );
        assert!("ib".parse::<TransportKind>().is_err());
        for k in [TransportKind::Auto, TransportKind::Tcp, TransportKind::Rdma] {
            assert_eq!(k.as_str().parse::<TransportKind>().unwrap(), k);
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
        }
    }
}
