//! A failed RDMA work request, typed: which request ([`WorkRequest`]), the work completion's
//! status ([`WcStatus`]) and vendor error, and, for a flushed request, why its endpoint had
//! failed before ([`EndpointFailure`]). The values come from the completion queue; nothing here
//! calls into libibverbs, so the types are built and tested without a device.

use std::time::Duration;

use super::super::io::IoError;

/// The opcode of an RDMA work request the transport posts (`IBV_WR_RDMA_WRITE`,
/// `IBV_WR_RDMA_READ`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkOp {
    /// `IBV_WR_RDMA_WRITE`: local → remote.
    Write,
    /// `IBV_WR_RDMA_READ`: remote → local.
    Read,
}

impl std::fmt::Display for WorkOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WorkOp::Write => "WRITE",
            WorkOp::Read => "READ",
        })
    }
}

/// One work request as posted: its opcode and length, the engine slices it carries (one, or a
/// run merged into one request), both addresses, and where it went (device, QP, peer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkRequest {
    /// RDMA WRITE or READ.
    pub op: WorkOp,
    /// Bytes the request moves (its slices' lengths summed).
    pub bytes: u64,
    /// Id of its first slice in the batch.
    pub first_slice: u32,
    /// Id of its last slice (equal to `first_slice` unless slices were merged).
    pub last_slice: u32,
    /// The work request id it was posted with.
    pub wr_id: u64,
    /// Local start address (virtual address in this process, or its host mirror).
    pub local_addr: u64,
    /// The peer's segment name (`host:port`).
    pub peer: String,
    /// Remote start address (virtual address in the peer's process).
    pub remote_addr: u64,
    /// The remote key the request used.
    pub rkey: u32,
    /// The local device's name (`"rxe0"`, `"mlx5_0"`).
    pub device: String,
    /// The local QP number.
    pub qp_num: u32,
}

impl std::fmt::Display for WorkRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RDMA {} of {} bytes (slices {}..={}) between local {:#x} and {} remote {:#x} \
             (rkey {:#x}) on {} QP {:#x}",
            self.op,
            self.bytes,
            self.first_slice,
            self.last_slice,
            self.local_addr,
            self.peer,
            self.remote_addr,
            self.rkey,
            self.device,
            self.qp_num
        )
    }
}

/// A work completion's status (`enum ibv_wc_status`, libibverbs `verbs.h`); a value this
/// list does not know is kept as `Other`. Shown as libibverbs' own text with the number
/// (`"remote access error (10)"`), as `ibv_wc_status_str` words it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)] // each variant is the `IBV_WC_*` value of the same name
pub enum WcStatus {
    Success,
    LocLenErr,
    LocQpOpErr,
    LocEecOpErr,
    LocProtErr,
    WrFlushErr,
    MwBindErr,
    BadRespErr,
    LocAccessErr,
    RemInvReqErr,
    RemAccessErr,
    RemOpErr,
    RetryExcErr,
    RnrRetryExcErr,
    LocRddViolErr,
    RemInvRdReqErr,
    RemAbortErr,
    InvEecnErr,
    InvEecStateErr,
    FatalErr,
    RespTimeoutErr,
    GeneralErr,
    TmErr,
    TmRndvIncomplete,
    /// A status value libibverbs did not define when this was written.
    Other(u32),
}

/// The known statuses in `ibv_wc_status` order (index = value), with libibverbs' texts.
const KNOWN: [(WcStatus, &str); 24] = [
    (WcStatus::Success, "success"),
    (WcStatus::LocLenErr, "local length error"),
    (WcStatus::LocQpOpErr, "local QP operation error"),
    (WcStatus::LocEecOpErr, "local EE context operation error"),
    (WcStatus::LocProtErr, "local protection error"),
    (WcStatus::WrFlushErr, "Work Request Flushed Error"),
    (WcStatus::MwBindErr, "memory management operation error"),
    (WcStatus::BadRespErr, "bad response error"),
    (WcStatus::LocAccessErr, "local access error"),
    (WcStatus::RemInvReqErr, "remote invalid request error"),
    (WcStatus::RemAccessErr, "remote access error"),
    (WcStatus::RemOpErr, "remote operation error"),
    (WcStatus::RetryExcErr, "transport retry counter exceeded"),
    (WcStatus::RnrRetryExcErr, "RNR retry counter exceeded"),
    (WcStatus::LocRddViolErr, "local RDD violation error"),
    (WcStatus::RemInvRdReqErr, "remote invalid RD request"),
    (WcStatus::RemAbortErr, "aborted error"),
    (WcStatus::InvEecnErr, "invalid EE context number"),
    (WcStatus::InvEecStateErr, "invalid EE context state"),
    (WcStatus::FatalErr, "fatal error"),
    (WcStatus::RespTimeoutErr, "response timeout error"),
    (WcStatus::GeneralErr, "general error"),
    (WcStatus::TmErr, "TM error"),
    (WcStatus::TmRndvIncomplete, "TM software rendezvous"),
];

impl WcStatus {
    /// The status of a work completion's `status` field.
    pub fn from_code(code: u32) -> Self {
        KNOWN
            .get(code as usize)
            .map_or(WcStatus::Other(code), |(s, _)| *s)
    }

    /// The `ibv_wc_status` value.
    pub fn code(self) -> u32 {
        match self {
            WcStatus::Other(code) => code,
            known => KNOWN
                .iter()
                .position(|(s, _)| *s == known)
                .map_or(u32::MAX, |i| i as u32),
        }
    }

    /// libibverbs' text for the status (`"unknown status"` for `Other`).
    pub fn text(self) -> &'static str {
        KNOWN
            .iter()
            .find(|(s, _)| *s == self)
            .map_or("unknown status", |(_, t)| t)
    }

    /// False for the statuses a retry cannot change, because the request itself is wrong
    /// (a bad rkey, address or length, on either side); true for the rest (a lost or
    /// restarted peer, a flush after its QP failed), which a fresh endpoint may get past.
    pub fn retry_can_help(self) -> bool {
        !matches!(
            self,
            WcStatus::RemAccessErr
                | WcStatus::RemInvReqErr
                | WcStatus::LocProtErr
                | WcStatus::LocLenErr
                | WcStatus::LocAccessErr
        )
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.text(), self.code())
    }
}

/// A work request whose completion came back with an error status.
#[derive(Debug, Clone)]
pub struct FailedWork {
    /// The request.
    pub request: WorkRequest,
    /// Its completion's status.
    pub status: WcStatus,
    /// The completion's vendor error (`ibv_wc::vendor_err`; 0 when the provider gives none).
    pub vendor_err: u32,
    /// For a flushed request (`WcStatus::WrFlushErr`): why its endpoint failed first, which
    /// is what flushed it (also the error's `source()`).
    pub after: Option<EndpointFailure>,
}

impl std::fmt::Display for FailedWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.after {
            Some(first) => write!(f, "{}: {}, after: {first}", self.request, self.status),
            None => {
                write!(
                    f,
                    "{}: work completion status {}",
                    self.request, self.status
                )?;
                if self.vendor_err != 0 {
                    write!(f, ", vendor error {:#x}", self.vendor_err)?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for FailedWork {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.after.as_ref().map(|e| e as _)
    }
}

/// Why an RDMA endpoint (the QPs to one peer on one device) was retired: the first failure
/// only; its outstanding work requests then flush.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EndpointFailure {
    /// A work request on it failed.
    #[error("{0}")]
    Work(#[source] Box<FailedWork>),
    /// The provider refused to post a work request (`op`: which device, QP and peer).
    #[error("{0}")]
    Post(#[source] IoError),
    /// A work request got no completion within `RdmaConfig::completion_timeout`.
    #[error("no work completion within {waited:?} on {device}")]
    NoCompletion {
        /// The timeout.
        waited: Duration,
        /// The local device's name.
        device: String,
    },
    /// It held no work for `RdmaConfig::idle_timeout` and was dropped.
    #[error("dropped after idling")]
    Idle,
    /// The transport shut down.
    #[error("RDMA transport shut down")]
    ShutDown,
    /// The peer said it dropped its side of the connection.
    #[error("disconnected from {peer}")]
    Disconnected {
        /// The peer's segment name.
        peer: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    fn request() -> WorkRequest {
        WorkRequest {
            op: WorkOp::Write,
            bytes: 4096,
            first_slice: 3,
            last_slice: 4,
            wr_id: 7,
            local_addr: 0x1000,
            peer: "h:1".into(),
            remote_addr: 0x2000,
            rkey: 0x42,
            device: "rxe0".into(),
            qp_num: 0x11,
        }
    }

    #[test]
    fn every_status_code_round_trips_and_unknown_ones_are_kept() {
        for code in 0..40 {
            assert_eq!(WcStatus::from_code(code).code(), code);
        }
        assert_eq!(WcStatus::from_code(12), WcStatus::RetryExcErr);
        assert_eq!(WcStatus::from_code(5), WcStatus::WrFlushErr);
        assert_eq!(WcStatus::from_code(99), WcStatus::Other(99));
        assert_eq!(
            WcStatus::RetryExcErr.to_string(),
            "transport retry counter exceeded (12)"
        );
        assert_eq!(WcStatus::Other(99).to_string(), "unknown status (99)");
    }

    #[test]
    fn a_retry_is_tried_only_where_it_can_change_the_outcome() {
        for wrong in [
            WcStatus::RemAccessErr,
            WcStatus::RemInvReqErr,
            WcStatus::LocProtErr,
            WcStatus::LocLenErr,
            WcStatus::LocAccessErr,
        ] {
            assert!(!wrong.retry_can_help(), "{wrong}");
        }
        for lost in [
            WcStatus::RetryExcErr,
            WcStatus::WrFlushErr,
            WcStatus::RnrRetryExcErr,
            WcStatus::Other(99),
        ] {
            assert!(lost.retry_can_help(), "{lost}");
        }
    }

    #[test]
    fn a_failed_work_request_names_itself_its_status_and_what_flushed_it() {
        let first = FailedWork {
            request: request(),
            status: WcStatus::RetryExcErr,
            vendor_err: 0x81,
            after: None,
        };
        assert_eq!(
            first.to_string(),
            "RDMA WRITE of 4096 bytes (slices 3..=4) between local 0x1000 and h:1 remote 0x2000 \
             (rkey 0x42) on rxe0 QP 0x11: work completion status transport retry counter \
             exceeded (12), vendor error 0x81"
        );
        let flushed = FailedWork {
            request: WorkRequest {
                first_slice: 5,
                last_slice: 5,
                ..request()
            },
            status: WcStatus::WrFlushErr,
            vendor_err: 0,
            after: Some(EndpointFailure::Work(Box::new(first.clone()))),
        };
        let text = flushed.to_string();
        assert!(
            text.contains("(slices 5..=5)")
                && text.contains("Work Request Flushed Error (5), after: RDMA WRITE")
                && text.ends_with("vendor error 0x81"),
            "{text}"
        );
        // the endpoint's first failure is the flushed request's source, typed
        let cause = flushed.source().expect("the flush keeps what caused it");
        let cause = cause
            .downcast_ref::<EndpointFailure>()
            .expect("an endpoint failure");
        assert!(matches!(cause, EndpointFailure::Work(w) if w.status == WcStatus::RetryExcErr));
        let silent = EndpointFailure::NoCompletion {
            waited: Duration::from_secs(5),
            device: "rxe0".into(),
        };
        assert_eq!(silent.to_string(), "no work completion within 5s on rxe0");
    }
}
