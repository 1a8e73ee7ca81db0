//! `vramsim whatif` end to end: every row is what `predict` says for its configuration, the outputs
//! (table, JSON, CSV, bar chart), and a clear error (exit status 2) for every kind of bad grid.

mod common;
use common::{assert_fails, json, stdout, succeeds};

use serde_json::Value;

const FIXED: &[&str] = &["--model", "gpt2", "--seq", "128", "--gpu", "t4"];

fn whatif(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec!["whatif".into()];
    args.extend(FIXED.iter().map(|s| s.to_string()));
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn refs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

#[test]
fn every_row_is_what_predict_says() {
    let args = whatif(&[
        "--vary",
        "precision=fp32,amp-bf16",
        "--vary",
        "batch=1,64",
        "--vary",
        "alloc-conf=,expandable_segments:True",
    ]);
    let rows = json(&refs(&args));
    let rows = rows.as_array().expect("a list of rows");
    assert_eq!(rows.len(), 8);
    for row in rows {
        let options = &row["options"];
        let mut predict: Vec<String> = vec!["predict".into()];
        predict.extend(FIXED.iter().map(|s| s.to_string()));
        for key in ["precision", "batch", "alloc-conf"] {
            predict.push(format!("--{key}={}", options[key].as_str().unwrap()));
        }
        let expected = json(&refs(&predict));
        for field in [
            "fits",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "peak_device_used_bytes",
            "peak_requested_bytes",
            "params",
            "peak_phase",
        ] {
            assert_eq!(row[field], expected[field], "{field} of {options}");
        }
        assert_eq!(row["oom"]["message"], expected["oom"]["message"]);
        assert_eq!(
            row["effective_batch"].as_u64(),
            options["batch"].as_str().unwrap().parse::<u64>().ok()
        );
        let step = &row["step_time"];
        assert!(step["step_ms"].as_f64().unwrap() > 0.0);
        assert!(step["factor"].as_f64().unwrap() >= 1.0 - 1e-9);
        assert_eq!(step["gpu_figures"], "t4");
    }
    // those that fit first, by peak; then those that run out of memory
    let key = |r: &Value| {
        (
            !r["fits"].as_bool().unwrap(),
            r["peak_device_used_bytes"].as_u64().unwrap(),
        )
    };
    assert!(rows.windows(2).all(|w| key(&w[0]) <= key(&w[1])));
    assert!(rows.iter().any(|r| r["fits"] == true) && rows.iter().any(|r| r["fits"] == false));
}

#[test]
fn checkpointing_and_accumulation_cost_what_the_step_model_says() {
    let args = whatif(&[
        "--precision",
        "amp-bf16",
        "--batch",
        "4",
        "--vary",
        "checkpoint=none,full",
        "--vary",
        "accum=1,4",
    ]);
    let rows = json(&refs(&args));
    let find = |ckpt: &str, accum: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["options"]["checkpoint"] == ckpt && r["options"]["accum"] == accum)
            .unwrap()["step_time"]
            .clone()
    };
    let factor = |s: Value| s["factor"].as_f64().unwrap();
    assert!((factor(find("none", "1")) - 1.0).abs() < 1e-9);
    let full = factor(find("full", "1"));
    assert!(full > 1.15 && full < 1.45, "full checkpointing: {full}");
    let accum = factor(find("none", "4"));
    assert!(accum > 3.0 && accum < 4.2, "accumulation over 4: {accum}");
    assert_eq!(
        rows.as_array()
            .unwrap()
            .iter()
            .filter(|r| r["effective_batch"] == 16)
            .count(),
        2
    );
}

#[test]
fn table_and_csv() {
    let spec = "alloc-conf=;max_split_size_mb:128,garbage_collection_threshold:0.6";
    let args = whatif(&["--vary", "batch=1,2", "--vary", spec]);
    let output = succeeds(&refs(&args));
    let table = stdout(&output);
    for expected in [
        "whatif   4 configurations: batch (2) × alloc-conf (2)",
        "device used",
        "eff. batch",
        "step (ms)",
        "× plain",
        "4 of 4 fit",
        "max_split_size_mb:128,garbage_collection_threshold:0.6",
    ] {
        assert!(
            table.contains(expected),
            "table lacks {expected:?}:\n{table}"
        );
    }

    let mut csv_args = args.clone();
    csv_args.push("--csv".into());
    let output = succeeds(&refs(&csv_args));
    let csv = stdout(&output);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 5, "{csv}");
    assert!(lines[0].starts_with("batch,alloc-conf,model,batch,seq,precision"));
    assert!(lines[0].contains("peak_device_used_bytes") && lines[0].contains("step_ms"));
    // a value holding commas is quoted
    assert!(csv.contains("\"max_split_size_mb:128,garbage_collection_threshold:0.6\""));
}

#[test]
fn bar_chart_in_png_and_svg() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("whatif-cli");
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["bars.png", "bars.svg"] {
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        let args = whatif(&[
            "--vary",
            "precision=fp32,amp-bf16",
            "--vary",
            "batch=1,64",
            "--plot",
            path.to_str().unwrap(),
        ]);
        succeeds(&refs(&args));
        let bytes = std::fs::read(&path).unwrap();
        if name.ends_with(".png") {
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        } else {
            let text = String::from_utf8(bytes).unwrap();
            for label in [
                "gpt2: what if",
                "batch 64",
                "OOM",
                "memory (GiB)",
                "peak reserved",
            ] {
                assert!(text.contains(label), "SVG lacks {label:?}");
            }
        }
    }
}

#[test]
fn bad_grids_are_refused_with_what_would_be_valid() {
    // a complete configuration but for what is varied
    let fail = |extra: &[&str], fragments: &[&str]| {
        let mut all = vec!["--batch", "1"];
        all.extend_from_slice(extra);
        let args = whatif(&all);
        assert_fails(&refs(&args), fragments);
    };
    let fail_unbatched = |extra: &[&str], fragments: &[&str]| {
        let args = whatif(extra);
        assert_fails(&refs(&args), fragments);
    };
    // unknown key: the valid ones are listed
    fail(
        &["--vary", "colour=red"],
        &[
            "unknown --vary key \"colour\"",
            "precision",
            "checkpoint",
            "alloc-conf",
        ],
    );
    // unknown values: predict's own lists
    fail(
        &["--vary", "precision=fp32,fp64"],
        &[
            "\"fp64\"",
            "--vary precision",
            "fp32, bf16, amp-fp16, amp-bf16",
        ],
    );
    fail(
        &["--vary", "checkpoint=full,often"],
        &["\"often\"", "none, full, every:K, selective, sqrt"],
    );
    assert_fails(
        &["whatif", "--batch", "1", "--vary", "model=gpt2,gpt5"],
        &["\"gpt5\"", "gpt2-medium", "llama2-7b"],
    );
    assert_fails(
        &[
            "whatif",
            "--model",
            "gpt2",
            "--batch",
            "1",
            "--vary",
            "gpu=rtx4090,rtx9999",
        ],
        &["\"rtx9999\"", "h100-80gb"],
    );
    fail_unbatched(
        &["--vary", "batch=8,0"],
        &["\"0\"", "batch must be a whole number"],
    );
    fail(&["--vary", "inference=maybe"], &["flag", "true, false"]);
    fail(&["--vary", "accum"], &["KEY=V1,V2"]);
    // empty grids
    fail(&[], &["empty grid", "--vary KEY=V1,V2"]);
    fail(&["--vary", "accum="], &["empty grid", "--vary accum="]);
    // too many configurations: refused before anything is evaluated, with the count
    let eleven = "1,2,3,4,5,6,7,8,9,10,11";
    let specs: Vec<String> = [
        "accum",
        "iterations",
        "optimizer",
        "context",
        "memory-fraction",
        "alloc-conf",
    ]
    .iter()
    .map(|k| format!("{k}={eleven}"))
    .collect();
    let mut extra: Vec<&str> = Vec::new();
    for spec in &specs {
        extra.push("--vary");
        extra.push(spec);
    }
    fail(
        &extra,
        &[
            "1,771,561 configurations",
            "1,000,000",
            "11 accum × 11 iterations",
        ],
    );
    // fixed and varied at once
    fail(
        &["--vary", "batch=1,2"],
        &["--batch is both fixed and varied"],
    );
    // incomplete: predict's own complaint
    fail_unbatched(&["--vary", "accum=1,2"], &["--batch"]);
    // no model
    assert_fails(
        &["whatif", "--vary", "batch=1,2"],
        &["--model", "--hf-config"],
    );
}

#[test]
fn heads_losses_and_kept_outputs_vary_like_any_predict_option() {
    let args = whatif(&[
        "--batch",
        "2",
        "--vary",
        "head=lm,seq-cls:2,none",
        "--vary",
        "keep-outputs=false,true",
    ]);
    let rows = json(&refs(&args));
    let rows = rows.as_array().expect("a list of rows");
    assert_eq!(rows.len(), 6);
    for row in rows {
        let options = &row["options"];
        let mut predict: Vec<String> = vec!["predict".into(), "--batch=2".into()];
        predict.extend(FIXED.iter().map(|s| s.to_string()));
        predict.push(format!("--head={}", options["head"].as_str().unwrap()));
        if options["keep-outputs"] == "true" {
            predict.push("--keep-outputs".into());
        }
        let expected = json(&refs(&predict));
        assert_eq!(
            row["peak_requested_bytes"],
            expected["peak_requested_bytes"]
        );
        assert_eq!(row["params"], expected["params"]);
        assert_eq!(row["recipe"]["head"], options["head"]);
    }
    let bad = whatif(&["--batch", "2", "--vary", "head=lm,seq-cls:0"]);
    assert_fails(&refs(&bad), &["seq-cls:0"]);
}
