//! `kvferry checksum --spec SPEC.json`: the checksum definition (docs/design.md §2.1) evaluated on KV
//! tensors dumped to files, for people debugging a transfer (issue 3's contract).
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

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use kvferry_checksum::definition::layer_block_checksum;
use kvferry_checksum::fingerprint::layer_fingerprint;
use kvferry_checksum::group::{parse_layer_number, LayerSpec, ReplicaKey};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use memmap2::Mmap;
use serde::Deserialize;
use serde_json::{json, Value};
use thiserror::Error;

/// Why a spec could not be evaluated. Every message names the file or the field and its value.
#[derive(Debug, Error)]
pub enum SpecError {
    /// The spec file itself cannot be read.
    #[error("cannot read spec {path}: {source}")]
    ReadSpec {
        /// The spec file's path, as given.
        path: PathBuf,
        /// The read error.
        source: std::io::Error,
    },
    /// The spec is not JSON of the expected shape.
    #[error("spec {path}: {msg}")]
    Json {
        /// The spec file's path, as given.
        path: PathBuf,
        /// serde_json's message (with line and column).
        msg: String,
    },
    /// A field holds a value that cannot be used.
    #[error("{field} = {value}: {why}")]
    Field {
        /// Where the field is in the spec, e.g. `groups[0].layers[1].dims.D`.
        field: String,
        /// The value found, as text.
        value: String,
        /// Why it cannot be used.
        why: String,
    },
    /// A tensor file is missing, unreadable or does not match the spec.
    #[error("{field}: file {path}: {why}")]
    File {
        /// The spec field that names the file, e.g. `groups[0].layers[1].path`.
        field: String,
        /// The tensor file's path (relative paths resolved against the spec's folder).
        path: PathBuf,
        /// What is wrong with it (missing, unreadable, wrong size, ...).
        why: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecFile {
    num_tokens: u64,
    groups: Vec<SpecGroup>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecGroup {
    group_id: u32,
    block_size: u64,
    #[serde(default)]
    start: u64,
    block_ids: Vec<u64>,
    layers: Vec<SpecLayer>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecLayer {
    name: String,
    path: String,
    #[serde(default)]
    tensor: Option<String>,
    layout: String,
    dims: BTreeMap<String, u64>,
    elem_bytes: u64,
    #[serde(default = "one")]
    kernel_blocks: u64,
    #[serde(default)]
    head_offset: u32,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    dtype: Option<String>,
}

fn one() -> u64 {
    1
}

fn field_err(field: impl Into<String>, value: impl ToString, why: impl Into<String>) -> SpecError {
    SpecError::Field {
        field: field.into(),
        value: value.to_string(),
        why: why.into(),
    }
}

/// The geometry of one layer from its `layout`, `dims`, `elem_bytes` and `kernel_blocks`.
fn geometry(l: &SpecLayer, at: &str) -> Result<Geometry, SpecError> {
    let layout = Layout::parse(&l.layout).map_err(|e| {
        field_err(
            format!("{at}.layout"),
            format!("{:?}", l.layout),
            e.to_string(),
        )
    })?;
    for key in l.dims.keys() {
        let known = matches!(key.as_str(), "B" | "N" | "H" | "D");
        if !known {
            let why = if key == "KV" {
                "KV is always 2 and must not be given"
            } else {
                "expected B, N, H or D"
            };
            return Err(field_err(format!("{at}.dims.{key}"), l.dims[key], why));
        }
    }
    let dim = |name: &str| -> Result<u64, SpecError> {
        l.dims.get(name).copied().ok_or_else(|| {
            field_err(
                format!("{at}.dims"),
                format!("{:?}", l.dims),
                format!("{name} is required"),
            )
        })
    };
    let h = match (layout.has_heads(), l.dims.get("H")) {
        (true, Some(&h)) => h,
        (true, None) => {
            return Err(field_err(
                format!("{at}.dims"),
                format!("{:?}", l.dims),
                "H is required by the layout",
            ))
        }
        (false, None) | (false, Some(1)) => 1,
        (false, Some(&h)) => {
            return Err(field_err(
                format!("{at}.dims.H"),
                h,
                format!("layout {:?} has no H dimension", l.layout),
            ))
        }
    };
    let elem = ElemBytes::new(l.elem_bytes)
        .map_err(|e| field_err(format!("{at}.elem_bytes"), l.elem_bytes, e.to_string()))?;
    let g = Geometry::contiguous(
        layout,
        dim("B")?,
        dim("N")?,
        h,
        dim("D")?,
        elem,
        l.kernel_blocks,
    )
    .map_err(|e| field_err(format!("{at}.dims"), format!("{:?}", l.dims), e.to_string()))?;
    if g.pieces_per_cell().is_none() {
        return Err(field_err(
            format!("{at}.dims.D"),
            g.head_dim,
            format!(
                "a cell of {} bytes (parts {} × D {} × elem_bytes {}) is not whole 8-byte pieces",
                g.cell_bytes(),
                g.parts(),
                g.head_dim,
                l.elem_bytes
            ),
        ));
    }
    Ok(g)
}

/// A layer's bytes: the mapped file and the range of the array in it.
struct Mapped {
    map: Option<Mmap>,
    range: std::ops::Range<usize>,
}

impl Mapped {
    fn bytes(&self) -> &[u8] {
        self.map
            .as_deref()
            .map_or(&[][..], |m| &m[self.range.clone()])
    }
}

/// Maps `path` and finds the array of `g` in it (raw `.bin`, `.npy` or `.safetensors` tensor).
fn map_layer(dir: &Path, l: &SpecLayer, g: &Geometry, at: &str) -> Result<Mapped, SpecError> {
    let path = dir.join(&l.path);
    let ferr = |why: String| SpecError::File {
        field: format!("{at}.path"),
        path: path.clone(),
        why,
    };
    let file = File::open(&path).map_err(|e| ferr(e.to_string()))?;
    let len = file.metadata().map_err(|e| ferr(e.to_string()))?.len();
    let want = g.byte_len();
    if len == 0 {
        return match want {
            0 => Ok(Mapped {
                map: None,
                range: 0..0,
            }),
            _ => Err(ferr(format!("is empty, expected {want} bytes of KV"))),
        };
    }
    // SAFETY: the file is mapped read-only for the duration of this command; like any tool that
    // reads a file, it assumes no other process truncates or rewrites the file meanwhile.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| ferr(format!("cannot map: {e}")))?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let range = match ext.as_str() {
        "npy" => npy_range(&map, g, l.elem_bytes).map_err(|e| ferr(e.0))?,
        "safetensors" => {
            let Some(name) = l.tensor.as_deref() else {
                return Err(field_err(
                    format!("{at}.tensor"),
                    "null",
                    "a .safetensors file needs \"tensor\": the tensor's name",
                ));
            };
            safetensors_range(&map, name, g, l.elem_bytes).map_err(|e| ferr(e.0))?
        }
        _ => {
            if l.tensor.is_some() {
                return Err(field_err(
                    format!("{at}.tensor"),
                    format!("{:?}", l.tensor),
                    "only .safetensors files hold named tensors",
                ));
            }
            if len != want {
                return Err(ferr(format!("holds {len} bytes, but layout {} with dims {:?} and elem_bytes {} needs {want}", l.layout, l.dims, l.elem_bytes)));
            }
            0..want as usize
        }
    };
    Ok(Mapped {
        map: Some(map),
        range,
    })
}

/// The data range of a `.npy` file after checking its header against the geometry: C order,
/// little-endian (or byte) elements of `elem_bytes`, shape with the array's element count.
/// Why a `.npy` or `.safetensors` file does not hold the KV a layer needs; the text says
/// which part of the file (magic, header, dtype, shape, length).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct FormatError(pub String);

impl From<&str> for FormatError {
    fn from(s: &str) -> FormatError {
        FormatError(s.to_string())
    }
}

impl From<String> for FormatError {
    fn from(s: String) -> FormatError {
        FormatError(s)
    }
}

fn npy_range(
    data: &[u8],
    g: &Geometry,
    elem_bytes: u64,
) -> Result<std::ops::Range<usize>, FormatError> {
    if data.len() < 10 || &data[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (bad magic)".into());
    }
    let (header_len, start) = match data[6] {
        1 => (u16::from_le_bytes([data[8], data[9]]) as usize, 10usize),
        2 | 3 if data.len() >= 12 => (
            u32::from_le_bytes([data[8], data[9], data[10], data[11]]) as usize,
            12,
        ),
        v => return Err(format!(".npy version {v} is not supported").into()),
    };
    let end = start
        .checked_add(header_len)
        .filter(|&e| e <= data.len())
        .ok_or(".npy header runs past the end of the file")?;
    let header = std::str::from_utf8(&data[start..end]).map_err(|_| ".npy header is not text")?;
    let descr = npy_value(header, "descr").ok_or(".npy header has no 'descr'")?;
    let quote = descr
        .chars()
        .next()
        .filter(|c| *c == '\'' || *c == '"')
        .ok_or(".npy descr is not a string")?;
    let descr = &descr[1..];
    let descr = &descr[..descr.find(quote).ok_or(".npy descr is not a string")?];
    let (order, size) = descr.split_at(descr.len().min(1));
    let kind_size: String = size
        .chars()
        .skip_while(|c| c.is_ascii_alphabetic())
        .collect();
    let itemsize: u64 = kind_size
        .parse()
        .map_err(|_| format!(".npy descr {descr:?} is not a simple type"))?;
    if itemsize != elem_bytes {
        return Err(format!(
            ".npy descr {descr:?} has {itemsize}-byte elements, but elem_bytes is {elem_bytes}"
        )
        .into());
    }
    if order == ">" && itemsize > 1 {
        return Err(format!(".npy descr {descr:?} is big-endian; the checksum reads the bytes as they lie in memory").into());
    }
    if npy_value(header, "fortran_order").is_some_and(|v| v.starts_with("True")) {
        return Err(".npy array is in Fortran order; save it C-contiguous".into());
    }
    let shape = npy_value(header, "shape").ok_or(".npy header has no 'shape'")?;
    let shape = shape.trim_start_matches('(');
    let shape = &shape[..shape.find(')').ok_or(".npy shape is not a tuple")?];
    let mut count: u64 = 1;
    for d in shape.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let d: u64 = d
            .parse()
            .map_err(|_| format!(".npy shape ({shape}) is not integers"))?;
        count = count.checked_mul(d).ok_or(".npy shape overflows")?;
    }
    let want = g.byte_len();
    if count.checked_mul(itemsize) != Some(want) {
        return Err(format!(".npy shape ({shape}) holds {count} elements of {itemsize} bytes, but the layout needs {want} bytes").into());
    }
    let data_end = end
        .checked_add(want as usize)
        .filter(|&e| e <= data.len())
        .ok_or("the .npy file is shorter than its header says")?;
    Ok(end..data_end)
}

/// The text after `'key':` in a .npy header dict, up to the end.
fn npy_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = &header[at + key.len() + 2..];
    Some(rest.trim_start().strip_prefix(':')?.trim_start())
}

/// The data range of tensor `name` in a safetensors file, checked against the geometry.
fn safetensors_range(
    data: &[u8],
    name: &str,
    g: &Geometry,
    elem_bytes: u64,
) -> Result<std::ops::Range<usize>, FormatError> {
    let st = safetensors::SafeTensors::deserialize(data)
        .map_err(|e| format!("not a safetensors file: {e}"))?;
    let t = st
        .tensor(name)
        .map_err(|e| format!("tensor {name:?}: {e}"))?;
    let bits = t.dtype().bitsize() as u64;
    if bits != elem_bytes * 8 {
        return Err(format!(
            "tensor {name:?} has dtype {} ({bits} bits), but elem_bytes is {elem_bytes}",
            t.dtype()
        )
        .into());
    }
    let bytes = t.data();
    if bytes.len() as u64 != g.byte_len() {
        return Err(format!(
            "tensor {name:?} of shape {:?} holds {} bytes, but the layout needs {}",
            t.shape(),
            bytes.len(),
            g.byte_len()
        )
        .into());
    }
    let start = bytes.as_ptr() as usize - data.as_ptr() as usize;
    Ok(start..start + bytes.len())
}

/// Evaluates the spec at `path` (see the module docs): one value per block id per group, from the
/// layers' dumped arrays, and each group's fingerprint when every layer has `kind` and `dtype`.
/// Errors name the field or file and its value: missing file, wrong size, a cell that is not
/// whole 8-byte pieces, a bad layout, a name without a layer number, a block id out of range.
pub fn checksum_spec(path: &Path) -> Result<Value, SpecError> {
    let text = std::fs::read_to_string(path).map_err(|source| SpecError::ReadSpec {
        path: path.to_path_buf(),
        source,
    })?;
    let spec: SpecFile = serde_json::from_str(&text).map_err(|e| SpecError::Json {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut groups = Vec::new();
    for (gi, grp) in spec.groups.iter().enumerate() {
        if grp.block_size == 0 {
            return Err(field_err(
                format!("groups[{gi}].block_size"),
                0,
                "must be at least 1",
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
                    "holds no (single) layer number",
                )
            })?;
            let g = geometry(l, &at)?;
            if g.block_size() != grp.block_size {
                return Err(field_err(
                    format!("{at}.kernel_blocks"),
                    l.kernel_blocks,
                    format!(
                        "kernel_blocks × N = {} but the group's block_size is {}",
                        g.block_size(),
                        grp.block_size
                    ),
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
                    format!("layer {li} holds {} logical blocks", g.num_blocks()),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Logical KV of one layer: `data[b][n][h][part][d]` elements of `elem` bytes.
    struct Logical {
        b: u64,
        n: u64,
        h: u64,
        d: u64,
        parts: u64,
        elem: usize,
        data: Vec<u8>,
    }

    impl Logical {
        fn new(b: u64, n: u64, h: u64, d: u64, parts: u64, elem: usize, seed: u64) -> Logical {
            let mut z = seed;
            let data = (0..(b * n * h * parts * d) as usize * elem)
                .map(|_| {
                    z = z
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (z >> 35) as u8
                })
                .collect();
            Logical {
                b,
                n,
                h,
                d,
                parts,
                elem,
                data,
            }
        }
        fn at(&self, kb: u64, t: u64, h: u64, part: u64, d: u64) -> usize {
            ((((kb * self.n + t) * self.h + h) * self.parts + part) * self.d + d) as usize
                * self.elem
        }
        /// C-contiguous bytes in `layout` order.
        fn write(&self, layout: &str) -> Vec<u8> {
            let names: Vec<&str> = layout.split_whitespace().collect();
            let size = |n: &str| match n {
                "KV" => 2,
                "B" => self.b,
                "N" => self.n,
                "H" => self.h,
                _ => self.d,
            };
            let mut out = vec![0u8; self.data.len()];
            for kb in 0..self.b {
                for t in 0..self.n {
                    for h in 0..self.h {
                        for part in 0..self.parts {
                            for d in 0..self.d {
                                let idx = names.iter().fold(0u64, |acc, &nm| {
                                    let i = match nm {
                                        "KV" => part,
                                        "B" => kb,
                                        "N" => t,
                                        "H" => h,
                                        _ => d,
                                    };
                                    acc * size(nm) + i
                                });
                                let (o, s) = (idx as usize * self.elem, self.at(kb, t, h, part, d));
                                out[o..o + self.elem].copy_from_slice(&self.data[s..s + self.elem]);
                            }
                        }
                    }
                }
            }
            out
        }
        /// §2.1 by the direct form, from the logical data.
        fn value(
            &self,
            layer: u64,
            head_offset: u64,
            kpb: u64,
            block: u64,
            pos: u64,
            num_tokens: u64,
        ) -> u64 {
            let bs = kpb * self.n;
            let p = self.parts * self.d * self.elem as u64 / 8;
            let mut c = 0u64;
            for h in 0..self.h {
                let mut s = 0u64;
                for t in 0..bs {
                    let tok = pos * bs + t;
                    if tok >= num_tokens {
                        break;
                    }
                    let mut cell = Vec::new();
                    for part in 0..self.parts {
                        for d in 0..self.d {
                            let a = self.at(block * kpb + t / self.n, t % self.n, h, part, d);
                            cell.extend_from_slice(&self.data[a..a + self.elem]);
                        }
                    }
                    for (i, piece) in cell.chunks(8).enumerate() {
                        let x = u64::from_le_bytes(piece.try_into().unwrap());
                        s = s.wrapping_add(x.wrapping_mul(2 * (tok * p + i as u64) + 1));
                    }
                }
                c = c.wrapping_add((2 * (layer * 65536 + head_offset + h) + 1).wrapping_mul(s));
            }
            c
        }
    }

    fn npy(shape: &[u64], descr: &str, data: &[u8]) -> Vec<u8> {
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        let mut header = format!(
            "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({},), }}",
            dims.join(", ")
        );
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((header.len() as u16).to_le_bytes());
        out.extend(header.as_bytes());
        out.extend(data);
        out
    }

    fn write_spec(dir: &Path, spec: &Value) -> PathBuf {
        let p = dir.join("spec.json");
        std::fs::write(&p, spec.to_string()).unwrap();
        p
    }

    /// Three layers in three layouts and three file kinds; values against the direct form
    /// computed here from the logical KV (independent of the checksum crate).
    #[test]
    fn spec_values_equal_the_definition() {
        let dir = tempfile::tempdir().unwrap();
        let (b, n, kpb) = (6, 8, 2); // 3 logical blocks of 16 tokens
        let l0 = Logical::new(b, n, 2, 16, 2, 2, 1); // bf16, KV, 2 heads
        let l1 = Logical::new(b, n, 1, 32, 1, 2, 2); // MLA-like latent, 1 head
        let l2 = Logical::new(b, n, 4, 3, 2, 4, 3); // fp32, D·elem = 12: pieces straddle K|V
        std::fs::write(dir.path().join("l0.bin"), l0.write("KV B N H D")).unwrap();
        std::fs::write(
            dir.path().join("l1.npy"),
            npy(&[b, n, 32], "<f2", &l1.write("B N D")),
        )
        .unwrap();
        let l2_bytes = l2.write("B H N KV D");
        let view = safetensors::tensor::TensorView::new(
            safetensors::Dtype::F32,
            vec![6, 4, 8, 2, 3],
            &l2_bytes,
        )
        .unwrap();
        let st = safetensors::tensor::serialize([("layer2", view)], None).unwrap();
        std::fs::write(dir.path().join("kv.safetensors"), st).unwrap();
        let num_tokens = 37;
        let spec = json!({
            "num_tokens": num_tokens,
            "groups": [{"group_id": 5, "block_size": 16, "start": 0, "block_ids": [2, 0, 1], "layers": [
                {"name": "model.layers.0.self_attn.attn", "path": "l0.bin", "layout": "KV B N H D",
                 "dims": {"B": 6, "N": 8, "H": 2, "D": 16}, "elem_bytes": 2, "kernel_blocks": 2, "head_offset": 2,
                 "kind": "FullAttentionSpec", "dtype": "torch.bfloat16"},
                {"name": "model.layers.7.self_attn.attn", "path": "l1.npy", "layout": "B N D",
                 "dims": {"B": 6, "N": 8, "D": 32}, "elem_bytes": 2, "kernel_blocks": 2,
                 "kind": "MLAAttentionSpec", "dtype": "torch.bfloat16"},
                {"name": "model.layers.3.self_attn.attn", "path": "kv.safetensors", "tensor": "layer2", "layout": "B H N KV D",
                 "dims": {"B": 6, "N": 8, "H": 4, "D": 3}, "elem_bytes": 4, "kernel_blocks": 2, "head_offset": 4,
                 "kind": "FullAttentionSpec", "dtype": "torch.float32"}
            ]}]
        });
        let out = checksum_spec(&write_spec(dir.path(), &spec)).unwrap();
        let g = &out["groups"][0];
        for (pos, block) in [2u64, 0, 1].into_iter().enumerate() {
            let pos = pos as u64;
            let want = l0
                .value(0, 2, kpb, block, pos, num_tokens)
                .wrapping_add(l1.value(7, 0, kpb, block, pos, num_tokens))
                .wrapping_add(l2.value(3, 4, kpb, block, pos, num_tokens));
            assert_eq!(
                g["values"][pos as usize],
                json!(format!("0x{want:016x}")),
                "position {pos}"
            );
        }
        let fp = layer_fingerprint(
            "model.layers.0.self_attn.attn",
            "FullAttentionSpec",
            16,
            "torch.bfloat16",
        )
        .wrapping_add(layer_fingerprint(
            "model.layers.7.self_attn.attn",
            "MLAAttentionSpec",
            16,
            "torch.bfloat16",
        ))
        .wrapping_add(layer_fingerprint(
            "model.layers.3.self_attn.attn",
            "FullAttentionSpec",
            16,
            "torch.float32",
        ));
        assert_eq!(g["fingerprint"], json!(format!("0x{fp:016x}")));
        assert_eq!(
            (
                out["num_tokens"].clone(),
                g["group_id"].clone(),
                g["start"].clone()
            ),
            (json!(37), json!(5), json!(0))
        );
    }

    /// The same spec evaluated by an independent Python implementation of §2.1 (standard library
    /// only), when python3 is installed.
    #[test]
    fn spec_values_match_a_python_implementation() {
        let Ok(py) = std::process::Command::new("python3")
            .arg("--version")
            .output()
        else {
            eprintln!("SKIP spec_values_match_a_python_implementation: python3 not found");
            return;
        };
        if !py.status.success() {
            eprintln!("SKIP spec_values_match_a_python_implementation: python3 does not run");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let l0 = Logical::new(4, 16, 2, 8, 2, 2, 11);
        std::fs::write(dir.path().join("a.bin"), l0.write("B KV H N D")).unwrap();
        let spec = json!({"num_tokens": 50, "groups": [{"group_id": 0, "block_size": 16, "start": 1, "block_ids": [3, 0, 2, 1],
            "layers": [{"name": "model.layers.4.attn", "path": "a.bin", "layout": "B KV H N D",
                        "dims": {"B": 4, "N": 16, "H": 2, "D": 8}, "elem_bytes": 2, "head_offset": 6}]}]});
        let path = write_spec(dir.path(), &spec);
        let ours = checksum_spec(&path).unwrap();
        assert!(
            ours["groups"][0].get("fingerprint").is_none(),
            "no kind/dtype: no fingerprint"
        );
        let script = r#"
import json, struct, sys
spec = json.load(open(sys.argv[1])); g = spec["groups"][0]; l = g["layers"][0]
B, N, H, D = (l["dims"][k] for k in "BNHD"); E = l["elem_bytes"]
raw = open(sys.argv[2], "rb").read()
def elem(b, part, h, t, d):  # layout B KV H N D
    i = (((b * 2 + part) * H + h) * N + t) * D + d
    return raw[i * E:(i + 1) * E]
P = 2 * D * E // 8; M = 1 << 64; out = []
for i, blk in enumerate(g["block_ids"]):
    pos = g["start"] + i; c = 0
    for h in range(H):
        s = 0
        for t in range(N):
            tok = pos * N + t
            if tok >= spec["num_tokens"]: break
            cell = b"".join(elem(blk, part, h, t, d) for part in range(2) for d in range(D))
            for p in range(P):
                x = struct.unpack("<Q", cell[8 * p:8 * p + 8])[0]
                s = (s + x * (2 * (tok * P + p) + 1)) % M
        c = (c + (2 * (4 * 65536 + 6 + h) + 1) * s) % M
    out.append("0x%016x" % c)
print(json.dumps(out))
"#;
        let res = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&path)
            .arg(dir.path().join("a.bin"))
            .output()
            .unwrap();
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        let theirs: Value = serde_json::from_slice(&res.stdout).unwrap();
        assert_eq!(ours["groups"][0]["values"], theirs);
    }

    fn err_of(dir: &Path, layer: Value, block_ids: Value) -> String {
        let spec = json!({"num_tokens": 20, "groups": [{"group_id": 0, "block_size": 16, "block_ids": block_ids, "layers": [layer]}]});
        checksum_spec(&write_spec(dir, &spec))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn errors_name_field_and_value() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ok.bin"), vec![0u8; 2 * 4 * 16 * 2 * 8 * 2]).unwrap();
        let layer = |f: &dyn Fn(&mut Value)| {
            let mut l = json!({"name": "model.layers.1.attn", "path": "ok.bin", "layout": "KV B N H D",
                               "dims": {"B": 4, "N": 16, "H": 2, "D": 8}, "elem_bytes": 2});
            f(&mut l);
            l
        };
        assert!(checksum_spec(&write_spec(dir.path(), &json!({"num_tokens": 20, "groups": [{"group_id": 0, "block_size": 16, "block_ids": [1], "layers": [layer(&|_| {})]}]}))).is_ok());
        let cases: Vec<(Value, Value, &str)> = vec![
            (
                layer(&|l| l["path"] = json!("missing.bin")),
                json!([0]),
                "missing.bin",
            ),
            (layer(&|l| l["dims"]["B"] = json!(5)), json!([0]), "needs"),
            (
                layer(&|l| l["layout"] = json!("KV B X H D")),
                json!([0]),
                "groups[0].layers[0].layout = \"KV B X H D\"",
            ),
            (
                layer(&|l| l["name"] = json!("model.final")),
                json!([0]),
                "groups[0].layers[0].name = \"model.final\"",
            ),
            (
                layer(&|l| {
                    l["layout"] = json!("B N D");
                    l["dims"] = json!({"B": 4, "N": 16, "D": 3});
                }),
                json!([0]),
                "groups[0].layers[0].dims.D = 3",
            ),
            (layer(&|_| {}), json!([0, 4]), "groups[0].block_ids[1] = 4"),
            (
                layer(&|l| l["kernel_blocks"] = json!(2)),
                json!([0]),
                "groups[0].layers[0].kernel_blocks = 2",
            ),
            (
                layer(&|l| l["elem_bytes"] = json!(3)),
                json!([0]),
                "groups[0].layers[0].elem_bytes = 3",
            ),
            (
                layer(&|l| l["dims"]["KV"] = json!(2)),
                json!([0]),
                "groups[0].layers[0].dims.KV = 2",
            ),
            (
                layer(&|l| l["tensor"] = json!("x")),
                json!([0]),
                "groups[0].layers[0].tensor",
            ),
        ];
        for (l, ids, want) in cases {
            let e = err_of(dir.path(), l.clone(), ids);
            assert!(e.contains(want), "{l}: error {e:?} should contain {want:?}");
        }
        let e = checksum_spec(&dir.path().join("nope.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope.json"), "{e}");
        std::fs::write(
            dir.path().join("bad.json"),
            "{\"num_tokens\": 1, \"groups\": [], \"extra\": 1}",
        )
        .unwrap();
        assert!(checksum_spec(&dir.path().join("bad.json"))
            .unwrap_err()
            .to_string()
            .contains("extra"));
    }

    #[test]
    fn npy_and_safetensors_mismatches_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let data = vec![0u8; 4 * 16 * 8 * 2];
        let base = json!({"name": "model.layers.1.attn", "layout": "B N D", "dims": {"B": 4, "N": 16, "D": 8}, "elem_bytes": 2});
        let with = |path: &str, extra: Value| {
            let mut l = base.clone();
            l["path"] = json!(path);
            if let Value::Object(m) = extra {
                for (k, v) in m {
                    l[k] = v;
                }
            }
            l
        };
        std::fs::write(dir.path().join("f4.npy"), npy(&[4, 16, 4], "<f4", &data)).unwrap();
        assert!(
            err_of(dir.path(), with("f4.npy", json!({})), json!([0])).contains("4-byte elements")
        );
        std::fs::write(dir.path().join("be.npy"), npy(&[4, 16, 8], ">f2", &data)).unwrap();
        assert!(err_of(dir.path(), with("be.npy", json!({})), json!([0])).contains("big-endian"));
        std::fs::write(
            dir.path().join("short.npy"),
            npy(&[4, 16, 4], "<f2", &data[..data.len() / 2]),
        )
        .unwrap();
        assert!(err_of(dir.path(), with("short.npy", json!({})), json!([0])).contains("needs"));
        std::fs::write(dir.path().join("junk.npy"), b"not numpy at all").unwrap();
        assert!(err_of(dir.path(), with("junk.npy", json!({})), json!([0])).contains("magic"));
        std::fs::write(dir.path().join("ok.npy"), npy(&[4, 16, 8], "<f2", &data)).unwrap();
        assert!(checksum_spec(&write_spec(dir.path(), &json!({"num_tokens": 9, "groups": [{"group_id": 0, "block_size": 16, "block_ids": [3], "layers": [with("ok.npy", json!({}))]}]}))).is_ok());
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![4, 16, 8], &data)
                .unwrap();
        std::fs::write(
            dir.path().join("t.safetensors"),
            safetensors::tensor::serialize([("k", view)], None).unwrap(),
        )
        .unwrap();
        assert!(
            err_of(dir.path(), with("t.safetensors", json!({})), json!([0])).contains("tensor")
        );
        assert!(err_of(
            dir.path(),
            with("t.safetensors", json!({"tensor": "v"})),
            json!([0])
        )
        .contains("\"v\""));
        let e = err_of(
            dir.path(),
            with(
                "t.safetensors",
                json!({"tensor": "k", "elem_bytes": 4, "dims": {"B": 4, "N": 16, "D": 4}}),
            ),
            json!([0]),
        );
        assert!(e.contains("16 bits"), "{e}");
    }
}
