//! The engine's sync helpers, as Mooncake's: one transfer or one batch, submitted and waited
//! for under a deadline that grows with its bytes (`EngineConfig::sync_timeout`), then freed.

use crate::engine::TransferEngine;
use crate::error::Result;
use crate::types::{Op, TransferRequest};

impl TransferEngine {
    /// Opens `target`, submits `reqs` (`(local, remote, len)`) as one batch of `op`, waits for
    /// it up to `sync_timeout` of its bytes and frees it. Errors as `open_segment`, `submit`
    /// and `wait`.
    fn sync(&self, target: &str, op: Op, reqs: &[(u64, u64, u64)]) -> Result<()> {
        let seg = self.open_segment(target)?;
        let requests: Vec<TransferRequest> = reqs
            .iter()
            .map(|&(l, r, n)| TransferRequest {
                op,
                local_addr: l,
                remote_addr: r,
                len: n,
            })
            .collect();
        let bytes = reqs.iter().fold(0u64, |a, r| a.saturating_add(r.2));
        let id = self.submit(&seg, &requests)?;
        let r = self.wait(id, self.config().sync_timeout(bytes));
        self.free_batch(id);
        r
    }

    /// WRITEs `len` bytes from `local` (registered here) to `remote` in segment `target`
    /// (`host:port`, opened and cached as needed) and waits (deadline
    /// `transfer_timeout + transfer_timeout_per_byte × len`). Errors as `submit` and `wait`.
    pub fn transfer_sync_write(
        &self,
        target: &str,
        local: u64,
        remote: u64,
        len: u64,
    ) -> Result<()> {
        self.sync(target, Op::Write, &[(local, remote, len)])
    }

    /// READs `len` bytes from `remote` in segment `target` into `local`; as `transfer_sync_write`.
    pub fn transfer_sync_read(
        &self,
        target: &str,
        local: u64,
        remote: u64,
        len: u64,
    ) -> Result<()> {
        self.sync(target, Op::Read, &[(local, remote, len)])
    }

    /// WRITEs every `(local, remote, len)` to segment `target` as one batch and waits (deadline
    /// from the total bytes). Errors as `transfer_sync_write`; `Failed` names the first failure.
    pub fn batch_transfer_sync_write(
        &self,
        target: &str,
        requests: &[(u64, u64, u64)],
    ) -> Result<()> {
        self.sync(target, Op::Write, requests)
    }

    /// READs every `(local, remote, len)` from segment `target` as one batch and waits.
    pub fn batch_transfer_sync_read(
        &self,
        target: &str,
        requests: &[(u64, u64, u64)],
    ) -> Result<()> {
        self.sync(target, Op::Read, requests)
    }
}
