//! Per-layer fingerprints (docs/design.md §2.3): the first 8 bytes, little-endian, of the SHA-256
//! of the text Python's `repr` gives the tuple `(name, kind, block_size, dtype)`, so values agree
//! with vLLM's when its strings are passed. A group's fingerprint is the sum of its layers'
//! (mod 2^64), summed over PP stages by the coordinator.

use sha2::{Digest, Sha256};

/// Fingerprint of one layer: `u64::from_le_bytes(sha256(repr((name, kind, block_size, dtype)))[..8])`.
pub fn layer_fingerprint(name: &str, kind: &str, block_size: u64, dtype: &str) -> u64 {
    let text = format!(
        "({}, {}, {}, {})",
        py_repr(name),
        py_repr(kind),
        block_size,
        py_repr(dtype)
    );
    let digest = Sha256::digest(text.as_bytes());
    u64::from_le_bytes(digest[..8].try_into().expect("sha256 has 32 bytes"))
}

/// Python 3's `repr` of a `str`: single quotes unless the text holds `'` and no `"`; backslash,
/// the quote, `\t \n \r` escaped; other non-printable characters as `\xNN`, `\uNNNN` or
/// `\UNNNNNNNN`. Printability follows Python for ASCII and Latin-1 and for the common
/// non-printable classes elsewhere (controls, separators, format characters, surrogates,
/// private use); layer names, kinds and dtypes are ASCII in practice.
pub fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if printable(c) => out.push(c),
            c => {
                let v = c as u32;
                if v < 0x100 {
                    out.push_str(&format!("\\x{v:02x}"));
                } else if v < 0x10000 {
                    out.push_str(&format!("\\u{v:04x}"));
                } else {
                    out.push_str(&format!("\\U{v:08x}"));
                }
            }
        }
    }
    out.push(quote);
    out
}

/// Python's `str.isprintable` for one character (exact for U+0000..U+00FF).
fn printable(c: char) -> bool {
    let v = c as u32;
    match v {
        0x20..=0x7e => true,
        0..=0x1f | 0x7f..=0xa0 | 0xad => false,
        0xa1..=0xff => true,
        // Zs other than space, Zl, Zp, common Cf
        0x1680
        | 0x2000..=0x200f
        | 0x2028..=0x202f
        | 0x205f..=0x206f
        | 0x3000
        | 0xfeff
        | 0xfff9..=0xfffb => false,
        0x180e | 0x061c | 0x0600..=0x0605 | 0x06dd | 0x070f | 0x08e2 | 0x110bd | 0x110cd => false,
        0xd800..=0xdfff | 0xe000..=0xf8ff | 0xf0000..=0x10ffff => false,
        0xe0001 | 0xe0020..=0xe007f => false,
        0x1bca0..=0x1bca3 | 0x1d173..=0x1d17a => false,
        _ => true,
    }
}
