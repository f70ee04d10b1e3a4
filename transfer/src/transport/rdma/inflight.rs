//! Work requests posted and not yet completed: what the completion thread needs to finish
//! each (`InFlight`), in one table per device (`InFlightTable`, `Shared::inflight`).

use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::memory_region::MemoryRegion as VerbsMr;

use super::endpoint::Endpoint;
use super::work::Work;

/// A posted work request: what the completion thread needs to finish it.
pub(crate) struct InFlight {
    pub ep: Arc<Endpoint>,
    pub qp: usize,
    /// Its slices, in order, contiguous on both sides (one unless merged; never empty).
    pub works: Vec<Work>,
    /// Bytes of the work request (the slices' lengths summed).
    pub len: u64,
    pub rkey: u32,
    /// Keeps the local memory region registered until the work request completes.
    pub _mr: Arc<VerbsMr>,
    pub posted: Instant,
}

/// Table of work requests in flight on one device, indexed by the low 32 bits of the wr_id;
/// the high 32 bits are a generation so a stale id never matches a reused slot.
#[derive(Default)]
pub(crate) struct InFlightTable {
    slots: Vec<(u32, Option<InFlight>)>,
    free: Vec<u32>,
    pub count: usize,
}

impl InFlightTable {
    pub fn insert(&mut self, v: InFlight) -> u64 {
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push((0, None));
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[i as usize];
        slot.0 = slot.0.wrapping_add(1);
        slot.1 = Some(v);
        self.count += 1;
        ((slot.0 as u64) << 32) | i as u64
    }

    pub fn remove(&mut self, wr_id: u64) -> Option<InFlight> {
        let i = (wr_id & 0xffff_ffff) as usize;
        let gen = (wr_id >> 32) as u32;
        let slot = self.slots.get_mut(i)?;
        if slot.0 != gen {
            return None;
        }
        let v = slot.1.take()?;
        self.free.push(i as u32);
        self.count -= 1;
        Some(v)
    }

    /// The entry of `wr_id`, if it is in the table.
    pub fn get(&self, wr_id: u64) -> Option<&InFlight> {
        let slot = self.slots.get((wr_id & 0xffff_ffff) as usize)?;
        (slot.0 == (wr_id >> 32) as u32).then_some(slot.1.as_ref()?)
    }

    /// Every entry (for the watchdog and shutdown).
    pub fn iter(&self) -> impl Iterator<Item = &InFlight> {
        self.slots.iter().filter_map(|s| s.1.as_ref())
    }

    pub fn drain(&mut self) -> Vec<InFlight> {
        let out: Vec<InFlight> = self.slots.iter_mut().filter_map(|s| s.1.take()).collect();
        self.slots.clear();
        self.free.clear();
        self.count = 0;
        out
    }
}
