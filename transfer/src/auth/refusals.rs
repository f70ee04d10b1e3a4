//! Refused handshake authentications: their counts, and a log limit so that a peer
//! hammering the listener cannot flood the log.

use crate::sync::MutexExt;
use std::time::{Duration, Instant};

/// Counts of refused handshake authentications (`TransferEngine::auth_refusals`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuthRefusals {
    /// `Hello` and `Auth` frames refused since the engine started.
    pub refused: u64,
    /// How many of them produced a WARN line (at most [`REFUSAL_LOG_BURST`] per
    /// [`REFUSAL_LOG_WINDOW`]; each line after a quiet spell says how many were not logged).
    pub logged: u64,
}

/// Most refusal WARN lines per [`REFUSAL_LOG_WINDOW`]: a peer hammering the listener with bad
/// proofs cannot fill the log.
pub const REFUSAL_LOG_BURST: u32 = 5;
/// The window of [`REFUSAL_LOG_BURST`].
pub const REFUSAL_LOG_WINDOW: Duration = Duration::from_secs(10);

/// A fixed-window limit on log lines: at most `burst` lines per `window`; what is held back
/// is counted and reported with the next line that is let through. Time is an argument.
#[derive(Debug)]
pub struct LogLimit {
    burst: u32,
    window: Duration,
    state: std::sync::Mutex<LogWindow>,
}

#[derive(Debug, Default)]
struct LogWindow {
    start: Option<Instant>,
    lines: u32,
    held_back: u64,
}

impl LogLimit {
    /// At most `burst` lines per `window`.
    pub fn new(burst: u32, window: Duration) -> LogLimit {
        LogLimit {
            burst,
            window,
            state: Default::default(),
        }
    }

    /// Whether a line may be written at `now`: `Some(n)` with the number of lines held back
    /// since the last one written, `None` when this one is held back.
    pub fn allow(&self, now: Instant) -> Option<u64> {
        let mut w = self.state.locked();
        if w.start
            .is_none_or(|s| now.saturating_duration_since(s) >= self.window)
        {
            w.start = Some(now);
            w.lines = 0;
        }
        if w.lines >= self.burst {
            w.held_back += 1;
            return None;
        }
        w.lines += 1;
        Some(std::mem::take(&mut w.held_back))
    }
}

pub(super) struct RefusalLog {
    pub(super) refused: std::sync::atomic::AtomicU64,
    pub(super) logged: std::sync::atomic::AtomicU64,
    pub(super) limit: LogLimit,
}
