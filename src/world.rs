//! One side's KV caches as a serving engine would hold them: a worker per TP×PP
//! rank, each with its own memory (one arena holding all its layers' arrays),
//! its own transfer engine, and the layers it holds (PP splits layers, TP splits
//! KV heads or replicates them). Used by `demo`, `serve` and `load`.
//!
//! Sources: docs/design.md §2.2 (layouts), §2.3 (replicas), §3 (registration), §4 (ranks).

use std::sync::Arc;

mod shape;
pub use shape::ShapeFault;

use kvferry_checksum::group::{plan_group, CacheDesc, GroupPlan, LayerSpec, RankInfo};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_kernels::cuda::driver::{copy_dtoh_async, copy_htod_async, DeviceBuffer, Stream};
use kvferry_kernels::cuda::CudaBackend;
use kvferry_kernels::KernelError;
use kvferry_p2p::proto::heads::HeadMap;
use kvferry_transfer::{EngineConfig, Location, TransferEngine, TransferError, TransportKind};
use memmap2::MmapMut;

use crate::models::{ModelShape, STATE_GROUP};
pub use crate::pool::BlockPool;

/// The group of full-attention layers (every layer of a model that is not hybrid).
pub const GROUP_ID: u32 = crate::models::FULL_GROUP;

/// What shapes one side (producer or consumer) of the demo.
#[derive(Debug, Clone)]
pub struct SideConfig {
    /// The model whose KV caches are held.
    pub model: ModelShape,
    /// TP ranks.
    pub tp: u32,
    /// PP stages.
    pub pp: u32,
    /// Tokens per block.
    pub block_size: u64,
    /// Layout of each layer's array (ignored for MLA, which is always `B N D`).
    pub layout: String,
    /// Logical blocks per layer array.
    pub num_blocks: u64,
    /// Transport of each rank's engine.
    pub transport: TransportKind,
    /// Where the KV caches live: host memory, or the memory of GPU `n` (`cuda:n`).
    pub location: Location,
}

/// One layer's array inside a rank's arena.
#[derive(Debug, Clone)]
pub struct LayerAlloc {
    /// The KV cache group the layer belongs to ([`crate::models::ModelShape::group_of`]).
    pub group: u32,
    /// The layer as the checksum sees it (global heads, replica key).
    pub spec: LayerSpec,
    /// Byte offset of the array in the arena.
    pub offset: u64,
}

/// GPU memory of a rank: the device arena, a host shadow the demo writes KV into
/// before uploading it (the "prefill"), and the stream the copies run on.
struct GpuArena {
    dev: DeviceBuffer,
    stream: Stream,
    // Keeps the device's context alive as long as the buffer.
    _backend: CudaBackend,
}

/// One rank's KV memory and transfer engine.
pub struct RankKv {
    /// TP/PP place of this rank.
    pub rank: RankInfo,
    /// The rank's layers, in layer order.
    pub layers: Vec<LayerAlloc>,
    /// Host memory every layer lives in (registered with `engine`); with GPU memory,
    /// the host shadow of the device arena.
    arena: MmapMut,
    /// The device arena, when the KV lives on a GPU (registered with `engine` instead).
    gpu: Option<GpuArena>,
    /// Where the registered memory lives (`cuda:N` with a device arena, else `cpu`).
    location: Location,
    /// The rank's transfer engine.
    pub engine: Arc<TransferEngine>,
}

impl RankKv {
    /// Base address of the arena (a device address with GPU memory).
    pub fn base(&self) -> u64 {
        match &self.gpu {
            Some(g) => g.dev.ptr(),
            None => self.arena.as_ptr() as u64,
        }
    }

    /// Copies the byte ranges of `blocks` of every layer between the host shadow and
    /// the device arena (`up`: host → device). No-op for host memory.
    fn copy_blocks(&mut self, blocks: &[u64], up: bool) -> Result<(), WorldError> {
        let Some(g) = &self.gpu else { return Ok(()) };
        for l in &self.layers {
            for &b in blocks {
                for r in l.spec.geometry.block_byte_ranges(b) {
                    let (off, len) = ((l.offset + r.start) as usize, (r.end - r.start) as usize);
                    // SAFETY: both ranges lie inside their arenas (same layout); the
                    // stream is synchronised before the host buffer is touched again.
                    unsafe {
                        if up {
                            copy_htod_async(
                                g.dev.ptr() + off as u64,
                                self.arena.as_ptr().add(off),
                                len,
                                g.stream.raw(),
                            )
                            .map_err(WorldError::Cuda)?;
                        } else {
                            copy_dtoh_async(
                                self.arena.as_mut_ptr().add(off),
                                g.dev.ptr() + off as u64,
                                len,
                                g.stream.raw(),
                            )
                            .map_err(WorldError::Cuda)?;
                        }
                    }
                }
            }
        }
        g.stream.synchronize().map_err(WorldError::Cuda)
    }

    /// Makes the host view of `blocks` current (downloads them from the GPU).
    pub fn download_blocks(&mut self, blocks: &[u64]) -> Result<(), WorldError> {
        self.copy_blocks(blocks, false)
    }

    /// Where the memory lives (shown as `cpu` or `cuda:N`).
    pub fn location(&self) -> Location {
        self.location
    }

    /// Address of layer `i`'s array.
    pub fn layer_addr(&self, i: usize) -> u64 {
        self.base() + self.layers[i].offset
    }

    /// Layer `i`'s array (the host view).
    pub fn layer_bytes(&self, i: usize) -> &[u8] {
        let l = &self.layers[i];
        &self.arena[l.offset as usize..(l.offset + l.spec.geometry.byte_len()) as usize]
    }
}

/// Why one side's ranks could not be built or their memory copied.
#[derive(Debug, thiserror::Error)]
pub enum WorldError {
    /// Sizes, a layout or a model the demo's sides cannot be built with.
    #[error("{0}")]
    Shape(#[from] ShapeFault),
    /// The layout or the geometry is invalid.
    #[error(transparent)]
    Layout(#[from] kvferry_checksum::layout::LayoutError),
    /// The checksum cannot cover a rank's group.
    #[error("{}: the KV cache group cannot be checksummed: {reason}", rank_name(*.rank))]
    Skipped {
        /// The rank.
        rank: kvferry_checksum::group::RankInfo,
        /// Why.
        reason: kvferry_checksum::group::SkipReason,
    },
    /// The host memory of a rank could not be mapped.
    #[error("allocating {bytes} bytes of KV memory: {source}")]
    Alloc {
        /// Bytes asked for.
        bytes: u64,
        /// Why.
        source: std::io::Error,
    },
    /// The GPU cannot be used.
    #[error("--device cuda: GPU {ordinal} unusable: {source}")]
    Gpu {
        /// The GPU.
        ordinal: u32,
        /// Why.
        source: KernelError,
    },
    /// A CUDA driver call failed (stream, copy): the driver's error.
    #[error("{0}")]
    Cuda(#[from] kvferry_cuda::CudaError),
    /// A rank's KV memory could not be allocated on its GPU.
    #[error("allocating {bytes} bytes on cuda:{ordinal}: {source}")]
    GpuAlloc {
        /// Bytes asked for.
        bytes: usize,
        /// The GPU.
        ordinal: u32,
        /// The driver's error.
        source: kvferry_cuda::CudaError,
    },
    /// A rank's transfer engine did not start.
    #[error("starting the transfer engine of {}: {source}", rank_name(*.rank))]
    Engine {
        /// The rank.
        rank: kvferry_checksum::group::RankInfo,
        /// Why.
        source: TransferError,
    },
    /// A request's KV could not be generated ("prefill").
    #[error(transparent)]
    Fill(#[from] crate::fill::FillError),
    /// A rank's KV memory could not be registered with its engine.
    #[error("registering KV memory of {}: {source}", rank_name(*.rank))]
    Register {
        /// The rank.
        rank: kvferry_checksum::group::RankInfo,
        /// Why.
        source: TransferError,
    },
}

/// "TP rank 1/2, PP rank 0/1": a rank for messages.
pub fn rank_name(r: RankInfo) -> String {
    format!(
        "TP rank {}/{}, PP rank {}/{}",
        r.tp_rank, r.tp_size, r.pp_rank, r.pp_size
    )
}

/// Which layers PP stage `stage` of `pp` holds: a contiguous run, earlier stages
/// taking one more when the count does not divide.
pub fn stage_layers(layers: u32, pp: u32, stage: u32) -> std::ops::Range<u32> {
    let base = layers / pp;
    let extra = layers % pp;
    let start = stage * base + stage.min(extra);
    let len = base + u32::from(stage < extra);
    start..start + len
}

/// Builds the ranks of one side: plans each rank's layers (global heads,
/// replicas) with the checksum crate, allocates and registers each rank's arena
/// with a new transfer engine.
///
/// Errors: a TP size the model's heads cannot be split into, a bad layout, a
/// layer the checksum cannot cover, an engine or registration failure.
pub fn build_side(cfg: &SideConfig, engine_cfg: &EngineConfig) -> Result<Vec<RankKv>, WorldError> {
    let all_layers = cfg.model.layers + cfg.model.state_layers;
    if cfg.tp == 0 || cfg.pp == 0 || cfg.pp > all_layers {
        return Err(ShapeFault::Parallelism {
            tp: cfg.tp,
            pp: cfg.pp,
            layers: all_layers,
        }
        .into());
    }
    let m = &cfg.model;
    if !m.mla && m.kv_heads > cfg.tp && !m.kv_heads.is_multiple_of(cfg.tp) {
        return Err(ShapeFault::HeadsSplit {
            tp: cfg.tp,
            heads: m.kv_heads,
        }
        .into());
    }
    if !m.mla && cfg.tp > m.kv_heads && !cfg.tp.is_multiple_of(m.kv_heads) {
        return Err(ShapeFault::NotHeadMultiple {
            tp: cfg.tp,
            heads: m.kv_heads,
        }
        .into());
    }
    let layout_text = if m.mla { "B N D" } else { cfg.layout.as_str() };
    let layout = Layout::parse(layout_text)?;
    if m.mla == layout.has_kv() {
        return Err(ShapeFault::KvDim {
            layout: layout_text.to_string(),
            model: m.name,
            mla: m.mla,
        }
        .into());
    }
    if layout.dims().last() != Some(&kvferry_checksum::layout::Dim::D) {
        return Err(ShapeFault::DNotInnermost(layout_text.to_string()).into());
    }
    let heads_per_rank = if m.mla {
        1
    } else {
        (m.kv_heads / cfg.tp).max(1)
    } as u64;
    if !layout.has_heads() && heads_per_rank != 1 {
        return Err(ShapeFault::NoHeadDim {
            layout: layout_text.to_string(),
            heads_per_rank,
        }
        .into());
    }
    let elem = ElemBytes::new(m.elem_bytes)?;
    let mut ranks = Vec::new();
    for pp_rank in 0..cfg.pp {
        for tp_rank in 0..cfg.tp {
            let rank = RankInfo {
                tp_rank,
                tp_size: cfg.tp,
                pp_rank,
                pp_size: cfg.pp,
            };
            let stage = stage_layers(all_layers, cfg.pp, pp_rank);
            let mut specs = Vec::new();
            for group in m.groups() {
                let in_group: Vec<u32> =
                    stage.clone().filter(|&l| m.group_of(l) == group).collect();
                if group == STATE_GROUP {
                    specs.extend(state_specs(
                        m,
                        &in_group,
                        rank,
                        heads_per_rank,
                        cfg.num_blocks,
                    )?);
                    continue;
                }
                let mut caches = Vec::new();
                for &layer in &in_group {
                    let g = Geometry::contiguous(
                        layout.clone(),
                        cfg.num_blocks,
                        cfg.block_size,
                        heads_per_rank,
                        m.head_dim,
                        elem,
                        1,
                    )?;
                    caches.push(CacheDesc::new(
                        m.layer_name(layer),
                        Some(m.kind(group)),
                        Some(m.dtype),
                        g,
                    ));
                }
                match plan_group(group, cfg.block_size, &caches, rank, Some(m.kv_heads)) {
                    GroupPlan::Checksum { layers, .. } => {
                        specs.extend(layers.into_iter().map(|l| (group, l)))
                    }
                    GroupPlan::Skipped { reason, .. } => {
                        return Err(WorldError::Skipped { rank, reason })
                    }
                }
            }
            let mut layers = Vec::with_capacity(specs.len());
            let mut offset = 0u64;
            for (group, spec) in specs {
                let len = spec.geometry.byte_len();
                layers.push(LayerAlloc {
                    group,
                    spec,
                    offset,
                });
                offset += len.next_multiple_of(4096);
            }
            let arena = MmapMut::map_anon(offset.max(4096) as usize).map_err(|source| {
                WorldError::Alloc {
                    bytes: offset,
                    source,
                }
            })?;
            let gpu = match cfg.location {
                Location::Cpu => None,
                Location::Cuda(n) => {
                    let backend = CudaBackend::shared(n)
                        .map_err(|source| WorldError::Gpu { ordinal: n, source })?;
                    let dev =
                        DeviceBuffer::new(backend.context(), arena.len()).map_err(|source| {
                            WorldError::GpuAlloc {
                                bytes: arena.len(),
                                ordinal: n,
                                source,
                            }
                        })?;
                    let stream = Stream::new(backend.context()).map_err(WorldError::Cuda)?;
                    Some(GpuArena {
                        dev,
                        stream,
                        _backend: backend,
                    })
                }
            };
            let mut ecfg = engine_cfg.clone();
            ecfg.transport = cfg.transport;
            let engine =
                TransferEngine::new(ecfg).map_err(|source| WorldError::Engine { rank, source })?;
            let (addr, location) = match &gpu {
                Some(g) => (g.dev.ptr(), cfg.location),
                None => (arena.as_ptr() as u64, Location::Cpu),
            };
            // SAFETY: the memory lives as long as the RankKv, which owns the engine handle;
            // the engine is told to forget the region in Drop below.
            unsafe { engine.register_memory(addr, arena.len() as u64, location) }
                .map_err(|source| WorldError::Register { rank, source })?;
            ranks.push(RankKv {
                rank,
                layers,
                location,
                arena,
                gpu,
                engine,
            });
        }
    }
    Ok(ranks)
}

/// The specs of the state layers `layers` of `m` (group [`STATE_GROUP`]) on `rank`: one state
/// of `state_bytes` per block (layout `B N H D`, one "token" per block, the state's heads
/// split over TP as the KV heads), with global head offsets as the attention layers have them.
/// The checksum skips the group (no per-token blocks); the planner maps its heads between TP
/// sizes.
fn state_specs(
    m: &ModelShape,
    layers: &[u32],
    rank: RankInfo,
    heads_per_rank: u64,
    num_blocks: u64,
) -> Result<Vec<(u32, LayerSpec)>, WorldError> {
    let per_head = m.state_bytes / m.kv_heads.max(1) as u64;
    if per_head == 0 || !per_head.is_multiple_of(m.elem_bytes) {
        return Err(ShapeFault::StateSplit {
            model: m.name,
            state_bytes: m.state_bytes,
            heads: m.kv_heads,
        }
        .into());
    }
    let elem = ElemBytes::new(m.elem_bytes)?;
    // TP above the head count replicates one head on consecutive ranks (as KV heads).
    let replicas = (rank.tp_size / m.kv_heads.max(1)).max(1);
    let head_offset = (rank.tp_rank / replicas) * heads_per_rank as u32;
    layers
        .iter()
        .map(|&layer| {
            let geometry = Geometry::contiguous(
                Layout::parse("B N H D")?,
                num_blocks,
                1,
                heads_per_rank,
                per_head / m.elem_bytes,
                elem,
                1,
            )?;
            Ok((
                STATE_GROUP,
                LayerSpec {
                    name: m.layer_name(layer),
                    layer,
                    head_offset,
                    geometry,
                    kind: Some(m.kind(STATE_GROUP).to_string()),
                    dtype: Some(m.dtype.to_string()),
                    replica: kvferry_checksum::group::ReplicaKey::NONE,
                },
            ))
        })
        .collect()
}

impl Drop for RankKv {
    fn drop(&mut self) {
        // The engine may outlive this arena (shared Arc): make it forget the memory first.
        let _ = self.engine.unregister_memory(self.base());
    }
}

/// "Prefill": writes request `request`'s KV into `blocks` (block ids in request
/// order) of every layer of `rank`, every slot of every block (also those past the
/// prompt's end), from seeded pseudo-random bytes that depend only on (seed,
/// request, layer, global head, token): the same prompt gives the same bytes per token on
/// sides of different block sizes ([`crate::fill`], the layers on threads of their own).
/// Returns the bytes written.
///
/// Errors: a fill thread the OS refuses ([`WorldError::Fill`]), a failed upload to GPU memory.
pub fn fill_request(
    rank: &mut RankKv,
    seed: u64,
    request: u64,
    blocks: &[u64],
) -> Result<u64, WorldError> {
    // Each layer's own bytes of the arena (the layers lie in order, apart).
    let mut parts = Vec::with_capacity(rank.layers.len());
    let mut rest = &mut rank.arena[..];
    let mut at = 0u64;
    for l in &rank.layers {
        let skip = std::mem::take(&mut rest)
            .split_at_mut((l.offset - at) as usize)
            .1;
        let (layer, tail) = skip.split_at_mut(l.spec.geometry.byte_len() as usize);
        parts.push((layer, &l.spec));
        (rest, at) = (tail, l.offset + l.spec.geometry.byte_len());
    }
    let written = crate::fill::fill_layers(parts, seed, request, blocks)?;
    rank.copy_blocks(blocks, true)?;
    Ok(written)
}

/// The block tables a serving engine keeps for a `tokens`-token request in `blocks` (ids in
/// request order, blocks of `block_size` tokens), one per KV cache group of `model`, indexed
/// by group id: full attention holds every block; a sliding-window group's blocks wholly
/// before the window are null (freed, as vLLM's sliding-window manager does); a state group
/// holds only its last block (the state after the prompt).
pub fn request_tables(
    model: &ModelShape,
    blocks: &[u64],
    tokens: u64,
    block_size: u64,
) -> Vec<Vec<Option<u64>>> {
    let groups = model.groups();
    let n = groups.iter().max().map_or(0, |g| *g as usize + 1);
    let mut tables = vec![Vec::new(); n];
    for g in groups {
        let first = match (g, model.window(g)) {
            (STATE_GROUP, _) => blocks.len().saturating_sub(1) as u64,
            (_, Some(w)) => tokens.saturating_sub(w) / block_size,
            _ => 0,
        };
        tables[g as usize] = blocks
            .iter()
            .enumerate()
            .map(|(i, &b)| (i as u64 >= first).then_some(b))
            .collect();
    }
    tables
}

/// Flips bit `bit` (0..8) of the byte of token `token` (< the prompt's tokens)
/// of `rank`'s layer `layer`, head `head`, part `part`, element byte `byte`, in
/// the block `blocks[token / block_size]`: a corruption the checksum must see.
/// With GPU memory the byte is flipped in device memory.
///
/// Errors: a failed copy to or from GPU memory.
#[allow(clippy::too_many_arguments)]
pub fn flip_bit(
    rank: &mut RankKv,
    layer: usize,
    blocks: &[u64],
    token: u64,
    head: u64,
    part: u64,
    byte: u64,
    bit: u8,
) -> Result<(), WorldError> {
    let l = rank.layers[layer].clone();
    let g = &l.spec.geometry;
    let block = blocks[(token / g.block_size()) as usize];
    let t = token % g.block_size();
    let kb = block * g.kernel_blocks_per_block + t / g.tokens_per_kernel_block;
    let (d, b) = (byte / g.elem.get(), byte % g.elem.get());
    let at =
        (l.offset + g.byte_offset(part, kb, t % g.tokens_per_kernel_block, head, d) + b) as usize;
    match &rank.gpu {
        None => rank.arena[at] ^= 1 << bit,
        Some(gpu) => {
            let mut b = [0u8; 1];
            // SAFETY: `at` lies inside the device arena; the stream is synchronised
            // before `b` is read or dropped.
            unsafe {
                copy_dtoh_async(
                    b.as_mut_ptr(),
                    gpu.dev.ptr() + at as u64,
                    1,
                    gpu.stream.raw(),
                )
                .map_err(WorldError::Cuda)?;
                gpu.stream.synchronize().map_err(WorldError::Cuda)?;
                b[0] ^= 1 << bit;
                copy_htod_async(gpu.dev.ptr() + at as u64, b.as_ptr(), 1, gpu.stream.raw())
                    .map_err(WorldError::Cuda)?;
                gpu.stream.synchronize().map_err(WorldError::Cuda)?;
            }
        }
    }
    Ok(())
}

/// Whether the consumer side's KV of tokens `[0, tokens)` in `blocks_b` equals the producer
/// side's in `blocks_a` (token by token, so the two sides may have different block sizes),
/// compared per layer and global KV head, so the two sides may have different TP and PP sizes:
/// every head of every consumer rank's layer is compared with the producer rank the planner
/// takes it from (the producer's [`HeadMap`], as in `kvferry_p2p::proto::serve::plan`). False
/// when a consumer head has no producer holder or a block list is too short. A state layer's
/// last block is compared (the request's state). `group`: only that group's layers. Host
/// shadows are compared: download GPU blocks first.
pub fn sides_kv_equal(
    a: &[RankKv],
    blocks_a: &[u64],
    b: &[RankKv],
    blocks_b: &[u64],
    tokens: u64,
    group: Option<u32>,
) -> bool {
    // The cell of token `t` of head `head` of layer `i` of rank `r` (D innermost: the demo's
    // layouts all have it).
    let cell = |r: &RankKv, i: usize, blocks: &[u64], head: u64, t: u64| -> Option<Vec<u8>> {
        let g = &r.layers[i].spec.geometry;
        let (bs, n) = (g.block_size(), g.tokens_per_kernel_block);
        let block = *blocks.get((t / bs) as usize)?;
        let kb = block * g.kernel_blocks_per_block + (t % bs) / n;
        let bytes = r.layer_bytes(i);
        let chunk = g.head_dim * g.elem.get();
        let mut out = Vec::with_capacity((chunk * g.parts()) as usize);
        for part in 0..g.parts() {
            let at = g.byte_offset(part, kb, (t % bs) % n, head, 0) as usize;
            out.extend_from_slice(bytes.get(at..at + chunk as usize)?);
        }
        Some(out)
    };
    let heads = HeadMap::of_ranks(a.iter().map(|r| r.layers.iter().map(|l| &l.spec)));
    for rb in b {
        for (ib, lb) in rb.layers.iter().enumerate() {
            if group.is_some_and(|g| g != lb.group) {
                continue;
            }
            for j in 0..lb.spec.geometry.heads {
                let h = lb.spec.head_offset as u64 + j;
                let Some(holder) = heads.pick(&lb.spec.name, h, rb.rank.tp_rank) else {
                    return false;
                };
                let (ra, ia, ha) = (&a[holder.rank], holder.layer, h - holder.first());
                if lb.group == STATE_GROUP {
                    // One state per block: the request's state is its last block's.
                    let last = |blocks: &[u64]| blocks.len().checked_sub(1).map(|i| i as u64);
                    match (last(blocks_a), last(blocks_b)) {
                        (Some(x), Some(y))
                            if cell(ra, ia, blocks_a, ha, x) == cell(rb, ib, blocks_b, j, y) => {}
                        _ => return false,
                    }
                    continue;
                }
                for t in 0..tokens {
                    match (cell(ra, ia, blocks_a, ha, t), cell(rb, ib, blocks_b, j, t)) {
                        (Some(x), Some(y)) if x == y => {}
                        _ => return false,
                    }
                }
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(tp: u32, pp: u32, layout: &str) -> SideConfig {
        SideConfig {
            model: crate::models::MODELS[0].clone(),
            tp,
            pp,
            block_size: 16,
            layout: layout.to_string(),
            num_blocks: 4,
            transport: TransportKind::Tcp,
            location: Location::Cpu,
        }
    }

    #[test]
    fn a_side_that_cannot_be_built_says_why_in_a_typed_fault() {
        let shape = |cfg: SideConfig| match build_side(&cfg, &EngineConfig::default()) {
            Err(WorldError::Shape(f)) => f,
            other => panic!("{:?}", other.map(|r| r.len())),
        };
        let layers = crate::models::MODELS[0].layers + crate::models::MODELS[0].state_layers;
        assert_eq!(
            shape(side(0, 1, "KV B N H D")),
            ShapeFault::Parallelism {
                tp: 0,
                pp: 1,
                layers
            }
        );
        assert_eq!(
            shape(side(3, 1, "KV B N H D")),
            ShapeFault::HeadsSplit { tp: 3, heads: 8 }
        );
        assert_eq!(
            shape(side(1, 1, "KV B N D H")),
            ShapeFault::DNotInnermost("KV B N D H".into())
        );
    }

    #[test]
    fn stages_cover_all_layers_once() {
        for layers in 1..40 {
            for pp in 1..=layers.min(5) {
                let mut next = 0;
                for s in 0..pp {
                    let r = stage_layers(layers, pp, s);
                    assert_eq!(r.start, next);
                    assert!(!r.is_empty());
                    next = r.end;
                }
                assert_eq!(next, layers);
            }
        }
    }
}
