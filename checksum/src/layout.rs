//! The layout model of DESIGN.md §2.2: a layer's cache is an array of fixed-size
//! elements whose dimensions are a permutation of a subset of `KV` (2: K, V),
//! `B` (kernel blocks), `N` (tokens per kernel block), `H` (KV heads on this rank)
//! and `D` (elements per head), with byte strides.

use thiserror::Error;

/// One named dimension of a layer's cache array (DESIGN.md §2.2).
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

/// Errors building a [`Layout`] or [`Geometry`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// A dimension name that is not one of `KV B N H D`.
    #[error("layout {layout:?}: unknown dimension {dim:?} (expected KV, B, N, H or D)")]
    UnknownDim { layout: String, dim: String },
    /// A dimension named twice.
    #[error("layout {layout:?}: dimension {dim} appears twice")]
    DuplicateDim { layout: String, dim: String },
    /// `B`, `N` or `D` missing.
    #[error("layout {layout:?}: dimension {dim} is required")]
    MissingDim { layout: String, dim: String },
    /// An element size other than 1, 2, 4 or 8 bytes.
    #[error("elem_bytes {0}: must be 1, 2, 4 or 8")]
    ElemBytes(u64),
    /// A zero or overflowing size.
    #[error("{field} = {value}: {why}")]
    BadSize { field: &'static str, value: u64, why: &'static str },
    /// Strides that do not match the dimensions or address outside the array.
    #[error("strides: {0}")]
    BadStrides(String),
}
