//! No use after unregister: `unregister_memory` never returns while the engine may still move
//! bytes from or into the region. It waits for the batches in flight on it (even one whose
//! wait timed out, whose slices on the wire still land) or fails with `InUse`, leaving the
//! region registered.
//!
//! The tests hold a slice in flight: the local region is the tests' fake GPU memory
//! (`common::fake_gpu`), whose copies go through a `MemoryAccess` that parks every copy into or
//! out of the region until the test opens its gate, so a READ is provably still landing (a
//! WRITE still reading the region) when `unregister_memory` is called, however fast loopback is.

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::fake_gpu::FakeGpu;
use common::{assert_same, config, engine, Buf};
use kvferry_transfer::{
    Location, MemoryAccess, MemoryRegion, Op, Result, TransferEngine, TransferError,
    TransferRequest,
};

/// Bytes moved per test: a few slices.
const LEN: usize = 4 << 20;

fn register(e: &TransferEngine, b: &Buf) {
    b.register(e);
}

/// Starts one `op` of `len` bytes between `local` (an address registered on `a`) and `remote`
/// (on `b`).
fn start(
    a: &TransferEngine,
    b: &TransferEngine,
    op: Op,
    local: u64,
    remote: &Buf,
    len: usize,
) -> kvferry_transfer::BatchId {
    let seg = a.open_segment(&b.segment_name()).unwrap();
    a.submit(
        &seg,
        &[TransferRequest {
            op,
            local_addr: local,
            remote_addr: remote.addr(),
            len: len as u64,
        }],
    )
    .unwrap()
}

/// The fake GPU of the transfer tests (`LEN` bytes of `cuda:0` memory), whose copies wait for
/// `open` (up to 30 s).
struct Gate {
    gpu: Arc<FakeGpu>,
    state: Mutex<(bool, usize)>,
    changed: Condvar,
}

impl Gate {
    fn new() -> Arc<Gate> {
        Arc::new(Gate {
            gpu: FakeGpu::new(LEN as u64),
            state: Mutex::new((false, 0)),
            changed: Condvar::new(),
        })
    }

    fn open(&self) {
        self.state.lock().unwrap().0 = true;
        self.changed.notify_all();
    }

    /// Counts a parked copy and waits (up to 30 s) for `open`.
    fn park(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut s = self.state.lock().unwrap();
        s.1 += 1;
        self.changed.notify_all();
        while !s.0 && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            s = self.changed.wait_timeout(s, left).unwrap().0;
        }
    }

    /// Waits (up to 30 s) until a copy is parked at the gate.
    fn wait_parked(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut s = self.state.lock().unwrap();
        while s.1 == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no slice reached the gate");
            s = self.changed.wait_timeout(s, left).unwrap().0;
        }
    }

    /// The device memory's first address.
    fn addr(&self) -> u64 {
        self.gpu.base
    }

    /// What the device memory holds now.
    fn bytes(&self) -> Vec<u8> {
        self.gpu.device(0, LEN)
    }
}

impl MemoryAccess for Gate {
    fn name(&self) -> &'static str {
        "gated-fake-gpu"
    }
    fn check(&self, location: Location) -> Result<()> {
        self.gpu.check(location)
    }
    fn check_region(&self, region: &MemoryRegion) -> Result<()> {
        self.gpu.check_region(region)
    }
    unsafe fn copy_from(&self, location: Location, src: u64, dst: &mut [u8]) -> Result<()> {
        self.check(location)?;
        self.park();
        // SAFETY: forwarded from this call's contract.
        unsafe { self.gpu.copy_from(location, src, dst) }
    }
    unsafe fn copy_to(&self, location: Location, dst: u64, src: &[u8]) -> Result<()> {
        self.check(location)?;
        self.park();
        // SAFETY: forwarded from this call's contract.
        unsafe { self.gpu.copy_to(location, dst, src) }
    }
}

/// An engine whose `cuda:0` copies park at `gate`, with the gate's device memory registered.
fn gated_engine(gate: &Arc<Gate>, unregister_timeout: Duration) -> Arc<TransferEngine> {
    let mut c = config();
    c.unregister_timeout = unregister_timeout;
    let a = TransferEngine::with_memory_access(c, gate.clone()).unwrap();
    // SAFETY: the fake device memory lives as long as the gate, which the engine holds.
    unsafe { a.register_memory(gate.addr(), LEN as u64, Location::Cuda(0)) }.unwrap();
    a
}

#[test]
fn an_async_read_lands_nothing_after_unregister_returns() {
    let gate = Gate::new();
    let remote = Buf::new(LEN, 7);
    let a = gated_engine(&gate, Duration::from_secs(30));
    let b = engine();
    register(&b, &remote);
    let batch = start(&a, &b, Op::Read, gate.addr(), &remote, LEN);
    // A slice's bytes arrived and wait at the gate to land in the region.
    gate.wait_parked();
    let (tx, rx) = mpsc::channel();
    let at_return = std::thread::scope(|s| {
        s.spawn(|| {
            let r = a.unregister_memory(gate.addr());
            // what the memory holds the moment the engine says it is done with it
            let _ = tx.send((r, gate.bytes()));
        });
        // An unregister that does not wait returns within this; one that waits cannot return
        // before the gate opens.
        let early = rx.recv_timeout(Duration::from_millis(500));
        gate.open();
        let (r, bytes) = match early {
            Ok(v) => v,
            Err(_) => rx
                .recv_timeout(Duration::from_secs(30))
                .expect("unregister_memory returns once the READ landed"),
        };
        r.expect("unregister_memory");
        bytes
    });
    // Whatever the batch still does ends here; nothing of it may land after the return.
    let waited = a.wait(batch, Duration::from_secs(20));
    assert!(
        at_return == gate.bytes(),
        "bytes landed in the memory after unregister_memory returned"
    );
    assert_same(
        &at_return,
        &remote.bytes,
        "what the READ landed before the return",
    );
    waited.expect("the READ completes");
    assert!(a.region_path(gate.addr()).is_none());
}

#[test]
fn an_async_write_sends_nothing_after_unregister_returns() {
    let gate = Gate::new();
    gate.gpu.fill_device(0, LEN, 3);
    let sent = gate.bytes();
    let remote = Buf::zeroed(LEN);
    let a = gated_engine(&gate, Duration::from_secs(30));
    let b = engine();
    register(&b, &remote);
    let batch = start(&a, &b, Op::Write, gate.addr(), &remote, LEN);
    // A slice's bytes wait at the gate to be read from the region and sent.
    gate.wait_parked();
    let addr = gate.addr();
    let (tx, rx) = mpsc::channel();
    let a2 = a.clone();
    let unregister = std::thread::spawn(move || {
        let _ = tx.send(a2.unregister_memory(addr));
    });
    // An unregister that does not wait returns within this; one that waits cannot return
    // before the gate opens.
    let r = match rx.recv_timeout(Duration::from_millis(500)) {
        Ok(r) => r,
        Err(_) => {
            gate.open();
            rx.recv_timeout(Duration::from_secs(30))
                .expect("unregister_memory returns once the WRITE was sent")
        }
    };
    r.expect("unregister_memory");
    // The engine is done with the memory: its owner reuses it.
    gate.gpu.fill_device(0, LEN, 99);
    gate.open();
    let waited = a.wait(batch, Duration::from_secs(20));
    unregister.join().unwrap();
    assert!(
        remote.bytes == sent,
        "the WRITE sent bytes read from the buffer after unregister_memory returned"
    );
    waited.expect("the WRITE completes");
    assert!(a.region_path(addr).is_none());
}

#[test]
fn a_region_still_in_use_at_the_deadline_stays_registered_and_unregister_says_in_use() {
    let gate = Gate::new();
    let remote = Buf::new(LEN, 5);
    let a = gated_engine(&gate, Duration::from_millis(200));
    let b = engine();
    register(&b, &remote);
    let batch = start(&a, &b, Op::Read, gate.addr(), &remote, LEN);
    // The READ is landing (held at the gate) for the whole of the unregister deadline.
    gate.wait_parked();
    let r = a.unregister_memory(gate.addr());
    gate.open();
    match r {
        Err(TransferError::InUse { addr, batches, .. }) => {
            assert_eq!(addr, gate.addr());
            assert_eq!(batches, 1);
        }
        other => panic!("unregister_memory while a READ lands in the region: {other:?}"),
    }
    assert!(a.region_path(gate.addr()).is_some(), "it stays registered");
    // Still registered, so the READ completes into it; then it can go.
    a.wait(batch, Duration::from_secs(20))
        .expect("the READ completes");
    assert_same(&gate.bytes(), &remote.bytes, "the READ's bytes");
    a.unregister_memory(gate.addr()).unwrap();
    assert!(a.region_path(gate.addr()).is_none());
}
