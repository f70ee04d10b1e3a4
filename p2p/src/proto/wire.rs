//! Conversions between the checksum crate's layer geometry (docs/design.md §2.2) and
//! its wire form, and the compatibility rule for copying a block byte-for-byte.

use kvferry_checksum::layout::{ElemBytes, Geometry, Layout, LayoutError};

use kvferry_kernels::LayerInput;

use crate::proto::msg_body::{WireGeometry, WireLayer};

/// The wire form of a layer: its name, array, head offset, geometry and element type.
pub fn to_wire_layer(l: &LayerInput) -> WireLayer {
    WireLayer {
        name: l.spec.name.clone(),
        addr: l.addr,
        len: l.len,
        head_offset: l.spec.head_offset,
        geometry: to_wire(&l.spec.geometry),
        dtype: l.spec.dtype.clone(),
    }
}

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
pub fn from_wire(w: &WireGeometry) -> Result<Geometry, LayoutError> {
    let layout = Layout::parse(&w.layout)?;
    let elem = ElemBytes::new(w.elem_bytes)?;
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
}

/// Why two geometries cannot be copied byte-for-byte ([`compatible`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Incompatible {
    /// The layouts (dimension orders) differ.
    #[error("layouts differ: producer {producer} consumer {consumer}")]
    Layout {
        /// The producer's layout.
        producer: String,
        /// The consumer's layout.
        consumer: String,
    },
    /// A size both sides must share differs.
    #[error("{what} differ: producer {producer} consumer {consumer}")]
    Size {
        /// Which size ("head size", "element bytes", ...).
        what: &'static str,
        /// The producer's value.
        producer: u64,
        /// The consumer's value.
        consumer: u64,
    },
    /// A side's strides put a dimension out of the layout's order.
    #[error("{side} strides {strides:?} do not decrease along the layout")]
    Strides {
        /// "producer" or "consumer".
        side: &'static str,
        /// That side's strides.
        strides: Vec<u64>,
    },
}

/// Whether the KV heads of a block of `a` can be copied byte-for-byte into a block
/// of `b`: the same layout, tokens per kernel block, head size, element size and
/// kernel blocks per block (the number of blocks, the number of KV heads (TP ranks
/// of different sizes hold different head counts) and the strides may differ; both
/// sides list a head range's bytes in the same logical order). `Err` says what differs.
pub fn compatible(a: &Geometry, b: &Geometry) -> Result<(), Incompatible> {
    let pairs = [
        (
            "tokens per kernel block",
            a.tokens_per_kernel_block,
            b.tokens_per_kernel_block,
        ),
        (
            "kernel blocks per block",
            a.kernel_blocks_per_block,
            b.kernel_blocks_per_block,
        ),
    ];
    compatible_cells(a, b)?;
    for (what, x, y) in pairs {
        if x != y {
            return Err(Incompatible::Size {
                what,
                producer: x,
                consumer: y,
            });
        }
    }
    Ok(())
}

/// Whether runs of tokens of `a` can be copied byte-for-byte into `b` within one kernel block
/// of each (filling blocks of one size from blocks of another, docs/design.md §4.5): the same
/// layout, head size and element size, address order equal to the layout order; the tokens
/// per kernel block, kernel blocks per block, number of blocks, KV heads and strides may
/// differ. `Err` says what differs.
pub fn compatible_cells(a: &Geometry, b: &Geometry) -> Result<(), Incompatible> {
    let pairs = [
        ("head size", a.head_dim, b.head_dim),
        ("element bytes", a.elem.get(), b.elem.get()),
    ];
    if a.layout != b.layout {
        return Err(Incompatible::Layout {
            producer: a.layout.to_string(),
            consumer: b.layout.to_string(),
        });
    }
    for (what, x, y) in pairs {
        if x != y {
            return Err(Incompatible::Size {
                what,
                producer: x,
                consumer: y,
            });
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
            return Err(Incompatible::Strides {
                side,
                strides: g.strides.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn geo(layout: &str, b: u64, h: u64) -> Geometry {
        Geometry::contiguous(
            Layout::parse(layout).unwrap(),
            b,
            16,
            h,
            8,
            ElemBytes::Two,
            1,
        )
        .unwrap()
    }

    #[test]
    fn geometry_round_trips() {
        for l in [
            "KV B N H D",
            "B KV N H D",
            "B KV H N D",
            "B H N KV D",
            "B N D",
        ] {
            let h = if l.contains('H') { 4 } else { 1 };
            let g = geo(l, 10, h);
            assert_eq!(from_wire(&to_wire(&g)).unwrap(), g);
        }
    }

    #[test]
    fn compatible_allows_other_block_and_head_counts_only() {
        assert_eq!(
            compatible(&geo("KV B N H D", 8, 2), &geo("KV B N H D", 12, 2)),
            Ok(())
        );
        assert_eq!(
            compatible(&geo("B KV H N D", 8, 4), &geo("B KV H N D", 8, 1)),
            Ok(()),
            "TP ranks of different sizes hold different head counts"
        );
        assert!(matches!(
            compatible(&geo("KV B N H D", 8, 2), &geo("B KV N H D", 8, 2)),
            Err(Incompatible::Layout { .. })
        ));
        // Strides that put a dimension out of layout order.
        let g = geo("B N H D", 8, 2);
        let odd = g.clone().with_strides(vec![512, 2, 256, 32]).unwrap();
        assert!(matches!(
            compatible(&g, &odd),
            Err(Incompatible::Strides {
                side: "consumer",
                ..
            })
        ));
    }

    #[test]
    fn bad_wire_geometry_is_an_error() {
        let mut w = to_wire(&geo("KV B N H D", 8, 2));
        w.layout = "KV B X".into();
        assert!(from_wire(&w).is_err());
        let mut w = to_wire(&geo("KV B N H D", 8, 2));
        w.strides.pop();
        assert!(from_wire(&w).is_err());
        let mut w = to_wire(&geo("KV B N H D", 8, 2));
        w.elem_bytes = 3;
        assert!(from_wire(&w).is_err());
    }

    proptest! {
        #[test]
        fn from_wire_never_panics(
            b in any::<u64>(), n in any::<u64>(), h in any::<u64>(), d in any::<u64>(),
            e in 0u64..10, k in any::<u64>(), strides in proptest::collection::vec(any::<u64>(), 0..6),
        ) {
            let w = WireGeometry {
                layout: "KV B N H D".into(), num_kernel_blocks: b, tokens_per_kernel_block: n,
                heads: h, head_dim: d, elem_bytes: e, kernel_blocks_per_block: k, strides,
            };
            if let Ok(g) = from_wire(&w) {
                let _ = g.byte_len();
            }
        }
    }
}
