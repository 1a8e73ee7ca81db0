//! `check-snapshot`: how faithfully the caching-allocator model reproduces a real GPU run recorded in a
//! PyTorch memory snapshot.
//!
//! ```no_run
//! use vramsim_sim::check::{check_device, CheckOptions};
//! let snapshot = vramsim_traces::snapshot::load_snapshot_file("run.pickle.gz").unwrap();
//! let report = check_device(&snapshot, 0, &CheckOptions::default()).unwrap();
//! assert_eq!(report.segment_events_matched, report.segment_events_recorded);
//! println!("{}", report.to_table());
//! ```
//!
//! The device's history is imported ([`crate::import`]: the state recording began from, then the
//! program's requests) and replayed through [`CachingAllocator`] with the snapshot's own
//! `allocator_settings`, recording the simulated history. The replay goes on after an out-of-memory
//! error, as the recorded program did when it caught it. Each recorded action is then compared with what
//! the simulation did *at the same request*:
//!
//! - **segment events** (`segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`): a recorded event
//!   matches a simulated one of the same action, size and address in the same step (the `malloc`,
//!   `free` or `empty_cache` it happened in);
//! - **placement**: an allocation matches when the simulated block lies at the same offset of the same
//!   segment as the recorded one;
//! - **out-of-memory errors**: at the same request, with PyTorch's message;
//! - **the final state**: reserved and allocated bytes, and the segments, against the snapshot's
//!   `segments`;
//!
//! and the first step where anything differs is reported with the rule that decided it.
//!
//! Two things a snapshot does not say are supplied from the history. *Addresses*: where the CUDA driver
//! puts a new segment is not the allocator's decision, but the allocator's ties (best fit among equal
//! sizes, §2.3) are broken by address, so the replay gives each new segment the address the GPU gave it
//! ([`CachingAllocator::set_segment_address_hints`]; simulated addresses are translated where a hint
//! could not be used). *Capacity*: taken from an `oom` entry (its `device_free` plus what was reserved
//! then), else from the releases the allocator made (between the highest reservation and what the failing
//! request needed), else the default GPU; `--gpu`/`--capacity` override it. Which one was used is part of
//! the report.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Value};
use vramsim_traces::snapshot::{Action as RecAction, BlockState, Snapshot};
use vramsim_traces::Event;

use crate::allocator::caching::CachingAllocator;
use crate::allocator::{Action, Allocator, HistoryEntry, SegmentInfo};
use crate::device::{Device, DEFAULT_GPU};
use crate::engine::{Replay, ReplayOptions};
use crate::format::format_size;
use crate::import::{
    config_from_settings, import_device, Capacity, DeviceImport, ImportError, ImportOptions,
    InitialState, ReleaseCause,
};

/// How to check.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// The device to replay on, instead of the capacity the history implies (`--gpu`, `--capacity`).
    pub device: Option<Device>,
    /// Give new segments the addresses the GPU gave them (default true; false leaves placement to the
    /// simulated address space, to see how much the driver's address order matters).
    pub recorded_addresses: bool,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            device: None,
            recorded_addresses: true,
        }
    }
}

/// The device a check replays on, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct CapacityChoice {
    /// The device (its `total_memory` is the usable capacity; no context unless given).
    pub device: Device,
    /// How it was chosen.
    pub source: String,
}

/// The device the history implies (see the module doc), on device index `index`.
pub fn device_for(capacity: &Capacity, index: u32) -> CapacityChoice {
    let (bytes, source) = match *capacity {
        Capacity::Oom {
            usable,
            entry,
            device_free,
            reserved,
        } => (
            usable,
            format!(
                "inferred from the oom at entry {entry}: device_free {} + reserved {} (total capacity, CUDA context and other processes are not recorded: the message's total is this figure)",
                format_size(device_free),
                format_size(reserved)
            ),
        ),
        Capacity::Window {
            at_least, below, entry,
        } => (
            at_least + (below - at_least) / 2,
            format!(
                "inferred from the allocator's release at entry {entry}: midway between the highest reservation, {}, and what that request needed, {}",
                format_size(at_least),
                format_size(below)
            ),
        ),
        Capacity::AtLeast { bytes } => {
            let default = Device::preset(DEFAULT_GPU).expect("the default preset exists");
            if default.total_memory >= bytes {
                let mut device = default;
                device.context_bytes = 0;
                device.index = index;
                return CapacityChoice {
                    source: format!(
                        "the default GPU ({DEFAULT_GPU}, {}, no context): the history does not constrain it beyond its highest reservation, {}",
                        format_size(device.total_memory),
                        format_size(bytes)
                    ),
                    device,
                };
            }
            (
                bytes,
                format!(
                    "the highest reservation recorded, {} (the history does not constrain it further)",
                    format_size(bytes)
                ),
            )
        }
    };
    let mut device = Device::with_capacity(bytes);
    device.index = index;
    CapacityChoice { device, source }
}

/// One recorded or simulated action, as a report shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActionView {
    /// The action (`segment_alloc`, `alloc`, `oom`, ...).
    pub action: String,
    /// Its address (recorded addresses; simulated ones translated where known), `device_free` for `oom`.
    pub addr: u64,
    /// Its size.
    pub size: u64,
}

/// The first step where the simulation did something other than the GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// Index of the recorded entry (in the device's history) of the request.
    pub entry: usize,
    /// Index of the event in the imported trace.
    pub trace_event: usize,
    /// The request (`alloc`, `free`, `empty_cache`).
    pub request: String,
    /// What the GPU recorded in that step.
    pub recorded: Vec<ActionView>,
    /// What the simulation did.
    pub simulated: Vec<ActionView>,
    /// The allocator rule that decided, in words.
    pub rule: String,
}

/// Recorded, simulated and matched counts of one segment action.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Recorded events.
    pub recorded: u64,
    /// Simulated events.
    pub simulated: u64,
    /// Recorded events the simulation reproduced.
    pub matched: u64,
}

/// A recorded out-of-memory error and what the simulation did at the same request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomCheck {
    /// The recorded entry.
    pub entry: usize,
    /// The rounded request.
    pub size: u64,
    /// Recorded `device_free`.
    pub device_free_recorded: u64,
    /// Whether the simulation raised out-of-memory at that request.
    pub simulated: bool,
    /// The simulated `device_free`, when it did.
    pub device_free_simulated: Option<u64>,
    /// PyTorch's message, as the simulation raised it.
    pub message: Option<String>,
}

/// What `check-snapshot` found for one device.
#[derive(Clone, Debug)]
pub struct CheckReport {
    /// The device index.
    pub device: u32,
    /// The settings used, and where they came from.
    pub settings: String,
    /// The capacity used, and where it came from.
    pub capacity: CapacityChoice,
    /// Entries in the device's history (0: state only).
    pub recorded_entries: usize,
    /// Recorded `alloc` entries.
    pub alloc_events: u64,
    /// Allocations replayed (recorded `alloc` entries that the simulation served).
    pub allocs_simulated: u64,
    /// Allocations at the same offset of the same segment as recorded.
    pub same_offset_allocs: u64,
    /// Recorded segment events (alloc, free, map, unmap).
    pub segment_events_recorded: u64,
    /// Simulated segment events.
    pub segment_events_simulated: u64,
    /// Recorded segment events reproduced at the same request.
    pub segment_events_matched: u64,
    /// The same, per action: `segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`.
    pub by_action: [Tally; 4],
    /// Σ `total_size` of the final segments.
    pub final_reserved_recorded: u64,
    /// Reserved bytes at the end of the replay.
    pub final_reserved_simulated: u64,
    /// Σ `allocated_size` of the final segments.
    pub final_allocated_recorded: u64,
    /// Allocated bytes at the end of the replay.
    pub final_allocated_simulated: u64,
    /// The final segments.
    pub final_segments_recorded: usize,
    /// Final segments the replay ends with at the same address, with the same blocks.
    pub final_segments_matched: usize,
    /// Recorded out-of-memory errors, each with the simulation's answer.
    pub ooms: Vec<OomCheck>,
    /// Out-of-memory errors the simulation raised.
    pub ooms_simulated: u64,
    /// The reconstructed state recording began from.
    pub initial: InitialState,
    /// Releases the importer read as `empty_cache` calls, and as the allocator's own.
    pub releases: (usize, usize),
    /// Frees deferred by stream events.
    pub deferred_frees: u64,
    /// The first step that differs.
    pub first_divergence: Option<Divergence>,
    /// Things the reader should know (settings, contradictions in the snapshot, skipped events).
    pub notes: Vec<String>,
}

impl CheckReport {
    /// Whether the device has a recorded history (false: a state-only snapshot, only the final-state
    /// checks mean anything).
    pub fn has_history(&self) -> bool {
        self.recorded_entries > 0
    }

    /// Recorded OOMs the simulation raised at the same request.
    pub fn ooms_matched(&self) -> usize {
        self.ooms.iter().filter(|o| o.simulated).count()
    }

    /// The report as JSON (the keys are documented by `vramsim check-snapshot --help`).
    pub fn to_json(&self) -> Value {
        let view = |v: &[ActionView]| {
            v.iter()
                .map(|a| json!({"action": a.action, "addr": a.addr, "size": a.size}))
                .collect::<Vec<_>>()
        };
        let names = [
            "segment_alloc",
            "segment_free",
            "segment_map",
            "segment_unmap",
        ];
        let mut by_action = serde_json::Map::new();
        for (name, t) in names.iter().zip(&self.by_action) {
            by_action.insert(
                (*name).to_owned(),
                json!({"recorded": t.recorded, "simulated": t.simulated, "matched": t.matched}),
            );
        }
        json!({
            "device": self.device,
            "has_history": self.has_history(),
            "recorded_entries": self.recorded_entries,
            "settings": self.settings,
            "capacity": {"bytes": self.capacity.device.total_memory, "source": self.capacity.source},
            "alloc_events": self.alloc_events,
            "allocs_simulated": self.allocs_simulated,
            "same_offset_allocs": self.same_offset_allocs,
            "segment_events_recorded": self.segment_events_recorded,
            "segment_events_simulated": self.segment_events_simulated,
            "segment_events_matched": self.segment_events_matched,
            "segment_events": by_action,
            "final_reserved_recorded": self.final_reserved_recorded,
            "final_reserved_simulated": self.final_reserved_simulated,
            "final_allocated_recorded": self.final_allocated_recorded,
            "final_allocated_simulated": self.final_allocated_simulated,
            "final_segments_recorded": self.final_segments_recorded,
            "final_segments_matched": self.final_segments_matched,
            "ooms_recorded": self.ooms.len(),
            "ooms_simulated": self.ooms_simulated,
            "ooms_matched": self.ooms_matched(),
            "ooms": self.ooms.iter().map(|o| json!({
                "entry": o.entry, "size": o.size, "device_free_recorded": o.device_free_recorded,
                "simulated": o.simulated, "device_free_simulated": o.device_free_simulated,
                "message": o.message,
            })).collect::<Vec<_>>(),
            "initial_state": {
                "segments": self.initial.segments, "reserved_bytes": self.initial.reserved,
                "allocated_bytes": self.initial.allocated, "live_blocks": self.initial.live_blocks,
                "inferred_block_sizes": self.initial.inferred_block_sizes,
                "pending_frees": self.initial.pending_frees,
            },
            "releases": {"empty_cache": self.releases.0, "allocator": self.releases.1},
            "deferred_frees": self.deferred_frees,
            "first_divergence": self.first_divergence.as_ref().map(|d| json!({
                "entry": d.entry, "trace_event": d.trace_event, "request": d.request,
                "recorded": view(&d.recorded), "simulated": view(&d.simulated), "rule": d.rule,
            })),
            "notes": self.notes,
        })
    }

    /// The report as a table for people.
    pub fn to_table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(t, "device {}", self.device);
        let _ = writeln!(t, "  settings        {}", self.settings);
        let _ = writeln!(
            t,
            "  capacity        {} ({} bytes): {}",
            format_size(self.capacity.device.total_memory),
            self.capacity.device.total_memory,
            self.capacity.source
        );
        if !self.has_history() {
            let _ = writeln!(
                t,
                "  history         none: a state-only snapshot (recorded without trace entries); only the final state is checked"
            );
        } else {
            let i = &self.initial;
            let _ = writeln!(
                t,
                "  history         {} entries; recording began with {} segments ({}), {} live blocks ({} allocated, {} sized by inference, {} pending)",
                self.recorded_entries,
                i.segments,
                format_size(i.reserved),
                i.live_blocks,
                format_size(i.allocated),
                i.inferred_block_sizes,
                i.pending_frees
            );
            let _ = writeln!(
                t,
                "  releases        {} read as empty_cache, {} by the allocator; {} deferred frees",
                self.releases.0, self.releases.1, self.deferred_frees
            );
        }
        let _ = writeln!(t);
        let _ = writeln!(
            t,
            "  {:<22} {:>10} {:>10} {:>10} {:>8}",
            "", "recorded", "simulated", "matched", ""
        );
        let names = [
            "segment_alloc",
            "segment_free",
            "segment_map",
            "segment_unmap",
        ];
        for (name, tally) in names.iter().zip(&self.by_action) {
            if tally.recorded + tally.simulated == 0 {
                continue;
            }
            matched_row(&mut t, name, tally.recorded, tally.simulated, tally.matched);
        }
        matched_row(
            &mut t,
            "segment events",
            self.segment_events_recorded,
            self.segment_events_simulated,
            self.segment_events_matched,
        );
        matched_row(
            &mut t,
            "allocs (same offset)",
            self.alloc_events,
            self.allocs_simulated,
            self.same_offset_allocs,
        );
        let _ = writeln!(
            t,
            "  {:<22} {:>10} {:>10} {:>10}",
            "ooms",
            self.ooms.len(),
            self.ooms_simulated,
            self.ooms_matched()
        );
        let _ = writeln!(
            t,
            "  {:<22} {:>10} {:>10} {:>10}",
            "final segments", self.final_segments_recorded, "", self.final_segments_matched
        );
        let same = |a: u64, b: u64| if a == b { "same" } else { "DIFFERENT" };
        let _ = writeln!(
            t,
            "  {:<22} {:>10} {:>10} {:>10}",
            "final reserved",
            format_size(self.final_reserved_recorded),
            format_size(self.final_reserved_simulated),
            same(self.final_reserved_recorded, self.final_reserved_simulated)
        );
        let _ = writeln!(
            t,
            "  {:<22} {:>10} {:>10} {:>10}",
            "final allocated",
            format_size(self.final_allocated_recorded),
            format_size(self.final_allocated_simulated),
            same(
                self.final_allocated_recorded,
                self.final_allocated_simulated
            )
        );
        for o in &self.ooms {
            let _ = writeln!(t);
            let _ = writeln!(
                t,
                "  oom at entry {} ({} requested, {} free recorded): {}",
                o.entry,
                format_size(o.size),
                format_size(o.device_free_recorded),
                match (o.simulated, o.device_free_simulated) {
                    (true, Some(free)) => format!(
                        "reproduced at the same request, {} free simulated",
                        format_size(free)
                    ),
                    _ => "NOT reproduced: the simulation served the request".to_owned(),
                }
            );
            if let Some(m) = &o.message {
                let _ = writeln!(t, "    {m}");
            }
        }
        let _ = writeln!(t);
        match &self.first_divergence {
            None => {
                let _ = writeln!(t, "  first divergence: none");
            }
            Some(d) => {
                let _ = writeln!(
                    t,
                    "  first divergence: entry {} ({}, trace event {})",
                    d.entry, d.request, d.trace_event
                );
                let show = |v: &[ActionView]| {
                    if v.is_empty() {
                        "nothing".to_owned()
                    } else {
                        v.iter()
                            .map(|a| format!("{} {:#x} {}", a.action, a.addr, a.size))
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                };
                let _ = writeln!(t, "    recorded:  {}", show(&d.recorded));
                let _ = writeln!(t, "    simulated: {}", show(&d.simulated));
                let _ = writeln!(t, "    rule:      {}", d.rule);
            }
        }
        for note in &self.notes {
            let _ = writeln!(t, "  note: {note}");
        }
        t
    }
}

/// A recorded segment event waiting for its step.
#[derive(Clone, Copy, Debug)]
struct RecSeg {
    action: Action,
    addr: u64,
    size: u64,
}

/// Translation of simulated addresses to recorded ones: simulated range start → (end, recorded start).
#[derive(Default)]
struct Translation {
    ranges: BTreeMap<u64, (u64, u64)>,
}

impl Translation {
    /// Translates `[sim, sim + size)` to `[rec, rec + size)` from now on; the parts of earlier ranges it
    /// overlaps are forgotten, the rest of them kept.
    fn add(&mut self, sim: u64, size: u64, rec: u64) {
        let end = sim + size;
        let overlapping: Vec<(u64, u64, u64)> = self
            .ranges
            .range(..end)
            .rev()
            .take_while(|(_, &(stop, _))| stop > sim)
            .map(|(&start, &(stop, r))| (start, stop, r))
            .collect();
        for (start, stop, r) in overlapping {
            self.ranges.remove(&start);
            if start < sim {
                self.ranges.insert(start, (sim, r));
            }
            if stop > end {
                self.ranges.insert(end, (stop, r + (end - start)));
            }
        }
        self.ranges.insert(sim, (end, rec));
    }

    fn remove(&mut self, sim: u64) {
        self.ranges.remove(&sim);
    }

    /// The recorded address of a simulated one, where known.
    fn of(&self, sim: u64) -> Option<u64> {
        let (&start, &(end, rec)) = self.ranges.range(..=sim).next_back()?;
        (sim < end).then_some(rec + (sim - start))
    }
}

/// The recorded segments (and mapped ranges) live at a point of the history: start → end.
#[derive(Default)]
struct RecordedRanges {
    ranges: BTreeMap<u64, u64>,
}

impl RecordedRanges {
    fn add(&mut self, addr: u64, size: u64) {
        self.ranges.insert(addr, addr + size);
    }

    fn remove(&mut self, addr: u64, size: u64) {
        let end = addr + size;
        let Some((&start, &stop)) = self.ranges.range(..=addr).next_back() else {
            return;
        };
        if stop < end {
            self.ranges.remove(&addr);
            return;
        }
        self.ranges.remove(&start);
        if start < addr {
            self.ranges.insert(start, addr);
        }
        if end < stop {
            self.ranges.insert(end, stop);
        }
    }

    fn containing(&self, addr: u64) -> Option<(u64, u64)> {
        let (&start, &stop) = self.ranges.range(..=addr).next_back()?;
        (addr < stop).then_some((start, stop))
    }
}

fn action_of(a: &RecAction) -> Option<Action> {
    Some(match a {
        RecAction::SegmentAlloc => Action::SegmentAlloc,
        RecAction::SegmentFree => Action::SegmentFree,
        RecAction::SegmentMap => Action::SegmentMap,
        RecAction::SegmentUnmap => Action::SegmentUnmap,
        _ => return None,
    })
}

fn tally_index(a: Action) -> usize {
    match a {
        Action::SegmentAlloc => 0,
        Action::SegmentFree => 1,
        Action::SegmentMap => 2,
        _ => 3,
    }
}

/// Checks device `device` of `snapshot` (see the module doc).
pub fn check_device(
    snapshot: &Snapshot,
    device: u32,
    options: &CheckOptions,
) -> Result<CheckReport, ImportError> {
    let settings = config_from_settings(snapshot.allocator_settings.as_ref());
    let import = import_device(
        snapshot,
        device,
        &ImportOptions {
            config: settings.config.clone(),
        },
    )?;
    let capacity = match &options.device {
        Some(d) => {
            let mut d = d.clone();
            d.index = device;
            CapacityChoice {
                device: d,
                source: "given (--gpu/--capacity)".to_owned(),
            }
        }
        None => device_for(&import.recorded.capacity, device),
    };
    let allocator = CachingAllocator::new(settings.config.clone(), capacity.device.clone());
    let mut notes = settings.notes.clone();
    notes.extend(import.recorded.notes.iter().cloned());
    let mut checker = Checker::new(snapshot, &import, allocator);
    checker.recorded_addresses = options.recorded_addresses;
    Ok(checker.run(settings.source, capacity, notes))
}

/// Checks every device of `snapshot` that has a history or segments.
pub fn check_snapshot(
    snapshot: &Snapshot,
    options: &CheckOptions,
) -> Result<Vec<CheckReport>, ImportError> {
    snapshot
        .devices_with_data()
        .into_iter()
        .map(|d| check_device(snapshot, d, options))
        .collect()
}

/// The replay and its bookkeeping.
struct Checker<'a> {
    snapshot: &'a Snapshot,
    import: &'a DeviceImport,
    replay: Replay<CachingAllocator>,
    translation: Translation,
    recorded_ranges: RecordedRanges,
    recorded_addresses: bool,
    report: CheckReport,
}

impl<'a> Checker<'a> {
    fn new(snapshot: &'a Snapshot, import: &'a DeviceImport, allocator: CachingAllocator) -> Self {
        let rec = &import.recorded;
        let report = CheckReport {
            device: import.device,
            settings: String::new(),
            capacity: CapacityChoice {
                device: Device::with_capacity(0),
                source: String::new(),
            },
            recorded_entries: rec.entries,
            alloc_events: rec.allocs,
            allocs_simulated: 0,
            same_offset_allocs: 0,
            segment_events_recorded: rec.segment_allocs
                + rec.segment_frees
                + rec.segment_maps
                + rec.segment_unmaps,
            segment_events_simulated: 0,
            segment_events_matched: 0,
            by_action: [
                Tally {
                    recorded: rec.segment_allocs,
                    ..Tally::default()
                },
                Tally {
                    recorded: rec.segment_frees,
                    ..Tally::default()
                },
                Tally {
                    recorded: rec.segment_maps,
                    ..Tally::default()
                },
                Tally {
                    recorded: rec.segment_unmaps,
                    ..Tally::default()
                },
            ],
            final_reserved_recorded: rec.final_reserved,
            final_reserved_simulated: 0,
            final_allocated_recorded: rec.final_allocated,
            final_allocated_simulated: 0,
            final_segments_recorded: rec.final_segments,
            final_segments_matched: 0,
            ooms: rec
                .ooms
                .iter()
                .map(|o| OomCheck {
                    entry: o.entry,
                    size: o.size,
                    device_free_recorded: o.device_free,
                    simulated: false,
                    device_free_simulated: None,
                    message: None,
                })
                .collect(),
            ooms_simulated: 0,
            initial: rec.initial.clone(),
            releases: (
                rec.releases
                    .iter()
                    .filter(|r| r.cause == ReleaseCause::EmptyCache)
                    .count(),
                rec.releases
                    .iter()
                    .filter(|r| r.cause == ReleaseCause::Allocator)
                    .count(),
            ),
            deferred_frees: rec.deferred_frees,
            first_divergence: None,
            notes: Vec::new(),
        };
        Checker {
            snapshot,
            import,
            replay: Replay::new(allocator, &ReplayOptions::default()),
            translation: Translation::default(),
            recorded_ranges: RecordedRanges::default(),
            recorded_addresses: true,
            report,
        }
    }

    fn run(
        mut self,
        settings: String,
        capacity: CapacityChoice,
        notes: Vec<String>,
    ) -> CheckReport {
        self.report.settings = settings;
        self.report.capacity = capacity;
        self.report.notes = notes;
        let entries = self
            .snapshot
            .device_traces
            .get(self.import.device as usize)
            .map_or(&[][..], Vec::as_slice);
        let events = &self.import.trace.events;
        let origins = &self.import.origins;
        self.replay.allocator_mut().set_record_history(true);
        let mut next_entry = 0usize; // the first recorded entry not yet assigned to a step
                                     // completions the ring buffer starts with may finish frees requested before it began
        let leading = entries
            .iter()
            .take_while(|e| e.action == RecAction::FreeCompleted)
            .count();
        let mut skipped = 0u64;
        for (k, event) in events.iter().enumerate() {
            // the recorded segment events of this step: those since the previous step's request
            let anchors = matches!(
                event,
                Event::Alloc { .. } | Event::Free { .. } | Event::EmptyCache
            );
            let mut rec_segs = Vec::new();
            let mut rec_completions = Vec::new();
            let mut rec_maybe_completions = Vec::new();
            if let (true, Some(origin)) = (anchors, origins[k]) {
                let origin = origin as usize;
                while next_entry <= origin && next_entry < entries.len() {
                    let e = &entries[next_entry];
                    let immediate = next_entry > 0 && {
                        let p = &entries[next_entry - 1];
                        p.action == RecAction::FreeRequested && p.addr == e.addr
                    };
                    if e.action == RecAction::FreeCompleted {
                        // right after its free_requested: completed at once, or (the block waited
                        // for stream events) by this step's malloc; the simulation says which
                        if immediate || next_entry < leading {
                            rec_maybe_completions.push(e.addr);
                        } else {
                            rec_completions.push(e.addr);
                        }
                    }
                    if let Some(action) = action_of(&e.action) {
                        rec_segs.push(RecSeg {
                            action,
                            addr: e.addr,
                            size: e.size,
                        });
                    }
                    next_entry += 1;
                }
            }
            if let Event::Segment(seg) = event {
                // adopted at its recorded address
                self.translation.add(seg.addr, seg.size, seg.addr);
                self.recorded_ranges.add(seg.addr, seg.size);
            }
            let hints: Vec<u64> = rec_segs
                .iter()
                .filter(|r| matches!(r.action, Action::SegmentAlloc | Action::SegmentMap))
                .filter(|_| self.recorded_addresses)
                .map(|r| r.addr)
                .collect();
            self.replay
                .allocator_mut()
                .set_segment_address_hints(&hints);
            let result = self.replay.apply(event.clone());
            self.replay.allocator_mut().set_segment_address_hints(&[]);
            if let Err(e) = result {
                skipped += 1;
                if skipped <= 3 {
                    self.report
                        .notes
                        .push(format!("trace event {k} could not be replayed: {e}"));
                }
            }
            let history = self.replay.allocator_mut().take_history();
            if let Some(origin) = origins[k] {
                if anchors {
                    self.compare(
                        k,
                        origin as usize,
                        event,
                        (&rec_segs, &mut rec_completions, &rec_maybe_completions),
                        &history,
                        entries,
                    );
                }
            }
        }
        if skipped > 3 {
            self.report.notes.push(format!(
                "{skipped} trace events in all could not be replayed (after an earlier divergence)"
            ));
        }
        self.finish()
    }

    /// Compares one step: the recorded segment events anchored to it and the recorded request, with the
    /// simulated history of the step.
    fn compare(
        &mut self,
        k: usize,
        entry: usize,
        event: &Event,
        (rec_segs, rec_completions, rec_maybe): (&[RecSeg], &mut Vec<u64>, &[u64]),
        history: &[HistoryEntry],
        entries: &[vramsim_traces::snapshot::TraceEntry],
    ) {
        let sim_segs: Vec<&HistoryEntry> = history
            .iter()
            .filter(|h| {
                matches!(
                    h.action,
                    Action::SegmentAlloc
                        | Action::SegmentFree
                        | Action::SegmentMap
                        | Action::SegmentUnmap
                )
            })
            .collect();
        for h in &sim_segs {
            self.report.segment_events_simulated += 1;
            self.report.by_action[tally_index(h.action)].simulated += 1;
        }
        // pair recorded and simulated segment events in order
        let mut used = vec![false; sim_segs.len()];
        let mut all_paired = true;
        for r in rec_segs {
            let found = sim_segs.iter().enumerate().position(|(i, h)| {
                !used[i]
                    && h.action == r.action
                    && h.size == r.size
                    && match r.action {
                        // a new range: paired by size; its address translates from now on
                        Action::SegmentAlloc | Action::SegmentMap => {
                            self.translation.of(h.addr).is_none_or(|a| a == r.addr)
                        }
                        _ => self.translation.of(h.addr) == Some(r.addr),
                    }
            });
            match found {
                Some(i) => {
                    used[i] = true;
                    let h = sim_segs[i];
                    self.report.segment_events_matched += 1;
                    self.report.by_action[tally_index(r.action)].matched += 1;
                    match r.action {
                        Action::SegmentAlloc | Action::SegmentMap => {
                            self.translation.add(h.addr, h.size, r.addr)
                        }
                        Action::SegmentFree => self.translation.remove(h.addr),
                        _ => {}
                    }
                }
                None => all_paired = false,
            }
            match r.action {
                Action::SegmentAlloc | Action::SegmentMap => {
                    self.recorded_ranges.add(r.addr, r.size)
                }
                _ => self.recorded_ranges.remove(r.addr, r.size),
            }
        }
        // simulated ranges nobody recorded: translate them to themselves, for the record
        let unpaired_sim = used.iter().any(|u| !u);
        let mut diverged = !all_paired || unpaired_sim;
        let recorded_entry = &entries[entry];
        // deferred frees (record_stream) returned to the cache in this step
        let freed_now = history
            .iter()
            .find(|h| h.action == Action::FreeRequested)
            .map(|h| h.addr);
        let mut sim_completions: Vec<u64> = history
            .iter()
            .filter(|h| h.action == Action::FreeCompleted && Some(h.addr) != freed_now)
            .map(|h| self.translation.of(h.addr).unwrap_or(h.addr))
            .collect();
        rec_completions.sort_unstable();
        let required = rec_completions.iter().all(|a| sim_completions.contains(a));
        let allowed = sim_completions
            .iter()
            .all(|a| rec_completions.contains(a) || rec_maybe.contains(a));
        sim_completions.sort_unstable();
        let mut why = None;
        if !(required && allowed) {
            diverged = true;
            why = Some(format!(
                "deferred frees (record_stream, §4.3) returned to the cache in this step: {} recorded ({}), {} simulated ({})",
                rec_completions.len(),
                hex_list(rec_completions),
                sim_completions.len(),
                hex_list(&sim_completions)
            ));
        }
        let sim_alloc = history.iter().find(|h| h.action == Action::Alloc);
        let sim_oom = history.iter().find(|h| h.action == Action::Oom);
        match (&recorded_entry.action, event) {
            (RecAction::Alloc, Event::Alloc { .. }) => match sim_alloc {
                Some(h) => {
                    self.report.allocs_simulated += 1;
                    if self.translation.of(h.addr) == Some(recorded_entry.addr) {
                        self.report.same_offset_allocs += 1;
                    } else {
                        diverged = true;
                    }
                }
                None => diverged = true,
            },
            (RecAction::Oom, Event::Alloc { .. }) => {
                let i = self
                    .report
                    .ooms
                    .iter()
                    .position(|o| o.entry == entry)
                    .expect("every recorded oom is listed");
                match sim_oom {
                    Some(h) => {
                        let o = &mut self.report.ooms[i];
                        o.simulated = true;
                        o.device_free_simulated = Some(h.addr);
                        o.message = self.replay.oom().map(|o| o.message.clone());
                    }
                    None => {
                        diverged = true;
                        why = Some(format!(
                            "PyTorch raised out-of-memory for {} bytes with {} free, but the simulated device had room (capacity {})",
                            recorded_entry.size,
                            format_size(recorded_entry.addr),
                            self.report.capacity.source
                        ));
                    }
                }
            }
            _ => {}
        }
        if sim_oom.is_some() {
            self.report.ooms_simulated += 1;
            if recorded_entry.action != RecAction::Oom {
                diverged = true;
            }
        }
        if diverged && self.report.first_divergence.is_none() {
            let recorded: Vec<ActionView> = rec_segs
                .iter()
                .map(|r| ActionView {
                    action: r.action.name().to_owned(),
                    addr: r.addr,
                    size: r.size,
                })
                .chain(std::iter::once(ActionView {
                    action: recorded_entry.action.as_str().to_owned(),
                    addr: recorded_entry.addr,
                    size: recorded_entry.size,
                }))
                .collect();
            let simulated: Vec<ActionView> = history
                .iter()
                .filter(|h| !matches!(h.action, Action::FreeCompleted))
                .map(|h| ActionView {
                    action: h.action.name().to_owned(),
                    addr: if h.action == Action::Oom {
                        h.addr
                    } else {
                        self.translation.of(h.addr).unwrap_or(h.addr)
                    },
                    size: h.size,
                })
                .collect();
            let rule = why.unwrap_or_else(|| self.rule(event, rec_segs, history, recorded_entry));
            self.report.first_divergence = Some(Divergence {
                entry,
                trace_event: k,
                request: event.op().to_owned(),
                recorded,
                simulated,
                rule,
            });
        }
    }

    /// The allocator rule behind a divergent step, in words.
    fn rule(
        &self,
        event: &Event,
        rec_segs: &[RecSeg],
        history: &[HistoryEntry],
        recorded: &vramsim_traces::snapshot::TraceEntry,
    ) -> String {
        let segments = self.replay.allocator().segments();
        let sim_alloc = history.iter().find(|h| h.action == Action::Alloc);
        let sim_new = history
            .iter()
            .find(|h| matches!(h.action, Action::SegmentAlloc | Action::SegmentMap));
        let rec_new = rec_segs
            .iter()
            .find(|r| matches!(r.action, Action::SegmentAlloc | Action::SegmentMap));
        let sim_released = history
            .iter()
            .filter(|h| matches!(h.action, Action::SegmentFree | Action::SegmentUnmap))
            .count();
        let rec_released = rec_segs
            .iter()
            .filter(|r| matches!(r.action, Action::SegmentFree | Action::SegmentUnmap))
            .count();
        let place = |addr: u64| -> String {
            match find_segment(&segments, addr) {
                Some(s) => format!(
                    "offset {} of the {}-byte {} segment at {:#x}",
                    addr - s.address,
                    s.total_size,
                    if s.is_expandable {
                        "expandable"
                    } else {
                        "ordinary"
                    },
                    self.translation.of(s.address).unwrap_or(s.address)
                ),
                None => format!("{addr:#x}"),
            }
        };
        let rec_place = |addr: u64| -> String {
            match self.recorded_ranges.containing(addr) {
                Some((start, end)) => format!(
                    "offset {} of the {}-byte recorded segment at {start:#x}",
                    addr - start,
                    end - start
                ),
                None => format!("{addr:#x}"),
            }
        };
        let Event::Alloc { size, stream, .. } = event else {
            return match event {
                Event::EmptyCache => format!(
                    "empty_cache (§5.3) released {sim_released} cached segments (or ranges) in the simulation, {rec_released} on the GPU: the cache held different whole free segments"
                ),
                _ => format!(
                    "the free released {sim_released} segments in the simulation and {rec_released} on the GPU"
                ),
            };
        };
        let rounded = crate::rounding::round_size(*size, self.replay.allocator().config());
        if history.iter().any(|h| h.action == Action::Oom) {
            return format!(
                "no cached block of stream {stream} holds {rounded} bytes (§3.1), no new segment fits the simulated device and releasing the cache did not help (§3 step 4): out of memory (capacity {})",
                self.report.capacity.source
            );
        }
        match (sim_new, rec_new, sim_alloc) {
            (None, Some(r), Some(a)) => format!(
                "best fit (§3.1): the smallest cached block of stream {stream} with at least {rounded} bytes was at {} in the simulation; PyTorch found none and allocated a new {}-byte segment at {:#x}",
                place(a.addr),
                r.size,
                r.addr
            ),
            (Some(h), None, Some(_)) => format!(
                "no cached block of stream {stream} with at least {rounded} bytes in the simulation (§3.1), so it allocated a new {}-byte segment (§1.4, §7.2 for expandable); PyTorch served it from its cache at {}",
                h.size,
                rec_place(recorded.addr)
            ),
            (Some(h), Some(r), _) if h.size != r.size => format!(
                "the new segment is {} bytes in the simulation and {} bytes on the GPU (§1.4 get_allocation_size, §7.2 page rounding for expandable segments)",
                h.size, r.size
            ),
            (_, _, Some(a)) if sim_released != rec_released => format!(
                "the simulation released {sim_released} segments before serving the request and PyTorch {rec_released} (§3 step 4: a cudaMalloc failing on the simulated device of capacity {} triggers the release)",
                self.report.capacity.source
            ) + &format!("; the block went to {}", place(a.addr)),
            (_, _, Some(a)) => format!(
                "best fit (§3.1) chose {} for {rounded} bytes on stream {stream}; PyTorch placed it at {}",
                place(a.addr),
                rec_place(recorded.addr)
            ),
            _ => "the simulated step recorded no allocation".to_owned(),
        }
    }

    fn finish(mut self) -> CheckReport {
        let alloc = self.replay.allocator();
        let stats = alloc.stats();
        self.report.final_reserved_simulated = stats.reserved_bytes.all.current as u64;
        self.report.final_allocated_simulated = stats.allocated_bytes.all.current as u64;
        let simulated = alloc.segments();
        let by_addr: BTreeMap<u64, &SegmentInfo> = simulated
            .iter()
            .map(|s| (self.translation.of(s.address).unwrap_or(s.address), s))
            .collect();
        self.report.final_segments_matched = self
            .snapshot
            .segments
            .iter()
            .filter(|s| s.device == self.import.device)
            .filter(|s| {
                by_addr.get(&s.address).is_some_and(|sim| {
                    sim.total_size == s.total_size
                        && sim.blocks.len() == s.blocks.len()
                        && sim.blocks.iter().zip(&s.blocks).all(|(a, b)| {
                            a.size == b.size
                                && match b.state {
                                    BlockState::ActiveAllocated => {
                                        a.state == crate::allocator::BlockState::ActiveAllocated
                                    }
                                    BlockState::ActivePendingFree => {
                                        a.state == crate::allocator::BlockState::ActivePendingFree
                                    }
                                    BlockState::Inactive => {
                                        a.state == crate::allocator::BlockState::Inactive
                                    }
                                }
                        })
                })
            })
            .count();
        self.report
    }
}

/// At most eight addresses in hex, for messages.
fn hex_list(addrs: &[u64]) -> String {
    let mut s: Vec<String> = addrs.iter().take(8).map(|a| format!("{a:#x}")).collect();
    if addrs.len() > 8 {
        s.push("...".to_owned());
    }
    s.join(", ")
}

/// The segment holding `addr`.
fn find_segment(segments: &[SegmentInfo], addr: u64) -> Option<&SegmentInfo> {
    let i = segments.partition_point(|s| s.address <= addr);
    let s = segments.get(i.checked_sub(1)?)?;
    (addr < s.address + s.total_size).then_some(s)
}

/// One row of the check table: recorded, simulated and matched counts, and the share matched.
fn matched_row(t: &mut String, name: &str, recorded: u64, simulated: u64, matched: u64) {
    let share = if recorded == 0 {
        "-".to_owned()
    } else {
        format!("{:.1}%", 100.0 * matched as f64 / recorded as f64)
    };
    let _ = writeln!(
        t,
        "  {:<22} {:>10} {:>10} {:>10} {:>8}",
        name, recorded, simulated, matched, share
    );
}
