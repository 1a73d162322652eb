//! `sd-worker-rocm-engine`: the Stable Diffusion worker built for AMD GPUs through ROCm (stable-diffusion.cpp
//! engine), started by `sd-worker-rocm` once the machine can load its libraries; all behaviour is in
//! `sdhive-worker`.

fn main() -> anyhow::Result<()> {
    sdhive_worker::main(shared_worker::Backend::Rocm)
}
