//! Stale descriptors: a consumer (child process) restarted under the same segment
//! name and the same region addresses must be loadable again. The producer's cached descriptor
//! still names the old instance (and data port); the engine fetches the descriptor again once
//! before failing a slice.

mod common;

use std::net::TcpListener;

use common::child::{self, Spec};
use std::time::Duration;

use common::child::eventually;
use common::{assert_same, engine_with, Buf};

const LEN: u64 = 1 << 20;
/// A fixed address for the consumer's region in every child (free in a fresh process: far
/// below the mmap area, far above the binary and heap).
const FIXED: u64 = 0x6b00_0000_0000;

#[test]
#[ignore = "child process mode of the restart tests"]
fn child_consumer() {
    child::serve_if_child();
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Writes a fresh pattern to the consumer and reads it back.
fn load(
    producer: &kvferry_transfer::TransferEngine,
    src: &mut Buf,
    dst: &Buf,
    c: &child::Child,
    seed: u64,
) -> kvferry_transfer::Result<()> {
    src.fill(seed);
    producer.transfer_sync_write(&c.segment, src.addr(), c.addr, LEN)?;
    producer.transfer_sync_read(&c.segment, dst.addr(), c.addr, LEN)?;
    assert_same(&dst.bytes, &src.bytes, "read back from the consumer");
    Ok(())
}

/// `idle_first`: the producer's data connections idle out before each load after a restart,
/// so the load opens a new connection with the cached (old) instance id.
fn restart_and_load(data_port: u16, addr: u64, idle_first: bool) {
    let producer = engine_with(|c| c.tcp.idle_timeout = Duration::from_millis(200));
    restart_and_load_with(&producer, data_port, addr, idle_first, false);
}

fn restart_and_load_with(
    producer: &kvferry_transfer::TransferEngine,
    data_port: u16,
    addr: u64,
    idle_first: bool,
    rdma: bool,
) {
    let mut src = Buf::new(LEN as usize, 1);
    let dst = Buf::zeroed(LEN as usize);
    src.register(producer);
    dst.register(producer);
    let spec = Spec {
        port: free_port(),
        data_port,
        addr,
        len: LEN,
        rdma,
    };
    let mut c = child::spawn("child_consumer", spec);
    let (name, at) = (c.segment.clone(), c.addr);
    load(producer, &mut src, &dst, &c, 10).expect("load before the restart");
    for round in 0..3u64 {
        c.kill();
        c = child::spawn("child_consumer", spec);
        assert_eq!(c.segment, name, "same segment name");
        assert_eq!(c.addr, at, "same region address");
        if idle_first {
            assert!(
                eventually(Duration::from_secs(20), || producer.stats().connections
                    == 0),
                "the producer's data connections idle out"
            );
        }
        load(producer, &mut src, &dst, &c, 100 + round)
            .unwrap_or_else(|e| panic!("round {round}: load after the consumer restarted: {e}"));
    }
}

#[test]
fn restarted_consumer_with_same_name_and_addresses_is_loadable() {
    restart_and_load(0, FIXED, false);
}

/// The restarted consumer takes the same data port too, and the producer's connections have
/// idled out: its new connection carries the old instance id, and the new instance answers
/// "stale instance id".
#[test]
fn restarted_consumer_on_the_same_data_port_is_loadable() {
    restart_and_load(free_port(), FIXED + (64 << 20), true);
}

/// Over RDMA: the cached descriptor names the old instance's rkeys; the old endpoint's QPs fail
/// (retry exceeded), a fresh endpoint reaches the new instance but its WRITEs hit dead rkeys
/// (remote access error), and the engine fetches the descriptor again and retries once.
/// Skipped without an RDMA device (run in the soft-RoCE guest).
#[test]
#[cfg_attr(
    not(feature = "rdma"),
    ignore = "needs the `rdma` cargo feature: cargo test --features kvferry/rdma"
)]
fn rdma_restarted_consumer_with_same_name_and_addresses_is_loadable() {
    if !common::rdma::rdma_or_skip(
        "rdma_restarted_consumer_with_same_name_and_addresses_is_loadable",
    ) {
        return;
    }
    let producer = common::rdma::engine();
    restart_and_load_with(&producer, 0, FIXED + (128 << 20), false, true);
}
