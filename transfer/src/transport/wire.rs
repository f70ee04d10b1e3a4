//! The TCP data protocol (docs/design.md §3 "TCP transport"): fixed little-endian headers.
//!
//! Request (48 bytes): magic `u32` = `REQ_MAGIC`, op `u8` (1 WRITE, 2 READ), 3 zero bytes,
//! target instance id `u64`, remote addr `u64`, len `u64`, grant token `[u8; 16]` (all zero
//! when the initiator has none; an authenticated target checks it, `crate::auth`); a WRITE is
//! followed by `len` payload bytes. Reply (16 bytes): magic `u32` = `REP_MAGIC`, status `u8`, 3 zero bytes, len `u64`;
//! followed by `len` bytes: the data of an OK READ, nothing for an OK WRITE, the error text for
//! any other status. Replies come in request order. The target replies OK to a WRITE only after
//! the payload is in place (Mooncake once acknowledged before applying: silent loss).
//!
//! Scattered WRITE (op 3): many small pieces in one frame. The header's addr field holds the
//! number of pieces n (1..=`MAX_PIECES`), len the payload bytes (the pieces' sum); then n
//! pieces of (remote addr `u64`, len `u64`), then the payloads in piece order. One reply for
//! the frame: OK only when every piece is in place. Pieces of a KV block split by KV head (TP
//! sizes that differ) are a few hundred bytes each: one frame and one ack per piece was most of
//! the cost.

use crate::error::{ProtocolError, Result, TransferError};

pub(crate) const REQ_MAGIC: u32 = 0x5446_564b; // "KVFT"
pub(crate) const REP_MAGIC: u32 = 0x5246_564b; // "KVFR"
pub(crate) const REQ_LEN: usize = 48;
pub(crate) const REP_LEN: usize = 16;
/// Largest error text a reply may carry.
pub(crate) const MAX_ERROR_TEXT: u64 = 4096;

pub(crate) const OP_WRITE: u8 = 1;
pub(crate) const OP_READ: u8 = 2;
pub(crate) const OP_WRITE_SCATTER: u8 = 3;
/// Most pieces one scattered WRITE carries.
pub(crate) const MAX_PIECES: usize = 1024;
/// Bytes of one piece entry: remote addr, len.
pub(crate) const PIECE_LEN: usize = 16;

/// Reply status codes.
pub(crate) const ST_OK: u8 = 0;
/// The range is not inside one registered region of the target: refused, nothing written.
pub(crate) const ST_OUT_OF_RANGE: u8 = 1;
/// The request names another instance id: the initiator's descriptor is stale.
pub(crate) const ST_STALE: u8 = 2;
/// The request is malformed (zero length, over the frame limit); the target closes after it.
pub(crate) const ST_BAD_REQUEST: u8 = 3;
/// The target could not access its memory (e.g. GPU copy failed).
pub(crate) const ST_SERVER_ERROR: u8 = 4;
/// The target is authenticated and the frame's token has no live grant that allows its op
/// and ranges: refused, nothing read or written.
pub(crate) const ST_DENIED: u8 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub op: u8,
    pub instance: u64,
    pub addr: u64,
    pub len: u64,
    pub token: [u8; 16],
}

impl Request {
    pub(crate) fn encode(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        b[0..4].copy_from_slice(&REQ_MAGIC.to_le_bytes());
        b[4] = self.op;
        b[8..16].copy_from_slice(&self.instance.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..48].copy_from_slice(&self.token);
        b
    }

    /// Parses a header; `Protocol` error on a wrong magic (the stream cannot be resynchronised).
    pub(crate) fn decode(b: &[u8; REQ_LEN]) -> Result<Request> {
        let magic = u32::from_le_bytes(b[0..4].try_into().expect("4"));
        if magic != REQ_MAGIC {
            return Err(TransferError::Protocol(ProtocolError::BadMagic {
                what: "data request",
                magic,
            }));
        }
        Ok(Request {
            op: b[4],
            instance: u64::from_le_bytes(b[8..16].try_into().expect("8")),
            addr: u64::from_le_bytes(b[16..24].try_into().expect("8")),
            len: u64::from_le_bytes(b[24..32].try_into().expect("8")),
            token: b[32..48].try_into().expect("16"),
        })
    }
}

pub(crate) fn encode_reply(status: u8, len: u64) -> [u8; REP_LEN] {
    let mut b = [0u8; REP_LEN];
    b[0..4].copy_from_slice(&REP_MAGIC.to_le_bytes());
    b[4] = status;
    b[8..16].copy_from_slice(&len.to_le_bytes());
    b
}

/// Parses a reply header into (status, len); `Protocol` error on a wrong magic.
pub(crate) fn decode_reply(b: &[u8; REP_LEN]) -> Result<(u8, u64)> {
    let magic = u32::from_le_bytes(b[0..4].try_into().expect("4"));
    if magic != REP_MAGIC {
        return Err(TransferError::Protocol(ProtocolError::BadMagic {
            what: "data reply",
            magic,
        }));
    }
    Ok((b[4], u64::from_le_bytes(b[8..16].try_into().expect("8"))))
}

/// Encodes the piece table of a scattered WRITE.
pub(crate) fn encode_pieces(pieces: &[(u64, u64)]) -> Vec<u8> {
    let mut b = Vec::with_capacity(pieces.len() * PIECE_LEN);
    for &(addr, len) in pieces {
        b.extend_from_slice(&addr.to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
    }
    b
}

/// The piece count of a scattered WRITE header (its addr field), checked before the table is
/// read: 1..=`MAX_PIECES` pieces and 1..=`max_payload` bytes. `Protocol` error otherwise.
pub(crate) fn scatter_count(req: &Request, max_payload: u64) -> Result<usize> {
    let n = req.addr;
    if n == 0 || n > MAX_PIECES as u64 || req.len == 0 || req.len > max_payload {
        return Err(TransferError::Protocol(ProtocolError::Mismatch {
            what: format!("scattered WRITE of {n} pieces and bytes"),
            got: req.len,
            expected: format!("1..={MAX_PIECES} pieces, 1..={max_payload} bytes"),
        }));
    }
    Ok(n as usize)
}

/// Decodes a piece table and checks it: every len > 0, the sum equal to `total` (no overflow).
/// `Protocol` error otherwise (the stream cannot be trusted after it).
pub(crate) fn decode_pieces(b: &[u8], total: u64) -> Result<Vec<(u64, u64)>> {
    let mut sum = 0u64;
    let mut out = Vec::with_capacity(b.len() / PIECE_LEN);
    for e in b.chunks_exact(PIECE_LEN) {
        let addr = u64::from_le_bytes(e[0..8].try_into().expect("8"));
        let len = u64::from_le_bytes(e[8..16].try_into().expect("8"));
        sum = sum.checked_add(len).filter(|_| len > 0).ok_or_else(|| {
            TransferError::Protocol(ProtocolError::BadField {
                what: "scattered WRITE piece length".into(),
                value: len.to_string(),
                expected: "1 or more bytes, all pieces' sum within 64 bits",
            })
        })?;
        out.push((addr, len));
    }
    if sum != total {
        return Err(TransferError::Protocol(ProtocolError::Mismatch {
            what: "scattered WRITE pieces' sum of bytes".into(),
            got: sum,
            expected: format!("{total} (the header's)"),
        }));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_magic_is_refused() {
        let r = Request {
            op: OP_READ,
            instance: 7,
            addr: 0xdead_beef,
            len: 123,
            token: [9; 16],
        };
        assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        let mut b = r.encode();
        b[0] ^= 1;
        assert!(Request::decode(&b).is_err());
        assert_eq!(
            decode_reply(&encode_reply(ST_STALE, 9)).unwrap(),
            (ST_STALE, 9)
        );
        let mut b = encode_reply(ST_OK, 0);
        b[3] = 0;
        assert!(decode_reply(&b).is_err());
    }

    #[test]
    fn piece_tables_round_trip_and_bad_ones_are_refused() {
        let p = vec![(0x1000, 10), (0x9000, 1), (7, 300)];
        assert_eq!(decode_pieces(&encode_pieces(&p), 311).unwrap(), p);
        assert!(
            decode_pieces(&encode_pieces(&p), 310).is_err(),
            "sum differs"
        );
        assert!(
            decode_pieces(&encode_pieces(&[(1, 0), (2, 5)]), 5).is_err(),
            "empty piece"
        );
        assert!(
            decode_pieces(&encode_pieces(&[(1, u64::MAX), (2, 2)]), 1).is_err(),
            "overflow"
        );
    }
}
