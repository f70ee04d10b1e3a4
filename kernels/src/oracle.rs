//! The tests' oracle (feature `test-tools`): a group's values by the definition's direct form
//! (§2.1, [`layer_block_checksum_direct`]), summed per replica key as §2.3 says. Independent of
//! every backend's fast path, so the CPU backend, the CUDA kernel and its CPU replay are all
//! checked against this one reference.

use std::collections::BTreeMap;

use kvferry_checksum::definition::layer_block_checksum_direct;
use kvferry_checksum::group::{LayerSpec, ReplicaKey};
use kvferry_checksum::select::BlockSelection;

/// The values a backend must return for one group: for each replica key among `layers`, one
/// u64 per entry of `selection.block_ids` (block `block_ids[i]` at request position
/// `selection.start + i`), over the first `num_tokens` tokens of the request. `layers` pairs
/// each layer's spec with its bytes (the whole array, as the geometry describes it).
///
/// Slow (each cell gathered element by element): for tests only. Panics where a layer's bytes
/// cannot hold a selected block, as the direct form does.
pub fn direct_values(
    layers: &[(&LayerSpec, &[u8])],
    selection: &BlockSelection,
    num_tokens: u64,
) -> BTreeMap<ReplicaKey, Vec<u64>> {
    let mut out: BTreeMap<ReplicaKey, Vec<u64>> = BTreeMap::new();
    for &(spec, bytes) in layers {
        let values = out
            .entry(spec.replica)
            .or_insert_with(|| vec![0; selection.block_ids.len()]);
        for (i, (v, &block)) in values.iter_mut().zip(&selection.block_ids).enumerate() {
            *v = v.wrapping_add(layer_block_checksum_direct(
                spec,
                bytes,
                block,
                selection.start + i as u64,
                num_tokens,
            ));
        }
    }
    out
}
