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
use crate::error::TransferError;
use crate::types::Op;

impl Shared {
    /// Retries a failed slice on a fresh endpoint while it has retries left (and the failure
    /// can change on retry), else reports it failed with `text`.
    pub(super) fn retry_or_fail(self: &Arc<Self>, mut w: Work, text: String, retryable: bool) {
        if retryable
            && w.attempts < self.config.max_retries
            && !w.sink.is_cancelled()
            && !self.stop.load(Ordering::SeqCst)
        {
            w.attempts += 1;
            self.retried.fetch_add(1, Ordering::Relaxed);
            if w.first_error.is_none() {
                w.first_error = Some(text.clone());
            }
            tracing::debug!(
                slice = w.slice.id,
                attempt = w.attempts,
                "retrying RDMA slice: {text}"
            );
            self.dispatch(vec![w]);
        } else {
            let msg = match (&w.first_error, w.attempts) {
                (_, 0) => text,
                (Some(first), n) if *first != text => {
                    format!("{text} (after {n} retries; first failure: {first})")
                }
                (_, n) => format!("{text} (after {n} retries)"),
            };
            // a connect or QP failure may mean the peer restarted (new instance, ports and
            // rkeys): the engine fetches its descriptor again and retries the slice once
            w.sink.fail_peer(w.slice.id, TransferError::rdma(msg));
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
        let flushed = wc.status == verbs::wc::WR_FLUSH_ERR;
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
        if wc.status == verbs::wc::SUCCESS {
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
        let what = format!(
            "RDMA {} of {} bytes (slices {}..={}) between local {:#x} and {} remote {:#x} (rkey {:#x}) on {} QP {:#x}",
            match sl.op {
                Op::Write => "WRITE",
                Op::Read => "READ",
            },
            inf.len,
            sl.id,
            last.slice.id,
            sl.local_addr,
            first.peer.name,
            sl.remote_addr,
            inf.rkey,
            dev.info.name,
            ep.qps[inf.qp].qpn
        );
        let status = verbs::wc_status_text(wc.status);
        let text = match (wc.status, ep.first_error.get()) {
            (verbs::wc::WR_FLUSH_ERR, Some(first)) => format!("{what}: {status}, after: {first}"),
            _ => format!("{what}: work completion status {status}"),
        };
        self.endpoint_failed(&ep, text.clone());
        // errors a retry cannot change: the request itself is wrong
        let retryable = !matches!(
            wc.status,
            verbs::wc::REM_ACCESS_ERR
                | verbs::wc::REM_INV_REQ_ERR
                | verbs::wc::LOC_PROT_ERR
                | verbs::wc::LOC_LEN_ERR
                | verbs::wc::LOC_ACCESS_ERR
        );
        // the slice stays the unit of retry: each goes on alone (and may merge anew)
        works.extend(own);
        for w in works {
            self.retry_or_fail(w, text.clone(), retryable);
        }
    }
}
