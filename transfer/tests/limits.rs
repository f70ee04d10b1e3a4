//! Connection limits: hundreds of idle connections from one source address must not
//! lock other sources out of a segment's handshake and data listeners, and a connection that
//! sends no valid first frame is closed after a short pre-authentication timeout. On loopback
//! the idle connections come from 127.0.0.2 and the real peer from 127.0.0.1 (any 127/8
//! address is local on Linux).

mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::time::{Duration, Instant};

use common::{assert_same, engine_with, Buf};

/// A consumer whose handshake deadline is long, so only the first-frame deadline can close a
/// silent handshake connection.
fn consumer() -> std::sync::Arc<kvferry_transfer::TransferEngine> {
    engine_with(|c| c.handshake_timeout = Duration::from_secs(60))
}

/// A TCP connection to `to` whose source address is `from` (port any).
fn connect_from(from: [u8; 4], to: SocketAddr) -> std::io::Result<TcpStream> {
    // SAFETY: plain socket/bind/connect on a fresh fd that the TcpStream then owns.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = TcpStream::from_raw_fd(fd);
        let mut a: libc::sockaddr_in = std::mem::zeroed();
        a.sin_family = libc::AF_INET as libc::sa_family_t;
        a.sin_addr.s_addr = u32::from_ne_bytes(from);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if libc::bind(fd, &a as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let SocketAddr::V4(t) = to else {
            panic!("IPv4 only")
        };
        a.sin_port = t.port().to_be();
        a.sin_addr.s_addr = u32::from_ne_bytes(t.ip().octets());
        if libc::connect(fd, &a as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

fn data_port(e: &kvferry_transfer::TransferEngine) -> u16 {
    e.local_descriptor().transport.details["data_port"]
        .as_u64()
        .unwrap() as u16
}

#[test]
fn idle_connections_from_one_source_do_not_lock_out_another() {
    let consumer = consumer();
    let producer = engine_with(|_| {});
    let dst = Buf::zeroed(1 << 20);
    let src = Buf::new(1 << 20, 5);
    dst.register(&consumer);
    src.register(&producer);
    let hs: SocketAddr = consumer.segment_name().parse().unwrap();
    let data = SocketAddr::new(hs.ip(), data_port(&consumer));
    let mut idle = Vec::new();
    for to in [hs, data] {
        for _ in 0..300 {
            idle.push(connect_from([127, 0, 0, 2], to).expect("idle connection"));
        }
    }
    // the real producer, from 127.0.0.1: descriptor handshake and data connections
    producer
        .transfer_sync_write(&consumer.segment_name(), src.addr(), dst.addr(), src.len())
        .expect("a real transfer from another source is served");
    assert_same(&dst.bytes, &src.bytes, "payload landed");
    drop(idle);
}

#[test]
fn a_connection_without_a_first_frame_is_closed_soon() {
    let consumer = consumer();
    let hs: SocketAddr = consumer.segment_name().parse().unwrap();
    let data = SocketAddr::new(hs.ip(), data_port(&consumer));
    for to in [hs, data] {
        let mut s = connect_from([127, 0, 0, 3], to).unwrap();
        // the old waits were the handshake deadline (60 s here) and 120 s (data idle): a closed
        // connection within 20 s means the data listener has a first-frame deadline
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let t = Instant::now();
        let r = s.read(&mut [0u8; 64]);
        assert!(
            matches!(r, Ok(0))
                || matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "{to}: the silent connection is closed by the listener ({r:?} after {:?})",
            t.elapsed()
        );
    }
}

/// A pooled data connection is opened only when it has a job: one never used cannot sit idle
/// past the target's first-frame deadline and then fail the slice it gets.
#[test]
fn data_connections_open_only_with_work_and_outlive_the_first_frame_deadline() {
    let consumer = engine_with(|c| c.tcp.first_frame_timeout = Duration::from_millis(300));
    let producer = engine_with(|c| c.tcp.coalesce_bytes = 0); // one frame per slice
    let dst = Buf::zeroed(1 << 20);
    let src = Buf::new(1 << 20, 9);
    dst.register(&consumer);
    src.register(&producer);
    let name = consumer.segment_name();
    producer
        .transfer_sync_write(&name, src.addr(), dst.addr(), 4096)
        .unwrap();
    assert_eq!(producer.stats().connections, 1, "one job, one connection");
    assert_eq!(consumer.stats().served_connections, 1);
    std::thread::sleep(Duration::from_millis(800)); // past the consumer's first-frame deadline
    let reqs: Vec<(u64, u64, u64)> = (0..8)
        .map(|i| (src.addr() + i * 65536, dst.addr() + i * 65536, 65536))
        .collect();
    producer.batch_transfer_sync_write(&name, &reqs).unwrap();
    assert_eq!(
        consumer.stats().served_connections,
        producer.config().tcp.connections_per_peer,
        "every pooled connection now carries work"
    );
    assert_same(
        &dst.bytes[..8 * 65536],
        &src.bytes[..8 * 65536],
        "payload landed",
    );
}
