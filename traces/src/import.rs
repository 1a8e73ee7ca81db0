//! PyTorch memory snapshots as vramsim traces: one trace per device, starting from the allocator state at
//! the moment recording began.
//!
//! ```no_run
//! use vramsim_traces::import::{import_device, ImportOptions};
//! use vramsim_traces::snapshot::load_snapshot_file;
//! let snapshot = load_snapshot_file("memory_snapshot.pickle.gz").unwrap();
//! let device = import_device(&snapshot, 0, &ImportOptions::from_snapshot(&snapshot)).unwrap();
//! vramsim_traces::write_trace("device0.jsonl", &device.trace).unwrap();
//! ```
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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use crate::event::{AllocId, Category, Event, InitialBlock, InitialSegment, Pool, StreamId};
use crate::snapshot::{Action, AllocatorSettings, BlockState, Snapshot, TraceEntry};
use crate::trace::{Meta, Trace};

/// `kMinBlockSize` (§1.1).
const MIN_BLOCK_SIZE: u64 = 512;
/// `kSmallSize` (§1.1): the largest small-pool request, and the largest remainder a large block keeps.
const SMALL_SIZE: u64 = 1 << 20;
/// `kSmallBuffer` (§1.1): the size of a small-pool segment.
const SMALL_BUFFER: u64 = 2 << 20;
/// `kLargeBuffer` (§1.1): the default large segment size and non-split rounding tolerance.
const LARGE_BUFFER: u64 = 20 << 20;
/// The synthetic stream of the first deferred free; later ones count down.
pub const FIRST_SYNTHETIC_STREAM: StreamId = u64::MAX;
/// Microseconds between the completion times given to consecutive deferred frees.
const DEFERRED_STEP_US: u64 = 1_000_000;

/// The allocator rules the importer needs to infer the sizes of blocks it only sees freed and to tell
/// the program's releases from the allocator's: §1.2 `round_size`, §3.2 `should_split`, §3.1 oversize
/// rules, §5.4 garbage collection. (The importer needs this much of the allocator; everything else is the
/// simulator's.)
#[derive(Clone, Debug, PartialEq)]
pub struct SizeRules {
    /// `roundup_power2_divisions`: entry k for sizes in [2^(20+k), 2^(21+k)) (§12.4).
    pub roundup_power2_divisions: [u64; 16],
    /// `max_split_size` in bytes (`u64::MAX` when unset).
    pub max_split_size: u64,
    /// `max_non_split_rounding` in bytes (default 20 MiB).
    pub max_non_split_rounding_size: u64,
    /// `garbage_collection_threshold` (0 = off).
    pub garbage_collection_threshold: f64,
    /// `large_segment_size` in bytes (default 20 MiB): the page of large-pool expandable segments (§7.1).
    pub large_segment_size: u64,
}

impl Default for SizeRules {
    fn default() -> Self {
        SizeRules {
            roundup_power2_divisions: [0; 16],
            max_split_size: u64::MAX,
            max_non_split_rounding_size: LARGE_BUFFER,
            garbage_collection_threshold: 0.0,
            large_segment_size: LARGE_BUFFER,
        }
    }
}

impl SizeRules {
    /// The rules of a snapshot's `allocator_settings` fields (defaults where absent).
    pub fn from_settings(settings: Option<&AllocatorSettings>) -> SizeRules {
        let mut rules = SizeRules::default();
        let Some(s) = settings else { return rules };
        if let Some(m) = s.max_split_size {
            // −1 is SIZE_MAX cast to int64: unset.
            rules.max_split_size = if m < 0 { u64::MAX } else { m as u64 };
        }
        if let Some(t) = s.garbage_collection_threshold {
            rules.garbage_collection_threshold = t;
        }
        if let Some(divs) = &s.roundup_power2_divisions {
            for &(start_mib, d) in divs {
                // key = interval start in MiB: 1 → entry 0, 2 → 1, ..., 32768 → 15
                if start_mib.is_power_of_two() {
                    let k = (63 - start_mib.leading_zeros()) as usize;
                    if k < 16 {
                        rules.roundup_power2_divisions[k] = d;
                    }
                }
            }
        }
        rules
    }

    /// §1.2 `round_size`: the block size a request of `size` bytes occupies.
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK_SIZE {
            return MIN_BLOCK_SIZE;
        }
        let log2 = 63 - size.leading_zeros() as i64;
        let divisions = self.roundup_power2_divisions[(log2 - 20).clamp(0, 15) as usize];
        if divisions > 1 && size > MIN_BLOCK_SIZE.saturating_mul(divisions) {
            // roundup_power2_next_division
            if size.is_power_of_two() {
                return size;
            }
            let floor = 1u64 << (63 - size.leading_zeros());
            let step = floor >> (63 - divisions.leading_zeros());
            if step == 0 {
                return floor * 2;
            }
            let down = size - size % step;
            if down == size {
                size
            } else {
                down + step
            }
        } else {
            size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
        }
    }

    /// §1.3: the pool of a rounded size.
    pub fn pool_of(rounded: u64) -> Pool {
        if rounded <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        }
    }
}

/// How to import.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImportOptions {
    /// The allocator rules (normally the snapshot's own settings).
    pub rules: SizeRules,
}

impl ImportOptions {
    /// The options that follow the snapshot's own `allocator_settings`.
    pub fn from_snapshot(snapshot: &Snapshot) -> ImportOptions {
        ImportOptions {
            rules: SizeRules::from_settings(snapshot.allocator_settings.as_ref()),
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

/// Whether the file at `path` holds a pickle (a snapshot) rather than a vramsim trace: its first byte,
/// after gunzipping if it starts with the gzip magic, is the pickle `PROTO` opcode `0x80` (every pickle of
/// protocol 2 or later, which is what `_dump_snapshot()` writes), where a trace starts with `{`. Reads at
/// most a few bytes.
pub fn is_snapshot_file(path: impl AsRef<std::path::Path>) -> std::io::Result<bool> {
    use std::io::Read;
    let path = path.as_ref();
    let mut head = Vec::with_capacity(2);
    std::fs::File::open(path)?.take(2).read_to_end(&mut head)?;
    if head == [0x1f, 0x8b] {
        let mut first = Vec::with_capacity(1);
        let gz = flate2::read::MultiGzDecoder::new(std::fs::File::open(path)?);
        // a corrupt gzip stream is for the reader that follows to report
        let _ = gz.take(1).read_to_end(&mut first);
        return Ok(first == [0x80]);
    }
    Ok(head.first() == Some(&0x80))
}

/// The devices a snapshot holds: every index with a trace list (even empty, as PyTorch writes one per
/// device) or a segment, ascending.
pub fn devices(snapshot: &Snapshot) -> Vec<u32> {
    let mut devices: Vec<u32> = (0..snapshot.device_traces.len() as u32).collect();
    devices.extend(snapshot.segments.iter().map(|s| s.device));
    devices.sort_unstable();
    devices.dedup();
    devices
}

/// The devices with something to replay: a non-empty history or at least one segment, ascending.
pub fn devices_with_data(snapshot: &Snapshot) -> Vec<u32> {
    devices(snapshot)
        .into_iter()
        .filter(|&d| {
            snapshot
                .device_traces
                .get(d as usize)
                .is_some_and(|t| !t.is_empty())
                || snapshot.segments.iter().any(|s| s.device == d)
        })
        .collect()
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

/// What the snapshot records about one device, and what the importer inferred from it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Recorded {
    /// Entries in the device's history (0: a state-only snapshot).
    pub entries: usize,
    /// `alloc` entries.
    pub allocs: u64,
    /// `free_requested` entries.
    pub frees: u64,
    /// `segment_alloc` entries.
    pub segment_allocs: u64,
    /// `segment_free` entries.
    pub segment_frees: u64,
    /// `segment_map` entries.
    pub segment_maps: u64,
    /// `segment_unmap` entries.
    pub segment_unmaps: u64,
    /// The recorded out-of-memory errors.
    pub ooms: Vec<RecordedOom>,
    /// Σ `total_size` of the device's final segments.
    pub final_reserved: u64,
    /// Σ `allocated_size` of the device's final segments.
    pub final_allocated: u64,
    /// The device's final segments.
    pub final_segments: usize,
    /// The reconstructed state at the first entry.
    pub initial: InitialState,
    /// The highest reserved bytes over the history (initial state included).
    pub peak_reserved: u64,
    /// Every run of `segment_free`/`segment_unmap` entries, classified.
    pub releases: Vec<Release>,
    /// What the history says of the device's capacity.
    pub capacity: Capacity,
    /// Frees deferred by stream events (`free_completed` not right after its `free_requested`).
    pub deferred_frees: u64,
    /// Recorded span from the first to the last entry, in microseconds (when `time_us` is recorded).
    pub time_span_us: Option<i64>,
    /// Contradictions in the snapshot the importer had to step around.
    pub notes: Vec<String>,
}

/// The reconstructed allocator state when recording began.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InitialState {
    /// Segments (ordinary segments, plus one per contiguous mapped range of expandable ones).
    pub segments: usize,
    /// Σ segment sizes.
    pub reserved: u64,
    /// Live blocks (allocated, or waiting for stream events).
    pub live_blocks: usize,
    /// Σ sizes of the allocated blocks.
    pub allocated: u64,
    /// Live blocks whose size was inferred (they appear only in a free entry).
    pub inferred_block_sizes: usize,
    /// Blocks waiting for stream events at the start.
    pub pending_frees: usize,
}

/// A recorded `oom` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedOom {
    /// Index of the entry in the device's history.
    pub entry: usize,
    /// The rounded request (`size` of the entry).
    pub size: u64,
    /// `device_free`: the device's free bytes at the failure.
    pub device_free: u64,
    /// Reserved bytes at the failure, from the reconstructed state and the recorded segment entries.
    pub reserved: u64,
    /// The stream of the request.
    pub stream: StreamId,
}

/// A run of consecutive `segment_free`/`segment_unmap` entries (or, for an `empty_cache` that released
/// nothing, the deferred completions it made; then `bytes` is 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    /// Index of the first entry of the run.
    pub entry: usize,
    /// Number of entries.
    pub len: usize,
    /// Bytes released.
    pub bytes: u64,
    /// Reserved bytes before the run.
    pub reserved_before: u64,
    /// The bytes of the new segment (or mapped pages) that follow the run, if any.
    pub followed_by_segment: Option<u64>,
    /// Who released.
    pub cause: ReleaseCause,
    /// Why the importer thinks so.
    pub reason: String,
}

/// Who released the segments of a [`Release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseCause {
    /// The program: `torch.cuda.empty_cache()` (written to the trace as `empty_cache`).
    EmptyCache,
    /// The allocator, inside a `malloc` (§3 step 4: release and retry, or GC/oversize release).
    Allocator,
}

/// What the history implies about the device's capacity (bytes the allocator could hold: total memory
/// minus the CUDA context and other processes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// An `oom` entry: `device_free + reserved` at the failure.
    Oom {
        /// The usable bytes implied.
        usable: u64,
        /// The entry.
        entry: usize,
        /// Its `device_free`.
        device_free: u64,
        /// Reserved bytes then.
        reserved: u64,
    },
    /// Releases the allocator made: at least the highest reservation, less than `below`.
    Window {
        /// The highest reservation recorded.
        at_least: u64,
        /// What the first release's request would have needed (reserved before + new segment).
        below: u64,
        /// The release that set `below`.
        entry: usize,
    },
    /// Only the highest reservation recorded.
    AtLeast {
        /// The highest reservation recorded.
        bytes: u64,
    },
}

impl Default for Capacity {
    fn default() -> Self {
        Capacity::AtLeast { bytes: 0 }
    }
}

impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Capacity::Oom {
                usable,
                entry,
                device_free,
                reserved,
            } => write!(
                f,
                "{usable} bytes usable, implied by the oom at entry {entry} (device_free {device_free} + reserved {reserved})"
            ),
            Capacity::Window {
                at_least,
                below,
                entry,
            } => write!(
                f,
                "between {at_least} bytes (the highest reservation) and {below} bytes (what the release at entry {entry} made room for)"
            ),
            Capacity::AtLeast { bytes } => {
                write!(f, "at least {bytes} bytes (the highest reservation)")
            }
        }
    }
}

/// A live block while walking the history.
#[derive(Clone, Copy, Debug)]
struct LiveBlock {
    /// Known size (from the final segments), or `None` when it must be inferred.
    size: Option<u64>,
    requested: u64,
    /// Waiting for stream events.
    pending: bool,
}

/// A segment of the reconstructed state with its live blocks, each with the room up to the next one:
/// (segment address, segment, [(block address, block, room)]).
type InitialLayout = (u64, SegmentInfo, Vec<(u64, LiveBlock, u64)>);

/// A segment of the reconstructed state.
#[derive(Clone, Copy, Debug)]
struct SegmentInfo {
    size: u64,
    stream: StreamId,
    pool: Pool,
    expandable: bool,
}

/// Imports device `device` of `snapshot`.
pub fn import_device(
    snapshot: &Snapshot,
    device: u32,
    options: &ImportOptions,
) -> Result<DeviceImport, ImportError> {
    let present = devices(snapshot);
    if !present.contains(&device) {
        return Err(ImportError::NoSuchDevice { device, present });
    }
    let empty = Vec::new();
    let entries = snapshot
        .device_traces
        .get(device as usize)
        .unwrap_or(&empty);
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

    // ---- the final state
    let final_segments: Vec<&crate::snapshot::Segment> = snapshot
        .segments
        .iter()
        .filter(|s| s.device == device)
        .collect();
    rec.final_segments = final_segments.len();
    rec.final_reserved = final_segments.iter().map(|s| s.total_size).sum();
    rec.final_allocated = final_segments.iter().map(|s| s.allocated_size).sum();
    let mut segments: BTreeMap<u64, SegmentInfo> = BTreeMap::new();
    let mut live: HashMap<u64, LiveBlock> = HashMap::new();
    for s in &final_segments {
        let pool = match s.segment_type {
            crate::snapshot::SegmentType::Small => Pool::Small,
            crate::snapshot::SegmentType::Large => Pool::Large,
        };
        insert_range(
            &mut segments,
            s.address,
            SegmentInfo {
                size: s.total_size,
                stream: s.stream,
                pool,
                expandable: s.is_expandable,
            },
        );
        for b in &s.blocks {
            if b.state.is_active() {
                live.insert(
                    b.address,
                    LiveBlock {
                        size: Some(b.size),
                        requested: b.requested_size,
                        pending: b.state == BlockState::ActivePendingFree,
                    },
                );
            }
        }
    }

    // ---- undo the history, newest first
    // the pool of every block address recorded (for mapped ranges seen only unmapped)
    let mut alloc_pools: Vec<(u64, Pool)> = if rec.segment_unmaps > 0 {
        entries
            .iter()
            .filter(|e| {
                matches!(
                    e.action,
                    Action::Alloc | Action::FreeRequested | Action::FreeCompleted
                )
            })
            .map(|e| (e.addr, SizeRules::pool_of(options.rules.round_size(e.size))))
            .collect()
    } else {
        Vec::new()
    };
    alloc_pools.sort_unstable_by_key(|&(a, _)| a);
    for (i, e) in entries.iter().enumerate().rev() {
        match e.action {
            Action::Alloc => {
                if live.remove(&e.addr).is_none() {
                    rec.notes.push(format!(
                        "entry {i}: alloc of {:#x}, which is neither live at the end nor freed later",
                        e.addr
                    ));
                }
            }
            Action::FreeRequested => match live.get_mut(&e.addr) {
                Some(b) if b.pending => b.pending = false,
                Some(_) => rec.notes.push(format!(
                    "entry {i}: free_requested of {:#x}, which is freed again later without an alloc",
                    e.addr
                )),
                None => {
                    live.insert(
                        e.addr,
                        LiveBlock {
                            size: None,
                            requested: e.size,
                            pending: false,
                        },
                    );
                }
            },
            Action::FreeCompleted => match live.entry(e.addr) {
                std::collections::hash_map::Entry::Occupied(_) => rec.notes.push(format!(
                    "entry {i}: free_completed of {:#x}, which is live later without an alloc",
                    e.addr
                )),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(LiveBlock {
                        size: None,
                        requested: e.size,
                        pending: true,
                    });
                }
            },
            Action::SegmentAlloc => {
                if segments.remove(&e.addr).is_none() {
                    rec.notes.push(format!(
                        "entry {i}: segment_alloc of {:#x}, which does not exist later",
                        e.addr
                    ));
                }
            }
            Action::SegmentFree => {
                insert_range(
                    &mut segments,
                    e.addr,
                    SegmentInfo {
                        size: e.size,
                        stream: e.stream,
                        // §1.4: small-pool segments are kSmallBuffer; large ones are bigger
                        pool: if e.size <= SMALL_BUFFER {
                            Pool::Small
                        } else {
                            Pool::Large
                        },
                        expandable: false,
                    },
                );
            }
            Action::SegmentMap => {
                if !remove_mapped(&mut segments, e.addr, e.size) {
                    rec.notes.push(format!(
                        "entry {i}: segment_map of {:#x} ({} bytes), which is not mapped later",
                        e.addr, e.size
                    ));
                }
            }
            Action::SegmentUnmap => {
                // a range off the large page grid is a small-pool range (§7.1 page sizes)
                let pool = if !e.size.is_multiple_of(options.rules.large_segment_size) {
                    Some(Pool::Small)
                } else {
                    known_pool(&final_segments, &alloc_pools, e.addr, e.size, e.stream)
                };
                add_mapped(&mut segments, e.addr, e.size, e.stream, pool)
            }
            Action::Oom | Action::Snapshot | Action::Other(_) => {}
        }
    }

    // ---- the initial segments and their blocks: each live block with the room up to the next one
    let mut blocks_by_addr: Vec<(u64, LiveBlock)> = live.into_iter().collect();
    blocks_by_addr.sort_unstable_by_key(|&(a, _)| a);
    let mut layout: Vec<InitialLayout> = Vec::new();
    let mut next_block = 0;
    for (&addr, seg) in &segments {
        let end = addr + seg.size;
        // blocks before this segment lie outside every segment
        while next_block < blocks_by_addr.len() && blocks_by_addr[next_block].0 < addr {
            rec.notes.push(format!(
                "block {:#x} live at the start lies in no segment: left out",
                blocks_by_addr[next_block].0
            ));
            next_block += 1;
        }
        let first = next_block;
        while next_block < blocks_by_addr.len() && blocks_by_addr[next_block].0 < end {
            next_block += 1;
        }
        let inside = &blocks_by_addr[first..next_block];
        let blocks = inside
            .iter()
            .enumerate()
            .map(|(k, &(baddr, b))| {
                let boundary = inside.get(k + 1).map_or(end, |&(next, _)| next);
                (baddr, b, boundary - baddr)
            })
            .collect();
        layout.push((addr, *seg, blocks));
    }
    // where the history shows the blocks of unknown size end
    // (ordinary segments only: unmapping splits an expandable segment's free blocks at page
    // boundaries without an allocation, and there rule 2 is exact anyway)
    let unknown: BTreeMap<u64, u64> = layout
        .iter()
        .filter(|(_, seg, _)| !seg.expandable)
        .flat_map(|(_, _, blocks)| blocks.iter())
        .filter(|(_, b, _)| b.size.is_none())
        .map(|&(addr, _, room)| (addr, addr + room))
        .collect();
    let observed = observed_ends(entries, &unknown);

    let mut initial_events = Vec::new();
    let mut pending_at_start = Vec::new();
    let mut live_ids: HashSet<u64> = HashSet::new();
    for (addr, seg, inside) in &layout {
        let (addr, seg) = (*addr, *seg);
        let mut blocks = Vec::with_capacity(inside.len());
        for &(baddr, b, room) in inside {
            let size = match b.size {
                Some(size) if size <= room => size,
                Some(size) => {
                    rec.notes.push(format!(
                        "block {baddr:#x} of {size} bytes overlaps what follows it: cut to {room} bytes"
                    ));
                    room
                }
                None => {
                    rec.initial.inferred_block_sizes += 1;
                    let rounded = options.rules.round_size(b.requested);
                    match observed.get(&baddr) {
                        Some(&end) if end - baddr >= rounded => end - baddr,
                        _ => infer_size(
                            &options.rules,
                            &seg,
                            b.requested,
                            room,
                            baddr,
                            &mut rec.notes,
                        ),
                    }
                }
            };
            if b.pending {
                pending_at_start.push(baddr);
            }
            live_ids.insert(baddr);
            rec.initial.live_blocks += 1;
            if !b.pending {
                rec.initial.allocated += size;
            }
            blocks.push(InitialBlock {
                id: AllocId::Int(baddr),
                offset: baddr - addr,
                size,
                requested: b.requested.min(size),
                category: Category::Other,
                tag: None,
            });
        }
        rec.initial.segments += 1;
        rec.initial.reserved += seg.size;
        initial_events.push(Event::Segment(Box::new(InitialSegment {
            addr,
            size: seg.size,
            stream: seg.stream,
            pool: seg.pool,
            expandable: seg.expandable,
            base: None,
            blocks,
        })));
    }
    for &(baddr, _) in &blocks_by_addr[next_block..] {
        rec.notes.push(format!(
            "block {baddr:#x} live at the start lies in no segment: left out"
        ));
    }
    rec.initial.pending_frees = pending_at_start.len();

    // ---- reserved bytes over the history, and the releases
    let mut reserved = rec.initial.reserved;
    rec.peak_reserved = reserved;
    let mut reserved_before = Vec::with_capacity(entries.len());
    for e in entries {
        reserved_before.push(reserved);
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                reserved = reserved.saturating_add(e.size);
                rec.peak_reserved = rec.peak_reserved.max(reserved);
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                reserved = reserved.saturating_sub(e.size)
            }
            _ => {}
        }
    }
    for (i, e) in entries.iter().enumerate() {
        if e.action == Action::Oom {
            rec.ooms.push(RecordedOom {
                entry: i,
                size: e.size,
                device_free: e.addr,
                reserved: reserved_before[i],
                stream: e.stream,
            });
        }
    }
    set_reservation_bases(
        entries,
        &mut initial_events,
        &options.rules,
        rec.peak_reserved,
    );
    classify_releases(
        entries,
        &initial_events,
        &reserved_before,
        &options.rules,
        &mut rec,
    );
    rec.capacity = capacity(&rec);

    // ---- the events
    let mut events = initial_events;
    let mut origins = vec![None; events.len()];
    let deferred = deferred_completions(entries);
    rec.deferred_frees = deferred.iter().filter(|d| d.is_some()).count() as u64;
    let mut streams = SyntheticStreams::default();
    let release_at: HashMap<usize, &Release> = rec.releases.iter().map(|r| (r.entry, r)).collect();
    // runs of deferred completions that are an empty_cache releasing nothing: entry → last entry
    let silent: HashMap<usize, usize> = rec
        .releases
        .iter()
        .filter(|r| r.bytes == 0 && entries[r.entry].action == Action::FreeCompleted)
        .flat_map(|r| (r.entry..r.entry + r.len).map(move |j| (j, r.entry + r.len - 1)))
        .collect();
    // blocks waiting at the start: freed now, through their synthetic streams (those the buffer starts
    // by completing, unless a release follows, as if their free had been immediate)
    let leading = leading_completions(entries);
    for &baddr in &pending_at_start {
        let completion = entries
            .iter()
            .position(|e| e.action == Action::FreeCompleted && e.addr == baddr);
        let id = AllocId::Int(baddr);
        if completion.is_some_and(|c| c < leading && !completes_in_release(entries, c, &release_at))
        {
            events.push(Event::Free { id });
            origins.push(None);
            live_ids.remove(&baddr);
            continue;
        }
        let s = streams.defer(baddr, completion);
        events.push(Event::RecordStream {
            id: id.clone(),
            stream: s,
        });
        events.push(Event::Compute {
            stream: s,
            us: streams.duration_us(s),
        });
        events.push(Event::Free { id });
        origins.extend([None, None, None]);
        live_ids.remove(&baddr);
    }
    let mut i = 0;
    while i < entries.len() {
        let e = &entries[i];
        let origin = Some(i as u32);
        match e.action {
            Action::Alloc => {
                if !live_ids.insert(e.addr) {
                    rec.notes.push(format!(
                        "entry {i}: alloc of {:#x}, which is already live: its free was not recorded, freed here",
                        e.addr
                    ));
                    events.push(Event::Free {
                        id: AllocId::Int(e.addr),
                    });
                    origins.push(origin);
                }
                events.push(Event::Alloc {
                    id: AllocId::Int(e.addr),
                    size: e.size,
                    stream: e.stream,
                    category: Category::Other,
                    tag: None,
                });
                origins.push(origin);
            }
            Action::FreeRequested => {
                if !live_ids.remove(&e.addr) {
                    rec.notes.push(format!(
                        "entry {i}: free_requested of {:#x}, which is not live: left out",
                        e.addr
                    ));
                } else if let Some(completion) = deferred[i].or_else(|| {
                    // Completed at once, but right before the allocator's own release or an oom: the
                    // block may have waited for stream events that only that release's
                    // synchronize_and_free_events completed (§5.3). Replaying it as waiting is
                    // equivalent when it did not wait (the failed search failed with it cached too).
                    let next = entries.get(i + 1)?;
                    (next.action == Action::FreeCompleted
                        && next.addr == e.addr
                        && completes_in_release(entries, i + 1, &release_at))
                    .then_some(i + 1)
                }) {
                    let id = AllocId::Int(e.addr);
                    let s = streams.defer(e.addr, (completion != usize::MAX).then_some(completion));
                    events.push(Event::RecordStream {
                        id: id.clone(),
                        stream: s,
                    });
                    events.push(Event::Compute {
                        stream: s,
                        us: streams.duration_us(s),
                    });
                    events.push(Event::Free { id });
                    origins.extend([origin, origin, origin]);
                } else {
                    events.push(Event::Free {
                        id: AllocId::Int(e.addr),
                    });
                    origins.push(origin);
                    let completed_next = entries
                        .get(i + 1)
                        .is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr);
                    if completed_next {
                        i += 1; // its free_completed
                    }
                }
            }
            Action::FreeCompleted if silent.contains_key(&i) => {
                streams.complete(e.addr);
                if silent[&i] == i {
                    streams.release_all();
                    events.push(Event::EmptyCache);
                    origins.push(origin);
                }
            }
            Action::FreeCompleted => {
                if let Some(s) = streams.complete(e.addr) {
                    // Completions right before the allocator's own release (or an oom) may be that
                    // release's synchronize_and_free_events (§5.3), which runs after the cache search:
                    // the replayed release completes them itself.
                    if !completes_in_release(entries, i, &release_at) {
                        events.push(Event::Sync { stream: Some(s) });
                        origins.push(origin);
                    }
                }
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                if let Some(run) = release_at.get(&i) {
                    // the allocator's own releases wait for every deferred free (§5.3)
                    streams.release_all();
                    let last = run.entry + run.len - 1;
                    if run.cause == ReleaseCause::EmptyCache {
                        events.push(Event::EmptyCache);
                        origins.push(Some(last as u32));
                    }
                    i = last;
                }
            }
            Action::Oom => {
                streams.release_all();
                events.push(Event::Alloc {
                    id: AllocId::Str(format!("oom@{i}").into()),
                    size: e.size,
                    stream: e.stream,
                    category: Category::Other,
                    tag: None,
                });
                origins.push(origin);
            }
            Action::SegmentAlloc | Action::SegmentMap | Action::Snapshot | Action::Other(_) => {}
        }
        i += 1;
    }

    let meta = meta_of(snapshot, device, &rec);
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

/// The size of a block seen only freed: §1.2 rounding, extended to the next boundary where §3.2 would
/// not have split the remainder off.
fn infer_size(
    rules: &SizeRules,
    seg: &SegmentInfo,
    requested: u64,
    room: u64,
    addr: u64,
    notes: &mut Vec<String>,
) -> u64 {
    let rounded = rules.round_size(requested);
    if rounded > room {
        notes.push(format!(
            "block {addr:#x} requested {requested} bytes (rounded {rounded}) but only {room} bytes lie before the next block: sized {room}"
        ));
        return room;
    }
    let remainder = room - rounded;
    if seg.pool == Pool::Small || seg.expandable {
        // §3.2: small pool / expandable segments split off any remainder of 512 bytes or more
        return rounded;
    }
    let oversize = rounded >= rules.max_split_size;
    // §3.2: a large block splits only if the request is below max_split_size and more than 1 MiB
    // remains; no large-pool block is 1 MiB or smaller, so such a remainder is part of this block.
    if remainder <= SMALL_SIZE || (oversize && remainder < rules.max_non_split_rounding_size) {
        room
    } else {
        rounded
    }
}

/// For blocks live at the start whose size is unknown (`unknown`: address → the end of the room up to the
/// next live block or the segment's end), the end the history shows: the address of the first `alloc`
/// inside the room while the block is still live. An allocation takes the front of a free block (§3.4),
/// and until then the room behind the block was one free block (free neighbours merge, §4.2, and no
/// other block lived there), so that address is where the block ends.
fn observed_ends(entries: &[TraceEntry], unknown: &BTreeMap<u64, u64>) -> HashMap<u64, u64> {
    let mut observed = HashMap::new();
    if unknown.is_empty() {
        return observed;
    }
    // a block's free merges it with the room behind it: later allocations say nothing of its end
    let mut freed: HashSet<u64> = HashSet::new();
    for e in entries {
        match e.action {
            Action::Alloc => {
                if let Some((&block, &limit)) = unknown.range(..e.addr).next_back() {
                    if e.addr < limit && !freed.contains(&block) {
                        observed.entry(block).or_insert(e.addr);
                    }
                }
            }
            Action::FreeCompleted if unknown.contains_key(&e.addr) => {
                freed.insert(e.addr);
            }
            _ => {}
        }
    }
    observed
}

/// Inserts a segment, merging an expandable range with adjacent mapped ranges of the same stream and
/// pool (a snapshot reports one segment per contiguous mapped range).
fn insert_range(segments: &mut BTreeMap<u64, SegmentInfo>, addr: u64, info: SegmentInfo) {
    if !info.expandable {
        segments.insert(addr, info);
        return;
    }
    let (mut start, mut size) = (addr, info.size);
    if let Some((&prev, p)) = segments.range(..addr).next_back() {
        if p.expandable && p.stream == info.stream && p.pool == info.pool && prev + p.size == addr {
            start = prev;
            size += p.size;
        }
    }
    let end = addr + info.size;
    if let Some(n) = segments.get(&end).copied() {
        if n.expandable && n.stream == info.stream && n.pool == info.pool {
            segments.remove(&end);
            size += n.size;
        }
    }
    segments.insert(start, SegmentInfo { size, ..info });
}

/// Undoes a `segment_map`: removes `[addr, addr + size)` from the mapped range holding it.
fn remove_mapped(segments: &mut BTreeMap<u64, SegmentInfo>, addr: u64, size: u64) -> bool {
    let Some((&start, &info)) = segments.range(..=addr).next_back() else {
        return false;
    };
    let end = addr.saturating_add(size);
    if !info.expandable || start + info.size < end {
        return false;
    }
    segments.remove(&start);
    if addr > start {
        segments.insert(
            start,
            SegmentInfo {
                size: addr - start,
                ..info
            },
        );
    }
    if start + info.size > end {
        segments.insert(
            end,
            SegmentInfo {
                size: start + info.size - end,
                ..info
            },
        );
    }
    true
}

/// The pool of an expandable range seen only in a `segment_unmap`, where something recorded says: a final
/// segment of the stream overlapping it, or a block recorded inside it.
fn known_pool(
    final_segments: &[&crate::snapshot::Segment],
    alloc_pools: &[(u64, Pool)],
    addr: u64,
    size: u64,
    stream: StreamId,
) -> Option<Pool> {
    let end = addr.saturating_add(size);
    let from_final = final_segments.iter().find(|s| {
        s.is_expandable && s.stream == stream && s.address < end && addr < s.address + s.total_size
    });
    if let Some(s) = from_final {
        return Some(match s.segment_type {
            crate::snapshot::SegmentType::Small => Pool::Small,
            crate::snapshot::SegmentType::Large => Pool::Large,
        });
    }
    let first = alloc_pools.partition_point(|&(a, _)| a < addr);
    alloc_pools
        .get(first)
        .filter(|&&(a, _)| a < end)
        .map(|&(_, pool)| pool)
}

/// Undoes a `segment_unmap`: adds `[addr, addr + size)` as a mapped range. Its pool is `known` when
/// something recorded says it, else that of the nearest mapped range of the stream (the same
/// reservation, most likely), else the one its size suggests (20 MiB pages are large-pool pages).
fn add_mapped(
    segments: &mut BTreeMap<u64, SegmentInfo>,
    addr: u64,
    size: u64,
    stream: StreamId,
    known: Option<Pool>,
) {
    let neighbour = known.or_else(|| {
        segments
            .range(..addr)
            .rev()
            .chain(segments.range(addr..))
            .find(|(_, s)| s.expandable && s.stream == stream)
            .map(|(_, s)| s.pool)
    });
    let pool = neighbour.unwrap_or(if size.is_multiple_of(LARGE_BUFFER) {
        Pool::Large
    } else {
        Pool::Small
    });
    insert_range(
        segments,
        addr,
        SegmentInfo {
            size,
            stream,
            pool,
            expandable: true,
        },
    );
}

/// Whether the `free_completed` at `i` belongs to a run of completions followed by a release the
/// allocator made inside a `malloc`, or by an `oom`.
fn completes_in_release(
    entries: &[TraceEntry],
    i: usize,
    releases: &HashMap<usize, &Release>,
) -> bool {
    let mut j = i;
    while j < entries.len() && entries[j].action == Action::FreeCompleted {
        j += 1;
    }
    match entries.get(j).map(|e| &e.action) {
        Some(Action::Oom) => true,
        Some(Action::SegmentFree | Action::SegmentUnmap) => releases
            .get(&j)
            .is_some_and(|r| r.cause == ReleaseCause::Allocator),
        _ => false,
    }
}

/// For each `free_requested` entry whose `free_completed` does not follow at once, the index of that
/// `free_completed` (`Some(usize::MAX)` if it never comes); `None` elsewhere.
fn deferred_completions(entries: &[TraceEntry]) -> Vec<Option<usize>> {
    let mut out = vec![None; entries.len()];
    let mut waiting: HashMap<u64, usize> = HashMap::new();
    for (i, e) in entries.iter().enumerate() {
        match e.action {
            Action::FreeRequested => {
                let next = entries.get(i + 1);
                if !next.is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr) {
                    waiting.insert(e.addr, i);
                    out[i] = Some(usize::MAX);
                }
            }
            Action::FreeCompleted => {
                if let Some(free) = waiting.remove(&e.addr) {
                    out[free] = Some(i);
                }
            }
            _ => {}
        }
    }
    out
}

/// The synthetic streams of deferred frees and the host clock the replay will have (in µs), so that
/// each stream's work ends at its block's recorded completion.
#[derive(Default)]
struct SyntheticStreams {
    /// Streams free for reuse.
    free: Vec<StreamId>,
    /// Streams handed out so far.
    made: u64,
    /// Block address → (stream, completion time).
    pending: HashMap<u64, (StreamId, u64)>,
    /// Stream → its completion time (for `duration_us`).
    ends: HashMap<StreamId, u64>,
    /// The replay's host clock, as far as these events move it.
    host_us: u64,
}

impl SyntheticStreams {
    /// A stream for the deferred free of `addr`, completing at the recorded entry `completion` (never,
    /// for `None`).
    fn defer(&mut self, addr: u64, completion: Option<usize>) -> StreamId {
        let s = self.free.pop().unwrap_or_else(|| {
            self.made += 1;
            FIRST_SYNTHETIC_STREAM - (self.made - 1)
        });
        // Completion times increase with the entry index of the recorded completion, so the streams
        // finish in the recorded order; a free that never completes finishes after all of them.
        let end = match completion {
            Some(c) => (c as u64 + 1).saturating_mul(DEFERRED_STEP_US),
            None => u64::MAX / 4_000,
        };
        self.pending.insert(addr, (s, end));
        self.ends.insert(s, end);
        s
    }

    /// The `compute` duration that makes stream `s` finish at its completion time.
    fn duration_us(&self, s: StreamId) -> f64 {
        self.ends[&s].saturating_sub(self.host_us) as f64
    }

    /// The recorded completion of `addr`: the stream to `sync` (if the free was deferred).
    fn complete(&mut self, addr: u64) -> Option<StreamId> {
        let (s, end) = self.pending.remove(&addr)?;
        self.host_us = self.host_us.max(end);
        self.ends.remove(&s);
        self.free.push(s);
        Some(s)
    }

    /// A release waits for every pending event: the host moves past every completion time.
    fn release_all(&mut self) {
        if let Some(&end) = self.ends.values().max() {
            self.host_us = self.host_us.max(end);
        }
    }
}

fn classify_releases(
    entries: &[TraceEntry],
    initial: &[Event],
    reserved_before: &[u64],
    rules: &SizeRules,
    rec: &mut Recorded,
) {
    let is_release =
        |e: &TraceEntry| matches!(e.action, Action::SegmentFree | Action::SegmentUnmap);
    let mut layout = ExpandableLayout::new(entries, initial, rules);
    // Completions just before a release may be that release's own synchronize_and_free_events (§5.3),
    // after the cache search: a run is judged with them still waiting.
    let mut held: Vec<usize> = Vec::new();
    let leading = leading_completions(entries);
    let mut i = 0;
    while i < entries.len() {
        if !is_release(&entries[i]) {
            if i >= leading
                && is_deferred_completion(entries, i)
                && ends_silent_empty_cache(entries, i)
            {
                // deferred frees returned to the cache outside any malloc: only empty_cache does that
                let mut start = i;
                while start > 0 && is_deferred_completion(entries, start - 1) {
                    start -= 1;
                }
                rec.releases.push(Release {
                    entry: start,
                    len: i + 1 - start,
                    bytes: 0,
                    reserved_before: reserved_before[i],
                    followed_by_segment: None,
                    cause: ReleaseCause::EmptyCache,
                    reason: "deferred frees completed outside any malloc, which only empty_cache does (§5.3); it released no segment".to_owned(),
                });
            }
            if entries[i].action == Action::FreeCompleted {
                held.push(i);
            } else {
                for j in held.drain(..) {
                    layout.apply(entries, j);
                }
                layout.apply(entries, i);
            }
            i += 1;
            continue;
        }
        let start = i;
        while i < entries.len() && is_release(&entries[i]) {
            i += 1;
        }
        let run = &entries[start..i];
        let bytes = run.iter().map(|e| e.size).sum();
        let before = reserved_before[start];
        let waiting: Vec<u64> = held.iter().map(|&j| entries[j].addr).collect();
        let (cause, reason, followed_by_segment) = classify_run(
            entries,
            (start, i),
            before,
            rules,
            rec.peak_reserved,
            (&layout, &waiting),
        );
        for j in held.drain(..).chain(start..i) {
            layout.apply(entries, j);
        }
        rec.releases.push(Release {
            entry: start,
            len: i - start,
            bytes,
            reserved_before: before,
            followed_by_segment,
            cause,
            reason,
        });
    }
}

/// The `free_completed` entries the ring buffer starts with: they may complete frees whose
/// `free_requested` just missed the buffer, or belong to the `malloc` or release that follows.
fn leading_completions(entries: &[TraceEntry]) -> usize {
    entries
        .iter()
        .take_while(|e| e.action == Action::FreeCompleted)
        .count()
}

/// Where the reservations of the initial expandable ranges begin: the lowest address the history maps or
/// unmaps in the same stream and pool while the reservation lives (until none of its ranges is mapped),
/// within a reservation's size (1⅛ × the highest reservation, §7.1) of its ranges. Set as `base` on the
/// stream and pool's first range when it is below it.
fn set_reservation_bases(
    entries: &[TraceEntry],
    initial: &mut [Event],
    rules: &SizeRules,
    peak: u64,
) {
    let mut first: BTreeMap<(StreamId, Pool), (u64, u64)> = BTreeMap::new(); // (lowest start, highest end)
    for e in initial.iter() {
        if let Event::Segment(seg) = e {
            if seg.expandable {
                let span = first.entry((seg.stream, seg.pool)).or_insert((u64::MAX, 0));
                span.0 = span.0.min(seg.addr);
                span.1 = span.1.max(seg.addr + seg.size);
            }
        }
    }
    if first.is_empty() {
        return;
    }
    let reach = (peak + peak / 8).saturating_add(rules.large_segment_size);
    let mut layout = ExpandableLayout::new(entries, initial, rules);
    let mut bases: BTreeMap<(StreamId, Pool), u64> =
        first.iter().map(|(&k, &(lo, _))| (k, lo)).collect();
    let mut open: Vec<(StreamId, Pool)> = first.keys().copied().collect();
    for (i, e) in entries.iter().enumerate() {
        if open.is_empty() {
            break;
        }
        if matches!(e.action, Action::SegmentMap | Action::SegmentUnmap) {
            let pool = match e.action {
                Action::SegmentMap => layout.next_pool[i].unwrap_or(Pool::Large),
                _ => layout.pool_at(e.addr).unwrap_or(Pool::Large),
            };
            let key = (e.stream, pool);
            if open.contains(&key) {
                let (_, hi) = first[&key];
                if e.addr < bases[&key] && hi - e.addr <= reach {
                    bases.insert(key, e.addr);
                }
            }
        }
        layout.apply(entries, i);
        open.retain(|&(stream, pool)| layout.has_ranges(stream, pool));
    }
    let mut done: Vec<(StreamId, Pool)> = Vec::new();
    for e in initial.iter_mut() {
        if let Event::Segment(seg) = e {
            let key = (seg.stream, seg.pool);
            if seg.expandable && !done.contains(&key) {
                done.push(key);
                if bases[&key] < seg.addr {
                    seg.base = Some(bases[&key]);
                }
            }
        }
    }
}

/// Whether the entry at `i` is the `free_completed` of a deferred free (not right after its own
/// `free_requested`).
fn is_deferred_completion(entries: &[TraceEntry], i: usize) -> bool {
    let e = &entries[i];
    e.action == Action::FreeCompleted
        && !(i > 0
            && entries[i - 1].action == Action::FreeRequested
            && entries[i - 1].addr == e.addr)
}

/// Whether the deferred completion at `i` is the last of a run that no `malloc` or release follows
/// (the run belongs to an `empty_cache` that found nothing to release).
fn ends_silent_empty_cache(entries: &[TraceEntry], i: usize) -> bool {
    match entries.get(i + 1).map(|e| &e.action) {
        Some(Action::FreeCompleted) => !is_deferred_completion(entries, i + 1),
        Some(
            Action::Alloc
            | Action::SegmentAlloc
            | Action::SegmentMap
            | Action::SegmentFree
            | Action::SegmentUnmap
            | Action::Oom,
        ) => false,
        _ => true,
    }
}

/// The recorded layout of expandable segments, replayed forward: mapped ranges (by stream and pool) and
/// the live blocks in them (an expandable block is exactly its rounded request, §3.2). Enough to say how
/// many bytes a request would have had to map at a given moment (§7.2).
struct ExpandableLayout {
    /// Mapped ranges: start → (end, stream, pool).
    ranges: BTreeMap<u64, (u64, StreamId, Pool)>,
    /// Live blocks (allocated or waiting for events): start → end.
    blocks: BTreeMap<u64, u64>,
    /// For each entry, the pool of the next request (`alloc` or `oom`) at or after it.
    next_pool: Vec<Option<Pool>>,
    small_page: u64,
    large_page: u64,
    rounded: Vec<u64>,
}

impl ExpandableLayout {
    fn new(entries: &[TraceEntry], initial: &[Event], rules: &SizeRules) -> Self {
        let mut layout = ExpandableLayout {
            ranges: BTreeMap::new(),
            blocks: BTreeMap::new(),
            next_pool: vec![None; entries.len()],
            small_page: SMALL_BUFFER,
            large_page: rules.large_segment_size,
            rounded: entries
                .iter()
                .map(|e| match e.action {
                    Action::Alloc => rules.round_size(e.size),
                    _ => e.size,
                })
                .collect(),
        };
        if !entries
            .iter()
            .any(|e| matches!(e.action, Action::SegmentMap | Action::SegmentUnmap))
            && !initial
                .iter()
                .any(|e| matches!(e, Event::Segment(s) if s.expandable))
        {
            return layout; // nothing expandable: the layout stays empty
        }
        let mut pool = None;
        for i in (0..entries.len()).rev() {
            if matches!(entries[i].action, Action::Alloc | Action::Oom) {
                pool = Some(SizeRules::pool_of(layout.rounded[i]));
            }
            layout.next_pool[i] = pool;
        }
        for e in initial {
            if let Event::Segment(seg) = e {
                if seg.expandable {
                    layout.map(seg.addr, seg.size, seg.stream, seg.pool);
                    for b in &seg.blocks {
                        layout
                            .blocks
                            .insert(seg.addr + b.offset, seg.addr + b.offset + b.size);
                    }
                }
            }
        }
        layout
    }

    fn map(&mut self, addr: u64, size: u64, stream: StreamId, pool: Pool) {
        let (mut start, mut end) = (addr, addr + size);
        if let Some((&s, &(e, st, p))) = self.ranges.range(..addr).next_back() {
            if e == addr && st == stream && p == pool {
                self.ranges.remove(&s);
                start = s;
            }
        }
        if let Some(&(e, st, p)) = self.ranges.get(&end) {
            if st == stream && p == pool {
                self.ranges.remove(&end);
                end = e;
            }
        }
        self.ranges.insert(start, (end, stream, pool));
    }

    fn unmap(&mut self, addr: u64, size: u64) {
        let end = addr + size;
        let Some((&s, &(e, st, p))) = self.ranges.range(..=addr).next_back() else {
            return;
        };
        if e < end {
            return;
        }
        self.ranges.remove(&s);
        if s < addr {
            self.ranges.insert(s, (addr, st, p));
        }
        if end < e {
            self.ranges.insert(end, (e, st, p));
        }
    }

    /// The pool of the mapped range holding `addr`.
    fn pool_at(&self, addr: u64) -> Option<Pool> {
        let (_, &(end, _, pool)) = self.ranges.range(..=addr).next_back()?;
        (addr < end).then_some(pool)
    }

    /// Whether any range of `stream` and `pool` is mapped.
    fn has_ranges(&self, stream: StreamId, pool: Pool) -> bool {
        self.ranges
            .values()
            .any(|&(_, st, p)| st == stream && p == pool)
    }

    /// Applies entry `i`.
    fn apply(&mut self, entries: &[TraceEntry], i: usize) {
        let e = &entries[i];
        match e.action {
            Action::SegmentMap => {
                let pool = self.next_pool[i].unwrap_or(Pool::Large);
                self.map(e.addr, e.size, e.stream, pool);
            }
            Action::SegmentUnmap => self.unmap(e.addr, e.size),
            Action::Alloc if !self.ranges.is_empty() => {
                self.blocks.insert(e.addr, e.addr + self.rounded[i]);
            }
            Action::FreeCompleted => {
                self.blocks.remove(&e.addr);
            }
            _ => {}
        }
    }

    /// The bytes a request of `rounded` bytes on `stream` would map now (§7.2
    /// `find_expandable_block` + `map_block`), or `None` if a cached block serves it (§3.1) or nothing
    /// expandable is known.
    fn mapping_needed(&self, stream: StreamId, rounded: u64) -> Option<u64> {
        let pool = SizeRules::pool_of(rounded);
        let page = match pool {
            Pool::Small => self.small_page,
            Pool::Large => self.large_page,
        };
        let ranges: Vec<(u64, u64)> = self
            .ranges
            .iter()
            .filter(|(_, &(_, st, p))| st == stream && p == pool)
            .map(|(&s, &(e, _, _))| (s, e))
            .collect();
        // free blocks of the ranges: the gaps between live blocks
        let live_in = |s: u64, e: u64| self.blocks.range(s..e);
        for &(s, e) in &ranges {
            let mut cursor = s;
            for (&b, &be) in live_in(s, e) {
                if b - cursor >= rounded {
                    return None;
                }
                cursor = be.max(cursor);
            }
            if e.saturating_sub(cursor) >= rounded {
                return None;
            }
        }
        let pages = |bytes: u64| bytes.div_ceil(page) * page;
        if ranges.is_empty() {
            return Some(pages(rounded));
        }
        let free_tail = |k: usize| {
            let (s, e) = ranges[k];
            let last_end = live_in(s, e).map(|(_, &be)| be).max().unwrap_or(s);
            e.saturating_sub(last_end)
        };
        let free_prefix = |k: usize| {
            let (s, e) = ranges[k];
            live_in(s, e).next().map_or(e - s, |(&b, _)| b - s)
        };
        // the unmapped blocks in address order: after each range (the last one unbounded)
        'candidates: for k in 0..ranges.len() {
            let mut remaining = rounded.saturating_sub(free_tail(k));
            let mut mapped = 0;
            let mut j = k;
            loop {
                let gap = ranges.get(j + 1).map_or(u64::MAX, |n| n.0 - ranges[j].1);
                let take = gap.min(remaining);
                mapped += pages(take);
                remaining -= take;
                if remaining == 0 {
                    return Some(mapped);
                }
                let next = j + 1;
                let prefix = free_prefix(next);
                if prefix >= remaining {
                    return Some(mapped);
                }
                if prefix < ranges[next].1 - ranges[next].0 {
                    continue 'candidates;
                }
                remaining -= prefix;
                j = next;
            }
        }
        Some(pages(rounded))
    }
}

/// Who made the release `entries[start..end]` (see the module doc), why, and the bytes of the new
/// segment that follows it.
/// `waiting`: blocks whose completion right before the run may belong to it (see the caller).
fn classify_run(
    entries: &[TraceEntry],
    (start, end): (usize, usize),
    before: u64,
    rules: &SizeRules,
    peak: u64,
    (layout, waiting): (&ExpandableLayout, &[u64]),
) -> (ReleaseCause, String, Option<u64>) {
    let mut j = end;
    while j < entries.len() && entries[j].action == Action::Snapshot {
        j += 1;
    }
    let Some(next) = entries.get(j) else {
        return (
            ReleaseCause::EmptyCache,
            "nothing follows it: no request was waiting".to_owned(),
            None,
        );
    };
    if next.action == Action::Oom {
        return (
            ReleaseCause::Allocator,
            format!("the out-of-memory at entry {j} follows it (§3 step 4e release before the last retry)"),
            None,
        );
    }
    if !matches!(next.action, Action::SegmentAlloc | Action::SegmentMap) {
        return (
            ReleaseCause::EmptyCache,
            format!(
                "entry {j} ({}) follows it, not a new segment for a waiting request",
                next.action
            ),
            None,
        );
    }
    let mut need = 0u64;
    let mut k = j;
    while k < entries.len()
        && matches!(entries[k].action, Action::SegmentAlloc | Action::SegmentMap)
    {
        need = need.saturating_add(entries[k].size);
        k += 1;
    }
    let Some(request) = entries.get(k).filter(|e| e.action == Action::Alloc) else {
        return (
            ReleaseCause::EmptyCache,
            "the new segment after it serves no recorded request".to_owned(),
            Some(need),
        );
    };
    if rules.garbage_collection_threshold > 0.0 || rules.max_split_size != u64::MAX {
        return (
            ReleaseCause::Allocator,
            "garbage collection (§5.4) or the oversize release (§5.2) may release inside a malloc"
                .to_owned(),
            Some(need),
        );
    }
    let rounded = rules.round_size(request.size);
    let pool = SizeRules::pool_of(rounded);
    if entries[j].action == Action::SegmentMap {
        // expandable segments: what the first attempt, before the release, would have mapped
        return match layout.mapping_needed(request.stream, rounded) {
            None => (
                ReleaseCause::EmptyCache,
                format!(
                    "a free block could have served the next request of {} bytes from the cache (§3.1)",
                    request.size
                ),
                Some(need),
            ),
            Some(first) if before.saturating_add(first) <= peak => (
                ReleaseCause::EmptyCache,
                format!(
                    "before the release the next request would have mapped {first} bytes (§7.2), which fitted next to the {before} bytes reserved (the device held {peak} bytes at its peak)"
                ),
                Some(need),
            ),
            Some(first) => (
                ReleaseCause::Allocator,
                format!(
                    "before the release the next request needed {first} more bytes mapped (§7.2), which did not fit next to the {before} bytes reserved (§3 step 4e)"
                ),
                Some(first),
            ),
        };
    }
    let servable = entries[start..end].iter().find(|e| {
        e.action == Action::SegmentFree
            && e.stream == request.stream
            && (e.size <= SMALL_BUFFER) == (pool == Pool::Small)
            && e.size >= rounded
            // a segment freed by a completion of the release itself was not in the cache before
            && !waiting.iter().any(|&w| w >= e.addr && w - e.addr < e.size)
    });
    if let Some(s) = servable {
        return (
            ReleaseCause::EmptyCache,
            format!(
                "the released segment {:#x} ({} bytes) could have served the next request of {} bytes from the cache (§3.1)",
                s.addr, s.size, request.size
            ),
            Some(need),
        );
    }
    if before.saturating_add(need) <= peak {
        return (
            ReleaseCause::EmptyCache,
            format!(
                "the new {need}-byte segment fitted next to the {before} bytes reserved before it (the device held {peak} bytes at its peak)"
            ),
            Some(need),
        );
    }
    (
        ReleaseCause::Allocator,
        format!(
            "the next request needed a new {need}-byte segment that did not fit next to the {before} bytes reserved before (§3 step 4e)"
        ),
        Some(need),
    )
}

fn capacity(rec: &Recorded) -> Capacity {
    if let Some(oom) = rec.ooms.first() {
        return Capacity::Oom {
            usable: oom.device_free.saturating_add(oom.reserved),
            entry: oom.entry,
            device_free: oom.device_free,
            reserved: oom.reserved,
        };
    }
    // A malloc that had to release first did not fit: capacity < reserved before + the new segment.
    let tightest = rec
        .releases
        .iter()
        .filter(|r| r.cause == ReleaseCause::Allocator)
        .filter_map(|r| {
            Some((
                r.reserved_before.saturating_add(r.followed_by_segment?),
                r.entry,
            ))
        })
        .min();
    match tightest {
        Some((below, entry)) if below > rec.peak_reserved => Capacity::Window {
            at_least: rec.peak_reserved,
            below,
            entry,
        },
        _ => Capacity::AtLeast {
            bytes: rec.peak_reserved,
        },
    }
}

fn meta_of(snapshot: &Snapshot, device: u32, rec: &Recorded) -> Meta {
    use serde_json::json;
    let mut meta = Meta::new();
    meta.insert("source".into(), json!("pytorch-snapshot"));
    meta.insert("device".into(), json!(device));
    meta.insert("recorded_entries".into(), json!(rec.entries));
    if let Some(span) = rec.time_span_us {
        meta.insert("time_span_us".into(), json!(span));
    }
    if let Some(conf) = snapshot
        .allocator_settings
        .as_ref()
        .and_then(|s| s.pytorch_cuda_alloc_conf.as_ref())
    {
        meta.insert("alloc_conf".into(), json!(conf));
    }
    let i = &rec.initial;
    meta.insert(
        "initial_state".into(),
        json!({
            "segments": i.segments, "reserved_bytes": i.reserved, "allocated_bytes": i.allocated,
            "live_blocks": i.live_blocks, "inferred_block_sizes": i.inferred_block_sizes,
            "pending_frees": i.pending_frees,
        }),
    );
    meta.insert(
        "final_state".into(),
        json!({
            "segments": rec.final_segments, "reserved_bytes": rec.final_reserved,
            "allocated_bytes": rec.final_allocated,
        }),
    );
    let entries = |cause| {
        rec.releases
            .iter()
            .filter(|r| r.cause == cause)
            .map(|r| r.entry)
            .collect::<Vec<_>>()
    };
    meta.insert(
        "empty_cache_inferred".into(),
        json!(entries(ReleaseCause::EmptyCache)),
    );
    meta.insert(
        "allocator_releases".into(),
        json!(entries(ReleaseCause::Allocator)),
    );
    meta.insert("deferred_frees".into(), json!(rec.deferred_frees));
    meta.insert(
        "ooms".into(),
        json!(rec
            .ooms
            .iter()
            .map(|o| json!({"entry": o.entry, "size": o.size, "device_free": o.device_free, "reserved_bytes": o.reserved}))
            .collect::<Vec<_>>()),
    );
    meta.insert(
        "capacity".into(),
        match &rec.capacity {
            Capacity::Oom { usable, entry, .. } => {
                json!({"kind": "oom", "usable_bytes": usable, "entry": entry})
            }
            Capacity::Window {
                at_least,
                below,
                entry,
            } => json!({"kind": "window", "at_least": at_least, "below": below, "entry": entry}),
            Capacity::AtLeast { bytes } => json!({"kind": "at_least", "bytes": bytes}),
        },
    );
    if !rec.notes.is_empty() {
        meta.insert("notes".into(), json!(rec.notes));
    }
    meta
}
