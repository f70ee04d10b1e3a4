//! The endpoint store: the cache of endpoints by (peer, device pair), how slices are routed to
//! them (`dispatch`), the connect thread that fills a slot, the retirement of a failed endpoint,
//! and the idle expiry that drops endpoints and tells their targets (`CloseNotice`).

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::connect::{self, CloseNotice};
use super::device::Device;
use super::endpoint::{Endpoint, EpKey, Slot};
use super::shared::Shared;
use super::work::Work;
use crate::error::{EndpointFailure, RdmaError, TransferError};
use crate::handshake::{self, FrameType};

impl Shared {
    pub(super) fn key_for(&self, w: &Work) -> EpKey {
        let local_dev = (w.slice.id as usize + w.attempts as usize) % self.devices.len();
        EpKey {
            peer: w.peer.name.clone(),
            instance: w.peer.instance_id,
            local_dev,
            // `decode` refused a peer with no device
            remote_dev: local_dev % w.peer_info.devices.len().max(1),
        }
    }

    /// Routes slices to their endpoints; connects (on a new thread) where none is ready.
    pub(super) fn dispatch(self: &Arc<Self>, works: Vec<Work>) {
        let mut groups: HashMap<EpKey, Vec<Work>> = HashMap::new();
        for w in works {
            groups.entry(self.key_for(&w)).or_default().push(w);
        }
        for (key, ws) in groups {
            if self.stop.load(Ordering::SeqCst) {
                let e = TransferError::Rdma(RdmaError::ShutDown);
                ws.into_iter()
                    .for_each(|w| w.sink.complete(w.slice.id, Err(e.clone())));
                continue;
            }
            let mut eps = self.endpoints.locked();
            let ws = match eps.get_mut(&key) {
                Some(Slot::Ready(ep)) => {
                    let ep = ep.clone();
                    let mut pending = ep.lock_pending();
                    if !ep.is_broken() {
                        ep.touch();
                        pending.extend(ws);
                        drop(pending);
                        drop(eps);
                        self.pump(&ep);
                        continue;
                    }
                    drop(pending);
                    eps.remove(&key);
                    ws
                }
                Some(Slot::Connecting(waiting)) => {
                    waiting.extend(ws);
                    continue;
                }
                None => ws,
            };
            let backoff = ws.iter().map(|w| w.attempts).max().unwrap_or(0);
            eps.insert(key.clone(), Slot::Connecting(ws));
            drop(eps);
            let s = self.clone();
            let k2 = key.clone();
            let spawned = std::thread::Builder::new()
                .name("kvferry-rdma-connect".into())
                .spawn(move || s.connect(k2, backoff));
            if let Err(e) = spawned {
                let err = TransferError::io("spawn RDMA connect thread", e);
                if let Some(Slot::Connecting(ws)) = self.endpoints.locked().remove(&key) {
                    ws.into_iter()
                        .for_each(|w| w.sink.complete(w.slice.id, Err(err.clone())));
                }
            }
        }
    }

    /// Connect thread: handshake for `key`, then hands the waiting slices to the endpoint.
    pub(super) fn connect(self: Arc<Self>, key: EpKey, backoff: u32) {
        if backoff > 0 {
            std::thread::sleep(Duration::from_millis(50 * backoff.min(20) as u64));
        }
        let dev = self.devices[key.local_dev].clone();
        let replaces = self.replaced.locked().get(&key).copied();
        let timeout = self.handshake_timeout;
        let peer = key.peer.clone();
        let cred = self.credential.clone();
        let res = Endpoint::connect(
            dev,
            key.clone(),
            &self.segment_name,
            self.instance_id,
            replaces,
            &self.config,
            |body| handshake::request_with(&peer, FrameType::Connect, body, timeout, cred.as_ref()),
        );
        let mut eps = self.endpoints.locked();
        let waiting = match eps.remove(&key) {
            Some(Slot::Connecting(w)) => w,
            Some(other) => {
                eps.insert(key.clone(), other);
                Vec::new()
            }
            None => Vec::new(),
        };
        match res {
            Ok(ep) if !self.stop.load(Ordering::SeqCst) => {
                let ep = Arc::new(ep);
                ep.lock_pending().extend(waiting);
                eps.insert(key, Slot::Ready(ep.clone()));
                drop(eps);
                self.pump(&ep);
            }
            Ok(_) => {
                drop(eps);
                let e = TransferError::Rdma(RdmaError::ShutDown);
                waiting
                    .into_iter()
                    .for_each(|w| w.sink.complete(w.slice.id, Err(e.clone())));
            }
            Err(e) => {
                drop(eps);
                tracing::warn!("RDMA connect to {} failed: {e}", key.peer);
                let e = RdmaError::Connect {
                    peer: key.peer.clone(),
                    source: crate::error::Shared(Arc::new(e)),
                };
                for w in waiting {
                    self.retry_or_fail(w, e.clone(), true);
                }
            }
        }
    }

    /// Retires a failed endpoint (first failure only): out of the cache, QPs to ERR (their
    /// outstanding work requests flush and are retried as they complete), pending slices
    /// re-dispatched to a fresh endpoint.
    pub(super) fn endpoint_failed(self: &Arc<Self>, ep: &Arc<Endpoint>, reason: EndpointFailure) {
        let Some(pending) = ep.mark_broken(&reason) else {
            return;
        };
        tracing::warn!(peer = %ep.key.peer, device = %ep.dev.info.name, "RDMA endpoint failed: {reason}");
        {
            let mut eps = self.endpoints.locked();
            if matches!(eps.get(&ep.key), Some(Slot::Ready(e)) if e.id == ep.id) {
                eps.remove(&ep.key);
            }
        }
        self.replaced.locked().insert(ep.key.clone(), ep.id);
        if !pending.is_empty() {
            self.dispatch(pending);
        }
    }

    /// Endpoints on device `dev` with slices waiting.
    pub(super) fn waiting_endpoints(&self, dev: usize) -> Vec<Arc<Endpoint>> {
        self.endpoints
            .locked()
            .values()
            .filter_map(|s| match s {
                Slot::Ready(ep) if ep.key.local_dev == dev && !ep.lock_pending().is_empty() => {
                    Some(ep.clone())
                }
                _ => None,
            })
            .collect()
    }

    /// Drops this device's endpoints that held no work for `idle_timeout` (their QPs are
    /// destroyed) and tells each target, best effort, to drop its side (`CloseNotice`).
    /// Forgotten replacements of peers with no endpoint left are announced the same way.
    pub(super) fn expire_idle(self: &Arc<Self>, dev: &Device) {
        let (idle, forgotten) = {
            let mut eps = self.endpoints.locked();
            let keys: Vec<EpKey> = eps
                .iter()
                .filter_map(|(k, s)| match s {
                    Slot::Ready(ep)
                        if k.local_dev == dev.index && ep.is_idle(self.idle_timeout) =>
                    {
                        Some(k.clone())
                    }
                    _ => None,
                })
                .collect();
            let idle: Vec<Arc<Endpoint>> = keys
                .iter()
                .filter_map(|k| match eps.remove(k) {
                    Some(Slot::Ready(ep)) => Some(ep),
                    _ => None,
                })
                .collect();
            let mut forgotten = Vec::new();
            self.replaced.locked().retain(|k, id| {
                let keep = k.local_dev != dev.index || eps.contains_key(k);
                if !keep {
                    forgotten.push((k.peer.clone(), *id));
                }
                keep
            });
            (idle, forgotten)
        };
        if idle.is_empty() && forgotten.is_empty() {
            return;
        }
        let mut by_peer: HashMap<String, Vec<u64>> = HashMap::new();
        for ep in &idle {
            // a dispatch that took the endpoint before it left the cache re-dispatches
            if let Some(pending) = ep.mark_broken(&EndpointFailure::Idle) {
                if !pending.is_empty() {
                    self.dispatch(pending);
                }
            }
            by_peer.entry(ep.key.peer.clone()).or_default().push(ep.id);
        }
        for (peer, id) in forgotten {
            by_peer.entry(peer).or_default().push(id);
        }
        tracing::debug!(device = %dev.info.name, endpoints = idle.len(), "RDMA endpoints idle: dropped");
        drop(idle);
        for (peer, ids) in by_peer {
            let notice = CloseNotice {
                version: connect::CONNECT_VERSION,
                initiator: self.segment_name.clone(),
                close: ids,
            };
            let Ok(body) = serde_json::to_vec(&notice) else {
                continue;
            };
            let (timeout, cred) = (self.handshake_timeout, self.credential.clone());
            let spawned = std::thread::Builder::new()
                .name("kvferry-rdma-close".into())
                .spawn(move || {
                    let r = handshake::request_with(
                        &peer,
                        FrameType::Connect,
                        &body,
                        timeout,
                        cred.as_ref(),
                    );
                    if let Err(e) = r {
                        tracing::debug!(%peer, "RDMA close notice not delivered: {e}");
                    }
                });
            if let Err(e) = spawned {
                tracing::debug!("cannot spawn an RDMA close thread: {e}");
            }
        }
    }
}
