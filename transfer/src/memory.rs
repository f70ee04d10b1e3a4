//! Memory regions: the registry of what this engine exposes, and access to non-host memory
//! (docs/design.md §3: "register_memory(addr, len, location)"; only registered memory is ever
//! read or written by a peer).

use crate::sync::RwLockExt;
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};

use crate::error::{
    ArgumentError, ConfigError, RegistrationError, Result, TransferError, UnsupportedError,
};
use crate::types::Location;

/// A registered range of memory: `len` bytes from virtual address `addr` of this process,
/// living at `location` (device pointers for `cuda:N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryRegion {
    /// Start: a virtual address of this process (a device pointer for `cuda:N`).
    pub addr: u64,
    /// Length in bytes (non-zero once registered).
    pub len: u64,
    /// Where the bytes live: host memory or a CUDA device.
    pub location: Location,
}

impl MemoryRegion {
    /// One past the last byte (`addr + len`; registration guarantees no overflow).
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    /// True when `[addr, addr+len)` lies wholly inside this region (`len` may be 0).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.end())
    }
}

/// How a transport made a registered region reachable by peers (docs/design.md §3 "GPU memory":
/// dma-buf, else peer memory, else staging through pinned host buffers). The engine reports it
/// per region (`TransferEngine::region_path`) and publishes it in the segment descriptor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RegistrationPath {
    /// Host memory used in place (RDMA: `ibv_reg_mr` of the range; TCP: read and written
    /// directly).
    #[default]
    Host,
    /// GPU memory registered with the NIC from a dma-buf (`cuMemGetHandleForAddressRange` →
    /// `ibv_reg_dmabuf_mr`): GPUDirect RDMA.
    DmaBuf,
    /// GPU memory registered with plain `ibv_reg_mr` (the nvidia-peermem kernel module):
    /// GPUDirect RDMA.
    PeerMemory,
    /// GPU memory moved through pinned host memory with device copies. TCP: every slice is
    /// copied through pinned staging buffers. RDMA (when the NIC cannot register the GPU
    /// range): work requests use a pinned host mirror of the region, which is copied from the
    /// device before it is read and to the device after it is written.
    Staged,
}

impl std::fmt::Display for RegistrationPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RegistrationPath::Host => "host",
            RegistrationPath::DmaBuf => "dma-buf",
            RegistrationPath::PeerMemory => "peer-memory",
            RegistrationPath::Staged => "staged",
        })
    }
}

/// What a transport hands out for one registered region, published to peers in the segment
/// descriptor as `{"path": ..., <the transport's own keys>}` (docs/design.md §3.2). The engine
/// reads only `path`; the rest belongs to the transport that made it ([`TransportKeys`]):
/// RDMA puts its rkeys and staging mirror there (`rdma::RdmaRegionKeys`), TCP nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionKeys {
    /// How the region was registered (absent in a descriptor: `host`).
    #[serde(default)]
    pub path: RegistrationPath,
    /// The transport's keys for the region, opaque to the engine.
    #[serde(flatten)]
    pub transport: TransportKeys,
}

impl RegionKeys {
    /// Keys of a region registered on `path` with the transport's own `transport` keys.
    pub fn new(path: RegistrationPath, transport: TransportKeys) -> Self {
        RegionKeys { path, transport }
    }
}

/// A transport's own keys for one region: a JSON object only that transport reads, encoded
/// from and decoded into its typed value (RDMA: `{"rkeys": [u32...], "staging_addr": u64?}`).
/// Empty for transports that need no keys (TCP).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TransportKeys(serde_json::Map<String, serde_json::Value>);

impl TransportKeys {
    /// No keys (TCP).
    pub fn none() -> Self {
        Self::default()
    }

    /// Encodes a transport's typed keys. `keys` must serialize to a JSON object whose fields
    /// do not include `path` (the engine's own); anything else is a `Config` error (a bug of
    /// the transport, reported rather than published).
    pub fn encode<T: Serialize>(keys: &T) -> Result<Self> {
        match serde_json::to_value(keys) {
            Ok(serde_json::Value::Object(map)) if !map.contains_key("path") => {
                Ok(TransportKeys(map))
            }
            Ok(other) => Err(TransferError::Config(ConfigError::KeysShape {
                got: Box::new(other),
            })),
            Err(e) => Err(TransferError::Config(ConfigError::KeysEncode {
                transport: "transport",
                source: Arc::new(e),
            })),
        }
    }

    /// Decodes a peer's keys into the transport's typed keys. Errors: serde's, naming the
    /// missing or bad field (e.g. "missing field `rkeys`"), for the transport to wrap with the
    /// segment's name; nothing is defaulted that the type does not default itself.
    pub fn decode<T: serde::de::DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_value(serde_json::Value::Object(self.0.clone()))
    }

    /// True when the transport published no keys.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// One field of the keys (a wrapping transport's own, e.g. CUDA IPC's `cuda_ipc`).
    pub fn get(&self, field: &str) -> Option<&serde_json::Value> {
        self.0.get(field)
    }

    /// Adds a field beside the wrapped transport's keys (CUDA IPC's `cuda_ipc` or
    /// `cuda_ipc_refused`); decoders of the wrapped transport ignore fields they do not know.
    pub fn insert(&mut self, field: &str, value: serde_json::Value) {
        self.0.insert(field.to_string(), value);
    }
}

/// One registered region with the keys its transport returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryEntry {
    /// The registered range.
    pub region: MemoryRegion,
    /// What the transport returned for it (registration path and its own keys).
    pub keys: RegionKeys,
}

/// The engine's table of registered regions: non-overlapping, keyed by start address.
/// Shared (behind `Arc`) by the engine and its transport; the TCP target serves a request only
/// while holding the read lock on the region it checked, so `remove` returns only after every
/// in-progress access to that region ended.
#[derive(Debug, Default)]
pub struct MemoryRegistry {
    regions: RwLock<BTreeMap<u64, RegistryEntry>>,
    /// Batches in flight per region (`crate::inflight`).
    inflight: Arc<crate::inflight::InFlight>,
}

impl MemoryRegistry {
    /// Empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks that `region` has len > 0, does not wrap the address space and overlaps no
    /// registered region; then calls `register` (the transport's hook) and records the region
    /// with the keys it returns. Errors: `Registration` for zero length, overflow or overlap;
    /// whatever `register` returns (nothing is recorded then).
    pub fn insert(
        &self,
        region: MemoryRegion,
        register: impl FnOnce(&MemoryRegion) -> Result<RegionKeys>,
    ) -> Result<RegionKeys> {
        if region.len == 0 {
            return Err(TransferError::Registration(RegistrationError::ZeroLength {
                addr: region.addr,
            }));
        }
        if region.addr.checked_add(region.len).is_none() {
            return Err(TransferError::Registration(RegistrationError::Wraps {
                addr: region.addr,
                len: region.len,
            }));
        }
        let mut map = self.regions.write_locked();
        let before = map.range(..region.end()).next_back();
        if let Some((_, e)) = before {
            if e.region.end() > region.addr {
                return Err(TransferError::Registration(RegistrationError::Overlaps {
                    addr: region.addr,
                    len: region.len,
                    with_addr: e.region.addr,
                    with_len: e.region.len,
                }));
            }
        }
        let keys = register(&region)?;
        map.insert(
            region.addr,
            RegistryEntry {
                region,
                keys: keys.clone(),
            },
        );
        Ok(keys)
    }

    /// Removes the region that starts at `addr` (after every in-progress target-side access to
    /// it ended) and returns it. `InvalidArgument` when no region starts there.
    pub fn remove(&self, addr: u64) -> Result<RegistryEntry> {
        let mut map = self.regions.write_locked();
        map.remove(&addr)
            .ok_or_else(|| TransferError::InvalidArgument(ArgumentError::NoRegionAt { addr }))
    }

    /// Pins the regions starting at `starts` for a batch until the returned pins drop.
    /// Errors: `NotRegistered` when one was unregistered meanwhile (nothing is pinned then).
    pub(crate) fn pin(&self, starts: &[u64]) -> Result<crate::inflight::Pins> {
        let map = self.regions.read_locked();
        if let Some(&addr) = starts.iter().find(|s| !map.contains_key(s)) {
            return Err(TransferError::NotRegistered { addr, len: 1 });
        }
        Ok(self.inflight.pin(starts.iter().copied()))
    }

    /// As `remove`, once no batch pins the region: waits up to `wait` for the batches in
    /// flight on it to end. Errors: `InvalidArgument` as `remove`; `InUse` when batches still
    /// use it at the deadline (it stays registered).
    pub fn remove_when_idle(&self, addr: u64, wait: std::time::Duration) -> Result<RegistryEntry> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            {
                let mut map = self.regions.write_locked();
                let batches = self.inflight.count(addr);
                if batches == 0 || !map.contains_key(&addr) {
                    return map.remove(&addr).ok_or_else(|| {
                        TransferError::InvalidArgument(ArgumentError::NoRegionAt { addr })
                    });
                }
                if std::time::Instant::now() >= deadline {
                    return Err(TransferError::InUse {
                        addr,
                        batches,
                        waited: wait,
                    });
                }
            }
            self.inflight.wait_idle(addr, deadline);
        }
    }

    /// All regions, ascending by address.
    pub fn snapshot(&self) -> Vec<RegistryEntry> {
        let map = self.regions.read_locked();
        map.values().cloned().collect()
    }

    /// The region that wholly contains `[addr, addr+len)`, if any.
    pub fn find(&self, addr: u64, len: u64) -> Option<RegistryEntry> {
        let map = self.regions.read_locked();
        find_in(&map, addr, len).cloned()
    }

    /// Runs `f` on the region that wholly contains `[addr, addr+len)` while holding the
    /// registry's read lock (the region cannot be removed meanwhile); `None` when no region
    /// contains the range (then `f` is not called).
    pub fn with_region<R>(
        &self,
        addr: u64,
        len: u64,
        f: impl FnOnce(&RegistryEntry) -> R,
    ) -> Option<R> {
        let map = self.regions.read_locked();
        find_in(&map, addr, len).map(f)
    }

    /// As `cover` for every range of `ranges` under one read lock, with the regions only (no
    /// keys are cloned): a submit of thousands of requests takes the lock once. Errors: the
    /// index of the first range some byte of which no region holds.
    pub(crate) fn cover_regions(
        &self,
        ranges: impl ExactSizeIterator<Item = (u64, u64)>,
    ) -> std::result::Result<Covers<MemoryRegion>, usize> {
        let map = self.regions.read_locked();
        let mut entries: Option<Vec<&RegistryEntry>> = None;
        // Requests of one submit mostly lie in one region: the last one is tried first.
        let mut last: Option<&RegistryEntry> = None;
        let mut out = Covers::with_capacity(ranges.len());
        for (i, (addr, len)) in ranges.enumerate() {
            // Most requests lie inside one region: one tree lookup, no allocation.
            if let Some(e) = last.filter(|e| e.region.contains(addr, len)) {
                out.push(smallvec::smallvec![(addr, len, e.region)]);
                continue;
            }
            if let Some(e) = find_in(&map, addr, len) {
                last = Some(e);
                out.push(smallvec::smallvec![(addr, len, e.region)]);
                continue;
            }
            let all = entries.get_or_insert_with(|| map.values().collect());
            match cover_sorted(all, |e| &e.region, addr, len) {
                Some(v) => out.push(v.into_iter().map(|(a, l, e)| (a, l, e.region)).collect()),
                None => return Err(i),
            }
        }
        Ok(out)
    }

    /// Cuts `[addr, addr+len)` at region boundaries: the pieces `(addr, len, entry)` covering
    /// it in order, when registered regions cover it without a gap; `None` otherwise.
    pub fn cover(&self, addr: u64, len: u64) -> Option<Vec<(u64, u64, RegistryEntry)>> {
        let map = self.regions.read_locked();
        let entries: Vec<&RegistryEntry> = map.values().collect();
        cover_sorted(&entries, |e| &e.region, addr, len)
            .map(|v| v.into_iter().map(|(a, l, e)| (a, l, e.clone())).collect())
    }
}

fn find_in(map: &BTreeMap<u64, RegistryEntry>, addr: u64, len: u64) -> Option<&RegistryEntry> {
    let (_, e) = map.range(..=addr).next_back()?;
    e.region.contains(addr, len).then_some(e)
}

/// The pieces `(addr, len, item)` one request's range is cut into at region boundaries:
/// almost always one, held without a heap allocation.
pub(crate) type Cover<T> = smallvec::SmallVec<[(u64, u64, T); 1]>;

/// The covers of a submit's requests, one per request (inline for one: a submit of one
/// request allocates no list).
pub(crate) type Covers<T> = smallvec::SmallVec<[Cover<T>; 1]>;

/// Cuts `[addr, addr+len)` at the boundaries of `items` (sorted by address, non-overlapping):
/// `(piece addr, piece len, item)` in order, or `None` when some byte is not covered or the
/// range wraps. Shared by the local registry and peers' advertised buffers.
pub(crate) fn cover_sorted<'a, T>(
    items: &[&'a T],
    region_of: impl Fn(&T) -> &MemoryRegion,
    addr: u64,
    len: u64,
) -> Option<Vec<(u64, u64, &'a T)>> {
    let end = addr.checked_add(len)?;
    let mut out = Vec::new();
    let mut cur = addr;
    // first item whose end is past `addr`
    let mut i = items.partition_point(|t| region_of(t).end() <= addr);
    while cur < end {
        let t = *items.get(i)?;
        let r = region_of(t);
        if r.addr > cur {
            return None;
        }
        let piece_end = r.end().min(end);
        out.push((cur, piece_end - cur, t));
        cur = piece_end;
        i += 1;
    }
    Some(out)
}

/// Copies between host buffers and memory that the host cannot address directly (GPU memory).
/// The TCP transport uses it for every region whose location is not `Cpu` (host regions are
/// read and written in place). The GPU helper provides an implementation in `src/gpu/`
/// (`gpu::memory_access()`, staging through pinned host buffers); without it,
/// `HostMemoryAccess` refuses non-host locations with `Unsupported`.
pub trait MemoryAccess: Send + Sync + 'static {
    /// Short name for logs (`"host"`, `"cuda"`).
    fn name(&self) -> &'static str;

    /// Ok when this backend can copy to and from `location`; `Unsupported` with a clear text
    /// otherwise. Called at registration, so an unusable region is refused early.
    fn check(&self, location: Location) -> Result<()>;

    /// Ok when this backend can copy to and from the whole of `region` (e.g. for `cuda:N`:
    /// the range is device memory of device N). Called at registration. Default:
    /// [`MemoryAccess::check`] of the region's location.
    fn check_region(&self, region: &MemoryRegion) -> Result<()> {
        self.check(region.location)
    }

    /// Copies `dst.len()` bytes starting at `src_addr` (memory at `location`) into `dst`.
    ///
    /// # Safety
    /// `[src_addr, src_addr + dst.len())` is valid memory of `location` for the duration.
    unsafe fn copy_from(&self, location: Location, src_addr: u64, dst: &mut [u8]) -> Result<()>;

    /// Copies `src` to `dst_addr` (memory at `location`); returns after the bytes are in
    /// place (a device copy is synchronised before returning).
    ///
    /// # Safety
    /// `[dst_addr, dst_addr + src.len())` is valid, writable memory of `location`.
    unsafe fn copy_to(&self, location: Location, dst_addr: u64, src: &[u8]) -> Result<()>;

    /// Exports `[region.addr, +region.len)` of a `cuda:N` region as a dma-buf, for the RDMA
    /// transport's `ibv_reg_dmabuf_mr` (docs/design.md §3 "GPU memory": dma-buf first, then the
    /// peer-memory path, else a pinned host mirror). Default: `Unsupported` (no exporter).
    fn export_dmabuf(&self, region: &MemoryRegion) -> Result<DmabufRange> {
        Err(UnsupportedError::NoDmabuf {
            backend: self.name(),
            location: region.location,
        }
        .into())
    }
}

/// dma-buf export of a GPU range: the fd and the range's offset inside the dma-buf (from
/// [`MemoryAccess::export_dmabuf`]; the CUDA one uses `cuMemGetHandleForAddressRange`).
#[derive(Debug)]
pub struct DmabufRange {
    /// The dma-buf file descriptor (owned; closed on drop).
    pub fd: std::os::fd::OwnedFd,
    /// Byte offset of the region's `addr` from the dma-buf's start (the export covers whole
    /// pages, so this is `addr` modulo the page size).
    pub offset: u64,
}

/// The built-in `MemoryAccess`: host memory only; `cuda:N` is `Unsupported`.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostMemoryAccess;

impl HostMemoryAccess {
    fn refuse(location: Location) -> TransferError {
        TransferError::Unsupported(UnsupportedError::NoGpuBackend { location })
    }
}

impl MemoryAccess for HostMemoryAccess {
    fn name(&self) -> &'static str {
        "host"
    }

    fn check(&self, location: Location) -> Result<()> {
        match location {
            Location::Cpu => Ok(()),
            other => Err(Self::refuse(other)),
        }
    }

    unsafe fn copy_from(&self, location: Location, src_addr: u64, dst: &mut [u8]) -> Result<()> {
        self.check(location)?;
        // SAFETY: the caller promises the source range is valid host memory.
        unsafe {
            std::ptr::copy_nonoverlapping(src_addr as *const u8, dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    unsafe fn copy_to(&self, location: Location, dst_addr: u64, src: &[u8]) -> Result<()> {
        self.check(location)?;
        // SAFETY: the caller promises the destination range is valid, writable host memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst_addr as *mut u8, src.len()) };
        Ok(())
    }
}

/// Checks that host range `[addr, addr + len)` is mapped readable and writable in this
/// process, by reading `/proc/self/maps` (Linux). A peer may READ and WRITE registered memory,
/// so a range with unmapped or read-only pages in it would let a peer read memory the caller
/// never meant to expose, or crash this process on a WRITE. Only a guard against a wrong
/// address or length: the caller still promises the memory stays mapped until unregistered
/// (a later `munmap` is not seen). CUDA ranges are not listed there; the driver checks them.
/// Errors: `Registration(NotMapped)` naming the first byte that is not mapped so;
/// `Registration(MapsUnreadable)` when `/proc/self/maps` cannot be read.
pub(crate) fn check_host_mapped(addr: u64, len: u64) -> Result<()> {
    if !cfg!(target_os = "linux") {
        return Ok(());
    }
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|e| {
        TransferError::Registration(RegistrationError::MapsUnreadable { kind: e.kind() })
    })?;
    match first_unmapped(&maps, addr, addr.saturating_add(len)) {
        None => Ok(()),
        Some(at) => Err(TransferError::Registration(RegistrationError::NotMapped {
            addr,
            len,
            at,
        })),
    }
}

/// The first byte of `[addr, end)` not inside a readable and writable mapping of `maps` (the
/// text of `/proc/<pid>/maps`: `start-end perms ...`, hex, ascending), or `None`.
pub(crate) fn first_unmapped(maps: &str, addr: u64, end: u64) -> Option<u64> {
    let mut at = addr;
    for line in maps.lines() {
        if at >= end {
            break;
        }
        let mut fields = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else {
            continue;
        };
        if e <= at {
            continue;
        }
        let rw = perms.as_bytes().get(..2) == Some(b"rw".as_slice());
        if s > at || !rw {
            return Some(at);
        }
        at = e;
    }
    (at < end).then_some(at)
}

#[cfg(test)]
mod tests {

    const MAPS: &str = "\
00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/x
00652000-00655000 rw-p 00052000 08:02 173521 /usr/bin/x
00655000-00700000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000001000 ---p 00000000 00:00 0
7f0000001000-7f0000100000 rw-p 00000000 00:00 0
";

    #[test]
    fn a_range_must_lie_in_readable_writable_mappings() {
        // Inside one mapping, and across two adjacent ones.
        assert_eq!(first_unmapped(MAPS, 0x652000, 0x653000), None);
        assert_eq!(first_unmapped(MAPS, 0x654000, 0x6ff000), None);
        assert_eq!(first_unmapped(MAPS, 0x7f0000001000, 0x7f0000100000), None);
        // Read-only code, a hole, a guard page, past the last mapping, address 1.
        assert_eq!(first_unmapped(MAPS, 0x400000, 0x401000), Some(0x400000));
        assert_eq!(first_unmapped(MAPS, 0x6ff000, 0x701000), Some(0x700000));
        assert_eq!(
            first_unmapped(MAPS, 0x7f0000000800, 0x7f0000002000),
            Some(0x7f0000000800)
        );
        assert_eq!(
            first_unmapped(MAPS, 0x7f00000ff000, 0x7f0000101000),
            Some(0x7f0000100000)
        );
        assert_eq!(first_unmapped(MAPS, 1, 1 << 63), Some(1));
        assert_eq!(first_unmapped("", 1, 2), Some(1));
    }

    #[test]
    fn this_process_heap_is_mapped_and_address_1_is_not() {
        let buf = vec![0u8; 1 << 20];
        assert!(check_host_mapped(buf.as_ptr() as u64, buf.len() as u64).is_ok());
        assert!(matches!(
            check_host_mapped(1, 1 << 63),
            Err(TransferError::Registration(RegistrationError::NotMapped {
                at: 1,
                ..
            }))
        ));
    }
    use super::*;

    fn r(addr: u64, len: u64) -> MemoryRegion {
        MemoryRegion {
            addr,
            len,
            location: Location::Cpu,
        }
    }

    #[test]
    fn insert_rejects_zero_len_wrap_and_every_overlap() {
        let reg = MemoryRegistry::new();
        let ok = |_: &MemoryRegion| Ok(RegionKeys::default());
        reg.insert(r(1000, 100), ok).unwrap();
        assert!(reg.insert(r(2000, 0), ok).is_err());
        assert!(reg.insert(r(u64::MAX - 10, 20), ok).is_err());
        for (a, l) in [(1000, 100), (999, 2), (1099, 1), (900, 1000), (1050, 10)] {
            assert!(reg.insert(r(a, l), ok).is_err(), "[{a}, +{l}) overlaps");
        }
        reg.insert(r(1100, 10), ok).unwrap(); // adjacent is fine
        reg.insert(r(990, 10), ok).unwrap();
        assert_eq!(reg.snapshot().len(), 3);
    }

    #[test]
    fn failed_transport_registration_records_nothing() {
        let reg = MemoryRegistry::new();
        let e = reg.insert(r(0x1000, 10), |_| {
            Err(TransferError::Rdma(crate::error::RdmaError::ShutDown))
        });
        assert!(e.is_err());
        assert!(reg.snapshot().is_empty());
    }

    #[test]
    fn find_and_cover() {
        let reg = MemoryRegistry::new();
        let ok = |_: &MemoryRegion| Ok(RegionKeys::default());
        reg.insert(r(100, 100), ok).unwrap();
        reg.insert(r(200, 50), ok).unwrap();
        reg.insert(r(300, 10), ok).unwrap();
        assert!(reg.find(150, 50).is_some());
        assert!(reg.find(150, 51).is_none());
        assert!(reg.find(99, 1).is_none());
        let c = reg.cover(150, 80).unwrap();
        assert_eq!(
            c.iter().map(|(a, l, _)| (*a, *l)).collect::<Vec<_>>(),
            vec![(150, 50), (200, 30)]
        );
        assert!(reg.cover(240, 70).is_none(), "gap 250..300");
        assert!(reg.cover(u64::MAX, 2).is_none());
        assert!(reg.remove(200).is_ok());
        assert!(reg.remove(200).is_err());
        assert!(reg.cover(150, 80).is_none());
    }

    #[test]
    fn host_access_refuses_gpu_memory() {
        let e = HostMemoryAccess.check(Location::Cuda(0)).unwrap_err();
        assert!(e.to_string().contains("GPU memory"), "{e}");
    }
}
