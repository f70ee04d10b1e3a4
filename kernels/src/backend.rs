//! The checksum backend trait (docs/design.md §5, docs/interfaces.md) and the pending work it
//! gives back; its jobs and results are in [`crate::job`] (re-exported here).

use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use crate::job::{
    validate_job, CopyJob, GroupJob, GroupResult, JobFault, Keep, KernelError, LayerInput,
    Location, PartMismatch,
};

/// A checksum backend: CPU or CUDA.
pub trait ChecksumBackend: Send + Sync {
    /// `"cpu"` or `"cuda"`.
    fn name(&self) -> &'static str;

    /// Starts checksumming `jobs`; the result is taken from the returned [`PendingChecksums`].
    ///
    /// # Safety
    /// Every `LayerInput`'s `[addr, addr + len)` must be valid, readable memory of the job's
    /// `device` until the result has been taken (or the pending value dropped and its work ended),
    /// and nothing may write it meanwhile if the values are to mean anything.
    unsafe fn submit(&self, jobs: Vec<GroupJob>) -> Result<PendingChecksums, KernelError>;

    /// As [`ChecksumBackend::submit`], ordered after the work queued so far on `after` (a raw
    /// `CUstream` handle of the jobs' device; 0: the legacy default stream) where the backend
    /// reads device memory; never synchronising that stream. Default (host memory: no stream
    /// writes it): `submit`.
    ///
    /// # Safety
    /// As `submit`; `after` is 0 or a live stream of the jobs' device.
    unsafe fn submit_after(
        &self,
        jobs: Vec<GroupJob>,
        _after: u64,
    ) -> Result<PendingChecksums, KernelError> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.submit(jobs) }
    }

    /// As [`ChecksumBackend::submit`], ordered on the device after each of `events` (events
    /// recorded on streams of the jobs' device after the work that writes the layers, e.g. a
    /// transport's copies into them) where the backend reads device memory: no host waits for
    /// them. Default: `submit` when `events` is empty, else [`KernelError::Unordered`] (a
    /// backend that cannot wait on the device must not read before the events' work ends).
    ///
    /// # Safety
    /// As `submit`; every event is of the jobs' device's primary context and was recorded.
    unsafe fn submit_after_events(
        &self,
        jobs: Vec<GroupJob>,
        events: &[&kvferry_cuda::driver::Event],
    ) -> Result<PendingChecksums, KernelError> {
        if !events.is_empty() {
            return Err(KernelError::Unordered);
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { self.submit(jobs) }
    }

    /// Starts jobs that copy each chunk they checksum from a source into their layers, then
    /// sum the stored values ([`CopyJob`]): one pass over the bytes where a copy then a
    /// checksum would read them twice. `keep` is held until the device is done with the
    /// launch, even past a dropped result. Unordered (the sources must be final and the layers
    /// free when it is called). Errors: as `submit`, a source that does not pair up with its
    /// layer, and [`KernelError::NoCopy`] from a backend that only reads (the default).
    ///
    /// # Safety
    /// As `submit` for the layers and the sources (readable device memory of the jobs' device
    /// over each source geometry's span until the device is done with the launch); nothing
    /// else may touch the layers' covered bytes until the result is taken, nor write the
    /// sources' if the values are to mean anything.
    unsafe fn submit_copying(
        &self,
        jobs: Vec<CopyJob>,
        keep: Keep,
    ) -> Result<PendingChecksums, KernelError> {
        drop((jobs, keep));
        Err(KernelError::NoCopy)
    }

    /// As [`ChecksumBackend::submit_copying`], for launches planned ahead
    /// ([`crate::CopyPlans`]: made only by the same checks), so that none is checked or
    /// planned again here. Errors: plans for another device, a driver failure, and
    /// [`KernelError::NoCopy`] from a backend that only reads (the default).
    ///
    /// # Safety
    /// As `submit_copying`, for the layers and sources the plans were made from.
    unsafe fn submit_planned(
        &self,
        plans: crate::CopyPlans,
        keep: Keep,
    ) -> Result<PendingChecksums, KernelError> {
        drop((plans, keep));
        Err(KernelError::NoCopy)
    }
}

/// A backend's in-flight work. Implemented by each backend; wrapped in [`PendingChecksums`].
pub trait Pending: Send {
    /// The result if ready (taken once); `None` while still running.
    fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>>;
    /// Blocks until the result is ready or `timeout` passes ([`KernelError::Timeout`]).
    fn wait(&mut self, timeout: Duration) -> Result<Vec<GroupResult>, KernelError>;
}

/// Checksums being computed: poll or wait (with a deadline) for the results, one per job in
/// submission order.
pub struct PendingChecksums {
    inner: Box<dyn Pending>,
}

impl std::fmt::Debug for PendingChecksums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingChecksums")
    }
}

impl PendingChecksums {
    /// Wraps a backend's pending work.
    pub fn new(inner: Box<dyn Pending>) -> PendingChecksums {
        PendingChecksums { inner }
    }

    /// Already computed results.
    pub fn ready(result: Result<Vec<GroupResult>, KernelError>) -> PendingChecksums {
        PendingChecksums::new(Box::new(Ready(Some(result))))
    }

    /// Results computed by another thread that sends them on `rx`.
    pub fn from_channel(
        rx: mpsc::Receiver<Result<Vec<GroupResult>, KernelError>>,
    ) -> PendingChecksums {
        PendingChecksums::new(Box::new(Channel::new(rx)))
    }

    /// The results if ready (once); `None` while running.
    pub fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>> {
        self.inner.poll()
    }

    /// Waits at most `timeout` for the results.
    pub fn wait(mut self, timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        self.inner.wait(timeout)
    }
}

struct Ready(Option<Result<Vec<GroupResult>, KernelError>>);

impl Pending for Ready {
    fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>> {
        self.0.take()
    }
    fn wait(&mut self, _timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        self.0.take().unwrap_or(Err(KernelError::Lost))
    }
}

/// Results that arrive once on a channel: the `Pending` of work running on a host thread.
pub(crate) struct Channel {
    rx: mpsc::Receiver<Result<Vec<GroupResult>, KernelError>>,
    taken: bool,
}

impl Channel {
    /// Pending results that `rx` delivers once.
    pub(crate) fn new(rx: mpsc::Receiver<Result<Vec<GroupResult>, KernelError>>) -> Channel {
        Channel { rx, taken: false }
    }
}

impl Pending for Channel {
    fn poll(&mut self) -> Option<Result<Vec<GroupResult>, KernelError>> {
        if self.taken {
            return None;
        }
        match self.rx.try_recv() {
            Ok(r) => {
                self.taken = true;
                Some(r)
            }
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => {
                self.taken = true;
                Some(Err(KernelError::Lost))
            }
        }
    }
    fn wait(&mut self, timeout: Duration) -> Result<Vec<GroupResult>, KernelError> {
        if self.taken {
            return Err(KernelError::Lost);
        }
        let deadline = Instant::now() + timeout;
        match self
            .rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(r) => {
                self.taken = true;
                r
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(KernelError::Timeout(timeout)),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(KernelError::Lost),
        }
    }
}
