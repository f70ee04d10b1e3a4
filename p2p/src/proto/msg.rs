//! Wire messages of the control channel (docs/design.md §4): msgpack maps with field
//! names (`rmp_serde::to_vec_named`), a `version` field checked first, unknown
//! fields ignored, status codes as vLLM's MooncakeConnector (FINISH=0,
//! CONTINUE=1, ERROR=2). Decoding never panics on any input, and every list is capped
//! ([`MAX_GROUPS`], [`MAX_RANKS`], [`MAX_LAYERS`], [`MAX_BLOCKS`], [`MAX_STRIDES`]) before
//! its elements are read, so a decoded message holds a small multiple of its bytes.

use super::msg_header::{from_msgpack, leading_header, Header};
use kvferry_transfer::{Shared, TransferPath};

use serde::{Deserialize, Serialize};

pub use super::msg_body::{
    WireBlocks, WireGeometry, WireLayer, WireRank, WireRankGroup, DEFAULT_MAX_ZMTP_MESSAGE,
    MAX_BLOCKS, MAX_GROUPS, MAX_LAYERS, MAX_MESSAGE_BYTES, MAX_RANKS, MAX_STRIDES,
    PROTOCOL_VERSION,
};

/// `kind` of a consumer → producer transfer request.
pub const KIND_TRANSFER_REQUEST: &str = "transfer_request";
/// `kind` of a producer → consumer reply.
pub const KIND_REPLY: &str = "reply";
/// `kind` of the consumer's first message on a connection (`proto::session`).
pub const KIND_HELLO: &str = "hello";
/// `kind` of the producer's answer to a `hello`.
pub const KIND_WELCOME: &str = "welcome";

/// Reply status, numbered as vLLM's MooncakeConnector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// 0: the blocks were written; the reply carries the checksum payload.
    Finish,
    /// 1: the producer has the request but is not done (e.g. not yet published).
    Continue,
    /// 2: the load failed; the reply's `error` says why.
    Error,
}

impl Status {
    /// The wire code (0, 1, 2).
    pub fn code(self) -> u8 {
        match self {
            Status::Finish => 0,
            Status::Continue => 1,
            Status::Error => 2,
        }
    }

    /// Parses a wire code; `None` for anything but 0, 1, 2.
    pub fn from_code(code: u8) -> Option<Status> {
        match code {
            0 => Some(Status::Finish),
            1 => Some(Status::Continue),
            2 => Some(Status::Error),
            _ => None,
        }
    }
}

/// Errors decoding a control message. Each is a value, never a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsgError {
    /// The message is larger than [`MAX_MESSAGE_BYTES`].
    #[error("control message of {0} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")]
    TooLarge(usize),
    /// Not a msgpack map with the expected fields (the decoder's error: which field, which
    /// limit).
    #[error("malformed control message: {0}")]
    Malformed(#[source] DecodeError),
    /// A `hello` whose nonce is not 32 bytes or whose names are over [`MAX_NAME_BYTES`].
    #[error(
        "malformed control message: hello with a nonce of {nonce} bytes (32) or a name over \
         {MAX_NAME_BYTES} bytes (producer {producer}, consumer {consumer})"
    )]
    BadHello {
        /// The nonce's length, bytes.
        nonce: usize,
        /// The producer name's length, bytes.
        producer: usize,
        /// The consumer name's length, bytes.
        consumer: usize,
    },
    /// A `welcome` without a 32-byte nonce (and no refusal), or with a proof not of 32 bytes.
    #[error(
        "malformed control message: welcome with a nonce of {nonce} bytes or a proof not of 32 \
         ({proof:?} bytes)"
    )]
    BadWelcome {
        /// The nonce's length, bytes.
        nonce: usize,
        /// The proof's length, bytes, if it has one.
        proof: Option<usize>,
    },
    /// A reply for a pending load that names another request than the load's.
    #[error(
        "malformed control message: reply for load {load_id} names request {got:?}, the load \
         is for {expected:?}"
    )]
    RequestMismatch {
        /// The load.
        load_id: u64,
        /// The request id the reply names.
        got: String,
        /// The load's request id.
        expected: String,
    },
    /// A `version` other than [`PROTOCOL_VERSION`] (or none at all).
    #[error("control message version {got:?}, this peer speaks version {PROTOCOL_VERSION}")]
    WrongVersion {
        /// The version found, `None` when the field is missing.
        got: Option<u64>,
    },
    /// A `kind` other than the one expected on this socket.
    #[error("control message kind {got:?}, expected {expected:?}")]
    WrongKind {
        /// The kind found.
        got: Option<String>,
        /// The kind this socket accepts.
        expected: &'static str,
    },
    /// A `status` other than 0, 1, 2.
    #[error("reply status {0} is not FINISH=0, CONTINUE=1 or ERROR=2")]
    BadStatus(u8),
}

impl MsgError {
    /// The decoder's error for a message that does not decode.
    fn decode(e: rmp_serde::decode::Error) -> Self {
        MsgError::Malformed(Shared::new(e))
    }
}

/// The msgpack decoder's error (rmp-serde's), shared so that a [`MsgError`] stays `Clone`; its
/// `source()` is the decoder's error itself, for a caller that downcasts. Equality is
/// [`Shared`]'s (the same error, or the same text).
pub type DecodeError = Shared<rmp_serde::decode::Error>;

/// Consumer → producer: "write request `request_id`'s blocks into my memory" (the wire form of a
/// load; the engine's `kvferry_transfer::TransferRequest` is one READ or WRITE).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadRequest {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// [`KIND_TRANSFER_REQUEST`].
    pub kind: String,
    /// The request whose KV is loaded.
    pub request_id: String,
    /// Consumer-chosen id of this load, echoed in replies (a stale reply never matches another load).
    pub load_id: u64,
    /// Consumer TP size.
    pub tp_size: u32,
    /// Consumer PP size.
    pub pp_size: u32,
    /// Tokens the consumer already holds (local prefix hit); not loaded.
    pub num_local_computed: u64,
    /// Tokens of the request's KV (num_computed after the load).
    pub num_tokens: u64,
    /// Milliseconds, from the producer's receipt, within which the consumer still
    /// accepts the blocks; the producer starts no transfer that could end later.
    /// 0: no budget.
    #[serde(default)]
    pub budget_ms: u64,
    /// Blocks to write, per group.
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_GROUPS>")]
    pub blocks: Vec<WireBlocks>,
    /// The consumer's ranks.
    #[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_RANKS>")]
    pub ranks: Vec<WireRank>,
    /// The fresh random per-load grant token (32 hex digits) the consumer's ranks granted
    /// WRITE on exactly this load's block bytes, until the load ends (`kvferry_transfer::auth`):
    /// the producer attaches it to its WRITEs and keys its FINISH proof with it.
    /// `None` from a consumer that grants nothing (then no proof is sent).
    #[serde(default)]
    pub token: Option<String>,
    /// Proof of the lease's load key for this load of this session
    /// (`proto::session::Session::key_proof`): only a request proving the key the producer
    /// published with may load it; a missing or wrong proof gets ERROR and leaves the lease for
    /// its owner. The key itself never travels on the control channel.
    #[serde(default, with = "serde_bytes")]
    pub key_proof: Option<Vec<u8>>,
    /// With a shared secret: the consumer's proof of it over the session and this whole
    /// request (`proto::session::Session::request_proof`); a producer with the secret acts on
    /// no request without a valid one.
    #[serde(default, with = "serde_bytes")]
    pub proof: Option<Vec<u8>>,
    /// The consumer READs the blocks itself (docs/design.md §4.10): the producer checks the
    /// request against its lease only (`ranks` may be empty), answers FINISH with the payload
    /// at once, and holds the lease until the consumer's `read_done` or the serve margin.
    /// Absent (false): the producer WRITEs, as before.
    #[serde(default, skip_serializing_if = "is_false")]
    pub read: bool,
    /// Asks for the producer's layout ([`Reply::layout`]) with the FINISH, so that later
    /// loads may read. Absent (false): none is sent.
    #[serde(default, skip_serializing_if = "is_false")]
    pub want_layout: bool,
    /// With `read`: the digest of the producer layout the consumer planned its reads with
    /// (`msg_read::layout_digest`); a producer whose layout differs (it restarted with other
    /// memory) answers ERROR with `read_refused`, nothing served, the lease untouched.
    #[serde(default, with = "serde_bytes", skip_serializing_if = "Option::is_none")]
    pub layout_digest: Option<Vec<u8>>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Consumer → producer, the first message on a connection: opens a session
/// (`proto::session`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// [`KIND_HELLO`].
    pub kind: String,
    /// The consumer's fresh random nonce, 32 bytes.
    #[serde(with = "serde_bytes")]
    pub nonce: Vec<u8>,
    /// The producer endpoint the consumer dialed; a producer with a secret refuses one that
    /// does not name it.
    pub producer: String,
    /// The consumer's name (its first rank's segment).
    pub consumer: String,
}

/// Producer → consumer, the answer to a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// [`KIND_WELCOME`].
    pub kind: String,
    /// The producer's fresh random nonce, 32 bytes (empty when refused).
    #[serde(with = "serde_bytes")]
    pub nonce: Vec<u8>,
    /// With a shared secret: the producer's proof of it over the session.
    #[serde(default, with = "serde_bytes")]
    pub proof: Option<Vec<u8>>,
    /// Why the `hello` was refused (no session).
    #[serde(default)]
    pub error: Option<String>,
    /// The producer serves loads its consumer reads (docs/design.md §4.10): a request may ask
    /// for its layout. Absent (false) from producers that do not, whose proof of a request
    /// would not cover the fields they do not know.
    #[serde(default, skip_serializing_if = "is_false")]
    pub reads: bool,
}

/// Producer → consumer reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// [`KIND_REPLY`].
    pub kind: String,
    /// Status code: [`Status::code`].
    pub status: u8,
    /// The request this answers.
    pub request_id: String,
    /// The load this answers ([`LoadRequest::load_id`]).
    pub load_id: u64,
    /// Why the load failed (ERROR) or what the producer waits for (CONTINUE).
    #[serde(default)]
    pub error: Option<String>,
    /// The producer's checksum payload (docs/design.md §2.4), raw bytes: the connector-owned carrier.
    #[serde(default, with = "serde_bytes")]
    pub checksums: Option<Vec<u8>>,
    /// Bytes the producer wrote for this load.
    #[serde(default)]
    pub bytes_written: u64,
    /// On FINISH for a request with a token: [`finish_proof`] keyed by the token, so that the
    /// consumer accepts the payload only from the producer it sent the token to.
    #[serde(default, with = "serde_bytes")]
    pub proof: Option<Vec<u8>>,
    /// On ERROR: the producer holds no session for this connection (it was evicted, or no
    /// hello came): nothing was served; the consumer must say hello again (a new session) and
    /// may send the request again. Absent (false) from producers that do not say it.
    #[serde(default)]
    pub no_session: bool,
    /// On ERROR: why, as a type, where the producer knows one (its words stay in `error`).
    /// Absent from producers that do not say it, and read as absent when it names a reason
    /// this side does not know (a newer producer's).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "known_reason"
    )]
    pub reason: Option<ErrorReason>,
    /// On CONTINUE: the layers whose copies have all completed since the last progress
    /// (`proto::progress`), so that the consumer checksums them while the rest is copied.
    /// Absent from producers that do not say it, and read as absent when it is not a span
    /// (a newer producer's form): no progress, every layer is verified after the FINISH.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "known_span"
    )]
    pub landed: Option<LayerSpan>,
    /// On FINISH: the path that carried the load's bytes (the first producer rank's into
    /// its first consumer rank: `cuda-ipc`, `tcp` or `rdma`), so that the consumer can say
    /// what carried its KV. Absent from producers that do not say it, and read as absent when
    /// it names a path this side does not know. Not covered by the FINISH proof: it is a
    /// report, nothing is decided on it.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "known_path"
    )]
    pub path: Option<TransferPath>,
    /// On FINISH to a request with `want_layout`: the producer's ranks and KV memory
    /// (docs/design.md §4.10), covered by the FINISH proof. Empty (absent): not sent.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX_RANKS>"
    )]
    pub layout: super::msg_read::WireProducerLayout,
}

/// Layer slots `[first, end)` of a request (`proto::progress::layer_slots`): the layers a
/// progress reply says have landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSpan {
    /// The first layer slot.
    pub first: u32,
    /// One past the last.
    pub end: u32,
}

/// `Reply::landed` as read: anything but a span of two numbers is `None`, not a bad reply, and
/// is skipped as it is read, never held (`msg_span`).
fn known_span<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<LayerSpan>, D::Error> {
    Ok(super::msg_span::read_span(d)?.map(|(first, end)| LayerSpan { first, end }))
}

/// Why the producer answered ERROR, as a type (a snake_case string on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorReason {
    /// The request does not match what the producer published for it (a block the lease
    /// does not hold at a position, a group it never published, KV that cannot be copied
    /// byte for byte): the two sides replay different prompts or models, so the run's other
    /// requests are refused the same way.
    LeaseMismatch,
    /// A request to read for a lease not published yet (reads made before the publish could
    /// predate the KV): nothing was served, the lease untouched; the consumer loads by WRITE
    /// (which may wait for the publish) and keeps the layout.
    ReadEarly,
    /// A request to read (docs/design.md §4.10) planned with another layout than the
    /// producer's (which restarted with other memory, or sends none): nothing was served, the
    /// lease untouched; the consumer forgets the layout, asks for it again and loads by WRITE.
    ReadRefused,
}

/// `Reply::path` as read: a path this side does not know, or a value that is no word, is
/// `None`, not a bad reply (`msg_span::read_word`).
fn known_path<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<TransferPath>, D::Error> {
    let s = super::msg_span::read_word(d)?;
    Ok(match s.as_deref() {
        Some("cuda-ipc") => Some(TransferPath::CudaIpc),
        Some("tcp") => Some(TransferPath::Tcp),
        Some("rdma") => Some(TransferPath::Rdma),
        _ => None,
    })
}

/// `Reply::reason` as read: a reason this side does not know, or a value that is no word, is
/// `None`, not a bad reply (`msg_span::read_word`).
fn known_reason<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<ErrorReason>, D::Error> {
    let s = super::msg_span::read_word(d)?;
    Ok(match s.as_deref() {
        Some("lease_mismatch") => Some(ErrorReason::LeaseMismatch),
        Some("read_refused") => Some(ErrorReason::ReadRefused),
        Some("read_early") => Some(ErrorReason::ReadEarly),
        _ => None,
    })
}

/// HMAC label of the FINISH proof.
const FINISH_LABEL: &[u8] = b"kvferry/finish/v2";

/// The FINISH proof: `HMAC-SHA256(token, label ‖ session id ‖ request_id ‖ load_id ‖
/// bytes_written ‖ has_checksums ‖ checksums [‖ layout])` (each part length-prefixed; the
/// layout as encoded, a part only when one is sent), 32 bytes. It binds
/// the payload to the load (of this session, `proto::session::Session::id`) whose token only
/// the consumer and the producer it asked know.
pub fn finish_proof(token: &str, session_id: &[u8; 32], reply: &Reply) -> [u8; 32] {
    let layout = layout_bytes(&reply.layout);
    let load_id = reply.load_id.to_le_bytes();
    let bytes = reply.bytes_written.to_le_bytes();
    let has = [reply.checksums.is_some() as u8];
    let mut parts: Vec<&[u8]> = vec![
        FINISH_LABEL,
        session_id,
        reply.request_id.as_bytes(),
        &load_id,
        &bytes,
        &has,
        reply.checksums.as_deref().unwrap_or_default(),
    ];
    // A FINISH without a layout proves exactly what it proved before layouts were sent.
    if !reply.layout.is_empty() {
        parts.push(&layout);
    }
    kvferry_transfer::auth::hmac_sha256(token.as_bytes(), &parts)
}

/// The layout's part of the FINISH proof: its msgpack form, or nothing when none is sent (so
/// that a FINISH without a layout proves what it proved before).
fn layout_bytes(layout: &super::msg_read::WireProducerLayout) -> Vec<u8> {
    if layout.is_empty() {
        Vec::new()
    } else {
        encode(layout)
    }
}

impl Reply {
    /// A reply with `status` and nothing else.
    pub fn new(status: Status, request_id: &str, load_id: u64) -> Reply {
        Reply {
            version: PROTOCOL_VERSION,
            kind: KIND_REPLY.to_string(),
            status: status.code(),
            request_id: request_id.to_string(),
            load_id,
            error: None,
            checksums: None,
            bytes_written: 0,
            proof: None,
            no_session: false,
            reason: None,
            landed: None,
            path: None,
            layout: Vec::new(),
        }
    }

    /// An ERROR reply with a reason.
    pub fn error(request_id: &str, load_id: u64, why: impl Into<String>) -> Reply {
        let mut r = Reply::new(Status::Error, request_id, load_id);
        r.error = Some(why.into());
        r
    }

    /// The parsed status (checked at decode time).
    pub fn status(&self) -> Status {
        Status::from_code(self.status).unwrap_or(Status::Error)
    }
}

/// A message's size checked, then its header read ([`leading_header`], else the whole map)
/// and its version checked.
fn header(bytes: &[u8]) -> Result<Header, MsgError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(MsgError::TooLarge(bytes.len()));
    }
    let header: Header = match leading_header(bytes) {
        Some(h) => h,
        None => from_msgpack(bytes).map_err(MsgError::decode)?,
    };
    if header.version != Some(PROTOCOL_VERSION as u64) {
        return Err(MsgError::WrongVersion {
            got: header.version,
        });
    }
    Ok(header)
}

fn check_header(bytes: &[u8], expected: &'static str) -> Result<(), MsgError> {
    let header = header(bytes)?;
    if header.kind.as_deref() != Some(expected) {
        return Err(MsgError::WrongKind {
            got: header.kind,
            expected,
        });
    }
    Ok(())
}

/// Encodes a message as a msgpack map with field names.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    // Serializing these plain structs to a Vec cannot fail.
    rmp_serde::to_vec_named(msg).unwrap_or_default()
}

/// Decodes a transfer request: size, version and kind are checked before the body.
pub fn decode_request(bytes: &[u8]) -> Result<LoadRequest, MsgError> {
    check_header(bytes, KIND_TRANSFER_REQUEST)?;
    from_msgpack(bytes).map_err(MsgError::decode)
}

/// A message on the producer's socket: a session's `hello` or a transfer request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsumerMessage {
    /// Opens a session.
    Hello(Hello),
    /// Asks for a load.
    Request(LoadRequest),
    /// Ends the lease of a load the consumer read (docs/design.md §4.10).
    ReadDone(super::msg_read::ReadDone),
}

/// Length of a session nonce, bytes.
pub const NONCE_BYTES: usize = 32;
/// Longest endpoint or consumer name a `hello` carries, bytes.
pub const MAX_NAME_BYTES: usize = 1024;

/// Decodes what a consumer sends: size and version are checked before the body; the `kind`
/// picks a [`Hello`] (nonce of [`NONCE_BYTES`], names of at most [`MAX_NAME_BYTES`]) or a
/// transfer request.
pub fn decode_consumer_message(bytes: &[u8]) -> Result<ConsumerMessage, MsgError> {
    // The header once: each check of it reads the message again.
    let h = header(bytes)?;
    match h.kind.as_deref() {
        Some(KIND_HELLO) => hello_body(bytes).map(ConsumerMessage::Hello),
        Some(KIND_TRANSFER_REQUEST) => from_msgpack(bytes)
            .map(ConsumerMessage::Request)
            .map_err(MsgError::decode),
        Some(super::msg_read::KIND_READ_DONE) => from_msgpack(bytes)
            .map(ConsumerMessage::ReadDone)
            .map_err(MsgError::decode),
        _ => Err(MsgError::WrongKind {
            got: h.kind,
            expected: KIND_TRANSFER_REQUEST,
        }),
    }
}

/// Decodes a `hello`: header first, then a 32-byte nonce and bounded names.
pub fn decode_hello(bytes: &[u8]) -> Result<Hello, MsgError> {
    check_header(bytes, KIND_HELLO)?;
    hello_body(bytes)
}

/// A `hello` whose header was checked: its nonce and names.
fn hello_body(bytes: &[u8]) -> Result<Hello, MsgError> {
    let h: Hello = from_msgpack(bytes).map_err(MsgError::decode)?;
    let max = MAX_NAME_BYTES;
    if h.nonce.len() != NONCE_BYTES || h.producer.len() > max || h.consumer.len() > max {
        return Err(MsgError::BadHello {
            nonce: h.nonce.len(),
            producer: h.producer.len(),
            consumer: h.consumer.len(),
        });
    }
    Ok(h)
}

/// Decodes a `welcome`: header first; a nonce of 32 bytes unless refused, a proof of 32 if any.
pub fn decode_welcome(bytes: &[u8]) -> Result<Welcome, MsgError> {
    check_header(bytes, KIND_WELCOME)?;
    let w: Welcome = from_msgpack(bytes).map_err(MsgError::decode)?;
    let nonce_ok = w.nonce.len() == NONCE_BYTES || w.error.is_some();
    if !nonce_ok || w.proof.as_ref().is_some_and(|p| p.len() != 32) {
        return Err(MsgError::BadWelcome {
            nonce: w.nonce.len(),
            proof: w.proof.as_ref().map(|p| p.len()),
        });
    }
    Ok(w)
}

/// Decodes a reply: size, version and kind are checked before the body; the status must be 0, 1 or 2.
pub fn decode_reply(bytes: &[u8]) -> Result<Reply, MsgError> {
    check_header(bytes, KIND_REPLY)?;
    let reply: Reply = from_msgpack(bytes).map_err(MsgError::decode)?;
    if Status::from_code(reply.status).is_none() {
        return Err(MsgError::BadStatus(reply.status));
    }
    Ok(reply)
}
