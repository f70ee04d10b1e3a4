//! The import's waits and what a failed import means for the allocations, without a GPU: a
//! peer whose handshake listener never answers, and turns held by another import.

use std::collections::{HashMap, HashSet};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_cuda::ipc::AllocationKind;

use super::keys::{HostIdentity, IpcRegionKeys};
use super::live::{LiveTable, LiveView};
use super::state::Peer;
use super::transport::CudaIpcTransport;
use crate::config::EngineConfig;
use crate::descriptor::{SegmentDescriptor, TransportInfo};
use crate::error::TransferError;
use crate::transport::{Transport, TransportContext};
use crate::types::TransportKind;

fn transport(handshake_timeout: Duration) -> Arc<CudaIpcTransport> {
    let ctx = TransportContext {
        config: EngineConfig {
            handshake_timeout,
            ..EngineConfig::default()
        },
        segment_name: "127.0.0.1:1".into(),
        instance_id: 1,
        registry: Arc::new(crate::memory::MemoryRegistry::new()),
        memory: Arc::new(crate::memory::HostMemoryAccess),
        auth: crate::auth::AuthState::new(None, "test"),
    };
    let inner: Arc<dyn Transport> =
        Arc::new(crate::transport::tcp::TcpTransport::new(ctx.clone()).unwrap());
    CudaIpcTransport::new(&ctx, inner).unwrap()
}

/// A peer at `name`, another process of some host.
fn peer(name: String) -> SegmentDescriptor {
    SegmentDescriptor {
        name,
        instance_id: 7,
        transport: TransportInfo {
            kind: TransportKind::Tcp,
            details: serde_json::json!({}),
        },
        buffers: Vec::new(),
    }
}

fn other_process() -> HostIdentity {
    HostIdentity {
        boot_id: "b".into(),
        machine_id: "m".into(),
        pid_ns: "pid:[1]".into(),
        pid: 2,
    }
}

fn keys(base: u64) -> Arc<IpcRegionKeys> {
    Arc::new(IpcRegionKeys {
        host: other_process(),
        device_uuid: "00".repeat(16),
        alloc_base: base,
        alloc_size: 0x10000,
        kind: AllocationKind::VmmFd,
    })
}

/// A handshake listener that accepts (the kernel does) and never answers.
fn silent_peer() -> (TcpListener, SegmentDescriptor) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let name = l.local_addr().unwrap().to_string();
    (l, peer(name))
}

/// A peer state with nothing mapped yet (as after an import of other allocations).
fn known_peer(t: &CudaIpcTransport, desc: &SegmentDescriptor) {
    let table = LiveTable::new().unwrap();
    t.peers.lock().unwrap().insert(
        desc.name.clone(),
        Peer {
            instance_id: desc.instance_id,
            live: LiveView::open(&table.fd()).unwrap(),
            mapped: HashMap::new(),
            failed: HashSet::new(),
        },
    );
}

/// One deadline for the whole warm-up: a peer that never answers costs it that deadline
/// once, not one handshake timeout per local device.
#[test]
fn a_warm_up_ends_at_its_deadline_over_every_device() {
    let t = transport(Duration::from_secs(20));
    let (_listener, desc) = silent_peer();
    let plan = vec![(0, vec![keys(0x10000)]), (1, vec![keys(0x40000)])];
    let t0 = Instant::now();
    let e = t
        .warm_parts(&desc, &plan, t0 + Duration::from_millis(300))
        .unwrap_err();
    assert!(matches!(e, TransferError::Timeout(_)), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

/// The wait for the turn behind another import of the peer ends at the warm-up's deadline,
/// not after a handshake timeout of its own.
#[test]
fn the_turn_wait_ends_at_the_warm_ups_deadline() {
    let t = transport(Duration::from_secs(20));
    let (_listener, desc) = silent_peer();
    let _other = t
        .importing
        .turn(&desc.name, Duration::from_secs(1))
        .unwrap();
    let t0 = Instant::now();
    let k = keys(0x10000);
    let by = t0 + Duration::from_millis(200);
    let e = t.import(&desc, &[&k], 0, Some(by)).unwrap_err();
    assert!(matches!(e, TransferError::Timeout(_)), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

/// A post that waited out its turn behind another import fails with `Timeout`, and the
/// allocations stay importable: the next post asks again instead of taking the fallback.
/// A request that failed marks them failed, as before.
#[test]
fn a_post_that_waits_out_its_turn_leaves_the_allocations_importable() {
    let t = transport(Duration::from_millis(200));
    let (_listener, desc) = silent_peer();
    known_peer(&t, &desc);
    let k = keys(0x10000);
    let allocs = [&*k];
    let turn = t
        .importing
        .turn(&desc.name, Duration::from_secs(1))
        .unwrap();
    let e = t.import(&desc, &allocs, 0, None).unwrap_err();
    assert!(matches!(e, TransferError::Timeout(_)), "{e}");
    assert!(!t.import_failed(&desc, 0, &allocs, &e));
    assert!(t.peers.lock().unwrap()[&desc.name].failed.is_empty());
    drop(turn);
    // A peer that is not there: the request fails, not a wait; marked for this device only.
    let gone = peer("127.0.0.1:1".into());
    known_peer(&t, &gone);
    let e = t.import(&gone, &allocs, 0, None).unwrap_err();
    assert!(!matches!(e, TransferError::Timeout(_)), "{e}");
    assert!(t.import_failed(&gone, 0, &allocs, &e));
    let peers = t.peers.lock().unwrap();
    assert!(peers[&gone.name].failed.contains(&(0, 0x10000)));
    assert!(!peers[&gone.name].failed.contains(&(1, 0x10000)));
}

/// A group whose keys name two processes (one of them this one) is refused with a typed
/// error before anything is asked or mapped: mapped as one, one key's host would decide for
/// all (an allocation of another process taken as this process's addresses, or the reverse).
#[test]
fn a_group_that_mixes_processes_is_refused() {
    let t = transport(Duration::from_secs(20));
    let (_listener, desc) = silent_peer();
    let mut mine = (*keys(0x10000)).clone();
    mine.host = HostIdentity::local().unwrap_or_else(other_process);
    mine.host.pid = std::process::id();
    let theirs = keys(0x40000);
    let t0 = Instant::now();
    let e = t.import(&desc, &[&mine, &theirs], 0, None).unwrap_err();
    assert!(
        matches!(
            e,
            TransferError::Protocol(crate::error::ProtocolError::CudaIpcMixedProcesses { .. })
        ),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "nothing was asked");
    assert!(t.peers.lock().unwrap().get(&desc.name).is_none());
    // The same process throughout is one group.
    assert!(super::peer::one_process("p", &[&theirs, &keys(0x50000)])
        .unwrap()
        .is_some());
}

/// A peer process seen alive is taken as alive for `ALIVE_FOR` without a system call per
/// post; after that the next post asks again and finds it gone, and one gone is asked about
/// every time.
#[test]
fn a_peer_seen_alive_is_asked_about_again_only_after_a_while() {
    let t = transport(Duration::from_secs(1));
    let Some(me) = HostIdentity::local().filter(|h| !h.pid_ns.is_empty()) else {
        eprintln!("SKIPPED: no pid namespace to compare pids in");
        return;
    };
    let mut child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let host = HostIdentity {
        pid: child.id(),
        ..me
    };
    let t0 = Instant::now();
    assert!(!t.peer_gone(&host, t0));
    child.kill().unwrap();
    child.wait().unwrap();
    let alive_for = super::peer::ALIVE_FOR;
    assert!(
        !t.peer_gone(&host, t0 + alive_for / 2),
        "seen alive a moment ago: not asked again"
    );
    assert!(t.peer_gone(&host, t0 + alive_for), "asked again: gone");
    assert!(
        t.peer_gone(&host, t0 + alive_for),
        "gone: asked again, still gone"
    );
}

/// A peer's range as this process's kernels read it: only inside one of its buffers, what
/// its live table holds and the allocation as mapped for that device; `None` (nothing set
/// up) before the allocation is mapped for that device; the mapping kept by the range.
#[test]
fn a_mapped_range_is_only_what_is_registered_and_mapped() {
    use crate::memory::{MemoryRegion, RegionKeys, RegistrationPath};
    use crate::transport::Transport;
    use crate::types::Location;
    let t = transport(Duration::from_secs(1));
    let (base, size) = (0x10000u64, 0x10000u64);
    let mut desc = peer("127.0.0.1:9".into());
    let field = super::transport::KEYS_FIELD;
    let keys_json = crate::memory::TransportKeys::encode(
        &serde_json::json!({ field: serde_json::to_value(&*keys(base)).unwrap() }),
    )
    .unwrap();
    desc.buffers.push(crate::descriptor::BufferDesc {
        region: MemoryRegion {
            addr: base,
            len: size,
            location: Location::Cuda(0),
        },
        keys: RegionKeys::new(RegistrationPath::default(), keys_json),
    });
    let desc = Arc::new(desc);
    let one = |t: &CudaIpcTransport, d: &Arc<SegmentDescriptor>, dev, addr, len| {
        t.mapped(d, dev, &[(addr, len)])
            .map(|r| r.map(|mut v| v.remove(0)))
    };
    assert!(one(&t, &desc, 0, base, 64).is_none(), "no peer state yet");
    let mut table = LiveTable::new().unwrap();
    // Registered now: the first half only.
    table.publish(&[(base, size / 2)]).unwrap();
    let mapping = Arc::new(super::state::Mapped::InProcess(0x7000_0000));
    t.peers.lock().unwrap().insert(
        desc.name.clone(),
        Peer {
            instance_id: desc.instance_id,
            live: LiveView::open(&table.fd()).unwrap(),
            mapped: HashMap::from([((0, base), (size, mapping.clone()))]),
            failed: HashSet::new(),
        },
    );
    let r = one(&t, &desc, 0, base + 0x100, 64).unwrap().unwrap();
    assert_eq!(r.ptr(), 0x7000_0100);
    assert_eq!(
        Arc::strong_count(&mapping),
        3,
        "the range keeps the mapping"
    );
    let two = t
        .mapped(&desc, 0, &[(base, 8), (base + 0x200, 8)])
        .unwrap()
        .unwrap();
    let ptrs: Vec<u64> = two.iter().map(|r| r.ptr()).collect();
    assert_eq!(ptrs, [0x7000_0000, 0x7000_0200]);
    assert!(
        one(&t, &desc, 1, base, 64).is_none(),
        "not mapped for device 1"
    );
    let out = |addr, len| {
        matches!(
            one(&t, &desc, 0, addr, len),
            Some(Err(TransferError::RemoteOutOfRange { .. }))
        )
    };
    assert!(
        matches!(
            t.mapped(&desc, 0, &[(base, 8), (base + size / 2, 8)]),
            Some(Err(TransferError::RemoteOutOfRange { .. }))
        ),
        "one range of many outside: all refused"
    );
    assert!(out(base + size / 2 - 8, 16), "past what is registered now");
    assert!(out(base - 8, 16), "outside the buffer");
    assert!(out(base + size, 8), "past the buffer");
    // Another instance of the peer (restarted): its entry is not this one's.
    let other = Arc::new(SegmentDescriptor {
        instance_id: 8,
        ..(*desc).clone()
    });
    assert!(one(&t, &other, 0, base, 64).is_none());
}
