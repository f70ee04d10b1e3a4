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
use kvferry_transfer::node::RdmaFacts;
use kvferry_transfer::{EngineConfig, Location, RdmaConfig, TcpConfig, TransferEngine};
use serde::Serialize;

use crate::cli::DoctorArgs;
use crate::error::CliError;

/// Bytes of the trial buffers registered with the trial engine.
const TRIAL_BYTES: usize = 2 << 20;

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
    /// Same-host GPU sharing through CUDA IPC as the transfer engine's route: `None` while the
    /// transport choice does not offer it (the CUDA IPC export/import exists in
    /// `kvferry_cuda::ipc`; the GPUs' capability for it is `gpu.devices[].ipc`).
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
        cuda_ipc_transport: None,
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
                error: r.err().map(|e| e.to_string()),
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
        }),
        (Ok(engine), Some(_)) => Some(gpu_trial(engine)),
    };
    (host, gpu_path)
}

fn gpu_trial(engine: &TransferEngine) -> PathFacts {
    let mut facts = PathFacts {
        memory: "cuda:0".into(),
        transport: Some(engine.transport_name().into()),
        why: engine.transport_reason().into(),
        registration: None,
        error: None,
    };
    let buffer = kvferry_cuda::guarded("allocating a trial buffer on cuda:0", || {
        let ctx = kvferry_cuda::driver::Context::new(0)?;
        let b = kvferry_cuda::driver::DeviceBuffer::new(&ctx, TRIAL_BYTES)?;
        Ok((ctx, b))
    });
    match buffer {
        Err(e) => facts.error = Some(e.to_string()),
        Ok((_ctx, b)) => {
            // SAFETY: `b` is live device memory of cuda:0 until it is unregistered below.
            match unsafe { engine.register_memory(b.ptr(), TRIAL_BYTES as u64, Location::Cuda(0)) }
            {
                Ok(()) => {
                    facts.registration = engine.region_path(b.ptr()).map(|p| p.to_string());
                    let _ = engine.unregister_memory(b.ptr());
                }
                Err(e) => facts.error = Some(e.to_string()),
            }
        }
    }
    facts
}

/// The problems in `r`, worst first, each with what to do. Pure.
pub fn diagnose(r: &Report) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut add = |severity, key, what: String, fix: String| {
        out.push(Problem {
            severity,
            key,
            what,
            fix,
        })
    };
    let host_rdma = r.host_path.transport.as_deref() == Some("rdma");
    // RDMA.
    if !r.rdma_built && !r.kernel_rdma_devices.is_empty() {
        add(
            Severity::Warning,
            "rdma-not-built",
            format!(
                "the kernel has RDMA devices ({}) but this build has no RDMA transport: KV moves over TCP",
                r.kernel_rdma_devices.join(", ")
            ),
            "rebuild with `cargo build --release --features rdma` (needs cmake and libclang-dev)".into(),
        );
    }
    if r.rdma_built && r.rdma.devices.is_empty() && !r.kernel_rdma_devices.is_empty() {
        add(
            Severity::Warning,
            "libibverbs-missing",
            format!(
                "the kernel has RDMA devices ({}) but libibverbs lists none ({})",
                r.kernel_rdma_devices.join(", "),
                r.rdma.list_error.as_deref().unwrap_or("empty list")
            ),
            "install rdma-core's user space (`apt install libibverbs1 ibverbs-providers`, `dnf install rdma-core libibverbs`)".into(),
        );
    }
    for d in &r.rdma.devices {
        if d.chosen.is_none() {
            let down: Vec<String> = d
                .ports
                .iter()
                .filter(|p| p.state != "Active")
                .map(|p| format!("port {} {}", p.port, p.state))
                .collect();
            let fix = if !down.is_empty() {
                format!("bring the link up (cable, switch port, `ip link set <netdev> up`; `ibv_devinfo -d {}` shows the state)", d.name)
            } else {
                "give the port's netdev an IP address so a RoCEv2 GID appears (`ibv_devinfo -v` lists the GIDs), or set the GID index".into()
            };
            add(
                Severity::Warning,
                "rdma-device-unusable",
                format!(
                    "RDMA device {} is not used: {}{}",
                    d.name,
                    d.unusable.as_deref().unwrap_or("no usable port"),
                    if down.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", down.join(", "))
                    }
                ),
                fix,
            );
            continue;
        }
        let Some(c) = &d.chosen else { continue };
        let port = d.ports.iter().find(|p| p.port == c.port);
        let gid_kind = port
            .and_then(|p| p.gids.iter().find(|g| g.index == c.gid_index))
            .map(|g| g.kind.as_str());
        if gid_kind == Some("RoCEv1") {
            add(
                Severity::Warning,
                "rocev1-gid",
                format!(
                    "RDMA device {} port {} uses RoCEv1 GID {} ({}): not routable across subnets and often mismatched by peers on RoCEv2",
                    d.name, c.port, c.gid_index, c.gid
                ),
                "give the netdev an IPv4 address so an IPv4-mapped RoCEv2 GID appears (kvferry prefers it), and check both sides use RoCEv2".into(),
            );
        }
        let ethernet = port.is_some_and(|p| p.link_layer == "Ethernet");
        if c.mtu < if ethernet { 1024 } else { 2048 } {
            add(
                Severity::Warning,
                "rdma-mtu-low",
                format!("RDMA device {} port {} has active MTU {} bytes: every message is cut into small packets", d.name, c.port, c.mtu),
                if ethernet {
                    "raise the netdev's MTU (`ip link set dev <netdev> mtu 9000`; RoCE's active MTU follows it, up to 4096) on both sides and the switch".into()
                } else {
                    "check the subnet manager's MTU for the partition (opensm `mtu`)".into()
                },
            );
        }
    }
    if r.host_path.transport.as_deref() == Some("tcp")
        && r.rdma.devices.iter().any(|d| d.chosen.is_some())
    {
        add(
            Severity::Warning,
            "rdma-present-tcp-used",
            format!("RDMA is usable here but the engine uses TCP: {}", r.host_path.why),
            "use --transport auto (or rdma) and read the engine's warning for why RDMA did not start".into(),
        );
    }
    if let Some(e) = &r.host_path.error {
        add(
            Severity::Error,
            "host-registration-fails",
            format!("registering host memory fails: {e}"),
            if host_rdma {
                "raise the locked-memory limit (see memlock) and check the RDMA device (`ibv_devinfo`)".into()
            } else {
                "read the error; `kvferry doctor --transport tcp` shows whether TCP works".into()
            },
        );
    }
    // GPU.
    if r.gpu.devices.is_empty() && Path::new("/dev/nvidia0").exists() {
        add(
            Severity::Warning,
            "cuda-driver-unusable",
            format!(
                "/dev/nvidia0 exists but the CUDA driver is unusable: {}",
                r.gpu.driver_error.as_deref().unwrap_or("no devices")
            ),
            "install the NVIDIA driver's user-space library (libcuda.so.1) or put it on LD_LIBRARY_PATH; in a container run with the NVIDIA container toolkit (`--gpus all`)".into(),
        );
    }
    if let Some(g) = &r.gpu_path {
        if let Some(e) = &g.error {
            add(
                Severity::Error,
                "gpu-registration-fails",
                format!("registering GPU memory (cuda:0) fails: {e}"),
                "check the GPU is free and the driver works (`nvidia-smi`); with RDMA try --gpu-registration staged".into(),
            );
        } else if g.transport.as_deref() == Some("rdma")
            && g.registration.as_deref() == Some("staged")
        {
            let dma = r.gpu.devices.first().is_some_and(|d| d.dma_buf);
            add(
                Severity::Warning,
                "gpu-staged",
                "GPU KV is staged through pinned host memory: the NIC cannot register GPU memory (no GPUDirect RDMA); every transfer adds a device copy and host memory equal to the KV".into(),
                if dma {
                    "the GPU can export dma-buf: use a kernel >= 5.12 with rdma-core >= 34 and NVIDIA's open kernel module, or load nvidia-peermem (`modprobe nvidia_peermem`)".into()
                } else {
                    "load nvidia-peermem (`modprobe nvidia_peermem`), or use a GPU/driver that supports dma-buf export".into()
                },
            );
        } else if g.transport.as_deref() == Some("tcp") {
            add(
                Severity::Info,
                "gpu-over-tcp",
                "GPU KV moves over TCP, copied through pinned host buffers".into(),
                "for GPUDirect RDMA, build with --features rdma on a node with an RDMA NIC".into(),
            );
        }
    }
    // Limits.
    let lim = &r.limits;
    if lim.memlock.needed > 0 && lim.memlock.soft.is_some_and(|s| s < lim.memlock.needed) {
        add(
            Severity::Error,
            "memlock-low",
            format!(
                "locked-memory limit {} is below the {} bytes RDMA registration will pin",
                human(lim.memlock.soft),
                lim.memlock.needed
            ),
            "raise it: `ulimit -l unlimited` (hard limit permitting), `* - memlock unlimited` in /etc/security/limits.conf, `LimitMEMLOCK=infinity` in a systemd unit, `--ulimit memlock=-1` for docker".into(),
        );
    }
    if lim.nofile.soft.is_some_and(|s| s < lim.nofile.needed) {
        add(
            Severity::Warning,
            "nofile-low",
            format!(
                "open-file limit {} is below the {} descriptors the engines may hold under load (listeners, served and opened connections)",
                human(lim.nofile.soft),
                lim.nofile.needed
            ),
            format!(
                "raise it: `ulimit -n {}` (hard limit {}), `LimitNOFILE=` in a systemd unit, `--ulimit nofile=` for docker",
                lim.nofile.needed.next_power_of_two(),
                human(lim.nofile.hard)
            ),
        );
    }
    // Secret file.
    if let Some(s) = &r.secret_file {
        if let Some(e) = &s.error {
            add(
                Severity::Error,
                "secret-file-unusable",
                format!("secret file {}: {e}", s.path),
                "write 16..=4096 random bytes to it: `head -c 32 /dev/urandom > FILE && chmod 600 FILE`".into(),
            );
        }
        if let Some(m) = &s.mode {
            let bits = u32::from_str_radix(m, 8).unwrap_or(0o777);
            if bits & 0o077 != 0 {
                add(
                    Severity::Warning,
                    "secret-file-readable",
                    format!("secret file {} has mode {m}: other users can read the secret that authenticates the engines", s.path),
                    format!("`chmod 600 {}`", s.path),
                );
            }
        }
        if !s.owned_by_me && s.mode.is_some() {
            add(
                Severity::Warning,
                "secret-file-owner",
                format!("secret file {} is owned by another user", s.path),
                format!(
                    "`chown $(id -u) {}` so only this service's user controls it",
                    s.path
                ),
            );
        }
    }
    out.sort_by_key(|p| std::cmp::Reverse(p.severity));
    out
}

fn human(v: Option<u64>) -> String {
    match v {
        None => "unlimited".into(),
        Some(n) => n.to_string(),
    }
}

/// The readable form of the report.
pub fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let path = |p: &PathFacts| {
        format!(
            "{} ({}){}",
            p.transport.as_deref().unwrap_or("none"),
            p.why,
            match (&p.registration, &p.error) {
                (Some(reg), _) => format!(", registration {reg}"),
                (None, Some(e)) => format!(", registration fails: {e}"),
                (None, None) => String::new(),
            }
        )
    };
    let _ = writeln!(s, "kvferry {} doctor", r.version);
    let _ = writeln!(s, "host memory KV: {}", path(&r.host_path));
    match &r.gpu_path {
        Some(g) => {
            let _ = writeln!(s, "GPU memory KV ({}): {}", g.memory, path(g));
        }
        None => {
            let _ = writeln!(
                s,
                "GPU memory KV: no usable GPU ({})",
                r.gpu.driver_error.as_deref().unwrap_or("0 devices")
            );
        }
    }
    let _ = writeln!(
        s,
        "RDMA: {}",
        if r.rdma.devices.is_empty() {
            r.rdma
                .list_error
                .clone()
                .unwrap_or_else(|| "no devices".into())
        } else {
            format!("{} device(s)", r.rdma.devices.len())
        }
    );
    for d in &r.rdma.devices {
        let _ = writeln!(
            s,
            "  {}: {}",
            d.name,
            match &d.chosen {
                Some(c) => format!(
                    "kvferry uses port {} GID {} ({}), MTU {}",
                    c.port, c.gid_index, c.gid, c.mtu
                ),
                None => format!("unused: {}", d.unusable.as_deref().unwrap_or("?")),
            }
        );
        for p in &d.ports {
            let _ = writeln!(
                s,
                "    port {}: {} {}, active MTU {}, LID {}",
                p.port, p.state, p.link_layer, p.active_mtu, p.lid
            );
            for g in &p.gids {
                let _ = writeln!(s, "      GID {} {} {}", g.index, g.kind, g.gid);
            }
        }
    }
    for g in &r.gpu.devices {
        let _ = writeln!(
            s,
            "GPU {}: {} ({}, sm {}, {} MiB): dma-buf {}, GPUDirect RDMA {}, CUDA IPC {}",
            g.ordinal,
            g.name,
            g.pci_bus_id,
            g.compute_capability,
            g.total_memory >> 20,
            yes(g.dma_buf),
            yes(g.gpudirect_rdma),
            yes(g.ipc)
        );
    }
    if r.gpu.devices.len() > 1 {
        let pairs: Vec<String> = r
            .gpu
            .peer_access
            .iter()
            .map(|(a, b)| format!("{a}->{b}"))
            .collect();
        let _ = writeln!(
            s,
            "GPU peer access: {}",
            if pairs.is_empty() {
                "none".into()
            } else {
                pairs.join(" ")
            }
        );
    }
    let _ = writeln!(
        s,
        "nvidia-peermem loaded: {}; CUDA IPC transport: {}",
        yes(r.peer_memory_module),
        r.cuda_ipc_transport
            .as_deref()
            .unwrap_or("not in this build")
    );
    let l = &r.limits;
    let _ = writeln!(
        s,
        "memlock: {} (hard {}), needed {}; open files: {} (hard {}), needed {}",
        human(l.memlock.soft),
        human(l.memlock.hard),
        l.memlock.needed,
        human(l.nofile.soft),
        human(l.nofile.hard),
        l.nofile.needed
    );
    if let Some(f) = &r.secret_file {
        let _ = writeln!(
            s,
            "secret file {}: mode {}",
            f.path,
            f.mode.as_deref().unwrap_or("unreadable")
        );
    }
    if r.problems.is_empty() {
        let _ = writeln!(s, "no problems found");
    }
    for p in &r.problems {
        let _ = writeln!(
            s,
            "{}: {}\n  fix: {}",
            match p.severity {
                Severity::Error => "ERROR",
                Severity::Warning => "warning",
                Severity::Info => "note",
            },
            p.what,
            p.fix
        );
    }
    s
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_cuda::inspect::GpuFacts;
    use kvferry_transfer::node::{ChosenPort, GidFacts, RdmaDeviceFacts, RdmaPortFacts};

    fn path(transport: &str, registration: &str) -> PathFacts {
        PathFacts {
            memory: "cpu".into(),
            transport: Some(transport.into()),
            why: "auto: test".into(),
            registration: Some(registration.into()),
            error: None,
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
}
