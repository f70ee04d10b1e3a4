//! `kvferry serve` (producer) and `kvferry load` (consumer) as two processes,
//! for use across machines. The producer prefills and publishes `--requests`
//! requests, then serves loads on its ZeroMQ ROUTER; the consumer loads each one.
//!
//! What a proxy would carry between them in a serving deployment (the producer's
//! block ids and token counts, vLLM's kv_transfer_params) is derived on both
//! sides from the shared `--seed`, `--requests` and token range: both replay the
//! same prompt lengths and the same block allocation.
//!
//! Request ownership: each request's load key is derived on both sides, from the shared
//! secret (`--secret-file`) when one is given (nobody without it can load a request), else
//! from `--seed`, which is not secret (open mode: ownership then holds only against clients
//! that do not know the seed; trusted networks only). Both cases are said in the info line.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_checksum::verdict::Verdict;
use kvferry_p2p::proto::consumer::{ConnectFailure, FailReason, SessionError};
use kvferry_p2p::{derive_load_key, Consumer, LoadError, LoadSpec, Producer, ReleaseReason};
use kvferry_transfer::{Secret, TransferPath};
use rand::SeedableRng;
use serde::Serialize;

use crate::cli::{LoadArgs, ServeArgs};
use crate::corrupt::Flip;
use crate::error::CliError;
use crate::loads::{consumer_config, load_groups, producer_config, prompt_lengths, LoadCounts};
use crate::models::{model_by_name, ModelShape};
use crate::setup::{
    engine_config, host_of, local_addr_towards, memory_paths, physical_memory, secret, side_config,
    side_workers,
};
use crate::world::{build_side, fill_request, request_tables, BlockPool};

/// Prompt lengths, each request's block ids, and the total block count.
type ProducerTables = (Vec<u64>, Vec<Vec<u64>>, u64);

/// What a block count may cost on this side, checked before anything is allocated: `per_block`
/// bytes per block (of `what`), and at most `limit` bytes in all (this machine's memory).
#[derive(Debug, Clone, Copy)]
struct BlockCost {
    per_block: u64,
    what: &'static str,
    limit: u64,
}

impl BlockCost {
    /// The least KV one block of `block_size` tokens of `model` takes over a whole side: every
    /// layer and head once, a state per state layer (TP replicas and page rounding add to it).
    fn kv(model: &ModelShape, block_size: u64, limit: u64) -> BlockCost {
        let state = u64::from(model.state_layers).saturating_mul(model.state_bytes);
        BlockCost {
            per_block: model
                .bytes_per_token()
                .saturating_mul(block_size)
                .saturating_add(state),
            what: "of KV",
            limit,
        }
    }

    /// Ok when `blocks` blocks fit the limit, else a usage error naming `flags` (what asked
    /// for the blocks), the bytes and the limit.
    fn check(&self, blocks: u64, flags: &str) -> Result<(), CliError> {
        match blocks.checked_mul(self.per_block) {
            Some(bytes) if bytes <= self.limit => Ok(()),
            bytes => Err(CliError::usage(format!(
                "{flags}: {blocks} blocks, {} bytes {}, more than this machine's {} bytes of memory; lower --max-tokens or --requests",
                bytes.map_or_else(|| "over 2^64".to_string(), |b| b.to_string()),
                self.what,
                self.limit
            ))),
        }
    }
}

/// The producer's block table of every request: lengths and block ids, replayed
/// identically by both roles. `cost` is what each producer block costs this side (serve holds
/// its KV; load only replays its id): a count past the limit is a usage error before the
/// block ids are allocated.
fn producer_tables(
    requests: u32,
    min: u64,
    max: u64,
    seed: u64,
    block_size: u64,
    cost: BlockCost,
) -> Result<ProducerTables, CliError> {
    if min == 0 || min > max || block_size == 0 {
        return Err(CliError::usage(format!("--min-tokens {min} / --max-tokens {max} / --block-size {block_size}: need 1 <= min <= max and a block size >= 1")));
    }
    let lengths = prompt_lengths(requests, min, max, seed);
    let flags = format!(
        "--requests {requests} of up to --max-tokens {max} tokens in blocks of {block_size}"
    );
    // The flags can ask for more blocks than a u64 counts or any machine holds: a clear
    // error here, not an overflow, an aborted allocation, or gigabytes of block ids
    // allocated before the KV allocation fails.
    let total = lengths
        .iter()
        .try_fold(0u64, |s, t| s.checked_add(t.div_ceil(block_size)));
    let Some(total) = total else {
        return Err(CliError::usage(format!(
            "{flags}: more blocks than a 64-bit count holds; lower --max-tokens or --requests"
        )));
    };
    cost.check(total, &flags)?;
    let Some(mut pool) = BlockPool::try_new(total.max(1), seed) else {
        return Err(CliError::usage(format!(
            "{flags}: {total} block ids cannot be allocated here; lower --max-tokens or --requests"
        )));
    };
    let tables = lengths
        .iter()
        .map(|t| {
            pool.alloc(t.div_ceil(block_size) as usize)
                .expect("pool sized for all requests")
        })
        .collect();
    Ok((lengths, tables, total.max(1)))
}

/// The load key of request `request_id` (see the module docs): from the shared secret, else
/// from the seed.
fn load_key(secret: Option<&Secret>, seed: u64, request_id: &str) -> Result<String, CliError> {
    let open;
    let s = match secret {
        Some(s) => s,
        None => {
            open =
                Secret::from_bytes(format!("kvferry open-mode load keys, seed {seed}").as_bytes())
                    .map_err(CliError::transfer("the open-mode load key secret"))?;
            &open
        }
    };
    Ok(derive_load_key(s, request_id))
}

/// The options that must match between `serve` and `load` (each side replays the prompts and
/// block tables from them).
const SHARED_OPTIONS: &str = "--seed, --requests, --min-tokens/--max-tokens, --model, --layout and --block-size (or --producer-block-size)";

/// The hint for a producer that cannot be reached or does not answer.
const REACH: &str =
    "is `kvferry serve` running, and is --producer its --bind address, reachable from here?";

/// The likely cause of a failed load and the options that fix it, from the error (the
/// producer's reason travels as text, so a producer ERROR is read by its words), this side's
/// secret mode, seed and `replay` options (as a command line gives them, for a refusal of other
/// prompts to show beside serve's); `None` when the error names none of the causes below, or already
/// gives the advice itself (a refused connect asks whether `kvferry serve` runs there).
pub fn load_failure_hint(
    error: &LoadError,
    has_secret: bool,
    seed: u64,
    replay: &str,
) -> Option<String> {
    let words = match error {
        LoadError::Connect { why, .. } => return connect_hint(why),
        LoadError::Failed {
            reason: FailReason::NoReply(_),
            ..
        } => return Some(REACH.to_string()),
        LoadError::Failed {
            reason: FailReason::Producer(words) | FailReason::LeaseMismatch(words),
            ..
        } => words.as_str(),
        _ => return None,
    };
    if words.contains("load key wrong") {
        // A secret mismatch fails earlier, when the sides prove the secret to each other.
        return Some(if has_secret {
            "the producer refused this side's load key, derived from --secret-file: give serve and load the same --secret-file".to_string()
        } else {
            format!("the producer refused this side's load key, derived from --seed {seed} (no --secret-file here): serve runs with another --seed; give both the same")
        });
    }
    if words.contains("does not prove the shared secret") {
        return Some(if has_secret {
            "the producer did not accept this side's --secret-file: give serve and load the same secret".to_string()
        } else {
            "serve runs with a shared secret: give load the same one (--secret-file or KVFERRY_SECRET_FILE)".to_string()
        });
    }
    if words.contains("load key missing") {
        return Some("the producer's lease needs a load key this side did not send".to_string());
    }
    if options_differ(error) {
        return Some(format!(
            "serve and load replay different prompts: they must be given the same {SHARED_OPTIONS} (this side: {replay})"
        ));
    }
    if words.contains("already loaded") {
        return Some(
            "serve serves each request once: restart `kvferry serve` to load them again"
                .to_string(),
        );
    }
    if words.contains("lease expired") {
        return Some("serve holds each request for its --lease (120 s by default) and frees it then: start load sooner, or give serve a longer --lease".to_string());
    }
    if words.contains("consumer's budget leaves less than") {
        return Some("load's --timeout leaves the producer less than its transfer deadline (half of serve's --timeout): give both the same --timeout".to_string());
    }
    None
}

/// The options of `args` that decide the prompts and block tables `load` replays, as a command
/// line gives them, to hold beside serve's when they differ.
fn replay_options(args: &LoadArgs) -> String {
    let c = &args.common;
    let producer_block = args
        .producer_block_size
        .map_or(String::new(), |b| format!(" --producer-block-size {b}"));
    format!(
        "--seed {} --requests {} --min-tokens {} --max-tokens {} --model {} --layout {:?} --block-size {}{producer_block}",
        args.seed, args.requests, args.min_tokens, args.max_tokens, c.model, c.layout, c.block_size
    )
}

/// What `load` prints of a failed load: the error, except for a load refused at once because
/// the last connect failed moments ago (`earlier`: a load before it failed, and printed why):
/// that one says so briefly instead of repeating the earlier cause and its advice.
fn failure_line(error: &LoadError, earlier: bool) -> String {
    match error {
        LoadError::Connect {
            why: ConnectFailure::Unreachable(u),
            producer,
            ..
        } if earlier => format!(
            "not tried: the last connect to {producer} failed less than {:?} ago (above)",
            u.retry_interval
        ),
        other => other.to_string(),
    }
}

/// Whether the producer refused a load because the two sides replay different prompts or
/// models from their options (a block table or a group that does not match the lease, which
/// the producer says with its typed reason, `ErrorReason::LeaseMismatch`): then every other
/// request of the run is refused the same way. A producer that gives no typed reason is not
/// taken to say so: the run goes on.
fn options_differ(error: &LoadError) -> bool {
    matches!(
        error,
        LoadError::Failed {
            reason: FailReason::LeaseMismatch(_),
            ..
        }
    )
}

/// The hint for a connect that failed with `why`: none where its message already gives the
/// advice (nothing listens there: it asks whether `kvferry serve` runs there) or the producer
/// refused the session in its own words; the secret for a producer that did not prove it
/// (directly, or as the cause of a load refused at once after it); else where to look.
fn connect_hint(why: &ConnectFailure) -> Option<String> {
    match why {
        ConnectFailure::Refused { .. } | ConnectFailure::Session(SessionError::Refused(_)) => None,
        ConnectFailure::Unreachable(u) => connect_hint(&u.why),
        ConnectFailure::Session(SessionError::Unproven) => Some(
            "the producer did not prove this side's --secret-file: serve runs with another secret or none; give both the same --secret-file".to_string(),
        ),
        _ => Some(REACH.to_string()),
    }
}

/// What protects the data path and request ownership, for the info line.
fn security_line(secret: Option<&Secret>) -> &'static str {
    if secret.is_some() {
        "authenticated (shared secret): per-load grant tokens on the data path; load keys derived from the secret"
    } else {
        "unauthenticated: any peer that reaches the ports may read and write registered memory — trusted networks only; load keys derive from --seed, which is not secret"
    }
}

/// `kvferry serve`: prefill and publish every request, then serve loads until
/// `--exit-after` loads were served (or forever).
///
/// Errors: bad arguments (an `--exit-after` above `--requests`, which could never be
/// reached: a request is loaded at most once), an address that cannot be bound, a side
/// that cannot be built.
pub fn serve(args: &ServeArgs) -> Result<(), CliError> {
    let _metrics = args
        .metrics_addr
        .as_deref()
        .map(crate::metrics_http::MetricsServer::start)
        .transpose()?;
    let c = &args.common;
    if args.exit_after > args.requests {
        return Err(CliError::usage(format!(
            "--exit-after {}: more than the {} requests published (--requests); each is loaded at most once, so serve would never exit",
            args.exit_after, args.requests
        )));
    }
    let model = model_by_name(&c.model)?.clone();
    // The producer's arena holds every request's blocks at once.
    let (lengths, tables, num_blocks) = producer_tables(
        args.requests,
        args.min_tokens,
        args.max_tokens,
        args.seed,
        c.block_size,
        BlockCost::kv(&model, c.block_size, physical_memory()),
    )?;
    let side = side_config(
        c,
        model.clone(),
        (args.tp, args.pp),
        c.block_size,
        num_blocks,
        0,
    );
    // The engines' segment names travel to peers: by default they name the host the
    // control channel binds.
    let bind_host = host_of(&args.bind);
    let unspecified = bind_host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified());
    if unspecified && c.data_host.is_none() {
        tracing::warn!(
            "--bind {}: the transfer engines listen on 127.0.0.1; pass --data-host for a consumer on another machine",
            args.bind
        );
    }
    let default_host = if unspecified { "127.0.0.1" } else { bind_host };
    let mut ranks = build_side(&side, &engine_config(c, default_host)?)?;
    let (workers, backend) = side_workers(&ranks, c, &model, c.block_size, 0)?;
    let rt = tokio::runtime::Runtime::new().map_err(CliError::Runtime)?;
    let mut cfg = producer_config(c);
    cfg.bind = format!(
        "tcp://{}",
        args.bind.strip_prefix("tcp://").unwrap_or(&args.bind)
    );
    cfg.timeouts.lease = Duration::from_secs_f64(args.lease);
    // Bound before any KV is generated: a busy port fails now, not after the whole prefill.
    let producer = rt
        .block_on(Producer::start(cfg, workers))
        .map_err(CliError::p2p(format!("--bind {}", args.bind)))?;
    let secret = secret(c)?;
    eprintln!("kvferry serve: listening on {}", producer.endpoint());
    // Said right before the work, so that a failure after it shows the KV was being generated.
    eprintln!(
        "kvferry serve: generating {} requests of model-shaped KV (seeded random bytes) and publishing each",
        args.requests
    );
    for (i, (blocks, &tokens)) in tables.iter().zip(&lengths).enumerate() {
        for r in ranks.iter_mut() {
            fill_request(r, args.seed, i as u64, blocks)?;
        }
        let id = format!("req-{i}");
        rt.block_on(producer.publish_with_key(
            &id,
            request_tables(&model, blocks, tokens, c.block_size),
            tokens,
            &load_key(secret.as_ref(), args.seed, &id)?,
        ))
        .map_err(CliError::p2p(format!("publishing {id}")))?;
    }
    eprintln!(
        "kvferry serve: {} requests published on {} (transport {}, checksums on {backend}, lease {} s); {}",
        args.requests,
        producer.endpoint(),
        ranks[0].engine.transport_name(),
        args.lease,
        security_line(secret.as_ref())
    );
    // Every released lease counts towards --exit-after; the summary says how each ended.
    let (mut served, mut failed, mut expired) = (0u32, 0u32, 0u32);
    loop {
        std::thread::sleep(Duration::from_millis(50));
        for r in producer.released() {
            match r.reason {
                ReleaseReason::Served => served += 1,
                ReleaseReason::Failed(_) => failed += 1,
                ReleaseReason::Expired => expired += 1,
            }
        }
        if args.exit_after > 0 && served + failed + expired >= args.exit_after {
            break;
        }
    }
    rt.block_on(producer.shutdown());
    eprintln!(
        "kvferry serve: {served} loads served, {failed} failed, {expired} expired unloaded; exiting"
    );
    Ok(())
}

/// Result of `kvferry load`, printed as JSON with `--json`.
#[derive(Debug, Default, Serialize)]
pub struct LoadReport {
    /// What carried the KV ([`carried_by`]): the path the producer's FINISH names
    /// (`cuda-ipc`, `tcp` or `rdma`), `mixed` when loads named different ones, or this side's
    /// network transport when none named one (an older producer, or no load finished).
    pub transport: String,
    /// The network transport this side's engine uses (`tcp` or `rdma`).
    pub network_transport: String,
    /// The registration paths of this side's KV memory ([`memory_paths`]).
    pub memory_paths: Vec<String>,
    /// Requests loaded.
    pub requests: u32,
    /// Verdict and action counts (top-level JSON fields).
    #[serde(flatten)]
    pub counts: LoadCounts,
    /// KV bytes moved.
    pub bytes: u64,
    /// Wall seconds of the loads.
    pub seconds: f64,
    /// Seconds opening the control connection and the session took before the first load
    /// (not in `seconds`; a connect that failed is the first load's to report).
    pub connect_seconds: f64,
    /// bytes / seconds in GB/s.
    pub gb_per_s: f64,
    /// Loads given a flipped bit (`--corrupt`).
    pub corrupted: u32,
    /// Of those, the ones whose verdict was a mismatch (the rest went unnoticed or failed).
    pub caught: u32,
}

/// What carried a run's KV: the one path its loads' FINISHes named, `mixed` for several, or
/// `network` (the engine's transport) when none named one.
pub fn carried_by(paths: &[TransferPath], network: &str) -> String {
    match paths.split_first() {
        None => network.to_string(),
        Some((first, rest)) if rest.iter().all(|p| p == first) => first.to_string(),
        Some(_) => "mixed".to_string(),
    }
}

/// `kvferry load`: load every request from a `kvferry serve` producer and verify it.
///
/// Errors: bad arguments, a side that cannot be built. Failed loads are counted, not errors.
pub fn load(args: &LoadArgs) -> Result<(), CliError> {
    let metrics = args
        .metrics_addr
        .as_deref()
        .map(crate::metrics_http::MetricsServer::start)
        .transpose()?;
    let c = &args.common;
    let model = model_by_name(&c.model)?.clone();
    // The producer's tables are replayed with its block size; this side's blocks have its own.
    let producer_block_size = args.producer_block_size.unwrap_or(c.block_size);
    if c.block_size == 0 {
        return Err(CliError::usage("--block-size 0: must be at least 1"));
    }
    // This side's arena holds the longest request's blocks, checked first; the producer's
    // tables are only replayed here (8 bytes per block id: the producer's KV is on its machine).
    let limit = physical_memory();
    let max_blocks = args.max_tokens.div_ceil(c.block_size);
    BlockCost::kv(&model, c.block_size, limit).check(
        max_blocks,
        &format!(
            "--max-tokens {} in blocks of {} (the longest request, loaded here)",
            args.max_tokens, c.block_size
        ),
    )?;
    let ids = BlockCost {
        per_block: 8,
        what: "of the producer's block ids replayed",
        limit,
    };
    let (lengths, tables, _) = producer_tables(
        args.requests,
        args.min_tokens,
        args.max_tokens,
        args.seed,
        producer_block_size,
        ids,
    )?;
    let max_blocks = lengths
        .iter()
        .map(|t| t.div_ceil(c.block_size))
        .max()
        .unwrap_or(1);
    let side = side_config(
        c,
        model.clone(),
        (args.tp, args.pp),
        c.block_size,
        max_blocks,
        0,
    );
    // The producer WRITEs into this side's memory: its engines must be reachable from it.
    let default_host =
        local_addr_towards(&args.producer).unwrap_or_else(|| "127.0.0.1".to_string());
    if args.corrupt > args.requests {
        return Err(CliError::usage(format!(
            "--corrupt {}: at most --requests ({})",
            args.corrupt, args.requests
        )));
    }
    let ranks = build_side(&side, &engine_config(c, &default_host)?)?;
    let (workers, _) = side_workers(&ranks, c, &model, c.block_size, 0)?;
    let network_transport = ranks[0].engine.transport_name().to_string();
    let memory_paths = memory_paths(&ranks);
    let mut carried = Vec::new();
    let rt = tokio::runtime::Runtime::new().map_err(CliError::Runtime)?;
    let consumer = Consumer::new(consumer_config(c), workers)
        .map_err(CliError::p2p("starting the consumer"))?;
    let producer = if args.producer.starts_with("tcp://") {
        args.producer.clone()
    } else {
        format!("tcp://{}", args.producer)
    };
    // The control connection and the session are opened now, as the demo opens them and a
    // decode instance does when it starts, so that the first load's time is a load's. A
    // failure is the first load's to report (it is refused at once, naming this cause).
    let t = Instant::now();
    if let Err(e) = rt.block_on(consumer.connect(&producer)) {
        tracing::debug!("connecting to {producer} ahead of the loads failed: {e}");
    }
    let connect_seconds = t.elapsed().as_secs_f64();
    // Fault injection: the landed hook flips one bit of the chosen loads.
    let ranks = Arc::new(Mutex::new(ranks));
    let pending_flip = crate::corrupt::install_hook(&consumer, ranks.clone());
    let mut rng = rand::rngs::SmallRng::seed_from_u64(args.seed ^ 0xc0ff_ee00);
    let corrupt = crate::corrupt::choose(&mut rng, args.requests, args.corrupt);
    let mut report = LoadReport {
        network_transport,
        memory_paths,
        connect_seconds,
        requests: args.requests,
        corrupted: args.corrupt,
        ..LoadReport::default()
    };
    let local: Vec<u64> = (0..max_blocks).collect();
    let secret = secret(c)?;
    eprintln!("kvferry load: {}", security_line(secret.as_ref()));
    for (i, (blocks, &tokens)) in tables.iter().zip(&lengths).enumerate() {
        let spec = LoadSpec {
            load_key: Some(load_key(secret.as_ref(), args.seed, &format!("req-{i}"))?),
            request_id: format!("req-{i}"),
            producer: producer.clone(),
            groups: {
                let local = &local[..tokens.div_ceil(c.block_size) as usize];
                let remote = request_tables(&model, blocks, tokens, producer_block_size);
                let local = request_tables(&model, local, tokens, c.block_size);
                load_groups(&model, &remote, &local, producer_block_size)
            },
            num_local_computed: 0,
            num_tokens: tokens,
        };
        let corrupted = corrupt.contains(&(i as u32));
        if corrupted {
            let local = &local[..tokens.div_ceil(c.block_size) as usize];
            let flip = Flip::random(
                &mut rng,
                &model,
                &ranks.lock().unwrap(),
                local,
                tokens,
                c.block_size,
            );
            pending_flip.arm(&spec.request_id, flip);
        }
        let request_id = spec.request_id.clone();
        let t = Instant::now();
        let outcome = rt.block_on(consumer.load(spec));
        report.seconds += t.elapsed().as_secs_f64();
        // A flip not applied (the load failed before landing) must not stay armed.
        pending_flip.take(&request_id);
        match outcome {
            Ok(o) => {
                report.bytes += o.bytes;
                carried.extend(o.path);
                report.counts.record(o.verdict.as_ref(), o.action);
                if corrupted && matches!(o.verdict, Some(Verdict::Mismatch { .. })) {
                    report.caught += 1;
                }
            }
            Err(e) => {
                eprintln!(
                    "kvferry load: req-{i}: {}",
                    failure_line(&e, report.counts.failed > 0)
                );
                // Once, at the first failure: the likely cause and the options that fix it.
                let hint =
                    load_failure_hint(&e, secret.is_some(), args.seed, &replay_options(args));
                if let (0, Some(h)) = (report.counts.failed, hint) {
                    eprintln!("kvferry load: {h}");
                }
                report.counts.failed += 1;
                // The rest would be refused the same way, each after its wait for a publish
                // where serve has fewer requests: counted failed, not tried.
                let rest = args.requests - i as u32 - 1;
                if options_differ(&e) && rest > 0 {
                    eprintln!("kvferry load: the other {rest} requests not tried: the producer would refuse them the same way");
                    report.counts.failed += rest;
                    break;
                }
            }
        }
    }
    report.transport = carried_by(&carried, &report.network_transport);
    report.gb_per_s = if report.seconds > 0.0 {
        report.bytes as f64 / report.seconds / 1e9
    } else {
        0.0
    };
    // A corrupted load is as expected when it ended as a mismatch.
    let bad = report.requests - report.counts.verified - report.caught;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "kvferry load: {} requests over {}: {} verified, {} mismatch, {} unverified, {} failed, {} recomputed; {:.2} GB in {:.3} s ({:.2} GB/s)",
            report.requests, report.transport, report.counts.verified, report.counts.mismatch, report.counts.unverified, report.counts.failed, report.counts.recomputed,
            report.bytes as f64 / 1e9, report.seconds, report.gb_per_s
        );
    }
    if let (Some(_), Some(linger)) = (&metrics, args.metrics_linger) {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::thread::sleep(Duration::from_secs_f64(linger));
    }
    if bad > 0 {
        return Err(CliError::failed(format!(
            "{bad} of {} loads were not verified{}",
            report.requests,
            if report.corrupted > 0 {
                " (corrupted loads caught as a mismatch not counted)"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `load --json`'s `transport` says what carried the KV (as the demo's does), not the
    /// engine's network transport.
    #[test]
    fn the_transport_is_the_path_the_finishes_name() {
        use TransferPath::{CudaIpc, Tcp};
        assert_eq!(carried_by(&[CudaIpc, CudaIpc], "tcp"), "cuda-ipc");
        assert_eq!(carried_by(&[Tcp], "tcp"), "tcp");
        assert_eq!(carried_by(&[CudaIpc, Tcp], "tcp"), "mixed");
        assert_eq!(carried_by(&[], "rdma"), "rdma");
    }

    #[test]
    fn block_counts_no_machine_holds_are_a_usage_error_not_a_panic() {
        // One request of u64::MAX blocks; four whose sum overflows; 2^63 block ids.
        let ids = BlockCost {
            per_block: 8,
            what: "of ids",
            limit: u64::MAX,
        };
        for (requests, tokens) in [(1, u64::MAX), (4, u64::MAX), (2, 1 << 62)] {
            assert!(
                matches!(
                    producer_tables(requests, tokens, tokens, 1, 1, ids),
                    Err(CliError::Usage(_))
                ),
                "{requests} × {tokens}"
            );
        }
        let (_, tables, total) = producer_tables(2, 10, 10, 1, 4, ids).unwrap();
        assert_eq!((tables.len(), total), (2, 6));
    }

    #[test]
    fn a_block_count_whose_kv_exceeds_the_memory_is_refused_before_any_allocation() {
        let tiny = model_by_name("tiny").unwrap();
        // 2 requests of 1000 tokens: 126 blocks of 16 tokens, 32 KiB of tiny's KV each.
        let cost = BlockCost::kv(tiny, 16, 4_000_000);
        let e = producer_tables(2, 1000, 1000, 1, 16, cost).map(|_| ());
        let Err(CliError::Usage(text)) = e else {
            panic!("{e:?}")
        };
        assert!(
            text.contains("--max-tokens 1000")
                && text.contains(&(126u64 * 32768).to_string())
                && text.contains("4000000 bytes of memory"),
            "{text}"
        );
        // What fits is allocated; block ids are 8 bytes each, whatever the model.
        assert!(producer_tables(2, 1000, 1000, 1, 16, BlockCost::kv(tiny, 16, 8 << 20)).is_ok());
        let ids = BlockCost {
            per_block: 8,
            what: "of ids",
            limit: 126 * 8,
        };
        assert!(producer_tables(2, 1000, 1000, 1, 16, ids).is_ok());
        let one_less = BlockCost {
            limit: 126 * 8 - 1,
            ..ids
        };
        assert!(producer_tables(2, 1000, 1000, 1, 16, one_less).is_err());
        // A count whose bytes pass 2^64 is refused, not wrapped.
        let e = BlockCost::kv(tiny, 16, u64::MAX).check(u64::MAX / 2, "--max-tokens");
        assert!(matches!(e, Err(CliError::Usage(t)) if t.contains("over 2^64")));
    }

    #[test]
    fn this_machine_reports_its_memory() {
        let m = physical_memory();
        assert!((1 << 20..u64::MAX).contains(&m), "{m}");
    }

    /// A producer ERROR with `words`, as a load gets it.
    fn producer_error(words: &str) -> LoadError {
        LoadError::Failed {
            request_id: "req-0".into(),
            reason: FailReason::Producer(kvferry_transfer::PeerText::from_bytes(words.as_bytes())),
        }
    }

    /// The hint for other prompts gives this side's values of every option serve must share.
    #[test]
    fn a_refusal_for_other_prompts_names_this_sides_options() {
        use crate::cli::{Cli, Command};
        use clap::Parser;
        let argv = [
            "kvferry",
            "load",
            "--producer",
            "h:1",
            "--model",
            "tiny-hybrid",
        ];
        let Command::Load(args) = Cli::try_parse_from(argv).unwrap().command else {
            unreachable!()
        };
        let replay = replay_options(&args);
        assert_eq!(
            replay,
            "--seed 1 --requests 8 --min-tokens 100 --max-tokens 4000 --model tiny-hybrid \
             --layout \"KV B N H D\" --block-size 16"
        );
        let e = mismatch_error("layer model.layers.0.self_attn.attn: head size differ");
        let hint = load_failure_hint(&e, false, 1, &replay).unwrap_or_default();
        assert!(hint.contains("this side: --seed 1 --requests 8"), "{hint}");
        assert!(hint.contains("--model tiny-hybrid"), "{hint}");
    }

    #[test]
    fn a_group_the_producer_never_published_names_the_shared_options() {
        // What a load with another --model than serve's gets (a hybrid model's second group).
        let e = mismatch_error("transfer failed: group 1 was not published");
        let hint = load_failure_hint(&e, false, 1, "--seed 1 --requests 2").unwrap_or_default();
        assert!(
            hint.contains("replay different prompts") && hint.contains("--model"),
            "{hint}"
        );
    }

    /// A producer ERROR with `words` and the typed reason of a request that does not match
    /// the lease.
    fn mismatch_error(words: &str) -> LoadError {
        LoadError::Failed {
            request_id: "req-0".into(),
            reason: FailReason::LeaseMismatch(kvferry_transfer::PeerText::from_bytes(
                words.as_bytes(),
            )),
        }
    }

    #[test]
    fn only_a_refusal_for_other_prompts_says_the_options_differ() {
        let words = "request refused, nothing written: group 1 was not published";
        assert!(options_differ(&mismatch_error(words)));
        // The words alone decide nothing: without the typed reason (an older producer, or
        // a refusal that only reads alike) the run goes on.
        assert!(!options_differ(&producer_error(words)));
        let late = "request \"req-4\" was not published in time (publish wait 30s or the consumer's budget)";
        assert!(!options_differ(&producer_error(late)));
        assert!(!options_differ(&producer_error("lease expired after 120s")));
        // The hint names the shared options either way it is told.
        let hint = load_failure_hint(&mismatch_error(words), false, 1, "--seed 1 --requests 2")
            .unwrap_or_default();
        assert!(hint.contains("replay different prompts"), "{hint}");
    }

    #[test]
    fn a_load_of_requests_already_served_or_expired_is_told_why() {
        let again = producer_error("request \"req-0\": already loaded (KV is never fetched twice)");
        let hint = load_failure_hint(&again, false, 1, "--seed 1 --requests 1").unwrap_or_default();
        assert!(hint.contains("restart `kvferry serve`"), "{hint}");
        let late =
            producer_error("request \"req-0\": lease expired after 120s; its blocks were freed");
        let hint = load_failure_hint(&late, false, 1, "--seed 1 --requests 1").unwrap_or_default();
        assert!(hint.contains("--lease"), "{hint}");
    }

    #[test]
    fn a_load_without_the_producers_secret_is_told_to_give_it() {
        let e = producer_error("the request does not prove the shared secret over this session");
        let hint = load_failure_hint(&e, false, 1, "--seed 1 --requests 1").unwrap_or_default();
        assert!(hint.contains("KVFERRY_SECRET_FILE"), "{hint}");
        let hint = load_failure_hint(&e, true, 1, "--seed 1 --requests 1").unwrap_or_default();
        assert!(hint.contains("the same secret"), "{hint}");
    }

    #[test]
    fn a_refused_connect_is_not_given_the_advice_its_message_already_gives() {
        let connect = |why| LoadError::Connect {
            request_id: "req-0".into(),
            producer: "tcp://127.0.0.1:9".into(),
            why,
        };
        let refused = ConnectFailure::Refused {
            addr: "127.0.0.1:9".into(),
            waited: Duration::from_secs(2),
        };
        // The message asks whether serve runs there; a hint asking again would repeat it.
        assert!(connect(refused.clone())
            .to_string()
            .contains("kvferry serve"));
        assert_eq!(
            load_failure_hint(&connect(refused.clone()), false, 1, "--seed 1 --requests 1"),
            None
        );
        let after = ConnectFailure::Unreachable(kvferry_p2p::proto::consumer::Unreachable {
            retry_interval: Duration::from_secs(1),
            why: Box::new(refused.clone()),
        });
        assert_eq!(
            load_failure_hint(&connect(after.clone()), false, 1, "--seed 1 --requests 1"),
            None
        );
        // The loads refused at once after it say so briefly, without the cause again.
        let first = failure_line(&connect(refused.clone()), false);
        let next = failure_line(&connect(after.clone()), true);
        assert!(first.contains("kvferry serve"), "{first}");
        assert!(
            !next.contains("kvferry serve") && next.contains("not tried"),
            "{next}"
        );
        assert!(failure_line(&connect(after), false).contains("kvferry serve"));
        // A producer with another secret: the secret, not whether serve runs.
        let unproven = connect(ConnectFailure::Session(SessionError::Unproven));
        let hint =
            load_failure_hint(&unproven, true, 1, "--seed 1 --requests 1").unwrap_or_default();
        assert!(
            hint.contains("--secret-file") && !hint.contains("running"),
            "{hint}"
        );
        // A connect that only timed out says nothing of serve: the hint does.
        let timeout = connect(ConnectFailure::Timeout(Duration::from_secs(2)));
        assert!(!timeout.to_string().contains("kvferry serve"));
        let hint =
            load_failure_hint(&timeout, false, 1, "--seed 1 --requests 1").unwrap_or_default();
        assert!(hint.contains("kvferry serve"), "{hint}");
    }
}
