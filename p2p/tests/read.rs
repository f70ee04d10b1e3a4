//! Loads the consumer reads itself (docs/design.md §4.10), over real loopback sockets: TCP
//! engines in open mode stand in for CUDA IPC (`ReadMode::Always`; the GPU tests run the real
//! path). The first load to a producer is written and brings its layout; later ones are read,
//! land byte for byte, verify, and end the producer's lease. Bad bytes are caught; a consumer
//! in `Auto` mode whose KV is not reached over CUDA IPC never reads; a producer restarted with
//! other memory refuses the stale plan and the load goes by WRITE.

mod common;

use std::time::{Duration, Instant};

use common::{
    consumer_config, producer_config, published_blocks, spec, Side, LOCAL_BLOCKS, REMOTE_BLOCKS,
};
use kvferry_checksum::verdict::Verdict;
use kvferry_p2p::{
    Consumer, ConsumerConfig, LoadOutcome, Producer, ProducerConfig, ReadMode, ReleaseReason,
};

const BLOCKS: u64 = 12;

fn reading(mode: ReadMode) -> ConsumerConfig {
    ConsumerConfig {
        read: mode,
        ..consumer_config()
    }
}

/// A TP 1 producer (seeded KV) and a TP 1 consumer reading in `mode`, with their sides.
async fn pair(mode: ReadMode) -> (Producer, Consumer, Side, Side) {
    let p = Side::new(1, 1, BLOCKS, Some(7));
    let c = Side::new(1, 1, BLOCKS, None);
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    let consumer = Consumer::new(reading(mode), c.workers.clone()).unwrap();
    (producer, consumer, p, c)
}

async fn load(producer: &Producer, consumer: &Consumer, id: &str) -> LoadOutcome {
    producer
        .publish(id, published_blocks(), common::NUM_TOKENS)
        .await
        .unwrap();
    let out = consumer.load(spec(id, producer).await).await.unwrap();
    // A layout that came with the FINISH is taken on a task of its own.
    tokio::time::sleep(Duration::from_millis(50)).await;
    out
}

/// Waits (up to 5 s) until `producer` released `id`; returns why.
async fn released(producer: &Producer, id: &str) -> ReleaseReason {
    let until = Instant::now() + Duration::from_secs(5);
    let mut seen = Vec::new();
    while Instant::now() < until {
        seen.extend(producer.released());
        if let Some(r) = seen.iter().find(|r| r.request_id == id) {
            return r.reason.clone();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{id} not released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_read_by_the_consumer_land_byte_for_byte_verify_and_end_the_lease() {
    for (ptp, ctp, pp) in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)] {
        let what = format!("producer TP {ptp}, consumer TP {ctp}, PP {pp}");
        let p = Side::new(ptp, pp, BLOCKS, Some(7));
        let c = Side::new(ctp, pp, BLOCKS, None);
        let producer = Producer::start(producer_config(), p.workers.clone())
            .await
            .unwrap();
        let consumer = Consumer::new(reading(ReadMode::Always), c.workers.clone()).unwrap();
        // The first load is written, and brings the producer's layout.
        let first = load(&producer, &consumer, "first").await;
        assert!(!first.read, "{what}");
        assert_eq!(first.verdict, Some(Verdict::Verified), "{what}");
        for i in 0..2 {
            let id = format!("read-{i}");
            let out = load(&producer, &consumer, &id).await;
            assert!(out.read, "{what}: {out:?}");
            assert_eq!(out.verdict, Some(Verdict::Verified), "{what}");
            assert_eq!(out.bytes, first.bytes, "{what}");
            assert_eq!(
                out.path,
                Some(kvferry_transfer::TransferPath::Tcp),
                "{what}"
            );
            assert_eq!(
                released(&producer, &id).await,
                ReleaseReason::Served,
                "{what}"
            );
        }
        if ptp == ctp {
            for rank in 0..p.workers.len() {
                for layer in 0..p.memory[rank].len() {
                    for (r, l) in REMOTE_BLOCKS.iter().zip(LOCAL_BLOCKS) {
                        assert_eq!(
                            p.block_bytes(rank, layer, *r),
                            c.block_bytes(rank, layer, l),
                            "{what}"
                        );
                    }
                }
            }
        }
        producer.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_byte_in_the_producers_blocks_is_caught_when_read() {
    let (producer, consumer, p, _c) = pair(ReadMode::Always).await;
    load(&producer, &consumer, "first").await;
    producer
        .publish("bad", published_blocks(), common::NUM_TOKENS)
        .await
        .unwrap();
    // After the publish (its payload), before the read.
    let addr = p.token_addr(0, 0, REMOTE_BLOCKS[1], 3);
    // SAFETY: addr is inside the producer's layer array, which the test keeps alive.
    unsafe { *(addr as *mut u8) ^= 0x10 };
    let out = consumer.load(spec("bad", &producer).await).await.unwrap();
    assert!(out.read);
    match out.verdict {
        Some(Verdict::Mismatch { mismatches, .. }) => {
            assert_eq!(mismatches[0].positions, vec![1])
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_auto_mode_kv_not_reached_over_cuda_ipc_is_written() {
    let p = Side::new(1, 1, BLOCKS, Some(7));
    let c = Side::new(1, 1, BLOCKS, None);
    let producer = Producer::start(producer_config(), p.workers.clone())
        .await
        .unwrap();
    for mode in [ReadMode::Auto, ReadMode::Never] {
        let consumer = Consumer::new(reading(mode), c.workers.clone()).unwrap();
        for i in 0..2 {
            let out = load(&producer, &consumer, &format!("{mode:?}-{i}")).await;
            assert!(!out.read, "{mode:?}");
            assert_eq!(out.verdict, Some(Verdict::Verified));
        }
    }
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_restarted_with_other_memory_is_loaded_by_write_then_read_again() {
    let c = Side::new(1, 1, BLOCKS, None);
    let consumer = Consumer::new(reading(ReadMode::Always), c.workers.clone()).unwrap();
    let old = Side::new(1, 1, BLOCKS, Some(7));
    let producer = Producer::start(producer_config(), old.workers.clone())
        .await
        .unwrap();
    let endpoint = producer.endpoint().to_string();
    load(&producer, &consumer, "a").await;
    assert!(load(&producer, &consumer, "b").await.read);
    producer.shutdown().await;
    drop(producer);
    // The consumer sees its connection to the old producer close before the next load: a load
    // sent on that connection while it closes fails (connection lost), which is not what this
    // test is about (on a busy machine the close took longer than the next load's start).
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Another producer at the same endpoint, its KV elsewhere: the consumer's plan is stale.
    let new = Side::new(1, 1, BLOCKS, Some(8));
    let config = ProducerConfig {
        bind: endpoint,
        ..producer_config()
    };
    let producer = Producer::start(config, new.workers.clone()).await.unwrap();
    let out = load(&producer, &consumer, "c").await;
    assert!(!out.read, "{out:?}");
    assert_eq!(out.verdict, Some(Verdict::Verified));
    // Its FINISH brought the new layout: reads again.
    let out = load(&producer, &consumer, "d").await;
    assert!(out.read, "{out:?}");
    assert_eq!(out.verdict, Some(Verdict::Verified));
    producer.shutdown().await;
    drop(old);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_that_gets_no_finish_lets_a_later_one_ask_for_the_layout() {
    let (producer, consumer, _p, _c) = pair(ReadMode::Always).await;
    // The first load asks for the layout and is refused (another load key): no FINISH.
    producer
        .publish("a", published_blocks(), common::NUM_TOKENS)
        .await
        .unwrap();
    let mut wrong = spec("a", &producer).await;
    wrong.load_key = Some("not the key".into());
    assert!(consumer.load(wrong).await.is_err());
    // The next asks again, and the one after reads.
    assert!(!load(&producer, &consumer, "b").await.read);
    assert!(load(&producer, &consumer, "c").await.read);
    producer.shutdown().await;
}

#[test]
fn reads_on_every_path_are_refused_with_a_secret() {
    let secret = kvferry_transfer::Secret::from_bytes(b"p2p test shared secret, 32 bytes").unwrap();
    let c = Side::authenticated(1, 1, BLOCKS, None, secret);
    let e = Consumer::new(reading(ReadMode::Always), c.workers.clone()).err();
    assert!(
        matches!(e, Some(kvferry_p2p::P2pError::Config(ref f)) if f.to_string().contains("ReadMode::Auto")),
        "{e:?}"
    );
    assert!(Consumer::new(reading(ReadMode::Auto), c.workers.clone()).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_load_the_producer_refuses_makes_the_next_ask_for_the_layout_again() {
    let (producer, consumer, _p, _c) = pair(ReadMode::Always).await;
    load(&producer, &consumer, "a").await;
    assert!(load(&producer, &consumer, "b").await.read);
    // "b" again: read, and refused (already loaded). The layout is not trusted any more.
    assert!(consumer.load(spec("b", &producer).await).await.is_err());
    assert!(!load(&producer, &consumer, "c").await.read);
    assert!(load(&producer, &consumer, "d").await.read);
    producer.shutdown().await;
}
