//! Where memory lives (docs/design.md §3): host memory or a CUDA device's memory. The one type
//! for it in kvferry: the transfer engine's regions, the checksum kernels' jobs, the connector's
//! workers and the Python API all use this.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A location text that is neither `"cpu"` nor `"cuda:N"`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("location {0:?}: expected \"cpu\" or \"cuda:N\"")]
pub struct ParseLocationError(pub String);

/// Where a memory region lives. Written `"cpu"` or `"cuda:N"` (N = CUDA device ordinal) in
/// configs, descriptors and on the wire (serde uses that text form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Location {
    /// Host memory addressable by this process.
    Cpu,
    /// Device memory of CUDA device N (a device pointer, not host-addressable).
    Cuda(u32),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Cpu => f.write_str("cpu"),
            Location::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Location {
    type Err = ParseLocationError;
    /// Parses `"cpu"` or `"cuda:N"` (case-insensitive `cpu`, surrounding space ignored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("cpu") {
            return Ok(Location::Cpu);
        }
        if let Some(n) = t.strip_prefix("cuda:") {
            if let Ok(n) = n.parse::<u32>() {
                return Ok(Location::Cuda(n));
            }
        }
        Err(ParseLocationError(s.to_string()))
    }
}

impl Serialize for Location {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Location {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
