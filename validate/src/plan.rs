//! The simulated side of a validation replay: a trace through an allocator model, one event at a time,
//! with the device-level calls (`cudaMalloc`, `cudaFree`, page maps and unmaps) each event makes.
//!
//! [`SimDriver`] applies events as `vramsim_sim::engine::Replay` does (same id bookkeeping, size 0 answered
//! without a block, the first out-of-memory error ends the replay). It is its own loop rather than the
//! engine because validation needs the allocator between events: its history (the device calls to repeat
//! on the GPU) and, for the stream-ordered pool, a synchronization hook the engine does not have.
//!
//! Nothing here touches a GPU; the functions are tested without one.

use std::collections::HashMap;

use vramsim_sim::allocator::{Action, Allocator, BlockRef, OutOfMemory};
use vramsim_sim::timeline::Timeline;
use vramsim_traces::{AllocId, Event};

use crate::error::ValidateError;

/// A device-level call the simulated allocator made, as its history records it (fact sheet §10.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceAction {
    /// `segment_alloc`: `cudaMalloc(size)` of a segment at simulated address `addr`.
    Malloc {
        /// Simulated address.
        addr: u64,
        /// Bytes.
        size: u64,
    },
    /// `segment_free`: `cudaFree` of the segment at `addr`.
    Free {
        /// Simulated address.
        addr: u64,
        /// Bytes.
        size: u64,
    },
    /// `segment_map`: pages of an expandable segment mapped at `addr` (§7.2).
    Map {
        /// Simulated address of the first page.
        addr: u64,
        /// Bytes (whole pages).
        size: u64,
    },
    /// `segment_unmap`: pages unmapped (§7.5).
    Unmap {
        /// Simulated address of the first page.
        addr: u64,
        /// Bytes (whole pages).
        size: u64,
    },
}

/// What one event did in the simulator.
#[derive(Clone, Debug, PartialEq)]
pub struct SimStep {
    /// 0-based index of the event in the trace.
    pub index: u64,
    /// Device calls made, in order.
    pub actions: Vec<DeviceAction>,
    /// Reserved bytes after the event.
    pub reserved: u64,
    /// Allocated bytes after the event.
    pub allocated: u64,
    /// The out-of-memory error of a failed `alloc` (the replay stops there).
    pub oom: Option<OutOfMemory>,
}

/// A trace through an allocator model, event by event, with history recorded.
pub struct SimDriver<A: Allocator> {
    allocator: A,
    timeline: Timeline,
    live: HashMap<AllocId, Option<BlockRef>>,
    index: u64,
    honour_compute: bool,
    segments_as_allocs: bool,
    on_sync: Option<fn(&mut A, &Timeline)>,
}

impl<A: Allocator> SimDriver<A> {
    /// A replay on `allocator` at host time zero. With `honour_compute` false, `compute` events are
    /// skipped: streams stay idle, as on a GPU replay that launches no kernels.
    pub fn new(mut allocator: A, honour_compute: bool) -> Self {
        allocator.set_record_history(true);
        SimDriver {
            allocator,
            timeline: Timeline::new(),
            live: HashMap::new(),
            index: 0,
            honour_compute,
            segments_as_allocs: false,
            on_sync: None,
        }
    }

    /// Calls `hook` after every `sync` event (the stream-ordered pool's release at synchronization).
    pub fn with_sync_hook(mut self, hook: fn(&mut A, &Timeline)) -> Self {
        self.on_sync = Some(hook);
        self
    }

    /// Replays a trace's initial `segment`s as plain allocations of their blocks' requested sizes (for
    /// models that cannot adopt segments, like the stream-ordered pool).
    pub fn with_segments_as_allocs(mut self) -> Self {
        self.segments_as_allocs = true;
        self
    }

    /// The allocator as the replay left it.
    pub fn allocator(&self) -> &A {
        &self.allocator
    }

    /// The clocks.
    pub fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    /// The allocator's block for a live id (`None` for size-0 allocations and unknown ids).
    pub fn block_of(&self, id: &AllocId) -> Option<BlockRef> {
        self.live.get(id).copied().flatten()
    }

    /// Applies the next event.
    pub fn step(&mut self, event: &Event) -> Result<SimStep, ValidateError> {
        let index = self.index;
        self.index += 1;
        let mut oom = None;
        let mut actions = Vec::new();
        match event {
            Event::Alloc {
                id, size, stream, ..
            } => {
                if self.live.contains_key(id) {
                    return Err(ValidateError::Sim(format!(
                        "event {index}: alloc of id {id}, which is already live; ids must be unique among live allocations"
                    )));
                }
                let block = if *size == 0 {
                    Some(None)
                } else {
                    match self.allocator.malloc(*size, *stream, &mut self.timeline) {
                        Ok(block) => Some(Some(block)),
                        Err(error) => {
                            oom = Some(error);
                            None
                        }
                    }
                };
                if let Some(block) = block {
                    self.live.insert(id.clone(), block);
                }
            }
            Event::Free { id } => {
                let block = self
                    .live
                    .remove(id)
                    .ok_or_else(|| unknown(index, "free", id))?;
                if let Some(block) = block {
                    self.allocator.free(block, &mut self.timeline);
                }
            }
            Event::RecordStream { id, stream } => {
                let block = *self
                    .live
                    .get(id)
                    .ok_or_else(|| unknown(index, "record_stream", id))?;
                if let Some(block) = block {
                    self.allocator.record_stream(block, *stream);
                }
            }
            Event::EmptyCache => self.allocator.empty_cache(&mut self.timeline),
            Event::Compute { stream, us } => {
                if self.honour_compute {
                    self.timeline.enqueue(*stream, (us * 1000.0).round() as u64);
                }
            }
            Event::Sync { stream } => {
                match stream {
                    Some(stream) => self.timeline.synchronize_stream(*stream),
                    None => self.timeline.synchronize(),
                }
                if let Some(hook) = self.on_sync {
                    hook(&mut self.allocator, &self.timeline);
                }
            }
            Event::Phase { .. } => {}
            Event::Segment(segment) => {
                if self.segments_as_allocs {
                    for b in &segment.blocks {
                        let block = if b.requested == 0 {
                            None
                        } else {
                            match self.allocator.malloc(
                                b.requested,
                                segment.stream,
                                &mut self.timeline,
                            ) {
                                Ok(block) => Some(block),
                                Err(error) => {
                                    oom = Some(error);
                                    break;
                                }
                            }
                        };
                        self.live.insert(b.id.clone(), block);
                    }
                } else {
                    let blocks = self
                        .allocator
                        .adopt_segment(segment)
                        .map_err(|e| ValidateError::Sim(format!("event {index}: segment: {e}")))?;
                    for (b, block) in segment.blocks.iter().zip(blocks) {
                        self.live.insert(b.id.clone(), Some(block));
                    }
                    // adopt_segment records no history: the segment is a device allocation all the same.
                    actions.push(if segment.expandable {
                        DeviceAction::Map {
                            addr: segment.addr,
                            size: segment.size,
                        }
                    } else {
                        DeviceAction::Malloc {
                            addr: segment.addr,
                            size: segment.size,
                        }
                    });
                }
            }
        }
        for entry in self.allocator.take_history() {
            let (addr, size) = (entry.addr, entry.size);
            actions.push(match entry.action {
                Action::SegmentAlloc => DeviceAction::Malloc { addr, size },
                Action::SegmentFree => DeviceAction::Free { addr, size },
                Action::SegmentMap => DeviceAction::Map { addr, size },
                Action::SegmentUnmap => DeviceAction::Unmap { addr, size },
                _ => continue,
            });
        }
        let stats = self.allocator.stats();
        Ok(SimStep {
            index,
            actions,
            reserved: stats.reserved_bytes.all.current as u64,
            allocated: stats.allocated_bytes.all.current as u64,
            oom,
        })
    }
}

fn unknown(index: u64, op: &str, id: &AllocId) -> ValidateError {
    ValidateError::Sim(format!(
        "event {index}: {op} of id {id}, which is not a live allocation (never allocated, or already freed)"
    ))
}

/// The pages of a `segment_map`/`segment_unmap` of `size` bytes: (page size, count).
///
/// A small-pool mapping is exactly one 2 MiB page (a request of at most 1 MiB never needs more, §7.2); a
/// large-pool mapping is a whole number of `large_page`s (20 MiB unless `large_segment_size_mb` says
/// otherwise). Unmaps are looked up page by page by the caller, so only maps need telling apart.
pub fn map_pages(size: u64, small_page: u64, large_page: u64) -> Result<(u64, u64), ValidateError> {
    if size > 0 && size.is_multiple_of(large_page) {
        Ok((large_page, size / large_page))
    } else if size == small_page {
        Ok((small_page, 1))
    } else {
        Err(ValidateError::Sim(format!(
            "a mapping of {size} bytes is neither one {small_page}-byte small page nor whole {large_page}-byte large pages"
        )))
    }
}

/// The greatest common divisor of the positive values (0 when there are none): the granularity that
/// explains every observed step of device memory.
pub fn gcd_of(values: impl IntoIterator<Item = u64>) -> u64 {
    values.into_iter().filter(|&v| v > 0).fold(0, gcd)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The median of some durations (in µs), 0 for none.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}
