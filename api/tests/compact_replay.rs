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
                        let allocator = parsed.machine.build().unwrap().allocator;
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

/// A sweep lowers once for every accumulation count above three (and every GPU getting the same
/// kernels): each configuration's report equals the one it gets evaluated alone.
#[test]
fn accumulation_counts_sharing_a_lowering_get_their_own_reports() {
    use vramsim_api::sweep::{evaluate, evaluate_one, Progress, Wants};
    let configs: Vec<Vec<String>> = ["1", "4", "7", "16", "64"]
        .iter()
        .flat_map(|accum| {
            ["--gpu=h100-80gb", "--capacity=2GiB"].map(|machine| {
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
    let swept = evaluate(&configs, Wants::default(), &Progress::hidden());
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
