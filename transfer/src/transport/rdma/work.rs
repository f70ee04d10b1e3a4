//! The unit of work that moves through the RDMA transport: a slice on its way (`Work`) and
//! the jobs of the stager thread (`StageJob`).

use std::sync::Arc;

use super::mirror::Mirror;
use super::peer::RdmaPeerInfo;
use crate::descriptor::SegmentDescriptor;
use crate::error::RdmaError;
use crate::transport::{CompletionSink, Slice};

/// One slice on its way: the engine's slice, its peer, where to report it, retries so far.
pub(crate) struct Work {
    pub slice: Slice,
    pub peer: Arc<SegmentDescriptor>,
    /// The peer's RDMA peer info, decoded from its descriptor once for the batch.
    pub peer_info: Arc<RdmaPeerInfo>,
    pub sink: CompletionSink,
    pub attempts: u32,
    /// The first failure (kept for the final error when a retry fails differently).
    pub first_error: Option<RdmaError>,
    /// The host mirror of the local region when it is staged GPU memory (`staging_sync.rs`).
    pub mirror: Option<Arc<Mirror>>,
}

/// Work for the stager.
pub(crate) enum StageJob {
    /// Slices to prepare, then dispatch.
    Before(Vec<Work>),
    /// A slice whose work request succeeded, to finish, then report.
    After(Work),
}
