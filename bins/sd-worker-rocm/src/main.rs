//! `sd-worker-rocm`: the Stable Diffusion worker built for AMD GPUs through ROCm (stable-diffusion.cpp engine);
//! all behaviour is in `sdhive-worker`.

fn main() -> anyhow::Result<()> {
    sdhive_worker::main(shared_worker::Backend::Rocm)
}
