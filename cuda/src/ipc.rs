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

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use crate::driver::{check, Context, DriverResult};
use crate::error::CudaError;

/// How an allocation was made, which decides how a peer process can map it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AllocationKind {
    /// `cuMemAlloc` (the CUDA runtime's `cudaMalloc`, PyTorch's default caching allocator):
    /// shared with `cuIpcGetMemHandle` on the allocation's base.
    Legacy,
    /// `cuMemCreate` with the POSIX file descriptor handle type: shared as a file descriptor.
    VmmFd,
}

/// One device allocation as the driver sees it: its base address, size in bytes, kind and
/// device ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Device address of the allocation's first byte (`cuMemGetAddressRange`).
    pub base: u64,
    /// Bytes from `base`.
    pub size: u64,
    /// How a peer maps it.
    pub kind: AllocationKind,
    /// The CUDA device ordinal it lives on.
    pub ordinal: u32,
}

/// Why an allocation cannot be shared with another process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportRefused {
    /// The address is not device memory the driver knows (host memory, a freed pointer).
    #[error("{addr:#x} is not device memory: {source}")]
    NotDeviceMemory {
        /// The address asked about.
        addr: u64,
        /// The driver's answer.
        #[source]
        source: CudaError,
    },
    /// A `cuMemCreate` allocation made without the POSIX file descriptor handle type: neither
    /// legacy IPC nor fd export can share it (allocate with
    /// `requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    #[error(
        "{addr:#x} is a cuMemCreate allocation without the POSIX file descriptor handle type \
         (allowed handle types {allowed:#x}): it cannot be exported to another process"
    )]
    VmmNotExportable {
        /// The address asked about.
        addr: u64,
        /// The allocation's `CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES` bit set.
        allowed: u64,
    },
    /// The driver refused the export itself.
    #[error("exporting {addr:#x}: {source}")]
    Driver {
        /// The address asked about.
        addr: u64,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
}

/// `cuPointerGetAttribute(attr, addr)` into a `T`.
///
/// # Safety
/// `T` is the type the driver writes for `attr`.
unsafe fn attribute<T: Default>(attr: sys::CUpointer_attribute, addr: u64) -> DriverResult<T> {
    let mut v = T::default();
    // SAFETY: `v` is a live `T`, the type the caller promises the driver writes for `attr`.
    let r = unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut c_void, attr, addr) };
    check(&format!("cuPointerGetAttribute({attr:?})"), r)?;
    Ok(v)
}

/// The allocation holding device address `addr` and how it can be shared; the context of its
/// device must be current. Errors: [`ExportRefused`] naming why it cannot be shared.
pub fn allocation_of(addr: u64) -> Result<Allocation, ExportRefused> {
    use sys::CUpointer_attribute as A;
    let not_device = |source| ExportRefused::NotDeviceMemory { addr, source };
    let mut base = 0;
    let mut size = 0usize;
    // SAFETY: out-pointers to live locals.
    unsafe {
        check(
            "cuMemGetAddressRange",
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr),
        )
    }
    .map_err(not_device)?;
    // SAFETY: DEVICE_ORDINAL is written as an int.
    let ordinal: i32 =
        unsafe { attribute(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr) }.map_err(not_device)?;
    // cuMemRetainAllocationHandle succeeds only for cuMemCreate memory.
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a live local; `addr` is passed as the address the driver looks up.
    let vmm = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut c_void) };
    let kind = if vmm == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the retained handle is released once, here.
        unsafe {
            let _ = sys::cuMemRelease(handle);
        }
        // SAFETY: ALLOWED_HANDLE_TYPES is written as a u64 bit set.
        let allowed: u64 = unsafe { attribute(A::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, addr) }
            .map_err(not_device)?;
        let fd = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 as u64;
        if allowed & fd == 0 {
            return Err(ExportRefused::VmmNotExportable { addr, allowed });
        }
        AllocationKind::VmmFd
    } else {
        AllocationKind::Legacy
    };
    Ok(Allocation {
        base,
        size: size as u64,
        kind,
        ordinal: ordinal.max(0) as u32,
    })
}

/// A legacy IPC handle: 64 opaque bytes naming one `cuMemAlloc` allocation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LegacyHandle(pub [u8; 64]);

impl std::fmt::Debug for LegacyHandle {
    // The handle grants access to the allocation: never printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LegacyHandle(..)")
    }
}

/// `cuIpcGetMemHandle` of the allocation starting at `base` (the context of its device
/// current). Errors: [`ExportRefused::Driver`] (e.g. `CUDA_ERROR_INVALID_VALUE` on
/// virtual-memory allocations).
pub fn legacy_handle(base: u64) -> Result<LegacyHandle, ExportRefused> {
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: `h` is a live handle struct the driver writes.
    unsafe { check("cuIpcGetMemHandle", sys::cuIpcGetMemHandle(&mut h, base)) }
        .map_err(|source| ExportRefused::Driver { addr: base, source })?;
    Ok(LegacyHandle(h.reserved.map(|c| c as u8)))
}

/// Another process's `cuMemAlloc` allocation opened in this one; closed on drop.
pub struct OpenedLegacy {
    ptr: u64,
    ctx: sys::CUcontext,
}
// SAFETY: a device address, usable from any thread with its context bound.
unsafe impl Send for OpenedLegacy {}
// SAFETY: as for Send: shared access only reads the address.
unsafe impl Sync for OpenedLegacy {}

impl OpenedLegacy {
    /// Opens `handle` in `ctx` (made current here), with peer access enabled lazily where the
    /// allocation is on another device. Errors: the driver's (`CUDA_ERROR_INVALID_CONTEXT` for
    /// a handle of this same process, `CUDA_ERROR_INVALID_VALUE` for one of a process that
    /// freed it or died).
    pub fn open(ctx: &Context, handle: &LegacyHandle) -> DriverResult<OpenedLegacy> {
        ctx.bind()?;
        let h = sys::CUipcMemHandle_st {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        // SAFETY: `ptr` is a live local the driver writes; the handle is passed by value.
        unsafe {
            check(
                "cuIpcOpenMemHandle",
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                ),
            )?
        };
        Ok(OpenedLegacy {
            ptr,
            ctx: ctx.raw(),
        })
    }

    /// The allocation's base in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for OpenedLegacy {
    fn drop(&mut self) {
        // SAFETY: the mapping was opened by `open` in this context and is closed once, here.
        unsafe {
            let _ = sys::cuCtxSetCurrent(self.ctx);
            let _ = sys::cuIpcCloseMemHandle(self.ptr);
        }
    }
}

/// `cuMemExportToShareableHandle` of the virtual-memory allocation mapped at `addr`, as a
/// POSIX file descriptor (owned by the caller; the peer's import keeps the memory alive, not
/// the descriptor). Errors: [`ExportRefused`] naming why.
pub fn export_vmm(addr: u64) -> Result<OwnedFd, ExportRefused> {
    let driver = |source| ExportRefused::Driver { addr, source };
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a live local; the retained handle is released below.
    unsafe {
        check(
            "cuMemRetainAllocationHandle",
            sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut c_void),
        )
    }
    .map_err(driver)?;
    let mut fd: i32 = -1;
    // SAFETY: `fd` is a live int the driver writes (the POSIX fd handle type writes an int);
    // `handle` was retained above and is released once after the export.
    let r = unsafe {
        let r = check(
            "cuMemExportToShareableHandle",
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut i32 as *mut c_void,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            ),
        );
        let _ = sys::cuMemRelease(handle);
        r
    };
    r.map_err(driver)?;
    if fd < 0 {
        return Err(driver(CudaError::Invalid(
            "cuMemExportToShareableHandle returned no file descriptor".into(),
        )));
    }
    // SAFETY: the driver returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Another process's virtual-memory allocation mapped into this one from its file descriptor:
/// an address range of our own, unmapped, freed and released on drop.
pub struct ImportedVmm {
    ptr: u64,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
    ctx: sys::CUcontext,
}
// SAFETY: a device address range, usable from any thread with its context bound.
unsafe impl Send for ImportedVmm {}
// SAFETY: as for Send: shared access only reads the address.
unsafe impl Sync for ImportedVmm {}

impl ImportedVmm {
    /// Imports the allocation behind `fd` (of `size` bytes, the exporter's allocation size),
    /// maps it at a fresh address range and gives `ctx`'s device read-write access. Errors:
    /// the failing driver call; nothing stays mapped or reserved then.
    pub fn import(ctx: &Context, fd: &OwnedFd, size: u64) -> DriverResult<ImportedVmm> {
        ctx.bind()?;
        let size = usize::try_from(size)
            .map_err(|_| CudaError::Invalid(format!("allocation size {size} too large")))?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the POSIX fd handle type takes the descriptor's value cast to a pointer
        // (CUDA's documented convention); `handle` is a live local.
        unsafe {
            check(
                "cuMemImportFromShareableHandle",
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    fd.as_raw_fd() as isize as *mut c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                ),
            )?
        };
        let release = |h| {
            // SAFETY: `h` was imported above and is released once, on this failure path.
            unsafe {
                let _ = sys::cuMemRelease(h);
            }
        };
        let mut ptr = 0;
        // SAFETY: `ptr` is a live local; a reservation of `size` bytes anywhere.
        if let Err(e) = unsafe {
            check(
                "cuMemAddressReserve",
                sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0),
            )
        } {
            release(handle);
            return Err(e);
        }
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ctx.ordinal() as i32,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `[ptr, +size)` was reserved above; the handle covers `size` bytes (the
        // exporter's allocation size); on failure everything done so far is undone.
        let mapped = unsafe {
            check("cuMemMap", sys::cuMemMap(ptr, size, 0, handle, 0)).and_then(|_| {
                check("cuMemSetAccess", sys::cuMemSetAccess(ptr, size, &access, 1)).inspect_err(
                    |_| {
                        let _ = sys::cuMemUnmap(ptr, size);
                    },
                )
            })
        };
        if let Err(e) = mapped {
            // SAFETY: the reservation made above is freed once, on this failure path.
            unsafe {
                let _ = sys::cuMemAddressFree(ptr, size);
            }
            release(handle);
            return Err(e);
        }
        Ok(ImportedVmm {
            ptr,
            size,
            handle,
            ctx: ctx.raw(),
        })
    }

    /// The allocation's base in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for ImportedVmm {
    fn drop(&mut self) {
        // SAFETY: mapping, reservation and handle were made by `import` and are undone once,
        // here, with the context bound.
        unsafe {
            let _ = sys::cuCtxSetCurrent(self.ctx);
            let _ = sys::cuMemUnmap(self.ptr, self.size);
            let _ = sys::cuMemAddressFree(self.ptr, self.size);
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}

/// Device memory from `cuMemCreate` with the POSIX file descriptor handle type, mapped
/// read-write for its device: what PyTorch's expandable segments and vLLM's cumem allocator
/// make. Used by tests and benchmarks of the fd path; freed on drop.
pub struct VmmBuffer {
    ptr: u64,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
    ctx: sys::CUcontext,
}
// SAFETY: a device address range, usable from any thread with its context bound.
unsafe impl Send for VmmBuffer {}
// SAFETY: as for Send.
unsafe impl Sync for VmmBuffer {}

impl VmmBuffer {
    /// Allocates at least `len` bytes (rounded up to the allocation granularity) on `ctx`'s
    /// device, exportable as a file descriptor. Errors: the failing driver call.
    pub fn new(ctx: &Context, len: usize) -> DriverResult<VmmBuffer> {
        ctx.bind()?;
        // SAFETY: a zeroed property struct is its documented default; the fields set below
        // are the ones cuMemCreate reads.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ctx.ordinal() as i32;
        let mut gran = 0usize;
        // SAFETY: `gran` is a live local, `prop` a filled property struct.
        unsafe {
            check(
                "cuMemGetAllocationGranularity",
                sys::cuMemGetAllocationGranularity(
                    &mut gran,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
            )?
        };
        let size = len.max(1).div_ceil(gran.max(1)) * gran.max(1);
        let mut handle = 0;
        // SAFETY: `handle` is a live local, `prop` a filled property struct.
        unsafe { check("cuMemCreate", sys::cuMemCreate(&mut handle, size, &prop, 0))? };
        let mut ptr = 0;
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: reserve, map and set access on the range just reserved for the handle just
        // created; on failure each step is undone.
        let r = unsafe {
            check(
                "cuMemAddressReserve",
                sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0),
            )
            .and_then(|_| {
                check("cuMemMap", sys::cuMemMap(ptr, size, 0, handle, 0)).inspect_err(|_| {
                    let _ = sys::cuMemAddressFree(ptr, size);
                })
            })
            .and_then(|_| {
                check("cuMemSetAccess", sys::cuMemSetAccess(ptr, size, &access, 1)).inspect_err(
                    |_| {
                        let _ = sys::cuMemUnmap(ptr, size);
                        let _ = sys::cuMemAddressFree(ptr, size);
                    },
                )
            })
        };
        if let Err(e) = r {
            // SAFETY: the handle created above is released once, on this failure path.
            unsafe {
                let _ = sys::cuMemRelease(handle);
            }
            return Err(e);
        }
        Ok(VmmBuffer {
            ptr,
            size,
            handle,
            ctx: ctx.raw(),
        })
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes mapped (the requested length rounded up to the granularity).
    pub fn len(&self) -> usize {
        self.size
    }

    /// Whether no bytes are mapped (never, once made).
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        // SAFETY: mapping, reservation and handle were made by `new` and are undone once, here.
        unsafe {
            let _ = sys::cuCtxSetCurrent(self.ctx);
            let _ = sys::cuMemUnmap(self.ptr, self.size);
            let _ = sys::cuMemAddressFree(self.ptr, self.size);
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}

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

/// One copy of a batch: `len` bytes from device address `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    /// Destination device address.
    pub dst: u64,
    /// Source device address.
    pub src: u64,
    /// Bytes.
    pub len: usize,
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

/// The gather/scatter piece kernel loaded in one context, with a table buffer (pinned host
/// and device) that grows as needed. One enqueue at a time: the table is reused by the next
/// enqueue only after the caller has seen the previous one's work complete (an event).
pub struct PieceCopier {
    _module: crate::driver::Module,
    func: crate::driver::Function,
    grid_max: u32,
    table: Option<(crate::driver::PinnedBuffer, crate::driver::DeviceBuffer)>,
    // Last: the buffers and module above are released with the context still retained.
    ctx: Context,
}

impl PieceCopier {
    /// Compiles and loads the kernel for `ordinal`'s device. Errors: NVRTC missing or failing,
    /// the driver's.
    pub fn new(ordinal: u32) -> DriverResult<PieceCopier> {
        let ctx = Context::new(ordinal)?;
        let image = crate::nvrtc::compile(COPY_SRC, "copy.cu", ctx.compute_capability()?)?;
        let module = crate::driver::Module::load(&ctx, &image)?;
        let func = module.function("kvf_copy_pieces")?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as u32;
        let grid_max = sms.max(1) * func.occupancy(256)?;
        Ok(PieceCopier {
            _module: module,
            func,
            grid_max,
            table: None,
            ctx,
        })
    }

    /// Enqueues `plan` on `stream`: its direct copies, then one launch for its pieces (the
    /// table goes up with an async copy on the same stream first).
    ///
    /// # Safety
    /// Every range is valid device memory until the stream's work completes; `stream` belongs
    /// to this copier's context; the previous enqueue's work has completed.
    pub unsafe fn enqueue(&mut self, plan: &CopyPlan, stream: sys::CUstream) -> DriverResult<()> {
        self.ctx.bind()?;
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
            CudaError::Invalid(format!("{} pieces in one launch", plan.pieces.len()))
        })?;
        let bytes = plan.pieces.len() * 24;
        if self.table.as_ref().is_none_or(|(h, _)| h.len() < bytes) {
            let cap = bytes.next_power_of_two().max(64 << 10);
            self.table = Some((
                crate::driver::PinnedBuffer::new(&self.ctx, cap)?,
                crate::driver::DeviceBuffer::new(&self.ctx, cap)?,
            ));
        }
        let (host, dev) = self.table.as_ref().expect("made above");
        // SAFETY: the pinned table holds at least `bytes`; the previous enqueue's upload has
        // completed (contract), so nothing reads it now.
        let words = unsafe { std::slice::from_raw_parts_mut(host.as_ptr() as *mut u64, bytes / 8) };
        for (i, c) in plan.pieces.iter().enumerate() {
            words[3 * i] = c.dst;
            words[3 * i + 1] = c.src;
            words[3 * i + 2] = c.len as u64;
        }
        let mut table = dev.ptr();
        let mut count = n;
        // One block per piece at a time.
        let grid = n.min(self.grid_max);
        // SAFETY: the upload reads `bytes` of pinned memory kept until the next enqueue; the
        // kernel's arguments are a device pointer and a u32, as its signature.
        unsafe {
            crate::driver::copy_htod_async(dev.ptr(), host.as_ptr(), bytes, stream)?;
            self.func.launch(
                stream,
                grid,
                256,
                &mut [
                    &mut table as *mut u64 as *mut c_void,
                    &mut count as *mut u32 as *mut c_void,
                ],
            )?;
        }
        Ok(())
    }
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
