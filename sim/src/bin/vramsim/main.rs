//! The `vramsim` command line: replay traces against simulated allocators, list GPUs, benchmark.

mod bench;
mod machine;
mod replay;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// vramsim: will it fit, what is the peak, where does the memory go? A discrete-event simulator of GPU
/// memory with a faithful model of PyTorch's CUDA caching allocator.
#[derive(Parser)]
#[command(name = "vramsim", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay an allocation trace (JSON or JSON Lines, optionally gzipped) and report peaks, statistics,
    /// fragmentation and out-of-memory errors.
    Replay(replay::ReplayArgs),
    /// List the GPU presets accepted by --gpu, with their capacities.
    Gpus {
        /// Also say where each capacity figure comes from.
        #[arg(long)]
        sources: bool,
    },
    /// Measure replay and parsing speed and streaming memory on synthetic traces.
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => replay::run(args),
        Command::Gpus { sources } => machine::list_gpus(sources),
        Command::Bench(args) => bench::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}
