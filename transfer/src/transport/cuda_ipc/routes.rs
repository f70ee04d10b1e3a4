//! Which path a pair of regions takes, and the peer's keys it takes it with, remembered: a
//! submit asks for a pair's route twice (its slice size, then its post) and the next submit
//! of the pair again, and deciding it reads the peer's JSON keys, the peers' failed imports
//! and the devices' peer access.

use std::collections::HashMap;
use std::sync::Arc;

use kvferry_cuda::ipc;

use super::keys::{route, IpcRegionKeys, Route};
use super::transport::{
    CudaIpcTransport, Decoded, RouteMemo, DECODED_KEPT, KEYS_FIELD, ROUTES_KEPT,
};
use crate::descriptor::SegmentDescriptor;
use crate::memory::MemoryRegion;
use crate::sync::MutexExt;
use crate::types::Location;

/// The CUDA IPC keys of the peer's buffer `i`: `None` when it publishes none, `Some(Err)` when
/// they do not decode.
pub(super) fn decode_keys(peer: &SegmentDescriptor, i: usize) -> Decoded {
    let v = peer.buffers.get(i)?.keys.transport.get(KEYS_FIELD)?;
    Some(
        serde_json::from_value::<IpcRegionKeys>(v.clone())
            .map(Arc::new)
            .map_err(|_| ()),
    )
}

impl CudaIpcTransport {
    /// `decode_keys(peer, i)`, remembered per descriptor: `held` (the descriptor's `Arc`, when
    /// the caller has it) lets a descriptor seen for the first time be remembered.
    pub(super) fn keys_of(
        &self,
        peer: &SegmentDescriptor,
        held: Option<&Arc<SegmentDescriptor>>,
        i: usize,
    ) -> Decoded {
        let at = peer as *const SegmentDescriptor as usize;
        let mut cache = self.decoded.locked();
        if let Some((_, m)) = cache.get(&at) {
            if let Some(k) = m.get(&i) {
                return k.clone();
            }
        }
        let k = decode_keys(peer, i);
        if !cache.contains_key(&at) {
            let Some(a) = held else { return k };
            // Entries of descriptors gone are dropped; past the bound, all.
            cache.retain(|_, (w, _)| w.strong_count() > 0);
            if cache.len() >= DECODED_KEPT {
                cache.clear();
            }
            cache.insert(at, (Arc::downgrade(a), HashMap::new()));
        }
        if let Some((_, m)) = cache.get_mut(&at) {
            if m.len() < peer.buffers.len() {
                m.insert(i, k.clone());
            }
        }
        k
    }

    /// The route of a slice between `local` and the peer's buffer `remote_buffer`, with that
    /// buffer's keys: remembered per pair until the peer's state changes (`route_epoch`), so
    /// that a submit's slice size and its post, and later submits of the pair, decide it
    /// once. `held`: the descriptor's `Arc`, when the caller has it (a pair is remembered only
    /// for a descriptor known alive by a `Weak`).
    pub(super) fn route_keys(
        &self,
        peer: &SegmentDescriptor,
        held: Option<&Arc<SegmentDescriptor>>,
        local: &MemoryRegion,
        remote_buffer: usize,
    ) -> (Route, Decoded) {
        use std::sync::atomic::Ordering;
        let at = peer as *const SegmentDescriptor;
        let epoch = self.route_epoch.load(Ordering::Acquire);
        {
            let memo = self.routes.locked();
            // A live `Weak` to `at`: the descriptor there is the one remembered (two live
            // values never share an address).
            if let Some(m) = memo
                .iter()
                .rev()
                .find(|m| m.desc.as_ptr() == at && m.local == *local && m.buffer == remote_buffer)
            {
                if m.epoch == epoch && m.desc.strong_count() > 0 {
                    return (m.route.clone(), m.keys.clone());
                }
            }
        }
        let keys = self.keys_of(peer, held, remote_buffer);
        let route = self.route_of(peer, local, remote_buffer, &keys);
        let desc = match held {
            Some(a) => Some(Arc::downgrade(a)),
            None => self.decoded_weak(peer),
        };
        if let Some(desc) = desc {
            let mut memo = self.routes.locked();
            memo.retain(|m| {
                m.desc.strong_count() > 0
                    && !(m.desc.as_ptr() == at && m.local == *local && m.buffer == remote_buffer)
            });
            if memo.len() >= ROUTES_KEPT {
                memo.remove(0);
            }
            memo.push(RouteMemo {
                desc,
                local: *local,
                buffer: remote_buffer,
                epoch,
                route: route.clone(),
                keys: keys.clone(),
            });
        }
        (route, keys)
    }

    /// The `Weak` the keys' memory holds of `peer` (`keys_of`), if it is alive.
    fn decoded_weak(&self, peer: &SegmentDescriptor) -> Option<std::sync::Weak<SegmentDescriptor>> {
        let at = peer as *const SegmentDescriptor as usize;
        self.decoded
            .locked()
            .get(&at)
            .map(|(w, _)| w.clone())
            .filter(|w| w.strong_count() > 0 && std::ptr::eq(w.as_ptr(), peer))
    }

    /// Says that a peer's failed imports or the peers held changed: remembered routes are
    /// decided again. Called with the peers' lock held or right after the change.
    pub(super) fn routes_changed(&self) {
        self.route_epoch
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Whether local device `a` can access the device of `uuid` (remembered).
    fn peer_access(&self, a: u32, uuid: &str) -> bool {
        if let Some(&ok) = self.access.locked().get(&a).and_then(|m| m.get(uuid)) {
            return ok;
        }
        let ok = kvferry_cuda::guarded("peer access", || {
            Ok(match ipc::ordinal_of_uuid(uuid) {
                Some(b) => ipc::can_access_peer(a, b).unwrap_or(false),
                None => false,
            })
        })
        .unwrap_or(false);
        let mut m = self.access.locked();
        if m.values().map(HashMap::len).sum::<usize>() >= DECODED_KEPT {
            m.clear();
        }
        m.entry(a).or_default().insert(uuid.to_string(), ok);
        ok
    }

    /// The route of a slice between `local` and the peer's buffer `remote_buffer` whose keys
    /// decoded to `k`.
    pub(super) fn route_of(
        &self,
        peer: &SegmentDescriptor,
        local: &MemoryRegion,
        remote_buffer: usize,
        k: &Decoded,
    ) -> Route {
        let Some(buffer) = peer.buffers.get(remote_buffer) else {
            return Route::Fallback(super::keys::FallbackWhy::NotExported);
        };
        let failed = match (k, local.location) {
            (Some(Ok(k)), Location::Cuda(d)) => {
                self.peers.locked().get(&peer.name).is_some_and(|p| {
                    p.instance_id == peer.instance_id && p.failed.contains(&(d, k.alloc_base))
                })
            }
            _ => false,
        };
        route(
            self.me.as_ref(),
            local,
            &buffer.region,
            k.as_ref().map(|r| r.as_deref().map_err(|_| ())),
            |a, _| match k.as_ref() {
                Some(Ok(k)) => self.peer_access(a, &k.device_uuid),
                _ => false,
            },
            failed,
            super::keys::OwnEngines::contains(&peer.name, peer.instance_id),
        )
    }
}
