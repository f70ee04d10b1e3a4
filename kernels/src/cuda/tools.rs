//! Device helpers for the GPU tests and the benchmark (`kernels/cuda/tools.cu`): random
//! fill, a plain read-bandwidth reduction (the benchmark's baseline, measured in the
//! same run), the same reduction over byte ranges, a spin kernel, and synchronous copies.
//! Not on the checksum path.

use super::driver::{self, DeviceBuffer, Function, Module, Stream};
use super::{load, CudaBackend, RawStream, TOOLS_SRC};
use kvferry_cuda::CudaError;
use std::ffi::c_void;

/// The helper kernels, loaded in the backend's context.
pub struct Tools {
    backend: CudaBackend,
    _module: Module,
    fill: Function,
    read_sum: Function,
    read_ranges: Function,
    spin: Function,
    grid: u32,
}

fn arg<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

impl Tools {
    /// Compiles and loads the helper kernels for `backend`'s device.
    pub fn new(backend: &CudaBackend) -> Result<Tools, CudaError> {
        let ctx = backend.context();
        ctx.bind()?;
        let image = load::compile(TOOLS_SRC, "tools.cu", ctx.compute_capability()?)?;
        let module = Module::load(ctx, &image)?;
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        let read_sum = module.function("kvf_read_sum")?;
        let grid = sms.max(1) as u32 * read_sum.occupancy(256)?;
        Ok(Tools {
            backend: backend.clone(),
            fill: module.function("kvf_fill")?,
            read_ranges: module.function("kvf_read_ranges")?,
            spin: module.function("kvf_spin")?,
            read_sum,
            _module: module,
            grid,
        })
    }

    /// Allocates `len` bytes of device memory (plain cuMemAlloc).
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer, CudaError> {
        self.backend.context().bind()?;
        DeviceBuffer::new(self.backend.context(), len)
    }

    /// A new non-blocking stream.
    pub fn stream(&self) -> Result<Stream, CudaError> {
        self.backend.context().bind()?;
        Stream::new(self.backend.context())
    }

    /// A new event (`timing` for elapsed-time reads).
    pub fn event(&self, timing: bool) -> Result<driver::Event, CudaError> {
        self.backend.context().bind()?;
        driver::Event::new(self.backend.context(), timing)
    }

    /// Fills the first `len / 8` words at `ptr` with splitmix64(seed + i), on `stream`.
    ///
    /// # Safety
    /// The device addresses are valid for what the kernel reads and writes, and `stream` is a
    /// live stream of the backend's context.
    pub unsafe fn fill_random(
        &self,
        ptr: u64,
        len: usize,
        seed: u64,
        stream: RawStream,
    ) -> Result<(), CudaError> {
        self.backend.context().bind()?;
        let (mut p, mut n, mut s) = (ptr, (len / 8) as u64, seed);
        let mut args = [arg(&mut p), arg(&mut n), arg(&mut s)];
        // SAFETY: the arguments match the kernel's signature; the addresses and stream are valid
        // by this function's contract.
        unsafe { self.fill.launch(stream, self.grid, 256, &mut args) }
    }

    /// Adds the u64 sum of `len` bytes at `ptr` (16-byte aligned, `len % 16 == 0`) into the
    /// u64 at device address `out`, on `stream`: one read of every byte, 16-byte loads.
    ///
    /// # Safety
    /// The device addresses are valid for what the kernel reads and writes, and `stream` is a
    /// live stream of the backend's context.
    pub unsafe fn read_sum(
        &self,
        ptr: u64,
        len: usize,
        out: u64,
        stream: RawStream,
    ) -> Result<(), CudaError> {
        self.backend.context().bind()?;
        let (mut p, mut n, mut o) = (ptr, (len / 16) as u64, out);
        let mut args = [arg(&mut p), arg(&mut n), arg(&mut o)];
        // SAFETY: the arguments match the kernel's signature; the addresses and stream are valid
        // by this function's contract.
        unsafe { self.read_sum.launch(stream, self.grid, 256, &mut args) }
    }

    /// Like [`Tools::read_sum`] over `n` ranges whose device addresses and lengths are the u64
    /// arrays at device addresses `addrs` and `lens`.
    ///
    /// # Safety
    /// The device addresses are valid for what the kernel reads and writes, and `stream` is a
    /// live stream of the backend's context.
    pub unsafe fn read_ranges(
        &self,
        addrs: u64,
        lens: u64,
        n: u32,
        out: u64,
        stream: RawStream,
    ) -> Result<(), CudaError> {
        self.backend.context().bind()?;
        let (mut a, mut l, mut c, mut o) = (addrs, lens, n, out);
        let mut args = [arg(&mut a), arg(&mut l), arg(&mut c), arg(&mut o)];
        // SAFETY: the arguments match the kernel's signature; the addresses and stream are valid
        // by this function's contract.
        unsafe {
            self.read_ranges
                .launch(stream, n.min(self.grid).max(1), 256, &mut args)
        }
    }

    /// Queues a one-thread kernel that spins `ns` nanoseconds, then writes 1 to the u64 at `flag`.
    ///
    /// # Safety
    /// The device addresses are valid for what the kernel reads and writes, and `stream` is a
    /// live stream of the backend's context.
    pub unsafe fn spin(&self, ns: u64, flag: u64, stream: RawStream) -> Result<(), CudaError> {
        self.backend.context().bind()?;
        let (mut t, mut f) = (ns, flag);
        let mut args = [arg(&mut t), arg(&mut f)];
        // SAFETY: the arguments match the kernel's signature; the addresses and stream are valid
        // by this function's contract.
        unsafe { self.spin.launch(stream, 1, 1, &mut args) }
    }

    /// Copies host bytes to device address `dst` (synchronous; tests only).
    pub fn upload(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        self.backend.context().bind()?;
        // SAFETY: test tool: `src` is a live slice of `src.len()` bytes; `dst` is a device
        // address of at least that many bytes the caller allocated (the driver rejects addresses
        // it does not know).
        unsafe {
            driver::check(
                "cuMemcpyHtoD",
                cudarc::driver::sys::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len()),
            )
        }
    }

    /// Copies `len` bytes at device address `src` to the host (synchronous; tests only).
    pub fn download(&self, src: u64, len: usize) -> Result<Vec<u8>, CudaError> {
        self.backend.context().bind()?;
        let mut v = vec![0u8; len];
        // SAFETY: test tool: `v` has `len` bytes; `src` is a device range of `len` bytes the
        // caller allocated.
        unsafe {
            driver::check(
                "cuMemcpyDtoH",
                cudarc::driver::sys::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut c_void, src, len),
            )?;
        }
        Ok(v)
    }
}
