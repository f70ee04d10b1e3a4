//! The target side of endpoints: passive QPs created for a peer's Connect request, kept by
//! (initiator, endpoint id) in a bounded table, dropped on a close notice, a replacement or
//! the initiator's restart.

use std::collections::HashMap;
use std::time::Instant;

use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};

use super::connect::{ConnectReply, ConnectRequest, QpInfo, CONNECT_VERSION, MAX_CLOSE};
use super::device::Device;
use super::qp::{connect_qp, create_qp, path_mtu};
use super::verbs;
use crate::config::RdmaConfig;
use crate::error::Result;

/// Passive endpoints kept per transport at most (oldest dropped first).
const MAX_PASSIVE: usize = 4096;

/// Target side of an endpoint: QPs that only respond (RDMA WRITE/READ need no receive work).
struct Passive {
    _qps: Vec<BasicQueuePair>,
    created: Instant,
    /// The initiator's instance id, when it sent one.
    instance: Option<u64>,
}

/// Passive endpoints by (initiator segment, endpoint id); bounded.
#[derive(Default)]
pub(crate) struct PassiveTable {
    map: HashMap<(String, u64), Passive>,
}

impl PassiveTable {
    /// Serves one Connect request on `dev`: QPs to RTS towards the initiator's; the reply.
    pub fn accept(
        &mut self,
        dev: &Device,
        req: &ConnectRequest,
        config: &RdmaConfig,
    ) -> Result<ConnectReply> {
        let mtu = path_mtu(dev.info.active_mtu, req.port.active_mtu)?;
        req.port.gid_value()?;
        let max_wr = (config.max_wr as u32).min(dev.max_qp_wr).max(1);
        let mut qps = Vec::with_capacity(req.qps.len());
        let mut infos = Vec::with_capacity(req.qps.len());
        for theirs in &req.qps {
            let mut qp = create_qp(dev, max_wr)?;
            let mine = QpInfo {
                qpn: qp.qp_number(),
                psn: verbs::random_psn(),
            };
            connect_qp(&mut qp, dev, mine.psn, &req.port, *theirs, mtu, config)?;
            infos.push(mine);
            qps.push(qp);
        }
        if let Some(old) = req.replaces {
            self.map.remove(&(req.initiator.clone(), old));
        }
        if let Some(inst) = req.initiator_instance {
            // the initiator restarted: its earlier instance's endpoints are dead
            self.map
                .retain(|k, p| k.0 != req.initiator || p.instance.is_none_or(|i| i == inst));
        }
        if self.map.len() >= MAX_PASSIVE {
            if let Some(oldest) = self
                .map
                .iter()
                .min_by_key(|(_, p)| p.created)
                .map(|(k, _)| k.clone())
            {
                tracing::warn!(initiator = %oldest.0, "too many RDMA endpoints: dropping the oldest");
                self.map.remove(&oldest);
            }
        }
        self.map.insert(
            (req.initiator.clone(), req.endpoint_id),
            Passive {
                _qps: qps,
                created: Instant::now(),
                instance: req.initiator_instance,
            },
        );
        tracing::debug!(
            initiator = %req.initiator,
            device = %dev.info.name,
            path_mtu = mtu,
            qps = ?infos.iter().map(|q| q.qpn).collect::<Vec<_>>(),
            "RDMA endpoint accepted"
        );
        Ok(ConnectReply {
            version: CONNECT_VERSION,
            endpoint_id: req.endpoint_id,
            port: dev.info.clone(),
            qps: infos,
        })
    }

    /// Drops the passive endpoints `ids` of initiator `name` (its close notice).
    pub fn close(&mut self, name: &str, ids: &[u64]) {
        for id in ids.iter().take(MAX_CLOSE) {
            self.map.remove(&(name.to_string(), *id));
        }
    }

    /// QPs held by passive endpoints.
    pub fn qps(&self) -> usize {
        self.map.values().map(|p| p._qps.len()).sum()
    }

    /// Drops every passive endpoint of initiator `name`.
    pub fn remove_initiator(&mut self, name: &str) {
        self.map.retain(|k, _| k.0 != name);
    }

    pub fn clear(&mut self) {
        self.map.clear();
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
}
