//! Verification as the layers land, over real loopback sockets: the producer cuts a load into
//! layer groups and names each as it lands, the consumer checksums those layers before the
//! FINISH and the rest after it, and the parts add up to the whole-request checksum bit for
//! bit (the verdict compares them with the producer's payload, computed over all layers at
//! publish) for every cut, on TP 1, TP 2 and PP 2. Bad bytes in an early layer are caught, and
//! a landed hook (which changes bytes between landing and verifying) turns the overlap off for
//! the loads it runs for.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{consumer_config, Side};
use kvferry_checksum::verdict::Verdict;
use kvferry_p2p::{Consumer, Landed, LoadGroup, LoadOutcome, LoadSpec, Producer, ProducerConfig};

const BLOCKS: u64 = 12;
/// 8 layers, 2 KV heads of 8 elements.
const SHAPE: (u32, u64, u64) = (8, 2, 8);
const NUM_TOKENS: u64 = 40;
const REMOTE: [u64; 3] = [3, 5, 1];
const LOCAL: [u64; 3] = [7, 2, 10];

struct Pair {
    producer: Producer,
    consumer: Consumer,
    p: Side,
    c: Side,
}

/// A pair whose producer copies in layer groups of `group_bytes` (0: in one go).
async fn pair(tp: u32, pp: u32, group_bytes: u64) -> Pair {
    let p = Side::shaped(tp, pp, BLOCKS, Some(7), SHAPE);
    let c = Side::shaped(tp, pp, BLOCKS, Some(99), SHAPE);
    let config = ProducerConfig {
        transfer_timeout: Duration::from_secs(10),
        layer_group_bytes: group_bytes,
        ..ProducerConfig::default()
    };
    let producer = Producer::start(config, p.workers.clone()).await.unwrap();
    let consumer = Consumer::new(consumer_config(), c.workers.clone()).unwrap();
    Pair {
        producer,
        consumer,
        p,
        c,
    }
}

/// Publishes and loads `id`.
async fn load(pair: &Pair, id: &str) -> LoadOutcome {
    let table = |b: &[u64]| b.iter().map(|&b| Some(b)).collect::<Vec<_>>();
    pair.producer
        .publish(id, vec![table(&REMOTE)], NUM_TOKENS)
        .await
        .unwrap();
    let spec = LoadSpec {
        request_id: id.into(),
        producer: pair.producer.endpoint().to_string(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: table(&REMOTE),
            local_blocks: table(&LOCAL),
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key: pair.producer.load_key(id).await,
    };
    pair.consumer.load(spec).await.unwrap()
}

fn assert_landed(pair: &Pair) {
    for rank in 0..pair.p.workers.len() {
        for layer in 0..pair.p.memory[rank].len() {
            for (r, l) in REMOTE.iter().zip(LOCAL) {
                assert_eq!(
                    pair.p.block_bytes(rank, layer, *r),
                    pair.c.block_bytes(rank, layer, l)
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_verified_as_they_land_add_up_to_the_whole_request_checksum() {
    for (tp, pp) in [(1, 1), (2, 1), (1, 2)] {
        // The load's bytes, copied in one go.
        let whole = pair(tp, pp, 0).await;
        let one_go = load(&whole, "whole").await;
        assert_eq!(one_go.verdict, Some(Verdict::Verified));
        assert_eq!(one_go.early_layers, 0);
        whole.producer.shutdown().await;
        let bytes = one_go.bytes;
        // One group (nothing early), two, three, and as many as allowed (one layer each at most).
        for (group_bytes, early) in [
            (bytes, false),
            (bytes / 2, true),
            (bytes / 3, true),
            (1, true),
        ] {
            let pair = pair(tp, pp, group_bytes).await;
            let out = load(&pair, "r").await;
            let what = format!("TP {tp} PP {pp}, groups of {group_bytes} of {bytes} bytes");
            assert_eq!(out.verdict, Some(Verdict::Verified), "{what}");
            assert_eq!(out.bytes, bytes, "{what}");
            assert_eq!(out.early_layers > 0, early, "{what}: {out:?}");
            // At most every layer was checksummed as it landed (the last group's CONTINUE
            // comes before the FINISH, and is left for after it when heard late).
            assert!(out.early_layers <= SHAPE.0 * tp, "{what}: {out:?}");
            assert_landed(&pair);
            pair.producer.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_byte_in_an_early_layer_is_caught() {
    let pair = pair(1, 1, 1).await;
    // The producer's payload is computed at publish; its bytes of layer 0 change after it, so
    // what lands in that layer is not what the payload says.
    pair.producer
        .publish(
            "bad",
            vec![REMOTE.iter().map(|&b| Some(b)).collect()],
            NUM_TOKENS,
        )
        .await
        .unwrap();
    let addr = pair.p.token_addr(0, 0, REMOTE[1], 3);
    // SAFETY: addr is inside the producer's layer array, which the test keeps alive.
    unsafe { *(addr as *mut u8) ^= 0x10 };
    let spec = LoadSpec {
        request_id: "bad".into(),
        producer: pair.producer.endpoint().to_string(),
        groups: vec![LoadGroup {
            remote_block_size: None,
            group_id: 0,
            remote_blocks: REMOTE.iter().map(|&b| Some(b)).collect(),
            local_blocks: LOCAL.iter().map(|&b| Some(b)).collect(),
        }],
        num_local_computed: 0,
        num_tokens: NUM_TOKENS,
        load_key: pair.producer.load_key("bad").await,
    };
    let out = pair.consumer.load(spec).await.unwrap();
    assert!(out.early_layers > 0, "{out:?}");
    match out.verdict {
        Some(Verdict::Mismatch { mismatches, .. }) => {
            assert_eq!(mismatches[0].positions, vec![1])
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landed_hook_turns_the_overlap_off_for_the_loads_it_runs_for() {
    let pair = pair(1, 1, 1).await;
    // The hook flips a bit of layer 0 (an early layer) after the load lands: it must be
    // checksummed after the hook, so the load is a mismatch.
    let addr = pair.c.token_addr(0, 0, LOCAL[1], 3);
    let flip = Arc::new(move |_: &Landed| {
        // SAFETY: addr is inside the consumer's layer array, which the test keeps alive.
        unsafe { *(addr as *mut u8) ^= 0x10 };
    });
    pair.consumer.set_landed_hook(Some(flip.clone()));
    let out = load(&pair, "hooked").await;
    assert_eq!(out.early_layers, 0);
    assert!(
        matches!(out.verdict, Some(Verdict::Mismatch { .. })),
        "{out:?}"
    );
    // A hook for other loads only: these overlap. Whether a load's progress is taken before
    // its FINISH is timing (a starved host may take both at once), so of a few such loads at
    // least one must have started layers early, and all verify.
    pair.consumer
        .set_landed_hook_for(flip.clone(), Arc::new(|id: &str| id == "other"));
    let mut early = Vec::new();
    for i in 0..5 {
        let out = load(&pair, &format!("free-{i}")).await;
        assert_eq!(out.verdict, Some(Verdict::Verified), "{out:?}");
        early.push(out.early_layers);
        if out.early_layers > 0 {
            break;
        }
    }
    assert!(
        early.iter().any(|&n| n > 0),
        "no load overlapped: {early:?}"
    );
    let out = load(&pair, "other").await;
    assert_eq!(out.early_layers, 0);
    assert!(
        matches!(out.verdict, Some(Verdict::Mismatch { .. })),
        "{out:?}"
    );
    pair.producer.shutdown().await;
}

/// The outcome says what carried the KV, as the producer's FINISH names it, whether the load
/// was copied in one go or in layer groups (TP 2: two ranks submit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outcome_names_the_path_that_carried_the_kv() {
    for (tp, group_bytes) in [(1, 0), (1, 1), (2, 0), (2, 1)] {
        let pair = pair(tp, 1, group_bytes).await;
        let out = load(&pair, "r").await;
        assert_eq!(out.verdict, Some(Verdict::Verified));
        let what = format!("TP {tp}, groups of {group_bytes} bytes");
        assert_eq!(
            out.path,
            Some(kvferry_transfer::TransferPath::Tcp),
            "{what}"
        );
        pair.producer.shutdown().await;
    }
}
