//! The transfer engine (docs/design.md §3): the public facade. It owns the parts and says in
//! which order they are used; each rule lives in the part's own file:
//! - `transport::select`: which transport the engine uses (and why);
//! - `handshake_service`: what the handshake listener answers, behind the auth gate;
//! - `descriptor`: descriptors built, validated, covered, kind-checked;
//! - `path`: path reporting (region paths, CUDA IPC export, transfer paths, metrics labels);
//! - `batch`: requests cut into slices, the batch table;
//! - `peer_cache`: peers' descriptors, their expiry and the one retry on a stale one.

use std::sync::Arc;
use std::time::Duration;

use crate::auth::{AuthState, GrantGuard, GrantSpec, Token};
use crate::batch::{self, BatchTable};
use crate::config::EngineConfig;
use crate::descriptor::SegmentDescriptor;
use crate::error::{ConfigError, Result};
use crate::handshake::HandshakeServer;
use crate::handshake_service::HandshakeService;
use crate::memory::{MemoryAccess, MemoryRegion, MemoryRegistry};
use crate::peer_cache::{BatchRefresh, PeerCache};
use crate::segment::{check_segment_name, SegmentHandle};
use crate::transport::completion::BatchState;
use crate::transport::{CompletionSink, Transport, TransportContext};
pub use crate::types::EngineStats;
use crate::types::{BatchId, BatchStatus, Location, TransferRequest, TransportKind};

/// A transfer engine: one segment (`host:port`), its registered memory, and the transport that
/// moves bytes to and from peer segments. `Send + Sync`; used behind `Arc`. Dropping the last
/// `Arc` closes the listeners and connections (in-flight slices fail).
///
/// Threads: the engine owns std threads (handshake listener, transport threads) and no async
/// runtime. Sync methods block only on std primitives with deadlines, so they work from any
/// thread, inside a tokio runtime too (they block that worker: from async code prefer
/// `submit` + `wait_async`).
pub struct TransferEngine {
    pub(crate) config: EngineConfig,
    name: String,
    instance_id: u64,
    pub(crate) registry: Arc<MemoryRegistry>,
    pub(crate) transport: Arc<dyn Transport>,
    transport_reason: String,
    pub(crate) peers: Arc<PeerCache>,
    pub(crate) batches: BatchTable,
    /// The metrics series of the kinds of batch seen last (`crate::metrics`).
    pub(crate) series: crate::batch_meter::SeriesCache,
    handshake: Option<HandshakeServer>,
    auth: Arc<AuthState>,
    /// Counts this engine in the process's peer fd budget (`crate::fd_budget`).
    _slot: crate::fd_budget::EngineSlot,
}

impl TransferEngine {
    /// Starts an engine: binds the handshake listener on `config.host:config.port` (0 = any
    /// port), chooses the transport (one info line says which and why) and starts serving.
    /// Errors: `Config` for a bad config (slice_size 0, host not bindable, port in use, transport
    /// `rdma` with no usable device).
    pub fn new(config: EngineConfig) -> Result<Arc<TransferEngine>> {
        Self::with_memory_access(config, crate::gpu::memory_access())
    }

    /// As `new`, with an explicit `MemoryAccess` for memory the host cannot address (`cuda:N`)
    /// instead of the built-in choice (`gpu::memory_access()` when built, else host only).
    pub fn with_memory_access(
        config: EngineConfig,
        memory: Arc<dyn MemoryAccess>,
    ) -> Result<Arc<TransferEngine>> {
        Self::start(config, memory, |ctx| {
            let chosen = crate::transport::select::choose(ctx)?;
            Ok((chosen.transport, chosen.why.to_string()))
        })
    }

    /// As `with_memory_access`, with the transport (and the reason the info line gives)
    /// made by `choose` from the engine's transport context.
    fn start(
        config: EngineConfig,
        memory: Arc<dyn MemoryAccess>,
        choose: impl FnOnce(&TransportContext) -> Result<(Arc<dyn Transport>, String)>,
    ) -> Result<Arc<TransferEngine>> {
        if config.slice_size == 0 {
            return Err(ConfigError::at_least("slice_size", 0, 1).into());
        }
        let host = config.host.trim().to_string();
        if host.is_empty() {
            return Err(ConfigError::EmptyHost.into());
        }
        let (listener, name) = crate::handshake_service::bind(&host, &config)?;
        let instance_id = crate::ids::random_u64();
        let registry = Arc::new(MemoryRegistry::new());
        let auth = AuthState::new(config.auth.resolve()?, &name);
        let ctx = TransportContext {
            config: config.clone(),
            segment_name: name.clone(),
            instance_id,
            registry: registry.clone(),
            memory,
            auth: auth.clone(),
        };
        let (transport, transport_reason) = choose(&ctx)?;
        tracing::info!(segment = %name, "kvferry transfer engine: transport {} ({}); {}", transport.kind(), transport_reason, auth.describe());
        let server = HandshakeService {
            name: name.clone(),
            instance_id,
            registry: registry.clone(),
            transport: transport.clone(),
            auth: auth.clone(),
        }
        .start(
            listener,
            config.handshake_timeout,
            crate::admission::Limits::of(&config.tcp),
        )?;
        let peers = Arc::new(PeerCache::new(
            transport.clone(),
            auth.clone(),
            config.handshake_timeout,
            config.peer_idle_timeout,
            config.tcp.connections_per_peer,
        ));
        Ok(Arc::new(TransferEngine {
            config,
            name,
            instance_id,
            registry,
            transport,
            transport_reason,
            peers,
            batches: BatchTable::new(),
            series: Default::default(),
            handshake: Some(server),
            auth,
            _slot: crate::fd_budget::EngineSlot::new(),
        }))
    }

    /// This engine's segment name, `host:port` of its handshake listener.
    pub fn segment_name(&self) -> String {
        self.name.clone()
    }

    /// The transport in use: `"tcp"` or `"rdma"` (`transport_kind().as_str()`).
    pub fn transport_name(&self) -> &'static str {
        self.transport.kind().as_str()
    }

    /// The transport in use: `Tcp` or `Rdma` (never `Auto`).
    pub fn transport_kind(&self) -> TransportKind {
        self.transport.kind()
    }

    /// Why the engine uses its transport, as its info line gives it: `"configured"`,
    /// `"auto: RDMA device mlx5_0 port 1, RoCE GID 3 (::ffff:10.0.0.1), MTU 4096"`,
    /// `"auto: no usable RDMA device"`, ...
    pub fn transport_reason(&self) -> &str {
        &self.transport_reason
    }

    /// Handshake authentications this engine refused, and how many were logged (the WARN is
    /// rate-limited: a peer sending bad proofs cannot fill the log).
    pub fn auth_refusals(&self) -> crate::auth::AuthRefusals {
        self.auth.refusals()
    }

    /// The shared secret this engine authenticates with, `None` in open mode. For embedders
    /// that run a control channel beside the engine and prove the same secret on it (the P2P
    /// connector); never logged (its `Debug` is redacted).
    pub fn secret(&self) -> Option<&crate::auth::Secret> {
        self.auth.secret.as_ref()
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
        let info = self.transport.local_info();
        SegmentDescriptor::build(&self.name, self.instance_id, info, &self.registry)
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
        if location == Location::Cpu && len > 0 && addr.checked_add(len).is_some() {
            // A peer reads and writes what is registered: never a range this process has not
            // mapped (read-write), whatever the caller promised.
            crate::memory::check_host_mapped(addr, len)?;
        }
        let t = self.transport.clone();
        self.registry.insert(region, |r| t.register(r)).map(|_| ())
    }

    /// Orders this engine's later transfers of device `device`'s memory after the work queued
    /// so far on `stream` (a raw `CUstream` of that device; 0: the legacy default stream):
    /// an event is recorded there, the CUDA IPC copy stream waits for it on the device, and
    /// the paths that read device memory from the host (TCP staging, RDMA) wait for it on the
    /// host before their next such slice, up to `deadline`. Never synchronises `stream`.
    /// Errors: no CUDA, a driver failure.
    ///
    /// # Safety
    /// `stream` is 0 or a live stream of device `device`.
    pub unsafe fn order_after(&self, device: u32, stream: u64, deadline: Duration) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        let point = unsafe { crate::transport::stream_point(device, stream) }?;
        self.transport.order_after(device, &point, deadline)
    }

    /// How the registered region containing `addr` was made reachable by peers (host memory
    /// in place, GPUDirect through dma-buf or peer memory, or staged through pinned host
    /// memory); `None` when no registered region contains `addr`.
    pub fn region_path(&self, addr: u64) -> Option<crate::memory::RegistrationPath> {
        crate::path::region_path(&self.registry, addr)
    }

    /// Whether peers on this host reach the `cuda:N` region containing `addr` through CUDA IPC:
    /// `Some(Ok(()))` when it is exported, `Some(Err(e))` when it could not be (`e`: the
    /// export's error, e.g. `Gpu` from the driver or `Unsupported(NoHostIdentity)`; the region
    /// moves over the network transport), `None` for host memory, an engine without CUDA IPC,
    /// or no region at `addr`.
    pub fn region_cuda_ipc(&self, addr: u64) -> Option<Result<()>> {
        crate::path::region_cuda_ipc(&self.registry, self.transport.as_ref(), addr)
    }

    /// The path a transfer between `local_addr` (registered here) and `remote_addr` (in a
    /// buffer of `target`) takes now: CUDA IPC, TCP or RDMA. Errors: `NotRegistered` and
    /// `RemoteOutOfRange` as `submit`.
    pub fn transfer_path(
        &self,
        target: &SegmentHandle,
        local_addr: u64,
        remote_addr: u64,
    ) -> Result<crate::types::TransferPath> {
        let t = self.transport.as_ref();
        crate::path::transfer_path(&self.registry, t, target, local_addr, remote_addr)
    }

    /// Ranges `(remote address, length)` of `target`'s registered device memory as addresses
    /// that this process's kernels on `cuda:device` read directly, one per range, each mapped
    /// while its value lives (`Transport::mapped`): what a kernel that reads a peer's KV
    /// itself needs. Never imports or blocks for one: `Ok(None)` where the transport maps no
    /// peer memory (TCP, RDMA) or has not mapped some range's allocation for `device` yet (a
    /// transfer between them does). Errors: `RemoteOutOfRange` for a range not inside one
    /// buffer of `target`, what the peer has registered now, and the allocation as mapped
    /// here.
    pub fn mapped(
        &self,
        target: &SegmentHandle,
        device: u32,
        ranges: &[(u64, u64)],
    ) -> Result<Option<Vec<crate::transport::MappedRange>>> {
        self.transport
            .mapped(&target.descriptor, device, ranges)
            .transpose()
    }

    /// Unregisters the region that starts at `addr`, once no batch of this engine moves bytes
    /// from or into it (waiting up to `unregister_timeout` for the last slice of each to be
    /// reported, even of a batch whose wait timed out) and any in-progress TCP target access
    /// to it ended; it never returns while this engine may still touch the memory. Errors:
    /// `InvalidArgument` when no region starts there; `InUse` when batches still use it at the
    /// deadline (it stays registered: do not free it). Peers' cached descriptors still list
    /// it; their requests to it are refused by the target (RDMA: its keys are invalidated).
    pub fn unregister_memory(&self, addr: u64) -> Result<()> {
        let e = self
            .registry
            .remove_when_idle(addr, self.config.unregister_timeout)?;
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
        self.open(name, None)
    }

    /// Whether segment `name`'s descriptor is cached: `open_segment` then answers without a
    /// handshake (a caller that must not block for one asks first). Like an open, it marks
    /// the descriptor used and drops idle ones (which may wait for the transport's locks). A
    /// cached descriptor may still be dropped before the open (idle, or its peer
    /// unreachable), and a submit to it may still block: a transport's first transfers to a
    /// peer can set up its side (CUDA IPC imports the peer's allocations then).
    pub fn has_segment(&self, name: &str) -> bool {
        self.peers.get(name).is_some()
    }

    /// As `open_segment`, for a peer that granted `token` (`crate::auth`): an uncached
    /// descriptor is fetched presenting the token (or this engine's secret proof, when it has
    /// a secret), and the returned handle carries the token into every request submitted with
    /// it. Errors as `open_segment`; a token the peer does not know is a `Handshake` error.
    pub fn open_segment_with_token(&self, name: &str, token: Token) -> Result<SegmentHandle> {
        self.open(name, Some(token))
    }

    /// The cached descriptor of `name`, or one fetched presenting `token`; the handle carries it.
    fn open(&self, name: &str, token: Option<Token>) -> Result<SegmentHandle> {
        check_segment_name(name)?;
        let descriptor = match self.peers.get(name) {
            Some(d) => d,
            None => self.peers.fetch(name, token.as_ref(), true)?,
        };
        Ok(SegmentHandle { descriptor, token })
    }

    /// Fetches segment `name`'s descriptor again (e.g. after the peer registered more memory) and
    /// replaces the cached one. Errors as `open_segment`.
    pub fn refresh_segment(&self, name: &str) -> Result<SegmentHandle> {
        check_segment_name(name)?;
        Ok(SegmentHandle {
            descriptor: self.peers.fetch(name, None, true)?,
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
    /// Requests are cut into slices that never cross a region on either side, of `slice_size`
    /// or the size the transport chose for the pair of regions (`Transport::slice_size`).
    /// An empty `requests` gives a batch that is already `Completed`. The handle's token
    /// (`SegmentHandle::with_token`), if any, travels with every data frame.
    /// A slice that fails on
    /// the peer's connection (refused or broken, the peer answers for another instance id, an
    /// RDMA connection error) is retried once after the descriptor is fetched again (once per
    /// batch): a peer restarted under the same name is reached at its new ports.
    pub fn submit(&self, target: &SegmentHandle, requests: &[TransferRequest]) -> Result<BatchId> {
        let t0 = std::time::Instant::now();
        let local_covers = batch::local_covers(&self.registry, requests)?;
        let mut desc = target.descriptor.clone();
        let remote_covers = match desc.remote_covers(requests) {
            Ok(c) => c,
            Err(_) => {
                check_segment_name(target.name())?;
                // No warm-up here: a submit returns at once; its post imports what it needs.
                desc = self
                    .peers
                    .fetch(target.name(), target.token.as_ref(), false)?;
                desc.remote_covers(requests)?
            }
        };
        desc.check_kind(self.transport.kind())?;
        let default = self.config.slice_size;
        let slices = batch::slice_requests(requests, &local_covers, &remote_covers, |l, b| {
            self.transport.slice_size(&desc, l, b, default)
        })?;
        // the local regions stay registered until the last slice is reported
        let pins = self.registry.pin(&batch::region_starts(&slices))?;
        let path = self.path_label_at(requests.first().map(|r| r.local_addr));
        let n_slices = slices.len();
        let meter = self
            .series
            .start(t0, path, &desc.name, requests, n_slices as u32);
        let (id, state) = self.batches.start(n_slices as u32, meter);
        state.hold(pins);
        self.peers.touch(&desc, t0);
        let timing = tracing::enabled!(target: "kvferry::timing", tracing::Level::DEBUG);
        let prep_us = if timing {
            t0.elapsed().as_micros() as u64
        } else {
            0
        };
        if !slices.is_empty() {
            // The refresh keeps the batch's slices (a retry finds them by id); the post borrows.
            let refresh = BatchRefresh::new(self.peers.clone(), desc.clone(), slices, target.token);
            self.transport.post(
                &desc,
                refresh.slices(),
                CompletionSink::with_refresh(state, refresh.clone()),
                target.token,
            );
        }
        if timing {
            tracing::debug!(
                target: "kvferry::timing",
                slices = n_slices,
                prep_us,
                post_us = t0.elapsed().as_micros() as u64 - prep_us,
                "engine submit"
            );
        }
        Ok(id)
    }

    fn batch(&self, batch: BatchId) -> Result<Arc<BatchState>> {
        self.batches.get(batch)
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
        self.finish(batch, r)
    }

    /// Async twin of `wait` for use inside a tokio runtime (needs the runtime's timer).
    pub async fn wait_async(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        let r = self.batch(batch)?.wait_async(timeout).await;
        self.finish(batch, r)
    }

    /// Ends a wait with `r`: meters it, and frees the batch unless it timed out.
    fn finish(&self, batch: BatchId, r: Result<()>) -> Result<()> {
        self.batches.end(batch, &r);
        r
    }

    /// Forgets a batch (its status becomes `Invalid`). Its slices not yet sent are skipped;
    /// slices already on the wire finish unobserved.
    pub fn free_batch(&self, batch: BatchId) {
        self.batches.free(batch);
    }
}

impl TransferEngine {
    /// The metrics' `path` of a batch whose first local address is `first` (`crate::path`).
    pub(crate) fn path_label_at(&self, first: Option<u64>) -> &'static str {
        crate::path::label_at(&self.registry, self.transport.kind(), first)
    }
}

#[cfg(test)]
impl TransferEngine {
    /// An engine on host memory whose transport `make` builds (tests of the engine's own
    /// work with a transport of the test's).
    pub(crate) fn with_transport(
        config: EngineConfig,
        make: impl FnOnce(&TransportContext) -> Arc<dyn Transport>,
    ) -> Result<Arc<TransferEngine>> {
        let memory: Arc<dyn MemoryAccess> = Arc::new(crate::memory::HostMemoryAccess);
        Self::start(config, memory, |ctx| Ok((make(ctx), "test".to_string())))
    }
}

#[cfg(test)]
#[path = "engine_cost_tests.rs"]
mod cost_tests;

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.handshake.take();
        self.transport.shutdown();
    }
}
