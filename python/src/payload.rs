//! `KVChecksumPayload`: what a producer sends (docs/design.md §2.4; the seed's "Wire format"), with
//! the seed's wire format: msgpack `[version=1, tp_size, num_tokens, [[group_id, fingerprint,
//! block_size, start, values]...]]`, `values` a bin of little-endian u64; base64 (standard
//! alphabet) on text channels. Byte-equal to `kvferry payload encode`: both are the checksum
//! crate's `Payload`.

use kvferry_checksum::payload::{Payload, PayloadGroup, PAYLOAD_VERSION};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// One KV cache group's checksums in a payload: one u64 per block position from ``start``.
///
/// KVChecksumGroup(group_id, values, *, block_size, start=0, fingerprint=0)
///
/// - group_id: the KV cache group id (u32).
/// - values: list of int (u64), the block checksum of positions ``start``, ``start + 1``, ...
/// - block_size: tokens per block on the side that computed them (> 0).
/// - start: block position of ``values[0]`` in the request.
/// - fingerprint: sum of the group's layer fingerprints over PP stages (0 when unknown).
///
/// Raises ValueError: block_size 0; OverflowError: a value outside u64.
#[pyclass(frozen, eq, module = "kvferry")]
#[derive(Clone, PartialEq)]
pub struct KVChecksumGroup {
    pub(crate) inner: PayloadGroup,
}

#[pymethods]
impl KVChecksumGroup {
    #[new]
    #[pyo3(signature = (group_id, values, *, block_size, start=0, fingerprint=0))]
    fn new(
        group_id: u32,
        values: Vec<u64>,
        block_size: u64,
        start: u64,
        fingerprint: u64,
    ) -> PyResult<KVChecksumGroup> {
        if block_size == 0 {
            return Err(PyValueError::new_err(format!(
                "group {group_id}: block_size must be at least 1"
            )));
        }
        Ok(KVChecksumGroup {
            inner: PayloadGroup {
                group_id,
                fingerprint,
                block_size,
                start,
                values,
            },
        })
    }

    /// The KV cache group id.
    #[getter]
    fn group_id(&self) -> u32 {
        self.inner.group_id
    }

    /// The block checksums (list of int), one per position from ``start``.
    #[getter]
    fn values(&self) -> Vec<u64> {
        self.inner.values.clone()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> u64 {
        self.inner.block_size
    }

    /// Block position of the first value.
    #[getter]
    fn start(&self) -> u64 {
        self.inner.start
    }

    /// The group fingerprint (0 when unknown).
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint
    }

    fn __repr__(&self) -> String {
        let g = &self.inner;
        format!(
            "KVChecksumGroup({}, [{}], block_size={}, start={}, fingerprint=0x{:016x})",
            g.group_id,
            g.values
                .iter()
                .map(|v| format!("0x{v:016x}"))
                .collect::<Vec<_>>()
                .join(", "),
            g.block_size,
            g.start,
            g.fingerprint
        )
    }
}

/// The KV checksums of one request, as the producer sends them (the seed's KVChecksumPayload).
///
/// KVChecksumPayload(num_tokens, groups, *, tp_size=1)
///
/// - num_tokens: tokens the values cover, ``[0, num_tokens)`` on a producer (on a consumer's
///   side of ``compare``: the tokens it holds after the load).
/// - groups: list of KVChecksumGroup.
/// - tp_size: the producer's TP size (informational).
///
/// ``to_bytes()`` / ``from_bytes(data)`` give the msgpack wire format, ``to_base64()`` /
/// ``from_base64(text)`` its base64 text, byte-equal to ``kvferry payload encode``.
#[pyclass(frozen, eq, module = "kvferry")]
#[derive(Clone, PartialEq)]
pub struct KVChecksumPayload {
    pub(crate) inner: Payload,
}

#[pymethods]
impl KVChecksumPayload {
    #[new]
    #[pyo3(signature = (num_tokens, groups, *, tp_size=1))]
    fn new(num_tokens: u64, groups: Vec<KVChecksumGroup>, tp_size: u32) -> KVChecksumPayload {
        KVChecksumPayload {
            inner: Payload {
                version: PAYLOAD_VERSION,
                tp_size,
                num_tokens,
                groups: groups.into_iter().map(|g| g.inner).collect(),
            },
        }
    }

    /// The msgpack encoding (bytes), as carried on the ZeroMQ control channel.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_bytes())
    }

    /// Decodes msgpack bytes (bytes, bytearray or memoryview). Raises ValueError: too large
    /// (over 64 MiB), malformed, trailing bytes, another version, values not whole u64, block
    /// size 0. Never reads past the input.
    #[staticmethod]
    fn from_bytes(data: &Bound<'_, PyAny>) -> PyResult<KVChecksumPayload> {
        let bytes = match data.cast::<PyBytes>() {
            Ok(b) => b.clone(),
            Err(_) => data
                .py()
                .get_type::<PyBytes>()
                .call1((data,))?
                .cast_into::<PyBytes>()?,
        };
        Payload::from_bytes(bytes.as_bytes())
            .map(|inner| KVChecksumPayload { inner })
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Standard base64 of ``to_bytes()`` (str), as carried in kv_transfer_params.
    fn to_base64(&self) -> String {
        self.inner.to_base64()
    }

    /// Decodes standard base64 text (surrounding whitespace ignored), then as ``from_bytes``.
    /// Raises ValueError: not base64, or as ``from_bytes``.
    #[staticmethod]
    fn from_base64(text: &str) -> PyResult<KVChecksumPayload> {
        Payload::from_base64(text)
            .map(|inner| KVChecksumPayload { inner })
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Format version (1).
    #[getter]
    fn version(&self) -> u32 {
        self.inner.version
    }

    /// The producer's TP size.
    #[getter]
    fn tp_size(&self) -> u32 {
        self.inner.tp_size
    }

    /// Tokens covered.
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.inner.num_tokens
    }

    /// The groups (list of KVChecksumGroup).
    #[getter]
    fn groups(&self) -> Vec<KVChecksumGroup> {
        self.inner
            .groups
            .iter()
            .map(|g| KVChecksumGroup { inner: g.clone() })
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "KVChecksumPayload(num_tokens={}, {} groups, tp_size={})",
            self.inner.num_tokens,
            self.inner.groups.len(),
            self.inner.tp_size
        )
    }
}

/// Registers the classes of this file.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KVChecksumGroup>()?;
    m.add_class::<KVChecksumPayload>()?;
    Ok(())
}
