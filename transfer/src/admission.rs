//! Admission of served connections, one [`Listener`] type for the handshake listener
//! (`crate::handshake`) and the TCP data listener (`transport::tcp`) ("connection
//! limits"; docs/design.md §3): at most `Limits::max_connections` served connections at once,
//! at most `Limits::per_source` from one source IP (so idle connections from one host cannot
//! lock out the others), and every admitted connection carries the deadline by which its
//! first frame must have arrived (`Limits::first_frame`, the pre-authentication deadline).
//! What a connection's frames mean is the serve function's business.

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::TcpConfig;
use crate::error::{Result, TransferError};

/// Served connections per source IP of one listener.
struct Sources {
    counts: Mutex<HashMap<IpAddr, usize>>,
    max_per_source: usize,
}

/// One admitted connection; dropping it frees its place.
struct Ticket {
    sources: Arc<Sources>,
    ip: IpAddr,
}

impl Sources {
    fn new(max_per_source: usize) -> Arc<Sources> {
        Arc::new(Sources {
            counts: Mutex::new(HashMap::new()),
            max_per_source: max_per_source.max(1),
        })
    }

    /// A ticket for one more connection from `ip`, or `None` when `ip` holds its maximum.
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<Ticket> {
        let mut c = self.counts.locked();
        let n = c.entry(ip).or_insert(0);
        if *n >= self.max_per_source {
            return None;
        }
        *n += 1;
        Some(Ticket {
            sources: self.clone(),
            ip,
        })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self.sources.counts.locked();
        if let Some(n) = c.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.remove(&self.ip);
            }
        }
    }
}

/// What a [`Listener`] admits: `TcpConfig::max_server_connections`,
/// `max_connections_per_source` and `first_frame_timeout`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Served connections at once (at least 1); more are closed at once.
    pub max_connections: usize,
    /// Served connections at once from one source IP (at least 1); more are closed at once.
    pub per_source: usize,
    /// Time from accept by which the connection's first frame must have arrived.
    pub first_frame: Duration,
}

impl Limits {
    /// The limits `cfg` sets.
    pub(crate) fn of(cfg: &TcpConfig) -> Limits {
        Limits {
            max_connections: cfg.max_server_connections,
            per_source: cfg.max_connections_per_source,
            first_frame: cfg.first_frame_timeout,
        }
    }
}

/// One admitted connection, handed to the serve function on its own thread.
pub(crate) struct Admitted {
    /// The connection (blocking, no timeouts set).
    pub stream: TcpStream,
    /// The peer's address.
    pub peer: SocketAddr,
    /// When the first frame must have arrived (accept time + `Limits::first_frame`): the
    /// serve function reads it by then or closes the connection.
    pub first_frame_deadline: Instant,
}

/// Serves one admitted connection until it ends; its place is freed when this returns. It
/// must not shut the socket down: the listener closes it after freeing the place, so that a
/// peer that sees the close and connects again finds the place free.
pub(crate) type Serve = dyn Fn(Admitted) + Send + Sync;

/// Thread names and the log label of a [`Listener`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Names {
    /// Label in log lines (`"handshake"`, `"tcp data listener"`).
    pub label: &'static str,
    /// Name of the accept thread.
    pub accept_thread: &'static str,
    /// Name of each connection's thread.
    pub conn_thread: &'static str,
}

/// A listening socket served by an accept thread and one thread per admitted connection,
/// under [`Limits`]. Stops accepting when dropped ([`Listener::stop`]).
pub(crate) struct Listener {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    names: Names,
    limits: Limits,
    serve: Arc<Serve>,
    stop: AtomicBool,
    active: AtomicUsize,
    sources: Arc<Sources>,
    /// Clones of served sockets, to close them in `close_served`.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    /// Tests: how long a connection's thread pauses after the serve function returns and
    /// again after closing the socket, to widen the windows in which a reconnecting peer
    /// would find the place still held.
    #[cfg(test)]
    close_linger_ms: AtomicU64,
}

impl Listener {
    /// Starts serving `listener`: each admitted connection runs `serve` on its own thread.
    /// Errors: `Io` when the address cannot be read or the accept thread cannot be spawned.
    pub(crate) fn start(
        listener: TcpListener,
        names: Names,
        limits: Limits,
        serve: Arc<Serve>,
    ) -> Result<Listener> {
        let addr = listener
            .local_addr()
            .map_err(|e| TransferError::io(format!("{} address", names.label), e))?;
        let shared = Arc::new(Shared {
            names,
            limits,
            serve,
            stop: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            sources: Sources::new(limits.per_source),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            #[cfg(test)]
            close_linger_ms: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name(names.accept_thread.into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| TransferError::io(format!("spawn {} thread", names.label), e))?;
        Ok(Listener {
            shared,
            addr,
            accept: Mutex::new(Some(accept)),
        })
    }

    /// The bound address.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections being served now.
    pub(crate) fn active(&self) -> usize {
        self.shared.active.load(Ordering::SeqCst)
    }

    /// Stops accepting and joins the accept thread; served connections go on. Idempotent.
    pub(crate) fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let Some(t) = self.accept.locked().take() else {
            return;
        };
        // Wake the blocking accept. If that connect fails (e.g. no file descriptors left),
        // the thread may never wake: leave it detached rather than block forever.
        if TcpStream::connect_timeout(&self.addr, Duration::from_millis(500)).is_ok() {
            let _ = t.join();
        }
    }

    /// Closes every served connection and waits up to `wait` for their threads to end.
    pub(crate) fn close_served(&self, wait: Duration) {
        for (_, s) in self.shared.conns.locked().drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
        let deadline = Instant::now() + wait;
        while self.active() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

#[cfg(test)]
impl Shared {
    fn linger(&self) {
        std::thread::sleep(Duration::from_millis(
            self.close_linger_ms.load(Ordering::SeqCst),
        ));
    }
}

#[cfg(test)]
impl Listener {
    /// Tests: the pauses of [`Shared::close_linger_ms`], in milliseconds.
    pub(crate) fn close_linger_for_tests(&self, ms: u64) {
        self.shared.close_linger_ms.store(ms, Ordering::SeqCst);
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    let label = sh.names.label;
    let max = sh.limits.max_connections.max(1);
    for conn in listener.incoming() {
        if sh.stop.load(Ordering::SeqCst) {
            break;
        }
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("{label} accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let first_frame_deadline = Instant::now() + sh.limits.first_frame;
        let Ok(peer) = s.peer_addr() else { continue };
        let Some(ticket) = sh.sources.admit(peer.ip()) else {
            tracing::warn!(%peer, "{label}: too many connections from this source, closing one");
            continue;
        };
        if sh.active.fetch_add(1, Ordering::SeqCst) >= max {
            sh.active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("{label}: too many connections, closing one");
            continue;
        }
        let id = sh.next_conn.fetch_add(1, Ordering::SeqCst);
        if let Ok(c) = s.try_clone() {
            sh.conns.locked().insert(id, c);
        }
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new()
            .name(sh.names.conn_thread.into())
            .spawn(move || {
                (sh2.serve)(Admitted {
                    stream: s,
                    peer,
                    first_frame_deadline,
                });
                #[cfg(test)]
                sh2.linger();
                // The place is free before the clone in `conns`, the socket's last fd, is
                // closed: a peer that sees the close and connects again finds it free.
                drop(ticket);
                sh2.active.fetch_sub(1, Ordering::SeqCst);
                let clone = sh2.conns.locked().remove(&id);
                drop(clone);
                #[cfg(test)]
                sh2.linger();
            });
        if let Err(e) = spawned {
            sh.conns.locked().remove(&id);
            sh.active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("{label}: cannot spawn a connection thread: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_source_has_its_own_limit_and_tickets_free_places() {
        let s = Sources::new(2);
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.1".parse().unwrap();
        let t1 = s.admit(a).unwrap();
        let _t2 = s.admit(a).unwrap();
        assert!(s.admit(a).is_none(), "third from one source refused");
        assert!(s.admit(b).is_some(), "another source still admitted");
        drop(t1);
        assert!(s.admit(a).is_some(), "a closed connection frees its place");
    }

    /// A peer that reads the server's close and connects again at once is served: the place
    /// is freed before the socket closes. Without that order the reconnect races the
    /// release; the pause after the close makes the reconnect win that race.
    #[test]
    fn a_peer_that_sees_the_close_and_reconnects_is_served() {
        use std::io::{Read, Write};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let limits = Limits {
            max_connections: 1,
            per_source: 1,
            first_frame: Duration::from_secs(5),
        };
        let names = Names {
            label: "test",
            accept_thread: "test-accept",
            conn_thread: "test-conn",
        };
        let serve = |mut a: Admitted| {
            let mut b = [0u8; 1];
            if a.stream.read_exact(&mut b).is_ok() {
                let _ = a.stream.write_all(&b);
            }
        };
        let l = Listener::start(listener, names, limits, Arc::new(serve)).unwrap();
        l.close_linger_for_tests(20);
        let addr = l.local_addr();
        for round in 0..20u32 {
            let mut c = TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            c.write_all(&[round as u8]).unwrap();
            let mut got = Vec::new();
            // A connection closed at accept reads as an empty answer (or a reset).
            let _ = c.read_to_end(&mut got);
            assert_eq!(
                got,
                [round as u8],
                "round {round}: served, answered, closed"
            );
        }
    }
}
