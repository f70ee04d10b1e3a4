//! The owner side of CUDA IPC: allocations exported once (legacy handle or file descriptor),
//! the live table republished as regions come and go, and the handle requests peers send in a
//! `Connect` frame (in secret mode only a peer proving the secret gets a handle).

use std::collections::HashSet;
use std::sync::Arc;

use kvferry_cuda::ipc::{self, allocation_of, AllocationKind};

use super::fdpass::hex;
use super::keys::IpcRegionKeys;
use super::live::LiveTable;
use super::state::{
    allocs_bytes, gpu_err, parse_hex, AllocReply, Envelope, Export, Reply, Request,
    MAX_ALLOCS_PER_REQUEST, NONCES_KEPT, PROOF_LABEL,
};
use super::transport::CudaIpcTransport;
use crate::error::{
    ArgumentError, ProtocolError, Refusal, Result, TransferError, UnsupportedError,
};
use crate::memory::MemoryRegion;
use crate::sync::MutexExt;

impl CudaIpcTransport {
    /// Exports the allocation holding `region` and returns its keys (owner side).
    pub(super) fn export(&self, region: &MemoryRegion, ordinal: u32) -> Result<IpcRegionKeys> {
        let me = self
            .me
            .clone()
            .ok_or(TransferError::Unsupported(UnsupportedError::NoHostIdentity))?;
        let lane = self.lane(ordinal)?;
        lane.ctx.bind().map_err(gpu_err)?;
        let a = allocation_of(region.addr).map_err(gpu_err)?;
        if a.ordinal != ordinal || region.end() > a.base + a.size {
            return Err(ArgumentError::SpansAllocations {
                addr: region.addr,
                len: region.len,
                ordinal,
                alloc_addr: a.base,
                alloc_len: a.size,
                alloc_ordinal: i64::from(a.ordinal),
            }
            .into());
        }
        let uuid = ipc::device_uuid(ordinal).map_err(gpu_err)?;
        let mut ex = self.exports.locked();
        let e = match ex.entry(a.base) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let (legacy, fd) = match a.kind {
                    AllocationKind::Legacy => {
                        (Some(ipc::legacy_handle(a.base).map_err(gpu_err)?), None)
                    }
                    AllocationKind::VmmFd => {
                        self.fd_server()?;
                        (
                            None,
                            Some(Arc::new(ipc::export_vmm(a.base).map_err(gpu_err)?)),
                        )
                    }
                };
                v.insert(Export {
                    size: a.size,
                    regions: HashSet::new(),
                    legacy,
                    fd,
                })
            }
        };
        e.regions.insert(region.addr);
        Ok(IpcRegionKeys {
            host: me,
            device_uuid: uuid,
            alloc_base: a.base,
            alloc_size: a.size,
            kind: a.kind,
        })
    }

    /// Republishes the live table from the export list.
    pub(super) fn publish_live(&self, registered: &[(u64, u64)]) -> Result<()> {
        let mut live = self.live.locked();
        if live.is_none() {
            *live = Some(LiveTable::new()?);
        }
        live.as_mut().expect("made").publish(registered)
    }

    /// The regions exported now, for the live table (addr, len).
    pub(super) fn live_regions(
        &self,
        extra: Option<&MemoryRegion>,
        gone: Option<u64>,
    ) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .live_lens
            .locked()
            .iter()
            .filter(|(a, _)| Some(**a) != gone)
            .map(|(a, l)| (*a, *l))
            .collect();
        if let Some(r) = extra {
            v.push((r.addr, r.len));
        }
        v
    }

    pub(super) fn handle_request(&self, body: &[u8]) -> Result<Vec<u8>> {
        let req: Envelope<Request> = serde_json::from_slice(body).map_err(|e| {
            TransferError::Protocol(ProtocolError::BadJson {
                what: "CUDA IPC handle request".into(),
                source: e.into(),
            })
        })?;
        let req = req.cuda_ipc;
        if req.version != 1 {
            return Err(TransferError::Protocol(ProtocolError::Version {
                what: "CUDA IPC handle request",
                got: req.version,
                speaks: 1,
            }));
        }
        if req.allocs.len() > MAX_ALLOCS_PER_REQUEST {
            return Err(TransferError::Protocol(ProtocolError::TooLarge {
                what: "CUDA IPC handle request's allocations".into(),
                len: req.allocs.len() as u64,
                limit: MAX_ALLOCS_PER_REQUEST as u64,
            }));
        }
        let nonce = parse_hex::<32>(&req.nonce).ok_or_else(|| {
            TransferError::Protocol(ProtocolError::BadField {
                what: "CUDA IPC nonce".into(),
                value: format!("of {} characters", req.nonce.len()),
                expected: "64 hex digits",
            })
        })?;
        if let Some(secret) = &self.auth.secret {
            // A handle gives the whole allocation: only a peer holding the secret gets one
            // (a grant token, good for some ranges, is not enough).
            let want = secret.prove(PROOF_LABEL, &[&nonce, &allocs_bytes(&req.allocs)]);
            let ok = req
                .proof
                .as_deref()
                .and_then(parse_hex::<32>)
                .is_some_and(|p| crate::auth::ct_eq(&p, &want));
            if !ok {
                return Err(TransferError::Auth(crate::error::AuthError::Handshake(
                    "CUDA IPC handles need the shared secret's proof",
                )));
            }
            let mut n = self.nonces.locked();
            if !n.0.insert(nonce) {
                return Err(TransferError::Auth(crate::error::AuthError::Handshake(
                    "CUDA IPC handle request replayed",
                )));
            }
            n.1.push_back(nonce);
            if n.1.len() > NONCES_KEPT {
                if let Some(old) = n.1.pop_front() {
                    n.0.remove(&old);
                }
            }
        }
        let srv = self.fd_server()?;
        let live_fd = self
            .live
            .locked()
            .as_ref()
            .map(|l| l.fd())
            .ok_or_else(|| TransferError::Unsupported(UnsupportedError::NothingExported))?;
        let live = hex(&srv.offer(live_fd, super::live::TABLE_BYTES as u64)?);
        let ex = self.exports.locked();
        let mut allocs = Vec::with_capacity(req.allocs.len());
        for base in &req.allocs {
            let e = ex.get(base).ok_or_else(|| TransferError::Refused {
                segment: "this engine".into(),
                why: Refusal::NotExported { base: *base },
            })?;
            allocs.push(AllocReply {
                base: *base,
                size: e.size,
                legacy: e.legacy.map(|h| hex(&h.0)),
                fd: match &e.fd {
                    Some(fd) => Some(hex(&srv.offer(fd.clone(), e.size)?)),
                    None => None,
                },
            });
        }
        serde_json::to_vec(&Envelope {
            cuda_ipc: Reply {
                socket: srv.name().to_string(),
                live,
                allocs,
            },
        })
        .map_err(|e| {
            TransferError::Protocol(ProtocolError::Encode {
                what: "CUDA IPC reply",
                source: e.into(),
            })
        })
    }

    pub(super) fn unexport(&self, region: &MemoryRegion) {
        let mut ex = self.exports.locked();
        let empty: Vec<u64> = ex
            .iter_mut()
            .filter_map(|(base, e)| {
                e.regions.remove(&region.addr);
                e.regions.is_empty().then_some(*base)
            })
            .collect();
        for b in empty {
            ex.remove(&b);
        }
    }
}
