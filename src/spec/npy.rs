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
        return Err(FormatError::NpyMagic);
    }
    let (header_len, start) = match data[6] {
        1 => (u16::from_le_bytes([data[8], data[9]]) as usize, 10usize),
        2 | 3 if data.len() >= 12 => (
            u32::from_le_bytes([data[8], data[9], data[10], data[11]]) as usize,
            12,
        ),
        v => return Err(FormatError::NpyVersion(v)),
    };
    let end = start
        .checked_add(header_len)
        .filter(|&e| e <= data.len())
        .ok_or(FormatError::NpyHeaderPastEnd)?;
    let header = std::str::from_utf8(&data[start..end]).map_err(|_| FormatError::NpyHeaderText)?;
    let descr = npy_value(header, "descr").ok_or(FormatError::NpyNoKey("descr"))?;
    let quote = descr
        .chars()
        .next()
        .filter(|c| *c == '\'' || *c == '"')
        .ok_or(FormatError::NpyDescrNotString)?;
    let descr = &descr[1..];
    let descr = &descr[..descr.find(quote).ok_or(FormatError::NpyDescrNotString)?];
    // The byte-order mark is one ASCII byte: a first character of more bytes is no dtype
    // (and no place to split the text).
    let (order, size) = descr
        .split_at_checked(descr.len().min(1))
        .ok_or_else(|| FormatError::NpyDescrType(descr.to_string()))?;
    let kind_size: String = size
        .chars()
        .skip_while(|c| c.is_ascii_alphabetic())
        .collect();
    let itemsize: u64 = kind_size
        .parse()
        .map_err(|_| FormatError::NpyDescrType(descr.to_string()))?;
    if itemsize != elem_bytes {
        return Err(FormatError::NpyElemBytes {
            descr: descr.to_string(),
            itemsize,
            elem_bytes,
        });
    }
    if order == ">" && itemsize > 1 {
        return Err(FormatError::NpyBigEndian(descr.to_string()));
    }
    if npy_value(header, "fortran_order").is_some_and(|v| v.starts_with("True")) {
        return Err(FormatError::NpyFortran);
    }
    let shape = npy_value(header, "shape").ok_or(FormatError::NpyNoKey("shape"))?;
    let shape = shape.trim_start_matches('(');
    let shape = &shape[..shape.find(')').ok_or(FormatError::NpyShapeNotTuple)?];
    let mut count: u64 = 1;
    for d in shape.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let d: u64 = d
            .parse()
            .map_err(|_| FormatError::NpyShapeNotIntegers(shape.to_string()))?;
        count = count.checked_mul(d).ok_or(FormatError::NpyShapeOverflow)?;
    }
    let want = g.byte_len();
    if count.checked_mul(itemsize) != Some(want) {
        return Err(FormatError::NpyLength {
            shape: shape.to_string(),
            count,
            itemsize,
            want,
        });
    }
    let data_end = end
        .checked_add(want as usize)
        .filter(|&e| e <= data.len())
        .ok_or(FormatError::NpyShort)?;
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
