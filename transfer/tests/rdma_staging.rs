//! GPU memory the NIC cannot register, over RDMA (docs/design.md §3 "GPU memory": dma-buf, else
//! peer memory, else staging through pinned host memory with a warning).
//!
//! A fake GPU stands in for CUDA: its "device memory" is an address range reserved with
//! `PROT_NONE`, so neither the host nor the NIC can touch it (`ibv_reg_mr` fails there as it
//! does for GPU memory without nvidia-peermem), and its copies move bytes between those
//! addresses and a host backing store it owns. The tests check that the bytes reach the
//! "device" (not just the mirror) when a batch reports done, both as target and as initiator.
//!
//! Runs on a real verbs device (soft-RoCE in the QEMU guest of tests/softroce/); skipped
//! without one unless `KVFERRY_REQUIRE_RDMA=1`.

mod common;

use std::sync::atomic::Ordering;

use common::fake_gpu::FakeGpu;
use common::rdma::{engine_with_memory, rdma_or_skip};
use common::{assert_same, Buf};
use kvferry_transfer::handshake::{self, FrameType};
use kvferry_transfer::{GpuRegistration, Location, RegistrationPath, TransferError};

const MIB: u64 = 1 << 20;

#[test]
#[cfg_attr(
    not(feature = "rdma"),
    ignore = "needs the `rdma` cargo feature: cargo test --features kvferry/rdma"
)]
fn unregistrable_gpu_target_is_staged_and_writes_reach_the_device() {
    if !rdma_or_skip("unregistrable_gpu_target_is_staged_and_writes_reach_the_device") {
        return;
    }
    let gpu = FakeGpu::new(8 * MIB);
    let a = engine_with_memory(gpu.clone(), |_| {});
    let b = engine_with_memory(gpu.clone(), |_| {});
    // SAFETY: the fake device's memory outlives the engines.
    unsafe { b.register_memory(gpu.base, 4 * MIB, Location::Cuda(0)) }
        .expect("auto registration falls back to staging");
    assert_eq!(b.region_path(gpu.base), Some(RegistrationPath::Staged));
    assert_eq!(b.region_path(gpu.base + 4 * MIB), None);
    let d = a.open_segment(&b.segment_name()).unwrap();
    let buf = &d.descriptor().buffers[0];
    assert_eq!(buf.keys.path, RegistrationPath::Staged);
    // The RDMA key type exists only in an `rdma` build (without it this test is ignored).
    #[cfg(feature = "rdma")]
    {
        let rdma_keys: kvferry_transfer::transport::rdma::RdmaRegionKeys =
            buf.keys.transport.decode().unwrap();
        assert!(
            rdma_keys.staging_addr.is_some(),
            "the peer learns the mirror"
        );
    }

    let src = Buf::new((3 * MIB + 777) as usize, 7);
    src.register(&a);
    let off = 12_345u64;
    a.transfer_sync_write(&b.segment_name(), src.addr(), gpu.base + off, src.len())
        .expect("write into staged GPU memory");
    assert_same(
        &gpu.device(off, src.bytes.len()),
        &src.bytes,
        "the device holds the written bytes when the write reports done",
    );

    // a kernel rewrites device memory: a READ must see the new bytes, not the mirror's old ones
    gpu.fill_device(0, (4 * MIB) as usize, 99);
    let back = Buf::zeroed((MIB + 3) as usize);
    back.register(&a);
    a.transfer_sync_read(&b.segment_name(), back.addr(), gpu.base + 101, back.len())
        .expect("read from staged GPU memory");
    let want = gpu.device(101, back.bytes.len());
    assert_same(
        &back.bytes,
        &want,
        "read returns the device's current bytes",
    );
}

#[test]
#[cfg_attr(
    not(feature = "rdma"),
    ignore = "needs the `rdma` cargo feature: cargo test --features kvferry/rdma"
)]
fn staged_local_gpu_memory_writes_and_reads_through_its_mirror() {
    if !rdma_or_skip("staged_local_gpu_memory_writes_and_reads_through_its_mirror") {
        return;
    }
    let gpu = FakeGpu::new(4 * MIB);
    let a = engine_with_memory(gpu.clone(), |_| {});
    let b = engine_with_memory(gpu.clone(), |_| {});
    // SAFETY: the fake device's memory outlives the engines.
    unsafe { a.register_memory(gpu.base, 4 * MIB, Location::Cuda(0)) }.unwrap();
    assert_eq!(a.region_path(gpu.base + 5), Some(RegistrationPath::Staged));
    let mut dst = Buf::zeroed((2 * MIB) as usize);
    dst.register(&b);

    gpu.fill_device(0, (4 * MIB) as usize, 3);
    let len = 2 * MIB - 9;
    a.transfer_sync_write(&b.segment_name(), gpu.base + 64, dst.addr() + 9, len)
        .expect("write from staged GPU memory");
    let want = gpu.device(64, len as usize);
    assert_same(&dst.bytes[9..], &want, "the device's bytes were sent");

    dst.fill(11);
    a.transfer_sync_read(&b.segment_name(), gpu.base + MIB, dst.addr(), dst.len())
        .expect("read into staged GPU memory");
    assert_same(
        &gpu.device(MIB, dst.bytes.len()),
        &dst.bytes,
        "the device holds the read bytes when the read reports done",
    );
}

#[test]
#[cfg_attr(
    not(feature = "rdma"),
    ignore = "needs the `rdma` cargo feature: cargo test --features kvferry/rdma"
)]
fn forced_gpu_registration_paths_fail_clearly_or_stage_without_fallback() {
    if !rdma_or_skip("forced_gpu_registration_paths_fail_clearly_or_stage_without_fallback") {
        return;
    }
    let gpu = FakeGpu::new(MIB);
    for (mode, needle) in [
        (GpuRegistration::PeerMemory, "peer memory"),
        (GpuRegistration::DmaBuf, "dma-buf"),
    ] {
        let e = engine_with_memory(gpu.clone(), |c| c.rdma.gpu_registration = mode);
        // SAFETY: the fake device's memory outlives the engine.
        let err = unsafe { e.register_memory(gpu.base, MIB, Location::Cuda(0)) }.unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, TransferError::Unsupported(_)) && text.contains(needle),
            "{mode:?}: {text}"
        );
        assert!(!text.contains("staging"), "{mode:?} must not stage: {text}");
        assert_eq!(e.region_path(gpu.base), None, "nothing stays registered");
    }
    let e = engine_with_memory(gpu.clone(), |c| {
        c.rdma.gpu_registration = GpuRegistration::Staged
    });
    // SAFETY: the fake device's memory outlives the engine.
    unsafe { e.register_memory(gpu.base, MIB, Location::Cuda(0)) }.unwrap();
    assert_eq!(e.region_path(gpu.base), Some(RegistrationPath::Staged));
    // host memory is never staged, whatever the GPU setting
    let host = Buf::zeroed(4096);
    host.register(&e);
    assert_eq!(e.region_path(host.addr()), Some(RegistrationPath::Host));
}

#[test]
#[cfg_attr(
    not(feature = "rdma"),
    ignore = "needs the `rdma` cargo feature: cargo test --features kvferry/rdma"
)]
fn staging_syncs_outside_staged_regions_are_refused_and_copy_nothing() {
    if !rdma_or_skip("staging_syncs_outside_staged_regions_are_refused_and_copy_nothing") {
        return;
    }
    let gpu = FakeGpu::new(MIB);
    let b = engine_with_memory(gpu.clone(), |_| {});
    // SAFETY: the fake device's memory outlives the engines.
    unsafe { b.register_memory(gpu.base, MIB / 2, Location::Cuda(0)) }.unwrap();
    let host = Buf::zeroed(4096);
    host.register(&b);
    let before = gpu.copies.load(Ordering::SeqCst);
    let t = std::time::Duration::from_secs(5);
    for (dir, addr, len) in [
        ("to-device", gpu.base + MIB / 2 - 8, 16), // runs past the staged region
        ("to-host", gpu.base + MIB / 2, 8),        // fake device memory never registered
        ("to-device", host.addr(), 8),             // host memory is not staged
        ("to-device", gpu.base, 0),
    ] {
        let body = format!(
            r#"{{"staging_sync":{{"direction":"{dir}","ranges":[[{},8],[{addr},{len}]]}}}}"#,
            gpu.base
        );
        let e = handshake::request(&b.segment_name(), FrameType::Connect, body.as_bytes(), t)
            .expect_err("refused");
        assert!(e.to_string().contains("staging sync"), "{e}");
    }
    assert_eq!(
        gpu.copies.load(Ordering::SeqCst),
        before,
        "a refused sync copies none of its ranges, not even the valid first one"
    );
    // the engine still serves a good sync
    let body = format!(
        r#"{{"staging_sync":{{"direction":"to-host","ranges":[[{},8]]}}}}"#,
        gpu.base
    );
    handshake::request(&b.segment_name(), FrameType::Connect, body.as_bytes(), t).unwrap();
    assert_eq!(gpu.copies.load(Ordering::SeqCst), before + 1);
}

#[test]
#[cfg_attr(
    not(feature = "rdma"),
    ignore = "needs the `rdma` cargo feature: cargo test --features kvferry/rdma"
)]
fn requests_across_staged_regions_registered_back_to_back_reach_the_device() {
    if !rdma_or_skip("requests_across_staged_regions_registered_back_to_back_reach_the_device") {
        return;
    }
    // per-layer regions carved from one allocation: slices on both sides of a boundary are
    // merged into one sync range, which the owner must cut, not refuse
    let gpu = FakeGpu::new(2 * MIB);
    let a = engine_with_memory(gpu.clone(), |_| {});
    let b = engine_with_memory(gpu.clone(), |_| {});
    for half in [0, MIB] {
        // SAFETY: the fake device's memory outlives the engines.
        unsafe { b.register_memory(gpu.base + half, MIB, Location::Cuda(0)) }.unwrap();
        assert_eq!(
            b.region_path(gpu.base + half),
            Some(RegistrationPath::Staged)
        );
    }
    let src = Buf::new(96 * 1024, 5);
    src.register(&a);
    let at = MIB - 40 * 1024;
    a.transfer_sync_write(&b.segment_name(), src.addr(), gpu.base + at, src.len())
        .expect("write across the boundary of two staged regions");
    assert_same(
        &gpu.device(at, src.bytes.len()),
        &src.bytes,
        "both regions' devices hold the written bytes",
    );
    gpu.fill_device(0, (2 * MIB) as usize, 17);
    let back = Buf::zeroed(src.bytes.len());
    back.register(&a);
    a.transfer_sync_read(&b.segment_name(), back.addr(), gpu.base + at, back.len())
        .expect("read across the boundary of two staged regions");
    assert_same(
        &back.bytes,
        &gpu.device(at, back.bytes.len()),
        "read returns both devices' current bytes",
    );
}

#[test]
#[cfg_attr(
    not(feature = "rdma"),
    ignore = "needs the `rdma` cargo feature: cargo test --features kvferry/rdma"
)]
fn tens_of_thousands_of_scattered_slices_from_a_staged_peer_complete() {
    if !rdma_or_skip("tens_of_thousands_of_scattered_slices_from_a_staged_peer_complete") {
        return;
    }
    // 60k non-adjacent 64-byte blocks: their ranges do not fit one 1 MiB sync frame
    const N: u64 = 60_000;
    let gpu = FakeGpu::new(N * 128);
    let a = engine_with_memory(gpu.clone(), |_| {});
    let b = engine_with_memory(gpu.clone(), |_| {});
    // SAFETY: the fake device's memory outlives the engines.
    unsafe { b.register_memory(gpu.base, N * 128, Location::Cuda(0)) }.unwrap();
    gpu.fill_device(0, (N * 128) as usize, 23);
    let dst = Buf::zeroed((N * 64) as usize);
    dst.register(&a);
    let reqs: Vec<(u64, u64, u64)> = (0..N)
        .map(|i| (dst.addr() + i * 64, gpu.base + i * 128, 64))
        .collect();
    a.batch_transfer_sync_read(&b.segment_name(), &reqs)
        .expect("scattered reads from staged GPU memory");
    for i in [0, 1, N / 2, N - 1] {
        let (l, r) = ((i * 64) as usize, i * 128);
        assert_same(&dst.bytes[l..l + 64], &gpu.device(r, 64), "block read");
    }
    let all: Vec<u8> = (0..N).flat_map(|i| gpu.device(i * 128, 64)).collect();
    assert_same(&dst.bytes, &all, "every block read");
}
