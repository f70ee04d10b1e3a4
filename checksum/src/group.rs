//! The layers of one KV cache group on one worker (docs/design.md §2.1, §2.3; the seed's
//! "Several caches per layer" and "How many ranks replicate a layer"): layer numbers,
//! global KV heads, replica keys, and the reasons a group cannot be checksummed.

use std::collections::BTreeMap;
use std::fmt;

use crate::layout::Geometry;

/// `H` of §2.1: a fixed bound on any layer's KV heads (global head numbers are below it), so
/// that head factors do not depend on the model's head counts or its TP split.
pub const MAX_KV_HEADS_PER_LAYER: u64 = 65536;

/// Which copy of replicated KV a layer's values describe (§2.3): `replicas` ranks hold the same
/// KV heads and this is copy `index` (`0 <= index < replicas`). Unreplicated KV is [`ReplicaKey::NONE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaKey {
    /// R: ranks holding the same KV heads.
    pub replicas: u32,
    /// k: this copy, `0..replicas`.
    pub index: u32,
}

impl ReplicaKey {
    /// Unreplicated KV: (1, 0).
    pub const NONE: ReplicaKey = ReplicaKey {
        replicas: 1,
        index: 0,
    };
}

/// One layer (one cache tensor) a worker checksums: its layer number (from its name), the
/// global index of its first local KV head, its array geometry and its replica key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSpec {
    /// Layer name, e.g. `model.layers.12.self_attn.attn`.
    pub name: String,
    /// Layer number `layer` of §2.1 (from the name).
    pub layer: u32,
    /// Global KV head index of local head 0 (rank offset plus the offset of earlier caches of
    /// the same layer).
    pub head_offset: u32,
    /// The layer's cache array on this rank.
    pub geometry: Geometry,
    /// Cache spec type (e.g. `FullAttentionSpec`), for the fingerprint.
    pub kind: Option<String>,
    /// Data type text (e.g. `torch.bfloat16`), for the fingerprint.
    pub dtype: Option<String>,
    /// Which copy of replicated KV this rank holds.
    pub replica: ReplicaKey,
}

/// Why a worker cannot checksum a group (the seed's skipped-group kinds). Both sides skipping a
/// group leaves it out of the verdict; one side skipping makes it unverified (§2.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SkipReason {
    /// Layers without per-token KV blocks (Mamba state).
    NoPerTokenBlocks,
    /// Compressed caches (`tokens_per_state != 1`).
    Compressed,
    /// KV heads packed into head slots.
    PackedHeadSlots,
    /// The group's KV lives in host memory the worker does not checksum.
    HostResident,
    /// A cell is not a whole number of 8-byte pieces.
    NotWholePieces,
    /// Kernel blocks do not tile the group's block size.
    KernelBlocksDoNotTile,
    /// Two caches of different layer modules share one layer number.
    DuplicateLayerNumber,
    /// A layer name without a (single) layer number.
    NoLayerNumber,
    /// How many ranks replicate a layer's KV heads cannot be determined.
    UnknownReplicas,
}

impl SkipReason {
    /// A short human text for logs.
    pub fn text(self) -> &'static str {
        match self {
            SkipReason::NoPerTokenBlocks => "layers without per-token KV blocks",
            SkipReason::Compressed => "compressed cache (tokens_per_state != 1)",
            SkipReason::PackedHeadSlots => "KV heads packed into head slots",
            SkipReason::HostResident => "host-resident KV cache",
            SkipReason::NotWholePieces => "cell is not a whole number of 8-byte pieces",
            SkipReason::KernelBlocksDoNotTile => "kernel blocks do not tile the block size",
            SkipReason::DuplicateLayerNumber => {
                "two caches of different modules share a layer number"
            }
            SkipReason::NoLayerNumber => "layer name without a layer number",
            SkipReason::UnknownReplicas => "cannot tell how many TP ranks replicate the KV heads",
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.text())
    }
}

/// One KV cache tensor as a worker sees it: name, spec kind, dtype, geometry on this rank, and
/// the facts that decide whether and how it is checksummed (§2.1, §2.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheDesc {
    /// Layer name (holds the layer number).
    pub name: String,
    /// Spec type, e.g. `FullAttentionSpec`, `MLAAttentionSpec` (a kind containing `MLA` is
    /// held whole by every TP rank unless `max_tp_shards` says otherwise).
    pub kind: Option<String>,
    /// Data type text, e.g. `torch.bfloat16`.
    pub dtype: Option<String>,
    /// The array on this rank (`heads` = KV heads on this rank).
    pub geometry: Geometry,
    /// False for state without per-token blocks (Mamba).
    pub per_token_blocks: bool,
    /// Tokens per stored state; anything but 1 is a compressed cache.
    pub tokens_per_state: u64,
    /// KV heads packed into head slots.
    pub packed_head_slots: bool,
    /// The cache lives in host memory (not checksummed by this worker).
    pub host_resident: bool,
    /// The most TP shards this cache's heads are split into; more TP ranks replicate them.
    pub max_tp_shards: Option<u32>,
    /// Name of the layer whose cache this one shares (KV sharing); counted once, under the lowest
    /// layer number.
    pub alias_of: Option<String>,
}

impl CacheDesc {
    /// A plain per-token cache with no flags set.
    pub fn new(
        name: impl Into<String>,
        kind: Option<&str>,
        dtype: Option<&str>,
        geometry: Geometry,
    ) -> CacheDesc {
        CacheDesc {
            name: name.into(),
            kind: kind.map(str::to_string),
            dtype: dtype.map(str::to_string),
            geometry,
            per_token_blocks: true,
            tokens_per_state: 1,
            packed_head_slots: false,
            host_resident: false,
            max_tp_shards: None,
            alias_of: None,
        }
    }
}

/// A worker's place: TP rank and size, PP rank and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankInfo {
    /// TP rank, `0..tp_size`.
    pub tp_rank: u32,
    /// TP size.
    pub tp_size: u32,
    /// PP rank, `0..pp_size`.
    pub pp_rank: u32,
    /// PP size.
    pub pp_size: u32,
}

impl RankInfo {
    /// A single worker (TP1, PP1).
    pub const SINGLE: RankInfo = RankInfo {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
    };
}

/// What one worker does for one group: checksum these layers, or skip with a reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupPlan {
    /// Checksum `layers` (sorted by layer number, then name).
    Checksum {
        /// KV cache group id.
        group_id: u32,
        /// Tokens per logical block.
        block_size: u64,
        /// The layers with their global heads and replica keys.
        layers: Vec<LayerSpec>,
    },
    /// The group cannot be checksummed on this worker.
    Skipped {
        /// KV cache group id.
        group_id: u32,
        /// Why.
        reason: SkipReason,
    },
}

/// The layer number in a layer name: the single dot-separated component made only of digits
/// (`model.layers.12.self_attn.attn` → 12). `None` when there is none or more than one.
pub fn parse_layer_number(name: &str) -> Option<u32> {
    let mut found = None;
    for part in name.split('.') {
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            if found.is_some() {
                return None;
            }
            found = Some(part.parse::<u32>().ok()?);
        }
    }
    found
}

/// The layer module of a name: everything up to and including its layer number component
/// (`model.layers.0.self_attn.indexer.k_cache` → `model.layers.0`).
fn layer_module(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    let at = parts
        .iter()
        .position(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        .unwrap_or(parts.len());
    parts[..(at + 1).min(parts.len())].join(".")
}

/// Replication of one cache across TP: (replicas R, shards = tp_size / R).
fn replicas_of(c: &CacheDesc, tp_size: u32, model_kv_heads: Option<u32>) -> Option<u32> {
    let is_mla = c.kind.as_deref().is_some_and(|k| k.contains("MLA"));
    let shards_cap = match c.max_tp_shards {
        Some(0) => return None,
        Some(s) => Some(s),
        None if is_mla => Some(1),
        None => None,
    };
    let r = match shards_cap {
        Some(s) if tp_size <= s => 1,
        Some(s) => {
            if !tp_size.is_multiple_of(s) {
                return None;
            }
            tp_size / s
        }
        None if c.geometry.heads > 1 || tp_size == 1 => 1,
        // One head per rank: replicated iff TP exceeds the model's KV heads.
        None => {
            let kv = model_kv_heads?;
            if kv == 0 {
                return None;
            }
            if tp_size <= kv {
                1
            } else if tp_size.is_multiple_of(kv) {
                tp_size / kv
            } else {
                return None;
            }
        }
    };
    Some(r)
}

/// Plans group `group_id` (block size `block_size`) on the worker at `rank` holding `caches`
/// (§2.1, §2.3): checks every cache can be checksummed, numbers layers from their names,
/// gives each its global KV heads (rank offset; caches of one layer module take consecutive
/// heads in name order) and its replica key; KV shared between layers (`alias_of`) is counted
/// once, under the lowest layer number. `model_kv_heads` resolves GQA caches with one head
/// per rank. The first failing check decides the [`SkipReason`].
pub fn plan_group(
    group_id: u32,
    block_size: u64,
    caches: &[CacheDesc],
    rank: RankInfo,
    model_kv_heads: Option<u32>,
) -> GroupPlan {
    let skip = |reason| GroupPlan::Skipped { group_id, reason };
    for c in caches {
        let g = &c.geometry;
        let reason = if !c.per_token_blocks {
            Some(SkipReason::NoPerTokenBlocks)
        } else if c.tokens_per_state != 1 {
            Some(SkipReason::Compressed)
        } else if c.packed_head_slots {
            Some(SkipReason::PackedHeadSlots)
        } else if c.host_resident {
            Some(SkipReason::HostResident)
        } else if g.pieces_per_cell().is_none() {
            Some(SkipReason::NotWholePieces)
        } else if g.block_size() != block_size {
            Some(SkipReason::KernelBlocksDoNotTile)
        } else if parse_layer_number(&c.name).is_none() {
            Some(SkipReason::NoLayerNumber)
        } else {
            None
        };
        if let Some(r) = reason {
            return skip(r);
        }
    }
    // KV sharing: one tensor under several names counts once, under its lowest layer number.
    let mut by_root: BTreeMap<&str, &CacheDesc> = BTreeMap::new();
    for c in caches {
        let root = c.alias_of.as_deref().unwrap_or(&c.name);
        let layer = parse_layer_number(&c.name).unwrap_or(u32::MAX);
        match by_root.get(root) {
            Some(prev)
                if (
                    parse_layer_number(&prev.name).unwrap_or(u32::MAX),
                    &prev.name,
                ) <= (layer, &c.name) => {}
            _ => {
                by_root.insert(root, c);
            }
        }
    }
    // Caches per layer number, sorted by name; one layer number must be one module.
    let mut by_layer: BTreeMap<u32, Vec<&CacheDesc>> = BTreeMap::new();
    for c in by_root.values() {
        by_layer
            .entry(parse_layer_number(&c.name).unwrap_or(u32::MAX))
            .or_default()
            .push(c);
    }
    let tp = rank.tp_size.max(1);
    let mut layers = Vec::new();
    for (layer, mut cs) in by_layer {
        cs.sort_by(|a, b| a.name.cmp(&b.name));
        let module = layer_module(&cs[0].name);
        if cs.iter().any(|c| layer_module(&c.name) != module) {
            return skip(SkipReason::DuplicateLayerNumber);
        }
        let mut base: u64 = 0;
        for c in cs {
            let Some(r) = replicas_of(c, tp, model_kv_heads) else {
                return skip(SkipReason::UnknownReplicas);
            };
            let shards = (tp / r) as u64;
            let shard = (rank.tp_rank / r) as u64;
            let heads = c.geometry.heads;
            let offset = base + shard * heads;
            base += shards * heads;
            if base > MAX_KV_HEADS_PER_LAYER {
                return skip(SkipReason::UnknownReplicas);
            }
            layers.push(LayerSpec {
                name: c.name.clone(),
                layer,
                head_offset: offset as u32,
                geometry: c.geometry.clone(),
                kind: c.kind.clone(),
                dtype: c.dtype.clone(),
                replica: ReplicaKey {
                    replicas: r,
                    index: rank.tp_rank % r,
                },
            });
        }
    }
    GroupPlan::Checksum {
        group_id,
        block_size,
        layers,
    }
}
