//! The live allocations of a step walked in order, a repeated micro-batch's later repetitions
//! stepped over in one move.
//!
//! A step's compact form ([`crate::compact::CompactTrace`]) writes the third micro-batch of an
//! optimizer step once for the third to the last, right after the second, which it repeats (the
//! compact form's check): the `k`-th repetition allocates the same sizes, its own ids moved
//! `k × shift` up, and frees the same ids of its own and of the micro-batch before it (the ids it
//! takes), which were live or not as the second micro-batch's were for the first repetition. So each
//! repetition changes the live bytes by the same amounts: the requested-bytes curve of repetition `k`
//! is the first's, `k` times the net change of one repetition higher; and the allocations of
//! repetition `k` that outlive repetition `k + 1` are those of the second micro-batch that outlived
//! the first repetition, moved `k + 1` repetitions on. [`Walk`] walks the first repetition event by
//! event and steps over the rest with these rules: the same peak, live set, phase and event indices
//! as a walk of the expanded step, which the test `compact_lowering` checks against the expansion of
//! every zoo model and loop option, at the peak and at out-of-memory points.

use rustc_hash::FxHashMap;
use vramsim_traces::{renamed_id, AllocId, Event, EventView};

use crate::compact::RepeatSpan;

/// Consecutive events of a step: `view`, or, with `repeat`, `view` done `repeat.times` times, the
/// `k`-th time with every id (as `view` names it) at or above `repeat.renamed_from` moved
/// `k × repeat.shift` up.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stretch<'a> {
    /// The events.
    pub view: EventView<'a>,
    /// The repetition they are, if any.
    pub repeat: Option<RepeatSpan>,
}

/// An allocation's id in a walk: integer ids as the whole step names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key<'a> {
    Int(u64),
    Str(&'a str),
}

/// A live allocation: the event that made it, its index in the whole step, its requested bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Live<'a> {
    /// The allocation event (its tag and category).
    pub event: &'a Event,
    /// Its index in the whole step.
    pub index: usize,
    /// Requested bytes.
    pub size: u64,
}

/// The first highest live requested bytes met by a walk, and the index of the allocation that
/// reached it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Peak {
    /// Live requested bytes there.
    pub bytes: u64,
    /// Index (in the whole step) of the allocation that reached them.
    pub at: usize,
}

/// What a walk has seen: the live allocations and their requested bytes, the index of the next
/// event, the last phase marker, and (when tracked) the peak.
#[derive(Debug, Default)]
pub(crate) struct Walk<'a> {
    live: FxHashMap<Key<'a>, Live<'a>>,
    /// Live requested bytes (PyTorch's `requested_bytes.all.current`).
    pub current: u64,
    /// Index of the next event in the whole step.
    pub index: usize,
    /// The last phase marker walked: its index and name.
    pub phase: Option<(usize, &'a str)>,
    /// The peak, when the walk tracks it.
    pub peak: Option<Peak>,
}

/// Requested bytes through one walked repetition: the bytes before and after it, and its first
/// highest point after an allocation (bytes, index).
#[derive(Clone, Copy, Debug)]
struct RepetitionCurve {
    /// Live requested bytes before the repetition.
    before: u64,
    /// Live requested bytes after it.
    after: u64,
    /// Its first highest point after an allocation: bytes and index in the whole step.
    top: Option<(u64, usize)>,
}

impl<'a> Walk<'a> {
    /// A walk from the step's start; `track_peak` makes it record [`Walk::peak`].
    pub fn new(track_peak: bool) -> Walk<'a> {
        Walk {
            peak: track_peak.then(Peak::default),
            ..Walk::default()
        }
    }

    /// The allocations live now.
    pub fn live(&self) -> impl Iterator<Item = &Live<'a>> {
        self.live.values()
    }

    /// Walks `stretches` in order up to (not including) the event of index `stop` in the whole step.
    pub fn run(&mut self, stretches: &[Stretch<'a>], stop: usize) {
        for s in stretches {
            if self.index >= stop {
                return;
            }
            match s.repeat {
                None => {
                    self.events(&s.view, None, stop);
                }
                Some(r) => self.repetitions(&s.view, &r, stop),
            }
        }
    }

    /// Walks `view`'s events (as repetition `k` of `repeat`, where given) up to index `stop`;
    /// returns the repetition's requested-bytes curve.
    fn events(
        &mut self,
        view: &EventView<'a>,
        repeat: Option<(&RepeatSpan, u64)>,
        stop: usize,
    ) -> RepetitionCurve {
        let mut curve = RepetitionCurve {
            before: self.current,
            after: self.current,
            top: None,
        };
        let key = |id: &'a AllocId| match id {
            AllocId::Int(i) => {
                let mut out = renamed_id(*i, view.renames);
                if let Some((r, k)) = repeat {
                    if out >= r.renamed_from {
                        out = out.wrapping_add(k.wrapping_mul(r.shift));
                    }
                }
                Key::Int(out)
            }
            AllocId::Str(s) => Key::Str(s),
        };
        for (e, size) in view.sized() {
            if self.index >= stop {
                break;
            }
            match e {
                Event::Alloc { id, size: own, .. } => {
                    let size = size.unwrap_or(*own);
                    let live = Live {
                        event: e,
                        index: self.index,
                        size,
                    };
                    self.live.insert(key(id), live);
                    self.current = self.current.saturating_add(size);
                    if curve.top.is_none_or(|(b, _)| self.current > b) {
                        curve.top = Some((self.current, self.index));
                    }
                    if let Some(p) = &mut self.peak {
                        if self.current > p.bytes {
                            *p = Peak {
                                bytes: self.current,
                                at: self.index,
                            };
                        }
                    }
                }
                Event::Free { id } => {
                    let freed = self.live.remove(&key(id)).map_or(0, |l| l.size);
                    self.current -= freed;
                }
                Event::Phase { name } => self.phase = Some((self.index, name)),
                _ => {}
            }
            self.index += 1;
        }
        curve.after = self.current;
        curve
    }

    /// Walks `view` done `r.times` times up to index `stop`: the first repetition event by event,
    /// the whole ones after it in one move (see the module documentation), then the one `stop`
    /// falls in.
    fn repetitions(&mut self, view: &EventView<'a>, r: &RepeatSpan, stop: usize) {
        let len = view.events.len();
        if len == 0 {
            return;
        }
        let start = self.index;
        let mut k = 0;
        let mut first: Option<RepetitionCurve> = None;
        while k < r.times && self.index < stop {
            if let (1, Some(first)) = (k, first) {
                // repetitions 1.. wholly before `stop`
                let whole = ((stop - start) / len).min(r.times as usize);
                let n = whole.saturating_sub(1) as u64;
                if n > 0 && self.step_over(r, len, n, first) {
                    k += n;
                    continue;
                }
            }
            let curve = self.events(view, Some((r, k)), stop);
            if k == 0 {
                first = Some(curve);
            }
            k += 1;
        }
    }

    /// Steps from the end of repetition 0 over `n` whole repetitions (1 to `n`) of `len` events,
    /// the first's curve being `first`: false, walking nothing, if a count does not fit.
    fn step_over(&mut self, r: &RepeatSpan, len: usize, n: u64, first: RepetitionCurve) -> bool {
        let growth = i128::from(first.after) - i128::from(first.before);
        let current = i128::from(self.current) + i128::from(n) * growth;
        let Ok(current) = u64::try_from(current) else {
            return false;
        };
        let Some(moved_events) = (n as usize).checked_mul(len) else {
            return false;
        };
        // The last repetition stepped over peaks highest when each adds bytes.
        if let (Some(p), Some((top, at)), true) = (&mut self.peak, first.top, growth > 0) {
            let bytes = i128::from(top) + i128::from(n) * growth;
            let Ok(bytes) = u64::try_from(bytes) else {
                return false;
            };
            if bytes > p.bytes {
                *p = Peak {
                    bytes,
                    at: at + moved_events,
                };
            }
        }
        // Ids the micro-batch before the repetitions allocates, and then repetition k:
        // [from + k × shift, from + (k + 1) × shift) (k = 0 for that micro-batch).
        let own = |k: u64, id: u64| {
            let lo = r.renamed_from.wrapping_add(k.wrapping_mul(r.shift));
            id.wrapping_sub(lo) < r.shift
        };
        let moved = |&(id, l): &(u64, Live<'a>), j: u64| {
            (
                Key::Int(id.wrapping_add(j.wrapping_mul(r.shift))),
                Live {
                    index: l.index + j as usize * len,
                    ..l
                },
            )
        };
        let of = |k: u64| -> Vec<(u64, Live<'a>)> {
            self.live
                .iter()
                .filter_map(|(key, l)| match *key {
                    Key::Int(i) if own(k, i) => Some((i, *l)),
                    _ => None,
                })
                .collect()
        };
        // The micro-batch before's allocations that outlived the first repetition outlive every
        // later one (as those of each repetition outlive the next); the first's live ones are the
        // last's, `n` repetitions on.
        let (kept, first_live) = (of(0), of(1));
        for (id, _) in &first_live {
            self.live.remove(&Key::Int(*id));
        }
        for j in 1..=n {
            self.live.extend(kept.iter().map(|e| moved(e, j)));
        }
        self.live.extend(first_live.iter().map(|e| moved(e, n)));
        if let Some((i, name)) = self.phase {
            if i >= self.index - len {
                self.phase = Some((i + moved_events, name));
            }
        }
        self.current = current;
        self.index += moved_events;
        true
    }
}
