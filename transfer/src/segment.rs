//! Segments: a peer engine named `host:port`, described by the descriptor it returns to a
//! handshake query (docs/design.md §3 "Segments").

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::memory::{MemoryRegion, RegionKeys};
use crate::transport::TransportInfo;

/// One buffer a segment advertises: a registered memory region and its transport keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDesc {
    /// The region in the segment's own address space (`addr`, `len` in bytes, location).
    pub region: MemoryRegion,
    /// How it was registered, and its transport's own keys (RDMA: per-device rkeys, staging mirror).
    pub keys: RegionKeys,
}

/// What a segment tells its peers (JSON on the handshake channel, frame type `Descriptor`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// The segment name, `host:port` of its handshake listener.
    pub name: String,
    /// Random id of the engine instance; changes when the peer restarts on the same port, so a
    /// stale descriptor is detected (TCP data requests carry it and the target checks it).
    pub instance_id: u64,
    /// The segment's transport and its connection facts (devices, data port).
    pub transport: TransportInfo,
    /// Registered buffers, ascending by address, non-overlapping.
    pub buffers: Vec<BufferDesc>,
}

impl SegmentDescriptor {
    /// The buffer that wholly contains `[addr, addr+len)`, if any.
    pub fn find_buffer(&self, addr: u64, len: u64) -> Option<&BufferDesc> {
        let i = self.buffers.partition_point(|b| b.region.addr <= addr);
        let b = self.buffers.get(i.checked_sub(1)?)?;
        b.region.contains(addr, len).then_some(b)
    }
}

/// An opened segment (returned by `TransferEngine::open_segment`): its name and the descriptor
/// fetched by the handshake (cached by the engine). Cheap to clone.
#[derive(Debug, Clone)]
pub struct SegmentHandle {
    pub(crate) descriptor: Arc<SegmentDescriptor>,
    pub(crate) token: Option<crate::auth::Token>,
}

impl SegmentHandle {
    /// `host:port` of the segment.
    pub fn name(&self) -> &str {
        &self.descriptor.name
    }

    /// This handle with `token` attached: requests submitted with it carry the token, which
    /// the peer checks against the grant it made (`crate::auth`).
    pub fn with_token(mut self, token: crate::auth::Token) -> SegmentHandle {
        self.token = Some(token);
        self
    }

    /// The attached grant token, if any.
    pub fn token(&self) -> Option<crate::auth::Token> {
        self.token
    }

    /// The descriptor this handle was opened with.
    pub fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }
}
