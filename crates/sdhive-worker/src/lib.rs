//! The runtime every `sd-worker-<backend>` binary shares: its command line, logging, and the subcommands. A
//! binary's `main` only names its backend; everything else lives here so the binaries cannot drift apart.

pub mod cli;
pub mod engine;
mod generate;
pub mod output;
pub mod preview;
pub mod request;
pub mod serve;

use clap::{CommandFactory, FromArgMatches};
use cli::{Cli, Command};
use shared_worker::Backend;
use std::ffi::OsString;

/// Parses the process arguments and runs the chosen subcommand on `backend`.
pub fn main(backend: Backend) -> anyhow::Result<()> {
    run(backend, std::env::args_os())
}

/// [`main`] with explicit arguments (the first is the program name).
pub fn run<I, T>(backend: Backend, args: I) -> anyhow::Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = parse(backend, args);
    init_tracing();
    match cli.command {
        Command::Generate(args) => generate::run(backend, &args),
        Command::Serve(args) => serve::run(backend, &args),
    }
}

/// `--version` reports the backend too, since which binary is installed is the first thing to check; the GPU
/// binaries' launchers print the same line where the engine cannot load.
pub fn version_string(backend: Backend) -> String {
    sdhive_launch::version_line(backend.name())
}

/// Parses like clap's `Parser::parse` (printing help/version or the usage error and exiting), with the name and
/// version of this backend's binary.
fn parse<I, T>(backend: Backend, args: I) -> Cli
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    // clap stores names and versions as &'static str unless its `string` feature is on; this runs once per
    // process, so leaking two short strings is the simpler choice.
    let name: &'static str = Box::leak(backend.binary_name().into_boxed_str());
    let version: &'static str = Box::leak(version_string(backend).into_boxed_str());
    let matches = Cli::command().name(name).version(version).get_matches_from(args);
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// Logs go to stderr (stdout carries the written file names); RUST_LOG overrides the quiet default.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // A host process may have installed a subscriber already; keeping theirs is right.
    let _ = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter).try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn version_names_the_backend() {
        assert_eq!(version_string(Backend::Cpu), format!("{} (backend: cpu)", env!("CARGO_PKG_VERSION")));
    }
}
