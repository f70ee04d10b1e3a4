//! The owner's list of regions still registered, shared read-only with the peers that mapped
//! its memory. An IPC mapping gives a peer the whole allocation and the owner sees none of
//! its copies, so the owner cannot refuse an access the way the TCP target does; instead the
//! peer checks every slice against this list before it copies, and a region unregistered here
//! is refused there from then on.
//!
//! A memfd of [`TABLE_BYTES`], a seqlock: `u64 seq` (odd while the owner writes), `u64 count`,
//! then `count` × (`u64 addr`, `u64 len`). At most [`MAX_LIVE`] regions.
//!
//! The memfd is sealed against shrinking and growing ([`REQUIRED_SEALS`]), and a peer maps
//! only a descriptor that carries those seals: a file the owner could truncate under the
//! peer's mapping would make the peer's next read of it a SIGBUS, and a file of another file
//! system (FUSE) could stall it. Seals cannot be removed once added, so the check holds for
//! as long as the mapping lives.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use super::keys::within;
use crate::error::{ProtocolError, Result, TransferError, UnsupportedError};

/// Bytes of the shared table.
pub const TABLE_BYTES: usize = 64 << 10;
/// Regions the table holds at most.
pub const MAX_LIVE: usize = TABLE_BYTES / 16 - 1;
/// Seals a table's memfd must carry before a peer maps it: its size is fixed for good.
pub const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

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
    /// A fresh, empty table: a memfd of [`TABLE_BYTES`] sealed with [`REQUIRED_SEALS`],
    /// `F_SEAL_FUTURE_WRITE` (after this process mapped it: no one else can write it) and
    /// `F_SEAL_SEAL`, so neither this process nor a peer can change its size. Errors: `Io`
    /// (memfd, size, seal, map).
    pub fn new() -> Result<LiveTable> {
        // SAFETY: a NUL-terminated name; the returned descriptor is owned below.
        let raw = unsafe {
            libc::memfd_create(
                c"kvferry-cuda-ipc-live".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
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
        // Peers refuse a table without these (LiveView::open). The seals also keep a peer that
        // holds the descriptor from truncating it under our own mapping.
        let seal = |seals| add_seals(&fd, seals);
        seal(REQUIRED_SEALS).map_err(|e| TransferError::io("seal the CUDA IPC live table", e))?;
        // SAFETY: a shared mapping of our own memfd; peers map it read-only.
        let map = unsafe { memmap2::MmapMut::map_mut(&file) }
            .map_err(|e| TransferError::io("map the CUDA IPC live table", e))?;
        // Every peer gets the descriptor: once our own writable mapping exists, no one may
        // make another or write() to it (F_SEAL_FUTURE_WRITE, Linux 5.1), so only this
        // process writes the list other peers check their slices against; F_SEAL_SEAL keeps
        // anyone from changing the seals later. A kernel without F_SEAL_FUTURE_WRITE still
        // gets F_SEAL_SEAL (the size stays fixed), with a warning.
        if let Err(e) = seal(libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL) {
            tracing::warn!("the CUDA IPC live table cannot be sealed against writes by peers ({e}): a peer holding it could change the region list other peers read");
            seal(libc::F_SEAL_SEAL)
                .map_err(|e| TransferError::io("seal the CUDA IPC live table", e))?;
        }
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

/// Adds `seals` (`F_SEAL_*`) to the memfd `fd`. Errors: the OS's (`EPERM` once `F_SEAL_SEAL`
/// is set or for a seal the file refuses, `EINVAL` for a file that cannot be sealed).
fn add_seals(fd: &OwnedFd, seals: libc::c_int) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor we borrow; F_ADD_SEALS takes an int and touches no memory.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    (r == 0)
        .then_some(())
        .ok_or_else(std::io::Error::last_os_error)
}

/// The seals (`F_SEAL_*`) of `fd`. Errors: the OS's (`EINVAL` for a file that cannot be sealed).
fn get_seals(fd: &OwnedFd) -> std::io::Result<libc::c_int> {
    // SAFETY: fcntl on a descriptor we borrow; F_GET_SEALS takes no argument, touches no memory.
    let s = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if s < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s)
}

/// A peer's read-only view of an owner's table.
pub struct LiveView {
    map: memmap2::Mmap,
}

impl LiveView {
    /// Maps `fd` (the owner's table) read-only, once it is known to be a memfd sealed with
    /// [`REQUIRED_SEALS`] (its size cannot change under the mapping). Nothing is mapped when
    /// a check fails. Errors: `Io` when its seals cannot be read (`InvalidInput`: not a file
    /// that can be sealed, such as a regular or FUSE file), or on dup, stat or map; `Protocol`
    /// (`BadField`) when it lacks a required seal, (`Mismatch`) when it is not a table's size.
    pub fn open(fd: &OwnedFd) -> Result<LiveView> {
        let seals = get_seals(fd).map_err(|e| {
            TransferError::io(
                "read the seals of the CUDA IPC live table (a sealed memfd is required)",
                e,
            )
        })?;
        if seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(TransferError::Protocol(ProtocolError::BadField {
                what: "CUDA IPC live table seals".into(),
                value: format!("{seals:#x}"),
                expected: "F_SEAL_SHRINK and F_SEAL_GROW",
            }));
        }
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
        // SAFETY: a read-only shared mapping; the owner writes it only through atomics, and the
        // seals checked above keep the file from being truncated under it.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| TransferError::io("map the CUDA IPC live table", e))?;
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
        let inside = |&(a, l): &(u64, u64)| within(a, l, addr, len);
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

    /// A memfd of `len` bytes carrying `seals` (none: not even sealable).
    fn memfd(len: u64, seals: Option<libc::c_int>) -> OwnedFd {
        let flags = if seals.is_some() {
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING
        } else {
            libc::MFD_CLOEXEC
        };
        // SAFETY: a NUL-terminated name; the descriptor is owned below.
        let raw = unsafe { libc::memfd_create(c"x".as_ptr(), flags) };
        assert!(raw >= 0, "memfd_create");
        // SAFETY: fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        std::fs::File::from(fd.try_clone().unwrap())
            .set_len(len)
            .unwrap();
        if let Some(seals) = seals {
            add_seals(&fd, seals).unwrap();
        }
        fd
    }

    fn seals(fd: &OwnedFd) -> libc::c_int {
        get_seals(fd).unwrap()
    }

    #[test]
    fn a_file_of_another_size_is_refused() {
        let fd = memfd(TABLE_BYTES as u64 / 2, Some(REQUIRED_SEALS));
        let e = LiveView::open(&fd).err().expect("a short table is refused");
        assert!(
            matches!(e, TransferError::Protocol(ProtocolError::Mismatch { .. })),
            "{e}"
        );
    }

    /// The owner's table carries the seals peers require, and a peer maps and reads it.
    #[test]
    fn the_owners_table_is_sealed_and_a_peer_reads_it() {
        let mut t = LiveTable::new().unwrap();
        let want = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        assert_eq!(seals(&t.fd()) & want, want, "seals {:#x}", seals(&t.fd()));
        let v = LiveView::open(&t.fd()).unwrap();
        t.publish(&[(0x2000, 0x40)]).unwrap();
        assert!(v.covers(0x2000, 0x40));
        assert!(!v.covers(0x2000, 0x41));
    }

    /// Every peer holds the table's descriptor: none can map it writable or write to it (the
    /// list other peers trust), while the owner's own mapping still publishes.
    #[test]
    fn a_peer_cannot_write_the_owners_table() {
        use std::io::Write;
        let mut t = LiveTable::new().unwrap();
        let peer = std::fs::File::from(t.fd().try_clone().unwrap());
        // SAFETY: a test mapping of a memfd; refused before anything is mapped.
        let writable = unsafe { memmap2::MmapMut::map_mut(&peer) };
        assert!(writable.is_err(), "writable mapping");
        assert!((&peer).write_all(&[1u8; 16]).is_err(), "write()");
        t.publish(&[(0x3000, 0x40)]).unwrap();
        assert!(LiveView::open(&t.fd()).unwrap().covers(0x3000, 0x40));
    }

    /// A table an owner could truncate under our mapping (a SIGBUS on our next read) is not
    /// mapped: no seals, a seal missing, or a file that cannot be sealed at all.
    #[test]
    fn a_table_that_can_change_size_is_refused() {
        let bytes = TABLE_BYTES as u64;
        for (fd, what) in [
            (memfd(bytes, None), "not sealable"),
            (memfd(bytes, Some(0)), "sealable, no seals"),
            (memfd(bytes, Some(libc::F_SEAL_GROW)), "may shrink"),
            (memfd(bytes, Some(libc::F_SEAL_SHRINK)), "may grow"),
        ] {
            let e = LiveView::open(&fd).err().expect(what);
            assert!(
                matches!(e, TransferError::Protocol(ProtocolError::BadField { .. })),
                "{what}: {e}"
            );
        }
        // A regular file of the right size: no seals to read at all (on tmpfs, seals that
        // say it is sealed against sealing only).
        let path = std::env::temp_dir().join(format!(
            "kvferry-live-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let file = std::fs::File::create_new(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        file.set_len(bytes).unwrap();
        let e = LiveView::open(&OwnedFd::from(file))
            .err()
            .expect("a regular file");
        let refused = match &e {
            TransferError::Io(_) => e.io_error_kind() == Some(std::io::ErrorKind::InvalidInput),
            TransferError::Protocol(ProtocolError::BadField { .. }) => true,
            _ => false,
        };
        assert!(refused, "{e}");
    }

    /// The owner's guarantee behind the peer's check: the table's size cannot change, so a
    /// peer's mapping stays readable.
    #[test]
    fn a_sealed_table_cannot_be_truncated() {
        let mut t = LiveTable::new().unwrap();
        let v = LiveView::open(&t.fd()).unwrap();
        let fd = t.fd();
        for len in [
            0,
            TABLE_BYTES as libc::off_t / 2,
            2 * TABLE_BYTES as libc::off_t,
        ] {
            // SAFETY: ftruncate on a descriptor we borrow.
            let r = unsafe { libc::ftruncate(fd.as_raw_fd(), len) };
            let e = std::io::Error::last_os_error();
            assert_eq!(r, -1, "ftruncate to {len} succeeded");
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        }
        assert!(
            add_seals(&fd, libc::F_SEAL_WRITE).is_err(),
            "F_SEAL_SEAL keeps the seals as they are"
        );
        t.publish(&[(0x1000, 0x10)]).unwrap();
        assert!(v.covers(0x1000, 0x10), "the mapping still reads");
    }
}
