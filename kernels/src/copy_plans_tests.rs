//! [`CopyPlans`]: the same launches as a fresh plan over the new blocks, and every block check
//! made again.
use super::*;
use crate::{GroupJob, LayerInput};
use kvferry_checksum::group::ReplicaKey;
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_checksum::select::BlockSelection;

const DEV: Location = Location::Cuda(0);

/// `n` layers of `blocks` blocks of 16 tokens (8 heads × 128, bf16, `layout`) from `base`.
fn layers(layout: &str, n: u32, blocks: u64, base: u64) -> Vec<LayerInput> {
    let mut addr = base;
    (0..n)
        .map(|layer| {
            let geometry = Geometry::contiguous(
                Layout::parse(layout).unwrap(),
                blocks,
                16,
                8,
                128,
                ElemBytes::new(2).unwrap(),
                1,
            )
            .unwrap();
            let len = geometry.byte_len();
            let l = LayerInput {
                spec: LayerSpec {
                    name: format!("model.layers.{layer}.attn"),
                    layer,
                    head_offset: 0,
                    geometry,
                    kind: None,
                    dtype: None,
                    replica: ReplicaKey::NONE,
                },
                addr,
                len,
            };
            addr += len;
            l
        })
        .collect()
}

/// A copy job of layers of 64 blocks from sources of 32, over `blocks` (source `sources`).
fn job(layout: &str, start: u64, blocks: &[u64], sources: &[u64], tokens: u64) -> CopyJob {
    CopyJob {
        job: GroupJob {
            group_id: 3,
            block_size: 16,
            layers: layers(layout, 4, 64, 1 << 40),
            selection: BlockSelection {
                start,
                block_ids: blocks.to_vec(),
            },
            num_tokens: tokens,
            device: DEV,
        },
        sources: layers(layout, 4, 32, 1 << 44),
        source_blocks: sources.to_vec(),
    }
}

fn blocks(start: u64, ids: &[u64], src: &[u64], tokens: u64) -> JobBlocks {
    JobBlocks {
        start,
        block_ids: ids.to_vec(),
        src_block_ids: src.to_vec(),
        num_tokens: tokens,
    }
}

/// Over other blocks (more, fewer, another start, a partial last block), the plans are those
/// planned afresh for them, in both part orders.
#[test]
fn other_blocks_plan_as_a_fresh_plan_would() {
    for layout in ["KV B N H D", "B KV H N D"] {
        let first = CopyPlans::new(DEV, &[job(layout, 0, &[5, 9], &[1, 2], 32)]).unwrap();
        for (start, ids, src, tokens) in [
            (0u64, vec![63u64, 0, 7], vec![31u64, 30, 0], 40u64),
            (2, vec![4], vec![6], 40),
            (1, vec![10, 11, 12, 13, 14], vec![0, 1, 2, 3, 4], 16 * 6),
        ] {
            let rebound = first
                .with_blocks(vec![blocks(start, &ids, &src, tokens)])
                .unwrap();
            let fresh = CopyPlans::new(DEV, &[job(layout, start, &ids, &src, tokens)]).unwrap();
            assert_eq!(rebound, fresh, "{layout} {ids:?}");
        }
    }
}

/// A block past the layers' 64 or the sources' 32, counts that differ, and another device are
/// refused, each with its cause.
#[test]
fn blocks_out_of_range_and_counts_that_differ_are_refused() {
    let plans = CopyPlans::new(DEV, &[job("KV B N H D", 0, &[5], &[1], 16)]).unwrap();
    let fault = |r: Result<CopyPlans, KernelError>| match r {
        Err(KernelError::InvalidJob { group_id: 3, why }) => why,
        other => panic!("{other:?}"),
    };
    assert!(matches!(
        fault(plans.with_blocks(vec![blocks(0, &[63, 64], &[0, 0], 32)])),
        JobFault::BlockOutOfRange {
            id: 64,
            blocks: 64,
            ..
        }
    ));
    assert!(matches!(
        fault(plans.with_blocks(vec![blocks(0, &[1, 2], &[31, 32], 32)])),
        JobFault::BlockOutOfRange {
            id: 32,
            blocks: 32,
            ..
        }
    ));
    assert!(matches!(
        fault(plans.with_blocks(vec![blocks(0, &[1, 2], &[3], 32)])),
        JobFault::Plan(PlanError::Source { .. })
    ));
    assert!(matches!(
        fault(plans.with_blocks(Vec::new())),
        JobFault::Plan(PlanError::Source { .. })
    ));
    assert!(matches!(
        fault(CopyPlans::new(
            Location::Cuda(1),
            &[job("KV B N H D", 0, &[5], &[1], 16)]
        )),
        JobFault::WrongDevice { .. }
    ));
    // What a fresh plan refuses is refused here too.
    assert!(matches!(
        fault(CopyPlans::new(
            DEV,
            &[job("KV B N H D", 0, &[5], &[40], 16)]
        )),
        JobFault::BlockOutOfRange { id: 40, .. }
    ));
}
