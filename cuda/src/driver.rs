//! Thin owners of CUDA driver objects (context, stream, event, memory, module) over
//! cudarc's raw bindings (`cudarc::driver::sys`), each released on drop with its context
//! made current first. Errors are driver error names with what was being done.

use cudarc::driver::sys;
use std::ffi::c_void;

use crate::error::{CudaError, InvalidArg};

/// A driver call's outcome: on failure, what was being done and the driver's error.
pub type DriverResult<T> = Result<T, CudaError>;

/// `r` as a [`DriverResult`]: the driver's error name after `what`.
pub fn check(what: &str, r: sys::CUresult) -> DriverResult<()> {
    r.result().map_err(|e| CudaError::driver(what, e))
}

/// The device's primary context (shared with the CUDA runtime, PyTorch, etc.), retained
/// for as long as this value lives.
pub struct Context {
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
    ordinal: u32,
}

// SAFETY: driver handles may be used from any thread once the context is made current there.
unsafe impl Send for Context {}
// SAFETY: as for Send: the driver's handles are thread-safe; every method binds the context
// first.
unsafe impl Sync for Context {}

impl Context {
    /// Initialises the driver and retains device `ordinal`'s primary context.
    /// Errors when the driver fails or the device does not exist.
    pub fn new(ordinal: u32) -> DriverResult<Context> {
        // SAFETY: driver calls with plain values and out-pointers to live locals; callers probe
        // the library first (kvferry_cuda::probe), and cudarc's panic on a missing library is
        // caught by their `guarded`.
        unsafe {
            check("cuInit", sys::cuInit(0))?;
            let mut n = 0i32;
            check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut n))?;
            if ordinal as i64 >= n as i64 {
                return Err(CudaError::NoSuchDevice {
                    ordinal,
                    count: n.max(0) as u32,
                });
            }
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal as i32))?;
            let mut ctx = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            )?;
            let c = Context { ctx, dev, ordinal };
            c.bind()?;
            Ok(c)
        }
    }

    /// Makes the context current on the calling thread (cheap; every entry point calls it).
    pub fn bind(&self) -> DriverResult<()> {
        // SAFETY: `self.ctx` is a primary context this value retains until its drop.
        unsafe { check("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.ctx)) }
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// An integer attribute of the device.
    pub fn attribute(&self, a: sys::CUdevice_attribute) -> DriverResult<i32> {
        let mut v = 0;
        // SAFETY: `v` is a live i32 the driver writes; `self.dev` is a device handle from
        // cuDeviceGet.
        unsafe {
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(&mut v, a, self.dev),
            )?
        };
        Ok(v)
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> DriverResult<(i32, i32)> {
        Ok((
            self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// The device's name.
    pub fn name(&self) -> String {
        let mut buf = [0 as std::ffi::c_char; 128];
        // SAFETY: `buf` has 128 bytes and the length passed is 128, so the driver writes a
        // NUL-terminated name inside it, which CStr reads.
        unsafe {
            if sys::cuDeviceGetName(buf.as_mut_ptr(), 128, self.dev) != sys::CUresult::CUDA_SUCCESS
            {
                return "unknown".into();
            }
            std::ffi::CStr::from_ptr(buf.as_ptr())
                .to_string_lossy()
                .into_owned()
        }
    }

    /// The raw context handle.
    pub fn raw(&self) -> sys::CUcontext {
        self.ctx
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `self.dev`'s primary context was retained by `new` and is released once, here.
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

fn bind_raw(ctx: sys::CUcontext) {
    // SAFETY: `ctx` is a live context handle of a value being dropped (its owner keeps the
    // primary context retained).
    unsafe {
        let _ = sys::cuCtxSetCurrent(ctx);
    }
}

/// A stream that does not synchronise with the legacy default stream.
pub struct Stream {
    pub(crate) raw: sys::CUstream,
    ctx: sys::CUcontext,
}
// SAFETY: a stream handle may be used from any thread; its context is bound before each use.
unsafe impl Send for Stream {}
// SAFETY: as for Send: the driver serialises work on one stream itself.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream in `ctx` (which must be current).
    pub fn new(ctx: &Context) -> DriverResult<Stream> {
        let mut s = std::ptr::null_mut();
        // SAFETY: `s` is a live local the driver writes; the context is current (documented
        // precondition).
        unsafe {
            check(
                "cuStreamCreate",
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
            )?
        };
        Ok(Stream {
            raw: s,
            ctx: ctx.raw(),
        })
    }

    /// The raw handle, for [`super::CudaBackend::submit_after`] and the tools.
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Blocks until the stream's work is done (tests and benchmarks only).
    pub fn synchronize(&self) -> DriverResult<()> {
        // SAFETY: `self.raw` is a live stream this value owns.
        unsafe { check("cuStreamSynchronize", sys::cuStreamSynchronize(self.raw)) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        bind_raw(self.ctx);
        // SAFETY: the stream is owned by this value and destroyed once, with its context bound.
        unsafe {
            let _ = sys::cuStreamDestroy_v2(self.raw);
        }
    }
}

/// A CUDA event.
pub struct Event {
    pub(crate) raw: sys::CUevent,
    ctx: sys::CUcontext,
}
// SAFETY: an event handle may be used from any thread; its context is bound before each use.
unsafe impl Send for Event {}
// SAFETY: as for Send: recording and querying an event are thread-safe driver calls.
unsafe impl Sync for Event {}

/// State of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventState {
    /// All work before the record has completed (or the event was never recorded).
    Done,
    /// Work before the record is still running.
    Pending,
}

impl Event {
    /// Creates an event; `timing` false creates it with timing disabled (cheaper).
    pub fn new(ctx: &Context, timing: bool) -> DriverResult<Event> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let mut e = std::ptr::null_mut();
        // SAFETY: `e` is a live local the driver writes.
        unsafe { check("cuEventCreate", sys::cuEventCreate(&mut e, flags as u32))? };
        Ok(Event {
            raw: e,
            ctx: ctx.raw(),
        })
    }

    /// Records the event on `stream`.
    ///
    /// # Safety
    /// `stream` is a live stream of this event's context.
    pub unsafe fn record(&self, stream: sys::CUstream) -> DriverResult<()> {
        // SAFETY: forwarded from this function's contract (see # Safety).
        unsafe { check("cuEventRecord", sys::cuEventRecord(self.raw, stream)) }
    }

    /// Whether the work before the last record has completed; never blocks.
    pub fn query(&self) -> DriverResult<EventState> {
        // SAFETY: `self.raw` is a live event this value owns.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(EventState::Done),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(EventState::Pending),
            e => check("cuEventQuery", e).map(|_| EventState::Done),
        }
    }

    /// Blocks until the event completes (tests and benchmarks only).
    pub fn synchronize(&self) -> DriverResult<()> {
        // SAFETY: `self.raw` is a live event this value owns.
        unsafe { check("cuEventSynchronize", sys::cuEventSynchronize(self.raw)) }
    }

    /// Milliseconds between two completed timing events.
    pub fn elapsed_ms(start: &Event, end: &Event) -> DriverResult<f32> {
        let mut ms = 0f32;
        // SAFETY: both events are live (borrowed) and `ms` is a live local the driver writes.
        unsafe {
            check(
                "cuEventElapsedTime_v2",
                sys::cuEventElapsedTime_v2(&mut ms, start.raw, end.raw),
            )?
        };
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        bind_raw(self.ctx);
        // SAFETY: the event is owned by this value and destroyed once, with its context bound.
        unsafe {
            let _ = sys::cuEventDestroy_v2(self.raw);
        }
    }
}

/// Device memory from a plain `cuMemAlloc` (never managed memory).
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: sys::CUcontext,
}
// SAFETY: a device pointer is a plain address, usable from any thread with its context bound.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as for Send: shared access only reads the address and length.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` bytes (at least 1) of device memory, 256-byte aligned.
    pub fn new(ctx: &Context, len: usize) -> DriverResult<DeviceBuffer> {
        let mut ptr = 0;
        // SAFETY: `ptr` is a live local the driver writes.
        unsafe { check("cuMemAlloc", sys::cuMemAlloc_v2(&mut ptr, len.max(1)))? };
        Ok(DeviceBuffer {
            ptr,
            len,
            ctx: ctx.raw(),
        })
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        bind_raw(self.ctx);
        // SAFETY: the allocation is owned by this value and freed once, with its context bound.
        unsafe {
            let _ = sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, so copies to and from it are truly
/// asynchronous.
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    ctx: sys::CUcontext,
}
// SAFETY: pinned host memory is plain memory, usable from any thread; this value owns it.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as for Send: `&self` only hands out the pointer; writes through it are the caller's
// unsafe.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes (at least 1) of pinned host memory, zeroed.
    pub fn new(ctx: &Context, len: usize) -> DriverResult<PinnedBuffer> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a live local the driver writes; on success it points at `len.max(1)`
        // bytes, which are zeroed before any read.
        unsafe {
            check("cuMemHostAlloc", sys::cuMemHostAlloc(&mut p, len.max(1), 0))?;
            std::ptr::write_bytes(p as *mut u8, 0, len.max(1));
        }
        Ok(PinnedBuffer {
            ptr: p as *mut u8,
            len,
            ctx: ctx.raw(),
        })
    }

    /// Host address of the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        bind_raw(self.ctx);
        // SAFETY: the allocation is owned by this value and freed once, with its context bound.
        unsafe {
            let _ = sys::cuMemFreeHost(self.ptr as *mut c_void);
        }
    }
}

/// A loaded module (CUBIN or PTX image).
pub struct Module {
    raw: sys::CUmodule,
    ctx: sys::CUcontext,
}
// SAFETY: a module handle may be used from any thread with its context bound.
unsafe impl Send for Module {}
// SAFETY: as for Send: looking up a function only reads the module.
unsafe impl Sync for Module {}

/// A kernel of a [`Module`]; valid while the module lives.
#[derive(Clone, Copy)]
pub struct Function(pub(crate) sys::CUfunction);
// SAFETY: a function handle is an immutable driver object, usable from any thread.
unsafe impl Send for Function {}
// SAFETY: as for Send.
unsafe impl Sync for Function {}

impl Module {
    /// Loads a CUBIN, or a NUL-terminated PTX text, into the current context.
    pub fn load(ctx: &Context, image: &[u8]) -> DriverResult<Module> {
        let mut m = std::ptr::null_mut();
        // SAFETY: `image` is a live slice holding a CUBIN or NUL-terminated PTX (documented
        // contract) and `m` a live local the driver writes.
        unsafe {
            check(
                "cuModuleLoadData",
                sys::cuModuleLoadData(&mut m, image.as_ptr() as *const c_void),
            )?
        };
        Ok(Module {
            raw: m,
            ctx: ctx.raw(),
        })
    }

    /// The `extern "C"` kernel named `name`.
    pub fn function(&self, name: &str) -> DriverResult<Function> {
        let c = std::ffi::CString::new(name).map_err(|source| {
            CudaError::Invalid(InvalidArg::Nul {
                what: "kernel name",
                name: name.to_string(),
                source,
            })
        })?;
        let mut f = std::ptr::null_mut();
        // SAFETY: `c` is a NUL-terminated name alive for the call, `self.raw` a loaded module,
        // `f` a live local.
        unsafe {
            check(
                &format!("cuModuleGetFunction({name})"),
                sys::cuModuleGetFunction(&mut f, self.raw, c.as_ptr()),
            )?
        };
        Ok(Function(f))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        bind_raw(self.ctx);
        // SAFETY: the module is owned by this value and unloaded once, with its context bound.
        unsafe {
            let _ = sys::cuModuleUnload(self.raw);
        }
    }
}

impl Function {
    /// Launches the kernel; `params` point at the argument values, in order.
    ///
    /// # Safety
    /// The arguments match the kernel's signature and the memory they name is valid
    /// until the launch completes.
    pub unsafe fn launch(
        &self,
        stream: sys::CUstream,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> DriverResult<()> {
        // SAFETY: forwarded from this function's contract (see # Safety).
        unsafe {
            check(
                "cuLaunchKernel",
                sys::cuLaunchKernel(
                    self.0,
                    grid,
                    1,
                    1,
                    block,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
            )
        }
    }

    /// Resident blocks per multiprocessor at `block` threads and no dynamic shared memory.
    pub fn occupancy(&self, block: u32) -> DriverResult<u32> {
        let mut n = 0;
        // SAFETY: `n` is a live local the driver writes; `self.0` is a function of a loaded
        // module.
        unsafe {
            check(
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.0, block as i32, 0),
            )?
        };
        Ok(n.max(1) as u32)
    }
}

/// `cuMemcpyHtoDAsync` of `len` bytes.
///
/// # Safety
/// Both ranges are valid; `src` stays valid until the copy completes (pinned for true asynchrony).
pub unsafe fn copy_htod_async(
    dst: u64,
    src: *const u8,
    len: usize,
    stream: sys::CUstream,
) -> DriverResult<()> {
    // SAFETY: forwarded from this function's contract (see # Safety).
    unsafe {
        check(
            "cuMemcpyHtoDAsync",
            sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, stream),
        )
    }
}

/// `cuMemcpyDtoHAsync` of `len` bytes.
///
/// # Safety
/// Both ranges are valid; `dst` stays valid until the copy completes.
pub unsafe fn copy_dtoh_async(
    dst: *mut u8,
    src: u64,
    len: usize,
    stream: sys::CUstream,
) -> DriverResult<()> {
    // SAFETY: forwarded from this function's contract (see # Safety).
    unsafe {
        check(
            "cuMemcpyDtoHAsync",
            sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, stream),
        )
    }
}

/// `cuMemsetD8Async` of `len` bytes to `value`.
///
/// # Safety
/// The range is valid device memory.
pub unsafe fn memset_async(
    dst: u64,
    value: u8,
    len: usize,
    stream: sys::CUstream,
) -> DriverResult<()> {
    // SAFETY: forwarded from this function's contract (see # Safety).
    unsafe {
        check(
            "cuMemsetD8Async",
            sys::cuMemsetD8Async(dst, value, len, stream),
        )
    }
}

/// Makes `stream` wait for `event` on the device (no host blocking).
///
/// # Safety
/// Both are live handles of one context.
pub unsafe fn stream_wait(stream: sys::CUstream, event: &Event) -> DriverResult<()> {
    // SAFETY: forwarded from this function's contract (see # Safety).
    unsafe {
        check(
            "cuStreamWaitEvent",
            sys::cuStreamWaitEvent(stream, event.raw, 0),
        )
    }
}
