//! With the `cuda` feature, compiles `src/model/kernels.cu` to PTX for `CUDA_COMPUTE_CAP` (default 90) with the nvcc
//! on PATH (`cargo xtask build-cuda` provides one), as sdhive-cuda-kernels does; the library embeds it. Without the
//! feature, nothing to do.

fn main() {
    println!("cargo:rerun-if-changed=src/model/kernels.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let status = std::process::Command::new("nvcc")
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(out_dir.join("upscale_kernels.ptx"))
        .arg("src/model/kernels.cu")
        .status()
        .unwrap_or_else(|e| panic!("cannot run nvcc (needed by the cuda feature; see docs/gpu.md): {e}"));
    assert!(status.success(), "nvcc failed to compile src/model/kernels.cu for compute_{cap} ({status})");
}
