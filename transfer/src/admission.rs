//! Per-source connection limits of the handshake and data listeners (issue 10, "connection
//! limits"): one source IP may hold at most `max_per_source` served connections at once, so
//! idle connections from one host cannot lock out the others (the listeners' total limit,
//! `TcpConfig::max_server_connections`, stays as it was).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Served connections per source IP of one listener.
pub(crate) struct Sources {
    counts: Mutex<HashMap<IpAddr, usize>>,
    max_per_source: usize,
}

/// One admitted connection; dropping it frees its place.
pub(crate) struct Ticket {
    sources: Arc<Sources>,
    ip: IpAddr,
}

impl Sources {
    pub(crate) fn new(max_per_source: usize) -> Arc<Sources> {
        Arc::new(Sources {
            counts: Mutex::new(HashMap::new()),
            max_per_source: max_per_source.max(1),
        })
    }

    /// A ticket for one more connection from `ip`, or `None` when `ip` holds its maximum.
    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<Ticket> {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = c.entry(ip).or_insert(0);
        if *n >= self.max_per_source {
            return None;
        }
        *n += 1;
        Some(Ticket {
            sources: self.clone(),
            ip,
        })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self
            .sources
            .counts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = c.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_source_has_its_own_limit_and_tickets_free_places() {
        let s = Sources::new(2);
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.1".parse().unwrap();
        let t1 = s.admit(a).unwrap();
        let _t2 = s.admit(a).unwrap();
        assert!(s.admit(a).is_none(), "third from one source refused");
        assert!(s.admit(b).is_some(), "another source still admitted");
        drop(t1);
        assert!(s.admit(a).is_some(), "a closed connection frees its place");
    }
}
