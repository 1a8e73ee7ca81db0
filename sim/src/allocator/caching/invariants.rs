//! Consistency checks between `memory_stats()` and `memory_snapshot()` (§8.4), as PyTorch's
//! `_check_memory_stat_consistency` test helper does them, plus the layout checks a simulator owes:
//! segments do not overlap and blocks tile their segment exactly.
//!
//! These are for tests and debug runs; they format text only when something is wrong.

use crate::allocator::{BlockState, SegmentInfo};
use crate::rounding::PoolKind;
use crate::stats::{MemoryStats, Stat, StatArray};

/// Checks the §8.4 invariants between `stats` and `segments` and the layout of `segments`; returns the first
/// violation found.
///
/// For every pool (`all`, `small_pool`, `large_pool`): `segment` = number of non-expandable segments (the
/// stat is not kept for expandable segments), `reserved_bytes` = Σ `total_size`, `allocated_bytes` =
/// Σ `allocated_size`, `active_bytes` = Σ `active_size`, `requested_bytes` = Σ `requested_size`,
/// `allocation` = number of `active_allocated` blocks, `active` = number of `active_*` blocks,
/// `inactive_split`/`inactive_split_bytes` = count/Σ size of inactive blocks in non-expandable segments of
/// more than one block. Also: segments sorted and disjoint, blocks contiguous and summing to the segment,
/// per-segment sums matching the blocks, and `current ≤ peak` for every stat.
pub fn check_snapshot(stats: &MemoryStats, segments: &[SegmentInfo]) -> Result<(), String> {
    let mut expected = Expected::default();
    let mut previous_end = 0u64;
    for (i, seg) in segments.iter().enumerate() {
        if seg.address < previous_end {
            return Err(format!(
                "segment {i} at {:#x} overlaps the previous one (ends at {previous_end:#x})",
                seg.address
            ));
        }
        previous_end = seg.address + seg.total_size;
        check_segment(i, seg)?;
        for pool in [None, Some(seg.pool)] {
            let e = expected.pool_mut(pool);
            if !seg.is_expandable {
                e.segment += 1;
            }
            e.reserved_bytes += seg.total_size;
            e.allocated_bytes += seg.allocated_size;
            e.active_bytes += seg.active_size;
            e.requested_bytes += seg.requested_size;
            for b in &seg.blocks {
                match b.state {
                    BlockState::ActiveAllocated => {
                        e.allocation += 1;
                        e.active += 1;
                    }
                    BlockState::ActivePendingFree => e.active += 1,
                    BlockState::Inactive => {
                        if !seg.is_expandable && seg.blocks.len() > 1 {
                            e.inactive_split += 1;
                            e.inactive_split_bytes += b.size;
                        }
                    }
                }
            }
        }
    }
    for (pool, name) in [
        (None, "all"),
        (Some(PoolKind::Small), "small_pool"),
        (Some(PoolKind::Large), "large_pool"),
    ] {
        let e = expected.pool_mut(pool);
        for (key, array, want) in [
            ("segment", &stats.segment, e.segment),
            ("reserved_bytes", &stats.reserved_bytes, e.reserved_bytes),
            ("allocated_bytes", &stats.allocated_bytes, e.allocated_bytes),
            ("active_bytes", &stats.active_bytes, e.active_bytes),
            ("requested_bytes", &stats.requested_bytes, e.requested_bytes),
            ("allocation", &stats.allocation, e.allocation),
            ("active", &stats.active, e.active),
            ("inactive_split", &stats.inactive_split, e.inactive_split),
            (
                "inactive_split_bytes",
                &stats.inactive_split_bytes,
                e.inactive_split_bytes,
            ),
        ] {
            let got = select(array, pool).current;
            if got != want as i64 {
                return Err(format!(
                    "{key}.{name}.current is {got} but the snapshot says {want}"
                ));
            }
        }
    }
    for (key, array) in stats.arrays() {
        for (pool, stat) in [
            ("all", &array.all),
            ("small_pool", &array.small_pool),
            ("large_pool", &array.large_pool),
        ] {
            check_stat(&format!("{key}.{pool}"), stat)?;
        }
    }
    check_stat("oversize_allocations", &stats.oversize_allocations)?;
    check_stat("oversize_segments", &stats.oversize_segments)?;
    Ok(())
}

fn check_segment(i: usize, seg: &SegmentInfo) -> Result<(), String> {
    let mut at = seg.address;
    let (mut allocated, mut active, mut requested) = (0, 0, 0);
    if seg.blocks.is_empty() {
        return Err(format!("segment {i} has no blocks"));
    }
    for (j, b) in seg.blocks.iter().enumerate() {
        if b.address != at {
            return Err(format!(
                "segment {i} block {j} starts at {:#x}, expected {at:#x}",
                b.address
            ));
        }
        if b.size == 0 {
            return Err(format!("segment {i} block {j} is empty"));
        }
        at += b.size;
        if b.state == BlockState::ActiveAllocated {
            allocated += b.size;
        }
        if b.state != BlockState::Inactive {
            active += b.size;
            requested += b.requested_size;
            if b.requested_size > b.size {
                return Err(format!(
                    "segment {i} block {j}: requested {} > size {}",
                    b.requested_size, b.size
                ));
            }
        }
        if j > 0
            && b.state == BlockState::Inactive
            && seg.blocks[j - 1].state == BlockState::Inactive
        {
            return Err(format!(
                "segment {i} blocks {} and {j} are adjacent free blocks that were not merged",
                j - 1
            ));
        }
    }
    if at - seg.address != seg.total_size {
        return Err(format!(
            "segment {i}: blocks cover {} bytes of {}",
            at - seg.address,
            seg.total_size
        ));
    }
    if (allocated, active, requested) != (seg.allocated_size, seg.active_size, seg.requested_size) {
        return Err(format!(
            "segment {i}: sums (allocated, active, requested) = {:?} but the segment says {:?}",
            (allocated, active, requested),
            (seg.allocated_size, seg.active_size, seg.requested_size)
        ));
    }
    Ok(())
}

fn check_stat(name: &str, stat: &Stat) -> Result<(), String> {
    if stat.current < 0 || stat.current > stat.peak {
        return Err(format!(
            "{name}: current {} is negative or above peak {}",
            stat.current, stat.peak
        ));
    }
    if stat.allocated - stat.freed > stat.current {
        // allocated − freed = current − (current at the last accumulated reset) ≤ current.
        return Err(format!(
            "{name}: allocated {} − freed {} exceeds current {}",
            stat.allocated, stat.freed, stat.current
        ));
    }
    Ok(())
}

fn select(array: &StatArray, pool: Option<PoolKind>) -> &Stat {
    match pool {
        None => &array.all,
        Some(kind) => array.pool(kind),
    }
}

#[derive(Default)]
struct Counts {
    segment: u64,
    reserved_bytes: u64,
    allocated_bytes: u64,
    active_bytes: u64,
    requested_bytes: u64,
    allocation: u64,
    active: u64,
    inactive_split: u64,
    inactive_split_bytes: u64,
}

#[derive(Default)]
struct Expected {
    all: Counts,
    small: Counts,
    large: Counts,
}

impl Expected {
    fn pool_mut(&mut self, pool: Option<PoolKind>) -> &mut Counts {
        match pool {
            None => &mut self.all,
            Some(PoolKind::Small) => &mut self.small,
            Some(PoolKind::Large) => &mut self.large,
        }
    }
}
