//! A named tensor in a `.safetensors` file (through the `safetensors` crate), checked against
//! a layer's geometry.

use kvferry_checksum::layout::Geometry;

use super::error::FormatError;

/// The data range of tensor `name` in a safetensors file, checked against the geometry.
/// Errors: a [`FormatError`] naming the tensor and what does not match (dtype, length).
pub(super) fn safetensors_range(
    data: &[u8],
    name: &str,
    g: &Geometry,
    elem_bytes: u64,
) -> Result<std::ops::Range<usize>, FormatError> {
    let st = safetensors::SafeTensors::deserialize(data).map_err(FormatError::Safetensors)?;
    let t = st.tensor(name).map_err(|source| FormatError::Tensor {
        name: name.to_string(),
        source,
    })?;
    let bits = t.dtype().bitsize() as u64;
    if bits != elem_bytes * 8 {
        return Err(FormatError::Dtype {
            name: name.to_string(),
            dtype: t.dtype(),
            bits,
            elem_bytes,
        });
    }
    let bytes = t.data();
    if bytes.len() as u64 != g.byte_len() {
        return Err(FormatError::TensorLength {
            name: name.to_string(),
            shape: t.shape().to_vec(),
            len: bytes.len(),
            want: g.byte_len(),
        });
    }
    let start = bytes.as_ptr() as usize - data.as_ptr() as usize;
    Ok(start..start + bytes.len())
}
