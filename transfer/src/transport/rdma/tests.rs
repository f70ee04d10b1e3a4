//! Tests of the RDMA transport below the engine: the Connect checks, the in-flight table, the
//! path MTU rule (pure, run everywhere), and on a device (soft-RoCE in the guest) a request
//! outside the target's memory region with a valid rkey, and the path MTU of mixed-MTU peers.
//! Device tests skip with a reason when no device is usable, unless `KVFERRY_REQUIRE_RDMA=1`.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use super::connect::{check_request, CloseNotice, ConnectRequest, QpInfo, CONNECT_VERSION};
use super::qp::path_mtu;
use super::{PortInfo, RdmaTransport};
use crate::config::{EngineConfig, RdmaConfig};
use crate::descriptor::{BufferDesc, SegmentDescriptor};
use crate::error::{ConfigError, TransferError};
use crate::handshake::{FrameType, HandshakeServer};
use crate::memory::{HostMemoryAccess, MemoryRegion, MemoryRegistry};
use crate::transport::completion::BatchState;
use crate::transport::{CompletionSink, Slice, Transport, TransportContext};
use crate::types::{BatchStatus, Location, Op, TransportKind};

pub(super) fn port(mtu: u32) -> PortInfo {
    PortInfo {
        name: "rxe0".into(),
        port: 1,
        gid_index: 1,
        gid: "::ffff:10.99.0.1".into(),
        lid: 0,
        active_mtu: mtu,
        ethernet: true,
    }
}

fn request() -> ConnectRequest {
    ConnectRequest {
        version: CONNECT_VERSION,
        initiator: "127.0.0.1:1".into(),
        endpoint_id: 7,
        replaces: None,
        device: 0,
        initiator_instance: Some(3),
        port: port(1024),
        qps: vec![QpInfo { qpn: 17, psn: 5 }],
    }
}

#[test]
fn close_notices_and_connect_requests_never_parse_as_each_other() {
    let req = serde_json::to_vec(&request()).unwrap();
    assert!(serde_json::from_slice::<CloseNotice>(&req).is_err());
    let close = serde_json::to_vec(&CloseNotice {
        version: CONNECT_VERSION,
        initiator: "127.0.0.1:1".into(),
        close: vec![7, 8],
    })
    .unwrap();
    assert!(serde_json::from_slice::<ConnectRequest>(&close).is_err());
    let back: CloseNotice = serde_json::from_slice(&close).unwrap();
    assert_eq!(back.close, vec![7, 8]);
    // an initiator of before the instance field still parses
    let mut old: serde_json::Value = serde_json::from_slice(&req).unwrap();
    old.as_object_mut().unwrap().remove("initiator_instance");
    let r: ConnectRequest = serde_json::from_value(old).unwrap();
    assert_eq!(r.initiator_instance, None);
}

#[test]
fn path_mtu_is_the_smaller_side() {
    assert_eq!(path_mtu(1024, 512).unwrap(), 512);
    assert_eq!(path_mtu(256, 4096).unwrap(), 256);
    assert_eq!(path_mtu(4096, 4096).unwrap(), 4096);
    assert!(path_mtu(1024, 1500).is_ok(), "min is 1024");
    assert!(path_mtu(1000, 4096).is_err(), "1000 is not an IB MTU");
}

#[test]
fn connect_requests_are_checked_before_any_verbs_call() {
    assert!(check_request(&request(), 1).is_ok());
    type Mutation = Box<dyn Fn(&mut ConnectRequest)>;
    let bad: Vec<(&str, Mutation)> = vec![
        ("version", Box::new(|r| r.version = 99)),
        ("no QPs", Box::new(|r| r.qps.clear())),
        (
            "too many QPs",
            Box::new(|r| r.qps = vec![QpInfo { qpn: 1, psn: 1 }; 65]),
        ),
        ("device", Box::new(|r| r.device = 1)),
        ("MTU", Box::new(|r| r.port.active_mtu = 1500)),
        ("QPN", Box::new(|r| r.qps[0].qpn = 1 << 24)),
    ];
    for (what, f) in bad {
        let mut r = request();
        f(&mut r);
        let e = check_request(&r, 1).expect_err(what);
        assert!(matches!(e, TransferError::Protocol(_)), "{what}: {e:?}");
    }
    assert!(port(1024).gid_value().is_ok());
    let mut p = port(1024);
    p.gid = "not a gid".into();
    assert!(matches!(p.gid_value(), Err(TransferError::Protocol(_))));
}

#[test]
fn config_is_checked() {
    let mut c = RdmaConfig::default();
    assert!(super::device::check_config(&c).is_ok());
    c.mtu = Some(1500);
    assert!(super::device::check_config(&c).is_err());
    c = RdmaConfig {
        qps_per_endpoint: 0,
        ..RdmaConfig::default()
    };
    assert!(super::device::check_config(&c).is_err());
    c = RdmaConfig {
        retry_count: 8,
        ..RdmaConfig::default()
    };
    assert!(super::device::check_config(&c).is_err());
    // a merged work request of more than 1 GiB is refused (its length must fit the verbs u32)
    c = RdmaConfig {
        merge_bytes: (1 << 30) + 1,
        ..RdmaConfig::default()
    };
    assert!(super::device::check_config(&c).is_err());
    c.merge_bytes = 1 << 30;
    assert!(super::device::check_config(&c).is_ok());
}

#[test]
fn unknown_device_gives_none_and_a_config_error_without_panicking() {
    // holds with or without libibverbs on the machine
    let rdma = RdmaConfig {
        devices: vec!["no-such-device-xyz".into()],
        ..RdmaConfig::default()
    };
    assert!(super::probe(&rdma).is_none());
    let (ctx, _l) = context(EngineConfig {
        rdma,
        ..EngineConfig::default()
    });
    match super::create(&ctx) {
        // without libibverbs the device list itself fails
        Err(TransferError::Config(e @ ConfigError::RdmaDeviceList(_))) => {
            assert!(e.to_string().starts_with("no usable RDMA device"), "{e}")
        }
        Err(TransferError::Config(e @ ConfigError::NoRdmaDevice { .. })) => {
            assert!(e.to_string().contains("\"no-such-device-xyz\""), "{e}")
        }
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("a transport on a device that does not exist"),
    }
}

/// True when an RDMA device is usable; else prints why (or panics with KVFERRY_REQUIRE_RDMA=1).
fn rdma_or_skip(test: &str) -> bool {
    if super::probe(&RdmaConfig::default()).is_some() {
        return true;
    }
    if std::env::var("KVFERRY_REQUIRE_RDMA").is_ok_and(|v| v == "1") {
        panic!("{test}: KVFERRY_REQUIRE_RDMA=1 but no usable RDMA device was found");
    }
    // Straight to stderr: libtest hides a passing test's eprintln! output.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: no usable RDMA device");
    false
}

fn context(config: EngineConfig) -> (TransportContext, TcpListener) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let name = l.local_addr().unwrap().to_string();
    let ctx = TransportContext {
        config,
        segment_name: name,
        instance_id: crate::ids::random_u64(),
        registry: Arc::new(MemoryRegistry::new()),
        memory: Arc::new(HostMemoryAccess),
        auth: crate::auth::AuthState::new(None, "test"),
    };
    (ctx, l)
}

/// An RDMA transport with a handshake listener that hands Connect frames to it.
struct Node {
    t: Arc<RdmaTransport>,
    name: String,
    instance: u64,
    _server: HandshakeServer,
}

fn node(f: impl FnOnce(&mut EngineConfig)) -> Node {
    let mut c = EngineConfig {
        transport: TransportKind::Rdma,
        ..EngineConfig::default()
    };
    f(&mut c);
    let (ctx, l) = context(c);
    let t = RdmaTransport::new(&ctx).expect("RDMA transport");
    let t2 = t.clone();
    let handler =
        move |ty: FrameType, body: &[u8], session: &mut crate::handshake::Session| match ty {
            FrameType::Connect => t2.on_handshake(session.peer, body),
            _ => Err(TransferError::Protocol(
                crate::error::ProtocolError::NotARequest("non-Connect"),
            )),
        };
    let server = HandshakeServer::start(l, Arc::new(handler), Duration::from_secs(5), 16).unwrap();
    Node {
        t,
        name: ctx.segment_name,
        instance: ctx.instance_id,
        _server: server,
    }
}

fn register(n: &Node, addr: u64, len: u64) -> (MemoryRegion, crate::memory::RegionKeys) {
    let r = MemoryRegion {
        addr,
        len,
        location: Location::Cpu,
    };
    let k = n.t.register(&r).expect("register");
    (r, k)
}

/// `target`'s segment as an initiator sees it: one buffer, `region` (host memory) with the
/// `keys` `target` registered for it. `region` may claim more than was registered.
fn descriptor(
    target: &Node,
    region: MemoryRegion,
    keys: crate::memory::RegionKeys,
) -> Arc<SegmentDescriptor> {
    Arc::new(SegmentDescriptor {
        name: target.name.clone(),
        instance_id: target.instance,
        transport: target.t.local_info(),
        buffers: vec![BufferDesc { region, keys }],
    })
}

/// Registers `remote` whole on `target` and `local` whole on `init` (each the address and
/// length of host memory): the descriptor `init` posts to (its one buffer, index 0, is
/// `remote`) and `init`'s region for `local`.
fn one_buffer_each(
    target: &Node,
    init: &Node,
    (remote, remote_len): (u64, u64),
    (local, local_len): (u64, u64),
) -> (Arc<SegmentDescriptor>, MemoryRegion) {
    let (region, keys) = register(target, remote, remote_len);
    let (local_region, _) = register(init, local, local_len);
    (descriptor(target, region, keys), local_region)
}

/// Posts `slices` in one call and waits (60 s at most) for the batch's outcome.
fn run_all(n: &Node, peer: &Arc<SegmentDescriptor>, slices: &[Slice]) -> BatchStatus {
    let st = BatchState::new(slices.len() as u32);
    n.t.post(peer, slices, CompletionSink::new(st.clone()), None);
    let _ = st.wait(Duration::from_secs(60));
    st.status()
}

/// Posts one slice and waits for its outcome.
fn run(n: &Node, peer: &Arc<SegmentDescriptor>, slice: Slice) -> BatchStatus {
    run_all(n, peer, &[slice])
}

#[test]
fn rdma_out_of_region_request_with_a_valid_rkey_is_refused_and_writes_nothing() {
    if !rdma_or_skip("rdma_out_of_region_request_with_a_valid_rkey_is_refused_and_writes_nothing") {
        return;
    }
    let target = node(|_| {});
    let init = node(|_| {});
    const K: usize = 64 << 10;
    let remote = vec![0xA5u8; 3 * K];
    let local: Vec<u8> = (0..K).map(|i| (i * 7 + 3) as u8).collect();
    // only the middle third is registered on the target
    let mid = remote.as_ptr() as u64 + K as u64;
    let (_, keys) = register(&target, mid, K as u64);
    let (lr, _) = register(&init, local.as_ptr() as u64, K as u64);
    // a descriptor that claims twice the registered length: the engine's own check passes, the
    // NIC's rkey scope must refuse
    let claimed = MemoryRegion {
        addr: mid,
        len: 2 * K as u64,
        location: Location::Cpu,
    };
    let peer = descriptor(&target, claimed, keys);
    let slice = |op, remote_addr, len| Slice {
        id: 0,
        op,
        local_addr: lr.addr,
        local_region: lr,
        remote_addr,
        remote_buffer: 0,
        len,
    };
    for (what, addr, len) in [
        ("crossing the region's end", mid + K as u64 - 100, 4096u64),
        ("past the region's end", mid + K as u64 + 10, 4096),
    ] {
        for op in [Op::Write, Op::Read] {
            match run(&init, &peer, slice(op, addr, len)) {
                BatchStatus::Failed(t) => {
                    let t = t.to_string();
                    eprintln!("{what} {op:?}: {t}");
                    assert!(t.contains("remote access error"), "{what} {op:?}: {t}");
                }
                s => panic!("{what} {op:?}: {s:?}"),
            }
            assert!(
                remote.iter().all(|&b| b == 0xA5),
                "{what} {op:?}: target bytes changed"
            );
        }
    }
    // the same pair still works inside the region (a fresh endpoint replaced the failed one)
    assert_eq!(
        run(&init, &peer, slice(Op::Write, mid + 5, 1000)),
        BatchStatus::Completed
    );
    assert_eq!(&remote[K + 5..K + 1005], &local[..1000]);
    assert!(remote[..K + 5]
        .iter()
        .chain(&remote[K + 1005..])
        .all(|&b| b == 0xA5));
}

#[test]
fn rdma_path_mtu_is_the_smaller_of_both_sides() {
    if !rdma_or_skip("rdma_path_mtu_is_the_smaller_of_both_sides") {
        return;
    }
    for (init_mtu, target_mtu) in [(Some(512), None), (None, Some(256)), (Some(256), Some(512))] {
        let target = node(|c| c.rdma.mtu = target_mtu);
        let init = node(|c| c.rdma.mtu = init_mtu);
        let port_mtu = init.t.ports()[0]
            .active_mtu
            .max(target.t.ports()[0].active_mtu);
        let want = init_mtu
            .unwrap_or(port_mtu)
            .min(target_mtu.unwrap_or(port_mtu));
        let remote = vec![0u8; 100_000];
        let local: Vec<u8> = (0..100_000).map(|i| (i % 251) as u8).collect();
        let (peer, lr) = one_buffer_each(
            &target,
            &init,
            (remote.as_ptr() as u64, remote.len() as u64),
            (local.as_ptr() as u64, local.len() as u64),
        );
        let s = Slice {
            id: 0,
            op: Op::Write,
            local_addr: lr.addr,
            local_region: lr,
            remote_addr: remote.as_ptr() as u64,
            remote_buffer: 0,
            len: 100_000,
        };
        assert_eq!(
            run(&init, &peer, s),
            BatchStatus::Completed,
            "MTUs {init_mtu:?}/{target_mtu:?}"
        );
        assert_eq!(remote, local);
        assert_eq!(
            init.t.path_mtus(&target.name),
            vec![want],
            "MTUs {init_mtu:?}/{target_mtu:?}"
        );
        assert_eq!(target.t.passive_endpoints(), 1);
    }
}

#[test]
fn rdma_garbage_connect_frames_are_refused_without_panicking() {
    if !rdma_or_skip("rdma_garbage_connect_frames_are_refused_without_panicking") {
        return;
    }
    let target = node(|_| {});
    let peer = "127.0.0.1:9".parse().unwrap();
    for body in [&b""[..], b"{", b"[]", b"{\"version\":1}", &[0xff; 64][..]] {
        let e = target
            .t
            .on_handshake(peer, body)
            .expect_err("garbage accepted");
        assert!(matches!(e, TransferError::Protocol(_)), "{e:?}");
    }
    let mut r = request();
    r.device = 3;
    let e = target
        .t
        .on_handshake(peer, &serde_json::to_vec(&r).unwrap())
        .unwrap_err();
    assert!(matches!(e, TransferError::Protocol(_)), "{e:?}");
    // a well-formed request towards a QP that does not exist still sets up (the target cannot
    // tell); nothing is left half-made when the GID is bad
    let mut r = request();
    r.port.gid = "zz".into();
    assert!(target
        .t
        .on_handshake(peer, &serde_json::to_vec(&r).unwrap())
        .is_err());
    assert_eq!(target.t.passive_endpoints(), 0);
}

#[test]
fn rdma_slices_in_flight_on_a_failed_endpoint_are_retried_on_a_fresh_one() {
    if !rdma_or_skip("rdma_slices_in_flight_on_a_failed_endpoint_are_retried_on_a_fresh_one") {
        return;
    }
    const SLICE: usize = 64 << 10;
    const N: usize = 512; // 32 MiB: under soft-RoCE most of it is in flight at the disconnect
                          // one work request per slice, and 16 slices merged per work request: either way each
                          // slice of a failed work request is retried (or failed) on its own
    for (max_retries, merge_bytes) in [(0, 0), (3, 0), (0, 1 << 20), (3, 1 << 20)] {
        eprintln!("max_retries {max_retries}, merge_bytes {merge_bytes}");
        let target = node(|_| {});
        let init = node(|c| {
            c.rdma.max_retries = max_retries;
            c.rdma.merge_bytes = merge_bytes;
        });
        let remote = vec![0u8; N * SLICE];
        let local: Vec<u8> = (0..N * SLICE)
            .map(|i| (i % 253) as u8 ^ (i >> 16) as u8)
            .collect();
        let (peer, lr) = one_buffer_each(
            &target,
            &init,
            (remote.as_ptr() as u64, remote.len() as u64),
            (local.as_ptr() as u64, local.len() as u64),
        );
        let slices: Vec<Slice> = (0..N)
            .map(|i| Slice {
                id: i as u32,
                op: Op::Write,
                local_addr: lr.addr + (i * SLICE) as u64,
                local_region: lr,
                remote_addr: remote.as_ptr() as u64 + (i * SLICE) as u64,
                remote_buffer: 0,
                len: SLICE as u64,
            })
            .collect();
        let st = BatchState::new(N as u32);
        init.t
            .post(&peer, &slices, CompletionSink::new(st.clone()), None);
        let t0 = std::time::Instant::now();
        while init.t.slices_in_flight() < N / 2 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let in_flight = init.t.slices_in_flight();
        // the target drops its side (as a restarted peer would): no more ACKs, the initiator's
        // work requests exceed their retries, the endpoint fails
        target.t.disconnect(&init.name);
        eprintln!("max_retries {max_retries}: disconnected with {in_flight} slices in flight");
        let _ = st.wait(Duration::from_secs(120));
        let retried = init.t.retried_slices();
        match (max_retries, st.status()) {
            (0, BatchStatus::Failed(t)) => {
                let t = t.to_string();
                eprintln!("no retries: {t}");
                assert!(
                    t.to_lowercase().contains("retry"),
                    "the retry-exceeded status is named: {t}"
                );
            }
            (0, s) => panic!("with no retries a flushed slice must fail: {s:?}"),
            (_, BatchStatus::Completed) => {
                eprintln!("{retried} slices retried on a fresh endpoint");
                assert!(retried > 0, "the disconnect hit no work request in flight");
                assert!(remote == local, "bytes differ after the retries");
            }
            (_, s) => panic!("retries on a fresh endpoint must complete the batch: {s:?}"),
        }
    }
}

#[test]
fn rdma_consecutive_slices_merge_into_one_work_request_only_where_they_continue() {
    if !rdma_or_skip("rdma_consecutive_slices_merge_into_one_work_request_only_where_they_continue")
    {
        return;
    }
    const S: usize = 64 << 10;
    // (op, local slot, remote slot) in units of S
    let mut layout: Vec<(Op, usize, usize)> = (0..32).map(|i| (Op::Write, i, i)).collect();
    layout.push((Op::Write, 32, 33)); // a gap on the remote side: a new work request
    layout.push((Op::Write, 33, 34)); // continues the one before on both sides
    layout.push((Op::Read, 34, 35)); // continues in addresses, another operation
    layout.push((Op::Write, 36, 36)); // a gap on the local side
                                      // merge_bytes -> work requests: 0..32 in 1 MiB (or 256 KiB) runs, then 32-33, 34, 35
    for (merge_bytes, want) in [(1u64 << 20, 5u64), (256 << 10, 11), (0, 36)] {
        let target = node(|_| {});
        let init = node(|c| c.rdma.merge_bytes = merge_bytes);
        let remote = vec![0xA5u8; 40 * S];
        let mut local: Vec<u8> = (0..40 * S)
            .map(|i| (i % 251) as u8 ^ (i >> 16) as u8)
            .collect();
        let expect_local = {
            let mut l = local.clone();
            l[34 * S..35 * S].fill(0xA5);
            l
        };
        let (peer, lr) = one_buffer_each(
            &target,
            &init,
            (remote.as_ptr() as u64, remote.len() as u64),
            (local.as_mut_ptr() as u64, local.len() as u64),
        );
        let slices: Vec<Slice> = layout
            .iter()
            .enumerate()
            .map(|(id, &(op, l, r))| Slice {
                id: id as u32,
                op,
                local_addr: lr.addr + (l * S) as u64,
                local_region: lr,
                remote_addr: remote.as_ptr() as u64 + (r * S) as u64,
                remote_buffer: 0,
                len: S as u64,
            })
            .collect();
        assert_eq!(
            run_all(&init, &peer, &slices),
            BatchStatus::Completed,
            "merge {merge_bytes}"
        );
        assert_eq!(
            init.t.work_requests_posted(),
            want,
            "merge_bytes {merge_bytes}: work requests posted"
        );
        for &(op, l, r) in &layout {
            if op == Op::Write {
                assert!(
                    remote[r * S..(r + 1) * S] == local[l * S..(l + 1) * S],
                    "merge {merge_bytes}: write of local slot {l} to remote slot {r}"
                );
            }
        }
        assert!(
            local == expect_local,
            "merge {merge_bytes}: the read landed"
        );
        for untouched in [32, 37, 38, 39] {
            assert!(
                remote[untouched * S..(untouched + 1) * S]
                    .iter()
                    .all(|&b| b == 0xA5),
                "merge {merge_bytes}: remote slot {untouched} changed"
            );
        }
    }
}

#[test]
fn rdma_a_posted_chain_signals_only_its_last_work_request() {
    if !rdma_or_skip("rdma_a_posted_chain_signals_only_its_last_work_request") {
        return;
    }
    const S: usize = 16 << 10;
    const N: usize = 100;
    // slice i goes from local slot i to remote slot N-1-i: no two continue each other, so each
    // is a work request of its own; one post puts all of them on the endpoint at once
    // (qps, post_chain) -> signalled: ceil(per QP / post_chain) per QP
    for (qps, chain, want) in [(1usize, 32usize, 4u64), (2, 32, 4), (2, 8, 14), (1, 1, 100)] {
        let target = node(|_| {});
        let init = node(|c| {
            c.rdma.qps_per_endpoint = qps;
            c.rdma.post_chain = chain;
        });
        let remote = vec![0u8; N * S];
        let local: Vec<u8> = (0..N * S)
            .map(|i| (i % 253) as u8 ^ (i >> 14) as u8)
            .collect();
        let (peer, lr) = one_buffer_each(
            &target,
            &init,
            (remote.as_ptr() as u64, remote.len() as u64),
            (local.as_ptr() as u64, local.len() as u64),
        );
        let slices: Vec<Slice> = (0..N)
            .map(|i| Slice {
                id: i as u32,
                op: Op::Write,
                local_addr: lr.addr + (i * S) as u64,
                local_region: lr,
                remote_addr: remote.as_ptr() as u64 + ((N - 1 - i) * S) as u64,
                remote_buffer: 0,
                len: S as u64,
            })
            .collect();
        let what = format!("{qps} QPs, chains of {chain}");
        assert_eq!(
            run_all(&init, &peer, &slices),
            BatchStatus::Completed,
            "{what}"
        );
        assert_eq!(init.t.work_requests_posted(), N as u64, "{what}: posted");
        assert_eq!(init.t.work_completions(), want, "{what}: work completions");
        assert_eq!(init.t.work_requests_in_flight(), 0, "{what}: in flight");
        for i in 0..N {
            let r = N - 1 - i;
            assert!(
                remote[r * S..(r + 1) * S] == local[i * S..(i + 1) * S],
                "{what}: slice {i}"
            );
        }
    }
}
