//! `kvferry bench`: transfer throughput sweep in the manner of Mooncake's tebench and
//! `transfer_engine_bench` (block size × batch × threads, READ and WRITE, host or GPU memory;
//! GB/s with median and spread over repeats, average, p99 and p999 batch latency).
//!
//! Three modes: `loopback` (the default: target and initiator engines in this process),
//! `target` (serve one registered buffer until killed) and `initiator` (sweep against a target
//! in another process, on this host or another). Both forms run the same initiator code, so
//! their numbers compare. Optionally checksums every landed batch to show the overhead.
//!
//! Source: docs/design.md §6, docs/design.md §9 (tebench's columns).

mod buffer;
mod plot;
mod sweep;
mod target;
mod types;

pub use target::derived_token;
pub use types::{BatchBounds, BenchPoint, BenchReport};

use kvferry_transfer::{EngineConfig, Op, RdmaConfig};

use crate::cli::{parse_sizes, BenchArgs, BenchMode, BenchOp, BenchPattern, DeviceArg};
use crate::error::CliError;
use crate::setup::{gpu_registration, local_addr_towards, transport_kind};
use buffer::Buffer;
use sweep::{Initiator, Shape};
use target::Target;
use types::location;

/// Runs the sweep (or the target) and prints/writes the results.
///
/// Errors: bad arguments, engines that cannot start, a failed transfer.
pub fn run(args: &BenchArgs) -> Result<(), CliError> {
    if args.mode == BenchMode::Target {
        let len = one_size("--buffer-size", &args.buffer_size)?;
        return target::serve(
            args,
            engine_config(args, "--listen", args.listen.as_deref())?,
            len,
        );
    }
    // Fail before the sweep, not after it, when an output file cannot be written.
    let plot = args.plot.clone().or_else(|| {
        let beside = args.json_out.as_ref().or(args.csv_out.as_ref())?;
        Some(beside.with_extension("svg"))
    });
    for p in [&args.json_out, &args.csv_out, &plot].into_iter().flatten() {
        std::fs::File::create(p).map_err(CliError::io(format!("cannot write {}", p.display())))?;
    }
    let report = run_report(args)?;
    if let Some(p) = &args.json_out {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .map_err(CliError::io(format!("writing {}", p.display())))?;
    }
    if let Some(p) = &args.csv_out {
        std::fs::write(p, csv(&report))
            .map_err(CliError::io(format!("writing {}", p.display())))?;
    }
    if let Some(p) = &plot {
        plot::write(&report, p)?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", table(&report));
        if let Some(p) = &plot {
            println!("plot: {}", p.display());
        }
    }
    Ok(())
}

fn csv(report: &BenchReport) -> String {
    let mut csv = String::from("transport,mode,device,op,block_size,batch,threads,pattern,path,gb_per_s,spread_pct,avg_latency_us,p99_latency_us,p999_latency_us,batches,checksum_overhead\n");
    for p in &report.points {
        csv += &format!(
            "{},{},{},{},{},{},{},{},{},{:.4},{:.1},{:.1},{:.1},{:.1},{},{}\n",
            report.transport,
            report.mode,
            report.device,
            p.op,
            p.block_size,
            p.batch,
            p.threads,
            p.pattern,
            p.path,
            p.gb_per_s,
            p.spread_pct,
            p.avg_latency_us,
            p.p99_latency_us,
            p.p999_latency_us,
            p.batches,
            p.checksum_overhead
                .map(|v| format!("{v:.4}"))
                .unwrap_or_default()
        );
    }
    csv
}

fn table(report: &BenchReport) -> String {
    let mut out = format!(
        "transport {} mode {} device {} repeats {}\n{:>5} {:>10} {:>6} {:>7} {:>8} {:>10} {:>8} {:>11} {:>11} {:>11} {:>9}\n",
        report.transport, report.mode, report.device, report.repeats,
        "op", "block", "batch", "threads", "path", "GB/s", "spread%", "avg lat us", "p99 lat us",
        "p999 lat us", "cksum/xfer"
    );
    for p in &report.points {
        out += &format!(
            "{:>5} {:>10} {:>6} {:>7} {:>8} {:>10.3} {:>8.1} {:>11.1} {:>11.1} {:>11.1} {:>9}\n",
            p.op,
            p.block_size,
            p.batch,
            p.threads,
            p.path,
            p.gb_per_s,
            p.spread_pct,
            p.avg_latency_us,
            p.p99_latency_us,
            p.p999_latency_us,
            p.checksum_overhead
                .map(|v| format!("{v:.3}"))
                .unwrap_or_else(|| "-".into())
        );
    }
    out
}

fn one_size(flag: &'static str, text: &str) -> Result<u64, CliError> {
    match parse_sizes(text).map_err(|source| CliError::Sizes { flag, source })?[..] {
        [v] => Ok(v),
        _ => Err(CliError::usage(format!(
            "{flag} {text}: one size, not a list"
        ))),
    }
}

/// The engine configuration of either side: `listen` as `HOST:PORT` (port 0 or none: one the
/// OS picks; `flag` names the option it came from), the transport, NICs, GID index, GPU
/// registration and the shared secret. Errors: `Usage` for no port or an unspecified host,
/// `Port` for a port that is not a `u16`.
fn engine_config(
    args: &BenchArgs,
    flag: &'static str,
    listen: Option<&str>,
) -> Result<EngineConfig, CliError> {
    let (host, port) = match listen {
        Some(a) => {
            let a = a.strip_prefix("tcp://").unwrap_or(a);
            let (h, p) = a
                .rsplit_once(':')
                .ok_or_else(|| CliError::usage(format!("{a}: expected HOST:PORT")))?;
            let port: u16 = p.parse().map_err(|source| CliError::Port {
                flag,
                addr: a.to_string(),
                source,
            })?;
            (h.trim_matches(|c| c == '[' || c == ']').to_string(), port)
        }
        None => ("127.0.0.1".to_string(), 0),
    };
    if host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
    {
        return Err(CliError::usage(format!(
            "{host}: the engines need an address the other side can reach, not an unspecified one"
        )));
    }
    let mut cfg = EngineConfig {
        host,
        port,
        transport: transport_kind(args.transport),
        cuda_ipc: crate::setup::cuda_ipc_mode(args.transport),
        rdma: RdmaConfig {
            devices: args.nic.clone(),
            gid_index: args.gid_index,
            gpu_registration: gpu_registration(args.gpu_registration),
            ..RdmaConfig::default()
        },
        ..EngineConfig::default()
    };
    cfg.auth.secret_file = args.secret_file.clone();
    if let Some(n) = args.qps_per_endpoint {
        cfg.rdma.qps_per_endpoint = n as usize;
    }
    if let Some(n) = args.merge_bytes {
        cfg.rdma.merge_bytes = n;
    }
    if let Some(n) = args.post_chain {
        cfg.rdma.post_chain = n as usize;
    }
    Ok(cfg)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The nearest-rank percentile `q` (0..1] of sorted `v` (not empty).
fn percentile(v: &[f64], q: f64) -> f64 {
    v[((v.len() as f64 * q).ceil() as usize)
        .saturating_sub(1)
        .min(v.len() - 1)]
}

/// Runs the sweep (loopback or initiator mode) and returns the results.
///
/// Errors: bad arguments, no target given in initiator mode, a target buffer too small for the
/// largest point, engines that cannot start, a failed transfer or a request that did not land
/// intact.
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
    let mut need = 0u64;
    for &bs in &sizes {
        for &batch in &batches {
            for &nthreads in &threads {
                let total = bs
                    .checked_mul(batch)
                    .and_then(|v| v.checked_mul(nthreads))
                    .filter(|&t| t <= 8 << 30)
                    .ok_or_else(|| {
                        CliError::usage(format!("block {bs} × batch {batch} × threads {nthreads}: more than 8 GiB of buffers"))
                    })?;
                need = need.max(total);
            }
        }
    }
    let ops: Vec<Op> = args
        .op
        .iter()
        .map(|o| match o {
            BenchOp::Write => Op::Write,
            BenchOp::Read => Op::Read,
        })
        .collect();
    // The loopback form's target lives here; in initiator mode, in another process.
    let (loopback, target_name) = match args.mode {
        BenchMode::Loopback => {
            let t = Target::start(engine_config(args, "--listen", None)?, need, args, None)?;
            let name = t.engine.segment_name();
            (Some(t), name)
        }
        _ => {
            let name = args.target.clone().ok_or_else(|| {
                CliError::usage(
                    "--mode initiator needs --target HOST:PORT (the segment the target printed)",
                )
            })?;
            (None, name)
        }
    };
    if args.checksum && args.device == DeviceArg::Cuda {
        return Err(CliError::usage(
            "--checksum checksums on the CPU: use it with --device cpu",
        ));
    }
    let listen = match (&loopback, &args.data_host) {
        (_, Some(h)) => Some(format!("{h}:0")),
        (None, None) => local_addr_towards(&target_name).map(|h| format!("{h}:0")),
        (Some(_), None) => None,
    };
    let engine = kvferry_transfer::TransferEngine::new(engine_config(
        args,
        "--data-host",
        listen.as_deref(),
    )?)
    .map_err(CliError::transfer("starting the initiator engine"))?;
    let token = match (&loopback, engine.secret()) {
        (Some(t), _) => t.token,
        (None, Some(s)) => Some(derived_token(s, &target_name)),
        (None, None) => None,
    };
    let seg = match token {
        Some(tok) => engine.open_segment_with_token(&target_name, tok),
        None => engine.open_segment(&target_name),
    }
    .map_err(CliError::transfer(format!("opening segment {target_name}")))?;
    let remote = seg
        .descriptor()
        .buffers
        .iter()
        .max_by_key(|b| b.region.len)
        .map(|b| (b.region.addr, b.region.len))
        .ok_or_else(|| CliError::failed(format!("segment {target_name} registered no buffer")))?;
    if remote.1 < need {
        return Err(CliError::usage(format!(
            "the target's buffer holds {} bytes; the largest point needs {need} (block × batch × threads): start the target with a larger --buffer-size",
            remote.1
        )));
    }
    let local = Buffer::new(location(args), 2 * need)?;
    local.fill_pattern(0, need)?;
    // SAFETY: `local` outlives its registration: unregistered below before it drops.
    unsafe { engine.register_memory(local.addr(), local.len(), local.location()) }
        .map_err(CliError::transfer("registering the initiator buffer"))?;
    let result = (|| -> Result<Vec<BenchPoint>, CliError> {
        let init = Initiator {
            engine: &engine,
            seg: &seg,
            local: &local,
            remote: remote.0,
            need,
        };
        let path = engine
            .transfer_path(&seg, local.addr(), remote.0)
            .map_err(CliError::transfer("the transfer path"))?
            .to_string();
        let mut points = Vec::new();
        for &op in &ops {
            for &bs in &sizes {
                for &batch in &batches {
                    for &nthreads in &threads {
                        let shape = Shape {
                            op,
                            bs,
                            batch,
                            threads: nthreads,
                            pattern: args.pattern,
                        };
                        let checksum_over = match (args.checksum, op) {
                            (false, _) => None,
                            (true, Op::Read) => local.host_bytes(),
                            (true, Op::Write) => Some(
                                loopback
                                    .as_ref()
                                    .and_then(|t| t.buffer.host_bytes())
                                    .ok_or_else(|| CliError::usage("--checksum of WRITE needs the landed bytes in this process: use the loopback form or --op read"))?,
                            ),
                        };
                        points.push(point(&init, &shape, args, bounds, checksum_over, &path)?);
                    }
                }
            }
        }
        Ok(points)
    })();
    let _ = engine.unregister_memory(local.addr());
    let points = result?;
    Ok(BenchReport {
        transport: engine.transport_name().to_string(),
        mode: match args.mode {
            BenchMode::Loopback => "loopback",
            _ => "initiator",
        }
        .to_string(),
        device: location(args).to_string(),
        repeats: args.repeats,
        points,
    })
}

fn point(
    init: &Initiator<'_>,
    s: &Shape,
    args: &BenchArgs,
    bounds: BatchBounds,
    checksum_over: Option<&[u8]>,
    path: &str,
) -> Result<BenchPoint, CliError> {
    init.prepare(s)?;
    let mut runs = Vec::new();
    let mut lat = Vec::new();
    let mut cks = 0.0;
    for _ in 0..args.repeats {
        let r = init.run(s, args.seconds, bounds, checksum_over)?;
        runs.push(r.gb_per_s);
        lat.extend(r.latencies);
        cks += r.checksum_secs;
    }
    init.check(s)?;
    lat.sort_by(|a, b| a.total_cmp(b));
    let xfer_secs: f64 = lat.iter().sum();
    let med = median(&runs);
    let (lo, hi) = runs
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    Ok(BenchPoint {
        op: match s.op {
            Op::Write => "write",
            Op::Read => "read",
        }
        .to_string(),
        block_size: s.bs,
        batch: s.batch,
        threads: s.threads,
        pattern: match s.pattern {
            BenchPattern::Contiguous => "contiguous",
            BenchPattern::Scattered => "scattered",
        }
        .to_string(),
        path: path.to_string(),
        gb_per_s: med,
        spread_pct: if med > 0.0 {
            (hi - lo) / med * 100.0
        } else {
            0.0
        },
        gb_per_s_runs: runs,
        avg_latency_us: xfer_secs / lat.len() as f64 * 1e6,
        p99_latency_us: percentile(&lat, 0.99) * 1e6,
        p999_latency_us: percentile(&lat, 0.999) * 1e6,
        batches: lat.len() as u64,
        checksum_overhead: checksum_over.map(|_| cks / xfer_secs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::IntErrorKind;

    fn bench_args() -> BenchArgs {
        use clap::Parser;
        match crate::cli::Cli::try_parse_from(["kvferry", "bench"])
            .unwrap()
            .command
        {
            crate::cli::Command::Bench(b) => b,
            _ => unreachable!("`kvferry bench` parses as the bench command"),
        }
    }

    #[test]
    fn a_bad_port_keeps_its_parse_error_and_names_the_flag() {
        let args = bench_args();
        for (port, kind) in [
            ("70000", IntErrorKind::PosOverflow),
            ("x1", IntErrorKind::InvalidDigit),
            ("", IntErrorKind::Empty),
        ] {
            let addr = format!("127.0.0.1:{port}");
            match engine_config(&args, "--data-host", Some(&addr)) {
                Err(CliError::Port {
                    flag,
                    addr: a,
                    source,
                }) => {
                    assert_eq!(flag, "--data-host");
                    assert_eq!(a, addr);
                    assert_eq!(source.kind(), &kind);
                }
                other => panic!("{addr}: {other:?}"),
            }
        }
        let e = engine_config(&args, "--listen", Some("127.0.0.1:70000")).unwrap_err();
        let source = std::error::Error::source(&e).expect("the parse error as the source");
        assert!(source.is::<std::num::ParseIntError>());
        assert!(e
            .to_string()
            .starts_with("--listen 127.0.0.1:70000: bad port"));
        assert_eq!(
            engine_config(&args, "--listen", Some("127.0.0.1:7000"))
                .unwrap()
                .port,
            7000
        );
    }
}
