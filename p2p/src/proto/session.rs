//! The control channel's session (docs/design.md §8.1), without sockets: the first exchange
//! on every consumer → producer connection, and the proofs that bind each request to it.
//!
//! ```text
//! consumer                                              producer
//!   hello   { nonce_c, producer: endpoint dialed, consumer: its name }  ──▶
//!   ◀──  welcome { nonce_p, proof_p }          (proof_p only with a secret)
//!   transfer_request { …, key_proof, proof_c, token }                    ──▶
//! ```
//!
//! - `proof_p = HMAC(secret, "kvferry/control/v2/producer" ‖ T)` and
//!   `proof_c = HMAC(secret, "kvferry/control/v2/request" ‖ T ‖ request)`, where the
//!   transcript `T = nonce_c ‖ nonce_p ‖ producer ‖ consumer` and `request` is the request's
//!   msgpack encoding with `proof` empty: one label per direction (no reflection), both nonces
//!   (no replay into another session), both names (a producer refuses a `hello` naming another
//!   endpoint, so a relay that passes the exchange on from elsewhere fails).
//! - A consumer with the secret sends nothing but its `hello` until `proof_p` checks; a
//!   producer with the secret acts on no request whose `proof_c` does not.
//! - The load key never travels: the request carries
//!   `key_proof = HMAC(load key, "kvferry/control/v2/load-key" ‖ T ‖ request_id ‖ load_id)`,
//!   in either mode, so a captured request is useless in any other session, and a fake
//!   producer learns nothing it can load with.
//!
//! Every HMAC part is length-prefixed (`kvferry_transfer::auth::hmac_sha256`); comparisons are
//! constant-time.

use kvferry_transfer::auth::{ct_eq, hmac_sha256};
use kvferry_transfer::Secret;

use super::msg::{encode, LoadRequest};
/// The sizes a `hello` carries (defined with the message, `super::msg`).
pub use super::msg::{MAX_NAME_BYTES, NONCE_BYTES};

const PRODUCER_LABEL: &str = "kvferry/control/v2/producer";
const REQUEST_LABEL: &str = "kvferry/control/v2/request";
const KEY_LABEL: &[u8] = b"kvferry/control/v2/load-key";
const ID_LABEL: &[u8] = b"kvferry/control/v2/session-id";

/// One control-channel session: both nonces and both names, as each side agreed them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The consumer's nonce (from its `hello`).
    pub consumer_nonce: [u8; NONCE_BYTES],
    /// The producer's nonce (from its `welcome`).
    pub producer_nonce: [u8; NONCE_BYTES],
    /// The producer endpoint the consumer dialed.
    pub producer: String,
    /// The consumer's name.
    pub consumer: String,
}

impl Session {
    fn transcript(&self) -> [&[u8]; 4] {
        [
            &self.consumer_nonce,
            &self.producer_nonce,
            self.producer.as_bytes(),
            self.consumer.as_bytes(),
        ]
    }

    /// The producer's proof of the secret over this session (the `welcome`'s `proof`).
    pub fn producer_proof(&self, secret: &Secret) -> [u8; 32] {
        secret.prove(PRODUCER_LABEL, &self.transcript())
    }

    /// Whether `proof` is the producer's proof of `secret` over this session.
    pub fn check_producer_proof(&self, secret: &Secret, proof: Option<&[u8]>) -> bool {
        proof.is_some_and(|p| ct_eq(&self.producer_proof(secret), p))
    }

    /// The consumer's proof of the secret over this session and the whole of `request`
    /// (encoded with `proof` empty).
    pub fn request_proof(&self, secret: &Secret, request: &LoadRequest) -> [u8; 32] {
        let mut r = request.clone();
        r.proof = None;
        let bytes = encode(&r);
        let t = self.transcript();
        secret.prove(REQUEST_LABEL, &[t[0], t[1], t[2], t[3], &bytes])
    }

    /// Whether `request.proof` is the consumer's proof of `secret` over this session and the
    /// request.
    pub fn check_request_proof(&self, secret: &Secret, request: &LoadRequest) -> bool {
        request
            .proof
            .as_deref()
            .is_some_and(|p| ct_eq(&self.request_proof(secret, request), p))
    }

    /// Proof of a lease's load key for one load of this session (the request's `key_proof`).
    pub fn key_proof(&self, load_key: &str, request_id: &str, load_id: u64) -> [u8; 32] {
        let t = self.transcript();
        hmac_sha256(
            load_key.as_bytes(),
            &[
                KEY_LABEL,
                t[0],
                t[1],
                t[2],
                t[3],
                request_id.as_bytes(),
                &load_id.to_le_bytes(),
            ],
        )
    }

    /// Whether `request.key_proof` proves `load_key` in this session (constant-time).
    pub fn check_key_proof(&self, load_key: &str, request: &LoadRequest) -> bool {
        request.key_proof.as_deref().is_some_and(|p| {
            ct_eq(
                &self.key_proof(load_key, &request.request_id, request.load_id),
                p,
            )
        })
    }

    /// A public digest of the session (not secret): bound into the FINISH proof, so that a
    /// FINISH answers only this session's load.
    pub fn id(&self) -> [u8; 32] {
        let t = self.transcript();
        hmac_sha256(ID_LABEL, &t)
    }
}

/// Whether `dialed` (a `hello`'s `producer`) names the producer bound at `endpoint` (the
/// socket's resolved endpoint, `tcp://ip:port`) after being asked to bind `bind` (the
/// configured text, which may name the host otherwise): the same text; or a TCP endpoint on
/// the same port whose host is the bound one, the configured one, `localhost` for a loopback
/// address, or any host when bound to a wildcard address (`0.0.0.0`, `::`, `*`).
pub fn names_producer(dialed: &str, endpoint: &str, bind: &str) -> bool {
    if dialed == endpoint || dialed == bind {
        return true;
    }
    let split = |e: &str| -> Option<(String, u16)> {
        let rest = e.strip_prefix("tcp://")?;
        let (host, port) = rest.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        Some((host.to_ascii_lowercase(), port.parse().ok()?))
    };
    let (Some((dh, dp)), Some((eh, ep))) = (split(dialed), split(endpoint)) else {
        return false;
    };
    if dp != ep {
        return false;
    }
    let bind_host = split(bind).map(|(h, _)| h);
    let loopback = eh
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback());
    let wildcard = ["0.0.0.0", "::", "*"].contains(&eh.as_str())
        || bind_host
            .as_deref()
            .is_some_and(|h| ["0.0.0.0", "::", "*"].contains(&h));
    dh == eh
        || bind_host.as_deref() == Some(dh.as_str())
        || (dh == "localhost" && loopback)
        || wildcard
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn producer_names() {
        let ep = "tcp://127.0.0.1:5000";
        assert!(names_producer(ep, ep, "tcp://127.0.0.1:0"));
        assert!(names_producer(
            "tcp://localhost:5000",
            ep,
            "tcp://127.0.0.1:0"
        ));
        assert!(!names_producer(
            "tcp://127.0.0.1:5001",
            ep,
            "tcp://127.0.0.1:0"
        ));
        assert!(!names_producer(
            "tcp://10.0.0.2:5000",
            ep,
            "tcp://127.0.0.1:0"
        ));
        assert!(names_producer(
            "tcp://prefill-0:5000",
            "tcp://10.0.0.1:5000",
            "tcp://prefill-0:5000"
        ));
        assert!(names_producer(
            "tcp://10.0.0.1:5000",
            "tcp://0.0.0.0:5000",
            "tcp://0.0.0.0:5000"
        ));
        assert!(!names_producer("garbage", ep, "tcp://127.0.0.1:0"));
    }
}
