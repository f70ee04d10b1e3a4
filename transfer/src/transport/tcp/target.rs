//! Target side of the TCP transport: the data listener's accept loop and the per-connection
//! server that checks and serves READ, WRITE and scattered WRITE frames.

use std::io::{IoSlice, Read};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::socket::{drain, prepare, read_full, write_full, write_vectored_full};
use crate::admission::{Admitted, Limits, Listener, Names};
use crate::auth::Denied;
use crate::config::TcpConfig;
use crate::error::{ProtocolError, Result, TransferError};
use crate::transport::wire::{self, Request};
use crate::transport::TransportContext;
use crate::types::{Location, Op};

/// What every served data connection shares.
pub(super) struct ServerShared {
    pub(super) ctx: TransportContext,
    /// Set at shutdown: served connections stop at their next request.
    pub(super) stop: AtomicBool,
}

/// Starts the data listener on `listener` (limits from `ctx.config.tcp`).
pub(super) fn listen(listener: TcpListener, sh: Arc<ServerShared>) -> Result<Listener> {
    let names = Names {
        label: "tcp data listener",
        accept_thread: "kvferry-tcp-accept",
        conn_thread: "kvferry-tcp-serve",
    };
    let limits = Limits::of(&sh.ctx.config.tcp);
    let serve = move |c: Admitted| {
        let peer = c.peer;
        if let Err(e) = serve_conn(c, &sh) {
            tracing::debug!(%peer, "tcp data connection closed: {e}");
        }
    };
    Listener::start(listener, names, limits, Arc::new(serve))
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

/// Reads a connection's first request header, all of it by `deadline` (the
/// pre-authentication deadline the listener set), then restores the socket's `io_timeout`.
fn read_first_request(s: &mut TcpStream, cfg: &TcpConfig, deadline: Instant) -> Result<Request> {
    let mut hdr = [0u8; wire::REQ_LEN];
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

fn serve_conn(c: Admitted, sh: &ServerShared) -> Result<()> {
    let mut s = c.stream;
    let cfg = &sh.ctx.config.tcp;
    prepare(&s, cfg, "prepare served connection")?;
    let idle = cfg.idle_timeout.saturating_mul(2);
    let instance = sh.ctx.instance_id;
    let mut first = Some(read_first_request(&mut s, cfg, c.first_frame_deadline)?);
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
                return Err(TransferError::Protocol(ProtocolError::UnknownOp(op)));
            }
        };
        if req.len == 0 || req.len > cfg.max_frame_payload {
            let e = ProtocolError::Mismatch {
                what: "request length".into(),
                got: req.len,
                expected: format!("1..={}", cfg.max_frame_payload),
            };
            let _ = reply_error(&mut s, wire::ST_BAD_REQUEST, &e.to_string());
            return Err(TransferError::Protocol(e));
        }
        let op = if is_write { Op::Write } else { Op::Read };
        if let Err(d) = authorize(sh, &req, op, [(req.addr, req.len)]) {
            if is_write {
                drain(&mut s, req.len, "drain refused payload")?;
            }
            reply_error(&mut s, wire::ST_DENIED, &d.to_string())?;
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
/// `Err` is why not (its text goes back to the initiator).
fn authorize(
    sh: &ServerShared,
    req: &Request,
    op: Op,
    ranges: impl IntoIterator<Item = (u64, u64)>,
) -> std::result::Result<(), Denied> {
    let auth = &sh.ctx.auth;
    if !auth.enforced() {
        return Ok(());
    }
    auth.grants
        .check(&crate::auth::Token(req.token), op, ranges)
        .inspect_err(|d| tracing::debug!("tcp data frame refused: {d}"))
}

/// Serves a scattered WRITE (op 3): reads the piece table; when every piece lies inside a
/// registered region, reads each piece into place, else drains the payload and refuses the
/// frame (nothing written); one reply for the frame.
/// `Err` when the connection must close (a malformed frame, a broken socket).
fn serve_scatter(s: &mut TcpStream, sh: &ServerShared, req: Request) -> Result<()> {
    let cfg = &sh.ctx.config.tcp;
    let n = match wire::scatter_count(&req, cfg.max_frame_payload) {
        Ok(n) => n,
        Err(e) => {
            let _ = reply_error(s, wire::ST_BAD_REQUEST, &e.to_string());
            return Err(e);
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
        return reply_error(s, wire::ST_DENIED, &d.to_string());
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
            // SAFETY: the caller holds the registry's read lock on a region at `other` that
            // contains the range (unregister waits for the lock); `copy_to` writes
            // `staging.len() == len` bytes.
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
            // SAFETY: the range lies in a registered host region, held registered by the
            // caller's read lock while the bytes are sent.
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
            // SAFETY: the range lies in a registered region at `other`, held registered by the
            // caller's read lock; `copy_from` reads `staging.len() == req.len` bytes.
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
