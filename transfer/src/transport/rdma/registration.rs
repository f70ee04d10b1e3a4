//! Memory registration: host regions with `ibv_reg_mr` on every device; `cuda:N` regions by
//! dma-buf, else peer memory, else a pinned host mirror (docs/design.md §3 "GPU memory"); and
//! the owner's side of a staging sync, which resolves a peer's ranges against the registered
//! mirrors.

use crate::sync::MutexExt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use sideway::ibverbs::memory_region::MemoryRegion as VerbsMr;
use sideway::ibverbs::AccessFlags;

use super::device::Device;
use super::mirror::Mirror;
use super::shared::Shared;
use super::staging_sync::{self, Direction, SyncRequest};
use crate::config::GpuRegistration;
use crate::error::{RdmaError, Result, UnsupportedError};
use crate::memory::{MemoryRegion, RegistrationPath};

/// Registers a dma-buf range on one device (`ibv_reg_dmabuf_mr`), `iova` = the address peers
/// use for it. Safety: `fd` is a live dma-buf whose `[offset, +len)` stays valid while the
/// memory region exists.
unsafe fn reg_dmabuf(
    dev: &Device,
    fd: &OwnedFd,
    offset: u64,
    len: u64,
    iova: u64,
) -> Result<Arc<VerbsMr>> {
    // SAFETY: this function's contract: `fd` is a live dma-buf whose `[offset, +len)` stays
    // valid while the memory region exists; the PD is live for `dev`'s borrow.
    unsafe {
        dev.pd
            .reg_dmabuf_mr(offset, len as usize, iova, fd.as_raw_fd(), access())
    }
    .map_err(|e| RdmaError::verbs(format!("{}: ibv_reg_dmabuf_mr", dev.info.name), e).into())
}

pub(super) fn access() -> AccessFlags {
    AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead
}

/// A GPU region's registration: its memory regions (one per device), path and host mirror.
pub(super) type GpuRegistered = (Vec<Arc<VerbsMr>>, RegistrationPath, Option<Arc<Mirror>>);
impl Shared {
    /// `ibv_reg_mr` of `[addr, +len)` on every device; on error nothing stays registered.
    ///
    /// # Safety
    /// The range is valid host memory (or peer memory the driver can pin) while registered.
    pub(super) unsafe fn reg_host(&self, addr: u64, len: u64) -> Result<Vec<Arc<VerbsMr>>> {
        self.devices
            .iter()
            .map(|d| {
                // SAFETY: this function's contract: `[addr, +len)` stays valid (host memory, or
                // device memory the driver pins) while the memory region exists.
                unsafe { d.pd.reg_mr(addr as usize, len as usize, access()) }.map_err(|e| {
                    RdmaError::verbs(
                        format!("{}: ibv_reg_mr [{addr:#x}, +{len})", d.info.name),
                        e,
                    )
                    .into()
                })
            })
            .collect()
    }

    /// Registers a `cuda:N` region per `config.gpu_registration` (docs/design.md §3 "GPU memory"):
    /// dma-buf, else peer memory, else a host mirror (with a warning naming why GPUDirect
    /// failed). Returns the memory regions (one per device), the path and the mirror.
    /// Errors: `Unsupported` with every path's failure when none works.
    pub(super) fn register_gpu(&self, region: &MemoryRegion) -> Result<GpuRegistered> {
        let mode = self.config.gpu_registration;
        let mut why: Vec<(&str, crate::error::Shared)> = Vec::new();
        if matches!(mode, GpuRegistration::Auto | GpuRegistration::DmaBuf) {
            match self.reg_dmabuf_all(region) {
                Ok(mrs) => return Ok((mrs, RegistrationPath::DmaBuf, None)),
                Err(e) => why.push(("dma-buf", crate::error::Shared(Arc::new(e)))),
            }
        }
        if matches!(mode, GpuRegistration::Auto | GpuRegistration::PeerMemory) {
            // SAFETY: with nvidia-peermem the driver pins the device range; without it this
            // fails (the kernel cannot pin memory the host cannot map).
            match unsafe { self.reg_host(region.addr, region.len) } {
                Ok(mrs) => return Ok((mrs, RegistrationPath::PeerMemory, None)),
                Err(e) => why.push(("peer memory", crate::error::Shared(Arc::new(e)))),
            }
        }
        if matches!(mode, GpuRegistration::Auto | GpuRegistration::Staged) {
            let staged = self.memory.check_region(region).and_then(|()| {
                let m = Mirror::new(region)?;
                // SAFETY: the mirror is host memory owned by `Registered` with the regions.
                let mrs = unsafe { self.reg_host(m.addr(), region.len) }?;
                Ok((mrs, m))
            });
            match staged {
                Ok((mrs, m)) => {
                    if mode == GpuRegistration::Auto {
                        tracing::warn!(
                            "{} region [{:#x}, +{}) cannot be registered with the NIC ({}); \
                             staging it through {} bytes of pinned host memory: every transfer \
                             adds a device copy",
                            region.location,
                            region.addr,
                            region.len,
                            why.iter()
                                .map(|(path, e)| format!("{path}: {e}"))
                                .collect::<Vec<_>>()
                                .join("; "),
                            region.len
                        );
                    }
                    return Ok((mrs, RegistrationPath::Staged, Some(m)));
                }
                Err(e) => why.push(("staging", crate::error::Shared(Arc::new(e)))),
            }
        }
        Err(UnsupportedError::GpuRegistration {
            location: region.location,
            addr: region.addr,
            len: region.len,
            mode: mode.as_str(),
            attempts: why,
        }
        .into())
    }

    /// dma-buf registration of a GPU region on every device (one export).
    pub(super) fn reg_dmabuf_all(&self, region: &MemoryRegion) -> Result<Vec<Arc<VerbsMr>>> {
        // The exporter comes with the engine's memory access (passed explicitly, no global).
        let buf = self.memory.export_dmabuf(region)?;
        self.devices
            .iter()
            // SAFETY: the exporter returns a dma-buf covering the region; it stays registered
            // only while the region is.
            .map(|d| unsafe { reg_dmabuf(d, &buf.fd, buf.offset, region.len, region.addr) })
            .collect()
    }

    /// Serves a peer's staging sync: checks every range against this engine's staged regions,
    /// then copies them (mirror → device after the peer's WRITEs, device → mirror before its
    /// READs). Errors: `InvalidArgument` for a range outside them (nothing is copied), the
    /// first failed copy.
    pub(super) fn serve_sync(&self, sync: &SyncRequest) -> Result<()> {
        let mirrors: Vec<Arc<Mirror>> = self
            .regions
            .locked()
            .values()
            .filter_map(|r| r.mirror.clone())
            .collect();
        let body = &sync.staging_sync;
        let copies = staging_sync::resolve(body, |a, l| {
            mirrors.iter().find(|m| m.region().contains(a, l)).cloned()
        })?;
        for (m, addr, len) in copies {
            match body.direction {
                Direction::ToDevice => m.to_device(&*self.memory, addr, len)?,
                Direction::ToHost => m.to_host(&*self.memory, addr, len)?,
            }
        }
        Ok(())
    }
}
