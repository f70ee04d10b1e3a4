//! What the bench's parts share: the report's shapes, the batch bounds of a point and where
//! the buffers live.

use kvferry_transfer::Location;
use serde::Serialize;

use crate::cli::{BenchArgs, DeviceArg};
use crate::error::CliError;

/// One point of the sweep.
#[derive(Debug, Clone, Serialize)]
pub struct BenchPoint {
    /// `write` or `read`, seen from the initiator.
    pub op: String,
    /// Bytes per request.
    pub block_size: u64,
    /// Requests per batch.
    pub batch: u64,
    /// Submitting threads.
    pub threads: u64,
    /// `contiguous` or `scattered` (`--pattern`).
    pub pattern: String,
    /// The path the transfers took (`tcp`, `rdma`, `cuda-ipc`).
    pub path: String,
    /// Throughput, GB/s (10^9 bytes): the median over the repeats.
    pub gb_per_s: f64,
    /// Throughput of each repeat, GB/s, in run order.
    pub gb_per_s_runs: Vec<f64>,
    /// (max - min) / median of the repeats' throughput, percent (0 with one repeat).
    pub spread_pct: f64,
    /// Mean batch latency over every batch of every repeat, microseconds.
    pub avg_latency_us: f64,
    /// 99th percentile batch latency, microseconds.
    pub p99_latency_us: f64,
    /// 99.9th percentile batch latency, microseconds.
    pub p999_latency_us: f64,
    /// Batches completed, all threads and repeats.
    pub batches: u64,
    /// With `--checksum`: checksum seconds per transfer second.
    pub checksum_overhead: Option<f64>,
}

/// The whole sweep's result.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Transport used.
    pub transport: String,
    /// `loopback` (one process) or `initiator` (against a target process).
    pub mode: String,
    /// Where both buffers live (`cpu`, `cuda:N`).
    pub device: String,
    /// Repeats per point.
    pub repeats: u32,
    /// Points of the sweep.
    pub points: Vec<BenchPoint>,
}

/// Where the bench's buffers live.
pub fn location(args: &BenchArgs) -> Location {
    match args.device {
        DeviceArg::Cpu => Location::Cpu,
        DeviceArg::Cuda => Location::Cuda(args.gpu),
    }
}

/// How many batches each thread of a point runs: at least `min`, at most `max` (0: no
/// bound), and no new one after the point's seconds once `min` are done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchBounds {
    min: u64,
    max: u64,
}

impl BatchBounds {
    /// Errors: `min` of 0, or a `max` (other than 0) below `min`.
    pub fn new(min: u64, max: u64) -> Result<BatchBounds, CliError> {
        if min == 0 {
            return Err(CliError::usage("--min-batches must be at least 1"));
        }
        if max != 0 && max < min {
            return Err(CliError::usage(format!(
                "--max-batches {max} is below --min-batches {min}"
            )));
        }
        Ok(BatchBounds { min, max })
    }

    /// Whether a thread that has completed `done` batches starts another; `time_up` once the
    /// point's seconds have passed.
    pub fn another(&self, done: u64, time_up: bool) -> bool {
        if self.max != 0 && done >= self.max {
            return false;
        }
        done < self.min || !time_up
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_bounds_take_the_count_over_the_clock() {
        let b = BatchBounds::new(3, 0).unwrap();
        assert!(
            b.another(2, true),
            "below the minimum, time does not stop a point"
        );
        assert!(!b.another(3, true));
        assert!(b.another(3, false), "no maximum: the clock decides");
        let b = BatchBounds::new(1, 4).unwrap();
        assert!(
            !b.another(4, false),
            "the maximum ends a point before its seconds"
        );
        assert!(b.another(3, false));
        assert!(BatchBounds::new(0, 0).is_err());
        assert!(BatchBounds::new(5, 2).is_err());
    }
}
