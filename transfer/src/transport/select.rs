//! Transport choice: the one place where the configured [`TransportKind`] (or `Auto`) becomes
//! a transport, with the reason the engine's info line gives.
//!
//! Today one transport serves every region and peer of an engine: `Auto` takes RDMA when
//! `rdma::probe` finds a usable device and `rdma::create` succeeds, TCP otherwise. A new kind
//! (a variant of `TransportKind`, its probe and create here) is added to `choose`; a choice per
//! region or per peer (e.g. same-host device memory) belongs here too, so that the engine, the
//! descriptor and the handshake service never name a transport themselves.

use std::sync::Arc;

use super::tcp::TcpTransport;
use super::{Transport, TransportContext};
use crate::config::RdmaConfig;
use crate::error::{ConfigError, NoRdma, Result, TransferError};
use crate::types::TransportKind;

/// The transport `choose` made, and why (for the engine's one info line).
pub(crate) struct Chosen {
    /// The transport the engine uses for every region and peer.
    pub transport: Arc<dyn Transport>,
    /// Why this one: `"configured"`, `"auto: RDMA device rxe0 ..."`, `"auto: no usable RDMA
    /// device"`...
    pub why: String,
}

#[cfg(feature = "rdma")]
fn rdma_probe(c: &RdmaConfig) -> std::result::Result<String, NoRdma> {
    super::rdma::probe(c).ok_or(NoRdma::NoDevice)
}
#[cfg(not(feature = "rdma"))]
fn rdma_probe(_c: &RdmaConfig) -> std::result::Result<String, NoRdma> {
    Err(NoRdma::NotBuilt)
}
#[cfg(feature = "rdma")]
fn rdma_create(ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
    super::rdma::create(ctx)
}
#[cfg(not(feature = "rdma"))]
fn rdma_create(_ctx: &TransportContext) -> Result<Arc<dyn Transport>> {
    Err(TransferError::Config(ConfigError::RdmaUnusable(
        NoRdma::NotBuilt,
    )))
}

/// Creates the transport `ctx.config.transport` asks for, wrapped in the CUDA IPC transport
/// where `ctx.config.cuda_ipc` and the CUDA driver allow (device memory between processes of
/// this host as device copies; everything else through the network transport). `Tcp`: TCP. `Rdma`: RDMA, or a
/// `Config` error when no device is usable (or the build has none). `Auto`: RDMA when a device
/// is usable and the transport starts (a warning names why it did not), else TCP.
/// Errors: `Config` as above; the TCP transport's own (its data listener cannot bind).
pub(crate) fn choose(ctx: &TransportContext) -> Result<Chosen> {
    let net = choose_network(ctx)?;
    match with_cuda_ipc(ctx.config.cuda_ipc, kvferry_cuda::cuda_available()) {
        Ok(()) => Ok(Chosen {
            transport: super::cuda_ipc::CudaIpcTransport::new(ctx, net.transport)?,
            why: format!(
                "{}; CUDA IPC for device memory of processes on this host",
                net.why
            ),
        }),
        Err(why) => Ok(Chosen {
            transport: net.transport,
            why: format!("{}; no CUDA IPC ({why})", net.why),
        }),
    }
}

/// Whether the CUDA IPC transport wraps the network transport: `Ok` when `mode` allows it and
/// the driver is usable (`cuda`: the probe's device count), else why not. `Required` without a
/// driver still wraps (its registrations then fail with the reason).
fn with_cuda_ipc(
    mode: crate::config::CudaIpcMode,
    cuda: std::result::Result<u32, kvferry_cuda::CudaError>,
) -> std::result::Result<(), String> {
    use crate::config::CudaIpcMode;
    match (mode, cuda) {
        (CudaIpcMode::Off, _) => Err("off".into()),
        (CudaIpcMode::Required, _) => Ok(()),
        (CudaIpcMode::Auto, Ok(n)) if n > 0 => Ok(()),
        (CudaIpcMode::Auto, Ok(_)) => Err("no CUDA device".into()),
        (CudaIpcMode::Auto, Err(e)) => Err(e.to_string()),
    }
}

/// The network transport `ctx.config.transport` asks for (see `choose`).
fn choose_network(ctx: &TransportContext) -> Result<Chosen> {
    let tcp = |why: String| -> Result<Chosen> {
        Ok(Chosen {
            transport: Arc::new(TcpTransport::new(ctx.clone())?),
            why,
        })
    };
    match ctx.config.transport {
        TransportKind::Tcp => tcp("configured".into()),
        TransportKind::Rdma => match rdma_probe(&ctx.config.rdma) {
            Ok(dev) => Ok(Chosen {
                transport: rdma_create(ctx)?,
                why: format!("configured; device {dev}"),
            }),
            Err(why) => Err(TransferError::Config(ConfigError::RdmaUnusable(why))),
        },
        TransportKind::Auto => match rdma_probe(&ctx.config.rdma) {
            Ok(dev) => match rdma_create(ctx) {
                Ok(transport) => Ok(Chosen {
                    transport,
                    why: format!("auto: RDMA device {dev}"),
                }),
                Err(e) => {
                    tracing::warn!(
                        "RDMA device {dev} found but unusable ({e}); falling back to TCP"
                    );
                    tcp(format!("auto: RDMA device {dev} unusable"))
                }
            },
            Err(why) => tcp(format!("auto: {why}")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CudaIpcMode;

    #[test]
    fn cuda_ipc_wraps_only_where_allowed_and_a_driver_is_present() {
        let none = || Err(kvferry_cuda::CudaError::DriverLibraryMissing);
        assert!(with_cuda_ipc(CudaIpcMode::Auto, Ok(1)).is_ok());
        assert_eq!(
            with_cuda_ipc(CudaIpcMode::Auto, none()).unwrap_err(),
            "libcuda not found"
        );
        assert_eq!(
            with_cuda_ipc(CudaIpcMode::Auto, Ok(0)).unwrap_err(),
            "no CUDA device"
        );
        assert_eq!(with_cuda_ipc(CudaIpcMode::Off, Ok(8)).unwrap_err(), "off");
        assert!(with_cuda_ipc(CudaIpcMode::Required, none()).is_ok());
    }
}
