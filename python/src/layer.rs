//! KV cache descriptions handed over from Python: a layer's tensor and its layout
//! ([`KVCacheLayer`]), a KV cache group of layers ([`KVCacheGroup`]) and one TP/PP rank's groups
//! ([`Rank`]). The checksum functions take layers; `Producer` and `Consumer` take ranks.
//!
//! A layer's layout is described as in `kvferry checksum --spec` (docs/design.md §2.2):
//! one dimension name per tensor axis, outermost first, from `KV` (size 2),
//! `B` (kernel blocks), `N` (tokens per kernel block), `H` (KV heads on this rank) and `D`
//! (elements per head); sizes and byte strides come from the tensor itself.

use kvferry_checksum::group::{parse_layer_number, LayerSpec, RankInfo, ReplicaKey, SkipReason};
use kvferry_checksum::layout::{Dim, ElemBytes, Geometry, Layout, LayoutError};
use kvferry_kernels::{LayerInput, Location};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::repr::str_repr;
use crate::tensor::{view_of, TensorView};

/// `"cpu"` or `"cuda:N"`.
pub fn device_name(d: Location) -> String {
    // The one location type's text form ("cpu" / "cuda:N").
    d.to_string()
}

/// One layer's KV cache tensor on one rank, with its layout.
///
/// KVCacheLayer(name, kv_cache, layout, *, kernel_blocks=1, head_offset=0, kind=None,
///              dtype=None, replicas=1, replica_index=0)
///
/// - name: the layer's name; its single all-digits dot-separated part is the layer number of
///   the checksum definition (``model.layers.12.self_attn.attn`` -> 12).
/// - kv_cache: the tensor (torch or numpy array, or any object with ``__dlpack__``,
///   ``data_ptr()``/``shape``/``stride()``, or ``__array_interface__``), in host memory or in
///   CUDA memory. It is not copied: it must stay allocated while this layer is in use (the
///   layer keeps a reference to it).
/// - layout: one dimension name per tensor axis, outermost first, as in
///   ``kvferry checksum --spec``: ``"KV B N H D"`` (vLLM FlashAttention), ``"B KV N H D"``
///   (FlashInfer), ``"B KV H N D"`` (HND), ``"B H N KV D"`` (fused), ``"B N D"`` (MLA). ``B``,
///   ``N`` and ``D`` are required; ``KV`` (size 2) and ``H`` (size 1 when absent) are optional.
/// - kernel_blocks: kernel blocks per logical block (block_size = kernel_blocks * N).
/// - head_offset: global index of this tensor's first KV head across TP (rank offset plus the
///   heads of earlier caches of the same layer module).
/// - kind, dtype: the cache spec type (e.g. ``"FullAttentionSpec"``) and data type text (e.g.
///   ``"torch.bfloat16"``) of the layer fingerprint (docs/design.md §2.3); both or the fingerprint
///   is unknown (0).
/// - replicas, replica_index: this rank's copy of KV heads that ``replicas`` TP ranks hold
///   (MLA caches, GQA with more TP ranks than KV heads); 1, 0 when not replicated.
///
/// Raises ValueError: a name without a single layer number, a layout that does not name every
/// axis once or misses B/N/D, a KV axis of size other than 2, an element size other than 1, 2,
/// 4 or 8 bytes, a cell (K and V of one head and token) that is not whole 8-byte pieces, a
/// negative or broadcast stride, a replica index not below ``replicas``. TypeError: not a
/// tensor.
#[pyclass(frozen, module = "kvferry")]
pub struct KVCacheLayer {
    pub(crate) spec: LayerSpec,
    pub(crate) addr: u64,
    pub(crate) device: Location,
    pub(crate) keep: Vec<Py<PyAny>>,
    pub(crate) tensor: Py<PyAny>,
}

#[pymethods]
impl KVCacheLayer {
    #[new]
    #[pyo3(signature = (name, kv_cache, layout, *, kernel_blocks=1, head_offset=0, kind=None, dtype=None, replicas=1, replica_index=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: String,
        kv_cache: &Bound<'_, PyAny>,
        layout: &str,
        kernel_blocks: u64,
        head_offset: u32,
        kind: Option<String>,
        dtype: Option<String>,
        replicas: u32,
        replica_index: u32,
    ) -> PyResult<KVCacheLayer> {
        let layer = parse_layer_number(&name).ok_or_else(|| {
            PyValueError::new_err(format!(
                "layer name {name:?} holds no single layer number (e.g. model.layers.12.attn)"
            ))
        })?;
        if replicas == 0 || replica_index >= replicas {
            return Err(PyValueError::new_err(format!(
                "replica_index {replica_index} must be below replicas {replicas} (>= 1)"
            )));
        }
        let view = view_of(kv_cache)?;
        let geometry = geometry_of(&view, layout, kernel_blocks)
            .map_err(|e| PyValueError::new_err(format!("layer {name:?}: {e}")))?;
        Ok(KVCacheLayer {
            spec: LayerSpec {
                name,
                layer,
                head_offset,
                geometry,
                kind,
                dtype,
                replica: ReplicaKey {
                    replicas,
                    index: replica_index,
                },
            },
            addr: view.addr,
            device: view.device,
            keep: view.keep,
            tensor: kv_cache.clone().unbind(),
        })
    }

    /// The layer's name.
    #[getter]
    fn name(&self) -> &str {
        &self.spec.name
    }

    /// The layer number parsed from the name.
    #[getter]
    fn layer(&self) -> u32 {
        self.spec.layer
    }

    /// Global index of the tensor's first KV head.
    #[getter]
    fn head_offset(&self) -> u32 {
        self.spec.head_offset
    }

    /// The layout, normalised (e.g. ``"KV B N H D"``).
    #[getter]
    fn layout(&self) -> String {
        self.spec.geometry.layout.to_string()
    }

    /// Logical blocks the tensor holds (``B // kernel_blocks``).
    #[getter]
    fn num_blocks(&self) -> u64 {
        self.spec.geometry.num_blocks()
    }

    /// Tokens per logical block (``kernel_blocks * N``).
    #[getter]
    fn block_size(&self) -> u64 {
        self.spec.geometry.block_size()
    }

    /// KV heads the tensor holds (``H``; 1 without an H axis).
    #[getter]
    fn heads(&self) -> u64 {
        self.spec.geometry.heads
    }

    /// Elements per head and part (``D``).
    #[getter]
    fn head_dim(&self) -> u64 {
        self.spec.geometry.head_dim
    }

    /// Bytes per element.
    #[getter]
    fn elem_bytes(&self) -> u64 {
        self.spec.geometry.elem.get()
    }

    /// Bytes the tensor spans from its first element (what is registered for transfers).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.spec.geometry.byte_len()
    }

    /// Address of the tensor's first element (a device pointer for CUDA memory).
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.addr
    }

    /// ``"cpu"`` or ``"cuda:N"``.
    #[getter]
    fn device(&self) -> String {
        device_name(self.device)
    }

    /// The tensor given.
    #[getter]
    fn kv_cache(&self, py: Python<'_>) -> Py<PyAny> {
        self.tensor.clone_ref(py)
    }

    /// ``(replicas, replica_index)``.
    #[getter]
    fn replica(&self) -> (u32, u32) {
        (self.spec.replica.replicas, self.spec.replica.index)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "KVCacheLayer({}, layout={}, blocks={}, block_size={}, heads={}, head_offset={}, device={})",
            str_repr(py, &self.spec.name),
            str_repr(py, &self.layout()),
            self.num_blocks(),
            self.block_size(),
            self.heads(),
            self.spec.head_offset,
            str_repr(py, &self.device())
        )
    }
}

impl KVCacheLayer {
    /// The layer as a checksum backend reads it.
    pub fn input(&self) -> LayerInput {
        LayerInput {
            spec: self.spec.clone(),
            addr: self.addr,
            len: self.spec.geometry.byte_len(),
        }
    }
}

/// Why a tensor cannot be read in the layout it was described with.
#[derive(Debug, thiserror::Error)]
enum GeometryError {
    /// The layout text, the element size or the strides are invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The layout names another number of axes than the tensor has.
    #[error("layout {layout} names {axes} axes but the tensor has {dims} (shape {shape:?})")]
    AxisCount {
        /// The parsed layout.
        layout: Layout,
        /// Axes the layout names.
        axes: usize,
        /// The tensor's dimensions.
        dims: usize,
        /// The tensor's shape.
        shape: Vec<u64>,
    },
    /// The KV axis is not of size 2.
    #[error("the KV axis has size {0}, expected 2 (K and V)")]
    KvAxis(u64),
    /// A cell (one token of one head) is not a whole number of 8-byte pieces.
    #[error(
        "a cell of {bytes} bytes (parts {parts} x D {d} x {elem} bytes) is not whole 8-byte pieces"
    )]
    NotWholePieces {
        /// Bytes per cell.
        bytes: u64,
        /// K and V (2) or one part.
        parts: u64,
        /// Elements per head and part.
        d: u64,
        /// Bytes per element.
        elem: u64,
    },
    /// The tensor holds fewer kernel blocks than one logical block needs.
    #[error("B = {kernel} kernel blocks hold no logical block of {per_block} kernel blocks")]
    NoBlock {
        /// Kernel blocks in the tensor.
        kernel: u64,
        /// Kernel blocks per logical block.
        per_block: u64,
    },
}

/// The geometry of a tensor `view` read in `layout` order with `kernel_blocks` per logical block.
fn geometry_of(
    view: &TensorView,
    layout: &str,
    kernel_blocks: u64,
) -> Result<Geometry, GeometryError> {
    let layout = Layout::parse(layout)?;
    let dims = layout.dims().to_vec();
    if dims.len() != view.shape.len() {
        return Err(GeometryError::AxisCount {
            axes: dims.len(),
            dims: view.shape.len(),
            shape: view.shape.clone(),
            layout,
        });
    }
    let size = |d: Dim| layout.position(d).map(|i| view.shape[i]).unwrap_or(1);
    if layout.has_kv() && size(Dim::Kv) != 2 {
        return Err(GeometryError::KvAxis(size(Dim::Kv)));
    }
    let elem = ElemBytes::new(view.itemsize)?;
    let g = Geometry::contiguous(
        layout.clone(),
        size(Dim::B),
        size(Dim::N),
        size(Dim::H),
        size(Dim::D),
        elem,
        kernel_blocks,
    )?
    .with_strides(view.strides.clone())?;
    if g.pieces_per_cell().is_none() {
        return Err(GeometryError::NotWholePieces {
            bytes: g.cell_bytes(),
            parts: g.parts(),
            d: g.head_dim,
            elem: g.elem.get(),
        });
    }
    if g.num_blocks() == 0 {
        return Err(GeometryError::NoBlock {
            kernel: g.num_kernel_blocks,
            per_block: kernel_blocks,
        });
    }
    Ok(g)
}

/// Parses a skip reason name (see [`KVCacheGroup`]).
fn skip_reason(name: &str) -> PyResult<SkipReason> {
    Ok(match name {
        "no_per_token_blocks" => SkipReason::NoPerTokenBlocks,
        "compressed" => SkipReason::Compressed,
        "packed_head_slots" => SkipReason::PackedHeadSlots,
        "host_resident" => SkipReason::HostResident,
        "not_whole_pieces" => SkipReason::NotWholePieces,
        "kernel_blocks_do_not_tile" => SkipReason::KernelBlocksDoNotTile,
        "duplicate_layer_number" => SkipReason::DuplicateLayerNumber,
        "no_layer_number" => SkipReason::NoLayerNumber,
        "unknown_replicas" => SkipReason::UnknownReplicas,
        other => {
            return Err(PyValueError::new_err(format!(
                "skipped {other:?}: expected one of no_per_token_blocks, compressed, \
                 packed_head_slots, host_resident, not_whole_pieces, kernel_blocks_do_not_tile, \
                 duplicate_layer_number, no_layer_number, unknown_replicas"
            )))
        }
    })
}

/// One KV cache group as one rank holds it: its layers (all of one block size).
///
/// KVCacheGroup(group_id, layers, *, sliding_window=None, skipped=None, block_size=None)
///
/// - group_id: the KV cache group id; block tables passed to ``Producer.publish`` and
///   ``Consumer.load`` are indexed by it.
/// - layers: list of KVCacheLayer, on one device, all of one block size.
/// - sliding_window: the window in tokens for sliding-window attention (only the last
///   ``ceil(window / block_size) + 1`` blocks are checksummed, docs/design.md §2.5), None for full
///   attention.
/// - skipped: a reason the rank cannot checksum the group (its blocks still transfer, the group
///   is reported skipped, docs/design.md §2.3): ``"no_per_token_blocks"``, ``"compressed"``,
///   ``"packed_head_slots"``, ``"host_resident"``, ``"not_whole_pieces"``,
///   ``"kernel_blocks_do_not_tile"``, ``"duplicate_layer_number"``, ``"no_layer_number"``,
///   ``"unknown_replicas"``.
/// - block_size: the group's block size in tokens, for a state group
///   (``skipped="no_per_token_blocks"``, Mamba-type: each layer holds one state per block, laid
///   out as a one-token block, e.g. ``"B N H D"`` with N = 1); default and for any other group:
///   the layers' block size.
///
/// Raises ValueError: no layers, layers of different block sizes or devices, an unknown skip
/// reason, a ``block_size`` other than the layers' for a group that is not a state group.
#[pyclass(frozen, module = "kvferry")]
pub struct KVCacheGroup {
    pub(crate) group_id: u32,
    pub(crate) block_size: u64,
    pub(crate) layers: Vec<Py<KVCacheLayer>>,
    pub(crate) sliding_window: Option<u64>,
    pub(crate) skipped: Option<SkipReason>,
    pub(crate) device: Location,
}

#[pymethods]
impl KVCacheGroup {
    #[new]
    #[pyo3(signature = (group_id, layers, *, sliding_window=None, skipped=None, block_size=None))]
    fn new(
        py: Python<'_>,
        group_id: u32,
        layers: Vec<Py<KVCacheLayer>>,
        sliding_window: Option<u64>,
        skipped: Option<&str>,
        block_size: Option<u64>,
    ) -> PyResult<KVCacheGroup> {
        let asked = block_size;
        let first = layers
            .first()
            .ok_or_else(|| PyValueError::new_err(format!("group {group_id}: no layers")))?
            .get();
        let (block_size, device) = (first.spec.geometry.block_size(), first.device);
        for l in &layers {
            let l = l.bind(py).get();
            if l.spec.geometry.block_size() != block_size {
                return Err(PyValueError::new_err(format!(
                    "group {group_id}: layer {:?} has block size {}, layer {:?} {block_size}",
                    l.spec.name,
                    l.spec.geometry.block_size(),
                    first.spec.name
                )));
            }
            if l.device != device {
                return Err(PyValueError::new_err(format!(
                    "group {group_id}: layer {:?} is on {}, layer {:?} on {}",
                    l.spec.name,
                    device_name(l.device),
                    first.spec.name,
                    device_name(device)
                )));
            }
        }
        let skipped = skipped.map(skip_reason).transpose()?;
        let block_size = match asked {
            None => block_size,
            Some(b) if b > 0 && skipped == Some(SkipReason::NoPerTokenBlocks) => b,
            Some(b) if b == block_size => b,
            Some(b) => {
                return Err(PyValueError::new_err(format!(
                    "group {group_id}: block_size {b} differs from its layers' {block_size}; only a state group (skipped=\"no_per_token_blocks\") has blocks of another size than its layers"
                )))
            }
        };
        Ok(KVCacheGroup {
            group_id,
            block_size,
            layers,
            sliding_window,
            skipped,
            device,
        })
    }

    /// The KV cache group id.
    #[getter]
    fn group_id(&self) -> u32 {
        self.group_id
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> u64 {
        self.block_size
    }

    /// The layers (list of KVCacheLayer).
    #[getter]
    fn layers(&self, py: Python<'_>) -> Vec<Py<KVCacheLayer>> {
        self.layers.iter().map(|l| l.clone_ref(py)).collect()
    }

    /// ``"cpu"`` or ``"cuda:N"``.
    #[getter]
    fn device(&self) -> String {
        device_name(self.device)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "KVCacheGroup({}, {} layers, block_size={}, device={})",
            self.group_id,
            self.layers.len(),
            self.block_size,
            str_repr(py, &device_name(self.device))
        )
    }
}

/// One TP/PP rank's KV caches: what a serving worker process holds.
///
/// Rank(groups, *, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
///
/// - groups: list of KVCacheGroup, distinct group ids, all on one device.
/// - tp_rank, tp_size, pp_rank, pp_size: the rank's place in its side's TP x PP grid.
///
/// A Producer or Consumer takes the ranks of a whole TP x PP grid (every rank once) and sums
/// their checksums into one value per block position (docs/design.md §2.3). A serving worker process
/// that holds only its own rank gives its Producer or Consumer one Rank with the default
/// ``tp_size=1, pp_size=1`` and its layers' global ``head_offset``: see ``Producer``.
///
/// Raises ValueError: no groups, a group id twice, groups on different devices, a rank outside
/// its sizes.
#[pyclass(frozen, module = "kvferry")]
pub struct Rank {
    pub(crate) rank: RankInfo,
    pub(crate) groups: Vec<Py<KVCacheGroup>>,
    pub(crate) device: Location,
}

#[pymethods]
impl Rank {
    #[new]
    #[pyo3(signature = (groups, *, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1))]
    fn new(
        py: Python<'_>,
        groups: Vec<Py<KVCacheGroup>>,
        tp_rank: u32,
        tp_size: u32,
        pp_rank: u32,
        pp_size: u32,
    ) -> PyResult<Rank> {
        if tp_size == 0 || pp_size == 0 || tp_rank >= tp_size || pp_rank >= pp_size {
            return Err(PyValueError::new_err(format!(
                "tp_rank {tp_rank} / tp_size {tp_size}, pp_rank {pp_rank} / pp_size {pp_size}: \
                 sizes must be at least 1 and ranks below them"
            )));
        }
        let first = groups
            .first()
            .ok_or_else(|| PyValueError::new_err("a rank needs at least one KVCacheGroup"))?
            .get();
        let device = first.device;
        let mut ids = Vec::new();
        for g in &groups {
            let g = g.bind(py).get();
            if ids.contains(&g.group_id) {
                return Err(PyValueError::new_err(format!(
                    "group id {} appears twice",
                    g.group_id
                )));
            }
            ids.push(g.group_id);
            if g.device != device {
                return Err(PyValueError::new_err(format!(
                    "group {} is on {}, group {} on {}: one rank's KV is on one device",
                    g.group_id,
                    device_name(g.device),
                    first.group_id,
                    device_name(device)
                )));
            }
        }
        Ok(Rank {
            rank: RankInfo {
                tp_rank,
                tp_size,
                pp_rank,
                pp_size,
            },
            groups,
            device,
        })
    }

    /// ``(tp_rank, tp_size, pp_rank, pp_size)``.
    #[getter]
    fn place(&self) -> (u32, u32, u32, u32) {
        let r = self.rank;
        (r.tp_rank, r.tp_size, r.pp_rank, r.pp_size)
    }

    /// ``"cpu"`` or ``"cuda:N"``.
    #[getter]
    fn device(&self) -> String {
        device_name(self.device)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let r = self.rank;
        format!(
            "Rank(tp {}/{}, pp {}/{}, {} groups, device={})",
            r.tp_rank,
            r.tp_size,
            r.pp_rank,
            r.pp_size,
            self.groups.len(),
            str_repr(py, &device_name(self.device))
        )
    }
}

/// Extracts a list of KVCacheLayer from any Python sequence of them.
pub fn layers_of(py: Python<'_>, layers: &[Py<KVCacheLayer>]) -> PyResult<Vec<LayerInput>> {
    if layers.is_empty() {
        return Err(PyValueError::new_err("no layers given"));
    }
    Ok(layers.iter().map(|l| l.bind(py).get().input()).collect())
}

/// The memory every layer of `rank` spans, as (address, length) ranges, overlapping and
/// adjacent ranges merged (one registration each).
pub fn memory_ranges(py: Python<'_>, rank: &Rank) -> Vec<(u64, u64)> {
    let mut r: Vec<(u64, u64)> = rank
        .groups
        .iter()
        .flat_map(|g| {
            g.bind(py)
                .get()
                .layers
                .iter()
                .map(|l| {
                    let l = l.bind(py).get();
                    (l.addr, l.addr.saturating_add(l.spec.geometry.byte_len()))
                })
                .collect::<Vec<_>>()
        })
        .collect();
    r.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in r {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out.into_iter().map(|(s, e)| (s, e - s)).collect()
}

/// Registers the classes of this file.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KVCacheLayer>()?;
    m.add_class::<KVCacheGroup>()?;
    m.add_class::<Rank>()?;
    Ok(())
}
