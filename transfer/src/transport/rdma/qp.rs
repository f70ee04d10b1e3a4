//! RC QP state changes: create (INIT), connect (RTR, RTS) towards a peer's QP, fail (ERR),
//! and the path MTU both sides agree on (the smaller side's, so mixed-MTU peers work).

use sideway::ibverbs::address::AddressHandleAttribute;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
};
use sideway::ibverbs::AccessFlags;

use super::connect::QpInfo;
use super::device::{Device, PortInfo};
use super::verbs;
use crate::config::RdmaConfig;
use crate::error::{RdmaError, Result};

/// Creates an RC QP on `dev` (send/recv CQ = the device CQ) and moves it to INIT with remote
/// read and write access.
pub(crate) fn create_qp(dev: &Device, max_wr: u32) -> Result<BasicQueuePair> {
    let mut qp = dev
        .pd
        .create_qp_builder()
        .setup_qp_type(QueuePairType::ReliableConnection)
        .setup_max_send_wr(max_wr)
        .setup_max_recv_wr(1)
        .setup_max_send_sge(1)
        .setup_max_recv_sge(1)
        .setup_send_cq(dev.cq.clone())
        .setup_recv_cq(dev.cq.clone())
        .build()
        .map_err(|e| RdmaError::verbs(format!("{}: create QP", dev.info.name), e))?;
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::Init)
        .setup_pkey_index(0)
        .setup_port(dev.info.port)
        .setup_access_flags(
            AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
        );
    qp.modify(&a)
        .map_err(|e| RdmaError::verbs(format!("{}: QP to INIT", dev.info.name), e))?;
    Ok(qp)
}

/// Moves an INIT QP to RTR then RTS towards `remote`'s QP `rq`.
pub(crate) fn connect_qp(
    qp: &mut BasicQueuePair,
    dev: &Device,
    local_psn: u32,
    remote: &PortInfo,
    rq: QpInfo,
    path_mtu: u32,
    config: &RdmaConfig,
) -> Result<()> {
    let mtu = verbs::mtu_from_bytes(path_mtu)
        .ok_or_else(|| verbs::not_an_ib_mtu("path MTU".into(), path_mtu))?;
    let mut ah = AddressHandleAttribute::new();
    ah.setup_dest_lid(remote.lid)
        .setup_port(dev.info.port)
        .setup_service_level(0);
    if dev.info.ethernet || remote.lid == 0 {
        let gid = remote.gid_value()?;
        ah.setup_grh(&gid, 0, dev.info.gid_index.min(255) as u8, 64, 0);
    }
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::ReadyToReceive)
        .setup_path_mtu(mtu)
        .setup_dest_qp_num(rq.qpn)
        .setup_rq_psn(rq.psn & 0x00ff_ffff)
        .setup_max_dest_read_atomic(dev.max_rd_atomic)
        .setup_min_rnr_timer(12)
        .setup_address_vector(&ah);
    let op = format!(
        "{}: QP {:#x} to RTR (remote QP {:#x}, GID {}, MTU {path_mtu})",
        dev.info.name,
        qp.qp_number(),
        rq.qpn,
        remote.gid,
    );
    qp.modify(&a).map_err(|e| RdmaError::verbs(op, e))?;
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::ReadyToSend)
        .setup_sq_psn(local_psn & 0x00ff_ffff)
        .setup_timeout(config.qp_timeout)
        .setup_retry_cnt(config.retry_count.min(7))
        .setup_rnr_retry(config.retry_count.min(6))
        .setup_max_read_atomic(dev.max_rd_atomic);
    let op = format!("{}: QP {:#x} to RTS", dev.info.name, qp.qp_number());
    qp.modify(&a).map_err(|e| RdmaError::verbs(op, e))?;
    Ok(())
}

/// Moves a QP to the error state: every outstanding work request completes with a flush error.
pub(crate) fn fail_qp(qp: &mut BasicQueuePair) {
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::Error);
    if let Err(e) = qp.modify(&a) {
        tracing::debug!("QP {:#x} to ERR: {e}", qp.qp_number());
    }
}

/// Path MTU of a connection: the smaller of both sides' advertised active MTUs.
pub(crate) fn path_mtu(local: u32, remote: u32) -> Result<u32> {
    let m = local.min(remote);
    verbs::mtu_from_bytes(m)
        .map(|_| m)
        .ok_or_else(|| verbs::not_an_ib_mtu(format!("path MTU of MTUs {local}/{remote}"), m))
}
