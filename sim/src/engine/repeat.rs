//! Repeated events with an exact steady state: a run of events that a trace repeats (gradient
//! accumulation's micro-steps) is replayed until the state at a repetition boundary equals the state at
//! the previous boundary; the remaining repetitions would then do exactly what the last one did, so
//! they are skipped and their effect carried: running totals (events, allocs, frees, the allocator's
//! `allocated`/`freed`/`num_*` counters, GC clocks, phase occurrences and marks) grow by what one
//! repetition added, peaks stay (a repetition reaches what the last one reached), and the live
//! allocations take the last repetition's ids.
//!
//! "The state" is everything that decides what the following events do: the allocator's state key
//! ([`Allocator::steady_state_key`]: segments and blocks by address, pools, GC ages), the clocks, the
//! current phase, and the live allocations with their blocks, the ids of earlier repetitions named as
//! the next repetition names them. Where a part cannot be described (another allocator model, a kept
//! timeline for plots, string ids), every repetition is replayed: the result is the same either way.

use rustc_hash::FxHashMap;
use vramsim_traces::{AllocId, Event};

use super::peaks::Peaks;
use super::{phase_peaks, Flow, Live, Replay, ReplayError, ReplayOutcome, MAX_PHASE_MARKS};
use crate::allocator::{Allocator, Counters};
use crate::stats::MemoryStats;
use vramsim_traces::{renamed_id, EventView};

/// Events that repeat: `view`'s events `times` times in a row, the `k`-th repetition (from 0) being
/// those events (ids renamed and sizes replaced as the view says) with every integer id at or above
/// `renamed_from` (as the view names it) increased by `k × shift` (each repetition allocates its own
/// ids, and may free those of the repetition before it, `shift` ids earlier).
#[derive(Clone, Copy, Debug)]
pub struct Repeat<'a> {
    /// One repetition (the first).
    pub view: EventView<'a>,
    /// Repetitions in all (the first included).
    pub times: u64,
    /// The lowest integer id that is renamed from one repetition to the next.
    pub renamed_from: u64,
    /// How far each repetition moves the renamed ids.
    pub shift: u64,
}

impl Repeat<'_> {
    /// `id` (as written) as the `k`-th repetition names it.
    #[inline]
    pub fn id(&self, id: &AllocId, k: u64) -> AllocId {
        match id {
            AllocId::Int(i) => {
                let i = renamed_id(*i, self.view.renames);
                AllocId::Int(if i >= self.renamed_from {
                    i + k * self.shift
                } else {
                    i
                })
            }
            other => other.clone(),
        }
    }

    /// `event` as the `k`-th repetition has it, with `size` bytes if it is an allocation whose size
    /// the view replaces (without its tag, which a replay does not read).
    pub fn event(&self, event: &Event, size: Option<u64>, k: u64) -> Event {
        let mut e = event.with_id(|id| self.id(id, k)).without_tag();
        if let (Event::Alloc { size: written, .. }, Some(bytes)) = (&mut e, size) {
            *written = bytes;
        }
        e
    }

    /// Every event of every repetition, in order (what [`Replay::apply_repeated`] stands for).
    pub fn expand(&self) -> impl Iterator<Item = Event> + '_ {
        (0..self.times).flat_map(move |k| {
            self.view
                .sized()
                .map(move |(e, size)| self.event(e, size, k))
        })
    }

    /// The same repetitions, `times` of them.
    fn times(&self, times: u64) -> Self {
        Repeat { times, ..*self }
    }
}

/// The replays a repetition's counts part into, each with its flow.
type Forks<A> = Vec<(Replay<A>, Flow)>;

/// What a steady state's skip carried, per repetition: enough to tell the outcome of a run with more
/// repetitions of the same events ([`Replay::outcome_with_more`]).
#[derive(Clone, Debug)]
pub(super) struct Carried {
    /// The event index where the repetitions ended: more of them would go in here.
    at: u64,
    /// Events of one repetition.
    len: u64,
    /// `alloc` and `free` events of one repetition.
    allocs: u64,
    frees: u64,
    /// The allocator's statistics at two consecutive repetition boundaries (one repetition's growth).
    before: MemoryStats,
    after: MemoryStats,
    /// Each phase's starts in one repetition, by phase slot.
    occurrences: Vec<u64>,
    /// The phase starts of one repetition: (offset in it, name).
    marks: Vec<(u64, String)>,
    /// Repetitions in this run, and how many of them were replayed.
    times: u64,
    replayed: u64,
    /// The fewest repetitions a run of the same events can have for this replay to tell its outcome:
    /// the repetitions replayed (the state after the last equalled the state before it, so the run
    /// could end there or go on), or one fewer where the last of them raised no statistic's peak
    /// and started no new phase (the run could end before it: its state was already the steady
    /// one, and the peaks it leaves out are told by [`Carried::before_last`]).
    fewest: u64,
    /// The peaks of the stretch that ends with these repetitions (since the previous carried steady
    /// state, or the start), without the last repetition replayed and with it.
    before_last: Peaks,
    through_last: Peaks,
}

/// The state and counters at a repetition boundary.
struct Boundary {
    key: Vec<u64>,
    counters: Counters,
    allocs: u64,
    frees: u64,
    occurrences: Vec<u64>,
    /// The peaks since the previous carried steady state (or the start).
    window: Peaks,
}

impl<A: Allocator> Replay<A> {
    /// Applies `repeat.times` repetitions of `repeat.events` (as [`Repeat::expand`] lists them),
    /// skipping those that follow a steady state exactly (see the module documentation). Stops at an
    /// out-of-memory error as [`Replay::apply`] does.
    pub fn apply_repeated(&mut self, repeat: &Repeat) -> Result<Flow, ReplayError> {
        // one count forks nothing
        let (forks, flow) = self.repeat_counts(repeat, &[repeat.times], |_: &A| -> A {
            unreachable!("a single repetition count is never forked")
        })?;
        debug_assert!(forks.is_empty());
        Ok(flow)
    }

    /// [`Replay::apply_repeated`] for several repetition counts at once (`counts`, ascending and
    /// distinct; `repeat.times` is not read): the repetitions the counts share are applied once, and
    /// the replay is copied (its allocator through `fork`) where their runs part — where a count's
    /// repetitions end, and at the steady state, from which each count carries its own remaining
    /// repetitions. Returns, for each count in order, the replay as `apply_repeated` with that many
    /// repetitions leaves it, and its flow.
    pub fn apply_repeated_each(
        mut self,
        repeat: &Repeat,
        counts: &[u64],
        fork: impl Fn(&A) -> A,
    ) -> Result<Vec<(Replay<A>, Flow)>, ReplayError> {
        if counts.is_empty() {
            return Ok(Vec::new());
        }
        let (mut out, flow) = self.repeat_counts(repeat, counts, fork)?;
        out.push((self, flow));
        Ok(out)
    }

    /// The repetitions of `repeat` for each of `counts` (ascending, distinct, not empty), this replay
    /// going on as the largest: the other counts' replays (copies made where their runs part, in
    /// order), and this one's flow. What [`Replay::apply_repeated`] and
    /// [`Replay::apply_repeated_each`] share.
    fn repeat_counts(
        &mut self,
        repeat: &Repeat,
        counts: &[u64],
        fork: impl Fn(&A) -> A,
    ) -> Result<(Forks<A>, Flow), ReplayError> {
        let mut out = Vec::with_capacity(counts.len());
        let most = *counts.last().expect("a count");
        let split = |r: &Replay<A>| r.fork_with(fork(&r.allocator));
        let start = self.next_index;
        let mut previous: Option<Boundary> = None;
        let mut rest = counts;
        for k in 0..most {
            // the counts whose repetitions end here (the largest ends after the loop)
            while rest[0] == k {
                out.push((split(self), Flow::Continue));
                rest = &rest[1..];
            }
            let (&last, others) = rest.split_last().expect("the largest count is left");
            let capacity = previous.as_ref().map_or(0, |p| p.key.len());
            if let Some(now) = self.boundary(repeat, k, capacity) {
                if previous.as_ref().is_some_and(|p| p.key == now.key) {
                    let before = previous.expect("checked");
                    for &count in others {
                        let mut r = split(self);
                        r.skip(&repeat.times(count), k, start, &before, &now);
                        out.push((r, Flow::Continue));
                    }
                    self.skip(&repeat.times(last), k, start, &before, &now);
                    return Ok((out, Flow::Continue));
                }
                previous = Some(now);
            }
            if self.apply_shifted(&repeat.view, repeat.renamed_from, k * repeat.shift)?
                == Flow::Stopped
            {
                // every count left runs repetition k, and stops there
                for _ in others {
                    out.push((split(self), Flow::Stopped));
                }
                return Ok((out, Flow::Stopped));
            }
        }
        Ok((out, Flow::Continue))
    }

    /// Keeps, from here on, the peaks of each stretch between carried steady states (a little work
    /// per event after the first), so that [`Replay::outcome_with_more`] can tell runs that leave
    /// out a repetition that was replayed. Call it before the repetitions.
    pub fn keep_stretch_peaks(&mut self) {
        self.stretch_peaks = true;
    }

    /// How many repeats this replay carried (skipped from a steady state) so far.
    pub fn carried_repeats(&self) -> usize {
        self.carried.len()
    }

    /// The outcome this replay would reach, its remaining events applied as they were, if each
    /// repeat it carried had had `more` more repetitions (`more` < 0: fewer) — where that follows
    /// exactly from what the carried steady states did: every one of the run's `repeats` repeats
    /// carried (reached its steady state and skipped: more repetitions of a steady state do what
    /// the last one did, so each running total grows by `more` repetitions' growth and the events
    /// after it move on by `more` repetitions' length, peaks staying), no out-of-memory error, no
    /// timeline, phase marks below their cap. Fewer repetitions follow as exactly down to the
    /// repetitions replayed before the steady state showed, or one fewer where the last of them
    /// raised no statistic's peak and started no new phase (a run that stops at a steady state's
    /// boundary goes on as one that passes it): each running total then falls by their growth, their
    /// events and phase marks go, and the other peaks are those of the stretches the run keeps
    /// (before the repetitions it leaves out, and after them), one after the other, where the
    /// replay kept them ([`Replay::keep_stretch_peaks`]). `None` otherwise. What
    /// [`Replay::finish`] would report for a run of the same events with every repeat `more`
    /// repetitions longer (proptest `steady_state`).
    pub fn outcome_with_more(&self, more: i64, repeats: usize) -> Option<ReplayOutcome> {
        if self.carried.len() != repeats
            || self.oom.is_some()
            || self.sampler.capacity > 0
            || self.phase_marks.len() >= MAX_PHASE_MARKS
            || self.carried.iter().any(|c| {
                c.times
                    .checked_add_signed(more)
                    .is_none_or(|n| n < c.fewest)
            })
        {
            return None;
        }
        let mut stats = self.allocator.stats().clone();
        let (mut allocs, mut frees, mut events) = (self.allocs, self.frees, self.next_index);
        let mut phases = self.phases.clone();
        // `x` grown by `more` repetitions of `per` (within range: a run's totals are)
        let grown = |x: u64, per: u64| x.wrapping_add_signed((per as i64).wrapping_mul(more));
        for c in &self.carried {
            stats.add_repetitions(&c.before, &c.after, more);
            allocs = grown(allocs, c.allocs);
            frees = grown(frees, c.frees);
            events = grown(events, c.len);
            for (phase, per) in phases.iter_mut().zip(&c.occurrences) {
                phase.occurrences = grown(phase.occurrences, *per);
            }
        }
        // the event indices after each carried repeat move on by the repetitions added before them
        // (or back by those left out)
        let moved = |index: u64| -> u64 {
            self.carried
                .iter()
                .filter(|c| index >= c.at)
                .fold(index, |i, c| grown(i, c.len))
        };
        // the repetitions left out: the last ones before each carried repeat's end
        let left_out = |index: u64| -> bool {
            more < 0
                && self
                    .carried
                    .iter()
                    .any(|c| index < c.at && index >= c.at - c.len * more.unsigned_abs())
        };
        let added = more.max(0) as u64;
        let mut marks: Vec<(u64, String)> = Vec::with_capacity(self.phase_marks.len());
        let mut carried = self.carried.iter().peekable();
        for (index, name) in &self.phase_marks {
            while let Some(c) = carried.next_if(|c| c.at <= *index) {
                let start = moved(c.at) - c.len * added;
                for j in 0..added {
                    for (offset, name) in &c.marks {
                        marks.push((start + j * c.len + offset, name.clone()));
                    }
                }
            }
            if !left_out(*index) {
                marks.push((moved(*index), name.clone()));
            }
        }
        for c in carried {
            let start = moved(c.at) - c.len * added;
            for j in 0..added {
                for (offset, name) in &c.marks {
                    marks.push((start + j * c.len + offset, name.clone()));
                }
            }
        }
        marks.truncate(MAX_PHASE_MARKS);
        // the peaks: the whole replay's where every repetition replayed stays in the run (those
        // carried raise none), else those of the stretches the run keeps, one after the other
        let leaves_out = |c: &Carried| c.times.wrapping_add_signed(more) < c.replayed;
        let peaks = if self.carried.iter().any(leaves_out) {
            if !self.stretch_peaks {
                return None;
            }
            let kept = self.carried.iter().map(|c| match leaves_out(c) {
                true => &c.before_last,
                false => &c.through_last,
            });
            let last = self
                .window
                .as_ref()
                .expect("a carried repeat starts a stretch");
            kept.chain([last]).fold(Peaks::default(), |earlier, later| {
                earlier.then(later, moved)
            })
        } else {
            Peaks::default().then(&self.peaks, moved)
        };
        Some(ReplayOutcome {
            stats,
            events,
            allocs,
            frees,
            peak_device_used: peaks.device_used,
            categories_at_peak: peaks.categories,
            peak_allocated_event: peaks.allocated_event,
            allocated_at_reserved_peak: peaks.allocated_at_reserved,
            phases: phase_peaks(&phases, &peaks),
            phase_marks: marks,
            timeline: Vec::new(),
            oom: None,
            host_time_ns: self.timeline.now(),
        })
    }

    /// The state before repetition `k`, or `None` where it cannot be described (`capacity`: the
    /// words the key is expected to take, the previous boundary's).
    fn boundary(&self, repeat: &Repeat, k: u64, capacity: usize) -> Option<Boundary> {
        if self.sampler.capacity > 0 {
            return None;
        }
        // the live allocations, ids named as repetition k + 1 would name those of repetition k
        let first_renamed = repeat.renamed_from + k * repeat.shift;
        let mut live = Vec::with_capacity(self.live.len());
        // (name, entry's index): the renamed flag, the id and the index in 1 + 64 + 32 bits, sorted
        // as one integer
        let mut order: Vec<u128> = Vec::with_capacity(self.live.len());
        for (id, l) in &self.live {
            let AllocId::Int(i) = id else { return None };
            let (renamed, name) = if *i >= first_renamed {
                (1u128, i - k * repeat.shift)
            } else {
                (0, *i)
            };
            let addr = match l.block {
                Some(b) => self.allocator.block_address(b)?,
                None => u64::MAX,
            };
            let index = u32::try_from(live.len()).ok()?;
            order.push(renamed << 96 | u128::from(name) << 32 | u128::from(index));
            live.push([
                renamed as u64,
                name,
                l.size,
                l.category.index() as u64,
                addr,
            ]);
        }
        // the names are distinct (ids are, and a renamed id keeps its flag): sorting by them gives
        // the order of a sort by the whole entry
        order.sort_unstable();
        // the live allocations first (counted, so that the parts cannot run into each other), then
        // the clocks, the phase and the allocator's state, which reserves its own room (the
        // previous boundary's length, `capacity`, leaves nothing to grow)
        let mut key = Vec::with_capacity(capacity.max(64 + 5 * live.len()));
        key.push(live.len() as u64);
        for o in order {
            key.extend(live[(o as u32) as usize]);
        }
        self.timeline.steady_state_key(&mut key);
        key.push(self.current_phase.map_or(u64::MAX, |p| p as u64));
        if !self.allocator.steady_state_key(&mut key) {
            return None;
        }
        Some(Boundary {
            key,
            counters: self.allocator.counters(),
            allocs: self.allocs,
            frees: self.frees,
            occurrences: self.phases.iter().map(|p| p.occurrences).collect(),
            window: match self.stretch_peaks {
                true => self.window.as_ref().unwrap_or(&self.peaks).clone(),
                false => Peaks::default(),
            },
        })
    }

    /// Repetitions `k..times` start from the state repetition `k − 1` started from (`before`): they
    /// would do what it did. Carries their effect instead of replaying them.
    fn skip(&mut self, repeat: &Repeat, k: u64, start: u64, before: &Boundary, now: &Boundary) {
        let n = repeat.times - k;
        let len = repeat.view.events.len() as u64;
        // the last repetition replayed (k − 1) raised no statistic's peak and started no new phase
        let quiet = before.counters.stats.same_peaks(&now.counters.stats)
            && before.occurrences.len() == now.occurrences.len();
        self.carried.push(Carried {
            times: repeat.times,
            replayed: k,
            fewest: k - u64::from(quiet),
            before_last: before.window.clone(),
            through_last: now.window.clone(),
            at: self.next_index + n * len,
            len,
            allocs: self.allocs - before.allocs,
            frees: self.frees - before.frees,
            before: before.counters.stats.clone(),
            after: self.allocator.counters().stats,
            occurrences: self
                .phases
                .iter()
                .enumerate()
                .map(|(i, p)| p.occurrences - before.occurrences.get(i).copied().unwrap_or(0))
                .collect(),
            marks: repeat
                .view
                .events
                .iter()
                .enumerate()
                .filter_map(|(offset, e)| match e {
                    Event::Phase { name } => Some((offset as u64, name.to_string())),
                    _ => None,
                })
                .collect(),
        });
        self.allocs += (self.allocs - before.allocs) * n;
        self.frees += (self.frees - before.frees) * n;
        self.allocator.carry_repetitions(&before.counters, n);
        for (i, phase) in self.phases.iter_mut().enumerate() {
            let then = before.occurrences.get(i).copied().unwrap_or(0);
            phase.occurrences += (phase.occurrences - then) * n;
        }
        if self.phase_marks.len() < MAX_PHASE_MARKS {
            let marks: Vec<(u64, &str)> = repeat
                .view
                .events
                .iter()
                .enumerate()
                .filter_map(|(offset, e)| match e {
                    Event::Phase { name } => Some((offset as u64, &**name)),
                    _ => None,
                })
                .collect();
            'marks: for j in k..repeat.times {
                for &(offset, name) in &marks {
                    if self.phase_marks.len() >= MAX_PHASE_MARKS {
                        break 'marks;
                    }
                    self.phase_marks
                        .push((start + j * len + offset, name.to_string()));
                }
                if marks.is_empty() {
                    break;
                }
            }
        }
        self.next_index += n * len;
        // the next stretch's peaks start here
        if self.stretch_peaks {
            self.window = Some(Peaks::default());
        }
        // the live allocations of the last repetitions take the ids the last one gives them
        let first_renamed = repeat.renamed_from + k * repeat.shift;
        let live = std::mem::take(&mut self.live);
        let mut renamed: FxHashMap<AllocId, Live> =
            FxHashMap::with_capacity_and_hasher(live.len(), Default::default());
        for (id, mut l) in live {
            let id = match id {
                AllocId::Int(i) if i >= first_renamed => {
                    l.since += n * len;
                    AllocId::Int(i + n * repeat.shift)
                }
                other => other,
            };
            renamed.insert(id, l);
        }
        self.live = renamed;
    }
}
