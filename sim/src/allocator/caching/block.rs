//! `Block` and the arena that owns every block (PyTorch's `struct Block`, §2.2).
//!
//! PyTorch allocates each `Block` with `new` and links neighbours of a segment with raw `prev`/`next`
//! pointers. Here blocks live in one `Vec<Block>` and refer to each other by `u32` index, with a free list of
//! vacant slots, so that splitting and merging allocate nothing once the arena has grown to the workload's
//! high-water mark.
//!
//! *Invariant:* the index of an allocated block never changes while it is allocated (the caller's
//! `BlockRef`); only free blocks are merged away.

use std::ops::{Index, IndexMut};

use vramsim_traces::StreamId;

use crate::rounding::PoolKind;

/// The null link (`nullptr` in PyTorch).
pub(crate) const NIL: u32 = u32::MAX;

/// One block: a contiguous range of a segment, allocated, cached or (expandable segments) unmapped.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    /// `ptr`: device address of the first byte.
    pub addr: u64,
    /// `size`: bytes (a multiple of 512).
    pub size: u64,
    /// `requested_size`: what the caller asked for when it was last handed out.
    pub requested_size: u64,
    /// `stream`: the allocation stream; the block only ever serves this stream.
    pub stream: StreamId,
    /// `gc_count_base`: the pool's `get_free_blocks_call_count` when the block was cached (§5.4).
    pub gc_count_base: i64,
    /// `prev`: the neighbour at lower addresses in the same segment, or `NIL`.
    pub prev: u32,
    /// `next`: the neighbour at higher addresses in the same segment, or `NIL`.
    pub next: u32,
    /// `expandable_segment_`: index of the expandable segment this block belongs to, or `NIL`.
    pub segment: u32,
    /// `event_count`: outstanding CUDA events of a deferred free (§4.1).
    pub event_count: u32,
    /// `stream_uses`: slot in `StreamUses` of the streams recorded with `record_stream`, or `NIL`.
    pub uses: u32,
    /// The pool (`pool->is_small`).
    pub pool: PoolKind,
    /// `allocated`: handed out to the caller.
    pub allocated: bool,
    /// `mapped`: backed by physical pages (always true outside expandable segments).
    pub mapped: bool,
    /// The arena slot holds a block (false on the free list).
    pub live: bool,
}

impl Block {
    /// A free, mapped, unlinked block.
    #[inline]
    pub fn new(addr: u64, size: u64, stream: StreamId, pool: PoolKind) -> Block {
        Block {
            addr,
            size,
            requested_size: 0,
            stream,
            gc_count_base: 0,
            prev: NIL,
            next: NIL,
            segment: NIL,
            event_count: 0,
            uses: NIL,
            pool,
            allocated: false,
            mapped: true,
            live: true,
        }
    }

    /// `is_split()`: the block shares its segment with other blocks.
    #[inline]
    pub fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }

    /// Part of an expandable segment.
    #[inline]
    pub fn is_expandable(&self) -> bool {
        self.segment != NIL
    }

    /// Allocated or waiting for stream events (`active` in snapshots and stats).
    #[inline]
    pub fn is_active(&self) -> bool {
        self.allocated || self.event_count > 0 || self.uses != NIL
    }
}

/// Every block, by index, with a free list of vacant slots.
#[derive(Clone, Debug, Default)]
pub(crate) struct BlockArena {
    blocks: Vec<Block>,
    vacant: Vec<u32>,
}

impl BlockArena {
    /// Stores `block` and returns its index (reusing the most recently vacated slot).
    #[inline]
    pub fn insert(&mut self, block: Block) -> u32 {
        match self.vacant.pop() {
            Some(idx) => {
                self.blocks[idx as usize] = block;
                idx
            }
            None => {
                let idx = self.blocks.len() as u32;
                assert!(idx != NIL, "block arena exhausted");
                self.blocks.push(block);
                idx
            }
        }
    }

    /// Deletes the block at `idx` (PyTorch's `delete block`).
    #[inline]
    pub fn remove(&mut self, idx: u32) {
        let block = &mut self.blocks[idx as usize];
        debug_assert!(block.live, "block {idx} deleted twice");
        block.live = false;
        self.vacant.push(idx);
    }

    /// Whether `idx` names a live block.
    #[inline]
    pub fn contains(&self, idx: u32) -> bool {
        self.blocks.get(idx as usize).is_some_and(|b| b.live)
    }

    /// Live blocks with their indices, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &Block)> + '_ {
        self.blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.live)
            .map(|(i, b)| (i as u32, b))
    }
}

impl Index<u32> for BlockArena {
    type Output = Block;

    #[inline]
    fn index(&self, idx: u32) -> &Block {
        &self.blocks[idx as usize]
    }
}

impl IndexMut<u32> for BlockArena {
    #[inline]
    fn index_mut(&mut self, idx: u32) -> &mut Block {
        &mut self.blocks[idx as usize]
    }
}
