//! Expandable segments (§7): growth page by page, the search rules, stats, and shrinking on empty_cache.
//! Expected numbers follow from §7's rules (20 MiB large pages, 2 MiB small pages, whole pages only).

use vramsim_sim::allocator::caching::{check_snapshot, CachingAllocator};
use vramsim_sim::allocator::{Action, Allocator, BlockState, HistoryEntry};
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::timeline::Timeline;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn expandable(capacity: u64) -> CachingAllocator {
    let config = AllocatorConfig {
        expandable_segments: true,
        ..Default::default()
    };
    let mut a = CachingAllocator::new(config, Device::with_capacity(capacity));
    a.set_record_history(true);
    a
}

fn consistent(a: &CachingAllocator) {
    if let Err(e) = check_snapshot(a.stats(), &a.segments()) {
        panic!("stats and snapshot disagree: {e}");
    }
}

fn maps(history: &[HistoryEntry], action: Action) -> Vec<(u64, u64)> {
    history
        .iter()
        .filter(|h| h.action == action)
        .map(|h| (h.addr, h.size))
        .collect()
}

/// §7.2: reserved grows in 20 MiB pages, sized by the rounded request; the segment stat stays 0; each map
/// is one num_device_alloc; remainders of ≥ 512 B are split off without inactive_split accounting.
#[test]
fn large_pool_grows_in_20_mib_pages() {
    let mut a = expandable(80 * GIB);
    let mut tl = Timeline::new();
    // 30 MiB: two pages (40 MiB) mapped; 10 MiB left free behind the block.
    let x = a.malloc(30 * MIB, 0, &mut tl).unwrap();
    let base = a.block_address(x);
    assert_eq!(
        maps(&a.take_history(), Action::SegmentMap),
        [(base, 40 * MIB)]
    );
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all.current, (40 * MIB) as i64);
    assert_eq!(s.segment.all.current, 0);
    assert_eq!(s.num_device_alloc, 1);
    assert_eq!(a.block_size(x), 30 * MIB);
    assert_eq!(s.inactive_split.all.current, 0);
    consistent(&a);

    // 25 MiB: the free 10 MiB plus one more page (20 MiB) at the frontier = 30 MiB, split 25 + 5.
    let y = a.malloc(25 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.block_address(y), base + 30 * MIB);
    assert_eq!(
        maps(&a.take_history(), Action::SegmentMap),
        [(base + 40 * MIB, 20 * MIB)]
    );
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all.current, (60 * MIB) as i64);
    assert_eq!(s.segment.all.current, 0);
    assert_eq!(s.num_device_alloc, 2);

    // One snapshot segment per contiguous mapped range, flagged expandable: 30 | 25 | 5 free.
    let segments = a.segments();
    assert_eq!(segments.len(), 1);
    assert!(segments[0].is_expandable);
    assert_eq!(segments[0].address, base);
    assert_eq!(segments[0].total_size, 60 * MIB);
    let sizes: Vec<u64> = segments[0].blocks.iter().map(|b| b.size).collect();
    assert_eq!(sizes, [30 * MIB, 25 * MIB, 5 * MIB]);
    consistent(&a);
}

/// §7.1: the small pool grows in 2 MiB pages, its own segment.
#[test]
fn small_pool_grows_in_2_mib_pages() {
    let mut a = expandable(80 * GIB);
    let mut tl = Timeline::new();
    let x = a.malloc(1000, 0, &mut tl).unwrap();
    assert_eq!(
        a.stats().reserved_bytes.small_pool.current,
        (2 * MIB) as i64
    );
    assert_eq!(a.block_size(x), 1024);
    // 1 MiB fits in the rest of the page; the next 1 MiB needs one more 2 MiB page right after it.
    let y = a.malloc(MIB, 0, &mut tl).unwrap();
    let z = a.malloc(MIB, 0, &mut tl).unwrap();
    assert_eq!(a.block_address(y), a.block_address(x) + 1024);
    assert_eq!(a.block_address(z), a.block_address(y) + MIB);
    assert_eq!(
        a.stats().reserved_bytes.small_pool.current,
        (4 * MIB) as i64
    );
    assert_eq!(a.stats().segment.all.current, 0);
    consistent(&a);
}

/// §7.2 with NEW large_segment_size: the large page follows the setting.
#[test]
fn large_page_is_large_segment_size() {
    let config = AllocatorConfig {
        expandable_segments: true,
        large_segment_size: 32 * MIB,
        ..Default::default()
    };
    let mut a = CachingAllocator::new(config, Device::with_capacity(80 * GIB));
    let mut tl = Timeline::new();
    a.malloc(40 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.stats().reserved_bytes.all.current, (64 * MIB) as i64);
    a.malloc(30 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.stats().reserved_bytes.all.current, (96 * MIB) as i64);
    consistent(&a);
}

/// §7.1: each (stream, pool) gets its own reservation of ceil(1.125 × total / page) pages; the simulated
/// address space places the next reservation right after it.
#[test]
fn reservation_is_one_and_an_eighth_of_the_device() {
    let mut a = expandable(1000 * MIB);
    let mut tl = Timeline::new();
    let x = a.malloc(30 * MIB, 0, &mut tl).unwrap();
    let y = a.malloc(30 * MIB, 1, &mut tl).unwrap();
    // 1000 + 1000/8 = 1125 MiB → 57 pages of 20 MiB = 1140 MiB.
    assert_eq!(a.block_address(y) - a.block_address(x), 1140 * MIB);
    assert_eq!(a.expandable_segment_count(), 2);
    assert_eq!(a.segments().len(), 2);
    consistent(&a);
}

/// §7.5: empty_cache unmaps only the whole pages inside free blocks; partial pages stay mapped and the
/// snapshot segment then starts after the unmapped page. Once nothing is mapped the reservation goes.
#[test]
fn empty_cache_unmaps_whole_free_pages_only() {
    let mut a = expandable(80 * GIB);
    let mut tl = Timeline::new();
    let x = a.malloc(30 * MIB, 0, &mut tl).unwrap();
    let y = a.malloc(25 * MIB, 0, &mut tl).unwrap();
    let base = a.block_address(x);
    // Pages: [0, 20) [20, 40) [40, 60). Blocks: x [0, 30) | y [30, 55) | free [55, 60).
    a.free(x, &mut tl);
    a.take_history();
    a.empty_cache(&mut tl);
    // The free [0, 30) holds page 0 entirely; [55, 60) holds no whole page.
    assert_eq!(
        maps(&a.take_history(), Action::SegmentUnmap),
        [(base, 20 * MIB)]
    );
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all.current, (40 * MIB) as i64);
    assert_eq!(s.num_device_free, 1);
    let segments = a.segments();
    assert_eq!(segments.len(), 1);
    assert_eq!(segments[0].address, base + 20 * MIB);
    let blocks: Vec<(u64, BlockState)> = segments[0]
        .blocks
        .iter()
        .map(|b| (b.size, b.state))
        .collect();
    assert_eq!(
        blocks,
        [
            (10 * MIB, BlockState::Inactive),
            (25 * MIB, BlockState::ActiveAllocated),
            (5 * MIB, BlockState::Inactive),
        ]
    );
    consistent(&a);

    // Freeing y merges [20, 60) into one free block: pages 1 and 2 unmap, the whole reservation is
    // unmapped and released.
    a.free(y, &mut tl);
    a.empty_cache(&mut tl);
    assert_eq!(
        maps(&a.take_history(), Action::SegmentUnmap),
        [(base + 20 * MIB, 40 * MIB)]
    );
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
    assert_eq!(a.stats().num_device_free, 2);
    assert_eq!(a.expandable_segment_count(), 0);
    assert!(a.segments().is_empty());
    consistent(&a);
}

/// §7.2: after a shrink, growth fills the unmapped gap at the lowest address first.
#[test]
fn growth_refills_the_lowest_unmapped_gap() {
    let mut a = expandable(80 * GIB);
    let mut tl = Timeline::new();
    let x = a.malloc(40 * MIB, 0, &mut tl).unwrap(); // pages 0, 1
    let y = a.malloc(20 * MIB, 0, &mut tl).unwrap(); // page 2
    let base = a.block_address(x);
    a.free(x, &mut tl);
    a.empty_cache(&mut tl); // pages 0 and 1 unmapped
    assert_eq!(a.stats().reserved_bytes.all.current, (20 * MIB) as i64);
    a.take_history();
    // 30 MiB: the gap [0, 40) has room; map pages 0 and 1 again, right there.
    let z = a.malloc(30 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.block_address(z), base);
    assert_eq!(
        maps(&a.take_history(), Action::SegmentMap),
        [(base, 40 * MIB)]
    );
    // The gap's 10 MiB rest merged with nothing (y is allocated): one contiguous mapped range again.
    assert_eq!(a.segments().len(), 1);
    assert_eq!(a.block_address(y), base + 40 * MIB);
    consistent(&a);
}

/// §7.3: with expandable segments active, best fit looks at the size a block can grow to: a 4 MiB block at
/// the frontier (4 MiB + the unmapped rest) loses to a bigger block that cannot grow.
#[test]
fn search_prefers_blocks_away_from_the_frontier() {
    let mut a = expandable(80 * GIB);
    let mut tl = Timeline::new();
    // Pages 0–1: a [0, 8) | b [8, 16) | c [16, 36) | free [36, 40).
    let a0 = a.malloc(8 * MIB, 0, &mut tl).unwrap();
    let b = a.malloc(8 * MIB, 0, &mut tl).unwrap();
    let _c = a.malloc(20 * MIB, 0, &mut tl).unwrap();
    a.free(b, &mut tl);
    // Free: b [8, 16) = 8 MiB (cannot grow), tail [36, 40) = 4 MiB + unmapped rest (can grow).
    // A 3 MiB request: lower_bound finds the 4 MiB tail first, but its expandable size is huge, and b's 8
    // MiB is smaller, so b is chosen.
    let d = a.malloc(3 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.block_address(d), a.block_address(a0) + 8 * MIB);
    consistent(&a);
}

/// §7.3: when expandable segments are turned off, cached expandable blocks are not used.
#[test]
fn disabled_expandable_segments_skip_expandable_blocks() {
    let mut a = expandable(80 * GIB);
    let mut tl = Timeline::new();
    let x = a.malloc(30 * MIB, 0, &mut tl).unwrap();
    a.free(x, &mut tl);
    a.set_allocator_settings(AllocatorConfig::default());
    let y = a.malloc(10 * MIB, 0, &mut tl).unwrap();
    assert_ne!(a.block_address(y), a.block_address(x));
    assert_eq!(
        a.stats().segment.all.current,
        1,
        "a plain cudaMalloc segment"
    );
    // …and plain blocks keep their usual split rule (10 MiB segment, nothing left).
    assert_eq!(a.block_size(y), 10 * MIB);
    consistent(&a);
}

/// §3.3: the memory fraction is checked with the §1.4 size even for expandable segments: a 12 MiB
/// request counts 12 MiB against the limit but maps a 20 MiB page.
#[test]
fn fraction_check_uses_the_allocation_size() {
    let mut a = expandable(GIB);
    a.set_memory_fraction(30.0 / 1024.0); // 30 MiB allowed
    assert_eq!(a.allowed_memory_maximum(), Some(30 * MIB));
    let mut tl = Timeline::new();
    a.malloc(12 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.total_allocated_memory(), 20 * MIB);
    // The 8 MiB left is too small for 12 MiB, and growing is refused: 20 + 12 > 30 (it would have mapped
    // one more 20 MiB page).
    let err = a.malloc(12 * MIB, 0, &mut tl).unwrap_err();
    assert_eq!(err.alloc_size, 12 * MIB);
    // 8 MiB still fits in the mapped page.
    a.malloc(8 * MIB, 0, &mut tl).unwrap();
    consistent(&a);
}

/// §7.2: when the device runs out while mapping, the request fails like a cudaMalloc OOM.
#[test]
fn mapping_fails_when_the_device_is_full() {
    let mut a = expandable(100 * MIB);
    let mut tl = Timeline::new();
    a.malloc(70 * MIB, 0, &mut tl).unwrap(); // 4 pages = 80 MiB
    assert_eq!(a.stats().reserved_bytes.all.current, (80 * MIB) as i64);
    // 20 MiB free on the device; 30 MiB needs 10 MiB more than the free 10 MiB: one page, fits.
    a.malloc(30 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.stats().reserved_bytes.all.current, (100 * MIB) as i64);
    let err = a.malloc(20 * MIB, 0, &mut tl).unwrap_err();
    assert_eq!(err.device_free, 0);
    assert_eq!(a.stats().num_ooms, 1);
    consistent(&a);
}

/// §4 with expandable blocks: a record_stream'd free is deferred, and an unmap synchronizes the stream.
#[test]
fn deferred_frees_and_unmap_synchronize() {
    let mut a = expandable(80 * GIB);
    let mut tl = Timeline::new();
    let x = a.malloc(40 * MIB, 0, &mut tl).unwrap();
    a.record_stream(x, 1);
    tl.enqueue(1, 5_000);
    a.free(x, &mut tl);
    assert_eq!(a.stats().active.all.current, 1, "pending free stays active");
    tl.enqueue(0, 7_000);
    a.empty_cache(&mut tl);
    // The event waited for (5 µs), then the unmap synchronized stream 0 (7 µs).
    assert_eq!(tl.now(), 7_000);
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
    consistent(&a);
}
