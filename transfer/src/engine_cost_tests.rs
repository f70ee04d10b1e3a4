//! The engine's own host work per batch, with a transport that moves nothing: its `post`
//! hands the batch to a completion thread of its own (as the CUDA IPC transport hands its
//! events to one), or completes it before returning. The figure is printed, never asserted
//! (speed is compared between builds, side by side):
//!
//! `cargo test --release -p kvferry-transfer --lib engine_host_cost -- --ignored --nocapture`
//! (`KVF_COST_BATCHES`: batches per figure, default 200000), and per request of a batch of
//! many scattered pieces (as Mooncake's `batch_transfer_sync_write` hands them):
//! `cargo test --release -p kvferry-transfer --lib engine_piece_cost -- --ignored --nocapture`.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::Token;
use crate::config::EngineConfig;
use crate::descriptor::{SegmentDescriptor, TransportInfo};
use crate::error::Result;
use crate::memory::{MemoryRegion, RegionKeys};
use crate::transport::{CompletionSink, Slice, Transport};
use crate::types::{Location, Op, TransferRequest, TransportKind};
use crate::TransferEngine;

/// A transport that completes every slice at once: in `post` (`inline`), or on its own
/// completion thread, which polls its queue as the CUDA IPC completion thread does.
struct AtOnce {
    inline: bool,
    tx: std::sync::Mutex<Option<mpsc::Sender<Reports>>>,
}

/// What `AtOnce::post` hands its completion thread: the sink and the slice ids to succeed.
type Reports = (CompletionSink, Vec<u32>);

impl AtOnce {
    fn new(inline: bool) -> Arc<Self> {
        let (tx, rx) = mpsc::channel::<Reports>();
        if inline {
            drop(rx);
            return Arc::new(AtOnce {
                inline,
                tx: std::sync::Mutex::new(None),
            });
        }
        std::thread::spawn(move || loop {
            match rx.try_recv() {
                Ok((sink, ids)) => sink.succeed_all(&ids),
                Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        });
        Arc::new(AtOnce {
            inline,
            tx: std::sync::Mutex::new(Some(tx)),
        })
    }
}

impl Transport for AtOnce {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn local_info(&self) -> TransportInfo {
        TransportInfo {
            kind: TransportKind::Tcp,
            details: serde_json::json!({}),
        }
    }
    fn register(&self, _region: &MemoryRegion) -> Result<RegionKeys> {
        Ok(RegionKeys::default())
    }
    fn deregister(&self, _region: &MemoryRegion) -> Result<()> {
        Ok(())
    }
    fn on_handshake(&self, _peer: SocketAddr, _body: &[u8]) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn post(
        &self,
        _peer: &Arc<SegmentDescriptor>,
        slices: &[Slice],
        done: CompletionSink,
        _token: Option<Token>,
    ) {
        done.expect_soon();
        let ids: Vec<u32> = slices.iter().map(|s| s.id).collect();
        if self.inline {
            done.succeed_all(&ids);
        } else if let Some(tx) = self.tx.lock().unwrap().as_ref() {
            let _ = tx.send((done, ids));
        }
    }
    fn slice_size(
        &self,
        _peer: &SegmentDescriptor,
        _local: &MemoryRegion,
        _remote_buffer: usize,
        _default: u64,
    ) -> u64 {
        // As CUDA IPC: a contiguous request of up to 64 MiB is one slice.
        64 << 20
    }
    fn shutdown(&self) {
        self.tx.lock().unwrap().take();
    }
}

/// Two engines on `AtOnce` transports, a buffer registered on each: (initiator, target,
/// the initiator's handle on the target, source, destination).
pub(super) struct Pair {
    pub(super) a: Arc<TransferEngine>,
    _b: Arc<TransferEngine>,
    pub(super) seg: crate::segment::SegmentHandle,
    pub(super) src: Vec<u8>,
    pub(super) dst: Vec<u8>,
}

pub(super) fn pair(inline: bool, size: usize) -> Pair {
    let make = |inline| {
        TransferEngine::with_transport(EngineConfig::default(), move |_| {
            AtOnce::new(inline) as Arc<dyn Transport>
        })
        .unwrap()
    };
    let (a, b) = (make(inline), make(inline));
    let (src, dst) = (vec![7u8; size], vec![1u8; size]);
    // SAFETY: the buffers outlive the engines' use of them (the test drops the engines first).
    unsafe {
        a.register_memory(src.as_ptr() as u64, size as u64, Location::Cpu)
            .unwrap();
        b.register_memory(dst.as_ptr() as u64, size as u64, Location::Cpu)
            .unwrap();
    }
    let seg = a.open_segment(&b.segment_name()).unwrap();
    Pair {
        a,
        _b: b,
        seg,
        src,
        dst,
    }
}

/// Nanoseconds per batch of one contiguous request, `window` batches in flight: (whole loop,
/// submit alone).
fn per_batch(p: &Pair, batches: usize, window: usize) -> (f64, f64) {
    let req = [TransferRequest {
        op: Op::Write,
        local_addr: p.src.as_ptr() as u64,
        remote_addr: p.dst.as_ptr() as u64,
        len: p.src.len() as u64,
    }];
    let wait = |id| p.a.wait(id, Duration::from_secs(10)).unwrap();
    wait(p.a.submit(&p.seg, &req).unwrap());
    let mut in_flight = std::collections::VecDeque::new();
    let mut submitting = Duration::ZERO;
    let t = Instant::now();
    for _ in 0..batches {
        if in_flight.len() == window {
            wait(in_flight.pop_front().unwrap());
        }
        let s = Instant::now();
        in_flight.push_back(p.a.submit(&p.seg, &req).unwrap());
        submitting += s.elapsed();
    }
    in_flight.into_iter().for_each(wait);
    let n = batches as f64;
    (
        t.elapsed().as_nanos() as f64 / n,
        submitting.as_nanos() as f64 / n,
    )
}

/// The figures' settings: batches (`KVF_COST_BATCHES`, else `default`) and completion modes
/// (`KVF_COST_MODE`: `inline`, `thread`, else both; `true` is inline).
fn settings(default: usize) -> (usize, Vec<bool>) {
    let batches = std::env::var("KVF_COST_BATCHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    let modes = match std::env::var("KVF_COST_MODE").as_deref() {
        Ok("inline") => vec![true],
        Ok("thread") => vec![false],
        _ => vec![true, false],
    };
    (batches, modes)
}

#[test]
#[ignore = "a benchmark: prints the engine's host time per batch"]
fn engine_host_cost() {
    let (batches, modes) = settings(200_000);
    for inline in modes {
        let p = pair(inline, 1 << 20);
        for window in [1, 4] {
            let (all, submit) = per_batch(&p, batches, window);
            println!(
                "engine host cost: completion {} window {window}: {all:.0} ns/batch, submit {submit:.0} ns/batch",
                if inline { "inline" } else { "thread" }
            );
        }
    }
}

/// Nanoseconds per request of one batch of `n` pieces of `piece` bytes at every other offset on
/// both sides (nothing coalesces), submitted and waited for `batches` times: (whole loop, submit
/// alone).
fn per_piece(p: &Pair, n: usize, piece: usize, batches: usize) -> (f64, f64) {
    let reqs: Vec<TransferRequest> = (0..n)
        .map(|i| TransferRequest {
            op: Op::Write,
            local_addr: p.src.as_ptr() as u64 + (2 * i * piece) as u64,
            remote_addr: p.dst.as_ptr() as u64 + (2 * i * piece) as u64,
            len: piece as u64,
        })
        .collect();
    let run = || {
        let s = Instant::now();
        let id = p.a.submit(&p.seg, &reqs).unwrap();
        let submitted = s.elapsed();
        p.a.wait(id, Duration::from_secs(10)).unwrap();
        p.a.free_batch(id);
        submitted
    };
    run();
    let mut submitting = Duration::ZERO;
    let t = Instant::now();
    for _ in 0..batches {
        submitting += run();
    }
    let n = (batches * n) as f64;
    (
        t.elapsed().as_nanos() as f64 / n,
        submitting.as_nanos() as f64 / n,
    )
}

#[test]
#[ignore = "a benchmark: prints the engine's host time per request of a scattered batch"]
fn engine_piece_cost() {
    let (n, piece) = (4096, 4096);
    let (batches, modes) = settings(200);
    for inline in modes {
        let p = pair(inline, 2 * n * piece);
        let (all, submit) = per_piece(&p, n, piece, batches);
        println!(
            "engine piece cost: completion {}: {n} pieces a batch: {all:.1} ns/request, submit {submit:.1} ns/request",
            if inline { "inline" } else { "thread" }
        );
    }
}
