//! The producer machine and time (docs/design.md §4.3): leases and waits that run out,
//! heartbeats, the end of a read load's lease, forgotten ids.

use std::hash::Hash;
use std::time::Instant;

use super::{Effect, Entry, ProducerMachine, Refusal, ReleaseReason, Reply, Status, Warning};

impl<P: Clone + Eq + Hash, T> ProducerMachine<P, T> {
    /// Time passed: expire leases and waits, send heartbeats, forget old ids.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut effects = Vec::new();
        let beat = self.timeouts.heartbeat;
        let mut expired = Vec::new();
        let mut read_over = Vec::new();
        for (id, e) in self.entries.iter_mut() {
            match e {
                Entry::Held { expires, .. } if *expires <= now => expired.push(id.clone()),
                Entry::Serving {
                    read_until: Some(until),
                    ..
                } if *until <= now => read_over.push(id.clone()),
                // Its FINISH went out: no more CONTINUE.
                Entry::Serving {
                    read_until: Some(_),
                    ..
                } => {}
                Entry::Serving {
                    peer,
                    load_id,
                    next_beat,
                    ..
                } if *next_beat <= now => {
                    *next_beat = now + beat;
                    effects.push(Effect::Reply {
                        peer: peer.clone(),
                        reply: Reply::new(Status::Continue, id, *load_id),
                    });
                }
                _ => {}
            }
        }
        read_over.sort();
        for id in read_over {
            // The consumer never said it had read: the serve margin bounds its reads.
            self.end_read(now, &id);
        }
        expired.sort();
        for id in expired {
            self.entries.insert(
                id.clone(),
                Entry::Done {
                    reason: ReleaseReason::Expired,
                    forget_at: now + self.timeouts.tombstone,
                },
            );
            effects.push(Effect::Released {
                request_id: id,
                reason: ReleaseReason::Expired,
            });
        }
        self.entries
            .retain(|_, e| !matches!(e, Entry::Done { forget_at, .. } if *forget_at <= now));
        let (late, keep): (Vec<_>, Vec<_>) = self.parked.drain(..).partition(|p| p.deadline <= now);
        self.parked = keep;
        for p in late {
            let id = p.request.request_id;
            effects.push(Effect::Warn(Warning::Load(Refusal::NotPublished(
                id.clone(),
            ))));
            let reply = Reply::error(
                &id,
                p.request.load_id,
                format!("request {id:?} was not published in time (publish wait {:?} or the consumer's budget)", self.timeouts.publish_wait),
            );
            effects.push(Effect::Reply {
                peer: p.peer,
                reply,
            });
        }
        for p in self.parked.iter_mut().filter(|p| p.next_beat <= now) {
            p.next_beat = now + beat;
            effects.push(Effect::Reply {
                peer: p.peer.clone(),
                reply: Reply::new(Status::Continue, &p.request.request_id, p.request.load_id),
            });
        }
        self.effects.extend(effects);
    }

    /// The earliest time at which [`Self::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let entries = self.entries.values().map(|e| match e {
            Entry::Held { expires, .. } => *expires,
            Entry::Done { forget_at, .. } => *forget_at,
            Entry::Serving {
                read_until: Some(t),
                ..
            } => *t,
            Entry::Serving { next_beat, .. } => *next_beat,
        });
        entries
            .chain(self.parked.iter().map(|p| p.deadline.min(p.next_beat)))
            .min()
    }
}
