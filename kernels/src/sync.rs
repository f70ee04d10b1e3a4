//! A lock that outlives a panic. A thread that panics while holding one of this crate's locks
//! leaves the data consistent (a slot pool's lists, the per-device backend table: each critical
//! section either finishes its update or has changed nothing before the code that can panic),
//! so the next holder takes the data as it is instead of spreading the panic to every later
//! caller. The transfer engine's `sync` module says the same for its locks; this crate sits
//! below it and keeps its own copy of the one helper it needs, public for its tests (and any
//! caller) to lock the same way.

use std::sync::{Mutex, MutexGuard};

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_panicked_holder_leaves_the_data_to_the_next() {
        let m = Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("holder panics");
        })
        .join();
        assert!(m.is_poisoned());
        *m.locked() += 1;
        assert_eq!(*m.locked(), 2);
    }
}
