//! Segment descriptors (docs/design.md §3 "Segments"): what a segment tells its peers in reply
//! to a handshake `Descriptor` query, and every rule about them in one place: build (this
//! engine's own), validate (a peer's, before it is cached), cover (requests against a peer's
//! buffers) and the transport kind check (both sides must speak one transport).
//!
//! The wire format is JSON: `{"name", "instance_id", "transport": {"kind", "details"},
//! "buffers": [{"region", "keys"}...]}`, `kind` one of the lowercase names of
//! [`TransportKind`] (`"tcp"`, `"rdma"`).

use serde::{Deserialize, Serialize};

use crate::error::{
    DescriptorError, HandshakeError, ProtocolError, Result, TransferError, UnsupportedError,
};
use crate::handshake::MAX_FRAME_BODY;
use crate::memory::{cover_sorted, Covers, MemoryRegion, MemoryRegistry, RegionKeys};
use crate::types::{TransferRequest, TransportKind};

/// One buffer a segment advertises: a registered memory region and its transport keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDesc {
    /// The region in the segment's own address space (`addr`, `len` in bytes, location).
    pub region: MemoryRegion,
    /// How it was registered, and its transport's own keys (RDMA: per-device rkeys, staging mirror).
    pub keys: RegionKeys,
}

/// What a segment tells its peers (JSON on the handshake channel, frame type `Descriptor`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// The segment name, `host:port` of its handshake listener.
    pub name: String,
    /// Random id of the engine instance; changes when the peer restarts on the same port, so a
    /// stale descriptor is detected (TCP data requests carry it and the target checks it).
    pub instance_id: u64,
    /// The segment's transport and its connection facts (devices, data port).
    pub transport: TransportInfo,
    /// Registered buffers, ascending by address, non-overlapping.
    pub buffers: Vec<BufferDesc>,
}

/// The transport part of a segment descriptor: which transport the segment speaks and what a
/// peer needs to reach it. `kind` is the transport's [`crate::Transport::kind`] (never
/// `Auto`); `details` is the transport's own JSON object. TCP: `{"data_port": u16}` (host = the
/// segment's host). RDMA (defined by the rdma module), e.g. `{"devices": [{"name", "gid",
/// "lid", "port", "active_mtu"}...]}`; each buffer's RDMA keys (`RdmaRegionKeys`) give one rkey
/// per device, in this order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportInfo {
    /// The transport the segment speaks (`"tcp"` or `"rdma"` on the wire).
    pub kind: TransportKind,
    /// The transport's own JSON object (TCP: `{"data_port": u16}`; RDMA: its device list).
    /// A transport reads it only through [`TransportInfo::decode`], into its own typed peer
    /// info, once per use: never key by key with a default for a missing key.
    pub details: serde_json::Value,
}

impl TransportInfo {
    /// Decodes `details` into the transport's typed peer info `T` (RDMA: `RdmaPeerInfo`).
    /// Errors: `Protocol` naming the segment, the transport and the missing or bad field (serde's
    /// text, e.g. "devices[0]: missing field `gid`").
    pub fn decode<T: serde::de::DeserializeOwned>(&self, segment: &str) -> Result<T> {
        serde_json::from_value(self.details.clone()).map_err(|e| {
            TransferError::Protocol(ProtocolError::BadJson {
                what: format!("segment {segment} advertises bad {} peer info", self.kind),
                source: e.into(),
            })
        })
    }
}

/// A peer descriptor lists at most this many buffers: the reply must fit one handshake frame
/// (`MAX_FRAME_BODY`) at about 160 bytes of JSON per buffer.
const MAX_BUFFERS: usize = MAX_FRAME_BODY as usize / 160;

impl SegmentDescriptor {
    /// This engine's own descriptor, as a `Descriptor` query is answered: its registered
    /// buffers now, at most `MAX_BUFFERS` of them (a warning names how many were left out).
    pub(crate) fn build(
        name: &str,
        instance_id: u64,
        transport: TransportInfo,
        registry: &MemoryRegistry,
    ) -> SegmentDescriptor {
        let mut buffers: Vec<BufferDesc> = registry
            .snapshot()
            .into_iter()
            .map(|e| BufferDesc {
                region: e.region,
                keys: e.keys,
            })
            .collect();
        if buffers.len() > MAX_BUFFERS {
            tracing::warn!(
                "{} registered regions; the descriptor lists only the first {MAX_BUFFERS}",
                buffers.len()
            );
            buffers.truncate(MAX_BUFFERS);
        }
        SegmentDescriptor {
            name: name.to_string(),
            instance_id,
            transport,
            buffers,
        }
    }

    /// Checks a descriptor received from a peer opened as `opened_as`: buffers of nonzero
    /// length that do not wrap, sorted here by address, non-overlapping. The name becomes
    /// `opened_as` (reach the peer by the name we used: its own host may be a bind address).
    /// Errors: `Handshake` (`InvalidDescriptor`) naming the bad buffer.
    pub(crate) fn validate(mut self, opened_as: &str) -> Result<SegmentDescriptor> {
        let bad = |why: DescriptorError| TransferError::Handshake {
            peer: opened_as.to_string(),
            source: HandshakeError::InvalidDescriptor(why),
        };
        self.buffers.sort_by_key(|b| b.region.addr);
        let mut prev_end = 0u64;
        for (i, b) in self.buffers.iter().enumerate() {
            let end = b.region.addr.checked_add(b.region.len).ok_or_else(|| {
                bad(DescriptorError::Wraps {
                    addr: b.region.addr,
                    len: b.region.len,
                })
            })?;
            if b.region.len == 0 {
                return Err(bad(DescriptorError::ZeroLength {
                    addr: b.region.addr,
                }));
            }
            if i > 0 && b.region.addr < prev_end {
                return Err(bad(DescriptorError::Overlaps {
                    addr: b.region.addr,
                    prev_end,
                }));
            }
            prev_end = end;
        }
        self.name = opened_as.to_string();
        Ok(self)
    }

    /// The buffer that wholly contains `[addr, addr+len)`, if any.
    pub fn find_buffer(&self, addr: u64, len: u64) -> Option<&BufferDesc> {
        self.find_buffer_index(addr, len).map(|i| &self.buffers[i])
    }

    /// The index of the buffer that wholly contains `[addr, addr+len)`, if any.
    pub(crate) fn find_buffer_index(&self, addr: u64, len: u64) -> Option<usize> {
        let i = self.buffers.partition_point(|b| b.region.addr <= addr);
        let i = i.checked_sub(1)?;
        self.buffers[i].region.contains(addr, len).then_some(i)
    }

    /// The peer-side covers `(addr, len, buffer index)` of every request's remote range, in
    /// order. Errors: `RemoteOutOfRange` for the first request some byte of which no buffer
    /// holds.
    pub(crate) fn remote_covers(&self, requests: &[TransferRequest]) -> Result<Covers<usize>> {
        // Built only for a request that spans buffers (most lie in one: no O(buffers) work
        // per submit then).
        let idx: std::cell::OnceCell<Vec<(usize, &BufferDesc)>> = std::cell::OnceCell::new();
        let refs: std::cell::OnceCell<Vec<&(usize, &BufferDesc)>> = std::cell::OnceCell::new();
        // Requests of one submit mostly lie in one buffer: the last one is tried first.
        let mut last = usize::MAX;
        // Room for every request at once (collecting `Result`s would grow it by doubling).
        let mut out = Covers::with_capacity(requests.len());
        for r in requests {
            let one = match self.buffers.get(last) {
                Some(b) if b.region.contains(r.remote_addr, r.len) => Some(last),
                _ => self.find_buffer_index(r.remote_addr, r.len),
            };
            if let Some(i) = one {
                last = i;
                out.push(smallvec::smallvec![(r.remote_addr, r.len, i)]);
                continue;
            }
            let refs = refs.get_or_init(|| {
                idx.get_or_init(|| self.buffers.iter().enumerate().collect())
                    .iter()
                    .collect()
            });
            let cover = cover_sorted(refs, |(_, b)| &b.region, r.remote_addr, r.len)
                .map(|v| v.into_iter().map(|(a, l, (i, _))| (a, l, *i)).collect())
                .ok_or_else(|| TransferError::RemoteOutOfRange {
                    segment: self.name.clone(),
                    addr: r.remote_addr,
                    len: r.len,
                })?;
            out.push(cover);
        }
        Ok(out)
    }

    /// `Ok` when this segment speaks transport `local` (two segments talk only over one
    /// transport). Errors: `Unsupported` naming both kinds.
    pub(crate) fn check_kind(&self, local: TransportKind) -> Result<()> {
        if self.transport.kind == local {
            return Ok(());
        }
        Err(UnsupportedError::TransportMismatch {
            segment: self.name.clone(),
            theirs: self.transport.kind,
            ours: local,
        }
        .into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Location, Op};

    #[test]
    fn bad_peer_info_keeps_the_json_error_by_type() {
        #[derive(Debug, serde::Deserialize)]
        struct Info {
            #[allow(dead_code)]
            data_port: u16,
        }
        let info = TransportInfo {
            kind: TransportKind::Tcp,
            details: serde_json::json!({"data_port": "x"}),
        };
        let e = info.decode::<Info>("h:1").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("segment h:1 advertises bad tcp peer info")
                && text.contains("expected u16"),
            "{text}"
        );
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        let mut json = None;
        while let Some(c) = cur {
            json = json.or(c.downcast_ref::<serde_json::Error>());
            cur = c.source();
        }
        assert!(json.is_some_and(|j| j.is_data()), "{text}");
        assert!(
            matches!(&e, TransferError::Protocol(p) if *p == match e.clone() {
                TransferError::Protocol(q) => q,
                _ => unreachable!(),
            }),
            "a clone is equal"
        );
    }

    fn region(addr: u64, len: u64) -> MemoryRegion {
        MemoryRegion {
            addr,
            len,
            location: Location::Cpu,
        }
    }

    fn buf(a: u64, l: u64) -> BufferDesc {
        BufferDesc {
            region: region(a, l),
            keys: Default::default(),
        }
    }

    fn desc(kind: TransportKind, buffers: Vec<BufferDesc>) -> SegmentDescriptor {
        SegmentDescriptor {
            name: "x:1".into(),
            instance_id: 1,
            transport: TransportInfo {
                kind,
                details: serde_json::json!({}),
            },
            buffers,
        }
    }

    #[test]
    fn peer_descriptors_with_overlap_or_wrap_are_refused() {
        let d = |bufs| desc(TransportKind::Tcp, bufs);
        assert!(d(vec![buf(100, 10), buf(105, 10)]).validate("p:1").is_err());
        assert!(d(vec![buf(u64::MAX - 1, 10)]).validate("p:1").is_err());
        assert!(d(vec![buf(100, 0)]).validate("p:1").is_err());
        let ok = d(vec![buf(200, 10), buf(100, 100)])
            .validate("p:1")
            .unwrap();
        assert_eq!(ok.buffers[0].region.addr, 100);
        assert_eq!(ok.name, "p:1");
    }

    #[test]
    fn the_kind_travels_as_todays_lowercase_string() {
        let d = desc(TransportKind::Rdma, vec![]);
        let j = serde_json::to_value(&d).unwrap();
        assert_eq!(j["transport"]["kind"], "rdma");
        let tcp = r#"{"name":"h:1","instance_id":7,"transport":{"kind":"tcp","details":{"data_port":9}},"buffers":[]}"#;
        let back: SegmentDescriptor = serde_json::from_str(tcp).unwrap();
        assert_eq!(back.transport.kind, TransportKind::Tcp);
        let junk = tcp.replace("\"tcp\"", "\"carrier-pigeon\"");
        assert!(serde_json::from_str::<SegmentDescriptor>(&junk).is_err());
    }

    #[test]
    fn a_peer_of_another_kind_is_refused_naming_both() {
        let d = desc(TransportKind::Rdma, vec![]);
        d.check_kind(TransportKind::Rdma).unwrap();
        let e = d.check_kind(TransportKind::Tcp).unwrap_err().to_string();
        assert!(e.contains("\"rdma\"") && e.contains("\"tcp\""), "{e}");
    }

    #[test]
    fn remote_covers_cut_at_buffer_boundaries_or_refuse_gaps() {
        let d = desc(
            TransportKind::Tcp,
            vec![buf(100, 50), buf(150, 50), buf(300, 10)],
        );
        let req = |remote_addr, len| TransferRequest {
            op: Op::Write,
            local_addr: 0,
            remote_addr,
            len,
        };
        let c = d
            .remote_covers(&[req(120, 60), req(150, 10), req(155, 5)])
            .unwrap();
        assert_eq!(c[0].as_slice(), [(120, 30, 0), (150, 30, 1)]);
        assert_eq!(c[1].as_slice(), [(150, 10, 1)]);
        assert_eq!(c[2].as_slice(), [(155, 5, 1)], "the last buffer again");
        let c = d.remote_covers(&[req(300, 10), req(100, 5)]).unwrap();
        assert_eq!(c[1].as_slice(), [(100, 5, 0)], "not the last buffer");
        assert!(d.remote_covers(&[req(190, 20)]).is_err()); // gap [200, 300)
        assert_eq!(d.find_buffer_index(300, 10), Some(2));
        assert_eq!(d.find_buffer_index(305, 10), None);
    }
}
