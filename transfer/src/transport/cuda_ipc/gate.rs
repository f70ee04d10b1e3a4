//! One import at a time per peer, with a deadline for the wait.
//!
//! Posts in flight together that find the same peer's allocations unmapped wait for the first
//! one's import instead of each asking the peer and mapping them again (a second mapping of an
//! allocation would replace the first). The gate is per peer, so a peer that stalls its import
//! handshake holds up only posts to itself; and a wait behind another import ends at its
//! deadline, so posts queued behind a stalled peer do not add one handshake deadline each.

use std::collections::HashSet;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::sync::{wait_timeout, MutexExt};

/// Peers (segment names) whose allocations a post is importing right now: at most one entry
/// per peer, removed when that import ends.
#[derive(Default)]
pub(super) struct ImportGates {
    busy: Mutex<HashSet<String>>,
    freed: Condvar,
}

/// The right to import one peer's allocations; dropping it lets the next post for that peer in.
pub(super) struct ImportTurn<'a> {
    gates: &'a ImportGates,
    peer: String,
}

impl ImportGates {
    /// Waits up to `deadline` until no other post imports `peer`'s allocations, then takes the
    /// turn. `None` when the deadline passed with another import of `peer` still in progress.
    pub(super) fn turn(&self, peer: &str, deadline: Duration) -> Option<ImportTurn<'_>> {
        let end = Instant::now() + deadline;
        let mut busy = self.busy.locked();
        while busy.contains(peer) {
            let left = end.checked_duration_since(Instant::now())?;
            busy = wait_timeout(&self.freed, busy, left).0;
        }
        busy.insert(peer.to_string());
        Some(ImportTurn {
            gates: self,
            peer: peer.to_string(),
        })
    }

    /// How many imports are in progress (tests).
    #[cfg(test)]
    fn in_progress(&self) -> usize {
        self.busy.locked().len()
    }
}

impl Drop for ImportTurn<'_> {
    fn drop(&mut self) {
        self.gates.busy.locked().remove(&self.peer);
        self.gates.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_peer_being_imported_does_not_hold_up_another_peer() {
        let gates = ImportGates::default();
        let _a = gates.turn("a", Duration::from_secs(5)).expect("a is free");
        let t0 = Instant::now();
        let b = gates.turn("b", Duration::from_secs(5));
        assert!(b.is_some());
        assert!(t0.elapsed() < Duration::from_secs(1));
        assert_eq!(gates.in_progress(), 2);
    }

    #[test]
    fn a_wait_behind_a_stalled_import_ends_at_its_deadline() {
        let gates = ImportGates::default();
        let _stalled = gates.turn("a", Duration::from_secs(5)).expect("a is free");
        let t0 = Instant::now();
        assert!(gates.turn("a", Duration::from_millis(50)).is_none());
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert_eq!(gates.in_progress(), 1);
    }

    #[test]
    fn the_next_post_gets_the_turn_when_the_import_ends_and_entries_go() {
        let gates = Arc::new(ImportGates::default());
        let first = gates.turn("a", Duration::from_secs(5)).expect("a is free");
        let g = gates.clone();
        let waiter = std::thread::spawn(move || g.turn("a", Duration::from_secs(5)).is_some());
        std::thread::sleep(Duration::from_millis(20));
        drop(first);
        assert!(waiter.join().expect("waiter"));
        assert_eq!(gates.in_progress(), 0);
    }
}
