//! Peer descriptors the engine has fetched (docs/design.md §3 "Segments"): the cache, its idle
//! expiry (what a peer that went away leaves here must not grow without bound), and the one
//! retry of a batch's slices on a freshly fetched descriptor when the cached one turned out
//! stale (the peer restarted under the same name).

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::auth::{AuthState, Token};
use crate::descriptor::SegmentDescriptor;
use crate::error::{HandshakeError, Result, RetryOutcome, TransferError};
use crate::handshake::{self, FrameType};
use crate::transport::completion::PeerRefresh;
use crate::transport::{CompletionSink, Slice, Transport};

struct Entry {
    desc: Arc<SegmentDescriptor>,
    used: Instant,
}

/// Descriptors by segment name. An entry not used (opened or submitted to) for `idle` is
/// dropped, and the transport told (`Transport::forget_idle`); one whose peer
/// cannot be reached any more is dropped at once (`forget`). At most
/// `crate::fd_budget::peer_budget` peers are held: past it the least recently used one goes
/// with its connections, so peers that come and go never exhaust the process's fds.
pub(crate) struct PeerCache {
    entries: Mutex<HashMap<String, Entry>>,
    transport: Arc<dyn Transport>,
    auth: Arc<AuthState>,
    handshake_timeout: Duration,
    idle: Duration,
    /// Fds the connections to one peer hold at most: a TCP data connection holds its socket,
    /// the reader's clone and the closer's clone; RDMA queue pairs hold none.
    fds_per_peer: usize,
    /// The descriptor touched last (its address) and when (ns after `epoch`): a touch of the
    /// same descriptor less than `touch_gap` later leaves its entry as it is (no lock, no
    /// hash of its name per submit), so an entry is dropped at most `touch_gap` before
    /// `idle` has passed since its last use.
    last_touch: (AtomicUsize, AtomicU64),
    epoch: Instant,
    touch_gap: Duration,
}

/// The longest `PeerCache::touch_gap`: a sixteenth of the idle timeout, at most this.
const TOUCH_GAP_MAX: Duration = Duration::from_millis(100);

impl PeerCache {
    pub(crate) fn new(
        transport: Arc<dyn Transport>,
        auth: Arc<AuthState>,
        handshake_timeout: Duration,
        idle: Duration,
        tcp_connections_per_peer: usize,
    ) -> Self {
        let fds_per_peer = match transport.kind() {
            crate::types::TransportKind::Rdma => 1,
            _ => 3 * tcp_connections_per_peer.max(1),
        };
        PeerCache {
            fds_per_peer,
            entries: Mutex::new(HashMap::new()),
            transport,
            auth,
            handshake_timeout,
            idle,
            last_touch: (AtomicUsize::new(0), AtomicU64::new(0)),
            epoch: Instant::now(),
            touch_gap: (idle / 16).min(TOUCH_GAP_MAX),
        }
    }

    /// Runs `f` on the entries under the cache's lock, those idle at `now` dropped first. The
    /// transport is told of the dropped ones after the lock is released
    /// (`Transport::forget_idle`): left alone, a departed CUDA IPC peer's imported allocations
    /// would stay mapped for the life of the process.
    fn with_entries<R>(&self, now: Instant, f: impl FnOnce(&mut HashMap<String, Entry>) -> R) -> R {
        let (r, expired) = {
            let mut m = self.entries.locked();
            let idle = self.idle;
            let mut expired = Vec::new();
            // One clock read for all entries (this runs at every submit); `expired` allocates
            // only when an entry goes.
            m.retain(|name, e| {
                let keep = now.saturating_duration_since(e.used) < idle;
                if !keep {
                    expired.push(name.clone());
                }
                keep
            });
            (f(&mut m), expired)
        };
        // Outside the lock: a transport takes its own locks and may wait on them. An entry `f`
        // put back under the same name (a fetch) is forgotten by the transport too; its next
        // transfer sets up again what it needs.
        for name in expired {
            tracing::debug!(segment = %name, idle = ?self.idle, "peer idle; dropping its descriptor");
            self.transport.forget_idle(&name);
        }
        r
    }

    /// The cached descriptor of `name` (marked used), if any.
    pub(crate) fn get(&self, name: &str) -> Option<Arc<SegmentDescriptor>> {
        let now = Instant::now();
        self.with_entries(now, |m| {
            m.get_mut(name).map(|e| {
                e.used = now;
                e.desc.clone()
            })
        })
    }

    /// Marks `name` used at `now` (a submit to it, which read the clock as it started).
    /// A descriptor touched less than `touch_gap` before is left as it is (see `last_touch`).
    pub(crate) fn touch(&self, desc: &Arc<SegmentDescriptor>, now: Instant) {
        let at = Arc::as_ptr(desc) as usize;
        let t = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        let (last, when) = &self.last_touch;
        // The time is stored before the address (release): an address read (acquire) comes
        // with a time at least as late as its touch.
        if last.load(Ordering::Acquire) == at
            && t.saturating_sub(when.load(Ordering::Relaxed)) < self.touch_gap.as_nanos() as u64
        {
            return;
        }
        self.with_entries(now, |m| {
            if let Some(e) = m.get_mut(&desc.name) {
                e.used = e.used.max(now);
            }
        });
        when.store(t, Ordering::Relaxed);
        last.store(at, Ordering::Release);
    }

    /// Cached descriptors now (after dropping idle ones).
    pub(crate) fn len(&self) -> usize {
        self.with_entries(Instant::now(), |m| m.len())
    }

    /// Drops `name`'s descriptor and the transport's connections to it.
    pub(crate) fn forget(&self, name: &str) {
        self.with_entries(Instant::now(), |m| m.remove(name));
        self.transport.disconnect(name);
    }

    /// Fetches `name`'s descriptor by a handshake (within the handshake timeout; presenting
    /// this engine's secret proof or `token`, `crate::auth`), validates and caches it. A new
    /// instance id drops the transport's connections to the old instance. With `warm`, what
    /// the first transfer would set up (`Transport::warm_up`, within one handshake timeout)
    /// is set up before it returns; callers that must return at once (a submit's re-fetch, a
    /// batch's retry) pass `false` and leave it to the transfer.
    /// Errors: `Handshake` when the peer cannot be reached or answers badly.
    pub(crate) fn fetch(
        &self,
        name: &str,
        token: Option<&Token>,
        warm: bool,
    ) -> Result<Arc<SegmentDescriptor>> {
        let body = handshake::request_with(
            name,
            FrameType::Descriptor,
            b"",
            self.handshake_timeout,
            self.auth.credential(token).as_ref(),
        )?;
        let d: SegmentDescriptor =
            serde_json::from_slice(&body).map_err(|e| TransferError::Handshake {
                peer: name.to_string(),
                source: HandshakeError::BadJson {
                    what: "descriptor",
                    source: Arc::new(e),
                },
            })?;
        let d = Arc::new(d.validate(name)?);
        let now = Instant::now();
        let (old, evicted) = self.with_entries(now, |m| {
            let old = m.insert(
                name.to_string(),
                Entry {
                    desc: d.clone(),
                    used: now,
                },
            );
            let budget = crate::fd_budget::peer_budget(self.fds_per_peer);
            (old, evict_over(m, budget, name))
        });
        for e in evicted {
            tracing::debug!(segment = %e, budget_fds = crate::fd_budget::nofile_limit(), "peer budget reached; dropping the least recently used peer's connections");
            self.transport.disconnect(&e);
        }
        if old.is_some_and(|o| o.desc.instance_id != d.instance_id) {
            tracing::info!(
                segment = name,
                "segment restarted (new instance id); dropping its connections"
            );
            self.transport.disconnect(name);
        }
        // What the first transfer would set up (CUDA IPC imports) is set up now, outside the
        // cache's lock; a failure leaves it to that transfer.
        if !warm {
            return Ok(d);
        }
        if let Err(e) = self.transport.warm_up(&d) {
            tracing::warn!(
                segment = name,
                "preparing transfers to this segment failed ({e}); the first transfer prepares them"
            );
        }
        Ok(d)
    }
}

/// Removes the least recently used entries (never `keep`) until at most `budget` remain;
/// returns their names.
fn evict_over(m: &mut HashMap<String, Entry>, budget: usize, keep: &str) -> Vec<String> {
    let mut gone = Vec::new();
    while m.len() > budget.max(1) {
        let Some(oldest) = m
            .iter()
            .filter(|(k, _)| k.as_str() != keep)
            .min_by_key(|(_, e)| e.used)
            .map(|(k, _)| k.clone())
        else {
            break;
        };
        m.remove(&oldest);
        gone.push(oldest);
    }
    gone
}

/// One retry per batch: the first slice that fails on the peer's connection starts one
/// descriptor fetch (on its own thread, so no transport thread waits for a handshake); every
/// slice that fails so, before or after, is posted again on the fetched descriptor, or fails
/// with its own error and why the fetch failed.
/// Made once per submit (one allocation: its name is the submitted descriptor's).
pub(crate) struct BatchRefresh {
    cache: Arc<PeerCache>,
    /// The descriptor the batch was submitted on (its `name` is the segment's).
    submitted: Arc<SegmentDescriptor>,
    /// The batch's slices by id.
    slices: crate::batch::Slices,
    /// The grant token the batch was submitted with (`SegmentHandle::with_token`).
    token: Option<Token>,
    phase: Mutex<Phase>,
}

type Waiting = Vec<(u32, TransferError, CompletionSink)>;

enum Phase {
    Idle,
    Fetching(Waiting),
    Done(Result<Arc<SegmentDescriptor>>),
}

impl BatchRefresh {
    /// The retry of a batch of `slices` submitted on `submitted` with `token`.
    pub(crate) fn new(
        cache: Arc<PeerCache>,
        submitted: Arc<SegmentDescriptor>,
        slices: crate::batch::Slices,
        token: Option<Token>,
    ) -> Arc<Self> {
        Arc::new(BatchRefresh {
            cache,
            submitted,
            slices,
            token,
            phase: Mutex::new(Phase::Idle),
        })
    }

    /// The batch's slices by id, as given to `new`.
    pub(crate) fn slices(&self) -> &[Slice] {
        &self.slices
    }

    /// The peer's segment name.
    fn name(&self) -> &str {
        &self.submitted.name
    }
}

impl PeerRefresh for BatchRefresh {
    fn retry(self: Arc<Self>, id: u32, err: TransferError, sink: CompletionSink) {
        crate::metrics::global().retry(self.name());
        let mut phase = self.phase.locked();
        match &mut *phase {
            Phase::Fetching(w) => w.push((id, err, sink)),
            Phase::Done(d) => {
                let d = d.clone();
                drop(phase);
                self.resend(vec![(id, err, sink)], d);
            }
            Phase::Idle => {
                *phase = Phase::Fetching(vec![(id, err, sink)]);
                drop(phase);
                let this = self.clone();
                let spawned = std::thread::Builder::new()
                    .name("kvferry-refresh".into())
                    .spawn(move || this.fetch_and_resend());
                if let Err(e) = spawned {
                    self.finish(Err(TransferError::io("spawn descriptor refresh thread", e)));
                }
            }
        }
    }
}

impl BatchRefresh {
    fn fetch_and_resend(&self) {
        tracing::info!(
            segment = %self.name(),
            "a slice failed on the peer's connection; fetching its descriptor again"
        );
        let d = self.cache.fetch(self.name(), self.token.as_ref(), false);
        if d.is_err() {
            // the peer is gone: drop what we hold for it now, not after the idle timeout
            self.cache.forget(self.name());
        }
        self.finish(d);
    }

    fn finish(&self, d: Result<Arc<SegmentDescriptor>>) {
        let waiting = {
            let mut phase = self.phase.locked();
            match std::mem::replace(&mut *phase, Phase::Done(d.clone())) {
                Phase::Fetching(w) => w,
                _ => Vec::new(),
            }
        };
        self.resend(waiting, d);
    }

    /// Posts the failed slices again on `d` (their remote buffers looked up in it), or fails
    /// them when the fetch failed or their range is no longer advertised.
    fn resend(&self, failed: Waiting, d: Result<Arc<SegmentDescriptor>>) {
        let Some((_, _, sink)) = failed.first() else {
            return;
        };
        let sink = sink.clone();
        let desc = match d {
            Ok(d) => d,
            Err(fe) => {
                for (id, err, s) in failed {
                    s.complete(
                        id,
                        Err(annotate(err, RetryOutcome::Refetch(Box::new(fe.clone())))),
                    );
                }
                return;
            }
        };
        let mut again = Vec::with_capacity(failed.len());
        for (id, err, s) in failed {
            let Some(mut sl) = self.slices.get(id as usize).copied() else {
                s.complete(id, Err(err));
                continue;
            };
            match desc.find_buffer_index(sl.remote_addr, sl.len) {
                Some(b) => {
                    sl.remote_buffer = b;
                    again.push(sl);
                }
                None => s.complete(
                    id,
                    Err(annotate(
                        err,
                        RetryOutcome::NotInDescriptor {
                            addr: sl.remote_addr,
                            len: sl.len,
                            instance: desc.instance_id,
                        },
                    )),
                ),
            }
        }
        if !again.is_empty() {
            if let Err(e) = desc.check_kind(self.cache.transport.kind()) {
                return sink.fail_all(again.iter().map(|s| s.id), &e);
            }
            self.cache.transport.post(&desc, &again, sink, self.token);
        }
    }
}

fn annotate(err: TransferError, retry: RetryOutcome) -> TransferError {
    TransferError::Retry {
        source: Box::new(err),
        retry,
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::descriptor::TransportInfo;
    use crate::memory::{MemoryRegion, RegionKeys};
    use crate::types::TransportKind;

    /// A transport that counts its warm-ups, records its disconnects and moves nothing.
    #[derive(Default)]
    struct Counting {
        warmed: AtomicUsize,
        /// Each name disconnected or forgotten for idleness (which of the two), and whether
        /// `cache`'s lock was free at the time.
        disconnected: Mutex<Vec<(String, &'static str, bool)>>,
        /// The cache this transport serves, when a test wants its lock checked.
        cache: std::sync::OnceLock<std::sync::Weak<PeerCache>>,
    }

    impl Counting {
        fn record(&self, name: &str, how: &'static str) {
            // A transport may take its own locks and call back into the engine here: the cache
            // must not hold its lock while it calls out.
            let unlocked = self
                .cache
                .get()
                .and_then(std::sync::Weak::upgrade)
                .is_none_or(|c| c.entries.try_lock().is_ok());
            self.disconnected
                .locked()
                .push((name.to_string(), how, unlocked));
        }
    }

    impl Transport for Counting {
        fn kind(&self) -> TransportKind {
            TransportKind::Tcp
        }
        fn local_info(&self) -> TransportInfo {
            TransportInfo {
                kind: TransportKind::Tcp,
                details: serde_json::json!({}),
            }
        }
        fn register(&self, _region: &MemoryRegion) -> Result<RegionKeys> {
            Ok(RegionKeys::default())
        }
        fn deregister(&self, _region: &MemoryRegion) -> Result<()> {
            Ok(())
        }
        fn on_handshake(&self, _peer: SocketAddr, _body: &[u8]) -> Result<Vec<u8>> {
            Ok(Vec::new())
        }
        fn post(
            &self,
            _peer: &Arc<SegmentDescriptor>,
            slices: &[Slice],
            done: CompletionSink,
            _token: Option<Token>,
        ) {
            done.fail_all(slices.iter().map(|s| s.id), &TransferError::Cancelled);
        }
        fn warm_up(&self, _peer: &Arc<SegmentDescriptor>) -> Result<usize> {
            self.warmed.fetch_add(1, Ordering::SeqCst);
            Ok(0)
        }
        fn disconnect(&self, name: &str) {
            self.record(name, "disconnect");
        }
        fn forget_idle(&self, name: &str) {
            self.record(name, "forget_idle");
        }
    }

    /// A TCP descriptor of segment `name` with no buffers.
    fn descriptor(name: &str) -> Arc<SegmentDescriptor> {
        Arc::new(SegmentDescriptor {
            name: name.into(),
            instance_id: 1,
            transport: TransportInfo {
                kind: TransportKind::Tcp,
                details: serde_json::json!({}),
            },
            buffers: Vec::new(),
        })
    }

    /// Opening a segment warms up what the first transfer would set up; a fetch that must
    /// return at once (a submit's re-fetch, a batch's retry) does not.
    #[test]
    fn only_a_fetch_asked_to_warms_up() {
        let peer = crate::TransferEngine::new(crate::config::EngineConfig::default()).unwrap();
        let t = Arc::new(Counting::default());
        let cache = PeerCache::new(
            t.clone(),
            AuthState::new(None, "test"),
            Duration::from_secs(5),
            Duration::from_secs(60),
            1,
        );
        cache.fetch(&peer.segment_name(), None, false).unwrap();
        assert_eq!(t.warmed.load(Ordering::SeqCst), 0);
        cache.fetch(&peer.segment_name(), None, true).unwrap();
        assert_eq!(t.warmed.load(Ordering::SeqCst), 1);
    }

    /// A touch of the descriptor touched last is skipped within the gap only: one after it
    /// counts, so an entry in use never expires.
    #[test]
    fn a_touch_is_skipped_only_within_the_gap() {
        let cache = PeerCache::new(
            Arc::new(Counting::default()),
            AuthState::new(None, "test"),
            Duration::from_secs(5),
            Duration::from_millis(1600),
            1,
        );
        assert_eq!(cache.touch_gap, Duration::from_millis(100));
        let d = descriptor("127.0.0.1:9");
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        cache.entries.locked().insert(
            d.name.clone(),
            Entry {
                desc: d.clone(),
                used: t0,
            },
        );
        cache.touch(&d, t0);
        cache.touch(&d, ms(50));
        assert_eq!(cache.entries.locked()[&d.name].used, t0, "within the gap");
        cache.touch(&d, ms(150));
        assert_eq!(cache.entries.locked()[&d.name].used, ms(150));
        // Idle 1600 ms after t0, not after its last use: kept.
        assert!(cache.with_entries(ms(1700), |m| m.contains_key(&d.name)));
        assert!(!cache.with_entries(ms(1800), |m| m.contains_key(&d.name)));
    }

    /// An entry dropped for idleness is forgotten by the transport too (for CUDA IPC: the
    /// peer's imported allocations unmapped), after the cache's lock is released; an entry
    /// still in use is not.
    #[test]
    fn an_entry_dropped_for_idleness_is_forgotten_by_the_transport() {
        let t = Arc::new(Counting::default());
        let cache = Arc::new(PeerCache::new(
            t.clone(),
            AuthState::new(None, "test"),
            Duration::from_secs(5),
            Duration::from_millis(1600),
            1,
        ));
        t.cache.set(Arc::downgrade(&cache)).unwrap();
        let (gone, kept) = (descriptor("127.0.0.1:9"), descriptor("127.0.0.1:10"));
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        for (d, used) in [(&gone, t0), (&kept, ms(1000))] {
            cache.entries.locked().insert(
                d.name.clone(),
                Entry {
                    desc: d.clone(),
                    used,
                },
            );
        }
        // 1700 ms after its last use `gone` is past the idle timeout; `kept` (700 ms) is not.
        cache.touch(&kept, ms(1700));
        assert_eq!(
            *t.disconnected.locked(),
            [(gone.name.clone(), "forget_idle", true)]
        );
        let m = cache.entries.locked();
        assert!(!m.contains_key(&gone.name));
        assert_eq!(m[&kept.name].used, ms(1700));
    }
}
