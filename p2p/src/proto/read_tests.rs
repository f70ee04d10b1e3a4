//! The producer machine's loads read by the consumer (docs/design.md §4.10), on a fake clock:
//! the layout in the FINISH of a load that asks, the lease held past the FINISH until the
//! consumer's `read_done` (or the serve margin), and requests to read refused where reads
//! could not be trusted, the lease untouched.

use std::time::{Duration, Instant};

use super::msg::*;
use super::msg_read::{layout_digest, ReadDone, WireProducerGroup, WireProducerRank};
use super::producer::{Effect, ReleaseReason};
use super::tests::{replies, request, serves, sess, timeouts, Drive, Effects, Machine};

/// A one-rank producer layout (its contents only need to be stable).
fn layout() -> Vec<WireProducerRank> {
    vec![WireProducerRank {
        tp_rank: 0,
        pp_rank: 0,
        segment: "p:1".into(),
        groups: vec![WireProducerGroup {
            group_id: 0,
            block_size: 16,
            state: false,
            layers: Vec::new(),
        }],
    }]
}

const MARGIN: Duration = Duration::from_secs(2);

/// A machine serving reads, with `sess()` open for peer 1 (its hello, the producer's nonce
/// `sess()`'s).
fn machine() -> Machine {
    let mut m = Machine::new(timeouts(), MARGIN)
        .with_control(None, "tcp://p:1", "", {
            // The first session is `sess()` (producer nonce 2); later ones differ.
            let mut n = 1u8;
            Box::new(move || {
                n = n.wrapping_add(1);
                Ok([n; 32])
            })
        })
        .with_layout(layout());
    hello(&mut m, 1);
    m
}

/// `peer` says hello as `sess()`'s consumer; the welcome says the producer serves reads.
fn hello(m: &mut Machine, peer: u32) {
    let h = Hello {
        version: PROTOCOL_VERSION,
        kind: KIND_HELLO.to_string(),
        nonce: vec![1; 32],
        producer: "tcp://p:1".into(),
        consumer: "c:1".into(),
    };
    m.handle_message(Instant::now(), peer, &encode(&h));
    let welcomes: Vec<_> = m
        .drained()
        .into_iter()
        .filter_map(|e| match e {
            Effect::Welcome { welcome, .. } => Some(welcome),
            _ => None,
        })
        .collect();
    assert!(welcomes.len() == 1 && welcomes[0].reads, "{welcomes:?}");
}

/// A request to read `id` planned with `layout()`.
fn read_request(id: &str, load_id: u64) -> LoadRequest {
    let mut r = request(id, load_id);
    r.read = true;
    r.ranks = Vec::new();
    r.layout_digest = Some(layout_digest(&layout()).to_vec());
    r
}

fn released(e: &Effects) -> Vec<String> {
    e.iter()
        .filter_map(|e| match e {
            Effect::Released { request_id, reason } => {
                assert_eq!(*reason, ReleaseReason::Served);
                Some(request_id.clone())
            }
            _ => None,
        })
        .collect()
}

fn read_done(m: &mut Machine, now: Instant, peer: u32, id: &str, load_id: u64) -> Effects {
    m.handle_message(now, peer, &encode(&ReadDone::new(id, load_id)));
    m.drained()
}

fn the_reply(e: &Effects) -> Reply {
    let mut r: Vec<Reply> = e
        .iter()
        .filter_map(|e| match e {
            Effect::Reply { reply, .. } => Some(reply.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(r.len(), 1, "{e:?}");
    r.remove(0)
}

#[test]
fn the_layout_goes_only_in_the_finish_of_a_load_that_asks() {
    let t0 = Instant::now();
    for want in [false, true] {
        let mut m = machine();
        m.publish(t0, "a", "blocks").unwrap();
        let mut r = request("a", 1);
        r.want_layout = want;
        m.on_request(t0, 1, r, &sess());
        let e = m.on_served(t0, 1, "a", 1, Ok((10, Some(vec![7]), None)));
        let reply = the_reply(&e);
        assert_eq!(reply.status(), Status::Finish);
        assert_eq!(reply.layout.is_empty(), !want);
        // It travels and reads back as sent.
        let back = decode_reply(&encode(&reply)).unwrap();
        assert_eq!(back.layout, reply.layout);
    }
}

#[test]
fn a_read_loads_lease_holds_past_its_finish_until_the_consumers_read_done() {
    let t0 = Instant::now();
    let mut m = machine();
    m.publish(t0, "a", "blocks").unwrap();
    let e = m.on_request(t0, 1, read_request("a", 1), &sess());
    assert_eq!(serves(&e), vec![(1, "a".to_string(), "blocks")]);
    let e = m.on_served(t0, 1, "a", 1, Ok((0, Some(vec![7]), None)));
    assert_eq!(the_reply(&e).status(), Status::Finish);
    assert!(released(&e).is_empty(), "released at the FINISH: {e:?}");
    // Another peer's, or another load's, read_done changes nothing.
    hello(&mut m, 2);
    assert!(read_done(&mut m, t0, 2, "a", 1).is_empty());
    assert!(read_done(&mut m, t0, 1, "a", 9).is_empty());

    // No heartbeat after the FINISH, and nothing before the margin.
    assert!(m.on_tick(t0 + MARGIN / 2).is_empty());
    let e = read_done(&mut m, t0 + MARGIN / 2, 1, "a", 1);
    assert_eq!(released(&e), vec!["a".to_string()]);
    // Served once: a second request is refused, and a late read_done does nothing.
    let e = m.on_request(t0 + MARGIN, 3, read_request("a", 2), &sess());
    assert_eq!(replies(&e)[0].1, Status::Error);
    assert!(read_done(&mut m, t0 + MARGIN, 1, "a", 1).is_empty());
}

#[test]
fn a_read_loads_lease_ends_at_the_margin_without_a_read_done() {
    let t0 = Instant::now();
    let mut m = machine();
    m.publish(t0, "a", "blocks").unwrap();
    m.on_request(t0, 1, read_request("a", 1), &sess());
    let t1 = t0 + Duration::from_millis(10);
    m.on_served(t1, 1, "a", 1, Ok((0, None, None)));
    assert_eq!(m.poll_timeout(), Some(t1 + MARGIN));
    assert!(m.on_tick(t1 + MARGIN - Duration::from_millis(1)).is_empty());
    let e = m.on_tick(t1 + MARGIN);
    assert_eq!(released(&e), vec!["a".to_string()]);
}

#[test]
fn a_read_planned_with_another_layout_or_before_the_publish_is_refused_lease_untouched() {
    let t0 = Instant::now();
    let mut m = machine();
    // Before the publish: refused at once, not parked (reads then could predate the KV).
    let e = m.on_request(t0, 1, read_request("a", 1), &sess());
    let r = the_reply(&e);
    assert_eq!(r.status(), Status::Error);
    assert_eq!(r.reason, Some(ErrorReason::ReadEarly));
    m.publish(t0, "a", "blocks").unwrap();
    // Another layout's digest, or none: refused, and the lease is still held.
    for digest in [Some(vec![0u8; 32]), None] {
        let mut req = read_request("a", 2);
        req.layout_digest = digest;
        let e = m.on_request(t0, 1, req, &sess());
        assert!(serves(&e).is_empty());
        assert_eq!(the_reply(&e).reason, Some(ErrorReason::ReadRefused));
        assert_eq!(m.held(), 1);
    }
    // A producer that sends no layout serves no read.
    let mut bare = Machine::new(timeouts(), MARGIN);
    bare.publish(t0, "a", "blocks").unwrap();
    let mut req = read_request("a", 1);
    req.layout_digest = Some(layout_digest(&Vec::new()).to_vec());
    let e = bare.on_request(t0, 1, req, &sess());
    assert_eq!(the_reply(&e).reason, Some(ErrorReason::ReadRefused));
    // The request that fits is served by read.
    let e = m.on_request(t0, 1, read_request("a", 3), &sess());
    assert_eq!(serves(&e).len(), 1);
}

#[test]
fn the_finish_proof_covers_the_layout_and_is_unchanged_without_one() {
    let mut r = Reply::new(Status::Finish, "a", 1);
    r.checksums = Some(vec![1, 2]);
    let bare = finish_proof("t", &[3; 32], &r);
    r.layout = layout();
    let with = finish_proof("t", &[3; 32], &r);
    assert_ne!(bare, with);
    r.layout[0].segment = "elsewhere:1".into();
    assert_ne!(finish_proof("t", &[3; 32], &r), with);
    // A FINISH without a layout proves exactly what it proved before layouts existed.
    let old = kvferry_transfer::auth::hmac_sha256(
        b"t",
        &[
            b"kvferry/finish/v2",
            &[3; 32],
            b"a",
            &1u64.to_le_bytes(),
            &0u64.to_le_bytes(),
            &[1],
            &[1, 2],
        ],
    );
    assert_eq!(bare, old);
}

#[test]
fn a_read_done_before_the_finish_or_from_a_later_session_changes_nothing() {
    let t0 = Instant::now();
    let mut m = machine();
    m.publish(t0, "a", "blocks").unwrap();
    m.on_request(t0, 1, read_request("a", 1), &sess());
    // Before the FINISH: the lease is not the consumer's to end yet.
    assert!(read_done(&mut m, t0, 1, "a", 1).is_empty());
    m.on_served(t0, 1, "a", 1, Ok((0, None, None)));
    // The peer's connection closed and it said hello again: another session.
    m.handle_disconnected(&1);
    hello(&mut m, 1);
    assert!(read_done(&mut m, t0, 1, "a", 1).is_empty());
    // The lease still ends at the margin.
    assert_eq!(released(&m.on_tick(t0 + MARGIN)), vec!["a".to_string()]);
}

#[test]
fn a_read_loads_lease_holds_for_the_consumers_budget_within_the_lease() {
    let t0 = Instant::now();
    for (budget_ms, held) in [
        (0, MARGIN),
        (2_500, Duration::from_millis(2_500)),
        (5_000, Duration::from_secs(5)),
        (60_000, timeouts().lease),
    ] {
        let mut m = machine();
        m.publish(t0, "a", "blocks").unwrap();
        let mut r = read_request("a", 1);
        r.budget_ms = budget_ms;
        m.on_request(t0, 1, r, &sess());
        m.on_served(t0, 1, "a", 1, Ok((0, None, None)));
        assert_eq!(m.poll_timeout(), Some(t0 + held), "budget {budget_ms} ms");
    }
}

#[test]
fn a_stranger_asking_to_read_leaves_the_lease_to_its_owner() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle_publish(t0, "a", "blocks", Some("the key".into()))
        .unwrap();
    m.drained();
    let e = m.on_request(t0, 1, read_request("a", 1), &sess());
    assert!(serves(&e).is_empty());
    assert_eq!(replies(&e)[0].1, Status::Error);
    assert_eq!(m.held(), 1);
}

/// A consumer machine with a session whose welcome says `reads`.
fn consumer(reads: bool) -> super::consumer::ConsumerMachine {
    let c =
        super::consumer::ConsumerMachine::new(Duration::from_secs(10), Duration::from_secs(60), 1);
    super::tests::opened_with(c, reads)
}

#[test]
fn a_producer_that_does_not_say_it_serves_reads_is_never_asked_to() {
    use super::consumer::{ConsumerEvent, FailReason};
    let t0 = Instant::now();
    for reads in [false, true] {
        let mut c = consumer(reads);
        // The layout is asked for only of a producer that serves reads: an older one's proof
        // of the request would not cover the field.
        let mut r = request("a", 0);
        r.want_layout = true;
        c.start(t0, r, None).unwrap();
        let sent = decode_request(&c.poll_transmit().unwrap().bytes).unwrap();
        assert_eq!(sent.want_layout, reads);
        // A request to read goes only to one; to another it fails at once, nothing sent.
        let id = c.start(t0, read_request("b", 0), None).unwrap();
        if reads {
            assert!(
                decode_request(&c.poll_transmit().unwrap().bytes)
                    .unwrap()
                    .read
            );
        } else {
            assert!(c.poll_transmit().is_none());
            assert!(matches!(
                c.poll_event(),
                Some(ConsumerEvent::Failed { load_id, reason: FailReason::ReadRefused(_) }) if load_id == id
            ));
        }
    }
}
