//! Host work per load, without I/O or memory: the consumer's request build and grant ranges,
//! the request's encode and decode, the producer's plan, the engine's grant insert, and a read
//! load's plan (in full, from the shape's template, cut into four layer groups), for a
//! Llama-3-8B load of 4,096 tokens (32 layers × 8 KV heads × 128, bf16, `KV B N H D`, 256
//! blocks of 16 tokens: 512 MiB) and a Qwen3-0.6B load of 1,936 tokens (28 layers: 230 MB).
//! The arrays are never touched: their addresses are made up.
//!
//! `cargo bench -p kvferry-p2p --bench host_work` (compare two builds with criterion's
//! `--save-baseline NAME` / `--baseline NAME`).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use kvferry_checksum::group::{LayerSpec, RankInfo, ReplicaKey};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_kernels::LayerInput;
use kvferry_p2p::proto::layout::{RankLayout, WorkerGroup};
use kvferry_p2p::proto::msg::{decode_request, encode};
use kvferry_p2p::proto::read_plan::{read_plans, ReadTemplate};
use kvferry_p2p::proto::request::{build_request, grant_ranges, LoadGroup, LoadSpec};
use kvferry_p2p::proto::serve::{plan, Published};
use kvferry_transfer::{EngineConfig, GrantOps, GrantSpec, Token, TransferEngine, TransportKind};

const BLOCK: u64 = 16;
/// Blocks per layer array (both sides).
const CACHE_BLOCKS: u64 = 1024;

/// One side of `tp` ranks (8 KV heads split among them) of `layers` layers at `base` (each
/// array `CACHE_BLOCKS` blocks).
fn side(base: u64, layers: u32, segment: &str, tp: u32) -> Vec<RankLayout> {
    (0..tp)
        .map(|r| rank(base + ((r as u64) << 36), layers, segment, r, tp))
        .collect()
}

/// TP rank `r` of `tp`: its share of the 8 KV heads in `layers` arrays from `base`.
fn rank(base: u64, layers: u32, segment: &str, r: u32, tp: u32) -> RankLayout {
    let heads = 8 / tp as u64;
    let mut addr = base;
    let layers = (0..layers)
        .map(|layer| {
            let geometry = Geometry::contiguous(
                Layout::parse("KV B N H D").unwrap(),
                CACHE_BLOCKS,
                BLOCK,
                heads,
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
                    head_offset: r * heads as u32,
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
        .collect();
    RankLayout {
        rank: RankInfo {
            tp_rank: r,
            tp_size: tp,
            pp_rank: 0,
            pp_size: 1,
        },
        segment: segment.into(),
        groups: vec![WorkerGroup {
            group_id: 0,
            block_size: BLOCK,
            layers,
            sliding_window: None,
            skipped: None,
        }],
    }
}

/// A load of `tokens` tokens of a model of `layers` layers from a producer of `tp` ranks to a
/// consumer of one; with `tp` > 1 only the producer's plan (every head copied token by token).
fn bench_model(c: &mut Criterion, name: &str, layers: u32, tokens: u64, tp: u32) {
    let producer = side(1 << 40, layers, "10.0.0.1:7000", tp);
    let consumer = side(2 << 40, layers, "10.0.0.2:7000", 1);
    let n = tokens.div_ceil(BLOCK);
    // Scattered tables, as a serving engine's allocator leaves them: every other block.
    let remote: Vec<Option<u64>> = (0..n).map(|i| Some(i * 2 + 1)).collect();
    let local: Vec<Option<u64>> = (0..n)
        .map(|i| Some((n - 1 - i) * 2 % CACHE_BLOCKS))
        .collect();
    let spec = LoadSpec {
        request_id: "r".into(),
        producer: "tcp://p:1".into(),
        groups: vec![LoadGroup {
            group_id: 0,
            remote_blocks: remote.clone(),
            local_blocks: local,
            remote_block_size: None,
        }],
        num_local_computed: 0,
        num_tokens: tokens,
        load_key: None,
    };
    let published = Published {
        blocks: vec![remote],
        num_tokens: tokens,
        payload: None,
    };
    let (request, _) = build_request(&consumer, 1, 1, &spec).unwrap();
    let bytes = encode(&request);
    let engine = TransferEngine::new(EngineConfig {
        host: "127.0.0.1".into(),
        port: 0,
        transport: TransportKind::Tcp,
        ..EngineConfig::default()
    })
    .unwrap();

    let mut g = c.benchmark_group(name);
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(500));
    if tp > 1 {
        g.bench_function("plan", |b| {
            b.iter(|| plan(&producer, &published, &request).unwrap())
        });
        g.finish();
        return;
    }
    g.bench_function("build_request", |b| {
        b.iter(|| build_request(&consumer, 1, 1, &spec).unwrap())
    });
    g.bench_function("grant_ranges", |b| {
        b.iter(|| grant_ranges(&consumer[0], &request))
    });
    g.bench_function("grant", |b| {
        b.iter(|| {
            let ranges = grant_ranges(&consumer[0], &request);
            engine
                .grant(GrantSpec {
                    token: Token::random().unwrap(),
                    ops: GrantOps::WRITE,
                    ranges,
                    ttl: Duration::from_secs(10),
                })
                .unwrap()
        })
    });
    // The consumer's side of a read load: its plan from the producer's layout, the plan of a
    // shape seen before (the template), and the cut into four layer groups.
    let segments = vec!["10.0.0.2:7000".to_string()];
    let template = ReadTemplate::of(&producer, &segments, &request).unwrap();
    g.bench_function("read_plans", |b| {
        b.iter(|| read_plans(&producer, &segments, &request).unwrap().unwrap())
    });
    g.bench_function("read_template", |b| b.iter(|| template.reads(&request)));
    let reads = template.reads(&request);
    let quarters: Vec<_> = (0..4u32)
        .map(|i| i * layers / 4..(i + 1) * layers / 4)
        .collect();
    g.bench_function("read_layer_parts", |b| {
        b.iter(|| {
            quarters
                .iter()
                .flat_map(|q| reads.iter().map(|p| p.layer_part(q)))
                .collect::<Vec<_>>()
        })
    });
    g.bench_function("encode", |b| b.iter(|| encode(&request)));
    g.bench_function("decode", |b| b.iter(|| decode_request(&bytes).unwrap()));
    g.bench_function("plan", |b| {
        b.iter(|| plan(&producer, &published, &request).unwrap())
    });
    g.finish();
}

fn bench(c: &mut Criterion) {
    bench_model(c, "llama3-8b-4096", 32, 4096, 1);
    bench_model(c, "llama3-8b-4096-tp2", 32, 4096, 2);
    bench_model(c, "qwen3-0.6b-1936", 28, 1936, 1);
}

criterion_group!(benches, bench);
criterion_main!(benches);
