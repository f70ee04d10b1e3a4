//! Which consumer segments the producer's engines hold connections to, and when they may go
//! (docs/design.md §4), without I/O: a consumer's data connections and cached descriptor are
//! dropped once its control session has ended and no load to it is being served, not after the
//! engine's idle timeout, so consumers that come and go leave no fds behind. The producer's
//! machine says when ([`super::producer::Effect::CloseSegments`]); the shell closes them.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

use super::msg::LoadRequest;

/// Segments recorded per session at most; a consumer naming more in one session leaves the
/// rest to the engines' peer budget (`kvferry_transfer::fd_budget`).
const MAX_SEGMENTS_PER_SESSION: usize = 64;

/// Consumer segments by control session (`P`: the peer, a ROUTER identity in the shell), and
/// loads being served to each segment.
pub(crate) struct PeerSegments<P> {
    by_peer: HashMap<P, HashSet<String>>,
    serving: HashMap<String, usize>,
}

impl<P> Default for PeerSegments<P> {
    fn default() -> Self {
        PeerSegments {
            by_peer: HashMap::new(),
            serving: HashMap::new(),
        }
    }
}

impl<P: Clone + Eq + Hash> PeerSegments<P> {
    /// A request of `peer`'s session was admitted: its ranks' segments belong to the session.
    pub(crate) fn add_request(&mut self, peer: &P, req: &LoadRequest) {
        let set = self.by_peer.entry(peer.clone()).or_default();
        for r in &req.ranks {
            if set.len() >= MAX_SEGMENTS_PER_SESSION {
                break;
            }
            if !set.contains(&r.segment) {
                set.insert(r.segment.clone());
            }
        }
    }

    /// A load of `req` starts being served; returns its segments (hand them to `serve_ended`).
    pub(crate) fn serve_started(&mut self, req: &LoadRequest) -> Vec<String> {
        let segs: HashSet<&String> = req.ranks.iter().map(|r| &r.segment).collect();
        let segs: Vec<String> = segs.into_iter().cloned().collect();
        for s in &segs {
            *self.serving.entry(s.clone()).or_default() += 1;
        }
        segs
    }

    /// A load to `segments` ended; returns those nothing holds any more (to close).
    pub(crate) fn serve_ended(&mut self, segments: Vec<String>) -> Vec<String> {
        for s in &segments {
            if let Some(n) = self.serving.get_mut(s) {
                *n -= 1;
                if *n == 0 {
                    self.serving.remove(s);
                }
            }
        }
        self.unheld(segments)
    }

    /// `peer`'s session ended (its connection closed, or it was evicted); returns the segments
    /// nothing holds any more (to close).
    pub(crate) fn session_ended(&mut self, peer: &P) -> Vec<String> {
        let segs = self.by_peer.remove(peer).unwrap_or_default();
        self.unheld(segs.into_iter().collect())
    }

    fn unheld(&self, segments: Vec<String>) -> Vec<String> {
        segments
            .into_iter()
            .filter(|s| {
                !self.serving.contains_key(s) && !self.by_peer.values().any(|p| p.contains(s))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::msg::WireRank;
    use bytes::Bytes;

    fn req(segs: &[&str]) -> LoadRequest {
        let mut r = crate::proto::tests::request("r", 1);
        r.ranks = segs
            .iter()
            .map(|s| WireRank {
                tp_rank: 0,
                pp_rank: 0,
                segment: s.to_string(),
                groups: Vec::new(),
            })
            .collect();
        r
    }

    #[test]
    fn a_segment_goes_when_neither_a_session_nor_a_load_holds_it() {
        let mut p = PeerSegments::default();
        let (a, b) = (Bytes::from_static(b"a"), Bytes::from_static(b"b"));
        p.add_request(&a, &req(&["x:1", "y:1"]));
        p.add_request(&b, &req(&["y:1"]));
        let serving = p.serve_started(&req(&["x:1"]));
        // x is being served and y is b's too: nothing goes with a's session
        assert!(p.session_ended(&a).is_empty());
        assert_eq!(p.serve_ended(serving), vec!["x:1".to_string()]);
        assert_eq!(p.session_ended(&b), vec!["y:1".to_string()]);
        assert!(p.session_ended(&b).is_empty());
    }
}
