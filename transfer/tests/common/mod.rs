//! Shared helpers of the transfer integration tests: engines on loopback and test buffers.
#![allow(dead_code)]

pub mod child;
pub mod fake_gpu;
pub mod rdma;

use std::sync::Arc;
use std::time::Duration;

use kvferry_transfer::{EngineConfig, Location, TransferEngine, TransportKind};

/// Reports a test that passes without running its body: `SKIPPED <test>: <why>` on stderr.
/// Written to the stream itself, not with `eprintln!`, which libtest captures and hides for a
/// passing test: a contributor sees what `cargo test` did not test.
pub fn skipped(test: &str, why: &dyn std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// A TCP engine on 127.0.0.1, any port, with short deadlines so failure tests end quickly.
pub fn engine() -> Arc<TransferEngine> {
    engine_with(|_| {})
}

pub fn config() -> EngineConfig {
    let mut c = EngineConfig {
        transport: TransportKind::Tcp,
        ..EngineConfig::default()
    };
    c.handshake_timeout = Duration::from_secs(2);
    c.tcp.io_timeout = Duration::from_secs(2);
    c.transfer_timeout = Duration::from_secs(20);
    c
}

pub fn engine_with(f: impl FnOnce(&mut EngineConfig)) -> Arc<TransferEngine> {
    let mut c = config();
    f(&mut c);
    TransferEngine::new(c).expect("engine starts")
}

/// Heap bytes with a deterministic pattern; `addr()` is what gets registered.
pub struct Buf {
    pub bytes: Vec<u8>,
}

impl Buf {
    pub fn new(len: usize, seed: u64) -> Buf {
        let mut b = Buf {
            bytes: vec![0u8; len],
        };
        b.fill(seed);
        b
    }

    pub fn zeroed(len: usize) -> Buf {
        Buf {
            bytes: vec![0u8; len],
        }
    }

    /// xorshift64* pattern: different per seed and position.
    pub fn fill(&mut self, seed: u64) {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for chunk in self.bytes.chunks_mut(8) {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    pub fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    pub fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// Registers the whole buffer with `e` (the buffer outlives the engine in every test).
    pub fn register(&self, e: &TransferEngine) {
        // SAFETY: the buffer outlives the engine (the caller keeps both and drops the engine
        // first).
        unsafe { e.register_memory(self.addr(), self.len(), Location::Cpu) }.expect("register");
    }
}

/// Asserts two byte ranges are equal, reporting the first differing offset.
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if got == want {
        return; // memcmp; the byte search below only runs on a failure
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at byte {i} of {}", got.len());
    }
}

/// True when every byte is zero (compared in blocks, fast in debug builds).
pub fn all_zero(b: &[u8]) -> bool {
    static ZERO: [u8; 4096] = [0; 4096];
    b.chunks(4096).all(|c| c == &ZERO[..c.len()])
}
