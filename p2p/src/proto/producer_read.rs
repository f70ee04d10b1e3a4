//! The producer machine's side of loads the consumer reads itself (docs/design.md §4.10):
//! their lease, past the FINISH, until the consumer's `read_done` or the serve margin.

use std::hash::Hash;
use std::time::Instant;

use super::super::msg::{ErrorReason, LoadRequest};
use super::{Effect, Entry, ProducerMachine, ReleaseReason, Reply};

impl<P: Clone + Eq + Hash, T> ProducerMachine<P, T> {
    /// `peer` has read load `load_id` of `request_id` (its `read_done`): the lease ends
    /// (`Released` as served). Ignored unless that load is being read by `peer` in the session
    /// it asked in (its FINISH went out): a late, repeated or foreign `read_done`, or one from
    /// a later session of the same peer, changes nothing.
    pub fn handle_read_done(&mut self, now: Instant, peer: &P, request_id: &str, load_id: u64) {
        let session = self.sessions.id_of(peer);
        let reading = matches!(
            self.entries.get(request_id),
            Some(Entry::Serving {
                peer: p,
                load_id: l,
                read_until: Some(_),
                session_id,
                ..
            }) if p == peer && *l == load_id && session == Some(*session_id)
        );
        if reading {
            self.end_read(now, request_id);
        }
    }

    /// Ends the lease of the read load of `request_id`: served, its blocks released.
    pub(super) fn end_read(&mut self, now: Instant, request_id: &str) {
        self.entries.insert(
            request_id.to_string(),
            Entry::Done {
                reason: ReleaseReason::Served,
                forget_at: now + self.timeouts.tombstone,
            },
        );
        self.effects.push_back(Effect::Released {
            request_id: request_id.to_string(),
            reason: ReleaseReason::Served,
        });
    }

    /// `Some(ERROR)` for a request to read planned with another layout than this producer's
    /// (or when this producer sends none): nothing is served, the lease stays; the consumer
    /// asks for the layout again and loads by WRITE.
    pub(super) fn stale_layout(&self, request: &LoadRequest) -> Option<Reply> {
        let ours = !self.layout.is_empty()
            && request.layout_digest.as_deref() == Some(&self.layout_digest[..]);
        (request.read && !ours).then(|| {
            Self::read_refused(
                request,
                ErrorReason::ReadRefused,
                "the layout it was planned with is not this producer's (it restarted, or sends none)",
            )
        })
    }

    /// The ERROR (with `reason`) for a request this producer will not serve by read: `why`.
    /// Nothing is served; the consumer loads by WRITE.
    pub(super) fn read_refused(request: &LoadRequest, reason: ErrorReason, why: &str) -> Reply {
        let mut reply = Reply::error(
            &request.request_id,
            request.load_id,
            format!("not served by read, nothing served: {why}"),
        );
        reply.reason = Some(reason);
        reply
    }
}
