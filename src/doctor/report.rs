//! What `kvferry doctor` found (`super::inspect` fills it in; `--json` prints it as is).

use kvferry_cuda::inspect::GpuInventory;
use kvferry_transfer::node::RdmaFacts;
use serde::Serialize;

/// The whole report (`kvferry doctor --json` prints it).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// kvferry's version.
    pub version: &'static str,
    /// Whether this build has the RDMA transport (cargo feature `rdma`).
    pub rdma_built: bool,
    /// The path host-memory KV takes.
    pub host_path: PathFacts,
    /// The path GPU-memory KV takes (`cuda:0`); `None` with no usable GPU.
    pub gpu_path: Option<PathFacts>,
    /// RDMA devices, ports, GIDs and the transport's choice on each.
    pub rdma: RdmaFacts,
    /// RDMA devices the kernel has (`/sys/class/infiniband`), whether or not libibverbs can
    /// open them.
    pub kernel_rdma_devices: Vec<String>,
    /// The GPUs, their capabilities and peer access.
    pub gpu: GpuInventory,
    /// Whether the nvidia-peermem kernel module (or the older nv_peer_mem) is loaded: RDMA
    /// registration of GPU memory with plain `ibv_reg_mr`.
    pub peer_memory_module: bool,
    /// Same-host GPU sharing through CUDA IPC as the trial GPU registration found it
    /// (exported, or why not); `None` without a GPU trial. The GPUs' capability for it is
    /// `gpu.devices[].ipc`.
    pub cuda_ipc_transport: Option<String>,
    /// Locked-memory and open-file limits against what the configured pools need.
    pub limits: Limits,
    /// The secret file's permissions; `None` without `--secret-file`.
    pub secret_file: Option<SecretFileFacts>,
    /// Each problem found, with what to do.
    pub problems: Vec<Problem>,
}

/// How KV in one kind of memory moves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PathFacts {
    /// The memory: `cpu` or `cuda:N`.
    pub memory: String,
    /// The transport the engine chose (`tcp`, `rdma`); `None` when no engine started.
    pub transport: Option<String>,
    /// Why (the engine's own reason, or why no engine started).
    pub why: String,
    /// How a registered region is reached: `host`, `dma-buf`, `peer-memory`, `staged`; `None`
    /// when registration failed (`error` says why).
    pub registration: Option<String>,
    /// Why the trial registration failed.
    pub error: Option<String>,
    /// The kind of that failure, from the engine's typed error: what [`super::diagnose`]
    /// bases the fix on. `None` when nothing failed.
    pub cause: Option<PathCause>,
}

/// What kind of failure kept a trial engine from starting or a trial buffer from registering
/// (read from the engine's typed error), so that the fix names what to check or change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PathCause {
    /// A listener could not be bound on loopback (`TransferError::Bind`).
    Bind,
    /// `--transport rdma` was asked but no RDMA device is usable (a `ConfigError` about RDMA).
    NoRdma,
    /// The engine configuration was refused (another `ConfigError`, an invalid argument).
    Config,
    /// The OS has no randomness for the engine's secrets (`ConfigError::NoRandomness`).
    NoRandomness,
    /// `/proc/self/maps` could not be read to check the buffer (`RegistrationError::MapsUnreadable`).
    ProcMaps,
    /// A socket or file operation failed (`TransferError::Io`): descriptors or sockets.
    Io,
    /// The transport cannot do it (`TransferError::Unsupported`), e.g. GPU memory in a build
    /// without the GPU backend.
    Unsupported,
    /// The GPU layer failed (`TransferError::Gpu`).
    Gpu,
    /// Anything else (an RDMA failure, or a fault of the trial itself).
    Other,
}

/// A resource limit of this process (`getrlimit`); `None` = unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limit {
    /// Soft limit (what applies), bytes or descriptors; `None` = unlimited.
    pub soft: Option<u64>,
    /// Hard limit (the most the soft limit may be raised to without privilege).
    pub hard: Option<u64>,
    /// What the configured pools need at least.
    pub needed: u64,
}

/// The limits `doctor` checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// `RLIMIT_MEMLOCK`, bytes: RDMA registration pins every registered byte.
    pub memlock: Limit,
    /// `RLIMIT_NOFILE`: each engine's listeners and served connections.
    pub nofile: Limit,
    /// KV bytes one process registers (`--kv-bytes`, else `--model` × `--block-size` ×
    /// `--num-blocks`).
    pub kv_bytes: u64,
}

/// The secret file's ownership and mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SecretFileFacts {
    /// The path given.
    pub path: String,
    /// Permission bits, octal text (`0600`); `None` when the file cannot be read.
    pub mode: Option<String>,
    /// Whether this user owns it.
    pub owned_by_me: bool,
    /// Why it cannot be used (unreadable, too short or long); `None` when it can.
    pub error: Option<String>,
}

/// How bad a problem is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Worth knowing; nothing fails.
    Info,
    /// Works, slower or less safe than it could.
    Warning,
    /// Something configured will fail.
    Error,
}

/// One problem and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// How bad.
    pub severity: Severity,
    /// A short stable key for scripts (`rdma-not-built`, `memlock-low`, ...).
    pub key: &'static str,
    /// What is wrong, with the facts.
    pub what: String,
    /// What to do about it.
    pub fix: String,
}

/// A limit for people: its value, or `unlimited`.
pub(super) fn human(v: Option<u64>) -> String {
    match v {
        None => "unlimited".into(),
        Some(n) => n.to_string(),
    }
}
