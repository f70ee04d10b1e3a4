//! Specs checked before any byte moves (docs/design.md §4.5 "Checks"): the block tables a
//! producer publishes and a consumer loads into, and the element type of the layers the two
//! sides pair. One place for these rules, so that a change of what a request carries (several
//! block sizes, more groups) changes them once.
//!
//! - A group's block table covers the request's tokens exactly: `ceil(num_tokens /
//!   block_size)` positions, no more, no fewer. A shorter table would let a load be judged on
//!   blocks that hold only part of the tokens it claims (`publish([[0]], 2^63)` reported
//!   verified); a longer one names blocks no token is in.
//! - Every block id lies inside the cache: below the smallest block count of the group's
//!   layers on every rank of the side.
//! - The blocks a load writes are distinct: two positions written into one consumer block
//!   overwrite each other, and the checksum of the survivor could still match.
//! - Paired layers have the same element type when both sides name one, and both or neither
//!   name one: two caches with equal element sizes but different types (float16 and int16)
//!   copy byte for byte and would complete as `unverified` with meaningless KV.
//!
//! Pure: tables and ranks in, a typed [`TableError`] or [`DtypeError`] out.

use std::collections::HashMap;

use crate::proto::layout::RankLayout;

/// Why a block table cannot be published or loaded into.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// The table does not have exactly `ceil(num_tokens / block_size)` positions.
    #[error(
        "group {group}: the block table has {positions} positions, {num_tokens} tokens in blocks of {block_size} need exactly {needed}"
    )]
    Coverage {
        /// The group.
        group: u32,
        /// Positions in the table.
        positions: u64,
        /// Tokens the request holds.
        num_tokens: u64,
        /// Tokens per block.
        block_size: u64,
        /// `ceil(num_tokens / block_size)`.
        needed: u64,
    },
    /// A block id at or past the cache's block count.
    #[error("group {group} position {position}: block {block} is outside the cache ({num_blocks} blocks)")]
    Outside {
        /// The group.
        group: u32,
        /// The block position.
        position: u64,
        /// The block id.
        block: u64,
        /// Blocks of the smallest layer array of the group.
        num_blocks: u64,
    },
    /// One block at two positions a load writes.
    #[error("group {group}: block {block} is written at positions {first} and {second}")]
    Duplicate {
        /// The group.
        group: u32,
        /// The block id.
        block: u64,
        /// The first position naming it.
        first: u64,
        /// The second.
        second: u64,
    },
    /// The side's ranks have no such group, or it has no layers or a zero block size.
    #[error("group {0}: no layers to hold its blocks")]
    NoCache(u32),
}

/// Two paired layers whose element types differ.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("element type: producer {}, consumer {}", or_unnamed(.producer), or_unnamed(.consumer))]
pub struct DtypeError {
    /// The producer layer's dtype (`None`: not named).
    pub producer: Option<String>,
    /// The consumer layer's dtype (`None`: not named).
    pub consumer: Option<String>,
}

fn or_unnamed(d: &Option<String>) -> String {
    d.as_deref()
        .map_or_else(|| "not named".into(), str::to_string)
}

/// `ceil(num_tokens / block_size)`; `None` for a zero block size.
pub fn blocks_needed(num_tokens: u64, block_size: u64) -> Option<u64> {
    (block_size > 0).then(|| num_tokens.div_ceil(block_size))
}

/// Blocks every rank's every layer of `group_id` holds (the smallest array), with the group's
/// block size. Errors: [`TableError::NoCache`] when a rank lacks the group, or it has no
/// layers or a zero block size.
pub fn cache_blocks(ranks: &[RankLayout], group_id: u32) -> Result<(u64, u64), TableError> {
    let mut min: Option<u64> = None;
    let mut block_size = None;
    for r in ranks {
        let g = r.group(group_id).ok_or(TableError::NoCache(group_id))?;
        block_size.get_or_insert(g.block_size);
        for l in &g.layers {
            let n = l.spec.geometry.num_blocks();
            min = Some(min.map_or(n, |m| m.min(n)));
        }
    }
    match (min, block_size) {
        (Some(n), Some(bs)) if bs > 0 => Ok((n, bs)),
        _ => Err(TableError::NoCache(group_id)),
    }
}

/// One group's table: exactly `ceil(num_tokens / block_size)` positions, every block id below
/// `num_blocks` (`None`, a null block, is allowed anywhere: sliding windows leave them).
pub fn check_table(
    group: u32,
    table: &[Option<u64>],
    num_tokens: u64,
    block_size: u64,
    num_blocks: u64,
) -> Result<(), TableError> {
    let needed = blocks_needed(num_tokens, block_size).ok_or(TableError::NoCache(group))?;
    if table.len() as u64 != needed {
        return Err(TableError::Coverage {
            group,
            positions: table.len() as u64,
            num_tokens,
            block_size,
            needed,
        });
    }
    for (position, block) in table.iter().enumerate() {
        if let Some(block) = *block {
            if block >= num_blocks {
                return Err(TableError::Outside {
                    group,
                    position: position as u64,
                    block,
                    num_blocks,
                });
            }
        }
    }
    Ok(())
}

/// The tables of a publish or a load against a side's ranks: every group of `tables`
/// (`(group_id, table)`) by [`check_table`].
pub fn check_tables<'a>(
    ranks: &[RankLayout],
    tables: impl IntoIterator<Item = (u32, &'a [Option<u64>])>,
    num_tokens: u64,
) -> Result<(), TableError> {
    for (group, table) in tables {
        let (num_blocks, block_size) = cache_blocks(ranks, group)?;
        check_table(group, table, num_tokens, block_size, num_blocks)?;
    }
    Ok(())
}

/// The blocks a load writes (`positions[i]` → `blocks[i]`) name each block once.
pub fn check_distinct(group: u32, positions: &[u64], blocks: &[u64]) -> Result<(), TableError> {
    // Sorted ids with no two alike: no duplicate (the common case, without a hash per block).
    // Else the walk below names the first duplicate in list order.
    let n = positions.len().min(blocks.len());
    let mut sorted = blocks[..n].to_vec();
    sorted.sort_unstable();
    if sorted.windows(2).all(|w| w[0] != w[1]) {
        return Ok(());
    }
    let mut seen: HashMap<u64, u64> = HashMap::with_capacity(blocks.len());
    for (&position, &block) in positions.iter().zip(blocks) {
        if let Some(&first) = seen.get(&block) {
            return Err(TableError::Duplicate {
                group,
                block,
                first,
                second: position,
            });
        }
        seen.insert(block, position);
    }
    Ok(())
}

/// Paired layers' element types agree (both unnamed, or both the same name).
pub fn check_dtype(producer: Option<&str>, consumer: Option<&str>) -> Result<(), DtypeError> {
    if producer == consumer {
        return Ok(());
    }
    Err(DtypeError {
        producer: producer.map(str::to_string),
        consumer: consumer.map(str::to_string),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_needed_is_the_ceiling() {
        assert_eq!(blocks_needed(0, 16), Some(0));
        assert_eq!(blocks_needed(1, 16), Some(1));
        assert_eq!(blocks_needed(16, 16), Some(1));
        assert_eq!(blocks_needed(17, 16), Some(2));
        assert_eq!(blocks_needed(u64::MAX, 16), Some(u64::MAX / 16 + 1));
        assert_eq!(blocks_needed(5, 0), None);
    }

    #[test]
    fn a_table_covers_the_tokens_exactly() {
        let t = [Some(0), Some(1), Some(2)];
        assert!(check_table(0, &t, 40, 16, 10).is_ok());
        assert!(check_table(0, &t, 33, 16, 10).is_ok());
        for tokens in [32, 49, 1 << 63] {
            assert!(
                matches!(
                    check_table(0, &t, tokens, 16, 10),
                    Err(TableError::Coverage { positions: 3, .. })
                ),
                "{tokens}"
            );
        }
        // publish([[0]], 2^63): one block cannot hold 2^63 tokens.
        assert!(check_table(0, &[Some(0)], 1 << 63, 16, 10).is_err());
        // Null blocks (sliding windows) count as positions.
        assert!(check_table(0, &[None, None, Some(4)], 40, 16, 10).is_ok());
    }

    #[test]
    fn block_ids_lie_inside_the_cache() {
        assert!(check_table(0, &[Some(9)], 1, 16, 10).is_ok());
        assert_eq!(
            check_table(3, &[None, Some(10)], 20, 16, 10),
            Err(TableError::Outside {
                group: 3,
                position: 1,
                block: 10,
                num_blocks: 10
            })
        );
        assert!(check_table(0, &[Some(u64::MAX)], 1, 16, 10).is_err());
    }

    #[test]
    fn a_load_writes_each_block_once() {
        assert!(check_distinct(0, &[0, 1, 2], &[5, 6, 7]).is_ok());
        assert_eq!(
            check_distinct(0, &[0, 1, 2, 3], &[5, 5, 5, 5]),
            Err(TableError::Duplicate {
                group: 0,
                block: 5,
                first: 0,
                second: 1
            })
        );
    }

    #[test]
    fn dtypes_compare_like_layouts() {
        assert!(check_dtype(Some("torch.float16"), Some("torch.float16")).is_ok());
        assert!(check_dtype(None, None).is_ok());
        let e = check_dtype(Some("torch.float16"), Some("torch.int16")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "element type: producer torch.float16, consumer torch.int16"
        );
        assert!(check_dtype(Some("torch.float16"), None).is_err());
        assert!(check_dtype(None, Some("torch.int16")).is_err());
    }
}
