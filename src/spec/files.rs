//! A layer's tensor file mapped and its array found in it: a raw C-contiguous array (`.bin`),
//! a `.npy` file or a tensor of a `.safetensors` file, each checked against the geometry.

use std::fs::File;
use std::path::Path;

use kvferry_checksum::layout::Geometry;
use memmap2::Mmap;

use super::error::{field_err, FieldFault, FileFault, SpecError};
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
    let ferr = |why: FileFault| SpecError::File {
        field: format!("{at}.path"),
        path: path.clone(),
        why: Box::new(why),
    };
    let file = File::open(&path).map_err(|e| ferr(FileFault::Read(e)))?;
    let len = file.metadata().map_err(|e| ferr(FileFault::Read(e)))?.len();
    let want = g.byte_len();
    if len == 0 {
        return match want {
            0 => Ok(Mapped {
                map: None,
                range: 0..0,
            }),
            _ => Err(ferr(FileFault::Empty(want))),
        };
    }
    // SAFETY: the file is mapped read-only for the duration of this command; like any tool that
    // reads a file, it assumes no other process truncates or rewrites the file meanwhile.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| ferr(FileFault::Map(e)))?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let range = match ext.as_str() {
        "npy" => npy::npy_range(&map, g, l.elem_bytes).map_err(|e| ferr(FileFault::Format(e)))?,
        "safetensors" => {
            let Some(name) = l.tensor.as_deref() else {
                return Err(field_err(
                    format!("{at}.tensor"),
                    "null",
                    FieldFault::TensorNeeded,
                ));
            };
            safetensors_lookup::safetensors_range(&map, name, g, l.elem_bytes)
                .map_err(|e| ferr(FileFault::Format(e)))?
        }
        _ => {
            if l.tensor.is_some() {
                return Err(field_err(
                    format!("{at}.tensor"),
                    format!("{:?}", l.tensor),
                    FieldFault::TensorNotNamed,
                ));
            }
            if len != want {
                return Err(ferr(FileFault::Size {
                    len,
                    layout: l.layout.clone(),
                    dims: l.dims.clone(),
                    elem_bytes: l.elem_bytes,
                    want,
                }));
            }
            0..want as usize
        }
    };
    Ok(Mapped {
        map: Some(map),
        range,
    })
}
