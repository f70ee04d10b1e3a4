//! The consumer's protocol state machine for one producer connection (docs/design.md §4),
//! without sockets or clocks.
//!
//! One taxonomy, as the producer's machine and quinn-proto's `Connection`: the shell feeds
//! inputs through `handle_*` (a reply, a lost connection, a failed send, time passing) and
//! drains the outputs: [`ConsumerMachine::poll_transmit`] (requests to send),
//! [`ConsumerMachine::poll_event`] (loads ended, and [`ConsumerEvent::RebuildSocket`]) and
//! [`ConsumerMachine::poll_timeout`] (when to call [`ConsumerMachine::handle_timeout`]).
//!
//! Every load has two deadlines: the reply deadline (`reply_timeout` after the
//! request or after the last CONTINUE) and the overall deadline (`max_wait` after
//! the request; CONTINUE never extends past it). A missed deadline or a lost
//! connection fails the load with its reason and marks the socket for rebuilding
//! (the `zeromq` crate's DEALER does not reconnect by itself). A load is never
//! retried: KV is never fetched twice for one request. A FINISH for a load sent with a token
//! must carry the token's proof (`msg::finish_proof`), else the load fails (`BadProof`).
//!
//! Session (docs/design.md §8.1, `proto::session`): after connecting, the shell sends
//! [`ConsumerMachine::hello`] and feeds the answer to [`ConsumerMachine::handle_welcome`]; with a
//! shared secret, a producer that does not prove it gets nothing more (no request, no token,
//! no proof of a load key). Requests are bound to the session.
//!
//! Fail fast: once connecting to the producer has failed, the producer is *down*:
//! loads are refused at once with that failure's reason (no connect timeout each) until
//! `retry_interval` has passed since the failure; the next load after that connects again, and
//! a success ends the down state.

use std::collections::{HashMap, VecDeque};

use std::time::{Duration, Instant};

use kvferry_transfer::{PeerText, Secret, Shared};

use super::msg::{
    decode_reply, decode_welcome, encode, finish_proof, Hello, LayerSpan, LoadRequest, MsgError,
    Reply, Status, KIND_HELLO, PROTOCOL_VERSION,
};
use super::progress::{check_progress, layer_slots, ProgressError};
use super::session::Session;

/// Why a load failed before any verdict (transport or producer side).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FailReason {
    /// No reply within the reply deadline. A live producer whose control channel
    /// broke could still write into the load's blocks until the request's budget
    /// ends (`max_wait` after the request): do not reuse them before.
    #[error("no reply from the producer within {0:?} (lost reply or dead producer)")]
    NoReply(Duration),
    /// The producer kept answering CONTINUE past the overall deadline.
    #[error("producer did not finish within {0:?}")]
    Overall(Duration),
    /// The connection to the producer broke (producer died or restarted). As for
    /// `NoReply`, the load's blocks are safe to reuse only after `max_wait`.
    #[error("connection to the producer lost: {0}")]
    ConnectionLost(LinkError),
    /// The producer answered ERROR: its words (bounded, escaped).
    #[error("producer error: {0}")]
    Producer(PeerText),
    /// The producer answered ERROR because the request does not match its lease
    /// (`ErrorReason::LeaseMismatch`): the sides replay different prompts or models. Its
    /// words (bounded, escaped).
    #[error("producer error: {0}")]
    LeaseMismatch(PeerText),
    /// A request to read was refused (`ErrorReason::ReadRefused`: planned with a layout not the
    /// producer's; or, without sending it, a producer whose welcome does not say it serves
    /// reads): nothing was served, and the load may go again by WRITE. The words.
    #[error("producer error: {0}")]
    ReadRefused(PeerText),
    /// The producer answered ERROR to a request to read for a lease it has not published yet
    /// (`ErrorReason::ReadEarly`): nothing was served, and the load may go again by WRITE,
    /// which waits for the publish. Its words.
    #[error("producer error: {0}")]
    ReadEarly(PeerText),
    /// A FINISH whose proof does not match the load's token (missing or wrong): it did not
    /// come from the producer the token was sent to, so its payload is not accepted.
    #[error("FINISH without a valid proof of the load's token; payload refused")]
    BadProof,
    /// The producer holds no session for this connection (it evicted it): nothing was served;
    /// the socket is rebuilt with a new session, and the load may be sent again.
    #[error(
        "the producer holds no session for this connection (evicted); nothing was served: {0}"
    )]
    NoSession(PeerText),
}

/// Why the control connection to the producer failed, as the shell saw it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The socket's own error.
    #[error("{0}")]
    Socket(#[source] ShellError),
    /// The producer disconnected (the socket's monitor said so, or its events ended).
    #[error("producer disconnected")]
    Disconnected,
    /// No socket was open to send on (it was closed after a failure).
    #[error("no socket")]
    NoSocket,
    /// A send did not finish within the send timeout.
    #[error("send did not finish within {0:?}")]
    SendTimeout(Duration),
    /// The task that owns the connection ended before it answered.
    #[error("connection task ended")]
    TaskEnded,
    /// The load's request could not be sent (so the producer never got it): why.
    #[error("request not sent: {0}")]
    NotSent(#[source] Box<LinkError>),
}

/// An error of the shell's I/O (its socket, its random source), shared so that a [`LinkError`]
/// or [`ConnectFailure`] stays `Clone`; its `source()` is the error itself, for a caller that
/// downcasts. Equality is [`Shared`]'s (the same error, or the same text).
pub type ShellError = Shared;

/// An output of the machine ([`ConsumerMachine::poll_event`]).
#[derive(Debug, Clone, PartialEq)]
pub enum ConsumerEvent {
    /// The load ended with FINISH; the reply carries the payload.
    Finished {
        /// The load.
        load_id: u64,
        /// The producer's reply.
        reply: Reply,
    },
    /// The load failed (ERROR reply).
    Failed {
        /// The load.
        load_id: u64,
        /// Why.
        reason: FailReason,
    },
    /// CONTINUE: the producer is alive and the reply deadline moved.
    Progress {
        /// The load.
        load_id: u64,
        /// The layers the reply says have landed (`proto::progress`), checked to follow on
        /// from the ones named before; `None` when it names none.
        landed: Option<LayerSpan>,
    },
    /// A CONTINUE whose layers cannot have landed in this order (`proto::progress`): the
    /// reply deadline moved, but this load's progress is void from here on; every layer
    /// the early checksums covered is verified again after the FINISH.
    BadProgress {
        /// The load.
        load_id: u64,
        /// Why.
        error: ProgressError,
    },
    /// A reply for no pending load (late, after the load timed out): ignored.
    Stale {
        /// The load id in the reply.
        load_id: u64,
    },
    /// An undecodable message: ignored (no load can be blamed).
    Invalid(MsgError),
    /// Close the socket: a failure spoiled it (the `zeromq` crate's DEALER does not reconnect
    /// by itself) and no load waits on it any more. Its session is over; the next load connects
    /// anew. Never emitted while a load is pending (that would drop the replies it waits for).
    RebuildSocket,
}

/// A request to send on the socket ([`ConsumerMachine::poll_transmit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// The load it starts: on a failed send, [`ConsumerMachine::handle_send_failed`] with it.
    pub load_id: u64,
    /// The encoded request.
    pub bytes: Vec<u8>,
}

/// Why a session could not be opened with the producer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// The producer refused the `hello`: its words (bounded, escaped).
    #[error("the producer refused the session: {0}")]
    Refused(PeerText),
    /// With a shared secret: the producer did not prove it over this session (no proof, a
    /// wrong one, or a relay that answered for another endpoint). Nothing was sent to it.
    #[error("the producer did not prove the shared secret; nothing was sent to it")]
    Unproven,
    /// The answer is not a `welcome`.
    #[error("bad answer to hello: {0}")]
    Malformed(MsgError),
    /// An answer with no `hello` outstanding.
    #[error("a welcome with no hello outstanding")]
    Unexpected,
}

struct Pending {
    request_id: String,
    /// The session the request was sent in (bound into the FINISH proof).
    session_id: [u8; 32],
    /// The load's grant token: a FINISH must prove it (`msg::finish_proof`).
    token: Option<String>,
    reply_deadline: Instant,
    deadline: Instant,
    continued: bool,
    /// Layer slots of the request, and one past the last a progress named.
    slots: u32,
    landed: u32,
    /// A progress was bogus: later ones are ignored.
    progress_void: bool,
}

/// The loads in flight on one producer connection.
pub struct ConsumerMachine {
    reply_timeout: Duration,
    max_wait: Duration,
    next_load_id: u64,
    pending: HashMap<u64, Pending>,
    needs_rebuild: bool,
    retry_interval: Duration,
    down: Option<Down>,
    secret: Option<Secret>,
    /// The `hello` sent on the current socket, until its `welcome`.
    hello: Option<Session>,
    /// The session of the current socket.
    session: Option<Session>,
    /// Whether that session's producer serves reads (its welcome says so).
    peer_reads: bool,
    /// Outputs not yet polled.
    transmits: VecDeque<Transmit>,
    events: VecDeque<ConsumerEvent>,
}

/// The budget a consumer that waits at most `max_wait` for a load sends with it
/// ([`ConsumerMachine::budget`]): `max_wait` less a grace of 1 s, at most a quarter of it. A
/// consumer that reads a load itself reads within it (the producer holds the lease that long).
pub fn budget_of(max_wait: Duration) -> Duration {
    max_wait - (max_wait / 4).min(Duration::from_secs(1))
}

/// Why the control connection could not be made, or a load could not start on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectFailure {
    /// Connecting (or the hello exchange) did not finish within the connect timeout.
    #[error("connect did not finish within {0:?}")]
    Timeout(Duration),
    /// Connecting did not finish within the connect timeout (`waited`), and the last plain
    /// TCP connect to the producer's control port, `addr` (HOST:PORT), was refused: nothing
    /// listens there (yet).
    #[error("connection refused by {addr} for {waited:?} (is `kvferry serve` running there?)")]
    Refused {
        /// The producer's control address, HOST:PORT.
        addr: String,
        /// How long connecting was tried.
        waited: Duration,
    },
    /// The socket's error.
    #[error("{0}")]
    Socket(#[source] ShellError),
    /// The session could not be opened.
    #[error(transparent)]
    Session(SessionError),
    /// The session's nonce could not be drawn (the OS's random source failed).
    #[error("cannot draw the session nonce: {0}")]
    Nonce(#[source] ShellError),
    /// The machine has no session to start the load in.
    #[error("no session with the producer")]
    NoSession,
    /// The last connect failed less than the retry interval ago.
    #[error(transparent)]
    Unreachable(Unreachable),
}

/// A load refused at once: the last connect to the producer failed less than the retry
/// interval ago ([`ConsumerMachine::admit`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("producer unreachable (not retried for {retry_interval:?} after the last connect failed: {why})")]
pub struct Unreachable {
    /// The retry interval.
    pub retry_interval: Duration,
    /// Why the last connect failed.
    pub why: Box<ConnectFailure>,
}

/// The last connect failed: loads are refused until `retry_at`.
struct Down {
    why: ConnectFailure,
    retry_at: Instant,
}

impl ConsumerMachine {
    /// `reply_timeout`: longest silence from the producer; `max_wait`: longest load overall.
    /// `first_load_id` seeds the load ids (the shell uses a random one, so that ids of a
    /// rebuilt or restarted consumer do not collide with earlier ones).
    pub fn new(reply_timeout: Duration, max_wait: Duration, first_load_id: u64) -> Self {
        ConsumerMachine {
            reply_timeout,
            max_wait: max_wait.max(reply_timeout),
            next_load_id: first_load_id,
            pending: HashMap::new(),
            needs_rebuild: false,
            retry_interval: Duration::from_secs(1),
            down: None,
            secret: None,
            hello: None,
            session: None,
            peer_reads: false,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// Authenticated mode: the producer must prove `secret` before anything but the `hello`
    /// is sent, and every request carries this side's proof.
    pub fn with_secret(mut self, secret: Option<Secret>) -> Self {
        self.secret = secret;
        self
    }

    /// Opens a session on a fresh socket: the `hello` to send, with this side's `nonce`
    /// (fresh, random), the `producer` endpoint dialed and this consumer's name. Any earlier
    /// session ends.
    pub fn hello(&mut self, nonce: [u8; 32], producer: &str, consumer: &str) -> Vec<u8> {
        self.session = None;
        let s = Session {
            consumer_nonce: nonce,
            producer_nonce: [0; 32],
            producer: producer.to_string(),
            consumer: consumer.to_string(),
        };
        let msg = Hello {
            version: PROTOCOL_VERSION,
            kind: KIND_HELLO.to_string(),
            nonce: nonce.to_vec(),
            producer: s.producer.clone(),
            consumer: s.consumer.clone(),
        };
        self.hello = Some(s);
        encode(&msg)
    }

    /// The producer's answer to the `hello`: the session is open, or `Err` (then nothing may
    /// be sent on this socket).
    pub fn handle_welcome(&mut self, bytes: &[u8]) -> Result<(), SessionError> {
        let mut s = self.hello.take().ok_or(SessionError::Unexpected)?;
        let w = decode_welcome(bytes).map_err(SessionError::Malformed)?;
        if let Some(why) = w.error {
            return Err(SessionError::Refused(PeerText::from_bytes(why.as_bytes())));
        }
        s.producer_nonce = w
            .nonce
            .as_slice()
            .try_into()
            .map_err(|_| SessionError::Unexpected)?;
        if let Some(secret) = &self.secret {
            if !s.check_producer_proof(secret, w.proof.as_deref()) {
                return Err(SessionError::Unproven);
            }
        }
        self.session = Some(s);
        self.peer_reads = w.reads;
        Ok(())
    }

    /// How long after a failed connect loads are refused at once before the next one
    /// connects again (default 1 s).
    pub fn with_retry_interval(mut self, retry_interval: Duration) -> Self {
        self.retry_interval = retry_interval;
        self
    }

    /// Whether a load that needs a connection may try to connect now. `Err` holds the reason
    /// to fail it with at once: the producer is down (the last connect failed) and the retry
    /// interval has not passed.
    pub fn admit(&self, now: Instant) -> Result<(), Unreachable> {
        match &self.down {
            Some(d) if now < d.retry_at => Err(Unreachable {
                retry_interval: self.retry_interval,
                why: Box::new(d.why.clone()),
            }),
            _ => Ok(()),
        }
    }

    /// Connecting failed with `why`: the producer is down; loads are refused at once until
    /// `retry_interval` from `now`.
    pub fn handle_connect_failed(&mut self, now: Instant, why: ConnectFailure) {
        self.down = Some(Down {
            why,
            retry_at: now + self.retry_interval,
        });
    }

    /// Connecting succeeded: the producer is up again.
    pub fn handle_connected(&mut self) {
        self.down = None;
    }

    /// The budget sent with each request: `max_wait` less a grace for the request's
    /// trip (1 s, at most a quarter of `max_wait`), so that the producer's last write
    /// ends before this side's overall deadline.
    pub fn budget(&self) -> Duration {
        budget_of(self.max_wait)
    }

    /// Registers a load on the open session: assigns `request.load_id`, sets its budget, the
    /// proof of `load_key` (if any) and, with a secret, this side's proof over the whole
    /// request; queues the encoded request ([`Self::poll_transmit`]) and returns the load id.
    /// `None` when no session is open (nothing registered).
    pub fn start(
        &mut self,
        now: Instant,
        mut request: LoadRequest,
        load_key: Option<&str>,
    ) -> Option<u64> {
        let session = self.session.as_ref()?;
        let load_id = self.next_load_id;
        self.next_load_id = self.next_load_id.wrapping_add(1);
        request.load_id = load_id;
        if !self.peer_reads {
            // A producer that did not say it serves reads does not know these fields: its
            // proof of the request would not cover them (secret mode refuses it).
            request.want_layout = false;
            if request.read {
                let why = b"the producer does not serve reads (its welcome does not say so)";
                self.events.push_back(ConsumerEvent::Failed {
                    load_id,
                    reason: FailReason::ReadRefused(PeerText::from_bytes(why)),
                });
                return Some(load_id);
            }
        }
        request.budget_ms = self.budget().as_millis().min(u64::MAX as u128) as u64;
        request.key_proof =
            load_key.map(|k| session.key_proof(k, &request.request_id, load_id).to_vec());
        request.proof = None;
        if let Some(secret) = &self.secret {
            request.proof = Some(session.request_proof(secret, &request).to_vec());
        }
        self.pending.insert(
            load_id,
            Pending {
                request_id: request.request_id.clone(),
                session_id: session.id(),
                token: request.token.clone(),
                reply_deadline: now + self.reply_timeout,
                deadline: now + self.max_wait,
                continued: false,
                slots: layer_slots(&request).len().min(u32::MAX as usize) as u32,
                landed: 0,
                progress_void: false,
            },
        );
        self.transmits.push_back(Transmit {
            load_id,
            bytes: encode(&request),
        });
        Some(load_id)
    }

    /// Loads in flight.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// A message arrived from the producer.
    pub fn handle_message(&mut self, now: Instant, bytes: &[u8]) {
        let event = self.message(now, bytes);
        self.events.push_back(event);
        self.check_rebuild();
    }

    fn message(&mut self, now: Instant, bytes: &[u8]) -> ConsumerEvent {
        let reply = match decode_reply(bytes) {
            Ok(r) => r,
            Err(e) => return ConsumerEvent::Invalid(e),
        };
        let load_id = reply.load_id;
        let Some(p) = self.pending.get_mut(&load_id) else {
            return ConsumerEvent::Stale { load_id };
        };
        if p.request_id != reply.request_id {
            return ConsumerEvent::Invalid(MsgError::RequestMismatch {
                load_id,
                got: reply.request_id,
                expected: p.request_id.clone(),
            });
        }
        match reply.status() {
            Status::Continue => {
                p.reply_deadline = (now + self.reply_timeout).min(p.deadline);
                p.continued = true;
                let landed = match reply.landed {
                    Some(span) if !p.progress_void => span,
                    _ => {
                        return ConsumerEvent::Progress {
                            load_id,
                            landed: None,
                        }
                    }
                };
                match check_progress(p.landed, p.slots, landed) {
                    Ok(end) => {
                        p.landed = end;
                        ConsumerEvent::Progress {
                            load_id,
                            landed: Some(landed),
                        }
                    }
                    Err(error) => {
                        p.progress_void = true;
                        ConsumerEvent::BadProgress { load_id, error }
                    }
                }
            }
            Status::Finish => {
                let p = self.pending.remove(&load_id);
                let proven = match p.and_then(|p| p.token.map(|t| (t, p.session_id))) {
                    None => true,
                    Some((t, sid)) => reply.proof.as_deref().is_some_and(|got| {
                        kvferry_transfer::auth::ct_eq(&finish_proof(&t, &sid, &reply), got)
                    }),
                };
                if !proven {
                    return ConsumerEvent::Failed {
                        load_id,
                        reason: FailReason::BadProof,
                    };
                }
                ConsumerEvent::Finished { load_id, reply }
            }
            Status::Error => {
                self.pending.remove(&load_id);
                let why = PeerText::from_bytes(
                    reply
                        .error
                        .as_deref()
                        .unwrap_or("ERROR without a reason")
                        .as_bytes(),
                );
                if reply.no_session {
                    // the session is gone on the producer's side: a new socket, a new hello
                    self.needs_rebuild = true;
                    return ConsumerEvent::Failed {
                        load_id,
                        reason: FailReason::NoSession(why),
                    };
                }
                ConsumerEvent::Failed {
                    load_id,
                    reason: match reply.reason {
                        Some(super::msg::ErrorReason::ReadRefused) => FailReason::ReadRefused(why),
                        Some(super::msg::ErrorReason::ReadEarly) => FailReason::ReadEarly(why),
                        Some(super::msg::ErrorReason::LeaseMismatch) => {
                            FailReason::LeaseMismatch(why)
                        }
                        None => FailReason::Producer(why),
                    },
                }
            }
        }
    }

    /// Time passed: loads past a deadline fail (the socket is then rebuilt).
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut failed = Vec::new();
        let (reply_timeout, max_wait) = (self.reply_timeout, self.max_wait);
        self.pending.retain(|id, p| {
            if p.reply_deadline > now {
                return true;
            }
            // CONTINUE clamps the reply deadline to the overall one.
            if p.continued && p.reply_deadline >= p.deadline {
                failed.push((*id, FailReason::Overall(max_wait)));
            } else {
                failed.push((*id, FailReason::NoReply(reply_timeout)));
            }
            false
        });
        self.fail_all(failed);
    }

    /// The connection broke: every pending load fails; the socket is rebuilt.
    pub fn handle_connection_lost(&mut self, why: LinkError) {
        let failed = self
            .pending
            .drain()
            .map(|(id, _)| (id, FailReason::ConnectionLost(why.clone())))
            .collect();
        self.needs_rebuild = true;
        self.fail_all(failed);
    }

    /// Sending the request of `load_id` failed: the load fails (the producer never got it),
    /// and the socket is rebuilt. Nothing happens when the load is not pending.
    pub fn handle_send_failed(&mut self, load_id: u64, why: LinkError) {
        if self.pending.remove(&load_id).is_none() {
            return;
        }
        let reason = FailReason::ConnectionLost(LinkError::NotSent(Box::new(why)));
        self.fail_all(vec![(load_id, reason)]);
    }

    /// Queues the failures in load id order; a failure spoils the socket.
    fn fail_all(&mut self, mut failed: Vec<(u64, FailReason)>) {
        if !failed.is_empty() {
            self.needs_rebuild = true;
        }
        failed.sort_by_key(|(id, _)| *id);
        self.events.extend(
            failed
                .into_iter()
                .map(|(load_id, reason)| ConsumerEvent::Failed { load_id, reason }),
        );
        self.check_rebuild();
    }

    /// After a failure, once no load is in flight on the socket (rebuilding earlier would drop
    /// replies the others wait for): asks the shell to rebuild it; its session ends here.
    fn check_rebuild(&mut self) {
        if self.needs_rebuild && self.pending.is_empty() {
            self.needs_rebuild = false;
            self.session = None;
            self.hello = None;
            self.transmits.clear();
            self.events.push_back(ConsumerEvent::RebuildSocket);
        }
    }

    /// Queues the `read_done` of load `load_id` of `request_id`, which this consumer read
    /// itself (docs/design.md §4.10): its producer's lease ends. Sent only on a session: a
    /// socket rebuilt since has lost the load's session, and the lease ends at its deadline.
    pub fn read_done(&mut self, request_id: &str, load_id: u64) {
        if self.session.is_some() {
            let done = super::msg_read::ReadDone::new(request_id, load_id);
            self.transmits.push_back(Transmit {
                load_id,
                bytes: super::msg::encode(&done),
            });
        }
    }

    /// The next request to send, in the order the loads started.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next output: a load that ended (or made progress, or a reply ignored), or
    /// [`ConsumerEvent::RebuildSocket`].
    pub fn poll_event(&mut self) -> Option<ConsumerEvent> {
        self.events.pop_front()
    }

    /// The session of the current socket, once its `welcome` checked.
    pub fn session(&self) -> Option<&Session> {
        self.session.as_ref()
    }

    /// When [`Self::handle_timeout`] has something to do: the earliest deadline of a pending
    /// load.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.pending.values().map(|p| p.reply_deadline).min()
    }
}
