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
    /// Why this one (its `Display` is the info line's reason: `"configured"`, `"auto: RDMA
    /// device rxe0"`, `"auto: no usable RDMA device; no CUDA IPC (off)"`...).
    pub why: Choice,
}

/// Why the engine's transport is the one it is: the network transport's reason and, once
/// `choose` has decided, whether CUDA IPC wraps it.
#[derive(Debug)]
pub(crate) struct Choice {
    /// Why this network transport.
    pub network: NetworkChoice,
    /// `Some(Ok)`: CUDA IPC wraps it; `Some(Err)`: why not; `None`: not decided yet.
    pub cuda_ipc: Option<std::result::Result<(), NoCudaIpc>>,
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.network)?;
        match &self.cuda_ipc {
            Some(Ok(())) => write!(f, "; CUDA IPC for device memory of processes on this host"),
            Some(Err(why)) => write!(f, "; no CUDA IPC ({why})"),
            None => Ok(()),
        }
    }
}

/// Why this network transport.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NetworkChoice {
    /// TCP, as configured.
    #[error("configured")]
    ConfiguredTcp,
    /// RDMA, as configured, on this device.
    #[error("configured; device {0}")]
    ConfiguredRdma(String),
    /// `Auto` found this RDMA device and its transport started.
    #[error("auto: RDMA device {0}")]
    AutoRdma(String),
    /// `Auto` found this RDMA device but its transport did not start (`source`: why): TCP.
    #[error("auto: RDMA device {device} unusable")]
    AutoRdmaUnusable {
        /// The device.
        device: String,
        /// The RDMA transport's error.
        #[source]
        source: TransferError,
    },
    /// `Auto` found no usable RDMA device: TCP.
    #[error("auto: {0}")]
    AutoNoRdma(#[source] NoRdma),
}

/// Why the CUDA IPC transport does not wrap the network transport.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NoCudaIpc {
    /// `CudaIpcMode::Off`.
    #[error("off")]
    Off,
    /// The driver is present but lists no device.
    #[error("no CUDA device")]
    NoDevice,
    /// The driver's probe failed (e.g. libcuda is absent).
    #[error("{0}")]
    Driver(#[source] kvferry_cuda::CudaError),
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
    let wrap = with_cuda_ipc(ctx.config.cuda_ipc, kvferry_cuda::cuda_available());
    let transport = match wrap {
        Ok(()) => super::cuda_ipc::CudaIpcTransport::new(ctx, net.transport)?,
        Err(_) => net.transport,
    };
    Ok(Chosen {
        transport,
        why: Choice {
            cuda_ipc: Some(wrap),
            ..net.why
        },
    })
}

/// Whether the CUDA IPC transport wraps the network transport: `Ok` when `mode` allows it and
/// the driver is usable (`cuda`: the probe's device count), else why not. `Required` without a
/// driver still wraps (its registrations then fail with the reason).
fn with_cuda_ipc(
    mode: crate::config::CudaIpcMode,
    cuda: std::result::Result<u32, kvferry_cuda::CudaError>,
) -> std::result::Result<(), NoCudaIpc> {
    use crate::config::CudaIpcMode;
    match (mode, cuda) {
        (CudaIpcMode::Off, _) => Err(NoCudaIpc::Off),
        (CudaIpcMode::Required, _) => Ok(()),
        (CudaIpcMode::Auto, Ok(n)) if n > 0 => Ok(()),
        (CudaIpcMode::Auto, Ok(_)) => Err(NoCudaIpc::NoDevice),
        (CudaIpcMode::Auto, Err(e)) => Err(NoCudaIpc::Driver(e)),
    }
}

/// The network transport `ctx.config.transport` asks for (see `choose`).
fn choose_network(ctx: &TransportContext) -> Result<Chosen> {
    let chosen = |transport: Arc<dyn Transport>, network: NetworkChoice| Chosen {
        transport,
        why: Choice {
            network,
            cuda_ipc: None,
        },
    };
    let tcp = |why: NetworkChoice| -> Result<Chosen> {
        Ok(chosen(Arc::new(TcpTransport::new(ctx.clone())?), why))
    };
    match ctx.config.transport {
        TransportKind::Tcp => tcp(NetworkChoice::ConfiguredTcp),
        TransportKind::Rdma => match rdma_probe(&ctx.config.rdma) {
            Ok(dev) => Ok(chosen(
                rdma_create(ctx)?,
                NetworkChoice::ConfiguredRdma(dev),
            )),
            Err(why) => Err(TransferError::Config(ConfigError::RdmaUnusable(why))),
        },
        TransportKind::Auto => match rdma_probe(&ctx.config.rdma) {
            Ok(dev) => match rdma_create(ctx) {
                Ok(transport) => Ok(chosen(transport, NetworkChoice::AutoRdma(dev))),
                Err(e) => {
                    tracing::warn!(
                        "RDMA device {dev} found but unusable ({e}); falling back to TCP"
                    );
                    tcp(NetworkChoice::AutoRdmaUnusable {
                        device: dev,
                        source: e,
                    })
                }
            },
            Err(why) => tcp(NetworkChoice::AutoNoRdma(why)),
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
        // The driver's own error survives as the cause, and the text is unchanged.
        let no_driver = with_cuda_ipc(CudaIpcMode::Auto, none()).unwrap_err();
        assert_eq!(
            no_driver,
            NoCudaIpc::Driver(kvferry_cuda::CudaError::DriverLibraryMissing)
        );
        assert_eq!(no_driver.to_string(), "libcuda not found");
        assert_eq!(
            with_cuda_ipc(CudaIpcMode::Auto, Ok(0)),
            Err(NoCudaIpc::NoDevice)
        );
        assert_eq!(with_cuda_ipc(CudaIpcMode::Off, Ok(8)), Err(NoCudaIpc::Off));
        assert!(with_cuda_ipc(CudaIpcMode::Required, none()).is_ok());
    }

    /// The reason's text is the info line's, built from the typed choice.
    #[test]
    fn the_choice_reads_as_the_info_line() {
        let c = Choice {
            network: NetworkChoice::AutoNoRdma(NoRdma::NotBuilt),
            cuda_ipc: Some(Err(NoCudaIpc::Off)),
        };
        assert_eq!(
            c.to_string(),
            format!("auto: {}; no CUDA IPC (off)", NoRdma::NotBuilt)
        );
        let c = Choice {
            network: NetworkChoice::ConfiguredTcp,
            cuda_ipc: Some(Ok(())),
        };
        assert_eq!(
            c.to_string(),
            "configured; CUDA IPC for device memory of processes on this host"
        );
    }
}
