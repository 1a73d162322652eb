//! With the `cuda` feature, compiles each `src/*.cu` to PTX for `CUDA_COMPUTE_CAP` (default 90) with the nvcc on
//! PATH (`cargo xtask build-cuda` provides one); the library embeds the PTX and learns the capability through
//! `SDHIVE_CUDA_COMPUTE_CAP`. For 9.0 the attention is compiled a second time for the arch-specific compute_90a,
//! whose PTX holds the Hopper (wgmma) kernels and loads only on 9.0 devices, and the fused feed-forward product
//! with GEGLU, the narrow products with their LayerNorm and the 8² convolution (`src/geglu_wgmma.cu`,
//! `src/linear_norm_wgmma.cu`, `src/conv_splitk.cu`, Hopper only) are compiled for compute_90a alone; other builds get empty files
//! there. Without the feature, nothing to do.

const SOURCES: [&str; 4] = ["kernels", "attention", "edge_conv", "upscale"];

/// Sources that exist only as Hopper kernels: compiled for compute_90a alone.
const HOPPER_ONLY: [&str; 3] = ["geglu_wgmma", "linear_norm_wgmma", "conv_splitk"];

fn main() {
    for source in SOURCES.iter().chain(&HOPPER_ONLY) {
        println!("cargo:rerun-if-changed=src/{source}.cu");
    }
    // Included by the Hopper-only sources and the attention.
    println!("cargo:rerun-if-changed=src/wgmma_common.cuh");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    println!("cargo:rustc-env=SDHIVE_CUDA_COMPUTE_CAP={cap}");
    for source in SOURCES {
        nvcc(source, &format!("compute_{cap}"), &out_dir.join(format!("{source}.ptx")));
    }
    for source in ["attention"].iter().chain(&HOPPER_ONLY) {
        let name = format!("{source}_sm90a.ptx");
        let hopper = out_dir.join(&name);
        if cap == "90" {
            nvcc(source, "compute_90a", &hopper);
        } else {
            std::fs::write(&hopper, "")
                .unwrap_or_else(|e| panic!("writing an empty {name} into OUT_DIR: {e}"));
        }
    }
}

fn nvcc(source: &str, arch: &str, out: &std::path::Path) {
    let status = std::process::Command::new("nvcc")
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch={arch}"))
        .arg("-o")
        .arg(out)
        .arg(format!("src/{source}.cu"))
        .status()
        .unwrap_or_else(|e| panic!("cannot run nvcc (needed by the cuda feature; see docs/gpu.md): {e}"));
    assert!(status.success(), "nvcc failed to compile src/{source}.cu for {arch} ({status})");
}
