//! Conversions between the checksum crate's layer geometry (DESIGN.md §2.2) and
//! its wire form, and the compatibility rule for copying a block byte-for-byte.

use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};

use crate::proto::msg::WireGeometry;

/// The wire form of a geometry.
pub fn to_wire(g: &Geometry) -> WireGeometry {
    WireGeometry {
        layout: g.layout.to_string(),
        num_kernel_blocks: g.num_kernel_blocks,
        tokens_per_kernel_block: g.tokens_per_kernel_block,
        heads: g.heads,
        head_dim: g.head_dim,
        elem_bytes: g.elem.get(),
        kernel_blocks_per_block: g.kernel_blocks_per_block,
        strides: g.strides.clone(),
    }
}

/// Rebuilds a geometry from a peer's description, validating every number
/// (the checksum crate refuses zero, oversized and overflowing sizes and strides).
pub fn from_wire(w: &WireGeometry) -> Result<Geometry, String> {
    let layout = Layout::parse(&w.layout).map_err(|e| e.to_string())?;
    let elem = ElemBytes::new(w.elem_bytes).map_err(|e| e.to_string())?;
    Geometry::contiguous(
        layout,
        w.num_kernel_blocks,
        w.tokens_per_kernel_block,
        w.heads,
        w.head_dim,
        elem,
        w.kernel_blocks_per_block,
    )
    .and_then(|g| g.with_strides(w.strides.clone()))
    .map_err(|e| e.to_string())
}

/// Whether a block of `a` can be copied byte-for-byte into a block of `b`: the
/// same layout, tokens per kernel block, heads, head size, element size and
/// kernel blocks per block (the number of blocks and the strides may differ;
/// both sides list a block's bytes in the same logical order). `Err` says what differs.
pub fn compatible(a: &Geometry, b: &Geometry) -> Result<(), String> {
    let pairs = [
        (
            "tokens per kernel block",
            a.tokens_per_kernel_block,
            b.tokens_per_kernel_block,
        ),
        ("KV heads", a.heads, b.heads),
        ("head size", a.head_dim, b.head_dim),
        ("element bytes", a.elem.get(), b.elem.get()),
        (
            "kernel blocks per block",
            a.kernel_blocks_per_block,
            b.kernel_blocks_per_block,
        ),
    ];
    if a.layout != b.layout {
        return Err(format!(
            "layouts differ: producer {} consumer {}",
            a.layout, b.layout
        ));
    }
    for (what, x, y) in pairs {
        if x != y {
            return Err(format!("{what} differ: producer {x} consumer {y}"));
        }
    }
    // Address order must be the layout's order for the byte-for-byte pairing.
    for (side, g) in [("producer", a), ("consumer", b)] {
        let strides: Vec<u64> = g
            .layout
            .dims()
            .iter()
            .zip(&g.strides)
            .filter(|(d, _)| g.size_of(**d) > 1)
            .map(|(_, s)| *s)
            .collect();
        if strides.windows(2).any(|w| w[0] <= w[1]) {
            return Err(format!(
                "{side} strides {:?} do not decrease along the layout",
                g.strides
            ));
        }
    }
    Ok(())
}
