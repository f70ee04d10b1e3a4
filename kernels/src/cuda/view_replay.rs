//! Replays the kernel (`kernels/cuda/checksum.cu`) thread by thread on the CPU and
//! compares with the definition's reference, so index arithmetic and the plan are
//! checked here, without a GPU.
use super::*;
use crate::oracle::direct_values;
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_checksum::select::BlockSelection;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const THREADS: u32 = 256;
const UNROLL: usize = 4;

fn rd(mem: &[u8], base: u64, addr: u64, n: usize) -> u64 {
    let o = (addr - base) as usize;
    let mut b = [0u8; 8];
    b[..n].copy_from_slice(&mem[o..o + n]);
    u64::from_le_bytes(b)
}

/// CPU replay of tile_vec<V> for one thread.
#[allow(clippy::too_many_arguments)]
fn tile_vec(
    l: &LayerView,
    mem: &[u8],
    base: u64,
    part: u32,
    t0: u64,
    nt: u32,
    v: u32,
    tid: u32,
) -> u64 {
    let r = l.d * l.elem / v;
    let p_part = part as u64 * ((l.d * l.elem) >> 3) as u64;
    let n_o = if l.outer_is_token != 0 { nt } else { l.n_outer };
    let n_i = l.n_inner;
    let mut c = tid % r;
    let row = tid / r;
    let mut i = row % n_i;
    let mut o = row / n_i;
    let (sc, srows) = (THREADS % r, THREADS / r);
    let (si, so) = (srows % n_i, srows / n_i);
    let mut acc = 0u64;
    while o < n_o {
        for _ in 0..UNROLL {
            let n = if l.outer_is_token != 0 { o } else { i };
            let h = if l.outer_is_token != 0 { i } else { o };
            let ok = o < n_o && n < nt;
            let addr = base + o as u64 * l.s_outer + i as u64 * l.s_inner + c as u64 * v as u64;
            let j = (t0 + n as u64) * l.pieces + p_part + c as u64 * (v as u64 / 8);
            let m = l.m_base.wrapping_add(2 * h as u64);
            if ok {
                let x0 = rd(mem, l.base, addr, 8);
                let s = if v == 16 {
                    let x1 = rd(mem, l.base, addr + 8, 8);
                    x0.wrapping_add(x1)
                        .wrapping_mul(j.wrapping_mul(2).wrapping_add(1))
                        .wrapping_add(x1.wrapping_mul(2))
                } else {
                    x0.wrapping_mul(j.wrapping_mul(2).wrapping_add(1))
                };
                acc = acc.wrapping_add(m.wrapping_mul(s));
            }
            c += sc;
            let mut carry = 0;
            if c >= r {
                c -= r;
                carry = 1;
            }
            i += si + carry;
            o += so;
            if i >= n_i {
                i -= n_i;
                o += 1;
            }
        }
    }
    acc
}

fn tile_generic(l: &LayerView, mem: &[u8], base: u64, t0: u64, nt: u32, tid: u32) -> u64 {
    let p = l.pieces as u32;
    let part_bytes = l.d * l.elem;
    let n_o = if l.outer_is_token != 0 { nt } else { l.n_outer };
    let total = n_o * l.n_inner * p;
    let mut acc = 0u64;
    let mut q = tid;
    while q < total {
        let (row, pc) = (q / p, q % p);
        let (o, i) = (row / l.n_inner, row % l.n_inner);
        let n = if l.outer_is_token != 0 { o } else { i };
        let h = if l.outer_is_token != 0 { i } else { o };
        if n < nt {
            let rb = base + o as u64 * l.s_outer + i as u64 * l.s_inner;
            let mut x = 0u64;
            for b in 0..8u32 {
                let off = pc * 8 + b;
                let part = off / part_bytes;
                let rem = off - part * part_bytes;
                let d = rem / l.elem;
                let eb = rem - d * l.elem;
                let a = rb + part as u64 * l.s_part + d as u64 * l.s_d + eb as u64;
                x |= rd(mem, l.base, a, 1) << (8 * b);
            }
            let jj = (t0 + n as u64) * l.pieces + pc as u64;
            acc = acc.wrapping_add(
                l.m_base
                    .wrapping_add(2 * h as u64)
                    .wrapping_mul(x.wrapping_mul(jj.wrapping_mul(2).wrapping_add(1))),
            );
        }
        q += THREADS;
    }
    acc
}

/// CPU replay of tile_regular for one thread.
#[allow(clippy::too_many_arguments)]
fn tile_regular(
    l: &LayerView,
    mem: &[u8],
    base: u64,
    part: u32,
    t0: u64,
    nt: u32,
    v: u32,
    tid: u32,
) -> u64 {
    let rs = (l.regular >> 8) & 0xff;
    let nis = (l.regular >> 16) & 0xff;
    let c = tid & ((1 << rs) - 1);
    let row = tid >> rs;
    let i = row & ((1 << nis) - 1);
    let mut o = row >> nis;
    let so = (THREADS >> rs) >> nis;
    // The kernel would never advance: the plan must not mark such a layer regular.
    assert!(
        so > 0,
        "regular layer whose rows x inner groups exceed the block: {l:?}"
    );
    let ot = l.outer_is_token != 0;
    let n_o = if ot { nt } else { l.n_outer };
    if !ot && i >= nt {
        return 0;
    }
    let (mut su, mut sw, mut sx, mut sy) = (0u64, 0u64, 0u64, 0u64);
    while o < n_o {
        let a = base + o as u64 * l.s_outer + i as u64 * l.s_inner + c as u64 * v as u64;
        let x0 = rd(mem, l.base, a, 8);
        let x1 = if v == 16 {
            rd(mem, l.base, a + 8, 8)
        } else {
            0
        };
        let y = x0.wrapping_add(x1);
        su = su.wrapping_add(y);
        sw = sw.wrapping_add((o as u64).wrapping_mul(y));
        sx = sx.wrapping_add(x1);
        sy = sy.wrapping_add((o as u64).wrapping_mul(x1));
        o += so;
    }
    let p = l.pieces;
    let q = part as u64 * ((l.d * l.elem) >> 3) as u64 + c as u64 * (v as u64 / 8);
    if ot {
        let m = l.m_base.wrapping_add(2 * i as u64);
        let k = (2u64.wrapping_mul(t0).wrapping_mul(p)).wrapping_add(2 * q + 1);
        m.wrapping_mul(
            k.wrapping_mul(su)
                .wrapping_add(2u64.wrapping_mul(p).wrapping_mul(sw))
                .wrapping_add(sx.wrapping_mul(2)),
        )
    } else {
        let j = 2u64
            .wrapping_mul(t0 + i as u64)
            .wrapping_mul(p)
            .wrapping_add(2 * q + 1);
        l.m_base
            .wrapping_mul(j.wrapping_mul(su).wrapping_add(sx.wrapping_mul(2)))
            .wrapping_add(2u64.wrapping_mul(j.wrapping_mul(sw).wrapping_add(sy.wrapping_mul(2))))
    }
}

/// CPU replay of kvf_checksum over all tiles; `mems[l]` backs layer l.
fn replay(plan: &LaunchPlan, mems: &[&[u8]]) -> Vec<u64> {
    let ns = plan.keys.len();
    let mut out = vec![0u64; plan.block_ids.len() * ns];
    for tile in 0..plan.total_tiles {
        let bidx = tile / plan.tiles_per_group;
        let r = tile % plan.tiles_per_group;
        let li = plan.views.iter().rposition(|v| v.tile_begin <= r).unwrap();
        let l = &plan.views[li];
        let local = r - l.tile_begin;
        let (kk, part) = if l.mode == MODE_GENERIC {
            (local, 0)
        } else {
            (local / l.parts, local % l.parts)
        };
        let bs = l.kb_per_block as u64 * l.tokens as u64;
        let t0 = (plan.start + bidx as u64) * bs + kk as u64 * l.tokens as u64;
        if t0 >= plan.num_tokens {
            continue;
        }
        let nt = (plan.num_tokens - t0).min(l.tokens as u64) as u32;
        let kb = plan.block_ids[bidx as usize] * l.kb_per_block as u64 + kk as u64;
        let base = l.base + kb * l.s_block + part as u64 * l.s_part;
        let mut sum = 0u64;
        for tid in 0..THREADS {
            let a = match l.mode {
                MODE_VEC16 if l.regular != 0 => {
                    tile_regular(l, mems[li], base, part, t0, nt, 16, tid)
                }
                MODE_VEC8 if l.regular != 0 => {
                    tile_regular(l, mems[li], base, part, t0, nt, 8, tid)
                }
                MODE_VEC16 => tile_vec(l, mems[li], base, part, t0, nt, 16, tid),
                MODE_VEC8 => tile_vec(l, mems[li], base, part, t0, nt, 8, tid),
                _ => tile_generic(l, mems[li], base, t0, nt, tid),
            };
            sum = sum.wrapping_add(a);
        }
        let o = bidx as usize * ns + l.slot as usize;
        out[o] = out[o].wrapping_add(sum);
    }
    out
}

const LAYOUTS: [&str; 7] = [
    "KV B N H D",
    "B KV N H D",
    "B KV H N D",
    "B H N KV D",
    "B N D",
    "B N H D",
    "H B N KV D",
];

fn random_spec(rng: &mut ChaCha8Rng, layer: u32, replica: ReplicaKey) -> LayerSpec {
    loop {
        let layout = Layout::parse(LAYOUTS[rng.random_range(0..LAYOUTS.len())]).unwrap();
        let elem = [
            ElemBytes::One,
            ElemBytes::Two,
            ElemBytes::Four,
            ElemBytes::Eight,
        ][rng.random_range(0..4)];
        // Mostly small; sometimes rows of 64+ chunks with 4-8 inner rows, where one
        // pass of the 256 threads does not cover whole inner groups.
        let big = rng.random_bool(0.15);
        let d = if big {
            [128u64, 256][rng.random_range(0..2)]
        } else {
            [1u64, 2, 3, 4, 8, 16, 24, 64][rng.random_range(0..8)]
        };
        let h = if !layout.has_heads() {
            1
        } else if big {
            [4u64, 8][rng.random_range(0..2)]
        } else {
            rng.random_range(1..4)
        };
        let n = if big {
            [4u64, 8, 16][rng.random_range(0..3)]
        } else {
            rng.random_range(1..6)
        };
        let kbpb = rng.random_range(1..4);
        let b = kbpb * rng.random_range(1..5);
        let g = Geometry::contiguous(layout, b, n, h, d, elem, kbpb).unwrap();
        if g.pieces_per_cell().is_none() {
            continue;
        }
        // Sometimes pad the strides: the outermost stays, others grow by a multiple of 8 (or 1).
        let g = if rng.random_bool(0.4) {
            let pad = [1u64, 8, 16][rng.random_range(0..3)];
            let dims = g.layout.dims().to_vec();
            let mut strides = vec![0u64; dims.len()];
            let mut span = elem as u64;
            for k in (0..dims.len()).rev() {
                strides[k] = span
                    + if k + 1 == dims.len() {
                        0
                    } else {
                        pad * rng.random_range(0..2)
                    };
                span = strides[k] * g.size_of(dims[k]);
            }
            match g.clone().with_strides(strides) {
                Ok(g2) => g2,
                Err(_) => g,
            }
        } else {
            g
        };
        return LayerSpec {
            name: format!("model.layers.{layer}.self_attn.attn"),
            layer,
            head_offset: rng.random_range(0..100),
            geometry: g,
            kind: None,
            dtype: None,
            replica,
        };
    }
}

#[test]
fn replayed_kernel_matches_definition() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut modes = [0usize; 3];
    let mut regular = 0usize;
    let mut regular_head_outer = 0usize;
    for case in 0..300 {
        let nl = rng.random_range(1..4);
        let rk = if rng.random_bool(0.3) {
            ReplicaKey {
                replicas: 2,
                index: 1,
            }
        } else {
            ReplicaKey::NONE
        };
        let specs: Vec<LayerSpec> = (0..nl)
            .map(|l| {
                random_spec(
                    &mut rng,
                    l as u32 * 3 + 1,
                    if l == 0 { ReplicaKey::NONE } else { rk },
                )
            })
            .collect();
        // Base addresses: 16-aligned, or shifted by 8 to force the 8-byte / generic paths.
        let shift = [0u64, 8, 1][rng.random_range(0..3)];
        let mems: Vec<Vec<u8>> = specs
            .iter()
            .map(|s| {
                (0..s.geometry.byte_len())
                    .map(|_| rng.random::<u8>())
                    .collect()
            })
            .collect();
        let bases: Vec<u64> = (0..nl as u64)
            .map(|l| (l + 1) * (1 << 40) + shift)
            .collect();
        let nblocks = specs.iter().map(|s| s.geometry.num_blocks()).min().unwrap();
        let count = rng.random_range(0..=nblocks);
        let block_ids: Vec<u64> = (0..count).map(|_| rng.random_range(0..nblocks)).collect();
        let start = rng.random_range(0..3);
        let bs = specs[0].geometry.block_size();
        let num_tokens = ((start + count) * bs).saturating_sub(rng.random_range(0..bs.max(1)));
        let layers: Vec<(&LayerSpec, u64, u64)> = specs
            .iter()
            .zip(&bases)
            .zip(&mems)
            .map(|((s, &b), m)| (s, b, m.len() as u64))
            .collect();
        let plan = launch_plan(&layers, &block_ids, start, num_tokens).unwrap();
        for v in &plan.views {
            modes[v.mode as usize] += 1;
            regular += (v.regular != 0) as usize;
            regular_head_outer +=
                (v.regular != 0 && v.outer_is_token == 0 && v.n_outer > 1) as usize;
        }
        let slices: Vec<&[u8]> = mems.iter().map(|m| m.as_slice()).collect();
        let got = replay(&plan, &slices);
        let ns = plan.keys.len();
        let pairs: Vec<(&LayerSpec, &[u8])> = specs
            .iter()
            .zip(&mems)
            .map(|(s, m)| (s, m.as_slice()))
            .collect();
        let selection = BlockSelection {
            start,
            block_ids: block_ids.clone(),
        };
        let want = direct_values(&pairs, &selection, num_tokens);
        for bi in 0..block_ids.len() {
            for (k, key) in plan.keys.iter().enumerate() {
                assert_eq!(
                    got[bi * ns + k],
                    want[key][bi],
                    "case {case} block {bi} key {key:?} views {:?}",
                    plan.views
                );
            }
        }
    }
    // Every load path was exercised.
    assert!(modes.iter().all(|&m| m > 10), "modes {modes:?}");
    assert!(
        regular > 10 && regular_head_outer > 5,
        "regular {regular}, with heads outer {regular_head_outer}"
    );
}

#[test]
fn refuses_bad_blocks_and_short_arrays() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let s = random_spec(&mut rng, 0, ReplicaKey::NONE);
    let len = s.geometry.byte_len();
    let nb = s.geometry.num_blocks();
    assert!(launch_plan(&[(&s, 0, len)], &[nb], 0, 100).is_err());
    assert!(launch_plan(&[(&s, 0, len - 1)], &[0], 0, 100).is_err());
    assert!(launch_plan(&[(&s, 0, len)], &[nb - 1], 0, 100).is_ok());
}

#[test]
fn view_is_120_bytes() {
    assert_eq!(std::mem::size_of::<LayerView>(), 120);
}
