//! Why a caller's argument (or a peer's request for this side's memory) is invalid: the cause
//! carried by [`TransferError::InvalidArgument`](super::TransferError::InvalidArgument), with
//! the address, length and limit as fields.

use kvferry_cuda::Location;

use super::io::Shared;

/// Why an argument is invalid. Addresses are virtual addresses in the process that owns the
/// memory; lengths are bytes.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ArgumentError {
    /// A transfer request of length 0.
    #[error("request at local {local_addr:#x} has zero length")]
    ZeroLengthRequest {
        /// The request's local address.
        local_addr: u64,
    },
    /// A batch would be cut into more slices than one batch can count.
    #[error("batch has more than {limit} slices; raise slice_size")]
    TooManySlices {
        /// The most slices of one batch.
        limit: u64,
    },
    /// A slice longer than one RDMA work request can carry (or of length 0).
    #[error("slice of {len} bytes (1..={max})")]
    SliceLength {
        /// The slice's length.
        len: u64,
        /// The longest one work request carries.
        max: u64,
    },
    /// No memory region starts at `addr` (unregistering, pinning).
    #[error("no memory region registered at {addr:#x}")]
    NoRegionAt {
        /// The address given.
        addr: u64,
    },
    /// The RDMA transport holds no registration starting at `addr`.
    #[error("no RDMA registration at {addr:#x}")]
    NoRdmaRegistration {
        /// The region's start.
        addr: u64,
    },
    /// A `cuda:N` range the CUDA driver does not know as device memory of that GPU.
    #[error("[{addr:#x}, +{len}) is not cuda:{ordinal} memory: {source}")]
    NotDeviceMemory {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
        /// The GPU it was said to be on.
        ordinal: u32,
        /// The driver's answer.
        #[source]
        source: Shared,
    },
    /// A `cuda:N` range that is not inside one allocation of that GPU (it runs past the end
    /// of the allocation holding its start, or that allocation is on another GPU).
    #[error(
        "[{addr:#x}, +{len}) is not inside one allocation of cuda:{ordinal} memory \
         (allocation [{alloc_addr:#x}, +{alloc_len}) on cuda:{alloc_ordinal})"
    )]
    SpansAllocations {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
        /// The GPU it was said to be on.
        ordinal: u32,
        /// Start of the allocation holding `addr`.
        alloc_addr: u64,
        /// That allocation's length.
        alloc_len: u64,
        /// The GPU of that allocation.
        alloc_ordinal: i64,
    },
    /// A dma-buf export asked of memory that is not device memory.
    #[error("dma-buf export of {location} memory: only cuda:N memory is exported")]
    DmabufOfHost {
        /// Where the region lives.
        location: Location,
    },
    /// A region too large for this process's address space (a host mirror of it cannot be
    /// mapped).
    #[error("region of {len} bytes does not fit this process's address space")]
    RegionTooLarge {
        /// The region's length.
        len: u64,
    },
    /// A staged region was unregistered while a slice or sync used it.
    #[error("the staged {location} region at {addr:#x} was unregistered")]
    StagedRegionGone {
        /// Where the region lives.
        location: Location,
        /// Its start.
        addr: u64,
    },
    /// A range that is not inside the staged region it was looked up in.
    #[error(
        "[{addr:#x}, +{len}) is not inside the staged region [{region_addr:#x}, +{region_len})"
    )]
    OutsideStagedRegion {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
        /// The staged region's start.
        region_addr: u64,
        /// Its length.
        region_len: u64,
    },
    /// A peer's staging sync request that breaks its bounds (see [`SyncBound`]).
    #[error("staging sync {0}")]
    StagingSync(SyncBound),
    /// A text that is not a grant token.
    #[error("a token is 32 hex digits")]
    BadToken,
    /// A grant of more ranges than one grant may have.
    #[error("a grant of {ranges} ranges (at most {limit})")]
    TooManyGrantRanges {
        /// Ranges given.
        ranges: usize,
        /// The most allowed.
        limit: usize,
    },
    /// A grant range of length 0 or that wraps the address space.
    #[error("grant range [{addr:#x}, +{len}) is empty or wraps the address space")]
    BadGrantRange {
        /// Its start.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A strided request with a range of length 0 (and at least one block).
    #[error("strided request has a range of zero length")]
    StridedZeroLength,
    /// A strided request one copy of which runs past the end of the address space.
    #[error("a strided request's copy at base {base:#x} + offset {offset:#x} overflows the address space")]
    StridedOverflow {
        /// The block's base on the side that overflows.
        base: u64,
        /// The offset added to it (a range's offset, or the end of block 0's span).
        offset: u64,
    },
    /// A grant for a token that already has a live one.
    #[error("this token already has a live grant")]
    GrantExists,
    /// A transport name that is none of `auto`, `tcp`, `rdma` (at most 64 characters of it).
    #[error("transport {given:?}: expected auto, tcp or rdma")]
    UnknownTransport {
        /// The name given, cut to 64 characters.
        given: String,
    },
}

/// How a peer's staging sync request breaks its bounds ([`ArgumentError::StagingSync`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyncBound {
    /// More ranges than one request may name.
    #[error("names {ranges} ranges (at most {limit})")]
    TooManyRanges {
        /// Ranges named.
        ranges: usize,
        /// The most allowed.
        limit: usize,
    },
    /// A range of length 0.
    #[error("range at {addr:#x} has zero length")]
    ZeroLength {
        /// Its start.
        addr: u64,
    },
    /// A range outside every staged region (or that wraps the address space).
    #[error("range [{addr:#x}, +{len}) is not inside a staged region")]
    NotStaged {
        /// Its start.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// The ranges cut into more pieces of staged regions than one request may copy.
    #[error("spans more than {limit} pieces of staged regions")]
    TooManyPieces {
        /// The most pieces allowed.
        limit: usize,
    },
}

impl ArgumentError {
    /// [`ArgumentError::UnknownTransport`] for `given`, cut to 64 characters (it may come from
    /// a file or an environment variable and is echoed in the message).
    pub fn unknown_transport(given: &str) -> Self {
        ArgumentError::UnknownTransport {
            given: given.chars().take(64).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TransferError;

    #[test]
    fn argument_causes_keep_their_texts_and_bound_what_they_echo() {
        let t = |e: ArgumentError| TransferError::InvalidArgument(e).to_string();
        assert_eq!(
            t(ArgumentError::ZeroLengthRequest { local_addr: 0x1000 }),
            "invalid argument: request at local 0x1000 has zero length"
        );
        assert_eq!(
            t(ArgumentError::StagingSync(SyncBound::TooManyRanges {
                ranges: 9,
                limit: 8
            })),
            "invalid argument: staging sync names 9 ranges (at most 8)"
        );
        let long = "x".repeat(10_000);
        let e = t(ArgumentError::unknown_transport(&long));
        assert!(e.len() < 200, "{e}");
    }
}
