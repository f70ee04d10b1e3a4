//! Submitting checksum jobs to a side stream: each group's launch plan, the slot's parameters, the
//! waits the work is ordered after (a caller's stream or a writer's events), the upload, the
//! outputs' reset, one launch per group, the results' copy back and the event polled.

use std::ffi::c_void;

use super::view::{launch_plan, LayerView};
use super::{
    align, chunks_per_thread, driver, kerr, slots, CopyJob, CudaBackend, CudaPending, Event,
    GroupJob, Inner, JobFault, Keep, KernelError, KernelVariant, LaunchPlan, Location, Ordering,
    PendingGroup, RawStream, Slot, THREADS,
};
use crate::job::plan_error;
use crate::{CopyPlans, LayerInput};
use kvferry_checksum::group::LayerSpec;
use kvferry_cuda::CudaError;

impl CudaBackend {
    /// Submits `jobs` (one launch per group) on the next side stream, ordered after the work
    /// already queued on `after` (the caller's stream) by an event, or unordered when
    /// `after` is `None` (the data is already in place as far as the host knows, e.g. it
    /// landed by RDMA). Returns at once; the caller's stream is never synchronised and the
    /// host never blocks on the device here.
    ///
    /// Errors: a job for another device, a layer the kernel cannot read (see
    /// [`super::view::launch_plan`]), or a driver failure.
    ///
    /// # Safety
    /// Every layer's `[addr, addr + len)` is device memory of this device that stays
    /// valid until the result is taken (or the pending value is dropped and the device
    /// is done with it); `after` is a live stream of this device's primary context.
    pub unsafe fn submit_after(
        &self,
        jobs: Vec<GroupJob>,
        after: Option<RawStream>,
    ) -> Result<CudaPending, KernelError> {
        let after = after.map_or(After::Nothing, After::Stream);
        // SAFETY: forwarded from this function's contract.
        unsafe { self.submit_ordered(jobs, after) }
    }

    /// As [`CudaBackend::submit_after`], ordered after every event of `events` instead of a
    /// caller's stream: each was recorded on a stream of this device after the work that
    /// writes the layers (a transport's copies into them), and the side stream waits for each
    /// on the device, so the kernels start as soon as the copies end with no host round trip.
    /// No events: unordered, as `submit`. Errors as `submit_after`.
    ///
    /// # Safety
    /// As `submit_after`; every event is of this device's primary context and was recorded
    /// (an event never recorded is complete at once, which orders nothing).
    pub unsafe fn submit_after_events(
        &self,
        jobs: Vec<GroupJob>,
        events: &[&Event],
    ) -> Result<CudaPending, KernelError> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.submit_ordered(jobs, After::Events(events)) }
    }

    /// The body of [`CudaBackend::submit_after`] and [`CudaBackend::submit_after_events`].
    ///
    /// # Safety
    /// As theirs.
    unsafe fn submit_ordered(
        &self,
        jobs: Vec<GroupJob>,
        after: After<'_>,
    ) -> Result<CudaPending, KernelError> {
        let mut plans: Vec<(u32, LaunchPlan)> = Vec::with_capacity(jobs.len());
        for job in &jobs {
            crate::job::validate_job_on(job, Location::Cuda(self.inner.ctx.ordinal()))?;
            let layers: Vec<(&LayerSpec, u64, u64)> =
                job.layers.iter().map(LayerInput::as_plan_layer).collect();
            let plan = launch_plan(
                &layers,
                &job.selection.block_ids,
                job.selection.start,
                job.num_tokens,
            )
            .map_err(plan_error(job.group_id))?;
            plans.push((job.group_id, plan));
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { self.submit_plans(plans, after, Keep::new()) }
    }

    /// [`crate::ChecksumBackend::submit_copying`]: each job's launch copies every chunk it
    /// checksums from its sources first (`kvf_copy_checksum`), on the next side stream,
    /// unordered; `keep` stays with the submission's slot until its work completed. Errors
    /// as `submit_after`, and a source that does not pair up with its layer
    /// ([`super::view::copy_plan`]).
    ///
    /// # Safety
    /// As the trait method's.
    pub unsafe fn submit_copying(
        &self,
        jobs: Vec<CopyJob>,
        keep: Keep,
    ) -> Result<CudaPending, KernelError> {
        let plans = CopyPlans::new(Location::Cuda(self.inner.ctx.ordinal()), &jobs)?;
        // SAFETY: forwarded from this function's contract.
        unsafe { self.submit_planned(plans, keep) }
    }

    /// [`crate::ChecksumBackend::submit_planned`]: `plans` (checked when made) on the next
    /// side stream, unordered, as [`CudaBackend::submit_copying`]. Errors: plans for another
    /// device, or a driver failure.
    ///
    /// # Safety
    /// As the trait method's.
    pub unsafe fn submit_planned(
        &self,
        plans: CopyPlans,
        keep: Keep,
    ) -> Result<CudaPending, KernelError> {
        let backend = Location::Cuda(self.inner.ctx.ordinal());
        if plans.device() != backend {
            return Err(KernelError::InvalidJob {
                group_id: plans.first_group(),
                why: JobFault::WrongDevice {
                    job: plans.device(),
                    backend,
                },
            });
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { self.submit_plans(plans.into_launches(), After::Nothing, keep) }
    }

    /// Enqueues `plans` (one launch each) on a side stream after `after`, their slot keeping
    /// `keep`.
    ///
    /// # Safety
    /// As `submit_after`'s, for every plan's layers and sources.
    unsafe fn submit_plans(
        &self,
        plans: Vec<(u32, LaunchPlan)>,
        after: After<'_>,
        keep: Keep,
    ) -> Result<CudaPending, KernelError> {
        let inner = &self.inner;
        // Byte layout of the slot: [views, block ids, source block ids]* then [outputs]*.
        let mut off = 0usize;
        let mut param_offs = Vec::with_capacity(plans.len());
        for (_, p) in &plans {
            let v = align(off, 16);
            let ids = align(v + p.views.len() * std::mem::size_of::<LayerView>(), 8);
            off = ids + (p.block_ids.len() + p.src_block_ids.len()) * 8;
            param_offs.push((v, ids));
        }
        let params_len = off;
        let out_base = align(params_len, 256);
        let mut out_offs = Vec::with_capacity(plans.len());
        let mut o = out_base;
        for (_, p) in &plans {
            out_offs.push(o);
            o += p.block_ids.len() * p.keys.len() * 8;
        }
        let out_len = o - out_base;
        inner.ctx.bind().map_err(kerr)?;
        let slot = slots::take_slot(&inner.pool, &inner.ctx, o).map_err(kerr)?;
        let host = slot.mem.host();
        for ((_, p), &(v, ids)) in plans.iter().zip(&param_offs) {
            // SAFETY: the slot's pinned buffer holds at least `o` bytes (take_slot); the views
            // and block ids fit at their offsets, computed above from these lengths, and no
            // device work uses the slot yet.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    p.views.as_ptr() as *const u8,
                    host.add(v),
                    p.views.len() * std::mem::size_of::<LayerView>(),
                );
                std::ptr::copy_nonoverlapping(
                    p.block_ids.as_ptr() as *const u8,
                    host.add(ids),
                    p.block_ids.len() * 8,
                );
                std::ptr::copy_nonoverlapping(
                    p.src_block_ids.as_ptr() as *const u8,
                    host.add(ids + p.block_ids.len() * 8),
                    p.src_block_ids.len() * 8,
                );
            }
        }
        // The outputs start at zero (the kernels add into them): zeroed here and uploaded with
        // the parameters, one copy where a memset would be one more driver call per submit.
        // SAFETY: the slot's pinned buffer holds at least `o` bytes (take_slot) and no device
        // work uses the slot yet.
        unsafe { std::ptr::write_bytes(host.add(params_len), 0, o - params_len) };
        let timed = inner.timing.load(Ordering::Relaxed);
        let side = match after {
            After::Events(e) if !e.is_empty() => inner.ordered.raw(),
            _ => {
                let next = inner.next.fetch_add(1, Ordering::Relaxed);
                inner.streams[next % inner.streams.len()].raw()
            }
        };
        // SAFETY: forwarded from this function's contract (the layers' device memory, `after`);
        // `side` is one of the backend's streams.
        let r = unsafe {
            inner.enqueue(
                side,
                &slot,
                &plans,
                &param_offs,
                &out_offs,
                out_base,
                out_len,
                after,
                timed,
            )
        };
        let mut slot = slot;
        slot.timed = timed;
        slot.keep = keep;
        if let Err(e) = r {
            // Whatever was queued may still run: retire the slot behind a fresh record.
            // SAFETY: `side`, the stream this submission took, is the backend's own and of
            // the event's context.
            let _ = unsafe { slot.done.record(side) };
            slots::retire(&inner.pool, slot);
            return Err(kerr(e));
        }
        let groups = plans
            .into_iter()
            .zip(out_offs)
            .map(|((group_id, p), out_off)| PendingGroup {
                group_id,
                start: p.start,
                blocks: p.block_ids.len(),
                keys: p.keys,
                out_off,
            })
            .collect();
        Ok(CudaPending {
            inner: self.inner.clone(),
            slot: Some(slot),
            groups,
            kernel_ms: None,
        })
    }
}

/// What a submission's kernels wait for on the device before they read the layers.
#[derive(Clone, Copy)]
pub(super) enum After<'a> {
    /// Nothing: the data is in place as far as the host knows.
    Nothing,
    /// The work queued so far on a caller's stream (an event recorded there).
    Stream(RawStream),
    /// Each of these events, recorded by the writer of the layers.
    Events(&'a [&'a Event]),
}

impl Inner {
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn enqueue(
        &self,
        s: RawStream,
        slot: &Slot,
        plans: &[(u32, LaunchPlan)],
        param_offs: &[(usize, usize)],
        out_offs: &[usize],
        out_base: usize,
        out_len: usize,
        after: After<'_>,
        timed: bool,
    ) -> Result<(), CudaError> {
        // SAFETY: the slot is this submission's alone (pinned host and device buffers sized
        // for the params and outputs by `take_slot`); the layers' memory and `after` are valid
        // by `submit_after`'s contract; every handle is of this backend's context, bound by
        // the caller; the kernel arguments match `kvf_checksum`'s signature.
        unsafe {
            match after {
                After::Nothing => {}
                After::Stream(caller) => {
                    slot.ready.record(caller)?;
                    driver::stream_wait(s, &slot.ready)?;
                }
                After::Events(events) => {
                    for e in events {
                        driver::stream_wait(s, e)?;
                    }
                }
            }
            let dev = slot.mem.dev();
            // The parameters and the zeroed outputs after them ([`CudaBackend::submit_plans`]).
            let upload = out_base + out_len;
            if upload > 0 {
                driver::copy_htod_async(dev, slot.mem.host(), upload, s)?;
            }
            if timed {
                slot.kstart.record(s)?;
            }
            for (((_, p), &(v, ids)), &out) in plans.iter().zip(param_offs).zip(out_offs) {
                if p.total_tiles == 0 {
                    continue;
                }
                let mut a_views = dev + v as u64;
                let mut a_nl = p.views.len() as u32;
                let mut a_ids = dev + ids as u64;
                let mut a_src = dev + ids as u64 + p.block_ids.len() as u64 * 8;
                let mut a_nb = p.block_ids.len() as u32;
                let mut a_start = p.start;
                let mut a_nt = p.num_tokens;
                let mut a_ns = p.keys.len() as u32;
                let mut a_tpg = p.tiles_per_group;
                let mut a_out = dev + out as u64;
                let copies = !p.src_block_ids.is_empty();
                // `kvf_checksum`'s nine arguments; `kvf_copy_checksum` takes the source block
                // ids after the block ids.
                let mut all: [*mut c_void; 10] = [
                    &mut a_views as *mut u64 as *mut c_void,
                    &mut a_nl as *mut u32 as *mut c_void,
                    &mut a_ids as *mut u64 as *mut c_void,
                    &mut a_src as *mut u64 as *mut c_void,
                    &mut a_nb as *mut u32 as *mut c_void,
                    &mut a_start as *mut u64 as *mut c_void,
                    &mut a_nt as *mut u64 as *mut c_void,
                    &mut a_ns as *mut u32 as *mut c_void,
                    &mut a_tpg as *mut u32 as *mut c_void,
                    &mut a_out as *mut u64 as *mut c_void,
                ];
                if !copies {
                    all.copy_within(4.., 3);
                }
                let args = &mut all[..if copies { 10 } else { 9 }];
                let u8 = match self.variant {
                    KernelVariant::Unroll4 => false,
                    KernelVariant::Unroll8 => true,
                    KernelVariant::Auto => chunks_per_thread(p) > 4,
                };
                let (kernel, grid_cap) = if copies {
                    self.copy_kernels[u8 as usize]
                } else {
                    self.kernels[u8 as usize]
                };
                let grid = p.total_tiles.min(grid_cap).max(1);
                kernel.launch(s, grid, THREADS, args)?;
            }
            if timed {
                slot.kend.record(s)?;
            }
            if out_len > 0 {
                driver::copy_dtoh_async(
                    slot.mem.host().add(out_base),
                    dev + out_base as u64,
                    out_len,
                    s,
                )?;
            }
            slot.done.record(s)?;
            Ok(())
        }
    }
}
