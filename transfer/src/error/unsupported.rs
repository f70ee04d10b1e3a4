//! What the engine cannot do here: the cause carried by
//! [`TransferError::Unsupported`](super::TransferError::Unsupported) (memory no backend can
//! move, a peer of another transport, a budget of exports or tickets spent, a transport shut
//! down), with the location, the limit and each path's failure as fields.

use kvferry_cuda::Location;

use crate::transport_kind::TransportKind;

use super::io::Shared;

/// Why the engine (or one of its transports) cannot do what was asked.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UnsupportedError {
    /// Device memory without the GPU memory backend (a build or a process without CUDA).
    #[error(
        "memory at {location} cannot be moved by this transport: GPU memory needs the GPU \
         memory backend (transfer/src/gpu, cuda support), which is not available in this build"
    )]
    NoGpuBackend {
        /// Where the memory lives.
        location: Location,
    },
    /// A location the memory backend has no device for (`why`: the CUDA layer's answer).
    #[error("memory at {location} cannot be used: {why}")]
    Unusable {
        /// Where the memory lives.
        location: Location,
        /// Why it cannot be used.
        #[source]
        why: Shared,
    },
    /// The GPU (or its driver) cannot export device memory as a dma-buf.
    #[error("memory at {location} cannot be used: the device or driver does not support dma-buf")]
    NoDmabufSupport {
        /// Where the region lives.
        location: Location,
    },
    /// The driver reported success exporting a dma-buf but gave no file descriptor.
    #[error("memory at {location} cannot be used: cuMemGetHandleForAddressRange returned no fd")]
    DmabufNoFd {
        /// Where the region lives.
        location: Location,
    },
    /// A memory backend that exports no dma-buf (`backend`: its name).
    #[error("{backend} memory access exports no dma-buf for {location} memory")]
    NoDmabuf {
        /// The memory backend (`MemoryAccess::name`).
        backend: &'static str,
        /// Where the region lives.
        location: Location,
    },
    /// No way to register a device region for RDMA worked (or the one forced failed): the
    /// region, `gpu_registration` and each path tried with its failure.
    #[error(
        "{location} region [{addr:#x}, +{len}) cannot be registered for RDMA \
         (gpu_registration {mode}): {}",
        attempts_text(attempts)
    )]
    GpuRegistration {
        /// Where the region lives.
        location: Location,
        /// Its start.
        addr: u64,
        /// Its length in bytes.
        len: u64,
        /// `RdmaConfig::gpu_registration` as configured (`"auto"`, `"dma-buf"`, ...).
        mode: &'static str,
        /// Each path tried (`"dma-buf"`, `"peer memory"`, `"staging"`) and its failure.
        attempts: Vec<(&'static str, Shared)>,
    },
    /// A peer whose descriptor names another transport than this engine's.
    #[error("segment {segment} uses transport \"{theirs}\", this engine uses \"{ours}\"")]
    TransportMismatch {
        /// The peer's segment name.
        segment: String,
        /// The peer's transport kind.
        theirs: TransportKind,
        /// This engine's transport kind.
        ours: TransportKind,
    },
    /// A transport that takes no `Connect` handshake frames was sent one.
    #[error("the {transport} transport takes no connect frames")]
    NoConnectFrames {
        /// The transport's name.
        transport: &'static str,
    },
    /// The transport shut down before the slice was moved.
    #[error("the {transport} transport is shut down")]
    ShutDown {
        /// The transport's name.
        transport: &'static str,
    },
    /// CUDA IPC needs this host's identity (`/proc/sys/kernel/random/boot_id`) and has none.
    #[error("no host identity (/proc/sys/kernel/random/boot_id)")]
    NoHostIdentity,
    /// A CUDA IPC request came while no region is exported.
    #[error("no region is exported for CUDA IPC")]
    NothingExported,
    /// More regions exported for CUDA IPC than its live table holds (nothing changed).
    #[error("{regions} regions exported for CUDA IPC; at most {limit}")]
    TooManyExports {
        /// Regions that would be exported.
        regions: usize,
        /// The most allowed.
        limit: usize,
    },
    /// Every CUDA IPC descriptor ticket is outstanding (peers have not fetched theirs yet).
    #[error("{limit} CUDA IPC descriptor tickets are outstanding; try again later")]
    TooManyTickets {
        /// The most tickets outstanding at once.
        limit: usize,
    },
    /// The CUDA IPC descriptor socket could not be started.
    #[error("CUDA IPC socket: {0}")]
    IpcSocket(#[source] Shared),
    /// A transport that takes no strided groups was handed some.
    #[error("the {transport} transport takes no strided groups")]
    NoStridedGroups {
        /// The transport's name.
        transport: &'static str,
    },
    /// A strided group's pair of regions stopped going over CUDA IPC between submit and post
    /// (the peer's descriptor changed, its allocation could not be imported).
    #[error("the peer's buffer {buffer} is no longer reached over CUDA IPC")]
    NotOverCudaIpc {
        /// Index of the peer's buffer.
        buffer: usize,
    },
    /// The local device has no strided copy kernel (NVRTC missing or failing).
    #[error("no strided copy kernel on cuda:{ordinal}")]
    NoStridedKernel {
        /// The device.
        ordinal: u32,
    },
}

fn attempts_text(attempts: &[(&'static str, Shared)]) -> String {
    let v: Vec<String> = attempts.iter().map(|(p, e)| format!("{p}: {e}")).collect();
    v.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TransferError;
    use std::sync::Arc;

    #[test]
    fn a_failed_gpu_registration_names_each_path_and_keeps_its_error() {
        let io = std::io::Error::from_raw_os_error(libc::EOPNOTSUPP);
        let e = TransferError::Unsupported(UnsupportedError::GpuRegistration {
            location: Location::Cuda(0),
            addr: 0x1000,
            len: 64,
            mode: "dma-buf",
            attempts: vec![("dma-buf", Shared(Arc::new(io)))],
        });
        let text = e.to_string();
        assert!(
            text.starts_with(
                "unsupported: cuda:0 region [0x1000, +64) cannot be registered for RDMA \
                 (gpu_registration dma-buf): dma-buf: "
            ),
            "{text}"
        );
    }
}
