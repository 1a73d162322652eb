//! `sd-worker-cuda`: the Stable Diffusion worker built for NVIDIA GPUs; all behaviour is in `sdhive-worker`.

fn main() -> anyhow::Result<()> {
    sdhive_worker::main(shared_worker::Backend::Cuda)
}
