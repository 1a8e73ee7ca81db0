//! Expandable segments (`expandable_segments:True`, §7; PyTorch's `ExpandableSegment`, Note [Expandable
//! Segments]).
//!
//! Instead of one `cudaMalloc` per segment, a pool reserves, per stream, a virtual range big enough for
//! 1⅛ × the device's memory (`ceil(1.125 × total / page)` pages) and maps physical pages into it on demand:
//! 2 MiB pages for the small pool, `large_segment_size` (20 MiB) pages for the large pool. Inside the range,
//! blocks are ordinary blocks; the unmapped remainder is a block too (`mapped == false`), kept in the pool's
//! `unmapped` set. A request that no cached block fits maps just enough whole pages at the lowest address
//! where free and unmapped space together fit it (`find_expandable_block`), and the newly mapped range merges
//! with the free mapped blocks around it. Flushing the cache unmaps every page lying entirely inside a free
//! block; partial pages at its ends stay mapped.
//!
//! Differences from ordinary segments: the `segment` stat is not counted (reserved bytes grow by the mapped
//! bytes and `num_device_alloc`/`num_device_free` count map/unmap calls); any remainder of at least 512 bytes
//! is split off (§3.2); `inactive_split` is not kept (§7.4); GC and `release_available_cached_blocks` skip
//! these blocks (NEW); a snapshot shows one segment per contiguous mapped range.
//!
//! Versions: the NEW (≈2.9/main) `ExpandableSegment` computes its reservation from `totalGlobalMem` itself
//! and takes its large page size from `large_segment_size`; OLD hard-codes 20 MiB. Unmapping synchronizes the
//! segment's stream (`cudaStreamSynchronize` in `unmapHandles`), which moves the host clock.

use vramsim_traces::StreamId;

use crate::allocator::Action;
use crate::config::AllocatorConfig;
use crate::rounding::{PoolKind, SMALL_BUFFER};
use crate::timeline::Timeline;

use super::block::{Block, NIL};
use super::{pool_index, CachingAllocator};

/// §7.1 the page (physical handle) size of `kind`'s expandable segments: 2 MiB (`kSmallBuffer`) for the
/// small pool, `large_segment_size` for the large pool (NEW; OLD hard-codes 20 MiB).
pub fn page_size(kind: PoolKind, config: &AllocatorConfig) -> u64 {
    match kind {
        PoolKind::Small => SMALL_BUFFER,
        PoolKind::Large => config.large_segment_size,
    }
}

/// §7.2 `map`: the bytes mapped to hold `size` bytes from a page boundary (whole pages of `page` bytes).
pub fn whole_pages(size: u64, page: u64) -> u64 {
    size.div_ceil(page) * page
}

/// One reserved virtual range and its page size (PyTorch's `ExpandableSegment`).
#[derive(Clone, Debug)]
pub(crate) struct ExpandableSegment {
    /// `ptr_`: start of the reservation.
    pub base: u64,
    /// `segment_size_`: bytes per page (physical handle).
    pub page: u64,
    /// `max_handles_`: pages in the reservation.
    pub max_pages: u64,
    /// The stream the segment serves (synchronized when unmapping).
    pub stream: StreamId,
    /// The pool it serves.
    pub kind: PoolKind,
    /// Bytes currently mapped (`mapped_size_`).
    pub mapped_bytes: u64,
}

impl ExpandableSegment {
    /// `size()`: bytes reserved.
    pub fn size(&self) -> u64 {
        self.max_pages * self.page
    }

    /// `segmentLeft(p)`: index of the page holding `p`.
    fn segment_left(&self, p: u64) -> u64 {
        (p - self.base) / self.page
    }

    /// `segmentRight(p)`: index of the first page starting at or after `p`.
    fn segment_right(&self, p: u64) -> u64 {
        (p - self.base).div_ceil(self.page)
    }

    /// `map(range)`: the whole pages covering `[ptr, ptr + size)` as (address, bytes); `ptr` is page-aligned.
    pub fn map_range(&self, ptr: u64, size: u64) -> (u64, u64) {
        debug_assert_eq!((ptr - self.base) % self.page, 0);
        (ptr, whole_pages(size, self.page))
    }

    /// `unmap(range)`: the whole pages lying inside `[ptr, ptr + size)` as (address, bytes); bytes is 0
    /// when there is none.
    pub fn unmap_range(&self, ptr: u64, size: u64) -> (u64, u64) {
        let begin = self.segment_right(ptr);
        let end = self.segment_left(ptr + size);
        if begin >= end {
            return (ptr, 0);
        }
        (self.base + begin * self.page, (end - begin) * self.page)
    }
}

/// `expandable_segments_`: the live segments, by slot.
#[derive(Clone, Debug, Default)]
pub(crate) struct ExpandableSegments {
    slots: Vec<Option<ExpandableSegment>>,
    vacant: Vec<u32>,
}

impl ExpandableSegments {
    /// Stores a new segment and returns its slot.
    fn insert(&mut self, segment: ExpandableSegment) -> u32 {
        match self.vacant.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(segment);
                slot
            }
            None => {
                self.slots.push(Some(segment));
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Drops the segment in `slot` (`delete expandable_segment_`: the reservation is freed).
    fn remove(&mut self, slot: u32) {
        debug_assert!(self.slots[slot as usize].is_some());
        self.slots[slot as usize] = None;
        self.vacant.push(slot);
    }

    pub(crate) fn get(&self, slot: u32) -> &ExpandableSegment {
        self.slots[slot as usize]
            .as_ref()
            .expect("block of a released expandable segment")
    }

    pub(crate) fn get_mut(&mut self, slot: u32) -> &mut ExpandableSegment {
        self.slots[slot as usize]
            .as_mut()
            .expect("block of a released expandable segment")
    }

    /// Writes every slot (live segments with their reservation, pages and mapped bytes) and the vacant
    /// slots in reuse order, for a replay's steady-state check.
    pub(crate) fn steady_state_key(&self, key: &mut Vec<u64>) {
        key.push(self.slots.len() as u64);
        for slot in &self.slots {
            match slot {
                None => key.push(u64::MAX),
                Some(s) => key.extend([
                    s.base,
                    s.page,
                    s.max_pages,
                    s.stream,
                    s.kind as u64,
                    s.mapped_bytes,
                ]),
            }
        }
        key.push(self.vacant.len() as u64);
        key.extend(self.vacant.iter().map(|&v| u64::from(v)));
    }

    /// Number of live segments.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// The slot of the live segment of `stream` and `kind` whose reservation holds `addr`.
    pub(crate) fn containing(&self, stream: StreamId, kind: PoolKind, addr: u64) -> Option<u32> {
        self.slots.iter().enumerate().find_map(|(slot, s)| {
            let s = s.as_ref()?;
            (s.stream == stream && s.kind == kind && addr >= s.base && addr - s.base < s.size())
                .then_some(slot as u32)
        })
    }
}

impl CachingAllocator {
    /// `allocatable(b)`: a block that free and unmapped space may be chained through.
    fn allocatable(&self, idx: u32) -> bool {
        if idx == NIL {
            return false;
        }
        let b = &self.blocks[idx];
        !b.allocated && b.event_count == 0 && b.uses == NIL
    }

    /// §7.2 find_expandable_block: the lowest-addressed place in one of the stream's expandable segments
    /// where a free block and/or unmapped space chained forward hold `size` bytes; a new segment (one
    /// unmapped block spanning its reservation) if there is none.
    fn find_expandable_block(&mut self, kind: PoolKind, stream: StreamId, size: u64) -> u32 {
        let mut unmapped = std::mem::take(&mut self.scratch2);
        unmapped.clear();
        self.pools[pool_index(kind)].collect_unmapped(stream, &mut unmapped);
        let mut found = NIL;
        for &idx in &unmapped {
            // The lowest unmapped range; a free block right before it can be used too.
            let prev = self.blocks[idx].prev;
            let mut candidate = idx;
            if self.allocatable(prev) {
                candidate = prev;
            }
            // has_available_address_space
            let mut bytes = 0;
            let mut b = candidate;
            while bytes < size && self.allocatable(b) {
                bytes += self.blocks[b].size;
                b = self.blocks[b].next;
            }
            if bytes >= size {
                found = candidate;
                break;
            }
        }
        self.scratch2 = unmapped;
        if found != NIL {
            return found;
        }
        let (page, max_pages) = self.expandable_geometry(kind);
        let base = self.address_space.reserve(max_pages * page);
        self.new_expandable_segment(kind, stream, base, max_pages)
    }

    /// The page size and page count of a new reservation for `kind`.
    pub(super) fn expandable_geometry(&self, kind: PoolKind) -> (u64, u64) {
        let page = page_size(kind, &self.config);
        // "enough address space for 1 1/8 the total memory on the GPU": numSegments(total + total / 8).
        let total = self.device.total_memory;
        (page, (total + total / 8).div_ceil(page))
    }

    /// A new expandable segment of `max_pages` pages at `base`, all unmapped; returns its one unmapped
    /// block.
    pub(super) fn new_expandable_segment(
        &mut self,
        kind: PoolKind,
        stream: StreamId,
        base: u64,
        max_pages: u64,
    ) -> u32 {
        let (page, _) = self.expandable_geometry(kind);
        let slot = self.segments.insert(ExpandableSegment {
            base,
            page,
            max_pages,
            stream,
            kind,
            mapped_bytes: 0,
        });
        let mut block = Block::new(base, max_pages * page, stream, kind);
        block.mapped = false;
        block.segment = slot;
        let idx = self.blocks.insert(block);
        self.pools[pool_index(kind)].insert_unmapped(stream, base, idx);
        idx
    }

    /// §7.2 map_block: maps the whole pages covering the first `size` bytes of the unmapped block `to_map`,
    /// merges the mapped range with free neighbours and caches it. False if the device has not that much
    /// free memory (`cuMemCreate` out of memory: nothing of this call stays mapped).
    fn map_block(&mut self, to_map: u32, size: u64, tl: &Timeline) -> bool {
        let block = &self.blocks[to_map];
        debug_assert!(!block.mapped && size <= block.size);
        let (addr, block_size, stream, kind, slot, next) = (
            block.addr,
            block.size,
            block.stream,
            block.pool,
            block.segment,
            block.next,
        );
        let (mapped_addr, mapped) = self.segments.get(slot).map_range(addr, size);
        if mapped == 0 || mapped > self.device_free() {
            return false;
        }
        self.pools[pool_index(kind)].remove_unmapped(stream, addr);
        self.blocks[to_map].mapped = true;
        if mapped < block_size {
            // to_map -> remaining (still unmapped) -> next
            let mut remaining = Block::new(addr + mapped, block_size - mapped, stream, kind);
            remaining.mapped = false;
            remaining.segment = slot;
            let remaining = self.blocks.insert(remaining);
            self.splice(remaining, to_map, next);
            self.pools[pool_index(kind)].insert_unmapped(stream, addr + mapped, remaining);
            self.blocks[to_map].size = mapped;
        }
        let (prev, next) = (self.blocks[to_map].prev, self.blocks[to_map].next);
        self.try_merge_blocks(to_map, prev);
        self.try_merge_blocks(to_map, next);
        self.insert_free(to_map);
        self.total_allocated_memory += mapped;
        self.segments.get_mut(slot).mapped_bytes += mapped;
        // §7.2 stats: reserved grows by the mapped bytes; the segment count does not change.
        self.stats.reserved_bytes.increase(kind, mapped);
        self.stats.num_device_alloc += 1;
        self.record(Action::SegmentMap, mapped_addr, mapped, stream, tl);
        true
    }

    /// §7.2 try_allocate_expandable_block: maps pages until one free block holds `size` bytes and takes it
    /// out of the pool; `None` when mapping fails (pages mapped before the failure stay mapped and cached).
    pub(super) fn try_allocate_expandable_block(
        &mut self,
        kind: PoolKind,
        stream: StreamId,
        size: u64,
        tl: &Timeline,
    ) -> Option<u32> {
        // candidate: unmapped -> null | unmapped -> free -> * | free -> unmapped -> *
        let mut candidate = self.find_expandable_block(kind, stream, size);
        if !self.blocks[candidate].mapped {
            let len = self.blocks[candidate].size.min(size);
            if !self.map_block(candidate, len, tl) {
                return None;
            }
        }
        while self.blocks[candidate].size < size {
            // invariant: free -> unmapped -> *; mapping the unmapped block merges the free one into it.
            let remaining = size - self.blocks[candidate].size;
            let next = self.blocks[candidate].next;
            let len = remaining.min(self.blocks[next].size);
            if !self.map_block(next, len, tl) {
                return None;
            }
            candidate = next;
        }
        self.remove_free(candidate);
        Some(candidate)
    }

    /// §7.5 unmap_block: unmaps the whole pages inside the free expandable block `idx`; the partial pages at
    /// either end stay mapped as free blocks of their own. The segment's stream is synchronized first.
    pub(super) fn unmap_block(&mut self, idx: u32, tl: &mut Timeline) {
        let block = &self.blocks[idx];
        let (addr, size, stream, kind, slot, prev, next) = (
            block.addr,
            block.size,
            block.stream,
            block.pool,
            block.segment,
            block.prev,
            block.next,
        );
        let segment = self.segments.get(slot);
        let (unmapped_addr, unmapped) = segment.unmap_range(addr, size);
        if unmapped == 0 {
            return;
        }
        // unmapHandles: cudaStreamSynchronize(stream) before cuMemUnmap.
        tl.synchronize_stream(segment.stream);
        self.remove_free(idx);
        let before = unmapped_addr - addr;
        if before > 0 {
            // prev? -> before_free -> block
            let mut before_free = Block::new(addr, before, stream, kind);
            before_free.segment = slot;
            let before_free = self.blocks.insert(before_free);
            self.splice(before_free, prev, idx);
            self.insert_free(before_free);
        }
        let after = size - (before + unmapped);
        if after > 0 {
            // block -> after_free -> next?
            let mut after_free = Block::new(unmapped_addr + unmapped, after, stream, kind);
            after_free.segment = slot;
            let after_free = self.blocks.insert(after_free);
            self.splice(after_free, idx, next);
            self.insert_free(after_free);
        }
        let block = &mut self.blocks[idx];
        block.addr = unmapped_addr;
        block.size = unmapped;
        block.mapped = false;
        let (prev, next) = (block.prev, block.next);
        self.try_merge_blocks(idx, prev);
        self.try_merge_blocks(idx, next);
        let block = &self.blocks[idx];
        self.pools[pool_index(kind)].insert_unmapped(stream, block.addr, idx);
        self.total_allocated_memory -= unmapped;
        self.segments.get_mut(slot).mapped_bytes -= unmapped;
        self.stats.reserved_bytes.decrease(kind, unmapped);
        self.stats.num_device_free += 1;
        self.record(Action::SegmentUnmap, unmapped_addr, unmapped, stream, tl);
    }

    /// `release_expandable_segment`: drops a segment whose whole reservation is one unmapped block.
    pub(super) fn release_expandable_segment(&mut self, idx: u32) {
        let block = &self.blocks[idx];
        let slot = block.segment;
        debug_assert!(!block.mapped && block.size == self.segments.get(slot).size());
        self.pools[pool_index(block.pool)].remove_unmapped(block.stream, block.addr);
        self.address_space.release(block.addr);
        self.segments.remove(slot);
        self.blocks.remove(idx);
    }

    /// Number of live expandable segments (reservations).
    pub fn expandable_segment_count(&self) -> usize {
        self.segments.len()
    }
}
