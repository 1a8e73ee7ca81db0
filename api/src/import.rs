//! `vramsim import`, and PyTorch memory snapshots wherever a command takes a trace.
//!
//! A snapshot (the pickle `torch.cuda.memory._dump_snapshot()` writes, optionally gzipped) is told from a
//! trace by its first byte (a pickle of protocol 2 or later starts with `0x80`; a trace with `{`), and
//! imported one device at a time (`vramsim_sim::import`). Replaying a snapshot uses, unless told
//! otherwise, the snapshot's own allocator settings and the device capacity its history implies, so that
//! the replay starts where the recorded run did; `--alloc-conf`, `--gpu` and `--capacity` ask "what if".

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use vramsim_sim::check::device_for;
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::engine::ReplayOutcome;
use vramsim_sim::format::format_size;
use vramsim_sim::import::{
    config_from_settings, import_device, DeviceImport, ImportOptions, ReleaseCause,
    SnapshotSettings,
};
use vramsim_traces::snapshot::{is_snapshot_file, load_snapshot_file, Snapshot};
use vramsim_traces::{AllocId, Event, TraceError};

use crate::machine::MachineArgs;

/// Options of `vramsim import`.
#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The snapshot: the pickle `torch.cuda.memory._dump_snapshot()` writes (optionally gzipped).
    pub snapshot: PathBuf,
    /// Where to write the trace (`.jsonl` for JSON Lines, `.json` for a JSON document, `.gz` to
    /// compress). With several devices and no --device, one file per device: `NAME.deviceN.jsonl`.
    #[arg(short, long)]
    pub output: PathBuf,
    /// The device to import (default: every device with a history or segments).
    #[arg(long)]
    pub device: Option<u32>,
}

/// The snapshot options of commands that take a trace or a snapshot.
#[derive(Args, Debug, Clone, Default)]
pub struct SnapshotArgs {
    /// For a snapshot input: the device whose history to replay (needed when several have one).
    #[arg(long)]
    pub device: Option<u32>,
}

/// Reads a snapshot file, saying plainly when the file is not one.
pub fn load_snapshot(path: &Path) -> Result<Snapshot> {
    load_snapshot_file(path).map_err(|e| anyhow::Error::new(NotASnapshot(e)))
}

/// A file that cannot be read as a snapshot: the reader's error and what was expected, in one message
/// (no source, so that `{:#}` says it once); typed so that callers can tell it from a bad option.
#[derive(Debug)]
pub struct NotASnapshot(pub vramsim_traces::snapshot::SnapshotError);

impl std::fmt::Display for NotASnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}\n(expected a PyTorch memory snapshot: the pickle `torch.cuda.memory._dump_snapshot()` writes)",
            self.0
        )
    }
}

impl std::error::Error for NotASnapshot {}

/// Whether `path` holds a snapshot rather than a trace.
fn is_snapshot(path: &Path) -> Result<bool> {
    is_snapshot_file(path).with_context(|| format!("cannot read {}", path.display()))
}

/// The one device to replay: `--device`, or the only device with something recorded.
fn pick_device(snapshot: &Snapshot, path: &Path, device: Option<u32>) -> Result<u32> {
    if let Some(d) = device {
        return Ok(d);
    }
    match snapshot.devices_with_data().as_slice() {
        [one] => Ok(*one),
        [] => snapshot.devices().first().copied().ok_or_else(|| {
            anyhow!(
                "{}: the snapshot holds no device (no segments and no history)",
                path.display()
            )
        }),
        many => bail!(
            "{}: the snapshot holds devices {}: choose one with --device N",
            path.display(),
            many.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Imports one device with the snapshot's own settings.
fn import(snapshot: &Snapshot, device: u32) -> Result<(DeviceImport, SnapshotSettings)> {
    let settings = config_from_settings(snapshot.allocator_settings.as_ref());
    let options = ImportOptions {
        config: settings.config.clone(),
    };
    let import = import_device(snapshot, device, &options)?;
    Ok((import, settings))
}

/// One device of a snapshot, imported and written as a trace.
pub struct Imported {
    /// The CUDA device index.
    pub device: u32,
    /// Events of the trace written.
    pub events: usize,
    /// Entries of the recorded history.
    pub entries: usize,
    /// Segments the allocator held when recording began.
    pub initial_segments: usize,
    /// Runs of segment frees read as `empty_cache` calls.
    pub empty_cache: usize,
    /// Frees deferred by `record_stream`, written as synthetic streams.
    pub deferred_frees: u64,
    /// Out-of-memory errors recorded.
    pub ooms: usize,
    /// Where the trace was written.
    pub path: PathBuf,
    /// What the import inferred, in words.
    pub notes: Vec<String>,
}

impl Imported {
    /// The line `vramsim import` prints for the device (and its notes).
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "device {}: {} events from {} recorded entries ({} segments at the start, {} read as empty_cache, {} deferred frees, {} ooms) -> {}\n",
            self.device,
            self.events,
            self.entries,
            self.initial_segments,
            self.empty_cache,
            self.deferred_frees,
            self.ooms,
            self.path.display()
        );
        for note in &self.notes {
            s.push_str(&format!("  note: {note}\n"));
        }
        s
    }

    /// The same as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "device": self.device,
            "events": self.events,
            "recorded_entries": self.entries,
            "initial_segments": self.initial_segments,
            "empty_cache": self.empty_cache,
            "deferred_frees": self.deferred_frees,
            "ooms": self.ooms,
            "path": self.path.display().to_string(),
            "notes": self.notes,
        })
    }
}

/// `vramsim import` without the printing: each device imported and its trace written.
pub fn import_snapshot(args: &ImportArgs) -> Result<Vec<Imported>> {
    let snapshot = load_snapshot(&args.snapshot)?;
    let targets = match args.device {
        Some(d) => vec![d],
        None => {
            let with_data = snapshot.devices_with_data();
            if with_data.is_empty() {
                vec![pick_device(&snapshot, &args.snapshot, None)?]
            } else {
                with_data
            }
        }
    };
    let several = targets.len() > 1;
    let mut done = Vec::new();
    for device in targets {
        let (import, _) = import(&snapshot, device)?;
        let path = if several {
            per_device_name(&args.output, device)
        } else {
            args.output.clone()
        };
        vramsim_traces::write_trace(&path, &import.trace)
            .with_context(|| format!("cannot write {}", path.display()))?;
        let r = &import.recorded;
        done.push(Imported {
            device,
            events: import.trace.events.len(),
            entries: r.entries,
            initial_segments: r.initial.segments,
            empty_cache: r
                .releases
                .iter()
                .filter(|x| x.cause == ReleaseCause::EmptyCache)
                .count(),
            deferred_frees: r.deferred_frees,
            ooms: r.ooms.len(),
            path,
            notes: r.notes.clone(),
        });
    }
    Ok(done)
}

/// `vramsim import`.
pub fn run(args: ImportArgs) -> Result<()> {
    for imported in import_snapshot(&args)? {
        print!("{}", imported.to_text());
    }
    Ok(())
}

/// `trace.jsonl.gz` → `trace.device1.jsonl.gz`.
fn per_device_name(path: &Path, device: u32) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (stem, ext) = match name.find('.') {
        Some(i) if i > 0 => (&name[..i], &name[i..]),
        _ => (name.as_str(), ""),
    };
    path.with_file_name(format!("{stem}.device{device}{ext}"))
}

/// The events of a trace file or of one device of a snapshot.
pub type Events = Box<dyn Iterator<Item = Result<Event, TraceError>>>;

/// A snapshot being replayed.
pub struct SnapshotInput {
    /// The imported device.
    pub import: DeviceImport,
    /// The snapshot's settings.
    pub settings: SnapshotSettings,
}

/// Opens a trace, or imports one device of a snapshot (then also returned, for
/// [`SnapshotInput::machine`] and [`SnapshotInput::verdict`]).
pub fn open_input(path: &Path, args: &SnapshotArgs) -> Result<(Events, Option<SnapshotInput>)> {
    if !is_snapshot(path)? {
        let events = vramsim_traces::open_events(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        return Ok((Box::new(events), None));
    }
    let snapshot = load_snapshot(path)?;
    let device = pick_device(&snapshot, path, args.device)?;
    let (import, settings) =
        import(&snapshot, device).with_context(|| format!("cannot import {}", path.display()))?;
    let events: Vec<Event> = import.trace.events.clone();
    Ok((
        Box::new(events.into_iter().map(Ok)),
        Some(SnapshotInput { import, settings }),
    ))
}

/// The machine a trace or snapshot replays on: for a snapshot, its own settings unless `--alloc-conf`
/// is given, and the capacity its history implies (no CUDA context) unless `--gpu`/`--capacity` is.
pub fn machine_for(snapshot: Option<&SnapshotInput>, given: &MachineArgs) -> MachineArgs {
    match snapshot {
        Some(s) => s.machine(given),
        None => given.clone(),
    }
}

impl SnapshotInput {
    /// See [`machine_for`].
    pub fn machine(&self, given: &MachineArgs) -> MachineArgs {
        let mut machine = given.clone();
        let s = self;
        machine.device_index = s.import.device;
        if machine.alloc_conf.is_empty() && machine.allocator.is_pytorch() {
            machine.alloc_conf = settings_string(&s.settings.config);
        }
        if machine.gpu.is_none() && machine.capacity.is_none() {
            let choice = device_for(&s.import.recorded.capacity, s.import.device);
            machine.capacity = Some(choice.device.total_memory.to_string());
            if machine.context.is_none() {
                machine.context = Some("0".to_owned());
            }
        }
        machine
    }

    /// For a snapshot: what the replay says of the recorded run (the device, and whether its recorded
    /// out-of-memory error still happens), as lines for the table and as JSON.
    pub fn verdict(&self, given: &MachineArgs, outcome: &ReplayOutcome) -> (Vec<String>, Value) {
        let s = self;
        let r = &s.import.recorded;
        let mut lines = vec![format!(
            "snapshot   device {}, {} recorded entries; settings {}{}",
            s.import.device,
            r.entries,
            s.settings.source,
            if given.alloc_conf.is_empty() {
                ""
            } else {
                " (replayed with --alloc-conf instead)"
            }
        )];
        if given.gpu.is_none() && given.capacity.is_none() {
            lines.push(format!(
                "capacity   {}",
                device_for(&r.capacity, s.import.device).source
            ));
        }
        let recorded = r.ooms.first();
        let happened = outcome.oom.as_ref();
        let verdict = match (recorded, happened) {
            (Some(o), Some(h)) if h.id == AllocId::Str(format!("oom@{}", o.entry).into()) => {
                format!("the recorded out-of-memory (entry {}, {}) still happens at the same request", o.entry, format_size(o.size))
            }
            (Some(o), Some(h)) => format!(
                "out-of-memory at trace event {} ({} requested), before the recorded one (entry {})",
                h.event_index,
                format_size(h.requested_bytes),
                o.entry
            ),
            (Some(o), None) => format!(
                "the recorded out-of-memory (entry {}, {}) does not happen",
                o.entry,
                format_size(o.size)
            ),
            (None, Some(h)) => format!(
                "out-of-memory at trace event {} ({} requested): the recorded run had none",
                h.event_index,
                format_size(h.requested_bytes)
            ),
            (None, None) => "no out-of-memory, as recorded".to_owned(),
        };
        lines.push(format!("recorded   {verdict}"));
        let json = json!({
            "device": s.import.device,
            "recorded_entries": r.entries,
            "settings": s.settings.source,
            "recorded_ooms": r.ooms.iter().map(|o| o.entry).collect::<Vec<_>>(),
            "verdict": verdict,
            "recorded_final_reserved": r.final_reserved,
            "recorded_peak_reserved": r.peak_reserved,
        });
        (lines, json)
    }
}

/// A settings string PyTorch would parse to `config`'s modelled settings (for snapshots whose settings
/// come as fields only).
pub fn settings_string(config: &AllocatorConfig) -> String {
    if !config.settings.is_empty() {
        return config.settings.clone();
    }
    let mut parts = Vec::new();
    if config.expandable_segments {
        parts.push("expandable_segments:True".to_owned());
    }
    if config.max_split_size != u64::MAX {
        parts.push(format!("max_split_size_mb:{}", config.max_split_size >> 20));
    }
    if config.garbage_collection_threshold > 0.0 {
        parts.push(format!(
            "garbage_collection_threshold:{}",
            config.garbage_collection_threshold
        ));
    }
    if config.roundup_power2_divisions.iter().any(|&d| d != 0) {
        let list: Vec<String> = config
            .roundup_power2_divisions
            .iter()
            .enumerate()
            .map(|(k, d)| format!("{}:{d}", 1u64 << k))
            .collect();
        parts.push(format!("roundup_power2_divisions:[{}]", list.join(",")));
    }
    parts.join(",")
}
