//! The CPU backend (docs/design.md §5): results equal the direct form of §2.1 summed per replica key,
//! for several layers, layouts and thread counts; bad jobs are refused before any byte is read;
//! poll/wait behave; `backend_for` never panics; a group's layers checked in parts add up to the
//! result over all of them.

use std::collections::BTreeMap;
use std::time::Duration;

use kvferry_checksum::group::{LayerSpec, ReplicaKey};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_checksum::select::BlockSelection;
use kvferry_kernels::oracle::direct_values;
use kvferry_kernels::{
    backend_for, ChecksumBackend, CpuBackend, GroupJob, GroupResult, JobFault, KernelError,
    LayerInput, Location,
};

struct Layer {
    spec: LayerSpec,
    bytes: Vec<u8>,
}

fn layer(
    layer: u32,
    layout: &str,
    heads: u64,
    d: u64,
    elem: ElemBytes,
    replica: ReplicaKey,
    seed: u64,
) -> Layer {
    let g = Geometry::contiguous(Layout::parse(layout).unwrap(), 12, 8, heads, d, elem, 2).unwrap();
    let mut z = seed;
    let bytes = (0..g.byte_len())
        .map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (z >> 29) as u8
        })
        .collect();
    let spec = LayerSpec {
        name: format!("model.layers.{layer}.self_attn.attn"),
        layer,
        head_offset: 3 * layer,
        geometry: g,
        kind: None,
        dtype: None,
        replica,
    };
    Layer { spec, bytes }
}

fn job(layers: &[Layer], selection: BlockSelection, num_tokens: u64) -> GroupJob {
    GroupJob {
        group_id: 4,
        block_size: 16,
        layers: layers
            .iter()
            .map(|l| LayerInput {
                spec: l.spec.clone(),
                addr: l.bytes.as_ptr() as u64,
                len: l.bytes.len() as u64,
            })
            .collect(),
        selection,
        num_tokens,
        device: Location::Cpu,
    }
}

/// The oracle's values for `layers` (the definition's direct form, summed per replica key).
fn expected(
    layers: &[Layer],
    sel: &BlockSelection,
    num_tokens: u64,
) -> BTreeMap<ReplicaKey, Vec<u64>> {
    let pairs: Vec<(&LayerSpec, &[u8])> = layers.iter().map(|l| (&l.spec, &l.bytes[..])).collect();
    direct_values(&pairs, sel, num_tokens)
}

fn model() -> Vec<Layer> {
    let r2 = |i| ReplicaKey {
        replicas: 2,
        index: i,
    };
    vec![
        layer(0, "KV B N H D", 4, 128, ElemBytes::Two, ReplicaKey::NONE, 1),
        layer(1, "B KV H N D", 2, 64, ElemBytes::Four, ReplicaKey::NONE, 2),
        layer(2, "B N D", 1, 72, ElemBytes::Two, r2(1), 3),
        layer(3, "B H N KV D", 3, 6, ElemBytes::Two, ReplicaKey::NONE, 4),
        layer(4, "KV B N H D", 2, 3, ElemBytes::Four, r2(1), 5),
    ]
}

#[test]
fn results_equal_the_direct_form_for_any_thread_count() {
    let layers = model();
    let sel = BlockSelection {
        start: 1,
        block_ids: vec![5, 0, 3, 2],
    };
    let want = expected(&layers, &sel, 55);
    for threads in [1, 2, 3, 8] {
        let backend = CpuBackend::new(threads);
        // SAFETY: `layers` outlives the wait.
        let pending = unsafe {
            backend.submit(vec![
                job(&layers, sel.clone(), 55),
                job(&layers[..1], sel.clone(), 55),
            ])
        }
        .unwrap();
        let results = pending.wait(Duration::from_secs(60)).unwrap();
        assert_eq!(results.len(), 2);
        assert_eq!((results[0].group_id, results[0].start), (4, 1));
        assert_eq!(results[0].values, want, "threads {threads}");
        assert_eq!(results[1].values, expected(&layers[..1], &sel, 55));
    }
}

#[test]
fn a_groups_layers_checked_in_parts_add_up_to_the_whole_bit_for_bit() {
    let layers = model();
    let sel = BlockSelection {
        start: 2,
        block_ids: vec![4, 1, 0],
    };
    let backend = CpuBackend::new(2);
    let run = |part: &[Layer]| {
        // SAFETY: `layers` outlives the wait.
        let pending = unsafe { backend.submit(vec![job(part, sel.clone(), 40)]) }.unwrap();
        pending.wait(Duration::from_secs(60)).unwrap().remove(0)
    };
    let whole = run(&layers);
    // Every split in two, and one in three: the parts' keys differ (layers 2 and 4 are
    // replicated, the others not), so keys are both added and taken over.
    let splits: [&[usize]; 5] = [&[1], &[2], &[3], &[4], &[1, 3]];
    for cuts in splits {
        let mut bounds = vec![0];
        bounds.extend_from_slice(cuts);
        bounds.push(layers.len());
        let mut sum = run(&layers[bounds[0]..bounds[1]]);
        for w in bounds[1..].windows(2) {
            sum.absorb(run(&layers[w[0]..w[1]])).unwrap();
        }
        assert_eq!(sum, whole, "layers cut at {cuts:?}");
    }
    // A part of other blocks is refused, and the result stays as it was.
    let mut first = run(&layers[..2]);
    let kept = first.clone();
    let mut other = run(&layers[2..]);
    other.start += 1;
    let e = first.absorb(other).unwrap_err();
    assert_eq!((e.start, e.part_start), (2, 3));
    assert_eq!(first, kept);
    let mut short = run(&layers[2..]);
    short.values.values_mut().for_each(|v| {
        v.pop();
    });
    let e = first.absorb(short).unwrap_err();
    assert_eq!((e.len, e.part_len), (3, 2));
    assert_eq!(first, kept);
    let mut group = run(&layers[2..]);
    group.group_id += 1;
    assert!(first.absorb(group).is_err());
    assert_eq!(first, kept);
}

/// A part's lists must all have the result's length, also when the result's lists are
/// empty or it has no key yet: `zip` would drop the extra values silently.
#[test]
fn a_part_whose_lists_differ_in_length_is_refused_even_against_empty_lists() {
    let key = |index| ReplicaKey { replicas: 2, index };
    let result = |lists: &[(u32, Vec<u64>)]| GroupResult {
        group_id: 1,
        start: 0,
        values: lists.iter().map(|(k, v)| (key(*k), v.clone())).collect(),
    };
    let mut empty = result(&[(0, vec![])]);
    let e = empty.absorb(result(&[(0, vec![1, 2])])).unwrap_err();
    assert_eq!((e.len, e.part_len), (0, 2));
    assert_eq!(empty, result(&[(0, vec![])]));
    let e = empty
        .absorb(result(&[(0, vec![]), (1, vec![3])]))
        .unwrap_err();
    assert_eq!((e.len, e.part_len), (0, 1));
    let mut none = result(&[]);
    let e = none
        .absorb(result(&[(0, vec![1, 2]), (1, vec![3])]))
        .unwrap_err();
    assert_eq!((e.len, e.part_len), (0, 1));
    assert_eq!(none, result(&[]));
    // Equal lengths add (or are taken over) as before.
    none.absorb(result(&[(0, vec![1, 2]), (1, vec![3, 4])]))
        .unwrap();
    none.absorb(result(&[(0, vec![1, 1])])).unwrap();
    assert_eq!(none, result(&[(0, vec![2, 3]), (1, vec![3, 4])]));
}

#[test]
fn poll_returns_the_result_once() {
    let layers = model();
    let sel = BlockSelection {
        start: 0,
        block_ids: vec![1],
    };
    // SAFETY: `layers` outlives the pending value (its drop joins the worker thread).
    let mut pending =
        unsafe { CpuBackend::new(2).submit(vec![job(&layers, sel.clone(), 16)]) }.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let result = loop {
        if let Some(r) = pending.poll() {
            break r.unwrap();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no result within 60 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(result[0].values, expected(&layers, &sel, 16));
    assert!(pending.poll().is_none());
    // Dropping an unpolled submission waits for its thread; nothing is read afterwards.
    // SAFETY: `layers` outlives the wait.
    let p = unsafe { CpuBackend::new(1).submit(vec![job(&layers, sel, 16)]) }.unwrap();
    drop(p);
}

#[test]
fn bad_jobs_are_refused_before_reading() {
    let layers = model();
    let backend = CpuBackend::new(1);
    let sel = BlockSelection {
        start: 0,
        block_ids: vec![0],
    };
    let refuse = |j: GroupJob, want: fn(&JobFault) -> bool| {
        // SAFETY: refused jobs read nothing; valid ones point at `layers`.
        match unsafe { backend.submit(vec![j]) } {
            Err(KernelError::InvalidJob { group_id: 4, why }) => assert!(want(&why), "{why}"),
            other => panic!("expected InvalidJob, got {other:?}"),
        }
    };
    let mut j = job(&layers, sel.clone(), 16);
    j.layers[1].len -= 1;
    refuse(j, |f| matches!(f, JobFault::Short { .. }));
    let mut j = job(
        &layers,
        BlockSelection {
            start: 0,
            block_ids: vec![6],
        },
        16,
    );
    j.layers.truncate(1);
    refuse(j, |f| matches!(f, JobFault::BlockOutOfRange { id: 6, .. }));
    let mut j = job(&layers, sel.clone(), 16);
    j.block_size = 8;
    refuse(j, |f| {
        matches!(
            f,
            JobFault::BlockSize {
                group_block_size: 8,
                ..
            }
        )
    });
    let mut j = job(&layers, sel.clone(), 16);
    j.device = Location::Cuda(0);
    refuse(j, |f| {
        *f == JobFault::WrongDevice {
            job: Location::Cuda(0),
            backend: Location::Cpu,
        }
    });
    let mut j = job(&layers, sel, 16);
    j.layers[0].addr = u64::MAX - 10;
    refuse(j, |f| matches!(f, JobFault::Overflow { .. }));
}

#[test]
fn backend_for_never_panics() {
    assert_eq!(backend_for(Location::Cpu).name(), "cpu");
    let name = backend_for(Location::Cuda(0)).name();
    assert!(name == "cpu" || name == "cuda", "{name}");
}

/// A worker thread that panics (the `test-tools` hook) fails the submission with its reason; it
/// never yields values that miss its layers (which would compare as a mismatch).
#[test]
fn a_panicked_worker_is_an_error_not_missing_layers() {
    let layers = model();
    let sel = BlockSelection {
        start: 0,
        block_ids: vec![1, 2],
    };
    for (threads, at) in [(1, 0), (2, 3), (3, 4), (8, 2)] {
        let backend = CpuBackend::new(threads).panicking_at_layer(at);
        // SAFETY: `layers` outlives the wait.
        let pending = unsafe { backend.submit(vec![job(&layers, sel.clone(), 40)]) }.unwrap();
        match pending.wait(Duration::from_secs(60)) {
            Err(KernelError::WorkerPanicked { group_id, why }) => {
                assert_eq!(group_id, 4);
                assert!(why.contains(&format!("layer index {at}")), "{why}");
            }
            other => panic!("threads {threads}: expected WorkerPanicked, got {other:?}"),
        }
    }
}

/// A layer thread the OS refuses (the `test-tools` hook asks for a stack no address space
/// holds) fails the submission with a typed error instead of panicking the caller.
#[test]
fn a_layer_thread_the_os_refuses_is_an_error() {
    let layers = model();
    let sel = BlockSelection {
        start: 0,
        block_ids: vec![1, 2],
    };
    let backend = CpuBackend::new(2).with_worker_stack(1 << 60);
    // SAFETY: `layers` outlives the wait.
    let pending = unsafe { backend.submit(vec![job(&layers, sel, 40)]) }.unwrap();
    match pending.wait(Duration::from_secs(60)) {
        Err(KernelError::NoThread(_)) => {}
        other => panic!("expected NoThread, got {other:?}"),
    }
}

/// The CUDA launch plan (pure host code) says why a layer cannot be planned in a typed cause.
#[test]
fn launch_plan_refusals_are_typed() {
    use kvferry_kernels::cuda::view::{launch_plan, PlanError};
    let layers = model();
    let spec = &layers[0].spec;
    let len = layers[0].bytes.len() as u64;
    let addr = layers[0].bytes.as_ptr() as u64;
    assert_eq!(
        launch_plan(&[(spec, addr, len - 1)], &[0], 0, 16).err(),
        Some(PlanError::Short {
            layer: spec.name.clone(),
            spans: len,
            given: len - 1,
        })
    );
    let blocks = spec.geometry.num_blocks();
    assert_eq!(
        launch_plan(&[(spec, addr, len)], &[blocks], 0, 16).err(),
        Some(PlanError::BlockOutOfRange {
            layer: spec.name.clone(),
            id: blocks,
            blocks,
        })
    );
}
