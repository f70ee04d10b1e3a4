//! [`TransportKind`], the name of a transport. A leaf module: the error types name it (a peer
//! of another transport) and `types` parses it (`FromStr`, whose error is an `ArgumentError`),
//! so it imports nothing of the crate.

use serde::{Deserialize, Serialize};

/// A transport kind. In `EngineConfig::transport` it is the operator's choice: `Auto` takes
/// RDMA when `rdma::probe()` finds a usable device, TCP otherwise (one info line says which;
/// `transport::select` is the one place that choice is made); `Rdma` with no device is a
/// `Config` error. In a segment descriptor (`TransportInfo::kind`) it is what the segment
/// speaks, never `Auto`. Serialized as its lowercase name (`"auto"`, `"tcp"`, `"rdma"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// RDMA when a usable device is found, else TCP (the default).
    #[default]
    Auto,
    /// The TCP transport, even where RDMA is present.
    Tcp,
    /// The RDMA transport; no usable device is a `Config` error.
    Rdma,
}

impl TransportKind {
    /// The lowercase name, as serialized: `"auto"`, `"tcp"` or `"rdma"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma => "rdma",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
