//! A consumer engine in a child process: the test binary re-run with one ignored test, so a
//! kill is a real kill (the kernel closes its sockets) and a restart is a new process that
//! can take the same handshake port, data port and region address.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kvferry_transfer::{EngineConfig, EngineStats, Location, TransferEngine, TransportKind};

const ENV: &str = "KVFERRY_TEST_CHILD";

/// What the child engine binds and registers.
#[derive(Debug, Clone, Copy, Default)]
pub struct Spec {
    /// Handshake port (0 = any).
    pub port: u16,
    /// TCP data port (0 = any).
    pub data_port: u16,
    /// Fixed address of the registered region (0 = wherever mmap puts it).
    pub addr: u64,
    /// Region length, bytes.
    pub len: u64,
    /// RDMA transport instead of TCP.
    pub rdma: bool,
}

/// A running child consumer; killed (SIGKILL) when dropped.
pub struct Child {
    proc: std::process::Child,
    /// Its segment name, `127.0.0.1:port`.
    pub segment: String,
    /// Its registered region.
    pub addr: u64,
}

/// Starts `test` (an ignored test of this binary that calls `serve_if_child`) as a child
/// consumer with `spec`; returns once it printed its segment name (deadline 30 s).
pub fn spawn(test: &str, spec: Spec) -> Child {
    let exe = std::env::current_exe().expect("test binary path");
    let mut proc = Command::new(exe)
        .args([
            "--exact",
            test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            ENV,
            format!(
                "{} {} {} {} {}",
                spec.port, spec.data_port, spec.addr, spec.len, spec.rdma as u8
            ),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child consumer");
    let out = proc.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(out);
        let mut line = String::new();
        while r.read_line(&mut line).unwrap_or(0) > 0 {
            // the harness prints "test <name> ... " on the same line first
            if let Some(i) = line.find("KVFERRY-READY ") {
                let _ = tx.send(line[i + 14..].trim().to_string());
                break;
            }
            line.clear();
        }
        // keep draining so the child never blocks on a full pipe
        let _ = std::io::copy(&mut r, &mut std::io::sink());
    });
    let ready = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("child consumer ready within 30 s");
    let mut it = ready.split_whitespace();
    let segment = it.next().expect("segment").to_string();
    let addr = it.next().and_then(|a| a.parse().ok()).expect("addr");
    Child {
        proc,
        segment,
        addr,
    }
}

impl Child {
    /// SIGKILLs the child and reaps it.
    pub fn kill(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stop();
    }
}

/// In the child (the env var is set): starts a TCP (or RDMA) engine per the spec, maps and registers the
/// region (at the fixed address when asked, `MAP_FIXED_NOREPLACE`), prints
/// `KVFERRY-READY <segment> <addr>` and serves until killed or stdin closes. Returns at once in
/// the parent.
pub fn serve_if_child() {
    let Ok(spec) = std::env::var(ENV) else {
        return;
    };
    let v: Vec<u64> = spec
        .split_whitespace()
        .map(|x| x.parse().expect("child spec"))
        .collect();
    let (port, data_port, addr, len) = (v[0] as u16, v[1] as u16, v[2], v[3]);
    let mut c = EngineConfig {
        transport: if v[4] == 1 {
            TransportKind::Rdma
        } else {
            TransportKind::Tcp
        },
        port,
        ..EngineConfig::default()
    };
    c.tcp.data_port = data_port;
    let e = TransferEngine::new(c).expect("child engine starts");
    let flags = libc::MAP_PRIVATE
        | libc::MAP_ANONYMOUS
        | if addr != 0 {
            libc::MAP_FIXED_NOREPLACE
        } else {
            0
        };
    // SAFETY: a fresh anonymous mapping; it lives until the process dies.
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "map the consumer region");
    assert!(addr == 0 || p as u64 == addr, "fixed address honoured");
    // SAFETY: the mapping stays valid for the life of the process.
    unsafe { e.register_memory(p as u64, len, Location::Cpu) }.expect("register");
    println!("KVFERRY-READY {} {}", e.segment_name(), p as u64);
    // serve until the parent kills us or goes away (stdin EOF)
    let _ = std::io::stdin().read(&mut [0u8; 1]);
    std::process::exit(0);
}

/// Open file descriptors of this process.
pub fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Threads of this process.
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Polls `f` until it returns true or `limit` passes; returns its last answer.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// No leaks under churn: `rounds` child consumers (test `child`, on RDMA when
/// `rdma`, each registering `len` >= 512 KiB bytes) are started, each written to three times
/// (8 × 64 KiB from `src`, registered with `producer`) and SIGKILLed; then the producer's file
/// descriptors, threads and `stats()` must return to their starting counts within `settle`
/// (its idle timeouts must be shorter).
pub fn killed_consumers_leave_nothing_behind(
    producer: &TransferEngine,
    src: u64,
    len: u64,
    child: &str,
    rdma: bool,
    rounds: u64,
    settle: Duration,
) {
    let (fd0, th0) = (fds(), threads());
    let mut peak = (fd0, th0, 0usize);
    for round in 0..rounds {
        let c = spawn(
            child,
            Spec {
                len,
                rdma,
                ..Spec::default()
            },
        );
        for _ in 0..3 {
            let reqs: Vec<(u64, u64, u64)> = (0..8)
                .map(|i| (src + i * 65536, c.addr + i * 65536, 65536))
                .collect();
            producer
                .batch_transfer_sync_write(&c.segment, &reqs)
                .unwrap_or_else(|e| panic!("round {round}: write to the live consumer: {e}"));
        }
        let st = producer.stats();
        assert!(
            st.cached_segments >= 1,
            "round {round}: the live consumer is cached: {st:?}"
        );
        assert!(
            st.connections > 0,
            "round {round}: connections counted: {st:?}"
        );
        peak = (
            peak.0.max(fds()),
            peak.1.max(threads()),
            peak.2.max(st.connections),
        );
        c.kill();
    }
    let back = eventually(settle, || {
        fds() <= fd0 && threads() <= th0 && producer.stats() == EngineStats::default()
    });
    eprintln!(
        "producer before churn: {fd0} fds, {th0} threads; peak {} fds, {} threads, {} \
         connections; after {rounds} killed consumers and the idle timeout: {} fds, {} threads, \
         {:?}",
        peak.0,
        peak.1,
        peak.2,
        fds(),
        threads(),
        producer.stats()
    );
    assert!(
        back,
        "fds {} (start {fd0}), threads {} (start {th0}), {:?} did not return",
        fds(),
        threads(),
        producer.stats()
    );
}
