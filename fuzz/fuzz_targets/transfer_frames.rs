//! The transfer engine's decoders of peer input (docs/design.md §3): handshake frame headers and
//! descriptor bodies, `Hello` bodies and replies, TCP data request and reply headers and scattered-WRITE piece tables, on
//! arbitrary bytes: never a panic (a malformed frame is an error value).
#![no_main]

use kvferry_transfer::fuzzing;
use kvferry_transfer::SegmentDescriptor;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 6 {
        0 => {
            if let Ok((len, _ty)) = fuzzing::handshake_frame_header(rest) {
                assert!(len <= kvferry_transfer::handshake::MAX_FRAME_BODY);
            }
        }
        1 => {
            let _ = serde_json::from_slice::<SegmentDescriptor>(rest);
        }
        2 => {
            if let Ok(pieces) = fuzzing::data_request(rest) {
                assert!(pieces.len() <= fuzzing::MAX_PIECES);
            }
        }
        3 => {
            let _ = fuzzing::data_reply(rest);
        }
        4 => {
            if let Ok(h) = kvferry_transfer::auth::Hello::decode(rest) {
                assert_eq!(kvferry_transfer::auth::Hello::decode(&h.encode()), Ok(h));
            }
        }
        _ => {
            let _ = kvferry_transfer::auth::decode_hello_reply(rest);
        }
    }
});
