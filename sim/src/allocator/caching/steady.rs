//! The steady-state check of repeated replays ([`crate::engine::Repeat`]): a canonical description of
//! everything that decides what the allocator does next, and the counters that a skipped repetition
//! would have moved.
//!
//! Two states with the same key make the same decisions for the same calls: every segment and block
//! (address, size, requested size, stream, pool, whether it is allocated or mapped, its neighbours'
//! presence, its expandable segment), the free pools (which hold exactly the free, mapped blocks with no
//! pending events: `pool.rs`'s invariant), the GC ages of cached blocks (`get_free_blocks_call_count −
//! gc_count_base`, what §5.4's collector compares), the bytes obtained from the device, the address
//! space's bump pointer and the expandable segments' slots. Blocks are named by address, not by arena
//! slot: no decision of the allocator reads a slot index (pools order by (stream, size, address)).
//! States with outstanding stream events, `record_stream` uses, recorded history or address hints are
//! not described (no skip): replaying them in full is always exact.

use super::block::NIL;
use super::{pool_index, CachingAllocator};
use crate::allocator::Counters;
use crate::rounding::PoolKind;

/// Words per block in the steady-state key.
const BLOCK_WORDS: usize = 9;

impl CachingAllocator {
    /// See [`crate::allocator::Allocator::steady_state_key`].
    pub(crate) fn write_steady_state_key(&self, key: &mut Vec<u64>) -> bool {
        if self.record_history || self.events.pending > 0 {
            return false;
        }
        if !self.address_space.steady_state_key(key) {
            return false;
        }
        key.push(self.total_allocated_memory);
        self.segments.steady_state_key(key);
        let start = key.len();
        // every block checked, and the segments' first blocks (`prev` is NIL) gathered to walk them
        let mut heads: Vec<(u64, u32)> = Vec::new();
        let mut count = 0usize;
        for (idx, b) in self.blocks.iter() {
            if b.uses != NIL || b.event_count > 0 {
                key.truncate(start);
                return false;
            }
            count += 1;
            if b.prev == NIL {
                heads.push((b.addr, idx));
            }
        }
        // blocks in address order (one per address: a segment's blocks do not overlap): each
        // segment's chain from its first block, segments by address, which is the order of a sort
        // of every block by address when the walk meets every block at rising addresses (checked;
        // otherwise sorted)
        heads.sort_unstable();
        key.reserve(1 + BLOCK_WORDS * count + 3 * self.stats.arrays().len() + 2);
        key.push(count as u64);
        let blocks_start = key.len();
        let (mut walked, mut last) = (0usize, None::<u64>);
        for &(_, head) in &heads {
            let mut idx = head;
            while idx != NIL {
                let b = &self.blocks[idx];
                if last.is_some_and(|l| l >= b.addr) || walked == count {
                    walked = usize::MAX;
                    break;
                }
                last = Some(b.addr);
                walked += 1;
                self.push_block_key(idx, key);
                idx = b.next;
            }
            if walked == usize::MAX {
                break;
            }
        }
        if walked != count {
            key.truncate(blocks_start);
            let mut order: Vec<(u64, u32)> = self.blocks.iter().map(|(i, b)| (b.addr, i)).collect();
            order.sort_unstable();
            for (_, idx) in order {
                self.push_block_key(idx, key);
            }
        }
        key.extend(self.stats.arrays().iter().flat_map(|(_, a)| {
            [a.all.current, a.small_pool.current, a.large_pool.current].map(|c| c as u64)
        }));
        key.extend([
            self.stats.oversize_allocations.current as u64,
            self.stats.oversize_segments.current as u64,
        ]);
        true
    }

    /// The words of block `idx` in the steady-state key ([`BLOCK_WORDS`] of them).
    #[inline]
    fn push_block_key(&self, idx: u32, key: &mut Vec<u64>) {
        let b = &self.blocks[idx];
        let free = !b.allocated && b.mapped;
        let age = if free {
            // §5.4: the collector reads ages, not the counter itself
            (self.pools[pool_index(b.pool)].get_free_blocks_call_count - b.gc_count_base) as u64
        } else {
            0
        };
        key.extend([
            b.addr,
            b.size,
            b.requested_size,
            b.stream,
            u64::from(b.pool == PoolKind::Large),
            u64::from(b.allocated) | u64::from(b.mapped) << 1,
            u64::from(b.prev != NIL) | u64::from(b.next != NIL) << 1,
            u64::from(b.segment),
            age,
        ]);
    }

    /// See [`crate::allocator::Allocator::counters`].
    pub(crate) fn steady_counters(&self) -> Counters {
        Counters {
            stats: self.stats.clone(),
            gc_calls: [
                self.pools[0].get_free_blocks_call_count,
                self.pools[1].get_free_blocks_call_count,
            ],
        }
    }

    /// See [`crate::allocator::Allocator::carry_repetitions`]: the statistics move on as `n` more
    /// repetitions would move them, and the GC counters with the cached blocks' age bases, so that
    /// every age stays what it is (what `n` identical repetitions leave).
    pub(crate) fn carry_steady_repetitions(&mut self, before: &Counters, n: u64) {
        self.stats.carry_repetitions(&before.stats, n);
        for (p, pool) in self.pools.iter_mut().enumerate() {
            let step = (pool.get_free_blocks_call_count - before.gc_calls[p]) * n as i64;
            if step == 0 {
                continue;
            }
            pool.get_free_blocks_call_count += step;
            for idx in pool.iter() {
                self.blocks[idx].gc_count_base += step;
            }
        }
    }
}
