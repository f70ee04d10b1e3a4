//! CPU checksum throughput against a plain read of the same buffer, in the same run, on one core
//! (docs/design.md §2.1 fast form, §7). The layer buffer is realistic: `KV B N H D`, bf16, 8 KV heads
//! × 128, 16-token blocks, 256 MiB (4096 blocks). Report: ratio = plain_read time / checksum time
//! (≥ 0.8 targeted).
//!
//! `cargo bench -p kvferry-kernels --bench cpu_checksum`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvferry_checksum::definition::layer_block_checksum;
use kvferry_checksum::group::{LayerSpec, ReplicaKey};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_checksum::select::BlockSelection;
use kvferry_kernels::{ChecksumBackend, CpuBackend, GroupJob, LayerInput, Location};

const BLOCKS: u64 = 4096;

fn layer(layout: &str) -> (LayerSpec, Vec<u8>) {
    let g = Geometry::contiguous(
        Layout::parse(layout).unwrap(),
        BLOCKS,
        16,
        8,
        128,
        ElemBytes::Two,
        1,
    )
    .unwrap();
    let mut z = 0x1234_5678u64;
    let bytes: Vec<u8> = (0..g.byte_len() / 8)
        .flat_map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            z.to_le_bytes()
        })
        .collect();
    let spec = LayerSpec {
        name: "model.layers.3.self_attn.attn".into(),
        layer: 3,
        head_offset: 0,
        geometry: g,
        kind: None,
        dtype: None,
        replica: ReplicaKey::NONE,
    };
    (spec, bytes)
}

fn plain_read(bytes: &[u8]) -> u64 {
    bytes.chunks_exact(8).fold(0u64, |a, c| {
        a.wrapping_add(u64::from_le_bytes(c.try_into().unwrap()))
    })
}

fn checksum_all(spec: &LayerSpec, bytes: &[u8]) -> u64 {
    let n = BLOCKS * 16;
    (0..BLOCKS).fold(0u64, |a, b| {
        a.wrapping_add(layer_block_checksum(spec, bytes, b, b, n))
    })
}

fn bench(c: &mut Criterion) {
    for layout in ["KV B N H D", "B KV H N D"] {
        let (spec, bytes) = layer(layout);
        let mut g = c.benchmark_group(format!("cpu_checksum/{layout}"));
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(6));
        g.bench_function("plain_read", |b| {
            b.iter(|| black_box(plain_read(black_box(&bytes))))
        });
        g.bench_function("checksum", |b| {
            b.iter(|| black_box(checksum_all(black_box(&spec), black_box(&bytes))))
        });
        if layout == "KV B N H D" {
            let backend = CpuBackend::new(1);
            let job = GroupJob {
                group_id: 0,
                block_size: 16,
                layers: vec![LayerInput {
                    spec: spec.clone(),
                    addr: bytes.as_ptr() as u64,
                    len: bytes.len() as u64,
                }],
                selection: BlockSelection {
                    start: 0,
                    block_ids: (0..BLOCKS).collect(),
                },
                num_tokens: BLOCKS * 16,
                device: Location::Cpu,
            };
            g.bench_function("cpu_backend_1_thread", |b| {
                b.iter(|| {
                    // SAFETY: `bytes` outlives the wait below.
                    let p = unsafe { backend.submit(vec![job.clone()]) }.unwrap();
                    black_box(p.wait(Duration::from_secs(60)).unwrap())
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
