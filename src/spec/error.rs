//! Errors of `checksum --spec`: every message names the spec field or the file and its value.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvferry_checksum::layout::LayoutError;

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
    #[error("spec {path}: {source}")]
    Json {
        /// The spec file's path, as given.
        path: PathBuf,
        /// serde_json's error (with line and column).
        source: serde_json::Error,
    },
    /// A field holds a value that cannot be used.
    #[error("{field} = {value}: {why}")]
    Field {
        /// Where the field is in the spec, e.g. `groups[0].layers[1].dims.D`.
        field: String,
        /// The value found, as text.
        value: String,
        /// Why it cannot be used.
        why: FieldFault,
    },
    /// A tensor file is missing, unreadable or does not match the spec.
    #[error("{field}: file {path}: {why}")]
    File {
        /// The spec field that names the file, e.g. `groups[0].layers[1].path`.
        field: String,
        /// The tensor file's path (relative paths resolved against the spec's folder).
        path: PathBuf,
        /// What is wrong with it (missing, unreadable, wrong size, ...); boxed, as it is the
        /// largest cause and every spec result carries it.
        why: Box<FileFault>,
    },
}

/// Why a spec field's value cannot be used ([`SpecError::Field`]).
#[derive(Debug, Error)]
pub enum FieldFault {
    /// The layout, element size or dims do not make a layout or geometry (the checksum
    /// crate's error).
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// `dims.KV` given: KV is implied.
    #[error("KV is always 2 and must not be given")]
    KvGiven,
    /// A dims key other than B, N, H, D.
    #[error("expected B, N, H or D")]
    UnknownDim,
    /// A dimension the layout needs is absent.
    #[error("{0} is required")]
    DimRequired(&'static str),
    /// `H` absent although the layout has heads.
    #[error("H is required by the layout")]
    HeadsRequired,
    /// `H` other than 1 for a layout without heads.
    #[error("layout {0:?} has no H dimension")]
    NoHeads(String),
    /// A cell that is not whole 8-byte pieces.
    #[error(
        "a cell of {cell_bytes} bytes (parts {parts} × D {head_dim} × elem_bytes {elem_bytes}) \
         is not whole 8-byte pieces"
    )]
    Cell {
        /// Bytes of one cell.
        cell_bytes: u64,
        /// Parts per cell (2 for K and V, 1 for a latent).
        parts: u64,
        /// D.
        head_dim: u64,
        /// Bytes per element.
        elem_bytes: u64,
    },
    /// A block size of 0.
    #[error("must be at least 1")]
    Zero,
    /// A layer name without exactly one layer number.
    #[error("holds no (single) layer number")]
    NoLayerNumber,
    /// The layer's kernel blocks × N differ from the group's block size.
    #[error(
        "kernel_blocks × N = {layer_block_size} but the group's block_size is {group_block_size}"
    )]
    KernelBlocks {
        /// The layer's block size (kernel_blocks × N), tokens.
        layer_block_size: u64,
        /// The group's block size, tokens.
        group_block_size: u64,
    },
    /// A block id at or past a layer's logical block count.
    #[error("layer {layer} holds {blocks} logical blocks")]
    BlockId {
        /// The layer's index in its group.
        layer: usize,
        /// Logical blocks in that layer.
        blocks: u64,
    },
    /// A `.safetensors` file without `"tensor"`.
    #[error("a .safetensors file needs \"tensor\": the tensor's name")]
    TensorNeeded,
    /// `"tensor"` for a file that has no named tensors.
    #[error("only .safetensors files hold named tensors")]
    TensorNotNamed,
}

/// What is wrong with a tensor file ([`SpecError::File`]).
#[derive(Debug, Error)]
pub enum FileFault {
    /// It cannot be opened or its size read.
    #[error("{0}")]
    Read(#[source] std::io::Error),
    /// It is empty where KV is expected.
    #[error("is empty, expected {0} bytes of KV")]
    Empty(u64),
    /// It cannot be mapped.
    #[error("cannot map: {0}")]
    Map(#[source] std::io::Error),
    /// A `.npy` or `.safetensors` file that does not hold the layer's array.
    #[error("{0}")]
    Format(#[source] FormatError),
    /// A raw file whose size is not the layer's.
    #[error("holds {len} bytes, but layout {layout} with dims {dims:?} and elem_bytes {elem_bytes} needs {want}")]
    Size {
        /// The file's bytes.
        len: u64,
        /// The layout text.
        layout: String,
        /// The dims.
        dims: BTreeMap<String, u64>,
        /// Bytes per element.
        elem_bytes: u64,
        /// The bytes the layer's geometry spans.
        want: u64,
    },
}

/// Why a `.npy` or `.safetensors` file does not hold the KV a layer needs; each names the
/// part of the file (magic, header, dtype, shape, length).
#[derive(Debug, Error)]
pub enum FormatError {
    /// Not `\x93NUMPY` at the start (or under 10 bytes).
    #[error("not a .npy file (bad magic)")]
    NpyMagic,
    /// A `.npy` format version other than 1, 2, 3 (or a 2/3 header cut short).
    #[error(".npy version {0} is not supported")]
    NpyVersion(u8),
    /// The header's length runs past the file's end.
    #[error(".npy header runs past the end of the file")]
    NpyHeaderPastEnd,
    /// The header is not UTF-8.
    #[error(".npy header is not text")]
    NpyHeaderText,
    /// The header lacks this key (`descr` or `shape`).
    #[error(".npy header has no '{0}'")]
    NpyNoKey(&'static str),
    /// `descr` is not a quoted string.
    #[error(".npy descr is not a string")]
    NpyDescrNotString,
    /// `descr` (this one) is not a byte order, kind and size.
    #[error(".npy descr {0:?} is not a simple type")]
    NpyDescrType(String),
    /// The elements' size is not the spec's `elem_bytes`.
    #[error(".npy descr {descr:?} has {itemsize}-byte elements, but elem_bytes is {elem_bytes}")]
    NpyElemBytes {
        /// The descr.
        descr: String,
        /// Bytes per element in the file.
        itemsize: u64,
        /// Bytes per element in the spec.
        elem_bytes: u64,
    },
    /// Big-endian elements (this descr) wider than a byte.
    #[error(".npy descr {0:?} is big-endian; the checksum reads the bytes as they lie in memory")]
    NpyBigEndian(String),
    /// A Fortran-ordered array.
    #[error(".npy array is in Fortran order; save it C-contiguous")]
    NpyFortran,
    /// `shape` is not a tuple.
    #[error(".npy shape is not a tuple")]
    NpyShapeNotTuple,
    /// `shape` (this text) holds something other than integers.
    #[error(".npy shape ({0}) is not integers")]
    NpyShapeNotIntegers(String),
    /// The product of `shape` overflows u64.
    #[error(".npy shape overflows")]
    NpyShapeOverflow,
    /// The array's bytes are not the layer's.
    #[error(
        ".npy shape ({shape}) holds {count} elements of {itemsize} bytes, but the layout needs \
         {want} bytes"
    )]
    NpyLength {
        /// The shape, as written.
        shape: String,
        /// Elements in the shape.
        count: u64,
        /// Bytes per element.
        itemsize: u64,
        /// Bytes the layer's geometry spans.
        want: u64,
    },
    /// Fewer bytes after the header than the shape says.
    #[error("the .npy file is shorter than its header says")]
    NpyShort,
    /// Not a safetensors file: the safetensors reader's error.
    #[error("not a safetensors file: {0}")]
    Safetensors(#[source] safetensors::SafeTensorError),
    /// The named tensor cannot be read: the safetensors reader's error.
    #[error("tensor {name:?}: {source}")]
    Tensor {
        /// The tensor's name.
        name: String,
        /// The reader's error.
        source: safetensors::SafeTensorError,
    },
    /// The tensor's dtype is not `elem_bytes` wide.
    #[error("tensor {name:?} has dtype {dtype} ({bits} bits), but elem_bytes is {elem_bytes}")]
    Dtype {
        /// The tensor's name.
        name: String,
        /// Its dtype.
        dtype: safetensors::Dtype,
        /// Bits per element.
        bits: u64,
        /// Bytes per element in the spec.
        elem_bytes: u64,
    },
    /// The tensor's bytes are not the layer's.
    #[error("tensor {name:?} of shape {shape:?} holds {len} bytes, but the layout needs {want}")]
    TensorLength {
        /// The tensor's name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Its bytes.
        len: usize,
        /// Bytes the layer's geometry spans.
        want: u64,
    },
}

/// A [`SpecError::Field`]: `field` holds `value`, which cannot be used because `why`.
pub(super) fn field_err(
    field: impl Into<String>,
    value: impl ToString,
    why: FieldFault,
) -> SpecError {
    SpecError::Field {
        field: field.into(),
        value: value.to_string(),
        why,
    }
}
