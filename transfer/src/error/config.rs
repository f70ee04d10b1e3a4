//! Why an engine configuration (or a secret, or a transport's own keys) is unusable: the
//! cause carried by [`TransferError::Config`](super::TransferError::Config), with the key, the
//! value given and the limit as fields.

use std::path::PathBuf;
use std::sync::Arc;

use super::io::IoError;
use super::rdma::RdmaError;

/// Why the engine configuration is unusable. Each variant names the key (`"rdma.mtu"`), the
/// value given and what is allowed; none is produced by a peer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConfigError {
    /// `EngineConfig::host` is empty or only whitespace.
    #[error("host is empty")]
    EmptyHost,
    /// A number outside its bounds: `key` (`"rdma.qps_per_endpoint"`), the value given, the
    /// smallest and largest allowed.
    #[error("{key} {value}: expected {}", bounds(*min, *max))]
    OutOfRange {
        /// The configuration key.
        key: &'static str,
        /// The value given.
        value: u64,
        /// The smallest value allowed.
        min: u64,
        /// The largest value allowed (`u64::MAX`: no upper bound).
        max: u64,
    },
    /// A number that must be one of a few values (`rdma.mtu`: the IB MTUs).
    #[error("{key} {value}: expected one of {}", list(allowed))]
    NotOneOf {
        /// The configuration key.
        key: &'static str,
        /// The value given.
        value: u64,
        /// The values allowed.
        allowed: &'static [u64],
    },
    /// `slice_size`, with the merged tail a slice may take on (a quarter more), does not fit
    /// one TCP data frame.
    #[error(
        "slice_size {slice_size} (+ a merged tail of up to a quarter) exceeds \
         tcp.max_frame_payload {max_frame_payload}"
    )]
    SliceOverFrame {
        /// `EngineConfig::slice_size`, bytes.
        slice_size: u64,
        /// `TcpConfig::max_frame_payload`, bytes.
        max_frame_payload: u64,
    },
    /// `transport = rdma` was asked for and RDMA cannot be used here.
    #[error("transport rdma was requested but RDMA is not usable here ({0}); use tcp or auto")]
    RdmaUnusable(NoRdma),
    /// No RDMA device could be opened: the devices asked for (`rdma.devices`; empty: any)
    /// and why each one tried failed.
    #[error("no usable RDMA device{}{}", among(wanted), failures(tried))]
    NoRdmaDevice {
        /// `RdmaConfig::devices`.
        wanted: Vec<String>,
        /// Each device tried and why it could not be opened.
        tried: Vec<RdmaError>,
    },
    /// The verbs library could not list the RDMA devices.
    #[error("no usable RDMA device: cannot list devices: {0}")]
    RdmaDeviceList(#[source] RdmaError),
    /// The operating system has no randomness to give (ids, tokens, nonces).
    #[error("no OS randomness available: {0}")]
    NoRandomness(getrandom::Error),
    /// A shared secret shorter than the minimum.
    #[error("shared secret of {len} bytes: at least {min} are needed")]
    SecretTooShort {
        /// Its length in bytes.
        len: usize,
        /// `auth::MIN_SECRET_BYTES`.
        min: usize,
    },
    /// A secret file that cannot be used: its path and why.
    #[error("secret file {}: {why}", path.display())]
    SecretFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        why: SecretFileError,
    },
    /// A transport's keys are not a JSON object without `path` (the engine's own field): a bug
    /// of the transport, reported rather than published. `got`: the JSON it produced.
    #[error("transport keys must be a JSON object without `path`, got {got}")]
    KeysShape {
        /// The transport's keys as JSON.
        got: Box<serde_json::Value>,
    },
    /// A transport's keys could not be encoded as JSON (`transport`: whose).
    #[error("{transport} keys: {source}")]
    KeysEncode {
        /// `"transport"`, `"CUDA IPC"`.
        transport: &'static str,
        /// The encoder's error.
        #[source]
        source: Arc<serde_json::Error>,
    },
}

impl ConfigError {
    /// `key`'s `value` is below `min` (no upper bound).
    pub fn at_least(key: &'static str, value: u64, min: u64) -> Self {
        ConfigError::OutOfRange {
            key,
            value,
            min,
            max: u64::MAX,
        }
    }
}

/// Why a secret file cannot be used ([`ConfigError::SecretFile`]).
#[derive(Debug, Clone, thiserror::Error)]
pub enum SecretFileError {
    /// It cannot be read (missing, no permission).
    #[error("{0}")]
    Unreadable(#[source] IoError),
    /// It is larger than `auth::MAX_SECRET_BYTES`.
    #[error("over {limit} bytes")]
    TooLarge {
        /// The largest secret allowed, bytes.
        limit: usize,
    },
    /// Its secret (trailing whitespace removed) is shorter than `auth::MIN_SECRET_BYTES`.
    #[error("shared secret of {len} bytes: at least {min} are needed")]
    TooShort {
        /// Its length in bytes.
        len: usize,
        /// The minimum.
        min: usize,
    },
}

/// Why the engine does not use RDMA (in `ConfigError::RdmaUnusable` and the engine's info
/// line when `Auto` falls back to TCP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoRdma {
    /// The build has RDMA but no device with an ACTIVE port was found.
    #[error("no usable RDMA device")]
    NoDevice,
    /// The build has no RDMA transport.
    #[error("this build has no RDMA transport (cargo feature `rdma`)")]
    NotBuilt,
}

/// `min..=max` in words: `at least 1` without an upper bound, `at most 7` from 0.
fn bounds(min: u64, max: u64) -> String {
    match (min, max) {
        (min, u64::MAX) => format!("at least {min}"),
        (0, max) => format!("at most {max}"),
        (min, max) => format!("{min}..={max}"),
    }
}

fn list(allowed: &[u64]) -> String {
    let v: Vec<String> = allowed.iter().map(u64::to_string).collect();
    v.join(", ")
}

fn among(wanted: &[String]) -> String {
    if wanted.is_empty() {
        String::new()
    } else {
        format!(" among {wanted:?}")
    }
}

fn failures(tried: &[RdmaError]) -> String {
    let v: Vec<String> = tried.iter().map(ToString::to_string).collect();
    if v.is_empty() {
        String::new()
    } else {
        format!(": {}", v.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TransferError;

    #[test]
    fn config_causes_name_the_key_the_value_and_the_bounds() {
        let t = |e: ConfigError| TransferError::from(e).to_string();
        let qps = ConfigError::OutOfRange {
            key: "rdma.qps_per_endpoint",
            value: 65,
            min: 1,
            max: 64,
        };
        assert_eq!(
            t(qps),
            "configuration error: rdma.qps_per_endpoint 65: expected 1..=64"
        );
        let wr = ConfigError::OutOfRange {
            key: "rdma.max_wr",
            value: 0,
            min: 1,
            max: u64::MAX,
        };
        assert_eq!(
            t(wr),
            "configuration error: rdma.max_wr 0: expected at least 1"
        );
        let mtu = ConfigError::NotOneOf {
            key: "rdma.mtu",
            value: 300,
            allowed: &[256, 512, 1024, 2048, 4096],
        };
        assert_eq!(
            t(mtu),
            "configuration error: rdma.mtu 300: expected one of 256, 512, 1024, 2048, 4096"
        );
        let none = ConfigError::NoRdmaDevice {
            wanted: vec!["mlx5_9".into()],
            tried: vec![RdmaError::NoActivePort {
                device: "mlx5_9".into(),
            }],
        };
        assert_eq!(
            t(none),
            "configuration error: no usable RDMA device among [\"mlx5_9\"]: mlx5_9: no ACTIVE port"
        );
        let file = ConfigError::SecretFile {
            path: "/s".into(),
            why: SecretFileError::TooShort { len: 3, min: 16 },
        };
        assert_eq!(
            t(file),
            "configuration error: secret file /s: shared secret of 3 bytes: at least 16 are needed"
        );
    }
}
