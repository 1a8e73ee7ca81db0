//! PyTorch's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`, native backend), byte for byte.
//!
//! # How it works
//!
//! Memory is obtained from the device in *segments* (one `cudaMalloc` each) and handed out in *blocks*
//! carved from them. A freed block is not returned to the device: it is *cached* in a pool and reused by a
//! later request. Segments go back to the device only when the cache is flushed (`empty_cache`, or the last
//! resort of a failing `malloc`), when the oversize release path or the garbage collector picks them, and
//! only when no block of theirs is in use.
//!
//! *Rounding and pools (§1).* A request is rounded up to a multiple of 512 bytes (or to a power-of-two
//! division with `roundup_power2_divisions`). Rounded sizes up to 1 MiB are *small* and are served from 2 MiB
//! segments of the small pool; larger ones come from the large pool, whose new segments are 20 MiB
//! (`large_segment_size`) for requests under 10 MiB and the request rounded up to 2 MiB otherwise.
//!
//! *Streams (§2.3).* Every block belongs to the stream it was allocated on, and a cached block only serves
//! requests of that stream: each pool is ordered by (stream, size, address), and the search for a request is
//! a `lower_bound` on (stream, size) — the smallest cached block of the stream that is big enough, the lowest
//! address among equals. A block used on other streams (`record_stream`) is only cached once CUDA events
//! recorded on those streams at free time have fired; until then it stays *active* (§4.1, §4.3).
//!
//! *Splitting (§3.2) and merging (§4.2).* A block bigger than the request is split, the front handed out and
//! the tail cached, when the tail is worth keeping: in the small pool if at least 512 bytes remain, in the
//! large pool if more than 1 MiB remains and the request is below `max_split_size`. A freed block merges with
//! free neighbours of its segment, so a segment whose blocks are all free becomes one block again.
//!
//! *Oversize blocks (§3.1).* With `max_split_size` set, blocks of at least that size are never split and only
//! serve requests of at least that size that they exceed by less than `max_non_split_rounding_size`.
//!
//! *When the cache misses (§3 step 4).* In order: the garbage collector frees the oldest whole cached
//! segments if a memory fraction and a GC threshold are set (§5.4); a new segment is allocated, within the
//! memory fraction and the device's free memory (§3.3); failing that, cached oversize segments of the stream
//! are freed until enough is released (§5.2); failing that, the allocator waits for every deferred free and
//! frees every whole cached segment (§5.3) and retries once. If that fails too, it raises PyTorch's
//! out-of-memory error (§6).
//!
//! *Expandable segments (§7).* With `expandable_segments:True` a stream's pool grows one huge reserved
//! virtual range page by page (2 MiB pages small, `large_segment_size` pages large) instead of making new
//! segments; flushing the cache unmaps the whole free pages. See [`expandable`].
//!
//! # Code map
//! - `block.rs` — `Block` and the arena that owns all blocks (indices instead of pointers).
//! - `pool.rs` — `BlockPool`: the free blocks of a pool in (stream, size, address) order.
//! - `sorted.rs` — `SortedSet`: the ordered map behind the pools (chunked sorted arrays).
//! - `events.rs` — `stream_uses` and the per-stream FIFOs of deferred frees.
//! - `expandable.rs` — expandable segments: finding, mapping and unmapping pages.
//! - `release.rs` — giving memory back: `release_block`, `release_available_cached_blocks`,
//!   `release_cached_blocks`, the garbage collector.
//! - `snapshot.rs` — `segments()` (`torch.cuda.memory_snapshot()`).
//! - `invariants.rs` — `check_snapshot`: the §8.4 consistency checks between stats and snapshot.
//! - `address_space.rs` — the simulated virtual address space (and the address hints of recorded runs).
//! - `adopt.rs` — starting from a recorded state: segments that exist before the first event.
//! - `steady.rs` — the state key and counters of a replay's steady-state check (skipped repetitions).
//! - this file — `malloc`, `free`, `record_stream` and the block bookkeeping they share.
//!
//! Version followed: the NEW behaviour (≈ PyTorch 2.9 / main, late 2025) wherever versions differ, each place
//! marked "NEW" in a comment. CUDA graphs, MemPools and the free-memory callbacks are not modelled.
//!
//! *Invariants:* deterministic (same calls, same settings → same addresses, stats and history); `malloc` and
//! `free` allocate nothing in steady state and format no strings except for an OOM.

pub(crate) mod address_space;
mod adopt;
mod block;
mod events;
pub mod expandable;
pub mod invariants;
mod pool;
mod release;
mod snapshot;
mod sorted;
mod steady;

use vramsim_traces::StreamId;

use vramsim_traces::InitialSegment;

use crate::allocator::{
    Action, AdoptError, Allocator, BlockRef, Counters, HistoryEntry, OutOfMemory, SegmentInfo,
};
use crate::config::AllocatorConfig;
use crate::device::Device;
use crate::oom::{out_of_memory_message, OomFacts, MORE_THAN_1EB_MESSAGE};
use crate::rounding::{
    get_allocation_size, round_size, PoolKind, MAX_REQUEST, MIN_BLOCK_SIZE, SMALL_SIZE,
};
use crate::stats::MemoryStats;
use crate::timeline::Timeline;

use address_space::AddressSpace;
use block::{Block, BlockArena, NIL};
use events::{EventQueues, StreamUses};
use expandable::ExpandableSegments;
use pool::BlockPool;

pub use invariants::check_snapshot;

/// PyTorch's CUDA caching allocator for one device (`DeviceCachingAllocator`).
///
/// ```
/// use vramsim_sim::allocator::{caching::CachingAllocator, Allocator};
/// use vramsim_sim::{config::AllocatorConfig, device::Device, timeline::Timeline};
///
/// let mut alloc = CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(80 << 30));
/// let mut timeline = Timeline::new();
/// let block = alloc.malloc(3 << 20, 0, &mut timeline).unwrap();
/// assert_eq!(alloc.stats().reserved_bytes.all.current, 20 << 20); // a 20 MiB segment, split
/// alloc.free(block, &mut timeline);
/// alloc.empty_cache(&mut timeline);
/// assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
/// ```
#[derive(Clone, Debug)]
pub struct CachingAllocator {
    config: AllocatorConfig,
    device: Device,
    stats: MemoryStats,
    /// Every block (allocated, cached, pending or unmapped).
    blocks: BlockArena,
    /// `small_blocks`, `large_blocks` (index: [`pool_index`]).
    pools: [BlockPool; 2],
    /// `cuda_events`.
    events: EventQueues,
    /// `stream_uses` of blocks.
    uses: StreamUses,
    /// `expandable_segments_`.
    segments: ExpandableSegments,
    address_space: AddressSpace,
    /// `total_allocated_memory`: bytes obtained from the device (segments + mapped pages).
    total_allocated_memory: u64,
    /// `allowed_memory_maximum`: NEW `optional<size_t>`, set iff the memory fraction is below 1.
    allowed_memory_maximum: Option<u64>,
    record_history: bool,
    history: Vec<HistoryEntry>,
    /// Reusable buffers for the release paths.
    scratch: Vec<u32>,
    scratch2: Vec<u32>,
}

/// Index of a pool in `CachingAllocator::pools`.
#[inline]
fn pool_index(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

impl CachingAllocator {
    /// A fresh allocator with these settings on this device. A `per_process_memory_fraction` in the settings
    /// is applied as PyTorch does at construction (NEW, §12.3).
    pub fn new(config: AllocatorConfig, device: Device) -> Self {
        let stats = MemoryStats {
            // §8.2 max_split_size: the setting at construction, SIZE_MAX shows as −1.
            max_split_size: config.max_split_size as i64,
            ..MemoryStats::default()
        };
        let fraction = config.per_process_memory_fraction;
        let mut allocator = CachingAllocator {
            config,
            device,
            stats,
            blocks: BlockArena::default(),
            pools: [BlockPool::new(), BlockPool::new()],
            events: EventQueues::default(),
            uses: StreamUses::default(),
            segments: ExpandableSegments::default(),
            address_space: AddressSpace::default(),
            total_allocated_memory: 0,
            allowed_memory_maximum: None,
            record_history: false,
            history: Vec::new(),
            scratch: Vec::new(),
            scratch2: Vec::new(),
        };
        if let Some(fraction) = fraction {
            allocator.set_memory_fraction(fraction);
        }
        allocator
    }

    /// The settings in force.
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// `torch.cuda.memory._set_allocator_settings`: replaces the settings at run time (e.g. toggling
    /// `expandable_segments`). As in PyTorch, the memory fraction and `memory_stats()["max_split_size"]` keep
    /// the values they got at construction; a `per_process_memory_fraction` in `config` is ignored.
    pub fn set_allocator_settings(&mut self, config: AllocatorConfig) {
        self.config = config;
    }

    /// `torch.cuda.set_per_process_memory_fraction(fraction)` (NEW semantics): a fraction below 1 limits the
    /// bytes obtained from the device to `size_t(fraction × total_memory)`; 1 removes the limit.
    ///
    /// # Panics
    /// If `fraction` is not in [0, 1] ("invalid fraction", as PyTorch's `TORCH_CHECK`).
    pub fn set_memory_fraction(&mut self, fraction: f64) {
        assert!(
            (0.0..=1.0).contains(&fraction),
            "invalid fraction:{fraction}. Please set within [0, 1]."
        );
        // NEW setMemoryFraction: the limit is only active below 1; static_cast<size_t> truncates.
        self.allowed_memory_maximum = if fraction < 1.0 {
            Some((fraction * self.device.total_memory as f64) as u64)
        } else {
            None
        };
    }

    /// `torch.cuda.get_per_process_memory_fraction()`: allowed / total, 1.0 when no limit is set.
    pub fn memory_fraction(&self) -> f64 {
        match self.allowed_memory_maximum {
            Some(allowed) => allowed as f64 / self.device.total_memory as f64,
            None => 1.0,
        }
    }

    /// The per-process limit in bytes, when a memory fraction below 1 is set.
    pub fn allowed_memory_maximum(&self) -> Option<u64> {
        self.allowed_memory_maximum
    }

    /// `total_allocated_memory`: bytes currently obtained from the device.
    pub fn total_allocated_memory(&self) -> u64 {
        self.total_allocated_memory
    }

    /// The device address of a live block (`tensor.data_ptr()`).
    pub fn block_address(&self, block: BlockRef) -> u64 {
        debug_assert!(self.blocks.contains(block.0));
        self.blocks[block.0].addr
    }

    /// The bytes a live block occupies (its rounded, possibly unsplit, size).
    pub fn block_size(&self, block: BlockRef) -> u64 {
        debug_assert!(self.blocks.contains(block.0));
        self.blocks[block.0].size
    }

    /// `reset_accumulated_memory_stats()`.
    pub fn reset_accumulated_stats(&mut self) {
        self.stats.reset_accumulated();
    }

    /// `cudaMemGetInfo` free bytes now.
    #[inline]
    fn device_free(&self) -> u64 {
        self.device.free_memory(self.total_allocated_memory)
    }

    /// §3.1 / §5.4: GC bookkeeping and collection run only with a memory fraction below 1 and a threshold.
    #[inline]
    fn gc_enabled(&self) -> bool {
        self.allowed_memory_maximum.is_some() && self.config.garbage_collection_threshold > 0.0
    }

    /// `record_trace`: appends a history entry when recording.
    #[inline]
    fn record(&mut self, action: Action, addr: u64, size: u64, stream: StreamId, tl: &Timeline) {
        if self.record_history {
            self.history.push(HistoryEntry {
                action,
                addr,
                size,
                stream,
                time_ns: tl.now(),
            });
        }
    }

    /// `pool.insert_into_blocks(block)`: caches a free block and stamps its GC age base.
    #[inline]
    fn insert_free(&mut self, idx: u32) {
        let block = &mut self.blocks[idx];
        let pool = &mut self.pools[pool_index(block.pool)];
        block.gc_count_base = pool.get_free_blocks_call_count;
        pool.insert(block.stream, block.size, block.addr, idx);
    }

    /// Takes a free block out of its pool's ordered set.
    #[inline]
    fn remove_free(&mut self, idx: u32) {
        let block = &self.blocks[idx];
        self.pools[pool_index(block.pool)].remove(block.stream, block.size, block.addr);
    }

    /// Links `idx` between `before` and `after` (`Block::splice`).
    fn splice(&mut self, idx: u32, before: u32, after: u32) {
        if before != NIL {
            debug_assert_eq!(self.blocks[before].next, after);
            self.blocks[before].next = idx;
        }
        self.blocks[idx].prev = before;
        if after != NIL {
            debug_assert_eq!(self.blocks[after].prev, before);
            self.blocks[after].prev = idx;
        }
        self.blocks[idx].next = after;
    }

    /// §4.3 process_events: frees the blocks whose last outstanding event has fired. Per stream, events are
    /// taken oldest first and the stream is left at the first one that has not fired.
    #[inline]
    fn process_events(&mut self, tl: &mut Timeline) {
        if self.events.pending == 0 {
            return;
        }
        let mut streams = std::mem::take(&mut self.events.streams);
        for stream in &mut streams {
            while let Some(&(fires_at, idx)) = stream.queue.front() {
                if !tl.has_fired(fires_at) {
                    break;
                }
                stream.queue.pop_front();
                self.events.pending -= 1;
                self.release_event(idx, tl);
            }
        }
        self.events.streams = streams;
    }

    /// One event of `idx` completed: `event_count -= 1`, and the block is cached at zero.
    #[inline]
    fn release_event(&mut self, idx: u32, tl: &mut Timeline) {
        let block = &mut self.blocks[idx];
        block.event_count -= 1;
        if block.event_count == 0 {
            self.free_block(idx, tl);
        }
    }

    /// §4.3 synchronize_and_free_events: waits for every outstanding event (the host clock moves to the
    /// latest of them) and frees the blocks they held back.
    fn synchronize_and_free_events(&mut self, tl: &mut Timeline) {
        self.stats.num_sync_all_streams += 1;
        let mut streams = std::mem::take(&mut self.events.streams);
        for stream in &mut streams {
            while let Some((fires_at, idx)) = stream.queue.pop_front() {
                // cudaEventSynchronize
                tl.wait_until(fires_at);
                self.events.pending -= 1;
                self.release_event(idx, tl);
            }
        }
        self.events.streams = streams;
    }

    /// §4.1 insert_events: one event per recorded stream, fired when that stream's queued work is done.
    fn insert_events(&mut self, idx: u32, tl: &mut Timeline) {
        let slot = self.blocks[idx].uses;
        self.blocks[idx].uses = NIL;
        for i in 0..self.uses.streams(slot).len() {
            let stream = self.uses.streams(slot)[i];
            let fires_at = tl.record_event(stream);
            self.blocks[idx].event_count += 1;
            self.events.push(stream, fires_at, idx);
        }
        self.uses.release(slot);
    }

    /// §3.1 get_free_block: the best-fitting cached block of `stream` for a rounded request of `size`
    /// bytes, taken out of the pool, or `None`.
    #[inline]
    fn get_free_block(
        &mut self,
        kind: PoolKind,
        stream: StreamId,
        size: u64,
        expandable_active: bool,
    ) -> Option<u32> {
        let gc_enabled = self.gc_enabled();
        let pool = &mut self.pools[pool_index(kind)];
        if gc_enabled {
            // §3.1 step 1: block ages only advance while GC is enabled.
            pool.get_free_blocks_call_count += 1;
        }
        let blocks = &self.blocks;
        // §2.3 lower_bound((stream, size, 0)); stream-first order, so a miss never looks at other streams.
        let mut candidates = pool.at_least(stream, size)?;
        let (_, first) = candidates.next()?;
        let mut found = first;
        let mut found_at = candidates.last_position();
        if blocks[found].is_expandable() {
            if expandable_active {
                // §7.3: compare by the size a block can grow to (plus an unmapped block right after it);
                // walk to bigger blocks while they have a smaller expandable size.
                let expandable_size = |idx: u32| {
                    let b = &blocks[idx];
                    let next = b.next;
                    b.size
                        + if next != NIL && !blocks[next].mapped {
                            blocks[next].size
                        } else {
                            0
                        }
                };
                while blocks[found].is_expandable() {
                    match candidates.next() {
                        Some((_, next)) if expandable_size(next) < expandable_size(found) => {
                            found = next;
                            found_at = candidates.last_position();
                        }
                        _ => break,
                    }
                }
            } else {
                // §7.3: expandable segments were turned off: only non-expandable blocks qualify.
                loop {
                    let (_, next) = candidates.next()?;
                    if !blocks[next].is_expandable() {
                        found = next;
                        found_at = candidates.last_position();
                        break;
                    }
                }
            }
        }
        let found_size = blocks[found].size;
        if refuses_oversize_block(size, found_size, &self.config)
            || exceeds_non_split_rounding(size, found_size, &self.config)
        {
            return None;
        }
        pool.remove_at(stream, found_at);
        Some(found)
    }

    /// §3.3 alloc_block: a new segment of `alloc_size` bytes (or, with expandable segments, newly mapped
    /// pages holding `size` bytes), or `None` if the memory fraction or the device does not allow it.
    fn alloc_block(
        &mut self,
        kind: PoolKind,
        stream: StreamId,
        size: u64,
        alloc_size: u64,
        is_retry: bool,
        tl: &mut Timeline,
    ) -> Option<u32> {
        if is_retry {
            // §3.3: counted whether or not the retry succeeds.
            self.stats.num_alloc_retries += 1;
        }
        // §3.3 memory fraction: checked with the §1.4 size, without calling CUDA (also for expandable).
        if let Some(allowed) = self.allowed_memory_maximum {
            if self.total_allocated_memory + alloc_size > allowed {
                return None;
            }
        }
        if self.config.expandable_segments {
            // §7.2 try_allocate_expandable_block
            return self.try_allocate_expandable_block(kind, stream, size, tl);
        }
        // cudaMalloc(alloc_size): fails when the device has not that much free.
        if alloc_size > self.device_free() {
            return None;
        }
        let addr = self.address_space.reserve(alloc_size);
        self.total_allocated_memory += alloc_size;
        let idx = self
            .blocks
            .insert(Block::new(addr, alloc_size, stream, kind));
        self.stats.segment.increase(kind, 1);
        self.stats.reserved_bytes.increase(kind, alloc_size);
        if alloc_size >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        self.record(Action::SegmentAlloc, addr, alloc_size, stream, tl);
        Some(idx)
    }

    /// §3.4 alloc_found_block: hands out `idx` (its front `size` bytes if `split`) for a request of
    /// `orig_size` bytes and returns the index of the block handed out.
    #[inline]
    fn alloc_found_block(
        &mut self,
        idx: u32,
        orig_size: u64,
        size: u64,
        split: bool,
        tl: &Timeline,
    ) -> u32 {
        let block = &self.blocks[idx];
        let kind = block.pool;
        let stream = block.stream;
        let already_split = block.is_split();
        let expandable = block.is_expandable();
        let handed_out = if split {
            // §3.4: the front `size` bytes become a new block; the tail stays cached.
            let remaining = idx;
            let (addr, prev, segment) = (block.addr, block.prev, block.segment);
            let mut front = Block::new(addr, size, stream, kind);
            front.segment = segment;
            front.prev = prev;
            front.next = remaining;
            let front = self.blocks.insert(front);
            if prev != NIL {
                self.blocks[prev].next = front;
            }
            let tail = &mut self.blocks[remaining];
            tail.prev = front;
            tail.addr += size;
            tail.size -= size;
            let tail_size = tail.size;
            self.insert_free(remaining);
            // §3.4 inactive_split bookkeeping (not for expandable segments, §7.4).
            if !expandable {
                if already_split {
                    // An already-split inactive block shrinks by `size` bytes.
                    self.stats.inactive_split_bytes.decrease(kind, size);
                } else {
                    // A previously unsplit block leaves an inactive split tail.
                    self.stats.inactive_split_bytes.increase(kind, tail_size);
                    self.stats.inactive_split.increase(kind, 1);
                }
            }
            front
        } else {
            if already_split && !expandable {
                // §3.4: an inactive split block becomes active whole.
                let block_size = self.blocks[idx].size;
                self.stats.inactive_split_bytes.decrease(kind, block_size);
                self.stats.inactive_split.decrease(kind, 1);
            }
            idx
        };
        let block = &mut self.blocks[handed_out];
        block.allocated = true;
        block.requested_size = orig_size;
        let (addr, block_size) = (block.addr, block.size);
        self.record(Action::Alloc, addr, orig_size, stream, tl);
        // §3.4 stats, aggregate and pool.
        let stats = &mut self.stats;
        stats.allocation.increase(kind, 1);
        stats.allocated_bytes.increase(kind, block_size);
        stats.active.increase(kind, 1);
        stats.active_bytes.increase(kind, block_size);
        stats.requested_bytes.increase(kind, orig_size);
        if block_size >= self.config.max_split_size {
            stats.oversize_allocations.increase(1);
        }
        handed_out
    }

    /// §4.2 try_merge_blocks: merges the free neighbour `src` into `dst` if it is free, not waiting for
    /// events and equally mapped; returns the bytes subsumed (0 if no merge).
    #[inline]
    fn try_merge_blocks(&mut self, dst: u32, src: u32) -> u64 {
        if src == NIL {
            return 0;
        }
        let s = &self.blocks[src];
        if s.allocated || s.event_count > 0 || s.uses != NIL || s.mapped != self.blocks[dst].mapped
        {
            return 0;
        }
        let (s_addr, s_size, s_prev, s_next, s_mapped, s_stream, s_pool) =
            (s.addr, s.size, s.prev, s.next, s.mapped, s.stream, s.pool);
        if self.blocks[dst].prev == src {
            // [src dst]: dst takes the lower address.
            let d = &mut self.blocks[dst];
            d.addr = s_addr;
            d.prev = s_prev;
            if s_prev != NIL {
                self.blocks[s_prev].next = dst;
            }
        } else {
            // [dst src]
            self.blocks[dst].next = s_next;
            if s_next != NIL {
                self.blocks[s_next].prev = dst;
            }
        }
        self.blocks[dst].size += s_size;
        let pool = &mut self.pools[pool_index(s_pool)];
        if s_mapped {
            pool.remove(s_stream, s_size, s_addr);
        } else {
            pool.remove_unmapped(s_stream, s_addr);
        }
        self.blocks.remove(src);
        s_size
    }

    /// §4.2 free_block: caches a block whose uses are over, merging it with free neighbours.
    fn free_block(&mut self, idx: u32, tl: &Timeline) {
        let block = &self.blocks[idx];
        debug_assert!(!block.allocated && block.event_count == 0 && block.uses == NIL);
        let (addr, original_size, requested, stream, kind, prev, next) = (
            block.addr,
            block.size,
            block.requested_size,
            block.stream,
            block.pool,
            block.prev,
            block.next,
        );
        self.record(Action::FreeCompleted, addr, requested, stream, tl);
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        // §4.2: merge with prev, then next (both taken before merging).
        for candidate in [prev, next] {
            let subsumed = self.try_merge_blocks(idx, candidate);
            if subsumed > 0 {
                net_blocks -= 1;
                net_bytes -= subsumed as i64;
            }
        }
        self.insert_free(idx);
        let block = &self.blocks[idx];
        if block.is_split() {
            net_blocks += 1;
            net_bytes += block.size as i64;
        }
        let expandable = block.is_expandable();
        let stats = &mut self.stats;
        // §4.2 inactive_split delta (expandable segments excluded, §7.4).
        if !expandable {
            apply_delta(&mut stats.inactive_split, kind, net_blocks);
            apply_delta(&mut stats.inactive_split_bytes, kind, net_bytes);
        }
        stats.active.decrease(kind, 1);
        stats.active_bytes.decrease(kind, original_size);
        stats.requested_bytes.decrease(kind, requested);
    }

    /// §6.1: the out-of-memory error, with its history entry and `num_ooms`.
    #[cold]
    #[inline(never)]
    fn out_of_memory(
        &mut self,
        orig_size: u64,
        size: u64,
        alloc_size: u64,
        stream: StreamId,
        tl: &Timeline,
    ) -> OutOfMemory {
        let device_free = self.device_free();
        // §10.2 oom entry: addr = device_free, size = the rounded request.
        self.record(Action::Oom, device_free, size, stream, tl);
        self.stats.num_ooms += 1;
        let message = out_of_memory_message(&OomFacts {
            device: &self.device,
            alloc_size,
            device_free,
            allowed: self.allowed_memory_maximum,
            allocated_bytes: self.stats.allocated_bytes.all.current as u64,
            reserved_bytes: self.stats.reserved_bytes.all.current as u64,
        });
        OutOfMemory {
            message,
            requested: orig_size,
            alloc_size,
            device_free,
        }
    }
}

/// §3.1 oversize rule 1: a request of `size` bytes below `max_split_size` never takes a cached block of
/// `block_size` bytes at or above it.
#[inline]
pub fn refuses_oversize_block(size: u64, block_size: u64, config: &AllocatorConfig) -> bool {
    size < config.max_split_size && block_size >= config.max_split_size
}

/// §3.1 oversize rule 2 (NEW: `max_non_split_rounding_size`): a request of `size` bytes at or above
/// `max_split_size` takes a cached block of `block_size` bytes only if it wastes less than the tolerance.
#[inline]
pub fn exceeds_non_split_rounding(size: u64, block_size: u64, config: &AllocatorConfig) -> bool {
    size >= config.max_split_size
        && block_size >= size.saturating_add(config.max_non_split_rounding_size)
}

/// §3.2 should_split: whether the `remaining` bytes of a block of `pool` beyond a rounded request of
/// `size` bytes become a cached block of their own.
#[inline]
pub fn should_split(
    pool: PoolKind,
    expandable_active: bool,
    size: u64,
    remaining: u64,
    config: &AllocatorConfig,
) -> bool {
    if pool == PoolKind::Small || expandable_active {
        // NEW: is_expandable_segments_active (the setting, default pool).
        remaining >= MIN_BLOCK_SIZE
    } else {
        size < config.max_split_size && remaining > SMALL_SIZE
    }
}

/// Increases or decreases a stat array by a signed amount (free_block's net changes).
#[inline]
fn apply_delta(array: &mut crate::stats::StatArray, kind: PoolKind, delta: i64) {
    if delta > 0 {
        array.increase(kind, delta as u64);
    } else if delta < 0 {
        array.decrease(kind, delta.unsigned_abs());
    }
}

impl Allocator for CachingAllocator {
    /// §3 malloc.
    #[inline]
    fn malloc(
        &mut self,
        orig_size: u64,
        stream: StreamId,
        tl: &mut Timeline,
    ) -> Result<BlockRef, OutOfMemory> {
        // §3: 2^60 bytes or more are refused before the allocator is involved; no stats touched.
        if orig_size >= MAX_REQUEST {
            return Err(OutOfMemory {
                message: MORE_THAN_1EB_MESSAGE.to_string(),
                requested: orig_size,
                alloc_size: 0,
                device_free: self.device_free(),
            });
        }
        debug_assert!(orig_size > 0, "malloc(0) is answered by the engine");
        // §3 step 1 (no capture is ever underway here).
        self.process_events(tl);
        // §3 step 2
        let size = round_size(orig_size, &self.config);
        let kind = PoolKind::of(size);
        let alloc_size = get_allocation_size(size, &self.config);
        let expandable_active = self.config.expandable_segments;
        // §3 step 3 (the free-memory callbacks are CUDA-IPC only and free nothing here).
        let mut found = self.get_free_block(kind, stream, size, expandable_active);
        if found.is_none() {
            // §3 step 4a: garbage collection.
            if self.gc_enabled() {
                self.garbage_collect_cached_blocks(tl);
            }
            // §3 step 4b
            found = self.alloc_block(kind, stream, size, alloc_size, false, tl);
            // §3 step 4d (4c, the NEW MemPool use_on_oom fallback, has no pools to try).
            if found.is_none() && self.release_available_cached_blocks(kind, stream, size, tl) {
                found = self.alloc_block(kind, stream, size, alloc_size, false, tl);
            }
            // §3 step 4e
            if found.is_none() {
                self.release_cached_blocks(tl);
                found = self.alloc_block(kind, stream, size, alloc_size, true, tl);
            }
        }
        let Some(idx) = found else {
            // §3 step 5
            return Err(self.out_of_memory(orig_size, size, alloc_size, stream, tl));
        };
        // §3 step 6
        let block = &self.blocks[idx];
        let split = should_split(
            block.pool,
            expandable_active,
            size,
            block.size - size,
            &self.config,
        );
        Ok(BlockRef(
            self.alloc_found_block(idx, orig_size, size, split, tl),
        ))
    }

    /// §4.1 free.
    #[inline]
    fn free(&mut self, block: BlockRef, tl: &mut Timeline) {
        let idx = block.0;
        debug_assert!(
            self.blocks.contains(idx) && self.blocks[idx].allocated,
            "free of block {idx}, which is not allocated"
        );
        let b = &mut self.blocks[idx];
        b.allocated = false;
        let (kind, size, addr, requested, stream, uses) =
            (b.pool, b.size, b.addr, b.requested_size, b.stream, b.uses);
        // §4.1 step 1: allocation stats drop at once.
        self.stats.allocation.decrease(kind, 1);
        self.stats.allocated_bytes.decrease(kind, size);
        self.record(Action::FreeRequested, addr, requested, stream, tl);
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
        if uses != NIL {
            // §4.1 step 3: deferred until the recorded streams pass this point.
            self.insert_events(idx, tl);
        } else {
            // §4.1 step 2
            self.free_block(idx, tl);
        }
    }

    /// `recordStream`: uses on the allocation stream are ignored (§4.1).
    fn record_stream(&mut self, block: BlockRef, stream: StreamId) {
        let idx = block.0;
        debug_assert!(
            self.blocks.contains(idx) && self.blocks[idx].allocated,
            "record_stream on block {idx}, which is not allocated"
        );
        let b = &mut self.blocks[idx];
        if stream == b.stream {
            return;
        }
        b.uses = self.uses.insert(b.uses, stream);
    }

    /// §5.3 `emptyCache` = release_cached_blocks.
    fn empty_cache(&mut self, tl: &mut Timeline) {
        self.release_cached_blocks(tl);
    }

    /// See `adopt.rs`.
    fn adopt_segment(&mut self, segment: &InitialSegment) -> Result<Vec<BlockRef>, AdoptError> {
        self.adopt(segment)
    }

    fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn segments(&self) -> Vec<SegmentInfo> {
        self.snapshot()
    }

    /// `_record_memory_history(enabled)`; disabling clears what was recorded, as PyTorch does.
    fn set_record_history(&mut self, enabled: bool) {
        self.record_history = enabled;
        if !enabled {
            self.history.clear();
        }
    }

    fn take_history(&mut self) -> Vec<HistoryEntry> {
        std::mem::take(&mut self.history)
    }

    fn steady_state_key(&self, key: &mut Vec<u64>) -> bool {
        self.write_steady_state_key(key)
    }

    fn block_address(&self, block: BlockRef) -> Option<u64> {
        Some(self.blocks[block.0].addr)
    }

    fn counters(&self) -> Counters {
        self.steady_counters()
    }

    fn carry_repetitions(&mut self, before: &Counters, n: u64) {
        self.carry_steady_repetitions(before, n)
    }

    fn fork(&self) -> Option<Box<dyn Allocator>> {
        Some(Box::new(self.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc() -> CachingAllocator {
        CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(8 << 30))
    }

    #[test]
    fn split_tail_is_cached_and_merges_back() {
        let mut a = alloc();
        let mut tl = Timeline::new();
        let b = a.malloc(4 << 20, 0, &mut tl).unwrap();
        assert_eq!(a.pools[1].len(), 1, "the 16 MiB tail is cached");
        a.free(b, &mut tl);
        assert_eq!(a.pools[1].len(), 1, "merged back into one 20 MiB block");
        let only = a.pools[1].iter().next().unwrap();
        assert_eq!(a.blocks[only].size, 20 << 20);
        assert!(!a.blocks[only].is_split());
    }

    #[test]
    fn pool_search_is_per_stream() {
        let mut pool = BlockPool::new();
        pool.insert(3, 5 << 20, 0x1000, 7);
        let (key, idx) = pool.at_least(3, 1).unwrap().next().unwrap();
        assert_eq!((key, idx), (pool::key(5 << 20, 0x1000), 7));
        assert!(pool.at_least(2, 1).is_none());
    }
}
