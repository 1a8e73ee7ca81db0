//! `vramsim replay`: a trace through an allocator model, reported as a table, JSON, a summary or a plot.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use vramsim_sim::engine::{Replay, ReplayOptions};
use vramsim_sim::plot::{plot_timeline, TimelinePlot, TimelineSample};
use vramsim_sim::report::Report;
use vramsim_sim::summary::memory_summary;

use crate::machine::MachineArgs;

/// Timeline points kept for `--plot`.
const PLOT_POINTS: usize = 4000;

/// Options of `vramsim replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// The trace: vramsim JSON or JSON Lines, optionally gzip-compressed.
    pub trace: PathBuf,
    #[command(flatten)]
    pub machine: MachineArgs,
    /// Also print torch.cuda.memory_summary() for the final state.
    #[arg(long)]
    pub summary: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Draw allocated and reserved memory over the trace to a .png or .svg file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// Runs `vramsim replay`.
pub fn run(args: ReplayArgs) -> Result<()> {
    let machine = args.machine.build()?;
    let events = vramsim_traces::open_events(&args.trace)
        .with_context(|| format!("cannot read {}", args.trace.display()))?;
    let options = ReplayOptions {
        timeline_points: if args.plot.is_some() { PLOT_POINTS } else { 0 },
    };
    let device = machine.allocator.device().clone();
    let outcome = Replay::new(machine.allocator, &options)
        .run(events)
        .with_context(|| format!("cannot replay {}", args.trace.display()))?;
    let report = Report {
        source: args.trace.display().to_string(),
        allocator: args.machine.allocator.name().to_string(),
        alloc_conf: machine.alloc_conf,
        memory_fraction: machine.memory_fraction,
        device,
        outcome,
    };
    if let Some(path) = &args.plot {
        draw(&report, path)?;
    }
    if args.json {
        let mut json = report.to_json();
        if args.summary {
            json["memory_summary"] = memory_summary(&report.outcome.stats, 0, false).into();
        }
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        print!("{}", report.to_table());
        if args.summary {
            println!();
            print!("{}", memory_summary(&report.outcome.stats, 0, false));
        }
        if let Some(path) = &args.plot {
            println!("plot       {}", path.display());
        }
    }
    Ok(())
}

fn draw(report: &Report, path: &std::path::Path) -> Result<()> {
    let samples: Vec<TimelineSample> = report
        .outcome
        .timeline
        .iter()
        .map(|p| TimelineSample {
            x: p.event_index as f64,
            allocated: p.allocated,
            reserved: p.reserved,
        })
        .collect();
    let phases: Vec<(f64, String)> = report
        .outcome
        .phase_marks
        .iter()
        .map(|(index, name)| (*index as f64, name.clone()))
        .collect();
    let title = format!(
        "{} · {}{}",
        report.source,
        report.allocator,
        if report.alloc_conf.is_empty() {
            String::new()
        } else {
            format!(" ({})", report.alloc_conf)
        }
    );
    plot_timeline(
        &TimelinePlot {
            title: &title,
            x_label: "event",
            samples: &samples,
            capacity: Some(report.device.total_memory - report.device.non_allocator_bytes()),
            oom_at: report.outcome.oom.as_ref().map(|o| o.event_index as f64),
            phases: &phases,
        },
        path,
    )
    .with_context(|| format!("cannot draw {}", path.display()))
}
