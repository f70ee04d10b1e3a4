//! GPU memory in the transfer engine (docs/design.md §3 "GPU memory"): the `cuda:N` memory access
//! (pinned staging) used by the TCP transport, registration checks, WRITE/READ between two
//! engines whose regions are device memory, and the dma-buf export for RDMA.
//!
//! Where CUDA is absent these check that `cuda:N` is refused cleanly and print
//! `SKIPPED: <reason>` for the parts that need a GPU; `KVFERRY_REQUIRE_GPU` turns skips into
//! failures (set by scripts/gpu-tests.sh on a GPU machine).

mod common;

use std::os::fd::AsRawFd;

use common::{engine, Buf};
use cudarc::driver::sys;
use kvferry_transfer::gpu::{cuda_available, export_dmabuf, location_of, memory_access};
use kvferry_transfer::{
    DmabufRange, HostMemoryAccess, Location, MemoryAccess, MemoryRegion, TransferError,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn gpu(test: &str) -> bool {
    match cuda_available() {
        Ok(n) if n > 0 => true,
        other => {
            let why = other
                .err()
                .map_or_else(|| "no CUDA device".to_string(), |e| e.to_string());
            assert!(
                std::env::var_os("KVFERRY_REQUIRE_GPU").is_none(),
                "{test}: GPU required but {why}"
            );
            common::skipped(test, &why);
            false
        }
    }
}

/// Device memory from plain cuMemAlloc in device 0's primary context, freed on drop.
struct DevBuf {
    ptr: u64,
    len: usize,
}

fn bind0() {
    // SAFETY: called only after `gpu()` found a device; out-pointers to live locals.
    unsafe {
        let mut dev = 0;
        assert_eq!(sys::cuDeviceGet(&mut dev, 0), sys::CUresult::CUDA_SUCCESS);
        let mut ctx = std::ptr::null_mut();
        assert_eq!(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuCtxSetCurrent(ctx), sys::CUresult::CUDA_SUCCESS);
    }
}

impl DevBuf {
    fn new(len: usize) -> DevBuf {
        bind0();
        let mut ptr = 0;
        assert_eq!(
            // SAFETY: `ptr` is a live local the driver writes; device 0's context is current
            // (bind0).
            unsafe { sys::cuMemAlloc_v2(&mut ptr, len) },
            sys::CUresult::CUDA_SUCCESS
        );
        DevBuf { ptr, len }
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        bind0();
        // SAFETY: the allocation is owned by this value and freed once.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| r.random()).collect()
}

#[test]
fn cuda_memory_is_refused_cleanly_without_cuda() {
    let m = memory_access();
    match cuda_available() {
        Ok(n) if n > 0 => {
            assert!(m.check(Location::Cuda(0)).is_ok());
            let e = m.check(Location::Cuda(n)).unwrap_err();
            assert!(matches!(e, TransferError::Unsupported(_)), "{e}");
        }
        _ => {
            let e = m.check(Location::Cuda(0)).unwrap_err();
            assert!(
                matches!(e, TransferError::Unsupported(_)) && e.to_string().contains("cuda:0"),
                "{e}"
            );
            let mut b = [0u8; 8];
            // SAFETY: the copy is refused (address 4096 is no allocation) before any byte is
            // read.
            assert!(unsafe { m.copy_from(Location::Cuda(0), 4096, &mut b) }.is_err());
        }
    }
    assert!(m.check(Location::Cpu).is_ok());
}

#[test]
fn pointer_location_is_detected_for_the_wildcard() {
    // host memory (and junk addresses) are cpu with or without CUDA; never a panic
    let host = vec![0u8; 4096];
    assert_eq!(location_of(host.as_ptr() as u64), Location::Cpu);
    assert_eq!(location_of(8), Location::Cpu);
    if !gpu("pointer_location_is_detected_for_the_wildcard") {
        return;
    }
    let d = DevBuf::new(1 << 20);
    // from a thread with no current context too
    let p = d.ptr;
    let other = std::thread::spawn(move || location_of(p + 4096))
        .join()
        .unwrap();
    assert_eq!(location_of(d.ptr), Location::Cuda(0));
    assert_eq!(other, Location::Cuda(0));
    assert_eq!(location_of(host.as_ptr() as u64), Location::Cpu);
}

#[test]
fn staging_copies_round_trip_at_odd_sizes() {
    if !gpu("staging_copies_round_trip_at_odd_sizes") {
        return;
    }
    let m = memory_access();
    let dev = DevBuf::new(8 << 20);
    for (i, &len) in [
        1usize,
        7,
        4096,
        (1 << 20) - 1,
        1 << 20,
        (1 << 20) + 1,
        3 * (1 << 20) + 5,
        7 << 20,
    ]
    .iter()
    .enumerate()
    {
        let off = (i * 13) as u64;
        let src = random(len, i as u64);
        // SAFETY: `[dev.ptr + off, +src.len())` lies in the live allocation `dev`.
        unsafe { m.copy_to(Location::Cuda(0), dev.ptr + off, &src) }.unwrap();
        let mut back = vec![0u8; len];
        // SAFETY: `[dev.ptr + off, +back.len())` lies in the live allocation `dev`.
        unsafe { m.copy_from(Location::Cuda(0), dev.ptr + off, &mut back) }.unwrap();
        assert!(back == src, "round trip of {len} bytes at offset {off}");
    }
    assert!(dev.len > 0);
}

#[test]
fn registration_checks_device_ranges() {
    if !gpu("registration_checks_device_ranges") {
        return;
    }
    let m = memory_access();
    let dev = DevBuf::new(1 << 20);
    let host = vec![0u8; 4096];
    let region = |addr: u64, len: u64| MemoryRegion {
        addr,
        len,
        location: Location::Cuda(0),
    };
    m.check_region(&region(dev.ptr, 1 << 20)).unwrap();
    m.check_region(&region(dev.ptr + 100, 1000)).unwrap();
    // Past the allocation's end, and a host pointer, are refused at registration.
    assert!(matches!(
        m.check_region(&region(dev.ptr + 4096, 1 << 20)),
        Err(TransferError::InvalidArgument(_))
    ));
    let e = m
        .check_region(&region(host.as_ptr() as u64, 4096))
        .unwrap_err();
    assert!(
        matches!(e, TransferError::InvalidArgument(_)) && e.to_string().contains("cuda:0"),
        "{e}"
    );
    let a = engine();
    // SAFETY: `dev` is a live 1 MiB allocation that outlives the engine's registration
    // (unregistered below); the host range is refused.
    unsafe {
        assert!(a
            .register_memory(host.as_ptr() as u64, 4096, Location::Cuda(0))
            .is_err());
        a.register_memory(dev.ptr, 1 << 20, Location::Cuda(0))
            .unwrap();
    }
    a.unregister_memory(dev.ptr).unwrap();
}

/// Two engines over loopback TCP, both regions in GPU memory: WRITE then READ back, bytes
/// compared, including the bytes around the written range.
#[test]
fn tcp_moves_gpu_blocks_between_engines() {
    if !gpu("tcp_moves_gpu_blocks_between_engines") {
        return;
    }
    let m = memory_access();
    let (a, b) = (engine(), engine());
    let len = 6 << 20;
    let (src, dst, back) = (DevBuf::new(len), DevBuf::new(len), DevBuf::new(len));
    let data = random(len, 1);
    let before = random(len, 2);
    // SAFETY: the buffers are live allocations of `len` bytes that outlive the engines'
    // registrations.
    unsafe {
        m.copy_to(Location::Cuda(0), src.ptr, &data).unwrap();
        m.copy_to(Location::Cuda(0), dst.ptr, &before).unwrap();
        a.register_memory(src.ptr, len as u64, Location::Cuda(0))
            .unwrap();
        a.register_memory(back.ptr, len as u64, Location::Cuda(0))
            .unwrap();
        b.register_memory(dst.ptr, len as u64, Location::Cuda(0))
            .unwrap();
    }
    let host = Buf::new(1 << 16, 9);
    host.register(&a);
    let target = b.segment_name();
    let (lo, ro, n) = (1000u64, 5000u64, (4 << 20) + 333);
    a.transfer_sync_write(&target, src.ptr + lo, dst.ptr + ro, n)
        .unwrap();
    let mut got = vec![0u8; len];
    // SAFETY: `dst` is a live allocation of at least `got.len()` bytes.
    unsafe { m.copy_from(Location::Cuda(0), dst.ptr, &mut got) }.unwrap();
    let (lo_u, ro_u, n_u) = (lo as usize, ro as usize, n as usize);
    assert!(
        got[ro_u..ro_u + n_u] == data[lo_u..lo_u + n_u],
        "written bytes"
    );
    assert!(
        got[..ro_u] == before[..ro_u] && got[ro_u + n_u..] == before[ro_u + n_u..],
        "bytes around the range"
    );
    a.transfer_sync_read(&target, back.ptr, dst.ptr + ro, n)
        .unwrap();
    let mut read = vec![0u8; n_u];
    // SAFETY: `back` is a live allocation of at least `read.len()` bytes.
    unsafe { m.copy_from(Location::Cuda(0), back.ptr, &mut read) }.unwrap();
    assert!(read[..] == data[lo_u..lo_u + n_u], "read back");
    // Host memory on one side, GPU memory on the other.
    a.transfer_sync_write(&target, host.addr(), dst.ptr, 1 << 16)
        .unwrap();
    let mut g = vec![0u8; 1 << 16];
    // SAFETY: `dst` is a live allocation of at least `g.len()` bytes.
    unsafe { m.copy_from(Location::Cuda(0), dst.ptr, &mut g) }.unwrap();
    assert!(g == host.bytes, "host to GPU");
}

/// The dma-buf export for RDMA registration (the RDMA path itself needs a NIC): a fd and the
/// region's offset in the page-aligned exported range, or a clear Unsupported where the
/// platform has no dma-buf support.
#[test]
fn dmabuf_export_of_device_memory() {
    let host = [0u8; 64];
    // The exporter travels with the engine's memory access (no global): the CUDA one exports,
    // refusing host memory as the free function does; the host-only one has no exporter.
    let e = memory_access()
        .export_dmabuf(&MemoryRegion {
            addr: host.as_ptr() as u64,
            len: 64,
            location: Location::Cpu,
        })
        .unwrap_err();
    assert!(matches!(e, TransferError::InvalidArgument(_)), "{e}");
    let e = HostMemoryAccess
        .export_dmabuf(&MemoryRegion {
            addr: host.as_ptr() as u64,
            len: 64,
            location: Location::Cuda(0),
        })
        .unwrap_err();
    assert!(matches!(e, TransferError::Unsupported(_)), "{e}");
    let e = export_dmabuf(&MemoryRegion {
        addr: host.as_ptr() as u64,
        len: 64,
        location: Location::Cpu,
    })
    .unwrap_err();
    assert!(matches!(e, TransferError::InvalidArgument(_)), "{e}");
    if !gpu("dmabuf_export_of_device_memory") {
        return;
    }
    let dev = DevBuf::new(4 << 20);
    match memory_access().export_dmabuf(&MemoryRegion {
        addr: dev.ptr + 8192 + 100,
        len: 1 << 20,
        location: Location::Cuda(0),
    }) {
        Ok(DmabufRange { fd, offset }) => {
            assert!(fd.as_raw_fd() >= 0);
            assert_eq!(offset, 100, "offset inside the page-aligned range");
            eprintln!("dma-buf export: fd {} offset {offset}", fd.as_raw_fd());
        }
        Err(TransferError::Unsupported(why)) => eprintln!("dma-buf export unsupported here: {why}"),
        Err(e) => panic!("dma-buf export failed unexpectedly: {e}"),
    }
    assert_eq!(dev.len, 4 << 20);
}
