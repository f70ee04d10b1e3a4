//! The owner's list of regions still registered, shared read-only with the peers that mapped
//! its memory. An IPC mapping gives a peer the whole allocation and the owner sees none of
//! its copies, so the owner cannot refuse an access the way the TCP target does; instead the
//! peer checks every slice against this list before it copies, and a region unregistered here
//! is refused there from then on.
//!
//! A memfd of [`TABLE_BYTES`], a seqlock: `u64 seq` (odd while the owner writes), `u64 count`,
//! then `count` × (`u64 addr`, `u64 len`). At most [`MAX_LIVE`] regions.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{ProtocolError, Result, TransferError, UnsupportedError};

/// Bytes of the shared table.
pub const TABLE_BYTES: usize = 64 << 10;
/// Regions the table holds at most.
pub const MAX_LIVE: usize = TABLE_BYTES / 16 - 1;

fn words(map: &[u8]) -> &[AtomicU64] {
    // SAFETY: the mapping is TABLE_BYTES long and page-aligned (so 8-aligned); AtomicU64 has
    // the size and alignment of u64, and every access goes through atomics.
    unsafe { std::slice::from_raw_parts(map.as_ptr() as *const AtomicU64, map.len() / 8) }
}

/// The owner's side.
pub struct LiveTable {
    map: memmap2::MmapMut,
    fd: Arc<OwnedFd>,
}

impl LiveTable {
    /// A fresh, empty table. Errors: `Io` (memfd, size, map).
    pub fn new() -> Result<LiveTable> {
        // SAFETY: a NUL-terminated name; the returned descriptor is owned below.
        let raw =
            unsafe { libc::memfd_create(c"kvferry-cuda-ipc-live".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(TransferError::io(
                "memfd_create for the CUDA IPC live table",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let file = std::fs::File::from(fd.try_clone().map_err(|e| TransferError::io("dup", e))?);
        file.set_len(TABLE_BYTES as u64)
            .map_err(|e| TransferError::io("size the CUDA IPC live table", e))?;
        // SAFETY: a shared mapping of our own memfd; peers map it read-only.
        let map = unsafe { memmap2::MmapMut::map_mut(&file) }
            .map_err(|e| TransferError::io("map the CUDA IPC live table", e))?;
        Ok(LiveTable {
            map,
            fd: Arc::new(fd),
        })
    }

    /// The descriptor peers map.
    pub fn fd(&self) -> Arc<OwnedFd> {
        self.fd.clone()
    }

    /// Publishes `regions` (addr, len) as the live list. Errors: `Unsupported` past
    /// [`MAX_LIVE`] regions (nothing changes then).
    pub fn publish(&mut self, regions: &[(u64, u64)]) -> Result<()> {
        if regions.len() > MAX_LIVE {
            return Err(UnsupportedError::TooManyExports {
                regions: regions.len(),
                limit: MAX_LIVE,
            }
            .into());
        }
        let w = words(&self.map);
        let seq = w[0].load(Ordering::Relaxed);
        w[0].store(seq | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        w[1].store(regions.len() as u64, Ordering::Relaxed);
        for (i, (a, l)) in regions.iter().enumerate() {
            w[2 + 2 * i].store(*a, Ordering::Relaxed);
            w[3 + 2 * i].store(*l, Ordering::Relaxed);
        }
        w[0].store((seq | 1) + 1, Ordering::Release);
        Ok(())
    }
}

/// A peer's read-only view of an owner's table.
pub struct LiveView {
    map: memmap2::Mmap,
}

impl LiveView {
    /// Maps `fd` (the owner's table) read-only. Errors: `Io`; `Protocol` when it is not a
    /// table's size.
    pub fn open(fd: &OwnedFd) -> Result<LiveView> {
        let file = std::fs::File::from(fd.try_clone().map_err(|e| TransferError::io("dup", e))?);
        let len = file
            .metadata()
            .map_err(|e| TransferError::io("stat the CUDA IPC live table", e))?
            .len();
        if len != TABLE_BYTES as u64 {
            return Err(TransferError::Protocol(ProtocolError::Mismatch {
                what: "CUDA IPC live table bytes".into(),
                got: len,
                expected: TABLE_BYTES.to_string(),
            }));
        }
        // SAFETY: a read-only shared mapping; the owner writes it only through atomics.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| TransferError::io("map the CUDA IPC live table", e))?;
        let _ = fd.as_raw_fd();
        Ok(LiveView { map })
    }

    /// Whether `[addr, addr+len)` lies inside one live region. A writer that never finishes
    /// (a dead owner mid-update) makes it false after a bounded number of tries.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        self.snapshot().covers(addr, len)
    }

    /// The live regions as one consistent read, to check many slices against (one read of
    /// the table per post instead of one per slice). A writer that never finishes (a dead
    /// owner mid-update) gives an empty list after a bounded number of tries.
    pub fn snapshot(&self) -> LiveSnapshot {
        let w = words(&self.map);
        let mut regions = SnapshotRegions::new();
        for _ in 0..1000 {
            let s1 = w[0].load(Ordering::Acquire);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let n = (w[1].load(Ordering::Relaxed) as usize).min(MAX_LIVE);
            regions.clear();
            regions.extend((0..n).map(|i| {
                (
                    w[2 + 2 * i].load(Ordering::Relaxed),
                    w[3 + 2 * i].load(Ordering::Relaxed),
                )
            }));
            fence(Ordering::Acquire);
            if w[0].load(Ordering::Relaxed) == s1 {
                return LiveSnapshot { regions, last: 0 };
            }
        }
        LiveSnapshot {
            regions: SnapshotRegions::new(),
            last: 0,
        }
    }
}

/// A snapshot's regions: inline for the few an owner usually has (a snapshot is read per post).
type SnapshotRegions = smallvec::SmallVec<[(u64, u64); 8]>;

/// The live regions at one moment ([`LiveView::snapshot`]).
pub struct LiveSnapshot {
    regions: SnapshotRegions,
    /// The region that covered the last slice asked about: slices come in runs of one region.
    last: usize,
}

impl LiveSnapshot {
    /// Whether `[addr, addr+len)` lies inside one region of the snapshot.
    pub fn covers(&mut self, addr: u64, len: u64) -> bool {
        let inside = |&(a, l): &(u64, u64)| {
            addr >= a
                && addr
                    .checked_add(len)
                    .is_some_and(|e| a.checked_add(l).is_some_and(|re| e <= re))
        };
        if self.regions.get(self.last).is_some_and(inside) {
            return true;
        }
        match self.regions.iter().position(inside) {
            Some(i) => {
                self.last = i;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_sees_regions_come_and_go() {
        let mut t = LiveTable::new().unwrap();
        let v = LiveView::open(&t.fd()).unwrap();
        assert!(!v.covers(0x1000, 1));
        t.publish(&[(0x1000, 0x100), (0x5000, 0x10)]).unwrap();
        assert!(v.covers(0x1000, 0x100));
        assert!(v.covers(0x5008, 8));
        assert!(!v.covers(0x10ff, 2), "past the region's end");
        assert!(!v.covers(u64::MAX, 2), "wraps");
        let mut before = v.snapshot();
        t.publish(&[(0x5000, 0x10)]).unwrap();
        assert!(!v.covers(0x1000, 1), "unregistered");
        // A snapshot is the table when it was read; the next one sees the change.
        assert!(before.covers(0x1000, 0x10) && before.covers(0x5000, 1));
        assert!(
            before.covers(0x1000, 0x10),
            "the last region asked about, again"
        );
        let mut after = v.snapshot();
        assert!(after.covers(0x5000, 0x10));
        assert!(!after.covers(0x1000, 0x10));
        assert!(
            !after.covers(0x5008, 9),
            "past the end of the last region asked about"
        );
    }

    #[test]
    fn the_table_is_bounded() {
        let mut t = LiveTable::new().unwrap();
        let many: Vec<(u64, u64)> = (0..=MAX_LIVE as u64).map(|i| (i * 16, 16)).collect();
        assert!(t.publish(&many).is_err());
        t.publish(&many[..MAX_LIVE]).unwrap();
    }

    #[test]
    fn a_file_of_another_size_is_refused() {
        // SAFETY: a NUL-terminated name; the descriptor is owned below.
        let raw = unsafe { libc::memfd_create(c"x".as_ptr(), 0) };
        // SAFETY: fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        assert!(LiveView::open(&fd).is_err());
    }
}
