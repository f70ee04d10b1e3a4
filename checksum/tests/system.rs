//! End-to-end checks of docs/design.md §2 on a simulated model: workers of each side hold their
//! TP/PP share in some layout, build records as real workers do, coordinators sum them, the
//! payload travels as bytes, and the consumer compares. Expected values come from the oracle,
//! computed from the logical KV alone.

mod common;

use common::*;
use kvferry_checksum::group::SkipReason;
use kvferry_checksum::layout::ElemBytes;
use kvferry_checksum::payload::Payload;
use kvferry_checksum::record::{consumer_sums, producer_payload, ConsumerGroup, WorkerRecord};
use kvferry_checksum::select::{consumer_blocks, producer_blocks, BlockSelection};
use kvferry_checksum::verdict::{compare, UnverifiedReason, Verdict};

fn full_table(t: &[u64]) -> Vec<Option<u64>> {
    t.iter().map(|&b| Some(b)).collect()
}

/// The producer's payload for `num_tokens` tokens, after a trip through bytes.
fn produce(model: &Model, side: &Side, num_tokens: u64) -> Payload {
    let positions = num_tokens.div_ceil(side.block_size());
    let t = table(positions, positions + 3, 11);
    let sel = producer_blocks(&full_table(&t), num_tokens, side.block_size(), None).unwrap();
    let recs = side_records(model, side, &t, num_tokens, &Faults::default(), Some(&sel));
    let p = producer_payload(&recs, side.tp, side.pp, num_tokens).unwrap();
    Payload::from_bytes(&p.to_bytes()).unwrap()
}

/// The consumer's records for a load of tokens `[local, num_computed)`.
fn consume_records(
    model: &Model,
    side: &Side,
    num_computed: u64,
    faults: &Faults,
) -> Vec<WorkerRecord> {
    let positions = num_computed.div_ceil(side.block_size());
    let t = table(positions, positions + 5, 23);
    let sel = consumer_blocks(
        &full_table(&t),
        faults.local_prefix_tokens,
        num_computed,
        side.block_size(),
        None,
    );
    side_records(model, side, &t, num_computed, faults, sel.as_ref())
}

fn load(
    model: &Model,
    prod: &Side,
    cons: &Side,
    num_tokens: u64,
    num_computed: u64,
    faults: &Faults,
) -> Verdict {
    let payload = produce(model, prod, num_tokens);
    let recs = consume_records(model, cons, num_computed, faults);
    let sums = consumer_sums(&recs, cons.tp, cons.pp, num_computed).unwrap();
    compare(Ok(Some(&payload)), &sums)
}

const SPLITS: [(u32, u32); 5] = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)];

#[test]
fn producer_payload_equals_definition_for_every_layout_and_split() {
    let model = Model::gqa(4, 4, 8);
    let num_tokens = 37;
    let want = model.oracle_blocks(8, num_tokens);
    for layout in LAYOUTS {
        for (tp, pp) in SPLITS {
            let side = Side::new(tp, pp, layout, 4, 2, true);
            let p = produce(&model, &side, num_tokens);
            assert_eq!(p.groups.len(), 1);
            assert_eq!(p.groups[0].values, want, "layout {layout} tp {tp} pp {pp}");
            assert_eq!(
                p.groups[0].fingerprint,
                model.fingerprint(8),
                "layout {layout} tp {tp} pp {pp}"
            );
            assert_eq!(
                (p.groups[0].start, p.groups[0].block_size, p.num_tokens),
                (0, 8, num_tokens)
            );
        }
    }
}

#[test]
fn straddling_pieces_and_element_sizes_sum_to_definition() {
    // D·elem = 12 bytes: a piece straddles K|V; fp8 with D = 4: the cell is one piece.
    for (elem, d) in [
        (ElemBytes::Four, 3),
        (ElemBytes::One, 4),
        (ElemBytes::Eight, 1),
        (ElemBytes::Two, 6),
    ] {
        let model = Model {
            caches: (0..2).map(|l| ModelCache::attn(l, 2, d, elem)).collect(),
            seed: 3,
        };
        let want = model.oracle_blocks(6, 20);
        for layout in LAYOUTS {
            for (tp, pp) in [(1, 1), (2, 2)] {
                let side = Side::new(tp, pp, layout, 3, 2, true);
                assert_eq!(
                    produce(&model, &side, 20).groups[0].values,
                    want,
                    "{elem:?} d={d} {layout} tp{tp} pp{pp}"
                );
            }
        }
    }
}

#[test]
fn gqa_replicas_are_summed_once_by_the_producer() {
    // 2 KV heads at TP4: each head on 2 consecutive ranks.
    let model = Model::gqa(2, 2, 8);
    let side = Side::new(4, 1, "B KV N H D", 4, 1, true);
    assert_eq!(
        produce(&model, &side, 30).groups[0].values,
        model.oracle_blocks(4, 30)
    );
}

#[test]
fn producer_coordinator_ignores_replica_copies_reported_anyway() {
    // Workers that report every copy (as a consumer's do): the producer still sums copy 0 only.
    for model in [
        Model::gqa(2, 2, 8),
        Model {
            caches: vec![ModelCache::mla(0, 16, ElemBytes::Two)],
            seed: 9,
        },
    ] {
        let side = Side::new(4, 1, "KV B N H D", 4, 1, false);
        let t = table(8, 10, 1);
        let sel = producer_blocks(&full_table(&t), 30, 4, None).unwrap();
        let recs = side_records(&model, &side, &t, 30, &Faults::default(), Some(&sel));
        assert!(recs
            .iter()
            .any(|r| r.groups[0].values.keys().any(|k| k.index != 0)));
        let p = producer_payload(&recs, 4, 1, 30).unwrap();
        assert_eq!(p.groups[0].values, model.oracle_blocks(4, 30));
    }
}

#[test]
fn mla_replicas_summed_once_and_checked_per_replica() {
    let model = Model {
        caches: (0..3)
            .map(|l| ModelCache::mla(l, 16, ElemBytes::Two))
            .collect(),
        seed: 5,
    };
    let want = model.oracle_blocks(8, 29);
    for tp in [1, 2, 4] {
        let prod = Side::new(tp, 1, "B N H D", 8, 1, true);
        assert_eq!(
            produce(&model, &prod, 29).groups[0].values,
            want,
            "producer tp{tp}"
        );
        let cons = Side::new(tp, 1, "B N H D", 4, 2, false);
        let recs = consume_records(&model, &cons, 29, &Faults::default());
        let sums = consumer_sums(&recs, tp, 1, 29).unwrap();
        let ConsumerGroup::Checked { checks, .. } = &sums.groups[&0] else {
            panic!("{:?}", sums.groups)
        };
        assert_eq!(checks.len(), tp as usize);
        for c in checks {
            assert_eq!(c, &want);
        }
    }
}

#[test]
fn gqa_consumer_builds_one_check_per_replica() {
    let model = Model::gqa(2, 2, 8);
    let cons = Side::new(4, 1, "B KV H N D", 4, 1, false);
    let recs = consume_records(&model, &cons, 30, &Faults::default());
    let sums = consumer_sums(&recs, 4, 1, 30).unwrap();
    let ConsumerGroup::Checked { checks, .. } = &sums.groups[&0] else {
        panic!()
    };
    assert_eq!(checks.len(), 2);
    for c in checks {
        assert_eq!(c, &model.oracle_blocks(4, 30));
    }
}

#[test]
fn corrupting_one_replica_copy_is_a_mismatch_although_another_is_intact() {
    let model = Model::gqa(2, 2, 8);
    let prod = Side::new(1, 1, "KV B N H D", 4, 1, true);
    let cons = Side::new(4, 1, "B KV N H D", 4, 1, false);
    // Head 1 lives on ranks 2 (copy 0) and 3 (copy 1): corrupt rank 3's copy of token 9.
    let faults = Faults {
        cells: vec![(1, 9, 1, 0x40, Some(3))],
        local_prefix_tokens: 0,
    };
    match load(&model, &prod, &cons, 30, 30, &faults) {
        Verdict::Mismatch { mismatches, .. } => assert_eq!(mismatches[0].positions, vec![2]),
        v => panic!("expected a mismatch, got {v:?}"),
    }
    // Same for MLA, copy 2 of 4.
    let mla = Model {
        caches: (0..2)
            .map(|l| ModelCache::mla(l, 16, ElemBytes::Two))
            .collect(),
        seed: 5,
    };
    let faults = Faults {
        cells: vec![(0, 3, 0, 0x01, Some(2))],
        local_prefix_tokens: 0,
    };
    let v = load(
        &mla,
        &Side::new(2, 1, "B N H D", 4, 1, true),
        &Side::new(4, 1, "N B H D", 4, 1, false),
        30,
        30,
        &faults,
    );
    assert!(matches!(v, Verdict::Mismatch { .. }), "{v:?}");
}

#[test]
fn a_replica_not_checksummed_is_unverified() {
    let model = Model::gqa(2, 2, 8);
    let cons = Side::new(4, 1, "B KV N H D", 4, 1, false);
    let mut recs = consume_records(&model, &cons, 30, &Faults::default());
    // Rank 3 (copy 1 of head 1) reports the group without values.
    recs[3].groups[0].values.clear();
    let sums = consumer_sums(&recs, 4, 1, 30).unwrap();
    assert_eq!(
        sums.groups[&0],
        ConsumerGroup::Unverified(UnverifiedReason::ReplicaNotChecksummed)
    );
    let payload = produce(&model, &Side::new(1, 1, "KV B N H D", 4, 1, true), 30);
    assert_eq!(
        compare(Ok(Some(&payload)), &sums),
        Verdict::Unverified(vec![(Some(0), UnverifiedReason::ReplicaNotChecksummed)])
    );
}

#[test]
fn correct_loads_verify_across_tp_pp_pairs_and_layouts() {
    let model = Model::gqa(4, 4, 8);
    let pairs = [
        ((1, 1), (1, 1)),
        ((2, 1), (1, 1)),
        ((1, 1), (2, 1)),
        ((1, 2), (1, 1)),
        ((1, 1), (2, 2)),
        ((4, 1), (2, 2)),
        ((2, 2), (4, 1)),
    ];
    for (i, ((ptp, ppp), (ctp, cpp))) in pairs.into_iter().enumerate() {
        let prod = Side::new(ptp, ppp, LAYOUTS[i % LAYOUTS.len()], 4, 2, true);
        let cons = Side::new(ctp, cpp, LAYOUTS[(i + 2) % LAYOUTS.len()], 8, 1, false);
        let v = load(&model, &prod, &cons, 45, 45, &Faults::default());
        assert_eq!(v, Verdict::Verified, "({ptp},{ppp}) -> ({ctp},{cpp})");
    }
    // Replicated heads on either side.
    let model = Model::gqa(2, 2, 8);
    for ((ptp, pp), ctp) in [((1, 1), 4), ((4, 1), 1), ((4, 2), 2)] {
        let v = load(
            &model,
            &Side::new(ptp, pp, "KV B N H D", 4, 1, true),
            &Side::new(ctp, 1, "B H N KV D", 4, 1, false),
            30,
            30,
            &Faults::default(),
        );
        assert_eq!(v, Verdict::Verified, "tp{ptp} pp{pp} -> tp{ctp}");
    }
}

#[test]
fn corrupted_byte_is_a_mismatch_at_its_block_position() {
    let model = Model::gqa(4, 4, 8);
    for (tok, head, cache) in [(0, 0, 0), (20, 3, 2), (44, 1, 3)] {
        let faults = Faults {
            cells: vec![(cache, tok, head, 0x80, None)],
            local_prefix_tokens: 0,
        };
        let v = load(
            &model,
            &Side::new(2, 1, "KV B N H D", 8, 1, true),
            &Side::new(1, 2, "B KV H N D", 8, 1, false),
            45,
            45,
            &faults,
        );
        match v {
            Verdict::Mismatch {
                mismatches,
                unverified,
            } => {
                assert_eq!(mismatches.len(), 1);
                assert_eq!(
                    (mismatches[0].group_id, mismatches[0].positions.clone()),
                    (0, vec![tok / 8])
                );
                assert!(unverified.is_empty());
            }
            v => panic!("token {tok}: expected a mismatch, got {v:?}"),
        }
    }
}

#[test]
fn block_sizes_16_and_32_verify_both_ways_and_catch_corruption() {
    let model = Model::gqa(2, 2, 8);
    for (pbs, cbs) in [(16, 32), (32, 16)] {
        let prod = Side::new(1, 1, "KV B N H D", pbs, 1, true);
        let cons = Side::new(2, 1, "B KV N H D", 8, cbs / 8, false);
        for n in [70, 64, 17] {
            assert_eq!(
                load(&model, &prod, &cons, n, n, &Faults::default()),
                Verdict::Verified,
                "{pbs}/{cbs} n={n}"
            );
        }
        let faults = Faults {
            cells: vec![(1, 40, 1, 2, None)],
            local_prefix_tokens: 0,
        };
        match load(&model, &prod, &cons, 70, 70, &faults) {
            Verdict::Mismatch { mismatches, .. } => {
                // Consumer positions of the 32-token chunk holding token 40.
                let want: Vec<u64> = if cbs == 16 { vec![2, 3] } else { vec![1] };
                assert_eq!(mismatches[0].positions, want, "{pbs}/{cbs}");
            }
            v => panic!("{pbs}/{cbs}: expected a mismatch, got {v:?}"),
        }
    }
}

#[test]
fn consumer_with_smaller_blocks_starting_inside_a_producer_block_is_unverified() {
    let model = Model::gqa(2, 2, 8);
    let prod = Side::new(1, 1, "KV B N H D", 32, 1, true);
    let cons = Side::new(1, 1, "KV B N H D", 16, 1, false);
    let faults = Faults {
        cells: vec![],
        local_prefix_tokens: 16,
    };
    let v = load(&model, &prod, &cons, 70, 70, &faults);
    assert_eq!(
        v,
        Verdict::Unverified(vec![(Some(0), UnverifiedReason::UnalignedStart)])
    );
    // Aligned prefix hit (32 tokens) verifies.
    let faults = Faults {
        cells: vec![],
        local_prefix_tokens: 32,
    };
    assert_eq!(
        load(&model, &prod, &cons, 70, 70, &faults),
        Verdict::Verified
    );
}

#[test]
fn local_prefix_hit_compares_only_loaded_blocks() {
    // The consumer's first 16 tokens were computed locally (other bytes than the producer's).
    let model = Model::gqa(2, 4, 8);
    let faults = Faults {
        cells: vec![],
        local_prefix_tokens: 16,
    };
    for (tp, layout) in [(1, "KV B N H D"), (2, "B KV H N D")] {
        let v = load(
            &model,
            &Side::new(1, 1, "KV B N H D", 8, 1, true),
            &Side::new(tp, 1, layout, 8, 1, false),
            40,
            40,
            &faults,
        );
        assert_eq!(v, Verdict::Verified, "tp{tp}");
    }
    // A corrupted loaded token is still caught.
    let faults = Faults {
        cells: vec![(0, 17, 0, 1, None)],
        local_prefix_tokens: 16,
    };
    let v = load(
        &model,
        &Side::new(1, 1, "KV B N H D", 8, 1, true),
        &Side::new(1, 1, "KV B N H D", 8, 1, false),
        40,
        40,
        &faults,
    );
    assert!(matches!(v, Verdict::Mismatch { .. }), "{v:?}");
}

#[test]
fn last_block_compared_only_when_both_hold_the_same_tokens() {
    let model = Model::gqa(2, 2, 8);
    let prod = Side::new(1, 1, "KV B N H D", 8, 1, true);
    let cons = Side::new(1, 1, "B KV N H D", 8, 1, false);
    // Consumer holds 36 tokens, producer 37: last block (32..) not compared, even if it differs.
    let faults = Faults {
        cells: vec![(0, 33, 0, 1, None)],
        local_prefix_tokens: 0,
    };
    assert_eq!(
        load(&model, &prod, &cons, 37, 36, &faults),
        Verdict::Verified
    );
    // With equal counts it is compared.
    assert!(matches!(
        load(&model, &prod, &cons, 37, 37, &faults),
        Verdict::Mismatch { .. }
    ));
    // Earlier blocks are compared either way.
    let faults = Faults {
        cells: vec![(0, 30, 1, 1, None)],
        local_prefix_tokens: 0,
    };
    assert!(matches!(
        load(&model, &prod, &cons, 37, 36, &faults),
        Verdict::Mismatch { .. }
    ));
}

#[test]
fn attention_and_indexer_caches_take_consecutive_heads() {
    // Layer module model.layers.L: an attention cache (2 KV heads, sharded) and an indexer cache
    // (one head, held whole by every rank), which takes head 2 of the layer.
    let mut caches = Vec::new();
    for l in 0..2 {
        caches.push(ModelCache::attn(l, 2, 8, ElemBytes::Two));
        let mut idx = ModelCache::mla(l, 8, ElemBytes::Two);
        idx.name = format!("model.layers.{l}.self_attn.indexer.k_cache");
        idx.head_base = 2;
        caches.push(idx);
    }
    let model = Model { caches, seed: 13 };
    let want = model.oracle_blocks(8, 27);
    for tp in [1, 2, 4] {
        let prod = Side::new(tp, 1, "B KV N H D", 8, 1, true);
        assert_eq!(produce(&model, &prod, 27).groups[0].values, want, "tp{tp}");
        let cons = Side::new(tp, 1, "KV B N H D", 4, 2, false);
        assert_eq!(
            load(
                &model,
                &Side::new(1, 1, "KV B N H D", 8, 1, true),
                &cons,
                27,
                27,
                &Faults::default()
            ),
            Verdict::Verified
        );
    }
}

fn with_skipped(mut recs: Vec<WorkerRecord>, reason: SkipReason) -> Vec<WorkerRecord> {
    for r in &mut recs {
        r.skipped.push((1, reason));
    }
    recs
}

#[test]
fn every_skip_kind_next_to_a_checksummed_group() {
    let model = Model::gqa(2, 2, 8);
    let prod = Side::new(2, 1, "KV B N H D", 8, 1, true);
    let cons = Side::new(1, 1, "KV B N H D", 8, 1, false);
    let t = table(4, 6, 1);
    let sel = producer_blocks(&full_table(&t), 30, 8, None).unwrap();
    let prec = side_records(&model, &prod, &t, 30, &Faults::default(), Some(&sel));
    let crec = consume_records(&model, &cons, 30, &Faults::default());
    let reasons = [
        SkipReason::NoPerTokenBlocks,
        SkipReason::Compressed,
        SkipReason::PackedHeadSlots,
        SkipReason::HostResident,
        SkipReason::NotWholePieces,
        SkipReason::KernelBlocksDoNotTile,
        SkipReason::DuplicateLayerNumber,
        SkipReason::NoLayerNumber,
        SkipReason::UnknownReplicas,
    ];
    for reason in reasons {
        let payload = producer_payload(&with_skipped(prec.clone(), reason), 2, 1, 30).unwrap();
        assert_eq!(
            payload.groups.len(),
            1,
            "{reason:?}: skipped group left out of the payload"
        );
        // Skipped on both sides: ignored.
        let sums = consumer_sums(&with_skipped(crec.clone(), reason), 1, 1, 30).unwrap();
        assert_eq!(
            compare(Ok(Some(&payload)), &sums),
            Verdict::Verified,
            "{reason:?}"
        );
        // Skipped on the consumer only: group 1 of the producer is unverified.
        let mut both = producer_payload(&prec, 2, 1, 30).unwrap();
        let mut g1 = both.groups[0].clone();
        g1.group_id = 1;
        both.groups.push(g1);
        assert_eq!(
            compare(Ok(Some(&both)), &sums),
            Verdict::Unverified(vec![(Some(1), UnverifiedReason::OneSideOnly)]),
            "{reason:?}"
        );
    }
    // Skipped on the producer only.
    let payload =
        producer_payload(&with_skipped(prec, SkipReason::NoPerTokenBlocks), 2, 1, 30).unwrap();
    let mut crec2 = crec.clone();
    let mut g1 = crec2[0].groups[0].clone();
    g1.group_id = 1;
    crec2[0].groups.push(g1);
    let sums = consumer_sums(&crec2, 1, 1, 30).unwrap();
    assert_eq!(
        compare(Ok(Some(&payload)), &sums),
        Verdict::Unverified(vec![(Some(1), UnverifiedReason::OneSideOnly)])
    );
}

#[test]
fn missing_worker_makes_producer_send_nothing_and_consumer_unverified() {
    let model = Model::gqa(2, 2, 8);
    let side = Side::new(2, 2, "KV B N H D", 8, 1, true);
    let t = table(4, 6, 1);
    let sel = producer_blocks(&full_table(&t), 30, 8, None).unwrap();
    let mut recs = side_records(&model, &side, &t, 30, &Faults::default(), Some(&sel));
    recs.remove(2);
    assert!(producer_payload(&recs, 2, 2, 30).is_err());
    assert_eq!(
        consumer_sums(&recs, 2, 2, 30).unwrap_err(),
        UnverifiedReason::NotEveryWorkerReported
    );
}

#[test]
fn worker_with_other_blocks_is_unverified() {
    let model = Model::gqa(2, 2, 8);
    let cons = Side::new(2, 1, "KV B N H D", 8, 1, false);
    let mut recs = consume_records(&model, &cons, 30, &Faults::default());
    recs[1].groups[0].start += 1;
    let sums = consumer_sums(&recs, 2, 1, 30).unwrap();
    assert_eq!(
        sums.groups[&0],
        ConsumerGroup::Unverified(UnverifiedReason::OtherBlocks)
    );
    assert!(producer_payload(&recs, 2, 1, 30).is_err());
    // Scheduled other blocks than reported.
    let mut sums = consumer_sums(
        &consume_records(&model, &cons, 30, &Faults::default()),
        2,
        1,
        30,
    )
    .unwrap();
    sums.expect_blocks(
        0,
        &BlockSelection {
            start: 0,
            block_ids: vec![1, 2],
        },
    );
    assert_eq!(
        sums.groups[&0],
        ConsumerGroup::Unverified(UnverifiedReason::OtherBlocks)
    );
}

#[test]
fn fingerprints_sum_per_pp_stage_not_per_worker() {
    let model = Model::gqa(4, 4, 8);
    for (tp, pp) in SPLITS {
        let p = produce(&model, &Side::new(tp, pp, "KV B N H D", 8, 1, true), 20);
        assert_eq!(
            p.groups[0].fingerprint,
            model.fingerprint(8),
            "tp{tp} pp{pp}"
        );
    }
    // Different layers (another dtype) make the fingerprint differ: unverified.
    let mut other = model.clone();
    other.caches[3].dtype = "torch.float16".into();
    let payload = produce(&other, &Side::new(1, 1, "KV B N H D", 8, 1, true), 20);
    let recs = consume_records(
        &model,
        &Side::new(2, 2, "KV B N H D", 8, 1, false),
        20,
        &Faults::default(),
    );
    let sums = consumer_sums(&recs, 2, 2, 20).unwrap();
    assert_eq!(
        compare(Ok(Some(&payload)), &sums),
        Verdict::Unverified(vec![(Some(0), UnverifiedReason::FingerprintDiffers)])
    );
}
