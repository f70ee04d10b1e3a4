//! Hostile peers against a producer/consumer pair on loopback (issue 10): raw TCP data frames
//! into the blocks of either side, a stranger loading another consumer's request, a FINISH
//! that does not prove the load's token. With a shared secret on both sides the engines are
//! authenticated: only the producer holding the load's grant token writes, only into the
//! load's blocks, only until the load ends. The open-mode test shows what main allowed.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::Side;
use kvferry_checksum::policy::Policy;
use kvferry_checksum::verdict::Verdict;
use kvferry_p2p::proto::consumer::FailReason;
use kvferry_p2p::proto::msg::{decode_request, encode, finish_proof, Reply, Status};
use kvferry_p2p::{
    Consumer, ConsumerConfig, LoadError, LoadGroup, LoadSpec, Producer, ProducerConfig,
};
use kvferry_transfer::{Secret, TransferEngine};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const NUM_TOKENS: u64 = 40;

fn secret() -> Secret {
    Secret::from_bytes(b"p2p test shared secret, 32 bytes").unwrap()
}

fn producer_config() -> ProducerConfig {
    ProducerConfig {
        transfer_timeout: Duration::from_secs(10),
        ..ProducerConfig::default()
    }
}

fn consumer_config() -> ConsumerConfig {
    ConsumerConfig {
        policy: Policy::default(),
        reply_timeout: Duration::from_secs(10),
        max_wait: Duration::from_secs(20),
        ..ConsumerConfig::default()
    }
}

fn spec(request_id: &str, endpoint: &str, load_key: Option<String>) -> LoadSpec {
    LoadSpec {
        request_id: request_id.into(),
        producer: endpoint.into(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: vec![Some(3), Some(5), Some(1)],
            local_blocks: vec![Some(7), Some(2), Some(10)],
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key,
    }
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
        .load(spec("req-1", producer.endpoint(), Some(info.load_key)))
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
        let err = stranger.load(spec("req-1", &ep, key)).await.unwrap_err();
        assert!(
            matches!(&err, LoadError::Failed { reason: FailReason::Producer(w), .. } if w.contains("load key")),
            "{err}"
        );
    }
    assert!(stranger_side.block_bytes(0, 0, 7).iter().all(|&b| b == 0));
    assert!(producer.released().is_empty(), "the lease was not consumed");
    let out = owner
        .load(spec("req-1", &ep, Some(info.load_key)))
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    // a stranger asking before the publish cannot lock the owner out either
    let early = stranger.load(spec("req-2", &ep, Some("f".repeat(32))));
    let real = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        owner
            .load(spec("req-2", &ep, Some("owner-key".into())))
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

/// A fake producer that answers every request FINISH with `proof(token, reply)`.
async fn fake_producer(
    proof: impl Fn(Option<&str>, &Reply) -> Option<Vec<u8>> + Send + 'static,
) -> String {
    let mut router = zeromq::RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    tokio::spawn(async move {
        while let Ok(m) = router.recv().await {
            let frames = m.into_vec();
            let req = decode_request(frames.last().unwrap()).unwrap();
            let mut reply = Reply::new(Status::Finish, &req.request_id, req.load_id);
            reply.bytes_written = 1;
            reply.proof = proof(req.token.as_deref(), &reply);
            let mut msg = ZmqMessage::from(frames[0].clone());
            msg.push_back(encode(&reply).into());
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
        ("none", fake_producer(|_, _| None).await, false),
        (
            "other token",
            fake_producer(|_, r| Some(finish_proof(&"0".repeat(32), r).to_vec())).await,
            false,
        ),
        (
            "right token",
            fake_producer(|t, r| Some(finish_proof(t.unwrap(), r).to_vec())).await,
            true,
        ),
    ];
    for (what, ep, accepted) in cases {
        let r = consumer.load(spec("req-f", &ep, None)).await;
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
