//! The control port's ZMTP decoder (the patched zeromq codec, as the producer's ROUTER and the
//! consumer's DEALER run it with a max message size) on arbitrary bytes arriving in arbitrary
//! pieces: never a panic, and never more reserved than the limit allows (unbounded, a
//! frame header declaring 40 GiB aborted the process).
#![no_main]

use asynchronous_codec::Decoder;
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use zeromq::__bench::{Message, ZmqCodec};
use zeromq::SocketOptions;

/// Small, so that the fuzzer reaches it; the check is the same at the real 64 MiB.
const LIMIT: usize = 4096;
/// The decoder's read chunk (zeromq's default read_buffer_max_size).
const CHUNK: usize = 64 * 1024;

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut input = Vec::with_capacity(64 + rest.len());
    // Half the runs start past a valid greeting, so the frame states get most of the work.
    if mode & 1 == 0 {
        input.extend_from_slice(&greeting());
    }
    input.extend_from_slice(rest);
    let piece = 1 + (mode as usize >> 1);
    let mut options = SocketOptions::default();
    options.max_message_size(LIMIT);
    let mut codec = ZmqCodec::with_options(&options);
    let mut buf = BytesMut::new();
    for chunk in input.chunks(piece) {
        buf.extend_from_slice(chunk);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(Message::Message(m))) => {
                    assert!(m.iter().map(|f| f.len()).sum::<usize>() <= LIMIT)
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => return, // the connection is dropped
            }
            assert!(
                buf.capacity() <= LIMIT + 2 * CHUNK + input.len(),
                "reserved {} bytes",
                buf.capacity()
            );
        }
        assert!(
            buf.capacity() <= LIMIT + 2 * CHUNK + input.len(),
            "reserved {} bytes",
            buf.capacity()
        );
    }
});
