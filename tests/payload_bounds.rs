//! `kvferry payload decode` holds memory within a small multiple of its input (unbounded, 60 MB
//! of 3 million tiny groups took 5.9 GB). The CLI runs as a child; its peak RSS comes from
//! `wait4`'s rusage of that child alone.

use std::io::Write;
use std::process::{Command, Stdio};

use base64::Engine as _;
use kvferry_checksum::payload::{Payload, PayloadGroup};

/// Runs `kvferry payload decode` on `stdin`; returns (success, stdout, stderr, peak RSS bytes).
#[allow(clippy::zombie_processes)] // reaped by wait4 below, which std cannot see
fn decode(stdin: &str) -> (bool, Vec<u8>, String, u64) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["payload", "decode"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let text = stdin.to_string();
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(text.as_bytes());
    });
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut b).unwrap();
        b
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut err, &mut s).unwrap();
        s
    });
    let mut status = 0;
    // SAFETY: rusage is plain data; wait4 reaps exactly this child (std never waits for it).
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    // SAFETY: `pid` is our child; `status` and `usage` are live locals wait4 writes.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    writer.join().unwrap();
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    // ru_maxrss is in KiB on Linux.
    (
        ok,
        reader.join().unwrap(),
        err_reader.join().unwrap(),
        usage.ru_maxrss as u64 * 1024,
    )
}

/// msgpack of a version-1 payload with `n` groups of one value each (20 bytes a group).
fn tiny_groups(n: u32) -> Vec<u8> {
    let mut b = vec![0x94, 0x01, 0x01, 0x28, 0xdd];
    b.extend_from_slice(&n.to_be_bytes());
    for i in 0..n {
        b.extend_from_slice(&[0x95, 0x00, 0xce]);
        b.extend_from_slice(&i.to_be_bytes());
        b.extend_from_slice(&[0x10, 0xcc, 0x00, 0xc4, 0x08]);
        b.extend_from_slice(&(i as u64).to_le_bytes());
    }
    b
}

#[test]
fn three_million_tiny_groups_are_refused_in_bounded_memory() {
    let bytes = tiny_groups(3_000_000);
    assert!(bytes.len() >= 60_000_000);
    let text = base64::engine::general_purpose::STANDARD.encode(&bytes);
    let (ok, _out, err, rss) = decode(&text);
    // The text, its bytes and the process itself: a few times the input, not 100×.
    assert!(
        rss < 6 * text.len() as u64,
        "peak RSS {rss} bytes for {} bytes of input",
        text.len()
    );
    assert!(!ok, "a payload of 3 million groups must be refused");
    assert!(err.contains("more than the limit of 4096"), "{err}");
}

#[test]
fn a_large_payload_of_few_groups_decodes_right_in_bounded_memory() {
    let p = Payload {
        version: 1,
        tp_size: 2,
        num_tokens: 1 << 24,
        groups: (0..4u32)
            .map(|g| PayloadGroup {
                group_id: g,
                fingerprint: 0x1234_5678_9abc_def0 ^ g as u64,
                block_size: 16,
                start: g as u64,
                values: (0..500_000u64)
                    .map(|v| v.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ g as u64)
                    .collect(),
            })
            .collect(),
    };
    let text = p.to_base64();
    let (ok, out, err, rss) = decode(&text);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["groups"].as_array().unwrap().len(), 4);
    for (g, jg) in p.groups.iter().zip(v["groups"].as_array().unwrap()) {
        let values = jg["values"].as_array().unwrap();
        assert_eq!(values.len(), g.values.len());
        for i in [0, 1, 250_000, 499_999] {
            assert_eq!(values[i], format!("0x{:016x}", g.values[i]));
        }
    }
    // A JSON tree of 2 million values took over 200 MB; streamed output holds none of it.
    assert!(
        rss < 8 * text.len() as u64,
        "peak RSS {rss} bytes for {} bytes of input",
        text.len()
    );
}
