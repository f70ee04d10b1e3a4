//! Same-host GPU memory between processes through CUDA IPC (docs/design.md §3.10): the pieces
//! the transport is built from.
//!
//! * [`keys`]: the host identity (boot id, machine id, pid namespace, pid), what an exported
//!   region publishes ([`keys::IpcRegionKeys`]) and the route of one slice (CUDA IPC, in-process
//!   copy, or the fallback transport with the reason), decided without touching a GPU.
//! * [`fdpass`]: file descriptors of `cuMemCreate` allocations passed to a peer over a Unix
//!   socket (`SCM_RIGHTS`) against single-use tickets.
//! * [`live`]: the owner's list of regions still registered, which peers check every slice
//!   against before they copy.
//! * [`transport`]: the transport itself, wrapping the network transport.
//!
//! The driver side (export, open, import, the piece kernel) is kvferry-cuda's `ipc`.

mod copy;
pub mod fdpass;
mod gate;
#[cfg(test)]
mod import_tests;
pub mod keys;
pub mod live;
mod owner;
mod peer;
mod routes;
mod state;
mod strided;
pub mod transport;
mod warm;

pub use transport::CudaIpcTransport;
