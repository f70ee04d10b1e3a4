//! Finding the CUDA driver at run time (docs/design.md §5: dynamic loading, detect first,
//! never panic). The one probe of kvferry: the kernels and the transfer engine ask here.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::CudaError;

/// Runs `f`, turning a panic inside cudarc (a missing library or symbol) into an error that
/// starts with `what`.
pub fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, CudaError>) -> Result<T, CudaError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            Err(CudaError::Panicked {
                what: what.into(),
                message: msg,
            })
        }
    }
}

/// Whether the CUDA driver library (`libcuda.so.1`) can be loaded (probed once).
pub fn driver_library_present() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    *P.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries to dlopen the library; a panic inside cudarc
        // is caught here.
        catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    })
}

/// Whether the CUDA driver is usable here: the number of devices after `cuInit`, or why not
/// (`libcuda` missing, `cuInit` failing). Probed once per process; never panics.
pub fn cuda_available() -> Result<u32, CudaError> {
    static P: OnceLock<Result<u32, CudaError>> = OnceLock::new();
    P.get_or_init(|| {
        if !driver_library_present() {
            return Err(CudaError::DriverLibraryMissing);
        }
        guarded("cuInit", || {
            // SAFETY: the library is present; cuInit and cuDeviceGetCount take plain values and
            // an out-pointer to a live local.
            unsafe {
                sys::cuInit(0)
                    .result()
                    .map_err(|e| CudaError::driver("cuInit", e))?;
                let mut n = 0;
                sys::cuDeviceGetCount(&mut n)
                    .result()
                    .map_err(|e| CudaError::driver("cuDeviceGetCount", e))?;
                Ok(n.max(0) as u32)
            }
        })
    })
    .clone()
}
