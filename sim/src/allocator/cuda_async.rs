//! CUDA's stream-ordered memory pool: PyTorch's `backend:cudaMallocAsync`.
//!
//! With `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync` PyTorch does no caching of its own: every tensor is
//! a `cudaMallocAsync` on the current stream and every free a `cudaFreeAsync`, and the CUDA driver's memory
//! pool does the caching (`c10/cuda/CUDAMallocAsyncAllocator.cpp`, read at pytorch/pytorch commit
//! 03459473c0ec8fea0afc2b32d0d5f45346c2a072). This module models that pool. The driver's pool is closed
//! source, so the model keeps two kinds of rules apart, and says which is which.
//!
//! # What PyTorch does (confirmed, from `CUDAMallocAsyncAllocator.cpp`)
//!
//! - **Pool settings** (`lazy_init_device`): the device's default pool, with the release threshold set to
//!   `UINT64_MAX` ("See 'Retaining memory in the pool'") and the three reuse policies
//!   (`ReuseFollowEventDependencies`, `ReuseAllowOpportunistic`, `ReuseAllowInternalDependencies`) enabled.
//!   So under PyTorch the pool **never shrinks at a synchronization**: only `empty_cache()` returns memory.
//! - **`malloc`**: the 1 EiB guard (`"CUDA out of memory. Tried to allocate more than 1EB memory."`), then,
//!   if a memory fraction is set, `pytorch_used_bytes + size > fraction × total` fails at once; otherwise
//!   `cudaMallocAsync(size, stream)`. A failure raises `OutOfMemoryError` with the text of
//!   [`cuda_async_oom_message`] (no retry, no cache flush).
//! - **`free`**: `cudaFreeAsync` on the allocation's stream; if `record_stream` named other streams, PyTorch
//!   makes a private "unifying" stream wait (CUDA events) for the allocation stream and every recorded
//!   stream, and frees on that stream — so such memory is reusable only "opportunistically", once the driver
//!   sees that all those streams have passed the free (PyTorch's own comment says so).
//! - **`empty_cache`**: `cudaDeviceSynchronize()` then `cudaMemPoolTrimTo(pool, 0)`.
//! - **Statistics** (`getDeviceStats`): only three keys are filled, from pool attributes:
//!   `allocated_bytes.all` and `active_bytes.all` = `UsedMemCurrent`/`UsedMemHigh`, `reserved_bytes.all` =
//!   `ReservedMemCurrent`/`ReservedMemHigh`. Every other `memory_stats()` key stays 0, and this model
//!   leaves them 0 too. `reset_peak_memory_stats` resets both highs to the current values.
//! - `snapshot()` and `_record_memory_history` raise for this backend. The model still lists its pages
//!   ([`Allocator::segments`]) and records history, as vramsim's own view.
//!
//! # What the CUDA documentation says (confirmed, from the CUDA Programming Guide §4.3 "Stream-Ordered
//! Memory Allocator" and the `cuMemPoolSetAttribute` reference)
//!
//! - Memory freed on a stream is reusable **at once by later allocations on the same stream** (stream
//!   order makes it safe).
//! - `ReuseAllowOpportunistic`: another stream may reuse it once the free has **completed** on the GPU
//!   ("the stream has passed the point of execution indicated by the free operation"). When a stream is
//!   synchronized with the host, its completed frees are available to every stream.
//! - `ReuseAllowInternalDependencies`: only when the driver **fails to map more physical memory**, it may
//!   reuse memory whose free is still pending on another stream, inserting a wait into the allocating stream.
//! - Release threshold (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`, default 0 for a plain pool): "When more than
//!   the release threshold bytes of memory are held by the memory pool, the allocator will try to release
//!   memory back to the OS on the next call to stream, event or context synchronize." `cuMemPoolTrimTo(keep)`
//!   releases unused memory down to `keep` bytes.
//! - `UsedMemCurrent` is "the total size of all of the memory allocated from the pool and not available for
//!   reuse"; `ReservedMemCurrent` "the current total physical GPU memory consumed by the pool".
//!
//! # What this model assumes (UNCONFIRMED: the driver's internals are not documented)
//!
//! - **Physical pages.** The pool holds physical memory in pages of [`CudaAsyncConfig::page_size`]
//!   (default 2 MiB, the minimum `cuMemCreate` granularity that `cuMemGetAllocationGranularity` reports on
//!   current GPUs, and the pool is documented as built from "virtual address and physical memory
//!   resources"). `ReservedMemCurrent` = pages × page size. One public figure is consistent with it: the
//!   80,576 MiB reserved in rapidsai/rmm#1245 is a whole number of 2 MiB (indeed 64 MiB) units; the driver
//!   may well grow in bigger chunks. `vramsim-validate calibrate` measures the growth unit.
//! - **Used bytes** are the exact requested sizes: in rapidsai/rmm#1245 `UsedMemCurrent` (53,514,136,688)
//!   equals the bytes the application requested, and is not a multiple of 512.
//! - **Placement.** An allocation of at least one page takes `ceil(size / page)` whole pages, from any free
//!   pages of the pool (the NVIDIA blog "Using the CUDA Stream-Ordered Memory Allocator, Part 1" says the
//!   driver defragments by remapping unused pool memory into a contiguous virtual range), so whole free
//!   pages never fragment; the tail of its last page is unusable while it lives. A smaller allocation is
//!   placed best fit (smallest fitting free range, then lowest address) inside pages shared by small
//!   allocations, at [`CudaAsyncConfig::alignment`] (default 256 B, `cudaMalloc`'s documented alignment),
//!   or opens a fresh page. A shared page whose last allocation is freed becomes a free page again.
//! - **Which free memory.** Same-stream memory first, then memory whose free has completed (opportunistic),
//!   then new pages; when the device cannot supply them all, (internal dependencies) pending memory of other
//!   streams, earliest first, the allocating stream then waiting for it, and new pages only for the rest.
//!   Pages are taken lowest address first.
//! - **Trimming** releases whole free pages whose frees have completed, highest address first, until the
//!   pool holds no more than the target. Pages holding any live allocation stay.
//! - A free lowers `UsedMemCurrent` when `cudaFreeAsync` is called, not when it executes.
//! - Streams and kernels come from the replay's [`Timeline`]: a free on stream *s* completes when the work
//!   queued on *s* at that moment is done.
//!
//! `vramsim-validate replay TRACE --backend async` compares this model with the real pool's
//! `RESERVED_MEM_HIGH`/`USED_MEM_HIGH`, event by event, and is how these assumptions get checked.

use std::collections::BTreeSet;

use vramsim_traces::StreamId;

use crate::allocator::caching::address_space::AddressSpace;
use crate::allocator::{
    Action, Allocator, BlockInfo, BlockRef, BlockState, HistoryEntry, OutOfMemory, SegmentInfo,
};
use crate::device::Device;
use crate::format::format_size;
use crate::oom::MORE_THAN_1EB_MESSAGE;
use crate::rounding::{PoolKind, MAX_REQUEST};
use crate::stats::MemoryStats;
use crate::timeline::Timeline;

/// The default physical page of the pool: 2 MiB (unconfirmed, see the module documentation).
pub const DEFAULT_PAGE_SIZE: u64 = 2 << 20;
/// The default alignment of sub-page allocations: 256 B (unconfirmed).
pub const DEFAULT_ALIGNMENT: u64 = 256;

/// The settings of the pool model.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaAsyncConfig {
    /// Physical page of the pool: the unit reserved memory grows and shrinks by.
    pub page_size: u64,
    /// Alignment of allocations placed inside a shared page (a power of two).
    pub alignment: u64,
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`: bytes the pool keeps at a synchronization. PyTorch: `u64::MAX`.
    pub release_threshold: u64,
    /// `CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC`.
    pub reuse_allow_opportunistic: bool,
    /// `CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES`.
    pub reuse_allow_internal_dependencies: bool,
    /// `torch.cuda.set_per_process_memory_fraction`: limits the bytes PyTorch has allocated.
    pub memory_fraction: Option<f64>,
}

impl CudaAsyncConfig {
    /// The pool as PyTorch configures it: release threshold `UINT64_MAX`, every reuse policy on.
    pub fn pytorch() -> Self {
        CudaAsyncConfig {
            page_size: DEFAULT_PAGE_SIZE,
            alignment: DEFAULT_ALIGNMENT,
            release_threshold: u64::MAX,
            reuse_allow_opportunistic: true,
            reuse_allow_internal_dependencies: true,
            memory_fraction: None,
        }
    }

    /// A pool with the driver's defaults (release threshold 0: trimmed at every synchronization).
    pub fn driver_default() -> Self {
        CudaAsyncConfig {
            release_threshold: 0,
            ..Self::pytorch()
        }
    }
}

impl Default for CudaAsyncConfig {
    fn default() -> Self {
        Self::pytorch()
    }
}

/// The text of PyTorch's `OutOfMemoryError` for this backend (`mallocAsync`).
///
/// `limit` is `pytorch_memory_limits[device]`: `u64::MAX` unless a memory fraction is set.
pub fn cuda_async_oom_message(
    device: u32,
    allocated: u64,
    requested: u64,
    total: u64,
    free: u64,
    limit: u64,
) -> String {
    format!(
        "Allocation on device {device} would exceed allowed memory. (out of memory)\n\
         Currently allocated     : {}\n\
         Requested               : {}\n\
         Device limit            : {}\n\
         Free (according to CUDA): {}\n\
         PyTorch limit (set by user-supplied memory fraction)\n                        : {}",
        format_size(allocated),
        format_size(requested),
        format_size(total),
        format_size(free),
        format_size(limit)
    )
}

/// Who may reuse freed memory without waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    /// Freed on this stream: reusable at once by it.
    Stream(StreamId),
    /// Freed on PyTorch's unifying stream, or merged from frees of several streams: reusable only once
    /// complete.
    Unifying,
}

/// Freed memory: by whom, and when its free completes on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Freed {
    owner: Owner,
    ready_at: u64,
}

impl Freed {
    /// A brand-new page: nothing to wait for.
    const FRESH: Freed = Freed {
        owner: Owner::Unifying,
        ready_at: 0,
    };

    fn merge(self, other: Freed) -> Freed {
        Freed {
            owner: if self.owner == other.owner {
                self.owner
            } else {
                Owner::Unifying
            },
            ready_at: self.ready_at.max(other.ready_at),
        }
    }

    fn complete_by(self, visible_until: u64) -> bool {
        self.ready_at <= visible_until
    }
}

/// A free byte range inside a shared page.
#[derive(Clone, Copy, Debug)]
struct FreeRange {
    offset: u64,
    len: u64,
    freed: Freed,
}

#[derive(Clone, Debug)]
enum PageState {
    /// Given back to the device; the slot is kept so page ids stay stable.
    Released,
    /// Reserved, holding nothing.
    Free(Freed),
    /// One page of a whole-page allocation.
    Whole,
    /// Holds small allocations: `live` of them, and these free ranges (sorted by offset).
    Shared { live: u32, free: Vec<FreeRange> },
}

#[derive(Clone, Debug)]
struct Page {
    addr: u64,
    state: PageState,
}

#[derive(Clone, Debug)]
enum Placement {
    Pages { pages: Vec<u32>, addr: u64 },
    Sub { page: u32, offset: u64, len: u64 },
}

#[derive(Clone, Debug)]
struct Allocation {
    size: u64,
    stream: StreamId,
    recorded: Vec<StreamId>,
    placement: Placement,
}

impl Allocation {
    fn addr(&self, pages: &[Page]) -> u64 {
        match &self.placement {
            Placement::Pages { addr, .. } => *addr,
            Placement::Sub { page, offset, .. } => pages[*page as usize].addr + offset,
        }
    }
}

/// A source of memory found for a request, before it is committed.
enum Found {
    Range { page: u32, index: usize },
    FreePage(u32),
}

/// CUDA's stream-ordered pool behind PyTorch's `backend:cudaMallocAsync` (see the module documentation for
/// the rules and which of them are confirmed).
///
/// ```
/// use vramsim_sim::allocator::cuda_async::{CudaAsyncAllocator, CudaAsyncConfig};
/// use vramsim_sim::allocator::Allocator;
/// use vramsim_sim::{device::Device, timeline::Timeline};
///
/// let mut pool = CudaAsyncAllocator::new(CudaAsyncConfig::pytorch(), Device::with_capacity(1 << 30));
/// let mut timeline = Timeline::new();
/// let a = pool.malloc(3 << 20, 0, &mut timeline).unwrap(); // 3 MiB: two 2 MiB pages
/// assert_eq!(pool.stats().reserved_bytes.all.current, 4 << 20);
/// assert_eq!(pool.stats().allocated_bytes.all.current, 3 << 20);
/// pool.free(a, &mut timeline);
/// assert_eq!(pool.stats().reserved_bytes.all.current, 4 << 20); // kept: threshold UINT64_MAX
/// pool.empty_cache(&mut timeline);
/// assert_eq!(pool.stats().reserved_bytes.all.current, 0);
/// ```
#[derive(Clone, Debug)]
pub struct CudaAsyncAllocator {
    config: CudaAsyncConfig,
    device: Device,
    stats: MemoryStats,
    pages: Vec<Page>,
    /// Pages in [`PageState::Free`], as (address, id): address order.
    free_pages: BTreeSet<(u64, u32)>,
    /// Pages in [`PageState::Shared`], as (address, id).
    shared_pages: BTreeSet<(u64, u32)>,
    /// Released page slots, reused lowest first.
    released: BTreeSet<u32>,
    allocations: Vec<Option<Allocation>>,
    vacant: Vec<u32>,
    address_space: AddressSpace,
    /// Pages held (reserved bytes / page size).
    held_pages: u64,
    /// Σ requested sizes of live allocations (`pytorch_used_bytes`, `UsedMemCurrent`).
    used: u64,
    /// Host time of the last synchronization the pool saw (for reuse with opportunism off).
    last_sync_ns: u64,
    record_history: bool,
    history: Vec<HistoryEntry>,
}

impl CudaAsyncAllocator {
    /// An empty pool on this device.
    ///
    /// # Panics
    /// If `page_size` is 0 or `alignment` is not a power of two.
    pub fn new(config: CudaAsyncConfig, device: Device) -> Self {
        assert!(config.page_size > 0, "page_size must be positive");
        assert!(
            config.alignment.is_power_of_two(),
            "alignment must be a power of two"
        );
        // getDeviceStats returns a default-constructed DeviceStats: max_split_size stays 0.
        let stats = MemoryStats {
            max_split_size: 0,
            ..MemoryStats::default()
        };
        CudaAsyncAllocator {
            config,
            device,
            stats,
            pages: Vec::new(),
            free_pages: Default::default(),
            shared_pages: Default::default(),
            released: Default::default(),
            allocations: Vec::new(),
            vacant: Vec::new(),
            address_space: AddressSpace::default(),
            held_pages: 0,
            used: 0,
            last_sync_ns: 0,
            record_history: false,
            history: Vec::new(),
        }
    }

    /// The settings in force.
    pub fn config(&self) -> &CudaAsyncConfig {
        &self.config
    }

    /// `ReservedMemCurrent`: bytes of physical memory the pool holds.
    pub fn reserved(&self) -> u64 {
        self.held_pages * self.config.page_size
    }

    /// `UsedMemCurrent`: Σ sizes of live allocations.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The device address of a live block.
    pub fn block_address(&self, block: BlockRef) -> u64 {
        self.allocation(block).addr(&self.pages)
    }

    /// A host synchronization (`cudaStreamSynchronize`, `cudaEventSynchronize`, `cudaDeviceSynchronize`)
    /// has just happened: completed frees become available to every stream and, when the pool holds more
    /// than the release threshold, it trims itself down to it.
    ///
    /// The replay engine has no synchronization hook, and under PyTorch (threshold `UINT64_MAX`, opportunistic
    /// reuse on) a synchronization changes nothing this model keeps; drivers of other settings (the
    /// validation replay) call this after the timeline's own `synchronize`.
    pub fn synchronize(&mut self, timeline: &Timeline) {
        self.last_sync_ns = timeline.now();
        if self.reserved() > self.config.release_threshold {
            self.trim_to(self.config.release_threshold, timeline);
        }
    }

    /// `cuMemPoolTrimTo(pool, keep)`: releases completed free pages, highest address first, until the pool
    /// holds at most `keep` bytes (or no releasable page is left).
    pub fn trim_to(&mut self, keep: u64, timeline: &Timeline) {
        let now = timeline.now();
        let candidates: Vec<u32> = self.free_pages.iter().rev().map(|&(_, id)| id).collect();
        for id in candidates {
            if self.reserved() <= keep {
                break;
            }
            let PageState::Free(freed) = self.pages[id as usize].state else {
                continue;
            };
            if !freed.complete_by(now) {
                continue;
            }
            self.release_page(id, timeline);
        }
    }

    fn allocation(&self, block: BlockRef) -> &Allocation {
        self.allocations[block.0 as usize]
            .as_ref()
            .expect("a block that is not allocated")
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

    /// The limit of `setMemoryFraction`: `fraction × total`, else `UINT64_MAX`.
    fn limit(&self) -> u64 {
        match self.config.memory_fraction {
            Some(fraction) => (fraction * self.device.total_memory as f64) as u64,
            None => u64::MAX,
        }
    }

    fn device_free(&self) -> u64 {
        self.device.free_memory(self.reserved())
    }

    /// Whether `stream` may reuse memory freed as `freed` without waiting.
    fn usable(&self, freed: Freed, stream: StreamId, now: u64) -> bool {
        if freed.owner == Owner::Stream(stream) {
            return true;
        }
        let visible_until = if self.config.reuse_allow_opportunistic {
            now
        } else {
            self.last_sync_ns
        };
        freed.complete_by(visible_until)
    }

    fn new_page(&mut self, state: PageState, tl: &Timeline, stream: StreamId) -> u32 {
        let page_size = self.config.page_size;
        let addr = self.address_space.reserve(page_size);
        let id = match self.released.pop_first() {
            Some(id) => {
                self.pages[id as usize] = Page { addr, state };
                id
            }
            None => {
                self.pages.push(Page { addr, state });
                (self.pages.len() - 1) as u32
            }
        };
        self.held_pages += 1;
        self.stats.reserved_bytes.all.increase(page_size);
        self.record(Action::SegmentAlloc, addr, page_size, stream, tl);
        id
    }

    fn release_page(&mut self, id: u32, tl: &Timeline) {
        let page_size = self.config.page_size;
        let addr = self.pages[id as usize].addr;
        self.pages[id as usize].state = PageState::Released;
        self.free_pages.remove(&(addr, id));
        self.released.insert(id);
        self.address_space.release(addr);
        self.held_pages -= 1;
        self.stats.reserved_bytes.all.decrease(page_size);
        self.record(Action::SegmentFree, addr, page_size, 0, tl);
    }

    /// The best usable free range for `len` bytes in shared pages: smallest, then lowest address.
    fn best_range(&self, len: u64, accept: impl Fn(&Self, Freed) -> bool) -> Option<(u32, usize)> {
        let mut best: Option<(u64, u64, u32, usize)> = None;
        for &(_, id) in &self.shared_pages {
            let page = &self.pages[id as usize];
            let PageState::Shared { free, .. } = &page.state else {
                continue;
            };
            for (index, range) in free.iter().enumerate() {
                if range.len >= len && accept(self, range.freed) {
                    let key = (range.len, page.addr + range.offset);
                    if best.is_none_or(|(l, a, _, _)| key < (l, a)) {
                        best = Some((key.0, key.1, id, index));
                    }
                }
            }
        }
        best.map(|(_, _, id, index)| (id, index))
    }

    /// The first free page (lowest address) that `accept` takes.
    fn first_free_page(&self, accept: impl Fn(&Self, Freed) -> bool) -> Option<u32> {
        self.free_pages.iter().map(|&(_, id)| id).find(
            |&id| matches!(self.pages[id as usize].state, PageState::Free(f) if accept(self, f)),
        )
    }

    /// Makes `stream` wait for memory freed as `freed` (an internal dependency).
    fn wait_for(freed: Freed, stream: StreamId, tl: &mut Timeline) {
        let idle = tl.stream_idle_at(stream);
        if freed.ready_at > idle {
            tl.enqueue(stream, freed.ready_at - idle);
        }
    }

    /// Finds room for a sub-page allocation of `len` bytes, in the documented order.
    fn find_sub(&self, len: u64, stream: StreamId, now: u64) -> Option<Found> {
        let same =
            |s: &Self, f: Freed| f.owner == Owner::Stream(stream) && s.usable(f, stream, now);
        let usable = |s: &Self, f: Freed| s.usable(f, stream, now);
        if let Some((page, index)) = self.best_range(len, same) {
            return Some(Found::Range { page, index });
        }
        if let Some((page, index)) = self.best_range(len, usable) {
            return Some(Found::Range { page, index });
        }
        if let Some(page) = self.first_free_page(same) {
            return Some(Found::FreePage(page));
        }
        self.first_free_page(usable).map(Found::FreePage)
    }

    fn malloc_sub(&mut self, len: u64, stream: StreamId, tl: &mut Timeline) -> Option<Placement> {
        let now = tl.now();
        let found = match self.find_sub(len, stream, now) {
            Some(found) => Some(found),
            None if self.device_free() >= self.config.page_size => {
                let page = self.new_page(PageState::Free(Freed::FRESH), tl, stream);
                self.free_pages
                    .insert((self.pages[page as usize].addr, page));
                Some(Found::FreePage(page))
            }
            None if self.config.reuse_allow_internal_dependencies => {
                // §internal dependencies: pending memory of another stream, earliest first.
                let range = self.best_range(len, |_, _| true);
                match range {
                    Some((page, index)) => Some(Found::Range { page, index }),
                    None => self
                        .free_pages
                        .iter()
                        .map(|&(_, id)| id)
                        .min_by_key(|&id| match self.pages[id as usize].state {
                            PageState::Free(f) => (f.ready_at, id),
                            _ => (u64::MAX, id),
                        })
                        .map(Found::FreePage),
                }
            }
            None => None,
        }?;
        let (page, index) = match found {
            Found::Range { page, index } => (page, index),
            Found::FreePage(page) => {
                let PageState::Free(freed) = self.pages[page as usize].state else {
                    unreachable!("free_pages holds free pages only");
                };
                let addr = self.pages[page as usize].addr;
                self.free_pages.remove(&(addr, page));
                self.shared_pages.insert((addr, page));
                self.pages[page as usize].state = PageState::Shared {
                    live: 0,
                    free: vec![FreeRange {
                        offset: 0,
                        len: self.config.page_size,
                        freed,
                    }],
                };
                (page, 0)
            }
        };
        let PageState::Shared { live, free } = &mut self.pages[page as usize].state else {
            unreachable!("a shared page");
        };
        let range = &mut free[index];
        let freed = range.freed;
        let offset = range.offset;
        range.offset += len;
        range.len -= len;
        if range.len == 0 {
            free.remove(index);
        }
        *live += 1;
        if !self.usable(freed, stream, now) {
            Self::wait_for(freed, stream, tl);
        }
        Some(Placement::Sub { page, offset, len })
    }

    fn malloc_pages(&mut self, n: u64, stream: StreamId, tl: &mut Timeline) -> Option<Placement> {
        let now = tl.now();
        let mut chosen: Vec<u32> = Vec::new();
        // Same stream first, then completed frees of other streams.
        for pass in 0..2 {
            for &(_, id) in &self.free_pages {
                if chosen.len() as u64 == n {
                    break;
                }
                let PageState::Free(f) = self.pages[id as usize].state else {
                    continue;
                };
                let take = if pass == 0 {
                    f.owner == Owner::Stream(stream)
                } else {
                    f.owner != Owner::Stream(stream) && self.usable(f, stream, now)
                };
                if take {
                    chosen.push(id);
                }
            }
        }
        let missing = n - chosen.len() as u64;
        let mut waits: Vec<Freed> = Vec::new();
        let grow = if missing * self.config.page_size <= self.device_free() {
            missing
        } else if self.config.reuse_allow_internal_dependencies {
            // Pending pages of other streams, earliest completion first.
            let mut pending: Vec<(u64, u32, Freed)> = self
                .free_pages
                .iter()
                .map(|&(_, id)| id)
                .filter(|id| !chosen.contains(id))
                .filter_map(|id| match self.pages[id as usize].state {
                    PageState::Free(f) => Some((f.ready_at, id, f)),
                    _ => None,
                })
                .collect();
            pending.sort_unstable_by_key(|&(ready, id, _)| (ready, id));
            // Growth failed: pending memory first, then grow only what is still missing.
            let taken = missing.min(pending.len() as u64);
            let grow = missing - taken;
            if grow * self.config.page_size > self.device_free() {
                return None;
            }
            for &(_, id, f) in pending.iter().take(taken as usize) {
                chosen.push(id);
                waits.push(f);
            }
            grow
        } else {
            return None;
        };
        for &id in &chosen {
            self.free_pages.remove(&(self.pages[id as usize].addr, id));
            self.pages[id as usize].state = PageState::Whole;
        }
        for _ in 0..grow {
            let id = self.new_page(PageState::Whole, tl, stream);
            chosen.push(id);
        }
        for f in waits {
            Self::wait_for(f, stream, tl);
        }
        chosen.sort_unstable();
        let addr = self.address_space.reserve(n * self.config.page_size);
        Some(Placement::Pages {
            pages: chosen,
            addr,
        })
    }

    /// Frees a sub-page range, merging it with free neighbours; returns whether the page is now empty.
    fn free_range(&mut self, page: u32, offset: u64, len: u64, freed: Freed) -> bool {
        let PageState::Shared { live, free } = &mut self.pages[page as usize].state else {
            unreachable!("a shared page");
        };
        *live -= 1;
        let at = free.partition_point(|r| r.offset < offset);
        free.insert(at, FreeRange { offset, len, freed });
        // Merge with the next, then with the previous range.
        if at + 1 < free.len() && free[at].offset + free[at].len == free[at + 1].offset {
            let next = free.remove(at + 1);
            free[at].len += next.len;
            free[at].freed = free[at].freed.merge(next.freed);
        }
        if at > 0 && free[at - 1].offset + free[at - 1].len == free[at].offset {
            let this = free.remove(at);
            free[at - 1].len += this.len;
            free[at - 1].freed = free[at - 1].freed.merge(this.freed);
        }
        *live == 0
    }
}

/// Rounds `n` up to a multiple of `to` (a power of two).
fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

impl Allocator for CudaAsyncAllocator {
    fn malloc(
        &mut self,
        size: u64,
        stream: StreamId,
        tl: &mut Timeline,
    ) -> Result<BlockRef, OutOfMemory> {
        let page_size = self.config.page_size;
        // CudaMallocAsyncAllocator::allocate: the 1 EiB guard.
        if size >= MAX_REQUEST {
            return Err(OutOfMemory {
                message: MORE_THAN_1EB_MESSAGE.to_string(),
                requested: size,
                alloc_size: 0,
                device_free: self.device_free(),
            });
        }
        let len = round_up(size, self.config.alignment);
        let pages = len.div_ceil(page_size);
        let limit = self.limit();
        // mallocAsync: the memory-fraction limit is checked before cudaMallocAsync.
        let placement = if self.used.saturating_add(size) > limit {
            None
        } else if len < page_size {
            self.malloc_sub(len, stream, tl)
        } else {
            self.malloc_pages(pages, stream, tl)
        };
        let Some(placement) = placement else {
            let device_free = self.device_free();
            self.record(Action::Oom, device_free, size, stream, tl);
            return Err(OutOfMemory {
                message: cuda_async_oom_message(
                    self.device.index,
                    self.used,
                    size,
                    self.device.total_memory,
                    device_free,
                    limit,
                ),
                requested: size,
                alloc_size: if len < page_size {
                    page_size
                } else {
                    pages * page_size
                },
                device_free,
            });
        };
        let allocation = Allocation {
            size,
            stream,
            recorded: Vec::new(),
            placement,
        };
        let addr = allocation.addr(&self.pages);
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
        self.used += size;
        // getDeviceStats: allocated_bytes and active_bytes are both UsedMem.
        self.stats.allocated_bytes.all.increase(size);
        self.stats.active_bytes.all.increase(size);
        self.record(Action::Alloc, addr, size, stream, tl);
        Ok(BlockRef(idx))
    }

    fn free(&mut self, block: BlockRef, tl: &mut Timeline) {
        let allocation = self.allocations[block.0 as usize]
            .take()
            .expect("free of a block that is not allocated");
        self.vacant.push(block.0);
        let addr = allocation.addr(&self.pages);
        let size = allocation.size;
        // free_impl: the allocation stream, or the unifying stream after waiting for every recorded stream.
        let freed = if allocation.recorded.is_empty() {
            Freed {
                owner: Owner::Stream(allocation.stream),
                ready_at: tl.record_event(allocation.stream),
            }
        } else {
            let ready_at = allocation
                .recorded
                .iter()
                .map(|&s| tl.record_event(s))
                .fold(tl.record_event(allocation.stream), u64::max);
            Freed {
                owner: Owner::Unifying,
                ready_at,
            }
        };
        self.record(Action::FreeRequested, addr, size, allocation.stream, tl);
        self.record(Action::FreeCompleted, addr, size, allocation.stream, tl);
        match allocation.placement {
            Placement::Pages { pages, addr } => {
                self.address_space.release(addr);
                for id in pages {
                    self.pages[id as usize].state = PageState::Free(freed);
                    self.free_pages.insert((self.pages[id as usize].addr, id));
                }
            }
            Placement::Sub { page, offset, len } => {
                if self.free_range(page, offset, len, freed) {
                    let PageState::Shared { free, .. } = &self.pages[page as usize].state else {
                        unreachable!("a shared page");
                    };
                    let merged = free
                        .iter()
                        .map(|r| r.freed)
                        .reduce(Freed::merge)
                        .unwrap_or(freed);
                    let page_addr = self.pages[page as usize].addr;
                    self.pages[page as usize].state = PageState::Free(merged);
                    self.shared_pages.remove(&(page_addr, page));
                    self.free_pages.insert((page_addr, page));
                }
            }
        }
        self.used -= size;
        self.stats.allocated_bytes.all.decrease(size);
        self.stats.active_bytes.all.decrease(size);
    }

    /// `recordStream`: remembers the stream (the allocation stream itself is ignored, with PyTorch's
    /// warning in real runs).
    fn record_stream(&mut self, block: BlockRef, stream: StreamId) {
        let allocation = self.allocations[block.0 as usize]
            .as_mut()
            .expect("record_stream of a block that is not allocated");
        if stream != allocation.stream && !allocation.recorded.contains(&stream) {
            allocation.recorded.push(stream);
        }
    }

    /// A snapshot's initial segments describe the caching allocator's blocks, which this backend does
    /// not have.
    fn adopt_segment(
        &mut self,
        _segment: &vramsim_traces::InitialSegment,
    ) -> Result<Vec<BlockRef>, crate::allocator::AdoptError> {
        Err(crate::allocator::AdoptError::Unsupported {
            model: "cuda-async",
        })
    }

    /// `emptyCache`: `cudaDeviceSynchronize()` then `cudaMemPoolTrimTo(pool, 0)`.
    fn empty_cache(&mut self, tl: &mut Timeline) {
        tl.synchronize();
        self.last_sync_ns = tl.now();
        self.trim_to(0, tl);
    }

    fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    fn device(&self) -> &Device {
        &self.device
    }

    /// vramsim's view of the pool (PyTorch's `snapshot()` raises for this backend): one segment per
    /// whole-page allocation (its pages, remapped contiguously), one per shared page, one per free page.
    fn segments(&self) -> Vec<SegmentInfo> {
        let page_size = self.config.page_size;
        let mut segments = Vec::new();
        for allocation in self.allocations.iter().flatten() {
            if let Placement::Pages { pages, addr } = &allocation.placement {
                let total = pages.len() as u64 * page_size;
                let len = round_up(allocation.size, self.config.alignment);
                let mut blocks = vec![BlockInfo {
                    address: *addr,
                    size: len,
                    requested_size: allocation.size,
                    state: BlockState::ActiveAllocated,
                }];
                if total > len {
                    blocks.push(BlockInfo {
                        address: addr + len,
                        size: total - len,
                        requested_size: 0,
                        state: BlockState::Inactive,
                    });
                }
                segments.push(SegmentInfo {
                    address: *addr,
                    total_size: total,
                    allocated_size: len,
                    active_size: len,
                    requested_size: allocation.size,
                    stream: allocation.stream,
                    pool: PoolKind::Large,
                    is_expandable: false,
                    blocks,
                });
            }
        }
        // (page id, offset, len, requested) of sub-page allocations.
        let mut in_page: Vec<(u64, u64, u64, u64)> = Vec::new();
        for allocation in self.allocations.iter().flatten() {
            if let Placement::Sub { page, offset, len } = allocation.placement {
                in_page.push((u64::from(page), offset, len, allocation.size));
            }
        }
        in_page.sort_unstable();
        for (id, page) in self.pages.iter().enumerate() {
            match &page.state {
                PageState::Free(freed) => segments.push(SegmentInfo {
                    address: page.addr,
                    total_size: page_size,
                    allocated_size: 0,
                    active_size: 0,
                    requested_size: 0,
                    stream: match freed.owner {
                        Owner::Stream(s) => s,
                        Owner::Unifying => 0,
                    },
                    pool: PoolKind::Large,
                    is_expandable: false,
                    blocks: vec![BlockInfo {
                        address: page.addr,
                        size: page_size,
                        requested_size: 0,
                        state: BlockState::Inactive,
                    }],
                }),
                PageState::Shared { free, .. } => {
                    let mut blocks: Vec<BlockInfo> = free
                        .iter()
                        .map(|r| BlockInfo {
                            address: page.addr + r.offset,
                            size: r.len,
                            requested_size: 0,
                            state: BlockState::Inactive,
                        })
                        .collect();
                    let start = in_page.partition_point(|e| e.0 < id as u64);
                    let mut allocated = 0;
                    let mut requested = 0;
                    for &(_, offset, len, req) in
                        in_page[start..].iter().take_while(|e| e.0 == id as u64)
                    {
                        allocated += len;
                        requested += req;
                        blocks.push(BlockInfo {
                            address: page.addr + offset,
                            size: len,
                            requested_size: req,
                            state: BlockState::ActiveAllocated,
                        });
                    }
                    blocks.sort_by_key(|b| b.address);
                    segments.push(SegmentInfo {
                        address: page.addr,
                        total_size: page_size,
                        allocated_size: allocated,
                        active_size: allocated,
                        requested_size: requested,
                        stream: 0,
                        pool: PoolKind::Small,
                        is_expandable: false,
                        blocks,
                    });
                }
                PageState::Released | PageState::Whole => {}
            }
        }
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
