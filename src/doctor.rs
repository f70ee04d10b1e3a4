//! `kvferry doctor` (docs/design.md §6): inspects this node and says, for host memory and for
//! GPU memory, which path the transfer engine's `auto` takes and why, lists the facts that
//! decide it (RDMA devices, ports, GIDs, MTU; GPUs, dma-buf, GPUDirect RDMA, CUDA IPC, peer
//! access; memlock and open-file limits; the secret file's permissions), and gives each
//! problem with what to do about it.
//!
//! The paths are not guessed: a real engine is started on loopback with the configured
//! transport, as `serve` would start it, and a small host buffer (and, with a GPU, a small
//! device buffer) is registered with it; the engine's own choice and the region's registration
//! path are what the report says. The RDMA facts come from the transport's own device and GID
//! choice code (`kvferry_transfer::node`). Where libibverbs or libcuda are absent the report
//! says so and nothing panics.
//!
//! [`diagnose`] turns the facts into problems and is pure (tested on made-up facts).

use std::path::Path;

use kvferry_cuda::inspect::GpuInventory;
use kvferry_transfer::{
    ConfigError, EngineConfig, Location, RdmaConfig, RegistrationError, TcpConfig, TransferEngine,
    TransferError,
};

use crate::cli::DoctorArgs;
use crate::error::CliError;

mod diagnose;
mod render;
mod report;

pub use diagnose::diagnose;
pub use render::render;
pub use report::{Limit, Limits, PathCause, PathFacts, Problem, Report, SecretFileFacts, Severity};

/// Bytes of the trial buffers registered with the trial engine.
const TRIAL_BYTES: usize = 2 << 20;

/// Runs `kvferry doctor`: prints the report (text, or JSON with `--json`). Errors: `Failed`
/// when a problem of severity `error` was found (after the report is printed); bad options.
pub fn run(args: &DoctorArgs) -> Result<(), CliError> {
    let report = inspect(args)?;
    if args.json {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer_pretty(&mut out, &report)?;
        use std::io::Write;
        writeln!(out).map_err(CliError::io("writing stdout"))?;
    } else {
        print!("{}", render(&report));
    }
    let errors = report
        .problems
        .iter()
        .filter(|p| p.severity == Severity::Error)
        .count();
    if errors > 0 {
        return Err(CliError::Failed(format!(
            "doctor found {errors} problem(s) that will make kvferry fail (listed above)"
        )));
    }
    Ok(())
}

/// Gathers the facts and the problems. Errors: bad `--kv-bytes` or `--model`.
pub fn inspect(args: &DoctorArgs) -> Result<Report, CliError> {
    let kv_bytes = match &args.kv_bytes {
        Some(t) => crate::cli::parse_sizes(t)
            .map_err(|source| CliError::Sizes {
                flag: "--kv-bytes",
                source,
            })?
            .iter()
            .fold(0u64, |a, b| a.saturating_add(*b)),
        None => {
            let m = crate::models::model_by_name(&args.model)?;
            m.bytes_per_token()
                .saturating_mul(args.block_size)
                .saturating_mul(args.num_blocks)
        }
    };
    let rdma_config = RdmaConfig {
        gpu_registration: crate::setup::gpu_registration(args.gpu_registration),
        ..RdmaConfig::default()
    };
    let config = EngineConfig {
        host: "127.0.0.1".into(),
        transport: crate::setup::transport_kind(args.transport),
        rdma: rdma_config.clone(),
        ..EngineConfig::default()
    };
    let rdma = kvferry_transfer::node::rdma_facts(&rdma_config);
    let gpu = kvferry_cuda::inspect::gpus();
    let (host_path, gpu_path) = trial(&config, &gpu);
    let cuda_ipc_transport = cuda_ipc_facts(gpu_path.as_ref());
    let tcp = TcpConfig::default();
    let per_engine = 2 * tcp.max_server_connections as u64 + 64;
    let limits = Limits {
        memlock: limit(
            libc::RLIMIT_MEMLOCK,
            needed_memlock(&host_path, &gpu_path, kv_bytes),
        ),
        nofile: limit(
            libc::RLIMIT_NOFILE,
            per_engine.saturating_mul(args.ranks as u64) + 64,
        ),
        kv_bytes,
    };
    let secret_file = args.secret_file.as_deref().map(secret_facts);
    let mut report = Report {
        version: env!("CARGO_PKG_VERSION"),
        rdma_built: rdma.built,
        host_path,
        gpu_path,
        rdma,
        kernel_rdma_devices: list_dir("/sys/class/infiniband"),
        gpu,
        peer_memory_module: Path::new("/sys/module/nvidia_peermem").exists()
            || Path::new("/sys/module/nv_peer_mem").exists(),
        cuda_ipc_transport,
        limits,
        secret_file,
        problems: Vec::new(),
    };
    report.problems = diagnose(&report);
    Ok(report)
}

/// Locked memory the paths need: every registered byte with RDMA (host memory, or the host
/// mirror of staged GPU memory); nothing with TCP (its pinned staging buffers are the
/// driver's, not counted against the limit).
fn needed_memlock(host: &PathFacts, gpu: &Option<PathFacts>, kv_bytes: u64) -> u64 {
    let rdma = |p: &PathFacts| p.transport.as_deref() == Some("rdma");
    if rdma(host)
        || gpu
            .as_ref()
            .is_some_and(|g| rdma(g) && g.registration.as_deref() == Some("staged"))
    {
        kv_bytes
    } else {
        0
    }
}

fn limit(resource: libc::__rlimit_resource_t, needed: u64) -> Limit {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a live rlimit getrlimit writes.
    let ok = unsafe { libc::getrlimit(resource, &mut r) } == 0;
    let v = |x: libc::rlim_t| (x != libc::RLIM_INFINITY).then_some(x);
    if ok {
        Limit {
            soft: v(r.rlim_cur),
            hard: v(r.rlim_max),
            needed,
        }
    } else {
        Limit {
            soft: Some(0),
            hard: Some(0),
            needed,
        }
    }
}

fn list_dir(dir: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn secret_facts(path: &Path) -> SecretFileFacts {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path);
    let error = kvferry_transfer::Secret::from_file(path)
        .err()
        .map(|e| e.to_string());
    // SAFETY: geteuid takes no arguments and cannot fail.
    let me = unsafe { libc::geteuid() };
    SecretFileFacts {
        path: path.display().to_string(),
        mode: meta
            .as_ref()
            .ok()
            .map(|m| format!("{:04o}", m.mode() & 0o7777)),
        owned_by_me: meta.as_ref().is_ok_and(|m| m.uid() == me),
        error,
    }
}

/// Starts an engine as `serve` would and registers a small host buffer (and a small `cuda:0`
/// buffer when a GPU is usable): what the engine does is the path.
fn trial(config: &EngineConfig, gpu: &GpuInventory) -> (PathFacts, Option<PathFacts>) {
    let engine = TransferEngine::new(config.clone());
    let host = match &engine {
        Err(e) => PathFacts {
            memory: "cpu".into(),
            transport: None,
            why: format!("the transfer engine does not start: {e}"),
            registration: None,
            error: Some(e.to_string()),
            cause: Some(path_cause(e)),
        },
        Ok(engine) => {
            let buf = vec![0u8; TRIAL_BYTES];
            let addr = buf.as_ptr() as u64;
            // SAFETY: `buf` is live host memory until it is unregistered below; no batch uses it.
            let r = unsafe { engine.register_memory(addr, TRIAL_BYTES as u64, Location::Cpu) };
            let registration = r.as_ref().ok().map(|_| {
                let p = engine.region_path(addr).map(|p| p.to_string());
                let _ = engine.unregister_memory(addr);
                p.unwrap_or_else(|| "host".into())
            });
            PathFacts {
                memory: "cpu".into(),
                transport: Some(engine.transport_name().into()),
                why: engine.transport_reason().into(),
                registration,
                error: r.as_ref().err().map(|e| e.to_string()),
                cause: r.as_ref().err().map(path_cause),
            }
        }
    };
    let gpu_path = match (&engine, gpu.devices.first()) {
        (_, None) => None,
        (Err(e), Some(_)) => Some(PathFacts {
            memory: "cuda:0".into(),
            transport: None,
            why: format!("the transfer engine does not start: {e}"),
            registration: None,
            error: Some(e.to_string()),
            cause: Some(path_cause(e)),
        }),
        (Ok(engine), Some(_)) => Some(gpu_trial(engine)),
    };
    (host, gpu_path)
}

/// The kind of a trial engine's failure, for the fix [`diagnose`] gives.
fn path_cause(e: &TransferError) -> PathCause {
    match e {
        TransferError::Bind(_) => PathCause::Bind,
        TransferError::Config(
            ConfigError::RdmaUnusable(_)
            | ConfigError::NoRdmaDevice { .. }
            | ConfigError::RdmaDeviceList(_),
        ) => PathCause::NoRdma,
        TransferError::Config(ConfigError::NoRandomness(_)) => PathCause::NoRandomness,
        TransferError::Config(_) | TransferError::InvalidArgument(_) => PathCause::Config,
        TransferError::Registration(RegistrationError::MapsUnreadable { .. }) => {
            PathCause::ProcMaps
        }
        TransferError::Io(_) => PathCause::Io,
        TransferError::Unsupported(_) => PathCause::Unsupported,
        TransferError::Gpu(_) => PathCause::Gpu,
        _ => PathCause::Other,
    }
}

/// What the trial GPU registration says of CUDA IPC: `None` without a GPU trial.
fn cuda_ipc_facts(gpu_path: Option<&PathFacts>) -> Option<String> {
    let reg = gpu_path?.registration.as_deref()?;
    Some(if reg.ends_with(", cuda-ipc") {
        "cuda:N regions exported: device memory between processes of this host moves as device copies".into()
    } else if let Some(i) = reg.find("(not exported for CUDA IPC: ") {
        reg[i + 1..reg.len() - 1].to_string()
    } else {
        "off (EngineConfig::cuda_ipc) or no CUDA driver".into()
    })
}

fn gpu_trial(engine: &TransferEngine) -> PathFacts {
    let mut facts = PathFacts {
        memory: "cuda:0".into(),
        transport: Some(engine.transport_name().into()),
        why: engine.transport_reason().into(),
        registration: None,
        error: None,
        cause: None,
    };
    let buffer = kvferry_cuda::guarded("allocating a trial buffer on cuda:0", || {
        let ctx = kvferry_cuda::driver::Context::new(0)?;
        let b = kvferry_cuda::driver::DeviceBuffer::new(&ctx, TRIAL_BYTES)?;
        Ok((ctx, b))
    });
    match buffer {
        Err(e) => {
            facts.error = Some(e.to_string());
            facts.cause = Some(PathCause::Gpu);
        }
        Ok((_ctx, b)) => {
            // SAFETY: `b` is live device memory of cuda:0 until it is unregistered below.
            match unsafe { engine.register_memory(b.ptr(), TRIAL_BYTES as u64, Location::Cuda(0)) }
            {
                Ok(()) => {
                    facts.registration = engine.region_path(b.ptr()).map(|p| {
                        match engine.region_cuda_ipc(b.ptr()) {
                            Some(Ok(())) => format!("{p}, cuda-ipc"),
                            Some(Err(why)) => format!("{p} (not exported for CUDA IPC: {why})"),
                            None => p.to_string(),
                        }
                    });
                    let _ = engine.unregister_memory(b.ptr());
                }
                Err(e) => {
                    facts.error = Some(e.to_string());
                    facts.cause = Some(path_cause(&e));
                }
            }
        }
    }
    facts
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_cuda::inspect::GpuFacts;
    use kvferry_transfer::node::{ChosenPort, GidFacts, RdmaDeviceFacts, RdmaFacts, RdmaPortFacts};

    fn path(transport: &str, registration: &str) -> PathFacts {
        PathFacts {
            memory: "cpu".into(),
            transport: Some(transport.into()),
            why: "auto: test".into(),
            registration: Some(registration.into()),
            error: None,
            cause: None,
        }
    }

    /// A node with nothing wrong: TCP, no GPU, generous limits, no secret.
    fn healthy() -> Report {
        Report {
            version: "test",
            rdma_built: true,
            host_path: path("tcp", "host"),
            gpu_path: None,
            rdma: RdmaFacts {
                built: true,
                list_error: Some("no libibverbs".into()),
                devices: Vec::new(),
            },
            kernel_rdma_devices: Vec::new(),
            gpu: GpuInventory {
                driver_version: None,
                driver_error: Some("libcuda not found".into()),
                devices: Vec::new(),
                peer_access: Vec::new(),
            },
            peer_memory_module: false,
            cuda_ipc_transport: None,
            limits: Limits {
                memlock: Limit {
                    soft: None,
                    hard: None,
                    needed: 0,
                },
                nofile: Limit {
                    soft: Some(65536),
                    hard: Some(65536),
                    needed: 640,
                },
                kv_bytes: 1 << 30,
            },
            secret_file: None,
            problems: Vec::new(),
        }
    }

    fn rdma_device(kind: &str, mtu: u32) -> RdmaDeviceFacts {
        RdmaDeviceFacts {
            name: "mlx5_0".into(),
            error: None,
            ports: vec![RdmaPortFacts {
                port: 1,
                state: "Active".into(),
                link_layer: "Ethernet".into(),
                active_mtu: mtu,
                lid: 0,
                gids: vec![GidFacts {
                    index: 0,
                    gid: "fe80::1".into(),
                    kind: kind.into(),
                }],
            }],
            chosen: Some(ChosenPort {
                port: 1,
                gid_index: 0,
                gid: "fe80::1".into(),
                mtu,
            }),
            unusable: None,
        }
    }

    fn keys(r: &Report) -> Vec<&'static str> {
        diagnose(r).iter().map(|p| p.key).collect()
    }

    #[test]
    fn a_healthy_node_has_no_problems() {
        assert!(diagnose(&healthy()).is_empty());
        assert!(render(&healthy()).contains("no problems found"));
    }

    #[test]
    fn without_a_gpu_trial_cuda_ipc_is_untried_not_missing_from_the_build() {
        // Every build has the CUDA IPC transport; only a GPU trial can say whether it works.
        let text = render(&healthy());
        assert!(
            text.contains("CUDA IPC transport: not tried (no usable GPU"),
            "{text}"
        );
        assert!(!text.contains("not in this build"), "{text}");
    }

    #[test]
    fn memlock_below_what_rdma_pins_is_an_error() {
        let mut r = healthy();
        r.host_path = path("rdma", "host");
        r.limits.memlock = Limit {
            soft: Some(8 << 20),
            hard: Some(8 << 20),
            needed: 1 << 30,
        };
        let p = diagnose(&r);
        assert_eq!(p[0].key, "memlock-low");
        assert_eq!(p[0].severity, Severity::Error);
        assert!(p[0].fix.contains("ulimit -l unlimited"), "{}", p[0].fix);
        r.limits.memlock.soft = None;
        assert!(diagnose(&r).is_empty());
    }

    #[test]
    fn memlock_needs_follow_the_paths() {
        let tcp = path("tcp", "host");
        let rdma = path("rdma", "host");
        let staged = path("rdma", "staged");
        let dmabuf = path("rdma", "dma-buf");
        assert_eq!(needed_memlock(&tcp, &None, 100), 0);
        assert_eq!(needed_memlock(&rdma, &None, 100), 100);
        assert_eq!(needed_memlock(&tcp, &Some(staged), 100), 100);
        assert_eq!(needed_memlock(&tcp, &Some(dmabuf), 100), 0);
    }

    #[test]
    fn rocev1_gid_and_low_mtu_are_named() {
        let mut r = healthy();
        r.host_path = path("rdma", "host");
        r.rdma.devices = vec![rdma_device("RoCEv1", 1024)];
        assert_eq!(keys(&r), vec!["rocev1-gid"]);
        r.rdma.devices = vec![rdma_device("RoCEv2", 512)];
        assert_eq!(keys(&r), vec!["rdma-mtu-low"]);
        r.rdma.devices = vec![rdma_device("RoCEv2", 4096)];
        assert!(keys(&r).is_empty());
    }

    #[test]
    fn rdma_usable_but_tcp_chosen_is_a_warning() {
        let mut r = healthy();
        r.rdma.devices = vec![rdma_device("RoCEv2", 4096)];
        assert_eq!(keys(&r), vec!["rdma-present-tcp-used"]);
    }

    #[test]
    fn a_down_port_says_bring_the_link_up() {
        let mut r = healthy();
        let mut d = rdma_device("RoCEv2", 4096);
        d.ports[0].state = "Down".into();
        d.chosen = None;
        d.unusable = Some("no ACTIVE port".into());
        r.rdma.devices = vec![d];
        let p = diagnose(&r);
        assert_eq!(p[0].key, "rdma-device-unusable");
        assert!(p[0].what.contains("port 1 Down"), "{}", p[0].what);
        assert!(p[0].fix.contains("link up"), "{}", p[0].fix);
    }

    #[test]
    fn kernel_devices_without_the_build_or_the_library_are_named() {
        let mut r = healthy();
        r.kernel_rdma_devices = vec!["rxe0".into()];
        assert_eq!(keys(&r), vec!["libibverbs-missing"]);
        r.rdma_built = false;
        r.rdma.built = false;
        assert_eq!(keys(&r), vec!["rdma-not-built"]);
    }

    #[test]
    fn staged_gpu_memory_over_rdma_says_how_to_get_gpudirect() {
        let mut r = healthy();
        r.host_path = path("rdma", "host");
        r.gpu.devices = vec![GpuFacts {
            ordinal: 0,
            name: "GPU".into(),
            pci_bus_id: "0000:01:00.0".into(),
            compute_capability: "9.0".into(),
            total_memory: 1 << 30,
            dma_buf: true,
            gpudirect_rdma: true,
            ipc: true,
            posix_fd_handles: true,
        }];
        r.gpu_path = Some(path("rdma", "staged"));
        let p = diagnose(&r);
        assert_eq!(p[0].key, "gpu-staged");
        assert!(p[0].fix.contains("nvidia_peermem"), "{}", p[0].fix);
        r.gpu_path = Some(path("rdma", "dma-buf"));
        assert!(diagnose(&r).is_empty());
    }

    #[test]
    fn gpu_over_tcp_names_cuda_ipc_and_the_missing_piece() {
        let mut r = healthy();
        r.gpu_path = Some(path("tcp", "staged, cuda-ipc"));
        let p = diagnose(&r);
        assert_eq!(p[0].key, "gpu-over-tcp");
        assert!(p[0].what.contains("to other hosts"), "{}", p[0].what);
        assert!(p[0].what.contains("over CUDA IPC"), "{}", p[0].what);
        // Built with rdma: the NIC is missing, not the build.
        assert!(p[0].fix.contains("needs an RDMA NIC"), "{}", p[0].fix);
        assert!(!p[0].fix.contains("build with"), "{}", p[0].fix);
        r.rdma_built = false;
        r.gpu_path = Some(path("tcp", "staged (not exported for CUDA IPC: no driver)"));
        let p = diagnose(&r);
        assert!(p[0].what.contains("not available"), "{}", p[0].what);
        assert!(
            p[0].fix.contains("build with --features rdma"),
            "{}",
            p[0].fix
        );
    }

    #[test]
    fn open_file_limit_below_need_is_a_warning_with_a_number() {
        let mut r = healthy();
        r.limits.nofile.soft = Some(256);
        let p = diagnose(&r);
        assert_eq!(p[0].key, "nofile-low");
        assert!(p[0].fix.contains("ulimit -n 1024"), "{}", p[0].fix);
    }

    #[test]
    fn problems_come_worst_first() {
        let mut r = healthy();
        r.limits.nofile.soft = Some(256);
        r.host_path.error = Some("bad".into());
        let p = diagnose(&r);
        assert_eq!(p[0].severity, Severity::Error);
        assert_eq!(p[1].severity, Severity::Warning);
    }

    /// Each cause of a failed trial on TCP gets its own fix, naming what to check or change;
    /// none leaves the reader with the error alone.
    #[test]
    fn a_failed_host_trial_without_rdma_gets_a_fix_for_its_cause() {
        for (cause, needle) in [
            (PathCause::Bind, "ip link set lo up"),
            (PathCause::NoRdma, "--transport auto"),
            (PathCause::Config, "--transport"),
            (PathCause::NoRandomness, "getrandom"),
            (PathCause::ProcMaps, "/proc"),
            (PathCause::Io, "ulimit -n"),
            (PathCause::Unsupported, "--features"),
            (PathCause::Gpu, "nvidia-smi"),
            (PathCause::Other, "KVFERRY_LOG=debug"),
        ] {
            let mut r = healthy();
            r.host_path.error = Some("bad".into());
            r.host_path.cause = Some(cause);
            let p = diagnose(&r);
            let p = p
                .iter()
                .find(|p| p.key == "host-registration-fails")
                .unwrap();
            assert!(p.fix.contains(needle), "{cause:?}: {}", p.fix);
            assert!(!p.fix.contains("read the error"), "{cause:?}: {}", p.fix);
        }
    }

    #[test]
    fn trial_failures_are_classified_from_the_typed_error() {
        use kvferry_transfer::NoRdma;
        let no_rdma = TransferError::Config(ConfigError::RdmaUnusable(NoRdma::NotBuilt));
        assert_eq!(path_cause(&no_rdma), PathCause::NoRdma);
        let maps = TransferError::Registration(RegistrationError::MapsUnreadable {
            kind: std::io::ErrorKind::NotFound,
        });
        assert_eq!(path_cause(&maps), PathCause::ProcMaps);
        let config = TransferError::Config(ConfigError::EmptyHost);
        assert_eq!(path_cause(&config), PathCause::Config);
    }
}
