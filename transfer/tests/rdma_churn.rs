//! No leaks under churn over RDMA: consumers (child processes on the RDMA
//! transport) are loaded and killed many times; the producer's endpoints (QPs), cached
//! descriptors, file descriptors and threads return to their starting count once
//! `peer_idle_timeout` passes. The only test of this binary, so no other test moves the counts.
//! Skipped without an RDMA device (run in the soft-RoCE guest).

mod common;

use std::time::Duration;

use common::child;
use common::rdma::{engine_with, rdma_or_skip};
use common::Buf;

const LEN: u64 = 1 << 20;

#[test]
#[ignore = "child process mode of the churn tests"]
fn child_consumer() {
    child::serve_if_child();
}

#[test]
#[cfg_attr(
    not(feature = "rdma"),
    ignore = "needs the `rdma` cargo feature: cargo test --features kvferry/rdma"
)]
fn rdma_killed_consumers_leave_no_qps_fds_or_threads_behind() {
    if !rdma_or_skip("rdma_killed_consumers_leave_no_qps_fds_or_threads_behind") {
        return;
    }
    let producer = engine_with(|c| c.peer_idle_timeout = Duration::from_secs(1));
    let src = Buf::new(LEN as usize, 7);
    src.register(&producer);
    child::killed_consumers_leave_nothing_behind(
        &producer,
        src.addr(),
        LEN,
        "child_consumer",
        true,
        6,
        Duration::from_secs(60),
    );
}
