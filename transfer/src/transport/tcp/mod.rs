//! TCP transport (docs/design.md §3 "TCP transport"): the default where no RDMA device exists.
//!
//! Target side: a data listener (its port goes in `TransportInfo::details.data_port`), one
//! thread per accepted connection. In authenticated mode (`crate::auth`) every frame's token
//! must have a live grant that allows its op and covers its ranges (one hash lookup and a
//! binary search), else it is refused (`ST_DENIED`) and nothing is read or written. Every
//! request is checked against the registry in code: a
//! range not inside one registered region is refused (`ST_OUT_OF_RANGE`) and nothing is written;
//! a WRITE is acknowledged only after its payload is in place. Host memory is read and written
//! in place (no staging copy); other locations go through `MemoryAccess`.
//!
//! Initiator side: per peer, a pool of `TcpConfig::connections_per_peer` connections; slices of a
//! post are spread round-robin over them. Each connection has a writer thread (sends requests,
//! WRITE payloads straight from registered memory with one vectored write) and a reader thread
//! (reads replies in order, READ data straight into registered memory); at most
//! `inflight_per_connection` slices are in flight per connection. Every socket operation has a
//! deadline (`io_timeout`): a dead peer fails the slices within it. A broken connection fails its
//! slices (through `CompletionSink::fail_peer`, so the engine may fetch the peer's descriptor
//! again and retry them once) and is replaced on the next post. A connection is opened when its
//! first job arrives and closed (socket and threads) when it broke or idled `idle_timeout`; a
//! pool whose last connection closed is dropped ("no leaks under churn").
//!
//! Listener: at most `max_server_connections` served connections, `max_connections_per_source`
//! per source IP, and a connection's first request must arrive within `first_frame_timeout`.

mod coalesce;
mod connection;
mod pool;
mod socket;
mod target;

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{CompletionSink, Slice, Transport, TransportContext, TransportStats};
use crate::admission::Listener;
use crate::descriptor::{SegmentDescriptor, TransportInfo};
use crate::error::{ConfigError, IoError, ProtocolError, Result, TransferError, UnsupportedError};
use crate::memory::{MemoryRegion, RegionKeys, RegistrationPath, TransportKeys};
use crate::types::{Location, TransportKind};
use coalesce::coalesce;
use pool::{PeerPool, Pools};
use target::ServerShared;

/// What a TCP peer advertises in its segment descriptor (`TransportInfo::details`, wire format
/// of `TcpTransport::local_info`): the port of its data listener, on the host of its segment
/// name. Decoded with `TransportInfo::decode`; a missing or out-of-range port is a `Protocol`
/// error naming the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpPeerInfo {
    /// The data listener's TCP port (1..=65535; 0 is refused).
    pub data_port: u16,
}

/// The TCP transport. Create with [`TcpTransport::new`]; the engine owns it behind `Arc`.
pub struct TcpTransport {
    ctx: TransportContext,
    data_port: u16,
    server: Arc<ServerShared>,
    listener: Listener,
    peers: Arc<Pools>,
}

impl TcpTransport {
    /// Binds the data listener on `ctx.config.host`, port chosen by the OS, and starts serving.
    /// Errors: `Bind` when the host cannot be bound; `Config` for a slice size over the frame
    /// limit.
    pub fn new(ctx: TransportContext) -> Result<Self> {
        let (slice, tcp) = (ctx.config.slice_size, &ctx.config.tcp);
        if slice.saturating_add(slice / 4) > tcp.max_frame_payload {
            return Err(TransferError::Config(ConfigError::SliceOverFrame {
                slice_size: slice,
                max_frame_payload: tcp.max_frame_payload,
            }));
        }
        let host = ctx.config.host.clone();
        let range = ctx.config.listen_ports;
        let listener =
            crate::ports::bind_listener(crate::ports::unbracket(&host), tcp.data_port, range)
                .map_err(|e| {
                    let at = crate::ports::listen_address(&host, tcp.data_port, range);
                    TransferError::Bind(IoError::new(format!("bind TCP data listener on {at}"), e))
                })?;
        let server = Arc::new(ServerShared {
            ctx: ctx.clone(),
            stop: AtomicBool::new(false),
        });
        let listener = target::listen(listener, server.clone())?;
        Ok(TcpTransport {
            ctx,
            data_port: listener.local_addr().port(),
            server,
            listener,
            peers: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// Port of the data listener.
    pub fn data_port(&self) -> u16 {
        self.data_port
    }

    fn pool_for(&self, peer: &SegmentDescriptor) -> Result<Arc<PeerPool>> {
        let mut peers = self.peers.locked();
        if let Some(p) = peers.get(&peer.name) {
            if p.instance == peer.instance_id {
                return Ok(p.clone());
            }
        }
        let info: TcpPeerInfo = peer.transport.decode(&peer.name)?;
        if info.data_port == 0 {
            return Err(TransferError::Protocol(ProtocolError::BadField {
                what: format!("segment {}'s TCP data_port", peer.name),
                value: "0".into(),
                expected: "a port in 1..=65535",
            }));
        }
        let port = info.data_port;
        let host = peer
            .name
            .rsplit_once(':')
            .map(|(h, _)| h)
            .ok_or_else(|| TransferError::BadSegmentName(peer.name.clone()))?;
        let pool = Arc::new(PeerPool {
            segment: peer.name.clone(),
            addr: crate::ports::host_port(host, port),
            instance: peer.instance_id,
            cfg: self.ctx.config.tcp.clone(),
            ctx: self.ctx.clone(),
            conns: Mutex::new(Vec::new()),
            next: AtomicUsize::new(0),
            down: Mutex::new(None),
            pools: Arc::downgrade(&self.peers),
        });
        if let Some(old) = peers.insert(peer.name.clone(), pool.clone()) {
            old.close();
        }
        Ok(pool)
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn local_info(&self) -> TransportInfo {
        TransportInfo {
            kind: TransportKind::Tcp,
            details: json!({ "data_port": self.data_port }),
        }
    }

    fn register(&self, region: &MemoryRegion) -> Result<RegionKeys> {
        self.ctx.memory.check_region(region)?;
        if region.location != Location::Cpu {
            // The path this memory takes (docs/design.md §3): TCP moves it through pinned staging.
            tracing::info!(
                "{} region [{:#x}, +{}) registered for TCP via pinned host staging buffers",
                region.location,
                region.addr,
                region.len
            );
            return Ok(RegionKeys::new(
                RegistrationPath::Staged,
                TransportKeys::none(),
            ));
        }
        Ok(RegionKeys::default())
    }

    fn deregister(&self, _region: &MemoryRegion) -> Result<()> {
        Ok(())
    }

    fn on_handshake(&self, _peer: SocketAddr, _body: &[u8]) -> Result<Vec<u8>> {
        Err(UnsupportedError::NoConnectFrames { transport: "tcp" }.into())
    }

    fn post(
        &self,
        peer: &Arc<SegmentDescriptor>,
        slices: &[Slice],
        done: CompletionSink,
        token: Option<crate::auth::Token>,
    ) {
        if let Err(e) = peer.check_kind(TransportKind::Tcp) {
            return done.fail_all(slices.iter().map(|s| s.id), &e);
        }
        let pool = match self.pool_for(peer) {
            Ok(p) => p,
            Err(e) => return done.fail_all(slices.iter().map(|s| s.id), &e),
        };
        let tcp = &self.ctx.config.tcp;
        let token = token.map(|t| t.0).unwrap_or_default();
        for job in coalesce(
            slices,
            tcp.coalesce_bytes.min(tcp.max_frame_payload),
            &done,
            token,
        ) {
            pool.send(job);
        }
    }

    fn disconnect(&self, name: &str) {
        let old = self.peers.locked().remove(name);
        if let Some(p) = old {
            p.close();
        }
    }

    fn stats(&self) -> TransportStats {
        let peers = self.peers.locked();
        TransportStats {
            peers: peers.len(),
            connections: peers
                .values()
                .map(|p| {
                    let conns = p.conns.locked();
                    conns.iter().filter(|c| c.is_open()).count()
                })
                .sum(),
            served_connections: self.listener.active(),
        }
    }

    fn shutdown(&self) {
        let pools: Vec<_> = self.peers.locked().drain().map(|(_, p)| p).collect();
        for p in pools {
            p.close();
        }
        self.server.stop.store(true, Ordering::SeqCst);
        self.listener.stop();
        // Close served connections so no thread touches registered memory after we return.
        self.listener.close_served(self.ctx.config.tcp.io_timeout);
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        if !self.server.stop.load(Ordering::SeqCst) {
            self.shutdown();
        }
    }
}
