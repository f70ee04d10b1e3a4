//! How many blocks each side of the demo holds: as many requests as a memory budget per side
//! allows (all of them when they fit), so that a stage of requests published together is long
//! and the load phase measures the loads' steady state, not a window that fills and drains
//! every few requests. The budget is `--pool-memory`, else a share of the memory the side's KV
//! takes (the GPU's free memory and the host copy with `--device cuda`, host memory without).

use std::fmt;

use crate::models::ModelShape;

/// Default share of a GPU's free memory (measured before either side allocates) one side's
/// pool may take with `--device cuda`: both sides on one GPU take at most 0.8 of it, the rest
/// left to the transports' and checksums' buffers and the device-copy reference.
pub const DEVICE_SHARE: f64 = 0.4;
/// Default share of this machine's memory one side's pool may take with `--device cuda`: each
/// side's KV is generated in a host copy of its arena (the producer's is written whole).
pub const HOST_SHARE_CUDA: f64 = 0.25;
/// Default share of this machine's memory one side's pool may take with `--device cpu`: both
/// arenas are host memory and are written whole (the producer's by prefill, the consumer's by
/// the loads), beside the transport's buffers; a sixteenth keeps the default demo's peak where
/// pools of four of the longest prompts had it on a 24 GiB machine (about 4 GB).
pub const HOST_SHARE_CPU: f64 = 0.0625;
/// Most requests one stage prefills and publishes before its loads start. It bounds a stage's
/// publishes and loads, and with them the demo producer's lease, which must outlast a stage.
pub const MAX_STAGE_REQUESTS: usize = 1024;

/// Where a side's pool budget came from (what a budget error names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BudgetFrom {
    /// `--pool-memory`.
    Flag,
    /// [`DEVICE_SHARE`] of GPU `ordinal`'s `free` bytes.
    Device {
        /// The GPU.
        ordinal: u32,
        /// Its free memory at the start, bytes.
        free: u64,
    },
    /// `share` of this machine's `physical` bytes of memory.
    Host {
        /// [`HOST_SHARE_CUDA`] or [`HOST_SHARE_CPU`].
        share: f64,
        /// This machine's memory, bytes.
        physical: u64,
    },
}

impl fmt::Display for BudgetFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetFrom::Flag => write!(f, "--pool-memory"),
            BudgetFrom::Device { ordinal, free } => write!(
                f,
                "by default {DEVICE_SHARE} of GPU {ordinal}'s {free} free bytes; set --pool-memory"
            ),
            BudgetFrom::Host { share, physical } => write!(
                f,
                "by default {share} of this machine's {physical} bytes of memory; set --pool-memory"
            ),
        }
    }
}

/// The bytes one side's pool may hold and where that came from: `flag` (`--pool-memory`) when
/// given, else the least of `host_share` of `physical` bytes and, with a GPU (`device`: its
/// ordinal and free bytes), [`DEVICE_SHARE`] of its free memory.
pub fn side_budget(
    flag: Option<u64>,
    host_share: f64,
    physical: u64,
    device: Option<(u32, u64)>,
) -> (u64, BudgetFrom) {
    if let Some(b) = flag {
        return (b, BudgetFrom::Flag);
    }
    // f64 of a u64 byte count: exact to 2^53 bytes, far past any machine's memory.
    let host = (physical as f64 * host_share) as u64;
    let from_host = (
        host,
        BudgetFrom::Host {
            share: host_share,
            physical,
        },
    );
    match device {
        Some((ordinal, free)) if ((free as f64 * DEVICE_SHARE) as u64) < host => (
            (free as f64 * DEVICE_SHARE) as u64,
            BudgetFrom::Device { ordinal, free },
        ),
        _ => from_host,
    }
}

/// Bytes one block of `block_size` tokens of `model` takes over a whole side of `tp` ranks:
/// every layer's K and V (one latent for MLA) of every head, and a state per state layer,
/// times the copies TP makes (MLA's latent and heads fewer than the ranks are replicated).
/// Saturating: a size past u64 asks for more than any budget.
pub fn side_block_bytes(model: &ModelShape, tp: u32, block_size: u64) -> u64 {
    let copies = if model.mla {
        tp
    } else {
        (tp / model.kv_heads.max(1)).max(1)
    };
    let state = u64::from(model.state_layers).saturating_mul(model.state_bytes);
    model
        .bytes_per_token()
        .saturating_mul(block_size)
        .saturating_add(state)
        .saturating_mul(u64::from(copies))
}

/// The longest request needs `need` bytes of a side's pool, more than its `budget`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooSmall {
    /// Bytes of the longest request on this side (u64::MAX: past 2^64).
    pub need: u64,
}

/// Blocks of a side's pool for requests of `lengths` tokens in blocks of `block_size`, each
/// block `block_bytes` bytes: as many as `budget` bytes hold, never more than all the requests
/// together, plus one. Errors: [`TooSmall`] when the longest request alone needs more than the
/// budget (no stage could hold it).
pub fn pool_blocks(
    lengths: &[u64],
    block_size: u64,
    block_bytes: u64,
    budget: u64,
) -> Result<u64, TooSmall> {
    let blocks = lengths.iter().map(|&t| t.div_ceil(block_size));
    let largest = blocks.clone().max().unwrap_or(1);
    // Past 2^64 bytes is more than any budget, u64::MAX included.
    match largest.checked_mul(block_bytes) {
        Some(need) if need <= budget => {}
        need => {
            return Err(TooSmall {
                need: need.unwrap_or(u64::MAX),
            })
        }
    }
    let all = blocks.fold(0u64, u64::saturating_add).max(largest);
    let fit = budget / block_bytes.max(1);
    Ok(all.min(fit).saturating_add(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::model_by_name;

    #[test]
    fn a_pool_holds_what_its_budget_allows_but_never_more_than_all_requests() {
        // Largest request 4 blocks of 16 tokens; all six together 16 blocks; 10 bytes a block.
        let lengths = [64, 20, 33, 16, 50, 17];
        assert_eq!(pool_blocks(&lengths, 16, 10, 1 << 30), Ok(16 + 1));
        assert_eq!(pool_blocks(&lengths, 16, 10, 90), Ok(9 + 1));
        // Exactly the longest request fits.
        assert_eq!(pool_blocks(&lengths, 16, 10, 40), Ok(4 + 1));
        assert_eq!(
            pool_blocks(&lengths, 16, 10, 39),
            Err(TooSmall { need: 40 })
        );
        assert_eq!(
            pool_blocks(&[u64::MAX], 1, 2, u64::MAX),
            Err(TooSmall { need: u64::MAX })
        );
    }

    #[test]
    fn the_budget_is_the_flag_else_the_least_of_the_host_and_device_shares() {
        assert_eq!(
            side_budget(Some(7), 0.5, 100, Some((0, 10))),
            (7, BudgetFrom::Flag)
        );
        let host = BudgetFrom::Host {
            share: 0.25,
            physical: 1000,
        };
        assert_eq!(side_budget(None, 0.25, 1000, None), (250, host));
        // 0.4 of 1000 free bytes is more than the host's 250: the host bounds it.
        assert_eq!(side_budget(None, 0.25, 1000, Some((1, 1000))), (250, host));
        assert_eq!(
            side_budget(None, 0.25, 1000, Some((1, 500))),
            (
                200,
                BudgetFrom::Device {
                    ordinal: 1,
                    free: 500
                }
            )
        );
    }

    #[test]
    fn a_block_counts_every_copy_tp_makes() {
        let tiny = model_by_name("tiny").unwrap();
        let one = side_block_bytes(tiny, 1, 16);
        assert_eq!(one, tiny.bytes_per_token() * 16);
        // Two heads over two ranks: split, not copied; over four ranks: each head twice.
        assert_eq!(side_block_bytes(tiny, 2, 16), one);
        assert_eq!(side_block_bytes(tiny, 4, 16), 2 * one);
    }
}
