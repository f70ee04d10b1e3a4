//! The facts `super::rdma_facts` reports: plain data, serializable, with no verbs in them (the
//! RDMA transport fills them in, `transport::rdma::inventory`).

use serde::Serialize;

/// The RDMA side of the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RdmaFacts {
    /// Whether this build has the RDMA transport (cargo feature `rdma`).
    pub built: bool,
    /// Why devices could not be listed (no libibverbs, no RDMA support, not built); `None`
    /// when the list was read.
    pub list_error: Option<String>,
    /// Every device libibverbs lists, in its order.
    pub devices: Vec<RdmaDeviceFacts>,
}

/// One RDMA device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RdmaDeviceFacts {
    /// Device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Why the device could not be opened or queried; `None` when it was.
    pub error: Option<String>,
    /// Its ports, from port 1.
    pub ports: Vec<RdmaPortFacts>,
    /// The port and GID the transport would use on this device (`None`: unusable, `unusable`
    /// says why).
    pub chosen: Option<ChosenPort>,
    /// Why the transport would not use this device (`None` when it would).
    pub unusable: Option<String>,
}

/// One port of a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RdmaPortFacts {
    /// Port number (from 1).
    pub port: u8,
    /// Logical state (`Active`, `Down`, `Initializing`, ...).
    pub state: String,
    /// `Ethernet` (RoCE), `InfiniBand` or `Unspecified`.
    pub link_layer: String,
    /// The port's active MTU, bytes.
    pub active_mtu: u32,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// The GID table's non-zero entries.
    pub gids: Vec<GidFacts>,
}

/// One GID table entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GidFacts {
    /// Index in the port's GID table (what `RdmaConfig::gid_index` names).
    pub index: u32,
    /// The GID as IPv6 text (`::ffff:10.0.0.1` for an IPv4-mapped RoCEv2 GID).
    pub gid: String,
    /// `RoCEv2`, `RoCEv1` or `IB` (InfiniBand ports).
    pub kind: String,
}

/// What the transport would use on a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChosenPort {
    /// Port number.
    pub port: u8,
    /// GID index (automatic: IPv4-mapped RoCEv2 first; or `RdmaConfig::gid_index`).
    pub gid_index: u32,
    /// The GID.
    pub gid: String,
    /// MTU the engine advertises, bytes (the port's, capped by `RdmaConfig::mtu`).
    pub mtu: u32,
}
