//! The host mirror of a staged GPU region (docs/design.md §3 "GPU memory", the last resort after
//! dma-buf and peer memory): host memory of the region's size, registered with the NIC in its
//! place, with the device copies that keep the two in step and the retirement that ends them
//! when the region is unregistered. The sync messages that trigger the copies are
//! `staging_sync.rs`.

use crate::sync::RwLockExt;
use std::sync::{Arc, RwLock};

use crate::error::{ArgumentError, IoError, RdmaError, Result, TransferError};
use crate::memory::{MemoryAccess, MemoryRegion};

/// A host mirror of one staged GPU region: `region.len` bytes of anonymous memory, pinned by
/// the NIC registration of it. Offsets are the region's: byte `addr` of the region lives at
/// `self.addr() + (addr - region.addr)`.
pub(crate) struct Mirror {
    region: MemoryRegion,
    ptr: *mut u8,
    _map: memmap2::MmapMut,
    /// False once the region is unregistered; copies hold the read lock, so `retire` returns
    /// only after the last copy into the device range ended (the caller may free it then).
    live: RwLock<bool>,
}

// SAFETY: the pointer is into the owned mapping, which lives as long as the mirror; concurrent
// copies touch disjoint or NIC-owned bytes exactly as RDMA buffers always are.
unsafe impl Send for Mirror {}
// SAFETY: as for Send: `&Mirror` only reads the pointer's value; the bytes behind it are
// written by the NIC and by copies that `live` orders against `retire`, never through `&self`
// fields.
unsafe impl Sync for Mirror {}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirror")
            .field("region", &self.region)
            .field("addr", &format_args!("{:#x}", self.addr()))
            .finish()
    }
}

impl Mirror {
    /// Maps `region.len` bytes of host memory for `region`. Errors: `Rdma` when the host has no
    /// room for them (the text names the size).
    pub fn new(region: &MemoryRegion) -> Result<Arc<Mirror>> {
        let len = usize::try_from(region.len).map_err(|_| {
            TransferError::InvalidArgument(ArgumentError::RegionTooLarge { len: region.len })
        })?;
        let mut map = memmap2::MmapMut::map_anon(len).map_err(|e| {
            TransferError::Rdma(RdmaError::MirrorMap {
                len: region.len,
                location: region.location,
                addr: region.addr,
                source: IoError::new("mmap", e),
            })
        })?;
        let ptr = map.as_mut_ptr();
        Ok(Arc::new(Mirror {
            region: *region,
            ptr,
            _map: map,
            live: RwLock::new(true),
        }))
    }

    /// Ends device copies for an unregistered region: waits for copies in progress (each is
    /// bounded by the memory backend's deadline), then makes every later one an error. A
    /// peer's sync served on another thread can no longer write device memory the owner has
    /// freed once its `unregister_memory` returned.
    pub fn retire(&self) {
        *self.live.write_locked() = false;
    }

    /// Runs `copy` while the region is registered. Errors: `InvalidArgument` once retired.
    fn while_live(&self, copy: impl FnOnce() -> Result<()>) -> Result<()> {
        let live = self.live.read_locked();
        if !*live {
            return Err(ArgumentError::StagedRegionGone {
                location: self.region.location,
                addr: self.region.addr,
            }
            .into());
        }
        copy()
    }

    /// Address of the mirror (what the NIC registration covers).
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// The staged region this mirrors.
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// The mirror address of region address `addr`, for `len` bytes inside the region.
    pub fn translate(&self, addr: u64, len: u64) -> Option<u64> {
        self.region
            .contains(addr, len)
            .then(|| self.addr() + (addr - self.region.addr))
    }

    fn bytes(&self, addr: u64, len: u64) -> Result<*mut u8> {
        let at = self.translate(addr, len).ok_or_else(|| {
            TransferError::InvalidArgument(ArgumentError::OutsideStagedRegion {
                addr,
                len,
                region_addr: self.region.addr,
                region_len: self.region.len,
            })
        })?;
        Ok(at as *mut u8)
    }

    /// Copies `[addr, +len)` of the region from the device into the mirror (before the NIC
    /// reads it). Errors: `InvalidArgument` outside the region; the copy's error.
    pub fn to_host(&self, mem: &dyn MemoryAccess, addr: u64, len: u64) -> Result<()> {
        let p = self.bytes(addr, len)?;
        // SAFETY: `p..p+len` is inside the mapping (checked above); the region is device memory
        // registered by the caller, valid while registered (register_memory's contract), which
        // `while_live` holds for the copy.
        self.while_live(|| unsafe {
            let dst = std::slice::from_raw_parts_mut(p, len as usize);
            mem.copy_from(self.region.location, addr, dst)
        })
    }

    /// Copies `[addr, +len)` of the region from the mirror to the device (after the NIC wrote
    /// it). Errors as [`Mirror::to_host`].
    pub fn to_device(&self, mem: &dyn MemoryAccess, addr: u64, len: u64) -> Result<()> {
        let p = self.bytes(addr, len)?;
        // SAFETY: `p..p+len` is inside the mapping (checked by `bytes`); the device range is
        // valid while the region is registered, which `while_live` holds for the copy.
        self.while_live(|| unsafe {
            let src = std::slice::from_raw_parts(p as *const u8, len as usize);
            mem.copy_to(self.region.location, addr, src)
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::types::Location;
    use std::sync::Mutex;

    /// A "device" that is host memory it copies itself, logging each copy.
    #[derive(Default)]
    struct Dev {
        log: Mutex<Vec<(&'static str, u64, usize)>>,
    }

    impl MemoryAccess for Dev {
        fn name(&self) -> &'static str {
            "test"
        }
        fn check(&self, _: Location) -> Result<()> {
            Ok(())
        }
        unsafe fn copy_from(&self, _: Location, src: u64, dst: &mut [u8]) -> Result<()> {
            self.log.lock().unwrap().push(("from", src, dst.len()));
            // SAFETY: the test "device" is host memory: `src` is the start of a live Vec of at
            // least `dst.len()` bytes (the mirror checked the range against the region).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
            Ok(())
        }
        unsafe fn copy_to(&self, _: Location, dst: u64, src: &[u8]) -> Result<()> {
            self.log.lock().unwrap().push(("to", dst, src.len()));
            // SAFETY: as in `copy_from`: `dst` is inside a live Vec the test owns.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
            Ok(())
        }
    }

    pub(crate) fn region_of(v: &[u8]) -> MemoryRegion {
        MemoryRegion {
            addr: v.as_ptr() as u64,
            len: v.len() as u64,
            location: Location::Cuda(0),
        }
    }

    #[test]
    fn mirror_copies_only_the_named_range_each_way() {
        let mut device: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let m = Mirror::new(&region_of(&device)).unwrap();
        let dev = Dev::default();
        let base = device.as_ptr() as u64;
        m.to_host(&dev, base + 100, 50).unwrap();
        // SAFETY: the mirror maps 4096 bytes (the region's length) and outlives `mirror`.
        let mirror = unsafe { std::slice::from_raw_parts(m.addr() as *const u8, 4096) };
        assert_eq!(&mirror[100..150], &device[100..150]);
        assert!(mirror[..100].iter().chain(&mirror[150..]).all(|&b| b == 0));

        // the NIC writes into the mirror; only the synced range reaches the device
        // SAFETY: as above; no copy runs while the test writes (it plays the NIC).
        let mirror = unsafe { std::slice::from_raw_parts_mut(m.addr() as *mut u8, 4096) };
        mirror[1000..1100].fill(0xAB);
        mirror[2000..2010].fill(0xCD);
        m.to_device(&dev, base + 1000, 100).unwrap();
        let before = device[2000];
        assert!(device[1000..1100].iter().all(|&b| b == 0xAB));
        assert_eq!(device[2000], before, "an unsynced range stays as it was");
        assert_eq!(
            *dev.log.lock().unwrap(),
            vec![("from", base + 100, 50), ("to", base + 1000, 100)]
        );
        device[0] = 1; // the device buffer outlives the mirror's uses
    }

    #[test]
    fn mirror_refuses_ranges_outside_its_region() {
        let device = vec![0u8; 256];
        let m = Mirror::new(&region_of(&device)).unwrap();
        let dev = Dev::default();
        let base = device.as_ptr() as u64;
        for (a, l) in [
            (base - 1, 2),
            (base + 200, 57),
            (base + 256, 1),
            (u64::MAX, 2),
        ] {
            assert!(m.to_device(&dev, a, l).is_err(), "[{a:#x}, +{l})");
            assert!(m.to_host(&dev, a, l).is_err(), "[{a:#x}, +{l})");
        }
        assert!(dev.log.lock().unwrap().is_empty(), "nothing was copied");
        assert_eq!(m.translate(base + 10, 246), Some(m.addr() + 10));
        assert_eq!(m.translate(base + 10, 247), None);
    }

    /// A device whose copies wait for a go-ahead (a slow copy on another thread).
    struct Gate {
        entered: Mutex<std::sync::mpsc::Sender<()>>,
        release: Mutex<std::sync::mpsc::Receiver<()>>,
        finished: std::sync::atomic::AtomicBool,
    }

    impl MemoryAccess for Gate {
        fn name(&self) -> &'static str {
            "gate"
        }
        fn check(&self, _: Location) -> Result<()> {
            Ok(())
        }
        unsafe fn copy_from(&self, l: Location, src: u64, dst: &mut [u8]) -> Result<()> {
            // SAFETY: forwards this function's own contract to `copy_to`, which reads nothing.
            unsafe { self.copy_to(l, src, dst) }
        }
        unsafe fn copy_to(&self, _: Location, _: u64, _: &[u8]) -> Result<()> {
            self.entered.lock().unwrap().send(()).unwrap();
            self.release.lock().unwrap().recv().unwrap();
            self.finished
                .store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
    }

    #[test]
    fn retire_waits_for_a_copy_in_progress_and_refuses_later_ones() {
        let device = vec![0u8; 256];
        let base = device.as_ptr() as u64;
        let m = Mirror::new(&region_of(&device)).unwrap();
        let (etx, erx) = std::sync::mpsc::channel();
        let (rtx, rrx) = std::sync::mpsc::channel();
        let gate = Arc::new(Gate {
            entered: Mutex::new(etx),
            release: Mutex::new(rrx),
            finished: Default::default(),
        });
        // a peer's sync copying into the device range
        let (m2, g2) = (m.clone(), gate.clone());
        let copy = std::thread::spawn(move || m2.to_device(&*g2, base, 16));
        erx.recv().unwrap();
        // the owner unregisters meanwhile: retire must not return before the copy ended
        let (m3, g3) = (m.clone(), gate.clone());
        let retire = std::thread::spawn(move || {
            m3.retire();
            g3.finished.load(std::sync::atomic::Ordering::SeqCst)
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        rtx.send(()).unwrap();
        copy.join().unwrap().unwrap();
        assert!(
            retire.join().unwrap(),
            "retire returned while a copy into the device was still running"
        );
        let dev = Dev::default();
        for e in [m.to_device(&dev, base, 8), m.to_host(&dev, base, 8)] {
            let e = e.unwrap_err().to_string();
            assert!(e.contains("unregistered"), "{e}");
        }
        assert!(
            dev.log.lock().unwrap().is_empty(),
            "nothing copied after retire"
        );
    }
}
