//! Producer and consumer with different TP and PP sizes (docs/design.md §4): the producer maps KV
//! heads between ranks, every consumer rank gets each of its heads from one producer rank
//! that holds it (replicas included), and the checksums compare because both sides sum to
//! the unsharded value. Real loopback sockets, as in `loopback.rs`.

mod common;

use std::sync::Arc;

use common::{
    consumer_config, producer_config, spec, Side, BLOCK, HEAD_DIM, LOCAL_BLOCKS, NUM_TOKENS,
    REMOTE_BLOCKS,
};
use kvferry_checksum::policy::Action;
use kvferry_checksum::verdict::Verdict;
use kvferry_p2p::{Consumer, Landed, Producer};

const PRODUCER_BLOCKS: u64 = 8;
const CONSUMER_BLOCKS: u64 = 12;

struct Pair {
    producer: Producer,
    consumer: Consumer,
    p: Side,
    c: Side,
}

/// Producer `TP × PP` and consumer `TP × PP`, model (layers, KV heads, head size).
async fn pair(p: (u32, u32), c: (u32, u32), shape: (u32, u64, u64)) -> Pair {
    pair2(p, c, shape, shape).await
}

async fn pair2(
    p: (u32, u32),
    c: (u32, u32),
    p_shape: (u32, u64, u64),
    c_shape: (u32, u64, u64),
) -> Pair {
    let ps = Side::shaped(p.0, p.1, PRODUCER_BLOCKS, Some(7), p_shape);
    let cs = Side::shaped(c.0, c.1, CONSUMER_BLOCKS, Some(99), c_shape);
    let producer = Producer::start(producer_config(), ps.workers.clone())
        .await
        .unwrap();
    let consumer = Consumer::new(consumer_config(), cs.workers.clone()).unwrap();
    Pair {
        producer,
        consumer,
        p: ps,
        c: cs,
    }
}

/// Every head of every consumer rank's layer holds the producer's bytes of that global head.
fn assert_heads_landed(pair: &Pair) {
    let mut checked = 0;
    for (cr, cw) in pair.c.workers.iter().enumerate() {
        for (cl, layer) in cw.groups[0].layers.iter().enumerate() {
            for j in 0..layer.spec.geometry.heads {
                let h = layer.spec.head_offset as u64 + j;
                // any producer rank holding head h of this layer (replicas hold the same bytes)
                let (pr, pl, ph) = pair
                    .p
                    .workers
                    .iter()
                    .enumerate()
                    .flat_map(|(r, w)| {
                        w.groups[0]
                            .layers
                            .iter()
                            .enumerate()
                            .filter_map(move |(i, l)| {
                                let o = l.spec.head_offset as u64;
                                (l.spec.name == layer.spec.name
                                    && h >= o
                                    && h < o + l.spec.geometry.heads)
                                    .then(|| (r, i, h - o))
                            })
                    })
                    .next()
                    .unwrap_or_else(|| {
                        panic!("no producer rank holds head {h} of {}", layer.spec.name)
                    });
                for (r, l) in REMOTE_BLOCKS.iter().zip(LOCAL_BLOCKS) {
                    assert_eq!(
                        pair.p.head_bytes(pr, pl, ph, *r),
                        pair.c.head_bytes(cr, cl, j, l),
                        "consumer rank {cr} {} head {h}: block {r} → {l}",
                        layer.spec.name
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 0);
}

/// Bytes the consumer's ranks hold for the loaded blocks (what must be written).
fn consumer_bytes(side: &Side) -> u64 {
    side.workers
        .iter()
        .flat_map(|w| w.groups[0].layers.iter())
        .map(|l| 3 * 2 * BLOCK * l.spec.geometry.heads * HEAD_DIM * 2)
        .sum()
}

async fn verifies(p: (u32, u32), c: (u32, u32), shape: (u32, u64, u64)) {
    let pair = pair(p, c, shape).await;
    let table = REMOTE_BLOCKS.iter().map(|&b| Some(b)).collect();
    pair.producer
        .publish("req-1", vec![table], NUM_TOKENS)
        .await
        .unwrap();
    let out = pair
        .consumer
        .load(spec("req-1", &pair.producer).await)
        .await
        .unwrap();
    let what = format!(
        "producer TP{}×PP{} → consumer TP{}×PP{}, {shape:?}",
        p.0, p.1, c.0, c.1
    );
    assert_eq!(out.verdict, Some(Verdict::Verified), "{what}");
    assert_eq!(out.action, Action::Complete, "{what}");
    assert_eq!(
        out.bytes,
        consumer_bytes(&pair.c),
        "{what}: every consumer byte once"
    );
    assert_heads_landed(&pair);
    pair.producer.shutdown().await;
}

/// 4 layers, 2 KV heads, head size 8 (TP 4 replicates each head on two ranks).
const TWO_HEADS: (u32, u64, u64) = (4, 2, HEAD_DIM);
/// 4 layers, 4 KV heads.
const FOUR_HEADS: (u32, u64, u64) = (4, 4, HEAD_DIM);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_tp2_to_consumer_tp1() {
    verifies((2, 1), (1, 1), TWO_HEADS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_tp1_to_consumer_tp2() {
    verifies((1, 1), (2, 1), TWO_HEADS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_tp4_to_consumer_tp2_with_four_heads() {
    verifies((4, 1), (2, 1), FOUR_HEADS).await;
    verifies((2, 1), (4, 1), FOUR_HEADS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_heads_on_either_side() {
    // TP 4 over 2 KV heads: every head on two ranks.
    verifies((4, 1), (1, 1), TWO_HEADS).await;
    verifies((1, 1), (4, 1), TWO_HEADS).await;
    verifies((4, 1), (2, 1), TWO_HEADS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_pp_sizes_and_both_at_once() {
    verifies((1, 2), (1, 1), TWO_HEADS).await;
    verifies((1, 1), (1, 4), TWO_HEADS).await;
    verifies((2, 2), (1, 4), FOUR_HEADS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_is_found_with_different_tp_sizes() {
    let pair = pair((1, 1), (2, 1), TWO_HEADS).await;
    let table = REMOTE_BLOCKS.iter().map(|&b| Some(b)).collect();
    pair.producer
        .publish("req-c", vec![table], NUM_TOKENS)
        .await
        .unwrap();
    // consumer TP rank 1 (head 1), second loaded block
    let addr = pair.c.token_addr(1, 0, LOCAL_BLOCKS[1], 3);
    pair.consumer
        .set_landed_hook(Some(Arc::new(move |_: &Landed| {
            // SAFETY: inside the consumer's layer array, which the test keeps alive.
            unsafe { *(addr as *mut u8) ^= 0x10 };
        })));
    let out = pair
        .consumer
        .load(spec("req-c", &pair.producer).await)
        .await
        .unwrap();
    match out.verdict {
        Some(Verdict::Mismatch { ref mismatches, .. }) => {
            assert_eq!(mismatches.len(), 1);
            assert_eq!(mismatches[0].positions, vec![1]);
        }
        ref other => panic!("expected a mismatch, got {other:?}"),
    }
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_of_another_head_count_is_refused_with_a_clear_error() {
    // more heads than the producer holds, and fewer (which every consumer rank could be
    // served from, silently loading part of the KV)
    for (p_shape, c_shape) in [(TWO_HEADS, FOUR_HEADS), (FOUR_HEADS, TWO_HEADS)] {
        let pair = pair2((1, 1), (2, 1), p_shape, c_shape).await;
        let table = REMOTE_BLOCKS.iter().map(|&b| Some(b)).collect();
        pair.producer
            .publish("req-h", vec![table], NUM_TOKENS)
            .await
            .unwrap();
        let err = pair
            .consumer
            .load(spec("req-h", &pair.producer).await)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("KV heads"),
            "{p_shape:?} → {c_shape:?}: {err}"
        );
        pair.producer.shutdown().await;
    }
}
