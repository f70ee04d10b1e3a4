//! The p2p control-message decoders (transfer request, reply, hello, welcome) on arbitrary bytes: never a panic.
#![no_main]

use kvferry_p2p::proto::msg::{decode_consumer_message, decode_reply, decode_request, decode_welcome};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_request(data);
    let _ = decode_reply(data);
    let _ = decode_consumer_message(data);
    let _ = decode_welcome(data);
});
