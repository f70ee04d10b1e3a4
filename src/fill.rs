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

/// Why a request's KV could not be filled.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// The OS refused a thread to fill some of the layers (out of threads or memory).
    #[error("starting a thread to fill a request's layers: {0}")]
    NoThread(#[source] std::io::Error),
}

/// Fills request `request`'s KV into `blocks` (block ids in request order) of each layer:
/// `layers` holds each layer's whole array (its geometry's `byte_len` bytes) with its spec.
/// Every slot of every block is written (also those past the prompt's end). The layers are
/// spread over up to [`MAX_THREADS`] threads (bounded by the cores); the bytes do not depend
/// on how. Returns the bytes written.
///
/// Errors: [`FillError::NoThread`] when the OS refuses a fill thread (the layers' bytes are
/// then partly written).
pub fn fill_layers(
    layers: Vec<(&mut [u8], &LayerSpec)>,
    seed: u64,
    request: u64,
    blocks: &[u64],
) -> Result<u64, FillError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let thread = || std::thread::Builder::new().name("kvferry-fill".into());
    fill_layers_on(
        layers,
        cores.min(MAX_THREADS),
        thread,
        (seed, request, blocks),
    )
}

/// [`fill_layers`] on up to `threads` threads from `thread`.
fn fill_layers_on(
    layers: Vec<(&mut [u8], &LayerSpec)>,
    threads: usize,
    thread: impl Fn() -> std::thread::Builder,
    (seed, request, blocks): (u64, u64, &[u64]),
) -> Result<u64, FillError> {
    let threads = threads.min(layers.len()).max(1);
    if threads == 1 {
        return Ok(layers
            .into_iter()
            .map(|(bytes, spec)| fill_layer(bytes, spec, seed, request, blocks))
            .sum());
    }
    // Round robin: layers of one side are alike in size.
    let mut shares: Vec<Vec<(&mut [u8], &LayerSpec)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, layer) in layers.into_iter().enumerate() {
        shares[i % threads].push(layer);
    }
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(threads);
        let mut refused = None;
        for share in shares {
            let run = move || {
                share
                    .into_iter()
                    .map(|(bytes, spec)| fill_layer(bytes, spec, seed, request, blocks))
                    .sum::<u64>()
            };
            match thread().spawn_scoped(s, run) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    refused = Some(FillError::NoThread(e));
                    break;
                }
            }
        }
        // A fill thread only indexes inside its own layer's array: a panic there is a bug of
        // this file, raised again here as it would be without threads.
        let written = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .sum();
        match refused {
            Some(e) => Err(e),
            None => Ok(written),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_checksum::group::ReplicaKey;
    use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};

    fn spec(layer: u32) -> LayerSpec {
        let layout = Layout::parse("KV B N H D").unwrap();
        LayerSpec {
            name: format!("model.layers.{layer}.self_attn.attn"),
            layer,
            head_offset: 0,
            geometry: Geometry::contiguous(layout, 4, 16, 2, 8, ElemBytes::Two, 1).unwrap(),
            kind: None,
            dtype: None,
            replica: ReplicaKey::NONE,
        }
    }

    /// The bytes do not depend on the number of fill threads.
    #[test]
    fn threads_do_not_change_the_bytes() {
        let specs: Vec<LayerSpec> = (0..3).map(spec).collect();
        let len = specs[0].geometry.byte_len() as usize;
        let fill = |threads| {
            let mut arrays = vec![vec![0u8; len]; specs.len()];
            let layers = arrays.iter_mut().map(|a| &mut a[..]).zip(&specs).collect();
            let thread = std::thread::Builder::new;
            let n = fill_layers_on(layers, threads, thread, (7, 3, &[2, 0])).unwrap();
            (n, arrays)
        };
        assert_eq!(fill(1), fill(2));
        assert!(fill(1).0 > 0);
    }

    /// A fill thread the OS refuses (a stack no address space holds) fails the fill with a
    /// typed error instead of panicking the process.
    #[test]
    fn a_fill_thread_the_os_refuses_is_an_error() {
        let specs: Vec<LayerSpec> = (0..2).map(spec).collect();
        let len = specs[0].geometry.byte_len() as usize;
        let mut arrays = vec![vec![0u8; len]; specs.len()];
        let layers = arrays.iter_mut().map(|a| &mut a[..]).zip(&specs).collect();
        let refused = || std::thread::Builder::new().stack_size(1 << 60);
        let e = fill_layers_on(layers, 2, refused, (7, 3, &[2, 0])).unwrap_err();
        assert!(matches!(e, FillError::NoThread(_)), "{e:?}");
    }
}
