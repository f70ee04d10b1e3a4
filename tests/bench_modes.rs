//! `kvferry bench --mode target` and `--mode initiator` as two processes: READ and WRITE with
//! repeats (median, spread, p999 beside p99), what landed checked across the processes, the
//! plot written beside the JSON, a shared secret (and a stranger without it refused), and a
//! target buffer too small for the sweep named before anything moves.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

fn kvferry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
}

/// A target process and the segment it printed; killed on drop.
struct TargetProc {
    child: Child,
    segment: String,
}

impl Drop for TargetProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn target(extra: &[&str]) -> TargetProc {
    let mut child = kvferry()
        .args(["bench", "--mode", "target", "--transport", "tcp"])
        .args(["--listen", "127.0.0.1:0", "--buffer-size", "4M"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let segment = line
        .split_whitespace()
        .skip_while(|w| *w != "segment")
        .nth(1)
        .unwrap_or_else(|| panic!("no segment in {line:?}"))
        .to_string();
    TargetProc { child, segment }
}

fn initiator(t: &TargetProc, extra: &[&str]) -> std::process::Output {
    kvferry()
        .args(["bench", "--mode", "initiator", "--transport", "tcp"])
        .args(["--target", &t.segment])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn two_processes_read_and_write_with_repeats_percentiles_and_a_plot() {
    let t = target(&[]);
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let out = initiator(
        &t,
        &[
            "--op",
            "write,read",
            "--block-sizes",
            "4K,64K",
            "--batch",
            "8",
            "--threads",
            "1,2",
            "--pattern",
            "scattered",
            "--seconds",
            "0.2",
            "--repeats",
            "3",
            "--json-out",
            json.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("p999 lat us"), "{stdout}");
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["mode"], "initiator");
    assert_eq!(r["transport"], "tcp");
    let points = r["points"].as_array().unwrap();
    assert_eq!(points.len(), 8, "2 ops × 2 sizes × 2 thread counts: {r}");
    for op in ["write", "read"] {
        assert_eq!(points.iter().filter(|p| p["op"] == op).count(), 4, "{r}");
    }
    for p in points {
        let runs = p["gb_per_s_runs"].as_array().unwrap();
        assert_eq!(runs.len(), 3, "{p}");
        let mut v: Vec<f64> = runs.iter().map(|x| x.as_f64().unwrap()).collect();
        v.sort_by(f64::total_cmp);
        assert_eq!(p["gb_per_s"].as_f64().unwrap(), v[1], "the median: {p}");
        assert!(
            p["p999_latency_us"].as_f64() >= p["p99_latency_us"].as_f64(),
            "{p}"
        );
        assert!(p["avg_latency_us"].as_f64().unwrap() > 0.0, "{p}");
        assert_eq!(p["path"], "tcp");
    }
    let svg = std::fs::read_to_string(dir.path().join("r.svg")).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("read scattered batch 8 threads 2"),
        "{svg}"
    );
}

#[test]
fn a_shared_secret_lets_the_initiator_in_and_a_stranger_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (good, bad) = (dir.path().join("secret"), dir.path().join("other"));
    std::fs::write(&good, "the bench's shared secret, 32+ bytes\n").unwrap();
    std::fs::write(&bad, "some other secret, not the shared one\n").unwrap();
    let t = target(&["--secret-file", good.to_str().unwrap()]);
    let sweep = [
        "--block-sizes",
        "4K",
        "--batch",
        "4",
        "--seconds",
        "0.1",
        "--op",
        "write,read",
    ];
    let out = initiator(
        &t,
        &[&sweep[..], &["--secret-file", good.to_str().unwrap()]].concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = initiator(
        &t,
        &[&sweep[..], &["--secret-file", bad.to_str().unwrap()]].concat(),
    );
    assert!(!out.status.success(), "a stranger's bench ran");
}

#[test]
fn a_target_buffer_smaller_than_the_sweep_is_named_before_anything_moves() {
    let t = target(&[]);
    let out = initiator(
        &t,
        &["--block-sizes", "1M", "--batch", "8", "--seconds", "0.1"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--buffer-size"),
        "{err}"
    );
    // The initiator mode needs its target.
    let out = kvferry()
        .args(["bench", "--mode", "initiator"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--target"), "{err}");
}
