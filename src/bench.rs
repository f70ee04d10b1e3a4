//! `kvferry bench`: transfer throughput sweep in the manner of Mooncake's
//! tebench (block size × batch × threads; GB/s, average and p99 batch latency),
//! between two transfer engines on this host (loopback TCP, or one RDMA device in
//! loopback). Optionally checksums every landed batch to show the overhead.
//!
//! Source: docs/design.md §6, docs/design.md §9 (tebench's columns).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_checksum::definition::slice_checksum;
use kvferry_transfer::{
    EngineConfig, GrantOps, GrantSpec, Location, Op, Token, TransferEngine, TransferRequest,
};
use memmap2::MmapMut;
use serde::Serialize;

use crate::cli::{parse_sizes, BenchArgs, BenchPattern};
use crate::error::CliError;
use crate::setup::transport_kind;

/// One point of the sweep.
#[derive(Debug, Clone, Serialize)]
pub struct BenchPoint {
    /// Bytes per request.
    pub block_size: u64,
    /// Requests per batch.
    pub batch: u64,
    /// Submitting threads.
    pub threads: u64,
    /// `contiguous` or `scattered` (`--pattern`).
    pub pattern: String,
    /// Throughput, GB/s (10^9 bytes).
    pub gb_per_s: f64,
    /// Mean batch latency, microseconds.
    pub avg_latency_us: f64,
    /// 99th percentile batch latency, microseconds.
    pub p99_latency_us: f64,
    /// Batches completed.
    pub batches: u64,
    /// With `--checksum`: checksum seconds per transfer second.
    pub checksum_overhead: Option<f64>,
}

/// The whole sweep's result.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Transport used.
    pub transport: String,
    /// Points of the sweep.
    pub points: Vec<BenchPoint>,
}

/// Runs the sweep and prints/writes the results.
///
/// Errors: bad arguments, engines that cannot start, a failed transfer.
pub fn run(args: &BenchArgs) -> Result<(), CliError> {
    // Fail before the sweep, not after it, when an output file cannot be written.
    for p in [&args.json_out, &args.csv_out].into_iter().flatten() {
        std::fs::File::create(p).map_err(CliError::io(format!("cannot write {}", p.display())))?;
    }
    let report = run_report(args)?;
    if let Some(p) = &args.json_out {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .map_err(CliError::io(format!("writing {}", p.display())))?;
    }
    if let Some(p) = &args.csv_out {
        let mut csv = String::from("transport,block_size,batch,threads,pattern,gb_per_s,avg_latency_us,p99_latency_us,batches,checksum_overhead\n");
        for pt in &report.points {
            csv += &format!(
                "{},{},{},{},{},{:.4},{:.1},{:.1},{},{}\n",
                report.transport,
                pt.block_size,
                pt.batch,
                pt.threads,
                pt.pattern,
                pt.gb_per_s,
                pt.avg_latency_us,
                pt.p99_latency_us,
                pt.batches,
                pt.checksum_overhead
                    .map(|v| format!("{v:.4}"))
                    .unwrap_or_default()
            );
        }
        std::fs::write(p, csv).map_err(CliError::io(format!("writing {}", p.display())))?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("transport {}", report.transport);
        println!(
            "{:>10} {:>6} {:>7} {:>10} {:>12} {:>12} {:>9}",
            "block", "batch", "threads", "GB/s", "avg lat us", "p99 lat us", "cksum/xfer"
        );
        for p in &report.points {
            println!(
                "{:>10} {:>6} {:>7} {:>10.3} {:>12.1} {:>12.1} {:>9}",
                p.block_size,
                p.batch,
                p.threads,
                p.gb_per_s,
                p.avg_latency_us,
                p.p99_latency_us,
                p.checksum_overhead
                    .map(|v| format!("{v:.3}"))
                    .unwrap_or_else(|| "-".into())
            );
        }
    }
    Ok(())
}

/// Runs the sweep and returns the results.
pub fn run_report(args: &BenchArgs) -> Result<BenchReport, CliError> {
    let sizes_of = |flag: &'static str, text: &str| {
        parse_sizes(text).map_err(|source| CliError::Sizes { flag, source })
    };
    let sizes = sizes_of("--block-sizes", &args.block_sizes)?;
    let batches = sizes_of("--batch", &args.batch)?;
    let threads = sizes_of("--threads", &args.threads)?;
    if !(args.seconds > 0.0 && args.seconds.is_finite()) {
        return Err(CliError::usage(format!(
            "--seconds {}: must be a positive number",
            args.seconds
        )));
    }
    let bounds = BatchBounds::new(args.min_batches, args.max_batches)?;
    let mut cfg = EngineConfig {
        transport: transport_kind(args.transport),
        ..EngineConfig::default()
    };
    cfg.auth.secret_file = args.secret_file.clone();
    let src_engine = TransferEngine::new(cfg.clone())
        .map_err(CliError::transfer("starting the source engine"))?;
    let dst_engine =
        TransferEngine::new(cfg).map_err(CliError::transfer("starting the target engine"))?;
    let transport = src_engine.transport_name().to_string();
    let mut points = Vec::new();
    for &bs in &sizes {
        for &batch in &batches {
            for &nthreads in &threads {
                let per_thread = bs
                    .checked_mul(batch)
                    .ok_or(CliError::usage("block size × batch overflows"))?;
                let total = per_thread.checked_mul(nthreads).filter(|&t| t <= 8 << 30).ok_or_else(|| {
                    CliError::usage(format!("block {bs} × batch {batch} × threads {nthreads}: more than 8 GiB of buffers"))
                })?;
                let mut src = MmapMut::map_anon(total as usize)
                    .map_err(CliError::io(format!("allocating {total} bytes")))?;
                let dst = MmapMut::map_anon(total as usize)
                    .map_err(CliError::io(format!("allocating {total} bytes")))?;
                for (i, b) in src.iter_mut().enumerate() {
                    *b = (i as u8).wrapping_mul(31) ^ (i >> 12) as u8;
                }
                let (sa, da) = (src.as_ptr() as u64, dst.as_ptr() as u64);
                // SAFETY: both maps outlive the registrations (unregistered below before they drop).
                unsafe {
                    src_engine
                        .register_memory(sa, total, Location::Cpu)
                        .map_err(CliError::transfer("registering the source buffer"))?;
                    dst_engine
                        .register_memory(da, total, Location::Cpu)
                        .map_err(CliError::transfer("registering the target buffer"))?;
                }
                // Authenticated: the source writes with a token the target granted for its buffer.
                let grant = dst_engine
                    .grant(GrantSpec {
                        token: Token::random().map_err(CliError::transfer("a grant token"))?,
                        ops: GrantOps::WRITE,
                        ranges: vec![(da, total)],
                        ttl: Duration::from_secs(24 * 3600),
                    })
                    .map_err(CliError::transfer("granting the target buffer"))?;
                let point = sweep_point(
                    &src_engine,
                    (&dst_engine.segment_name(), grant.token()),
                    (&src, &dst),
                    bs,
                    batch,
                    nthreads,
                    args.seconds,
                    bounds,
                    args.pattern,
                    args.checksum,
                );
                let _ = src_engine.unregister_memory(sa);
                let _ = dst_engine.unregister_memory(da);
                points.push(point?);
            }
        }
    }
    Ok(BenchReport { transport, points })
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

#[allow(clippy::too_many_arguments)]
fn sweep_point(
    engine: &Arc<TransferEngine>,
    (target, token): (&str, Token),
    (src_map, dst_map): (&MmapMut, &MmapMut),
    bs: u64,
    batch: u64,
    threads: u64,
    seconds: f64,
    bounds: BatchBounds,
    pattern: BenchPattern,
    checksum: bool,
) -> Result<BenchPoint, CliError> {
    let (src, dst) = (src_map.as_ptr() as u64, dst_map.as_ptr() as u64);
    // The target slot of request i.
    let slot = move |i: u64| match pattern {
        BenchPattern::Contiguous => i,
        BenchPattern::Scattered => batch - 1 - i,
    };
    let checksum_over = checksum.then_some(dst_map);
    let seg = engine
        .open_segment_with_token(target, token)
        .map_err(CliError::transfer(format!("opening segment {target}")))?;
    let stop = Arc::new(AtomicBool::new(false));
    // Threads done with their batches, so that a point bounded by count ends when they are.
    let finished = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Vec::<f64>::new()));
    let checksum_secs = Arc::new(Mutex::new(0f64));
    let dst_bytes: Option<&[u8]> = checksum_over.map(|m| &m[..]);
    let start = Instant::now();
    let result: Result<(), CliError> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for t in 0..threads {
            let (stop, lat, seg, cks, finished) = (
                stop.clone(),
                latencies.clone(),
                seg.clone(),
                checksum_secs.clone(),
                finished.clone(),
            );
            handles.push(s.spawn(move || -> Result<(), CliError> {
                // Counted as finished however this thread ends (an error too).
                struct Finished(Arc<AtomicU64>);
                impl Drop for Finished {
                    fn drop(&mut self) {
                        self.0.fetch_add(1, Ordering::SeqCst);
                    }
                }
                let _finished = Finished(finished);
                let mut done = 0u64;
                let base = t * bs * batch;
                let reqs: Vec<TransferRequest> = (0..batch)
                    .map(|i| TransferRequest {
                        op: Op::Write,
                        local_addr: src + base + i * bs,
                        remote_addr: dst + base + slot(i) * bs,
                        len: bs,
                    })
                    .collect();
                while bounds.another(done, stop.load(Ordering::Relaxed)) {
                    done += 1;
                    let t0 = Instant::now();
                    let id = engine
                        .submit(&seg, &reqs)
                        .map_err(CliError::transfer("submitting a batch"))?;
                    engine
                        .wait(id, Duration::from_secs(60))
                        .map_err(CliError::transfer("waiting for a batch"))?;
                    lat.lock().unwrap().push(t0.elapsed().as_secs_f64());
                    if let Some(bytes) = dst_bytes {
                        let c0 = Instant::now();
                        let region = &bytes[base as usize..(base + bs * batch) as usize];
                        let words: Vec<u64> = region
                            .chunks_exact(8)
                            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                            .collect();
                        std::hint::black_box(slice_checksum(&words, 0));
                        *cks.lock().unwrap() += c0.elapsed().as_secs_f64();
                    }
                }
                Ok(())
            }));
        }
        let until = start + Duration::from_secs_f64(seconds);
        while Instant::now() < until && finished.load(Ordering::SeqCst) < threads {
            let left = until.saturating_duration_since(Instant::now());
            std::thread::sleep(left.min(Duration::from_millis(10)));
        }
        stop.store(true, Ordering::Relaxed);
        handles.into_iter().try_for_each(|h| {
            h.join()
                .map_err(|_| CliError::failed("a bench thread panicked"))?
        })
    });
    result?;
    let elapsed = start.elapsed().as_secs_f64();
    let mut lat = latencies.lock().unwrap().clone();
    lat.sort_by(|a, b| a.total_cmp(b));
    let n = lat.len() as u64;
    if n == 0 {
        return Err(CliError::failed(format!(
            "block {bs} batch {batch}: no batch completed in {seconds} s"
        )));
    }
    let xfer_secs: f64 = lat.iter().sum();
    let p99 = lat[((lat.len() as f64 * 0.99).ceil() as usize)
        .saturating_sub(1)
        .min(lat.len() - 1)];
    let cks = *checksum_secs.lock().unwrap();
    // Every request's bytes must have landed in its slot (the source never changes).
    for t in 0..threads {
        let base = t * bs * batch;
        for i in 0..batch {
            let (s0, d0) = ((base + i * bs) as usize, (base + slot(i) * bs) as usize);
            if src_map[s0..s0 + bs as usize] != dst_map[d0..d0 + bs as usize] {
                return Err(CliError::failed(format!(
                    "block {bs} batch {batch}: request {i} of thread {t} did not land intact"
                )));
            }
        }
    }
    Ok(BenchPoint {
        block_size: bs,
        batch,
        threads,
        pattern: match pattern {
            BenchPattern::Contiguous => "contiguous",
            BenchPattern::Scattered => "scattered",
        }
        .to_string(),
        gb_per_s: (n * bs * batch) as f64 / elapsed / 1e9,
        avg_latency_us: xfer_secs / n as f64 * 1e6,
        p99_latency_us: p99 * 1e6,
        batches: n,
        checksum_overhead: checksum_over.map(|_| cks / xfer_secs),
    })
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
