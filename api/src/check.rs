//! `vramsim check-snapshot`: replays a PyTorch memory snapshot's history through the simulated caching
//! allocator and reports how faithfully it reproduces what the GPU did.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use vramsim_sim::check::{check_device, CheckOptions, CheckReport};
use vramsim_sim::device::{parse_size, Device};

/// Options of `vramsim check-snapshot`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The snapshot: the pickle `torch.cuda.memory._dump_snapshot()` writes (optionally gzipped).
    pub snapshot: PathBuf,
    /// The device to check (default: every device with a history or segments).
    #[arg(long)]
    pub device: Option<u32>,
    /// Print the report as JSON: one object per device (an array when several devices are checked),
    /// with at least alloc_events, segment_events_recorded, segment_events_matched,
    /// same_offset_allocs, final_reserved_recorded, final_reserved_simulated and first_divergence.
    #[arg(long)]
    pub json: bool,
    /// Replay on this GPU preset (see `vramsim gpus`) instead of the capacity the history implies.
    #[arg(long, conflicts_with = "capacity")]
    pub gpu: Option<String>,
    /// Replay on a device of this usable capacity (e.g. 24GiB) instead of the one the history implies.
    #[arg(long)]
    pub capacity: Option<String>,
    /// Let the simulated address space place new segments instead of giving them the addresses the GPU
    /// gave them (shows how much the driver's address order decides best-fit ties).
    #[arg(long)]
    pub simulated_addresses: bool,
}

/// `vramsim check-snapshot --json`'s document: one device's report, or an array of them.
pub fn reports_json(reports: &[CheckReport]) -> serde_json::Value {
    match reports {
        [one] => one.to_json(),
        many => serde_json::Value::Array(many.iter().map(CheckReport::to_json).collect()),
    }
}

/// Runs `vramsim check-snapshot`.
pub fn run(args: CheckArgs) -> Result<()> {
    let reports = check_snapshot(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports_json(&reports))?);
    } else {
        println!("{}", args.snapshot.display());
        for r in &reports {
            print!("{}", r.to_table());
        }
    }
    Ok(())
}

/// `vramsim check-snapshot` without the printing: one report per device checked.
pub fn check_snapshot(args: &CheckArgs) -> Result<Vec<CheckReport>> {
    let snapshot = crate::import::load_snapshot(&args.snapshot)?;
    let device = match (&args.gpu, &args.capacity) {
        (Some(gpu), _) => Some(Device::preset(gpu)?),
        (None, Some(c)) => Some(Device::with_capacity(
            parse_size(c).context("invalid --capacity")?,
        )),
        (None, None) => None,
    };
    let options = CheckOptions {
        device,
        recorded_addresses: !args.simulated_addresses,
    };
    let targets = match args.device {
        Some(d) => vec![d],
        None => {
            let with_data = snapshot.devices_with_data();
            if with_data.is_empty() {
                match snapshot.devices().first() {
                    Some(&d) => vec![d],
                    None => bail!(
                        "{}: the snapshot holds no device (no segments and no history)",
                        args.snapshot.display()
                    ),
                }
            } else {
                with_data
            }
        }
    };
    let reports: Vec<CheckReport> = targets
        .into_iter()
        .map(|d| check_device(&snapshot, d, &options))
        .collect::<Result<_, _>>()
        .with_context(|| format!("cannot check {}", args.snapshot.display()))?;
    Ok(reports)
}
