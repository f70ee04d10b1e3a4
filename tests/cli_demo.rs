//! End-to-end checks of `kvferry demo`, `serve`/`load` and the file tools, run
//! as a user runs them: the built binary, its JSON output (the counts a
//! run must reach).

use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

mod common;
use common::KillOnDrop;

fn kvferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    c.env("KVFERRY_LOG", "warn");
    c
}

/// Runs `kvferry demo --json` with `args` on a small but real model shape and
/// returns the report.
fn demo(args: &[&str]) -> Value {
    let out = kvferry()
        .args([
            "demo",
            "--json",
            "--model",
            "tiny",
            "--requests",
            "10",
            "--min-tokens",
            "20",
            "--max-tokens",
            "300",
        ])
        .args(args)
        .output()
        .expect("run kvferry");
    assert!(
        out.status.success(),
        "demo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "demo {args:?}: bad JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn n(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("field {key} missing or not a count in {v}"))
}

#[test]
fn demo_verifies_every_load_and_reports_the_contract_fields() {
    let r = demo(&[]);
    for key in [
        "transport",
        "network_transport",
        "transfer_path",
        "requests",
        "verified",
        "mismatch",
        "unverified",
        "failed",
        "recomputed",
        "bytes",
        "seconds",
        "gb_per_s",
        "checksum_seconds",
        "verify_seconds",
        "verify_share_median",
        "verify_share_max",
        "copy_gb_per_s",
    ] {
        assert!(r.get(key).is_some(), "field {key} missing in {r}");
    }
    let share = |k: &str| r[k].as_f64().unwrap();
    assert!(
        0.0 < share("verify_share_median")
            && share("verify_share_median") <= share("verify_share_max")
            && share("verify_share_max") <= 1.0,
        "{r}"
    );
    assert!(share("verify_seconds") <= share("checksum_seconds"), "{r}");
    assert!(share("copy_gb_per_s") > 0.0, "{r}");
    assert_eq!(n(&r, "requests"), 10);
    assert_eq!(n(&r, "verified"), 10);
    assert_eq!(
        (
            n(&r, "mismatch"),
            n(&r, "unverified"),
            n(&r, "failed"),
            n(&r, "recomputed")
        ),
        (0, 0, 0, 0)
    );
    assert!(n(&r, "bytes") > 0);
    assert_eq!(
        r["transport"], "tcp",
        "no RDMA device here: the engine must fall back to TCP"
    );
    // Host memory: what carried the KV is the engines' network transport.
    assert_eq!(r["network_transport"], "tcp", "{r}");
    assert_eq!(r["transfer_path"], r["transport"], "{r}");
    assert_eq!(
        r["memory_paths"],
        serde_json::json!(["host"]),
        "host KV memory is registered in place on both sides"
    );
}

#[test]
fn corrupt_fail_open_reports_mismatches_and_completes_all() {
    let r = demo(&["--corrupt", "3"]);
    assert_eq!(n(&r, "mismatch"), 3);
    assert_eq!(n(&r, "verified"), 7);
    assert_eq!(n(&r, "completed"), 10);
    assert_eq!((n(&r, "failed"), n(&r, "recomputed")), (0, 0));
}

#[test]
fn corrupt_fail_closed_fail_ends_the_corrupted_loads() {
    let r = demo(&[
        "--corrupt",
        "3",
        "--fail-closed",
        "--load-failure-policy",
        "fail",
    ]);
    assert_eq!(n(&r, "failed"), 3);
    assert_eq!(n(&r, "completed"), 7);
    assert_eq!(n(&r, "recomputed"), 0);
}

#[test]
fn corrupt_fail_closed_recompute_restores_the_producers_kv() {
    let r = demo(&[
        "--corrupt",
        "3",
        "--fail-closed",
        "--load-failure-policy",
        "recompute",
    ]);
    assert_eq!(n(&r, "recomputed"), 3);
    assert_eq!(n(&r, "failed"), 0);
    assert_eq!(r["kv_equal_after_recompute"], Value::Bool(true), "{r}");
}

#[test]
fn demo_with_tp2_and_pp2_verifies_and_detects() {
    for ranks in [
        ["--prefill-tp", "2", "--decode-tp", "2"],
        ["--prefill-pp", "2", "--decode-pp", "2"],
    ] {
        let r = demo(&ranks);
        assert_eq!(n(&r, "verified"), 10, "{ranks:?}: {r}");
        let mut args = ranks.to_vec();
        args.extend([
            "--corrupt",
            "2",
            "--fail-closed",
            "--load-failure-policy",
            "fail",
        ]);
        let r = demo(&args);
        assert_eq!(
            (n(&r, "mismatch"), n(&r, "failed")),
            (2, 2),
            "{ranks:?}: {r}"
        );
    }
}

#[test]
fn demo_with_different_tp_and_pp_sizes_verifies_detects_and_recomputes() {
    for ranks in [
        ["--prefill-tp", "2", "--decode-tp", "1"],
        ["--prefill-tp", "1", "--decode-tp", "2"],
        ["--prefill-pp", "2", "--decode-tp", "2"],
    ] {
        let r = demo(&ranks);
        assert_eq!(n(&r, "verified"), 10, "{ranks:?}: {r}");
        let mut args = ranks.to_vec();
        args.extend([
            "--corrupt",
            "3",
            "--fail-closed",
            "--load-failure-policy",
            "recompute",
        ]);
        let r = demo(&args);
        assert_eq!(
            (n(&r, "mismatch"), n(&r, "recomputed"), n(&r, "verified")),
            (3, 3, 7),
            "{ranks:?}: {r}"
        );
        assert_eq!(r["kv_equal_after_recompute"], Value::Bool(true), "{r}");
    }
}

#[test]
fn demo_with_different_block_sizes_verifies_and_flags_the_right_blocks() {
    // Both ratios, with different TP sizes on the two sides: every load verifies by chunk
    // sums; a flipped bit is a mismatch at exactly the consumer blocks of its chunk (the
    // demo counts any other verdict or position list as unexpected and exits 1).
    for (sizes, ranks) in [
        (
            ["--prefill-block-size", "16", "--decode-block-size", "32"],
            ["--prefill-tp", "2", "--decode-tp", "1"],
        ),
        (
            ["--prefill-block-size", "32", "--decode-block-size", "16"],
            ["--prefill-tp", "1", "--decode-tp", "2"],
        ),
    ] {
        let base = [&sizes[..], &ranks[..]].concat();
        let r = demo(&base);
        assert_eq!(n(&r, "verified"), 10, "{base:?}: {r}");
        assert_eq!(
            n(&r, "prefill_block_size") + n(&r, "decode_block_size"),
            48,
            "{r}"
        );
        let r = demo(&[&base[..], &["--corrupt", "4"]].concat());
        assert_eq!(
            (n(&r, "mismatch"), n(&r, "verified"), n(&r, "unexpected")),
            (4, 6, 0),
            "{base:?}: {r}"
        );
        let r = demo(
            &[
                &base[..],
                &[
                    "--corrupt",
                    "3",
                    "--fail-closed",
                    "--load-failure-policy",
                    "recompute",
                ],
            ]
            .concat(),
        );
        assert_eq!(
            (n(&r, "recomputed"), n(&r, "verified")),
            (3, 7),
            "{base:?}: {r}"
        );
        assert_eq!(r["kv_equal_after_recompute"], Value::Bool(true), "{r}");
    }
}

#[test]
fn demo_hybrid_model_moves_every_group_and_verifies_the_attention_groups() {
    // Full attention, sliding window and Mamba-type state: three KV cache groups, with TP and
    // PP sizes that differ between the sides. Every load verifies (the state group is skipped
    // on both sides), the state blocks land, and flipped bits are mismatches at the right group
    // and consumer blocks (the demo counts anything else as unexpected and exits 1).
    for ranks in [
        &["--prefill-tp", "2", "--decode-tp", "1"][..],
        &["--prefill-tp", "1", "--decode-tp", "2", "--prefill-pp", "3"][..],
    ] {
        let base = [&["--model", "tiny-hybrid"][..], ranks].concat();
        let r = demo(&base);
        assert_eq!(n(&r, "verified"), 10, "{ranks:?}: {r}");
        assert_eq!(r["state_landed"], Value::Bool(true), "{r}");
        let r = demo(&[&base[..], &["--corrupt", "10"]].concat());
        assert_eq!(
            (n(&r, "mismatch"), n(&r, "unexpected")),
            (10, 0),
            "{ranks:?}: {r}"
        );
        assert_eq!(r["mismatched_groups"], serde_json::json!([0, 1]), "{r}");
        let r = demo(
            &[
                &base[..],
                &[
                    "--corrupt",
                    "3",
                    "--fail-closed",
                    "--load-failure-policy",
                    "recompute",
                ],
            ]
            .concat(),
        );
        assert_eq!(
            (n(&r, "recomputed"), n(&r, "verified")),
            (3, 7),
            "{ranks:?}: {r}"
        );
        assert_eq!(r["kv_equal_after_recompute"], Value::Bool(true), "{r}");
    }
    // A state group moves only between equal block sizes: refused before any byte moves.
    let out = kvferry()
        .args([
            "demo",
            "--json",
            "--model",
            "tiny-hybrid",
            "--requests",
            "2",
            "--decode-block-size",
            "32",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("state group"));
}

#[test]
fn demo_mla_with_tp2_checks_every_replica() {
    let base = [
        "--model",
        "deepseek-v2-lite",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "2",
        "--requests",
        "4",
        "--max-tokens",
        "200",
    ];
    let r = demo(&base);
    assert_eq!(n(&r, "verified"), 4, "{r}");
    // One flipped bit lands in one rank's copy only; the other copy is intact.
    let mut args = base.to_vec();
    args.extend(["--corrupt", "4"]);
    let r = demo(&args);
    assert_eq!(n(&r, "mismatch"), 4, "{r}");
}

#[test]
fn demo_layouts_all_verify() {
    for layout in ["KV B N H D", "B KV N H D", "B KV H N D", "B H N KV D"] {
        let r = demo(&["--layout", layout, "--requests", "3"]);
        assert_eq!(n(&r, "verified"), 3, "{layout}: {r}");
    }
}

/// With several loads in flight, each corrupted load is caught at exactly its own flipped
/// bit (the demo exits 1 otherwise), and the counts are exact under each policy: flips are
/// armed per request, not in one slot the first landed load would take.
#[test]
fn loads_in_flight_keep_exact_counts_under_every_policy() {
    let base = ["--requests", "12", "--in-flight", "5", "--corrupt", "4"];
    let r = demo(&base);
    assert_eq!(n(&r, "in_flight"), 5, "{r}");
    assert_eq!((n(&r, "verified"), n(&r, "mismatch")), (8, 4), "{r}");
    assert_eq!((n(&r, "completed"), n(&r, "unexpected")), (12, 0), "{r}");
    let fail = demo(
        &[
            &base[..],
            &["--fail-closed", "--load-failure-policy", "fail"],
        ]
        .concat(),
    );
    assert_eq!((n(&fail, "mismatch"), n(&fail, "failed")), (4, 4), "{fail}");
    assert_eq!(n(&fail, "completed"), 8, "{fail}");
    let rec = demo(
        &[
            &base[..],
            &["--fail-closed", "--load-failure-policy", "recompute"],
        ]
        .concat(),
    );
    assert_eq!(
        (n(&rec, "mismatch"), n(&rec, "recomputed")),
        (4, 4),
        "{rec}"
    );
    assert_eq!(rec["kv_equal_after_recompute"], true, "{rec}");
    // Different block sizes: each mismatch names exactly its chunk's blocks, loads in flight.
    let blocks = ["--prefill-block-size", "16", "--decode-block-size", "32"];
    let r = demo(&[&base[..], &blocks[..]].concat());
    assert_eq!((n(&r, "verified"), n(&r, "mismatch")), (8, 4), "{r}");
    // A hybrid model's state blocks land with loads in flight too.
    let h = demo(&["--model", "tiny-hybrid", "--in-flight", "4"]);
    assert_eq!(n(&h, "verified"), 10, "{h}");
    assert_eq!(h["state_landed"], true, "{h}");
}

/// One load in flight is the serial demo; more than the requests is the requests; the
/// report gives each load's latency beside the throughput.
#[test]
fn in_flight_is_reported_with_the_loads_latency() {
    for (asked, want) in [("1", 1), ("64", 10)] {
        let r = demo(&["--in-flight", asked]);
        assert_eq!(n(&r, "in_flight"), want, "{r}");
        assert_eq!(n(&r, "verified"), 10, "{r}");
        let f = |k: &str| {
            r[k].as_f64()
                .unwrap_or_else(|| panic!("{k} missing in {r}"))
        };
        assert!(
            0.0 < f("load_seconds_median") && f("load_seconds_median") <= f("load_seconds_max"),
            "{r}"
        );
        // The load phase's wall time holds every load, so no load is longer than it.
        assert!(f("load_seconds_max") <= f("seconds"), "{r}");
        assert!(n(&r, "runtime_workers") >= 2, "{r}");
    }
}

/// The pools are sized by a memory budget: all the requests in one stage when they fit, more
/// stages (every load still verified, corruptions still caught) under a small `--pool-memory`,
/// and a budget that cannot hold the longest prompt is one usage error naming the flag.
#[test]
fn pools_hold_what_pool_memory_allows_in_stages() {
    let all = demo(&[]);
    assert_eq!(n(&all, "stages"), 1, "{all}");
    // tiny: 32 KiB a block of 16 tokens; the longest of these prompts takes 19 blocks at most.
    let small = demo(&["--pool-memory", "1M", "--corrupt", "3"]);
    assert!(n(&small, "stages") >= 2, "{small}");
    assert_eq!(
        (n(&small, "verified"), n(&small, "mismatch")),
        (7, 3),
        "{small}"
    );
    assert_eq!(n(&small, "bytes"), n(&all, "bytes"), "{small}");
    let out = kvferry()
        .args(["demo", "--json", "--model", "tiny", "--requests", "10"])
        .args(["--max-tokens", "300", "--pool-memory", "300K"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("more than the 307200 bytes its pool may hold (--pool-memory)")
            && err.contains("--max-tokens 300"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// A prompt of more blocks than a load request may name, or whose load would grant more byte
/// ranges than a grant holds, is refused up front, once, not load after load (the run would
/// otherwise prefill every request and fail each).
#[test]
fn a_prompt_past_a_load_requests_blocks_is_one_usage_error() {
    let out = kvferry()
        .args(["demo", "--json", "--model", "tiny", "--requests", "2"])
        .args(["--block-size", "1", "--min-tokens", "1100000"])
        .args(["--max-tokens", "1100000", "--pool-memory", "8G"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--max-tokens 1100000 in blocks of 1")
            && err.contains("a load request names at most 1048576 blocks"),
        "{err}"
    );
    // Fewer blocks, but each of tiny's 4 layers grants K and V apart: 1.6M ranges a load, on
    // engines with a secret (an open engine checks no grant, and the consumer makes none).
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "the shared secret of the demo's sides\n").unwrap();
    let out = kvferry()
        .args(["demo", "--json", "--model", "tiny", "--requests", "2"])
        .args(["--secret-file", secret.to_str().unwrap()])
        .args(["--block-size", "1", "--min-tokens", "200000"])
        .args(["--max-tokens", "200000", "--pool-memory", "8G"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--max-tokens 200000: the longest prompt's load is too large")
            && err.contains("1600000 ranges, more than the 1048576"),
        "{err}"
    );
    assert!(!err.contains("load failed"), "{err}");
}

#[test]
fn demo_rejects_bad_arguments_with_a_clear_error() {
    for (args, needle) in [
        (vec!["--model", "gpt-9"], "possible values: qwen3-0.6b"),
        (vec!["--corrupt", "11"], "--corrupt"),
        (vec!["--min-tokens", "0"], "--min-tokens"),
        (vec!["--prefill-tp", "3"], "TP"),
        // The message names the side whose sizes are wrong.
        (vec!["--decode-tp", "3"], "--decode-tp"),
        (vec!["--prefill-pp", "5"], "--prefill-pp"),
        (vec!["--data-host", "0.0.0.0"], "can reach"),
        (vec!["--layout", "KV B N Q D"], "Q"),
        (vec!["--gpu-registration", "sideways"], "--gpu-registration"),
        (vec!["--decode-block-size", "0"], "--decode-block-size"),
        (vec!["--in-flight", "0"], "--in-flight"),
        (vec!["--in-flight", "65"], "--in-flight"),
        (vec!["--in-flight", "many"], "--in-flight"),
        // 4 in flight of 2^62 + 1 blocks: 2^64 + 5 blocks, refused (not wrapped to 5).
        (
            vec![
                "--block-size",
                "1",
                "--min-tokens",
                "4611686018427387905",
                "--max-tokens",
                "4611686018427387905",
            ],
            "too large",
        ),
        (
            vec!["--prefill-block-size", "3", "--decode-block-size", "7"],
            "--prefill-block-size 3 / --decode-block-size 7",
        ),
    ] {
        let out = kvferry()
            .args(["demo", "--json", "--model", "tiny", "--requests", "10"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(needle),
            "{args:?}: error should mention {needle:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A TCP port on `host` that was free a moment ago.
fn free_port(host: &str) -> u16 {
    let l = std::net::TcpListener::bind((host, 0)).unwrap();
    l.local_addr().unwrap().port()
}

/// Starts `kvferry serve --bind ADDR ARGS...` (stderr kept for [`stderr_of`]) and gives it
/// a moment to bind; the consumer also retries within its deadline while it starts. Killed
/// when dropped, so a failing assertion leaves no `serve` behind.
fn spawn_serve(addr: &str, args: &[&str]) -> KillOnDrop {
    let child = kvferry()
        .args(["serve", "--bind", addr])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = KillOnDrop(child);
    wait_listening(&mut server, addr);
    server
}

/// Returns once `addr` accepts a TCP connection (the serve process has bound its control
/// port), or the process has exited, or 30 s have passed; for port 0 (an address nobody can
/// connect to) after a fixed 500 ms. A fixed sleep alone raced a slow start on a loaded
/// machine: the load's connect then timed out against a producer that was still setting up.
fn wait_listening(server: &mut Child, addr: &str) {
    let Ok(target) = addr.parse::<std::net::SocketAddr>() else {
        std::thread::sleep(Duration::from_millis(500));
        return;
    };
    if target.port() == 0 {
        std::thread::sleep(Duration::from_millis(500));
        return;
    }
    for _ in 0..300 {
        if server.try_wait().unwrap().is_some() {
            return;
        }
        if std::net::TcpStream::connect_timeout(&target, Duration::from_millis(100)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs `kvferry load --json --producer ADDR ARGS...` to its end.
fn run_load(addr: &str, args: &[&str]) -> Output {
    kvferry()
        .args(["load", "--json", "--producer", addr])
        .args(args)
        .output()
        .unwrap()
}

/// The stderr of a finished child started with a piped stderr.
fn stderr_of(child: &mut Child) -> String {
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut err).unwrap();
    }
    err
}

/// Waits for `child` at most `secs` seconds; kills it and returns None when it is still running.
fn wait_at_most(child: &mut Child, secs: u64) -> Option<ExitStatus> {
    for _ in 0..secs * 10 {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

#[test]
fn serve_and_load_as_two_processes() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = [
        "--model",
        "tiny",
        "--requests",
        "5",
        "--min-tokens",
        "20",
        "--max-tokens",
        "200",
        "--seed",
        "7",
    ];
    // The two sides need not have the same TP and PP sizes.
    let mut server = spawn_serve(
        &addr,
        &[&common[..], &["--exit-after", "5", "--tp", "2"]].concat(),
    );
    let out = run_load(&addr, &[&common[..], &["--pp", "2"]].concat());
    let status = wait_at_most(&mut server, 30).expect("serve did not exit");
    assert!(
        out.status.success(),
        "load failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "serve failed: {}", stderr_of(&mut server));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(n(&r, "verified"), 5, "{r}");
    // The session was opened before the first load, outside the loads' time.
    let connect = r["connect_seconds"].as_f64().unwrap_or(0.0);
    assert!(connect > 0.0, "{r}");
    // What carried the KV, as the producer's FINISHes name it, and this side's memory.
    assert_eq!(r["transport"], "tcp", "{r}");
    assert_eq!(r["network_transport"], "tcp", "{r}");
    assert_eq!(r["memory_paths"], serde_json::json!(["host"]), "{r}");
}

/// A load with the wrong --model is refused before any byte moves, and leaves the producer's
/// requests for a load with the right one: both loads' requests are the same, and serve ends
/// having served every one, none failed.
#[test]
fn a_load_with_the_wrong_model_leaves_the_requests_for_a_right_one() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = ["--requests", "2", "--max-tokens", "100", "--seed", "3"];
    let mut server = spawn_serve(
        &addr,
        &[&common[..], &["--model", "tiny", "--exit-after", "2"]].concat(),
    );
    let wrong = run_load(&addr, &[&common[..], &["--model", "tiny-hybrid"]].concat());
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(!wrong.status.success(), "{err}");
    assert!(err.contains("nothing written"), "{err}");
    let right = run_load(&addr, &[&common[..], &["--model", "tiny"]].concat());
    assert!(
        right.status.success(),
        "{}",
        String::from_utf8_lossy(&right.stderr)
    );
    let r: Value = serde_json::from_slice(&right.stdout).unwrap();
    assert_eq!(n(&r, "verified"), 2, "{r}");
    let status = wait_at_most(&mut server, 30).expect("serve did not exit");
    let err = stderr_of(&mut server);
    assert!(status.success(), "{err}");
    assert!(err.contains("2 loads served, 0 failed"), "{err}");
}

/// A load whose options replay other prompts than serve's (here: more requests) stops at the
/// first refusal instead of waiting for each request serve never published.
#[test]
fn a_load_with_other_prompts_stops_at_the_first_refusal() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = ["--model", "tiny", "--max-tokens", "100", "--timeout", "6"];
    let _server = spawn_serve(&addr, &[&common[..], &["--requests", "2"]].concat());
    let out = run_load(&addr, &[&common[..], &["--requests", "4"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("replay different prompts")
            && err.contains("the other 3 requests not tried")
            && !err.contains("req-1:"),
        "{err}"
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(n(&r, "failed"), 4, "{r}");
}

/// A load against a port where nothing listens says the connection was refused and asks
/// whether serve runs there (once), instead of only that connecting timed out.
#[test]
fn a_load_with_no_producer_listening_says_the_connection_was_refused() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    // The second load is refused at once (the connect failed moments ago): it says so
    // briefly, without the cause and its advice again.
    let out = run_load(
        &addr,
        &["--model", "tiny", "--requests", "2", "--timeout", "2"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("connection refused by {addr}")) && err.contains("kvferry serve"),
        "{err}"
    );
    // Once: the message asks it, so no hint line under it asks again.
    assert_eq!(err.matches("kvferry serve").count(), 1, "{err}");
    assert!(err.contains("req-1: not tried"), "{err}");
}

/// A producer that starts listening while the load is connecting is still waited for: the
/// refusals seen before it listened do not end the connect early, and the retries between them
/// stay short (it listens 3.5 s into the load's 5 s connect timeout: a backoff that doubled
/// without a short cap slept from 3.2 s to 6.4 s and missed it).
#[test]
fn a_load_started_before_its_producer_connects_once_it_listens() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = [
        "--model",
        "tiny",
        "--requests",
        "2",
        "--max-tokens",
        "100",
        "--timeout",
        "30",
    ];
    let load = kvferry()
        .args(["load", "--json", "--producer", &addr])
        .args(common)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut load = KillOnDrop(load);
    std::thread::sleep(Duration::from_millis(3500));
    let mut server = spawn_serve(&addr, &[&common[..], &["--exit-after", "2"]].concat());
    let status = wait_at_most(&mut load, 60).expect("load still running after 60 s");
    let err = stderr_of(&mut load);
    assert!(status.success(), "load failed: {err}");
    assert!(wait_at_most(&mut server, 30).is_some_and(|s| s.success()));
}

#[test]
fn serve_and_load_with_different_block_sizes_verify() {
    // The producer runs 32-token blocks, the consumer 16 (and TP 2 against TP 1): the load
    // side replays the producer's tables with --producer-block-size.
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = [
        "--model",
        "tiny",
        "--requests",
        "4",
        "--min-tokens",
        "20",
        "--max-tokens",
        "200",
        "--seed",
        "5",
    ];
    let mut server = spawn_serve(
        &addr,
        &[&common[..], &["--exit-after", "4", "--block-size", "32"]].concat(),
    );
    let out = run_load(
        &addr,
        &[
            &common[..],
            &[
                "--block-size",
                "16",
                "--producer-block-size",
                "32",
                "--tp",
                "2",
            ],
        ]
        .concat(),
    );
    let status = wait_at_most(&mut server, 30).expect("serve did not exit");
    assert!(
        out.status.success(),
        "load failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "serve failed: {}", stderr_of(&mut server));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(n(&r, "verified"), 4, "{r}");
}

#[test]
fn serve_and_load_a_hybrid_model() {
    // Three KV cache groups (full, sliding window, state) between TP 2 and TP 1.
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = [
        "--model",
        "tiny-hybrid",
        "--requests",
        "4",
        "--min-tokens",
        "20",
        "--max-tokens",
        "200",
        "--seed",
        "6",
    ];
    let mut server = spawn_serve(
        &addr,
        &[&common[..], &["--exit-after", "4", "--tp", "2"]].concat(),
    );
    let out = run_load(&addr, &common);
    let status = wait_at_most(&mut server, 30).expect("serve did not exit");
    assert!(
        out.status.success(),
        "load failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "serve failed: {}", stderr_of(&mut server));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(n(&r, "verified"), 4, "{r}");
}

#[test]
fn a_timeout_below_the_producers_default_transfer_deadline_still_verifies() {
    // The producer's transfer deadline follows --timeout (it was a fixed 30 s, so every
    // load under a shorter --timeout was refused).
    let r = demo(&["--timeout", "5", "--requests", "3"]);
    assert_eq!(n(&r, "verified"), 3, "{r}");
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = [
        "--model",
        "tiny",
        "--requests",
        "2",
        "--max-tokens",
        "200",
        "--timeout",
        "8",
    ];
    let mut server = spawn_serve(&addr, &[&common[..], &["--exit-after", "2"]].concat());
    let out = run_load(&addr, &common);
    let served = wait_at_most(&mut server, 30);
    assert!(
        out.status.success(),
        "load failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        served.is_some_and(|s| s.success()),
        "serve did not exit cleanly: {}",
        stderr_of(&mut server)
    );
}

#[test]
fn serve_and_load_name_reachable_transfer_engines() {
    // The producer WRITEs to the consumer's engines by their segment names: away from
    // loopback they must name the address the two processes talk on, not 127.0.0.1.
    // 127.0.0.2 and .3 stand for two machines' addresses (Linux routes 127/8 to loopback).
    // serve's engines default to the --bind host; load's are named by --data-host here
    // (its default, the local address routing to the producer, is 127.0.0.1 on loopback).
    let addr = format!("127.0.0.2:{}", free_port("127.0.0.2"));
    let common = [
        "--model",
        "tiny",
        "--requests",
        "2",
        "--max-tokens",
        "200",
        "--log",
        "info",
    ];
    let mut server = spawn_serve(&addr, &[&common[..], &["--exit-after", "2"]].concat());
    let out = run_load(
        &addr,
        &[&common[..], &["--data-host", "127.0.0.3"]].concat(),
    );
    let status = wait_at_most(&mut server, 30).expect("serve did not exit");
    let serve_err = stderr_of(&mut server);
    let load_err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "load failed: {load_err}");
    assert!(status.success(), "serve failed: {serve_err}");
    assert!(load_err.contains("segment=127.0.0.3:"), "{load_err}");
    assert!(serve_err.contains("segment=127.0.0.2:"), "{serve_err}");
    assert!(!load_err.contains("segment=127.0.0.1:"), "{load_err}");
}

#[test]
fn serve_refuses_an_exit_after_it_could_never_reach() {
    // Each request is loaded at most once: with --exit-after above --requests serve
    // would wait forever.
    let args = ["--model", "tiny", "--requests", "2", "--max-tokens", "100"];
    let mut server = spawn_serve("127.0.0.1:0", &[&args[..], &["--exit-after", "3"]].concat());
    let status = wait_at_most(&mut server, 20).expect("serve still running after 20 s");
    let err = stderr_of(&mut server);
    assert!(!status.success(), "serve should refuse: {err}");
    assert!(err.contains("--exit-after 3"), "{err}");
}

/// Loads the producer refuses (another layout) leave the requests held, but only for their
/// lease: serve then counts them expired, not served nor failed.
#[test]
fn serve_summary_counts_requests_only_refused_as_expired_at_their_lease() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = [
        "--model",
        "tiny",
        "--requests",
        "2",
        "--min-tokens",
        "20",
        "--max-tokens",
        "200",
    ];
    let layout = |l: &'static str| [&common[..], &["--layout", l]].concat();
    let mut server = spawn_serve(
        &addr,
        &[
            &layout("KV B N H D")[..],
            &["--exit-after", "2", "--lease", "3"],
        ]
        .concat(),
    );
    // Another layout: the producer refuses every load.
    let out = run_load(&addr, &layout("B KV H N D"));
    assert!(!out.status.success());
    let status = wait_at_most(&mut server, 30).expect("serve did not exit");
    let err = stderr_of(&mut server);
    assert!(status.success(), "{err}");
    assert!(
        err.contains("0 loads served, 0 failed, 2 expired unloaded"),
        "{err}"
    );
}

#[test]
fn bad_durations_and_rank_counts_are_refused_without_panic() {
    for args in [
        vec!["demo", "--timeout=-1"],
        vec!["demo", "--timeout", "nan"],
        vec!["demo", "--timeout", "0"],
        vec!["demo", "--timeout", "1e300"],
        vec!["demo", "--prefill-tp", "100000", "--decode-tp", "100000"],
        vec!["bench", "--seconds", "1e300"],
        vec!["--log", "[[[", "demo"],
    ] {
        let out = kvferry().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should be refused");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Zero requests is a run that does nothing and reports success: refused when parsing, as
/// `--in-flight 0` is, by every command that takes `--requests` (waited for at most 20 s, so
/// a serve that accepted it and started serving fails the test instead of hanging it).
#[test]
fn zero_requests_are_refused_by_demo_serve_and_load() {
    for args in [
        vec!["demo", "--model", "tiny", "--requests", "0"],
        vec![
            "serve",
            "--model",
            "tiny",
            "--bind",
            "127.0.0.1:0",
            "--requests",
            "0",
        ],
        vec![
            "load",
            "--model",
            "tiny",
            "--producer",
            "127.0.0.1:1",
            "--timeout",
            "5",
            "--requests",
            "0",
        ],
    ] {
        let child = kvferry()
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut child = KillOnDrop(child);
        let status = wait_at_most(&mut child, 20);
        let err = stderr_of(&mut child);
        assert!(
            status.is_some_and(|s| !s.success()),
            "{args:?} should be refused: {status:?} {err}"
        );
        assert!(err.contains("--requests"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn payload_encode_decode_round_trip_and_junk_is_an_error() {
    let json = r#"{"version":1,"tp_size":2,"num_tokens":40,"groups":[{"group_id":0,"fingerprint":"0x0000000000000001","block_size":16,"start":0,"values":["0x0000000000000002","0xffffffffffffffff","0x00000000000000aa"]}]}"#;
    let run = |args: &[&str], input: &str| {
        let mut child = kvferry()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let enc = run(&["payload", "encode"], json);
    assert!(
        enc.status.success(),
        "{}",
        String::from_utf8_lossy(&enc.stderr)
    );
    let b64 = String::from_utf8(enc.stdout).unwrap();
    let dec = run(&["payload", "decode"], &b64);
    assert!(
        dec.status.success(),
        "{}",
        String::from_utf8_lossy(&dec.stderr)
    );
    let back: Value = serde_json::from_slice(&dec.stdout).unwrap();
    assert_eq!(back, serde_json::from_str::<Value>(json).unwrap());
    for junk in [
        "",
        "hello!!",
        "AAAA",
        "lAEBKJGVAM8SNFZ4kKvN7xAAxBgBAAAAAAAAAAIAAAAAAAAAAwAAAAAAAA",
    ] {
        let out = run(&["payload", "decode"], junk);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{junk:?} decoded: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            !err.contains("panicked") && err.contains("error"),
            "{junk:?}: {err}"
        );
    }
    let out = run(&["payload", "encode"], r#"{"version":1}"#);
    assert!(!out.status.success());
}

#[test]
fn checksum_spec_command_prints_the_definitions_values_and_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    // KV B N H D with B=4, N=16, H=2, D=8, bf16: 2*4*16*2*8*2 bytes of arbitrary data.
    let bytes: Vec<u8> = (0..2 * 4 * 16 * 2 * 8 * 2u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(dir.path().join("l7.bin"), &bytes).unwrap();
    let spec = r#"{"num_tokens": 40, "groups": [{"group_id": 0, "block_size": 16, "start": 0, "block_ids": [3, 1, 2],
        "layers": [{"name": "model.layers.7.self_attn.attn", "path": "l7.bin", "layout": "KV B N H D",
                    "dims": {"B": 4, "N": 16, "H": 2, "D": 8}, "elem_bytes": 2, "kernel_blocks": 1, "head_offset": 0,
                    "kind": "FullAttentionSpec", "dtype": "torch.bfloat16"}]}]}"#;
    let path = dir.path().join("spec.json");
    std::fs::write(&path, spec).unwrap();
    let out = kvferry()
        .args(["checksum", "--spec"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got, kvferry::spec::checksum_spec(&path).unwrap());
    let values = got["groups"][0]["values"].as_array().unwrap();
    assert_eq!(values.len(), 3);
    assert!(
        values.iter().all(|v| v.as_str().unwrap().len() == 18),
        "{got}"
    );
    assert!(got["groups"][0]["fingerprint"].is_string());
    // A file of the wrong size is an error naming the field.
    std::fs::write(dir.path().join("l7.bin"), &bytes[1..]).unwrap();
    let out = kvferry()
        .args(["checksum", "--spec"])
        .arg(&path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("path"), "{err}");
}

#[test]
fn bench_moves_contiguous_and_scattered_batches_and_checks_what_landed() {
    for pattern in ["contiguous", "scattered"] {
        let out = kvferry()
            .args(["bench", "--transport", "tcp", "--block-sizes", "1K,64K"])
            .args(["--batch", "1,32", "--seconds", "0.3", "--json"])
            .args(["--pattern", pattern])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{pattern}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        let points = r["points"].as_array().unwrap();
        assert_eq!(points.len(), 4, "{r}");
        for p in points {
            assert_eq!(p["pattern"], pattern, "{p}");
            assert!(n(p, "batches") > 0, "{p}");
        }
    }
}

#[test]
fn bench_points_run_at_least_min_batches_and_at_most_max_batches() {
    // A point whose seconds pass before its first batch ends still runs --min-batches.
    let out = kvferry()
        .args(["bench", "--transport", "tcp", "--block-sizes", "4K"])
        .args([
            "--batch",
            "2",
            "--seconds",
            "0.001",
            "--min-batches",
            "5",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(n(&r["points"][0], "batches") >= 5, "{r}");
    // --max-batches ends a point at its count (here long before its 600 s).
    let out = kvferry()
        .args([
            "bench",
            "--transport",
            "tcp",
            "--block-sizes",
            "4K",
            "--batch",
            "2",
        ])
        .args([
            "--threads",
            "2",
            "--seconds",
            "600",
            "--max-batches",
            "3",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(n(&r["points"][0], "batches"), 6, "3 per thread: {r}");
    let out = kvferry()
        .args([
            "bench",
            "--transport",
            "tcp",
            "--min-batches",
            "4",
            "--max-batches",
            "2",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--max-batches"),
        "{err}"
    );
}

#[test]
fn serve_and_load_with_a_shared_secret_and_a_stranger_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let (good, bad) = (dir.path().join("secret"), dir.path().join("other"));
    std::fs::write(&good, "the shared secret of serve and load\n").unwrap();
    std::fs::write(&bad, "some other secret, not the shared one\n").unwrap();
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = [
        "--model",
        "tiny",
        "--requests",
        "2",
        "--min-tokens",
        "20",
        "--max-tokens",
        "200",
        "--seed",
        "7",
        "--transport",
        "tcp",
    ];
    let secret = ["--secret-file", good.to_str().unwrap()];
    let mut server = spawn_serve(
        &addr,
        &[&common[..], &secret, &["--exit-after", "2"]].concat(),
    );
    // Without the secret, or with another one: no request can be loaded, none is consumed
    // (the producer refuses a request that does not prove the secret; a consumer with another
    // one refuses the producer, whose proof does not check, and sends it nothing).
    for extra in [&[][..], &["--secret-file", bad.to_str().unwrap()][..]] {
        let out = run_load(&addr, &[&common[..], extra].concat());
        assert!(!out.status.success());
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!((n(&r, "verified"), n(&r, "failed")), (0, 2), "{r}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("prove the shared secret"), "{err}");
    }
    // The secret's holder loads both (the env var works as --secret-file).
    let out = kvferry()
        .args(["load", "--json", "--producer", &addr])
        .args(common)
        .env("KVFERRY_SECRET_FILE", &good)
        .output()
        .unwrap();
    let status = wait_at_most(&mut server, 30).expect("serve did not exit");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = stderr_of(&mut server);
    assert!(status.success(), "serve failed: {err}");
    assert!(err.contains("authenticated (shared secret)"), "{err}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(n(&r, "verified"), 2, "{r}");
}

#[test]
fn a_load_with_other_requests_names_the_options_serve_and_load_share() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = [
        "--model",
        "tiny",
        "--min-tokens",
        "20",
        "--max-tokens",
        "300",
    ];
    let mut server = spawn_serve(
        &addr,
        &[&common[..], &["--requests", "6", "--exit-after", "1"]].concat(),
    );
    // Fewer requests than serve published: every one exists, but the block tables differ.
    let out = run_load(&addr, &[&common[..], &["--requests", "4"]].concat());
    let _ = server.kill();
    let _ = server.wait();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("serve and load replay different prompts")
            && err.contains("--seed, --requests")
            && err.contains("this side: --seed 1 --requests 4"),
        "{err}"
    );
}

#[test]
fn serve_on_a_busy_port_fails_before_generating_kv_and_names_bind() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let out = kvferry()
        .args([
            "serve",
            "--bind",
            &addr,
            "--model",
            "tiny",
            "--requests",
            "4",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("--bind {addr}")), "{err}");
    assert!(
        !err.contains("generating"),
        "failed after generating KV: {err}"
    );
}

#[test]
fn device_and_transport_errors_name_their_own_option_not_the_side_sizes() {
    for args in [&["--transport", "rdma"][..], &["--device", "cuda"][..]] {
        let out = kvferry()
            .args(["demo", "--model", "tiny", "--requests", "1"])
            .args(args)
            .output()
            .unwrap();
        if out.status.success() {
            continue; // this machine has the device: nothing to check
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !err.contains("--prefill-tp") && !err.contains("--decode-tp"),
            "{args:?}: {err}"
        );
    }
    // A size error still names the side whose options caused it.
    let out = kvferry()
        .args([
            "demo",
            "--model",
            "tiny",
            "--requests",
            "1",
            "--prefill-tp",
            "3",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--prefill-tp"));
}

#[test]
fn a_load_with_another_seed_is_told_which_option_differs() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = ["--model", "tiny", "--requests", "2", "--max-tokens", "200"];
    let mut server = spawn_serve(&addr, &[&common[..], &["--seed", "7"]].concat());
    let out = run_load(&addr, &[&common[..], &["--seed", "8"]].concat());
    let _ = server.kill();
    let _ = server.wait();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("load key wrong"), "{err}");
    assert_eq!(
        err.matches(
            "derived from --seed 8 (no --secret-file here): serve runs with another --seed"
        )
        .count(),
        1,
        "{err}"
    );
}

/// A run of `n` TCP ports on 127.0.0.1 that were free a moment ago: `"LO-HI"` and LO.
fn free_port_range(n: u16) -> (String, u16) {
    loop {
        let lo = free_port("127.0.0.1");
        let Some(hi) = lo.checked_add(n - 1) else {
            continue;
        };
        if (lo..=hi).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return (format!("{lo}-{hi}"), lo);
        }
    }
}

/// The ports of the `segment=HOST:PORT` fields in an info log.
fn segment_ports(log: &str) -> Vec<u16> {
    log.split("segment=")
        .skip(1)
        .filter_map(|s| {
            let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || ".:[]".contains(c)))?;
            s[..end].rsplit_once(':')?.1.parse().ok()
        })
        .collect()
}

#[test]
fn serve_and_load_bind_their_transfer_engines_in_the_engine_ports_range() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let common = [
        "--model",
        "tiny",
        "--requests",
        "2",
        "--max-tokens",
        "200",
        "--transport",
        "tcp",
        "--log",
        "info",
    ];
    let ((serve_range, s_lo), (load_range, l_lo)) = (free_port_range(8), free_port_range(8));
    let mut server = spawn_serve(
        &addr,
        &[
            &common[..],
            &[
                "--exit-after",
                "2",
                "--tp",
                "2",
                "--engine-ports",
                &serve_range,
            ],
        ]
        .concat(),
    );
    let out = run_load(
        &addr,
        &[&common[..], &["--engine-ports", &load_range]].concat(),
    );
    let status = wait_at_most(&mut server, 30).expect("serve did not exit");
    let serve_err = stderr_of(&mut server);
    let load_err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "load failed: {load_err}");
    assert!(status.success(), "serve failed: {serve_err}");
    // Two engines (TP 2) on serve's side, one on load's: each handshake port in its range.
    let (s, l) = (segment_ports(&serve_err), segment_ports(&load_err));
    assert!(
        s.len() >= 2 && s.iter().all(|p| (s_lo..s_lo + 8).contains(p)),
        "{s:?} {serve_err}"
    );
    assert!(
        !l.is_empty() && l.iter().all(|p| (l_lo..l_lo + 8).contains(p)),
        "{l:?} {load_err}"
    );
}

#[test]
fn a_taken_engine_port_range_fails_at_start_naming_the_range() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let range = format!("{port}-{port}");
    let out = kvferry()
        .args([
            "serve",
            "--bind",
            "127.0.0.1:0",
            "--model",
            "tiny",
            "--requests",
            "2",
        ])
        .args(["--engine-ports", &range])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("port range {range} is in use")),
        "{err}"
    );
    assert!(
        !err.contains("generating"),
        "failed after generating KV: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // A malformed range is refused while parsing, naming the option.
    let out = kvferry()
        .args(["demo", "--engine-ports", "20010-20000"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--engine-ports") && err.contains("LO-HI"),
        "{err}"
    );
}

#[test]
fn serve_logs_why_it_refused_a_load() {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    // A 4 s timeout: a request serve never published waits 2 s (a transfer may take half).
    let common = ["--model", "tiny", "--max-tokens", "200", "--timeout", "4"];
    let mut server = spawn_serve(
        &addr,
        &[&common[..], &["--requests", "2", "--seed", "7"]].concat(),
    );
    // Another seed: the same request ids, keys derived from another seed, and a request serve
    // never published (req-2). (A load with serve's seed and another --requests would stop at
    // its first request: other prompts, other block tables.)
    let out = run_load(
        &addr,
        &[&common[..], &["--requests", "3", "--seed", "8"]].concat(),
    );
    assert!(!out.status.success());
    let _ = server.kill();
    let _ = server.wait();
    let err = stderr_of(&mut server);
    assert!(
        err.contains("the load key it proves is not its lease's"),
        "serve should log the wrong key: {err}"
    );
    assert!(
        err.contains("\"req-2\": not published here"),
        "serve should log the unknown request: {err}"
    );
}
