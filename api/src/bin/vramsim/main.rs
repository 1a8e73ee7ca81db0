//! The `vramsim` command line: replay traces and snapshots against simulated allocators, import and check
//! PyTorch snapshots, predict a model's training step, sweep what-ifs over it (the largest batch, the
//! recipes that reach a global batch), explain a pasted out-of-memory message, list GPUs, benchmark, and
//! hand validation on real GPUs to `vramsim-validate`. A thin shell: each command's options and work
//! are in the `vramsim_api` library.

mod bench;

/// The binary's heap: lowering, instantiating and replaying steps allocate and free many small
/// objects (events, layouts, graph nodes), which mimalloc serves faster than glibc's malloc.
#[global_allocator]
static HEAP: mimalloc::MiMalloc = mimalloc::MiMalloc;

// mimalloc's C API (linked in by the `mimalloc` crate).
unsafe extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// mimalloc's `mi_option_purge_delay` (`mimalloc.h`, `mi_option_e`: the 16th option in v2 and v3).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// Keeps freed memory mapped for reuse: by default mimalloc returns free pages to the system a second
/// after they empty (`purge_delay` 1000 ms), and a sweep, which frees and allocates steps of the
/// same sizes again and again, then pays for the kernel zeroing the pages it maps back (measured:
/// a third of a 1,000-point `whatif`'s time, in the kernel's `clear_page`). The process's peak
/// memory is unchanged (what it frees it soon needs again).
fn keep_freed_memory() {
    // SAFETY: sets one of mimalloc's options, an integer it reads on each purge; any value is valid
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use vramsim_api::{
    check, diagnose, explain, import, machine, maxbatch, predict, recommend, replay, steptime,
    whatif,
};

/// vramsim: will it fit, what is the peak, where does the memory go? A discrete-event simulator of GPU
/// memory with a faithful model of PyTorch's CUDA caching allocator.
#[derive(Parser)]
#[command(name = "vramsim", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Built once per process from the command line: the size of the predict options is no concern.
#[allow(clippy::large_enum_variant)]
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
    /// Convert a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot()) into vramsim traces, one
    /// per device, starting from the allocator state at the moment recording began.
    Import(import::ImportArgs),
    /// Replay a PyTorch memory snapshot's history through the simulated caching allocator with the
    /// snapshot's own settings and report how faithfully it reproduces the GPU: segment events, block
    /// placement, out-of-memory errors, final reserved and allocated bytes, and the first divergence.
    CheckSnapshot(check::CheckArgs),
    /// Predict the GPU memory of a model's training step (or inference): lower a zoo model or a
    /// HuggingFace config.json to an allocation trace and replay it through the allocator model.
    Predict(predict::PredictArgs),
    /// Evaluate `predict` over a grid of options (--vary KEY=V1,V2,...) in parallel: peaks, fits or
    /// OOM, effective batch and an estimated step time for every configuration, sorted by peak.
    #[command(after_long_help = steptime::HELP)]
    Whatif(whatif::WhatifArgs),
    /// Find the largest batch (or, with --max-seq, sequence) that fits the device, by bisection with
    /// `predict`'s replay, and the first size that does not, with PyTorch's out-of-memory message.
    MaxBatch(maxbatch::MaxBatchArgs),
    /// List the recipes (precision, checkpointing, micro-batch × accumulation) that reach a global
    /// batch on the device, fastest first by estimated step time, each with its `predict` command.
    #[command(after_long_help = steptime::HELP)]
    Recommend(recommend::RecommendArgs),
    /// Replay traces on a real NVIDIA GPU, probe it and calibrate the simulator: runs the
    /// vramsim-validate binary (see `vramsim validate --help`).
    #[command(disable_help_flag = true)]
    Validate {
        /// Arguments of vramsim-validate.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Read a pasted out-of-memory message (PyTorch, torch_npu, TensorFlow, JAX/XLA; stdin with `-`):
    /// its figures in bytes with their rounding bounds, the cause by a stated rule (exceeds_device,
    /// fragmentation, capacity and the shortfall), and the remedies for it, replayed when a model is given.
    Explain(explain::ExplainArgs),
    /// Explain an out-of-memory error or a growth that already happened, from a PyTorch snapshot or a
    /// trace: iterations, growth per iteration and the allocation sites that leak, what decided the
    /// OOM (live tensors, fragmentation, other processes), and remedies verified by replay.
    Diagnose(diagnose::DiagnoseArgs),
}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => replay::run(args),
        Command::Gpus { sources } => machine::list_gpus(sources),
        Command::Bench(args) => bench::run(args),
        Command::Import(args) => import::run(args),
        Command::CheckSnapshot(args) => check::run(args),
        Command::Predict(args) => predict::run(args),
        Command::Whatif(args) => whatif::run(args),
        Command::MaxBatch(args) => maxbatch::run(args),
        Command::Recommend(args) => recommend::run(args),
        Command::Validate { args } => return validate(&args),
        Command::Explain(args) => explain::run(args),
        Command::Diagnose(args) => diagnose::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}

/// `vramsim validate ARGS`: the `vramsim-validate` binary next to this one (else on PATH) with ARGS;
/// exits with its status. (A cargo dependency would be circular: validate depends on sim.)
fn validate(args: &[std::ffi::OsString]) -> ExitCode {
    let name = format!("vramsim-validate{}", std::env::consts::EXE_SUFFIX);
    let program = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join(&name)))
        .filter(|path| path.exists())
        .unwrap_or_else(|| name.into());
    match std::process::Command::new(&program).args(args).status() {
        Ok(status) => ExitCode::from(status.code().map_or(2, |code| code.clamp(0, 255) as u8)),
        Err(error) => {
            eprintln!(
                "error: cannot run {}: {error} (build it with `cargo build -p vramsim-validate`)",
                program.display()
            );
            ExitCode::from(2)
        }
    }
}
