//! The consumer's settings and what a load hands back: plain data, kept apart from the
//! loading path and the connection loop in `consumer.rs`.

use std::time::Duration;

use kvferry_checksum::policy::{Action, CarrierCheck, Policy};
use kvferry_checksum::verdict::Verdict;
use tracing::warn;

use crate::error::P2pError;
use crate::proto::msg::DEFAULT_MAX_ZMTP_MESSAGE;

/// Consumer settings.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// Fail-open / fail-closed and the load failure policy (§2.7).
    pub policy: Policy,
    /// Verify loads with checksums.
    pub checksums: bool,
    /// Whether the producer's payload can reach this consumer. The connector-owned
    /// carrier (the control-channel reply) always exists, so this is `true` unless an
    /// embedder strips payloads; checksums without a carrier are refused at startup
    /// when fail-closed, disabled with a warning when fail-open (§2.7).
    pub carrier: bool,
    /// Longest silence from the producer while a load waits (a CONTINUE restarts it).
    pub reply_timeout: Duration,
    /// Longest a load may wait for its reply in total.
    pub max_wait: Duration,
    /// Deadline of one rank's checksums of the landed blocks.
    pub checksum_timeout: Duration,
    /// Deadline of connecting the DEALER to a producer.
    pub connect_timeout: Duration,
    /// Deadline of handing one request to the DEALER.
    pub send_timeout: Duration,
    /// After a failed connect to a producer, loads to it fail at once with that failure's
    /// reason for this long; the next load after it connects again (without it, each load
    /// waited `connect_timeout` once the producer was gone).
    pub reconnect_interval: Duration,
    /// Largest message a producer may send on the DEALER (bytes, all frames of one message);
    /// a frame header declaring more drops the connection (its loads fail) before anything
    /// is reserved. Default [`DEFAULT_MAX_ZMTP_MESSAGE`].
    pub max_message_bytes: usize,
    /// Whether this consumer READs a load's blocks itself (docs/design.md §4.10) instead of
    /// asking the producer to WRITE them. Default [`ReadMode::Auto`].
    pub read: ReadMode,
    /// Bytes of one layer group of a load read here: each group's copies are submitted as
    /// batches of their own, and its checksums start as they are queued (device memory) or as
    /// they land. A load of at least twice this is read in groups of about this size (at most
    /// 4); 0: always one group. Default [`DEFAULT_READ_GROUP_BYTES`].
    pub read_group_bytes: u64,
    /// How a load read here over CUDA IPC is checksummed. Default [`ReadCheck::OnePass`].
    pub read_check: ReadCheck,
}

/// How a load this consumer reads over CUDA IPC is checksummed (docs/design.md §4.10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadCheck {
    /// Where both sides hold every layer of the load in the same layout (block counts aside)
    /// and the producer's memory is mapped here already, the checksum kernel copies each chunk
    /// from the producer's blocks into this side's and sums the registers it stored: the
    /// bytes cross device memory once. The checksum is of what was stored into this side's
    /// blocks, at the addresses the verification reads, not of a second read after landing.
    /// Elsewhere, as [`ReadCheck::AfterLanding`].
    #[default]
    OnePass,
    /// The transport copies; the checksum kernels read the landed bytes after the copies end
    /// (ordered on the device): two passes over the bytes.
    AfterLanding,
}

/// Default [`ConsumerConfig::read_group_bytes`].
pub const DEFAULT_READ_GROUP_BYTES: u64 = 64 << 20;

impl ConsumerConfig {
    /// The longest a load waits for its producer's reply, from [`Consumer::load`]'s call:
    /// connecting and the producer's welcome (`connect_timeout` each), handing the request over
    /// (`send_timeout`), then the overall wait (`max_wait`, never less than `reply_timeout`: the
    /// machine's own rule). The producer writes into the load's blocks only within it, so the
    /// load's grants last this long, and the load's wait for its connection ends by it.
    ///
    /// [`Consumer::load`]: crate::Consumer::load
    pub fn reply_deadline(&self) -> Duration {
        2 * self.connect_timeout + self.send_timeout + self.max_wait.max(self.reply_timeout)
    }

    /// The longest one load may take, from [`Consumer::load`]'s call to its outcome: the
    /// [reply deadline](Self::reply_deadline) plus the checksums of the landed blocks
    /// (`checksum_timeout`; the landed hook's own time aside). The one rule for a load's
    /// deadline: embedders (the Python binding's default `Consumer.load` deadline, the vLLM
    /// connector's) take theirs from it, so their deadline never cuts a load the consumer
    /// would still end with its own reason.
    ///
    /// [`Consumer::load`]: crate::Consumer::load
    pub fn load_deadline(&self) -> Duration {
        self.reply_deadline() + self.checksum_timeout
    }
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            policy: Policy::default(),
            checksums: true,
            carrier: true,
            reply_timeout: Duration::from_secs(30),
            max_wait: Duration::from_secs(480),
            checksum_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            send_timeout: Duration::from_secs(5),
            reconnect_interval: Duration::from_secs(1),
            max_message_bytes: DEFAULT_MAX_ZMTP_MESSAGE,
            read: ReadMode::Auto,
            read_group_bytes: DEFAULT_READ_GROUP_BYTES,
            read_check: ReadCheck::OnePass,
        }
    }
}

/// When a consumer READs a load's blocks itself (docs/design.md §4.10): it plans the copies
/// from the producer's layout (sent once, in the FINISH of a load that asked for it) and reads
/// them while its request is on its way, then checksums each layer group as its copies
/// complete; the producer only checks the request against its lease and answers with the
/// payload. It never applies to a load whose layout this consumer does not hold yet (the
/// first to each producer) or that a landed hook runs for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadMode {
    /// Read where every producer rank's memory is reached over CUDA IPC from the consumer
    /// ranks that need it (device memory of both, one host); else the producer WRITEs.
    #[default]
    Auto,
    /// Read over whatever path the engines take. Over TCP or RDMA the producer's engines grant
    /// no READ in secret mode, so such loads fail there: for open mode (and tests) only.
    Always,
    /// Never read: the producer WRITEs every load (and no layout is asked for).
    Never,
}

/// The result of a load that landed.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOutcome {
    /// The request.
    pub request_id: String,
    /// The verdict (§2.6); `None` when checksums are disabled.
    pub verdict: Option<Verdict>,
    /// What the embedder does now (§2.7): complete, fail the request, or recompute.
    pub action: Action,
    /// Bytes the producer wrote, or that this side read (`read`): whole blocks, except a load
    /// read in one pass ([`ReadCheck::OnePass`]), which copies only the request's tokens (the
    /// cells its checksum covers).
    pub bytes: u64,
    /// Seconds from sending the request to the producer's FINISH.
    pub transfer_seconds: f64,
    /// Seconds spent checksumming the landed blocks and comparing.
    pub checksum_seconds: f64,
    /// Layers (of all ranks) whose checksums started as they landed, before the FINISH
    /// (docs/design.md §4.9); the rest were checksummed after it. 0 when the producer said no
    /// progress, its progress was bogus, or a landed hook ran.
    pub early_layers: u32,
    /// What carried the KV, as the producer's FINISH says (`cuda-ipc`, `tcp` or `rdma`; the
    /// path of its first batch); `None` from a producer that does not say it.
    pub path: Option<kvferry_transfer::TransferPath>,
    /// Whether this consumer read the blocks itself (docs/design.md §4.10) instead of the
    /// producer writing them; `path` then is the path of its own first read.
    pub read: bool,
}

/// §2.7: checksums with no carrier verify nothing (the checksum crate's
/// [`Policy::check_carrier`]). Returns whether checksums run.
pub(crate) fn carrier_check(config: &ConsumerConfig) -> Result<bool, P2pError> {
    if !config.checksums {
        return Ok(false);
    }
    match config.policy.check_carrier(config.carrier) {
        Ok(CarrierCheck::Enabled) => Ok(true),
        Ok(CarrierCheck::DisabledWithWarning(text)) => {
            warn!("{text}");
            Ok(false)
        }
        Err(e) => Err(P2pError::Config(e.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_deadline_covers_every_wait_of_a_load() {
        let c = ConsumerConfig {
            reply_timeout: Duration::from_secs(10),
            max_wait: Duration::from_secs(100),
            checksum_timeout: Duration::from_secs(7),
            connect_timeout: Duration::from_secs(3),
            send_timeout: Duration::from_secs(2),
            ..ConsumerConfig::default()
        };
        assert_eq!(c.reply_deadline(), Duration::from_secs(3 + 3 + 2 + 100));
        assert_eq!(c.load_deadline(), Duration::from_secs(3 + 3 + 2 + 100 + 7));
        // The machine never waits less than the reply timeout overall.
        let c = ConsumerConfig {
            reply_timeout: Duration::from_secs(200),
            ..c
        };
        assert_eq!(c.load_deadline(), Duration::from_secs(3 + 3 + 2 + 200 + 7));
    }
}
