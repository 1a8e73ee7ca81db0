//! cuBLAS workspaces as the caching allocator serves them (fact sheet §1.4 / §14.2): sizes from the
//! lowering's PyTorch rules, segments from the allocator's.

use vramsim_models::Workspaces;
use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::allocator::Allocator;
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::find_preset;
use vramsim_sim::timeline::Timeline;

const MIB: u64 = 1 << 20;

#[test]
fn a_workspace_opens_the_segment_pytorch_opens() {
    // An A100's 8,519,680 B (8.125 MiB) request: a multiple of 512, so unrounded; large pool; under
    // kMinLargeAlloc (10 MiB), so a new segment is kLargeBuffer = 20 MiB, split 8.125 + 11.875.
    // An H100's 32 MiB: at least 10 MiB, rounded to 2 MiB: a 32 MiB segment, nothing left over.
    for (gpu, request, segment) in [
        ("a100-80gb", 8_519_680u64, 20 * MIB),
        ("h100-80gb", 33_554_432, 32 * MIB),
    ] {
        let preset = find_preset(gpu).unwrap();
        let (size, _) = Workspaces::default().cublas_workspace_bytes(preset.compute_capability);
        assert_eq!(size, request);
        let mut a = CachingAllocator::new(AllocatorConfig::default(), preset.device());
        let mut tl = Timeline::new();
        let ws = a.malloc(size, 0, &mut tl).unwrap();
        let s = a.stats();
        assert_eq!(s.reserved_bytes.all.current as u64, segment, "{gpu}");
        assert_eq!(s.allocated_bytes.all.current as u64, request, "{gpu}");
        assert_eq!(s.inactive_split_bytes.all.current as u64, segment - request);
        // Per call: freed at the end of the GEMM, the segment stays cached for the next one.
        a.free(ws, &mut tl);
        let again = a.malloc(size, 0, &mut tl).unwrap();
        assert_eq!(a.stats().reserved_bytes.all.current as u64, segment);
        a.free(again, &mut tl);
    }
}
