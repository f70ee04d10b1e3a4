//! Opening a peer's allocations (initiator side): the handle request with its proof, the
//! live table and file descriptors fetched over the Unix socket, each allocation mapped once;
//! and forgetting a peer.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use kvferry_cuda::ipc::{AllocationKind, ImportedVmm, LegacyHandle, OpenedLegacy};

use super::fdpass::{self, hex};
use super::keys::{HostIdentity, IpcRegionKeys, OwnEngines};
use super::live::LiveView;
use super::state::{
    allocs_bytes, gpu_err, parse_hex, AllocReply, Envelope, Mapped, Peer, Reply, Request,
    PROOF_LABEL,
};
use super::transport::CudaIpcTransport;
use crate::descriptor::SegmentDescriptor;
use crate::error::{CudaIpcReplyFault, ProtocolError, Refusal, Result, TransferError};
use crate::handshake::{self, FrameType};
use crate::sync::MutexExt;

/// How long a peer process seen alive is taken as alive without asking (`peer_gone`).
pub(super) const ALIVE_FOR: std::time::Duration = std::time::Duration::from_micros(500);
/// Peer processes remembered alive at most (more start the list afresh).
const ALIVE_KEPT: usize = 64;

impl CudaIpcTransport {
    /// Asks `desc` for the allocations of `keys` (one process's: see [`one_process`]) and maps
    /// them for local device `dev` (initiator side), each under (`dev`, its base).
    /// Allocations that fail to map are marked failed (with a warning). Every wait is bounded:
    /// the turn behind another import of this peer and the handle request by the handshake
    /// timeout, each descriptor read by the socket's deadline, and all of them by `by` where
    /// given (a warm-up's one budget). Errors: `Timeout` when the turn was not had in time or
    /// `by` passed (what is not mapped then is not failed: a later import asks again); any
    /// other: the request failed (the caller decides what that means for the allocations).
    pub(super) fn import(
        &self,
        desc: &SegmentDescriptor,
        keys: &[&IpcRegionKeys],
        dev: u32,
        by: Option<Instant>,
    ) -> Result<()> {
        let Some(host) = one_process(&desc.name, keys)? else {
            return Ok(());
        };
        let allocs: Vec<(u64, u64, AllocationKind)> = keys
            .iter()
            .map(|k| (k.alloc_base, k.alloc_size, k.kind))
            .collect();
        let h = self.handshake_timeout;
        let left = || by.map_or(h, |b| b.saturating_duration_since(Instant::now()).min(h));
        // A step that failed once `by` passed failed for the deadline, not for the peer.
        let late = |e: TransferError| match by {
            Some(b) if Instant::now() >= b => TransferError::Timeout(h),
            _ => e,
        };
        // One import at a time per peer; what another one mapped meanwhile is not asked for
        // again (a second mapping of an allocation would replace the first, unmapped once its
        // copies end).
        let t0 = Instant::now();
        let _turn = self
            .importing
            .turn(&desc.name, left())
            .ok_or(TransferError::Timeout(h))?;
        let waited_us = t0.elapsed().as_micros() as u64;
        let allocs: Vec<(u64, u64, AllocationKind)> = {
            let peers = self.peers.locked();
            let p = peers
                .get(&desc.name)
                .filter(|p| p.instance_id == desc.instance_id);
            allocs
                .iter()
                .filter(|a| p.is_none_or(|p| !p.mapped.contains_key(&(dev, a.0))))
                .copied()
                .collect()
        };
        if allocs.is_empty() {
            tracing::debug!(target: "kvferry::timing", waited_us, "cuda ipc import: mapped meanwhile");
            return Ok(());
        }
        let allocs = &allocs[..];
        let nonce = crate::auth::random_bytes::<32>()?;
        let bases: Vec<u64> = allocs.iter().map(|a| a.0).collect();
        let in_process = self.me.as_ref().is_some_and(|m| m.same_process(host));
        if in_process && !OwnEngines::contains(&desc.name, desc.instance_id) {
            // Its keys copy this process's identity: its addresses would be taken as ours.
            return Err(TransferError::Refused {
                segment: desc.name.clone(),
                why: Refusal::ForgedIdentity,
            });
        }
        // In-process peers need only the live table.
        let wanted: Vec<u64> = if in_process {
            Vec::new()
        } else {
            bases.clone()
        };
        let proof = self
            .auth
            .secret
            .as_ref()
            .map(|s| hex(&s.prove(PROOF_LABEL, &[&nonce, &allocs_bytes(&wanted)])));
        let body = serde_json::to_vec(&Envelope {
            cuda_ipc: Request {
                version: 1,
                nonce: hex(&nonce),
                proof,
                allocs: wanted,
                instance: Some(desc.instance_id),
            },
        })
        .map_err(|e| {
            TransferError::Protocol(ProtocolError::Encode {
                what: "CUDA IPC request",
                source: e.into(),
            })
        })?;
        let window = left();
        if window.is_zero() {
            return Err(TransferError::Timeout(h));
        }
        let reply = handshake::request_with(
            &desc.name,
            FrameType::Connect,
            &body,
            window,
            self.credential.as_ref(),
        )
        .map_err(late)?;
        let reply: Envelope<Reply> = serde_json::from_slice(&reply).map_err(|e| {
            TransferError::Protocol(ProtocolError::BadJson {
                what: format!("CUDA IPC reply from {}", desc.name),
                source: e.into(),
            })
        })?;
        let reply = reply.cuda_ipc;
        let ticket = |t: &str| {
            parse_hex::<16>(t).ok_or_else(|| {
                TransferError::Protocol(ProtocolError::BadField {
                    what: format!("CUDA IPC ticket from {}", desc.name),
                    value: format!("of {} characters", t.len()),
                    expected: "32 hex digits",
                })
            })
        };
        let asked_us = t0.elapsed().as_micros() as u64 - waited_us;
        let (live_fd, _) =
            fdpass::fetch(&reply.socket, &ticket(&reply.live)?, &desc.name, by).map_err(late)?;
        let live = LiveView::open(&live_fd)?;
        tracing::debug!(
            target: "kvferry::timing",
            waited_us,
            asked_us,
            live_us = t0.elapsed().as_micros() as u64 - waited_us - asked_us,
            allocs = allocs.len(),
            in_process,
            "cuda ipc import"
        );
        // Made after the request (an in-process peer needs none, and a test of the waits no
        // device), before the lock: a new lane compiles its kernels.
        let lane = if in_process {
            None
        } else {
            Some(self.lane(dev)?)
        };
        // Each allocation is fetched and mapped with no lock held (the peer's turn keeps a
        // second import of it out): a peer that stalls its descriptors, or a slow driver
        // import, holds up this import only, not every post to every peer.
        let mut results: Vec<(u64, u64, Result<Mapped>)> = Vec::with_capacity(allocs.len());
        // The budget ran out: the rest stays unmapped, not failed (the first post that needs
        // it asks); what was mapped is kept.
        let mut timed_out = false;
        for (base, size, kind) in allocs {
            // No lane: an in-process peer, which maps nothing.
            let Some(lane) = lane.as_ref() else { break };
            if by.is_some_and(|b| Instant::now() >= b) {
                timed_out = true;
                break;
            }
            let got = reply.allocs.iter().find(|a| a.base == *base);
            let mapped = match (got, kind) {
                (Some(a), _) if a.size != *size => {
                    Err(TransferError::Protocol(ProtocolError::Mismatch {
                        what: format!("allocation {base:#x}: bytes in the reply"),
                        got: a.size,
                        expected: format!("{size} (the descriptor's)"),
                    }))
                }
                (
                    Some(AllocReply {
                        legacy: Some(h), ..
                    }),
                    AllocationKind::Legacy,
                ) => match parse_hex::<64>(h) {
                    Some(b) => OpenedLegacy::open(&lane.ctx, &LegacyHandle(b))
                        .map_err(gpu_err)
                        .and_then(|o| {
                            // Copies are bounded by the size the keys claim: refuse a claim
                            // past what the handle mapped.
                            if o.size() < *size {
                                return Err(TransferError::Protocol(ProtocolError::Mismatch {
                                    what: format!("allocation {base:#x}: bytes mapped"),
                                    got: o.size(),
                                    expected: format!("{size} (the descriptor's)"),
                                }));
                            }
                            Ok(Mapped::Legacy(o))
                        }),
                    None => Err(TransferError::Protocol(ProtocolError::BadField {
                        what: format!("allocation {base:#x}: legacy handle"),
                        value: format!("of {} characters", h.len()),
                        expected: "128 hex digits",
                    })),
                },
                (Some(AllocReply { fd: Some(t), .. }), AllocationKind::VmmFd) => ticket(t)
                    .and_then(|t| fdpass::fetch(&reply.socket, &t, &desc.name, by))
                    .and_then(|(fd, sz)| {
                        if sz != *size {
                            return Err(TransferError::Protocol(ProtocolError::Mismatch {
                                what: format!("allocation {base:#x}: descriptor bytes"),
                                got: sz,
                                expected: size.to_string(),
                            }));
                        }
                        ImportedVmm::import(&lane.ctx, &fd, sz)
                            .map(Mapped::Vmm)
                            .map_err(gpu_err)
                    }),
                (got, kind) => Err(TransferError::Protocol(ProtocolError::CudaIpcReply {
                    peer: desc.name.clone(),
                    fault: match got {
                        None => CudaIpcReplyFault::NotListed { base: *base },
                        Some(_) => CudaIpcReplyFault::NoHandle {
                            base: *base,
                            kind: *kind,
                        },
                    },
                })),
            };
            if mapped.is_err() && by.is_some_and(|b| Instant::now() >= b) {
                timed_out = true;
                break;
            }
            results.push((*base, *size, mapped));
        }
        let mut peers = self.peers.locked();
        let p = match peers.get_mut(&desc.name) {
            Some(p) if p.instance_id == desc.instance_id => {
                p.live = live;
                p
            }
            _ => {
                // Another instance's failed imports go with it.
                self.routes_changed();
                peers.insert(
                    desc.name.clone(),
                    Peer {
                        instance_id: desc.instance_id,
                        live,
                        mapped: HashMap::new(),
                        failed: HashSet::new(),
                    },
                );
                peers.get_mut(&desc.name).expect("inserted")
            }
        };
        if in_process {
            for (base, size, _) in allocs {
                p.mapped
                    .insert((dev, *base), (*size, Arc::new(Mapped::InProcess(*base))));
            }
            return Ok(());
        }
        for (base, size, mapped) in results {
            match mapped {
                Ok(m) => {
                    p.mapped.insert((dev, base), (size, Arc::new(m)));
                }
                Err(e) => {
                    tracing::warn!(
                        peer = %desc.name,
                        "CUDA IPC import of allocation {base:#x} failed ({e}); its slices go over {}",
                        self.inner.kind()
                    );
                    p.failed.insert((dev, base));
                    self.routes_changed();
                }
            }
        }
        if timed_out {
            return Err(TransferError::Timeout(h));
        }
        Ok(())
    }

    /// Whether the peer's process is gone (same pid namespace only; else unknown: false).
    /// Whether the peer process `host` is gone, asked at `now`: `kill(pid, 0)` in the same pid
    /// namespace, unless the process was seen alive less than `ALIVE_FOR` before `now` (a
    /// system call per post costs more than a small copy; copies posted meanwhile to a peer
    /// that just died land in the allocation its import keeps alive, as those it had queued
    /// when it died do). A process seen gone is asked again every time.
    pub(super) fn peer_gone(&self, host: &HostIdentity, now: Instant) -> bool {
        let Some(me) = &self.me else { return false };
        if !me.same_host(host) || me.pid_ns.is_empty() || me.pid_ns != host.pid_ns {
            return false;
        }
        let fresh = |&(pid, at): &(u32, Instant)| {
            pid == host.pid && now.saturating_duration_since(at) < ALIVE_FOR
        };
        if self.alive.locked().iter().any(fresh) {
            return false;
        }
        // SAFETY: signal 0 checks existence and permission only.
        let r = unsafe { libc::kill(host.pid as i32, 0) };
        let gone = r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        let mut alive = self.alive.locked();
        alive.retain(|(pid, _)| *pid != host.pid);
        if !gone {
            if alive.len() >= ALIVE_KEPT {
                alive.clear();
            }
            alive.push((host.pid, now));
        }
        gone
    }

    /// Forgets the peer held under `name` with its mappings (each unmapped once the copies
    /// that hold it end).
    pub(super) fn drop_peer(&self, name: &str) {
        self.drop_peer_if(name, |_| true);
    }

    /// As [`Self::drop_peer`], only where the peer held under `name` is `instance_id`: a
    /// process seen gone is that instance, not one that restarted under its name since.
    pub(super) fn drop_instance(&self, name: &str, instance_id: u64) {
        self.drop_peer_if(name, |p| p.instance_id == instance_id);
    }

    fn drop_peer_if(&self, name: &str, which: impl FnOnce(&Peer) -> bool) {
        let gone = {
            let mut peers = self.peers.locked();
            match peers.get(name) {
                Some(p) if which(p) => peers.remove(name),
                _ => None,
            }
        };
        if gone.is_some() {
            self.routes_changed();
        }
        drop(gone);
    }
}

/// The process that all of `keys` (a group of one peer's keys) name; `None` for no keys.
/// Errors: `Protocol(CudaIpcMixedProcesses)` naming `segment` when they name more than one
/// (one segment is one process: mapping such a group as one would take a key that claims this
/// process for another process's allocation, or the reverse).
pub(super) fn one_process<'k>(
    segment: &str,
    keys: &[&'k IpcRegionKeys],
) -> Result<Option<&'k HostIdentity>> {
    let Some(first) = keys.first() else {
        return Ok(None);
    };
    match keys.iter().find(|k| k.host != first.host) {
        None => Ok(Some(&first.host)),
        Some(other) => Err(TransferError::Protocol(
            ProtocolError::CudaIpcMixedProcesses {
                segment: segment.to_string(),
                first: first.host.pid,
                other: other.host.pid,
            },
        )),
    }
}
