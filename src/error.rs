//! Errors of the `kvferry` command (docs/design.md §6): each keeps the error it came from as
//! its `source`; only `main` turns one into the one-line message the user reads.

use kvferry_kernels::KernelError;
use kvferry_p2p::P2pError;
use kvferry_transfer::TransferError;

use crate::demo::pools::BudgetFrom;
use crate::payload_json::PayloadJsonError;
use crate::spec::SpecError;
use crate::world::WorldError;

/// Why a `kvferry` command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Options that cannot work together; the text names them.
    #[error("{0}")]
    Usage(String),
    /// A run that ended badly: loads not verified, a bench point with no batch or with bytes
    /// that did not land; the text gives the counts.
    #[error("{0}")]
    Failed(String),
    /// `--model` names no built-in model.
    #[error(transparent)]
    Model(#[from] crate::models::UnknownModel),
    /// A side's ranks could not be built.
    #[error(transparent)]
    World(#[from] WorldError),
    /// One side of the demo could not be built (`side` names its options).
    #[error("{side}: {source}")]
    Side {
        /// "producer (--prefill-tp/--prefill-pp)" or "consumer (--decode-tp/--decode-pp)".
        side: &'static str,
        /// Why.
        source: WorldError,
    },
    /// One side of the demo could not allocate its KV memory (`side` names its options): the
    /// blocks it holds grow with `--pool-memory` (or its default share) and `--max-tokens`.
    #[error("{side}: {source}; each side's pool holds as many of the prompts (up to --max-tokens) as --pool-memory or its default share of memory allows: lower one of them")]
    SideMemory {
        /// As in [`CliError::Side`].
        side: &'static str,
        /// The allocation's error ([`WorldError::Alloc`] or [`WorldError::GpuAlloc`]).
        source: WorldError,
    },
    /// A side's block pool cannot hold the demo's longest request: no stage could load it.
    #[error("{side}: the longest prompt (of up to --max-tokens {max_tokens}) needs {need} bytes of KV, more than the {budget} bytes its pool may hold ({from}); lower --max-tokens or raise --pool-memory")]
    PoolBudget {
        /// As in [`CliError::Side`].
        side: &'static str,
        /// `--max-tokens`.
        max_tokens: u64,
        /// Bytes the longest request takes on that side (u64::MAX: past 2^64).
        need: u64,
        /// Bytes the side's pool may hold.
        budget: u64,
        /// Where the budget came from: `--pool-memory` or its default share.
        from: BudgetFrom,
    },
    /// `--device cuda` where the CUDA checksum backend is unusable (the ranks' memory is on
    /// the GPU, so the CPU backend cannot read it).
    #[error("--device cuda: the CUDA checksum backend is unusable here: {0}")]
    CudaBackend(#[source] KernelError),
    /// The tokio runtime did not start.
    #[error("starting the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A producer or consumer could not start, or a publish was refused (`what` says which).
    #[error("{what}: {source}")]
    P2p {
        /// What was being done, e.g. "starting the producer".
        what: String,
        /// Why it failed.
        source: P2pError,
    },
    /// A transfer engine, the shared secret or a transfer failed (`what` says which).
    #[error("{what}: {source}")]
    Transfer {
        /// What was being done, e.g. "opening segment 127.0.0.1:4000".
        what: String,
        /// Why it failed.
        source: TransferError,
    },
    /// A list of sizes does not parse (`flag` names the option).
    #[error("{flag}: {source}")]
    Sizes {
        /// The option, e.g. "--block-sizes".
        flag: &'static str,
        /// Why.
        source: crate::cli::SizeError,
    },
    /// The port of a `HOST:PORT` option is not a number from 0 to 65535 (`flag` names the
    /// option, `addr` the address given).
    #[error("{flag} {addr}: bad port")]
    Port {
        /// The option, e.g. "--listen".
        flag: &'static str,
        /// The `HOST:PORT` text given.
        addr: String,
        /// The parser's error.
        source: std::num::ParseIntError,
    },
    /// The log filter (`--log` or `KVFERRY_LOG`) does not parse.
    #[error("{from} {filter:?}: not a log filter ({source})")]
    LogFilter {
        /// Where it came from: `"--log"`, `"KVFERRY_LOG"` or `"default"`.
        from: &'static str,
        /// The filter text.
        filter: String,
        /// The parser's error.
        source: tracing_subscriber::filter::ParseError,
    },
    /// A file or stream could not be read or written (`what` names it).
    #[error("{what}: {source}")]
    Io {
        /// What was being read or written.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A report could not be encoded as JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// `checksum --spec` failed.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// `payload decode/encode` failed.
    #[error(transparent)]
    Payload(#[from] PayloadJsonError),
}

impl CliError {
    /// A [`CliError::Usage`] from any text.
    pub fn usage(text: impl Into<String>) -> CliError {
        CliError::Usage(text.into())
    }

    /// A [`CliError::Failed`] from any text.
    pub fn failed(text: impl Into<String>) -> CliError {
        CliError::Failed(text.into())
    }

    /// A [`CliError::P2p`] for `what`.
    pub fn p2p(what: impl Into<String>) -> impl FnOnce(P2pError) -> CliError {
        let what = what.into();
        move |source| CliError::P2p { what, source }
    }

    /// A [`CliError::Transfer`] for `what`.
    pub fn transfer(what: impl Into<String>) -> impl FnOnce(TransferError) -> CliError {
        let what = what.into();
        move |source| CliError::Transfer { what, source }
    }

    /// A [`CliError::Io`] for `what`.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CliError {
        let what = what.into();
        move |source| CliError::Io { what, source }
    }
}
