//! Why a load or a group cannot be compared: the fixed reasons of docs/design.md §2.6, shared by
//! the records (a group a worker could not checksum) and the verdicts (`crate::verdict`, which
//! re-exports it).

use std::fmt;

/// Why a load or a group cannot be compared (the fixed reasons of §2.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UnverifiedReason {
    /// Not every TP×PP worker reported the load.
    NotEveryWorkerReported,
    /// The producer sent no checksums.
    NoChecksums,
    /// The producer's checksums could not be decoded.
    InvalidChecksums,
    /// A worker checksummed other blocks than scheduled.
    OtherBlocks,
    /// The group is checksummed (or present) on one side only.
    OneSideOnly,
    /// The group's fingerprints differ (other layers, kinds or dtypes).
    FingerprintDiffers,
    /// Block sizes that are not multiples of each other.
    BlockSizesIncompatible,
    /// The consumer's first loaded (smaller) block starts inside a producer block.
    UnalignedStart,
    /// No position is compared on both sides.
    NoCommonPosition,
    /// A copy of replicated KV was not checksummed.
    ReplicaNotChecksummed,
}

impl UnverifiedReason {
    /// A short human text for logs.
    pub fn text(self) -> &'static str {
        match self {
            UnverifiedReason::NotEveryWorkerReported => "not every worker reported the load",
            UnverifiedReason::NoChecksums => "the producer sent no checksums",
            UnverifiedReason::InvalidChecksums => "the producer's checksums are invalid",
            UnverifiedReason::OtherBlocks => "a worker checksummed other blocks than scheduled",
            UnverifiedReason::OneSideOnly => "group checksummed by one side only",
            UnverifiedReason::FingerprintDiffers => "group fingerprint differs",
            UnverifiedReason::BlockSizesIncompatible => {
                "block sizes are not multiples of each other"
            }
            UnverifiedReason::UnalignedStart => "first loaded block starts inside a producer block",
            UnverifiedReason::NoCommonPosition => "no block position in common",
            UnverifiedReason::ReplicaNotChecksummed => "a replica of the KV was not checksummed",
        }
    }
}

impl fmt::Display for UnverifiedReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.text())
    }
}
