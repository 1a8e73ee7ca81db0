//! A typed model of PyTorch memory snapshots (`torch.cuda.memory._snapshot()`, pytorch_allocator.md
//! §10.2), read from and written to the pickles `torch.cuda.memory._dump_snapshot()` writes.
//!
//! ```no_run
//! use vramsim_traces::snapshot::{load_snapshot_file, Action};
//! let snap = load_snapshot_file("memory_snapshot.pickle.gz").unwrap();
//! let allocs = snap.device_traces[0].iter().filter(|e| e.action == Action::Alloc).count();
//! println!("{} segments, {allocs} allocations recorded", snap.segments.len());
//! ```
//!
//! What goes in: a dict snapshot (`segments`, `device_traces`, `allocator_settings`,
//! `external_annotations`) or the older list-of-segments form of `torch.cuda.memory_snapshot()`, as a
//! pickle or as JSON, gzip-compressed or not ([`load_snapshot_file`] tells them apart by their first
//! bytes). Keys differ between PyTorch versions, so only the keys no version lacks are required
//! (segment `address`, `total_size`, `blocks`; block `size`, `state`; trace entry `action`, `size`
//! and `addr`, or `device_free` for `oom`); the others get the value PyTorch would have written (each
//! field's doc says which). Keys this model does not know are kept, in order, in `extra`.
//!
//! What it deliberately leaves out: stack traces. `frames` (and the legacy per-block `history`) are
//! dropped on reading, because they are most of a snapshot's bytes and the simulator never needs them;
//! [`Snapshot::to_value`] writes `frames: []` wherever `torch/cuda/_memory_viz.py` and `MemoryViz.js`
//! expect a list (segments, blocks, trace entries), so exported files open in `pytorch.org/memory_viz`
//! with `<block was allocated before _record_history was enabled>` in place of stacks.
//!
//! Invariant: `Snapshot::from_value(&s.to_value()) == Ok(s)` for every snapshot this module reads.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::pickle::{self, PickleError, Value};
use crate::StreamId;

/// A memory snapshot: the allocator's segments when it was taken, and each device's recorded history.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Every segment of every device, sorted by address within each device (as PyTorch emits them).
    pub segments: Vec<Segment>,
    /// Per device index, the trace ring buffer oldest first (empty when history was not recorded, or
    /// for the list-of-segments format).
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// The allocator configuration (`None` when the file has none: PyTorch before 2.2, or the list
    /// format).
    pub allocator_settings: Option<AllocatorSettings>,
    /// `external_annotations` as written (a list of `{stage, name, device, time_us}` dicts from
    /// profiler record_function ranges in recent PyTorch), `None` when absent.
    pub external_annotations: Option<Vec<Value>>,
    /// Top-level keys this model does not know, in file order.
    pub extra: Vec<(String, Value)>,
}

impl Snapshot {
    /// The devices the snapshot holds: every index with a trace list (even empty, as PyTorch writes one
    /// per device) or a segment, ascending.
    pub fn devices(&self) -> Vec<u32> {
        let mut devices: Vec<u32> = (0..self.device_traces.len() as u32).collect();
        devices.extend(self.segments.iter().map(|s| s.device));
        devices.sort_unstable();
        devices.dedup();
        devices
    }

    /// The devices with something to replay: a non-empty history or at least one segment, ascending.
    pub fn devices_with_data(&self) -> Vec<u32> {
        self.devices()
            .into_iter()
            .filter(|&d| {
                self.device_traces
                    .get(d as usize)
                    .is_some_and(|t| !t.is_empty())
                    || self.segments.iter().any(|s| s.device == d)
            })
            .collect()
    }
}

/// One segment: a `cudaMalloc` (or an expandable segment's mapped range) and the blocks it is split into.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    /// CUDA device index (default 0).
    pub device: u32,
    /// Device address of the segment's first byte.
    pub address: u64,
    /// Bytes reserved from CUDA.
    pub total_size: u64,
    /// Σ sizes of `active_allocated` blocks (default: computed from the blocks).
    pub allocated_size: u64,
    /// Σ sizes of active blocks, allocated or pending free (default: computed from the blocks).
    pub active_size: u64,
    /// Σ requested (unrounded) sizes of active blocks (default: computed from the blocks).
    pub requested_size: u64,
    /// The stream the segment was allocated for (the `cudaStream_t` as an integer; default 0).
    pub stream: StreamId,
    /// Which pool it belongs to (default: small for segments of at most 2 MiB, §1.4).
    pub segment_type: SegmentType,
    /// The memory pool id; `(0, 0)` is the default pool, others are CUDA-graph or `MemPool` pools
    /// (default `(0, 0)`).
    pub segment_pool_id: (u64, u64),
    /// Whether this is an expandable segment (`expandable_segments:True`; default false).
    pub is_expandable: bool,
    /// The blocks, in address order, covering the segment without gaps.
    pub blocks: Vec<Block>,
    /// Keys this model does not know, in file order (`frames` is dropped, not kept here).
    pub extra: Vec<(String, Value)>,
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// Device address (default: the segment's address plus the sizes of the blocks before it).
    pub address: u64,
    /// Rounded size in bytes.
    pub size: u64,
    /// The size the caller asked for (default: the legacy `history[0].real_size`, else `size`). For
    /// inactive blocks PyTorch leaves the value of the last allocation here, which may exceed `size`.
    pub requested_size: u64,
    /// Allocation state.
    pub state: BlockState,
    /// Keys this model does not know, in file order (`frames` and `history` are dropped).
    pub extra: Vec<(String, Value)>,
}

/// The state of a [`Block`] (`active` = allocated, or freed but waiting for stream events).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// `"active_allocated"`: handed out to a tensor.
    ActiveAllocated,
    /// `"active_pending_free"`: freed, waiting for events of streams it was used on (`record_stream`).
    ActivePendingFree,
    /// `"inactive"`: cached, free for reuse.
    Inactive,
}

impl BlockState {
    /// PyTorch's string for this state.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }

    /// The state PyTorch names `s`, if any.
    pub fn from_name(s: &str) -> Option<BlockState> {
        Some(match s {
            "active_allocated" => BlockState::ActiveAllocated,
            "active_pending_free" => BlockState::ActivePendingFree,
            "inactive" => BlockState::Inactive,
            _ => return None,
        })
    }

    /// Whether the block counts as active (its state string starts with `active_`, §8.4).
    pub fn is_active(self) -> bool {
        self != BlockState::Inactive
    }
}

/// The pool a segment belongs to (`segment_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SegmentType {
    /// `"large"`: the large pool (requests over 1 MiB, §1.3).
    Large,
    /// `"small"`: the small pool (2 MiB segments for requests of at most 1 MiB).
    Small,
}

impl SegmentType {
    /// PyTorch's string for this type.
    pub fn as_str(self) -> &'static str {
        match self {
            SegmentType::Large => "large",
            SegmentType::Small => "small",
        }
    }
}

/// What a [`TraceEntry`] records (§10.2 table).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// `alloc`: a block handed out; `size` is the requested size.
    Alloc,
    /// `free_requested`: the user freed the block.
    FreeRequested,
    /// `free_completed`: the block returned to the cache (after its stream events).
    FreeCompleted,
    /// `segment_alloc`: `cudaMalloc` of a segment.
    SegmentAlloc,
    /// `segment_free`: `cudaFree` of a segment.
    SegmentFree,
    /// `segment_map`: pages mapped into an expandable segment.
    SegmentMap,
    /// `segment_unmap`: pages unmapped from an expandable segment.
    SegmentUnmap,
    /// `snapshot`: a `_snapshot()` call; `size` is Σ active sizes.
    Snapshot,
    /// `oom`: an out-of-memory; `addr` holds `device_free`, `size` the rounded request.
    Oom,
    /// Any other action (newer PyTorch, user annotations), kept with its name rather than dropped.
    Other(String),
}

impl Action {
    /// PyTorch's string for this action.
    pub fn as_str(&self) -> &str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Snapshot => "snapshot",
            Action::Oom => "oom",
            Action::Other(s) => s,
        }
    }

    /// The action PyTorch names `s` ([`Action::Other`] for names this model does not know).
    pub fn from_name(s: &str) -> Action {
        match s {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "snapshot" => Action::Snapshot,
            "oom" => Action::Oom,
            other => Action::Other(other.to_string()),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One entry of a device's trace ring buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// Block or segment address; for [`Action::Oom`] the device's free bytes (`device_free`), as in
    /// PyTorch's C++ `TraceEntry`.
    pub addr: u64,
    /// Bytes (see [`Action`] for which size each action records).
    pub size: u64,
    /// The stream (default 0).
    pub stream: StreamId,
    /// Microseconds since the epoch (absent before PyTorch 2.1).
    pub time_us: Option<i64>,
    /// `compile_context` (torch.compile frame, `"N/A"` outside; PyTorch 2.5+).
    pub compile_context: Option<String>,
    /// `user_metadata` (PyTorch 2.6+).
    pub user_metadata: Option<String>,
    /// Keys this model does not know, in file order (`frames` is dropped).
    pub extra: Vec<(String, Value)>,
}

/// `allocator_settings`: the `PYTORCH_CUDA_ALLOC_CONF` options in effect (§12). Every field is `None`
/// when the file lacks the key.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct AllocatorSettings {
    /// `PYTORCH_CUDA_ALLOC_CONF`: the last settings string (`""` if unset).
    pub pytorch_cuda_alloc_conf: Option<String>,
    /// `max_split_size` in bytes; `-1` means unlimited (SIZE_MAX cast to int64).
    pub max_split_size: Option<i64>,
    /// `garbage_collection_threshold` (0.0 = off).
    pub garbage_collection_threshold: Option<f64>,
    /// `expandable_segments`.
    pub expandable_segments: Option<bool>,
    /// `pinned_num_register_threads`.
    pub pinned_num_register_threads: Option<i64>,
    /// `release_lock_on_cudamalloc`.
    pub release_lock_on_cudamalloc: Option<bool>,
    /// `pinned_use_cuda_host_register`.
    pub pinned_use_cuda_host_register: Option<bool>,
    /// `graph_capture_record_stream_reuse` (PyTorch 2.9+).
    pub graph_capture_record_stream_reuse: Option<bool>,
    /// `roundup_power2_divisions` as (interval start in MiB, divisions) pairs, in file order
    /// (PyTorch writes keys `"1"`, `"2"`, ..., `"32768"`).
    pub roundup_power2_divisions: Option<Vec<(u64, u64)>>,
    /// Keys this model does not know, in file order.
    pub extra: Vec<(String, Value)>,
}

/// Σ over a segment's blocks, to compare with the sizes it records (§8.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BlockSums {
    /// Σ size of `active_allocated` blocks (compare with [`Segment::allocated_size`]).
    pub allocated_size: u64,
    /// Σ size of active blocks (compare with [`Segment::active_size`]).
    pub active_size: u64,
    /// Σ requested_size of active blocks (compare with [`Segment::requested_size`]).
    pub requested_size: u64,
    /// Σ size of all blocks (compare with [`Segment::total_size`]).
    pub total_size: u64,
}

impl Segment {
    /// The sizes the blocks add up to (saturating, so corrupt input cannot overflow).
    pub fn sums_from_blocks(&self) -> BlockSums {
        let mut sums = BlockSums::default();
        for b in &self.blocks {
            sums.total_size = sums.total_size.saturating_add(b.size);
            if b.state.is_active() {
                sums.active_size = sums.active_size.saturating_add(b.size);
                sums.requested_size = sums.requested_size.saturating_add(b.requested_size);
            }
            if b.state == BlockState::ActiveAllocated {
                sums.allocated_size = sums.allocated_size.saturating_add(b.size);
            }
        }
        sums
    }
}

/// Why a snapshot could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// Reading (or gunzipping) the bytes failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The bytes are not a readable pickle.
    #[error("{0}")]
    Pickle(#[from] PickleError),
    /// The bytes look like JSON but do not parse.
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The data does not have a snapshot's shape: `at` is the path to the offending value
    /// (`device_traces[0][17].size`), `message` what was wrong (`expected int, got str`).
    #[error("{at}: {message}")]
    Shape {
        /// Path from the top-level object to the offending value.
        at: String,
        /// What was wrong, and what would be valid.
        message: String,
    },
    /// An error in a named file.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong with it.
        source: Box<SnapshotError>,
    },
}

// ------------------------------------------------------------------------------------------------
// Files

/// Reads a snapshot file: a pickle or JSON, each optionally gzip-compressed (detected by the gzip
/// magic bytes, not the file name), holding a dict snapshot or a list of segments.
pub fn load_snapshot_file(path: impl AsRef<Path>) -> Result<Snapshot, SnapshotError> {
    let path = path.as_ref();
    let in_file = |e: SnapshotError| SnapshotError::File {
        path: path.to_owned(),
        source: Box::new(e),
    };
    let value = load_value_file(path)?;
    Snapshot::from_value(&value).map_err(in_file)
}

/// Whether the file at `path` holds a pickle (a snapshot) rather than a vramsim trace: its first byte,
/// after gunzipping if it starts with the gzip magic, is the pickle `PROTO` opcode `0x80` (every pickle of
/// protocol 2 or later, which is what `_dump_snapshot()` writes), where a trace starts with `{`. Reads at
/// most a few bytes.
pub fn is_snapshot_file(path: impl AsRef<Path>) -> std::io::Result<bool> {
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

/// Reads a pickle or JSON file (optionally gzip-compressed) as a raw [`Value`], without checking that
/// it is a snapshot.
pub fn load_value_file(path: impl AsRef<Path>) -> Result<Value, SnapshotError> {
    let path = path.as_ref();
    let in_file = |e: SnapshotError| SnapshotError::File {
        path: path.to_owned(),
        source: Box::new(e),
    };
    let bytes = std::fs::read(path).map_err(|e| in_file(e.into()))?;
    decode_bytes(&bytes).map_err(in_file)
}

/// Decodes the bytes of a snapshot file into a raw [`Value`]: gunzips them if they start with the gzip
/// magic `1f 8b`, parses JSON if the first non-blank byte is `{` or `[` (neither is a pickle opcode),
/// and unpickles otherwise.
pub fn decode_bytes(bytes: &[u8]) -> Result<Value, SnapshotError> {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut plain = Vec::new();
        flate2::read::MultiGzDecoder::new(bytes).read_to_end(&mut plain)?;
        return decode_plain(&plain);
    }
    decode_plain(bytes)
}

fn decode_plain(bytes: &[u8]) -> Result<Value, SnapshotError> {
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') | Some(b'[') => {
            let json: serde_json::Value = serde_json::from_slice(bytes)?;
            Ok(from_json(&json))
        }
        _ => Ok(pickle::from_slice(bytes)?),
    }
}

fn from_json(json: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match json {
        J::Null => Value::None,
        J::Bool(b) => Value::Bool(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::Int(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => Value::str(s),
        J::Array(items) => Value::list(items.iter().map(from_json).collect()),
        J::Object(map) => Value::dict(
            map.iter()
                .map(|(k, v)| (Value::str(k), from_json(v)))
                .collect(),
        ),
    }
}

/// Writes `snapshot` as the pickle [`Snapshot::to_pickle`] makes, gzip-compressed when the file name
/// ends in `.gz` (`pickle.load(gzip.open(path))` then reads it).
pub fn write_snapshot_file(
    path: impl AsRef<Path>,
    snapshot: &Snapshot,
) -> Result<(), SnapshotError> {
    let path = path.as_ref();
    let in_file = |e: std::io::Error| SnapshotError::File {
        path: path.to_owned(),
        source: Box::new(e.into()),
    };
    let bytes = snapshot.to_pickle();
    let bytes = if path.extension().is_some_and(|e| e == "gz") {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&bytes).map_err(in_file)?;
        gz.finish().map_err(in_file)?
    } else {
        bytes
    };
    std::fs::write(path, bytes).map_err(in_file)
}

// ------------------------------------------------------------------------------------------------
// Value -> Snapshot

/// A shape error on its way up: the path is collected innermost first.
struct ShapeErr {
    path: Vec<PathSeg>,
    message: String,
}

enum PathSeg {
    Key(String),
    Index(usize),
}

impl ShapeErr {
    fn new(message: impl Into<String>) -> Self {
        ShapeErr {
            path: Vec::new(),
            message: message.into(),
        }
    }

    fn expected(what: &str, got: &Value) -> Self {
        ShapeErr::new(format!("expected {what}, got {}", got.type_name()))
    }

    fn key(mut self, key: &str) -> Self {
        self.path.push(PathSeg::Key(key.to_string()));
        self
    }

    fn index(mut self, i: usize) -> Self {
        self.path.push(PathSeg::Index(i));
        self
    }

    fn into_error(self) -> SnapshotError {
        let mut at = String::new();
        for seg in self.path.iter().rev() {
            match seg {
                PathSeg::Key(k) if at.is_empty() => at.push_str(k),
                PathSeg::Key(k) => {
                    at.push('.');
                    at.push_str(k);
                }
                PathSeg::Index(i) => at.push_str(&format!("[{i}]")),
            }
        }
        if at.is_empty() {
            at.push_str("(top level)");
        }
        SnapshotError::Shape {
            at,
            message: self.message,
        }
    }
}

type Shaped<T> = Result<T, ShapeErr>;

fn as_u64(v: &Value) -> Shaped<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n)
            .map_err(|_| ShapeErr::new(format!("expected a non-negative int, got {n}"))),
        Value::BigInt(b) if b.len() == 9 && b[8] == 0 => {
            let mut buf = [0u8; 8];
            buf.copy_from_slice(&b[..8]);
            Ok(u64::from_le_bytes(buf))
        }
        Value::BigInt(_) => Err(ShapeErr::new(
            "expected an int of at most 64 bits, got a larger int",
        )),
        other => Err(ShapeErr::expected("int", other)),
    }
}

fn as_i64(v: &Value) -> Shaped<i64> {
    match v {
        Value::Int(n) => Ok(*n),
        Value::BigInt(_) => Err(ShapeErr::new(
            "expected an int of at most 64 bits, got a larger int",
        )),
        other => Err(ShapeErr::expected("int", other)),
    }
}

fn as_u32(v: &Value) -> Shaped<u32> {
    let n = as_i64(v)?;
    u32::try_from(n).map_err(|_| ShapeErr::new(format!("expected a device index, got {n}")))
}

fn as_bool(v: &Value) -> Shaped<bool> {
    v.as_bool().ok_or_else(|| ShapeErr::expected("bool", v))
}

fn as_f64(v: &Value) -> Shaped<f64> {
    match v {
        Value::Float(x) => Ok(*x),
        Value::Int(n) => Ok(*n as f64),
        other => Err(ShapeErr::expected("float", other)),
    }
}

fn as_string(v: &Value) -> Shaped<String> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| ShapeErr::expected("str", v))
}

fn as_dict(v: &Value) -> Shaped<&[(Value, Value)]> {
    v.as_dict().ok_or_else(|| ShapeErr::expected("dict", v))
}

fn as_list(v: &Value) -> Shaped<&[Value]> {
    v.as_sequence().ok_or_else(|| ShapeErr::expected("list", v))
}

/// The entries of a dict with string keys.
fn str_entries(v: &Value) -> Shaped<impl Iterator<Item = (&str, &Value)>> {
    let entries = as_dict(v)?;
    if let Some((k, _)) = entries.iter().find(|(k, _)| k.as_str().is_none()) {
        return Err(ShapeErr::new(format!(
            "expected str keys, found the {} key {k}",
            k.type_name()
        )));
    }
    Ok(entries
        .iter()
        .map(|(k, v)| (k.as_str().unwrap_or_default(), v)))
}

/// Parses `v` under `key`, attaching the key to any error.
fn field<T>(key: &str, v: &Value, parse: impl FnOnce(&Value) -> Shaped<T>) -> Shaped<T> {
    parse(v).map_err(|e| e.key(key))
}

fn missing(key: &str) -> ShapeErr {
    ShapeErr::new(format!("missing key '{key}'"))
}

fn list_of<T>(v: &Value, mut parse: impl FnMut(&Value) -> Shaped<T>) -> Shaped<Vec<T>> {
    as_list(v)?
        .iter()
        .enumerate()
        .map(|(i, item)| parse(item).map_err(|e| e.index(i)))
        .collect()
}

impl Snapshot {
    /// Reads the typed model from a raw value: a dict snapshot, or a list of segments (the older
    /// `torch.cuda.memory_snapshot()` form, giving empty traces). Errors name the path to the
    /// offending value: `device_traces[0][17].size: expected int, got str`.
    pub fn from_value(value: &Value) -> Result<Snapshot, SnapshotError> {
        Self::parse(value).map_err(ShapeErr::into_error)
    }

    /// Decodes a snapshot file's bytes (see [`decode_bytes`]) into the typed model.
    pub fn from_bytes(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
        Self::from_value(&decode_bytes(bytes)?)
    }

    fn parse(value: &Value) -> Shaped<Snapshot> {
        if value.as_list().is_some() {
            let segments = list_of(value, parse_segment)?;
            return Ok(Snapshot {
                segments,
                device_traces: Vec::new(),
                allocator_settings: None,
                external_annotations: None,
                extra: Vec::new(),
            });
        }
        if value.as_dict().is_none() {
            return Err(ShapeErr::expected(
                "a snapshot dict or a list of segments",
                value,
            ));
        }
        let mut segments = None;
        let mut device_traces = Vec::new();
        let mut allocator_settings = None;
        let mut external_annotations = None;
        let mut extra = Vec::new();
        for (key, v) in str_entries(value)? {
            match key {
                "segments" => segments = Some(field(key, v, |v| list_of(v, parse_segment))?),
                "device_traces" => {
                    device_traces =
                        field(key, v, |v| list_of(v, |t| list_of(t, parse_trace_entry)))?
                }
                "allocator_settings" if *v == Value::None => {}
                "allocator_settings" => allocator_settings = Some(field(key, v, parse_settings)?),
                "external_annotations" => {
                    external_annotations = Some(field(key, v, |v| Ok(as_list(v)?.to_vec()))?)
                }
                other => extra.push((other.to_string(), v.clone())),
            }
        }
        Ok(Snapshot {
            segments: segments.ok_or_else(|| missing("segments"))?,
            device_traces,
            allocator_settings,
            external_annotations,
            extra,
        })
    }

    /// The raw value `torch.cuda.memory._snapshot()` would return for this snapshot, keys in PyTorch's
    /// order, with `frames: []` on every segment, block and trace entry (see the module doc).
    /// `allocator_settings` and `external_annotations` are written when present.
    pub fn to_value(&self) -> Value {
        // one list shared by every `frames`, so the pickle writes it once and memo-references it
        let frames = Value::list(Vec::new());
        let mut top = vec![
            (
                Value::str("segments"),
                Value::list(self.segments.iter().map(|s| s.to_value(&frames)).collect()),
            ),
            (
                Value::str("device_traces"),
                Value::list(
                    self.device_traces
                        .iter()
                        .map(|t| Value::list(t.iter().map(|e| e.to_value(&frames)).collect()))
                        .collect(),
                ),
            ),
        ];
        if let Some(settings) = &self.allocator_settings {
            top.push((Value::str("allocator_settings"), settings.to_value()));
        }
        if let Some(annotations) = &self.external_annotations {
            top.push((
                Value::str("external_annotations"),
                Value::list(annotations.clone()),
            ));
        }
        push_extra(&mut top, &self.extra);
        Value::dict(top)
    }

    /// This snapshot as a protocol-4 pickle that `pickle.load`, `torch/cuda/_memory_viz.py` and
    /// `pytorch.org/memory_viz` read.
    pub fn to_pickle(&self) -> Vec<u8> {
        pickle::to_vec(&self.to_value())
    }
}

fn push_extra(entries: &mut Vec<(Value, Value)>, extra: &[(String, Value)]) {
    entries.extend(extra.iter().map(|(k, v)| (Value::str(k), v.clone())));
}

fn kv(key: &str, value: impl Into<Value>) -> (Value, Value) {
    (Value::str(key), value.into())
}

fn parse_segment(v: &Value) -> Shaped<Segment> {
    let mut device = 0;
    let mut address = None;
    let mut total_size = None;
    let (mut allocated_size, mut active_size, mut requested_size) = (None, None, None);
    let mut stream = 0;
    let mut segment_type = None;
    let mut segment_pool_id = (0, 0);
    let mut is_expandable = false;
    let mut blocks = None;
    let mut extra = Vec::new();
    for (key, v) in str_entries(v)? {
        match key {
            "device" => device = field(key, v, as_u32)?,
            "address" => address = Some(field(key, v, as_u64)?),
            "total_size" => total_size = Some(field(key, v, as_u64)?),
            "allocated_size" => allocated_size = Some(field(key, v, as_u64)?),
            "active_size" => active_size = Some(field(key, v, as_u64)?),
            "requested_size" => requested_size = Some(field(key, v, as_u64)?),
            "stream" => stream = field(key, v, as_u64)?,
            "segment_type" => {
                segment_type = Some(field(key, v, |v| match v.as_str() {
                    Some("large") => Ok(SegmentType::Large),
                    Some("small") => Ok(SegmentType::Small),
                    Some(other) => Err(ShapeErr::new(format!(
                        "expected 'large' or 'small', got '{other}'"
                    ))),
                    None => Err(ShapeErr::expected("str", v)),
                })?)
            }
            "segment_pool_id" => {
                segment_pool_id = field(key, v, |v| match as_list(v)? {
                    [a, b] => Ok((
                        as_u64(a).map_err(|e| e.index(0))?,
                        as_u64(b).map_err(|e| e.index(1))?,
                    )),
                    other => Err(ShapeErr::new(format!(
                        "expected a pair of ints, got {} items",
                        other.len()
                    ))),
                })?
            }
            "is_expandable" => is_expandable = field(key, v, as_bool)?,
            "blocks" => blocks = Some(field(key, v, |v| list_of(v, parse_block))?),
            "frames" => {}
            other => extra.push((other.to_string(), v.clone())),
        }
    }
    let address = address.ok_or_else(|| missing("address"))?;
    let total_size = total_size.ok_or_else(|| missing("total_size"))?;
    let blocks: Vec<(Block, bool)> = blocks.ok_or_else(|| missing("blocks"))?;
    // blocks without an address (old PyTorch) sit right after the previous block
    let mut next = address;
    let blocks: Vec<Block> = blocks
        .into_iter()
        .map(|(mut b, has_address)| {
            if !has_address {
                b.address = next;
            }
            next = b.address.saturating_add(b.size);
            b
        })
        .collect();
    let mut segment = Segment {
        device,
        address,
        total_size,
        allocated_size: 0,
        active_size: 0,
        requested_size: 0,
        stream,
        // §1.4: small-pool segments are kSmallBuffer = 2 MiB; large ones are bigger
        segment_type: segment_type.unwrap_or(if total_size <= 2 << 20 {
            SegmentType::Small
        } else {
            SegmentType::Large
        }),
        segment_pool_id,
        is_expandable,
        blocks,
        extra,
    };
    let sums = segment.sums_from_blocks();
    segment.allocated_size = allocated_size.unwrap_or(sums.allocated_size);
    segment.active_size = active_size.unwrap_or(sums.active_size);
    segment.requested_size = requested_size.unwrap_or(sums.requested_size);
    Ok(segment)
}

/// A block, and whether the file gave its address.
fn parse_block(v: &Value) -> Shaped<(Block, bool)> {
    let mut address = None;
    let mut size = None;
    let mut requested_size = None;
    let mut history_size = None;
    let mut state = None;
    let mut extra = Vec::new();
    for (key, v) in str_entries(v)? {
        match key {
            "address" => address = Some(field(key, v, as_u64)?),
            "size" => size = Some(field(key, v, as_u64)?),
            "requested_size" => requested_size = Some(field(key, v, as_u64)?),
            "state" => {
                state = Some(field(key, v, |v| {
                    let s = v.as_str().ok_or_else(|| ShapeErr::expected("str", v))?;
                    BlockState::from_name(s).ok_or_else(|| {
                        ShapeErr::new(format!(
                            "expected 'active_allocated', 'active_pending_free' or 'inactive', got '{s}'"
                        ))
                    })
                })?)
            }
            // legacy (PyTorch 1.x/2.0): per-block history; keep the first entry's real_size only
            "history" => {
                history_size = v
                    .as_sequence()
                    .and_then(|h| h.first())
                    .and_then(|h| h.get("real_size"))
                    .and_then(|s| as_u64(s).ok())
            }
            "frames" => {}
            other => extra.push((other.to_string(), v.clone())),
        }
    }
    let size = size.ok_or_else(|| missing("size"))?;
    let block = Block {
        address: address.unwrap_or(0),
        size,
        requested_size: requested_size.or(history_size).unwrap_or(size),
        state: state.ok_or_else(|| missing("state"))?,
        extra,
    };
    Ok((block, address.is_some()))
}

fn parse_trace_entry(v: &Value) -> Shaped<TraceEntry> {
    let mut action = None;
    let mut addr = None;
    let mut device_free = None;
    let mut size = None;
    let mut stream = 0;
    let mut time_us = None;
    let mut compile_context = None;
    let mut user_metadata = None;
    let mut extra = Vec::new();
    for (key, v) in str_entries(v)? {
        match key {
            "action" => action = Some(Action::from_name(&field(key, v, as_string)?)),
            "addr" => addr = Some(field(key, v, as_u64)?),
            "device_free" => device_free = Some(field(key, v, as_u64)?),
            "size" => size = Some(field(key, v, as_u64)?),
            "stream" => stream = field(key, v, as_u64)?,
            "time_us" => time_us = Some(field(key, v, as_i64)?),
            "compile_context" => compile_context = Some(field(key, v, as_string)?),
            "user_metadata" => user_metadata = Some(field(key, v, as_string)?),
            "frames" => {}
            other => extra.push((other.to_string(), v.clone())),
        }
    }
    let action = action.ok_or_else(|| missing("action"))?;
    let addr = match (&action, addr, device_free) {
        (Action::Oom, _, Some(free)) => free,
        (_, Some(addr), _) => addr,
        (_, None, Some(free)) => free,
        (Action::Oom, None, None) => return Err(missing("device_free")),
        (_, None, None) => return Err(missing("addr")),
    };
    Ok(TraceEntry {
        action,
        addr,
        size: size.ok_or_else(|| missing("size"))?,
        stream,
        time_us,
        compile_context,
        user_metadata,
        extra,
    })
}

fn parse_settings(v: &Value) -> Shaped<AllocatorSettings> {
    let mut s = AllocatorSettings::default();
    for (key, v) in str_entries(v)? {
        match key {
            "PYTORCH_CUDA_ALLOC_CONF" => {
                s.pytorch_cuda_alloc_conf = Some(field(key, v, as_string)?)
            }
            "max_split_size" => s.max_split_size = Some(field(key, v, as_i64)?),
            "garbage_collection_threshold" => {
                s.garbage_collection_threshold = Some(field(key, v, as_f64)?)
            }
            "expandable_segments" => s.expandable_segments = Some(field(key, v, as_bool)?),
            "pinned_num_register_threads" => {
                s.pinned_num_register_threads = Some(field(key, v, as_i64)?)
            }
            "release_lock_on_cudamalloc" => {
                s.release_lock_on_cudamalloc = Some(field(key, v, as_bool)?)
            }
            "pinned_use_cuda_host_register" => {
                s.pinned_use_cuda_host_register = Some(field(key, v, as_bool)?)
            }
            "graph_capture_record_stream_reuse" => {
                s.graph_capture_record_stream_reuse = Some(field(key, v, as_bool)?)
            }
            "roundup_power2_divisions" => {
                s.roundup_power2_divisions = Some(field(key, v, |v| {
                    str_entries(v)?
                        .map(|(k, d)| {
                            let start = k.parse::<u64>().map_err(|_| {
                                ShapeErr::new(format!("expected a size in MiB as key, got '{k}'"))
                            })?;
                            Ok((start, as_u64(d).map_err(|e| e.key(k))?))
                        })
                        .collect()
                })?)
            }
            other => s.extra.push((other.to_string(), v.clone())),
        }
    }
    Ok(s)
}

// ------------------------------------------------------------------------------------------------
// Snapshot -> Value

impl Segment {
    fn to_value(&self, frames: &Value) -> Value {
        let blocks = self.blocks.iter().map(|b| b.to_value(frames)).collect();
        let mut entries = vec![
            kv("device", i64::from(self.device)),
            kv("address", self.address),
            kv("total_size", self.total_size),
            kv("allocated_size", self.allocated_size),
            kv("active_size", self.active_size),
            kv("requested_size", self.requested_size),
            kv("stream", self.stream),
            kv("segment_type", self.segment_type.as_str()),
            kv(
                "segment_pool_id",
                Value::tuple(vec![
                    self.segment_pool_id.0.into(),
                    self.segment_pool_id.1.into(),
                ]),
            ),
            kv("is_expandable", self.is_expandable),
            kv("frames", frames.clone()),
            kv("blocks", Value::list(blocks)),
        ];
        push_extra(&mut entries, &self.extra);
        Value::dict(entries)
    }
}

impl Block {
    fn to_value(&self, frames: &Value) -> Value {
        let mut entries = vec![
            kv("address", self.address),
            kv("size", self.size),
            kv("requested_size", self.requested_size),
            kv("state", self.state.as_str()),
            kv("frames", frames.clone()),
        ];
        push_extra(&mut entries, &self.extra);
        Value::dict(entries)
    }
}

impl TraceEntry {
    fn to_value(&self, frames: &Value) -> Value {
        let addr_key = if self.action == Action::Oom {
            "device_free"
        } else {
            "addr"
        };
        let mut entries = vec![
            kv("action", self.action.as_str()),
            kv(addr_key, self.addr),
            kv("size", self.size),
            kv("stream", self.stream),
        ];
        if let Some(t) = self.time_us {
            entries.push(kv("time_us", t));
        }
        if let Some(c) = &self.compile_context {
            entries.push(kv("compile_context", c.as_str()));
        }
        if let Some(m) = &self.user_metadata {
            entries.push(kv("user_metadata", m.as_str()));
        }
        entries.push(kv("frames", frames.clone()));
        push_extra(&mut entries, &self.extra);
        Value::dict(entries)
    }
}

impl AllocatorSettings {
    /// The raw `allocator_settings` dict, keys in PyTorch's order, absent fields left out.
    pub fn to_value(&self) -> Value {
        let mut entries = Vec::new();
        let s = self;
        if let Some(v) = &s.pytorch_cuda_alloc_conf {
            entries.push(kv("PYTORCH_CUDA_ALLOC_CONF", v.as_str()));
        }
        if let Some(v) = s.max_split_size {
            entries.push(kv("max_split_size", v));
        }
        if let Some(v) = s.garbage_collection_threshold {
            entries.push(kv("garbage_collection_threshold", v));
        }
        if let Some(v) = s.expandable_segments {
            entries.push(kv("expandable_segments", v));
        }
        if let Some(v) = s.pinned_num_register_threads {
            entries.push(kv("pinned_num_register_threads", v));
        }
        if let Some(v) = s.release_lock_on_cudamalloc {
            entries.push(kv("release_lock_on_cudamalloc", v));
        }
        if let Some(v) = s.pinned_use_cuda_host_register {
            entries.push(kv("pinned_use_cuda_host_register", v));
        }
        if let Some(v) = s.graph_capture_record_stream_reuse {
            entries.push(kv("graph_capture_record_stream_reuse", v));
        }
        if let Some(divs) = &s.roundup_power2_divisions {
            let map = divs
                .iter()
                .map(|(start, d)| (Value::from(start.to_string()), Value::from(*d)))
                .collect();
            entries.push(kv("roundup_power2_divisions", Value::dict(map)));
        }
        push_extra(&mut entries, &s.extra);
        Value::dict(entries)
    }
}
