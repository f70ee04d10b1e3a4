//! The authenticated data path (`kvferry_transfer::auth`), attacked with raw sockets
//! on loopback: descriptors only for the secret or a live grant token, TCP data frames only
//! with a token whose grant allows the op and covers the ranges, for the grant's lifetime.
//! The open mode keeps today's behaviour (anyone may read and write): its test shows what an
//! attacker could do on main.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{engine_with, Buf};
use kvferry_transfer::auth::{decode_hello_reply, Hello, REFUSAL_LOG_BURST};
use kvferry_transfer::{
    GrantOps, GrantSpec, Op, Secret, Token, TransferEngine, TransferError, TransferRequest,
};

const SECRET: &[u8] = b"a shared secret of the test, 32b";

fn secret() -> Secret {
    Secret::from_bytes(SECRET).unwrap()
}

fn authed() -> std::sync::Arc<TransferEngine> {
    engine_with(|c| c.auth.secret = Some(secret()))
}

// ------------------------------------------------------------------ raw wire (spec copies)

fn frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u64).to_le_bytes().to_vec();
    f.push(ty);
    f.extend_from_slice(body);
    f
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// One handshake request on `s`: (reply type, body).
fn ask(s: &mut TcpStream, ty: u8, body: &[u8]) -> (u8, Vec<u8>) {
    s.write_all(&frame(ty, body)).unwrap();
    let mut h = [0u8; 9];
    s.read_exact(&mut h).unwrap();
    let mut b = vec![0u8; u64::from_le_bytes(h[..8].try_into().unwrap()) as usize];
    s.read_exact(&mut b).unwrap();
    (h[8], b)
}

const DESCRIPTOR: u8 = 1;
const HELLO: u8 = 2;
const AUTH: u8 = 3;
const ERROR: u8 = 0xFF;

fn data_request(op: u8, instance: u64, addr: u64, len: u64, token: [u8; 16]) -> Vec<u8> {
    let mut b = vec![0u8; 48];
    b[0..4].copy_from_slice(&0x5446_564bu32.to_le_bytes());
    b[4] = op;
    b[8..16].copy_from_slice(&instance.to_le_bytes());
    b[16..24].copy_from_slice(&addr.to_le_bytes());
    b[24..32].copy_from_slice(&len.to_le_bytes());
    b[32..48].copy_from_slice(&token);
    b
}

fn scatter(instance: u64, pieces: &[(u64, &[u8])], token: [u8; 16]) -> Vec<u8> {
    let total: u64 = pieces.iter().map(|p| p.1.len() as u64).sum();
    let mut f = data_request(3, instance, pieces.len() as u64, total, token);
    for (a, b) in pieces {
        f.extend_from_slice(&a.to_le_bytes());
        f.extend_from_slice(&(b.len() as u64).to_le_bytes());
    }
    for (_, b) in pieces {
        f.extend_from_slice(b);
    }
    f
}

/// (status, trailing bytes) of one data reply.
fn reply(s: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    let mut b = vec![0u8; u64::from_le_bytes(h[8..16].try_into().unwrap()) as usize];
    s.read_exact(&mut b).unwrap();
    (h[4], b)
}

const OK: u8 = 0;
const DENIED: u8 = 5;

fn data_addr(e: &TransferEngine) -> String {
    let d = e.local_descriptor();
    format!(
        "127.0.0.1:{}",
        d.transport.details["data_port"].as_u64().unwrap()
    )
}

fn grant(
    e: &TransferEngine,
    ranges: Vec<(u64, u64)>,
    ops: GrantOps,
) -> kvferry_transfer::GrantGuard {
    e.grant(GrantSpec {
        token: Token::random().unwrap(),
        ops,
        ranges,
        ttl: Duration::from_secs(60),
    })
    .unwrap()
}

// ------------------------------------------------------------------ tests

#[test]
fn open_mode_serves_anyone_as_mooncake_does() {
    // What any client can do to an engine without a secret (main's only mode).
    let e = engine_with(|_| {});
    assert!(!e.is_authenticated());
    let buf = Buf::new(4096, 1);
    buf.register(&e);
    let mut h = connect(&e.segment_name());
    let (t, body) = ask(&mut h, DESCRIPTOR, b"");
    assert_eq!(t, DESCRIPTOR, "{}", String::from_utf8_lossy(&body));
    let inst = e.local_descriptor().instance_id;
    let mut s = connect(&data_addr(&e));
    let mut w = data_request(1, inst, buf.addr() + 8, 4, [0; 16]);
    w.extend_from_slice(b"EVIL");
    s.write_all(&w).unwrap();
    assert_eq!(reply(&mut s).0, OK);
    assert_eq!(&buf.bytes[8..12], b"EVIL");
    s.write_all(&data_request(2, inst, buf.addr(), 16, [0; 16]))
        .unwrap();
    let (st, leaked) = reply(&mut s);
    assert_eq!((st, &leaked[..]), (OK, &buf.bytes[..16]));
}

#[test]
fn descriptors_need_the_secret_or_a_live_grant_token() {
    let e = authed();
    assert!(e.is_authenticated());
    let buf = Buf::new(4096, 2);
    buf.register(&e);
    // no credential: refused
    let mut h = connect(&e.segment_name());
    let (t, body) = ask(&mut h, DESCRIPTOR, b"");
    assert_eq!(t, ERROR);
    assert!(String::from_utf8_lossy(&body).contains("authenticated"));
    // a wrong secret's proof: refused, and the descriptor stays refused on that connection
    let name = e.segment_name();
    let hello = Hello::new(&name, "me:1").unwrap();
    let (t, reply) = ask(&mut h, HELLO, &hello.encode());
    assert_eq!(
        (t, reply.len()),
        (HELLO, 64),
        "nonce and the target's proof"
    );
    let (nonce_t, proof_t) = decode_hello_reply(&reply).unwrap();
    assert_eq!(Some(hello.target_proof(&secret(), &nonce_t)), proof_t);
    let wrong = Secret::from_bytes(b"not the shared secret at all....").unwrap();
    let mut body = vec![1u8];
    body.extend_from_slice(&hello.initiator_proof(&wrong, &nonce_t));
    assert_eq!(ask(&mut h, AUTH, &body).0, ERROR);
    assert_eq!(ask(&mut h, DESCRIPTOR, b"").0, ERROR);
    // a replayed proof (for an old nonce) is refused
    let mut h = connect(&name);
    let (_, reply1) = ask(&mut h, HELLO, &hello.encode());
    let (nonce1, _) = decode_hello_reply(&reply1).unwrap();
    let mut proof1 = vec![1u8];
    proof1.extend_from_slice(&hello.initiator_proof(&secret(), &nonce1));
    assert_eq!(ask(&mut h, AUTH, &proof1).0, AUTH);
    assert_eq!(ask(&mut h, DESCRIPTOR, b"").0, DESCRIPTOR);
    let mut h2 = connect(&name);
    ask(&mut h2, HELLO, &hello.encode());
    assert_eq!(
        ask(&mut h2, AUTH, &proof1).0,
        ERROR,
        "a proof is bound to the target's nonce"
    );
    // an unknown token: refused; a live grant's token: served; after the grant: refused
    let mut h = connect(&e.segment_name());
    let mut tb = vec![2u8];
    tb.extend_from_slice(&[9u8; 16]);
    assert_eq!(ask(&mut h, AUTH, &tb).0, ERROR);
    let g = grant(&e, vec![(buf.addr(), 64)], GrantOps::WRITE);
    let mut tb = vec![2u8];
    tb.extend_from_slice(g.token().as_bytes());
    let mut h = connect(&e.segment_name());
    assert_eq!(ask(&mut h, AUTH, &tb).0, AUTH);
    assert_eq!(ask(&mut h, DESCRIPTOR, b"").0, DESCRIPTOR);
    drop(g);
    let mut h = connect(&e.segment_name());
    assert_eq!(ask(&mut h, AUTH, &tb).0, ERROR);
    // the engine API: a peer without the secret cannot open it; with the secret or a token it can
    let stranger = engine_with(|_| {});
    let err = stranger.open_segment(&e.segment_name()).unwrap_err();
    assert!(matches!(err, TransferError::Handshake { .. }), "{err}");
    let friend = authed();
    friend.open_segment(&e.segment_name()).unwrap();
    let g = grant(&e, vec![(buf.addr(), 64)], GrantOps::WRITE);
    stranger
        .open_segment_with_token(&e.segment_name(), g.token())
        .unwrap();
}

#[test]
fn raw_data_frames_need_a_grant_for_their_op_and_ranges_and_its_lifetime() {
    let e = authed();
    let buf = Buf::new(8192, 3);
    buf.register(&e);
    let before = buf.bytes.clone();
    let inst = e.local_descriptor().instance_id;
    let (a, n) = (buf.addr(), buf.len());
    let mut s = connect(&data_addr(&e));
    let write = |s: &mut TcpStream, addr: u64, bytes: &[u8], token: [u8; 16]| {
        let mut f = data_request(1, inst, addr, bytes.len() as u64, token);
        f.extend_from_slice(bytes);
        s.write_all(&f).unwrap();
        reply(s).0
    };
    // no token, a made-up token: refused, nothing written, the connection stays usable
    assert_eq!(write(&mut s, a, b"EVIL", [0; 16]), DENIED);
    assert_eq!(write(&mut s, a, b"EVIL", [7; 16]), DENIED);
    s.write_all(&data_request(2, inst, a, 64, [0; 16])).unwrap();
    let (st, leaked) = reply(&mut s);
    assert_eq!(
        (st, leaked.is_empty()),
        (DENIED, false),
        "an error text, no data"
    );
    assert!(!leaked.windows(16).any(|w| w == &before[..16]));
    assert_eq!(buf.bytes, before);
    // a WRITE grant for [a+1024, +1024)
    let g = grant(&e, vec![(a + 1024, 1024)], GrantOps::WRITE);
    let t = g.token().0;
    assert_eq!(write(&mut s, a + 1024, b"GOOD", t), OK);
    assert_eq!(&buf.bytes[1024..1028], b"GOOD");
    assert_eq!(
        write(&mut s, a + 2046, b"EVIL", t),
        DENIED,
        "straddles the end"
    );
    assert_eq!(write(&mut s, a, b"EVIL", t), DENIED, "outside");
    s.write_all(&data_request(2, inst, a + 1024, 16, t))
        .unwrap();
    assert_eq!(reply(&mut s).0, DENIED, "READ is off unless granted");
    // scattered WRITE: any piece outside the grant refuses the whole frame
    s.write_all(&scatter(
        inst,
        &[(a + 1100, b"SCAT"), (a + n - 8, b"EVIL")],
        t,
    ))
    .unwrap();
    assert_eq!(reply(&mut s).0, DENIED);
    assert_eq!(&buf.bytes[1100..1104], &before[1100..1104]);
    s.write_all(&scatter(
        inst,
        &[(a + 1100, b"SCAT"), (a + 1200, b"TER!")],
        t,
    ))
    .unwrap();
    assert_eq!(reply(&mut s).0, OK);
    assert_eq!(&buf.bytes[1200..1204], b"TER!");
    // a READ grant allows READ of its ranges only
    let r = grant(
        &e,
        vec![(a + 4096, 64)],
        GrantOps {
            write: false,
            read: true,
        },
    );
    s.write_all(&data_request(2, inst, a + 4096, 64, r.token().0))
        .unwrap();
    let (st, data) = reply(&mut s);
    assert_eq!((st, &data[..]), (OK, &buf.bytes[4096..4160]));
    assert_eq!(write(&mut s, a + 4096, b"EVIL", r.token().0), DENIED);
    // the grant ends with its guard: a write after the load ended goes nowhere
    drop(g);
    assert_eq!(write(&mut s, a + 1024, b"LATE", t), DENIED);
    assert_eq!(&buf.bytes[1024..1028], b"GOOD");
    // ...and with its ttl
    let short = e
        .grant(GrantSpec {
            token: Token::random().unwrap(),
            ops: GrantOps::WRITE,
            ranges: vec![(a, n)],
            ttl: Duration::from_millis(1),
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(write(&mut s, a, b"LATE", short.token().0), DENIED);
    assert_eq!(&buf.bytes[..4], &before[..4]);
}

#[test]
fn engines_move_bytes_with_a_token_and_are_refused_without() {
    let target = authed();
    let init = authed();
    let dst = Buf::zeroed(1 << 20);
    dst.register(&target);
    let src = Buf::new(1 << 20, 4);
    src.register(&init);
    let req = |off: u64, len: u64| TransferRequest {
        op: Op::Write,
        local_addr: src.addr() + off,
        remote_addr: dst.addr() + off,
        len,
    };
    // the secret opens the segment, but frames without a token are refused
    let seg = init.open_segment(&target.segment_name()).unwrap();
    let id = init.submit(&seg, &[req(0, 4096)]).unwrap();
    let err = init.wait(id, Duration::from_secs(10)).unwrap_err();
    assert!(err.to_string().contains("grant"), "{err}");
    assert!(dst.bytes[..4096].iter().all(|&b| b == 0));
    // a grant for the first 512 KiB: writes inside land (many slices, coalesced frames)
    let g = grant(&target, vec![(dst.addr(), 512 << 10)], GrantOps::WRITE);
    let seg = seg.with_token(g.token());
    let id = init.submit(&seg, &[req(0, 512 << 10)]).unwrap();
    init.wait(id, Duration::from_secs(10)).unwrap();
    assert_eq!(&dst.bytes[..512 << 10], &src.bytes[..512 << 10]);
    // past the grant: refused, nothing beyond it written
    let id = init.submit(&seg, &[req(512 << 10, 4096)]).unwrap();
    let err = init.wait(id, Duration::from_secs(10)).unwrap_err();
    assert!(err.to_string().contains("not authorized"), "{err}");
    assert!(dst.bytes[512 << 10..].iter().all(|&b| b == 0));
    // READ with a WRITE grant: refused
    let mut back = TransferRequest {
        op: Op::Read,
        ..req(0, 4096)
    };
    back.local_addr = src.addr() + (600 << 10);
    let id = init.submit(&seg, &[back]).unwrap();
    assert!(init.wait(id, Duration::from_secs(10)).is_err());
    drop(g);
    assert_eq!(target.live_grants(), 0);
}

/// A raw handshake listener that records the frame types it receives and answers `Hello` with
/// a nonce and no proof (an open engine, or a stranger without the secret), every other frame
/// with an empty reply of its type.
fn recording_target() -> (String, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            loop {
                let mut h = [0u8; 9];
                if c.read_exact(&mut h).is_err() {
                    break;
                }
                let mut b = vec![0u8; u64::from_le_bytes(h[..8].try_into().unwrap()) as usize];
                if c.read_exact(&mut b).is_err() {
                    break;
                }
                s2.lock().unwrap().push(h[8]);
                let reply = if h[8] == HELLO {
                    vec![7u8; 32]
                } else {
                    Vec::new()
                };
                if c.write_all(&frame(h[8], &reply)).is_err() {
                    break;
                }
            }
        }
    });
    (addr, seen)
}

#[test]
fn a_secret_initiator_sends_nothing_to_a_target_that_does_not_prove_the_secret() {
    // An engine with the secret asked to open a stranger's segment (a fake consumer, or an
    // open-mode engine): the stranger gets the Hello and nothing else, no proof, no request.
    let (fake, seen) = recording_target();
    let init = authed();
    let err = init.open_segment(&fake).unwrap_err();
    assert!(
        err.to_string().contains("did not prove the shared secret"),
        "{err}"
    );
    assert_eq!(
        *seen.lock().unwrap(),
        vec![HELLO],
        "only the Hello reached it"
    );
    // an open engine is such a target: a secret engine never writes into it, even with a token
    let open = engine_with(|_| {});
    let err = init
        .open_segment_with_token(&open.segment_name(), Token::random().unwrap())
        .unwrap_err();
    assert!(
        err.to_string().contains("did not prove the shared secret"),
        "{err}"
    );
}

/// Relays one connection's handshake frames between a client and `target`, rewriting the
/// `Hello`'s target name to `rewrite` when given; returns the relay's address.
fn relay(target: String, rewrite: Option<String>) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let Ok((mut c, _)) = l.accept() else { return };
        let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
        let mut t = connect(&target);
        loop {
            let mut h = [0u8; 9];
            if c.read_exact(&mut h).is_err() {
                return;
            }
            let mut b = vec![0u8; u64::from_le_bytes(h[..8].try_into().unwrap()) as usize];
            if c.read_exact(&mut b).is_err() {
                return;
            }
            if h[8] == HELLO {
                if let (Some(name), Ok(mut hello)) = (&rewrite, Hello::decode(&b)) {
                    hello.target = name.clone();
                    b = hello.encode();
                }
            }
            let (ty, reply) = ask(&mut t, h[8], &b);
            if c.write_all(&frame(ty, &reply)).is_err() {
                return;
            }
        }
    });
    addr
}

#[test]
fn a_relaying_man_in_the_middle_gets_no_authenticated_connection() {
    // The initiator is made to dial a relay, which passes its handshake on to the real target
    // (to then use the authenticated connection itself). As it is, the target refuses a Hello
    // naming the relay; rewritten to name the target, the target's proof names the target and
    // the initiator, which dialed the relay, refuses it and sends no proof.
    let target = authed();
    let init = authed();
    let before = target.auth_refusals().refused;
    let err = init
        .open_segment(&relay(target.segment_name(), None))
        .unwrap_err();
    assert!(err.to_string().contains("names another segment"), "{err}");
    assert_eq!(target.auth_refusals().refused, before + 1);
    let err = init
        .open_segment(&relay(target.segment_name(), Some(target.segment_name())))
        .unwrap_err();
    assert!(
        err.to_string().contains("did not prove the shared secret"),
        "{err}"
    );
}

#[test]
fn reflected_and_replayed_proofs_are_refused() {
    let e = authed();
    let name = e.segment_name();
    // reflection: the target's own proof sent back as the initiator's
    let mut h = connect(&name);
    let hello = Hello::new(&name, "attacker:1").unwrap();
    let (_, reply) = ask(&mut h, HELLO, &hello.encode());
    let mut reflected = vec![1u8];
    reflected.extend_from_slice(&reply[32..]);
    assert_eq!(ask(&mut h, AUTH, &reflected).0, ERROR);
    // ...nor the target's proof over a second Hello with the nonces swapped
    let mut h = connect(&name);
    let (_, r1) = ask(&mut h, HELLO, &hello.encode());
    let (n_t, _) = decode_hello_reply(&r1).unwrap();
    let mut h2 = connect(&name);
    let swapped = Hello {
        nonce: n_t,
        ..hello.clone()
    };
    let (_, r2) = ask(&mut h2, HELLO, &swapped.encode());
    let mut forged = vec![1u8];
    forged.extend_from_slice(&r2[32..]);
    assert_eq!(ask(&mut h, AUTH, &forged).0, ERROR);
    assert_eq!(ask(&mut h, DESCRIPTOR, b"").0, ERROR);
}

#[test]
fn refused_authentications_are_counted_and_their_warnings_rate_limited() {
    let e = authed();
    let name = e.segment_name();
    let tries = 3 * REFUSAL_LOG_BURST as u64;
    for _ in 0..tries {
        let mut h = connect(&name);
        let hello = Hello::new(&name, "x:1").unwrap();
        ask(&mut h, HELLO, &hello.encode());
        assert_eq!(ask(&mut h, AUTH, &[1u8; 33]).0, ERROR);
    }
    let r = e.auth_refusals();
    assert_eq!(r.refused, tries);
    assert_eq!(
        r.logged, REFUSAL_LOG_BURST as u64,
        "the rest are counted, not logged"
    );
}
