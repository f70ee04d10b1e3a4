//! Decoding a producer's reply holds no more memory than the reply's bytes: a `landed` field in
//! a form this side does not know (a long list, a deep nest) is skipped as it is read, never
//! buffered element by element (a buffered msgpack nil takes 32 bytes for its 1 on the wire,
//! so a 64 MiB reply would have held 2 GiB). Its own test binary: it counts the process's
//! allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvferry_p2p::proto::msg::{decode_reply, encode, LayerSpan, Reply, Status};

/// The system allocator, keeping the live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are kept.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as the caller's contract for `GlobalAlloc::alloc`.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A CONTINUE whose `landed` is `value` (msgpack bytes) instead of a span.
fn continue_with_landed(value: &[u8]) -> Vec<u8> {
    let mut plain = Reply::new(Status::Continue, "r", 7);
    plain.landed = Some(LayerSpan { first: 0, end: 1 });
    let bytes = encode(&plain);
    let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let mut out = Vec::with_capacity(bytes.len() + value.len());
    let map = v.as_map().unwrap();
    // A map header of the same count, then every pair with `landed`'s value replaced.
    rmp_write_map_len(&mut out, map.len() as u32);
    for (k, val) in map {
        rmpv::encode::write_value(&mut out, k).unwrap();
        if k.as_str() == Some("landed") {
            out.extend_from_slice(value);
        } else {
            rmpv::encode::write_value(&mut out, val).unwrap();
        }
    }
    out
}

fn rmp_write_map_len(out: &mut Vec<u8>, n: u32) {
    assert!(n < 16);
    out.push(0x80 | n as u8);
}

/// Peak bytes held above what was live before while decoding `bytes`.
fn peak_while_decoding(bytes: &[u8]) -> (usize, Option<LayerSpan>) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let r = decode_reply(bytes).expect("an unknown landed form is no progress, not a bad reply");
    (PEAK.load(Ordering::Relaxed) - before, r.landed)
}

#[test]
fn an_unknown_landed_form_is_skipped_without_buffering_it() {
    // A list of 4 Mi nils: 4 MiB on the wire.
    let n: u32 = 4 << 20;
    let mut list = vec![0xdd];
    list.extend_from_slice(&n.to_be_bytes());
    list.resize(list.len() + n as usize, 0xc0);
    let bytes = continue_with_landed(&list);
    let (peak, landed) = peak_while_decoding(&bytes);
    assert_eq!(landed, None);
    assert!(
        peak < bytes.len(),
        "decoding a {}-byte reply held {peak} bytes at its peak",
        bytes.len()
    );
    // A map of 1 Mi pairs of small integers.
    let n: u32 = 1 << 20;
    let mut map = vec![0xdf];
    map.extend_from_slice(&n.to_be_bytes());
    for i in 0..n {
        map.extend_from_slice(&[0x01, (i & 0x7f) as u8]);
    }
    let bytes = continue_with_landed(&map);
    let (peak, landed) = peak_while_decoding(&bytes);
    assert_eq!(landed, None);
    assert!(peak < bytes.len(), "{peak} bytes for {}", bytes.len());
    // The span itself still reads, as a map and as a pair.
    let (_, landed) = peak_while_decoding(&continue_with_landed(&[0x92, 0x02, 0x05]));
    assert_eq!(landed, Some(LayerSpan { first: 2, end: 5 }));
}

/// A reply nested deeper than any reply (in `landed` or in a field this side does not know) is
/// a bad reply, refused at the decoders' bound, far above any message's nesting and far below
/// what a worker thread's stack holds (rmp-serde's own, 1024, overflowed a 2 MiB stack in a
/// debug build: the consumer aborted).
#[test]
fn a_deep_nest_is_a_bad_reply_not_a_stack_overflow() {
    let mut nest = vec![0x91u8; 4096];
    nest.push(0xc0);
    assert!(decode_reply(&continue_with_landed(&nest)).is_err());
    let plain = encode(&Reply::new(Status::Continue, "r", 7));
    let v = rmpv::decode::read_value(&mut &plain[..]).unwrap();
    let map = v.as_map().unwrap();
    let mut out = vec![0x80 | (map.len() as u8 + 1)];
    for (k, val) in map {
        rmpv::encode::write_value(&mut out, k).unwrap();
        rmpv::encode::write_value(&mut out, val).unwrap();
    }
    rmpv::encode::write_value(&mut out, &rmpv::Value::from("zzz")).unwrap();
    out.extend_from_slice(&nest);
    assert!(decode_reply(&out).is_err());
}

/// A FINISH (or ERROR) whose optional `path` or `reason` comes in a form this side does not
/// know (a number, a list, a map, a long string) reads as not said, as an unknown word does,
/// instead of failing the whole reply (the load then waited for its deadline).
#[test]
fn an_unknown_form_of_path_or_reason_reads_as_not_said() {
    use kvferry_p2p::proto::msg::ErrorReason;
    use kvferry_transfer::TransferPath;
    let with = |status: Status, field: &str, value: &[u8]| {
        let mut plain = Reply::new(status, "r", 7);
        plain.path = Some(TransferPath::Tcp);
        plain.reason = Some(ErrorReason::LeaseMismatch);
        let bytes = encode(&plain);
        let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let map = v.as_map().unwrap();
        let mut out = Vec::new();
        rmp_write_map_len(&mut out, map.len() as u32);
        for (k, val) in map {
            rmpv::encode::write_value(&mut out, k).unwrap();
            if k.as_str() == Some(field) {
                out.extend_from_slice(value);
            } else {
                rmpv::encode::write_value(&mut out, val).unwrap();
            }
        }
        out
    };
    let long = {
        let mut s = vec![0xd9, 200];
        s.extend(std::iter::repeat_n(b'x', 200));
        s
    };
    for value in [
        &[0x07][..],
        &[0x92, 0x01, 0x02],
        &[0x81, 0xa1, b'a', 0x01],
        &long,
    ] {
        let r = decode_reply(&with(Status::Finish, "path", value)).unwrap();
        assert_eq!(r.path, None, "{value:?}");
        let r = decode_reply(&with(Status::Error, "reason", value)).unwrap();
        assert_eq!(r.reason, None, "{value:?}");
    }
    // The words themselves still read.
    let r = decode_reply(&with(
        Status::Finish,
        "path",
        &[0xa4, b'r', b'd', b'm', b'a'],
    ))
    .unwrap();
    assert_eq!(r.path, Some(TransferPath::Rdma));
    let r = decode_reply(&with(Status::Error, "x", &[0xc0])).unwrap();
    assert_eq!(r.reason, Some(ErrorReason::LeaseMismatch));
}
