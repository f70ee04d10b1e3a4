//! Reading a reply's optional fields from peer input without failing the reply on a form this
//! side does not know: the layer span (`msg::Reply::landed`: a map with `first` and `end`, or a
//! pair, each a `u32`) and short words (`msg::Reply::path`, `msg::Reply::reason`). Anything
//! else, of any size or shape, is skipped as it is read (never buffered: serde's untagged
//! enums buffer a whole value, 32 bytes for every byte of a msgpack list of nils) and reads as
//! absent.

use std::fmt;

use serde::de::{self, Deserializer, EnumAccess, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// Reads `[first, end)` as a pair of `u32`s from `d`, or `None` for any other value, which is
/// skipped without being held. Errors: only the deserializer's own (input that ends, nesting
/// past its depth limit), as for any other field.
pub(super) fn read_span<'de, D: Deserializer<'de>>(d: D) -> Result<Option<(u32, u32)>, D::Error> {
    d.deserialize_any(SpanVisitor)
}

/// Longest word [`read_word`] returns: longer strings are no word this side knows.
const MAX_WORD: usize = 64;

/// Reads a string of at most [`MAX_WORD`] bytes from `d`, or `None` for anything else (a longer
/// string, another type), which is skipped without being held. Errors: only the deserializer's
/// own, as for any other field.
pub(super) fn read_word<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_any(WordVisitor)
}

/// Visitor methods that read each listed kind of value as absent (`None`), skipping what it
/// holds as it is read (nothing is kept): the kinds a visitor does not take.
macro_rules! absent {
    ($de:lifetime: $($kind:ident)*) => { $(absent!(@ $de $kind);)* };
    (@ $de:lifetime bool) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@ $de:lifetime i64) => {
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@ $de:lifetime u64) => {
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@ $de:lifetime f64) => {
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@ $de:lifetime str) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@ $de:lifetime bytes) => {
        fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@ $de:lifetime unit) => {
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@ $de:lifetime none) => {
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
    (@ $de:lifetime some) => {
        fn visit_some<D: Deserializer<$de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(IgnoredAny).map(|_| None)
        }
    };
    (@ $de:lifetime newtype) => {
        fn visit_newtype_struct<D: Deserializer<$de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(IgnoredAny).map(|_| None)
        }
    };
    (@ $de:lifetime seq) => {
        fn visit_seq<A: SeqAccess<$de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            IgnoredAny.visit_seq(seq).map(|_| None)
        }
    };
    (@ $de:lifetime map) => {
        fn visit_map<A: MapAccess<$de>>(self, map: A) -> Result<Self::Value, A::Error> {
            IgnoredAny.visit_map(map).map(|_| None)
        }
    };
    (@ $de:lifetime variant) => {
        fn visit_enum<A: EnumAccess<$de>>(self, data: A) -> Result<Self::Value, A::Error> {
            IgnoredAny.visit_enum(data).map(|_| None)
        }
    };
}

/// The visitor of [`read_word`].
struct WordVisitor;

impl<'de> Visitor<'de> for WordVisitor {
    type Value = Option<String>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a word")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok((v.len() <= MAX_WORD).then(|| v.to_string()))
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
    absent!('de: bytes bool i64 u64 f64 unit none newtype seq map variant);
}

/// One value: `Some` for an integer within `u32`, `None` for anything else (skipped).
struct MaybeU32(Option<u32>);

impl<'de> de::Deserialize<'de> for MaybeU32 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Skip(|v: Option<u64>| v.and_then(|v| u32::try_from(v).ok())))
            .map(MaybeU32)
    }
}

/// A map key: whether it names `first` (0), `end` (1), or something else (skipped).
struct Key(Option<u8>);

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Option<u8>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                self.visit_bytes(v.as_bytes())
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
                Ok(match v {
                    b"first" => Some(0),
                    b"end" => Some(1),
                    _ => None,
                })
            }
            absent!('de: bool i64 u64 f64 unit none some newtype seq map variant);
        }
        d.deserialize_any(KeyVisitor).map(Key)
    }
}

/// A visitor that takes an unsigned integer through `take` and skips everything else (`None`).
struct Skip<F>(F);

impl<'de, F: FnOnce(Option<u64>) -> Option<u32>> Visitor<'de> for Skip<F> {
    type Value = Option<u32>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok((self.0)(Some(v)))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok((self.0)(u64::try_from(v).ok()))
    }
    absent!('de: bool f64 str bytes unit none some newtype seq map variant);
}

/// The span itself: a map of `first` and `end` (other keys skipped) or a pair; anything else,
/// a key twice, a value that is not a `u32`, or a pair of more or fewer than two, is `None`.
struct SpanVisitor;

impl<'de> Visitor<'de> for SpanVisitor {
    type Value = Option<(u32, u32)>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a layer span")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut first, mut end, mut bad) = (None, None, false);
        while let Some(Key(k)) = map.next_key::<Key>()? {
            match k {
                Some(i) => {
                    let MaybeU32(v) = map.next_value()?;
                    let slot = if i == 0 { &mut first } else { &mut end };
                    bad |= v.is_none() || slot.is_some();
                    *slot = v;
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(match (first, end) {
            (Some(f), Some(e)) if !bad => Some((f, e)),
            _ => None,
        })
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let first = seq.next_element::<MaybeU32>()?;
        let end = match first {
            Some(_) => seq.next_element::<MaybeU32>()?,
            None => None,
        };
        let more = match end {
            Some(_) => seq.next_element::<IgnoredAny>()?.is_some(),
            None => false,
        };
        if more {
            IgnoredAny.visit_seq(seq)?;
        }
        Ok(match (first, end) {
            (Some(MaybeU32(Some(f))), Some(MaybeU32(Some(e)))) if !more => Some((f, e)),
            _ => None,
        })
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
    absent!('de: none unit bool i64 u64 f64 str bytes newtype variant);
}
