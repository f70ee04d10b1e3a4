//! The `.npy` format, as far as `checksum --spec` needs it: the header (magic, version, the
//! `descr`, `fortran_order` and `shape` entries of its dict) checked against a layer's
//! geometry, and where the array's bytes lie.

use kvferry_checksum::layout::Geometry;

use super::error::FormatError;

/// The data range of a `.npy` file after checking its header against the geometry: C order,
/// little-endian (or byte) elements of `elem_bytes`, shape with the array's element count.
/// Errors: a [`FormatError`] naming the part of the file (magic, header, dtype, shape, length).
pub(super) fn npy_range(
    data: &[u8],
    g: &Geometry,
    elem_bytes: u64,
) -> Result<std::ops::Range<usize>, FormatError> {
    if data.len() < 10 || &data[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (bad magic)".into());
    }
    let (header_len, start) = match data[6] {
        1 => (u16::from_le_bytes([data[8], data[9]]) as usize, 10usize),
        2 | 3 if data.len() >= 12 => (
            u32::from_le_bytes([data[8], data[9], data[10], data[11]]) as usize,
            12,
        ),
        v => return Err(format!(".npy version {v} is not supported").into()),
    };
    let end = start
        .checked_add(header_len)
        .filter(|&e| e <= data.len())
        .ok_or(".npy header runs past the end of the file")?;
    let header = std::str::from_utf8(&data[start..end]).map_err(|_| ".npy header is not text")?;
    let descr = npy_value(header, "descr").ok_or(".npy header has no 'descr'")?;
    let quote = descr
        .chars()
        .next()
        .filter(|c| *c == '\'' || *c == '"')
        .ok_or(".npy descr is not a string")?;
    let descr = &descr[1..];
    let descr = &descr[..descr.find(quote).ok_or(".npy descr is not a string")?];
    let (order, size) = descr.split_at(descr.len().min(1));
    let kind_size: String = size
        .chars()
        .skip_while(|c| c.is_ascii_alphabetic())
        .collect();
    let itemsize: u64 = kind_size
        .parse()
        .map_err(|_| format!(".npy descr {descr:?} is not a simple type"))?;
    if itemsize != elem_bytes {
        return Err(format!(
            ".npy descr {descr:?} has {itemsize}-byte elements, but elem_bytes is {elem_bytes}"
        )
        .into());
    }
    if order == ">" && itemsize > 1 {
        return Err(format!(".npy descr {descr:?} is big-endian; the checksum reads the bytes as they lie in memory").into());
    }
    if npy_value(header, "fortran_order").is_some_and(|v| v.starts_with("True")) {
        return Err(".npy array is in Fortran order; save it C-contiguous".into());
    }
    let shape = npy_value(header, "shape").ok_or(".npy header has no 'shape'")?;
    let shape = shape.trim_start_matches('(');
    let shape = &shape[..shape.find(')').ok_or(".npy shape is not a tuple")?];
    let mut count: u64 = 1;
    for d in shape.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let d: u64 = d
            .parse()
            .map_err(|_| format!(".npy shape ({shape}) is not integers"))?;
        count = count.checked_mul(d).ok_or(".npy shape overflows")?;
    }
    let want = g.byte_len();
    if count.checked_mul(itemsize) != Some(want) {
        return Err(format!(".npy shape ({shape}) holds {count} elements of {itemsize} bytes, but the layout needs {want} bytes").into());
    }
    let data_end = end
        .checked_add(want as usize)
        .filter(|&e| e <= data.len())
        .ok_or("the .npy file is shorter than its header says")?;
    Ok(end..data_end)
}

/// The text after `'key':` in a .npy header dict, up to the end.
fn npy_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = &header[at + key.len() + 2..];
    Some(rest.trim_start().strip_prefix(':')?.trim_start())
}
