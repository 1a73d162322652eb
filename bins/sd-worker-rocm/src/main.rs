//! `sd-worker-rocm`: checks that this machine can load the ROCm worker (`sd-worker-rocm-engine`, beside it) and
//! becomes it, or says which backend cannot start and what is missing; all behaviour is in `sdhive-launch`.

fn main() -> anyhow::Result<()> {
    Ok(sdhive_launch::launch(&sdhive_launch::ROCM)?)
}
