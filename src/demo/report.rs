//! The demo's report: the JSON `--json` prints, and the same facts as a few lines for a person.

use serde::Serialize;

use crate::loads::LoadCounts;

/// The demo's result, printed as JSON with `--json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DemoReport {
    /// What carried the KV between the first producer and consumer ranks: "cuda-ipc"
    /// (device copies between GPU memory of processes of this host), "tcp" or "rdma".
    pub transport: String,
    /// The engines' network transport ("tcp" or "rdma"): what KV to other hosts takes. It
    /// differs from `transport` only when same-host GPU KV moved over CUDA IPC.
    pub network_transport: String,
    /// How the engines registered the KV memory of both sides: "host", or for GPU memory
    /// "dma-buf" / "peer-memory" (GPUDirect RDMA) or "staged" (through pinned host memory).
    pub memory_paths: Vec<String>,
    /// The same as `transport` (kept for scripts that read it).
    pub transfer_path: String,
    /// Loads the consumer read itself (docs/design.md §4.10: same-host GPU KV over CUDA IPC,
    /// from the second load to a producer on); the others the producer wrote.
    pub read_loads: u32,
    /// Checksum backend ("cpu" or "cuda").
    pub checksum_backend: String,
    /// Model shape.
    pub model: String,
    /// Producer TP×PP and consumer TP×PP.
    pub prefill_tp: u32,
    /// See `prefill_tp`.
    pub prefill_pp: u32,
    /// See `prefill_tp`.
    pub decode_tp: u32,
    /// See `prefill_tp`.
    pub decode_pp: u32,
    /// Tokens per block of the producer and of the consumer.
    pub prefill_block_size: u64,
    /// See `prefill_block_size`.
    pub decode_block_size: u64,
    /// Requests loaded.
    pub requests: u32,
    /// Prompt tokens over all requests.
    pub tokens: u64,
    /// Verdict and action counts (top-level JSON fields).
    #[serde(flatten)]
    pub counts: LoadCounts,
    /// Corruptions injected (`--corrupt`).
    pub corrupted: u32,
    /// After each recompute, the consumer's KV of that request equals the producer's
    /// (null when nothing was recomputed).
    pub kv_equal_after_recompute: Option<bool>,
    /// The KV cache groups a mismatch was reported in, ascending.
    pub mismatched_groups: Vec<u32>,
    /// With state layers (a hybrid model): after every completed load, the consumer's state
    /// blocks equal the producer's (they move but are not checksummed); null without them.
    pub state_landed: Option<bool>,
    /// Loads in flight at once (`--in-flight`, at most `requests`).
    pub in_flight: u32,
    /// Worker threads of the runtime both sides ran on (from `in_flight` and the cores).
    pub runtime_workers: u32,
    /// Stages the requests went in: each prefilled and published as many requests as both
    /// sides' pools hold (`--pool-memory`), then loaded them; 1 when they all fit.
    pub stages: u32,
    /// KV bytes moved by the transfer engines.
    pub bytes: u64,
    /// Wall seconds of the load phase (request, transfer, reply, verification): the sum over
    /// the stages (the requests published together, loaded `in_flight` at a time, the next
    /// one started as one ends) of the time from their first load's start to the last one's
    /// end; with one load in flight, the sum of the loads' latencies. Prefill and publish are
    /// not in it.
    pub seconds: f64,
    /// bytes / seconds, in GB/s (10^9): the loads' throughput with `in_flight` loads at once.
    pub gb_per_s: f64,
    /// One load's latency (request to verdict: the `Consumer::load` call), seconds: the
    /// median over all loads (the upper one of an even count), failed ones included.
    pub load_seconds_median: f64,
    /// The same, the largest.
    pub load_seconds_max: f64,
    /// Seconds spent checksumming (producer at publish + consumer after landing).
    pub checksum_seconds: f64,
    /// Seconds the consumer spent verifying (checksumming the landed blocks and comparing),
    /// over all loads; part of `seconds`.
    pub verify_seconds: f64,
    /// The consumer's verification time as a share of its load's time (0..1): the median over
    /// the loads that landed.
    pub verify_share_median: f64,
    /// The same, the largest.
    pub verify_share_max: f64,
    /// The reference beside `gb_per_s`, GB/s (10^9): with `--device cpu` one core copying the
    /// same bytes in host memory (`memcpy` of a buffer of up to 256 MiB, repeated until the
    /// loads' bytes or 1 GiB are copied, the best pass); with `--device cuda` an in-process
    /// device-to-device copy on the consumer's GPU of one load's mean bytes (the raw copy
    /// rate of the same bytes, timed with events; 0 when it could not be measured).
    pub copy_gb_per_s: f64,
    /// What `copy_gb_per_s` measured: `host memcpy` or `device copy`.
    pub copy_reference: String,
    /// Seconds the producer spent generating KV (seeded random bytes in the model's shape),
    /// not counted in `seconds`.
    pub prefill_seconds: f64,
    /// Loads whose outcome was not the expected one: an uncorrupted load not verified and
    /// completed, a corrupted one not a mismatch, or a load that ended in an error. The
    /// command exits with status 1 when this is not 0.
    pub unexpected: u32,
}

/// Prints the report `r` as a few lines on stdout ([`summary`]).
pub(super) fn print_summary(r: &DemoReport) {
    print!("{}", summary(r));
}

/// The report `r` as a few lines for a person, each ending in a newline.
pub(super) fn summary(r: &DemoReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvferry demo: {} — producer TP{}×PP{} → consumer TP{}×PP{}, block sizes {} → {}",
        r.model,
        r.prefill_tp,
        r.prefill_pp,
        r.decode_tp,
        r.decode_pp,
        r.prefill_block_size,
        r.decode_block_size
    );
    let network = if r.network_transport == r.transport {
        String::new()
    } else {
        format!(" (to other hosts: {})", r.network_transport)
    };
    let _ = writeln!(
        out,
        "  transport {}{} (KV memory: {}), checksums on {}",
        r.transport,
        network,
        r.memory_paths.join(", "),
        r.checksum_backend
    );
    if r.read_loads > 0 {
        let _ = writeln!(
            out,
            "  {} of {} loads read by the consumer, the others written by the producer",
            r.read_loads, r.requests
        );
    }
    let _ = writeln!(
        out,
        "  {} requests, {} prompt tokens, {:.2} GB of KV moved",
        r.requests,
        r.tokens,
        r.bytes as f64 / 1e9
    );
    let _ = writeln!(
        out,
        "  loads: {:.3} s, {:.2} GB/s; raw copy ({}) on this machine {:.2} GB/s (loads at {:.2} of it)",
        r.seconds,
        r.gb_per_s,
        r.copy_reference,
        r.copy_gb_per_s,
        if r.copy_gb_per_s > 0.0 {
            r.gb_per_s / r.copy_gb_per_s
        } else {
            0.0
        }
    );
    let _ = writeln!(
        out,
        "  {} loads in flight at once, in {} stage(s); a load's latency {:.2} ms (median), {:.2} ms at most",
        r.in_flight,
        r.stages,
        r.load_seconds_median * 1e3,
        r.load_seconds_max * 1e3
    );
    let _ = writeln!(
        out,
        "  verification: {:.0}% of a load's time (median; largest {:.0}%), {:.3} s in all",
        r.verify_share_median * 100.0,
        r.verify_share_max * 100.0,
        r.verify_seconds
    );
    let _ = writeln!(
        out,
        "  not in the loads: producer checksums at publish {:.3} s; KV generation (seeded random bytes) {:.3} s",
        r.checksum_seconds - r.verify_seconds,
        r.prefill_seconds
    );
    let _ = writeln!(
        out,
        "  verdicts: {} verified, {} mismatch, {} unverified; actions: {} completed, {} failed, {} recomputed",
        r.counts.verified,
        r.counts.mismatch,
        r.counts.unverified,
        r.counts.completed,
        r.counts.failed,
        r.counts.recomputed
    );
    if r.corrupted > 0 {
        let _ = writeln!(out, "  {} corruptions injected", r.corrupted);
    }
    if let Some(eq) = r.kv_equal_after_recompute {
        let _ = writeln!(
            out,
            "  consumer KV equals producer KV after recovery: {}",
            if eq { "yes" } else { "NO" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Numbers as `#`, so that a run's lines compare with another run's by their words.
    fn shape(line: &str) -> String {
        let mut s: String = line
            .chars()
            .map(|c| if c.is_ascii_digit() { '#' } else { c })
            .collect();
        while s.contains("##") || s.contains("#.#") {
            s = s.replace("##", "#").replace("#.#", "#");
        }
        s
    }

    /// README's sample of the demo's output has every line the summary prints for such a run,
    /// word for word (numbers aside), so it cannot go stale unnoticed.
    #[test]
    fn readme_sample_has_the_summarys_lines() {
        let readme = include_str!("../../README.md");
        let sample: Vec<String> = readme
            .split("```text\n")
            .find(|b| b.starts_with("kvferry demo: "))
            .and_then(|b| b.split("```").next())
            .expect("README has the demo's sample output")
            .lines()
            .map(shape)
            .collect();
        let r = DemoReport {
            transport: "tcp".into(),
            network_transport: "tcp".into(),
            memory_paths: vec!["host".into()],
            checksum_backend: "cpu".into(),
            model: "qwen3-0.6b".into(),
            copy_reference: "host memcpy".into(),
            ..DemoReport::default()
        };
        for line in summary(&r).lines() {
            assert!(
                sample.contains(&shape(line)),
                "README's demo sample lacks {line:?}"
            );
        }
    }
}
