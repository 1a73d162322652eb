//! Project tasks that are more than one cargo command: the CI sequence, fixture regeneration and benchmarks.
//! `cargo xtask --help` lists them.

mod bench;
mod bench_serve;
mod ci;
mod cuda;
mod fixtures;
mod util;

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
    },
    /// Regenerate the committed tiny models and diffusers goldens (needs a Python with torch + diffusers).
    Fixtures {
        /// Python interpreter with torch, diffusers and transformers.
        #[arg(long, env = "SDHIVE_PYTHON", default_value = "python3")]
        python: String,
    },
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
        Task::BuildCuda { bench, tests } => cuda::build(cuda::Extras { bench, tests }).map(drop),
        Task::Fixtures { python } => fixtures::run(&python),
        Task::Bench { which } => bench::run(which),
    }
}
