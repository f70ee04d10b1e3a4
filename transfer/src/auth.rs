//! Authorization of the handshake and data path (docs/design.md §8.1).
//!
//! Two modes, chosen by `EngineConfig::auth`:
//! - **Open** (no secret; the default, as in Mooncake): any peer that reaches the listeners may
//!   fetch the descriptor, connect QPs and READ/WRITE every registered region. Trusted
//!   networks only; the engine's info line says so.
//! - **Authenticated** (a shared secret configured): both sides of a handshake prove the
//!   secret ([`Hello`]: the target proves it over both nonces and both names before the
//!   initiator proves it in `Auth`, each with its own label; the secret never travels). The
//!   listener hands out the descriptor and accepts RDMA `Connect` frames only on a connection
//!   that proved the secret or presented a live grant token, and an initiator with the secret
//!   sends nothing after its `Hello` to a target that did not prove it. Every TCP data frame must carry a grant token,
//!   and its op and byte ranges must lie inside what the target granted to that token, before
//!   the grant expires or is dropped. READ is refused unless the grant allows it.
//!
//! Grants are made by the target (`TransferEngine::grant`): a random [`Token`], the ops, the
//! byte ranges and a lifetime; the returned [`GrantGuard`] revokes the grant when dropped. The
//! initiator attaches the token to its requests (`SegmentHandle::with_token`). The per-frame
//! check is one hash lookup and a binary search over the grant's sorted ranges.
//!
//! What this does not do: the token travels in clear inside data frames and the control
//! channel, so an on-path attacker who can read the traffic can reuse it for the grant's
//! ranges until the grant ends (use a private network or an encrypted tunnel against that).
//! Over RDMA a connected QP can use any rkey of the target's regions: the QP acceptance check
//! (secret proof or token at `Connect`) is what protects them; per-load memory windows are
//! not implemented.

use crate::sync::RwLockExt;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{ArgumentError, AuthError, Result, TransferError};
use crate::types::Op;

mod hello_wire;
mod refusals;
mod secret;

pub use hello_wire::{HelloError, MAX_NAME_BYTES, NONCE_BYTES};
use refusals::RefusalLog;
pub use refusals::{AuthRefusals, LogLimit, REFUSAL_LOG_BURST, REFUSAL_LOG_WINDOW};
pub use secret::{
    ct_eq, hmac_sha256, random_bytes, Credential, Secret, Token, MAX_SECRET_BYTES, MIN_SECRET_BYTES,
};

/// Most ranges one grant may hold (a load's block byte ranges, merged where adjacent).
pub const MAX_GRANT_RANGES: usize = 1 << 20;

/// Which ops a grant allows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantOps {
    /// Peers may WRITE into the ranges.
    pub write: bool,
    /// Peers may READ the ranges (off unless asked for).
    pub read: bool,
}

impl GrantOps {
    /// WRITE only (what a consumer grants a producer for one load).
    pub const WRITE: GrantOps = GrantOps {
        write: true,
        read: false,
    };
}

/// A target-side grant: `token` may do `ops` on `ranges` (`(addr, len)` in this engine's
/// address space, bytes) for `ttl` from now (or until its guard is dropped).
#[derive(Debug, Clone)]
pub struct GrantSpec {
    /// The token peers present; must not be in use by another live grant.
    pub token: Token,
    /// Allowed ops.
    pub ops: GrantOps,
    /// Byte ranges `(addr, len)`; may overlap or touch (they are merged); len > 0, no wrap.
    pub ranges: Vec<(u64, u64)>,
    /// Lifetime from the `grant` call.
    pub ttl: Duration,
}

struct Grant {
    ops: GrantOps,
    /// Sorted, merged, disjoint `[start, end)`.
    ranges: Vec<(u64, u64)>,
    expires: Instant,
}

impl Grant {
    fn covers(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let i = self.ranges.partition_point(|r| r.0 <= addr);
        i > 0 && self.ranges[i - 1].1 >= end
    }
}

/// Why a frame was refused (the text goes back to the initiator).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Denied {
    /// No token, an unknown one, a revoked or expired one.
    NoGrant,
    /// The grant does not allow this op.
    Op(Op),
    /// The range is outside the grant's ranges.
    Range(u64, u64),
}

impl fmt::Display for Denied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Denied::NoGrant => f.write_str("no live grant for this token (authenticated segment)"),
            Denied::Op(op) => write!(f, "the grant does not allow {op:?}"),
            Denied::Range(a, l) => write!(f, "range [{a:#x}, +{l}) is outside the grant"),
        }
    }
}

/// The end of the grant range `(addr, len)`. Errors: `BadGrantRange` for len 0 or a wrap.
fn range_end(addr: u64, len: u64) -> Result<u64> {
    addr.checked_add(len)
        .filter(|_| len > 0)
        .ok_or_else(|| ArgumentError::BadGrantRange { addr, len }.into())
}

/// `ranges` (`(addr, len)`) as sorted, merged, disjoint `[start, end)` in one pass when their
/// starts ascend (as a load's grant lists them: layer by layer, each part's blocks in order),
/// with no copy and no sort; `None` as soon as one start is below the one before (the caller
/// sorts then). Errors: `BadGrantRange` for a range of len 0 or one that wraps.
fn merge_ascending(ranges: &[(u64, u64)]) -> Result<Option<Vec<(u64, u64)>>> {
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(a, l) in ranges {
        let e = range_end(a, l)?;
        match merged.last_mut() {
            Some(m) if a < m.0 => return Ok(None),
            Some(m) if a <= m.1 => m.1 = m.1.max(e),
            _ => merged.push((a, e)),
        }
    }
    Ok(Some(merged))
}

/// The grants of one engine, shared by the engine (which makes them) and its transport
/// (which checks every frame).
#[derive(Default)]
pub(crate) struct GrantTable {
    map: RwLock<HashMap<Token, Arc<Grant>>>,
}

impl GrantTable {
    fn insert(&self, spec: GrantSpec) -> Result<()> {
        if spec.ranges.len() > MAX_GRANT_RANGES {
            return Err(ArgumentError::TooManyGrantRanges {
                ranges: spec.ranges.len(),
                limit: MAX_GRANT_RANGES,
            }
            .into());
        }
        let merged = match merge_ascending(&spec.ranges)? {
            Some(m) => m,
            None => {
                let mut r: Vec<(u64, u64)> = Vec::with_capacity(spec.ranges.len());
                for &(a, l) in &spec.ranges {
                    r.push((a, range_end(a, l)?));
                }
                // Stable sort: it merges the ascending runs callers usually pass (per layer,
                // per part) in about linear time, where an unstable sort would sort them anew.
                r.sort();
                let mut merged: Vec<(u64, u64)> = Vec::with_capacity(r.len());
                for (a, e) in r {
                    match merged.last_mut() {
                        Some(m) if a <= m.1 => m.1 = m.1.max(e),
                        _ => merged.push((a, e)),
                    }
                }
                merged
            }
        };
        let now = Instant::now();
        let g = Grant {
            ops: spec.ops,
            ranges: merged,
            expires: now
                .checked_add(spec.ttl)
                .unwrap_or(now + Duration::from_secs(1 << 30)),
        };
        let mut map = self.map.write_locked();
        map.retain(|_, g| g.expires > now); // expired grants go on the next grant
        if map.contains_key(&spec.token) {
            return Err(ArgumentError::GrantExists.into());
        }
        map.insert(spec.token, Arc::new(g));
        Ok(())
    }

    fn remove(&self, token: &Token) {
        self.map.write_locked().remove(token);
    }

    /// Whether `token` names a live grant (any ops).
    pub(crate) fn live(&self, token: &Token) -> bool {
        let map = self.map.read_locked();
        map.get(token).is_some_and(|g| g.expires > Instant::now())
    }

    /// The per-frame check: `token` may do `op` on `[addr, +len)` now.
    pub(crate) fn check(
        &self,
        token: &Token,
        op: Op,
        ranges: impl IntoIterator<Item = (u64, u64)>,
    ) -> std::result::Result<(), Denied> {
        let map = self.map.read_locked();
        let g = map.get(token).ok_or(Denied::NoGrant)?;
        if g.expires <= Instant::now() {
            return Err(Denied::NoGrant);
        }
        let allowed = match op {
            Op::Write => g.ops.write,
            Op::Read => g.ops.read,
        };
        if !allowed {
            return Err(Denied::Op(op));
        }
        for (a, l) in ranges {
            if !g.covers(a, l) {
                return Err(Denied::Range(a, l));
            }
        }
        Ok(())
    }

    /// Live grants (tests and diagnostics).
    pub(crate) fn len(&self) -> usize {
        let now = Instant::now();
        let map = self.map.read_locked();
        map.values().filter(|g| g.expires > now).count()
    }
}

/// The authorization state of one engine: the mode (secret or open), its name (what
/// `Hello`s must name), the grants, and the refusal counters.
pub(crate) struct AuthState {
    /// `Some` in authenticated mode.
    pub secret: Option<Secret>,
    /// This engine's segment name (`host:port`): the target name a `Hello` must carry, and
    /// the initiator name this engine binds into its own handshakes.
    pub name: String,
    /// Grants made by this engine (checked only in authenticated mode).
    pub grants: Arc<GrantTable>,
    /// Refused handshake authentications, and how many of them were logged.
    refusals: RefusalLog,
}

impl AuthState {
    pub(crate) fn new(secret: Option<Secret>, name: &str) -> Arc<AuthState> {
        Arc::new(AuthState {
            secret,
            name: name.to_string(),
            grants: Arc::new(GrantTable::default()),
            refusals: RefusalLog {
                refused: Default::default(),
                logged: Default::default(),
                limit: LogLimit::new(REFUSAL_LOG_BURST, REFUSAL_LOG_WINDOW),
            },
        })
    }

    /// Whether peers must authenticate.
    pub(crate) fn enforced(&self) -> bool {
        self.secret.is_some()
    }

    /// What this engine presents to peers: its secret, if any, else `token`.
    pub(crate) fn credential(&self, token: Option<&Token>) -> Option<Credential> {
        match (&self.secret, token) {
            (Some(s), _) => Some(Credential::Secret {
                secret: s.clone(),
                initiator: self.name.clone(),
            }),
            (None, Some(t)) => Some(Credential::Token(*t)),
            (None, None) => None,
        }
    }

    /// Counts a refused `Hello` or `Auth` from `peer` and logs it within the rate limit.
    pub(crate) fn refused(&self, peer: std::net::SocketAddr, why: &TransferError) {
        use std::sync::atomic::Ordering::Relaxed;
        self.refusals.refused.fetch_add(1, Relaxed);
        if let Some(held_back) = self.refusals.limit.allow(Instant::now()) {
            self.refusals.logged.fetch_add(1, Relaxed);
            if held_back > 0 {
                tracing::warn!(%peer, "handshake authentication refused: {why} ({held_back} more refusals not logged)");
            } else {
                tracing::warn!(%peer, "handshake authentication refused: {why}");
            }
        }
    }

    /// The refusal counters.
    pub(crate) fn refusals(&self) -> AuthRefusals {
        use std::sync::atomic::Ordering::Relaxed;
        AuthRefusals {
            refused: self.refusals.refused.load(Relaxed),
            logged: self.refusals.logged.load(Relaxed),
        }
    }

    /// One line for the engine's info log: the mode and what it protects.
    pub(crate) fn describe(&self) -> &'static str {
        if self.enforced() {
            "authenticated: descriptors and RDMA connects need the shared secret or a grant token; TCP data frames need a grant token for their ranges"
        } else {
            "unauthenticated: any peer that reaches the ports may read and write registered memory — trusted networks only"
        }
    }
}

/// A live grant; dropping it revokes the grant at once (frames in flight with its token are
/// refused from then on).
pub struct GrantGuard {
    table: Arc<GrantTable>,
    token: Token,
}

impl GrantGuard {
    /// The grant's token.
    pub fn token(&self) -> Token {
        self.token
    }
}

impl fmt::Debug for GrantGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GrantGuard({:?})", self.token)
    }
}

impl Drop for GrantGuard {
    fn drop(&mut self) {
        self.table.remove(&self.token);
    }
}

pub(crate) fn grant(table: &Arc<GrantTable>, spec: GrantSpec) -> Result<GrantGuard> {
    let token = spec.token;
    table.insert(spec)?;
    Ok(GrantGuard {
        table: table.clone(),
        token,
    })
}

/// Handshake `Auth` frame bodies: `1 ‖ proof[32]` (secret) or `2 ‖ token[16]`.
pub(crate) const AUTH_SECRET: u8 = 1;
pub(crate) const AUTH_TOKEN: u8 = 2;
/// HMAC label of the target's proof (the `Hello` reply): one label per direction, so that a
/// proof made by one side is never accepted as the other side's (no reflection).
pub const HANDSHAKE_TARGET_LABEL: &str = "kvferry/handshake/v2/target";
/// HMAC label of the initiator's proof (the `Auth` frame).
pub const HANDSHAKE_INITIATOR_LABEL: &str = "kvferry/handshake/v2/initiator";
/// A handshake `Hello` request: the initiator's fresh nonce and the two names the proofs of
/// both sides bind. Body: `nonce[32] ‖ u16 LE len ‖ target ‖ u16 LE len ‖ initiator` (names
/// UTF-8, at most [`MAX_NAME_BYTES`] each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The initiator's random nonce.
    pub nonce: [u8; NONCE_BYTES],
    /// The segment name the initiator dialed (`host:port`): the target refuses a `Hello` that
    /// names another segment, so a proof made for one target is useless at another.
    pub target: String,
    /// The initiator's own segment name (bound into both proofs; empty when it has none).
    pub initiator: String,
}

impl Hello {
    /// A fresh `Hello` to `target` from `initiator`. Errors as [`random_bytes`].
    pub fn new(target: &str, initiator: &str) -> Result<Hello> {
        Ok(Hello {
            nonce: random_bytes()?,
            target: target.to_string(),
            initiator: initiator.to_string(),
        })
    }

    /// The wire body. Names longer than [`MAX_NAME_BYTES`] are cut (the target then refuses
    /// the `Hello`, as it names another segment).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = self.nonce.to_vec();
        for name in [&self.target, &self.initiator] {
            let n = &name.as_bytes()[..name.len().min(MAX_NAME_BYTES)];
            b.extend_from_slice(&(n.len() as u16).to_le_bytes());
            b.extend_from_slice(n);
        }
        b
    }

    /// Decodes a `Hello` body; never panics, reads nothing past a bad length.
    pub fn decode(body: &[u8]) -> std::result::Result<Hello, HelloError> {
        let nonce: [u8; NONCE_BYTES] = body
            .get(..NONCE_BYTES)
            .and_then(|n| n.try_into().ok())
            .ok_or(HelloError::Truncated("nonce"))?;
        let mut rest = &body[NONCE_BYTES..];
        let mut name = |what: &'static str| -> std::result::Result<String, HelloError> {
            let len = rest
                .get(..2)
                .map(|l| u16::from_le_bytes([l[0], l[1]]) as usize)
                .ok_or(HelloError::Truncated(what))?;
            if len > MAX_NAME_BYTES {
                return Err(HelloError::NameTooLong(len));
            }
            let n = rest.get(2..2 + len).ok_or(HelloError::Truncated(what))?;
            rest = &rest[2 + len..];
            String::from_utf8(n.to_vec()).map_err(|_| HelloError::NotUtf8)
        };
        let target = name("target name")?;
        let initiator = name("initiator name")?;
        if !rest.is_empty() {
            return Err(HelloError::Trailing(rest.len()));
        }
        Ok(Hello {
            nonce,
            target,
            initiator,
        })
    }

    /// `HMAC-SHA256(secret, label ‖ initiator nonce ‖ target nonce ‖ target ‖ initiator)`:
    /// the proof of the side that `label` names, over this handshake's transcript.
    fn proof(&self, secret: &Secret, label: &str, target_nonce: &[u8; NONCE_BYTES]) -> [u8; 32] {
        secret.prove(
            label,
            &[
                &self.nonce,
                target_nonce,
                self.target.as_bytes(),
                self.initiator.as_bytes(),
            ],
        )
    }

    /// The target's proof (the `Hello` reply's last 32 bytes).
    pub fn target_proof(&self, secret: &Secret, target_nonce: &[u8; NONCE_BYTES]) -> [u8; 32] {
        self.proof(secret, HANDSHAKE_TARGET_LABEL, target_nonce)
    }

    /// The initiator's proof (the `Auth` frame's body after its kind byte).
    pub fn initiator_proof(&self, secret: &Secret, target_nonce: &[u8; NONCE_BYTES]) -> [u8; 32] {
        self.proof(secret, HANDSHAKE_INITIATOR_LABEL, target_nonce)
    }
}

/// Decodes a `Hello` reply: the target's nonce and, from an authenticated target, its proof.
pub fn decode_hello_reply(
    body: &[u8],
) -> std::result::Result<([u8; NONCE_BYTES], Option<[u8; 32]>), HelloError> {
    let nonce = |b: &[u8]| -> [u8; NONCE_BYTES] { b[..NONCE_BYTES].try_into().expect("32 bytes") };
    match body.len() {
        32 => Ok((nonce(body), None)),
        64 => Ok((
            nonce(body),
            Some(body[NONCE_BYTES..].try_into().expect("32 bytes")),
        )),
        n => Err(HelloError::ReplyLength(n)),
    }
}

/// Whether `dialed` (the name in a `Hello`) names this target: its segment name `own`, or the
/// address the connection arrived on (`local`, as `ip:port` or `localhost:port` on loopback).
/// Another name is refused: a proof bound to it would be valid at another segment.
pub(crate) fn names_me(dialed: &str, own: &str, local: Option<std::net::SocketAddr>) -> bool {
    if dialed == own {
        return true;
    }
    let Some(local) = local else { return false };
    if let Ok(a) = dialed.parse::<std::net::SocketAddr>() {
        return a == local;
    }
    match dialed.rsplit_once(':') {
        Some(("localhost", port)) => {
            local.ip().is_loopback() && port.parse::<u16>().ok() == Some(local.port())
        }
        _ => false,
    }
}

/// What a handshake connection holds between `Hello` and `Auth`.
#[derive(Debug, Clone)]
pub(crate) struct PendingHello {
    hello: Hello,
    target_nonce: [u8; NONCE_BYTES],
}

/// The target's answer to `Hello`: a fresh nonce and, when this engine has a secret, its proof
/// over the transcript (so that the initiator learns it talks to a holder of the secret before
/// it proves anything itself). Refuses a `Hello` that names another segment than this one
/// (authenticated mode) and a malformed body.
pub(crate) fn on_hello(
    state: &AuthState,
    body: &[u8],
    local: Option<std::net::SocketAddr>,
) -> Result<(PendingHello, Vec<u8>)> {
    let fail = |why: &'static str| TransferError::Auth(AuthError::Handshake(why));
    let hello = Hello::decode(body).map_err(|_| fail("malformed Hello"))?;
    let target_nonce = random_bytes::<NONCE_BYTES>()?;
    let mut reply = target_nonce.to_vec();
    if let Some(secret) = &state.secret {
        if !names_me(&hello.target, &state.name, local) {
            return Err(fail("the Hello names another segment than this one"));
        }
        reply.extend_from_slice(&hello.target_proof(secret, &target_nonce));
    }
    Ok((
        PendingHello {
            hello,
            target_nonce,
        },
        reply,
    ))
}

/// The initiator's side of `Hello`: checks the reply and returns the `Auth` body. With the
/// secret, the target must have proved it over this `Hello` (else `TargetUnproven`: nothing of
/// the initiator's goes to it); with a token, the token is presented as it is.
pub(crate) fn answer_hello(
    cred: &Credential,
    hello: &Hello,
    reply: &[u8],
) -> std::result::Result<Vec<u8>, crate::error::HandshakeError> {
    use crate::error::HandshakeError;
    let (target_nonce, proof) = decode_hello_reply(reply).map_err(HandshakeError::BadHello)?;
    match cred {
        Credential::Secret { secret: s, .. } => {
            let ok = proof.is_some_and(|p| ct_eq(&hello.target_proof(s, &target_nonce), &p));
            if !ok {
                return Err(HandshakeError::TargetUnproven);
            }
            let mut b = vec![AUTH_SECRET];
            b.extend_from_slice(&hello.initiator_proof(s, &target_nonce));
            Ok(b)
        }
        Credential::Token(t) => {
            let mut b = vec![AUTH_TOKEN];
            b.extend_from_slice(&t.0);
            Ok(b)
        }
    }
}

/// Checks an `Auth` frame body against the connection's pending `Hello` (taken: one try per
/// `Hello`).
pub(crate) fn check_auth_body(
    state: &AuthState,
    body: &[u8],
    pending: Option<PendingHello>,
) -> Result<()> {
    let fail = |why: &'static str| TransferError::Auth(AuthError::Handshake(why));
    match (body.first().copied(), &state.secret) {
        (Some(AUTH_SECRET), Some(secret)) if body.len() == 33 => {
            let p = pending.ok_or_else(|| fail("send Hello first"))?;
            let want = p.hello.initiator_proof(secret, &p.target_nonce);
            if ct_eq(&want, &body[1..]) {
                Ok(())
            } else {
                Err(fail("the secret proof does not match"))
            }
        }
        (Some(AUTH_TOKEN), _) if body.len() == 17 => {
            let t = Token(body[1..].try_into().expect("16 bytes"));
            if state.grants.live(&t) {
                Ok(())
            } else {
                Err(fail("the token has no live grant"))
            }
        }
        _ => Err(fail("malformed Auth frame")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_with(
        ranges: Vec<(u64, u64)>,
        ops: GrantOps,
        ttl: Duration,
    ) -> (Arc<GrantTable>, GrantGuard) {
        let t = Arc::new(GrantTable::default());
        let g = grant(
            &t,
            GrantSpec {
                token: Token([7; 16]),
                ops,
                ranges,
                ttl,
            },
        )
        .unwrap();
        (t, g)
    }

    #[test]
    fn ascending_and_shuffled_ranges_make_the_same_grant() {
        // Touching, overlapping, nested and apart, ascending by start.
        let asc = vec![
            (100, 50),
            (150, 10),
            (155, 20),
            (160, 2),
            (300, 10),
            (400, 1),
        ];
        let want = vec![(100, 175), (300, 310), (400, 401)];
        assert_eq!(merge_ascending(&asc).unwrap(), Some(want.clone()));
        let mut shuffled = asc.clone();
        shuffled.swap(0, 4);
        // A start below the one before: left to the sorting path, which merges alike.
        assert_eq!(merge_ascending(&shuffled).unwrap(), None);
        let tok = Token([7; 16]);
        for ranges in [asc, shuffled] {
            let (t, _g) = table_with(ranges, GrantOps::WRITE, Duration::from_secs(60));
            let g = t.map.read_locked().get(&tok).cloned().unwrap();
            assert_eq!(g.ranges, want);
        }
        // Bad ranges are refused on either path.
        for bad in [
            vec![(100, 0)],
            vec![(5, 1), (u64::MAX, 2)],
            vec![(9, 1), (5, 0)],
        ] {
            assert!(
                GrantTable::default()
                    .insert(GrantSpec {
                        token: tok,
                        ops: GrantOps::WRITE,
                        ranges: bad.clone(),
                        ttl: Duration::from_secs(1),
                    })
                    .is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn grants_check_op_ranges_and_lifetime() {
        let tok = Token([7; 16]);
        let (t, g) = table_with(
            vec![(100, 50), (150, 10), (300, 10)],
            GrantOps::WRITE,
            Duration::from_secs(60),
        );
        assert_eq!(t.check(&tok, Op::Write, [(100, 60)]), Ok(())); // merged 100..160
        assert_eq!(t.check(&tok, Op::Write, [(305, 5)]), Ok(()));
        assert_eq!(
            t.check(&tok, Op::Write, [(99, 2)]),
            Err(Denied::Range(99, 2))
        );
        assert_eq!(
            t.check(&tok, Op::Write, [(155, 10)]),
            Err(Denied::Range(155, 10))
        );
        assert_eq!(
            t.check(&tok, Op::Write, [(u64::MAX, 2)]),
            Err(Denied::Range(u64::MAX, 2))
        );
        assert_eq!(
            t.check(&tok, Op::Read, [(100, 1)]),
            Err(Denied::Op(Op::Read))
        );
        assert_eq!(
            t.check(&Token([8; 16]), Op::Write, [(100, 1)]),
            Err(Denied::NoGrant)
        );
        assert!(t.live(&tok));
        drop(g);
        assert_eq!(t.check(&tok, Op::Write, [(100, 1)]), Err(Denied::NoGrant));
        assert!(!t.live(&tok));
        let (t, _g) = table_with(vec![(0, 10)], GrantOps::WRITE, Duration::ZERO);
        assert_eq!(t.check(&tok, Op::Write, [(0, 1)]), Err(Denied::NoGrant));
    }

    #[test]
    fn hello_decoding_is_total_and_bounded() {
        assert_eq!(Hello::decode(&[0; 31]), Err(HelloError::Truncated("nonce")));
        assert_eq!(
            Hello::decode(&[0; 33]),
            Err(HelloError::Truncated("target name"))
        );
        let mut b = vec![0u8; 32];
        b.extend_from_slice(&(MAX_NAME_BYTES as u16 + 1).to_le_bytes());
        assert_eq!(
            Hello::decode(&b),
            Err(HelloError::NameTooLong(MAX_NAME_BYTES + 1))
        );
        let mut b = Hello::new("a:1", "b:2").unwrap().encode();
        b.push(0);
        assert_eq!(Hello::decode(&b), Err(HelloError::Trailing(1)));
        assert!(decode_hello_reply(&[0; 33]).is_err());
        let limit = LogLimit::new(2, Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(limit.allow(t0), Some(0));
        assert_eq!(limit.allow(t0), Some(0));
        assert_eq!(limit.allow(t0), None);
        assert_eq!(limit.allow(t0 + Duration::from_secs(1)), None);
        assert_eq!(limit.allow(t0 + Duration::from_secs(10)), Some(2));
    }

    #[test]
    fn tokens_round_trip_and_secrets_are_checked() {
        let t = Token::random().unwrap();
        assert_eq!(t.to_string().parse::<Token>().unwrap(), t);
        assert!("abc".parse::<Token>().is_err());
        assert!(!format!("{t:?}").contains(&t.to_string()));
        assert!(Secret::from_bytes(b"short").is_err());
        let s = Secret::from_bytes(b"0123456789abcdef").unwrap();
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        let st = AuthState::new(Some(s.clone()), "127.0.0.1:7000");
        let cred = Credential::Secret {
            secret: s.clone(),
            initiator: "127.0.0.1:7001".into(),
        };
        let hello = Hello::new("127.0.0.1:7000", "127.0.0.1:7001").unwrap();
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello.clone()));
        let (pending, reply) = on_hello(&st, &hello.encode(), None).unwrap();
        let body = answer_hello(&cred, &hello, &reply).unwrap();
        assert!(check_auth_body(&st, &body, Some(pending.clone())).is_ok());
        assert!(check_auth_body(&st, &body, None).is_err());
        // bound to both nonces: another Hello's pending state refuses the proof
        let (other_pending, _) = on_hello(&st, &hello.encode(), None).unwrap();
        assert!(check_auth_body(&st, &body, Some(other_pending)).is_err());
        // the target's proof is not an initiator's proof (direction labels)
        let mut reflected = vec![AUTH_SECRET];
        reflected.extend_from_slice(&reply[32..]);
        assert!(check_auth_body(&st, &reflected, Some(pending.clone())).is_err());
        // a Hello naming another segment is refused by an authenticated target
        let elsewhere = Hello::new("10.0.0.9:7000", "x").unwrap();
        assert!(on_hello(&st, &elsewhere.encode(), None).is_err());
        // a target without the secret (open: no proof) or with another one is not answered
        let open = AuthState::new(None, "127.0.0.1:7000");
        let (_, open_reply) = on_hello(&open, &hello.encode(), None).unwrap();
        assert!(matches!(
            answer_hello(&cred, &hello, &open_reply),
            Err(crate::error::HandshakeError::TargetUnproven)
        ));
        let other = Secret::from_bytes(b"0123456789abcdeX").unwrap();
        let wrong = AuthState::new(Some(other), "127.0.0.1:7000");
        let (_, wrong_reply) = on_hello(&wrong, &hello.encode(), None).unwrap();
        assert!(answer_hello(&cred, &hello, &wrong_reply).is_err());
        assert!(check_auth_body(&st, &[2, 1, 2], Some(pending.clone())).is_err());
        let tb = answer_hello(&Credential::Token(t), &hello, &reply).unwrap();
        assert!(check_auth_body(&st, &tb, None).is_err(), "no live grant");
        // names: the segment name, or the address the connection arrived on
        let local: std::net::SocketAddr = "127.0.0.1:7000".parse().unwrap();
        assert!(names_me("127.0.0.1:7000", "h:7000", Some(local)));
        assert!(names_me("localhost:7000", "h:7000", Some(local)));
        assert!(names_me("h:7000", "h:7000", None));
        assert!(!names_me("127.0.0.1:7001", "h:7000", Some(local)));
        assert!(!names_me("m:7000", "h:7000", Some(local)));
        assert!(hmac_sha256(b"k", &[b"ab", b"c"]) != hmac_sha256(b"k", &[b"a", b"bc"]));
    }
}
