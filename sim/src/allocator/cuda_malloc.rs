//! No caching (`PYTORCH_NO_CUDA_MEMORY_CACHING=1`, or `torch.cuda.caching_allocator_enable(False)`).
//!
//! PyTorch then bypasses the caching allocator (`uncached_allocate` / `uncached_delete` in
//! `CUDACachingAllocator.cpp`): every allocation is a `cudaMalloc` of exactly the requested size (no
//! rounding, no pools, no splitting) and every free a `cudaFree`. What this model does, and why:
//!
//! - **Out of memory** when the request exceeds the device's free memory (capacity − context − other
//!   processes − live allocations). PyTorch raises a plain `CUDA error: out of memory` from
//!   `C10_CUDA_CHECK` (not the caching allocator's `OutOfMemoryError` text); the message here is that first
//!   line (the debugging hints PyTorch appends after it are left out). The 1 EiB guard of `allocate` still
//!   applies first. No memory fraction: `set_per_process_memory_fraction` only limits the caching allocator.
//! - **`record_stream` is ignored**, as in PyTorch: `recordStream` returns early for memory whose deleter is
//!   not the caching allocator's. The memory is freed at once on `free`; it is safe because `cudaFree`
//!   synchronizes the device, which this model does too (the host clock moves to when every stream is idle).
//! - **Statistics.** PyTorch reports zeros for every `memory_stats()` key in this mode, which would make
//!   reports useless, so this model counts what happens, in the caching allocator's vocabulary:
//!   `allocated_bytes` = `reserved_bytes` = `active_bytes` = `requested_bytes` = Σ live allocation sizes;
//!   `allocation` = `segment` = `active` = number of live allocations; `num_device_alloc` / `num_device_free`
//!   = cudaMalloc / cudaFree calls; `num_ooms` = failed requests. The pool of an allocation is the one its
//!   size would have in the caching allocator (≤ 1 MiB small). Oversize and split stats stay zero.
//! - **History** (which PyTorch does not record in this mode): `segment_alloc` + `alloc` per malloc,
//!   `free_requested` + `free_completed` + `segment_free` per free, `oom` on failure.
//! - Addresses come from the same simulated address space as the caching allocator's segments. The driver's
//!   2 MiB physical granularity is not charged (unconfirmed detail, not in PyTorch's code).
//! - **Starting from a recorded state** (a trace's `segment` events): without a cache there are no
//!   segments to take over, so each live block becomes an allocation of its own, of its *requested* size
//!   (what it would have cost without caching), at the block's address; the cached gaps vanish.

use vramsim_traces::StreamId;

use crate::allocator::caching::address_space::AddressSpace;
use vramsim_traces::InitialSegment;

use crate::allocator::{
    Action, AdoptError, Allocator, BlockInfo, BlockRef, BlockState, HistoryEntry, OutOfMemory,
    SegmentInfo,
};
use crate::device::Device;
use crate::oom::MORE_THAN_1EB_MESSAGE;
use crate::rounding::{PoolKind, MAX_REQUEST};
use crate::stats::MemoryStats;
use crate::timeline::Timeline;

/// The text of a failed `cudaMalloc` as `C10_CUDA_CHECK` raises it (first line).
pub const CUDA_ERROR_OUT_OF_MEMORY: &str = "CUDA error: out of memory";

/// One live allocation.
#[derive(Clone, Copy, Debug)]
struct Allocation {
    addr: u64,
    size: u64,
    stream: StreamId,
}

/// Every allocation is its own device allocation (`PYTORCH_NO_CUDA_MEMORY_CACHING=1`).
///
/// ```
/// use vramsim_sim::allocator::{cuda_malloc::CudaMallocAllocator, Allocator};
/// use vramsim_sim::{device::Device, timeline::Timeline};
///
/// let mut alloc = CudaMallocAllocator::new(Device::with_capacity(1 << 30));
/// let mut timeline = Timeline::new();
/// let block = alloc.malloc(1000, 0, &mut timeline).unwrap();
/// assert_eq!(alloc.stats().reserved_bytes.all.current, 1000); // no rounding
/// alloc.free(block, &mut timeline);
/// assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
/// ```
#[derive(Clone, Debug)]
pub struct CudaMallocAllocator {
    device: Device,
    stats: MemoryStats,
    /// Live allocations by `BlockRef` index; vacant slots are `None`.
    allocations: Vec<Option<Allocation>>,
    vacant: Vec<u32>,
    address_space: AddressSpace,
    /// Σ live allocation sizes.
    total: u64,
    record_history: bool,
    history: Vec<HistoryEntry>,
}

impl CudaMallocAllocator {
    /// An allocator without caching on this device.
    pub fn new(device: Device) -> Self {
        CudaMallocAllocator {
            device,
            stats: MemoryStats::default(),
            allocations: Vec::new(),
            vacant: Vec::new(),
            address_space: AddressSpace::default(),
            total: 0,
            record_history: false,
            history: Vec::new(),
        }
    }

    /// Stores a live allocation and counts it (segment, reservation and allocation alike).
    fn insert(&mut self, allocation: Allocation) -> u32 {
        let size = allocation.size;
        let idx = match self.vacant.pop() {
            Some(idx) => {
                self.allocations[idx as usize] = Some(allocation);
                idx
            }
            None => {
                self.allocations.push(Some(allocation));
                (self.allocations.len() - 1) as u32
            }
        };
        self.total += size;
        let kind = PoolKind::of(size);
        let s = &mut self.stats;
        s.segment.increase(kind, 1);
        s.reserved_bytes.increase(kind, size);
        s.allocation.increase(kind, 1);
        s.allocated_bytes.increase(kind, size);
        s.active.increase(kind, 1);
        s.active_bytes.increase(kind, size);
        s.requested_bytes.increase(kind, size);
        idx
    }

    fn record(&mut self, action: Action, addr: u64, size: u64, stream: StreamId, tl: &Timeline) {
        if self.record_history {
            self.history.push(HistoryEntry {
                action,
                addr,
                size,
                stream,
                time_ns: tl.now(),
            });
        }
    }
}

impl Allocator for CudaMallocAllocator {
    fn malloc(
        &mut self,
        size: u64,
        stream: StreamId,
        tl: &mut Timeline,
    ) -> Result<BlockRef, OutOfMemory> {
        let device_free = self.device.free_memory(self.total);
        // `allocate`'s 1 EiB guard comes before the uncached path.
        if size >= MAX_REQUEST {
            return Err(OutOfMemory {
                message: MORE_THAN_1EB_MESSAGE.to_string(),
                requested: size,
                alloc_size: 0,
                device_free,
            });
        }
        // uncached_allocate: cudaMalloc(size) of exactly the requested size.
        if size > device_free {
            self.stats.num_ooms += 1;
            self.record(Action::Oom, device_free, size, stream, tl);
            return Err(OutOfMemory {
                message: CUDA_ERROR_OUT_OF_MEMORY.to_string(),
                requested: size,
                alloc_size: size,
                device_free,
            });
        }
        let addr = self.address_space.reserve(size);
        let idx = self.insert(Allocation { addr, size, stream });
        self.stats.num_device_alloc += 1;
        self.record(Action::SegmentAlloc, addr, size, stream, tl);
        self.record(Action::Alloc, addr, size, stream, tl);
        Ok(BlockRef(idx))
    }

    /// Each live block becomes an allocation of its requested size at its address (see the module doc).
    fn adopt_segment(&mut self, segment: &InitialSegment) -> Result<Vec<BlockRef>, AdoptError> {
        let needed: u64 = segment.blocks.iter().map(|b| b.requested.max(1)).sum();
        let free = self.device.free_memory(self.total);
        if needed > free {
            return Err(AdoptError::DoesNotFit {
                addr: segment.addr,
                needed,
                free,
            });
        }
        let mut refs = Vec::with_capacity(segment.blocks.len());
        for b in &segment.blocks {
            let addr = segment.addr + b.offset;
            // a zero-byte request still names a block: give it one byte of address space
            let size = b.requested.max(1);
            if let Err((other, end)) = self.address_space.place(addr, size) {
                return Err(AdoptError::Overlap {
                    addr,
                    size,
                    other,
                    other_size: end - other,
                });
            }
            refs.push(BlockRef(self.insert(Allocation {
                addr,
                size,
                stream: segment.stream,
            })));
        }
        Ok(refs)
    }

    fn free(&mut self, block: BlockRef, tl: &mut Timeline) {
        let Allocation { addr, size, stream } = self.allocations[block.0 as usize]
            .take()
            .expect("free of a block that is not allocated");
        self.vacant.push(block.0);
        self.address_space.release(addr);
        self.record(Action::FreeRequested, addr, size, stream, tl);
        self.record(Action::FreeCompleted, addr, size, stream, tl);
        self.record(Action::SegmentFree, addr, size, stream, tl);
        // uncached_delete: cudaFree, which synchronizes the device.
        tl.synchronize();
        self.total -= size;
        let kind = PoolKind::of(size);
        let s = &mut self.stats;
        s.num_device_free += 1;
        s.segment.decrease(kind, 1);
        s.reserved_bytes.decrease(kind, size);
        s.allocation.decrease(kind, 1);
        s.allocated_bytes.decrease(kind, size);
        s.active.decrease(kind, 1);
        s.active_bytes.decrease(kind, size);
        s.requested_bytes.decrease(kind, size);
    }

    /// Ignored: PyTorch's `recordStream` skips memory it did not allocate through the cache.
    fn record_stream(&mut self, _block: BlockRef, _stream: StreamId) {}

    /// Nothing is cached, so nothing to release.
    fn empty_cache(&mut self, _timeline: &mut Timeline) {}

    fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    fn device(&self) -> &Device {
        &self.device
    }

    /// One segment of one block per live allocation, sorted by address.
    fn segments(&self) -> Vec<SegmentInfo> {
        let mut segments: Vec<SegmentInfo> = self
            .allocations
            .iter()
            .flatten()
            .map(|a| SegmentInfo {
                address: a.addr,
                total_size: a.size,
                allocated_size: a.size,
                active_size: a.size,
                requested_size: a.size,
                stream: a.stream,
                pool: PoolKind::of(a.size),
                is_expandable: false,
                blocks: vec![BlockInfo {
                    address: a.addr,
                    size: a.size,
                    requested_size: a.size,
                    state: BlockState::ActiveAllocated,
                }],
            })
            .collect();
        segments.sort_by_key(|s| s.address);
        segments
    }

    fn set_record_history(&mut self, enabled: bool) {
        self.record_history = enabled;
        if !enabled {
            self.history.clear();
        }
    }

    fn take_history(&mut self) -> Vec<HistoryEntry> {
        std::mem::take(&mut self.history)
    }
}
