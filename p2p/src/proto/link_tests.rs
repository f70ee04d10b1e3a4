//! The consumer machine against the producer machine over a simulated link: a fake clock,
//! messages dropped and delayed at random, transfers of random length. Property tests of the
//! rules that tie the two sides together:
//!
//! * budget vs serve margin: the producer starts a transfer only when it ends within the
//!   budget the consumer sent, so no write lands after the consumer's overall deadline as long
//!   as a request's trip stays within the grace the budget leaves for it;
//! * never served twice: whatever is dropped, delayed or asked again, each lease is written at
//!   most once and each request id lands at most once;
//! * every load ends, by its overall deadline, exactly once;
//! * CONTINUE vs the reply deadline: while the producer is alive and its messages arrive, a
//!   CONTINUE comes at least every heartbeat, so a consumer whose reply timeout exceeds one
//!   heartbeat plus the link's delays never gives up on a live producer (`NoReply`);
//! * progress (`proto::progress`): transfers land in 1 to 4 layer groups and the producer
//!   names each as it lands; whatever is lost or reordered, the spans a consumer takes follow
//!   on from slot 0 within the request, each named by the producer for that load after its
//!   layers landed, so no layer is taken twice or before it landed.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kvferry_checksum::group::RankInfo;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::consumer::{ConsumerEvent, ConsumerMachine, FailReason};
use super::msg::{
    encode, LayerSpan, LoadRequest, WireBlocks, WireRank, WireRankGroup, KIND_TRANSFER_REQUEST,
    PROTOCOL_VERSION,
};
use super::producer::{Effect, ProducerMachine, ProducerTimeouts};
use super::serve_error::{ServeFailure, WriteError, WriteErrorKind};

/// How the link and the sides behave in one run.
#[derive(Debug, Clone)]
struct Net {
    seed: u64,
    /// Chance that one message is lost.
    drop: f64,
    /// Longest one-way delay of a message.
    max_delay: Duration,
    /// Shortest and longest transfer (one past the serve margin fails at it).
    min_transfer: Duration,
    max_transfer: Duration,
    reply_timeout: Duration,
    max_wait: Duration,
    serve_margin: Duration,
    heartbeat: Duration,
    publish_wait: Duration,
}

/// What a consumer wants: load request `id` at `at`.
#[derive(Debug, Clone, Copy)]
struct Load {
    consumer: usize,
    id: u8,
    at: Duration,
}

#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Landed,
    Failed(FailReason),
}

/// One load as the consumer saw it.
#[derive(Debug)]
struct LoadRec {
    request_id: String,
    sent: Instant,
    ended: Vec<(Instant, Outcome)>,
    /// The progress spans it took, and when.
    spans: Vec<(Instant, LayerSpan)>,
}

/// One transfer the producer ran: whose load, and when its writes happened.
#[derive(Debug)]
struct Write {
    consumer: usize,
    load_id: u64,
    request_id: String,
    end: Instant,
}

enum Msg {
    ToProducer { peer: u32, bytes: Vec<u8> },
    ToConsumer { peer: u32, bytes: Vec<u8> },
}

struct Sim {
    net: Net,
    rng: ChaCha8Rng,
    t0: Instant,
    now: Instant,
    producer: ProducerMachine<u32, String>,
    consumers: Vec<ConsumerMachine>,
    /// Each consumer's current connection (a new one per rebuilt socket).
    peer_of: Vec<Option<u32>>,
    consumer_of: HashMap<u32, usize>,
    next_peer: u32,
    /// Messages in flight by delivery time (and sequence, so that equal times keep order).
    link: BTreeMap<(Instant, u64), Msg>,
    seq: u64,
    /// Transfers in flight: when they end, and the serve's answer.
    serving: Vec<(Instant, u32, String, u64, bool)>,
    loads: HashMap<(usize, u64), LoadRec>,
    writes: Vec<Write>,
    /// Layer groups landing: when, and the load's request id, load id and span.
    progress: Vec<(Instant, String, u64, LayerSpan)>,
    /// Every span the producer named, by (request id, load id), with when it landed.
    named: HashMap<(String, u64), Vec<(Instant, LayerSpan)>>,
}

/// Layer slots of the simulated requests.
const SLOTS: u32 = 4;

fn request(id: &str) -> LoadRequest {
    LoadRequest {
        version: PROTOCOL_VERSION,
        kind: KIND_TRANSFER_REQUEST.to_string(),
        request_id: id.to_string(),
        load_id: 0,
        tp_size: 1,
        pp_size: 1,
        num_local_computed: 0,
        num_tokens: 16,
        budget_ms: 0,
        token: None,
        key_proof: None,
        proof: None,
        read: false,
        want_layout: false,
        layout_digest: None,
        blocks: vec![WireBlocks {
            group_id: 0,
            block_size: 16,
            remote_block_size: 0,
            positions: Vec::new(),
            remote_blocks: Vec::new(),
            remote_positions: Vec::new(),
            local_blocks: Vec::new(),
        }],
        ranks: vec![WireRank {
            tp_rank: 0,
            pp_rank: 0,
            segment: "c:1".into(),
            groups: vec![WireRankGroup {
                group_id: 0,
                layers: (0..SLOTS as usize)
                    .map(|i| {
                        let mut l =
                            super::tests::request("x", 0).ranks[0].groups[0].layers[0].clone();
                        l.name = format!("model.layers.{i}.attn");
                        l
                    })
                    .collect(),
            }],
        }],
    }
}

impl Sim {
    fn new(net: Net, consumers: usize) -> Sim {
        let t0 = Instant::now();
        let timeouts = ProducerTimeouts {
            lease: Duration::from_secs(120),
            publish_wait: net.publish_wait,
            tombstone: Duration::from_secs(600),
            heartbeat: net.heartbeat,
        };
        let mut nonce = 0u8;
        let nonces = Box::new(move || {
            nonce = nonce.wrapping_add(1);
            Ok([nonce; 32])
        });
        Sim {
            rng: ChaCha8Rng::seed_from_u64(net.seed),
            producer: ProducerMachine::new(timeouts, net.serve_margin).with_control(
                None,
                "tcp://p:1",
                "tcp://p:1",
                nonces,
            ),
            consumers: (0..consumers)
                .map(|i| ConsumerMachine::new(net.reply_timeout, net.max_wait, 1000 * i as u64))
                .collect(),
            peer_of: vec![None; consumers],
            consumer_of: HashMap::new(),
            next_peer: 1,
            link: BTreeMap::new(),
            seq: 0,
            serving: Vec::new(),
            loads: HashMap::new(),
            writes: Vec::new(),
            progress: Vec::new(),
            named: HashMap::new(),
            net,
            t0,
            now: t0,
        }
    }

    /// Puts `msg` on the link: lost, or delivered after a random delay.
    fn send(&mut self, msg: Msg) {
        if self.rng.random_bool(self.net.drop) {
            return;
        }
        let max = self.net.max_delay.as_millis() as u64;
        let at = self.now + Duration::from_millis(self.rng.random_range(0..=max));
        self.seq += 1;
        self.link.insert((at, self.seq), msg);
    }

    /// Opens consumer `c`'s session over a fresh connection, as the shell connects (the
    /// handshake is not subject to the link: the shell's connect has its own deadline).
    fn connect(&mut self, c: usize) {
        let peer = self.next_peer;
        self.next_peer += 1;
        self.peer_of[c] = Some(peer);
        self.consumer_of.insert(peer, c);
        let hello = self.consumers[c].hello([c as u8; 32], "tcp://p:1", "c");
        self.producer.handle_message(self.now, peer, &hello);
        self.drain_producer();
    }

    fn load(&mut self, c: usize, id: &str) {
        if self.consumers[c].session().is_none() {
            self.connect(c);
        }
        let load_id = self.consumers[c]
            .start(self.now, request(id), None)
            .expect("a session is open");
        self.loads.insert(
            (c, load_id),
            LoadRec {
                request_id: id.to_string(),
                sent: self.now,
                ended: Vec::new(),
                spans: Vec::new(),
            },
        );
        self.drain_consumer(c);
    }

    fn drain_consumer(&mut self, c: usize) {
        while let Some(t) = self.consumers[c].poll_transmit() {
            let peer = self.peer_of[c].expect("connected");
            self.send(Msg::ToProducer {
                peer,
                bytes: t.bytes,
            });
        }
        while let Some(e) = self.consumers[c].poll_event() {
            let (load_id, outcome) = match e {
                ConsumerEvent::Finished { load_id, .. } => (load_id, Outcome::Landed),
                ConsumerEvent::Failed { load_id, reason } => (load_id, Outcome::Failed(reason)),
                ConsumerEvent::RebuildSocket => {
                    self.peer_of[c] = None;
                    continue;
                }
                ConsumerEvent::Progress {
                    load_id,
                    landed: Some(span),
                } => {
                    let rec = self.loads.get_mut(&(c, load_id)).expect("a started load");
                    rec.spans.push((self.now, span));
                    continue;
                }
                _ => continue,
            };
            let rec = self.loads.get_mut(&(c, load_id)).expect("a started load");
            rec.ended.push((self.now, outcome));
        }
    }

    fn drain_producer(&mut self) {
        while let Some(e) = self.producer.poll_effect() {
            match e {
                Effect::Welcome { peer, welcome } => {
                    let c = self.consumer_of[&peer];
                    let opened = self.consumers[c].handle_welcome(&encode(&welcome));
                    assert_eq!(opened, Ok(()), "{welcome:?}");
                }
                Effect::Reply { peer, reply } => self.send(Msg::ToConsumer {
                    peer,
                    bytes: encode(&reply),
                }),
                Effect::Serve {
                    peer,
                    request,
                    deadline,
                    ..
                } => {
                    let min = self.net.min_transfer.as_millis() as u64;
                    let max = (self.net.max_transfer.as_millis() as u64).max(min);
                    let took = Duration::from_millis(self.rng.random_range(min..=max));
                    // The shell bounds the writes by the deadline: past it they fail.
                    let ok = self.now + took <= deadline;
                    let end = (self.now + took).min(deadline);
                    self.writes.push(Write {
                        consumer: self.consumer_of[&peer],
                        load_id: request.load_id,
                        request_id: request.request_id.clone(),
                        end,
                    });
                    // The copies land in 1 to 4 layer groups; with more than one, each is named
                    // as it lands, the last one too (ahead of the FINISH, when all landed).
                    let groups = self.rng.random_range(1..=SLOTS);
                    let named = if groups > 1 { groups } else { 0 };
                    for k in 1..=named {
                        let at = self.now + took * k / groups;
                        let span = LayerSpan {
                            first: SLOTS * (k - 1) / groups,
                            end: SLOTS * k / groups,
                        };
                        if at < end || (k == groups && ok) {
                            let id = request.request_id.clone();
                            self.progress.push((at, id, request.load_id, span));
                        }
                    }
                    self.serving
                        .push((end, peer, request.request_id, request.load_id, ok));
                }
                Effect::Released { .. } | Effect::Warn(_) | Effect::CloseSegments { .. } => {}
            }
        }
    }

    /// Runs until nothing is left to happen: every load asked at its time, every `publish`
    /// of request `id` at its time.
    fn run(&mut self, publishes: &[(u8, Duration)], loads: &[Load]) {
        let mut todo: Vec<(Instant, Option<Load>, u8)> = publishes
            .iter()
            .map(|&(id, at)| (self.t0 + at, None, id))
            .chain(loads.iter().map(|l| (self.t0 + l.at, Some(*l), l.id)))
            .collect();
        todo.sort_by_key(|t| t.0);
        let mut todo = todo.into_iter().peekable();
        let end = self.t0 + Duration::from_secs(3600);
        loop {
            let next = [
                todo.peek().map(|t| t.0),
                self.link.keys().next().map(|k| k.0),
                self.serving.iter().map(|s| s.0).min(),
                self.progress.iter().map(|s| s.0).min(),
                self.producer.poll_timeout(),
            ]
            .into_iter()
            .chain(self.consumers.iter().map(|c| c.poll_timeout()))
            .flatten()
            .min();
            let Some(next) = next.filter(|&t| t < end) else {
                break;
            };
            self.now = self.now.max(next);
            if let Some((at, load, id)) = todo.next_if(|t| t.0 <= self.now) {
                let _ = at;
                match load {
                    Some(l) => self.load(l.consumer, &format!("r{id}")),
                    None => {
                        let r = self.producer.handle_publish(
                            self.now,
                            &format!("r{id}"),
                            format!("lease r{id}"),
                            None,
                        );
                        let _ = r; // a second publish of one id is refused; nothing else
                        self.drain_producer();
                    }
                }
                continue;
            }
            if let Some(k) = self.link.keys().next().copied().filter(|k| k.0 <= self.now) {
                match self.link.remove(&k) {
                    Some(Msg::ToProducer { peer, bytes }) => {
                        self.producer.handle_message(self.now, peer, &bytes);
                        self.drain_producer();
                    }
                    Some(Msg::ToConsumer { peer, bytes }) => {
                        let c = self.consumer_of[&peer];
                        // A message for a socket already rebuilt goes nowhere.
                        if self.peer_of[c] == Some(peer) {
                            self.consumers[c].handle_message(self.now, &bytes);
                            self.drain_consumer(c);
                        }
                    }
                    None => {}
                }
                continue;
            }
            if let Some(i) = self.progress.iter().position(|s| s.0 <= self.now) {
                let (at, id, load_id, span) = self.progress.swap_remove(i);
                let named = self.named.entry((id.clone(), load_id)).or_default();
                named.push((at, span));
                self.producer.handle_progress(self.now, &id, load_id, span);
                self.drain_producer();
                continue;
            }
            if let Some(i) = self.serving.iter().position(|s| s.0 <= self.now) {
                let (_, peer, id, load_id, ok) = self.serving.swap_remove(i);
                let result = if ok {
                    Ok((1, None, None))
                } else {
                    Err(ServeFailure::Write(WriteError {
                        rank: RankInfo::SINGLE,
                        kind: WriteErrorKind::OpenTimeout(self.net.serve_margin),
                    }))
                };
                self.producer
                    .handle_served(self.now, peer, &id, load_id, result);
                self.drain_producer();
                continue;
            }
            if self.producer.poll_timeout().is_some_and(|t| t <= self.now) {
                self.producer.handle_timeout(self.now);
                self.drain_producer();
            }
            for c in 0..self.consumers.len() {
                if self.consumers[c]
                    .poll_timeout()
                    .is_some_and(|t| t <= self.now)
                {
                    self.consumers[c].handle_timeout(self.now);
                    self.drain_consumer(c);
                }
            }
        }
    }

    /// The grace the consumer's budget leaves for a request's trip.
    fn grace(&self) -> Duration {
        self.net.max_wait - self.consumers[0].budget()
    }
}

fn ms(lo: u64, hi: u64) -> impl Strategy<Value = Duration> {
    (lo..=hi).prop_map(Duration::from_millis)
}

fn net(drop: f64) -> impl Strategy<Value = Net> {
    (
        any::<u64>(),
        ms(0, 400),
        ms(0, 6000),
        ms(1000, 5000),
        ms(2000, 12000),
        ms(500, 4000),
        ms(100, 2000),
        ms(0, 8000),
    )
        .prop_map(
            move |(seed, max_delay, max_transfer, reply, wait, margin, beat, publish)| Net {
                seed,
                drop,
                max_delay,
                min_transfer: Duration::ZERO,
                max_transfer,
                reply_timeout: reply,
                max_wait: wait.max(reply),
                serve_margin: margin,
                heartbeat: beat,
                publish_wait: publish,
            },
        )
}

fn loads(consumers: usize) -> impl Strategy<Value = Vec<Load>> {
    proptest::collection::vec((0..consumers, 0u8..4, ms(0, 10_000)), 1..12).prop_map(|v| {
        v.into_iter()
            .map(|(consumer, id, at)| Load { consumer, id, at })
            .collect()
    })
}

fn publishes() -> impl Strategy<Value = Vec<(u8, Duration)>> {
    proptest::collection::vec((0u8..4, ms(0, 10_000)), 0..8)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Budget vs serve margin: with every request's trip within the grace the budget leaves,
    /// no write ends after the overall deadline of the load it serves (so a consumer that gave
    /// up may reuse its blocks then), whatever is lost or late; and every load ends exactly
    /// once, by its overall deadline.
    #[test]
    fn no_write_lands_after_the_consumer_gave_up(
        net in net(0.2), publishes in publishes(), loads in loads(2),
    ) {
        let mut sim = Sim::new(net, 2);
        // Trips within the grace (the budget's reason); the sampled delay is capped to it.
        sim.net.max_delay = sim.net.max_delay.min(sim.grace());
        sim.run(&publishes, &loads);
        for w in &sim.writes {
            let rec = &sim.loads[&(w.consumer, w.load_id)];
            prop_assert_eq!(&rec.request_id, &w.request_id);
            prop_assert!(w.end <= rec.sent + sim.net.max_wait,
                "a write of {} ended {:?} after the consumer's deadline",
                w.request_id, w.end - (rec.sent + sim.net.max_wait));
        }
        for rec in sim.loads.values() {
            prop_assert_eq!(rec.ended.len(), 1, "{:?}", rec);
            prop_assert!(rec.ended[0].0 <= rec.sent + sim.net.max_wait, "{:?}", rec);
        }
    }

    /// Progress over a lossy, reordering link: the spans a load takes follow on from slot 0,
    /// within the request, each once, and each was named by the producer for this load after
    /// its layers landed (so no layer is checksummed before it landed, nor twice).
    #[test]
    fn a_load_takes_only_spans_that_landed_each_once_in_order(
        net in net(0.2), publishes in publishes(), loads in loads(2),
    ) {
        let mut sim = Sim::new(net, 2);
        sim.run(&publishes, &loads);
        for ((c, load_id), rec) in &sim.loads {
            let mut landed = 0;
            let named = sim.named.get(&(rec.request_id.clone(), *load_id));
            for &(at, span) in &rec.spans {
                prop_assert_eq!(span.first, landed, "{:?}", rec);
                prop_assert!(span.end > span.first && span.end <= SLOTS, "{:?}", rec);
                landed = span.end;
                let when = named.and_then(|n| n.iter().find(|n| n.1 == span)).map(|n| n.0);
                prop_assert!(when.is_some_and(|t| t <= at),
                    "consumer {} took {:?}, not named (or named later) for this load: {:?}",
                    c, span, named);
            }
        }
    }

    /// Never served twice: however many consumers ask for one request id, and whatever the
    /// link loses or delays, its lease is written at most once and lands at most once.
    #[test]
    fn a_lease_is_never_served_twice(
        net in net(0.3), publishes in publishes(), loads in loads(3),
    ) {
        let mut sim = Sim::new(net, 3);
        sim.run(&publishes, &loads);
        let mut writes: HashMap<&str, usize> = HashMap::new();
        for w in &sim.writes {
            *writes.entry(&w.request_id).or_default() += 1;
        }
        prop_assert!(writes.values().all(|&n| n <= 1), "{:?}", writes);
        let mut landed: HashMap<&str, usize> = HashMap::new();
        for rec in sim.loads.values() {
            if rec.ended.iter().any(|e| e.1 == Outcome::Landed) {
                *landed.entry(&rec.request_id).or_default() += 1;
                prop_assert!(writes.contains_key(rec.request_id.as_str()), "landed unwritten: {:?}", rec);
            }
        }
        prop_assert!(landed.values().all(|&n| n <= 1), "{:?}", landed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// CONTINUE vs the reply deadline: nothing lost, every message within `max_delay`, and a
    /// reply timeout longer than one heartbeat plus a round trip (the first CONTINUE answers
    /// the request) and than a heartbeat plus one trip's spread (a CONTINUE may be late by the
    /// link's delay, the next one early): no load fails for silence of a live producer.
    #[test]
    fn a_live_producer_is_never_silent_past_the_reply_deadline(
        net in net(0.0), publishes in publishes(), loads in loads(2),
    ) {
        let mut sim = Sim::new(net, 2);
        let n = &mut sim.net;
        // The reply timeout's rule: past a heartbeat and both trips, with room for the clock.
        n.reply_timeout = n.reply_timeout.max(n.heartbeat + 2 * n.max_delay + Duration::from_millis(1));
        n.max_wait = n.max_wait.max(n.reply_timeout);
        let (reply, wait) = (n.reply_timeout, n.max_wait);
        sim.consumers = (0..2)
            .map(|i| ConsumerMachine::new(reply, wait, 1000 * i as u64))
            .collect();
        sim.run(&publishes, &loads);
        for rec in sim.loads.values() {
            prop_assert!(
                !rec.ended.iter().any(|e| matches!(e.1, Outcome::Failed(FailReason::NoReply(_)))),
                "a live producer's load failed for silence: {:?} ({:?})", rec, sim.net
            );
        }
    }
}

/// The grace is the reason for the budget's margin: a request whose trip takes longer than
/// the grace can be served past the consumer's deadline (the property above needs its bound).
#[test]
fn a_trip_longer_than_the_grace_can_outlast_the_consumer() {
    let net = Net {
        seed: 1,
        drop: 0.0,
        max_delay: Duration::ZERO,
        min_transfer: Duration::from_secs(4),
        max_transfer: Duration::from_secs(4),
        reply_timeout: Duration::from_secs(10),
        max_wait: Duration::from_secs(10),
        serve_margin: Duration::from_secs(4),
        heartbeat: Duration::from_secs(1),
        publish_wait: Duration::from_secs(30),
    };
    let mut sim = Sim::new(net, 1);
    sim.producer
        .handle_publish(sim.now, "r0", "lease".into(), None)
        .unwrap();
    sim.load(0, "r0");
    // Hold the request on the link for 7 s (the grace is 1 s), then let it through: the
    // producer sees 9 s of budget left and starts a 4 s transfer.
    let ((_, seq), msg) = sim.link.pop_first().unwrap();
    sim.link
        .insert((sim.now + Duration::from_secs(7), seq), msg);
    sim.run(&[], &[]);
    let rec = sim.loads.values().next().unwrap();
    assert!(
        sim.writes
            .iter()
            .any(|w| w.end > rec.sent + sim.net.max_wait),
        "{:?}",
        sim.writes
    );
}
