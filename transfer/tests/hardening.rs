//! Guards of the transfer engine, each shown by a test that fails without it: target-side range
//! checks, initiator-side checks, deadlines against dead or silent peers, malformed frames on both
//! ports, descriptor caching, instance ids, config errors.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::{assert_same, engine, engine_with, Buf};
use kvferry_transfer::{
    BatchStatus, ConfigError, EngineConfig, Location, Op, RegistrationError, TransferEngine,
    TransferError, TransferRequest, TransportKind,
};

// ------------------------------------------------------------------ raw wire helpers (spec copies)

fn handshake_frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u64).to_le_bytes().to_vec();
    f.push(ty);
    f.extend_from_slice(body);
    f
}

/// Reads one handshake frame (type, body) or None on EOF/timeout.
fn read_handshake_frame(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut h = [0u8; 9];
    s.read_exact(&mut h).ok()?;
    let len = u64::from_le_bytes(h[..8].try_into().unwrap());
    assert!(len <= 1 << 20, "reply frame within the limit");
    let mut b = vec![0u8; len as usize];
    s.read_exact(&mut b).ok()?;
    Some((h[8], b))
}

fn data_request(op: u8, instance: u64, addr: u64, len: u64) -> Vec<u8> {
    // 48 bytes: the last 16 are the grant token (none here: these engines are open)
    let mut b = vec![0u8; 48];
    b[0..4].copy_from_slice(&0x5446_564bu32.to_le_bytes());
    b[4] = op;
    b[8..16].copy_from_slice(&instance.to_le_bytes());
    b[16..24].copy_from_slice(&addr.to_le_bytes());
    b[24..32].copy_from_slice(&len.to_le_bytes());
    b
}

/// Reads one data reply: (status, trailing bytes).
fn read_data_reply(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).ok()?;
    assert_eq!(
        u32::from_le_bytes(h[0..4].try_into().unwrap()),
        0x5246_564b,
        "reply magic"
    );
    let len = u64::from_le_bytes(h[8..16].try_into().unwrap());
    let mut b = vec![0u8; len as usize];
    s.read_exact(&mut b).ok()?;
    Some((h[4], b))
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn data_addr(e: &TransferEngine) -> String {
    let d = e.local_descriptor();
    format!(
        "127.0.0.1:{}",
        d.transport.details["data_port"].as_u64().unwrap()
    )
}

/// True when the peer closed the connection (EOF or reset) within the read timeout.
fn closed_by_peer(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            }
        }
    }
}

fn a_dead_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

// ------------------------------------------------------------------ target-side range checks

#[test]
fn target_refuses_requests_outside_its_regions_even_with_a_stale_descriptor() {
    let a = engine();
    let b = engine();
    let src = Buf::new(1 << 20, 1);
    let mut back = Buf::zeroed(1 << 20);
    src.register(&a);
    back.register(&a);
    let dst = Buf::new(1 << 20, 2);
    dst.register(&b);
    let seg = a.open_segment(&b.segment_name()).unwrap(); // lists all of dst
                                                          // B now exposes only the first half; A's cached descriptor still lists the whole buffer.
    b.unregister_memory(dst.addr()).unwrap();
    let half = dst.len() / 2;
    // SAFETY: `dst` outlives the engine `b`.
    unsafe { b.register_memory(dst.addr(), half, Location::Cpu) }.unwrap();
    let before = dst.bytes.clone();

    for (off, len) in [(half, 4096u64), (half - 100, 200), (half + 70_000, 300_000)] {
        let req = TransferRequest {
            op: Op::Write,
            local_addr: src.addr(),
            remote_addr: dst.addr() + off,
            len,
        };
        let id = a.submit(&seg, &[req]).unwrap();
        match a.wait(id, Duration::from_secs(10)) {
            Err(TransferError::Failed { first, .. }) => assert!(
                matches!(*first, TransferError::RemoteOutOfRange { .. }),
                "the batch keeps the target's typed refusal: {first}"
            ),
            r => panic!("write outside the target's regions: {r:?}"),
        }
        assert_same(
            &dst.bytes,
            &before,
            &format!("refused write at +{off} changed nothing"),
        );

        let req = TransferRequest {
            op: Op::Read,
            local_addr: back.addr(),
            remote_addr: dst.addr() + off,
            len,
        };
        let id = a.submit(&seg, &[req]).unwrap();
        assert!(matches!(
            a.wait(id, Duration::from_secs(10)),
            Err(TransferError::Failed { .. })
        ));
        assert!(
            back.bytes.iter().all(|&x| x == 0),
            "refused read delivered nothing"
        );
    }
    // the same connections still work for an in-range write
    a.transfer_sync_write(&b.segment_name(), src.addr(), dst.addr(), 1000)
        .unwrap();
    assert_same(
        &dst.bytes[..1000],
        &src.bytes[..1000],
        "in-range write after refusals",
    );
    back.bytes.fill(0);
}

#[test]
fn raw_out_of_range_and_stale_requests_get_errors_and_the_connection_stays_usable() {
    let b = engine();
    let dst = Buf::new(64 * 1024, 3);
    dst.register(&b);
    let inst = b.local_descriptor().instance_id;
    let before = dst.bytes.clone();
    let mut s = connect(&data_addr(&b));
    // WRITE past the end of the region, with payload
    let mut req = data_request(1, inst, dst.addr() + dst.len() - 10, 20);
    req.extend_from_slice(&[0xAA; 20]);
    s.write_all(&req).unwrap();
    let (st, text) = read_data_reply(&mut s).expect("error reply");
    assert_eq!(st, 1, "out of range: {}", String::from_utf8_lossy(&text));
    // WRITE naming another instance of the segment
    let mut req = data_request(1, inst ^ 1, dst.addr(), 8);
    req.extend_from_slice(&[0xBB; 8]);
    s.write_all(&req).unwrap();
    assert_eq!(read_data_reply(&mut s).expect("stale reply").0, 2);
    // READ entirely outside
    s.write_all(&data_request(2, inst, 0x10, 16)).unwrap();
    assert_eq!(read_data_reply(&mut s).expect("error reply").0, 1);
    assert_same(&dst.bytes, &before, "nothing written by refused requests");
    // a valid WRITE then READ on the same connection
    let mut req = data_request(1, inst, dst.addr() + 5, 4);
    req.extend_from_slice(&[1, 2, 3, 4]);
    s.write_all(&req).unwrap();
    assert_eq!(read_data_reply(&mut s).expect("ack"), (0, vec![]));
    assert_eq!(&dst.bytes[5..9], &[1, 2, 3, 4]);
    s.write_all(&data_request(2, inst, dst.addr() + 5, 4))
        .unwrap();
    assert_eq!(
        read_data_reply(&mut s).expect("data"),
        (0, vec![1, 2, 3, 4])
    );
}

/// A scattered WRITE frame (op 3): header, piece table, payloads.
fn scatter_frame(instance: u64, pieces: &[(u64, &[u8])]) -> Vec<u8> {
    let total: u64 = pieces.iter().map(|p| p.1.len() as u64).sum();
    let mut f = data_request(3, instance, pieces.len() as u64, total);
    for (addr, bytes) in pieces {
        f.extend_from_slice(&addr.to_le_bytes());
        f.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    }
    for (_, bytes) in pieces {
        f.extend_from_slice(bytes);
    }
    f
}

#[test]
fn raw_scattered_writes_land_piece_by_piece_or_not_at_all() {
    let b = engine();
    let dst = Buf::new(64 * 1024, 3);
    dst.register(&b);
    let inst = b.local_descriptor().instance_id;
    let mut s = connect(&data_addr(&b));
    let base = dst.addr();
    // three pieces, out of order, with gaps between them
    let mut want = dst.bytes.clone();
    let pieces: [(u64, &[u8]); 3] = [(900, &[7; 50]), (10, &[8; 3]), (60_000, &[9; 500])];
    for (off, bytes) in pieces {
        want[off as usize..off as usize + bytes.len()].copy_from_slice(bytes);
    }
    let frame: Vec<(u64, &[u8])> = pieces.iter().map(|&(o, b)| (base + o, b)).collect();
    s.write_all(&scatter_frame(inst, &frame)).unwrap();
    assert_eq!(read_data_reply(&mut s).expect("ack"), (0, vec![]));
    assert_same(
        &dst.bytes,
        &want,
        "every piece in place, nothing else touched",
    );

    // one piece past the end of the region: the whole frame is refused, nothing written
    let bad: [(u64, &[u8]); 3] = [
        (base, &[1; 8]),
        (base + dst.len() - 4, &[2; 8]),
        (base + 100, &[3; 8]),
    ];
    s.write_all(&scatter_frame(inst, &bad)).unwrap();
    let (st, text) = read_data_reply(&mut s).expect("error reply");
    assert_eq!(st, 1, "{}", String::from_utf8_lossy(&text));
    // another instance: stale
    s.write_all(&scatter_frame(inst ^ 1, &frame)).unwrap();
    assert_eq!(read_data_reply(&mut s).expect("stale reply").0, 2);
    assert_same(&dst.bytes, &want, "refused frames wrote nothing");
    // the connection still serves
    s.write_all(&scatter_frame(inst, &[(base + 20, &[5; 4])]))
        .unwrap();
    assert_eq!(read_data_reply(&mut s).expect("ack").0, 0);
    assert_eq!(&dst.bytes[20..24], &[5; 4]);

    // malformed tables: an error reply, then the connection closes
    let addr = data_addr(&b);
    let mut zero_piece = data_request(3, inst, 2, 4);
    for (a, l) in [(base, 0u64), (base + 8, 4)] {
        zero_piece.extend_from_slice(&a.to_le_bytes());
        zero_piece.extend_from_slice(&l.to_le_bytes());
    }
    let mut short_sum = data_request(3, inst, 1, 9);
    short_sum.extend_from_slice(&base.to_le_bytes());
    short_sum.extend_from_slice(&4u64.to_le_bytes());
    for (what, frame) in [
        ("no pieces", data_request(3, inst, 0, 8)),
        ("too many pieces", data_request(3, inst, 1025, 1025)),
        ("huge payload", data_request(3, inst, 1, u64::MAX)),
        ("zero-length piece", zero_piece),
        ("pieces do not sum to the length", short_sum),
    ] {
        let mut s = connect(&addr);
        s.write_all(&frame).unwrap();
        let (st, _) = read_data_reply(&mut s).unwrap_or_else(|| panic!("{what}: no reply"));
        assert_eq!(st, 3, "{what}: bad request");
        assert!(closed_by_peer(&mut s), "{what}: closed after a bad request");
    }
    assert_same(
        &dst.bytes[24..],
        &want[24..],
        "malformed frames wrote nothing",
    );
}

// ------------------------------------------------------------------ initiator-side checks

#[test]
fn unregistered_local_memory_is_rejected_before_sending() {
    let a = engine();
    let b = engine();
    let src = Buf::new(8192, 4);
    let dst = Buf::new(8192, 5);
    dst.register(&b);
    let before = dst.bytes.clone();
    let e = a
        .transfer_sync_write(&b.segment_name(), src.addr(), dst.addr(), 100)
        .unwrap_err();
    assert!(matches!(e, TransferError::NotRegistered { .. }), "{e}");
    // registered, but the request runs past the region's end
    // SAFETY: `src` outlives the engine `a`.
    unsafe { a.register_memory(src.addr(), 4096, Location::Cpu) }.unwrap();
    let e = a
        .transfer_sync_write(&b.segment_name(), src.addr() + 4000, dst.addr(), 100)
        .unwrap_err();
    assert!(matches!(e, TransferError::NotRegistered { .. }), "{e}");
    let e = a
        .transfer_sync_read(&b.segment_name(), src.addr() + 4096, dst.addr(), 1)
        .unwrap_err();
    assert!(matches!(e, TransferError::NotRegistered { .. }), "{e}");
    assert_same(&dst.bytes, &before, "nothing moved");
    let seg = a.open_segment(&b.segment_name()).unwrap();
    let zero = TransferRequest {
        op: Op::Write,
        local_addr: src.addr(),
        remote_addr: dst.addr(),
        len: 0,
    };
    assert!(matches!(
        a.submit(&seg, &[zero]),
        Err(TransferError::InvalidArgument(_))
    ));
}

#[test]
fn remote_ranges_outside_advertised_buffers_are_rejected_before_sending() {
    let a = engine();
    let b = engine();
    let src = Buf::new(1 << 16, 6);
    src.register(&a);
    let dst = Buf::new(1 << 16, 7);
    dst.register(&b);
    let before = dst.bytes.clone();
    let seg = a.open_segment(&b.segment_name()).unwrap();
    for (addr, len) in [
        (dst.addr() + dst.len() - 1, 2),
        (dst.addr() - 1, 1),
        (8, 8),
        (u64::MAX - 3, 3),
    ] {
        let ok = TransferRequest {
            op: Op::Write,
            local_addr: src.addr(),
            remote_addr: dst.addr(),
            len: 10,
        };
        let bad = TransferRequest {
            op: Op::Write,
            local_addr: src.addr(),
            remote_addr: addr,
            len,
        };
        // the good request of the batch must not be sent either
        let e = a.submit(&seg, &[ok, bad]).unwrap_err();
        assert!(matches!(e, TransferError::RemoteOutOfRange { .. }), "{e}");
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_same(&dst.bytes, &before, "nothing moved");
}

// ------------------------------------------------------------------ deadlines

#[test]
fn a_segment_that_never_existed_fails_within_the_deadline() {
    let a = engine();
    let t = Instant::now();
    let e = a
        .open_segment(&format!("127.0.0.1:{}", a_dead_port()))
        .unwrap_err();
    assert!(matches!(e, TransferError::Handshake { .. }), "{e}");
    let src = Buf::new(64, 1);
    src.register(&a);
    let e = a
        .transfer_sync_write(
            &format!("127.0.0.1:{}", a_dead_port()),
            src.addr(),
            0x1000,
            8,
        )
        .unwrap_err();
    assert!(matches!(e, TransferError::Handshake { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn a_silent_handshake_peer_fails_within_the_deadline() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let name = l.local_addr().unwrap().to_string();
    let hold = std::thread::spawn(move || {
        let c = l.accept().map(|(s, _)| s);
        std::thread::sleep(Duration::from_secs(4));
        drop(c);
    });
    let a = engine_with(|c| c.handshake_timeout = Duration::from_millis(500));
    let t = Instant::now();
    let e = a.open_segment(&name).unwrap_err();
    assert!(matches!(e, TransferError::Handshake { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    hold.join().unwrap();
}

/// A fake segment: answers descriptor queries itself (its descriptor names `data_port`), so the
/// data port can be a black hole.
fn fake_segment(buffer: (u64, u64), data_port: u16) -> String {
    fake_segment_with(|name| {
        serde_json::to_vec(&serde_json::json!({
            "name": name, "instance_id": 42,
            "transport": {"kind": "tcp", "details": {"data_port": data_port}},
            "buffers": [{"region": {"addr": buffer.0, "len": buffer.1, "location": "cpu"}, "keys": {"rkeys": []}}],
        }))
        .unwrap()
    })
}

/// A fake segment answering every descriptor query with `body(name)`.
fn fake_segment_with(body: impl FnOnce(&str) -> Vec<u8>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let name = l.local_addr().unwrap().to_string();
    let body = body(&name);
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            if read_handshake_frame(&mut s).is_some() {
                let _ = s.write_all(&handshake_frame(1, &body));
            }
        }
    });
    name
}

#[test]
fn bad_peer_descriptors_are_refused_with_clear_errors() {
    let a = engine();
    let src = Buf::new(4096, 1);
    src.register(&a);
    let desc = |kind: &str, details: serde_json::Value, bufs: serde_json::Value| {
        let (kind, details, bufs) = (kind.to_string(), details, bufs);
        move |name: &str| {
            serde_json::to_vec(&serde_json::json!({
                "name": name, "instance_id": 1,
                "transport": {"kind": kind, "details": details}, "buffers": bufs,
            }))
            .unwrap()
        }
    };
    let buf = serde_json::json!([{"region": {"addr": 4096, "len": 4096, "location": "cpu"}, "keys": {"rkeys": [1]}}]);
    // another transport: refused before anything is sent
    let n = fake_segment_with(desc(
        "rdma",
        serde_json::json!({"devices": []}),
        buf.clone(),
    ));
    let e = a.transfer_sync_write(&n, src.addr(), 4096, 10).unwrap_err();
    assert!(
        matches!(
            e,
            TransferError::Unsupported(kvferry_transfer::UnsupportedError::TransportMismatch {
                theirs: kvferry_transfer::TransportKind::Rdma,
                ours: kvferry_transfer::TransportKind::Tcp,
                ..
            })
        ),
        "{e}"
    );
    // a kind this build does not know: the descriptor is refused when it is opened
    let n = fake_segment_with(desc("pigeon", serde_json::json!({}), buf.clone()));
    let e = a.open_segment(&n).unwrap_err();
    assert!(
        matches!(e, TransferError::Handshake { .. }) && e.to_string().contains("pigeon"),
        "{e}"
    );
    // no data port: the transfer fails with a clear error
    let n = fake_segment_with(desc("tcp", serde_json::json!({}), buf.clone()));
    let e = a.transfer_sync_write(&n, src.addr(), 4096, 10).unwrap_err();
    assert!(e.to_string().contains("data_port"), "{e}");
    // overlapping, wrapping, unknown location, not JSON
    for bufs in [
        serde_json::json!([{"region": {"addr": 0, "len": 10, "location": "cpu"}, "keys": {"rkeys": []}},
                           {"region": {"addr": 5, "len": 10, "location": "cpu"}, "keys": {"rkeys": []}}]),
        serde_json::json!([{"region": {"addr": u64::MAX, "len": 10, "location": "cpu"}, "keys": {"rkeys": []}}]),
        serde_json::json!([{"region": {"addr": 0, "len": 10, "location": "tpu:0"}, "keys": {"rkeys": []}}]),
    ] {
        let n = fake_segment_with(desc("tcp", serde_json::json!({"data_port": 1}), bufs));
        let e = a.open_segment(&n).unwrap_err();
        assert!(matches!(e, TransferError::Handshake { .. }), "{e}");
    }
    let n = fake_segment_with(|_| b"{not json".to_vec());
    assert!(matches!(
        a.open_segment(&n),
        Err(TransferError::Handshake { .. })
    ));
}

#[test]
fn a_data_peer_that_never_answers_fails_within_io_timeout() {
    let hole = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = hole.local_addr().unwrap().port();
    let keep = std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in hole.incoming().take(8) {
            held.push(s); // accept, never read or reply
        }
        std::thread::sleep(Duration::from_secs(12));
    });
    let name = fake_segment((0x10_0000, 1 << 30), port);
    let a = engine_with(|c| c.tcp.io_timeout = Duration::from_millis(800));
    let src = Buf::new(8 << 20, 9);
    src.register(&a);
    let t = Instant::now();
    // 8 MiB fills the socket buffers (write deadline) and no reply ever comes (read deadline)
    let e = a
        .transfer_sync_write(&name, src.addr(), 0x10_0000, src.len())
        .unwrap_err();
    assert!(matches!(e, TransferError::Failed { .. }), "{e}");
    let e = a
        .transfer_sync_read(&name, src.addr(), 0x10_0000, 64)
        .unwrap_err();
    assert!(matches!(e, TransferError::Failed { .. }), "{e}");
    // Each op waits at most an io_timeout per deadline (write, read) and tries once more after
    // fetching the peer's descriptor again: about 3.2 s; the rest is room for a loaded machine
    // (a wait without the deadline never ends).
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    drop(keep);
}

#[test]
fn a_killed_peer_gives_an_error_not_a_hang() {
    let a = engine();
    let b = engine();
    let src = Buf::new(4 << 20, 10);
    src.register(&a);
    let dst = Buf::zeroed(4 << 20);
    dst.register(&b);
    let name = b.segment_name();
    a.transfer_sync_write(&name, src.addr(), dst.addr(), 1 << 20)
        .unwrap(); // pooled connections up
    drop(b);
    let t = Instant::now();
    for i in 0..3 {
        let e = a
            .transfer_sync_write(&name, src.addr(), dst.addr(), 4 << 20)
            .unwrap_err();
        // the first write fails on the pooled connections (and the descriptor fetch that
        // follows); the dead peer is then forgotten, so later writes fail opening it
        if i == 0 {
            assert!(matches!(e, TransferError::Failed { .. }), "{e}");
        } else {
            assert!(matches!(e, TransferError::Handshake { .. }), "{e}");
        }
    }
    assert_eq!(a.stats().cached_segments, 0, "the dead peer is not cached");
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn a_timed_out_batch_sends_none_of_its_remaining_slices() {
    // one connection, one frame in flight: frames go out in order, one round trip each
    let a = engine_with(|c| {
        c.tcp.connections_per_peer = 1;
        c.tcp.inflight_per_connection = 1;
        c.tcp.coalesce_bytes = 64 * 1024;
    });
    let b = engine();
    let n = 256usize << 20;
    let src = Buf {
        bytes: vec![0xAB; n],
    };
    let dst = Buf::zeroed(n);
    let barrier = Buf::zeroed(4096);
    src.register(&a);
    dst.register(&b);
    barrier.register(&b);
    let seg = a.open_segment(&b.segment_name()).unwrap();
    let req = TransferRequest {
        op: Op::Write,
        local_addr: src.addr(),
        remote_addr: dst.addr(),
        len: n as u64,
    };
    let id = a.submit(&seg, &[req]).unwrap();
    assert!(matches!(
        a.wait(id, Duration::from_millis(1)),
        Err(TransferError::Timeout(_))
    ));
    // queued behind every frame of the timed-out batch on the same connection
    a.transfer_sync_write(&b.segment_name(), src.addr(), barrier.addr(), 4096)
        .unwrap();
    assert!(barrier.bytes.iter().all(|&x| x == 0xAB));
    let tail = &dst.bytes[n - (16 << 20)..];
    assert!(
        common::all_zero(tail),
        "slices of a timed-out batch were still sent"
    );
}

#[test]
fn wait_times_out_and_the_batch_reports_timeout() {
    let hole = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = hole.local_addr().unwrap().port();
    let keep = std::thread::spawn(move || {
        let s = hole.accept();
        std::thread::sleep(Duration::from_secs(3));
        drop(s);
    });
    let name = fake_segment((0x10_0000, 1 << 20), port);
    let a = engine_with(|c| c.tcp.io_timeout = Duration::from_secs(2));
    let src = Buf::new(64, 9);
    src.register(&a);
    let seg = a.open_segment(&name).unwrap();
    let req = TransferRequest {
        op: Op::Read,
        local_addr: src.addr(),
        remote_addr: 0x10_0000,
        len: 64,
    };
    let id = a.submit(&seg, &[req]).unwrap();
    let t = Instant::now();
    assert!(matches!(
        a.wait(id, Duration::from_millis(200)),
        Err(TransferError::Timeout(_))
    ));
    assert!(t.elapsed() < Duration::from_secs(2));
    assert_eq!(a.status(id), BatchStatus::Timeout);
    a.free_batch(id);
    assert_eq!(a.status(id), BatchStatus::Invalid);
    keep.join().unwrap();
}

// ------------------------------------------------------------------ malformed input

#[test]
fn malformed_handshake_frames_get_errors_and_the_engine_keeps_serving() {
    let b = engine();
    let name = b.segment_name();
    // (bytes, expect an error frame)
    let mut cases: Vec<(Vec<u8>, bool)> = vec![
        (vec![], false), // connect and close
        (
            (u64::MAX)
                .to_le_bytes()
                .iter()
                .cloned()
                .chain([1u8])
                .collect(),
            true,
        ),
        (
            ((2u64 << 20).to_le_bytes())
                .iter()
                .cloned()
                .chain([0u8])
                .collect(),
            true,
        ),
        (handshake_frame(7, b"{}"), true),
        (handshake_frame(0xFF, b"err"), true),
        (handshake_frame(0, b"{\"qp\": 1}"), true), // TCP takes no connect frames
        (vec![1, 2, 3], false),                     // truncated header
        (
            (100u64)
                .to_le_bytes()
                .iter()
                .cloned()
                .chain([1u8])
                .chain([0u8; 10])
                .collect(),
            false,
        ), // short body
    ];
    let mut x = 0x1234_5678_9abc_def1u64;
    for n in [1usize, 9, 100, 5000] {
        let v: Vec<u8> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        cases.push((v, false));
    }
    for (i, (bytes, expect_error)) in cases.into_iter().enumerate() {
        let mut s = connect(&name);
        s.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let reply = read_handshake_frame(&mut s);
        if expect_error {
            let (ty, body) = reply.unwrap_or_else(|| panic!("case {i}: no error frame"));
            assert_eq!(ty, 0xFF, "case {i}: {}", String::from_utf8_lossy(&body));
        }
    }
    // still serving: a fresh engine opens the segment and transfers
    let a = engine();
    let src = Buf::new(1000, 1);
    let dst = Buf::zeroed(1000);
    src.register(&a);
    dst.register(&b);
    a.transfer_sync_write(&name, src.addr(), dst.addr(), 1000)
        .unwrap();
    assert_same(&dst.bytes, &src.bytes, "after malformed handshakes");
}

#[test]
fn malformed_data_frames_get_errors_and_the_engine_keeps_serving() {
    let b = engine();
    let dst = Buf::new(1 << 16, 11);
    dst.register(&b);
    let before = dst.bytes.clone();
    let inst = b.local_descriptor().instance_id;
    let addr = data_addr(&b);
    // huge length with a valid header: refused with an error reply, then closed
    for (op, len) in [
        (1u8, u64::MAX),
        (1, 1 << 40),
        (2, u64::MAX),
        (1, 0),
        (2, 0),
        (9, 8),
    ] {
        let mut s = connect(&addr);
        s.write_all(&data_request(op, inst, dst.addr(), len))
            .unwrap();
        let (st, _) =
            read_data_reply(&mut s).unwrap_or_else(|| panic!("op {op} len {len}: no reply"));
        assert_eq!(st, 3, "op {op} len {len}: bad request");
        assert!(
            closed_by_peer(&mut s),
            "op {op} len {len}: closed after a bad request"
        );
    }
    // random bytes (bad magic): closed without touching memory
    let mut x = 0xfeed_beef_u64;
    for n in [1usize, 31, 32, 33, 1000, 100_000] {
        let v: Vec<u8> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut s = connect(&addr);
        let _ = s.write_all(&v);
        if n >= 32 {
            assert!(
                closed_by_peer(&mut s),
                "{n} random bytes: connection closed"
            );
        }
    }
    // a header then silence: the engine keeps serving others meanwhile
    let mut slow = connect(&addr);
    slow.write_all(&data_request(1, inst, dst.addr(), 100))
        .unwrap();
    assert_same(&dst.bytes[100..], &before[100..], "garbage wrote nothing");
    let a = engine();
    let src = Buf::new(1 << 16, 12);
    src.register(&a);
    a.transfer_sync_write(&b.segment_name(), src.addr(), dst.addr(), src.len())
        .unwrap();
    assert_same(&dst.bytes, &src.bytes, "after malformed data frames");
    drop(slow);
}

// ------------------------------------------------------------------ segments and descriptors

#[test]
fn descriptors_are_cached_and_refreshed_on_a_miss() {
    let a = engine();
    let b = engine();
    let src = Buf::new(1 << 16, 13);
    src.register(&a);
    let d1 = Buf::zeroed(1 << 12);
    d1.register(&b);
    let name = b.segment_name();
    let h1 = a.open_segment(&name).unwrap();
    assert_eq!(h1.descriptor().buffers.len(), 1);
    // registered after A cached the descriptor: the miss triggers one refresh
    let d2 = Buf::zeroed(1 << 12);
    d2.register(&b);
    a.transfer_sync_write(&name, src.addr(), d2.addr(), 4096)
        .unwrap();
    assert_same(
        &d2.bytes,
        &src.bytes[..4096],
        "write to a newly registered buffer",
    );
    assert_eq!(
        a.open_segment(&name).unwrap().descriptor().buffers.len(),
        2,
        "cache updated"
    );
    // the cache answers without the peer
    let inst = b.local_descriptor().instance_id;
    drop(b);
    let h = a.open_segment(&name).expect("cached descriptor");
    assert_eq!(h.descriptor().instance_id, inst);
    assert!(a.refresh_segment(&name).is_err(), "refresh needs the peer");
    a.close_segment(&name);
    assert!(
        a.open_segment(&name).is_err(),
        "closed segment is fetched again"
    );
}

#[test]
fn a_restarted_peer_is_noticed() {
    let a = engine();
    let b = engine();
    let src = Buf::new(4096, 14);
    src.register(&a);
    let dst = Buf::zeroed(4096);
    dst.register(&b);
    let name = b.segment_name();
    let port: u16 = name.rsplit_once(':').unwrap().1.parse().unwrap();
    a.transfer_sync_write(&name, src.addr(), dst.addr(), 4096)
        .unwrap();
    let old = b.local_descriptor().instance_id;
    drop(b);
    let c = engine_with(|cfg| cfg.port = port);
    dst.register(&c);
    assert_ne!(c.local_descriptor().instance_id, old);
    // the cached descriptor is stale: the failed slices make the engine fetch it again, and
    // the write lands in the new instance (never silently in the old one)
    a.transfer_sync_write(&name, src.addr(), dst.addr(), 4096)
        .unwrap();
    assert_eq!(
        a.open_segment(&name).unwrap().descriptor().instance_id,
        c.local_descriptor().instance_id,
        "the cached descriptor was replaced"
    );
    let h = a.refresh_segment(&name).unwrap();
    assert_eq!(h.descriptor().instance_id, c.local_descriptor().instance_id);
    a.transfer_sync_write(&name, src.addr(), dst.addr(), 4096)
        .unwrap();
}

// ------------------------------------------------------------------ configuration

#[test]
fn configuration_and_registration_errors_are_clear() {
    let e = TransferEngine::new(EngineConfig {
        transport: TransportKind::Rdma,
        ..common::config()
    })
    .err()
    .unwrap();
    assert!(
        // "no usable RDMA device" with the rdma feature, "this build has no RDMA transport" without
        matches!(e, TransferError::Config(ConfigError::RdmaUnusable(_)))
            && e.to_string().contains("RDMA is not usable here"),
        "{e}"
    );
    let e = TransferEngine::new(EngineConfig {
        slice_size: 0,
        ..common::config()
    })
    .err()
    .unwrap();
    assert!(
        matches!(
            e,
            TransferError::Config(ConfigError::OutOfRange {
                key: "slice_size",
                value: 0,
                ..
            })
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "configuration error: slice_size 0: expected at least 1"
    );
    let a = engine();
    let port: u16 = a
        .segment_name()
        .rsplit_once(':')
        .unwrap()
        .1
        .parse()
        .unwrap();
    let e = TransferEngine::new(EngineConfig {
        port,
        ..common::config()
    })
    .err()
    .unwrap();
    assert!(
        matches!(e, TransferError::Bind(ref io) if io.source.kind() == std::io::ErrorKind::AddrInUse),
        "{e}"
    );
    let auto = TransferEngine::new(EngineConfig {
        transport: TransportKind::Auto,
        ..common::config()
    })
    .unwrap();
    assert!(["tcp", "rdma"].contains(&auto.transport_name()));

    let buf = Buf::zeroed(4096);
    // SAFETY: `buf` outlives the engine; the zero-length registration is refused.
    unsafe {
        assert!(matches!(
            a.register_memory(buf.addr(), 0, Location::Cpu),
            Err(TransferError::Registration(
                RegistrationError::ZeroLength { .. }
            ))
        ));
        // without a usable GPU backend (no CUDA here), device memory is refused clearly;
        // with one, a host pointer is still not cuda:0 memory
        let e = a
            .register_memory(buf.addr(), 4096, Location::Cuda(0))
            .unwrap_err();
        assert!(
            matches!(
                e,
                TransferError::Unsupported(_) | TransferError::InvalidArgument(_)
            ) && e.to_string().contains("cuda:0"),
            "{e}"
        );
        a.register_memory(buf.addr(), 4096, Location::Cpu).unwrap();
        assert!(
            matches!(
                a.register_memory(buf.addr() + 4095, 1, Location::Cpu),
                Err(TransferError::Registration(
                    RegistrationError::Overlaps { .. }
                ))
            ),
            "overlap"
        );
    }
    assert!(a.unregister_memory(buf.addr() + 1).is_err());
    a.unregister_memory(buf.addr()).unwrap();
    for bad in ["nohost", "127.0.0.1", "127.0.0.1:0", ":5"] {
        assert!(
            matches!(a.open_segment(bad), Err(TransferError::BadSegmentName(_))),
            "{bad}"
        );
    }
}

#[test]
fn connection_floods_are_capped_and_the_engine_recovers() {
    let b = engine_with(|c| c.tcp.max_server_connections = 3);
    let dst = Buf::zeroed(4096);
    dst.register(&b);
    for addr in [data_addr(&b), b.segment_name()] {
        let held: Vec<TcpStream> = (0..3).map(|_| connect(&addr)).collect();
        std::thread::sleep(Duration::from_millis(100)); // let the server take them
        let mut extra = connect(&addr);
        extra
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        assert!(
            closed_by_peer(&mut extra),
            "{addr}: a connection over the cap is closed at once"
        );
        drop(held);
    }
    // once the flood is gone, transfers work again (server threads notice the closes)
    let a = engine_with(|c| c.tcp.connections_per_peer = 2);
    let src = Buf::new(4096, 15);
    src.register(&a);
    let t = Instant::now();
    loop {
        match a.transfer_sync_write(&b.segment_name(), src.addr(), dst.addr(), 4096) {
            Ok(()) => break,
            Err(e) if t.elapsed() < Duration::from_secs(5) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("engine did not recover: {e}"),
        }
    }
    assert_same(&dst.bytes, &src.bytes, "after the flood");
}

#[test]
fn register_memory_refuses_ranges_this_process_has_not_mapped() {
    let a = engine();
    // Address 1 for 2^63 bytes: a peer read memory the target never meant to expose.
    // SAFETY: refused before anything is registered.
    let e = unsafe { a.register_memory(1, 1 << 63, Location::Cpu) }.unwrap_err();
    assert!(
        matches!(
            e,
            TransferError::Registration(RegistrationError::NotMapped { at: 1, .. })
        ),
        "{e}"
    );
    // A real buffer, then one that runs a page past an anonymous mapping's end.
    let buf = Buf::new(8192, 1);
    // SAFETY: `buf` outlives the engine's use of it (unregistered below).
    unsafe { a.register_memory(buf.addr(), 8192, Location::Cpu) }.unwrap();
    a.unregister_memory(buf.addr()).unwrap();
    let page = 4096usize;
    // SAFETY: a fresh anonymous mapping of two pages whose second page is then unmapped.
    let m = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(m, libc::MAP_FAILED);
    // SAFETY: the second page of the mapping made above.
    let unmapped = unsafe { libc::munmap(m.cast::<u8>().add(page).cast(), page) };
    assert_eq!(unmapped, 0);
    // SAFETY: refused (the second page is not mapped), nothing registered.
    let e = unsafe { a.register_memory(m as u64, 2 * page as u64, Location::Cpu) }.unwrap_err();
    assert!(
        matches!(
            e,
            TransferError::Registration(RegistrationError::NotMapped { .. })
        ),
        "{e}"
    );
    // SAFETY: the first page, still mapped.
    unsafe { libc::munmap(m, page) };
}
