//! A fake GPU for the transfer tests: "device memory" is an address range reserved with
//! `PROT_NONE`, so neither the host nor a NIC can touch it (`ibv_reg_mr` fails there as it does
//! for GPU memory without nvidia-peermem, and a stray direct access crashes the test), and its
//! copies move bytes between those addresses and a host backing store it owns.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvferry_transfer::{Location, MemoryAccess, MemoryRegion, Result, TransferError};

use super::Buf;

/// `len` bytes of fake device memory at `base` (unmapped for the host), backed by `backing`.
pub struct FakeGpu {
    /// First address of the fake device memory.
    pub base: u64,
    /// Its size in bytes.
    pub len: u64,
    backing: *mut u8,
    /// Copies made so far (either way).
    pub copies: AtomicUsize,
}

// SAFETY: the backing store is only touched through copies of disjoint or test-ordered ranges.
unsafe impl Send for FakeGpu {}
// SAFETY: the fake device's memory is only written through `&mut` slices or by the engine under
// the MemoryAccess contract; the base pointer itself is never mutated.
unsafe impl Sync for FakeGpu {}

impl FakeGpu {
    /// `len` bytes of fake device memory.
    pub fn new(len: u64) -> Arc<FakeGpu> {
        // SAFETY: a fresh anonymous reservation, never accessed by the host.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED, "reserve the fake device range");
        let backing = Box::leak(vec![0u8; len as usize].into_boxed_slice()).as_mut_ptr();
        Arc::new(FakeGpu {
            base: base as u64,
            len,
            backing,
            copies: AtomicUsize::new(0),
        })
    }

    fn host(&self, addr: u64, len: usize) -> Result<*mut u8> {
        if addr < self.base || addr - self.base + len as u64 > self.len {
            return Err(TransferError::InvalidArgument(
                kvferry_transfer::ArgumentError::NotDeviceMemory {
                    addr,
                    len: len as u64,
                    ordinal: 0,
                    source: kvferry_transfer::Shared(Arc::new(std::io::Error::other(
                        "outside the fake device range",
                    ))),
                },
            ));
        }
        // SAFETY: inside the backing store (checked).
        Ok(unsafe { self.backing.add((addr - self.base) as usize) })
    }

    /// A copy of the device bytes `[off, +len)` (what a kernel would see).
    pub fn device(&self, off: u64, len: usize) -> Vec<u8> {
        let p = self.host(self.base + off, len).expect("inside");
        // SAFETY: inside the backing store; tests read it only when no copy is running.
        unsafe { std::slice::from_raw_parts(p, len) }.to_vec()
    }

    /// Overwrites the device bytes `[off, +len)` with a pattern (a kernel writing its KV).
    pub fn fill_device(&self, off: u64, len: usize, seed: u64) {
        let p = self.host(self.base + off, len).expect("inside");
        let b = Buf::new(len, seed);
        // SAFETY: inside the backing store; no copy is running.
        unsafe { std::ptr::copy_nonoverlapping(b.bytes.as_ptr(), p, len) };
    }
}

impl MemoryAccess for FakeGpu {
    fn name(&self) -> &'static str {
        "fake-gpu"
    }
    fn check(&self, location: Location) -> Result<()> {
        match location {
            Location::Cpu | Location::Cuda(0) => Ok(()),
            other => Err(TransferError::Unsupported(
                kvferry_transfer::UnsupportedError::NoGpuBackend { location: other },
            )),
        }
    }
    fn check_region(&self, region: &MemoryRegion) -> Result<()> {
        self.check(region.location)?;
        if region.location == Location::Cuda(0) {
            self.host(region.addr, region.len as usize)?;
        }
        Ok(())
    }
    unsafe fn copy_from(&self, location: Location, src: u64, dst: &mut [u8]) -> Result<()> {
        self.check(location)?;
        let p = match location {
            Location::Cuda(_) => self.host(src, dst.len())?,
            Location::Cpu => src as *mut u8,
        };
        self.copies.fetch_add(1, Ordering::SeqCst);
        // SAFETY: `self.host` checked that a cuda range lies in the fake device's allocation with
        // `dst.len()` bytes; a cpu range is valid by the MemoryAccess caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    unsafe fn copy_to(&self, location: Location, dst: u64, src: &[u8]) -> Result<()> {
        self.check(location)?;
        let p = match location {
            Location::Cuda(_) => self.host(dst, src.len())?,
            Location::Cpu => dst as *mut u8,
        };
        self.copies.fetch_add(1, Ordering::SeqCst);
        // SAFETY: `self.host` checked that a cuda range lies in the fake device's allocation with
        // `src.len()` bytes; a cpu range is valid by the MemoryAccess caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
        Ok(())
    }
}
