//! The producer's protocol state machine (docs/design.md §4), without sockets or clocks.
//!
//! One taxonomy, as the consumer's machine and quinn-proto's `Connection`: the shell feeds
//! inputs through `handle_*` with the current time (a consumer's message, a closed connection,
//! a publish, a finished serve, time passing) and drains the effects with
//! [`ProducerMachine::poll`], calling [`ProducerMachine::handle_timeout`] at
//! [`ProducerMachine::poll_timeout`].
//!
//! * Sessions ([`super::sessions`]): a `hello` opens one per connection; a request is acted on
//!   only in its connection's session (proofs checked, no replayed load id); a message that does
//!   not decode is answered with ERROR under the ids it names, where they can be read.
//! * `publish` puts a request's blocks under a lease; a lease whose consumer never
//!   comes expires and its blocks are released.
//! * A transfer request for a held lease is served exactly once (KV is never
//!   fetched twice); a second request, or one for an expired lease, gets ERROR.
//! * A request the serve refuses before writing anything (one that does not fit the lease:
//!   another model, other block tables; a grant token that does not parse) gets ERROR and the
//!   lease goes back under its first deadline, for a consumer whose request fits: one
//!   consumer's mistake does not end a request another could still load, and no refusal
//!   holds it past the lease it was published with.
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

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

use kvferry_transfer::{Secret, Shared};

use super::msg::{
    decode_consumer_message, ConsumerMessage, ErrorReason, LayerSpan, LoadRequest, Reply, Status,
};
use super::msg_read::WireProducerLayout;
use super::peer_segments::PeerSegments;
use super::producer_effects::{not_owner, owns, ServedLoad};
pub use super::producer_effects::{
    Effect, ProducerTimeouts, PublishError, Refusal, ReleaseReason, Warning,
};
use super::serve_error::ServeFailure;
use super::session::Session;
use super::sessions::{os_nonces, salvage_ids, NonceSource, Sessions};

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
        /// The lease's load key, until it is released.
        key: Option<String>,
        /// When the lease expires, should the serve refuse the request and give it back.
        expires: Instant,
        next_beat: Instant,
        /// The load's grant token: the FINISH proves it (`msg::finish_proof`).
        token: Option<String>,
        /// The id of the session the request came in (bound into the FINISH proof).
        session_id: [u8; 32],
        /// The consumer segments the load writes to (held open until it ends).
        segments: Vec<String>,
        /// The consumer reads the blocks itself (docs/design.md §4.10).
        read: bool,
        /// The FINISH carries the producer's layout.
        want_layout: bool,
        /// A read load whose FINISH went out: its lease ends at the consumer's `read_done`,
        /// or at this time.
        read_until: Option<Instant>,
        /// The consumer's budget for the load (it reads within it), at most the lease's time.
        read_hold: Option<Instant>,
    },
    /// The lease ended (served, failed or expired); a request for it again is answered from
    /// `reason` (`ProducerMachine::ended_text`).
    Done {
        reason: ReleaseReason,
        forget_at: Instant,
    },
}

struct Parked<P> {
    peer: P,
    request: LoadRequest,
    /// The session the request came in (its key proof is checked at publish).
    session: Session,
    /// When waiting for the publish stops (publish wait, or the consumer's budget).
    deadline: Instant,
    /// The consumer's own deadline, if it sent a budget.
    consumer_deadline: Option<Instant>,
    next_beat: Instant,
}

/// The producer's state: sessions, leases, requests waiting for their publish, finished ids.
pub struct ProducerMachine<P, T> {
    timeouts: ProducerTimeouts,
    serve_margin: Duration,
    entries: HashMap<String, Entry<P, T>>,
    parked: Vec<Parked<P>>,
    sessions: Sessions<P>,
    /// Effects not yet polled.
    effects: VecDeque<Effect<P, T>>,
    /// The consumer segments each session and each load in flight hold.
    segments: PeerSegments<P>,
    /// The producer's ranks, sent in a FINISH to a request that asks (`want_layout`).
    layout: WireProducerLayout,
    /// `layout`'s digest, which a request to read must name.
    layout_digest: [u8; 32],
}

#[path = "producer_read.rs"]
mod read;
#[path = "producer_time.rs"]
mod time;

const TWICE: &str = "is already being loaded (KV is never fetched twice)";

/// Most requests with load keys that may wait for one request id's publish.
pub const MAX_WAITING_PER_REQUEST: usize = 8;

impl<P: Clone + Eq + Hash, T> ProducerMachine<P, T> {
    /// An empty machine in open mode (no secret); `serve_margin` is the longest a transfer may
    /// take (the shell's transfer timeout): no transfer starts with less left of the
    /// consumer's budget.
    pub fn new(timeouts: ProducerTimeouts, serve_margin: Duration) -> Self {
        ProducerMachine {
            timeouts,
            serve_margin,
            entries: HashMap::new(),
            parked: Vec::new(),
            sessions: Sessions::new(None, "", "", os_nonces()),
            effects: VecDeque::new(),
            segments: PeerSegments::default(),
            layout: Vec::new(),
            layout_digest: [0; 32],
        }
    }

    /// The producer's ranks (`msg_read::layout_to_wire`), sent in the FINISH of a request
    /// that asks for them so that its consumer may read later loads itself (docs/design.md
    /// §4.10). Without it (empty), no layout is sent and consumers never read.
    pub fn with_layout(mut self, layout: WireProducerLayout) -> Self {
        self.layout_digest = super::msg_read::layout_digest(&layout);
        self.layout = layout;
        self
    }

    /// Holds at most `max` sessions (at least 1; default [`super::sessions::MAX_SESSIONS`]): past it the oldest
    /// goes, and its consumer's next request is answered `no_session`.
    pub fn with_max_sessions(mut self, max: usize) -> Self {
        self.sessions.set_max(max);
        self
    }

    /// The control channel's settings: `secret` (authenticated mode: consumers must prove
    /// it), the producer's bound `endpoint` and configured `bind` (what a `hello` may name),
    /// and where the `welcome` nonces come from.
    pub fn with_control(
        mut self,
        secret: Option<Secret>,
        endpoint: &str,
        bind: &str,
        nonces: NonceSource,
    ) -> Self {
        self.sessions = Sessions::new(secret, endpoint, bind, nonces);
        self
    }

    /// The next effect to carry out, in the order they arose.
    pub fn poll_effect(&mut self) -> Option<Effect<P, T>> {
        self.effects.pop_front()
    }

    /// The load key of `request_id`'s lease while it is held or being served (`None` once
    /// released, never published, or published without a key).
    pub fn load_key(&self, request_id: &str) -> Option<&str> {
        match self.entries.get(request_id)? {
            Entry::Held { key, .. } | Entry::Serving { key, .. } => key.as_deref(),
            Entry::Done { .. } => None,
        }
    }

    /// A message from `peer` arrived: a `hello` (answered with a welcome), a request (acted on
    /// in `peer`'s session), or something that does not decode (ERROR under the ids it names).
    pub fn handle_message(&mut self, now: Instant, peer: P, body: &[u8]) {
        match decode_consumer_message(body) {
            Ok(ConsumerMessage::Hello(hello)) => {
                let (mut welcome, evicted, refused) = self.sessions.hello(now, &peer, hello);
                welcome.reads = welcome.error.is_none() && !self.layout.is_empty();
                if let Some(why) = refused {
                    self.effects.push_back(Effect::Warn(Warning::Refused(why)));
                }
                if let Some(old) = evicted {
                    self.session_ended(&old);
                }
                self.effects.push_back(Effect::Welcome { peer, welcome });
            }
            Ok(ConsumerMessage::ReadDone(done)) => {
                self.handle_read_done(now, &peer, &done.request_id, done.load_id)
            }
            Ok(ConsumerMessage::Request(req)) => match self.sessions.admit(&peer, &req) {
                Ok(session) => {
                    self.segments.add_request(&peer, &req);
                    self.handle_request(now, peer, req, &session)
                }
                Err(why) => {
                    self.effects
                        .push_back(Effect::Warn(Warning::Refused(why.clone())));
                    let mut reply = Reply::error(&req.request_id, req.load_id, why.to_string());
                    // Evicted (or never said hello): the consumer says hello again and may
                    // send the request again, since nothing was served.
                    reply.no_session = !self.sessions.contains(&peer);
                    self.effects.push_back(Effect::Reply { peer, reply });
                }
            },
            Err(error) => {
                let (request_id, load_id) = salvage_ids(body);
                let reply = Reply::error(
                    request_id.as_deref().unwrap_or(""),
                    load_id.unwrap_or(0),
                    format!("bad transfer request: {error}"),
                );
                self.effects
                    .push_back(Effect::Warn(Warning::BadRequest { request_id, error }));
                self.effects.push_back(Effect::Reply { peer, reply });
            }
        }
    }

    /// `peer`'s connection closed: its session ends.
    pub fn handle_disconnected(&mut self, peer: &P) {
        self.sessions.close(peer);
        self.session_ended(peer);
    }

    /// `peer`'s session ended (closed or evicted): its consumer's data connections go once no
    /// load to them is in flight ([`Effect::CloseSegments`]).
    fn session_ended(&mut self, peer: &P) {
        let unheld = self.segments.session_ended(peer);
        self.close_segments(unheld);
    }

    fn close_segments(&mut self, segments: Vec<String>) {
        if !segments.is_empty() {
            self.effects.push_back(Effect::CloseSegments { segments });
        }
    }

    /// Open sessions.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Number of leases currently held (published, not yet served or expired).
    pub fn held(&self) -> usize {
        self.entries
            .values()
            .filter(|e| matches!(e, Entry::Held { .. }))
            .count()
    }

    fn consumer_deadline(now: Instant, request: &LoadRequest) -> Option<Instant> {
        (request.budget_ms > 0).then(|| now + Duration::from_millis(request.budget_ms))
    }

    /// Why a request for a lease that ended as `reason` is refused (the ERROR reply's text).
    fn ended_text(&self, reason: &ReleaseReason) -> String {
        match reason {
            ReleaseReason::Served => "already loaded (KV is never fetched twice)".to_string(),
            ReleaseReason::Failed(e) => {
                format!("an earlier load failed ({e}); KV is never fetched twice")
            }
            ReleaseReason::Expired => format!(
                "lease expired after {:?}; its blocks were freed",
                self.timeouts.lease
            ),
        }
    }

    /// `Some(ERROR)` when a transfer started now could outlast the consumer's budget.
    fn too_late(
        &self,
        now: Instant,
        request: &LoadRequest,
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

    /// Serves `lease` (held until `expires`) to `request`.
    #[allow(clippy::too_many_arguments)] // the lease's parts, each kept for a refusal
    fn serve(
        &mut self,
        now: Instant,
        peer: P,
        request: LoadRequest,
        session: &Session,
        lease: T,
        key: Option<String>,
        expires: Instant,
    ) -> Effect<P, T> {
        self.entries.insert(
            request.request_id.clone(),
            Entry::Serving {
                peer: peer.clone(),
                load_id: request.load_id,
                key,
                expires,
                next_beat: now + self.timeouts.heartbeat,
                token: request.token.clone(),
                session_id: session.id(),
                segments: self.segments.serve_started(&request),
                read: request.read,
                want_layout: request.want_layout,
                read_until: None,
                read_hold: Self::consumer_deadline(now, &request)
                    .map(|d| d.min(now + self.timeouts.lease)),
            },
        );
        Effect::Serve {
            peer,
            request,
            lease,
            deadline: now + self.serve_margin,
        }
    }

    /// Puts `data` under a lease for `request_id` that only a request carrying `key` may load
    /// (`None`: any); serves the first waiting request that carries it; waiting requests
    /// with a missing or wrong key get ERROR.
    pub fn handle_publish(
        &mut self,
        now: Instant,
        request_id: &str,
        data: T,
        key: Option<String>,
    ) -> Result<(), PublishError> {
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
                effects.extend(not_owner(w.peer, &w.request));
            } else if let Some(reply) = self.too_late(now, &w.request, w.consumer_deadline) {
                effects.push(Effect::Reply {
                    peer: w.peer,
                    reply,
                });
            } else if let Some(d) = data.take() {
                // The heartbeat keeps the waiting request's cadence: its consumer heard the
                // last CONTINUE up to a heartbeat ago, so restarting the interval at the
                // publish would leave it silent for up to two.
                let beat = w.next_beat;
                let expires = now + self.timeouts.lease;
                effects.push(self.serve(
                    now,
                    w.peer,
                    w.request,
                    &w.session,
                    d,
                    key.clone(),
                    expires,
                ));
                if let Some(Entry::Serving { next_beat, .. }) = self.entries.get_mut(request_id) {
                    *next_beat = beat;
                }
            }
        }
        if let Some(data) = data {
            let expires = now + self.timeouts.lease;
            self.entries
                .insert(request_id.to_string(), Entry::Held { data, expires, key });
        }
        self.effects.extend(effects);
        Ok(())
    }

    /// A consumer's transfer request arrived in `session`, its proofs checked
    /// ([`Self::handle_message`] does both for a message off the socket).
    pub fn handle_request(
        &mut self,
        now: Instant,
        peer: P,
        request: LoadRequest,
        session: &Session,
    ) {
        let effects = self.request(now, peer, request, session);
        self.effects.extend(effects);
    }

    fn request(
        &mut self,
        now: Instant,
        peer: P,
        request: LoadRequest,
        session: &Session,
    ) -> Vec<Effect<P, T>> {
        let id = request.request_id.clone();
        let load_id = request.load_id;
        if let Some(reply) = self.stale_layout(&request) {
            return vec![Effect::Reply { peer, reply }];
        }
        let consumer_deadline = Self::consumer_deadline(now, &request);
        match self.entries.remove(&id) {
            Some(Entry::Held { data, expires, key }) => {
                if !owns(&key, &request, session) {
                    // A stranger: the lease stays, untouched, for its owner.
                    let effects = not_owner(peer, &request);
                    self.entries.insert(id, Entry::Held { data, expires, key });
                    return effects.into();
                }
                if let Some(reply) = self.too_late(now, &request, consumer_deadline) {
                    // Nothing was written: the lease stays for a consumer with time left.
                    self.entries.insert(id, Entry::Held { data, expires, key });
                    return vec![Effect::Reply { peer, reply }];
                }
                vec![self.serve(now, peer, request, session, data, key, expires)]
            }
            Some(e @ Entry::Serving { .. }) => {
                self.entries.insert(id.clone(), e);
                let reply = Reply::error(&id, load_id, format!("request {id:?} {TWICE}"));
                vec![Effect::Reply { peer, reply }]
            }
            Some(Entry::Done { reason, forget_at }) => {
                let why = self.ended_text(&reason);
                let reply = Reply::error(&id, load_id, format!("request {id:?}: {why}"));
                self.entries.insert(id, Entry::Done { reason, forget_at });
                vec![Effect::Reply { peer, reply }]
            }
            None if request.read => {
                // Reads made before the publish could predate the KV: by WRITE, it may wait.
                vec![Effect::Reply {
                    peer,
                    reply: Self::read_refused(
                        &request,
                        ErrorReason::ReadEarly,
                        "not published yet",
                    ),
                }]
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
                            // No time left to wait: refused, never left unanswered (a transfer
                            // could start now, exactly at the edge, but there is nothing yet).
                            let reply = self.too_late(now, &request, consumer_deadline)
                                .unwrap_or_else(|| Reply::error(&id, load_id, format!(
                                    "request {id:?} not published yet, and the consumer's budget leaves no time to wait for it"
                                )));
                            return vec![Effect::Reply { peer, reply }];
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
    pub fn handle_served(
        &mut self,
        now: Instant,
        peer: P,
        request_id: &str,
        load_id: u64,
        result: Result<ServedLoad, ServeFailure>,
    ) {
        let forget_at = now + self.timeouts.tombstone;
        let (token, segments, read, want_layout) = match self.entries.get_mut(request_id) {
            Some(Entry::Serving {
                token,
                session_id,
                segments,
                read,
                want_layout,
                ..
            }) => (
                token.clone().map(|t| (t, *session_id)),
                std::mem::take(segments),
                *read,
                *want_layout,
            ),
            _ => (None, Vec::new(), false, false),
        };
        let (reply, reason) = match result {
            Ok((bytes, checksums, path)) => {
                let mut reply = Reply::new(Status::Finish, request_id, load_id);
                reply.bytes_written = bytes;
                reply.checksums = checksums;
                reply.path = path;
                if want_layout {
                    reply.layout = self.layout.clone();
                }
                if let Some((t, sid)) = token {
                    reply.proof = Some(super::msg::finish_proof(&t, &sid, &reply).to_vec());
                }
                (reply, ReleaseReason::Served)
            }
            Err(e) => {
                let mut reply = Reply::error(request_id, load_id, format!("transfer failed: {e}"));
                reply.reason = e.reason();
                (reply, ReleaseReason::Failed(Shared::new(e)))
            }
        };
        if read && reason == ReleaseReason::Served {
            // The consumer reads now: the lease holds until it says so, or the margin ends.
            if let Some(Entry::Serving {
                read_until,
                read_hold,
                ..
            }) = self.entries.get_mut(request_id)
            {
                // At least the serve margin; as long as the consumer may still read (its
                // budget), within the lease's time.
                let margin = now + self.serve_margin;
                *read_until = Some(read_hold.map_or(margin, |h| h.max(margin)));
            }
            self.effects.push_back(Effect::Reply { peer, reply });
            return;
        }
        self.entries.insert(
            request_id.to_string(),
            Entry::Done {
                reason: reason.clone(),
                forget_at,
            },
        );
        // Released first: the writes are over; the embedder learns it no later than the consumer.
        self.effects.push_back(Effect::Released {
            request_id: request_id.to_string(),
            reason,
        });
        self.effects.push_back(Effect::Reply { peer, reply });
        let unheld = self.segments.serve_ended(segments);
        self.close_segments(unheld);
    }

    /// The copies of layers `landed` of the load `load_id` of `request_id` being served have
    /// completed (`proto::progress`): its consumer gets a CONTINUE naming them, which also
    /// counts as the heartbeat. Nothing happens for a load not being served (it ended).
    pub fn handle_progress(
        &mut self,
        now: Instant,
        request_id: &str,
        load_id: u64,
        landed: LayerSpan,
    ) {
        if let Some(Entry::Serving {
            peer,
            load_id: serving,
            next_beat,
            ..
        }) = self.entries.get_mut(request_id)
        {
            if *serving == load_id {
                *next_beat = now + self.timeouts.heartbeat;
                let mut reply = Reply::new(Status::Continue, request_id, load_id);
                reply.landed = Some(landed);
                let peer = peer.clone();
                self.effects.push_back(Effect::Reply { peer, reply });
            }
        }
    }

    /// Serving `request_id` was refused before anything was written (`why`: the request does
    /// not fit the lease or the ranks, or its grant token does not parse), and `lease` comes
    /// back untouched: the consumer gets ERROR, and the lease is held again under its key and
    /// its first deadline (expiring then as if never asked), for a consumer whose request fits.
    /// Nothing is released.
    pub fn handle_refused(
        &mut self,
        now: Instant,
        peer: P,
        request_id: &str,
        load_id: u64,
        why: ServeFailure,
        lease: T,
    ) {
        let mut reply = Reply::error(
            request_id,
            load_id,
            format!("request refused, nothing written (the lease stays for a request that fits it): {why}"),
        );
        reply.reason = why.reason();
        let mut unheld = Vec::new();
        match self.entries.remove(request_id) {
            Some(Entry::Serving {
                key,
                expires,
                segments,
                ..
            }) => {
                unheld = self.segments.serve_ended(segments);
                // Refused after its deadline: it ends as it would have, unasked.
                let entry = if expires <= now {
                    self.effects.push_back(Effect::Released {
                        request_id: request_id.to_string(),
                        reason: ReleaseReason::Expired,
                    });
                    Entry::Done {
                        reason: ReleaseReason::Expired,
                        forget_at: now + self.timeouts.tombstone,
                    }
                } else {
                    Entry::Held {
                        data: lease,
                        expires,
                        key,
                    }
                };
                self.entries.insert(request_id.to_string(), entry);
            }
            Some(other) => {
                self.entries.insert(request_id.to_string(), other);
            }
            None => {}
        }
        self.effects.push_back(Effect::Reply { peer, reply });
        self.close_segments(unheld);
    }
}
