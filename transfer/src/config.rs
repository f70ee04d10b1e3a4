//! Engine configuration (docs/design.md §3; timeouts after Mooncake, docs/design.md §9).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::types::TransportKind;

/// Configuration of one `TransferEngine`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// Host (IP or name) the handshake and data listeners bind, and the host part of this
    /// engine's segment name. Must be an address peers can reach (not `0.0.0.0`).
    pub host: String,
    /// Handshake listener port; 0 = let the OS pick (or `listen_ports`). The segment name is
    /// `host:port`.
    pub port: u16,
    /// Ports the handshake listener and the TCP data listener take when their own port
    /// (`port`, `tcp.data_port`) is 0: the lowest free ports of this range, so that a firewall
    /// can list them. `None` (the default): ports the OS picks (ephemeral). A range with no free
    /// port left is a `Bind` error naming it.
    pub listen_ports: Option<crate::ports::PortRange>,
    /// Transport choice (see `TransportKind`).
    pub transport: TransportKind,
    /// RDMA settings, read only by the RDMA transport.
    pub rdma: RdmaConfig,
    /// TCP settings, read only by the TCP transport.
    pub tcp: TcpConfig,
    /// Deadline of one handshake exchange (connect + request + reply). Default 5 s (Mooncake).
    pub handshake_timeout: Duration,
    /// Base deadline of the sync helpers (`transfer_sync_*`); the helpers wait
    /// `transfer_timeout + transfer_timeout_per_byte * bytes`. Default 30 s (Mooncake).
    pub transfer_timeout: Duration,
    /// Per-byte part of the sync helpers' deadline. Default 1 ns per byte (Mooncake).
    pub transfer_timeout_per_byte: Duration,
    /// Requests are cut into slices of at most this many bytes (never crossing a memory
    /// region); a tail of at most `slice_size / 4` is merged into the previous slice, as in
    /// Mooncake. Default 64 KiB. Must be > 0.
    pub slice_size: u64,
    /// Authorization: open (no secret, the default) or authenticated (a shared secret); see
    /// `crate::auth`.
    pub auth: AuthConfig,
    /// A peer's cached descriptor not used (opened or submitted to) for this long is dropped,
    /// and so are the RDMA endpoints (QPs) to a peer with no work for this long (TCP data
    /// connections have their own `tcp.idle_timeout`). Default 60 s. Peers that fail are
    /// dropped at once ("no leaks under churn").
    pub peer_idle_timeout: Duration,
    /// Device memory between processes of this host through CUDA IPC (docs/design.md §3.10).
    /// Default `Auto`.
    pub cuda_ipc: CudaIpcMode,
    /// How long `unregister_memory` waits for batches in flight on the region to end before it
    /// fails with `InUse` (the region then stays registered). Default 5 s.
    pub unregister_timeout: Duration,
}

/// Whether `cuda:N` regions are offered to peers on this host through CUDA IPC
/// (`EngineConfig::cuda_ipc`). Slices between device memory of two processes of one host
/// then move as device copies; all others over the network transport.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CudaIpcMode {
    /// Export every `cuda:N` region that can be exported where the CUDA driver is present; a
    /// region that cannot be is registered for the network transport only, with a warning
    /// naming why (its keys carry `cuda_ipc_refused`).
    #[default]
    Auto,
    /// No CUDA IPC: everything over the network transport.
    Off,
    /// As `Auto`, but a `cuda:N` region that cannot be exported is refused at registration
    /// with the reason.
    Required,
}

/// Authorization settings (`crate::auth`). With neither `secret` nor `secret_file` the engine
/// is open (Mooncake's model: any peer that reaches its ports may read and write registered
/// memory; trusted networks only). With either, it is authenticated: peers must prove the
/// secret or present a grant token, and TCP data frames need a grant token.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AuthConfig {
    /// A file holding the shared secret (16..=4096 bytes; a trailing newline is ignored).
    /// The CLI fills it from `--secret-file` or the `KVFERRY_SECRET_FILE` environment variable.
    pub secret_file: Option<std::path::PathBuf>,
    /// The shared secret itself (takes precedence over `secret_file`; never serialized).
    #[serde(skip)]
    pub secret: Option<crate::auth::Secret>,
}

impl AuthConfig {
    /// The configured secret: `secret`, else the contents of `secret_file`, else `None` (open
    /// mode). Errors (`Config`): an unreadable, too short or too long secret file.
    pub fn resolve(&self) -> crate::error::Result<Option<crate::auth::Secret>> {
        match (&self.secret, &self.secret_file) {
            (Some(s), _) => Ok(Some(s.clone())),
            (None, Some(p)) => crate::auth::Secret::from_file(p).map(Some),
            (None, None) => Ok(None),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            host: "127.0.0.1".into(),
            port: 0,
            listen_ports: None,
            transport: TransportKind::Auto,
            rdma: RdmaConfig::default(),
            tcp: TcpConfig::default(),
            handshake_timeout: Duration::from_secs(5),
            transfer_timeout: Duration::from_secs(30),
            transfer_timeout_per_byte: Duration::from_nanos(1),
            slice_size: 64 * 1024,
            auth: AuthConfig::default(),
            peer_idle_timeout: Duration::from_secs(60),
            cuda_ipc: CudaIpcMode::Auto,
            unregister_timeout: Duration::from_secs(5),
        }
    }
}

impl EngineConfig {
    /// The sync helpers' deadline for `bytes` bytes: base + per-byte × bytes (saturating).
    pub fn sync_timeout(&self, bytes: u64) -> Duration {
        let per = self
            .transfer_timeout_per_byte
            .as_nanos()
            .saturating_mul(bytes as u128)
            .min(u64::MAX as u128) as u64;
        self.transfer_timeout
            .saturating_add(Duration::from_nanos(per))
    }
}

/// RDMA transport settings (docs/design.md §3; defaults after Mooncake, docs/design.md §9).
/// Owned by the RDMA transport; fields may be added there.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct RdmaConfig {
    /// RDMA device names to use (e.g. `["mlx5_0"]`, `["rxe0"]`); empty = all usable devices.
    pub devices: Vec<String>,
    /// GID index to use; `None` = pick automatically (IPv4-mapped RoCEv2 first).
    pub gid_index: Option<u32>,
    /// RC QPs per endpoint (peer × device). Default 2.
    pub qps_per_endpoint: usize,
    /// Work requests outstanding per QP at most. Default 256.
    pub max_wr: usize,
    /// Consecutive slices of one `post` that continue each other on both sides (same local
    /// region, same remote buffer, same operation) go out as one work request of up to this
    /// many bytes; each slice is still completed, failed and retried on its own. Default
    /// 1 MiB; a value ≤ `EngineConfig::slice_size` disables merging; at most 1 GiB.
    pub merge_bytes: u64,
    /// Work requests posted per `ibv_post_send` call at most, as one chained list (one
    /// doorbell per list). Default 32; 1 posts them one by one.
    pub post_chain: usize,
    /// Times a failed slice is retried on a fresh endpoint. Default 3.
    pub max_retries: u32,
    /// Caps the active MTU this engine advertises, in bytes (256, 512, 1024, 2048 or 4096);
    /// `None` = the port's active MTU. The path MTU of a connection is the smaller of both
    /// sides' values (tests force a low one to exercise mixed-MTU peers).
    pub mtu: Option<u32>,
    /// QP local ACK timeout exponent: 4.096 µs × 2^qp_timeout per try (IB spec). Default 14
    /// (about 67 ms, as Mooncake); with `retry_count` it bounds how fast a dead peer errors.
    pub qp_timeout: u8,
    /// QP transport retries (0..=7) before a work request fails with a retry-exceeded
    /// status. Default 6: soft-RoCE (rxe) treats 7 as "retry forever", so a dead peer
    /// would never fail there.
    pub retry_count: u8,
    /// Safety net: a work request with no completion after this long fails its endpoint
    /// (its QPs are moved to the error state, which flushes them). Default 20 s.
    pub completion_timeout: Duration,
    /// How `cuda:N` regions are registered with the NIC (docs/design.md §3 "GPU memory").
    /// Default `Auto`: dma-buf, else peer memory, else staging through pinned host memory
    /// with a warning.
    pub gpu_registration: GpuRegistration,
}

/// The registration path the RDMA transport tries for GPU memory (`RdmaConfig::gpu_registration`).
/// A forced path that fails is a registration error, never a silent fallback.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuRegistration {
    /// dma-buf (`ibv_reg_dmabuf_mr`), else peer memory (`ibv_reg_mr` through nvidia-peermem),
    /// else a pinned host mirror with device copies (a warning says so and why).
    #[default]
    Auto,
    /// dma-buf only.
    DmaBuf,
    /// Peer memory only.
    PeerMemory,
    /// The pinned host mirror, without trying GPUDirect (costs host memory equal to the region
    /// and a device copy per transfer).
    Staged,
}

impl GpuRegistration {
    /// The configuration's spelling: `"auto"`, `"dma-buf"`, `"peer-memory"`, `"staged"`.
    pub fn as_str(self) -> &'static str {
        match self {
            GpuRegistration::Auto => "auto",
            GpuRegistration::DmaBuf => "dma-buf",
            GpuRegistration::PeerMemory => "peer-memory",
            GpuRegistration::Staged => "staged",
        }
    }
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            devices: Vec::new(),
            gid_index: None,
            qps_per_endpoint: 2,
            max_wr: 256,
            merge_bytes: 1 << 20,
            post_chain: 32,
            max_retries: 3,
            mtu: None,
            qp_timeout: 14,
            retry_count: 6,
            completion_timeout: Duration::from_secs(20),
            gpu_registration: GpuRegistration::Auto,
        }
    }
}

/// TCP transport settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct TcpConfig {
    /// Data connections opened to one peer (slices are spread over them). Default 4.
    pub connections_per_peer: usize,
    /// Slices in flight per data connection (pipelined, acknowledged in order). Default 32.
    pub inflight_per_connection: usize,
    /// Deadline of one socket operation (connect, one read, one write) on data connections.
    /// A dead peer yields an error within about this time. Default 10 s.
    pub io_timeout: Duration,
    /// A data connection that carries no request for this long is closed (both sides).
    /// Default 60 s.
    pub idle_timeout: Duration,
    /// Consecutive slices of one request are sent as one data frame of up to this many bytes
    /// (each slice is still reported). Default 1 MiB; a value ≤ `slice_size` disables merging.
    pub coalesce_bytes: u64,
    /// Largest payload one data frame may carry; larger frames are refused. Default 64 MiB.
    pub max_frame_payload: u64,
    /// Accepted connections served at once per listener (handshake or data); more are closed
    /// at once. Default 256.
    pub max_server_connections: usize,
    /// Accepted connections served at once per source IP per listener (handshake or data);
    /// more from that source are closed at once, so one host's idle connections cannot lock
    /// out the others. Default 64 (a host of 16 producer ranks with 4 data connections each).
    pub max_connections_per_source: usize,
    /// Pre-authentication deadline: an accepted connection (handshake or data) whose first
    /// valid frame has not fully arrived within this long is closed. Default 2 s.
    pub first_frame_timeout: Duration,
    /// Port of the TCP data listener; 0 = let the OS pick (the default) or, with
    /// `EngineConfig::listen_ports`, the lowest free port of that range. A fixed port suits
    /// firewalls; the port is advertised in the descriptor either way.
    pub data_port: u16,
    /// Socket send/receive buffer size in bytes (SO_SNDBUF/SO_RCVBUF); 0 = OS default.
    /// Default 4 MiB.
    pub socket_buffer: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connections_per_peer: 4,
            inflight_per_connection: 32,
            io_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            coalesce_bytes: 1 << 20,
            max_frame_payload: 64 << 20,
            max_server_connections: 256,
            max_connections_per_source: 64,
            first_frame_timeout: Duration::from_secs(2),
            data_port: 0,
            socket_buffer: 4 << 20,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_timeout_is_base_plus_per_byte_and_saturates() {
        let c = EngineConfig::default();
        assert_eq!(c.sync_timeout(0), Duration::from_secs(30));
        assert_eq!(c.sync_timeout(2_000_000_000), Duration::from_secs(32));
        let _ = c.sync_timeout(u64::MAX); // no overflow panic
    }
}
