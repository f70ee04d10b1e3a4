//! kvferry-p2p: the producer/consumer connector (docs/design.md §4), push as vLLM's
//! MooncakeConnector: the consumer asks, the producer WRITEs the KV blocks into
//! the consumer's memory through its transfer engine, then replies on the ZeroMQ
//! control channel with the status and the checksum payload (the connector-owned
//! carrier, docs/design.md §2.4). The consumer checksums the landed blocks, compares,
//! applies the policy (§2.7), and only then reports the load.
//!
//! # Layers
//! * [`proto`] — sans-I/O: wire messages (msgpack maps, versioned, FINISH=0 /
//!   CONTINUE=1 / ERROR=2), the producer/consumer state machines (leases,
//!   deadlines, one load per request), the consumer's transfer request
//!   ([`proto::request`]) and the producer's plan of the WRITEs that serve it
//!   ([`proto::serve`], KV heads found through the [`proto::heads`] map), over ranks
//!   given as plain data ([`proto::layout`]); tested without a network.
//! * [`shell`] — the thin tokio shell: a ROUTER for the producer, a DEALER per
//!   producer for the consumer; every await has a timeout.
//! * [`worker`] — one TP/PP rank: its engine, KV memory and checksum backend;
//!   [`checksum`] runs a rank's checksums and sums the ranks (§2.3).
//!
//! # The API (what an embedder uses)
//! ```text
//! // Each side: one Worker per TP×PP rank; the embedder owns and registers the memory.
//! Worker { rank: RankInfo, engine: Arc<TransferEngine>, device: Location,
//!          groups: Vec<WorkerGroup>, backend: Arc<dyn ChecksumBackend> }
//! WorkerGroup { group_id, block_size, layers: Vec<LayerInput>, sliding_window: Option<u64>,
//!               skipped: Option<SkipReason> }
//!
//! Producer::start(ProducerConfig, Vec<Worker>).await -> Result<Producer, P2pError>
//! producer.endpoint() -> &str                                   // "tcp://127.0.0.1:40123"
//! producer.publish(request_id, blocks: Vec<Vec<Option<u64>>>, num_tokens).await
//!     -> Result<PublishInfo, P2pError>                          // blocks[g]: group g's block table
//!                                                               // info.load_key: only its holder loads
//! producer.publish_with_key(request_id, blocks, num_tokens, load_key).await  // the embedder's key
//! producer.released() -> Vec<Released>                          // leases served / failed / expired
//! producer.shutdown().await
//!
//! Consumer::new(ConsumerConfig, Vec<Worker>) -> Result<Consumer, P2pError>
//! consumer.set_landed_hook(Some(Arc::new(|landed: &Landed| { .. })))   // fault injection
//! consumer.load(LoadSpec { request_id, producer, groups: Vec<LoadGroup>,
//!                          num_local_computed, num_tokens, load_key }).await
//!     -> Result<LoadOutcome, LoadError>   // LoadOutcome { verdict, action, bytes, .. }
//! ```
//! The two sides' TP and PP sizes may differ: layers pair by name, and each KV
//! head a consumer rank holds is written by a producer rank that holds it (with
//! replicas, consumer TP rank c takes it from the (c mod n)-th of the n holders;
//! rank to rank when the TP sizes are equal). Paired layers must have the same
//! layout, tokens per kernel block, head size, element size and kernel blocks per
//! block (the number of blocks, KV heads and the strides may differ). The block sizes
//! may differ too (`LoadGroup::remote_block_size`): the consumer's blocks are then filled
//! token by token, which needs only the same layout, head size and element size; a state
//! group (no per-token blocks) moves only between equal block sizes (docs/design.md §4.5).
//!
//! # Deadlines and failures (§4)
//! * Producer: a lease lasts `timeouts.lease`; a request before its publish waits
//!   `timeouts.publish_wait`; a waiting or served request gets CONTINUE every
//!   `timeouts.heartbeat`; a transfer must end within `transfer_timeout` and starts
//!   only if that much is left of the consumer's budget (sent as `budget_ms`).
//! * Consumer: a load fails after `reply_timeout` of silence, after `max_wait` in
//!   all, or at once when the control connection drops; the DEALER is then rebuilt
//!   (once no other load waits on it). A failed load's blocks may still receive a
//!   late write from a live producer until `max_wait` after the request.
//! * Security: every load grants the consumer's engines WRITE on exactly its
//!   block bytes to a fresh random token, revoked when the reply arrives (before
//!   verification); the producer writes with the token and its FINISH proves it (HMAC);
//!   a request is served only with its lease's load key. The grants are enforced when the
//!   engines are authenticated (a shared secret, `kvferry_transfer::auth`).
//! * A request is loaded at most once: a second request for it, or one for an
//!   expired lease, gets ERROR (never stale blocks).
#![warn(missing_docs)]

pub mod checksum;
pub mod error;
pub mod proto;
pub mod shell;
pub mod worker;

pub use error::{
    BindFailure, ConfigFault, LoadError, LoadSpecFault, P2pError, PublishFailure, WorkersFault,
};
pub use proto::msg::{DEFAULT_MAX_ZMTP_MESSAGE, MAX_MESSAGE_BYTES};
pub use proto::producer::{ProducerTimeouts, Refusal, ReleaseReason};
pub use shell::consumer::{
    Consumer, ConsumerConfig, HookFilter, Landed, LandedGroup, LandedHook, LoadGroup, LoadOutcome,
    LoadSpec, ReadCheck, ReadMode, DEFAULT_READ_GROUP_BYTES,
};
pub use shell::producer::Producer;
pub use shell::producer_config::{
    derive_load_key, ProducerConfig, PublishInfo, Released, DEFAULT_RECEIVE_BUDGET,
};
pub use worker::{Worker, WorkerGroup};
