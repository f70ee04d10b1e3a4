//! The transfer engine (docs/design.md §3): memory registry, segments, batches, transport choice.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::auth::{AuthState, GrantGuard, GrantSpec, Token};
use crate::config::{EngineConfig, RdmaConfig};
use crate::error::{AuthError, HandshakeError, IoError, Result, TransferError};
use crate::handshake::{FrameType, HandshakeServer, Session, MAX_FRAME_BODY};
use crate::memory::{cover_sorted, MemoryAccess, MemoryRegion, MemoryRegistry};
use crate::peer_cache::{BatchRefresh, PeerCache};
use crate::segment::{BufferDesc, SegmentDescriptor, SegmentHandle};
use crate::transport::completion::BatchState;
use crate::transport::tcp::TcpTransport;
use crate::transport::{CompletionSink, Slice, Transport, TransportContext};
use crate::types::{BatchId, BatchStatus, Location, Op, TransferRequest, TransportKind};

/// A transfer engine: one segment (`host:port`), its registered memory, and the transport that
/// moves bytes to and from peer segments. `Send + Sync`; used behind `Arc`. Dropping the last
/// `Arc` closes the listeners and connections (in-flight slices fail).
///
/// Threads: the engine owns std threads (handshake listener, transport threads) and no async
/// runtime. Sync methods block only on std primitives with deadlines, so they work from any
/// thread, inside a tokio runtime too (they block that worker: from async code prefer
/// `submit` + `wait_async`).
pub struct TransferEngine {
    config: EngineConfig,
    name: String,
    instance_id: u64,
    registry: Arc<MemoryRegistry>,
    transport: Arc<dyn Transport>,
    peers: Arc<PeerCache>,
    batches: Mutex<HashMap<u64, Arc<BatchState>>>,
    next_batch: AtomicU64,
    handshake: Option<HandshakeServer>,
    auth: Arc<AuthState>,
}

fn random_id() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

fn segment_name(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Why the engine does not use RDMA (the reason in its one info line).
#[derive(Debug, Clone, Copy, thiserror::Error)]
enum NoRdma {
    #[cfg_attr(
        not(feature = "rdma"),
        allow(dead_code, reason = "built with the rdma feature")
    )]
    #[error("no usable RDMA device")]
    NoDevice,
    #[cfg_attr(
        feature = "rdma",
        allow(dead_code, reason = "built without the rdma feature")
    )]
    #[error("this build has no RDMA transport (cargo feature `rdma`)")]
    NotBuilt,
}

/// `Ok(device)` when RDMA is usable, else why not (for the one info line).
#[cfg(feature = "rdma")]
fn rdma_probe(c: &RdmaConfig) -> std::result::Result<String, NoRdma> {
    crate::transport::rdma::probe(c).ok_or(NoRdma::NoDevice)
}
#[cfg(not(feature = "rdma"))]
fn rdma_probe(_c: &RdmaConfig) -> std::result::Result<String, NoRdma> {
    Err(NoRdma::NotBuilt)
}
#[cfg(feature = "rdma")]
fn rdma_create(ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
    crate::transport::rdma::create(ctx)
}
#[cfg(not(feature = "rdma"))]
fn rdma_create(_ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
    Err(TransferError::Config(
        "this build has no RDMA transport".into(),
    ))
}
fn memory_access() -> Arc<dyn MemoryAccess> {
    crate::gpu::memory_access()
}

/// Picks the transport per `config.transport`; returns it with the reason for the info line.
fn choose_transport(ctx: &TransportContext) -> Result<(Arc<dyn Transport>, String)> {
    let tcp = |why: String| -> Result<(Arc<dyn Transport>, String)> {
        Ok((Arc::new(TcpTransport::new(ctx.clone())?), why))
    };
    match ctx.config.transport {
        TransportKind::Tcp => tcp("configured".into()),
        TransportKind::Rdma => match rdma_probe(&ctx.config.rdma) {
            Ok(dev) => Ok((rdma_create(ctx)?, format!("configured; device {dev}"))),
            Err(why) => Err(TransferError::Config(format!(
                "transport rdma was requested but RDMA is not usable here ({why}); use tcp or auto"
            ))),
        },
        TransportKind::Auto => match rdma_probe(&ctx.config.rdma) {
            Ok(dev) => match rdma_create(ctx) {
                Ok(t) => Ok((t, format!("auto: RDMA device {dev}"))),
                Err(e) => {
                    tracing::warn!(
                        "RDMA device {dev} found but unusable ({e}); falling back to TCP"
                    );
                    tcp(format!("auto: RDMA device {dev} unusable"))
                }
            },
            Err(why) => tcp(format!("auto: {why}")),
        },
    }
}

/// Checks a descriptor received from a peer: kind set, buffers valid, sorted, non-overlapping.
pub(crate) fn validate_descriptor(
    mut d: SegmentDescriptor,
    opened_as: &str,
) -> Result<SegmentDescriptor> {
    let bad = |why: String| TransferError::Handshake {
        peer: opened_as.to_string(),
        source: HandshakeError::InvalidDescriptor(why),
    };
    d.buffers.sort_by_key(|b| b.region.addr);
    let mut prev_end = 0u64;
    for (i, b) in d.buffers.iter().enumerate() {
        let end = b
            .region
            .addr
            .checked_add(b.region.len)
            .ok_or_else(|| bad(format!("buffer {:#x} wraps", b.region.addr)))?;
        if b.region.len == 0 {
            return Err(bad(format!("buffer {:#x} has zero length", b.region.addr)));
        }
        if i > 0 && b.region.addr < prev_end {
            return Err(bad(format!(
                "buffer {:#x} overlaps the previous one",
                b.region.addr
            )));
        }
        prev_end = end;
    }
    // Reach the peer by the name we used (its own host may be a bind address).
    d.name = opened_as.to_string();
    Ok(d)
}

/// Cuts `[0, len)` of one request at every boundary of either side, then into slices of
/// `slice_size` (a tail of at most `slice_size/4` merged into the previous slice).
/// `local`/`remote` are the covers `(addr, len, item)` of the two sides, in order.
fn cut_request(
    req: &TransferRequest,
    local: &[(u64, u64, MemoryRegion)],
    remote: &[(u64, u64, usize)],
    slice_size: u64,
    out: &mut Vec<Slice>,
) {
    let (mut li, mut ri) = (0usize, 0usize);
    let (mut lo, mut ro) = (0u64, 0u64); // offsets consumed within the current pieces
    let mut off = 0u64;
    while off < req.len {
        let (_, llen, region) = local[li];
        let (_, rlen, buffer) = remote[ri];
        let chunk = (llen - lo).min(rlen - ro);
        let mut at = 0u64;
        let full = chunk / slice_size;
        let rem = chunk % slice_size;
        let merge_tail = full >= 1 && rem > 0 && rem <= slice_size / 4;
        while at < chunk {
            let mut n = (chunk - at).min(slice_size);
            if merge_tail && chunk - at == slice_size + rem {
                n = slice_size + rem;
            }
            out.push(Slice {
                id: out.len() as u32,
                op: req.op,
                local_addr: req.local_addr + off + at,
                local_region: region,
                remote_addr: req.remote_addr + off + at,
                remote_buffer: buffer,
                len: n,
            });
            at += n;
        }
        off += chunk;
        lo += chunk;
        ro += chunk;
        if lo == llen {
            li += 1;
            lo = 0;
        }
        if ro == rlen {
            ri += 1;
            ro = 0;
        }
    }
}

impl TransferEngine {
    /// Starts an engine: binds the handshake listener on `config.host:config.port` (0 = any
    /// port), chooses the transport (one info line says which and why) and starts serving.
    /// Errors: `Config` for a bad config (slice_size 0, host not bindable, port in use, transport
    /// `rdma` with no usable device).
    pub fn new(config: EngineConfig) -> Result<Arc<TransferEngine>> {
        Self::with_memory_access(config, memory_access())
    }

    /// As `new`, with an explicit `MemoryAccess` for memory the host cannot address (`cuda:N`)
    /// instead of the built-in choice (`gpu::memory_access()` when built, else host only).
    pub fn with_memory_access(
        config: EngineConfig,
        memory: Arc<dyn MemoryAccess>,
    ) -> Result<Arc<TransferEngine>> {
        if config.slice_size == 0 {
            return Err(TransferError::Config("slice_size must be > 0".into()));
        }
        let host = config.host.trim().to_string();
        if host.is_empty() {
            return Err(TransferError::Config("host is empty".into()));
        }
        let bind_host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(&host)
            .to_string();
        let listener = TcpListener::bind((bind_host.as_str(), config.port)).map_err(|e| {
            TransferError::Bind(IoError::new(
                format!(
                    "bind handshake listener on {}",
                    segment_name(&bind_host, config.port)
                ),
                e,
            ))
        })?;
        let port = listener
            .local_addr()
            .map_err(|e| TransferError::io("handshake listener address", e))?
            .port();
        let name = segment_name(&bind_host, port);
        let instance_id = random_id();
        let registry = Arc::new(MemoryRegistry::new());
        let auth = AuthState::new(config.auth.resolve()?);
        let ctx = TransportContext {
            config: config.clone(),
            segment_name: name.clone(),
            instance_id,
            registry: registry.clone(),
            memory,
            auth: auth.clone(),
        };
        let (transport, why) = choose_transport(&ctx)?;
        tracing::info!(segment = %name, "kvferry transfer engine: transport {} ({why}); {}", transport.name(), auth.describe());

        let (t, reg, n, a) = (
            transport.clone(),
            registry.clone(),
            name.clone(),
            auth.clone(),
        );
        let handler = move |ty: FrameType, body: &[u8], session: &mut Session| -> Result<Vec<u8>> {
            let gate = |session: &Session| {
                if a.enforced() && !session.authed {
                    return Err(TransferError::Auth(AuthError::NotAuthenticated));
                }
                Ok(())
            };
            match ty {
                FrameType::Descriptor => {
                    gate(session)?;
                    let d = local_descriptor(&n, instance_id, &*t, &reg);
                    serde_json::to_vec(&d)
                        .map_err(|e| TransferError::Protocol(format!("encode descriptor: {e}")))
                }
                FrameType::Connect => {
                    gate(session)?;
                    t.on_handshake(session.peer, body)
                }
                FrameType::Hello => {
                    let nonce = crate::auth::random_bytes::<32>()?;
                    session.nonce = Some(nonce);
                    Ok(nonce.to_vec())
                }
                FrameType::Auth => {
                    if a.enforced() {
                        let r = crate::auth::check_auth_body(&a, body, session.nonce.take());
                        if let Err(e) = &r {
                            tracing::warn!(peer = %session.peer, "handshake authentication refused: {e}");
                        }
                        r?;
                    }
                    session.authed = true;
                    Ok(Vec::new())
                }
                FrameType::Error => Err(TransferError::Protocol(
                    "an error frame is not a request".into(),
                )),
            }
        };
        let server = HandshakeServer::start_limited(
            listener,
            Arc::new(handler),
            config.handshake_timeout,
            crate::admission::Limits::of(&config.tcp),
        )?;
        let peers = Arc::new(PeerCache::new(
            transport.clone(),
            auth.clone(),
            config.handshake_timeout,
            config.peer_idle_timeout,
        ));
        Ok(Arc::new(TransferEngine {
            config,
            name,
            instance_id,
            registry,
            transport,
            peers,
            batches: Mutex::new(HashMap::new()),
            next_batch: AtomicU64::new(1),
            handshake: Some(server),
            auth,
        }))
    }

    /// This engine's segment name, `host:port` of its handshake listener.
    pub fn segment_name(&self) -> String {
        self.name.clone()
    }

    /// The transport in use: `"tcp"` or `"rdma"`.
    pub fn transport_name(&self) -> &'static str {
        self.transport.name()
    }

    /// Whether peers must authenticate (a shared secret is configured; `crate::auth`).
    pub fn is_authenticated(&self) -> bool {
        self.auth.enforced()
    }

    /// Grants `spec.token` the right to `spec.ops` on `spec.ranges` of this engine's memory
    /// for `spec.ttl` (target side, `crate::auth`). Enforced only in authenticated mode; in
    /// open mode any peer may read and write anyway and the grant changes nothing. The grant
    /// ends when the returned guard is dropped or the ttl passes, whichever comes first.
    /// Errors (`InvalidArgument`): a range of length 0 or that wraps, more than
    /// `auth::MAX_GRANT_RANGES` ranges, a token that already has a live grant.
    pub fn grant(&self, spec: GrantSpec) -> Result<GrantGuard> {
        crate::auth::grant(&self.auth.grants, spec)
    }

    /// Live grants of this engine (diagnostics and tests).
    pub fn live_grants(&self) -> usize {
        self.auth.grants.len()
    }

    /// The configuration the engine was started with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The descriptor this engine returns to a peer's descriptor query (its registered buffers
    /// now).
    pub fn local_descriptor(&self) -> SegmentDescriptor {
        local_descriptor(
            &self.name,
            self.instance_id,
            &*self.transport,
            &self.registry,
        )
    }

    /// Registers `[addr, addr+len)` at `location` for transfers: peers may then READ and WRITE
    /// it, and local requests may use it. Errors: `InvalidArgument` for len 0, a range that wraps
    /// or overlaps a registered region; `Unsupported` when the transport cannot serve the
    /// location (GPU memory without the GPU backend); transport errors (RDMA registration).
    /// Takes the registry's write lock, so it may wait for TCP target-side accesses in progress
    /// (each bounded by `tcp.io_timeout` per socket operation).
    ///
    /// # Safety
    /// The range must be valid memory of `location` (writable) until `unregister_memory(addr)`
    /// returns, and no batch using it may be in flight when it is unregistered or freed.
    pub unsafe fn register_memory(&self, addr: u64, len: u64, location: Location) -> Result<()> {
        let region = MemoryRegion {
            addr,
            len,
            location,
        };
        let t = self.transport.clone();
        self.registry.insert(region, |r| t.register(r)).map(|_| ())
    }

    /// How the registered region containing `addr` was made reachable by peers (host memory
    /// in place, GPUDirect through dma-buf or peer memory, or staged through pinned host
    /// memory); `None` when no registered region contains `addr`.
    pub fn region_path(&self, addr: u64) -> Option<crate::memory::RegistrationPath> {
        self.registry.find(addr, 1).map(|e| e.keys.path)
    }

    /// Unregisters the region that starts at `addr` (after any in-progress TCP target access to
    /// it ended). `InvalidArgument` when no region starts there. Peers' cached descriptors still
    /// list it; their requests to it are refused by the target.
    pub fn unregister_memory(&self, addr: u64) -> Result<()> {
        let e = self.registry.remove(addr)?;
        if let Err(err) = self.transport.deregister(&e.region) {
            tracing::warn!("deregistering memory region {addr:#x}: {err}");
        }
        Ok(())
    }

    /// Opens segment `name` (`host:port` of a peer's handshake listener): returns the cached
    /// descriptor, or fetches it by a handshake (within `handshake_timeout`) and caches it.
    /// A descriptor not used (opened or submitted to) for `peer_idle_timeout` is dropped from
    /// the cache, as is one whose peer could not be reached again after a connection error.
    /// Errors: `InvalidArgument` for a name that is not `host:port`; `Handshake` when the peer
    /// cannot be reached or answers badly.
    pub fn open_segment(&self, name: &str) -> Result<SegmentHandle> {
        check_segment_name(name)?;
        if let Some(d) = self.peers.get(name) {
            return Ok(SegmentHandle {
                descriptor: d,
                token: None,
            });
        }
        Ok(SegmentHandle {
            descriptor: self.peers.fetch(name, None)?,
            token: None,
        })
    }

    /// As `open_segment`, for a peer that granted `token` (`crate::auth`): an uncached
    /// descriptor is fetched presenting the token (or this engine's secret proof, when it has
    /// a secret), and the returned handle carries the token into every request submitted with
    /// it. Errors as `open_segment`; a token the peer does not know is a `Handshake` error.
    pub fn open_segment_with_token(&self, name: &str, token: Token) -> Result<SegmentHandle> {
        check_segment_name(name)?;
        let descriptor = match self.peers.get(name) {
            Some(d) => d,
            None => self.peers.fetch(name, Some(&token))?,
        };
        Ok(SegmentHandle {
            descriptor,
            token: Some(token),
        })
    }

    /// Fetches segment `name`'s descriptor again (e.g. after the peer registered more memory) and
    /// replaces the cached one. Errors as `open_segment`.
    pub fn refresh_segment(&self, name: &str) -> Result<SegmentHandle> {
        check_segment_name(name)?;
        Ok(SegmentHandle {
            descriptor: self.peers.fetch(name, None)?,
            token: None,
        })
    }

    /// Forgets the cached descriptor of `name` and closes the transport's connections to it.
    pub fn close_segment(&self, name: &str) {
        self.peers.forget(name);
    }

    /// Counts of what this engine holds for peers now (see `EngineStats`); idle descriptors
    /// are dropped first.
    pub fn stats(&self) -> EngineStats {
        let t = self.transport.stats();
        EngineStats {
            cached_segments: self.peers.len(),
            peers: t.peers,
            connections: t.connections,
            served_connections: t.served_connections,
        }
    }

    /// Validates and slices `requests`, all with segment `target`, and starts them; returns at
    /// once with the batch id. Every request is checked before anything is sent: len > 0; local
    /// range covered by registered memory (else `NotRegistered`); remote range covered by the
    /// peer's advertised buffers (else the descriptor is fetched again once, then
    /// `RemoteOutOfRange`); the peer speaks this engine's transport (else `Unsupported`).
    /// Requests are cut into slices of `slice_size` that never cross a region on either side.
    /// An empty `requests` gives a batch that is already `Completed`. The handle's token
    /// (`SegmentHandle::with_token`), if any, travels with every data frame.
    /// A slice that fails on
    /// the peer's connection (refused or broken, the peer answers for another instance id, an
    /// RDMA connection error) is retried once after the descriptor is fetched again (once per
    /// batch): a peer restarted under the same name is reached at its new ports.
    pub fn submit(&self, target: &SegmentHandle, requests: &[TransferRequest]) -> Result<BatchId> {
        let mut desc = target.descriptor.clone();
        let local_covers = requests
            .iter()
            .map(|r| {
                if r.len == 0 {
                    return Err(TransferError::InvalidArgument(format!(
                        "request at local {:#x} has zero length",
                        r.local_addr
                    )));
                }
                self.registry
                    .cover(r.local_addr, r.len)
                    .map(|v| {
                        v.into_iter()
                            .map(|(a, l, e)| (a, l, e.region))
                            .collect::<Vec<_>>()
                    })
                    .ok_or(TransferError::NotRegistered {
                        addr: r.local_addr,
                        len: r.len,
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let remote_covers = match remote_covers(&desc, requests) {
            Ok(c) => c,
            Err(_) => {
                check_segment_name(target.name())?;
                desc = self.peers.fetch(target.name(), target.token.as_ref())?;
                remote_covers(&desc, requests)?
            }
        };
        if desc.transport.kind != self.transport.name() {
            return Err(crate::transport::kind_mismatch(
                self.transport.name(),
                &desc,
            ));
        }
        let mut slices = Vec::new();
        for ((r, l), rc) in requests.iter().zip(&local_covers).zip(&remote_covers) {
            let est = r.len / self.config.slice_size + (l.len() + rc.len()) as u64;
            if slices.len() as u64 + est > u32::MAX as u64 {
                return Err(TransferError::InvalidArgument(
                    "batch has too many slices; raise slice_size".into(),
                ));
            }
            cut_request(r, l, rc, self.config.slice_size, &mut slices);
        }
        let id = self.next_batch.fetch_add(1, Ordering::Relaxed);
        let state = BatchState::new(slices.len() as u32);
        self.batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, state.clone());
        self.peers.touch(&desc.name);
        if !slices.is_empty() {
            let refresh =
                BatchRefresh::new(self.peers.clone(), &desc.name, slices.clone(), target.token);
            self.transport.post(
                &desc,
                slices,
                CompletionSink::with_refresh(state, Arc::new(refresh)),
                target.token,
            );
        }
        Ok(BatchId(id))
    }

    fn batch(&self, batch: BatchId) -> Result<Arc<BatchState>> {
        self.batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&batch.0)
            .cloned()
            .ok_or(TransferError::UnknownBatch(batch.0))
    }

    /// The batch's current state; `Invalid` for an unknown or freed id.
    pub fn status(&self, batch: BatchId) -> BatchStatus {
        self.batch(batch)
            .map(|b| b.status())
            .unwrap_or(BatchStatus::Invalid)
    }

    /// Blocks until the batch finishes or `timeout` passes. `Ok` when every slice succeeded;
    /// `Failed` (first error and count), `Timeout` (the batch stays `Timeout`; its slices not yet
    /// sent are skipped, slices already on the wire may still land), `UnknownBatch`. A finished (completed or failed) batch is freed.
    pub fn wait(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        let r = self.batch(batch)?.wait(timeout);
        if !matches!(r, Err(TransferError::Timeout(_))) {
            self.free_batch(batch);
        }
        r
    }

    /// Async twin of `wait` for use inside a tokio runtime (needs the runtime's timer).
    pub async fn wait_async(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        let r = self.batch(batch)?.wait_async(timeout).await;
        if !matches!(r, Err(TransferError::Timeout(_))) {
            self.free_batch(batch);
        }
        r
    }

    /// Forgets a batch (its status becomes `Invalid`). Its slices not yet sent are skipped;
    /// slices already on the wire finish unobserved.
    pub fn free_batch(&self, batch: BatchId) {
        let b = self
            .batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&batch.0);
        if let Some(b) = b {
            b.cancel(); // slices not yet sent are skipped
        }
    }

    fn sync(&self, target: &str, op: Op, reqs: &[(u64, u64, u64)]) -> Result<()> {
        let seg = self.open_segment(target)?;
        let requests: Vec<TransferRequest> = reqs
            .iter()
            .map(|&(l, r, n)| TransferRequest {
                op,
                local_addr: l,
                remote_addr: r,
                len: n,
            })
            .collect();
        let bytes = reqs.iter().fold(0u64, |a, r| a.saturating_add(r.2));
        let id = self.submit(&seg, &requests)?;
        let r = self.wait(id, self.config.sync_timeout(bytes));
        self.free_batch(id);
        r
    }

    /// WRITEs `len` bytes from `local` (registered here) to `remote` in segment `target`
    /// (`host:port`, opened and cached as needed) and waits (deadline
    /// `transfer_timeout + transfer_timeout_per_byte × len`). Errors as `submit` and `wait`.
    pub fn transfer_sync_write(
        &self,
        target: &str,
        local: u64,
        remote: u64,
        len: u64,
    ) -> Result<()> {
        self.sync(target, Op::Write, &[(local, remote, len)])
    }

    /// READs `len` bytes from `remote` in segment `target` into `local`; as `transfer_sync_write`.
    pub fn transfer_sync_read(
        &self,
        target: &str,
        local: u64,
        remote: u64,
        len: u64,
    ) -> Result<()> {
        self.sync(target, Op::Read, &[(local, remote, len)])
    }

    /// WRITEs every `(local, remote, len)` to segment `target` as one batch and waits (deadline
    /// from the total bytes). Errors as `transfer_sync_write`; `Failed` names the first failure.
    pub fn batch_transfer_sync_write(
        &self,
        target: &str,
        requests: &[(u64, u64, u64)],
    ) -> Result<()> {
        self.sync(target, Op::Write, requests)
    }

    /// READs every `(local, remote, len)` from segment `target` as one batch and waits.
    pub fn batch_transfer_sync_read(
        &self,
        target: &str,
        requests: &[(u64, u64, u64)],
    ) -> Result<()> {
        self.sync(target, Op::Read, requests)
    }
}

/// What an engine holds for peers (`TransferEngine::stats`): what must return to its starting
/// values once peers die or go idle (issue 10, "no leaks under churn").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Peer descriptors cached (`open_segment`).
    pub cached_segments: usize,
    /// Peers the transport holds connection state for (TCP connection pools, RDMA peers with
    /// endpoints).
    pub peers: usize,
    /// Connections this engine opened: TCP data connections, RDMA QPs of its endpoints.
    pub connections: usize,
    /// Connections peers opened to this engine and it serves now: TCP data connections, RDMA
    /// QPs of passive endpoints.
    pub served_connections: usize,
}

fn check_segment_name(name: &str) -> Result<()> {
    let ok = name
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    if ok {
        Ok(())
    } else {
        Err(TransferError::InvalidArgument(format!(
            "segment name {name:?} is not host:port"
        )))
    }
}

fn local_descriptor(
    name: &str,
    instance_id: u64,
    t: &dyn Transport,
    reg: &MemoryRegistry,
) -> SegmentDescriptor {
    let mut buffers: Vec<BufferDesc> = reg
        .snapshot()
        .into_iter()
        .map(|e| BufferDesc {
            region: e.region,
            keys: e.keys,
        })
        .collect();
    // keep the reply under the frame limit: ~120 bytes of JSON per buffer
    let cap = (MAX_FRAME_BODY as usize / 160).max(1);
    if buffers.len() > cap {
        tracing::warn!(
            "{} registered regions; the descriptor lists only the first {cap}",
            buffers.len()
        );
        buffers.truncate(cap);
    }
    SegmentDescriptor {
        name: name.to_string(),
        instance_id,
        transport: t.local_info(),
        buffers,
    }
}

/// The peer-side covers `(addr, len, buffer index)` of every request, or `RemoteOutOfRange`.
fn remote_covers(
    desc: &SegmentDescriptor,
    requests: &[TransferRequest],
) -> Result<Vec<Vec<(u64, u64, usize)>>> {
    let idx: Vec<(usize, &BufferDesc)> = desc.buffers.iter().enumerate().collect();
    let refs: Vec<&(usize, &BufferDesc)> = idx.iter().collect();
    requests
        .iter()
        .map(|r| {
            cover_sorted(&refs, |(_, b)| &b.region, r.remote_addr, r.len)
                .map(|v| v.into_iter().map(|(a, l, (i, _))| (a, l, *i)).collect())
                .ok_or_else(|| TransferError::RemoteOutOfRange {
                    segment: desc.name.clone(),
                    addr: r.remote_addr,
                    len: r.len,
                })
        })
        .collect()
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.handshake.take();
        self.transport.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(addr: u64, len: u64) -> MemoryRegion {
        MemoryRegion {
            addr,
            len,
            location: Location::Cpu,
        }
    }

    #[test]
    fn cut_respects_both_sides_boundaries_and_merges_small_tails() {
        let req = TransferRequest {
            op: Op::Write,
            local_addr: 1000,
            remote_addr: 5000,
            len: 300,
        };
        // local: two regions split at offset 100; remote: split at offset 250
        let local = [
            (1000, 100, region(900, 200)),
            (1100, 200, region(1100, 200)),
        ];
        let remote = [(5000, 250, 0usize), (5250, 50, 1usize)];
        let mut out = Vec::new();
        cut_request(&req, &local, &remote, 64, &mut out);
        let spans: Vec<(u64, u64)> = out.iter().map(|s| (s.local_addr - 1000, s.len)).collect();
        // chunk [0,100): 64 + 36 (36 > 16, not merged); [100,250): 64+64+22; [250,300): 50
        assert_eq!(
            spans,
            vec![
                (0, 64),
                (64, 36),
                (100, 64),
                (164, 64),
                (228, 22),
                (250, 50)
            ]
        );
        assert!(out.iter().enumerate().all(|(i, s)| s.id as usize == i));
        assert_eq!(out[5].remote_buffer, 1);
        assert_eq!(out[2].local_region.addr, 1100);
        // a tail of at most slice/4 merges into the previous slice
        let req = TransferRequest {
            len: 64 * 3 + 16,
            ..req
        };
        let mut out = Vec::new();
        cut_request(
            &req,
            &[(1000, req.len, region(1000, 1000))],
            &[(5000, req.len, 0)],
            64,
            &mut out,
        );
        assert_eq!(
            out.iter().map(|s| s.len).collect::<Vec<_>>(),
            vec![64, 64, 80]
        );
        assert_eq!(out.iter().map(|s| s.len).sum::<u64>(), req.len);
    }

    #[test]
    fn segment_names_are_checked() {
        for ok in ["127.0.0.1:15000", "host:1", "[::1]:9"] {
            check_segment_name(ok).unwrap();
        }
        for bad in ["", "host", ":80", "host:0", "host:99999", "host:x"] {
            assert!(check_segment_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn peer_descriptors_with_overlap_or_wrap_are_refused() {
        let info = crate::transport::TransportInfo {
            kind: "tcp".into(),
            details: serde_json::json!({}),
        };
        let buf = |a, l| BufferDesc {
            region: region(a, l),
            keys: Default::default(),
        };
        let d = |bufs| SegmentDescriptor {
            name: "x:1".into(),
            instance_id: 1,
            transport: info.clone(),
            buffers: bufs,
        };
        assert!(validate_descriptor(d(vec![buf(100, 10), buf(105, 10)]), "p:1").is_err());
        assert!(validate_descriptor(d(vec![buf(u64::MAX - 1, 10)]), "p:1").is_err());
        assert!(validate_descriptor(d(vec![buf(100, 0)]), "p:1").is_err());
        let ok = validate_descriptor(d(vec![buf(200, 10), buf(100, 100)]), "p:1").unwrap();
        assert_eq!(ok.buffers[0].region.addr, 100);
        assert_eq!(ok.name, "p:1");
    }
}
