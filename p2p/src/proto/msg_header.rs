//! A message's `version` and `kind` read without decoding the whole map: every message this
//! crate encodes (`msg::encode`, fields in declaration order) starts with them, and reading the
//! header with serde walks every other field too (a transfer request's block lists, a reply's
//! checksum payload), once per check. Anything else (other order, other types, a short map)
//! goes to the full decode, so the answer is always the one serde would give.

/// Deepest nesting of lists and maps a control message may have. The deepest message, a
/// transfer request, nests about ten (request, ranks, rank, groups, group, layers, layer,
/// geometry, its lists); rmp-serde's own bound (1024) takes more than a 2 MiB thread stack in
/// a debug build, so a peer's nest of lists aborted the process before the bound refused it.
pub const MAX_NESTING: usize = 32;

/// Decodes a control message (or any msgpack from a peer) from `bytes` with lists and maps
/// nested at most [`MAX_NESTING`] deep. Errors: rmp-serde's (malformed, or nested deeper).
pub(crate) fn from_msgpack<'a, T: serde::Deserialize<'a>>(
    bytes: &'a [u8],
) -> Result<T, rmp_serde::decode::Error> {
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_NESTING);
    T::deserialize(&mut de)
}

/// The two header fields (`None`: absent).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub(crate) struct Header {
    #[serde(default)]
    pub(crate) version: Option<u64>,
    #[serde(default)]
    pub(crate) kind: Option<String>,
}

/// The header when `bytes` is a msgpack map of at least two entries whose first two are
/// `version` (an unsigned integer) and `kind` (a UTF-8 string), in either order; `None`
/// otherwise (the caller decodes the whole map then). Reads only those entries, never past
/// `bytes`.
pub(crate) fn leading_header(bytes: &[u8]) -> Option<Header> {
    let mut at = 0usize;
    let entries = match *bytes.first()? {
        b @ 0x80..=0x8f => {
            at = 1;
            u64::from(b & 0x0f)
        }
        0xde => uint_be(bytes, &mut at, 1, 2)?,
        0xdf => uint_be(bytes, &mut at, 1, 4)?,
        _ => return None,
    };
    if entries < 2 {
        return None;
    }
    let (mut version, mut kind) = (None, None);
    for _ in 0..2 {
        match read_str(bytes, &mut at)? {
            b"version" if version.is_none() => version = Some(read_uint(bytes, &mut at)?),
            b"kind" if kind.is_none() => {
                let s = std::str::from_utf8(read_str(bytes, &mut at)?).ok()?;
                kind = Some(s.to_string());
            }
            _ => return None,
        }
    }
    Some(Header { version, kind })
}

/// The big-endian unsigned integer of `n` bytes at `bytes[*at + skip..]`; moves `at` past it.
fn uint_be(bytes: &[u8], at: &mut usize, skip: usize, n: usize) -> Option<u64> {
    let start = at.checked_add(skip)?;
    let end = start.checked_add(n)?;
    let v = bytes
        .get(start..end)?
        .iter()
        .fold(0u64, |a, &b| (a << 8) | u64::from(b));
    *at = end;
    Some(v)
}

/// A msgpack unsigned integer (positive fixint, uint 8/16/32/64) at `*at`.
fn read_uint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    match *bytes.get(*at)? {
        b @ 0x00..=0x7f => {
            *at += 1;
            Some(u64::from(b))
        }
        0xcc => uint_be(bytes, at, 1, 1),
        0xcd => uint_be(bytes, at, 1, 2),
        0xce => uint_be(bytes, at, 1, 4),
        0xcf => uint_be(bytes, at, 1, 8),
        _ => None,
    }
}

/// A msgpack string (fixstr, str 8/16/32) at `*at`: its bytes.
fn read_str<'a>(bytes: &'a [u8], at: &mut usize) -> Option<&'a [u8]> {
    let len = match *bytes.get(*at)? {
        b @ 0xa0..=0xbf => {
            *at += 1;
            u64::from(b & 0x1f)
        }
        0xd9 => uint_be(bytes, at, 1, 1)?,
        0xda => uint_be(bytes, at, 1, 2)?,
        0xdb => uint_be(bytes, at, 1, 4)?,
        _ => return None,
    };
    let end = at.checked_add(usize::try_from(len).ok()?)?;
    let s = bytes.get(*at..end)?;
    *at = end;
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;

    #[derive(Serialize)]
    struct Vk<'a> {
        version: u64,
        kind: &'a str,
        rest: Vec<u64>,
    }
    #[derive(Serialize)]
    struct Kv<'a> {
        kind: &'a str,
        version: u64,
    }
    #[derive(Serialize)]
    struct Other<'a> {
        id: u32,
        version: u64,
        kind: &'a str,
    }
    #[derive(Serialize)]
    struct OnlyVersion {
        version: u64,
    }

    fn full(bytes: &[u8]) -> Option<Header> {
        rmp_serde::from_slice(bytes).ok()
    }

    #[test]
    fn the_leading_header_is_what_the_full_decode_reads_or_none() {
        let long_kind = "k".repeat(300);
        let cases: Vec<Vec<u8>> = vec![
            rmp_serde::to_vec_named(&Vk {
                version: 1,
                kind: "transfer_request",
                rest: (0..5000).collect(),
            })
            .unwrap(),
            rmp_serde::to_vec_named(&Vk {
                version: u64::MAX,
                kind: &long_kind,
                rest: vec![],
            })
            .unwrap(),
            rmp_serde::to_vec_named(&Kv {
                kind: "reply",
                version: 70000,
            })
            .unwrap(),
        ];
        for b in &cases {
            let fast = leading_header(b).expect("starts with the header");
            assert_eq!(Some(fast), full(b));
        }
        // Not leading (another field first), or only one of the two: the full decode decides.
        let other = rmp_serde::to_vec_named(&Other {
            id: 3,
            version: 1,
            kind: "hello",
        })
        .unwrap();
        assert_eq!(leading_header(&other), None);
        assert_eq!(full(&other).unwrap().kind.as_deref(), Some("hello"));
        let one = rmp_serde::to_vec_named(&OnlyVersion { version: 1 }).unwrap();
        assert_eq!(leading_header(&one), None);
        // A map of one entry followed by bytes that would read as a `kind` entry: the map's
        // length is honoured, nothing past it is taken for the header.
        let mut short = one.clone();
        short.extend_from_slice(&[0xa4, b'k', b'i', b'n', b'd', 0xa1, b'x']);
        assert_eq!(leading_header(&short), None);
        // Cut anywhere inside the header: never read past the end, never a header.
        let b = &cases[0];
        for cut in 0..20 {
            assert_eq!(leading_header(&b[..cut]), None, "cut at {cut}");
        }
        // A key given twice, a kind that is not UTF-8, a version that is not an unsigned
        // integer: none.
        let twice = [
            0x82, 0xa7, b'v', b'e', b'r', b's', b'i', b'o', b'n', 1, 0xa7,
        ];
        let mut twice = twice.to_vec();
        twice.extend_from_slice(b"version");
        twice.push(2);
        assert_eq!(leading_header(&twice), None);
        let bad_utf8 = [
            0x82, 0xa7, b'v', b'e', b'r', b's', b'i', b'o', b'n', 1, 0xa4, b'k', b'i', b'n', b'd',
            0xa1, 0xff,
        ];
        assert_eq!(leading_header(&bad_utf8), None);
        let negative = [
            0x82, 0xa7, b'v', b'e', b'r', b's', b'i', b'o', b'n', 0xff, 0xa4, b'k', b'i', b'n',
            b'd', 0xa1, b'x',
        ];
        assert_eq!(leading_header(&negative), None);
        assert_eq!(leading_header(&[]), None);
        assert_eq!(leading_header(&[0xdf, 0, 0]), None);
    }
}
