//! The producer (docs/design.md §4): a ZeroMQ ROUTER serving transfer requests, the
//! lease state machine of [`crate::proto::producer`], and the publish path that
//! checksums a request's blocks when its KV is complete.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use kvferry_checksum::record::producer_payload;
use kvferry_checksum::select::producer_blocks;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::checksum::{all_records, CallerStream};
use crate::error::P2pError;
use crate::proto::layout::RankLayout;
use crate::proto::msg::encode;
use crate::proto::producer::{Effect, ProducerMachine, PublishError, ReleaseReason, Warning};
use crate::proto::serve::{plan, Published};
use crate::proto::serve_error::ServeFailure;
use crate::proto::sessions::os_nonces;
use crate::proto::spec_checks::check_tables;
use crate::shell::gate::{warn_limited, ControlGate, Gate, PeerWarnings};
use crate::shell::producer_config::{
    workers_secret, ProducerConfig, PublishInfo, Released, MAX_LOAD_KEY_BYTES,
};
use crate::shell::serve::write_all;
use crate::shell::sleep_until;
use crate::worker::{validate, Worker};
use kvferry_kernels::Location;
use kvferry_transfer::auth::LogLimit;
use kvferry_transfer::sync::MutexExt;
use kvferry_transfer::Token;

enum Event {
    Message(zeromq::ZmqResult<ZmqMessage>),
    Command(Option<Command>),
    Peer(Option<SocketEvent>),
    Tick,
}

enum Command {
    Publish {
        request_id: String,
        data: Published,
        key: String,
        respond: oneshot::Sender<Result<(), PublishError>>,
    },
    Served {
        peer: Bytes,
        request_id: String,
        load_id: u64,
        result: Result<(u64, Option<Vec<u8>>), ServeFailure>,
    },
    LoadKey {
        request_id: String,
        respond: oneshot::Sender<Option<String>>,
    },
    Shutdown,
}

/// A running producer: one ROUTER, one event loop task, TP×PP workers.
pub struct Producer {
    endpoint: String,
    commands: mpsc::UnboundedSender<Command>,
    released: Arc<Mutex<Vec<Released>>>,
    workers: Arc<Vec<Worker>>,
    /// The workers as the protocol sees them (same order).
    layouts: Arc<Vec<RankLayout>>,
    tp: u32,
    pp: u32,
    config: ProducerConfig,
    /// The event loop, until [`Producer::shutdown`] takes it.
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Producer {
    /// Validates the workers (one TP×PP grid, agreeing groups), binds the ROUTER
    /// and starts the event loop. Must be called inside a tokio runtime.
    /// Errors: [`P2pError::Workers`], [`P2pError::Bind`].
    pub async fn start(config: ProducerConfig, workers: Vec<Worker>) -> Result<Producer, P2pError> {
        let (tp, pp, workers) = validate(workers)?;
        let secret = workers_secret(&workers)?;
        let mut options = zeromq::SocketOptions::default();
        options.max_message_size(config.max_message_bytes);
        // The control port is as bounded as the engine's listeners (docs/design.md §8.1).
        options
            .accept_gate(Arc::new(Gate(ControlGate::new(
                config.max_connections,
                config.max_connections_per_source,
            ))))
            .handshake_timeout(config.handshake_timeout)
            .frame_timeout(config.frame_timeout)
            .receive_budget(zeromq::ReceiveBudget::new(config.receive_budget_bytes));
        let mut socket = zeromq::RouterSocket::with_options(options);
        // Peers refused during the ZMTP handshake (e.g. an oversized command) are reported here.
        let monitor = Some(socket.monitor());
        let bind_err = |why: String| P2pError::Bind {
            endpoint: config.bind.clone(),
            why,
        };
        let endpoint = tokio::time::timeout(Duration::from_secs(10), socket.bind(&config.bind))
            .await
            .map_err(|_| bind_err("timed out".into()))?
            .map_err(|e| bind_err(e.to_string()))?
            .to_string();
        let (tx, rx) = mpsc::unbounded_channel();
        let released = Arc::new(Mutex::new(Vec::new()));
        let workers = Arc::new(workers);
        let layouts: Arc<Vec<RankLayout>> = Arc::new(workers.iter().map(Worker::layout).collect());
        let task = tokio::spawn(
            EventLoop {
                machine: ProducerMachine::new(config.timeouts, config.transfer_timeout)
                    .with_control(secret, &endpoint, &config.bind, os_nonces())
                    .with_max_sessions(config.max_sessions),
                socket,
                monitor,
                commands: tx.downgrade(),
                released: released.clone(),
                workers: workers.clone(),
                layouts: layouts.clone(),
                send_timeout: config.send_timeout,
                refusals: LogLimit::new(5, Duration::from_secs(10)),
                peer_warnings: PeerWarnings::new(),
            }
            .run(rx),
        );
        info!(%endpoint, tp, pp, "producer listening");
        Ok(Producer {
            endpoint,
            commands: tx,
            released,
            workers,
            layouts,
            tp,
            pp,
            config,
            task: Mutex::new(Some(task)),
        })
    }

    /// The bound control endpoint, e.g. `tcp://127.0.0.1:40123`: what consumers connect to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// A prompt's KV is complete: checksums its blocks now (every rank, tokens
    /// `[0, num_tokens)`, §2.5), then holds them under a lease until a consumer
    /// loads them or the lease expires. `blocks[g]` is group `g`'s block table
    /// (position → block id, `None` = null block); every group id of the workers
    /// must have an entry. A rank that fails to checksum makes the producer send
    /// no checksums for this request (a warning, in [`PublishInfo::warning`]).
    /// The lease gets a fresh random load key (in [`PublishInfo::load_key`]): only a load
    /// carrying it is served (request ownership).
    /// Errors: a missing group entry, a duplicate request id, a stopped producer.
    pub async fn publish(
        &self,
        request_id: &str,
        blocks: Vec<Vec<Option<u64>>>,
        num_tokens: u64,
    ) -> Result<PublishInfo, P2pError> {
        let key = kvferry_transfer::Token::random().map_err(|e| P2pError::Publish {
            request_id: request_id.to_string(),
            why: e.to_string(),
        })?;
        self.publish_with_key(request_id, blocks, num_tokens, &key.to_string())
            .await
    }

    /// As [`Producer::publish`], with the embedder's load key (1..=[`MAX_LOAD_KEY_BYTES`]
    /// bytes; e.g. from the proxy, or [`derive_load_key`](crate::derive_load_key)). Keep it
    /// unguessable: whoever holds it may load the request.
    pub async fn publish_with_key(
        &self,
        request_id: &str,
        blocks: Vec<Vec<Option<u64>>>,
        num_tokens: u64,
        load_key: &str,
    ) -> Result<PublishInfo, P2pError> {
        self.publish_inner(request_id, blocks, num_tokens, load_key, None)
            .await
    }

    /// As [`Producer::publish_with_key`] for KV still being written on `stream` (a raw
    /// `CUstream` of the workers' device, e.g. the forward's; 0: the legacy default stream),
    /// without synchronising it: an event is recorded on it, the checksums run after it, and
    /// every rank's engine orders its later copies of that device's memory after it (the CUDA
    /// IPC copy stream waits for the event on the device; paths that read device memory from
    /// the host wait for it on the host before their next such read, within the transfer
    /// timeout). Workers on host memory ignore it. Errors: as `publish_with_key`, and a
    /// driver failure recording or waiting for the event.
    ///
    /// # Safety
    /// `stream` is 0 or a live stream of every CUDA worker's device.
    pub async unsafe fn publish_after_stream(
        &self,
        request_id: &str,
        blocks: Vec<Vec<Option<u64>>>,
        num_tokens: u64,
        load_key: &str,
        stream: u64,
    ) -> Result<PublishInfo, P2pError> {
        // SAFETY: this function's contract.
        let after = unsafe { CallerStream::new(stream) };
        self.publish_inner(request_id, blocks, num_tokens, load_key, Some(after))
            .await
    }

    async fn publish_inner(
        &self,
        request_id: &str,
        blocks: Vec<Vec<Option<u64>>>,
        num_tokens: u64,
        load_key: &str,
        after: Option<CallerStream>,
    ) -> Result<PublishInfo, P2pError> {
        let perr = |why: String| P2pError::Publish {
            request_id: request_id.to_string(),
            why,
        };
        if load_key.is_empty() || load_key.len() > MAX_LOAD_KEY_BYTES {
            return Err(perr(format!(
                "load key of {} bytes (1..={MAX_LOAD_KEY_BYTES})",
                load_key.len()
            )));
        }
        for g in &self.workers[0].groups {
            if blocks.len() <= g.group_id as usize {
                return Err(perr(format!("no block table for group {}", g.group_id)));
            }
        }
        // Before anything is checksummed or held: each table covers the tokens exactly and
        // names blocks inside the cache (a lease over tokens no block holds would verify).
        check_tables(
            &self.layouts,
            self.workers[0]
                .groups
                .iter()
                .map(|g| (g.group_id, blocks[g.group_id as usize].as_slice())),
            num_tokens,
        )
        .map_err(|e| perr(e.to_string()))?;
        if let Some(stream) = after {
            // Before the lease exists, so no copy of these blocks can start unordered.
            for w in self.workers.iter() {
                let Location::Cuda(device) = w.device else {
                    continue;
                };
                let (engine, deadline) = (w.engine.clone(), self.config.transfer_timeout);
                // Off the event loop's thread: the first call makes the device's copy stream.
                let ordered = tokio::task::spawn_blocking(move || {
                    // SAFETY: a CallerStream is 0 or a live stream of this device.
                    unsafe { engine.order_after(device, stream.raw(), deadline) }
                })
                .await
                .map_err(|e| perr(format!("ordering after the caller's stream: {e}")))?;
                ordered.map_err(|e| perr(format!("ordering after the caller's stream: {e}")))?;
            }
        }
        let started = Instant::now();
        let mut info = PublishInfo {
            checksummed: false,
            checksum_seconds: 0.0,
            warning: None,
            payload_bytes: 0,
            load_key: load_key.to_string(),
        };
        let mut payload = None;
        if self.config.checksums {
            let select = |g: &crate::worker::WorkerGroup| {
                producer_blocks(
                    &blocks[g.group_id as usize],
                    num_tokens,
                    g.block_size,
                    g.sliding_window,
                )
            };
            let (records, missing) = all_records(
                &self.workers,
                &select,
                num_tokens,
                self.config.checksum_timeout,
                after,
            )
            .await;
            if !missing.is_empty() {
                info.warning = Some(format!(
                    "not every worker reported, sending no checksums: {}",
                    missing.join("; ")
                ));
            } else {
                match producer_payload(&records, self.tp, self.pp, num_tokens) {
                    Ok(p) => {
                        let bytes = p.to_bytes();
                        info.payload_bytes = bytes.len();
                        info.checksummed = true;
                        payload = Some(bytes);
                    }
                    Err(e) => info.warning = Some(format!("sending no checksums: {e}")),
                }
            }
            info.checksum_seconds = started.elapsed().as_secs_f64();
            if let Some(w) = &info.warning {
                warn!(request_id, "{w}");
            }
        }
        let (respond, answer) = oneshot::channel();
        let data = Published {
            blocks,
            num_tokens,
            payload,
        };
        self.commands
            .send(Command::Publish {
                request_id: request_id.to_string(),
                data,
                key: load_key.to_string(),
                respond,
            })
            .map_err(|_| P2pError::Closed)?;
        match tokio::time::timeout(Duration::from_secs(10), answer).await {
            Ok(Ok(Ok(()))) => Ok(info),
            Ok(Ok(Err(why))) => Err(perr(why.to_string())),
            _ => Err(P2pError::Closed),
        }
    }

    /// The load key of `request_id`'s lease while it is held or being served (`None` once
    /// released, never published, or the producer stopped), as the lease machine holds it.
    pub async fn load_key(&self, request_id: &str) -> Option<String> {
        let (respond, answer) = oneshot::channel();
        let ask = Command::LoadKey {
            request_id: request_id.to_string(),
            respond,
        };
        self.commands.send(ask).ok()?;
        tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .ok()?
            .ok()?
    }

    /// Takes the leases released since the last call (served, failed, expired):
    /// their blocks may be reused by the embedder.
    pub fn released(&self) -> Vec<Released> {
        std::mem::take(&mut *self.released.locked())
    }

    /// Stops the event loop and closes the ROUTER (loads in flight get no reply), within 5 s
    /// (past it the loop is aborted). Later calls return at once; publishes still running
    /// fail with [`P2pError::Closed`], as every call after it does. The workers stay with the
    /// producer until it is dropped.
    pub async fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let Some(mut task) = self.task.locked().take() else {
            return;
        };
        if tokio::time::timeout(Duration::from_secs(5), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }
}

struct EventLoop {
    machine: ProducerMachine<Bytes, Published>,
    socket: zeromq::RouterSocket,
    monitor: Option<futures::channel::mpsc::Receiver<SocketEvent>>,
    /// Weak, so that dropping the [`Producer`] ends the loop (serve tasks hold it strongly).
    commands: mpsc::WeakUnboundedSender<Command>,
    released: Arc<Mutex<Vec<Released>>>,
    workers: Arc<Vec<Worker>>,
    /// The workers as the planner sees them (same order).
    layouts: Arc<Vec<RankLayout>>,
    send_timeout: Duration,
    /// Rate limit of the WARN lines for refused hellos and requests.
    refusals: LogLimit,
    /// Warnings a consumer (or anyone reaching the port) can trigger, at most one a second each.
    peer_warnings: PeerWarnings,
}

impl EventLoop {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        loop {
            // The socket's recv is cancel-safe (a message is taken only when returned),
            // so one task can both receive and, after the select, send.
            let event = tokio::select! {
                m = self.socket.recv() => Event::Message(m),
                c = commands.recv() => Event::Command(c),
                ev = async {
                    match self.monitor.as_mut() {
                        Some(m) => m.next().await,
                        None => std::future::pending().await,
                    }
                } => Event::Peer(ev),
                _ = sleep_until(self.machine.poll_timeout()) => Event::Tick,
            };
            match event {
                Event::Message(Ok(m)) => self.on_message(m),
                Event::Message(Err(e)) => {
                    warn!("producer control socket failed: {e}");
                    break;
                }
                Event::Peer(Some(SocketEvent::AcceptFailed(e))) => {
                    warn_limited!(self.peer_warnings.accept, "control connection failed: {e}");
                }
                Event::Peer(Some(SocketEvent::Disconnected(peer))) => {
                    self.machine.handle_disconnected(&Bytes::from(peer));
                }
                Event::Peer(Some(_)) => {}
                Event::Peer(None) => self.monitor = None,
                Event::Command(None | Some(Command::Shutdown)) => break,
                Event::Command(Some(Command::Publish {
                    request_id,
                    data,
                    key,
                    respond,
                })) => {
                    let r =
                        self.machine
                            .handle_publish(Instant::now(), &request_id, data, Some(key));
                    let _ = respond.send(r);
                }
                Event::Command(Some(Command::LoadKey {
                    request_id,
                    respond,
                })) => {
                    let _ = respond.send(self.machine.load_key(&request_id).map(str::to_string));
                }
                Event::Command(Some(Command::Served {
                    peer,
                    request_id,
                    load_id,
                    result,
                })) => {
                    if let Err(e) = &result {
                        warn_limited!(
                            self.peer_warnings.load_failed,
                            request_id,
                            "load failed: {e}"
                        );
                    }
                    self.machine
                        .handle_served(Instant::now(), peer, &request_id, load_id, result);
                }
                Event::Tick => self.machine.handle_timeout(Instant::now()),
            }
            self.drain().await;
        }
        // Close the listener before returning, so the endpoint can be bound again at once.
        let errors = tokio::time::timeout(Duration::from_secs(5), self.socket.close()).await;
        if let Ok(errors) = errors {
            for e in errors {
                warn!("closing the producer socket: {e}");
            }
        }
    }

    fn on_message(&mut self, m: ZmqMessage) {
        let frames = m.into_vec();
        // ROUTER gives [identity, (empty delimiter,)? payload].
        let (Some(peer), Some(body)) = (frames.first().cloned(), frames.last().cloned()) else {
            return;
        };
        if frames.len() < 2 {
            warn_limited!(
                self.peer_warnings.bad_request,
                "control message without a body, dropped"
            );
            return;
        }
        self.machine.handle_message(Instant::now(), peer, &body);
    }

    /// A WARN for a refused hello or request, within the rate limit.
    fn refused(&self, why: &str) {
        match self.refusals.allow(Instant::now()) {
            Some(0) => warn!("control channel: refused: {why}"),
            Some(n) => warn!("control channel: refused: {why} ({n} more refusals not logged)"),
            None => {}
        }
    }

    /// Carries out the machine's effects.
    async fn drain(&mut self) {
        while let Some(e) = self.machine.poll_effect() {
            match e {
                Effect::Welcome { peer, welcome } => self.send(peer, encode(&welcome), None).await,
                Effect::Reply { peer, reply } => {
                    self.send(peer, encode(&reply), Some(&reply.request_id))
                        .await
                }
                Effect::Warn(Warning::Refused(why)) => self.refused(&why.to_string()),
                // Only the consumer hears the reply: say here why a load was refused.
                Effect::Warn(Warning::Load(refusal)) => self.refused(&refusal.to_string()),
                Effect::CloseSegments { segments } => {
                    // Off the event loop: an RDMA transport destroys its queue pairs there.
                    let workers = self.workers.clone();
                    tokio::task::spawn_blocking(move || {
                        for s in &segments {
                            debug!(segment = %s, "consumer gone; closing its data connections");
                            for w in workers.iter() {
                                w.engine.close_segment(s);
                            }
                        }
                    });
                }
                Effect::Warn(Warning::BadRequest { request_id, error }) => warn_limited!(
                    self.peer_warnings.bad_request,
                    request_id = ?request_id,
                    "bad transfer request: {error}"
                ),
                Effect::Released { request_id, reason } => {
                    debug!(request_id, ?reason, "lease released");
                    if reason == ReleaseReason::Expired {
                        warn!(
                            request_id,
                            "lease expired before any consumer came; blocks freed"
                        );
                    }
                    self.released.locked().push(Released { request_id, reason });
                }
                Effect::Serve {
                    peer,
                    request,
                    lease,
                    deadline,
                } => {
                    let workers = self.workers.clone();
                    let layouts = self.layouts.clone();
                    let Some(commands) = self.commands.upgrade() else {
                        continue; // the producer is being dropped
                    };
                    let (request_id, load_id) = (request.request_id.clone(), request.load_id);
                    let serve = tokio::spawn(async move {
                        let token = match request.token.as_deref().map(str::parse::<Token>) {
                            None => Ok(None),
                            Some(Ok(t)) => Ok(Some(t)),
                            Some(Err(e)) => Err(ServeFailure::Token(e)),
                        };
                        let t_plan = Instant::now();
                        let planned = plan(&layouts, &lease, &request).map_err(ServeFailure::from);
                        debug!(
                            target: "kvferry::timing",
                            request_id = request.request_id,
                            plan_us = t_plan.elapsed().as_micros() as u64,
                            copies = planned.as_ref().map(|p| p.iter().map(|r| r.copy_count()).sum::<usize>()).unwrap_or(0),
                            "serve planned"
                        );
                        let result = match (token, planned) {
                            (Err(e), _) | (_, Err(e)) => Err(e),
                            (Ok(token), Ok(plan)) => write_all(workers, plan, deadline, token)
                                .await
                                .map_err(ServeFailure::from),
                        };
                        result.map(|bytes| (bytes, lease.payload))
                    });
                    // Whatever happens to the serve task, the lease ends and the consumer hears.
                    tokio::spawn(async move {
                        let result = serve.await.unwrap_or_else(|e| Err(ServeFailure::Task(e)));
                        let _ = commands.send(Command::Served {
                            peer,
                            request_id,
                            load_id,
                            result,
                        });
                    });
                }
            }
        }
    }

    /// Sends `body` to `peer` within the send timeout; a reply (naming `request_id`) not sent
    /// is a warning, a welcome not sent a debug line (its consumer times out connecting).
    async fn send(&mut self, peer: Bytes, body: Vec<u8>, request_id: Option<&str>) {
        let mut msg = ZmqMessage::from(peer);
        msg.push_back(Bytes::from(body));
        let why = match tokio::time::timeout(self.send_timeout, self.socket.send(msg)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("not sent within {:?}", self.send_timeout),
        };
        match request_id {
            Some(request_id) => {
                warn_limited!(
                    self.peer_warnings.not_sent,
                    request_id,
                    "reply not sent: {why}"
                )
            }
            None => debug!("welcome not sent: {why}"),
        }
    }
}
