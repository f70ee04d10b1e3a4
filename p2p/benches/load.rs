//! Cost of a load through the connector against the same bytes written by the
//! transfer engine directly, in the same run (docs/design.md §4, §7): TCP loopback,
//! 8 layers × 8 KV heads × 128, bf16, `KV B N H D`, 32 blocks of 16 tokens per
//! load (16 MiB). Report: ratio = engine_direct time / p2p time (1.0 = no overhead).
//!
//! `cargo bench -p kvferry-p2p --bench load`

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::Side;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvferry_checksum::policy::Policy;
use kvferry_p2p::proto::plan::{pair_ranges, Copy};
use kvferry_p2p::{Consumer, ConsumerConfig, LoadGroup, LoadSpec, Producer, ProducerConfig};
use kvferry_transfer::{Op, TransferRequest};

const SHAPE: (u32, u64, u64) = (8, 8, 128);
const BLOCKS: u64 = 64;
const LOADED: u64 = 32;

fn tables() -> (Vec<Option<u64>>, Vec<Option<u64>>) {
    let remote = (0..LOADED).map(|i| Some(i * 2)).collect();
    let local = (0..LOADED).map(|i| Some(BLOCKS - 1 - i)).collect();
    (remote, local)
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let p = Side::shaped(1, 1, BLOCKS, Some(1), SHAPE);
    let cons = Side::shaped(1, 1, BLOCKS, Some(2), SHAPE);
    let (remote, local) = tables();

    // The same copies the producer would make, for the direct baseline.
    let mut copies: Vec<Copy> = Vec::new();
    for (pl, cl) in p.workers[0].groups[0]
        .layers
        .iter()
        .zip(&cons.workers[0].groups[0].layers)
    {
        for (r, l) in remote.iter().zip(&local) {
            let (r, l) = (r.unwrap(), l.unwrap());
            pair_ranges(
                pl.addr,
                &pl.spec.geometry.block_byte_ranges(r),
                cl.addr,
                &cl.spec.geometry.block_byte_ranges(l),
                &mut copies,
            )
            .unwrap();
        }
    }
    let bytes: u64 = copies.iter().map(|c| c.len).sum();
    let requests: Vec<TransferRequest> = copies
        .iter()
        .map(|c| TransferRequest {
            op: Op::Write,
            local_addr: c.src,
            remote_addr: c.dst,
            len: c.len,
        })
        .collect();
    let engine = p.workers[0].engine.clone();
    let target = engine
        .open_segment(&cons.workers[0].engine.segment_name())
        .unwrap();

    let mut g = c.benchmark_group("load_16MiB");
    g.throughput(Throughput::Bytes(bytes));
    g.sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .warm_up_time(Duration::from_secs(1));
    g.bench_function("engine_direct", |b| {
        b.iter(|| {
            let batch = engine.submit(&target, &requests).unwrap();
            engine.wait(batch, Duration::from_secs(30)).unwrap();
        })
    });
    for checksums in [false, true] {
        let name = if checksums {
            "p2p_load_verified"
        } else {
            "p2p_load_no_checksums"
        };
        let (producer, consumer) = rt.block_on(async {
            let pc = ProducerConfig {
                checksums,
                ..ProducerConfig::default()
            };
            let producer = Producer::start(pc, p.workers.clone()).await.unwrap();
            let cc = ConsumerConfig {
                checksums,
                policy: Policy::default(),
                ..ConsumerConfig::default()
            };
            (producer, Consumer::new(cc, cons.workers.clone()).unwrap())
        });
        let mut n = 0u64;
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    n += 1;
                    let id = format!("{name}-{n}");
                    rt.block_on(async {
                        let info = producer
                            .publish(&id, vec![remote.clone()], LOADED * common::BLOCK)
                            .await
                            .unwrap();
                        let spec = LoadSpec {
                            request_id: id.clone(),
                            producer: producer.endpoint().to_string(),
                            groups: vec![LoadGroup {
                                remote_block_size: None,
                                group_id: 0,
                                remote_blocks: remote.clone(),
                                local_blocks: local.clone(),
                            }],
                            num_local_computed: 0,
                            num_tokens: LOADED * common::BLOCK,
                            load_key: Some(info.load_key),
                        };
                        let started = Instant::now();
                        let out = consumer.load(spec).await.unwrap();
                        spent += started.elapsed();
                        assert_eq!(out.bytes, bytes);
                        producer.released();
                    });
                }
                spent
            })
        });
        rt.block_on(producer.shutdown());
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
