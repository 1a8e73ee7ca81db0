//! The simulated side of a GPU replay, without a GPU: which device calls each event makes. Expected
//! segment sizes follow PyTorch's rules (fact sheet §1.4 for cudaMalloc segments, §7.2/§7.5 for expandable
//! pages), not vramsim's output.

use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::allocator::cuda_async::{CudaAsyncAllocator, CudaAsyncConfig};
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_traces::{AllocId, Category, Event};
use vramsim_validate::plan::{gcd_of, map_pages, median, DeviceAction, SimDriver};

const MIB: u64 = 1 << 20;

fn alloc(id: u64, size: u64) -> Event {
    Event::Alloc {
        id: AllocId::Int(id),
        size,
        stream: 0,
        category: Category::Other,
        tag: None,
    }
}

fn free(id: u64) -> Event {
    Event::Free {
        id: AllocId::Int(id),
    }
}

fn sizes(actions: &[DeviceAction]) -> Vec<(char, u64)> {
    actions
        .iter()
        .map(|a| match *a {
            DeviceAction::Malloc { size, .. } => ('+', size),
            DeviceAction::Free { size, .. } => ('-', size),
            DeviceAction::Map { size, .. } => ('m', size),
            DeviceAction::Unmap { size, .. } => ('u', size),
        })
        .collect()
}

/// (event, device calls it makes, reserved bytes after it).
type Case = (Event, Vec<(char, u64)>, u64);

fn run(conf: &str, cases: Vec<Case>) {
    let config = AllocatorConfig::parse(conf).unwrap();
    let allocator = CachingAllocator::new(config, Device::with_capacity(8 << 30));
    let mut sim = SimDriver::new(allocator, true);
    for (i, (event, calls, reserved)) in cases.into_iter().enumerate() {
        let step = sim.step(&event).unwrap();
        assert_eq!(step.index, i as u64);
        assert_eq!(sizes(&step.actions), calls, "event {i} {event:?} ({conf})");
        assert_eq!(step.reserved, reserved, "event {i} {event:?} ({conf})");
        assert!(step.oom.is_none());
    }
}

#[test]
fn raw_segments_are_cuda_mallocs_of_pytorch_segment_sizes() {
    run(
        "",
        vec![
            (alloc(1, 1000), vec![('+', 2 * MIB)], 2 * MIB), // small pool: a 2 MiB segment
            (alloc(2, 5 * MIB), vec![('+', 20 * MIB)], 22 * MIB), // 1–10 MiB: a 20 MiB segment
            (alloc(3, 30 * MIB + 1), vec![('+', 32 * MIB)], 54 * MIB), // larger: rounded up to 2 MiB
            (free(3), vec![], 54 * MIB),                               // cached, no device call
            (alloc(4, 0), vec![], 54 * MIB),                           // size 0: no block
            (Event::EmptyCache, vec![('-', 32 * MIB)], 22 * MIB),
            (free(1), vec![], 22 * MIB),
            (free(2), vec![], 22 * MIB),
            (free(4), vec![], 22 * MIB),
            // §5.3: the large pool is released before the small one.
            (Event::EmptyCache, vec![('-', 20 * MIB), ('-', 2 * MIB)], 0),
        ],
    );
}

#[test]
fn vmm_segments_are_page_maps() {
    run(
        "expandable_segments:True",
        vec![
            (alloc(1, 1000), vec![('m', 2 * MIB)], 2 * MIB), // one 2 MiB small page
            (alloc(2, 5 * MIB), vec![('m', 20 * MIB)], 22 * MIB), // one 20 MiB large page
            // 30 MiB + 512 after the 15 MiB free tail: one more page.
            (alloc(3, 30 * MIB + 1), vec![('m', 20 * MIB)], 42 * MIB),
            (free(3), vec![], 42 * MIB),
            // Only the page entirely inside the free block is unmapped.
            (Event::EmptyCache, vec![('u', 20 * MIB)], 22 * MIB),
        ],
    );
}

#[test]
fn ids_are_checked_like_the_engine_does() {
    let allocator =
        CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(1 << 30));
    let mut sim = SimDriver::new(allocator, true);
    sim.step(&alloc(1, 10)).unwrap();
    let err = sim.step(&alloc(1, 10)).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("event 1: alloc of id 1, which is already live"),
        "{err}"
    );
    let err = sim.step(&free(9)).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("event 2: free of id 9, which is not a live allocation"),
        "{err}"
    );
}

#[test]
fn an_out_of_memory_step_carries_pytorchs_error() {
    let allocator =
        CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(64 * MIB));
    let mut sim = SimDriver::new(allocator, true);
    let step = sim.step(&alloc(1, 100 * MIB)).unwrap();
    let oom = step.oom.expect("100 MiB does not fit in 64 MiB");
    assert!(
        oom.message
            .starts_with("CUDA out of memory. Tried to allocate 100.00 MiB."),
        "{}",
        oom.message
    );
}

#[test]
fn the_async_model_is_driven_with_synchronization() {
    let model = CudaAsyncAllocator::new(
        CudaAsyncConfig::driver_default(),
        Device::with_capacity(1 << 30),
    );
    let mut sim = SimDriver::new(model, false).with_sync_hook(|m, tl| m.synchronize(tl));
    sim.step(&alloc(1, 64 * MIB)).unwrap();
    sim.step(&free(1)).unwrap();
    assert_eq!(sim.allocator().reserved(), 64 * MIB);
    let step = sim.step(&Event::Sync { stream: None }).unwrap();
    assert_eq!(
        step.reserved, 0,
        "release threshold 0: trimmed at the synchronization"
    );
    assert_eq!(
        sizes(&step.actions),
        vec![('-', 2 * MIB); 32],
        "pages given back"
    );
}

#[test]
fn map_sizes_tell_small_pages_from_large_ones() {
    let cases = [
        (2 * MIB, Ok((2 * MIB, 1))),
        (20 * MIB, Ok((20 * MIB, 1))),
        (60 * MIB, Ok((20 * MIB, 3))),
        (4 * MIB, Err(())),
        (0, Err(())),
    ];
    for (size, expected) in cases {
        let got = map_pages(size, 2 * MIB, 20 * MIB).map_err(|_| ());
        assert_eq!(got, expected, "{size}");
    }
    assert_eq!(
        map_pages(64 * MIB, 2 * MIB, 64 * MIB).unwrap(),
        (64 * MIB, 1),
        "large_segment_size_mb:64"
    );
}

#[test]
fn small_helpers() {
    assert_eq!(gcd_of([0, 4 * MIB, 22 * MIB, 2 * MIB]), 2 * MIB);
    assert_eq!(gcd_of([0, 0]), 0);
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    assert_eq!(median(&mut []), 0.0);
}
