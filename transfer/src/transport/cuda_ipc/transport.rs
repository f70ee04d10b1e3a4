//! The CUDA IPC transport: wraps the engine's network transport (TCP or RDMA) and moves the
//! slices whose both sides are device memory of processes on this host as device copies,
//! handing every other slice to the wrapped transport. Its `kind` and descriptor facts are the
//! wrapped transport's, so it talks to peers without CUDA IPC as before.
//!
//! * **Owner side.** `register` lets the wrapped transport register the region, then exports
//!   the allocation holding it (legacy handle or file descriptor, once per allocation) and
//!   publishes [`IpcRegionKeys`] under `cuda_ipc` in the region's keys, and the region in the
//!   live table; memory that cannot be exported publishes `cuda_ipc_refused` with the reason
//!   instead (or is refused, with [`CudaIpcMode::Required`]). A `Connect` frame
//!   `{"cuda_ipc": {...}}` asks for the handles of named allocations: legacy handles come in
//!   the reply, file descriptors (and the live table's) as tickets for the Unix socket.
//! * **Initiator side.** Per peer (name and instance id), each allocation is opened once and
//!   kept until the peer's descriptor changes, the segment is closed, the peer process is gone
//!   or the transport shuts down. Before each copy every slice is checked against the owner's
//!   live table. Slices are coalesced where both sides continue each other, then enqueued on
//!   the local device's stream of this transport (never a caller's stream): copies of 16 MiB
//!   and more one driver call each, the rest in one launch of the piece kernel; an event
//!   recorded after them completes the slices (a completion thread polls it, with a deadline).

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use kvferry_cuda::driver::{Context, Event, EventState, Stream};
use kvferry_cuda::ipc::{
    self, allocation_of, AllocationKind, ImportedVmm, LegacyHandle, OpenedLegacy, PieceKernel,
    PieceTable,
};

use super::fdpass::{self, hex, FdServer};
use super::keys::{route, HostIdentity, IpcRegionKeys, Route};
use super::live::{LiveTable, LiveView};
use crate::auth::AuthState;
use crate::config::CudaIpcMode;
use crate::descriptor::SegmentDescriptor;
use crate::error::{Result, TransferError};
use crate::handshake::{self, FrameType};
use crate::memory::{MemoryRegion, RegionKeys};
use crate::transport::{
    CompletionSink, Slice, Transport, TransportContext, TransportInfo, TransportStats,
};
use crate::types::{Location, Op, TransportKind};

/// The key of a region's CUDA IPC facts in its keys.
pub const KEYS_FIELD: &str = "cuda_ipc";
/// The key of the reason a `cuda:N` region was not exported.
pub const REFUSED_FIELD: &str = "cuda_ipc_refused";
/// HMAC label of a handle request's proof.
const PROOF_LABEL: &str = "kvferry cuda-ipc handles v1";
/// Nonces of handle requests remembered against replay.
const NONCES_KEPT: usize = 4096;
/// Allocations one handle request may name.
const MAX_ALLOCS_PER_REQUEST: usize = 1024;
/// Longest wait for one batch's device copies (plus 1 ns per byte).
const COPY_DEADLINE: Duration = Duration::from_secs(30);

/// One exported allocation (owner side).
struct Export {
    size: u64,
    /// Registered regions inside it (their start addresses).
    regions: HashSet<u64>,
    legacy: Option<LegacyHandle>,
    fd: Option<Arc<OwnedFd>>,
}

/// An allocation of a peer mapped here.
enum Mapped {
    Legacy(OpenedLegacy),
    Vmm(ImportedVmm),
    /// The peer is this process: its addresses are ours.
    InProcess(u64),
}

impl Mapped {
    fn ptr(&self) -> u64 {
        match self {
            Mapped::Legacy(o) => o.ptr(),
            Mapped::Vmm(v) => v.ptr(),
            Mapped::InProcess(p) => *p,
        }
    }
}

/// What this process holds of one peer instance (initiator side).
struct Peer {
    instance_id: u64,
    live: LiveView,
    /// Allocation base (peer address) → (size, mapping).
    mapped: HashMap<u64, (u64, Arc<Mapped>)>,
    /// Allocations whose import failed (sent to the fallback transport from then on).
    failed: HashSet<u64>,
}

/// A handle request (`Connect` body `{"cuda_ipc": Request}`).
#[derive(Serialize, Deserialize)]
struct Request {
    version: u32,
    /// 32 random bytes as hex, proven with the secret in authenticated mode.
    nonce: String,
    /// HMAC of the nonce and the allocations, hex; `None` in open mode.
    proof: Option<String>,
    /// Allocation bases wanted.
    allocs: Vec<u64>,
}

#[derive(Serialize, Deserialize)]
struct Reply {
    /// The owner's Unix socket (abstract name) for tickets.
    socket: String,
    /// Ticket of the live table.
    live: String,
    allocs: Vec<AllocReply>,
}

#[derive(Serialize, Deserialize)]
struct AllocReply {
    base: u64,
    size: u64,
    /// Legacy handle (64 bytes, hex).
    legacy: Option<String>,
    /// Ticket of the file descriptor.
    fd: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Envelope<T> {
    cuda_ipc: T,
}

/// A device's copy lane: its context, this transport's stream on it, the piece kernel (when
/// NVRTC is there) and spare tables.
struct Lane {
    ctx: Context,
    stream: Stream,
    kernel: Option<PieceKernel>,
    tables: Mutex<Vec<PieceTable>>,
}

/// Device copies in flight: their event, slices and what must live until they end.
struct Job {
    event: Event,
    done: CompletionSink,
    ids: Vec<u32>,
    deadline: Instant,
    lane: Arc<Lane>,
    table: Option<PieceTable>,
    _keep: Vec<Arc<Mapped>>,
}

/// Nonces of handle requests seen (a set for lookup, a queue for age), against replay.
type Nonces = (HashSet<[u8; 32]>, VecDeque<[u8; 32]>);

/// The transport (see the module doc).
pub struct CudaIpcTransport {
    inner: Arc<dyn Transport>,
    mode: CudaIpcMode,
    me: Option<HostIdentity>,
    auth: Arc<AuthState>,
    handshake_timeout: Duration,
    exports: Mutex<HashMap<u64, Export>>,
    /// Exported regions (addr → len): what the live table lists.
    live_lens: Mutex<HashMap<u64, u64>>,
    live: Mutex<Option<LiveTable>>,
    fd_server: OnceLock<std::result::Result<FdServer, String>>,
    peers: Mutex<HashMap<String, Peer>>,
    nonces: Mutex<Nonces>,
    lanes: Mutex<HashMap<u32, Arc<Lane>>>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    completer: Mutex<Option<std::thread::JoinHandle<()>>>,
    credential: Option<crate::auth::Credential>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn gpu_err(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> TransferError {
    TransferError::gpu(e)
}

impl CudaIpcTransport {
    /// Wraps `inner`. Errors: none yet (CUDA is probed at the first `cuda:N` registration).
    pub fn new(ctx: &TransportContext, inner: Arc<dyn Transport>) -> Result<Arc<Self>> {
        let (tx, rx) = mpsc::channel::<Job>();
        let completer = std::thread::Builder::new()
            .name("kvferry-cuda-ipc-done".into())
            .spawn(move || complete_jobs(rx))
            .map_err(|e| TransferError::io("start the CUDA IPC completion thread", e))?;
        Ok(Arc::new(CudaIpcTransport {
            inner,
            mode: ctx.config.cuda_ipc,
            me: HostIdentity::local(),
            auth: ctx.auth.clone(),
            handshake_timeout: ctx.config.handshake_timeout,
            exports: Mutex::new(HashMap::new()),
            live_lens: Mutex::new(HashMap::new()),
            live: Mutex::new(None),
            fd_server: OnceLock::new(),
            peers: Mutex::new(HashMap::new()),
            nonces: Mutex::new((HashSet::new(), VecDeque::new())),
            lanes: Mutex::new(HashMap::new()),
            jobs: Mutex::new(Some(tx)),
            completer: Mutex::new(Some(completer)),
            credential: ctx.auth.credential(None),
        }))
    }

    fn fd_server(&self) -> Result<&FdServer> {
        self.fd_server
            .get_or_init(|| FdServer::start().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| TransferError::Unsupported(format!("CUDA IPC socket: {e}")))
    }

    fn lane(&self, ordinal: u32) -> Result<Arc<Lane>> {
        if let Some(l) = lock(&self.lanes).get(&ordinal) {
            return Ok(l.clone());
        }
        let made = kvferry_cuda::guarded("CUDA IPC lane", || {
            let ctx = Context::new(ordinal)?;
            let stream = Stream::new(&ctx)?;
            let kernel = match PieceKernel::new(ordinal) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(
                        "cuda:{ordinal}: no piece kernel ({e}); small CUDA IPC copies go one driver call each"
                    );
                    None
                }
            };
            Ok(Lane {
                ctx,
                stream,
                kernel,
                tables: Mutex::new(Vec::new()),
            })
        })
        .map_err(gpu_err)?;
        let l = Arc::new(made);
        lock(&self.lanes).insert(ordinal, l.clone());
        Ok(l)
    }

    /// Exports the allocation holding `region` and returns its keys (owner side).
    fn export(&self, region: &MemoryRegion, ordinal: u32) -> Result<IpcRegionKeys> {
        let me = self.me.clone().ok_or_else(|| {
            TransferError::Unsupported("no host identity (/proc/sys/kernel/random/boot_id)".into())
        })?;
        let lane = self.lane(ordinal)?;
        lane.ctx.bind().map_err(gpu_err)?;
        let a = allocation_of(region.addr).map_err(gpu_err)?;
        if a.ordinal != ordinal || region.end() > a.base + a.size {
            return Err(TransferError::InvalidArgument(format!(
                "[{:#x}, +{}) is not inside one allocation of cuda:{ordinal} (allocation [{:#x}, +{}) on cuda:{})",
                region.addr, region.len, a.base, a.size, a.ordinal
            )));
        }
        let uuid = ipc::device_uuid(ordinal).map_err(gpu_err)?;
        let mut ex = lock(&self.exports);
        let e = match ex.entry(a.base) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let (legacy, fd) = match a.kind {
                    AllocationKind::Legacy => {
                        (Some(ipc::legacy_handle(a.base).map_err(gpu_err)?), None)
                    }
                    AllocationKind::VmmFd => {
                        self.fd_server()?;
                        (
                            None,
                            Some(Arc::new(ipc::export_vmm(a.base).map_err(gpu_err)?)),
                        )
                    }
                };
                v.insert(Export {
                    size: a.size,
                    regions: HashSet::new(),
                    legacy,
                    fd,
                })
            }
        };
        e.regions.insert(region.addr);
        Ok(IpcRegionKeys {
            host: me,
            device_uuid: uuid,
            alloc_base: a.base,
            alloc_size: a.size,
            kind: a.kind,
        })
    }

    /// Republishes the live table from the export list.
    fn publish_live(&self, registered: &[(u64, u64)]) -> Result<()> {
        let mut live = lock(&self.live);
        if live.is_none() {
            *live = Some(LiveTable::new()?);
        }
        live.as_mut().expect("made").publish(registered)
    }

    /// The regions exported now, for the live table (addr, len).
    fn live_regions(&self, extra: Option<&MemoryRegion>, gone: Option<u64>) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = lock(&self.live_lens)
            .iter()
            .filter(|(a, _)| Some(**a) != gone)
            .map(|(a, l)| (*a, *l))
            .collect();
        if let Some(r) = extra {
            v.push((r.addr, r.len));
        }
        v
    }

    fn handle_request(&self, body: &[u8]) -> Result<Vec<u8>> {
        let req: Envelope<Request> = serde_json::from_slice(body)
            .map_err(|e| TransferError::Protocol(format!("CUDA IPC handle request: {e}")))?;
        let req = req.cuda_ipc;
        if req.version != 1 {
            return Err(TransferError::Protocol(format!(
                "CUDA IPC handle request version {}, this engine speaks 1",
                req.version
            )));
        }
        if req.allocs.len() > MAX_ALLOCS_PER_REQUEST {
            return Err(TransferError::Protocol(format!(
                "CUDA IPC handle request names {} allocations; at most {MAX_ALLOCS_PER_REQUEST}",
                req.allocs.len()
            )));
        }
        let nonce = parse_hex::<32>(&req.nonce)
            .ok_or_else(|| TransferError::Protocol("CUDA IPC nonce: 64 hex digits".into()))?;
        if let Some(secret) = &self.auth.secret {
            // A handle gives the whole allocation: only a peer holding the secret gets one
            // (a grant token, good for some ranges, is not enough).
            let want = secret.prove(PROOF_LABEL, &[&nonce, &allocs_bytes(&req.allocs)]);
            let ok = req
                .proof
                .as_deref()
                .and_then(parse_hex::<32>)
                .is_some_and(|p| crate::auth::ct_eq(&p, &want));
            if !ok {
                return Err(TransferError::Auth(crate::error::AuthError::Handshake(
                    "CUDA IPC handles need the shared secret's proof",
                )));
            }
            let mut n = lock(&self.nonces);
            if !n.0.insert(nonce) {
                return Err(TransferError::Auth(crate::error::AuthError::Handshake(
                    "CUDA IPC handle request replayed",
                )));
            }
            n.1.push_back(nonce);
            if n.1.len() > NONCES_KEPT {
                if let Some(old) = n.1.pop_front() {
                    n.0.remove(&old);
                }
            }
        }
        let srv = self.fd_server()?;
        let live_fd = lock(&self.live).as_ref().map(|l| l.fd()).ok_or_else(|| {
            TransferError::Unsupported("no region is exported for CUDA IPC".into())
        })?;
        let live = hex(&srv.offer(live_fd, super::live::TABLE_BYTES as u64)?);
        let ex = lock(&self.exports);
        let mut allocs = Vec::with_capacity(req.allocs.len());
        for base in &req.allocs {
            let e = ex.get(base).ok_or_else(|| TransferError::Refused {
                segment: "this engine".into(),
                text: format!("allocation {base:#x} is not exported for CUDA IPC"),
            })?;
            allocs.push(AllocReply {
                base: *base,
                size: e.size,
                legacy: e.legacy.map(|h| hex(&h.0)),
                fd: match &e.fd {
                    Some(fd) => Some(hex(&srv.offer(fd.clone(), e.size)?)),
                    None => None,
                },
            });
        }
        serde_json::to_vec(&Envelope {
            cuda_ipc: Reply {
                socket: srv.name().to_string(),
                live,
                allocs,
            },
        })
        .map_err(|e| TransferError::Protocol(format!("encode CUDA IPC reply: {e}")))
    }

    /// Asks `peer` for `allocs` and maps them (initiator side). Returns the peer state made or
    /// updated; allocations that fail to map are marked failed (with a warning).
    fn import(
        &self,
        desc: &SegmentDescriptor,
        host: &HostIdentity,
        allocs: &[(u64, u64, AllocationKind)],
        lane: &Lane,
    ) -> Result<()> {
        let nonce = crate::auth::random_bytes::<32>()?;
        let bases: Vec<u64> = allocs.iter().map(|a| a.0).collect();
        let in_process = self.me.as_ref().is_some_and(|m| m.same_process(host));
        // In-process peers need only the live table.
        let wanted: Vec<u64> = if in_process {
            Vec::new()
        } else {
            bases.clone()
        };
        let proof = self
            .auth
            .secret
            .as_ref()
            .map(|s| hex(&s.prove(PROOF_LABEL, &[&nonce, &allocs_bytes(&wanted)])));
        let body = serde_json::to_vec(&Envelope {
            cuda_ipc: Request {
                version: 1,
                nonce: hex(&nonce),
                proof,
                allocs: wanted,
            },
        })
        .map_err(|e| TransferError::Protocol(format!("encode CUDA IPC request: {e}")))?;
        let reply = handshake::request_with(
            &desc.name,
            FrameType::Connect,
            &body,
            self.handshake_timeout,
            self.credential.as_ref(),
        )?;
        let reply: Envelope<Reply> = serde_json::from_slice(&reply).map_err(|e| {
            TransferError::Protocol(format!("CUDA IPC reply from {}: {e}", desc.name))
        })?;
        let reply = reply.cuda_ipc;
        let ticket = |t: &str| {
            parse_hex::<16>(t).ok_or_else(|| {
                TransferError::Protocol(format!(
                    "CUDA IPC ticket from {}: 32 hex digits",
                    desc.name
                ))
            })
        };
        let (live_fd, _) = fdpass::fetch(&reply.socket, &ticket(&reply.live)?, &desc.name)?;
        let live = LiveView::open(&live_fd)?;
        let mut peers = lock(&self.peers);
        let p = match peers.get_mut(&desc.name) {
            Some(p) if p.instance_id == desc.instance_id => {
                p.live = live;
                p
            }
            _ => {
                peers.insert(
                    desc.name.clone(),
                    Peer {
                        instance_id: desc.instance_id,
                        live,
                        mapped: HashMap::new(),
                        failed: HashSet::new(),
                    },
                );
                peers.get_mut(&desc.name).expect("inserted")
            }
        };
        if in_process {
            for (base, size, _) in allocs {
                p.mapped
                    .insert(*base, (*size, Arc::new(Mapped::InProcess(*base))));
            }
            return Ok(());
        }
        for (base, size, kind) in allocs {
            let got = reply.allocs.iter().find(|a| a.base == *base);
            let mapped = match (got, kind) {
                (Some(a), _) if a.size != *size => Err(TransferError::Protocol(format!(
                    "allocation {base:#x}: {} bytes in the reply, {size} in the descriptor",
                    a.size
                ))),
                (
                    Some(AllocReply {
                        legacy: Some(h), ..
                    }),
                    AllocationKind::Legacy,
                ) => match parse_hex::<64>(h) {
                    Some(b) => OpenedLegacy::open(&lane.ctx, &LegacyHandle(b))
                        .map(Mapped::Legacy)
                        .map_err(gpu_err),
                    None => Err(TransferError::Protocol(
                        "legacy handle: 128 hex digits".into(),
                    )),
                },
                (Some(AllocReply { fd: Some(t), .. }), AllocationKind::VmmFd) => ticket(t)
                    .and_then(|t| fdpass::fetch(&reply.socket, &t, &desc.name))
                    .and_then(|(fd, sz)| {
                        if sz != *size {
                            return Err(TransferError::Protocol(format!(
                                "allocation {base:#x}: descriptor of {sz} bytes, expected {size}"
                            )));
                        }
                        ImportedVmm::import(&lane.ctx, &fd, sz)
                            .map(Mapped::Vmm)
                            .map_err(gpu_err)
                    }),
                _ => Err(TransferError::Protocol(format!(
                    "no {kind:?} handle for allocation {base:#x} in the reply"
                ))),
            };
            match mapped {
                Ok(m) => {
                    p.mapped.insert(*base, (*size, Arc::new(m)));
                }
                Err(e) => {
                    tracing::warn!(
                        peer = %desc.name,
                        "CUDA IPC import of allocation {base:#x} failed ({e}); its slices go over {}",
                        self.inner.kind()
                    );
                    p.failed.insert(*base);
                }
            }
        }
        Ok(())
    }

    /// Whether the peer's process is gone (same pid namespace only; else unknown: false).
    fn peer_gone(&self, host: &HostIdentity) -> bool {
        let Some(me) = &self.me else { return false };
        if !me.same_host(host) || me.pid_ns.is_empty() || me.pid_ns != host.pid_ns {
            return false;
        }
        // SAFETY: signal 0 checks existence and permission only.
        let r = unsafe { libc::kill(host.pid as i32, 0) };
        r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    }

    fn drop_peer(&self, name: &str) {
        let gone = lock(&self.peers).remove(name);
        drop(gone);
    }
}

fn allocs_bytes(a: &[u64]) -> Vec<u8> {
    a.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn parse_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    // from_str_radix alone would take a leading '+'.
    if s.len() != 2 * N || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Slices of one post that take CUDA IPC, resolved to device addresses.
struct Planned {
    id: u32,
    dst: u64,
    src: u64,
    len: u64,
}

/// Merges consecutive slices (in id order) whose both sides continue each other.
fn coalesce(planned: &[Planned]) -> Vec<ipc::Copy> {
    let mut out: Vec<ipc::Copy> = Vec::new();
    for p in planned {
        if let Some(last) = out.last_mut() {
            if last.dst + last.len as u64 == p.dst && last.src + last.len as u64 == p.src {
                last.len += p.len as usize;
                continue;
            }
        }
        out.push(ipc::Copy {
            dst: p.dst,
            src: p.src,
            len: p.len as usize,
        });
    }
    out
}

/// The CUDA IPC keys of the peer's buffer `i`: `None` when it publishes none, `Some(Err)` when
/// they do not decode.
fn decode_keys(
    peer: &SegmentDescriptor,
    i: usize,
) -> Option<std::result::Result<IpcRegionKeys, ()>> {
    let v = peer.buffers.get(i)?.keys.transport.get(KEYS_FIELD)?;
    Some(serde_json::from_value::<IpcRegionKeys>(v.clone()).map_err(|_| ()))
}

impl CudaIpcTransport {
    /// The route of a slice between `local` and the peer's buffer `remote_buffer` whose keys
    /// decoded to `k`.
    fn route_of(
        &self,
        peer: &SegmentDescriptor,
        local: &MemoryRegion,
        remote_buffer: usize,
        k: &Option<std::result::Result<IpcRegionKeys, ()>>,
    ) -> Route {
        let Some(buffer) = peer.buffers.get(remote_buffer) else {
            return Route::Fallback(super::keys::FallbackWhy::NotExported);
        };
        let failed = match k {
            Some(Ok(k)) => lock(&self.peers).get(&peer.name).is_some_and(|p| {
                p.instance_id == peer.instance_id && p.failed.contains(&k.alloc_base)
            }),
            _ => false,
        };
        route(
            self.me.as_ref(),
            local,
            &buffer.region,
            k.as_ref().map(|r| r.as_ref().map_err(|_| ())),
            |a, _| {
                let Some(Ok(k)) = k.as_ref() else {
                    return false;
                };
                kvferry_cuda::guarded("peer access", || {
                    Ok(match ipc::ordinal_of_uuid(&k.device_uuid) {
                        Some(b) => ipc::can_access_peer(a, b).unwrap_or(false),
                        None => false,
                    })
                })
                .unwrap_or(false)
            },
            failed,
        )
    }
}

impl Transport for CudaIpcTransport {
    fn path(
        &self,
        peer: &SegmentDescriptor,
        local: &MemoryRegion,
        remote_buffer: usize,
    ) -> crate::types::TransferPath {
        match self.route_of(
            peer,
            local,
            remote_buffer,
            &decode_keys(peer, remote_buffer),
        ) {
            Route::Ipc | Route::InProcess => crate::types::TransferPath::CudaIpc,
            Route::Fallback(_) => self.inner.path(peer, local, remote_buffer),
        }
    }

    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn local_info(&self) -> TransportInfo {
        self.inner.local_info()
    }

    fn register(&self, region: &MemoryRegion) -> Result<RegionKeys> {
        let mut keys = self.inner.register(region)?;
        let Location::Cuda(ordinal) = region.location else {
            return Ok(keys);
        };
        let exported = self.export(region, ordinal).and_then(|k| {
            let regs = self.live_regions(Some(region), None);
            self.publish_live(&regs)?;
            lock(&self.live_lens).insert(region.addr, region.len);
            Ok(k)
        });
        match exported {
            Ok(k) => {
                keys.transport.insert(
                    KEYS_FIELD,
                    serde_json::to_value(&k)
                        .map_err(|e| TransferError::Config(format!("CUDA IPC keys: {e}")))?,
                );
            }
            Err(e) if self.mode == CudaIpcMode::Required => {
                self.unexport(region);
                let _ = self.inner.deregister(region);
                return Err(e);
            }
            Err(e) => {
                self.unexport(region);
                tracing::warn!(
                    "[{:#x}, +{}) on {}: not exported for CUDA IPC ({e}); peers on this host move it over {}",
                    region.addr,
                    region.len,
                    region.location,
                    self.inner.kind()
                );
                keys.transport
                    .insert(REFUSED_FIELD, serde_json::Value::String(e.to_string()));
            }
        }
        Ok(keys)
    }

    fn deregister(&self, region: &MemoryRegion) -> Result<()> {
        if region.location != Location::Cpu {
            lock(&self.live_lens).remove(&region.addr);
            let regs = self.live_regions(None, Some(region.addr));
            if let Err(e) = self.publish_live(&regs) {
                tracing::warn!("CUDA IPC live table: {e}");
            }
            self.unexport(region);
        }
        self.inner.deregister(region)
    }

    fn on_handshake(&self, peer: SocketAddr, body: &[u8]) -> Result<Vec<u8>> {
        if body.starts_with(b"{\"cuda_ipc\"") {
            return self.handle_request(body);
        }
        self.inner.on_handshake(peer, body)
    }

    fn post(
        &self,
        peer: &Arc<SegmentDescriptor>,
        slices: Vec<Slice>,
        done: CompletionSink,
        token: Option<crate::auth::Token>,
    ) {
        let mut fallback = Vec::new();
        let mut ipc_slices: Vec<(Slice, Arc<IpcRegionKeys>)> = Vec::new();
        let mut decoded: HashMap<usize, Option<std::result::Result<Arc<IpcRegionKeys>, ()>>> =
            HashMap::new();
        // The route depends on the two regions only: decided once per pair.
        let mut routes: HashMap<(u64, usize), Route> = HashMap::new();
        for s in slices {
            let k = decoded
                .entry(s.remote_buffer)
                .or_insert_with(|| decode_keys(peer, s.remote_buffer).map(|r| r.map(Arc::new)));
            let r = routes
                .entry((s.local_region.addr, s.remote_buffer))
                .or_insert_with(|| {
                    let plain = k
                        .as_ref()
                        .map(|r| r.as_ref().map(|a| (**a).clone()).map_err(|_| ()));
                    self.route_of(peer, &s.local_region, s.remote_buffer, &plain)
                })
                .clone();
            match (r, k) {
                (Route::Ipc | Route::InProcess, Some(Ok(k))) => ipc_slices.push((s, k.clone())),
                _ => fallback.push(s),
            }
        }
        if !ipc_slices.is_empty() {
            fallback.extend(self.post_ipc(peer, ipc_slices, &done));
        }
        if !fallback.is_empty() {
            self.inner.post(peer, fallback, done, token);
        }
    }

    fn disconnect(&self, name: &str) {
        self.drop_peer(name);
        self.inner.disconnect(name);
    }

    fn stats(&self) -> TransportStats {
        let mut s = self.inner.stats();
        let peers = lock(&self.peers);
        s.peers += peers.len();
        s.connections += peers.values().map(|p| p.mapped.len()).sum::<usize>();
        s
    }

    fn shutdown(&self) {
        lock(&self.jobs).take();
        if let Some(t) = lock(&self.completer).take() {
            let _ = t.join();
        }
        lock(&self.peers).clear();
        self.inner.shutdown();
    }
}

impl CudaIpcTransport {
    fn unexport(&self, region: &MemoryRegion) {
        let mut ex = lock(&self.exports);
        let empty: Vec<u64> = ex
            .iter_mut()
            .filter_map(|(base, e)| {
                e.regions.remove(&region.addr);
                e.regions.is_empty().then_some(*base)
            })
            .collect();
        for b in empty {
            ex.remove(&b);
        }
    }

    /// Starts the CUDA IPC slices; returns those that must go to the fallback transport
    /// (their allocation could not be imported).
    fn post_ipc(
        &self,
        peer: &Arc<SegmentDescriptor>,
        slices: Vec<(Slice, Arc<IpcRegionKeys>)>,
        done: &CompletionSink,
    ) -> Vec<Slice> {
        let fail = |ids: &mut dyn Iterator<Item = u32>, e: &TransferError| done.fail_all(ids, e);
        if done.is_cancelled() {
            fail(
                &mut slices.iter().map(|(s, _)| s.id),
                &CompletionSink::cancelled_error(),
            );
            return Vec::new();
        }
        let host = slices[0].1.host.clone();
        if self.peer_gone(&host) {
            self.drop_peer(&peer.name);
            let e = TransferError::Refused {
                segment: peer.name.clone(),
                text: format!("its process {} has exited", host.pid),
            };
            fail(&mut slices.iter().map(|(s, _)| s.id), &e);
            return Vec::new();
        }
        // One local device per post in practice; group by it anyway.
        let mut by_dev: HashMap<u32, Vec<(Slice, Arc<IpcRegionKeys>)>> = HashMap::new();
        for (s, k) in slices {
            let Location::Cuda(d) = s.local_region.location else {
                unreachable!("routed to CUDA IPC only with device memory on both sides")
            };
            by_dev.entry(d).or_default().push((s, k));
        }
        let mut fallback = Vec::new();
        for (dev, group) in by_dev {
            let lane = match self.lane(dev) {
                Ok(l) => l,
                Err(e) => {
                    fail(&mut group.iter().map(|(s, _)| s.id), &e);
                    continue;
                }
            };
            // Import what is missing, once per allocation.
            let missing: Vec<(u64, u64, AllocationKind)> = {
                let peers = lock(&self.peers);
                let p = peers
                    .get(&peer.name)
                    .filter(|p| p.instance_id == peer.instance_id);
                let mut seen = HashSet::new();
                group
                    .iter()
                    .filter(|(_, k)| {
                        p.is_none_or(|p| !p.mapped.contains_key(&k.alloc_base))
                            && seen.insert(k.alloc_base)
                    })
                    .map(|(_, k)| (k.alloc_base, k.alloc_size, k.kind))
                    .collect()
            };
            if !missing.is_empty() {
                if let Err(e) = self.import(peer, &host, &missing, &lane) {
                    tracing::warn!(peer = %peer.name, "CUDA IPC handshake failed ({e}); these slices go over {}", self.inner.kind());
                    let mut peers = lock(&self.peers);
                    if let Some(p) = peers.get_mut(&peer.name) {
                        p.failed.extend(missing.iter().map(|m| m.0));
                    }
                    fallback.extend(group.into_iter().map(|(s, _)| s));
                    continue;
                }
            }
            let mut planned = Vec::with_capacity(group.len());
            let mut keep: Vec<Arc<Mapped>> = Vec::new();
            {
                let peers = lock(&self.peers);
                let Some(p) = peers.get(&peer.name) else {
                    fallback.extend(group.into_iter().map(|(s, _)| s));
                    continue;
                };
                for (s, k) in group {
                    let Some((_, m)) = p.mapped.get(&k.alloc_base) else {
                        fallback.push(s);
                        continue;
                    };
                    if !p.live.covers(s.remote_addr, s.len) {
                        done.complete(
                            s.id,
                            Err(TransferError::RemoteOutOfRange {
                                segment: peer.name.clone(),
                                addr: s.remote_addr,
                                len: s.len,
                            }),
                        );
                        continue;
                    }
                    let remote = m.ptr() + (s.remote_addr - k.alloc_base);
                    let (dst, src) = match s.op {
                        Op::Write => (remote, s.local_addr),
                        Op::Read => (s.local_addr, remote),
                    };
                    if !keep.iter().any(|x| Arc::ptr_eq(x, m)) {
                        keep.push(m.clone());
                    }
                    planned.push(Planned {
                        id: s.id,
                        dst,
                        src,
                        len: s.len,
                    });
                }
            }
            if planned.is_empty() {
                continue;
            }
            planned.sort_by_key(|p| p.id);
            let copies = coalesce(&planned);
            let ids: Vec<u32> = planned.iter().map(|p| p.id).collect();
            let bytes: u64 = planned.iter().map(|p| p.len).sum();
            match self.enqueue(&lane, &copies) {
                Ok((event, table)) => {
                    let job = Job {
                        event,
                        done: done.clone(),
                        ids,
                        deadline: Instant::now() + COPY_DEADLINE + Duration::from_nanos(bytes),
                        lane: lane.clone(),
                        table,
                        _keep: keep,
                    };
                    let tx = lock(&self.jobs).clone();
                    let refused = match tx {
                        Some(tx) => tx.send(job).err().map(|mpsc::SendError(j)| j),
                        None => Some(job),
                    };
                    if let Some(j) = refused {
                        // Shut down meanwhile: let the copies end before their memory goes.
                        let _ = j.event.synchronize();
                        j.done.fail_all(
                            j.ids.iter().copied(),
                            &TransferError::Unsupported(
                                "the CUDA IPC transport is shut down".into(),
                            ),
                        );
                    }
                }
                Err(e) => fail(&mut ids.into_iter(), &e),
            }
        }
        fallback
    }

    /// Enqueues `copies` on the lane's stream and records an event after them.
    fn enqueue(&self, lane: &Lane, copies: &[ipc::Copy]) -> Result<(Event, Option<PieceTable>)> {
        lane.ctx.bind().map_err(gpu_err)?;
        let plan = ipc::plan_copies(copies);
        let s = lane.stream.raw();
        let mut table = None;
        match &lane.kernel {
            Some(k) => {
                let mut t = lock(&lane.tables).pop().unwrap_or_default();
                // SAFETY: every range lies inside registered local memory or a peer
                // allocation mapped here (kept alive by the job until the event completes);
                // the table is ours until the job returns it after the event.
                unsafe { k.enqueue(&plan, &mut t, s) }.map_err(gpu_err)?;
                table = Some(t);
            }
            None => {
                let all: Vec<ipc::Copy> = plan.direct.iter().chain(&plan.pieces).copied().collect();
                // SAFETY: as above.
                unsafe { ipc::copy_batch_async(&all, s) }.map_err(gpu_err)?;
            }
        }
        let ev = Event::new(&lane.ctx, false).map_err(gpu_err)?;
        // SAFETY: the lane's stream belongs to the lane's context.
        unsafe { ev.record(s) }.map_err(gpu_err)?;
        Ok((ev, table))
    }
}

/// The completion thread: polls each job's event until it completes or its deadline passes.
fn complete_jobs(rx: mpsc::Receiver<Job>) {
    let mut jobs: Vec<Job> = Vec::new();
    let mut late: Vec<Job> = Vec::new();
    let mut open = true;
    let mut idle_since: Option<Instant> = None;
    while open || !jobs.is_empty() || !late.is_empty() {
        if jobs.is_empty() && late.is_empty() {
            match rx.recv() {
                Ok(j) => jobs.push(j),
                Err(_) => open = false,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < jobs.len() {
            let _ = jobs[i].lane.ctx.bind();
            match jobs[i].event.query() {
                Ok(EventState::Done) => {
                    let j = jobs.swap_remove(i);
                    j.done.succeed_all(&j.ids);
                    if let Some(t) = j.table {
                        lock(&j.lane.tables).push(t);
                    }
                }
                Ok(EventState::Pending) if now < jobs[i].deadline => i += 1,
                other => {
                    let j = jobs.swap_remove(i);
                    let e = match other {
                        Err(e) => gpu_err(e),
                        _ => TransferError::Timeout(COPY_DEADLINE),
                    };
                    j.done.fail_all(j.ids.iter().copied(), &e);
                    // Its table and mappings stay until the device is done with them.
                    late.push(j);
                }
            }
        }
        late.retain(|j| matches!(j.event.query(), Ok(EventState::Pending)));
        if !jobs.is_empty() || !late.is_empty() {
            // Copies take microseconds to milliseconds: yield for the first 200 µs of a wait
            // (a sleep costs tens of microseconds of latency), then sleep.
            if idle_since.get_or_insert(now).elapsed() < Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        } else {
            idle_since = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{Credential, GrantOps, GrantSpec, Secret, Token};
    use crate::config::{AuthConfig, EngineConfig};

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
                proof: proof_with
                    .map(|s| hex(&s.prove(PROOF_LABEL, &[&nonce, &allocs_bytes(&[])]))),
                allocs: vec![],
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

    #[test]
    fn contiguous_slices_merge_and_gaps_do_not() {
        let p = |id, dst, src, len| Planned { id, dst, src, len };
        let c = coalesce(&[
            p(0, 1000, 5000, 100),
            p(1, 1100, 5100, 100),
            p(2, 1300, 5200, 100), // gap on the destination side
            p(3, 1400, 5300, 50),
            p(4, 1450, 9000, 50), // gap on the source side
        ]);
        let got: Vec<(u64, u64, usize)> = c.iter().map(|c| (c.dst, c.src, c.len)).collect();
        assert_eq!(
            got,
            vec![(1000, 5000, 200), (1300, 5200, 150), (1450, 9000, 50)]
        );
    }

    #[test]
    fn hex_parsing_is_strict() {
        assert_eq!(parse_hex::<2>("0aff"), Some([10, 255]));
        assert_eq!(parse_hex::<2>("0af"), None);
        assert_eq!(parse_hex::<2>("0afg"), None);
        assert_eq!(parse_hex::<2>("+a00"), None);
        assert_eq!(parse_hex::<1>("é"), None);
    }
}
