//! Host work per request on the engine's submit path, over the TCP transport on loopback (runs
//! without a GPU): N small WRITE requests in one batch, `submit` timed alone and `submit` +
//! `wait` (completion) timed together, as ns per request. Compare two builds by running them
//! side by side (A B A B) and taking the ratio of their medians; the absolute figures depend on
//! the machine.
//!
//! `cargo run --release -p kvferry-transfer --example submit_cost -- [requests] [request_bytes] [rounds]`
//! (defaults 16384, 1024, 20). Requests are every other `request_bytes` of the source and
//! target buffers, so no two are adjacent.

use std::time::{Duration, Instant};

use kvferry_transfer::{EngineConfig, Op, TransferRequest, TransportKind};

mod support;
use support::EnginePair;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n = args.first().copied().unwrap_or(16384).max(1);
    let len = args.get(1).copied().unwrap_or(1024).max(1);
    let rounds = args.get(2).copied().unwrap_or(20).max(1);
    let size = (2 * n * len) as usize;
    let cfg = EngineConfig {
        transport: TransportKind::Tcp,
        ..EngineConfig::default()
    };
    let pair = EnginePair::new(cfg, size);
    let (a, seg) = (&pair.a, &pair.seg);
    let reqs: Vec<TransferRequest> = (0..n)
        .map(|i| TransferRequest {
            op: Op::Write,
            local_addr: pair.src_addr(2 * i * len),
            remote_addr: pair.dst_addr(2 * i * len),
            len,
        })
        .collect();
    let (mut submit_ns, mut total_ns) = (Vec::new(), Vec::new());
    for round in 0..=rounds {
        let t = Instant::now();
        let id = a.submit(seg, &reqs).unwrap();
        let s = t.elapsed();
        a.wait(id, Duration::from_secs(60)).unwrap();
        let w = t.elapsed();
        if round > 0 {
            // round 0 warms connections and caches
            submit_ns.push(s.as_nanos() as f64 / n as f64);
            total_ns.push(w.as_nanos() as f64 / n as f64);
        }
    }
    assert_eq!(pair.src[..len as usize], pair.dst[..len as usize]);
    println!(
        "requests {n} of {len} B, {rounds} rounds: submit {:.1} ns/request, submit+completion {:.1} ns/request (medians)",
        median(&mut submit_ns),
        median(&mut total_ns)
    );
}
