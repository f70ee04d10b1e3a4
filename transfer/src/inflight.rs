//! Slices in flight per registered local region (docs/design.md §3 "Memory"): a batch pins the
//! regions its slices read from or land in until its last slice is reported, and a region is
//! unregistered only once nothing pins it, so the engine never touches memory its owner was
//! told it may free.

use crate::ids::NumMap;
use crate::sync::MutexExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Pin counts by region start address.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    counts: Mutex<Counts>,
    idle: Condvar,
}

#[derive(Debug, Default)]
struct Counts {
    by_start: NumMap<usize>,
    /// Threads asleep on `idle` now: an unpin notifies only when one is (a notification is
    /// a system call whether or not anybody waits).
    sleepers: usize,
    /// Notifications made (tests: none without a sleeper).
    #[cfg(test)]
    notified: usize,
}

impl std::ops::Deref for Counts {
    type Target = NumMap<usize>;
    fn deref(&self) -> &NumMap<usize> {
        &self.by_start
    }
}

impl std::ops::DerefMut for Counts {
    fn deref_mut(&mut self) -> &mut NumMap<usize> {
        &mut self.by_start
    }
}

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, Counts> {
        self.counts.locked()
    }

    /// Pins the regions starting at `starts` (once each per call) until the returned `Pins`
    /// drops. The caller holds the registry's read lock, so none of them is being removed.
    pub(crate) fn pin(self: &Arc<Self>, starts: impl IntoIterator<Item = u64>) -> Pins {
        let mut starts: Starts = starts.into_iter().collect();
        starts.sort_unstable();
        starts.dedup();
        let mut c = self.lock();
        for s in &starts {
            *c.entry(*s).or_default() += 1;
        }
        Pins {
            inflight: self.clone(),
            starts,
        }
    }

    /// Batches pinning the region at `start` now.
    pub(crate) fn count(&self, start: u64) -> usize {
        self.lock().get(&start).copied().unwrap_or(0)
    }

    /// Waits until nothing pins the region at `start` or `deadline` passes; returns the pins
    /// left (0 when idle).
    pub(crate) fn wait_idle(&self, start: u64, deadline: Instant) -> usize {
        let mut c = self.lock();
        loop {
            let n = c.get(&start).copied().unwrap_or(0);
            let left = deadline.saturating_duration_since(Instant::now());
            if n == 0 || left.is_zero() {
                return n;
            }
            c.sleepers += 1;
            c = crate::sync::wait_timeout(&self.idle, c, left.min(Duration::from_millis(100))).0;
            c.sleepers -= 1;
        }
    }
}

/// The regions one batch pins; dropping it (when the batch's last slice is reported) unpins.
pub(crate) struct Pins {
    inflight: Arc<InFlight>,
    starts: Starts,
}

/// The regions of one batch (inline for the few a batch usually uses).
type Starts = smallvec::SmallVec<[u64; 2]>;

impl std::fmt::Debug for Pins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pins")
            .field("starts", &self.starts)
            .finish()
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let mut c = self.inflight.lock();
        let mut idle = false;
        for s in &self.starts {
            if let Some(n) = c.get_mut(s) {
                *n -= 1;
                if *n == 0 {
                    c.remove(s);
                    idle = true;
                }
            }
        }
        if idle && c.sleepers > 0 {
            #[cfg(test)]
            {
                c.notified += 1;
            }
            drop(c);
            self.inflight.idle.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_is_idle_once_every_batch_pinning_it_dropped() {
        let f = Arc::new(InFlight::default());
        let a = f.pin([0x1000, 0x1000, 0x2000]);
        let b = f.pin([0x1000]);
        assert_eq!(f.count(0x1000), 2);
        assert_eq!(f.count(0x2000), 1);
        drop(a);
        assert_eq!(f.wait_idle(0x1000, Instant::now()), 1);
        let f2 = f.clone();
        let t = std::thread::spawn(move || {
            f2.wait_idle(0x1000, Instant::now() + Duration::from_secs(10))
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(b);
        assert_eq!(t.join().unwrap(), 0);
        assert_eq!(f.count(0x2000), 0);
    }

    #[test]
    fn an_unpin_notifies_only_a_sleeping_waiter() {
        let f = Arc::new(InFlight::default());
        drop(f.pin([0x1000]));
        assert_eq!(f.lock().notified, 0, "nobody waits: no notification");
        let pins = f.pin([0x1000]);
        let f2 = f.clone();
        let t = std::thread::spawn(move || {
            f2.wait_idle(0x1000, Instant::now() + Duration::from_secs(10))
        });
        while f.lock().sleepers == 0 {
            std::thread::yield_now();
        }
        drop(pins);
        assert_eq!(t.join().unwrap(), 0);
        assert_eq!(f.lock().notified, 1, "the sleeper was woken");
    }
}
