//! Gradient accumulation lowered once per repeated micro-step (`compact::lower_compact`): the expanded
//! trace equals a fresh lowering of every micro-batch, event for event and in its `meta` (the byte-for-
//! byte JSON follows), for every zoo model, and for the recipe options that touch the training loop
//! (kept outputs, gradients zeroed in place, checkpointing of both kinds, AMP with a GradScaler,
//! clipping, persistent cuBLAS workspaces, cudnn.benchmark, more iterations, inference); and its
//! peak breakdowns, walked without expanding it, equal those of the expansion.

use vramsim_models::compact::{lower_compact, CompactTrace};
use vramsim_models::zoo::{self, NAMES};
use vramsim_models::{
    lower, peak_breakdown, peak_breakdown_until, CheckpointImpl, Checkpointing,
    CublasWorkspaceMode, Precision, Recipe, ZeroGrad,
};
use vramsim_traces::{Event, Trace};

fn recipe(name: &str, accum: u32) -> Recipe {
    let mut r = Recipe::new(2, 32);
    if zoo::Arch::from_name(name)
        .unwrap()
        .max_positions()
        .is_none()
    {
        r.seq = 0;
        if ["resnet", "vgg", "efficientnet", "convnext"]
            .iter()
            .any(|family| name.contains(family))
        {
            r.image_size = Some((64, 64));
        }
    }
    r.accum = accum;
    r
}

/// The expanded compact lowering equals the full one, and so do its forms for two and three
/// micro-batches (`with_accum`: the third micro-batch done no time, or once); returns whether
/// micro-batches were repeated.
fn check(name: &str, r: &Recipe) -> bool {
    let g = zoo::build(name, r).unwrap_or_else(|e| panic!("{name}: {e}"));
    let compact = lower_compact(&g, r).unwrap();
    same(name, &compact, &lower(&g, r).unwrap(), r);
    if !compact.repeats.is_empty() {
        for accum in [2, 3] {
            let fewer = Recipe { accum, ..r.clone() };
            let made = compact
                .with_accum(&fewer)
                .expect("a compact form serves 2 and 3");
            same(name, &made, &lower(&g, &fewer).unwrap(), &fewer);
        }
    }
    !compact.repeats.is_empty()
}

/// Asserts that `compact` expands to `full` (`r`'s fresh lowering), event for event, in its meta
/// and as JSON.
fn same(name: &str, compact: &CompactTrace, full: &vramsim_traces::Trace, r: &Recipe) {
    let expanded = compact.expand();
    assert_eq!(compact.events, full.events.len(), "{name} {}", r.name());
    assert_eq!(expanded.meta, full.meta, "{name} {}: meta", r.name());
    if let Some(i) = (0..full.events.len()).find(|&i| expanded.events[i] != full.events[i]) {
        panic!(
            "{name} {}: event {i}: {:?} != {:?}",
            r.name(),
            expanded.events[i],
            full.events[i]
        );
    }
    assert_eq!(expanded.events.len(), full.events.len());
    let json = |t: &vramsim_traces::Trace| {
        let mut out = Vec::new();
        vramsim_traces::write_json(&mut out, t).unwrap();
        out
    };
    assert!(json(&expanded) == json(full), "{name} {}: JSON", r.name());
    same_breakdowns(name, compact, &expanded, r);
}

/// The compact trace's breakdowns, at its peak and at out-of-memory points spread over the step,
/// equal those of its expansion, and each event index names the event the expansion has there.
fn same_breakdowns(name: &str, compact: &CompactTrace, expanded: &Trace, r: &Recipe) {
    let peak = peak_breakdown(expanded);
    assert_eq!(compact.peak_breakdown(), peak, "{name} {}: peak", r.name());
    let n = expanded.events.len();
    // nothing, half the step (inside a repetition where the step has many), just past the peak,
    // past the end
    for end in [0, n / 2, peak.event_index + 1, n + 1] {
        assert_eq!(
            compact.peak_breakdown_until(end),
            peak_breakdown_until(expanded, end),
            "{name} {}: until {end}",
            r.name()
        );
    }
    let tag = |e: &Event| match e {
        Event::Alloc { tag, category, .. } => Some((tag.clone(), *category)),
        _ => None,
    };
    for i in (0..n).step_by(97).chain([n.saturating_sub(1)]) {
        let at = compact.lowered_event_at(i).expect("within the step");
        assert_eq!(tag(at), tag(&expanded.events[i]), "{name}: event {i}");
    }
    assert!(compact.lowered_event_at(n).is_none());
}

#[test]
fn every_zoo_model_expands_to_its_full_lowering() {
    for name in NAMES {
        assert!(check(name, &recipe(name, 5)), "{name}: no repetition found");
    }
}

/// A change to a recipe.
type Change = Box<dyn Fn(&mut Recipe)>;

#[test]
fn loop_options_expand_to_their_full_lowering() {
    let variants: Vec<(&str, Change)> = vec![
        ("keep outputs", Box::new(|r| r.keep_outputs = true)),
        ("zero_grad zero", Box::new(|r| r.zero_grad = ZeroGrad::Zero)),
        (
            "full checkpointing",
            Box::new(|r| r.checkpointing = Checkpointing::Full),
        ),
        (
            "reentrant checkpointing",
            Box::new(|r| {
                r.checkpointing = Checkpointing::Every(2);
                r.checkpoint_impl = CheckpointImpl::Reentrant;
            }),
        ),
        (
            "selective",
            Box::new(|r| r.checkpointing = Checkpointing::Selective),
        ),
        ("amp-fp16", Box::new(|r| r.precision = Precision::AmpFp16)),
        ("amp-bf16", Box::new(|r| r.precision = Precision::AmpBf16)),
        ("bf16", Box::new(|r| r.precision = Precision::Bf16)),
        ("clip", Box::new(|r| r.clip_grad_norm = Some(1.0))),
        (
            "persistent cuBLAS",
            Box::new(|r| r.workspaces.cublas_mode = CublasWorkspaceMode::Persistent),
        ),
        (
            "cudnn.benchmark",
            Box::new(|r| r.workspaces.cudnn_benchmark = true),
        ),
        ("3 iterations", Box::new(|r| r.iterations = 3)),
        ("1 iteration", Box::new(|r| r.iterations = 1)),
        ("inference", Box::new(|r| r.inference = true)),
    ];
    for name in [
        "gpt2",
        "bert-base",
        "tinyllama-1.1b",
        "resnet18",
        "vit-b-16",
        "nanogpt",
        "timm/convnext_nano",
    ] {
        for (what, change) in &variants {
            for accum in [4, 7] {
                let mut r = recipe(name, accum);
                change(&mut r);
                assert!(check(name, &r), "{name} {what}: no repetition found");
            }
        }
    }
}

/// One compact lowering serves every accumulation from two on.
#[test]
fn one_compact_lowering_serves_every_accumulation_from_two() {
    for name in ["gpt2", "resnet18", "bert-base"] {
        let r4 = recipe(name, 4);
        let g = zoo::build(name, &r4).unwrap();
        let four = lower_compact(&g, &r4).unwrap();
        for accum in [2, 3, 5, 8, 16, 64] {
            let r = recipe(name, accum);
            let other = four.with_accum(&r).expect("several micro-batches");
            assert!(
                other.expand() == lower(&g, &r).unwrap(),
                "{name} accum {accum}"
            );
        }
        assert!(four.with_accum(&recipe(name, 1)).is_none());
    }
}

#[test]
fn three_micro_batches_or_fewer_are_lowered_as_they_are() {
    for accum in 1..=3 {
        assert!(!check("gpt2", &recipe("gpt2", accum)));
    }
}

/// Data-parallel layouts (buckets, sharded states, reduce-scatters, all-gathers, tensor-parallel
/// ranks) repeat their micro-batches as a single device does: where the compact form of six
/// micro-batches repeats, it and its forms for two, three and sixteen expand to fresh lowerings.
#[test]
fn data_parallel_layouts_serve_every_accumulation_from_one_lowering() {
    use vramsim_models::{Precision, Shard};
    let mut repeated = 0;
    for (shard, dp, tp) in [
        (Shard::Ddp, 4, 1),
        (Shard::Zero1, 4, 1),
        (Shard::Zero2, 4, 1),
        (Shard::Zero3, 4, 1),
        (Shard::ZeroRedundancy, 4, 1),
        (Shard::Fsdp2, 4, 1),
        (Shard::Fsdp2, 2, 2),
        (Shard::None, 1, 2),
    ] {
        let mut r = recipe("gpt2", 6);
        r.precision = Precision::Bf16;
        r.parallel.shard = shard;
        r.parallel.dp = dp;
        r.parallel.tp = tp;
        let what = format!("{shard} dp {dp} tp {tp}");
        let g = zoo::build("gpt2", &r).unwrap_or_else(|e| panic!("{what}: {e}"));
        let compact = lower_compact(&g, &r).unwrap();
        same(&what, &compact, &lower(&g, &r).unwrap(), &r);
        if compact.repeats.is_empty() {
            continue;
        }
        repeated += 1;
        for accum in [2, 3, 16] {
            let other = Recipe { accum, ..r.clone() };
            let made = compact.with_accum(&other).expect("several micro-batches");
            same(&what, &made, &lower(&g, &other).unwrap(), &other);
        }
    }
    // ZeRO-2, FSDP2 (with and without TP) and TP alone repeat here; the others are lowered whole
    assert!(repeated >= 4, "{repeated} layouts repeat");
}
