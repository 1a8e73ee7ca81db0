//! `vramsim replay`: a trace through an allocator model, reported as a table, JSON, a summary or a plot.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use vramsim_sim::engine::{Replay, ReplayOptions};
use vramsim_sim::export::{snapshot_of, ExportOptions};
use vramsim_sim::report::Report;
use vramsim_sim::summary::memory_summary;

use crate::machine::MachineArgs;

/// Timeline points kept for `--plot`.
const PLOT_POINTS: usize = 4000;

/// The timeline points a replay keeps: [`PLOT_POINTS`] when a `--plot` file is asked for, else none.
pub(crate) fn timeline_points(plot: &Option<PathBuf>) -> usize {
    if plot.is_some() {
        PLOT_POINTS
    } else {
        0
    }
}

/// Options of `vramsim replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// The trace: vramsim JSON or JSON Lines, or a PyTorch memory snapshot pickle (replayed from its
    /// recorded state, with its own settings and capacity unless --alloc-conf/--gpu/--capacity are
    /// given); optionally gzip-compressed.
    pub trace: PathBuf,
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub snapshot: crate::import::SnapshotArgs,
    /// Also print torch.cuda.memory_summary() for the final state.
    #[arg(long)]
    pub summary: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Draw allocated and reserved memory over the trace to a .png or .svg file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Record the allocator's history during the replay and write the final state as a PyTorch memory
    /// snapshot pickle, for torch/cuda/_memory_viz.py and pytorch.org/memory_viz (gzip-compressed if
    /// the name ends in .gz; the web viewer reads only uncompressed files).
    #[arg(long, value_name = "FILE.pickle")]
    pub snapshot_out: Option<PathBuf>,
}

/// A finished `vramsim replay`.
pub struct Replayed {
    /// The replay's report.
    pub report: Report,
    /// For a snapshot input: how the replay compares with the recorded history (lines, JSON).
    pub verdict: Option<(Vec<String>, serde_json::Value)>,
    /// Whether `torch.cuda.memory_summary()` of the final state is part of the output.
    pub summary: bool,
}

impl Replayed {
    /// `vramsim replay --json`'s document.
    pub fn to_json(&self) -> serde_json::Value {
        let mut json = self.report.to_json();
        if let Some((_, v)) = &self.verdict {
            json["snapshot"] = v.clone();
        }
        if self.summary {
            json["memory_summary"] = memory_summary(&self.report.outcome.stats, 0, false).into();
        }
        // what the framework itself reports: its allocated bytes are the BFC chunks in use
        let allocated = &self.report.outcome.stats.allocated_bytes.all;
        match self.report.allocator.as_str() {
            "tf-bfc" => {
                json["get_memory_info"] =
                    serde_json::json!({"current": allocated.current, "peak": allocated.peak});
            }
            "jax" => {
                json["memory_stats"] = serde_json::json!({
                    "bytes_in_use": allocated.current,
                    "peak_bytes_in_use": allocated.peak,
                });
            }
            _ => {}
        }
        json
    }

    /// `vramsim replay`'s table (and the snapshot verdict, and the memory summary when asked for).
    pub fn to_table(&self) -> String {
        let mut out = self.report.to_table();
        for line in self.verdict.iter().flat_map(|(lines, _)| lines) {
            out.push_str(line);
            out.push('\n');
        }
        if self.summary {
            out.push('\n');
            out.push_str(&memory_summary(&self.report.outcome.stats, 0, false));
        }
        out
    }
}

/// Runs `vramsim replay`.
pub fn run(args: ReplayArgs) -> Result<()> {
    let (plot, snapshot_out, json) = (args.plot.clone(), args.snapshot_out.clone(), args.json);
    let replayed = replay(args)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&replayed.to_json())?);
    } else {
        print!("{}", replayed.to_table());
        if let Some(path) = &plot {
            println!("plot       {}", path.display());
        }
        if let Some(path) = &snapshot_out {
            println!("snapshot   {}", path.display());
        }
    }
    Ok(())
}

/// `vramsim replay` without the printing: replays, writes `--snapshot-out` and draws `--plot` when
/// given.
pub fn replay(mut args: ReplayArgs) -> Result<Replayed> {
    // a PyTorch snapshot replays from its recorded state, with its own settings and capacity by default
    let (events, recorded) = crate::import::open_input(&args.trace, &args.snapshot)?;
    let given = args.machine.clone();
    args.machine = crate::import::machine_for(recorded.as_ref(), &given);
    let machine = args.machine.build()?;
    let options = ReplayOptions {
        timeline_points: timeline_points(&args.plot),
    };
    let device = machine.allocator.device().clone();
    let mut allocator = machine.allocator;
    if args.snapshot_out.is_some() {
        // _record_memory_history() before the first event: the trace then holds every action.
        allocator.set_record_history(true);
    }
    let mut replay = Replay::new(allocator, &options);
    replay
        .apply_all(events)
        .with_context(|| format!("cannot replay {}", args.trace.display()))?;
    let (outcome, mut allocator) = replay.into_parts();
    if let Some(path) = &args.snapshot_out {
        let snapshot = snapshot_of(&mut allocator, &machine.config, &ExportOptions::default());
        vramsim_traces::snapshot::write_snapshot_file(path, &snapshot)
            // the error names the file; its source chain would repeat the I/O error
            .map_err(|e| anyhow::anyhow!("cannot write the snapshot: {e}"))?;
    }
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
    let verdict = recorded.map(|s| s.verdict(&given, &report.outcome));
    Ok(Replayed {
        report,
        verdict,
        summary: args.summary,
    })
}

fn draw(report: &Report, path: &std::path::Path) -> Result<()> {
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
    report
        .plot_timeline(&title, path)
        .with_context(|| format!("cannot draw {}", path.display()))
}
