//! Sharing device memory between processes of one host (docs/design.md §3.10): the two ways
//! the driver exports an allocation and the owners of what a peer imports.
//!
//! * **Legacy IPC** (`cuMemAlloc` memory): [`legacy_handle`] makes the 64-byte
//!   `cuIpcGetMemHandle` of an allocation's base; the peer opens it once with
//!   [`OpenedLegacy::open`] (`cuIpcOpenMemHandle`) and closes it on drop.
//! * **Virtual-memory allocations** (`cuMemCreate`: PyTorch's expandable segments, vLLM's cumem
//!   allocator), which legacy IPC refuses: [`export_vmm`] exports the allocation as a POSIX file
//!   descriptor (`cuMemExportToShareableHandle`), which travels over a Unix socket
//!   (`SCM_RIGHTS`); the peer maps it with [`ImportedVmm::import`]
//!   (`cuMemImportFromShareableHandle` + `cuMemAddressReserve`/`cuMemMap`/`cuMemSetAccess`).
//! * [`allocation_of`] tells the two apart: `cuMemRetainAllocationHandle` succeeds only on
//!   virtual-memory allocations, and their pointer attribute `ALLOWED_HANDLE_TYPES` says whether
//!   they were created exportable as a file descriptor.
//!
//! Every call here is a plain driver call on a context the caller made current; callers probe
//! the driver first ([`crate::cuda_available`]) and run the first call inside
//! [`crate::guarded`], as for the rest of this crate.

mod piece;
mod share;
mod strided;

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::driver::{check, DriverResult};
use crate::error::{CudaError, InvalidArg};
use piece::LoadedKernel;
pub use piece::{Copy, PieceTable};
pub use share::{
    allocation_of, export_vmm, legacy_handle, Allocation, AllocationKind, ExportRefused,
    ImportedVmm, LegacyHandle, OpenedLegacy, VmmBuffer,
};
pub use strided::{
    strided_cut, strided_table, StridedCopies, StridedKernel, StridedTable, STRIDED_PIECES_WANTED,
    STRIDED_PIECE_MAX, STRIDED_PIECE_MIN, STRIDED_SRC,
};

/// Whether device `a` can read and write device `b`'s memory (`cuDeviceCanAccessPeer`); true
/// for `a == b`. Errors: the driver's.
pub fn can_access_peer(a: u32, b: u32) -> DriverResult<bool> {
    if a == b {
        return Ok(true);
    }
    let (mut da, mut db) = (0, 0);
    let mut can = 0;
    // SAFETY: out-pointers to live locals; plain ordinals.
    unsafe {
        check("cuDeviceGet", sys::cuDeviceGet(&mut da, a as i32))?;
        check("cuDeviceGet", sys::cuDeviceGet(&mut db, b as i32))?;
        check(
            "cuDeviceCanAccessPeer",
            sys::cuDeviceCanAccessPeer(&mut can, da, db),
        )?;
    }
    Ok(can != 0)
}

/// Enqueues `copies` on `stream`: one `cuMemcpyBatchAsync` where the driver has it (CUDA 12.8
/// and later), else one `cuMemcpyDtoDAsync` each. Returns whether the batch call was used.
///
/// # Safety
/// Every range is valid device memory for as long as the stream's work runs; `stream` is a
/// live stream of the current context.
pub unsafe fn copy_batch_async(copies: &[Copy], stream: sys::CUstream) -> DriverResult<bool> {
    if copies.len() > 1 && batch_available() {
        let mut dsts: Vec<u64> = copies.iter().map(|c| c.dst).collect();
        let mut srcs: Vec<u64> = copies.iter().map(|c| c.src).collect();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.len).collect();
        // SAFETY: zeroed attributes are their documented default; the access order is set.
        let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        let mut idx = 0usize;
        // SAFETY: the three arrays hold `copies.len()` entries each and live for the call; one
        // attribute applies from index 0; the ranges are the caller's promise.
        let r = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                copies.len(),
                &mut attr,
                &mut idx,
                1,
                stream,
            )
        };
        check("cuMemcpyBatchAsync", r)?;
        return Ok(true);
    }
    for c in copies {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            check(
                "cuMemcpyDtoDAsync",
                sys::cuMemcpyDtoDAsync_v2(c.dst, c.src, c.len, stream),
            )?
        };
    }
    Ok(false)
}

/// Whether the driver exports `cuMemcpyBatchAsync_v2` (probed once; cudarc panics on a
/// missing symbol, so the lookup runs guarded).
pub fn batch_available() -> bool {
    static P: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        std::panic::catch_unwind(|| {
            // SAFETY: a call with null arrays and count 0 is rejected by the driver with
            // CUDA_ERROR_INVALID_VALUE without touching memory; a missing symbol panics in
            // cudarc, caught here.
            let r = unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                    std::ptr::null_mut(),
                )
            };
            r != sys::CUresult::CUDA_ERROR_NOT_FOUND
        })
        .unwrap_or(false)
    })
}

/// Copies of at least this many bytes go to `cuMemcpyDtoDAsync` (the driver call's cost is
/// small beside them); smaller ones go to the piece kernel.
pub const DIRECT_COPY_MIN: usize = 16 << 20;
/// The longest piece of the piece kernel: longer ones are cut, so that one long piece does not
/// keep one warp busy while the others idle.
pub const KERNEL_PIECE_MAX: usize = 256 << 10;
/// The shortest cut: pieces are cut no finer than this.
pub const KERNEL_PIECE_MIN: usize = 4 << 10;
/// Pieces wanted per launch: about two per block an H100/H200 keeps resident (132
/// multiprocessors × 8 blocks of 256 threads).
pub const KERNEL_PIECES_WANTED: usize = 2048;

/// How a list of copies is carried out: `direct` copies one driver call each, `pieces` in one
/// launch of the piece kernel. Small copies are cut to a length between [`KERNEL_PIECE_MIN`]
/// and [`KERNEL_PIECE_MAX`] (a power of two, 16-byte multiple) that gives about
/// [`KERNEL_PIECES_WANTED`] pieces. A single small copy goes direct (a launch costs about what
/// a call does).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyPlan {
    /// One `cuMemcpyDtoDAsync` each.
    pub direct: Vec<Copy>,
    /// The piece kernel's table.
    pub pieces: Vec<Copy>,
}

/// Splits `copies` (empty ones dropped) into a [`CopyPlan`].
pub fn plan_copies(copies: &[Copy]) -> CopyPlan {
    let mut plan = CopyPlan::default();
    let small: Vec<&Copy> = copies
        .iter()
        .filter(|c| c.len > 0 && c.len < DIRECT_COPY_MIN)
        .collect();
    for c in copies.iter().filter(|c| c.len >= DIRECT_COPY_MIN) {
        plan.direct.push(*c);
    }
    if small.len() == 1 {
        plan.direct.push(*small[0]);
        return plan;
    }
    let bytes: usize = small.iter().map(|c| c.len).sum();
    let cut = (bytes / KERNEL_PIECES_WANTED)
        .next_power_of_two()
        .clamp(KERNEL_PIECE_MIN, KERNEL_PIECE_MAX);
    for c in small {
        let mut off = 0;
        while off < c.len {
            let len = cut.min(c.len - off);
            plan.pieces.push(Copy {
                dst: c.dst + off as u64,
                src: c.src + off as u64,
                len,
            });
            off += len;
        }
    }
    plan
}

/// The piece kernel's source (compiled with NVRTC on first use per device).
pub const COPY_SRC: &str = include_str!("../kernels/copy.cu");

/// The gather/scatter piece kernel loaded in one device's context. Shared by any number of
/// enqueues at once; each brings its own [`PieceTable`].
pub struct PieceKernel(LoadedKernel);

impl PieceKernel {
    /// Compiles and loads the kernel for `ordinal`'s device. Errors: NVRTC missing or failing,
    /// the driver's.
    pub fn new(ordinal: u32) -> DriverResult<PieceKernel> {
        LoadedKernel::load(ordinal, COPY_SRC, "copy.cu", "kvf_copy_pieces").map(PieceKernel)
    }

    /// Enqueues `plan` on `stream`: its direct copies, then one launch for its pieces (the
    /// table goes up with an async copy on the same stream first).
    ///
    /// # Safety
    /// Every range is valid device memory until the stream's work completes; `stream` belongs
    /// to this kernel's context; `table`'s previous launch has completed and `table` lives
    /// until this one has.
    pub unsafe fn enqueue(
        &self,
        plan: &CopyPlan,
        table: &mut PieceTable,
        stream: sys::CUstream,
    ) -> DriverResult<()> {
        let k = &self.0;
        k.bind()?;
        for c in &plan.direct {
            // SAFETY: forwarded from this function's contract.
            unsafe {
                check(
                    "cuMemcpyDtoDAsync",
                    sys::cuMemcpyDtoDAsync_v2(c.dst, c.src, c.len, stream),
                )?
            };
        }
        if plan.pieces.is_empty() {
            return Ok(());
        }
        let n = u32::try_from(plan.pieces.len()).map_err(|_| {
            CudaError::Invalid(InvalidArg::TooMany {
                what: "pieces",
                count: plan.pieces.len(),
            })
        })?;
        let fill = |words: &mut [u64]| {
            for (i, c) in plan.pieces.iter().enumerate() {
                words[3 * i] = c.dst;
                words[3 * i + 1] = c.src;
                words[3 * i + 2] = c.len as u64;
            }
        };
        // SAFETY: forwarded from this function's contract; the context is bound above.
        let mut table_ptr = unsafe { k.upload(table, 3 * plan.pieces.len(), fill, stream) }?;
        let mut count = n;
        // One block per piece at a time.
        let grid = n.min(k.grid_max);
        // SAFETY: the kernel's arguments are a device pointer and a u32, as its signature; the
        // table it names lives until the launch completed (contract).
        unsafe {
            k.launch(
                stream,
                grid,
                &mut [
                    &mut table_ptr as *mut u64 as *mut c_void,
                    &mut count as *mut u32 as *mut c_void,
                ],
            )
        }
    }
}

/// The UUID of device `ordinal`, as 32 lowercase hex digits: the name by which two processes
/// with different `CUDA_VISIBLE_DEVICES` agree on a device. Errors: the driver's.
pub fn device_uuid(ordinal: u32) -> DriverResult<String> {
    let mut dev = 0;
    let mut u = sys::CUuuid_st { bytes: [0; 16] };
    // SAFETY: out-pointers to live locals.
    unsafe {
        check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal as i32))?;
        check("cuDeviceGetUuid", sys::cuDeviceGetUuid_v2(&mut u, dev))?;
    }
    Ok(u.bytes
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect())
}

/// The ordinal of the device whose UUID is `uuid` (as [`device_uuid`] writes it), if this
/// process sees it.
pub fn ordinal_of_uuid(uuid: &str) -> Option<u32> {
    let mut n = 0;
    // SAFETY: out-pointer to a live local.
    unsafe { check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut n)).ok()? };
    (0..n.max(0) as u32).find(|&o| device_uuid(o).is_ok_and(|u| u == uuid))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(dst: u64, src: u64, len: usize) -> Copy {
        Copy { dst, src, len }
    }

    #[test]
    fn large_copies_go_direct_small_ones_to_the_kernel_cut_for_parallelism() {
        let big = c(0, 1 << 40, DIRECT_COPY_MIN);
        let p = plan_copies(&[
            c(0, 0, 0),
            big,
            c(100, 200, 3000),
            c(1 << 30, 1 << 31, 8192 + 16),
        ]);
        assert_eq!(p.direct, vec![big]);
        // 11 KiB of small copies: cut at the shortest piece length
        assert_eq!(
            p.pieces,
            vec![
                c(100, 200, 3000),
                c(1 << 30, 1 << 31, 4096),
                c((1 << 30) + 4096, (1 << 31) + 4096, 4096),
                c((1 << 30) + 8192, (1 << 31) + 8192, 16),
            ]
        );
        let total: usize = p.direct.iter().chain(&p.pieces).map(|x| x.len).sum();
        assert_eq!(total, DIRECT_COPY_MIN + 3000 + 8192 + 16, "every byte once");
    }

    #[test]
    fn the_cut_grows_with_the_bytes_up_to_its_longest() {
        // 4 MiB in two copies: 4 MiB / 2048 = 2 KiB -> the shortest cut
        let p = plan_copies(&[c(0, 0, 2 << 20), c(1 << 30, 1 << 31, 2 << 20)]);
        assert!(p.pieces.iter().all(|x| x.len == KERNEL_PIECE_MIN));
        // 16 copies of 15 MiB: 240 MiB / 2048 = 120 KiB -> 128 KiB
        let many: Vec<Copy> = (0..16u64)
            .map(|i| c(i << 32, (i << 32) + (1 << 31), 15 << 20))
            .collect();
        let p = plan_copies(&many);
        assert!(
            p.pieces.iter().all(|x| x.len == 128 << 10),
            "{:?}",
            &p.pieces[..2]
        );
        // 200 of them: 3000 MiB / 2048 -> past the longest cut, held at it
        let many: Vec<Copy> = (0..200u64)
            .map(|i| c(i << 32, (i << 32) + (1 << 31), 15 << 20))
            .collect();
        let p = plan_copies(&many);
        assert!(
            p.pieces.iter().all(|x| x.len == KERNEL_PIECE_MAX),
            "{:?}",
            &p.pieces[..2]
        );
        assert_eq!(p.pieces.len(), 200 * 60);
    }

    #[test]
    fn a_single_small_copy_is_one_driver_call() {
        let p = plan_copies(&[c(1, 2, 3 << 20)]);
        assert_eq!(p.direct, vec![c(1, 2, 3 << 20)]);
        assert!(p.pieces.is_empty());
        assert_eq!(plan_copies(&[]), CopyPlan::default());
    }
}
