//! `BlockPool`: the ordered sets of cached (free) blocks of one pool (§2.3).
//!
//! PyTorch keeps one `std::set<Block*>` per pool ordered by **(stream, size, ptr)** — stream first — and
//! searches it with `lower_bound((stream, size, 0))`. Because the stream comes first, the set is a
//! concatenation of one sub-set per stream in stream order; this module stores exactly that: per stream, in
//! ascending stream order, a [`SortedSet`] keyed by `(size, addr)` (one integer: [`key`]) whose value is the block's arena
//! index. Iterating the streams in order and each map in order visits
//! blocks in PyTorch's set order, which GC and `release_blocks` depend on. Stream handles are ordered by their
//! `StreamId`, as PyTorch orders `cudaStream_t` pointer values (the default stream, 0, first).
//!
//! The `unmapped` set of expandable segments (§2.3, ordered by (stream, ptr)) is kept the same way.
//!
//! *Invariant:* a block is in `blocks` iff it is free, mapped and not waiting for events; it is in
//! `unmapped` iff it is an unmapped range of an expandable segment. Its key is the (size, addr) it had when it
//! was inserted; callers remove a block before changing either.

use std::collections::BTreeMap;

use vramsim_traces::StreamId;

use super::sorted::{Ascending, Descending, Pos, SortedSet};

/// `(size, addr)` as one integer, `size << 64 | addr`: PyTorch's size-then-address order within a
/// stream (one comparison instead of two in the block search).
pub(crate) type Key = u128;

/// The key of a block of `size` bytes at `addr`.
#[inline]
pub(crate) fn key(size: u64, addr: u64) -> Key {
    u128::from(size) << 64 | u128::from(addr)
}

/// The size a key orders by.
#[inline]
pub(crate) fn key_size(key: Key) -> u64 {
    (key >> 64) as u64
}

/// The free blocks of one stream, best fit first.
#[derive(Clone, Debug)]
struct StreamBlocks {
    stream: StreamId,
    blocks: SortedSet<Key>,
}

/// The unmapped ranges of one stream's expandable segments, by address.
#[derive(Clone, Debug)]
struct StreamUnmapped {
    stream: StreamId,
    blocks: BTreeMap<u64, u32>,
}

/// PyTorch's `BlockPool`: the small or the large pool of cached blocks.
#[derive(Clone, Debug, Default)]
pub(crate) struct BlockPool {
    /// `blocks`, one ordered map per stream, streams ascending.
    streams: Vec<StreamBlocks>,
    /// `unmapped`, one ordered map per stream, streams ascending.
    unmapped: Vec<StreamUnmapped>,
    /// `get_free_blocks_call_count`: `get_free_block` calls while GC is enabled (§5.4 ages).
    pub get_free_blocks_call_count: i64,
}

impl BlockPool {
    /// An empty pool.
    pub fn new() -> BlockPool {
        BlockPool {
            streams: Vec::new(),
            unmapped: Vec::new(),
            get_free_blocks_call_count: 0,
        }
    }

    #[inline]
    fn stream_blocks(&self, stream: StreamId) -> Option<&SortedSet<Key>> {
        self.streams
            .iter()
            .find(|s| s.stream == stream)
            .map(|s| &s.blocks)
    }

    #[inline(always)]
    fn stream_blocks_mut(&mut self, stream: StreamId) -> &mut SortedSet<Key> {
        let pos = match self.streams.iter().position(|s| s.stream == stream) {
            Some(pos) => pos,
            None => self.add_stream(stream),
        };
        &mut self.streams[pos].blocks
    }

    /// The first free block of a stream: a new, empty set in stream order.
    #[cold]
    #[inline(never)]
    fn add_stream(&mut self, stream: StreamId) -> usize {
        let pos = self.streams.partition_point(|s| s.stream < stream);
        self.streams.insert(
            pos,
            StreamBlocks {
                stream,
                blocks: SortedSet::default(),
            },
        );
        pos
    }

    /// Inserts a free block (the caller sets its `gc_count_base`: `insert_into_blocks`).
    #[inline]
    pub fn insert(&mut self, stream: StreamId, size: u64, addr: u64, idx: u32) {
        let inserted = self.stream_blocks_mut(stream).insert(key(size, addr), idx);
        debug_assert!(inserted, "block inserted twice");
    }

    /// Removes the free block with this key.
    #[inline]
    pub fn remove(&mut self, stream: StreamId, size: u64, addr: u64) {
        let removed = self.stream_blocks_mut(stream).remove(key(size, addr));
        debug_assert!(removed.is_some(), "block not in its pool");
    }

    /// `lower_bound((stream, size, 0))`: this stream's free blocks of at least `size` bytes, smallest
    /// first, ties by lowest address, as `(key, index)` ([`key`]).
    #[inline]
    pub fn at_least(&self, stream: StreamId, size: u64) -> Option<Ascending<'_, Key>> {
        self.stream_blocks(stream)
            .map(|blocks| blocks.from(key(size, 0)))
    }

    /// Removes the block `at_least(stream, ..)` last returned (see `Ascending::last_position`).
    #[inline]
    pub fn remove_at(&mut self, stream: StreamId, pos: Pos) {
        self.stream_blocks_mut(stream).remove_at(pos);
    }

    /// This stream's free blocks smaller than `size` bytes, largest first (the walk down from the largest
    /// block below a key).
    pub fn below_descending(&self, stream: StreamId, size: u64) -> Option<Descending<'_, Key>> {
        self.stream_blocks(stream)
            .map(|blocks| blocks.below_descending(key(size, 0)))
    }

    /// Every free block in PyTorch's set order (stream, size, addr), appended to `out`.
    pub fn collect_in_order(&self, out: &mut Vec<u32>) {
        for stream in &self.streams {
            out.extend(stream.blocks.iter().map(|(_, idx)| idx));
        }
    }

    /// Every free block in set order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.streams
            .iter()
            .flat_map(|s| s.blocks.iter().map(|(_, idx)| idx))
    }

    /// Number of free blocks.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.streams.iter().map(|s| s.blocks.len()).sum()
    }

    fn stream_unmapped_mut(&mut self, stream: StreamId) -> &mut BTreeMap<u64, u32> {
        let pos = match self.unmapped.iter().position(|s| s.stream == stream) {
            Some(pos) => pos,
            None => {
                let pos = self.unmapped.partition_point(|s| s.stream < stream);
                self.unmapped.insert(
                    pos,
                    StreamUnmapped {
                        stream,
                        blocks: BTreeMap::new(),
                    },
                );
                pos
            }
        };
        &mut self.unmapped[pos].blocks
    }

    /// Inserts an unmapped range of an expandable segment.
    pub fn insert_unmapped(&mut self, stream: StreamId, addr: u64, idx: u32) {
        let previous = self.stream_unmapped_mut(stream).insert(addr, idx);
        debug_assert!(previous.is_none(), "unmapped block inserted twice");
    }

    /// Removes an unmapped range.
    pub fn remove_unmapped(&mut self, stream: StreamId, addr: u64) {
        let removed = self.stream_unmapped_mut(stream).remove(&addr);
        debug_assert!(removed.is_some(), "unmapped block not in its pool");
    }

    /// This stream's unmapped ranges by ascending address, appended to `out`.
    pub fn collect_unmapped(&self, stream: StreamId, out: &mut Vec<u32>) {
        if let Some(s) = self.unmapped.iter().find(|s| s.stream == stream) {
            out.extend(s.blocks.values().copied());
        }
    }
}
