//! The report as text for a person (`kvferry doctor` without `--json`).

use super::report::{human, PathFacts, Report, Severity};

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
            .unwrap_or("not tried (no usable GPU to register a trial buffer on)")
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
