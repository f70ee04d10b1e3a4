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
    let st = safetensors::SafeTensors::deserialize(data)
        .map_err(|e| format!("not a safetensors file: {e}"))?;
    let t = st
        .tensor(name)
        .map_err(|e| format!("tensor {name:?}: {e}"))?;
    let bits = t.dtype().bitsize() as u64;
    if bits != elem_bytes * 8 {
        return Err(format!(
            "tensor {name:?} has dtype {} ({bits} bits), but elem_bytes is {elem_bytes}",
            t.dtype()
        )
        .into());
    }
    let bytes = t.data();
    if bytes.len() as u64 != g.byte_len() {
        return Err(format!(
            "tensor {name:?} of shape {:?} holds {} bytes, but the layout needs {}",
            t.shape(),
            bytes.len(),
            g.byte_len()
        )
        .into());
    }
    let start = bytes.as_ptr() as usize - data.as_ptr() as usize;
    Ok(start..start + bytes.len())
}
