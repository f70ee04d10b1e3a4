//! kvferry patch: what a listening socket lets its peers hold (KVFERRY-PATCH.md). Upstream
//! accepts every connection, waits for a greeting and for each frame without a deadline, and
//! buffers whatever peers send up to the per-message limit on each connection, so a few
//! sources holding idle half-greetings or half-sent large frames exhaust the process's file
//! descriptors or memory. These are the hooks; the policy (how many, from whom) is the
//! embedder's.

use std::any::Any;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Decides whether a listening socket serves a connection accepted from `peer`.
/// `Some(permit)`: served, `permit` dropped when the connection closes (both halves);
/// `None`: closed at once, before the greeting.
pub trait AcceptGate: Send + Sync {
    /// Called once per accepted TCP connection, on the accept task: must not block.
    fn admit(&self, peer: SocketAddr) -> Option<Box<dyn Any + Send + Sync>>;
}

/// Bytes that declared frame bodies may hold at once across every connection sharing this
/// budget (`SocketOptions::receive_budget`). A frame body of at least
/// [`ReceiveBudget::CHARGED_FROM`] bytes is charged its declared length before anything is
/// reserved for it, and refunded when its message is delivered or its connection dropped; a
/// frame that does not fit drops its connection. Smaller frames are not charged (a
/// connection's read buffer bounds them), so small legitimate messages pass however much
/// large frames hold.
#[derive(Debug)]
pub struct ReceiveBudget {
    limit: usize,
    used: AtomicUsize,
}

impl ReceiveBudget {
    /// Frames below this many bytes are not charged.
    pub const CHARGED_FROM: usize = 64 * 1024;

    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    pub(crate) fn try_charge(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|&t| t <= self.limit)
            })
            .is_ok()
    }

    pub(crate) fn refund(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// A stream holding an [`AcceptGate`] permit: dropped (freeing the permit) with the stream.
#[cfg(feature = "tokio-runtime")]
pub(crate) struct Permitted<S> {
    pub(crate) stream: S,
    pub(crate) _permit: Box<dyn Any + Send + Sync>,
}

#[cfg(feature = "tokio-runtime")]
impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Permitted<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

#[cfg(feature = "tokio-runtime")]
impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Permitted<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// At most one warning a second from the socket's own peer-triggered logs, with the count of
/// those left out (a flood of refused peers must not flood the log).
pub(crate) fn warn_limited(args: std::fmt::Arguments<'_>) {
    use std::sync::atomic::AtomicU64;
    static LAST: AtomicU64 = AtomicU64::new(0);
    static SKIPPED: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST.load(Ordering::Relaxed);
    if now > last
        && LAST
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    {
        let skipped = SKIPPED.swap(0, Ordering::AcqRel);
        if skipped > 0 {
            log::warn!("{args} ({skipped} more like it in the last second(s) not logged)");
        } else {
            log::warn!("{args}");
        }
    } else {
        SKIPPED.fetch_add(1, Ordering::Relaxed);
    }
}
