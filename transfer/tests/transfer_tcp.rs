//! WRITE and READ between two engines over real loopback sockets (TCP transport), data compared
//! byte for byte, including the bytes around each written range.

mod common;

use std::time::Duration;

use common::{assert_same, engine, engine_with, Buf};
use kvferry_transfer::{BatchStatus, Op, TransferError, TransferRequest};

const SIZES: &[u64] = &[
    1,
    7,
    4095,
    65_536,
    65_537,
    65_536 + 16_384,
    65_536 + 16_385,
    3 * 65_536 + 1,
    (1 << 20) + 13,
    64 << 20,
];

#[test]
fn write_then_read_many_sizes_at_unaligned_offsets() {
    let a = engine();
    let b = engine();
    let max = *SIZES.iter().max().unwrap() as usize;
    let src = Buf::new(max + 64, 1);
    let mut dst = Buf::new(max + 64, 2);
    let mut back = Buf::zeroed(max + 64);
    src.register(&a);
    back.register(&a);
    dst.register(&b);
    let target = b.segment_name();
    for (i, &len) in SIZES.iter().enumerate() {
        let (lo, ro) = (3 + i as u64, 5 + 2 * i as u64);
        let before = dst.bytes.clone();
        a.transfer_sync_write(&target, src.addr() + lo, dst.addr() + ro, len)
            .unwrap_or_else(|e| panic!("write {len}: {e}"));
        let (lo_u, ro_u, n) = (lo as usize, ro as usize, len as usize);
        assert_same(
            &dst.bytes[ro_u..ro_u + n],
            &src.bytes[lo_u..lo_u + n],
            &format!("written {len}"),
        );
        assert_same(
            &dst.bytes[..ro_u],
            &before[..ro_u],
            "bytes before the range",
        );
        assert_same(
            &dst.bytes[ro_u + n..],
            &before[ro_u + n..],
            "bytes after the range",
        );

        // READ it back from a different remote offset that holds other bytes
        dst.fill(100 + i as u64);
        back.bytes.fill(0);
        a.transfer_sync_read(&target, back.addr() + 1, dst.addr() + ro, len)
            .unwrap_or_else(|e| panic!("read {len}: {e}"));
        assert_same(
            &back.bytes[1..1 + n],
            &dst.bytes[ro_u..ro_u + n],
            &format!("read {len}"),
        );
        assert!(
            back.bytes[0] == 0 && common::all_zero(&back.bytes[1 + n..]),
            "read {len} wrote outside its range"
        );
    }
}

/// Lays out `n` requests of pseudo-random lengths in disjoint ranges on both sides.
fn layout(n: usize, seed: u64) -> Vec<(u64, u64, u64)> {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut l, mut r) = (0u64, 0u64);
    (0..n)
        .map(|_| {
            let len = 1 + next() % (3 * 65_536);
            let gap_l = next() % 97;
            let gap_r = next() % 131;
            let req = (l + gap_l, r + gap_r, len);
            l += gap_l + len;
            r += gap_r + len;
            req
        })
        .collect()
}

#[test]
fn batches_of_1_to_512_requests_write_and_read() {
    let a = engine();
    let b = engine();
    let size = 512 * (3 * 65_536 + 200);
    let src = Buf::new(size, 7);
    let mut dst = Buf::zeroed(size);
    let mut back = Buf::zeroed(size);
    src.register(&a);
    back.register(&a);
    dst.register(&b);
    for (k, n) in [1usize, 2, 17, 128, 512].into_iter().enumerate() {
        let reqs = layout(n, 1000 + k as u64);
        dst.bytes.fill(0);
        let abs: Vec<_> = reqs
            .iter()
            .map(|&(l, r, len)| (src.addr() + l, dst.addr() + r, len))
            .collect();
        a.batch_transfer_sync_write(&b.segment_name(), &abs)
            .unwrap();
        let mut expect = vec![0u8; size];
        for &(l, r, len) in &reqs {
            let (l, r, len) = (l as usize, r as usize, len as usize);
            expect[r..r + len].copy_from_slice(&src.bytes[l..l + len]);
        }
        assert_same(&dst.bytes, &expect, &format!("batch of {n} writes"));

        dst.fill(5000 + k as u64);
        back.bytes.fill(0);
        let abs: Vec<_> = reqs
            .iter()
            .map(|&(l, r, len)| (back.addr() + l, dst.addr() + r, len))
            .collect();
        a.batch_transfer_sync_read(&b.segment_name(), &abs).unwrap();
        let mut expect = vec![0u8; size];
        for &(l, r, len) in &reqs {
            let (l, r, len) = (l as usize, r as usize, len as usize);
            expect[l..l + len].copy_from_slice(&dst.bytes[r..r + len]);
        }
        assert_same(&back.bytes, &expect, &format!("batch of {n} reads"));
    }
}

#[test]
fn requests_spanning_adjacent_regions_on_both_sides() {
    let a = engine();
    let b = engine();
    let src = Buf::new(300_000, 3);
    let dst = Buf::zeroed(300_000);
    // local split at 100_000 and 150_001; remote split at 70_000
    for (off, len) in [(0u64, 100_000u64), (100_000, 50_001), (150_001, 149_999)] {
        // SAFETY: `src` outlives the engine `a`.
        unsafe { a.register_memory(src.addr() + off, len, kvferry_transfer::Location::Cpu) }
            .unwrap();
    }
    for (off, len) in [(0u64, 70_000u64), (70_000, 230_000)] {
        // SAFETY: `dst` outlives the engine `b`.
        unsafe { b.register_memory(dst.addr() + off, len, kvferry_transfer::Location::Cpu) }
            .unwrap();
    }
    a.transfer_sync_write(&b.segment_name(), src.addr() + 10, dst.addr() + 20, 299_000)
        .unwrap();
    assert_same(
        &dst.bytes[20..299_020],
        &src.bytes[10..299_010],
        "spanning write",
    );
    assert!(dst.bytes[..20]
        .iter()
        .chain(&dst.bytes[299_020..])
        .all(|&x| x == 0));
}

#[test]
fn mixed_ops_in_one_batch_and_status_transitions() {
    let a = engine();
    let b = engine();
    let la = Buf::new(1 << 20, 11);
    let mut lb = Buf::zeroed(1 << 20);
    let rb = Buf::new(1 << 20, 12);
    la.register(&a);
    lb.register(&a);
    rb.register(&b);
    let mut remote_w = Buf::zeroed(1 << 20);
    remote_w.register(&b);
    let seg = a.open_segment(&b.segment_name()).unwrap();
    let reqs = [
        TransferRequest {
            op: Op::Write,
            local_addr: la.addr(),
            remote_addr: remote_w.addr(),
            len: 1 << 20,
        },
        TransferRequest {
            op: Op::Read,
            local_addr: lb.addr(),
            remote_addr: rb.addr(),
            len: 1 << 20,
        },
    ];
    let id = a.submit(&seg, &reqs).unwrap();
    assert!(matches!(
        a.status(id),
        BatchStatus::Waiting | BatchStatus::Pending | BatchStatus::Completed
    ));
    a.wait(id, Duration::from_secs(20)).unwrap();
    assert_eq!(
        a.status(id),
        BatchStatus::Invalid,
        "a finished wait frees the batch"
    );
    assert!(matches!(
        a.wait(id, Duration::from_secs(1)),
        Err(TransferError::UnknownBatch(_))
    ));
    assert_same(&remote_w.bytes, &la.bytes, "write half");
    assert_same(&lb.bytes, &rb.bytes, "read half");
    remote_w.bytes.fill(0);
    lb.bytes.fill(0);
    // an empty batch is complete at once
    let id = a.submit(&seg, &[]).unwrap();
    assert_eq!(a.status(id), BatchStatus::Completed);
}

#[test]
fn many_threads_share_one_engine_and_peer() {
    let a = engine_with(|c| c.slice_size = 16 * 1024);
    let b = engine();
    let src = Buf::new(8 << 20, 21);
    let dst = Buf::zeroed(8 << 20);
    src.register(&a);
    dst.register(&b);
    let chunk = 1u64 << 20;
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (a, name) = (a.clone(), b.segment_name());
            let (sa, da) = (src.addr(), dst.addr());
            s.spawn(move || {
                for _ in 0..3 {
                    a.transfer_sync_write(&name, sa + t * chunk, da + t * chunk, chunk)
                        .unwrap();
                }
            });
        }
    });
    assert_same(&dst.bytes, &src.bytes, "8 threads × 1 MiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usable_from_async_code() {
    let a = engine();
    let b = engine();
    let src = Buf::new(3 << 20, 31);
    let dst = Buf::zeroed(3 << 20);
    src.register(&a);
    dst.register(&b);
    let seg = a.open_segment(&b.segment_name()).unwrap();
    let req = TransferRequest {
        op: Op::Write,
        local_addr: src.addr(),
        remote_addr: dst.addr(),
        len: src.len(),
    };
    let id = a.submit(&seg, &[req]).unwrap();
    a.wait_async(id, Duration::from_secs(20)).await.unwrap();
    assert_same(&dst.bytes, &src.bytes, "async wait");
    // the sync helper called straight from a runtime thread must not panic
    a.transfer_sync_read(&b.segment_name(), src.addr(), dst.addr(), 100)
        .unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn sync_helpers_inside_a_current_thread_runtime() {
    let a = engine();
    let b = engine();
    let src = Buf::new(1 << 20, 41);
    let dst = Buf::zeroed(1 << 20);
    src.register(&a);
    dst.register(&b);
    a.transfer_sync_write(&b.segment_name(), src.addr(), dst.addr(), src.len())
        .unwrap();
    assert_same(&dst.bytes, &src.bytes, "sync write inside a runtime");
}

#[test]
fn an_engine_can_target_its_own_segment() {
    let a = engine();
    let src = Buf::new(300_000, 51);
    let dst = Buf::zeroed(300_000);
    src.register(&a);
    dst.register(&a);
    a.transfer_sync_write(&a.segment_name(), src.addr(), dst.addr(), 300_000)
        .unwrap();
    assert_same(&dst.bytes, &src.bytes, "write to self");
}

/// Copies over TCP have no device points: a submitter that asks for them is told to wait on
/// the host, and the batch moves its bytes as `submit_strided` would.
#[test]
fn a_strided_batch_over_tcp_has_no_device_points() {
    let (a, b) = (engine(), engine());
    let src = Buf::new(64 << 10, 9);
    let dst = Buf::zeroed(64 << 10);
    src.register(&a);
    dst.register(&b);
    let seg = a.open_segment(&b.segment_name()).unwrap();
    let req = kvferry_transfer::StridedRequest {
        op: Op::Write,
        ranges: vec![kvferry_transfer::StridedRange {
            local: 0,
            remote: 0,
            len: 4096,
        }],
        blocks: (0..16u64)
            .map(|i| (src.addr() + i * 4096, dst.addr() + i * 4096))
            .collect(),
    };
    let (id, points) = a.submit_strided_with_points(&seg, &[req]).unwrap();
    assert!(points.is_none());
    a.wait(id, Duration::from_secs(10)).unwrap();
    assert_same(&dst.bytes, &src.bytes, "strided write with points asked");
}
