//! One initiator data connection: its writer thread sends frames (WRITE payloads straight from
//! registered memory), its reader thread reads the replies in order.

use crate::sync::MutexExt;
use std::borrow::Cow;
use std::io::IoSlice;
use std::net::{Shutdown, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::coalesce::Job;
use super::pool::{Conn, PeerPool};
use super::socket::{read_full, write_vectored_full};
use crate::error::{AuthError, PeerText, ProtocolError, Refusal, Result, TransferError};
use crate::transport::wire::{self, Request};
use crate::transport::{CompletionSink, Slice};
use crate::types::{Location, Op};

impl PeerPool {
    pub(super) fn run_writer(self: &Arc<Self>, conn: &Arc<Conn>, rx: Receiver<Job>) {
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
                *self.down.locked() = Some((until, e.clone()));
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
            *conn.stream.locked() = Some(c);
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
                    conn.tx.locked().take();
                    let mut ok = true;
                    while let Ok(j) = rx.try_recv() {
                        if ok {
                            ok = self.send_one(&mut s, &ftx, j, &conn, &rx);
                        } else {
                            j.fail_peer(&TransferError::io_kind(
                                format!("send to segment {}", self.segment),
                                std::io::ErrorKind::NotConnected,
                                "connection closed",
                            ));
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
            let e = TransferError::io_kind(
                format!("TCP connection to segment {}", self.segment),
                std::io::ErrorKind::BrokenPipe,
                "broke",
            );
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
            // SAFETY: this function's contract: `[local_addr, +len)` is registered host memory,
            // valid for as long as the returned bytes are used.
            Location::Cpu => Ok(Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(sl.local_addr as *const u8, sl.len as usize)
            })),
            loc => {
                let mut b = vec![0u8; sl.len as usize];
                // SAFETY: this function's contract: `[local_addr, +len)` is registered memory at
                // `loc`, valid now; `copy_from` reads `b.len() == len` bytes of it.
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
            // SAFETY: every piece is a slice the engine checked lies in a registered region,
            // which the caller keeps valid until the batch finishes; the payloads are dropped
            // once the frame is written, before the batch can finish.
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
                return Err(TransferError::Protocol(ProtocolError::TooLarge {
                    what: format!("{what}: error text bytes"),
                    len,
                    limit: wire::MAX_ERROR_TEXT,
                }));
            }
            let mut t = vec![0u8; len as usize];
            read_full(s, &mut t, &what)?;
            let err = reply_error(&self.segment, status, &t, sl, scatter);
            if status == wire::ST_STALE {
                return Ok(Reply::Stale(err));
            }
            if status == wire::ST_BAD_REQUEST {
                return Err(err); // the target closes after a bad request
            }
            return Ok(Reply::Done(Err(err)));
        }
        let expect = if sl.op == Op::Read { sl.len } else { 0 };
        if len != expect {
            return Err(TransferError::Protocol(ProtocolError::Mismatch {
                what: format!("{what}: data bytes"),
                got: len,
                expected: expect.to_string(),
            }));
        }
        if sl.op == Op::Read {
            match sl.local_region.location {
                Location::Cpu => {
                    // SAFETY: the engine checked the slice lies in a registered host region, which
                    // the caller keeps valid until the batch finishes (after this reply is read).
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(sl.local_addr as *mut u8, sl.len as usize)
                    };
                    read_full(s, dst, &what)?;
                }
                loc => {
                    let mut staging = vec![0u8; sl.len as usize];
                    read_full(s, &mut staging, &what)?;
                    // SAFETY: the engine checked the slice lies in a registered region at `loc`,
                    // kept valid until the batch finishes; `copy_to` writes `staging.len() ==
                    // len` bytes.
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

/// The error for a reply of `status` (not `ST_OK`) from target `segment` to slice `sl` (sent
/// scattered or not), with the target's error text `text`, which is kept bounded and escaped
/// ([`PeerText`]): a target cannot flood or break the lines its words are logged on.
fn reply_error(segment: &str, status: u8, text: &[u8], sl: &Slice, scatter: bool) -> TransferError {
    let text = PeerText::from_bytes(text);
    let segment = segment.to_string();
    match status {
        wire::ST_OUT_OF_RANGE if scatter => TransferError::Refused {
            segment,
            why: Refusal::Scattered(text),
        },
        wire::ST_OUT_OF_RANGE => TransferError::RemoteOutOfRange {
            segment,
            addr: sl.remote_addr,
            len: sl.len,
        },
        wire::ST_DENIED => TransferError::Auth(AuthError::Refused { segment, text }),
        wire::ST_STALE => TransferError::Stale { segment, text },
        _ => TransferError::Refused {
            segment,
            why: Refusal::Peer(text),
        },
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
    use crate::memory::MemoryRegion;

    #[test]
    fn a_targets_error_text_is_bounded_escaped_and_typed_by_its_status() {
        let sl = Slice {
            id: 0,
            op: Op::Write,
            local_addr: 0x1000,
            local_region: MemoryRegion {
                addr: 0x1000,
                len: 8,
                location: Location::Cpu,
            },
            remote_addr: 0x2000,
            remote_buffer: 0,
            len: 8,
        };
        let flood = format!("no live grant\n\u{1b}[2J{}", "x".repeat(1 << 16));
        for status in [
            wire::ST_SERVER_ERROR,
            wire::ST_BAD_REQUEST,
            wire::ST_DENIED,
            wire::ST_STALE,
        ] {
            let e = reply_error("h:1", status, flood.as_bytes(), &sl, false);
            let text = e.to_string();
            assert!(!text.contains('\n') && !text.contains('\u{1b}'), "{text}");
            assert!(text.contains("no live grant\\n\\u{1b}[2J"), "{text}");
            assert!(
                text.len() < PeerText::MAX_CHARS + 64,
                "{} bytes",
                text.len()
            );
            assert!(text.ends_with("..."), "{text}");
        }
        let denied = reply_error("h:1", wire::ST_DENIED, b"no grant", &sl, false);
        assert!(matches!(
            denied,
            TransferError::Auth(AuthError::Refused { .. })
        ));
        let stale = reply_error("h:1", wire::ST_STALE, b"instance 2", &sl, false);
        assert!(matches!(stale, TransferError::Stale { .. }));
        let scattered = reply_error("h:1", wire::ST_OUT_OF_RANGE, b"piece 3", &sl, true);
        assert!(matches!(
            scattered,
            TransferError::Refused {
                why: Refusal::Scattered(_),
                ..
            }
        ));
        assert_eq!(
            scattered.to_string(),
            "segment h:1 refused the request: scattered WRITE: piece 3"
        );
        let out = reply_error("h:1", wire::ST_OUT_OF_RANGE, b"", &sl, false);
        assert!(matches!(
            out,
            TransferError::RemoteOutOfRange {
                addr: 0x2000,
                len: 8,
                ..
            }
        ));
    }
}
