//! Gradient accumulation lowered once per repeated micro-step: a step of `accum` micro-batches is
//! lowered with three, and the third micro-batch stands for the third to the last.
//!
//! From the second micro-batch of an optimizer step on, the training loop does the same thing again
//! (`forward`, `backward` into gradients that exist already, the previous micro-batch's kept outputs
//! freed): the lowering makes the same events, each micro-batch allocating its own ids and freeing the
//! previous one's. [`lower_compact`] lowers three micro-batches per optimizer step and checks that the
//! third is the second again, every event equal (op, size, stream, category, tag) with the ids
//! renamed consistently: the second's own ids moved by the ids one micro-batch allocates, those it
//! takes from the first (kept outputs it frees) mapped one-to-one onto those the third takes from the
//! second, every other id the same. Where the check fails, the whole step is lowered as it is.
//! [`CompactTrace::expand`] writes the events a lowering of all `accum` micro-batches makes: the
//! third micro-batch's events once per micro-batch, its ids renamed as the replay engine's `Repeat`
//! renames them, and the
//! later events' ids moved past the added micro-batches (ids are handed out in order). The equality
//! with a fresh lowering, byte for byte, is the test `compact_lowering` (every zoo model and recipe
//! option that touches the loop), not this module's check.
//!

use rustc_hash::FxHashMap;
use std::borrow::Cow;
use std::sync::Arc;

use serde_json::{Map, Value};
use vramsim_traces::{renamed_id, AllocId, Event, EventView, Trace};

use crate::graph::Graph;
use crate::lower::{lower, LowerError};
use crate::recipe::Recipe;

/// Micro-batches lowered per optimizer step when the step has more: the first (which creates the
/// gradients), the second (the first repetition) and the third (checked to equal the second).
const LOWERED_MICRO_BATCHES: u32 = 3;

/// One micro-batch that stands for several: `events[start..start + len]` of the compact trace, done
/// `times` times in a row, the `k`-th time (from 0) with every id at or above `renamed_from` moved by
/// `k × shift`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RepeatSpan {
    /// Index of its first event in the compact trace.
    pub start: usize,
    /// Events of one micro-batch.
    pub len: usize,
    /// Micro-batches it stands for.
    pub times: u64,
    /// The lowest id renamed from one micro-batch to the next (the first id of the micro-batch before).
    pub renamed_from: u64,
    /// Ids one micro-batch allocates.
    pub shift: u64,
}

/// A lowered step with its repeated micro-batches written once.
///
/// The lowered events are shared (an `Arc`) by the steps made from them without lowering — the same
/// step at another accumulation count ([`CompactTrace::with_accum`]) or batch size
/// ([`crate::template::BatchTemplate::instantiate`]) — which differ in their repetitions, their
/// `meta` and the sizes of some allocations ([`CompactTrace::sizes`]), so that making one copies no
/// event, and a replay reads the shared events through an [`EventView`].
#[derive(Clone, Debug)]
pub struct CompactTrace {
    /// The events lowered (with three micro-batches per optimizer step where `repeats` is not empty),
    /// each allocation's size as lowered unless `sizes` lists it.
    lowered: Arc<Vec<Event>>,
    /// (event index, requested bytes) of the allocations whose size is not the lowered one, by index.
    sizes: Arc<Vec<(usize, u64)>>,
    /// The `meta` of the whole step (its `accum`, `recipe` and `phases` as a full lowering writes
    /// them).
    pub meta: Map<String, Value>,
    /// The repeated micro-batches, in trace order.
    pub repeats: Vec<RepeatSpan>,
    /// Events of the whole step.
    pub events: usize,
    /// `meta.phases` of the lowered events.
    lowered_phases: Arc<Vec<Value>>,
}

/// Events ready for a replay: a range of the lowered events, with the renames that name its ids as
/// the whole step does (the ids later micro-batches took moved past), and, with `repeat`, the events
/// of one micro-batch that stands for `repeat.times` (its `renamed_from` named as the whole step
/// names it). [`CompactTrace::piece_view`] gives the events.
#[derive(Clone, Debug)]
pub struct ReplayPiece {
    /// Where the events are in the lowered trace.
    pub range: (usize, usize),
    /// (from, by): the ids at or above `from` move up by `by` ([`renamed_id`]).
    pub renames: Vec<(u64, u64)>,
    /// The repetition these events are, if any.
    pub repeat: Option<RepeatSpan>,
}

impl CompactTrace {
    /// A trace without repetitions.
    pub fn plain(trace: Trace) -> CompactTrace {
        let events = trace.events.len();
        CompactTrace {
            lowered: Arc::new(trace.events),
            sizes: Arc::default(),
            meta: trace.meta,
            repeats: Vec::new(),
            events,
            lowered_phases: Arc::default(),
        }
    }

    /// The events lowered, with allocation sizes as lowered ([`CompactTrace::sizes`] says which
    /// differ).
    pub fn lowered_events(&self) -> &[Event] {
        &self.lowered
    }

    /// (event index, requested bytes) of the lowered allocations whose size in this step is not the
    /// lowered one, by index.
    pub fn sizes(&self) -> &[(usize, u64)] {
        &self.sizes
    }

    /// The lowered events, each with its size in this step where it is not the lowered one.
    pub fn sized_events(&self) -> impl Iterator<Item = (&Event, Option<u64>)> + '_ {
        self.view((0, self.lowered.len()), &[]).sized()
    }

    /// The same lowered events with other allocation sizes (`sizes`, by event index) and `meta`:
    /// the step at another batch size, sharing this one's events.
    pub fn with_sizes(&self, sizes: Vec<(usize, u64)>, meta: Map<String, Value>) -> CompactTrace {
        CompactTrace {
            sizes: Arc::new(sizes),
            meta,
            ..self.clone()
        }
    }

    /// Whether `other` is this step at another accumulation count: the same lowered events (shared,
    /// not equal: made from one lowering by [`CompactTrace::with_accum`]) and sizes, repeated in the
    /// same places (their counts may differ).
    pub fn same_lowering(&self, other: &CompactTrace) -> bool {
        let places = |c: &CompactTrace| -> Vec<(usize, usize, u64, u64)> {
            c.repeats
                .iter()
                .map(|r| (r.start, r.len, r.renamed_from, r.shift))
                .collect()
        };
        Arc::ptr_eq(&self.lowered, &other.lowered)
            && Arc::ptr_eq(&self.sizes, &other.sizes)
            && places(self) == places(other)
    }

    /// The lowered events in `range`, as a replay reads them: their sizes in this step, their ids
    /// renamed by `renames`.
    pub fn view<'a>(&'a self, range: (usize, usize), renames: &'a [(u64, u64)]) -> EventView<'a> {
        let lo = self.sizes.partition_point(|&(i, _)| i < range.0);
        let hi = self.sizes.partition_point(|&(i, _)| i < range.1);
        EventView {
            events: &self.lowered[range.0..range.1],
            sizes: &self.sizes[lo..hi],
            sizes_from: range.0,
            renames,
        }
    }

    /// The renames that apply after the first `j` repeats: ids at or above a repeat's `renamed_from`
    /// move by `(times − 1) × shift`, the ids its later micro-batches took.
    fn renames(&self, j: usize) -> Vec<(u64, u64)> {
        self.repeats[..j]
            .iter()
            .map(|r| (r.renamed_from, added_ids(r)))
            .collect()
    }

    /// The compact trace as pieces to replay in order: events, then each repeated micro-batch, then
    /// the events after it.
    pub fn replay_pieces(&self) -> Vec<ReplayPiece> {
        let mut pieces = Vec::new();
        let mut at = 0;
        for (j, r) in self.repeats.iter().enumerate() {
            let renames = self.renames(j);
            let repeat = RepeatSpan {
                renamed_from: rename_id(r.renamed_from, &renames, None),
                ..*r
            };
            pieces.push(ReplayPiece {
                range: (at, r.start),
                renames: renames.clone(),
                repeat: None,
            });
            pieces.push(ReplayPiece {
                range: (r.start, r.start + r.len),
                renames,
                repeat: Some(repeat),
            });
            at = r.start + r.len;
        }
        pieces.push(ReplayPiece {
            range: (at, self.lowered.len()),
            renames: self.renames(self.repeats.len()),
            repeat: None,
        });
        pieces
    }

    /// The events of `piece`, one of [`CompactTrace::replay_pieces`].
    pub fn piece_view<'a>(&'a self, piece: &'a ReplayPiece) -> EventView<'a> {
        self.view(piece.range, &piece.renames)
    }

    /// The lowered event that event `index` of the whole step is written as (its id as lowered;
    /// its size as lowered unless [`CompactTrace::sizes`] lists it); `None` past the step's end.
    pub fn lowered_event_at(&self, index: usize) -> Option<&Event> {
        let mut at = 0;
        let mut left = index;
        for r in &self.repeats {
            let before = r.start - at;
            if left < before {
                return self.lowered.get(at + left);
            }
            left -= before;
            let repeated = (r.times as usize).saturating_mul(r.len);
            if left < repeated {
                return self.lowered.get(r.start + left % r.len);
            }
            left -= repeated;
            at = r.start + r.len;
        }
        self.lowered.get(at + left)
    }

    /// `meta.phases` of the lowered events (of three micro-batches per step where there are repeats).
    pub(crate) fn lowered_phases(&self) -> &[Value] {
        &self.lowered_phases
    }

    /// The step as a full lowering writes it.
    pub fn expand(&self) -> Trace {
        let sized = |e: &Event, size: Option<u64>| sized_event((e, size)).into_owned();
        let mut events = Vec::with_capacity(self.events);
        let mut at = 0;
        let mut renames: Vec<(u64, u64)> = Vec::new();
        let no_renames: &[(u64, u64)] = &[];
        for r in &self.repeats {
            events.extend(
                self.view((at, r.start), no_renames)
                    .sized()
                    .map(|(e, size)| rename_event(&sized(e, size), &renames, None)),
            );
            let body: Vec<Event> = self
                .view((r.start, r.start + r.len), no_renames)
                .sized()
                .map(|(e, size)| sized(e, size))
                .collect();
            for k in 0..r.times {
                events.extend(body.iter().map(|e| rename_event(e, &renames, Some((r, k)))));
            }
            renames.push((r.renamed_from, added_ids(r)));
            at = r.start + r.len;
        }
        events.extend(
            self.view((at, self.lowered.len()), no_renames)
                .sized()
                .map(|(e, size)| rename_event(&sized(e, size), &renames, None)),
        );
        Trace {
            meta: self.meta.clone(),
            events,
        }
    }
}

/// The ids a repeat's later micro-batches allocate beyond the one written, `(times − 1) × shift`,
/// modulo 2^64: a repeat done no time (two micro-batches) gives back the ids of the one written, and
/// the later ids move back (the renames of [`renamed_id`] add modulo 2^64).
fn added_ids(r: &RepeatSpan) -> u64 {
    r.times.wrapping_sub(1).wrapping_mul(r.shift)
}

/// An event with the size it has in a step ([`CompactTrace::sized_events`]): borrowed where it is
/// the lowered one.
pub(crate) fn sized_event((e, size): (&Event, Option<u64>)) -> Cow<'_, Event> {
    match (e, size) {
        (Event::Alloc { .. }, Some(bytes)) => {
            let mut e = e.clone();
            if let Event::Alloc { size, .. } = &mut e {
                *size = bytes;
            }
            Cow::Owned(e)
        }
        _ => Cow::Borrowed(e),
    }
}

/// `id` after the renames of earlier repeats, then (inside a repeat) as its `k`-th micro-batch names it.
pub fn rename_id(id: u64, renames: &[(u64, u64)], repeat: Option<(&RepeatSpan, u64)>) -> u64 {
    let mut out = renamed_id(id, renames);
    if let Some((r, k)) = repeat {
        if id >= r.renamed_from {
            out += k * r.shift;
        }
    }
    out
}

fn rename_event(e: &Event, renames: &[(u64, u64)], repeat: Option<(&RepeatSpan, u64)>) -> Event {
    e.with_id(|id| match id {
        AllocId::Int(i) => AllocId::Int(rename_id(*i, renames, repeat)),
        other => other.clone(),
    })
}

/// Lowers `recipe`'s step of `graph` with each optimizer step's third to last micro-batches written
/// once (see the module documentation); the same as [`lower`] where the step has three micro-batches
/// or fewer, or where the third is not the second again.
pub fn lower_compact(graph: &Graph, recipe: &Recipe) -> Result<CompactTrace, LowerError> {
    // A pipeline rank's micro-batches are its schedule's, not accumulation steps: lowered whole.
    if recipe.accum <= LOWERED_MICRO_BATCHES || recipe.parallel.pp > 1 {
        return Ok(CompactTrace::plain(lower(graph, recipe)?));
    }
    let mut three = recipe.clone();
    three.accum = LOWERED_MICRO_BATCHES;
    let trace = lower(graph, &three)?;
    match compact(trace, recipe) {
        Some(c) => Ok(c),
        None => Ok(CompactTrace::plain(lower(graph, recipe)?)),
    }
}

/// The event ranges of micro-batches 0, 1 and 2 of each optimizer step, from `meta.phases`.
fn micro_ranges(trace: &Trace) -> Option<Vec<[(usize, usize); 3]>> {
    let phases = trace.meta.get("phases")?.as_array()?;
    let entry = |p: &Value| -> Option<(u64, u64, usize, String)> {
        Some((
            p.get("iteration")?.as_u64()?,
            p.get("micro_batch")?.as_u64()?,
            p.get("event")?.as_u64()? as usize,
            p.get("phase")?.as_str()?.to_string(),
        ))
    };
    let entries: Vec<_> = phases.iter().map(entry).collect::<Option<_>>()?;
    let iterations = trace.meta.get("iterations")?.as_u64()?;
    let mut out = Vec::new();
    for it in 0..iterations {
        let mut ranges = [(0usize, 0usize); 3];
        for (m, range) in ranges.iter_mut().enumerate() {
            let first = entries
                .iter()
                .position(|(i, mb, _, name)| *i == it && *mb == m as u64 && name == "forward")?;
            let end = entries[first..]
                .iter()
                .find(|(i, mb, _, name)| *i != it || *mb != m as u64 || name == "optimizer")
                .map_or(trace.events.len(), |e| e.2);
            *range = (entries[first].2, end);
        }
        out.push(ranges);
    }
    Some(out)
}

/// The first integer id allocated in `events`.
fn first_alloc(events: &[Event]) -> Option<u64> {
    events.iter().find_map(|e| match e {
        Event::Alloc {
            id: AllocId::Int(i),
            ..
        } => Some(*i),
        _ => None,
    })
}

fn int_ids(e: &Event) -> Option<Option<u64>> {
    match e {
        Event::Alloc { id, .. } | Event::Free { id } | Event::RecordStream { id, .. } => match id {
            AllocId::Int(i) => Some(Some(*i)),
            AllocId::Str(_) => None,
        },
        _ => Some(None),
    }
}

/// Whether micro-batch 2 (`third`) is micro-batch 1 (`second`) again: equal events with the ids
/// renamed consistently (see the module documentation). `from` are the first ids of micro-batches
/// 0, 1 and 2.
fn repeats_itself(second: &[Event], third: &[Event], from: [u64; 3]) -> bool {
    if second.len() != third.len() {
        return false;
    }
    let shift = from[2] - from[1];
    let mut taken: FxHashMap<u64, u64> = FxHashMap::default();
    for (a, b) in second.iter().zip(third) {
        let (Some(ia), Some(ib)) = (int_ids(a), int_ids(b)) else {
            return false;
        };
        let ids_match = match (ia, ib) {
            (None, None) => true,
            (Some(y), Some(z)) if y >= from[1] => y < from[2] && z == y + shift,
            (Some(y), Some(z)) if y == z => !taken.contains_key(&y),
            (Some(y), Some(z)) => {
                (from[0]..from[1]).contains(&y)
                    && (from[1]..from[2]).contains(&z)
                    && *taken.entry(y).or_insert(z) == z
            }
            _ => false,
        };
        if !ids_match {
            return false;
        }
        let same = match (a, b) {
            (
                Event::Alloc {
                    size,
                    stream,
                    category,
                    tag,
                    ..
                },
                Event::Alloc {
                    size: s2,
                    stream: st2,
                    category: c2,
                    tag: t2,
                    ..
                },
            ) => size == s2 && stream == st2 && category == c2 && tag == t2,
            (Event::Free { .. }, Event::Free { .. }) => true,
            (Event::RecordStream { stream, .. }, Event::RecordStream { stream: s2, .. }) => {
                stream == s2
            }
            (a, b) => a == b,
        };
        if !same {
            return false;
        }
    }
    true
}

/// The compact form of a three-micro-batch lowering standing for `recipe.accum` micro-batches.
fn compact(trace: Trace, recipe: &Recipe) -> Option<CompactTrace> {
    let ranges = micro_ranges(&trace)?;
    let mut repeats = Vec::new();
    for [m0, m1, m2] in ranges {
        let events = &trace.events;
        let f1 = first_alloc(&events[m1.0..m1.1]);
        let f2 = first_alloc(&events[m2.0..m2.1]);
        let (from1, from2) = match (f1, f2) {
            (Some(a), Some(b)) if b >= a => (a, b),
            (None, None) => (u64::MAX, u64::MAX),
            _ => return None,
        };
        let from0 = first_alloc(&events[m0.0..m0.1]).unwrap_or(from1);
        if !repeats_itself(
            &events[m1.0..m1.1],
            &events[m2.0..m2.1],
            [from0, from1, from2],
        ) {
            return None;
        }
        repeats.push(RepeatSpan {
            start: m2.0,
            len: m2.1 - m2.0,
            times: 1,
            renamed_from: from1,
            shift: if from1 == u64::MAX { 0 } else { from2 - from1 },
        });
    }
    let lowered_phases = Arc::new(trace.meta.get("phases")?.as_array()?.clone());
    let mut c = CompactTrace {
        lowered: Arc::new(trace.events),
        sizes: Arc::default(),
        meta: trace.meta,
        repeats,
        events: 0,
        lowered_phases,
    };
    c.set_accum(recipe)?;
    Some(c)
}

impl CompactTrace {
    /// The same step with `recipe.accum` micro-batches per optimizer step, where the compact form
    /// stands for several (`None` otherwise): the lowering of three micro-batches does not depend on
    /// how many there are beyond the first (the loss is divided by the accumulation steps whenever
    /// there are several, `fwd.rs`'s `finish_loss`), so one serves every count from two on — two
    /// being the third micro-batch done no time, the later events' ids moved back by the ids it
    /// allocates (test `compact_lowering`, against fresh lowerings of every count).
    /// `recipe` differs from the lowered one in `accum` only.
    pub fn with_accum(&self, recipe: &Recipe) -> Option<CompactTrace> {
        if self.repeats.is_empty() || recipe.accum < LOWERED_MICRO_BATCHES - 1 {
            return None;
        }
        // the meta but its phases, which `set_accum` writes anew (one entry per micro-batch's phase)
        let meta = self
            .meta
            .iter()
            .map(|(k, v)| match k.as_str() {
                "phases" => (k.clone(), Value::Null),
                _ => (k.clone(), v.clone()),
            })
            .collect();
        let mut c = CompactTrace {
            lowered: self.lowered.clone(),
            sizes: self.sizes.clone(),
            meta,
            repeats: self.repeats.clone(),
            events: self.events,
            lowered_phases: self.lowered_phases.clone(),
        };
        c.set_accum(recipe)?;
        Some(c)
    }

    /// Sets the repetitions, the event count and the whole step's meta (its accumulation, recipe name
    /// and phase list) for `recipe.accum` micro-batches.
    fn set_accum(&mut self, recipe: &Recipe) -> Option<()> {
        // the third micro-batch stands for the third to the last: none of them with two
        let times = u64::from((recipe.accum + 1).checked_sub(LOWERED_MICRO_BATCHES)?);
        for r in &mut self.repeats {
            r.times = times;
        }
        let repeats = &self.repeats;
        // events the repetitions add to (or, done no time, take from) the lowered ones
        let added = |r: &RepeatSpan| (r.times as isize - 1) * r.len as isize;
        let extra: isize = repeats.iter().map(added).sum();
        self.events = self.lowered.len().checked_add_signed(extra)?;
        let phases = &self.lowered_phases;
        let mut out = Vec::with_capacity(phases.len());
        let mut moved = 0isize;
        let mut i = 0;
        for r in repeats {
            // the phases before the repeated micro-batch, then its own once per micro-batch it
            // stands for
            while i < phases.len() && (phases[i].get("event")?.as_u64()? as usize) < r.start {
                out.push(moved_phase(&phases[i], moved, None)?);
                i += 1;
            }
            let first = i;
            while i < phases.len() && (phases[i].get("event")?.as_u64()? as usize) < r.start + r.len
            {
                i += 1;
            }
            for k in 0..r.times as usize {
                for p in &phases[first..i] {
                    out.push(moved_phase(p, moved + (k * r.len) as isize, Some(k))?);
                }
            }
            moved += added(r);
        }
        for p in &phases[i..] {
            out.push(moved_phase(p, moved, None)?);
        }
        let m = &mut self.meta;
        m.insert("accum".into(), recipe.accum.into());
        m.insert("recipe".into(), recipe.name().into());
        m.insert("phases".into(), Value::Array(out));
        Some(())
    }
}

/// A `meta.phases` entry moved `by` events later (earlier where negative) (and, for the `k`-th
/// repetition of the repeated micro-batch, numbered as that micro-batch).
fn moved_phase(p: &Value, by: isize, k: Option<usize>) -> Option<Value> {
    let mut q = p.clone();
    q["event"] = (p.get("event")?.as_u64()? as usize)
        .checked_add_signed(by)?
        .into();
    if let Some(k) = k {
        q["micro_batch"] = (LOWERED_MICRO_BATCHES as usize - 1 + k).into();
    }
    Some(q)
}
