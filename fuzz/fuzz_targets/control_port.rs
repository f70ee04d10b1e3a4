//! The control port's ZMTP decoder (the patched zeromq codec, as the producer's ROUTER and the
//! consumer's DEALER run it with a max message size) on arbitrary bytes arriving in arbitrary
//! pieces: never a panic, and never more reserved than the limit allows (a frame header
//! declaring 40 GiB aborted the process). With the receive budget the producer shares between
//! its connections: never more charged than the budget, and all of it refunded when the
//! decoder is dropped.
#![no_main]

use asynchronous_codec::Decoder;
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use zeromq::__bench::{Message, ZmqCodec};
use zeromq::{ReceiveBudget, SocketOptions};

/// Small, so that the fuzzer reaches it; the check is the same at the real 64 MiB.
const LIMIT: usize = 4096;
/// Budget mode: a message limit above the budget's charged size, and a budget of two such frames.
const BUDGET_LIMIT: usize = 256 * 1024;
const BUDGET: usize = 2 * ReceiveBudget::CHARGED_FROM + 1;
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
    let piece = 1 + ((mode as usize >> 1) & 0x3f);
    let mut options = SocketOptions::default();
    let budget = ReceiveBudget::new(BUDGET);
    let limit = if mode & 0x80 != 0 {
        options.receive_budget(budget.clone());
        BUDGET_LIMIT
    } else {
        LIMIT
    };
    options.max_message_size(limit);
    let mut codec = ZmqCodec::with_options(&options);
    let mut buf = BytesMut::new();
    for chunk in input.chunks(piece) {
        buf.extend_from_slice(chunk);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(Message::Message(m))) => {
                    assert!(m.iter().map(|f| f.len()).sum::<usize>() <= limit)
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => break, // the connection is dropped
            }
            assert!(budget.used() <= BUDGET, "charged {}", budget.used());
            assert!(
                buf.capacity() <= limit + 2 * CHUNK + input.len(),
                "reserved {} bytes",
                buf.capacity()
            );
        }
        assert!(
            buf.capacity() <= limit + 2 * CHUNK + input.len(),
            "reserved {} bytes",
            buf.capacity()
        );
    }
    drop(codec);
    assert_eq!(budget.used(), 0, "a dropped decoder refunds what it held");
});
