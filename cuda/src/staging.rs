//! Pinned host memory with a device twin, for the small tables and results a launch uploads
//! and reads back: allocated ahead in one piece and handed out in equal parts, because
//! allocating (or freeing) pinned or device memory synchronises the whole device, which a
//! submit made while other streams copy must not do.

use std::sync::Arc;

use crate::driver::{Context, DeviceBuffer, DriverResult, PinnedBuffer};
use crate::error::{CudaError, InvalidArg};

/// One pinned host allocation and one device allocation of the same length.
// Field order is drop order: the context, retained for the memory's sake, goes last.
struct Pair {
    host: PinnedBuffer,
    dev: DeviceBuffer,
    _ctx: Context,
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
        // A retain of its own: the memory is freed in its context, whoever drops first.
        let keep = Context::new(ctx.ordinal())?;
        ctx.bind()?;
        let pair = Pair {
            host: PinnedBuffer::new(ctx, len)?,
            dev: DeviceBuffer::new(ctx, len)?,
            _ctx: keep,
        };
        Ok(Staging {
            pair: Arc::new(pair),
            off: 0,
            len,
        })
    }

    /// `count` parts of `part` bytes each (rounded up to 256, the device's alignment for any
    /// access), from one host and one device allocation in `ctx` made now. Empty when
    /// `count` or `part` is 0. Errors: [`InvalidArg::Size`] when the whole does not fit in
    /// `usize`; the driver's (nothing is allocated then).
    pub fn ahead(ctx: &Context, part: usize, count: usize) -> DriverResult<Vec<Staging>> {
        if part == 0 || count == 0 {
            return Ok(Vec::new());
        }
        let (part, whole) = sizes(part, count)?;
        let whole = Staging::new(ctx, whole)?;
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

/// A part's bytes rounded up to 256 and the whole of `count` of them, or
/// [`InvalidArg::Size`] when either does not fit in `usize`.
fn sizes(part: usize, count: usize) -> DriverResult<(usize, usize)> {
    let asked = (part as u64).saturating_mul(count as u64);
    let too_large = || CudaError::Invalid(InvalidArg::Size(asked));
    let part = part.checked_next_multiple_of(256).ok_or_else(too_large)?;
    let whole = part.checked_mul(count).ok_or_else(too_large)?;
    Ok((part, whole))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts round up to 256 bytes; a whole past `usize` is refused, never wrapped (a
    /// wrapped whole would allocate a few bytes for parts that claim many).
    #[test]
    fn a_whole_past_usize_is_refused_not_wrapped() {
        assert_eq!(sizes(1000, 8).unwrap(), (1024, 8192));
        assert_eq!(sizes(256, 3).unwrap(), (256, 768));
        for (part, count) in [(usize::MAX, 1), (1 << 40, 1 << 40), (256, usize::MAX)] {
            let e = sizes(part, count).err();
            assert!(
                matches!(e, Some(CudaError::Invalid(InvalidArg::Size(_)))),
                "{part} x {count}: {e:?}"
            );
        }
    }
}
