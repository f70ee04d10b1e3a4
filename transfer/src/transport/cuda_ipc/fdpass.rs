//! Passing exported allocations' file descriptors to a peer process of the same host: a Unix
//! socket in the abstract namespace, served by one thread, that hands out a descriptor
//! (`SCM_RIGHTS`) only against a single-use ticket. Tickets are made by the owner for a peer
//! that asked through the handshake (authenticated there in secret mode), so knowing the
//! socket's name gives nothing.
//!
//! Exchange: the peer connects and sends its 16-byte ticket; the server answers 8 bytes (the
//! allocation's size, little-endian) with the descriptor attached, or 8 zero bytes and no
//! descriptor when the ticket is unknown, used or expired. Every read and write has a deadline
//! and at most [`MAX_TICKETS`] tickets are outstanding.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sendfd::{RecvWithFd, SendWithFd};

use crate::error::{Refusal, Result, TransferError, UnsupportedError};
use crate::sync::MutexExt;

/// Outstanding tickets at most; a peer asking for more is refused until some expire or are used.
pub const MAX_TICKETS: usize = 4096;
/// A ticket not used within this long is void.
pub const TICKET_LIFETIME: Duration = Duration::from_secs(10);
/// Deadline of each read and write on the socket.
const IO_DEADLINE: Duration = Duration::from_secs(2);

/// A descriptor offered to one peer: the shared export and the allocation's size.
struct Offer {
    fd: Arc<OwnedFd>,
    size: u64,
    expires: Instant,
}

struct Shared {
    tickets: Mutex<HashMap<[u8; 16], Offer>>,
    stop: AtomicBool,
}

/// The owner's side: the listening socket, its serving thread and the ticket table. Stops when
/// dropped.
pub struct FdServer {
    name: String,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FdServer {
    /// Binds `\0kvferry-cuda-ipc-<random>` and starts serving. Errors: `Io` when the socket
    /// cannot be bound.
    pub fn start() -> Result<FdServer> {
        let r = crate::auth::random_bytes::<8>()?;
        let name = format!("kvferry-cuda-ipc-{}", hex(&r));
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| TransferError::io("name the CUDA IPC socket", e))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| TransferError::io(format!("bind the CUDA IPC socket {name}"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| TransferError::io("set the CUDA IPC socket non-blocking", e))?;
        let shared = Arc::new(Shared {
            tickets: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvferry-cuda-ipc-fd".into())
            .spawn(move || serve(listener, sh))
            .map_err(|e| TransferError::io("start the CUDA IPC socket thread", e))?;
        Ok(FdServer {
            name,
            shared,
            thread: Some(thread),
        })
    }

    /// The socket's abstract name (without the leading NUL), for the peer's [`fetch`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A fresh single-use ticket for `fd` (an allocation of `size` bytes), valid for
    /// [`TICKET_LIFETIME`]. Errors: `Unsupported` when [`MAX_TICKETS`] are outstanding.
    pub fn offer(&self, fd: Arc<OwnedFd>, size: u64) -> Result<[u8; 16]> {
        let ticket = crate::auth::random_bytes::<16>()?;
        let now = Instant::now();
        let mut t = self.shared.tickets.locked();
        t.retain(|_, o| o.expires > now);
        if t.len() >= MAX_TICKETS {
            return Err(UnsupportedError::TooManyTickets { limit: MAX_TICKETS }.into());
        }
        t.insert(
            ticket,
            Offer {
                fd,
                size,
                expires: now + TICKET_LIFETIME,
            },
        );
        Ok(ticket)
    }

    /// Tickets outstanding now (expired ones included until the next offer or use).
    pub fn outstanding(&self) -> usize {
        self.shared.tickets.locked().len()
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(listener: UnixListener, sh: Arc<Shared>) {
    while !sh.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, _)) => {
                if let Err(e) = answer(&s, &sh) {
                    tracing::debug!("CUDA IPC descriptor request: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => {
                tracing::warn!("CUDA IPC socket accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn answer(s: &UnixStream, sh: &Shared) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(IO_DEADLINE))?;
    s.set_write_timeout(Some(IO_DEADLINE))?;
    let mut ticket = [0u8; 16];
    (&*s).read_exact(&mut ticket)?;
    let offer = {
        let mut t = sh.tickets.locked();
        t.remove(&ticket).filter(|o| o.expires > Instant::now())
    };
    match offer {
        Some(o) => {
            let n = s.send_with_fd(&o.size.to_le_bytes(), &[o.fd.as_raw_fd()])?;
            if n != 8 {
                return Err(std::io::Error::other("short write of the size"));
            }
            Ok(())
        }
        None => (&*s).write_all(&[0u8; 8]),
    }
}

/// Longest wait for the server's answer: it answers one connection at a time, each within
/// `IO_DEADLINE`, so one slow connection ahead of ours plus our own exchange.
const FETCH_READ: Duration = Duration::from_secs(5);

/// The peer's side: fetches the descriptor for `ticket` from socket `name`, within the socket
/// deadline (reads up to 5 s, writes up to 2 s) and by `by` where given (the caller's overall
/// deadline: each wait ends at it). Returns the descriptor and the allocation's size. Errors:
/// `Io` for a socket failure (a read past either deadline among them); `Timeout` when `by`
/// has passed before the exchange starts; `Refused` (naming `segment`) for an unknown, used
/// or expired ticket.
pub fn fetch(
    name: &str,
    ticket: &[u8; 16],
    segment: &str,
    by: Option<Instant>,
) -> Result<(OwnedFd, u64)> {
    let io = |what: &str, e| TransferError::io(format!("{what} (CUDA IPC socket {name})"), e);
    let left = by.map_or(FETCH_READ, |b| b.saturating_duration_since(Instant::now()));
    if left.is_zero() {
        return Err(TransferError::Timeout(FETCH_READ));
    }
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| io("name", e))?;
    let s = UnixStream::connect_addr(&addr).map_err(|e| io("connect", e))?;
    s.set_read_timeout(Some(FETCH_READ.min(left)))
        .and_then(|_| s.set_write_timeout(Some(IO_DEADLINE.min(left))))
        .map_err(|e| io("set deadlines", e))?;
    (&s).write_all(ticket).map_err(|e| io("send ticket", e))?;
    let mut size = [0u8; 8];
    let mut fds: [RawFd; 1] = [-1];
    let (n, nfd) = s
        .recv_with_fd(&mut size, &mut fds)
        .map_err(|e| io("receive descriptor", e))?;
    // SAFETY: a received descriptor is new in this process and owned by nobody else.
    let fd = (nfd == 1 && fds[0] >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fds[0]) });
    if n != 8 {
        return Err(io(
            "receive size",
            std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
        ));
    }
    match fd {
        Some(fd) => Ok((fd, u64::from_le_bytes(size))),
        None => Err(TransferError::Refused {
            segment: segment.to_string(),
            why: Refusal::UnknownTicket,
        }),
    }
}

/// Lower-case hex of `b`.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Seek;

    fn memfd_with(text: &[u8]) -> OwnedFd {
        let mut f = tempfile_like();
        f.write_all(text).unwrap();
        f.rewind().unwrap();
        OwnedFd::from(f)
    }

    fn tempfile_like() -> std::fs::File {
        // An anonymous file: memfd_create through libc (no file system state left behind).
        // SAFETY: a NUL-terminated name and no flags; the fd returned is owned by the File.
        let fd = unsafe { libc::memfd_create(c"kvferry-test".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create");
        // SAFETY: fresh fd owned by nobody else.
        unsafe { std::fs::File::from_raw_fd(fd) }
    }

    #[test]
    fn a_ticket_fetches_its_descriptor_once() {
        let srv = FdServer::start().unwrap();
        let fd = Arc::new(memfd_with(b"kv bytes"));
        let t = srv.offer(fd, 4096).unwrap();
        let (got, size) = fetch(srv.name(), &t, "peer:1", None).unwrap();
        assert_eq!(size, 4096);
        let mut s = String::new();
        std::fs::File::from(got).read_to_string(&mut s).unwrap();
        assert_eq!(s, "kv bytes", "the descriptor names the same file");
        let again = fetch(srv.name(), &t, "peer:1", None).unwrap_err();
        assert!(matches!(again, TransferError::Refused { .. }), "{again}");
        assert_eq!(srv.outstanding(), 0);
    }

    #[test]
    fn an_unknown_ticket_gets_nothing() {
        let srv = FdServer::start().unwrap();
        srv.offer(Arc::new(memfd_with(b"x")), 1).unwrap();
        let e = fetch(srv.name(), &[7u8; 16], "peer:1", None).unwrap_err();
        assert!(matches!(e, TransferError::Refused { .. }), "{e}");
        assert_eq!(srv.outstanding(), 1, "the real ticket is still there");
    }

    #[test]
    fn a_silent_client_does_not_hold_the_server() {
        let srv = FdServer::start().unwrap();
        let addr = SocketAddr::from_abstract_name(srv.name().as_bytes()).unwrap();
        let _idle = UnixStream::connect_addr(&addr).unwrap();
        let t = srv.offer(Arc::new(memfd_with(b"y")), 1).unwrap();
        // served after the idle connection's read deadline
        let (_, size) = fetch(srv.name(), &t, "peer:1", None).unwrap();
        assert_eq!(size, 1);
    }

    /// A caller's deadline ends the wait for a server that does not answer (its own read
    /// deadline would let it wait 5 s).
    #[test]
    fn a_fetch_ends_at_the_callers_deadline() {
        let srv = FdServer::start().unwrap();
        let addr = SocketAddr::from_abstract_name(srv.name().as_bytes()).unwrap();
        // The server serves one connection at a time: this silent one holds it for 2 s.
        let _idle = UnixStream::connect_addr(&addr).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let t = srv.offer(Arc::new(memfd_with(b"w")), 1).unwrap();
        let t0 = Instant::now();
        let by = t0 + Duration::from_millis(300);
        let e = fetch(srv.name(), &t, "peer:1", Some(by)).unwrap_err();
        assert!(matches!(e, TransferError::Io(_)), "{e}");
        assert!(
            t0.elapsed() < Duration::from_millis(1500),
            "{:?}",
            t0.elapsed()
        );
        let e = fetch(srv.name(), &t, "peer:1", Some(t0)).unwrap_err();
        assert!(matches!(e, TransferError::Timeout(_)), "{e}");
    }

    #[test]
    fn tickets_are_budgeted() {
        let srv = FdServer::start().unwrap();
        let fd = Arc::new(memfd_with(b"z"));
        for _ in 0..MAX_TICKETS {
            srv.offer(fd.clone(), 1).unwrap();
        }
        let e = srv.offer(fd, 1).unwrap_err();
        assert!(e.to_string().contains("outstanding"), "{e}");
    }
}
