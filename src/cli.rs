//! Command-line arguments of `kvferry` (docs/design.md §6), parsed with clap.

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvferry_transfer::{PortRange, PortRangeError};
use std::path::PathBuf;

/// Most TP or PP ranks per side the CLI starts (each rank has its own engine and threads).
pub const MAX_RANKS: u32 = 64;

/// A command-line value clap's own parsers do not check; clap prints it with the option.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    /// Not a number.
    #[error("{0:?} is not a number of seconds")]
    NotSeconds(String),
    /// Not finite, not above 0, or over a day.
    #[error("{0:?}: must be more than 0 and at most 86400 seconds")]
    SecondsRange(String),
    /// Not a whole number.
    #[error("{0:?} is not a whole number")]
    NotWhole(String),
    /// A rank count outside `1..=MAX_RANKS`.
    #[error("{0}: must be between 1 and {MAX_RANKS}")]
    Ranks(u32),
    /// Not `HOST:PORT` with a port in 1..=65535.
    #[error("{0:?}: expected HOST:PORT, e.g. 127.0.0.1:17100 or [::1]:17100 (port 1-65535)")]
    HostPort(String),
}

/// Checks a `HOST:PORT` address (an optional `tcp://` prefix, an IPv6 host in brackets, a
/// port in 1..=65535) and returns it as given. Catching `127.0.0.1` without its port here says
/// what is wrong before anything starts, instead of ZeroMQ's "Invalid Syntax" at connect time.
pub fn connect_addr(text: &str) -> Result<String, ArgError> {
    address(text, false)
}

/// [`connect_addr`] for an address to bind: port 0 (any free port) allowed.
pub fn bind_addr(text: &str) -> Result<String, ArgError> {
    address(text, true)
}

fn address(text: &str, port_zero: bool) -> Result<String, ArgError> {
    let bad = || ArgError::HostPort(text.to_string());
    let a = text.strip_prefix("tcp://").unwrap_or(text);
    let (host, port) = a.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty()
            && !host.contains(':')
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '*')
    };
    if (port == 0 && !port_zero) || !host_ok {
        return Err(bad());
    }
    Ok(text.to_string())
}

/// Parses `--engine-ports`: `LO-HI` or one port, in 1..=65535.
pub fn port_range(text: &str) -> Result<PortRange, PortRangeError> {
    text.parse()
}

/// Parses a duration in seconds: finite, above 0, at most a day.
pub fn seconds(text: &str) -> Result<f64, ArgError> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| ArgError::NotSeconds(text.to_string()))?;
    if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
        return Err(ArgError::SecondsRange(text.to_string()));
    }
    Ok(v)
}

fn ranks(text: &str) -> Result<u32, ArgError> {
    let v: u32 = text
        .trim()
        .parse()
        .map_err(|_| ArgError::NotWhole(text.to_string()))?;
    if v == 0 || v > MAX_RANKS {
        return Err(ArgError::Ranks(v));
    }
    Ok(v)
}

/// kvferry: peer-to-peer KV-cache transfer for prefill/decode disaggregation
/// that verifies every load.
#[derive(Debug, Parser)]
#[command(
    name = "kvferry",
    version,
    about,
    propagate_version = true,
    args_override_self = true
)]
pub struct Cli {
    /// Log filter (tracing's env-filter syntax), also read from KVFERRY_LOG.
    #[arg(long, global = true)]
    pub log: Option<String>,
    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The main job: a producer and a consumer on loopback move model-shaped KV (seeded random
    /// bytes in a real model's KV cache shape) for many requests and verify every load.
    /// Fail-open by default (every load completes; the counts show each verdict).
    ///
    /// The report gives the loads' throughput beside a plain memory copy of the same bytes on
    /// this machine, and the consumer's verification time as a share of each load.
    Demo(DemoArgs),
    /// Run the producer (prefill) role: publish requests' KV and serve loads.
    Serve(ServeArgs),
    /// Run the consumer (decode) role against a `kvferry serve` producer.
    Load(LoadArgs),
    /// Transfer throughput sweep (block size × batch × threads).
    Bench(BenchArgs),
    /// Inspect this node: which path `auto` takes for host and GPU memory and why (RDMA
    /// devices, GIDs, MTU; GPUs, dma-buf, IPC; memlock and open-file limits), each problem
    /// with what to do.
    Doctor(DoctorArgs),
    /// Evaluate the checksum definition on KV tensors dumped to files.
    Checksum(ChecksumArgs),
    /// Convert a checksum payload between base64 and JSON.
    Payload {
        /// `decode` (base64 → JSON) or `encode` (JSON → base64).
        #[command(subcommand)]
        action: PayloadAction,
    },
}

/// Which transport the transfer engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// GPU memory of processes on this host over CUDA IPC (device copies); everything else
    /// over RDMA when a usable device exists, TCP otherwise.
    Auto,
    /// Force TCP (GPU memory staged through pinned host buffers; no CUDA IPC).
    Tcp,
    /// Force RDMA (an error when no device exists; no CUDA IPC).
    Rdma,
    /// CUDA IPC for GPU memory, refusing to register GPU memory it cannot export (rather than
    /// moving it over the network transport); other memory as `auto`.
    CudaIpc,
}

/// Where the KV caches live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// Host memory; checksums on the CPU.
    Cpu,
    /// GPU memory (device 0 unless a `--*-gpu` option says otherwise); checksums with the
    /// CUDA kernels.
    Cuda,
}

/// How the RDMA transport registers GPU KV memory (docs/design.md §3 "GPU memory").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuRegistrationArg {
    /// dma-buf, else peer memory, else staging through pinned host memory (with a warning).
    Auto,
    /// dma-buf only (GPUDirect RDMA).
    DmaBuf,
    /// Peer memory only (nvidia-peermem, GPUDirect RDMA).
    PeerMemory,
    /// A pinned host mirror with device copies, without trying GPUDirect.
    Staged,
}

/// The load failure policy under fail-closed (docs/design.md §2.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailurePolicyArg {
    /// The request ends with an error.
    Fail,
    /// The consumer discards the loaded KV and recomputes the prompt.
    Recompute,
}

/// Options shared by the roles: model, ranks, transport, policy.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Model shape: a built-in KV cache geometry (seeded random bytes in it, no weights).
    #[arg(long, default_value = "qwen3-0.6b", value_parser = crate::models::model_parser())]
    pub model: String,
    /// Tokens per block of this side (demo: of both sides, unless `--prefill-block-size` /
    /// `--decode-block-size` say otherwise).
    #[arg(long, default_value_t = 16)]
    pub block_size: u64,
    /// KV cache layout (dimension order, outermost first), e.g. "KV B N H D" (FlashAttention),
    /// "B KV N H D" (FlashInfer), "B KV H N D" (HND). MLA models always use "B N D".
    #[arg(long, default_value = "KV B N H D")]
    pub layout: String,
    /// Transport of the transfer engine.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,
    /// Where the KV caches live.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// How RDMA registers GPU KV memory (with `--device cuda`; TCP always stages it through
    /// pinned host buffers).
    #[arg(long, value_enum, default_value_t = GpuRegistrationArg::Auto)]
    pub gpu_registration: GpuRegistrationArg,
    /// Treat a mismatch or an unverified load as a load failure.
    #[arg(long)]
    pub fail_closed: bool,
    /// What a load failure does under fail-closed.
    #[arg(long, value_enum, default_value_t = FailurePolicyArg::Fail)]
    pub load_failure_policy: FailurePolicyArg,
    /// Address this side's transfer engines listen on and name in their segment names, which
    /// the other side connects to for the KV data: one it can reach (not 0.0.0.0). Default:
    /// demo 127.0.0.1; serve the host of `--bind`; load the local address that routes to
    /// `--producer`.
    #[arg(long)]
    pub data_host: Option<String>,
    /// Ports this side's transfer engines listen on, LO-HI (or one port): each engine binds the
    /// lowest free ports of the range, one for its handshake and, over TCP, one for data (2 per
    /// TP×PP rank), so a firewall can list them. Default: ports the OS picks (ephemeral). A
    /// range with no free port left fails at start, naming it.
    #[arg(long, value_parser = port_range)]
    pub engine_ports: Option<PortRange>,
    /// Seconds a load may take before it fails (request, transfer and reply). The producer
    /// (demo, serve) gives a load's WRITEs half of it and starts none unless the consumer's
    /// `--timeout` leaves that much.
    #[arg(long, default_value_t = 60.0, value_parser = seconds)]
    pub timeout: f64,
    /// File holding a shared secret (16..=4096 bytes): authenticates the transfer engines
    /// (descriptors and RDMA connects need the secret, TCP data frames a per-load grant token)
    /// and, for serve/load, derives each request's load key. Without it the engines are
    /// unauthenticated (any peer that reaches their ports may read and write registered
    /// memory): trusted networks only.
    #[arg(long, env = "KVFERRY_SECRET_FILE")]
    pub secret_file: Option<PathBuf>,
    /// MiB of one layer group of a load the consumer reads itself (same-host GPU KV over CUDA
    /// IPC): each group's copies go as batches of their own, its checksums queued behind them;
    /// a load of at least twice this is read in up to 4 groups, 0 reads every load in one.
    #[arg(long, default_value_t = kvferry_p2p::DEFAULT_READ_GROUP_BYTES >> 20)]
    pub read_group_mib: u64,
    /// How a load the consumer reads itself over CUDA IPC is checksummed: `one-pass` (the
    /// checksum kernel copies each chunk from the producer's blocks and sums what it stored,
    /// where both sides lay each layer out alike) or `after-landing` (the transport copies,
    /// the checksum kernels read the landed bytes after).
    #[arg(long, value_enum, default_value_t = ReadCheckArg::OnePass)]
    pub read_check: ReadCheckArg,
}

/// How a load read over CUDA IPC is checksummed (docs/design.md §4.10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReadCheckArg {
    /// The checksum kernel copies and sums what it stored: one pass over the bytes.
    OnePass,
    /// The transport copies; the checksums read the landed bytes after: two passes.
    AfterLanding,
}

/// `kvferry demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// The options demo, serve and load share (model, layout, transport, device, policy, timeout).
    #[command(flatten)]
    pub common: CommonArgs,
    /// Number of requests (1 to 100000).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub requests: u32,
    /// Shortest prompt, in tokens.
    #[arg(long, default_value_t = 100)]
    pub min_tokens: u64,
    /// Longest prompt, in tokens.
    #[arg(long, default_value_t = 4000)]
    pub max_tokens: u64,
    /// Seed of the prompt lengths, the KV bytes and the corruption.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Flip one random bit in N landed loads, after the transfer and before verification.
    #[arg(long, default_value_t = 0)]
    pub corrupt: u32,
    /// Loads in flight at once (1..=64; default 4, 16 with `--device cuda`). The consumer loads
    /// each stage's requests keeping this many in flight (the next starts as one ends), as a
    /// decode instance loads the requests it schedules; 1 gives each load's latency alone.
    /// Over CUDA IPC a load's host work (request, grant, reply, the wait for the checksum
    /// kernels) takes about ten times its device copy (about 1 ms against 0.1 ms for 230 MB
    /// on an H200), so about 16 loads keep the copies going; over TCP the copies bound it.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub in_flight: Option<u32>,
    /// Most bytes of KV each side's block pool holds (e.g. 16G; K, M, G suffixes). The
    /// producer prefills and publishes as many requests as both pools hold (all of them when
    /// they fit, at most 1024) before that stage's loads start; a request that alone needs
    /// more is a usage error. Default: 0.4 of the GPU's free memory and at most 0.25 of this
    /// machine's memory with `--device cuda` (the KV is generated in a host copy), 0.0625 of
    /// this machine's memory without.
    #[arg(long, value_parser = size)]
    pub pool_memory: Option<u64>,
    /// TP ranks of the producer (prefill).
    #[arg(long, default_value_t = 1, value_parser = ranks)]
    pub prefill_tp: u32,
    /// TP ranks of the consumer (decode).
    #[arg(long, default_value_t = 1, value_parser = ranks)]
    pub decode_tp: u32,
    /// PP stages of the producer.
    #[arg(long, default_value_t = 1, value_parser = ranks)]
    pub prefill_pp: u32,
    /// PP stages of the consumer.
    #[arg(long, default_value_t = 1, value_parser = ranks)]
    pub decode_pp: u32,
    /// GPU (CUDA ordinal) of the producer's KV with `--device cuda` (0 on a one-GPU machine).
    #[arg(long, default_value_t = 0)]
    pub prefill_gpu: u32,
    /// GPU (CUDA ordinal) of the consumer's KV with `--device cuda` (1 to move KV between
    /// two GPUs).
    #[arg(long, default_value_t = 0)]
    pub decode_gpu: u32,
    /// Tokens per block of the producer (default `--block-size`). When it differs from the
    /// consumer's, the consumer's blocks are filled token by token and verified by chunk sums;
    /// one of the two must then be a multiple of the other.
    #[arg(long)]
    pub prefill_block_size: Option<u64>,
    /// Tokens per block of the consumer (default `--block-size`).
    #[arg(long)]
    pub decode_block_size: Option<u64>,
    /// Print one JSON object instead of the readable summary.
    #[arg(long)]
    pub json: bool,
}

/// `kvferry serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// The options demo, serve and load share (model, layout, transport, device, policy, timeout).
    #[command(flatten)]
    pub common: CommonArgs,
    /// Serve the process's metrics (Prometheus/OpenMetrics text) over HTTP at
    /// `http://HOST:PORT/metrics` (port 0 picks one; the info line names it). Bounded: a few
    /// connections at once, each answered or closed within seconds.
    #[arg(long)]
    pub metrics_addr: Option<String>,
    /// TP ranks of this producer (prefill) side (the other side's TP size may differ).
    #[arg(long, default_value_t = 1, value_parser = ranks)]
    pub tp: u32,
    /// PP stages of this producer (prefill) side (the other side's PP size may differ).
    #[arg(long, default_value_t = 1, value_parser = ranks)]
    pub pp: u32,
    /// Address the control channel (ZeroMQ ROUTER) binds, HOST:PORT. Bound before any KV is
    /// generated: a busy port fails at once.
    #[arg(long, default_value = "127.0.0.1:17100", value_parser = bind_addr)]
    pub bind: String,
    /// Seconds a published request's blocks are held for a consumer that has not come; then
    /// they are released (counted as expired).
    #[arg(long, default_value_t = 120.0, value_parser = seconds)]
    pub lease: f64,
    /// Number of requests published (the consumer must use the same; 1 to 100000).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub requests: u32,
    /// Shortest prompt, in tokens.
    #[arg(long, default_value_t = 100)]
    pub min_tokens: u64,
    /// Longest prompt, in tokens.
    #[arg(long, default_value_t = 4000)]
    pub max_tokens: u64,
    /// Seed of the prompt lengths and KV bytes (the consumer must use the same).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Exit after this many requests were released: served, failed or expired unloaded
    /// (0: serve until interrupted). At most `--requests`: each is loaded at most once.
    #[arg(long, default_value_t = 0)]
    pub exit_after: u32,
}

/// `kvferry load`.
#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// The options demo, serve and load share (model, layout, transport, device, policy, timeout).
    #[command(flatten)]
    pub common: CommonArgs,
    /// Serve the process's metrics (Prometheus/OpenMetrics text) over HTTP at
    /// `http://HOST:PORT/metrics` (port 0 picks one; the info line names it). Bounded: a few
    /// connections at once, each answered or closed within seconds.
    #[arg(long)]
    pub metrics_addr: Option<String>,
    /// TP ranks of this consumer (decode) side (the other side's TP size may differ).
    #[arg(long, default_value_t = 1, value_parser = ranks)]
    pub tp: u32,
    /// PP stages of this consumer (decode) side (the other side's PP size may differ).
    #[arg(long, default_value_t = 1, value_parser = ranks)]
    pub pp: u32,
    /// The producer's control channel, HOST:PORT (`kvferry serve --bind`).
    #[arg(long, value_parser = connect_addr)]
    pub producer: String,
    /// Tokens per block of the producer (its `--block-size`; default this side's
    /// `--block-size`). The producer's block tables are replayed with it; this side's blocks
    /// are filled token by token when it differs.
    #[arg(long)]
    pub producer_block_size: Option<u64>,
    /// Number of requests to load (1 to 100000).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub requests: u32,
    /// Shortest prompt, in tokens (as the producer).
    #[arg(long, default_value_t = 100)]
    pub min_tokens: u64,
    /// Longest prompt, in tokens (as the producer).
    #[arg(long, default_value_t = 4000)]
    pub max_tokens: u64,
    /// Seed (as the producer).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Flip one random bit in N landed loads, after the transfer and before verification (a
    /// test of verification across processes: each must end as a mismatch).
    #[arg(long, default_value_t = 0)]
    pub corrupt: u32,
    /// After the loads, keep answering `--metrics-addr` this many seconds before exiting, so a
    /// final scrape sees every load (the result is printed first).
    #[arg(long, value_parser = seconds)]
    pub metrics_linger: Option<f64>,
    /// Print one JSON object instead of the readable summary.
    #[arg(long)]
    pub json: bool,
}

/// Where a bench batch's requests land on the target (`kvferry bench --pattern`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchPattern {
    /// Request i lands right after request i-1 (as Mooncake's tebench).
    Contiguous,
    /// Requests land in reverse order: no two consecutive ones continue each other.
    Scattered,
}

/// Which side of a bench this process runs (`kvferry bench --mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchMode {
    /// Target and initiator engines in this process, over loopback (the default).
    Loopback,
    /// Serve one registered buffer (`--buffer-size`) on `--listen` until killed.
    Target,
    /// Run the sweep against the target at `--target` (this host or another).
    Initiator,
}

/// A bench op, seen from the initiator (`kvferry bench --op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchOp {
    /// Local → remote.
    Write,
    /// Remote → local.
    Read,
}

/// `kvferry bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// `loopback` (both engines in this process), `target` (serve a buffer until killed) or
    /// `initiator` (sweep against `--target`, a target process on this host or another).
    #[arg(long, value_enum, default_value_t = BenchMode::Loopback)]
    pub mode: BenchMode,
    /// Target: `HOST:PORT` its engine listens on and names as its segment (port 0: one the
    /// OS picks). Default 127.0.0.1:0; across hosts, an address the initiator reaches.
    #[arg(long, value_parser = bind_addr)]
    pub listen: Option<String>,
    /// Initiator: the target's segment, `HOST:PORT` as the target printed it.
    #[arg(long, value_parser = connect_addr)]
    pub target: Option<String>,
    /// Initiator: the address its own engine listens on (default: this host's address
    /// towards `--target`).
    #[arg(long)]
    pub data_host: Option<String>,
    /// Target: bytes of its registered buffer (K/M/G suffixes); at least block × batch ×
    /// threads of the largest point.
    #[arg(long, default_value = "1G")]
    pub buffer_size: String,
    /// Ops to sweep, comma separated: `write` (local → remote), `read` (remote → local).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "write")]
    pub op: Vec<BenchOp>,
    /// Where the buffers live (both sides take it): host memory, or GPU `--gpu`, registered
    /// as `serve` registers KV, so the path is the one `auto` picks (CUDA IPC on one host,
    /// else dma-buf, peer memory or staging for RDMA, staging for TCP).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// The GPU of `--device cuda`.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// How RDMA registers GPU memory (with `--device cuda`).
    #[arg(long, value_enum, default_value_t = GpuRegistrationArg::Auto)]
    pub gpu_registration: GpuRegistrationArg,
    /// RDMA devices (NICs) to use, comma separated (e.g. `mlx5_0,mlx5_1`); default: every
    /// usable one. TCP uses the interface of `--listen`/`--data-host`.
    #[arg(long, value_delimiter = ',')]
    pub nic: Vec<String>,
    /// RDMA GID index (default: picked, IPv4-mapped RoCEv2 first).
    #[arg(long)]
    pub gid_index: Option<u32>,
    /// Runs of each point: the table gives the median throughput and the spread
    /// ((max - min) / median), latencies over every run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeats: u32,
    /// Transport of the transfer engine.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,
    /// Request sizes in bytes (comma separated; K/M suffixes).
    #[arg(long, default_value = "64K,1M")]
    pub block_sizes: String,
    /// Requests per batch (comma separated).
    #[arg(long, default_value = "128")]
    pub batch: String,
    /// Submitting threads (comma separated).
    #[arg(long, default_value = "1")]
    pub threads: String,
    /// Seconds per point of the sweep: each thread starts no new batch after this, once it
    /// has done `--min-batches`.
    #[arg(long, default_value_t = 2.0, value_parser = seconds)]
    pub seconds: f64,
    /// Batches each thread completes per point at least, however long they take (a point
    /// resting on one batch says little when one batch outlasts `--seconds`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub min_batches: u64,
    /// Batches each thread completes per point at most (0: no bound); a point ends at this
    /// count even before `--seconds`.
    #[arg(long, default_value_t = 0)]
    pub max_batches: u64,
    /// Where each batch's requests land: `contiguous` (request i after request i-1 on both
    /// sides, so the transport may merge them) or `scattered` (in reverse order on the
    /// target, so no two consecutive requests continue each other).
    #[arg(long, value_enum, default_value_t = BenchPattern::Contiguous)]
    pub pattern: BenchPattern,
    /// RDMA: RC QPs per endpoint (`rdma.qps_per_endpoint`; default the engine's, 2).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub qps_per_endpoint: Option<u64>,
    /// RDMA: largest work request that consecutive slices are merged into, bytes
    /// (`rdma.merge_bytes`; default the engine's, 1 MiB; 0 posts one per slice).
    #[arg(long)]
    pub merge_bytes: Option<u64>,
    /// RDMA: work requests per `ibv_post_send` call at most (`rdma.post_chain`; default the
    /// engine's, 32; 1 posts them one by one).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub post_chain: Option<u64>,
    /// Authenticate both engines with this shared secret: the target grants READ and WRITE on
    /// its buffer to a token both sides derive from the secret and the target's segment name,
    /// and every data frame is checked (measures the check). Target and initiator take the
    /// same file.
    #[arg(long, env = "KVFERRY_SECRET_FILE")]
    pub secret_file: Option<PathBuf>,
    /// Also checksum every landed batch (CPU backend) and report the overhead.
    #[arg(long)]
    pub checksum: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Write the results as CSV to this file.
    #[arg(long)]
    pub csv_out: Option<PathBuf>,
    /// Plot throughput against request size (one line per op, pattern, batch and thread
    /// count) as SVG to this file. Default: beside `--json-out` or `--csv-out` (same name,
    /// `.svg`), else no plot.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `kvferry doctor`.
#[derive(Debug, Clone, Args)]
pub struct DoctorArgs {
    /// The transport to inspect, as `serve`/`load` take it.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,
    /// How RDMA registers GPU memory, as `serve`/`load` take it.
    #[arg(long, value_enum, default_value_t = GpuRegistrationArg::Auto)]
    pub gpu_registration: GpuRegistrationArg,
    /// KV bytes one process registers (K/M/G suffixes; a list is summed), for the
    /// locked-memory check. Default: `--model` × `--block-size` × `--num-blocks`.
    #[arg(long)]
    pub kv_bytes: Option<String>,
    /// Model shape whose KV the pools hold (without `--kv-bytes`).
    #[arg(long, default_value = "qwen3-0.6b", value_parser = crate::models::model_parser())]
    pub model: String,
    /// Tokens per block (without `--kv-bytes`).
    #[arg(long, default_value_t = 16)]
    pub block_size: u64,
    /// Blocks in the pools (without `--kv-bytes`).
    #[arg(long, default_value_t = 4096)]
    pub num_blocks: u64,
    /// Ranks (transfer engines) one process runs, for the open-file check.
    #[arg(long, default_value_t = 1, value_parser = ranks)]
    pub ranks: u32,
    /// The shared secret file to check (permissions, size).
    #[arg(long, env = "KVFERRY_SECRET_FILE")]
    pub secret_file: Option<PathBuf>,
    /// Print one JSON object instead of the readable report.
    #[arg(long)]
    pub json: bool,
}

/// `kvferry checksum`.
#[derive(Debug, Clone, Args)]
pub struct ChecksumArgs {
    /// The spec file (JSON) describing the KV tensors and blocks.
    #[arg(long)]
    pub spec: PathBuf,
}

/// `kvferry payload …`.
#[derive(Debug, Clone, Subcommand)]
pub enum PayloadAction {
    /// Base64 payload text on stdin → JSON on stdout.
    Decode,
    /// JSON on stdin → base64 payload text on stdout.
    Encode,
}

/// Parses "64K,1M,4096" into byte counts.
///
/// Errors: an empty list, a zero, or a part that is not a number with an optional K/M/G suffix.
pub fn parse_sizes(text: &str) -> Result<Vec<u64>, SizeError> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (num, mul) = match part.chars().last().map(|c| c.to_ascii_uppercase()) {
            Some('K') => (&part[..part.len() - 1], 1u64 << 10),
            Some('M') => (&part[..part.len() - 1], 1 << 20),
            Some('G') => (&part[..part.len() - 1], 1 << 30),
            _ => (part, 1),
        };
        let n: u64 = num
            .parse()
            .map_err(|_| SizeError::NotASize(part.to_string()))?;
        let v = n
            .checked_mul(mul)
            .filter(|&v| v > 0)
            .ok_or_else(|| SizeError::OutOfRange(part.to_string()))?;
        out.push(v);
    }
    if out.is_empty() {
        return Err(SizeError::Empty(text.to_string()));
    }
    Ok(out)
}

/// One size of [`parse_sizes`]' form (a number with an optional K, M or G), at least 1.
/// Errors: not a size, or more than one.
pub fn size(text: &str) -> Result<u64, SizeError> {
    match parse_sizes(text)?.as_slice() {
        [one] => Ok(*one),
        _ => Err(SizeError::NotASize(text.to_string())),
    }
}

/// Why a list of sizes does not parse ([`parse_sizes`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// A part that is not a number with an optional K, M or G.
    #[error("{0:?}: not a size (a number with an optional K, M or G)")]
    NotASize(String),
    /// A part of 0 or of 2^64 bytes or more.
    #[error("{0:?}: must be at least 1 and below 2^64")]
    OutOfRange(String),
    /// No part at all.
    #[error("{0:?}: an empty list")]
    Empty(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::MODELS;

    /// Every subcommand that takes `--model` lists every model of the table in its help
    /// (short and long), and takes each of them.
    #[test]
    fn every_model_option_lists_the_model_table() {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        cli.build();
        let mut seen = 0;
        for sub in cli.get_subcommands_mut() {
            let Some(arg) = sub.get_arguments().find(|a| a.get_id() == "model") else {
                continue;
            };
            let listed: Vec<String> = arg
                .get_possible_values()
                .iter()
                .map(|v| v.get_name().to_string())
                .collect();
            let names: Vec<String> = MODELS.iter().map(|m| m.name.to_string()).collect();
            assert_eq!(listed, names, "{}", sub.get_name());
            let (short, long) = (
                sub.render_help().to_string(),
                sub.render_long_help().to_string(),
            );
            for m in MODELS {
                assert!(
                    short.contains(m.name),
                    "{} -h lacks {}",
                    sub.get_name(),
                    m.name
                );
                assert!(
                    long.contains(&m.details()),
                    "{} --help lacks {m}",
                    sub.get_name()
                );
            }
            seen += 1;
        }
        // demo, serve, load, doctor.
        assert!(seen >= 4, "{seen}");
        for m in MODELS {
            Cli::try_parse_from(["kvferry", "demo", "--model", m.name]).unwrap();
        }
        let e = Cli::try_parse_from(["kvferry", "load", "--model", "gpt-9"]).unwrap_err();
        assert!(e.to_string().contains("tiny-hybrid"), "{e}");
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(
            parse_sizes("64K, 1M,4096").unwrap(),
            vec![65536, 1 << 20, 4096]
        );
        assert!(parse_sizes("").is_err());
        assert!(parse_sizes("0").is_err());
        assert!(parse_sizes("12Q").is_err());
        assert!(parse_sizes("99999999999999G").is_err());
    }

    #[test]
    fn addresses_need_a_host_and_a_port() {
        for ok in [
            "127.0.0.1:17100",
            "tcp://10.0.0.1:1",
            "[::1]:17100",
            "prefill-0.example:65535",
            "*:17100",
        ] {
            assert_eq!(connect_addr(ok).as_deref(), Ok(ok), "{ok}");
        }
        for bad in [
            "127.0.0.1",
            "127.0.0.1:",
            "127.0.0.1:0",
            "127.0.0.1:65536",
            ":17100",
            "::1:17100",
            "[nope]:17100",
            "a b:1",
            "",
        ] {
            assert_eq!(
                connect_addr(bad),
                Err(ArgError::HostPort(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn load_without_a_port_is_refused_when_parsing_naming_the_form() {
        let e = Cli::try_parse_from(["kvferry", "load", "--producer", "127.0.0.1"]).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("--producer") && text.contains("HOST:PORT"),
            "{text}"
        );
        let e = Cli::try_parse_from(["kvferry", "serve", "--bind", "0.0.0.0"]).unwrap_err();
        assert!(e.to_string().contains("--bind"), "{e}");
        assert_eq!(bind_addr("127.0.0.1:0").as_deref(), Ok("127.0.0.1:0"));
        assert!(Cli::try_parse_from(["kvferry", "serve", "--lease", "0"]).is_err());
        let Command::Serve(s) = Cli::try_parse_from(["kvferry", "serve", "--lease", "7.5"])
            .unwrap()
            .command
        else {
            panic!("serve")
        };
        assert_eq!(s.lease, 7.5);
    }
}
