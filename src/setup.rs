//! Turning command-line options into engine configs and p2p workers (shared by
//! `demo`, `serve` and `load`).

use std::time::Duration;

use kvferry_kernels::{try_backend_for, LayerInput};
use kvferry_p2p::{Worker, WorkerGroup};
use kvferry_transfer::{
    AuthConfig, CudaIpcMode, EngineConfig, GpuRegistration, Location, RdmaConfig, Secret,
    TransportKind,
};

use crate::cli::{CommonArgs, DeviceArg, GpuRegistrationArg, TransportArg};
use crate::error::CliError;
use crate::models::ModelShape;
use crate::models::STATE_GROUP;
use crate::world::{RankKv, SideConfig};
use kvferry_checksum::group::SkipReason;

/// The engine's transport choice for a `--transport` value.
pub fn transport_kind(t: TransportArg) -> TransportKind {
    match t {
        TransportArg::Auto => TransportKind::Auto,
        TransportArg::Tcp => TransportKind::Tcp,
        TransportArg::Rdma => TransportKind::Rdma,
        TransportArg::CudaIpc => TransportKind::Auto,
    }
}

/// The engine's CUDA IPC setting for a `--transport` value: a forced network transport turns
/// it off (so `--transport tcp` really moves GPU KV over TCP), `cuda-ipc` requires it.
pub fn cuda_ipc_mode(t: TransportArg) -> CudaIpcMode {
    match t {
        TransportArg::Auto => CudaIpcMode::Auto,
        TransportArg::Tcp | TransportArg::Rdma => CudaIpcMode::Off,
        TransportArg::CudaIpc => CudaIpcMode::Required,
    }
}

/// The engine's GPU registration setting for a `--gpu-registration` value.
pub fn gpu_registration(a: GpuRegistrationArg) -> GpuRegistration {
    match a {
        GpuRegistrationArg::Auto => GpuRegistration::Auto,
        GpuRegistrationArg::DmaBuf => GpuRegistration::DmaBuf,
        GpuRegistrationArg::PeerMemory => GpuRegistration::PeerMemory,
        GpuRegistrationArg::Staged => GpuRegistration::Staged,
    }
}

/// The transfer engine configuration for the common options: `--data-host` (else
/// `default_host`) as the engines' host, ports from `--engine-ports` (else picked by the OS),
/// `--timeout` as the transfer deadline.
///
/// Errors: an unspecified address (0.0.0.0, ::) as the host: peers could not reach it.
pub fn engine_config(c: &CommonArgs, default_host: &str) -> Result<EngineConfig, CliError> {
    let host = c.data_host.as_deref().unwrap_or(default_host).to_string();
    if host
        .trim_matches(|ch| ch == '[' || ch == ']')
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
    {
        return Err(CliError::usage(format!(
            "--data-host {host}: the transfer engines need an address the other side can reach, not an unspecified one"
        )));
    }
    Ok(EngineConfig {
        host,
        listen_ports: c.engine_ports,
        transport: transport_kind(c.transport),
        cuda_ipc: cuda_ipc_mode(c.transport),
        transfer_timeout: Duration::from_secs_f64(c.timeout),
        rdma: RdmaConfig {
            gpu_registration: gpu_registration(c.gpu_registration),
            ..RdmaConfig::default()
        },
        auth: AuthConfig {
            secret: secret(c)?,
            secret_file: None,
        },
        ..EngineConfig::default()
    })
}

/// The shared secret of `--secret-file` (or `KVFERRY_SECRET_FILE`), `None` without one.
/// Errors: an unreadable, too short or too long file.
pub fn secret(c: &CommonArgs) -> Result<Option<Secret>, CliError> {
    c.secret_file
        .as_deref()
        .map(Secret::from_file)
        .transpose()
        .map_err(|source| CliError::Transfer {
            what: "--secret-file".into(),
            source,
        })
}

/// This machine's physical memory in bytes (`sysconf`: pages × page size), or `u64::MAX`
/// where the OS does not say. Every side's KV arena is host memory (with `--device cuda` as
/// well: the host copy the KV is generated in), so no block count may ask for more.
pub fn physical_memory() -> u64 {
    // SAFETY: sysconf reads a system value; it has no preconditions and touches no memory of ours.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    match (u64::try_from(pages), u64::try_from(page)) {
        (Ok(n), Ok(p)) if n > 0 && p > 0 => n.saturating_mul(p),
        _ => u64::MAX,
    }
}

/// Free memory of GPU `ordinal` in bytes (`cuMemGetInfo`), read through its primary context.
/// Errors: no driver, no such device, or the driver's refusal.
pub fn device_free_memory(ordinal: u32) -> Result<u64, kvferry_cuda::CudaError> {
    if !kvferry_cuda::driver_library_present() {
        return Err(kvferry_cuda::CudaError::DriverLibraryMissing);
    }
    kvferry_cuda::guarded("reading the GPU's free memory", || {
        let ctx = kvferry_cuda::driver::Context::new(ordinal)?;
        ctx.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to live locals; the context is current on this thread.
        unsafe {
            kvferry_cuda::driver::check(
                "cuMemGetInfo",
                kvferry_cuda::sys::cuMemGetInfo_v2(&mut free, &mut total),
            )?;
        }
        Ok(free as u64)
    })
}

/// The host part of `HOST:PORT` (brackets kept off an IPv6 host), or the text itself.
pub fn host_of(addr: &str) -> &str {
    let a = addr.strip_prefix("tcp://").unwrap_or(addr);
    let host = a.rsplit_once(':').map_or(a, |(h, _)| h);
    host.trim_matches(|ch| ch == '[' || ch == ']')
}

/// The local address this machine uses to reach `peer` (`HOST:PORT`): the host a consumer's
/// transfer engines must name so that the producer can WRITE to them. No packet is sent (a
/// UDP socket is only connected). `None` when the peer does not resolve.
pub fn local_addr_towards(peer: &str) -> Option<String> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let a = peer.strip_prefix("tcp://").unwrap_or(peer);
    let target = a.to_socket_addrs().ok()?.next()?;
    let bind = if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let sock = UdpSocket::bind(bind).ok()?;
    sock.connect(target).ok()?;
    Some(sock.local_addr().ok()?.ip().to_string())
}

/// The registration paths of the ranks' KV memory (`host`, `dma-buf`, `peer-memory`,
/// `staged`, and `cuda-ipc` where GPU memory is exported to processes of this host), each
/// once, in rank order: how the engines made it reachable by peers.
pub fn memory_paths(ranks: &[RankKv]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in ranks {
        let p = r
            .engine
            .region_path(r.base())
            .map_or_else(|| "unregistered".to_string(), |p| p.to_string());
        let ipc = match r.engine.region_cuda_ipc(r.base()) {
            Some(Ok(())) => Some("cuda-ipc".to_string()),
            Some(Err(why)) => Some(format!("no cuda-ipc ({why})")),
            None => None,
        };
        for p in std::iter::once(p).chain(ipc) {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// The path the transfers between the first consumer rank and the first producer rank take
/// (`cuda-ipc`, `tcp` or `rdma`), or why it is not known.
pub fn transfer_path(producer: &RankKv, consumer: &RankKv) -> String {
    let name = producer.engine.segment_name();
    match consumer.engine.open_segment(&name).and_then(|seg| {
        consumer
            .engine
            .transfer_path(&seg, consumer.base(), producer.base())
    }) {
        Ok(p) => p.to_string(),
        Err(e) => format!("unknown ({e})"),
    }
}

/// One side's KV caches for the common options: `model` held by `tp × pp` ranks whose
/// layer arrays hold `num_blocks` blocks of `block_size` tokens in `--layout`, on the
/// `--device` (GPU `gpu` for `cuda`), each rank's engine on `--transport`.
pub fn side_config(
    c: &CommonArgs,
    model: ModelShape,
    (tp, pp): (u32, u32),
    block_size: u64,
    num_blocks: u64,
    gpu: u32,
) -> SideConfig {
    SideConfig {
        model,
        tp,
        pp,
        block_size,
        layout: c.layout.clone(),
        num_blocks,
        transport: transport_kind(c.transport),
        location: device_location(c.device, gpu),
    }
}

/// Where `--device` puts the KV caches: host memory, or GPU `gpu`.
pub fn device_location(d: DeviceArg, gpu: u32) -> Location {
    match d {
        DeviceArg::Cpu => Location::Cpu,
        DeviceArg::Cuda => Location::Cuda(gpu),
    }
}

/// The p2p workers of one side's ranks (`model`'s KV cache groups, blocks of `block_size`
/// tokens: full attention, sliding window with its window, Mamba-type state skipped by the
/// checksum), on GPU `gpu` with `--device cuda`, and the checksum backend's name.
///
/// Errors: `--device cuda` where the CUDA checksum backend is unusable (the ranks'
/// memory is on the GPU, so the CPU backend cannot read it).
pub fn side_workers(
    ranks: &[RankKv],
    c: &CommonArgs,
    model: &ModelShape,
    block_size: u64,
    gpu: u32,
) -> Result<(Vec<Worker>, String), CliError> {
    let device = device_location(c.device, gpu);
    // No silent CPU fallback: the CPU backend cannot read GPU memory.
    let backend = try_backend_for(device).map_err(CliError::CudaBackend)?;
    let name = backend.name().to_string();
    let workers = ranks
        .iter()
        .map(|r| Worker {
            rank: r.rank,
            engine: r.engine.clone(),
            device,
            // Every rank names every group, with the layers its PP stage holds (maybe none).
            groups: model
                .groups()
                .into_iter()
                .map(|group| WorkerGroup {
                    group_id: group,
                    block_size,
                    layers: r
                        .layers
                        .iter()
                        .enumerate()
                        .filter(|(_, l)| l.group == group)
                        .map(|(i, l)| LayerInput {
                            spec: l.spec.clone(),
                            addr: r.layer_addr(i),
                            len: l.spec.geometry.byte_len(),
                        })
                        .collect(),
                    sliding_window: model.window(group),
                    skipped: (group == STATE_GROUP).then_some(SkipReason::NoPerTokenBlocks),
                })
                .collect(),
            backend: backend.clone(),
        })
        .collect();
    Ok((workers, name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn a_forced_network_transport_turns_cuda_ipc_off() {
        let cfg = |t: &str| {
            let cli =
                crate::cli::Cli::try_parse_from(["kvferry", "demo", "--transport", t]).unwrap();
            let crate::cli::Command::Demo(d) = cli.command else {
                panic!("demo")
            };
            engine_config(&d.common, "127.0.0.1").unwrap()
        };
        assert_eq!(cfg("tcp").cuda_ipc, CudaIpcMode::Off);
        assert_eq!(cfg("tcp").transport, TransportKind::Tcp);
        assert_eq!(cfg("rdma").cuda_ipc, CudaIpcMode::Off);
        assert_eq!(cfg("auto").cuda_ipc, CudaIpcMode::Auto);
        assert_eq!(cfg("cuda-ipc").cuda_ipc, CudaIpcMode::Required);
        assert_eq!(cfg("cuda-ipc").transport, TransportKind::Auto);
    }
}
