//! Frame coalescing: slices become data frames (`Job`s), merged where they continue each other
//! and gathered into scattered WRITEs where they do not.

use crate::error::{Result, TransferError};
use crate::transport::wire;
use crate::transport::{CompletionSink, Slice};
use crate::types::Op;

/// One data frame: consecutive slices (contiguous on both sides, same op and regions) merged
/// into `slice`, reported per original id in `ids`; `more` holds further WRITE pieces of a
/// scattered WRITE (op 3), each merged the same way.
pub(super) struct Job {
    pub(super) slice: Slice,
    pub(super) ids: std::ops::Range<u32>,
    pub(super) more: Vec<(Slice, std::ops::Range<u32>)>,
    pub(super) sink: CompletionSink,
    /// The grant token the frame carries (zero: none).
    pub(super) token: [u8; 16],
}

impl Job {
    pub(super) fn complete(&self, result: Result<()>) {
        let more = self.more.iter().flat_map(|(_, ids)| ids.clone());
        for id in self.ids.clone().chain(more) {
            self.sink.complete(id, result.clone());
        }
    }

    /// Fails every slice of the frame as a failure of the peer's connection (see
    /// `CompletionSink::fail_peer`).
    pub(super) fn fail_peer(&self, err: &TransferError) {
        let more = self.more.iter().flat_map(|(_, ids)| ids.clone());
        for id in self.ids.clone().chain(more) {
            self.sink.fail_peer(id, err.clone());
        }
    }

    /// Payload bytes of the frame.
    pub(super) fn bytes(&self) -> u64 {
        self.slice.len + self.more.iter().map(|(s, _)| s.len).sum::<u64>()
    }
}

/// Merges runs of slices that continue each other on both sides (same op, same local region and
/// remote buffer, consecutive ids) into frames of at most `limit` bytes: fewer headers, acks and
/// syscalls per byte. Slices longer than `limit` stay whole. Then runs of small WRITE frames
/// that do not continue each other become scattered WRITEs of at most `limit` bytes and
/// `MAX_PIECES` pieces.
pub(super) fn coalesce(
    slices: &[Slice],
    limit: u64,
    sink: &CompletionSink,
    token: [u8; 16],
) -> Vec<Job> {
    let mut out: Vec<Job> = Vec::new();
    // `out.last()`'s payload bytes (`Job::bytes`), kept as pieces are gathered: summing the
    // pieces on every gather would cost O(pieces) per slice.
    let mut acc_bytes = 0u64;
    for j in merge_continuing(slices, limit, sink, token) {
        if let Some(acc) = out.last_mut() {
            let gather = acc.slice.op == Op::Write
                && j.slice.op == Op::Write
                && acc.more.len() + 1 < wire::MAX_PIECES
                && acc_bytes + j.slice.len <= limit;
            if gather {
                acc_bytes += j.slice.len;
                acc.more.push((j.slice, j.ids));
                continue;
            }
        }
        acc_bytes = j.slice.len;
        out.push(j);
    }
    out
}

fn merge_continuing(
    slices: &[Slice],
    limit: u64,
    sink: &CompletionSink,
    token: [u8; 16],
) -> Vec<Job> {
    let mut jobs: Vec<Job> = Vec::new();
    for &s in slices {
        if let Some(j) = jobs.last_mut() {
            let m = &mut j.slice;
            let continues = m.op == s.op
                && m.local_region == s.local_region
                && m.remote_buffer == s.remote_buffer
                && m.local_addr + m.len == s.local_addr
                && m.remote_addr + m.len == s.remote_addr
                && j.ids.end == s.id
                && m.len + s.len <= limit;
            if continues {
                m.len += s.len;
                j.ids.end += 1;
                continue;
            }
        }
        jobs.push(Job {
            slice: s,
            ids: s.id..s.id + 1,
            more: Vec::new(),
            sink: sink.clone(),
            token,
        });
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryRegion;
    use crate::transport::completion::BatchState;
    use crate::types::Location;

    #[test]
    fn coalesce_merges_only_continuing_slices_up_to_the_limit() {
        let region = MemoryRegion {
            addr: 0,
            len: 1 << 30,
            location: Location::Cpu,
        };
        let mk = |id: u32, op: Op, l: u64, r: u64, len: u64, buf: usize| Slice {
            id,
            op,
            local_addr: l,
            local_region: region,
            remote_addr: r,
            remote_buffer: buf,
            len,
        };
        let slices = vec![
            mk(0, Op::Write, 0, 1000, 100, 0),
            mk(1, Op::Write, 100, 1100, 100, 0), // continues 0
            mk(2, Op::Write, 200, 1300, 100, 0), // remote gap
            mk(3, Op::Read, 300, 1400, 100, 0),  // other op
            mk(4, Op::Read, 400, 1500, 100, 1),  // other buffer
            mk(5, Op::Read, 500, 1600, 100, 1),  // continues 4
            mk(6, Op::Read, 600, 1700, 100, 1),  // would exceed 250
        ];
        let sink = CompletionSink::new(BatchState::new(7));
        let jobs = coalesce(&slices, 250, &sink, [0; 16]);
        let got: Vec<(std::ops::Range<u32>, u64, u64)> = jobs
            .iter()
            .map(|j| (j.ids.clone(), j.slice.local_addr, j.slice.len))
            .collect();
        assert_eq!(
            got,
            vec![
                (0..2, 0, 200),
                (2..3, 200, 100),
                (3..4, 300, 100),
                (4..6, 400, 200),
                (6..7, 600, 100)
            ]
        );
    }

    #[test]
    fn small_writes_that_do_not_continue_are_gathered_into_scattered_frames() {
        let region = MemoryRegion {
            addr: 0,
            len: 1 << 30,
            location: Location::Cpu,
        };
        let mk = |id: u32, op: Op, l: u64, r: u64, len: u64| Slice {
            id,
            op,
            local_addr: l,
            local_region: region,
            remote_addr: r,
            remote_buffer: 0,
            len,
        };
        let sink = CompletionSink::new(BatchState::new(8));
        let slices = vec![
            mk(0, Op::Write, 0, 5000, 100),
            mk(1, Op::Write, 100, 5100, 50), // continues 0: merged into its piece
            mk(2, Op::Write, 900, 100, 60),  // gathered as a second piece
            mk(3, Op::Write, 2000, 9000, 100), // 310 bytes in all: over 300, a new frame
            mk(4, Op::Read, 3000, 7000, 10), // reads are never gathered
            mk(5, Op::Write, 4000, 1000, 10),
            mk(6, Op::Write, 4100, 1200, 400), // alone over the limit: its own frame
        ];
        let jobs = coalesce(&slices, 300, &sink, [0; 16]);
        let shape: Vec<Vec<(std::ops::Range<u32>, u64)>> = jobs
            .iter()
            .map(|j| {
                std::iter::once((j.ids.clone(), j.slice.len))
                    .chain(j.more.iter().map(|(s, ids)| (ids.clone(), s.len)))
                    .collect()
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                vec![(0..2, 150), (2..3, 60)],
                vec![(3..4, 100)],
                vec![(4..5, 10)],
                vec![(5..6, 10)],
                vec![(6..7, 400)],
            ]
        );
        // at most MAX_PIECES pieces per frame
        let many: Vec<Slice> = (0..(wire::MAX_PIECES as u32 + 5))
            .map(|i| mk(i, Op::Write, i as u64 * 10, i as u64 * 10 + 3, 1))
            .collect();
        let sink = CompletionSink::new(BatchState::new(many.len() as u32));
        let jobs = coalesce(&many, 1 << 20, &sink, [0; 16]);
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].more.len() + 1, wire::MAX_PIECES);
        assert_eq!(jobs[1].more.len() + 1, 5);
    }
}
