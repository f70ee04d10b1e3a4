//! Loads read in one pass (docs/design.md §4.10 "One pass"): where this consumer reads a
//! producer's KV over CUDA IPC and both hold every layer of the load in the same layout (block
//! counts aside), the checksum kernel itself copies each chunk it checksums from the
//! producer's blocks (mapped here) into this side's and sums the registers it stored. The
//! bytes cross device memory once for the copy and the checksum together, where a copy then a
//! checksum of the landed bytes read them twice.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kvferry_kernels::GroupResult;
use kvferry_transfer::sync::MutexExt;
use tracing::debug;

use super::copy_plan::{CopyReads, CopyTemplate, NoCopy};
use super::layout::{ProducerLayout, Reads, Shape};
use super::Consumer;
use crate::checksum::{wait_device, ChecksumError};
use crate::proto::msg::LoadRequest;
use crate::proto::progress::layer_slots_of;
use crate::proto::serve_error::{WriteError, WriteErrorKind};
use crate::shell::consumer_config::{ReadCheck, ReadMode};
use crate::shell::verify_parts::{Parts, Selector};
use crate::worker::Worker;
use crate::LoadSpec;

/// A load's one-pass launch queued at its start ([`Consumer::launch_early`]).
pub(super) struct Early {
    /// The load's parts, whose jobs the launch runs.
    pub(super) parts: Parts,
    /// The launch.
    pub(super) submitted: Submitted,
    /// The producer's layout it reads with.
    pub(super) producer: Arc<ProducerLayout>,
}

/// What [`Consumer::launch_early`] did for a load.
pub(super) enum EarlyLaunch {
    /// Queued the load's launch.
    Launched(Early),
    /// Tried it and was refused (why: a debug line): the load is read in two passes, without
    /// trying again.
    Refused,
    /// Not for this load: reads or one pass are off, or the producer or the request shape was
    /// not read in one pass before.
    No,
}

impl Consumer {
    /// Queues the one-pass launch of `request` (built from `spec`, the load that started at
    /// `started`) at once, where an earlier load of its shape from that producer was read in
    /// one pass (its template is made then) and reads are on; else the load goes its usual
    /// way ([`EarlyLaunch`]).
    pub(super) fn launch_early(
        &self,
        spec: &LoadSpec,
        request: &LoadRequest,
        started: Instant,
    ) -> EarlyLaunch {
        let on = self.config.read != ReadMode::Never
            && self.checksums
            && self.queue_checksums
            && self.config.read_check == ReadCheck::OnePass;
        if !on {
            return EarlyLaunch::No;
        }
        let producer = match self.reads.locked().get(&spec.producer) {
            Some(Reads::Yes(l)) => l.clone(),
            _ => return EarlyLaunch::No,
        };
        if !producer.warm.load(Ordering::Acquire) {
            return EarlyLaunch::No;
        }
        // A shape not planned yet is planned by the load's usual way, which launches it too.
        if producer.copy_template(request).is_none() {
            return EarlyLaunch::No;
        }
        let mut parts = Parts::new(
            self.workers.clone(),
            Arc::new(Selector::new(spec)),
            layer_slots_of(&self.layouts, &request.blocks),
            self.config.checksum_timeout,
        )
        .with_fingerprints(self.fingerprints.clone());
        // `None` for a shape whose layers do not pair up, as for a load refused.
        let copy = self.copy_reads(&producer, &mut parts, request);
        let planned_us = started.elapsed().as_micros() as u64;
        let rid = &spec.request_id;
        match copy.and_then(|c| self.submit_copy(c, rid, started, planned_us)) {
            Some(submitted) => EarlyLaunch::Launched(Early {
                parts,
                submitted,
                producer,
            }),
            None => EarlyLaunch::Refused,
        }
    }

    /// Starts `copy` ([`CopyReads::submit`]) for the load of `rid` that started at `started`
    /// and planned it by `planned_us`; `None` when its launch was refused before anything
    /// was queued (why: a debug line), and the load is read in two passes.
    pub(super) fn submit_copy(
        &self,
        copy: CopyReads,
        rid: &str,
        started: Instant,
        planned_us: u64,
    ) -> Option<Submitted> {
        match copy.submit(&self.workers) {
            Ok(s) => {
                debug!(
                    target: "kvferry::timing",
                    request_id = rid,
                    planned_us,
                    submit_us = started.elapsed().as_micros() as u64,
                    "read in one pass"
                );
                Some(s)
            }
            Err(why) => {
                debug!(request_id = rid, "read in two passes: {why}");
                None
            }
        }
    }

    /// The one-pass reads of `request` from `producer` (its template made once per request
    /// shape), where its layers and blocks pair up; else `None` (why: a debug line), and the
    /// load is read in two passes.
    pub(super) fn copy_reads(
        &self,
        producer: &ProducerLayout,
        parts: &mut Parts,
        request: &LoadRequest,
    ) -> Option<CopyReads> {
        let rid = &request.request_id;
        let template = match producer.copy_template(request) {
            Some(t) => t?,
            None => {
                let jobs = parts.whole_jobs();
                let t = match CopyTemplate::of(&self.workers, &jobs, &producer.ranks, request) {
                    Ok(t) => Some(Arc::new(t)),
                    Err(why) => {
                        debug!(request_id = rid, "read in two passes: {why}");
                        // Only a refusal of the whole shape is remembered.
                        if !why.lasting() {
                            return None;
                        }
                        None
                    }
                };
                let shape = Shape::groups(request).collect();
                *producer.copies.locked() = Some((shape, t.clone()));
                t?
            }
        };
        template
            .reads(
                &self.workers,
                parts.selections(),
                parts.num_tokens(),
                request,
            )
            .inspect_err(|why| debug!(request_id = rid, "read in two passes: {why}"))
            .ok()
    }
}

impl CopyReads {
    /// Starts every worker's launches on this task (the backends only enqueue: no host wait)
    /// and returns what to wait for. Errors: the first worker's backend refused its launch,
    /// so nothing was queued (the load goes in two passes). A later worker's refusal is kept
    /// for [`Submitted::wait`], which waits for the launches queued before it.
    pub(super) fn submit(self, workers: &[Worker]) -> Result<Submitted, NoCopy> {
        let at = Instant::now();
        let mut pending = Vec::with_capacity(workers.len());
        for ((w, plans), keep) in workers.iter().zip(self.plans).zip(self.keep) {
            // SAFETY: the layers are this worker's KV (the Worker contract: valid and registered
            // while it is in use, and this load's blocks are its own until it ends); the sources
            // are the producer's registered memory as mapped here, checked against its live
            // table, and `keep` holds those mappings until the device is done with the launch.
            match unsafe { w.backend.submit_planned(plans, keep) } {
                Ok(p) => pending.push((w.rank, Ok(p))),
                Err(e) if pending.is_empty() => return Err(NoCopy::Refused(e)),
                Err(e) => {
                    pending.push((w.rank, Err(ChecksumError::from(e))));
                    break;
                }
            }
        }
        Ok(Submitted {
            at,
            pending,
            bytes: self.bytes,
        })
    }
}

/// One-pass reads started ([`CopyReads::submit`]).
pub(super) struct Submitted {
    at: Instant,
    pending: Vec<(
        kvferry_checksum::group::RankInfo,
        Result<kvferry_kernels::PendingChecksums, ChecksumError>,
    )>,
    bytes: u64,
}

impl Submitted {
    /// Waits for every worker's launches until `deadline`, all of them even after one failed
    /// (none of them writes after this returns, unless it ran out of time): the bytes copied
    /// and each worker's results (indexed as the workers). Errors: the first worker's that
    /// failed (`Copy`: its kernel refused or failed) or did not end in time
    /// (`GroupsTimeout`: it may still write).
    pub(super) async fn wait(
        self,
        deadline: Instant,
    ) -> Result<(u64, Vec<Vec<GroupResult>>), WriteError> {
        let timeout = deadline.saturating_duration_since(self.at);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut first: Option<WriteError> = None;
        for (rank, p) in self.pending {
            let r = match p {
                Ok(p) => wait_device(p, self.at, timeout).await,
                Err(e) => Err(e),
            };
            let kind = match r {
                Ok(r) => {
                    out.push(r);
                    continue;
                }
                Err(ChecksumError::Timeout(t)) => WriteErrorKind::GroupsTimeout(t),
                Err(ChecksumError::Kernel(e)) => WriteErrorKind::Copy(e),
                // Not from a device wait; taken as a launch that may still run.
                Err(_) => WriteErrorKind::GroupsTimeout(timeout),
            };
            // A timeout outranks a failure: what may still land must be said.
            let later = matches!(kind, WriteErrorKind::GroupsTimeout(_));
            if first.is_none() || later {
                first = Some(WriteError { rank, kind });
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok((self.bytes, out)),
        }
    }
}
