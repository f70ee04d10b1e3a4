//! The export and import half of `super` (see its docs): which kind an allocation is, legacy
//! IPC handles, virtual-memory allocations exported as file descriptors and mapped by the
//! peer, and the exportable buffers made for tests and benchmarks.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use crate::driver::{check, Context, DriverResult};
use crate::error::{CudaError, InvalidArg};

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
    /// Bytes mapped at `ptr`, as the driver reports them.
    size: u64,
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
        let mut opened = OpenedLegacy {
            ptr,
            size: 0,
            ctx: ctx.raw(),
        };
        // What was mapped, not what the peer says it exported: copies are bounded by it.
        // (On an error `opened` is dropped, which closes the handle.)
        let (mut base, mut size) = (0, 0usize);
        // SAFETY: out-pointers to live locals; `ptr` was just mapped in the current context.
        unsafe {
            check(
                "cuMemGetAddressRange",
                sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr),
            )?
        };
        opened.size = if base == ptr { size as u64 } else { 0 };
        Ok(opened)
    }

    /// The allocation's base in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes mapped from [`OpenedLegacy::ptr`] on (0 where the driver placed the handle's
    /// memory elsewhere than at the returned address).
    pub fn size(&self) -> u64 {
        self.size
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
        return Err(driver(CudaError::Invalid(InvalidArg::NoFd)));
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
        let size = usize::try_from(size).map_err(|_| CudaError::Invalid(InvalidArg::Size(size)))?;
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
