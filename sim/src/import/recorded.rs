//! What the snapshot records about one device, and what the importer inferred from it: the reconstructed
//! initial state, the recorded out-of-memory errors, the releases and their causes, the device's capacity.

use std::fmt;

use vramsim_traces::StreamId;

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
