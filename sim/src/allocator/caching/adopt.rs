//! Starting from a recorded state: segments that exist before the first event of a trace (`{"op":
//! "segment"}`, the state a PyTorch snapshot's history starts from).
//!
//! An adopted segment is laid out as PyTorch would hold it: the declared live blocks allocated, every gap
//! between them one cached block (free neighbours always merge, §4.2). Statistics count the segment and
//! its blocks as current (`segment`, `reserved_bytes`, `allocation`, `allocated_bytes`, `active`,
//! `requested_bytes`, `inactive_split` for the gaps of a split segment, §8.4); `num_device_alloc` is not
//! counted and no history is recorded, since nothing happened. An expandable range (§7) goes into its
//! stream's reservation for the pool, made at the first range adopted for them (at that range's address,
//! (or at the `base` the event gives), with PyTorch's size, §7.1); later ranges must lie on its page grid.
//!
//! Address hints (the addresses a real GPU gave the segments of a recorded run) also live here: see
//! [`CachingAllocator::set_segment_address_hints`].

use vramsim_traces::InitialSegment;

use crate::allocator::{AdoptError, BlockRef};
use crate::rounding::PoolKind;

use super::block::{Block, NIL};
use super::{pool_index, CachingAllocator};

impl CachingAllocator {
    /// The device addresses the next new segments (a `cudaMalloc`, or an expandable segment's
    /// reservation) should get, in order of preference: those a real GPU gave them in a recorded run. A
    /// hint is used only where the whole segment fits there without overlapping a live one; otherwise
    /// the simulated address space places it. Replaces earlier hints; an empty slice clears them.
    pub fn set_segment_address_hints(&mut self, hints: &[u64]) {
        self.address_space.set_hints(hints);
    }

    /// `Allocator::adopt_segment` for the caching allocator.
    pub(super) fn adopt(&mut self, seg: &InitialSegment) -> Result<Vec<BlockRef>, AdoptError> {
        let kind = PoolKind::from(seg.pool);
        let free = self.device_free();
        if seg.size > free {
            return Err(AdoptError::DoesNotFit {
                addr: seg.addr,
                needed: seg.size,
                free,
            });
        }
        // the range the blocks go into: (first block's prev, last block's next, expandable slot)
        let (before, after, slot) = if seg.expandable {
            self.adopt_mapped_range(seg, kind)?
        } else {
            self.address_space
                .place(seg.addr, seg.size)
                .map_err(|(other, end)| AdoptError::Overlap {
                    addr: seg.addr,
                    size: seg.size,
                    other,
                    other_size: end - other,
                })?;
            (NIL, NIL, NIL)
        };
        // the chain: free gaps and the declared blocks, in address order
        let mut chain: Vec<(u32, bool)> = Vec::with_capacity(2 * seg.blocks.len() + 1);
        let mut refs = Vec::with_capacity(seg.blocks.len());
        let mut cursor = 0u64;
        let make = |this: &mut Self, offset: u64, size: u64| {
            let mut block = Block::new(seg.addr + offset, size, seg.stream, kind);
            block.segment = slot;
            this.blocks.insert(block)
        };
        for b in &seg.blocks {
            if b.offset > cursor {
                chain.push((make(self, cursor, b.offset - cursor), false));
            }
            let idx = make(self, b.offset, b.size);
            let block = &mut self.blocks[idx];
            block.allocated = true;
            block.requested_size = b.requested;
            chain.push((idx, true));
            refs.push(BlockRef(idx));
            cursor = b.offset + b.size;
        }
        if cursor < seg.size {
            chain.push((make(self, cursor, seg.size - cursor), false));
        }
        let mut prev = before;
        for &(idx, _) in &chain {
            self.blocks[idx].prev = prev;
            if prev != NIL {
                self.blocks[prev].next = idx;
            }
            prev = idx;
        }
        self.blocks[prev].next = after;
        if after != NIL {
            self.blocks[after].prev = prev;
        }

        // statistics of the segment (§3.3; §7.2: a mapped range is reserved bytes, not a segment)
        self.total_allocated_memory += seg.size;
        self.stats.reserved_bytes.increase(kind, seg.size);
        if seg.expandable {
            self.segments.get_mut(slot).mapped_bytes += seg.size;
        } else {
            self.stats.segment.increase(kind, 1);
            if seg.size >= self.config.max_split_size {
                self.stats.oversize_segments.increase(1);
            }
        }
        // ... and of its blocks (§3.4 for the allocated ones, §4.2 for the cached gaps)
        let split = chain.len() > 1;
        for &(idx, allocated) in &chain {
            let (size, requested) = (self.blocks[idx].size, self.blocks[idx].requested_size);
            if allocated {
                let stats = &mut self.stats;
                stats.allocation.increase(kind, 1);
                stats.allocated_bytes.increase(kind, size);
                stats.active.increase(kind, 1);
                stats.active_bytes.increase(kind, size);
                stats.requested_bytes.increase(kind, requested);
                if size >= self.config.max_split_size {
                    stats.oversize_allocations.increase(1);
                }
            } else {
                self.insert_free(idx);
                if split && !seg.expandable {
                    self.stats.inactive_split.increase(kind, 1);
                    self.stats.inactive_split_bytes.increase(kind, size);
                }
            }
        }
        Ok(refs)
    }

    /// Maps `seg`'s range in its stream's reservation for the pool (made if there is none yet): carves it
    /// out of the unmapped block holding it and returns the neighbours the range's blocks link to and
    /// the reservation's slot.
    fn adopt_mapped_range(
        &mut self,
        seg: &InitialSegment,
        kind: PoolKind,
    ) -> Result<(u32, u32, u32), AdoptError> {
        let (page, pages) = self.expandable_geometry(kind);
        let slot = match self.segments.containing(seg.stream, kind, seg.addr) {
            Some(slot) => slot,
            None => {
                // a reservation of PyTorch's size starting at `base` (or the range), large enough for
                // the range in any case
                let base = seg.base.unwrap_or(seg.addr);
                let max_pages = pages.max((seg.addr + seg.size - base).div_ceil(page));
                self.address_space
                    .place(base, max_pages * page)
                    .map_err(|(other, end)| AdoptError::Overlap {
                        addr: base,
                        size: max_pages * page,
                        other,
                        other_size: end - other,
                    })?;
                let unmapped = self.new_expandable_segment(kind, seg.stream, base, max_pages);
                self.blocks[unmapped].segment
            }
        };
        let base = self.segments.get(slot).base;
        let off_grid = AdoptError::NotOnPageGrid {
            addr: seg.addr,
            size: seg.size,
            page,
            base,
        };
        if !(seg.addr - base).is_multiple_of(page) || !seg.size.is_multiple_of(page) {
            return Err(off_grid);
        }
        // the unmapped block that holds the whole range
        let mut unmapped = std::mem::take(&mut self.scratch2);
        unmapped.clear();
        self.pools[pool_index(kind)].collect_unmapped(seg.stream, &mut unmapped);
        let end = seg.addr + seg.size;
        let holder = unmapped.iter().copied().find(|&idx| {
            let b = &self.blocks[idx];
            b.segment == slot && b.addr <= seg.addr && end <= b.addr + b.size
        });
        self.scratch2 = unmapped;
        let Some(holder) = holder else {
            return Err(off_grid);
        };
        let (h_addr, h_size, h_prev, h_next) = {
            let b = &self.blocks[holder];
            (b.addr, b.size, b.prev, b.next)
        };
        let pool = &mut self.pools[pool_index(kind)];
        pool.remove_unmapped(seg.stream, h_addr);
        self.blocks.remove(holder);
        let unmapped_piece = |this: &mut Self, addr: u64, size: u64| {
            let mut b = Block::new(addr, size, seg.stream, kind);
            b.mapped = false;
            b.segment = slot;
            let idx = this.blocks.insert(b);
            this.pools[pool_index(kind)].insert_unmapped(seg.stream, addr, idx);
            idx
        };
        let mut before = h_prev;
        if seg.addr > h_addr {
            let idx = unmapped_piece(self, h_addr, seg.addr - h_addr);
            self.blocks[idx].prev = h_prev;
            if h_prev != NIL {
                self.blocks[h_prev].next = idx;
            }
            before = idx;
        }
        let mut after = h_next;
        if end < h_addr + h_size {
            let idx = unmapped_piece(self, end, h_addr + h_size - end);
            self.blocks[idx].next = h_next;
            if h_next != NIL {
                self.blocks[h_next].prev = idx;
            }
            after = idx;
        }
        Ok((before, after, slot))
    }
}

#[cfg(test)]
mod tests {
    use vramsim_traces::{AllocId, Category, InitialBlock, Pool};

    use super::*;
    use crate::allocator::caching::check_snapshot;
    use crate::allocator::Allocator;
    use crate::config::AllocatorConfig;
    use crate::device::Device;
    use crate::timeline::Timeline;

    fn block(id: u64, offset: u64, size: u64) -> InitialBlock {
        InitialBlock {
            id: AllocId::Int(id),
            offset,
            size,
            requested: size - 100,
            category: Category::Other,
            tag: None,
        }
    }

    #[test]
    fn an_adopted_segment_has_its_blocks_and_merged_gaps() {
        let mut a =
            CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(1 << 30));
        let mib = 1 << 20;
        let refs = a
            .adopt_segment(&InitialSegment {
                addr: 0x1000_0000,
                size: 20 * mib,
                stream: 0,
                pool: Pool::Large,
                expandable: false,
                base: None,
                blocks: vec![block(1, 2 * mib, 4 * mib), block(2, 6 * mib, 4 * mib)],
            })
            .unwrap();
        assert_eq!(refs.len(), 2);
        let segs = a.segments();
        assert_eq!(segs.len(), 1);
        let sizes: Vec<u64> = segs[0].blocks.iter().map(|b| b.size).collect();
        assert_eq!(sizes, [2 * mib, 4 * mib, 4 * mib, 10 * mib]);
        check_snapshot(a.stats(), &a.segments()).unwrap();
        assert_eq!(a.stats().inactive_split.all.current, 2);
        // the 10 MiB tail is the best fit for 8 MiB; freeing merges everything back
        let mut tl = Timeline::new();
        let b = a.malloc(8 * mib, 0, &mut tl).unwrap();
        assert_eq!(a.block_address(b), 0x1000_0000 + 10 * mib);
        for r in refs.into_iter().chain([b]) {
            a.free(r, &mut tl);
        }
        assert_eq!(a.segments()[0].blocks.len(), 1);
        a.empty_cache(&mut tl);
        assert_eq!(a.stats().reserved_bytes.all.current, 0);
        check_snapshot(a.stats(), &a.segments()).unwrap();
    }

    #[test]
    fn overlapping_and_oversized_segments_are_refused() {
        let mut a =
            CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(64 << 20));
        let seg = |addr, size| InitialSegment {
            addr,
            size,
            stream: 0,
            pool: Pool::Large,
            expandable: false,
            base: None,
            blocks: vec![],
        };
        a.adopt_segment(&seg(0x1000_0000, 20 << 20)).unwrap();
        assert!(matches!(
            a.adopt_segment(&seg(0x1000_0000 + (10 << 20), 20 << 20)),
            Err(AdoptError::Overlap { .. })
        ));
        assert!(matches!(
            a.adopt_segment(&seg(0x2000_0000, 60 << 20)),
            Err(AdoptError::DoesNotFit { .. })
        ));
    }

    #[test]
    fn expandable_ranges_join_one_reservation_and_grow_from_it() {
        let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
        let mut a = CachingAllocator::new(config, Device::with_capacity(1 << 30));
        let mib = 1 << 20;
        let range = |addr, size, blocks| InitialSegment {
            addr,
            size,
            stream: 0,
            pool: Pool::Large,
            expandable: true,
            base: None,
            blocks,
        };
        let base = 0x4000_0000;
        a.adopt_segment(&range(base, 40 * mib, vec![block(1, 0, 30 * mib)]))
            .unwrap();
        a.adopt_segment(&range(base + 60 * mib, 20 * mib, vec![]))
            .unwrap();
        assert!(matches!(
            a.adopt_segment(&range(base + 90 * mib, 20 * mib, vec![])),
            Err(AdoptError::NotOnPageGrid { .. })
        ));
        assert_eq!(a.expandable_segment_count(), 1);
        assert_eq!(a.stats().reserved_bytes.all.current, 60 << 20);
        assert_eq!(a.stats().segment.all.current, 0);
        let segs = a.segments();
        assert_eq!(segs.len(), 2);
        check_snapshot(a.stats(), &a.segments()).unwrap();
        // 25 MiB: the 10 MiB free tail of the first range + one mapped page (the hole at 40 MiB)
        let mut tl = Timeline::new();
        a.set_record_history(true);
        let b = a.malloc(25 * mib, 0, &mut tl).unwrap();
        assert_eq!(a.block_address(b), base + 30 * mib);
        let maps: Vec<_> = a
            .take_history()
            .into_iter()
            .map(|h| (h.action, h.addr, h.size))
            .collect();
        assert_eq!(
            maps[0],
            (
                crate::allocator::Action::SegmentMap,
                base + 40 * mib,
                20 * mib
            )
        );
        check_snapshot(a.stats(), &a.segments()).unwrap();
    }
}
