//! Pure entry points into the transfer engine's decoders of peer input (docs/design.md §3):
//! the same functions the listeners run, without a socket, for the fuzz targets
//! (fuzz/fuzz_targets/transfer_frames.rs) and regression tests. Not a stable API.

use crate::error::{ProtocolError, Result, TransferError};
use crate::transport::wire;

/// Most pieces one scattered WRITE may carry.
pub const MAX_PIECES: usize = wire::MAX_PIECES;

/// Largest frame payload the fuzz entry points accept (the TCP transport's default).
const MAX_FRAME_PAYLOAD: u64 = 64 << 20;

/// A handshake frame header (`u64` LE body length, `u8` type) from the first 9 bytes of `b`:
/// (body length, type byte). Errors: fewer than 9 bytes, a length over
/// [`crate::handshake::MAX_FRAME_BODY`].
pub fn handshake_frame_header(b: &[u8]) -> Result<(u64, u8)> {
    let hdr: &[u8; 9] = b
        .get(..9)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| TransferError::Protocol(ProtocolError::Short("handshake header")))?;
    Ok((crate::handshake::frame_len(hdr, "fuzz")?, hdr[8]))
}

/// A TCP data request: its 48-byte header, then for a scattered WRITE its piece table,
/// decoded and checked as the target does before it touches memory. Returns the ranges
/// `(addr, len)` the frame names. Errors: short input, bad magic, a piece count or payload
/// over the limits, a bad piece table.
pub fn data_request(b: &[u8]) -> Result<Vec<(u64, u64)>> {
    let short = || TransferError::Protocol(ProtocolError::Short("data request"));
    let hdr: &[u8; wire::REQ_LEN] = b
        .get(..wire::REQ_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(short)?;
    let req = wire::Request::decode(hdr)?;
    if req.op != wire::OP_WRITE_SCATTER {
        return Ok(vec![(req.addr, req.len)]);
    }
    let n = wire::scatter_count(&req, MAX_FRAME_PAYLOAD)?;
    let table = b
        .get(wire::REQ_LEN..wire::REQ_LEN + n * wire::PIECE_LEN)
        .ok_or_else(short)?;
    wire::decode_pieces(table, req.len)
}

/// A TCP data reply header (16 bytes): (status, len). Errors: short input, bad magic.
pub fn data_reply(b: &[u8]) -> Result<(u8, u64)> {
    let hdr: &[u8; wire::REP_LEN] = b
        .get(..wire::REP_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| TransferError::Protocol(ProtocolError::Short("data reply")))?;
    wire::decode_reply(hdr)
}
