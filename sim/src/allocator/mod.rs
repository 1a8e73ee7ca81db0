//! The `Allocator` trait and the allocator models behind it.
//!
//! An allocator model receives the `malloc`/`free`/`record_stream`/`empty_cache` calls a replay makes, keeps
//! its own view of device memory and its statistics in PyTorch's vocabulary, and answers `malloc` with a
//! block or an out-of-memory error carrying PyTorch's message. Models are deterministic: the same calls with
//! the same settings give the same bytes, every time.

pub mod bfc;
pub mod caching;
pub mod cuda_async;
pub mod cuda_malloc;

use vramsim_traces::{InitialSegment, StreamId};

use crate::device::Device;
use crate::rounding::PoolKind;
use crate::stats::MemoryStats;
use crate::timeline::Timeline;

/// A live block handed out by an allocator; valid until it is freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockRef(pub u32);

/// Why a `malloc` failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutOfMemory {
    /// PyTorch's `OutOfMemoryError` text.
    pub message: String,
    /// The requested (unrounded) size.
    pub requested: u64,
    /// The size the allocator tried to obtain from the device (§1.4), 0 for the "more than 1EB" case.
    pub alloc_size: u64,
    /// `cudaMemGetInfo` free bytes at the failure.
    pub device_free: u64,
}

/// One entry of the allocator's history, as PyTorch's `_record_memory_history` records it (§10.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    /// What happened.
    pub action: Action,
    /// Block or segment address (for `Oom`, the device's free bytes).
    pub addr: u64,
    /// Size as §10.2 defines it per action (requested size for block actions).
    pub size: u64,
    /// The stream of the block or segment.
    pub stream: StreamId,
    /// Host time in nanoseconds.
    pub time_ns: u64,
}

/// The trace actions of §10.2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A block handed out.
    Alloc,
    /// The user freed a block.
    FreeRequested,
    /// The block returned to the cache.
    FreeCompleted,
    /// `cudaMalloc` of a segment.
    SegmentAlloc,
    /// `cudaFree` of a segment.
    SegmentFree,
    /// Pages of an expandable segment mapped.
    SegmentMap,
    /// Pages of an expandable segment unmapped.
    SegmentUnmap,
    /// An out-of-memory error.
    Oom,
}

impl Action {
    /// The action string of PyTorch snapshots (`free_requested`, `segment_map`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
        }
    }
}

/// The state of a block in a snapshot (§10.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// Handed out.
    ActiveAllocated,
    /// Freed by the user, waiting for stream events.
    ActivePendingFree,
    /// Cached.
    Inactive,
}

impl BlockState {
    /// The state string of PyTorch snapshots.
    pub fn name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// One block of a segment in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Device address.
    pub address: u64,
    /// Block size (rounded).
    pub size: u64,
    /// Requested size of an active block (0 for inactive ones).
    pub requested_size: u64,
    /// Its state.
    pub state: BlockState,
}

/// One segment (a cudaMalloc, or one contiguous mapped range of an expandable segment) in a snapshot,
/// with the fields of `torch.cuda.memory_snapshot()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Device address of the first byte.
    pub address: u64,
    /// Bytes reserved from the device.
    pub total_size: u64,
    /// Σ size of allocated blocks.
    pub allocated_size: u64,
    /// Σ size of active blocks.
    pub active_size: u64,
    /// Σ requested size of active blocks.
    pub requested_size: u64,
    /// Allocation stream.
    pub stream: StreamId,
    /// Small or large pool.
    pub pool: PoolKind,
    /// Part of an expandable segment.
    pub is_expandable: bool,
    /// Blocks in address order.
    pub blocks: Vec<BlockInfo>,
}

/// Why a segment could not be adopted ([`Allocator::adopt_segment`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdoptError {
    /// The segment overlaps one the allocator already holds.
    #[error("the segment at {addr:#x} ({size} bytes) overlaps the one at {other:#x} ({other_size} bytes)")]
    Overlap {
        /// The segment's address.
        addr: u64,
        /// Its size.
        size: u64,
        /// The address of the segment it overlaps.
        other: u64,
        /// That segment's size.
        other_size: u64,
    },
    /// The device has not that much free memory.
    #[error("the segment at {addr:#x} needs {needed} bytes but the device has {free} bytes free: give a larger capacity")]
    DoesNotFit {
        /// The segment's address.
        addr: u64,
        /// The bytes it needs.
        needed: u64,
        /// The device's free bytes.
        free: u64,
    },
    /// An expandable range that does not lie on the page grid of its stream's reservation (§7.1).
    #[error("the expandable range at {addr:#x} ({size} bytes) is not on the {page}-byte page grid of the reservation at {base:#x}; declare the ranges of one stream and pool in address order")]
    NotOnPageGrid {
        /// The range's address.
        addr: u64,
        /// Its size.
        size: u64,
        /// The page size of its pool.
        page: u64,
        /// The reservation's start.
        base: u64,
    },
    /// The allocator model cannot start from a given state.
    #[error("the {model} allocator model cannot start from declared segments")]
    Unsupported {
        /// The model's name.
        model: &'static str,
    },
}

/// A simulated device allocator.
pub trait Allocator {
    /// `malloc(size, stream)`: a block of at least `size` bytes (size > 0; the engine answers size 0 with a
    /// null pointer as PyTorch does), or PyTorch's out-of-memory error. May advance the host clock when the
    /// allocator waits on CUDA events (§3 step 4e).
    fn malloc(
        &mut self,
        size: u64,
        stream: StreamId,
        timeline: &mut Timeline,
    ) -> Result<BlockRef, OutOfMemory>;

    /// `free(block)`: immediate, or deferred until the streams recorded on the block pass this point.
    fn free(&mut self, block: BlockRef, timeline: &mut Timeline);

    /// `record_stream(block, stream)`.
    fn record_stream(&mut self, block: BlockRef, stream: StreamId);

    /// `empty_cache()`: waits for pending frees and returns every whole free segment to the device.
    fn empty_cache(&mut self, timeline: &mut Timeline);

    /// Takes over a segment that exists before the first event (a trace's `segment` op: the state a
    /// PyTorch snapshot's history starts from), with its live blocks allocated; returns the blocks, in the
    /// order given. Records no history. The default refuses ([`AdoptError::Unsupported`]).
    fn adopt_segment(&mut self, segment: &InitialSegment) -> Result<Vec<BlockRef>, AdoptError> {
        let _ = segment;
        Err(AdoptError::Unsupported { model: "this" })
    }

    /// Statistics in `torch.cuda.memory_stats()` form.
    fn stats(&self) -> &MemoryStats;

    /// `reset_peak_memory_stats()`.
    fn reset_peak_stats(&mut self);

    /// The device this allocator lives on.
    fn device(&self) -> &Device;

    /// Bytes this process holds on the device: reserved memory plus the CUDA context.
    fn device_used(&self) -> u64 {
        self.stats().reserved_bytes.all.current as u64 + self.device().context_bytes
    }

    /// The segments and their blocks, sorted by address (`torch.cuda.memory_snapshot()`).
    fn segments(&self) -> Vec<SegmentInfo>;

    /// Starts or stops recording history (`_record_memory_history`).
    fn set_record_history(&mut self, enabled: bool);

    /// Takes the history recorded since the last call.
    fn take_history(&mut self) -> Vec<HistoryEntry>;

    /// Appends to `key` a canonical description of everything that decides what the allocator does
    /// next (segments and blocks named by address, with streams, offsets, sizes and states; free pools;
    /// the counters its decisions read), so that two states with equal keys answer the same calls the
    /// same way. Returns false (the key is then meaningless) when the model cannot describe its state:
    /// a replay then never skips repetitions ([`crate::engine::Replay::apply_repeated`]).
    fn steady_state_key(&self, key: &mut Vec<u64>) -> bool {
        let _ = key;
        false
    }

    /// The device address of a live block, for [`Allocator::steady_state_key`]'s naming.
    fn block_address(&self, block: BlockRef) -> Option<u64> {
        let _ = block;
        None
    }

    /// The counters that repetitions move (statistics, GC call counts).
    fn counters(&self) -> Counters {
        Counters {
            stats: self.stats().clone(),
            gc_calls: [0; 2],
        }
    }

    /// Moves the counters on by `n` repetitions of what changed them since `before` (the same state
    /// key then and now): what `n` more identical repetitions would leave. Only called where
    /// [`Allocator::steady_state_key`] describes the state.
    fn carry_repetitions(&mut self, before: &Counters, n: u64) {
        let _ = (before, n);
    }

    /// A copy of the allocator in its present state, which then goes on on its own (a replay that
    /// continues in several ways from one point: [`crate::engine::Replay::apply_repeated_each`]), or
    /// `None` where the model cannot be copied.
    fn fork(&self) -> Option<Box<dyn Allocator>> {
        None
    }
}

/// What an allocator's counters stood at when a repetition began ([`Allocator::counters`]).
#[derive(Clone, Debug)]
pub struct Counters {
    /// The statistics.
    pub stats: MemoryStats,
    /// `get_free_blocks_call_count` of the small and the large pool (the GC's clock, §5.4).
    pub gc_calls: [i64; 2],
}

impl<T: Allocator + ?Sized> Allocator for Box<T> {
    fn malloc(
        &mut self,
        size: u64,
        stream: StreamId,
        timeline: &mut Timeline,
    ) -> Result<BlockRef, OutOfMemory> {
        (**self).malloc(size, stream, timeline)
    }
    fn free(&mut self, block: BlockRef, timeline: &mut Timeline) {
        (**self).free(block, timeline)
    }
    fn record_stream(&mut self, block: BlockRef, stream: StreamId) {
        (**self).record_stream(block, stream)
    }
    fn empty_cache(&mut self, timeline: &mut Timeline) {
        (**self).empty_cache(timeline)
    }
    fn adopt_segment(&mut self, segment: &InitialSegment) -> Result<Vec<BlockRef>, AdoptError> {
        (**self).adopt_segment(segment)
    }
    fn stats(&self) -> &MemoryStats {
        (**self).stats()
    }
    fn reset_peak_stats(&mut self) {
        (**self).reset_peak_stats()
    }
    fn device(&self) -> &Device {
        (**self).device()
    }
    fn device_used(&self) -> u64 {
        (**self).device_used()
    }
    fn segments(&self) -> Vec<SegmentInfo> {
        (**self).segments()
    }
    fn set_record_history(&mut self, enabled: bool) {
        (**self).set_record_history(enabled)
    }
    fn take_history(&mut self) -> Vec<HistoryEntry> {
        (**self).take_history()
    }
    fn steady_state_key(&self, key: &mut Vec<u64>) -> bool {
        (**self).steady_state_key(key)
    }
    fn block_address(&self, block: BlockRef) -> Option<u64> {
        (**self).block_address(block)
    }
    fn counters(&self) -> Counters {
        (**self).counters()
    }
    fn carry_repetitions(&mut self, before: &Counters, n: u64) {
        (**self).carry_repetitions(before, n)
    }
    fn fork(&self) -> Option<Box<dyn Allocator>> {
        (**self).fork()
    }
}
