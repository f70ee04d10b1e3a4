//! What the metrics need of each batch in flight (`crate::metrics`): its series (path, peer,
//! op), bytes, slices and start, recorded once when it is waited for. The series are resolved
//! once per kind of batch and kept (`SeriesCache`): a batch's metrics then cost no label
//! strings, no label hashing and no family lookups.

use crate::sync::MutexExt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::Result;
use crate::metrics::TransferSeries;
use crate::types::{Op, TransferRequest};

/// A batch in flight as the metrics see it.
pub(crate) struct BatchMeter {
    started: Instant,
    series: Arc<TransferSeries>,
    bytes: u64,
    slices: u32,
}

impl BatchMeter {
    /// Records the waited batch's end (`r`: done, failed, or timed out) in its series.
    pub(crate) fn record(self, r: &Result<()>) {
        self.series.record(
            crate::metrics::global(),
            self.bytes,
            self.slices,
            self.started.elapsed().as_secs_f64(),
            r.as_ref().map(|_| ()).map_err(|e| e.cause()),
        );
    }
}

/// Series of the kinds of batch seen last, by (path, peer name, op).
#[derive(Default)]
pub(crate) struct SeriesCache(Mutex<Vec<Arc<TransferSeries>>>);

/// Kinds of batch remembered at most (more start the cache afresh): an engine talks to a few
/// peers over one or two paths.
const SERIES_KEPT: usize = 32;

impl SeriesCache {
    /// The meter of a batch of `slices` slices of `requests` to `peer` on `path` (a metrics
    /// label) that started at `started`.
    pub(crate) fn start(
        &self,
        started: Instant,
        path: &'static str,
        peer: &str,
        requests: &[TransferRequest],
        slices: u32,
    ) -> BatchMeter {
        let op = requests.first().map(|r| r.op).unwrap_or(Op::Write);
        let bytes = requests.iter().fold(0u64, |a, r| a.saturating_add(r.len));
        self.start_with(started, path, peer, op, bytes, slices)
    }

    /// As `start`, for a batch of `bytes` whose first request is an `op`.
    pub(crate) fn start_with(
        &self,
        started: Instant,
        path: &'static str,
        peer: &str,
        op: Op,
        bytes: u64,
        slices: u32,
    ) -> BatchMeter {
        let op = match op {
            Op::Read => "read",
            Op::Write => "write",
        };
        BatchMeter {
            started,
            series: self.series(path, peer, op),
            bytes,
            slices,
        }
    }

    fn series(&self, path: &'static str, peer: &str, op: &'static str) -> Arc<TransferSeries> {
        let mut kept = self.0.locked();
        if let Some(s) = kept.iter().rev().find(|s| s.is(path, peer, op)) {
            return s.clone();
        }
        if kept.len() >= SERIES_KEPT {
            kept.clear();
        }
        let s = Arc::new(crate::metrics::global().transfer_series(path, peer, op));
        kept.push(s.clone());
        s
    }
}
