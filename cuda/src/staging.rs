//! Pinned host memory with a device twin, for the small tables and results a launch uploads
//! and reads back: allocated ahead in one piece and handed out in equal parts, because
//! allocating (or freeing) pinned or device memory synchronises the whole device, which a
//! submit made while other streams copy must not do.

use std::sync::Arc;

use crate::driver::{Context, DeviceBuffer, DriverResult, PinnedBuffer};

/// One pinned host allocation and one device allocation of the same length.
struct Pair {
    host: PinnedBuffer,
    dev: DeviceBuffer,
}

/// Host and device bytes at the same offsets: a buffer of its own, or one part of a staging
/// area allocated ahead ([`Staging::ahead`]). The memory lives as long as this value.
pub struct Staging {
    pair: Arc<Pair>,
    off: usize,
    len: usize,
}

impl Staging {
    /// `len` bytes (at least 1) of pinned host memory and `len` of device memory in `ctx`
    /// (made current on this thread), allocated now (each allocation synchronises the
    /// device). Errors: the driver's.
    pub fn new(ctx: &Context, len: usize) -> DriverResult<Staging> {
        ctx.bind()?;
        let pair = Pair {
            host: PinnedBuffer::new(ctx, len)?,
            dev: DeviceBuffer::new(ctx, len)?,
        };
        Ok(Staging {
            pair: Arc::new(pair),
            off: 0,
            len,
        })
    }

    /// `count` parts of `part` bytes each (rounded up to 256, the device's alignment for any
    /// access), from one host and one device allocation in `ctx` made now. Empty when
    /// `count` or `part` is 0. Errors: the driver's (nothing is allocated then).
    pub fn ahead(ctx: &Context, part: usize, count: usize) -> DriverResult<Vec<Staging>> {
        if part == 0 || count == 0 {
            return Ok(Vec::new());
        }
        let part = part.next_multiple_of(256);
        let whole = Staging::new(ctx, part * count)?;
        Ok((0..count)
            .map(|i| Staging {
                pair: whole.pair.clone(),
                off: i * part,
                len: part,
            })
            .collect())
    }

    /// Host address of the first byte (page-locked: copies from it are asynchronous).
    pub fn host(&self) -> *mut u8 {
        // SAFETY: `off + len` lies within the host allocation (made so by `new`/`ahead`).
        unsafe { self.pair.host.as_ptr().add(self.off) }
    }

    /// Device address of the first byte (256-byte aligned).
    pub fn dev(&self) -> u64 {
        self.pair.dev.ptr() + self.off as u64
    }

    /// Bytes, host and device each.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
