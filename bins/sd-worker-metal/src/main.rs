//! `sd-worker-metal`: the Stable Diffusion worker built for Apple GPUs; all behaviour is in `sdhive-worker`.

fn main() -> anyhow::Result<()> {
    sdhive_worker::main(shared_worker::Backend::Metal)
}
