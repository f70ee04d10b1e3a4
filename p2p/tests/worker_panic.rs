//! A consumer checksum worker whose thread panics leaves the load unverified with a reason,
//! never a mismatch. Its own test binary: it runs apart from loopback.rs, whose
//! restart test is timing-sensitive under load.

mod common;

use std::sync::Arc;

use common::{consumer_config, producer_config, published_blocks, spec, Side, NUM_TOKENS};
use kvferry_checksum::policy::Action;
use kvferry_checksum::verdict::{UnverifiedReason, Verdict};
use kvferry_p2p::{Consumer, Producer};

/// The CPU backend's `test-tools` hook makes the thread of layer index 1 panic (two threads,
/// so one layer's thread panics while the other's values arrive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_worker_panic_is_unverified_not_mismatch() {
    let p = Side::new(1, 1, 8, Some(7));
    let mut c = Side::new(1, 1, 12, Some(99));
    c.workers[0].backend = Arc::new(kvferry_kernels::CpuBackend::new(2).panicking_at_layer(1));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    producer
        .publish("req-panic", published_blocks(), NUM_TOKENS)
        .await
        .unwrap();
    let out = consumer
        .load(spec("req-panic", &producer).await)
        .await
        .unwrap();
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
