//! The transport interface: one small trait that moves slices between this engine's registered
//! memory and a peer segment's advertised buffers, in the manner of NCCL's net plugin and
//! Mooncake's `Transport` (docs/design.md §3). Two implementations: TCP (`tcp`, always built) and
//! RDMA (`rdma`, in `transport/rdma/`,
//! cargo feature `rdma`).
//!
//! # How the engine drives a transport
//!
//! 1. **Creation.** The engine binds its handshake listener (so its segment name is known),
//!    builds a [`TransportContext`] and creates the transport in `select::choose`, the one
//!    place a configured kind (or `Auto`) becomes a transport: TCP with
//!    `tcp::TcpTransport::new`, RDMA with `rdma::create(&ctx)`; for `Auto` it first calls
//!    `rdma::probe(&ctx.config.rdma)`.
//! 2. **Registration.** `TransferEngine::register_memory` checks the region (len > 0, no overlap)
//!    and then calls [`Transport::register`] under the registry's write lock; the returned
//!    [`RegionKeys`] are published with the region in this engine's [`SegmentDescriptor`].
//!    `unregister_memory` calls [`Transport::deregister`] the same way.
//! 3. **Descriptor.** A peer's `open_segment` sends a `Descriptor` handshake frame; the engine
//!    answers with `{name, instance_id, transport: local_info(), buffers}` itself
//!    (`crate::handshake_service`, `SegmentDescriptor::build`).
//! 4. **Connect frames.** Any other connection set-up a transport needs (RDMA: QP numbers, PSNs,
//!    GIDs, LIDs, active MTUs) travels as a `Connect` handshake frame: the initiating transport
//!    sends it with [`crate::handshake::request`]`(&peer.name, FrameType::Connect, body,
//!    timeout)` and gets the reply body back; on the target the engine hands the body to
//!    [`Transport::on_handshake`] and sends back what it returns (or an error frame with the
//!    error's text, which the initiator receives as `TransferError::Handshake`). The body format
//!    is the transport's own (JSON recommended); it must be at most 1 MiB.
//! 5. **Transfers.** `submit` validates every request (local range covered by registered memory,
//!    remote range covered by the peer's advertised buffers), cuts it into [`Slice`]s and calls
//!    [`Transport::post`] once per submit with all slices of the batch. The transport executes
//!    them asynchronously and reports each slice exactly once to the [`CompletionSink`]. The batch
//!    is done when success + failed slices = slices (as in Mooncake).
//!    `submit_strided` validates strided requests per block and, for the pairs of regions a
//!    transport says it takes ([`Transport::takes_strided`]), calls [`Transport::post_strided`]
//!    with whole groups of blocks instead (each group one unit of completion); otherwise it cuts
//!    the copies into slices as above.
//! 6. **Shutdown.** When the engine is dropped it calls [`Transport::shutdown`].
//!
//! # What the RDMA module must provide (`transport/rdma/mod.rs`)
//!
//! ```ignore
//! /// Some(one-line description of the usable device(s), e.g. "rxe0 port 1, RoCEv2 GID 1,
//! /// MTU 1024") when at least one device (restricted to `config.devices` when non-empty) can be
//! /// opened and has an ACTIVE port; None otherwise. Quick, never panics, no side effects.
//! pub fn probe(config: &crate::config::RdmaConfig) -> Option<String>;
//! /// The RDMA transport. Errors: `TransferError::Rdma` / `Config` with a clear text.
//! pub fn create(ctx: &crate::transport::TransportContext)
//!     -> Result<std::sync::Arc<dyn crate::transport::Transport>, crate::error::TransferError>;
//! ```
//! The module is compiled with the cargo feature `rdma` (its verbs bindings need cmake and
//! libclang to build); without it the engine treats RDMA as absent and says so.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::config::EngineConfig;
use crate::descriptor::{SegmentDescriptor, TransportInfo};
use crate::error::{Result, TransferError};
use crate::memory::{MemoryAccess, MemoryRegion, MemoryRegistry, RegionKeys};
use crate::types::{Op, TransportKind};

pub mod completion;
pub mod cuda_ipc;
pub(crate) mod select;
pub mod tcp;
pub(crate) mod wire;

#[cfg(feature = "rdma")]
pub mod rdma;

pub use completion::CompletionSink;

/// Everything a transport gets from the engine at creation.
#[derive(Clone)]
pub struct TransportContext {
    /// The engine's configuration (`rdma`, `tcp`, timeouts, `host`).
    pub config: EngineConfig,
    /// This engine's segment name (`host:port` of the handshake listener).
    pub segment_name: String,
    /// This engine instance's random id (`SegmentDescriptor::instance_id`).
    pub instance_id: u64,
    /// The engine's registered regions. A target-side transport that serves requests in code
    /// (TCP) checks every request against it (`with_region` holds the lock while serving).
    pub registry: Arc<MemoryRegistry>,
    /// Copies to/from memory the host cannot address (`cuda:N`); see `MemoryAccess`.
    pub memory: Arc<dyn MemoryAccess>,
    /// The engine's authorization mode and grants: a target-side transport that serves
    /// requests in code (TCP) checks every frame's token against it when it is enforced; an
    /// initiator proves its secret with it on a peer's handshake listener (RDMA connects).
    pub(crate) auth: Arc<crate::auth::AuthState>,
}

/// One piece of a request, as the engine hands it to `post`. Guarantees:
/// `[local_addr, local_addr+len)` lies inside `local_region` (registered here) and
/// `[remote_addr, remote_addr+len)` inside `peer.buffers[remote_buffer].region`; `len` > 0 and
/// at most `s + s/4` (a merged tail), `s` the slice size `Transport::slice_size` gave for the
/// pair of regions. Ids of one `post` are 0..n, in request order; consecutive slices of one
/// request are contiguous on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    /// Index of this slice within its `post` call: 0..slices.len(). Report it to the sink.
    pub id: u32,
    /// `Write`: local → remote. `Read`: remote → local.
    pub op: Op,
    /// Start of the local side: a virtual address in this process, inside `local_region`.
    pub local_addr: u64,
    /// The registered local region that contains the slice (RDMA: look up its lkey by `addr`).
    pub local_region: MemoryRegion,
    /// Start of the remote side: a virtual address in the peer's process, inside
    /// `peer.buffers[remote_buffer].region`.
    pub remote_addr: u64,
    /// Index into `peer.buffers` of the buffer that contains the remote side
    /// (RDMA: its rkeys, `RdmaPeerInfo::buffers[remote_buffer]`).
    pub remote_buffer: usize,
    /// Bytes.
    pub len: u64,
}

/// A transport: moves slices between this engine's registered memory and peer segments.
/// Implementations are shared across threads (`Send + Sync`) and called concurrently.
pub trait Transport: Send + Sync + 'static {
    /// `Tcp` or `Rdma` (never `Auto`); also `TransportInfo::kind` in this engine's
    /// descriptor. Two segments talk only when their transports are of one kind.
    fn kind(&self) -> TransportKind;

    /// What goes in this engine's segment descriptor (see `TransportInfo`). Called for every
    /// descriptor query; cheap and infallible.
    fn local_info(&self) -> TransportInfo;

    /// Makes `region` accessible to peers (RDMA: `ibv_reg_mr`/dma-buf on every device, with
    /// remote read and write access, or a registered host mirror for GPU memory the NIC
    /// cannot register; keep the lkeys internally, keyed by `region.addr`) and returns the
    /// keys to publish, with the `RegistrationPath` taken. TCP: checks the location is
    /// servable, returns no rkeys.
    /// Called with the registry write-locked; the region is already checked (len > 0, no
    /// overlap). On error nothing must stay registered.
    fn register(&self, region: &MemoryRegion) -> Result<RegionKeys>;

    /// Undoes `register` for the region (same `addr`, `len`, `location`). Called with the
    /// registry write-locked, after the engine removed the region (no TCP target access to it
    /// is in progress). Errors are logged by the engine; the region is gone either way.
    fn deregister(&self, region: &MemoryRegion) -> Result<()>;

    /// Handles a `Connect` handshake frame from `peer` and returns the reply body. Runs on the
    /// handshake server's thread for that connection; must return within
    /// `config.handshake_timeout`. An `Err` is sent back as an error frame with its text.
    /// Must not panic whatever `body` holds. TCP: always `Unsupported`.
    fn on_handshake(&self, peer: SocketAddr, body: &[u8]) -> Result<Vec<u8>>;

    /// Starts the slices (all to segment `peer`, any mix of ops) and returns without waiting for
    /// the network (it may block briefly on internal locks or a bounded queue). Each slice must
    /// be reported exactly once with `done.complete(slice.id, result)` — from any thread, in any
    /// order, possibly before `post` returns — with `Ok(())` only when the bytes are in place
    /// (WRITE: applied at the target; READ: in local memory), else an error naming the cause.
    /// A transport that cannot reach the peer reports every slice failed within its own
    /// deadlines (never holds a slice forever). `peer.transport.kind == self.kind()` is already
    /// checked by the engine. Before starting a slice, check `done.is_cancelled()`: a cancelled
    /// batch's unsent slices are reported with `CompletionSink::cancelled_error()`, not sent.
    /// `token`: the grant token the target made for these slices (`SegmentHandle::with_token`),
    /// carried in every TCP data frame; `None` in open mode. `slices` is borrowed: the engine
    /// keeps the batch's one copy (for the retry on a fresh descriptor), so a submit copies no
    /// slice table; a transport copies only what it keeps.
    fn post(
        &self,
        peer: &Arc<SegmentDescriptor>,
        slices: &[Slice],
        done: CompletionSink,
        token: Option<crate::auth::Token>,
    );

    /// Whether [`Transport::post_strided`] takes strided groups between `local` (registered
    /// here) and the peer's buffer `remote_buffer` (`TransferEngine::submit_strided`): a
    /// transport whose copies are device work (CUDA IPC) carries a group's copies without
    /// one slice each. Called at submit, once per pair of regions. Default: `false` (the
    /// engine then cuts the copies into slices and calls `post`, as for `submit`).
    fn takes_strided(
        &self,
        _peer: &SegmentDescriptor,
        _local: &MemoryRegion,
        _remote_buffer: usize,
    ) -> bool {
        false
    }

    /// Starts the strided groups (all to segment `peer`, every pair one `takes_strided`
    /// accepted) and returns without waiting. Guarantees as for `Slice`: every byte of every
    /// copy of a group lies inside its `local_region` and the peer's buffer `remote_buffer`;
    /// ids are 0..groups.len(). Each group is reported exactly once with
    /// `done.complete(group.id, result)`, `Ok(())` only when all its copies are in place;
    /// a cancelled batch's unstarted groups with `CompletionSink::cancelled_error()`. A
    /// group has no retry on a fresh descriptor. Default (never called while `takes_strided`
    /// is `false`): reports every group `Unsupported`.
    fn post_strided(
        &self,
        _peer: &Arc<SegmentDescriptor>,
        groups: &[crate::strided::StridedGroup],
        done: CompletionSink,
    ) {
        done.fail_all(
            groups.iter().map(|g| g.id),
            &TransferError::Unsupported(crate::error::UnsupportedError::NoStridedGroups {
                transport: self.kind().as_str(),
            }),
        );
    }

    /// The path a slice between `local` (a registered region here) and the peer's buffer
    /// `remote_buffer` takes now (`TransferEngine::transfer_path`). Default: this transport's
    /// kind (`Tcp` or `Rdma`).
    fn path(
        &self,
        _peer: &SegmentDescriptor,
        _local: &MemoryRegion,
        _remote_buffer: usize,
    ) -> crate::types::TransferPath {
        match self.kind() {
            TransportKind::Rdma => crate::types::TransferPath::Rdma,
            _ => crate::types::TransferPath::Tcp,
        }
    }

    /// The slice size (bytes, > 0) for runs between `local` (registered here) and the peer's
    /// buffer `remote_buffer`; `default` is the engine's `slice_size`. The slice is the unit
    /// of completion accounting and of the one retry on a fresh descriptor: a transport whose
    /// cost per slice is host work rather than wire time (device copies) asks for larger ones;
    /// a slice it hands to another transport must then still fit that one's limits.
    /// Called at submit, once per pair of regions. Default: `default`.
    fn slice_size(
        &self,
        _peer: &SegmentDescriptor,
        _local: &MemoryRegion,
        _remote_buffer: usize,
        default: u64,
    ) -> u64 {
        default
    }

    /// Why the registered region at base address `addr` is not shared with peers on this host
    /// the way this transport shares device memory (CUDA IPC: the export's error; the region
    /// then moves over the wrapped network transport). `None`: it is shared, is not device
    /// memory, or this transport shares nothing that way (the default).
    fn not_exported(&self, _addr: u64) -> Option<crate::error::TransferError> {
        None
    }

    /// Prepares now what the first transfer to `peer` would otherwise set up itself (CUDA
    /// IPC: imports the peer's allocations that this engine's device memory copies through),
    /// called right after the engine fetched `peer`'s descriptor (`TransferEngine::open_segment`),
    /// so that no transfer pays it. All of it ends within one handshake timeout.
    /// Returns how many items (allocations) it asked for. Errors: a failed request (the
    /// engine logs it); what it did not prepare, the first transfer prepares as before.
    /// Default: nothing (`Ok(0)`).
    fn warm_up(&self, _peer: &Arc<SegmentDescriptor>) -> Result<usize> {
        Ok(0)
    }

    /// Ranges `(remote address, length)` of `peer`'s registered device memory as addresses
    /// that kernels of this process on local device `device` read directly, one per range,
    /// each mapped as long as its [`MappedRange`] lives (CUDA IPC: the peer's allocation as
    /// imported here). Sets nothing up: `None` where this transport maps no peer memory (TCP,
    /// RDMA: the default) or has not mapped some range's allocation for `device` yet (its
    /// first transfer there does). Errors: `RemoteOutOfRange` for the first range not inside
    /// one buffer of `peer`, what the peer has registered now (its live table), and the
    /// allocation as mapped here.
    fn mapped(
        &self,
        _peer: &Arc<SegmentDescriptor>,
        _device: u32,
        _ranges: &[(u64, u64)],
    ) -> Option<Result<Vec<MappedRange>>> {
        None
    }

    /// Drops cached connections/endpoints to segment `name` (the engine calls it when the peer's
    /// descriptor changed, e.g. the peer restarted). Default: nothing.
    fn disconnect(&self, _name: &str) {}

    /// The engine dropped segment `name`'s descriptor after `EngineConfig::peer_idle_timeout`
    /// without an open or a submit: drop what is held for it that has no idle limit of its own
    /// (CUDA IPC: the peer's imported allocations, which would otherwise stay mapped for the
    /// life of the process). Transfers still in flight to it must not fail for it (unlike
    /// `disconnect`). Default: nothing (TCP connections and RDMA endpoints time out alone).
    fn forget_idle(&self, _name: &str) {}

    /// Counts of the connection state held now (`TransferEngine::stats`). Default: zeros.
    fn stats(&self) -> TransportStats {
        TransportStats::default()
    }

    /// Stops the transport's threads and closes its connections; in-flight slices are reported
    /// failed. Called once, when the engine is dropped. Default: nothing.
    fn shutdown(&self) {}

    /// Orders this transport's later copies of device `device`'s memory after `point`, an
    /// event recorded on a caller's stream after the work that wrote the KV
    /// (`TransferEngine::order_after`). The caller's stream is never synchronised. Default
    /// (transports that read device memory from the host: TCP's pinned staging, RDMA): waits
    /// on the host for the event, up to `deadline`. Errors: `Timeout`, a driver failure.
    fn order_after(&self, _device: u32, point: &StreamPoint, deadline: Duration) -> Result<()> {
        wait_point(point, deadline)
    }
}

/// A peer's device memory as this process's kernels reach it ([`Transport::mapped`]): the
/// mapping stays while this value (or a clone of [`MappedRange::keep`]) lives.
#[derive(Clone)]
pub struct MappedRange {
    ptr: u64,
    keep: Arc<dyn std::any::Any + Send + Sync>,
}

impl MappedRange {
    /// A range at `ptr` kept mapped by `keep`.
    pub fn new(ptr: u64, keep: Arc<dyn std::any::Any + Send + Sync>) -> MappedRange {
        MappedRange { ptr, keep }
    }

    /// The range's first byte as a device address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// What keeps the range mapped: hold it until the device is done reading (a kernel that
    /// reads the range may outlive this value).
    pub fn keep(&self) -> Arc<dyn std::any::Any + Send + Sync> {
        self.keep.clone()
    }
}

impl std::fmt::Debug for MappedRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedRange({:#x})", self.ptr)
    }
}

/// A point on a caller's CUDA stream: an event recorded there, shared by the transports that
/// order their copies after it.
pub type StreamPoint = Arc<kvferry_cuda::driver::Event>;

/// An event recorded on `stream` (a raw `CUstream` of device `device`; 0: the legacy default
/// stream) after the work queued there so far. Errors: no CUDA, a driver failure.
///
/// # Safety
/// `stream` is 0 or a live stream of device `device`.
pub unsafe fn stream_point(device: u32, stream: u64) -> Result<StreamPoint> {
    kvferry_cuda::guarded("stream point", || {
        let ctx = kvferry_cuda::driver::Context::new(device)?;
        let event = kvferry_cuda::driver::Event::new(&ctx, false)?;
        // SAFETY: the caller's contract: a live stream of this device (or the default).
        unsafe { event.record(stream as kvferry_cuda::sys::CUstream)? };
        Ok(Arc::new(event))
    })
    .map_err(TransferError::gpu)
}

/// Waits on the host until the work before `point` has completed on the device (polling the
/// event: never a synchronisation of the stream it was recorded on), up to `deadline`.
/// Errors: `Timeout`, a driver failure.
pub fn wait_point(point: &StreamPoint, deadline: Duration) -> Result<()> {
    use kvferry_cuda::driver::EventState;
    let end = std::time::Instant::now() + deadline;
    let mut pause = Duration::from_micros(10);
    loop {
        match point.query() {
            Ok(EventState::Done) => return Ok(()),
            Ok(EventState::Pending) => {}
            Err(e) => return Err(TransferError::gpu(e)),
        }
        if std::time::Instant::now() >= end {
            return Err(TransferError::Timeout(deadline));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

/// A transport's connection state (`Transport::stats`), as `EngineStats` reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Peers with connection state (TCP pools, RDMA peers with endpoints).
    pub peers: usize,
    /// Connections opened by this side (TCP data connections, RDMA QPs).
    pub connections: usize,
    /// Connections served for peers (TCP data connections, RDMA passive QPs).
    pub served_connections: usize,
}
