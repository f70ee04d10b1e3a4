//! Progress replies between the two machines (`proto::progress`): the producer names the
//! layers that landed on a CONTINUE, the consumer takes only spans that follow on from the
//! ones before, within the request, and reads a reply without them (an older producer's) or
//! with a form it does not know (a newer one's) as no progress.

use std::time::{Duration, Instant};

use super::consumer::{ConsumerEvent, ConsumerMachine};
use super::msg::*;
use super::producer::{Effect, ProducerMachine};
use super::progress::ProgressError;
use super::tests::{opened, request, sess, start, timeouts};

/// A request of `n` layers (slots `0..n`).
fn layers(id: &str, n: usize) -> LoadRequest {
    let mut r = request(id, 0);
    let l = r.ranks[0].groups[0].layers[0].clone();
    r.ranks[0].groups[0].layers = (0..n)
        .map(|i| WireLayer {
            name: format!("model.layers.{i}.attn"),
            ..l.clone()
        })
        .collect();
    r
}

fn progress(id: &str, load_id: u64, first: u32, end: u32) -> Vec<u8> {
    let mut r = Reply::new(Status::Continue, id, load_id);
    r.landed = Some(LayerSpan { first, end });
    encode(&r)
}

#[test]
fn a_progress_span_travels_on_continue_and_anything_else_reads_as_none() {
    let bytes = progress("a", 3, 0, 8);
    let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    assert!(v
        .as_map()
        .unwrap()
        .iter()
        .any(|(k, _)| k.as_str() == Some("landed")));
    let r = decode_reply(&bytes).unwrap();
    assert_eq!(r.landed, Some(LayerSpan { first: 0, end: 8 }));
    // Not written without progress: an older consumer reads the same map.
    let plain = encode(&Reply::new(Status::Continue, "a", 3));
    let v = rmpv::decode::read_value(&mut &plain[..]).unwrap();
    let map = v.as_map().unwrap().clone();
    assert!(!map.iter().any(|(k, _)| k.as_str() == Some("landed")));
    assert_eq!(decode_reply(&plain).unwrap().landed, None);
    // A form this side does not know: no progress, not a bad reply.
    for other in [
        rmpv::Value::from("layers 0-8"),
        rmpv::Value::Array(vec!["a".into(), "b".into()]),
        rmpv::Value::Map(vec![("first".into(), "x".into())]),
        rmpv::Value::Nil,
    ] {
        let mut m = map.clone();
        m.push(("landed".into(), other.clone()));
        let mut b = Vec::new();
        rmpv::encode::write_value(&mut b, &rmpv::Value::Map(m)).unwrap();
        assert_eq!(decode_reply(&b).unwrap().landed, None, "{other:?}");
    }
}

#[test]
fn the_producer_names_landed_layers_only_to_the_load_it_serves() {
    let t0 = Instant::now();
    let mut m: ProducerMachine<u32, &'static str> =
        ProducerMachine::new(timeouts(), Duration::from_secs(2));
    m.handle_publish(t0, "a", "blocks", None).unwrap();
    m.handle_request(t0, 1, request("a", 7), &sess());
    while m.poll_effect().is_some() {}
    let span = LayerSpan { first: 0, end: 4 };
    m.handle_progress(t0, "a", 8, span); // another load of the id
    m.handle_progress(t0, "b", 7, span); // another request
    assert_eq!(m.poll_effect(), None);
    m.handle_progress(t0, "a", 7, span);
    match m.poll_effect() {
        Some(Effect::Reply { peer: 1, reply }) => {
            assert_eq!(reply.status(), Status::Continue);
            assert_eq!((reply.load_id, reply.landed), (7, Some(span)));
        }
        other => panic!("{other:?}"),
    }
    // It counts as the heartbeat.
    assert_eq!(m.poll_timeout(), Some(t0 + timeouts().heartbeat));
    m.handle_served(t0, 1, "a", 7, Ok((1, None, None)));
    while m.poll_effect().is_some() {}
    m.handle_progress(t0, "a", 7, span);
    assert_eq!(m.poll_effect(), None, "no progress after the FINISH");
}

#[test]
fn the_consumer_takes_spans_that_follow_on_and_voids_the_load_on_bogus_ones() {
    let t0 = Instant::now();
    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(60),
        0,
    ));
    let ev = |c: &mut ConsumerMachine, at: u64, b: &[u8]| {
        c.handle_message(t0 + Duration::from_secs(at), b);
        c.poll_event().unwrap()
    };
    let span = |first, end| Some(LayerSpan { first, end });
    let (id, _) = start(&mut c, t0, layers("a", 6));
    let landed = |landed| ConsumerEvent::Progress {
        load_id: id,
        landed,
    };
    assert_eq!(ev(&mut c, 1, &progress("a", id, 0, 2)), landed(span(0, 2)));
    assert_eq!(ev(&mut c, 2, &progress("a", id, 2, 5)), landed(span(2, 5)));
    let bad = |error| ConsumerEvent::BadProgress { load_id: id, error };
    assert_eq!(
        ev(&mut c, 3, &progress("a", id, 4, 6)),
        bad(ProgressError::Twice {
            first: 4,
            end: 6,
            landed: 5
        })
    );
    // Void from here on; the deadline still moved (the producer is alive).
    assert_eq!(ev(&mut c, 4, &progress("a", id, 5, 6)), landed(None));
    assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(6)));

    for (first, end, error) in [
        (
            1,
            2,
            ProgressError::OutOfOrder {
                first: 1,
                end: 2,
                landed: 0,
            },
        ),
        (
            0,
            7,
            ProgressError::OutOfRange {
                first: 0,
                end: 7,
                slots: 6,
            },
        ),
        (0, 0, ProgressError::Empty { first: 0, end: 0 }),
    ] {
        let (id, _) = start(&mut c, t0, layers("b", 6));
        assert_eq!(
            ev(&mut c, 1, &progress("b", id, first, end)),
            ConsumerEvent::BadProgress { load_id: id, error }
        );
        c.handle_message(t0, &encode(&Reply::new(Status::Finish, "b", id)));
        while c.poll_event().is_some() {}
    }
}
