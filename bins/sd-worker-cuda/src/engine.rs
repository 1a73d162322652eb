//! `sd-worker-cuda-engine`: the Stable Diffusion worker built for NVIDIA GPUs, started by `sd-worker-cuda` once
//! the machine can load its libraries; all behaviour is in `sdhive-worker`.

fn main() -> anyhow::Result<()> {
    sdhive_worker::main(shared_worker::Backend::Cuda)
}
