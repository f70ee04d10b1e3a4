//! The producer's event loop (docs/design.md §4.3): one tokio task that owns the ROUTER, feeds
//! the lease machine of [`crate::proto::producer`] the socket's messages, the peers' disconnects,
//! the embedder's commands and its timers, and carries out what the machine polls out (welcomes
//! and replies to send, leases released, serves to run, data connections to close).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::proto::layout::RankLayout;
use crate::proto::msg::{encode, LayerSpan};
use crate::proto::producer::{Effect, ProducerMachine, PublishError, ReleaseReason, Warning};
use crate::proto::serve::Published;
use crate::proto::serve_error::ServeFailure;
use crate::shell::gate::{warn_limited, PeerWarnings};
use crate::shell::producer_config::Released;
use crate::shell::serve::{serve_load, ServeEnd};
use crate::shell::sleep_until;
use crate::worker::Worker;
use kvferry_transfer::auth::LogLimit;
use kvferry_transfer::sync::MutexExt;

enum Event {
    Message(zeromq::ZmqResult<ZmqMessage>),
    Command(Option<Command>),
    Peer(Option<SocketEvent>),
    Tick,
}

/// What the [`Producer`](crate::shell::producer::Producer) and its serve tasks tell the loop.
pub(super) enum Command {
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
        result: ServeEnd,
        /// When the serve task was spawned (for the timing line of its way back).
        spawned: Instant,
    },
    /// The layers `landed` of a load being served have landed (`proto::progress`).
    Progress {
        request_id: String,
        load_id: u64,
        landed: LayerSpan,
    },
    LoadKey {
        request_id: String,
        respond: oneshot::Sender<Option<String>>,
    },
    Shutdown,
}

/// The loop's state: the machine, the ROUTER and what the effects need.
pub(super) struct EventLoop {
    pub(super) machine: ProducerMachine<Bytes, Published>,
    pub(super) socket: zeromq::RouterSocket,
    pub(super) monitor: Option<futures::channel::mpsc::Receiver<SocketEvent>>,
    /// Weak, so that dropping the [`Producer`](crate::shell::producer::Producer) ends the loop
    /// (serve tasks hold it strongly).
    pub(super) commands: mpsc::WeakUnboundedSender<Command>,
    pub(super) released: Arc<Mutex<Vec<Released>>>,
    pub(super) workers: Arc<Vec<Worker>>,
    /// The workers as the planner sees them (same order).
    pub(super) layouts: Arc<Vec<RankLayout>>,
    pub(super) send_timeout: Duration,
    /// Bytes of one layer group of a serve (`ProducerConfig::layer_group_bytes`).
    pub(super) layer_group_bytes: u64,
    /// Rate limit of the WARN lines for refused hellos and requests.
    pub(super) refusals: LogLimit,
    /// Warnings a consumer (or anyone reaching the port) can trigger, at most one a second each.
    pub(super) peer_warnings: PeerWarnings,
}

impl EventLoop {
    /// Runs until the socket fails, a [`Command::Shutdown`] comes or every sender is gone;
    /// then closes the ROUTER (within 5 s) so its endpoint can be bound again at once.
    pub(super) async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
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
                Event::Command(Some(Command::Progress {
                    request_id,
                    load_id,
                    landed,
                })) => {
                    self.machine
                        .handle_progress(Instant::now(), &request_id, load_id, landed);
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
                    spawned,
                })) => {
                    debug!(
                        target: "kvferry::timing",
                        request_id,
                        served_us = spawned.elapsed().as_micros() as u64,
                        "serve back on the loop"
                    );
                    let now = Instant::now();
                    match result {
                        ServeEnd::Ran(result) => {
                            if let Err(e) = &result {
                                warn_limited!(
                                    self.peer_warnings.load_failed,
                                    request_id,
                                    "load failed: {e}"
                                );
                            }
                            self.machine
                                .handle_served(now, peer, &request_id, load_id, result);
                        }
                        ServeEnd::Refused(why, lease) => {
                            warn_limited!(
                                self.peer_warnings.load_failed,
                                request_id,
                                "load refused, nothing written; the lease stays: {why}"
                            );
                            self.machine.handle_refused(
                                now,
                                peer,
                                &request_id,
                                load_id,
                                why,
                                lease,
                            );
                        }
                    }
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
        let t = Instant::now();
        self.machine.handle_message(t, peer, &body);
        debug!(
            target: "kvferry::timing",
            bytes = body.len(),
            handle_us = t.elapsed().as_micros() as u64,
            "request handled"
        );
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
                    let t = Instant::now();
                    let body = encode(&reply);
                    let encode_us = t.elapsed().as_micros() as u64;
                    self.send(peer, body, Some(&reply.request_id)).await;
                    debug!(
                        target: "kvferry::timing",
                        request_id = reply.request_id,
                        encode_us,
                        send_us = t.elapsed().as_micros() as u64 - encode_us,
                        "reply sent"
                    );
                }
                Effect::Warn(Warning::Refused(why)) => self.refused(&why.to_string()),
                // Only the consumer hears the reply: say here why a load was refused.
                Effect::Warn(Warning::Load(refusal)) => self.refused(&refusal.to_string()),
                Effect::CloseSegments { segments } => {
                    // Off the event loop: an RDMA transport destroys its queue pairs there.
                    // tokio's spawn_blocking panics when its pool has no thread and the OS
                    // refuses one; from a task of its own that panic ends that task (the
                    // connections stay open until the engine drops), not the event loop.
                    let workers = self.workers.clone();
                    tokio::spawn(async move {
                        let closed = tokio::task::spawn_blocking(move || {
                            for s in &segments {
                                debug!(segment = %s, "consumer gone; closing its data connections");
                                for w in workers.iter() {
                                    w.engine.close_segment(s);
                                }
                            }
                        });
                        if let Err(e) = closed.await {
                            warn!("closing a gone consumer's data connections failed: {e}");
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
                            "lease expired before any consumer loaded it; blocks freed"
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
                    let peer_of_panicked = peer.clone();
                    let spawned = Instant::now();
                    let (tell, id) = (commands.downgrade(), request_id.clone());
                    let progress = move |landed| {
                        if let Some(c) = tell.upgrade() {
                            let request_id = id.clone();
                            let _ = c.send(Command::Progress {
                                request_id,
                                load_id,
                                landed,
                            });
                        }
                    };
                    let groups = self.layer_group_bytes;
                    let (back, id) = (commands.clone(), request_id.clone());
                    // The serve task tells the loop itself (one hop back, not two).
                    let serve = tokio::spawn(async move {
                        let result = serve_load(
                            workers, layouts, lease, request, deadline, groups, progress,
                        )
                        .await;
                        let _ = back.send(Command::Served {
                            peer,
                            request_id: id,
                            load_id,
                            result,
                            spawned,
                        });
                    });
                    // Whatever happens to the serve task (a panic), the consumer hears, and the
                    // lease ends.
                    tokio::spawn(async move {
                        if let Err(e) = serve.await {
                            let _ = commands.send(Command::Served {
                                peer: peer_of_panicked,
                                request_id,
                                load_id,
                                result: ServeEnd::Ran(Err(ServeFailure::Task(e))),
                                spawned,
                            });
                        }
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
