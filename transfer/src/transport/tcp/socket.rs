//! Socket helpers of the TCP transport: options, full reads and writes, draining.

use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use crate::config::TcpConfig;
use crate::error::{Result, TransferError};

pub(super) fn set_buffers(s: &TcpStream, bytes: usize) {
    if bytes == 0 {
        return;
    }
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: `s` owns a valid socket fd for the call; the option value is a live c_int
        // and the length passed is its size.
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

pub(super) fn prepare(s: &TcpStream, cfg: &TcpConfig, what: &str) -> Result<()> {
    s.set_nodelay(true)
        .map_err(|e| TransferError::io(what, e))?;
    s.set_read_timeout(Some(cfg.io_timeout))
        .map_err(|e| TransferError::io(what, e))?;
    s.set_write_timeout(Some(cfg.io_timeout))
        .map_err(|e| TransferError::io(what, e))?;
    set_buffers(s, cfg.socket_buffer);
    Ok(())
}

pub(super) fn read_full(s: &mut TcpStream, buf: &mut [u8], what: &str) -> Result<()> {
    s.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => TransferError::io_kind(
            what,
            std::io::ErrorKind::UnexpectedEof,
            "connection closed by peer",
        ),
        _ => TransferError::io(what, e),
    })
}

pub(super) fn write_full(s: &mut TcpStream, buf: &[u8], what: &str) -> Result<()> {
    s.write_all(buf).map_err(|e| TransferError::io(what, e))
}

/// Writes all of `parts` with vectored writes (header and payload in one syscall).
pub(super) fn write_vectored_full(
    s: &mut TcpStream,
    parts: &mut [IoSlice<'_>],
    what: &str,
) -> Result<()> {
    let mut parts = parts;
    while !parts.is_empty() {
        match s.write_vectored(parts) {
            Ok(0) => {
                return Err(TransferError::io_kind(
                    what,
                    std::io::ErrorKind::WriteZero,
                    "connection closed by peer",
                ))
            }
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TransferError::io(what, e)),
        }
    }
    Ok(())
}

/// Reads and discards `n` bytes (keeps the stream in step after a refused WRITE).
pub(super) fn drain(s: &mut TcpStream, mut n: u64, what: &str) -> Result<()> {
    let mut scratch = vec![0u8; (n.min(1 << 20)) as usize];
    while n > 0 {
        let k = n.min(scratch.len() as u64) as usize;
        read_full(s, &mut scratch[..k], what)?;
        n -= k as u64;
    }
    Ok(())
}
