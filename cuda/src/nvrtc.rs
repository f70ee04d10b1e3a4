//! Compiling CUDA C with NVRTC at run time (docs/design.md §5: dynamic loading, detect, never
//! panic): the checksum kernels (kvferry-kernels) and the CUDA IPC copy kernel ([`crate::ipc`])
//! are compiled here.
//!
//! cudarc loads `libcuda`/`libnvrtc` lazily and panics when they are absent, so every
//! entry point first checks that the libraries load (`is_culib_present`), then runs the
//! first calls inside `catch_unwind` as a last resort.

use crate::{CudaError, InvalidArg};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::ffi::CString;
use std::panic::catch_unwind;
use std::sync::OnceLock;

use crate::guarded;

/// Directories where a CUDA toolkit's NVRTC often lives but the loader may not look.
fn nvrtc_dirs() -> Vec<String> {
    let mut dirs = Vec::new();
    if let Ok(d) = std::env::var("KVFERRY_NVRTC_DIR") {
        dirs.push(d);
    }
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Ok(d) = std::env::var(var) {
            dirs.push(format!("{d}/lib64"));
            dirs.push(format!("{d}/lib"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs.push("/usr/local/cuda/targets/sbsa-linux/lib".into());
    dirs
}

/// Whether NVRTC can be loaded. If the loader's search path lacks it, a copy in a usual
/// toolkit directory is loaded (and kept) so that cudarc's later `dlopen` by soname finds it.
pub fn nvrtc_library_present() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    *P.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries to dlopen NVRTC; a panic in cudarc is caught.
        let present = || catch_unwind(|| unsafe { nvrtc_sys::is_culib_present() }).unwrap_or(false);
        if present() {
            return true;
        }
        for dir in nvrtc_dirs() {
            for name in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] {
                let path = format!("{dir}/{name}");
                if std::path::Path::new(&path).exists() {
                    // NVRTC dlopens its builtins by soname at compile time: load them first.
                    if let Ok(rd) = std::fs::read_dir(&dir) {
                        for f in rd.flatten() {
                            let n = f.file_name().to_string_lossy().into_owned();
                            if n.starts_with("libnvrtc-builtins.so") {
                                // SAFETY: loading NVRTC's builtins library runs no initialiser
                                // with preconditions; it is kept loaded for the process's life.
                                if let Ok(lib) = unsafe { libloading::Library::new(f.path()) } {
                                    std::mem::forget(lib);
                                }
                            }
                        }
                    }
                    // SAFETY: loading NVRTC runs no initialiser with preconditions; it is kept
                    // loaded for the process's life.
                    if let Ok(lib) = unsafe { libloading::Library::new(&path) } {
                        // Kept loaded for the process's life: cudarc holds its own handle by soname.
                        std::mem::forget(lib);
                        if present() {
                            return true;
                        }
                    }
                }
            }
        }
        false
    })
}

/// Compiles CUDA C `src` with NVRTC for compute capability `cc`: a CUBIN for `sm_XY`,
/// or, if this NVRTC does not know that architecture, PTX for `compute_90` (NUL-
/// terminated) for the driver to finish. Errors carry NVRTC's log.
pub fn compile(src: &str, name: &str, cc: (i32, i32)) -> Result<Vec<u8>, CudaError> {
    if !nvrtc_library_present() {
        return Err(CudaError::NvrtcLibraryMissing);
    }
    guarded("nvrtc", || {
        let sm = format!("--gpu-architecture=sm_{}{}", cc.0, cc.1);
        match compile_with(src, name, &sm, true) {
            Ok(cubin) => Ok(cubin),
            Err(e) => {
                compile_with(src, name, "--gpu-architecture=compute_90", false).map_err(|e2| {
                    match e2 {
                        CudaError::Compile { what, log, source } => CudaError::Compile {
                            what: format!("{what} (PTX fallback, after {sm}: {e})"),
                            log,
                            source,
                        },
                        other => other,
                    }
                })
            }
        }
    })
}

fn compile_with(src: &str, name: &str, arch: &str, cubin: bool) -> Result<Vec<u8>, CudaError> {
    let nul = |what: &'static str| {
        move |source| {
            CudaError::Invalid(InvalidArg::Nul {
                what,
                name: name.to_string(),
                source,
            })
        }
    };
    let csrc = CString::new(src).map_err(nul("source"))?;
    let cname = CString::new(name).map_err(nul("name"))?;
    let prog = nvrtc::create_program(&csrc, Some(&cname))
        .map_err(|e| CudaError::nvrtc("nvrtcCreateProgram", e))?;
    let opts = [
        arch.to_string(),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
    ];
    // SAFETY: `prog` is a live program created above; the options outlive the call; the log and
    // image are read with sizes NVRTC reports.
    let out = unsafe {
        match nvrtc::compile_program(prog, &opts) {
            Ok(()) => {
                if cubin {
                    let mut n = 0usize;
                    nvrtc_sys::nvrtcGetCUBINSize(prog, &mut n)
                        .result()
                        .map_err(|e| CudaError::nvrtc("nvrtcGetCUBINSize", e))
                        .and_then(|_| {
                            let mut buf = vec![0u8; n];
                            nvrtc_sys::nvrtcGetCUBIN(
                                prog,
                                buf.as_mut_ptr() as *mut std::ffi::c_char,
                            )
                            .result()
                            .map(|_| buf)
                            .map_err(|e| CudaError::nvrtc("nvrtcGetCUBIN", e))
                        })
                } else {
                    nvrtc::get_ptx(prog)
                        .map(|p| p.iter().map(|&c| c as u8).collect::<Vec<u8>>())
                        .map_err(|e| CudaError::nvrtc("nvrtcGetPTX", e))
                }
            }
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| {
                        let b: Vec<u8> = l
                            .iter()
                            .take_while(|&&c| c != 0)
                            .map(|&c| c as u8)
                            .collect();
                        String::from_utf8_lossy(&b).into_owned()
                    })
                    .unwrap_or_default();
                Err(CudaError::Compile {
                    what: format!("nvrtc {arch} compile of {name}"),
                    log,
                    source: e,
                })
            }
        }
    };
    // SAFETY: `prog` was created above and is destroyed once, after its last use.
    unsafe {
        let _ = nvrtc::destroy_program(prog);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nul_byte_is_a_typed_invalid_argument_before_nvrtc_is_called() {
        match compile_with("a\0b", "k", "--gpu-architecture=sm_90", true) {
            Err(CudaError::Invalid(InvalidArg::Nul { what, name, source })) => {
                assert_eq!(
                    (what, name.as_str(), source.nul_position()),
                    ("source", "k", 1)
                );
            }
            other => panic!("{other:?}"),
        }
        match compile_with("ok", "k\0", "--gpu-architecture=sm_90", true) {
            Err(CudaError::Invalid(InvalidArg::Nul { what: "name", .. })) => {}
            other => panic!("{other:?}"),
        }
    }
}
