//! The few verbs calls sideway 0.4.3 does not wrap (raw CQ polling, CQ notification, async
//! events, status texts), via rdma-mummy-sys, which loads libibverbs with `dlopen` at start-up:
//! with no libibverbs every call reports `EOPNOTSUPP` instead of crashing.

use std::os::fd::RawFd;
use std::time::Duration;

use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};

pub(crate) use sys::ibv_wc as WorkCompletion;

/// Polls up to `out.capacity()` completions into `out` (cleared first). Err(errno) on failure.
pub(crate) fn poll_cq(
    cq: &BasicCompletionQueue,
    out: &mut Vec<WorkCompletion>,
) -> Result<usize, i32> {
    out.clear();
    let cap = out.capacity().min(i32::MAX as usize) as i32;
    // SAFETY: `out` has room for `cap` entries; the CQ outlives the call.
    let n = unsafe { sys::ibv_poll_cq(cq.cq().as_ptr(), cap, out.as_mut_ptr()) };
    if n < 0 {
        return Err(-n);
    }
    // SAFETY: ibv_poll_cq initialised the first `n` (0 <= n <= cap <= capacity) entries.
    unsafe { out.set_len(n as usize) };
    Ok(n as usize)
}

/// Largest single work request the transport posts, bytes (`RdmaConfig::merge_bytes` is
/// bounded by it; the IB limit is 2^31).
pub(crate) const MAX_WR_BYTES: u64 = 1 << 30;

/// One RDMA WRITE or READ work request with one scatter/gather entry, as `post_send_list`
/// posts it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawWr {
    pub wr_id: u64,
    /// READ (remote → local) when true, else WRITE (local → remote).
    pub read: bool,
    pub lkey: u32,
    pub local_addr: u64,
    /// Bytes (the caller bounds it by the IB limit of 2^31).
    pub len: u32,
    pub rkey: u32,
    pub remote_addr: u64,
    /// Asks for a work completion on success (an error always gives one, and so does a flush).
    pub signaled: bool,
}

/// Posts `wrs` (signalled where `RawWr::signaled`) on `qp` as one chained list in a single `ibv_post_send`
/// (one doorbell instead of one per work request). `Err((posted, errno))` when the provider
/// refused one: the first `posted` work requests are on the send queue (they complete, or
/// flush once the QP is in error), the rest are not.
///
/// # Safety
/// Every `[local_addr, +len)` must lie in memory registered under `lkey` and stay registered
/// until the work request completes; `qp` must be a live RC QP.
pub(crate) unsafe fn post_send_list(
    qp: &BasicQueuePair,
    wrs: &[RawWr],
) -> Result<(), (usize, i32)> {
    if wrs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<sys::ibv_sge> = wrs
        .iter()
        .map(|w| sys::ibv_sge {
            addr: w.local_addr,
            length: w.len,
            lkey: w.lkey,
        })
        .collect();
    let mut list: Vec<sys::ibv_send_wr> = wrs
        .iter()
        .map(|w| {
            // SAFETY: ibv_send_wr is plain data (integers, raw pointers, unions of them): all
            // zeroes is a valid value (null pointers, no SGE, opcode WRITE).
            let mut r: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
            r.wr_id = w.wr_id;
            r.num_sge = 1;
            r.opcode = if w.read {
                sys::ibv_wr_opcode::IBV_WR_RDMA_READ
            } else {
                sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE
            };
            r.send_flags = if w.signaled {
                sys::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            r.wr.rdma = sys::rdma_t {
                remote_addr: w.remote_addr,
                rkey: w.rkey,
            };
            r
        })
        .collect();
    // both vectors are complete: their buffers no longer move, so the pointers stay valid
    let n = list.len();
    let base = list.as_mut_ptr();
    for i in 0..n {
        // SAFETY: i < n = list.len() = sges.len(); the next pointer is the element after i
        // (or null for the last one).
        unsafe {
            let w = base.add(i);
            (*w).sg_list = sges.as_mut_ptr().add(i);
            (*w).next = if i + 1 < n {
                base.add(i + 1)
            } else {
                std::ptr::null_mut()
            };
        }
    }
    let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
    // SAFETY: the list is well formed (n linked entries with one SGE each, alive for the
    // call); the caller guarantees the QP and the memory; `bad` is a valid out-pointer.
    let rc = unsafe { sys::ibv_post_send(qp.qp().as_ptr(), base, &mut bad) };
    if rc == 0 {
        return Ok(());
    }
    // entries before `bad_wr` were posted; a provider that leaves it unset posted none
    let posted = if bad.is_null() {
        0
    } else {
        // SAFETY: `bad` points into `list` (the provider returns one of our entries).
        (unsafe { bad.offset_from(base) }).clamp(0, n as isize) as usize
    };
    Err((posted, rc))
}

/// Arms the CQ so its next completion raises an event on its channel.
pub(crate) fn req_notify_cq(cq: &BasicCompletionQueue) -> Result<(), i32> {
    // SAFETY: `cq` is a live CQ (the borrow keeps it from being destroyed during the call).
    match unsafe { sys::ibv_req_notify_cq(cq.cq().as_ptr(), 0) } {
        0 => Ok(()),
        e => Err(e),
    }
}

/// Waits up to `timeout` for the channel's fd to become readable; then consumes and acks every
/// pending CQ event (the fd is non-blocking). Returns whether an event came.
pub(crate) fn wait_cq_event(channel: &CompletionChannel, timeout: Duration) -> bool {
    let fd = std::os::fd::AsRawFd::as_raw_fd(channel);
    if !wait_readable(fd, timeout) {
        return false;
    }
    let mut got = false;
    loop {
        let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::os::raw::c_void = std::ptr::null_mut();
        // SAFETY: the channel is live for the borrow; `cq` and `ctx` are valid out-pointers to
        // locals.
        let rc =
            unsafe { sys::ibv_get_cq_event(channel.comp_channel().as_ptr(), &mut cq, &mut ctx) };
        if rc != 0 || cq.is_null() {
            return got;
        }
        // ibv_destroy_cq waits for every event to be acked: ack at once.
        // SAFETY: `cq` is the non-null CQ ibv_get_cq_event just returned an event for; it
        // cannot be destroyed before this ack.
        unsafe { sys::ibv_ack_cq_events(cq, 1) };
        got = true;
    }
}

/// poll(2) on one fd for readability, up to `timeout`.
pub(crate) fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `p` is one valid, initialised pollfd on the stack, and nfds is 1.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0 && (p.revents & libc::POLLIN) != 0
}

/// Sets O_NONBLOCK on `fd`.
pub(crate) fn set_nonblocking(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl F_GETFL/F_SETFL takes no pointers; `fd` is the open async fd of a live
    // context (a bad fd would only make fcntl fail with EBADF).
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The context's async event fd.
pub(crate) fn async_fd(ctx: &DeviceContext) -> RawFd {
    // SAFETY: `context()` points to the `ibv_context` that `ctx` keeps open for the borrow;
    // reading its `async_fd` field is a plain read of initialised memory.
    unsafe { ctx.context().as_ref().async_fd }
}

/// Same layout as `struct ibv_async_event`, with the event type kept as a raw number (reading
/// an unknown value into a Rust enum would be undefined behaviour).
#[repr(C)]
struct RawAsyncEvent {
    element: usize,
    event_type: u32,
}

/// An async event type (`enum ibv_event_type`, verbs.h), named; a number this build does not
/// know stays a number (`Unknown`) rather than being read into a Rust enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AsyncEvent {
    CqErr,
    QpFatal,
    QpReqErr,
    QpAccessErr,
    CommEst,
    SqDrained,
    PathMig,
    PathMigErr,
    DeviceFatal,
    PortActive,
    PortErr,
    LidChange,
    PkeyChange,
    SmChange,
    SrqErr,
    SrqLimitReached,
    QpLastWqeReached,
    ClientReregister,
    GidChange,
    WqFatal,
    DeviceSpeedChange,
    Unknown(u32),
}

/// The events in `enum ibv_event_type` order: `KNOWN_EVENTS[n]` has the value `n`.
const KNOWN_EVENTS: [AsyncEvent; 21] = [
    AsyncEvent::CqErr,
    AsyncEvent::QpFatal,
    AsyncEvent::QpReqErr,
    AsyncEvent::QpAccessErr,
    AsyncEvent::CommEst,
    AsyncEvent::SqDrained,
    AsyncEvent::PathMig,
    AsyncEvent::PathMigErr,
    AsyncEvent::DeviceFatal,
    AsyncEvent::PortActive,
    AsyncEvent::PortErr,
    AsyncEvent::LidChange,
    AsyncEvent::PkeyChange,
    AsyncEvent::SmChange,
    AsyncEvent::SrqErr,
    AsyncEvent::SrqLimitReached,
    AsyncEvent::QpLastWqeReached,
    AsyncEvent::ClientReregister,
    AsyncEvent::GidChange,
    AsyncEvent::WqFatal,
    AsyncEvent::DeviceSpeedChange,
];

/// What an async event's `element` union holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventElement {
    /// A `struct ibv_qp *`.
    Qp,
    /// A port number.
    Port,
    /// A CQ, SRQ, WQ or nothing: not reported.
    Other,
}

impl AsyncEvent {
    /// The event for a raw `ibv_event_type` value.
    pub fn from_raw(t: u32) -> AsyncEvent {
        KNOWN_EVENTS
            .get(t as usize)
            .copied()
            .unwrap_or(AsyncEvent::Unknown(t))
    }

    /// The raw `ibv_event_type` value.
    pub fn raw(self) -> u32 {
        match self {
            AsyncEvent::Unknown(t) => t,
            known => KNOWN_EVENTS.iter().position(|e| *e == known).unwrap_or(0) as u32,
        }
    }

    /// What the event's element is (verbs.h: QP events carry the QP, port events the port).
    pub fn element(self) -> EventElement {
        use AsyncEvent::*;
        match self {
            QpFatal | QpReqErr | QpAccessErr | CommEst | SqDrained | PathMig | PathMigErr
            | QpLastWqeReached => EventElement::Qp,
            PortActive | PortErr | LidChange | PkeyChange | SmChange | ClientReregister
            | GidChange | DeviceSpeedChange => EventElement::Port,
            _ => EventElement::Other,
        }
    }

    /// True for events that report a normal change (logged at info), false for errors and
    /// events this build does not know (logged at warn).
    pub fn is_informational(self) -> bool {
        use AsyncEvent::*;
        matches!(
            self,
            CommEst | PortActive | LidChange | ClientReregister | GidChange | DeviceSpeedChange
        )
    }

    /// The event's name for logs.
    pub fn name(self) -> &'static str {
        use AsyncEvent::*;
        match self {
            CqErr => "CQ error",
            QpFatal => "QP fatal",
            QpReqErr => "QP request error",
            QpAccessErr => "QP access error",
            CommEst => "communication established",
            SqDrained => "SQ drained",
            PathMig => "path migrated",
            PathMigErr => "path migration error",
            DeviceFatal => "device fatal",
            PortActive => "port active",
            PortErr => "port error",
            LidChange => "LID change",
            PkeyChange => "P_Key change",
            SmChange => "SM change",
            SrqErr => "SRQ error",
            SrqLimitReached => "SRQ limit reached",
            QpLastWqeReached => "QP last WQE reached",
            ClientReregister => "client reregister",
            GidChange => "GID change",
            WqFatal => "WQ fatal",
            DeviceSpeedChange => "device speed change",
            Unknown(_) => "unknown event",
        }
    }
}

/// Takes one async event if one is pending (the fd must be non-blocking), acks it and returns
/// (event, element: QP number / port number / 0).
pub(crate) fn take_async_event(ctx: &DeviceContext) -> Option<(AsyncEvent, u64)> {
    let mut ev = RawAsyncEvent {
        element: 0,
        event_type: u32::MAX,
    };
    // SAFETY: RawAsyncEvent has ibv_async_event's size and layout (a pointer-sized union, an
    // enum of C int size, padding); the context pointer is live for the lifetime of `ctx`.
    let rc = unsafe {
        sys::ibv_get_async_event(
            ctx.context().as_ptr(),
            &mut ev as *mut RawAsyncEvent as *mut sys::ibv_async_event,
        )
    };
    if rc != 0 {
        return None;
    }
    let event = AsyncEvent::from_raw(ev.event_type);
    let element = match event.element() {
        EventElement::Qp => {
            let qp = ev.element as *const sys::ibv_qp;
            if qp.is_null() {
                0
            } else {
                // SAFETY: for a QP event the element is the QP the event is about; it stays
                // valid until the event is acked below (ibv_destroy_qp waits for the ack).
                unsafe { (*qp).qp_num as u64 }
            }
        }
        EventElement::Port => ev.element as u32 as u64,
        EventElement::Other => 0,
    };
    // SAFETY: acks exactly the event ibv_get_async_event filled into `ev` above (same layout,
    // same memory), once.
    unsafe { sys::ibv_ack_async_event(&mut ev as *mut RawAsyncEvent as *mut sys::ibv_async_event) };
    Some((event, element))
}

/// MTU in bytes of a verbs MTU value.
pub(crate) fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

/// The verbs MTU for a byte count (exact IB MTUs only).
pub(crate) fn mtu_from_bytes(b: u32) -> Option<Mtu> {
    Some(match b {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => return None,
    })
}

/// `Protocol` error: `what`'s value `mtu` is not an IB MTU (256, 512, 1024, 2048, 4096).
pub(crate) fn not_an_ib_mtu(what: String, mtu: u32) -> crate::error::TransferError {
    crate::error::TransferError::Protocol(crate::error::ProtocolError::BadField {
        what,
        value: mtu.to_string(),
        expected: "an IB MTU (256, 512, 1024, 2048 or 4096 bytes)",
    })
}

/// A random 24-bit packet sequence number.
pub(crate) fn random_psn() -> u32 {
    (crate::ids::random_u64() & 0x00ff_ffff) as u32
}

#[cfg(test)]
mod tests {
    #[test]
    fn async_events_are_matched_by_their_verbs_h_values() {
        use super::{AsyncEvent, EventElement};
        use rdma_mummy_sys::ibv_event_type as T;
        let table = [
            (AsyncEvent::CqErr, T::IBV_EVENT_CQ_ERR),
            (AsyncEvent::QpFatal, T::IBV_EVENT_QP_FATAL),
            (AsyncEvent::QpReqErr, T::IBV_EVENT_QP_REQ_ERR),
            (AsyncEvent::QpAccessErr, T::IBV_EVENT_QP_ACCESS_ERR),
            (AsyncEvent::CommEst, T::IBV_EVENT_COMM_EST),
            (AsyncEvent::SqDrained, T::IBV_EVENT_SQ_DRAINED),
            (AsyncEvent::PathMig, T::IBV_EVENT_PATH_MIG),
            (AsyncEvent::PathMigErr, T::IBV_EVENT_PATH_MIG_ERR),
            (AsyncEvent::DeviceFatal, T::IBV_EVENT_DEVICE_FATAL),
            (AsyncEvent::PortActive, T::IBV_EVENT_PORT_ACTIVE),
            (AsyncEvent::PortErr, T::IBV_EVENT_PORT_ERR),
            (AsyncEvent::LidChange, T::IBV_EVENT_LID_CHANGE),
            (AsyncEvent::PkeyChange, T::IBV_EVENT_PKEY_CHANGE),
            (AsyncEvent::SmChange, T::IBV_EVENT_SM_CHANGE),
            (AsyncEvent::SrqErr, T::IBV_EVENT_SRQ_ERR),
            (AsyncEvent::SrqLimitReached, T::IBV_EVENT_SRQ_LIMIT_REACHED),
            (
                AsyncEvent::QpLastWqeReached,
                T::IBV_EVENT_QP_LAST_WQE_REACHED,
            ),
            (AsyncEvent::ClientReregister, T::IBV_EVENT_CLIENT_REREGISTER),
            (AsyncEvent::GidChange, T::IBV_EVENT_GID_CHANGE),
            (AsyncEvent::WqFatal, T::IBV_EVENT_WQ_FATAL),
            (
                AsyncEvent::DeviceSpeedChange,
                T::IBV_EVENT_DEVICE_SPEED_CHANGE,
            ),
        ];
        for (event, raw) in table {
            // the element union holds a QP pointer exactly for the QP events (verbs.h), a port
            // number for the port events: reading one as the other would be a wild pointer
            let qp_event = matches!(
                raw,
                T::IBV_EVENT_QP_FATAL
                    | T::IBV_EVENT_QP_REQ_ERR
                    | T::IBV_EVENT_QP_ACCESS_ERR
                    | T::IBV_EVENT_COMM_EST
                    | T::IBV_EVENT_SQ_DRAINED
                    | T::IBV_EVENT_PATH_MIG
                    | T::IBV_EVENT_PATH_MIG_ERR
                    | T::IBV_EVENT_QP_LAST_WQE_REACHED
            );
            let port_event = matches!(
                raw,
                T::IBV_EVENT_PORT_ACTIVE
                    | T::IBV_EVENT_PORT_ERR
                    | T::IBV_EVENT_LID_CHANGE
                    | T::IBV_EVENT_PKEY_CHANGE
                    | T::IBV_EVENT_SM_CHANGE
                    | T::IBV_EVENT_CLIENT_REREGISTER
                    | T::IBV_EVENT_GID_CHANGE
                    | T::IBV_EVENT_DEVICE_SPEED_CHANGE
            );
            let raw = raw as u32;
            assert_eq!(AsyncEvent::from_raw(raw), event, "{raw}");
            assert_eq!(event.raw(), raw, "{event:?}");
            assert_eq!(event.element() == EventElement::Qp, qp_event, "{event:?}");
            assert_eq!(
                event.element() == EventElement::Port,
                port_event,
                "{event:?}"
            );
        }
        let unknown = AsyncEvent::from_raw(99);
        assert_eq!(unknown, AsyncEvent::Unknown(99));
        assert_eq!(unknown.raw(), 99);
        assert!(
            !unknown.is_informational(),
            "an unknown event is logged as a warning"
        );
        assert!(AsyncEvent::PortActive.is_informational());
        assert!(!AsyncEvent::PortErr.is_informational());
    }
}
