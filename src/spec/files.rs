//! A layer's tensor file mapped and its array found in it: a raw C-contiguous array (`.bin`),
//! a `.npy` file or a tensor of a `.safetensors` file, each checked against the geometry.

use std::fs::File;
use std::path::Path;

use kvferry_checksum::layout::Geometry;
use memmap2::Mmap;

use super::error::{field_err, SpecError};
use super::schema::SpecLayer;
use super::{npy, safetensors_lookup};

/// A layer's bytes: the mapped file and the range of the array in it.
pub(super) struct Mapped {
    map: Option<Mmap>,
    range: std::ops::Range<usize>,
}

impl Mapped {
    pub(super) fn bytes(&self) -> &[u8] {
        self.map
            .as_deref()
            .map_or(&[][..], |m| &m[self.range.clone()])
    }
}

/// Maps `path` and finds the array of `g` in it (raw `.bin`, `.npy` or `.safetensors` tensor).
pub(super) fn map_layer(
    dir: &Path,
    l: &SpecLayer,
    g: &Geometry,
    at: &str,
) -> Result<Mapped, SpecError> {
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
        "npy" => npy::npy_range(&map, g, l.elem_bytes).map_err(|e| ferr(e.0))?,
        "safetensors" => {
            let Some(name) = l.tensor.as_deref() else {
                return Err(field_err(
                    format!("{at}.tensor"),
                    "null",
                    "a .safetensors file needs \"tensor\": the tensor's name",
                ));
            };
            safetensors_lookup::safetensors_range(&map, name, g, l.elem_bytes)
                .map_err(|e| ferr(e.0))?
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
