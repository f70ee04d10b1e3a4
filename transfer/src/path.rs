//! Path reporting (docs/design.md §3): how a registered region is reachable by peers, which path
//! a transfer takes between a local and a remote address, and the metrics' `path` label of a
//! batch. The engine's `region_path`, `region_cuda_ipc` and `transfer_path` delegate here.

use crate::error::{Result, TransferError};
use crate::memory::{MemoryRegistry, RegistrationPath};
use crate::segment::SegmentHandle;
use crate::transport::Transport;
use crate::types::{TransferPath, TransportKind};

/// How the registered region containing `addr` was made reachable by peers; `None` when no
/// region of `registry` contains `addr` (`TransferEngine::region_path`).
pub(crate) fn region_path(registry: &MemoryRegistry, addr: u64) -> Option<RegistrationPath> {
    // Without cloning the entry: its keys are JSON, and this runs at every submit.
    registry.with_region(addr, 1, |e| e.keys.path)
}

/// Whether peers on this host reach the `cuda:N` region containing `addr` through CUDA IPC
/// (`TransferEngine::region_cuda_ipc`): `Some(Ok(()))` exported, `Some(Err(e))` the export's
/// error, `None` for host memory, a transport without CUDA IPC, or no region at `addr`.
pub(crate) fn region_cuda_ipc(
    registry: &MemoryRegistry,
    transport: &dyn Transport,
    addr: u64,
) -> Option<Result<()>> {
    let e = registry.find(addr, 1)?;
    if e.keys
        .transport
        .get(crate::transport::cuda_ipc::transport::KEYS_FIELD)
        .is_some()
    {
        return Some(Ok(()));
    }
    transport.not_exported(e.region.addr).map(Err)
}

/// The path a transfer between `local_addr` (registered in `registry`) and `remote_addr` (in a
/// buffer of `target`) takes now (`TransferEngine::transfer_path`). Errors: `NotRegistered`
/// when no local region contains `local_addr`, `RemoteOutOfRange` when no buffer of `target`
/// contains `remote_addr`.
pub(crate) fn transfer_path(
    registry: &MemoryRegistry,
    transport: &dyn Transport,
    target: &SegmentHandle,
    local_addr: u64,
    remote_addr: u64,
) -> Result<TransferPath> {
    let local = registry
        .find(local_addr, 1)
        .ok_or(TransferError::NotRegistered {
            addr: local_addr,
            len: 1,
        })?;
    let d = &target.descriptor;
    let i = d
        .buffers
        .iter()
        .position(|b| b.region.contains(remote_addr, 1))
        .ok_or_else(|| TransferError::RemoteOutOfRange {
            segment: d.name.clone(),
            addr: remote_addr,
            len: 1,
        })?;
    Ok(transport.path(d, &local.region, i))
}

/// The metrics' `path` of a batch whose first local address is `first`: the transport's kind,
/// and for GPU memory how that address's region of `registry` is registered.
pub(crate) fn label_at(
    registry: &MemoryRegistry,
    kind: TransportKind,
    first: Option<u64>,
) -> &'static str {
    let reg = first
        .and_then(|a| region_path(registry, a))
        .unwrap_or_default();
    label_of(kind, reg)
}

/// The metrics' `path` of a batch moved by a transport of `kind` from a region registered
/// along `reg`: the kind alone for host memory, else `{kind}-gpu-staged`, `{kind}-dma-buf`,
/// `{kind}-peer-memory`. A static text: a submit formats no label.
pub(crate) fn label_of(kind: TransportKind, reg: RegistrationPath) -> &'static str {
    use RegistrationPath as P;
    use TransportKind as K;
    match (kind, reg) {
        (K::Tcp, P::Host) => "tcp",
        (K::Tcp, P::Staged) => "tcp-gpu-staged",
        (K::Tcp, P::DmaBuf) => "tcp-dma-buf",
        (K::Tcp, P::PeerMemory) => "tcp-peer-memory",
        (K::Rdma, P::Host) => "rdma",
        (K::Rdma, P::Staged) => "rdma-gpu-staged",
        (K::Rdma, P::DmaBuf) => "rdma-dma-buf",
        (K::Rdma, P::PeerMemory) => "rdma-peer-memory",
        (K::Auto, P::Host) => "auto",
        (K::Auto, P::Staged) => "auto-gpu-staged",
        (K::Auto, P::DmaBuf) => "auto-dma-buf",
        (K::Auto, P::PeerMemory) => "auto-peer-memory",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RegistrationPath as P;

    #[test]
    fn path_labels_are_the_kind_and_the_registration_path() {
        for k in [TransportKind::Auto, TransportKind::Tcp, TransportKind::Rdma] {
            for r in [P::Host, P::Staged, P::DmaBuf, P::PeerMemory] {
                let kind = k.as_str();
                let want = match r {
                    P::Host => kind.to_string(),
                    P::Staged => format!("{kind}-gpu-staged"),
                    other => format!("{kind}-{other}"),
                };
                assert_eq!(label_of(k, r), want);
            }
        }
    }
}
