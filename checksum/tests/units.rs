//! Unit tests of block selection (§2.5), group planning (§2.1/§2.3), fingerprints (§2.3),
//! comparison (§2.6) and policy (§2.7).

use std::collections::BTreeMap;

use kvferry_checksum::fingerprint::{layer_fingerprint, py_repr};
use kvferry_checksum::group::{
    parse_layer_number, plan_group, CacheDesc, GroupPlan, LayerSpec, RankInfo, ReplicaKey,
    SkipReason,
};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_checksum::payload::{Payload, PayloadError, PayloadGroup};
use kvferry_checksum::policy::{Action, CarrierCheck, LoadFailurePolicy, Policy};
use kvferry_checksum::record::{ConsumerGroup, ConsumerSums};
use kvferry_checksum::select::{consumer_blocks, producer_blocks, BlockSelection};
use kvferry_checksum::verdict::{compare, log_verdict, Mismatch, UnverifiedReason, Verdict};

// ---- select (§2.5)

fn blocks(ids: &[i64]) -> Vec<Option<u64>> {
    ids.iter().map(|&i| (i >= 0).then_some(i as u64)).collect()
}

fn sel(start: u64, ids: &[u64]) -> Option<BlockSelection> {
    Some(BlockSelection {
        start,
        block_ids: ids.to_vec(),
    })
}

#[test]
fn producer_selects_blocks_holding_the_prompt() {
    let b = blocks(&[5, 9, 2, 7, 1]);
    assert_eq!(producer_blocks(&b, 40, 16, None), sel(0, &[5, 9, 2]));
    assert_eq!(producer_blocks(&b, 48, 16, None), sel(0, &[5, 9, 2]));
    assert_eq!(producer_blocks(&b, 49, 16, None), sel(0, &[5, 9, 2, 7]));
    assert_eq!(producer_blocks(&b, 0, 16, None), None);
    assert_eq!(
        producer_blocks(&b, 200, 16, None),
        None,
        "fewer blocks than tokens need"
    );
    assert_eq!(producer_blocks(&b, 40, 0, None), None);
}

#[test]
fn leading_nulls_dropped_and_inner_null_leaves_group_out() {
    assert_eq!(
        producer_blocks(&blocks(&[-1, -1, 4, 6]), 64, 16, None),
        sel(2, &[4, 6])
    );
    assert_eq!(
        producer_blocks(&blocks(&[-1, 3, -1, 6]), 64, 16, None),
        None
    );
    assert_eq!(producer_blocks(&blocks(&[-1, -1]), 32, 16, None), None);
    assert_eq!(
        consumer_blocks(&blocks(&[1, 2, -1, 6]), 0, 64, 16, None),
        None
    );
}

#[test]
fn sliding_window_keeps_last_blocks() {
    let b = blocks(&[0, 1, 2, 3, 4, 5, 6, 7]);
    // window 20 tokens, 16-token blocks: ceil(20/16)+1 = 3 blocks.
    assert_eq!(producer_blocks(&b, 128, 16, Some(20)), sel(5, &[5, 6, 7]));
    assert_eq!(producer_blocks(&b, 100, 16, Some(20)), sel(4, &[4, 5, 6]));
    assert_eq!(producer_blocks(&b, 30, 16, Some(20)), sel(0, &[0, 1]));
    // With the nulls the window left.
    assert_eq!(
        producer_blocks(&blocks(&[-1, -1, -1, -1, 4, 5, 6, 7]), 128, 16, Some(20)),
        sel(5, &[5, 6, 7])
    );
    assert_eq!(
        consumer_blocks(&b, 16, 128, 16, Some(20)),
        sel(5, &[5, 6, 7])
    );
}

#[test]
fn consumer_selects_loaded_blocks_only() {
    let b = blocks(&[3, 8, 1, 4]);
    assert_eq!(consumer_blocks(&b, 0, 50, 16, None), sel(0, &[3, 8, 1, 4]));
    assert_eq!(consumer_blocks(&b, 32, 50, 16, None), sel(2, &[1, 4]));
    assert_eq!(consumer_blocks(&b, 40, 50, 16, None), sel(2, &[1, 4]));
    assert_eq!(consumer_blocks(&b, 50, 50, 16, None), None);
    assert_eq!(consumer_blocks(&b, 0, 80, 16, None), None);
}

// ---- group planning (§2.1, §2.3)

fn geom(heads: u64, layout: &str) -> Geometry {
    Geometry::contiguous(
        Layout::parse(layout).unwrap(),
        8,
        16,
        heads,
        64,
        ElemBytes::Two,
        1,
    )
    .unwrap()
}

fn attn(layer: u32, heads: u64) -> CacheDesc {
    CacheDesc::new(
        format!("model.layers.{layer}.self_attn.attn"),
        Some("FullAttentionSpec"),
        Some("torch.bfloat16"),
        geom(heads, "KV B N H D"),
    )
}

fn rank(tp_rank: u32, tp_size: u32) -> RankInfo {
    RankInfo {
        tp_rank,
        tp_size,
        pp_rank: 0,
        pp_size: 1,
    }
}

fn layers(plan: GroupPlan) -> Vec<LayerSpec> {
    match plan {
        GroupPlan::Checksum { layers, .. } => layers,
        GroupPlan::Skipped { reason, .. } => panic!("skipped: {reason:?}"),
    }
}

fn summary(plan: GroupPlan) -> Vec<(String, u32, u32, ReplicaKey)> {
    layers(plan)
        .into_iter()
        .map(|l| (l.name, l.layer, l.head_offset, l.replica))
        .collect()
}

#[test]
fn layer_numbers_from_names() {
    assert_eq!(
        parse_layer_number("model.layers.12.self_attn.attn"),
        Some(12)
    );
    assert_eq!(
        parse_layer_number("model.layers.0.self_attn.indexer.k_cache"),
        Some(0)
    );
    assert_eq!(parse_layer_number("model.embed"), None);
    assert_eq!(parse_layer_number("model.layers.1.experts.3.attn"), None);
    assert_eq!(parse_layer_number("layers.99999999999.attn"), None);
}

#[test]
fn sharded_heads_are_numbered_globally() {
    for r in 0..4 {
        let s = summary(plan_group(
            0,
            16,
            &[attn(3, 2), attn(1, 2)],
            rank(r, 4),
            Some(8),
        ));
        assert_eq!(
            s[0],
            (
                "model.layers.1.self_attn.attn".into(),
                1,
                2 * r,
                ReplicaKey::NONE
            )
        );
        assert_eq!(s[1].2, 2 * r);
    }
}

#[test]
fn gqa_with_more_ranks_than_heads_replicates_on_consecutive_ranks() {
    // 2 KV heads at TP4: ranks 0,1 hold head 0; ranks 2,3 head 1.
    let want = [(0, 0), (0, 1), (1, 0), (1, 1)];
    for (r, &(head, index)) in want.iter().enumerate() {
        let s = summary(plan_group(0, 16, &[attn(0, 1)], rank(r as u32, 4), Some(2)));
        assert_eq!((s[0].2, s[0].3), (head, ReplicaKey { replicas: 2, index }));
    }
    // Without the model's head count it cannot be told.
    assert_eq!(
        plan_group(0, 16, &[attn(0, 1)], rank(1, 4), None),
        GroupPlan::Skipped {
            group_id: 0,
            reason: SkipReason::UnknownReplicas
        }
    );
    assert_eq!(
        plan_group(0, 16, &[attn(0, 1)], rank(1, 4), Some(3)),
        GroupPlan::Skipped {
            group_id: 0,
            reason: SkipReason::UnknownReplicas
        }
    );
    // TP equal to heads: one head each, not replicated.
    let s = summary(plan_group(0, 16, &[attn(0, 1)], rank(3, 4), Some(4)));
    assert_eq!((s[0].2, s[0].3), (3, ReplicaKey::NONE));
}

#[test]
fn mla_and_declared_max_tp_shards_replicate() {
    let mut mla = CacheDesc::new(
        "model.layers.2.self_attn.attn",
        Some("MLAAttentionSpec"),
        Some("torch.bfloat16"),
        geom(1, "B N D"),
    );
    for r in 0..4 {
        let s = summary(plan_group(0, 16, &[mla.clone()], rank(r, 4), None));
        assert_eq!(
            (s[0].2, s[0].3),
            (
                0,
                ReplicaKey {
                    replicas: 4,
                    index: r
                }
            )
        );
    }
    mla.kind = Some("SlidingWindowMLASpec".into());
    assert_eq!(
        summary(plan_group(0, 16, &[mla], rank(1, 2), None))[0].3,
        ReplicaKey {
            replicas: 2,
            index: 1
        }
    );
    // Declared: 2 heads split in at most 2 shards, TP4 → 2 replicas of each shard.
    let mut c = attn(0, 1);
    c.max_tp_shards = Some(2);
    let got: Vec<_> = (0..4)
        .map(|r| {
            let s = summary(plan_group(0, 16, &[c.clone()], rank(r, 4), None));
            (s[0].2, s[0].3.index)
        })
        .collect();
    assert_eq!(got, vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
}

#[test]
fn caches_of_one_layer_module_take_consecutive_heads_in_name_order() {
    let idx = CacheDesc::new(
        "model.layers.0.self_attn.indexer.k_cache",
        Some("MLAAttentionSpec"),
        Some("torch.uint8"),
        geom(1, "B N D"),
    );
    for r in 0..2 {
        let s = summary(plan_group(
            0,
            16,
            &[idx.clone(), attn(0, 2)],
            rank(r, 2),
            None,
        ));
        assert_eq!(s[0].0, "model.layers.0.self_attn.attn");
        assert_eq!((s[0].2, s[0].3), (2 * r, ReplicaKey::NONE));
        // 4 attention heads over TP2 come first: the indexer is head 4.
        assert_eq!(
            (s[1].2, s[1].3),
            (
                4,
                ReplicaKey {
                    replicas: 2,
                    index: r
                }
            )
        );
    }
}

#[test]
fn one_layer_number_in_two_modules_is_skipped() {
    let mut mtp = attn(3, 2);
    mtp.name = "model.mtp.layers.3.self_attn.attn".into();
    assert_eq!(
        plan_group(5, 16, &[attn(3, 2), mtp], rank(0, 1), None),
        GroupPlan::Skipped {
            group_id: 5,
            reason: SkipReason::DuplicateLayerNumber
        }
    );
}

#[test]
fn kv_sharing_counts_once_under_the_lowest_layer() {
    let mut shared = attn(7, 2);
    shared.alias_of = Some("model.layers.2.self_attn.attn".into());
    let s = summary(plan_group(0, 16, &[shared, attn(2, 2)], rank(0, 1), None));
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].1, 2);
    // Two aliases of a layer outside the group: kept once, under the lower number.
    let mut a = attn(9, 2);
    a.alias_of = Some("model.layers.1.self_attn.attn".into());
    let mut b = attn(5, 2);
    b.alias_of = Some("model.layers.1.self_attn.attn".into());
    let s = summary(plan_group(0, 16, &[a, b], rank(0, 1), None));
    assert_eq!(s.iter().map(|x| x.1).collect::<Vec<_>>(), vec![5]);
}

#[test]
fn every_skip_kind_is_detected() {
    let ok = attn(0, 2);
    let check = |c: CacheDesc, bs: u64, reason: SkipReason| {
        assert_eq!(
            plan_group(1, bs, &[ok.clone(), c], rank(0, 1), None),
            GroupPlan::Skipped {
                group_id: 1,
                reason
            }
        );
    };
    let mut c = attn(1, 2);
    c.per_token_blocks = false;
    check(c, 16, SkipReason::NoPerTokenBlocks);
    let mut c = attn(1, 2);
    c.tokens_per_state = 4;
    check(c, 16, SkipReason::Compressed);
    let mut c = attn(1, 2);
    c.packed_head_slots = true;
    check(c, 16, SkipReason::PackedHeadSlots);
    let mut c = attn(1, 2);
    c.host_resident = true;
    check(c, 16, SkipReason::HostResident);
    let mut c = attn(1, 2);
    c.geometry = Geometry::contiguous(
        Layout::parse("B N D").unwrap(),
        8,
        16,
        1,
        3,
        ElemBytes::Two,
        1,
    )
    .unwrap();
    check(c, 16, SkipReason::NotWholePieces);
    let mut c = attn(1, 2);
    c.geometry = Geometry::contiguous(
        Layout::parse("KV B N H D").unwrap(),
        8,
        12,
        2,
        64,
        ElemBytes::Two,
        1,
    )
    .unwrap();
    check(c, 16, SkipReason::KernelBlocksDoNotTile);
    let mut c = attn(1, 2);
    c.name = "model.final.attn".into();
    check(c, 16, SkipReason::NoLayerNumber);
    // The plain group checksums.
    assert_eq!(
        layers(plan_group(
            1,
            16,
            &[ok.clone(), attn(1, 2)],
            rank(0, 1),
            None
        ))
        .len(),
        2
    );
}

// ---- fingerprint (§2.3); expected values from Python: sha256(repr(t).encode())[:8], little-endian

#[test]
fn fingerprints_match_python() {
    assert_eq!(
        layer_fingerprint(
            "model.layers.0.self_attn.attn",
            "FullAttentionSpec",
            16,
            "torch.bfloat16"
        ),
        0x05b2_65ca_4f48_1ca9
    );
    assert_eq!(
        layer_fingerprint(
            "model.layers.12.self_attn.attn",
            "MLAAttentionSpec",
            64,
            "torch.float8_e4m3fn"
        ),
        0x6810_a145_1372_4b7c
    );
    assert_eq!(
        layer_fingerprint("it's", "a\"b\\c", 1, "x\ty\n\u{1}\u{7f}\u{a0}é\u{2028}😀"),
        0x1bfc_b081_5c06_190e
    );
}

#[test]
fn repr_quotes_like_python() {
    assert_eq!(py_repr("abc"), "'abc'");
    assert_eq!(py_repr("it's"), "\"it's\"");
    assert_eq!(py_repr("'\""), "'\\'\"'");
    assert_eq!(py_repr("a\\b"), "'a\\\\b'");
    assert_eq!(py_repr("\u{0}\u{1f}"), "'\\x00\\x1f'");
}

// ---- verdict (§2.6)

fn pg(group_id: u32, block_size: u64, start: u64, values: &[u64]) -> PayloadGroup {
    PayloadGroup {
        group_id,
        fingerprint: 77,
        block_size,
        start,
        values: values.to_vec(),
    }
}

fn payload(num_tokens: u64, groups: Vec<PayloadGroup>) -> Payload {
    Payload {
        version: 1,
        tp_size: 1,
        num_tokens,
        groups,
    }
}

fn checked(block_size: u64, start: u64, checks: &[&[u64]]) -> ConsumerGroup {
    ConsumerGroup::Checked {
        block_size,
        start,
        fingerprint: 77,
        checks: checks.iter().map(|c| c.to_vec()).collect(),
    }
}

fn sums(num_tokens: u64, groups: Vec<(u32, ConsumerGroup)>) -> ConsumerSums {
    ConsumerSums {
        num_tokens,
        groups: groups.into_iter().collect::<BTreeMap<_, _>>(),
    }
}

fn unv(g: Option<u32>, r: UnverifiedReason) -> Verdict {
    Verdict::Unverified(vec![(g, r)])
}

#[test]
fn load_level_outcomes() {
    let c = sums(40, vec![(0, checked(16, 0, &[&[1, 2, 3]]))]);
    assert_eq!(
        compare(Ok(None), &c),
        unv(None, UnverifiedReason::NoChecksums)
    );
    assert_eq!(
        compare(Err(&PayloadError::Version(9)), &c),
        unv(None, UnverifiedReason::InvalidChecksums)
    );
    assert_eq!(
        compare(Ok(Some(&payload(40, vec![pg(0, 16, 0, &[1, 2, 3])]))), &c),
        Verdict::Verified
    );
}

/// A producer's start whose token offsets overflow a u64 (off the wire, never checked when
/// decoded) makes the group unverified instead of panicking the consumer.
#[test]
fn producer_positions_past_u64_are_invalid_not_a_panic() {
    let c = sums(40, vec![(0, checked(16, 0, &[&[1, 2]]))]);
    for (start, values) in [
        (u64::MAX / 16, &[1u64, 2][..]),
        (u64::MAX / 16, &[1][..]),
        (u64::MAX, &[1][..]),
        (u64::MAX / 16 + 1, &[][..]),
    ] {
        assert_eq!(
            compare(Ok(Some(&payload(40, vec![pg(0, 16, start, values)]))), &c),
            unv(Some(0), UnverifiedReason::InvalidChecksums),
            "start {start}"
        );
    }
}

#[test]
fn equal_block_sizes_compare_common_positions() {
    // Producer 0..3, consumer loads 1..3.
    let p = payload(40, vec![pg(0, 16, 0, &[1, 2, 3])]);
    assert_eq!(
        compare(
            Ok(Some(&p)),
            &sums(40, vec![(0, checked(16, 1, &[&[2, 3]]))])
        ),
        Verdict::Verified
    );
    let v = compare(
        Ok(Some(&p)),
        &sums(40, vec![(0, checked(16, 1, &[&[2, 4]]))]),
    );
    assert_eq!(
        v,
        Verdict::Mismatch {
            mismatches: vec![Mismatch {
                group_id: 0,
                positions: vec![2]
            }],
            unverified: vec![]
        }
    );
    // No common position.
    let p2 = payload(40, vec![pg(0, 16, 0, &[1])]);
    assert_eq!(
        compare(Ok(Some(&p2)), &sums(40, vec![(0, checked(16, 2, &[&[3]]))])),
        unv(Some(0), UnverifiedReason::NoCommonPosition)
    );
}

#[test]
fn last_block_needs_equal_token_counts() {
    let p = payload(40, vec![pg(0, 16, 0, &[1, 2, 3])]);
    // Consumer holds 41 tokens: last block differs in token count, not compared.
    assert_eq!(
        compare(
            Ok(Some(&p)),
            &sums(41, vec![(0, checked(16, 0, &[&[1, 2, 99]]))])
        ),
        Verdict::Verified
    );
    assert!(matches!(
        compare(
            Ok(Some(&p)),
            &sums(40, vec![(0, checked(16, 0, &[&[1, 2, 99]]))])
        ),
        Verdict::Mismatch { .. }
    ));
    // Only the last block loaded, counts differ: nothing in common.
    assert_eq!(
        compare(Ok(Some(&p)), &sums(39, vec![(0, checked(16, 2, &[&[3]]))])),
        unv(Some(0), UnverifiedReason::NoCommonPosition)
    );
}

#[test]
fn different_block_sizes_compare_chunks() {
    // Producer 16-token blocks [a b c d e], consumer 32-token blocks [a+b, c+d, e] for 70 tokens.
    let p = payload(70, vec![pg(0, 16, 0, &[1, 2, 3, 4, 5])]);
    assert_eq!(
        compare(
            Ok(Some(&p)),
            &sums(70, vec![(0, checked(32, 0, &[&[3, 7, 5]]))])
        ),
        Verdict::Verified
    );
    let v = compare(
        Ok(Some(&p)),
        &sums(70, vec![(0, checked(32, 0, &[&[3, 8, 5]]))]),
    );
    assert_eq!(
        v,
        Verdict::Mismatch {
            mismatches: vec![Mismatch {
                group_id: 0,
                positions: vec![1]
            }],
            unverified: vec![]
        }
    );
    // Reverse: producer 32, consumer 16; mismatch reported at both consumer positions of the chunk.
    let p = payload(70, vec![pg(0, 32, 0, &[3, 7, 5])]);
    assert_eq!(
        compare(
            Ok(Some(&p)),
            &sums(70, vec![(0, checked(16, 0, &[&[1, 2, 3, 4, 5]]))])
        ),
        Verdict::Verified
    );
    let v = compare(
        Ok(Some(&p)),
        &sums(70, vec![(0, checked(16, 2, &[&[3, 5, 5]]))]),
    );
    assert_eq!(
        v,
        Verdict::Mismatch {
            mismatches: vec![Mismatch {
                group_id: 0,
                positions: vec![2, 3]
            }],
            unverified: vec![]
        }
    );
    // Unaligned start: consumer's first 16-token block inside a 32-token producer block.
    assert_eq!(
        compare(
            Ok(Some(&p)),
            &sums(70, vec![(0, checked(16, 1, &[&[2, 3, 4, 5]]))])
        ),
        unv(Some(0), UnverifiedReason::UnalignedStart)
    );
    // Not dividing.
    assert_eq!(
        compare(
            Ok(Some(&p)),
            &sums(70, vec![(0, checked(24, 0, &[&[1, 2, 3]]))])
        ),
        unv(Some(0), UnverifiedReason::BlockSizesIncompatible)
    );
}

#[test]
fn blocks_past_the_last_token_count_zero_in_a_chunk() {
    // 40 tokens: 16-token producer blocks [a b c]; consumer 64-token block holds all.
    let p = payload(40, vec![pg(0, 16, 0, &[1, 2, 3])]);
    assert_eq!(
        compare(Ok(Some(&p)), &sums(40, vec![(0, checked(64, 0, &[&[6]]))])),
        Verdict::Verified
    );
}

#[test]
fn every_replica_check_must_match() {
    let p = payload(32, vec![pg(0, 16, 0, &[1, 2])]);
    let c = sums(32, vec![(0, checked(16, 0, &[&[1, 2], &[1, 9]]))]);
    assert_eq!(
        compare(Ok(Some(&p)), &c),
        Verdict::Mismatch {
            mismatches: vec![Mismatch {
                group_id: 0,
                positions: vec![1]
            }],
            unverified: vec![]
        }
    );
}

#[test]
fn group_level_outcomes_and_mixed_findings() {
    let p = payload(
        32,
        vec![
            pg(0, 16, 0, &[1, 2]),
            pg(1, 16, 0, &[5, 6]),
            pg(2, 16, 0, &[7, 8]),
        ],
    );
    let mut fp = checked(16, 0, &[&[5, 6]]);
    if let ConsumerGroup::Checked { fingerprint, .. } = &mut fp {
        *fingerprint = 78;
    }
    let c = sums(
        32,
        vec![
            (0, checked(16, 0, &[&[1, 3]])),
            (1, fp),
            (3, ConsumerGroup::Skipped(SkipReason::NoPerTokenBlocks)),
            (4, checked(16, 0, &[&[1, 1]])),
        ],
    );
    let v = compare(Ok(Some(&p)), &c);
    assert_eq!(
        v,
        Verdict::Mismatch {
            mismatches: vec![Mismatch {
                group_id: 0,
                positions: vec![1]
            }],
            unverified: vec![
                (Some(1), UnverifiedReason::FingerprintDiffers),
                (Some(2), UnverifiedReason::OneSideOnly),
                (Some(4), UnverifiedReason::OneSideOnly),
            ],
        }
    );
    assert_eq!(v.unverified().len(), 3);
    log_verdict("req-1", &v);
    log_verdict("req-2", &v);
    // Duplicate group ids in a payload make it invalid.
    let dup = payload(32, vec![pg(0, 16, 0, &[1, 2]), pg(0, 16, 0, &[1, 2])]);
    assert_eq!(
        compare(
            Ok(Some(&dup)),
            &sums(32, vec![(0, checked(16, 0, &[&[1, 2]]))])
        ),
        unv(None, UnverifiedReason::InvalidChecksums)
    );
}

// ---- policy (§2.7)

#[test]
fn policy_decides_per_verdict() {
    let mismatch = Verdict::Mismatch {
        mismatches: vec![Mismatch {
            group_id: 0,
            positions: vec![0],
        }],
        unverified: vec![],
    };
    let unverified = unv(None, UnverifiedReason::NoChecksums);
    let open = Policy::default();
    assert!(!open.fail_closed);
    for v in [&Verdict::Verified, &mismatch, &unverified] {
        assert_eq!(open.decide(v), Action::Complete);
    }
    let fail = Policy {
        fail_closed: true,
        load_failure: LoadFailurePolicy::Fail,
    };
    let recompute = Policy {
        fail_closed: true,
        load_failure: LoadFailurePolicy::Recompute,
    };
    assert_eq!(fail.decide(&Verdict::Verified), Action::Complete);
    assert_eq!(
        (fail.decide(&mismatch), fail.decide(&unverified)),
        (Action::Fail, Action::Fail)
    );
    assert_eq!(
        (recompute.decide(&mismatch), recompute.decide(&unverified)),
        (Action::Recompute, Action::Recompute)
    );
    assert_eq!(
        "recompute".parse::<LoadFailurePolicy>(),
        Ok(LoadFailurePolicy::Recompute)
    );
    assert!("retry".parse::<LoadFailurePolicy>().is_err());
}

#[test]
fn carrier_less_setup_fails_closed_and_warns_open() {
    assert!(Policy {
        fail_closed: true,
        ..Policy::default()
    }
    .check_carrier(false)
    .is_err());
    assert!(matches!(
        Policy::default().check_carrier(false),
        Ok(CarrierCheck::DisabledWithWarning(_))
    ));
    assert_eq!(
        Policy {
            fail_closed: true,
            ..Policy::default()
        }
        .check_carrier(true),
        Ok(CarrierCheck::Enabled)
    );
}
