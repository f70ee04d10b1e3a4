//! CUDA IPC copy throughput between two processes on one GPU, as ratios to an in-process
//! `cuMemcpyDtoDAsync` of the same bytes measured in the same run (docs/design.md §7).
//!
//! The child process (this binary with `child`) allocates the destination memory (`cuMemAlloc`
//! and `cuMemCreate` with the POSIX fd handle type) and exports it; this process maps it
//! (legacy IPC handle; file descriptor over the Unix socket) and copies into it from its own
//! memory on its own stream, timed with events:
//!
//! * `contiguous`: one copy of `size` bytes;
//! * `64K pieces`, `4K pieces`: `size` bytes as pieces at every other piece offset on both
//!   sides (nothing coalesces), in one launch of the piece kernel (kvferry-cuda's
//!   `PieceKernel`);
//! * `4K batch API`: the same 4 KiB pieces through one `cuMemcpyBatchAsync` (what the driver's
//!   batch gives instead);
//! * `vmm`: one contiguous copy into the `cuMemCreate` allocation.
//!
//! * `engine …`: the same requests through two transfer engines (`TransferEngine::submit` and
//!   `wait`, the CUDA IPC transport), timed on the host from submit to the end of the wait
//!   (so the engine's figures include what the host adds: slicing, routing, completion), one
//!   batch at a time: each batch's fixed cost (submit, completion, wake-up) is added to its
//!   copy;
//! * `engine … strided ×4`: the scattered pieces as one strided request
//!   (`TransferEngine::submit_strided`: one range, a block per piece), validated per block and
//!   copied by one launch of the strided kernel, 4 batches in flight;
//! * `engine … ×4`: the same with up to 4 batches in flight (a batch is submitted before the
//!   oldest is waited on), the way the reference's copies are enqueued back to back: throughput,
//!   with the host work of one batch overlapping the copies of the others.
//!
//! A second table splits the engine's host time: `submit` (validation, slicing, routing,
//! enqueue; µs per batch, and ns per request for 64 KiB pieces) against the whole batch.
//! A third gives the host's part of each driver call a batch makes (a copy, an event record
//! and query, a context switch, a launch of the piece kernel with its table): µs per call, the
//! floor under the engine's own work per batch.
//!
//! The bytes of a scattered copy are checked at the end (read back through the mapping).
//!
//!   cargo run --release -p kvferry-transfer --example cuda_ipc_bench [-- MAX_MIB]
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

use kvferry_cuda::driver::{
    copy_dtoh_async, copy_htod_async, Context, DeviceBuffer, Event, Stream,
};
use kvferry_cuda::ipc::{
    self, export_vmm, legacy_handle, plan_copies, ImportedVmm, LegacyHandle, OpenedLegacy,
    PieceKernel, PieceTable, VmmBuffer,
};
use kvferry_transfer::transport::cuda_ipc::fdpass::{fetch, FdServer};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn child(max: usize) {
    let ctx = Context::new(0).unwrap();
    let buf = DeviceBuffer::new(&ctx, 2 * max).unwrap();
    let vmm = VmmBuffer::new(&ctx, 2 * max).unwrap();
    let engine = kvferry_transfer::TransferEngine::new(Default::default()).unwrap();
    // SAFETY: the buffer lives until this process exits.
    unsafe {
        engine
            .register_memory(
                buf.ptr(),
                (2 * max) as u64,
                kvferry_transfer::Location::Cuda(0),
            )
            .unwrap()
    };
    let srv = FdServer::start().unwrap();
    let t = srv
        .offer(Arc::new(export_vmm(vmm.ptr()).unwrap()), vmm.len() as u64)
        .unwrap();
    println!(
        "KVF {} {} {} {} {} {}",
        hex(&legacy_handle(buf.ptr()).unwrap().0),
        srv.name(),
        hex(&t),
        vmm.len(),
        engine.segment_name(),
        buf.ptr()
    );
    std::io::stdout().flush().unwrap();
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
}

/// Seconds per run of `f` (which enqueues on `stream`), over `reps` runs after one warm-up.
fn time(ctx: &Context, stream: &Stream, reps: usize, mut f: impl FnMut()) -> f64 {
    let (a, b) = (
        Event::new(ctx, true).unwrap(),
        Event::new(ctx, true).unwrap(),
    );
    f();
    stream.synchronize().unwrap();
    // SAFETY: live stream and events of this context.
    unsafe { a.record(stream.raw()).unwrap() };
    for _ in 0..reps {
        f();
    }
    // SAFETY: as above.
    unsafe { b.record(stream.raw()).unwrap() };
    b.synchronize().unwrap();
    Event::elapsed_ms(&a, &b).unwrap() as f64 / 1e3 / reps as f64
}

fn pieces(dst: u64, src: u64, size: usize, piece: usize) -> Vec<ipc::Copy> {
    (0..size / piece)
        .map(|i| ipc::Copy {
            dst: dst + (2 * i * piece) as u64,
            src: src + (2 * i * piece) as u64,
            len: piece,
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let max_mib: usize = args
        .iter()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(256);
    let max = max_mib << 20;
    if args.get(1).map(String::as_str) == Some("child") {
        return child(max);
    }
    match kvferry_cuda::cuda_available() {
        Ok(n) if n > 0 => {}
        other => {
            println!("SKIPPED: no CUDA device ({other:?})");
            return;
        }
    }
    let ctx = Context::new(0).unwrap();
    let mut kid = Command::new(std::env::current_exe().unwrap())
        .args(["child", &max_mib.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(kid.stdout.take().unwrap());
    let line = loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "child exited");
        if let Some(x) = l.trim().strip_prefix("KVF ") {
            break x.to_string();
        }
    };
    let w: Vec<&str> = line.split_whitespace().collect();
    let mut h = [0u8; 64];
    h.copy_from_slice(&unhex(w[0]));
    let legacy = OpenedLegacy::open(&ctx, &LegacyHandle(h)).unwrap();
    let mut t = [0u8; 16];
    t.copy_from_slice(&unhex(w[2]));
    let (fd, vsize) = fetch(w[1], &t, "child", None).unwrap();
    assert_eq!(vsize, w[3].parse::<u64>().unwrap());
    let vmm = ImportedVmm::import(&ctx, &fd, vsize).unwrap();
    let src = DeviceBuffer::new(&ctx, 2 * max).unwrap();
    let local = DeviceBuffer::new(&ctx, 2 * max).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let s = stream.raw();
    let engine = kvferry_transfer::TransferEngine::new(Default::default()).unwrap();
    // SAFETY: `src` outlives the engine's use of it.
    unsafe {
        engine
            .register_memory(
                src.ptr(),
                (2 * max) as u64,
                kvferry_transfer::Location::Cuda(0),
            )
            .unwrap()
    };
    let seg = engine.open_segment(w[4]).unwrap();
    let remote: u64 = w[5].parse().unwrap();
    println!(
        "engine path: {}",
        engine.transfer_path(&seg, src.ptr(), remote).unwrap()
    );
    // Host seconds per batch of those `submit` makes, with up to `window` batches in flight,
    // first submit to the end of the last wait; and the seconds per batch spent in `submit`
    // alone.
    let windowed = |submit: &dyn Fn() -> kvferry_transfer::BatchId, reps: usize, window: usize| {
        let wait = |id| engine.wait(id, std::time::Duration::from_secs(60)).unwrap();
        wait(submit());
        let mut in_flight = std::collections::VecDeque::new();
        let mut submitting = std::time::Duration::ZERO;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            if in_flight.len() == window {
                wait(in_flight.pop_front().unwrap());
            }
            let s = std::time::Instant::now();
            in_flight.push_back(submit());
            submitting += s.elapsed();
        }
        in_flight.into_iter().for_each(wait);
        (
            t.elapsed().as_secs_f64() / reps as f64,
            submitting.as_secs_f64() / reps as f64,
        )
    };
    // `windowed` for batches of `reqs`.
    let engine_run = |reqs: &[kvferry_transfer::TransferRequest], reps: usize, window: usize| {
        windowed(&|| engine.submit(&seg, reqs).unwrap(), reps, window)
    };
    // `windowed` for one strided request (`TransferEngine::submit_strided`).
    let strided_run = |req: &kvferry_transfer::StridedRequest, reps: usize, window: usize| {
        let one = std::slice::from_ref(req);
        windowed(&|| engine.submit_strided(&seg, one).unwrap(), reps, window)
    };
    // `size` bytes as pieces of `piece` at every other piece offset, as one strided request.
    let strided = |size: usize, piece: usize| kvferry_transfer::StridedRequest {
        op: kvferry_transfer::Op::Write,
        ranges: vec![kvferry_transfer::StridedRange {
            local: 0,
            remote: 0,
            len: piece as u64,
        }],
        blocks: (0..size / piece)
            .map(|i| {
                (
                    src.ptr() + (2 * i * piece) as u64,
                    remote + (2 * i * piece) as u64,
                )
            })
            .collect(),
    };
    let engine_time =
        |reqs: &[kvferry_transfer::TransferRequest], reps: usize| engine_run(reqs, reps, 1).0;
    let reqs = |size: usize, piece: usize| -> Vec<kvferry_transfer::TransferRequest> {
        (0..size / piece)
            .map(|i| kvferry_transfer::TransferRequest {
                op: kvferry_transfer::Op::Write,
                local_addr: src.ptr() + (2 * i * piece) as u64,
                remote_addr: remote + (2 * i * piece) as u64,
                len: piece as u64,
            })
            .collect()
    };
    println!(
        "device: {} (one GPU, process pair, cuMemcpyBatchAsync: {})",
        ctx.name(),
        if ipc::batch_available() { "yes" } else { "no" }
    );
    let kernel = PieceKernel::new(0).expect("piece kernel (NVRTC)");
    let table = std::cell::RefCell::new(PieceTable::new());
    println!(
        "| size | reference GB/s | contiguous | 64K pieces | 4K pieces | 4K batch API | vmm | engine contiguous | engine 64K pieces | engine 4K pieces | engine contiguous ×4 | engine 64K pieces ×4 | engine 64K strided ×4 | engine 4K strided ×4 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut host_rows = Vec::new();
    let mut size = 64 << 10;
    while size <= max {
        let reps = ((1usize << 31) / size).clamp(8, 4000);
        let src_ptr = src.ptr();
        let copy = |dst: u64| {
            move || {
                // SAFETY: `size` bytes inside live allocations of 2 * max bytes.
                unsafe {
                    ipc::copy_batch_async(
                        &[ipc::Copy {
                            dst,
                            src: src_ptr,
                            len: size,
                        }],
                        s,
                    )
                    .unwrap();
                }
            }
        };
        let reference = time(&ctx, &stream, reps, copy(local.ptr()));
        let contiguous = time(&ctx, &stream, reps, copy(legacy.ptr()));
        let vm = time(&ctx, &stream, reps, copy(vmm.ptr()));
        let scattered = |piece: usize, use_kernel: bool| {
            let ps = pieces(legacy.ptr(), src.ptr(), size, piece);
            let plan = plan_copies(&ps);
            let reps = if use_kernel { reps } else { reps.min(20) };
            time(&ctx, &stream, reps, || {
                // SAFETY: every piece lies inside the 2 * max byte allocations. The repeated
                // enqueues rewrite the pinned table while an earlier upload may still read it:
                // with the same plan every time the bytes are the same, so the race is benign
                // here (the transport gives each batch a table of its own).
                unsafe {
                    if use_kernel {
                        kernel.enqueue(&plan, &mut table.borrow_mut(), s).unwrap();
                    } else {
                        ipc::copy_batch_async(&ps, s).unwrap();
                    }
                }
            })
        };
        let p64 = scattered(64 << 10, true);
        let p4 = scattered(4 << 10, true);
        let l4 = if size <= 16 << 20 {
            format!("{:.3}", reference / scattered(4 << 10, false))
        } else {
            "-".into()
        };
        let ereps = ((256usize << 20) / size).clamp(5, 200);
        let e_contig = engine_time(
            &[kvferry_transfer::TransferRequest {
                op: kvferry_transfer::Op::Write,
                local_addr: src.ptr(),
                remote_addr: remote,
                len: size as u64,
            }],
            ereps,
        );
        let e64 = engine_time(&reqs(size, 64 << 10), ereps);
        let e4 = engine_time(&reqs(size, 4 << 10), ereps.min(20));
        let contig_req = [kvferry_transfer::TransferRequest {
            op: kvferry_transfer::Op::Write,
            local_addr: src.ptr(),
            remote_addr: remote,
            len: size as u64,
        }];
        let (pc, pc_submit) = engine_run(&contig_req, 4 * ereps, 4);
        let r64 = reqs(size, 64 << 10);
        let (p64e, p64_submit) = engine_run(&r64, 4 * ereps, 4);
        let (s64, s64_submit) = strided_run(&strided(size, 64 << 10), 4 * ereps, 4);
        let (s4, _) = strided_run(&strided(size, 4 << 10), 4 * ereps, 4);
        let label = if size >= 1 << 20 {
            format!("{} MiB", size >> 20)
        } else {
            format!("{} KiB", size >> 10)
        };
        host_rows.push(format!(
            "| {label} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} |",
            e_contig * 1e6,
            pc * 1e6,
            pc_submit * 1e6,
            p64e * 1e6,
            p64_submit * 1e9 / r64.len() as f64,
            s64 * 1e6,
            s64_submit * 1e6,
        ));
        println!(
            "| {} | {:.1} | {:.3} | {:.3} | {:.3} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
            label,
            size as f64 / reference / 1e9,
            reference / contiguous,
            reference / p64,
            reference / p4,
            l4,
            reference / vm,
            reference / e_contig,
            reference / e64,
            reference / e4,
            reference / pc,
            reference / p64e,
            reference / s64,
            reference / s4
        );
        size *= 4;
    }
    println!();
    println!(
        "| size | engine contiguous µs/batch | ×4 µs/batch | ×4 submit µs/batch | engine 64K pieces ×4 µs/batch | ×4 submit ns/request | engine 64K strided ×4 µs/batch | ×4 strided submit µs/batch |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in host_rows {
        println!("{r}");
    }
    // The host's part of each driver call a batch makes: µs per call, `n` calls back to back
    // timed on the host (the stream drained before and after, so no call waits for room).
    let per_call = |n: usize, f: &mut dyn FnMut()| -> f64 {
        stream.synchronize().unwrap();
        let t = std::time::Instant::now();
        for _ in 0..n {
            f();
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        stream.synchronize().unwrap();
        us
    };
    let copy_into = |len: usize| {
        let c = [ipc::Copy {
            dst: legacy.ptr(),
            src: src.ptr(),
            len,
        }];
        // SAFETY: `len` bytes inside both allocations (of 2 * max bytes).
        move || unsafe {
            ipc::copy_batch_async(&c, s).unwrap();
        }
    };
    let ev = Event::new(&ctx, false).unwrap();
    let small = plan_copies(&pieces(legacy.ptr(), src.ptr(), 64 << 10, 4 << 10));
    let mut calls: Vec<(&str, f64)> = vec![
        (
            "cuMemcpyDtoDAsync 64 KiB (into the IPC mapping)",
            per_call(200, &mut copy_into(64 << 10)),
        ),
        (
            "cuMemcpyDtoDAsync 1 MiB (into the IPC mapping)",
            per_call(200, &mut copy_into(1 << 20)),
        ),
        ("cuEventRecord", {
            // SAFETY: a live event and stream of this context.
            per_call(1000, &mut || unsafe { ev.record(s).unwrap() })
        }),
        (
            "cuEventQuery (completed)",
            per_call(1000, &mut || {
                ev.query().unwrap();
            }),
        ),
        (
            "cuCtxSetCurrent (the same context)",
            per_call(1000, &mut || ctx.bind().unwrap()),
        ),
    ];
    // The same copy call while another thread asks an event in a loop, as the transport's
    // completion thread does: what the driver's locks shared with that thread add per call.
    let polled = {
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                ctx.bind().unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    ev.query().unwrap();
                }
            });
            let us = per_call(200, &mut copy_into(1 << 20));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            us
        })
    };
    calls.push((
        "cuMemcpyDtoDAsync 1 MiB, another thread querying an event meanwhile",
        polled,
    ));
    let pinned = kvferry_cuda::driver::PinnedBuffer::new(&ctx, 4096).unwrap();
    let dev_table = DeviceBuffer::new(&ctx, 4096).unwrap();
    calls.push((
        "cuMemcpyHtoDAsync 384 B from pinned memory (a piece table's upload)",
        // SAFETY: 384 bytes of live pinned and device buffers of 4096 bytes.
        per_call(200, &mut || unsafe {
            copy_htod_async(dev_table.ptr(), pinned.as_ptr(), 384, s).unwrap()
        }),
    ));
    calls.push((
        "piece kernel: 16 pieces (table upload + launch)",
        per_call(200, &mut || {
            // SAFETY: as the scattered runs above (the same plan each time: the pinned
            // table's bytes do not change while an upload may read them).
            unsafe { kernel.enqueue(&small, &mut table.borrow_mut(), s).unwrap() }
        }),
    ));
    println!();
    println!("| driver call (host side) | µs per call |");
    println!("|---|---|");
    for (what, us) in calls {
        println!("| {what} | {us:.2} |");
    }
    // Bytes: a pattern scattered into the child's memory as 4 KiB pieces, read back.
    let n = 16 << 20;
    let pat: Vec<u8> = (0..2 * n).map(|i| (i * 7 + i / 4096) as u8).collect();
    // SAFETY: `pat` outlives the synchronised copies; ranges inside the allocations.
    unsafe {
        copy_htod_async(src.ptr(), pat.as_ptr(), 2 * n, s).unwrap();
        stream.synchronize().unwrap();
        let mut t = table.borrow_mut();
        kernel
            .enqueue(
                &plan_copies(&pieces(legacy.ptr(), src.ptr(), n, 4096)),
                &mut t,
                s,
            )
            .unwrap();
        stream.synchronize().unwrap();
        kernel
            .enqueue(
                &plan_copies(&pieces(local.ptr(), legacy.ptr(), n, 4096)),
                &mut t,
                s,
            )
            .unwrap();
    }
    stream.synchronize().unwrap();
    let mut back = vec![0u8; 2 * n];
    // SAFETY: `back` has 2n bytes; synchronised before it is read.
    unsafe { copy_dtoh_async(back.as_mut_ptr(), local.ptr(), 2 * n, s).unwrap() };
    stream.synchronize().unwrap();
    let bad = (0..n / 4096)
        .filter(|i| {
            let o = 2 * i * 4096;
            back[o..o + 4096] != pat[o..o + 4096]
        })
        .count();
    println!(
        "bytes: 4K pieces written and read back through the mapping, {bad} of {} pieces differ",
        n / 4096
    );
    drop(legacy);
    drop(vmm);
    let _ = kid.kill();
    let _ = kid.wait();
    assert_eq!(bad, 0);
}
