//! The producer (docs/design.md §4): a ZeroMQ ROUTER serving transfer requests through the
//! lease state machine of [`crate::proto::producer`] (its event loop in `producer_loop.rs`),
//! and the publish path that checksums a request's blocks when its KV is complete.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_checksum::record::producer_payload;
use kvferry_checksum::select::producer_blocks;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{info, warn};
use zeromq::Socket;

use crate::checksum::{all_records, CallerStream};
use crate::error::{BindFailure, P2pError, PublishFailure};
use crate::proto::msg_read::layout_to_wire;

use crate::proto::layout::RankLayout;
use crate::proto::producer::ProducerMachine;
use crate::proto::serve::Published;
use crate::proto::sessions::os_nonces;
use crate::proto::spec_checks::check_tables;
use crate::shell::gate::{ControlGate, Gate, PeerWarnings};
use crate::shell::producer_config::{
    workers_secret, ProducerConfig, PublishInfo, Released, MAX_LOAD_KEY_BYTES,
};
use crate::shell::producer_loop::{Command, EventLoop};
use crate::worker::{validate, Worker};
use kvferry_kernels::Location;
use kvferry_transfer::auth::LogLimit;
use kvferry_transfer::sync::MutexExt;
use kvferry_transfer::Shared;

/// A running producer: one ROUTER, one event loop task, TP×PP workers.
pub struct Producer {
    endpoint: String,
    commands: mpsc::UnboundedSender<Command>,
    released: Arc<Mutex<Vec<Released>>>,
    workers: Arc<Vec<Worker>>,
    /// The workers as the protocol sees them (same order).
    layouts: Arc<Vec<RankLayout>>,
    tp: u32,
    pp: u32,
    config: ProducerConfig,
    /// The event loop, until [`Producer::shutdown`] takes it.
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Producer {
    /// Validates the workers (one TP×PP grid, agreeing groups), binds the ROUTER
    /// and starts the event loop. Must be called inside a tokio runtime.
    /// Errors: [`P2pError::Workers`], [`P2pError::Bind`].
    pub async fn start(config: ProducerConfig, workers: Vec<Worker>) -> Result<Producer, P2pError> {
        let (tp, pp, workers) = validate(workers)?;
        let secret = workers_secret(&workers)?;
        let mut options = zeromq::SocketOptions::default();
        options.max_message_size(config.max_message_bytes);
        // The control port is as bounded as the engine's listeners (docs/design.md §8.1).
        options
            .accept_gate(Arc::new(Gate(ControlGate::new(
                config.max_connections,
                config.max_connections_per_source,
            ))))
            .handshake_timeout(config.handshake_timeout)
            .frame_timeout(config.frame_timeout)
            .receive_budget(zeromq::ReceiveBudget::new(config.receive_budget_bytes));
        let mut socket = zeromq::RouterSocket::with_options(options);
        // Peers refused during the ZMTP handshake (e.g. an oversized command) are reported here.
        let monitor = Some(socket.monitor());
        let bind_err = |why: BindFailure| P2pError::Bind {
            endpoint: config.bind.clone(),
            why,
        };
        let bind_within = Duration::from_secs(10);
        let endpoint = tokio::time::timeout(bind_within, socket.bind(&config.bind))
            .await
            .map_err(|_| bind_err(BindFailure::TimedOut(bind_within)))?
            .map_err(|e| bind_err(BindFailure::Socket(Shared(Arc::new(e)))))?
            .to_string();
        let (tx, rx) = mpsc::unbounded_channel();
        let released = Arc::new(Mutex::new(Vec::new()));
        let workers = Arc::new(workers);
        let layouts: Arc<Vec<RankLayout>> = Arc::new(workers.iter().map(Worker::layout).collect());
        let task = tokio::spawn(
            EventLoop {
                machine: ProducerMachine::new(config.timeouts, config.transfer_timeout)
                    .with_control(secret, &endpoint, &config.bind, os_nonces())
                    .with_max_sessions(config.max_sessions)
                    .with_layout(layout_to_wire(&layouts)),
                socket,
                monitor,
                commands: tx.downgrade(),
                released: released.clone(),
                workers: workers.clone(),
                layouts: layouts.clone(),
                send_timeout: config.send_timeout,
                layer_group_bytes: config.layer_group_bytes,
                refusals: LogLimit::new(5, Duration::from_secs(10)),
                peer_warnings: PeerWarnings::new(),
            }
            .run(rx),
        );
        info!(%endpoint, tp, pp, "producer listening");
        Ok(Producer {
            endpoint,
            commands: tx,
            released,
            workers,
            layouts,
            tp,
            pp,
            config,
            task: Mutex::new(Some(task)),
        })
    }

    /// The bound control endpoint, e.g. `tcp://127.0.0.1:40123`: what consumers connect to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// A prompt's KV is complete: checksums its blocks now (every rank, tokens
    /// `[0, num_tokens)`, §2.5), then holds them under a lease until a consumer
    /// loads them or the lease expires. `blocks[g]` is group `g`'s block table
    /// (position → block id, `None` = null block); every group id of the workers
    /// must have an entry. A rank that fails to checksum makes the producer send
    /// no checksums for this request (a warning, in [`PublishInfo::warning`]).
    /// The lease gets a fresh random load key (in [`PublishInfo::load_key`]): only a load
    /// carrying it is served (request ownership).
    /// Errors: a missing group entry, a duplicate request id, a stopped producer.
    pub async fn publish(
        &self,
        request_id: &str,
        blocks: Vec<Vec<Option<u64>>>,
        num_tokens: u64,
    ) -> Result<PublishInfo, P2pError> {
        let key = kvferry_transfer::Token::random().map_err(|e| P2pError::Publish {
            request_id: request_id.to_string(),
            why: PublishFailure::NoKey(Shared(Arc::new(e))),
        })?;
        self.publish_with_key(request_id, blocks, num_tokens, &key.to_string())
            .await
    }

    /// As [`Producer::publish`], with the embedder's load key (1..=[`MAX_LOAD_KEY_BYTES`]
    /// bytes; e.g. from the proxy, or [`derive_load_key`](crate::derive_load_key)). Keep it
    /// unguessable: whoever holds it may load the request.
    pub async fn publish_with_key(
        &self,
        request_id: &str,
        blocks: Vec<Vec<Option<u64>>>,
        num_tokens: u64,
        load_key: &str,
    ) -> Result<PublishInfo, P2pError> {
        self.publish_inner(request_id, blocks, num_tokens, load_key, None)
            .await
    }

    /// As [`Producer::publish_with_key`] for KV still being written on `stream` (a raw
    /// `CUstream` of the workers' device, e.g. the forward's; 0: the legacy default stream),
    /// without synchronising it: an event is recorded on it, the checksums run after it, and
    /// every rank's engine orders its later copies of that device's memory after it (the CUDA
    /// IPC copy stream waits for the event on the device; paths that read device memory from
    /// the host wait for it on the host before their next such read, within the transfer
    /// timeout). Workers on host memory ignore it. Errors: as `publish_with_key`, and a
    /// driver failure recording or waiting for the event.
    ///
    /// # Safety
    /// `stream` is 0 or a live stream of every CUDA worker's device.
    pub async unsafe fn publish_after_stream(
        &self,
        request_id: &str,
        blocks: Vec<Vec<Option<u64>>>,
        num_tokens: u64,
        load_key: &str,
        stream: u64,
    ) -> Result<PublishInfo, P2pError> {
        // SAFETY: this function's contract.
        let after = unsafe { CallerStream::new(stream) };
        self.publish_inner(request_id, blocks, num_tokens, load_key, Some(after))
            .await
    }

    async fn publish_inner(
        &self,
        request_id: &str,
        blocks: Vec<Vec<Option<u64>>>,
        num_tokens: u64,
        load_key: &str,
        after: Option<CallerStream>,
    ) -> Result<PublishInfo, P2pError> {
        let perr = |why: PublishFailure| P2pError::Publish {
            request_id: request_id.to_string(),
            why,
        };
        if load_key.is_empty() || load_key.len() > MAX_LOAD_KEY_BYTES {
            return Err(perr(PublishFailure::KeyLength {
                bytes: load_key.len(),
                max: MAX_LOAD_KEY_BYTES,
            }));
        }
        for g in &self.workers[0].groups {
            if blocks.len() <= g.group_id as usize {
                return Err(perr(PublishFailure::NoTable(g.group_id)));
            }
        }
        // Before anything is checksummed or held: each table covers the tokens exactly and
        // names blocks inside the cache (a lease over tokens no block holds would verify).
        check_tables(
            &self.layouts,
            self.workers[0]
                .groups
                .iter()
                .map(|g| (g.group_id, blocks[g.group_id as usize].as_slice())),
            num_tokens,
        )
        .map_err(|e| perr(PublishFailure::Table(e)))?;
        if let Some(stream) = after {
            // Before the lease exists, so no copy of these blocks can start unordered.
            for w in self.workers.iter() {
                let Location::Cuda(device) = w.device else {
                    continue;
                };
                let (engine, deadline) = (w.engine.clone(), self.config.transfer_timeout);
                // Off the event loop's thread: the first call makes the device's copy stream.
                let ordered = tokio::task::spawn_blocking(move || {
                    // SAFETY: a CallerStream is 0 or a live stream of this device.
                    unsafe { engine.order_after(device, stream.raw(), deadline) }
                })
                .await
                .map_err(|e| perr(PublishFailure::Order(Shared(Arc::new(e)))))?;
                ordered.map_err(|e| perr(PublishFailure::Order(Shared(Arc::new(e)))))?;
            }
        }
        let started = Instant::now();
        let mut info = PublishInfo {
            checksummed: false,
            checksum_seconds: 0.0,
            warning: None,
            payload_bytes: 0,
            load_key: load_key.to_string(),
        };
        let mut payload = None;
        if self.config.checksums {
            let select = |g: &crate::worker::WorkerGroup| {
                producer_blocks(
                    &blocks[g.group_id as usize],
                    num_tokens,
                    g.block_size,
                    g.sliding_window,
                )
            };
            let (records, missing) = all_records(
                &self.workers,
                &select,
                num_tokens,
                self.config.checksum_timeout,
                after,
            )
            .await;
            if !missing.is_empty() {
                info.warning = Some(format!(
                    "not every worker reported, sending no checksums: {}",
                    missing.join("; ")
                ));
            } else {
                match producer_payload(&records, self.tp, self.pp, num_tokens) {
                    Ok(p) => {
                        let bytes = p.to_bytes();
                        info.payload_bytes = bytes.len();
                        info.checksummed = true;
                        payload = Some(bytes);
                    }
                    Err(e) => info.warning = Some(format!("sending no checksums: {e}")),
                }
            }
            info.checksum_seconds = started.elapsed().as_secs_f64();
            if let Some(w) = &info.warning {
                warn!(request_id, "{w}");
            }
        }
        let (respond, answer) = oneshot::channel();
        let data = Published {
            blocks,
            num_tokens,
            payload,
        };
        self.commands
            .send(Command::Publish {
                request_id: request_id.to_string(),
                data,
                key: load_key.to_string(),
                respond,
            })
            .map_err(|_| P2pError::Closed)?;
        match tokio::time::timeout(Duration::from_secs(10), answer).await {
            Ok(Ok(Ok(()))) => Ok(info),
            Ok(Ok(Err(why))) => Err(perr(PublishFailure::Refused(why))),
            _ => Err(P2pError::Closed),
        }
    }

    /// The load key of `request_id`'s lease while it is held or being served (`None` once
    /// released, never published, or the producer stopped), as the lease machine holds it.
    pub async fn load_key(&self, request_id: &str) -> Option<String> {
        let (respond, answer) = oneshot::channel();
        let ask = Command::LoadKey {
            request_id: request_id.to_string(),
            respond,
        };
        self.commands.send(ask).ok()?;
        tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .ok()?
            .ok()?
    }

    /// Takes the leases released since the last call (served, failed, expired):
    /// their blocks may be reused by the embedder.
    pub fn released(&self) -> Vec<Released> {
        std::mem::take(&mut *self.released.locked())
    }

    /// Stops the event loop and closes the ROUTER (loads in flight get no reply), within 5 s
    /// (past it the loop is aborted). Later calls return at once; publishes still running
    /// fail with [`P2pError::Closed`], as every call after it does. The workers stay with the
    /// producer until it is dropped.
    pub async fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let Some(mut task) = self.task.locked().take() else {
            return;
        };
        if tokio::time::timeout(Duration::from_secs(5), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }
}
