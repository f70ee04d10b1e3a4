//! The consumer's connection to one producer (docs/design.md §4.4): a tokio task that owns the
//! DEALER socket, says hello, feeds the consumer machine the socket's messages, the loads it is
//! given and its timers, and carries out what the machine polls out (requests to send, loads
//! ended, the socket to rebuild).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use crate::proto::consumer::{
    ConnectFailure, ConsumerEvent, ConsumerMachine, FailReason, LinkError,
};
use crate::proto::msg::{LayerSpan, LoadRequest, Reply};
use crate::proto::progress::ProgressError;
use crate::shell::consumer_config::ConsumerConfig;
use crate::shell::sleep_until;
use kvferry_transfer::{Secret, Shared};

/// Why a load got no reply: its connection failed, or the machine failed it.
pub(crate) enum ConnFailure {
    Connect(ConnectFailure),
    Failed(FailReason),
}

/// A load for a connection's task: the request, its lease's key and where its outcome goes.
pub(crate) struct LoadCmd {
    pub(crate) request: LoadRequest,
    /// The lease's load key: proved in the session, never sent.
    pub(crate) load_key: Option<String>,
    pub(crate) respond: oneshot::Sender<Result<Reply, ConnFailure>>,
    /// Where the load's progress goes while it waits (`None`: nobody listens). At most one
    /// message per layer of the request: the machine takes only spans that follow on.
    pub(crate) progress: Option<mpsc::UnboundedSender<LoadProgress>>,
}

/// What a waiting load hears of its progress ([`LoadCmd::progress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LoadProgress {
    /// These layer slots have landed (`proto::progress`).
    Landed(LayerSpan),
    /// The producer's progress was bogus: the load's early checksums are void.
    Void(ProgressError),
}

/// A waiting load: its answer channel, its progress channel, and when it started here.
type Waiter = (
    oneshot::Sender<Result<Reply, ConnFailure>>,
    Option<mpsc::UnboundedSender<LoadProgress>>,
    Instant,
);

/// What a connection's task is told: start a load, or connect now (ahead of the first load)
/// and say whether it could.
pub(crate) enum ConnCmd {
    Load(Box<LoadCmd>),
    Connect(oneshot::Sender<Result<(), ConnectFailure>>),
    /// A load this consumer read itself is over: tell the producer (its lease ends).
    ReadDone {
        request_id: String,
        load_id: u64,
    },
}

enum SockEvent {
    Message(Bytes),
    Lost(LinkError),
}

/// A connected DEALER, received from on the connection's own task (no reader task between the
/// socket and the machine: a reply wakes one task, not two); dropping it closes the socket.
struct Sock {
    send: zeromq::DealerSendHalf,
    recv: zeromq::DealerRecvHalf,
    monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    /// The socket failed or its peer went: nothing more is read from it (until the machine
    /// has it rebuilt), so that a failed socket is not polled in a loop.
    lost: bool,
}

impl Sock {
    /// The socket's next message or loss; pending forever once lost. Cancel-safe: the DEALER's
    /// receive takes a message only when it returns it, and so does the monitor.
    async fn next(&mut self) -> SockEvent {
        if self.lost {
            return std::future::pending().await;
        }
        let ev = loop {
            tokio::select! {
                m = self.recv.recv() => match m {
                    Ok(m) => {
                        if let Some(body) = m.into_vec().pop() {
                            break SockEvent::Message(body);
                        }
                    }
                    Err(e) => break SockEvent::Lost(LinkError::Socket(Shared(Arc::new(e)))),
                },
                ev = self.monitor.next() => match ev {
                    Some(SocketEvent::Disconnected(_)) | None => {
                        break SockEvent::Lost(LinkError::Disconnected)
                    }
                    Some(_) => {}
                },
            }
        };
        self.lost = matches!(ev, SockEvent::Lost(_));
        ev
    }
}

/// The task of one (consumer, producer) DEALER: drives a [`ConsumerMachine`] with the socket's
/// messages, the loads it is given and its timers, and carries out its outputs.
pub(crate) struct Connection {
    endpoint: String,
    /// This consumer's name in sessions.
    name: String,
    machine: ConsumerMachine,
    connect_timeout: Duration,
    send_timeout: Duration,
    max_message_bytes: usize,
    sock: Option<Sock>,
    generation: u64,
    /// Each load's answer and progress channels and when it was started here (for its timing
    /// line).
    waiters: HashMap<u64, Waiter>,
}

/// A connection's first load id: random, so that the ids of a rebuilt or restarted consumer do
/// not collide with earlier ones; below 2^52, so that they stay exact where a peer reads JSON
/// numbers as doubles and never wrap.
fn seed() -> u64 {
    kvferry_transfer::ids::random_u64() & 0x000f_ffff_ffff_ffff
}

/// Tries a plain TCP connect to `addr` (HOST:PORT) every [`PROBE_INTERVAL`], from one
/// interval on (a producer that is up is connected to by ZeroMQ before the first probe), and
/// sets `refused` to whether the last attempt was refused. Stops probing, and waits forever,
/// once one connects or the address cannot be resolved: the caller's connect or deadline ends
/// it. Each probe is bounded by the interval.
async fn probe_refusals(addr: &str, refused: &mut bool) -> std::convert::Infallible {
    loop {
        tokio::time::sleep(PROBE_INTERVAL).await;
        match tokio::time::timeout(PROBE_INTERVAL, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => break,
            Ok(Err(e)) => {
                *refused = e.kind() == std::io::ErrorKind::ConnectionRefused;
                if e.kind() == std::io::ErrorKind::InvalidInput {
                    break;
                }
            }
            Err(_) => *refused = false,
        }
    }
    *refused = false;
    std::future::pending().await
}

/// How often [`probe_refusals`] probes, and how long each probe may take.
const PROBE_INTERVAL: Duration = Duration::from_millis(250);

impl Connection {
    pub(crate) fn new(
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

    async fn connect(&mut self) -> Result<(), ConnectFailure> {
        let mut options = SocketOptions::default();
        options.connect_timeout(self.connect_timeout);
        options.max_message_size(self.max_message_bytes);
        let mut socket = zeromq::DealerSocket::with_options(options);
        let monitor = socket.monitor();
        // ZeroMQ retries a refused connect until its timeout and then only says it timed out;
        // a plain TCP probe beside it remembers what the last attempt saw, so that a producer
        // that is not running is told from a slow one (the whole timeout is still waited: a
        // producer that is starting is connected to as soon as it listens).
        let addr = self
            .endpoint
            .strip_prefix("tcp://")
            .unwrap_or(&self.endpoint)
            .to_string();
        let mut refused = false;
        let connected = tokio::time::timeout(self.connect_timeout, async {
            tokio::select! {
                r = socket.connect(&self.endpoint) => r,
                never = probe_refusals(&addr, &mut refused) => match never {},
            }
        })
        .await;
        match connected {
            // ZeroMQ may also give up on its own just before the deadline ("Connect timed
            // out"): either way, what the probes saw says why.
            Err(_) | Ok(Err(_)) if refused => {
                return Err(ConnectFailure::Refused {
                    addr,
                    waited: self.connect_timeout,
                })
            }
            Err(_) => return Err(ConnectFailure::Timeout(self.connect_timeout)),
            Ok(Err(e)) => return Err(ConnectFailure::Socket(Shared(Arc::new(e)))),
            Ok(Ok(())) => {}
        }
        // The session first: with a secret, nothing else goes out before the producer proved it.
        let nonce = kvferry_transfer::auth::random_bytes::<32>()
            .map_err(|e| ConnectFailure::Nonce(Shared(Arc::new(e))))?;
        let hello = self.machine.hello(nonce, &self.endpoint, &self.name);
        let welcome = tokio::time::timeout(self.connect_timeout, async {
            socket.send(ZmqMessage::from(hello)).await?;
            socket.recv().await
        })
        .await
        .map_err(|_| ConnectFailure::Timeout(self.connect_timeout))?
        .map_err(|e| ConnectFailure::Socket(Shared(Arc::new(e))))?;
        let body = welcome.into_vec().pop().unwrap_or_default();
        self.machine
            .handle_welcome(&body)
            .map_err(ConnectFailure::Session)?;
        self.generation += 1;
        let generation = self.generation;
        let (send, recv) = socket.split();
        self.sock = Some(Sock {
            send,
            recv,
            monitor,
            lost: false,
        });
        debug!(endpoint = self.endpoint, generation, "DEALER connected");
        Ok(())
    }

    /// A new load: connects unless connected (or the producer is down), then starts it on the
    /// machine; a load that cannot start is answered at once.
    async fn start(&mut self, cmd: LoadCmd) {
        let LoadCmd {
            request,
            load_key,
            respond,
            progress,
        } = cmd;
        let started = self.open().await.and_then(|()| {
            self.machine
                .start(Instant::now(), request, load_key.as_deref())
                .ok_or(ConnFailure::Connect(ConnectFailure::NoSession))
        });
        match started {
            Ok(load_id) => {
                self.waiters
                    .insert(load_id, (respond, progress, Instant::now()));
            }
            Err(e) => {
                let _ = respond.send(Err(e));
            }
        }
    }

    /// Connects the socket unless it is open.
    async fn open(&mut self) -> Result<(), ConnFailure> {
        if self.sock.is_some() {
            return Ok(());
        }
        self.machine
            .admit(Instant::now())
            .map_err(|why| ConnFailure::Connect(ConnectFailure::Unreachable(why)))?;
        if let Err(e) = self.connect().await {
            // Debug, not a warning: every load waiting on this connect gets `e` as its
            // `LoadError::Connect` and its caller reports it; a warning would say it twice.
            debug!(endpoint = self.endpoint, "cannot reach the producer: {e}");
            self.machine
                .handle_connect_failed(Instant::now(), e.clone());
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
                    None => Some(LinkError::NoSocket),
                    Some(sock) => {
                        let send = sock.send.send(ZmqMessage::from(t.bytes));
                        match tokio::time::timeout(self.send_timeout, send).await {
                            Ok(Ok(())) => None,
                            Ok(Err(e)) => Some(LinkError::Socket(Shared(Arc::new(e)))),
                            Err(_) => Some(LinkError::SendTimeout(self.send_timeout)),
                        }
                    }
                };
                if let Some(why) = why {
                    self.machine.handle_send_failed(t.load_id, why);
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
                ConsumerEvent::Progress { load_id, landed } => {
                    debug!(load_id, ?landed, "producer: CONTINUE");
                    if let Some(span) = landed {
                        self.progress(load_id, LoadProgress::Landed(span));
                    }
                }
                ConsumerEvent::BadProgress { load_id, error } => {
                    warn!(
                        endpoint = self.endpoint,
                        load_id, "bad progress from the producer, every layer is verified after the FINISH: {error}"
                    );
                    self.progress(load_id, LoadProgress::Void(error));
                }
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

    /// Tells the load `load_id` of its progress, if it listens.
    fn progress(&self, load_id: u64, p: LoadProgress) {
        if let Some((_, Some(tx), _)) = self.waiters.get(&load_id) {
            let _ = tx.send(p);
        }
    }

    fn answer(&mut self, load_id: u64, result: Result<Reply, ConnFailure>) {
        if let Some((w, _, started)) = self.waiters.remove(&load_id) {
            debug!(
                target: "kvferry::timing",
                load_id,
                answered_us = started.elapsed().as_micros() as u64,
                "load answered on the connection"
            );
            let _ = w.send(result);
        }
    }

    /// Runs until `commands` closes (the consumer dropped it).
    pub(crate) async fn run(mut self, mut commands: mpsc::UnboundedReceiver<ConnCmd>) {
        loop {
            let event = tokio::select! {
                cmd = commands.recv() => Event::Command(cmd),
                ev = async {
                    match self.sock.as_mut() {
                        Some(sock) => sock.next().await,
                        None => std::future::pending().await,
                    }
                } => Event::Sock(ev),
                _ = sleep_until(self.machine.poll_timeout()) => Event::Tick,
            };
            match event {
                Event::Command(None) => break,
                Event::Command(Some(ConnCmd::Load(cmd))) => self.start(*cmd).await,
                Event::Command(Some(ConnCmd::ReadDone {
                    request_id,
                    load_id,
                })) => self.machine.read_done(&request_id, load_id),
                Event::Command(Some(ConnCmd::Connect(respond))) => {
                    let r = self.open().await.map_err(|f| match f {
                        ConnFailure::Connect(why) => why,
                        ConnFailure::Failed(_) => ConnectFailure::NoSession,
                    });
                    let _ = respond.send(r);
                }
                Event::Sock(SockEvent::Message(body)) => {
                    self.machine.handle_message(Instant::now(), &body)
                }
                Event::Sock(SockEvent::Lost(why)) => {
                    if self.machine.pending() > 0 {
                        warn!(endpoint = self.endpoint, "control connection lost: {why}");
                    } else {
                        debug!(
                            endpoint = self.endpoint,
                            "control connection closed while idle: {why}"
                        );
                    }
                    self.machine.handle_connection_lost(why);
                }
                Event::Tick => self.machine.handle_timeout(Instant::now()),
            }
            self.drain().await;
        }
    }
}

/// What woke a connection's task.
enum Event {
    Command(Option<ConnCmd>),
    Sock(SockEvent),
    Tick,
}
