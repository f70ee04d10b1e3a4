//! kvferry transfer engine (docs/design.md §3): a memory registry, segments named `host:port` found
//! by a P2P TCP handshake, batches of READ/WRITE requests cut into slices, and transports behind
//! one small trait (`transport::Transport`): TCP (always) and RDMA (`transport::rdma`).
//!
//! Threading: the engine runs its own std threads (handshake listener, TCP data listener and
//! connection threads); it owns no async runtime. Every sync call (`submit`, `wait`,
//! `open_segment`, the `*_sync_*` helpers) uses only std blocking primitives with deadlines, so
//! it never panics inside a tokio runtime (it does block that thread: from async code, call
//! `submit` and then `wait_async`, or wrap sync helpers in `spawn_blocking`).
//!
//! Modules behind the engine:
//! - `transport/rdma/` (cargo feature `rdma`; its verbs bindings need cmake and libclang):
//!   `probe(&RdmaConfig) -> Option<String>` and `create(&TransportContext)`; without the
//!   feature the engine treats RDMA as absent and its one info line says so.
//! - `gpu/`: `memory_access()`: copies to and from `cuda:N` memory through pinned staging for
//!   the TCP transport; where CUDA is absent it refuses `cuda:N` with `Unsupported`, never panics.
//!
//! Security model (`auth`): open by default, as in Mooncake: any host that reaches the
//! listeners may READ and WRITE the registered regions (the target still checks every TCP
//! request against its registered regions, so nothing outside them is ever touched). With a
//! shared secret (`EngineConfig::auth`) the engine is authenticated: descriptors and RDMA
//! connects need the secret (proved, never sent) or a grant token, and every TCP data frame
//! needs a grant token covering its op and ranges (`TransferEngine::grant`).

#![warn(missing_docs)]
#![warn(unsafe_op_in_unsafe_fn)]

mod admission;
pub mod auth;
mod batch;
mod batch_meter;
pub mod config;
pub mod descriptor;
pub mod engine;
mod engine_strided;
mod engine_sync;
pub mod error;
pub mod fd_budget;
pub mod fuzzing;
pub mod handshake;
mod handshake_service;
pub mod ids;
mod inflight;
pub mod memory;
pub mod metrics;
pub mod node;
mod path;
mod peer_cache;
pub mod ports;
pub mod segment;
pub mod strided;
pub mod sync;
pub mod transport;
mod transport_kind;
pub mod types;

pub mod gpu;

pub use auth::{Credential, GrantGuard, GrantOps, GrantSpec, Secret, Token};
pub use config::{AuthConfig, CudaIpcMode, EngineConfig, GpuRegistration, RdmaConfig, TcpConfig};
pub use descriptor::{BufferDesc, SegmentDescriptor, TransportInfo};
pub use engine::{EngineStats, TransferEngine};
pub use error::{
    ArgumentError, AuthError, ConfigError, DescriptorError, HandshakeError, IoError, JsonError,
    NoRdma, PeerText, ProtocolError, RdmaError, Refusal, RegistrationError, Result, RetryOutcome,
    SecretFileError, Shared, SyncBound, TransferError, UnsupportedError,
};
pub use memory::{
    DmabufRange, HostMemoryAccess, MemoryAccess, MemoryRegion, MemoryRegistry, RegionKeys,
    RegistrationPath, TransportKeys,
};
pub use ports::{host_port, PortRange, PortRangeError};
pub use segment::SegmentHandle;
pub use strided::{StridedGroup, StridedRange, StridedRequest};
pub use transport::{
    CompletionSink, MappedRange, Slice, StreamPoint, Transport, TransportContext, TransportStats,
};
pub use types::{BatchId, BatchStatus, Location, Op, TransferPath, TransferRequest, TransportKind};
