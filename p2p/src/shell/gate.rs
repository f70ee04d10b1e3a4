//! The producer's control port admission (docs/design.md §8.1 "Bounds"): at most
//! `max_connections` control connections at once and `per_source` from one source IP, decided
//! at accept before the ZMTP greeting (the patched `zeromq` crate's `AcceptGate`), as the
//! transfer engine's handshake and data listeners do; and warnings a peer can trigger, logged
//! at most once per interval with the count of those left out.

use kvferry_transfer::sync::MutexExt;
use std::any::Any;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Logs at most one line per `interval`; the next line carries the count of those skipped.
pub(crate) struct LogLimit {
    interval: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    pub(crate) fn new(interval: Duration) -> Self {
        LogLimit {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(skipped since the last line)` when a line may be logged now, else `None` (the
    /// line is counted as skipped).
    pub(crate) fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.locked();
        match s.0 {
            Some(last) if now.duration_since(last) < self.interval => {
                s.1 += 1;
                None
            }
            _ => {
                s.0 = Some(now);
                Some(std::mem::take(&mut s.1))
            }
        }
    }
}

/// Logs `$($arg)+` as a warning through `$limit` ([`LogLimit`]), naming how many were skipped.
macro_rules! warn_limited {
    ($limit:expr, $($arg:tt)+) => {
        if let Some(skipped) = $limit.allow() {
            if skipped > 0 {
                tracing::warn!(skipped, $($arg)+);
            } else {
                tracing::warn!($($arg)+);
            }
        }
    };
}
pub(crate) use warn_limited;

/// One [`LogLimit`] per kind of peer-triggered warning of the producer.
pub(crate) struct PeerWarnings {
    pub(crate) accept: LogLimit,
    pub(crate) bad_request: LogLimit,
    pub(crate) not_sent: LogLimit,
    pub(crate) load_failed: LogLimit,
}

impl PeerWarnings {
    pub(crate) fn new() -> Self {
        let l = || LogLimit::new(Duration::from_secs(1));
        PeerWarnings {
            accept: l(),
            bad_request: l(),
            not_sent: l(),
            load_failed: l(),
        }
    }
}

struct Counts {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

/// Connection limits of one control port.
pub(crate) struct ControlGate {
    counts: Mutex<Counts>,
    max_connections: usize,
    per_source: usize,
    refused: LogLimit,
}

/// One admitted control connection; dropping it (the connection closed) frees its place.
struct Ticket {
    gate: Arc<ControlGate>,
    ip: IpAddr,
}

impl ControlGate {
    /// A gate admitting `max_connections` connections at once, `per_source` from one IP
    /// (each at least 1).
    pub(crate) fn new(max_connections: usize, per_source: usize) -> Arc<ControlGate> {
        Arc::new(ControlGate {
            counts: Mutex::new(Counts {
                total: 0,
                by_source: HashMap::new(),
            }),
            max_connections: max_connections.max(1),
            per_source: per_source.max(1),
            refused: LogLimit::new(Duration::from_secs(10)),
        })
    }

    /// Connections admitted now.
    #[cfg(test)]
    fn admitted(&self) -> usize {
        self.counts.locked().total
    }

    fn admit_ip(self: &Arc<Self>, ip: IpAddr) -> Option<Ticket> {
        let mut c = self.counts.locked();
        let from_ip = c.by_source.get(&ip).copied().unwrap_or(0);
        if c.total >= self.max_connections || from_ip >= self.per_source {
            let (total, max, per) = (c.total, self.max_connections, self.per_source);
            drop(c);
            warn_limited!(
                self.refused,
                %ip,
                "control connection refused: {from_ip} of {per} from this source, {total} of {max} in all"
            );
            return None;
        }
        c.total += 1;
        *c.by_source.entry(ip).or_insert(0) += 1;
        Some(Ticket {
            gate: self.clone(),
            ip,
        })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self.gate.counts.locked();
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.by_source.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.by_source.remove(&self.ip);
            }
        }
    }
}

/// The gate as the `zeromq` crate asks it.
pub(crate) struct Gate(pub(crate) Arc<ControlGate>);

impl zeromq::AcceptGate for Gate {
    fn admit(&self, peer: SocketAddr) -> Option<Box<dyn Any + Send + Sync>> {
        self.0
            .admit_ip(peer.ip())
            .map(|t| Box::new(t) as Box<dyn Any + Send + Sync>)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_source_and_total_limits_free_their_place_on_drop() {
        let g = ControlGate::new(3, 2);
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let t1 = g.admit_ip(a).unwrap();
        let _t2 = g.admit_ip(a).unwrap();
        assert!(g.admit_ip(a).is_none(), "per source");
        let _t3 = g.admit_ip(b).unwrap();
        assert!(g.admit_ip(b).is_none(), "in all");
        assert_eq!(g.admitted(), 3);
        drop(t1);
        assert!(g.admit_ip(b).is_some());
        assert_eq!(g.admitted(), 2, "the new ticket was dropped at once");
    }

    #[test]
    fn a_limited_log_says_how_many_it_left_out() {
        let l = LogLimit::new(Duration::from_secs(10));
        let t = Instant::now();
        assert_eq!(l.allow_at(t), Some(0));
        assert_eq!(l.allow_at(t + Duration::from_secs(1)), None);
        assert_eq!(l.allow_at(t + Duration::from_secs(2)), None);
        assert_eq!(l.allow_at(t + Duration::from_secs(11)), Some(2));
    }
}
