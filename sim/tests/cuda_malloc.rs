//! `PYTORCH_NO_CUDA_MEMORY_CACHING=1`: every allocation is its own cudaMalloc of exactly the requested size
//! and every free a cudaFree (see the module documentation of `cuda_malloc.rs` for what is counted).

use vramsim_sim::allocator::caching::check_snapshot;
use vramsim_sim::allocator::cuda_malloc::{CudaMallocAllocator, CUDA_ERROR_OUT_OF_MEMORY};
use vramsim_sim::allocator::{Action, Allocator, BlockState};
use vramsim_sim::device::Device;
use vramsim_sim::oom::MORE_THAN_1EB_MESSAGE;
use vramsim_sim::timeline::Timeline;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

#[test]
fn every_allocation_is_exactly_its_size() {
    let mut a = CudaMallocAllocator::new(Device::with_capacity(GIB));
    let mut tl = Timeline::new();
    let sizes = [1u64, 1000, MIB + 1, 25 * MIB + 1];
    let blocks: Vec<_> = sizes
        .iter()
        .map(|&size| a.malloc(size, 0, &mut tl).unwrap())
        .collect();
    let total: u64 = sizes.iter().sum();
    let s = a.stats();
    for array in [
        &s.allocated_bytes,
        &s.reserved_bytes,
        &s.active_bytes,
        &s.requested_bytes,
    ] {
        assert_eq!(array.all.current, total as i64);
    }
    for array in [&s.allocation, &s.segment, &s.active] {
        assert_eq!(array.all.current, sizes.len() as i64);
    }
    // Pools as the caching allocator would assign them: 1 and 1000 B small, the others large.
    assert_eq!(s.reserved_bytes.small_pool.current, 1001);
    assert_eq!(s.num_device_alloc, 4);
    let segments = a.segments();
    assert_eq!(segments.len(), 4);
    assert!(segments
        .iter()
        .all(|seg| seg.blocks.len() == 1 && seg.blocks[0].state == BlockState::ActiveAllocated));
    let mut seen: Vec<u64> = segments.iter().map(|seg| seg.total_size).collect();
    seen.sort();
    assert_eq!(seen, sizes);
    for b in blocks {
        a.free(b, &mut tl);
    }
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(s.segment.all.current, 0);
    assert_eq!(s.num_device_free, 4);
    assert!(a.segments().is_empty());
}

#[test]
fn out_of_memory_when_the_device_is_full() {
    let mut device = Device::with_capacity(GIB);
    device.context_bytes = 24 * MIB;
    let mut a = CudaMallocAllocator::new(device);
    let mut tl = Timeline::new();
    let x = a.malloc(1000 * MIB, 0, &mut tl).unwrap();
    // 1024 − 24 − 1000 = 0 MiB left.
    assert!(a.malloc(MIB, 0, &mut tl).is_err());
    a.free(x, &mut tl);
    let z = a.malloc(1000 * MIB, 0, &mut tl).unwrap();
    let err = a.malloc(1, 0, &mut tl).unwrap_err();
    assert_eq!(err.message, CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!((err.requested, err.alloc_size, err.device_free), (1, 1, 0));
    assert_eq!(a.stats().num_ooms, 2);
    a.free(z, &mut tl);
    let err = a.malloc(1 << 60, 0, &mut tl).unwrap_err();
    assert_eq!(err.message, MORE_THAN_1EB_MESSAGE);
    assert_eq!(a.stats().num_ooms, 2, "the 1 EiB guard counts nothing");
}

/// PyTorch's recordStream ignores memory not allocated through the cache; cudaFree synchronizes the device.
#[test]
fn record_stream_is_ignored_and_free_synchronizes() {
    let mut a = CudaMallocAllocator::new(Device::with_capacity(GIB));
    let mut tl = Timeline::new();
    let x = a.malloc(MIB, 0, &mut tl).unwrap();
    a.record_stream(x, 1);
    tl.enqueue(1, 5_000);
    a.free(x, &mut tl);
    assert_eq!(a.stats().active.all.current, 0, "freed at once");
    assert_eq!(tl.now(), 5_000, "cudaFree waited for the device");
    a.empty_cache(&mut tl);
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
}

#[test]
fn history_and_consistency() {
    let mut a = CudaMallocAllocator::new(Device::with_capacity(GIB));
    let mut tl = Timeline::new();
    a.set_record_history(true);
    let x = a.malloc(3000, 2, &mut tl).unwrap();
    check_snapshot(a.stats(), &a.segments()).unwrap();
    a.free(x, &mut tl);
    let actions: Vec<Action> = a.take_history().iter().map(|h| h.action).collect();
    assert_eq!(
        actions,
        [
            Action::SegmentAlloc,
            Action::Alloc,
            Action::FreeRequested,
            Action::FreeCompleted,
            Action::SegmentFree
        ]
    );
    check_snapshot(a.stats(), &a.segments()).unwrap();
}
