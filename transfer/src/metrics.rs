//! kvferry's Prometheus metrics (docs/design.md §6 "Metrics"): what the transfer engines moved
//! (per path and peer) and what the consumers' loads came to (per verdict), in one
//! process-wide registry, encoded in the Prometheus/OpenMetrics text format by
//! [`encode_text`].
//!
//! Built on `prometheus-client`, the Prometheus project's own Rust client: typed label sets,
//! no global macros, OpenMetrics text out of the box, no exporter or runtime pulled in (the
//! HTTP endpoint is kvferry's own bounded one, and vLLM re-exports through its own client).
//!
//! Names follow vLLM's NIXL connector metrics (`vllm:nixl_xfer_time_seconds`, ...) with the
//! `kvferry_` prefix, so a NIXL dashboard needs only the new prefix:
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `kvferry_xfer_time_seconds` | histogram | path, peer, op | one batch, submit to end |
//! | `kvferry_bytes_transferred` | histogram | path, peer, op | bytes of one batch |
//! | `kvferry_num_slices` | histogram | path, peer, op | slices of one batch |
//! | `kvferry_transferred_bytes_total` | counter | path, peer, op | bytes of finished batches |
//! | `kvferry_num_failed_transfers_total` | counter | path, peer, op, cause | failed batches |
//! | `kvferry_num_retries_total` | counter | peer | slices posted again on a fresh descriptor |
//! | `kvferry_num_loads_total` | counter | verdict, reason | consumer loads |
//! | `kvferry_num_recomputed_total` | counter | | loads whose KV is discarded and recomputed |
//! | `kvferry_load_time_seconds` | histogram | | request sent to producer's FINISH |
//! | `kvferry_checksum_time_seconds` | histogram | | checksumming and comparing one load |
//!
//! `path` is the transport and, for GPU memory, how it was registered: `tcp`,
//! `tcp-gpu-staged`, `rdma`, `rdma-dma-buf`, `rdma-peer-memory`, `rdma-gpu-staged`. `peer` is
//! the peer's segment name (`host:port`); at most [`MAX_PEERS`] distinct peers get their own
//! label, later ones count under `other` (a peer chooses the names it makes us write to, so
//! the label set must have a budget). `verdict`: `verified`, `mismatch`, `unverified` (with
//! `reason`, e.g. `no_checksums`), `unchecked` (checksums off), `failed` (with `reason`: the
//! load did not land).

use crate::sync::MutexExt;
use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Distinct peers labelled by name; later peers count under `peer="other"`.
pub const MAX_PEERS: usize = 256;

/// Labels of one transfer series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransferLabels {
    /// `tcp`, `rdma`, `rdma-dma-buf`, ... (module doc).
    pub path: String,
    /// The peer's segment name, or `other`.
    pub peer: String,
    /// `read` or `write`.
    pub op: String,
}

/// Labels of a failed transfer.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// As `TransferLabels::path`.
    pub path: String,
    /// As `TransferLabels::peer`.
    pub peer: String,
    /// `read` or `write`.
    pub op: String,
    /// The failure's cause (`TransferError::cause`): `timeout`, `io`, `rdma`, `refused`, ...
    pub cause: String,
}

/// Labels of a retry.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabels {
    /// As `TransferLabels::peer`.
    pub peer: String,
}

/// Labels of a load.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoadLabels {
    /// `verified`, `mismatch`, `unverified`, `unchecked`, `failed`.
    pub verdict: String,
    /// Why unverified or failed (snake case), empty otherwise.
    pub reason: String,
}

/// One finished transfer batch, as [`Metrics::transfer`] records it.
#[derive(Debug, Clone, Copy)]
pub struct Transfer<'a> {
    /// `tcp`, `rdma`, `rdma-dma-buf`, ... (module doc).
    pub path: &'a str,
    /// The peer's segment name.
    pub peer: &'a str,
    /// `read` or `write`.
    pub op: &'a str,
    /// Bytes of the batch.
    pub bytes: u64,
    /// Slices of the batch.
    pub slices: u32,
    /// Seconds from submit to its end.
    pub seconds: f64,
}

/// One (path, peer, op) series of [`Metrics`]'s transfer families, resolved once
/// ([`Metrics::transfer_series`]): the handles share the families' values.
pub(crate) struct TransferSeries {
    path: String,
    /// The peer's segment name (its label may be `other`).
    peer_name: String,
    op: String,
    /// The labels, made at the first batch recorded: a peer takes one of the `MAX_PEERS`
    /// labels only once a batch of it is recorded, as through `Metrics::transfer`.
    labels: OnceLock<TransferLabels>,
    /// The handles of a finished batch's series (time, bytes, slices, bytes total), made at
    /// the first one: a series only ever failed shows only in the failure family.
    ok: OnceLock<(Histogram, Histogram, Histogram, Counter)>,
}

impl TransferSeries {
    /// Whether this is the series of `path`, the peer named `peer` and `op`.
    pub(crate) fn is(&self, path: &str, peer: &str, op: &str) -> bool {
        self.path == path && self.op == op && self.peer_name == peer
    }

    fn labels(&self, m: &Metrics) -> &TransferLabels {
        self.labels.get_or_init(|| TransferLabels {
            path: self.path.clone(),
            peer: m.peer(&self.peer_name),
            op: self.op.clone(),
        })
    }

    /// Records a finished batch of `bytes` in `slices` that took `seconds`: `Ok`, or the
    /// failure's cause (counted in `m`'s failure family).
    pub(crate) fn record(
        &self,
        m: &Metrics,
        bytes: u64,
        slices: u32,
        seconds: f64,
        result: Result<(), &str>,
    ) {
        match result {
            Ok(()) => {
                let (time, b, s, total) = self.ok.get_or_init(|| {
                    let l = self.labels(m);
                    (
                        m.xfer_time.get_or_create(l).clone(),
                        m.xfer_bytes.get_or_create(l).clone(),
                        m.xfer_slices.get_or_create(l).clone(),
                        m.bytes_total.get_or_create(l).clone(),
                    )
                });
                time.observe(seconds);
                b.observe(bytes as f64);
                s.observe(slices as f64);
                total.inc_by(bytes);
            }
            Err(cause) => {
                let l = self.labels(m);
                m.failed
                    .get_or_create(&FailureLabels {
                        path: l.path.clone(),
                        peer: l.peer.clone(),
                        op: l.op.clone(),
                        cause: cause.into(),
                    })
                    .inc();
            }
        }
    }
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// The process's metrics.
pub struct Metrics {
    registry: Registry,
    xfer_time: HistogramFamily<TransferLabels>,
    xfer_bytes: HistogramFamily<TransferLabels>,
    xfer_slices: HistogramFamily<TransferLabels>,
    bytes_total: Family<TransferLabels, Counter>,
    failed: Family<FailureLabels, Counter>,
    retries: Family<PeerLabels, Counter>,
    loads: Family<LoadLabels, Counter>,
    recomputed: Counter,
    load_time: Histogram,
    checksum_time: Histogram,
    peers: Mutex<HashSet<String>>,
}

const TIME_BUCKETS: [f64; 13] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
];
const SLICE_BUCKETS: [f64; 14] = [
    10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0, 20000.0,
    50000.0,
];

fn time_histogram() -> Histogram {
    Histogram::new(TIME_BUCKETS)
}
fn bytes_histogram() -> Histogram {
    // 2 KiB to 8 GiB, as vLLM's NIXL bytes histogram.
    Histogram::new((1..25).step_by(2).map(|i| (1u64 << (10 + i)) as f64))
}
fn slices_histogram() -> Histogram {
    Histogram::new(SLICE_BUCKETS)
}

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kvferry");
        let m = Metrics {
            xfer_time: Family::new_with_constructor(time_histogram),
            xfer_bytes: Family::new_with_constructor(bytes_histogram),
            xfer_slices: Family::new_with_constructor(slices_histogram),
            bytes_total: Family::default(),
            failed: Family::default(),
            retries: Family::default(),
            loads: Family::default(),
            recomputed: Counter::default(),
            load_time: time_histogram(),
            checksum_time: time_histogram(),
            peers: Mutex::new(HashSet::new()),
            registry: Registry::default(),
        };
        registry.register(
            "xfer_time_seconds",
            "Duration of kvferry transfer batches (submit to end)",
            m.xfer_time.clone(),
        );
        registry.register(
            "bytes_transferred",
            "Bytes per kvferry transfer batch",
            m.xfer_bytes.clone(),
        );
        registry.register(
            "num_slices",
            "Slices per kvferry transfer batch",
            m.xfer_slices.clone(),
        );
        registry.register(
            "transferred_bytes",
            "Bytes moved by finished kvferry transfer batches",
            m.bytes_total.clone(),
        );
        registry.register(
            "num_failed_transfers",
            "Failed kvferry transfer batches, by cause",
            m.failed.clone(),
        );
        registry.register(
            "num_retries",
            "Slices posted again on a freshly fetched peer descriptor",
            m.retries.clone(),
        );
        registry.register(
            "num_loads",
            "Consumer loads by verdict (verified, mismatch, unverified, unchecked, failed)",
            m.loads.clone(),
        );
        registry.register(
            "num_recomputed",
            "Loads whose KV was discarded for recomputation (fail-closed, recompute policy)",
            m.recomputed.clone(),
        );
        registry.register(
            "load_time_seconds",
            "Duration of consumer loads, request to the producer's FINISH",
            m.load_time.clone(),
        );
        registry.register(
            "checksum_time_seconds",
            "Time checksumming and comparing one landed load",
            m.checksum_time.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The peer label for `name`: itself while fewer than `MAX_PEERS` peers are labelled,
    /// else `other`.
    fn peer(&self, name: &str) -> String {
        let mut peers = self.peers.locked();
        if peers.contains(name) {
            return name.to_string();
        }
        if peers.len() < MAX_PEERS {
            peers.insert(name.to_string());
            return name.to_string();
        }
        "other".into()
    }

    /// Records a finished batch `t`: `Ok` or the failure's cause.
    pub fn transfer(&self, t: &Transfer<'_>, result: Result<(), &str>) {
        self.transfer_series(t.path, t.peer, t.op)
            .record(self, t.bytes, t.slices, t.seconds, result);
    }

    /// The series of batches on `path` to the peer named `peer` of `op` (its label as
    /// `transfer` gives it), to record many batches in without a lookup each. Nothing
    /// appears in the exposition until a batch is recorded in it.
    pub(crate) fn transfer_series(&self, path: &str, peer: &str, op: &str) -> TransferSeries {
        TransferSeries {
            path: path.into(),
            peer_name: peer.into(),
            op: op.into(),
            labels: OnceLock::new(),
            ok: OnceLock::new(),
        }
    }

    /// Records a slice posted again to `peer` after its descriptor was fetched again.
    pub fn retry(&self, peer: &str) {
        self.retries
            .get_or_create(&PeerLabels {
                peer: self.peer(peer),
            })
            .inc();
    }

    /// Records a load's verdict (`reason` empty unless unverified or failed), and its times
    /// when it landed.
    pub fn load(
        &self,
        verdict: &str,
        reason: &str,
        load_seconds: Option<f64>,
        checksum_seconds: Option<f64>,
    ) {
        self.loads
            .get_or_create(&LoadLabels {
                verdict: verdict.into(),
                reason: reason.into(),
            })
            .inc();
        if let Some(s) = load_seconds {
            self.load_time.observe(s);
        }
        if let Some(s) = checksum_seconds {
            self.checksum_time.observe(s);
        }
    }

    /// Records a load whose KV is discarded and recomputed.
    pub fn recomputed(&self) {
        self.recomputed.inc();
    }

    /// The metrics in the OpenMetrics text format (what Prometheus scrapes), ending `# EOF`.
    pub fn encode_text(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The process's metrics (created on first use).
pub fn global() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::new)
}

/// `global().encode_text()`: the process's metrics as OpenMetrics text.
pub fn encode_text() -> String {
    global().encode_text()
}

/// The content type of [`encode_text`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, start: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(start))
    }

    #[test]
    fn transfers_and_loads_appear_with_their_labels() {
        let m = Metrics::new();
        m.transfer(
            &Transfer {
                path: "tcp",
                peer: "10.0.0.1:7",
                op: "write",
                bytes: 4096,
                slices: 2,
                seconds: 0.002,
            },
            Ok(()),
        );
        m.transfer(
            &Transfer {
                path: "tcp",
                peer: "10.0.0.1:7",
                op: "write",
                bytes: 4096,
                slices: 2,
                seconds: 0.002,
            },
            Ok(()),
        );
        m.transfer(
            &Transfer {
                path: "rdma",
                peer: "10.0.0.2:7",
                op: "read",
                bytes: 1,
                slices: 1,
                seconds: 0.1,
            },
            Err("timeout"),
        );
        m.load("verified", "", Some(0.01), Some(0.001));
        m.load("unverified", "no_checksums", Some(0.01), Some(0.001));
        m.recomputed();
        let t = m.encode_text();
        assert!(t.ends_with("# EOF\n"), "{t}");
        assert_eq!(
            line(&t, "kvferry_transferred_bytes_total{"),
            Some(
                r#"kvferry_transferred_bytes_total{path="tcp",peer="10.0.0.1:7",op="write"} 8192"#
            )
        );
        assert!(
            line(&t, "kvferry_xfer_time_seconds_count{")
                .is_some_and(|l| l.ends_with(" 2") && l.contains(r#"path="tcp""#)),
            "{t}"
        );
        assert_eq!(
            line(&t, "kvferry_num_failed_transfers_total{"),
            Some(
                r#"kvferry_num_failed_transfers_total{path="rdma",peer="10.0.0.2:7",op="read",cause="timeout"} 1"#
            )
        );
        assert!(
            t.contains(r#"kvferry_num_loads_total{verdict="unverified",reason="no_checksums"} 1"#)
        );
        assert!(t.contains("kvferry_num_recomputed_total 1"));
        assert!(t.contains("kvferry_checksum_time_seconds_count 2"));
    }

    #[test]
    fn a_series_kept_records_into_the_families_and_a_failed_one_only_as_failed() {
        let m = Metrics::new();
        let ok = m.transfer_series("tcp", "10.0.0.1:7", "write");
        let bad = m.transfer_series("tcp", "10.0.0.3:7", "write");
        let _never = m.transfer_series("tcp", "10.0.0.4:7", "write");
        assert!(ok.is("tcp", "10.0.0.1:7", "write") && !ok.is("tcp", "10.0.0.1:7", "read"));
        ok.record(&m, 100, 1, 0.001, Ok(()));
        ok.record(&m, 100, 1, 0.001, Ok(()));
        // The same series through the public call: one set of values.
        m.transfer(
            &Transfer {
                path: "tcp",
                peer: "10.0.0.1:7",
                op: "write",
                bytes: 100,
                slices: 1,
                seconds: 0.001,
            },
            Ok(()),
        );
        bad.record(&m, 100, 1, 0.001, Err("io"));
        let t = m.encode_text();
        assert!(
            t.contains(
                r#"kvferry_transferred_bytes_total{path="tcp",peer="10.0.0.1:7",op="write"} 300"#
            ),
            "{t}"
        );
        assert!(t.contains(
            r#"kvferry_num_failed_transfers_total{path="tcp",peer="10.0.0.3:7",op="write",cause="io"} 1"#
        ));
        assert!(
            !t.lines()
                .any(|l| l.starts_with("kvferry_xfer") && l.contains("10.0.0.3:7")),
            "a series only failed has no success values: {t}"
        );
        assert!(
            !m.peers.locked().contains("10.0.0.4:7"),
            "a series never recorded takes no peer label"
        );
    }

    #[test]
    fn peers_past_the_budget_count_as_other() {
        let m = Metrics::new();
        for i in 0..MAX_PEERS + 10 {
            m.transfer(
                &Transfer {
                    path: "tcp",
                    peer: &format!("h:{i}"),
                    op: "write",
                    bytes: 1,
                    slices: 1,
                    seconds: 0.0,
                },
                Ok(()),
            );
        }
        let t = m.encode_text();
        let series = t
            .lines()
            .filter(|l| l.starts_with("kvferry_transferred_bytes_total{"))
            .count();
        assert_eq!(series, MAX_PEERS + 1);
        assert!(
            t.contains(r#"kvferry_transferred_bytes_total{path="tcp",peer="other",op="write"} 10"#)
        );
    }
}
