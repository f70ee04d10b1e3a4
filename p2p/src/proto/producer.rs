//! The producer's protocol state machine (docs/design.md §4), without sockets or clocks:
//! the shell feeds it events with the current time and carries out the effects.
//!
//! * `publish` puts a request's blocks under a lease; a lease whose consumer never
//!   comes expires and its blocks are released.
//! * A transfer request for a held lease is served exactly once (KV is never
//!   fetched twice); a second request, or one for an expired lease, gets ERROR.
//! * A request that arrives before its publish waits (bounded by `publish_wait`);
//!   the consumer gets CONTINUE meanwhile and ERROR when the wait runs out.
//! * While a request waits or is being served, the consumer gets a CONTINUE every
//!   `heartbeat`, so that its silence deadline only fires for a dead producer.
//! * Request ownership: a lease published with a load key is served only to a request
//!   proving that key in its session (`Session::key_proof`, compared in constant time); a missing or wrong key gets ERROR and
//!   the lease stays for its owner. Several requests for one id may wait for its publish
//!   when they carry keys (so that a stranger asking first cannot lock the owner out).
//! * A request carries the consumer's budget (`budget_ms`): a transfer is started
//!   only if it can end (within `serve_margin`) before the consumer gives up, so
//!   the producer never writes into blocks the consumer already abandoned.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::msg::{Reply, Status, TransferRequest};
use super::serve_error::ServeFailure;
use super::session::Session;

/// Timeouts of the producer state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerTimeouts {
    /// How long published blocks are held for a consumer that has not come.
    pub lease: Duration,
    /// How long a request that arrived before its publish waits for it.
    pub publish_wait: Duration,
    /// How long a finished request's id is remembered, so that a late request
    /// for it gets a precise error (served / expired / failed) instead of waiting.
    pub tombstone: Duration,
    /// Interval of CONTINUE messages to a consumer whose request waits or is served.
    pub heartbeat: Duration,
}

impl Default for ProducerTimeouts {
    fn default() -> Self {
        ProducerTimeouts {
            lease: Duration::from_secs(120),
            publish_wait: Duration::from_secs(30),
            tombstone: Duration::from_secs(600),
            heartbeat: Duration::from_secs(1),
        }
    }
}

/// Why a lease's blocks were released to the embedder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseReason {
    /// The blocks were written to a consumer (FINISH sent).
    Served,
    /// Serving failed (ERROR sent); the blocks are not offered again.
    Failed(String),
    /// No consumer came before the lease ran out.
    Expired,
}

/// What the shell must do after an event.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect<P, T> {
    /// Send `reply` to `peer`.
    Reply {
        /// The consumer connection.
        peer: P,
        /// The message.
        reply: Reply,
    },
    /// Write the blocks of `lease` as `request` asks, finishing by `deadline`,
    /// then call [`ProducerMachine::on_served`].
    Serve {
        /// The consumer connection.
        peer: P,
        /// The consumer's request.
        request: TransferRequest,
        /// The published data, moved out of the lease (it is served once).
        lease: T,
        /// When the writes must be done (the serve margin from now).
        deadline: Instant,
    },
    /// The blocks of `request_id` may be reused by the embedder.
    Released {
        /// The request.
        request_id: String,
        /// Why.
        reason: ReleaseReason,
    },
}

/// A load refused for who asked or what it asked for, for the producer's log
/// ([`ProducerMachine::take_refusals`]); the consumer gets the same cause in its ERROR reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The request proved a load key that is not its lease's.
    #[error("request {0:?}: the load key it proves is not its lease's (the consumer has another publish's key, or derived its key from another secret or seed)")]
    KeyWrong(String),
    /// The lease has a load key and the request proved none.
    #[error("request {0:?}: its lease has a load key and the request proves none (the consumer was not given the key)")]
    KeyMissing(String),
    /// No lease of the request was published before its wait ended.
    #[error("request {0:?}: not published here before the wait ended (an unknown request id: the consumer asks another producer's request, or both sides replay different prompts)")]
    NotPublished(String),
}

/// Most refusals kept for [`ProducerMachine::take_refusals`]; more before the shell takes them
/// are dropped (they are log lines, and a peer must not make the producer hold more).
pub const MAX_PENDING_REFUSALS: usize = 64;

/// Errors of [`ProducerMachine::publish`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    /// The request id is already published, being served, or finished recently.
    #[error("request {0:?} was already published")]
    Duplicate(String),
}

enum Entry<P, T> {
    Held {
        data: T,
        expires: Instant,
        /// The lease's load key; `None`: any consumer may load it.
        key: Option<String>,
    },
    Serving {
        peer: P,
        load_id: u64,
        next_beat: Instant,
        /// The load's grant token: the FINISH proves it (`msg::finish_proof`).
        token: Option<String>,
        /// The id of the session the request came in (bound into the FINISH proof).
        session_id: [u8; 32],
    },
    Done {
        why: String,
        forget_at: Instant,
    },
}

struct Parked<P> {
    peer: P,
    request: TransferRequest,
    /// The session the request came in (its key proof is checked at publish).
    session: Session,
    /// When waiting for the publish stops (publish wait, or the consumer's budget).
    deadline: Instant,
    /// The consumer's own deadline, if it sent a budget.
    consumer_deadline: Option<Instant>,
    next_beat: Instant,
}

/// The producer's state: leases, requests waiting for their publish, finished ids.
pub struct ProducerMachine<P, T> {
    timeouts: ProducerTimeouts,
    serve_margin: Duration,
    entries: HashMap<String, Entry<P, T>>,
    parked: Vec<Parked<P>>,
    refusals: Vec<Refusal>,
}

const TWICE: &str = "is already being loaded (KV is never fetched twice)";

/// Most requests with load keys that may wait for one request id's publish.
pub const MAX_WAITING_PER_REQUEST: usize = 8;

/// Whether `request`, in `session`, may load a lease published with `key`: it proves the key
/// for this session and load (constant-time compare).
fn owns(key: &Option<String>, request: &TransferRequest, session: &Session) -> bool {
    match key {
        None => true,
        Some(k) => session.check_key_proof(k, request),
    }
}

fn not_owner(request: &TransferRequest, refusals: &mut Vec<Refusal>) -> Reply {
    let id = &request.request_id;
    let (why, refusal) = if request.key_proof.is_some() {
        ("wrong", Refusal::KeyWrong(id.clone()))
    } else {
        ("missing", Refusal::KeyMissing(id.clone()))
    };
    note(refusals, refusal);
    Reply::error(
        id,
        request.load_id,
        format!("request {id:?}: load key {why}; only the consumer the producer's lease names may load it"),
    )
}

/// Keeps `r` for the log, within [`MAX_PENDING_REFUSALS`].
fn note(refusals: &mut Vec<Refusal>, r: Refusal) {
    if refusals.len() < MAX_PENDING_REFUSALS {
        refusals.push(r);
    }
}

impl<P: Clone, T> ProducerMachine<P, T> {
    /// An empty machine; `serve_margin` is the longest a transfer may take (the
    /// shell's transfer timeout): no transfer starts with less left of the consumer's budget.
    pub fn new(timeouts: ProducerTimeouts, serve_margin: Duration) -> Self {
        ProducerMachine {
            timeouts,
            serve_margin,
            entries: HashMap::new(),
            parked: Vec::new(),
            refusals: Vec::new(),
        }
    }

    /// Takes the loads refused since the last call for a wrong or missing load key or an
    /// unknown request (at most [`MAX_PENDING_REFUSALS`]), oldest first: what the producer
    /// should log, since only the consumer hears the reply.
    pub fn take_refusals(&mut self) -> Vec<Refusal> {
        std::mem::take(&mut self.refusals)
    }

    /// Number of leases currently held (published, not yet served or expired).
    pub fn held(&self) -> usize {
        self.entries
            .values()
            .filter(|e| matches!(e, Entry::Held { .. }))
            .count()
    }

    fn consumer_deadline(now: Instant, request: &TransferRequest) -> Option<Instant> {
        (request.budget_ms > 0).then(|| now + Duration::from_millis(request.budget_ms))
    }

    /// `Some(ERROR)` when a transfer started now could outlast the consumer's budget.
    fn too_late(
        &self,
        now: Instant,
        request: &TransferRequest,
        consumer_deadline: Option<Instant>,
    ) -> Option<Reply> {
        let d = consumer_deadline?;
        (now + self.serve_margin > d).then(|| {
            Reply::error(
                &request.request_id,
                request.load_id,
                format!(
                    "the consumer's budget leaves less than the {:?} a transfer may take; not started",
                    self.serve_margin
                ),
            )
        })
    }

    fn serve(
        &mut self,
        now: Instant,
        peer: P,
        request: TransferRequest,
        session: &Session,
        lease: T,
    ) -> Effect<P, T> {
        self.entries.insert(
            request.request_id.clone(),
            Entry::Serving {
                peer: peer.clone(),
                load_id: request.load_id,
                next_beat: now + self.timeouts.heartbeat,
                token: request.token.clone(),
                session_id: session.id(),
            },
        );
        Effect::Serve {
            peer,
            request,
            lease,
            deadline: now + self.serve_margin,
        }
    }

    /// Puts `data` under a lease for `request_id` that any consumer may load; serves a
    /// request already waiting for it. See [`Self::publish_keyed`].
    pub fn publish(
        &mut self,
        now: Instant,
        request_id: &str,
        data: T,
    ) -> Result<Vec<Effect<P, T>>, PublishError> {
        self.publish_keyed(now, request_id, data, None)
    }

    /// Puts `data` under a lease for `request_id` that only a request carrying `key` may load
    /// (`None`: any); serves the first waiting request that carries it; waiting requests
    /// with a missing or wrong key get ERROR.
    pub fn publish_keyed(
        &mut self,
        now: Instant,
        request_id: &str,
        data: T,
        key: Option<String>,
    ) -> Result<Vec<Effect<P, T>>, PublishError> {
        if self.entries.contains_key(request_id) {
            return Err(PublishError::Duplicate(request_id.to_string()));
        }
        let mut effects = Vec::new();
        let (waiting, rest): (Vec<_>, Vec<_>) = self
            .parked
            .drain(..)
            .partition(|p| p.request.request_id == request_id);
        self.parked = rest;
        let mut data = Some(data);
        for w in waiting {
            if data.is_none() {
                let reply = Reply::error(
                    request_id,
                    w.request.load_id,
                    format!("request {request_id:?} {TWICE}"),
                );
                effects.push(Effect::Reply {
                    peer: w.peer,
                    reply,
                });
            } else if !owns(&key, &w.request, &w.session) {
                effects.push(Effect::Reply {
                    peer: w.peer,
                    reply: not_owner(&w.request, &mut self.refusals),
                });
            } else if let Some(reply) = self.too_late(now, &w.request, w.consumer_deadline) {
                effects.push(Effect::Reply {
                    peer: w.peer,
                    reply,
                });
            } else if let Some(d) = data.take() {
                effects.push(self.serve(now, w.peer, w.request, &w.session, d));
            }
        }
        if let Some(data) = data {
            let expires = now + self.timeouts.lease;
            self.entries
                .insert(request_id.to_string(), Entry::Held { data, expires, key });
        }
        Ok(effects)
    }

    /// A consumer's transfer request arrived in `session` (whose proofs the shell checked).
    pub fn on_request(
        &mut self,
        now: Instant,
        peer: P,
        request: TransferRequest,
        session: &Session,
    ) -> Vec<Effect<P, T>> {
        let id = request.request_id.clone();
        let load_id = request.load_id;
        let consumer_deadline = Self::consumer_deadline(now, &request);
        match self.entries.remove(&id) {
            Some(Entry::Held { data, expires, key }) => {
                if !owns(&key, &request, session) {
                    // A stranger: the lease stays, untouched, for its owner.
                    let reply = not_owner(&request, &mut self.refusals);
                    self.entries.insert(id, Entry::Held { data, expires, key });
                    return vec![Effect::Reply { peer, reply }];
                }
                if let Some(reply) = self.too_late(now, &request, consumer_deadline) {
                    // Nothing was written: the lease stays for a consumer with time left.
                    self.entries.insert(id, Entry::Held { data, expires, key });
                    return vec![Effect::Reply { peer, reply }];
                }
                vec![self.serve(now, peer, request, session, data)]
            }
            Some(e @ Entry::Serving { .. }) => {
                self.entries.insert(id.clone(), e);
                let reply = Reply::error(&id, load_id, format!("request {id:?} {TWICE}"));
                vec![Effect::Reply { peer, reply }]
            }
            Some(Entry::Done { why, forget_at }) => {
                let reply = Reply::error(&id, load_id, format!("request {id:?}: {why}"));
                self.entries.insert(id, Entry::Done { why, forget_at });
                vec![Effect::Reply { peer, reply }]
            }
            None => {
                // A keyed request may wait beside others (the key is checked at publish), so
                // that whoever asks first cannot lock the lease's owner out.
                let waiting = self
                    .parked
                    .iter()
                    .filter(|p| p.request.request_id == id)
                    .count();
                if waiting > 0
                    && (request.key_proof.is_none() || waiting >= MAX_WAITING_PER_REQUEST)
                {
                    let reply = Reply::error(&id, load_id, format!("request {id:?} {TWICE}"));
                    return vec![Effect::Reply { peer, reply }];
                }
                let mut deadline = now + self.timeouts.publish_wait;
                if let Some(d) = consumer_deadline {
                    match d.checked_sub(self.serve_margin) {
                        Some(last_start) if last_start > now => deadline = deadline.min(last_start),
                        _ => {
                            let reply = self.too_late(now, &request, consumer_deadline);
                            return reply
                                .map(|reply| Effect::Reply { peer, reply })
                                .into_iter()
                                .collect();
                        }
                    }
                }
                let mut reply = Reply::new(Status::Continue, &id, load_id);
                reply.error = Some(format!(
                    "request {id:?} not published yet; waiting up to {:?}",
                    deadline.saturating_duration_since(now)
                ));
                let next_beat = now + self.timeouts.heartbeat;
                self.parked.push(Parked {
                    peer: peer.clone(),
                    request,
                    session: session.clone(),
                    deadline,
                    consumer_deadline,
                    next_beat,
                });
                vec![Effect::Reply { peer, reply }]
            }
        }
    }

    /// Serving `request_id` ended: `Ok((bytes_written, checksum payload))` or `Err(reason)`.
    pub fn on_served(
        &mut self,
        now: Instant,
        peer: P,
        request_id: &str,
        load_id: u64,
        result: Result<(u64, Option<Vec<u8>>), ServeFailure>,
    ) -> Vec<Effect<P, T>> {
        let forget_at = now + self.timeouts.tombstone;
        let token = match self.entries.get(request_id) {
            Some(Entry::Serving {
                token: Some(t),
                session_id,
                ..
            }) => Some((t.clone(), *session_id)),
            _ => None,
        };
        let (reply, why, reason) = match result {
            Ok((bytes, checksums)) => {
                let mut reply = Reply::new(Status::Finish, request_id, load_id);
                reply.bytes_written = bytes;
                reply.checksums = checksums;
                if let Some((t, sid)) = token {
                    reply.proof = Some(super::msg::finish_proof(&t, &sid, &reply).to_vec());
                }
                (
                    reply,
                    "already loaded (KV is never fetched twice)".to_string(),
                    ReleaseReason::Served,
                )
            }
            Err(e) => (
                Reply::error(request_id, load_id, format!("transfer failed: {e}")),
                format!("an earlier load failed ({e}); KV is never fetched twice"),
                ReleaseReason::Failed(e.to_string()),
            ),
        };
        self.entries
            .insert(request_id.to_string(), Entry::Done { why, forget_at });
        // Released first: the writes are over; the embedder learns it no later than the consumer.
        vec![
            Effect::Released {
                request_id: request_id.to_string(),
                reason,
            },
            Effect::Reply { peer, reply },
        ]
    }

    /// Time passed: expire leases and waits, send heartbeats, forget old ids.
    pub fn on_tick(&mut self, now: Instant) -> Vec<Effect<P, T>> {
        let mut effects = Vec::new();
        let beat = self.timeouts.heartbeat;
        let mut expired = Vec::new();
        for (id, e) in self.entries.iter_mut() {
            match e {
                Entry::Held { expires, .. } if *expires <= now => expired.push(id.clone()),
                Entry::Serving {
                    peer,
                    load_id,
                    next_beat,
                    ..
                } if *next_beat <= now => {
                    *next_beat = now + beat;
                    effects.push(Effect::Reply {
                        peer: peer.clone(),
                        reply: Reply::new(Status::Continue, id, *load_id),
                    });
                }
                _ => {}
            }
        }
        expired.sort();
        for id in expired {
            self.entries.insert(
                id.clone(),
                Entry::Done {
                    why: format!(
                        "lease expired after {:?}; its blocks were freed",
                        self.timeouts.lease
                    ),
                    forget_at: now + self.timeouts.tombstone,
                },
            );
            effects.push(Effect::Released {
                request_id: id,
                reason: ReleaseReason::Expired,
            });
        }
        self.entries
            .retain(|_, e| !matches!(e, Entry::Done { forget_at, .. } if *forget_at <= now));
        let (late, keep): (Vec<_>, Vec<_>) = self.parked.drain(..).partition(|p| p.deadline <= now);
        self.parked = keep;
        for p in late {
            let id = p.request.request_id;
            note(&mut self.refusals, Refusal::NotPublished(id.clone()));
            let reply = Reply::error(
                &id,
                p.request.load_id,
                format!("request {id:?} was not published in time (publish wait {:?} or the consumer's budget)", self.timeouts.publish_wait),
            );
            effects.push(Effect::Reply {
                peer: p.peer,
                reply,
            });
        }
        for p in self.parked.iter_mut().filter(|p| p.next_beat <= now) {
            p.next_beat = now + beat;
            effects.push(Effect::Reply {
                peer: p.peer.clone(),
                reply: Reply::new(Status::Continue, &p.request.request_id, p.request.load_id),
            });
        }
        effects
    }

    /// The earliest time at which [`Self::on_tick`] has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        let entries = self.entries.values().map(|e| match e {
            Entry::Held { expires, .. } => *expires,
            Entry::Done { forget_at, .. } => *forget_at,
            Entry::Serving { next_beat, .. } => *next_beat,
        });
        entries
            .chain(self.parked.iter().map(|p| p.deadline.min(p.next_beat)))
            .min()
    }
}
