//! Work completions and retries: a completed work request finishes its slices (or hands them to
//! the stager); a failed one retires its endpoint and retries the slice on a fresh endpoint
//! while it has retries left, else reports it to the engine (`CompletionSink::fail_peer`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::sync::MutexExt;

use super::device::Device;
use super::inflight::InFlight;
use super::shared::Shared;
use super::verbs;
use super::work::{StageJob, Work};
use crate::error::{
    EndpointFailure, FailedWork, RdmaError, TransferError, WcStatus, WorkOp, WorkRequest,
};
use crate::types::Op;

impl Shared {
    /// Retries a failed slice on a fresh endpoint while it has retries left (and the failure
    /// can change on retry), else reports it failed with `failure` (and the first failure,
    /// when a retry failed differently).
    pub(super) fn retry_or_fail(
        self: &Arc<Self>,
        mut w: Work,
        failure: RdmaError,
        retryable: bool,
    ) {
        if retryable
            && w.attempts < self.config.max_retries
            && !w.sink.is_cancelled()
            && !self.stop.load(Ordering::SeqCst)
        {
            w.attempts += 1;
            self.retried.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                slice = w.slice.id,
                attempt = w.attempts,
                "retrying RDMA slice: {failure}"
            );
            if w.first_error.is_none() {
                w.first_error = Some(failure);
            }
            self.dispatch(vec![w]);
        } else {
            let err = match (w.first_error.take(), w.attempts) {
                (_, 0) => failure,
                (first, retries) => RdmaError::Retried {
                    first: first
                        .filter(|f| f.to_string() != failure.to_string())
                        .map(Box::new),
                    last: Box::new(failure),
                    retries,
                },
            };
            // a connect or QP failure may mean the peer restarted (new instance, ports and
            // rkeys): the engine fetches its descriptor again and retries the slice once
            w.sink.fail_peer(w.slice.id, TransferError::Rdma(err));
        }
    }

    /// Finishes a work request that completed successfully: its room and credit back, its
    /// slices completed (or handed to the stager).
    fn finish_ok(self: &Arc<Self>, dev: &Device, inf: InFlight) {
        inf.ep.qps[inf.qp]
            .outstanding
            .fetch_sub(1, Ordering::AcqRel);
        dev.return_credit();
        for w in inf.works {
            if w.needs_after() {
                self.stage(StageJob::After(w));
            } else {
                w.sink.complete(w.slice.id, Ok(()));
            }
        }
    }

    /// Handles one work completion.
    pub(super) fn complete(self: &Arc<Self>, dev: &Device, wc: &verbs::WorkCompletion) {
        let Some(inf) = self.lock_inflight(dev).remove(wc.wr_id) else {
            tracing::warn!(
                wr_id = wc.wr_id,
                "RDMA completion for an unknown work request"
            );
            return;
        };
        let ep = inf.ep.clone();
        ep.touch();
        // the unsignalled work requests posted before this one on its QP are done: an RC send
        // queue completes in order, so after a success or an error they succeeded; after a flush
        // they went before the QP failed (an unsignalled one that failed or flushed gave its own
        // completion, which took it off `sent`), yet they go on with this one's slices: moved
        // twice, a slice moves the same bytes, and a provider that flushes without completions
        // for unsignalled work requests loses nothing
        let earlier: Vec<u64> = {
            let mut sent = ep.qps[inf.qp].sent.locked();
            match sent.iter().position(|&id| id == wc.wr_id) {
                Some(at) => {
                    let mut done: Vec<u64> = sent.drain(..=at).collect();
                    done.pop();
                    done
                }
                None => Vec::new(),
            }
        };
        let status = WcStatus::from_code(wc.status);
        let flushed = status == WcStatus::WrFlushErr;
        let mut works = Vec::new();
        for id in earlier {
            let taken = self.lock_inflight(dev).remove(id);
            match taken {
                Some(e) if flushed => {
                    ep.qps[e.qp].outstanding.fetch_sub(1, Ordering::AcqRel);
                    dev.return_credit();
                    works.extend(e.works);
                }
                Some(e) => self.finish_ok(dev, e),
                None => {}
            }
        }
        if status == WcStatus::Success {
            self.finish_ok(dev, inf);
            return;
        }
        ep.qps[inf.qp].outstanding.fetch_sub(1, Ordering::AcqRel);
        dev.return_credit();
        let own = inf.works;
        let (Some(first), Some(last)) = (own.first(), own.last()) else {
            return;
        };
        let sl = &first.slice;
        let failed = FailedWork {
            request: WorkRequest {
                op: match sl.op {
                    Op::Write => WorkOp::Write,
                    Op::Read => WorkOp::Read,
                },
                bytes: inf.len,
                first_slice: sl.id,
                last_slice: last.slice.id,
                wr_id: wc.wr_id,
                local_addr: sl.local_addr,
                peer: first.peer.name.clone(),
                remote_addr: sl.remote_addr,
                rkey: inf.rkey,
                device: dev.info.name.clone(),
                qp_num: ep.qps[inf.qp].qpn,
            },
            status,
            vendor_err: wc.vendor_err,
            after: if flushed {
                ep.first_error.get().cloned()
            } else {
                None
            },
        };
        self.endpoint_failed(&ep, EndpointFailure::Work(Box::new(failed.clone())));
        let retryable = status.retry_can_help();
        let failure = RdmaError::WorkFailed(Box::new(failed));
        // the slice stays the unit of retry: each goes on alone (and may merge anew)
        works.extend(own);
        for w in works {
            self.retry_or_fail(w, failure.clone(), retryable);
        }
    }
}
