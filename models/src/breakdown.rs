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

use std::collections::HashMap;
use vramsim_traces::{AllocId, Category, Event, Trace};

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
    breakdown(trace, trace.events.len(), true)
}

/// What was live when an out-of-memory error was raised at event `end - 1` (the failing allocation
/// included), over the first `end` events: not the highest point before it, which a step that runs
/// out of memory in a later iteration, through fragmentation, passed with less live. Empty for
/// `end == 0`.
pub fn peak_breakdown_until(trace: &Trace, end: usize) -> PeakBreakdown {
    breakdown(trace, end, false)
}

/// The live set over the first `end` events at their first maximum of live requested bytes
/// (`at_max`), else after the last of them.
fn breakdown(trace: &Trace, end: usize, at_max: bool) -> PeakBreakdown {
    let events = &trace.events[..end.min(trace.events.len())];
    // Pass 1: where is the point?
    let mut sizes: HashMap<&AllocId, u64> = HashMap::new();
    let (mut cur, mut peak, mut at) = (0u64, 0u64, 0usize);
    for (i, e) in events.iter().enumerate() {
        match e {
            Event::Alloc { id, size, .. } => {
                sizes.insert(id, *size);
                cur = cur.saturating_add(*size);
                if at_max && cur > peak {
                    peak = cur;
                    at = i;
                }
            }
            Event::Free { id } => cur -= sizes.remove(id).unwrap_or(0),
            _ => {}
        }
    }
    if !at_max {
        peak = cur;
        at = events.len().saturating_sub(1);
    }
    // Pass 2: what is live there? (Nothing for no events.)
    let mut live: HashMap<&AllocId, usize> = HashMap::new();
    let mut phase: Option<(usize, &str)> = None;
    for (i, e) in events.iter().enumerate().take(at + 1) {
        match e {
            Event::Alloc { id, .. } => {
                live.insert(id, i);
            }
            Event::Free { id } => {
                live.remove(id);
            }
            Event::Phase { name } => phase = Some((i, name)),
            _ => {}
        }
    }
    let mut cats = [0u64; Category::ALL.len()];
    // group -> (bytes, allocations, bytes by category, first event)
    let mut modules: HashMap<String, (u64, u64, [u64; Category::ALL.len()], usize)> =
        HashMap::new();
    let mut all: Vec<Allocation> = Vec::with_capacity(live.len());
    for &i in live.values() {
        if let Event::Alloc {
            size,
            category,
            tag,
            ..
        } = &events[i]
        {
            let tag = tag.as_deref().unwrap_or("");
            cats[category.index()] = cats[category.index()].saturating_add(*size);
            let m = modules.entry(module_group(tag, *category)).or_insert((
                0,
                0,
                [0; Category::ALL.len()],
                i,
            ));
            m.0 = m.0.saturating_add(*size);
            m.1 += 1;
            m.2[category.index()] = m.2[category.index()].saturating_add(*size);
            m.3 = m.3.min(i);
            all.push(Allocation {
                tag: tag.to_string(),
                bytes: *size,
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
    let iteration = phase.and_then(|(i, _)| phase_iteration(trace, i));
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
fn phase_iteration(trace: &Trace, i: usize) -> Option<u64> {
    trace
        .meta
        .get("phases")?
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
