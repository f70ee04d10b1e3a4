//! The layout model of docs/design.md §2.2: a layer's cache is an array of fixed-size
//! elements whose dimensions are a permutation of a subset of `KV` (2: K, V),
//! `B` (kernel blocks), `N` (tokens per kernel block), `H` (KV heads on this rank)
//! and `D` (elements per head), with byte strides.

use std::fmt;
use std::ops::Range;

use thiserror::Error;

/// One named dimension of a layer's cache array (docs/design.md §2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    /// K or V (size 2). Absent for caches with a single part (MLA latent caches).
    Kv,
    /// Kernel blocks.
    B,
    /// Tokens per kernel block.
    N,
    /// KV heads held by this rank. Absent means one head.
    H,
    /// Elements per head (per part).
    D,
}

impl Dim {
    /// The dimension's name as written in a layout string (`KV`, `B`, `N`, `H`, `D`).
    pub fn name(self) -> &'static str {
        match self {
            Dim::Kv => "KV",
            Dim::B => "B",
            Dim::N => "N",
            Dim::H => "H",
            Dim::D => "D",
        }
    }

    fn parse(s: &str) -> Option<Dim> {
        match s.to_ascii_uppercase().as_str() {
            "KV" => Some(Dim::Kv),
            "B" => Some(Dim::B),
            "N" => Some(Dim::N),
            "H" => Some(Dim::H),
            "D" => Some(Dim::D),
            _ => None,
        }
    }
}

/// Size in bytes of one element: 1, 2, 4 or 8 (fp8, bf16/fp16, fp32, fp64/u64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemBytes {
    /// 1-byte elements (fp8, int8).
    One = 1,
    /// 2-byte elements (bf16, fp16).
    Two = 2,
    /// 4-byte elements (fp32).
    Four = 4,
    /// 8-byte elements.
    Eight = 8,
}

impl ElemBytes {
    /// The element size for `bytes`; errors ([`LayoutError::ElemBytes`]) unless 1, 2, 4 or 8.
    pub fn new(bytes: u64) -> Result<ElemBytes, LayoutError> {
        match bytes {
            1 => Ok(ElemBytes::One),
            2 => Ok(ElemBytes::Two),
            4 => Ok(ElemBytes::Four),
            8 => Ok(ElemBytes::Eight),
            other => Err(LayoutError::ElemBytes(other)),
        }
    }

    /// Bytes per element.
    pub fn get(self) -> u64 {
        self as u64
    }
}

/// Errors building a [`Layout`] or [`Geometry`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// A dimension name that is not one of `KV B N H D`.
    #[error("layout {layout:?}: unknown dimension {dim:?} (expected KV, B, N, H or D)")]
    UnknownDim {
        /// The layout text as given.
        layout: String,
        /// The word that is not a dimension name.
        dim: String,
    },
    /// A dimension named twice.
    #[error("layout {layout:?}: dimension {dim} appears twice")]
    DuplicateDim {
        /// The layout text (as given, or the dimension names joined by spaces).
        layout: String,
        /// The repeated dimension's name (`KV`, `B`, `N`, `H` or `D`).
        dim: String,
    },
    /// `B`, `N` or `D` missing.
    #[error("layout {layout:?}: dimension {dim} is required")]
    MissingDim {
        /// The layout text (as given, or the dimension names joined by spaces).
        layout: String,
        /// The missing dimension's name: `B`, `N` or `D`.
        dim: String,
    },
    /// An element size other than 1, 2, 4 or 8 bytes.
    #[error("elem_bytes {0}: must be 1, 2, 4 or 8")]
    ElemBytes(u64),
    /// A zero or overflowing size.
    #[error("{field} = {value}: {why}")]
    BadSize {
        /// Which size: `B`, `N`, `H`, `D`, `kernel_blocks`, or `array` (the array's byte size).
        field: &'static str,
        /// The refused value (for `array`, the byte count reached before the overflow).
        value: u64,
        /// Why it is refused, e.g. "must be at least 1" or "too large" (over 2^40).
        why: &'static str,
    },
    /// Strides that do not match the dimensions or address outside the array.
    #[error("strides: {0}")]
    BadStrides(StrideFault),
}

/// What is wrong with explicit strides ([`Geometry::with_strides`]).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StrideFault {
    /// Not one stride per layout dimension.
    #[error("{given} strides for layout {layout} with {dims} dimensions")]
    Count {
        /// Strides given.
        given: usize,
        /// The layout.
        layout: Layout,
        /// Its dimensions.
        dims: usize,
    },
    /// A stride of 0 (the `index`-th, of `dim`).
    #[error("stride {index} ({}) is zero", .dim.name())]
    Zero {
        /// Position in the strides.
        index: usize,
        /// Its dimension.
        dim: Dim,
    },
    /// The array's span overflows u64 at the `index`-th stride.
    #[error("stride {index} ({}) = {stride} overflows", .dim.name())]
    Overflow {
        /// Position in the strides.
        index: usize,
        /// Its dimension.
        dim: Dim,
        /// The stride, bytes.
        stride: u64,
    },
}

/// The order of a layer's array dimensions, outermost first, e.g. `KV B N H D`
/// (vLLM FlashAttention), `B KV N H D` (FlashInfer), `B KV H N D` (HND),
/// `B H N KV D` (fused), `B N D` (MLA). docs/design.md §2.2.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    dims: Vec<Dim>,
}

impl Layout {
    /// Parses a whitespace-separated list of dimension names (case-insensitive).
    /// `B`, `N` and `D` are required; `KV` and `H` are optional; none may repeat.
    /// Errors: [`LayoutError::UnknownDim`], [`LayoutError::DuplicateDim`], [`LayoutError::MissingDim`].
    pub fn parse(text: &str) -> Result<Layout, LayoutError> {
        let mut dims = Vec::new();
        for word in text.split_whitespace() {
            let dim = Dim::parse(word).ok_or_else(|| LayoutError::UnknownDim {
                layout: text.to_string(),
                dim: word.to_string(),
            })?;
            if dims.contains(&dim) {
                return Err(LayoutError::DuplicateDim {
                    layout: text.to_string(),
                    dim: dim.name().into(),
                });
            }
            dims.push(dim);
        }
        Layout::from_dims(dims).map_err(|e| match e {
            LayoutError::MissingDim { dim, .. } => LayoutError::MissingDim {
                layout: text.to_string(),
                dim,
            },
            other => other,
        })
    }

    /// A layout from dimensions, outermost first (same rules as [`Layout::parse`]).
    pub fn from_dims(dims: Vec<Dim>) -> Result<Layout, LayoutError> {
        let text = dims.iter().map(|d| d.name()).collect::<Vec<_>>().join(" ");
        for (i, d) in dims.iter().enumerate() {
            if dims[..i].contains(d) {
                return Err(LayoutError::DuplicateDim {
                    layout: text,
                    dim: d.name().into(),
                });
            }
        }
        for req in [Dim::B, Dim::N, Dim::D] {
            if !dims.contains(&req) {
                return Err(LayoutError::MissingDim {
                    layout: text,
                    dim: req.name().into(),
                });
            }
        }
        Ok(Layout { dims })
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[Dim] {
        &self.dims
    }

    /// Whether the array has a `KV` dimension (separate K and V parts).
    pub fn has_kv(&self) -> bool {
        self.dims.contains(&Dim::Kv)
    }

    /// Whether the array has an `H` dimension (absent = one head).
    pub fn has_heads(&self) -> bool {
        self.dims.contains(&Dim::H)
    }

    /// Position of `dim` in the layout, if present.
    pub fn position(&self, dim: Dim) -> Option<usize> {
        self.dims.iter().position(|&d| d == dim)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.dims.iter().map(|d| d.name()).collect();
        f.write_str(&names.join(" "))
    }
}

/// One layer's cache array on one rank (docs/design.md §2.2): sizes, element size,
/// kernel blocks per logical block and byte strides per layout dimension.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Geometry {
    /// Order of the dimensions.
    pub layout: Layout,
    /// `B`: kernel blocks in the array.
    pub num_kernel_blocks: u64,
    /// `N`: tokens per kernel block.
    pub tokens_per_kernel_block: u64,
    /// `H`: KV heads on this rank (1 when the layout has no `H`).
    pub heads: u64,
    /// `D`: elements per head and part.
    pub head_dim: u64,
    /// Element size.
    pub elem: ElemBytes,
    /// Kernel blocks per logical block: `block_size = kernel_blocks_per_block * N`.
    pub kernel_blocks_per_block: u64,
    /// Byte stride per layout dimension, outermost first (same order as `layout.dims()`).
    pub strides: Vec<u64>,
}

/// Sizes above this are refused, so that products of sizes and strides cannot overflow u64.
const MAX_SIZE: u64 = 1 << 40;

impl Geometry {
    /// A C-contiguous array in `layout` order with sizes `b, n, h, d` (`h` must be 1 when the
    /// layout has no `H`; sizes must be non-zero) and `kernel_blocks_per_block` kernel blocks
    /// per logical block. Errors: [`LayoutError::BadSize`].
    pub fn contiguous(
        layout: Layout,
        b: u64,
        n: u64,
        h: u64,
        d: u64,
        elem: ElemBytes,
        kernel_blocks_per_block: u64,
    ) -> Result<Geometry, LayoutError> {
        let check = |field: &'static str, value: u64| -> Result<(), LayoutError> {
            if value == 0 {
                Err(LayoutError::BadSize {
                    field,
                    value,
                    why: "must be at least 1",
                })
            } else if value > MAX_SIZE {
                Err(LayoutError::BadSize {
                    field,
                    value,
                    why: "too large",
                })
            } else {
                Ok(())
            }
        };
        check("B", b)?;
        check("N", n)?;
        check("H", h)?;
        check("D", d)?;
        check("kernel_blocks", kernel_blocks_per_block)?;
        if !layout.has_heads() && h != 1 {
            return Err(LayoutError::BadSize {
                field: "H",
                value: h,
                why: "layout has no H dimension, so H must be 1",
            });
        }
        let mut g = Geometry {
            layout,
            num_kernel_blocks: b,
            tokens_per_kernel_block: n,
            heads: h,
            head_dim: d,
            elem,
            kernel_blocks_per_block,
            strides: Vec::new(),
        };
        let mut strides = vec![0u64; g.layout.dims().len()];
        let mut acc = elem.get();
        for (i, &dim) in g.layout.dims().iter().enumerate().rev() {
            strides[i] = acc;
            acc = acc
                .checked_mul(g.size_of(dim))
                .filter(|&v| v <= MAX_SIZE * 64)
                .ok_or(LayoutError::BadSize {
                    field: "array",
                    value: acc,
                    why: "byte size overflows or exceeds 64 TiB",
                })?;
        }
        g.strides = strides;
        Ok(g)
    }

    /// The same sizes with explicit byte strides (outermost first, one per layout dimension).
    /// Errors ([`LayoutError::BadStrides`]) on a wrong count, a zero stride, or a span that overflows.
    pub fn with_strides(mut self, strides: Vec<u64>) -> Result<Geometry, LayoutError> {
        if strides.len() != self.layout.dims().len() {
            return Err(LayoutError::BadStrides(StrideFault::Count {
                given: strides.len(),
                layout: self.layout.clone(),
                dims: self.layout.dims().len(),
            }));
        }
        let mut span: u64 = self.elem.get();
        for (i, (&dim, &s)) in self.layout.dims().iter().zip(&strides).enumerate() {
            if s == 0 {
                return Err(LayoutError::BadStrides(StrideFault::Zero { index: i, dim }));
            }
            let extent = (self.size_of(dim) - 1)
                .checked_mul(s)
                .and_then(|e| e.checked_add(span))
                .ok_or(LayoutError::BadStrides(StrideFault::Overflow {
                    index: i,
                    dim,
                    stride: s,
                }))?;
            span = extent;
        }
        self.strides = strides;
        Ok(self)
    }

    /// Size of one layout dimension (`KV` = 2).
    pub fn size_of(&self, dim: Dim) -> u64 {
        match dim {
            Dim::Kv => 2,
            Dim::B => self.num_kernel_blocks,
            Dim::N => self.tokens_per_kernel_block,
            Dim::H => self.heads,
            Dim::D => self.head_dim,
        }
    }

    /// Byte stride of `dim`, or 0 when the layout does not have it.
    pub fn stride_of(&self, dim: Dim) -> u64 {
        self.layout
            .position(dim)
            .map(|i| self.strides[i])
            .unwrap_or(0)
    }

    /// Bytes the array spans: the offset of its last element plus one element.
    pub fn byte_len(&self) -> u64 {
        self.layout
            .dims()
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| (self.size_of(d) - 1) * s)
            .sum::<u64>()
            + self.elem.get()
    }

    /// Tokens per logical block: `kernel_blocks_per_block * N`.
    pub fn block_size(&self) -> u64 {
        self.kernel_blocks_per_block * self.tokens_per_kernel_block
    }

    /// Logical blocks in the array (`B / kernel_blocks_per_block`, rounded down).
    pub fn num_blocks(&self) -> u64 {
        self.num_kernel_blocks / self.kernel_blocks_per_block
    }

    /// Parts per cell: 2 (K and V) with a `KV` dimension, else 1.
    pub fn parts(&self) -> u64 {
        if self.layout.has_kv() {
            2
        } else {
            1
        }
    }

    /// Bytes of one cell (one token, one head): `parts * D * elem`.
    pub fn cell_bytes(&self) -> u64 {
        self.parts() * self.head_dim * self.elem.get()
    }

    /// 8-byte pieces per cell (`P` of §2.1); `None` when the cell is not a whole number of pieces.
    pub fn pieces_per_cell(&self) -> Option<u64> {
        let c = self.cell_bytes();
        c.is_multiple_of(8).then_some(c / 8)
    }

    /// Byte offset of element `d` of part `part` (0 = K, 1 = V) of head `head` of token
    /// `token` (within the kernel block) of kernel block `kernel_block`.
    pub fn byte_offset(&self, part: u64, kernel_block: u64, token: u64, head: u64, d: u64) -> u64 {
        let mut off = 0;
        for (&dim, &s) in self.layout.dims().iter().zip(&self.strides) {
            let idx = match dim {
                Dim::Kv => part,
                Dim::B => kernel_block,
                Dim::N => token,
                Dim::H => head,
                Dim::D => d,
            };
            off += idx * s;
        }
        off
    }

    /// Bytes between logical block `b` and `b + 1`: every range of
    /// [`Geometry::block_head_byte_ranges`]`(b, heads)` is the same range of block 0 moved by
    /// `b * block_stride()` (the block index enters an element's offset linearly), so a caller
    /// walking many blocks computes block 0's ranges once. 0 when the layout has no `B` (never
    /// for a valid geometry).
    pub fn block_stride(&self) -> u64 {
        self.layout
            .dims()
            .iter()
            .zip(&self.strides)
            .find(|(d, _)| **d == Dim::B)
            .map_or(0, |(_, &s)| s.saturating_mul(self.kernel_blocks_per_block))
    }

    /// The bytes a transfer moves for logical block `block_id`: coalesced, ascending, non-overlapping
    /// byte ranges covering every element of its kernel blocks. Empty when `block_id >= num_blocks()`.
    pub fn block_byte_ranges(&self, block_id: u64) -> Vec<Range<u64>> {
        self.block_head_byte_ranges(block_id, 0..self.heads)
    }

    /// The bytes of local KV heads `heads` (of `0..self.heads`) of logical block `block_id`,
    /// as [`Geometry::block_byte_ranges`] gives the whole block: what a transfer moves when the
    /// other side's TP rank holds only some of this rank's heads (docs/design.md §4, different TP
    /// sizes). Layouts without `H` have one head. Empty when the block or the head range is out
    /// of range, or the range is empty.
    pub fn block_head_byte_ranges(&self, block_id: u64, heads: Range<u64>) -> Vec<Range<u64>> {
        if block_id >= self.num_blocks() || heads.start >= heads.end || heads.end > self.heads {
            return Vec::new();
        }
        let kb0 = block_id * self.kernel_blocks_per_block;
        self.sub_array_ranges(
            kb0..kb0 + self.kernel_blocks_per_block,
            0..self.tokens_per_kernel_block,
            heads,
        )
    }

    /// The bytes of tokens `tokens` (of `0..N`) of kernel block `kernel_block`, local KV heads
    /// `heads`: what a transfer moves when the two sides' block sizes differ and a block is
    /// filled token by token from the other side's blocks (docs/design.md §4.5). Same form as
    /// [`Geometry::block_byte_ranges`] (coalesced, ascending). Empty when the kernel block, the
    /// token range or the head range is out of range or empty.
    pub fn token_head_byte_ranges(
        &self,
        kernel_block: u64,
        tokens: Range<u64>,
        heads: Range<u64>,
    ) -> Vec<Range<u64>> {
        if kernel_block >= self.num_kernel_blocks
            || tokens.start >= tokens.end
            || tokens.end > self.tokens_per_kernel_block
            || heads.start >= heads.end
            || heads.end > self.heads
        {
            return Vec::new();
        }
        self.sub_array_ranges(kernel_block..kernel_block + 1, tokens, heads)
    }

    /// The coalesced byte ranges of the sub-array `kernel_blocks × tokens × heads` (every part
    /// and element); the ranges must lie inside the array.
    fn sub_array_ranges(
        &self,
        kernel_blocks: Range<u64>,
        tokens: Range<u64>,
        heads: Range<u64>,
    ) -> Vec<Range<u64>> {
        let dims = self.layout.dims();
        let span = |r: &Range<u64>| (r.start, r.end - r.start);
        // Per dim: (first index, count, stride)
        let spec: Vec<(u64, u64, u64)> = dims
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| match d {
                Dim::B => (span(&kernel_blocks).0, span(&kernel_blocks).1, s),
                Dim::N => (span(&tokens).0, span(&tokens).1, s),
                Dim::H => (span(&heads).0, span(&heads).1, s),
                _ => (0, self.size_of(d), s),
            })
            .collect();
        // Longest suffix of dims that is one dense run: stride[i] == count[i+1] * stride[i+1] ...
        let elem = self.elem.get();
        let mut dense_from = spec.len();
        let mut run = elem;
        for i in (0..spec.len()).rev() {
            let (_, count, stride) = spec[i];
            if stride != run && count > 1 {
                break;
            }
            run = if count > 1 { stride * count } else { run };
            dense_from = i;
        }
        let mut ranges = Vec::new();
        let mut idx = vec![0u64; dense_from];
        loop {
            let base: u64 = spec
                .iter()
                .enumerate()
                .map(|(i, &(first, _, s))| (first + if i < dense_from { idx[i] } else { 0 }) * s)
                .sum();
            ranges.push(base..base + run);
            // Odometer over the non-dense dims.
            let mut i = dense_from;
            loop {
                if i == 0 {
                    return coalesce(ranges);
                }
                i -= 1;
                idx[i] += 1;
                if idx[i] < spec[i].1 {
                    break;
                }
                idx[i] = 0;
            }
        }
    }
}

fn coalesce(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}
