//! Initiator side of the TCP transport: per peer instance, a pool of data connections that
//! jobs are spread over; a connection is opened on its first job and ends broken or idle.

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::coalesce::Job;
use super::socket::prepare;
use crate::config::TcpConfig;
use crate::error::{Result, TransferError};
use crate::transport::TransportContext;

/// The connection pools by segment name.
pub(super) type Pools = Mutex<HashMap<String, Arc<PeerPool>>>;

/// The connections to one peer instance.
pub(super) struct PeerPool {
    pub(super) segment: String,
    pub(super) addr: String,
    pub(super) instance: u64,
    pub(super) cfg: TcpConfig,
    pub(super) ctx: TransportContext,
    pub(super) conns: Mutex<Vec<Arc<Conn>>>,
    pub(super) next: AtomicUsize,
    /// Set when a connect failed: until the instant, jobs fail at once with that error instead
    /// of each spawning a connection attempt.
    pub(super) down: Mutex<Option<(Instant, TransferError)>>,
    /// The transport's pools: the last connection to close removes this pool from them.
    pub(super) pools: std::sync::Weak<Pools>,
}

/// One data connection: a job queue feeding its writer thread. `tx` is `None` once the
/// connection stopped taking jobs (broken, idle or closed); jobs already queued are still
/// reported by the writer.
pub(super) struct Conn {
    pub(super) tx: Mutex<Option<Sender<Job>>>,
    pub(super) stream: Mutex<Option<TcpStream>>,
}

impl Conn {
    /// True while the socket is open (connected, not yet ended).
    pub(super) fn is_open(&self) -> bool {
        self.stream.locked().is_some()
    }

    pub(super) fn close(&self) {
        self.tx.locked().take();
        if let Some(s) = self.stream.locked().as_ref() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl PeerPool {
    pub(super) fn send(self: &Arc<Self>, mut job: Job) {
        if let Some((until, e)) = self.down.locked().as_ref() {
            if Instant::now() < *until {
                return job.fail_peer(e);
            }
        }
        let want = self.cfg.connections_per_peer.max(1);
        let i = self.next.fetch_add(1, Ordering::Relaxed) % want;
        // two tries: the chosen connection may have just gone idle or broken
        for _ in 0..2 {
            let conn = {
                let mut conns = self.conns.locked();
                while conns.len() < want {
                    conns.push(self.spawn_conn());
                }
                conns[i].clone()
            };
            let r = {
                let tx = conn.tx.locked();
                match tx.as_ref() {
                    Some(tx) => tx.send(job).map_err(|e| e.0),
                    None => Err(job),
                }
            };
            match r {
                Ok(()) => return,
                Err(j) => {
                    job = j;
                    let mut conns = self.conns.locked();
                    if conns.get(i).is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                        conns[i] = self.spawn_conn();
                    }
                }
            }
        }
        job.fail_peer(&TransferError::io_kind(
            format!("send to segment {}", self.segment),
            std::io::ErrorKind::NotConnected,
            "no usable TCP connection",
        ));
    }

    /// A connection's writer ended: forget the connection, and the pool when it was the last.
    fn conn_ended(self: &Arc<Self>, conn: &Arc<Conn>) {
        let Some(pools) = self.pools.upgrade() else {
            return;
        };
        let mut pools = pools.locked();
        let mut conns = self.conns.locked();
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

    pub(super) fn close(&self) {
        for c in self.conns.locked().drain(..) {
            c.close();
        }
    }

    pub(super) fn connect(&self) -> Result<TcpStream> {
        let what = format!(
            "connect to TCP data port {} of segment {}",
            self.addr, self.segment
        );
        let addrs: Vec<SocketAddr> = self
            .addr
            .to_socket_addrs()
            .map_err(|e| TransferError::io(&what, e))?
            .collect();
        let mut last =
            TransferError::io_kind(&what, std::io::ErrorKind::AddrNotAvailable, "no address");
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
    pub(super) fn retire(conn: &Conn, rx: &Receiver<Job>, err: &TransferError) {
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
    pub(super) fn first_job(conn: &Conn, rx: &Receiver<Job>, idle: Duration) -> Option<Job> {
        match rx.recv_timeout(idle) {
            Ok(j) => Some(j),
            Err(RecvTimeoutError::Timeout) => {
                conn.tx.locked().take();
                rx.try_recv().ok() // one that slipped in before we stopped taking jobs
            }
            Err(RecvTimeoutError::Disconnected) => None,
        }
    }
}
