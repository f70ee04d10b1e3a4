//! Fail fast when the producer is gone: once the control connection is lost and
//! connecting again fails, the loads queued behind that attempt fail at once with its reason
//! instead of one connect timeout each; a producer back on the same endpoint serves again.

mod common;

use std::time::{Duration, Instant};

use common::Side;
use kvferry_p2p::ProducerConfig;
use kvferry_p2p::{Consumer, ConsumerConfig, LoadError, LoadGroup, LoadSpec, Producer};

const NUM_TOKENS: u64 = 40;
const QUEUED: usize = 6;

fn spec(request_id: &str, producer: &str) -> LoadSpec {
    LoadSpec {
        request_id: request_id.into(),
        producer: producer.to_string(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: vec![Some(3), Some(5), Some(1)],
            local_blocks: vec![Some(7), Some(2), Some(10)],
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key: None,
    }
}

fn producer_config(bind: &str) -> ProducerConfig {
    ProducerConfig {
        bind: bind.to_string(),
        transfer_timeout: Duration::from_secs(10),
        ..ProducerConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_loads_fail_at_once_when_the_producer_is_gone() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let producer = Producer::start(producer_config("tcp://127.0.0.1:0"), p.workers.clone())
        .await
        .unwrap();
    let endpoint = producer.endpoint().to_string();
    let consumer = Consumer::new(
        ConsumerConfig {
            reply_timeout: Duration::from_secs(10),
            max_wait: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(2),
            send_timeout: Duration::from_secs(2),
            // Long enough that every queued load lands inside it.
            reconnect_interval: Duration::from_secs(30),
            ..ConsumerConfig::default()
        },
        c.workers.clone(),
    )
    .unwrap();
    producer
        .publish("first", vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
        .await
        .unwrap();
    let first = LoadSpec {
        load_key: producer.load_key("first").await,
        ..spec("first", &endpoint)
    };
    assert!(consumer.load(first).await.is_ok());

    producer.shutdown().await;
    // Let the consumer see the connection drop (a load sent before it would wait for its send);
    // generous for a loaded machine: no retry is due for 30 s.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let results = futures::future::join_all(
        (0..QUEUED).map(|i| consumer.load(spec(&format!("gone-{i}"), &endpoint))),
    )
    .await;
    let mut attempted = 0;
    let mut refused = 0;
    for r in &results {
        match r {
            Err(LoadError::Connect { why, .. })
                if why.to_string().starts_with("producer unreachable") =>
            {
                refused += 1
            }
            Err(_) => attempted += 1,
            Ok(out) => panic!("a load to a dead producer landed: {out:?}"),
        }
    }
    // One load tries to connect (and fails after its timeout); the ones queued behind it are
    // refused at once with that reason. Before the fix every load paid its own timeout.
    assert!(
        attempted <= 2,
        "{attempted} loads tried to connect: {results:?}"
    );
    assert_eq!(attempted + refused, QUEUED);
    assert!(refused >= QUEUED - 2, "{results:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_recovers_when_the_producer_returns() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let producer = Producer::start(producer_config("tcp://127.0.0.1:0"), p.workers.clone())
        .await
        .unwrap();
    let endpoint = producer.endpoint().to_string();
    let consumer = Consumer::new(
        ConsumerConfig {
            reply_timeout: Duration::from_secs(10),
            max_wait: Duration::from_secs(20),
            connect_timeout: Duration::from_millis(500),
            send_timeout: Duration::from_secs(2),
            // Long enough that the second load below reaches the connection before a retry
            // is due, even on a loaded machine.
            reconnect_interval: Duration::from_secs(2),
            ..ConsumerConfig::default()
        },
        c.workers.clone(),
    )
    .unwrap();
    producer.shutdown().await;
    // Down: the first load's connect fails, the next is refused at once with its reason.
    let first = consumer.load(spec("down-1", &endpoint)).await.unwrap_err();
    assert!(matches!(first, LoadError::Connect { .. }), "{first:?}");
    let second = consumer.load(spec("down-2", &endpoint)).await.unwrap_err();
    match &second {
        LoadError::Connect { why, .. } => {
            assert!(why.to_string().starts_with("producer unreachable"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    // Back on the same endpoint: within a bounded number of tries (each after the retry
    // interval) the same consumer loads again.
    let producer = Producer::start(producer_config(&endpoint), p.workers.clone())
        .await
        .unwrap();
    producer
        .publish("back", vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let out = loop {
        let back = LoadSpec {
            load_key: producer.load_key("back").await,
            ..spec("back", &endpoint)
        };
        match consumer.load(back).await {
            Ok(out) => break out,
            Err(LoadError::Connect { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(250)).await
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    assert!(out.verdict.unwrap().is_verified());
    producer.shutdown().await;
}
