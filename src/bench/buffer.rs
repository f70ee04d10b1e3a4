//! The bench's memory: one buffer in host memory (anonymous map) or in GPU memory (plain
//! `cuMemAlloc`), registered with an engine like any other region, so that `auto` picks the
//! path it picks for KV (CUDA IPC, dma-buf, peer memory, staging, TCP). The host side only
//! fills it and reads it back to check what landed; transfers never go through these helpers.

use kvferry_cuda::driver::{copy_dtoh_async, copy_htod_async, Context, DeviceBuffer, Stream};
use kvferry_transfer::Location;
use memmap2::{MmapMut, MmapRaw};

use crate::error::CliError;

/// Bytes moved between host and GPU per copy while filling or checking (bounds the host
/// staging memory these helpers hold).
const CHUNK: usize = 64 << 20;

/// A bench buffer: host memory, or GPU memory with the stream its fill and check copies run on.
pub enum Buffer {
    /// Host memory, held as a raw map: the transports write it behind any reference.
    Host(MmapRaw),
    /// GPU memory of one device (fields dropped in order: memory before its context).
    Gpu {
        /// The device memory.
        dev: DeviceBuffer,
        /// Stream of the fill and check copies.
        stream: Stream,
        /// The device's primary context, retained while the memory lives.
        ctx: Context,
    },
}

fn gpu_err(what: &str) -> impl FnOnce(kvferry_cuda::CudaError) -> CliError + '_ {
    move |e| CliError::failed(format!("{what}: {e}"))
}

impl Buffer {
    /// Allocates `len` bytes (> 0) at `location` (`cpu` or `cuda:N`), zeroed.
    ///
    /// Errors: the allocation fails, or the CUDA driver or device is missing (said in one line).
    pub fn new(location: Location, len: u64) -> Result<Buffer, CliError> {
        let n = usize::try_from(len)
            .map_err(|_| CliError::usage(format!("{len} bytes: too large for this host")))?;
        match location {
            Location::Cpu => Ok(Buffer::Host(MmapRaw::from(
                MmapMut::map_anon(n.max(1)).map_err(CliError::io(format!(
                    "allocating {len} bytes of host memory"
                )))?,
            ))),
            Location::Cuda(o) => {
                let what = format!("--device cuda: GPU {o}");
                kvferry_cuda::cuda_available().map_err(gpu_err(&what))?;
                kvferry_cuda::guarded("bench GPU buffer", || {
                    let ctx = Context::new(o)?;
                    let dev = DeviceBuffer::new(&ctx, n)?;
                    let stream = Stream::new(&ctx)?;
                    let b = Buffer::Gpu { dev, stream, ctx };
                    b.fill_gpu(0, n, 0)?;
                    Ok(b)
                })
                .map_err(gpu_err(&what))
            }
        }
    }

    /// Address of the first byte (a device address for GPU memory).
    pub fn addr(&self) -> u64 {
        match self {
            Buffer::Host(m) => m.as_ptr() as u64,
            Buffer::Gpu { dev, .. } => dev.ptr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Buffer::Host(m) => m.len() as u64,
            Buffer::Gpu { dev, .. } => dev.len() as u64,
        }
    }

    /// Where it lives, as registered.
    pub fn location(&self) -> Location {
        match self {
            Buffer::Host(_) => Location::Cpu,
            Buffer::Gpu { ctx, .. } => Location::Cuda(ctx.ordinal()),
        }
    }

    /// The bytes, when they are host memory (`None` for GPU memory). Transfers may land in
    /// them while the slice lives: callers read only ranges no transfer is writing.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match self {
            // SAFETY: the map is live as long as `self`; see the contract above.
            Buffer::Host(m) => Some(unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) }),
            Buffer::Gpu { .. } => None,
        }
    }

    /// The host bytes `[o, o+n)` for writing (in range: checked by the callers).
    #[allow(clippy::mut_from_ref)]
    fn host_mut(m: &MmapRaw, o: usize, n: usize) -> &mut [u8] {
        // SAFETY: the range lies inside the live map; the bench writes a range only while no
        // transfer touches it and no other slice of it is held.
        unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr().add(o), n) }
    }

    fn range(&self, off: u64, len: u64) -> Result<(usize, usize), CliError> {
        off.checked_add(len)
            .filter(|&e| e <= self.len())
            .map(|_| (off as usize, len as usize))
            .ok_or_else(|| {
                CliError::failed(format!(
                    "bytes {off}+{len} lie outside the {}-byte buffer",
                    self.len()
                ))
            })
    }

    /// Fills `[off, off+len)` with the bench's pattern (a byte of each offset, so that a
    /// request that landed in the wrong slot shows).
    pub fn fill_pattern(&self, off: u64, len: u64) -> Result<(), CliError> {
        let (o, n) = self.range(off, len)?;
        let byte = |i: usize| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8 ^ (i >> 20) as u8;
        match self {
            Buffer::Host(m) => {
                for (i, b) in Self::host_mut(m, o, n).iter_mut().enumerate() {
                    *b = byte(o + i);
                }
                Ok(())
            }
            Buffer::Gpu { .. } => {
                let mut done = 0;
                while done < n {
                    let k = CHUNK.min(n - done);
                    let host: Vec<u8> = (o + done..o + done + k).map(byte).collect();
                    self.copy_in(o + done, &host)?;
                    done += k;
                }
                Ok(())
            }
        }
    }

    /// Sets `[off, off+len)` to `value` (clears a landing area before transfers fill it).
    pub fn fill(&self, off: u64, len: u64, value: u8) -> Result<(), CliError> {
        let (o, n) = self.range(off, len)?;
        match self {
            Buffer::Host(m) => {
                Self::host_mut(m, o, n).fill(value);
                Ok(())
            }
            Buffer::Gpu { .. } => self
                .fill_gpu(o, n, value)
                .map_err(gpu_err("clearing GPU memory")),
        }
    }

    fn fill_gpu(&self, o: usize, n: usize, value: u8) -> Result<(), kvferry_cuda::CudaError> {
        let Buffer::Gpu { dev, stream, ctx } = self else {
            return Ok(());
        };
        ctx.bind()?;
        // SAFETY: the range lies inside the allocation (checked by the callers).
        unsafe {
            kvferry_cuda::driver::memset_async(dev.ptr() + o as u64, value, n, stream.raw())?
        };
        stream.synchronize()
    }

    fn copy_in(&self, o: usize, host: &[u8]) -> Result<(), CliError> {
        let Buffer::Gpu { dev, stream, ctx } = self else {
            return Ok(());
        };
        let run = || -> Result<(), kvferry_cuda::CudaError> {
            ctx.bind()?;
            // SAFETY: the range lies inside the allocation; `host` outlives the copy (the
            // stream is synchronised before returning).
            unsafe {
                copy_htod_async(
                    dev.ptr() + o as u64,
                    host.as_ptr(),
                    host.len(),
                    stream.raw(),
                )?
            };
            stream.synchronize()
        };
        run().map_err(gpu_err("copying to GPU memory"))
    }

    /// A host copy of `[off, off+len)`.
    pub fn read(&self, off: u64, len: u64) -> Result<Vec<u8>, CliError> {
        let (o, n) = self.range(off, len)?;
        match self {
            Buffer::Host(_) => Ok(self.host_bytes().unwrap_or_default()[o..o + n].to_vec()),
            Buffer::Gpu { dev, stream, ctx } => {
                let mut out = vec![0u8; n];
                let mut run = || -> Result<(), kvferry_cuda::CudaError> {
                    ctx.bind()?;
                    for start in (0..n).step_by(CHUNK) {
                        let k = CHUNK.min(n - start);
                        // SAFETY: both ranges lie inside their allocations; the stream is
                        // synchronised before `out` is read.
                        unsafe {
                            copy_dtoh_async(
                                out[start..].as_mut_ptr(),
                                dev.ptr() + (o + start) as u64,
                                k,
                                stream.raw(),
                            )?
                        };
                    }
                    stream.synchronize()
                };
                run().map_err(gpu_err("copying from GPU memory"))?;
                Ok(out)
            }
        }
    }
}
