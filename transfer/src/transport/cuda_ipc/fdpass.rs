//! Passing exported allocations' file descriptors to a peer process of the same host: a Unix
//! socket in the abstract namespace, served by one thread, that hands out a descriptor
//! (`SCM_RIGHTS`) only against a single-use ticket. Tickets are made by the owner for a peer
//! that asked through the handshake (authenticated there in secret mode), so knowing the
//! socket's name gives nothing.
//!
//! Exchange: the peer connects and sends its 16-byte ticket; the server answers 8 bytes (the
//! allocation's size, little-endian) with the descriptor attached, or 8 zero bytes and no
//! descriptor when the ticket is unknown, used or expired. A process of another user (the
//! socket's `SO_PEERCRED`; abstract sockets have no file permissions) is answered 8 bytes of
//! `0xff` at once, before anything is read, so it holds the server no time. Every connect,
//! read and write has a deadline and at most [`MAX_TICKETS`] tickets are outstanding. A
//! received descriptor is close-on-exec from the moment it exists, so a child the process
//! forks and execs elsewhere never inherits a peer's allocation.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sendfd::SendWithFd;

use crate::error::{Refusal, Result, TransferError, UnsupportedError};
use crate::sync::MutexExt;

/// Outstanding tickets at most; a peer asking for more is refused until some expire or are used.
pub const MAX_TICKETS: usize = 4096;
/// A ticket not used within this long is void.
pub const TICKET_LIFETIME: Duration = Duration::from_secs(10);
/// Deadline of each read and write on the socket.
const IO_DEADLINE: Duration = Duration::from_secs(2);
/// The answer to a process of another user: no allocation is this large.
const OTHER_USER: [u8; 8] = [0xff; 8];

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
    let own = own_uid();
    while !sh.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, _)) => match peer_uid(&s) {
                Some(uid) if uid == own => {
                    if let Err(e) = answer(&s, &sh) {
                        tracing::debug!("CUDA IPC descriptor request: {e}");
                    }
                }
                uid => {
                    // Refused before anything is read: a fresh socket's buffer takes the 8
                    // bytes.
                    let _ = s.set_nonblocking(true);
                    let _ = (&s).write_all(&OTHER_USER);
                    tracing::debug!(
                        ?uid,
                        "CUDA IPC descriptor request from another user refused"
                    );
                }
            },
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

/// The effective user id of the process at the other end of `s` (`SO_PEERCRED`, as it was
/// when that process connected); `None` when the kernel does not say.
fn peer_uid(s: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let size = std::mem::size_of::<libc::ucred>();
    let mut len = size as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals, `len` holding `cred`'s size; the descriptor
    // is the stream's own, open for this call.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0 && len as usize == size).then_some(cred.uid)
}

/// This process's effective user id.
fn own_uid() -> u32 {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

fn answer(s: &UnixStream, sh: &Shared) -> std::io::Result<()> {
    // One deadline for the whole exchange, not one per read: the server answers one
    // connection at a time, and a client trickling its ticket a byte a read would hold it
    // for sixteen read deadlines.
    let deadline = Instant::now() + IO_DEADLINE;
    s.set_nonblocking(false)?;
    s.set_write_timeout(Some(IO_DEADLINE))?;
    let mut ticket = [0u8; 16];
    let mut got = 0;
    while got < ticket.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match (&*s).read(&mut ticket[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
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
/// deadline (connecting and writing up to 2 s, reading up to 5 s) and by `by` where given (the
/// caller's overall deadline: each wait ends at it). Returns the descriptor (close-on-exec) and
/// the allocation's size. Errors: `Io` for a socket failure (a read or write past either
/// deadline among them); `Timeout` when `by` has passed before the exchange starts, or when
/// the server's queue of connections has no place for ours within the connect deadline;
/// `Refused` (naming `segment`) for an unknown, used or expired ticket.
pub fn fetch(
    name: &str,
    ticket: &[u8; 16],
    segment: &str,
    by: Option<Instant>,
) -> Result<(OwnedFd, u64)> {
    let io = |what: &str, e| TransferError::io(format!("{what} (CUDA IPC socket {name})"), e);
    let left = |now: Instant| by.map_or(FETCH_READ, |b| b.saturating_duration_since(now));
    let before = left(Instant::now());
    if before.is_zero() {
        return Err(TransferError::Timeout(FETCH_READ));
    }
    let s = connect(name, IO_DEADLINE.min(before))?;
    let after = left(Instant::now());
    if after.is_zero() {
        return Err(TransferError::Timeout(FETCH_READ));
    }
    s.set_read_timeout(Some(FETCH_READ.min(after)))
        .and_then(|_| s.set_write_timeout(Some(IO_DEADLINE.min(after))))
        .map_err(|e| io("set deadlines", e))?;
    (&s).write_all(ticket).map_err(|e| io("send ticket", e))?;
    let mut size = [0u8; 8];
    let (n, fd) = recv_fd(&s, &mut size).map_err(|e| io("receive descriptor", e))?;
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
            why: match size {
                OTHER_USER => Refusal::OtherUser,
                _ => Refusal::UnknownTicket,
            },
        }),
    }
}

/// The address of the abstract socket `name` (no leading NUL; the bytes as given, as
/// `SocketAddr::from_abstract_name` takes them) and its length. Errors: `InvalidInput` for a
/// name too long for an address.
fn abstract_addr(name: &str) -> std::io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // The same check, and so the same error, as the std socket address the server binds.
    SocketAddr::from_abstract_name(name.as_bytes())?;
    // SAFETY: sockaddr_un is plain data, valid all zero.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let path = name.as_bytes();
    // The leading NUL (left zero) puts the name in the abstract namespace.
    let dst = addr
        .sun_path
        .get_mut(1..1 + path.len())
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    for (d, b) in dst.iter_mut().zip(path) {
        *d = *b as libc::c_char;
    }
    // The length counts the name's bytes exactly: an abstract name is not NUL-terminated.
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + path.len();
    Ok((addr, len as libc::socklen_t))
}

/// Connects to the abstract socket `name`, waiting at most `wait` for the server to take the
/// connection into its queue. A blocking connect to a listener whose queue is full waits until
/// the listener accepts, which one that never does never would; Linux ends that wait at the
/// socket's send timeout (`EAGAIN`), so it is set before connecting. Errors: `Timeout(wait)`
/// when the queue had no place within `wait`; `Io` otherwise.
fn connect(name: &str, wait: Duration) -> Result<UnixStream> {
    let io = |what: &str, e| TransferError::io(format!("{what} (CUDA IPC socket {name})"), e);
    let (addr, len) = abstract_addr(name).map_err(|e| io("name", e))?;
    let s = UnixStream::from(unix_socket(libc::SOCK_CLOEXEC).map_err(|e| io("socket", e))?);
    let until = Instant::now() + wait;
    loop {
        let rem = until.saturating_duration_since(Instant::now());
        if rem.is_zero() {
            return Err(TransferError::Timeout(wait));
        }
        // SO_SNDTIMEO: the wait of a blocking AF_UNIX connect (std rounds below 1 µs up, so it
        // is never 0, which would mean no limit).
        s.set_write_timeout(Some(rem))
            .map_err(|e| io("set connect deadline", e))?;
        let Err(e) = connect_to(&s, &addr, len) else {
            return Ok(s);
        };
        match e.raw_os_error() {
            // An interrupted AF_UNIX connect leaves the socket unconnected: try again for the
            // time that is left.
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return Err(TransferError::Timeout(wait)),
            _ => return Err(io("connect", e)),
        }
    }
}

/// A new `AF_UNIX` stream socket, with `flags` (`SOCK_CLOEXEC`, `SOCK_NONBLOCK`). Errors: the
/// OS's.
fn unix_socket(flags: libc::c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: socket() takes no pointers; the descriptor it returns is owned at once.
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | flags, 0) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// One `connect(2)` of `s` to `addr` (`len` bytes of it, from [`abstract_addr`]). Errors: the
/// OS's (`EAGAIN`: the listener's queue is full; `EINTR`).
fn connect_to(
    s: &impl AsRawFd,
    addr: &libc::sockaddr_un,
    len: libc::socklen_t,
) -> std::io::Result<()> {
    // SAFETY: `addr` is an initialised sockaddr_un and `len` is within it.
    let r = unsafe {
        libc::connect(
            s.as_raw_fd(),
            (addr as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One `recvmsg` on `s` into `buf`, with at most one descriptor (`SCM_RIGHTS`): the bytes read
/// and the descriptor, if one came. The descriptor is received close-on-exec
/// (`MSG_CMSG_CLOEXEC`: no window in which a concurrent fork and exec inherits it); any more
/// the sender attached are closed by the kernel, or here should one get through.
fn recv_fd(s: &UnixStream, buf: &mut [u8]) -> std::io::Result<(usize, Option<OwnedFd>)> {
    const FD_BYTES: u32 = std::mem::size_of::<libc::c_int>() as u32;
    // u64s: aligned for a cmsghdr; larger than one descriptor's control message.
    let mut control = [0u64; 8];
    // SAFETY: CMSG_SPACE is arithmetic on its argument; it touches no memory.
    let space = unsafe { libc::CMSG_SPACE(FD_BYTES) } as usize;
    let control_len = space.min(std::mem::size_of_val(&control));
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data, valid all zero.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control_len as _;
    // SAFETY: `msg` points at `iov` (over `buf`) and `control`, which outlive the call, with
    // their true lengths.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fd = None;
    // SAFETY: `msg` is the header recvmsg filled: its control pointer and length describe the
    // control messages the kernel wrote into `control`.
    let mut h = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
    while !h.is_null() {
        // SAFETY: a non-null header CMSG_FIRSTHDR/CMSG_NXTHDR returned lies inside `control`.
        let (level, kind, cmsg_len) = unsafe { ((*h).cmsg_level, (*h).cmsg_type, (*h).cmsg_len) };
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            // SAFETY: the header lies inside `control` (above).
            let data = unsafe { libc::CMSG_DATA(h) };
            let header = (data as usize).saturating_sub(h as usize);
            let end = (control.as_ptr() as usize + control_len).saturating_sub(data as usize);
            // cmsg_len is a size_t on glibc and a u32 on musl.
            #[allow(clippy::unnecessary_cast)]
            let bytes = (cmsg_len as usize).saturating_sub(header).min(end);
            for i in 0..bytes / FD_BYTES as usize {
                // SAFETY: within this message's data, inside `control` (bounded above).
                let raw = unsafe { data.cast::<libc::c_int>().add(i).read_unaligned() };
                if raw >= 0 {
                    // SAFETY: a descriptor the kernel just installed in this process for us;
                    // nothing else owns it.
                    let got = unsafe { OwnedFd::from_raw_fd(raw) };
                    // The first is the answer; any other is dropped (closed) here.
                    fd.get_or_insert(got);
                }
            }
        }
        // SAFETY: `msg` and `h` as above; CMSG_NXTHDR returns null past the last header.
        h = unsafe { libc::CMSG_NXTHDR(&raw const msg, h) };
    }
    Ok((n as usize, fd))
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
        assert!(cloexec(&got), "a fetched descriptor is close-on-exec");
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

    /// A process of another user is answered at once with the refusal, before it sends
    /// anything (so it cannot hold the server), and never gets a descriptor. Needs root (to
    /// start that process as `nobody`) and python3 (a client that is not this code).
    #[test]
    fn another_users_process_is_refused_at_once() {
        // SAFETY: geteuid takes no arguments and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED another_users_process_is_refused_at_once: not root");
            return;
        }
        let srv = FdServer::start().unwrap();
        srv.offer(Arc::new(memfd_with(b"z")), 1).unwrap();
        let client = "import socket, sys\n\
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n\
            s.settimeout(10)\n\
            s.connect('\\0' + sys.argv[1])\n\
            print(s.recv(8).hex())\n";
        use std::os::unix::process::CommandExt;
        let out = match std::process::Command::new("python3")
            .args(["-c", client, srv.name()])
            .uid(65534)
            .gid(65534)
            .output()
        {
            Ok(o) => o,
            Err(e) => {
                eprintln!("SKIPPED another_users_process_is_refused_at_once: python3: {e}");
                return;
            }
        };
        let answer = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            answer.trim(),
            "ffffffffffffffff",
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(srv.outstanding(), 1, "the ticket is still there");
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

    /// A client that trickles its ticket a byte at a time (each read well within the read
    /// deadline) is cut off at one deadline for the whole exchange, not held for sixteen: the
    /// server answers one connection at a time.
    #[test]
    fn a_trickling_client_is_cut_off_at_one_deadline() {
        let srv = FdServer::start().unwrap();
        let addr = SocketAddr::from_abstract_name(srv.name().as_bytes()).unwrap();
        let mut c = UnixStream::connect_addr(&addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t0 = Instant::now();
        // 16 bytes, 300 ms apart: 4.5 s in all, each gap well under the 2 s deadline.
        let mut sent = 0;
        for i in 0..16u8 {
            if i > 0 {
                std::thread::sleep(Duration::from_millis(300));
            }
            if c.write_all(&[i]).is_err() {
                break;
            }
            sent += 1;
        }
        let mut reply = Vec::new();
        let _ = c.read_to_end(&mut reply);
        assert!(
            sent < 16 || reply.is_empty(),
            "served after {:?}: {sent} bytes sent, {} answered",
            t0.elapsed(),
            reply.len()
        );
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

    fn cloexec(fd: &OwnedFd) -> bool {
        // SAFETY: fcntl on a descriptor we borrow, no argument.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        assert!(flags >= 0, "{}", std::io::Error::last_os_error());
        flags & libc::FD_CLOEXEC != 0
    }

    /// A descriptor is close-on-exec as soon as it is received, so a fork and exec elsewhere in
    /// the process cannot hand a peer's allocation to the child.
    #[test]
    fn a_received_descriptor_is_close_on_exec() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = memfd_with(b"c");
        assert!(!cloexec(&f), "the sender's copy is inheritable");
        a.send_with_fd(&9u64.to_le_bytes(), &[f.as_raw_fd()])
            .unwrap();
        let mut buf = [0u8; 8];
        let (n, fd) = recv_fd(&b, &mut buf).unwrap();
        assert_eq!((n, u64::from_le_bytes(buf)), (8, 9));
        assert!(cloexec(&fd.expect("a descriptor")));
        // Bytes without a descriptor: none.
        (&a).write_all(&[1u8; 8]).unwrap();
        let (n, fd) = recv_fd(&b, &mut buf).unwrap();
        assert_eq!(n, 8);
        assert!(fd.is_none());
    }

    /// A listener whose queue is full and that never accepts: a blocking connect would wait
    /// for it forever; the fetch ends at its deadline instead.
    #[test]
    fn a_full_queue_ends_the_connect_at_the_deadline() {
        let name = format!(
            "kvferry-cuda-ipc-test-{}",
            hex(&crate::auth::random_bytes::<8>().unwrap())
        );
        let (addr, len) = abstract_addr(&name).unwrap();
        let listener = unix_socket(libc::SOCK_CLOEXEC).unwrap();
        // SAFETY: `addr` is an initialised sockaddr_un of `len` bytes.
        let r = unsafe {
            libc::bind(
                listener.as_raw_fd(),
                (&raw const addr).cast::<libc::sockaddr>(),
                len,
            )
        };
        assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
        // SAFETY: listen on our own socket.
        assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
        // Fill the queue: non-blocking connects until one finds no place (EAGAIN).
        let mut queued = Vec::new();
        let mut full = false;
        for _ in 0..16 {
            let c = unix_socket(libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK).unwrap();
            let Err(e) = connect_to(&c, &addr, len) else {
                queued.push(c);
                continue;
            };
            assert_eq!(e.raw_os_error(), Some(libc::EAGAIN), "{e}");
            full = true;
            break;
        }
        assert!(full && !queued.is_empty(), "{} queued", queued.len());

        // On a thread, so that a fetch that hangs fails the test instead of blocking it.
        let (tx, rx) = std::sync::mpsc::channel();
        let t0 = Instant::now();
        let by = t0 + Duration::from_secs(1);
        std::thread::spawn(move || {
            let _ = tx.send(fetch(&name, &[1u8; 16], "peer:1", Some(by)).map(|_| ()));
        });
        let got = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("fetch still connecting 10 s after its 1 s deadline");
        let e = got.unwrap_err();
        assert!(matches!(e, TransferError::Timeout(_)), "{e}");
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(10),
            "{took:?}"
        );
        drop(queued);
        drop(listener);
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
