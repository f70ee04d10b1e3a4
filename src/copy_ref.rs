//! The references a throughput is read against, measured in the same run: one core copying
//! host memory, or an in-process device-to-device copy on a GPU.

use std::time::Instant;

/// GB/s (10^9) of one core copying `bytes` in host memory: a buffer of `bytes` (at least
/// 1 MiB, at most 256 MiB) copied until `bytes` or 1 GiB have been copied (at least 3
/// passes); the best pass. The reference the loads' throughput is read against.
pub fn copy_rate(bytes: u64) -> f64 {
    const MIB: u64 = 1 << 20;
    let len = bytes.clamp(MIB, 256 * MIB) as usize;
    // Both buffers written first: the pages are mapped before the timing starts.
    let src: Vec<u8> = (0..len).map(|i| i as u8).collect();
    let mut dst = vec![1u8; len];
    let passes = (bytes.min(1 << 30) / len as u64).max(3);
    let mut best = f64::MAX;
    for _ in 0..passes {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    if best > 0.0 {
        len as f64 / best / 1e9
    } else {
        0.0
    }
}

/// GB/s (10^9) of an in-process `cuMemcpyDtoDAsync` of `bytes` (at least 1 MiB, at most
/// 1 GiB) between two buffers of GPU `ordinal`, timed with events over enough copies to
/// take about 20 ms after a warm-up: the raw copy rate of the same bytes, the reference of a
/// transfer between GPU memory. Errors: the driver's (no device, out of memory), as text.
pub fn device_copy_rate(bytes: u64, ordinal: u32) -> Result<f64, String> {
    use kvferry_cuda::driver::{Context, DeviceBuffer, Event, Stream};
    const MIB: u64 = 1 << 20;
    let len = bytes.clamp(MIB, 1 << 30) as usize;
    kvferry_cuda::guarded("device copy reference", || {
        let ctx = Context::new(ordinal)?;
        let (src, dst) = (DeviceBuffer::new(&ctx, len)?, DeviceBuffer::new(&ctx, len)?);
        let stream = Stream::new(&ctx)?;
        let (a, b) = (Event::new(&ctx, true)?, Event::new(&ctx, true)?);
        let copy = kvferry_cuda::ipc::Copy {
            dst: dst.ptr(),
            src: src.ptr(),
            len,
        };
        // About 20 ms of copies at 2 TB/s; at least 5.
        let reps = ((40u64 << 30) / len as u64).clamp(5, 2000);
        // SAFETY: both buffers hold `len` bytes and outlive the synchronised stream; the
        // events and the stream belong to `ctx`.
        unsafe {
            kvferry_cuda::ipc::copy_batch_async(&[copy], stream.raw())?;
            a.record(stream.raw())?;
            for _ in 0..reps {
                kvferry_cuda::ipc::copy_batch_async(&[copy], stream.raw())?;
            }
            b.record(stream.raw())?;
        }
        b.synchronize()?;
        let ms = f64::from(Event::elapsed_ms(&a, &b)?);
        Ok(if ms > 0.0 {
            len as f64 * reps as f64 / (ms / 1e3) / 1e9
        } else {
            0.0
        })
    })
    .map_err(|e| e.to_string())
}
