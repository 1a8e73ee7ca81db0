//! Lowering once per structure (`template::BatchTemplate`): a template fitted through the lowerings at
//! batch 2 and 3 writes, at every larger batch, the step a fresh lowering writes, byte for byte (events,
//! repeats and `meta`), for every zoo model, at two sequence lengths for the language models and two
//! image sizes for the convolutional ones, under the recipe options that change which tensors a step
//! holds (precision, checkpointing, accumulation, optimizers, kept outputs).

mod common;

use common::{template_recipes as recipes, TEMPLATE_BATCHES as BATCHES};
use vramsim_models::compact::{lower_compact, CompactTrace};
use vramsim_models::template::BatchTemplate;
use vramsim_models::zoo;
use vramsim_models::{Checkpointing, OptimizerKind, Precision, Recipe};

fn lowered(name: &str, r: &Recipe) -> CompactTrace {
    let g = zoo::build(name, r).unwrap_or_else(|e| panic!("{name}: {e}"));
    lower_compact(&g, r).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Fits the template at batch 2 and 3 and compares its instances with fresh lowerings.
fn check(name: &str, base: &Recipe) {
    let at = |batch: u64| {
        let mut r = base.clone();
        r.batch = batch;
        lowered(name, &r)
    };
    let template = BatchTemplate::fit_or_why(&at(2), 2, &at(3), 3)
        .unwrap_or_else(|why| panic!("{name} {}: no template: {why}", base.name()));
    for batch in BATCHES {
        let fresh = at(batch);
        let made = template
            .instantiate(batch)
            .unwrap_or_else(|| panic!("{name} {} batch {batch}: no instance", base.name()));
        assert!(
            made.same_as(&fresh),
            "{name} {} batch {batch}: the instance differs from a fresh lowering",
            base.name()
        );
        let json = |t: &CompactTrace| {
            let mut out = Vec::new();
            vramsim_traces::write_json(&mut out, &t.expand()).unwrap();
            out
        };
        assert!(json(&made) == json(&fresh), "{name} batch {batch}: JSON");
    }
}

#[test]
fn every_zoo_model_instantiates_its_fresh_lowering() {
    common::for_every_template_recipe(check);
}

#[test]
fn recipe_options_instantiate_their_fresh_lowering() {
    type Change = fn(&mut Recipe);
    let changes: [(&str, Change); 7] = [
        ("amp-bf16", |r| r.precision = Precision::AmpBf16),
        ("amp-fp16", |r| r.precision = Precision::AmpFp16),
        ("full checkpointing", |r| {
            r.checkpointing = Checkpointing::Full
        }),
        ("accumulation 6", |r| r.accum = 6),
        ("accumulation 2", |r| r.accum = 2),
        ("sgd", |r| r.optimizer = OptimizerKind::Sgd),
        ("kept outputs", |r| r.keep_outputs = true),
    ];
    for name in ["gpt2", "llama2-7b", "bert-base", "resnet18", "vit-b-16"] {
        for (what, change) in changes {
            let mut r = recipes(name).remove(0);
            change(&mut r);
            eprintln!("{name}: {what}");
            check(name, &r);
        }
    }
}

#[test]
fn a_change_of_structure_is_no_template() {
    // batch 1 and 2 of two different models are not one structure
    let mut r = recipes("gpt2").remove(0);
    r.batch = 2;
    let mut r3 = r.clone();
    r3.batch = 3;
    assert!(BatchTemplate::fit(&lowered("gpt2", &r), 2, &lowered("mlp", &r3), 3).is_none());
    // nor are two lowerings at one batch
    assert!(BatchTemplate::fit(&lowered("gpt2", &r), 2, &lowered("gpt2", &r), 2).is_none());
    // batch 1 takes cuBLAS where batch 2 takes cuBLASLt (`isInputCompliesAddmmCudaLt`: every
    // dimension of mat1 above 1): the MLP's linear layers make other workspaces
    let mut r1 = recipes("mlp").remove(0);
    r1.batch = 1;
    let mut r2 = r1.clone();
    r2.batch = 2;
    let why =
        BatchTemplate::fit_or_why(&lowered("mlp", &r1), 1, &lowered("mlp", &r2), 2).unwrap_err();
    assert!(why.contains("cublas"), "{why}");
}

/// The most requested bytes live at once in `trace`, counted event by event.
fn requested_peak(trace: &CompactTrace) -> u64 {
    let mut live = std::collections::HashMap::new();
    let (mut now, mut peak) = (0u64, 0u64);
    for e in &trace.expand().events {
        match e {
            vramsim_traces::Event::Alloc { id, size, .. } => {
                live.insert(id.clone(), *size);
                now += size;
                peak = peak.max(now);
            }
            vramsim_traces::Event::Free { id } => now -= live.remove(id).unwrap_or(0),
            _ => {}
        }
    }
    peak
}

#[test]
fn the_requested_peak_bounds_the_batch() {
    for (name, accum) in [("gpt2", 1), ("resnet18", 1), ("gpt2", 5)] {
        let mut r = recipes(name).remove(0);
        r.accum = accum;
        let at = |batch: u64| {
            let mut r = r.clone();
            r.batch = batch;
            lowered(name, &r)
        };
        let template = BatchTemplate::fit(&at(2), 2, &at(3), 3).unwrap();
        // a budget between the peaks of batch 600 and 601 (activations, not the optimizer's
        // step, decide the peak there): the answer is 600
        let (p600, p601) = (requested_peak(&at(600)), requested_peak(&at(601)));
        assert!(p600 < p601, "{name}");
        for bytes in [p600, (p600 + p601) / 2, p601 - 1] {
            assert_eq!(
                template.largest_batch_within(bytes),
                Some(600),
                "{name} {bytes}"
            );
        }
        assert_eq!(template.largest_batch_within(p601), Some(601), "{name}");
    }
}
