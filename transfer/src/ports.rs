//! The engine's listening ports: one port, or the first free port of a range the operator
//! opened in the firewall (`EngineConfig::listen_ports`).
//!
//! An engine listens on two TCP ports: the handshake listener (descriptors, RDMA connects) and,
//! with the TCP transport, the data listener. Both are ephemeral by default. Between hosts behind
//! a firewall the operator gives a range instead; every engine of every process on the host then
//! binds the lowest free ports of it, so one range serves any number of ranks and engines started
//! in any order (a bind is atomic: two processes never get the same port).

use std::fmt;
use std::net::TcpListener;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An inclusive range of TCP ports, `first..=last`, both in 1..=65535. Written `"LO-HI"`, or
/// `"PORT"` for one port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortRange {
    /// The lowest port of the range.
    pub first: u16,
    /// The highest port of the range (at least `first`).
    pub last: u16,
}

/// Why a port range does not parse ([`PortRange::from_str`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?}: expected a port range LO-HI (e.g. 20000-20099) or one port, ports 1-65535, LO <= HI"
)]
pub struct PortRangeError(pub String);

impl PortRange {
    /// The ports in the range (1..=65536 of them).
    pub fn len(&self) -> u32 {
        u32::from(self.last) - u32::from(self.first) + 1
    }

    /// Never true: a range holds at least one port.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl FromStr for PortRange {
    type Err = PortRangeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || PortRangeError(text.to_string());
        let t = text.trim();
        let (a, b) = t.split_once('-').unwrap_or((t, t));
        let first: u16 = a.trim().parse().map_err(|_| bad())?;
        let last: u16 = b.trim().parse().map_err(|_| bad())?;
        if first == 0 || last < first {
            return Err(bad());
        }
        Ok(PortRange { first, last })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

/// Binds a TCP listener on `host` (no brackets): at `port` when it is not 0 or no `range` is
/// given (0: the OS picks), else at the lowest free port of `range`. Errors: the bind's own error
/// for a fixed or ephemeral port; for a range, the first error that is not "address in use"
/// (a host that is not local fails at once), else `AddrInUse` saying every port of the range is
/// taken.
pub fn bind_listener(
    host: &str,
    port: u16,
    range: Option<PortRange>,
) -> std::io::Result<TcpListener> {
    let Some(range) = range.filter(|_| port == 0) else {
        return TcpListener::bind((host, port));
    };
    for p in range.first..=range.last {
        match TcpListener::bind((host, p)) {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!(
            "every port of the engine port range {range} is in use ({} ports; each engine takes \
             one for its handshake and, over TCP, one for data): widen the range",
            range.len()
        ),
    ))
}

/// `host:port`, an IPv6 host in brackets (`[::1]:9`; a host already in brackets is kept as
/// is): the one way kvferry writes an address, e.g. a listener's segment name.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `host` without the brackets an IPv6 address is written in (`[::1]` → `::1`), as a socket
/// binds it; any other host as is.
pub fn unbracket(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Where [`bind_listener`] binds, for messages: `host:port`, or `host port LO-HI` when the range
/// applies.
pub(crate) fn listen_address(host: &str, port: u16, range: Option<PortRange>) -> String {
    match range.filter(|_| port == 0) {
        Some(r) => format!("{host} port {r}"),
        None => host_port(host, port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bracketed_ipv6_hosts_bind_without_their_brackets() {
        assert_eq!(unbracket("[::1]"), "::1");
        assert_eq!(unbracket("::1"), "::1");
        assert_eq!(unbracket("10.0.0.1"), "10.0.0.1");
        assert_eq!(unbracket("[::1"), "[::1");
        assert_eq!(unbracket(&host_port("fe80::1", 9)[..9]), "fe80::1");
    }

    #[test]
    fn ranges_parse_and_bad_ones_are_refused() {
        assert_eq!(
            "20000-20099".parse(),
            Ok(PortRange {
                first: 20000,
                last: 20099
            })
        );
        assert_eq!(" 7 ".parse(), Ok(PortRange { first: 7, last: 7 }));
        for bad in ["", "0-10", "10-9", "1-65536", "a-b", "-5", "5-", "1:2"] {
            assert_eq!(
                bad.parse::<PortRange>(),
                Err(PortRangeError(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_range_binds_its_lowest_free_port_and_says_when_none_is_free() {
        // A free port and the one above it, found by binding and letting go.
        let (lo, held) = loop {
            let a = TcpListener::bind(("127.0.0.1", 0)).unwrap();
            let p = a.local_addr().unwrap().port();
            if p < 65535 {
                if let Ok(b) = TcpListener::bind(("127.0.0.1", p + 1)) {
                    drop(b);
                    break (p, a);
                }
            }
        };
        let range = PortRange {
            first: lo,
            last: lo + 1,
        };
        // `lo` is held: the next port of the range is bound.
        let l = bind_listener("127.0.0.1", 0, Some(range)).unwrap();
        assert_eq!(l.local_addr().unwrap().port(), lo + 1);
        // Both held: the error names the range.
        let e = bind_listener("127.0.0.1", 0, Some(range)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        assert!(e.to_string().contains(&range.to_string()), "{e}");
        // A fixed port wins over the range.
        drop(held);
        let fixed = bind_listener("127.0.0.1", lo, Some(range)).unwrap();
        assert_eq!(fixed.local_addr().unwrap().port(), lo);
    }
}
