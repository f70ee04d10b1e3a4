//! Different block sizes on the two sides and hybrid models (several KV cache groups: full
//! attention, sliding window, Mamba-type state), over real loopback sockets (docs/design.md
//! §2.5, §2.6, §4.5): the consumer's blocks are filled token by token from the producer's and
//! verified by chunk sums, every group's blocks move, and a flipped bit in a group is a
//! mismatch at the consumer's block positions of its chunk.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Side, STATE_BYTES, WINDOW};
use kvferry_checksum::policy::Policy;
use kvferry_checksum::verdict::{Mismatch, UnverifiedReason, Verdict};
use kvferry_p2p::{
    Consumer, ConsumerConfig, Landed, LoadError, LoadGroup, LoadSpec, Producer, ProducerConfig,
};

const BLOCKS: u64 = 24;
const NUM_TOKENS: u64 = 90;

struct Pair {
    producer: Producer,
    consumer: Consumer,
    p: Side,
    c: Side,
}

async fn pair(p: Side, c: Side) -> Pair {
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
    Pair {
        producer,
        consumer,
        p,
        c,
    }
}

/// A block table of `NUM_TOKENS` tokens in blocks of `bs`, scattered over the array.
fn table(bs: u64, salt: u64) -> Vec<Option<u64>> {
    (0..NUM_TOKENS.div_ceil(bs))
        .map(|i| Some((i * 7 + salt) % BLOCKS))
        .collect()
}

/// The table of a sliding-window group: blocks wholly before the window are null.
fn windowed(t: &[Option<u64>], bs: u64) -> Vec<Option<u64>> {
    let first = (NUM_TOKENS - WINDOW) / bs;
    t.iter()
        .enumerate()
        .map(|(i, b)| if (i as u64) < first { None } else { *b })
        .collect()
}

/// The cell bytes of token `t` (K and V, all local heads) of layer `layer` of group `group` on
/// rank `rank`, whose group's block table is `t_blocks`.
fn cell(
    side: &Side,
    rank: usize,
    group: usize,
    layer: usize,
    blocks: &[Option<u64>],
    t: u64,
) -> Vec<u8> {
    let l = &side.workers[rank].groups[group].layers[layer];
    let g = &l.spec.geometry;
    let bs = g.block_size();
    let block = blocks[(t / bs) as usize].unwrap();
    // SAFETY: the layer's array is one of the side's live buffers.
    let buf = unsafe { std::slice::from_raw_parts(l.addr as *const u8, l.len as usize) };
    let mut out = Vec::new();
    for h in 0..g.heads {
        for part in 0..g.parts() {
            let at = g.byte_offset(part, block, t % bs, h, 0) as usize;
            out.extend_from_slice(&buf[at..at + (g.head_dim * g.elem.get()) as usize]);
        }
    }
    out
}

/// Flips a bit of token `t` (K, head 0, element 0) of layer 0 of `group` on consumer rank 0
/// after the transfer, before verification.
fn flip_after_landing(pair: &Pair, group: usize, blocks: &[Option<u64>], t: u64) {
    let bs = pair.c.workers[0].groups[group].block_size;
    let addr = pair
        .c
        .group_token_addr(0, group, 0, blocks[(t / bs) as usize].unwrap(), t % bs);
    pair.consumer
        .set_landed_hook(Some(Arc::new(move |_: &Landed| {
            // SAFETY: a byte inside a live buffer of the consumer side, written by no one else now.
            unsafe { *(addr as *mut u8) ^= 0x10 };
        })));
}

async fn load_spec(pair: &Pair, id: &str, groups: Vec<LoadGroup>, lc: u64) -> LoadSpec {
    LoadSpec {
        request_id: id.into(),
        producer: pair.producer.endpoint().to_string(),
        groups,
        num_local_computed: lc,
        num_tokens: NUM_TOKENS,
        load_key: pair.producer.load_key(id).await,
    }
}

fn group(id: u32, remote: &[Option<u64>], local: &[Option<u64>], rbs: u64) -> LoadGroup {
    LoadGroup {
        group_id: id,
        remote_blocks: remote.to_vec(),
        local_blocks: local.to_vec(),
        remote_block_size: Some(rbs),
    }
}

/// Producer blocks of `pbs` tokens, consumer blocks of `cbs`, TP `ptp` → `ctp`: a correct load
/// verifies and lands every token; a flipped bit is a mismatch at the consumer blocks of its
/// chunk; a consumer with smaller blocks starting inside a producer block is unverified.
async fn block_sizes(pbs: u64, cbs: u64, ptp: u32, ctp: u32) {
    let what = format!("{pbs}/{cbs} TP {ptp}→{ctp}");
    let pair = pair(
        Side::sized(ptp, 1, BLOCKS, Some(3), "B KV N H D", pbs),
        Side::sized(ctp, 1, BLOCKS, Some(4), "B KV N H D", cbs),
    )
    .await;
    let (remote, local) = (table(pbs, 1), table(cbs, 5));
    for id in ["ok", "flip", "unaligned"] {
        pair.producer
            .publish(id, vec![remote.clone()], NUM_TOKENS)
            .await
            .unwrap();
    }
    let ok = pair
        .consumer
        .load(load_spec(&pair, "ok", vec![group(0, &remote, &local, pbs)], 0).await)
        .await
        .unwrap();
    assert_eq!(ok.verdict, Some(Verdict::Verified), "{what}");
    if ptp == ctp {
        for rank in 0..ptp as usize {
            for t in 0..NUM_TOKENS {
                assert_eq!(
                    cell(&pair.p, rank, 0, 0, &remote, t),
                    cell(&pair.c, rank, 0, 0, &local, t),
                    "{what}: token {t}"
                );
            }
        }
    }

    // Token 70: chunk 70 / max(pbs, cbs), all its consumer blocks reported.
    flip_after_landing(&pair, 0, &local, 70);
    let out = pair
        .consumer
        .load(load_spec(&pair, "flip", vec![group(0, &remote, &local, pbs)], 0).await)
        .await
        .unwrap();
    let l = pbs.max(cbs);
    let want: Vec<u64> =
        (70 / l * l / cbs..((70 / l + 1) * l / cbs).min(NUM_TOKENS.div_ceil(cbs))).collect();
    assert_eq!(
        out.verdict,
        Some(Verdict::Mismatch {
            mismatches: vec![Mismatch {
                group_id: 0,
                positions: want
            }],
            unverified: vec![]
        }),
        "{what}"
    );
    pair.consumer.set_landed_hook(None);

    // A local prefix hit of one consumer block: aligned to the producer's blocks only when the
    // consumer's blocks are not the smaller ones.
    let out = pair
        .consumer
        .load(
            load_spec(
                &pair,
                "unaligned",
                vec![group(0, &remote, &local, pbs)],
                cbs,
            )
            .await,
        )
        .await
        .unwrap();
    if cbs < pbs {
        assert_eq!(
            out.verdict,
            Some(Verdict::Unverified(vec![(
                Some(0),
                UnverifiedReason::UnalignedStart
            )])),
            "{what}"
        );
    } else {
        assert_eq!(out.verdict, Some(Verdict::Verified), "{what}");
    }
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_block_sizes_verify_by_chunk_sums_both_ways() {
    block_sizes(16, 32, 1, 1).await;
    block_sizes(32, 16, 1, 1).await;
    block_sizes(16, 32, 2, 1).await;
    block_sizes(32, 16, 1, 2).await;
    block_sizes(8, 32, 2, 2).await;
}

/// Full attention, sliding window and state groups between TP `ptp` and `ctp`: every group's
/// blocks land (the state too, unchecksummed), the attention groups verify, and a flipped bit
/// in each attention group is a mismatch of that group at the right position.
async fn hybrid(ptp: u32, ctp: u32) {
    let what = format!("TP {ptp}→{ctp}");
    let pair = pair(
        Side::hybrid(ptp, 1, BLOCKS, Some(8), "KV B N H D", 16),
        Side::hybrid(ctp, 1, BLOCKS, Some(9), "KV B N H D", 16),
    )
    .await;
    let (remote, local) = (table(16, 2), table(16, 11));
    let (wremote, wlocal) = (windowed(&remote, 16), windowed(&local, 16));
    // The state group: one state block, the last position's.
    let state = |t: &[Option<u64>]| {
        let mut s = vec![None; t.len()];
        *s.last_mut().unwrap() = *t.last().unwrap();
        s
    };
    let (sremote, slocal) = (state(&remote), state(&local));
    let groups = || {
        vec![
            group(0, &remote, &local, 16),
            group(1, &wremote, &wlocal, 16),
            group(2, &sremote, &slocal, 16),
        ]
    };
    for id in ["ok", "flip0", "flip1", "state"] {
        pair.producer
            .publish(
                id,
                vec![remote.clone(), wremote.clone(), sremote.clone()],
                NUM_TOKENS,
            )
            .await
            .unwrap();
    }
    let out = pair
        .consumer
        .load(load_spec(&pair, "ok", groups(), 0).await)
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified), "{what}");
    // The state block moved whole, to every consumer rank.
    let last = |t: &[Option<u64>]| t.last().unwrap().unwrap();
    for rank in 0..ctp as usize {
        for layer in 0..2 {
            let got = pair.c.group_block_bytes(rank, 2, layer, last(&slocal));
            assert_eq!(got.len() as u64, STATE_BYTES);
            assert_eq!(
                got,
                pair.p.group_block_bytes(0, 2, layer, last(&sremote)),
                "{what}"
            );
        }
    }
    for (g, t, id) in [(0usize, 20u64, "flip0"), (1, 85, "flip1")] {
        let blocks = if g == 0 { &local } else { &wlocal };
        flip_after_landing(&pair, g, blocks, t);
        let out = pair
            .consumer
            .load(load_spec(&pair, id, groups(), 0).await)
            .await
            .unwrap();
        assert_eq!(
            out.verdict,
            Some(Verdict::Mismatch {
                mismatches: vec![Mismatch {
                    group_id: g as u32,
                    positions: vec![t / 16]
                }],
                unverified: vec![]
            }),
            "{what}: group {g}"
        );
    }
    // A flipped state byte is not seen: state groups are skipped on both sides (the attention
    // groups still verify under fail-closed).
    let addr = pair.c.group_block_bytes(0, 2, 0, last(&slocal)).len();
    assert!(addr > 0);
    let l = &pair.c.workers[0].groups[2].layers[0];
    let at = l.addr + l.spec.geometry.byte_offset(0, last(&slocal), 0, 0, 3);
    pair.consumer
        .set_landed_hook(Some(Arc::new(move |_: &Landed| {
            // SAFETY: a byte inside a live buffer of the consumer side, written by no one else now.
            unsafe { *(at as *mut u8) ^= 1 };
        })));
    let out = pair
        .consumer
        .load(load_spec(&pair, "state", groups(), 0).await)
        .await
        .unwrap();
    assert_eq!(out.verdict, Some(Verdict::Verified), "{what}");
    pair.producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hybrid_groups_all_move_and_attention_groups_verify() {
    hybrid(1, 1).await;
    hybrid(2, 1).await;
    hybrid(1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_group_between_different_block_sizes_is_refused_before_any_byte_moves() {
    let pair = pair(
        Side::hybrid(1, 1, BLOCKS, Some(8), "KV B N H D", 16),
        Side::hybrid(1, 1, BLOCKS, Some(9), "KV B N H D", 32),
    )
    .await;
    let (remote, local) = (table(16, 2), table(32, 11));
    pair.producer
        .publish(
            "r",
            vec![remote.clone(), windowed(&remote, 16), remote.clone()],
            NUM_TOKENS,
        )
        .await
        .unwrap();
    let err = pair
        .consumer
        .load(
            load_spec(
                &pair,
                "r",
                vec![group(0, &remote, &local, 16), group(2, &remote, &local, 16)],
                0,
            )
            .await,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, LoadError::Spec { why, .. } if why.to_string().contains("state group")),
        "{err}"
    );
    pair.producer.shutdown().await;
}
