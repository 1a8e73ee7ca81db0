//! PyTorch memory snapshots as vramsim traces: one trace per device, starting from the allocator state at
//! the moment recording began.
//!
//! ```no_run
//! use vramsim_sim::import::{import_device, ImportOptions};
//! use vramsim_traces::snapshot::load_snapshot_file;
//! let snapshot = load_snapshot_file("memory_snapshot.pickle.gz").unwrap();
//! let device = import_device(&snapshot, 0, &ImportOptions::from_snapshot(&snapshot)).unwrap();
//! vramsim_traces::write_trace("device0.jsonl", &device.trace).unwrap();
//! ```
//!
//! The importer lives beside the allocator because reconstructing an allocator's state takes the
//! allocator's rules: it sizes blocks with [`round_size`](crate::rounding::round_size), §3.2
//! [`should_split`](crate::allocator::caching::should_split) and the §3.1 oversize rule
//! ([`exceeds_non_split_rounding`](crate::allocator::caching::exceeds_non_split_rounding)), maps
//! expandable segments in [`page_size`](crate::allocator::caching::expandable::page_size) pages, and reads
//! the snapshot's settings into the [`AllocatorConfig`] the replay will use ([`config_from_settings`]).
//! Reading and writing the snapshot file itself is the trace crate's (`vramsim_traces::snapshot`).
//!
//! # What a snapshot says, and what the trace says
//!
//! A snapshot (§10 of `pytorch_allocator.md`) holds the allocator's final `segments` and, per device, a
//! ring buffer of the actions it recorded: `alloc`, `free_requested`, `free_completed`, `segment_alloc`,
//! `segment_free`, `segment_map`, `segment_unmap`, `oom`. A trace holds what the *program* asked for;
//! what the allocator decided (segments, releases) is left for the simulator to decide again. So:
//!
//! | recorded | trace |
//! | --- | --- |
//! | `alloc(addr, size, stream)` | `alloc` with `id` = the block address (an integer), `size` the requested bytes |
//! | `free_requested` followed at once by its `free_completed` | `free` |
//! | `free_requested` whose `free_completed` comes later | a deferred free: see below |
//! | `segment_alloc`, `segment_map` | nothing: the allocator decides |
//! | a run of `segment_free`/`segment_unmap` the allocator made | nothing (see *Releases*) |
//! | a run of `segment_free`/`segment_unmap` the program asked for | `empty_cache` |
//! | `oom(device_free, size)` | an `alloc` of `size` bytes (the rounded request: the unrounded one is not recorded) with the string id `"oom@ENTRY"` |
//! | `time_us` | nothing (see *Time*) |
//!
//! # The state recording began from
//!
//! The trace is a ring buffer: segments and blocks that existed when recording began appear only in the
//! final `segments`, or in the history only as a `segment_free` or a `free_requested` without their
//! allocation. The importer walks the history backwards from the final segments, undoing each action:
//! a `segment_alloc` means the segment did not exist before it, a `segment_free` that it did (as one free
//! block); `segment_map`/`segment_unmap` remove/add mapped ranges of expandable segments; an `alloc`
//! means the block was not allocated before it, a `free_requested`/`free_completed` that it was (or that
//! it was waiting for stream events). What is left at the first entry is the initial state, written as
//! `segment` ops at the head of the trace.
//!
//! In the caching allocator free neighbours always merge (§4.2), so a segment's layout is fully
//! determined by its live blocks: every gap between them is one free block. Each live block's address and
//! requested size are recorded; its *size* is known when the block is still live in the final
//! `segments`. A block that only appears in a `free` entry gets an inferred size, from the first rule
//! that applies:
//!
//! 1. *The history shows its end* (ordinary segments). An allocation takes the front of a free block
//!    (§3.4), and the room behind the block (up to the next live block or the segment's end) is one free
//!    block until something is allocated there; so the first `alloc` inside that room while the block is
//!    still live marks where the block ends.
//! 2. *Small pool and expandable segments:* any remainder of 512 bytes or more is split off (§3.2), so the
//!    size is exactly `round_size(requested)` (§1.2).
//! 3. *Large pool of an ordinary segment:* a remainder of at most 1 MiB is never split (§3.2) and no
//!    large-pool block is ever that small, so when at most 1 MiB lies between `round_size(requested)` and
//!    the next known boundary, it belongs to the block; with `max_split_size` set, an oversize block is
//!    never split, and a remainder below `max_non_split_rounding` is taken to belong to it too.
//!    Otherwise the size is `round_size(requested)`. This is the one guess: a block carved unsplit from a
//!    free block whose neighbour was freed before recording began could be up to 1 MiB larger, and
//!    nothing recorded says so (rule 1 catches it whenever the room behind the block is used before the
//!    block is freed).
//!
//! [`InitialState::inferred_block_sizes`] counts the blocks sized this way.
//!
//! A block waiting for stream events at the start (its `free_completed` comes without a
//! `free_requested`) is declared live and freed at once through a synthetic stream (below), so that it
//! stays pending until its recorded completion.
//!
//! # Deferred frees (`record_stream`)
//!
//! A `free_completed` that does not immediately follow its `free_requested` means the block was used on
//! another stream (`tensor.record_stream`): PyTorch held it back until CUDA events recorded on those
//! streams fired, and returned it to the cache at a later `malloc` (`process_events`, §4.3) or release
//! (§5.3). The snapshot does not say which stream used the block, so the importer gives each such block
//! a synthetic stream (ids counted down from 2^64−1, reused once free) and writes, at the free,
//! `record_stream(id, S)`, `compute(S, us)`, `free(id)`, and at the recorded completion `sync(S)`. The
//! `compute` durations are chosen so that the synthetic streams finish in the recorded order of
//! completions, each no earlier than its `sync`: the simulated event fires exactly at its `sync`, and the
//! next `malloc` caches the block, where PyTorch did.
//!
//! Three refinements. Completions right before a release the allocator made inside a `malloc` (or before
//! an `oom`) may be that release's `synchronize_and_free_events` (§5.3), which comes after the failed cache
//! search: they get no `sync`, and the replayed release completes them itself (equivalent when they were
//! in fact completed at the start of the `malloc`: the search failed with them cached, so it fails without
//! them). For the same reason a `free_requested` immediately followed by its `free_completed` and then by
//! such a release is written as a deferred free. And completions that no `malloc` or release follows can
//! only come from an `empty_cache` that found nothing to release: it is written as `empty_cache`.
//!
//! # Releases
//!
//! A run of `segment_free`/`segment_unmap` entries is either the program's `torch.cuda.empty_cache()` or
//! the allocator's own last resort inside a `malloc` that found no room (§3 step 4e: free every cached
//! segment, retry), which is followed by a `segment_alloc`/`segment_map` and the `alloc`, or by an `oom`.
//! The importer writes `empty_cache` for a run unless it is followed by an `oom`, or by a new segment
//! for a request that (1) none of the released segments could have served (had the cache been able to
//! serve it, the `malloc` would not have released anything) and (2) did not fit next to what was reserved
//! before the run under the highest reservation the history proves the device could hold (had it fitted,
//! the first `cudaMalloc` would have succeeded). With `garbage_collection_threshold` or `max_split_size`
//! set, a run followed by a new segment is taken as the allocator's (§5.4 garbage collection, §5.2
//! oversize release). [`Recorded::releases`] lists every run with the reason for its classification.
//!
//! # Device capacity
//!
//! A snapshot does not record the device's capacity. An `oom` entry implies it: its `device_free` plus
//! what was reserved at that moment is what the allocator could use ([`Capacity::Oom`]). Without an `oom`,
//! releases the allocator made bound it: more than the highest reservation recorded, less than what the
//! failing request would have needed ([`Capacity::Window`]). Otherwise only the highest reservation is a
//! bound ([`Capacity::AtLeast`]).
//!
//! # Time
//!
//! The allocator's decisions depend on the order of requests, not on their timing (only deferred frees do,
//! and they are written as explicit streams above), so the recorded `time_us` gaps are dropped; the
//! trace's `meta.time_span_us` keeps the recorded span.
//!
//! # Limits
//!
//! - A ring buffer that begins inside a `malloc` (its first entries are that `malloc`'s releases or
//!   completions) does not say what the cache held when the `malloc` searched it; the state reconstructed
//!   is the one after the entries the buffer kept.
//! - With expandable segments, a `malloc` whose first attempt failed, whose release unmapped nothing and
//!   whose retry mapped nothing leaves no trace of the release; the completions it made read as the
//!   `malloc`'s own (seen only with deferred frees under memory pressure; none of the shipped snapshots has
//!   deferred frees).
//! - With `garbage_collection_threshold` or `max_split_size` set, releases before the first `cudaMalloc`
//!   (§5.4, §5.2) are taken as the allocator's, and held-back completions may differ from PyTorch's.
//!
//! Importing never fails on a snapshot that contradicts itself (a free of a block never allocated, a
//! block outside every segment): the importer keeps a replayable trace and lists what it had to ignore in
//! [`Recorded::notes`].
//!
//! # Modules
//!
//! [`settings`] reads the snapshot's `allocator_settings`; `initial` undoes the history into the state
//! recording began from (the `segment` ops and the block sizes); `capacity` follows the reserved bytes
//! and says what they imply of the device; `releases` tells the program's `empty_cache` from the
//! allocator's own releases, with `expandable` replaying the recorded mappings for it; `streams` gives
//! deferred frees their synthetic streams; `emit` writes the trace's events and `meta`.

mod capacity;
mod emit;
mod expandable;
mod initial;
mod recorded;
mod releases;
pub mod settings;
mod streams;

use vramsim_traces::snapshot::{Action, Snapshot, TraceEntry};
use vramsim_traces::{Pool, Trace};

use crate::config::AllocatorConfig;
use crate::rounding::SMALL_BUFFER;

pub use recorded::{Capacity, InitialState, Recorded, RecordedOom, Release, ReleaseCause};
pub use settings::{config_from_settings, SnapshotSettings};
pub use streams::FIRST_SYNTHETIC_STREAM;

/// How to import.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImportOptions {
    /// The allocator settings the blocks were sized and released under (normally the snapshot's own).
    pub config: AllocatorConfig,
}

impl ImportOptions {
    /// The options that follow the snapshot's own `allocator_settings` ([`config_from_settings`]).
    pub fn from_snapshot(snapshot: &Snapshot) -> ImportOptions {
        ImportOptions {
            config: config_from_settings(snapshot.allocator_settings.as_ref()).config,
        }
    }
}

/// Why a device could not be imported.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The device index is not in the snapshot.
    #[error("{}", no_such_device(*.device, .present))]
    NoSuchDevice {
        /// The device asked for.
        device: u32,
        /// The devices the snapshot holds (a trace or a segment), ascending.
        present: Vec<u32>,
    },
}

fn no_such_device(device: u32, present: &[u32]) -> String {
    match present {
        [] => format!("the snapshot holds no device (no segments and no history), so there is no device {device}"),
        _ => format!(
            "the snapshot has no device {device}: it holds device{} {}",
            if present.len() == 1 { "" } else { "s" },
            present.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// One device of a snapshot as a trace, with what the snapshot itself says about it.
#[derive(Clone, Debug)]
pub struct DeviceImport {
    /// The device index.
    pub device: u32,
    /// The trace: `segment` ops for the initial state, then the recorded requests.
    pub trace: Trace,
    /// For each event of the trace, the index of the recorded entry it stands for (`None` for the events
    /// that set up the initial state).
    pub origins: Vec<Option<u32>>,
    /// Facts read from the snapshot alone (never from a simulation).
    pub recorded: Recorded,
}

/// Imports device `device` of `snapshot`.
pub fn import_device(
    snapshot: &Snapshot,
    device: u32,
    options: &ImportOptions,
) -> Result<DeviceImport, ImportError> {
    let present = snapshot.devices();
    if !present.contains(&device) {
        return Err(ImportError::NoSuchDevice { device, present });
    }
    let entries: &[TraceEntry] = snapshot
        .device_traces
        .get(device as usize)
        .map_or(&[], Vec::as_slice);
    let config = &options.config;
    let mut rec = Recorded {
        entries: entries.len(),
        ..Recorded::default()
    };
    count_actions(entries, &mut rec);
    if let (Some(first), Some(last)) = (
        entries.first().and_then(|e| e.time_us),
        entries.last().and_then(|e| e.time_us),
    ) {
        rec.time_span_us = Some(last - first);
    }

    let mut initial = initial::reconstruct(snapshot, device, entries, config, &mut rec);
    let reserved_before = capacity::reservations(entries, &mut rec);
    initial::set_reservation_bases(entries, &mut initial.events, config, rec.peak_reserved);
    releases::classify_releases(entries, &initial.events, &reserved_before, config, &mut rec);
    rec.capacity = capacity::capacity(&rec);

    let (events, origins) = emit::events(entries, initial, &mut rec);
    let meta = emit::meta_of(snapshot, device, &rec);
    Ok(DeviceImport {
        device,
        trace: Trace { meta, events },
        origins,
        recorded: rec,
    })
}

fn count_actions(entries: &[TraceEntry], rec: &mut Recorded) {
    for e in entries {
        match e.action {
            Action::Alloc => rec.allocs += 1,
            Action::FreeRequested => rec.frees += 1,
            Action::SegmentAlloc => rec.segment_allocs += 1,
            Action::SegmentFree => rec.segment_frees += 1,
            Action::SegmentMap => rec.segment_maps += 1,
            Action::SegmentUnmap => rec.segment_unmaps += 1,
            _ => {}
        }
    }
}

/// The pool of a segment seen only in a `segment_free`: small-pool segments are `kSmallBuffer` (§1.4
/// `get_allocation_size`), large-pool ones are bigger.
fn segment_pool(size: u64) -> Pool {
    if size <= SMALL_BUFFER {
        Pool::Small
    } else {
        Pool::Large
    }
}
