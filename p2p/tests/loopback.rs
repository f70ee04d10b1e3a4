//! Producer and consumer in one process over real loopback sockets (ZeroMQ
//! control channel + TCP transfer engine), small KV caches, TP1 / TP2 / PP2.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Side, BLOCK};
use kvferry_checksum::policy::{Action, LoadFailurePolicy, Policy};
use kvferry_checksum::verdict::{UnverifiedReason, Verdict};
use kvferry_p2p::proto::consumer::FailReason;
use kvferry_p2p::{
    Consumer, ConsumerConfig, Landed, LoadError, LoadGroup, LoadSpec, Producer, ProducerConfig,
    ProducerTimeouts, ReleaseReason,
};

const PRODUCER_BLOCKS: u64 = 8;
const CONSUMER_BLOCKS: u64 = 12;

fn producer_config() -> ProducerConfig {
    ProducerConfig {
        transfer_timeout: Duration::from_secs(10),
        ..ProducerConfig::default()
    }
}

fn consumer_config(policy: Policy) -> ConsumerConfig {
    ConsumerConfig {
        policy,
        reply_timeout: Duration::from_secs(10),
        max_wait: Duration::from_secs(20),
        ..ConsumerConfig::default()
    }
}

fn fail_closed(load_failure: LoadFailurePolicy) -> Policy {
    Policy {
        fail_closed: true,
        load_failure,
    }
}

/// 40 tokens in 3 blocks on both sides, at different block ids.
const NUM_TOKENS: u64 = 40;
fn remote_table() -> Vec<Option<u64>> {
    vec![Some(3), Some(5), Some(1)]
}
fn local_table() -> Vec<Option<u64>> {
    vec![Some(7), Some(2), Some(10)]
}

struct Pair {
    producer: Producer,
    consumer: Consumer,
    p: Side,
    c: Side,
}

async fn pair(tp: u32, pp: u32, pcfg: ProducerConfig, policy: Policy) -> Pair {
    let p = Side::new(tp, pp, PRODUCER_BLOCKS, Some(7));
    let c = Side::new(tp, pp, CONSUMER_BLOCKS, Some(99));
    let producer = Producer::start(pcfg, p.workers.clone()).await.unwrap();
    let consumer = Consumer::new(consumer_config(policy), c.workers.clone()).unwrap();
    Pair {
        producer,
        consumer,
        p,
        c,
    }
}

async fn spec(request_id: &str, producer: &Producer) -> LoadSpec {
    LoadSpec {
        request_id: request_id.into(),
        producer: producer.endpoint().to_string(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: remote_table(),
            local_blocks: local_table(),
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key: producer.load_key(request_id).await,
    }
}

/// Every landed block equals the producer's, on every rank and layer.
fn assert_blocks_landed(pair: &Pair) {
    for rank in 0..pair.p.workers.len() {
        for layer in 0..pair.p.memory[rank].len() {
            for (r, l) in remote_table().iter().zip(local_table()) {
                assert_eq!(
                    pair.p.block_bytes(rank, layer, r.unwrap()),
                    pair.c.block_bytes(rank, layer, l.unwrap()),
                    "rank {rank} layer {layer} block {r:?} → {l:?}"
                );
            }
        }
    }
}

async fn load_verifies(tp: u32, pp: u32) {
    let pair = pair(tp, pp, producer_config(), Policy::default()).await;
    let info = pair
        .producer
        .publish("req-1", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    assert!(info.checksummed, "{info:?}");
    // Before the load, the consumer's blocks differ from the producer's.
    assert_ne!(pair.p.block_bytes(0, 0, 3), pair.c.block_bytes(0, 0, 7));
    let out = pair
        .consumer
        .load(spec("req-1", &pair.producer).await)
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    assert_eq!(out.action, Action::Complete);
    let per_rank_layer = 3 * 2 * BLOCK * (common::KV_HEADS / tp as u64) * common::HEAD_DIM * 2;
    let layers_per_rank = common::LAYERS as u64 / pp as u64;
    assert_eq!(
        out.bytes,
        per_rank_layer * layers_per_rank * (tp * pp) as u64
    );
    assert_blocks_landed(&pair);
    assert_eq!(pair.producer.released()[0].reason, ReleaseReason::Served);
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp1_load_verifies() {
    load_verifies(1, 1).await;
}

/// A load's future can be sent to another thread: an embedder (the demo with loads in flight, a
/// connector starting a load per scheduled request) spawns each load on a task of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_runs_on_a_spawned_task() {
    let pair = pair(1, 1, producer_config(), Policy::default()).await;
    pair.producer
        .publish("req-1", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let spec = spec("req-1", &pair.producer).await;
    let consumer = Arc::new(pair.consumer);
    let task = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.load(spec).await }
    });
    let out = task.await.unwrap().unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp2_load_verifies() {
    load_verifies(2, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pp2_load_verifies() {
    load_verifies(1, 2).await;
}

/// Flips one bit of the landed KV (rank `rank`, layer 0, position 1, token 3) in the hook.
fn flip_bit_hook(pair: &Pair, rank: usize) {
    let addr = pair.c.token_addr(rank, 0, local_table()[1].unwrap(), 3);
    pair.consumer
        .set_landed_hook(Some(Arc::new(move |landed: &Landed| {
            assert_eq!(landed.groups[0].local_blocks, vec![7, 2, 10]);
            // SAFETY: addr is inside the consumer's layer array, which the test keeps alive.
            unsafe { *(addr as *mut u8) ^= 0x10 };
        })));
}

async fn corrupted_load(policy: Policy, tp: u32) -> (Verdict, Action) {
    let pair = pair(tp, 1, producer_config(), policy).await;
    pair.producer
        .publish("req-c", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    flip_bit_hook(&pair, tp as usize - 1);
    let out = pair
        .consumer
        .load(spec("req-c", &pair.producer).await)
        .await
        .unwrap();
    pair.producer.shutdown().await;
    (out.verdict.unwrap(), out.action)
}

fn assert_mismatch_at_position_1(v: &Verdict) {
    match v {
        Verdict::Mismatch { mismatches, .. } => {
            assert_eq!(mismatches.len(), 1);
            assert_eq!(mismatches[0].group_id, 0);
            assert_eq!(mismatches[0].positions, vec![1]);
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bit_fail_open_completes_with_mismatch() {
    let (v, a) = corrupted_load(Policy::default(), 1).await;
    assert_mismatch_at_position_1(&v);
    assert_eq!(a, Action::Complete);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bit_on_tp_rank_1_fail_closed_fails() {
    let (v, a) = corrupted_load(fail_closed(LoadFailurePolicy::Fail), 2).await;
    assert_mismatch_at_position_1(&v);
    assert_eq!(a, Action::Fail);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bit_fail_closed_recompute() {
    let (v, a) = corrupted_load(fail_closed(LoadFailurePolicy::Recompute), 1).await;
    assert_mismatch_at_position_1(&v);
    assert_eq!(a, Action::Recompute);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bit_in_local_prefix_is_not_compared() {
    // The consumer holds the first block (16 tokens) already: position 0 is neither
    // loaded nor compared, so corrupting it changes nothing; position 1 still verifies.
    let pair = pair(1, 1, producer_config(), Policy::default()).await;
    pair.producer
        .publish("req-p", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let addr = pair.c.token_addr(0, 0, 7, 0);
    let before = pair.c.block_bytes(0, 0, 7);
    pair.consumer
        .set_landed_hook(Some(Arc::new(move |l: &Landed| {
            assert_eq!(l.groups[0].positions, vec![1, 2]);
            // SAFETY: `addr` is a byte inside a live buffer of the consumer side, written by no
            // one else now.
            unsafe { *(addr as *mut u8) ^= 1 };
        })));
    let mut s = spec("req-p", &pair.producer).await;
    s.num_local_computed = BLOCK;
    let out = pair.consumer.load(s).await.unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    // Block 7 (position 0) was not written by the load.
    let mut after = pair.c.block_bytes(0, 0, 7);
    after[0] ^= 1;
    assert_eq!(after, before);
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_payload_is_unverified() {
    let pcfg = ProducerConfig {
        checksums: false,
        ..producer_config()
    };
    for (policy, action) in [
        (Policy::default(), Action::Complete),
        (fail_closed(LoadFailurePolicy::Recompute), Action::Recompute),
    ] {
        let pair = pair(1, 1, pcfg.clone(), policy).await;
        let info = pair
            .producer
            .publish("req-n", vec![remote_table()], NUM_TOKENS)
            .await
            .unwrap();
        assert!(!info.checksummed);
        let out = pair
            .consumer
            .load(spec("req-n", &pair.producer).await)
            .await
            .unwrap();
        assert_eq!(
            out.verdict,
            Some(Verdict::Unverified(vec![(
                None,
                UnverifiedReason::NoChecksums
            )]))
        );
        assert_eq!(out.action, action);
        assert_blocks_landed(&pair);
        pair.producer.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_load_of_a_request_gets_error() {
    let pair = pair(1, 1, producer_config(), Policy::default()).await;
    pair.producer
        .publish("req-2", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    pair.consumer
        .load(spec("req-2", &pair.producer).await)
        .await
        .unwrap();
    let err = pair
        .consumer
        .load(spec("req-2", &pair.producer).await)
        .await
        .unwrap_err();
    match &err {
        LoadError::Failed {
            reason: FailReason::Producer(why),
            ..
        } => assert!(why.as_str().contains("already loaded"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        err.action(&fail_closed(LoadFailurePolicy::Recompute)),
        Action::Recompute
    );
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lease_gets_error_and_is_released() {
    let pcfg = ProducerConfig {
        timeouts: ProducerTimeouts {
            lease: Duration::from_millis(200),
            ..ProducerTimeouts::default()
        },
        ..producer_config()
    };
    let pair = pair(1, 1, pcfg, Policy::default()).await;
    pair.producer
        .publish("req-e", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let before = pair.c.block_bytes(0, 0, 7);
    // The producer's timer runs late on a loaded machine: wait for the release, by a deadline.
    // (`released` hands over what it returns.)
    let end = std::time::Instant::now() + Duration::from_secs(10);
    let mut released = pair.producer.released();
    while released.is_empty() && std::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
        released = pair.producer.released();
    }
    assert_eq!(released[0].reason, ReleaseReason::Expired);
    let err = pair
        .consumer
        .load(spec("req-e", &pair.producer).await)
        .await
        .unwrap_err();
    match &err {
        LoadError::Failed {
            reason: FailReason::Producer(why),
            ..
        } => assert!(why.as_str().contains("lease expired"), "{why}"),
        other => panic!("{other:?}"),
    }
    // No stale block was written.
    assert_eq!(pair.c.block_bytes(0, 0, 7), before);
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_before_publish_waits_for_it() {
    let pair = pair(1, 1, producer_config(), Policy::default()).await;
    let (producer, consumer) = (&pair.producer, &pair.consumer);
    let load = consumer.load(LoadSpec {
        load_key: Some("key-req-w".into()),
        ..spec("req-w", producer).await
    });
    let publish = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        producer
            .publish_with_key("req-w", vec![remote_table()], NUM_TOKENS, "key-req-w")
            .await
            .unwrap()
    };
    let (out, _) = tokio::join!(load, publish);
    assert_eq!(out.unwrap().verdict, Some(Verdict::Verified));
    assert_blocks_landed(&pair);
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_producer_block_id_is_refused_and_the_lease_stays_for_a_fitting_load() {
    let pair = pair(1, 1, producer_config(), Policy::default()).await;
    pair.producer
        .publish("req-b", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let mut s = spec("req-b", &pair.producer).await;
    s.groups[0].remote_blocks[1] = Some(4);
    let err = pair.consumer.load(s).await.unwrap_err();
    assert!(
        matches!(&err, LoadError::Failed { reason: FailReason::LeaseMismatch(w), .. }
            if w.as_str().contains("position 1: consumer expects producer block 4, the producer holds block 5")),
        "{err}"
    );
    // Refused before any byte moved: the lease stays for a consumer whose request fits.
    assert!(pair.producer.released().is_empty());
    let out = pair
        .consumer
        .load(spec("req-b", &pair.producer).await)
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    assert_blocks_landed(&pair);
    assert_eq!(pair.producer.released()[0].reason, ReleaseReason::Served);
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_producer_fails_within_the_reply_deadline() {
    use kvferry_p2p::proto::msg::{
        decode_consumer_message, encode, ConsumerMessage, Welcome, KIND_WELCOME, PROTOCOL_VERSION,
    };
    use zeromq::{Socket, SocketRecv, SocketSend};
    // A ROUTER that opens sessions, takes requests and never answers them: a lost reply.
    let mut router = zeromq::RouterSocket::new();
    let endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let sink = tokio::spawn(async move {
        while let Ok(m) = router.recv().await {
            let frames = m.into_vec();
            if let Ok(ConsumerMessage::Hello(_)) = decode_consumer_message(frames.last().unwrap()) {
                let w = Welcome {
                    version: PROTOCOL_VERSION,
                    kind: KIND_WELCOME.into(),
                    nonce: vec![1; 32],
                    proof: None,
                    error: None,
                    reads: false,
                };
                let mut msg = zeromq::ZmqMessage::from(frames[0].clone());
                msg.push_back(encode(&w).into());
                let _ = router.send(msg).await;
            }
        }
    });
    let c = Side::new(1, 1, CONSUMER_BLOCKS, None);
    let cfg = ConsumerConfig {
        reply_timeout: Duration::from_millis(500),
        ..consumer_config(Policy::default())
    };
    let consumer = Consumer::new(cfg, c.workers.clone()).unwrap();
    let mut s = LoadSpec {
        request_id: "req-s".into(),
        producer: endpoint,
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: remote_table(),
            local_blocks: local_table(),
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key: None,
    };
    let started = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(10), consumer.load(s.clone()))
        .await
        .expect("load hung")
        .unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Failed {
                reason: FailReason::NoReply(_),
                ..
            }
        ),
        "{err}"
    );
    assert!(started.elapsed() >= Duration::from_millis(500));
    sink.abort();
    // Nobody listens any more: the next load fails with a clear reason too, within its deadlines.
    s.request_id = "req-s2".into();
    let err = tokio::time::timeout(Duration::from_secs(20), consumer.load(s))
        .await
        .expect("load hung")
        .unwrap_err();
    assert!(
        matches!(err, LoadError::Connect { .. } | LoadError::Failed { .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_producer_fails_the_load_and_a_restarted_one_is_reached() {
    let p = Side::new(1, 1, PRODUCER_BLOCKS, Some(7));
    let c = Side::new(1, 1, CONSUMER_BLOCKS, Some(99));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let endpoint = producer.endpoint().to_string();
    let cfg = ConsumerConfig {
        reply_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(1),
        ..consumer_config(Policy::default())
    };
    let consumer = Consumer::new(cfg, c.workers.clone()).unwrap();
    producer
        .publish("r1", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    consumer.load(spec("r1", &producer).await).await.unwrap();
    // The producer dies with a request published: the load fails, within its deadline.
    producer
        .publish("r2", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    producer.shutdown().await;
    let mut s = LoadSpec {
        producer: endpoint.clone(),
        ..spec_for("r2", &endpoint)
    };
    let started = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(10), consumer.load(s.clone()))
        .await
        .expect("load hung")
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    eprintln!("dead producer: {err}");
    // The dead producer may have failed the load either by a lost connection or by a failed
    // reconnect (which side of that race depends on how fast its sockets close); after a failed
    // connect the consumer fails fast for its retry interval (1 s), so wait that out.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // A new producer on the same endpoint: the consumer rebuilds its socket and loads.
    let producer = Producer::start(
        ProducerConfig {
            bind: endpoint.clone(),
            ..producer_config()
        },
        p.workers.clone(),
    )
    .await
    .unwrap();
    producer
        .publish("r3", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    s.request_id = "r3".into();
    s.load_key = producer.load_key("r3").await;
    let out = consumer.load(s).await.unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    producer.shutdown().await;
}

fn spec_for(request_id: &str, endpoint: &str) -> LoadSpec {
    LoadSpec {
        request_id: request_id.into(),
        producer: endpoint.into(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: remote_table(),
            local_blocks: local_table(),
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_without_carrier_is_refused_at_startup() {
    let c = Side::new(1, 1, CONSUMER_BLOCKS, None);
    let cfg = ConsumerConfig {
        carrier: false,
        ..consumer_config(fail_closed(LoadFailurePolicy::Fail))
    };
    assert!(matches!(
        Consumer::new(cfg, c.workers.clone()),
        Err(kvferry_p2p::P2pError::Config(
            kvferry_p2p::ConfigFault::NoCarrier(_)
        ))
    ));
    let cfg = ConsumerConfig {
        carrier: false,
        ..consumer_config(Policy::default())
    };
    assert!(!Consumer::new(cfg, c.workers.clone())
        .unwrap()
        .checksums_enabled());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_a_waiting_load_alive_past_the_silence_deadline() {
    let pcfg = ProducerConfig {
        timeouts: ProducerTimeouts {
            heartbeat: Duration::from_millis(200),
            ..ProducerTimeouts::default()
        },
        ..producer_config()
    };
    let p = Side::new(1, 1, PRODUCER_BLOCKS, Some(7));
    let c = Side::new(1, 1, CONSUMER_BLOCKS, Some(99));
    let producer = Producer::start(pcfg, p.workers.clone()).await.unwrap();
    let cfg = ConsumerConfig {
        // Beats every 200 ms keep it alive with room for a stalled runtime on a loaded
        // machine; the publish comes twice the silence deadline later.
        reply_timeout: Duration::from_millis(1500),
        ..consumer_config(Policy::default())
    };
    let consumer = Consumer::new(cfg, c.workers.clone()).unwrap();
    let load = consumer.load(LoadSpec {
        load_key: Some("key-req-h".into()),
        ..spec("req-h", &producer).await
    });
    let publish = async {
        tokio::time::sleep(Duration::from_millis(3000)).await;
        producer
            .publish_with_key("req-h", vec![remote_table()], NUM_TOKENS, "key-req-h")
            .await
            .unwrap()
    };
    let (out, _) = tokio::join!(load, publish);
    assert_eq!(out.unwrap().verdict, Some(Verdict::Verified));
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_protocol_version_gets_a_clear_error_reply() {
    use bytes::Bytes;
    use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};
    let p = Side::new(1, 1, PRODUCER_BLOCKS, Some(7));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    #[derive(serde::Serialize)]
    struct Future {
        version: u32,
        kind: &'static str,
        request_id: &'static str,
        load_id: u64,
        something_new: bool,
    }
    let body = rmp_serde::to_vec_named(&Future {
        version: 9,
        kind: "transfer_request",
        request_id: "req-v",
        load_id: 77,
        something_new: true,
    })
    .unwrap();
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(producer.endpoint()).await.unwrap();
    dealer
        .send(ZmqMessage::from(Bytes::from(body)))
        .await
        .unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
        .await
        .expect("no reply")
        .unwrap();
    let reply = kvferry_p2p::proto::msg::decode_reply(reply.get(reply.len() - 1).unwrap()).unwrap();
    assert_eq!(reply.status(), kvferry_p2p::proto::msg::Status::Error);
    assert_eq!((reply.request_id.as_str(), reply.load_id), ("req-v", 77));
    assert!(reply.error.unwrap().contains("version"));
    producer.shutdown().await;
}

/// A backend that always fails: a worker that does not report.
struct BrokenBackend;
impl kvferry_kernels::ChecksumBackend for BrokenBackend {
    fn name(&self) -> &'static str {
        "broken"
    }
    unsafe fn submit(
        &self,
        _jobs: Vec<kvferry_kernels::GroupJob>,
    ) -> Result<kvferry_kernels::PendingChecksums, kvferry_kernels::KernelError> {
        Err(kvferry_kernels::KernelError::NoThread(
            std::io::ErrorKind::OutOfMemory,
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_worker_not_reporting_sends_no_checksums() {
    let mut p = Side::new(2, 1, PRODUCER_BLOCKS, Some(7));
    let c = Side::new(2, 1, CONSUMER_BLOCKS, Some(99));
    p.workers[1].backend = Arc::new(BrokenBackend);
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let consumer = Consumer::new(consumer_config(Policy::default()), c.workers.clone()).unwrap();
    let info = producer
        .publish("req-x", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    assert!(!info.checksummed);
    assert!(info.warning.unwrap().contains("not every worker reported"));
    let out = consumer.load(spec("req-x", &producer).await).await.unwrap();
    assert_eq!(
        out.verdict,
        Some(Verdict::Unverified(vec![(
            None,
            UnverifiedReason::NoChecksums
        )]))
    );
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_worker_not_reporting_is_unverified() {
    let p = Side::new(2, 1, PRODUCER_BLOCKS, Some(7));
    let mut c = Side::new(2, 1, CONSUMER_BLOCKS, Some(99));
    c.workers[0].backend = Arc::new(BrokenBackend);
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let consumer = Consumer::new(
        consumer_config(fail_closed(LoadFailurePolicy::Fail)),
        c.workers.clone(),
    )
    .unwrap();
    producer
        .publish("req-y", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let out = consumer.load(spec("req-y", &producer).await).await.unwrap();
    assert_eq!(
        out.verdict,
        Some(Verdict::Unverified(vec![(
            None,
            UnverifiedReason::NotEveryWorkerReported
        )]))
    );
    assert_eq!(out.action, Action::Fail);
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_errors_are_clear() {
    let p = Side::new(1, 1, PRODUCER_BLOCKS, Some(7));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    producer
        .publish("dup", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let e = producer
        .publish("dup", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("already published"), "{e}");
    assert!(
        matches!(
            &e,
            kvferry_p2p::P2pError::Publish {
                why: kvferry_p2p::PublishFailure::Refused(
                    kvferry_p2p::proto::producer::PublishError::Duplicate(id)
                ),
                ..
            } if id == "dup"
        ),
        "{e:?}"
    );
    let e = producer
        .publish("no-groups", vec![], NUM_TOKENS)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no block table for group 0"), "{e}");
    assert!(
        matches!(
            &e,
            kvferry_p2p::P2pError::Publish {
                why: kvferry_p2p::PublishFailure::NoTable(0),
                ..
            }
        ),
        "{e:?}"
    );
    let e = producer
        .publish_with_key("empty-key", vec![remote_table()], NUM_TOKENS, "")
        .await
        .unwrap_err();
    assert!(
        matches!(
            &e,
            kvferry_p2p::P2pError::Publish {
                why: kvferry_p2p::PublishFailure::KeyLength { bytes: 0, .. },
                ..
            }
        ),
        "{e:?}"
    );
    producer.shutdown().await;
}

/// A control endpoint that cannot be bound is a `Bind` error whose cause is the socket's own
/// error, reachable through `source()`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbindable_endpoint_keeps_the_sockets_error() {
    use std::error::Error as _;
    let p = Side::new(1, 1, PRODUCER_BLOCKS, None);
    let e = Producer::start(
        ProducerConfig {
            bind: "tcp://203.0.113.1:1".into(),
            ..producer_config()
        },
        p.workers.clone(),
    )
    .await
    .err()
    .expect("an address of no local interface is not bound");
    let kvferry_p2p::P2pError::Bind { endpoint, why } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(endpoint, "tcp://203.0.113.1:1");
    let kvferry_p2p::BindFailure::Socket(socket) = why else {
        panic!("{why:?}")
    };
    let below = socket.source().expect("the socket's error");
    assert!(
        below.downcast_ref::<zeromq::ZmqError>().is_some(),
        "{below:?}"
    );
}

/// A stream given to publish orders nothing on host-memory workers (no stream writes their KV):
/// the load verifies as without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_after_a_stream_with_host_workers_verifies() {
    let pair = pair(1, 1, producer_config(), Policy::default()).await;
    // SAFETY: 0 is the legacy default stream; host workers never use it.
    let info = unsafe {
        pair.producer
            .publish_after_stream("s", vec![remote_table()], NUM_TOKENS, "key-s", 0)
    }
    .await
    .unwrap();
    assert!(info.checksummed, "{info:?}");
    let out = pair
        .consumer
        .load(spec("s", &pair.producer).await)
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    assert_blocks_landed(&pair);
    pair.producer.shutdown().await;
}

/// Two groups: full attention (`KV B N H D`) and a sliding window of 16 tokens in
/// the FlashInfer layout (`B KV N H D`) whose first block is out of the window
/// (a null block on both sides). A flipped bit in the window group's last block
/// is a mismatch there, and only there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_group_with_null_blocks() {
    for corrupt in [false, true] {
        let p = common::Side::with_window(2, 1, PRODUCER_BLOCKS, Some(5));
        let c = common::Side::with_window(2, 1, CONSUMER_BLOCKS, Some(6));
        let producer = Producer::start(producer_config(), p.workers.clone())
            .await
            .unwrap();
        let consumer =
            Consumer::new(consumer_config(Policy::default()), c.workers.clone()).unwrap();
        let window_remote = vec![None, Some(4), Some(6)];
        let window_local = vec![None, Some(8), Some(11)];
        producer
            .publish(
                "req-sw",
                vec![remote_table(), window_remote.clone()],
                NUM_TOKENS,
            )
            .await
            .unwrap();
        if corrupt {
            let addr = c.group_token_addr(1, 1, 1, 11, 5);
            consumer.set_landed_hook(Some(Arc::new(move |l: &Landed| {
                assert_eq!(l.groups[1].positions, vec![1, 2]);
                // SAFETY: `addr` is a byte inside a live buffer of the consumer side, written by
                // no one else now.
                unsafe { *(addr as *mut u8) ^= 0x80 };
            })));
        }
        let mut s = spec("req-sw", &producer).await;
        s.groups.push(LoadGroup {
            remote_block_size: None,
            group_id: 1,
            remote_blocks: window_remote,
            local_blocks: window_local,
        });
        let out = consumer.load(s).await.unwrap();
        if corrupt {
            match out.verdict.unwrap() {
                Verdict::Mismatch {
                    mismatches,
                    unverified,
                } => {
                    assert_eq!(mismatches.len(), 1);
                    assert_eq!(
                        (mismatches[0].group_id, mismatches[0].positions.clone()),
                        (1, vec![2])
                    );
                    assert!(unverified.is_empty());
                }
                other => panic!("{other:?}"),
            }
        } else {
            assert_eq!(out.verdict, Some(Verdict::Verified));
            for rank in 0..2 {
                for layer in 0..2 {
                    for (r, l) in [(4, 8), (6, 11)] {
                        assert_eq!(
                            p.group_block_bytes(rank, 1, layer, r),
                            c.group_block_bytes(rank, 1, layer, l)
                        );
                    }
                }
            }
        }
        producer.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_dying_during_a_load_fails_it_promptly() {
    let p = Side::new(1, 1, PRODUCER_BLOCKS, Some(7));
    let c = Side::new(1, 1, CONSUMER_BLOCKS, Some(99));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let cfg = ConsumerConfig {
        reply_timeout: Duration::from_secs(5),
        ..consumer_config(Policy::default())
    };
    let consumer = Consumer::new(cfg, c.workers.clone()).unwrap();
    let s = spec("never-published", &producer).await;
    // Connected first, so that the producer dies during the load, not during its connect
    // (a loaded machine may take longer than the wait below to connect).
    consumer.connect(&s.producer).await.unwrap();
    let started = Instant::now();
    let load = consumer.load(s);
    let kill = async {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        producer.shutdown().await;
    };
    let (out, _) = tokio::join!(load, kill);
    let err = out.unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Failed {
                reason: FailReason::ConnectionLost(_),
                ..
            }
        ),
        "{err}"
    );
    // The disconnect is noticed, not waited out.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_block_outside_its_array_is_refused() {
    let pair = pair(1, 1, producer_config(), Policy::default()).await;
    pair.producer
        .publish("req-o", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let mut s = spec("req-o", &pair.producer).await;
    s.groups[0].local_blocks[2] = Some(CONSUMER_BLOCKS);
    // Refused by the consumer itself, before any request (the producer would refuse it too).
    let err = pair.consumer.load(s).await.unwrap_err();
    assert!(
        matches!(&err, LoadError::Spec { why: kvferry_p2p::LoadSpecFault::Spec(_), .. } if err.to_string().contains("outside the cache")),
        "{err}"
    );
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_layouts_are_refused_not_copied_byte_for_byte() {
    let p = Side::new(1, 1, PRODUCER_BLOCKS, Some(7));
    let c = Side::with_layout(1, 1, CONSUMER_BLOCKS, Some(99), "B KV N H D");
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let consumer = Consumer::new(consumer_config(Policy::default()), c.workers.clone()).unwrap();
    producer
        .publish("req-l", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let err = consumer
        .load(spec("req-l", &producer).await)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("layouts differ"), "{err}");
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_producer_stops_it() {
    let p = Side::new(1, 1, PRODUCER_BLOCKS, Some(7));
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let endpoint = producer.endpoint().to_string();
    drop(producer);
    // Its loop ends and closes the ROUTER: the endpoint can be bound again soon.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let cfg = ProducerConfig {
            bind: endpoint.clone(),
            ..producer_config()
        };
        match Producer::start(cfg, p.workers.clone()).await {
            Ok(again) => {
                again.shutdown().await;
                break;
            }
            Err(e) if Instant::now() < deadline => {
                eprintln!("not yet: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("endpoint still bound after the producer was dropped: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_worker_sets_are_refused() {
    use kvferry_p2p::WorkersFault;
    let side = Side::new(2, 1, PRODUCER_BLOCKS, None);
    let cfg = || consumer_config(Policy::default());
    // Each refusal keeps its case and values, not only its text.
    let refused =
        |workers: Vec<kvferry_p2p::Worker>, what: &str, case: fn(&WorkersFault) -> bool| {
            match Consumer::new(cfg(), workers) {
                Err(kvferry_p2p::P2pError::Workers(why)) => {
                    assert!(why.to_string().contains(what), "{why}");
                    assert!(case(&why), "{why:?}");
                }
                Err(e) => panic!("{e}"),
                Ok(_) => panic!("accepted workers with {what}"),
            }
        };
    refused(vec![side.workers[0].clone()], "workers for TP 2", |f| {
        matches!(
            f,
            WorkersFault::Count {
                workers: 1,
                tp: 2,
                pp: 1
            }
        )
    });
    refused(
        vec![side.workers[0].clone(), side.workers[0].clone()],
        "grid",
        |f| matches!(f, WorkersFault::OffGrid { tp: 2, pp: 1, .. }),
    );
    let mut w = side.workers.clone();
    w[1].groups[0].layers[0].len -= 1;
    refused(
        w,
        "spans",
        |f| matches!(f, WorkersFault::LayerTooShort { spans, len, .. } if spans == &(len + 1)),
    );
    let mut w = side.workers.clone();
    w[1].groups[0].block_size = 32;
    refused(w, "groups", |f| {
        matches!(f, WorkersFault::GroupsDiffer { .. })
    });
    refused(vec![], "no workers", |f| f == &WorkersFault::NoWorkers);
    // Producer::start runs the same checks.
    let e = Producer::start(producer_config(), vec![side.workers[1].clone()])
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("workers"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_asking_for_more_tokens_than_published_is_refused() {
    let pair = pair(1, 1, producer_config(), Policy::default()).await;
    pair.producer
        .publish("req-m", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let mut s = spec("req-m", &pair.producer).await;
    s.num_tokens = NUM_TOKENS + 1;
    let err = pair.consumer.load(s).await.unwrap_err();
    assert!(
        err.to_string().contains("the producer published 40"),
        "{err}"
    );
    pair.producer.shutdown().await;
}

/// The producer holds `max_sessions` sessions; a consumer whose session it evicted gets a
/// `no_session` refusal (nothing served), says hello again on a new socket and loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_session_was_evicted_says_hello_again_and_loads() {
    let cfg = ProducerConfig {
        max_sessions: 1,
        ..producer_config()
    };
    let t = pair(1, 1, cfg, Policy::default()).await;
    let other_side = Side::new(1, 1, CONSUMER_BLOCKS, None);
    let other = Consumer::new(
        consumer_config(Policy::default()),
        other_side.workers.clone(),
    )
    .unwrap();
    for (i, c) in [&t.consumer, &other, &t.consumer].into_iter().enumerate() {
        let rid = format!("evict-{i}");
        t.producer
            .publish(&rid, vec![remote_table()], NUM_TOKENS)
            .await
            .unwrap();
        let out = c
            .load(spec(&rid, &t.producer).await)
            .await
            .unwrap_or_else(|e| panic!("load {i}: {e}"));
        assert!(out.verdict.unwrap().is_verified(), "load {i}");
    }
    t.producer.shutdown().await;
}

/// `connect` opens the control connection and the session before the first load (as the
/// demo does, so that no load pays them), and the load after it goes on that session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_ahead_opens_the_session_the_first_load_uses() {
    let pair = pair(1, 1, producer_config(), Policy::default()).await;
    pair.consumer
        .connect(pair.producer.endpoint())
        .await
        .expect("connect to a running producer");
    pair.producer
        .publish("req-1", vec![remote_table()], NUM_TOKENS)
        .await
        .unwrap();
    let out = pair
        .consumer
        .load(spec("req-1", &pair.producer).await)
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified));
    assert_blocks_landed(&pair);
    pair.producer.shutdown().await;
}

/// `connect` to a port nothing listens on ends within twice the connect timeout with why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_ahead_to_no_producer_fails_within_its_deadline() {
    let c = Side::new(1, 1, CONSUMER_BLOCKS, None);
    let cfg = ConsumerConfig {
        connect_timeout: Duration::from_millis(600),
        ..consumer_config(Policy::default())
    };
    let consumer = Consumer::new(cfg, c.workers.clone()).unwrap();
    // A port that was just free: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let e = tokio::time::timeout(
        Duration::from_secs(10),
        consumer.connect(&format!("tcp://127.0.0.1:{port}")),
    )
    .await
    .expect("connect hung")
    .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    eprintln!("connect to nothing: {e}");
}
