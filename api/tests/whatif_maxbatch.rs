//! `vramsim max-batch` and `vramsim recommend` end to end, checked against `predict`: the batch
//! max-batch returns fits and the next one does not, for several models and cards; the answer grows
//! with the capacity; the recipes recommend lists reach the global batch and fit.

mod common;
use common::{json, stderr, succeeds, vramsim};

use serde_json::Value;

/// `predict --json` of `recipe` with `--KEY VALUE` added.
fn predict(recipe: &[&str], key: &str, value: u64) -> Value {
    let value = value.to_string();
    let mut args = vec!["predict"];
    args.extend_from_slice(recipe);
    args.extend_from_slice(&[key, &value]);
    json(&args)
}

/// Models and cards, each with the recipe `predict` takes (all but the batch).
const CASES: &[&[&str]] = &[
    &[
        "--model",
        "gpt2",
        "--seq",
        "256",
        "--precision",
        "amp-bf16",
        "--gpu",
        "t4",
    ],
    &[
        "--model",
        "gpt2-medium",
        "--seq",
        "512",
        "--checkpoint",
        "full",
        "--gpu",
        "rtx4090",
    ],
    &[
        "--model",
        "tinyllama-1.1b",
        "--seq",
        "256",
        "--precision",
        "bf16",
        "--attention",
        "sdpa-flash",
        "--gpu",
        "l4",
    ],
    &["--model", "resnet18", "--gpu", "t4"],
    &[
        "--model",
        "bert-base",
        "--seq",
        "128",
        "--precision",
        "amp-fp16",
        "--gpu",
        "v100-16gb",
    ],
    &["--model", "mlp", "--capacity", "1GiB"],
];

#[test]
fn the_batch_returned_fits_and_the_next_does_not() {
    for recipe in CASES {
        let mut args = vec!["max-batch"];
        args.extend_from_slice(recipe);
        let answer = json(&args);
        let b = answer["max_batch"].as_u64().expect("max_batch");
        assert!(b >= 1, "{recipe:?}");
        let at = predict(recipe, "--batch", b);
        assert_eq!(at["fits"], true, "{recipe:?}: batch {b} should fit");
        assert_eq!(
            at["peak_device_used_bytes"], answer["peak_device_used_bytes"],
            "{recipe:?}"
        );
        let next = predict(recipe, "--batch", b + 1);
        assert_eq!(
            next["fits"],
            false,
            "{recipe:?}: batch {} should not fit",
            b + 1
        );
        let failure = &answer["first_failure"];
        assert_eq!(failure["batch"].as_u64(), Some(b + 1), "{recipe:?}");
        assert_eq!(failure["reason"], "oom");
        assert_eq!(failure["message"], next["oom"]["message"], "{recipe:?}");
        // every size tried is on the right side of the answer (the curve is monotone here)
        for t in answer["tried"].as_array().unwrap() {
            let size = t["batch"].as_u64().unwrap();
            assert_eq!(t["fits"].as_bool().unwrap(), size <= b, "{recipe:?}: {t}");
        }
    }
}

#[test]
fn the_answer_grows_with_the_capacity() {
    let mut last = 0;
    for capacity in [
        "3GiB", "4GiB", "6GiB", "8GiB", "12GiB", "16GiB", "24GiB", "40GiB",
    ] {
        let answer = json(&[
            "max-batch",
            "--model",
            "gpt2",
            "--seq",
            "256",
            "--precision",
            "amp-bf16",
            "--capacity",
            capacity,
        ]);
        let b = answer["max_batch"].as_u64().unwrap();
        assert!(b >= last, "{capacity}: {b} < {last}");
        last = b;
    }
    assert!(last > 50, "40 GiB holds far more than {last}");
}

#[test]
fn headroom_keeps_memory_free() {
    // the first case: gpt2, seq 256, amp-bf16, T4
    let recipe = CASES[0];
    let mut plain = vec!["max-batch"];
    plain.extend_from_slice(recipe);
    let without = json(&plain)["max_batch"].as_u64().unwrap();
    let mut args = plain.clone();
    args.extend_from_slice(&["--headroom", "20%"]);
    let with = json(&args);
    let b = with["max_batch"].as_u64().unwrap();
    assert!(b < without, "{b} vs {without}");
    let total = with["device"]["total_memory_bytes"].as_u64().unwrap();
    assert_eq!(with["headroom_bytes"].as_u64().unwrap(), total / 5);
    assert!(with["peak_device_used_bytes"].as_u64().unwrap() <= total - total / 5);
    assert_eq!(with["first_failure"]["reason"], "headroom");
    assert!(with["first_failure"]["message"]
        .as_str()
        .unwrap()
        .contains("headroom"));
    // a size is also accepted
    args.pop();
    args.push("1GiB");
    assert_eq!(json(&args)["headroom_bytes"], 1u64 << 30);
}

#[test]
fn max_seq_fits_and_the_next_does_not() {
    let recipe = ["--model", "gpt2", "--batch", "8", "--capacity", "4GiB"];
    let mut args = vec!["max-batch", "--max-seq"];
    args.extend_from_slice(&recipe);
    let answer = json(&args);
    let s = answer["max_seq"].as_u64().expect("max_seq");
    assert!(s > 1 && s < 1024, "{s}");
    assert_eq!(predict(&recipe, "--seq", s)["fits"], true);
    assert_eq!(predict(&recipe, "--seq", s + 1)["fits"], false);
    // the model's positions bound the search
    let roomy = json(&[
        "max-batch",
        "--max-seq",
        "--model",
        "gpt2",
        "--gpu",
        "h100-80gb",
    ]);
    assert_eq!(roomy["max_seq"], 1024);
    assert_eq!(roomy["limit_reached"], true);
}

#[test]
fn a_card_on_which_even_batch_one_does_not_fit() {
    let output = vramsim(&["max-batch", "--model", "llama2-7b", "--gpu", "t4"]);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("error: even batch 1 does not fit on Tesla T4"),
        "{err}"
    );
    assert!(
        err.contains("CUDA out of memory. Tried to allocate"),
        "{err}"
    );
    // and the options max-batch searches are not given
    let output = vramsim(&["max-batch", "--model", "gpt2", "--batch", "4"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("--batch is what max-batch searches"));
}

#[test]
fn recommended_recipes_reach_the_global_batch_and_fit() {
    let fixed = ["--model", "gpt2", "--seq", "256", "--gpu", "t4"];
    let mut args = vec!["recommend", "--global-batch", "48", "--top", "20"];
    args.extend_from_slice(&fixed);
    let doc = json(&args);
    let recipes = doc["recipes"].as_array().unwrap();
    assert_eq!(doc["recipes_tried"], 16);
    assert!(!recipes.is_empty());
    let times: Vec<f64> = recipes
        .iter()
        .map(|r| r["step_time"]["step_ms"].as_f64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "fastest first");
    for r in recipes {
        let (b, a) = (r["batch"].as_u64().unwrap(), r["accum"].as_u64().unwrap());
        assert_eq!(b * a, 48, "{r}");
        // the command line is `predict` with this recipe, and it fits
        let command = r["command"].as_str().unwrap();
        let words: Vec<&str> = command.split_whitespace().collect();
        assert_eq!(&words[..2], ["vramsim", "predict"]);
        let out = json(&words[1..]);
        assert_eq!(out["fits"], true, "{command}");
        assert_eq!(out["recipe"]["batch"].as_u64(), Some(b));
        // the largest micro-batch: twice as large (when it divides) does not fit
        if 48 % (2 * b) == 0 {
            let mut bigger: Vec<String> = words[1..].iter().map(|s| s.to_string()).collect();
            let i = bigger.iter().position(|w| w == "--batch").unwrap();
            bigger[i + 1] = (2 * b).to_string();
            let j = bigger.iter().position(|w| w == "--accum").unwrap();
            bigger[j + 1] = (a / 2).to_string();
            let refs: Vec<&str> = bigger.iter().map(String::as_str).collect();
            assert_eq!(json(&refs)["fits"], false, "{command} with batch {}", 2 * b);
        }
    }
    // nothing fits: says so, with the message of the most frugal recipe
    let output = vramsim(&[
        "recommend",
        "--model",
        "llama2-7b",
        "--gpu",
        "t4",
        "--global-batch",
        "8",
    ]);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("no recipe reaches global batch 8"), "{err}");
    assert!(
        err.contains("bf16, checkpoint full, batch 1 × accum 8"),
        "{err}"
    );
    assert!(err.contains("CUDA out of memory"), "{err}");
}

#[test]
fn curve_and_timeline_plots() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("whatif-maxbatch");
    std::fs::create_dir_all(&dir).unwrap();
    let curve = dir.join("curve.svg");
    let timeline = dir.join("timeline.png");
    let output = succeeds(&[
        "max-batch",
        "--model",
        "gpt2",
        "--seq",
        "256",
        "--precision",
        "amp-bf16",
        "--gpu",
        "t4",
        "--headroom",
        "5%",
        "--plot",
        curve.to_str().unwrap(),
        "--timeline",
        timeline.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("largest batch that fits"), "{text}");
    assert!(text.contains("vramsim predict --model gpt2"), "{text}");
    let svg = std::fs::read_to_string(&curve).unwrap();
    for label in [
        "batch size",
        "largest that fits",
        "first that does not",
        "device memory",
        "limit",
    ] {
        assert!(svg.contains(label), "curve lacks {label:?}");
    }
    let png = std::fs::read(&timeline).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 20_000);
}
