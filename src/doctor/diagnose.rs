//! The problems in a report, each with its fix: pure, tested on made-up facts (`super`'s tests).

use std::path::Path;

use super::report::{human, PathCause, Problem, Report, Severity};

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
            "rebuild with `cargo build --release --features rdma`".into(),
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
                host_trial_fix(r.host_path.cause).into()
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
            // Same-host GPU KV takes CUDA IPC whatever the network transport is: only KV to
            // other hosts goes through host memory, and the fix depends on what is missing.
            let ipc = g
                .registration
                .as_deref()
                .is_some_and(|reg| reg.ends_with(", cuda-ipc"));
            let what = if ipc {
                "GPU KV to other hosts moves over TCP, copied through pinned host buffers (GPU KV between processes of this host moves over CUDA IPC, as device copies)"
            } else {
                "GPU KV moves over TCP, copied through pinned host buffers (CUDA IPC is not available for same-host peers either)"
            };
            let fix = if r.rdma_built {
                "for GPUDirect RDMA between hosts, this binary has the RDMA transport: the node needs an RDMA NIC that libibverbs lists (see RDMA above)"
            } else {
                "for GPUDirect RDMA between hosts, build with --features rdma on a node with an RDMA NIC"
            };
            add(Severity::Info, "gpu-over-tcp", what.into(), fix.into());
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

/// What to check or change when the trial engine did not start, or its host buffer did not
/// register, without RDMA: by the failure's kind.
fn host_trial_fix(cause: Option<PathCause>) -> &'static str {
    match cause {
        Some(PathCause::Bind) => "the trial engine binds loopback: check `lo` is up (`ip link set lo up`) and 127.0.0.1 is assigned; in a container, give it a network namespace with loopback",
        Some(PathCause::NoRdma) => "use --transport auto (or tcp) on this node; for RDMA, build with --features rdma and check `ibv_devinfo` lists a device with an active port",
        Some(PathCause::Config) => "change the option the error names (--transport, --gpu-registration) back to its default and run doctor again",
        Some(PathCause::NoRandomness) => "the kernel's random source is unavailable: check getrandom(2) works (in a seccomp sandbox, allow it) or /dev/urandom exists",
        Some(PathCause::ProcMaps) => "mount /proc (host ranges are checked against /proc/self/maps): in a container, do not mask /proc",
        Some(PathCause::Io) => "check the open-file limit (`ulimit -n`, see nofile) and that sockets may be created (no seccomp or sandbox blocking socket/bind)",
        Some(PathCause::Unsupported) => "this build cannot do what was asked: use --transport auto, or rebuild with the needed --features (rdma, cuda)",
        Some(PathCause::Gpu) => "check the GPU and driver (`nvidia-smi`) or run without GPU memory",
        Some(PathCause::Other) | None => "run `KVFERRY_LOG=debug kvferry doctor --transport tcp` to see which step fails, and report it with that output",
    }
}
