//! The RDMA transport on `sideway` (docs/design.md §3 "RDMA transport"): RC QPs, several per
//! endpoint; RoCEv2 GID chosen automatically (IPv4-mapped first) or by `RdmaConfig::gid_index`;
//! one completion queue and one completion thread per device; bounded outstanding work requests
//! (per QP: `max_wr`; per device: the CQ depth); failed slices retried on a fresh endpoint up to
//! `max_retries` times, then handed to the engine (`CompletionSink::fail_peer`), which fetches
//! the peer's descriptor again and retries once (a restarted peer has new rkeys); an endpoint
//! cache whose endpoints idle for `EngineConfig::peer_idle_timeout` are dropped, with a close
//! notice so the target drops its passive QPs too (a restarted initiator's old passive QPs go
//! when its new instance connects); async events logged by a thread per device.
//!
//! Slices come from the engine already cut (never crossing a memory region) and checked against
//! the peer's advertised buffers; the NIC enforces the rest (rkey scope), and a remote access
//! error comes back as a failed slice naming the work completion status.
//!
//! GPU memory (`cuda:N` regions) is registered per `RdmaConfig::gpu_registration`: dma-buf,
//! else peer memory, else (with a warning) a pinned host mirror kept in step with the device
//! by copies that the initiator's syncs trigger (`staging_sync.rs`, `stager.rs`). The path taken is
//! published in the region's keys and reported by `TransferEngine::region_path`.
//!
//! libibverbs is loaded at run time (rdma-mummy-sys `dlopen`s it): on a machine without it
//! [`probe`] returns `None` and [`create`] a `Config` error; nothing crashes.

mod connect;
mod device;
mod endpoint;
mod endpoint_store;
mod inflight;
mod keys;
mod mirror;
mod passive;
mod peer;
mod post;
mod qp;
mod registration;
mod retry;
mod shared;
mod stager;
mod staging_sync;
mod transport;
mod verbs;
mod work;
mod workers;

#[cfg(test)]
mod tests;

use std::sync::Arc;

/// dma-buf export of a GPU range, produced by the engine's `MemoryAccess::export_dmabuf`.
pub use crate::memory::DmabufRange;
pub use connect::{CloseNotice, ConnectReply, ConnectRequest, QpInfo};
pub(crate) use device::inventory;
pub use device::PortInfo;
pub use keys::RdmaRegionKeys;
pub use peer::RdmaPeerInfo;
pub use transport::RdmaTransport;

use super::{Transport, TransportContext};
use crate::config::RdmaConfig;
use crate::error::Result;

/// `Some(one-line description of the first usable device)` when a device (restricted to
/// `config.devices` when non-empty) opens and has an ACTIVE port with a usable GID; `None`
/// otherwise (no libibverbs: a debug line says why; the engine logs the one info line on the
/// transport it chose). Quick, never panics, no lasting effects.
pub fn probe(config: &RdmaConfig) -> Option<String> {
    let list = match device::list_devices() {
        Ok(l) => l,
        Err(e) => {
            // The engine logs the one info line on the transport it chose.
            tracing::debug!("RDMA unavailable: {e}");
            return None;
        }
    };
    for name in device::wanted_names(&list, config) {
        let Some(dev) = list
            .iter()
            .find(|d| sideway::ibverbs::device::DeviceInfo::name(d) == name)
        else {
            continue;
        };
        let ctx = match dev.open() {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("RDMA device {name}: open: {e}");
                continue;
            }
        };
        match device::choose_port(&ctx, config) {
            Ok(c) => {
                let i = &c.info;
                return Some(format!(
                    "{} port {}, {} GID {} ({}), MTU {}",
                    i.name,
                    i.port,
                    if i.ethernet { "RoCE" } else { "InfiniBand" },
                    i.gid_index,
                    i.gid,
                    i.active_mtu
                ));
            }
            Err(why) => tracing::debug!("RDMA device unusable: {why}"),
        }
    }
    None
}

/// Creates the RDMA transport on every usable device (restricted to `config.rdma.devices`).
/// Errors: `Config` for bad RDMA settings or when no device is usable (with the reasons).
pub fn create(ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
    Ok(RdmaTransport::new(ctx)? as Arc<dyn Transport>)
}
