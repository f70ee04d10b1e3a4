//! Detects the modules other helpers add later (`src/transport/rdma/`, `src/gpu/`), so this crate
//! compiles before and after they land: `cfg(kvferry_rdma_module)` / `cfg(kvferry_gpu_module)`.
use std::path::Path;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvferry_rdma_module)");
    println!("cargo::rustc-check-cfg=cfg(kvferry_gpu_module)");
    println!("cargo::rerun-if-changed=src/transport");
    println!("cargo::rerun-if-changed=src/gpu");
    println!("cargo::rerun-if-changed=src/transport/rdma/mod.rs");
    println!("cargo::rerun-if-changed=src/gpu/mod.rs");
    if Path::new("src/transport/rdma/mod.rs").exists() {
        println!("cargo::rustc-cfg=kvferry_rdma_module");
    }
    if Path::new("src/gpu/mod.rs").exists() {
        println!("cargo::rustc-cfg=kvferry_gpu_module");
    }
}
