//! A simulated model for the checksum tests: logical KV content derived from a seed, an
//! independent oracle of the definition (docs/design.md §2.1) computed from the logical KV alone, and
//! workers that hold their TP/PP share of it in any layout and build records the way a real
//! worker does (plan_group → select → layer_block_checksum).
#![allow(dead_code)]

use std::collections::BTreeMap;

use kvferry_checksum::definition::layer_block_checksum;
use kvferry_checksum::fingerprint::layer_fingerprint;
use kvferry_checksum::group::{plan_group, CacheDesc, GroupPlan, RankInfo};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_checksum::record::{GroupRecord, WorkerRecord};
use kvferry_checksum::select::BlockSelection;

pub const LAYOUTS: [&str; 6] = [
    "KV B N H D",
    "B KV N H D",
    "B KV H N D",
    "B H N KV D",
    "H KV B D N",
    "D N H KV B",
];

pub fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One cache tensor of the model (unsharded).
#[derive(Debug, Clone)]
pub struct ModelCache {
    pub name: String,
    pub kind: String,
    pub dtype: String,
    /// Layer number (as in the name).
    pub layer: u32,
    /// Global head of this cache's head 0 within its layer (caches of one layer take
    /// consecutive heads in name order).
    pub head_base: u32,
    /// KV heads of the whole model for this cache.
    pub heads: u32,
    pub head_dim: u64,
    pub elem: ElemBytes,
    /// 2 with K and V, 1 for latent (MLA) caches.
    pub parts: u64,
    /// Replicated whole on every TP rank (MLA-type).
    pub mla: bool,
}

impl ModelCache {
    pub fn attn(layer: u32, heads: u32, head_dim: u64, elem: ElemBytes) -> ModelCache {
        ModelCache {
            name: format!("model.layers.{layer}.self_attn.attn"),
            kind: "FullAttentionSpec".into(),
            dtype: "torch.bfloat16".into(),
            layer,
            head_base: 0,
            heads,
            head_dim,
            elem,
            parts: 2,
            mla: false,
        }
    }

    pub fn mla(layer: u32, head_dim: u64, elem: ElemBytes) -> ModelCache {
        ModelCache {
            name: format!("model.layers.{layer}.self_attn.attn"),
            kind: "MLAAttentionSpec".into(),
            dtype: "torch.bfloat16".into(),
            layer,
            head_base: 0,
            heads: 1,
            head_dim,
            elem,
            parts: 1,
            mla: true,
        }
    }

    pub fn cell_bytes(&self) -> u64 {
        self.parts * self.head_dim * self.elem.get()
    }
}

/// The model's KV of one request: content of (cache, token, head, part, d) from a seed, with
/// optional overrides (corruptions) applied per consumer.
#[derive(Debug, Clone)]
pub struct Model {
    pub caches: Vec<ModelCache>,
    pub seed: u64,
}

impl Model {
    /// Llama-like: `layers` layers of `heads` KV heads, bf16, D = `d`.
    pub fn gqa(layers: u32, heads: u32, d: u64) -> Model {
        Model {
            caches: (0..layers)
                .map(|l| ModelCache::attn(l, heads, d, ElemBytes::Two))
                .collect(),
            seed: 7,
        }
    }

    /// The bytes of element (part, d) of head `head` of token `token` of cache `c`.
    pub fn elem_bytes(&self, c: usize, token: u64, head: u32, part: u64, d: u64) -> Vec<u8> {
        let mut z = splitmix(self.seed ^ (c as u64) << 40);
        z = splitmix(z ^ token);
        z = splitmix(z ^ ((head as u64) << 32 | part << 24 | d));
        z.to_le_bytes()[..self.caches[c].elem.get() as usize].to_vec()
    }

    /// The cell of one token and head: K elements then V elements.
    pub fn cell(&self, c: usize, token: u64, head: u32) -> Vec<u8> {
        let mc = &self.caches[c];
        let mut out = Vec::new();
        for part in 0..mc.parts {
            for d in 0..mc.head_dim {
                out.extend(self.elem_bytes(c, token, head, part, d));
            }
        }
        out
    }

    /// The definition, straight from §2.1: `Σ_{cache, head} m · Σ_{t in block, t < num_tokens}
    /// Σ_p x_{t,p}·(2(t·P+p)+1)` for block `position` of `block_size` tokens.
    pub fn oracle(&self, position: u64, block_size: u64, num_tokens: u64) -> u64 {
        let mut c_val = 0u64;
        for (ci, mc) in self.caches.iter().enumerate() {
            let p = mc.cell_bytes() / 8;
            for head in 0..mc.heads {
                let mut s = 0u64;
                for t in position * block_size..((position + 1) * block_size).min(num_tokens) {
                    let cell = self.cell(ci, t, head);
                    for (pi, chunk) in cell.chunks(8).enumerate() {
                        let x = u64::from_le_bytes(chunk.try_into().unwrap());
                        let j = t * p + pi as u64;
                        s = s.wrapping_add(x.wrapping_mul(2 * j + 1));
                    }
                }
                let m = 2 * ((mc.layer as u64) * 65536 + (mc.head_base + head) as u64) + 1;
                c_val = c_val.wrapping_add(m.wrapping_mul(s));
            }
        }
        c_val
    }

    pub fn oracle_blocks(&self, block_size: u64, num_tokens: u64) -> Vec<u64> {
        (0..num_tokens.div_ceil(block_size))
            .map(|q| self.oracle(q, block_size, num_tokens))
            .collect()
    }

    /// The fingerprint of the whole group (sum of its caches' layer fingerprints).
    pub fn fingerprint(&self, block_size: u64) -> u64 {
        self.caches.iter().fold(0u64, |a, c| {
            a.wrapping_add(layer_fingerprint(&c.name, &c.kind, block_size, &c.dtype))
        })
    }
}

/// How one side holds the KV.
#[derive(Debug, Clone)]
pub struct Side {
    pub tp: u32,
    pub pp: u32,
    pub layout: &'static str,
    /// Tokens per kernel block.
    pub n: u64,
    /// Kernel blocks per logical block.
    pub kpb: u64,
    /// Whether this side is the producer (reports replica 0 only).
    pub producer: bool,
}

impl Side {
    pub fn new(tp: u32, pp: u32, layout: &'static str, n: u64, kpb: u64, producer: bool) -> Side {
        Side {
            tp,
            pp,
            layout,
            n,
            kpb,
            producer,
        }
    }
    pub fn block_size(&self) -> u64 {
        self.n * self.kpb
    }
}

/// Where the consumer's bytes differ from the model: (cache, token, global head) → a cell
/// transform (XOR of the first byte with a value). Applied to the copies held by the listed TP
/// ranks only (None = every rank).
#[derive(Debug, Clone, Default)]
pub struct Faults {
    pub cells: Vec<(usize, u64, u32, u8, Option<u32>)>,
    /// Tokens below this hold other (locally computed) KV than the model's (a local prefix hit).
    pub local_prefix_tokens: u64,
}

/// One worker's view: its caches (arrays filled from the model) and its plan.
pub struct Worker {
    pub rank: RankInfo,
    pub caches: Vec<(CacheDesc, Vec<u8>, usize)>,
}

/// Which model caches stage `pp` of `pp_size` holds (contiguous ranges of layer numbers).
fn stage_of(model: &Model, c: usize, pp_size: u32) -> u32 {
    let max_layer = model.caches.iter().map(|c| c.layer).max().unwrap_or(0) + 1;
    let per = max_layer.div_ceil(pp_size);
    model.caches[c].layer / per
}

/// Local heads and global head of local head 0 for cache `mc` at TP rank `r` of `tp` (the real
/// sharding, written independently of plan_group).
fn shard(mc: &ModelCache, r: u32, tp: u32) -> (u32, u32) {
    if mc.mla {
        (mc.heads, 0)
    } else if tp <= mc.heads {
        let local = mc.heads / tp;
        (local, r * local)
    } else {
        (1, r / (tp / mc.heads))
    }
}

/// Builds a worker's arrays: `num_blocks` logical blocks; request position i in block
/// `table[i]`; other slots (and slots past `num_tokens`) hold junk.
pub fn build_worker(
    model: &Model,
    side: &Side,
    rank: RankInfo,
    table: &[u64],
    num_blocks: u64,
    num_tokens: u64,
    faults: &Faults,
) -> Worker {
    let layout = Layout::parse(side.layout).unwrap();
    let mut caches = Vec::new();
    for (ci, mc) in model.caches.iter().enumerate() {
        if stage_of(model, ci, side.pp) != rank.pp_rank {
            continue;
        }
        let (local, first) = shard(mc, rank.tp_rank, side.tp);
        let mut lay = layout.clone();
        if mc.parts == 1 {
            let dims: Vec<_> = lay
                .dims()
                .iter()
                .copied()
                .filter(|d| *d != kvferry_checksum::layout::Dim::Kv)
                .collect();
            lay = Layout::from_dims(dims).unwrap();
        }
        if local == 1 && !lay.has_heads() {
            // fine
        }
        let g = Geometry::contiguous(
            lay,
            num_blocks * side.kpb,
            side.n,
            local as u64,
            mc.head_dim,
            mc.elem,
            side.kpb,
        )
        .unwrap();
        let mut bytes: Vec<u8> = (0..g.byte_len())
            .map(|i| splitmix(i ^ 0xdead ^ (ci as u64) << 50) as u8)
            .collect();
        let bs = side.block_size();
        for (pos, &bid) in table.iter().enumerate() {
            for t in 0..bs {
                let tok = pos as u64 * bs + t;
                if tok >= num_tokens {
                    continue;
                }
                for h in 0..local {
                    let gh = first + h;
                    let mut cell = if tok < faults.local_prefix_tokens {
                        let mut m2 = model.clone();
                        m2.seed ^= 0x5555;
                        m2.cell(ci, tok, gh)
                    } else {
                        model.cell(ci, tok, gh)
                    };
                    for &(fc, ft, fh, x, frank) in &faults.cells {
                        if fc == ci
                            && ft == tok
                            && fh == gh
                            && frank.is_none_or(|r| r == rank.tp_rank)
                        {
                            cell[0] ^= x;
                        }
                    }
                    let e = mc.elem.get() as usize;
                    let kb = bid * side.kpb + t / side.n;
                    for part in 0..mc.parts {
                        for d in 0..mc.head_dim {
                            let off = g.byte_offset(part, kb, t % side.n, h as u64, d) as usize;
                            let at = ((part * mc.head_dim + d) as usize) * e;
                            bytes[off..off + e].copy_from_slice(&cell[at..at + e]);
                        }
                    }
                }
            }
        }
        let mut desc = CacheDesc::new(mc.name.clone(), Some(&mc.kind), Some(&mc.dtype), g);
        if mc.mla {
            desc.kind = Some(mc.kind.clone());
        }
        caches.push((desc, bytes, ci));
    }
    Worker { rank, caches }
}

/// The worker's record for group 0 over `selection` (None: group left out).
pub fn worker_record(
    model: &Model,
    side: &Side,
    w: &Worker,
    selection: Option<&BlockSelection>,
    num_tokens: u64,
) -> WorkerRecord {
    let descs: Vec<CacheDesc> = w.caches.iter().map(|c| c.0.clone()).collect();
    let kv_heads = model
        .caches
        .iter()
        .filter(|c| !c.mla)
        .map(|c| c.heads)
        .max();
    let plan = plan_group(0, side.block_size(), &descs, w.rank, kv_heads);
    let mut rec = WorkerRecord {
        rank: w.rank,
        groups: Vec::new(),
        skipped: Vec::new(),
    };
    let layers = match plan {
        GroupPlan::Skipped { group_id, reason } => {
            rec.skipped.push((group_id, reason));
            return rec;
        }
        GroupPlan::Checksum { layers, .. } => layers,
    };
    let Some(sel) = selection else { return rec };
    let mut values: BTreeMap<_, Vec<u64>> = BTreeMap::new();
    let mut fp = 0u64;
    for spec in &layers {
        fp = fp.wrapping_add(layer_fingerprint(
            &spec.name,
            spec.kind.as_deref().unwrap(),
            side.block_size(),
            spec.dtype.as_deref().unwrap(),
        ));
        if side.producer && spec.replica.index != 0 {
            continue;
        }
        let bytes = &w.caches.iter().find(|c| c.0.name == spec.name).unwrap().1;
        let acc = values
            .entry(spec.replica)
            .or_insert_with(|| vec![0; sel.block_ids.len()]);
        for (i, &bid) in sel.block_ids.iter().enumerate() {
            let v = layer_block_checksum(spec, bytes, bid, sel.start + i as u64, num_tokens);
            acc[i] = acc[i].wrapping_add(v);
        }
    }
    rec.groups.push(GroupRecord {
        group_id: 0,
        block_size: side.block_size(),
        start: sel.start,
        fingerprint: Some(fp),
        values,
    });
    rec
}

/// A shuffled block table for `positions` positions among `num_blocks` blocks.
pub fn table(positions: u64, num_blocks: u64, seed: u64) -> Vec<u64> {
    let mut ids: Vec<u64> = (0..num_blocks).collect();
    for i in (1..ids.len()).rev() {
        let j = (splitmix(seed ^ i as u64) % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids.truncate(positions as usize);
    ids
}

/// Every worker's record of one side for a request of `num_tokens` tokens whose blocks are
/// `table`; `select` picks the blocks from the full table (as Option per position).
pub fn side_records(
    model: &Model,
    side: &Side,
    table: &[u64],
    num_tokens: u64,
    faults: &Faults,
    selection: Option<&BlockSelection>,
) -> Vec<WorkerRecord> {
    let num_blocks = table
        .iter()
        .max()
        .map_or(1, |m| m + 1)
        .max(table.len() as u64 + 2);
    let mut out = Vec::new();
    for pp in 0..side.pp {
        for tp in 0..side.tp {
            let rank = RankInfo {
                tp_rank: tp,
                tp_size: side.tp,
                pp_rank: pp,
                pp_size: side.pp,
            };
            let w = build_worker(model, side, rank, table, num_blocks, num_tokens, faults);
            out.push(worker_record(model, side, &w, selection, num_tokens));
        }
    }
    out
}
