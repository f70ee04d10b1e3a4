//! What the producer sends (docs/design.md §2.4): a msgpack array
//! `[version=1, tp_size, num_tokens, [[group_id, fingerprint, block_size, start, values]...]]`,
//! `values` a msgpack bin of little-endian u64, one per block position from `start`. Text
//! channels carry it base64-encoded (standard alphabet). Decoding never panics: malformed,
//! truncated, oversized or wrong-version input is a [`PayloadError`].

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The payload format version this crate writes and reads.
pub const PAYLOAD_VERSION: u32 = 1;

/// The largest payload accepted, in bytes (raw msgpack; base64 text may be 4/3 of it).
/// 64 MiB holds 8M block values: far beyond any prompt.
pub const MAX_PAYLOAD_BYTES: usize = 64 << 20;

/// The most groups a payload may hold: one per KV cache group of the model (a handful), with a
/// wide margin. A payload declaring more is refused before its groups are decoded, so that 64 MiB
/// of tiny groups cannot turn into gigabytes of per-group allocations.
pub const MAX_PAYLOAD_GROUPS: usize = 4096;

/// The producer's checksums for one request (§2.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    /// Format version ([`PAYLOAD_VERSION`]).
    pub version: u32,
    /// The producer's TP size (informational).
    pub tp_size: u32,
    /// Tokens the producer checksummed, `[0, num_tokens)`.
    pub num_tokens: u64,
    /// One entry per checksummed group.
    pub groups: Vec<PayloadGroup>,
}

/// One group's values in a [`Payload`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadGroup {
    /// KV cache group id.
    pub group_id: u32,
    /// Sum of the group's layer fingerprints over PP stages (0 when unknown).
    pub fingerprint: u64,
    /// Tokens per block on the producer.
    pub block_size: u64,
    /// Position of `values[0]`.
    pub start: u64,
    /// One block checksum per position from `start`.
    pub values: Vec<u64>,
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PayloadError {
    /// More than [`MAX_PAYLOAD_BYTES`].
    #[error("payload of {0} bytes exceeds the limit of {MAX_PAYLOAD_BYTES}")]
    TooLarge(usize),
    /// Not standard base64: the decoder's error.
    #[error("payload is not valid base64: {0}")]
    Base64(#[source] base64::DecodeError),
    /// Not the msgpack structure of §2.4 (truncated, wrong types): the msgpack decoder's text
    /// (its error is neither `Clone` nor `Eq`, which a payload error is).
    #[error("payload is malformed: {0}")]
    Malformed(String),
    /// Bytes after the payload's msgpack value (this many).
    #[error("payload is malformed: {0} trailing bytes")]
    Trailing(usize),
    /// A version other than [`PAYLOAD_VERSION`].
    #[error("payload version {0} is not supported (expected {PAYLOAD_VERSION})")]
    Version(u64),
    /// A group's values are not a whole number of u64.
    #[error("group {group_id}: values hold {len} bytes, not a multiple of 8")]
    ValuesLength {
        /// The group's id as sent.
        group_id: u32,
        /// Length of its `values` bin, in bytes.
        len: usize,
    },
    /// A group has block size 0.
    #[error("group {group_id}: block_size is 0")]
    ZeroBlockSize {
        /// The group's id as sent.
        group_id: u32,
    },
}

#[derive(Serialize, Deserialize)]
struct WireGroup(u32, u64, u64, u64, #[serde(with = "serde_bytes")] Vec<u8>);

#[derive(Serialize)]
struct Wire(u32, u32, u64, Vec<WireGroup>);

/// The version of an array of any length (first element), so that a payload of another version
/// is reported as such whatever its other fields are.
struct WireHead(u64);

impl<'de> Deserialize<'de> for WireHead {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = WireHead;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array starting with the version")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<WireHead, A::Error> {
                let v: u64 = seq
                    .next_element()?
                    .ok_or_else(|| serde::de::Error::custom("empty array"))?;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(WireHead(v))
            }
        }
        d.deserialize_seq(V)
    }
}

#[derive(Deserialize)]
struct WireIn(
    serde::de::IgnoredAny,
    u32,
    u64,
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, MAX_PAYLOAD_GROUPS>")] Vec<WireGroup>,
);

impl Payload {
    /// Encodes as msgpack (§2.4).
    pub fn to_bytes(&self) -> Vec<u8> {
        let wire = Wire(
            self.version,
            self.tp_size,
            self.num_tokens,
            self.groups
                .iter()
                .map(|g| {
                    let mut b = Vec::with_capacity(g.values.len() * 8);
                    for v in &g.values {
                        b.extend_from_slice(&v.to_le_bytes());
                    }
                    WireGroup(g.group_id, g.fingerprint, g.block_size, g.start, b)
                })
                .collect(),
        );
        rmp_serde::to_vec(&wire).expect("msgpack encoding to a Vec cannot fail")
    }

    /// Decodes msgpack bytes (§2.4). Errors: too large, malformed (including more than
    /// [`MAX_PAYLOAD_GROUPS`] groups), trailing bytes, wrong version, values not whole u64, zero
    /// block size. Never panics; holds at most a small multiple of `bytes.len()` in memory.
    pub fn from_bytes(bytes: &[u8]) -> Result<Payload, PayloadError> {
        if bytes.len() > MAX_PAYLOAD_BYTES {
            return Err(PayloadError::TooLarge(bytes.len()));
        }
        let head: WireHead = decode_exact(bytes, false)?;
        if head.0 != PAYLOAD_VERSION as u64 {
            return Err(PayloadError::Version(head.0));
        }
        let wire: WireIn = decode_exact(bytes, true)?;
        let mut groups = Vec::with_capacity(wire.3.len());
        for WireGroup(group_id, fingerprint, block_size, start, values) in wire.3 {
            if values.len() % 8 != 0 {
                return Err(PayloadError::ValuesLength {
                    group_id,
                    len: values.len(),
                });
            }
            if block_size == 0 {
                return Err(PayloadError::ZeroBlockSize { group_id });
            }
            let values = values
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            groups.push(PayloadGroup {
                group_id,
                fingerprint,
                block_size,
                start,
                values,
            });
        }
        Ok(Payload {
            version: PAYLOAD_VERSION,
            tp_size: wire.1,
            num_tokens: wire.2,
            groups,
        })
    }

    /// Encodes as standard base64 of [`Payload::to_bytes`].
    pub fn to_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.to_bytes())
    }

    /// Decodes standard base64 text (surrounding whitespace ignored), then [`Payload::from_bytes`].
    pub fn from_base64(text: &str) -> Result<Payload, PayloadError> {
        let text = text.trim();
        if text.len() > MAX_PAYLOAD_BYTES / 3 * 4 + 4 {
            return Err(PayloadError::TooLarge(text.len() / 4 * 3));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(PayloadError::Base64)?;
        Payload::from_bytes(&bytes)
    }
}

/// Deepest nesting of lists a payload may have (it has three: the payload, its groups, a group).
const MAX_PAYLOAD_NESTING: usize = 16;

fn decode_exact<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    exact: bool,
) -> Result<T, PayloadError> {
    // A Cursor reader grows buffers only as bytes arrive, so a forged length cannot allocate.
    let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(bytes));
    // A payload nests three deep; rmp-serde's own bound (1024) takes more than a 2 MiB thread
    // stack in a debug build, so a nest of lists in a skipped field aborted the process.
    de.set_max_depth(MAX_PAYLOAD_NESTING);
    let v = T::deserialize(&mut de).map_err(|e| PayloadError::Malformed(e.to_string()))?;
    if exact {
        let used = de.position() as usize;
        if used != bytes.len() {
            return Err(PayloadError::Trailing(bytes.len() - used));
        }
    }
    Ok(v)
}
