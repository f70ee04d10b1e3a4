//! No leaks under churn over RDMA (issue 10): consumers (child processes on the RDMA
//! transport) are loaded and killed many times; the producer's endpoints (QPs), cached
//! descriptors, file descriptors and threads return to their starting count once
//! `peer_idle_timeout` passes. The only test of this binary, so no other test moves the counts.
//! Skipped without an RDMA device (run in the soft-RoCE guest).

mod common;

use std::time::Duration;

use common::child::{self, eventually, fds, threads, Spec};
use common::rdma::{engine_with, rdma_or_skip};
use common::Buf;

const LEN: u64 = 1 << 20;

#[test]
#[ignore = "child process mode of the churn tests"]
fn child_consumer() {
    child::serve_if_child();
}

#[test]
fn rdma_killed_consumers_leave_no_qps_fds_or_threads_behind() {
    if !rdma_or_skip("rdma_killed_consumers_leave_no_qps_fds_or_threads_behind") {
        return;
    }
    let producer = engine_with(|c| c.peer_idle_timeout = Duration::from_secs(1));
    let src = Buf::new(LEN as usize, 7);
    src.register(&producer);
    let (fd0, th0) = (fds(), threads());
    let mut peak = (fd0, th0, 0usize);
    for round in 0..6u64 {
        let c = child::spawn(
            "child_consumer",
            Spec {
                len: LEN,
                rdma: true,
                ..Spec::default()
            },
        );
        for _ in 0..3 {
            let reqs: Vec<(u64, u64, u64)> = (0..8)
                .map(|i| (src.addr() + i * 65536, c.addr + i * 65536, 65536))
                .collect();
            producer
                .batch_transfer_sync_write(&c.segment, &reqs)
                .unwrap_or_else(|e| panic!("round {round}: write to the live consumer: {e}"));
        }
        let st = producer.stats();
        assert!(st.connections > 0, "round {round}: QPs counted: {st:?}");
        peak = (
            peak.0.max(fds()),
            peak.1.max(threads()),
            peak.2.max(st.connections),
        );
        c.kill();
    }
    let stats0 = kvferry_transfer::EngineStats::default();
    let back = eventually(Duration::from_secs(60), || {
        fds() <= fd0 && threads() <= th0 && producer.stats() == stats0
    });
    eprintln!(
        "producer before churn: {fd0} fds, {th0} threads; peak {} fds, {} threads, {} QPs; \
         after 6 killed consumers and the idle timeout: {} fds, {} threads, {:?}",
        peak.0,
        peak.1,
        peak.2,
        fds(),
        threads(),
        producer.stats()
    );
    assert!(
        back,
        "fds {} (start {fd0}), threads {} (start {th0}), {:?} did not return",
        fds(),
        threads(),
        producer.stats()
    );
}
