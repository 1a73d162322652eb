//! `sd-worker-vulkan-engine`: the Stable Diffusion worker built for Vulkan GPUs (stable-diffusion.cpp engine),
//! started by `sd-worker-vulkan` once the machine can load its libraries; all behaviour is in `sdhive-worker`.

fn main() -> anyhow::Result<()> {
    sdhive_worker::main(shared_worker::Backend::Vulkan)
}
