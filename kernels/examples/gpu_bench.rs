//! GPU checksum benchmark (docs/design.md §5, §7; method: the device workplace's METHOD.md).
//!
//! Llama-3-8B's KV cache shape (32 layers, 8 KV heads, head 128, bf16), one request of
//! 4096 tokens in 16-token blocks scattered over a large cache (one array per layer, as
//! vLLM holds it). Bytes are counted first; every time is a median of many runs timed with
//! device events; each run checksums a fresh random block list (so no run reads what the
//! last one left in L2) and the cache is refilled with new random data between batches.
//!
//! Reported as ratios to baselines measured in the same run on the same device:
//! * read bandwidth: a plain u64 sum over the same number of contiguous bytes (16-byte
//!   loads, grid-stride) — the device's read ceiling;
//! * same-bytes read: the same plain sum over exactly the byte ranges the checksum reads;
//! * transfer: the same bytes at 50 GB/s (a fast NIC), for the checksum's share of a load.
//!
//! Run: `gpu_bench [--runs N] [--tokens T] [--cache-blocks B]` on a machine with CUDA;
//! prints `SKIPPED: <reason>` and exits 0 elsewhere.
//!
//! Measured on an H200 (driver 580, CUDA 13.0; `scripts/gpu-tests.sh run`, `--runs 100`,
//! 2026-11-30), default (Auto) kernel, ratio of checksum throughput to the contiguous read
//! baseline: vLLM flash layout bf16 0.94, HND bf16 0.96, fp8 0.88; ~0.13 ms of kernel time
//! per 512 MiB request, 1.7% of the same bytes' transfer time at 50 GB/s.

use kvferry_checksum::group::{LayerSpec, ReplicaKey};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_checksum::select::BlockSelection;
use kvferry_kernels::cuda::driver::{DeviceBuffer, Event};
use kvferry_kernels::cuda::tools::Tools;
use kvferry_kernels::cuda::{unavailable_reason, CudaBackend, KernelVariant};
use kvferry_kernels::{ChecksumBackend, CpuBackend, GroupJob, LayerInput, Location};
use rand::seq::index::sample;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::time::{Duration, Instant};

struct Args {
    runs: usize,
    tokens: u64,
    cache_blocks: u64,
}

fn args() -> Args {
    let mut a = Args {
        runs: 60,
        tokens: 4096,
        cache_blocks: 8192,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i + 1 < v.len() {
        let n: u64 = v[i + 1]
            .parse()
            .unwrap_or_else(|_| panic!("{} needs a number", v[i]));
        match v[i].as_str() {
            "--runs" => a.runs = n as usize,
            "--tokens" => a.tokens = n,
            "--cache-blocks" => a.cache_blocks = n,
            o => panic!("unknown option {o}"),
        }
        i += 2;
    }
    a
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn spread(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (s[s.len() / 10], s[s.len() * 9 / 10])
}

struct Shape {
    name: &'static str,
    layout: &'static str,
    elem: ElemBytes,
}

struct Row {
    name: String,
    bytes: u64,
    read_ms: f64,
    ranges_ms: f64,
    kernel_ms: f64,
    kernel_p10_p90: (f64, f64),
    pipeline_ms: f64,
    submit_us: f64,
}

fn main() {
    let a = args();
    if let Some(why) = unavailable_reason() {
        println!("SKIPPED: {why}");
        if std::env::var_os("KVFERRY_REQUIRE_GPU").is_some() {
            std::process::exit(1);
        }
        return;
    }
    let backends: Vec<(KernelVariant, CudaBackend)> = KernelVariant::ALL
        .iter()
        .map(|&v| (v, CudaBackend::with_variant(0, v).expect("cuda backend")))
        .collect();
    let backend = &backends[0].1;
    let tools = Tools::new(backend).expect("tools");
    let ctx = backend.context();
    println!("device: {} (cuda:0)", ctx.name());
    let shapes = [
        Shape {
            name: "llama3-8b KV B N H D (vLLM flash)",
            layout: "KV B N H D",
            elem: ElemBytes::Two,
        },
        Shape {
            name: "llama3-8b B KV H N D (HND)",
            layout: "B KV H N D",
            elem: ElemBytes::Two,
        },
        Shape {
            name: "llama3-8b B KV N H D fp8",
            layout: "B KV N H D",
            elem: ElemBytes::One,
        },
    ];
    let mut rows = Vec::new();
    for shape in &shapes {
        rows.extend(run_shape(&backends, &tools, shape, &a));
    }
    println!();
    println!("| shape | bytes/request | read BW GB/s | checksum GB/s | ratio vs read BW | ratio vs same-bytes read | kernel ms (p10-p90) | per request ms (device) | submit us (host) | 50 GB/s transfer ms | checksum/transfer |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let gbs = |ms: f64| r.bytes as f64 / (ms * 1e-3) / 1e9;
        let xfer_ms = r.bytes as f64 / 50e9 * 1e3;
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.3} | {:.3} | {:.4} ({:.4}-{:.4}) | {:.4} | {:.1} | {:.2} | {:.4} |",
            r.name,
            r.bytes,
            gbs(r.read_ms),
            gbs(r.kernel_ms),
            r.read_ms / r.kernel_ms,
            r.ranges_ms / r.kernel_ms,
            r.kernel_ms,
            r.kernel_p10_p90.0,
            r.kernel_p10_p90.1,
            r.pipeline_ms,
            r.submit_us,
            xfer_ms,
            r.pipeline_ms / xfer_ms,
        );
    }
}

/// The CPU backend's values for `job`: the selected blocks are downloaded into a compact
/// host copy of each layer (same layout, one kernel block per selected block) and
/// checksummed there with the same positions.
fn cpu_reference(tools: &Tools, job: &GroupJob) -> Vec<kvferry_kernels::GroupResult> {
    let nb = job.selection.block_ids.len() as u64;
    let mut hosts = Vec::new();
    let mut layers = Vec::new();
    for l in &job.layers {
        let g = &l.spec.geometry;
        let compact = Geometry::contiguous(
            g.layout.clone(),
            nb * g.kernel_blocks_per_block,
            g.tokens_per_kernel_block,
            g.heads,
            g.head_dim,
            g.elem,
            g.kernel_blocks_per_block,
        )
        .unwrap();
        let mut host = vec![0u8; compact.byte_len() as usize];
        for (i, &id) in job.selection.block_ids.iter().enumerate() {
            for (src, dst) in g
                .block_byte_ranges(id)
                .into_iter()
                .zip(compact.block_byte_ranges(i as u64))
            {
                let bytes = tools
                    .download(l.addr + src.start, (src.end - src.start) as usize)
                    .unwrap();
                host[dst.start as usize..dst.end as usize].copy_from_slice(&bytes);
            }
        }
        let mut spec = l.spec.clone();
        spec.geometry = compact;
        hosts.push(host);
        layers.push(spec);
    }
    let cpu_job = GroupJob {
        layers: layers
            .into_iter()
            .zip(&hosts)
            .map(|(spec, h)| LayerInput {
                spec,
                addr: h.as_ptr() as u64,
                len: h.len() as u64,
            })
            .collect(),
        selection: BlockSelection {
            start: job.selection.start,
            block_ids: (0..nb).collect(),
        },
        device: Location::Cpu,
        ..job.clone()
    };
    // SAFETY: the job's layers are host buffers of this function that outlive the wait below.
    unsafe { CpuBackend::default().submit(vec![cpu_job]) }
        .unwrap()
        .wait(Duration::from_secs(120))
        .unwrap()
}

fn run_shape(
    backends: &[(KernelVariant, CudaBackend)],
    tools: &Tools,
    shape: &Shape,
    a: &Args,
) -> Vec<Row> {
    let (layers, heads, d, n) = (32u32, 8u64, 128u64, 16u64);
    let geometry = Geometry::contiguous(
        Layout::parse(shape.layout).unwrap(),
        a.cache_blocks,
        n,
        heads,
        d,
        shape.elem,
        1,
    )
    .unwrap();
    let layer_bytes = geometry.byte_len();
    let blocks = a.tokens.div_ceil(n);
    // Count the bytes first: every byte of every selected block of every layer, once.
    let bytes: u64 = layers as u64
        * blocks
        * geometry
            .block_byte_ranges(0)
            .iter()
            .map(|r| r.end - r.start)
            .sum::<u64>();
    println!(
        "{}: {layers} layers x {blocks} blocks of {n} tokens, cache {} blocks/layer ({:.1} GiB total), {bytes} bytes/request",
        shape.name,
        a.cache_blocks,
        (layer_bytes * layers as u64) as f64 / (1u64 << 30) as f64
    );
    let stream = tools.stream().unwrap();
    let s = stream.raw();
    let arrays: Vec<DeviceBuffer> = (0..layers)
        .map(|_| tools.alloc(layer_bytes as usize).unwrap())
        .collect();
    let refill = |seed: u64| {
        for (i, b) in arrays.iter().enumerate() {
            // SAFETY: `b` is a live device buffer of `b.len()` bytes and `s` a live stream of its
            // context.
            unsafe { tools.fill_random(b.ptr(), b.len(), seed * 1000 + i as u64, s) }.unwrap();
        }
    };
    let specs: Vec<LayerSpec> = (0..layers)
        .map(|l| LayerSpec {
            name: format!("model.layers.{l}.self_attn.attn"),
            layer: l,
            head_offset: 0,
            geometry: geometry.clone(),
            kind: None,
            dtype: None,
            replica: ReplicaKey::NONE,
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(2026);
    let new_job = |rng: &mut ChaCha8Rng| {
        let ids: Vec<u64> = sample(rng, a.cache_blocks as usize, blocks as usize)
            .into_iter()
            .map(|x| x as u64)
            .collect();
        GroupJob {
            group_id: 0,
            block_size: n,
            layers: specs
                .iter()
                .zip(&arrays)
                .map(|(sp, b)| LayerInput {
                    spec: sp.clone(),
                    addr: b.ptr(),
                    len: b.len() as u64,
                })
                .collect(),
            selection: BlockSelection {
                start: 0,
                block_ids: ids,
            },
            num_tokens: a.tokens,
            device: Location::Cuda(0),
        }
    };
    let out = tools.alloc(8).unwrap();
    let (e0, e1) = (tools.event(true).unwrap(), tools.event(true).unwrap());
    let time = |f: &dyn Fn()| -> f64 {
        // SAFETY: `s` is a live stream of the event's context.
        unsafe { e0.record(s).unwrap() };
        f();
        // SAFETY: `s` is a live stream of the event's context.
        unsafe { e1.record(s).unwrap() };
        e1.synchronize().unwrap();
        Event::elapsed_ms(&e0, &e1).unwrap() as f64
    };
    // Ranges of one job, as a device table for the same-bytes baseline.
    let range_table = |job: &GroupJob| -> (DeviceBuffer, DeviceBuffer, u32) {
        let mut addrs = Vec::new();
        let mut lens = Vec::new();
        for l in &job.layers {
            for &id in &job.selection.block_ids {
                for r in l.spec.geometry.block_byte_ranges(id) {
                    addrs.extend_from_slice(&(l.addr + r.start).to_le_bytes());
                    lens.extend_from_slice(&(r.end - r.start).to_le_bytes());
                }
            }
        }
        let (da, dl) = (
            tools.alloc(addrs.len()).unwrap(),
            tools.alloc(lens.len()).unwrap(),
        );
        tools.upload(da.ptr(), &addrs).unwrap();
        tools.upload(dl.ptr(), &lens).unwrap();
        (da, dl, (addrs.len() / 8) as u32)
    };
    refill(1);
    stream.synchronize().unwrap();
    // At full scale, once: every variant equals the CPU backend bit for bit.
    let job = new_job(&mut rng);
    let want = cpu_reference(tools, &job);
    for (v, backend) in backends {
        // SAFETY: the job's layers are device buffers that outlive the wait; `s` is a live
        // stream.
        let got = unsafe { backend.submit_after(vec![job.clone()], Some(s)) }
            .unwrap()
            .wait(Duration::from_secs(30))
            .unwrap();
        assert_eq!(got, want, "{v:?} differs from the CPU backend");
    }
    println!(
        "  {} values of one request equal the CPU backend's for every variant",
        blocks
    );
    // Warm-up: module load, slot allocation, clocks.
    for _ in 0..5 {
        for (_, backend) in backends {
            let job = new_job(&mut rng);
            // SAFETY: the job's layers are device buffers that outlive the wait; `s` is a live
            // stream.
            unsafe { backend.submit_after(vec![job], Some(s)) }
                .unwrap()
                .wait(Duration::from_secs(10))
                .unwrap();
        }
        time(&|| {
            // SAFETY: the buffers named by the launch outlive its completion (synchronised
            // below); `s` is a live stream.
            unsafe {
                tools.read_sum(
                    arrays[0].ptr(),
                    bytes.min(layer_bytes) as usize / 16 * 16,
                    out.ptr(),
                    s,
                )
            }
            .unwrap()
        });
    }
    let nv = backends.len();
    for (_, b) in backends {
        b.set_kernel_timing(true);
    }
    let (mut read, mut ranges) = (vec![], vec![]);
    let (mut kernel, mut pipeline, mut submit) =
        (vec![vec![]; nv], vec![vec![]; nv], vec![vec![]; nv]);
    let per_layer = (bytes / layers as u64) as usize / 16 * 16;
    for run in 0..a.runs {
        if run % 10 == 0 {
            refill(run as u64 + 2);
        }
        // Read bandwidth: the same byte count, contiguous, in one launch, from a layer
        // array the previous runs did not touch last.
        read.push(if bytes <= layer_bytes {
            let b = &arrays[(run * 7) % arrays.len()];
            time(&|| {
                // SAFETY: `b` holds at least `bytes` bytes and `out` is a live device buffer; `s`
                // is a live stream.
                unsafe { tools.read_sum(b.ptr(), bytes as usize / 16 * 16, out.ptr(), s) }.unwrap()
            })
        } else {
            time(&|| {
                for b in &arrays {
                    // SAFETY: `b` holds at least `per_layer` bytes and `out` is a live device
                    // buffer; `s` is a live stream.
                    unsafe { tools.read_sum(b.ptr(), per_layer, out.ptr(), s) }.unwrap();
                }
            })
        });
        let job = new_job(&mut rng);
        let (da, dl, nr) = range_table(&job);
        ranges.push(time(&|| {
            // SAFETY: `da`/`dl` hold `nr` ranges inside live device buffers; `out` is live; `s`
            // is a live stream.
            unsafe { tools.read_ranges(da.ptr(), dl.ptr(), nr, out.ptr(), s) }.unwrap()
        }));
        // The variants take turns, each on a fresh block list.
        for (vi, (_, backend)) in backends.iter().enumerate() {
            let job = new_job(&mut rng);
            // Per request on the device: ordered after `s`, then `s` waits for the results.
            // SAFETY: `s` is a live stream of the event's context.
            unsafe { e0.record(s).unwrap() };
            let t = Instant::now();
            // SAFETY: the job's layers are device buffers that outlive the wait; `s` is a live
            // stream.
            let mut p = unsafe { backend.submit_after(vec![job], Some(s)) }.unwrap();
            submit[vi].push(t.elapsed().as_secs_f64() * 1e6);
            // SAFETY: `s` is a live stream of the backend's context.
            unsafe { p.order_before(s).unwrap() };
            // SAFETY: `s` is a live stream of the event's context.
            unsafe { e1.record(s).unwrap() };
            let r = p.wait_mut(Duration::from_secs(10)).unwrap();
            assert_eq!(r[0].values[&ReplicaKey::NONE].len(), blocks as usize);
            e1.synchronize().unwrap();
            pipeline[vi].push(Event::elapsed_ms(&e0, &e1).unwrap() as f64);
            kernel[vi].push(p.kernel_ms().expect("kernel timing on") as f64);
        }
    }
    // The copy launches (`submit_copying`): the same blocks copied from a second set of arrays
    // into these and checksummed as stored, against twice the bytes moved at read bandwidth.
    let sources: Vec<DeviceBuffer> = (0..layers)
        .map(|_| tools.alloc(layer_bytes as usize).unwrap())
        .collect();
    for (i, b) in sources.iter().enumerate() {
        // SAFETY: `b` is a live device buffer of `b.len()` bytes and `s` a live stream.
        unsafe { tools.fill_random(b.ptr(), b.len(), 77 + i as u64, s) }.unwrap();
    }
    stream.synchronize().unwrap();
    let mut copy = vec![vec![]; nv];
    for _ in 0..a.runs {
        for (vi, (_, backend)) in backends.iter().enumerate() {
            let job = new_job(&mut rng);
            let from = new_job(&mut rng).selection.block_ids;
            let copy_job = kvferry_kernels::CopyJob {
                sources: job
                    .layers
                    .iter()
                    .zip(&sources)
                    .map(|(l, b)| LayerInput {
                        addr: b.ptr(),
                        ..l.clone()
                    })
                    .collect(),
                source_blocks: from,
                job,
            };
            // SAFETY: both sides are device buffers that outlive the wait.
            let mut p = unsafe { backend.submit_copying(vec![copy_job], Vec::new()) }.unwrap();
            p.wait_mut(Duration::from_secs(10)).unwrap();
            copy[vi].push(p.kernel_ms().expect("kernel timing on") as f64);
        }
    }
    drop(sources);
    for (vi, (v, _)) in backends.iter().enumerate() {
        println!(
            "  {v:?}: copy + checksum kernel {:.4} ms (p10-p90 {:.4}-{:.4}); reading and writing the bytes once at read bandwidth {:.4} ms",
            median(copy[vi].clone()),
            spread(&copy[vi]).0,
            spread(&copy[vi]).1,
            2.0 * median(read.clone()),
        );
    }
    for (_, b) in backends {
        b.set_kernel_timing(false);
    }
    println!(
        "  medians over {} runs: read {:.4} ms (p10-p90 {:.4}-{:.4}), same-bytes read {:.4} ms",
        a.runs,
        median(read.clone()),
        spread(&read).0,
        spread(&read).1,
        median(ranges.clone()),
    );
    backends
        .iter()
        .enumerate()
        .map(|(vi, (v, _))| {
            let row = Row {
                name: format!("{} [{v:?}]", shape.name),
                bytes,
                read_ms: median(read.clone()),
                ranges_ms: median(ranges.clone()),
                kernel_ms: median(kernel[vi].clone()),
                kernel_p10_p90: spread(&kernel[vi]),
                pipeline_ms: median(pipeline[vi].clone()),
                submit_us: median(submit[vi].clone()),
            };
            println!(
                "  {v:?}: checksum kernel {:.4} ms, per request {:.4} ms",
                row.kernel_ms, row.pipeline_ms
            );
            row
        })
        .collect()
}
