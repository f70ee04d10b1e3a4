//! kvferry-checksum: the KV checksum of docs/design.md §2, pure and without I/O.
//!
//! * [`definition`] — the slice/block checksum (§2.1): the fast additive form used
//!   everywhere and the direct form kept as the test reference.
//! * [`layout`] — the layout model (§2.2): where a cell's pieces live in a layer's bytes.
//! * [`group`] — layers of a KV cache group on one worker: layer numbers, global heads,
//!   replica keys, skip reasons (§2.1, §2.3).
//! * [`select`] — which blocks each side checksums (§2.5).
//! * [`record`] — worker records and the coordinator's sums (§2.3).
//! * [`fingerprint`] — per-layer fingerprints (§2.3).
//! * [`payload`] — what the producer sends (§2.4).
//! * [`verdict`] — comparison and verdicts (§2.6); [`unverified`] — why a group is not compared.
//! * [`policy`] — fail-open / fail-closed and the load failure policy (§2.7).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bounded;
pub mod definition;
pub mod fingerprint;
pub mod group;
pub mod layout;
pub mod payload;
pub mod policy;
pub mod record;
pub mod select;
pub mod unverified;
pub mod verdict;
