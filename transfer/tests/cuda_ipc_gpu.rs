//! CUDA IPC between two processes of one host (docs/design.md §3.10), on one GPU: the exporter
//! (this test) and an importer (this binary started again as a child) share device memory
//! allocated with `cuMemAlloc` (legacy IPC handle) and with `cuMemCreate` (a file descriptor
//! passed over the Unix socket against a ticket), the importer WRITEs into and READs from the
//! exporter's memory with device copies, and both sides check the bytes.
//!
//! Where CUDA is absent every test prints `SKIPPED: <reason>`; `KVFERRY_REQUIRE_GPU` turns
//! skips into failures (set by scripts/gpu-tests.sh on a GPU machine).

use std::io::{BufRead, BufReader, Write};
use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_cuda::driver::{
    copy_dtoh_async, copy_htod_async, Context, DeviceBuffer, Event, Stream,
};
use kvferry_cuda::ipc::{
    self, allocation_of, export_vmm, legacy_handle, AllocationKind, ImportedVmm, LegacyHandle,
    OpenedLegacy, VmmBuffer,
};
use kvferry_transfer::sync::MutexExt;
use kvferry_transfer::transport::cuda_ipc::fdpass::{fetch, FdServer};

const ROLE: &str = "KVFERRY_IPC_TEST_ROLE";

/// One GPU test at a time: the leak check reads the device's free memory.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.locked()
}

fn gpu(test: &str) -> Option<Context> {
    let why = match kvferry_cuda::cuda_available() {
        Ok(n) if n > 0 => match kvferry_cuda::guarded("context", || Context::new(0)) {
            Ok(c) => return Some(c),
            Err(e) => e.to_string(),
        },
        Ok(_) => "no CUDA device".to_string(),
        Err(e) => e.to_string(),
    };
    assert!(
        std::env::var_os("KVFERRY_REQUIRE_GPU").is_none(),
        "{test}: GPU required but {why}"
    );
    // Straight to stderr: libtest hides a passing test's eprintln! output.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    None
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1] ^ seed)
        .collect()
}

fn upload(ctx: &Context, dst: u64, bytes: &[u8]) {
    let s = Stream::new(ctx).unwrap();
    // SAFETY: `dst` has `bytes.len()` device bytes; synchronised before `bytes` goes away.
    unsafe { copy_htod_async(dst, bytes.as_ptr(), bytes.len(), s.raw()).unwrap() };
    s.synchronize().unwrap();
}

fn download(ctx: &Context, src: u64, len: usize) -> Vec<u8> {
    let s = Stream::new(ctx).unwrap();
    let mut v = vec![0u8; len];
    // SAFETY: `src` has `len` device bytes; synchronised before `v` is read.
    unsafe { copy_dtoh_async(v.as_mut_ptr(), src, len, s.raw()).unwrap() };
    s.synchronize().unwrap();
    v
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// The importer: this binary again, running `child_importer` with commands on stdin.
struct Importer {
    child: Child,
    /// The importer's `KVF ` answers, read by a thread of their own so every wait has a
    /// deadline.
    answers: std::sync::mpsc::Receiver<String>,
}

/// Longest wait for one answer of a child process.
const ANSWER_DEADLINE: Duration = Duration::from_secs(60);

/// Forwards the `KVF ` lines of a child's stdout to a channel.
fn answers_of(out: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            // libtest writes "test NAME ... " before a test's first line, without a newline.
            if let Some(i) = l.find("KVF ") {
                if tx.send(l[i + 4..].trim().to_string()).is_err() {
                    break;
                }
            }
        }
    });
    rx
}

impl Importer {
    fn start() -> Importer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_importer",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(ROLE, "importer")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let answers = answers_of(child.stdout.take().unwrap());
        Importer { child, answers }
    }

    /// Sends one command line and returns the importer's answer (its `KVF ` line).
    fn ask(&mut self, line: &str) -> String {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        self.answers
            .recv_timeout(ANSWER_DEADLINE)
            .unwrap_or_else(|e| panic!("importer gave no answer to {line:?}: {e}"))
    }
}

impl Drop for Importer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How the importer maps the exporter's allocation.
enum Share {
    Legacy(LegacyHandle),
    /// Socket name and ticket.
    Fd(String, [u8; 16]),
}

fn share_line(s: &Share, size: usize) -> String {
    match s {
        Share::Legacy(h) => format!("legacy {} {size}", hex(&h.0)),
        Share::Fd(name, t) => format!("fd {name}:{} {size}", hex(t)),
    }
}

/// The child side: maps each shared allocation it is told about and copies on command.
/// Commands: `map <how> <size>` -> `mapped <slot>`; `write <slot> <off> <len> <seed>` (its own
/// pattern into the slot) -> `ok`; `read <slot> <off> <len>` -> `data <hex>`;
/// `spin <slot> <len> <n>` (n copies in a loop, no answer until done) -> `ok`.
#[test]
fn child_importer() {
    if std::env::var(ROLE).as_deref() != Ok("importer") {
        return;
    }
    eprintln!("importer {}: start", std::process::id());
    let ctx = Context::new(0).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mut legacy: Vec<OpenedLegacy> = Vec::new();
    let mut vmm: Vec<ImportedVmm> = Vec::new();
    let mut slots: Vec<u64> = Vec::new();
    let local = DeviceBuffer::new(&ctx, 64 << 20).unwrap();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.unwrap();
        eprintln!("importer: {}", line.get(..40).unwrap_or(&line));
        let w: Vec<&str> = line.split_whitespace().collect();
        let answer = match w.as_slice() {
            ["map", "legacy", h, _size] => {
                let mut b = [0u8; 64];
                b.copy_from_slice(&unhex(h));
                match OpenedLegacy::open(&ctx, &LegacyHandle(b)) {
                    Ok(o) => {
                        slots.push(o.ptr());
                        legacy.push(o);
                        format!("mapped {}", slots.len() - 1)
                    }
                    Err(e) => format!("error {e}"),
                }
            }
            ["map", "fd", how, size] => {
                let (name, t) = how.rsplit_once(':').unwrap();
                let mut ticket = [0u8; 16];
                ticket.copy_from_slice(&unhex(t));
                match fetch(name, &ticket, "exporter", None)
                    .map_err(|e| e.to_string())
                    .and_then(|(fd, sz)| {
                        assert_eq!(sz, size.parse::<u64>().unwrap());
                        ImportedVmm::import(&ctx, &fd, sz).map_err(|e| e.to_string())
                    }) {
                    Ok(m) => {
                        slots.push(m.ptr());
                        vmm.push(m);
                        format!("mapped {}", slots.len() - 1)
                    }
                    Err(e) => format!("error {e}"),
                }
            }
            ["write", slot, off, len, seed] => {
                let (off, len): (u64, usize) = (off.parse().unwrap(), len.parse().unwrap());
                upload(&ctx, local.ptr(), &pattern(seed.parse().unwrap(), len));
                let dst = slots[slot.parse::<usize>().unwrap()] + off;
                // SAFETY: both ranges lie inside live allocations (the exporter's is mapped).
                unsafe {
                    ipc::copy_batch_async(
                        &[ipc::Copy {
                            dst,
                            src: local.ptr(),
                            len,
                        }],
                        stream.raw(),
                    )
                    .unwrap();
                }
                stream.synchronize().unwrap();
                "ok".to_string()
            }
            ["read", slot, off, len] => {
                let (off, len): (u64, usize) = (off.parse().unwrap(), len.parse().unwrap());
                let src = slots[slot.parse::<usize>().unwrap()] + off;
                // SAFETY: both ranges lie inside live allocations.
                unsafe {
                    ipc::copy_batch_async(
                        &[ipc::Copy {
                            dst: local.ptr(),
                            src,
                            len,
                        }],
                        stream.raw(),
                    )
                    .unwrap();
                }
                stream.synchronize().unwrap();
                format!("data {}", hex(&download(&ctx, local.ptr(), len)))
            }
            _ => format!("error unknown command {line:?}"),
        };
        println!("KVF {answer}");
    }
}

/// Writes from the importer land in the exporter's memory and reads return it, for an
/// allocation of `kind`.
fn round_trip(
    ctx: &Context,
    dst_ptr: u64,
    src_ptr: u64,
    how_dst: Share,
    how_src: Share,
    size: usize,
) {
    let mut imp = Importer::start();
    let expect = pattern(9, 1 << 20);
    upload(ctx, src_ptr + 4096, &expect);
    let a = imp.ask(&format!("map {}", share_line(&how_dst, size)));
    assert_eq!(a, "mapped 0");
    let b = imp.ask(&format!("map {}", share_line(&how_src, size)));
    assert_eq!(b, "mapped 1");
    // WRITE: the importer's pattern 5 into [dst + 8192, +1 MiB)
    assert_eq!(imp.ask(&format!("write 0 8192 {} 5", 1 << 20)), "ok");
    assert!(
        download(ctx, dst_ptr + 8192, 1 << 20) == pattern(5, 1 << 20),
        "bytes written by the importer differ"
    );
    assert_eq!(
        download(ctx, dst_ptr, 8192),
        vec![0u8; 8192],
        "bytes before the range untouched"
    );
    // READ: [src + 4096, +1 MiB) back to the importer
    let r = imp.ask(&format!("read 1 4096 {}", 1 << 20));
    let data = unhex(r.strip_prefix("data ").expect("data"));
    assert!(data == expect, "bytes read by the importer differ");
}

#[test]
fn legacy_ipc_write_and_read_across_processes() {
    let _one = serial();
    let Some(ctx) = gpu("legacy_ipc_write_and_read_across_processes") else {
        return;
    };
    let size = 4 << 20;
    let dst = DeviceBuffer::new(&ctx, size).unwrap();
    let src = DeviceBuffer::new(&ctx, size).unwrap();
    upload(&ctx, dst.ptr(), &vec![0u8; size]);
    // the export names the allocation's base even when asked about an inner address
    let a = allocation_of(dst.ptr() + 100).unwrap();
    assert_eq!(
        (a.base, a.size, a.kind),
        (dst.ptr(), size as u64, AllocationKind::Legacy)
    );
    let hd = Share::Legacy(legacy_handle(dst.ptr()).unwrap());
    let hs = Share::Legacy(legacy_handle(src.ptr()).unwrap());
    round_trip(&ctx, dst.ptr(), src.ptr(), hd, hs, size);
}

#[test]
fn vmm_memory_goes_by_file_descriptor_and_legacy_ipc_refuses_it() {
    let _one = serial();
    let Some(ctx) = gpu("vmm_memory_goes_by_file_descriptor_and_legacy_ipc_refuses_it") else {
        return;
    };
    let dst = VmmBuffer::new(&ctx, 4 << 20).unwrap();
    let src = VmmBuffer::new(&ctx, 4 << 20).unwrap();
    let size = dst.len();
    upload(&ctx, dst.ptr(), &vec![0u8; size]);
    let a = allocation_of(dst.ptr() + 100).unwrap();
    assert_eq!(
        (a.base, a.size, a.kind),
        (dst.ptr(), size as u64, AllocationKind::VmmFd)
    );
    let refused = legacy_handle(dst.ptr());
    eprintln!("legacy IPC on cuMemCreate memory: {refused:?}");
    assert!(refused.is_err(), "cuIpcGetMemHandle accepted VMM memory");
    let srv = FdServer::start().unwrap();
    let fd_d: Arc<OwnedFd> = Arc::new(export_vmm(dst.ptr()).unwrap());
    let fd_s: Arc<OwnedFd> = Arc::new(export_vmm(src.ptr()).unwrap());
    let td = srv.offer(fd_d, size as u64).unwrap();
    let ts = srv.offer(fd_s, size as u64).unwrap();
    let name = srv.name().to_string();
    round_trip(
        &ctx,
        dst.ptr(),
        src.ptr(),
        Share::Fd(name.clone(), td),
        Share::Fd(name, ts),
        size,
    );
}

#[test]
fn a_used_ticket_maps_nothing_in_the_importer() {
    let _one = serial();
    let Some(ctx) = gpu("a_used_ticket_maps_nothing_in_the_importer") else {
        return;
    };
    let buf = VmmBuffer::new(&ctx, 2 << 20).unwrap();
    let srv = FdServer::start().unwrap();
    let t = srv
        .offer(Arc::new(export_vmm(buf.ptr()).unwrap()), buf.len() as u64)
        .unwrap();
    let mut imp = Importer::start();
    let line = share_line(&Share::Fd(srv.name().to_string(), t), buf.len());
    assert_eq!(imp.ask(&format!("map {line}")), "mapped 0");
    let again = imp.ask(&format!("map {line}"));
    assert!(
        again.starts_with("error") && again.contains("ticket"),
        "{again}"
    );
}

/// The exporter dies while the importer's copies into its memory run: the importer's copies
/// end (the import keeps the memory alive) within the deadline, and closing the mapping gives
/// the memory back.
#[test]
fn an_exporter_killed_mid_copy_neither_hangs_nor_leaks_the_importer() {
    let _one = serial();
    let Some(ctx) = gpu("an_exporter_killed_mid_copy_neither_hangs_nor_leaks_the_importer") else {
        return;
    };
    // Here the child exports and this process imports: the child is the one killed.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_exporter",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ROLE, "exporter")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let answers = answers_of(child.stdout.take().unwrap());
    let handle = answers
        .recv_timeout(ANSWER_DEADLINE)
        .expect("the exporter's handle")
        .strip_prefix("handle ")
        .expect("a handle line")
        .to_string();
    let (free_before, _) = mem_info();
    let mut b = [0u8; 64];
    b.copy_from_slice(&unhex(&handle));
    let opened = OpenedLegacy::open(&ctx, &LegacyHandle(b)).unwrap();
    let local = DeviceBuffer::new(&ctx, 256 << 20).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let done = Event::new(&ctx, false).unwrap();
    for _ in 0..200 {
        // SAFETY: both ranges are 256 MiB inside live allocations (the import is open).
        unsafe {
            ipc::copy_batch_async(
                &[ipc::Copy {
                    dst: opened.ptr(),
                    src: local.ptr(),
                    len: 256 << 20,
                }],
                stream.raw(),
            )
            .unwrap();
        }
    }
    // SAFETY: live stream of this context.
    unsafe { done.record(stream.raw()).unwrap() };
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let state = loop {
        match done.query() {
            Ok(kvferry_cuda::driver::EventState::Done) => break Ok(()),
            Ok(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Ok(_) => panic!("copies into a dead exporter's memory still pending after 30 s"),
            Err(e) => break Err(e),
        }
    };
    eprintln!("copies after the exporter died: {state:?}");
    drop(opened);
    drop(local);
    let (free_after, _) = mem_info();
    // the exporter's 256 MiB are gone with it and our mapping; allow the driver some slack
    assert!(
        free_after + (8 << 20) >= free_before,
        "device memory not given back: {free_before} free before, {free_after} after"
    );
}

#[test]
fn child_exporter() {
    if std::env::var(ROLE).as_deref() != Ok("exporter") {
        return;
    }
    let ctx = Context::new(0).unwrap();
    let buf = DeviceBuffer::new(&ctx, 256 << 20).unwrap();
    println!("KVF handle {}", hex(&legacy_handle(buf.ptr()).unwrap().0));
    std::io::stdout().flush().unwrap();
    // Wait to be killed.
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
}

fn mem_info() -> (usize, usize) {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: out-pointers to live locals; a context is current.
    unsafe {
        kvferry_cuda::driver::check(
            "cuMemGetInfo",
            kvferry_cuda::sys::cuMemGetInfo_v2(&mut free, &mut total),
        )
        .unwrap()
    };
    (free, total)
}

// ---- The transport through two engines ------------------------------------------------------

use kvferry_transfer::{
    EngineConfig, Location, Op, SegmentHandle, StridedRange, StridedRequest, TransferEngine,
    TransferPath, TransferRequest,
};

/// A child process with an engine and one registered `cuda:0` region of 8 MiB (filled with
/// pattern 7), made with `cuMemAlloc` (`legacy`) or `cuMemCreate` (`vmm`).
/// Commands: `check <off> <len> <seed>` -> `same` | `differ`; `unregister` -> `ok`.
#[test]
fn child_engine() {
    let Ok(kind) = std::env::var(ROLE) else {
        return;
    };
    let Some(kind) = kind.strip_prefix("engine-") else {
        return;
    };
    let ctx = Context::new(0).unwrap();
    let len = 8 << 20;
    let (_d, _v, ptr) = if kind == "vmm" {
        let v = VmmBuffer::new(&ctx, len).unwrap();
        let p = v.ptr();
        (None, Some(v), p)
    } else {
        let d = DeviceBuffer::new(&ctx, len).unwrap();
        let p = d.ptr();
        (Some(d), None, p)
    };
    upload(&ctx, ptr, &pattern(7, len));
    let engine = TransferEngine::new(EngineConfig::default()).unwrap();
    // SAFETY: the buffer lives until this process exits.
    unsafe {
        engine
            .register_memory(ptr, len as u64, Location::Cuda(0))
            .unwrap()
    };
    println!(
        "KVF ready {} {ptr} {len} {:?}",
        engine.segment_name(),
        engine.region_cuda_ipc(ptr)
    );
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        let a = match w.as_slice() {
            ["check", off, n, seed] => {
                let (off, n): (u64, usize) = (off.parse().unwrap(), n.parse().unwrap());
                if download(&ctx, ptr + off, n) == pattern(seed.parse().unwrap(), n) {
                    "same".to_string()
                } else {
                    "differ".to_string()
                }
            }
            ["unregister"] => {
                engine.unregister_memory(ptr).unwrap();
                "ok".to_string()
            }
            _ => format!("error {line:?}"),
        };
        println!("KVF {a}");
    }
}

struct Peer {
    child: Child,
    answers: std::sync::mpsc::Receiver<String>,
    name: String,
    addr: u64,
}

impl Peer {
    fn start(kind: &str) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_engine",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(ROLE, format!("engine-{kind}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let answers = answers_of(child.stdout.take().unwrap());
        let ready = answers
            .recv_timeout(ANSWER_DEADLINE)
            .expect("child engine ready");
        eprintln!("child engine: {ready}");
        let w: Vec<&str> = ready.split_whitespace().collect();
        assert_eq!(w[0], "ready");
        assert!(
            ready.contains("Some(Ok(()))"),
            "the child's region is exported: {ready}"
        );
        Peer {
            child,
            answers,
            name: w[1].to_string(),
            addr: w[2].parse().unwrap(),
        }
    }

    fn ask(&mut self, line: &str) -> String {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        self.answers
            .recv_timeout(ANSWER_DEADLINE)
            .unwrap_or_else(|e| panic!("child engine gave no answer to {line:?}: {e}"))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(
    engine: &TransferEngine,
    seg: &SegmentHandle,
    reqs: &[TransferRequest],
) -> kvferry_transfer::Result<()> {
    let id = engine.submit(seg, reqs)?;
    engine.wait(id, Duration::from_secs(60))
}

/// WRITE and READ between this process's `cuMemAlloc` memory and a child's region of `kind`
/// over CUDA IPC: contiguous and scattered requests land byte for byte; after the child
/// unregisters its region, a WRITE to it is refused (the live table), never applied.
fn engine_round_trip(kind: &str) {
    let ctx = Context::new(0).unwrap();
    let mut peer = Peer::start(kind);
    let len = 8usize << 20;
    let local = DeviceBuffer::new(&ctx, len).unwrap();
    upload(&ctx, local.ptr(), &pattern(3, len));
    let engine = TransferEngine::new(EngineConfig::default()).unwrap();
    // SAFETY: `local` outlives the engine's use of it (dropped after the engine below).
    unsafe {
        engine
            .register_memory(local.ptr(), len as u64, Location::Cuda(0))
            .unwrap()
    };
    assert!(matches!(engine.region_cuda_ipc(local.ptr()), Some(Ok(()))));
    let seg = engine.open_segment(&peer.name).unwrap();
    // Opening the segment imported the peer's allocation (the warm-up): the first post finds
    // it mapped and asks the peer for nothing.
    assert_eq!(
        engine.stats().connections,
        1,
        "the peer's allocation is mapped once the segment is open, before any transfer"
    );
    assert_eq!(
        engine.transfer_path(&seg, local.ptr(), peer.addr).unwrap(),
        TransferPath::CudaIpc
    );
    // contiguous 1 MiB: local [0, 1 MiB) -> remote [8 KiB, ...)
    let remote = peer.addr;
    let w = |l: u64, r: u64, n: u64| TransferRequest {
        op: Op::Write,
        local_addr: local.ptr() + l,
        remote_addr: remote + r,
        len: n,
    };
    run(&engine, &seg, &[w(0, 8192, 1 << 20)]).unwrap();
    assert_eq!(peer.ask(&format!("check 8192 {} 3", 1 << 20)), "same");
    assert_eq!(
        engine.stats().connections,
        1,
        "the first transfer used the mapping the warm-up made, not one of its own"
    );
    // scattered: 64 pieces of 4 KiB at every other 4 KiB from 2 MiB on both sides
    let reqs: Vec<TransferRequest> = (0..64u64)
        .map(|i| w((2 << 20) + 8192 * i, (2 << 20) + 8192 * i, 4096))
        .collect();
    run(&engine, &seg, &reqs).unwrap();
    // READ: remote [6 MiB, 7 MiB) (pattern 7, untouched by the writes) -> local [4 MiB, ...)
    run(
        &engine,
        &seg,
        &[TransferRequest {
            op: Op::Read,
            local_addr: local.ptr() + (4 << 20),
            remote_addr: peer.addr + (6 << 20),
            len: 1 << 20,
        }],
    )
    .unwrap();
    assert!(
        download(&ctx, local.ptr() + (4 << 20), 1 << 20)[..] == pattern(7, len)[6 << 20..7 << 20],
        "bytes read over CUDA IPC differ"
    );
    // scattered READ back of what was written: equals this side's pattern at those offsets
    let reqs: Vec<TransferRequest> = (0..64u64)
        .map(|i| TransferRequest {
            op: Op::Read,
            local_addr: local.ptr() + (6 << 20) + 4096 * i,
            remote_addr: peer.addr + (2 << 20) + 8192 * i,
            len: 4096,
        })
        .collect();
    run(&engine, &seg, &reqs).unwrap();
    let back = download(&ctx, local.ptr() + (6 << 20), 64 * 4096);
    let src = pattern(3, len);
    for i in 0..64usize {
        let o = (2 << 20) + 8192 * i;
        assert!(
            back[4096 * i..4096 * (i + 1)] == src[o..o + 4096],
            "scattered piece {i} differs"
        );
    }
    strided_round_trip(&ctx, &engine, &seg, local.ptr(), peer.addr);
    // the child unregisters: the next WRITE is refused and changes nothing
    assert_eq!(peer.ask("unregister"), "ok");
    let e = run(&engine, &seg, &[w(0, 0, 4096)]).unwrap_err();
    eprintln!("WRITE after the peer unregistered: {e}");
    assert!(e.to_string().contains("not inside a buffer"), "{e}");
    assert_eq!(
        peer.ask("check 0 4096 7"),
        "same",
        "the refused WRITE changed nothing"
    );
    drop(engine);
}

/// Strided WRITE then strided READ back (ranges of 16-byte and odd lengths, one longer than
/// the kernel's longest piece) of 8 blocks: local [3 MiB, ...) → remote [3 MiB, ...) →
/// local [5 MiB, ...); every copy's bytes come back equal. A strided request one block of
/// which is past the peer's buffer is refused as the per-copy submit refuses it.
fn strided_round_trip(
    ctx: &Context,
    engine: &TransferEngine,
    seg: &SegmentHandle,
    local: u64,
    remote: u64,
) {
    let r = |l, r, len| StridedRange {
        local: l,
        remote: r,
        len,
    };
    let ranges = vec![r(0, 0, 1024), r(4096, 2048, 3000), r(10_000, 9_008, 70_000)];
    let stride = 96u64 << 10;
    let blocks = |l0: u64| -> Vec<(u64, u64)> {
        (0..8u64)
            .map(|i| {
                (
                    local + l0 + stride * (7 - i),
                    remote + (3 << 20) + stride * i,
                )
            })
            .collect()
    };
    let req = |op, l0| StridedRequest {
        op,
        ranges: ranges.clone(),
        blocks: blocks(l0),
    };
    let id = engine
        .submit_strided(seg, &[req(Op::Write, 3 << 20)])
        .unwrap();
    engine.wait(id, Duration::from_secs(60)).unwrap();
    let id = engine
        .submit_strided(seg, &[req(Op::Read, 5 << 20)])
        .unwrap();
    engine.wait(id, Duration::from_secs(60)).unwrap();
    let src = pattern(3, 8 << 20);
    let back = download(ctx, local + (5 << 20), 8 * stride as usize);
    for i in 0..8usize {
        for g in &ranges {
            let s = (3 << 20) + stride as usize * (7 - i) + g.local as usize;
            let b = stride as usize * (7 - i) + g.local as usize;
            assert!(
                back[b..b + g.len as usize] == src[s..s + g.len as usize],
                "strided block {i} range {g:?} differs"
            );
        }
    }
    let mut past = req(Op::Write, 3 << 20);
    past.blocks.push((local, remote + (8 << 20) - 4096));
    let e = engine.submit_strided(seg, &[past]).unwrap_err();
    assert!(
        matches!(e, kvferry_transfer::TransferError::RemoteOutOfRange { .. }),
        "{e}"
    );
}

#[test]
fn engine_cuda_ipc_legacy_memory() {
    let _one = serial();
    if gpu("engine_cuda_ipc_legacy_memory").is_none() {
        return;
    }
    engine_round_trip("legacy");
}

#[test]
fn engine_cuda_ipc_vmm_memory() {
    let _one = serial();
    if gpu("engine_cuda_ipc_vmm_memory").is_none() {
        return;
    }
    engine_round_trip("vmm");
}

/// The peer process is killed while batches into its memory run: every batch ends within its
/// deadline (no hang), and a later one fails naming the exited process.
#[test]
fn engine_cuda_ipc_peer_killed_mid_transfer() {
    let _one = serial();
    let Some(ctx) = gpu("engine_cuda_ipc_peer_killed_mid_transfer") else {
        return;
    };
    let mut peer = Peer::start("legacy");
    let len = 8usize << 20;
    let local = DeviceBuffer::new(&ctx, len).unwrap();
    let engine = TransferEngine::new(EngineConfig::default()).unwrap();
    // SAFETY: `local` outlives the engine's use of it.
    unsafe {
        engine
            .register_memory(local.ptr(), len as u64, Location::Cuda(0))
            .unwrap()
    };
    let seg = engine.open_segment(&peer.name).unwrap();
    let req = TransferRequest {
        op: Op::Write,
        local_addr: local.ptr(),
        remote_addr: peer.addr,
        len: len as u64,
    };
    run(&engine, &seg, &[req]).unwrap();
    let ids: Vec<_> = (0..200)
        .map(|_| engine.submit(&seg, &[req]).unwrap())
        .collect();
    let _ = peer.child.kill();
    let _ = peer.child.wait();
    let t = Instant::now();
    for id in ids {
        let _ = engine.wait(id, Duration::from_secs(60));
    }
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "batches hung after the peer died"
    );
    let e = run(&engine, &seg, &[req]).unwrap_err();
    eprintln!("WRITE after the peer died: {e}");
    assert!(e.to_string().contains("exited"), "{e}");
}

/// An engine of this process with `buf`'s `len` bytes registered (the caller keeps `buf` past
/// the engine: declared before it, it drops after).
fn engine_of(buf: &DeviceBuffer, len: usize) -> Arc<TransferEngine> {
    let e = TransferEngine::new(EngineConfig::default()).unwrap();
    // SAFETY: the caller keeps `buf` alive past the engine's use of it.
    unsafe {
        e.register_memory(buf.ptr(), len as u64, Location::Cuda(0))
            .unwrap();
    }
    e
}

/// Two engines of one process: device memory moves as in-process device copies.
#[test]
fn engine_cuda_ipc_in_one_process() {
    let _one = serial();
    let Some(ctx) = gpu("engine_cuda_ipc_in_one_process") else {
        return;
    };
    let len = 4usize << 20;
    let a = DeviceBuffer::new(&ctx, len).unwrap();
    let b = DeviceBuffer::new(&ctx, len).unwrap();
    upload(&ctx, a.ptr(), &pattern(11, len));
    let (ea, eb) = (engine_of(&a, len), engine_of(&b, len));
    let seg = ea.open_segment(&eb.segment_name()).unwrap();
    assert_eq!(
        ea.stats().connections,
        1,
        "the peer's live table is fetched when the segment opens, before any transfer"
    );
    assert_eq!(
        ea.transfer_path(&seg, a.ptr(), b.ptr()).unwrap(),
        TransferPath::CudaIpc
    );
    ea.transfer_sync_write(&eb.segment_name(), a.ptr(), b.ptr(), len as u64)
        .unwrap();
    assert!(download(&ctx, b.ptr(), len) == pattern(11, len));
}

/// A strided READ's device points order device work after its copies: a stream that waits on
/// them and then reads the landed bytes back sees them all, even with the lane busy with
/// earlier copies when the READ is submitted (no host wait between the submit and the read
/// back).
#[test]
fn strided_points_order_device_work_after_the_copies() {
    let _one = serial();
    let Some(ctx) = gpu("strided_points_order_device_work_after_the_copies") else {
        return;
    };
    const PART: usize = 64 << 20;
    let len = 3 * PART;
    let a = DeviceBuffer::new(&ctx, len).unwrap();
    let b = DeviceBuffer::new(&ctx, len).unwrap();
    upload(&ctx, a.ptr(), &pattern(13, PART));
    upload(&ctx, b.ptr(), &vec![0u8; PART]);
    let (ea, eb) = (engine_of(&a, len), engine_of(&b, len));
    let seg = eb.open_segment(&ea.segment_name()).unwrap();
    // Earlier copies on the same engine, not waited for: the READ queues behind them.
    let busy: Vec<_> = (0..8)
        .map(|i| {
            let off = PART as u64 + (i % 2) * PART as u64;
            let req = TransferRequest {
                op: Op::Write,
                local_addr: b.ptr() + off,
                remote_addr: a.ptr() + off,
                len: PART as u64,
            };
            eb.submit(&seg, &[req]).unwrap()
        })
        .collect();
    let block = 1u64 << 20;
    let read = StridedRequest {
        op: Op::Read,
        ranges: vec![StridedRange {
            local: 0,
            remote: 0,
            len: block,
        }],
        blocks: (0..PART as u64 / block)
            .map(|i| (b.ptr() + i * block, a.ptr() + i * block))
            .collect(),
    };
    let (id, points) = eb.submit_strided_with_points(&seg, &[read]).unwrap();
    let points = points.expect("CUDA IPC copies have device points");
    assert!(!points.is_empty());
    let s = Stream::new(&ctx).unwrap();
    let mut back = vec![0u8; PART];
    // SAFETY: the points are events of this device; `b` has PART bytes; the stream is
    // synchronised before `back` is read.
    unsafe {
        for p in &points {
            kvferry_cuda::driver::stream_wait(s.raw(), p).unwrap();
        }
        copy_dtoh_async(back.as_mut_ptr(), b.ptr(), PART, s.raw()).unwrap();
    }
    s.synchronize().unwrap();
    assert!(
        back == pattern(13, PART),
        "read back before the copies ended"
    );
    eb.wait(id, Duration::from_secs(60)).unwrap();
    for id in busy {
        eb.wait(id, Duration::from_secs(60)).unwrap();
    }
}
