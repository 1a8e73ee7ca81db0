//! `vramsim diagnose SNAPSHOT|TRACE`: explains an out-of-memory error or a growth that already
//! happened, from the recorded history.
//!
//! 1. The history ([`history`]): every allocation with its site (a snapshot's innermost user stack
//!    frame, a trace's tag), the iterations of the loop, and the bytes each iteration leaves behind
//!    (growth per iteration, leaks by site).
//! 2. The replay: the history through the allocator model on the machine given (for a snapshot, its own
//!    settings and the capacity its history implies). If it runs out of memory, the shortfall at the
//!    failing allocation is split into live tensors (by site), reserved-but-unallocated bytes
//!    (fragmentation) and memory outside the allocator (other processes, CUDA context), and the part
//!    that decides is named: the request does not fit even an empty device → live tensors; it fits the
//!    device but not the allocator's own limit (PyTorch's memory fraction, a BFC memory limit or JAX's
//!    preallocated share) → the memory limit; it would fit the device without the other processes and
//!    context → those; otherwise → fragmentation.
//!    With growth and no OOM, the iteration where the growth would exhaust the device is projected.
//! 3. The remedies ([`remedies`]): each candidate setting replays the same history (for a trace of a
//!    known model step, `predict --trace-out`'s, smaller batches are lowered and replayed too); a remedy
//!    is reported with its setting, whether the OOM disappears and the new peaks. Nothing is recommended
//!    untested.

pub mod history;
pub mod remedies;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::{json, Value};
use vramsim_sim::device::Device;
use vramsim_sim::engine::{Replay, ReplayOptions, ReplayOutcome};
use vramsim_sim::format::format_size;
use vramsim_sim::report::Report;
use vramsim_traces::Event;

use crate::machine::MachineArgs;
use history::{Growth, History, Iterations};
use remedies::Remedy;

/// Sites listed in the OOM cause.
const TOP_SITES: usize = 8;

/// Options of `vramsim diagnose`.
#[derive(Args, Debug)]
pub struct DiagnoseArgs {
    /// A PyTorch memory snapshot (recorded with `torch.cuda.memory._record_memory_history()`) or a
    /// vramsim trace.
    pub trace: PathBuf,
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub snapshot: crate::import::SnapshotArgs,
    /// Print the diagnosis as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Draw allocated and reserved memory over the history to a .png or .svg file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// A snapshot without allocation history: nothing to diagnose. Holds the file's name.
#[derive(Debug)]
pub struct NoHistory(pub String);

impl std::fmt::Display for NoHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: no trace recorded (the snapshot holds segments but no allocation history); record with `torch.cuda.memory._record_memory_history()` before the run, then `torch.cuda.memory._dump_snapshot(\"run.pickle\")`",
            self.0
        )
    }
}

impl std::error::Error for NoHistory {}

/// The part of an out-of-memory error that decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OomCause {
    /// The live tensors alone exceed the device.
    LiveTensors,
    /// The live tensors and the request exceed the allocator's limit (memory fraction, memory limit,
    /// preallocated share) but not the device.
    MemoryLimit,
    /// Memory outside the allocator (other processes, the CUDA context) takes the room it needed.
    OtherProcesses,
    /// Reserved but unallocated memory (fragmentation, cached blocks) takes the room it needed.
    Fragmentation,
}

impl OomCause {
    /// The name in JSON.
    pub fn name(self) -> &'static str {
        match self {
            OomCause::LiveTensors => "live_tensors",
            OomCause::MemoryLimit => "memory_limit",
            OomCause::OtherProcesses => "other_processes",
            OomCause::Fragmentation => "fragmentation",
        }
    }

    /// A sentence for the table.
    pub fn sentence(self) -> &'static str {
        match self {
            OomCause::LiveTensors => {
                "the live tensors and the request exceed the whole device: the model needs less memory (a smaller batch, checkpointing, lower precision), no allocator setting can help"
            }
            OomCause::MemoryLimit => {
                "it would fit the device but not the allocator's limit (memory fraction, memory limit or the preallocated share): raise the limit"
            }
            OomCause::OtherProcesses => {
                "it would fit without the other processes and the CUDA context"
            }
            OomCause::Fragmentation => {
                "it would fit the device: reserved but unallocated memory (fragmentation or cached blocks) took the room"
            }
        }
    }
}

/// The shortfall at the failing allocation, split.
#[derive(Clone, Debug, PartialEq)]
pub struct OomSplit {
    /// Index of the failing event.
    pub event_index: u64,
    /// The error's message.
    pub message: String,
    /// Bytes requested.
    pub requested_bytes: u64,
    /// Allocated bytes at the failure (live tensors, rounded).
    pub live_tensor_bytes: u64,
    /// Reserved minus allocated.
    pub reserved_unallocated_bytes: u64,
    /// Held by other processes.
    pub other_processes_bytes: u64,
    /// This process's CUDA context.
    pub context_bytes: u64,
    /// The device's total memory.
    pub total_memory_bytes: u64,
    /// The allocator's limit, where it has one below the device.
    pub memory_limit_bytes: Option<u64>,
    /// Live requested bytes by site at the failure, largest first.
    pub top_sites: Vec<(String, u64)>,
    /// Live requested bytes by category at the failure, largest first.
    pub categories: Vec<(String, u64)>,
    /// What decides it.
    pub cause: OomCause,
}

/// A finished `vramsim diagnose`.
pub struct Diagnosis {
    /// The input.
    pub source: String,
    /// Whether the input was a PyTorch snapshot.
    pub snapshot: bool,
    /// The allocator model.
    pub allocator: String,
    /// The settings string replayed.
    pub alloc_conf: String,
    /// The device replayed on.
    pub device: Device,
    /// The history.
    pub history: History,
    /// The iterations, if any repeat.
    pub iterations: Option<Iterations>,
    /// Their growth.
    pub growth: Option<Growth>,
    /// The replay with the settings given.
    pub baseline: ReplayOutcome,
    /// The OOM, split, if the replay ran out of memory.
    pub oom: Option<OomSplit>,
    /// With growth and no OOM: the iteration (0-based, counted from the first found) that would run out
    /// of memory.
    pub projected_oom_iteration: Option<u64>,
    /// The candidates, replayed.
    pub remedies: Vec<Remedy>,
}

/// Replays `events` on the machine `args` describes.
pub(crate) fn replay_events(
    events: &[Event],
    args: &MachineArgs,
    timeline_points: usize,
) -> Result<Replayed> {
    let machine = args.build()?;
    let device = machine.allocator.device().clone();
    let options = ReplayOptions { timeline_points };
    let outcome = Replay::new(machine.allocator, &options).run(events.iter().cloned().map(Ok))?;
    Ok(Replayed {
        outcome,
        device,
        alloc_conf: machine.alloc_conf,
        memory_limit: machine.memory_limit,
    })
}

/// A replay of the history and the machine it ran on.
pub(crate) struct Replayed {
    pub outcome: ReplayOutcome,
    pub device: Device,
    pub alloc_conf: String,
    pub memory_limit: Option<u64>,
}

/// Splits an out-of-memory error (see the module documentation).
fn split_oom(
    outcome: &ReplayOutcome,
    device: &Device,
    limit: Option<u64>,
    h: &History,
) -> Option<OomSplit> {
    let oom = outcome.oom.as_ref()?;
    let allocated = outcome.stats.allocated_bytes.all.current.max(0) as u64;
    let reserved = outcome.stats.reserved_bytes.all.current.max(0) as u64;
    let others: u64 = device.other_processes.iter().map(|p| p.bytes).sum();
    let need = allocated + oom.requested_bytes;
    let room = device.total_memory - device.non_allocator_bytes();
    let cause = if need > device.total_memory {
        OomCause::LiveTensors
    } else if limit.is_some_and(|l| l < room && need > l) {
        OomCause::MemoryLimit
    } else if need > room {
        OomCause::OtherProcesses
    } else {
        OomCause::Fragmentation
    };
    Some(OomSplit {
        event_index: oom.event_index,
        message: oom.message.clone(),
        requested_bytes: oom.requested_bytes,
        live_tensor_bytes: allocated,
        reserved_unallocated_bytes: reserved.saturating_sub(allocated),
        other_processes_bytes: others,
        context_bytes: device.context_bytes,
        total_memory_bytes: device.total_memory,
        memory_limit_bytes: limit,
        top_sites: history::live_by_site(h, oom.event_index)
            .into_iter()
            .take(TOP_SITES)
            .collect(),
        categories: history::live_by_category(h, oom.event_index),
        cause,
    })
}

/// `vramsim diagnose` without the printing.
pub fn diagnose(args: &DiagnoseArgs) -> Result<Diagnosis> {
    let (events, recorded) = crate::import::open_input(&args.trace, &args.snapshot)?;
    let events: Vec<Event> = events
        .collect::<Result<_, _>>()
        .with_context(|| format!("cannot read {}", args.trace.display()))?;
    let machine = crate::import::machine_for(recorded.as_ref(), &args.machine);
    let h = match &recorded {
        Some(s) => {
            if s.import.recorded.entries == 0 {
                return Err(NoHistory(args.trace.display().to_string()).into());
            }
            let sites =
                vramsim_traces::sites::load_trace_sites(&args.trace).with_context(|| {
                    format!("cannot read the stack frames of {}", args.trace.display())
                })?;
            let device_sites = sites
                .get(s.import.device as usize)
                .cloned()
                .unwrap_or_default();
            let origins = &s.import.origins;
            history::history(&events, &|i, _, _| {
                origins
                    .get(i)
                    .copied()
                    .flatten()
                    .and_then(|entry| device_sites.get(entry as usize).cloned().flatten())
                    .unwrap_or_else(|| "(no stack recorded)".to_string())
            })
        }
        None => history::history(&events, &|_, tag, category| match tag {
            Some(tag) => tag.to_string(),
            None => category.to_string(),
        }),
    };
    let iterations = history::iterations(&h);
    let growth = iterations.as_ref().map(|it| history::growth(&h, it));
    let points = crate::replay::timeline_points(&args.plot);
    let Replayed {
        outcome: baseline,
        device,
        alloc_conf,
        memory_limit,
    } = replay_events(&events, &machine, points)
        .with_context(|| format!("cannot replay {}", args.trace.display()))?;
    let oom = split_oom(&baseline, &device, memory_limit, &h);
    let projected_oom_iteration = match (&growth, &iterations) {
        (Some(g), Some(it)) if oom.is_none() => g.bytes_per_iteration.filter(|&b| b > 0).map(|b| {
            let room = (device.total_memory - device.non_allocator_bytes()).saturating_sub(
                baseline
                    .peak_device_used
                    .saturating_sub(device.context_bytes),
            );
            it.starts.len() as u64 + room / b
        }),
        _ => None,
    };
    let mut remedies = remedies::try_all(&events, &machine, &iterations, oom.is_some())?;
    if recorded.is_none() {
        // a known model step (a trace `predict --trace-out` wrote): smaller batches too
        let meta = vramsim_traces::open_events(&args.trace)
            .with_context(|| format!("cannot read {}", args.trace.display()))?
            .meta()
            .clone();
        remedies.extend(remedies::smaller_batches(
            &meta,
            events.len(),
            &machine,
            oom.is_some(),
        )?);
    }
    let diagnosis = Diagnosis {
        source: args.trace.display().to_string(),
        snapshot: recorded.is_some(),
        allocator: machine.allocator.name().to_string(),
        alloc_conf,
        device,
        history: h,
        iterations,
        growth,
        baseline,
        oom,
        projected_oom_iteration,
        remedies,
    };
    if let Some(path) = &args.plot {
        let report = Report {
            source: diagnosis.source.clone(),
            allocator: diagnosis.allocator.clone(),
            alloc_conf: diagnosis.alloc_conf.clone(),
            memory_fraction: machine.memory_fraction,
            device: diagnosis.device.clone(),
            outcome: diagnosis.baseline.clone(),
        };
        report
            .plot_timeline(&format!("{} · diagnose", diagnosis.source), path)
            .with_context(|| format!("cannot draw {}", path.display()))?;
    }
    Ok(diagnosis)
}

/// Runs `vramsim diagnose`.
pub fn run(args: DiagnoseArgs) -> Result<()> {
    let d = diagnose(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&d.to_json())?);
    } else {
        print!("{}", d.to_table());
        if let Some(path) = &args.plot {
            println!("plot       {}", path.display());
        }
    }
    Ok(())
}

impl Diagnosis {
    /// `vramsim diagnose --json`'s document.
    pub fn to_json(&self) -> Value {
        let it = self.iterations.as_ref();
        let g = self.growth.as_ref();
        json!({
            "source": self.source,
            "input": if self.snapshot { "snapshot" } else { "trace" },
            "allocator": self.allocator,
            "alloc_conf": self.alloc_conf,
            "device": {
                "name": self.device.name,
                "total_memory_bytes": self.device.total_memory,
                "context_bytes": self.device.context_bytes,
                "other_processes_bytes": self.device.other_processes.iter().map(|p| p.bytes).sum::<u64>(),
            },
            "events": self.history.events,
            "allocations": self.history.allocations.len(),
            "iterations": it.map(|it| json!({
                "count": it.starts.len(),
                "detected_by": it.detected_by,
                "start_events": it.starts,
                "live_bytes_at_start": g.map(|g| g.live_at_start.clone()),
                "leaked_bytes_by_iteration": g.map(|g| g.leaked_by_iteration.clone()),
            })),
            "growth_bytes_per_iteration": g.and_then(|g| g.bytes_per_iteration),
            "leaks": g.map(|g| g.leaks.iter().map(|l| json!({
                "site": l.site,
                "bytes": l.bytes,
                "count": l.count,
                "iterations": l.iterations,
                "first_event": l.first_event,
            })).collect::<Vec<_>>()).unwrap_or_default(),
            "projected_oom_iteration": self.projected_oom_iteration,
            "peaks": peaks_json(&self.baseline),
            "oom": self.oom.as_ref().map(|o| json!({
                "event_index": o.event_index,
                "message": o.message,
                "requested_bytes": o.requested_bytes,
            })),
            "oom_cause": self.oom.as_ref().map(|o| json!({
                "decided_by": o.cause.name(),
                "explanation": o.cause.sentence(),
                "requested_bytes": o.requested_bytes,
                "live_tensor_bytes": o.live_tensor_bytes,
                "reserved_unallocated_bytes": o.reserved_unallocated_bytes,
                "other_processes_bytes": o.other_processes_bytes,
                "context_bytes": o.context_bytes,
                "total_memory_bytes": o.total_memory_bytes,
                "memory_limit_bytes": o.memory_limit_bytes,
                "live_by_site": o.top_sites.iter().map(|(s, b)| json!({"site": s, "bytes": b})).collect::<Vec<_>>(),
                "live_by_category": o.categories.iter().map(|(c, b)| json!({"category": c, "bytes": b})).collect::<Vec<_>>(),
            })),
            "remedies": self.remedies.iter().map(Remedy::to_json).collect::<Vec<_>>(),
        })
    }

    /// `vramsim diagnose`'s table.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let mut line = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        line(format!("input      {}", self.source));
        line(format!(
            "allocator  {}{}",
            self.allocator,
            if self.alloc_conf.is_empty() {
                String::new()
            } else {
                format!(" ({})", self.alloc_conf)
            }
        ));
        line(format!(
            "device     {}, {} total",
            self.device.name,
            format_size(self.device.total_memory)
        ));
        line(format!(
            "history    {} events, {} allocations",
            self.history.events,
            self.history.allocations.len()
        ));
        match (&self.iterations, &self.growth) {
            (Some(it), Some(g)) => {
                line(format!(
                    "iterations {} (by {})",
                    it.starts.len(),
                    it.detected_by
                ));
                match g.bytes_per_iteration {
                    Some(0) => line(
                        "growth     none: the inner iterations free everything they allocate"
                            .into(),
                    ),
                    Some(b) => line(format!(
                        "growth     {} per iteration never freed",
                        format_size(b)
                    )),
                    None => line(
                        "growth     not measurable: three iterations or more are needed".into(),
                    ),
                }
                for l in g.leaks.iter().take(TOP_SITES) {
                    line(format!(
                        "  leak     {:>12} in {} iteration(s) ({} allocation(s)) at {}",
                        format_size(l.bytes),
                        l.iterations,
                        l.count,
                        l.site
                    ));
                }
            }
            _ => line("iterations none found (no repeating phase or allocation pattern)".into()),
        }
        if let Some(n) = self.projected_oom_iteration {
            line(format!(
                "projection at this growth the device runs out of memory in iteration {n}"
            ));
        }
        line(format!(
            "peaks      allocated {}, reserved {}",
            format_size(self.baseline.stats.allocated_bytes.all.peak.max(0) as u64),
            format_size(self.baseline.stats.reserved_bytes.all.peak.max(0) as u64)
        ));
        match &self.oom {
            None => line("oom        none in the replay".into()),
            Some(o) => {
                line(format!("oom        event {}: {}", o.event_index, o.message));
                line(format!(
                    "  split    request {}; live tensors {}; reserved but unallocated {}; other processes {}; CUDA context {}; device {}",
                    format_size(o.requested_bytes),
                    format_size(o.live_tensor_bytes),
                    format_size(o.reserved_unallocated_bytes),
                    format_size(o.other_processes_bytes),
                    format_size(o.context_bytes),
                    format_size(o.total_memory_bytes)
                ));
                line(format!(
                    "  cause    {}: {}",
                    o.cause.name(),
                    o.cause.sentence()
                ));
                for (site, bytes) in &o.top_sites {
                    line(format!("  live     {:>12} {site}", format_size(*bytes)));
                }
            }
        }
        if self.remedies.is_empty() {
            line("remedies   none to try for this allocator".into());
        }
        for r in &self.remedies {
            line(r.to_line(self.oom.is_some()));
        }
        if self.oom.is_some() && !self.remedies.iter().any(|r| r.avoids_oom == Some(true)) {
            line("verdict    none of the candidates avoids the out-of-memory error".into());
        }
        out
    }
}

/// The peaks of a replay, as JSON.
pub(crate) fn peaks_json(o: &ReplayOutcome) -> Value {
    json!({
        "allocated_bytes": o.stats.allocated_bytes.all.peak,
        "reserved_bytes": o.stats.reserved_bytes.all.peak,
        "device_used_bytes": o.peak_device_used,
        "fits": o.oom.is_none(),
    })
}
