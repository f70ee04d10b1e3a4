//! RDMA device discovery and the per-device resources (docs/design.md §3): context, protection
//! domain, one completion queue with its channel, and the table of work requests in flight.

use std::net::Ipv6Addr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sideway::ibverbs::address::Gid;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, PortState};
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::verbs;
use crate::config::RdmaConfig;
use crate::error::{ConfigError, ProtocolError, RdmaError, Result, TransferError};

/// What a peer needs to address one port (published in the descriptor and in Connect frames).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortInfo {
    /// Device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Port number (from 1).
    pub port: u8,
    /// GID index used on that port.
    pub gid_index: u32,
    /// The GID, as IPv6 text (`::ffff:10.99.0.1` for an IPv4-mapped RoCEv2 GID).
    pub gid: String,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active MTU advertised, bytes (the port's, capped by `RdmaConfig::mtu`).
    pub active_mtu: u32,
    /// `true` on RoCE (Ethernet link layer: addressing by GID, a GRH on every packet).
    pub ethernet: bool,
}

impl PortInfo {
    /// The GID parsed from its text. Error: `Protocol` naming the bad text.
    pub fn gid_value(&self) -> Result<Gid> {
        self.parse_gid().map_err(|_| {
            TransferError::Protocol(ProtocolError::BadField {
                what: format!("GID of device {:?}", self.name),
                value: format!("{:?}", self.gid),
                expected: "IPv6 address text",
            })
        })
    }

    /// The GID parsed from its IPv6 text; the parser's error if it is not IPv6 address text.
    pub(crate) fn parse_gid(&self) -> std::result::Result<Gid, std::net::AddrParseError> {
        self.gid.parse::<Ipv6Addr>().map(Gid::from)
    }
}

/// A usable port found on a device: the port, its GID choice and limits.
pub(crate) struct PortChoice {
    pub info: PortInfo,
    pub max_qp_rd_atom: u8,
    pub max_qp_init_rd_atom: u8,
    pub max_cqe: u32,
    pub max_qp_wr: u32,
    pub max_mr_size: u64,
}

/// Lists devices with libibverbs; `Verbs` error when the library is absent or listing fails.
pub(crate) fn list_devices() -> std::result::Result<DeviceList, RdmaError> {
    DeviceList::new()
        .map_err(|e| RdmaError::verbs("list devices (libibverbs missing or no RDMA support)", e))
}

/// Picks the GID index on `port`: `config.gid_index` when set (must be non-zero), else on
/// Ethernet the best of IPv4-mapped RoCEv2 > other RoCEv2 (not link-local) > link-local RoCEv2
/// > RoCEv1; on InfiniBand index 0.
fn choose_gid(
    ctx: &DeviceContext,
    port: u8,
    tbl_len: i32,
    ethernet: bool,
    config: &RdmaConfig,
) -> Option<(u32, Gid)> {
    if let Some(i) = config.gid_index {
        let g = ctx.query_gid(port, i).ok()?;
        return (!g.is_zero()).then_some((i, g));
    }
    if !ethernet {
        let g = ctx.query_gid(port, 0).ok()?;
        return Some((0, g));
    }
    let mut best: Option<(u8, u32, Gid)> = None;
    for i in 0..tbl_len.max(0) as u32 {
        let Ok(g) = ctx.query_gid(port, i) else {
            continue;
        };
        if g.is_zero() {
            continue;
        }
        let v2 = ctx.query_gid_type(port, i).map(|t| t == 1).unwrap_or(false);
        let v4mapped = Ipv6Addr::from(g).to_ipv4_mapped().is_some();
        let score = match (v2, v4mapped, g.is_unicast_link_local()) {
            (true, true, _) => 4,
            (true, false, false) => 3,
            (true, false, true) => 2,
            (false, _, _) => 1,
        };
        if best.as_ref().is_none_or(|b| score > b.0) {
            best = Some((score, i, g));
        }
    }
    best.map(|(_, i, g)| (i, g))
}

/// The first ACTIVE port of an open device with a usable GID, or why there is none.
pub(crate) fn choose_port(
    ctx: &DeviceContext,
    config: &RdmaConfig,
) -> std::result::Result<PortChoice, RdmaError> {
    let name = ctx.name();
    let attr = ctx
        .query_device()
        .map_err(|e| RdmaError::verbs(format!("{name}: query device"), e))?;
    let mut why = RdmaError::NoActivePort {
        device: name.clone(),
    };
    for port in 1..=attr.phys_port_cnt() {
        let Ok(p) = ctx.query_port(port) else {
            continue;
        };
        if p.port_state() != PortState::Active {
            continue;
        }
        let ethernet = p.link_layer() == LinkLayer::Ethernet;
        let Some((gid_index, gid)) = choose_gid(ctx, port, p.gid_tbl_len(), ethernet, config)
        else {
            why = RdmaError::NoUsableGid {
                device: name.clone(),
                port,
                gid_index: config.gid_index,
            };
            continue;
        };
        let mut mtu = verbs::mtu_bytes(p.active_mtu());
        if let Some(cap) = config.mtu {
            mtu = mtu.min(cap);
        }
        return Ok(PortChoice {
            info: PortInfo {
                name: name.clone(),
                port,
                gid_index,
                gid: Ipv6Addr::from(gid).to_string(),
                lid: p.lid(),
                active_mtu: mtu,
                ethernet,
            },
            max_qp_rd_atom: attr.max_qp_rd_atom().clamp(0, 255) as u8,
            max_qp_init_rd_atom: attr.max_qp_init_rd_atom().clamp(0, 255) as u8,
            max_cqe: attr.max_cqe().max(1) as u32,
            max_qp_wr: attr.max_qp_wr().max(1) as u32,
            max_mr_size: attr.max_mr_size(),
        });
    }
    Err(why)
}

/// Checks `config.mtu`: one of the IB MTUs.
pub(crate) fn check_config(config: &RdmaConfig) -> Result<()> {
    if let Some(m) = config.mtu {
        if verbs::mtu_from_bytes(m).is_none() {
            return Err(TransferError::Config(ConfigError::NotOneOf {
                key: "rdma.mtu",
                value: u64::from(m),
                allowed: &[256, 512, 1024, 2048, 4096],
            }));
        }
    }
    // merge_bytes: at most one work request's bytes
    let bounded: [(&'static str, u64, u64, u64); 5] = [
        (
            "rdma.qps_per_endpoint",
            config.qps_per_endpoint as u64,
            1,
            64,
        ),
        ("rdma.max_wr", config.max_wr as u64, 1, u64::MAX),
        (
            "rdma.merge_bytes",
            config.merge_bytes,
            0,
            super::verbs::MAX_WR_BYTES,
        ),
        ("rdma.retry_count", u64::from(config.retry_count), 0, 7),
        ("rdma.qp_timeout", u64::from(config.qp_timeout), 0, 31),
    ];
    for (key, value, min, max) in bounded {
        if !(min..=max).contains(&value) {
            return Err(TransferError::Config(ConfigError::OutOfRange {
                key,
                value,
                min,
                max,
            }));
        }
    }
    Ok(())
}

/// One opened device: its port choice, PD and CQ (shared by every QP on it); its in-flight
/// table is `Shared::inflight[index]`.
pub(crate) struct Device {
    /// Position in the transport's device list (= index into `RegionKeys::rkeys`).
    pub index: usize,
    pub info: PortInfo,
    pub max_rd_atomic: u8,
    pub max_mr_size: u64,
    pub max_qp_wr: u32,
    pub ctx: Arc<DeviceContext>,
    pub pd: Arc<ProtectionDomain>,
    pub cq: Arc<BasicCompletionQueue>,
    pub channel: Arc<CompletionChannel>,
    /// CQ entries: the most signalled work requests that may be outstanding on this device.
    pub cq_depth: usize,
    /// Outstanding signalled work requests on this device (never above `cq_depth`).
    pub outstanding: AtomicUsize,
}

impl Device {
    /// Opens device `name` (from `list`), picks its port and GID, allocates PD, channel, CQ.
    pub fn open(
        index: usize,
        list: &DeviceList,
        name: &str,
        config: &RdmaConfig,
    ) -> std::result::Result<Device, RdmaError> {
        let dev = list
            .iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| RdmaError::DeviceGone {
                device: name.to_string(),
            })?;
        let ctx = dev
            .open()
            .map_err(|e| RdmaError::verbs(format!("open {name}"), e))?;
        let choice = choose_port(&ctx, config)?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| RdmaError::verbs(format!("{name}: alloc PD"), e))?;
        let channel = ctx
            .create_comp_channel()
            .map_err(|e| RdmaError::verbs(format!("{name}: create completion channel"), e))?;
        verbs::set_nonblocking(std::os::fd::AsRawFd::as_raw_fd(&*channel))
            .map_err(|e| RdmaError::verbs(format!("{name}: completion channel"), e))?;
        let cq_depth = choice.max_cqe.min(65536) as usize;
        let cq = ctx
            .create_cq_builder()
            .setup_cqe(cq_depth as u32)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| RdmaError::verbs(format!("{name}: create CQ of {cq_depth}"), e))?;
        verbs::set_nonblocking(verbs::async_fd(&ctx))
            .map_err(|e| RdmaError::verbs(format!("{name}: async event fd"), e))?;
        Ok(Device {
            index,
            info: choice.info,
            max_rd_atomic: choice
                .max_qp_rd_atom
                .min(choice.max_qp_init_rd_atom)
                .clamp(1, 16),
            max_mr_size: choice.max_mr_size,
            max_qp_wr: choice.max_qp_wr,
            ctx,
            pd,
            cq,
            channel,
            cq_depth,
            outstanding: AtomicUsize::new(0),
        })
    }

    /// Takes one CQ credit if the device has room for another signalled work request.
    pub fn take_credit(&self) -> bool {
        self.outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.cq_depth).then_some(n + 1)
            })
            .is_ok()
    }

    pub fn return_credit(&self) {
        let _ = self
            .outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(1))
            });
    }
}

/// Names of the devices to use: `config.devices` when non-empty (in that order), else all.
pub(crate) fn wanted_names(list: &DeviceList, config: &RdmaConfig) -> Vec<String> {
    let all: Vec<String> = list.iter().map(|d| d.name()).collect();
    if config.devices.is_empty() {
        all
    } else {
        config
            .devices
            .iter()
            .filter(|n| all.contains(n))
            .cloned()
            .collect()
    }
}

/// Every device libibverbs lists with its ports and GIDs, and on each the port and GID this
/// transport would use (`choose_port`, the code `Device::open` runs), for `node::rdma_facts`.
/// Errors: `Verbs` when the device list cannot be read (no libibverbs).
pub(crate) fn inventory(
    config: &RdmaConfig,
) -> std::result::Result<Vec<crate::node::RdmaDeviceFacts>, RdmaError> {
    let list = list_devices()?;
    let wanted = wanted_names(&list, config);
    Ok(list
        .iter()
        .map(|d| {
            let name = d.name();
            let mut facts = crate::node::RdmaDeviceFacts {
                name: name.clone(),
                error: None,
                ports: Vec::new(),
                chosen: None,
                unusable: None,
            };
            match d.open() {
                Ok(ctx) => device_facts(&ctx, config, wanted.contains(&name), &mut facts),
                Err(e) => {
                    let e = RdmaError::verbs(format!("open {name}"), e).to_string();
                    facts.unusable = Some(e.clone());
                    facts.error = Some(e);
                }
            }
            facts
        })
        .collect())
}

fn device_facts(
    ctx: &DeviceContext,
    config: &RdmaConfig,
    wanted: bool,
    facts: &mut crate::node::RdmaDeviceFacts,
) {
    use crate::node::{ChosenPort, GidFacts, RdmaPortFacts};
    let attr = match ctx.query_device() {
        Ok(a) => a,
        Err(e) => {
            let e = RdmaError::verbs(format!("{}: query device", facts.name), e).to_string();
            facts.unusable = Some(e.clone());
            facts.error = Some(e);
            return;
        }
    };
    for port in 1..=attr.phys_port_cnt() {
        let Ok(p) = ctx.query_port(port) else {
            continue;
        };
        let ethernet = p.link_layer() == LinkLayer::Ethernet;
        let mut gids = Vec::new();
        for index in 0..p.gid_tbl_len().max(0) as u32 {
            let Ok(g) = ctx.query_gid(port, index) else {
                continue;
            };
            if g.is_zero() {
                continue;
            }
            let kind = if !ethernet {
                "IB"
            } else if ctx.query_gid_type(port, index).is_ok_and(|t| t == 1) {
                "RoCEv2"
            } else {
                "RoCEv1"
            };
            gids.push(GidFacts {
                index,
                gid: Ipv6Addr::from(g).to_string(),
                kind: kind.into(),
            });
        }
        facts.ports.push(RdmaPortFacts {
            port,
            state: format!("{:?}", p.port_state()),
            link_layer: format!("{:?}", p.link_layer()),
            active_mtu: verbs::mtu_bytes(p.active_mtu()),
            lid: p.lid(),
            gids,
        });
    }
    if !wanted {
        facts.unusable = Some("not in the configured RDMA device list".into());
        return;
    }
    match choose_port(ctx, config) {
        Ok(c) => {
            facts.chosen = Some(ChosenPort {
                port: c.info.port,
                gid_index: c.info.gid_index,
                gid: c.info.gid,
                mtu: c.info.active_mtu,
            })
        }
        Err(why) => facts.unusable = Some(why.to_string()),
    }
}
