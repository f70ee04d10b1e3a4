use super::*;
use crate::memory::cover_sorted;
use crate::types::Location;
use rand::{Rng, SeedableRng};

fn region(addr: u64, len: u64) -> MemoryRegion {
    MemoryRegion {
        addr,
        len,
        location: Location::Cpu,
    }
}

/// The per-copy validation: every copy's local range covered by `local` regions and its
/// remote range by `remote` buffers (cut at boundaries, no gap), as `submit` checks them.
fn per_copy(requests: &[StridedRequest], local: &[MemoryRegion], remote: &[MemoryRegion]) -> bool {
    let Ok(copies) = expand(requests) else {
        return false;
    };
    let (l, r): (Vec<&MemoryRegion>, Vec<&MemoryRegion>) =
        (local.iter().collect(), remote.iter().collect());
    copies.iter().all(|c| {
        c.len > 0
            && cover_sorted(&l, |g| g, c.local_addr, c.len).is_some()
            && cover_sorted(&r, |g| g, c.remote_addr, c.len).is_some()
    })
}

fn compact(
    requests: &[StridedRequest],
    local: &[MemoryRegion],
    remote: &[MemoryRegion],
    takes: bool,
) -> Result<Validated> {
    validate(
        requests,
        |a, n| local.iter().copied().find(|g| g.contains(a, n)),
        |a, n| {
            remote
                .iter()
                .copied()
                .enumerate()
                .find(|(_, g)| g.contains(a, n))
        },
        |_, _| takes,
    )
}

/// Regions laid out from 0 upwards, some adjacent (a copy may straddle them), some with gaps.
fn regions(rng: &mut impl Rng, base: u64) -> Vec<MemoryRegion> {
    let mut out = Vec::new();
    let mut at = base + rng.random_range(0..64);
    for _ in 0..rng.random_range(1..4) {
        let len = rng.random_range(1..600);
        out.push(region(at, len));
        at += len
            + if rng.random_bool(0.5) {
                0
            } else {
                rng.random_range(1..64)
            };
    }
    out
}

fn request(rng: &mut impl Rng, lbase: u64, rbase: u64) -> StridedRequest {
    let ranges = (0..rng.random_range(0..4))
        .map(|_| StridedRange {
            local: rng.random_range(0..64),
            remote: rng.random_range(0..64),
            // Now and then a zero-length range, which both ways refuse.
            len: if rng.random_ratio(1, 40) {
                0
            } else {
                rng.random_range(1..48)
            },
        })
        .collect();
    let blocks = (0..rng.random_range(0..6))
        .map(|_| {
            (
                lbase + rng.random_range(0..900),
                rbase + rng.random_range(0..900),
            )
        })
        .collect();
    StridedRequest {
        op: if rng.random_bool(0.5) {
            Op::Write
        } else {
            Op::Read
        },
        ranges,
        blocks,
    }
}

#[test]
fn compact_validation_accepts_exactly_what_per_copy_validation_accepts() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let (mut compact_n, mut expanded_n, mut refused_n) = (0, 0, 0);
    for case in 0..20_000 {
        let (lbase, rbase) = (1 << 20, 1 << 30);
        let local = regions(&mut rng, lbase);
        let remote = regions(&mut rng, rbase);
        let reqs: Vec<StridedRequest> = (0..rng.random_range(1..3))
            .map(|_| request(&mut rng, lbase, rbase))
            .collect();
        let takes = !rng.random_ratio(1, 10);
        let want = per_copy(&reqs, &local, &remote);
        let got = match compact(&reqs, &local, &remote, takes) {
            Err(_) => false,
            Ok(Validated::Expand) => {
                expanded_n += 1;
                // The engine then validates the expanded copies one by one.
                per_copy(&reqs, &local, &remote)
            }
            Ok(Validated::Compact(groups)) => {
                compact_n += 1;
                // Every copy of every group lies inside the group's region and buffer, and
                // the groups hold exactly the requests' copies, in order.
                let mut listed = Vec::new();
                for (i, g) in groups.iter().enumerate() {
                    assert_eq!(g.id as usize, i);
                    let buf = remote[g.remote_buffer];
                    for &(lb, rb) in &g.blocks {
                        for r in g.ranges.iter() {
                            assert!(g.local_region.contains(lb + r.local, r.len), "case {case}");
                            assert!(buf.contains(rb + r.remote, r.len), "case {case}");
                            listed.push((g.op, lb + r.local, rb + r.remote, r.len));
                        }
                    }
                }
                let all: Vec<_> = reqs
                    .iter()
                    .flat_map(|q| {
                        q.blocks.iter().flat_map(move |&(lb, rb)| {
                            q.ranges
                                .iter()
                                .map(move |r| (q.op, lb + r.local, rb + r.remote, r.len))
                        })
                    })
                    .collect();
                assert_eq!(listed, all, "case {case}");
                true
            }
        };
        if !want {
            refused_n += 1;
        }
        assert_eq!(
            got, want,
            "case {case}: {reqs:?} local {local:?} remote {remote:?}"
        );
    }
    // The generator reaches every outcome often.
    assert!(
        compact_n > 2000 && expanded_n > 2000 && refused_n > 2000,
        "{compact_n} {expanded_n} {refused_n}"
    );
}

#[test]
fn overflowing_and_zero_length_copies_are_refused_both_ways() {
    let local = [region(0, u64::MAX)];
    let remote = [region(0, u64::MAX)];
    let req = |lb: u64, len: u64| StridedRequest {
        op: Op::Write,
        ranges: vec![StridedRange {
            local: 16,
            remote: 0,
            len,
        }],
        blocks: vec![(0, 0), (lb, 0)],
    };
    for r in [req(u64::MAX - 20, 8), req(0, 0)] {
        assert!(matches!(
            compact(std::slice::from_ref(&r), &local, &remote, true),
            Err(TransferError::InvalidArgument(_))
        ));
        assert!(matches!(r.copies(), Err(TransferError::InvalidArgument(_))));
    }
    // A zero-length range of a request without blocks names no copy: nothing to refuse.
    let none = StridedRequest {
        blocks: vec![],
        ..req(0, 0)
    };
    assert_eq!(
        compact(&[none], &local, &remote, true).unwrap(),
        Validated::Compact(vec![])
    );
}

#[test]
fn blocks_of_one_pair_are_one_group_and_copies_merge_where_contiguous() {
    let local = [region(0, 1000), region(1000, 1000)];
    let remote = [region(5000, 4000)];
    let r = StridedRequest {
        op: Op::Write,
        ranges: vec![
            StridedRange {
                local: 0,
                remote: 0,
                len: 50,
            },
            StridedRange {
                local: 50,
                remote: 50,
                len: 50,
            },
        ],
        blocks: vec![(0, 5000), (100, 5100), (1000, 6000)],
    };
    let Validated::Compact(g) = compact(std::slice::from_ref(&r), &local, &remote, true).unwrap()
    else {
        panic!("fits")
    };
    assert_eq!(g.len(), 2, "a new group where the local region changes");
    assert_eq!(g[0].blocks, vec![(0, 5000), (100, 5100)]);
    assert_eq!(g[1].local_region.addr, 1000);
    // Blocks 0 and 1 continue each other on both sides: one copy of 200 bytes.
    let c = r.copies().unwrap();
    assert_eq!(
        c.iter().map(|c| (c.local_addr, c.len)).collect::<Vec<_>>(),
        vec![(0, 200), (1000, 100)]
    );
    // A transport that takes no strided groups: the per-copy path.
    assert_eq!(
        compact(&[r], &local, &remote, false).unwrap(),
        Validated::Expand
    );
}
