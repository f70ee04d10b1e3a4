//! No use after unregister: `unregister_memory` never returns while the engine may still move
//! bytes from or into the region. It waits for the batches in flight on it (even one whose
//! wait timed out, whose slices on the wire still land) or fails with `InUse`, leaving the
//! region registered.

mod common;

use std::time::{Duration, Instant};

use common::{engine, engine_with, Buf};
use kvferry_transfer::{BatchStatus, Op, TransferEngine, TransferError, TransferRequest};

const LEN: usize = 48 << 20;

fn register(e: &TransferEngine, b: &Buf) {
    b.register(e);
}

/// Starts one `op` of `LEN` bytes between `local` (on `a`) and `remote` (on `b`).
fn start(
    a: &TransferEngine,
    b: &TransferEngine,
    op: Op,
    local: &Buf,
    remote: &Buf,
) -> kvferry_transfer::BatchId {
    let seg = a.open_segment(&b.segment_name()).unwrap();
    a.submit(
        &seg,
        &[TransferRequest {
            op,
            local_addr: local.addr(),
            remote_addr: remote.addr(),
            len: LEN as u64,
        }],
    )
    .unwrap()
}

#[test]
fn an_async_read_lands_nothing_after_unregister_returns() {
    let local = Buf::zeroed(LEN);
    let remote = Buf::new(LEN, 7);
    let (a, b) = (engine(), engine());
    register(&a, &local);
    register(&b, &remote);
    let batch = start(&a, &b, Op::Read, &local, &remote);
    // The waiter gives up at once: the slices already on the wire still land.
    assert!(
        matches!(
            a.wait(batch, Duration::from_micros(1)),
            Err(TransferError::Timeout(_))
        ) || a.status(batch) == BatchStatus::Completed
    );
    a.unregister_memory(local.addr()).unwrap();
    let after = local.bytes.clone();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        after == local.bytes,
        "bytes landed in the buffer after unregister_memory returned"
    );
    assert!(a.region_path(local.addr()).is_none());
}

#[test]
fn an_async_write_sends_nothing_after_unregister_returns() {
    let mut local = Buf::new(LEN, 3);
    let remote = Buf::zeroed(LEN);
    let (a, b) = (engine(), engine());
    register(&a, &local);
    register(&b, &remote);
    let batch = start(&a, &b, Op::Write, &local, &remote);
    a.unregister_memory(local.addr()).unwrap();
    // The engine is done with the buffer: what the peer holds now is all it will get.
    local.fill(99);
    let landed = remote.bytes.clone();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        landed == remote.bytes,
        "the WRITE kept sending after unregister"
    );
    assert!(matches!(
        a.status(batch),
        BatchStatus::Completed | BatchStatus::Failed(_) | BatchStatus::Invalid
    ));
}

#[test]
fn a_region_still_in_use_at_the_deadline_stays_registered_and_unregister_says_in_use() {
    let local = Buf::zeroed(LEN);
    let remote = Buf::new(LEN, 5);
    let a = engine_with(|c| c.unregister_timeout = Duration::from_millis(1));
    let b = engine();
    register(&a, &local);
    register(&b, &remote);
    let batch = start(&a, &b, Op::Read, &local, &remote);
    let t = Instant::now();
    match a.unregister_memory(local.addr()) {
        Err(TransferError::InUse { addr, batches, .. }) => {
            assert_eq!(addr, local.addr());
            assert_eq!(batches, 1);
            assert!(a.region_path(local.addr()).is_some(), "it stays registered");
        }
        // the whole read landed within the millisecond: nothing to refuse
        Ok(()) => assert!(t.elapsed() < Duration::from_millis(50)),
        Err(e) => panic!("unexpected: {e}"),
    }
    a.wait(batch, Duration::from_secs(20)).unwrap_or(());
    let _ = a.unregister_memory(local.addr());
    assert!(a.region_path(local.addr()).is_none());
}
