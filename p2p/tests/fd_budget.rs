//! File descriptors do not follow consumers after they leave. Two mechanisms, each with its own
//! test that fails without it:
//! - a consumer's data connections and cached descriptor go when its control connection
//!   closes or its session is evicted, not after the engine's idle timeout
//!   (`..._go_when_its_control_connection_closes`, `..._go_when_its_session_is_evicted`: the
//!   consumers' engines stay up, so only the producer's own bookkeeping can close them);
//! - the engines' peer cache is bounded by a budget from `RLIMIT_NOFILE`
//!   (`the_peer_cache_stays_within_its_fd_budget_while_consumers_stay`: the consumers keep
//!   their sessions, so only the budget can drop their connections).
//!
//! And both together: a stream of many more distinct consumers than the limit could hold at 3
//! fds each, each loading one request and going away, all load and verify, and the
//! producer's fd count stays flat.
//!
//! The tests lower this process's own fd limit (all to the same value): they are alone in
//! their binary, and run one at a time (they count fds and live engines).

mod common;

use std::time::{Duration, Instant};

use common::{
    consumer_config, lower_fd_limit, open_fds, producer_config, published_blocks, spec, Side,
    NUM_TOKENS,
};
use kvferry_p2p::{Consumer, Producer, ProducerConfig};
use kvferry_transfer::fd_budget::peer_budget;
use kvferry_transfer::{EngineStats, TransferEngine};

const FD_LIMIT: u64 = 256;
const CONSUMERS: usize = 200;
/// Fds a TCP peer costs in the budget (3 per connection, 4 connections per peer by default).
const FDS_PER_PEER: usize = 12;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Polls `engine`'s stats until `done` holds or 10 s pass; returns the last stats.
async fn stats_until(engine: &TransferEngine, done: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = engine.stats();
        if done(&s) || Instant::now() >= deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Publishes `rid` on `producer` and loads it with `consumer`; it must verify.
async fn load_verified(producer: &Producer, consumer: &Consumer, rid: &str) {
    producer
        .publish(rid, published_blocks(), NUM_TOKENS)
        .await
        .unwrap();
    let out = consumer
        .load(spec(rid, producer).await)
        .await
        .unwrap_or_else(|e| panic!("load {rid}: {e} ({} fds open)", open_fds()));
    assert!(out.verdict.unwrap().is_verified(), "load {rid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_data_connections_go_when_its_control_connection_closes() {
    let _one = ONE_AT_A_TIME.lock().await;
    lower_fd_limit(FD_LIMIT);
    let p = Side::new(1, 1, 8, Some(7));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let c = Side::new(1, 1, 12, None);
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    load_verified(&producer, &consumer, "r").await;
    let engine = &p.workers[0].engine;
    assert_eq!(
        engine.stats().cached_segments,
        1,
        "the load opened the consumer's segment"
    );
    // Its control connection closes; its engine (and so its data listener) stays up.
    drop(consumer);
    let s = stats_until(engine, |s| s.cached_segments == 0 && s.connections == 0).await;
    assert!(
        s.cached_segments == 0 && s.connections == 0,
        "the producer still holds {s:?} for a consumer whose control connection closed"
    );
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_data_connections_go_when_its_session_is_evicted() {
    let _one = ONE_AT_A_TIME.lock().await;
    lower_fd_limit(FD_LIMIT);
    let p = Side::new(1, 1, 8, Some(7));
    let producer = Producer::start(
        ProducerConfig {
            max_sessions: 1,
            ..producer_config()
        },
        p.workers.clone(),
    )
    .await
    .unwrap();
    let (cx, cy) = (Side::new(1, 1, 12, None), Side::new(1, 1, 12, None));
    let x = Consumer::new(consumer_config(), cx.workers.clone()).unwrap();
    let y = Consumer::new(consumer_config(), cy.workers.clone()).unwrap();
    // Else the peer budget, not the eviction, could be what drops x's connections.
    assert!(
        peer_budget(FDS_PER_PEER) >= 2,
        "the budget holds both consumers"
    );
    load_verified(&producer, &x, "rx").await;
    // y's hello evicts x's session (one session at most); both stay connected.
    load_verified(&producer, &y, "ry").await;
    let engine = &p.workers[0].engine;
    let s = stats_until(engine, |s| s.cached_segments == 1 && s.peers == 1).await;
    assert!(
        s.cached_segments == 1 && s.peers == 1,
        "the producer still holds {s:?}: the evicted consumer's segment is one of them"
    );
    drop((x, y));
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_cache_stays_within_its_fd_budget_while_consumers_stay() {
    let _one = ONE_AT_A_TIME.lock().await;
    lower_fd_limit(FD_LIMIT);
    let p = Side::new(1, 1, 8, Some(7));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let engine = &p.workers[0].engine;
    // Each consumer keeps its control session (and its engine: one more engine sharing the
    // process's fds, so the budget per engine shrinks as they come).
    let mut staying = Vec::new();
    for i in 0..8 {
        let c = Side::new(1, 1, 12, None);
        let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
        load_verified(&producer, &consumer, &format!("r{i}")).await;
        let (s, budget) = (engine.stats(), peer_budget(FDS_PER_PEER));
        assert!(
            s.cached_segments <= budget && s.peers <= budget,
            "consumer {i}: the producer holds {s:?}, over its budget of {budget} peers"
        );
        staying.push((consumer, c));
    }
    assert!(
        peer_budget(FDS_PER_PEER) < 8,
        "the budget is what bounds the cache"
    );
    drop(staying);
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_distinct_consumers_under_a_256_fd_limit_all_load() {
    let _one = ONE_AT_A_TIME.lock().await;
    lower_fd_limit(FD_LIMIT);
    let p = Side::new(1, 1, 8, Some(7));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let mut fds = Vec::new();
    for i in 0..CONSUMERS {
        let c = Side::new(1, 1, 12, None);
        let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
        load_verified(&producer, &consumer, &format!("r{i}")).await;
        drop(consumer);
        drop(c);
        // The producer closes a departed consumer's connections on its own time: a sample
        // taken before that (a loaded machine) would count them as growth.
        stats_until(&p.workers[0].engine, |s| {
            s.cached_segments == 0 && s.connections == 0
        })
        .await;
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
        p.workers[0].engine.stats().cached_segments <= peer_budget(FDS_PER_PEER),
        "the peer cache holds more than its budget"
    );
    producer.shutdown().await;
}
