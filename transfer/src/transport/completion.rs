//! Per-batch completion accounting: transports report slices, waiters wait (Mooncake: a task is
//! done when success + failed slices = slices).

use crate::sync::MutexExt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{ProtocolError, Shared, TransferError};
use crate::types::BatchStatus;

/// How long a waiter of a batch marked `expect_soon` polls before it sleeps: longer than a
/// device copy of a few hundred MiB, short enough that a slow batch costs a core only briefly.
const SOON_SPIN: Duration = Duration::from_millis(2);

#[derive(Debug)]
struct Counts {
    succeeded: u32,
    failed: u32,
    first_error: Option<TransferError>,
    /// Inline for the few slices of a common batch (a batch is made per submit).
    reported: smallvec::SmallVec<[bool; 16]>,
    timed_out: bool,
    /// Threads asleep on `cond` now: a report notifies the condvar only when one is (a
    /// notification is a system call whether or not anybody waits).
    sleepers: u32,
    /// The local regions the slices use, pinned until the last slice is reported (then they
    /// may be unregistered): not when the waiter gives up, since slices on the wire still land.
    pins: Option<crate::inflight::Pins>,
}

/// A device point as the transports make it (`super::StreamPoint`, named here without
/// importing the module that imports this one).
type Point = Arc<kvferry_cuda::driver::Event>;

/// Device points added to a batch ([`BatchState::want_points`]) and the slices they cover.
struct PointTally<P> {
    points: smallvec::SmallVec<[P; 2]>,
    slices: u32,
}

impl<P> std::fmt::Debug for PointTally<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PointTally")
            .field("points", &self.points.len())
            .field("slices", &self.slices)
            .finish()
    }
}

impl<P> PointTally<P> {
    fn new() -> Self {
        PointTally {
            points: smallvec::SmallVec::new(),
            slices: 0,
        }
    }

    /// `point` covers `slices` more slices.
    fn add(&mut self, point: P, slices: u32) {
        self.points.push(point);
        self.slices = self.slices.saturating_add(slices);
    }

    /// The points, when they cover all `total` slices of the batch.
    fn covering(self, total: u32) -> Option<Vec<P>> {
        (self.slices == total).then(|| self.points.into_vec())
    }
}

/// Shared state of one batch: slice counts, the first error, and wake-ups for sync (`Condvar`)
/// and async (`tokio::sync::Notify`, usable without a runtime on the notifying side) waiters.
#[derive(Debug)]
pub(crate) struct BatchState {
    total: u32,
    counts: Mutex<Counts>,
    cond: Condvar,
    notify: tokio::sync::Notify,
    /// Set when nobody waits any more (timed out or freed): transports skip slices not yet sent.
    cancelled: std::sync::atomic::AtomicBool,
    /// Set by a transport whose slices end within microseconds (device copies): a waiter then
    /// polls `finished` for up to `SOON_SPIN` before it sleeps, since a sleeping waiter's
    /// wake-up costs more than such a copy.
    soon: std::sync::atomic::AtomicBool,
    /// Set once every slice is reported (read without the counts' lock by a polling waiter).
    finished: std::sync::atomic::AtomicBool,
    /// The device points of the batch's copies, kept only where the submitter asks for them
    /// (`want_points`, before the post): `None` otherwise.
    points: Mutex<Option<PointTally<Point>>>,
    /// Condvar notifications made (tests: none without a sleeper).
    #[cfg(test)]
    notified: std::sync::atomic::AtomicU32,
}

impl BatchState {
    pub(crate) fn new(total: u32) -> Arc<Self> {
        Arc::new(BatchState {
            total,
            counts: Mutex::new(Counts {
                succeeded: 0,
                failed: 0,
                first_error: None,
                reported: smallvec::smallvec![false; total as usize],
                timed_out: false,
                sleepers: 0,
                pins: None,
            }),
            cond: Condvar::new(),
            notify: tokio::sync::Notify::new(),
            cancelled: std::sync::atomic::AtomicBool::new(false),
            soon: std::sync::atomic::AtomicBool::new(false),
            finished: std::sync::atomic::AtomicBool::new(total == 0),
            points: Mutex::new(None),
            #[cfg(test)]
            notified: Default::default(),
        })
    }

    /// Holds `pins` until every slice is reported (at once when none is left).
    pub(crate) fn hold(&self, pins: crate::inflight::Pins) {
        let mut c = self.lock();
        if c.succeeded + c.failed < self.total {
            c.pins = Some(pins);
        }
    }

    /// After the last slice's report (`c` final): marks the batch finished, wakes its waiters
    /// and returns the pins, to be dropped once the counts' lock is released.
    fn finished(&self, c: &mut Counts) -> Option<crate::inflight::Pins> {
        self.finished
            .store(true, std::sync::atomic::Ordering::Release);
        if c.sleepers > 0 {
            #[cfg(test)]
            self.notified
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.cond.notify_all();
        }
        self.notify.notify_waiters();
        c.pins.take()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.locked()
    }

    /// Keeps the device points transports add for this batch (`CompletionSink::add_point`),
    /// for [`BatchState::take_points`]. Called before the batch is posted.
    pub(crate) fn want_points(&self) {
        *self.points.locked() = Some(PointTally::new());
    }

    /// The device points of the batch's copies when every slice has one (each was enqueued as
    /// device work with an event recorded after it), else `None` (some slice went another way
    /// or failed before its copies were enqueued, or nobody asked).
    pub(crate) fn take_points(&self) -> Option<Vec<Point>> {
        self.points.locked().take()?.covering(self.total)
    }

    /// Marks the batch as one whose slices end within microseconds (see `soon`).
    pub(crate) fn expect_soon(&self) {
        self.soon.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Asks transports to skip the batch's slices they have not sent yet.
    pub(crate) fn cancel(&self) {
        self.cancelled
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the batch was cancelled (timed out or freed).
    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Current status (a timed-out batch stays `Timeout`).
    pub(crate) fn status(&self) -> BatchStatus {
        let c = self.lock();
        Self::status_of(self.total, &c)
    }

    fn status_of(total: u32, c: &Counts) -> BatchStatus {
        if c.timed_out {
            return BatchStatus::Timeout;
        }
        let done = c.succeeded + c.failed;
        if done >= total {
            match &c.first_error {
                None => BatchStatus::Completed,
                Some(first) => BatchStatus::Failed(Shared::new(TransferError::Failed {
                    first: Box::new(first.clone()),
                    failed: c.failed,
                    total,
                })),
            }
        } else if done == 0 {
            BatchStatus::Waiting
        } else {
            BatchStatus::Pending
        }
    }

    /// The wait's result for a final `status` (a failed batch's error keeps its first slice
    /// failure as its source).
    fn finish(status: BatchStatus, timeout: Duration) -> Result<(), TransferError> {
        match status {
            BatchStatus::Completed => Ok(()),
            BatchStatus::Timeout => Err(TransferError::Timeout(timeout)),
            BatchStatus::Failed(e) => Err(TransferError::clone(&e.0)),
            // Invalid is never a batch's state, and finish is called for final states only
            _ => Err(TransferError::Protocol(ProtocolError::UnexpectedBatchState)),
        }
    }

    /// Blocks the calling thread until every slice is reported or `timeout` passes (then the
    /// batch becomes `Timeout`). Uses only std primitives: fine on any thread (it does block a
    /// runtime worker if called from async code; use `wait_async` there).
    pub(crate) fn wait(&self, timeout: Duration) -> Result<(), TransferError> {
        // A batch already finished (the common case with batches kept in flight) costs no
        // clock read.
        let finished = || self.finished.load(std::sync::atomic::Ordering::Acquire);
        let mut start = (!finished()).then(Instant::now);
        if let Some(start) = start.filter(|_| self.soon.load(std::sync::atomic::Ordering::Relaxed))
        {
            // Poll (yielding the core) while the copies are likely still short of done.
            let until = start + SOON_SPIN.min(timeout);
            while !finished() && Instant::now() < until {
                std::thread::yield_now();
            }
        }
        let mut c = self.lock();
        loop {
            let s = Self::status_of(self.total, &c);
            if s.is_final() {
                return Self::finish(s, timeout);
            }
            let deadline = start.get_or_insert_with(Instant::now).checked_add(timeout);
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                c.timed_out = true;
                self.cancel();
                return Err(TransferError::Timeout(timeout));
            }
            c.sleepers += 1;
            c = crate::sync::wait_timeout(&self.cond, c, left).0;
            c.sleepers -= 1;
        }
    }

    /// Async twin of `wait`; needs a tokio runtime with timers (the caller's).
    pub(crate) async fn wait_async(&self, timeout: Duration) -> Result<(), TransferError> {
        if self.soon.load(std::sync::atomic::Ordering::Relaxed) {
            // As `wait`, polling by yielding to the runtime (its other tasks run meanwhile).
            let until = Instant::now() + SOON_SPIN.min(timeout);
            while !self.finished.load(std::sync::atomic::Ordering::Acquire)
                && Instant::now() < until
            {
                tokio::task::yield_now().await;
            }
        }
        let fut = async {
            loop {
                let notified = self.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let s = self.status();
                if s.is_final() {
                    return s;
                }
                notified.await;
            }
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(s) => Self::finish(s, timeout),
            Err(_) => {
                let mut c = self.lock();
                let s = Self::status_of(self.total, &c);
                if s.is_final() {
                    return Self::finish(s, timeout);
                }
                c.timed_out = true;
                self.cancel();
                Err(TransferError::Timeout(timeout))
            }
        }
    }

    /// Reports every slice of `ids` succeeded under one lock (a transport that completes many
    /// slices by one event).
    fn report_ok(&self, ids: &[u32]) {
        let mut c = self.lock();
        for &id in ids {
            match c
                .reported
                .get_mut(id as usize)
                .map(|seen| std::mem::replace(seen, true))
            {
                Some(false) => c.succeeded += 1,
                Some(true) => tracing::warn!(slice = id, "second completion for a slice ignored"),
                None => tracing::warn!(
                    slice = id,
                    total = self.total,
                    "completion for an unknown slice id ignored"
                ),
            }
        }
        let pins = if c.succeeded + c.failed == self.total {
            self.finished(&mut c)
        } else {
            None
        };
        drop(c);
        // The regions are free (after the lock: unpinning takes the registry's).
        drop(pins);
    }

    fn report(&self, id: u32, result: Result<(), TransferError>) {
        let mut c = self.lock();
        let Some(seen) = c.reported.get_mut(id as usize) else {
            tracing::warn!(
                slice = id,
                total = self.total,
                "completion for an unknown slice id ignored"
            );
            return;
        };
        if std::mem::replace(seen, true) {
            tracing::warn!(slice = id, "second completion for a slice ignored");
            return;
        }
        match result {
            Ok(()) => c.succeeded += 1,
            Err(e) => {
                c.failed += 1;
                if c.first_error.is_none() {
                    c.first_error = Some(e);
                }
            }
        }
        let pins = if c.succeeded + c.failed == self.total {
            self.finished(&mut c)
        } else {
            None
        };
        drop(c);
        // The regions are free (after the lock: unpinning takes the registry's).
        drop(pins);
    }
}

/// Where a transport reports finished slices (one sink per `post` call; cheap to clone, usable
/// from any thread). The first report for a slice id counts; later ones and unknown ids are
/// ignored with a warning.
#[derive(Clone)]
pub struct CompletionSink {
    state: Arc<BatchState>,
    /// Where `fail_peer` sends a slice for one retry on a fresh descriptor (the engine's);
    /// `None` on a retry's own sink, so a slice is retried at most once.
    refresh: Option<Arc<dyn PeerRefresh>>,
}

impl std::fmt::Debug for CompletionSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionSink")
            .field("state", &self.state)
            .field("refresh", &self.refresh.is_some())
            .finish()
    }
}

/// The engine's side of `CompletionSink::fail_peer`: fetches the peer's descriptor again
/// (once per batch) and posts the slice again on `retry_sink` (which has no hook), or reports
/// it failed.
pub(crate) trait PeerRefresh: Send + Sync {
    fn retry(self: Arc<Self>, id: u32, err: TransferError, retry_sink: CompletionSink);
}

impl CompletionSink {
    /// A sink without the engine's retry hook (tests, transports' own tests).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn new(state: Arc<BatchState>) -> Self {
        CompletionSink {
            state,
            refresh: None,
        }
    }

    /// A sink whose `fail_peer` hands slices to `refresh` for one retry.
    pub(crate) fn with_refresh(state: Arc<BatchState>, refresh: Arc<dyn PeerRefresh>) -> Self {
        CompletionSink {
            state,
            refresh: Some(refresh),
        }
    }

    /// Reports slice `id` failed because the peer could not be reached as its descriptor says:
    /// the data connection was refused or broke, the peer answered for another instance id
    /// (it restarted), or the RDMA connection failed (QP error). The engine then fetches the
    /// peer's descriptor again (once per batch) and retries the slice once on it; a slice that
    /// fails again, or a sink without the engine's hook, reports `err` as `complete` does.
    pub fn fail_peer(&self, id: u32, err: TransferError) {
        match &self.refresh {
            Some(r) if !self.is_cancelled() => r.clone().retry(
                id,
                err,
                CompletionSink {
                    state: self.state.clone(),
                    refresh: None,
                },
            ),
            _ => self.complete(id, Err(err)),
        }
    }

    /// Reports slice `id` finished: `Ok(())` when its bytes are in place, else the error.
    pub fn complete(&self, id: u32, result: Result<(), TransferError>) {
        self.state.report(id, result);
    }

    /// True when both sinks report to the same batch (one `post`). Used by RDMA's merging.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn same_batch(&self, other: &CompletionSink) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }

    /// True once the batch timed out or was freed: nobody waits for it any more. A transport
    /// should then fail slices it has not started (`cancelled_error()`) instead of sending them,
    /// so a late transfer cannot land in memory the caller has already reused. Slices already
    /// on the wire may still land.
    pub fn is_cancelled(&self) -> bool {
        self.state.is_cancelled()
    }

    /// Says that this batch's slices end within microseconds (device copies): its waiter polls
    /// for a short while before it sleeps, instead of paying a thread wake-up per batch.
    pub fn expect_soon(&self) {
        self.state.expect_soon();
    }

    /// Says that `slices` of this batch's slices are in place once the device reaches
    /// `point` (an event recorded on the transport's stream after their copies), so that the
    /// submitter may order its own device work after them without a host wait
    /// (`TransferEngine::submit_strided_with_points`). Kept only where the submitter asked;
    /// the slices are still reported with `complete` as ever.
    pub fn add_point(&self, point: &Point, slices: u32) {
        if let Some(t) = self.state.points.locked().as_mut() {
            t.add(point.clone(), slices);
        }
    }

    /// The error for a slice skipped because its batch was cancelled.
    pub fn cancelled_error() -> TransferError {
        TransferError::Cancelled
    }

    /// Reports every slice of `ids` succeeded, as `complete(id, Ok(()))` each, under one lock.
    pub fn succeed_all(&self, ids: &[u32]) {
        self.state.report_ok(ids);
    }

    /// Reports every id in `ids` failed with (a copy of) `err`.
    pub fn fail_all(&self, ids: impl IntoIterator<Item = u32>, err: &TransferError) {
        for id in ids {
            self.state.report(id, Err(err.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_dedupes_and_reports_first_error() {
        let st = BatchState::new(3);
        let sink = CompletionSink::new(st.clone());
        assert_eq!(st.status(), BatchStatus::Waiting);
        sink.complete(0, Ok(()));
        sink.complete(0, Err(TransferError::Cancelled)); // ignored
        sink.complete(9, Ok(())); // unknown id: ignored
        assert_eq!(st.status(), BatchStatus::Pending);
        sink.complete(2, Err(TransferError::UnknownBatch(4242)));
        assert_eq!(st.status(), BatchStatus::Pending);
        sink.complete(1, Ok(()));
        match st.status() {
            BatchStatus::Failed(e) => {
                assert!(
                    matches!(*e.0, TransferError::Failed { ref first, failed: 1, total: 3 }
                        if matches!(**first, TransferError::UnknownBatch(4242))),
                    "{e}"
                )
            }
            s => panic!("{s:?}"),
        }
        assert!(matches!(
            st.wait(Duration::from_millis(1)),
            Err(TransferError::Failed { .. })
        ));
    }

    /// Points are given only when they cover every slice of the batch: a slice that went
    /// another way (no point) leaves the submitter to wait on the host.
    #[test]
    fn points_are_given_only_when_they_cover_every_slice() {
        let mut t = PointTally::new();
        t.add('a', 2);
        assert_eq!(t.covering(3), None);
        let mut t = PointTally::new();
        t.add('a', 2);
        t.add('b', 1);
        assert_eq!(t.covering(3), Some(vec!['a', 'b']));
        assert_eq!(PointTally::<char>::new().covering(0), Some(vec![]));
        // Nobody asked: nothing is kept, nothing given.
        let st = BatchState::new(0);
        assert!(st.take_points().is_none());
        st.want_points();
        assert_eq!(st.take_points().map(|p| p.len()), Some(0));
        assert!(st.take_points().is_none(), "taken once");
    }

    #[test]
    fn succeed_all_counts_each_slice_once() {
        let st = BatchState::new(4);
        let sink = CompletionSink::new(st.clone());
        sink.succeed_all(&[0, 1]);
        sink.succeed_all(&[1, 9]); // a repeat and an unknown id are ignored
        sink.complete(2, Err(TransferError::Cancelled));
        assert_eq!(st.status(), BatchStatus::Pending, "slice 3 is still out");
        sink.succeed_all(&[3, 2]);
        assert!(matches!(st.status(), BatchStatus::Failed(_)));
        assert!(st.wait(Duration::from_secs(1)).is_err());
    }

    #[test]
    fn a_batch_expected_soon_is_polled_for_then_still_times_out() {
        let st = BatchState::new(2);
        let sink = CompletionSink::new(st.clone());
        sink.expect_soon();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            sink.succeed_all(&[0, 1]);
        });
        st.wait(Duration::from_secs(10)).unwrap();
        t.join().unwrap();
        // The poll never outlasts the caller's timeout.
        let st = BatchState::new(1);
        CompletionSink::new(st.clone()).expect_soon();
        assert!(matches!(
            st.wait(Duration::from_millis(1)),
            Err(TransferError::Timeout(_))
        ));
        assert_eq!(st.status(), BatchStatus::Timeout);
    }

    #[test]
    fn a_report_notifies_the_condvar_only_for_a_sleeping_waiter() {
        use std::sync::atomic::Ordering::Relaxed;
        let st = BatchState::new(1);
        CompletionSink::new(st.clone()).complete(0, Ok(()));
        st.wait(Duration::from_secs(1)).unwrap();
        assert_eq!(
            st.notified.load(Relaxed),
            0,
            "nobody slept: no notification"
        );
        let st = BatchState::new(2);
        let (sink, st2) = (CompletionSink::new(st.clone()), st.clone());
        let t = std::thread::spawn(move || {
            while st2.lock().sleepers == 0 {
                std::thread::yield_now();
            }
            sink.succeed_all(&[0, 1]);
        });
        st.wait(Duration::from_secs(60)).unwrap();
        t.join().unwrap();
        assert_eq!(st.notified.load(Relaxed), 1, "the sleeper was woken");
        assert_eq!(st.lock().sleepers, 0);
    }

    #[test]
    fn wait_times_out_and_stays_timeout() {
        let st = BatchState::new(1);
        let e = st.wait(Duration::from_millis(20)).unwrap_err();
        assert!(matches!(e, TransferError::Timeout(_)));
        CompletionSink::new(st.clone()).complete(0, Ok(()));
        assert_eq!(st.status(), BatchStatus::Timeout);
    }

    #[test]
    fn wait_wakes_on_completion_from_another_thread() {
        let st = BatchState::new(2);
        let sink = CompletionSink::new(st.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            sink.complete(1, Ok(()));
            sink.complete(0, Ok(()));
        });
        st.wait(Duration::from_secs(10)).unwrap();
        t.join().unwrap();
    }

    #[tokio::test]
    async fn wait_async_wakes_and_times_out() {
        let st = BatchState::new(1);
        let sink = CompletionSink::new(st.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            sink.complete(0, Ok(()));
        });
        st.wait_async(Duration::from_secs(10)).await.unwrap();
        t.join().unwrap();
        let st2 = BatchState::new(1);
        assert!(matches!(
            st2.wait_async(Duration::from_millis(10)).await,
            Err(TransferError::Timeout(_))
        ));
        assert_eq!(st2.status(), BatchStatus::Timeout);
    }
}
