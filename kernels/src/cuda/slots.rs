//! The checksum backend's slots: the pinned and device buffers and events of one submission,
//! allocated ahead with the backend and reused, because an allocation on the submit path
//! synchronises the device.

use std::sync::Mutex;
use std::time::Instant;

use kvferry_cuda::driver::{Context, Event, EventState};
use kvferry_cuda::staging::Staging;
use kvferry_cuda::CudaError;

use crate::sync::MutexExt;

/// Slots allocated with the backend, in one piece (submissions in flight at once without
/// allocating, which synchronises the device): 16 loads in flight hold up to 5 each when
/// their producers name 4 layer groups (a producer naming more, up to the consumer's limit of
/// parts, makes its loads hold more: past these slots, submits allocate and wait).
pub(super) const PREALLOCATED_SLOTS: usize = 128;
/// Bytes per preallocated slot: views, block ids and outputs of a part of a load (e.g. 32
/// layers and 2048 blocks).
pub(super) const PREALLOCATED_BYTES: usize = 128 << 10;

/// Buffers of one submission: parameters (views, block ids) then outputs, in pinned host
/// memory and device memory at the same offsets, and its events.
pub(super) struct Slot {
    pub(super) mem: Staging,
    pub(super) ready: Event,
    pub(super) done: Event,
    pub(super) kstart: Event,
    pub(super) kend: Event,
    pub(super) timed: bool,
    /// What the submission's work needs alive until `done` (a copy launch's sources).
    pub(super) keep: crate::Keep,
}

#[derive(Default)]
pub(super) struct Pool {
    pub(super) free: Vec<Slot>,
    /// Slots whose pending result was dropped before completion: reused once `done` completes.
    retiring: Vec<Slot>,
    /// Slots allocated on the submit path so far (a warning at 1, 2, 4, ...).
    late: u64,
}

/// Most free slots a backend keeps; one more given back is freed (after a burst past the
/// slots allocated ahead, the pool shrinks back to this).
const SLOTS_KEPT: usize = 256;

/// The smallest free slot of at least `need` bytes, taken out of `pool`.
fn best_free(pool: &mut Pool, need: usize) -> Option<Slot> {
    let best = pool
        .free
        .iter()
        .enumerate()
        .filter(|(_, s)| s.mem.len() >= need)
        .min_by_key(|(_, s)| s.mem.len())
        .map(|(i, _)| i)?;
    Some(pool.free.swap_remove(best))
}

/// A free slot of `pool` of at least `need` bytes (the smallest that fits); when none fits,
/// the same after moving the retiring slots whose work completed to the free ones (each
/// asked about under the lock: only then); or, when none fits still, one allocated now in
/// `ctx` (current on this thread). Errors: the driver's.
pub(super) fn take_slot(pool: &Mutex<Pool>, ctx: &Context, need: usize) -> Result<Slot, CudaError> {
    let released = {
        let mut pool = pool.locked();
        if let Some(s) = best_free(&mut pool, need) {
            return Ok(s);
        }
        let released = reap(&mut pool);
        if let Some(s) = best_free(&mut pool, need) {
            drop(pool);
            drop(released);
            return Ok(s);
        }
        released
    };
    drop(released);
    // Allocation happens only when the pool has no free slot large enough (more
    // submissions in flight than slots, or a larger one than before). It synchronises
    // the device: the submit waits for the work queued on every stream.
    let t = Instant::now();
    let cap = need.next_power_of_two().max(PREALLOCATED_BYTES);
    let slot = Staging::new(ctx, cap).and_then(|mem| slot_in(ctx, mem))?;
    let alloc_us = t.elapsed().as_micros() as u64;
    tracing::debug!(
        target: "kvferry::timing",
        bytes = cap,
        alloc_us,
        "checksum slot allocated on the submit path"
    );
    let late = {
        let mut pool = pool.locked();
        pool.late += 1;
        pool.late
    };
    if late.is_power_of_two() {
        tracing::warn!(
            "checksum slot {late} allocated on the submit path ({alloc_us} µs: the allocation \
             waits for all the device's queued work): more checksum submissions in flight than \
             the {PREALLOCATED_SLOTS} allocated ahead, or one over {PREALLOCATED_BYTES} bytes"
        );
    }
    Ok(slot)
}

/// Moves the retiring slots whose work completed to the free ones (each asked about under the
/// lock) and returns what they kept, to be dropped once the lock is released (dropping a
/// mapping may wait for the driver).
fn reap(pool: &mut Pool) -> Vec<crate::Keep> {
    let mut released = Vec::new();
    let mut k = 0;
    while k < pool.retiring.len() {
        if matches!(pool.retiring[k].done.query(), Ok(EventState::Done)) {
            let mut s = pool.retiring.swap_remove(k);
            released.push(std::mem::take(&mut s.keep));
            pool.free.push(s);
        } else {
            k += 1;
        }
    }
    released
}

/// A slot over `mem`, with its events made in `ctx`. Errors: the driver's.
pub(super) fn slot_in(ctx: &Context, mem: Staging) -> Result<Slot, CudaError> {
    Ok(Slot {
        mem,
        ready: Event::new(ctx, false)?,
        done: Event::new(ctx, false)?,
        kstart: Event::new(ctx, true)?,
        kend: Event::new(ctx, true)?,
        timed: false,
        keep: Vec::new(),
    })
}

/// Gives `slot` back once its work completed: kept for the next submission, up to
/// [`SLOTS_KEPT`] free ones; past that it is freed here (outside the lock).
pub(super) fn give_back(pool: &Mutex<Pool>, mut slot: Slot) {
    let kept = std::mem::take(&mut slot.keep);
    let mut p = pool.locked();
    // Slots retired with their work still running hold what their launches read (a copy's
    // sources): reaped here too, not only when a submit runs short of slots.
    let released = if p.retiring.is_empty() {
        Vec::new()
    } else {
        reap(&mut p)
    };
    if p.free.len() < SLOTS_KEPT {
        p.free.push(slot);
        drop(p);
    } else {
        drop(p);
        drop(slot);
    }
    drop((kept, released));
}

/// Retires `slot`, whose work may still run (its result was dropped, or its submit or poll
/// failed): [`take_slot`] reuses it once its `done` event has completed.
pub(super) fn retire(pool: &Mutex<Pool>, slot: Slot) {
    pool.locked().retiring.push(slot);
}
