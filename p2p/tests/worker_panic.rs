//! A consumer checksum worker whose thread panics leaves the load unverified with a reason,
//! never a mismatch. Its own test binary: it runs apart from loopback.rs, whose
//! restart test is timing-sensitive under load.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::Side;
use kvferry_checksum::policy::{Action, Policy};
use kvferry_checksum::verdict::{UnverifiedReason, Verdict};
use kvferry_p2p::{Consumer, ConsumerConfig, LoadGroup, LoadSpec, Producer, ProducerConfig};

const NUM_TOKENS: u64 = 40;

/// The CPU backend's `test-tools` hook makes the thread of layer index 1 panic (two threads,
/// so one layer's thread panics while the other's values arrive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_worker_panic_is_unverified_not_mismatch() {
    let p = Side::new(1, 1, 8, Some(7));
    let mut c = Side::new(1, 1, 12, Some(99));
    c.workers[0].backend = Arc::new(kvferry_kernels::CpuBackend::new(2).panicking_at_layer(1));
    let producer = Producer::start(
        ProducerConfig {
            transfer_timeout: Duration::from_secs(10),
            ..ProducerConfig::default()
        },
        p.workers.clone(),
    )
    .await
    .unwrap();
    let consumer = Consumer::new(
        ConsumerConfig {
            policy: Policy::default(),
            reply_timeout: Duration::from_secs(10),
            max_wait: Duration::from_secs(20),
            ..ConsumerConfig::default()
        },
        c.workers.clone(),
    )
    .unwrap();
    producer
        .publish(
            "req-panic",
            vec![vec![Some(3), Some(5), Some(1)]],
            NUM_TOKENS,
        )
        .await
        .unwrap();
    let spec = LoadSpec {
        request_id: "req-panic".into(),
        producer: producer.endpoint().to_string(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: vec![Some(3), Some(5), Some(1)],
            local_blocks: vec![Some(7), Some(2), Some(10)],
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key: producer.load_key("req-panic"),
    };
    let out = consumer.load(spec).await.unwrap();
    assert_eq!(
        out.verdict,
        Some(Verdict::Unverified(vec![(
            None,
            UnverifiedReason::NotEveryWorkerReported
        )]))
    );
    assert_eq!(out.action, Action::Complete);
    producer.shutdown().await;
}
