//! `torch.cuda.memory_snapshot()` (§10.2): segments and their blocks.
//!
//! As PyTorch's `snapshot()`, a segment is reported from each mapped block whose predecessor is missing or
//! unmapped, walking forward while blocks are mapped; for ordinary segments that is the whole segment, for
//! expandable segments one entry per contiguous mapped range. Segments are sorted by address. Unlike
//! PyTorch, which reports the stale `requested_size` of cached blocks, an inactive block reports 0
//! (`BlockInfo::requested_size`).

use crate::allocator::{BlockInfo, BlockState, SegmentInfo};

use super::block::NIL;
use super::CachingAllocator;

impl CachingAllocator {
    /// The snapshot's segments, sorted by address.
    pub(super) fn snapshot(&self) -> Vec<SegmentInfo> {
        let mut segments = Vec::new();
        for (head, block) in self.blocks.iter() {
            if !block.mapped || (block.prev != NIL && self.blocks[block.prev].mapped) {
                continue;
            }
            let mut segment = SegmentInfo {
                address: block.addr,
                total_size: 0,
                allocated_size: 0,
                active_size: 0,
                requested_size: 0,
                stream: block.stream,
                pool: block.pool,
                is_expandable: block.is_expandable(),
                blocks: Vec::new(),
            };
            let mut idx = head;
            while idx != NIL && self.blocks[idx].mapped {
                let b = &self.blocks[idx];
                let active = b.is_active();
                let state = if b.allocated {
                    BlockState::ActiveAllocated
                } else if active {
                    BlockState::ActivePendingFree
                } else {
                    BlockState::Inactive
                };
                let requested_size = if active { b.requested_size } else { 0 };
                segment.total_size += b.size;
                if b.allocated {
                    segment.allocated_size += b.size;
                }
                if active {
                    segment.active_size += b.size;
                    segment.requested_size += requested_size;
                }
                segment.blocks.push(BlockInfo {
                    address: b.addr,
                    size: b.size,
                    requested_size,
                    state,
                });
                idx = b.next;
            }
            segments.push(segment);
        }
        segments.sort_by_key(|s| s.address);
        segments
    }
}
