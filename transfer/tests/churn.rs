//! No leaks under churn: consumers (child processes) are started, loaded and killed
//! many times; the producer's open file descriptors and threads return to their starting count
//! once its idle timeouts pass. The only test of this binary (besides the child mode), so no
//! other test's sockets or threads move the counts.

mod common;

use std::time::Duration;

use common::child;
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
    child::killed_consumers_leave_nothing_behind(
        &producer,
        src.addr(),
        LEN,
        "child_consumer",
        false,
        8,
        Duration::from_secs(30),
    );
}
