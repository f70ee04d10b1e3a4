//! Finding CUDA at run time (docs/design.md §5: dynamic loading, detect, never panic) and
//! compiling the kernels with NVRTC (kvferry-cuda's `nvrtc`, shared with the CUDA IPC copy
//! kernel).

/// Whether the CUDA driver library (`libcuda.so.1`) can be loaded: the one probe of kvferry-cuda.
pub use kvferry_cuda::driver_library_present;
pub(crate) use kvferry_cuda::guarded;
pub use kvferry_cuda::nvrtc::{compile, nvrtc_library_present};

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles both kernel sources when NVRTC is present (e.g. from the
    /// `nvidia-cuda-nvrtc` wheel via KVFERRY_NVRTC_DIR); skipped otherwise.
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !nvrtc_library_present() {
            assert!(
                std::env::var_os("KVFERRY_REQUIRE_GPU").is_none(),
                "KVFERRY_REQUIRE_GPU set but no libnvrtc"
            );
            // Straight to stderr: libtest hides a passing test's eprintln! output.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED kernels_compile_with_nvrtc: libnvrtc not found"
            );
            return;
        }
        for (name, src) in [
            ("checksum.cu", super::super::CHECKSUM_SRC),
            ("tools.cu", super::super::TOOLS_SRC),
            ("copy.cu", kvferry_cuda::ipc::COPY_SRC),
        ] {
            let cubin = compile(src, name, (9, 0)).unwrap_or_else(|e| panic!("{e}"));
            assert!(cubin.len() > 1000, "{name}: {} bytes", cubin.len());
        }
    }
}
