//! `--dp` / `--shard` / `--world-size` on `predict` (and so on whatif and max-batch, which share
//! its options): the single-GPU layout is today's predict to the byte, data-parallel layouts give a
//! per-rank report, and bad layouts fail with the reason (exit status 2).

mod common;
use common::{json, stdout, succeeds};

use serde_json::Value;
use vramsim_api::{parse_args, predict};

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// The table without its one wall-clock line (`lowered ... in X ms, replayed in Y ms`).
fn untimed_table(t: &str) -> String {
    t.lines()
        .filter(|l| !l.starts_with("lowered "))
        .collect::<Vec<_>>()
        .join("\n")
}

fn untimed(mut doc: Value) -> Value {
    if let Value::Object(map) = &mut doc {
        map.remove("timing");
    }
    doc
}

/// `--dp 1 --shard none` is the single-GPU step: the same trace, table and JSON for every zoo
/// model.
#[test]
fn dp1_shard_none_is_todays_predict_for_every_zoo_model() {
    for name in vramsim_models::zoo::NAMES {
        let base = ["--model", name, "--batch", "1", "--seq", "64"];
        let plain: predict::PredictArgs = parse_args("predict", &strings(&base)).unwrap();
        let mut with = base.to_vec();
        with.extend(["--dp", "1", "--shard", "none"]);
        let layout: predict::PredictArgs = parse_args("predict", &strings(&with)).unwrap();
        let a = predict::predict(&plain).unwrap();
        let b = predict::predict(&layout).unwrap();
        assert_eq!(a.lowered.trace(), b.lowered.trace(), "{name}: trace");
        assert_eq!(
            serde_json::to_string(&untimed(a.to_json())).unwrap(),
            serde_json::to_string(&untimed(b.to_json())).unwrap(),
            "{name}: JSON"
        );
        assert_eq!(
            untimed_table(&a.to_table()),
            untimed_table(&b.to_table()),
            "{name}: table"
        );
    }
}

#[test]
fn data_parallel_reports_one_role_for_all_ranks() {
    let doc = json(&[
        "predict", "--model", "gpt2", "--batch", "2", "--seq", "128", "--dp", "8", "--shard", "ddp",
    ]);
    let ranks = doc["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 1);
    assert_eq!(
        ranks[0]["ranks"],
        serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7])
    );
    // The top-level peaks are the worst (here the only) role's.
    assert_eq!(
        ranks[0]["peak_allocated_bytes"], doc["peak_allocated_bytes"],
        "{doc}"
    );
    assert_eq!(ranks[0]["fits"], doc["fits"]);
    assert!(ranks[0]["by_category"]["communication"].as_u64().unwrap() > 0);
    assert_eq!(doc["layout"]["world_size"], 8);
    let table = stdout(&succeeds(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--dp",
        "4",
        "--shard",
        "zero2",
    ]));
    assert!(table.contains("ranks 0-3"), "{table}");
    let doc = json(&[
        "predict", "--model", "gpt2", "--batch", "2", "--seq", "128", "--dp", "8", "--shard",
        "fsdp2",
    ]);
    assert_eq!(doc["layout"]["shard"], "fsdp2");
    assert!(doc["ranks"][0]["role"].as_str().unwrap().contains("FSDP2"));
    // An OOM on every rank: PyTorch's message in the role.
    let doc = json(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--dp",
        "2",
        "--shard",
        "ddp",
        "--capacity",
        "1GiB",
    ]);
    assert_eq!(doc["ranks"][0]["fits"], false);
    assert!(doc["ranks"][0]["oom_message"]
        .as_str()
        .unwrap()
        .contains("CUDA out of memory"));
}

#[test]
fn bad_layouts_fail_with_the_reason() {
    let base = ["predict", "--model", "gpt2", "--batch", "1", "--seq", "64"];
    let fails = |extra: &[&str], fragments: &[&str]| {
        let mut all = base.to_vec();
        all.extend_from_slice(extra);
        common::assert_fails(&all, fragments);
    };
    fails(&["--dp", "4"], &["--shard ddp, zero1, zero2 or fsdp2"]);
    fails(
        &[
            "--dp",
            "2",
            "--shard",
            "ddp",
            "--lora",
            "r=8,targets=c_attn",
        ],
        &["with fine-tuning", "not modelled yet"],
    );
    fails(
        &["--dp", "4", "--shard", "ddp", "--world-size", "8"],
        &["world-size", "8 does not match", "4 ranks"],
    );
    fails(
        &[
            "--precision",
            "bf16",
            "--dp",
            "4",
            "--shard",
            "zero2",
            "--optimizer",
            "sgd",
        ],
        &["sgd (no momentum) keeps none"],
    );
    fails(&["--dp", "4", "--shard", "zero1"], &["--precision bf16"]);
    fails(
        &["--dp", "4", "--shard", "zero3"],
        &["valid values are none, ddp, zero1, zero2"],
    );
    fails(&["--dp", "0", "--shard", "ddp"], &["dp must be"]);
    // nn.DataParallel is one process: it cannot be split by TP or PP (issue 18).
    fails(
        &["--dp", "2", "--shard", "dataparallel", "--tp", "2"],
        &["nn.DataParallel", "tensor (--tp 2)", "--shard ddp or fsdp2"],
    );
    fails(
        &["--dp", "2", "--shard", "dataparallel", "--pp", "2"],
        &["nn.DataParallel", "pipeline (--pp 2)"],
    );
    fails(
        &[
            "--dp",
            "2",
            "--shard",
            "ddp",
            "--world-size",
            "2",
            "--pp",
            "2",
        ],
        &["2 does not match", "dp 2 × tp 1 × pp 2 = 4 ranks"],
    );
    fails(&["--sp"], &["--tp 2 or more"]);
    fails(&["--pp-schedule", "gpipe"], &["--pp 2 or more"]);
    fails(
        &["--pp", "2", "--pp-schedule", "interleaved:1"],
        &["gpipe, 1f1b, interleaved:V"],
    );
    fails(&["--tp", "0"], &["tp must be"]);
    fails(
        &[
            "--dp", "65536", "--tp", "65536", "--pp", "2", "--shard", "ddp",
        ],
        &["8589934592 ranks"],
    );
    fails(
        &["--offload", "params", "--dp", "2", "--shard", "ddp"],
        &["--offload params", "not ddp"],
    );
    fails(
        &["--offload", "optimizer", "--dp", "2", "--shard", "fsdp2"],
        &["CPUOffloadPolicy", "--offload params"],
    );
    fails(&["--offload", "cpu"], &["none, optimizer, params"]);
    fails(
        &["--dp", "2", "--shard", "fsdp2", "--ddp-bucket-view"],
        &["gradient_as_bucket_view", "--shard ddp"],
    );
    fails(
        &["--dp", "2", "--shard", "ddp", "--fsdp-param-dtype", "bf16"],
        &["MixedPrecisionPolicy", "--shard fsdp2"],
    );
    fails(
        &[
            "--dp",
            "2",
            "--shard",
            "fsdp2",
            "--fsdp-reduce-dtype",
            "int8",
        ],
        &["valid values are fp32, bf16, fp16"],
    );
    fails(
        &[
            "--dp",
            "2",
            "--shard",
            "fsdp2",
            "--fsdp-param-dtype",
            "bf16",
            "--precision",
            "amp-bf16",
        ],
        &["autocast"],
    );
    fails(
        &["--dp", "2", "--shard", "ddp", "--inference"],
        &["--inference"],
    );
    common::assert_fails(
        &[
            "recommend",
            "--model",
            "gpt2",
            "--global-batch",
            "8",
            "--dp",
            "4",
            "--shard",
            "ddp",
        ],
        &["parallel layouts", "not searched yet"],
    );
}

/// max-batch and whatif take the layout through predict's options: Llama-2-7B in fp32 with AdamW
/// cannot fit one 80 GB GPU (16 B per parameter of model states alone), while FSDP2 over 8 ranks
/// (2 + 14 B per parameter spread over 8 ranks, plus the unsharded blocks) leaves room for a batch;
/// the effective batch counts every rank.
#[test]
fn max_batch_and_whatif_take_the_layout() {
    let single = common::vramsim(&["max-batch", "--model", "llama2-7b", "--seq", "512"]);
    assert_eq!(single.status.code(), Some(2));
    assert!(common::stderr(&single).contains("even batch 1 does not fit"));
    let doc = json(&[
        "max-batch",
        "--model",
        "llama2-7b",
        "--seq",
        "512",
        "--dp",
        "8",
        "--shard",
        "fsdp2",
        "--fsdp-param-dtype",
        "bf16",
        "--fsdp-reduce-dtype",
        "fp32",
    ]);
    let b = doc["max_batch"].as_u64().unwrap();
    assert!(b >= 1, "{doc}");
    assert_eq!(doc["effective_batch"].as_u64(), Some(8 * b));
    let rows = json(&[
        "whatif",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--dp",
        "4",
        "--vary",
        "shard=ddp,zero1,zero2,fsdp2",
    ]);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 4);
    for r in rows {
        assert_eq!(r["effective_batch"], 8, "{r}");
        assert_eq!(r["ranks"][0]["ranks"], serde_json::json!([0, 1, 2, 3]));
    }
}
