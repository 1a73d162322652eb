//! Project tasks that are more than one cargo command: the CI sequence, fixture regeneration and benchmarks.
//! `cargo xtask --help` lists them.

mod bench;
mod bench_cuda;
mod bench_serve;
mod ci;
mod cuda;
mod fixtures;
mod k8s;
mod random_model;
mod rocm;
mod util;
mod vulkan;
mod webui;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "sdhive project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Everything CI checks: formatting, clippy with warnings denied, the whole test suite, then the CUDA worker
    /// built and shown to refuse to run without a GPU (skip that part with SDHIVE_CI_SKIP_CUDA=1).
    Ci,
    /// Fetch the CUDA 13.0 toolchain (NVIDIA's PyPI wheels) into ~/.cache/sdhive-cuda-13.0 ($SDHIVE_CUDA_HOME).
    CudaToolchain,
    /// Build the release sd-worker-cuda against that toolchain (no GPU needed; CUDA_COMPUTE_CAP defaults to 90).
    BuildCuda {
        /// Also build sdhive-bench with `--device cuda`.
        #[arg(long)]
        bench: bool,
        /// Also build the sdhive-candle parity-test binary (run it with SDHIVE_TEST_DEVICE=cuda).
        #[arg(long)]
        tests: bool,
        /// Convolutions through cuDNN (fetches NVIDIA's cuDNN wheel; the binaries then need libcudnn.so.9).
        #[arg(long)]
        cudnn: bool,
    },
    /// Regenerate the committed tiny models and diffusers goldens (needs a Python with torch + diffusers).
    Fixtures {
        /// Python interpreter with torch, diffusers and transformers.
        #[arg(long, env = "SDHIVE_PYTHON", default_value = "python3")]
        python: String,
    },
    /// Write a model of real architecture with deterministic random weights from its manifest (SD1.5:
    /// tests/fixtures/sd15-random/manifest.json, SD3.5-medium: tests/fixtures/sd35m-random/manifest.json) that
    /// the stable-diffusion.cpp parity checks run; see xtask/fixtures/gen_sd15_random.py, gen_sd35m_random.py.
    RandomModel {
        /// Default: tests/fixtures/sd15-random/manifest.json.
        #[arg(long)]
        manifest: Option<std::path::PathBuf>,
        /// Default: ~/.cache/sdhive/<the manifest's folder name>.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Build and lint sd-worker-vulkan, then check it on lavapipe against diffusers' image for the random SD1.5.
    Vulkan,
    /// Build sd-worker-rocm for GFX_NAME (default gfx1030;gfx1100) in a Debian sid root with ROCm 6.4 (made once
    /// by xtask/scripts/rocm-root.sh; needs root for chroot), then check that it refuses to run without the HIP
    /// runtime and without an AMD GPU.
    Rocm,
    /// The web page: npm ci, rebuild web/dist and check it matches what is committed, type-check, then the
    /// browser tests (Playwright + Debian's chromium) against a real hive on the fixture models.
    Webui,
    /// The Kubernetes manifests and the Dockerfile (deploy/): rendered, schema-validated for the pinned
    /// Kubernetes versions, checkov and hadolint, plus a self-check that they reject broken files.
    K8s,
    /// Benchmarks against diffusers, run in the same invocation.
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Ci => ci::run(),
        Task::CudaToolchain => cuda::toolchain().map(drop),
        Task::BuildCuda { bench, tests, cudnn } => {
            cuda::build(cuda::Extras { bench, tests, cudnn, dev: false }).map(drop)
        }
        Task::Fixtures { python } => fixtures::run(&python),
        Task::Bench { which } => bench::run(which),
        Task::Vulkan => vulkan::run(),
        Task::Rocm => rocm::run(),
        Task::Webui => webui::run(),
        Task::K8s => k8s::run(),
        Task::RandomModel { manifest, out } => {
            let manifest = manifest
                .unwrap_or_else(|| util::workspace_root().join("tests/fixtures/sd15-random/manifest.json"));
            random_model::write(&manifest, &out.unwrap_or_else(|| random_model::default_out(&manifest)))
        }
    }
}
