//! What the metrics need of each batch in flight (`crate::metrics`): its path, peer, op, bytes
//! and start, recorded once when it is waited for.

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use crate::error::Result;
use crate::types::{BatchId, Op, TransferRequest};

/// A batch in flight as the metrics see it.
struct BatchMeter {
    started: Instant,
    path: &'static str,
    peer: String,
    op: &'static str,
    bytes: u64,
    slices: u32,
}

/// The engine's batches in flight, by id.
#[derive(Default)]
pub(crate) struct Meters(Mutex<HashMap<BatchId, BatchMeter>>);

impl Meters {
    fn lock(&self) -> MutexGuard<'_, HashMap<BatchId, BatchMeter>> {
        self.0.locked()
    }

    /// Batch `id` of `slices` slices of `requests` to `peer` started on `path` (a metrics label).
    pub(crate) fn start(
        &self,
        id: BatchId,
        path: &'static str,
        peer: &str,
        requests: &[TransferRequest],
        slices: u32,
    ) {
        let op = requests.first().map(|r| r.op).unwrap_or(Op::Write);
        let bytes = requests.iter().fold(0u64, |a, r| a.saturating_add(r.len));
        self.start_with(id, path, peer, op, bytes, slices);
    }

    /// As `start`, for a batch of `bytes` whose first request is an `op`.
    pub(crate) fn start_with(
        &self,
        id: BatchId,
        path: &'static str,
        peer: &str,
        op: Op,
        bytes: u64,
        slices: u32,
    ) {
        let meter = BatchMeter {
            started: Instant::now(),
            path,
            peer: peer.to_string(),
            op: match op {
                Op::Read => "read",
                Op::Write => "write",
            },
            bytes,
            slices,
        };
        self.lock().insert(id, meter);
    }

    /// Records a waited batch's end once: done, failed, or timed out (its later end is not
    /// recorded again).
    pub(crate) fn end(&self, id: BatchId, r: &Result<()>) {
        let Some(m) = self.lock().remove(&id) else {
            return;
        };
        crate::metrics::global().transfer(
            &crate::metrics::Transfer {
                path: m.path,
                peer: &m.peer,
                op: m.op,
                bytes: m.bytes,
                slices: m.slices,
                seconds: m.started.elapsed().as_secs_f64(),
            },
            r.as_ref().map(|_| ()).map_err(|e| e.cause()),
        );
    }

    /// Forgets batch `id` unrecorded (freed).
    pub(crate) fn forget(&self, id: BatchId) {
        self.lock().remove(&id);
    }
}
