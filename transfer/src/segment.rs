//! Segments: a peer engine named `host:port`, described by the descriptor it returns to a
//! handshake query (`crate::descriptor`; docs/design.md §3 "Segments"). This file holds the
//! handle an open returns and the rules for segment names.

use std::sync::Arc;

use crate::descriptor::SegmentDescriptor;
use crate::error::{Result, TransferError};

/// An opened segment (returned by `TransferEngine::open_segment`): its name and the descriptor
/// fetched by the handshake (cached by the engine). Cheap to clone.
#[derive(Debug, Clone)]
pub struct SegmentHandle {
    pub(crate) descriptor: Arc<SegmentDescriptor>,
    pub(crate) token: Option<crate::auth::Token>,
}

impl SegmentHandle {
    /// `host:port` of the segment.
    pub fn name(&self) -> &str {
        &self.descriptor.name
    }

    /// This handle with `token` attached: requests submitted with it carry the token, which
    /// the peer checks against the grant it made (`crate::auth`).
    pub fn with_token(mut self, token: crate::auth::Token) -> SegmentHandle {
        self.token = Some(token);
        self
    }

    /// The attached grant token, if any.
    pub fn token(&self) -> Option<crate::auth::Token> {
        self.token
    }

    /// The descriptor this handle was opened with.
    pub fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }
}

/// `Ok` for a name of the form `host:port` (host nonempty, port 1..=65535).
/// Errors: `BadSegmentName` naming the bad name.
pub(crate) fn check_segment_name(name: &str) -> Result<()> {
    let ok = name
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    if ok {
        Ok(())
    } else {
        Err(TransferError::BadSegmentName(name.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_are_checked() {
        for ok in ["127.0.0.1:15000", "host:1", "[::1]:9"] {
            check_segment_name(ok).unwrap();
        }
        for bad in ["", "host", ":80", "host:0", "host:99999", "host:x"] {
            assert!(check_segment_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ipv6_hosts_are_bracketed() {
        use crate::ports::host_port;
        assert_eq!(host_port("::1", 9), "[::1]:9");
        assert_eq!(host_port("[::1]", 9), "[::1]:9");
        assert_eq!(host_port("10.0.0.1", 9), "10.0.0.1:9");
    }
}
