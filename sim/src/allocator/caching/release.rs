//! Giving memory back to the device (§5): `release_block`, `release_available_cached_blocks`,
//! `release_cached_blocks` (the body of `empty_cache`) and `garbage_collect_cached_blocks`.
//!
//! Segments are never returned by a `free`; only these paths return them, and only whole free segments
//! (expandable segments give back whole free pages instead, see `expandable.rs`).
//!
//! A `cudaFree` is modelled as synchronous with the device, as CUDA documents it ("exhibits synchronous
//! behavior for most use cases"): the host clock moves to the time every stream is idle.

use crate::allocator::Action;
use crate::rounding::PoolKind;
use crate::timeline::Timeline;

use super::pool::key_size;
use super::{pool_index, CachingAllocator};

impl CachingAllocator {
    /// §5.1 release_block: `cudaFree` of a whole, non-expandable cached segment.
    pub(super) fn release_block(&mut self, idx: u32, tl: &mut Timeline) {
        let block = &self.blocks[idx];
        debug_assert!(
            !block.is_expandable() && !block.is_split() && !block.allocated,
            "release_block of a block that is not a whole cached segment"
        );
        let (addr, size, stream, kind) = (block.addr, block.size, block.stream, block.pool);
        self.stats.num_device_free += 1;
        self.record(Action::SegmentFree, addr, size, stream, tl);
        // cudaFree synchronizes the device.
        tl.synchronize();
        self.total_allocated_memory -= size;
        self.stats.segment.decrease(kind, 1);
        self.stats.reserved_bytes.decrease(kind, size);
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        self.pools[pool_index(kind)].remove(stream, size, addr);
        self.address_space.release(addr);
        self.blocks.remove(idx);
    }

    /// §5.2 release_available_cached_blocks: frees cached oversize segments of `stream` in the request's
    /// pool until at least `max(size, max_split_size)` bytes are released; true if that succeeded. Only with
    /// `max_split_size` set.
    pub(super) fn release_available_cached_blocks(
        &mut self,
        kind: PoolKind,
        stream: u64,
        size: u64,
        tl: &mut Timeline,
    ) -> bool {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return false;
        }
        let key = size.max(max_split);
        let pool = &self.pools[pool_index(kind)];
        // The smallest cached block of the stream with size ≥ key (NEW: unless it is expandable).
        let single = pool
            .at_least(stream, key)
            .and_then(|mut blocks| blocks.next().map(|(_, idx)| idx))
            .filter(|&idx| !self.blocks[idx].is_expandable());
        if let Some(idx) = single {
            // Free blocks of max_split_size or more are whole segments whenever max_split_size ≥
            // large_segment_size, which PyTorch's settings parser enforces; a split one is not releasable.
            if self.blocks[idx].is_split() {
                return false;
            }
            self.release_block(idx, tl);
            return true;
        }
        // Otherwise walk down from the largest block below the key, releasing oversize blocks of the
        // stream (NEW: skipping expandable ones) until the total reaches the key. Blocks released before
        // giving up stay released.
        let mut victims = std::mem::take(&mut self.scratch);
        victims.clear();
        let mut released = 0u64;
        if let Some(below) = pool.below_descending(stream, key) {
            for (block_key, idx) in below {
                let block_size = key_size(block_key);
                if released >= key || block_size < max_split {
                    break;
                }
                let block = &self.blocks[idx];
                if !block.is_expandable() && !block.is_split() {
                    released += block.size;
                    victims.push(idx);
                }
            }
        }
        for &idx in &victims {
            self.release_block(idx, tl);
        }
        self.scratch = victims;
        released >= key
    }

    /// §5.3 release_cached_blocks (`empty_cache`, and the last resort of a failing `malloc`): waits for all
    /// deferred frees, then releases every whole cached segment of the large and the small pool and unmaps
    /// the whole free pages of expandable segments. Always succeeds.
    pub(super) fn release_cached_blocks(&mut self, tl: &mut Timeline) -> bool {
        self.synchronize_and_free_events(tl);
        self.release_blocks(PoolKind::Large, tl);
        self.release_blocks(PoolKind::Small, tl);
        true
    }

    /// `release_blocks(pool)`: in set order, frees unsplit segments; then unmaps free expandable blocks and
    /// drops expandable segments left with nothing mapped.
    fn release_blocks(&mut self, kind: PoolKind, tl: &mut Timeline) {
        let mut order = std::mem::take(&mut self.scratch);
        let mut to_unmap = std::mem::take(&mut self.scratch2);
        order.clear();
        to_unmap.clear();
        self.pools[pool_index(kind)].collect_in_order(&mut order);
        for &idx in &order {
            let block = &self.blocks[idx];
            if block.is_expandable() {
                // Unmapping mutates the pool, so it comes after the walk.
                to_unmap.push(idx);
            } else if !block.is_split() {
                self.release_block(idx, tl);
            }
        }
        for &idx in &to_unmap {
            // §7.5 shrink
            self.unmap_block(idx, tl);
            let block = &self.blocks[idx];
            if !block.mapped && !block.is_split() {
                self.release_expandable_segment(idx);
            }
        }
        self.scratch = order;
        self.scratch2 = to_unmap;
    }

    /// §5.4 garbage_collect_cached_blocks: when more than `threshold × allowed` bytes are held, frees whole
    /// cached large segments whose age (`get_free_block` calls since they were cached) is at least the
    /// average age, pass after pass, until the excess is reclaimed or a pass frees nothing.
    pub(super) fn garbage_collect_cached_blocks(&mut self, tl: &mut Timeline) {
        let Some(allowed) = self.allowed_memory_maximum else {
            return;
        };
        let gc_threshold = (self.config.garbage_collection_threshold * allowed as f64) as u64;
        // No need to trigger GC yet.
        if self.total_allocated_memory <= gc_threshold {
            return;
        }
        let target = self.total_allocated_memory - gc_threshold;
        let large = pool_index(PoolKind::Large);
        let now = self.pools[large].get_free_blocks_call_count;
        let age = |base: i64| (now - base) as u64;
        // Total age of the freeable (unsplit) blocks of the default large pool, all streams.
        let mut total_age = 0u64;
        let mut freeable = 0i64;
        for idx in self.pools[large].iter() {
            let block = &self.blocks[idx];
            if !block.is_split() {
                total_age += age(block.gc_count_base);
                freeable += 1;
            }
        }
        if freeable == 0 {
            return;
        }
        let mut reclaimed = 0u64;
        let mut freed = true;
        let mut order = std::mem::take(&mut self.scratch);
        while reclaimed < target && freed && freeable > 0 {
            let age_threshold = total_age as f64 / freeable as f64;
            freed = false;
            order.clear();
            self.pools[large].collect_in_order(&mut order);
            // Free every block at least as old as the average; do not stop at the target within a pass.
            for &idx in &order {
                let block = &self.blocks[idx];
                let block_age = age(block.gc_count_base);
                // NEW: expandable blocks are skipped.
                if !block.is_split() && !block.is_expandable() && block_age as f64 >= age_threshold
                {
                    freed = true;
                    reclaimed += block.size;
                    total_age -= block_age;
                    freeable -= 1;
                    self.release_block(idx, tl);
                }
            }
        }
        self.scratch = order;
    }
}
