//! Project tasks that are more than one cargo command: the CI sequence, fixture regeneration and benchmarks.
//! `cargo xtask --help` lists them.

mod bench;
mod bench_serve;
mod ci;
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
    /// Everything CI checks: formatting, clippy with warnings denied, the whole test suite.
    Ci,
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
        Task::Fixtures { python } => fixtures::run(&python),
        Task::Bench { which } => bench::run(which),
    }
}
