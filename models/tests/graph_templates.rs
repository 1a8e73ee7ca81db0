//! A model graph at another batch without building it (`graph_template::GraphTemplate`): a template
//! fitted through the graphs at batch 2 and 3 writes, at every larger batch, the graph the zoo builds,
//! equal in every field, for every zoo model at two sequence lengths (language models) or image sizes
//! (convolutional ones), and with recipe options that change the graph (mixed precision, LoRA,
//! checkpointing's `use_cache`).

mod common;

use common::{template_recipes as recipes, TEMPLATE_BATCHES as BATCHES};
use vramsim_models::graph::Graph;
use vramsim_models::graph_template::GraphTemplate;
use vramsim_models::zoo::{self, NAMES};
use vramsim_models::{Checkpointing, Precision, Recipe};

fn built(name: &str, r: &Recipe, batch: u64) -> Graph {
    let mut r = r.clone();
    r.batch = batch;
    zoo::build(name, &r).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Fits the template at batch 2 and 3 and compares its instances with fresh builds.
fn check(name: &str, r: &Recipe) {
    let template = GraphTemplate::fit(&built(name, r, 2), &built(name, r, 3))
        .unwrap_or_else(|| panic!("{name} {}: no template", r.name()));
    for batch in BATCHES {
        let made = template
            .instantiate(batch)
            .unwrap_or_else(|| panic!("{name} {} batch {batch}: no instance", r.name()));
        assert!(
            made == built(name, r, batch),
            "{name} {} batch {batch}: the instance differs from a fresh build",
            r.name()
        );
    }
}

#[test]
fn every_zoo_model_instantiates_its_fresh_graph() {
    for name in NAMES {
        for r in recipes(name) {
            check(name, &r);
        }
    }
}

#[test]
fn recipe_options_instantiate_their_fresh_graph() {
    type Change = fn(&mut Recipe);
    let changes: [(&str, Change); 3] = [
        ("amp-fp16", |r| r.precision = Precision::AmpFp16),
        ("full checkpointing", |r| {
            r.checkpointing = Checkpointing::Full
        }),
        ("LoRA", |r| {
            r.lora = Some("r=8,targets=all-linear".parse().unwrap())
        }),
    ];
    for name in ["gpt2", "llama2-7b", "bert-base"] {
        for (what, change) in changes {
            let mut r = recipes(name).remove(0);
            change(&mut r);
            eprintln!("{name}: {what}");
            check(name, &r);
        }
    }
}

#[test]
fn graphs_of_other_structures_are_no_template() {
    let r = recipes("gpt2").remove(0);
    // two models
    assert!(GraphTemplate::fit(&built("gpt2", &r, 2), &built("gpt2-medium", &r, 3)).is_none());
    // one batch twice
    assert!(GraphTemplate::fit(&built("gpt2", &r, 2), &built("gpt2", &r, 2)).is_none());
    // two sequence lengths at two batches: the dimensions change, but the batch does not say how
    let mut longer = r.clone();
    longer.seq = 33;
    let a = built("gpt2", &r, 2);
    let b = built("gpt2", &longer, 3);
    assert!(GraphTemplate::fit(&a, &b).is_none());
}
