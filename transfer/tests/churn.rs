//! No leaks under churn (issue 10): consumers (child processes) are started, loaded and killed
//! many times; the producer's open file descriptors and threads return to their starting count
//! once its idle timeouts pass. The only test of this binary (besides the child mode), so no
//! other test's sockets or threads move the counts.

mod common;

use std::time::Duration;

use common::child::{self, eventually, fds, threads, Spec};
use common::{engine_with, Buf};

const LEN: u64 = 1 << 20;

#[test]
#[ignore = "child process mode of the churn tests"]
fn child_consumer() {
    child::serve_if_child();
}

#[test]
fn killed_consumers_leave_no_fds_threads_or_peers_behind() {
    let producer = engine_with(|c| {
        c.tcp.idle_timeout = Duration::from_millis(300);
        c.peer_idle_timeout = Duration::from_millis(300);
        c.tcp.coalesce_bytes = 0; // one frame per slice: every pooled connection is used
    });
    let src = Buf::new(LEN as usize, 7);
    src.register(&producer);
    let (fd0, th0) = (fds(), threads());
    let mut peak = (fd0, th0);
    for round in 0..8u64 {
        let c = child::spawn(
            "child_consumer",
            Spec {
                len: LEN,
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
        peak = (peak.0.max(fds()), peak.1.max(threads()));
        let st = producer.stats();
        assert!(
            st.cached_segments >= 1,
            "round {round}: the live consumer is cached"
        );
        assert!(st.connections > 0, "round {round}: connections counted");
        c.kill();
    }
    let stats0 = kvferry_transfer::EngineStats::default();
    let back = eventually(Duration::from_secs(30), || {
        fds() <= fd0 && threads() <= th0 && producer.stats() == stats0
    });
    eprintln!(
        "producer before churn: {fd0} fds, {th0} threads; peak {} fds, {} threads; \
         after 8 killed consumers and the idle timeout: {} fds, {} threads",
        peak.0,
        peak.1,
        fds(),
        threads()
    );
    assert!(
        back,
        "fds {} (start {fd0}), threads {} (start {th0}), {:?} did not return",
        fds(),
        threads(),
        producer.stats()
    );
}
