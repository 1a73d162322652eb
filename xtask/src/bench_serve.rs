//! `cargo xtask bench serve`: runs the ignored `serve_bench` test of sdhive-server (test profile, which the
//! workspace builds optimised), which prints the serving-overhead table: direct `Engine::generate` against
//! synchronous `POST /v1/images/generations` on loopback, and engine-callback → client SSE `progress` latency.
//! `cargo xtask bench gateway`: runs the ignored `gateway_bench` test of sdhive-tests the same way: a gateway's
//! cost per request, and the time from a lost node to the re-run of its job.

use crate::util::{cargo, workspace_root};
use anyhow::{bail, Result};

pub fn run(iters: usize) -> Result<()> {
    if iters == 0 {
        bail!("--iters must be at least 1");
    }
    // The harness reads its run count from the environment; the child cargo inherits it.
    std::env::set_var("SDHIVE_BENCH_ITERS", iters.to_string());
    cargo(
        &workspace_root(),
        &[
            "test",
            "-p",
            "sdhive-server",
            "--test",
            "serve_bench",
            "--",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ],
    )
}

pub fn gateway(iters: usize) -> Result<()> {
    if iters == 0 {
        bail!("--iters must be at least 1");
    }
    std::env::set_var("SDHIVE_BENCH_ITERS", iters.to_string());
    cargo(
        &workspace_root(),
        &["test", "-p", "sdhive-tests", "--test", "gateway_bench", "--", "--ignored", "--nocapture"],
    )
}
