//! The payload of docs/design.md §2.4: round trips, the exact msgpack bytes a Python producer
//! (`msgpack.packb`) writes, and rejection of junk without panics.

use kvferry_checksum::payload::{Payload, PayloadError, PayloadGroup, MAX_PAYLOAD_BYTES};
use proptest::prelude::*;

fn sample() -> Payload {
    Payload {
        version: 1,
        tp_size: 2,
        num_tokens: 40,
        groups: vec![
            PayloadGroup {
                group_id: 0,
                fingerprint: 0x05b2_65ca_4f48_1ca9,
                block_size: 16,
                start: 0,
                values: vec![1, u64::MAX],
            },
            PayloadGroup {
                group_id: 3,
                fingerprint: 0,
                block_size: 32,
                start: 2,
                values: vec![],
            },
        ],
    }
}

/// `msgpack.packb((1, 2, 40, [(0, 0x05b265ca4f481ca9, 16, 0, values), (3, 0, 32, 2, b"")]))`
/// written out by hand from the msgpack spec.
fn python_bytes() -> Vec<u8> {
    let mut b = vec![0x94, 0x01, 0x02, 0x28, 0x92, 0x95, 0x00, 0xcf];
    b.extend(0x05b2_65ca_4f48_1ca9u64.to_be_bytes());
    b.extend([0x10, 0x00, 0xc4, 0x10]);
    b.extend(1u64.to_le_bytes());
    b.extend(u64::MAX.to_le_bytes());
    b.extend([0x95, 0x03, 0x00, 0x20, 0x02, 0xc4, 0x00]);
    b
}

#[test]
fn encodes_as_python_msgpack_does() {
    assert_eq!(sample().to_bytes(), python_bytes());
    assert_eq!(Payload::from_bytes(&python_bytes()).unwrap(), sample());
}

#[test]
fn reads_wider_integer_encodings() {
    // A producer may write small integers in wider forms (uint16/uint32/uint64).
    let mut b = vec![
        0x94, 0xcd, 0x00, 0x01, 0xce, 0, 0, 0, 2, 0xcf, 0, 0, 0, 0, 0, 0, 0, 40, 0xdc, 0x00, 0x01,
    ];
    b.extend([0x95, 0xcc, 0x07, 0x01, 0x10, 0x00, 0xc5, 0x00, 0x08]);
    b.extend(9u64.to_le_bytes());
    let p = Payload::from_bytes(&b).unwrap();
    assert_eq!(
        (
            p.tp_size,
            p.num_tokens,
            p.groups[0].group_id,
            p.groups[0].values.clone()
        ),
        (2, 40, 7, vec![9])
    );
}

#[test]
fn base64_round_trip_and_standard_alphabet() {
    let p = sample();
    let text = p.to_base64();
    assert!(text
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "+/=".contains(c)));
    assert_eq!(Payload::from_base64(&text).unwrap(), p);
    assert_eq!(Payload::from_base64(&format!("  {text}\n")).unwrap(), p);
    assert!(matches!(
        Payload::from_base64("not base64!"),
        Err(PayloadError::Base64(_))
    ));
    assert!(matches!(
        Payload::from_base64(&text.replace('=', "")),
        Err(PayloadError::Base64(_)) | Err(PayloadError::Malformed(_))
    ));
}

#[test]
fn rejects_wrong_version_values_and_trailing_bytes() {
    let mut b = python_bytes();
    b[1] = 0x02;
    assert_eq!(Payload::from_bytes(&b), Err(PayloadError::Version(2)));
    // Version 2 with an entirely other structure is still reported as the version.
    assert_eq!(
        Payload::from_bytes(&[0x92, 0x02, 0xc0]),
        Err(PayloadError::Version(2))
    );
    let mut b = python_bytes();
    b.push(0x00);
    assert_eq!(Payload::from_bytes(&b), Err(PayloadError::Trailing(1)));
    // 7 bytes of values.
    let mut b = vec![
        0x94, 0x01, 0x01, 0x28, 0x91, 0x95, 0x00, 0x00, 0x10, 0x00, 0xc4, 0x07,
    ];
    b.extend([0u8; 7]);
    assert_eq!(
        Payload::from_bytes(&b),
        Err(PayloadError::ValuesLength {
            group_id: 0,
            len: 7
        })
    );
    // Block size 0.
    let b = vec![
        0x94, 0x01, 0x01, 0x28, 0x91, 0x95, 0x00, 0x00, 0x00, 0x00, 0xc4, 0x00,
    ];
    assert_eq!(
        Payload::from_bytes(&b),
        Err(PayloadError::ZeroBlockSize { group_id: 0 })
    );
    // A map instead of the array, a string, nothing at all, negative numbers.
    for junk in [
        &[0x80][..],
        &[0xa1, b'x'],
        &[],
        &[0x94, 0xff, 0x01, 0x28, 0x90],
        &[0x94, 0x01, 0xff, 0x28, 0x90],
    ] {
        assert!(Payload::from_bytes(junk).is_err(), "{junk:?}");
    }
}

#[test]
fn forged_lengths_do_not_allocate_or_panic() {
    // A bin32 claiming 4 GiB, an array32 claiming 4G groups.
    let b = [
        0x94, 0x01, 0x01, 0x28, 0x91, 0x95, 0x00, 0x00, 0x10, 0x00, 0xc6, 0xff, 0xff, 0xff, 0xff,
        0, 0,
    ];
    assert!(matches!(
        Payload::from_bytes(&b),
        Err(PayloadError::Malformed(_))
    ));
    let b = [0x94, 0x01, 0x01, 0x28, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x90];
    assert!(matches!(
        Payload::from_bytes(&b),
        Err(PayloadError::Malformed(_))
    ));
}

#[test]
fn oversized_input_is_refused() {
    let big = vec![0u8; MAX_PAYLOAD_BYTES + 1];
    assert_eq!(
        Payload::from_bytes(&big),
        Err(PayloadError::TooLarge(MAX_PAYLOAD_BYTES + 1))
    );
    let text = "A".repeat(MAX_PAYLOAD_BYTES / 3 * 4 + 8);
    assert!(matches!(
        Payload::from_base64(&text),
        Err(PayloadError::TooLarge(_))
    ));
}

#[test]
fn every_truncation_is_an_error() {
    let b = python_bytes();
    for n in 0..b.len() {
        assert!(Payload::from_bytes(&b[..n]).is_err(), "prefix of {n} bytes");
    }
}

fn payload_strategy() -> impl Strategy<Value = Payload> {
    let group = (
        any::<u32>(),
        any::<u64>(),
        1u64..1024,
        any::<u64>(),
        proptest::collection::vec(any::<u64>(), 0..40),
    )
        .prop_map(
            |(group_id, fingerprint, block_size, start, values)| PayloadGroup {
                group_id,
                fingerprint,
                block_size,
                start,
                values,
            },
        );
    (
        any::<u32>(),
        any::<u64>(),
        proptest::collection::vec(group, 0..5),
    )
        .prop_map(|(tp_size, num_tokens, groups)| Payload {
            version: 1,
            tp_size,
            num_tokens,
            groups,
        })
}

proptest! {
    #[test]
    fn round_trips(p in payload_strategy()) {
        prop_assert_eq!(Payload::from_bytes(&p.to_bytes()).unwrap(), p.clone());
        prop_assert_eq!(Payload::from_base64(&p.to_base64()).unwrap(), p);
    }

    #[test]
    fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = Payload::from_bytes(&b);
        let _ = Payload::from_base64(&String::from_utf8_lossy(&b));
    }

    #[test]
    fn mutated_payloads_never_panic(p in payload_strategy(), edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6), cut in any::<usize>()) {
        let mut b = p.to_bytes();
        for (at, v) in edits {
            let i = at % b.len();
            b[i] = v;
        }
        let cut = cut % (b.len() + 1);
        if let Ok(d) = Payload::from_bytes(&b[..cut]) {
            prop_assert_eq!(d.version, 1);
            for g in d.groups { prop_assert!(g.block_size > 0); }
        }
    }
}

/// A payload whose skipped fields nest lists deeper than any payload does is refused as
/// malformed, not decoded down to rmp-serde's own bound (1024 deep took more than a 2 MiB
/// thread stack in a debug build: the process aborted).
#[test]
fn a_deep_nest_is_malformed_not_a_stack_overflow() {
    // [1, [[[[...nil...]]]]]: the version, then a nest where the head skips the rest.
    let mut bytes = vec![0x92, 0x01];
    bytes.extend(std::iter::repeat_n(0x91u8, 4096));
    bytes.push(0xc0);
    let e = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || Payload::from_bytes(&bytes).map(|_| ()))
        .unwrap()
        .join()
        .unwrap()
        .unwrap_err();
    assert!(matches!(e, PayloadError::Malformed(_)), "{e:?}");
}
