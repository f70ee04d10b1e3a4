//! What a region exported for CUDA IPC publishes, the host identity that says two segments
//! share a host, and the route decision for one slice (pure: tested without a GPU).

use serde::{Deserialize, Serialize};

use kvferry_cuda::ipc::AllocationKind;

use crate::memory::MemoryRegion;
use crate::types::Location;

/// Which machine and which process a segment runs in. Two segments share a host when boot id
/// and machine id are equal (a container with its own machine id counts as another host: its
/// driver view may differ); the import succeeding is the final confirmation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`: changes at every boot.
    pub boot_id: String,
    /// `/etc/machine-id` (empty where the file is absent).
    pub machine_id: String,
    /// The pid namespace (`/proc/self/ns/pid` link text): equal namespaces make `pid`
    /// comparable, which tells the same process and a dead peer apart.
    pub pid_ns: String,
    /// The process id in that namespace.
    pub pid: u32,
}

impl HostIdentity {
    /// This process's identity, or `None` where the boot id cannot be read (not Linux, no
    /// /proc): then no region is offered over CUDA IPC.
    pub fn local() -> Option<HostIdentity> {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .ok()
                .map(|s| s.trim().to_string())
        };
        let boot_id = read("/proc/sys/kernel/random/boot_id").filter(|s| !s.is_empty())?;
        Some(HostIdentity {
            boot_id,
            machine_id: read("/etc/machine-id").unwrap_or_default(),
            pid_ns: std::fs::read_link("/proc/self/ns/pid")
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
            pid: std::process::id(),
        })
    }

    /// Whether `other` runs on the same host.
    pub fn same_host(&self, other: &HostIdentity) -> bool {
        self.boot_id == other.boot_id && self.machine_id == other.machine_id
    }

    /// Whether `other` is this very process (then its device addresses are ours).
    pub fn same_process(&self, other: &HostIdentity) -> bool {
        self.same_host(other)
            && !self.pid_ns.is_empty()
            && self.pid_ns == other.pid_ns
            && self.pid == other.pid
    }
}

/// The CUDA IPC facts of one exported `cuda:N` region, published under `cuda_ipc` in the
/// region's keys (beside the fallback transport's own keys). No handle is published: handles
/// go only to peers that ask in a `Connect` frame (with the secret's proof in authenticated
/// mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcRegionKeys {
    /// The exporting process.
    pub host: HostIdentity,
    /// The device's UUID (16 bytes as hex), so a peer maps it to its own ordinal.
    pub device_uuid: String,
    /// Base device address of the allocation holding the region (in the exporter's process).
    pub alloc_base: u64,
    /// Bytes of that allocation.
    pub alloc_size: u64,
    /// Legacy IPC handle or file descriptor.
    pub kind: AllocationKind,
}

impl IpcRegionKeys {
    /// Whether `region` lies inside the published allocation (a peer's keys are checked before
    /// anything is mapped from them).
    pub fn covers(&self, region: &MemoryRegion) -> bool {
        within(self.alloc_base, self.alloc_size, region.addr, region.len)
    }
}

/// Whether `[addr, addr + len)` lies inside `[start, start + size)`, where either end may lie
/// past `u64::MAX` (then: no). Every bound of a peer's ranges here is this one check: its keys'
/// allocation, its live regions, the allocation as mapped here.
pub(super) fn within(start: u64, size: u64, addr: u64, len: u64) -> bool {
    addr >= start
        && addr
            .checked_add(len)
            .zip(start.checked_add(size))
            .is_some_and(|(e, end)| e <= end)
}

/// The transfer engines of this process, by segment name and instance id. A peer's host
/// identity is what its descriptor says, and another process on the host can copy this
/// process's (boot id, pid): only a descriptor fetched from one of these engines (its name is
/// the address dialled, its instance id this engine's random one) is taken as this process.
pub struct OwnEngines;

static OWN_ENGINES: std::sync::Mutex<Vec<(String, u64)>> = std::sync::Mutex::new(Vec::new());

impl OwnEngines {
    /// Notes the engine `(segment_name, instance_id)` of this process (at its transport's
    /// creation); [`OwnEngines::remove`] forgets it.
    pub fn add(segment_name: &str, instance_id: u64) {
        use crate::sync::MutexExt;
        OWN_ENGINES
            .locked()
            .push((segment_name.to_string(), instance_id));
    }

    /// Forgets one note of `(segment_name, instance_id)`.
    pub fn remove(segment_name: &str, instance_id: u64) {
        use crate::sync::MutexExt;
        let mut v = OWN_ENGINES.locked();
        if let Some(i) = v
            .iter()
            .position(|(n, id)| *id == instance_id && n == segment_name)
        {
            v.swap_remove(i);
        }
    }

    /// Whether the peer named `segment_name` with `instance_id` is an engine of this process.
    pub fn contains(segment_name: &str, instance_id: u64) -> bool {
        use crate::sync::MutexExt;
        OWN_ENGINES
            .locked()
            .iter()
            .any(|(n, id)| *id == instance_id && n == segment_name)
    }
}

/// How one slice moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Device copy inside this process (both regions are ours).
    InProcess,
    /// Device copy through the peer's allocation mapped here.
    Ipc,
    /// The fallback transport (TCP or RDMA), and why.
    Fallback(FallbackWhy),
}

/// Why a slice does not take CUDA IPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackWhy {
    /// One side is host memory.
    HostMemory,
    /// The peer's region was not exported (no `cuda_ipc` keys).
    NotExported,
    /// The peer's keys are malformed or do not cover its region.
    BadKeys,
    /// The peer runs on another host.
    OtherHost,
    /// This process has no host identity (no /proc).
    NoIdentity,
    /// The two devices cannot access each other (`cuDeviceCanAccessPeer`).
    NoPeerAccess,
    /// Importing the peer's allocation failed before.
    ImportFailed,
    /// The peer's keys name this process, but the peer is none of this process's engines.
    ForgedIdentity,
}

impl std::fmt::Display for FallbackWhy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FallbackWhy::HostMemory => "one side is host memory",
            FallbackWhy::NotExported => "the peer's region is not exported for CUDA IPC",
            FallbackWhy::BadKeys => "the peer's CUDA IPC keys are malformed",
            FallbackWhy::OtherHost => "the peer runs on another host",
            FallbackWhy::NoIdentity => "this process has no host identity",
            FallbackWhy::NoPeerAccess => "the two GPUs cannot access each other",
            FallbackWhy::ImportFailed => "importing the peer's allocation failed",
            FallbackWhy::ForgedIdentity => {
                "the peer's keys claim this process, but it is none of its engines"
            }
        })
    }
}

/// The route of a slice between `local` (this engine's region) and the peer's region
/// `remote` with its published `remote_keys` (`None`: not exported; `Some(Err)`: keys that do
/// not decode). `me`: this process's identity. `peer_access(a, b)`: whether device `a` here can
/// access device `b` (given as the peer region's location ordinal after mapping by UUID;
/// callers pass `true` for one device). `import_failed`: an earlier import of that
/// allocation failed. `own_engine`: the peer is one of this process's own engines (its
/// segment name and instance id registered here, [`OwnEngines`]); only then does a peer whose
/// keys name this process take the in-process copy, since identities are the peer's word.
pub fn route(
    me: Option<&HostIdentity>,
    local: &MemoryRegion,
    remote: &MemoryRegion,
    remote_keys: Option<Result<&IpcRegionKeys, ()>>,
    peer_access: impl FnOnce(u32, u32) -> bool,
    import_failed: bool,
    own_engine: bool,
) -> Route {
    let (Location::Cuda(a), Location::Cuda(b)) = (local.location, remote.location) else {
        return Route::Fallback(FallbackWhy::HostMemory);
    };
    let keys = match remote_keys {
        None => return Route::Fallback(FallbackWhy::NotExported),
        Some(Err(())) => return Route::Fallback(FallbackWhy::BadKeys),
        Some(Ok(k)) => k,
    };
    if !keys.covers(remote) {
        return Route::Fallback(FallbackWhy::BadKeys);
    }
    let Some(me) = me else {
        return Route::Fallback(FallbackWhy::NoIdentity);
    };
    if !me.same_host(&keys.host) {
        return Route::Fallback(FallbackWhy::OtherHost);
    }
    if !peer_access(a, b) {
        return Route::Fallback(FallbackWhy::NoPeerAccess);
    }
    if me.same_process(&keys.host) {
        if !own_engine {
            return Route::Fallback(FallbackWhy::ForgedIdentity);
        }
        return Route::InProcess;
    }
    if import_failed {
        return Route::Fallback(FallbackWhy::ImportFailed);
    }
    Route::Ipc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(boot: &str, pid: u32) -> HostIdentity {
        HostIdentity {
            boot_id: boot.into(),
            machine_id: "m".into(),
            pid_ns: "pid:[1]".into(),
            pid,
        }
    }
    fn region(addr: u64, location: Location) -> MemoryRegion {
        MemoryRegion {
            addr,
            len: 100,
            location,
        }
    }
    /// The route from `me` between two regions at 0x1000 on device 0, the peer's keys `k`,
    /// peer access granted.
    fn on_gpu(me: &HostIdentity, k: &IpcRegionKeys, import_failed: bool, own: bool) -> Route {
        let gpu = region(0x1000, Location::Cuda(0));
        route(
            Some(me),
            &gpu,
            &gpu,
            Some(Ok(k)),
            |_, _| true,
            import_failed,
            own,
        )
    }
    fn keys(host: HostIdentity) -> IpcRegionKeys {
        IpcRegionKeys {
            host,
            device_uuid: "00".repeat(16),
            alloc_base: 0x1000,
            alloc_size: 0x1000,
            kind: AllocationKind::Legacy,
        }
    }

    #[test]
    fn device_memory_on_one_host_takes_ipc_else_says_why_not() {
        let me = id("b", 1);
        let gpu = region(0x1000, Location::Cuda(0));
        let k = keys(id("b", 2));
        let r =
            |local: &MemoryRegion, remote: &MemoryRegion, k: Option<Result<&IpcRegionKeys, ()>>| {
                route(Some(&me), local, remote, k, |_, _| true, false, false)
            };
        assert_eq!(r(&gpu, &gpu, Some(Ok(&k))), Route::Ipc);
        let host = region(0x1000, Location::Cpu);
        assert_eq!(
            r(&host, &gpu, Some(Ok(&k))),
            Route::Fallback(FallbackWhy::HostMemory)
        );
        assert_eq!(
            r(&gpu, &host, Some(Ok(&k))),
            Route::Fallback(FallbackWhy::HostMemory)
        );
        assert_eq!(
            r(&gpu, &gpu, None),
            Route::Fallback(FallbackWhy::NotExported)
        );
        assert_eq!(
            r(&gpu, &gpu, Some(Err(()))),
            Route::Fallback(FallbackWhy::BadKeys)
        );
        let other = keys(id("other boot", 2));
        assert_eq!(
            r(&gpu, &gpu, Some(Ok(&other))),
            Route::Fallback(FallbackWhy::OtherHost)
        );
        let mut other_machine = keys(id("b", 2));
        other_machine.host.machine_id = "container".into();
        assert_eq!(
            r(&gpu, &gpu, Some(Ok(&other_machine))),
            Route::Fallback(FallbackWhy::OtherHost)
        );
        assert_eq!(
            route(None, &gpu, &gpu, Some(Ok(&k)), |_, _| true, false, false),
            Route::Fallback(FallbackWhy::NoIdentity)
        );
    }

    #[test]
    fn keys_that_do_not_cover_the_peers_region_are_refused() {
        let me = id("b", 1);
        let k = keys(id("b", 2));
        // the allocation is [0x1000, 0x2000): a region reaching past it is not covered
        let past = region(0x1f9d, Location::Cuda(0));
        assert_eq!(
            route(
                Some(&me),
                &past,
                &past,
                Some(Ok(&k)),
                |_, _| true,
                false,
                false
            ),
            Route::Fallback(FallbackWhy::BadKeys)
        );
        let mut wrap = k.clone();
        wrap.alloc_base = u64::MAX - 10;
        assert!(!wrap.covers(&region(u64::MAX - 5, Location::Cuda(0))));
    }

    #[test]
    fn the_same_process_copies_in_place_and_a_failed_import_falls_back() {
        let me = id("b", 1);
        let mine = keys(id("b", 1));
        assert_eq!(on_gpu(&me, &mine, true, true), Route::InProcess);
        // another pid namespace: never taken for this process even with an equal pid
        let mut ns = keys(id("b", 1));
        ns.host.pid_ns = "pid:[2]".into();
        assert_eq!(on_gpu(&me, &ns, false, false), Route::Ipc);
        let theirs = keys(id("b", 2));
        assert_eq!(
            on_gpu(&me, &theirs, true, false),
            Route::Fallback(FallbackWhy::ImportFailed)
        );
    }

    /// Another process on the host can copy this process's identity into its keys (boot id,
    /// machine id and pid are readable): without being one of this process's engines it
    /// never gets the in-process copy, which would take its addresses as ours.
    #[test]
    fn a_peer_claiming_this_process_is_refused_unless_it_is_one_of_its_engines() {
        let me = id("b", 1);
        let claimed = keys(id("b", 1));
        assert_eq!(
            on_gpu(&me, &claimed, false, false),
            Route::Fallback(FallbackWhy::ForgedIdentity)
        );
        assert_eq!(on_gpu(&me, &claimed, false, true), Route::InProcess);
    }

    #[test]
    fn this_processs_engines_are_known_by_name_and_instance() {
        OwnEngines::add("10.0.0.9:4000", 77);
        assert!(OwnEngines::contains("10.0.0.9:4000", 77));
        assert!(!OwnEngines::contains("10.0.0.9:4001", 77), "another name");
        assert!(
            !OwnEngines::contains("10.0.0.9:4000", 78),
            "another instance"
        );
        OwnEngines::remove("10.0.0.9:4000", 77);
        assert!(!OwnEngines::contains("10.0.0.9:4000", 77));
    }

    #[test]
    fn devices_without_peer_access_are_refused_with_the_pair() {
        let me = id("b", 1);
        let k = keys(id("b", 2));
        let mut asked = None;
        let r = route(
            Some(&me),
            &region(0x1000, Location::Cuda(1)),
            &region(0x1000, Location::Cuda(3)),
            Some(Ok(&k)),
            |a, b| {
                asked = Some((a, b));
                false
            },
            false,
            false,
        );
        assert_eq!(r, Route::Fallback(FallbackWhy::NoPeerAccess));
        assert_eq!(asked, Some((1, 3)));
    }

    #[test]
    fn keys_round_trip_as_json() {
        let k = keys(id("b", 2));
        let v = serde_json::to_value(&k).unwrap();
        assert_eq!(v["kind"], "legacy");
        let back: IpcRegionKeys = serde_json::from_value(v).unwrap();
        assert_eq!(back, k);
        let mut v = serde_json::to_value(&k).unwrap();
        v.as_object_mut().unwrap().remove("alloc_size");
        assert!(serde_json::from_value::<IpcRegionKeys>(v).is_err());
    }
}
