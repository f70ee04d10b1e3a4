//! Replays the kernel (`kernels/cuda/checksum.cu`) thread by thread on the CPU and
//! compares with the definition's reference, so index arithmetic and the plan are
//! checked here, without a GPU.
use super::*;
use crate::oracle::direct_values;
use kvferry_checksum::layout::{Dim, ElemBytes, Geometry, Layout};
use kvferry_checksum::select::BlockSelection;
use rand::seq::SliceRandom;
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
    rd: &mut dyn FnMut(u64, usize) -> u64,
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
                let x0 = rd(addr, 8);
                let s = if v == 16 {
                    let x1 = rd(addr + 8, 8);
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

fn tile_generic(
    l: &LayerView,
    rd: &mut dyn FnMut(u64, usize) -> u64,
    base: u64,
    t0: u64,
    nt: u32,
    tid: u32,
) -> u64 {
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
                x |= rd(a, 1) << (8 * b);
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
    rd: &mut dyn FnMut(u64, usize) -> u64,
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
        let x0 = rd(a, 8);
        let x1 = if v == 16 { rd(a + 8, 8) } else { 0 };
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
    replay_with(plan, &mut |li, l, _, a, n| rd(mems[li], l.base, a, n))
}

/// CPU replay of kvf_copy_checksum: each chunk read from `srcs[l]` (based at the view's
/// `src_base`, block `src_block_ids[b]`) and written into `dsts[l]` before it is summed.
fn replay_copy(plan: &LaunchPlan, dsts: &mut [Vec<u8>], srcs: &[&[u8]]) -> Vec<u64> {
    replay_with(plan, &mut |li, l, (base, src), a, n| {
        let x = rd(srcs[li], l.src_base, src + (a - base), n);
        let o = (a - l.base) as usize;
        dsts[li][o..o + n].copy_from_slice(&x.to_le_bytes()[..n]);
        x
    })
}

/// The tile walk of both kernels: `read(layer index, view, (tile base, tile source base),
/// address, bytes)` gives each chunk's value.
type Reader<'a> = dyn FnMut(usize, &LayerView, (u64, u64), u64, usize) -> u64 + 'a;

fn replay_with(plan: &LaunchPlan, read: &mut Reader<'_>) -> Vec<u64> {
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
        let src = plan.src_block_ids.get(bidx as usize).map_or(0, |&sb| {
            l.src_base
                + (sb * l.kb_per_block as u64 + kk as u64) * l.src_s_block
                + part as u64 * l.src_s_part
        });
        let mut rd = |a: u64, n: usize| read(li, l, (base, src), a, n);
        let mut sum = 0u64;
        for tid in 0..THREADS {
            let a = match l.mode {
                MODE_VEC16 if l.regular != 0 => {
                    tile_regular(l, &mut rd, base, part, t0, nt, 16, tid)
                }
                MODE_VEC8 if l.regular != 0 => tile_regular(l, &mut rd, base, part, t0, nt, 8, tid),
                MODE_VEC16 => tile_vec(l, &mut rd, base, part, t0, nt, 16, tid),
                MODE_VEC8 => tile_vec(l, &mut rd, base, part, t0, nt, 8, tid),
                _ => tile_generic(l, &mut rd, base, t0, nt, tid),
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

/// The definition's values of `specs` over `mems` (layer `l` in `mems[l]`) for the blocks
/// `block_ids` from position `start`.
fn oracle(
    specs: &[LayerSpec],
    mems: &[Vec<u8>],
    start: u64,
    block_ids: &[u64],
    num_tokens: u64,
) -> std::collections::BTreeMap<ReplicaKey, Vec<u64>> {
    let pairs: Vec<(&LayerSpec, &[u8])> = specs
        .iter()
        .zip(mems)
        .map(|(s, m)| (s, m.as_slice()))
        .collect();
    let selection = BlockSelection {
        start,
        block_ids: block_ids.to_vec(),
    };
    direct_values(&pairs, &selection, num_tokens)
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
        let want = oracle(&specs, &mems, start, &block_ids, num_tokens);
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
fn view_is_144_bytes() {
    assert_eq!(std::mem::size_of::<LayerView>(), 144);
}

/// `g` with `blocks` logical blocks: the same strides within a block, the dimensions outside
/// `B` spanning the new count (padding between them kept).
fn with_blocks(g: &Geometry, blocks: u64) -> Geometry {
    let dims = g.layout.dims().to_vec();
    let b = g.layout.position(Dim::B).unwrap();
    let kb = blocks * g.kernel_blocks_per_block;
    let mut strides = g.strides.clone();
    for k in (0..b).rev() {
        let size = |d: Dim| if d == Dim::B { kb } else { g.size_of(d) };
        let pad = g.strides[k] - g.strides[k + 1] * g.size_of(dims[k + 1]);
        strides[k] = strides[k + 1] * size(dims[k + 1]) + pad;
    }
    let mut out = g.clone();
    out.num_kernel_blocks = kb;
    out.with_strides(strides).unwrap()
}

/// An independent copy of what a copy launch moves: every cell of every selected block's
/// tokens before `num_tokens`, element by element through the geometries' strides.
#[allow(clippy::too_many_arguments)]
fn reference_copy(
    dst: &Geometry,
    dmem: &mut [u8],
    src: &Geometry,
    smem: &[u8],
    ids: &[u64],
    src_ids: &[u64],
    start: u64,
    num_tokens: u64,
) {
    let (n, kbpb, e) = (
        dst.tokens_per_kernel_block,
        dst.kernel_blocks_per_block,
        dst.elem.get(),
    );
    for (b, (&id, &sid)) in ids.iter().zip(src_ids).enumerate() {
        for t in 0..dst.block_size() {
            if (start + b as u64) * dst.block_size() + t >= num_tokens {
                break;
            }
            let (kk, tok) = (t / n, t % n);
            for h in 0..dst.heads {
                for part in 0..dst.parts() {
                    for d in 0..dst.head_dim {
                        let at = |g: &Geometry, block: u64| {
                            ((block * kbpb + kk) * g.stride_of(Dim::B)
                                + part * g.stride_of(Dim::Kv)
                                + tok * g.stride_of(Dim::N)
                                + h * g.stride_of(Dim::H)
                                + d * g.stride_of(Dim::D)) as usize
                        };
                        let (o, so) = (at(dst, id), at(src, sid));
                        dmem[o..o + e as usize].copy_from_slice(&smem[so..so + e as usize]);
                    }
                }
            }
        }
    }
}

/// The copy kernel, replayed: it moves exactly the cells the checksum covers, from the source's
/// blocks into the layer's (nothing else of the layer changes), and its values are the
/// definition's over the bytes it stored, for sources with other block counts, padded
/// strides and every vector load path; what the copy cannot do chunk for chunk is refused.
#[test]
fn replayed_copy_moves_what_it_checksums() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (mut copied, mut refused, mut regular) = (0usize, 0usize, 0usize);
    let mut modes = [0usize; 3];
    let mut swapped = 0usize;
    for case in 0..300 {
        let nl = rng.random_range(1..4);
        let specs: Vec<LayerSpec> = (0..nl)
            .map(|l| random_spec(&mut rng, l as u32 * 5 + 2, ReplicaKey::NONE))
            .collect();
        let sources: Vec<LayerSpec> = specs
            .iter()
            .map(|s| {
                let blocks = rng.random_range(1..6);
                // Sometimes the other order of KV and B (the same strides within a block).
                let g = &s.geometry;
                let (n, h, d, e, k) = (
                    g.tokens_per_kernel_block,
                    g.heads,
                    g.head_dim,
                    g.elem,
                    g.kernel_blocks_per_block,
                );
                let plain =
                    |l: &str, b| Geometry::contiguous(Layout::parse(l).unwrap(), b, n, h, d, e, k);
                let swap = [("KV B N H D", "B KV N H D"), ("B KV N H D", "KV B N H D")]
                    .into_iter()
                    .find(|(from, _)| plain(from, g.num_kernel_blocks).is_ok_and(|p| p == *g));
                let geometry = match swap {
                    Some((_, to)) if rng.random_bool(0.5) => {
                        swapped += 1;
                        plain(to, blocks * k).unwrap()
                    }
                    _ => with_blocks(g, blocks),
                };
                LayerSpec {
                    geometry,
                    ..s.clone()
                }
            })
            .collect();
        let shift = [0u64, 8, 1][rng.random_range(0..3)];
        let fill = |rng: &mut ChaCha8Rng, g: &Geometry| -> Vec<u8> {
            (0..g.byte_len()).map(|_| rng.random::<u8>()).collect()
        };
        let dmems: Vec<Vec<u8>> = specs.iter().map(|s| fill(&mut rng, &s.geometry)).collect();
        let smems: Vec<Vec<u8>> = sources
            .iter()
            .map(|s| fill(&mut rng, &s.geometry))
            .collect();
        let dbases: Vec<u64> = (0..nl as u64)
            .map(|l| (l + 1) * (1 << 40) + shift)
            .collect();
        let sbases: Vec<u64> = (0..nl as u64)
            .map(|l| (l + 9) * (1 << 40) + shift)
            .collect();
        let nb = specs.iter().map(|s| s.geometry.num_blocks()).min().unwrap();
        let snb = sources
            .iter()
            .map(|s| s.geometry.num_blocks())
            .min()
            .unwrap();
        let count = rng.random_range(0..=nb.min(snb));
        // Distinct destination blocks: two positions never write one block.
        let mut ids: Vec<u64> = (0..nb).collect();
        ids.shuffle(&mut rng);
        ids.truncate(count as usize);
        let src_ids: Vec<u64> = (0..count).map(|_| rng.random_range(0..snb)).collect();
        let start = rng.random_range(0..3);
        let bs = specs[0].geometry.block_size();
        let num_tokens = ((start + count) * bs).saturating_sub(rng.random_range(0..bs.max(1)));
        let layers: Vec<(&LayerSpec, u64, u64)> = specs
            .iter()
            .zip(&dbases)
            .zip(&dmems)
            .map(|((s, &b), m)| (s, b, m.len() as u64))
            .collect();
        let from: Vec<(&LayerSpec, u64, u64)> = sources
            .iter()
            .zip(&sbases)
            .zip(&smems)
            .map(|((s, &b), m)| (s, b, m.len() as u64))
            .collect();
        let plan = match copy_plan(&layers, &from, &ids, &src_ids, start, num_tokens) {
            Ok(p) => p,
            Err(e @ PlanError::Source { .. }) => {
                // Only a layer the checksum reads byte by byte, or one whose rows are strided
                // over all blocks (a dimension of the row outside `B`): everything else pairs up.
                let plain = launch_plan(&layers, &ids, start, num_tokens).unwrap();
                let srcv = launch_plan(&from, &src_ids, start, num_tokens).unwrap();
                let explained = plain.views.iter().zip(&srcv.views).any(|(d, s)| {
                    d.mode == MODE_GENERIC || (d.s_outer, d.s_inner) != (s.s_outer, s.s_inner)
                });
                assert!(explained, "case {case}: refused ({e}) {:?}", plain.views);
                refused += 1;
                continue;
            }
            Err(e) => panic!("case {case}: {e}"),
        };
        copied += 1;
        regular += plan.views.iter().filter(|v| v.regular != 0).count();
        for v in &plan.views {
            modes[v.mode as usize] += 1;
        }
        let mut got_mems = dmems.clone();
        let slices: Vec<&[u8]> = smems.iter().map(|m| m.as_slice()).collect();
        let got = replay_copy(&plan, &mut got_mems, &slices);
        let mut want_mems = dmems.clone();
        for l in 0..nl {
            let (d, s) = (&specs[l].geometry, &sources[l].geometry);
            reference_copy(
                d,
                &mut want_mems[l],
                s,
                &smems[l],
                &ids,
                &src_ids,
                start,
                num_tokens,
            );
            assert!(
                got_mems[l] == want_mems[l],
                "case {case} layer {l}: bytes differ"
            );
        }
        let want = oracle(&specs, &want_mems, start, &ids, num_tokens);
        for bi in 0..ids.len() {
            assert_eq!(
                got[bi],
                want[&ReplicaKey::NONE][bi],
                "case {case} block {bi}"
            );
        }
    }
    assert!(
        copied > 60 && refused > 10 && regular > 20 && modes[0] > 10 && modes[1] > 10,
        "{copied} {refused} {regular} {modes:?}"
    );
    assert!(
        swapped > 5,
        "sources in the other order of KV and B: {swapped}"
    );
}

/// A source that differs from its layer in anything but its block count is refused, and so is
/// a source block past the source's blocks.
#[test]
fn a_copy_source_of_another_layout_is_refused() {
    let g = Geometry::contiguous(
        Layout::parse("KV B N H D").unwrap(),
        4,
        16,
        8,
        128,
        ElemBytes::Two,
        1,
    )
    .unwrap();
    let spec = LayerSpec {
        name: "l".into(),
        layer: 3,
        head_offset: 0,
        geometry: g.clone(),
        kind: None,
        dtype: None,
        replica: ReplicaKey::NONE,
    };
    let len = g.byte_len();
    let plan = |src: &LayerSpec, slen: u64, sid: u64| {
        copy_plan(
            &[(&spec, 1 << 40, len)],
            &[(src, 1 << 41, slen)],
            &[1],
            &[sid],
            0,
            16,
        )
    };
    let more = LayerSpec {
        geometry: with_blocks(&g, 9),
        ..spec.clone()
    };
    let ok = plan(&more, more.geometry.byte_len(), 8).unwrap();
    assert_eq!(ok.views[0].src_s_part, more.geometry.stride_of(Dim::Kv));
    assert!(matches!(
        plan(&more, more.geometry.byte_len(), 9),
        Err(PlanError::BlockOutOfRange { .. })
    ));
    let other_heads = LayerSpec {
        head_offset: 8,
        ..spec.clone()
    };
    let fewer_heads = LayerSpec {
        geometry: Geometry::contiguous(g.layout.clone(), 4, 16, 4, 128, ElemBytes::Two, 1).unwrap(),
        ..spec.clone()
    };
    let other_layout = LayerSpec {
        geometry: Geometry::contiguous(
            Layout::parse("KV B H N D").unwrap(),
            4,
            16,
            8,
            128,
            ElemBytes::Two,
            1,
        )
        .unwrap(),
        ..spec.clone()
    };
    for bad in [&other_heads, &fewer_heads, &other_layout] {
        let r = plan(bad, bad.geometry.byte_len(), 0);
        assert!(matches!(r, Err(PlanError::Source { .. })), "{r:?}");
    }
    assert!(matches!(
        copy_plan(&[(&spec, 1 << 40, len)], &[], &[1], &[0], 0, 16),
        Err(PlanError::Source { .. })
    ));
}
