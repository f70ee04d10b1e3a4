//! The checksum payload decoders (docs/design.md §2.4) on arbitrary bytes and text: never a panic;
//! whatever decodes re-encodes to bytes that decode to the same payload.
#![no_main]

use kvferry_checksum::payload::Payload;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = Payload::from_bytes(data) {
        assert_eq!(Payload::from_bytes(&p.to_bytes()).as_ref(), Ok(&p));
        assert!(p.groups.iter().all(|g| g.block_size > 0));
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(p) = Payload::from_base64(text) {
            assert_eq!(Payload::from_base64(&p.to_base64()).as_ref(), Ok(&p));
        }
    }
});
