//! The spec file's schema (see the `spec` module docs) and the geometry of a layer from it.

use std::collections::BTreeMap;

use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use serde::Deserialize;

use super::error::{field_err, FieldFault, SpecError};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SpecFile {
    pub num_tokens: u64,
    pub groups: Vec<SpecGroup>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SpecGroup {
    pub group_id: u32,
    pub block_size: u64,
    #[serde(default)]
    pub start: u64,
    pub block_ids: Vec<u64>,
    pub layers: Vec<SpecLayer>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SpecLayer {
    pub name: String,
    pub path: String,
    #[serde(default)]
    pub tensor: Option<String>,
    pub layout: String,
    pub dims: BTreeMap<String, u64>,
    pub elem_bytes: u64,
    #[serde(default = "one")]
    pub kernel_blocks: u64,
    #[serde(default)]
    pub head_offset: u32,
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub dtype: Option<String>,
}

fn one() -> u64 {
    1
}

/// The geometry of one layer from its `layout`, `dims`, `elem_bytes` and `kernel_blocks`.
pub(super) fn geometry(l: &SpecLayer, at: &str) -> Result<Geometry, SpecError> {
    let layout = Layout::parse(&l.layout).map_err(|e| {
        field_err(
            format!("{at}.layout"),
            format!("{:?}", l.layout),
            FieldFault::Layout(e),
        )
    })?;
    for key in l.dims.keys() {
        let known = matches!(key.as_str(), "B" | "N" | "H" | "D");
        if !known {
            let why = if key == "KV" {
                FieldFault::KvGiven
            } else {
                FieldFault::UnknownDim
            };
            return Err(field_err(format!("{at}.dims.{key}"), l.dims[key], why));
        }
    }
    let dim = |name: &'static str| -> Result<u64, SpecError> {
        l.dims.get(name).copied().ok_or_else(|| {
            field_err(
                format!("{at}.dims"),
                format!("{:?}", l.dims),
                FieldFault::DimRequired(name),
            )
        })
    };
    let h = match (layout.has_heads(), l.dims.get("H")) {
        (true, Some(&h)) => h,
        (true, None) => {
            return Err(field_err(
                format!("{at}.dims"),
                format!("{:?}", l.dims),
                FieldFault::HeadsRequired,
            ))
        }
        (false, None) | (false, Some(1)) => 1,
        (false, Some(&h)) => {
            return Err(field_err(
                format!("{at}.dims.H"),
                h,
                FieldFault::NoHeads(l.layout.clone()),
            ))
        }
    };
    let elem = ElemBytes::new(l.elem_bytes)
        .map_err(|e| field_err(format!("{at}.elem_bytes"), l.elem_bytes, e.into()))?;
    let g = Geometry::contiguous(
        layout,
        dim("B")?,
        dim("N")?,
        h,
        dim("D")?,
        elem,
        l.kernel_blocks,
    )
    .map_err(|e| field_err(format!("{at}.dims"), format!("{:?}", l.dims), e.into()))?;
    if g.pieces_per_cell().is_none() {
        return Err(field_err(
            format!("{at}.dims.D"),
            g.head_dim,
            FieldFault::Cell {
                cell_bytes: g.cell_bytes(),
                parts: g.parts(),
                head_dim: g.head_dim,
                elem_bytes: l.elem_bytes,
            },
        ));
    }
    Ok(g)
}
