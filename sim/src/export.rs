//! Export: a replay's final allocator state and recorded history as the PyTorch memory snapshot
//! `torch.cuda.memory._snapshot()` would have returned on a real GPU (pytorch_allocator.md §10.2), so
//! that vramsim's predictions open in PyTorch's own tools: `torch/cuda/_memory_viz.py`
//! (`stats`, `trace`, `trace_plot`, `segment_plot`) and `pytorch.org/memory_viz`.
//!
//! ```
//! use vramsim_sim::allocator::{caching::CachingAllocator, Allocator};
//! use vramsim_sim::export::{snapshot_of, ExportOptions};
//! use vramsim_sim::{config::AllocatorConfig, device::Device, timeline::Timeline};
//!
//! let config = AllocatorConfig::default();
//! let mut alloc = CachingAllocator::new(config.clone(), Device::with_capacity(80 << 30));
//! alloc.set_record_history(true); // before the first malloc, like _record_memory_history()
//! let _block = alloc.malloc(8 << 20, 0, &mut Timeline::new()).unwrap();
//! let snapshot = snapshot_of(&mut alloc, &config, &ExportOptions::default());
//! assert_eq!(snapshot.segments[0].total_size, 20 << 20);
//! assert_eq!(snapshot.device_traces[0].len(), 2); // segment_alloc, alloc
//! // what torch.cuda.memory._dump_snapshot() writes; protocol 4 with only the opcodes the small
//! // unpickler of pytorch.org/memory_viz (MemoryViz.js) reads
//! let pickle: Vec<u8> = snapshot.to_pickle();
//! # assert!(!pickle.is_empty());
//! ```
//!
//! # What goes where
//!
//! - `segments`: [`Allocator::segments`], one entry per segment (per contiguous mapped range for
//!   expandable segments), sorted by address, on device 0, in the default pool `(0, 0)`, with
//!   `frames: []` (vramsim has no stacks; the viewer shows "block was allocated before
//!   _record_history was enabled"). Block states and the per-segment sums are the allocator's own.
//!   One difference from a GPU: an `inactive` block's `requested_size` is 0, where PyTorch leaves the
//!   stale size of the block's last allocation (no PyTorch tool reads it for inactive blocks).
//! - `device_traces`: one list, device 0's, holding every [`HistoryEntry`] in order, as the trace
//!   ring buffer of `_record_memory_history(max_entries=sys.maxsize)` enabled before the replay's first
//!   event. Fields as PyTorch 2.9+ writes them: `action`, `addr` (`device_free` for `oom`), `size`,
//!   `stream`, `time_us`, `compile_context: "N/A"`, `user_metadata: ""`, `frames: []`. No `snapshot`
//!   entry: PyTorch's `snapshot()` copies the trace before recording its own entry (§10.2).
//! - `allocator_settings`: the §10.2 keys, in PyTorch's order, from the [`AllocatorConfig`]
//!   ([`allocator_settings`]).
//! - `external_annotations`: `[]` (vramsim records no profiler ranges).
//!
//! # Time
//!
//! `time_us` is [`ExportOptions::time_base_us`] plus the simulated host time of the entry in whole
//! microseconds (`time_ns / 1000`, truncated). The default base is 0, so exported times are
//! microseconds since the replay started: deterministic (the same trace and settings give the same
//! bytes) and honest (the simulator has no wall clock). Real snapshots count from the Unix epoch;
//! neither `_memory_viz.py` nor `MemoryViz.js` reads `time_us`, and importers use differences, so a
//! base only matters when lining an export up with a real run — pass that run's first `time_us`.
//!
//! What it deliberately does not do: invent stacks, CUDA-graph pools or devices other than 0. The
//! GPU itself (name, capacity, CUDA context) has no place in a PyTorch snapshot and is not written.

use vramsim_traces::snapshot::{
    Action as SnapshotAction, AllocatorSettings, Block, BlockState as SnapshotBlockState, Segment,
    SegmentType, Snapshot, TraceEntry,
};

use crate::allocator::{Action, Allocator, BlockInfo, BlockState, HistoryEntry, SegmentInfo};
use crate::config::AllocatorConfig;
use crate::rounding::PoolKind;

/// `compile_context` of an entry recorded outside `torch.compile` (PyTorch 2.5+).
pub const NO_COMPILE_CONTEXT: &str = "N/A";

/// Choices the snapshot format leaves open.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportOptions {
    /// Added to every entry's simulated host time in µs to make `time_us` (default 0: µs since the
    /// replay started; see the module doc).
    pub time_base_us: i64,
}

/// The snapshot of an allocator now: its segments and the history it recorded since the last
/// [`Allocator::take_history`] (taken, so the allocator's buffer is left empty). `config` is the
/// settings the allocator was built with, written as `allocator_settings`.
///
/// Record the history from the start with [`Allocator::set_record_history`]`(true)` before the first
/// `malloc`; otherwise the trace is empty and only `segments` describes the state.
pub fn snapshot_of<A: Allocator + ?Sized>(
    allocator: &mut A,
    config: &AllocatorConfig,
    options: &ExportOptions,
) -> Snapshot {
    let history = allocator.take_history();
    snapshot(&allocator.segments(), &history, config, options)
}

/// The snapshot made of these segments (as [`Allocator::segments`] gives them), this history (as
/// [`Allocator::take_history`] gives it, oldest first) and these settings.
pub fn snapshot(
    segments: &[SegmentInfo],
    history: &[HistoryEntry],
    config: &AllocatorConfig,
    options: &ExportOptions,
) -> Snapshot {
    Snapshot {
        segments: segments.iter().map(segment).collect(),
        device_traces: vec![history.iter().map(|e| trace_entry(e, options)).collect()],
        allocator_settings: Some(allocator_settings(config)),
        external_annotations: Some(Vec::new()),
        extra: Vec::new(),
    }
}

/// One segment of `torch.cuda.memory._snapshot()["segments"]`, on device 0 in the default pool.
pub fn segment(info: &SegmentInfo) -> Segment {
    Segment {
        device: 0,
        address: info.address,
        total_size: info.total_size,
        allocated_size: info.allocated_size,
        active_size: info.active_size,
        requested_size: info.requested_size,
        stream: info.stream,
        // §10.2 segment_type: "large" unless the segment belongs to the small pool.
        segment_type: match info.pool {
            PoolKind::Small => SegmentType::Small,
            PoolKind::Large => SegmentType::Large,
        },
        // §10.2 segment_pool_id: (0, 0) is the default pool (no CUDA graphs or MemPools are modelled).
        segment_pool_id: (0, 0),
        is_expandable: info.is_expandable,
        blocks: info.blocks.iter().map(block).collect(),
        extra: Vec::new(),
    }
}

/// One block of a snapshot segment.
pub fn block(info: &BlockInfo) -> Block {
    Block {
        address: info.address,
        size: info.size,
        requested_size: info.requested_size,
        state: match info.state {
            BlockState::ActiveAllocated => SnapshotBlockState::ActiveAllocated,
            BlockState::ActivePendingFree => SnapshotBlockState::ActivePendingFree,
            BlockState::Inactive => SnapshotBlockState::Inactive,
        },
        extra: Vec::new(),
    }
}

/// One entry of `device_traces[0]`. For `oom` the entry's `addr` holds the device's free bytes, which
/// the pickle writes under the key `device_free` (§10.2).
pub fn trace_entry(entry: &HistoryEntry, options: &ExportOptions) -> TraceEntry {
    TraceEntry {
        action: action(entry.action),
        addr: entry.addr,
        size: entry.size,
        stream: entry.stream,
        time_us: Some(
            options
                .time_base_us
                .saturating_add((entry.time_ns / 1000) as i64),
        ),
        compile_context: Some(NO_COMPILE_CONTEXT.to_string()),
        user_metadata: Some(String::new()),
        extra: Vec::new(),
    }
}

/// The snapshot action for an allocator history action.
pub fn action(action: Action) -> SnapshotAction {
    match action {
        Action::Alloc => SnapshotAction::Alloc,
        Action::FreeRequested => SnapshotAction::FreeRequested,
        Action::FreeCompleted => SnapshotAction::FreeCompleted,
        Action::SegmentAlloc => SnapshotAction::SegmentAlloc,
        Action::SegmentFree => SnapshotAction::SegmentFree,
        Action::SegmentMap => SnapshotAction::SegmentMap,
        Action::SegmentUnmap => SnapshotAction::SegmentUnmap,
        Action::Oom => SnapshotAction::Oom,
    }
}

/// `allocator_settings` as PyTorch 2.9+ writes it for these settings (§10.2, key order of
/// `torch/csrc/cuda/Module.cpp`): the settings string, `max_split_size` as int64 (unset, i.e.
/// SIZE_MAX, shows as −1), `garbage_collection_threshold`, `expandable_segments`,
/// `pinned_num_register_threads`, `release_lock_on_cudamalloc`, `pinned_use_cuda_host_register`,
/// `graph_capture_record_stream_reuse`, and `roundup_power2_divisions` keyed by the start of each
/// power-of-two interval in MiB (`"1"`, `"2"`, `"4"`, ..., `"32768"`).
pub fn allocator_settings(config: &AllocatorConfig) -> AllocatorSettings {
    AllocatorSettings {
        pytorch_cuda_alloc_conf: Some(config.settings.clone()),
        // int64_t(max_split_size): SIZE_MAX wraps to −1.
        max_split_size: Some(config.max_split_size as i64),
        garbage_collection_threshold: Some(config.garbage_collection_threshold),
        expandable_segments: Some(config.expandable_segments),
        pinned_num_register_threads: Some(config.pinned_num_register_threads as i64),
        release_lock_on_cudamalloc: Some(config.release_lock_on_cudamalloc),
        pinned_use_cuda_host_register: Some(config.pinned_use_cuda_host_register),
        graph_capture_record_stream_reuse: Some(config.graph_capture_record_stream_reuse),
        roundup_power2_divisions: Some(
            config
                .roundup_power2_divisions
                .iter()
                .enumerate()
                .map(|(k, &divisions)| (1u64 << k, divisions))
                .collect(),
        ),
        extra: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_settings_read_as_pytorch_writes_them() {
        let s = allocator_settings(&AllocatorConfig::default());
        assert_eq!(s.pytorch_cuda_alloc_conf.as_deref(), Some(""));
        assert_eq!(s.max_split_size, Some(-1));
        assert_eq!(s.garbage_collection_threshold, Some(0.0));
        assert_eq!(s.expandable_segments, Some(false));
        assert_eq!(s.pinned_num_register_threads, Some(1));
        let keys: Vec<u64> = s
            .roundup_power2_divisions
            .unwrap()
            .iter()
            .map(|&(k, d)| {
                assert_eq!(d, 0);
                k
            })
            .collect();
        assert_eq!(
            keys,
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
        );
    }

    #[test]
    fn oom_entries_keep_device_free_in_addr_and_times_are_microseconds() {
        let entry = HistoryEntry {
            action: Action::Oom,
            addr: 123 << 20,
            size: 40 << 20,
            stream: 7,
            time_ns: 2_999_999,
        };
        let e = trace_entry(&entry, &ExportOptions { time_base_us: 10 });
        assert_eq!(e.action, SnapshotAction::Oom);
        assert_eq!((e.addr, e.size, e.stream), (123 << 20, 40 << 20, 7));
        assert_eq!(e.time_us, Some(10 + 2_999));
    }
}
