//! kvferry-kernels: checksum backends (docs/design.md §5). The [`ChecksumBackend`] trait takes
//! [`GroupJob`]s (one KV cache group's selected blocks over its layers) and yields
//! [`GroupResult`]s (one u64 per block position and replica key, §2.1/§2.3). [`CpuBackend`]
//! evaluates the fast additive form of kvferry-checksum on host memory.
#![warn(missing_docs)]

pub mod backend;
mod copy_plans;
pub mod cpu;
pub mod cuda;
pub mod job;
#[cfg(any(test, feature = "test-tools"))]
pub mod oracle;
pub mod sync;

use std::sync::Arc;

pub use backend::{
    validate_job, ChecksumBackend, CopyJob, GroupJob, GroupResult, JobFault, Keep, KernelError,
    LayerInput, Location, PartMismatch, Pending, PendingChecksums,
};
pub use copy_plans::{CopyPlans, JobBlocks};
pub use cpu::CpuBackend;

/// The backend for KV on `device`: CPU for host memory. For a CUDA device, the CUDA backend when
/// it is usable, else the CPU backend with one info line (its jobs for device memory then fail
/// with [`KernelError::InvalidJob`]). Never panics.
pub fn backend_for(device: Location) -> Arc<dyn ChecksumBackend> {
    try_backend_for(device).unwrap_or_else(|e| {
        tracing::info!(?device, reason = %e, "CUDA checksum backend unusable; using the CPU backend");
        Arc::new(CpuBackend::default())
    })
}

/// The backend for KV on `device` with no fallback: CPU for host memory, the CUDA backend for
/// a CUDA device. Errors: why the CUDA backend is unusable (as [`cuda::CudaBackend::shared`]).
pub fn try_backend_for(device: Location) -> Result<Arc<dyn ChecksumBackend>, KernelError> {
    Ok(match device {
        Location::Cpu => Arc::new(CpuBackend::default()),
        Location::Cuda(ordinal) => Arc::new(cuda::CudaBackend::shared(ordinal)?),
    })
}
