//! The demo's "prefill": seeded pseudo-random KV written into a request's blocks, layer by
//! layer on threads of their own (a side's arena holds GBs: one core fills about 1 GB/s).

use kvferry_checksum::group::LayerSpec;
use rand::{RngCore, SeedableRng};

/// Tokens of one seeded stretch of KV: a token's bytes do not depend on the block size.
const STRETCH: u64 = 16;

/// At most this many threads fill a request's layers.
const MAX_THREADS: usize = 16;

/// Seed of one (request, layer, global head, stretch of [`STRETCH`] tokens) of KV, so that
/// any rank holding the head, with any block size, and a consumer recomputing it, make the
/// same bytes.
fn stretch_seed(seed: u64, request: u64, layer: u32, head: u64, stretch: u64) -> u64 {
    // SplitMix64 over the fields: cheap, well mixed, deterministic.
    let mut x = seed ^ 0x9E37_79B9_7F4A_7C15;
    for v in [request, layer as u64, head, stretch] {
        x = x
            .wrapping_add(v.wrapping_mul(0xBF58_476D_1CE4_E5B9))
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
    }
    x
}

/// Fills request `request`'s KV into `blocks` (block ids in request order) of each layer:
/// `layers` holds each layer's whole array (its geometry's `byte_len` bytes) with its spec.
/// Every slot of every block is written (also those past the prompt's end). The layers are
/// spread over up to [`MAX_THREADS`] threads (bounded by the cores); the bytes do not depend
/// on how. Returns the bytes written.
pub fn fill_layers(
    layers: Vec<(&mut [u8], &LayerSpec)>,
    seed: u64,
    request: u64,
    blocks: &[u64],
) -> u64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(MAX_THREADS).min(layers.len()).max(1);
    if threads == 1 {
        return layers
            .into_iter()
            .map(|(bytes, spec)| fill_layer(bytes, spec, seed, request, blocks))
            .sum();
    }
    // Round robin: layers of one side are alike in size.
    let mut shares: Vec<Vec<(&mut [u8], &LayerSpec)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, layer) in layers.into_iter().enumerate() {
        shares[i % threads].push(layer);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = shares
            .into_iter()
            .map(|share| {
                s.spawn(move || {
                    share
                        .into_iter()
                        .map(|(bytes, spec)| fill_layer(bytes, spec, seed, request, blocks))
                        .sum::<u64>()
                })
            })
            .collect();
        // A fill thread only indexes inside its own layer's array: a panic there is a bug of
        // this file, raised again here as it would be without threads.
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .sum()
    })
}

/// Fills one layer's array `bytes` (laid out by `spec`'s geometry) for `blocks`.
fn fill_layer(bytes: &mut [u8], spec: &LayerSpec, seed: u64, request: u64, blocks: &[u64]) -> u64 {
    let g = &spec.geometry;
    let chunk = (g.head_dim * g.elem.get()) as usize;
    let cell = chunk * g.parts() as usize;
    let (n, bs) = (g.tokens_per_kernel_block, g.block_size());
    let mut buf = vec![0u8; STRETCH as usize * cell];
    let mut written = 0u64;
    for h in 0..g.heads {
        let global = spec.head_offset as u64 + h;
        let mut current = None;
        for (position, &block) in blocks.iter().enumerate() {
            for i in 0..bs {
                let t = position as u64 * bs + i;
                if current != Some(t / STRETCH) {
                    current = Some(t / STRETCH);
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(stretch_seed(
                        seed,
                        request,
                        spec.layer,
                        global,
                        t / STRETCH,
                    ));
                    rng.fill_bytes(&mut buf);
                }
                let kb = block * g.kernel_blocks_per_block + i / n;
                let mut src = (t % STRETCH) as usize * cell;
                for part in 0..g.parts() {
                    let at = g.byte_offset(part, kb, i % n, h, 0) as usize;
                    bytes[at..at + chunk].copy_from_slice(&buf[src..src + chunk]);
                    src += chunk;
                }
                written += cell as u64;
            }
        }
    }
    written
}
