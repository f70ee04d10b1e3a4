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
//! pool whose last connection closed is dropped (issue 10, "no leaks under churn").
//!
//! Listener: at most `max_server_connections` served connections, `max_connections_per_source`
//! per source IP, and a connection's first request must arrive within `first_frame_timeout`.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use super::wire::{self, Request};
use super::{
    kind_mismatch, CompletionSink, Slice, Transport, TransportContext, TransportInfo,
    TransportStats,
};
use crate::admission::Sources;
use crate::config::TcpConfig;
use crate::error::{Result, TransferError};
use crate::memory::{MemoryRegion, RegionKeys, RegistrationPath};
use crate::segment::SegmentDescriptor;
use crate::types::{Location, Op};

/// The TCP transport. Create with [`TcpTransport::new`]; the engine owns it behind `Arc`.
pub struct TcpTransport {
    ctx: TransportContext,
    data_port: u16,
    server: Arc<ServerShared>,
    accept: Mutex<Option<std::thread::JoinHandle<()>>>,
    listen_addr: SocketAddr,
    peers: Arc<Pools>,
}

/// The connection pools by segment name.
type Pools = Mutex<HashMap<String, Arc<PeerPool>>>;

impl TcpTransport {
    /// Binds the data listener on `ctx.config.host`, port chosen by the OS, and starts serving.
    /// Errors: `Config` when the host cannot be bound.
    pub fn new(ctx: TransportContext) -> Result<Self> {
        let (slice, tcp) = (ctx.config.slice_size, &ctx.config.tcp);
        if slice.saturating_add(slice / 4) > tcp.max_frame_payload {
            return Err(TransferError::Config(format!(
                "slice_size {slice} (+ a merged tail of up to a quarter) exceeds tcp.max_frame_payload {}",
                tcp.max_frame_payload
            )));
        }
        let host = ctx.config.host.clone();
        let listener = TcpListener::bind((strip_brackets(&host), tcp.data_port)).map_err(|e| {
            TransferError::Config(format!("cannot bind TCP data listener on {host}: {e}"))
        })?;
        let listen_addr = listener
            .local_addr()
            .map_err(|e| TransferError::io("data listener address", e))?;
        let server = Arc::new(ServerShared {
            ctx: ctx.clone(),
            stop: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            sources: Sources::new(tcp.max_connections_per_source),
        });
        let sh = server.clone();
        let accept = std::thread::Builder::new()
            .name("kvferry-tcp-accept".into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| TransferError::io("spawn TCP accept thread", e))?;
        Ok(TcpTransport {
            ctx,
            data_port: listen_addr.port(),
            server,
            accept: Mutex::new(Some(accept)),
            listen_addr,
            peers: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// Port of the data listener.
    pub fn data_port(&self) -> u16 {
        self.data_port
    }

    fn pool_for(&self, peer: &SegmentDescriptor) -> Result<Arc<PeerPool>> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = peers.get(&peer.name) {
            if p.instance == peer.instance_id {
                return Ok(p.clone());
            }
        }
        let port = peer
            .transport
            .details
            .get("data_port")
            .and_then(|v| v.as_u64())
            .filter(|p| *p > 0 && *p <= u16::MAX as u64)
            .ok_or_else(|| {
                TransferError::Protocol(format!(
                    "segment {} advertises no valid TCP data_port",
                    peer.name
                ))
            })?;
        let host = peer.name.rsplit_once(':').map(|(h, _)| h).ok_or_else(|| {
            TransferError::InvalidArgument(format!("segment name {:?} is not host:port", peer.name))
        })?;
        let pool = Arc::new(PeerPool {
            segment: peer.name.clone(),
            addr: format!("{host}:{port}"),
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

fn strip_brackets(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn local_info(&self) -> TransportInfo {
        TransportInfo {
            kind: "tcp".into(),
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
            return Ok(RegionKeys {
                path: RegistrationPath::Staged,
                ..RegionKeys::default()
            });
        }
        Ok(RegionKeys::default())
    }

    fn deregister(&self, _region: &MemoryRegion) -> Result<()> {
        Ok(())
    }

    fn on_handshake(&self, _peer: SocketAddr, _body: &[u8]) -> Result<Vec<u8>> {
        Err(TransferError::Unsupported(
            "the tcp transport takes no connect frames".into(),
        ))
    }

    fn post(
        &self,
        peer: &Arc<SegmentDescriptor>,
        slices: Vec<Slice>,
        done: CompletionSink,
        token: Option<crate::auth::Token>,
    ) {
        if peer.transport.kind != self.name() {
            let e = kind_mismatch(self.name(), peer);
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
        let old = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        if let Some(p) = old {
            p.close();
        }
    }

    fn stats(&self) -> TransportStats {
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        TransportStats {
            peers: peers.len(),
            connections: peers
                .values()
                .map(|p| {
                    let conns = p.conns.lock().unwrap_or_else(|e| e.into_inner());
                    conns.iter().filter(|c| c.is_open()).count()
                })
                .sum(),
            served_connections: self.server.active.load(Ordering::SeqCst),
        }
    }

    fn shutdown(&self) {
        let pools: Vec<_> = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in pools {
            p.close();
        }
        self.server.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept; if that fails (no file descriptors left) the thread may
        // never wake, so it is left detached instead of blocking shutdown forever.
        let woke =
            TcpStream::connect_timeout(&self.listen_addr, Duration::from_millis(500)).is_ok();
        if let Some(t) = self.accept.lock().unwrap_or_else(|e| e.into_inner()).take() {
            if woke {
                let _ = t.join();
            }
        }
        // Close served connections so no thread touches registered memory after we return.
        for (_, s) in self
            .server
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        let deadline = Instant::now() + self.ctx.config.tcp.io_timeout;
        while self.server.active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        if !self.server.stop.load(Ordering::SeqCst) {
            self.shutdown();
        }
    }
}

// ---------------------------------------------------------------- socket helpers

fn set_buffers(s: &TcpStream, bytes: usize) {
    if bytes == 0 {
        return;
    }
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: plain setsockopt on a valid fd with a c_int value.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &v as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

fn prepare(s: &TcpStream, cfg: &TcpConfig, what: &str) -> Result<()> {
    s.set_nodelay(true)
        .map_err(|e| TransferError::io(what, e))?;
    s.set_read_timeout(Some(cfg.io_timeout))
        .map_err(|e| TransferError::io(what, e))?;
    s.set_write_timeout(Some(cfg.io_timeout))
        .map_err(|e| TransferError::io(what, e))?;
    set_buffers(s, cfg.socket_buffer);
    Ok(())
}

fn read_full(s: &mut TcpStream, buf: &mut [u8], what: &str) -> Result<()> {
    s.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            TransferError::Io(format!("{what}: connection closed by peer"))
        }
        _ => TransferError::io(what, e),
    })
}

fn write_full(s: &mut TcpStream, buf: &[u8], what: &str) -> Result<()> {
    s.write_all(buf).map_err(|e| TransferError::io(what, e))
}

/// Writes all of `parts` with vectored writes (header and payload in one syscall).
fn write_vectored_full(s: &mut TcpStream, parts: &mut [IoSlice<'_>], what: &str) -> Result<()> {
    let mut parts = parts;
    while !parts.is_empty() {
        match s.write_vectored(parts) {
            Ok(0) => {
                return Err(TransferError::Io(format!(
                    "{what}: connection closed by peer"
                )))
            }
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TransferError::io(what, e)),
        }
    }
    Ok(())
}

/// Reads and discards `n` bytes (keeps the stream in step after a refused WRITE).
fn drain(s: &mut TcpStream, mut n: u64, what: &str) -> Result<()> {
    let mut scratch = vec![0u8; (n.min(1 << 20)) as usize];
    while n > 0 {
        let k = n.min(scratch.len() as u64) as usize;
        read_full(s, &mut scratch[..k], what)?;
        n -= k as u64;
    }
    Ok(())
}

// ---------------------------------------------------------------- target side

struct ServerShared {
    ctx: TransportContext,
    stop: AtomicBool,
    active: AtomicUsize,
    /// Clones of served sockets, to close them at shutdown.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    sources: Arc<Sources>,
}

fn accept_loop(listener: TcpListener, sh: Arc<ServerShared>) {
    let max = sh.ctx.config.tcp.max_server_connections.max(1);
    for conn in listener.incoming() {
        if sh.stop.load(Ordering::SeqCst) {
            break;
        }
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("tcp accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let ticket = match s.peer_addr() {
            Ok(p) => sh.sources.admit(p.ip()).ok_or(p),
            Err(_) => continue,
        };
        let ticket = match ticket {
            Ok(t) => t,
            Err(p) => {
                tracing::warn!(peer = %p, "tcp data listener: too many connections from this source, closing one");
                continue;
            }
        };
        if sh.active.fetch_add(1, Ordering::SeqCst) >= max {
            sh.active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("tcp data listener: too many connections, closing one");
            continue;
        }
        let id = sh.next_conn.fetch_add(1, Ordering::SeqCst);
        if let Ok(c) = s.try_clone() {
            sh.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, c);
        }
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new()
            .name("kvferry-tcp-serve".into())
            .spawn(move || {
                let peer = s.peer_addr().ok();
                if let Err(e) = serve_conn(s, &sh2) {
                    tracing::debug!(?peer, "tcp data connection closed: {e}");
                }
                sh2.conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id);
                drop(ticket);
                sh2.active.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            sh.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            sh.active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("tcp data listener: cannot spawn a thread: {e}");
        }
    }
}

/// Waits for the first byte of the next request for at most `idle` (clean close on EOF or
/// idleness), then reads the rest of the header under the normal deadline.
fn read_request(s: &mut TcpStream, idle: Duration) -> Result<Option<Request>> {
    let mut hdr = [0u8; wire::REQ_LEN];
    // The socket's read timeout stays `io_timeout` (no per-request setsockopt); waiting for the
    // first byte simply tolerates timeouts until `idle` has passed.
    let start = Instant::now();
    let n = loop {
        match s.read(&mut hdr) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if start.elapsed() >= idle {
                    return Ok(None);
                }
            }
            Err(e) => return Err(TransferError::io("read request", e)),
        }
    };
    if n == 0 {
        return Ok(None);
    }
    read_full(s, &mut hdr[n..], "read request header")?;
    Request::decode(&hdr).map(Some)
}

/// Reads a connection's first request header, all of it within `first_frame_timeout` (the
/// pre-authentication deadline), then restores the socket's `io_timeout`.
fn read_first_request(s: &mut TcpStream, cfg: &TcpConfig) -> Result<Request> {
    let mut hdr = [0u8; wire::REQ_LEN];
    let deadline = Instant::now() + cfg.first_frame_timeout;
    crate::handshake::read_exact_by(s, &mut hdr, deadline, "read first request")?;
    prepare(s, cfg, "prepare served connection")?;
    Request::decode(&hdr)
}

fn reply_error(s: &mut TcpStream, status: u8, text: &str) -> Result<()> {
    let t = &text.as_bytes()[..text.len().min(wire::MAX_ERROR_TEXT as usize)];
    let h = wire::encode_reply(status, t.len() as u64);
    write_vectored_full(
        s,
        &mut [IoSlice::new(&h), IoSlice::new(t)],
        "send error reply",
    )
}

fn serve_conn(mut s: TcpStream, sh: &ServerShared) -> Result<()> {
    let cfg = &sh.ctx.config.tcp;
    prepare(&s, cfg, "prepare served connection")?;
    let idle = cfg.idle_timeout.saturating_mul(2);
    let instance = sh.ctx.instance_id;
    let mut first = Some(read_first_request(&mut s, cfg)?);
    loop {
        if sh.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let req = match first.take() {
            Some(r) => r,
            None => match read_request(&mut s, idle)? {
                Some(r) => r,
                None => return Ok(()),
            },
        };
        if req.op == wire::OP_WRITE_SCATTER {
            serve_scatter(&mut s, sh, req)?;
            continue;
        }
        let is_write = match req.op {
            wire::OP_WRITE => true,
            wire::OP_READ => false,
            op => {
                let _ = reply_error(&mut s, wire::ST_BAD_REQUEST, &format!("unknown op {op}"));
                return Err(TransferError::Protocol(format!("unknown op {op}")));
            }
        };
        if req.len == 0 || req.len > cfg.max_frame_payload {
            let text = format!(
                "request length {} is outside 1..={}",
                req.len, cfg.max_frame_payload
            );
            let _ = reply_error(&mut s, wire::ST_BAD_REQUEST, &text);
            return Err(TransferError::Protocol(text));
        }
        let op = if is_write { Op::Write } else { Op::Read };
        if let Err(d) = authorize(sh, &req, op, [(req.addr, req.len)]) {
            if is_write {
                drain(&mut s, req.len, "drain refused payload")?;
            }
            reply_error(&mut s, wire::ST_DENIED, &d)?;
            continue;
        }
        if req.instance != instance {
            if is_write {
                drain(&mut s, req.len, "drain refused payload")?;
            }
            reply_error(
                &mut s,
                wire::ST_STALE,
                &format!("request names instance {:#x}, this segment is instance {instance:#x} (restarted?)", req.instance),
            )?;
            continue;
        }
        // The read lock is held while the region's memory is accessed: unregister waits for it.
        let served = sh.ctx.registry.with_region(req.addr, req.len, |entry| {
            if is_write {
                serve_write(&mut s, sh, req, entry.region.location)
            } else {
                serve_read(&mut s, sh, req, entry.region.location)
            }
        });
        match served {
            Some(r) => r?,
            None => {
                if is_write {
                    drain(&mut s, req.len, "drain refused payload")?;
                }
                reply_error(
                    &mut s,
                    wire::ST_OUT_OF_RANGE,
                    &format!(
                        "range [{:#x}, +{}) is not inside a registered memory region",
                        req.addr, req.len
                    ),
                )?;
            }
        }
    }
}

/// In authenticated mode: the frame's token must allow `op` on every range (`crate::auth`).
/// `Err` is the refusal text for the initiator.
fn authorize(
    sh: &ServerShared,
    req: &Request,
    op: Op,
    ranges: impl IntoIterator<Item = (u64, u64)>,
) -> std::result::Result<(), String> {
    let auth = &sh.ctx.auth;
    if !auth.enforced() {
        return Ok(());
    }
    auth.grants
        .check(&crate::auth::Token(req.token), op, ranges)
        .map_err(|d| {
            tracing::debug!("tcp data frame refused: {d}");
            d.to_string()
        })
}

/// Serves a scattered WRITE (op 3): reads the piece table; when every piece lies inside a
/// registered region, reads each piece into place, else drains the payload and refuses the
/// frame (nothing written); one reply for the frame.
/// `Err` when the connection must close (a malformed frame, a broken socket).
fn serve_scatter(s: &mut TcpStream, sh: &ServerShared, req: Request) -> Result<()> {
    let cfg = &sh.ctx.config.tcp;
    let n = match wire::scatter_count(&req, cfg.max_frame_payload) {
        Ok(n) => n,
        Err(text) => {
            let _ = reply_error(s, wire::ST_BAD_REQUEST, &text);
            return Err(TransferError::Protocol(text));
        }
    };
    let mut table = vec![0u8; n * wire::PIECE_LEN];
    read_full(s, &mut table, "read scattered WRITE pieces")?;
    let pieces = match wire::decode_pieces(&table, req.len) {
        Ok(p) => p,
        Err(e) => {
            let _ = reply_error(s, wire::ST_BAD_REQUEST, &e.to_string());
            return Err(e);
        }
    };
    if let Err(d) = authorize(sh, &req, Op::Write, pieces.iter().copied()) {
        drain(s, req.len, "drain refused payload")?;
        return reply_error(s, wire::ST_DENIED, &d);
    }
    let instance = sh.ctx.instance_id;
    if req.instance != instance {
        drain(s, req.len, "drain refused payload")?;
        return reply_error(
            s,
            wire::ST_STALE,
            &format!(
                "request names instance {:#x}, this segment is instance {instance:#x} (restarted?)",
                req.instance
            ),
        );
    }
    // All or nothing: a frame with any piece outside the registered regions writes nothing.
    if let Some(&(addr, len)) = pieces
        .iter()
        .find(|&&(a, l)| sh.ctx.registry.find(a, l).is_none())
    {
        drain(s, req.len, "drain refused payload")?;
        return reply_error(
            s,
            wire::ST_OUT_OF_RANGE,
            &format!("range [{addr:#x}, +{len}) is not inside a registered memory region"),
        );
    }
    let mut failed: Option<(u8, String)> = None;
    for (addr, len) in pieces {
        // The read lock is held while the piece is written: unregister waits for it.
        let done = sh.ctx.registry.with_region(addr, len, |entry| {
            read_into(s, sh, addr, len, entry.region.location)
        });
        match done {
            Some(r) => {
                if let Err(e) = r? {
                    failed.get_or_insert((wire::ST_SERVER_ERROR, e.to_string()));
                }
            }
            None => {
                // unregistered since the check above
                drain(s, len, "drain refused payload")?;
                failed.get_or_insert((
                    wire::ST_OUT_OF_RANGE,
                    format!("range [{addr:#x}, +{len}) is not inside a registered memory region"),
                ));
            }
        }
    }
    match failed {
        None => write_full(s, &wire::encode_reply(wire::ST_OK, 0), "send WRITE ack"),
        Some((status, text)) => reply_error(s, status, &text),
    }
}

/// Reads `len` payload bytes into `[addr, +len)` at `loc`. Outer `Err`: the socket broke;
/// inner: the memory could not be written (the bytes were consumed either way).
fn read_into(
    s: &mut TcpStream,
    sh: &ServerShared,
    addr: u64,
    len: u64,
    loc: Location,
) -> Result<Result<()>> {
    match loc {
        Location::Cpu => {
            // SAFETY: the caller holds the registry's read lock on a host region containing the
            // range; registration promises it is valid writable memory.
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) };
            read_full(s, dst, "read WRITE payload")?;
            Ok(Ok(()))
        }
        other => {
            let mut staging = vec![0u8; len as usize];
            read_full(s, &mut staging, "read WRITE payload")?;
            // SAFETY: as above, for memory at `other`.
            Ok(unsafe { sh.ctx.memory.copy_to(other, addr, &staging) })
        }
    }
}

fn serve_write(s: &mut TcpStream, sh: &ServerShared, req: Request, loc: Location) -> Result<()> {
    match read_into(s, sh, req.addr, req.len, loc)? {
        Ok(()) => write_full(s, &wire::encode_reply(wire::ST_OK, 0), "send WRITE ack"),
        Err(e) => reply_error(s, wire::ST_SERVER_ERROR, &e.to_string()),
    }
}

fn serve_read(s: &mut TcpStream, sh: &ServerShared, req: Request, loc: Location) -> Result<()> {
    let h = wire::encode_reply(wire::ST_OK, req.len);
    match loc {
        Location::Cpu => {
            // SAFETY: the range lies in a registered host region, held registered by the lock.
            let src =
                unsafe { std::slice::from_raw_parts(req.addr as *const u8, req.len as usize) };
            write_vectored_full(
                s,
                &mut [IoSlice::new(&h), IoSlice::new(src)],
                "send READ data",
            )
        }
        other => {
            let mut staging = vec![0u8; req.len as usize];
            // SAFETY: as above, for memory at `other`.
            if let Err(e) = unsafe { sh.ctx.memory.copy_from(other, req.addr, &mut staging) } {
                return reply_error(s, wire::ST_SERVER_ERROR, &e.to_string());
            }
            write_vectored_full(
                s,
                &mut [IoSlice::new(&h), IoSlice::new(&staging)],
                "send READ data",
            )
        }
    }
}

// ---------------------------------------------------------------- initiator side

/// One data frame: consecutive slices (contiguous on both sides, same op and regions) merged
/// into `slice`, reported per original id in `ids`; `more` holds further WRITE pieces of a
/// scattered WRITE (op 3), each merged the same way.
struct Job {
    slice: Slice,
    ids: std::ops::Range<u32>,
    more: Vec<(Slice, std::ops::Range<u32>)>,
    sink: CompletionSink,
    /// The grant token the frame carries (zero: none).
    token: [u8; 16],
}

impl Job {
    fn complete(&self, result: Result<()>) {
        let more = self.more.iter().flat_map(|(_, ids)| ids.clone());
        for id in self.ids.clone().chain(more) {
            self.sink.complete(id, result.clone());
        }
    }

    /// Fails every slice of the frame as a failure of the peer's connection (see
    /// `CompletionSink::fail_peer`).
    fn fail_peer(&self, err: &TransferError) {
        let more = self.more.iter().flat_map(|(_, ids)| ids.clone());
        for id in self.ids.clone().chain(more) {
            self.sink.fail_peer(id, err.clone());
        }
    }

    /// Payload bytes of the frame.
    fn bytes(&self) -> u64 {
        self.slice.len + self.more.iter().map(|(s, _)| s.len).sum::<u64>()
    }
}

/// Merges runs of slices that continue each other on both sides (same op, same local region and
/// remote buffer, consecutive ids) into frames of at most `limit` bytes: fewer headers, acks and
/// syscalls per byte. Slices longer than `limit` stay whole. Then runs of small WRITE frames
/// that do not continue each other become scattered WRITEs of at most `limit` bytes and
/// `MAX_PIECES` pieces.
fn coalesce(slices: Vec<Slice>, limit: u64, sink: &CompletionSink, token: [u8; 16]) -> Vec<Job> {
    let mut out: Vec<Job> = Vec::new();
    for j in merge_continuing(slices, limit, sink, token) {
        if let Some(acc) = out.last_mut() {
            let gather = acc.slice.op == Op::Write
                && j.slice.op == Op::Write
                && acc.more.len() + 1 < wire::MAX_PIECES
                && acc.bytes() + j.slice.len <= limit;
            if gather {
                acc.more.push((j.slice, j.ids));
                continue;
            }
        }
        out.push(j);
    }
    out
}

fn merge_continuing(
    slices: Vec<Slice>,
    limit: u64,
    sink: &CompletionSink,
    token: [u8; 16],
) -> Vec<Job> {
    let mut jobs: Vec<Job> = Vec::new();
    for s in slices {
        if let Some(j) = jobs.last_mut() {
            let m = &mut j.slice;
            let continues = m.op == s.op
                && m.local_region == s.local_region
                && m.remote_buffer == s.remote_buffer
                && m.local_addr + m.len == s.local_addr
                && m.remote_addr + m.len == s.remote_addr
                && j.ids.end == s.id
                && m.len + s.len <= limit;
            if continues {
                m.len += s.len;
                j.ids.end += 1;
                continue;
            }
        }
        jobs.push(Job {
            slice: s,
            ids: s.id..s.id + 1,
            more: Vec::new(),
            sink: sink.clone(),
            token,
        });
    }
    jobs
}

/// The connections to one peer instance.
struct PeerPool {
    segment: String,
    addr: String,
    instance: u64,
    cfg: TcpConfig,
    ctx: TransportContext,
    conns: Mutex<Vec<Arc<Conn>>>,
    next: AtomicUsize,
    /// Set when a connect failed: until the instant, jobs fail at once with that error instead
    /// of each spawning a connection attempt.
    down: Mutex<Option<(Instant, TransferError)>>,
    /// The transport's pools: the last connection to close removes this pool from them.
    pools: std::sync::Weak<Pools>,
}

/// One data connection: a job queue feeding its writer thread. `tx` is `None` once the
/// connection stopped taking jobs (broken, idle or closed); jobs already queued are still
/// reported by the writer.
struct Conn {
    tx: Mutex<Option<Sender<Job>>>,
    stream: Mutex<Option<TcpStream>>,
}

impl Conn {
    /// True while the socket is open (connected, not yet ended).
    fn is_open(&self) -> bool {
        self.stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn close(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(s) = self
            .stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl PeerPool {
    fn send(self: &Arc<Self>, mut job: Job) {
        if let Some((until, e)) = self.down.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            if Instant::now() < *until {
                return job.fail_peer(e);
            }
        }
        let want = self.cfg.connections_per_peer.max(1);
        let i = self.next.fetch_add(1, Ordering::Relaxed) % want;
        // two tries: the chosen connection may have just gone idle or broken
        for _ in 0..2 {
            let conn = {
                let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
                while conns.len() < want {
                    conns.push(self.spawn_conn());
                }
                conns[i].clone()
            };
            let r = {
                let tx = conn.tx.lock().unwrap_or_else(|e| e.into_inner());
                match tx.as_ref() {
                    Some(tx) => tx.send(job).map_err(|e| e.0),
                    None => Err(job),
                }
            };
            match r {
                Ok(()) => return,
                Err(j) => {
                    job = j;
                    let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
                    if conns.get(i).is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                        conns[i] = self.spawn_conn();
                    }
                }
            }
        }
        job.fail_peer(&TransferError::Io(format!(
            "no usable TCP connection to segment {}",
            self.segment
        )));
    }

    /// A connection's writer ended: forget the connection, and the pool when it was the last.
    fn conn_ended(self: &Arc<Self>, conn: &Arc<Conn>) {
        let Some(pools) = self.pools.upgrade() else {
            return;
        };
        let mut pools = pools.lock().unwrap_or_else(|e| e.into_inner());
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        conns.retain(|c| !Arc::ptr_eq(c, conn));
        let ours = pools
            .get(&self.segment)
            .is_some_and(|p| Arc::ptr_eq(p, self));
        // A post that took this pool just before still works: its connections serve it, and
        // the next post makes a new pool. (A recent connect failure's fast-fail mark goes with
        // the pool; the engine's descriptor refresh handles the dead peer then.)
        if ours && conns.is_empty() {
            pools.remove(&self.segment);
        }
    }

    fn spawn_conn(self: &Arc<Self>) -> Arc<Conn> {
        let (tx, rx) = mpsc::channel::<Job>();
        let conn = Arc::new(Conn {
            tx: Mutex::new(Some(tx)),
            stream: Mutex::new(None),
        });
        let pool = self.clone();
        let c = conn.clone();
        let spawned = std::thread::Builder::new()
            .name("kvferry-tcp-writer".into())
            .spawn(move || pool.writer(c, rx));
        if let Err(e) = spawned {
            tracing::warn!("cannot spawn a TCP writer thread: {e}");
            conn.close();
        }
        conn
    }

    fn close(&self) {
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            c.close();
        }
    }

    fn connect(&self) -> Result<TcpStream> {
        let what = format!(
            "connect to TCP data port {} of segment {}",
            self.addr, self.segment
        );
        let addrs: Vec<SocketAddr> = self
            .addr
            .to_socket_addrs()
            .map_err(|e| TransferError::io(&what, e))?
            .collect();
        let mut last = TransferError::Io(format!("{what}: no address"));
        for a in addrs {
            match TcpStream::connect_timeout(&a, self.cfg.io_timeout) {
                Ok(s) => {
                    prepare(&s, &self.cfg, &what)?;
                    return Ok(s);
                }
                Err(e) => last = TransferError::io(&what, e),
            }
        }
        Err(last)
    }

    /// Stops taking jobs, then fails every job still queued with `err`.
    fn retire(conn: &Conn, rx: &Receiver<Job>, err: &TransferError) {
        conn.close();
        while let Ok(j) = rx.try_recv() {
            j.fail_peer(err);
        }
    }

    fn writer(self: Arc<Self>, conn: Arc<Conn>, rx: Receiver<Job>) {
        self.run_writer(&conn, rx);
        // Out of the pool now (not when a later post replaces it): with the last `Arc` the
        // socket clone kept for `close` goes too (only that fd: the reader may still be reading
        // the replies in flight on its own).
        self.conn_ended(&conn);
    }

    /// The first job, or `None` when none came within `idle_timeout` (the connection is then
    /// never opened).
    fn first_job(conn: &Conn, rx: &Receiver<Job>, idle: Duration) -> Option<Job> {
        match rx.recv_timeout(idle) {
            Ok(j) => Some(j),
            Err(RecvTimeoutError::Timeout) => {
                conn.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
                rx.try_recv().ok() // one that slipped in before we stopped taking jobs
            }
            Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    fn run_writer(self: &Arc<Self>, conn: &Arc<Conn>, rx: Receiver<Job>) {
        let conn = conn.clone();
        // connect only once there is a job: the target closes a connection whose first
        // request does not come within its first-frame deadline
        let Some(first) = Self::first_job(&conn, &rx, self.cfg.idle_timeout) else {
            return;
        };
        let mut s = match self.connect() {
            Ok(s) => s,
            Err(e) => {
                let until = Instant::now() + self.cfg.io_timeout.min(Duration::from_secs(1));
                *self.down.lock().unwrap_or_else(|e| e.into_inner()) = Some((until, e.clone()));
                first.fail_peer(&e);
                return Self::retire(&conn, &rx, &e);
            }
        };
        let read_half = match s.try_clone() {
            Ok(r) => r,
            Err(e) => {
                let e = TransferError::io("clone socket", e);
                first.fail_peer(&e);
                return Self::retire(&conn, &rx, &e);
            }
        };
        if let Ok(c) = s.try_clone() {
            *conn.stream.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
        }
        let (ftx, frx) = mpsc::sync_channel::<Job>(self.cfg.inflight_per_connection.max(1));
        let pool = self.clone();
        let c2 = conn.clone();
        let reader = std::thread::Builder::new()
            .name("kvferry-tcp-reader".into())
            .spawn(move || pool.reader(c2, read_half, frx));
        if let Err(e) = reader {
            let e = TransferError::io("spawn TCP reader thread", e);
            first.fail_peer(&e);
            return Self::retire(&conn, &rx, &e);
        }
        if !self.send_one(&mut s, &ftx, first, &conn, &rx) {
            return;
        }
        loop {
            let job = match rx.recv_timeout(self.cfg.idle_timeout) {
                Ok(j) => j,
                Err(RecvTimeoutError::Timeout) => {
                    // idle: stop taking jobs, then serve any that slipped in before
                    conn.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
                    let mut ok = true;
                    while let Ok(j) = rx.try_recv() {
                        if ok {
                            ok = self.send_one(&mut s, &ftx, j, &conn, &rx);
                        } else {
                            j.fail_peer(&TransferError::Io("connection closed".into()));
                        }
                    }
                    break;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            };
            if !self.send_one(&mut s, &ftx, job, &conn, &rx) {
                return;
            }
        }
        // dropping `ftx` lets the reader finish the in-flight replies and exit
    }

    /// Sends one job; on failure retires the connection and returns false.
    fn send_one(
        &self,
        s: &mut TcpStream,
        ftx: &SyncSender<Job>,
        job: Job,
        conn: &Conn,
        rx: &Receiver<Job>,
    ) -> bool {
        if job.sink.is_cancelled() {
            job.complete(Err(CompletionSink::cancelled_error()));
            return true;
        }
        if !job.more.is_empty() {
            return self.send_scatter(s, ftx, job, conn, rx);
        }
        let sl = job.slice;
        let req = Request {
            op: if sl.op == Op::Write {
                wire::OP_WRITE
            } else {
                wire::OP_READ
            },
            instance: self.instance,
            addr: sl.remote_addr,
            len: sl.len,
            token: job.token,
        };
        let hdr = req.encode();
        let payload = match sl.op {
            Op::Read => Cow::Borrowed(&[][..]),
            // SAFETY: the engine checked the slice lies in a registered region, which the caller
            // keeps valid until the batch finishes.
            Op::Write => match unsafe { self.write_payload(&sl) } {
                Ok(p) => p,
                Err(e) => {
                    job.complete(Err(e));
                    return true;
                }
            },
        };
        let mut parts = [IoSlice::new(&hdr), IoSlice::new(&payload)];
        self.send_frame(s, ftx, job, conn, rx, &mut parts)
    }

    /// Puts `job` in flight, then writes its frame `parts`; on failure retires the connection
    /// and returns false.
    fn send_frame(
        &self,
        s: &mut TcpStream,
        ftx: &SyncSender<Job>,
        job: Job,
        conn: &Conn,
        rx: &Receiver<Job>,
        parts: &mut [IoSlice<'_>],
    ) -> bool {
        // in flight before sending, so the reader expects the reply; blocks when the window is full
        if let Err(mpsc::SendError(job)) = ftx.send(job) {
            let e = TransferError::Io(format!("TCP connection to segment {} broke", self.segment));
            job.fail_peer(&e);
            Self::retire(conn, rx, &e);
            return false;
        }
        let what = format!("send to segment {}", self.segment);
        if let Err(e) = write_vectored_full(s, parts, &what) {
            // the reader fails the in-flight slices when its read breaks
            let _ = s.shutdown(Shutdown::Both);
            Self::retire(conn, rx, &e);
            return false;
        }
        true
    }

    /// The bytes a WRITE slice sends: host memory in place, other locations (GPU) copied out
    /// through the memory backend.
    ///
    /// # Safety
    /// `[sl.local_addr, +sl.len)` is registered memory at `sl.local_region.location`, valid
    /// for as long as the returned bytes are used.
    unsafe fn write_payload<'a>(&self, sl: &Slice) -> Result<Cow<'a, [u8]>> {
        match sl.local_region.location {
            // SAFETY: forwarded from the caller.
            Location::Cpu => Ok(Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(sl.local_addr as *const u8, sl.len as usize)
            })),
            loc => {
                let mut b = vec![0u8; sl.len as usize];
                // SAFETY: forwarded from the caller.
                unsafe { self.ctx.memory.copy_from(loc, sl.local_addr, &mut b) }?;
                Ok(Cow::Owned(b))
            }
        }
    }

    /// Sends a scattered WRITE (op 3); as `send_one`.
    fn send_scatter(
        &self,
        s: &mut TcpStream,
        ftx: &SyncSender<Job>,
        job: Job,
        conn: &Conn,
        rx: &Receiver<Job>,
    ) -> bool {
        let pieces: Vec<Slice> = std::iter::once(job.slice)
            .chain(job.more.iter().map(|(sl, _)| *sl))
            .collect();
        let table = wire::encode_pieces(
            &pieces
                .iter()
                .map(|p| (p.remote_addr, p.len))
                .collect::<Vec<_>>(),
        );
        let hdr = Request {
            op: wire::OP_WRITE_SCATTER,
            instance: self.instance,
            addr: pieces.len() as u64,
            len: job.bytes(),
            token: job.token,
        }
        .encode();
        // Payloads (GPU pieces copied out) are kept alive until the frame is written.
        let mut payloads: Vec<Cow<'_, [u8]>> = Vec::with_capacity(pieces.len());
        for p in &pieces {
            // SAFETY: as in `send_one`.
            match unsafe { self.write_payload(p) } {
                Ok(b) => payloads.push(b),
                Err(e) => {
                    job.complete(Err(e));
                    return true;
                }
            }
        }
        let mut parts: Vec<IoSlice<'_>> = Vec::with_capacity(pieces.len() + 2);
        parts.push(IoSlice::new(&hdr));
        parts.push(IoSlice::new(&table));
        parts.extend(payloads.iter().map(|b| IoSlice::new(b)));
        self.send_frame(s, ftx, job, conn, rx, &mut parts)
    }

    fn reader(self: Arc<Self>, conn: Arc<Conn>, mut s: TcpStream, frx: Receiver<Job>) {
        let mut broken: Option<TransferError> = None;
        for job in frx.iter() {
            if let Some(e) = &broken {
                job.fail_peer(e);
                continue;
            }
            match self.read_reply(&mut s, &job.slice, !job.more.is_empty()) {
                Ok(Reply::Done(result)) => job.complete(result),
                Ok(Reply::Stale(e)) => job.fail_peer(&e),
                Err(e) => {
                    job.fail_peer(&e);
                    conn.close();
                    broken = Some(e);
                }
            }
        }
        let _ = s.shutdown(Shutdown::Both);
    }

    /// Reads one reply. `Err`: the connection is unusable. `Reply`: the slice's result.
    /// `scatter`: the frame was a scattered WRITE starting with `sl`.
    fn read_reply(&self, s: &mut TcpStream, sl: &Slice, scatter: bool) -> Result<Reply> {
        let what = format!("reply from segment {}", self.segment);
        let mut h = [0u8; wire::REP_LEN];
        read_full(s, &mut h, &what)?;
        let (status, len) = wire::decode_reply(&h)?;
        if status != wire::ST_OK {
            if len > wire::MAX_ERROR_TEXT {
                return Err(TransferError::Protocol(format!(
                    "{what}: error text of {len} bytes"
                )));
            }
            let mut t = vec![0u8; len as usize];
            read_full(s, &mut t, &what)?;
            let text = String::from_utf8_lossy(&t).into_owned();
            let err = match status {
                wire::ST_OUT_OF_RANGE if scatter => TransferError::Failed(format!(
                    "segment {} refused a scattered WRITE: {text}",
                    self.segment
                )),
                wire::ST_OUT_OF_RANGE => TransferError::RemoteOutOfRange {
                    segment: self.segment.clone(),
                    addr: sl.remote_addr,
                    len: sl.len,
                },
                wire::ST_DENIED => TransferError::Unauthorized(format!(
                    "segment {} refused the request: {text}",
                    self.segment
                )),
                wire::ST_STALE => {
                    return Ok(Reply::Stale(TransferError::Failed(format!(
                        "segment {}: {text}",
                        self.segment
                    ))))
                }
                _ => TransferError::Failed(format!(
                    "segment {} refused the request: {text}",
                    self.segment
                )),
            };
            if status == wire::ST_BAD_REQUEST {
                return Err(err); // the target closes after a bad request
            }
            return Ok(Reply::Done(Err(err)));
        }
        let expect = if sl.op == Op::Read { sl.len } else { 0 };
        if len != expect {
            return Err(TransferError::Protocol(format!(
                "{what}: {len} data bytes, expected {expect}"
            )));
        }
        if sl.op == Op::Read {
            match sl.local_region.location {
                Location::Cpu => {
                    // SAFETY: the slice lies in a registered host region (checked by the engine).
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(sl.local_addr as *mut u8, sl.len as usize)
                    };
                    read_full(s, dst, &what)?;
                }
                loc => {
                    let mut staging = vec![0u8; sl.len as usize];
                    read_full(s, &mut staging, &what)?;
                    // SAFETY: as above, for memory at `loc`.
                    if let Err(e) = unsafe { self.ctx.memory.copy_to(loc, sl.local_addr, &staging) }
                    {
                        return Ok(Reply::Done(Err(e)));
                    }
                }
            }
        }
        Ok(Reply::Done(Ok(())))
    }
}

/// A reply's outcome for its slices.
enum Reply {
    /// The slices' result.
    Done(Result<()>),
    /// The target is another instance than the descriptor names (it restarted).
    Stale(TransferError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::completion::BatchState;

    #[test]
    fn coalesce_merges_only_continuing_slices_up_to_the_limit() {
        let region = MemoryRegion {
            addr: 0,
            len: 1 << 30,
            location: Location::Cpu,
        };
        let mk = |id: u32, op: Op, l: u64, r: u64, len: u64, buf: usize| Slice {
            id,
            op,
            local_addr: l,
            local_region: region,
            remote_addr: r,
            remote_buffer: buf,
            len,
        };
        let slices = vec![
            mk(0, Op::Write, 0, 1000, 100, 0),
            mk(1, Op::Write, 100, 1100, 100, 0), // continues 0
            mk(2, Op::Write, 200, 1300, 100, 0), // remote gap
            mk(3, Op::Read, 300, 1400, 100, 0),  // other op
            mk(4, Op::Read, 400, 1500, 100, 1),  // other buffer
            mk(5, Op::Read, 500, 1600, 100, 1),  // continues 4
            mk(6, Op::Read, 600, 1700, 100, 1),  // would exceed 250
        ];
        let sink = CompletionSink::new(BatchState::new(7));
        let jobs = coalesce(slices, 250, &sink, [0; 16]);
        let got: Vec<(std::ops::Range<u32>, u64, u64)> = jobs
            .iter()
            .map(|j| (j.ids.clone(), j.slice.local_addr, j.slice.len))
            .collect();
        assert_eq!(
            got,
            vec![
                (0..2, 0, 200),
                (2..3, 200, 100),
                (3..4, 300, 100),
                (4..6, 400, 200),
                (6..7, 600, 100)
            ]
        );
    }

    #[test]
    fn small_writes_that_do_not_continue_are_gathered_into_scattered_frames() {
        let region = MemoryRegion {
            addr: 0,
            len: 1 << 30,
            location: Location::Cpu,
        };
        let mk = |id: u32, op: Op, l: u64, r: u64, len: u64| Slice {
            id,
            op,
            local_addr: l,
            local_region: region,
            remote_addr: r,
            remote_buffer: 0,
            len,
        };
        let sink = CompletionSink::new(BatchState::new(8));
        let slices = vec![
            mk(0, Op::Write, 0, 5000, 100),
            mk(1, Op::Write, 100, 5100, 50), // continues 0: merged into its piece
            mk(2, Op::Write, 900, 100, 60),  // gathered as a second piece
            mk(3, Op::Write, 2000, 9000, 100), // 310 bytes in all: over 300, a new frame
            mk(4, Op::Read, 3000, 7000, 10), // reads are never gathered
            mk(5, Op::Write, 4000, 1000, 10),
            mk(6, Op::Write, 4100, 1200, 400), // alone over the limit: its own frame
        ];
        let jobs = coalesce(slices, 300, &sink, [0; 16]);
        let shape: Vec<Vec<(std::ops::Range<u32>, u64)>> = jobs
            .iter()
            .map(|j| {
                std::iter::once((j.ids.clone(), j.slice.len))
                    .chain(j.more.iter().map(|(s, ids)| (ids.clone(), s.len)))
                    .collect()
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                vec![(0..2, 150), (2..3, 60)],
                vec![(3..4, 100)],
                vec![(4..5, 10)],
                vec![(5..6, 10)],
                vec![(6..7, 400)],
            ]
        );
        // at most MAX_PIECES pieces per frame
        let many: Vec<Slice> = (0..(wire::MAX_PIECES as u32 + 5))
            .map(|i| mk(i, Op::Write, i as u64 * 10, i as u64 * 10 + 3, 1))
            .collect();
        let sink = CompletionSink::new(BatchState::new(many.len() as u32));
        let jobs = coalesce(many, 1 << 20, &sink, [0; 16]);
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].more.len() + 1, wire::MAX_PIECES);
        assert_eq!(jobs[1].more.len() + 1, 5);
    }
}
