//! The acceptance cases of `pytorch_allocator.md` §13 that need no CUDA graphs or MemPools (1–9, 18–22),
//! each replaying what PyTorch's own test does and checking what it checks.

use vramsim_sim::allocator::caching::{check_snapshot, CachingAllocator};
use vramsim_sim::allocator::{Action, Allocator, BlockRef, BlockState};
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::oom::MORE_THAN_1EB_MESSAGE;
use vramsim_sim::timeline::Timeline;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// `torch.cuda.get_device_properties(0).total_memory` of an H100 80GB HBM3 ("79.19 GiB").
const H100_TOTAL: u64 = 85_031_714_816;

fn allocator(config: AllocatorConfig) -> CachingAllocator {
    CachingAllocator::new(config, Device::with_capacity(H100_TOTAL))
}

fn consistent(a: &CachingAllocator) {
    if let Err(e) = check_snapshot(a.stats(), &a.segments()) {
        panic!("stats and snapshot disagree: {e}");
    }
}

/// Case 1, test_memory_stats: a 256-float tensor moves active_bytes by 1024; freeing + empty_cache
/// returns it; resetting peaks brings the peaks back to the current values.
#[test]
fn case_01_memory_stats() {
    let mut a = allocator(AllocatorConfig::default());
    let mut tl = Timeline::new();
    a.reset_peak_stats();
    a.reset_accumulated_stats();
    let start = a.stats().active_bytes.all.current;
    let x = a.malloc(256 * 4, 0, &mut tl).unwrap();
    assert_eq!(a.stats().active_bytes.all.current - start, 1024);
    assert_eq!(a.stats().active_bytes.all.freed, 0);
    a.free(x, &mut tl);
    a.empty_cache(&mut tl);
    assert_eq!(a.stats().active_bytes.all.current, start);
    assert_eq!(a.stats().active_bytes.all.freed, 1024);
    a.reset_peak_stats();
    assert_eq!(a.stats().allocated_bytes.all.peak, 0);
    assert_eq!(a.stats().reserved_bytes.all.peak, 0);
    consistent(&a);
}

/// Case 2, test_memory_allocation: caching_allocator_alloc(1) adds 512 to memory_allocated.
#[test]
fn case_02_memory_allocation() {
    let mut a = allocator(AllocatorConfig::default());
    let mut tl = Timeline::new();
    let before = a.stats().allocated_bytes.all.current;
    let x = a.malloc(1, 0, &mut tl).unwrap();
    assert_eq!(a.stats().allocated_bytes.all.current, before + 512);
    a.free(x, &mut tl);
    assert_eq!(a.stats().allocated_bytes.all.current, before);
}

/// Case 3, test_cachingAllocator_raw_alloc: raw_alloc(1 MiB) adds 1 MiB to requested_bytes.all.allocated.
#[test]
fn case_03_raw_alloc_requested_bytes() {
    let mut a = allocator(AllocatorConfig::default());
    let mut tl = Timeline::new();
    let before = a.stats().requested_bytes.all.allocated;
    let x = a.malloc(MIB, 0, &mut tl).unwrap();
    assert_eq!(a.stats().requested_bytes.all.allocated - before, 1_048_576);
    a.free(x, &mut tl);
}

/// Case 4, test_allocator_settings: Δ active_bytes.all.allocated for an 84 MiB tensor under each setting.
#[test]
fn case_04_allocator_settings() {
    let nbytes = 21 * MIB * 4; // 88,080,384
    let gc_list = AllocatorConfig {
        garbage_collection_threshold: 0.5,
        // [64:8,128:2,256:2,512:2,1024:1,>:1]: entries 0–6 = 8, 7–9 = 2, 10 = 1, NEW '>' from 11 = 1.
        roundup_power2_divisions: [8, 8, 8, 8, 8, 8, 8, 2, 2, 2, 1, 1, 1, 1, 1, 1],
        ..Default::default()
    };
    // (settings, request, Δ active_bytes.all.allocated)
    let table: Vec<(&str, AllocatorConfig, u64, u64)> = vec![
        ("", AllocatorConfig::default(), nbytes, 88_080_384),
        (
            "roundup_power2_divisions:4",
            AllocatorConfig {
                roundup_power2_divisions: [4; 16],
                ..Default::default()
            },
            nbytes,
            100_663_296,
        ),
        (
            "garbage_collection_threshold:0.5,max_split_size_mb:40",
            AllocatorConfig {
                garbage_collection_threshold: 0.5,
                max_split_size: 40 * MIB,
                ..Default::default()
            },
            nbytes,
            88_080_384,
        ),
        (
            "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,…] (84 MiB)",
            gc_list.clone(),
            nbytes,
            92_274_688,
        ),
        (
            "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,…] (400 MiB)",
            gc_list,
            100 * MIB * 4,
            536_870_912,
        ),
        (
            "release_lock_on_cudamalloc:True",
            AllocatorConfig {
                release_lock_on_cudamalloc: true,
                ..Default::default()
            },
            nbytes,
            88_080_384,
        ),
    ];
    for (settings, config, request, delta) in table {
        let mut a = allocator(config);
        let mut tl = Timeline::new();
        let before = a.stats().active_bytes.all.allocated;
        let before_requested = a.stats().requested_bytes.all.allocated;
        a.malloc(request, 0, &mut tl).unwrap();
        assert_eq!(
            a.stats().active_bytes.all.allocated - before,
            delta as i64,
            "{settings}"
        );
        assert_eq!(
            a.stats().requested_bytes.all.allocated - before_requested,
            request as i64,
            "{settings}"
        );
        consistent(&a);
    }
}

/// Case 5, test_out_of_memory: 800,000,000 GiB goes through the allocator and fails with that size;
/// 8,000,000,000 GiB (≥ 2^60 B) is refused up front without touching any stat.
#[test]
fn case_05_out_of_memory() {
    let mut a = allocator(AllocatorConfig::default());
    let mut tl = Timeline::new();
    let err = a.malloc(GIB * 800_000_000, 0, &mut tl).unwrap_err();
    // The regex of the PyTorch test.
    assert!(
        err.message
            .contains("Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of"),
        "{}",
        err.message
    );
    assert_eq!(err.alloc_size, 858_993_459_200_000_000);
    assert_eq!(err.requested, GIB * 800_000_000);
    assert_eq!(a.stats().num_ooms, 1);
    let stats_before = a.stats().clone();
    let err = a.malloc(GIB * 8_000_000_000, 0, &mut tl).unwrap_err();
    assert_eq!(err.message, MORE_THAN_1EB_MESSAGE);
    assert_eq!(err.alloc_size, 0);
    assert_eq!(a.stats(), &stats_before, "no stats touched");
}

/// Case 6, test_out_of_memory_retry: half the device succeeds, a second half fails (the context takes
/// room), and after freeing the first the second succeeds from the cache.
#[test]
fn case_06_out_of_memory_retry() {
    let mut device = Device::with_capacity(8 * GIB);
    device.context_bytes = 500 * MIB;
    let total = device.total_memory;
    let mut a = CachingAllocator::new(AllocatorConfig::default(), device);
    let mut tl = Timeline::new();
    let half = total / 2;
    let x = a.malloc(half, 0, &mut tl).unwrap();
    let address = a.block_address(x);
    assert!(a.malloc(half, 0, &mut tl).is_err());
    a.free(x, &mut tl);
    let y = a.malloc(half, 0, &mut tl).unwrap();
    assert_eq!(a.block_address(y), address);
    assert_eq!(a.stats().segment.all.current, 1);
    consistent(&a);
}

/// Case 7, test_set_per_process_memory_fraction / test_get_per_process_memory_fraction.
#[test]
fn case_07_per_process_memory_fraction() {
    let mut a = allocator(AllocatorConfig::default());
    let mut tl = Timeline::new();
    a.set_memory_fraction(0.5);
    // int(0.499 · T) − max_memory_reserved() succeeds.
    let application = (H100_TOTAL as f64 * 0.499) as u64 - a.stats().reserved_bytes.all.peak as u64;
    let x = a.malloc(application, 0, &mut tl).unwrap();
    a.free(x, &mut tl);
    a.empty_cache(&mut tl);
    // int(0.5 · T) fails: its 2 MiB-rounded segment exceeds size_t(0.5 · T).
    let application = (H100_TOTAL as f64 * 0.5) as u64;
    let err = a.malloc(application, 0, &mut tl).unwrap_err();
    assert_eq!(err.alloc_size, application.div_ceil(2 * MIB) * 2 * MIB);
    // get_per_process_memory_fraction round-trips (allowed / total).
    for fraction in [1.0, 0.0, 0.5, 0.123_456_789, 0.987_654_321] {
        a.set_memory_fraction(fraction);
        let got = a.memory_fraction();
        assert!((got - fraction).abs() < 1e-9, "set {fraction}, got {got}");
    }
    a.set_memory_fraction(0.0);
    assert_eq!(a.memory_fraction(), 0.0);
    a.set_memory_fraction(1.0);
    assert_eq!(a.memory_fraction(), 1.0);
}

/// Case 7: fractions outside [0, 1] are rejected.
#[test]
#[should_panic(expected = "invalid fraction")]
fn case_07_fraction_out_of_range_panics() {
    allocator(AllocatorConfig::default()).set_memory_fraction(1.5);
}

/// The 120 MiB budget of cases 8 and 9: fraction = 120 MiB / total, and int(fraction · total) is exactly
/// 120 MiB (the test asserts it).
fn budget_allocator(config: AllocatorConfig) -> CachingAllocator {
    let mut a = allocator(config);
    let fraction = (120 * MIB) as f64 / H100_TOTAL as f64;
    a.set_memory_fraction(fraction);
    assert_eq!(a.allowed_memory_maximum(), Some(120 * MIB));
    a
}

/// Case 8, test_max_split_expandable: 40 MiB plain, 40 MiB expandable, 40 MiB plain, a 4th OOMs; after
/// freeing all three, 120 MiB succeeds — release_available_cached_blocks walks past the expandable block
/// (NEW) and release_cached_blocks unmaps it.
#[test]
fn case_08_max_split_expandable() {
    let plain = AllocatorConfig {
        expandable_segments: false,
        max_split_size: 40 * MIB,
        ..Default::default()
    };
    let expandable = AllocatorConfig {
        expandable_segments: true,
        ..plain.clone()
    };
    let mut a = budget_allocator(plain.clone());
    let mut tl = Timeline::new();
    let x = a.malloc(40 * MIB, 0, &mut tl).unwrap();
    a.set_allocator_settings(expandable);
    let y = a.malloc(40 * MIB, 0, &mut tl).unwrap();
    a.set_allocator_settings(plain);
    let z = a.malloc(40 * MIB, 0, &mut tl).unwrap();
    consistent(&a);
    assert!(a.malloc(40 * MIB, 0, &mut tl).is_err());
    for b in [x, y, z] {
        a.free(b, &mut tl);
    }
    consistent(&a);
    a.malloc(120 * MIB, 0, &mut tl).unwrap();
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all.current, (120 * MIB) as i64);
    assert_eq!(s.segment.all.current, 1);
    // cudaMalloc ×3 + one map; cudaFree ×2 (release_available) + one unmap (release_cached_blocks).
    assert_eq!(s.num_device_alloc, 4);
    assert_eq!(s.num_device_free, 3);
    assert_eq!(s.num_ooms, 1);
    assert_eq!(s.num_alloc_retries, 2);
    assert_eq!(a.expandable_segment_count(), 0);
    consistent(&a);
}

/// Case 9, test_garbage_collect_expandable: 40 MiB plain + 40 MiB expandable, both freed; an 80 MiB
/// expandable request runs GC, which frees the plain block and leaves the (split) expandable one, which
/// then grows by one more 20 MiB page pair.
#[test]
fn case_09_garbage_collect_expandable() {
    let plain = AllocatorConfig {
        garbage_collection_threshold: 0.5,
        ..Default::default()
    };
    let expandable = AllocatorConfig {
        expandable_segments: true,
        ..plain.clone()
    };
    let mut a = budget_allocator(plain);
    let mut tl = Timeline::new();
    let x = a.malloc(40 * MIB, 0, &mut tl).unwrap();
    a.set_allocator_settings(expandable);
    let y = a.malloc(40 * MIB, 0, &mut tl).unwrap();
    let y_address = a.block_address(y);
    a.free(x, &mut tl);
    a.free(y, &mut tl);
    a.set_record_history(true);
    let z = a.malloc(80 * MIB, 0, &mut tl).unwrap();
    assert_eq!(a.block_address(z), y_address);
    let history = a.take_history();
    let actions: Vec<Action> = history.iter().map(|h| h.action).collect();
    assert_eq!(
        actions,
        [Action::SegmentFree, Action::SegmentMap, Action::Alloc]
    );
    assert_eq!(history[1].addr, y_address + 40 * MIB);
    assert_eq!(history[1].size, 40 * MIB);
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all.current, (80 * MIB) as i64);
    assert_eq!(s.segment.all.current, 0);
    assert_eq!(s.num_alloc_retries, 0);
    consistent(&a);
}

/// Case 18, test_record_stream: a block recorded on the main stream is not reused by the side stream
/// until the main stream's work is done; after synchronizing, the next allocation gets the same pointer.
#[test]
fn case_18_record_stream() {
    const MAIN: u64 = 0;
    const SIDE: u64 = 1;
    let mut a = allocator(AllocatorConfig::default());
    let mut tl = Timeline::new();
    let size = 4 * 4;
    // tmp = t.cuda(non_blocking=True) on the side stream.
    let tmp = a.malloc(size, SIDE, &mut tl).unwrap();
    let ptr = a.block_address(tmp);
    // main waits for side, tmp.record_stream(main), 50 ms sleep + copy on main; tmp goes out of scope.
    a.record_stream(tmp, MAIN);
    tl.enqueue(MAIN, 50_000_000);
    a.free(tmp, &mut tl);
    let pending = a.segments();
    assert_eq!(pending[0].blocks[0].state, BlockState::ActivePendingFree);
    // tmp2 on the side stream: "allocation re-used to soon" must not happen.
    let tmp2 = a.malloc(size, SIDE, &mut tl).unwrap();
    assert_ne!(a.block_address(tmp2), ptr);
    consistent(&a);
    // torch.cuda.current_stream().synchronize(), then tmp3 on the side stream reuses tmp's block.
    tl.synchronize_stream(MAIN);
    let tmp3 = a.malloc(size, SIDE, &mut tl).unwrap();
    assert_eq!(a.block_address(tmp3), ptr, "allocation not re-used");
    consistent(&a);
}

/// Case 19, test_caching_allocator_record_stream_oom: 100 × 160 MiB allocations whose frees wait on a
/// side stream never OOM: the last-resort stage waits for the events and frees the blocks. On a 2 GiB
/// device 11 blocks fit next to `y`, so stage 4e runs at allocations 12, 23, …, 100: 9 times.
#[test]
fn case_19_record_stream_oom() {
    const SIDE: u64 = 1;
    let mut a = CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(2 * GIB));
    let mut tl = Timeline::new();
    let n = 40 * MIB * 4;
    let y = a.malloc(n, SIDE, &mut tl).unwrap();
    for _ in 0..100 {
        let x = a.malloc(n, 0, &mut tl).unwrap();
        // y += x on the side stream
        tl.enqueue(SIDE, 1_000_000);
        a.record_stream(x, SIDE);
        a.free(x, &mut tl);
        consistent(&a);
    }
    let s = a.stats();
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.num_alloc_retries, 9);
    assert_eq!(s.num_sync_all_streams, 9);
    assert!(tl.now() > 0, "waiting for the events moved the host clock");
    a.empty_cache(&mut tl);
    assert_eq!(a.stats().reserved_bytes.all.current, n as i64);
    a.free(y, &mut tl);
    consistent(&a);
}

/// Case 20, test_memory_snapshot / test_cpp_memory_snapshot_pickle: the block's requested size and
/// address, the last trace entry after empty_cache (segment_free), and the unrounded size of `alloc`.
#[test]
fn case_20_memory_snapshot() {
    let mut a = allocator(AllocatorConfig::default());
    let mut tl = Timeline::new();
    a.set_record_history(true);
    let x = a.malloc(311 * 411 * 4, 0, &mut tl).unwrap();
    let segments = a.segments();
    let block = segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.state == BlockState::ActiveAllocated)
        .unwrap();
    assert_eq!(block.requested_size, 511_284);
    assert_eq!(block.address, a.block_address(x));
    let history = a.take_history();
    let last = history.last().unwrap();
    assert_eq!((last.action, last.size), (Action::Alloc, 311 * 411 * 4));
    a.free(x, &mut tl);
    a.empty_cache(&mut tl);
    let history = a.take_history();
    assert_eq!(history.last().unwrap().action, Action::SegmentFree);

    // test_cpp_memory_snapshot_pickle: 31×41 floats.
    let y = a.malloc(31 * 41 * 4, 0, &mut tl).unwrap();
    let last = a.take_history().pop().unwrap();
    assert_eq!((last.action, last.size), (Action::Alloc, 31 * 41 * 4));
    assert_eq!(last.addr, a.block_address(y));
}

/// Case 21, _test_memory_stats_generator (N = 35) with _check_memory_stat_consistency after every step.
#[test]
fn case_21_memory_stats_generator() {
    let mut a = allocator(AllocatorConfig::default());
    let mut tl = Timeline::new();
    let n = 35usize;
    let mut tracker = Tracker::new(&a);
    let float = |dims: &[u64]| dims.iter().product::<u64>() * 4;

    let step = |a: &mut CachingAllocator,
                tl: &mut Timeline,
                tracker: &mut Tracker,
                comp: i32,
                empty_cache: bool,
                reset_peak: bool| {
        tracker.assert_change(a, tl, comp, empty_cache, reset_peak);
        consistent(a);
    };
    let alloc = |a: &mut CachingAllocator, tl: &mut Timeline, bytes: u64| -> Option<BlockRef> {
        // An empty tensor (bytes == 0) has no storage: the allocator is not called.
        (bytes > 0).then(|| a.malloc(bytes, 0, tl).unwrap())
    };
    let free = |a: &mut CachingAllocator, tl: &mut Timeline, b: Option<BlockRef>| {
        if let Some(b) = b {
            a.free(b, tl);
        }
    };

    step(&mut a, &mut tl, &mut tracker, 0, false, false);
    step(&mut a, &mut tl, &mut tracker, 0, false, true);
    step(&mut a, &mut tl, &mut tracker, 0, true, false);
    step(&mut a, &mut tl, &mut tracker, 0, false, true);
    step(&mut a, &mut tl, &mut tracker, 0, false, false);

    let m0 = a.stats().allocated_bytes.all.current;
    let tensors1: Vec<Option<BlockRef>> = [float(&[1]), float(&[10, 20]), float(&[200, 300, 2000])]
        .into_iter()
        .map(|bytes| alloc(&mut a, &mut tl, bytes))
        .collect();
    let m1 = a.stats().allocated_bytes.all.current;
    step(&mut a, &mut tl, &mut tracker, 1, false, false);

    let mut tensors2: Vec<(Option<BlockRef>, u64)> = Vec::new();
    for i in 1..=(n / 2) as u64 {
        let bytes = float(&[i, i * 4]);
        tensors2.push((alloc(&mut a, &mut tl, bytes), bytes));
        step(&mut a, &mut tl, &mut tracker, 1, false, false);
    }
    for i in 5..(n / 2 + 5) as u64 {
        let bytes = float(&[i, i * 7, i * 9, i * 11]);
        tensors2.push((alloc(&mut a, &mut tl, bytes), bytes));
        step(&mut a, &mut tl, &mut tracker, 1, false, i % 2 == 0);
    }
    tensors2.push((None, 0));
    step(&mut a, &mut tl, &mut tracker, 0, false, false);

    // torch.randperm: any fixed permutation will do.
    let mut order: Vec<usize> = (0..tensors2.len()).collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let permuted: Vec<(Option<BlockRef>, u64)> = order.iter().map(|&i| tensors2[i]).collect();
    let mut tensors2 = permuted;
    step(&mut a, &mut tl, &mut tracker, 0, false, true);

    for i in 0..n / 2 {
        let (block, bytes) = tensors2.remove(i);
        free(&mut a, &mut tl, block);
        step(
            &mut a,
            &mut tl,
            &mut tracker,
            -(bytes.min(1) as i32),
            false,
            false,
        );
    }
    for i in 2..(2 * n / 3 + 2) as u64 {
        let bytes = float(&[i, i * 3, i * 8]);
        tensors2.push((alloc(&mut a, &mut tl, bytes), bytes));
        step(&mut a, &mut tl, &mut tracker, 1, true, false);
    }
    for (block, _) in tensors2 {
        free(&mut a, &mut tl, block);
    }
    step(&mut a, &mut tl, &mut tracker, -1, false, true);
    step(&mut a, &mut tl, &mut tracker, 0, false, false);
    assert_eq!(a.stats().allocated_bytes.all.current, m1);

    for block in tensors1 {
        free(&mut a, &mut tl, block);
    }
    step(&mut a, &mut tl, &mut tracker, -1, false, true);
    assert_eq!(a.stats().allocated_bytes.all.current, m0);
    step(&mut a, &mut tl, &mut tracker, 0, true, false);
    step(&mut a, &mut tl, &mut tracker, 0, false, true);
}

/// The `assert_change` helper of _test_memory_stats_generator.
struct Tracker {
    last_m: i64,
    max_m: i64,
    last_r: i64,
    max_r: i64,
}

impl Tracker {
    fn new(a: &CachingAllocator) -> Tracker {
        let s = a.stats();
        Tracker {
            last_m: s.allocated_bytes.all.current,
            max_m: s.allocated_bytes.all.peak,
            last_r: s.reserved_bytes.all.current,
            max_r: s.reserved_bytes.all.peak,
        }
    }

    fn assert_change(
        &mut self,
        a: &mut CachingAllocator,
        tl: &mut Timeline,
        comp: i32,
        empty_cache: bool,
        reset_peak: bool,
    ) {
        let s = a.stats();
        let (new_m, new_max_m) = (s.allocated_bytes.all.current, s.allocated_bytes.all.peak);
        match comp.signum() {
            1 => assert!(new_m > self.last_m),
            -1 => assert!(new_m < self.last_m),
            _ => assert_eq!(new_m, self.last_m),
        }
        assert!(new_m <= new_max_m);
        assert!(new_max_m >= self.max_m);
        self.last_m = new_m;
        self.max_m = new_max_m;
        let (new_r, new_max_r) = (s.reserved_bytes.all.current, s.reserved_bytes.all.peak);
        assert!(new_r <= new_max_r);
        assert!(new_max_r >= self.max_r);
        self.last_r = new_r;
        self.max_r = new_max_r;
        if empty_cache {
            a.empty_cache(tl);
            let s = a.stats();
            let (new_r, new_max_r) = (s.reserved_bytes.all.current, s.reserved_bytes.all.peak);
            assert!(new_r <= self.last_r, "empty_cache never increases reserved");
            assert!(new_r <= new_max_r);
            assert_eq!(
                new_max_r, self.max_r,
                "empty_cache leaves the reserved peak"
            );
            self.last_r = new_r;
        }
        if reset_peak {
            a.reset_peak_stats();
            let s = a.stats();
            assert_eq!(s.allocated_bytes.all.current, self.last_m);
            assert_eq!(s.allocated_bytes.all.peak, self.last_m);
            self.max_m = self.last_m;
            assert_eq!(s.reserved_bytes.all.current, self.last_r);
            assert_eq!(s.reserved_bytes.all.peak, self.last_r);
            self.max_r = self.last_r;
        }
    }
}

/// Case 22, test_notifies_oom / test_raises_oom: a 1 TiB request fails, with or without
/// max_split_size_mb:1024, and the failure carries what the OOM observers get.
#[test]
fn case_22_raises_oom() {
    for max_split_size in [u64::MAX, 1024 * MIB] {
        let mut a = allocator(AllocatorConfig {
            max_split_size,
            ..Default::default()
        });
        let mut tl = Timeline::new();
        let err = a.malloc(1 << 40, 0, &mut tl).unwrap_err();
        assert_eq!(err.alloc_size, 1 << 40);
        assert_eq!(err.device_free, H100_TOTAL);
        assert_eq!(a.stats().num_ooms, 1);
        assert_eq!(a.stats().reserved_bytes.all.current, 0);
    }
}
