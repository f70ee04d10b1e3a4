//! The control channel is bounded before allocation: a ZMTP frame header declaring more than
//! the configured limit drops that connection before anything is reserved, on the producer's
//! ROUTER and on the consumer's DEALER, and the process keeps serving. The producer's control
//! port is as bounded as the engine's listeners: per-source and total connection limits at
//! accept, a deadline for the handshake and for a message once begun, one receive budget for
//! the large frames of all connections. Raw TCP peers speak ZMTP 3.0 by hand (greeting,
//! READY, frames), from source addresses 127.0.0.x.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::{
    connect_from, consumer_config, greeting, producer_config, ready, spec_at, Side, NUM_TOKENS,
};
use kvferry_p2p::proto::consumer::FailReason;
use kvferry_p2p::{Consumer, ConsumerConfig, LoadError, LoadSpec, Producer};
use kvferry_p2p::{ProducerConfig, DEFAULT_MAX_ZMTP_MESSAGE};

/// A long message frame header declaring `len` body bytes.
fn long_header(len: u64) -> Vec<u8> {
    let mut h = vec![0x02u8];
    h.extend_from_slice(&len.to_be_bytes());
    h
}

fn read_frame(s: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut flags = [0u8; 1];
    s.read_exact(&mut flags).unwrap();
    let len = if flags[0] & 0x02 != 0 {
        let mut l = [0u8; 8];
        s.read_exact(&mut l).unwrap();
        u64::from_be_bytes(l) as usize
    } else {
        let mut l = [0u8; 1];
        s.read_exact(&mut l).unwrap();
        l[0] as usize
    };
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    (flags[0], body)
}

fn tcp_addr(endpoint: &str) -> String {
    endpoint.trim_start_matches("tcp://").to_string()
}

/// Whether the peer closed `s` (EOF or reset) before `deadline`.
fn closed_by_peer(s: &mut TcpStream, deadline: Instant) -> bool {
    let mut buf = [0u8; 256];
    while Instant::now() < deadline {
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

/// A real load still verifies on `producer` (it kept serving).
async fn a_load_verifies(producer: &Producer, c: &Side, request_id: &str) {
    producer
        .publish(
            request_id,
            vec![vec![Some(3), Some(5), Some(1)]],
            NUM_TOKENS,
        )
        .await
        .unwrap();
    // A place freed by a closed connection is given back once the producer has seen the close,
    // which a loaded machine may take a while to do: a connect refused at accept is tried again
    // (by a fresh consumer, which does not wait out a retry interval), by a deadline.
    let end = Instant::now() + Duration::from_secs(10);
    let out = loop {
        let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
        let r = consumer
            .load(LoadSpec {
                load_key: producer.load_key(request_id).await,
                ..spec_at(request_id, producer.endpoint(), None)
            })
            .await;
        match r {
            Err(LoadError::Connect { .. }) if Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            r => break r.unwrap(),
        }
    };
    assert!(out.verdict.unwrap().is_verified());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_40_gib_frame_header_before_the_handshake_drops_only_that_connection() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let addr = tcp_addr(producer.endpoint());
    let hostile = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&greeting()).unwrap();
        // Where READY is expected: one frame header declaring 40 GiB (the process aborted).
        s.write_all(&long_header(40 << 30)).unwrap();
        closed_by_peer(&mut s, Instant::now() + Duration::from_secs(10))
    })
    .await
    .unwrap();
    assert!(hostile, "the producer must drop the connection");
    a_load_verifies(&producer, &c, "after-40g").await;
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowly_streamed_8_gib_message_is_refused_at_its_header() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let addr = tcp_addr(producer.endpoint());
    let sent = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&greeting()).unwrap();
        s.write_all(&ready("DEALER")).unwrap();
        let mut g = [0u8; 64];
        s.read_exact(&mut g).unwrap();
        let (flags, body) = read_frame(&mut s);
        assert_eq!(flags & 0x04, 0x04, "the producer's READY");
        assert_eq!(&body[1..6], b"READY");
        s.write_all(&long_header(8 << 30)).unwrap();
        // Stream the body slowly; the producer must close before it pins much of it.
        let chunk = vec![0u8; 64 << 10];
        let mut sent = 0u64;
        let deadline = Instant::now() + Duration::from_secs(10);
        s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
        while Instant::now() < deadline {
            if s.write_all(&chunk).is_err() {
                return Some(sent);
            }
            sent += chunk.len() as u64;
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    })
    .await
    .unwrap();
    let sent = sent.expect("the producer must drop the connection before 10 s of streaming");
    assert!(sent < 64 << 20, "{sent} bytes went in before the drop");
    a_load_verifies(&producer, &c, "after-8g").await;
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_a_configured_limit_is_refused_and_one_under_it_served() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    // A real request is a few KiB: a 256-byte limit refuses it, the default serves it.
    let cfg = ProducerConfig {
        max_message_bytes: 256,
        ..producer_config()
    };
    let producer = Producer::start(cfg, p.workers.clone()).await.unwrap();
    producer
        .publish(
            "small-limit",
            vec![vec![Some(3), Some(5), Some(1)]],
            NUM_TOKENS,
        )
        .await
        .unwrap();
    let consumer = Consumer::new(
        ConsumerConfig {
            reply_timeout: Duration::from_secs(2),
            ..consumer_config()
        },
        c.workers.clone(),
    )
    .unwrap();
    let err = consumer
        .load(spec_at("small-limit", producer.endpoint(), None))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Failed {
                reason: FailReason::NoReply(_) | FailReason::ConnectionLost(_),
                ..
            }
        ),
        "{err:?}"
    );
    producer.shutdown().await;
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    assert_eq!(
        ProducerConfig::default().max_message_bytes,
        DEFAULT_MAX_ZMTP_MESSAGE
    );
    a_load_verifies(&producer, &c, "default-limit").await;
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_producer_cannot_crash_the_consumer() {
    let c = Side::new(1, 1, 12, Some(99));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&greeting()).unwrap();
        let mut g = [0u8; 64];
        s.read_exact(&mut g).unwrap();
        let _ready = read_frame(&mut s);
        s.write_all(&ready("ROUTER")).unwrap();
        let _hello = read_frame(&mut s);
        // The welcome: one frame header declaring 40 GiB (the consumer aborted).
        s.write_all(&long_header(40 << 30)).unwrap();
        closed_by_peer(&mut s, Instant::now() + Duration::from_secs(10))
    });
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    let err = consumer
        .load(spec_at("hostile", &endpoint, None))
        .await
        .unwrap_err();
    match &err {
        LoadError::Connect { why, .. } => {
            assert!(why.to_string().contains("maximum message size"), "{why}")
        }
        other => panic!("expected a lost connection, got {other:?}"),
    }
    assert!(
        fake.join().unwrap(),
        "the consumer must drop the connection"
    );
}

/// Greeting and READY done: a DEALER peer ready to send messages.
fn handshake(s: &mut TcpStream) {
    s.write_all(&greeting()).unwrap();
    s.write_all(&ready("DEALER")).unwrap();
    let mut g = [0u8; 64];
    s.read_exact(&mut g).unwrap();
    let (flags, body) = read_frame(s);
    assert_eq!(flags & 0x04, 0x04, "the producer's READY");
    assert_eq!(&body[1..6], b"READY");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_greeting_is_dropped_at_the_handshake_deadline() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let cfg = ProducerConfig {
        handshake_timeout: Duration::from_millis(1500),
        ..producer_config()
    };
    let producer = Producer::start(cfg, p.workers.clone()).await.unwrap();
    let addr = tcp_addr(producer.endpoint());
    let mut idle = connect_from("127.0.0.2", &addr).await.unwrap();
    let mut half = connect_from("127.0.0.2", &addr).await.unwrap();
    half.write_all(&greeting()[..10]).unwrap();
    let closed = tokio::task::spawn_blocking(move || {
        let until = Instant::now() + Duration::from_secs(5);
        (
            closed_by_peer(&mut idle, until),
            closed_by_peer(&mut half, until),
        )
    })
    .await
    .unwrap();
    assert_eq!(
        closed,
        (true, true),
        "(silent, half greeting) must be dropped"
    );
    a_load_verifies(&producer, &c, "after-half-greetings").await;
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_frame_is_dropped_at_the_frame_deadline() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let cfg = ProducerConfig {
        frame_timeout: Duration::from_millis(1500),
        ..producer_config()
    };
    let producer = Producer::start(cfg, p.workers.clone()).await.unwrap();
    let addr = tcp_addr(producer.endpoint());
    let mut s = connect_from("127.0.0.2", &addr).await.unwrap();
    let mut quiet = connect_from("127.0.0.2", &addr).await.unwrap();
    let closed = tokio::task::spawn_blocking(move || {
        handshake(&mut s);
        handshake(&mut quiet);
        // A 1 MiB frame, half of it sent, then nothing.
        s.write_all(&long_header(1 << 20)).unwrap();
        s.write_all(&vec![0u8; 512 << 10]).unwrap();
        let half = closed_by_peer(&mut s, Instant::now() + Duration::from_secs(5));
        // A connection idle between messages stays.
        let idle_kept = !closed_by_peer(&mut quiet, Instant::now() + Duration::from_secs(1));
        (half, idle_kept)
    })
    .await
    .unwrap();
    assert_eq!(
        closed,
        (true, true),
        "(half-sent frame dropped, idle connection kept)"
    );
    a_load_verifies(&producer, &c, "after-half-frame").await;
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_per_source_and_total_limits_are_closed_at_accept() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let cfg = ProducerConfig {
        max_connections: 12,
        max_connections_per_source: 5,
        handshake_timeout: Duration::from_secs(30),
        ..producer_config()
    };
    let producer = Producer::start(cfg, p.workers.clone()).await.unwrap();
    let addr = tcp_addr(producer.endpoint());
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(connect_from("127.0.0.2", &addr).await.unwrap());
    }
    let over_source = connect_from("127.0.0.2", &addr).await.unwrap();
    for _ in 0..5 {
        held.push(connect_from("127.0.0.3", &addr).await.unwrap());
    }
    // 10 held: one more source may take 2 places, then the total is reached.
    held.push(connect_from("127.0.0.4", &addr).await.unwrap());
    held.push(connect_from("127.0.0.4", &addr).await.unwrap());
    let over_total = connect_from("127.0.0.5", &addr).await.unwrap();
    let (closed, held) = tokio::task::spawn_blocking(move || {
        let until = || Instant::now() + Duration::from_secs(2);
        let (mut a, mut b) = (over_source, over_total);
        let closed = (
            closed_by_peer(&mut a, until()),
            closed_by_peer(&mut b, until()),
        );
        let open = held
            .iter()
            .filter(|s| {
                let mut s = (*s).try_clone().unwrap();
                !closed_by_peer(&mut s, Instant::now() + Duration::from_millis(50))
            })
            .count();
        (closed, (open, held))
    })
    .await
    .unwrap();
    assert_eq!(closed, (true, true), "(past per source, past total) closed");
    assert_eq!(held.0, 12, "the admitted connections stay");
    // Places free when connections close: a load from 127.0.0.1 then gets one.
    drop(held.1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    a_load_verifies(&producer, &c, "after-limits").await;
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_frames_of_all_connections_share_one_receive_budget() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let cfg = ProducerConfig {
        receive_budget_bytes: 5 << 20,
        frame_timeout: Duration::from_secs(30),
        ..producer_config()
    };
    let producer = Producer::start(cfg, p.workers.clone()).await.unwrap();
    let addr = tcp_addr(producer.endpoint());
    let mut conns = Vec::new();
    for i in 0..3 {
        conns.push(
            connect_from(&format!("127.0.0.{}", 2 + i), &addr)
                .await
                .unwrap(),
        );
    }
    let closed = tokio::task::spawn_blocking(move || {
        let mut closed = Vec::new();
        // Each declares 2 MiB (under the per-message cap) and sends half: 2 fit in 5 MiB.
        for s in &mut conns {
            handshake(s);
            // The refused one may be closed before all of it is written.
            let _ = s
                .write_all(&long_header(2 << 20))
                .and_then(|()| s.write_all(&vec![0u8; 1 << 20]));
        }
        for s in &mut conns {
            closed.push(closed_by_peer(
                s,
                Instant::now() + Duration::from_millis(700),
            ));
        }
        closed
    })
    .await
    .unwrap();
    assert_eq!(
        closed,
        vec![false, false, true],
        "the third frame does not fit"
    );
    // A small request is never charged: the load is served while the budget is spent.
    a_load_verifies(&producer, &c, "budget-spent").await;
    producer.shutdown().await;
}

/// A message nested deeper than any of the protocol's (a field holding a list in a list, 4096
/// deep) is refused as a bad message: the decoders bound the nesting far below what a
/// worker thread's stack holds (rmp-serde's own bound, 1024, overflowed a 2 MiB stack in a
/// debug build and aborted the producer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deeply_nested_message_is_refused_and_the_producer_keeps_serving() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let addr = tcp_addr(producer.endpoint());
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        handshake(&mut s);
        // {"version": 2, "kind": "transfer_request", "zzz": [[[[...nil...]]]]}
        let mut body = vec![0x83];
        for (k, v) in [("version", None), ("kind", Some("transfer_request"))] {
            body.push(0xa0 | k.len() as u8);
            body.extend_from_slice(k.as_bytes());
            match v {
                None => body.push(0x02),
                Some(v) => {
                    body.push(0xa0 | v.len() as u8);
                    body.extend_from_slice(v.as_bytes());
                }
            }
        }
        body.extend_from_slice(&[0xa3, b'z', b'z', b'z']);
        body.extend(std::iter::repeat_n(0x91u8, 4096));
        body.push(0xc0);
        let mut frame = vec![0x02];
        frame.extend_from_slice(&(body.len() as u64).to_be_bytes());
        frame.extend_from_slice(&body);
        s.write_all(&frame).unwrap();
        // The producer answers or not; it must not abort.
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut b = [0u8; 256];
        let _ = s.read(&mut b);
    })
    .await
    .unwrap();
    a_load_verifies(&producer, &c, "after-nest").await;
    producer.shutdown().await;
}
