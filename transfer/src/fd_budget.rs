//! The process's file-descriptor budget for peers (docs/design.md §3 "Segments"): how many
//! peers an engine may hold connections to at once, derived from `RLIMIT_NOFILE`, so that
//! however many consumers come and go, the peers cached here never exhaust the process's fds.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Most peers one engine caches, whatever the fd limit.
pub const MAX_CACHED_PEERS: usize = 4096;

/// Share of the process's fd limit that peers' connections of all engines may hold together
/// (the rest is for listeners, accepted connections, files, the control channel).
const PEER_SHARE_DIVISOR: u64 = 2;

/// Engines alive in this process (a producer process runs one engine per rank): the peer
/// share of the fd limit is split between them.
static LIVE_ENGINES: AtomicUsize = AtomicUsize::new(0);

/// Counts one live engine while held.
pub(crate) struct EngineSlot(());

impl EngineSlot {
    pub(crate) fn new() -> Self {
        LIVE_ENGINES.fetch_add(1, Ordering::Relaxed);
        EngineSlot(())
    }
}

impl Drop for EngineSlot {
    fn drop(&mut self) {
        LIVE_ENGINES.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The process's soft `RLIMIT_NOFILE` (open files), or 1024 where it cannot be read;
/// `RLIM_INFINITY` reads as `u64::MAX`.
pub fn nofile_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given and nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1024;
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        r.rlim_cur
    }
}

/// Peers one engine may cache when each costs `fds_per_peer` fds: half the fd limit, shared
/// by the live engines, in 1..=[`MAX_CACHED_PEERS`].
pub fn peer_budget(fds_per_peer: usize) -> usize {
    budget_for(
        nofile_limit(),
        LIVE_ENGINES.load(Ordering::Relaxed),
        fds_per_peer,
    )
}

fn budget_for(limit: u64, engines: usize, fds_per_peer: usize) -> usize {
    let share = limit / PEER_SHARE_DIVISOR / engines.max(1) as u64;
    let peers = share / fds_per_peer.max(1) as u64;
    peers.clamp(1, MAX_CACHED_PEERS as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_splits_half_the_limit_between_engines() {
        assert_eq!(budget_for(256, 1, 12), 10);
        assert_eq!(budget_for(256, 2, 12), 5);
        assert_eq!(budget_for(1024, 0, 12), 42);
        assert_eq!(budget_for(16, 8, 12), 1);
        assert_eq!(budget_for(u64::MAX, 1, 1), MAX_CACHED_PEERS);
    }
}
