//! `recommend --gpus N`: the layout search lists the fastest layouts that fit, the same as searching
//! every candidate, and accounts for every candidate (searched, pruned or refused with a reason).

mod common;
use common::{assert_fails, json};

use vramsim_api::layouts::search_with;
use vramsim_api::parse_args;
use vramsim_api::recommend::RecommendArgs;

fn args(extra: &[&str]) -> RecommendArgs {
    let mut a: Vec<String> = [
        "--model",
        "gpt2",
        "--seq",
        "256",
        "--global-batch",
        "16",
        "--top",
        "6",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    parse_args("recommend", &a).unwrap()
}

/// Branch and bound gives exactly the list an exhaustive search gives (a step at no accumulation
/// bounds every micro-batch's step from below).
#[test]
fn pruning_keeps_the_fastest_layouts() {
    for capacity in ["80GiB", "3GiB"] {
        let a = args(&["--capacity", capacity]);
        let pruned = search_with(&a, 4, true).unwrap();
        let full = search_with(&a, 4, false).unwrap();
        assert_eq!(full.pruned, 0);
        let key = |s: &vramsim_api::layouts::LayoutSearch| -> Vec<(Vec<(String, String)>, u64)> {
            s.found
                .iter()
                .map(|r| (r.settings.clone(), r.evaluated.step.step_ms.to_bits()))
                .collect()
        };
        assert_eq!(key(&pruned), key(&full), "{capacity}");
        assert!(pruned.searched <= full.searched);
        // every candidate is accounted for
        let refused: usize = pruned.refused.iter().map(|(_, n)| n).sum();
        assert_eq!(pruned.searched + pruned.pruned + refused, pruned.candidates);
    }
}

/// The same with context parallelism among the fastest: GPT-2 at seq 1024 on 2 GiB ranks, where
/// sharding the sequence over cp ranks is what lets a larger micro-batch fit.
#[test]
fn pruning_keeps_the_fastest_layouts_with_context_parallelism() {
    let a: RecommendArgs = parse_args(
        "recommend",
        &[
            "--model",
            "gpt2",
            "--seq",
            "1024",
            "--global-batch",
            "8",
            "--top",
            "4",
            "--capacity",
            "2GiB",
        ]
        .map(String::from),
    )
    .unwrap();
    let pruned = search_with(&a, 4, true).unwrap();
    let full = search_with(&a, 4, false).unwrap();
    let key = |s: &vramsim_api::layouts::LayoutSearch| -> Vec<(Vec<(String, String)>, u64)> {
        s.found
            .iter()
            .map(|r| (r.settings.clone(), r.evaluated.step.step_ms.to_bits()))
            .collect()
    };
    assert_eq!(key(&pruned), key(&full));
    assert!(
        full.found
            .iter()
            .any(|r| r.evaluated.prediction.recipe.parallel.cp > 1),
        "{:?}",
        key(&full)
    );
}

#[test]
fn layouts_multiply_to_the_gpus_and_split_the_global_batch() {
    let doc = json(&[
        "recommend",
        "--model",
        "gpt2",
        "--seq",
        "256",
        "--global-batch",
        "16",
        "--gpus",
        "4",
        "--top",
        "20",
    ]);
    let layouts = doc["layouts"].as_array().unwrap();
    assert!(!layouts.is_empty());
    for l in layouts {
        let (dp, tp, pp, cp) = (
            l["dp"].as_u64().unwrap(),
            l["tp"].as_u64().unwrap(),
            l["pp"].as_u64().unwrap(),
            l["cp"].as_u64().unwrap(),
        );
        assert_eq!(dp * tp * pp * cp, 4, "{l}");
        // context parallelism runs with FSDP2 over dp × cp and no pipeline
        if cp > 1 {
            assert_eq!(l["shard"], "fsdp2", "{l}");
            assert_eq!(pp, 1, "{l}");
        }
        assert_eq!(
            l["batch"].as_u64().unwrap() * l["accum"].as_u64().unwrap() * dp,
            16,
            "{l}"
        );
    }
    // the search covers context parallelism (GPT-2 at seq 256 allows cp 2 and 4)
    assert!(layouts.iter().any(|l| l["cp"].as_u64() > Some(1)), "{doc}");
    let times: Vec<f64> = layouts
        .iter()
        .map(|l| l["step_ms"].as_f64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
}

#[test]
fn bad_searches_fail_with_the_reason() {
    let base = [
        "recommend",
        "--model",
        "gpt2",
        "--seq",
        "256",
        "--global-batch",
        "16",
    ];
    let fails = |extra: &[&str], fragments: &[&str]| {
        let mut all = base.to_vec();
        all.extend_from_slice(extra);
        assert_fails(&all, fragments);
    };
    fails(&["--gpus", "4", "--dp", "2"], &["searches --dp itself"]);
    fails(&["--gpus", "0"], &["--gpus must be 1 or more"]);
    fails(&["--gpus", "4", "--finetune"], &["give one of them"]);
    fails(
        &["--gpus", "4", "--capacity", "10MiB"],
        &["no layout of 4 GPUs reaches global batch 16"],
    );
}
