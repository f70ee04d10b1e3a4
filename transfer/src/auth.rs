//! Authorization of the handshake and data path (issue 10; docs/design.md "Authentication").
//!
//! Two modes, chosen by `EngineConfig::auth`:
//! - **Open** (no secret; the default, as in Mooncake): any peer that reaches the listeners may
//!   fetch the descriptor, connect QPs and READ/WRITE every registered region. Trusted
//!   networks only; the engine's info line says so.
//! - **Authenticated** (a shared secret configured): the handshake listener hands out the
//!   descriptor and accepts RDMA `Connect` frames only on a connection that first proved the
//!   secret (challenge-response: `HMAC-SHA256(secret, label ‖ server nonce)`, the secret never
//!   travels) or presented a live grant token. Every TCP data frame must carry a grant token,
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

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::{AuthError, Result, TransferError};
use crate::types::Op;

/// Smallest shared secret accepted, bytes.
pub const MIN_SECRET_BYTES: usize = 16;
/// Largest shared secret file read, bytes.
pub const MAX_SECRET_BYTES: usize = 4096;
/// Most ranges one grant may hold (a load's block byte ranges, merged where adjacent).
pub const MAX_GRANT_RANGES: usize = 1 << 20;

/// `HMAC-SHA256(key, parts[0] ‖ parts[1] ‖ …)`; each part is prefixed with its length (u64 LE)
/// so that different splits of the same bytes never collide.
pub fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        mac.update(&(p.len() as u64).to_le_bytes());
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

/// Constant-time equality of two byte strings (lengths are not secret).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

/// `N` bytes from the operating system's CSPRNG (`getrandom`). Errors only when the OS has
/// no randomness to give (`Config`).
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| TransferError::Config(format!("no OS randomness available: {e}")))?;
    Ok(b)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let s = s.trim();
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A shared secret (at least [`MIN_SECRET_BYTES`] bytes). Never printed (`Debug` redacts it)
/// and never sent: peers prove they hold it with [`Secret::prove`].
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Arc<Vec<u8>>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// A secret from raw bytes. `Config` error when shorter than [`MIN_SECRET_BYTES`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Secret> {
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(TransferError::Config(format!(
                "shared secret of {} bytes: at least {MIN_SECRET_BYTES} are needed",
                bytes.len()
            )));
        }
        Ok(Secret(Arc::new(bytes.to_vec())))
    }

    /// Reads a secret file: its bytes with trailing whitespace (a final newline) removed,
    /// [`MIN_SECRET_BYTES`]..=[`MAX_SECRET_BYTES`]. Warns when others may read the file.
    /// Errors (`Config`): unreadable, too short or too long.
    pub fn from_file(path: &Path) -> Result<Secret> {
        let bad =
            |why: String| TransferError::Config(format!("secret file {}: {why}", path.display()));
        let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
        if meta.len() > MAX_SECRET_BYTES as u64 {
            return Err(bad(format!("over {MAX_SECRET_BYTES} bytes")));
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    "secret file {} may be read by other users (chmod 600 it)",
                    path.display()
                );
            }
        }
        let mut b = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        while b.last().is_some_and(|c| c.is_ascii_whitespace()) {
            b.pop();
        }
        Secret::from_bytes(&b).map_err(|e| bad(e.to_string()))
    }

    /// `HMAC-SHA256(secret, label, data…)`: proofs of possession and derived keys.
    pub fn prove(&self, label: &str, data: &[&[u8]]) -> [u8; 32] {
        let mut parts: Vec<&[u8]> = Vec::with_capacity(data.len() + 1);
        parts.push(label.as_bytes());
        parts.extend_from_slice(data);
        hmac_sha256(&self.0, &parts)
    }
}

/// A grant token: 16 random bytes, written as 32 lowercase hex digits (serde, `Display`,
/// `FromStr`). `Debug` shows only its first 4 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(pub [u8; 16]);

impl Token {
    /// A fresh token from the OS CSPRNG. Errors as [`random_bytes`].
    pub fn random() -> Result<Token> {
        random_bytes::<16>().map(Token)
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({}…)", &hex(&self.0[..2]))
    }
}

impl FromStr for Token {
    type Err = TransferError;
    /// 32 hex digits; anything else is `InvalidArgument`.
    fn from_str(s: &str) -> Result<Token> {
        unhex::<16>(s)
            .map(Token)
            .ok_or_else(|| TransferError::InvalidArgument("a token is 32 hex digits".into()))
    }
}

impl Serialize for Token {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Token {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// How an initiator authenticates on a peer's handshake listener.
#[derive(Debug, Clone)]
pub enum Credential {
    /// Prove the shared secret (challenge-response on the connection's nonce).
    Secret(Secret),
    /// Present a grant token the target made.
    Token(Token),
}

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

/// The grants of one engine, shared by the engine (which makes them) and its transport
/// (which checks every frame).
#[derive(Default)]
pub(crate) struct GrantTable {
    map: RwLock<HashMap<Token, Arc<Grant>>>,
}

impl GrantTable {
    fn insert(&self, spec: GrantSpec) -> Result<()> {
        if spec.ranges.len() > MAX_GRANT_RANGES {
            return Err(TransferError::InvalidArgument(format!(
                "a grant of {} ranges (at most {MAX_GRANT_RANGES})",
                spec.ranges.len()
            )));
        }
        let mut r: Vec<(u64, u64)> = Vec::with_capacity(spec.ranges.len());
        for &(a, l) in &spec.ranges {
            let end = a.checked_add(l).filter(|_| l > 0).ok_or_else(|| {
                TransferError::InvalidArgument(format!("grant range [{a:#x}, +{l})"))
            })?;
            r.push((a, end));
        }
        r.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(r.len());
        for (a, e) in r {
            match merged.last_mut() {
                Some(m) if a <= m.1 => m.1 = m.1.max(e),
                _ => merged.push((a, e)),
            }
        }
        let now = Instant::now();
        let g = Grant {
            ops: spec.ops,
            ranges: merged,
            expires: now
                .checked_add(spec.ttl)
                .unwrap_or(now + Duration::from_secs(1 << 30)),
        };
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, g| g.expires > now); // expired grants go on the next grant
        if map.contains_key(&spec.token) {
            return Err(TransferError::InvalidArgument(
                "this token already has a live grant".into(),
            ));
        }
        map.insert(spec.token, Arc::new(g));
        Ok(())
    }

    fn remove(&self, token: &Token) {
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(token);
    }

    /// Whether `token` names a live grant (any ops).
    pub(crate) fn live(&self, token: &Token) -> bool {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        map.get(token).is_some_and(|g| g.expires > Instant::now())
    }

    /// The per-frame check: `token` may do `op` on `[addr, +len)` now.
    pub(crate) fn check(
        &self,
        token: &Token,
        op: Op,
        ranges: impl IntoIterator<Item = (u64, u64)>,
    ) -> std::result::Result<(), Denied> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
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
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        map.values().filter(|g| g.expires > now).count()
    }
}

/// The authorization state of one engine: the mode (secret or open) and the grants.
pub(crate) struct AuthState {
    /// `Some` in authenticated mode.
    pub secret: Option<Secret>,
    /// Grants made by this engine (checked only in authenticated mode).
    pub grants: Arc<GrantTable>,
}

impl AuthState {
    pub(crate) fn new(secret: Option<Secret>) -> Arc<AuthState> {
        Arc::new(AuthState {
            secret,
            grants: Arc::new(GrantTable::default()),
        })
    }

    /// Whether peers must authenticate.
    pub(crate) fn enforced(&self) -> bool {
        self.secret.is_some()
    }

    /// What this engine presents to peers when it has no token: its secret, if any.
    pub(crate) fn credential(&self, token: Option<&Token>) -> Option<Credential> {
        match (&self.secret, token) {
            (Some(s), _) => Some(Credential::Secret(s.clone())),
            (None, Some(t)) => Some(Credential::Token(*t)),
            (None, None) => None,
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
/// HMAC label of the handshake proof: `Secret::prove(HANDSHAKE_LABEL, &[nonce])`.
pub const HANDSHAKE_LABEL: &str = "kvferry/handshake/v1";

pub(crate) fn auth_body(cred: &Credential, nonce: &[u8]) -> Vec<u8> {
    match cred {
        Credential::Secret(s) => {
            let mut b = vec![AUTH_SECRET];
            b.extend_from_slice(&s.prove(HANDSHAKE_LABEL, &[nonce]));
            b
        }
        Credential::Token(t) => {
            let mut b = vec![AUTH_TOKEN];
            b.extend_from_slice(&t.0);
            b
        }
    }
}

/// Checks an `Auth` frame body against the connection's `nonce` (taken: one try per nonce).
pub(crate) fn check_auth_body(
    state: &AuthState,
    body: &[u8],
    nonce: Option<[u8; 32]>,
) -> Result<()> {
    let fail = |why: &'static str| TransferError::Auth(AuthError::Handshake(why));
    match (body.first().copied(), &state.secret) {
        (Some(AUTH_SECRET), Some(secret)) if body.len() == 33 => {
            let nonce = nonce.ok_or_else(|| fail("send Hello for a nonce first"))?;
            let want = secret.prove(HANDSHAKE_LABEL, &[&nonce]);
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
    fn tokens_round_trip_and_secrets_are_checked() {
        let t = Token::random().unwrap();
        assert_eq!(t.to_string().parse::<Token>().unwrap(), t);
        assert!("abc".parse::<Token>().is_err());
        assert!(!format!("{t:?}").contains(&t.to_string()));
        assert!(Secret::from_bytes(b"short").is_err());
        let s = Secret::from_bytes(b"0123456789abcdef").unwrap();
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        let st = AuthState::new(Some(s.clone()));
        let nonce = [3u8; 32];
        let body = auth_body(&Credential::Secret(s), &nonce);
        assert!(check_auth_body(&st, &body, Some(nonce)).is_ok());
        assert!(check_auth_body(&st, &body, Some([4; 32])).is_err());
        assert!(check_auth_body(&st, &body, None).is_err());
        let other = Secret::from_bytes(b"0123456789abcdeX").unwrap();
        assert!(check_auth_body(
            &st,
            &auth_body(&Credential::Secret(other), &nonce),
            Some(nonce)
        )
        .is_err());
        assert!(check_auth_body(&st, &[2, 1, 2], Some(nonce)).is_err());
        assert!(check_auth_body(&st, &auth_body(&Credential::Token(t), &nonce), None).is_err());
        assert!(hmac_sha256(b"k", &[b"ab", b"c"]) != hmac_sha256(b"k", &[b"a", b"bc"]));
    }
}
