//! The state recording began from: the final segments with the history undone, newest entry first
//! (see the module doc of [`super`]), written as `segment` events, with the sizes of the blocks the
//! history only shows freed inferred by the allocator's own rules.

use std::collections::{BTreeMap, HashMap, HashSet};

use vramsim_traces::snapshot::{Action, BlockState, Segment, SegmentType, Snapshot, TraceEntry};
use vramsim_traces::{AllocId, Category, Event, InitialBlock, InitialSegment, Pool, StreamId};

use crate::allocator::caching::expandable::page_size;
use crate::allocator::caching::{exceeds_non_split_rounding, should_split};
use crate::config::AllocatorConfig;
use crate::rounding::{round_size, PoolKind, LARGE_BUFFER};

use super::expandable::ExpandableLayout;
use super::{segment_pool, Recorded};

/// The reconstructed state, as the trace starts it.
pub(super) struct Initial {
    /// One `segment` event per initial segment, in address order.
    pub events: Vec<Event>,
    /// Blocks waiting for stream events at the start, in address order.
    pub pending: Vec<u64>,
    /// The blocks live at the start (their ids in the trace are their addresses).
    pub live: HashSet<u64>,
}

/// A live block while walking the history.
#[derive(Clone, Copy, Debug)]
struct LiveBlock {
    /// Known size (from the final segments), or `None` when it must be inferred.
    size: Option<u64>,
    requested: u64,
    /// Waiting for stream events.
    pending: bool,
}

/// A segment of the reconstructed state with its live blocks, each with the room up to the next one:
/// (segment address, segment, [(block address, block, room)]).
type InitialLayout = (u64, SegmentInfo, Vec<(u64, LiveBlock, u64)>);

/// A segment of the reconstructed state.
#[derive(Clone, Copy, Debug)]
struct SegmentInfo {
    size: u64,
    stream: StreamId,
    pool: Pool,
    expandable: bool,
}

/// Reconstructs device `device`'s state at the first entry of its history; fills in the final and
/// initial figures of `rec` and notes what had to be stepped around.
pub(super) fn reconstruct(
    snapshot: &Snapshot,
    device: u32,
    entries: &[TraceEntry],
    config: &AllocatorConfig,
    rec: &mut Recorded,
) -> Initial {
    // ---- the final state
    let final_segments: Vec<&Segment> = snapshot
        .segments
        .iter()
        .filter(|s| s.device == device)
        .collect();
    rec.final_segments = final_segments.len();
    rec.final_reserved = final_segments.iter().map(|s| s.total_size).sum();
    rec.final_allocated = final_segments.iter().map(|s| s.allocated_size).sum();
    let mut segments: BTreeMap<u64, SegmentInfo> = BTreeMap::new();
    let mut live: HashMap<u64, LiveBlock> = HashMap::new();
    for s in &final_segments {
        let pool = pool_of_type(s.segment_type);
        insert_range(
            &mut segments,
            s.address,
            SegmentInfo {
                size: s.total_size,
                stream: s.stream,
                pool,
                expandable: s.is_expandable,
            },
        );
        for b in &s.blocks {
            if b.state.is_active() {
                live.insert(
                    b.address,
                    LiveBlock {
                        size: Some(b.size),
                        requested: b.requested_size,
                        pending: b.state == BlockState::ActivePendingFree,
                    },
                );
            }
        }
    }

    // ---- undo the history, newest first
    // the pool of every block address recorded (for mapped ranges seen only unmapped)
    let mut alloc_pools: Vec<(u64, Pool)> = if rec.segment_unmaps > 0 {
        entries
            .iter()
            .filter(|e| {
                matches!(
                    e.action,
                    Action::Alloc | Action::FreeRequested | Action::FreeCompleted
                )
            })
            .map(|e| (e.addr, PoolKind::of(round_size(e.size, config)).into()))
            .collect()
    } else {
        Vec::new()
    };
    alloc_pools.sort_unstable_by_key(|&(a, _)| a);
    for (i, e) in entries.iter().enumerate().rev() {
        match e.action {
            Action::Alloc => {
                if live.remove(&e.addr).is_none() {
                    rec.notes.push(format!(
                        "entry {i}: alloc of {:#x}, which is neither live at the end nor freed later",
                        e.addr
                    ));
                }
            }
            Action::FreeRequested => match live.get_mut(&e.addr) {
                Some(b) if b.pending => b.pending = false,
                Some(_) => rec.notes.push(format!(
                    "entry {i}: free_requested of {:#x}, which is freed again later without an alloc",
                    e.addr
                )),
                None => {
                    live.insert(
                        e.addr,
                        LiveBlock {
                            size: None,
                            requested: e.size,
                            pending: false,
                        },
                    );
                }
            },
            Action::FreeCompleted => match live.entry(e.addr) {
                std::collections::hash_map::Entry::Occupied(_) => rec.notes.push(format!(
                    "entry {i}: free_completed of {:#x}, which is live later without an alloc",
                    e.addr
                )),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(LiveBlock {
                        size: None,
                        requested: e.size,
                        pending: true,
                    });
                }
            },
            Action::SegmentAlloc => {
                if segments.remove(&e.addr).is_none() {
                    rec.notes.push(format!(
                        "entry {i}: segment_alloc of {:#x}, which does not exist later",
                        e.addr
                    ));
                }
            }
            Action::SegmentFree => {
                insert_range(
                    &mut segments,
                    e.addr,
                    SegmentInfo {
                        size: e.size,
                        stream: e.stream,
                        pool: segment_pool(e.size),
                        expandable: false,
                    },
                );
            }
            Action::SegmentMap => {
                if !remove_mapped(&mut segments, e.addr, e.size) {
                    rec.notes.push(format!(
                        "entry {i}: segment_map of {:#x} ({} bytes), which is not mapped later",
                        e.addr, e.size
                    ));
                }
            }
            Action::SegmentUnmap => {
                // a range off the large page grid is a small-pool range (§7.1 page sizes)
                let pool = if !e.size.is_multiple_of(page_size(PoolKind::Large, config)) {
                    Some(Pool::Small)
                } else {
                    known_pool(&final_segments, &alloc_pools, e.addr, e.size, e.stream)
                };
                add_mapped(&mut segments, e.addr, e.size, e.stream, pool)
            }
            Action::Oom | Action::Snapshot | Action::Other(_) => {}
        }
    }

    // ---- the initial segments and their blocks: each live block with the room up to the next one
    let mut blocks_by_addr: Vec<(u64, LiveBlock)> = live.into_iter().collect();
    blocks_by_addr.sort_unstable_by_key(|&(a, _)| a);
    let mut layout: Vec<InitialLayout> = Vec::new();
    let mut next_block = 0;
    for (&addr, seg) in &segments {
        let end = addr + seg.size;
        // blocks before this segment lie outside every segment
        while next_block < blocks_by_addr.len() && blocks_by_addr[next_block].0 < addr {
            rec.notes.push(format!(
                "block {:#x} live at the start lies in no segment: left out",
                blocks_by_addr[next_block].0
            ));
            next_block += 1;
        }
        let first = next_block;
        while next_block < blocks_by_addr.len() && blocks_by_addr[next_block].0 < end {
            next_block += 1;
        }
        let inside = &blocks_by_addr[first..next_block];
        let blocks = inside
            .iter()
            .enumerate()
            .map(|(k, &(baddr, b))| {
                let boundary = inside.get(k + 1).map_or(end, |&(next, _)| next);
                (baddr, b, boundary - baddr)
            })
            .collect();
        layout.push((addr, *seg, blocks));
    }
    // where the history shows the blocks of unknown size end
    // (ordinary segments only: unmapping splits an expandable segment's free blocks at page
    // boundaries without an allocation, and there rule 2 is exact anyway)
    let unknown: BTreeMap<u64, u64> = layout
        .iter()
        .filter(|(_, seg, _)| !seg.expandable)
        .flat_map(|(_, _, blocks)| blocks.iter())
        .filter(|(_, b, _)| b.size.is_none())
        .map(|&(addr, _, room)| (addr, addr + room))
        .collect();
    let observed = observed_ends(entries, &unknown);

    let mut initial_events = Vec::new();
    let mut pending_at_start = Vec::new();
    let mut live_ids: HashSet<u64> = HashSet::new();
    for (addr, seg, inside) in &layout {
        let (addr, seg) = (*addr, *seg);
        let mut blocks = Vec::with_capacity(inside.len());
        for &(baddr, b, room) in inside {
            let size = match b.size {
                Some(size) if size <= room => size,
                Some(size) => {
                    rec.notes.push(format!(
                        "block {baddr:#x} of {size} bytes overlaps what follows it: cut to {room} bytes"
                    ));
                    room
                }
                None => {
                    rec.initial.inferred_block_sizes += 1;
                    let rounded = round_size(b.requested, config);
                    match observed.get(&baddr) {
                        Some(&end) if end - baddr >= rounded => end - baddr,
                        _ => infer_size(config, &seg, b.requested, room, baddr, &mut rec.notes),
                    }
                }
            };
            if b.pending {
                pending_at_start.push(baddr);
            }
            live_ids.insert(baddr);
            rec.initial.live_blocks += 1;
            if !b.pending {
                rec.initial.allocated += size;
            }
            blocks.push(InitialBlock {
                id: AllocId::Int(baddr),
                offset: baddr - addr,
                size,
                requested: b.requested.min(size),
                category: Category::Other,
                tag: None,
            });
        }
        rec.initial.segments += 1;
        rec.initial.reserved += seg.size;
        initial_events.push(Event::Segment(Box::new(InitialSegment {
            addr,
            size: seg.size,
            stream: seg.stream,
            pool: seg.pool,
            expandable: seg.expandable,
            base: None,
            blocks,
        })));
    }
    for &(baddr, _) in &blocks_by_addr[next_block..] {
        rec.notes.push(format!(
            "block {baddr:#x} live at the start lies in no segment: left out"
        ));
    }
    rec.initial.pending_frees = pending_at_start.len();
    Initial {
        events: initial_events,
        pending: pending_at_start,
        live: live_ids,
    }
}

/// The size of a block seen only freed: §1.2 rounding, extended to the next boundary where §3.2 would
/// not have split the remainder off.
fn infer_size(
    config: &AllocatorConfig,
    seg: &SegmentInfo,
    requested: u64,
    room: u64,
    addr: u64,
    notes: &mut Vec<String>,
) -> u64 {
    let rounded = round_size(requested, config);
    if rounded > room {
        notes.push(format!(
            "block {addr:#x} requested {requested} bytes (rounded {rounded}) but only {room} bytes lie before the next block: sized {room}"
        ));
        return room;
    }
    let remainder = room - rounded;
    if seg.pool == Pool::Small || seg.expandable {
        // §3.2: small pool / expandable segments split off any remainder of 512 bytes or more
        return rounded;
    }
    // §1.3: no large-pool block is 1 MiB or smaller, so such a remainder is part of this block.
    let too_small = PoolKind::of(remainder) == PoolKind::Small;
    // §3.2: a large block splits only if the request is below max_split_size and more than 1 MiB
    // remains; an oversize block, never split, served the request only within max_non_split_rounding
    // (§3.1 oversize rule 2).
    let unsplit = !should_split(PoolKind::Large, false, rounded, remainder, config)
        && !exceeds_non_split_rounding(rounded, room, config);
    if too_small || unsplit {
        room
    } else {
        rounded
    }
}

/// For blocks live at the start whose size is unknown (`unknown`: address → the end of the room up to the
/// next live block or the segment's end), the end the history shows: the address of the first `alloc`
/// inside the room while the block is still live. An allocation takes the front of a free block (§3.4),
/// and until then the room behind the block was one free block (free neighbours merge, §4.2, and no
/// other block lived there), so that address is where the block ends.
fn observed_ends(entries: &[TraceEntry], unknown: &BTreeMap<u64, u64>) -> HashMap<u64, u64> {
    let mut observed = HashMap::new();
    if unknown.is_empty() {
        return observed;
    }
    // a block's free merges it with the room behind it: later allocations say nothing of its end
    let mut freed: HashSet<u64> = HashSet::new();
    for e in entries {
        match e.action {
            Action::Alloc => {
                if let Some((&block, &limit)) = unknown.range(..e.addr).next_back() {
                    if e.addr < limit && !freed.contains(&block) {
                        observed.entry(block).or_insert(e.addr);
                    }
                }
            }
            Action::FreeCompleted if unknown.contains_key(&e.addr) => {
                freed.insert(e.addr);
            }
            _ => {}
        }
    }
    observed
}

/// Inserts a segment, merging an expandable range with adjacent mapped ranges of the same stream and
/// pool (a snapshot reports one segment per contiguous mapped range).
fn insert_range(segments: &mut BTreeMap<u64, SegmentInfo>, addr: u64, info: SegmentInfo) {
    if !info.expandable {
        segments.insert(addr, info);
        return;
    }
    let (mut start, mut size) = (addr, info.size);
    if let Some((&prev, p)) = segments.range(..addr).next_back() {
        if p.expandable && p.stream == info.stream && p.pool == info.pool && prev + p.size == addr {
            start = prev;
            size += p.size;
        }
    }
    let end = addr + info.size;
    if let Some(n) = segments.get(&end).copied() {
        if n.expandable && n.stream == info.stream && n.pool == info.pool {
            segments.remove(&end);
            size += n.size;
        }
    }
    segments.insert(start, SegmentInfo { size, ..info });
}

/// Undoes a `segment_map`: removes `[addr, addr + size)` from the mapped range holding it.
fn remove_mapped(segments: &mut BTreeMap<u64, SegmentInfo>, addr: u64, size: u64) -> bool {
    let Some((&start, &info)) = segments.range(..=addr).next_back() else {
        return false;
    };
    let end = addr.saturating_add(size);
    if !info.expandable || start + info.size < end {
        return false;
    }
    segments.remove(&start);
    if addr > start {
        segments.insert(
            start,
            SegmentInfo {
                size: addr - start,
                ..info
            },
        );
    }
    if start + info.size > end {
        segments.insert(
            end,
            SegmentInfo {
                size: start + info.size - end,
                ..info
            },
        );
    }
    true
}

/// The pool of an expandable range seen only in a `segment_unmap`, where something recorded says: a final
/// segment of the stream overlapping it, or a block recorded inside it.
fn known_pool(
    final_segments: &[&Segment],
    alloc_pools: &[(u64, Pool)],
    addr: u64,
    size: u64,
    stream: StreamId,
) -> Option<Pool> {
    let end = addr.saturating_add(size);
    let from_final = final_segments.iter().find(|s| {
        s.is_expandable && s.stream == stream && s.address < end && addr < s.address + s.total_size
    });
    if let Some(s) = from_final {
        return Some(pool_of_type(s.segment_type));
    }
    let first = alloc_pools.partition_point(|&(a, _)| a < addr);
    alloc_pools
        .get(first)
        .filter(|&&(a, _)| a < end)
        .map(|&(_, pool)| pool)
}

/// Undoes a `segment_unmap`: adds `[addr, addr + size)` as a mapped range. Its pool is `known` when
/// something recorded says it, else that of the nearest mapped range of the stream (the same
/// reservation, most likely), else the one its size suggests (20 MiB pages are large-pool pages).
fn add_mapped(
    segments: &mut BTreeMap<u64, SegmentInfo>,
    addr: u64,
    size: u64,
    stream: StreamId,
    known: Option<Pool>,
) {
    let neighbour = known.or_else(|| {
        segments
            .range(..addr)
            .rev()
            .chain(segments.range(addr..))
            .find(|(_, s)| s.expandable && s.stream == stream)
            .map(|(_, s)| s.pool)
    });
    let pool = neighbour.unwrap_or(if size.is_multiple_of(LARGE_BUFFER) {
        Pool::Large
    } else {
        Pool::Small
    });
    insert_range(
        segments,
        addr,
        SegmentInfo {
            size,
            stream,
            pool,
            expandable: true,
        },
    );
}

/// Where the reservations of the initial expandable ranges begin: the lowest address the history maps or
/// unmaps in the same stream and pool while the reservation lives (until none of its ranges is mapped),
/// within a reservation's size (1⅛ × the highest reservation, §7.1) of its ranges. Set as `base` on the
/// stream and pool's first range when it is below it.
pub(super) fn set_reservation_bases(
    entries: &[TraceEntry],
    initial: &mut [Event],
    config: &AllocatorConfig,
    peak: u64,
) {
    let mut first: BTreeMap<(StreamId, Pool), (u64, u64)> = BTreeMap::new(); // (lowest start, highest end)
    for e in initial.iter() {
        if let Event::Segment(seg) = e {
            if seg.expandable {
                let span = first.entry((seg.stream, seg.pool)).or_insert((u64::MAX, 0));
                span.0 = span.0.min(seg.addr);
                span.1 = span.1.max(seg.addr + seg.size);
            }
        }
    }
    if first.is_empty() {
        return;
    }
    let reach = (peak + peak / 8).saturating_add(page_size(PoolKind::Large, config));
    let mut layout = ExpandableLayout::new(entries, initial, config);
    let mut bases: BTreeMap<(StreamId, Pool), u64> =
        first.iter().map(|(&k, &(lo, _))| (k, lo)).collect();
    let mut open: Vec<(StreamId, Pool)> = first.keys().copied().collect();
    for (i, e) in entries.iter().enumerate() {
        if open.is_empty() {
            break;
        }
        if matches!(e.action, Action::SegmentMap | Action::SegmentUnmap) {
            let pool = match e.action {
                Action::SegmentMap => layout.next_pool[i].unwrap_or(Pool::Large),
                _ => layout.pool_at(e.addr).unwrap_or(Pool::Large),
            };
            let key = (e.stream, pool);
            if open.contains(&key) {
                let (_, hi) = first[&key];
                if e.addr < bases[&key] && hi - e.addr <= reach {
                    bases.insert(key, e.addr);
                }
            }
        }
        layout.apply(entries, i);
        open.retain(|&(stream, pool)| layout.has_ranges(stream, pool));
    }
    let mut done: Vec<(StreamId, Pool)> = Vec::new();
    for e in initial.iter_mut() {
        if let Event::Segment(seg) = e {
            let key = (seg.stream, seg.pool);
            if seg.expandable && !done.contains(&key) {
                done.push(key);
                if bases[&key] < seg.addr {
                    seg.base = Some(bases[&key]);
                }
            }
        }
    }
}

/// The pool of a final segment.
fn pool_of_type(segment_type: SegmentType) -> Pool {
    match segment_type {
        SegmentType::Small => Pool::Small,
        SegmentType::Large => Pool::Large,
    }
}
