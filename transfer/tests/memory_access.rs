//! The `MemoryAccess` extension point (GPU memory over TCP): regions at a non-host location are
//! moved through staging copies by the installed `MemoryAccess`, on both sides. A fake "device"
//! backend stands in for CUDA here: its `cuda:0` memory is host memory it copies itself, counted.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use common::fake_gpu::FakeGpu;
use common::{assert_same, config, Buf};
use kvferry_transfer::{Location, MemoryAccess, Result, TransferEngine, TransferError};

#[derive(Default)]
struct FakeDevice {
    to: AtomicUsize,
    from: AtomicUsize,
    fail_writes: AtomicBool,
}

impl MemoryAccess for FakeDevice {
    fn name(&self) -> &'static str {
        "fake-device"
    }
    fn check(&self, location: Location) -> Result<()> {
        match location {
            Location::Cpu | Location::Cuda(0) => Ok(()),
            other => Err(TransferError::Unsupported(
                kvferry_transfer::UnsupportedError::NoGpuBackend { location: other },
            )),
        }
    }
    unsafe fn copy_from(&self, location: Location, src: u64, dst: &mut [u8]) -> Result<()> {
        self.check(location)?;
        self.from.fetch_add(1, Ordering::SeqCst);
        // SAFETY: the MemoryAccess caller's contract: the host range is valid for `dst.len()`
        // bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    unsafe fn copy_to(&self, location: Location, dst: u64, src: &[u8]) -> Result<()> {
        self.check(location)?;
        if self.fail_writes.load(Ordering::SeqCst) {
            return Err(TransferError::gpu("device copy failed (injected)"));
        }
        self.to.fetch_add(1, Ordering::SeqCst);
        // SAFETY: the MemoryAccess caller's contract: the host range is valid and writable for
        // `src.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
}

#[test]
fn device_regions_move_through_the_memory_access_backend() {
    let dev = Arc::new(FakeDevice::default());
    let a = TransferEngine::with_memory_access(config(), dev.clone()).unwrap();
    let b = TransferEngine::with_memory_access(config(), dev.clone()).unwrap();
    let src = Buf::new(3 << 20, 1);
    let dst = Buf::zeroed(3 << 20);
    let mut back = Buf::zeroed(3 << 20);
    // SAFETY: the buffers outlive the engines (dropped first); the fake device reads them as
    // cuda:0 memory.
    unsafe {
        a.register_memory(src.addr(), src.len(), Location::Cuda(0))
            .unwrap();
        a.register_memory(back.addr(), back.len(), Location::Cuda(0))
            .unwrap();
        b.register_memory(dst.addr(), dst.len(), Location::Cuda(0))
            .unwrap();
        assert!(b
            .register_memory(dst.addr() + dst.len(), 10, Location::Cuda(1))
            .is_err());
    }
    let n = b.segment_name();
    a.transfer_sync_write(&n, src.addr() + 1, dst.addr() + 2, (3 << 20) - 10)
        .unwrap();
    assert_same(
        &dst.bytes[2..(3 << 20) - 8],
        &src.bytes[1..(3 << 20) - 9],
        "device write",
    );
    assert!(dev.from.load(Ordering::SeqCst) > 0 && dev.to.load(Ordering::SeqCst) > 0);
    a.transfer_sync_read(&n, back.addr(), dst.addr(), 3 << 20)
        .unwrap();
    assert_same(&back.bytes, &dst.bytes, "device read");

    // a failing device copy at the target fails the slice; the connection stays usable
    dev.fail_writes.store(true, Ordering::SeqCst);
    let e = a
        .transfer_sync_write(&n, src.addr(), dst.addr(), 4096)
        .unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    dev.fail_writes.store(false, Ordering::SeqCst);
    back.bytes.fill(0);
    a.transfer_sync_read(&n, back.addr(), dst.addr(), 4096)
        .unwrap();
    assert_same(
        &back.bytes[..4096],
        &dst.bytes[..4096],
        "after a failed device copy",
    );
}

#[test]
fn scattered_small_writes_between_device_regions_land_exactly() {
    // Device memory the host cannot touch: a piece read or written in place would crash.
    let gpu = FakeGpu::new(2 << 20);
    let a = TransferEngine::with_memory_access(config(), gpu.clone()).unwrap();
    let b = TransferEngine::with_memory_access(config(), gpu.clone()).unwrap();
    let (src, dst) = (gpu.base, gpu.base + (1 << 20));
    gpu.fill_device(0, 2 << 20, 5);
    let host_src = Buf::new(1 << 16, 6);
    // SAFETY: the fake device's ranges and `host_src` outlive the engines.
    unsafe {
        a.register_memory(src, 1 << 20, Location::Cuda(0)).unwrap();
        b.register_memory(dst, 1 << 20, Location::Cuda(0)).unwrap();
    }
    host_src.register(&a);
    let device_src = gpu.device(0, 1 << 20);
    // 600 pieces of 1..700 bytes from device and host memory, to scattered device offsets:
    // the TCP transport sends them as scattered WRITE frames
    let mut want = gpu.device(1 << 20, 1 << 20);
    let mut reqs = Vec::new();
    let mut x = 12345u64;
    for i in 0..600u64 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = 1 + (x >> 33) % 700;
        let to = i * 1700 + (x >> 50) % 900;
        let (from, bytes) = if i % 3 == 0 {
            let o = (x >> 20) % (host_src.len() - len);
            (
                host_src.addr() + o,
                &host_src.bytes[o as usize..(o + len) as usize],
            )
        } else {
            let o = (x >> 24) % ((1 << 20) - len);
            (src + o, &device_src[o as usize..(o + len) as usize])
        };
        want[to as usize..(to + len) as usize].copy_from_slice(bytes);
        reqs.push((from, dst + to, len));
    }
    a.batch_transfer_sync_write(&b.segment_name(), &reqs)
        .unwrap();
    assert_same(
        &gpu.device(1 << 20, 1 << 20),
        &want,
        "every piece in place, the gaps untouched",
    );
}
