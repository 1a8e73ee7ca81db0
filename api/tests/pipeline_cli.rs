//! `--pp` on `predict` (and so on whatif and max-batch): every pipeline rank is its own role,
//! lowered and replayed once; the top-level peaks are the worst rank's; `--pp 1` is today's
//! step; bad pipeline layouts fail with the source's reason (exit status 2).

mod common;
use common::{assert_fails, json, stdout, succeeds};

use serde_json::Value;
use vramsim_api::{parse_args, predict};

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn untimed(mut doc: Value) -> Value {
    if let Value::Object(map) = &mut doc {
        map.remove("timing");
    }
    doc
}

/// `--pp 1` (with its default schedule) is the single-GPU step to the byte.
#[test]
fn pp1_is_todays_predict() {
    for name in ["gpt2", "tinyllama-1.1b", "bert-base", "resnet18"] {
        let base = ["--model", name, "--batch", "2", "--seq", "64"];
        let plain: predict::PredictArgs = parse_args("predict", &strings(&base)).unwrap();
        let mut with = base.to_vec();
        with.extend(["--pp", "1"]);
        let layout: predict::PredictArgs = parse_args("predict", &strings(&with)).unwrap();
        let a = predict::predict(&plain).unwrap();
        let b = predict::predict(&layout).unwrap();
        assert_eq!(a.lowered.trace(), b.lowered.trace(), "{name}: trace");
        assert_eq!(
            serde_json::to_string(&untimed(a.to_json())).unwrap(),
            serde_json::to_string(&untimed(b.to_json())).unwrap(),
            "{name}: JSON"
        );
    }
}

/// One role per rank, by rank: the first holds the embeddings, the last the head and the loss;
/// 1F1B's in-flight counts are `min(m, pp − stage)`; the top level is the worst rank's.
#[test]
fn each_rank_is_a_role_and_the_worst_decides() {
    let doc = json(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "8",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--pp",
        "4",
    ]);
    let ranks = doc["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 4);
    for (r, role) in ranks.iter().enumerate() {
        assert_eq!(role["ranks"], serde_json::json!([r]));
        let name = role["role"].as_str().unwrap();
        assert_eq!(name.contains("embeddings"), r == 0, "{name}");
        assert_eq!(name.contains("head and loss"), r == 3, "{name}");
        assert!(name.contains(&format!("{} micro-batch", 4 - r)), "{name}");
    }
    assert_eq!(
        doc["pipeline"]["in_flight"],
        serde_json::json!([4, 3, 2, 1])
    );
    assert_eq!(doc["pipeline"]["microbatches"], 8);
    assert_eq!(
        doc["pipeline"]["loop"], "torchtitan",
        "torchtitan's loop by default"
    );
    let worst = ranks
        .iter()
        .max_by_key(|r| r["peak_reserved_bytes"].as_u64().unwrap())
        .unwrap();
    assert_eq!(worst["peak_reserved_bytes"], doc["peak_reserved_bytes"]);
    assert_eq!(worst["peak_allocated_bytes"], doc["peak_allocated_bytes"]);
    assert_eq!(doc["layout"]["world_size"], 4);
    let table = stdout(&succeeds(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "8",
        "--seq",
        "128",
        "--pp",
        "2",
        "--pp-schedule",
        "gpipe",
    ]));
    assert!(
        table.contains("layout     pp 2 × gpipe (2 stages), 8 micro-batches of 1"),
        "{table}"
    );
    assert!(table.contains("decides    rank"), "{table}");
}

/// The schedules' and the split's own checks, with their reasons.
#[test]
fn bad_pipelines_fail_with_the_reason() {
    let fails = |extra: &[&str], fragments: &[&str]| {
        let mut args = vec!["predict", "--model", "gpt2", "--seq", "64"];
        args.extend_from_slice(extra);
        assert_fails(&args, fragments);
    };
    fails(
        &["--batch", "2", "--pp", "4"],
        &["Number of microbatches (2) must be greater than or equal to the number of stages (4)"],
    );
    fails(
        &["--batch", "8", "--pp", "2", "--microbatches", "3"],
        &["must divide the batch 8"],
    );
    fails(
        &[
            "--batch",
            "9",
            "--pp",
            "4",
            "--pp-schedule",
            "interleaved:2",
        ],
        &["multiple of the number of rounds (2)"],
    );
    fails(
        &["--batch", "16", "--pp", "13", "--pp-schedule", "gpipe"],
        &["13 stages for 12 layers", "at most 12"],
    );
    fails(
        &[
            "--batch",
            "8",
            "--pp",
            "4",
            "--pp-schedule",
            "interleaved:4",
        ],
        &["16 stages for 12 layers"],
    );
    fails(
        &["--batch", "8", "--pp", "2", "--dp", "2", "--shard", "zero2"],
        &["ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"],
    );
    fails(
        &["--batch", "8", "--pp", "2", "--dp", "2", "--shard", "zero1"],
        &["DeepSpeed's PipelineEngine", "zero1-torch"],
    );
    fails(
        &[
            "--batch",
            "8",
            "--pp",
            "2",
            "--dp",
            "4",
            "--shard",
            "fsdp2",
            "--reshard-after-forward",
            "2",
        ],
        &[
            "--reshard-after-forward 2 is not modelled",
            "unsharded after forward",
            "never an int",
            "_to_sharded_post_forward",
        ],
    );
    fails(
        &["--batch", "8", "--pp", "2", "--precision", "amp-fp16"],
        &["GradScaler", "_maybe_compute_loss", "_scale is None"],
    );
    fails(
        &["--batch", "8", "--pp", "2", "--pp-loop", "deepspeed"],
        &["pp-loop", "torchtitan, plain"],
    );
    fails(
        &["--batch", "8", "--pp-loop", "plain"],
        &["--pp-loop is the loop around a pipeline's schedule: give --pp 2 or more"],
    );
}

/// `max-batch` on a pipeline walks the multiples of `--microbatches` (M micro-batches of batch/M
/// samples): the answer is one, `predict` fits it and not the next multiple; without
/// `--microbatches` (one sample per micro-batch, memory nearly flat in the batch) it is refused.
#[test]
fn max_batch_of_a_pipeline_walks_the_micro_batch_multiples() {
    let base = [
        "--model",
        "gpt2",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--capacity",
        "3GiB",
        "--pp",
        "2",
        "--microbatches",
        "4",
    ];
    let mut args = vec!["max-batch"];
    args.extend_from_slice(&base);
    let doc = common::json(&args);
    let best = doc["max_batch"].as_u64().unwrap();
    assert!(best >= 4 && best.is_multiple_of(4), "{best}");
    let fits = |batch: u64| {
        let b = batch.to_string();
        let mut a = vec!["predict"];
        a.extend_from_slice(&base);
        a.extend_from_slice(&["--batch", &b]);
        common::json(&a)["fits"].as_bool().unwrap()
    };
    assert!(fits(best));
    assert!(!fits(best + 4));
    common::assert_fails(
        &["max-batch", "--model", "gpt2", "--seq", "128", "--pp", "2"],
        &["needs --microbatches M"],
    );
}

/// `--pp 2 --dp 2 --shard ddp` (and `zero1-torch`, over DDP): each pipeline rank is one role
/// played by its stage's two data-parallel ranks (torchtitan's mesh `pp, dp`: global ranks
/// `2·stage`, `2·stage + 1`); at the peak (the optimizer step) DDP's buckets hold the stage's
/// gradient bytes (bf16: the same bytes as its parameters and its gradients), and
/// `zero1-torch`'s AdamW holds less state than DDP's (a share of the stage's parameters).
#[test]
fn ddp_stages_are_roles_of_their_data_parallel_ranks() {
    let run = |shard: &str| {
        json(&[
            "predict",
            "--model",
            "gpt2",
            "--batch",
            "8",
            "--seq",
            "128",
            "--precision",
            "bf16",
            "--pp",
            "2",
            "--dp",
            "2",
            "--shard",
            shard,
        ])
    };
    let ddp = run("ddp");
    assert_eq!(ddp["layout"]["world_size"], 4);
    let ranks = ddp["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 2);
    for (s, role) in ranks.iter().enumerate() {
        let s = s as u64;
        assert_eq!(role["ranks"], serde_json::json!([2 * s, 2 * s + 1]));
        let by = &role["by_category"];
        assert_eq!(by["communication"], by["gradient"], "stage {s}");
        assert_eq!(by["communication"], by["parameter"], "stage {s}");
    }
    let zr = run("zero1-torch");
    for s in 0..2 {
        let state = |d: &Value| d["ranks"][s]["by_category"]["optimizer_state"].as_u64();
        assert!(state(&zr) < state(&ddp), "stage {s}");
    }
}

/// Fine-tuning under `--pp`: TinyLlama's embeddings and layers 0–10 frozen, which is the whole
/// first stage of torchtitan's split over 2 stages (embeddings + layers 0–10 | layers 11–21, norm,
/// head). Rank 0 holds its bf16 parameters and nothing else of the model states (2 × (32000 ×
/// 2048 + 11 × 44,044,288) bytes, by hand from the config); rank 1 also its gradients and AdamW
/// state (bf16: 2 + 4 bytes per element of 11 layers, the norm and the head).
#[test]
fn finetuning_under_pp_holds_each_stage_trainable_states_only() {
    let layer: u64 = 2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048;
    let d = common::json(&[
        "predict",
        "--model",
        "tinyllama-1.1b",
        "--batch",
        "2",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--pp",
        "2",
        "--freeze",
        "model.embed_tokens,model.layers.0-10",
    ]);
    let ranks = d["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 2);
    let cat = |r: usize, c: &str| ranks[r]["by_category"][c].as_u64().unwrap_or(0);
    assert_eq!(cat(0, "parameter"), 2 * (32000 * 2048 + 11 * layer));
    assert_eq!(cat(0, "gradient"), 0);
    assert_eq!(cat(0, "optimizer_state"), 0);
    let stage1 = 11 * layer + 2048 + 32000 * 2048;
    assert_eq!(cat(1, "parameter"), 2 * stage1);
    // At rank 1's peak (its optimizer step) the gradients and AdamW's two moments are all live.
    assert_eq!(cat(1, "gradient"), 2 * stage1);
    assert_eq!(cat(1, "optimizer_state"), 4 * stage1);
}
