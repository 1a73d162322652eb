//! `sd-worker-vulkan`: checks that this machine can load the Vulkan worker (`sd-worker-vulkan-engine`, beside
//! it) and becomes it, or says which backend cannot start and what is missing; all behaviour is in
//! `sdhive-launch`.

fn main() -> anyhow::Result<()> {
    Ok(sdhive_launch::launch(&sdhive_launch::VULKAN)?)
}
