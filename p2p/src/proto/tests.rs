//! State-machine and message tests, driven by events and a fake clock (no network).
#![allow(clippy::single_range_in_vec_init)] // ranges lists of one range are the point here

use std::time::{Duration, Instant};

use kvferry_transfer::{PeerText, TransferPath};
use proptest::prelude::*;
use serde::Serialize;

use super::consumer::{ConnectFailure, ConsumerEvent, ConsumerMachine, FailReason, LinkError};
use super::msg::*;
use super::plan::{pair_ranges, Copy, PlanError};
use super::producer::{Effect, ProducerMachine, ProducerTimeouts, PublishError, ReleaseReason};
use super::serve_error::ServeFailure;
use super::session::Session;

/// The session the machine tests run in.
pub(crate) fn sess() -> Session {
    Session {
        consumer_nonce: [1; 32],
        producer_nonce: [2; 32],
        producer: "tcp://p:1".into(),
        consumer: "c:1".into(),
    }
}

/// `c` with `sess()` open (an open-mode producer's welcome).
pub(crate) fn opened(c: ConsumerMachine) -> ConsumerMachine {
    opened_with(c, false)
}

/// `c` with `sess()` open, its producer's welcome saying `reads` (docs/design.md §4.10).
pub(crate) fn opened_with(mut c: ConsumerMachine, reads: bool) -> ConsumerMachine {
    c.hello([1; 32], "tcp://p:1", "c:1");
    let w = Welcome {
        version: PROTOCOL_VERSION,
        kind: KIND_WELCOME.to_string(),
        nonce: vec![2; 32],
        proof: None,
        error: None,
        reads,
    };
    c.handle_welcome(&encode(&w)).unwrap();
    c
}

/// Starts a load of `r` on `c`: its id and the request it sends.
pub(crate) fn start(c: &mut ConsumerMachine, now: Instant, r: LoadRequest) -> (u64, Vec<u8>) {
    let id = c.start(now, r, None).unwrap();
    let t = c.poll_transmit().unwrap();
    assert_eq!(t.load_id, id);
    (id, t.bytes)
}

/// Every output `c` has for the shell now.
fn events(c: &mut ConsumerMachine) -> Vec<ConsumerEvent> {
    std::iter::from_fn(|| c.poll_event()).collect()
}

/// The loads `c` failed since the last poll (a [`ConsumerEvent::RebuildSocket`] left in
/// `rebuild`).
fn failed(c: &mut ConsumerMachine, rebuild: &mut bool) -> Vec<(u64, FailReason)> {
    let mut out = Vec::new();
    for e in events(c) {
        match e {
            ConsumerEvent::Failed { load_id, reason } => out.push((load_id, reason)),
            ConsumerEvent::RebuildSocket => *rebuild = true,
            other => panic!("{other:?}"),
        }
    }
    out
}

/// The one load event a message from the producer gives.
fn on_message(c: &mut ConsumerMachine, now: Instant, bytes: &[u8]) -> ConsumerEvent {
    c.handle_message(now, bytes);
    let mut e = events(c);
    e.retain(|e| *e != ConsumerEvent::RebuildSocket);
    assert_eq!(e.len(), 1, "{e:?}");
    e.remove(0)
}

pub(crate) fn request(id: &str, load_id: u64) -> LoadRequest {
    LoadRequest {
        version: PROTOCOL_VERSION,
        kind: KIND_TRANSFER_REQUEST.to_string(),
        request_id: id.to_string(),
        load_id,
        tp_size: 1,
        pp_size: 1,
        num_local_computed: 0,
        num_tokens: 40,
        budget_ms: 0,
        token: None,
        key_proof: None,
        proof: None,
        read: false,
        want_layout: false,
        layout_digest: None,
        blocks: vec![WireBlocks {
            group_id: 0,
            block_size: 16,
            remote_block_size: 0,
            positions: vec![0, 1, 2],
            remote_blocks: vec![5, 6, 7],
            remote_positions: Vec::new(),
            local_blocks: vec![1, 2, 3],
        }],
        ranks: vec![WireRank {
            tp_rank: 0,
            pp_rank: 0,
            segment: "127.0.0.1:1".into(),
            groups: vec![WireRankGroup {
                group_id: 0,
                layers: vec![WireLayer {
                    name: "model.layers.0.attn".into(),
                    addr: 4096,
                    len: 8192,
                    head_offset: 0,
                    geometry: WireGeometry {
                        layout: "KV B N H D".into(),
                        num_kernel_blocks: 8,
                        tokens_per_kernel_block: 16,
                        heads: 2,
                        head_dim: 8,
                        elem_bytes: 2,
                        kernel_blocks_per_block: 1,
                        strides: vec![4096, 512, 32, 16, 2],
                    },
                    dtype: Some("torch.bfloat16".into()),
                }],
            }],
        }],
    }
}

pub(crate) fn timeouts() -> ProducerTimeouts {
    ProducerTimeouts {
        lease: Duration::from_secs(10),
        publish_wait: Duration::from_secs(5),
        tombstone: Duration::from_secs(100),
        heartbeat: Duration::from_secs(1000),
    }
}

pub(crate) type Machine = ProducerMachine<u32, &'static str>;
pub(crate) type Effects = Vec<Effect<u32, &'static str>>;

/// Each producer input followed by the effects it gives (drained as the shell drains them).
pub(crate) trait Drive {
    fn publish(
        &mut self,
        now: Instant,
        id: &str,
        data: &'static str,
    ) -> Result<Effects, PublishError>;
    fn on_request(&mut self, now: Instant, peer: u32, r: LoadRequest, s: &Session) -> Effects;
    fn on_served(
        &mut self,
        now: Instant,
        peer: u32,
        id: &str,
        load_id: u64,
        r: Result<super::producer_effects::ServedLoad, ServeFailure>,
    ) -> Effects;
    fn on_tick(&mut self, now: Instant) -> Effects;
    fn drained(&mut self) -> Effects;
}

impl Drive for Machine {
    fn publish(
        &mut self,
        now: Instant,
        id: &str,
        data: &'static str,
    ) -> Result<Effects, PublishError> {
        self.handle_publish(now, id, data, None)?;
        Ok(self.drained())
    }
    fn on_request(&mut self, now: Instant, peer: u32, r: LoadRequest, s: &Session) -> Effects {
        self.handle_request(now, peer, r, s);
        self.drained()
    }
    fn on_served(
        &mut self,
        now: Instant,
        peer: u32,
        id: &str,
        load_id: u64,
        r: Result<super::producer_effects::ServedLoad, ServeFailure>,
    ) -> Effects {
        self.handle_served(now, peer, id, load_id, r);
        self.drained()
    }
    fn on_tick(&mut self, now: Instant) -> Effects {
        self.handle_timeout(now);
        self.drained()
    }
    fn drained(&mut self) -> Effects {
        std::iter::from_fn(|| self.poll_effect()).collect()
    }
}

pub(crate) fn replies(effects: &[Effect<u32, &'static str>]) -> Vec<(u32, Status, Option<String>)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Reply { peer, reply } => Some((*peer, reply.status(), reply.error.clone())),
            _ => None,
        })
        .collect()
}

pub(crate) fn serves(effects: &[Effect<u32, &'static str>]) -> Vec<(u32, String, &'static str)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Serve {
                peer,
                request,
                lease,
                ..
            } => Some((*peer, request.request_id.clone(), *lease)),
            _ => None,
        })
        .collect()
}

#[test]
fn request_round_trips_as_named_map() {
    let r = request("req-1", 9);
    let bytes = encode(&r);
    // A map with field names, not an array of positions.
    let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let map = v.as_map().expect("msgpack map");
    assert!(map.iter().any(|(k, _)| k.as_str() == Some("request_id")));
    assert_eq!(decode_request(&bytes).unwrap(), r);
}

#[test]
fn reply_checksums_travel_as_msgpack_bin() {
    let mut r = Reply::new(Status::Finish, "req", 3);
    r.checksums = Some(vec![1, 2, 3, 255]);
    let bytes = encode(&r);
    let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let map = v.as_map().unwrap();
    let (_, c) = map
        .iter()
        .find(|(k, _)| k.as_str() == Some("checksums"))
        .unwrap();
    assert_eq!(c.as_slice(), Some(&[1u8, 2, 3, 255][..]));
    assert_eq!(decode_reply(&bytes).unwrap(), r);
}

#[derive(Serialize)]
struct ReplyPlus {
    version: u32,
    kind: &'static str,
    status: u8,
    request_id: &'static str,
    load_id: u64,
    from_the_future: Vec<u32>,
}

#[test]
fn unknown_fields_are_ignored_and_optional_fields_default() {
    let bytes = rmp_serde::to_vec_named(&ReplyPlus {
        version: PROTOCOL_VERSION,
        kind: KIND_REPLY,
        status: 1,
        request_id: "r",
        load_id: 4,
        from_the_future: vec![1, 2],
    })
    .unwrap();
    let r = decode_reply(&bytes).unwrap();
    assert_eq!(r.status(), Status::Continue);
    assert_eq!(r.checksums, None);
    assert_eq!(r.error, None);
}

#[test]
fn wrong_version_and_kind_and_status_are_clear_errors() {
    let mut r = Reply::new(Status::Finish, "r", 1);
    r.version = 1; // the first protocol (no sessions): refused, not misread
    assert_eq!(
        decode_reply(&encode(&r)),
        Err(MsgError::WrongVersion { got: Some(1) })
    );
    let q = request("r", 1);
    assert!(matches!(
        decode_reply(&encode(&q)),
        Err(MsgError::WrongKind { .. })
    ));
    assert!(matches!(
        decode_request(&encode(&Reply::new(Status::Finish, "r", 1))),
        Err(MsgError::WrongKind { .. })
    ));
    let mut r = Reply::new(Status::Finish, "r", 1);
    r.status = 7;
    assert_eq!(decode_reply(&encode(&r)), Err(MsgError::BadStatus(7)));
    let err = decode_reply(&[0xc1]).unwrap_err();
    assert!(matches!(err, MsgError::Malformed(_)));
    assert!(matches!(
        decode_reply(&vec![0u8; MAX_MESSAGE_BYTES + 1]),
        Err(MsgError::TooLarge(_))
    ));
}

#[test]
fn a_bad_hello_or_welcome_is_refused_with_its_lengths() {
    let hello = Hello {
        version: PROTOCOL_VERSION,
        kind: KIND_HELLO.into(),
        nonce: vec![0; 31],
        producer: "tcp://p:1".into(),
        consumer: "c".repeat(MAX_NAME_BYTES + 1),
    };
    assert_eq!(
        decode_hello(&encode(&hello)),
        Err(MsgError::BadHello {
            nonce: 31,
            producer: 9,
            consumer: MAX_NAME_BYTES + 1
        })
    );
    let welcome = Welcome {
        version: PROTOCOL_VERSION,
        kind: KIND_WELCOME.into(),
        nonce: vec![0; 32],
        proof: Some(vec![0; 5]),
        error: None,
        reads: false,
    };
    let e = decode_welcome(&encode(&welcome)).unwrap_err();
    assert_eq!(
        e,
        MsgError::BadWelcome {
            nonce: 32,
            proof: Some(5)
        }
    );
    assert!(e.to_string().contains("(Some(5) bytes)"), "{e}");
    // the decoder's own error stays reachable by type
    let bad = decode_reply(&[0x81, 0xc1]).unwrap_err();
    let source = std::error::Error::source(&bad).expect("the decoder's error");
    assert!(source.downcast_ref::<DecodeError>().is_some(), "{bad}");
}

#[test]
fn a_session_refusal_is_typed_and_the_consumer_hears_its_text() {
    use super::sessions::{SessionRefusal, Sessions};
    let t0 = Instant::now();
    let hello = || Hello {
        version: PROTOCOL_VERSION,
        kind: KIND_HELLO.into(),
        nonce: vec![7; 32],
        producer: "tcp://p:1".into(),
        consumer: "c".into(),
    };
    let mut broken = Sessions::<u32>::new(
        None,
        "tcp://p:1",
        "tcp://p:1",
        Box::new(|| Err(kvferry_transfer::TransferError::Cancelled)),
    );
    let (w, _, why) = broken.hello(t0, &1, hello());
    assert!(matches!(why, Some(SessionRefusal::NoNonce(_))), "{why:?}");
    assert_eq!(w.error, why.map(|w| w.to_string()));
    let mut s = Sessions::<u32>::new(None, "tcp://p:1", "tcp://p:1", Box::new(|| Ok([1; 32])));
    let q = request("a", 5);
    assert_eq!(s.admit(&1, &q).unwrap_err(), SessionRefusal::NoSession);
    let (w, _, why) = s.hello(t0, &1, hello());
    assert!(w.error.is_none() && why.is_none());
    assert!(s.admit(&1, &q).is_ok());
    let replay = s.admit(&1, &q).unwrap_err();
    assert_eq!(replay, SessionRefusal::Replayed(q.load_id));
    assert!(replay.to_string().contains("already used in this session"));
    let (w, _, why) = s.hello(t0, &1, hello());
    assert_eq!(why, Some(SessionRefusal::AlreadyOpen));
    assert_eq!(
        w.error.as_deref(),
        Some("a session is already open on this connection")
    );
}

#[test]
fn lists_over_their_caps_are_refused_before_their_elements() {
    let refused = |q: &LoadRequest, limit: usize| match decode_request(&encode(q)) {
        Err(MsgError::Malformed(why)) => {
            assert!(
                why.to_string()
                    .contains(&format!("more than the limit of {limit}")),
                "{why}"
            )
        }
        other => panic!("expected a refusal at {limit}, got {other:?}"),
    };
    let base = request("r", 1);
    let mut q = base.clone();
    q.ranks = vec![base.ranks[0].clone(); MAX_RANKS + 1];
    refused(&q, MAX_RANKS);
    q.ranks.pop();
    assert_eq!(decode_request(&encode(&q)).unwrap().ranks.len(), MAX_RANKS);
    let mut q = base.clone();
    q.blocks = vec![base.blocks[0].clone(); MAX_GROUPS + 1];
    refused(&q, MAX_GROUPS);
    let mut q = base.clone();
    q.blocks[0].positions = vec![0; MAX_BLOCKS + 1];
    refused(&q, MAX_BLOCKS);
    let mut q = base.clone();
    q.ranks[0].groups[0].layers[0].geometry.strides = vec![1; MAX_STRIDES + 1];
    refused(&q, MAX_STRIDES);
    // A forged length: the ranks array declares 2^32 - 1 elements and holds none.
    let mut bytes = encode(&base);
    let at = bytes.windows(6).position(|w| w == b"\xa5ranks").unwrap() + 6;
    bytes.truncate(at);
    bytes.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert!(matches!(
        decode_request(&bytes),
        Err(MsgError::Malformed(_))
    ));
}

#[test]
fn a_failed_connect_refuses_loads_until_the_retry_interval_passes() {
    let t0 = Instant::now();
    let mut m = opened(ConsumerMachine::new(
        Duration::from_secs(10),
        Duration::from_secs(20),
        1,
    ))
    .with_retry_interval(Duration::from_secs(2));
    assert_eq!(m.admit(t0), Ok(()));
    let refused = |what: &str| {
        ConnectFailure::Socket(kvferry_transfer::Shared(std::sync::Arc::new(
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, what.to_string()),
        )))
    };
    m.handle_connect_failed(t0, refused("connection refused"));
    let why = m
        .admit(t0 + Duration::from_millis(1999))
        .unwrap_err()
        .to_string();
    assert!(why.starts_with("producer unreachable"), "{why}");
    assert!(why.contains("connection refused"), "{why}");
    // After the interval the next load may connect again; a success ends the down state.
    assert_eq!(m.admit(t0 + Duration::from_secs(2)), Ok(()));
    m.handle_connect_failed(t0 + Duration::from_secs(2), refused("still refused"));
    assert!(m
        .admit(t0 + Duration::from_secs(3))
        .unwrap_err()
        .why
        .to_string()
        .contains("still refused"));
    m.handle_connected();
    assert_eq!(m.admit(t0 + Duration::from_secs(3)), Ok(()));
}

proptest! {
    #[test]
    fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_reply(&bytes);
        let _ = decode_request(&bytes);
    }

    #[test]
    fn decoding_truncated_messages_never_panics(cut in 0usize..400) {
        let bytes = encode(&request("req-x", 1));
        let cut = cut.min(bytes.len());
        let _ = decode_request(&bytes[..cut]);
        let _ = decode_reply(&bytes[..cut]);
    }
}

#[test]
fn published_lease_is_served_once() {
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    assert!(m.publish(t0, "a", "blocks-a").unwrap().is_empty());
    let e = m.on_request(t0, 1, request("a", 1), &sess());
    assert_eq!(serves(&e), vec![(1, "a".to_string(), "blocks-a")]);
    // A second request while serving: ERROR, not served again.
    let e = m.on_request(t0, 2, request("a", 2), &sess());
    assert_eq!(serves(&e), vec![]);
    assert_eq!(replies(&e)[0].1, Status::Error);
    let e = m.on_served(t0, 1, "a", 1, Ok((100, Some(vec![9]), None)));
    let r = replies(&e);
    assert_eq!(r[0].1, Status::Finish);
    assert!(e.contains(&Effect::Released {
        request_id: "a".into(),
        reason: ReleaseReason::Served
    }));
    // And after it was served.
    let e = m.on_request(t0 + Duration::from_secs(1), 3, request("a", 3), &sess());
    let r = replies(&e);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].1, Status::Error);
    assert!(r[0].2.as_ref().unwrap().contains("already loaded"));
    assert_eq!(serves(&e), vec![]);
}

#[test]
fn expired_lease_is_released_and_refused() {
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    m.publish(t0, "a", "blocks-a").unwrap();
    assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(10)));
    assert!(m.on_tick(t0 + Duration::from_secs(9)).is_empty());
    let e = m.on_tick(t0 + Duration::from_secs(10));
    assert_eq!(
        e,
        vec![Effect::Released {
            request_id: "a".into(),
            reason: ReleaseReason::Expired
        }]
    );
    assert_eq!(m.held(), 0);
    let e = m.on_request(t0 + Duration::from_secs(11), 1, request("a", 1), &sess());
    assert_eq!(serves(&e), vec![]);
    let r = replies(&e);
    assert_eq!(r[0].1, Status::Error);
    assert!(r[0].2.as_ref().unwrap().contains("lease expired"));
    // Publishing the same id again is refused: its blocks were freed.
    assert_eq!(
        m.publish(t0, "a", "x"),
        Err(PublishError::Duplicate("a".into()))
    );
}

#[test]
fn request_before_publish_waits_then_is_served() {
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    let e = m.on_request(t0, 7, request("early", 1), &sess());
    assert_eq!(
        replies(&e),
        vec![(7, Status::Continue, replies(&e)[0].2.clone())]
    );
    assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(5)));
    // A duplicate while parked: ERROR.
    let e = m.on_request(t0, 8, request("early", 2), &sess());
    assert_eq!(replies(&e)[0].1, Status::Error);
    let e = m
        .publish(t0 + Duration::from_secs(2), "early", "blocks")
        .unwrap();
    assert_eq!(serves(&e), vec![(7, "early".to_string(), "blocks")]);
    // Serving leases do not expire.
    assert!(m.on_tick(t0 + Duration::from_secs(60)).is_empty());
}

#[test]
fn request_never_published_gets_error_at_deadline() {
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    m.on_request(t0, 7, request("never", 1), &sess());
    assert!(replies(&m.on_tick(t0 + Duration::from_millis(4999))).is_empty());
    let e = m.on_tick(t0 + Duration::from_secs(5));
    let r = replies(&e);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].1, Status::Error);
    assert!(r[0].2.as_ref().unwrap().contains("not published"));
    // Published later: held normally, nobody is served by the stale wait.
    assert!(serves(
        &m.publish(t0 + Duration::from_secs(6), "never", "b")
            .unwrap()
    )
    .is_empty());
}

#[test]
fn failed_serve_is_final() {
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    m.publish(t0, "a", "b").unwrap();
    m.on_request(t0, 1, request("a", 1), &sess());
    let gone = ServeFailure::Token(kvferry_transfer::TransferError::Cancelled);
    let e = m.on_served(t0, 1, "a", 1, Err(gone));
    assert_eq!(replies(&e)[0].1, Status::Error);
    assert!(e.contains(&Effect::Released {
        request_id: "a".into(),
        reason: ReleaseReason::Failed(kvferry_transfer::Shared::new(ServeFailure::Token(
            kvferry_transfer::TransferError::Cancelled
        )))
    }));
    let e = m.on_request(t0, 1, request("a", 2), &sess());
    assert_eq!(serves(&e), vec![]);
    assert_eq!(replies(&e)[0].1, Status::Error);
}

/// A request the serve refuses before writing (here: one naming a group the lease lacks, as
/// from a consumer running another model) does not end the lease: a request that fits is
/// served after it, and nothing is released until then.
#[test]
fn a_refused_request_leaves_the_lease_for_one_that_fits() {
    use super::serve_error::ServeError;
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    m.publish(t0, "a", "b").unwrap();
    assert_eq!(
        serves(&m.on_request(t0, 1, request("a", 1), &sess())).len(),
        1
    );
    m.handle_refused(
        t0,
        1,
        "a",
        1,
        ServeFailure::Plan(ServeError::NotPublished(1)),
        "b",
    );
    let e = m.drained();
    let r = replies(&e);
    assert_eq!((r.len(), r[0].1), (1, Status::Error), "{e:?}");
    assert!(r[0]
        .2
        .as_ref()
        .unwrap()
        .contains("group 1 was not published"));
    assert!(
        !e.iter().any(|e| matches!(e, Effect::Released { .. })),
        "{e:?}"
    );
    assert_eq!(m.held(), 1);
    // Another consumer, whose request fits, gets the same blocks.
    let e = m.on_request(t0 + Duration::from_secs(1), 2, request("a", 2), &sess());
    assert_eq!(serves(&e), vec![(2, "a".to_string(), "b")]);
    let e = m.on_served(t0 + Duration::from_secs(1), 2, "a", 2, Ok((1, None, None)));
    assert!(e.contains(&Effect::Released {
        request_id: "a".into(),
        reason: ReleaseReason::Served
    }));
}

/// Refusals do not hold a lease past its first deadline: given back, it expires when it
/// would have unasked (or at once, when the refusal comes after it).
#[test]
fn a_refused_request_does_not_extend_the_lease() {
    let t0 = Instant::now();
    let bad = || ServeFailure::Token(kvferry_transfer::TransferError::Cancelled);
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    m.publish(t0, "a", "b").unwrap();
    m.on_request(t0 + Duration::from_secs(9), 1, request("a", 1), &sess());
    m.handle_refused(t0 + Duration::from_secs(9), 1, "a", 1, bad(), "b");
    m.drained();
    assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(10)));
    let e = m.on_tick(t0 + Duration::from_secs(10));
    assert!(e.contains(&Effect::Released {
        request_id: "a".into(),
        reason: ReleaseReason::Expired
    }));
    // Refused only after the deadline passed while it was planned: released as expired now.
    m.publish(t0, "c", "d").unwrap();
    m.on_request(t0 + Duration::from_secs(9), 1, request("c", 2), &sess());
    m.handle_refused(t0 + Duration::from_secs(11), 1, "c", 2, bad(), "d");
    let e = m.drained();
    assert!(e.contains(&Effect::Released {
        request_id: "c".into(),
        reason: ReleaseReason::Expired
    }));
    assert_eq!(m.held(), 0);
}

#[test]
fn tombstones_are_forgotten() {
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    m.publish(t0, "a", "b").unwrap();
    m.on_tick(t0 + Duration::from_secs(10));
    m.on_tick(t0 + Duration::from_secs(200));
    assert_eq!(m.poll_timeout(), None);
}

proptest! {
    /// Whatever the order of events, each publish is served at most once and
    /// never after its lease expired.
    #[test]
    fn never_served_twice_nor_after_expiry(events in proptest::collection::vec((0u8..4, 0u64..30), 1..60)) {
        let t0 = Instant::now();
        let mut m = Machine::new(timeouts(), Duration::from_secs(2));
        let mut now = t0;
        let mut served = 0;
        let mut published = false;
        let mut expired = false;
        let mut load = 0;
        for (kind, dt) in events {
            now += Duration::from_secs(dt);
            let effects = match kind {
                0 => { let r = m.publish(now, "a", "b"); if r.is_ok() { published = true; expired = false; served = 0; } r.unwrap_or_default() }
                1 | 2 => { load += 1; m.on_request(now, 1, request("a", load), &sess()) }
                _ => m.on_tick(now),
            };
            for e in &effects {
                match e {
                    Effect::Serve { .. } => { served += 1; prop_assert!(!expired); prop_assert!(published); }
                    Effect::Released { reason: ReleaseReason::Expired, .. } => expired = true,
                    _ => {}
                }
            }
        }
        prop_assert!(served <= 1);
    }
}

#[test]
fn a_producers_error_text_is_bounded_and_kept_on_one_line() {
    let t0 = Instant::now();
    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(10),
        100,
    ));
    let (id, _) = start(&mut c, t0, request("a", 0));
    let flood = format!("lease expired\n\u{1b}[2J{}", "x".repeat(100_000));
    match on_message(&mut c, t0, &encode(&Reply::error("a", id, &flood))) {
        ConsumerEvent::Failed {
            reason: reason @ FailReason::Producer(_),
            ..
        } => {
            let text = reason.to_string();
            assert!(
                text.starts_with("producer error: lease expired\\n\\u{1b}[2J"),
                "{}",
                &text[..80]
            );
            assert!(!text.contains('\n') && !text.contains('\u{1b}'));
            assert!(
                text.len() < PeerText::MAX_CHARS + 64,
                "{} bytes",
                text.len()
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn consumer_finish_and_error_and_stale() {
    let t0 = Instant::now();
    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(10),
        100,
    ));
    let (id, bytes) = start(&mut c, t0, request("a", 0));
    assert_eq!(id, 100);
    assert_eq!(decode_request(&bytes).unwrap().load_id, 100);
    let mut fin = Reply::new(Status::Finish, "a", id);
    fin.checksums = Some(vec![1]);
    match on_message(&mut c, t0, &encode(&fin)) {
        ConsumerEvent::Finished { load_id, reply } => {
            assert_eq!(load_id, 100);
            assert_eq!(reply.checksums, Some(vec![1]));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.pending(), 0);
    // The same reply again is stale.
    assert_eq!(
        on_message(&mut c, t0, &encode(&fin)),
        ConsumerEvent::Stale { load_id: 100 }
    );
    let (id2, _) = start(&mut c, t0, request("b", 0));
    let ev = on_message(&mut c, t0, &encode(&Reply::error("b", id2, "nope")));
    assert_eq!(
        ev,
        ConsumerEvent::Failed {
            load_id: id2,
            reason: FailReason::Producer(PeerText::from_bytes(b"nope"))
        }
    );
    // A reply naming another request for a pending load is not accepted.
    let (id3, _) = start(&mut c, t0, request("c", 0));
    assert!(matches!(
        on_message(&mut c, t0, &encode(&Reply::new(Status::Finish, "zzz", id3))),
        ConsumerEvent::Invalid(_)
    ));
    assert_eq!(c.pending(), 1);
    assert!(matches!(
        on_message(&mut c, t0, b"garbage"),
        ConsumerEvent::Invalid(_)
    ));
    // An ERROR spoils no socket.
    assert!(events(&mut c).is_empty());
}

#[test]
fn consumer_lost_reply_times_out_and_rebuilds() {
    let t0 = Instant::now();
    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(10),
        0,
    ));
    let (id, _) = start(&mut c, t0, request("a", 0));
    assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(2)));
    let mut rebuild = false;
    c.handle_timeout(t0 + Duration::from_millis(1999));
    assert!(failed(&mut c, &mut rebuild).is_empty());
    assert!(!rebuild);
    c.handle_timeout(t0 + Duration::from_secs(2));
    assert_eq!(
        failed(&mut c, &mut rebuild),
        vec![(id, FailReason::NoReply(Duration::from_secs(2)))]
    );
    assert!(rebuild, "the socket is rebuilt once the load failed");
    assert!(c.session().is_none(), "its session ended with it");
    assert!(c.start(t0, request("b", 0), None).is_none());
    // A reply arriving after the timeout is stale, never a late success.
    assert_eq!(
        on_message(&mut c, t0, &encode(&Reply::new(Status::Finish, "a", id))),
        ConsumerEvent::Stale { load_id: id }
    );
}

#[test]
fn consumer_continue_extends_but_not_past_overall_deadline() {
    let t0 = Instant::now();
    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(5),
        0,
    ));
    let (id, _) = start(&mut c, t0, request("a", 0));
    let cont = encode(&Reply::new(Status::Continue, "a", id));
    assert_eq!(
        on_message(&mut c, t0 + Duration::from_millis(1500), &cont),
        ConsumerEvent::Progress {
            load_id: id,
            landed: None
        }
    );
    let mut rebuild = false;
    c.handle_timeout(t0 + Duration::from_millis(3000));
    assert!(failed(&mut c, &mut rebuild).is_empty());
    on_message(&mut c, t0 + Duration::from_millis(3400), &cont);
    on_message(&mut c, t0 + Duration::from_millis(4500), &cont);
    assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(5)));
    c.handle_timeout(t0 + Duration::from_secs(5));
    assert_eq!(
        failed(&mut c, &mut rebuild),
        vec![(id, FailReason::Overall(Duration::from_secs(5)))]
    );
}

#[test]
fn consumer_rebuild_waits_for_other_loads() {
    let t0 = Instant::now();
    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(10),
        0,
    ));
    let (a, _) = start(&mut c, t0, request("a", 0));
    let (b, _) = start(&mut c, t0 + Duration::from_secs(1), request("b", 0));
    let mut rebuild = false;
    c.handle_timeout(t0 + Duration::from_secs(2));
    assert_eq!(
        failed(&mut c, &mut rebuild),
        vec![(a, FailReason::NoReply(Duration::from_secs(2)))]
    );
    assert!(!rebuild, "load b still waits on this socket");
    c.handle_message(t0, &encode(&Reply::new(Status::Finish, "b", b)));
    assert!(matches!(
        &events(&mut c)[..],
        [ConsumerEvent::Finished { .. }, ConsumerEvent::RebuildSocket]
    ));
}

#[test]
fn consumer_connection_lost_fails_all() {
    let t0 = Instant::now();
    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(10),
        0,
    ));
    let (a, _) = start(&mut c, t0, request("a", 0));
    let (b, _) = start(&mut c, t0, request("b", 0));
    c.handle_connection_lost(LinkError::Disconnected);
    let mut rebuild = false;
    let failed = failed(&mut c, &mut rebuild);
    assert_eq!(failed.iter().map(|f| f.0).collect::<Vec<_>>(), vec![a, b]);
    assert!(rebuild);
}

#[test]
fn a_failed_send_fails_its_load_and_rebuilds() {
    let t0 = Instant::now();
    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(10),
        0,
    ));
    let (a, _) = start(&mut c, t0, request("a", 0));
    let pipe = || {
        LinkError::Socket(kvferry_transfer::Shared(std::sync::Arc::new(
            std::io::Error::from(std::io::ErrorKind::BrokenPipe),
        )))
    };
    c.handle_send_failed(a, pipe());
    c.handle_send_failed(a, LinkError::NoSocket);
    let mut rebuild = false;
    assert!(matches!(
        &failed(&mut c, &mut rebuild)[..],
        [(id, FailReason::ConnectionLost(LinkError::NotSent(why)))] if *id == a && **why == pipe()
    ));
    assert!(rebuild);
}

#[test]
fn pair_ranges_cuts_at_both_sides_boundaries() {
    let mut out = Vec::new();
    let n = pair_ranges(1000, &[0..10, 20..30], 5000, &[0..5, 100..115], &mut out).unwrap();
    assert_eq!(n, 20);
    assert_eq!(
        out,
        vec![
            Copy {
                src: 1000,
                dst: 5000,
                len: 5
            },
            Copy {
                src: 1005,
                dst: 5100,
                len: 5
            },
            Copy {
                src: 1020,
                dst: 5105,
                len: 10
            },
        ]
    );
    // Contiguous on both sides merges into one copy.
    let mut out = Vec::new();
    pair_ranges(0, &[0..4, 4..8], 100, &[0..8], &mut out).unwrap();
    assert_eq!(
        out,
        vec![Copy {
            src: 0,
            dst: 100,
            len: 8
        }]
    );
    assert_eq!(
        pair_ranges(0, &[0..4], 0, &[0..5], &mut Vec::new()),
        Err(PlanError::LengthDiffers { src: 4, dst: 5 })
    );
}

proptest! {
    #[test]
    fn pair_ranges_maps_byte_k_to_byte_k(cuts_a in proptest::collection::vec(1u64..20, 1..8), cuts_b in proptest::collection::vec(1u64..20, 1..8)) {
        // Build two range lists of equal total length with gaps between ranges.
        let total: u64 = cuts_a.iter().sum();
        let mut b = cuts_b.clone();
        let sb: u64 = b.iter().sum();
        if sb < total { b.push(total - sb); } else {
            let mut acc = 0; let mut bb = Vec::new();
            for x in b { if acc + x >= total { bb.push(total - acc); break; } acc += x; bb.push(x); }
            b = bb.into_iter().filter(|x| *x > 0).collect();
        }
        let mk = |cuts: &[u64]| { let mut o = 0; cuts.iter().map(|c| { let r = o..o + c; o += c + 3; r }).collect::<Vec<_>>() };
        let (ra, rb) = (mk(&cuts_a), mk(&b));
        let mut out = Vec::new();
        pair_ranges(0, &ra, 10_000, &rb, &mut out).unwrap();
        let flat = |r: &[std::ops::Range<u64>]| r.iter().flat_map(|r| r.clone()).collect::<Vec<_>>();
        let (fa, fb) = (flat(&ra), flat(&rb));
        let mut k = 0;
        for c in &out { for x in 0..c.len { prop_assert_eq!(c.src + x, fa[k]); prop_assert_eq!(c.dst + x - 10_000, fb[k]); k += 1; } }
        prop_assert_eq!(k as u64, total);
    }
}

fn beating() -> ProducerTimeouts {
    ProducerTimeouts {
        heartbeat: Duration::from_secs(1),
        ..timeouts()
    }
}

fn continues(effects: &[Effect<u32, &'static str>]) -> Vec<u32> {
    replies(effects)
        .into_iter()
        .filter(|r| r.1 == Status::Continue)
        .map(|r| r.0)
        .collect()
}

#[test]
fn waiting_and_serving_requests_get_heartbeats() {
    let t0 = Instant::now();
    let mut m = Machine::new(beating(), Duration::from_secs(2));
    m.on_request(t0, 1, request("early", 1), &sess());
    m.publish(t0, "a", "blocks").unwrap();
    assert_eq!(
        serves(&m.on_request(t0, 2, request("a", 2), &sess())).len(),
        1
    );
    assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(1)));
    let mut beats = continues(&m.on_tick(t0 + Duration::from_secs(1)));
    beats.sort();
    assert_eq!(beats, vec![1, 2]);
    // Once served, no more heartbeats for it.
    m.on_served(t0, 2, "a", 2, Ok((1, None, None)));
    assert_eq!(continues(&m.on_tick(t0 + Duration::from_secs(2))), vec![1]);
}

#[test]
fn no_transfer_starts_that_could_outlast_the_consumers_budget() {
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    m.publish(t0, "a", "blocks").unwrap();
    let mut short = request("a", 1);
    short.budget_ms = 1500;
    let e = m.on_request(t0, 1, short, &sess());
    assert!(serves(&e).is_empty());
    assert!(
        replies(&e)[0].2.as_ref().unwrap().contains("budget"),
        "{e:?}"
    );
    // Nothing was written, so the lease is still there for a consumer with time left.
    let mut long = request("a", 2);
    long.budget_ms = 10_000;
    match &m.on_request(t0, 2, long, &sess())[..] {
        [Effect::Serve { deadline, .. }] => assert_eq!(*deadline, t0 + Duration::from_secs(2)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn waiting_for_publish_stops_when_the_budget_would_run_out() {
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    let mut r = request("w", 1);
    r.budget_ms = 4000; // the last transfer may start at t0 + 2 s (publish wait is 5 s)
    m.on_request(t0, 1, r, &sess());
    assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(2)));
    let e = m.on_tick(t0 + Duration::from_secs(2));
    assert_eq!(replies(&e)[0].1, Status::Error);
    // A publish just before that still serves it.
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    let mut r = request("w", 1);
    r.budget_ms = 4000;
    m.on_request(t0, 1, r, &sess());
    assert_eq!(
        serves(
            &m.publish(t0 + Duration::from_millis(1900), "w", "b")
                .unwrap()
        )
        .len(),
        1
    );
}

#[test]
fn a_request_with_no_time_left_to_wait_is_answered() {
    // The budget leaves exactly the serve margin: a transfer could start now, but nothing is
    // published yet, and waiting is no longer possible. The consumer hears so at once.
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    let mut r = request("edge", 1);
    r.budget_ms = 2000;
    let e = m.on_request(t0, 1, r, &sess());
    assert_eq!(replies(&e).len(), 1, "{e:?}");
    assert_eq!(replies(&e)[0].1, Status::Error);
    assert_eq!(m.poll_timeout(), None, "nothing parked");
}

#[test]
fn consumer_sends_a_budget_that_ends_before_its_own_deadline() {
    let t0 = Instant::now();
    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(10),
        0,
    ));
    let (_, bytes) = start(&mut c, t0, request("a", 0));
    let sent = decode_request(&bytes).unwrap();
    assert_eq!(sent.budget_ms, 9000);
    assert!(Duration::from_millis(sent.budget_ms) < Duration::from_secs(10));
}

/// The producer's ERROR for a request that does not match the lease carries the typed reason
/// (one for another cause does not), and the consumer fails the load with it; a reply without
/// it (an older producer's) or with a reason this side does not know (a newer one's) is a
/// plain producer error, never a bad reply.
#[test]
fn a_lease_mismatch_is_typed_on_the_wire() {
    use super::serve_error::ServeError;
    let reasons = |e: &[Effect<u32, &'static str>]| -> Vec<Option<ErrorReason>> {
        e.iter()
            .filter_map(|e| match e {
                Effect::Reply { reply, .. } => Some(reply.reason),
                _ => None,
            })
            .collect()
    };
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    m.publish(t0, "a", "b").unwrap();
    m.on_request(t0, 1, request("a", 1), &sess());
    let wrong_block = ServeError::WrongBlock {
        group: 0,
        position: 0,
        expected: 4,
        held: Some(5),
    };
    m.handle_refused(t0, 1, "a", 1, ServeFailure::Plan(wrong_block), "b");
    assert_eq!(
        reasons(&m.drained()),
        vec![Some(ErrorReason::LeaseMismatch)]
    );
    m.on_request(t0, 2, request("a", 2), &sess());
    let token = ServeFailure::Token(kvferry_transfer::TransferError::Cancelled);
    m.handle_refused(t0, 2, "a", 2, token, "b");
    assert_eq!(reasons(&m.drained()), vec![None]);

    let mut c = opened(ConsumerMachine::new(
        Duration::from_secs(2),
        Duration::from_secs(10),
        100,
    ));
    let (id, _) = start(&mut c, t0, request("x", 0));
    let mut r = Reply::error("x", id, "nope");
    r.reason = Some(ErrorReason::LeaseMismatch);
    assert_eq!(
        on_message(&mut c, t0, &encode(&r)),
        ConsumerEvent::Failed {
            load_id: id,
            reason: FailReason::LeaseMismatch(PeerText::from_bytes(b"nope"))
        }
    );
    // Without the field it is not written at all (older consumers read the same map).
    let plain = encode(&Reply::error("y", 7, "nope"));
    let v = rmpv::decode::read_value(&mut &plain[..]).unwrap();
    let mut map = v.as_map().unwrap().clone();
    assert!(!map.iter().any(|(k, _)| k.as_str() == Some("reason")));
    let (id, _) = start(&mut c, t0, request("y", 0));
    for (k, v) in map.iter_mut() {
        if k.as_str() == Some("load_id") {
            *v = rmpv::Value::from(id);
        }
    }
    map.push((
        rmpv::Value::from("reason"),
        rmpv::Value::from("a_newer_reason"),
    ));
    let mut newer = Vec::new();
    rmpv::encode::write_value(&mut newer, &rmpv::Value::Map(map)).unwrap();
    assert_eq!(
        on_message(&mut c, t0, &newer),
        ConsumerEvent::Failed {
            load_id: id,
            reason: FailReason::Producer(PeerText::from_bytes(b"nope"))
        }
    );
}

/// The FINISH names the path the serve reports (what carried the KV), and it is read back from
/// the wire; a reply without it (an older producer's) or naming a path this side does not know
/// (a newer one's) reads as no path, never as a bad reply.
#[test]
fn a_finish_names_the_path_that_carried_the_load() {
    let t0 = Instant::now();
    let mut m = Machine::new(timeouts(), Duration::from_secs(2));
    m.publish(t0, "a", "b").unwrap();
    m.on_request(t0, 1, request("a", 1), &sess());
    let e = m.on_served(t0, 1, "a", 1, Ok((8, None, Some(TransferPath::CudaIpc))));
    let finish = e
        .iter()
        .find_map(|e| match e {
            Effect::Reply { reply, .. } if reply.status() == Status::Finish => Some(reply.clone()),
            _ => None,
        })
        .expect("a FINISH");
    assert_eq!(finish.path, Some(TransferPath::CudaIpc));
    let wire = encode(&finish);
    assert_eq!(
        decode_reply(&wire).unwrap().path,
        Some(TransferPath::CudaIpc)
    );

    let v = rmpv::decode::read_value(&mut &wire[..]).unwrap();
    let mut map = v.as_map().unwrap().clone();
    for (k, v) in map.iter_mut() {
        if k.as_str() == Some("path") {
            *v = rmpv::Value::from("a-newer-path");
        }
    }
    let mut newer = Vec::new();
    rmpv::encode::write_value(&mut newer, &rmpv::Value::Map(map)).unwrap();
    assert_eq!(decode_reply(&newer).unwrap().path, None);
    let older = encode(&Reply::new(Status::Finish, "a", 1));
    let v = rmpv::decode::read_value(&mut &older[..]).unwrap();
    assert!(!v
        .as_map()
        .unwrap()
        .iter()
        .any(|(k, _)| k.as_str() == Some("path")));
    assert_eq!(decode_reply(&older).unwrap().path, None);
}
