//! `predict`'s optimised path (micro-batches lowered once and replayed to their steady state,
//! `compact::lower_compact` and `Replay::apply_repeated`) gives the report of the plain path (every
//! event of a full lowering replayed), field for field, over a grid of recipes and allocator settings,
//! out-of-memory points included.

use vramsim_api::predict::{lower_step, replay_step};
use vramsim_api::sweep::OptionSet;
use vramsim_models::{lower, zoo};
use vramsim_sim::engine::{Replay, ReplayOptions};

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn the_optimised_replay_equals_the_plain_one() {
    let (mut checked, mut ooms) = (0, 0);
    for model in ["gpt2", "resnet18"] {
        for accum in ["1", "2", "5", "16"] {
            for precision in ["fp32", "amp-fp16"] {
                for checkpoint in ["none", "full"] {
                    for machine in [
                        "--gpu=h100-80gb",
                        "--alloc-conf=expandable_segments:True",
                        "--alloc-conf=max_split_size_mb:64",
                        "--alloc-conf=garbage_collection_threshold:0.6,per_process_memory_fraction:0.8",
                        // small enough to run out of memory in some recipes
                        "--capacity=3GiB",
                    ] {
                        let a = args(&[
                            &format!("--model={model}"),
                            "--batch=4",
                            "--seq=256",
                            &format!("--accum={accum}"),
                            &format!("--precision={precision}"),
                            &format!("--checkpoint={checkpoint}"),
                            machine,
                        ]);
                        let parsed = OptionSet::predict().parse(&a).unwrap();
                        let lowered = lower_step(&parsed).unwrap();
                        let (report, prediction) = replay_step(&lowered, &parsed.machine, 0, true).unwrap();
                        // the plain path: a fresh lowering of every micro-batch, every event replayed
                        let graph = zoo::build(model, &lowered.recipe).unwrap();
                        let full = lower(&graph, &lowered.recipe).unwrap();
                        assert!(full == *lowered.trace(), "{a:?}: expanded trace");
                        // the machine the step replays on: with the kernels it loads (lazy loading)
                        let mut machine = parsed.machine.clone();
                        machine.library_bytes +=
                            machine.step_modules_choice().map_or(0, |m| m.bytes);
                        let allocator = machine.build().unwrap().allocator;
                        let plain = Replay::new(allocator, &ReplayOptions::default())
                            .run(full.events.iter().cloned().map(Ok))
                            .unwrap();
                        assert_eq!(
                            format!("{:?}", report.outcome),
                            format!("{plain:?}"),
                            "{a:?}"
                        );
                        assert_eq!(prediction.events, full.events.len());
                        checked += 1;
                        ooms += usize::from(plain.oom.is_some());
                    }
                }
            }
        }
    }
    assert_eq!(checked, 160);
    assert!(
        ooms > 0 && ooms < checked,
        "{ooms} of {checked} ran out of memory"
    );
}

/// A sweep lowers once for every accumulation count from two (and every GPU getting the same
/// kernels), and replays the counts of one machine together (`predict::replay_step_variants`): each
/// configuration's report equals the one it gets evaluated alone, out-of-memory points included, and
/// so does its `--json` document.
#[test]
fn accumulation_counts_sharing_a_lowering_get_their_own_reports() {
    use vramsim_api::sweep::{evaluate, evaluate_one, Progress, Wants};
    let configs: Vec<Vec<String>> = ["1", "2", "3", "4", "7", "16", "64"]
        .iter()
        .flat_map(|accum| {
            ["--gpu=h100-80gb", "--capacity=2GiB", "--capacity=1200MiB"].map(|machine| {
                args(&[
                    "--model=gpt2",
                    "--batch=2",
                    "--seq=128",
                    "--precision=amp-bf16",
                    &format!("--accum={accum}"),
                    machine,
                ])
            })
        })
        .collect();
    sweep_equals_each_alone(&configs);
    let fits: usize = configs
        .iter()
        .map(|c| usize::from(evaluate_one(c, Wants::default()).unwrap().fits()))
        .sum();
    assert!(
        fits > 0 && fits < configs.len(),
        "{fits} of {} fit",
        configs.len()
    );
    let wants = Wants {
        json: true,
        timeline_points: 0,
    };
    for (config, swept) in configs
        .iter()
        .zip(evaluate(&configs, wants, &Progress::hidden()))
    {
        let fresh =
            vramsim_api::predict::predict(&OptionSet::predict().parse(config).unwrap()).unwrap();
        assert_eq!(
            without_timing(swept.unwrap().json.expect("asked for")),
            without_timing(fresh.to_json()),
            "{config:?}"
        );
    }
}

/// Accumulation 2 told from a larger count's replay (its repeated micro-batch done no time, where the
/// steady state holds from it on): the same report as its own replay, over precisions and
/// checkpointing policies whose micro-batches raise the phases' peaks differently.
#[test]
fn fewer_repetitions_told_from_a_sweep_equal_their_own_replay() {
    let mut configs: Vec<Vec<String>> = Vec::new();
    for precision in ["fp32", "bf16", "amp-fp16"] {
        for checkpoint in ["none", "full", "selective"] {
            for accum in ["2", "4", "16"] {
                configs.push(args(&[
                    "--model=gpt2",
                    "--batch=2",
                    "--seq=128",
                    &format!("--precision={precision}"),
                    &format!("--checkpoint={checkpoint}"),
                    &format!("--accum={accum}"),
                ]));
            }
        }
    }
    sweep_equals_each_alone(&configs);
}

/// Evaluates `configs` as one sweep and each alone: the same outcomes, recipes, events, step times.
fn sweep_equals_each_alone(configs: &[Vec<String>]) {
    use vramsim_api::sweep::{evaluate, evaluate_one, Progress, Wants};
    let swept = evaluate(configs, Wants::default(), &Progress::hidden());
    for (config, swept) in configs.iter().zip(swept) {
        let swept = swept.unwrap();
        let alone = evaluate_one(config, Wants::default()).unwrap();
        assert_eq!(
            format!("{:?}", swept.report.outcome),
            format!("{:?}", alone.report.outcome),
            "{config:?}"
        );
        assert_eq!(swept.prediction.recipe, alone.prediction.recipe);
        assert_eq!(swept.prediction.events, alone.prediction.events);
        assert_eq!(swept.step.step_ms, alone.step.step_ms);
        assert_eq!(swept.last_iteration_start, alone.last_iteration_start);
    }
}

/// `predict --json`'s document without its timings (which differ from run to run).
fn without_timing(mut doc: serde_json::Value) -> serde_json::Value {
    if let Some(map) = doc.as_object_mut() {
        map.remove("timing");
    }
    doc
}

/// A sweep over batches lowers each family once per structure (two lowerings fit a template, the
/// largest batch checks it, the others are instances): every point's document equals `predict`'s own
/// (a fresh lowering and replay of that configuration), out-of-memory points included.
#[test]
fn templated_sweeps_equal_fresh_predictions() {
    let mut configs = Vec::new();
    // capacities that the larger batches of the language models exceed
    for (model, extra, capacity) in [
        ("gpt2", "--accum=5", "--capacity=3GiB"),
        ("resnet18", "--precision=amp-fp16", "--capacity=4GiB"),
        ("gpt2", "--checkpoint=full", "--capacity=2900MiB"),
    ] {
        for batch in 1..=7 {
            configs.push(args(&[
                &format!("--model={model}"),
                if model == "gpt2" {
                    "--seq=128"
                } else {
                    "--image-size=64"
                },
                extra,
                capacity,
                &format!("--batch={batch}"),
            ]));
        }
    }
    let (ooms, instances) = sweep_equals_fresh_predictions(&configs);
    assert!(ooms > 0, "the grid should reach the capacity");
    // batches 4, 5 and 6 of each family are instances (2 and 3 fit the template, 7 checks it)
    assert_eq!(instances, 9);
}

#[test]
fn seq_templated_sweeps_equal_fresh_predictions() {
    let mut configs = Vec::new();
    // lengths of residue 0 modulo 128 form one family over the batch and the length; 168 (residue
    // 40: FlashAttention's backward pads it to 256) is lowered on its own; a capacity that the
    // larger points exceed
    for seq in [128, 256, 384, 512, 168] {
        for batch in 1..=4 {
            configs.push(args(&[
                "--model=gpt2",
                "--precision=bf16",
                "--capacity=2300MiB",
                &format!("--seq={seq}"),
                &format!("--batch={batch}"),
            ]));
        }
    }
    let (ooms, instances) = sweep_equals_fresh_predictions(&configs);
    assert!(ooms > 0, "the grid should reach the capacity");
    // batches 2 and 3 at 128, 256 and 384 fit the template, batch 4 at 512 checks it; batch 4 at
    // 128, 256 and 384 and batches 2 and 3 at 512 are instances
    assert_eq!(instances, 5);
}

/// Evaluates `configs` as a sweep and checks each point's `--json` against a fresh `predict` of it
/// (timings aside); returns how many ran out of memory and how many were template instances.
fn sweep_equals_fresh_predictions(configs: &[Vec<String>]) -> (usize, usize) {
    use vramsim_api::sweep::{evaluate, Progress, Wants};
    let wants = Wants {
        json: true,
        timeline_points: 0,
    };
    let swept = evaluate(configs, wants, &Progress::hidden());
    let (mut ooms, mut instances) = (0, 0);
    for (a, point) in configs.iter().zip(swept) {
        let point = point.unwrap_or_else(|e| panic!("{a:?}: {e}"));
        ooms += usize::from(!point.fits());
        instances += usize::from(point.prediction.from_template);
        let fresh = vramsim_api::predict::predict(&OptionSet::predict().parse(a).unwrap()).unwrap();
        assert_eq!(
            without_timing(point.json.expect("asked for")),
            without_timing(fresh.to_json()),
            "{a:?}"
        );
    }
    (ooms, instances)
}
