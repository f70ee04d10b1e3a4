//! The one-pass read's decisions without a GPU: which layers pair up with the producer's,
//! which requests' blocks it moves, and what it refuses (with why) so that the load is read in
//! two passes instead. The launches themselves run in the GPU tests and the demo.

use std::sync::Arc;

use kvferry_checksum::group::{LayerSpec, RankInfo, ReplicaKey, SkipReason};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_checksum::select::BlockSelection;
use kvferry_kernels::{CpuBackend, GroupJob, LayerInput, Location};
use kvferry_transfer::{EngineConfig, TransferEngine, TransportKind};

use super::{source_blocks, CopyTemplate, NoCopy};
use crate::proto::layout::RankLayout;
use crate::proto::msg::LoadRequest;
use crate::proto::request::{build_request, LoadGroup, LoadSpec};
use crate::worker::{Worker, WorkerGroup};

/// `n` layers of `heads` KV heads in `layout`, `blocks` blocks of 16 tokens, at made-up
/// addresses from `base` (nothing here reads them).
fn layers(layout: &str, n: u32, heads: u64, blocks: u64, base: u64) -> Vec<LayerInput> {
    let g = Geometry::contiguous(
        Layout::parse(layout).unwrap(),
        blocks,
        16,
        heads,
        128,
        ElemBytes::Two,
        1,
    )
    .unwrap();
    (0..n)
        .map(|l| LayerInput {
            spec: LayerSpec {
                name: format!("model.layers.{l}.self_attn.attn"),
                layer: l,
                head_offset: 0,
                geometry: g.clone(),
                kind: None,
                dtype: None,
                replica: ReplicaKey::NONE,
            },
            addr: base + l as u64 * g.byte_len().next_multiple_of(256),
            len: g.byte_len(),
        })
        .collect()
}

fn group(layers: Vec<LayerInput>) -> WorkerGroup {
    WorkerGroup {
        group_id: 0,
        block_size: 16,
        layers,
        sliding_window: None,
        skipped: None,
    }
}

/// A consumer rank on "cuda:0" (a TCP engine: nothing is submitted here).
fn worker(group: WorkerGroup, device: Location) -> Worker {
    let engine = TransferEngine::new(EngineConfig {
        host: "127.0.0.1".into(),
        port: 0,
        transport: TransportKind::Tcp,
        ..EngineConfig::default()
    })
    .unwrap();
    Worker {
        rank: RankInfo::SINGLE,
        engine,
        device,
        groups: vec![group],
        backend: Arc::new(CpuBackend::new(1)),
    }
}

fn producer(layers: Vec<LayerInput>) -> Vec<RankLayout> {
    vec![RankLayout {
        rank: RankInfo::SINGLE,
        segment: "127.0.0.1:9".into(),
        groups: vec![group(layers)],
    }]
}

/// A load of `tokens` tokens into this side's blocks 7, 3, 5, ... from the producer's 0, 1, ...
fn request(w: &Worker, tokens: u64) -> LoadRequest {
    let n = tokens.div_ceil(16) as usize;
    let spec = LoadSpec {
        request_id: "r".into(),
        producer: "tcp://127.0.0.1:1".into(),
        groups: vec![LoadGroup {
            group_id: 0,
            remote_blocks: (0..n as u64).map(Some).collect(),
            local_blocks: (0..n as u64).map(|i| Some((7 + 2 * i) % 40)).collect(),
            remote_block_size: None,
        }],
        num_local_computed: 0,
        num_tokens: tokens,
        load_key: None,
    };
    build_request(&[w.layout()], 1, 1, &spec).unwrap().0
}

/// The job a load's parts give for the request (every layer, its blocks).
fn job(w: &Worker, request: &LoadRequest) -> GroupJob {
    let b = &request.blocks[0];
    GroupJob {
        group_id: 0,
        block_size: 16,
        layers: w.groups[0].layers.clone(),
        selection: BlockSelection {
            start: b.positions[0],
            block_ids: b.local_blocks.clone(),
        },
        num_tokens: request.num_tokens,
        device: w.device,
    }
}

/// Layers pair by name and heads, the producer's geometry kept (its own block count): a
/// template; the blocks then come from the request, in order or not.
#[test]
fn layers_pair_by_name_with_the_producers_geometry() {
    let mine = layers("KV B N H D", 4, 8, 40, 1 << 40);
    let w = worker(group(mine), Location::Cuda(0));
    let mut theirs = layers("KV B N H D", 4, 8, 64, 1 << 41);
    theirs.reverse();
    let r = request(&w, 100);
    let t = CopyTemplate::of(
        std::slice::from_ref(&w),
        &[vec![job(&w, &r)]],
        &producer(theirs),
        &r,
    )
    .unwrap();
    let segs = &t.workers[0].segments;
    assert_eq!(segs.len(), 1);
    assert_eq!(segs[0].0, "127.0.0.1:9");
    for (j, k, l) in &segs[0].1 {
        assert_eq!(*j, 0);
        assert_eq!(l.spec.name, format!("model.layers.{k}.self_attn.attn"));
        assert_eq!(l.spec.layer, *k as u32, "this side's layer number kept");
        assert_eq!(l.spec.geometry.num_blocks(), 64, "the producer's geometry");
        assert_eq!(l.addr, (1 << 41) + *k as u64 * l.len.next_multiple_of(256));
    }
    let j = job(&w, &r);
    assert_eq!(
        source_blocks(j.group_id, &j.selection, &r).unwrap(),
        (0..7).collect::<Vec<u64>>()
    );
    // Positions out of order: looked up.
    let mut r2 = r.clone();
    r2.blocks[0].positions.reverse();
    r2.blocks[0].remote_blocks.reverse();
    assert_eq!(
        source_blocks(j.group_id, &j.selection, &r2).unwrap(),
        (0..7).collect::<Vec<u64>>()
    );
}

/// What the one pass cannot move refuses the template, with why: host memory, a group that is
/// not checksummed, other block sizes, other heads (TP sizes differ), another layout within a
/// block, a layer the producer does not hold.
#[test]
fn what_cannot_be_copied_in_one_pass_is_refused_with_why() {
    let of = |w: &Worker, theirs: Vec<LayerInput>, r: &LoadRequest| {
        CopyTemplate::of(
            std::slice::from_ref(w),
            &[vec![job(w, r)]],
            &producer(theirs),
            r,
        )
    };
    let mine = || layers("KV B N H D", 2, 8, 40, 1 << 40);
    let theirs = || layers("KV B N H D", 2, 8, 64, 1 << 41);
    let w = worker(group(mine()), Location::Cuda(0));
    let r = request(&w, 64);
    assert!(of(&w, theirs(), &r).is_ok());

    let host = worker(group(mine()), Location::Cpu);
    assert!(matches!(of(&host, theirs(), &r), Err(NoCopy::Host(0))));

    let mut g = group(mine());
    g.skipped = Some(SkipReason::NoPerTokenBlocks);
    let skipped = worker(g, Location::Cuda(0));
    assert!(matches!(
        of(&skipped, theirs(), &r),
        Err(NoCopy::Unchecked(0))
    ));

    let mut sizes = r.clone();
    sizes.blocks[0].remote_block_size = 32;
    assert!(matches!(
        of(&w, theirs(), &sizes),
        Err(NoCopy::BlockSizes(0))
    ));

    let tp2 = layers("KV B N H D", 2, 4, 64, 1 << 41);
    assert!(matches!(of(&w, tp2, &r), Err(NoCopy::NoSource(_))));

    let heads_outer = layers("KV B H N D", 2, 8, 64, 1 << 41);
    assert!(matches!(of(&w, heads_outer, &r), Err(NoCopy::Layout(_))));

    let fewer = layers("KV B N H D", 1, 8, 64, 1 << 41);
    assert!(matches!(of(&w, fewer, &r), Err(NoCopy::NoSource(_))));
}

/// A load whose checksummed blocks are not the blocks it moves is refused: a selection of
/// another length, a position with no producer block.
#[test]
fn blocks_that_do_not_pair_up_are_refused() {
    let w = worker(
        group(layers("KV B N H D", 2, 8, 40, 1 << 40)),
        Location::Cuda(0),
    );
    let r = request(&w, 64);
    let mut j = job(&w, &r);
    j.selection.block_ids.pop();
    assert!(matches!(
        source_blocks(j.group_id, &j.selection, &r),
        Err(NoCopy::Blocks(0))
    ));
    let j = job(&w, &r);
    let mut moved = r.clone();
    moved.blocks[0].positions[1] = 99;
    assert!(matches!(
        source_blocks(j.group_id, &j.selection, &moved),
        Err(NoCopy::Blocks(0))
    ));
}

/// A template's reads ask the engine for the producer's memory as mapped now: a segment not
/// open here (or not mapped) is why this load goes in two passes; no handshake is made.
#[test]
fn reads_need_the_producers_segment_open_and_mapped_here() {
    let w = worker(
        group(layers("KV B N H D", 2, 8, 40, 1 << 40)),
        Location::Cuda(0),
    );
    let r = request(&w, 64);
    let theirs = layers("KV B N H D", 2, 8, 64, 1 << 41);
    let workers = [w];
    let jobs = vec![vec![job(&workers[0], &r)]];
    let t = CopyTemplate::of(&workers, &jobs, &producer(theirs), &r).unwrap();
    let started = std::time::Instant::now();
    let sels = |jobs: &[Vec<GroupJob>]| -> Vec<Vec<(u32, BlockSelection)>> {
        jobs.iter()
            .map(|js| {
                js.iter()
                    .map(|j| (j.group_id, j.selection.clone()))
                    .collect()
            })
            .collect()
    };
    let tokens = jobs[0][0].num_tokens;
    let e = t.reads(&workers, sels(&jobs), tokens, &r).err().unwrap();
    assert!(
        matches!(e, NoCopy::NotOpen(ref s) if s == "127.0.0.1:9"),
        "{e}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(1),
        "no handshake"
    );
    // Selections of another shape than the template's: another group, or none.
    let mut other = sels(&jobs);
    other[0][0].0 = 7;
    assert!(matches!(
        t.reads(&workers, other, tokens, &r),
        Err(NoCopy::Shape)
    ));
    assert!(matches!(
        t.reads(&workers, vec![Vec::new()], tokens, &r),
        Err(NoCopy::Shape)
    ));
}

/// Replicated heads (MLA, or GQA with TP above the head count): each consumer rank reads the
/// replica the planners pick for its TP rank (the `tp_rank mod n`-th holder), not the first.
#[test]
fn replicated_heads_pair_as_the_planners_pick_them() {
    let mine = layers("B N D", 2, 1, 40, 1 << 40);
    let mut w = worker(group(mine), Location::Cuda(0));
    w.rank = RankInfo {
        tp_rank: 1,
        tp_size: 2,
        pp_rank: 0,
        pp_size: 1,
    };
    let ranks: Vec<RankLayout> = (0..2u32)
        .map(|i| RankLayout {
            rank: RankInfo {
                tp_rank: i,
                tp_size: 2,
                pp_rank: 0,
                pp_size: 1,
            },
            segment: format!("127.0.0.1:{}", 9 + i),
            groups: vec![group(layers("B N D", 2, 1, 64, (1 << 41) * (i as u64 + 1)))],
        })
        .collect();
    let r = request(&w, 64);
    let t = CopyTemplate::of(std::slice::from_ref(&w), &[vec![job(&w, &r)]], &ranks, &r).unwrap();
    let segs = &t.workers[0].segments;
    assert_eq!(segs.len(), 1);
    assert_eq!(segs[0].0, "127.0.0.1:10", "rank 1 reads the second replica");
    assert!(segs[0].1.iter().all(|(_, _, l)| l.addr >= 1 << 42));
}
