//! The demo's checks of its options that clap's parsers cannot make (ranges between options,
//! options that need others), before anything is built.

use crate::cli::{DemoArgs, DeviceArg, FailurePolicyArg};
use crate::error::CliError;
use kvferry_p2p::proto::msg::MAX_BLOCKS;

/// Refuses options that cannot make a demo run that ends as expected. Errors: `CliError::Usage`
/// naming the options.
pub(super) fn check_args(args: &DemoArgs) -> Result<(), CliError> {
    if args.min_tokens == 0 || args.min_tokens > args.max_tokens {
        return Err(CliError::usage(format!(
            "--min-tokens {} / --max-tokens {}: need 1 <= min <= max",
            args.min_tokens, args.max_tokens
        )));
    }
    if args.corrupt > args.requests {
        return Err(CliError::usage(format!(
            "--corrupt {}: at most --requests ({})",
            args.corrupt, args.requests
        )));
    }
    for (flag, v) in [
        ("--block-size", Some(args.common.block_size)),
        ("--prefill-block-size", args.prefill_block_size),
        ("--decode-block-size", args.decode_block_size),
    ] {
        if v == Some(0) {
            return Err(CliError::usage(format!("{flag} 0: must be at least 1")));
        }
    }
    // Sizes not multiples of each other cannot be verified (the checksum's chunks would
    // straddle blocks on one side): every load would end unverified and the run fail.
    let bs = args.common.block_size;
    let (pbs, cbs) = (
        args.prefill_block_size.unwrap_or(bs),
        args.decode_block_size.unwrap_or(bs),
    );
    if pbs % cbs != 0 && cbs % pbs != 0 {
        return Err(CliError::usage(format!(
            "--prefill-block-size {pbs} / --decode-block-size {cbs}: one must be a multiple of the other (else no load can be verified)"
        )));
    }
    // A load request names each of its blocks: one past the wire's bound would be refused by
    // the producer load by load, so the run is refused here, once.
    let blocks = args.max_tokens.div_ceil(pbs.min(cbs));
    if blocks > MAX_BLOCKS as u64 {
        return Err(CliError::usage(format!(
            "--max-tokens {} in blocks of {}: a request of {blocks} blocks is too large (a load request names at most {MAX_BLOCKS} blocks); lower --max-tokens or raise the block size",
            args.max_tokens,
            pbs.min(cbs)
        )));
    }
    if args.common.device == DeviceArg::Cpu && (args.prefill_gpu != 0 || args.decode_gpu != 0) {
        return Err(CliError::usage(
            "--prefill-gpu/--decode-gpu place KV on GPUs: they need --device cuda",
        ));
    }
    if !args.common.fail_closed && args.common.load_failure_policy != FailurePolicyArg::Fail {
        tracing::warn!(
            "--load-failure-policy only acts under --fail-closed; fail-open completes every load"
        );
    }
    Ok(())
}
