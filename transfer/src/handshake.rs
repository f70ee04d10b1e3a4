//! The handshake channel (docs/design.md §3 "Handshake over TCP"; frame shape after Mooncake's P2P
//! handshake, docs/design.md §9): one TCP listener per engine at its segment name `host:port`.
//!
//! Frame: `u64` body length (little-endian), `u8` frame type, then the body (at most
//! [`MAX_FRAME_BODY`] bytes). The initiator sends one request frame and reads one reply frame;
//! the reply has the request's type on success or [`FrameType::Error`] with the error text
//! (UTF-8) as body. Every read and write on either side has a deadline
//! (`EngineConfig::handshake_timeout`). A malformed frame (unknown type, length over the limit)
//! gets an error reply and the connection is closed.
//!
//! Authentication (`crate::auth`, docs/design.md §8.1): an initiator with a credential first
//! sends `Hello` (its random 32-byte nonce, the segment name it dialed and its own name); the
//! reply is the target's random nonce and, from an authenticated target, the target's proof
//! `HMAC-SHA256(secret, target label ‖ both nonces ‖ both names)`, which an initiator with the
//! secret checks before it sends anything else. Then `Auth` (`1 ‖ HMAC-SHA256(secret, initiator
//! label ‖ both nonces ‖ both names)` or `2 ‖ token`); the reply is an empty `Auth` frame or an
//! error. An authenticated engine answers `Descriptor` and `Connect` only on a connection that
//! passed `Auth`; an open engine answers them on any connection (and accepts any `Auth`).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::admission::{Admitted, Limits, Listener, Names};
use crate::error::{HandshakeError, IoError, PeerText, ProtocolError, Result, TransferError};

/// Largest handshake frame body, bytes (1 MiB, as Mooncake's default).
pub const MAX_FRAME_BODY: u64 = 1 << 20;

/// Handshake frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameType {
    /// Transport-specific connection set-up (RDMA QP exchange); handled by
    /// `Transport::on_handshake`.
    Connect = 0,
    /// Descriptor query: empty request body; the reply body is the JSON `SegmentDescriptor`.
    Descriptor = 1,
    /// Nonce exchange: `nonce[32] ‖ u16 len ‖ target name ‖ u16 len ‖ initiator name`
    /// (`auth::Hello`); the reply body is the target's 32-byte nonce, followed by its 32-byte
    /// proof when it has a secret.
    Hello = 2,
    /// Authentication: `1 ‖ proof[32]` or `2 ‖ token[16]`; the reply body is empty.
    Auth = 3,
    /// Error reply: the body is the error text.
    Error = 0xFF,
}

impl FrameType {
    /// The frame type for a wire byte, `None` for unknown values.
    pub fn from_u8(b: u8) -> Option<FrameType> {
        match b {
            0 => Some(FrameType::Connect),
            1 => Some(FrameType::Descriptor),
            2 => Some(FrameType::Hello),
            3 => Some(FrameType::Auth),
            0xFF => Some(FrameType::Error),
            _ => None,
        }
    }
}

/// Sets the read and write timeouts of `s` to what is left until `deadline`;
/// `Timeout` when nothing is left.
fn arm(s: &TcpStream, deadline: Instant, what: &str) -> Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(TransferError::io_kind(
            what,
            std::io::ErrorKind::TimedOut,
            "deadline passed",
        ));
    }
    s.set_read_timeout(Some(left))
        .and_then(|_| s.set_write_timeout(Some(left)))
        .map_err(|e| TransferError::io(what, e))
}

/// `read_exact` that never runs past `deadline`, even against a peer trickling bytes.
pub(crate) fn read_exact_by(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        arm(s, deadline, what)?;
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(TransferError::io_kind(
                    what,
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed by peer",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TransferError::io(what, e)),
        }
    }
    Ok(())
}

/// `write_all` that never runs past `deadline`.
pub(crate) fn write_all_by(
    s: &mut TcpStream,
    buf: &[u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let mut sent = 0;
    while sent < buf.len() {
        arm(s, deadline, what)?;
        match s.write(&buf[sent..]) {
            Ok(0) => {
                return Err(TransferError::io_kind(
                    what,
                    std::io::ErrorKind::WriteZero,
                    "connection closed by peer",
                ))
            }
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TransferError::io(what, e)),
        }
    }
    Ok(())
}

fn encode(ty: FrameType, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(9 + body.len());
    f.extend_from_slice(&(body.len() as u64).to_le_bytes());
    f.push(ty as u8);
    f.extend_from_slice(body);
    f
}

/// The body length of a frame header, checked against [`MAX_FRAME_BODY`] before any of the
/// body is read or reserved: `Protocol` error over it.
pub(crate) fn frame_len(hdr: &[u8; 9], what: &str) -> Result<u64> {
    let len = u64::from_le_bytes(hdr[..8].try_into().expect("8 bytes"));
    if len > MAX_FRAME_BODY {
        return Err(TransferError::Protocol(ProtocolError::TooLarge {
            what: format!("{what}: frame body bytes"),
            len,
            limit: MAX_FRAME_BODY,
        }));
    }
    Ok(len)
}

/// Reads one frame; `Ok(None)` on a clean EOF before the first header byte.
/// A length over `MAX_FRAME_BODY` is a `Protocol` error (nothing of the body is read).
fn read_frame(s: &mut TcpStream, deadline: Instant, what: &str) -> Result<Option<(u8, Vec<u8>)>> {
    let mut hdr = [0u8; 9];
    arm(s, deadline, what)?;
    let first = loop {
        match s.read(&mut hdr) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TransferError::io(what, e)),
        }
    };
    if first == 0 {
        return Ok(None);
    }
    read_exact_by(s, &mut hdr[first..], deadline, what)?;
    let len = frame_len(&hdr, what)?;
    let mut body = vec![0u8; len as usize];
    read_exact_by(s, &mut body, deadline, what)?;
    Ok(Some((hdr[8], body)))
}

/// Sends one request frame of type `ty` to the handshake listener at `peer` (`host:port`) and
/// returns the reply body. The whole exchange (resolve, connect, write, read) finishes within
/// `timeout`. Errors: `Handshake { peer, source }` for connect failures, an error reply
/// (`HandshakeError::Refused` with the peer's text), a reply of another type, a malformed
/// reply, or the deadline.
/// This is the client helper transports use for their `Connect` frames (open peers).
pub fn request(peer: &str, ty: FrameType, body: &[u8], timeout: Duration) -> Result<Vec<u8>> {
    request_with(peer, ty, body, timeout, None)
}

/// As [`request`], authenticating first when `cred` is given: `Hello` with this side's nonce
/// and both names (the reply: the target's nonce and, from an authenticated target, its proof,
/// checked before anything else is sent), then `Auth` with this side's proof or the token, then
/// the request, all on one connection and within `timeout`. A refused `Hello` or `Auth` is
/// `Handshake` with `HandshakeError::Refused` (the peer's text); a target that does not prove
/// the secret is `HandshakeError::TargetUnproven`.
pub fn request_with(
    peer: &str,
    ty: FrameType,
    body: &[u8],
    timeout: Duration,
    cred: Option<&crate::auth::Credential>,
) -> Result<Vec<u8>> {
    let fail = |source: HandshakeError| TransferError::Handshake {
        peer: peer.to_string(),
        source,
    };
    if body.len() as u64 > MAX_FRAME_BODY {
        return Err(fail(HandshakeError::BodyTooLarge(body.len())));
    }
    let deadline = Instant::now() + timeout;
    let addrs: Vec<SocketAddr> = peer
        .to_socket_addrs()
        .map_err(|e| fail(HandshakeError::Resolve(IoError::new(peer, e))))?
        .collect();
    let mut last = HandshakeError::NoAddress;
    let mut stream = None;
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = HandshakeError::Connect(IoError::new(format!("connect to {a}"), e)),
        }
    }
    let mut s = stream.ok_or_else(|| fail(last))?;
    let _ = s.set_nodelay(true);
    if let Some(cred) = cred {
        let me = match cred {
            crate::auth::Credential::Secret { initiator, .. } => initiator.as_str(),
            crate::auth::Credential::Token(_) => "",
        };
        let hello = crate::auth::Hello::new(peer, me)?;
        let reply = exchange(&mut s, FrameType::Hello, &hello.encode(), deadline).map_err(fail)?;
        // With the secret, nothing of ours goes to a target that has not proved it first.
        let auth = crate::auth::answer_hello(cred, &hello, &reply).map_err(fail)?;
        exchange(&mut s, FrameType::Auth, &auth, deadline).map_err(fail)?;
    }
    let reply = exchange(&mut s, ty, body, deadline).map_err(fail);
    let _ = s.shutdown(Shutdown::Both);
    reply
}

/// One request/reply on an open handshake connection.
fn exchange(
    s: &mut TcpStream,
    ty: FrameType,
    body: &[u8],
    deadline: Instant,
) -> std::result::Result<Vec<u8>, HandshakeError> {
    let broke = |e| HandshakeError::Exchange(Box::new(e));
    write_all_by(s, &encode(ty, body), deadline, "send handshake request").map_err(broke)?;
    let reply = read_frame(s, deadline, "read handshake reply").map_err(broke)?;
    match reply {
        None => Err(HandshakeError::Closed),
        Some((t, b)) if t == ty as u8 => Ok(b),
        Some((t, b)) if t == FrameType::Error as u8 => {
            Err(HandshakeError::Refused(PeerText::from_bytes(&b)))
        }
        Some((got, _)) => Err(HandshakeError::UnexpectedReply {
            got,
            expected: ty as u8,
        }),
    }
}

/// Per-connection state of the handshake server, handed to the handler with every frame.
pub(crate) struct Session {
    /// The peer's address.
    pub peer: SocketAddr,
    /// The address the connection arrived on (what the peer dialed, as this side sees it).
    pub local: Option<SocketAddr>,
    /// The `Hello` answered on this connection, until an `Auth` frame uses it.
    pub hello: Option<crate::auth::PendingHello>,
    /// Whether this connection passed `Auth`.
    pub authed: bool,
}

/// Answers one request frame: `(type, body, session) -> reply body`; an `Err` becomes an error
/// frame.
pub(crate) type Handler = dyn Fn(FrameType, &[u8], &mut Session) -> Result<Vec<u8>> + Send + Sync;

/// The handshake listener: an [`Listener`] whose connections run the frame loop with
/// `handler` (limits and first-frame deadline as [`Limits`]). Stops when dropped.
pub(crate) struct HandshakeServer {
    _listener: Listener,
}

/// What every handshake connection thread shares.
struct ServerShared {
    timeout: Duration,
    handler: Arc<Handler>,
}

impl HandshakeServer {
    /// Serves `listener` with `handler`; each connection's frames must arrive within `timeout`.
    /// Per-source limit and first-frame deadline as `TcpConfig`'s defaults.
    #[cfg_attr(
        not(all(test, feature = "rdma")),
        allow(dead_code, reason = "used by the rdma module's tests")
    )]
    pub(crate) fn start(
        listener: TcpListener,
        handler: Arc<Handler>,
        timeout: Duration,
        max_connections: usize,
    ) -> Result<Self> {
        let limits = Limits {
            max_connections,
            ..Limits::of(&crate::config::TcpConfig::default())
        };
        Self::start_limited(listener, handler, timeout, limits)
    }

    /// As `start`, with `limits`.
    pub(crate) fn start_limited(
        listener: TcpListener,
        handler: Arc<Handler>,
        timeout: Duration,
        limits: Limits,
    ) -> Result<Self> {
        let sh = ServerShared { timeout, handler };
        let names = Names {
            label: "handshake",
            accept_thread: "kvferry-handshake",
            conn_thread: "kvferry-handshake-conn",
        };
        let listener = Listener::start(
            listener,
            names,
            limits,
            Arc::new(move |c| serve_conn(c, &sh)),
        )?;
        Ok(HandshakeServer {
            _listener: listener,
        })
    }
}

/// Runs the handler; a panic in it (a transport bug) becomes an error reply, not a dead thread.
fn call_handler(
    sh: &ServerShared,
    t: FrameType,
    body: &[u8],
    session: &mut Session,
) -> Result<Vec<u8>> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (sh.handler)(t, body, session)
    }))
    .unwrap_or_else(|_| Err(TransferError::Protocol(ProtocolError::Internal)))
}

fn serve_conn(c: Admitted, sh: &ServerShared) {
    let (mut s, peer) = (c.stream, c.peer);
    let _ = s.set_nodelay(true);
    let local = s.local_addr().ok();
    let mut session = Session {
        peer,
        local,
        hello: None,
        authed: false,
    };
    // the first frame must arrive within the pre-authentication deadline
    let mut first = true;
    loop {
        let mut deadline = Instant::now() + sh.timeout;
        if std::mem::take(&mut first) {
            deadline = deadline.min(c.first_frame_deadline);
        }
        let (ty, body) = match read_frame(&mut s, deadline, "read handshake request") {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(%peer, "handshake: {e}");
                if matches!(e, TransferError::Protocol(_)) {
                    let _ = write_all_by(
                        &mut s,
                        &encode(FrameType::Error, e.to_string().as_bytes()),
                        deadline,
                        "send handshake error",
                    );
                }
                // Returning closes the connection, after the listener freed its place.
                return;
            }
        };
        let (reply_ty, reply, keep) = match FrameType::from_u8(ty) {
            Some(
                t @ (FrameType::Connect
                | FrameType::Descriptor
                | FrameType::Hello
                | FrameType::Auth),
            ) => match call_handler(sh, t, &body, &mut session) {
                Ok(b) if b.len() as u64 <= MAX_FRAME_BODY => (t, b, true),
                Ok(b) => (
                    FrameType::Error,
                    format!("reply of {} bytes exceeds the frame limit", b.len()).into_bytes(),
                    true,
                ),
                Err(e) => (FrameType::Error, e.to_string().into_bytes(), true),
            },
            _ => (
                FrameType::Error,
                format!("unknown handshake frame type {ty}").into_bytes(),
                false,
            ),
        };
        let deadline = Instant::now() + sh.timeout;
        if write_all_by(
            &mut s,
            &encode(reply_ty, &reply),
            deadline,
            "send handshake reply",
        )
        .is_err()
            || !keep
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A peer whose connection the server ends (here: an unknown frame type) and that connects
    /// again at once is served: the server leaves the close to the listener, which frees the
    /// place first. A shutdown inside the frame loop would show the peer the close while the
    /// place is still held; the listener's pause after the loop returns makes that show.
    #[test]
    fn a_peer_closed_by_the_server_that_reconnects_at_once_is_served() {
        let limits = Limits {
            max_connections: 1,
            per_source: 1,
            first_frame: Duration::from_secs(5),
        };
        let handler = |_: FrameType, _: &[u8], _: &mut Session| -> Result<Vec<u8>> { Ok(vec![]) };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server =
            HandshakeServer::start_limited(l, Arc::new(handler), Duration::from_secs(5), limits)
                .unwrap();
        server._listener.close_linger_for_tests(20);
        let mut unknown = 0u64.to_le_bytes().to_vec();
        unknown.push(200);
        for round in 0..10 {
            let mut c = TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            c.write_all(&unknown).unwrap();
            let mut got = Vec::new();
            // A connection closed at accept reads as nothing (or a reset).
            let _ = c.read_to_end(&mut got);
            assert!(got.len() > 9, "round {round}: no error reply");
            assert_eq!(got[8], FrameType::Error as u8, "round {round}");
        }
    }
}
