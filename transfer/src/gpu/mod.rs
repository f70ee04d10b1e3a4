//! GPU memory for the transfer engine (docs/design.md §3 "GPU memory").
//!
//! * [`memory_access`]: the engine's [`MemoryAccess`] for `cuda:N` regions, used by the TCP
//!   transport: copies between device memory (any plain `cuMemAlloc` allocation) and the
//!   transport's host buffers through pinned staging buffers, double-buffered on a stream
//!   of their own. Where CUDA is absent it refuses `cuda:N` with `Unsupported` (never
//!   panics): cudarc loads `libcuda` lazily and panics when it is missing, so the library
//!   is probed first and the first calls run inside `catch_unwind`.
//! * [`export_dmabuf`]: `cuMemGetHandleForAddressRange` → a dma-buf fd for a device range,
//!   which the RDMA transport registers with `ibv_reg_dmabuf_mr` (installed as its exporter
//!   by [`memory_access`] when the RDMA module is built).

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvferry_cuda::driver::Context;
use kvferry_cuda::sys;
use kvferry_cuda::CudaError;

use crate::error::{ArgumentError, Result, Shared, TransferError, UnsupportedError};
use crate::memory::{DmabufRange, MemoryAccess, MemoryRegion};
use crate::types::Location;

/// Bytes per staging half: a copy moves in chunks of this size, one chunk in flight on the
/// device while the previous one is copied on the host.
const CHUNK: usize = 1 << 20;
/// Longest wait for one chunk's device copy.
const COPY_DEADLINE: Duration = Duration::from_secs(30);

/// The `MemoryAccess` for `cuda:N` (and host) memory, with the dma-buf exporter the RDMA
/// transport registers `cuda:N` regions through (`MemoryAccess::export_dmabuf`; it travels
/// with the engine's memory access, nothing is installed globally). Never panics; CUDA is
/// probed on first use.
pub fn memory_access() -> Arc<dyn MemoryAccess> {
    Arc::new(CudaMemoryAccess)
}

fn check(what: &str, r: sys::CUresult) -> std::result::Result<(), CudaError> {
    r.result().map_err(|e| CudaError::driver(what, e))
}

/// A CUDA failure as the engine's `Gpu` error, the `CudaError` kept as its source.
fn io(e: CudaError) -> TransferError {
    TransferError::gpu(e)
}

/// Whether the CUDA driver is usable here (the device count, or why not): kvferry-cuda's one
/// probe, shared with the checksum kernels.
pub use kvferry_cuda::cuda_available;
use kvferry_cuda::guarded;

/// Pinned host memory in two halves with an event each, and a stream: one copy at a time.
struct Staging {
    host: *mut u8,
    stream: sys::CUstream,
    events: [sys::CUevent; 2],
}

// SAFETY: the raw handles are used by one copy at a time (the pool hands a set to one caller).
unsafe impl Send for Staging {}

/// One device's primary context (kvferry-cuda's [`Context`]) and its staging pool (kept for
/// the process's life).
struct DeviceState {
    ctx: Context,
    pool: Mutex<Vec<Staging>>,
}

fn device(n: u32) -> Result<&'static DeviceState> {
    static ALL: OnceLock<
        Mutex<HashMap<u32, std::result::Result<&'static DeviceState, CudaError>>>,
    > = OnceLock::new();
    let count = cuda_available().map_err(|why| unsupported(Location::Cuda(n), &why))?;
    let mut all = ALL.get_or_init(Default::default).locked();
    let r = all.entry(n).or_insert_with(|| {
        if n >= count {
            return Err(CudaError::NoSuchDevice { ordinal: n, count });
        }
        guarded("cuda device", || {
            let state: &'static DeviceState = Box::leak(Box::new(DeviceState {
                ctx: Context::new(n)?,
                pool: Mutex::new(Vec::new()),
            }));
            Ok(state)
        })
    });
    r.clone()
        .map_err(|why| unsupported(Location::Cuda(n), &why))
}

fn unsupported(location: Location, why: &CudaError) -> TransferError {
    TransferError::Unsupported(UnsupportedError::Unusable {
        location,
        why: Shared(Arc::new(why.clone())),
    })
}

impl DeviceState {
    fn bind(&self) -> Result<()> {
        self.ctx.bind().map_err(io)
    }

    fn take(&self) -> Result<Staging> {
        if let Some(s) = self.pool.locked().pop() {
            return Ok(s);
        }
        // First use (or more concurrent copies than before): allocate a staging set.
        // SAFETY: out-pointers to live locals; the device's context was made current by the
        // caller (`bind`); on failure the pinned allocation is freed once and nothing else refers
        // to it.
        unsafe {
            let mut host: *mut c_void = std::ptr::null_mut();
            check(
                "cuMemHostAlloc",
                sys::cuMemHostAlloc(&mut host, 2 * CHUNK, 0),
            )
            .map_err(io)?;
            let mut stream = std::ptr::null_mut();
            let mut events = [std::ptr::null_mut(); 2];
            let made = (|| {
                check(
                    "cuStreamCreate",
                    sys::cuStreamCreate(
                        &mut stream,
                        sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    ),
                )?;
                for e in events.iter_mut() {
                    check(
                        "cuEventCreate",
                        sys::cuEventCreate(e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
                    )?;
                }
                Ok::<(), CudaError>(())
            })();
            if let Err(e) = made {
                let _ = sys::cuMemFreeHost(host);
                return Err(io(e));
            }
            Ok(Staging {
                host: host as *mut u8,
                stream,
                events,
            })
        }
    }

    fn give(&self, s: Staging) {
        self.pool.locked().push(s);
    }
}

impl Staging {
    fn half(&self, k: usize) -> *mut u8 {
        // SAFETY: the allocation holds two halves of CHUNK bytes.
        unsafe { self.host.add((k % 2) * CHUNK) }
    }

    unsafe fn record(&self, k: usize) -> Result<()> {
        // SAFETY: the stream and event are live handles owned by this staging set.
        unsafe {
            check(
                "cuEventRecord",
                sys::cuEventRecord(self.events[k % 2], self.stream),
            )
        }
        .map_err(io)
    }

    /// Waits (polling, with a deadline) until the work recorded on half `k` is done.
    fn wait(&self, k: usize) -> Result<()> {
        let deadline = Instant::now() + COPY_DEADLINE;
        let mut spins = 0u32;
        loop {
            // SAFETY: the event is a live handle owned by this staging set.
            match unsafe { sys::cuEventQuery(self.events[k % 2]) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(TransferError::gpu(format!("GPU copy failed: {e:?}"))),
            }
            if Instant::now() >= deadline {
                return Err(TransferError::Timeout(COPY_DEADLINE));
            }
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(5));
            }
        }
    }
}

/// `MemoryAccess` through CUDA: host memory in place, `cuda:N` memory through pinned
/// staging. Each copy is complete (device work waited for) when the call returns.
#[derive(Debug, Default, Clone, Copy)]
pub struct CudaMemoryAccess;

impl MemoryAccess for CudaMemoryAccess {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn check(&self, location: Location) -> Result<()> {
        match location {
            Location::Cpu => Ok(()),
            Location::Cuda(n) => device(n).map(|_| ()),
        }
    }

    fn export_dmabuf(&self, region: &MemoryRegion) -> Result<DmabufRange> {
        let (fd, offset) = export_dmabuf(region)?;
        Ok(DmabufRange { fd, offset })
    }

    fn check_region(&self, region: &MemoryRegion) -> Result<()> {
        let Location::Cuda(n) = region.location else {
            return Ok(());
        };
        let d = device(n)?;
        d.bind()?;
        let (start, size, ordinal) = allocation_of(region.addr).map_err(|why| {
            TransferError::InvalidArgument(ArgumentError::NotDeviceMemory {
                addr: region.addr,
                len: region.len,
                ordinal: n,
                source: Shared(Arc::new(why)),
            })
        })?;
        if ordinal != n as i32 || region.end() > start + size {
            return Err(ArgumentError::SpansAllocations {
                addr: region.addr,
                len: region.len,
                ordinal: n,
                alloc_addr: start,
                alloc_len: size,
                alloc_ordinal: i64::from(ordinal),
            }
            .into());
        }
        Ok(())
    }

    unsafe fn copy_from(&self, location: Location, src_addr: u64, dst: &mut [u8]) -> Result<()> {
        let n = match location {
            Location::Cpu => {
                // SAFETY: the caller promises the source range is valid host memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src_addr as *const u8,
                        dst.as_mut_ptr(),
                        dst.len(),
                    )
                };
                return Ok(());
            }
            Location::Cuda(n) => n,
        };
        let d = device(n)?;
        d.bind()?;
        let st = d.take()?;
        // Chunk k goes device -> half k%2 while chunk k-1 goes half -> dst.
        let r = (|| -> Result<()> {
            let chunks: Vec<(usize, usize)> = (0..dst.len())
                .step_by(CHUNK)
                .map(|o| (o, CHUNK.min(dst.len() - o)))
                .collect();
            for (k, &(off, len)) in chunks.iter().enumerate() {
                // SAFETY: `st.half(k)` has CHUNK >= `len` bytes of pinned memory that no other
                // copy uses (the set is ours); the caller promises `[src_addr + off, +len)` is
                // device memory of cuda:n; the event is recorded after the copy on the set's
                // stream.
                unsafe {
                    check(
                        "cuMemcpyDtoHAsync",
                        sys::cuMemcpyDtoHAsync_v2(
                            st.half(k) as *mut c_void,
                            src_addr + off as u64,
                            len,
                            st.stream,
                        ),
                    )
                    .map_err(io)?;
                    st.record(k)?;
                }
                if k > 0 {
                    let (po, pl) = chunks[k - 1];
                    st.wait(k - 1)?;
                    // SAFETY: the half holds the previous chunk, which the device finished writing.
                    unsafe {
                        std::ptr::copy_nonoverlapping(st.half(k - 1), dst.as_mut_ptr().add(po), pl)
                    };
                }
            }
            if let Some(&(lo, ll)) = chunks.last() {
                let k = chunks.len() - 1;
                st.wait(k)?;
                // SAFETY: the last chunk's copy into half k has completed (waited above); `dst`
                // has `ll` bytes at `lo`.
                unsafe { std::ptr::copy_nonoverlapping(st.half(k), dst.as_mut_ptr().add(lo), ll) };
            }
            Ok(())
        })();
        // A staging set whose copy failed may still be in use by the device: drop it, never reuse.
        if r.is_ok() {
            d.give(st);
        }
        r
    }

    unsafe fn copy_to(&self, location: Location, dst_addr: u64, src: &[u8]) -> Result<()> {
        let n = match location {
            Location::Cpu => {
                // SAFETY: the caller promises the destination range is valid, writable host memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), dst_addr as *mut u8, src.len())
                };
                return Ok(());
            }
            Location::Cuda(n) => n,
        };
        let d = device(n)?;
        d.bind()?;
        let st = d.take()?;
        // Chunk k goes src -> half k%2 -> device; a half is refilled only after its last copy ended.
        let r = (|| -> Result<()> {
            let mut last = None;
            for (k, off) in (0..src.len()).step_by(CHUNK).enumerate() {
                let len = CHUNK.min(src.len() - off);
                if k >= 2 {
                    st.wait(k)?;
                }
                // SAFETY: `src` has `len` bytes at `off`; half k is free (its previous copy was
                // waited for when k >= 2) and holds CHUNK >= `len` bytes; the caller promises the
                // device range is writable memory of cuda:n.
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr().add(off), st.half(k), len);
                    check(
                        "cuMemcpyHtoDAsync",
                        sys::cuMemcpyHtoDAsync_v2(
                            dst_addr + off as u64,
                            st.half(k) as *const c_void,
                            len,
                            st.stream,
                        ),
                    )
                    .map_err(io)?;
                    st.record(k)?;
                }
                last = Some(k);
            }
            // Stream order: the last chunk's event completes after every earlier copy.
            if let Some(k) = last {
                st.wait(k)?;
            }
            Ok(())
        })();
        if r.is_ok() {
            d.give(st);
        }
        r
    }
}

/// Where the memory at `addr` lives, for registration with Mooncake's wildcard location `"*"`:
/// `Cuda(n)` when `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)` says device memory
/// of CUDA device `n`, `Cpu` otherwise (host memory, pinned host memory, or an address CUDA does
/// not know). Where CUDA is absent it is `Cpu` without touching the driver; never panics. Uses
/// the calling thread's current context, or device 0's primary context when none is current
/// (the caller's current context is never replaced).
pub fn location_of(addr: u64) -> Location {
    if !matches!(cuda_available(), Ok(n) if n > 0) {
        return Location::Cpu;
    }
    // SAFETY: cuCtxGetCurrent writes a live local; the attribute reads pass out-values of the
    // types the driver writes (see `pointer_attribute`); a panic in cudarc is caught by
    // `guarded`.
    let r = guarded("pointer location", || unsafe {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        check("cuCtxGetCurrent", sys::cuCtxGetCurrent(&mut cur))?;
        // No current context and device 0 unusable: the address cannot be device memory.
        if cur.is_null() && device(0).and_then(|d| d.bind()).is_err() {
            return Ok(Location::Cpu);
        }
        use sys::CUpointer_attribute as A;
        // SAFETY: MEMORY_TYPE is written as a CUmemorytype (u32), DEVICE_ORDINAL as an int.
        let ty: u32 = pointer_attribute(A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)?;
        if ty != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Ok(Location::Cpu);
        }
        let ordinal: i32 = pointer_attribute(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)?;
        Ok(Location::Cuda(ordinal.max(0) as u32))
    });
    // An address unknown to CUDA is an error of the query: plain host memory.
    r.unwrap_or(Location::Cpu)
}

/// The allocation holding device address `addr`: (start, size, device ordinal).
fn allocation_of(addr: u64) -> std::result::Result<(u64, u64, i32), CudaError> {
    use sys::CUpointer_attribute as A;
    // SAFETY: each attribute is read into the type the driver writes for it
    // (CUdeviceptr, size_t, int).
    unsafe {
        let start: u64 = pointer_attribute(A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, addr)?;
        let size: usize = pointer_attribute(A::CU_POINTER_ATTRIBUTE_RANGE_SIZE, addr)?;
        let ordinal: i32 = pointer_attribute(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)?;
        Ok((start, size as u64, ordinal))
    }
}

/// `cuPointerGetAttribute(attr, addr)`.
///
/// # Safety
/// `T` is the type the driver writes for `attr`.
unsafe fn pointer_attribute<T: Default>(
    attr: sys::CUpointer_attribute,
    addr: u64,
) -> std::result::Result<T, CudaError> {
    let mut v = T::default();
    // SAFETY: `v` is a valid `T`, the type the caller promises the driver writes.
    let r = unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut c_void, attr, addr) };
    r.result()
        .map_err(|e| CudaError::driver(format!("cuPointerGetAttribute({attr:?})"), e))?;
    Ok(v)
}

/// Exports the device range of `region` (a `cuda:N` region inside one `cuMemAlloc`
/// allocation) as a dma-buf: the fd, and the region's offset inside it (the exported range
/// is widened to host pages). Errors: `Unsupported` without CUDA or where the device or
/// driver lacks dma-buf support, `InvalidArgument` for a host region.
pub fn export_dmabuf(region: &MemoryRegion) -> Result<(OwnedFd, u64)> {
    let Location::Cuda(n) = region.location else {
        return Err(ArgumentError::DmabufOfHost {
            location: region.location,
        }
        .into());
    };
    let d = device(n)?;
    d.bind()?;
    let supported = d
        .ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
        .map_err(io)?;
    if supported == 0 {
        return Err(UnsupportedError::NoDmabufSupport {
            location: region.location,
        }
        .into());
    }
    // SAFETY: sysconf takes a constant and has no preconditions.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as u64,
        _ => 4096,
    };
    let start = region.addr & !(page - 1);
    let end = region.end().div_ceil(page) * page;
    let mut fd: i32 = -1;
    // SAFETY: `fd` is a live i32 the driver writes; `[start, end)` lies within the cuda:n
    // allocation checked by the engine when the region was registered (widened to whole pages).
    unsafe {
        check(
            "cuMemGetHandleForAddressRange",
            sys::cuMemGetHandleForAddressRange(
                &mut fd as *mut i32 as *mut c_void,
                start,
                (end - start) as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            ),
        )
        .map_err(|e| unsupported(region.location, &e))?;
    }
    if fd < 0 {
        return Err(UnsupportedError::DmabufNoFd {
            location: region.location,
        }
        .into());
    }
    // SAFETY: the driver returned a fresh fd that nothing else owns.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, region.addr - start))
}
