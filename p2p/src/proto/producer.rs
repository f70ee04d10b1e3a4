//! The producer's protocol state machine (DESIGN.md §4), without sockets or clocks:
//! the shell feeds it events with the current time and carries out the effects.
//!
//! * `publish` puts a request's blocks under a lease; a lease whose consumer never
//!   comes expires and its blocks are released.
//! * A transfer request for a held lease is served exactly once (KV is never
//!   fetched twice); a second request, or one for an expired lease, gets ERROR.
//! * A request that arrives before its publish waits (bounded by `publish_wait`);
//!   the consumer gets CONTINUE meanwhile and ERROR when the wait runs out.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::msg::{Reply, Status, TransferRequest};

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
}

impl Default for ProducerTimeouts {
    fn default() -> Self {
        ProducerTimeouts {
            lease: Duration::from_secs(120),
            publish_wait: Duration::from_secs(30),
            tombstone: Duration::from_secs(600),
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
    /// Write the blocks of `lease` as `request` asks, then call [`ProducerMachine::on_served`].
    Serve {
        /// The consumer connection.
        peer: P,
        /// The consumer's request.
        request: TransferRequest,
        /// The published data, moved out of the lease (it is served once).
        lease: T,
    },
    /// The blocks of `request_id` may be reused by the embedder.
    Released {
        /// The request.
        request_id: String,
        /// Why.
        reason: ReleaseReason,
    },
}

/// Errors of [`ProducerMachine::publish`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    /// The request id is already published, being served, or finished recently.
    #[error("request {0:?} was already published")]
    Duplicate(String),
}

enum Entry<T> {
    Held { data: T, expires: Instant },
    Serving,
    Done { why: String, forget_at: Instant },
}

struct Parked<P> {
    peer: P,
    request: TransferRequest,
    deadline: Instant,
}

/// The producer's state: leases, requests waiting for their publish, finished ids.
pub struct ProducerMachine<P, T> {
    timeouts: ProducerTimeouts,
    entries: HashMap<String, Entry<T>>,
    parked: Vec<Parked<P>>,
}

impl<P: Clone, T> ProducerMachine<P, T> {
    /// An empty machine.
    pub fn new(timeouts: ProducerTimeouts) -> Self {
        ProducerMachine {
            timeouts,
            entries: HashMap::new(),
            parked: Vec::new(),
        }
    }

    /// Number of leases currently held (published, not yet served or expired).
    pub fn held(&self) -> usize {
        self.entries
            .values()
            .filter(|e| matches!(e, Entry::Held { .. }))
            .count()
    }

    /// Puts `data` under a lease for `request_id`; serves a request already waiting for it.
    pub fn publish(
        &mut self,
        now: Instant,
        request_id: &str,
        data: T,
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
        let mut waiting = waiting.into_iter();
        match waiting.next() {
            Some(first) => {
                self.entries.insert(request_id.to_string(), Entry::Serving);
                effects.push(Effect::Serve {
                    peer: first.peer,
                    request: first.request,
                    lease: data,
                });
            }
            None => {
                let expires = now + self.timeouts.lease;
                self.entries
                    .insert(request_id.to_string(), Entry::Held { data, expires });
            }
        }
        for other in waiting {
            effects.push(Effect::Reply {
                peer: other.peer,
                reply: Reply::error(
                    request_id,
                    other.request.load_id,
                    format!("request {request_id:?} is already being loaded by another transfer request"),
                ),
            });
        }
        Ok(effects)
    }

    /// A consumer's transfer request arrived.
    pub fn on_request(
        &mut self,
        now: Instant,
        peer: P,
        request: TransferRequest,
    ) -> Vec<Effect<P, T>> {
        let id = request.request_id.clone();
        let load_id = request.load_id;
        match self.entries.remove(&id) {
            Some(Entry::Held { data, .. }) => {
                self.entries.insert(id, Entry::Serving);
                vec![Effect::Serve {
                    peer,
                    request,
                    lease: data,
                }]
            }
            Some(Entry::Serving) => {
                self.entries.insert(id.clone(), Entry::Serving);
                vec![Effect::Reply {
                    peer,
                    reply: Reply::error(
                        &id,
                        load_id,
                        format!(
                            "request {id:?} is already being loaded (KV is never fetched twice)"
                        ),
                    ),
                }]
            }
            Some(Entry::Done { why, forget_at }) => {
                let reply = Reply::error(&id, load_id, format!("request {id:?}: {why}"));
                self.entries.insert(id, Entry::Done { why, forget_at });
                vec![Effect::Reply { peer, reply }]
            }
            None => {
                if self.parked.iter().any(|p| p.request.request_id == id) {
                    return vec![Effect::Reply {
                        peer,
                        reply: Reply::error(&id, load_id, format!("request {id:?} is already being loaded (KV is never fetched twice)")),
                    }];
                }
                let deadline = now + self.timeouts.publish_wait;
                let mut reply = Reply::new(Status::Continue, &id, load_id);
                reply.error = Some(format!(
                    "request {id:?} not published yet; waiting up to {:?}",
                    self.timeouts.publish_wait
                ));
                self.parked.push(Parked {
                    peer: peer.clone(),
                    request,
                    deadline,
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
        result: Result<(u64, Option<Vec<u8>>), String>,
    ) -> Vec<Effect<P, T>> {
        let forget_at = now + self.timeouts.tombstone;
        let (reply, why, reason) = match result {
            Ok((bytes, checksums)) => {
                let mut reply = Reply::new(Status::Finish, request_id, load_id);
                reply.bytes_written = bytes;
                reply.checksums = checksums;
                (
                    reply,
                    "already loaded (KV is never fetched twice)".to_string(),
                    ReleaseReason::Served,
                )
            }
            Err(e) => (
                Reply::error(request_id, load_id, format!("transfer failed: {e}")),
                format!("an earlier load failed ({e}); KV is never fetched twice"),
                ReleaseReason::Failed(e),
            ),
        };
        self.entries
            .insert(request_id.to_string(), Entry::Done { why, forget_at });
        vec![
            Effect::Reply { peer, reply },
            Effect::Released {
                request_id: request_id.to_string(),
                reason,
            },
        ]
    }

    /// Time passed: expire leases and waits, forget old ids.
    pub fn on_tick(&mut self, now: Instant) -> Vec<Effect<P, T>> {
        let mut effects = Vec::new();
        let expired: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| matches!(e, Entry::Held { expires, .. } if *expires <= now))
            .map(|(k, _)| k.clone())
            .collect();
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
            effects.push(Effect::Reply {
                reply: Reply::error(
                    &id,
                    p.request.load_id,
                    format!(
                        "request {id:?} was not published within {:?}",
                        self.timeouts.publish_wait
                    ),
                ),
                peer: p.peer,
            });
        }
        effects
    }

    /// The earliest time at which [`Self::on_tick`] has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        let leases = self.entries.values().filter_map(|e| match e {
            Entry::Held { expires, .. } => Some(*expires),
            Entry::Done { forget_at, .. } => Some(*forget_at),
            Entry::Serving => None,
        });
        leases.chain(self.parked.iter().map(|p| p.deadline)).min()
    }
}
