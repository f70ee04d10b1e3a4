//! What the loopback examples share (not an example: cargo builds only `examples/*.rs` and
//! `examples/*/main.rs`): two engines on one machine, a buffer registered with each, and the
//! first engine's handle on the second's segment.

use std::sync::Arc;

use kvferry_transfer::{EngineConfig, Location, SegmentHandle, TransferEngine};

/// Two engines of one config on this machine: `a` holds `src`, the second engine holds `dst` (both host
/// memory, registered whole), `seg` is `a`'s handle on the second engine's segment. The engines are declared
/// before the buffers, so they are dropped (and their registrations with them) first.
pub struct EnginePair {
    pub a: Arc<TransferEngine>,
    /// The target engine: held so its segment stays open.
    _b: Arc<TransferEngine>,
    pub seg: SegmentHandle,
    pub src: Vec<u8>,
    pub dst: Vec<u8>,
}

impl EnginePair {
    /// Starts both engines with `cfg`, fills `src` with 7s and `dst` with 1s (`size` bytes each;
    /// written, so page faults are not counted as the transport's cost), registers them and
    /// opens the second engine's segment from `a`. Panics on any failure (an example's set-up).
    pub fn new(cfg: EngineConfig, size: usize) -> EnginePair {
        let a = TransferEngine::new(cfg.clone()).unwrap();
        let b = TransferEngine::new(cfg).unwrap();
        let src = vec![7u8; size];
        let dst = vec![1u8; size];
        // SAFETY: the buffers are the pair's own and outlive both engines (field order).
        unsafe {
            a.register_memory(src.as_ptr() as u64, size as u64, Location::Cpu)
                .unwrap();
            b.register_memory(dst.as_ptr() as u64, size as u64, Location::Cpu)
                .unwrap();
        }
        let seg = a.open_segment(&b.segment_name()).unwrap();
        EnginePair {
            a,
            _b: b,
            seg,
            src,
            dst,
        }
    }

    /// Address of byte `offset` of `src`.
    pub fn src_addr(&self, offset: u64) -> u64 {
        self.src.as_ptr() as u64 + offset
    }

    /// Address of byte `offset` of `dst`.
    pub fn dst_addr(&self, offset: u64) -> u64 {
        self.dst.as_ptr() as u64 + offset
    }
}
