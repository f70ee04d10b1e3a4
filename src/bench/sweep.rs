//! One point of the sweep seen from the initiator: threads submitting batches of READ or
//! WRITE requests to the target's buffer for a while, their batch latencies, and the check
//! that every request's bytes landed in its slot (read back from the target, so that it
//! works when the target is another process on another host).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_checksum::definition::slice_checksum;
use kvferry_transfer::{Op, SegmentHandle, TransferEngine, TransferRequest};

use super::buffer::Buffer;
use super::types::BatchBounds;
use crate::cli::BenchPattern;
use crate::error::CliError;

/// Deadline of one batch (a stuck batch fails the point instead of hanging it).
const BATCH_DEADLINE: Duration = Duration::from_secs(60);

/// The initiator's view of one point: its engine, the opened target, its own buffer (the
/// source area `[0, need)` and the landing area `[need, 2 need)`) and the target's buffer.
pub struct Initiator<'a> {
    /// The initiator's engine.
    pub engine: &'a Arc<TransferEngine>,
    /// The target segment, opened (with a grant token where the target is authenticated).
    pub seg: &'a SegmentHandle,
    /// The initiator's registered buffer.
    pub local: &'a Buffer,
    /// Address of the target's buffer in the target's address space.
    pub remote: u64,
    /// Bytes of the source area (and of the landing area after it).
    pub need: u64,
}

/// The shape of a point.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// READ or WRITE.
    pub op: Op,
    /// Bytes per request.
    pub bs: u64,
    /// Requests per batch.
    pub batch: u64,
    /// Submitting threads.
    pub threads: u64,
    /// Where request i lands.
    pub pattern: BenchPattern,
}

impl Shape {
    /// The target slot of request i.
    fn slot(&self, i: u64) -> u64 {
        match self.pattern {
            BenchPattern::Contiguous => i,
            BenchPattern::Scattered => self.batch - 1 - i,
        }
    }

    /// Thread `t`'s requests: local offsets (source area for WRITE, landing area for READ)
    /// and remote offsets, in bytes from each buffer's start.
    fn requests(&self, t: u64, need: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let base = t * self.bs * self.batch;
        let local0 = match self.op {
            Op::Write => 0,
            Op::Read => need,
        };
        (0..self.batch).map(move |i| (local0 + base + i * self.bs, base + self.slot(i) * self.bs))
    }
}

/// What one run of a point measured.
pub struct Run {
    /// Throughput, GB/s (10^9 bytes).
    pub gb_per_s: f64,
    /// Every batch's latency, seconds.
    pub latencies: Vec<f64>,
    /// Seconds spent checksumming landed batches (with `--checksum`).
    pub checksum_secs: f64,
}

impl Initiator<'_> {
    fn submit_sync(&self, reqs: &[TransferRequest], what: &str) -> Result<(), CliError> {
        let id = self
            .engine
            .submit(self.seg, reqs)
            .map_err(CliError::transfer(format!("submitting {what}")))?;
        self.engine
            .wait(id, BATCH_DEADLINE)
            .map_err(CliError::transfer(format!("waiting for {what}")))
    }

    /// Readies the point: the landing area cleared and, for READ, the source area written to
    /// the target (so that what a READ brings back is known).
    pub fn prepare(&self, s: &Shape) -> Result<(), CliError> {
        let local = self.local;
        local.fill(self.need, self.need, 0)?;
        if s.op == Op::Read {
            let req = TransferRequest {
                op: Op::Write,
                local_addr: local.addr(),
                remote_addr: self.remote,
                len: self.need,
            };
            self.submit_sync(&[req], "the READ point's setup write")?;
        }
        Ok(())
    }

    /// Runs the point once: `threads` threads submit batches, bounded by `bounds` and
    /// `seconds`. With `checksum_over` (the landing memory as host bytes, offsets as the
    /// landing side's), every landed batch is checksummed on the CPU.
    pub fn run(
        &self,
        s: &Shape,
        seconds: f64,
        bounds: BatchBounds,
        checksum_over: Option<&[u8]>,
    ) -> Result<Run, CliError> {
        let (la, ra) = (self.local.addr(), self.remote);
        let stop = AtomicBool::new(false);
        // Threads done with their batches, so that a point bounded by count ends when they are.
        let finished = AtomicU64::new(0);
        let latencies = Mutex::new(Vec::<f64>::new());
        let checksum_secs = Mutex::new(0f64);
        let start = Instant::now();
        let result: Result<(), CliError> = std::thread::scope(|sc| {
            let mut handles = Vec::new();
            let mut refused = None;
            for t in 0..s.threads {
                let (stop, lat, cks, finished) = (&stop, &latencies, &checksum_secs, &finished);
                let run = move || -> Result<(), CliError> {
                    // Counted as finished however this thread ends (an error too).
                    struct Finished<'f>(&'f AtomicU64);
                    impl Drop for Finished<'_> {
                        fn drop(&mut self) {
                            self.0.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    let _finished = Finished(finished);
                    let reqs: Vec<TransferRequest> = s
                        .requests(t, self.need)
                        .map(|(l, r)| TransferRequest {
                            op: s.op,
                            local_addr: la + l,
                            remote_addr: ra + r,
                            len: s.bs,
                        })
                        .collect();
                    let landed = match s.op {
                        Op::Write => t * s.bs * s.batch,
                        Op::Read => self.need + t * s.bs * s.batch,
                    } as usize;
                    let mut done = 0u64;
                    while bounds.another(done, stop.load(Ordering::Relaxed)) {
                        done += 1;
                        let t0 = Instant::now();
                        self.submit_sync(&reqs, "a batch")?;
                        lat.lock().unwrap().push(t0.elapsed().as_secs_f64());
                        if let Some(bytes) = checksum_over {
                            let c0 = Instant::now();
                            let region = &bytes[landed..landed + (s.bs * s.batch) as usize];
                            let words: Vec<u64> = region
                                .chunks_exact(8)
                                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                                .collect();
                            std::hint::black_box(slice_checksum(&words, 0));
                            *cks.lock().unwrap() += c0.elapsed().as_secs_f64();
                        }
                    }
                    Ok(())
                };
                let thread = std::thread::Builder::new().name(format!("kvferry-bench-{t}"));
                match thread.spawn_scoped(sc, run) {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        // The threads started stop at once; the point fails with the OS's reason.
                        refused = Some(CliError::io(format!("starting bench thread {t}"))(e));
                        stop.store(true, Ordering::Relaxed);
                        break;
                    }
                }
            }
            let until = start + Duration::from_secs_f64(seconds);
            while refused.is_none()
                && Instant::now() < until
                && finished.load(Ordering::SeqCst) < s.threads
            {
                let left = until.saturating_duration_since(Instant::now());
                std::thread::sleep(left.min(Duration::from_millis(10)));
            }
            stop.store(true, Ordering::Relaxed);
            let joined = handles.into_iter().try_for_each(|h| {
                h.join()
                    .map_err(|_| CliError::failed("a bench thread panicked"))?
            });
            match refused {
                Some(e) => Err(e),
                None => joined,
            }
        });
        result?;
        let elapsed = start.elapsed().as_secs_f64();
        let latencies = latencies.into_inner().unwrap();
        if latencies.is_empty() {
            return Err(CliError::failed(format!(
                "block {} batch {}: no batch completed in {seconds} s",
                s.bs, s.batch
            )));
        }
        Ok(Run {
            gb_per_s: (latencies.len() as u64 * s.bs * s.batch) as f64 / elapsed / 1e9,
            latencies,
            checksum_secs: checksum_secs.into_inner().unwrap(),
        })
    }

    /// Checks that every request's bytes landed in its slot. WRITE: the target's slots are
    /// read back into the (cleared) landing area and compared with the source; READ: the
    /// landing area is compared with the source bytes the setup wrote to each request's slot.
    pub fn check(&self, s: &Shape) -> Result<(), CliError> {
        let local = self.local;
        if s.op == Op::Write {
            local.fill(self.need, self.need, 0)?;
            for t in 0..s.threads {
                let reqs: Vec<TransferRequest> = s
                    .requests(t, self.need)
                    .map(|(l, r)| TransferRequest {
                        op: Op::Read,
                        local_addr: local.addr() + self.need + l,
                        remote_addr: self.remote + r,
                        len: s.bs,
                    })
                    .collect();
                self.submit_sync(&reqs, "the read-back of the written slots")?;
            }
        }
        let src = local.read(0, self.need)?;
        let landed = local.read(self.need, self.need)?;
        for t in 0..s.threads {
            for (i, (l, r)) in s.requests(t, self.need).enumerate() {
                // WRITE: request i's source bytes, read back at the same local offset; READ:
                // the setup put source offset r in the target at r.
                let (want, got) = match s.op {
                    Op::Write => (l as usize, l as usize),
                    Op::Read => (r as usize, (l - self.need) as usize),
                };
                let n = s.bs as usize;
                if src[want..want + n] != landed[got..got + n] {
                    return Err(CliError::failed(format!(
                        "{:?} block {} batch {}: request {i} of thread {t} did not land intact",
                        s.op, s.bs, s.batch
                    )));
                }
            }
        }
        Ok(())
    }
}
