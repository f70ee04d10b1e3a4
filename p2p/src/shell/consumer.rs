//! The consumer (docs/design.md §4): one DEALER per producer (rebuilt after a failure:
//! the `zeromq` crate's DEALER does not reconnect by itself), the load state
//! machine of [`crate::proto::consumer`], and verification of every landed load
//! (§2.5–§2.7) before it is reported.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use kvferry_checksum::payload::Payload;
use kvferry_checksum::policy::Action;
use kvferry_checksum::record::consumer_sums;
use kvferry_checksum::verdict::{compare, log_verdict, UnverifiedReason, Verdict};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use crate::error::{LoadError, LoadSpecFault, P2pError};
use crate::proto::consumer::ConnectFailure;
use crate::proto::consumer::{FailReason, LinkError};
use crate::proto::layout::RankLayout;
use crate::proto::msg::{LoadRequest, Reply};
use crate::proto::progress::layer_slots;
use crate::proto::request::{build_blocks, grant_ranges, wire_ranks};
pub use crate::proto::request::{Landed, LandedGroup, LoadGroup, LoadSpec};
use crate::shell::connection::{ConnCmd, ConnFailure, Connection, LoadCmd, LoadProgress};
use crate::shell::consumer_config::carrier_check;
pub use crate::shell::consumer_config::{
    ConsumerConfig, LoadOutcome, ReadCheck, ReadMode, DEFAULT_READ_GROUP_BYTES,
};
use crate::shell::load_metrics::{record_load, Loaded};
use crate::shell::verify_parts::{Parts, Selector};
use crate::worker::{validate, Worker, WorkerGroup};
use kvferry_transfer::sync::RwLockExt;
use kvferry_transfer::{
    GrantGuard, GrantOps, GrantSpec, Secret, Shared, Token, TransferEngine, TransferError,
};

/// Called after a load's transfer finished and before its verification (fault
/// injection: the demo flips bits here). Runs on the loading task; keep it short.
/// A load the hook runs for verifies every layer after it, none as it lands.
pub type LandedHook = Arc<dyn Fn(&Landed) + Send + Sync>;

/// Which loads, by request id, a [`LandedHook`] runs for (asked when the load starts).
pub type HookFilter = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// A consumer: TP×PP workers and a DEALER per producer.
pub struct Consumer {
    config: ConsumerConfig,
    checksums: bool,
    workers: Arc<Vec<Worker>>,
    /// The workers as the request builder sees them (same order).
    layouts: Vec<RankLayout>,
    tp: u32,
    pp: u32,
    conns: tokio::sync::Mutex<HashMap<String, mpsc::UnboundedSender<ConnCmd>>>,
    hook: RwLock<Option<(LandedHook, Option<HookFilter>)>>,
    /// The workers' shared secret: producers must prove it before any request goes to them.
    secret: Option<Secret>,
    /// This consumer's name in sessions: its first rank's segment.
    name: String,
    /// Per producer endpoint: whether its loads are read here, with its layout
    /// (docs/design.md §4.10). A producer not listed is asked for its layout.
    reads: Arc<std::sync::Mutex<HashMap<String, layout::Reads>>>,
    /// Whether a read load's checksums are queued on the device behind its copies
    /// ([`read::queues_checksums`]): a property of the workers, worked out once.
    queue_checksums: bool,
    /// The workers' group fingerprints, computed once (every load's record names them).
    fingerprints: crate::shell::verify_parts::Fingerprints,
}

/// A byte range of a registered region: (offset, length).
type Range = (u64, u64);

impl Consumer {
    /// Validates the workers (one TP×PP grid, agreeing groups) and the carrier
    /// check (§2.7). Errors: [`P2pError::Workers`]; [`P2pError::Config`] when
    /// checksums are enabled fail-closed with no carrier.
    pub fn new(config: ConsumerConfig, workers: Vec<Worker>) -> Result<Consumer, P2pError> {
        let (tp, pp, workers) = validate(workers)?;
        let checksums = carrier_check(&config)?;
        let secret = crate::shell::producer_config::workers_secret(&workers)?;
        if secret.is_some() && config.read == ReadMode::Always {
            return Err(P2pError::Config(
                crate::error::ConfigFault::AlwaysReadWithSecret,
            ));
        }
        let name = workers
            .first()
            .map(|w| w.engine.segment_name())
            .unwrap_or_default();
        let queue_checksums = checksums && read::queues_checksums(&workers);
        let fingerprints = crate::shell::verify_parts::worker_fingerprints(&workers);
        Ok(Consumer {
            fingerprints,
            queue_checksums,
            secret,
            name,
            config,
            checksums,
            layouts: workers.iter().map(Worker::layout).collect(),
            workers: Arc::new(workers),
            tp,
            pp,
            conns: tokio::sync::Mutex::new(HashMap::new()),
            hook: RwLock::new(None),
            reads: Arc::new(std::sync::Mutex::new(HashMap::new())),
        })
    }

    /// Whether loads are verified (checksums enabled and a carrier present).
    pub fn checksums_enabled(&self) -> bool {
        self.checksums
    }

    /// Installs (or with `None` removes) the hook run after each transfer and before
    /// verification. Loads then verify every layer after the hook, none as it lands.
    pub fn set_landed_hook(&self, hook: Option<LandedHook>) {
        *self.hook.write_locked() = hook.map(|h| (h, None));
    }

    /// Installs `hook` for the loads whose request id `runs_for` accepts when they start; the
    /// others verify their layers as they land (docs/design.md §4.9).
    pub fn set_landed_hook_for(&self, hook: LandedHook, runs_for: HookFilter) {
        *self.hook.write_locked() = Some((hook, Some(runs_for)));
    }

    /// The hook to run after the load of `request_id` lands, if any.
    fn hook_for(&self, request_id: &str) -> Option<LandedHook> {
        match &*self.hook.read_locked() {
            Some((h, None)) => Some(h.clone()),
            Some((h, Some(f))) if f(request_id) => Some(h.clone()),
            _ => None,
        }
    }

    /// Loads `spec`: asks the producer to WRITE the blocks, waits for its reply
    /// (bounded by `reply_timeout` / `max_wait`), runs the landed hook, checksums
    /// the landed blocks on every rank (tokens `[num_local_computed, num_tokens)`),
    /// compares with the producer's payload, logs the verdict, applies the policy
    /// and only then returns. `Err` when the load did not land (bad spec, producer
    /// unreachable, ERROR, no reply): see [`LoadError::action`]. A load is never
    /// retried (KV is never fetched twice).
    /// Every load is counted in the process's metrics (`kvferry_transfer::metrics`): its
    /// verdict (or `failed` with why), its load and checksum times, a recompute.
    pub async fn load(&self, spec: LoadSpec) -> Result<LoadOutcome, LoadError> {
        let r = self.load_unmetered(spec).await;
        record_load(&r.as_ref().map(|o| Loaded {
            verdict: o.verdict.as_ref(),
            action: o.action,
            transfer_seconds: o.transfer_seconds,
            checksum_seconds: o.checksum_seconds,
        }));
        r
    }

    async fn load_unmetered(&self, spec: LoadSpec) -> Result<LoadOutcome, LoadError> {
        debug!(target: "kvferry::timing", request_id = spec.request_id, "load started");
        let t_build = Instant::now();
        let (mut request, landed) = self.build_request(&spec)?;
        let build_us = t_build.elapsed().as_micros();
        let hook = self.hook_for(&spec.request_id);
        // A hook runs between landing and verifying: such a load is written, never read.
        if hook.is_none() {
            // A shape read in one pass before: its launch is queued first, before the rest of
            // the load's host work.
            let early = self.launch_early(&spec, &request, t_build);
            let reads = match &early {
                copy::EarlyLaunch::Launched(e) => {
                    Some(read::ReadPlan::launched(e.producer.clone()))
                }
                _ => {
                    self.with_ranks(&mut request);
                    self.read_plan(&spec.producer, &request)
                }
            };
            if let Some(reads) = reads {
                match self
                    .load_by_read(&spec, request.clone(), reads, early)
                    .await
                {
                    Err(read::ReadEnd::Refused) => {} // by WRITE, below
                    Err(read::ReadEnd::Failed(e)) => return Err(e),
                    Ok(o) => return Ok(o),
                }
            }
        }
        self.with_ranks(&mut request);
        let rid = spec.request_id.clone();
        // WRITE for exactly this load's block bytes, to this load's token, until it ends.
        let (token, grants) = self.grant(&request).map_err(|e| LoadError::Spec {
            request_id: rid.clone(),
            why: LoadSpecFault::Grant(Shared(Arc::new(e))),
        })?;
        request.token = token.map(|t| t.to_string());
        let grant_us = t_build.elapsed().as_micros() - build_us;
        // Layers are verified as they land unless a hook runs between landing and verifying.
        let (progress, mut heard) = mpsc::unbounded_channel();
        let overlap = self.checksums && hook.is_none();
        let mut parts = Parts::new(
            self.workers.clone(),
            Arc::new(Selector::new(&spec)),
            if overlap {
                layer_slots(&request)
            } else {
                Vec::new()
            },
            self.config.checksum_timeout,
        )
        .with_fingerprints(self.fingerprints.clone());
        let started = Instant::now();
        // Asked last: nothing below returns before the reply, which settles it.
        // Held until the reply: a load that ends without one (failed, or dropped by its
        // caller) lets a later load ask again.
        let asked = self.ask_layout(&spec.producer);
        request.want_layout = asked.is_some();
        let send = self.send(
            &spec.producer,
            request,
            spec.load_key.clone(),
            overlap.then_some(progress),
        );
        tokio::pin!(send);
        // Progress first: the connection passes a load's progress on before its FINISH, so the
        // spans heard in one burst with the FINISH still start their checksums before it is
        // taken (each is a launch queued behind the others, never waited for in turn).
        let mut last_heard = None;
        // Time spent starting parts on this task (their jobs built and submitted).
        let mut progress_time = std::time::Duration::ZERO;
        let reply = loop {
            tokio::select! {
                biased;
                Some(p) = heard.recv() => {
                    let t = Instant::now();
                    parts.progress(p);
                    let now = Instant::now();
                    progress_time += now - t;
                    last_heard = Some(now);
                }
                r = &mut send => break r,
            }
        };
        // How long before the FINISH the last progress was taken (the head start of its part).
        let lead_us = last_heard.map_or(0, |t| t.elapsed().as_micros() as u64);
        // The transfer is over (FINISH: every WRITE was acknowledged) or failed: revoke
        // before verifying, so that nothing lands in the blocks after they are checked.
        drop(grants);
        // Progress the connection passed on before the FINISH but not taken above: its sends
        // and the answer fell between this task's polls of the two (another thread runs the
        // connection). Those layers landed before the FINISH and are taken as if heard first,
        // so that which layers a load verifies early does not depend on that race (bogus
        // progress still voids the parts; a failed load starts nothing).
        while let Ok(p) = heard.try_recv() {
            if reply.is_ok() {
                parts.progress(p);
            }
        }
        let reply = reply.map_err(|f| self.load_error(&spec, f))?;
        let transfer_seconds = started.elapsed().as_secs_f64();
        if let Some(asked) = asked {
            self.learn_layout(asked, &reply);
        }
        if let Some(hook) = hook {
            hook(&landed);
        }
        let phases = Phases {
            build_us,
            grant_us,
            lead_us,
            progress_us: progress_time.as_micros() as u64,
        };
        let path = reply.path;
        Ok(self
            .judge(&spec, &reply, parts, transfer_seconds, phases, path, false)
            .await)
    }

    /// The [`LoadError`] of a load whose reply failed (`f`).
    fn load_error(&self, spec: &LoadSpec, f: ConnFailure) -> LoadError {
        let request_id = spec.request_id.clone();
        match f {
            ConnFailure::Connect(why) => LoadError::Connect {
                request_id,
                producer: spec.producer.clone(),
                why,
            },
            ConnFailure::Failed(reason) => LoadError::Failed { request_id, reason },
        }
    }

    /// A landed load's outcome: without checksums, complete; else the layers `parts` did not
    /// checksum are, the parts added, compared with `reply`'s payload, the verdict logged and
    /// the policy applied. `read`: this consumer read the blocks itself, `path` carried them.
    #[allow(clippy::too_many_arguments)] // the load's parts, each its own
    async fn judge(
        &self,
        spec: &LoadSpec,
        reply: &Reply,
        parts: Parts,
        transfer_seconds: f64,
        phases: Phases,
        path: Option<kvferry_transfer::TransferPath>,
        read: bool,
    ) -> LoadOutcome {
        let rid = spec.request_id.clone();
        if !self.checksums {
            return LoadOutcome {
                request_id: rid,
                verdict: None,
                action: Action::Complete,
                bytes: reply.bytes_written,
                transfer_seconds,
                checksum_seconds: 0.0,
                early_layers: 0,
                path,
                read,
            };
        }
        let started = Instant::now();
        let overlapped = parts.started();
        let early_layers = parts.covered();
        let verdict = self.verify(spec, reply, parts).await;
        let checksum_seconds = started.elapsed().as_secs_f64();
        debug!(
            target: "kvferry::timing",
            request_id = rid,
            build_us = phases.build_us,
            grant_us = phases.grant_us,
            overlapped,
            lead_us = phases.lead_us,
            progress_us = phases.progress_us,
            read,
            transfer_us = (transfer_seconds * 1e6) as u64,
            verify_us = (checksum_seconds * 1e6) as u64,
            "load phases"
        );
        log_verdict(&rid, &verdict);
        let action = self.config.policy.decide(&verdict);
        if action != Action::Complete {
            warn!(
                request_id = rid,
                ?action,
                "load not completed (fail-closed)"
            );
        }
        LoadOutcome {
            request_id: rid,
            verdict: Some(verdict),
            action,
            bytes: reply.bytes_written,
            transfer_seconds,
            checksum_seconds,
            early_layers,
            path,
            read,
        }
    }

    /// Grants a fresh random token WRITE on every rank's bytes of the blocks `request` loads
    /// ([`grant_ranges`]), until the load's reply deadline ([`ConsumerConfig::reply_deadline`]);
    /// the guards revoke it when dropped. One grant per engine (ranks may share one).
    /// Returns the token for the request (`None`: no grant was made, the producer writes
    /// without one) and the guards.
    ///
    /// An engine without a secret checks no grant (open mode: any peer may write its memory,
    /// `kvferry_transfer::auth`), so none is made there: its ranges are not even listed. The
    /// token still goes with the request when such an engine holds a rank, so that the
    /// producer's FINISH proves it (`msg::finish_proof`) as before.
    fn grant(
        &self,
        request: &LoadRequest,
    ) -> Result<(Option<Token>, Vec<GrantGuard>), TransferError> {
        let t0 = Instant::now();
        let token = Token::random()?;
        // (engine, the (offset, length) ranges it grants)
        let mut per_engine: Vec<(&Arc<TransferEngine>, Vec<Range>)> = Vec::new();
        let mut open = false;
        for (w, layout) in self.workers.iter().zip(&self.layouts) {
            if !w.engine.is_authenticated() {
                open = true;
                continue;
            }
            let ranges = grant_ranges(layout, request);
            match per_engine
                .iter_mut()
                .find(|(e, _)| Arc::ptr_eq(e, &w.engine))
            {
                Some((_, r)) => r.extend(ranges),
                None => per_engine.push((&w.engine, ranges)),
            }
        }
        let ttl = self.config.reply_deadline();
        let (t_insert, ranges) = (
            Instant::now(),
            per_engine.iter().map(|(_, r)| r.len()).sum::<usize>(),
        );
        let ranges_us = t_insert.duration_since(t0).as_micros() as u64;
        let grants: Result<Vec<GrantGuard>, TransferError> = per_engine
            .into_iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(e, ranges)| {
                e.grant(GrantSpec {
                    token,
                    ops: GrantOps::WRITE,
                    ranges,
                    ttl,
                })
            })
            .collect();
        debug!(
            target: "kvferry::timing",
            request_id = request.request_id,
            ranges,
            ranges_us,
            insert_us = t_insert.elapsed().as_micros() as u64,
            "grant phases"
        );
        let grants = grants?;
        Ok(((open || !grants.is_empty()).then_some(token), grants))
    }

    /// The request of `spec` less its ranks' layers ([`Consumer::with_ranks`] adds them).
    fn build_request(&self, spec: &LoadSpec) -> Result<(LoadRequest, Landed), LoadError> {
        build_blocks(&self.layouts, self.tp, self.pp, spec).map_err(|e| LoadError::Spec {
            request_id: spec.request_id.clone(),
            why: LoadSpecFault::Spec(e),
        })
    }

    /// Adds this side's layers to `request` where it has none yet: what a request the producer
    /// writes, or a read plan, needs (a one-pass launch needs only the blocks).
    fn with_ranks(&self, request: &mut LoadRequest) {
        if request.ranks.is_empty() {
            request.ranks = wire_ranks(&self.layouts, request);
        }
    }

    async fn send(
        &self,
        producer: &str,
        request: LoadRequest,
        load_key: Option<String>,
        progress: Option<mpsc::UnboundedSender<LoadProgress>>,
    ) -> Result<Reply, ConnFailure> {
        // Both attempts end by one deadline: a load never waits past its reply deadline.
        let until = Instant::now() + self.config.reply_deadline();
        let r = self
            .send_once(
                producer,
                request.clone(),
                load_key.clone(),
                until,
                progress.clone(),
            )
            .await;
        match r {
            // Refused before anything was served (the producer evicted our session): the
            // connection says hello again, and the load goes once more on the new session.
            Err(ConnFailure::Failed(FailReason::NoSession(why))) => {
                debug!(
                    producer,
                    "session evicted by the producer ({why}); sending again"
                );
                self.send_once(producer, request, load_key, until, progress)
                    .await
            }
            r => r,
        }
    }

    async fn send_once(
        &self,
        producer: &str,
        request: LoadRequest,
        load_key: Option<String>,
        until: Instant,
        progress: Option<mpsc::UnboundedSender<LoadProgress>>,
    ) -> Result<Reply, ConnFailure> {
        let (respond, answer) = oneshot::channel();
        self.dispatch(
            producer,
            ConnCmd::Load(Box::new(LoadCmd {
                request,
                load_key,
                respond,
                progress,
            })),
        )
        .await;
        // The connection enforces the load's deadlines; this one guards against its task's loss.
        match tokio::time::timeout_at(until.into(), answer).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ConnFailure::Failed(FailReason::ConnectionLost(
                LinkError::TaskEnded,
            ))),
            Err(_) => Err(ConnFailure::Failed(FailReason::Overall(
                self.config.reply_deadline(),
            ))),
        }
    }

    /// Hands `cmd` to `producer`'s connection task, starting one (again) where there is none
    /// or it ended. A command no task took is dropped: its answer channel then says so.
    async fn dispatch(&self, producer: &str, mut cmd: ConnCmd) {
        let mut conns = self.conns.lock().await;
        for _ in 0..2 {
            let tx = conns.entry(producer.to_string()).or_insert_with(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                let conn = Connection::new(
                    producer.to_string(),
                    &self.config,
                    self.secret.clone(),
                    self.name.clone(),
                );
                tokio::spawn(conn.run(rx));
                tx
            });
            match tx.send(cmd) {
                Ok(()) => break,
                Err(mpsc::error::SendError(c)) => {
                    // The connection task is gone; start a fresh one.
                    cmd = c;
                    conns.remove(producer);
                }
            }
        }
    }

    /// Opens the control connection and the session to `producer` (`tcp://HOST:PORT`) now,
    /// as the first load to it would, so that no load pays the connect and the hello. Waits
    /// at most twice the connect timeout (the connect, then the hello). Errors: why it could
    /// not connect ([`ConnectFailure`]); a later load then tries again, as without this call.
    pub async fn connect(&self, producer: &str) -> Result<(), ConnectFailure> {
        let (respond, answer) = oneshot::channel();
        self.dispatch(producer, ConnCmd::Connect(respond)).await;
        let limit = self.config.connect_timeout.saturating_mul(2);
        match tokio::time::timeout(limit, answer).await {
            Ok(Ok(r)) => r,
            // The task ended without answering: no session was made.
            Ok(Err(_)) => Err(ConnectFailure::NoSession),
            Err(_) => Err(ConnectFailure::Timeout(limit)),
        }
    }

    /// Checksums the layers `parts` did not (all of them when none landed early), adds the
    /// parts, and compares with `reply`'s payload.
    async fn verify(&self, spec: &LoadSpec, reply: &Reply, parts: Parts) -> Verdict {
        let nt = spec.num_tokens;
        let selector = Selector::new(spec);
        let select = |g: &WorkerGroup| selector.select(g);
        let t_records = Instant::now();
        let finished = parts.finish().await;
        let records_us = t_records.elapsed().as_micros() as u64;
        let (records, missing) = (finished.records, finished.missing);
        if !missing.is_empty() {
            warn!(
                request_id = spec.request_id,
                "not every worker reported: {}",
                missing.join("; ")
            );
            return Verdict::Unverified(vec![(None, UnverifiedReason::NotEveryWorkerReported)]);
        }
        let t_sums = Instant::now();
        let mut sums = match consumer_sums(&records, self.tp, self.pp, nt) {
            Ok(s) => s,
            Err(reason) => return Verdict::Unverified(vec![(None, reason)]),
        };
        for g in &self.workers[0].groups {
            if g.skipped.is_some() {
                continue;
            }
            if let Some(sel) = select(g).filter(|s| !s.block_ids.is_empty()) {
                sums.expect_blocks(g.group_id, &sel);
            }
        }
        let sums_us = t_sums.elapsed().as_micros() as u64;
        let verdict = match reply.checksums.as_deref().map(Payload::from_bytes) {
            None => compare(Ok(None), &sums),
            Some(Ok(p)) => compare(Ok(Some(&p)), &sums),
            Some(Err(e)) => compare(Err(&e), &sums),
        };
        // The checksums (submit, kernels, results back) against the host work after them: the
        // ranks' sums, then decoding the payload and comparing.
        debug!(
            target: "kvferry::timing",
            request_id = spec.request_id,
            records_us,
            parts_done = finished.parts_done,
            parts_us = finished.parts_us,
            rest_us = finished.rest_us,
            rest_layers = finished.rest_layers,
            sums_us,
            compare_us = (t_sums.elapsed().as_micros() as u64).saturating_sub(sums_us),
            "verify phases"
        );
        verdict
    }
}

/// Host times of a load's first phases, for its timing line (µs).
#[derive(Debug, Clone, Copy, Default)]
struct Phases {
    build_us: u128,
    grant_us: u128,
    lead_us: u64,
    progress_us: u64,
}

#[path = "consumer_copy.rs"]
mod copy;
#[path = "consumer_copy_plan.rs"]
mod copy_plan;
#[path = "consumer_layout.rs"]
mod layout;
#[path = "consumer_read.rs"]
mod read;

#[cfg(test)]
#[path = "consumer_grant_tests.rs"]
mod grant_tests;
