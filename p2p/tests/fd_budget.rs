//! File descriptors do not follow consumers after they leave: under a low fd limit, a stream of
//! many more distinct consumers than the limit could hold at 3 fds each, each loading one
//! request and going away, all load and verify, and the producer's fd count stays flat. A
//! consumer's data connections go when its control connection closes (not after the idle
//! timeout), and the engines' peer cache is bounded by a budget from `RLIMIT_NOFILE`.
//!
//! The test lowers this process's own limit: it is alone in its test binary.

mod common;

use std::time::Duration;

use common::Side;
use kvferry_p2p::{Consumer, ConsumerConfig, LoadGroup, LoadSpec, Producer, ProducerConfig};

const NUM_TOKENS: u64 = 40;
const FD_LIMIT: u64 = 256;
const CONSUMERS: usize = 200;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn lower_fd_limit(to: u64) {
    let r = libc::rlimit {
        rlim_cur: to,
        rlim_max: to,
    };
    // SAFETY: setrlimit reads the struct it is given.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
}

fn spec(request_id: &str, producer: &Producer) -> LoadSpec {
    LoadSpec {
        request_id: request_id.into(),
        producer: producer.endpoint().to_string(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: vec![Some(3), Some(5), Some(1)],
            local_blocks: vec![Some(7), Some(2), Some(10)],
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key: producer.load_key(request_id),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_distinct_consumers_under_a_256_fd_limit_all_load() {
    lower_fd_limit(FD_LIMIT);
    let p = Side::new(1, 1, 8, Some(7));
    let producer = Producer::start(
        ProducerConfig {
            transfer_timeout: Duration::from_secs(10),
            ..ProducerConfig::default()
        },
        p.workers.clone(),
    )
    .await
    .unwrap();
    let mut fds = Vec::new();
    for i in 0..CONSUMERS {
        let rid = format!("r{i}");
        producer
            .publish(&rid, vec![vec![Some(3), Some(5), Some(1)]], NUM_TOKENS)
            .await
            .unwrap();
        let c = Side::new(1, 1, 12, None);
        let consumer = Consumer::new(
            ConsumerConfig {
                reply_timeout: Duration::from_secs(10),
                max_wait: Duration::from_secs(20),
                ..ConsumerConfig::default()
            },
            c.workers.clone(),
        )
        .unwrap();
        let out = consumer
            .load(spec(&rid, &producer))
            .await
            .unwrap_or_else(|e| {
                panic!("consumer {i} of {CONSUMERS}: {e} ({} fds open)", open_fds())
            });
        assert!(out.verdict.unwrap().is_verified(), "consumer {i}");
        drop(consumer);
        drop(c);
        fds.push(open_fds());
    }
    // Flat: the last consumers leave no more fds open than the first ones did.
    let early = *fds[..20].iter().max().unwrap();
    let late = *fds[CONSUMERS - 20..].iter().max().unwrap();
    assert!(
        late <= early + 16,
        "fds grew with consumers: {early} after the first 20, {late} at the end"
    );
    assert!(
        p.workers[0].engine.stats().cached_segments <= kvferry_transfer::fd_budget::peer_budget(12),
        "the peer cache holds more than its budget"
    );
    producer.shutdown().await;
}
