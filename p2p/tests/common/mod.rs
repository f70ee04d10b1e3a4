//! A small model on loopback for the connector's integration tests: 2 layers,
//! 2 KV heads, head size 8, bf16, block size 16, layout `KV B N H D`, held by
//! TP×PP ranks on each side; every rank has its own TCP transfer engine and CPU
//! checksum backend, and host memory registered with its engine.
#![allow(dead_code)]

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use kvferry_checksum::group::{plan_group, CacheDesc, GroupPlan, RankInfo};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_kernels::{CpuBackend, LayerInput};
use kvferry_p2p::{Worker, WorkerGroup};
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
