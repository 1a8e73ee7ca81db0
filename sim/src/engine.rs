//! The discrete-event replay engine: feeds a trace's events to an allocator model, keeps the clocks, and
//! measures what a report needs.
//!
//! Each event is applied in order. `alloc`/`free`/`record_stream`/`empty_cache` become the allocator's
//! `malloc`/`free`/`record_stream`/`empty_cache`; `compute` queues work on a stream and `sync` makes the host
//! wait (see [`Timeline`]), which is what decides when a `record_stream`-deferred free completes. The engine
//! maps the trace's allocation ids to the allocator's blocks and holds nothing per event: its memory is
//! O(live allocations + distinct phase names), so a JSON Lines trace of any length streams through it.
//! A failed `malloc` ends the replay at that event, as the `OutOfMemoryError` would end the program
//! ([`Replay::run`]; a caller driving [`Replay::apply`] itself may go on, as a program that catches the
//! error does).
//!
//! A trace may start from a recorded state: `segment` events before every other event hand the allocator
//! segments it already holds ([`Allocator::adopt_segment`]), and their blocks become live allocations
//! under the ids the events give them.

mod peaks;
mod repeat;
mod view;

use std::borrow::Cow;
use std::collections::hash_map::Entry;
use std::collections::BTreeMap;

use rustc_hash::FxHashMap;
use vramsim_traces::{AllocId, Category, Event, TraceError};

use crate::allocator::{AdoptError, Allocator, BlockRef};
use crate::stats::MemoryStats;
use crate::timeline::Timeline;
use peaks::Peaks;

pub use repeat::Repeat;
pub use vramsim_traces::{renamed_id, EventView};

/// A trace that cannot be replayed: it says which event and why.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// An `alloc` reuses an id that is still live.
    #[error("event {index}: alloc of id {id}, which is already live (allocated at event {live_since}); ids must be unique among live allocations")]
    DuplicateId {
        /// Index of the offending event (0-based over the trace's events).
        index: u64,
        /// The id.
        id: AllocId,
        /// Index of the event that allocated it.
        live_since: u64,
    },
    /// A `free` or `record_stream` names an id that is not live.
    #[error("event {index}: {op} of id {id}, which is not a live allocation (never allocated, or already freed)")]
    UnknownId {
        /// Index of the offending event.
        index: u64,
        /// `free` or `record_stream`.
        op: &'static str,
        /// The id.
        id: AllocId,
    },
    /// A `segment` after another op: segments declare the state a trace starts from.
    #[error("event {index}: op `segment` after op `{previous}` (event {previous_index}): segments declare the state a trace starts from, so they come before every other op")]
    SegmentNotAtStart {
        /// Index of the offending event.
        index: u64,
        /// The op of the first event that was not a `segment`.
        previous: &'static str,
        /// Its index.
        previous_index: u64,
    },
    /// The allocator could not take over a `segment`.
    #[error("event {index}: cannot start from this segment: {source}")]
    Adopt {
        /// Index of the offending event.
        index: u64,
        /// Why.
        #[source]
        source: AdoptError,
    },
}

/// What to measure besides the statistics.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// Keep an allocated/reserved timeline of at most this many points for plots (0: none).
    pub timeline_points: usize,
}

/// Whether the replay goes on after an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Next event, please.
    Continue,
    /// The allocator raised out-of-memory: the program would have stopped here.
    Stopped,
}

/// The out-of-memory error that ended a replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomEvent {
    /// Index of the failing `alloc` event.
    pub event_index: u64,
    /// PyTorch's message.
    pub message: String,
    /// The requested bytes.
    pub requested_bytes: u64,
    /// The id of the failing allocation.
    pub id: AllocId,
}

/// Peak figures of one phase (all phases of the same name are merged).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhasePeak {
    /// The phase name.
    pub name: String,
    /// How many times the phase started.
    pub occurrences: u64,
    /// Highest allocated bytes while in the phase.
    pub peak_allocated: u64,
    /// Highest reserved bytes while in the phase.
    pub peak_reserved: u64,
}

/// A phase's name and how many times it started (its peaks are kept with the others: [`Peaks`]).
#[derive(Clone, Debug)]
struct PhaseCount {
    name: String,
    occurrences: u64,
}

/// Each phase's peaks, in order of first appearance: `phases` with their peaks in `peaks`.
fn phase_peaks(phases: &[PhaseCount], peaks: &Peaks) -> Vec<PhasePeak> {
    phases
        .iter()
        .enumerate()
        .map(|(slot, p)| {
            let (peak_allocated, peak_reserved) = peaks.phases.get(slot).copied().unwrap_or((0, 0));
            PhasePeak {
                name: p.name.clone(),
                occurrences: p.occurrences,
                peak_allocated,
                peak_reserved,
            }
        })
        .collect()
}

/// One point of the memory timeline: the maxima over a run of events starting at `event_index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimelinePoint {
    /// First event index of the bucket.
    pub event_index: u64,
    /// Highest allocated bytes in the bucket.
    pub allocated: u64,
    /// Highest reserved bytes in the bucket.
    pub reserved: u64,
    /// Live requested bytes by category (indexed as [`Category::ALL`]) at the event where `allocated`
    /// peaked in the bucket (the first such event), so that a stack of them is one real moment.
    pub categories: [u64; Category::ALL.len()],
}

/// Everything a replay measured.
#[derive(Clone, Debug)]
pub struct ReplayOutcome {
    /// The allocator's statistics at the end (or at the OOM).
    pub stats: MemoryStats,
    /// Events applied (the failing one included).
    pub events: u64,
    /// `alloc` events applied.
    pub allocs: u64,
    /// `free` events applied.
    pub frees: u64,
    /// Highest `reserved + context` of this process.
    pub peak_device_used: u64,
    /// Allocated bytes at the moment of peak allocated, by category (requested sizes).
    pub categories_at_peak: [u64; Category::ALL.len()],
    /// Event index at which allocated memory peaked.
    pub peak_allocated_event: u64,
    /// The highest allocated bytes seen while reserved memory stood at its peak.
    pub allocated_at_reserved_peak: u64,
    /// Peaks by phase, in order of first appearance.
    pub phases: Vec<PhasePeak>,
    /// Phase starts (event index, name) for plots, at most [`MAX_PHASE_MARKS`].
    pub phase_marks: Vec<(u64, String)>,
    /// The downsampled timeline, when asked for.
    pub timeline: Vec<TimelinePoint>,
    /// The OOM that ended the replay, if any.
    pub oom: Option<OomEvent>,
    /// Host time at the end, in nanoseconds.
    pub host_time_ns: u64,
}

/// Phase starts kept for plotting; later ones are still counted in [`ReplayOutcome::phases`].
pub const MAX_PHASE_MARKS: usize = 1000;

#[derive(Clone)]
struct Live {
    block: Option<BlockRef>,
    size: u64,
    category: Category,
    since: u64,
}

/// A replay in progress: an allocator, the clocks and the live allocations.
pub struct Replay<A: Allocator> {
    allocator: A,
    timeline: Timeline,
    live: FxHashMap<AllocId, Live>,
    next_index: u64,
    allocs: u64,
    frees: u64,
    categories: [u64; Category::ALL.len()],
    /// The whole replay's peaks.
    peaks: Peaks,
    /// The peaks since the last carried steady state (`None` before the first: the whole replay's),
    /// kept where [`Replay::keep_stretch_peaks`] asked for them.
    window: Option<Peaks>,
    stretch_peaks: bool,
    /// Each phase's name and starts, by phase slot.
    phases: Vec<PhaseCount>,
    phase_index: BTreeMap<String, usize>,
    current_phase: Option<usize>,
    phase_marks: Vec<(u64, String)>,
    sampler: Sampler,
    oom: Option<OomEvent>,
    /// The op and index of the first event that was not a `segment`.
    started: Option<(&'static str, u64)>,
    /// What each skipped steady state carried, in order ([`Replay::outcome_with_more`]).
    carried: Vec<repeat::Carried>,
}

impl<A: Allocator> Replay<A> {
    /// Starts a replay on `allocator` at host time zero.
    pub fn new(allocator: A, options: &ReplayOptions) -> Self {
        Replay {
            allocator,
            timeline: Timeline::new(),
            live: FxHashMap::default(),
            next_index: 0,
            allocs: 0,
            frees: 0,
            categories: [0; Category::ALL.len()],
            peaks: Peaks::default(),
            window: None,
            stretch_peaks: false,
            phases: Vec::new(),
            phase_index: BTreeMap::new(),
            current_phase: None,
            phase_marks: Vec::new(),
            sampler: Sampler::new(options.timeline_points),
            oom: None,
            started: None,
            carried: Vec::new(),
        }
    }

    /// A copy of this replay in its present state, with `allocator` as its allocator (a copy of this
    /// one's): the two then go on independently, as two replays of the same events so far would.
    pub fn fork_with(&self, allocator: A) -> Replay<A> {
        Replay {
            allocator,
            timeline: self.timeline.clone(),
            live: self.live.clone(),
            next_index: self.next_index,
            allocs: self.allocs,
            frees: self.frees,
            categories: self.categories,
            peaks: self.peaks.clone(),
            window: self.window.clone(),
            stretch_peaks: self.stretch_peaks,
            phases: self.phases.clone(),
            phase_index: self.phase_index.clone(),
            current_phase: self.current_phase,
            phase_marks: self.phase_marks.clone(),
            sampler: self.sampler.clone(),
            oom: self.oom.clone(),
            started: self.started,
            carried: self.carried.clone(),
        }
    }

    /// The allocator, as the replay left it so far.
    pub fn allocator(&self) -> &A {
        &self.allocator
    }

    /// The allocator, to adjust between events (address hints, history).
    pub fn allocator_mut(&mut self) -> &mut A {
        &mut self.allocator
    }

    /// The clocks.
    pub fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    /// The out-of-memory error of the last failed `alloc`, if any.
    pub fn oom(&self) -> Option<&OomEvent> {
        self.oom.as_ref()
    }

    /// Applies the next event of the trace.
    pub fn apply(&mut self, event: Event) -> Result<Flow, ReplayError> {
        self.apply_ref(&event)
    }

    /// [`Replay::apply`] for a borrowed event: nothing is copied (an integer id is not even cloned),
    /// so a lowered trace replays in place, as many times as asked.
    pub fn apply_ref(&mut self, event: &Event) -> Result<Flow, ReplayError> {
        self.apply_as(event, |id| id, None)
    }

    /// [`Replay::apply_ref`] for a borrowed event that stands for another: its integer ids passed
    /// through `rename`, and, for an `alloc`, `size` bytes where given instead of the event's (a step
    /// written once and replayed as several, [`EventView`]). Nothing is copied.
    #[inline]
    pub fn apply_as<R: Fn(u64) -> u64>(
        &mut self,
        event: &Event,
        rename: R,
        size: Option<u64>,
    ) -> Result<Flow, ReplayError> {
        let index = self.next_index;
        self.next_index += 1;
        if let Event::Segment(segment) = event {
            return self.adopt(index, segment);
        }
        if self.started.is_none() {
            self.started = Some((event.op(), index));
        }
        match event {
            Event::Alloc {
                id,
                size: written,
                stream,
                category,
                ..
            } => {
                let size = size.unwrap_or(*written);
                return self.alloc(index, &renamed(id, &rename), size, *stream, *category);
            }
            Event::Free { id } => {
                let id = renamed(id, &rename);
                let live = self
                    .live
                    .remove(&id)
                    .ok_or_else(|| ReplayError::UnknownId {
                        index,
                        op: "free",
                        id: id.into_owned(),
                    })?;
                self.frees += 1;
                self.categories[live.category.index()] -= live.size;
                if let Some(block) = live.block {
                    self.allocator.free(block, &mut self.timeline);
                }
            }
            Event::RecordStream { id, stream } => {
                let id = renamed(id, &rename);
                let live = self.live.get(&id).ok_or_else(|| ReplayError::UnknownId {
                    index,
                    op: "record_stream",
                    id: id.into_owned(),
                })?;
                if let Some(block) = live.block {
                    self.allocator.record_stream(block, *stream);
                }
                return Ok(Flow::Continue);
            }
            Event::EmptyCache => self.allocator.empty_cache(&mut self.timeline),
            Event::Compute { stream, us } => {
                self.timeline.enqueue(*stream, (us * 1000.0).round() as u64);
                return Ok(Flow::Continue);
            }
            Event::Sync { stream: None } => {
                self.timeline.synchronize();
                return Ok(Flow::Continue);
            }
            Event::Sync {
                stream: Some(stream),
            } => {
                self.timeline.synchronize_stream(*stream);
                return Ok(Flow::Continue);
            }
            Event::Phase { name } => {
                self.start_phase(index, name);
                return Ok(Flow::Continue);
            }
            Event::Segment(_) => unreachable!("handled above"),
        }
        self.observe(index);
        Ok(Flow::Continue)
    }

    /// Applies borrowed events in order until they end or an allocation fails ([`Replay::apply_ref`]).
    pub fn apply_slice(&mut self, events: &[Event]) -> Result<Flow, ReplayError> {
        self.apply_view(&EventView {
            events,
            ..EventView::default()
        })
    }

    /// Applies the events `view` stands for, in order, until they end or an allocation fails: its
    /// borrowed events with their ids renamed and sizes replaced as it says ([`Replay::apply_as`]).
    pub fn apply_view(&mut self, view: &EventView) -> Result<Flow, ReplayError> {
        self.apply_shifted(view, u64::MAX, 0)
    }

    fn alloc(
        &mut self,
        index: u64,
        id: &AllocId,
        size: u64,
        stream: u64,
        category: Category,
    ) -> Result<Flow, ReplayError> {
        // one lookup: the slot found free is filled once the allocator has answered
        let slot = match self.live.entry(id.clone()) {
            Entry::Occupied(live) => {
                return Err(ReplayError::DuplicateId {
                    index,
                    id: id.clone(),
                    live_since: live.get().since,
                })
            }
            Entry::Vacant(slot) => slot,
        };
        self.allocs += 1;
        // PyTorch returns a null pointer for 0 bytes without involving the allocator (§3).
        let block = if size == 0 {
            None
        } else {
            match self.allocator.malloc(size, stream, &mut self.timeline) {
                Ok(block) => Some(block),
                Err(oom) => {
                    self.oom = Some(OomEvent {
                        event_index: index,
                        message: oom.message,
                        requested_bytes: size,
                        id: id.clone(),
                    });
                    self.observe(index);
                    return Ok(Flow::Stopped);
                }
            }
        };
        slot.insert(Live {
            block,
            size,
            category,
            since: index,
        });
        self.categories[category.index()] += size;
        self.observe(index);
        Ok(Flow::Continue)
    }

    /// A `segment` event: the allocator takes the segment over, its blocks become live allocations.
    fn adopt(
        &mut self,
        index: u64,
        segment: &vramsim_traces::InitialSegment,
    ) -> Result<Flow, ReplayError> {
        if let Some((previous, previous_index)) = self.started {
            return Err(ReplayError::SegmentNotAtStart {
                index,
                previous,
                previous_index,
            });
        }
        let mut ids = rustc_hash::FxHashSet::default();
        for b in &segment.blocks {
            let live_since = match self.live.get(&b.id) {
                Some(live) => live.since,
                None if !ids.insert(&b.id) => index,
                None => continue,
            };
            return Err(ReplayError::DuplicateId {
                index,
                id: b.id.clone(),
                live_since,
            });
        }
        let refs = self
            .allocator
            .adopt_segment(segment)
            .map_err(|source| ReplayError::Adopt { index, source })?;
        for (b, block) in segment.blocks.iter().zip(refs) {
            self.categories[b.category.index()] += b.requested;
            let previous = self.live.insert(
                b.id.clone(),
                Live {
                    block: Some(block),
                    size: b.requested,
                    category: b.category,
                    since: index,
                },
            );
            debug_assert!(previous.is_none(), "ids were checked to be distinct");
        }
        self.observe(index);
        Ok(Flow::Continue)
    }

    fn start_phase(&mut self, index: u64, name: &str) {
        let slot = match self.phase_index.get(name) {
            Some(&slot) => slot,
            None => {
                self.phases.push(PhaseCount {
                    name: name.to_string(),
                    occurrences: 0,
                });
                self.phase_index
                    .insert(name.to_string(), self.phases.len() - 1);
                self.phases.len() - 1
            }
        };
        self.phases[slot].occurrences += 1;
        self.current_phase = Some(slot);
        if self.phase_marks.len() < MAX_PHASE_MARKS {
            self.phase_marks.push((index, name.to_string()));
        }
        self.observe(index);
    }

    /// Folds the allocator's current figures into the peaks (called after every memory event).
    #[inline]
    fn observe(&mut self, index: u64) {
        let stats = self.allocator.stats();
        let allocated = stats.allocated_bytes.all.current as u64;
        let reserved = stats.reserved_bytes.all.current as u64;
        let device_used = self.allocator.device_used();
        let phase = self.current_phase;
        // the whole replay's peaks, and the current stretch's where they are kept
        for peaks in std::iter::once(&mut self.peaks).chain(self.window.as_mut()) {
            peaks.observe(
                index,
                allocated,
                reserved,
                device_used,
                &self.categories,
                phase,
            );
        }
        self.sampler
            .push(index, allocated, reserved, &self.categories);
    }

    /// Applies every event until the trace ends or an allocation fails, then reports.
    pub fn run<I>(mut self, events: I) -> Result<ReplayOutcome, ReplayError>
    where
        I: IntoIterator<Item = Result<Event, TraceError>>,
    {
        self.apply_all(events)?;
        Ok(self.finish())
    }

    /// Applies every event until the trace ends or an allocation fails, keeping the replay (and its
    /// allocator) for the caller.
    pub fn apply_all<I>(&mut self, events: I) -> Result<Flow, ReplayError>
    where
        I: IntoIterator<Item = Result<Event, TraceError>>,
    {
        for event in events {
            if self.apply(event?)? == Flow::Stopped {
                return Ok(Flow::Stopped);
            }
        }
        Ok(Flow::Continue)
    }

    /// Ends the replay and hands back what it measured.
    pub fn finish(self) -> ReplayOutcome {
        self.into_parts().0
    }

    /// Ends the replay, handing back what it measured and the allocator in its final state.
    pub fn into_parts(self) -> (ReplayOutcome, A) {
        let outcome = ReplayOutcome {
            stats: self.allocator.stats().clone(),
            events: self.next_index,
            allocs: self.allocs,
            frees: self.frees,
            peak_device_used: self.peaks.device_used,
            categories_at_peak: self.peaks.categories,
            peak_allocated_event: self.peaks.allocated_event,
            allocated_at_reserved_peak: self.peaks.allocated_at_reserved,
            phases: phase_peaks(&self.phases, &self.peaks),
            phase_marks: self.phase_marks,
            timeline: self.sampler.finish(),
            oom: self.oom,
            host_time_ns: self.timeline.now(),
        };
        (outcome, self.allocator)
    }
}

/// `id` with its integer through `rename` (a string id as it is).
#[inline]
fn renamed<'e>(id: &'e AllocId, rename: &impl Fn(u64) -> u64) -> Cow<'e, AllocId> {
    match id {
        AllocId::Int(i) => Cow::Owned(AllocId::Int(rename(*i))),
        other => Cow::Borrowed(other),
    }
}

/// Keeps at most `capacity` timeline points in bounded memory: each point holds the maxima of a bucket of
/// events (and the categories at its allocated peak), and when the buffer fills, neighbouring buckets
/// merge and the bucket width doubles, so the peaks survive any trace length. Nothing is allocated after
/// construction except in the rare halving.
#[derive(Clone)]
struct Sampler {
    capacity: usize,
    width: u64,
    points: Vec<TimelinePoint>,
}

impl Sampler {
    fn new(capacity: usize) -> Self {
        Sampler {
            capacity,
            width: 1,
            points: Vec::with_capacity(capacity),
        }
    }

    #[inline]
    fn push(
        &mut self,
        index: u64,
        allocated: u64,
        reserved: u64,
        categories: &[u64; Category::ALL.len()],
    ) {
        if self.capacity == 0 {
            return;
        }
        let start = index - index % self.width;
        if let Some(last) = self.points.last_mut() {
            if last.event_index == start {
                if allocated > last.allocated {
                    last.allocated = allocated;
                    last.categories = *categories;
                }
                last.reserved = last.reserved.max(reserved);
                return;
            }
        }
        if self.points.len() == self.capacity {
            self.halve();
            return self.push(index, allocated, reserved, categories);
        }
        self.points.push(TimelinePoint {
            event_index: start,
            allocated,
            reserved,
            categories: *categories,
        });
    }

    fn halve(&mut self) {
        self.width *= 2;
        let mut merged: Vec<TimelinePoint> = Vec::with_capacity(self.capacity);
        for point in self.points.drain(..) {
            let start = point.event_index - point.event_index % self.width;
            match merged.last_mut() {
                Some(last) if last.event_index == start => {
                    if point.allocated > last.allocated {
                        last.allocated = point.allocated;
                        last.categories = point.categories;
                    }
                    last.reserved = last.reserved.max(point.reserved);
                }
                _ => merged.push(TimelinePoint {
                    event_index: start,
                    ..point
                }),
            }
        }
        self.points = merged;
    }

    fn finish(self) -> Vec<TimelinePoint> {
        self.points
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_keeps_the_peak_within_its_capacity() {
        let mut sampler = Sampler::new(8);
        for i in 0..1000u64 {
            let value = if i == 777 { 1 << 30 } else { i };
            let mut categories = [0; Category::ALL.len()];
            categories[Category::Activation.index()] = value;
            sampler.push(i, value, value, &categories);
        }
        let points = sampler.finish();
        assert!(points.len() <= 8);
        assert_eq!(points.iter().map(|p| p.allocated).max(), Some(1 << 30));
        // each point's categories are those of its allocated peak
        for point in &points {
            assert_eq!(
                point.categories[Category::Activation.index()],
                point.allocated
            );
        }
        assert!(points
            .windows(2)
            .all(|w| w[0].event_index < w[1].event_index));
    }
}
