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
    /// Prove the shared secret, after the target proved it (mutual challenge-response over
    /// both nonces and both names, `Hello`).
    Secret {
        /// The shared secret.
        secret: Secret,
        /// This side's own segment name, bound into both proofs.
        initiator: String,
    },
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

/// Counts of refused handshake authentications (`TransferEngine::auth_refusals`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuthRefusals {
    /// `Hello` and `Auth` frames refused since the engine started.
    pub refused: u64,
    /// How many of them produced a WARN line (at most [`REFUSAL_LOG_BURST`] per
    /// [`REFUSAL_LOG_WINDOW`]; each line after a quiet spell says how many were not logged).
    pub logged: u64,
}

/// Most refusal WARN lines per [`REFUSAL_LOG_WINDOW`]: a peer hammering the listener with bad
/// proofs cannot fill the log.
pub const REFUSAL_LOG_BURST: u32 = 5;
/// The window of [`REFUSAL_LOG_BURST`].
pub const REFUSAL_LOG_WINDOW: Duration = Duration::from_secs(10);

/// A fixed-window limit on log lines: at most `burst` lines per `window`; what is held back
/// is counted and reported with the next line that is let through. Time is an argument.
#[derive(Debug)]
pub struct LogLimit {
    burst: u32,
    window: Duration,
    state: std::sync::Mutex<LogWindow>,
}

#[derive(Debug, Default)]
struct LogWindow {
    start: Option<Instant>,
    lines: u32,
    held_back: u64,
}

impl LogLimit {
    /// At most `burst` lines per `window`.
    pub fn new(burst: u32, window: Duration) -> LogLimit {
        LogLimit {
            burst,
            window,
            state: Default::default(),
        }
    }

    /// Whether a line may be written at `now`: `Some(n)` with the number of lines held back
    /// since the last one written, `None` when this one is held back.
    pub fn allow(&self, now: Instant) -> Option<u64> {
        let mut w = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if w.start
            .is_none_or(|s| now.saturating_duration_since(s) >= self.window)
        {
            w.start = Some(now);
            w.lines = 0;
        }
        if w.lines >= self.burst {
            w.held_back += 1;
            return None;
        }
        w.lines += 1;
        Some(std::mem::take(&mut w.held_back))
    }
}

struct RefusalLog {
    refused: std::sync::atomic::AtomicU64,
    logged: std::sync::atomic::AtomicU64,
    limit: LogLimit,
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
/// Longest segment name a `Hello` carries, bytes (a `host:port`, or a DNS name and port).
pub const MAX_NAME_BYTES: usize = 1024;
/// Length of a handshake nonce, bytes.
pub const NONCE_BYTES: usize = 32;

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

/// Why a handshake `Hello` request or reply body cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// The body ends before the field `0` is complete.
    #[error("Hello body ends inside its {0}")]
    Truncated(&'static str),
    /// A name longer than [`MAX_NAME_BYTES`].
    #[error("Hello names a segment of {0} bytes (at most {MAX_NAME_BYTES})")]
    NameTooLong(usize),
    /// A name that is not UTF-8.
    #[error("Hello names a segment that is not UTF-8")]
    NotUtf8,
    /// Bytes after the last field.
    #[error("{0} bytes after the end of the Hello body")]
    Trailing(usize),
    /// A reply that is neither `nonce[32]` nor `nonce[32] ‖ proof[32]`.
    #[error("Hello reply of {0} bytes (expected 32 or 64)")]
    ReplyLength(usize),
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
