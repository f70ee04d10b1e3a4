//! Loopback throughput of the TCP transport, as a ratio to plain TCP on the same machine in the
//! same run (the baseline: one socket, `write_all` of the same bytes, reader discarding them).
//!
//! `cargo run --release -p kvferry-transfer --example loopback -- [total_MiB] [request_KiB] [batch] [slice_KiB] [connections]`
//! Prints GB/s of engine WRITE, engine READ and the baseline, and the ratios.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use kvferry_transfer::{EngineConfig, Op, TransferRequest, TransportKind};

mod support;
use support::EnginePair;

fn baseline(bytes: &[u8], rounds: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let total = bytes.len() * rounds;
    let rx = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; 4 << 20];
        let mut got = 0;
        while got < total {
            got += s.read(&mut buf).unwrap();
        }
        s.write_all(&[1]).unwrap();
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let t = Instant::now();
    for _ in 0..rounds {
        s.write_all(bytes).unwrap();
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).unwrap();
    let secs = t.elapsed().as_secs_f64();
    rx.join().unwrap();
    total as f64 / secs / 1e9
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let total_mib = args.first().copied().unwrap_or(256);
    let req_kib = args.get(1).copied().unwrap_or(1024);
    let batch = args.get(2).copied().unwrap_or(64);
    let size = (total_mib << 20) as usize;
    let mut cfg = EngineConfig {
        transport: TransportKind::Tcp,
        ..EngineConfig::default()
    };
    if let Some(&k) = args.get(3) {
        cfg.slice_size = k << 10;
    }
    if let Some(&c) = args.get(4) {
        cfg.tcp.connections_per_peer = c as usize;
    }
    let pair = EnginePair::new(cfg, size);
    let (a, seg) = (&pair.a, &pair.seg);
    let req_len = req_kib << 10;
    let rounds = 3;
    let run = |op: Op| -> f64 {
        let t = Instant::now();
        for _ in 0..rounds {
            let mut off = 0u64;
            while off < size as u64 {
                let reqs: Vec<_> = (0..batch)
                    .map_while(|i| {
                        let o = off + i * req_len;
                        (o + req_len <= size as u64).then_some(TransferRequest {
                            op,
                            local_addr: pair.src_addr(o),
                            remote_addr: pair.dst_addr(o),
                            len: req_len,
                        })
                    })
                    .collect();
                if reqs.is_empty() {
                    break;
                }
                off += reqs.len() as u64 * req_len;
                let id = a.submit(seg, &reqs).unwrap();
                a.wait(id, std::time::Duration::from_secs(60)).unwrap();
            }
        }
        (size * rounds) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let w = run(Op::Write);
    let r = run(Op::Read);
    let base = baseline(&pair.src, rounds);
    println!(
        "total {total_mib} MiB x{rounds}, request {req_kib} KiB, batch {batch}, slice {} KiB, {} connections",
        a.config().slice_size >> 10,
        a.config().tcp.connections_per_peer
    );
    println!("plain TCP (1 socket): {base:.2} GB/s");
    println!("engine WRITE: {w:.2} GB/s  ratio {:.2}", w / base);
    println!("engine READ : {r:.2} GB/s  ratio {:.2}", r / base);
}
