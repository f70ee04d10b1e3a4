//! `kvferry demo`: the main job. A producer (prefill) and a consumer (decode),
//! each a TP×PP grid of ranks with its own KV memory and transfer engine, talk
//! only through loopback sockets (ZeroMQ control channel + the transfer engine).
//! For each request the producer "prefills" (seeded pseudo-random KV), publishes
//! (checksums now), the consumer loads (the producer WRITEs, replies with the
//! payload), the consumer verifies, the policy decides.
//!
//! Sources: docs/design.md §4 (flow), §2.7 (policy), §6 (the CLI).

mod args;
pub mod pools;

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use kvferry_checksum::policy::Action;
use kvferry_checksum::verdict::Verdict;
use kvferry_p2p::{Consumer, LoadError, LoadOutcome, LoadSpec, Producer, ProducerConfig};
use kvferry_transfer::sync::MutexExt;
use rand::SeedableRng;

mod report;

use report::print_summary;
pub use report::DemoReport;

use crate::cli::{DemoArgs, DeviceArg};
use crate::copy_ref::{copy_rate, device_copy_rate};
use crate::corrupt::Flip;
use crate::error::CliError;
use crate::loads::{consumer_config, load_groups, producer_config, prompt_lengths};
use crate::models::STATE_GROUP;
use crate::models::{model_by_name, ModelShape};
use crate::setup::{
    device_free_memory, engine_config, memory_paths, physical_memory, side_config, side_workers,
    transfer_path,
};
use crate::world::{
    build_side, fill_request, request_tables, sides_kv_equal, BlockPool, RankKv, WorldError,
};

/// Runs the demo and prints its report.
///
/// Errors: bad arguments, a side that cannot be built, a producer that cannot start.
pub fn run(args: &DemoArgs) -> Result<(), CliError> {
    let report = run_report(args)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_summary(&report);
    }
    if report.unexpected > 0 {
        return Err(CliError::failed(format!(
            "{} of {} loads did not end as expected (see the log)",
            report.unexpected, report.requests
        )));
    }
    Ok(())
}

/// Tokio worker threads for `in_flight` loads on a machine of `available` cores: two per load
/// in flight (the consumer's loading task and the producer's serving task of each load do host
/// work at once), at least 2 (serial loads keep the runtime they always had) and at most the
/// cores (many loads in flight are bound by that host work, not by the device).
pub fn runtime_workers(in_flight: u32, available: usize) -> usize {
    (2 * in_flight as usize).clamp(2, available.max(2))
}

/// `--in-flight`, else its default for the device: 16 with `--device cuda` (a load's host work
/// takes about ten times its device copy over CUDA IPC), 4 on the host (the copies bound it, as
/// the transfer engine's bench keeps 4 batches in flight); at most the requests.
fn in_flight_of(args: &DemoArgs) -> u32 {
    let default = match args.common.device {
        DeviceArg::Cuda => 16,
        DeviceArg::Cpu => 4,
    };
    args.in_flight
        .unwrap_or(default)
        .clamp(1, args.requests.max(1))
}

/// One request of a stage: its blocks on both sides, what it was given and how it is loaded.
struct Request {
    index: u32,
    tokens: u64,
    pblocks: Vec<u64>,
    cblocks: Vec<u64>,
    /// The flipped bit's (group, token), when the request was corrupted.
    flipped: Option<(u32, u64)>,
    spec: LoadSpec,
}

/// Runs the demo and returns its report (the tests use this).
///
/// Requests go in stages: the producer fills and publishes as many requests as both sides'
/// block pools hold (sized by `--pool-memory` or its default share of memory: all the requests
/// when they fit, at most [`pools::MAX_STAGE_REQUESTS`]), then the consumer loads them keeping
/// `--in-flight` loads in flight (each on its own task, the next one started as one ends),
/// then each outcome is checked and the blocks are freed. The load phase's time is the sum of
/// the stages' wall times: prefill, publish and the checks are not in it.
///
/// Errors: as [`run`]; [`CliError::PoolBudget`] when a side's pool cannot hold the longest
/// request.
pub fn run_report(args: &DemoArgs) -> Result<DemoReport, CliError> {
    args::check_args(args)?;
    let c = &args.common;
    let model = model_by_name(&c.model)?.clone();
    let lengths = prompt_lengths(args.requests, args.min_tokens, args.max_tokens, args.seed);
    let pbs = args.prefill_block_size.unwrap_or(c.block_size);
    let cbs = args.decode_block_size.unwrap_or(c.block_size);
    let in_flight = in_flight_of(args);
    const PRODUCER: &str = "producer (--prefill-tp/--prefill-pp/--prefill-block-size)";
    const CONSUMER: &str = "consumer (--decode-tp/--decode-pp/--decode-block-size)";
    let prod_blocks = side_pool(
        args,
        &model,
        &lengths,
        (args.prefill_tp, pbs, args.prefill_gpu),
        PRODUCER,
    )?;
    let cons_blocks = side_pool(
        args,
        &model,
        &lengths,
        (args.decode_tp, cbs, args.decode_gpu),
        CONSUMER,
    )?;
    let engine_cfg = engine_config(c, "127.0.0.1")?;
    let side = |tp, pp, bs, n, gpu| side_config(c, model.clone(), (tp, pp), bs, n, gpu);
    // Name the side: the sizes and the layout checks are per side.
    if !args.json {
        eprintln!(
            "kvferry demo: {} requests of {}-shaped KV (seeded random bytes), {} in flight, producer TP{}×PP{} → consumer TP{}×PP{} on loopback",
            args.requests, model.name, in_flight, args.prefill_tp, args.prefill_pp, args.decode_tp, args.decode_pp
        );
    }
    let mut prod_ranks = build_side(
        &side(
            args.prefill_tp,
            args.prefill_pp,
            pbs,
            prod_blocks,
            args.prefill_gpu,
        ),
        &engine_cfg,
    )
    .map_err(side_error(PRODUCER))?;
    let cons_ranks = build_side(
        &side(
            args.decode_tp,
            args.decode_pp,
            cbs,
            cons_blocks,
            args.decode_gpu,
        ),
        &engine_cfg,
    )
    .map_err(side_error(CONSUMER))?;
    check_grants(&cons_ranks, &lengths, cbs, args.max_tokens)?;
    let transport_name = prod_ranks[0].engine.transport_name().to_string();
    let path = transfer_path(&prod_ranks[0], &cons_ranks[0]);
    let mut paths = memory_paths(&prod_ranks);
    for p in memory_paths(&cons_ranks) {
        if !paths.contains(&p) {
            paths.push(p);
        }
    }
    let (prod_workers, backend_name) = side_workers(&prod_ranks, c, &model, pbs, args.prefill_gpu)?;
    let (cons_workers, _) = side_workers(&cons_ranks, c, &model, cbs, args.decode_gpu)?;

    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let threads = runtime_workers(in_flight, cores);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;

    // Which requests get a flipped bit, and where.
    let mut rng = rand::rngs::SmallRng::seed_from_u64(args.seed ^ 0xc0ff_ee00);
    let corrupt = crate::corrupt::choose(&mut rng, args.requests, args.corrupt);

    let producer = rt
        .block_on(Producer::start(
            demo_producer_config(args, in_flight as usize),
            prod_workers,
        ))
        .map_err(CliError::p2p("starting the producer"))?;
    let endpoint = producer.endpoint().to_string();
    let consumer = Arc::new(
        Consumer::new(consumer_config(c), cons_workers)
            .map_err(CliError::p2p("starting the consumer"))?,
    );

    let mut prod_pool = BlockPool::new(prod_blocks, args.seed);
    let mut cons_pool = BlockPool::new(cons_blocks, args.seed ^ 1);
    let mut report = DemoReport {
        transport: path.clone(),
        network_transport: transport_name,
        memory_paths: paths,
        transfer_path: path,
        checksum_backend: backend_name,
        model: model.name.to_string(),
        prefill_tp: args.prefill_tp,
        prefill_pp: args.prefill_pp,
        decode_tp: args.decode_tp,
        decode_pp: args.decode_pp,
        prefill_block_size: pbs,
        decode_block_size: cbs,
        requests: args.requests,
        in_flight,
        runtime_workers: threads as u32,
        ..DemoReport::default()
    };
    // A bar on a terminal; elsewhere (a pipe, a CI log) a line every eighth of the loads.
    let tty = std::io::stderr().is_terminal();
    let bar = if tty && !args.json {
        let b = ProgressBar::new(args.requests as u64);
        b.set_style(
            ProgressStyle::with_template("{spinner} {bar:40} {pos}/{len} loads {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let line_every = (args.requests / 8).max(1);
    let mut checks = Checks::default();
    let mut latencies: Vec<f64> = Vec::with_capacity(args.requests as usize);
    let mut done = 0u32;
    // What the first load would otherwise set up is set up now, outside the load phase, as a
    // serving pair does when it starts: the producer's engines open the consumer's segments
    // (importing its memory, with CUDA IPC) and the consumer opens its session.
    for p in &prod_ranks {
        for c in cons_ranks.iter() {
            let name = c.engine.segment_name();
            if let Err(e) = p.engine.open_segment(&name) {
                tracing::warn!(segment = %name, "producer: opening the consumer's segment ahead of the loads failed ({e}); the first load opens it");
            }
        }
    }
    if let Err(e) = rt.block_on(consumer.connect(&endpoint)) {
        tracing::warn!("consumer: connecting to the producer ahead of the loads failed ({e}); the first load connects");
    }
    // The consumer's memory, shared with the landed hook (fault injection).
    let cons_ranks = Arc::new(Mutex::new(cons_ranks));
    let pending_flips = crate::corrupt::install_hook(&consumer, cons_ranks.clone());
    let mut next = 0usize;
    while next < lengths.len() {
        // Prefill as many requests as both sides' blocks hold, then publish them (neither
        // part of the load phase's time). All are prefilled first so that a lease runs only
        // through steps with deadlines: the stage's other publishes and its loads
        // ([`demo_producer_config`]).
        let mut prefilled = Vec::new();
        while let Some(&tokens) = lengths
            .get(next)
            .filter(|_| prefilled.len() < pools::MAX_STAGE_REQUESTS)
        {
            let Some((pblocks, cblocks)) = take_blocks(
                &mut prod_pool,
                &mut cons_pool,
                tokens.div_ceil(pbs) as usize,
                tokens.div_ceil(cbs) as usize,
            ) else {
                break;
            };
            let i = next as u32;
            next += 1;
            let t0 = Instant::now();
            for r in prod_ranks.iter_mut() {
                fill_request(r, args.seed, i as u64, &pblocks)?;
            }
            report.prefill_seconds += t0.elapsed().as_secs_f64();
            prefilled.push((i, tokens, pblocks, cblocks));
        }
        let mut requests = Vec::with_capacity(prefilled.len());
        for (i, tokens, pblocks, cblocks) in prefilled {
            let request_id = format!("req-{i}");
            let (ptables, ctables) = (
                request_tables(&model, &pblocks, tokens, pbs),
                request_tables(&model, &cblocks, tokens, cbs),
            );
            let info = rt
                .block_on(producer.publish(&request_id, ptables.clone(), tokens))
                .map_err(CliError::p2p(format!("publishing {request_id}")))?;
            report.checksum_seconds += info.checksum_seconds;
            let mut flipped = None;
            if corrupt.contains(&i) {
                let ranks = cons_ranks.locked();
                let flip = Flip::random(&mut rng, &model, &ranks, &cblocks, tokens, cbs);
                flipped = Some((flip.group, flip.token));
                pending_flips.arm(&request_id, flip);
                report.corrupted += 1;
            }
            let spec = LoadSpec {
                request_id,
                producer: endpoint.clone(),
                groups: load_groups(&model, &ptables, &ctables, pbs),
                num_local_computed: 0,
                num_tokens: tokens,
                load_key: Some(info.load_key.clone()),
            };
            requests.push(Request {
                index: i,
                tokens,
                pblocks,
                cblocks,
                flipped,
                spec,
            });
        }
        if requests.is_empty() {
            return Err(CliError::failed("block pool exhausted"));
        }
        report.stages += 1;
        // Load them `in_flight` at a time, the next one started as one ends.
        let specs: Vec<LoadSpec> = requests.iter().map(|r| r.spec.clone()).collect();
        let t1 = Instant::now();
        let outcomes = rt.block_on(load_window(&consumer, specs, in_flight as usize));
        report.seconds += t1.elapsed().as_secs_f64();
        for (req, (outcome, load_seconds)) in requests.into_iter().zip(outcomes) {
            // A flip not applied (the load failed before landing) must not stay armed.
            pending_flips.take(&req.spec.request_id);
            latencies.push(load_seconds);
            report.tokens += req.tokens;
            checks.outcome(
                &mut report,
                Landing {
                    args,
                    model: &model,
                    prod_ranks: &mut prod_ranks,
                    cons_ranks: &cons_ranks,
                    pbs,
                    cbs,
                },
                &req,
                outcome,
                load_seconds,
            )?;
            cons_pool.free(&req.cblocks);
            // The load is over (served, failed or refused): the producer's blocks can be reused.
            prod_pool.free(&req.pblocks);
            bar.inc(1);
            bar.set_message(format!("{} verified", report.counts.verified));
            done += 1;
            if !tty && !args.json && (done.is_multiple_of(line_every) || done == args.requests) {
                eprintln!(
                    "kvferry demo: {done}/{} loads, {} verified",
                    args.requests, report.counts.verified
                );
            }
        }
    }
    bar.finish_and_clear();
    rt.block_on(producer.shutdown());
    report.kv_equal_after_recompute = checks.kv_equal;
    report.gb_per_s = if report.seconds > 0.0 {
        report.bytes as f64 / report.seconds / 1e9
    } else {
        0.0
    };
    (report.verify_share_median, report.verify_share_max) = median_max(&mut checks.shares);
    (report.load_seconds_median, report.load_seconds_max) = median_max(&mut latencies);
    (report.copy_gb_per_s, report.copy_reference) = match c.device {
        DeviceArg::Cpu => (copy_rate(report.bytes), "host memcpy".into()),
        DeviceArg::Cuda => {
            let per_load = report.bytes / u64::from(report.requests.max(1));
            let rate = device_copy_rate(per_load, args.decode_gpu).unwrap_or_else(|e| {
                tracing::warn!("device copy reference: {e}");
                0.0
            });
            (rate, "device copy".into())
        }
    };
    Ok(report)
}

/// Room for a publish's waits besides its checksums (the producer loop's answer, 10 s at most).
const PUBLISH_MARGIN: Duration = Duration::from_secs(15);

/// The demo's producer settings: [`producer_config`] with a lease sized by a stage. A stage
/// publishes up to [`pools::MAX_STAGE_REQUESTS`] requests (all prefilled before the first
/// publish), then loads them `in_flight` at a time; the lease taken at a request's publish
/// must outlast the stage's later publishes (each within the producer's checksum deadline and
/// [`PUBLISH_MARGIN`]) and the loads before and including its own (each within the consumer's
/// load deadline). On a slow link a stage outlives the default lease (1024 loads of 2 s, 16 in
/// flight, take 128 s), and the last loads would find their blocks freed. Leases only guard
/// against a consumer that never comes; the demo's consumer loads every request it published.
fn demo_producer_config(args: &DemoArgs, in_flight: usize) -> ProducerConfig {
    let mut cfg = producer_config(&args.common);
    let stage = (args.requests as usize).min(pools::MAX_STAGE_REQUESTS) as u32;
    let rounds = stage.div_ceil(in_flight.max(1) as u32);
    let load = consumer_config(&args.common).load_deadline();
    let publish = cfg.checksum_timeout + PUBLISH_MARGIN;
    let stage_bound = load * rounds + publish * stage;
    cfg.timeouts.lease = cfg.timeouts.lease.max(stage_bound);
    cfg
}

/// The median (the upper one of an even count) and the largest of `v` (sorted in place);
/// zeros when empty.
fn median_max(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (
        v.get(v.len() / 2).copied().unwrap_or(0.0),
        v.last().copied().unwrap_or(0.0),
    )
}

/// Loads `specs` keeping `window` (at least 1) loads in flight, each on a task of its own: the
/// next one starts as soon as one ends. Returns each outcome with its load's seconds, in the
/// order of `specs`: the time of the `Consumer::load` call on its task, as an embedder that
/// awaits it sees it (the task's spawn and join are this harness's, not the load's). A task
/// that ended without an outcome (it panicked) is a failed load, timed from its spawn.
async fn load_window(
    consumer: &Arc<Consumer>,
    specs: Vec<LoadSpec>,
    window: usize,
) -> Vec<(LoadEnd, f64)> {
    use std::collections::HashMap;
    let n = specs.len();
    let mut out: Vec<Option<(LoadEnd, f64)>> = (0..n).map(|_| None).collect();
    let mut tasks = tokio::task::JoinSet::new();
    // Task id → (index in `specs`, start): a task that panicked is known by its id alone.
    let mut started = HashMap::new();
    let mut queue = specs.into_iter().enumerate();
    type Started = HashMap<tokio::task::Id, (usize, Instant)>;
    let start = |tasks: &mut tokio::task::JoinSet<_>,
                 started: &mut Started,
                 (i, spec): (usize, LoadSpec)| {
        let consumer = consumer.clone();
        let t = Instant::now();
        let h = tasks.spawn(async move {
            let t = Instant::now();
            let o = consumer.load(spec).await;
            (o, t.elapsed().as_secs_f64())
        });
        started.insert(h.id(), (i, t));
    };
    for item in queue.by_ref().take(window.max(1)) {
        start(&mut tasks, &mut started, item);
    }
    while let Some(joined) = tasks.join_next_with_id().await {
        let (id, end) = match joined {
            Ok((id, (o, seconds))) => (id, Ok((o, seconds))),
            Err(e) => (e.id(), Err(Some(e))),
        };
        if let Some((i, t)) = started.remove(&id) {
            out[i] = Some(match end {
                Ok((o, seconds)) => (Ok(o), seconds),
                Err(e) => (Err(e), t.elapsed().as_secs_f64()),
            });
        }
        if let Some(item) = queue.next() {
            start(&mut tasks, &mut started, item);
        }
    }
    out.into_iter()
        .map(|o| o.unwrap_or((Err(None), 0.0)))
        .collect()
}

/// Blocks of one side's pool (`tp` ranks, blocks of `bs` tokens, on GPU `gpu` with `--device
/// cuda`) for requests of `lengths` tokens: as many as its budget holds ([`pools`]). Errors:
/// [`CliError::PoolBudget`] naming `side` when the longest request alone does not fit.
fn side_pool(
    args: &DemoArgs,
    model: &ModelShape,
    lengths: &[u64],
    (tp, bs, gpu): (u32, u64, u32),
    side: &'static str,
) -> Result<u64, CliError> {
    let (share, device) = match args.common.device {
        DeviceArg::Cpu => (pools::HOST_SHARE_CPU, None),
        DeviceArg::Cuda if args.pool_memory.is_some() => (pools::HOST_SHARE_CUDA, None),
        DeviceArg::Cuda => {
            match device_free_memory(gpu) {
                Ok(free) => (pools::HOST_SHARE_CUDA, Some((gpu, free))),
                Err(e) => {
                    // Building the side then says what is wrong with the GPU.
                    tracing::warn!("GPU {gpu}: free memory unknown ({e}); the pool's budget is the host's share");
                    (pools::HOST_SHARE_CUDA, None)
                }
            }
        }
    };
    let (budget, from) = pools::side_budget(args.pool_memory, share, physical_memory(), device);
    let block_bytes = pools::side_block_bytes(model, tp, bs);
    pools::pool_blocks(lengths, bs, block_bytes, budget).map_err(|t| CliError::PoolBudget {
        side,
        max_tokens: args.max_tokens,
        need: t.need,
        budget,
        from,
    })
}

/// Refuses, before any request is prefilled, a run whose longest prompt (of `lengths`, in
/// blocks of `cbs` tokens) would make a consumer rank grant its load more byte ranges than a
/// grant holds (each block's pieces in every layer of the rank, at most): every such load would
/// fail at its grant. A rank whose engine runs open (no secret) grants nothing (the consumer
/// makes no grant there), so it is not counted. Errors: [`CliError::Usage`] naming
/// `--max-tokens` (`max_tokens`).
fn check_grants(
    ranks: &[RankKv],
    lengths: &[u64],
    cbs: u64,
    max_tokens: u64,
) -> Result<(), CliError> {
    use kvferry_transfer::auth::MAX_GRANT_RANGES;
    let blocks = lengths.iter().max().map_or(0, |t| t.div_ceil(cbs));
    for r in ranks.iter().filter(|r| r.engine.is_authenticated()) {
        let per_block: u64 = r
            .layers
            .iter()
            .map(|l| l.spec.geometry.block_byte_ranges(0).len() as u64)
            .sum();
        let ranges = blocks.saturating_mul(per_block);
        if ranges > MAX_GRANT_RANGES as u64 {
            return Err(CliError::usage(format!(
                "--max-tokens {max_tokens}: the longest prompt's load is too large: {blocks} blocks of {per_block} byte ranges each on the consumer's {}, {ranges} ranges, more than the {MAX_GRANT_RANGES} a load's grant holds; lower --max-tokens or raise --decode-block-size (--block-size)",
                crate::world::rank_name(r.rank)
            )));
        }
    }
    Ok(())
}

/// Blocks for one request on both sides (`np` of the producer's pool, `nc` of the consumer's),
/// or `None`, with both pools as they were, when either has too few free.
fn take_blocks(
    prod: &mut BlockPool,
    cons: &mut BlockPool,
    np: usize,
    nc: usize,
) -> Option<(Vec<u64>, Vec<u64>)> {
    let p = prod.alloc(np)?;
    match cons.alloc(nc) {
        Some(c) => Some((p, c)),
        None => {
            prod.free(&p);
            None
        }
    }
}

/// How a load ended: its outcome or error, or (`Err`) its task ended without one (it
/// panicked; `None`: no task reported it).
type LoadEnd = Result<Result<LoadOutcome, LoadError>, Option<tokio::task::JoinError>>;

/// What checking a landed load needs of the demo's world.
struct Landing<'a> {
    args: &'a DemoArgs,
    model: &'a ModelShape,
    prod_ranks: &'a mut [RankKv],
    cons_ranks: &'a Arc<Mutex<Vec<RankKv>>>,
    pbs: u64,
    cbs: u64,
}

/// What the checks of the loads' outcomes gather beside the report.
#[derive(Default)]
struct Checks {
    /// Each landed load's verification share of its time.
    shares: Vec<f64>,
    /// After every recompute so far, the consumer's KV equals the producer's.
    kv_equal: Option<bool>,
}

impl Checks {
    /// Checks one load's outcome against what the request was given (a flip or none), counts
    /// it in `report`, and for a hybrid model's completed load or a recompute compares the
    /// two sides' KV. Errors: a failed copy from GPU memory.
    fn outcome(
        &mut self,
        report: &mut DemoReport,
        w: Landing<'_>,
        req: &Request,
        outcome: LoadEnd,
        load_seconds: f64,
    ) -> Result<(), CliError> {
        let (args, model, (pbs, cbs)) = (w.args, w.model, (w.pbs, w.cbs));
        let (tokens, request_id) = (req.tokens, &req.spec.request_id);
        let o = match outcome {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => {
                tracing::error!(request = %request_id, "load failed: {e}");
                report.counts.failed += 1;
                report.unexpected += 1;
                return Ok(());
            }
            Err(e) => {
                match e {
                    Some(e) => {
                        tracing::error!(request = %request_id, "the loading task ended: {e}")
                    }
                    None => tracing::error!(request = %request_id, "the load gave no outcome"),
                }
                report.counts.failed += 1;
                report.unexpected += 1;
                return Ok(());
            }
        };
        let as_expected = if let Some((group, t)) = req.flipped {
            // The mismatch names exactly the flipped group and the consumer blocks of the
            // chunk holding the flipped token (a chunk is the larger of the two block sizes,
            // §2.6).
            let want = mismatch_positions(t, tokens, pbs, cbs);
            matches!(&o.verdict, Some(Verdict::Mismatch { mismatches, .. })
                if mismatches.len() == 1 && mismatches[0].group_id == group
                    && mismatches[0].positions == want)
        } else {
            matches!(o.verdict, Some(Verdict::Verified)) && o.action == Action::Complete
        };
        if !as_expected {
            tracing::error!(request = %request_id, corrupted = req.flipped.is_some(), verdict = ?o.verdict, action = ?o.action, "unexpected load outcome");
            report.unexpected += 1;
        }
        if let Some(Verdict::Mismatch { mismatches, .. }) = o.verdict.as_ref() {
            report
                .mismatched_groups
                .extend(mismatches.iter().map(|m| m.group_id));
            report.mismatched_groups.sort_unstable();
            report.mismatched_groups.dedup();
        }
        let (pblocks, cblocks) = (&req.pblocks, &req.cblocks);
        if model.state_layers > 0 && o.action == Action::Complete {
            // State blocks are not checksummed: check that they landed.
            let mut ranks = w.cons_ranks.locked();
            for r in ranks.iter_mut() {
                r.download_blocks(cblocks)?;
            }
            for p in w.prod_ranks.iter_mut() {
                p.download_blocks(pblocks)?;
            }
            let equal = sides_kv_equal(
                w.prod_ranks,
                pblocks,
                &ranks,
                cblocks,
                tokens,
                Some(STATE_GROUP),
            );
            report.state_landed = Some(report.state_landed.unwrap_or(true) && equal);
        }
        report.bytes += o.bytes;
        report.read_loads += u32::from(o.read);
        report.checksum_seconds += o.checksum_seconds;
        report.verify_seconds += o.checksum_seconds;
        if load_seconds > 0.0 {
            self.shares
                .push((o.checksum_seconds / load_seconds).min(1.0));
        }
        report.counts.record(o.verdict.as_ref(), o.action);
        if o.action == Action::Recompute {
            // The embedder's job: recompute the prompt locally (same seeded KV), then the
            // consumer's KV must equal the producer's.
            let mut ranks = w.cons_ranks.locked();
            for r in ranks.iter_mut() {
                fill_request(r, args.seed, u64::from(req.index), cblocks)?;
                r.download_blocks(cblocks)?;
            }
            for p in w.prod_ranks.iter_mut() {
                p.download_blocks(pblocks)?;
            }
            let equal = sides_kv_equal(w.prod_ranks, pblocks, &ranks, cblocks, tokens, None);
            self.kv_equal = Some(self.kv_equal.unwrap_or(true) && equal);
        }
        Ok(())
    }
}

/// Which side's options a build error names: only errors that come from a side's sizes or
/// layout (a transport or device failure is the same on both sides and names its own option).
fn side_error(side: &'static str) -> impl Fn(WorldError) -> CliError {
    move |source| match source {
        WorldError::Shape(_) | WorldError::Layout(_) | WorldError::Skipped { .. } => {
            CliError::Side { side, source }
        }
        WorldError::Alloc { .. } | WorldError::GpuAlloc { .. } => {
            CliError::SideMemory { side, source }
        }
        other => CliError::World(other),
    }
}

/// The consumer block positions a flipped bit in token `token` of a `tokens`-token prompt is
/// reported at: every consumer block of the chunk of `max(pbs, cbs)` tokens holding it (one
/// block when the sizes are equal).
pub fn mismatch_positions(token: u64, tokens: u64, pbs: u64, cbs: u64) -> Vec<u64> {
    let chunk = pbs.max(cbs);
    let q = token / chunk;
    (q * chunk / cbs..((q + 1) * chunk / cbs).min(tokens.div_ceil(cbs))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_side_without_memory_for_its_blocks_names_the_options_that_size_them() {
        let e = side_error("producer (--prefill-tp)")(WorldError::Alloc {
            bytes: 1 << 40,
            source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
        });
        let text = e.to_string();
        assert!(matches!(e, CliError::SideMemory { .. }), "{e:?}");
        assert!(
            text.starts_with("producer (--prefill-tp): allocating 1099511627776 bytes")
                && text.contains("--pool-memory")
                && text.contains("--max-tokens"),
            "{text}"
        );
    }

    /// A stage's leases outlast the stage: every later publish and every load of the stage
    /// each within its deadline. The default lease (120 s) does not: 1024 loads of 2 s, 16 in
    /// flight, end 128 s after the last publish.
    #[test]
    fn a_stage_ends_before_its_leases() {
        use crate::cli::{Cli, Command};
        use clap::Parser;
        for (requests, in_flight, timeout) in [(1024u32, 16usize, 60.0), (100_000, 1, 5.0)] {
            let (n, t) = (requests.to_string(), timeout.to_string());
            let argv = ["kvferry", "demo", "--requests", &n, "--timeout", &t];
            let Command::Demo(args) = Cli::try_parse_from(argv).unwrap().command else {
                unreachable!()
            };
            let cfg = demo_producer_config(&args, in_flight);
            let stage = (requests as usize).min(pools::MAX_STAGE_REQUESTS) as u32;
            let loads =
                consumer_config(&args.common).load_deadline() * stage.div_ceil(in_flight as u32);
            let publishes = cfg.checksum_timeout * stage;
            assert!(cfg.timeouts.lease >= loads + publishes, "{cfg:?}");
            let slow_tcp = Duration::from_secs(2) * stage.div_ceil(in_flight as u32);
            assert!(cfg.timeouts.lease > slow_tcp, "{cfg:?}");
        }
        // A short demo keeps at least the default lease.
        let argv = ["kvferry", "demo", "--requests", "1", "--timeout", "1"];
        let Command::Demo(args) = Cli::try_parse_from(argv).unwrap().command else {
            unreachable!()
        };
        let default = producer_config(&args.common).timeouts.lease;
        assert!(demo_producer_config(&args, 1).timeouts.lease >= default);
    }

    #[test]
    fn runtime_workers_grow_with_loads_in_flight_within_the_cores() {
        // Serial loads keep the runtime they always had.
        assert_eq!(runtime_workers(1, 16), 2);
        assert_eq!(runtime_workers(2, 16), 4);
        assert_eq!(runtime_workers(4, 16), 8);
        // At most the cores, but never below 2.
        assert_eq!(runtime_workers(64, 128), 128);
        assert_eq!(runtime_workers(16, 16), 16);
        assert_eq!(runtime_workers(3, 4), 4);
        assert_eq!(runtime_workers(8, 2), 2);
        assert_eq!(runtime_workers(8, 1), 2);
    }

    #[test]
    fn a_request_takes_blocks_on_both_sides_or_on_neither() {
        let (mut p, mut c) = (BlockPool::new(10, 1), BlockPool::new(4, 2));
        let (pb, cb) = take_blocks(&mut p, &mut c, 6, 3).expect("room on both sides");
        assert_eq!((pb.len(), cb.len()), (6, 3));
        // The consumer's pool has 1 block left: the producer's 4 stay free.
        assert!(take_blocks(&mut p, &mut c, 4, 2).is_none());
        assert!(take_blocks(&mut p, &mut c, 4, 1).is_some());
    }

    /// A tiny consumer side of one rank with a few blocks of 1 token, its engine open or with a
    /// secret.
    fn tiny_side(secret: bool) -> Vec<RankKv> {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from(["kvferry", "demo", "--model", "tiny"]).unwrap();
        let crate::cli::Command::Demo(args) = cli.command else {
            unreachable!("parsed as demo")
        };
        let c = &args.common;
        let mut engine = engine_config(c, "127.0.0.1").unwrap();
        if secret {
            engine.auth.secret = Some(kvferry_transfer::Secret::from_bytes(&[7u8; 32]).unwrap());
        }
        let model = model_by_name("tiny").unwrap().clone();
        build_side(&side_config(c, model, (1, 1), 1, 4, 0), &engine).unwrap()
    }

    #[test]
    fn only_an_authenticated_consumer_counts_a_loads_grant_ranges() {
        // tiny grants K and V apart in each of its 4 layers: 8 ranges a block, 1.6M for 200000
        // blocks of 1 token, more than a grant holds.
        let lengths = [200_000];
        let e = check_grants(&tiny_side(true), &lengths, 1, 200_000).unwrap_err();
        assert!(
            e.to_string()
                .contains("1600000 ranges, more than the 1048576"),
            "{e}"
        );
        // An open engine checks no grant and the consumer makes none there: nothing to refuse.
        check_grants(&tiny_side(false), &lengths, 1, 200_000).unwrap();
    }

    #[test]
    fn median_is_the_upper_middle_and_max_the_largest() {
        assert_eq!(median_max(&mut []), (0.0, 0.0));
        assert_eq!(median_max(&mut [3.0, 1.0, 2.0]), (2.0, 3.0));
        assert_eq!(median_max(&mut [4.0, 1.0, 3.0, 2.0]), (3.0, 4.0));
    }
}
