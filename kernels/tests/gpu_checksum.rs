//! GPU checksum kernel against the tests' oracle, the definition's direct form (docs/design.md
//! §5, `kvferry_kernels::oracle`): random data, every layout of §2.2, element sizes 1/2/4/8,
//! kernel-block splits, random block lists, partial last blocks, replica keys, strided and
//! misaligned arrays; and the asynchrony contract (the
//! caller's stream is never synchronised; work is ordered after it).
//!
//! Every test prints `SKIPPED: <reason>` and passes where no usable CUDA device exists
//! (this is what CI sees). `scripts/gpu-tests.sh` runs them on a GPU machine.

use kvferry_checksum::group::{LayerSpec, ReplicaKey};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_checksum::select::BlockSelection;
use kvferry_kernels::cuda::driver::{DeviceBuffer, EventState};
use kvferry_kernels::cuda::tools::Tools;
use kvferry_kernels::cuda::view::{launch_plan, MODE_GENERIC, MODE_VEC16, MODE_VEC8};
use kvferry_kernels::cuda::{unavailable_reason, CudaBackend, KernelVariant};
use kvferry_kernels::oracle::direct_values;
use kvferry_kernels::sync::MutexExt;
use kvferry_kernels::{
    backend_for, ChecksumBackend, GroupJob, GroupResult, KernelError, LayerInput, Location,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

/// GPU tests run one at a time: another test's cuMemFree may wait for the whole device
/// (and hold the driver's locks meanwhile), which would blur the asynchrony test.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.locked()
}

fn gpu(test: &str) -> Option<(CudaBackend, Tools)> {
    if let Some(why) = unavailable_reason() {
        // scripts/gpu-tests.sh sets this on a machine with a GPU, where skipping would hide a fault.
        if std::env::var_os("KVFERRY_REQUIRE_GPU").is_some() {
            panic!("{test}: KVFERRY_REQUIRE_GPU is set but CUDA is unusable: {why}");
        }
        // Straight to stderr: libtest hides a passing test's eprintln! output.
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
        return None;
    }
    let b =
        CudaBackend::new(0).unwrap_or_else(|e| panic!("CUDA present but the backend failed: {e}"));
    let t = Tools::new(&b).unwrap_or_else(|e| panic!("tools: {e}"));
    Some((b, t))
}

/// Backends for the kernel variants other than the default.
fn other_variants() -> Vec<CudaBackend> {
    KernelVariant::ALL
        .iter()
        .filter(|&&v| v != KernelVariant::DEFAULT)
        .map(|&v| CudaBackend::with_variant(0, v).unwrap())
        .collect()
}

const LAYOUTS: [&str; 9] = [
    "KV B N H D",
    "B KV N H D",
    "B KV H N D",
    "B H N KV D",
    "B N D",
    "B N H D",
    "H B N KV D",
    "B N KV H D",
    "KV B H N D",
];

/// One layer's geometry: block size `kbpb * n` fixed by the job, the rest random;
/// sometimes padded strides (rows apart, heads apart, a strided D).
fn random_geometry(rng: &mut ChaCha8Rng, n: u64, kbpb: u64, nblocks: u64) -> Geometry {
    loop {
        let layout = Layout::parse(LAYOUTS[rng.random_range(0..LAYOUTS.len())]).unwrap();
        let elem = [
            ElemBytes::One,
            ElemBytes::Two,
            ElemBytes::Four,
            ElemBytes::Eight,
        ][rng.random_range(0..4)];
        let d = [1u64, 2, 3, 4, 8, 12, 16, 64, 128, 96][rng.random_range(0..10)];
        let h = if layout.has_heads() {
            rng.random_range(1..5)
        } else {
            1
        };
        let g = Geometry::contiguous(layout, kbpb * nblocks, n, h, d, elem, kbpb).unwrap();
        if g.pieces_per_cell().is_none() {
            continue;
        }
        if rng.random_bool(0.35) {
            let pad = [elem as u64, 8, 16, 48][rng.random_range(0..4)];
            let dims = g.layout.dims().to_vec();
            let mut strides = vec![0u64; dims.len()];
            let mut span = elem as u64;
            for k in (0..dims.len()).rev() {
                let extra = if rng.random_bool(0.5) { pad } else { 0 };
                // A strided D (extra bytes between elements) forces the generic path.
                strides[k] = if k + 1 == dims.len() {
                    span + if rng.random_bool(0.3) { elem as u64 } else { 0 }
                } else {
                    span + extra
                };
                span = strides[k] * g.size_of(dims[k]);
            }
            if let Ok(g2) = g.clone().with_strides(strides) {
                return g2;
            }
        }
        return g;
    }
}

struct Case {
    specs: Vec<LayerSpec>,
    host: Vec<Vec<u8>>,
    offsets: Vec<u64>,
    block_ids: Vec<u64>,
    start: u64,
    num_tokens: u64,
    block_size: u64,
}

fn random_case(rng: &mut ChaCha8Rng) -> Case {
    let n = [1u64, 2, 3, 4, 8, 16][rng.random_range(0..6)];
    let kbpb = [1u64, 1, 2, 3][rng.random_range(0..4)];
    let nblocks = rng.random_range(1..7);
    let nl = rng.random_range(1..5);
    let replica_choices = [
        ReplicaKey::NONE,
        ReplicaKey {
            replicas: 2,
            index: 0,
        },
        ReplicaKey {
            replicas: 2,
            index: 1,
        },
    ];
    let mut specs = Vec::new();
    for l in 0..nl {
        // Same block size for every layer; sometimes one kernel block holds the whole block.
        let (n_l, k_l) = if rng.random_bool(0.2) {
            (n * kbpb, 1)
        } else {
            (n, kbpb)
        };
        let g = random_geometry(rng, n_l, k_l, nblocks);
        let layer = rng.random_range(0..80u32) + 100 * l;
        specs.push(LayerSpec {
            name: format!("model.layers.{layer}.self_attn.attn"),
            layer,
            head_offset: rng.random_range(0..64),
            geometry: g,
            kind: None,
            dtype: None,
            replica: if rng.random_bool(0.3) {
                replica_choices[rng.random_range(0..3)]
            } else {
                ReplicaKey::NONE
            },
        });
    }
    let host: Vec<Vec<u8>> = specs
        .iter()
        .map(|s| {
            (0..s.geometry.byte_len())
                .map(|_| rng.random::<u8>())
                .collect()
        })
        .collect();
    // Offsets in one device buffer: 256-aligned, or shifted by 8 or by an odd amount.
    let mut offsets = Vec::new();
    let mut off = 0u64;
    for h in &host {
        let shift = [0u64, 0, 8, 1, 3][rng.random_range(0..5)];
        offsets.push(off + shift);
        off = (off + shift + h.len() as u64).div_ceil(256) * 256;
    }
    let count = rng.random_range(0..=(nblocks + 2));
    let block_ids: Vec<u64> = (0..count).map(|_| rng.random_range(0..nblocks)).collect();
    let start = rng.random_range(0..4);
    let bs = n * kbpb;
    let full = (start + count) * bs;
    let num_tokens = match rng.random_range(0..3) {
        0 => full,
        1 => full.saturating_sub(rng.random_range(0..bs.max(1))),
        _ => rng.random_range(0..=full + bs),
    };
    Case {
        specs,
        host,
        offsets,
        block_ids,
        start,
        num_tokens,
        block_size: bs,
    }
}

fn job(case: &Case, group_id: u32, device: Location, addrs: &[u64]) -> GroupJob {
    GroupJob {
        group_id,
        block_size: case.block_size,
        layers: case
            .specs
            .iter()
            .zip(addrs)
            .zip(&case.host)
            .map(|((s, &a), h)| LayerInput {
                spec: s.clone(),
                addr: a,
                len: h.len() as u64,
            })
            .collect(),
        selection: BlockSelection {
            start: case.start,
            block_ids: case.block_ids.clone(),
        },
        num_tokens: case.num_tokens,
        device,
    }
}

fn upload_case(tools: &Tools, case: &Case) -> (DeviceBuffer, Vec<u64>) {
    let total = case.offsets.last().copied().unwrap_or(0)
        + case.host.last().map(|h| h.len() as u64).unwrap_or(0);
    let buf = tools.alloc(total as usize + 256).unwrap();
    for (h, &o) in case.host.iter().zip(&case.offsets) {
        tools.upload(buf.ptr() + o, h).unwrap();
    }
    let addrs = case.offsets.iter().map(|&o| buf.ptr() + o).collect();
    (buf, addrs)
}

/// The oracle's results for `cases` (group `i` is `cases[i]`), from their host copies.
fn want_results(cases: &[Case]) -> Vec<GroupResult> {
    cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let layers: Vec<(&LayerSpec, &[u8])> = c
                .specs
                .iter()
                .zip(&c.host)
                .map(|(s, h)| (s, h.as_slice()))
                .collect();
            let selection = BlockSelection {
                start: c.start,
                block_ids: c.block_ids.clone(),
            };
            GroupResult {
                group_id: i as u32,
                start: c.start,
                values: direct_values(&layers, &selection, c.num_tokens),
            }
        })
        .collect()
}

#[test]
fn gpu_matches_oracle_on_random_layouts() {
    let _serial = serial();
    let Some((backend, tools)) = gpu("gpu_matches_oracle_on_random_layouts") else {
        return;
    };
    let others = other_variants();
    let mut rng = ChaCha8Rng::seed_from_u64(0x6b76_6665);
    let mut modes = [0usize; 3];
    let mut regular = 0usize;
    let mut elems = [0usize; 9];
    let mut partial = 0;
    let mut replicated = 0;
    let mut compared = 0usize;
    for round in 0..150 {
        // Several groups in one submission: one launch each.
        let cases: Vec<Case> = (0..rng.random_range(1..4))
            .map(|_| random_case(&mut rng))
            .collect();
        let mut bufs = Vec::new();
        let mut jobs = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            let (buf, addrs) = upload_case(&tools, c);
            let layers: Vec<(&LayerSpec, u64, u64)> = c
                .specs
                .iter()
                .zip(&addrs)
                .zip(&c.host)
                .map(|((s, &a), h)| (s, a, h.len() as u64))
                .collect();
            for v in launch_plan(&layers, &c.block_ids, c.start, c.num_tokens)
                .unwrap()
                .views
            {
                modes[v.mode as usize] += 1;
                regular += (v.regular != 0) as usize;
            }
            for s in &c.specs {
                elems[s.geometry.elem as usize] += 1;
                replicated += (s.replica != ReplicaKey::NONE) as usize;
            }
            partial += (c.num_tokens % c.block_size != 0) as usize;
            jobs.push(job(c, i as u32, Location::Cuda(0), &addrs));
            bufs.push(buf);
        }
        let want = want_results(&cases);
        for b in std::iter::once(&backend).chain(&others) {
            // SAFETY: the jobs' layers are device buffers of this test that outlive the wait.
            let got = unsafe { b.submit(jobs.clone()) }
                .unwrap()
                .wait(WAIT)
                .unwrap();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(
                    g, w,
                    "round {round}: specs {:?}",
                    cases[g.group_id as usize].specs
                );
                compared += w.values.values().map(|v| v.len()).sum::<usize>();
            }
        }
    }
    eprintln!(
        "compared {compared} values; views per path (vec16, vec8, generic) = {modes:?} ({regular} regular); elem sizes 1/2/4/8 = {:?}; \
         partial last blocks {partial}; replicated layers {replicated}",
        [elems[1], elems[2], elems[4], elems[8]]
    );
    assert!(
        modes[MODE_VEC16 as usize] > 20
            && modes[MODE_VEC8 as usize] > 20
            && modes[MODE_GENERIC as usize] > 20
            && regular > 20
    );
    assert!(
        elems[1] > 0
            && elems[2] > 0
            && elems[4] > 0
            && elems[8] > 0
            && partial > 0
            && replicated > 0
    );
}

#[allow(clippy::too_many_arguments)]
fn fixed_case(
    rng: &mut ChaCha8Rng,
    layout: &str,
    nblocks: u64,
    n: u64,
    h: u64,
    d: u64,
    elem: ElemBytes,
    layers: u32,
) -> Case {
    let specs: Vec<LayerSpec> = (0..layers)
        .map(|l| LayerSpec {
            name: format!("model.layers.{l}.self_attn.attn"),
            layer: l,
            head_offset: 8,
            geometry: Geometry::contiguous(
                Layout::parse(layout).unwrap(),
                nblocks,
                n,
                h,
                d,
                elem,
                1,
            )
            .unwrap(),
            kind: None,
            dtype: None,
            replica: ReplicaKey::NONE,
        })
        .collect();
    let host: Vec<Vec<u8>> = specs
        .iter()
        .map(|s| {
            (0..s.geometry.byte_len())
                .map(|_| rng.random::<u8>())
                .collect()
        })
        .collect();
    let mut offsets = Vec::new();
    let mut off = 0;
    for hb in &host {
        offsets.push(off);
        off = (off + hb.len() as u64).div_ceil(256) * 256;
    }
    let count = nblocks.min(24);
    let block_ids: Vec<u64> = (0..count).map(|_| rng.random_range(0..nblocks)).collect();
    let num_tokens = count * n - n / 2;
    Case {
        specs,
        host,
        offsets,
        block_ids,
        start: 0,
        num_tokens,
        block_size: n,
    }
}

/// Real model shapes: Llama-style GQA in four layouts (rows of 16 chunks), MLA's 576-wide
/// latent rows (72 chunks: not a power of two), a 4096-element fp32 row (more chunks than
/// threads), fp8.
#[test]
fn gpu_matches_oracle_on_model_shapes() {
    let _serial = serial();
    let Some((backend, tools)) = gpu("gpu_matches_oracle_on_model_shapes") else {
        return;
    };
    let others = other_variants();
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    let shapes: Vec<(&str, u64, u64, u64, ElemBytes)> = vec![
        ("KV B N H D", 16, 8, 128, ElemBytes::Two),
        ("B KV N H D", 16, 8, 128, ElemBytes::Two),
        ("B KV H N D", 16, 8, 128, ElemBytes::Two),
        ("B H N KV D", 16, 8, 128, ElemBytes::Two),
        ("B N D", 64, 1, 576, ElemBytes::Two),
        ("B N D", 4, 1, 4096, ElemBytes::Four),
        ("KV B N H D", 32, 4, 128, ElemBytes::One),
    ];
    for (layout, n, h, d, e) in shapes {
        let case = fixed_case(&mut rng, layout, 40, n, h, d, e, 3);
        let (buf, addrs) = upload_case(&tools, &case);
        let want = want_results(std::slice::from_ref(&case));
        for b in std::iter::once(&backend).chain(&others) {
            // SAFETY: the job's layers are device buffers of this test that outlive the wait.
            let got = unsafe { b.submit(vec![job(&case, 0, Location::Cuda(0), &addrs)]) }
                .unwrap()
                .wait(WAIT)
                .unwrap();
            assert_eq!(got, want, "{layout} n={n} h={h} d={d} e={e:?}");
        }
        drop(buf);
    }
}

/// The caller's stream is never synchronised: with a 2 s spin kernel queued on it, submit
/// returns while the spin still runs, and the checksums wait for it on the device. The
/// spin is followed on the caller's stream by a refill of the KV, so results equal to the
/// CPU's over the refilled bytes show the work was ordered after the caller's stream.
#[test]
fn gpu_submit_never_synchronises_the_caller_stream() {
    let _serial = serial();
    let Some((backend, tools)) = gpu("gpu_submit_never_synchronises_the_caller_stream") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut case = fixed_case(&mut rng, "KV B N H D", 64, 16, 8, 128, ElemBytes::Two, 4);
    let (buf, addrs) = upload_case(&tools, &case);
    let caller = tools.stream().unwrap();
    let flag = tools.alloc(8).unwrap();
    tools.upload(flag.ptr(), &[0u8; 8]).unwrap();
    // Warm: the first submission may load lazily-initialised driver state.
    // SAFETY: the buffers the launch names live until the end of the test, after it completes.
    unsafe {
        backend.submit_after(
            vec![job(&case, 0, Location::Cuda(0), &addrs)],
            Some(caller.raw()),
        )
    }
    .unwrap()
    .wait(WAIT)
    .unwrap();
    let spun = tools.event(false).unwrap();
    // SAFETY: `flag` is a live device buffer and `caller` a live stream of the backend's context.
    unsafe { tools.spin(2_000_000_000, flag.ptr(), caller.raw()) }.unwrap();
    // SAFETY: `caller` is a live stream of the event's context.
    unsafe { spun.record(caller.raw()).unwrap() };
    // Rewrite every layer after the spin, on the caller's stream.
    for (h, &a) in case.host.iter().zip(&addrs) {
        // SAFETY: the range lies inside the live device buffer `h` names; `caller` is a live
        // stream.
        unsafe { tools.fill_random(a - (a % 8), h.len() / 8 * 8, 77, caller.raw()) }.unwrap();
    }
    let t = std::time::Instant::now();
    // SAFETY: the job's layers are device buffers that outlive the wait; `caller` is a live
    // stream.
    let mut pending = unsafe {
        backend.submit_after(
            vec![job(&case, 0, Location::Cuda(0), &addrs)],
            Some(caller.raw()),
        )
    }
    .unwrap();
    eprintln!(
        "submit_after returned after {:?} with a 2 s spin queued on the caller's stream",
        t.elapsed()
    );
    assert_eq!(
        spun.query().unwrap(),
        EventState::Pending,
        "submit waited for the caller's stream"
    );
    assert!(
        pending.poll().is_none(),
        "checksums finished before the caller's stream reached them"
    );
    let got = pending.wait_mut(WAIT).unwrap();
    assert_eq!(spun.query().unwrap(), EventState::Done);
    assert_eq!(
        tools.download(flag.ptr(), 8).unwrap()[0],
        1,
        "spin kernel did not run"
    );
    for (h, &a) in case.host.iter_mut().zip(&addrs) {
        *h = tools.download(a, h.len()).unwrap();
    }
    let want = want_results(std::slice::from_ref(&case));
    assert_eq!(
        got, want,
        "checksums did not see the caller stream's writes"
    );
    drop(buf);
}

/// A pending result dropped while the device still works does not free or reuse its
/// buffers early: later submissions stay correct.
#[test]
fn gpu_dropped_pending_is_safe() {
    let _serial = serial();
    let Some((backend, tools)) = gpu("gpu_dropped_pending_is_safe") else {
        return;
    };
    dropped_pending_is_safe(&backend, &tools);
    // With 2 slots ahead: the submissions past them allocate on the submit path, and the
    // dropped ones' slots are retired, then reused once their work completed.
    let small = CudaBackend::with_slots(0, 2).unwrap();
    dropped_pending_is_safe(&small, &tools);
}

fn dropped_pending_is_safe(backend: &CudaBackend, tools: &Tools) {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let case = fixed_case(&mut rng, "B KV H N D", 64, 16, 8, 128, ElemBytes::Two, 4);
    let (buf, addrs) = upload_case(tools, &case);
    let want = want_results(std::slice::from_ref(&case));
    let caller = tools.stream().unwrap();
    let flag = tools.alloc(8).unwrap();
    // SAFETY: `flag` is a live device buffer and `caller` a live stream of the backend's context.
    unsafe { tools.spin(200_000_000, flag.ptr(), caller.raw()) }.unwrap();
    for _ in 0..8 {
        // SAFETY: the job's layers are device buffers that outlive the wait; `caller` is a live
        // stream.
        let p = unsafe {
            backend.submit_after(
                vec![job(&case, 0, Location::Cuda(0), &addrs)],
                Some(caller.raw()),
            )
        }
        .unwrap();
        drop(p);
    }
    for _ in 0..8 {
        // SAFETY: the job's layers are device buffers of this test that outlive the wait.
        let got = unsafe { backend.submit(vec![job(&case, 0, Location::Cuda(0), &addrs)]) }
            .unwrap()
            .wait(WAIT)
            .unwrap();
        assert_eq!(got, want);
    }
    caller.synchronize().unwrap();
    drop(buf);
}

#[test]
fn gpu_rejects_bad_jobs() {
    let _serial = serial();
    let Some((backend, tools)) = gpu("gpu_rejects_bad_jobs") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let case = fixed_case(&mut rng, "KV B N H D", 8, 16, 2, 64, ElemBytes::Two, 2);
    let (buf, addrs) = upload_case(&tools, &case);
    let mut bad = job(&case, 3, Location::Cuda(0), &addrs);
    bad.selection.block_ids.push(8);
    assert!(matches!(
        // SAFETY: refused before any byte is read (the test's point); no memory is touched.
        unsafe { backend.submit(vec![bad]) },
        Err(KernelError::InvalidJob { group_id: 3, .. })
    ));
    let cpu_job = job(&case, 4, Location::Cpu, &addrs);
    assert!(matches!(
        // SAFETY: refused before any byte is read (the test's point); no memory is touched.
        unsafe { backend.submit(vec![cpu_job]) },
        Err(KernelError::InvalidJob { group_id: 4, .. })
    ));
    let mut short = job(&case, 5, Location::Cuda(0), &addrs);
    short.layers[0].len -= 1;
    assert!(matches!(
        // SAFETY: refused before any byte is read (the test's point); no memory is touched.
        unsafe { backend.submit(vec![short]) },
        Err(KernelError::InvalidJob { group_id: 5, .. })
    ));
    drop(buf);
}

/// `backend_for(Cuda(0))` is the CUDA backend where CUDA works and the CPU backend (no
/// panic) where it does not: this test runs, and asserts, on both kinds of machine.
#[test]
fn gpu_backend_for_picks_cuda_when_usable() {
    let b = backend_for(Location::Cuda(0));
    match unavailable_reason() {
        Some(why) => {
            eprintln!("no CUDA here ({why}): expecting the CPU fallback");
            assert_eq!(b.name(), "cpu");
        }
        None => assert_eq!(b.name(), "cuda"),
    }
}

/// Submissions in flight up to the slots allocated with the backend take no allocation,
/// which would synchronise the device: with a 2 s spin queued on a stream of its own, 100
/// submissions all return while it still runs, and their results are right.
#[test]
fn gpu_submissions_in_flight_never_wait_for_other_streams() {
    let _serial = serial();
    let Some((backend, tools)) = gpu("gpu_submissions_in_flight_never_wait_for_other_streams")
    else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let case = fixed_case(&mut rng, "KV B N H D", 64, 16, 8, 128, ElemBytes::Two, 4);
    let (buf, addrs) = upload_case(&tools, &case);
    let want = want_results(std::slice::from_ref(&case));
    let other = tools.stream().unwrap();
    let flag = tools.alloc(8).unwrap();
    let spun = tools.event(false).unwrap();
    // SAFETY: `flag` is a live device buffer and `other` a live stream of the backend's context.
    unsafe { tools.spin(2_000_000_000, flag.ptr(), other.raw()) }.unwrap();
    // SAFETY: `other` is a live stream of the event's context.
    unsafe { spun.record(other.raw()).unwrap() };
    let pending: Vec<_> = (0..100)
        .map(|_| {
            // SAFETY: the job's layers are device buffers of this test that outlive the waits.
            unsafe { backend.submit(vec![job(&case, 0, Location::Cuda(0), &addrs)]) }.unwrap()
        })
        .collect();
    assert_eq!(
        spun.query().unwrap(),
        EventState::Pending,
        "a submit waited for another stream's work (an allocation on the submit path)"
    );
    for p in pending {
        assert_eq!(p.wait(WAIT).unwrap(), want);
    }
    assert_eq!(
        spun.query().unwrap(),
        EventState::Pending,
        "the results waited for another stream's work"
    );
    other.synchronize().unwrap();
    drop(buf);
}

/// Parts allocated ahead are disjoint, 256-byte aligned and each its own: what goes up
/// from one part's host bytes lands in that part's device bytes only. Tables allocated
/// ahead hold what they were asked for.
#[test]
fn gpu_staging_parts_are_disjoint() {
    use kvferry_cuda::ipc::PieceTable;
    use kvferry_cuda::staging::Staging;
    use kvferry_kernels::cuda::driver::Context;
    let _serial = serial();
    let Some((_backend, tools)) = gpu("gpu_staging_parts_are_disjoint") else {
        return;
    };
    let ctx = Context::new(0).unwrap();
    let parts = Staging::ahead(&ctx, 1000, 8).unwrap();
    assert_eq!(parts.len(), 8);
    for (i, p) in parts.iter().enumerate() {
        assert_eq!(p.len(), 1024, "rounded up to 256 bytes");
        assert_eq!(p.dev() % 256, 0);
        assert_eq!(p.host() as usize % 256, 0);
        if i > 0 {
            assert_eq!(p.dev(), parts[i - 1].dev() + 1024);
            assert_eq!(p.host() as usize, parts[i - 1].host() as usize + 1024);
        }
        // SAFETY: the part's host bytes are its own and live while `parts` does.
        unsafe { std::ptr::write_bytes(p.host(), i as u8 + 1, p.len()) };
    }
    for p in &parts {
        // SAFETY: as above; nothing else writes them meanwhile.
        let host = unsafe { std::slice::from_raw_parts(p.host(), p.len()) };
        tools.upload(p.dev(), host).unwrap();
    }
    for (i, p) in parts.iter().enumerate() {
        let got = tools.download(p.dev(), p.len()).unwrap();
        assert!(got.iter().all(|&b| b == i as u8 + 1), "part {i}");
    }
    assert!(Staging::ahead(&ctx, 0, 8).unwrap().is_empty());
    assert!(Staging::ahead(&ctx, 64, 0).unwrap().is_empty());
    let tables = PieceTable::ahead(&ctx, 256 << 10, 4).unwrap();
    assert_eq!(tables.len(), 4);
    assert!(tables.iter().all(|t| t.capacity() == 256 << 10));
    assert_eq!(PieceTable::new().capacity(), 0);
}

/// Every cell of `dst`'s selected blocks (tokens before `num_tokens`) with `src`'s at the
/// paired block, element by element through the geometries' strides: an independent copy.
#[allow(clippy::too_many_arguments)]
fn copy_cells(
    dst: &Geometry,
    dmem: &mut [u8],
    src: &Geometry,
    smem: &[u8],
    ids: &[u64],
    src_ids: &[u64],
    num_tokens: u64,
) {
    use kvferry_checksum::layout::Dim;
    let (n, e) = (dst.tokens_per_kernel_block, dst.elem.get() as usize);
    for (b, (&id, &sid)) in ids.iter().zip(src_ids).enumerate() {
        for t in 0..dst
            .block_size()
            .min(num_tokens.saturating_sub(b as u64 * dst.block_size()))
        {
            for h in 0..dst.heads {
                for part in 0..dst.parts() {
                    for d in 0..dst.head_dim {
                        let at = |g: &Geometry, block: u64| {
                            ((block * g.kernel_blocks_per_block + t / n) * g.stride_of(Dim::B)
                                + part * g.stride_of(Dim::Kv)
                                + (t % n) * g.stride_of(Dim::N)
                                + h * g.stride_of(Dim::H)
                                + d * g.stride_of(Dim::D)) as usize
                        };
                        let (o, so) = (at(dst, id), at(src, sid));
                        dmem[o..o + e].copy_from_slice(&smem[so..so + e]);
                    }
                }
            }
        }
    }
}

/// The copy kernels on real model shapes: each moves exactly the cells it checksums from the
/// source's blocks into the layer's (another block count, so other `B`/`KV` strides), and
/// its values are the oracle's over the source's blocks; every variant.
#[test]
fn gpu_copy_checksum_moves_what_it_sums() {
    let _serial = serial();
    let Some((backend, tools)) = gpu("gpu_copy_checksum_moves_what_it_sums") else {
        return;
    };
    let others = other_variants();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let shapes: Vec<(&str, u64, u64, u64, ElemBytes)> = vec![
        ("KV B N H D", 16, 8, 128, ElemBytes::Two),
        ("B KV N H D", 16, 8, 128, ElemBytes::Two),
        ("B KV H N D", 16, 8, 128, ElemBytes::Two),
        ("B N D", 64, 1, 576, ElemBytes::Two),
        ("B N D", 4, 1, 4096, ElemBytes::Four),
        ("KV B N H D", 32, 4, 128, ElemBytes::One),
    ];
    for (layout, n, h, d, e) in shapes {
        let src = fixed_case(&mut rng, layout, 40, n, h, d, e, 3);
        let mut dst = fixed_case(&mut rng, layout, 30, n, h, d, e, 3);
        // Distinct blocks to write; the source's own (random) blocks to read.
        let mut ids: Vec<u64> = (0..30).collect();
        ids.shuffle(&mut rng);
        ids.truncate(src.block_ids.len());
        dst.block_ids = ids.clone();
        dst.num_tokens = src.num_tokens;
        let (sbuf, saddrs) = upload_case(&tools, &src);
        let want = want_results(std::slice::from_ref(&src));
        let mut want_bytes = dst.host.clone();
        for (l, w) in want_bytes.iter_mut().enumerate() {
            let (dg, sg) = (&dst.specs[l].geometry, &src.specs[l].geometry);
            copy_cells(
                dg,
                w,
                sg,
                &src.host[l],
                &ids,
                &src.block_ids,
                src.num_tokens,
            );
        }
        for b in std::iter::once(&backend).chain(&others) {
            let (dbuf, daddrs) = upload_case(&tools, &dst);
            let copy = kvferry_kernels::CopyJob {
                job: job(&dst, 0, Location::Cuda(0), &daddrs),
                sources: job(&src, 0, Location::Cuda(0), &saddrs).layers,
                source_blocks: src.block_ids.clone(),
            };
            // SAFETY: both sides are device buffers of this test that outlive the wait.
            let got = unsafe { b.submit_copying(vec![copy], Vec::new()) }
                .unwrap()
                .wait(WAIT)
                .unwrap();
            assert_eq!(got, want, "{layout} n={n} h={h} d={d} e={e:?}");
            for (l, w) in want_bytes.iter().enumerate() {
                let bytes = tools.download(daddrs[l], w.len()).unwrap();
                assert!(bytes == *w, "{layout} layer {l}: landed bytes differ");
            }
            drop(dbuf);
        }
        drop(sbuf);
    }
}

/// The CPU backend does not copy: a copy job is refused, nothing touched.
#[test]
fn the_cpu_backend_refuses_copy_jobs() {
    let cpu = backend_for(Location::Cpu);
    // SAFETY: refused before any memory is read.
    let r = unsafe { cpu.submit_copying(Vec::new(), Vec::new()) };
    assert!(matches!(r, Err(KernelError::NoCopy)), "{r:?}");
}
