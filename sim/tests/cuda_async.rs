//! The cuda-async pool model (`allocator::cuda_async`): its rules, case by case, and the memory-fraction
//! and out-of-memory texts of PyTorch's `CUDAMallocAsyncAllocator.cpp`.
//!
//! Expected numbers follow from the model's documented rules (pages of 2 MiB, used = Σ requested bytes),
//! not from running it. The rules marked UNCONFIRMED in the module documentation are what
//! `vramsim-validate replay --backend async` checks on a GPU; `tests/data/calibration/*.json` are
//! SYNTHETIC probe outputs (no real device), used to check that calibrated settings reach the model.

use vramsim_sim::allocator::cuda_async::{
    cuda_async_oom_message, CudaAsyncAllocator, CudaAsyncConfig, DEFAULT_PAGE_SIZE,
};
use vramsim_sim::allocator::{Action, Allocator, BlockState};
use vramsim_sim::device::Device;
use vramsim_sim::timeline::Timeline;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn pool(config: CudaAsyncConfig, capacity: u64) -> (CudaAsyncAllocator, Timeline) {
    (
        CudaAsyncAllocator::new(config, Device::with_capacity(capacity)),
        Timeline::new(),
    )
}

fn reserved(p: &CudaAsyncAllocator) -> u64 {
    p.stats().reserved_bytes.all.current as u64
}

fn allocated(p: &CudaAsyncAllocator) -> u64 {
    p.stats().allocated_bytes.all.current as u64
}

/// (requested sizes allocated in order on stream 0, expected reserved bytes) — growth in whole pages.
#[test]
fn reserved_memory_grows_in_whole_pages() {
    let cases: &[(&[u64], u64)] = &[
        (&[1], 2 * MIB),                        // a small allocation opens one shared page
        (&[1, 1], 2 * MIB),                     // and the next one fits beside it
        (&[MIB, MIB], 2 * MIB),                 // two halves fill the page exactly
        (&[MIB, MIB, 1], 4 * MIB),              // the third needs a new page
        (&[2 * MIB], 2 * MIB),                  // exactly one page
        (&[2 * MIB + 1], 4 * MIB),              // a byte more: two pages
        (&[3 * MIB, 1], 6 * MIB),               // a whole-page tail is not shared
        (&[100 * MIB + 7], 102 * MIB),          // ceil(size / 2 MiB) pages
        (&[1, 2 * MIB, 1, 10 * MIB], 14 * MIB), // small ones share a page, large ones take their own
    ];
    for (sizes, expected) in cases {
        let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
        for &size in *sizes {
            p.malloc(size, 0, &mut tl).unwrap();
        }
        assert_eq!(reserved(&p), *expected, "sizes {sizes:?}");
        assert_eq!(
            allocated(&p),
            sizes.iter().sum::<u64>(),
            "used = Σ requested, {sizes:?}"
        );
    }
}

#[test]
fn pytorch_stats_fill_only_allocated_active_and_reserved() {
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    let a = p.malloc(5 * MIB, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    let flat = p.stats().to_flat();
    for (key, value) in &flat {
        let filled = key.starts_with("allocated_bytes.all.")
            || key.starts_with("active_bytes.all.")
            || key.starts_with("reserved_bytes.all.");
        if !filled {
            assert_eq!(
                *value, 0,
                "{key} is not reported by the cudaMallocAsync backend"
            );
        }
    }
    assert_eq!(p.stats().allocated_bytes.all.peak, (5 * MIB) as i64);
    assert_eq!(p.stats().active_bytes.all.peak, (5 * MIB) as i64);
    assert_eq!(p.stats().reserved_bytes.all.peak, (6 * MIB) as i64);
    p.reset_peak_stats();
    assert_eq!(p.stats().allocated_bytes.all.peak, 0, "reset to current");
    assert_eq!(p.stats().reserved_bytes.all.peak, (6 * MIB) as i64);
}

#[test]
fn same_stream_reuses_at_once_and_pytorch_never_trims_at_sync() {
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    tl.enqueue(0, 1_000_000); // the stream is busy: the free completes later
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    p.malloc(64 * MIB, 0, &mut tl).unwrap();
    assert_eq!(
        reserved(&p),
        64 * MIB,
        "stream order makes same-stream reuse safe"
    );
    tl.synchronize();
    p.synchronize(&tl);
    assert_eq!(reserved(&p), 64 * MIB, "release threshold UINT64_MAX");
}

#[test]
fn other_streams_reuse_only_completed_frees_unless_the_device_is_full() {
    // Opportunistic reuse: the free on stream 0 is pending while stream 0 is busy.
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    tl.enqueue(0, 1_000_000);
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    p.malloc(64 * MIB, 1, &mut tl).unwrap();
    assert_eq!(
        reserved(&p),
        128 * MIB,
        "pending free: stream 1 gets new pages"
    );

    // Once stream 0 has passed the free, stream 1 may take the memory.
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    tl.enqueue(0, 1_000_000);
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    tl.synchronize_stream(0);
    p.malloc(64 * MIB, 1, &mut tl).unwrap();
    assert_eq!(reserved(&p), 64 * MIB, "completed free: reused by stream 1");

    // Internal dependencies: with no room to grow, stream 1 waits for stream 0 instead of failing.
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 100 * MIB);
    tl.enqueue(0, 1_000_000);
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    p.malloc(64 * MIB, 1, &mut tl).unwrap();
    assert_eq!(reserved(&p), 64 * MIB);
    assert_eq!(
        tl.stream_idle_at(1),
        1_000_000,
        "stream 1 now waits for the free"
    );

    // Without internal dependencies the same request is an out-of-memory error.
    let config = CudaAsyncConfig {
        reuse_allow_internal_dependencies: false,
        ..CudaAsyncConfig::pytorch()
    };
    let (mut p, mut tl) = pool(config, 100 * MIB);
    tl.enqueue(0, 1_000_000);
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    assert!(p.malloc(64 * MIB, 1, &mut tl).is_err());
}

#[test]
fn record_stream_frees_on_the_unifying_stream() {
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    p.record_stream(a, 7);
    tl.enqueue(7, 500);
    p.free(a, &mut tl);
    // Even the allocation stream must wait: the memory went back through PyTorch's unifying stream.
    p.malloc(64 * MIB, 0, &mut tl).unwrap();
    assert_eq!(reserved(&p), 128 * MIB);
    // After stream 7 is done, the first 64 MiB are free for anyone.
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    p.record_stream(a, 7);
    tl.enqueue(7, 500);
    p.free(a, &mut tl);
    tl.synchronize();
    p.malloc(64 * MIB, 3, &mut tl).unwrap();
    assert_eq!(reserved(&p), 64 * MIB);
}

#[test]
fn driver_default_threshold_trims_at_synchronization() {
    let (mut p, mut tl) = pool(CudaAsyncConfig::driver_default(), 8 * GIB);
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    let b = p.malloc(1, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    assert_eq!(
        reserved(&p),
        66 * MIB,
        "nothing happens before a synchronization"
    );
    tl.synchronize();
    p.synchronize(&tl);
    assert_eq!(
        reserved(&p),
        2 * MIB,
        "the page of the live small allocation stays"
    );
    p.free(b, &mut tl);
    p.synchronize(&tl);
    assert_eq!(reserved(&p), 0);

    // A threshold keeps that many bytes.
    let config = CudaAsyncConfig {
        release_threshold: 10 * MIB,
        ..CudaAsyncConfig::pytorch()
    };
    let (mut p, mut tl) = pool(config, 8 * GIB);
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    p.synchronize(&tl);
    assert_eq!(reserved(&p), 10 * MIB);
}

#[test]
fn empty_cache_synchronizes_and_trims_to_zero() {
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    let keep = p.malloc(3 * MIB, 1, &mut tl).unwrap();
    let a = p.malloc(64 * MIB, 0, &mut tl).unwrap();
    tl.enqueue(0, 2_000);
    p.free(a, &mut tl);
    p.empty_cache(&mut tl);
    assert_eq!(tl.now(), 2_000, "cudaDeviceSynchronize");
    assert_eq!(
        reserved(&p),
        4 * MIB,
        "only the live allocation's pages stay"
    );
    assert_eq!(allocated(&p), 3 * MIB);
    p.free(keep, &mut tl);
}

#[test]
fn small_frees_merge_and_an_empty_shared_page_is_a_whole_page_again() {
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    let a = p.malloc(MIB, 0, &mut tl).unwrap();
    let b = p.malloc(MIB, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    p.free(b, &mut tl);
    // The page is whole again: a 2 MiB allocation takes it.
    p.malloc(2 * MIB, 0, &mut tl).unwrap();
    assert_eq!(reserved(&p), 2 * MIB);
    let segments = p.segments();
    assert_eq!(segments.len(), 1);
    assert_eq!(segments[0].blocks[0].state, BlockState::ActiveAllocated);
}

#[test]
fn segments_account_for_every_reserved_byte() {
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    let _a = p.malloc(3 * MIB, 0, &mut tl).unwrap();
    let b = p.malloc(5000, 0, &mut tl).unwrap();
    let _c = p.malloc(700, 1, &mut tl).unwrap();
    let d = p.malloc(9 * MIB, 0, &mut tl).unwrap();
    p.free(b, &mut tl);
    p.free(d, &mut tl);
    let segments = p.segments();
    let total: u64 = segments.iter().map(|s| s.total_size).sum();
    assert_eq!(total, reserved(&p));
    for s in &segments {
        assert_eq!(s.blocks.iter().map(|b| b.size).sum::<u64>(), s.total_size);
    }
    let requested: u64 = segments.iter().map(|s| s.requested_size).sum();
    assert_eq!(requested, allocated(&p));
}

#[test]
fn memory_fraction_and_out_of_memory_use_pytorchs_text() {
    let config = CudaAsyncConfig {
        memory_fraction: Some(0.5),
        ..CudaAsyncConfig::pytorch()
    };
    let (mut p, mut tl) = pool(config, GIB);
    p.malloc(500 * MIB, 0, &mut tl).unwrap();
    let err = p.malloc(100 * MIB, 0, &mut tl).unwrap_err();
    assert_eq!(
        err.message,
        "Allocation on device 0 would exceed allowed memory. (out of memory)\n\
         Currently allocated     : 500.00 MiB\n\
         Requested               : 100.00 MiB\n\
         Device limit            : 1024.00 MiB\n\
         Free (according to CUDA): 524.00 MiB\n\
         PyTorch limit (set by user-supplied memory fraction)\n                        : 512.00 MiB"
    );
    // Without a fraction the limit prints as UINT64_MAX bytes, as in pytorch/pytorch#110194.
    let text = cuda_async_oom_message(5, 0, 0, 0, 0, u64::MAX);
    assert!(text.ends_with(": 17179869184.00 GiB"), "{text}");

    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 10 * MIB);
    let err = p.malloc(11 * MIB, 0, &mut tl).unwrap_err();
    assert_eq!(err.alloc_size, 12 * MIB);
    assert_eq!(reserved(&p), 0, "a failed request takes nothing");
    let err = p.malloc(1 << 60, 0, &mut tl).unwrap_err();
    assert_eq!(
        err.message,
        "CUDA out of memory. Tried to allocate more than 1EB memory."
    );
}

#[test]
fn history_names_page_growth_and_trimming() {
    let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 8 * GIB);
    p.set_record_history(true);
    let a = p.malloc(3 * MIB, 0, &mut tl).unwrap();
    p.free(a, &mut tl);
    p.empty_cache(&mut tl);
    let actions: Vec<Action> = p.take_history().iter().map(|h| h.action).collect();
    assert_eq!(
        actions,
        [
            Action::SegmentAlloc,
            Action::SegmentAlloc,
            Action::Alloc,
            Action::FreeRequested,
            Action::FreeCompleted,
            Action::SegmentFree,
            Action::SegmentFree,
        ]
    );
    assert_eq!(DEFAULT_PAGE_SIZE, 2 * MIB);
}

#[test]
fn same_calls_give_same_bytes() {
    let run = || {
        let (mut p, mut tl) = pool(CudaAsyncConfig::pytorch(), 4 * GIB);
        let mut live = Vec::new();
        for i in 0..500u64 {
            let size = (i * 7919) % (40 * MIB) + 1;
            let stream = i % 3;
            tl.enqueue(stream, i * 10);
            live.push(p.malloc(size, stream, &mut tl).unwrap());
            if i % 3 == 0 {
                let b = live.remove((i as usize * 31) % live.len());
                p.free(b, &mut tl);
            }
        }
        (p.stats().clone(), p.segments())
    };
    assert_eq!(run(), run());
}
