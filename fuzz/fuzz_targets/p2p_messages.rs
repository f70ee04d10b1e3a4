//! The p2p control-message decoders (transfer request, reply) on arbitrary bytes: never a panic.
#![no_main]

use kvferry_p2p::proto::msg::{decode_reply, decode_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_request(data);
    let _ = decode_reply(data);
});
