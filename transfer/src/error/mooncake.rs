//! Mooncake's return codes (`mooncake-transfer-engine/include/error.h`) for kvferry's errors:
//! the Python binding's `TransferEngine` answers with them, as Mooncake's does. One function,
//! [`code`], maps a typed cause to its code.

use super::{ArgumentError, HandshakeError, RegistrationError, TransferError};

/// Mooncake `error.h`: invalid argument, and the generic failure of its Python layer.
pub const ERR_INVALID_ARGUMENT: i32 = -1;
/// Mooncake `error.h`: the address is not registered.
pub const ERR_ADDRESS_NOT_REGISTERED: i32 = -3;
/// Mooncake `error.h`: busy (a region batches still use cannot be unregistered).
pub const ERR_BATCH_BUSY: i32 = -4;
/// Mooncake `error.h`: registration overlaps a registered region.
pub const ERR_ADDRESS_OVERLAPPED: i32 = -7;
/// Mooncake `error.h` (`ERR_DNS`): the peer's host cannot be resolved (or its name is not
/// `host:port`).
pub const ERR_DNS: i32 = -101;
/// Mooncake `error.h` (`ERR_SOCKET`): the peer's handshake listener cannot be reached.
pub const ERR_SOCKET: i32 = -102;
/// Mooncake `error.h` (`ERR_MALFORMED_JSON`): the peer's handshake reply does not parse.
pub const ERR_MALFORMED_JSON: i32 = -103;

/// Mooncake's `error.h` code for a failed engine call, from its typed cause: the code
/// Mooncake's own engine returns for the same failure (`transfer_engine_impl.cpp`,
/// `transfer_metadata_plugin.cpp`). The Python binding returns it from registration,
/// unregistration and `send_probe`; its transfer calls return -1 whatever the cause, as
/// Mooncake's Python layer does.
///
/// - `ERR_ADDRESS_OVERLAPPED` (-7): a registration overlapping a registered region.
/// - `ERR_BATCH_BUSY` (-4): a region that transfers in flight still use.
/// - `ERR_ADDRESS_NOT_REGISTERED` (-3): no region at the address (unregister), or a local or
///   remote range outside registered memory (Mooncake's `selectDevice`).
/// - `ERR_DNS` (-101): the peer's host does not resolve, or the name is not `host:port`
///   (Mooncake parses any name and fails at `getaddrinfo`).
/// - `ERR_SOCKET` (-102): the peer cannot be reached, closes the connection, does not answer
///   in time, answers with another frame, or refuses the handshake.
/// - `ERR_MALFORMED_JSON` (-103): the peer's reply is not the JSON it should be.
/// - `ERR_INVALID_ARGUMENT` (-1): anything else (bad argument, configuration, transport; an
///   RDMA work request that failed, whatever its work completion status, and a failed RDMA
///   connect: Mooncake reports those as a failed transfer, -1 from its Python layer).
pub fn code(e: &TransferError) -> i32 {
    match e {
        TransferError::Registration(RegistrationError::Overlaps { .. }) => ERR_ADDRESS_OVERLAPPED,
        TransferError::InUse { .. } => ERR_BATCH_BUSY,
        TransferError::InvalidArgument(ArgumentError::NoRegionAt { .. })
        | TransferError::NotRegistered { .. }
        | TransferError::RemoteOutOfRange { .. } => ERR_ADDRESS_NOT_REGISTERED,
        TransferError::BadSegmentName(_) => ERR_DNS,
        TransferError::Handshake { source, .. } => match source {
            HandshakeError::Resolve(_) | HandshakeError::NoAddress => ERR_DNS,
            HandshakeError::BadJson { .. } => ERR_MALFORMED_JSON,
            HandshakeError::BodyTooLarge(_) => ERR_INVALID_ARGUMENT,
            _ => ERR_SOCKET,
        },
        TransferError::Io(_) | TransferError::Timeout(_) => ERR_SOCKET,
        TransferError::Failed { first, .. } => code(first),
        TransferError::Retry { source, .. } => code(source),
        _ => ERR_INVALID_ARGUMENT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::IoError;
    use std::io::{Error, ErrorKind};
    use std::sync::Arc;
    use std::time::Duration;

    fn handshake(source: HandshakeError) -> TransferError {
        TransferError::Handshake {
            peer: "h:1".into(),
            source,
        }
    }

    fn io(kind: ErrorKind) -> IoError {
        IoError::new("connect to h:1", Error::from(kind))
    }

    #[test]
    fn err_invalid_argument_for_a_bad_argument_or_anything_unnamed() {
        let zero =
            TransferError::InvalidArgument(ArgumentError::ZeroLengthRequest { local_addr: 0x1000 });
        assert_eq!(code(&zero), ERR_INVALID_ARGUMENT);
        let wraps = TransferError::Registration(RegistrationError::Wraps {
            addr: u64::MAX,
            len: 2,
        });
        assert_eq!(code(&wraps), ERR_INVALID_ARGUMENT);
        assert_eq!(code(&TransferError::Cancelled), ERR_INVALID_ARGUMENT);
        let big = handshake(HandshakeError::BodyTooLarge(1 << 30));
        assert_eq!(code(&big), ERR_INVALID_ARGUMENT);
    }

    #[test]
    fn err_address_not_registered_for_no_region_and_out_of_range_addresses() {
        let none = TransferError::InvalidArgument(ArgumentError::NoRegionAt { addr: 0x1000 });
        assert_eq!(code(&none), ERR_ADDRESS_NOT_REGISTERED);
        let local = TransferError::NotRegistered { addr: 1, len: 2 };
        assert_eq!(code(&local), ERR_ADDRESS_NOT_REGISTERED);
        let remote = TransferError::RemoteOutOfRange {
            segment: "h:1".into(),
            addr: 1,
            len: 2,
        };
        assert_eq!(code(&remote), ERR_ADDRESS_NOT_REGISTERED);
        // a batch is named by its first failed slice
        let batch = TransferError::Failed {
            first: Box::new(remote),
            failed: 1,
            total: 4,
        };
        assert_eq!(code(&batch), ERR_ADDRESS_NOT_REGISTERED);
    }

    #[test]
    fn err_batch_busy_for_a_region_in_use() {
        let busy = TransferError::InUse {
            addr: 0x1000,
            batches: 1,
            waited: Duration::from_secs(5),
        };
        assert_eq!(code(&busy), ERR_BATCH_BUSY);
    }

    #[test]
    fn err_address_overlapped_for_an_overlapping_registration() {
        let overlap = TransferError::Registration(RegistrationError::Overlaps {
            addr: 0x1000,
            len: 10,
            with_addr: 0x1004,
            with_len: 10,
        });
        assert_eq!(code(&overlap), ERR_ADDRESS_OVERLAPPED);
    }

    #[test]
    fn err_dns_for_an_unresolvable_host_or_a_bad_segment_name() {
        let resolve = handshake(HandshakeError::Resolve(io(ErrorKind::NotFound)));
        assert_eq!(code(&resolve), ERR_DNS);
        assert_eq!(code(&handshake(HandshakeError::NoAddress)), ERR_DNS);
        let name = TransferError::BadSegmentName("no-port-here".into());
        assert_eq!(code(&name), ERR_DNS);
    }

    #[test]
    fn err_socket_for_an_unreachable_silent_or_refusing_peer_and_a_timeout() {
        let refused = handshake(HandshakeError::Connect(io(ErrorKind::ConnectionRefused)));
        assert_eq!(code(&refused), ERR_SOCKET);
        assert_eq!(code(&handshake(HandshakeError::Closed)), ERR_SOCKET);
        let late = handshake(HandshakeError::Exchange(Box::new(TransferError::Timeout(
            Duration::from_secs(5),
        ))));
        assert_eq!(code(&late), ERR_SOCKET);
        assert_eq!(
            code(&TransferError::Timeout(Duration::from_secs(5))),
            ERR_SOCKET
        );
        let eof = TransferError::io_kind("reply", ErrorKind::UnexpectedEof, "closed");
        assert_eq!(code(&eof), ERR_SOCKET);
        assert_eq!(code(&handshake(HandshakeError::TargetUnproven)), ERR_SOCKET);
    }

    #[test]
    fn err_malformed_json_for_a_reply_that_does_not_parse() {
        let bad = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let e = handshake(HandshakeError::BadJson {
            what: "descriptor",
            source: Arc::new(bad),
        });
        assert_eq!(code(&e), ERR_MALFORMED_JSON);
    }

    #[test]
    fn err_invalid_argument_for_a_failed_rdma_work_request_or_connect() {
        use crate::error::{FailedWork, RdmaError, Shared, WcStatus, WorkOp, WorkRequest};
        for status in [0, 5, 10, 12, 99] {
            let work = TransferError::Rdma(RdmaError::WorkFailed(Box::new(FailedWork {
                request: WorkRequest {
                    op: WorkOp::Read,
                    bytes: 8,
                    first_slice: 0,
                    last_slice: 0,
                    wr_id: 1,
                    local_addr: 0x1000,
                    peer: "h:1".into(),
                    remote_addr: 0x2000,
                    rkey: 1,
                    device: "rxe0".into(),
                    qp_num: 1,
                },
                status: WcStatus::from_code(status),
                vendor_err: 0,
                after: None,
            })));
            assert_eq!(code(&work), ERR_INVALID_ARGUMENT, "{work}");
            assert_eq!(work.cause(), "rdma");
        }
        // a connect that failed for want of an address is still a failed transfer, not -101
        let connect = RdmaError::Connect {
            peer: "h:1".into(),
            source: Shared(Arc::new(handshake(HandshakeError::NoAddress))),
        };
        let retried = TransferError::Rdma(RdmaError::Retried {
            last: Box::new(connect),
            retries: 2,
            first: None,
        });
        assert_eq!(code(&retried), ERR_INVALID_ARGUMENT, "{retried}");
        assert_eq!(
            retried.to_string(),
            "rdma: RDMA connect to h:1: handshake with h:1 failed: no address (after 2 retries)"
        );
    }
}
