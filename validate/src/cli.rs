//! The `vramsim-validate` command line (also `vramsim validate ...`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use vramsim_sim::calibration::Calibration;
use vramsim_sim::device::parse_size;

use crate::driver::{driver_library_present, guard, no_driver, Gpu};
use crate::error::ValidateError;
use crate::probe::{nvidia_smi_used, probe_text, run_probe};
use crate::replay::{replay, report_text, Backend, ReplayOptions};

/// vramsim-validate: replay vramsim traces on a real NVIDIA GPU through the CUDA driver API, compare with
/// the simulator, and measure the figures (capacity, context, granularity, latencies) that calibrate it.
#[derive(Parser, Debug)]
#[command(name = "vramsim-validate", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Measure the device: name, total and free memory, CUDA context cost, allocation granularity
    /// (cuMemAlloc, cuMemCreate, the stream-ordered pool) and allocation/map latencies.
    Probe {
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: i32,
        /// Calls per latency measurement (the median is kept).
        #[arg(long, default_value_t = 20)]
        reps: u32,
        /// Print the raw observations as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Replay a trace on the GPU and compare device memory with the simulator, event by event.
    Replay {
        /// The trace (vramsim JSON or JSON Lines, optionally gzipped).
        trace: PathBuf,
        /// raw: cuMemAlloc/cuMemFree of the simulated PyTorch segments; vmm: page maps of its expandable
        /// segments; async: cuMemAllocAsync of every allocation on a stream-ordered pool, against the
        /// cuda-async model.
        #[arg(long, value_enum)]
        backend: Backend,
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: i32,
        /// PYTORCH_CUDA_ALLOC_CONF of the simulated caching allocator (raw, vmm).
        #[arg(long, default_value = "")]
        alloc_conf: String,
        /// The pool's release threshold (async): "max" (PyTorch's UINT64_MAX) or a size, e.g. 0 (the
        /// driver's default: trim at every synchronization) or 1GiB.
        #[arg(long, default_value = "max")]
        release_threshold: String,
        /// A calibration.json whose measured pool page size and alignment configure the cuda-async model.
        #[arg(long, value_name = "FILE")]
        calibration: Option<PathBuf>,
        /// Stop after this many events.
        #[arg(long)]
        max_events: Option<u64>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// List every compared event, not only those that differ.
        #[arg(long)]
        all_events: bool,
    },
    /// Probe the device and write calibration.json for `vramsim replay --calibration`.
    Calibrate {
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: i32,
        /// Calls per latency measurement.
        #[arg(long, default_value_t = 20)]
        reps: u32,
        /// Where to write the calibration.
        #[arg(long, default_value = "calibration.json")]
        out: PathBuf,
        /// Also write the raw probe report here.
        #[arg(long, value_name = "FILE")]
        probe_out: Option<PathBuf>,
    },
}

/// Parses the command line and runs it: exit status 0, or 2 with one `error: ...` line on stderr.
pub fn main() -> ExitCode {
    run(Cli::parse())
}

/// Runs a parsed command line (see [`main`]).
pub fn run(cli: Cli) -> ExitCode {
    match execute(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(2)
        }
    }
}

fn execute(cli: Cli) -> anyhow::Result<()> {
    // Every command needs the driver: say so before anything else, and before any driver call (cudarc
    // panics on the first call when the library is missing).
    if !driver_library_present() {
        return Err(no_driver().into());
    }
    match cli.command {
        Command::Probe { device, reps, json } => {
            let probe = probe(device, reps)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&probe)?);
            } else {
                print!("{}", probe_text(&probe));
            }
        }
        Command::Calibrate {
            device,
            reps,
            out,
            probe_out,
        } => {
            let probe = probe(device, reps)?;
            if let Some(path) = &probe_out {
                std::fs::write(path, serde_json::to_string_pretty(&probe)? + "\n")
                    .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
            }
            let calibration = probe.to_calibration()?;
            std::fs::write(&out, calibration.to_json())
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", out.display()))?;
            print!("{}", probe_text(&probe));
            println!("calibration  {}", out.display());
        }
        Command::Replay {
            trace,
            backend,
            device,
            alloc_conf,
            release_threshold,
            calibration,
            max_events,
            json,
            all_events,
        } => {
            let release_threshold = if release_threshold.eq_ignore_ascii_case("max") {
                u64::MAX
            } else {
                parse_size(&release_threshold)
                    .map_err(|e| anyhow::anyhow!("invalid --release-threshold: {e}"))?
            };
            let async_config =
                match &calibration {
                    Some(path) => Some(Calibration::read(path)?.async_config(
                        vramsim_sim::allocator::cuda_async::CudaAsyncConfig::pytorch(),
                    )),
                    None => None,
                };
            let options = ReplayOptions {
                backend,
                alloc_conf,
                release_threshold,
                async_config,
                max_events,
            };
            let report = guard(|| {
                let gpu = Gpu::open(device)?;
                replay(&gpu, &trace, &options)
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report_text(&report, all_events));
            }
        }
    }
    Ok(())
}

fn probe(device: i32, reps: u32) -> Result<crate::probe::ProbeReport, ValidateError> {
    // nvidia-smi's reading before this process creates its context.
    let before = nvidia_smi_used(device.max(0) as u32);
    guard(|| {
        let gpu = Gpu::open(device)?;
        run_probe(&gpu, before, reps.max(1))
    })
}
