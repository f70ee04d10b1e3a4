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
use crate::error::{ArgumentError, ProtocolError, Result, TransferError, UnsupportedError};
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
        if let Some(asked) = req.instance.filter(|&i| i != self.own.1) {
            return Err(TransferError::Refused {
                segment: self.own.0.clone(),
                why: crate::error::Refusal::OtherInstance {
                    asked,
                    current: self.own.1,
                },
            });
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
        for (base, e) in offered(&req.allocs, |b| ex.get(&b)) {
            allocs.push(AllocReply {
                base,
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

/// The bases of `asked` (a handle request's allocations, as sent) that get an answer, each with
/// what `export` finds for it, in the order of their first appearance. A base listed again is
/// answered once: each answer may mint a ticket, and a peer repeating one base must not eat the
/// ticket budget (`fdpass::MAX_TICKETS`) that other peers need. A base with no export (e.g.
/// unregistered since the peer read the descriptor) is left out rather than failing the whole
/// request: the importer fails that allocation alone (`CudaIpcReplyFault::NotListed`), and
/// nothing is minted for it.
fn offered<'e, E>(asked: &[u64], export: impl Fn(u64) -> Option<&'e E>) -> Vec<(u64, &'e E)> {
    // `asked` holds at most `MAX_ALLOCS_PER_REQUEST` bases (checked before).
    let mut seen = HashSet::with_capacity(asked.len());
    asked
        .iter()
        .filter(|b| seen.insert(**b))
        .filter_map(|&b| match export(b) {
            Some(e) => Some((b, e)),
            None => {
                tracing::debug!(
                    base = format_args!("{b:#x}"),
                    "CUDA IPC handle request: allocation not exported; left out of the reply"
                );
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    //! The handle service's answer, with no GPU: exports made of any file descriptor stand in
    //! for exported allocations (the tickets and the reply do not look inside them).

    use std::os::fd::OwnedFd;

    use super::super::state::{Export, Request};
    use super::*;
    use crate::auth::Secret;

    /// A CUDA IPC transport over a TCP one (`secret` as its auth), with an empty live table
    /// published and an export (one file descriptor) of `size` 1 at each of `bases`.
    fn owner(secret: Option<Secret>, bases: &[u64]) -> Arc<CudaIpcTransport> {
        let t = super::super::transport::tests::tcp_wrapped_as("127.0.0.1:1", 1, secret);
        t.publish_live(&[]).unwrap();
        let fd: Arc<OwnedFd> = Arc::new(std::fs::File::open("/dev/null").unwrap().into());
        for &base in bases {
            t.exports.locked().insert(
                base,
                Export {
                    size: 1,
                    regions: HashSet::from([base]),
                    legacy: None,
                    fd: Some(fd.clone()),
                },
            );
        }
        t
    }

    /// A request for `allocs` as a peer sends it (proven with `secret` when given).
    fn request(allocs: Vec<u64>, secret: Option<&Secret>) -> Vec<u8> {
        let nonce = crate::auth::random_bytes::<32>().unwrap();
        serde_json::to_vec(&Envelope {
            cuda_ipc: Request {
                version: 1,
                nonce: hex(&nonce),
                proof: secret
                    .map(|s| hex(&s.prove(PROOF_LABEL, &[&nonce, &allocs_bytes(&allocs)]))),
                allocs,
                instance: None,
            },
        })
        .unwrap()
    }

    fn reply(body: &[u8]) -> Reply {
        serde_json::from_slice::<Envelope<Reply>>(body)
            .unwrap()
            .cuda_ipc
    }

    /// A request that lists one base many times gets it once and costs one ticket for it (with
    /// the live table's), so repeating a base cannot eat the ticket budget honest peers need;
    /// the secret's proof still covers the list as sent.
    #[test]
    fn a_base_listed_many_times_gets_one_ticket() {
        let secret = Secret::from_bytes(b"0123456789abcdef0123").unwrap();
        let t = owner(Some(secret.clone()), &[0x1000]);
        let body = request(vec![0x1000; MAX_ALLOCS_PER_REQUEST], Some(&secret));
        let r = reply(&t.handle_request(&body).unwrap());
        // The count first: without de-duplication it reads 1025, the reply 1024 answers.
        assert_eq!(
            t.fd_server().unwrap().outstanding(),
            2,
            "the live table's and one"
        );
        let bases: Vec<u64> = r.allocs.iter().map(|a| a.base).collect();
        assert_eq!(bases, [0x1000]);
        assert!(r.allocs[0].fd.is_some());
    }

    /// A peer whose descriptor names another instance of this segment (from before a restart)
    /// gets nothing: its batch was planned for the process that was here then. A request
    /// naming this instance, or none (an older peer), is answered.
    #[test]
    fn a_request_for_another_instance_is_refused() {
        let t = owner(None, &[0x1000]);
        let ask = |instance| {
            let mut r: Envelope<Request> =
                serde_json::from_slice(&request(vec![0x1000], None)).unwrap();
            r.cuda_ipc.instance = instance;
            t.handle_request(&serde_json::to_vec(&r).unwrap())
        };
        let e = ask(Some(2)).unwrap_err();
        assert!(
            matches!(
                e,
                TransferError::Refused {
                    why: crate::error::Refusal::OtherInstance {
                        asked: 2,
                        current: 1
                    },
                    ..
                }
            ),
            "{e}"
        );
        assert!(ask(Some(1)).is_ok());
        assert!(ask(None).is_ok());
    }

    /// A base with no export (unregistered since the peer read the descriptor) is left out of
    /// the reply and costs no ticket; the others are answered, in the order asked (the importer
    /// fails the missing one alone).
    #[test]
    fn an_unknown_base_is_left_out_of_the_reply() {
        let t = owner(None, &[0x1000, 0x3000]);
        let body = request(vec![0x3000, 0x2000, 0x1000], None);
        let r = reply(&t.handle_request(&body).unwrap());
        let bases: Vec<u64> = r.allocs.iter().map(|a| a.base).collect();
        assert_eq!(bases, [0x3000, 0x1000]);
        assert!(r.allocs.iter().all(|a| a.fd.is_some() && a.size == 1));
        assert_eq!(
            t.fd_server().unwrap().outstanding(),
            3,
            "the live table's and two"
        );
    }
}
