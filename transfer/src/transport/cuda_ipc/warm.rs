//! The warm-up (initiator side): when a peer's segment is opened, its allocations that posts
//! from this engine's devices would copy through are imported at once, so that no post pays
//! the handle request and the mapping (milliseconds for the first one of a peer; the posts in
//! flight beside it wait for it). What the warm-up does not map (its request failed, the peer
//! published no keys yet) the first post imports as before.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use super::keys::{IpcRegionKeys, Route};
use super::transport::{CudaIpcTransport, Decoded};
use crate::descriptor::SegmentDescriptor;
use crate::error::Result;
use crate::memory::MemoryRegion;
use crate::sync::MutexExt;
use crate::types::Location;

/// One local device's share of a warm-up: the keys of the allocations it imports (each once).
pub(super) type WarmPart = (u32, Vec<Arc<IpcRegionKeys>>);

/// What a warm-up imports: for each of this engine's `devices` (ascending), each allocation of
/// the peer's `buffers` (its region and decoded keys) from which `route_of(device, buffer
/// index)` takes CUDA IPC or an in-process copy, once, unless `known(device, base)` (already
/// mapped for that device, or failed there, for this peer instance). Every device that reaches
/// an allocation maps it for itself: a mapping gives access to the device it was made for
/// only. Devices with nothing to import are left out; so are buffers without keys or that
/// route nowhere but the fallback.
pub(super) fn warm_plan(
    devices: &[u32],
    buffers: &[(MemoryRegion, Decoded)],
    route_of: impl Fn(u32, usize) -> Route,
    known: impl Fn(u32, u64) -> bool,
) -> Vec<WarmPart> {
    let mut devices = devices.to_vec();
    devices.sort_unstable();
    devices.dedup();
    let mut plan: Vec<WarmPart> = Vec::new();
    for dev in devices {
        let mut seen: HashSet<u64> = HashSet::new();
        let mut keys: Vec<Arc<IpcRegionKeys>> = Vec::new();
        for (i, (_, k)) in buffers.iter().enumerate() {
            let Some(Ok(k)) = k else { continue };
            if seen.contains(&k.alloc_base) || known(dev, k.alloc_base) {
                continue;
            }
            if matches!(route_of(dev, i), Route::Ipc | Route::InProcess) {
                seen.insert(k.alloc_base);
                keys.push(k.clone());
            }
        }
        if !keys.is_empty() {
            plan.push((dev, keys));
        }
    }
    plan
}

impl CudaIpcTransport {
    /// Imports the allocations of `peer` that posts from this engine's devices would copy
    /// through and that are not mapped yet ([`warm_plan`]): one handle request per local
    /// device, all of them within one handshake timeout from the call (the turn behind
    /// another import, the requests and the descriptor reads end at it). Returns how many
    /// allocations were asked for. Errors: the first request that failed, or `Timeout` at the
    /// deadline; what it left unmapped is not failed: the first post that needs it asks again.
    pub(super) fn warm(&self, peer: &Arc<SegmentDescriptor>) -> Result<usize> {
        let by = Instant::now() + self.handshake_timeout;
        let devices: Vec<u32> = self.devices.locked().clone();
        if devices.is_empty() || peer.buffers.is_empty() {
            return Ok(0);
        }
        let buffers: Vec<(MemoryRegion, Decoded)> = peer
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| (b.region, self.keys_of(peer, Some(peer), i)))
            .collect();
        let known: HashSet<(u32, u64)> = {
            let peers = self.peers.locked();
            peers
                .get(&peer.name)
                .filter(|p| p.instance_id == peer.instance_id)
                .map(|p| p.mapped.keys().chain(&p.failed).copied().collect())
                .unwrap_or_default()
        };
        let plan = warm_plan(
            &devices,
            &buffers,
            |d, i| {
                // The route depends on the local side's device only.
                let local = MemoryRegion {
                    addr: 0,
                    len: 0,
                    location: Location::Cuda(d),
                };
                self.route_of(peer, &local, i, &buffers[i].1)
            },
            |dev, base| known.contains(&(dev, base)),
        );
        self.warm_parts(peer, &plan, by)
    }

    /// Imports `plan`'s parts in order, every wait ending by `by`; stops at the first that
    /// fails. Returns how many allocations were asked for. Errors as [`Self::warm`].
    pub(super) fn warm_parts(
        &self,
        peer: &SegmentDescriptor,
        plan: &[WarmPart],
        by: Instant,
    ) -> Result<usize> {
        let t0 = Instant::now();
        let mut asked = 0;
        for (dev, keys) in plan {
            let keys: Vec<&IpcRegionKeys> = keys.iter().map(|k| &**k).collect();
            self.import(peer, &keys, *dev, Some(by))?;
            asked += keys.len();
        }
        tracing::debug!(
            target: "kvferry::timing",
            segment = %peer.name,
            allocs = asked,
            warm_us = t0.elapsed().as_micros() as u64,
            "cuda ipc warm-up"
        );
        Ok(asked)
    }
}

#[cfg(test)]
mod tests {
    use super::super::keys::{route, FallbackWhy, HostIdentity};
    use super::*;
    use kvferry_cuda::ipc::AllocationKind;

    fn id(pid: u32) -> HostIdentity {
        HostIdentity {
            boot_id: "b".into(),
            machine_id: "m".into(),
            pid_ns: "pid:[1]".into(),
            pid,
        }
    }

    fn buffer(addr: u64, dev: u32, base: u64, host: HostIdentity) -> (MemoryRegion, Decoded) {
        let region = MemoryRegion {
            addr,
            len: 0x100,
            location: Location::Cuda(dev),
        };
        let keys = IpcRegionKeys {
            host,
            device_uuid: format!("{dev:032x}"),
            alloc_base: base,
            alloc_size: 0x10000,
            kind: AllocationKind::Legacy,
        };
        (region, Some(Ok(Arc::new(keys))))
    }

    /// The route as the transport decides it, from `me`, with peer access only from device
    /// 0 to any device and between equal devices.
    fn route_from<'a>(
        me: &'a HostIdentity,
        buffers: &'a [(MemoryRegion, Decoded)],
    ) -> impl Fn(u32, usize) -> Route + 'a {
        move |d, i| {
            let (remote, k) = &buffers[i];
            let local = MemoryRegion {
                addr: 0,
                len: 0,
                location: Location::Cuda(d),
            };
            let keys = k.as_ref().map(|r| r.as_deref().map_err(|_| ()));
            route(
                Some(me),
                &local,
                remote,
                keys,
                |a, b| a == 0 || a == b,
                false,
                true,
            )
        }
    }

    fn bases(plan: &[WarmPart]) -> Vec<(u32, Vec<u64>)> {
        plan.iter()
            .map(|(d, ks)| (*d, ks.iter().map(|k| k.alloc_base).collect()))
            .collect()
    }

    #[test]
    fn each_allocation_of_a_peer_on_this_host_is_imported_once() {
        let me = id(1);
        // Two regions in one allocation, a third in another.
        let buffers = vec![
            buffer(0x10000, 0, 0x10000, id(2)),
            buffer(0x10800, 0, 0x10000, id(2)),
            buffer(0x40000, 0, 0x40000, id(2)),
        ];
        let plan = warm_plan(&[0], &buffers, route_from(&me, &buffers), |_, _| false);
        assert_eq!(bases(&plan), vec![(0, vec![0x10000, 0x40000])]);
    }

    #[test]
    fn allocations_already_mapped_or_failed_are_not_asked_for_again() {
        let me = id(1);
        let buffers = vec![
            buffer(0x10000, 0, 0x10000, id(2)),
            buffer(0x40000, 0, 0x40000, id(2)),
        ];
        let plan = warm_plan(&[0], &buffers, route_from(&me, &buffers), |_, b| {
            b == 0x10000
        });
        assert_eq!(bases(&plan), vec![(0, vec![0x40000])]);
        assert!(warm_plan(&[0], &buffers, route_from(&me, &buffers), |_, _| true).is_empty());
    }

    #[test]
    fn peers_on_another_host_without_keys_or_with_bad_keys_are_left_to_their_transport() {
        let me = id(1);
        let mut other = id(2);
        other.boot_id = "another boot".into();
        let mut no_keys = buffer(0x50000, 0, 0x50000, id(2));
        no_keys.1 = None;
        let mut bad_keys = buffer(0x60000, 0, 0x60000, id(2));
        bad_keys.1 = Some(Err(()));
        let host_memory = (
            MemoryRegion {
                addr: 0x70000,
                len: 0x100,
                location: Location::Cpu,
            },
            buffer(0x70000, 0, 0x70000, id(2)).1,
        );
        let buffers = vec![
            buffer(0x10000, 0, 0x10000, other),
            no_keys,
            bad_keys,
            host_memory,
        ];
        assert_eq!(
            route_from(&me, &buffers)(0, 0),
            Route::Fallback(FallbackWhy::OtherHost)
        );
        assert!(warm_plan(&[0], &buffers, route_from(&me, &buffers), |_, _| false).is_empty());
    }

    #[test]
    fn an_engine_without_device_memory_imports_nothing() {
        let me = id(1);
        let buffers = vec![buffer(0x10000, 0, 0x10000, id(2))];
        assert!(warm_plan(&[], &buffers, route_from(&me, &buffers), |_, _| false).is_empty());
    }

    /// A mapping serves the device it was made for only: each device maps what it reaches
    /// (here device 0 reaches every device, device 1 only itself), and what one device has
    /// mapped is not known to another.
    #[test]
    fn each_device_imports_what_it_reaches_for_itself() {
        let me = id(1);
        let buffers = vec![
            buffer(0x10000, 1, 0x10000, id(2)),
            buffer(0x40000, 2, 0x40000, id(2)),
        ];
        let plan = warm_plan(&[1, 0, 1], &buffers, route_from(&me, &buffers), |_, _| {
            false
        });
        assert_eq!(
            bases(&plan),
            vec![(0, vec![0x10000, 0x40000]), (1, vec![0x10000])]
        );
        // Device 0 mapped both: device 1 still maps its own.
        let plan = warm_plan(&[0, 1], &buffers, route_from(&me, &buffers), |d, _| d == 0);
        assert_eq!(bases(&plan), vec![(1, vec![0x10000])]);
        // Without device 0, device 1 takes what it reaches and the rest is left.
        let plan = warm_plan(&[1], &buffers, route_from(&me, &buffers), |_, _| false);
        assert_eq!(bases(&plan), vec![(1, vec![0x10000])]);
    }

    #[test]
    fn a_peer_in_this_process_is_warmed_too() {
        // Its import fetches only the live table, which the first post would wait for.
        let me = id(1);
        let buffers = vec![buffer(0x10000, 0, 0x10000, id(1))];
        let plan = warm_plan(&[0], &buffers, route_from(&me, &buffers), |_, _| false);
        assert_eq!(bases(&plan), vec![(0, vec![0x10000])]);
    }
}
