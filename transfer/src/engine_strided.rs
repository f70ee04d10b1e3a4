//! `TransferEngine::submit_strided`: a batch of strided requests (`crate::strided`), validated
//! per block and handed to the transport as strided groups where it takes them, else cut into
//! slices as `submit` does.

use crate::engine::TransferEngine;
use crate::error::Result;
use crate::segment::SegmentHandle;
use crate::strided::{self, StridedRequest, Validated};
use crate::transport::CompletionSink;
use crate::types::{BatchId, Op};

impl TransferEngine {
    /// Submits the copies of `requests` (all with segment `target`) as one batch and returns at
    /// once with its id, as `submit` of the same copies (`StridedRequest::copies`) would, but
    /// validated in O(ranges + blocks): every block whose copies' span lies inside one
    /// registered region and one of the peer's advertised buffers, between which the transport
    /// takes strided groups (`Transport::takes_strided`: CUDA IPC), is checked once and goes to
    /// the transport without a slice per copy. When any block does not fit (its ranges straddle
    /// regions or buffers, lie outside them, the descriptor is stale) or the transport takes no
    /// strided groups for a pair (TCP, RDMA), the whole batch goes through `submit` with the
    /// expanded copies: the same checks, the same errors, the slice as the unit of completion.
    /// So this accepts exactly what `submit` of the same copies accepts. Errors: as `submit`;
    /// `InvalidArgument` for a range of length 0 or a copy whose address overflows.
    pub fn submit_strided(
        &self,
        target: &SegmentHandle,
        requests: &[StridedRequest],
    ) -> Result<BatchId> {
        self.submit_strided_inner(target, requests, false)
            .map(|(id, _)| id)
    }

    /// As [`TransferEngine::submit_strided`], and also returns the batch's device points when
    /// it has them: events on the transport's own streams after which every copy of the batch
    /// is in place on the device (CUDA IPC copies enqueued at submit), for ordering device
    /// work that reads the landed bytes (a checksum kernel: `cuStreamWaitEvent`) without a
    /// host round trip. `None` when any copy of the batch has no such event (TCP, RDMA, a
    /// pair that went to the fallback, a group failed before its copies were enqueued): wait
    /// for the batch on the host then. The batch is still waited for as any (`wait`), which
    /// alone says whether the copies succeeded: a point only says where they end.
    /// Errors: as `submit_strided`.
    pub fn submit_strided_with_points(
        &self,
        target: &SegmentHandle,
        requests: &[StridedRequest],
    ) -> Result<(BatchId, Option<Vec<crate::transport::StreamPoint>>)> {
        self.submit_strided_inner(target, requests, true)
    }

    fn submit_strided_inner(
        &self,
        target: &SegmentHandle,
        requests: &[StridedRequest],
        points: bool,
    ) -> Result<(BatchId, Option<Vec<crate::transport::StreamPoint>>)> {
        let t0 = std::time::Instant::now();
        let desc = target.descriptor.clone();
        let validated = if desc.check_kind(self.transport.kind()).is_err() {
            Validated::Expand // `submit` names the error
        } else {
            strided::validate(
                requests,
                |a, n| self.registry.with_region(a, n, |e| e.region),
                |a, n| {
                    let i = desc.find_buffer_index(a, n)?;
                    Some((i, desc.buffers[i].region))
                },
                |l, b| self.transport.takes_strided(&desc, l, b),
            )?
        };
        let groups = match validated {
            Validated::Compact(g) => g,
            Validated::Expand => {
                return Ok((self.submit(target, &strided::expand(requests)?)?, None));
            }
        };
        let mut starts: smallvec::SmallVec<[u64; 2]> = smallvec::SmallVec::new();
        for g in &groups {
            if !starts.contains(&g.local_region.addr) {
                starts.push(g.local_region.addr);
            }
        }
        let pins = self.registry.pin(&starts)?;
        let first = requests
            .iter()
            .find_map(|r| Some(r.blocks.first()?.0 + r.ranges.first()?.local));
        let op = requests.first().map(|r| r.op).unwrap_or(Op::Write);
        let bytes = requests
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.bytes()));
        let path = self.path_label_at(first);
        let n = groups.len() as u32;
        let meter = self.series.start_with(t0, path, &desc.name, op, bytes, n);
        let (id, state) = self.batches.start(n, meter);
        state.hold(pins);
        self.peers.touch(&desc, t0);
        let timing = tracing::enabled!(target: "kvferry::timing", tracing::Level::DEBUG);
        let prep_us = if timing {
            t0.elapsed().as_micros() as u64
        } else {
            0
        };
        if points {
            state.want_points();
        }
        if !groups.is_empty() {
            self.transport
                .post_strided(&desc, &groups, CompletionSink::new(state.clone()));
        }
        // `None` unless asked for above (`want_points`).
        let points = state.take_points();
        if timing {
            tracing::debug!(
                target: "kvferry::timing",
                groups = groups.len(),
                prep_us,
                post_us = t0.elapsed().as_micros() as u64 - prep_us,
                "engine submit strided"
            );
        }
        Ok((id, points))
    }
}
