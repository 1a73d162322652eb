//! `sd-worker-cpu`: the Stable Diffusion worker built for the CPU backend; all behaviour is in `sdhive-worker`.

fn main() -> anyhow::Result<()> {
    sdhive_worker::main(shared_worker::Backend::Cpu)
}
