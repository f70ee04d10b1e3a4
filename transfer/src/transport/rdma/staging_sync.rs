//! GPU memory the NIC cannot register (docs/design.md §3 "GPU memory", the last resort after dma-buf
//! and peer memory): the region gets a host mirror of its own size, registered with the NIC in
//! its place, and device copies keep the two in step.
//!
//! One-sided verbs never tell the target that bytes landed, so the initiator does it: after its
//! WRITEs into a staged buffer complete it sends a `to-device` sync naming the ranges, and the
//! owner copies them from the mirror to the device before it answers; before READs from a
//! staged buffer it sends a `to-host` sync, and the owner copies the ranges from the device
//! into the mirror. A slice is reported done only after its sync, so "done" still means "in
//! place". Syncs travel as `Connect` handshake frames (JSON, see [`SyncRequest`]).
//!
//! This module holds the sync message and the checks of a peer's ranges; the mirror itself is
//! `mirror.rs`, and the thread that orders the copies around work requests is `stager.rs`.

use serde::{Deserialize, Serialize};
use std::sync::Arc;

use super::mirror::Mirror;
use crate::error::{ArgumentError, ProtocolError, Result, SyncBound, TransferError};

/// Most ranges one sync request may name (a body is at most 1 MiB anyway).
pub(crate) const MAX_SYNC_RANGES: usize = 65_536;
/// Most ranges the initiator puts in one sync: a range is at most 43 bytes of JSON
/// (`[u64,u64],`), so 16 Ki of them stay well under the 1 MiB frame limit.
pub(crate) const SYNC_RANGES_PER_REQUEST: usize = 16_384;
/// Most bytes the initiator asks one sync to copy: at a device copy rate of 1 GB/s that is
/// about 0.27 s, far inside the default 5 s `handshake_timeout` (one sync for a whole
/// multi-GiB batch would not be).
pub(crate) const SYNC_BYTES_PER_REQUEST: u64 = 256 << 20;
/// Most copies one sync may expand to once ranges are cut at region boundaries (bounds the
/// owner's work for ranges that each span many regions).
const MAX_SYNC_COPIES: usize = 4 * MAX_SYNC_RANGES;

/// Which way a sync copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Direction {
    /// Mirror → device: the initiator's WRITEs into these ranges completed.
    ToDevice,
    /// Device → mirror: the initiator is about to READ these ranges.
    ToHost,
}

/// The body of a sync: `{"staging_sync": {"direction": "to-device", "ranges": [[addr, len]...]}}`
/// with addresses in the owner's region address space (the buffers of its descriptor).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SyncRequest {
    pub staging_sync: SyncBody,
}

/// See [`SyncRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SyncBody {
    pub direction: Direction,
    pub ranges: Vec<(u64, u64)>,
}

impl SyncRequest {
    /// One request for `ranges` (merged), however many they are (tests; the stager sends
    /// [`SyncRequest::split`]).
    #[cfg(test)]
    pub fn new(direction: Direction, ranges: Vec<(u64, u64)>) -> SyncRequest {
        SyncRequest {
            staging_sync: SyncBody {
                direction,
                ranges: merge(ranges),
            },
        }
    }

    /// Requests for `ranges` (merged), none for no ranges, each with at most
    /// [`SYNC_RANGES_PER_REQUEST`] ranges (so its body fits a handshake frame,
    /// `handshake::MAX_FRAME_BODY`, and the owner's [`MAX_SYNC_RANGES`]) and at most
    /// [`SYNC_BYTES_PER_REQUEST`] bytes (ranges are cut to fit: the owner copies them before it
    /// answers, within the initiator's `handshake_timeout`). Ranges keep their sorted order.
    pub fn split(direction: Direction, ranges: Vec<(u64, u64)>) -> Vec<SyncRequest> {
        let request = |ranges| SyncRequest {
            staging_sync: SyncBody { direction, ranges },
        };
        let (mut out, mut cur, mut bytes) = (Vec::new(), Vec::new(), 0u64);
        for (mut addr, mut len) in merge(ranges) {
            while len > 0 {
                if cur.len() == SYNC_RANGES_PER_REQUEST || bytes == SYNC_BYTES_PER_REQUEST {
                    out.push(request(std::mem::take(&mut cur)));
                    bytes = 0;
                }
                let n = len.min(SYNC_BYTES_PER_REQUEST - bytes);
                cur.push((addr, n));
                (addr, len, bytes) = (addr + n, len - n, bytes + n);
            }
        }
        if !cur.is_empty() {
            out.push(request(cur));
        }
        out
    }

    /// `None` when `body` is not a sync (a connect request); `Some(Ok)` for a sync;
    /// `Some(Err(Protocol))` for a body that names `staging_sync` but is malformed (so the
    /// peer is told what is wrong with its sync, not with a connect request it never sent).
    pub fn parse(body: &[u8]) -> Option<Result<SyncRequest>> {
        match serde_json::from_slice(body) {
            Ok(r) => Some(Ok(r)),
            Err(_) if !body.windows(14).any(|w| w == b"\"staging_sync\"") => None,
            Err(e) => Some(Err(TransferError::Protocol(ProtocolError::BadJson {
                what: "staging sync".into(),
                source: e.into(),
            }))),
        }
    }
}

/// Sorts ranges and joins overlapping or adjacent ones; zero lengths and ranges that wrap the
/// address space are dropped (the owner refuses nothing it was not asked for).
pub(crate) fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.retain(|&(a, l)| l > 0 && a.checked_add(l).is_some());
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (a, l) in ranges {
        match out.last_mut() {
            Some((pa, pl)) if a <= *pa + *pl => *pl = (*pl).max(a + l - *pa),
            _ => out.push((a, l)),
        }
    }
    out
}

/// Checks a peer's sync ranges against this engine's staged regions: every byte of each range
/// must lie in a mirror (`find(addr, 1)`: the mirror holding byte `addr`). A range may run across
/// staged regions registered back to back (the initiator merges adjacent slices without knowing
/// where regions end); it is cut at their boundaries. Returns the copies to make, or
/// `InvalidArgument` naming the first bad range (then nothing is copied).
pub(crate) fn resolve(
    body: &SyncBody,
    find: impl Fn(u64, u64) -> Option<Arc<Mirror>>,
) -> Result<Vec<(Arc<Mirror>, u64, u64)>> {
    if body.ranges.len() > MAX_SYNC_RANGES {
        return Err(bound(SyncBound::TooManyRanges {
            ranges: body.ranges.len(),
            limit: MAX_SYNC_RANGES,
        }));
    }
    let mut copies = Vec::with_capacity(body.ranges.len());
    for &(addr, len) in &body.ranges {
        if len == 0 {
            return Err(bound(SyncBound::ZeroLength { addr }));
        }
        let outside = || bound(SyncBound::NotStaged { addr, len });
        let end = addr.checked_add(len).ok_or_else(outside)?;
        let mut at = addr;
        while at < end {
            let m = find(at, 1).ok_or_else(outside)?;
            // `find` says `at` is inside the mirror's region, so `at < region.end()`
            let piece = end.min(m.region().end()).saturating_sub(at);
            if piece == 0 {
                return Err(outside());
            }
            if copies.len() >= MAX_SYNC_COPIES {
                return Err(bound(SyncBound::TooManyPieces {
                    limit: MAX_SYNC_COPIES,
                }));
            }
            copies.push((m, at, piece));
            at += piece;
        }
    }
    Ok(copies)
}
/// `b` as the `InvalidArgument` a bad sync request gets.
fn bound(b: SyncBound) -> TransferError {
    TransferError::InvalidArgument(ArgumentError::StagingSync(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryRegion;
    use crate::transport::rdma::mirror::tests::region_of;
    use crate::types::Location;

    #[test]
    fn merge_joins_overlapping_and_adjacent_ranges_and_drops_empty_ones() {
        assert_eq!(
            merge(vec![
                (300, 10),
                (100, 50),
                (150, 10),
                (120, 5),
                (0, 0),
                (u64::MAX, 5)
            ]),
            vec![(100, 60), (300, 10)]
        );
        assert_eq!(merge(vec![(10, 100), (20, 5)]), vec![(10, 100)]);
        assert!(merge(vec![]).is_empty());
    }

    #[test]
    fn sync_requests_round_trip_and_connect_bodies_are_not_syncs() {
        let r = SyncRequest::new(Direction::ToDevice, vec![(200, 8), (100, 100)]);
        let body = serde_json::to_vec(&r).unwrap();
        let text = String::from_utf8(body.clone()).unwrap();
        assert!(text.contains("\"to-device\""), "{text}");
        assert_eq!(SyncRequest::parse(&body).unwrap().unwrap(), r);
        assert_eq!(r_ranges(&body), vec![(100, 108)]);
        for other in [
            &b"{\"version\":1,\"initiator\":\"a:1\"}"[..],
            b"",
            b"\xff\xfe",
        ] {
            assert!(SyncRequest::parse(other).is_none());
        }
        for junk in [
            &b"{\"staging_sync\":{\"direction\":\"sideways\",\"ranges\":[]}}"[..],
            b"{\"staging_sync\":{\"direction\":\"to-host\",\"ranges\":[[1]]}}",
            b"{\"staging_sync\":{\"direction\":\"to-host\",\"ranges\":[[1,-2]]}}",
            b"{\"staging_sync\":",
        ] {
            let e = SyncRequest::parse(junk).unwrap().unwrap_err().to_string();
            assert!(e.contains("protocol error: staging sync: "), "{e}");
        }
    }

    fn r_ranges(body: &[u8]) -> Vec<(u64, u64)> {
        SyncRequest::parse(body)
            .unwrap()
            .unwrap()
            .staging_sync
            .ranges
    }

    #[test]
    fn resolve_splits_a_merged_range_across_adjacent_staged_regions() {
        // two regions registered back to back (per-layer pieces of one allocation): the
        // initiator merges slices on both sides of the boundary into one range
        let device = vec![0u8; 2048];
        let base = device.as_ptr() as u64;
        let lo = Mirror::new(&MemoryRegion {
            len: 1024,
            ..region_of(&device)
        })
        .unwrap();
        let hi = Mirror::new(&MemoryRegion {
            addr: base + 1024,
            len: 1024,
            location: Location::Cuda(0),
        })
        .unwrap();
        let find = |a: u64, l: u64| {
            [&lo, &hi]
                .into_iter()
                .find(|m| m.region().contains(a, l))
                .cloned()
        };
        let req = SyncRequest::new(
            Direction::ToDevice,
            vec![(base + 1000, 24), (base + 1024, 24)],
        );
        assert_eq!(req.staging_sync.ranges, vec![(base + 1000, 48)]);
        let copies = resolve(&req.staging_sync, find).expect("both halves are staged");
        let got: Vec<(u64, u64, u64)> = copies.iter().map(|(m, a, l)| (m.addr(), *a, *l)).collect();
        assert_eq!(
            got,
            vec![(lo.addr(), base + 1000, 24), (hi.addr(), base + 1024, 24)]
        );
        // still refused: past the second region, or starting outside both
        for bad in [(base + 1000, 1049), (base - 1, 2)] {
            let b = SyncBody {
                direction: Direction::ToHost,
                ranges: vec![bad],
            };
            assert!(resolve(&b, find).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn many_scattered_ranges_become_several_syncs_that_each_fit_a_frame() {
        // 60k non-adjacent slices (KV blocks of many layers) at high addresses: one request
        // would exceed the handshake frame limit and fail the whole batch
        let base = 0x7f00_0000_0000u64;
        let ranges: Vec<(u64, u64)> = (0..60_000u64)
            .map(|i| (base + i * 65_536, 16_384))
            .collect();
        let one =
            serde_json::to_vec(&SyncRequest::new(Direction::ToDevice, ranges.clone())).unwrap();
        assert!(
            one.len() as u64 > crate::handshake::MAX_FRAME_BODY,
            "{}",
            one.len()
        );
        let reqs = SyncRequest::split(Direction::ToDevice, ranges.clone());
        assert!(reqs.len() > 1);
        let mut seen = Vec::new();
        for r in &reqs {
            let body = serde_json::to_vec(r).unwrap();
            assert!(
                body.len() as u64 <= crate::handshake::MAX_FRAME_BODY,
                "{}",
                body.len()
            );
            assert!(r.staging_sync.ranges.len() <= MAX_SYNC_RANGES);
            assert_eq!(r.staging_sync.direction, Direction::ToDevice);
            seen.extend_from_slice(&r.staging_sync.ranges);
        }
        assert_eq!(seen, ranges, "every range once, in order");
        // long numbers: 20-digit addresses (lengths are bounded by the byte cap)
        let (top, l) = (10_000_000_000_000_000_000u64, 16_384u64);
        let long: Vec<(u64, u64)> = (0..3 * SYNC_RANGES_PER_REQUEST as u64 + 1)
            .map(|i| (top + 2 * i * l, l))
            .collect();
        let reqs = SyncRequest::split(Direction::ToHost, long);
        assert_eq!(reqs.len(), 4);
        for r in reqs {
            let n = serde_json::to_vec(&r).unwrap().len() as u64;
            assert!(n <= crate::handshake::MAX_FRAME_BODY, "{n}");
        }
        assert!(SyncRequest::split(Direction::ToHost, vec![]).is_empty());
    }

    #[test]
    fn large_ranges_are_cut_so_no_sync_copies_more_than_its_byte_bound() {
        let base = 0x7f00_0000_0000u64;
        let gib = 1u64 << 30;
        let ranges = vec![(base + 2 * gib, 10), (base, gib + 5)];
        let reqs = SyncRequest::split(Direction::ToHost, ranges.clone());
        let sizes: Vec<u64> = reqs
            .iter()
            .map(|r| r.staging_sync.ranges.iter().map(|&(_, l)| l).sum())
            .collect();
        assert_eq!(
            sizes,
            vec![
                SYNC_BYTES_PER_REQUEST,
                SYNC_BYTES_PER_REQUEST,
                SYNC_BYTES_PER_REQUEST,
                SYNC_BYTES_PER_REQUEST,
                15
            ]
        );
        let all: Vec<(u64, u64)> = reqs
            .into_iter()
            .flat_map(|r| r.staging_sync.ranges)
            .collect();
        assert_eq!(merge(all), merge(ranges), "the same bytes, each once");
    }

    #[test]
    fn resolve_accepts_only_ranges_inside_staged_regions() {
        let device = vec![0u8; 1024];
        let m = Mirror::new(&region_of(&device)).unwrap();
        let base = device.as_ptr() as u64;
        let find = |a: u64, l: u64| m.region().contains(a, l).then(|| m.clone());
        let ok = SyncBody {
            direction: Direction::ToHost,
            ranges: vec![(base, 1024), (base + 10, 1)],
        };
        assert_eq!(resolve(&ok, find).unwrap().len(), 2);
        for bad in [(base + 1000, 25), (base - 8, 8), (base, 0), (0, 1)] {
            let b = SyncBody {
                direction: Direction::ToDevice,
                ranges: vec![(base, 8), bad],
            };
            let e = resolve(&b, find).unwrap_err().to_string();
            assert!(
                e.contains("staged region") || e.contains("zero length"),
                "{e}"
            );
        }
        let many = SyncBody {
            direction: Direction::ToHost,
            ranges: vec![(base, 1); MAX_SYNC_RANGES + 1],
        };
        assert!(resolve(&many, find).is_err());
    }
}
