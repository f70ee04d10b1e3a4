//! kvferry: the `kvferry` command's library (docs/design.md §6) — a facade over the
//! workspace crates plus the demo, the two roles, the benchmark and the file tools.
//!
//! * [`checksum`], [`kernels`], [`transfer`], [`p2p`]: the crates, re-exported.
//! * [`demo`] — the main job on loopback; [`roles`] — `serve`/`load` as two processes;
//!   [`loads`] — the settings and counts `demo` and `load` share; [`doctor`] — what this node
//!   offers and its problems;
//!   [`bench`] — the throughput sweep; [`spec`] — `checksum --spec`; [`payload_json`] — payload ⇄ JSON.
#![warn(missing_docs)]

pub use kvferry_checksum as checksum;
pub use kvferry_kernels as kernels;
pub use kvferry_p2p as p2p;
pub use kvferry_transfer as transfer;

pub mod bench;
pub mod cli;
pub mod copy_ref;
pub mod corrupt;
pub mod demo;
pub mod doctor;
pub mod error;
pub mod fill;
pub mod loads;
pub mod metrics_http;
pub mod models;
pub mod payload_json;
pub mod pool;
pub mod roles;
pub mod setup;
pub mod spec;
pub mod world;
