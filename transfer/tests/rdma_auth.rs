//! The RDMA QP acceptance check (`kvferry_transfer::auth`): an authenticated engine
//! answers RDMA `Connect` frames only on a handshake connection that proved the shared secret
//! (or presented a live grant token), so only such peers get a connected QP, the only thing
//! that makes its rkeys usable. A peer that learned the descriptor (here through a grant
//! token, as a sniffer might) but holds no secret gets no QP and writes nothing.
//!
//! Without a usable RDMA device every test prints why and passes (skipped), unless
//! `KVFERRY_REQUIRE_RDMA=1` (set in the soft-RoCE guest).

mod common;

use std::time::Duration;

use common::rdma::{engine_with, rdma_or_skip};
use common::Buf;
use kvferry_transfer::{GrantOps, GrantSpec, Secret, Token};

fn secret() -> Secret {
    Secret::from_bytes(b"rdma test shared secret, 32 byte").unwrap()
}

#[test]
#[cfg_attr(
    not(feature = "rdma"),
    ignore = "needs the `rdma` cargo feature: cargo test --features kvferry/rdma"
)]
fn rdma_connect_needs_the_secret_on_an_authenticated_engine() {
    if !rdma_or_skip("rdma_connect_needs_the_secret_on_an_authenticated_engine") {
        return;
    }
    let target = engine_with(|c| c.auth.secret = Some(secret()));
    let dst = Buf::zeroed(1 << 16);
    dst.register(&target);
    let src = Buf::new(1 << 16, 7);

    // A stranger without the secret: it gets the descriptor with a token, but no QP.
    let stranger = engine_with(|_| {});
    src.register(&stranger);
    let g = target
        .grant(GrantSpec {
            token: Token::random().unwrap(),
            ops: GrantOps::WRITE,
            ranges: vec![(dst.addr(), dst.len())],
            ttl: Duration::from_secs(60),
        })
        .unwrap();
    let seg = stranger
        .open_segment_with_token(&target.segment_name(), g.token())
        .expect("a live token gets the descriptor");
    let id = stranger
        .submit(
            &seg,
            &[kvferry_transfer::TransferRequest {
                op: kvferry_transfer::Op::Write,
                local_addr: src.addr(),
                remote_addr: dst.addr(),
                len: 4096,
            }],
        )
        .unwrap();
    let err = stranger.wait(id, Duration::from_secs(60)).unwrap_err();
    assert!(
        err.to_string().contains("authenticated") || err.to_string().contains("authoriz"),
        "{err}"
    );
    assert!(dst.bytes.iter().all(|&b| b == 0), "nothing written");

    // A peer with the secret connects and writes.
    let friend = engine_with(|c| c.auth.secret = Some(secret()));
    src.register(&friend);
    friend
        .transfer_sync_write(&target.segment_name(), src.addr(), dst.addr(), 4096)
        .unwrap();
    assert_eq!(&dst.bytes[..4096], &src.bytes[..4096]);
}
