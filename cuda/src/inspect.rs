//! What the GPUs of this node offer kvferry (for `kvferry doctor`): each device's name, memory
//! and the capabilities GPU KV registration and sharing depend on (dma-buf export, GPUDirect
//! RDMA, CUDA IPC), and which device pairs have peer access. Read through the driver's device
//! queries only: no context is created, nothing is allocated, nothing panics where `libcuda` is
//! absent.

use serde::Serialize;

use crate::driver::check;
use crate::error::CudaError;
use crate::probe::{cuda_available, guarded};
use cudarc::driver::sys;

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuFacts {
    /// Device ordinal (`cuda:N`).
    pub ordinal: u32,
    /// The device's name, e.g. "NVIDIA H200".
    pub name: String,
    /// PCI bus id, e.g. "0000:17:00.0" (matches the NIC's PCI topology in `nvidia-smi topo -m`).
    pub pci_bus_id: String,
    /// Compute capability, "major.minor".
    pub compute_capability: String,
    /// Device memory, bytes.
    pub total_memory: u64,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: device memory can be exported as a dma-buf
    /// (the RDMA transport's first GPU registration path, `ibv_reg_dmabuf_mr`).
    pub dma_buf: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`: the device supports GPUDirect RDMA
    /// (the NIC reading and writing its memory, through dma-buf or nvidia-peermem).
    pub gpudirect_rdma: bool,
    /// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`: needed for CUDA IPC memory handles
    /// (`cuIpcGetMemHandle`), with which processes on this host share device memory.
    pub ipc: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`: memory allocated
    /// with the virtual memory API can be shared between processes as a file descriptor.
    pub posix_fd_handles: bool,
}

/// The GPUs of this node and their peer access.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuInventory {
    /// The driver's version (e.g. 13000 for CUDA 13.0); `None` when the driver is unusable.
    pub driver_version: Option<i32>,
    /// Why the driver is unusable (`libcuda` missing, `cuInit` failing); `None` when usable.
    pub driver_error: Option<String>,
    /// Every device, in ordinal order.
    pub devices: Vec<GpuFacts>,
    /// Ordered pairs `(a, b)` where device `a` can access device `b`'s memory directly
    /// (`cuDeviceCanAccessPeer`; NVLink or PCIe P2P).
    pub peer_access: Vec<(u32, u32)>,
}

/// Inspects the GPUs. Never fails: a driver that cannot be used is reported in
/// `driver_error` with no devices; a device whose queries fail is left out with a
/// `driver_error` naming it.
pub fn gpus() -> GpuInventory {
    let count = match cuda_available() {
        Ok(n) => n,
        Err(e) => {
            return GpuInventory {
                driver_version: None,
                driver_error: Some(e.to_string()),
                devices: Vec::new(),
                peer_access: Vec::new(),
            }
        }
    };
    match guarded("inspecting the GPUs", || inspect(count)) {
        Ok(inv) => inv,
        Err(e) => GpuInventory {
            driver_version: None,
            driver_error: Some(e.to_string()),
            devices: Vec::new(),
            peer_access: Vec::new(),
        },
    }
}

fn inspect(count: u32) -> Result<GpuInventory, CudaError> {
    let mut version = 0;
    // SAFETY: `version` is a live local the driver writes; the driver is initialised
    // (`cuda_available` ran cuInit).
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut version)
    })?;
    let mut handles = Vec::new();
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let mut dev = 0;
        // SAFETY: out-pointer to a live local; ordinal < the device count.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal as i32)
        })?;
        handles.push(dev);
        devices.push(device_facts(ordinal, dev)?);
    }
    let mut peer_access = Vec::new();
    for (a, &da) in handles.iter().enumerate() {
        for (b, &db) in handles.iter().enumerate() {
            if a == b {
                continue;
            }
            let mut can = 0;
            // SAFETY: out-pointer to a live local; both handles come from cuDeviceGet.
            check("cuDeviceCanAccessPeer", unsafe {
                sys::cuDeviceCanAccessPeer(&mut can, da, db)
            })?;
            if can != 0 {
                peer_access.push((a as u32, b as u32));
            }
        }
    }
    Ok(GpuInventory {
        driver_version: Some(version),
        driver_error: None,
        devices,
        peer_access,
    })
}

fn attribute(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32, CudaError> {
    let mut v = 0;
    // SAFETY: out-pointer to a live local; `dev` comes from cuDeviceGet.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, a, dev)
    })?;
    Ok(v)
}

fn text(buf: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn device_facts(ordinal: u32, dev: sys::CUdevice) -> Result<GpuFacts, CudaError> {
    use sys::CUdevice_attribute as A;
    let mut name = [0 as std::ffi::c_char; 128];
    // SAFETY: `name` has 128 bytes and 128 is passed as its length.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), 128, dev)
    })?;
    let mut bus = [0 as std::ffi::c_char; 64];
    // SAFETY: `bus` has 64 bytes and 64 is passed as its length.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 64, dev)
    })?;
    let mut total = 0usize;
    // SAFETY: out-pointer to a live local.
    check("cuDeviceTotalMem", unsafe {
        sys::cuDeviceTotalMem_v2(&mut total, dev)
    })?;
    let major = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    // An attribute an older driver does not know reads as "not supported".
    let flag = |a| attribute(dev, a).map(|v| v != 0).unwrap_or(false);
    Ok(GpuFacts {
        ordinal,
        name: text(&name),
        pci_bus_id: text(&bus),
        compute_capability: format!("{major}.{minor}"),
        total_memory: total as u64,
        dma_buf: flag(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED),
        gpudirect_rdma: flag(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED),
        ipc: flag(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING),
        posix_fd_handles: flag(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inspecting_never_panics_and_agrees_with_the_probe() {
        let inv = gpus();
        match cuda_available() {
            Ok(n) => {
                assert_eq!(inv.devices.len() as u32, n);
                assert!(inv.driver_error.is_none());
            }
            Err(e) => {
                assert_eq!(inv.driver_error, Some(e.to_string()));
                assert!(inv.devices.is_empty() && inv.peer_access.is_empty());
            }
        }
    }

    #[test]
    fn names_stop_at_the_first_nul() {
        let buf: Vec<std::ffi::c_char> = b"H200\0junk"
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect();
        assert_eq!(text(&buf), "H200");
    }
}
