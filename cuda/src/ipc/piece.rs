//! What the piece kernels share: one copy, and the table of a launch.

use crate::driver::{Context, DeviceBuffer, DriverResult, PinnedBuffer};

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

/// The piece list of one launch: pinned host memory and its device copy, grown as needed.
/// Reused only after the launch that read it has completed.
pub struct PieceTable {
    bufs: Option<(PinnedBuffer, DeviceBuffer)>,
}

impl PieceTable {
    /// An empty table (allocated on first use).
    pub fn new() -> PieceTable {
        PieceTable { bufs: None }
    }
}

impl Default for PieceTable {
    fn default() -> Self {
        Self::new()
    }
}

impl PieceTable {
    /// The table's pinned host buffer and device buffer, grown (to a power of two, at least
    /// 64 KiB) to hold `bytes`. Errors: the driver's allocation failures.
    pub(crate) fn ensure(
        &mut self,
        ctx: &Context,
        bytes: usize,
    ) -> DriverResult<(&PinnedBuffer, &DeviceBuffer)> {
        if self.bufs.as_ref().is_none_or(|(h, _)| h.len() < bytes) {
            let cap = bytes.next_power_of_two().max(64 << 10);
            self.bufs = Some((PinnedBuffer::new(ctx, cap)?, DeviceBuffer::new(ctx, cap)?));
        }
        let (h, d) = self.bufs.as_ref().expect("made above");
        Ok((h, d))
    }
}
