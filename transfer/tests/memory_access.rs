//! The `MemoryAccess` extension point (GPU memory over TCP): regions at a non-host location are
//! moved through staging copies by the installed `MemoryAccess`, on both sides. A fake "device"
//! backend stands in for CUDA here: its `cuda:0` memory is host memory it copies itself, counted.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

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
            other => Err(TransferError::Unsupported(format!("no {other}"))),
        }
    }
    unsafe fn copy_from(&self, location: Location, src: u64, dst: &mut [u8]) -> Result<()> {
        self.check(location)?;
        self.from.fetch_add(1, Ordering::SeqCst);
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    unsafe fn copy_to(&self, location: Location, dst: u64, src: &[u8]) -> Result<()> {
        self.check(location)?;
        if self.fail_writes.load(Ordering::SeqCst) {
            return Err(TransferError::Unsupported(
                "device copy failed (injected)".into(),
            ));
        }
        self.to.fetch_add(1, Ordering::SeqCst);
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
