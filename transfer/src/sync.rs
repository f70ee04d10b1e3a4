//! Locks that outlive a panic. A thread that panics while holding one of kvferry's locks leaves
//! the data consistent (each critical section either finishes its update or has changed nothing
//! before the code that can panic), so the next holder takes the data as it is instead of
//! spreading the panic to every later caller. These helpers are the one place that says so.

use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// [`Mutex::lock`] that ignores poisoning (see the module docs).
pub trait MutexExt<T: ?Sized> {
    /// The guard, whether or not a holder panicked.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> MutexExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// [`RwLock::read`] and [`RwLock::write`] that ignore poisoning (see the module docs).
pub trait RwLockExt<T: ?Sized> {
    /// A shared guard, whether or not a holder panicked.
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    /// An exclusive guard, whether or not a holder panicked.
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// [`Condvar::wait_timeout`] that ignores poisoning: the guard back, and whether `timeout`
/// passed without a notification.
pub fn wait_timeout<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> (MutexGuard<'a, T>, bool) {
    let (g, r) = cv
        .wait_timeout(guard, timeout)
        .unwrap_or_else(|p| p.into_inner());
    (g, r.timed_out())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_panicked_holder_leaves_the_data_to_the_next() {
        let m = Arc::new(Mutex::new(1));
        let rw = Arc::new(RwLock::new(2));
        let (m2, rw2) = (m.clone(), rw.clone());
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            let _w = rw2.write().unwrap();
            panic!("holder panics");
        })
        .join();
        assert!(m.is_poisoned() && rw.is_poisoned());
        *m.locked() += 1;
        *rw.write_locked() += 1;
        assert_eq!((*m.locked(), *rw.read_locked()), (2, 3));
        let cv = Condvar::new();
        let (g, timed_out) = wait_timeout(&cv, m.locked(), Duration::from_millis(1));
        assert!(timed_out && *g == 2);
    }
}
