//! The jobs a checksum backend takes and what it gives back (docs/design.md §5,
//! docs/interfaces.md): a job checksums one KV cache group's selected blocks over all its
//! layers (or copies them first: [`CopyJob`]); its result holds one u64 per (block position,
//! replica key), the worker's part of §2.1's block values. The checks every backend makes of a
//! job before it reads a byte are here too.

use std::collections::BTreeMap;
use std::time::Duration;

use kvferry_checksum::group::{LayerSpec, ReplicaKey};
use kvferry_checksum::select::BlockSelection;
use thiserror::Error;

/// One layer's cache array as a backend reads it: its spec and where its bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInput {
    /// Layer number, global heads, geometry, replica key.
    pub spec: LayerSpec,
    /// Address of the layer's array (host pointer, or device pointer for [`Location::Cuda`]).
    pub addr: u64,
    /// Bytes valid from `addr` (at least `spec.geometry.byte_len()`).
    pub len: u64,
}

impl LayerInput {
    /// The layer as the launch plans take it ([`crate::cuda::view::launch_plan`],
    /// [`crate::cuda::view::copy_plan`]): (spec, address, byte length).
    pub fn as_plan_layer(&self) -> (&LayerSpec, u64, u64) {
        (&self.spec, self.addr, self.len)
    }
}

/// Where a job's KV lives: kvferry-cuda's one type for where memory lives (`Location::Cpu`,
/// or `Location::Cuda(ordinal)`).
pub use kvferry_cuda::Location;

/// Checksum one group's selected blocks over all its layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupJob {
    /// KV cache group id.
    pub group_id: u32,
    /// Tokens per logical block (every layer's `geometry.block_size()`).
    pub block_size: u64,
    /// The group's layers on this worker.
    pub layers: Vec<LayerInput>,
    /// Block ids and the position of the first.
    pub selection: BlockSelection,
    /// Request tokens; slots at or past it are excluded (§2.1).
    pub num_tokens: u64,
    /// Where the layers' arrays live.
    pub device: Location,
}

/// A [`GroupJob`] that first copies what it checksums ([`ChecksumBackend::submit_copying`]):
/// every chunk of `job`'s layers the checksum covers (its selected blocks, tokens before
/// `num_tokens`) is copied from the layer's source, then summed as stored. The checksum is of
/// the bytes the kernel stored into the layers, from the registers it stored them from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyJob {
    /// The checksum, over the layers the chunks are copied into.
    pub job: GroupJob,
    /// One per layer of `job.layers`, in order: the array its chunks are copied from, at an
    /// address this process's kernels read on the job's device (device memory there, or
    /// another process's allocation mapped into this one). Its layout must be the layer's
    /// but for its block count ([`crate::cuda::view::copy_plan`]).
    pub sources: Vec<LayerInput>,
    /// The source's block id at each position of `job.selection` (as many ids).
    pub source_blocks: Vec<u64>,
}

/// What a copy job's launch keeps alive until the device is done with it (a mapping of its
/// sources, say), even when its pending result is dropped before.
pub type Keep = Vec<std::sync::Arc<dyn std::any::Any + Send + Sync>>;

/// A job's result: replica key → one value per position from `start` (`selection.block_ids.len()`
/// values). Keys are those of the job's layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupResult {
    /// KV cache group id.
    pub group_id: u32,
    /// Position of the first value.
    pub start: u64,
    /// Replica key → values.
    pub values: BTreeMap<ReplicaKey, Vec<u64>>,
}

/// Why [`GroupResult::absorb`] refused a part: it is not of the same group's same blocks.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "a partial result of group {part_group} from position {part_start} ({part_len} values) \
     does not add to group {group} from position {start} ({len} values)"
)]
pub struct PartMismatch {
    /// The result's group id.
    pub group: u32,
    /// The result's first position.
    pub start: u64,
    /// The result's values per key (0 when it has no key yet).
    pub len: usize,
    /// The part's group id.
    pub part_group: u32,
    /// The part's first position.
    pub part_start: u64,
    /// The part's values of the first key whose length differs (else of its first key).
    pub part_len: usize,
}

impl GroupResult {
    /// Adds `part`, the result of the same group's same blocks over other layers, into this
    /// one: a group's value per replica key and position is the sum of its layers' (mod 2^64),
    /// so the results of a group's layers split in parts add up to the result over all of
    /// them, bit for bit (what checking each layer group as its copies land relies on). Keys
    /// only in `part` are taken as they are. Errors: [`PartMismatch`] when the group, the
    /// first position or the number of values differ (every list of `part` must have as many
    /// values as this result's, or as its own first list when this result has no key yet,
    /// an empty list included); `self` is unchanged then.
    pub fn absorb(&mut self, part: GroupResult) -> Result<(), PartMismatch> {
        let mine = self.values.values().next().map(Vec::len);
        // Every list of the part has this result's length (an empty one included: `zip`
        // would drop the extra values); without a key here, the part's first list's.
        let len = mine
            .or_else(|| part.values.values().next().map(Vec::len))
            .unwrap_or(0);
        let other_len = part.values.values().map(Vec::len).find(|&n| n != len);
        if part.group_id != self.group_id || part.start != self.start || other_len.is_some() {
            return Err(PartMismatch {
                group: self.group_id,
                start: self.start,
                len: mine.unwrap_or(0),
                part_group: part.group_id,
                part_start: part.start,
                part_len: other_len
                    .or_else(|| part.values.values().next().map(Vec::len))
                    .unwrap_or(0),
            });
        }
        for (key, values) in part.values {
            match self.values.get_mut(&key) {
                Some(mine) => {
                    for (a, b) in mine.iter_mut().zip(values) {
                        *a = a.wrapping_add(b);
                    }
                }
                None => {
                    self.values.insert(key, values);
                }
            }
        }
        Ok(())
    }
}

/// Errors of a backend.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KernelError {
    /// The job cannot be run as given (wrong device, short array, block id out of range, ...).
    #[error("group {group_id}: {why}")]
    InvalidJob {
        /// The job's KV cache group id.
        group_id: u32,
        /// What is wrong with it.
        #[source]
        why: JobFault,
    },
    /// A host thread for the checksums could not be started: the OS's error kind.
    #[error("device error: cannot start a checksum thread: {0}")]
    NoThread(std::io::ErrorKind),
    /// The results were asked for again after they were taken.
    #[error("device error: results already taken")]
    Taken,
    /// The CUDA layer failed (driver call, kernel compilation, no usable device); the driver's
    /// or NVRTC's error is the source.
    #[error("CUDA: {0}")]
    Cuda(#[from] kvferry_cuda::CudaError),
    /// `wait` ran out of time; the result may still arrive through `poll`.
    #[error("checksums not ready after {0:?}")]
    Timeout(Duration),
    /// A checksum worker thread panicked (a bug): the job has no values, so the load is
    /// unverified, never a mismatch.
    #[error("group {group_id}: checksum worker panicked: {why}")]
    WorkerPanicked {
        /// The KV cache group id of the job whose worker panicked.
        group_id: u32,
        /// The panic's message.
        why: String,
    },
    /// The worker computing the result went away without one.
    #[error("checksum worker ended without a result")]
    Lost,
    /// Asked to wait for device events (`submit_after_events`) that this backend cannot
    /// order its work after: it would read the layers before the work behind those events
    /// ends.
    #[error("this checksum backend cannot order its work after device events")]
    Unordered,
    /// Asked to copy what it checksums (`submit_copying`): this backend only reads (the CPU
    /// backend; the copy is then the transport's).
    #[error("this checksum backend does not copy")]
    NoCopy,
}

/// Why a job cannot be run as given ([`KernelError::InvalidJob`]); a layer is named by its
/// spec's name.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum JobFault {
    /// The job's memory is not where this backend reads (`backend`: the CPU backend reads host
    /// memory only, a CUDA backend its own device only).
    #[error("job for {job} given to the {backend} backend")]
    WrongDevice {
        /// Where the job's arrays live.
        job: Location,
        /// Where this backend reads.
        backend: Location,
    },
    /// A cell whose bytes are not whole 8-byte pieces.
    #[error("layer {layer}: cell of {cell_bytes} bytes is not whole 8-byte pieces")]
    Cell {
        /// The layer.
        layer: String,
        /// Bytes of one cell.
        cell_bytes: u64,
    },
    /// A layer's block size (tokens) is not the group's.
    #[error("layer {layer}: block size {layer_block_size} != group block size {group_block_size}")]
    BlockSize {
        /// The layer.
        layer: String,
        /// The layer's block size, tokens.
        layer_block_size: u64,
        /// The job's block size, tokens.
        group_block_size: u64,
    },
    /// A layer's array is longer than the memory given for it.
    #[error("layer {layer}: array spans {spans} bytes but only {given} are given")]
    Short {
        /// The layer.
        layer: String,
        /// Bytes the array's geometry spans.
        spans: u64,
        /// Bytes given (`len`).
        given: u64,
    },
    /// `addr + len` overflows.
    #[error("layer {layer}: address range overflows")]
    Overflow {
        /// The layer.
        layer: String,
    },
    /// A block id at or past the layer's block count.
    #[error("layer {layer}: block id {id} out of range (blocks: {blocks})")]
    BlockOutOfRange {
        /// The layer.
        layer: String,
        /// The block id.
        id: u64,
        /// Blocks in the layer's array.
        blocks: u64,
    },
    /// The CUDA kernel cannot checksum the layers (its launch plan's error).
    #[error("{0}")]
    Plan(crate::cuda::view::PlanError),
}

/// [`validate_job`] for a backend that reads on `device` only: a job for another device is
/// refused first ([`JobFault::WrongDevice`]).
pub(crate) fn validate_job_on(job: &GroupJob, device: Location) -> Result<(), KernelError> {
    if job.device != device {
        return Err(KernelError::InvalidJob {
            group_id: job.group_id,
            why: JobFault::WrongDevice {
                job: job.device,
                backend: device,
            },
        });
    }
    validate_job(job)
}

/// Group `group_id`'s job refused for its launch plan's error ([`JobFault::Plan`]).
pub(crate) fn plan_error(group_id: u32) -> impl Fn(crate::cuda::view::PlanError) -> KernelError {
    move |e| KernelError::InvalidJob {
        group_id,
        why: JobFault::Plan(e),
    }
}

/// Checks a job against its layers before any byte is read: every layer's array fits in its
/// `len`, has whole pieces and the job's block size, and every block id exists.
pub fn validate_job(job: &GroupJob) -> Result<(), KernelError> {
    validate_layers(
        job.group_id,
        job.block_size,
        &job.layers,
        &job.selection.block_ids,
    )
}

/// [`validate_job`] over `layers` and `block_ids` (a job's, or its sources' with their own
/// blocks): O(layers + blocks), the largest block id found once.
pub(crate) fn validate_layers(
    group_id: u32,
    block_size: u64,
    layers: &[LayerInput],
    block_ids: &[u64],
) -> Result<(), KernelError> {
    let bad = |why: JobFault| Err(KernelError::InvalidJob { group_id, why });
    let largest = block_ids.iter().copied().max();
    for l in layers {
        let g = &l.spec.geometry;
        let layer = || l.spec.name.clone();
        if g.pieces_per_cell().is_none() {
            return bad(JobFault::Cell {
                layer: layer(),
                cell_bytes: g.cell_bytes(),
            });
        }
        if g.block_size() != block_size {
            return bad(JobFault::BlockSize {
                layer: layer(),
                layer_block_size: g.block_size(),
                group_block_size: block_size,
            });
        }
        if g.byte_len() > l.len {
            return bad(JobFault::Short {
                layer: layer(),
                spans: g.byte_len(),
                given: l.len,
            });
        }
        if l.addr.checked_add(l.len).is_none() {
            return bad(JobFault::Overflow { layer: layer() });
        }
        let blocks = g.num_blocks();
        if largest.is_some_and(|m| m >= blocks) {
            // The first id out of range, as the error names it.
            let id = block_ids
                .iter()
                .copied()
                .find(|&id| id >= blocks)
                .unwrap_or(0);
            return bad(JobFault::BlockOutOfRange {
                layer: layer(),
                id,
                blocks,
            });
        }
    }
    Ok(())
}
