//! The CUDA IPC transport's tests that need no GPU: the handle service's gate (the secret's
//! proof, replays, malformed requests) and the slice size it cuts copies into.

use super::super::fdpass::hex;
use super::super::state::{allocs_bytes, Envelope, Request, MAX_ALLOCS_PER_REQUEST, PROOF_LABEL};
use super::*;
use crate::auth::{Credential, GrantOps, GrantSpec, Secret, Token};
use crate::config::{AuthConfig, EngineConfig};
use crate::handshake::{self, FrameType};
use std::collections::{HashMap, HashSet};

fn secret() -> Secret {
    Secret::from_bytes(b"0123456789abcdef0123").unwrap()
}

fn ask(
    engine: &crate::TransferEngine,
    cred: Option<&Credential>,
    proof_with: Option<&Secret>,
) -> TransferError {
    let nonce = [7u8; 32];
    let body = serde_json::to_vec(&Envelope {
        cuda_ipc: Request {
            version: 1,
            nonce: hex(&nonce),
            proof: proof_with.map(|s| hex(&s.prove(PROOF_LABEL, &[&nonce, &allocs_bytes(&[])]))),
            allocs: vec![],
            instance: None,
        },
    })
    .unwrap();
    handshake::request_with(
        &engine.segment_name(),
        FrameType::Connect,
        &body,
        Duration::from_secs(5),
        cred,
    )
    .unwrap_err()
}

/// In secret mode a handle goes only to a peer that proves the secret: a grant token (good
/// for some ranges only) or a connection without the proof gets nothing.
#[test]
fn handles_need_the_secrets_proof() {
    let engine = crate::TransferEngine::new(EngineConfig {
        auth: AuthConfig {
            secret: Some(secret()),
            ..AuthConfig::default()
        },
        cuda_ipc: CudaIpcMode::Required,
        ..EngineConfig::default()
    })
    .unwrap();
    let token = Token::random().unwrap();
    let _g = engine
        .grant(GrantSpec {
            token,
            ops: GrantOps::WRITE,
            ranges: vec![(0x1000, 16)],
            ttl: Duration::from_secs(60),
        })
        .unwrap();
    let e = ask(&engine, Some(&Credential::Token(token)), None);
    assert!(e.to_string().contains("need the shared secret"), "{e}");
    let e = ask(
        &engine,
        Some(&Credential::Secret {
            secret: secret(),
            initiator: "127.0.0.1:9".into(),
        }),
        None,
    );
    assert!(e.to_string().contains("need the shared secret"), "{e}");
    let wrong = Secret::from_bytes(b"another secret of 20").unwrap();
    let e = ask(
        &engine,
        Some(&Credential::Secret {
            secret: secret(),
            initiator: "127.0.0.1:9".into(),
        }),
        Some(&wrong),
    );
    assert!(e.to_string().contains("need the shared secret"), "{e}");
    // The right proof passes the gate (then: nothing is exported on this machine).
    let e = ask(
        &engine,
        Some(&Credential::Secret {
            secret: secret(),
            initiator: "127.0.0.1:9".into(),
        }),
        Some(&secret()),
    );
    assert!(
        e.to_string().contains("no region is exported"),
        "the proof should pass: {e}"
    );
    // ...once: the same nonce again is a replay.
    let e = ask(
        &engine,
        Some(&Credential::Secret {
            secret: secret(),
            initiator: "127.0.0.1:9".into(),
        }),
        Some(&secret()),
    );
    assert!(e.to_string().contains("replayed"), "{e}");
}

#[test]
fn ipc_slices_are_large_but_fit_the_fallback_transport() {
    let mut c = EngineConfig::default();
    assert_eq!(ipc_slice_size(&c, TransportKind::Rdma), IPC_SLICE_MAX);
    assert_eq!(
        ipc_slice_size(&c, TransportKind::Tcp),
        IPC_SLICE_MAX.min(c.tcp.max_frame_payload / 5 * 4)
    );
    // A slice handed to TCP after a failed import, with its merged tail, fits one frame.
    c.tcp.max_frame_payload = 8 << 20;
    let s = ipc_slice_size(&c, TransportKind::Tcp);
    assert!(s + s / 4 <= c.tcp.max_frame_payload, "{s}");
    // Never below the engine's own slice size.
    c.slice_size = 16 << 20;
    assert_eq!(ipc_slice_size(&c, TransportKind::Tcp), 16 << 20);
}

#[test]
fn a_malformed_request_is_refused_not_fatal() {
    let engine = crate::TransferEngine::new(EngineConfig {
        cuda_ipc: CudaIpcMode::Required,
        ..EngineConfig::default()
    })
    .unwrap();
    for body in [
        &b"{\"cuda_ipc\": 5}"[..],
        b"{\"cuda_ipc\": {\"version\": 2, \"nonce\": \"00\", \"proof\": null, \"allocs\": []}}",
        b"{\"cuda_ipc\": {\"version\": 1, \"nonce\": \"zz\", \"proof\": null, \"allocs\": []}}",
    ] {
        let e = handshake::request_with(
            &engine.segment_name(),
            FrameType::Connect,
            body,
            Duration::from_secs(5),
            None,
        )
        .unwrap_err();
        assert!(!e.to_string().is_empty());
    }
    let many: Vec<u64> = (0..=MAX_ALLOCS_PER_REQUEST as u64).collect();
    let body = serde_json::to_vec(&Envelope {
        cuda_ipc: Request {
            version: 1,
            nonce: hex(&[1u8; 32]),
            proof: None,
            allocs: many,
            instance: None,
        },
    })
    .unwrap();
    let e = handshake::request_with(
        &engine.segment_name(),
        FrameType::Connect,
        &body,
        Duration::from_secs(5),
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("at most"), "{e}");
}

/// Memory access that takes any location and copies nothing: the TCP transport registers
/// device memory through it without a driver.
struct AnyLocation;

impl crate::memory::MemoryAccess for AnyLocation {
    fn name(&self) -> &'static str {
        "any"
    }

    fn check(&self, _location: Location) -> Result<()> {
        Ok(())
    }

    unsafe fn copy_from(&self, location: Location, _src: u64, _dst: &mut [u8]) -> Result<()> {
        self.refuse(location)
    }

    unsafe fn copy_to(&self, location: Location, _dst: u64, _src: &[u8]) -> Result<()> {
        self.refuse(location)
    }
}

impl AnyLocation {
    fn refuse(&self, location: Location) -> Result<()> {
        Err(TransferError::Unsupported(UnsupportedError::NoGpuBackend {
            location,
        }))
    }
}

/// A CUDA IPC transport over a TCP one, with default config and no secret, on a segment no
/// peer reaches (nothing here connects).
fn tcp_wrapped() -> Arc<CudaIpcTransport> {
    tcp_wrapped_as("127.0.0.1:1", 1, None)
}

/// As [`tcp_wrapped`], for engine `segment_name` of `instance_id`, with `secret` when given.
pub(in crate::transport::cuda_ipc) fn tcp_wrapped_as(
    segment_name: &str,
    instance_id: u64,
    secret: Option<Secret>,
) -> Arc<CudaIpcTransport> {
    let ctx = TransportContext {
        config: EngineConfig::default(),
        segment_name: segment_name.into(),
        instance_id,
        registry: Arc::new(crate::memory::MemoryRegistry::new()),
        memory: Arc::new(AnyLocation),
        auth: crate::auth::AuthState::new(secret, "test"),
    };
    let inner: Arc<dyn Transport> =
        Arc::new(crate::transport::tcp::TcpTransport::new(ctx.clone()).unwrap());
    CudaIpcTransport::new(&ctx, inner).unwrap()
}

/// Holds peer `name` of `instance_id` in `t` as an import would, with `table` as its live
/// table and nothing mapped.
fn hold_peer(
    t: &CudaIpcTransport,
    name: &str,
    instance_id: u64,
    table: &super::super::live::LiveTable,
) {
    t.peers.lock().unwrap().insert(
        name.to_string(),
        super::super::state::Peer {
            instance_id,
            live: super::super::live::LiveView::open(&table.fd()).unwrap(),
            mapped: HashMap::new(),
            failed: HashSet::new(),
        },
    );
}

/// A `cuda:N` region whose export fails (here: no driver) is registered over the wrapped
/// transport, and why it was not exported stays the export's typed error, not its text,
/// until the region is deregistered.
#[test]
fn a_refused_export_keeps_its_typed_error_until_deregistered() {
    let t = tcp_wrapped();
    assert_eq!(t.mode, CudaIpcMode::Auto);
    let region = MemoryRegion {
        addr: 0x7000_0000,
        len: 4096,
        location: Location::Cuda(0),
    };
    let keys = t
        .register(&region)
        .expect("a refused export still registers");
    assert!(keys.transport.get(KEYS_FIELD).is_none(), "{keys:?}");
    let why = t.not_exported(region.addr).expect("the refusal is kept");
    assert_eq!(
        keys.transport.get(REFUSED_FIELD),
        Some(&serde_json::Value::String(why.to_string()))
    );
    assert!(
        matches!(why, TransferError::Gpu(_) | TransferError::Unsupported(_)),
        "{why:?}"
    );
    assert!(t.not_exported(region.addr + 1).is_none());
    t.deregister(&region).unwrap();
    assert!(t.not_exported(region.addr).is_none());
}

/// A remembered route is decided again when what it depends on beside the two regions
/// changes: an import of the peer's allocation failing sends the pair to the fallback, and
/// the peer forgotten (its failed imports with it) brings it back to CUDA IPC. A route of
/// another descriptor at the same pair is never the remembered one.
#[test]
fn a_remembered_route_follows_failed_imports_and_forgotten_peers() {
    let t = tcp_wrapped();
    let Some(me) = t.me.clone() else {
        return; // no host identity here: nothing goes over CUDA IPC
    };
    let uuid = "00".repeat(16);
    // Device 0 reaches the peer's device (the driver's answer, remembered: none asked here).
    t.access
        .lock()
        .unwrap()
        .entry(0)
        .or_default()
        .insert(uuid.clone(), true);
    let keys = super::super::keys::IpcRegionKeys {
        host: super::super::keys::HostIdentity {
            pid: me.pid.wrapping_add(1),
            ..me
        },
        device_uuid: uuid,
        alloc_base: 0x10000,
        alloc_size: 0x10000,
        kind: kvferry_cuda::ipc::AllocationKind::VmmFd,
    };
    let remote = MemoryRegion {
        addr: 0x10000,
        len: 0x1000,
        location: Location::Cuda(0),
    };
    let mut m = serde_json::Map::new();
    m.insert(KEYS_FIELD.into(), serde_json::to_value(&keys).unwrap());
    let published: crate::memory::TransportKeys =
        serde_json::from_value(serde_json::Value::Object(m)).unwrap();
    let desc = |keys: crate::memory::TransportKeys| {
        Arc::new(SegmentDescriptor {
            name: "127.0.0.1:9".into(),
            instance_id: 7,
            transport: TransportInfo {
                kind: TransportKind::Tcp,
                details: serde_json::json!({}),
            },
            buffers: vec![crate::descriptor::BufferDesc {
                region: remote,
                keys: crate::memory::RegionKeys::new(Default::default(), keys),
            }],
        })
    };
    let d = desc(published);
    let local = MemoryRegion {
        addr: 0x7000_0000,
        len: 4096,
        location: Location::Cuda(0),
    };
    let route =
        |d: &Arc<SegmentDescriptor>, held: bool| t.route_keys(d, held.then_some(d), &local, 0).0;
    assert_eq!(route(&d, true), Route::Ipc);
    assert_eq!(route(&d, false), Route::Ipc, "remembered");
    // The import failed: the pair goes to the fallback from then on.
    let table = super::super::live::LiveTable::new().unwrap();
    hold_peer(&t, &d.name, d.instance_id, &table);
    let e = TransferError::Handshake {
        peer: d.name.clone(),
        source: crate::error::HandshakeError::Closed,
    };
    assert!(t.import_failed(&d, 0, &[&keys], &e));
    assert_eq!(
        route(&d, false),
        Route::Fallback(super::super::keys::FallbackWhy::ImportFailed)
    );
    // Forgotten: its failed imports go with it.
    t.drop_peer(&d.name);
    assert_eq!(route(&d, true), Route::Ipc);
    // Another descriptor (the same pair, no keys published): its own route.
    let other = desc(crate::memory::TransportKeys::none());
    assert_eq!(
        route(&other, true),
        Route::Fallback(super::super::keys::FallbackWhy::NotExported)
    );
    assert_eq!(route(&d, false), Route::Ipc);
}

/// A process seen gone is the instance that posted, not a peer that restarted under its name
/// since: only that instance's mappings are forgotten.
#[test]
fn a_gone_instance_drops_only_its_own_entry() {
    let t = tcp_wrapped();
    let table = super::super::live::LiveTable::new().unwrap();
    let name = "127.0.0.1:9".to_string();
    hold_peer(&t, &name, 8, &table);
    t.drop_instance(&name, 7);
    assert!(
        t.peers.lock().unwrap().contains_key(&name),
        "the newer instance stays"
    );
    t.drop_instance(&name, 8);
    assert!(!t.peers.lock().unwrap().contains_key(&name));
}

/// The engine a transport belongs to is this process's own while the transport lives (the
/// in-process route asks), and no longer once it is dropped.
#[test]
fn a_transport_notes_its_engine_as_this_processs_while_it_lives() {
    use super::super::keys::OwnEngines;
    let t = tcp_wrapped_as("127.0.0.1:2", 0x5eed, None);
    let (name, id) = t.own.clone();
    assert!(OwnEngines::contains(&name, id));
    drop(t);
    assert!(!OwnEngines::contains(&name, id));
}
