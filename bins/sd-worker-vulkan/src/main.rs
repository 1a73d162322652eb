//! `sd-worker-vulkan`: the Stable Diffusion worker built for Vulkan GPUs (stable-diffusion.cpp engine); all
//! behaviour is in `sdhive-worker`.

fn main() -> anyhow::Result<()> {
    sdhive_worker::main(shared_worker::Backend::Vulkan)
}
