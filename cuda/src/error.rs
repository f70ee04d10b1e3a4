//! The CUDA layer's error: what was being done, with the driver's error kept as the source.

use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;
use thiserror::Error;

/// A failure of the CUDA layer (probe, driver call, kernel compilation). Cloneable, since
/// probes and per-device states cache their outcome for the process's life.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CudaError {
    /// The driver library (`libcuda.so.1`) cannot be loaded.
    #[error("libcuda not found")]
    DriverLibraryMissing,
    /// The NVRTC library cannot be loaded (kernels are compiled at run time).
    #[error("libnvrtc not found (set KVFERRY_NVRTC_DIR or LD_LIBRARY_PATH)")]
    NvrtcLibraryMissing,
    /// A driver call failed. Shown with the error code's name (DriverError's own Display asks
    /// libcuda for a text, which cudarc panics on where the library is missing).
    #[error("{what}: {:?}", .source.0)]
    Driver {
        /// The call (and what it was for).
        what: String,
        /// The driver's error code.
        #[source]
        source: DriverError,
    },
    /// cudarc panicked inside a call (a missing library or symbol); caught, never propagated.
    #[error("{what}: {message}")]
    Panicked {
        /// What was being done.
        what: String,
        /// The panic's message.
        message: String,
    },
    /// The device ordinal is not below the device count.
    #[error("cuda:{ordinal} does not exist ({count} devices)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices present.
        count: u32,
    },
    /// An NVRTC call failed (creating a program, reading its image).
    #[error("{what}: {:?}", .source.0)]
    Nvrtc {
        /// The call.
        what: String,
        /// NVRTC's error code.
        #[source]
        source: NvrtcError,
    },
    /// NVRTC could not compile a kernel source; `log` is its compile log.
    #[error("{what}: {:?}\n{log}", .source.0)]
    Compile {
        /// Source name and architecture (and an earlier attempt's failure).
        what: String,
        /// NVRTC's log (may be empty).
        log: String,
        /// NVRTC's error code.
        #[source]
        source: NvrtcError,
    },
    /// A value handed to the driver cannot be passed as given (e.g. a name with a NUL byte).
    #[error("{0}")]
    Invalid(InvalidArg),
}

/// A value the driver cannot take as given ([`CudaError::Invalid`]).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum InvalidArg {
    /// A name or source text (`what`) with a NUL byte.
    #[error("{what} {name:?}: {source}")]
    Nul {
        /// What it is: `"kernel name"`, `"name"`, `"source"`.
        what: &'static str,
        /// The name (of the source: its program name).
        name: String,
        /// Where the NUL is.
        source: std::ffi::NulError,
    },
    /// More items (`what`: pieces, strided groups) in one launch than its 32-bit count holds.
    #[error("{count} {what} in one launch")]
    TooMany {
        /// What is counted.
        what: &'static str,
        /// How many.
        count: usize,
    },
    /// An allocation size (bytes) that does not fit in `usize`.
    #[error("allocation size {0} too large")]
    Size(u64),
    /// The driver's export returned no file descriptor.
    #[error("cuMemExportToShareableHandle returned no file descriptor")]
    NoFd,
}

impl CudaError {
    /// A failed NVRTC call `what` with its error code.
    pub fn nvrtc(what: impl Into<String>, source: NvrtcError) -> CudaError {
        CudaError::Nvrtc {
            what: what.into(),
            source,
        }
    }

    /// A failed driver call `what` with its error code.
    pub fn driver(what: impl Into<String>, source: DriverError) -> CudaError {
        CudaError::Driver {
            what: what.into(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;
    use std::error::Error as _;

    #[test]
    fn a_driver_failure_keeps_the_driver_error_as_source() {
        let e = CudaError::driver(
            "cuMemAlloc",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        );
        let src = e.source().expect("the driver error is the source");
        assert_eq!(
            src.downcast_ref::<DriverError>(),
            Some(&DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))
        );
        assert!(e.to_string().starts_with("cuMemAlloc: "), "{e}");
    }
}
