//! `--shard dataparallel` on `predict`: one device is today's predict, more devices give a report
//! per device role (device 0 decides: it holds the optimizer and the gathered outputs), and bad
//! layouts fail with the reason (exit status 2).

mod common;

use serde_json::Value;

fn devices(args: &[&str]) -> Value {
    let mut all = vec!["predict"];
    all.extend_from_slice(args);
    common::json(&all)["devices"].clone()
}

/// With one device `DataParallel.forward` calls the module itself: the same peaks as predict.
#[test]
fn one_device_is_todays_predict() {
    let base = ["predict", "--model", "resnet18", "--batch", "8"];
    let plain = common::json(&base);
    let mut with = base.to_vec();
    with.extend(["--dp", "1", "--shard", "dataparallel"]);
    let dp = common::json(&with);
    for key in ["peak_allocated_bytes", "peak_reserved_bytes"] {
        assert_eq!(plain[key], dp[key], "{key}");
    }
}

/// Device 0 exceeds the replicas by at least AdamW's state (2 × 4 B per parameter, fp32), which
/// no other device holds; the layout fits only if every device fits.
#[test]
fn device_0_exceeds_the_replicas_by_the_optimizer_state() {
    let params = 25_557_032i64; // torchvision resnet50
    let d = devices(&[
        "--model",
        "resnet50",
        "--batch",
        "32",
        "--dp",
        "4",
        "--shard",
        "dataparallel",
    ]);
    assert_eq!(d["chunks"], serde_json::json!([8, 8, 8, 8]));
    let roles = d["roles"].as_array().unwrap();
    assert_eq!(roles.len(), 2, "device 0, and devices 1-3 alike");
    assert_eq!(roles[1]["ranks"], serde_json::json!([1, 2, 3]));
    assert_eq!(d["deciding_devices"], serde_json::json!([0]));
    assert!(d["device0_excess_allocated_bytes"].as_i64().unwrap() >= 8 * params);
    assert_eq!(
        d["device0_excess_by_category"]["optimizer_state"],
        8 * params
    );
    // A last device with a smaller chunk plays its own role: torch.chunk(10, 4) = 3, 3, 3, 1.
    let d = devices(&[
        "--model",
        "resnet18",
        "--batch",
        "10",
        "--dp",
        "4",
        "--shard",
        "dataparallel",
    ]);
    assert_eq!(d["chunks"], serde_json::json!([3, 3, 3, 1]));
    let ranks: Vec<Value> = d["roles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["ranks"].clone())
        .collect();
    assert_eq!(
        ranks,
        vec![
            serde_json::json!([0]),
            serde_json::json!([1, 2]),
            serde_json::json!([3])
        ]
    );
}

#[test]
fn bad_dataparallel_layouts_fail_with_the_reason() {
    let base = [
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "64",
        "--dp",
        "2",
        "--shard",
        "dataparallel",
    ];
    let fails = |extra: &[&str], fragments: &[&str]| {
        let mut all = base.to_vec();
        all.extend_from_slice(extra);
        common::assert_fails(&all, fragments);
    };
    fails(&["--fsdp-param-dtype", "bf16"], &["dataparallel", "FSDP2"]);
    fails(
        &["--ddp-bucket-view"],
        &["dataparallel", "DistributedDataParallel"],
    );
    fails(&["--output-device", "2"], &["output-device", "0..1"]);
    // torch.chunk(1, 2) makes one piece: device 1 would gather with no replica.
    common::assert_fails(
        &[
            "predict",
            "--model",
            "resnet18",
            "--batch",
            "1",
            "--dp",
            "2",
            "--shard",
            "dataparallel",
            "--output-device",
            "1",
        ],
        &["--output-device 1", "no chunk", "not modelled"],
    );
    fails(&["--accum", "2"], &["dataparallel", "--accum"]);
    common::assert_fails(
        &[
            "predict",
            "--model",
            "gpt2",
            "--batch",
            "2",
            "--seq",
            "64",
            "--dp",
            "2",
            "--shard",
            "ddp",
            "--output-device",
            "1",
        ],
        &["output_device", "--shard dataparallel"],
    );
}

/// `recommend --shard dataparallel` compares DataParallel with DDP on the same GPUs and global
/// batch: GPT-2 at 32 × 1024 tokens on four 24 GB cards fits with DDP (8 per rank) but not with
/// DataParallel, whose GPU 0 also gathers the logits of all 32 sequences.
#[test]
fn recommend_compares_dataparallel_with_ddp() {
    let d = common::json(&[
        "recommend",
        "--global-batch",
        "32",
        "--model",
        "gpt2",
        "--seq",
        "1024",
        "--dp",
        "4",
        "--shard",
        "dataparallel",
        "--gpu",
        "rtx-4090",
    ]);
    assert_eq!(d["ddp"]["batch_per_rank"], 8);
    assert_eq!(d["ddp"]["fits"], true);
    assert_eq!(d["dataparallel"]["fits"], false);
    assert!(d["verdict"]
        .as_str()
        .unwrap()
        .starts_with("DDP fits and DataParallel does not"));
}

/// A captured module whose loss function ran outside it (`forward_ops` before the loss) is split
/// as the zoo's torchvision loop is: the criterion on the output device, over the gathered logits.
#[test]
fn a_captured_module_with_its_criterion_outside_is_split_as_the_zoo_model() {
    let graph = format!(
        "{}/../models/tests/imported/resnet18.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let layout = ["--batch", "10", "--dp", "2", "--shard", "dataparallel"];
    let mut zoo = vec!["--model", "resnet18"];
    zoo.extend(layout);
    let mut captured = vec!["--graph", graph.as_str()];
    captured.extend(layout);
    let (z, c) = (devices(&zoo), devices(&captured));
    for key in ["peak_allocated_bytes", "peak_reserved_bytes"] {
        for d in 0..2 {
            assert_eq!(z["roles"][d][key], c["roles"][d][key], "device {d} {key}");
        }
    }
}
