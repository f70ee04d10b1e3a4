//! The consumer (docs/design.md §4): one DEALER per producer (rebuilt after a failure:
//! the `zeromq` crate's DEALER does not reconnect by itself), the load state
//! machine of [`crate::proto::consumer`], and verification of every landed load
//! (§2.5–§2.7) before it is reported.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use kvferry_checksum::payload::Payload;
use kvferry_checksum::policy::Action;
use kvferry_checksum::record::consumer_sums;
use kvferry_checksum::select::consumer_blocks;
use kvferry_checksum::verdict::{compare, log_verdict, UnverifiedReason, Verdict};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, warn};
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use crate::checksum::all_records;
use crate::error::{LoadError, P2pError};
use crate::proto::consumer::{ConsumerEvent, ConsumerMachine, FailReason, SessionError};
use crate::proto::layout::RankLayout;
use crate::proto::msg::{LoadRequest, Reply};
use crate::proto::request::{build_request, grant_ranges};
pub use crate::proto::request::{Landed, LandedGroup, LoadGroup, LoadSpec};
use crate::shell::consumer_config::carrier_check;
pub use crate::shell::consumer_config::{ConsumerConfig, LoadOutcome};
use crate::shell::load_metrics::{record_load, Loaded};
use crate::shell::sleep_until;
use crate::worker::{validate, Worker, WorkerGroup};
use kvferry_transfer::sync::RwLockExt;
use kvferry_transfer::{
    GrantGuard, GrantOps, GrantSpec, Secret, Token, TransferEngine, TransferError,
};

/// Called after a load's transfer finished and before its verification (fault
/// injection: the demo flips bits here). Runs on the loading task; keep it short.
pub type LandedHook = Arc<dyn Fn(&Landed) + Send + Sync>;

/// Why the DEALER could not connect.
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("connect did not finish within {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Zmq(zeromq::ZmqError),
    #[error(transparent)]
    Session(SessionError),
}

enum ConnFailure {
    Connect(String),
    Failed(FailReason),
}

struct LoadCmd {
    request: LoadRequest,
    /// The lease's load key: proved in the session, never sent.
    load_key: Option<String>,
    respond: oneshot::Sender<Result<Reply, ConnFailure>>,
}

/// A consumer: TP×PP workers and a DEALER per producer.
pub struct Consumer {
    config: ConsumerConfig,
    checksums: bool,
    workers: Arc<Vec<Worker>>,
    /// The workers as the request builder sees them (same order).
    layouts: Vec<RankLayout>,
    tp: u32,
    pp: u32,
    conns: tokio::sync::Mutex<HashMap<String, mpsc::UnboundedSender<LoadCmd>>>,
    hook: RwLock<Option<LandedHook>>,
    /// The workers' shared secret: producers must prove it before any request goes to them.
    secret: Option<Secret>,
    /// This consumer's name in sessions: its first rank's segment.
    name: String,
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
        let name = workers
            .first()
            .map(|w| w.engine.segment_name())
            .unwrap_or_default();
        Ok(Consumer {
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
        })
    }

    /// Whether loads are verified (checksums enabled and a carrier present).
    pub fn checksums_enabled(&self) -> bool {
        self.checksums
    }

    /// Installs (or with `None` removes) the hook run after each transfer and before verification.
    pub fn set_landed_hook(&self, hook: Option<LandedHook>) {
        *self.hook.write_locked() = hook;
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
        let t_build = Instant::now();
        let (mut request, landed) = self.build_request(&spec)?;
        let build_us = t_build.elapsed().as_micros();
        let rid = spec.request_id.clone();
        // WRITE for exactly this load's block bytes, to this load's token, until it ends.
        let grants = self.grant(&request).map_err(|e| LoadError::Spec {
            request_id: rid.clone(),
            why: format!("granting the load's blocks: {e}"),
        })?;
        request.token = grants.first().map(|g| g.token().to_string());
        let grant_us = t_build.elapsed().as_micros() - build_us;
        let started = Instant::now();
        let reply = self
            .send(&spec.producer, request, spec.load_key.clone())
            .await;
        // The transfer is over (FINISH: every WRITE was acknowledged) or failed: revoke
        // before verifying, so that nothing lands in the blocks after they are checked.
        drop(grants);
        let reply = reply.map_err(|f| match f {
            ConnFailure::Connect(why) => LoadError::Connect {
                request_id: rid.clone(),
                producer: spec.producer.clone(),
                why,
            },
            ConnFailure::Failed(reason) => LoadError::Failed {
                request_id: rid.clone(),
                reason,
            },
        })?;
        let transfer_seconds = started.elapsed().as_secs_f64();
        let hook = self.hook.read_locked().clone();
        if let Some(hook) = hook {
            hook(&landed);
        }
        if !self.checksums {
            return Ok(LoadOutcome {
                request_id: rid,
                verdict: None,
                action: Action::Complete,
                bytes: reply.bytes_written,
                transfer_seconds,
                checksum_seconds: 0.0,
            });
        }
        let started = Instant::now();
        let verdict = self.verify(&spec, &reply).await;
        let checksum_seconds = started.elapsed().as_secs_f64();
        debug!(
            target: "kvferry::timing",
            request_id = rid,
            build_us,
            grant_us,
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
        Ok(LoadOutcome {
            request_id: rid,
            verdict: Some(verdict),
            action,
            bytes: reply.bytes_written,
            transfer_seconds,
            checksum_seconds,
        })
    }

    /// Grants a fresh random token WRITE on every rank's bytes of the blocks `request` loads
    /// ([`grant_ranges`]), until the load's reply deadline ([`ConsumerConfig::reply_deadline`]);
    /// the guards revoke it when dropped.
    /// One grant per engine (ranks may share one).
    fn grant(&self, request: &LoadRequest) -> Result<Vec<GrantGuard>, TransferError> {
        let token = Token::random()?;
        // (engine, the (offset, length) ranges it grants)
        let mut per_engine: Vec<(&Arc<TransferEngine>, Vec<Range>)> = Vec::new();
        for (w, layout) in self.workers.iter().zip(&self.layouts) {
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
        per_engine
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
            .collect()
    }

    fn build_request(&self, spec: &LoadSpec) -> Result<(LoadRequest, Landed), LoadError> {
        build_request(&self.layouts, self.tp, self.pp, spec).map_err(|e| LoadError::Spec {
            request_id: spec.request_id.clone(),
            why: e.to_string(),
        })
    }

    async fn send(
        &self,
        producer: &str,
        request: LoadRequest,
        load_key: Option<String>,
    ) -> Result<Reply, ConnFailure> {
        // Both attempts end by one deadline: a load never waits past its reply deadline.
        let until = Instant::now() + self.config.reply_deadline();
        let r = self
            .send_once(producer, request.clone(), load_key.clone(), until)
            .await;
        match r {
            // Refused before anything was served (the producer evicted our session): the
            // connection says hello again, and the load goes once more on the new session.
            Err(ConnFailure::Failed(FailReason::NoSession(why))) => {
                debug!(
                    producer,
                    "session evicted by the producer ({why}); sending again"
                );
                self.send_once(producer, request, load_key, until).await
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
    ) -> Result<Reply, ConnFailure> {
        let (respond, answer) = oneshot::channel();
        let mut cmd = LoadCmd {
            request,
            load_key,
            respond,
        };
        {
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
        // The connection enforces the load's deadlines; this one guards against its task's loss.
        match tokio::time::timeout_at(until.into(), answer).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ConnFailure::Failed(FailReason::ConnectionLost(
                "connection task ended".into(),
            ))),
            Err(_) => Err(ConnFailure::Failed(FailReason::Overall(
                self.config.reply_deadline(),
            ))),
        }
    }

    async fn verify(&self, spec: &LoadSpec, reply: &Reply) -> Verdict {
        let tables: HashMap<u32, &LoadGroup> =
            spec.groups.iter().map(|g| (g.group_id, g)).collect();
        let (lc, nt) = (spec.num_local_computed, spec.num_tokens);
        let select = |g: &WorkerGroup| {
            let t = tables.get(&g.group_id)?;
            consumer_blocks(&t.local_blocks, lc, nt, g.block_size, g.sliding_window)
        };
        let (records, missing) = all_records(
            &self.workers,
            &select,
            nt,
            self.config.checksum_timeout,
            None,
        )
        .await;
        if !missing.is_empty() {
            warn!(
                request_id = spec.request_id,
                "not every worker reported: {}",
                missing.join("; ")
            );
            return Verdict::Unverified(vec![(None, UnverifiedReason::NotEveryWorkerReported)]);
        }
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
        match reply.checksums.as_deref().map(Payload::from_bytes) {
            None => compare(Ok(None), &sums),
            Some(Ok(p)) => compare(Ok(Some(&p)), &sums),
            Some(Err(e)) => compare(Err(&e), &sums),
        }
    }
}

enum SockEvent {
    Message(Bytes),
    Lost(String),
}

/// A connected DEALER; dropping it closes the socket (its reader is aborted).
struct Sock {
    send: zeromq::DealerSendHalf,
    reader: JoinHandle<()>,
}

impl Drop for Sock {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

struct Connection {
    endpoint: String,
    /// This consumer's name in sessions.
    name: String,
    machine: ConsumerMachine,
    connect_timeout: Duration,
    send_timeout: Duration,
    max_message_bytes: usize,
    sock: Option<Sock>,
    generation: u64,
    waiters: HashMap<u64, oneshot::Sender<Result<Reply, ConnFailure>>>,
}

/// A connection's first load id: random, so that the ids of a rebuilt or restarted consumer do
/// not collide with earlier ones; below 2^52, so that they stay exact where a peer reads JSON
/// numbers as doubles and never wrap.
fn seed() -> u64 {
    kvferry_transfer::ids::random_u64() & 0x000f_ffff_ffff_ffff
}

impl Connection {
    fn new(
        endpoint: String,
        c: &ConsumerConfig,
        secret: Option<Secret>,
        name: String,
    ) -> Connection {
        Connection {
            endpoint,
            name,
            machine: ConsumerMachine::new(c.reply_timeout, c.max_wait, seed())
                .with_retry_interval(c.reconnect_interval)
                .with_secret(secret),
            connect_timeout: c.connect_timeout,
            send_timeout: c.send_timeout,
            max_message_bytes: c.max_message_bytes,
            sock: None,
            generation: 0,
            waiters: HashMap::new(),
        }
    }

    async fn connect(
        &mut self,
        events: &mpsc::UnboundedSender<(u64, SockEvent)>,
    ) -> Result<(), ConnectError> {
        let mut options = SocketOptions::default();
        options.connect_timeout(self.connect_timeout);
        options.max_message_size(self.max_message_bytes);
        let mut socket = zeromq::DealerSocket::with_options(options);
        let mut monitor = socket.monitor();
        match tokio::time::timeout(self.connect_timeout, socket.connect(&self.endpoint)).await {
            Err(_) => return Err(ConnectError::Timeout(self.connect_timeout)),
            Ok(Err(e)) => return Err(ConnectError::Zmq(e)),
            Ok(Ok(())) => {}
        }
        // The session first: with a secret, nothing else goes out before the producer proved it.
        let nonce = kvferry_transfer::auth::random_bytes::<32>()
            .map_err(|e| ConnectError::Session(SessionError::Refused(e.to_string())))?;
        let hello = self.machine.hello(nonce, &self.endpoint, &self.name);
        let welcome = tokio::time::timeout(self.connect_timeout, async {
            socket.send(ZmqMessage::from(hello)).await?;
            socket.recv().await
        })
        .await
        .map_err(|_| ConnectError::Timeout(self.connect_timeout))?
        .map_err(ConnectError::Zmq)?;
        let body = welcome.into_vec().pop().unwrap_or_default();
        self.machine
            .handle_welcome(&body)
            .map_err(ConnectError::Session)?;
        self.generation += 1;
        let generation = self.generation;
        let (send, mut recv) = socket.split();
        let events = events.clone();
        let reader = tokio::spawn(async move {
            loop {
                tokio::select! {
                    m = recv.recv() => match m {
                        Ok(m) => {
                            if let Some(body) = m.into_vec().pop() {
                                let _ = events.send((generation, SockEvent::Message(body)));
                            }
                        }
                        Err(e) => {
                            let _ = events.send((generation, SockEvent::Lost(e.to_string())));
                            break;
                        }
                    },
                    ev = monitor.next() => match ev {
                        Some(SocketEvent::Disconnected(_)) | None => {
                            let _ = events.send((generation, SockEvent::Lost("producer disconnected".into())));
                            break;
                        }
                        Some(_) => {}
                    },
                }
            }
        });
        self.sock = Some(Sock { send, reader });
        debug!(endpoint = self.endpoint, generation, "DEALER connected");
        Ok(())
    }

    /// A new load: connects unless connected (or the producer is down), then starts it on the
    /// machine; a load that cannot start is answered at once.
    async fn start(&mut self, cmd: LoadCmd, events: &mpsc::UnboundedSender<(u64, SockEvent)>) {
        let LoadCmd {
            request,
            load_key,
            respond,
        } = cmd;
        let started = self.open(events).await.and_then(|()| {
            self.machine
                .start(Instant::now(), request, load_key.as_deref())
                .ok_or_else(|| ConnFailure::Connect("no session with the producer".into()))
        });
        match started {
            Ok(load_id) => {
                self.waiters.insert(load_id, respond);
            }
            Err(e) => {
                let _ = respond.send(Err(e));
            }
        }
    }

    /// Connects the socket unless it is open.
    async fn open(
        &mut self,
        events: &mpsc::UnboundedSender<(u64, SockEvent)>,
    ) -> Result<(), ConnFailure> {
        if self.sock.is_some() {
            return Ok(());
        }
        self.machine
            .admit(Instant::now())
            .map_err(|why| ConnFailure::Connect(why.to_string()))?;
        if let Err(e) = self.connect(events).await {
            warn!(endpoint = self.endpoint, "cannot reach the producer: {e}");
            let e = e.to_string();
            self.machine.handle_connect_failed(Instant::now(), &e);
            return Err(ConnFailure::Connect(e));
        }
        self.machine.handle_connected();
        Ok(())
    }

    /// Carries out the machine's outputs: sends its requests, answers the loads that ended,
    /// rebuilds the socket when it says so.
    async fn drain(&mut self) {
        loop {
            if let Some(t) = self.machine.poll_transmit() {
                let why = match self.sock.as_mut() {
                    None => Some("no socket".to_string()),
                    Some(sock) => {
                        let send = sock.send.send(ZmqMessage::from(t.bytes));
                        match tokio::time::timeout(self.send_timeout, send).await {
                            Ok(Ok(())) => None,
                            Ok(Err(e)) => Some(e.to_string()),
                            Err(_) => Some(format!(
                                "send did not finish within {:?}",
                                self.send_timeout
                            )),
                        }
                    }
                };
                if let Some(why) = why {
                    self.machine.handle_send_failed(t.load_id, &why);
                }
                continue;
            }
            let Some(event) = self.machine.poll_event() else {
                return;
            };
            match event {
                ConsumerEvent::Finished { load_id, reply } => self.answer(load_id, Ok(reply)),
                ConsumerEvent::Failed { load_id, reason } => {
                    if matches!(reason, FailReason::NoReply(_) | FailReason::Overall(_)) {
                        warn!(endpoint = self.endpoint, load_id, "load failed: {reason}");
                    }
                    self.answer(load_id, Err(ConnFailure::Failed(reason)))
                }
                ConsumerEvent::Progress { load_id } => debug!(load_id, "producer: CONTINUE"),
                ConsumerEvent::Stale { load_id } => {
                    warn!(load_id, "late reply for a load that already ended; ignored")
                }
                ConsumerEvent::Invalid(e) => {
                    warn!(endpoint = self.endpoint, "bad reply ignored: {e}")
                }
                ConsumerEvent::RebuildSocket => {
                    if self.sock.take().is_some() {
                        debug!(
                            endpoint = self.endpoint,
                            "rebuilding the DEALER after a failure"
                        );
                    }
                }
            }
        }
    }

    fn answer(&mut self, load_id: u64, result: Result<Reply, ConnFailure>) {
        if let Some(w) = self.waiters.remove(&load_id) {
            let _ = w.send(result);
        }
    }

    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<LoadCmd>) {
        let (ev_tx, mut events) = mpsc::unbounded_channel::<(u64, SockEvent)>();
        loop {
            tokio::select! {
                cmd = commands.recv() => {
                    let Some(cmd) = cmd else { break };
                    self.start(cmd, &ev_tx).await;
                }
                ev = events.recv() => {
                    let Some((generation, ev)) = ev else { break };
                    if generation != self.generation {
                        continue; // from a socket already replaced
                    }
                    match ev {
                        SockEvent::Message(body) => self.machine.handle_message(Instant::now(), &body),
                        SockEvent::Lost(why) => {
                            if self.machine.pending() > 0 {
                                warn!(endpoint = self.endpoint, "control connection lost: {why}");
                            } else {
                                debug!(endpoint = self.endpoint, "control connection closed while idle: {why}");
                            }
                            self.machine.handle_connection_lost(&why);
                        }
                    }
                }
                _ = sleep_until(self.machine.poll_timeout()) => self.machine.handle_timeout(Instant::now()),
            }
            self.drain().await;
        }
    }
}
