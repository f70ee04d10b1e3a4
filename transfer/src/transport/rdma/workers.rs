//! The per-device worker threads: the completion thread (polls the CQ, pumps waiting
//! endpoints, runs the watchdog) and the async-event thread.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::device::Device;
use super::endpoint::Endpoint;
use super::shared::Shared;
use super::verbs;
use crate::error::EndpointFailure;

/// Completions taken per poll.
const POLL_BATCH: usize = 64;

impl Shared {
    /// Fails endpoints whose oldest work request waited past `completion_timeout`, and drops
    /// idle ones (`expire_idle`).
    pub(super) fn watchdog(self: &Arc<Self>, dev: &Device) {
        self.expire_idle(dev);
        let limit = self.config.completion_timeout;
        let stale: Vec<Arc<Endpoint>> = {
            let t = self.lock_inflight(dev);
            let mut v: Vec<Arc<Endpoint>> = Vec::new();
            for inf in t.iter() {
                if inf.posted.elapsed() > limit
                    && !inf.ep.is_broken()
                    && !v.iter().any(|e| e.id == inf.ep.id)
                {
                    v.push(inf.ep.clone());
                }
            }
            v
        };
        for ep in stale {
            self.endpoint_failed(
                &ep,
                EndpointFailure::NoCompletion {
                    waited: limit,
                    device: dev.info.name.clone(),
                },
            );
        }
    }
}

/// Longest sleep on the completion channel: the thread checks `stop` and the watchdog at
/// least this often.
const CQ_WAIT: Duration = Duration::from_millis(100);

/// What the completion thread did (logged at debug when it exits): how many polls found
/// completions and how many wake-ups from the channel it took to get them. Measured on
/// soft-RoCE: one wake-up per signalled chain, a few dozen in a 4 s bench run, so the wake-up
/// latency is no part of a batch's time there.
#[derive(Debug, Default)]
struct PollCounts {
    /// Polls that returned completions.
    hits: u64,
    /// Wake-ups by a completion event on the channel.
    wakeups: u64,
}

/// Completion thread of one device: polls the CQ, sleeps on its channel when idle, runs the
/// watchdog once a second. Exits when the transport stops.
pub(super) fn run_completions(s: Arc<Shared>, dev: Arc<Device>) {
    let mut wcs: Vec<verbs::WorkCompletion> = Vec::with_capacity(POLL_BATCH);
    let mut last_watch = Instant::now();
    let mut armed = false;
    let mut counts = PollCounts::default();
    while !s.stop.load(Ordering::SeqCst) {
        let n = match verbs::poll_cq(&dev.cq, &mut wcs) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!("{}: ibv_poll_cq failed (errno {e})", dev.info.name);
                std::thread::sleep(Duration::from_millis(100));
                0
            }
        };
        if n > 0 {
            counts.hits += 1;
            armed = false;
            s.completions.fetch_add(n as u64, Ordering::Relaxed);
            for wc in wcs.iter() {
                s.complete(&dev, wc);
            }
            for ep in s.waiting_endpoints(dev.index) {
                s.pump(&ep);
            }
        } else if !armed {
            // arm, then poll once more: a completion between the poll and the arm raises no event
            if let Err(e) = verbs::req_notify_cq(&dev.cq) {
                tracing::error!("{}: ibv_req_notify_cq failed ({e})", dev.info.name);
            }
            armed = true;
            continue;
        } else if verbs::wait_cq_event(&dev.channel, CQ_WAIT) {
            counts.wakeups += 1;
            armed = false;
        }
        if last_watch.elapsed() >= Duration::from_secs(1) {
            last_watch = Instant::now();
            s.watchdog(&dev);
        }
    }
    tracing::debug!(
        device = %dev.info.name,
        polls_with_completions = counts.hits,
        channel_wakeups = counts.wakeups,
        "RDMA completion thread done"
    );
}

/// Async event thread of one device: logs every event (errors at warn).
pub(super) fn run_events(s: Arc<Shared>, dev: Arc<Device>) {
    let fd = verbs::async_fd(&dev.ctx);
    while !s.stop.load(Ordering::SeqCst) {
        if !verbs::wait_readable(fd, Duration::from_millis(200)) {
            continue;
        }
        while let Some((event, element)) = verbs::take_async_event(&dev.ctx) {
            let name = event.name();
            if event.is_informational() {
                tracing::info!(device = %dev.info.name, element, "RDMA async event: {name}")
            } else {
                tracing::warn!(device = %dev.info.name, element, "RDMA async event: {name} ({})", event.raw())
            }
        }
    }
}
