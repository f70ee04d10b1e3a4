//! kvferry-cuda: the one CUDA layer of kvferry (docs/design.md §3 "GPU memory", §5), used by the
//! checksum kernels (kvferry-kernels) and the transfer engine's GPU memory (kvferry-transfer).
//!
//! * [`Location`]: where memory lives (`cpu` or `cuda:N`), the one type every crate uses.
//! * [`probe`]: whether the CUDA driver is usable here. cudarc loads `libcuda` lazily and panics
//!   when it is missing, so the library is probed first and the first calls run inside
//!   `catch_unwind`; nothing here panics on a machine without CUDA.
//! * [`inspect`]: what the GPUs offer (dma-buf, GPUDirect RDMA, IPC, peer access), for
//!   `kvferry doctor`.
//! * [`driver`]: thin owners of driver objects (context, stream, event, memory, module).
//! * [`nvrtc`]: compiling CUDA C at run time (NVRTC found where the loader may not look).
//! * [`ipc`]: sharing device memory between processes of one host (legacy IPC handles, and
//!   virtual-memory allocations exported as file descriptors).
#![warn(missing_docs)]

pub mod driver;
pub mod error;
pub mod inspect;
pub mod ipc;
pub mod location;
pub mod nvrtc;
pub mod probe;
pub mod staging;

pub use error::{CudaError, InvalidArg};
pub use location::{Location, ParseLocationError};
pub use probe::{cuda_available, driver_library_present, guarded};

/// cudarc's raw driver bindings, for the crates above this one.
pub use cudarc::driver::sys;
