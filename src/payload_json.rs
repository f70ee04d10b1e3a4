//! `kvferry payload decode|encode`: the checksum payload (docs/design.md §2.4) ⇄ JSON, for people
//! reading or hand-making what a producer sends.
//!
//! JSON form: `{"version": 1, "tp_size": 1, "num_tokens": 40, "groups": [{"group_id": 0,
//! "fingerprint": "0x…", "block_size": 16, "start": 0, "values": ["0x…", …]}]}`; u64 values and
//! fingerprints are `0x` + 16 lower-case hex digits (decimal numbers and shorter hex are accepted
//! on input).

use kvferry_checksum::payload::{Payload, PayloadError, PayloadGroup, PAYLOAD_VERSION};
use kvferry_transfer::JsonError;
use serde_json::{json, Map, Value};
use thiserror::Error;

/// Why a payload could not be turned into JSON or back.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PayloadJsonError {
    /// The base64 text or bytes are not a valid payload.
    #[error("invalid payload: {0}")]
    Payload(#[from] PayloadError),
    /// The JSON text does not parse: serde_json's error (with line and column).
    #[error("invalid JSON: {0}")]
    Json(#[source] JsonError),
    /// A field is missing or holds an unusable value.
    #[error("{field} = {value}: {why}")]
    Field {
        /// Where the field is in the JSON, e.g. `num_tokens` or `groups[0].block_size`.
        field: String,
        /// The value found, as JSON text (`missing` when absent).
        value: String,
        /// Why it is refused.
        why: FieldFault,
    },
}

/// Why a field of the payload's JSON is refused ([`PayloadJsonError::Field`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum FieldFault {
    /// The field is absent.
    #[error("required")]
    Missing,
    /// A JSON number that is negative, fractional or above `u64::MAX`.
    #[error("not an unsigned 64-bit integer")]
    NotU64,
    /// A string that is neither `0x` with 1 to 16 hex digits nor a decimal u64.
    #[error("expected 0x followed by at most 16 hex digits, or a decimal number")]
    BadNumberText,
    /// Neither a number nor a string.
    #[error("expected a number or a hex string")]
    NotNumber,
    /// A u64 above `u32::MAX` where 32 bits are the most.
    #[error("does not fit in 32 bits")]
    NotU32,
    /// A `version` other than the one payload version.
    #[error("only version 1 exists")]
    Version,
    /// A `block_size` of 0.
    #[error("must be at least 1")]
    ZeroBlockSize,
    /// Not a JSON object where one is expected.
    #[error("expected an object")]
    NotObject,
    /// Not a JSON array where one is expected.
    #[error("expected an array")]
    NotArray,
}

fn hex(v: u64) -> Value {
    json!(format!("0x{v:016x}"))
}

/// The JSON form of a payload.
pub fn payload_to_json(p: &Payload) -> Value {
    json!({
        "version": p.version,
        "tp_size": p.tp_size,
        "num_tokens": p.num_tokens,
        "groups": p.groups.iter().map(|g| json!({
            "group_id": g.group_id,
            "fingerprint": hex(g.fingerprint),
            "block_size": g.block_size,
            "start": g.start,
            "values": g.values.iter().map(|&v| hex(v)).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// The JSON form of a payload serialized straight from it, keys in the order
/// [`payload_to_json`]'s maps print them (sorted), so that writing it holds no JSON tree.
struct Streamed<'a>(&'a Payload);
struct StreamedGroup<'a>(&'a PayloadGroup);
struct Hexes<'a>(&'a [u64]);

impl serde::Serialize for Streamed<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        struct Groups<'a>(&'a [PayloadGroup]);
        impl serde::Serialize for Groups<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut seq = s.serialize_seq(Some(self.0.len()))?;
                for g in self.0 {
                    seq.serialize_element(&StreamedGroup(g))?;
                }
                seq.end()
            }
        }
        let p = self.0;
        let mut m = s.serialize_map(Some(4))?;
        m.serialize_entry("groups", &Groups(&p.groups))?;
        m.serialize_entry("num_tokens", &p.num_tokens)?;
        m.serialize_entry("tp_size", &p.tp_size)?;
        m.serialize_entry("version", &p.version)?;
        m.end()
    }
}

impl serde::Serialize for StreamedGroup<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let g = self.0;
        let mut m = s.serialize_map(Some(5))?;
        m.serialize_entry("block_size", &g.block_size)?;
        m.serialize_entry("fingerprint", &format!("0x{:016x}", g.fingerprint))?;
        m.serialize_entry("group_id", &g.group_id)?;
        m.serialize_entry("start", &g.start)?;
        m.serialize_entry("values", &Hexes(&g.values))?;
        m.end()
    }
}

impl serde::Serialize for Hexes<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for v in self.0 {
            seq.serialize_element(&format!("0x{v:016x}"))?;
        }
        seq.end()
    }
}

/// Writes the pretty-printed JSON form of `p` (the text `serde_json::to_writer_pretty` gives
/// for [`payload_to_json`]) to `out` without building it in memory: the memory used is the
/// payload's own. Errors: those of `out`.
pub fn write_json<W: std::io::Write>(p: &Payload, out: W) -> std::io::Result<()> {
    serde_json::to_writer_pretty(out, &Streamed(p)).map_err(std::io::Error::other)
}

/// Decodes base64 payload text (as carried in kv_transfer_params) into its JSON form.
pub fn decode_to_json(base64_text: &str) -> Result<Value, PayloadJsonError> {
    Ok(payload_to_json(&Payload::from_base64(base64_text)?))
}

fn bad(field: &str, value: &Value, why: FieldFault) -> PayloadJsonError {
    PayloadJsonError::Field {
        field: field.to_string(),
        value: value.to_string(),
        why,
    }
}

/// A u64 from a JSON number or a `"0x…"` / decimal string.
fn u64_of(v: &Value, field: &str) -> Result<u64, PayloadJsonError> {
    match v {
        Value::Number(n) => n.as_u64().ok_or_else(|| bad(field, v, FieldFault::NotU64)),
        Value::String(s) => {
            let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                Some(h) if !h.is_empty() && h.len() <= 16 => u64::from_str_radix(h, 16).ok(),
                Some(_) => None,
                None => s.parse::<u64>().ok(),
            };
            parsed.ok_or_else(|| bad(field, v, FieldFault::BadNumberText))
        }
        _ => Err(bad(field, v, FieldFault::NotNumber)),
    }
}

fn u32_of(v: &Value, field: &str) -> Result<u32, PayloadJsonError> {
    u32::try_from(u64_of(v, field)?).map_err(|_| bad(field, v, FieldFault::NotU32))
}

fn get<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<&'a Value, PayloadJsonError> {
    obj.get(key).ok_or_else(|| PayloadJsonError::Field {
        field: format!("{at}{key}"),
        value: "missing".into(),
        why: FieldFault::Missing,
    })
}

fn object<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>, PayloadJsonError> {
    v.as_object()
        .ok_or_else(|| bad(at, v, FieldFault::NotObject))
}

/// A payload from its JSON form. Errors name the field: missing fields, values that are not
/// u64, a version other than 1, block size 0.
pub fn payload_from_json(v: &Value) -> Result<Payload, PayloadJsonError> {
    let top = object(v, "payload")?;
    let version = u64_of(get(top, "version", "")?, "version")?;
    if version != PAYLOAD_VERSION as u64 {
        return Err(bad("version", &top["version"], FieldFault::Version));
    }
    let tp_size = u32_of(get(top, "tp_size", "")?, "tp_size")?;
    let num_tokens = u64_of(get(top, "num_tokens", "")?, "num_tokens")?;
    let groups_v = get(top, "groups", "")?;
    let groups_a = groups_v
        .as_array()
        .ok_or_else(|| bad("groups", groups_v, FieldFault::NotArray))?;
    let mut groups = Vec::with_capacity(groups_a.len());
    for (i, gv) in groups_a.iter().enumerate() {
        let at = format!("groups[{i}].");
        let g = object(gv, &format!("groups[{i}]"))?;
        let field = |k: &str| format!("{at}{k}");
        let block_size = u64_of(get(g, "block_size", &at)?, &field("block_size"))?;
        if block_size == 0 {
            return Err(bad(
                &field("block_size"),
                &g["block_size"],
                FieldFault::ZeroBlockSize,
            ));
        }
        let values_v = get(g, "values", &at)?;
        let values_a = values_v
            .as_array()
            .ok_or_else(|| bad(&field("values"), values_v, FieldFault::NotArray))?;
        let values = values_a
            .iter()
            .enumerate()
            .map(|(j, x)| u64_of(x, &format!("{at}values[{j}]")))
            .collect::<Result<Vec<_>, _>>()?;
        groups.push(PayloadGroup {
            group_id: u32_of(get(g, "group_id", &at)?, &field("group_id"))?,
            fingerprint: u64_of(get(g, "fingerprint", &at)?, &field("fingerprint"))?,
            block_size,
            start: u64_of(get(g, "start", &at)?, &field("start"))?,
            values,
        });
    }
    Ok(Payload {
        version: PAYLOAD_VERSION,
        tp_size,
        num_tokens,
        groups,
    })
}

/// Encodes JSON text of the form above as base64 payload text.
pub fn encode_from_json(json_text: &str) -> Result<String, PayloadJsonError> {
    let v: Value =
        serde_json::from_str(json_text).map_err(|e| PayloadJsonError::Json(JsonError::new(e)))?;
    Ok(payload_from_json(&v)?.to_base64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Payload {
        Payload {
            version: 1,
            tp_size: 2,
            num_tokens: 40,
            groups: vec![PayloadGroup {
                group_id: 3,
                fingerprint: 0xdead_beef,
                block_size: 16,
                start: 1,
                values: vec![0, u64::MAX, 7],
            }],
        }
    }

    #[test]
    fn round_trip_through_json_and_base64() {
        let p = sample();
        let j = decode_to_json(&p.to_base64()).unwrap();
        assert_eq!(j["groups"][0]["values"][1], json!("0xffffffffffffffff"));
        assert_eq!(j["groups"][0]["fingerprint"], json!("0x00000000deadbeef"));
        let text = encode_from_json(&j.to_string()).unwrap();
        assert_eq!(Payload::from_base64(&text).unwrap(), p);
    }

    #[test]
    fn streamed_json_is_the_tree_printed() {
        let mut p = sample();
        p.groups.push(PayloadGroup {
            group_id: 9,
            fingerprint: 1,
            block_size: 4,
            start: 0,
            values: vec![],
        });
        let mut streamed = Vec::new();
        write_json(&p, &mut streamed).unwrap();
        let tree = serde_json::to_string_pretty(&payload_to_json(&p)).unwrap();
        assert_eq!(String::from_utf8(streamed).unwrap(), tree);
    }

    #[test]
    fn accepts_numbers_and_short_hex() {
        let j = r#"{"version":1,"tp_size":1,"num_tokens":40,"groups":[{"group_id":0,"fingerprint":"0x1f","block_size":16,"start":0,"values":[5,"0xA","12"]}]}"#;
        let p = Payload::from_base64(&encode_from_json(j).unwrap()).unwrap();
        assert_eq!(
            (p.groups[0].fingerprint, p.groups[0].values.clone()),
            (31, vec![5, 10, 12])
        );
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (
                r#"{"version":2,"tp_size":1,"num_tokens":1,"groups":[]}"#,
                "version",
                FieldFault::Version,
            ),
            (
                r#"{"version":1,"num_tokens":1,"groups":[]}"#,
                "tp_size",
                FieldFault::Missing,
            ),
            (
                r#"{"version":1,"tp_size":1,"num_tokens":1,"groups":[{"group_id":0,"fingerprint":"0x1","block_size":0,"start":0,"values":[]}]}"#,
                "groups[0].block_size",
                FieldFault::ZeroBlockSize,
            ),
            (
                r#"{"version":1,"tp_size":1,"num_tokens":1,"groups":[{"group_id":0,"fingerprint":"0x1","block_size":16,"start":0,"values":["0xzz"]}]}"#,
                "groups[0].values[0]",
                FieldFault::BadNumberText,
            ),
            (
                r#"{"version":1,"tp_size":1,"num_tokens":1,"groups":[{"group_id":0,"fingerprint":"0x11112222333344445","block_size":16,"start":0,"values":[]}]}"#,
                "groups[0].fingerprint",
                FieldFault::BadNumberText,
            ),
            (
                r#"{"version":1,"tp_size":1,"num_tokens":-1,"groups":[]}"#,
                "num_tokens",
                FieldFault::NotU64,
            ),
            (
                r#"{"version":1,"tp_size":1,"num_tokens":1,"groups":[{"fingerprint":"0x1","block_size":16,"start":0,"values":[]}]}"#,
                "groups[0].group_id",
                FieldFault::Missing,
            ),
        ];
        for (text, field, fault) in cases {
            match encode_from_json(text) {
                Err(PayloadJsonError::Field { field: f, why, .. }) => {
                    assert_eq!((f.as_str(), why), (field, fault), "{text}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(matches!(
            encode_from_json("{"),
            Err(PayloadJsonError::Json(_))
        ));
        assert!(matches!(
            decode_to_json("@@"),
            Err(PayloadJsonError::Payload(PayloadError::Base64(_)))
        ));
    }
}
