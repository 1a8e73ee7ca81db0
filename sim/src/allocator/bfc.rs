//! TensorFlow's and JAX/XLA's GPU allocator: the "best-fit with coalescing" (BFC) allocator of
//! `tsl/framework/bfc_allocator.{h,cc}` (TensorFlow `tensorflow/tsl/framework/`, the same code as
//! `xla/tsl/framework/` in openxla/xla, which JAX uses).
//!
//! Memory comes from the device in **regions** (one `cudaMalloc` each, through the sub-allocator);
//! each region is tiled without gaps by **chunks**, doubly linked in address order. A chunk is wholly in
//! use or wholly free; free chunks sit in one of 21 **bins**. There are no streams, no small/large pools
//! and no per-stream caches. The rules, each from the function named:
//!
//! - **Rounding** (`RoundedBytes`): every request is rounded up to a multiple of 256 bytes
//!   (`kMinAllocationSize = 1 << 8`); the chunk keeps the request as `requested_size`.
//! - **Bins** (`BinNumForSize`, `kNumBins = 21`): bin `b` holds free chunks of
//!   `[256·2^b, 256·2^(b+1))` bytes, the last bin everything from 256 MiB up. Inside a bin chunks are
//!   ordered by size, then address (`Bin::ChunkComparator`).
//! - **Best fit** (`FindChunkPtr`): from the bin of the rounded size upwards, the first chunk of at least
//!   the rounded size: the smallest that fits, the lowest address on ties.
//! - **Split** (`FindChunkPtr`, `SplitChunk`): the chosen chunk of size S is split for a rounded request
//!   R iff `S >= 2·R` or `S − R >= max_internal_fragmentation` (128 MiB, or
//!   `fragmentation_fraction × memory_limit` when that option is > 0); the allocation keeps the low
//!   address and the remainder goes back to the bins. Otherwise the whole chunk is handed out.
//! - **Coalescing** (`DeallocateRawInternal`, `TryToCoalesce`): a freed chunk merges with its next
//!   neighbour if free, then with its previous one if free (neighbours are region-local), and the result
//!   goes into its bin.
//! - **Growth** (`Extend`): when no chunk fits, a new region of `curr_region_allocation_bytes` is
//!   requested; that size doubles until it holds the request, and doubles after a success that did not
//!   need it to grow. It starts at 2 MiB with `allow_growth` (TF's `set_memory_growth`,
//!   `TF_FORCE_GPU_ALLOW_GROWTH`; JAX's `XLA_PYTHON_CLIENT_PREALLOCATE=false`), and at the whole memory
//!   limit without it (preallocation, the default of both: one region of the limit at the first
//!   allocation). The request is `min(curr_region_allocation_bytes, memory_limit − reserved)`, the
//!   latter rounded down to 256; a request larger than that fails at once.
//! - **Backpedal** (`Extend`): if the device refuses a region, the allocator retries once in its
//!   lifetime with 0.9×, 0.81×, … of the size (a `float` product, rounded up to 256) until the device
//!   accepts or the size drops below the request.
//! - **Garbage collection** (`DeallocateFreeRegions`, option `garbage_collection`; TF's GPU allocator
//!   turns it on unless `TF_ENABLE_GPU_GARBAGE_COLLECTION=false`, XLA's `CreateBFCAllocator` leaves it
//!   off): when neither a chunk nor a new region serves a request, regions holding no chunk in use are
//!   returned to the device if that plus the unreserved limit could hold the request, and `Extend` is
//!   tried again. It is the only path on which BFC gives memory back.
//! - **Out of memory**: after all of the above, the allocation fails.
//!
//! What this model leaves out, and why: the sub-allocator's region coalescing (`coalesce_regions_`,
//! only for the virtual-memory sub-allocator, which TensorFlow's `GPUProcessState::CreateSubAllocator`
//! keeps disabled (`#if 0`, "observed OOM issues"): regions come from `cudaMalloc` through
//! `DeviceMemAllocator`, separate regions whose chunks never merge across them); the
//! timestamped chunks of stream-ordered reuse (`timing_counter_`, unset for TF's and JAX's GPU
//! allocators); the 10-second retry for other threads (a replay has one thread); the driver's 2 MiB
//! physical granularity (regions count their exact bytes, as for the other models).
//!
//! Statistics (`AllocatorStats`): `bytes_in_use` (Σ sizes of chunks in use: rounding and unsplit waste
//! included), `peak_bytes_in_use`, `num_allocs`, `largest_alloc_size`, `bytes_limit`, and the bytes
//! held in regions (`pool_bytes`). `tf.config.experimental.get_memory_info('GPU:0')` returns
//! `{'current': bytes_in_use, 'peak': peak_bytes_in_use}`. In PyTorch's vocabulary (what reports
//! show): `allocated_bytes` = `active_bytes` = `bytes_in_use`, `requested_bytes` = Σ requested sizes,
//! `reserved_bytes` = region bytes, `segment` = regions; everything is counted in the large pool (BFC has
//! one pool). `record_stream` is ignored (TF and XLA order their work on one compute stream) and
//! `empty_cache` does nothing: neither framework has a call that returns BFC memory.

use std::collections::{BTreeMap, BTreeSet};

use vramsim_traces::StreamId;

use crate::allocator::caching::address_space::AddressSpace;
use crate::allocator::{
    Action, Allocator, BlockInfo, BlockRef, BlockState, HistoryEntry, OutOfMemory, SegmentInfo,
};
use crate::device::Device;
use crate::rounding::PoolKind;
use crate::stats::MemoryStats;
use crate::timeline::Timeline;

/// `kMinAllocationSize`: the rounding unit and smallest chunk.
pub const MIN_ALLOCATION_SIZE: u64 = 1 << 8;
/// `kNumBins`.
pub const NUM_BINS: usize = 21;
/// The first region with `allow_growth` (`BFCAllocator::BFCAllocator`: 2 MiB).
pub const INITIAL_GROWTH_REGION: u64 = 2 << 20;
/// The default `max_internal_fragmentation_bytes` of `FindChunkPtr`: 128 MiB.
pub const DEFAULT_MAX_INTERNAL_FRAGMENTATION: u64 = 128 << 20;
/// `kBackpedalFactor` of `Extend` (a C++ `float`).
pub const BACKPEDAL_FACTOR: f32 = 0.9;

/// `RoundedBytes`: `bytes` rounded up to a multiple of 256.
pub fn rounded_bytes(bytes: u64) -> u64 {
    bytes.div_ceil(MIN_ALLOCATION_SIZE) * MIN_ALLOCATION_SIZE
}

/// `BinNumForSize`: `min(20, floor(log2(max(bytes, 256) >> 8)))`.
pub fn bin_num_for_size(bytes: u64) -> usize {
    let v = bytes.max(MIN_ALLOCATION_SIZE) >> 8;
    (63 - v.leading_zeros() as usize).min(NUM_BINS - 1)
}

/// Which framework's allocator: its defaults, names and out-of-memory message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BfcFlavor {
    /// TensorFlow's `GPUBFCAllocator` (`GPU_<n>_bfc`).
    TensorFlow,
    /// JAX's PjRt GPU client (`xla/pjrt/gpu/gpu_helpers.cc`, `CreateBFCAllocator`).
    Jax,
}

/// The options of a BFC allocator (`BFCAllocator::Options` plus the memory limit).
#[derive(Clone, Debug, PartialEq)]
pub struct BfcConfig {
    /// `memory_limit_`: the most bytes the regions may hold.
    pub memory_limit: u64,
    /// `allow_growth`: regions from 2 MiB, doubling; otherwise one region of the whole limit.
    pub allow_growth: bool,
    /// `garbage_collection`: return wholly free regions to the device on the OOM path.
    pub garbage_collection: bool,
    /// `fragmentation_fraction`: when > 0, the split rule's waste limit is this × the memory limit.
    pub fragmentation_fraction: f64,
    /// Whose allocator (names and messages).
    pub flavor: BfcFlavor,
}

impl BfcConfig {
    /// The waste a chunk may carry before it is split regardless of size (`FindChunkPtr`).
    pub fn max_internal_fragmentation(&self) -> u64 {
        if self.fragmentation_fraction > 0.0 {
            (self.fragmentation_fraction * self.memory_limit as f64) as u64
        } else {
            DEFAULT_MAX_INTERNAL_FRAGMENTATION
        }
    }
}

/// `AllocatorStats` as the BFC allocator keeps them (`GetStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BfcStats {
    /// `num_allocs`: successful allocations.
    pub num_allocs: u64,
    /// `bytes_in_use`: Σ sizes of chunks in use.
    pub bytes_in_use: u64,
    /// `peak_bytes_in_use`.
    pub peak_bytes_in_use: u64,
    /// `largest_alloc_size`: the largest chunk handed out.
    pub largest_alloc_size: u64,
    /// `bytes_limit`: the memory limit.
    pub bytes_limit: u64,
    /// `pool_bytes`: bytes held in regions (`total_region_allocated_bytes_`).
    pub pool_bytes: u64,
    /// Peak of `pool_bytes`.
    pub peak_pool_bytes: u64,
}

#[derive(Clone, Debug)]
struct Chunk {
    addr: u64,
    size: u64,
    requested: u64,
    in_use: bool,
    prev: Option<u32>,
    next: Option<u32>,
    /// Start address of the chunk's region.
    region: u64,
}

#[derive(Clone, Debug)]
struct Region {
    size: u64,
    first: u32,
}

/// The BFC allocator of TensorFlow and JAX (see the module documentation for its rules).
///
/// ```
/// use vramsim_sim::allocator::bfc::{BfcAllocator, BfcConfig, BfcFlavor};
/// use vramsim_sim::allocator::Allocator;
/// use vramsim_sim::{device::Device, timeline::Timeline};
///
/// let config = BfcConfig { memory_limit: 1 << 30, allow_growth: true, garbage_collection: true,
///                          fragmentation_fraction: 0.0, flavor: BfcFlavor::TensorFlow };
/// let mut bfc = BfcAllocator::new(config, Device::with_capacity(2 << 30));
/// let mut timeline = Timeline::new();
/// let block = bfc.malloc(4, 0, &mut timeline).unwrap();
/// assert_eq!(bfc.bfc_stats().bytes_in_use, 256); // rounded to 256 bytes
/// assert_eq!(bfc.bfc_stats().pool_bytes, 2 << 20); // the first 2 MiB region
/// bfc.free(block, &mut timeline);
/// ```
#[derive(Clone, Debug)]
pub struct BfcAllocator {
    config: BfcConfig,
    device: Device,
    stats: MemoryStats,
    bfc: BfcStats,
    chunks: Vec<Chunk>,
    vacant: Vec<u32>,
    /// Free chunks per bin, by (size, address, handle).
    bins: Vec<BTreeSet<(u64, u64, u32)>>,
    regions: BTreeMap<u64, Region>,
    address_space: AddressSpace,
    curr_region_allocation_bytes: u64,
    started_backpedal: bool,
    record_history: bool,
    history: Vec<HistoryEntry>,
}

impl BfcAllocator {
    /// A BFC allocator with these options on this device (`BFCAllocator::BFCAllocator`).
    pub fn new(config: BfcConfig, device: Device) -> Self {
        let curr = if config.allow_growth {
            rounded_bytes(config.memory_limit.min(INITIAL_GROWTH_REGION))
        } else {
            rounded_bytes(config.memory_limit)
        };
        BfcAllocator {
            bfc: BfcStats {
                bytes_limit: config.memory_limit,
                ..BfcStats::default()
            },
            config,
            device,
            stats: MemoryStats::default(),
            chunks: Vec::new(),
            vacant: Vec::new(),
            bins: vec![BTreeSet::new(); NUM_BINS],
            regions: BTreeMap::new(),
            address_space: AddressSpace::default(),
            curr_region_allocation_bytes: curr,
            started_backpedal: false,
            record_history: false,
            history: Vec::new(),
        }
    }

    /// The options in force.
    pub fn config(&self) -> &BfcConfig {
        &self.config
    }

    /// `GetStats()`.
    pub fn bfc_stats(&self) -> BfcStats {
        self.bfc
    }

    /// `tf.config.experimental.get_memory_info`: (`current`, `peak`) = bytes in use and their peak.
    pub fn memory_info(&self) -> (u64, u64) {
        (self.bfc.bytes_in_use, self.bfc.peak_bytes_in_use)
    }

    /// The size the next region would be requested at (`curr_region_allocation_bytes_`).
    pub fn next_region_bytes(&self) -> u64 {
        self.curr_region_allocation_bytes
    }

    /// The regions, as (address, size), in address order.
    pub fn regions(&self) -> Vec<(u64, u64)> {
        self.regions.iter().map(|(&a, r)| (a, r.size)).collect()
    }

    /// The address of a block handed out (`chunk->ptr`).
    pub fn chunk_address(&self, block: BlockRef) -> u64 {
        self.chunks[block.0 as usize].addr
    }

    /// `AllocatedSize`: the size of the chunk a block holds (rounded, and unsplit waste included).
    pub fn allocated_size(&self, block: BlockRef) -> u64 {
        self.chunks[block.0 as usize].size
    }

    /// `RequestedSize`: the bytes asked for.
    pub fn requested_size(&self, block: BlockRef) -> u64 {
        self.chunks[block.0 as usize].requested
    }

    /// The allocator's name in messages (`GPU_<n>_bfc`).
    pub fn name(&self) -> String {
        format!("GPU_{}_bfc", self.device.index)
    }

    /// The out-of-memory text each framework raises for a failed request of `requested` bytes.
    ///
    /// TensorFlow: `OpKernelContext::allocate_tensor`'s `ResourceExhausted` ("OOM when allocating tensor
    /// with shape... and type ... on ... by allocator ..."); a trace carries bytes, not shapes, so the
    /// tensor is named as the uint8 vector of its bytes. JAX: XLA's `RESOURCE_EXHAUSTED: Out of memory
    /// while trying to allocate N bytes.` as users report it (the text of `XlaRuntimeError`).
    pub fn oom_message(&self, requested: u64) -> String {
        match self.config.flavor {
            BfcFlavor::TensorFlow => format!(
                "ResourceExhaustedError: OOM when allocating tensor with shape[{requested}] and type uint8 on /job:localhost/replica:0/task:0/device:GPU:{} by allocator {}",
                self.device.index,
                self.name()
            ),
            BfcFlavor::Jax => format!(
                "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate {requested} bytes."
            ),
        }
    }

    fn record(&mut self, action: Action, addr: u64, size: u64, tl: &Timeline) {
        if self.record_history {
            self.history.push(HistoryEntry {
                action,
                addr,
                size,
                stream: 0,
                time_ns: tl.now(),
            });
        }
    }

    fn new_chunk(&mut self, chunk: Chunk) -> u32 {
        match self.vacant.pop() {
            Some(h) => {
                self.chunks[h as usize] = chunk;
                h
            }
            None => {
                self.chunks.push(chunk);
                (self.chunks.len() - 1) as u32
            }
        }
    }

    fn insert_free(&mut self, h: u32) {
        let c = &self.chunks[h as usize];
        self.bins[bin_num_for_size(c.size)].insert((c.size, c.addr, h));
    }

    fn remove_free(&mut self, h: u32) {
        let c = &self.chunks[h as usize];
        let removed = self.bins[bin_num_for_size(c.size)].remove(&(c.size, c.addr, h));
        debug_assert!(removed, "free chunk not in its bin");
    }

    /// The sub-allocator (`cudaMalloc`): succeeds while the device has the bytes free.
    fn device_alloc(&self, bytes: u64) -> bool {
        bytes <= self.device.free_memory(self.bfc.pool_bytes)
    }

    /// `Extend`: a new region able to hold `rounded` bytes, if the limit and the device allow.
    fn extend(&mut self, rounded: u64, tl: &Timeline) -> bool {
        let available = (self.config.memory_limit.saturating_sub(self.bfc.pool_bytes)
            / MIN_ALLOCATION_SIZE)
            * MIN_ALLOCATION_SIZE;
        if rounded > available {
            return false;
        }
        let mut increased = false;
        while rounded > self.curr_region_allocation_bytes {
            self.curr_region_allocation_bytes *= 2;
            increased = true;
        }
        let mut bytes = self.curr_region_allocation_bytes.min(available);
        let mut ok = self.device_alloc(bytes);
        if !ok && !self.started_backpedal {
            // Only backpedal once: 0.9× per try, a float product rounded up to 256.
            self.started_backpedal = true;
            while !ok {
                bytes = rounded_bytes((bytes as f32 * BACKPEDAL_FACTOR) as u64);
                if bytes < rounded {
                    break;
                }
                ok = self.device_alloc(bytes);
            }
        }
        if !ok {
            return false;
        }
        if !increased {
            self.curr_region_allocation_bytes *= 2;
        }
        let addr = self.address_space.reserve(bytes);
        let h = self.new_chunk(Chunk {
            addr,
            size: bytes,
            requested: 0,
            in_use: false,
            prev: None,
            next: None,
            region: addr,
        });
        self.regions.insert(
            addr,
            Region {
                size: bytes,
                first: h,
            },
        );
        self.insert_free(h);
        self.bfc.pool_bytes += bytes;
        self.bfc.peak_pool_bytes = self.bfc.peak_pool_bytes.max(self.bfc.pool_bytes);
        self.stats.reserved_bytes.increase(PoolKind::Large, bytes);
        self.stats.segment.increase(PoolKind::Large, 1);
        self.stats.num_device_alloc += 1;
        self.record(Action::SegmentAlloc, addr, bytes, tl);
        true
    }

    /// `FindChunkPtr`: best fit from the request's bin upwards, split by the split rule.
    fn find_chunk(&mut self, rounded: u64, requested: u64) -> Option<u32> {
        let found = (bin_num_for_size(rounded)..NUM_BINS).find_map(|b| {
            self.bins[b]
                .range((rounded, 0, 0)..)
                .next()
                .map(|&(_, _, h)| h)
        })?;
        self.remove_free(found);
        let size = self.chunks[found as usize].size;
        if size >= rounded * 2 || size - rounded >= self.config.max_internal_fragmentation() {
            self.split(found, rounded);
        }
        let c = &mut self.chunks[found as usize];
        c.requested = requested;
        c.in_use = true;
        let size = c.size;
        self.bfc.num_allocs += 1;
        self.bfc.bytes_in_use += size;
        self.bfc.peak_bytes_in_use = self.bfc.peak_bytes_in_use.max(self.bfc.bytes_in_use);
        self.bfc.largest_alloc_size = self.bfc.largest_alloc_size.max(size);
        let s = &mut self.stats;
        s.allocation.increase(PoolKind::Large, 1);
        s.active.increase(PoolKind::Large, 1);
        s.allocated_bytes.increase(PoolKind::Large, size);
        s.active_bytes.increase(PoolKind::Large, size);
        s.requested_bytes.increase(PoolKind::Large, requested);
        Some(found)
    }

    /// `SplitChunk`: the first `bytes` stay with `h`, the rest becomes a free chunk after it.
    fn split(&mut self, h: u32, bytes: u64) {
        let (addr, size, next, region) = {
            let c = &self.chunks[h as usize];
            (c.addr, c.size, c.next, c.region)
        };
        let new = self.new_chunk(Chunk {
            addr: addr + bytes,
            size: size - bytes,
            requested: 0,
            in_use: false,
            prev: Some(h),
            next,
            region,
        });
        self.chunks[h as usize].size = bytes;
        self.chunks[h as usize].next = Some(new);
        if let Some(n) = next {
            self.chunks[n as usize].prev = Some(new);
        }
        self.insert_free(new);
    }

    /// `Merge`: `h2` (the chunk after `h1`) joins `h1` and is deleted.
    fn merge(&mut self, h1: u32, h2: u32) {
        let (size2, next2) = {
            let c2 = &self.chunks[h2 as usize];
            (c2.size, c2.next)
        };
        self.chunks[h1 as usize].size += size2;
        self.chunks[h1 as usize].next = next2;
        if let Some(n) = next2 {
            self.chunks[n as usize].prev = Some(h1);
        }
        self.vacant.push(h2);
    }

    /// `TryToCoalesce`: with the next chunk if free, then with the previous one if free.
    fn coalesce(&mut self, h: u32) -> u32 {
        let mut result = h;
        if let Some(n) = self.chunks[h as usize].next {
            if !self.chunks[n as usize].in_use {
                self.remove_free(n);
                self.merge(h, n);
            }
        }
        if let Some(p) = self.chunks[h as usize].prev {
            if !self.chunks[p as usize].in_use {
                self.remove_free(p);
                self.merge(p, h);
                result = p;
            }
        }
        result
    }

    /// `DeallocateFreeRegions`: with garbage collection on, returns the regions holding no chunk in use
    /// if that (with the unreserved limit) could serve `rounded` bytes.
    fn deallocate_free_regions(&mut self, rounded: u64, tl: &Timeline) -> bool {
        if !self.config.garbage_collection {
            return false;
        }
        let mut free_regions = Vec::new();
        let mut total_free = 0;
        for (&addr, region) in &self.regions {
            let mut h = Some(region.first);
            let mut any_use = false;
            while let Some(c) = h {
                if self.chunks[c as usize].in_use {
                    any_use = true;
                    break;
                }
                h = self.chunks[c as usize].next;
            }
            if !any_use {
                free_regions.push(addr);
                total_free += region.size;
            }
        }
        if total_free == 0 {
            return false;
        }
        let available = self.config.memory_limit - self.bfc.pool_bytes + total_free;
        if rounded > available {
            return false;
        }
        for addr in free_regions {
            let region = self.regions.remove(&addr).expect("listed above");
            let mut h = Some(region.first);
            while let Some(c) = h {
                self.remove_free(c);
                h = self.chunks[c as usize].next;
                self.vacant.push(c);
            }
            self.address_space.release(addr);
            self.bfc.pool_bytes -= region.size;
            self.stats
                .reserved_bytes
                .decrease(PoolKind::Large, region.size);
            self.stats.segment.decrease(PoolKind::Large, 1);
            self.stats.num_device_free += 1;
            self.record(Action::SegmentFree, addr, region.size, tl);
        }
        true
    }
}

impl Allocator for BfcAllocator {
    /// `AllocateRawInternal`: bins, then `Extend`, then garbage collection and `Extend` again.
    fn malloc(
        &mut self,
        size: u64,
        _stream: StreamId,
        tl: &mut Timeline,
    ) -> Result<BlockRef, OutOfMemory> {
        let rounded = rounded_bytes(size);
        let found = match self.find_chunk(rounded, size) {
            Some(h) => Some(h),
            None if self.extend(rounded, tl) => self.find_chunk(rounded, size),
            None => None,
        };
        let found = match found {
            Some(h) => Some(h),
            None if self.deallocate_free_regions(rounded, tl) && self.extend(rounded, tl) => {
                self.find_chunk(rounded, size)
            }
            None => None,
        };
        match found {
            Some(h) => {
                let addr = self.chunks[h as usize].addr;
                self.record(Action::Alloc, addr, size, tl);
                Ok(BlockRef(h))
            }
            None => {
                let device_free = self.device.free_memory(self.bfc.pool_bytes);
                self.stats.num_ooms += 1;
                self.record(Action::Oom, device_free, size, tl);
                Err(OutOfMemory {
                    message: self.oom_message(size),
                    requested: size,
                    alloc_size: rounded,
                    device_free,
                })
            }
        }
    }

    /// `DeallocateRawInternal`: `MarkFree`, then `TryToCoalesce` and back into a bin.
    fn free(&mut self, block: BlockRef, tl: &mut Timeline) {
        let h = block.0;
        let (addr, size, requested) = {
            let c = &mut self.chunks[h as usize];
            assert!(c.in_use, "free of a chunk that is not in use");
            c.in_use = false;
            (c.addr, c.size, c.requested)
        };
        self.bfc.bytes_in_use -= size;
        let s = &mut self.stats;
        s.allocation.decrease(PoolKind::Large, 1);
        s.active.decrease(PoolKind::Large, 1);
        s.allocated_bytes.decrease(PoolKind::Large, size);
        s.active_bytes.decrease(PoolKind::Large, size);
        s.requested_bytes.decrease(PoolKind::Large, requested);
        self.record(Action::FreeRequested, addr, requested, tl);
        self.record(Action::FreeCompleted, addr, requested, tl);
        let merged = self.coalesce(h);
        self.insert_free(merged);
    }

    /// Refused: a PyTorch snapshot's segments have no BFC regions and chunks to start from.
    fn adopt_segment(
        &mut self,
        _segment: &vramsim_traces::InitialSegment,
    ) -> Result<Vec<BlockRef>, crate::allocator::AdoptError> {
        Err(crate::allocator::AdoptError::Unsupported {
            model: "BFC (tf-bfc, jax)",
        })
    }

    /// Ignored: TF and XLA run a device's work on one compute stream.
    fn record_stream(&mut self, _block: BlockRef, _stream: StreamId) {}

    /// Nothing: BFC memory goes back to the device only by garbage collection on the OOM path.
    fn empty_cache(&mut self, _timeline: &mut Timeline) {}

    fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    fn reset_peak_stats(&mut self) {
        // `ClearStats`: the peak restarts from the bytes in use.
        self.stats.reset_peak();
        self.bfc.peak_bytes_in_use = self.bfc.bytes_in_use;
        self.bfc.largest_alloc_size = 0;
        self.bfc.num_allocs = 0;
    }

    fn device(&self) -> &Device {
        &self.device
    }

    /// One segment per region, its chunks as blocks.
    fn segments(&self) -> Vec<SegmentInfo> {
        self.regions
            .iter()
            .map(|(&addr, region)| {
                let mut blocks = Vec::new();
                let mut h = Some(region.first);
                while let Some(c) = h {
                    let chunk = &self.chunks[c as usize];
                    blocks.push(BlockInfo {
                        address: chunk.addr,
                        size: chunk.size,
                        requested_size: if chunk.in_use { chunk.requested } else { 0 },
                        state: if chunk.in_use {
                            BlockState::ActiveAllocated
                        } else {
                            BlockState::Inactive
                        },
                    });
                    h = chunk.next;
                }
                let allocated: u64 = blocks
                    .iter()
                    .filter(|b| b.state == BlockState::ActiveAllocated)
                    .map(|b| b.size)
                    .sum();
                SegmentInfo {
                    address: addr,
                    total_size: region.size,
                    allocated_size: allocated,
                    active_size: allocated,
                    requested_size: blocks.iter().map(|b| b.requested_size).sum(),
                    stream: 0,
                    pool: PoolKind::Large,
                    is_expandable: false,
                    blocks,
                }
            })
            .collect()
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

/// TensorFlow's default memory limit reserve (`MinSystemMemory` in
/// `tensorflow/core/common_runtime/gpu/gpu_device.cc`, optimized builds): 225 MiB when less than 2 GiB is
/// available, else by the compute capability's major version: ≤ 6: 500 MiB, 7: 1050 MiB, 8: 1536 MiB,
/// ≥ 9: 1800 MiB. Without `per_process_gpu_memory_fraction` or a logical device's `memory_limit`, the
/// limit is the free memory less this reserve (`SingleVirtualDeviceMemoryLimit`).
pub fn tf_min_system_memory(available: u64, cc_major: u32) -> u64 {
    const MIB: u64 = 1 << 20;
    if available < 1 << 31 {
        225 * MIB
    } else {
        match cc_major {
            0..=6 => 500 * MIB,
            7 => 1050 * MIB,
            8 => 1536 * MIB,
            _ => 1800 * MIB,
        }
    }
}

/// TensorFlow's default memory limit for a device with `available` free bytes (`SingleVirtualDeviceMemoryLimit`
/// without a fraction): the free memory less [`tf_min_system_memory`], unless the reserve is not smaller.
pub fn tf_default_memory_limit(available: u64, cc_major: u32) -> u64 {
    let reserve = tf_min_system_memory(available, cc_major);
    if reserve < available {
        available - reserve
    } else {
        available
    }
}
