//! The CUDA IPC transport's parts that need no transport: the handle request and reply, what
//! is held of exports, peers and lanes, the jobs in flight and the thread that completes them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use kvferry_cuda::driver::{Context, Event, EventState, Stream};
use kvferry_cuda::ipc::{ImportedVmm, LegacyHandle, OpenedLegacy, PieceKernel, PieceTable};

use smallvec::SmallVec;

use super::keys::IpcRegionKeys;
use super::live::LiveView;
use crate::error::{Result, TransferError};
use crate::sync::MutexExt;
use crate::transport::CompletionSink;
use crate::transport::Slice;

/// HMAC label of a handle request's proof.
pub(super) const PROOF_LABEL: &str = "kvferry cuda-ipc handles v1";
/// Nonces of handle requests remembered against replay.
pub(super) const NONCES_KEPT: usize = 4096;
/// Allocations one handle request may name.
pub(super) const MAX_ALLOCS_PER_REQUEST: usize = 1024;
/// Longest wait for one batch's device copies (plus 1 ns per byte).
pub(super) const COPY_DEADLINE: Duration = Duration::from_secs(30);

/// The CUDA IPC slices of one post with their keys: inline for a few (no allocation per post).
pub(super) type IpcSlices<'k> = SmallVec<[(Slice, &'k IpcRegionKeys); 2]>;
/// The slice ids of one job (inline for a few).
pub(super) type JobIds = SmallVec<[u32; 4]>;
/// The mappings one job keeps alive (inline for a few).
pub(super) type Keep = SmallVec<[Arc<Mapped>; 2]>;

/// One exported allocation (owner side).
pub(super) struct Export {
    pub(super) size: u64,
    /// Registered regions inside it (their start addresses).
    pub(super) regions: HashSet<u64>,
    pub(super) legacy: Option<LegacyHandle>,
    pub(super) fd: Option<Arc<OwnedFd>>,
}

/// An allocation of a peer mapped here.
pub(super) enum Mapped {
    Legacy(OpenedLegacy),
    Vmm(ImportedVmm),
    /// The peer is this process: its addresses are ours.
    InProcess(u64),
}

impl Mapped {
    pub(super) fn ptr(&self) -> u64 {
        match self {
            Mapped::Legacy(o) => o.ptr(),
            Mapped::Vmm(v) => v.ptr(),
            Mapped::InProcess(p) => *p,
        }
    }
}

/// What this process holds of one peer instance (initiator side).
pub(super) struct Peer {
    pub(super) instance_id: u64,
    pub(super) live: LiveView,
    /// (Local device, allocation base in the peer) → (size, mapping). Per device: a mapping
    /// gives access to the device it was made for only (a VMM import sets access for that
    /// device; a legacy open enables peer access from it), so another local device maps the
    /// allocation again.
    pub(super) mapped: HashMap<(u32, u64), (u64, Arc<Mapped>)>,
    /// (Local device, allocation base) whose import failed: sent to the fallback transport
    /// from then on.
    pub(super) failed: HashSet<(u32, u64)>,
}

/// A handle request (`Connect` body `{"cuda_ipc": Request}`).
#[derive(Serialize, Deserialize)]
pub(super) struct Request {
    pub(super) version: u32,
    /// 32 random bytes as hex, proven with the secret in authenticated mode.
    pub(super) nonce: String,
    /// HMAC of the nonce and the allocations, hex; `None` in open mode.
    pub(super) proof: Option<String>,
    /// Allocation bases wanted.
    pub(super) allocs: Vec<u64>,
    /// The owner's instance id as the asking peer's descriptor names it (absent from older
    /// peers): an owner restarted under the same name since refuses, so that a batch
    /// planned on the old descriptor never maps the new process's allocations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) instance: Option<u64>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct Reply {
    /// The owner's Unix socket (abstract name) for tickets.
    pub(super) socket: String,
    /// Ticket of the live table.
    pub(super) live: String,
    pub(super) allocs: Vec<AllocReply>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct AllocReply {
    pub(super) base: u64,
    pub(super) size: u64,
    /// Legacy handle (64 bytes, hex).
    pub(super) legacy: Option<String>,
    /// Ticket of the file descriptor.
    pub(super) fd: Option<String>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct Envelope<T> {
    pub(super) cuda_ipc: T,
}

/// A device's copy lane: its context, this transport's stream on it, the piece kernel (when
/// NVRTC is there) and spare tables.
pub(super) struct Lane {
    pub(super) ctx: Context,
    pub(super) stream: Stream,
    pub(super) kernel: Option<PieceKernel>,
    /// The strided kernel (when NVRTC is there and it compiled): strided groups take the
    /// per-copy path without it.
    pub(super) strided: Option<kvferry_cuda::ipc::StridedKernel>,
    pub(super) tables: Mutex<Vec<PieceTable>>,
    /// Tables allocated on the submit path so far (a warning at 1, 2, 4, ...).
    pub(super) late_tables: AtomicU64,
    /// Events of completed jobs, reused (an event per batch otherwise costs a create and a
    /// destroy in the driver).
    pub(super) events: Mutex<Vec<Event>>,
}

/// Bytes of table each of a lane's tables is allocated with ahead of its first launch: a
/// strided table of about 16,000 blocks, or a piece table of about 10,000 pieces.
pub(super) const TABLE_AHEAD_BYTES: usize = 256 << 10;
/// Tables a lane allocates (in one piece) when it is made: launches in flight at once that
/// take no allocation on the submit path (16 loads of 4 layer groups, say).
pub(super) const TABLES_AHEAD: usize = 64;
/// Most spare tables a lane keeps; one more returned is freed (a burst past it is rare).
const TABLES_KEPT: usize = 256;
/// Most spare tables larger than [`TABLE_AHEAD_BYTES`] a lane keeps, and the largest it keeps:
/// a table grows with the launch (a peer's request sets how large), so what stays after a
/// burst of large launches is bounded (at most 16 MiB of pinned and of device memory).
const LARGE_TABLES_KEPT: usize = 4;
const LARGE_TABLE_KEPT_BYTES: usize = 4 << 20;

impl Lane {
    /// The largest spare table of this lane, or a new one, allocated on its first use (on
    /// the submit path, where the allocation synchronises the device: only past
    /// [`TABLES_AHEAD`] launches in flight).
    pub(super) fn take_table(&self) -> PieceTable {
        let mut spare = self.tables.locked();
        match (0..spare.len()).max_by_key(|&i| spare[i].capacity()) {
            Some(i) => spare.swap_remove(i),
            None => {
                drop(spare);
                let late = self.late_tables.fetch_add(1, Ordering::Relaxed) + 1;
                if late.is_power_of_two() {
                    tracing::warn!(
                        "cuda ipc: piece table {late} allocated on the submit path (the \
                         allocation waits for all the device's queued work): more launches in \
                         flight on this device than the {TABLES_AHEAD} tables allocated ahead"
                    );
                }
                PieceTable::new()
            }
        }
    }

    /// Gives a table back once the launch that read it has completed, with the memory it
    /// outgrew as tables of their own: kept for the next launches, up to [`TABLES_KEPT`], of
    /// which up to [`LARGE_TABLES_KEPT`] larger than [`TABLE_AHEAD_BYTES`] (none over
    /// [`LARGE_TABLE_KEPT_BYTES`]); the rest is freed here, outside the lock.
    pub(super) fn give_table(&self, mut table: PieceTable) {
        let outgrown = table.take_outgrown();
        let mut freed = Vec::new();
        let mut spare = self.tables.locked();
        for t in std::iter::once(table).chain(outgrown) {
            let large = t.capacity() > TABLE_AHEAD_BYTES;
            let keep = spare.len() < TABLES_KEPT
                && (!large
                    || (t.capacity() <= LARGE_TABLE_KEPT_BYTES
                        && spare
                            .iter()
                            .filter(|s| s.capacity() > TABLE_AHEAD_BYTES)
                            .count()
                            < LARGE_TABLES_KEPT));
            if keep {
                spare.push(t);
            } else {
                freed.push(t);
            }
        }
        drop(spare);
        drop(freed);
    }

    /// Records an event (a spare one, or a new one) on the lane's stream after the work
    /// enqueued there so far. The lane's context is current. Errors: the driver's.
    pub(super) fn record_event(&self) -> Result<Event> {
        let spare = self.events.locked().pop();
        let ev = match spare {
            Some(e) => e,
            None => Event::new(&self.ctx, false).map_err(gpu_err)?,
        };
        // SAFETY: the lane's stream belongs to the lane's context.
        unsafe { ev.record(self.stream.raw()) }.map_err(gpu_err)?;
        Ok(ev)
    }
}

/// Device copies in flight: their event, slices and what must live until they end.
pub(super) struct Job {
    /// Shared with a submitter that orders device work after the copies
    /// (`CompletionSink::add_point`): the lane takes it back as a spare only once nobody else
    /// holds it, so it is never recorded again while someone may still wait on it.
    pub(super) event: Arc<Event>,
    pub(super) done: CompletionSink,
    pub(super) ids: JobIds,
    pub(super) deadline: Instant,
    /// Before this its copies cannot have ended (their bytes at the device's copy rate): not
    /// asked about until then.
    pub(super) ready_at: Instant,
    pub(super) lane: Arc<Lane>,
    pub(super) table: Option<PieceTable>,
    pub(super) _keep: Keep,
}

/// Nonces of handle requests seen (a set for lookup, a queue for age), against replay.
pub(super) type Nonces = (HashSet<[u8; 32]>, VecDeque<[u8; 32]>);

pub(super) fn gpu_err(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> TransferError {
    TransferError::gpu(e)
}

pub(super) fn allocs_bytes(a: &[u64]) -> Vec<u8> {
    a.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(super) fn parse_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    // from_str_radix alone would take a leading '+'.
    if s.len() != 2 * N || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Spare events a lane keeps.
const EVENTS_KEPT: usize = 64;

/// How long the completion thread keeps polling for new jobs after its last one ended before
/// it blocks: batches posted back to back then find it awake (a blocked thread's wake-up
/// costs tens of microseconds, more than a copy of several MiB).
const HOT_AFTER_LAST: Duration = Duration::from_millis(2);

/// Least time between two queries of one lane's pending event: a query costs the driver
/// about 1.3-1.5 µs on an H200 host, under locks the submitting threads' copies need.
const POLL_GAP: Duration = Duration::from_micros(2);

/// The completion thread: polls each job's event until it completes or its deadline passes.
pub(super) fn complete_jobs(rx: mpsc::Receiver<Job>) {
    let mut jobs: Vec<Job> = Vec::new();
    let mut late: Vec<Job> = Vec::new();
    let mut open = true;
    let mut idle_since: Option<Instant> = None;
    let mut last_done = Instant::now() - HOT_AFTER_LAST;
    // Lanes with a pending job this round (kept across rounds: no allocation per round).
    let mut waiting: Vec<*const Lane> = Vec::new();
    // Lanes whose event was pending at the last query, and when they may be asked again.
    let mut gaps: Vec<(*const Lane, Instant)> = Vec::new();
    while open || !jobs.is_empty() || !late.is_empty() {
        if jobs.is_empty() && late.is_empty() {
            if last_done.elapsed() < HOT_AFTER_LAST {
                match rx.try_recv() {
                    Ok(j) => jobs.push(j),
                    Err(mpsc::TryRecvError::Empty) => {
                        std::thread::yield_now();
                        continue;
                    }
                    Err(mpsc::TryRecvError::Disconnected) => open = false,
                }
            } else {
                match rx.recv() {
                    Ok(j) => jobs.push(j),
                    Err(_) => open = false,
                }
            }
        }
        loop {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let now = Instant::now();
        // A lane's jobs are events on one stream, recorded in about the order they arrive
        // here: once one is pending, the lane's later ones are too (or end with it), so they
        // are not asked this round unless past their deadline. One driver query per lane and
        // round, not one per job: the queries take the driver's locks that the submitting
        // threads' copies need.
        waiting.clear();
        gaps.retain(|(_, t)| *t > now);
        let mut bound: *const Lane = std::ptr::null();
        let mut i = 0;
        while i < jobs.len() {
            let lane = Arc::as_ptr(&jobs[i].lane);
            if waiting.contains(&lane) && now < jobs[i].deadline {
                i += 1;
                continue;
            }
            // Not yet: its copies cannot have ended, or the lane was asked a moment ago.
            let gap = gaps.iter().find(|(l, _)| *l == lane).map(|g| g.1);
            let hold = gap.map_or(jobs[i].ready_at, |g| g.max(jobs[i].ready_at));
            if now < hold && now < jobs[i].deadline {
                waiting.push(lane);
                i += 1;
                continue;
            }
            if bound != lane {
                let _ = jobs[i].lane.ctx.bind();
                bound = lane;
            }
            match jobs[i].event.query() {
                Ok(EventState::Done) => {
                    // In order (not swap_remove): the next job of the lane is asked next.
                    let j = jobs.remove(i);
                    j.done.succeed_all(&j.ids);
                    last_done = Instant::now();
                    // Progress: the next wait starts its yielding window afresh (else a
                    // stream of batches kept in flight for over 2 ms would be polled every
                    // sleep, tens of microseconds, longer than the copies queued behind).
                    idle_since = None;
                    if let Some(t) = j.table {
                        j.lane.give_table(t);
                    }
                    if let Ok(event) = Arc::try_unwrap(j.event) {
                        let mut spare = j.lane.events.locked();
                        if spare.len() < EVENTS_KEPT {
                            spare.push(event);
                        }
                    }
                }
                Ok(EventState::Pending) if now < jobs[i].deadline => {
                    waiting.push(lane);
                    gaps.retain(|(l, _)| *l != lane);
                    gaps.push((lane, now + POLL_GAP));
                    i += 1
                }
                other => {
                    let j = jobs.remove(i);
                    let e = match other {
                        Err(e) => gpu_err(e),
                        _ => TransferError::Timeout(COPY_DEADLINE),
                    };
                    j.done.fail_all(j.ids.iter().copied(), &e);
                    // Its table and mappings stay until the device is done with them.
                    late.push(j);
                }
            }
        }
        late.retain(|j| matches!(j.event.query(), Ok(EventState::Pending)));
        if !jobs.is_empty() || !late.is_empty() {
            // Copies take microseconds to about a millisecond (a 64 MiB slice: ~30 µs on an
            // H200): yield for the first 2 ms without a completion (a sleep costs tens of
            // microseconds of latency, more than the copy), then sleep.
            if idle_since.get_or_insert(now).elapsed() < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        } else {
            idle_since = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_parsing_is_strict() {
        assert_eq!(parse_hex::<2>("0aff"), Some([10, 255]));
        assert_eq!(parse_hex::<2>("0af"), None);
        assert_eq!(parse_hex::<2>("0afg"), None);
        assert_eq!(parse_hex::<2>("+a00"), None);
        assert_eq!(parse_hex::<1>("é"), None);
    }
}
