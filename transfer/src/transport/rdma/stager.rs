//! The stager thread: device copies and syncs around the work requests that touch staged GPU
//! memory (see `staging_sync.rs`). Slices that need nothing staged never pass through it.
//!
//! Before the wire: a WRITE from a staged local region first copies its bytes from the device
//! into the mirror; a READ from a peer's staged buffer first asks the peer to copy the ranges
//! into its mirror (one `to-host` sync per peer for all such slices at hand).
//! After the wire: a READ into a staged local region copies the landed bytes to the device; a
//! WRITE into a peer's staged buffer asks the peer to copy the ranges to its device (one
//! `to-device` sync per peer). Only then is the slice reported, so `Ok` means "in place".
//!
//! One thread serialises these copies; every wait is bounded (device copies by the memory
//! backend's deadline, syncs by `handshake_timeout`).

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use super::shared::Shared;
use super::staging_sync::{Direction, SyncRequest};
use super::work::{StageJob, Work};
use crate::error::{ProtocolError, RdmaError, TransferError};
use crate::handshake::{self, FrameType};
use crate::types::Op;

/// Where a slice's staged side is, if any.
impl Work {
    /// The peer's mirror address space is in use for the remote side.
    pub(crate) fn remote_staged(&self) -> bool {
        self.peer_info
            .buffers
            .get(self.slice.remote_buffer)
            .is_some_and(|k| k.staging_addr.is_some())
    }

    /// Needs the stager before its work request is posted.
    pub(crate) fn needs_before(&self) -> bool {
        match self.slice.op {
            Op::Write => self.mirror.is_some(),
            Op::Read => self.remote_staged(),
        }
    }

    /// Needs the stager after its work request succeeded.
    pub(crate) fn needs_after(&self) -> bool {
        match self.slice.op {
            Op::Read => self.mirror.is_some(),
            Op::Write => self.remote_staged(),
        }
    }
}

impl Shared {
    /// Hands `job` to the stager; if it is gone (shut down), fails the job's slices.
    pub(crate) fn stage(&self, job: StageJob) {
        let sent = self.stager.locked().send(job);
        if let Err(std::sync::mpsc::SendError(job)) = sent {
            fail_job(job, &gone());
        }
    }

    /// Syncs `ranges` with segment `peer`: as many requests as it takes for each body to fit a
    /// handshake frame (see `SyncRequest::split`), one after another, each waiting for its
    /// answer; stops at the first failure.
    fn sync(
        &self,
        peer: &str,
        direction: Direction,
        ranges: Vec<(u64, u64)>,
    ) -> Result<(), TransferError> {
        for req in SyncRequest::split(direction, ranges) {
            let body = serde_json::to_vec(&req).map_err(|e| {
                TransferError::Protocol(ProtocolError::Encode {
                    what: "staging sync",
                    source: e.into(),
                })
            })?;
            handshake::request_with(
                peer,
                FrameType::Connect,
                &body,
                self.handshake_timeout,
                self.credential.as_ref(),
            )?;
        }
        Ok(())
    }

    fn before(self: &Arc<Self>, works: Vec<Work>) {
        let mut ready = Vec::with_capacity(works.len());
        let mut reads: HashMap<String, Vec<Work>> = HashMap::new();
        for w in works {
            if w.sink.is_cancelled() {
                w.sink.complete(
                    w.slice.id,
                    Err(crate::transport::CompletionSink::cancelled_error()),
                );
                continue;
            }
            match w.slice.op {
                Op::Write => {
                    let Some(m) = &w.mirror else {
                        ready.push(w);
                        continue;
                    };
                    match m.to_host(&*self.memory, w.slice.local_addr, w.slice.len) {
                        Ok(()) => ready.push(w),
                        Err(e) => w.sink.complete(w.slice.id, Err(copy_failed("from", e))),
                    }
                }
                Op::Read if w.remote_staged() => {
                    reads.entry(w.peer.name.clone()).or_default().push(w)
                }
                Op::Read => ready.push(w),
            }
        }
        self.sync_each_peer(reads, Direction::ToHost, |ws| ready.extend(ws));
        if !ready.is_empty() {
            self.dispatch(ready);
        }
    }

    /// One sync per peer for its slices' remote ranges; `synced` gets the slices of each peer
    /// whose sync succeeded, the others fail with the sync's error.
    fn sync_each_peer(
        &self,
        by_peer: HashMap<String, Vec<Work>>,
        direction: Direction,
        mut synced: impl FnMut(Vec<Work>),
    ) {
        let way = match direction {
            Direction::ToHost => "from",
            Direction::ToDevice => "to",
        };
        for (peer, ws) in by_peer {
            // each sync may wait `handshake_timeout`: shutdown does not wait for them all
            if self.stop.load(Ordering::SeqCst) {
                fail_all(ws, &gone());
                continue;
            }
            let ranges = ws
                .iter()
                .map(|w| (w.slice.remote_addr, w.slice.len))
                .collect();
            match self.sync(&peer, direction, ranges) {
                Ok(()) => synced(ws),
                Err(e) => fail_all(ws, &sync_failed(&peer, way, e)),
            }
        }
    }

    fn after(&self, works: Vec<Work>) {
        let mut writes: HashMap<String, Vec<Work>> = HashMap::new();
        for w in works {
            match w.slice.op {
                Op::Read => {
                    let res = match &w.mirror {
                        Some(m) => m
                            .to_device(&*self.memory, w.slice.local_addr, w.slice.len)
                            .map_err(|e| copy_failed("to", e)),
                        None => Ok(()),
                    };
                    w.sink.complete(w.slice.id, res);
                }
                Op::Write if w.remote_staged() => {
                    writes.entry(w.peer.name.clone()).or_default().push(w)
                }
                Op::Write => w.sink.complete(w.slice.id, Ok(())),
            }
        }
        self.sync_each_peer(writes, Direction::ToDevice, |ws| {
            ws.into_iter()
                .for_each(|w| w.sink.complete(w.slice.id, Ok(())))
        });
    }
}

/// The stager thread: takes every job at hand, runs the "after" ones first (they finish
/// slices), then the "before" ones. Exits when the transport stops, failing what is left.
pub(crate) fn run_stager(s: Arc<Shared>, rx: Receiver<StageJob>) {
    while !s.stop.load(Ordering::SeqCst) {
        let first = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(j) => j,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let (mut before, mut after) = (Vec::new(), Vec::new());
        for job in std::iter::once(first).chain(rx.try_iter()) {
            match job {
                StageJob::Before(ws) => before.extend(ws),
                StageJob::After(w) => after.push(w),
            }
        }
        if !after.is_empty() {
            s.after(after);
        }
        if !before.is_empty() {
            s.before(before);
        }
    }
    // Under the sender's lock: a job sent after the last drain would be dropped with the
    // receiver, its slices never reported; now a later `stage` finds the channel closed.
    let _tx = s.stager.locked();
    for job in rx.try_iter() {
        fail_job(job, &gone());
    }
    drop(rx);
}

fn gone() -> TransferError {
    TransferError::Rdma(RdmaError::ShutDown)
}

fn fail_all(ws: Vec<Work>, e: &TransferError) {
    ws.into_iter()
        .for_each(|w| w.sink.complete(w.slice.id, Err(e.clone())));
}

fn fail_job(job: StageJob, e: &TransferError) {
    match job {
        StageJob::Before(ws) => fail_all(ws, e),
        StageJob::After(w) => w.sink.complete(w.slice.id, Err(e.clone())),
    }
}

fn copy_failed(way: &'static str, e: TransferError) -> TransferError {
    TransferError::Rdma(RdmaError::StagedCopy {
        way,
        source: crate::error::Shared(Arc::new(e)),
    })
}

fn sync_failed(peer: &str, way: &'static str, e: TransferError) -> TransferError {
    // `e` is the peer's refusal or copy error, or why it could not be reached in time
    TransferError::Rdma(RdmaError::StagedSync {
        peer: peer.to_string(),
        way,
        source: crate::error::Shared(Arc::new(e)),
    })
}
