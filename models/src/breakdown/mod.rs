//! What is live at the peak of a lowered trace, and whose it is.
//!
//! [`peak_breakdown`] walks a trace (no allocator involved), finds the first event where the sum of
//! live requested bytes is highest — PyTorch's `requested_bytes.all.peak`, which the caching
//! allocator's `allocated_bytes` peak follows up to rounding — and groups the allocations live there
//! by category and by module. The module of an allocation comes from its tag: `module.path:aten.op`
//! for ops, the parameter's module for parameters (`transformer.h.0.attn.c_attn.weight`), their
//! gradients (`grad:NAME`) and optimizer state (`exp_avg:NAME`), `buffer:NAME` for buffers,
//! `input:NAME` for inputs (module `(inputs)`), and a bare `aten.op` for code at the top level of
//! the step (the loss, the autograd engine, the optimizer's temporaries: module `(top level)`).
//! Modules are grouped at their repeated block (`transformer.h.3`, `model.layers.31`,
//! `bert.encoder.layer.11`, `layer4.1`: the path up to its first numbered component), else at their
//! first two components (`transformer.wte`, `cls.predictions`).

mod walk;

use std::collections::HashMap;

use serde_json::{Map, Value};
use vramsim_traces::{Category, Event, EventView, Trace};

use crate::compact::{CompactTrace, ReplayPiece};
use walk::{Stretch, Walk};

/// The live allocations at the peak of requested bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct PeakBreakdown {
    /// Live requested bytes at the peak (for [`peak_breakdown_until`], at the failing allocation).
    pub peak_requested: u64,
    /// Index (in `trace.events`) of the allocation that reached it first.
    pub event_index: usize,
    /// The phase the peak is in (`forward`, `backward`, `optimizer`, ...), if the trace marks phases.
    pub phase: Option<String>,
    /// Which optimizer step the peak is in (1 for the first), from the trace's `meta.phases` if
    /// present.
    pub iteration: Option<u64>,
    /// Bytes by category, in [`Category::ALL`] order, categories with no bytes left out.
    pub by_category: Vec<(Category, u64)>,
    /// Bytes by module group, largest first.
    pub by_module: Vec<ModuleBytes>,
    /// The largest live allocations, largest first (at most [`LARGEST`]).
    pub largest: Vec<Allocation>,
}

/// One module group's share of the peak.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleBytes {
    /// The group (`transformer.h.3`, `(top level)`, `(inputs)`).
    pub module: String,
    /// Live bytes.
    pub bytes: u64,
    /// Live allocations.
    pub allocations: u64,
    /// Bytes by category, in [`Category::ALL`] order, categories with no bytes left out.
    pub by_category: Vec<(Category, u64)>,
}

/// One live allocation.
#[derive(Clone, Debug, PartialEq)]
pub struct Allocation {
    /// Its tag.
    pub tag: String,
    /// Requested bytes.
    pub bytes: u64,
    /// Category.
    pub category: Category,
}

/// How many of the largest allocations [`PeakBreakdown::largest`] keeps.
pub const LARGEST: usize = 10;

/// The live set at the first maximum of live requested bytes (see the module documentation).
/// Frees of unknown ids are ignored.
pub fn peak_breakdown(trace: &Trace) -> PeakBreakdown {
    breakdown(&[whole(trace)], &trace.meta, trace.events.len(), true)
}

/// What was live when an out-of-memory error was raised at event `end - 1` (the failing allocation
/// included), over the first `end` events: not the highest point before it, which a step that runs
/// out of memory in a later iteration, through fragmentation, passed with less live. Empty for
/// `end == 0`.
pub fn peak_breakdown_until(trace: &Trace, end: usize) -> PeakBreakdown {
    breakdown(
        &[whole(trace)],
        &trace.meta,
        end.min(trace.events.len()),
        false,
    )
}

impl CompactTrace {
    /// [`peak_breakdown`] of the step this stands for ([`CompactTrace::expand`]), without
    /// expanding it: its repeated micro-batches are walked twice and stepped over
    /// (`walk`).
    pub fn peak_breakdown(&self) -> PeakBreakdown {
        let pieces = self.replay_pieces();
        breakdown(&stretches(self, &pieces), &self.meta, self.events, true)
    }

    /// [`peak_breakdown_until`] of the step this stands for, without expanding it.
    pub fn peak_breakdown_until(&self, end: usize) -> PeakBreakdown {
        let pieces = self.replay_pieces();
        breakdown(
            &stretches(self, &pieces),
            &self.meta,
            end.min(self.events),
            false,
        )
    }
}

/// A trace's events as one stretch.
fn whole(trace: &Trace) -> Stretch<'_> {
    Stretch {
        view: EventView {
            events: &trace.events,
            ..EventView::default()
        },
        repeat: None,
    }
}

/// A compact trace's replay pieces as stretches.
fn stretches<'a>(c: &'a CompactTrace, pieces: &'a [ReplayPiece]) -> Vec<Stretch<'a>> {
    pieces
        .iter()
        .map(|p| Stretch {
            view: c.piece_view(p),
            repeat: p.repeat,
        })
        .collect()
}

/// The live set over the first `end` events of `stretches` at their first maximum of live
/// requested bytes (`at_max`), else after the last of them.
fn breakdown(
    stretches: &[Stretch<'_>],
    meta: &Map<String, Value>,
    end: usize,
    at_max: bool,
) -> PeakBreakdown {
    // Pass 1: where is the point?
    let mut walk = Walk::new(at_max);
    walk.run(stretches, end);
    let (peak, at) = match walk.peak {
        Some(p) => (p.bytes, p.at),
        None => (walk.current, end.saturating_sub(1)),
    };
    // Pass 2: what is live there? (Nothing for no events.)
    let mut walk = Walk::new(false);
    walk.run(stretches, (at + 1).min(end));
    let mut cats = [0u64; Category::ALL.len()];
    // group -> (bytes, allocations, bytes by category, first event)
    let mut modules: HashMap<String, (u64, u64, [u64; Category::ALL.len()], usize)> =
        HashMap::new();
    let mut all: Vec<Allocation> = Vec::new();
    for live in walk.live() {
        if let Event::Alloc { category, tag, .. } = live.event {
            let (size, i) = (live.size, live.index);
            let tag = tag.as_deref().unwrap_or("");
            cats[category.index()] = cats[category.index()].saturating_add(size);
            let m = modules.entry(module_group(tag, *category)).or_insert((
                0,
                0,
                [0; Category::ALL.len()],
                i,
            ));
            m.0 = m.0.saturating_add(size);
            m.1 += 1;
            m.2[category.index()] = m.2[category.index()].saturating_add(size);
            m.3 = m.3.min(i);
            all.push(Allocation {
                tag: tag.to_string(),
                bytes: size,
                category: *category,
            });
        }
    }
    let nonzero = |c: &[u64; Category::ALL.len()]| -> Vec<(Category, u64)> {
        Category::ALL
            .iter()
            .zip(c.iter())
            .filter(|(_, b)| **b > 0)
            .map(|(c, b)| (*c, *b))
            .collect()
    };
    // Largest first; equal groups (the blocks of a stack) in the order they first allocated.
    let mut groups: Vec<(usize, ModuleBytes)> = modules
        .into_iter()
        .map(|(module, (bytes, allocations, c, first))| {
            (
                first,
                ModuleBytes {
                    module,
                    bytes,
                    allocations,
                    by_category: nonzero(&c),
                },
            )
        })
        .collect();
    groups.sort_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then(a.0.cmp(&b.0)));
    let by_module: Vec<ModuleBytes> = groups.into_iter().map(|(_, m)| m).collect();
    all.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.tag.cmp(&b.tag)));
    all.truncate(LARGEST);
    let phase = walk.phase;
    let iteration = phase.and_then(|(i, _)| phase_iteration(meta, i));
    PeakBreakdown {
        peak_requested: peak,
        event_index: at,
        phase: phase.map(|(_, n)| n.to_string()),
        iteration,
        by_category: nonzero(&cats),
        by_module,
        largest: all,
    }
}

/// The `iteration` of the `meta.phases` entry for the phase marker at event `i`.
fn phase_iteration(meta: &Map<String, Value>, i: usize) -> Option<u64> {
    meta.get("phases")?
        .as_array()?
        .iter()
        .find(|p| p["event"].as_u64() == Some(i as u64))?["iteration"]
        .as_u64()
        .map(|i| i + 1)
}

/// The module group an allocation's tag belongs to (see the module documentation).
pub fn module_group(tag: &str, category: Category) -> String {
    if tag.starts_with("input:") || category == Category::Input {
        return "(inputs)".into();
    }
    let path = match tag.split_once(':') {
        // `module.path:aten.op` (an op tag always names an ATen op after the colon).
        Some((module, op)) if op.starts_with("aten.") => module,
        // `grad:NAME`, `exp_avg:NAME`, `buffer:NAME`: a parameter's or buffer's name.
        Some((_, name)) => parent(name),
        // A parameter's own allocation is tagged with its name.
        None if category == Category::Parameter => parent(tag),
        None => "",
    };
    if path.is_empty() || path.starts_with("aten.") {
        return "(top level)".into();
    }
    let parts: Vec<&str> = path.split('.').collect();
    match parts.iter().position(|p| is_numbered(p)) {
        Some(k) => parts[..=k].join("."),
        None => parts[..parts.len().min(2)].join("."),
    }
}

/// `NAME` without its last component (a parameter's module).
fn parent(name: &str) -> &str {
    name.rsplit_once('.').map_or("", |(m, _)| m)
}

/// `3`, `encoder_layer_11`: a component that numbers a repeated block.
fn is_numbered(p: &str) -> bool {
    !p.is_empty()
        && (p.bytes().all(|b| b.is_ascii_digit())
            || p.rsplit_once('_')
                .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compact::RepeatSpan;
    use vramsim_traces::AllocId;

    #[test]
    fn an_oom_breakdown_is_what_is_live_at_the_failing_allocation() {
        let alloc = |id: u64, size: u64| Event::Alloc {
            id: id.into(),
            size,
            stream: Default::default(),
            category: Category::Activation,
            tag: Some(format!("m{id}:aten.empty").into()),
        };
        // 100 + 50 live, 100 freed, then 30 fails (fragmentation): 80 live at the error, at event 3.
        let trace = Trace::from_events(vec![
            alloc(1, 100),
            alloc(2, 50),
            Event::Free { id: 1u64.into() },
            alloc(3, 30),
        ]);
        let peak = peak_breakdown(&trace);
        assert_eq!((peak.peak_requested, peak.event_index), (150, 1));
        let oom = peak_breakdown_until(&trace, 4);
        assert_eq!((oom.peak_requested, oom.event_index), (80, 3));
        assert_eq!(oom.by_category, [(Category::Activation, 80)]);
        let empty = peak_breakdown_until(&trace, 0);
        assert_eq!((empty.peak_requested, empty.by_module.len()), (0, 0));
    }

    /// A repeated micro-batch walked twice and stepped over gives the breakdowns of its expansion,
    /// at the peak and at every event, when each repetition keeps an allocation (the live bytes
    /// grow: the peak is in the last one) and when it keeps none.
    #[test]
    fn stepping_over_repetitions_gives_the_expansions_breakdowns() {
        let alloc = |id: u64, size: u64, tag: &str| Event::Alloc {
            id: id.into(),
            size,
            stream: Default::default(),
            category: Category::Activation,
            tag: Some(format!("m.{tag}:aten.empty").into()),
        };
        let free = |id: u64| Event::Free { id: id.into() };
        let phase = |name: &str| Event::Phase { name: name.into() };
        for keeps in [false, true] {
            // the first micro-batch (ids below 10: its output 8), and the second (ids 10..),
            // which the repeated one repeats
            let mut before = vec![
                phase("forward"),
                alloc(1, 1000, "first"),
                alloc(8, 5, "out"),
                alloc(9, 7, "kept"),
                phase("backward"),
                alloc(10, 5, "out"),
                free(8),
                alloc(11, 7, "kept"),
            ];
            if !keeps {
                before.push(free(11));
            }
            // the repeated one as lowered: its own ids 12 and 13, taking 10 (the output before)
            let mut body = vec![phase("backward"), alloc(12, 5, "out"), free(10)];
            body.push(alloc(13, 7, "kept"));
            if !keeps {
                body.push(free(13));
            }
            // after it: the last output freed, a later allocation (id 14 as lowered)
            let after = vec![phase("optimizer"), free(12), alloc(14, 3, "late")];
            for times in 0..7u64 {
                // ids from 12 on move by (times − 1) × 2 after the repetitions
                let renames = [(12u64, times.wrapping_sub(1).wrapping_mul(2))];
                let r = RepeatSpan {
                    start: 0,
                    len: body.len(),
                    times,
                    renamed_from: 10,
                    shift: 2,
                };
                let stretches = [
                    Stretch {
                        view: EventView {
                            events: &before,
                            ..EventView::default()
                        },
                        repeat: None,
                    },
                    Stretch {
                        view: EventView {
                            events: &body,
                            ..EventView::default()
                        },
                        repeat: Some(r),
                    },
                    Stretch {
                        view: EventView {
                            events: &after,
                            renames: &renames,
                            ..EventView::default()
                        },
                        repeat: None,
                    },
                ];
                // the expansion, written out: repetition k's ids from 10 on moved by 2k
                let rename = |e: &Event, by: u64| {
                    e.with_id(|id| match id {
                        AllocId::Int(i) if *i >= 10 => i.wrapping_add(by).into(),
                        other => other.clone(),
                    })
                };
                let mut events = before.clone();
                for k in 0..times {
                    events.extend(body.iter().map(|e| rename(e, 2 * k)));
                }
                let by = times.wrapping_sub(1).wrapping_mul(2);
                events.extend(after.iter().map(|e| match e {
                    Event::Alloc {
                        id: AllocId::Int(i),
                        ..
                    }
                    | Event::Free {
                        id: AllocId::Int(i),
                    } if *i >= 12 => rename(e, by),
                    other => other.clone(),
                }));
                let trace = Trace::from_events(events);
                let n = trace.events.len();
                let meta = Map::new();
                let what = format!("keeps {keeps}, times {times}");
                assert_eq!(
                    breakdown(&stretches, &meta, n, true),
                    peak_breakdown(&trace),
                    "{what}"
                );
                for end in 0..=n {
                    assert_eq!(
                        breakdown(&stretches, &meta, end, false),
                        peak_breakdown_until(&trace, end),
                        "{what}, until {end}"
                    );
                }
                // 1,019 B after the second micro-batch; each repetition frees 5 B and adds 5 and
                // 7 (keeping the 7): the last one peaks at 1,019 + 7 × times, at its kept
                // allocation
                if keeps {
                    let peak = breakdown(&stretches, &meta, n, true);
                    assert_eq!(peak.peak_requested, 1019 + 7 * times);
                    assert_eq!(peak.event_index, 8 + 4 * times as usize - 1);
                }
            }
        }
    }

    #[test]
    fn tags_group_at_their_block() {
        let g = |t: &str, c: Category| module_group(t, c);
        assert_eq!(
            g("transformer.h.3.attn:aten.bmm", Category::Activation),
            "transformer.h.3"
        );
        assert_eq!(
            g(
                "grad:model.layers.31.mlp.up_proj.weight",
                Category::Gradient
            ),
            "model.layers.31"
        );
        assert_eq!(
            g("exp_avg:lm_head.weight", Category::OptimizerState),
            "lm_head"
        );
        assert_eq!(
            g("transformer.wte.weight", Category::Parameter),
            "transformer.wte"
        );
        assert_eq!(
            g("buffer:layer1.0.bn1.running_mean", Category::Other),
            "layer1.0"
        );
        assert_eq!(g("input:input_ids", Category::Input), "(inputs)");
        assert_eq!(g("aten._log_softmax", Category::Activation), "(top level)");
        assert_eq!(g("grad:fc.weight", Category::Gradient), "fc");
        assert_eq!(
            g(
                "encoder.layers.encoder_layer_11.mlp.0:aten.addmm",
                Category::Activation
            ),
            "encoder.layers.encoder_layer_11"
        );
        assert_eq!(
            g(
                "cls.predictions.transform.dense:aten.addmm",
                Category::Activation
            ),
            "cls.predictions"
        );
        assert_eq!(
            g("CrossEntropyLoss:aten._log_softmax", Category::Activation),
            "CrossEntropyLoss"
        );
    }
}
