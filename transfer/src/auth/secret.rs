//! The shared secret, grant tokens, the credential an initiator presents, and the primitives
//! they use (HMAC-SHA256 with length-prefixed parts, constant-time compare, OS randomness).

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::{ArgumentError, ConfigError, IoError, Result, SecretFileError, TransferError};

/// Smallest shared secret accepted, bytes.
pub const MIN_SECRET_BYTES: usize = 16;
/// Largest shared secret file read, bytes.
pub const MAX_SECRET_BYTES: usize = 4096;

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
    getrandom::fill(&mut b).map_err(|e| TransferError::Config(ConfigError::NoRandomness(e)))?;
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
            return Err(TransferError::Config(ConfigError::SecretTooShort {
                len: bytes.len(),
                min: MIN_SECRET_BYTES,
            }));
        }
        Ok(Secret(Arc::new(bytes.to_vec())))
    }

    /// Reads a secret file: its bytes with trailing whitespace (a final newline) removed,
    /// [`MIN_SECRET_BYTES`]..=[`MAX_SECRET_BYTES`]. Warns when others may read the file.
    /// Errors (`Config`): unreadable, too short or too long.
    pub fn from_file(path: &Path) -> Result<Secret> {
        let bad = |why: SecretFileError| {
            TransferError::Config(ConfigError::SecretFile {
                path: path.to_path_buf(),
                why,
            })
        };
        let unreadable = |e| bad(SecretFileError::Unreadable(IoError::new("cannot read", e)));
        let meta = std::fs::metadata(path).map_err(unreadable)?;
        if meta.len() > MAX_SECRET_BYTES as u64 {
            return Err(bad(SecretFileError::TooLarge {
                limit: MAX_SECRET_BYTES,
            }));
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
        let mut b = std::fs::read(path).map_err(unreadable)?;
        while b.last().is_some_and(|c| c.is_ascii_whitespace()) {
            b.pop();
        }
        if b.len() < MIN_SECRET_BYTES {
            return Err(bad(SecretFileError::TooShort {
                len: b.len(),
                min: MIN_SECRET_BYTES,
            }));
        }
        Secret::from_bytes(&b)
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
            .ok_or(TransferError::InvalidArgument(ArgumentError::BadToken))
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
