//! What the CLI's tests share: a child process owned by a guard that kills and reaps it.
#![allow(dead_code)]

use std::ops::{Deref, DerefMut};
use std::process::Child;

/// A child process killed and reaped when dropped, so a failing assertion does not leave a
/// `serve` (or a lingering `load`) running after the test. Derefs to the [`Child`].
pub struct KillOnDrop(pub Child);

impl Deref for KillOnDrop {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // Already reaped (the test waited for it): std knows, and signals no reused pid.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
