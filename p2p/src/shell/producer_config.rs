//! The producer's settings and what its API hands back (publish results, releases, derived
//! load keys): plain data, kept apart from `producer.rs` (the API) and `producer_loop.rs` (the
//! event loop) so that those stay about the publish path and the socket.

use std::time::Duration;

use crate::error::{ConfigFault, P2pError};
use crate::proto::msg::DEFAULT_MAX_ZMTP_MESSAGE;
use crate::proto::producer::{ProducerTimeouts, ReleaseReason};
use crate::worker::Worker;
use kvferry_transfer::Secret;

/// The shared secret of the workers' engines: all have the same one, or none has.
pub(crate) fn workers_secret(workers: &[Worker]) -> Result<Option<Secret>, P2pError> {
    let first = workers.first().and_then(|w| w.engine.secret().cloned());
    if workers.iter().any(|w| w.engine.secret() != first.as_ref()) {
        return Err(P2pError::Config(ConfigFault::SecretsDiffer));
    }
    Ok(first)
}

/// Producer settings.
#[derive(Debug, Clone)]
pub struct ProducerConfig {
    /// ZeroMQ endpoint to bind, e.g. `tcp://127.0.0.1:0` (port 0: any;
    /// [`Producer::endpoint`](crate::Producer::endpoint) reports the real one).
    pub bind: String,
    /// Lease, publish-wait and tombstone durations (§4 "Leases").
    pub timeouts: ProducerTimeouts,
    /// Deadline of one load's WRITEs (segment open + batch wait, all ranks). No
    /// transfer starts unless this much is left of the consumer's budget.
    pub transfer_timeout: Duration,
    /// Deadline of one rank's checksums at publish.
    pub checksum_timeout: Duration,
    /// Checksum published blocks and send the payload (the carrier); `false` sends none.
    pub checksums: bool,
    /// Deadline of sending one reply on the ROUTER.
    pub send_timeout: Duration,
    /// Largest message a consumer may send on the ROUTER (bytes, all frames of one message);
    /// a frame header declaring more drops that connection before anything is reserved.
    /// Default [`DEFAULT_MAX_ZMTP_MESSAGE`].
    pub max_message_bytes: usize,
    /// Control connections served at once, from all sources (at least 1); more are closed at
    /// accept, before the greeting. Default 256, as the transfer engine's listeners.
    pub max_connections: usize,
    /// Control connections served at once from one source IP (at least 1), so idle
    /// connections from one host cannot lock out the others. Default 64.
    pub max_connections_per_source: usize,
    /// Time an accepted connection has to finish the ZMTP handshake (greeting and READY).
    /// Default 2 s, as the listeners' first frame.
    pub handshake_timeout: Duration,
    /// Time a message has to arrive whole once its first byte came (idle connections between
    /// messages are not affected). Default 10 s.
    pub frame_timeout: Duration,
    /// Bytes that large frames (64 KiB and more) of all connections may hold at once, charged
    /// at their headers before anything is reserved; a frame that does not fit drops its
    /// connection. Default [`DEFAULT_RECEIVE_BUDGET`].
    pub receive_budget_bytes: usize,
    /// Control-channel sessions held at most (one per consumer connection); past it the
    /// oldest goes: its consumer's next request is answered `no_session` and it says hello
    /// again. Default [`MAX_SESSIONS`].
    pub max_sessions: usize,
    /// Bytes of one layer group (docs/design.md §4.9): a load of at least twice this is
    /// copied in layer groups of about this size (at most 4), and the consumer hears as each
    /// lands, to verify it while the rest is copied; a smaller one in one go. 0: always in one
    /// go. Default [`DEFAULT_LAYER_GROUP_BYTES`].
    pub layer_group_bytes: u64,
}

pub use crate::proto::progress::DEFAULT_LAYER_GROUP_BYTES;

/// Default [`ProducerConfig::max_sessions`].
pub use crate::proto::sessions::MAX_SESSIONS;

/// Default [`ProducerConfig::receive_budget_bytes`]: four messages of the default maximum size.
pub const DEFAULT_RECEIVE_BUDGET: usize = 4 * DEFAULT_MAX_ZMTP_MESSAGE;

impl Default for ProducerConfig {
    fn default() -> Self {
        ProducerConfig {
            bind: "tcp://127.0.0.1:0".into(),
            timeouts: ProducerTimeouts::default(),
            transfer_timeout: Duration::from_secs(30),
            checksum_timeout: Duration::from_secs(30),
            checksums: true,
            send_timeout: Duration::from_secs(5),
            max_message_bytes: DEFAULT_MAX_ZMTP_MESSAGE,
            max_connections: 256,
            max_connections_per_source: 64,
            handshake_timeout: Duration::from_secs(2),
            frame_timeout: Duration::from_secs(10),
            receive_budget_bytes: DEFAULT_RECEIVE_BUDGET,
            max_sessions: MAX_SESSIONS,
            layer_group_bytes: DEFAULT_LAYER_GROUP_BYTES,
        }
    }
}

/// What [`Producer::publish`](crate::Producer::publish) did.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishInfo {
    /// Whether a checksum payload will travel with the load.
    pub checksummed: bool,
    /// Seconds spent checksumming (wall clock, all ranks concurrently).
    pub checksum_seconds: f64,
    /// Why no payload will be sent, when checksums are enabled but none will be.
    pub warning: Option<String>,
    /// Size of the encoded payload in bytes (0 without one).
    pub payload_bytes: usize,
    /// The lease's load key: only a load carrying it ([`crate::LoadSpec::load_key`]) is
    /// served. Hand it to the consumer the lease is for (vLLM: in `kv_transfer_params`
    /// through the proxy). 32 hex digits when random
    /// ([`Producer::publish`](crate::Producer::publish)).
    pub load_key: String,
}

/// A load key derived from a shared secret: `hex(HMAC-SHA256(secret, "kvferry/load-key/v1" ‖
/// request_id))[..32]`. For two processes that agree on request ids without a proxy between
/// them (`kvferry serve` / `load`): both derive the same key, nobody without the secret can.
pub fn derive_load_key(secret: &kvferry_transfer::Secret, request_id: &str) -> String {
    secret
        .prove("kvferry/load-key/v1", &[request_id.as_bytes()])
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Longest load key accepted from an embedder, bytes.
pub const MAX_LOAD_KEY_BYTES: usize = 256;

/// A lease whose blocks the embedder may reuse now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// The request.
    pub request_id: String,
    /// Served, failed, or expired.
    pub reason: ReleaseReason,
}
