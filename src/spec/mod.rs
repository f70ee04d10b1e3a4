//! `kvferry checksum --spec SPEC.json`: the checksum definition (docs/design.md §2.1) evaluated on KV
//! tensors dumped to files, for people debugging a transfer.
//!
//! Input: `{"num_tokens": 40, "groups": [{"group_id": 0, "block_size": 16, "start": 0,
//! "block_ids": [3, 1, 4], "layers": [{"name": "model.layers.0.self_attn.attn", "path": "l0.bin",
//! "layout": "KV B N H D", "dims": {"B": 8, "N": 16, "H": 2, "D": 64}, "elem_bytes": 2,
//! "kernel_blocks": 1, "head_offset": 0, "kind": "FullAttentionSpec", "dtype": "torch.bfloat16"}]}]}`.
//! `path` is relative to the spec's folder: a raw C-contiguous array (`.bin`), a `.npy` file, or a
//! `.safetensors` file with `"tensor": "name"`. Sizes come from `dims` (KV is always 2 and not
//! given; no `H` = one head); a logical block is `kernel_blocks` consecutive `B` entries, so
//! `block_size = kernel_blocks · N`; `block_ids` are logical ids and `start` is the block position
//! of the first.
//!
//! Output: `{"num_tokens": 40, "groups": [{"group_id": 0, "block_size": 16, "start": 0,
//! "values": ["0x…", …], "fingerprint": "0x…"}]}`: 16-digit lower-case hex, one value per block
//! id; `fingerprint` (§2.3) only when every layer has `kind` and `dtype`.
//!
//! Files: `schema` (the spec's JSON and a layer's geometry), `files` (a tensor file mapped),
//! `npy` (the `.npy` header), `safetensors_lookup` (a named tensor), `error`; this file
//! evaluates the checksum.

mod error;
mod files;
mod npy;
mod safetensors_lookup;
mod schema;
#[cfg(test)]
mod tests;

use std::path::Path;

use kvferry_checksum::definition::layer_block_checksum;
use kvferry_checksum::fingerprint::layer_fingerprint;
use kvferry_checksum::group::{parse_layer_number, LayerSpec, ReplicaKey};
use serde_json::{json, Value};

use error::field_err;
pub use error::{FieldFault, FileFault, FormatError, SpecError};
use files::map_layer;
use schema::{geometry, SpecFile};

/// Evaluates the spec at `path` (see the module docs): one value per block id per group, from the
/// layers' dumped arrays, and each group's fingerprint when every layer has `kind` and `dtype`.
/// Errors name the field or file and its value: missing file, wrong size, a cell that is not
/// whole 8-byte pieces, a bad layout, a name without a layer number, a block id out of range.
pub fn checksum_spec(path: &Path) -> Result<Value, SpecError> {
    let text = std::fs::read_to_string(path).map_err(|source| SpecError::ReadSpec {
        path: path.to_path_buf(),
        source,
    })?;
    let spec: SpecFile = serde_json::from_str(&text).map_err(|source| SpecError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut groups = Vec::new();
    for (gi, grp) in spec.groups.iter().enumerate() {
        if grp.block_size == 0 {
            return Err(field_err(
                format!("groups[{gi}].block_size"),
                0,
                FieldFault::Zero,
            ));
        }
        let mut values = vec![0u64; grp.block_ids.len()];
        let mut fingerprint = Some(0u64);
        for (li, l) in grp.layers.iter().enumerate() {
            let at = format!("groups[{gi}].layers[{li}]");
            let layer = parse_layer_number(&l.name).ok_or_else(|| {
                field_err(
                    format!("{at}.name"),
                    format!("{:?}", l.name),
                    FieldFault::NoLayerNumber,
                )
            })?;
            let g = geometry(l, &at)?;
            if g.block_size() != grp.block_size {
                return Err(field_err(
                    format!("{at}.kernel_blocks"),
                    l.kernel_blocks,
                    FieldFault::KernelBlocks {
                        layer_block_size: g.block_size(),
                        group_block_size: grp.block_size,
                    },
                ));
            }
            if let Some((i, id)) = grp
                .block_ids
                .iter()
                .enumerate()
                .find(|(_, &id)| id >= g.num_blocks())
            {
                return Err(field_err(
                    format!("groups[{gi}].block_ids[{i}]"),
                    id,
                    FieldFault::BlockId {
                        layer: li,
                        blocks: g.num_blocks(),
                    },
                ));
            }
            let mapped = map_layer(dir, l, &g, &at)?;
            let ls = LayerSpec {
                name: l.name.clone(),
                layer,
                head_offset: l.head_offset,
                geometry: g,
                kind: l.kind.clone(),
                dtype: l.dtype.clone(),
                replica: ReplicaKey::NONE,
            };
            for (i, (&id, v)) in grp.block_ids.iter().zip(values.iter_mut()).enumerate() {
                *v = v.wrapping_add(layer_block_checksum(
                    &ls,
                    mapped.bytes(),
                    id,
                    grp.start + i as u64,
                    spec.num_tokens,
                ));
            }
            fingerprint = match (fingerprint, &l.kind, &l.dtype) {
                (Some(f), Some(kind), Some(dtype)) => {
                    Some(f.wrapping_add(layer_fingerprint(&l.name, kind, grp.block_size, dtype)))
                }
                _ => None,
            };
        }
        let mut out = json!({
            "group_id": grp.group_id,
            "block_size": grp.block_size,
            "start": grp.start,
            "values": values.iter().map(|v| format!("0x{v:016x}")).collect::<Vec<_>>(),
        });
        if let (Some(f), false) = (fingerprint, grp.layers.is_empty()) {
            out["fingerprint"] = json!(format!("0x{f:016x}"));
        }
        groups.push(out);
    }
    Ok(json!({ "num_tokens": spec.num_tokens, "groups": groups }))
}
