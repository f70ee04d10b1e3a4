//! What a consumer knows of a producer it may read from (docs/design.md §4.10): whether its
//! loads are read here, its layout as the plans read it, and the templates of the request
//! shapes read before (two passes and one pass). Shared by the read and one-pass rooms, which
//! do not import each other for it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use kvferry_transfer::sync::MutexExt;

use super::copy_plan::{CopyTemplate, ShapeTemplate};
use crate::proto::layout::RankLayout;
use crate::proto::msg::LoadRequest;
use crate::proto::read_plan::ReadTemplate;

/// A load's question for a producer's layout ([`super::Consumer::ask_layout`]): dropped while the
/// producer is still [`Reads::Asked`] (the load got no FINISH, or its caller dropped it), it
/// lets a later load ask again.
pub(super) struct Asked {
    pub(super) reads: Arc<std::sync::Mutex<std::collections::HashMap<String, Reads>>>,
    pub(super) producer: String,
}

impl Drop for Asked {
    fn drop(&mut self) {
        let mut reads = self.reads.locked();
        if matches!(reads.get(&self.producer), Some(Reads::Asked)) {
            reads.remove(&self.producer);
        }
    }
}

/// Whether a producer's loads are read here.
pub(super) enum Reads {
    /// A load asked for its layout (loads go by WRITE).
    Asked,
    /// Its layout came; whether this side reaches its memory is being checked (loads go by
    /// WRITE).
    Deciding,
    /// Read, planned with this layout.
    Yes(Arc<ProducerLayout>),
    /// Written by the producer (it sends no layout, or this side does not reach its memory
    /// as [`crate::shell::consumer_config::ReadMode`] asks).
    No,
}

/// A producer's layout as the plan reads it, and the digest a read request names.
pub(super) struct ProducerLayout {
    pub(super) ranks: Vec<RankLayout>,
    pub(super) digest: [u8; 32],
    /// The reads of the request shape last planned, for later loads of that shape.
    pub(super) template: std::sync::Mutex<Option<(Shape, Arc<ReadTemplate>)>>,
    /// A load read with this layout succeeded: the producer's memory is mapped here, so a
    /// later load's submits only enqueue (the load's own task may make them).
    pub(super) warm: AtomicBool,
    /// The one-pass reads of the request shape last read (`None`: that shape's layers do not
    /// pair up, it is read in two passes).
    pub(super) copies: std::sync::Mutex<Option<ShapeTemplate>>,
}

impl ProducerLayout {
    /// The one-pass template of `request`'s shape where that shape was planned before
    /// (`Some(None)`: its layers do not pair up, it is read in two passes); `None` where it
    /// was not.
    pub(super) fn copy_template(&self, request: &LoadRequest) -> Option<Option<Arc<CopyTemplate>>> {
        self.copies
            .locked()
            .as_ref()
            .filter(|(shape, _)| Shape::groups(request).eq(shape.iter().copied()))
            .map(|(_, t)| t.clone())
    }
}

/// What a [`ReadTemplate`] depends on in a request: its ranks (this side's memory) and, per
/// group, its id and both block sizes.
pub(super) struct Shape {
    ranks: Vec<crate::proto::msg::WireRank>,
    groups: Vec<(u32, u64, u64)>,
}

impl Shape {
    pub(super) fn groups(request: &LoadRequest) -> impl Iterator<Item = (u32, u64, u64)> + '_ {
        request
            .blocks
            .iter()
            .map(|b| (b.group_id, b.block_size, b.remote_block_size))
    }

    pub(super) fn of(request: &LoadRequest) -> Shape {
        Shape {
            ranks: request.ranks.clone(),
            groups: Shape::groups(request).collect(),
        }
    }

    /// Whether `request` has this shape.
    pub(super) fn fits(&self, request: &LoadRequest) -> bool {
        self.ranks == request.ranks && Shape::groups(request).eq(self.groups.iter().copied())
    }
}
