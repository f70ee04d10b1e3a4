//! Hostile peers against a producer/consumer pair on loopback: raw TCP data frames
//! into the blocks of either side, a stranger loading another consumer's request, a FINISH
//! that does not prove the load's token. With a shared secret on both sides the engines are
//! authenticated: only the producer holding the load's grant token writes, only into the
//! load's blocks, only until the load ends. The open-mode test shows what main allowed.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{consumer_config, producer_config, spec_at, Side, NUM_TOKENS};
use kvferry_checksum::verdict::Verdict;
use kvferry_p2p::proto::consumer::FailReason;
use kvferry_p2p::proto::msg::{
    decode_consumer_message, encode, finish_proof, ConsumerMessage, Reply, Status, Welcome,
    KIND_WELCOME, PROTOCOL_VERSION,
};
use kvferry_p2p::proto::session::Session;
use kvferry_p2p::{Consumer, LoadError, Producer};
use kvferry_transfer::{Secret, TransferEngine};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn secret() -> Secret {
    Secret::from_bytes(b"p2p test shared secret, 32 bytes").unwrap()
}

/// A WRITE (op 1) or READ (op 2) frame with no token, as an attacker who fetched nothing sends.
fn raw(engine: &TransferEngine, op: u8, addr: u64, payload: &[u8], len: u64) -> (u8, Vec<u8>) {
    let d = engine.local_descriptor();
    let port = d.transport.details["data_port"].as_u64().unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", port as u16)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut f = vec![0u8; 48];
    f[0..4].copy_from_slice(&0x5446_564bu32.to_le_bytes());
    f[4] = op;
    f[8..16].copy_from_slice(&d.instance_id.to_le_bytes());
    f[16..24].copy_from_slice(&addr.to_le_bytes());
    f[24..32].copy_from_slice(&len.to_le_bytes());
    f.extend_from_slice(payload);
    s.write_all(&f).unwrap();
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    let mut b = vec![0u8; u64::from_le_bytes(h[8..16].try_into().unwrap()) as usize];
    s.read_exact(&mut b).unwrap();
    (h[4], b)
}

const OK: u8 = 0;
const DENIED: u8 = 5;

/// Loads req-1 from a fresh pair; returns (producer, consumer, producer side, consumer side).
async fn loaded_pair(secret: Option<Secret>) -> (Producer, Consumer, Side, Side) {
    let (p, c) = match secret {
        Some(s) => (
            Side::authenticated(1, 1, 8, Some(7), s.clone()),
            Side::authenticated(1, 1, 12, Some(99), s),
        ),
        None => (Side::new(1, 1, 8, Some(7)), Side::new(1, 1, 12, Some(99))),
    };
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    // verification starts only after the load's grant ended
    let engine = c.workers[0].engine.clone();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
    let s2 = seen.clone();
    consumer.set_landed_hook(Some(std::sync::Arc::new(move |_: &kvferry_p2p::Landed| {
        s2.store(engine.live_grants(), std::sync::atomic::Ordering::SeqCst)
    })));
    let info = producer
        .publish("req-1", vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
        .await
        .unwrap();
    let out = consumer
        .load(spec_at("req-1", producer.endpoint(), Some(info.load_key)))
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    assert_eq!(p.block_bytes(0, 0, 3), c.block_bytes(0, 0, 7));
    assert_eq!(
        seen.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "grant revoked before verification"
    );
    (producer, consumer, p, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_mode_lets_anyone_overwrite_verified_blocks_and_read_kv() {
    // main's only mode (and still the default: trusted networks only).
    let (producer, _consumer, p, c) = loaded_pair(None).await;
    let block = c.token_addr(0, 0, 7, 0);
    let (st, _) = raw(&c.workers[0].engine, 1, block, b"EVIL", 4);
    assert_eq!(st, OK, "the write after verification lands unseen");
    assert_ne!(p.block_bytes(0, 0, 3), c.block_bytes(0, 0, 7));
    let (st, kv) = raw(&p.workers[0].engine, 2, p.token_addr(0, 0, 3, 0), b"", 16);
    assert_eq!(
        (st, kv),
        (OK, p.block_bytes(0, 0, 3)[..16].to_vec()),
        "KV leaks"
    );
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authenticated_pair_refuses_raw_frames_on_both_sides_and_ends_the_grant() {
    let (producer, _consumer, p, c) = loaded_pair(Some(secret())).await;
    // the load's grant ended with the load
    assert_eq!(c.workers[0].engine.live_grants(), 0);
    let landed = c.block_bytes(0, 0, 7);
    // consumer: a write after verification is refused
    let (st, _) = raw(
        &c.workers[0].engine,
        1,
        c.token_addr(0, 0, 7, 0),
        b"EVIL",
        4,
    );
    assert_eq!(st, DENIED);
    assert_eq!(c.block_bytes(0, 0, 7), landed);
    // producer: writes before a load and reads of its KV are refused
    let kv = p.block_bytes(0, 0, 5);
    let (st, _) = raw(
        &p.workers[0].engine,
        1,
        p.token_addr(0, 0, 5, 0),
        b"EVIL",
        4,
    );
    assert_eq!(st, DENIED);
    assert_eq!(p.block_bytes(0, 0, 5), kv);
    let (st, text) = raw(&p.workers[0].engine, 2, p.token_addr(0, 0, 5, 0), b"", 16);
    assert_eq!(st, DENIED);
    assert!(
        !text.windows(16).any(|w| w == &kv[..16]),
        "no KV in the refusal"
    );
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_load_another_consumers_request() {
    let p = Side::new(1, 1, 8, Some(7));
    let owner_side = Side::new(1, 1, 12, Some(99));
    let stranger_side = Side::new(1, 1, 12, None);
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let owner = Consumer::new(consumer_config(), owner_side.workers.clone()).unwrap();
    let stranger = Consumer::new(consumer_config(), stranger_side.workers.clone()).unwrap();
    let ep = producer.endpoint().to_string();
    let info = producer
        .publish("req-1", vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
        .await
        .unwrap();
    assert_eq!(info.load_key.len(), 32);
    // no key, a wrong key: ERROR, nothing written, the lease stays
    for key in [None, Some("0".repeat(32))] {
        let err = stranger.load(spec_at("req-1", &ep, key)).await.unwrap_err();
        assert!(
            matches!(&err, LoadError::Failed { reason: FailReason::Producer(w), .. } if w.as_str().contains("load key")),
            "{err}"
        );
    }
    assert!(stranger_side.block_bytes(0, 0, 7).iter().all(|&b| b == 0));
    assert!(producer.released().is_empty(), "the lease was not consumed");
    let out = owner
        .load(spec_at("req-1", &ep, Some(info.load_key)))
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    // a stranger asking before the publish cannot lock the owner out either
    let early = stranger.load(spec_at("req-2", &ep, Some("f".repeat(32))));
    let real = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        owner
            .load(spec_at("req-2", &ep, Some("owner-key".into())))
            .await
    };
    let publish = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        producer
            .publish_with_key(
                "req-2",
                vec![vec![Some(3), Some(5), Some(1)]],
                NUM_TOKENS,
                "owner-key",
            )
            .await
            .unwrap()
    };
    let (early, real, _) = tokio::join!(early, real, publish);
    assert!(early.is_err());
    assert_eq!(real.unwrap().verdict, Some(Verdict::Verified));
    producer.shutdown().await;
}

/// A fake producer (open mode: its welcome proves nothing) that answers every request FINISH
/// with `proof(token, session id, reply)`.
async fn fake_producer(
    proof: impl Fn(Option<&str>, &[u8; 32], &Reply) -> Option<Vec<u8>> + Send + 'static,
) -> String {
    let mut router = zeromq::RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    tokio::spawn(async move {
        let mut session = None;
        while let Ok(m) = router.recv().await {
            let frames = m.into_vec();
            let answer = match decode_consumer_message(frames.last().unwrap()).unwrap() {
                ConsumerMessage::Hello(h) => {
                    let s = Session {
                        consumer_nonce: h.nonce.as_slice().try_into().unwrap(),
                        producer_nonce: [5; 32],
                        producer: h.producer,
                        consumer: h.consumer,
                    };
                    session = Some(s);
                    encode(&Welcome {
                        version: PROTOCOL_VERSION,
                        kind: KIND_WELCOME.into(),
                        nonce: vec![5; 32],
                        proof: None,
                        error: None,
                        reads: false,
                    })
                }
                ConsumerMessage::Request(req) => {
                    let sid = session.as_ref().unwrap().id();
                    let mut reply = Reply::new(Status::Finish, &req.request_id, req.load_id);
                    reply.bytes_written = 1;
                    reply.proof = proof(req.token.as_deref(), &sid, &reply);
                    encode(&reply)
                }
                ConsumerMessage::ReadDone(_) => continue,
            };
            let mut msg = ZmqMessage::from(frames[0].clone());
            msg.push_back(answer.into());
            if router.send(msg).await.is_err() {
                break;
            }
        }
    });
    ep
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_must_prove_the_loads_token() {
    let c = Side::new(1, 1, 12, None);
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    let cases: Vec<(&str, String, bool)> = vec![
        ("none", fake_producer(|_, _, _| None).await, false),
        (
            "other token",
            fake_producer(|_, sid, r| Some(finish_proof(&"0".repeat(32), sid, r).to_vec())).await,
            false,
        ),
        (
            "right token",
            fake_producer(|t, sid, r| Some(finish_proof(t.unwrap(), sid, r).to_vec())).await,
            true,
        ),
    ];
    for (what, ep, accepted) in cases {
        let r = consumer.load(spec_at("req-f", &ep, None)).await;
        if accepted {
            assert!(r.is_ok(), "{what}: {r:?}");
        } else {
            assert!(
                matches!(
                    r,
                    Err(LoadError::Failed {
                        reason: FailReason::BadProof,
                        ..
                    })
                ),
                "{what}: {r:?}"
            );
        }
        assert_eq!(c.workers[0].engine.live_grants(), 0, "{what}: grant ended");
    }
}

// ------------------------------------------------------------ mutual authentication

/// What a producer without the secret got from a consumer.
#[derive(Debug, Default)]
struct Loot {
    /// The `kind` of every message received.
    kinds: Vec<String>,
    /// Grant tokens and load keys found in them.
    tokens: Vec<String>,
    load_keys: Vec<String>,
    /// Whether a WRITE with a stolen token landed.
    wrote: bool,
}

fn field<'a>(v: &'a rmpv::Value, k: &str) -> Option<&'a rmpv::Value> {
    v.as_map()?
        .iter()
        .find(|(kk, _)| kk.as_str() == Some(k))
        .map(|(_, v)| v)
}

fn msgpack(fields: Vec<(&str, rmpv::Value)>) -> Vec<u8> {
    let v = rmpv::Value::Map(fields.into_iter().map(|(k, v)| (k.into(), v)).collect());
    let mut b = Vec::new();
    rmpv::encode::write_value(&mut b, &v).unwrap();
    b
}

/// A producer without the shared secret, written against no particular protocol version: it
/// answers a `hello` with a welcome carrying `proof` (none, or bytes it made up), and a transfer
/// request by WRITING into the consumer's first layer with the request's token through
/// `thief` (an open engine with `src` registered), then FINISH with that token's proof.
async fn stealing_producer(
    proof: Option<Vec<u8>>,
    thief: std::sync::Arc<TransferEngine>,
    src: u64,
) -> (String, std::sync::Arc<std::sync::Mutex<Loot>>) {
    let mut router = zeromq::RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let loot = std::sync::Arc::new(std::sync::Mutex::new(Loot::default()));
    let l2 = loot.clone();
    tokio::spawn(async move {
        while let Ok(m) = router.recv().await {
            let frames = m.into_vec();
            let Ok(v) = rmpv::decode::read_value(&mut &frames.last().unwrap()[..]) else {
                continue;
            };
            let kind = field(&v, "kind")
                .and_then(|k| k.as_str())
                .unwrap_or("")
                .to_string();
            l2.lock().unwrap().kinds.push(kind.clone());
            let answer = if kind == "hello" {
                let mut f = vec![
                    ("version", rmpv::Value::from(2)),
                    ("kind", "welcome".into()),
                    ("nonce", rmpv::Value::Binary(vec![3; 32])),
                ];
                if let Some(p) = &proof {
                    f.push(("proof", rmpv::Value::Binary(p.clone())));
                }
                msgpack(f)
            } else {
                let s = |k: &str| field(&v, k).and_then(|x| x.as_str()).map(String::from);
                let (token, rid) = (s("token"), s("request_id").unwrap_or_default());
                let load_id = field(&v, "load_id").and_then(|x| x.as_u64()).unwrap_or(0);
                let mut wrote = false;
                if let Some(t) = &token {
                    let rank = &field(&v, "ranks").unwrap().as_array().unwrap()[0];
                    let seg = field(rank, "segment")
                        .unwrap()
                        .as_str()
                        .unwrap()
                        .to_string();
                    let layer = &field(
                        &field(rank, "groups").unwrap().as_array().unwrap()[0],
                        "layers",
                    )
                    .unwrap()
                    .as_array()
                    .unwrap()[0];
                    let dst = field(layer, "addr").unwrap().as_u64().unwrap();
                    let (thief, t) = (thief.clone(), t.parse().unwrap());
                    wrote = tokio::task::spawn_blocking(move || {
                        let seg = thief.open_segment_with_token(&seg, t).ok()?;
                        let req = kvferry_transfer::TransferRequest {
                            op: kvferry_transfer::Op::Write,
                            local_addr: src,
                            remote_addr: dst,
                            len: 256,
                        };
                        let id = thief.submit(&seg, &[req]).ok()?;
                        thief.wait(id, Duration::from_secs(5)).ok()
                    })
                    .await
                    .unwrap()
                    .is_some();
                }
                let mut l = l2.lock().unwrap();
                l.tokens.extend(token.clone());
                l.load_keys.extend(s("load_key"));
                l.wrote |= wrote;
                // FINISH proved with the stolen token (the first protocol's proof)
                let proof = token.map(|t| {
                    kvferry_transfer::auth::hmac_sha256(
                        t.as_bytes(),
                        &[
                            b"kvferry/finish/v1",
                            rid.as_bytes(),
                            &load_id.to_le_bytes(),
                            &256u64.to_le_bytes(),
                            &[0],
                            b"",
                        ],
                    )
                });
                let mut f = vec![
                    ("version", field(&v, "version").cloned().unwrap_or(1.into())),
                    ("kind", "reply".into()),
                    ("status", 0.into()),
                    ("request_id", rid.as_str().into()),
                    ("load_id", load_id.into()),
                    ("bytes_written", 256.into()),
                ];
                if let Some(p) = proof {
                    f.push(("proof", rmpv::Value::Binary(p.to_vec())));
                }
                msgpack(f)
            };
            let mut msg = ZmqMessage::from(frames[0].clone());
            msg.push_back(answer.into());
            if router.send(msg).await.is_err() {
                break;
            }
        }
    });
    (ep, loot)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_without_the_secret_gets_nothing_from_a_secret_consumer() {
    // The consumer is told to load from a fake producer. It must hand over no token, no load
    // key, nothing a descriptor or a WRITE could be had with, and report no load.
    let c = Side::authenticated(1, 1, 12, None, secret());
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    let thief_side = Side::new(1, 1, 8, Some(5));
    let thief = thief_side.workers[0].engine.clone();
    let src = thief_side.token_addr(0, 0, 0, 0);
    let key = kvferry_p2p::derive_load_key(&secret(), "req-1");
    for proof in [None, Some(vec![9u8; 32])] {
        let (ep, loot) = stealing_producer(proof.clone(), thief.clone(), src).await;
        let r = consumer
            .load(spec_at("req-1", &ep, Some(key.clone())))
            .await;
        let loot = loot.lock().unwrap();
        assert!(
            matches!(&r, Err(LoadError::Connect { why, .. }) if why.to_string().contains("did not prove the shared secret")),
            "proof {proof:?}: {r:?}"
        );
        assert_eq!(loot.kinds, vec!["hello"], "only the hello reached it");
        assert!(loot.tokens.is_empty() && loot.load_keys.is_empty() && !loot.wrote);
        assert!(
            c.block_bytes(0, 0, 0).iter().all(|&b| b == 0),
            "nothing landed"
        );
        assert_eq!(
            c.workers[0].engine.live_grants(),
            0,
            "the load's grant ended"
        );
    }
}

async fn dealer(ep: &str) -> zeromq::DealerSocket {
    let mut d = zeromq::DealerSocket::new();
    d.connect(ep).await.unwrap();
    d
}

async fn ask(d: &mut zeromq::DealerSocket, msg: Vec<u8>) -> Vec<u8> {
    d.send(ZmqMessage::from(msg)).await.unwrap();
    let m = tokio::time::timeout(Duration::from_secs(10), d.recv())
        .await
        .unwrap()
        .unwrap();
    m.into_vec().pop().unwrap().to_vec()
}

/// Opens a session on `d` with `machine` (its secret, if any); `Err` when the welcome fails.
async fn open_session(
    d: &mut zeromq::DealerSocket,
    machine: &mut kvferry_p2p::proto::consumer::ConsumerMachine,
    ep: &str,
) -> Result<(), kvferry_p2p::proto::consumer::SessionError> {
    let hello = machine.hello(kvferry_transfer::auth::random_bytes().unwrap(), ep, "me:1");
    let w = ask(d, hello).await;
    machine.handle_welcome(&w)
}

fn error_of(bytes: &[u8]) -> String {
    let r = kvferry_p2p::proto::msg::decode_reply(bytes).unwrap();
    assert_eq!(r.status(), Status::Error, "{r:?}");
    r.error.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_requests_are_useless_in_another_session_or_run() {
    use kvferry_p2p::proto::consumer::ConsumerMachine;
    let c = Side::authenticated(1, 1, 12, Some(99), secret());
    let key = kvferry_p2p::derive_load_key(&secret(), "req-1");
    let layouts: Vec<_> = c.workers.iter().map(|w| w.layout()).collect();
    let (request, _) =
        kvferry_p2p::proto::request::build_request(&layouts, 1, 1, &spec_at("req-1", "", None))
            .unwrap();
    let machine = || {
        ConsumerMachine::new(Duration::from_secs(10), Duration::from_secs(20), 1)
            .with_secret(Some(secret()))
    };
    // run 1: the owner's request for req-1 (not published yet: it waits), captured
    let p = Side::authenticated(1, 1, 8, Some(7), secret());
    let run1 = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let mut owner = machine();
    let mut d = dealer(run1.endpoint()).await;
    open_session(&mut d, &mut owner, run1.endpoint())
        .await
        .unwrap();
    owner
        .start(std::time::Instant::now(), request.clone(), Some(&key))
        .unwrap();
    let captured = owner.poll_transmit().unwrap().bytes;
    ask(&mut d, captured.clone()).await; // CONTINUE
                                         // in the same session, the same request again: refused
    let e = error_of(&ask(&mut d, captured.clone()).await);
    assert!(e.contains("already used in this session"), "{e}");
    drop(d);
    run1.shutdown().await;
    // run 2, same secret, req-1 published under the same derived key
    let run2 = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let ep = run2.endpoint().to_string();
    run2.publish_with_key(
        "req-1",
        vec![vec![Some(3), Some(5), Some(1)]],
        NUM_TOKENS,
        &key,
    )
    .await
    .unwrap();
    // the captured request with no session, and in a session of its own: refused
    let mut d = dealer(&ep).await;
    let e = error_of(&ask(&mut d, captured.clone()).await);
    assert!(e.contains("no session"), "{e}");
    let mut stranger = ConsumerMachine::new(Duration::from_secs(10), Duration::from_secs(20), 1);
    open_session(&mut d, &mut stranger, &ep).await.unwrap();
    let e = error_of(&ask(&mut d, captured.clone()).await);
    assert!(e.contains("does not prove the shared secret"), "{e}");
    // reflection: the producer's own proof of the session as the request's
    let mut d = dealer(&ep).await;
    let hello = stranger.hello([4; 32], &ep, "me:1");
    let w = kvferry_p2p::proto::msg::decode_welcome(&ask(&mut d, hello).await).unwrap();
    let mut reflected = request.clone();
    reflected.proof = w.proof.clone();
    reflected.load_id = 77;
    let e = error_of(&ask(&mut d, encode(&reflected)).await);
    assert!(e.contains("does not prove the shared secret"), "{e}");
    // an open-mode consumer holding the real load key: refused too
    let open_side = Side::new(1, 1, 12, None);
    let open = Consumer::new(consumer_config(), open_side.workers.clone()).unwrap();
    let r = open.load(spec_at("req-1", &ep, Some(key.clone()))).await;
    assert!(
        matches!(&r, Err(LoadError::Failed { reason: FailReason::Producer(w), .. }) if w.as_str().contains("does not prove the shared secret")),
        "{r:?}"
    );
    assert!(open_side.block_bytes(0, 0, 7).iter().all(|&b| b == 0));
    // the lease is intact: its owner loads it
    assert!(run2.released().is_empty());
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    let out = consumer
        .load(spec_at("req-1", &ep, Some(key)))
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    run2.shutdown().await;
}

/// A man in the middle: a ROUTER at its own endpoint that passes every consumer message on to
/// `producer` and every answer back, rewriting the hello's `producer` to `rewrite` if given.
async fn relay(producer: String, rewrite: Option<String>) -> String {
    let mut front = zeromq::RouterSocket::new();
    let ep = front.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    tokio::spawn(async move {
        let mut back = dealer(&producer).await;
        while let Ok(m) = front.recv().await {
            let frames = m.into_vec();
            let mut body = frames.last().unwrap().to_vec();
            if let (Some(name), Ok(ConsumerMessage::Hello(mut h))) =
                (&rewrite, decode_consumer_message(&body))
            {
                h.producer = name.clone();
                body = encode(&h);
            }
            let answer = ask(&mut back, body).await;
            let mut msg = ZmqMessage::from(frames[0].clone());
            msg.push_back(answer.into());
            if front.send(msg).await.is_err() {
                break;
            }
        }
    });
    ep
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relaying_man_in_the_middle_fails_on_the_control_channel() {
    let p = Side::authenticated(1, 1, 8, Some(7), secret());
    let c = Side::authenticated(1, 1, 12, None, secret());
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let ep = producer.endpoint().to_string();
    let key = kvferry_p2p::derive_load_key(&secret(), "req-1");
    producer
        .publish_with_key(
            "req-1",
            vec![vec![Some(3), Some(5), Some(1)]],
            NUM_TOKENS,
            &key,
        )
        .await
        .unwrap();
    // passed on as it is: the producer refuses a hello naming the relay
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    let r = consumer
        .load(spec_at(
            "req-1",
            &relay(ep.clone(), None).await,
            Some(key.clone()),
        ))
        .await;
    assert!(
        matches!(&r, Err(LoadError::Connect { why, .. }) if why.to_string().contains("refused the session")),
        "{r:?}"
    );
    // rewritten to name the producer: its proof names the producer, the consumer dialed the relay
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    let r = consumer
        .load(spec_at(
            "req-1",
            &relay(ep.clone(), Some(ep.clone())).await,
            Some(key.clone()),
        ))
        .await;
    assert!(
        matches!(&r, Err(LoadError::Connect { why, .. }) if why.to_string().contains("did not prove the shared secret")),
        "{r:?}"
    );
    assert!(c.block_bytes(0, 0, 7).iter().all(|&b| b == 0));
    // the lease is intact
    let out = consumer
        .load(spec_at("req-1", &ep, Some(key)))
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_mode_key_proofs_are_bound_to_their_session() {
    // No secret anywhere: the load key still never travels, and its proof from one session
    // does not load the lease in another.
    use kvferry_p2p::proto::consumer::ConsumerMachine;
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, None);
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let ep = producer.endpoint().to_string();
    let info = producer
        .publish("req-1", vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
        .await
        .unwrap();
    let layouts: Vec<_> = c.workers.iter().map(|w| w.layout()).collect();
    let (request, _) =
        kvferry_p2p::proto::request::build_request(&layouts, 1, 1, &spec_at("req-1", "", None))
            .unwrap();
    let mut owner = ConsumerMachine::new(Duration::from_secs(10), Duration::from_secs(20), 1);
    let mut d = dealer(&ep).await;
    open_session(&mut d, &mut owner, &ep).await.unwrap();
    owner
        .start(std::time::Instant::now(), request, Some(&info.load_key))
        .unwrap();
    let captured = owner.poll_transmit().unwrap().bytes;
    assert!(
        !captured
            .windows(info.load_key.len())
            .any(|w| w == info.load_key.as_bytes()),
        "the key itself is not in the request"
    );
    let mut d2 = dealer(&ep).await;
    let mut stranger = ConsumerMachine::new(Duration::from_secs(10), Duration::from_secs(20), 1);
    open_session(&mut d2, &mut stranger, &ep).await.unwrap();
    let e = error_of(&ask(&mut d2, captured).await);
    assert!(e.contains("load key wrong"), "{e}");
    assert!(
        producer.released().is_empty(),
        "the lease stays for its owner"
    );
    producer.shutdown().await;
}
