//! A small model on loopback for the connector's integration tests: 2 layers,
//! 2 KV heads, head size 8, bf16, block size 16, layout `KV B N H D`, held by
//! TP×PP ranks on each side; every rank has its own TCP transfer engine and CPU
//! checksum backend, and host memory registered with its engine. Also the tests' common load
//! (spec, configurations), fd helpers and raw ZMTP peers.
#![allow(dead_code)]

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use kvferry_checksum::group::{plan_group, CacheDesc, GroupPlan, RankInfo};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_kernels::{CpuBackend, LayerInput};
use kvferry_p2p::{
    ConsumerConfig, LoadGroup, LoadSpec, Producer, ProducerConfig, Worker, WorkerGroup,
};
use kvferry_transfer::{EngineConfig, Location, TransferEngine, TransportKind};
use rand::RngCore;
use rand_chacha::rand_core::SeedableRng;

pub const LAYERS: u32 = 2;
pub const KV_HEADS: u64 = 2;
pub const HEAD_DIM: u64 = 8;
/// (layers, KV heads, head size) of the test model.
pub const SMALL: (u32, u64, u64) = (LAYERS, KV_HEADS, HEAD_DIM);
pub const BLOCK: u64 = 16;
pub const WINDOW: u64 = 16;
/// Bytes of one Mamba-type state block of [`Side::hybrid`] (per layer).
pub const STATE_BYTES: u64 = 96;

/// Which groups a side holds.
#[derive(Clone, Copy)]
enum Groups {
    Full,
    Window,
    Hybrid,
}

thread_local! {
    /// The secret [`Side::authenticated`] gives the engines it builds.
    static SECRET: std::cell::RefCell<Option<kvferry_transfer::Secret>> = const { std::cell::RefCell::new(None) };
}

/// One side (producer or consumer): workers and the memory they point into.
/// `workers` is declared first so the engines drop before the memory.
pub struct Side {
    pub workers: Vec<Worker>,
    /// `memory[rank][i]`: the arrays of the rank's layers, group by group, in worker order.
    pub memory: Vec<Vec<Box<[u8]>>>,
}

impl Side {
    /// Builds a side of `tp × pp` ranks whose arrays hold `num_blocks` blocks,
    /// filled with seeded random bytes (`seed = None`: zeros).
    pub fn new(tp: u32, pp: u32, num_blocks: u64, seed: Option<u64>) -> Side {
        Side::build(
            tp,
            pp,
            num_blocks,
            seed,
            Groups::Full,
            "KV B N H D",
            SMALL,
            BLOCK,
        )
    }

    /// As [`Side::new`] with authenticated engines sharing `secret` (`kvferry_transfer::auth`).
    pub fn authenticated(
        tp: u32,
        pp: u32,
        num_blocks: u64,
        seed: Option<u64>,
        secret: kvferry_transfer::Secret,
    ) -> Side {
        SECRET.with(|s| *s.borrow_mut() = Some(secret));
        let side = Side::build(
            tp,
            pp,
            num_blocks,
            seed,
            Groups::Full,
            "KV B N H D",
            SMALL,
            BLOCK,
        );
        SECRET.with(|s| *s.borrow_mut() = None);
        side
    }

    /// As [`Side::new`] with group 0 in `layout`.
    pub fn with_layout(
        tp: u32,
        pp: u32,
        num_blocks: u64,
        seed: Option<u64>,
        layout: &'static str,
    ) -> Side {
        Side::build(tp, pp, num_blocks, seed, Groups::Full, layout, SMALL, BLOCK)
    }

    /// As [`Side::new`], plus group 1: a sliding-window group (window [`WINDOW`]
    /// tokens) in the FlashInfer layout `B KV N H D`, layers named `...sliding`.
    pub fn with_window(tp: u32, pp: u32, num_blocks: u64, seed: Option<u64>) -> Side {
        Side::build(
            tp,
            pp,
            num_blocks,
            seed,
            Groups::Window,
            "KV B N H D",
            SMALL,
            BLOCK,
        )
    }

    /// As [`Side::new`] with the model's shape `(layers, KV heads, head size)`.
    pub fn shaped(
        tp: u32,
        pp: u32,
        num_blocks: u64,
        seed: Option<u64>,
        shape: (u32, u64, u64),
    ) -> Side {
        Side::build(
            tp,
            pp,
            num_blocks,
            seed,
            Groups::Full,
            "KV B N H D",
            shape,
            BLOCK,
        )
    }

    /// As [`Side::new`] with blocks of `block` tokens in `layout`.
    pub fn sized(
        tp: u32,
        pp: u32,
        num_blocks: u64,
        seed: Option<u64>,
        layout: &'static str,
        block: u64,
    ) -> Side {
        Side::build(tp, pp, num_blocks, seed, Groups::Full, layout, SMALL, block)
    }

    /// A hybrid model with blocks of `block` tokens: group 0 full attention (`layout`), group 1
    /// sliding window ([`WINDOW`] tokens, `B KV N H D`), group 2 Mamba-type state (one state of
    /// [`STATE_BYTES`] per block, layout `B N D`, skipped by the checksum: no per-token blocks).
    pub fn hybrid(
        tp: u32,
        pp: u32,
        num_blocks: u64,
        seed: Option<u64>,
        layout: &'static str,
        block: u64,
    ) -> Side {
        Side::build(
            tp,
            pp,
            num_blocks,
            seed,
            Groups::Hybrid,
            layout,
            SMALL,
            block,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        tp: u32,
        pp: u32,
        num_blocks: u64,
        seed: Option<u64>,
        kinds: Groups,
        layout0: &'static str,
        (n_layers, kv_heads, head_dim): (u32, u64, u64),
        block: u64,
    ) -> Side {
        let mut workers = Vec::new();
        let mut memory = Vec::new();
        for pp_rank in 0..pp {
            for tp_rank in 0..tp {
                let rank = RankInfo {
                    tp_rank,
                    tp_size: tp,
                    pp_rank,
                    pp_size: pp,
                };
                // TP above the head count: each rank holds one head (replicated, as in vLLM).
                let heads = (kv_heads / tp as u64).max(1);
                let mut config = EngineConfig {
                    host: "127.0.0.1".into(),
                    port: 0,
                    transport: TransportKind::Tcp,
                    ..EngineConfig::default()
                };
                config.auth.secret = SECRET.with(|s| s.borrow().clone());
                let engine = TransferEngine::new(config).unwrap();
                let mut bufs = Vec::new();
                let mut groups = Vec::new();
                let kinds: &[(u32, &str, &str, Option<u64>)] = match kinds {
                    Groups::Full => &[(0, layout0, "attn", None)],
                    Groups::Window => &[
                        (0, layout0, "attn", None),
                        (1, "B KV N H D", "sliding", Some(WINDOW)),
                    ],
                    Groups::Hybrid => &[
                        (0, layout0, "attn", None),
                        (1, "B KV N H D", "sliding", Some(WINDOW)),
                        (2, "B N D", "mamba", None),
                    ],
                };
                for &(group_id, layout, suffix, sliding_window) in kinds {
                    let state = suffix == "mamba";
                    let layout = Layout::parse(layout).unwrap();
                    // A state block: one "token" of STATE_BYTES (one head).
                    let geometry = if state {
                        Geometry::contiguous(
                            layout,
                            num_blocks,
                            1,
                            1,
                            STATE_BYTES / 2,
                            ElemBytes::Two,
                            1,
                        )
                    } else {
                        Geometry::contiguous(
                            layout,
                            num_blocks,
                            block,
                            heads,
                            head_dim,
                            ElemBytes::Two,
                            1,
                        )
                    }
                    .unwrap();
                    let layers: Vec<u32> = (0..n_layers).filter(|l| l % pp == pp_rank).collect();
                    let caches: Vec<CacheDesc> = layers
                        .iter()
                        .map(|l| {
                            CacheDesc::new(
                                format!("model.layers.{l}.self_attn.{suffix}"),
                                Some(if sliding_window.is_some() {
                                    "SlidingWindowSpec"
                                } else if state {
                                    "MambaSpec"
                                } else {
                                    "FullAttentionSpec"
                                }),
                                Some("torch.bfloat16"),
                                geometry.clone(),
                            )
                        })
                        .map(|mut c| {
                            c.per_token_blocks = !state;
                            c
                        })
                        .collect();
                    let specs =
                        match plan_group(group_id, block, &caches, rank, Some(kv_heads as u32)) {
                            GroupPlan::Checksum { layers, .. } => layers,
                            // A state group: the layers as they are (whole, on every TP rank).
                            GroupPlan::Skipped { .. } if state => caches
                                .iter()
                                .map(|c| kvferry_checksum::group::LayerSpec {
                                    name: c.name.clone(),
                                    layer: 0,
                                    head_offset: 0,
                                    geometry: c.geometry.clone(),
                                    kind: c.kind.clone(),
                                    dtype: c.dtype.clone(),
                                    replica: kvferry_checksum::group::ReplicaKey::NONE,
                                })
                                .collect(),
                            GroupPlan::Skipped { reason, .. } => panic!("group skipped: {reason}"),
                        };
                    let mut inputs = Vec::new();
                    for spec in specs {
                        let len = spec.geometry.byte_len();
                        let mut buf = vec![0u8; len as usize].into_boxed_slice();
                        if let Some(seed) = seed {
                            // Replicas of a head (same layer, same heads) hold the same bytes.
                            let mut h = std::collections::hash_map::DefaultHasher::new();
                            (seed, &spec.name, spec.head_offset, heads).hash(&mut h);
                            rand_chacha::ChaCha8Rng::seed_from_u64(h.finish()).fill_bytes(&mut buf);
                        }
                        let addr = buf.as_ptr() as u64;
                        // SAFETY: the buffer lives in `memory` until after the engine is dropped.
                        unsafe { engine.register_memory(addr, len, Location::Cpu).unwrap() };
                        inputs.push(LayerInput { spec, addr, len });
                        bufs.push(buf);
                    }
                    groups.push(WorkerGroup {
                        group_id,
                        block_size: block,
                        layers: inputs,
                        sliding_window,
                        skipped: state
                            .then_some(kvferry_checksum::group::SkipReason::NoPerTokenBlocks),
                    });
                }
                workers.push(Worker {
                    rank,
                    engine,
                    device: Location::Cpu,
                    groups,
                    backend: Arc::new(CpuBackend::new(1)),
                });
                memory.push(bufs);
            }
        }
        Side { workers, memory }
    }

    /// The bytes of logical block `block` of layer index `layer` on worker `rank`.
    pub fn block_bytes(&self, rank: usize, layer: usize, block: u64) -> Vec<u8> {
        self.group_block_bytes(rank, 0, layer, block)
    }

    /// The bytes of logical block `block` of layer index `layer` of group `group` on worker `rank`.
    pub fn group_block_bytes(
        &self,
        rank: usize,
        group: usize,
        layer: usize,
        block: u64,
    ) -> Vec<u8> {
        let l = &self.workers[rank].groups[group].layers[layer];
        // SAFETY: the layer's array is one of this side's live buffers.
        let buf = unsafe { std::slice::from_raw_parts(l.addr as *const u8, l.len as usize) };
        l.spec
            .geometry
            .block_byte_ranges(block)
            .into_iter()
            .flat_map(|r| buf[r.start as usize..r.end as usize].to_vec())
            .collect()
    }

    /// The bytes of local head `head` of logical block `block` of layer index `layer` (group 0)
    /// on worker `rank`.
    pub fn head_bytes(&self, rank: usize, layer: usize, head: u64, block: u64) -> Vec<u8> {
        let l = &self.workers[rank].groups[0].layers[layer];
        // SAFETY: the layer's array is one of this side's live buffers.
        let buf = unsafe { std::slice::from_raw_parts(l.addr as *const u8, l.len as usize) };
        l.spec
            .geometry
            .block_head_byte_ranges(block, head..head + 1)
            .into_iter()
            .flat_map(|r| buf[r.start as usize..r.end as usize].to_vec())
            .collect()
    }

    /// Address of the first byte of token `token` (within the block), K part, head 0, element 0,
    /// of block `block` of layer index `layer` on worker `rank`.
    pub fn token_addr(&self, rank: usize, layer: usize, block: u64, token: u64) -> u64 {
        self.group_token_addr(rank, 0, layer, block, token)
    }

    /// As [`Side::token_addr`] in group `group`.
    pub fn group_token_addr(
        &self,
        rank: usize,
        group: usize,
        layer: usize,
        block: u64,
        token: u64,
    ) -> u64 {
        let l = &self.workers[rank].groups[group].layers[layer];
        l.addr + l.spec.geometry.byte_offset(0, block, token, 0, 0)
    }
}

// The tests' load: one request of 40 tokens in 3 blocks (the last one partly filled), at
// different block ids on each side, with the deadlines most tests share.

/// Tokens of the tests' request.
pub const NUM_TOKENS: u64 = 40;
/// Producer block ids of the tests' request (publish them as [`published_blocks`]).
pub const REMOTE_BLOCKS: [u64; 3] = [3, 5, 1];
/// Consumer block ids the tests' request lands in.
pub const LOCAL_BLOCKS: [u64; 3] = [7, 2, 10];

/// The block table to publish for the tests' request (group 0: [`REMOTE_BLOCKS`]).
pub fn published_blocks() -> Vec<Vec<Option<u64>>> {
    vec![REMOTE_BLOCKS.iter().map(|&b| Some(b)).collect()]
}

/// The tests' load of `request_id` from the producer at `endpoint` (`tcp://host:port`):
/// group 0, [`REMOTE_BLOCKS`] into [`LOCAL_BLOCKS`], [`NUM_TOKENS`] tokens, none computed
/// locally, with `load_key`.
pub fn spec_at(request_id: &str, endpoint: &str, load_key: Option<String>) -> LoadSpec {
    LoadSpec {
        request_id: request_id.into(),
        producer: endpoint.into(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: REMOTE_BLOCKS.iter().map(|&b| Some(b)).collect(),
            local_blocks: LOCAL_BLOCKS.iter().map(|&b| Some(b)).collect(),
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key,
    }
}

/// As [`spec_at`] from `producer`, with the load key it gives for `request_id`.
pub async fn spec(request_id: &str, producer: &Producer) -> LoadSpec {
    spec_at(
        request_id,
        producer.endpoint(),
        producer.load_key(request_id).await,
    )
}

/// A producer whose transfers end within 10 s.
pub fn producer_config() -> ProducerConfig {
    ProducerConfig {
        transfer_timeout: Duration::from_secs(10),
        ..ProducerConfig::default()
    }
}

/// A consumer (default policy) that waits 10 s for a reply and 20 s for a whole load.
pub fn consumer_config() -> ConsumerConfig {
    ConsumerConfig {
        reply_timeout: Duration::from_secs(10),
        max_wait: Duration::from_secs(20),
        ..ConsumerConfig::default()
    }
}

// File descriptors.

/// File descriptors this process has open now.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Lowers this process's `RLIMIT_NOFILE` (soft and hard) to `to` (it cannot be raised again:
/// a test that does this is alone in its binary).
pub fn lower_fd_limit(to: u64) {
    let r = libc::rlimit {
        rlim_cur: to,
        rlim_max: to,
    };
    // SAFETY: setrlimit reads the struct it is given.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
}

// Raw ZMTP 3.0 peers, spoken by hand.

/// A ZMTP 3.0 greeting with the NULL mechanism (64 bytes).
pub fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The READY command frame of a `socket_type` (`DEALER`, `ROUTER`) peer.
pub fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut f = vec![0x04, body.len() as u8];
    f.extend_from_slice(&body);
    f
}

/// A blocking raw TCP connection to `addr` from source IP `from` (127.0.0.x: Linux routes all
/// of 127/8 to loopback, so hostile peers are not the legitimate consumers' 127.0.0.1);
/// `None` when it cannot connect (as under a low fd limit).
pub async fn connect_from(from: &str, addr: &str) -> Option<std::net::TcpStream> {
    let sock = tokio::net::TcpSocket::new_v4().ok()?;
    sock.bind(format!("{from}:0").parse().ok()?).ok()?;
    let s = sock.connect(addr.parse().ok()?).await.ok()?;
    let s = s.into_std().ok()?;
    s.set_nonblocking(false).ok()?;
    Some(s)
}
