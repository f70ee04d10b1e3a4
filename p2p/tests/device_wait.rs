//! Device checksums are submitted and polled on the calling task (no blocking-pool hand-off):
//! their results equal the host path's, and a device that never finishes still ends the wait
//! at the checksum deadline. A stand-in backend plays the device (no GPU needed).

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Side;
use kvferry_checksum::select::BlockSelection;
use kvferry_kernels::{
    ChecksumBackend, CpuBackend, GroupJob, GroupResult, KernelError, Location, Pending,
    PendingChecksums,
};
use kvferry_p2p::checksum::{worker_record, ChecksumError};
use kvferry_p2p::WorkerGroup;

/// Pending work that reports "running" for `polls_left` polls, then the host results; or
/// never finishes (`None`).
struct Slow {
    results: Option<Result<Vec<GroupResult>, KernelError>>,
    polls_left: Option<u32>,
    polls: Arc<AtomicU32>,
}

impl Pending for Slow {
    fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>> {
        self.polls.fetch_add(1, Ordering::Relaxed);
        match self.polls_left.as_mut() {
            None => None,
            Some(0) => self.results.take(),
            Some(n) => {
                *n -= 1;
                None
            }
        }
    }
    fn wait(&mut self, _timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        unreachable!("device checksums are polled, never waited for on a thread")
    }
}

/// A "device" backend: jobs for `cuda:0` computed by the CPU backend on host memory, handed
/// back after some polls (or never).
struct FakeDevice {
    polls_left: Option<u32>,
    polls: Arc<AtomicU32>,
}

impl ChecksumBackend for FakeDevice {
    fn name(&self) -> &'static str {
        "fake-device"
    }
    unsafe fn submit(&self, jobs: Vec<GroupJob>) -> Result<PendingChecksums, KernelError> {
        let host: Vec<GroupJob> = jobs
            .into_iter()
            .map(|mut j| {
                assert_eq!(j.device, Location::Cuda(0));
                j.device = Location::Cpu;
                j
            })
            .collect();
        // A device that never finishes computes nothing.
        let results = match self.polls_left {
            Some(_) => {
                // SAFETY: forwarded from this function's contract (the test's host arrays).
                let pending = unsafe { CpuBackend::new(1).submit(host) }?;
                Some(pending.wait(Duration::from_secs(10)))
            }
            // A device that never finishes computes nothing.
            None => None,
        };
        Ok(PendingChecksums::new(Box::new(Slow {
            results,
            polls_left: self.polls_left,
            polls: self.polls.clone(),
        })))
    }
}

fn select_all(_: &WorkerGroup) -> Option<BlockSelection> {
    Some(BlockSelection {
        block_ids: vec![0, 1, 2],
        start: 0,
    })
}

#[tokio::test]
async fn device_results_equal_host_results() {
    let side = Side::new(1, 1, 8, Some(3));
    let host = worker_record(
        &side.workers[0],
        &select_all,
        40,
        Duration::from_secs(5),
        None,
    )
    .await
    .unwrap();
    let polls = Arc::new(AtomicU32::new(0));
    let mut device = side.workers[0].clone();
    device.device = Location::Cuda(0);
    device.backend = Arc::new(FakeDevice {
        polls_left: Some(50),
        polls: polls.clone(),
    });
    let rec = worker_record(&device, &select_all, 40, Duration::from_secs(5), None)
        .await
        .unwrap();
    assert_eq!(rec, host);
    assert!(!rec.groups.is_empty());
    assert_eq!(polls.load(Ordering::Relaxed), 51, "polled until done");
}

#[tokio::test]
async fn a_device_that_never_finishes_fails_at_the_deadline() {
    let side = Side::new(1, 1, 8, Some(3));
    let mut device = side.workers[0].clone();
    device.device = Location::Cuda(0);
    let polls = Arc::new(AtomicU32::new(0));
    device.backend = Arc::new(FakeDevice {
        polls_left: None,
        polls: polls.clone(),
    });
    let timeout = Duration::from_millis(100);
    let t0 = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        worker_record(&device, &select_all, 40, timeout, None),
    )
    .await
    .expect("the wait has a deadline");
    assert!(
        matches!(r, Err(ChecksumError::Timeout(t)) if t == timeout),
        "{r:?}"
    );
    assert!(t0.elapsed() >= timeout);
    assert!(polls.load(Ordering::Relaxed) > 1);
}
