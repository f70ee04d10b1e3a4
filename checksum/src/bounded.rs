//! Sequences of peer input decoded with a cap on their element count ("bounded
//! decoding"): a declared length over the cap is refused before any element is read, and a
//! sequence without a declared length is refused at element `MAX + 1`, so that the memory a
//! decoder holds stays a small multiple of its input whatever the input claims. Used through
//! `#[serde(deserialize_with = "kvferry_checksum::bounded::vec::<_, _, MAX>")]`.

use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};

/// Elements reserved up front at most, whatever a declared length says.
const MAX_PREALLOC: usize = 4096;

/// Deserializes a sequence of at most `MAX` elements into a `Vec`. Errors (a `D::Error`):
/// more than `MAX` elements declared or present, or an element that does not decode.
pub fn vec<'de, D, T, const MAX: usize>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_seq(Bounded::<T, MAX>(PhantomData))
}

struct Bounded<T, const MAX: usize>(PhantomData<T>);

fn too_many<E: Error>(n: usize, max: usize) -> E {
    E::custom(format!("{n} elements, more than the limit of {max}"))
}

impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for Bounded<T, MAX> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a sequence of at most {MAX} elements")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let declared = seq.size_hint().unwrap_or(0);
        if declared > MAX {
            return Err(too_many(declared, MAX));
        }
        let mut out = Vec::with_capacity(declared.min(MAX_PREALLOC));
        while let Some(x) = seq.next_element()? {
            if out.len() == MAX {
                return Err(too_many(MAX + 1, MAX));
            }
            out.push(x);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Deserialize, Debug)]
    struct Three(#[serde(deserialize_with = "super::vec::<_, _, 3>")] Vec<u8>);

    #[test]
    fn a_declared_length_over_the_cap_is_refused_before_reading() {
        // msgpack: an array32 declaring 2^32-1 elements, nothing after (a newtype is its field).
        let forged = [0xdd, 0xff, 0xff, 0xff, 0xff];
        let e = rmp_serde::from_slice::<Three>(&forged).unwrap_err();
        assert!(e.to_string().contains("more than the limit of 3"), "{e}");
        let ok = rmp_serde::to_vec(&vec![1u8, 2, 3]).unwrap();
        assert_eq!(
            rmp_serde::from_slice::<Three>(&ok).unwrap().0,
            vec![1, 2, 3]
        );
        let over = rmp_serde::to_vec(&vec![1u8, 2, 3, 4]).unwrap();
        assert!(rmp_serde::from_slice::<Three>(&over).is_err());
    }

    #[test]
    fn a_sequence_without_a_length_is_refused_at_the_extra_element() {
        // JSON arrays declare no length.
        let e = serde_json::from_str::<Three>("[1,2,3,4]").unwrap_err();
        assert!(e.to_string().contains("more than the limit of 3"), "{e}");
    }
}
