//! The `--metrics-addr` endpoint of `serve` and `load`: a small HTTP/1.0 server that answers
//! `GET /metrics` with the process's metrics (`kvferry_transfer::metrics`, OpenMetrics text)
//! and nothing else.
//!
//! It listens, so it is bounded as anything a stranger can reach: at most [`MAX_CONNECTIONS`]
//! connections served at once (more are closed at once), a request head of at most
//! [`MAX_REQUEST_BYTES`] read within [`DEADLINE`] in all (a slow sender cannot hold a place
//! longer), the answer written within the same deadline, one request per connection. It reads
//! nothing but the request line, changes nothing, and answers other paths 404 and other
//! methods 405.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::CliError;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 8;
/// Longest request head read (request line and headers), bytes.
pub const MAX_REQUEST_BYTES: usize = 8192;
/// Time a connection may take in all: reading the request and writing the answer.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// A running metrics endpoint; it serves until the process ends.
pub struct MetricsServer {
    addr: SocketAddr,
}

impl MetricsServer {
    /// Binds `addr` (`HOST:PORT`; port 0 picks one) and serves on a thread of its own.
    /// Errors: `Io` (the bind's error) for an address that does not bind.
    pub fn start(addr: &str) -> Result<MetricsServer, CliError> {
        let listener = TcpListener::bind(addr).map_err(CliError::io(format!(
            "--metrics-addr {addr}: cannot listen"
        )))?;
        let local = listener
            .local_addr()
            .map_err(CliError::io("--metrics-addr address"))?;
        let busy = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("kvferry-metrics".into())
            .spawn(move || accept_loop(listener, busy))
            .map_err(CliError::io("starting the metrics thread"))?;
        tracing::info!("metrics on http://{local}/metrics");
        Ok(MetricsServer { addr: local })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn accept_loop(listener: TcpListener, busy: Arc<AtomicUsize>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let admitted = busy
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_CONNECTIONS).then_some(n + 1)
            })
            .is_ok();
        if !admitted {
            drop(stream);
            continue;
        }
        let conn_busy = busy.clone();
        let spawned = std::thread::Builder::new()
            .name("kvferry-metrics-conn".into())
            .spawn(move || {
                let mut stream = stream;
                let _ = serve_one(&mut stream);
                // The place is free before the peer sees the close: a client that reads the
                // end of an answer and connects again finds it free.
                conn_busy.fetch_sub(1, Ordering::AcqRel);
                drop(stream);
            });
        if spawned.is_err() {
            busy.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Reads one request head within the deadline and answers it.
fn serve_one(s: &mut TcpStream) -> std::io::Result<()> {
    let end = Instant::now() + DEADLINE;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            break;
        }
        if head.len() > MAX_REQUEST_BYTES {
            return answer(
                s,
                end,
                "431 Request Header Fields Too Large",
                "text/plain",
                b"",
            );
        }
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" && method != "HEAD" {
        return answer(
            s,
            end,
            "405 Method Not Allowed",
            "text/plain",
            b"GET only\n",
        );
    }
    if path != "/metrics" && !path.starts_with("/metrics?") {
        return answer(s, end, "404 Not Found", "text/plain", b"see /metrics\n");
    }
    let body = kvferry_transfer::metrics::encode_text();
    let body = if method == "HEAD" { "" } else { body.as_str() };
    answer(
        s,
        end,
        "200 OK",
        kvferry_transfer::metrics::CONTENT_TYPE,
        body.as_bytes(),
    )
}

fn answer(
    s: &mut TcpStream,
    end: Instant,
    status: &str,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    let left = end.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Ok(());
    }
    s.set_write_timeout(Some(left))?;
    let head = format!(
        "HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    s.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_that_does_not_bind_is_an_io_error_with_its_cause() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        match MetricsServer::start(&addr) {
            Err(CliError::Io { what, source }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
                assert!(what.contains("--metrics-addr"), "{what}");
            }
            other => panic!("{:?}", other.map(|s| s.addr)),
        }
    }
}
