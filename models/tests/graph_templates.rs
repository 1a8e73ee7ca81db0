//! A model graph at another batch without building it (`graph_template::GraphTemplate`): a template
//! fitted through the graphs at batch 2 and 3 writes, at every larger batch, the graph the zoo builds,
//! equal in every field, for every zoo model at two sequence lengths (language models) or image sizes
//! (convolutional ones), and with recipe options that change the graph (mixed precision, LoRA,
//! checkpointing's `use_cache`).

mod common;

use common::{template_recipes as recipes, TEMPLATE_BATCHES as BATCHES};
use vramsim_models::graph::Graph;
use vramsim_models::graph_template::GraphTemplate;
use vramsim_models::seq_template::SeqGraphTemplate;
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
    common::for_every_template_recipe(check);
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

/// Over the batch and the sequence length (`seq_template::SeqGraphTemplate`): fitted through the
/// graphs at batches 2 and 3 × three lengths of one residue, it writes the zoo's graph at other
/// batches and lengths of that residue, for every zoo language model.
#[test]
fn every_language_model_instantiates_its_fresh_graph_over_the_length() {
    for name in NAMES {
        let arch = zoo::Arch::from_name(name).unwrap();
        let Some(positions) = arch.max_positions() else {
            continue;
        };
        for residue in [0u64, 40, 100] {
            let seqs = [residue + 128, residue + 256, residue + 384];
            if seqs[2] + 128 > positions {
                continue;
            }
            let r = Recipe::new(1, seqs[0]);
            let at = |batch: u64, seq: u64| {
                let mut r = r.clone();
                r.seq = seq;
                built(name, &r, batch)
            };
            let points = [2u64, 3].map(|b| seqs.map(|s| at(b, s)));
            let fit = [0, 1].map(|k| [0, 1, 2].map(|j| &points[k][j]));
            let template = SeqGraphTemplate::fit(fit, [2, 3], seqs)
                .unwrap_or_else(|| panic!("{name} residue {residue}: no template"));
            for (batch, seq) in [(5, seqs[2] + 128), (4, seqs[0]), (2, seqs[1])] {
                let made = template
                    .instantiate(batch, seq)
                    .unwrap_or_else(|| panic!("{name} batch {batch} seq {seq}: no instance"));
                assert!(
                    made == at(batch, seq),
                    "{name} batch {batch} seq {seq}: the instance differs from a fresh build"
                );
            }
            // a length of another residue is not the template's
            assert!(template.instantiate(2, seqs[0] + 1).is_none());
        }
    }
}
