//! A bounded loopback soak: legitimate loads (each from a new consumer that then goes away)
//! alongside hostile connections to the producer's control port and engine (half-greetings
//! held open, oversized frames, consumers with the wrong secret, garbage on the handshake
//! port), under a 256-fd limit. Measured: failed legitimate loads (must be 0), the process's
//! fd count and RSS over time (flat), and the bytes of warnings logged (bounded).
//!
//! `KVFERRY_SOAK_SECONDS` sets the length (default 20, the test command's short form;
//! `scripts/soak.sh` runs longer). The summary goes to stderr and, with `KVFERRY_SOAK_REPORT`,
//! to that file. The test lowers this process's own fd limit: it is alone in its binary.

mod common;

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{connect_from, consumer_config, greeting, open_fds, ready, spec, Side, NUM_TOKENS};
use kvferry_p2p::{Consumer, LoadGroup, LoadSpec, Producer, ProducerConfig};
use kvferry_transfer::Secret;

const FD_LIMIT: u64 = 256;
/// Half-greetings held open at once.
const HALF_GREETINGS: usize = 40;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Counts the bytes the subscriber writes (the warnings' log).
#[derive(Clone)]
struct Counting(Arc<AtomicU64>);

impl Write for Counting {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The test's runtime (each runtime of its own would cost fds under the low limit).
fn runtime() -> tokio::runtime::Handle {
    tokio::runtime::Handle::current()
}

/// Runs `f` on its own thread until `stop`, counting its rounds in `n`.
fn hostile(
    stop: &Arc<AtomicBool>,
    n: &Arc<AtomicU64>,
    mut f: impl FnMut() + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let (stop, n) = (stop.clone(), n.clone());
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            f();
            n.fetch_add(1, Ordering::Relaxed);
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legitimate_loads_alongside_hostile_connections_under_a_256_fd_limit() {
    let r = libc::rlimit {
        rlim_cur: FD_LIMIT,
        rlim_max: FD_LIMIT,
    };
    // SAFETY: setrlimit reads the struct it is given.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
    let seconds: u64 = std::env::var("KVFERRY_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let log_bytes = Arc::new(AtomicU64::new(0));
    let writer = Counting(log_bytes.clone());
    // The producer side's warnings (the wrong-secret consumers' own complaints are theirs: the
    // consumer's shell and its connection tasks).
    let _ = tracing_subscriber::fmt()
        .with_env_filter("warn,kvferry_p2p::shell::consumer=off,kvferry_p2p::shell::connection=off")
        .with_writer(move || writer.clone())
        .try_init();

    let secret = Secret::from_bytes(b"soak secret, 32 bytes of it....!").unwrap();
    let p = Side::authenticated(1, 1, 8, Some(7), secret.clone());
    let producer = Producer::start(
        ProducerConfig {
            transfer_timeout: Duration::from_secs(10),
            ..ProducerConfig::default()
        },
        p.workers.clone(),
    )
    .await
    .unwrap();
    let control = producer.endpoint().trim_start_matches("tcp://").to_string();
    let handshake = p.workers[0].engine.segment_name();

    let stop = Arc::new(AtomicBool::new(false));
    let counts: Vec<Arc<AtomicU64>> = (0..4).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let mut threads = Vec::new();
    // Half-greetings held open until the producer drops them (its handshake deadline).
    for i in 0..HALF_GREETINGS {
        let addr = control.clone();
        let (rt, from) = (runtime(), format!("127.0.0.{}", 2 + i % 4));
        threads.push(hostile(&stop, &counts[0], move || {
            if let Some(mut s) = rt.block_on(connect_from(&from, &addr)) {
                let _ = s.write_all(&greeting()[..10]);
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = s.read(&mut [0u8; 64]);
            } else {
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }
    // A message header declaring 8 GiB after a proper greeting.
    let addr = control.clone();
    let rt = runtime();
    threads.push(hostile(&stop, &counts[1], move || {
        if let Some(mut s) = rt.block_on(connect_from("127.0.0.6", &addr)) {
            let _ = s.write_all(&greeting());
            let _ = s.write_all(&ready("DEALER"));
            let mut h = vec![0x02u8];
            h.extend_from_slice(&(8u64 << 30).to_be_bytes());
            let _ = s.write_all(&h);
            let _ = s.write_all(&[0u8; 4096]);
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut buf = [0u8; 4096];
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
        }
        std::thread::sleep(Duration::from_millis(20));
    }));
    // Garbage on the engine's handshake port: a frame header declaring 1 TiB.
    let addr = handshake.clone();
    let rt = runtime();
    threads.push(hostile(&stop, &counts[2], move || {
        if let Some(mut s) = rt.block_on(connect_from("127.0.0.7", &addr)) {
            let mut f = (1u64 << 40).to_le_bytes().to_vec();
            f.push(1);
            let _ = s.write_all(&f);
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = s.read(&mut [0u8; 64]);
        }
        std::thread::sleep(Duration::from_millis(20));
    }));
    // Consumers with the wrong secret: refused at the session, never served.
    let wrong = Secret::from_bytes(b"not the soak secret, 32 bytes..!").unwrap();
    let bad_side = Side::authenticated(1, 1, 12, None, wrong);
    let bad_stop = stop.clone();
    let bad_count = counts[3].clone();
    let bad_workers = bad_side.workers.clone();
    let endpoint = producer.endpoint().to_string();
    // (a load's future is not Send: its own thread and runtime)
    let rt = runtime();
    let bad = std::thread::spawn(move || {
        rt.block_on(async move {
            while !bad_stop.load(Ordering::Relaxed) {
                let c = Consumer::new(consumer_config(), bad_workers.clone()).unwrap();
                let s = LoadSpec {
                    request_id: "victim".into(),
                    producer: endpoint.clone(),
                    groups: vec![LoadGroup {
                        remote_block_size: None,
                        group_id: 0,
                        remote_blocks: vec![Some(3), Some(5), Some(1)],
                        local_blocks: vec![Some(7), Some(2), Some(10)],
                    }],
                    num_local_computed: 0,
                    num_tokens: NUM_TOKENS,
                    load_key: Some("stolen".into()),
                };
                assert!(
                    c.load(s).await.is_err(),
                    "a consumer without the secret loaded"
                );
                bad_count.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    });

    // Legitimate loads, each from a new consumer that goes away after it.
    let started = Instant::now();
    let (mut ok, mut failed) = (0u64, 0u64);
    let mut samples: Vec<(f64, u64, u64)> = Vec::new();
    let mut next_sample = Instant::now();
    let mut i = 0u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        let rid = format!("soak-{i}");
        i += 1;
        producer
            .publish(&rid, vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
            .await
            .unwrap();
        let c = Side::authenticated(1, 1, 12, None, secret.clone());
        let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
        match consumer.load(spec(&rid, &producer).await).await {
            Ok(o) if o.verdict.as_ref().is_some_and(|v| v.is_verified()) => ok += 1,
            Ok(o) => {
                eprintln!("soak: load {rid} not verified: {:?}", o.verdict);
                failed += 1
            }
            Err(e) => {
                eprintln!("soak: load {rid} failed: {e} ({} fds)", (open_fds() as u64));
                failed += 1
            }
        }
        drop(consumer);
        drop(c);
        if Instant::now() >= next_sample {
            samples.push((
                started.elapsed().as_secs_f64(),
                (open_fds() as u64),
                rss_kib(),
            ));
            next_sample += Duration::from_secs(1);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = bad.join();
    for t in threads {
        let _ = t.join();
    }
    producer.shutdown().await;

    let third = (samples.len() / 3).max(1);
    let max_of =
        |s: &[(f64, u64, u64)], f: fn(&(f64, u64, u64)) -> u64| s.iter().map(f).max().unwrap_or(0);
    let (fd_early, fd_late) = (
        max_of(&samples[..third], |s| s.1),
        max_of(&samples[samples.len() - third..], |s| s.1),
    );
    let (rss_early, rss_late) = (
        max_of(&samples[..third], |s| s.2),
        max_of(&samples[samples.len() - third..], |s| s.2),
    );
    let logged = log_bytes.load(Ordering::Relaxed);
    let hostile: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let summary = format!(
        "soak: {:.0} s under a {FD_LIMIT}-fd limit; legitimate loads {} ({} failed); hostile: \
         {} half-greetings, {} oversized frames, {} garbage handshakes, {} wrong-secret consumers; \
         fds max {} (first third) -> {} (last third); RSS max {} -> {} MiB; warnings logged {} bytes",
        started.elapsed().as_secs_f64(),
        ok + failed,
        failed,
        hostile[0],
        hostile[1],
        hostile[2],
        hostile[3],
        fd_early,
        fd_late,
        rss_early / 1024,
        rss_late / 1024,
        logged
    );
    eprintln!("{summary}");
    if let Ok(path) = std::env::var("KVFERRY_SOAK_REPORT") {
        let samples: Vec<String> = samples
            .iter()
            .map(|(t, f, r)| format!("{t:.1} {f} {r}"))
            .collect();
        let _ = std::fs::write(
            path,
            format!("{summary}\n# seconds fds rss_kib\n{}\n", samples.join("\n")),
        );
    }
    assert_eq!(failed, 0, "legitimate loads failed");
    assert!(ok > 0);
    assert!(
        fd_late <= fd_early + 24,
        "fds grew: {fd_early} -> {fd_late}"
    );
    assert!(
        rss_late <= rss_early + rss_early / 2 + 32 * 1024,
        "RSS grew: {rss_early} -> {rss_late} KiB"
    );
    // Rate-limited: a few lines a second at most, whatever the hostile traffic.
    assert!(
        logged <= 2048 * seconds + 16 * 1024,
        "{logged} bytes of warnings in {seconds} s"
    );
}
