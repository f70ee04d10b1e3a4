//! `kvferry doctor --json` on this machine: the facts it reports agree with the node (the
//! transport the engine takes, the limits getrlimit gives, the secret file's mode), and each
//! problem it finds here comes with its fix.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

fn doctor(args: &[&str], nofile: Option<u64>) -> (i32, serde_json::Value) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    c.arg("doctor").arg("--json").args(args);
    c.env_remove("KVFERRY_SECRET_FILE")
        .env("KVFERRY_LOG", "warn");
    if let Some(n) = nofile {
        // SAFETY: setrlimit is async-signal-safe and touches only the child.
        unsafe {
            c.pre_exec(move || {
                let r = libc::rlimit {
                    rlim_cur: n,
                    rlim_max: n,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let out = c.output().expect("run kvferry doctor");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor --json printed no JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), v)
}

fn keys(v: &serde_json::Value) -> Vec<String> {
    v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["key"].as_str().unwrap().to_string())
        .collect()
}

fn problem<'a>(v: &'a serde_json::Value, key: &str) -> &'a serde_json::Value {
    v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["key"] == key)
        .unwrap_or_else(|| panic!("no problem {key} in {v:#}"))
}

#[test]
fn facts_agree_with_this_node() {
    let (rc, v) = doctor(&["--kv-bytes", "1G"], None);
    assert_eq!(v["rdma_built"], cfg!(feature = "rdma"), "{v:#}");
    assert_eq!(v["rdma"]["built"], cfg!(feature = "rdma"));
    // The host path is the engine's own choice: RDMA only where a device was chosen.
    let rdma_usable = v["rdma"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .any(|d| !d["chosen"].is_null());
    let host = &v["host_path"];
    assert_eq!(host["transport"], if rdma_usable { "rdma" } else { "tcp" });
    assert!(host["why"].as_str().unwrap().starts_with("auto:"), "{host}");
    assert_eq!(host["registration"], "host");
    if !rdma_usable {
        assert!(
            v["rdma"]["devices"].as_array().unwrap().is_empty()
                || v["rdma"]["devices"][0]["unusable"].is_string()
        );
    }
    if !cfg!(feature = "rdma") {
        assert!(host["why"].as_str().unwrap().contains("no RDMA transport"));
        assert!(v["rdma"]["list_error"].is_string());
    }
    // No GPU here means no GPU path and the driver's reason.
    if v["gpu"]["devices"].as_array().unwrap().is_empty() {
        assert!(v["gpu_path"].is_null());
        assert!(v["gpu"]["driver_error"].is_string());
    } else {
        assert_eq!(v["gpu_path"]["memory"], "cuda:0");
    }
    // The limits are getrlimit's.
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a live rlimit getrlimit writes.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) }, 0);
    let memlock = &v["limits"]["memlock"];
    if r.rlim_cur == libc::RLIM_INFINITY {
        assert!(memlock["soft"].is_null());
    } else {
        assert_eq!(memlock["soft"], r.rlim_cur);
    }
    assert_eq!(v["limits"]["kv_bytes"], 1u64 << 30);
    assert_eq!(memlock["needed"], if rdma_usable { 1u64 << 30 } else { 0 });
    assert!(v["secret_file"].is_null());
    assert_eq!(v["cuda_ipc_transport"], serde_json::Value::Null);
    let errors = v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["severity"] == "error");
    assert_eq!(rc, if errors { 1 } else { 0 }, "{v:#}");
}

#[test]
fn a_low_open_file_limit_is_reported_with_the_number_to_set() {
    let (_, v) = doctor(&["--ranks", "2"], Some(256));
    assert_eq!(v["limits"]["nofile"]["soft"], 256);
    let needed = v["limits"]["nofile"]["needed"].as_u64().unwrap();
    assert!(needed > 256);
    let p = problem(&v, "nofile-low");
    assert!(p["fix"].as_str().unwrap().contains("ulimit -n 2048"), "{p}");
    let (_, v) = doctor(&[], Some(4096));
    assert!(!keys(&v).contains(&"nofile-low".to_string()), "{v:#}");
}

#[test]
fn secret_file_permissions_and_size_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("secret");
    std::fs::write(&path, [7u8; 32]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let p = path.to_str().unwrap();
    let (_, v) = doctor(&["--secret-file", p], None);
    assert_eq!(v["secret_file"]["mode"], "0644");
    assert_eq!(v["secret_file"]["owned_by_me"], true);
    let w = problem(&v, "secret-file-readable");
    assert_eq!(w["severity"], "warning");
    assert_eq!(w["fix"], format!("`chmod 600 {p}`"));

    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (_, v) = doctor(&["--secret-file", p], None);
    assert!(!keys(&v).iter().any(|k| k.starts_with("secret")), "{v:#}");

    // Too short to be a secret: the engines would refuse it, so doctor fails.
    std::fs::write(&path, b"abc").unwrap();
    let (rc, v) = doctor(&["--secret-file", p], None);
    assert_eq!(problem(&v, "secret-file-unusable")["severity"], "error");
    assert_eq!(rc, 1);
}
