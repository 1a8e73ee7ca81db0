//! TensorFlow's / JAX's BFC allocator (`sim/src/allocator/bfc.rs`): the cases of TensorFlow's
//! `gpu_bfc_allocator_test.cc` (NoDups, ExerciseCoalescing, AllocatedVsRequested, TestCustomMemoryLimit,
//! AllocationsAndDeallocations' OOM, PhysicalAllocatorOomsFragmentation, TestRegionDeallocation) and
//! scenarios derived by hand from `bfc_allocator.cc`'s rules (bins, split/no split, best fit, coalescing
//! order, region doubling, backpedal, garbage collection, the memory limit).

use vramsim_sim::allocator::bfc::{
    bin_num_for_size, rounded_bytes, tf_default_memory_limit, BfcAllocator, BfcConfig, BfcFlavor,
};
use vramsim_sim::allocator::{Allocator, BlockRef, BlockState};
use vramsim_sim::device::Device;
use vramsim_sim::timeline::Timeline;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn tf(limit: u64, growth: bool, gc: bool) -> BfcConfig {
    BfcConfig {
        memory_limit: limit,
        allow_growth: growth,
        garbage_collection: gc,
        fragmentation_fraction: 0.0,
        flavor: BfcFlavor::TensorFlow,
    }
}

/// A BFC allocator on a device with room for the limit and more (the test's `1ull << 32` sub-allocator).
fn bfc(config: BfcConfig) -> BfcAllocator {
    BfcAllocator::new(config, Device::with_capacity(8 * GIB))
}

fn alloc(a: &mut BfcAllocator, tl: &mut Timeline, size: u64) -> BlockRef {
    a.malloc(size, 0, tl)
        .unwrap_or_else(|e| panic!("{size}: {}", e.message))
}

/// The (num_allocs, bytes_in_use, peak_bytes_in_use, largest_alloc_size) of `CheckStats`.
fn check_stats(a: &BfcAllocator) -> (u64, u64, u64, u64) {
    let s = a.bfc_stats();
    (
        s.num_allocs,
        s.bytes_in_use,
        s.peak_bytes_in_use,
        s.largest_alloc_size,
    )
}

#[test]
fn bins_are_powers_of_two_from_256_bytes() {
    // The constructor's CHECKs: bin b holds [256·2^b, 256·2^(b+1)); the last bin everything above.
    for b in 0..21usize {
        let size = 256u64 << b;
        assert_eq!(bin_num_for_size(size), b);
        assert_eq!(bin_num_for_size(size + 255), b);
        assert_eq!(bin_num_for_size(size * 2 - 1), b);
        if b + 1 < 21 {
            assert_ne!(bin_num_for_size(size * 2), b);
        }
    }
    assert_eq!(bin_num_for_size(1), 0);
    assert_eq!(bin_num_for_size(64 * GIB), 20);
    assert_eq!(rounded_bytes(1), 256);
    assert_eq!(rounded_bytes(256), 256);
    assert_eq!(rounded_bytes(257), 512);
}

#[test]
fn no_dups() {
    // NoDups: sizes 1..1023 round to 256, 512, 768 and 1024: 256·256 + 256·512 + 256·768 + 255·1024.
    let mut a = bfc(tf(GIB, false, true));
    let mut tl = Timeline::new();
    let blocks: Vec<_> = (1..1024).map(|s| alloc(&mut a, &mut tl, s)).collect();
    assert_eq!(check_stats(&a), (1023, 654336, 654336, 1024));
    let mut addrs: Vec<_> = blocks
        .iter()
        .map(|&b| (a.chunk_address(b), a.requested_size(b)))
        .collect();
    addrs.sort();
    for w in addrs.windows(2) {
        assert!(w[1].0 - w[0].0 >= w[0].1, "overlap");
    }
    for b in blocks {
        a.free(b, &mut tl);
    }
    assert_eq!(check_stats(&a), (1023, 0, 654336, 1024));
    // preallocation: one region of the whole limit
    assert_eq!(a.regions().len(), 1);
    assert_eq!(a.regions()[0].1, GIB);
}

#[test]
fn exercise_coalescing() {
    let mut a = bfc(tf(GIB, false, true));
    let mut tl = Timeline::new();
    let first = alloc(&mut a, &mut tl, 1024 * 4);
    let first_addr = a.chunk_address(first);
    a.free(first, &mut tl);
    assert_eq!(check_stats(&a), (1, 0, 4096, 4096));
    for _ in 0..1024 {
        let t1 = alloc(&mut a, &mut tl, 1024 * 4);
        let t2 = alloc(&mut a, &mut tl, 1048576 * 8);
        let t3 = alloc(&mut a, &mut tl, 2048 * 8);
        let t4 = alloc(&mut a, &mut tl, 10485760 * 4);
        for t in [t1, t2, t3, t4] {
            a.free(t, &mut tl);
        }
    }
    let peak = 1024 * 4 + 1048576 * 8 + 2048 * 8 + 10485760 * 4;
    assert_eq!(check_stats(&a), (4097, 0, peak, 10485760 * 4));
    // everything coalesced back into one chunk: the next allocation starts the region again
    let after = alloc(&mut a, &mut tl, 1024 * 4);
    assert_eq!(a.chunk_address(after), first_addr);
    let segments = a.segments();
    assert_eq!(segments.len(), 1);
    assert_eq!(segments[0].blocks.len(), 2);
}

#[test]
fn allocated_vs_requested() {
    let mut a = bfc(tf(GIB, false, true));
    let mut tl = Timeline::new();
    let t1 = alloc(&mut a, &mut tl, 4);
    assert_eq!(a.requested_size(t1), 4);
    assert_eq!(a.allocated_size(t1), 256);
    assert_eq!(a.stats().requested_bytes.all.current, 4);
    assert_eq!(a.stats().allocated_bytes.all.current, 256);
    assert_eq!(a.memory_info(), (256, 256));
}

#[test]
fn custom_memory_limit() {
    // TestCustomMemoryLimit: a 2 MiB limit holds 256 bytes but not 8 MiB.
    let mut a = bfc(tf(2 * MIB, false, true));
    let mut tl = Timeline::new();
    alloc(&mut a, &mut tl, 64 * 4);
    let err = a.malloc((2 << 20) * 4, 0, &mut tl).unwrap_err();
    assert_eq!(
        err.message,
        "ResourceExhaustedError: OOM when allocating tensor with shape[8388608] and type uint8 on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc"
    );
    assert_eq!(a.stats().num_ooms, 1);
}

#[test]
fn an_oom_does_not_prevent_later_allocations() {
    // AllocationsAndDeallocations: (1 << 30) + 1 bytes fail under a 1 GiB limit; small ones go on.
    let mut a = bfc(tf(GIB, false, true));
    let mut tl = Timeline::new();
    let b = alloc(&mut a, &mut tl, 1000);
    assert!(a.malloc(GIB + 1, 0, &mut tl).is_err());
    alloc(&mut a, &mut tl, 1000);
    a.free(b, &mut tl);
}

#[test]
fn growth_regions_double_and_fragmentation_ooms() {
    // PhysicalAllocatorOomsFragmentation: growth, 512 MiB; 128 × 4 MiB. The first request exceeds the
    // 2 MiB start, which doubles to 4 MiB (no further doubling); then 4 MiB (doubled after: 8), 8, 16,
    // ..., 256 MiB: 4 + 4 + 8 + ... + 256 = 512 MiB, 1 + 1 + 2 + ... + 64 = 128 allocations.
    for gc in [false, true] {
        let mut a = bfc(tf(512 * MIB, true, gc));
        let mut tl = Timeline::new();
        let blocks: Vec<_> = (0..128).map(|_| alloc(&mut a, &mut tl, 4 * MIB)).collect();
        let sizes: Vec<u64> = a.regions().iter().map(|&(_, s)| s / MIB).collect();
        assert_eq!(sizes, [4, 4, 8, 16, 32, 64, 128, 256]);
        for &b in &blocks[..127] {
            a.free(b, &mut tl);
        }
        // 508 MiB: no chunk (the largest free is 252 MiB), nothing left to reserve, and the free
        // regions (256 MiB) with the unreserved 0 cannot hold it either.
        assert!(a.malloc(512 * MIB - 4 * MIB, 0, &mut tl).is_err());
    }
}

#[test]
fn the_region_size_doubles_until_it_holds_the_request() {
    let mut a = bfc(tf(GIB, true, true));
    let mut tl = Timeline::new();
    assert_eq!(a.next_region_bytes(), 2 * MIB);
    // 5 MiB: 2 → 4 → 8 MiB, and no doubling after the success (it was increased); the 8 MiB chunk is
    // handed out whole (8 < 2 × 5 and 3 MiB < 128 MiB)
    let first = alloc(&mut a, &mut tl, 5 * MIB);
    assert_eq!(a.regions()[0].1, 8 * MIB);
    assert_eq!(a.allocated_size(first), 8 * MIB);
    assert_eq!(a.next_region_bytes(), 8 * MIB);
    // 1 MiB pieces: a region of 8 MiB (doubled after: 16) holds them
    for _ in 0..4 {
        alloc(&mut a, &mut tl, MIB);
    }
    let sizes: Vec<u64> = a.regions().iter().map(|&(_, s)| s / MIB).collect();
    assert_eq!(sizes, [8, 8]);
    assert_eq!(a.next_region_bytes(), 16 * MIB);
}

#[test]
fn split_only_when_the_chunk_is_twice_the_request_or_wastes_128_mib() {
    let mut tl = Timeline::new();
    // 300 MiB chunk, 200 MiB request: 300 < 400 and 100 < 128: handed out whole
    let mut a = bfc(tf(300 * MIB, false, true));
    let b = alloc(&mut a, &mut tl, 200 * MIB);
    assert_eq!(a.allocated_size(b), 300 * MIB);
    assert_eq!(a.bfc_stats().bytes_in_use, 300 * MIB);
    assert!(a.malloc(256, 0, &mut tl).is_err(), "nothing is left");
    // 150 MiB: 300 >= 2 × 150: split
    let mut a = bfc(tf(300 * MIB, false, true));
    let b = alloc(&mut a, &mut tl, 150 * MIB);
    assert_eq!(a.allocated_size(b), 150 * MIB);
    // 1000 MiB chunk, 800 MiB request: 200 MiB of waste >= 128 MiB: split
    let mut a = bfc(tf(1000 * MIB, false, true));
    let b = alloc(&mut a, &mut tl, 800 * MIB);
    assert_eq!(a.allocated_size(b), 800 * MIB);
    // with fragmentation_fraction 0.25 the waste limit is 250 MiB: not split
    let mut a = bfc(BfcConfig {
        fragmentation_fraction: 0.25,
        ..tf(1000 * MIB, false, true)
    });
    let b = alloc(&mut a, &mut tl, 800 * MIB);
    assert_eq!(a.allocated_size(b), 1000 * MIB);
}

#[test]
fn best_fit_by_size_then_address() {
    let mut a = bfc(tf(GIB, false, true));
    let mut tl = Timeline::new();
    let x = alloc(&mut a, &mut tl, MIB);
    let _sep1 = alloc(&mut a, &mut tl, 256);
    let y = alloc(&mut a, &mut tl, 2 * MIB);
    let _sep2 = alloc(&mut a, &mut tl, 256);
    let z = alloc(&mut a, &mut tl, MIB);
    let _sep3 = alloc(&mut a, &mut tl, 256);
    let (ax, ay, az) = (a.chunk_address(x), a.chunk_address(y), a.chunk_address(z));
    for b in [z, y, x] {
        a.free(b, &mut tl);
    }
    // two free 1 MiB chunks: the lower address wins
    let p = alloc(&mut a, &mut tl, MIB);
    assert_eq!(a.chunk_address(p), ax);
    // 1.5 MiB: the 2 MiB chunk, not the larger rest of the region (split: 2 >= 2 × 1.5 is false,
    // 0.5 MiB < 128 MiB: handed out whole)
    let q = alloc(&mut a, &mut tl, 3 * MIB / 2);
    assert_eq!(a.chunk_address(q), ay);
    assert_eq!(a.allocated_size(q), 2 * MIB);
    let r = alloc(&mut a, &mut tl, MIB);
    assert_eq!(a.chunk_address(r), az);
}

#[test]
fn a_freed_chunk_merges_with_its_next_then_its_previous_neighbour() {
    let mut a = bfc(tf(GIB, false, true));
    let mut tl = Timeline::new();
    let x = alloc(&mut a, &mut tl, MIB);
    let y = alloc(&mut a, &mut tl, MIB);
    let z = alloc(&mut a, &mut tl, MIB);
    let w = alloc(&mut a, &mut tl, MIB);
    let base = a.chunk_address(x);
    a.free(x, &mut tl);
    a.free(z, &mut tl);
    // x | y | z | w | rest: freeing y joins z (next), then x (previous): one 3 MiB chunk at x
    a.free(y, &mut tl);
    let blocks = &a.segments()[0].blocks;
    let states: Vec<_> = blocks
        .iter()
        .map(|b| (b.address - base, b.size, b.state))
        .collect();
    assert_eq!(
        states,
        [
            (0, 3 * MIB, BlockState::Inactive),
            (3 * MIB, MIB, BlockState::ActiveAllocated),
            (4 * MIB, GIB - 4 * MIB, BlockState::Inactive),
        ]
    );
    // freeing w joins the rest (next) and the 3 MiB chunk (previous): the whole region again
    a.free(w, &mut tl);
    let blocks = &a.segments()[0].blocks;
    assert_eq!(blocks.len(), 1);
    assert_eq!((blocks[0].address, blocks[0].size), (base, GIB));
}

#[test]
fn garbage_collection_returns_free_regions_on_the_oom_path() {
    // Growth under a 16 MiB limit: regions of 2 (A), 4 (B), 8 (C) MiB; A and B freed. 8 MiB fits no
    // chunk, and only 2 MiB is unreserved; with GC the 6 MiB of free regions go back, 8 MiB can be
    // reserved (min(16 MiB next region, 8 MiB available)) and the request succeeds.
    for gc in [true, false] {
        let mut a = bfc(tf(16 * MIB, true, gc));
        let mut tl = Timeline::new();
        let x = alloc(&mut a, &mut tl, 2 * MIB);
        let y = alloc(&mut a, &mut tl, 4 * MIB);
        let _z = alloc(&mut a, &mut tl, 8 * MIB);
        let sizes: Vec<u64> = a.regions().iter().map(|&(_, s)| s / MIB).collect();
        assert_eq!(sizes, [2, 4, 8]);
        a.free(x, &mut tl);
        a.free(y, &mut tl);
        let result = a.malloc(8 * MIB, 0, &mut tl);
        if gc {
            assert!(result.is_ok());
            let sizes: Vec<u64> = a.regions().iter().map(|&(_, s)| s / MIB).collect();
            assert_eq!(sizes, [8, 8]);
            assert_eq!(a.stats().num_device_free, 2);
            assert_eq!(a.stats().reserved_bytes.all.current, 16 * MIB as i64);
        } else {
            assert!(result.is_err());
            assert_eq!(a.stats().reserved_bytes.all.current, 14 * MIB as i64);
        }
    }
}

#[test]
fn backpedal_once_when_the_device_refuses_the_region() {
    // A 1 GiB limit on a 100 MiB device: the preallocated region is refused; the one backpedal tries
    // 0.9^k GiB until the device accepts: 0.9^22 GiB = 105.7 MiB > 100 MiB, 0.9^23 GiB = 95.1 MiB.
    let mut a = BfcAllocator::new(tf(GIB, false, true), Device::with_capacity(100 * MIB));
    let mut tl = Timeline::new();
    let b = alloc(&mut a, &mut tl, MIB);
    let region = a.regions()[0].1;
    let expected = GIB as f64 * 0.9f64.powi(23);
    // float products rounded up to 256 at each of the 23 steps
    assert!(
        (region as f64 - expected).abs() < 23.0 * 256.0 + expected * 1e-6,
        "{region}"
    );
    assert!(region <= 100 * MIB);
    a.free(b, &mut tl);
    // fill the region: the next request finds the device with under 5 MiB free and the limit's next
    // region refused; the backpedal is spent, so it fails although 1 MiB would fit on the device
    let whole = alloc(&mut a, &mut tl, region);
    assert!(a.malloc(MIB, 0, &mut tl).is_err());
    assert!(100 * MIB - region > MIB);
    a.free(whole, &mut tl);
}

#[test]
fn jax_names_its_oom_as_xla_does() {
    let mut a = bfc(BfcConfig {
        flavor: BfcFlavor::Jax,
        ..tf(2 * MIB, false, false)
    });
    let mut tl = Timeline::new();
    let err = a.malloc(3 * MIB, 0, &mut tl).unwrap_err();
    assert_eq!(
        err.message,
        "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3145728 bytes."
    );
}

#[test]
fn tensorflow_reserves_system_memory_by_compute_capability() {
    // MinSystemMemory: 1536 MiB on an 8.x card with 22 GiB free, 225 MiB under 2 GiB
    assert_eq!(tf_default_memory_limit(22 * GIB, 8), 22 * GIB - 1536 * MIB);
    assert_eq!(tf_default_memory_limit(22 * GIB, 9), 22 * GIB - 1800 * MIB);
    assert_eq!(tf_default_memory_limit(22 * GIB, 7), 22 * GIB - 1050 * MIB);
    assert_eq!(tf_default_memory_limit(GIB, 9), GIB - 225 * MIB);
}

mod random {
    //! Random programs: after every step the chunks tile their regions, no two free chunks are
    //! neighbours (`TryToCoalesce` merged them), `bytes_in_use` is the sum of the chunks in use, every
    //! live block holds at least its rounded request, and the regions stay within the memory limit.
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Alloc(u64),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let size = (0u32..25, any::<u64>()).prop_map(|(e, r)| (1u64 << e) + r % (1u64 << e));
        prop_oneof![3 => size.prop_map(Op::Alloc), 2 => any::<usize>().prop_map(Op::Free)]
    }

    fn check(a: &BfcAllocator, live: &[(BlockRef, u64)], limit: u64) {
        let mut in_use = 0;
        let mut reserved = 0;
        for s in a.segments() {
            reserved += s.total_size;
            let mut at = s.address;
            let mut previous_free = false;
            for b in &s.blocks {
                assert_eq!(b.address, at, "chunks tile the region");
                at += b.size;
                assert_eq!(b.size % 256, 0);
                let free = b.state == BlockState::Inactive;
                assert!(!(free && previous_free), "two free neighbours");
                previous_free = free;
                if !free {
                    in_use += b.size;
                }
            }
            assert_eq!(at, s.address + s.total_size);
        }
        assert!(reserved <= limit);
        assert_eq!(a.bfc_stats().bytes_in_use, in_use);
        assert_eq!(a.bfc_stats().pool_bytes, reserved);
        assert_eq!(a.stats().allocated_bytes.all.current as u64, in_use);
        for &(b, size) in live {
            assert!(a.allocated_size(b) >= rounded_bytes(size));
            assert_eq!(a.requested_size(b), size);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn invariants_hold_after_every_step(
            ops in proptest::collection::vec(op(), 1..80),
            growth in any::<bool>(),
            gc in any::<bool>(),
        ) {
            let limit = 256 * MIB;
            let mut a = BfcAllocator::new(tf(limit, growth, gc), Device::with_capacity(GIB));
            let mut tl = Timeline::new();
            let mut live: Vec<(BlockRef, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(size) => {
                        if let Ok(b) = a.malloc(size, 0, &mut tl) {
                            live.push((b, size));
                        }
                    }
                    Op::Free(pick) if !live.is_empty() => {
                        let (b, _) = live.swap_remove(pick % live.len());
                        a.free(b, &mut tl);
                    }
                    Op::Free(_) => {}
                }
                check(&a, &live, limit);
            }
        }
    }
}
