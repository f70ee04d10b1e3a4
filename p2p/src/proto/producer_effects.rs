//! The producer machine's outputs and settings ([`super::producer`]): its timeouts, the
//! effects the shell carries out, the warnings it logs, why a lease was released and why a
//! publish or a load was refused.

use std::time::{Duration, Instant};

use kvferry_transfer::{Shared, TransferPath};

use super::msg::{LoadRequest, MsgError, Reply, Welcome};
use super::serve_error::ServeFailure;
use super::session::Session;
use super::sessions::SessionRefusal;

/// What a serve that ran gives [`super::producer::ProducerMachine::handle_served`]: the bytes
/// written, the lease's checksum payload and the path that carried the load (for its FINISH).
pub type ServedLoad = (u64, Option<Vec<u8>>, Option<TransferPath>);

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
    /// Serving failed (ERROR sent) for this cause once WRITEs had started (a request refused
    /// before any WRITE leaves the lease held instead); the blocks are not offered again.
    Failed(Shared<ServeFailure>),
    /// No consumer came before the lease ran out.
    Expired,
}

/// What the shell must do ([`super::producer::ProducerMachine::poll`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Effect<P, T> {
    /// Send `welcome`, the answer to its `hello`, to `peer`.
    Welcome {
        /// The consumer connection.
        peer: P,
        /// The message (with `error` set when the session was refused).
        welcome: Welcome,
    },
    /// Send `reply` to `peer`.
    Reply {
        /// The consumer connection.
        peer: P,
        /// The message.
        reply: Reply,
    },
    /// Write the blocks of `lease` as `request` asks, finishing by `deadline`,
    /// then call [`super::producer::ProducerMachine::handle_served`].
    Serve {
        /// The consumer connection.
        peer: P,
        /// The consumer's request.
        request: LoadRequest,
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
    /// Drop every engine's cached descriptor of and data connections to these consumer
    /// segments: no session and no load in flight holds them any more (so that consumers
    /// that come and go leave no fds behind).
    CloseSegments {
        /// The consumer segments (`host:port` of their engines).
        segments: Vec<String>,
    },
    /// Something a peer did that an operator may want to know (the shell logs it, rate
    /// limited: anyone reaching the port can cause it).
    Warn(Warning),
}

/// A peer-caused event worth a warning ([`Effect::Warn`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Warning {
    /// A `hello` or a request refused (no session, an unproven secret, a replayed load id, a
    /// hello naming another producer): why, as the consumer was told.
    Refused(SessionRefusal),
    /// A load refused for a wrong or missing load key, or never published.
    Load(Refusal),
    /// A consumer message that does not decode (answered with ERROR).
    BadRequest {
        /// The request id it names, where it could be read.
        request_id: Option<String>,
        /// Why it does not decode.
        error: MsgError,
    },
}

/// A load refused for who asked or what it asked for, for the producer's log
/// ([`Warning::Load`]: only the consumer hears the reply); the consumer gets the same cause in
/// its ERROR reply.
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

/// Errors of [`super::producer::ProducerMachine::handle_publish`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    /// The request id is already published, being served, or finished recently.
    #[error("request {0:?} was already published")]
    Duplicate(String),
}

/// Whether `request`, in `session`, may load a lease published with `key`: it proves the key
/// for this session and load (constant-time compare).
pub(super) fn owns(key: &Option<String>, request: &LoadRequest, session: &Session) -> bool {
    match key {
        None => true,
        Some(k) => session.check_key_proof(k, request),
    }
}

/// The ERROR for a request that does not own its lease, after the warning that logs it.
pub(super) fn not_owner<P, T>(peer: P, request: &LoadRequest) -> [Effect<P, T>; 2] {
    let id = &request.request_id;
    let (why, refusal) = if request.key_proof.is_some() {
        ("wrong", Refusal::KeyWrong(id.clone()))
    } else {
        ("missing", Refusal::KeyMissing(id.clone()))
    };
    let reply = Reply::error(
        id,
        request.load_id,
        format!("request {id:?}: load key {why}; only the consumer the producer's lease names may load it"),
    );
    [
        Effect::Warn(Warning::Load(refusal)),
        Effect::Reply { peer, reply },
    ]
}
