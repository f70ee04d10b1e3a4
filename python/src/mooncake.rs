//! Mooncake's Python argument forms, translated for `engine.rs`: `local_hostname` and
//! `location` parsing, the batch argument triples. Its `error.h` codes, and which one an
//! error's cause maps to, live with the errors (`kvferry_transfer::error::mooncake`).

use kvferry_transfer::{Location, Op};

pub(crate) use kvferry_transfer::error::mooncake::{code, ERR_INVALID_ARGUMENT};

/// The metadata server value Mooncake uses for its peer-to-peer handshake (no etcd, no HTTP
/// metadata service); the only one kvferry supports.
pub(crate) const P2PHANDSHAKE: &str = "P2PHANDSHAKE";

/// Why Mooncake's `local_hostname` could not be split into host and port.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HostnameError {
    /// Nothing but whitespace.
    #[error("local_hostname is empty")]
    Empty,
    /// `[v6` without the closing bracket.
    #[error("local_hostname {0:?}: missing ']'")]
    MissingBracket(String),
    /// The port is not a number in 0..=65535.
    #[error("local_hostname {0:?}: bad port")]
    BadPort(String),
    /// Text after `]` that is not `:port`.
    #[error("local_hostname {0:?}: junk after ']'")]
    JunkAfterBracket(String),
}

/// Splits Mooncake's `local_hostname` into host and port: `"host"`, `"host:port"`,
/// `"[v6]"`, `"[v6]:port"` or a bare IPv6 address. Port 0 = let the OS pick.
pub(crate) fn split_hostname(s: &str) -> Result<(String, u16), HostnameError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(HostnameError::Empty);
    }
    let bad_port = || HostnameError::BadPort(s.to_string());
    if let Some(rest) = s.strip_prefix('[') {
        let (h, tail) = rest
            .split_once(']')
            .ok_or_else(|| HostnameError::MissingBracket(s.to_string()))?;
        return match tail.strip_prefix(':') {
            None if tail.is_empty() => Ok((h.to_string(), 0)),
            Some(p) => p
                .parse()
                .map(|p| (h.to_string(), p))
                .map_err(|_| bad_port()),
            None => Err(HostnameError::JunkAfterBracket(s.to_string())),
        };
    }
    match s.matches(':').count() {
        0 => Ok((s.to_string(), 0)),
        1 => {
            let (h, p) = s.split_once(':').unwrap_or((s, ""));
            p.parse()
                .map(|p| (h.to_string(), p))
                .map_err(|_| bad_port())
        }
        _ => Ok((s.to_string(), 0)), // a bare IPv6 address
    }
}

/// A `location` argument that is none of Mooncake's forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("location {0:?}: expected \"*\", \"cpu\", \"cpu:N\" or \"cuda:N\"")]
pub(crate) struct LocationError(String);

/// Mooncake's `location` argument: `"*"` = ask CUDA about the pointer, `"cpu"`/`"cpu:N"`
/// (N = NUMA node, ignored) = host memory, `"cuda:N"` = device memory of GPU N.
pub(crate) fn parse_location(location: &str, addr: u64) -> Result<Location, LocationError> {
    let l = location.trim();
    if l == "*" {
        return Ok(kvferry_transfer::gpu::location_of(addr));
    }
    if l.eq_ignore_ascii_case("cpu")
        || l.strip_prefix("cpu:")
            .is_some_and(|n| n.parse::<u32>().is_ok())
    {
        return Ok(Location::Cpu);
    }
    l.parse::<Location>()
        .map_err(|_| LocationError(location.to_string()))
}

/// The `(local, remote, len)` triple of a one-transfer call: none for length 0 (a no-op, as
/// [`triples`] drops).
pub(crate) fn single(buffer: u64, peer_buffer_address: u64, length: u64) -> Vec<(u64, u64, u64)> {
    if length > 0 {
        vec![(buffer, peer_buffer_address, length)]
    } else {
        vec![]
    }
}

/// `(local, remote, len)` triples of the batch call `call`; zero-length entries are dropped
/// (Mooncake completes them as no-ops). `None` (a warning logged, naming `call`) when the three
/// lists differ in length.
pub(crate) fn triples(
    call: &str,
    buffers: &[u64],
    peer_buffer_addresses: &[u64],
    lengths: &[u64],
) -> Option<Vec<(u64, u64, u64)>> {
    if buffers.len() != peer_buffer_addresses.len() || buffers.len() != lengths.len() {
        tracing::warn!("{call}: buffers, peer_buffer_addresses and lengths have different lengths");
        return None;
    }
    Some(
        buffers
            .iter()
            .zip(peer_buffer_addresses)
            .zip(lengths)
            .filter(|(_, &n)| n > 0)
            .map(|((&l, &r), &n)| (l, r, n))
            .collect(),
    )
}

pub(crate) fn op_name(op: Op) -> &'static str {
    match op {
        Op::Write => "write",
        Op::Read => "read",
    }
}
