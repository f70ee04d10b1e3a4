//! The KV checksum of blocks of KV cache tensors (docs/design.md §2.1; the seed's "What a checksum
//! is"), from Python: one value per block position over a rank's layers, on the CPU for host
//! tensors and on the GPU for CUDA tensors (ordered after the caller's stream, no host sync), and
//! the layer fingerprints of §2.3. The pure-Python face is `kvferry/checksum.py`.

use kvferry_transfer::sync::MutexExt;
use std::sync::Mutex;
use std::time::Duration;

use kvferry_checksum::definition::MAX_KV_HEADS_PER_LAYER;
use kvferry_checksum::fingerprint::layer_fingerprint as fingerprint_of;
use kvferry_checksum::select::BlockSelection;
use kvferry_kernels::{ChecksumBackend, CpuBackend, GroupJob, KernelError, Location, Pending};
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

use crate::layer::{device_name, layers_of, KVCacheLayer};
use crate::runtime::seconds;

enum State {
    /// Still running on the GPU.
    Running(Box<dyn Pending>),
    /// Taken: the values (returned again by later waits) or the error.
    Done(Result<Vec<u64>, String>),
}

/// Checksums being computed (from ``kvferry.checksum.submit``): one value per block id, once
/// ready. CPU tensors are checksummed when submitted, so their result is ready at once; CUDA
/// tensors are checksummed on kvferry's side streams after the work queued on the caller's
/// stream, and nothing here synchronises that stream. The tensors are kept alive until the
/// result is taken; they must not be written meanwhile if the values are to mean anything.
#[pyclass(module = "kvferry")]
pub struct KVChecksumPending {
    state: Mutex<State>,
    keep: Mutex<Vec<Py<PyAny>>>,
}

fn take(
    results: Result<Vec<kvferry_kernels::GroupResult>, KernelError>,
) -> Result<Vec<u64>, String> {
    let mut results = results.map_err(|e| e.to_string())?;
    let r = results.pop().ok_or("the backend returned no result")?;
    let mut values = r.values.into_values();
    Ok(values.next().unwrap_or_default())
}

#[pymethods]
impl KVChecksumPending {
    /// Whether the values are ready (never blocks).
    fn done(&self) -> bool {
        let mut st = self.state.locked();
        if let State::Running(p) = &mut *st {
            match p.poll() {
                None => return false,
                Some(r) => *st = State::Done(take(r)),
            }
        }
        self.keep.locked().clear();
        true
    }

    /// Waits at most ``timeout`` seconds (the GIL released) and returns the values: a list of
    /// int (u64), one per block id, in the order given. Raises TimeoutError when not ready by
    /// then (wait again later), RuntimeError when the device failed.
    #[pyo3(signature = (timeout=30.0))]
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<Vec<u64>> {
        let timeout = seconds(timeout, "timeout")?;
        let result = py.detach(|| {
            let mut st = self.state.locked();
            if let State::Running(p) = &mut *st {
                match p.wait(timeout) {
                    Err(KernelError::Timeout(t)) => return Err(t),
                    r => *st = State::Done(take(r)),
                }
            }
            match &*st {
                State::Done(r) => Ok(r.clone()),
                State::Running(_) => Err(timeout),
            }
        });
        let values = result
            .map_err(|t| PyTimeoutError::new_err(format!("checksums not ready after {t:?}")))?;
        self.keep.locked().clear();
        values.map_err(PyRuntimeError::new_err)
    }
}

/// Submits the checksum of `block_ids` (logical block ids at request positions `start`, `start+1`,
/// ...) over `layers`, tokens before `num_tokens`; CUDA work is ordered after `stream` (a raw
/// `cudaStream_t` as int; 0 is the legacy default stream). Called by `kvferry.checksum.submit`.
#[pyfunction]
#[pyo3(signature = (layers, block_ids, num_tokens, start=0, stream=None))]
fn _submit_checksums(
    py: Python<'_>,
    layers: Vec<Py<KVCacheLayer>>,
    block_ids: Vec<u64>,
    num_tokens: u64,
    start: u64,
    stream: Option<u64>,
) -> PyResult<KVChecksumPending> {
    let inputs = layers_of(py, &layers)?;
    let device = layers[0].bind(py).get().device;
    for l in &layers {
        let l = l.bind(py).get();
        if l.device != device {
            return Err(PyValueError::new_err(format!(
                "layer {:?} is on {}, layer {:?} on {}: checksum one device's layers at a time",
                l.spec.name,
                device_name(l.device),
                inputs[0].spec.name,
                device_name(device)
            )));
        }
        if l.spec.replica != inputs[0].spec.replica {
            return Err(PyValueError::new_err(format!(
                "layer {:?} is replica {:?}, layer {:?} replica {:?}: checksum each replica key's \
                 layers separately (their values are not summed, docs/design.md §2.3)",
                l.spec.name, l.spec.replica, inputs[0].spec.name, inputs[0].spec.replica
            )));
        }
    }
    let job = GroupJob {
        group_id: 0,
        block_size: inputs[0].spec.geometry.block_size(),
        layers: inputs,
        selection: BlockSelection { start, block_ids },
        num_tokens,
        device,
    };
    kvferry_kernels::validate_job(&job).map_err(|e| match e {
        KernelError::InvalidJob { why, .. } => PyValueError::new_err(why.to_string()),
        other => PyValueError::new_err(other.to_string()),
    })?;
    let keep: Vec<Py<PyAny>> = layers
        .iter()
        .flat_map(|l| l.bind(py).get().keep.iter().map(|k| k.clone_ref(py)))
        .collect();
    let state = match device {
        Location::Cpu => {
            let r = py.detach(|| {
                // SAFETY: validate_job checked every layer's byte span lies within the tensor
                // it was read from, and `layers` keeps each tensor alive for this call.
                let pending = unsafe { CpuBackend::new(cpu_threads()).submit(vec![job]) };
                pending.and_then(|p| p.wait(Duration::from_secs(3600)))
            });
            State::Done(take(r))
        }
        Location::Cuda(n) => {
            let backend = kvferry_kernels::cuda::CudaBackend::shared(n).map_err(|e| {
                PyRuntimeError::new_err(format!("CUDA checksum backend for cuda:{n}: {e}"))
            })?;
            let after = stream.unwrap_or(0);
            // SAFETY: the layers are CUDA tensors of device n (checked by the tensor reader),
            // kept alive by the pending value until its result is taken; `after` is the
            // caller's stream handle on that device (the caller's contract, documented).
            let p = py
                .detach(|| unsafe {
                    let raw = after as usize as kvferry_kernels::cuda::RawStream;
                    backend.submit_after(vec![job], Some(raw))
                })
                .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
            State::Running(Box::new(p))
        }
    };
    Ok(KVChecksumPending {
        state: Mutex::new(state),
        keep: Mutex::new(keep),
    })
}

/// Threads for CPU checksums: the machine's cores, at most 8.
fn cpu_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(8)
}

/// layer_fingerprint(name, kind, block_size, dtype) -> int
///
/// One layer's fingerprint (docs/design.md §2.3): the first 8 bytes, little-endian, of the SHA-256 of
/// ``repr((name, kind, block_size, dtype))``, as a u64. A group's fingerprint is the sum of its
/// layers' mod 2**64 (see ``group_fingerprint``).
#[pyfunction]
fn layer_fingerprint(name: &str, kind: &str, block_size: u64, dtype: &str) -> u64 {
    fingerprint_of(name, kind, block_size, dtype)
}

/// group_fingerprint(layers) -> int | None
///
/// The fingerprint part of one rank's layers of a group: the sum of ``layer_fingerprint`` of
/// every layer, mod 2**64, with each layer's own block size (docs/design.md §2.3). None when a layer
/// has no ``kind`` or ``dtype``. The producer and consumer sums add these parts over PP stages.
#[pyfunction]
fn group_fingerprint(py: Python<'_>, layers: Vec<Py<KVCacheLayer>>) -> Option<u64> {
    layers.iter().try_fold(0u64, |acc, l| {
        let s = &l.bind(py).get().spec;
        Some(acc.wrapping_add(fingerprint_of(
            &s.name,
            s.kind.as_deref()?,
            s.geometry.block_size(),
            s.dtype.as_deref()?,
        )))
    })
}

/// Registers the functions and classes of this file.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KVChecksumPending>()?;
    m.add_function(wrap_pyfunction!(_submit_checksums, m)?)?;
    m.add_function(wrap_pyfunction!(layer_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(group_fingerprint, m)?)?;
    m.add("MAX_KV_HEADS_PER_LAYER", MAX_KV_HEADS_PER_LAYER)?;
    Ok(())
}
