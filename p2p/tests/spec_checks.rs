//! Specs checked before any byte moves (docs/design.md §4.5 "Checks", `proto::spec_checks`):
//! each load that cannot be right is refused with the reason and leaves the consumer's KV as
//! it was, on loopback with real engines.

mod common;

use std::time::Duration;

use common::Side;
use kvferry_p2p::proto::consumer::FailReason;
use kvferry_p2p::proto::spec_checks::TableError;
use kvferry_p2p::{Consumer, ConsumerConfig, LoadError, LoadGroup, LoadSpec, P2pError, Producer};
use kvferry_p2p::{ProducerConfig, PublishFailure};

const NUM_TOKENS: u64 = 40; // 3 blocks of 16

async fn spec(
    request_id: &str,
    producer: &Producer,
    local: Vec<Option<u64>>,
    tokens: u64,
) -> LoadSpec {
    LoadSpec {
        request_id: request_id.into(),
        producer: producer.endpoint().to_string(),
        groups: vec![LoadGroup {
            group_id: 0,
            remote_blocks: vec![Some(3), Some(5), Some(1)],
            local_blocks: local,
            remote_block_size: None,
        }],
        num_local_computed: 0,
        num_tokens: tokens,
        load_key: producer.load_key(request_id).await,
    }
}

fn producer_config() -> ProducerConfig {
    ProducerConfig {
        transfer_timeout: Duration::from_secs(10),
        ..ProducerConfig::default()
    }
}

fn consumer_config() -> ConsumerConfig {
    ConsumerConfig {
        reply_timeout: Duration::from_secs(10),
        max_wait: Duration::from_secs(20),
        ..ConsumerConfig::default()
    }
}

fn snapshot(c: &Side) -> Vec<Vec<u8>> {
    c.memory.iter().flatten().map(|b| b.to_vec()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_float16_producer_and_an_int16_consumer_move_no_byte() {
    let p = Side::new(1, 1, 8, Some(7));
    let mut c = Side::new(1, 1, 12, Some(99));
    // Same element size (2 bytes), another type: byte-for-byte copies would "work".
    for w in &mut c.workers {
        for g in &mut w.groups {
            for l in &mut g.layers {
                l.spec.dtype = Some("torch.int16".into());
            }
        }
    }
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    producer
        .publish("dtype", vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
        .await
        .unwrap();
    let before = snapshot(&c);
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    let err = consumer
        .load(
            spec(
                "dtype",
                &producer,
                vec![Some(7), Some(2), Some(10)],
                NUM_TOKENS,
            )
            .await,
        )
        .await
        .unwrap_err();
    match &err {
        LoadError::Failed {
            reason: FailReason::Producer(why),
            ..
        } => assert!(
            why.as_str()
                .contains("element type: producer torch.bfloat16, consumer torch.int16"),
            "{why}"
        ),
        other => panic!("expected the producer's refusal, got {other:?}"),
    }
    assert!(snapshot(&c) == before, "no byte may land");
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_local_blocks_are_refused_before_the_request() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    producer
        .publish("dup", vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
        .await
        .unwrap();
    let before = snapshot(&c);
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    let err = consumer
        .load(
            spec(
                "dup",
                &producer,
                vec![Some(5), Some(5), Some(5)],
                NUM_TOKENS,
            )
            .await,
        )
        .await
        .unwrap_err();
    match &err {
        LoadError::Spec { why, .. } => {
            assert!(
                matches!(
                    why,
                    kvferry_p2p::LoadSpecFault::Spec(
                        kvferry_p2p::proto::request::SpecError::Table(TableError::Duplicate {
                            block: 5,
                            ..
                        })
                    )
                ),
                "{why:?}"
            );
            assert!(
                why.to_string()
                    .contains("block 5 is written at positions 0 and 1"),
                "{why}"
            )
        }
        other => panic!("expected a spec error, got {other:?}"),
    }
    assert!(snapshot(&c) == before, "no byte may land");
    // The lease is still there for a right load.
    let out = consumer
        .load(
            spec(
                "dup",
                &producer,
                vec![Some(7), Some(2), Some(10)],
                NUM_TOKENS,
            )
            .await,
        )
        .await
        .unwrap();
    assert!(out.verdict.unwrap().is_verified());
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_must_cover_its_tokens_with_blocks_inside_the_cache() {
    let p = Side::new(1, 1, 8, Some(7));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    // One block for 2^63 tokens: the load of it reported `verified`.
    let short = producer
        .publish("short", vec![vec![Some(0)]], 1 << 63)
        .await
        .unwrap_err();
    assert!(
        matches!(&short, P2pError::Publish { why: PublishFailure::Table(TableError::Coverage { .. }), .. } if short.to_string().contains("need exactly")),
        "{short}"
    );
    // Block 8 of an 8-block cache.
    let outside = producer
        .publish("outside", vec![vec![Some(3), Some(8), Some(1)]], NUM_TOKENS)
        .await
        .unwrap_err();
    assert!(
        matches!(&outside, P2pError::Publish { why: PublishFailure::Table(TableError::Outside { block: 8, .. }), .. } if outside.to_string().contains("outside the cache")),
        "{outside}"
    );
    // A table longer than the tokens names blocks no token is in.
    assert!(producer
        .publish(
            "long",
            vec![vec![Some(3), Some(5), Some(1), Some(2)]],
            NUM_TOKENS
        )
        .await
        .is_err());
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_is_never_verified_for_tokens_no_block_holds() {
    let p = Side::new(1, 1, 8, Some(7));
    let c = Side::new(1, 1, 12, Some(99));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    producer
        .publish("tokens", vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
        .await
        .unwrap();
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    // 3 local blocks cannot hold 2^63 tokens; a local block id past the cache (12 blocks).
    for (local, tokens, text) in [
        (vec![Some(7), Some(2), Some(10)], 1u64 << 63, "need exactly"),
        (
            vec![Some(7), Some(2), Some(12)],
            NUM_TOKENS,
            "outside the cache",
        ),
        (vec![Some(7), Some(2)], NUM_TOKENS, "need exactly"),
    ] {
        let err = consumer
            .load(spec("tokens", &producer, local, tokens).await)
            .await
            .unwrap_err();
        match &err {
            LoadError::Spec { why, .. } => assert!(why.to_string().contains(text), "{why}"),
            other => panic!("expected a spec error, got {other:?}"),
        }
    }
    producer.shutdown().await;
}
