//! The caching allocator's rules, one table or scenario per rule. Every expected number is derived from
//! PyTorch's rules in `pytorch_allocator.md` (section in each test's comment), never from vramsim's output.

use vramsim_sim::allocator::caching::{check_snapshot, CachingAllocator};
use vramsim_sim::allocator::{Action, Allocator, BlockRef, BlockState};
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::rounding::PoolKind;
use vramsim_sim::timeline::Timeline;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn allocator(config: AllocatorConfig, capacity: u64) -> CachingAllocator {
    CachingAllocator::new(config, Device::with_capacity(capacity))
}

fn default_allocator() -> CachingAllocator {
    allocator(AllocatorConfig::default(), 80 * GIB)
}

fn consistent(a: &CachingAllocator) {
    if let Err(e) = check_snapshot(a.stats(), &a.segments()) {
        panic!("stats and snapshot disagree: {e}");
    }
}

fn current(stat: &vramsim_sim::stats::StatArray) -> i64 {
    stat.all.current
}

/// §1.4 table: the segment each request gets, seen through the allocator (reserved bytes, pool, and
/// whether the block was split off, §3.2).
#[test]
fn segment_sizes_of_the_1_4_table() {
    // (request, rounded, pool, segment size)
    let table: [(u64, u64, PoolKind, u64); 8] = [
        (1, 512, PoolKind::Small, 2 * MIB),
        (513, 1024, PoolKind::Small, 2 * MIB),
        (1_048_576, 1_048_576, PoolKind::Small, 2 * MIB),
        (1_048_577, 1_049_088, PoolKind::Large, 20 * MIB),
        (10 * MIB - 512, 10_485_248, PoolKind::Large, 20 * MIB),
        (10 * MIB, 10_485_760, PoolKind::Large, 10 * MIB),
        (10 * MIB + 512, 10_486_272, PoolKind::Large, 12 * MIB),
        (25 * MIB + 1, 26_214_912, PoolKind::Large, 26 * MIB),
    ];
    for (request, rounded, pool, segment) in table {
        let mut a = default_allocator();
        let mut tl = Timeline::new();
        let block = a.malloc(request, 0, &mut tl).unwrap();
        let s = a.stats();
        assert_eq!(
            current(&s.reserved_bytes),
            segment as i64,
            "request {request}"
        );
        assert_eq!(s.reserved_bytes.pool(pool).current, segment as i64);
        assert_eq!(s.segment.pool(pool).current, 1);
        assert_eq!(s.requested_bytes.all.current, request as i64);
        // §3.2: small pool splits if ≥ 512 B remain; large pool if > 1 MiB remains.
        let remaining = segment - rounded;
        let split = match pool {
            PoolKind::Small => remaining >= 512,
            PoolKind::Large => remaining > MIB,
        };
        let block_size = if split { rounded } else { segment };
        assert_eq!(a.block_size(block), block_size, "request {request}");
        assert_eq!(s.allocated_bytes.all.current, block_size as i64);
        let segments = a.segments();
        assert_eq!(segments.len(), 1);
        assert_eq!(segments[0].total_size, segment);
        assert_eq!(segments[0].pool, pool);
        assert_eq!(segments[0].blocks.len(), if split { 2 } else { 1 });
        consistent(&a);
    }
}

/// Derived case: three 8 MiB requests → 20 MiB split 8+12, reuse split 8+4, then a new 20 MiB segment.
#[test]
fn three_8_mib_requests() {
    let mut a = default_allocator();
    let mut tl = Timeline::new();
    for _ in 0..3 {
        a.malloc(8 * MIB, 0, &mut tl).unwrap();
        consistent(&a);
    }
    let s = a.stats();
    assert_eq!(current(&s.reserved_bytes), (40 * MIB) as i64);
    assert_eq!(current(&s.segment), 2);
    assert_eq!(current(&s.allocated_bytes), (24 * MIB) as i64);
    // 4 MiB left in the first segment + 12 MiB in the second.
    assert_eq!(current(&s.inactive_split_bytes), (16 * MIB) as i64);
    assert_eq!(current(&s.inactive_split), 2);
}

/// §3.2 derived: 19 MiB in a fresh 20 MiB segment leaves exactly 1 MiB, which is not "> 1 MiB".
#[test]
fn nineteen_mib_is_not_split() {
    let mut a = default_allocator();
    let mut tl = Timeline::new();
    let b = a.malloc(19 * MIB, 0, &mut tl).unwrap();
    let s = a.stats();
    assert_eq!(current(&s.allocated_bytes), (20 * MIB) as i64);
    assert_eq!(current(&s.active_bytes), (20 * MIB) as i64);
    assert_eq!(current(&s.requested_bytes), (19 * MIB) as i64);
    assert_eq!(current(&s.inactive_split_bytes), 0);
    assert_eq!(a.block_size(b), 20 * MIB);
    let segments = a.segments();
    assert_eq!(segments[0].blocks.len(), 1);
    assert_eq!(segments[0].blocks[0].requested_size, 19 * MIB);
    consistent(&a);
}

/// §1.3, §3.2: small requests are carved, front first, from 2 MiB segments of the small pool.
#[test]
fn small_pool_packs_requests_into_2_mib_segments() {
    let mut a = default_allocator();
    let mut tl = Timeline::new();
    // Four 512 KiB requests fill one 2 MiB segment.
    let blocks: Vec<BlockRef> = (0..4)
        .map(|_| a.malloc(512 * KIB, 0, &mut tl).unwrap())
        .collect();
    let s = a.stats();
    assert_eq!(current(&s.segment), 1);
    assert_eq!(s.reserved_bytes.small_pool.current, (2 * MIB) as i64);
    // The 4th request takes the last 512 KiB exactly (remaining 0 < 512: no split).
    assert_eq!(current(&s.inactive_split), 0);
    // Addresses are consecutive: the front of the cached tail is always handed out.
    for pair in blocks.windows(2) {
        assert_eq!(
            a.block_address(pair[1]),
            a.block_address(pair[0]) + 512 * KIB
        );
    }
    // A 5th one needs a second segment.
    a.malloc(1, 0, &mut tl).unwrap();
    assert_eq!(current(&a.stats().segment), 2);
    consistent(&a);
}

/// §2.3: a cached block of one stream never serves another stream.
#[test]
fn cached_blocks_serve_only_their_stream() {
    let mut a = default_allocator();
    let mut tl = Timeline::new();
    let b = a.malloc(30 * MIB, 1, &mut tl).unwrap();
    a.free(b, &mut tl);
    let other = a.malloc(30 * MIB, 2, &mut tl).unwrap();
    assert_eq!(
        current(&a.stats().segment),
        2,
        "stream 2 cannot use stream 1's cache"
    );
    let same = a.malloc(30 * MIB, 1, &mut tl).unwrap();
    assert_eq!(current(&a.stats().segment), 2, "stream 1 reuses its block");
    assert_ne!(a.block_address(other), a.block_address(same));
    consistent(&a);
}

/// §2.3 best fit: the smallest cached block that fits, the lowest address among equals.
#[test]
fn best_fit_prefers_smallest_then_lowest_address() {
    let mut a = default_allocator();
    let mut tl = Timeline::new();
    // Whole segments of 30, 24, 24 and 40 MiB (≥ 10 MiB requests get exact 2 MiB-rounded segments).
    let b30 = a.malloc(30 * MIB, 0, &mut tl).unwrap();
    let b24a = a.malloc(24 * MIB, 0, &mut tl).unwrap();
    let b24b = a.malloc(24 * MIB, 0, &mut tl).unwrap();
    let b40 = a.malloc(40 * MIB, 0, &mut tl).unwrap();
    let (a24a, a24b, a30) = (
        a.block_address(b24a),
        a.block_address(b24b),
        a.block_address(b30),
    );
    for b in [b40, b24b, b30, b24a] {
        a.free(b, &mut tl);
    }
    // 23 MiB: both 24 MiB blocks fit better than 30; the lower address wins. 24 − 23 = 1 MiB: not split.
    let x = a.malloc(23 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.block_address(x), a24a.min(a24b));
    let y = a.malloc(23 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.block_address(y), a24a.max(a24b));
    let z = a.malloc(25 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.block_address(z), a30);
    assert_eq!(current(&a.stats().segment), 4, "no new segment");
    consistent(&a);
}

/// §4.2: freeing merges with both free neighbours; the survivor takes the lower address.
#[test]
fn free_merges_with_both_neighbours() {
    let mut a = default_allocator();
    let mut tl = Timeline::new();
    let x = a.malloc(2 * MIB, 0, &mut tl).unwrap();
    let y = a.malloc(2 * MIB, 0, &mut tl).unwrap();
    let z = a.malloc(2 * MIB, 0, &mut tl).unwrap();
    // 20 MiB segment: x | y | z | 14 MiB free
    assert_eq!(current(&a.stats().inactive_split), 1);
    a.free(x, &mut tl);
    a.free(z, &mut tl);
    // x alone, z merged with the tail: two inactive split blocks of 2 and 16 MiB.
    assert_eq!(current(&a.stats().inactive_split), 2);
    assert_eq!(current(&a.stats().inactive_split_bytes), (18 * MIB) as i64);
    consistent(&a);
    a.free(y, &mut tl);
    // Everything merged back: one whole, unsplit 20 MiB block.
    let s = a.stats();
    assert_eq!(current(&s.inactive_split), 0);
    assert_eq!(current(&s.inactive_split_bytes), 0);
    let segments = a.segments();
    assert_eq!(segments[0].blocks.len(), 1);
    assert_eq!(segments[0].blocks[0].state, BlockState::Inactive);
    consistent(&a);
}

/// §3.1 oversize rules with max_split_size = 40 MiB: (cached whole block, request, tolerance) → reused?
#[test]
fn max_split_size_oversize_rules() {
    // (cached block, request, max_non_split_rounding_size, reused)
    let table: [(u64, u64, u64, bool); 7] = [
        // request ≥ max_split and block < request + 20 MiB: reused whole.
        (50 * MIB, 45 * MIB, 20 * MIB, true),
        (50 * MIB, 40 * MIB, 20 * MIB, true),
        // request < max_split never takes an oversize block.
        (50 * MIB, 30 * MIB, 20 * MIB, false),
        (50 * MIB, 39 * MIB, 20 * MIB, false),
        // 70 ≥ 45 + 20: too wasteful...
        (70 * MIB, 45 * MIB, 20 * MIB, false),
        // ...unless the tolerance is 30 MiB (NEW max_non_split_rounding_mb).
        (70 * MIB, 45 * MIB, 30 * MIB, true),
        // exactly request + tolerance is refused (≥).
        (65 * MIB, 45 * MIB, 20 * MIB, false),
    ];
    for (cached, request, tolerance, reused) in table {
        let config = AllocatorConfig {
            max_split_size: 40 * MIB,
            max_non_split_rounding_size: tolerance,
            ..Default::default()
        };
        let mut a = allocator(config, 80 * GIB);
        let mut tl = Timeline::new();
        let b = a.malloc(cached, 0, &mut tl).unwrap();
        let cached_addr = a.block_address(b);
        a.free(b, &mut tl);
        let c = a.malloc(request, 0, &mut tl).unwrap();
        let s = a.stats();
        assert_eq!(
            a.block_address(c) == cached_addr,
            reused,
            "cached {cached}, request {request}, tolerance {tolerance}"
        );
        assert_eq!(current(&s.segment), if reused { 1 } else { 2 });
        if reused {
            // Oversize blocks are never split: the whole block is handed out.
            assert_eq!(a.block_size(c), cached);
            assert_eq!(s.oversize_allocations.current, 1);
        }
        // The cached block is oversize; so is every segment of ≥ 40 MiB.
        let oversize_segments = a
            .segments()
            .iter()
            .filter(|seg| seg.total_size >= 40 * MIB)
            .count() as i64;
        assert_eq!(s.oversize_segments.current, oversize_segments);
        consistent(&a);
    }
}

/// §3.2: with max_split_size set, a large block is only split for requests below it.
#[test]
fn max_split_size_stops_splitting_large_requests() {
    let config = AllocatorConfig {
        max_split_size: 40 * MIB,
        ..Default::default()
    };
    let mut a = allocator(config, 80 * GIB);
    let mut tl = Timeline::new();
    // 3 MiB request: 20 MiB segment, split (3 < 40 and 17 MiB > 1 MiB remain).
    a.malloc(3 * MIB, 0, &mut tl).unwrap();
    assert_eq!(current(&a.stats().inactive_split), 1);
    assert_eq!(a.stats().oversize_allocations.current, 0);
    // 45 MiB − 512: a 46 MiB segment, not split though 1 MiB + 512 B remain (request ≥ max_split).
    let b = a.malloc(45 * MIB - 512, 0, &mut tl).unwrap();
    assert_eq!(a.block_size(b), 46 * MIB);
    assert_eq!(a.stats().oversize_allocations.current, 1);
    assert_eq!(a.stats().oversize_segments.current, 1);
    assert_eq!(current(&a.stats().inactive_split), 1);
    consistent(&a);
}

/// §5.2 release_available_cached_blocks: frees the single smallest cached block ≥ the request, else the
/// largest oversize blocks of the stream until enough is released; the retry then succeeds without the
/// cache flush of step 4e.
#[test]
fn release_available_cached_blocks_frees_just_enough() {
    let config = AllocatorConfig {
        max_split_size: 40 * MIB,
        ..Default::default()
    };
    // Walk down: three cached 50 MiB segments on a 200 MiB device; a 100 MiB request releases the two with
    // the highest addresses (the set is ordered by size then address, walked from the end).
    let mut a = allocator(config.clone(), 200 * MIB);
    let mut tl = Timeline::new();
    let blocks: Vec<BlockRef> = (0..3)
        .map(|_| a.malloc(50 * MIB, 0, &mut tl).unwrap())
        .collect();
    let first = a.block_address(blocks[0]);
    for b in blocks {
        a.free(b, &mut tl);
    }
    a.set_record_history(true);
    a.malloc(100 * MIB, 0, &mut tl).unwrap();
    let s = a.stats();
    assert_eq!(s.num_device_free, 2);
    assert_eq!(s.num_alloc_retries, 0, "step 4e not needed");
    assert_eq!(s.num_sync_all_streams, 0);
    assert_eq!(current(&s.reserved_bytes), (150 * MIB) as i64);
    let segments = a.segments();
    assert!(segments
        .iter()
        .any(|seg| seg.address == first && seg.blocks[0].state == BlockState::Inactive));
    let frees: Vec<_> = a
        .take_history()
        .into_iter()
        .filter(|h| h.action == Action::SegmentFree)
        .collect();
    assert_eq!(frees.len(), 2);
    assert!(frees[0].addr > frees[1].addr, "largest address first");
    consistent(&a);

    // Single block: cached 50 and 120 MiB; 100 MiB cannot take 120 (≥ 100 + 20) but releases it.
    let mut a = allocator(config.clone(), 200 * MIB);
    let x = a.malloc(50 * MIB, 0, &mut tl).unwrap();
    let y = a.malloc(120 * MIB, 0, &mut tl).unwrap();
    a.free(x, &mut tl);
    a.free(y, &mut tl);
    a.malloc(100 * MIB, 0, &mut tl).unwrap();
    let s = a.stats();
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.num_alloc_retries, 0);
    assert_eq!(current(&s.reserved_bytes), (150 * MIB) as i64);
    consistent(&a);

    // Without max_split_size the path is skipped and the cache flush + retry (4e) does the work (and
    // would have split a cached 120 MiB block, so the cached blocks here are both too small).
    let mut a = allocator(AllocatorConfig::default(), 200 * MIB);
    let x = a.malloc(50 * MIB, 0, &mut tl).unwrap();
    let y = a.malloc(90 * MIB, 0, &mut tl).unwrap();
    a.free(x, &mut tl);
    a.free(y, &mut tl);
    a.malloc(100 * MIB, 0, &mut tl).unwrap();
    let s = a.stats();
    assert_eq!(s.num_device_free, 2, "both whole cached segments released");
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(current(&s.reserved_bytes), (100 * MIB) as i64);
    consistent(&a);
}

/// Sets up the §5.4 scenario: X (100 MiB) cached at age 4, W (80 MiB) and Y (100 MiB) cached at age 1
/// when a 150 MiB miss triggers GC on a 1 GiB device with fraction 0.5 (allowed 512 MiB).
fn gc_scenario(threshold: f64, fraction: Option<f64>) -> (CachingAllocator, [u64; 3]) {
    let config = AllocatorConfig {
        garbage_collection_threshold: threshold,
        per_process_memory_fraction: fraction,
        ..Default::default()
    };
    let mut a = allocator(config, GIB);
    let mut tl = Timeline::new();
    let x = a.malloc(100 * MIB, 0, &mut tl).unwrap(); // get_free_block call 1
    let y = a.malloc(100 * MIB, 0, &mut tl).unwrap(); // 2
    let w = a.malloc(80 * MIB, 0, &mut tl).unwrap(); // 3
    let addrs = [a.block_address(x), a.block_address(w), a.block_address(y)];
    a.free(x, &mut tl); // X cached at count 3
    a.free(w, &mut tl);
    for _ in 0..3 {
        // calls 4, 5, 6: each reuses W exactly and caches it again, younger.
        let again = a.malloc(80 * MIB, 0, &mut tl).unwrap();
        assert_eq!(a.block_address(again), addrs[1]);
        a.free(again, &mut tl); // W cached at count 4, 5, 6
    }
    a.free(y, &mut tl); // Y cached at count 6
    a.set_record_history(true);
    // Call 7 misses: ages X = 4, W = 1, Y = 1.
    a.malloc(150 * MIB, 0, &mut tl).unwrap();
    (a, addrs)
}

/// §5.4: GC frees whole cached segments at least as old as the average, pass after pass.
#[test]
fn garbage_collection_frees_oldest_first() {
    // threshold 0.5: gc_threshold = 256 MiB, total 280 MiB → target 24 MiB. Pass 1: average age
    // (4+1+1)/3 = 2 → only X (age 4) goes, reclaiming 100 MiB ≥ 24 MiB.
    let (mut a, [x, w, y]) = gc_scenario(0.5, Some(0.5));
    let freed: Vec<u64> = a
        .take_history()
        .iter()
        .filter(|h| h.action == Action::SegmentFree)
        .map(|h| h.addr)
        .collect();
    assert_eq!(freed, vec![x]);
    let cached: Vec<u64> = a
        .segments()
        .iter()
        .filter(|s| s.allocated_size == 0)
        .map(|s| s.address)
        .collect();
    let mut expected = vec![w, y];
    expected.sort();
    assert_eq!(cached, expected);
    assert_eq!(a.stats().num_alloc_retries, 0);
    consistent(&a);

    // threshold 0.2: gc_threshold = size_t(0.2 × 512 MiB), target ≈ 177.6 MiB. Pass 1 frees X (100 MiB);
    // pass 2 has average (1+1)/2 = 1 and frees W then Y (set order: smaller first).
    let (mut a, [x, w, y]) = gc_scenario(0.2, Some(0.5));
    let freed: Vec<u64> = a
        .take_history()
        .iter()
        .filter(|h| h.action == Action::SegmentFree)
        .map(|h| h.addr)
        .collect();
    assert_eq!(freed, vec![x, w, y]);
    assert_eq!(current(&a.stats().segment), 1);
    consistent(&a);
}

/// §5.4: GC needs a memory fraction below 1 (NEW: fraction 1.0 disables the limit and GC).
#[test]
fn garbage_collection_needs_a_memory_fraction() {
    for fraction in [None, Some(1.0)] {
        let (mut a, _) = gc_scenario(0.5, fraction);
        assert!(a
            .take_history()
            .iter()
            .all(|h| h.action != Action::SegmentFree));
        assert_eq!(current(&a.stats().segment), 4);
    }
}

/// §3.3 + §12.3: the fraction limit is size_t(fraction × total); a segment that would exceed it fails
/// without touching the device, then the cache flush and retry fail too, and the OOM is counted.
#[test]
fn memory_fraction_limits_reserved_memory() {
    let config = AllocatorConfig {
        per_process_memory_fraction: Some(0.5),
        ..Default::default()
    };
    let mut a = allocator(config, GIB);
    assert_eq!(a.allowed_memory_maximum(), Some(512 * MIB));
    assert_eq!(a.memory_fraction(), 0.5);
    let mut tl = Timeline::new();
    a.malloc(300 * MIB, 0, &mut tl).unwrap();
    let err = a.malloc(300 * MIB, 0, &mut tl).unwrap_err();
    assert_eq!(err.requested, 300 * MIB);
    assert_eq!(err.alloc_size, 300 * MIB);
    assert_eq!(err.device_free, GIB - 300 * MIB);
    let s = a.stats();
    assert_eq!(s.num_ooms, 1);
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(current(&s.reserved_bytes), (300 * MIB) as i64);
    // 212 MiB still fits: 300 + 212 = 512.
    a.malloc(212 * MIB, 0, &mut tl).unwrap();
    consistent(&a);
    // Removing the limit (fraction 1, NEW) lets more through.
    a.set_memory_fraction(1.0);
    assert_eq!(a.allowed_memory_maximum(), None);
    a.malloc(300 * MIB, 0, &mut tl).unwrap();
}

/// §3.3: a cudaMalloc fails when the device's free memory (capacity − context − other processes − what we
/// hold) is too small; the OOM error carries the §1.4 size and the free bytes.
#[test]
fn device_capacity_includes_context_and_other_processes() {
    let mut device = Device::with_capacity(GIB);
    device.context_bytes = 300 * MIB;
    device.other_processes = vec![vramsim_sim::device::OtherProcess {
        pid: 42,
        bytes: 200 * MIB,
    }];
    let mut a = CachingAllocator::new(AllocatorConfig::default(), device);
    let mut tl = Timeline::new();
    // 1 GiB − 300 MiB − 200 MiB = 524 MiB for the allocator.
    a.malloc(510 * MIB, 0, &mut tl).unwrap();
    let err = a.malloc(3 * MIB, 0, &mut tl).unwrap_err();
    assert_eq!(err.alloc_size, 20 * MIB);
    assert_eq!(err.device_free, 14 * MIB);
    assert_eq!(a.stats().num_ooms, 1);
    // 14 MiB free: a 14 MiB segment still fits.
    a.malloc(14 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.device_used(), GIB - 200 * MIB);
}

/// §3.1 rounding with roundup_power2_divisions (§1.2) reaches the block size.
#[test]
fn power2_divisions_round_block_sizes() {
    // (divisions for all sizes, request, block size handed out)
    let table: [(u64, u64, u64); 4] = [
        (4, 84 * MIB, 96 * MIB),
        (4, 1200, 1536),
        (8, 84 * MIB, 88 * MIB),
        (0, 84 * MIB, 84 * MIB),
    ];
    for (divisions, request, block) in table {
        let config = AllocatorConfig {
            roundup_power2_divisions: [divisions; 16],
            ..Default::default()
        };
        let mut a = allocator(config, 80 * GIB);
        let mut tl = Timeline::new();
        let b = a.malloc(request, 0, &mut tl).unwrap();
        assert_eq!(a.block_size(b), block, "{divisions} divisions, {request} B");
        assert_eq!(current(&a.stats().requested_bytes), request as i64);
    }
}
