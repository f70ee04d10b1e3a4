//! `checksum --spec` end to end: spec files and tensor files written to a temp folder.

use std::io::Write;
use std::path::{Path, PathBuf};

use kvferry_checksum::fingerprint::layer_fingerprint;
use serde_json::{json, Value};

use super::*;

/// Logical KV of one layer: `data[b][n][h][part][d]` elements of `elem` bytes.
struct Logical {
    b: u64,
    n: u64,
    h: u64,
    d: u64,
    parts: u64,
    elem: usize,
    data: Vec<u8>,
}

impl Logical {
    fn new(b: u64, n: u64, h: u64, d: u64, parts: u64, elem: usize, seed: u64) -> Logical {
        let mut z = seed;
        let data = (0..(b * n * h * parts * d) as usize * elem)
            .map(|_| {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (z >> 35) as u8
            })
            .collect();
        Logical {
            b,
            n,
            h,
            d,
            parts,
            elem,
            data,
        }
    }
    fn at(&self, kb: u64, t: u64, h: u64, part: u64, d: u64) -> usize {
        ((((kb * self.n + t) * self.h + h) * self.parts + part) * self.d + d) as usize * self.elem
    }
    /// C-contiguous bytes in `layout` order.
    fn write(&self, layout: &str) -> Vec<u8> {
        let names: Vec<&str> = layout.split_whitespace().collect();
        let size = |n: &str| match n {
            "KV" => 2,
            "B" => self.b,
            "N" => self.n,
            "H" => self.h,
            _ => self.d,
        };
        let mut out = vec![0u8; self.data.len()];
        for kb in 0..self.b {
            for t in 0..self.n {
                for h in 0..self.h {
                    for part in 0..self.parts {
                        for d in 0..self.d {
                            let idx = names.iter().fold(0u64, |acc, &nm| {
                                let i = match nm {
                                    "KV" => part,
                                    "B" => kb,
                                    "N" => t,
                                    "H" => h,
                                    _ => d,
                                };
                                acc * size(nm) + i
                            });
                            let (o, s) = (idx as usize * self.elem, self.at(kb, t, h, part, d));
                            out[o..o + self.elem].copy_from_slice(&self.data[s..s + self.elem]);
                        }
                    }
                }
            }
        }
        out
    }
    /// §2.1 by the direct form, from the logical data.
    fn value(
        &self,
        layer: u64,
        head_offset: u64,
        kpb: u64,
        block: u64,
        pos: u64,
        num_tokens: u64,
    ) -> u64 {
        let bs = kpb * self.n;
        let p = self.parts * self.d * self.elem as u64 / 8;
        let mut c = 0u64;
        for h in 0..self.h {
            let mut s = 0u64;
            for t in 0..bs {
                let tok = pos * bs + t;
                if tok >= num_tokens {
                    break;
                }
                let mut cell = Vec::new();
                for part in 0..self.parts {
                    for d in 0..self.d {
                        let a = self.at(block * kpb + t / self.n, t % self.n, h, part, d);
                        cell.extend_from_slice(&self.data[a..a + self.elem]);
                    }
                }
                for (i, piece) in cell.chunks(8).enumerate() {
                    let x = u64::from_le_bytes(piece.try_into().unwrap());
                    s = s.wrapping_add(x.wrapping_mul(2 * (tok * p + i as u64) + 1));
                }
            }
            c = c.wrapping_add((2 * (layer * 65536 + head_offset + h) + 1).wrapping_mul(s));
        }
        c
    }
}

fn npy(shape: &[u64], descr: &str, data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let mut header = format!(
        "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({},), }}",
        dims.join(", ")
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

fn write_spec(dir: &Path, spec: &Value) -> PathBuf {
    let p = dir.join("spec.json");
    std::fs::write(&p, spec.to_string()).unwrap();
    p
}

/// Three layers in three layouts and three file kinds; values against the direct form
/// computed here from the logical KV (independent of the checksum crate).
#[test]
fn spec_values_equal_the_definition() {
    let dir = tempfile::tempdir().unwrap();
    let (b, n, kpb) = (6, 8, 2); // 3 logical blocks of 16 tokens
    let l0 = Logical::new(b, n, 2, 16, 2, 2, 1); // bf16, KV, 2 heads
    let l1 = Logical::new(b, n, 1, 32, 1, 2, 2); // MLA-like latent, 1 head
    let l2 = Logical::new(b, n, 4, 3, 2, 4, 3); // fp32, D·elem = 12: pieces straddle K|V
    std::fs::write(dir.path().join("l0.bin"), l0.write("KV B N H D")).unwrap();
    std::fs::write(
        dir.path().join("l1.npy"),
        npy(&[b, n, 32], "<f2", &l1.write("B N D")),
    )
    .unwrap();
    let l2_bytes = l2.write("B H N KV D");
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::F32,
        vec![6, 4, 8, 2, 3],
        &l2_bytes,
    )
    .unwrap();
    let st = safetensors::tensor::serialize([("layer2", view)], None).unwrap();
    std::fs::write(dir.path().join("kv.safetensors"), st).unwrap();
    let num_tokens = 37;
    let spec = json!({
        "num_tokens": num_tokens,
        "groups": [{"group_id": 5, "block_size": 16, "start": 0, "block_ids": [2, 0, 1], "layers": [
            {"name": "model.layers.0.self_attn.attn", "path": "l0.bin", "layout": "KV B N H D",
             "dims": {"B": 6, "N": 8, "H": 2, "D": 16}, "elem_bytes": 2, "kernel_blocks": 2, "head_offset": 2,
             "kind": "FullAttentionSpec", "dtype": "torch.bfloat16"},
            {"name": "model.layers.7.self_attn.attn", "path": "l1.npy", "layout": "B N D",
             "dims": {"B": 6, "N": 8, "D": 32}, "elem_bytes": 2, "kernel_blocks": 2,
             "kind": "MLAAttentionSpec", "dtype": "torch.bfloat16"},
            {"name": "model.layers.3.self_attn.attn", "path": "kv.safetensors", "tensor": "layer2", "layout": "B H N KV D",
             "dims": {"B": 6, "N": 8, "H": 4, "D": 3}, "elem_bytes": 4, "kernel_blocks": 2, "head_offset": 4,
             "kind": "FullAttentionSpec", "dtype": "torch.float32"}
        ]}]
    });
    let out = checksum_spec(&write_spec(dir.path(), &spec)).unwrap();
    let g = &out["groups"][0];
    for (pos, block) in [2u64, 0, 1].into_iter().enumerate() {
        let pos = pos as u64;
        let want = l0
            .value(0, 2, kpb, block, pos, num_tokens)
            .wrapping_add(l1.value(7, 0, kpb, block, pos, num_tokens))
            .wrapping_add(l2.value(3, 4, kpb, block, pos, num_tokens));
        assert_eq!(
            g["values"][pos as usize],
            json!(format!("0x{want:016x}")),
            "position {pos}"
        );
    }
    let fp = layer_fingerprint(
        "model.layers.0.self_attn.attn",
        "FullAttentionSpec",
        16,
        "torch.bfloat16",
    )
    .wrapping_add(layer_fingerprint(
        "model.layers.7.self_attn.attn",
        "MLAAttentionSpec",
        16,
        "torch.bfloat16",
    ))
    .wrapping_add(layer_fingerprint(
        "model.layers.3.self_attn.attn",
        "FullAttentionSpec",
        16,
        "torch.float32",
    ));
    assert_eq!(g["fingerprint"], json!(format!("0x{fp:016x}")));
    assert_eq!(
        (
            out["num_tokens"].clone(),
            g["group_id"].clone(),
            g["start"].clone()
        ),
        (json!(37), json!(5), json!(0))
    );
}

/// The same spec evaluated by an independent Python implementation of §2.1 (standard library
/// only), when python3 is installed.
#[test]
fn spec_values_match_a_python_implementation() {
    let Ok(py) = std::process::Command::new("python3")
        .arg("--version")
        .output()
    else {
        // Straight to stderr: libtest hides a passing test's eprintln! output.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED spec_values_match_a_python_implementation: python3 not found"
        );
        return;
    };
    if !py.status.success() {
        // Straight to stderr: libtest hides a passing test's eprintln! output.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED spec_values_match_a_python_implementation: python3 does not run"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let l0 = Logical::new(4, 16, 2, 8, 2, 2, 11);
    std::fs::write(dir.path().join("a.bin"), l0.write("B KV H N D")).unwrap();
    let spec = json!({"num_tokens": 50, "groups": [{"group_id": 0, "block_size": 16, "start": 1, "block_ids": [3, 0, 2, 1],
        "layers": [{"name": "model.layers.4.attn", "path": "a.bin", "layout": "B KV H N D",
                    "dims": {"B": 4, "N": 16, "H": 2, "D": 8}, "elem_bytes": 2, "head_offset": 6}]}]});
    let path = write_spec(dir.path(), &spec);
    let ours = checksum_spec(&path).unwrap();
    assert!(
        ours["groups"][0].get("fingerprint").is_none(),
        "no kind/dtype: no fingerprint"
    );
    let script = r#"
import json, struct, sys
spec = json.load(open(sys.argv[1])); g = spec["groups"][0]; l = g["layers"][0]
B, N, H, D = (l["dims"][k] for k in "BNHD"); E = l["elem_bytes"]
raw = open(sys.argv[2], "rb").read()
def elem(b, part, h, t, d):  # layout B KV H N D
    i = (((b * 2 + part) * H + h) * N + t) * D + d
    return raw[i * E:(i + 1) * E]
P = 2 * D * E // 8; M = 1 << 64; out = []
for i, blk in enumerate(g["block_ids"]):
    pos = g["start"] + i; c = 0
    for h in range(H):
        s = 0
        for t in range(N):
            tok = pos * N + t
            if tok >= spec["num_tokens"]: break
            cell = b"".join(elem(blk, part, h, t, d) for part in range(2) for d in range(D))
            for p in range(P):
                x = struct.unpack("<Q", cell[8 * p:8 * p + 8])[0]
                s = (s + x * (2 * (tok * P + p) + 1)) % M
        c = (c + (2 * (4 * 65536 + 6 + h) + 1) * s) % M
    out.append("0x%016x" % c)
print(json.dumps(out))
"#;
    let res = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&path)
        .arg(dir.path().join("a.bin"))
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let theirs: Value = serde_json::from_slice(&res.stdout).unwrap();
    assert_eq!(ours["groups"][0]["values"], theirs);
}

fn err_of(dir: &Path, layer: Value, block_ids: Value) -> String {
    let spec = json!({"num_tokens": 20, "groups": [{"group_id": 0, "block_size": 16, "block_ids": block_ids, "layers": [layer]}]});
    checksum_spec(&write_spec(dir, &spec))
        .unwrap_err()
        .to_string()
}

#[test]
fn errors_name_field_and_value() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ok.bin"), vec![0u8; 2 * 4 * 16 * 2 * 8 * 2]).unwrap();
    let layer = |f: &dyn Fn(&mut Value)| {
        let mut l = json!({"name": "model.layers.1.attn", "path": "ok.bin", "layout": "KV B N H D",
                           "dims": {"B": 4, "N": 16, "H": 2, "D": 8}, "elem_bytes": 2});
        f(&mut l);
        l
    };
    assert!(checksum_spec(&write_spec(dir.path(), &json!({"num_tokens": 20, "groups": [{"group_id": 0, "block_size": 16, "block_ids": [1], "layers": [layer(&|_| {})]}]}))).is_ok());
    let cases: Vec<(Value, Value, &str)> = vec![
        (
            layer(&|l| l["path"] = json!("missing.bin")),
            json!([0]),
            "missing.bin",
        ),
        (layer(&|l| l["dims"]["B"] = json!(5)), json!([0]), "needs"),
        (
            layer(&|l| l["layout"] = json!("KV B X H D")),
            json!([0]),
            "groups[0].layers[0].layout = \"KV B X H D\"",
        ),
        (
            layer(&|l| l["name"] = json!("model.final")),
            json!([0]),
            "groups[0].layers[0].name = \"model.final\"",
        ),
        (
            layer(&|l| {
                l["layout"] = json!("B N D");
                l["dims"] = json!({"B": 4, "N": 16, "D": 3});
            }),
            json!([0]),
            "groups[0].layers[0].dims.D = 3",
        ),
        (layer(&|_| {}), json!([0, 4]), "groups[0].block_ids[1] = 4"),
        (
            layer(&|l| l["kernel_blocks"] = json!(2)),
            json!([0]),
            "groups[0].layers[0].kernel_blocks = 2",
        ),
        (
            layer(&|l| l["elem_bytes"] = json!(3)),
            json!([0]),
            "groups[0].layers[0].elem_bytes = 3",
        ),
        (
            layer(&|l| l["dims"]["KV"] = json!(2)),
            json!([0]),
            "groups[0].layers[0].dims.KV = 2",
        ),
        (
            layer(&|l| l["tensor"] = json!("x")),
            json!([0]),
            "groups[0].layers[0].tensor",
        ),
    ];
    for (l, ids, want) in cases {
        let e = err_of(dir.path(), l.clone(), ids);
        assert!(e.contains(want), "{l}: error {e:?} should contain {want:?}");
    }
    let e = checksum_spec(&dir.path().join("nope.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.json"), "{e}");
    std::fs::write(
        dir.path().join("bad.json"),
        "{\"num_tokens\": 1, \"groups\": [], \"extra\": 1}",
    )
    .unwrap();
    assert!(checksum_spec(&dir.path().join("bad.json"))
        .unwrap_err()
        .to_string()
        .contains("extra"));
}

#[test]
fn npy_and_safetensors_mismatches_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let data = vec![0u8; 4 * 16 * 8 * 2];
    let base = json!({"name": "model.layers.1.attn", "layout": "B N D", "dims": {"B": 4, "N": 16, "D": 8}, "elem_bytes": 2});
    let with = |path: &str, extra: Value| {
        let mut l = base.clone();
        l["path"] = json!(path);
        if let Value::Object(m) = extra {
            for (k, v) in m {
                l[k] = v;
            }
        }
        l
    };
    std::fs::write(dir.path().join("f4.npy"), npy(&[4, 16, 4], "<f4", &data)).unwrap();
    assert!(err_of(dir.path(), with("f4.npy", json!({})), json!([0])).contains("4-byte elements"));
    std::fs::write(dir.path().join("be.npy"), npy(&[4, 16, 8], ">f2", &data)).unwrap();
    assert!(err_of(dir.path(), with("be.npy", json!({})), json!([0])).contains("big-endian"));
    std::fs::write(
        dir.path().join("short.npy"),
        npy(&[4, 16, 4], "<f2", &data[..data.len() / 2]),
    )
    .unwrap();
    assert!(err_of(dir.path(), with("short.npy", json!({})), json!([0])).contains("needs"));
    // A descr whose first character is more than one byte: an error, not a panic.
    std::fs::write(dir.path().join("utf.npy"), npy(&[4, 16, 8], "é2", &data)).unwrap();
    let e = err_of(dir.path(), with("utf.npy", json!({})), json!([0]));
    assert!(e.contains("é2"), "{e}");
    std::fs::write(dir.path().join("junk.npy"), b"not numpy at all").unwrap();
    assert!(err_of(dir.path(), with("junk.npy", json!({})), json!([0])).contains("magic"));
    std::fs::write(dir.path().join("ok.npy"), npy(&[4, 16, 8], "<f2", &data)).unwrap();
    assert!(checksum_spec(&write_spec(dir.path(), &json!({"num_tokens": 9, "groups": [{"group_id": 0, "block_size": 16, "block_ids": [3], "layers": [with("ok.npy", json!({}))]}]}))).is_ok());
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![4, 16, 8], &data)
            .unwrap();
    std::fs::write(
        dir.path().join("t.safetensors"),
        safetensors::tensor::serialize([("k", view)], None).unwrap(),
    )
    .unwrap();
    assert!(err_of(dir.path(), with("t.safetensors", json!({})), json!([0])).contains("tensor"));
    assert!(err_of(
        dir.path(),
        with("t.safetensors", json!({"tensor": "v"})),
        json!([0])
    )
    .contains("\"v\""));
    let e = err_of(
        dir.path(),
        with(
            "t.safetensors",
            json!({"tensor": "k", "elem_bytes": 4, "dims": {"B": 4, "N": 16, "D": 4}}),
        ),
        json!([0]),
    );
    assert!(e.contains("16 bits"), "{e}");
}

#[test]
fn errors_carry_typed_causes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ok.bin"), vec![0u8; 4 * 16 * 8 * 2]).unwrap();
    let run = |layer: Value, block_ids: Value| {
        let spec = json!({"num_tokens": 20, "groups": [{"group_id": 0, "block_size": 16, "block_ids": block_ids, "layers": [layer]}]});
        checksum_spec(&write_spec(dir.path(), &spec)).unwrap_err()
    };
    let base = json!({"name": "model.layers.1.attn", "path": "ok.bin", "layout": "B N D",
                      "dims": {"B": 4, "N": 16, "D": 8}, "elem_bytes": 2});
    let mut kv = base.clone();
    kv["dims"]["KV"] = json!(2);
    assert!(matches!(
        run(kv, json!([0])),
        SpecError::Field {
            why: super::FieldFault::KvGiven,
            ..
        }
    ));
    assert!(matches!(
        run(base.clone(), json!([0, 4])),
        SpecError::Field {
            why: super::FieldFault::BlockId {
                layer: 0,
                blocks: 4
            },
            ..
        }
    ));
    let file_fault = |e: SpecError| match e {
        SpecError::File { why, .. } => *why,
        other => panic!("{other:?}"),
    };
    let mut big = base.clone();
    big["dims"]["B"] = json!(5);
    assert!(matches!(
        file_fault(run(big, json!([0]))),
        super::FileFault::Size {
            len: 1024,
            want: 1280,
            ..
        }
    ));
    std::fs::write(dir.path().join("junk.npy"), b"not numpy at all").unwrap();
    let mut junk = base.clone();
    junk["path"] = json!("junk.npy");
    assert!(matches!(
        file_fault(run(junk, json!([0]))),
        super::FileFault::Format(FormatError::NpyMagic)
    ));
    let mut missing = base;
    missing["path"] = json!("missing.bin");
    match file_fault(run(missing, json!([0]))) {
        super::FileFault::Read(e) => assert_eq!(e.kind(), std::io::ErrorKind::NotFound),
        other => panic!("{other:?}"),
    }
}
