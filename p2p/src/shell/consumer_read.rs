//! Loads the consumer reads itself (docs/design.md §4.10). Where the producer's KV memory is
//! reached over CUDA IPC, a load is fastest when no producer hop sits before the first copy or
//! between a copy and its checksum: the consumer plans the copies from the producer's layout
//! (sent once, in a FINISH), starts the reads and sends its request beside them, and checksums
//! each layer group as soon as its copies complete (on a device: kernels queued behind the
//! copies at their submit). The producer checks the request against its lease and answers with
//! the payload while the copies run; `read_done` ends its lease.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::Instant;

use kvferry_transfer::sync::MutexExt;
use kvferry_transfer::{Op, Shared, Token, TransferError, TransferPath};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::copy::EarlyLaunch;
use super::layout::{Asked, ProducerLayout, Reads, Shape};
use super::{Consumer, Phases};
use crate::error::{LoadError, LoadSpecFault};
use crate::proto::consumer::FailReason;
use crate::proto::layout::RankLayout;
use crate::proto::msg::LayerSpan;
use crate::proto::msg::{LoadRequest, Reply};
use crate::proto::msg_read::{layout_digest, layout_from_wire};
use crate::proto::progress::{layer_groups, layer_slots};
use crate::proto::read_plan::{read_plans, ReadTemplate};
use crate::proto::serve::RankPlan;
use crate::shell::connection::{ConnCmd, ConnFailure, LoadProgress};
use crate::shell::consumer_config::{LoadOutcome, ReadCheck, ReadMode};
use crate::shell::serve::{GroupedWrite, Queued};
use crate::shell::verify_parts::{Parts, Selector};
use crate::LoadSpec;
use futures::future::Either;
use futures::TryFutureExt;

/// A load planned to be read: the copies per (consumer rank, producer segment), local
/// addresses as `src`, and the layer groups they land in; none where its one-pass launch was
/// queued already ([`ReadPlan::launched`]).
pub(super) struct ReadPlan {
    plan_us: u64,
    plans: Vec<RankPlan>,
    groups: Vec<Range<u32>>,
    digest: [u8; 32],
    producer: Arc<ProducerLayout>,
}

impl ReadPlan {
    /// The plan of a load whose one-pass launch is queued already ([`Consumer::launch_early`]):
    /// nothing left for the transport to copy.
    pub(super) fn launched(producer: Arc<ProducerLayout>) -> ReadPlan {
        ReadPlan {
            plan_us: 0,
            plans: Vec::new(),
            groups: Vec::new(),
            digest: producer.digest,
            producer,
        }
    }
}

/// How a load by read ended without an outcome.
pub(super) enum ReadEnd {
    /// The producer will not serve it by read (`FailReason::ReadRefused`): nothing was served,
    /// and the load goes by WRITE.
    Refused,
    /// The load failed.
    Failed(LoadError),
}

/// Why this consumer does not read a producer's loads (logged once per producer).
#[derive(Debug, thiserror::Error)]
enum NoRead {
    #[error("its layout cannot be planned with: {0}")]
    Layout(#[from] crate::proto::msg_read::LayoutFromWireError),
    #[error("a rank holds no KV memory")]
    NoMemory,
    #[error("this side's KV memory is not device memory exported over CUDA IPC")]
    NotExported,
    #[error("segment {segment}: {source}")]
    Open {
        segment: String,
        source: TransferError,
    },
    #[error("segment {segment} is reached over {path}, not CUDA IPC")]
    Path { segment: String, path: TransferPath },
    #[error("checking the path did not end in time")]
    Timeout,
}

impl Consumer {
    /// Whether a load to `producer` asks for its layout: `Some` when reads are not off and
    /// nothing is known of it yet. One load asks (the others go by WRITE meanwhile); the
    /// [`Asked`] it holds lets a later load ask again unless its FINISH is taken
    /// ([`Consumer::learn_layout`]).
    pub(super) fn ask_layout(&self, producer: &str) -> Option<Asked> {
        if self.config.read == ReadMode::Never {
            return None;
        }
        let mut reads = self.reads.locked();
        if reads.contains_key(producer) {
            return None;
        }
        reads.insert(producer.to_string(), Reads::Asked);
        Some(Asked {
            reads: self.reads.clone(),
            producer: producer.to_string(),
        })
    }

    /// Takes the layout `reply` (a FINISH to a load that asked) carries, and decides once,
    /// on a task of its own (the load does not wait), whether `producer`'s loads are read
    /// here ([`readable`]). Loads go by WRITE until it is decided.
    pub(super) fn learn_layout(&self, asked: Asked, reply: &Reply) {
        let reads = asked.reads.clone();
        let producer = asked.producer.clone();
        if reply.layout.is_empty() {
            reads.locked().insert(producer, Reads::No);
            return;
        }
        reads.locked().insert(producer.clone(), Reads::Deciding);
        let layout = reply.layout.clone();
        let workers = self.workers.clone();
        let (mode, limit) = (
            self.config.read,
            self.config.connect_timeout.saturating_mul(2),
        );
        tokio::spawn(async move {
            let r = match readable(&workers, &layout, mode, limit).await {
                Ok(layout) => {
                    info!(
                        producer,
                        "loads from this producer are read here (its KV is reached over CUDA IPC)"
                    );
                    Reads::Yes(Arc::new(layout))
                }
                Err(why) => {
                    debug!(
                        producer,
                        "loads from this producer are written by it: {why}"
                    );
                    Reads::No
                }
            };
            reads.locked().insert(producer, r);
        });
    }

    /// The plan to read `request` from `producer`, where its loads are read here and the
    /// plan holds (else `None`: the producer writes, and refuses what does not fit with its
    /// reason). The consumer trusts its own block tables here; the producer checks them
    /// against its lease before it answers.
    pub(super) fn read_plan(&self, producer: &str, request: &LoadRequest) -> Option<ReadPlan> {
        // A read that raced a publish or a reused lease is caught only by the checksums.
        if self.config.read == ReadMode::Never || !self.checksums {
            return None;
        }
        let layout = match self.reads.locked().get(producer) {
            Some(Reads::Yes(l)) => l.clone(),
            _ => return None,
        };
        let t = Instant::now();
        let segments = || {
            self.layouts
                .iter()
                .map(|l| l.segment.clone())
                .collect::<Vec<_>>()
        };
        // A request of the shape last read: its blocks' pairs from the template, no plan.
        let cached = {
            let template = layout.template.locked();
            template
                .as_ref()
                .filter(|(k, _)| k.fits(request))
                .map(|(_, t)| t.clone())
        };
        let plans = match cached {
            Some(t) => t.reads(request),
            None => {
                let plans = match read_plans(&layout.ranks, &segments(), request) {
                    Ok(p) => p?,
                    Err(e) => {
                        debug!(request_id = request.request_id, "not read, written: {e}");
                        return None;
                    }
                };
                if let Some(t) = ReadTemplate::of(&layout.ranks, &segments(), request) {
                    *layout.template.locked() = Some((Shape::of(request), Arc::new(t)));
                }
                plans
            }
        };
        let mut slot_bytes = vec![0u64; layer_slots(request).len()];
        for p in &plans {
            p.add_slot_bytes(&mut slot_bytes);
        }
        let groups = layer_groups(&slot_bytes, self.config.read_group_bytes);
        debug!(
            target: "kvferry::timing",
            request_id = request.request_id,
            plan_us = t.elapsed().as_micros() as u64,
            groups = groups.len(),
            "read planned"
        );
        Some(ReadPlan {
            plan_us: t.elapsed().as_micros() as u64,
            plans,
            groups,
            digest: layout.digest,
            producer: layout.clone(),
        })
    }

    /// Tells `producer` that the reads of the load `reply` answered are over (`read_done`):
    /// its lease may end.
    async fn read_done(&self, producer: &str, reply: &Reply) {
        let done = ConnCmd::ReadDone {
            request_id: reply.request_id.clone(),
            load_id: reply.load_id,
        };
        self.dispatch(producer, done).await;
    }

    /// A load whose reads failed (`e`): logged, and its producer's next loads are written
    /// (`digest`'s layout forgotten).
    fn read_failed(
        &self,
        spec: &LoadSpec,
        digest: &[u8; 32],
        e: crate::proto::serve_error::WriteError,
    ) -> ReadEnd {
        let rid = &spec.request_id;
        warn!(
            request_id = rid,
            "reading the producer's blocks failed: {e}; its next loads are written"
        );
        self.forget_reads(&spec.producer, digest);
        ReadEnd::Failed(LoadError::Read {
            request_id: rid.clone(),
            why: Shared(Arc::new(e)),
        })
    }

    /// Forgets `producer`'s layout if it is still the one of `digest` (a newer one stays): its
    /// next load goes by WRITE and asks for the layout again.
    fn forget_reads(&self, producer: &str, digest: &[u8; 32]) {
        let mut reads = self.reads.locked();
        if matches!(reads.get(producer), Some(Reads::Yes(l)) if l.digest == *digest) {
            reads.remove(producer);
        }
    }

    /// Loads `spec` by reading (`reads`, planned from `request`): starts the reads, sends the
    /// request to read, checksums each layer group as it is queued on a device or lands, waits
    /// for both the reads and the producer's answer (by the reply deadline), tells the producer
    /// it has read, then verifies as any load. [`ReadEnd::Refused`]: the producer will not
    /// serve it by read and every read has ended (nothing served; after `read_refused` this
    /// side forgets the layout; the load goes by WRITE); reads that may still land fail it.
    /// `early`: the load's one-pass launch, queued already with its parts (`reads` then plans
    /// nothing), or tried and refused.
    pub(super) async fn load_by_read(
        &self,
        spec: &LoadSpec,
        mut request: LoadRequest,
        reads: ReadPlan,
        early: EarlyLaunch,
    ) -> Result<LoadOutcome, ReadEnd> {
        let rid = spec.request_id.clone();
        let started = Instant::now();
        // Within the budget sent with the request: the producer holds the lease that long.
        let budget = crate::proto::consumer::budget_of(self.config.max_wait);
        let deadline = started + budget.min(self.config.reply_deadline());
        let token = match Token::random() {
            Ok(t) => t,
            Err(e) => {
                // A launch queued already writes this load's blocks: it ends before the load
                // does, so that nothing lands in them after the caller takes them back.
                if let EarlyLaunch::Launched(e) = early {
                    let _ = e.submitted.wait(deadline).await;
                }
                return Err(ReadEnd::Failed(LoadError::Spec {
                    request_id: rid,
                    why: LoadSpecFault::Grant(Shared(Arc::new(e))),
                }));
            }
        };
        let (progress, mut heard) = mpsc::unbounded_channel();
        let queued = progress.clone();
        let tell = move |span| {
            let _ = progress.send(Heard::Landed(span));
        };
        let queued: Option<Queued> = self.queue_checksums.then(|| {
            Box::new(move |span, points| {
                let _ = queued.send(Heard::Queued(span, points));
            }) as Queued
        });
        let carried = Arc::new(OnceLock::new());
        let (workers, read) = (self.workers.clone(), Op::Read);
        // Dropped with this load (its caller gave up): no layer group is submitted after.
        let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
        // An earlier read from this producer succeeded: its memory is mapped here.
        let warm = reads.producer.warm.load(Ordering::Acquire);
        let (mut parts, submitted) = match early {
            EarlyLaunch::Launched(e) => (e.parts, Some(e.submitted)),
            tried => {
                let slots = if self.checksums {
                    layer_slots(&request)
                } else {
                    Vec::new()
                };
                let mut parts = Parts::new(
                    self.workers.clone(),
                    Arc::new(Selector::new(spec)),
                    slots,
                    self.config.checksum_timeout,
                )
                .with_fingerprints(self.fingerprints.clone());
                // Tried at the load's start and refused: not again.
                let one_pass = !matches!(tried, EarlyLaunch::Refused)
                    && warm
                    && self.queue_checksums
                    && self.config.read_check == ReadCheck::OnePass;
                let copy = one_pass
                    .then(|| self.copy_reads(&reads.producer, &mut parts, &request))
                    .flatten();
                // One pass: the kernels are queued first (this task only enqueues), before the
                // request goes out: they need nothing of the producer's answer, which comes
                // back while they run, and what they read is proved by the checksums, not by
                // the order.
                let planned_us = started.elapsed().as_micros() as u64;
                let submitted = copy.and_then(|c| self.submit_copy(c, &rid, started, planned_us));
                (parts, submitted)
            }
        };
        // The producer needs the blocks, not this side's memory: a smaller request.
        request.ranks = Vec::new();
        request.read = true;
        request.layout_digest = Some(reads.digest.to_vec());
        request.token = Some(token.to_string());
        let send = self.send(&spec.producer, request, spec.load_key.clone(), None);
        tokio::pin!(send);
        // The request goes out first (a hand-off to the connection's task), then the reads
        // start (below): the producer's answer comes back while the copies run, and what they
        // read is proved by the checksums, not by the order.
        let reads_plan_us = reads.plan_us;
        let mut reply = match futures::poll!(&mut send) {
            Poll::Ready(r) => Some(r),
            Poll::Pending => None,
        };
        // The connection's task, woken by that hand-off, waits in this worker's next-task slot
        // (which no other worker steals) until this task yields: it sends the request now, not
        // after the submits below.
        tokio::task::yield_now().await;
        let mut progress_time = std::time::Duration::ZERO;
        let mut take = |parts: &mut Parts, h: Heard| {
            let t = Instant::now();
            match h {
                Heard::Landed(span) => parts.progress(LoadProgress::Landed(span)),
                Heard::Queued(span, points) => parts.queued(span, &points),
            }
            progress_time += t.elapsed();
        };
        let reading = match submitted {
            Some(submitted) => {
                let _ = carried.set(TransferPath::CudaIpc);
                Either::Left(submitted.wait(deadline).map_ok(|(b, r)| (b, Some(r))))
            }
            None => {
                let mut write = GroupedWrite::new(
                    workers,
                    reads.plans,
                    &reads.groups,
                    read,
                    deadline,
                    None,
                    tell,
                    queued,
                    carried.clone(),
                    stop.0.clone(),
                );
                // Where the copies are device work and the producer's memory is mapped here (a
                // submit only enqueues), this task submits the groups it can and queues each
                // one's checksums behind its copies before the next one's: the device hears one
                // thread, in order, with no hand-off per group. The rest goes to the reads' task.
                while warm && write.submit_here() {
                    while let Ok(h) = heard.try_recv() {
                        take(&mut parts, h);
                    }
                }
                Either::Right(write.finish().map_ok(|b| (b, None)))
            }
        };
        tokio::pin!(reading);
        let mut bytes = None;
        let (mut read_at, mut reply_at) = Default::default();
        // Until both are in, or until the verdict can be worked out before the reads' task
        // ends: the producer answered and every layer's checksums are started or queued
        // behind its copies.
        while (reply.is_none() || bytes.is_none())
            && !(bytes.is_none() && matches!(reply, Some(Ok(_))) && parts.complete())
        {
            tokio::select! {
                biased;
                Some(h) = heard.recv() => take(&mut parts, h),
                r = &mut reading, if bytes.is_none() => {
                    bytes = Some(r.map(|(b, copied)| {
                        if let Some(results) = copied {
                            parts.copied(results);
                        }
                        b
                    }));
                    read_at = started.elapsed();
                }
                r = &mut send, if reply.is_none() => {
                    reply = Some(r);
                    reply_at = started.elapsed();
                }
            }
        }
        let phases = Phases {
            progress_us: progress_time.as_micros() as u64,
            ..Phases::default()
        };
        if let (None, Some(Ok(reply))) = (&bytes, &reply) {
            // The host's wait for the copies' end (the reads' task) is off the load's path: the
            // parts' results come no earlier, being ordered after the copies or started after
            // they landed. The verdict stands only if every read succeeded.
            // Every group is submitted by now: `carried` holds the first read's path.
            let (verify_at, path) = (started.elapsed().as_secs_f64(), carried.get().copied());
            let verdict = self.judge(spec, reply, parts, verify_at, phases, path, true);
            tokio::pin!(verdict);
            // The reads' end, then `read_done` at once: the producer's lease may end while the
            // verdict is still being worked out. Reads that failed drop the verdict unawaited.
            let read = async {
                // One-pass results end the loop above: the parts are complete only with them.
                let r = (&mut reading).await.map(|(b, _)| b);
                let at = started.elapsed();
                self.read_done(&spec.producer, reply).await;
                (r, at)
            };
            tokio::pin!(read);
            let mut early = None;
            let (bytes, read_at) = loop {
                tokio::select! {
                    biased;
                    r = &mut read => break r,
                    o = &mut verdict, if early.is_none() => early = Some(o),
                }
            };
            read_phases(&rid, reads_plan_us, read_at, reply_at);
            return match bytes {
                Ok(b) => {
                    reads.producer.warm.store(true, Ordering::Release);
                    let mut outcome = match early {
                        Some(o) => o,
                        None => verdict.await,
                    };
                    outcome.bytes = b;
                    outcome.transfer_seconds = read_at.as_secs_f64();
                    Ok(outcome)
                }
                Err(e) => Err(self.read_failed(spec, &reads.digest, e)),
            };
        }
        read_phases(&rid, reads_plan_us, read_at, reply_at);
        while let Ok(Heard::Landed(span) | Heard::Queued(span, _)) = heard.try_recv() {
            parts.late(LoadProgress::Landed(span));
        }
        let transfer_seconds = started.elapsed().as_secs_f64();
        let (Some(reply), Some(bytes)) = (reply, bytes) else {
            return Err(ReadEnd::Refused); // the loop above ends with both
        };
        // Reads whose copies may still land end the load even where the producer refused it:
        // they would land over what a WRITE into the same blocks brings.
        let refused = matches!(
            &reply,
            Err(ConnFailure::Failed(
                FailReason::ReadEarly(_) | FailReason::ReadRefused(_)
            ))
        );
        let bytes = match bytes {
            Err(e) if refused && e.may_still_land() => {
                self.forget_reads(&spec.producer, &reads.digest);
                return Err(ReadEnd::Failed(LoadError::Read {
                    request_id: rid,
                    why: Shared(Arc::new(e)),
                }));
            }
            b => b,
        };
        let mut reply = match reply {
            Ok(r) => r,
            Err(ConnFailure::Failed(FailReason::ReadEarly(why))) => {
                debug!(
                    request_id = rid,
                    "not served by read ({why}); loading by WRITE"
                );
                return Err(ReadEnd::Refused);
            }
            Err(ConnFailure::Failed(FailReason::ReadRefused(why))) => {
                debug!(
                    request_id = rid,
                    "not served by read ({why}); loading by WRITE"
                );
                self.forget_reads(&spec.producer, &reads.digest);
                return Err(ReadEnd::Refused);
            }
            Err(f) => {
                // Not a refusal of this request's shape (a lease mismatch is the lease's):
                // the next load goes by WRITE and asks for the layout again.
                if !matches!(f, ConnFailure::Failed(FailReason::LeaseMismatch(_))) {
                    self.forget_reads(&spec.producer, &reads.digest);
                }
                return Err(ReadEnd::Failed(self.load_error(spec, f)));
            }
        };
        // The reads are over, whatever they gave: the producer's lease may end.
        self.read_done(&spec.producer, &reply).await;
        reply.bytes_written = match bytes {
            Ok(b) => b,
            Err(e) => return Err(self.read_failed(spec, &reads.digest, e)),
        };
        reads.producer.warm.store(true, Ordering::Release);
        let path = carried.get().copied();
        Ok(self
            .judge(spec, &reply, parts, transfer_seconds, phases, path, true)
            .await)
    }
}

/// The timing line of a read load's phases (µs from its start): the plan, the reads' end as
/// the host saw it, the producer's answer.
fn read_phases(
    rid: &str,
    plan_us: u64,
    read_at: std::time::Duration,
    reply_at: std::time::Duration,
) {
    debug!(
        target: "kvferry::timing",
        request_id = rid,
        plan_us,
        read_us = read_at.as_micros() as u64,
        reply_us = reply_at.as_micros() as u64,
        "read phases"
    );
}

/// What the reads tell the load of a layer group.
enum Heard {
    /// Its copies completed.
    Landed(LayerSpan),
    /// Its copies were all enqueued on this side's devices, in place at these device points
    /// per worker ([`Queued`]).
    Queued(LayerSpan, Vec<Option<Vec<kvferry_transfer::StreamPoint>>>),
}

/// Whether a read load's layer groups are checksummed by kernels ordered after their copies on
/// the device, submitted as soon as the copies are (no host round trip between a copy's end
/// and its checksum's start): where every worker's KV is device memory and every worker reads
/// through an engine of its own. Host memory is checksummed as it lands, and so are ranks that
/// share an engine: a read plan submits a rank's copies through the first worker of its
/// segment, so one rank's reads land in the other's memory too and its points are not the
/// other's.
pub(super) fn queues_checksums(workers: &[crate::worker::Worker]) -> bool {
    let device = workers
        .iter()
        .all(|w| matches!(w.device, kvferry_kernels::Location::Cuda(_)));
    let mut seen = std::collections::HashSet::new();
    device && workers.iter().all(|w| seen.insert(w.engine.segment_name()))
}

/// Sets its flag when dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// `layout` (a producer's, from its FINISH), if `workers` read with it in `mode`: it parses
/// and, unless `mode` is [`ReadMode::Always`], every worker reaches every producer rank's
/// memory over CUDA IPC (checked by opening the segments, within `limit`).
async fn readable(
    workers: &Arc<Vec<crate::worker::Worker>>,
    layout: &crate::proto::msg_read::WireProducerLayout,
    mode: ReadMode,
    limit: std::time::Duration,
) -> Result<ProducerLayout, NoRead> {
    let ranks = layout_from_wire(layout)?;
    let layout = ProducerLayout {
        ranks,
        digest: layout_digest(layout),
        template: std::sync::Mutex::new(None),
        warm: AtomicBool::new(false),
        copies: std::sync::Mutex::new(None),
    };
    if mode == ReadMode::Always {
        return Ok(layout);
    }
    let first = |r: &RankLayout| {
        r.groups
            .iter()
            .flat_map(|g| &g.layers)
            .next()
            .map(|l| l.addr)
    };
    let mut pairs = Vec::new();
    for w in workers.iter() {
        let local = w
            .groups
            .iter()
            .flat_map(|g| &g.layers)
            .next()
            .ok_or(NoRead::NoMemory)?
            .addr;
        // Only device memory exported over CUDA IPC here can be read into that way: a
        // host-memory consumer opens nothing.
        if w.engine.region_cuda_ipc(local).is_none_or(|r| r.is_err()) {
            return Err(NoRead::NotExported);
        }
        for r in &layout.ranks {
            let remote = first(r).ok_or(NoRead::NoMemory)?;
            pairs.push((w.engine.clone(), local, r.segment.clone(), remote));
        }
    }
    let check = tokio::task::spawn_blocking(move || {
        for (engine, local, segment, remote) in pairs {
            let open = |source| NoRead::Open {
                segment: segment.clone(),
                source,
            };
            let handle = engine.open_segment(&segment).map_err(open)?;
            let path = engine.transfer_path(&handle, local, remote).map_err(open)?;
            if path != TransferPath::CudaIpc {
                return Err(NoRead::Path { segment, path });
            }
        }
        Ok(())
    });
    match tokio::time::timeout(limit, check).await {
        Ok(Ok(r)) => r.map(|()| layout),
        _ => Err(NoRead::Timeout),
    }
}
