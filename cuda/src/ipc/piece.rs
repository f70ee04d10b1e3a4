//! What the piece kernels share: one copy, the table of a launch, and how a kernel is loaded
//! and launched with its table.

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::driver::{Context, DriverResult, Event, Function, Module, Stream};
use crate::staging::Staging;

/// Threads per block of every piece kernel launch.
const THREADS: u32 = 256;

/// One copy of a batch: `len` bytes from device address `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    /// Destination device address.
    pub dst: u64,
    /// Source device address.
    pub src: u64,
    /// Bytes.
    pub len: usize,
}

/// The piece list of one launch: pinned host memory and its device copy, grown as needed,
/// and the event that marks its upload done. Reused only after the launch that read it has
/// completed.
pub struct PieceTable {
    mem: Option<Staging>,
    /// Memory outgrown, kept until the table drops: freeing pinned or device memory
    /// synchronises the whole device, which must not happen on the submit path.
    outgrown: Vec<Staging>,
    uploaded: Option<Event>,
}

/// Bytes a table grows to at the least.
const TABLE_MIN_BYTES: usize = 64 << 10;

impl PieceTable {
    /// An empty table (allocated on first use).
    pub fn new() -> PieceTable {
        PieceTable {
            mem: None,
            outgrown: Vec::new(),
            uploaded: None,
        }
    }

    /// `count` tables of `bytes` bytes of table each, from one allocation made now in `ctx`
    /// (made current here, by the allocation), with their upload events: allocating ahead
    /// keeps allocations, which synchronise the device, off the submit path. Errors: the
    /// driver's, or [`Staging::ahead`]'s.
    pub fn ahead(ctx: &Context, bytes: usize, count: usize) -> DriverResult<Vec<PieceTable>> {
        Staging::ahead(ctx, bytes, count)?
            .into_iter()
            .map(|mem| {
                Ok(PieceTable {
                    mem: Some(mem),
                    outgrown: Vec::new(),
                    uploaded: Some(Event::new(ctx, false)?),
                })
            })
            .collect()
    }

    /// Bytes of table a launch may use without growing it (0 before its first use).
    pub fn capacity(&self) -> usize {
        self.mem.as_ref().map_or(0, Staging::len)
    }

    /// The memory this table outgrew, as tables of their own (their upload events made at
    /// their first launch), once the launch that used this table has completed: a part
    /// allocated ahead that a table outgrew is a spare table again.
    pub fn take_outgrown(&mut self) -> Vec<PieceTable> {
        self.outgrown
            .drain(..)
            .map(|mem| PieceTable {
                mem: Some(mem),
                outgrown: Vec::new(),
                uploaded: None,
            })
            .collect()
    }
}

impl Default for PieceTable {
    fn default() -> Self {
        Self::new()
    }
}

impl PieceTable {
    /// The table's memory, grown (to a power of two, at least 64 KiB) to hold `bytes`.
    /// Errors: the driver's allocation failures.
    pub(crate) fn ensure(&mut self, ctx: &Context, bytes: usize) -> DriverResult<&Staging> {
        if self.mem.as_ref().is_none_or(|m| m.len() < bytes) {
            let grown = Staging::new(ctx, bytes.next_power_of_two().max(TABLE_MIN_BYTES))?;
            // Nothing reads the old memory any more (the previous launch completed), but
            // freeing it would synchronise the device: it stays until the table drops.
            self.outgrown.extend(self.mem.replace(grown));
        }
        Ok(self.mem.as_ref().expect("made above"))
    }
}

/// A piece kernel compiled with NVRTC and loaded in one device's context, with the largest
/// grid worth launching (the blocks of [`THREADS`] threads the device keeps resident). Shared
/// by any number of enqueues at once; each brings its own [`PieceTable`].
pub(crate) struct LoadedKernel {
    _module: Module,
    func: Function,
    /// Resident blocks of the device at 256 threads per block (at least one per
    /// multiprocessor).
    pub(crate) grid_max: u32,
    /// Where the tables go up: beside the launch streams, so that a launch queued behind
    /// another waits for that one only, not for its own upload queued behind it too (the
    /// host-to-device copy and its hand-over to the kernel cost microseconds per launch).
    uploads: Stream,
    // Last: the module above is unloaded with the context still retained.
    ctx: Context,
}

impl LoadedKernel {
    /// Compiles `src` (named `file` in NVRTC's messages) for `ordinal`'s device and loads its
    /// kernel `name`. Errors: NVRTC missing or failing, the driver's.
    pub(crate) fn load(ordinal: u32, src: &str, file: &str, name: &str) -> DriverResult<Self> {
        let ctx = Context::new(ordinal)?;
        let image = crate::nvrtc::compile(src, file, ctx.compute_capability()?)?;
        let module = Module::load(&ctx, &image)?;
        let func = module.function(name)?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as u32;
        let grid_max = sms.max(1) * func.occupancy(THREADS)?.max(1);
        ctx.bind()?;
        let uploads = Stream::new(&ctx)?;
        Ok(LoadedKernel {
            _module: module,
            func,
            grid_max,
            uploads,
            ctx,
        })
    }

    /// Makes the kernel's context current on this thread. Errors: the driver's.
    pub(crate) fn bind(&self) -> DriverResult<()> {
        self.ctx.bind()
    }

    /// Writes a table of `words` u64 words with `fill` into `table`'s pinned host buffer,
    /// enqueues its upload on the kernel's upload stream and makes `stream` wait for it (so
    /// the upload runs while `stream` still works on earlier launches); returns the device
    /// address of the table. Errors: the driver's (growing the table, its event, the upload).
    ///
    /// # Safety
    /// `stream` belongs to this kernel's context, which is current; `table`'s previous launch
    /// has completed and `table` lives until the launch that reads this upload has.
    pub(crate) unsafe fn upload(
        &self,
        table: &mut PieceTable,
        words: usize,
        fill: impl FnOnce(&mut [u64]),
        stream: sys::CUstream,
    ) -> DriverResult<u64> {
        let bytes = words * 8;
        let mem = table.ensure(&self.ctx, bytes)?;
        let (host, dev) = (mem.host(), mem.dev());
        // SAFETY: the pinned table (256-byte aligned) holds at least `bytes`; its previous
        // launch has completed (contract), so nothing reads it now.
        fill(unsafe { std::slice::from_raw_parts_mut(host as *mut u64, words) });
        if table.uploaded.is_none() {
            table.uploaded = Some(Event::new(&self.ctx, false)?);
        }
        let done = table.uploaded.as_ref().expect("made above");
        let up = self.uploads.raw();
        // SAFETY: the upload reads `bytes` of pinned memory the table keeps until its launch
        // completed (contract); the upload stream and the event belong to this kernel's
        // context, as `stream` does (contract); `stream`'s launch after this waits for the
        // event, so it reads the table only once it is up.
        unsafe {
            crate::driver::copy_htod_async(dev, host, bytes, up)?;
            done.record(up)?;
            crate::driver::stream_wait(stream, done)?;
        }
        Ok(dev)
    }

    /// Launches the kernel on `stream` with `grid` blocks of [`THREADS`] threads; `params`
    /// point at its argument values, in order. Errors: the driver's.
    ///
    /// # Safety
    /// As [`Function::launch`]: the arguments match the kernel's signature and the memory they
    /// name is valid until the launch completes; `stream` belongs to this kernel's context.
    pub(crate) unsafe fn launch(
        &self,
        stream: sys::CUstream,
        grid: u32,
        params: &mut [*mut c_void],
    ) -> DriverResult<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.func.launch(stream, grid, THREADS, params) }
    }
}
