//! The producer's side of the control channel's sessions (docs/design.md §8.1,
//! [`super::session`]), without sockets: the table of open sessions by peer, the answer to a
//! `hello`, the admission of a request into its peer's session, and the ids salvaged from a
//! message that does not decode (so that the consumer hears why at once).

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Instant;

use kvferry_transfer::{Secret, Shared, TransferError};

use super::msg::{Hello, LoadRequest, Welcome, KIND_WELCOME, MAX_MESSAGE_BYTES, PROTOCOL_VERSION};
use super::session::{names_producer, Session, NONCE_BYTES};

/// Default most control-channel sessions a producer holds (one per consumer connection); past
/// it, the oldest goes (its consumer's next request is answered `no_session`, and it says hello
/// again on a new connection).
pub const MAX_SESSIONS: usize = 4096;

/// Fresh random nonces for `welcome`s; `Err` (why, told to the consumer) when none can be had.
pub type NonceSource = Box<dyn FnMut() -> Result<[u8; NONCE_BYTES], TransferError> + Send>;

/// The OS's randomness ([`kvferry_transfer::auth::random_bytes`]).
pub fn os_nonces() -> NonceSource {
    Box::new(kvferry_transfer::auth::random_bytes::<NONCE_BYTES>)
}

/// Why a `hello` or a request was refused its session: the consumer is told the `Display`
/// text (in the welcome's `error`, or an ERROR reply), and the producer logs it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionRefusal {
    /// A `hello` on a connection that has a session already.
    #[error("a session is already open on this connection")]
    AlreadyOpen,
    /// With a secret: the `hello` names another producer than this one (a relay, or a
    /// consumer configured for another endpoint).
    #[error("the hello names {named:?}, this producer is {this}")]
    OtherProducer {
        /// The endpoint the `hello` names (the consumer's words, as decoded: bounded by
        /// `MAX_NAME_BYTES`).
        named: String,
        /// This producer's endpoint.
        this: String,
    },
    /// No nonce could be drawn for the session.
    #[error("{0}")]
    NoNonce(#[source] NonceError),
    /// A request on a connection without a session (never said hello, or evicted).
    #[error("no session on this connection: send hello first")]
    NoSession,
    /// With a secret: the request does not prove it over its session.
    #[error("the request does not prove the shared secret over this session")]
    Unproven,
    /// A request whose load id is not above the last one of its session (a replay).
    #[error("load id {0} was already used in this session (replayed request)")]
    Replayed(u64),
}

/// Why no nonce could be drawn (the engine's error for the OS's randomness), shared; equality
/// is [`Shared`]'s (the same error, or the same text: the engine's errors have no equality of
/// their own).
pub type NonceError = Shared<TransferError>;

struct PeerSession {
    session: Session,
    opened: Instant,
    /// The highest load id served a request in this session: a request must name a higher
    /// one (a replay within the session is refused).
    last_load_id: Option<u64>,
}

/// The sessions a producer holds, by peer (a ROUTER identity in the shell).
pub struct Sessions<P> {
    /// The workers' shared secret: consumers must prove it (authenticated mode).
    secret: Option<Secret>,
    /// The bound endpoint and the configured one: what a `hello` may name.
    endpoint: String,
    bind: String,
    nonces: NonceSource,
    open: HashMap<P, PeerSession>,
    /// Most sessions held at once (at least 1).
    max: usize,
}

impl<P: Clone + Eq + Hash> Sessions<P> {
    /// No session open; `secret`: authenticated mode; `endpoint` / `bind`: the producer's
    /// bound and configured endpoints (with a secret, a `hello` must name one of them,
    /// [`names_producer`]).
    pub fn new(secret: Option<Secret>, endpoint: &str, bind: &str, nonces: NonceSource) -> Self {
        Sessions {
            secret,
            endpoint: endpoint.to_string(),
            bind: bind.to_string(),
            nonces,
            open: HashMap::new(),
            max: MAX_SESSIONS,
        }
    }

    /// Holds at most `max` sessions (at least 1).
    pub fn set_max(&mut self, max: usize) {
        self.max = max.max(1);
    }

    /// Whether `peer` has a session open.
    pub fn contains(&self, peer: &P) -> bool {
        self.open.contains_key(peer)
    }

    /// The id (`Session::id`) of `peer`'s open session, if any.
    pub fn id_of(&self, peer: &P) -> Option<[u8; 32]> {
        self.open.get(peer).map(|s| s.session.id())
    }

    /// Open sessions.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// Whether no session is open.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Opens a session for `peer`, or says why not (in the welcome's `error`, and as the
    /// third value). At most [`Self::set_max`] sessions: the oldest goes to make room, and is
    /// returned (its session ended).
    pub fn hello(
        &mut self,
        now: Instant,
        peer: &P,
        hello: Hello,
    ) -> (Welcome, Option<P>, Option<SessionRefusal>) {
        let mut w = Welcome {
            version: PROTOCOL_VERSION,
            kind: KIND_WELCOME.to_string(),
            nonce: Vec::new(),
            proof: None,
            error: None,
            reads: false,
        };
        let mut refused = None;
        if self.open.contains_key(peer) {
            refused = Some(SessionRefusal::AlreadyOpen);
        } else if self.secret.is_some()
            && !names_producer(&hello.producer, &self.endpoint, &self.bind)
        {
            refused = Some(SessionRefusal::OtherProducer {
                named: hello.producer.clone(),
                this: self.endpoint.clone(),
            });
        }
        let nonce = match (self.nonces)() {
            Ok(n) => n,
            Err(e) => {
                refused = refused.or(Some(SessionRefusal::NoNonce(Shared::new(e))));
                [0; NONCE_BYTES]
            }
        };
        if let Some(why) = refused {
            w.error = Some(why.to_string());
            return (w, None, Some(why));
        }
        let session = Session {
            consumer_nonce: hello
                .nonce
                .as_slice()
                .try_into()
                .unwrap_or([0; NONCE_BYTES]),
            producer_nonce: nonce,
            producer: hello.producer,
            consumer: hello.consumer,
        };
        w.nonce = nonce.to_vec();
        w.proof = self
            .secret
            .as_ref()
            .map(|s| session.producer_proof(s).to_vec());
        let mut evicted = None;
        if self.open.len() >= self.max {
            evicted = self
                .open
                .iter()
                .min_by_key(|(_, s)| s.opened)
                .map(|(k, _)| k.clone());
            if let Some(k) = &evicted {
                self.open.remove(k);
            }
        }
        self.open.insert(
            peer.clone(),
            PeerSession {
                session,
                opened: now,
                last_load_id: None,
            },
        );
        (w, evicted, None)
    }

    /// The session a request of `peer` may act in: one is open, the request proves the secret
    /// over it (authenticated mode), and its load id was not used in it before. `Err`: why not.
    pub fn admit(&mut self, peer: &P, req: &LoadRequest) -> Result<Session, SessionRefusal> {
        let Some(s) = self.open.get_mut(peer) else {
            return Err(SessionRefusal::NoSession);
        };
        if let Some(secret) = &self.secret {
            if !s.session.check_request_proof(secret, req) {
                return Err(SessionRefusal::Unproven);
            }
        }
        if s.last_load_id.is_some_and(|last| req.load_id <= last) {
            return Err(SessionRefusal::Replayed(req.load_id));
        }
        s.last_load_id = Some(req.load_id);
        Ok(s.session.clone())
    }

    /// `peer`'s connection closed: its session ends.
    pub fn close(&mut self, peer: &P) {
        self.open.remove(peer);
    }
}

#[derive(serde::Deserialize, Default)]
struct Ids {
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    load_id: Option<u64>,
}

/// The request and load ids of a consumer message that did not decode, as far as they can be
/// read (a msgpack map with those fields; nothing from a message over [`MAX_MESSAGE_BYTES`]):
/// what an ERROR answering it can name, so that the consumer's load fails at once with the
/// reason instead of waiting for its deadline.
pub fn salvage_ids(body: &[u8]) -> (Option<String>, Option<u64>) {
    let ids: Ids = if body.len() <= MAX_MESSAGE_BYTES {
        super::msg_header::from_msgpack(body).unwrap_or_default()
    } else {
        Ids::default()
    };
    (ids.request_id, ids.load_id)
}
