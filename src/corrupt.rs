//! Fault injection for `demo --corrupt` and `load --corrupt`: one bit of a landed load is
//! flipped after the transfer and before verification, so the checksum must catch it. Flips
//! are armed per request, so loads in flight together each get exactly their own.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use kvferry_p2p::{Consumer, Landed};
use kvferry_transfer::sync::MutexExt;
use rand::Rng;

use crate::models::{ModelShape, STATE_GROUP};
use crate::world::{flip_bit, RankKv};

/// Where the landed hook flips a bit: a byte of a token the load wrote, in an attention
/// layer (state layers are not checksummed).
#[derive(Debug, Clone)]
pub struct Flip {
    /// The KV cache group of the flipped layer.
    pub group: u32,
    rank: usize,
    layer: usize,
    blocks: Vec<u64>,
    /// The flipped token (position in the prompt).
    pub token: u64,
    head: u64,
    part: u64,
    byte: u64,
    bit: u8,
}

impl Flip {
    /// A random byte of a token the load writes, in a random attention layer of `ranks`
    /// (the consumer's), whose request has `blocks` (of `block_size` tokens) and `tokens`.
    pub fn random(
        rng: &mut impl Rng,
        model: &ModelShape,
        ranks: &[RankKv],
        blocks: &[u64],
        tokens: u64,
        block_size: u64,
    ) -> Flip {
        let attention: Vec<(usize, usize)> = ranks
            .iter()
            .enumerate()
            .flat_map(|(r, kv)| {
                kv.layers
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.group != STATE_GROUP)
                    .map(move |(i, _)| (r, i))
            })
            .collect();
        let (rank, layer) = attention[rng.random_range(0..attention.len())];
        let l = &ranks[rank].layers[layer];
        let g = &l.spec.geometry;
        // A sliding-window layer's blocks wholly before the window were not loaded.
        let first = model
            .window(l.group)
            .map_or(0, |w| tokens.saturating_sub(w) / block_size * block_size);
        Flip {
            group: l.group,
            rank,
            layer,
            blocks: blocks.to_vec(),
            token: rng.random_range(first..tokens),
            head: rng.random_range(0..g.heads),
            part: rng.random_range(0..g.parts()),
            byte: rng.random_range(0..g.head_dim * g.elem.get()),
            bit: rng.random_range(0..8),
        }
    }
}

/// The flips waiting for their loads to land, by request id: with several loads in flight,
/// each flip must hit its own request's blocks, whichever load lands first.
#[derive(Clone, Default)]
pub struct PendingFlips(Arc<Mutex<HashMap<String, Flip>>>);

impl PendingFlips {
    /// Arms `flip` for the load of `request_id` (replacing one armed before for it).
    pub fn arm(&self, request_id: &str, flip: Flip) {
        self.0.locked().insert(request_id.to_string(), flip);
    }

    /// Takes the flip armed for `request_id`, if any: the landed hook applies it, and a load
    /// that ended without landing takes it back so that no later load of the same id gets it.
    pub fn take(&self, request_id: &str) -> Option<Flip> {
        self.0.locked().remove(request_id)
    }

    /// Whether a flip is armed for `request_id`.
    pub fn armed(&self, request_id: &str) -> bool {
        self.0.locked().contains_key(request_id)
    }
}

/// Installs on `consumer` a landed hook that applies the flip armed for the landed request
/// (if any) to `ranks`, once; returns the flips to arm. A flip that cannot be applied is logged.
/// The hook runs only for loads with a flip armed when they start: the others verify their
/// layers as they land.
pub fn install_hook(consumer: &Consumer, ranks: Arc<Mutex<Vec<RankKv>>>) -> PendingFlips {
    let pending = PendingFlips::default();
    let flips = pending.clone();
    let armed = pending.clone();
    let runs_for = Arc::new(move |request_id: &str| armed.armed(request_id));
    consumer.set_landed_hook_for(
        Arc::new(move |landed: &Landed| {
            if let Some(f) = flips.take(&landed.request_id) {
                let mut r = ranks.lock().unwrap();
                if let Err(e) = flip_bit(
                    &mut r[f.rank],
                    f.layer,
                    &f.blocks,
                    f.token,
                    f.head,
                    f.part,
                    f.byte,
                    f.bit,
                ) {
                    tracing::error!(request = %landed.request_id, "fault injection failed: {e}");
                }
            }
        }),
        runs_for,
    );
    pending
}

/// Which `n` of the requests `0..requests` get a flipped bit (all of them when `n >=
/// requests`), drawn from `rng`.
pub fn choose(rng: &mut impl Rng, requests: u32, n: u32) -> BTreeSet<u32> {
    use rand::seq::SliceRandom;
    let mut ids: Vec<u32> = (0..requests).collect();
    ids.shuffle(rng);
    ids.into_iter().take(n as usize).collect()
}
