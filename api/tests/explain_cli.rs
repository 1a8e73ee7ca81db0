//! `vramsim explain` end to end: the message as an argument or on standard input, the table and the
//! JSON fields the issue names, the remedies replayed with a model (only those that fit), and exit
//! status 2 saying what was not found for bad input.

mod common;
use std::io::Write;
use std::process::{Command, Stdio};

use common::{assert_fails, json, stdout, succeeds};

const MESSAGE: &str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.78 GiB. GPU 0 has a \
total capacity of 31.47 GiB of which 12.73 GiB is free. Including non-PyTorch memory, this process has \
18.73 GiB memory in use. Of the allocated memory 9.08 GiB is allocated by PyTorch, and 9.35 GiB is \
reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting \
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.";

#[test]
fn json_has_the_fields_the_issue_names() {
    let doc = json(&["explain", MESSAGE]);
    for field in [
        "framework",
        "device",
        "requested_bytes",
        "capacity_bytes",
        "free_bytes",
        "pytorch_allocated_bytes",
        "pytorch_reserved_unallocated_bytes",
        "this_process_bytes",
        "processes",
        "non_pytorch_bytes",
        "cause",
        "shortfall_bytes",
        "remedies",
    ] {
        assert!(doc.get(field).is_some(), "{field} missing: {doc}");
    }
    assert_eq!(doc["framework"], "pytorch");
    assert_eq!(doc["device"], "GPU 0");
    assert_eq!(doc["cause"], "capacity");
    // 22.78 − 12.73 − 9.35 = 0.70 GiB, taken at face value
    let gib = (1u64 << 30) as f64;
    let short = doc["shortfall_bytes"].as_u64().unwrap() as f64 / gib;
    assert!((short - 0.70).abs() < 1e-6, "{short}");
    // this process: 18.73 GiB, less reserved 9.08 + 9.35 = 18.43 GiB outside PyTorch: 0.30 GiB
    let outside = doc["non_pytorch_bytes"].as_u64().unwrap() as f64 / gib;
    assert!((outside - 0.30).abs() < 1e-6, "{outside}");
    assert!(doc["remedies"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["kind"] == "shed_bytes"));
}

#[test]
fn standard_input_takes_a_multi_line_paste() {
    let wrapped = MESSAGE.replace(". ", ".\n    ");
    for args in [vec!["explain", "-"], vec!["explain"]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vramsim"))
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(wrapped.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("cause      capacity"), "{text}");
        assert!(text.contains("22.78 GiB"), "{text}");
    }
}

#[test]
fn the_table_states_the_rule() {
    let text = stdout(&succeeds(&["explain", MESSAGE]));
    assert!(text.contains("rule       exceeds_device if"), "{text}");
    assert!(text.contains("shortfall"), "{text}");
}

#[test]
fn bad_input_exits_2_saying_what_was_not_found() {
    assert_fails(
        &["explain", "ValueError: the shapes do not match"],
        &[
            "no out-of-memory message found",
            "Tried to allocate",
            "OOM when allocating tensor",
        ],
    );
    assert_fails(
        &[
            "explain",
            "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 3.69 MiB is free.",
        ],
        &["Of the allocated memory", "is reserved by PyTorch but unallocated"],
    );
    assert_fails(
        &[
            "explain",
            "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 10.76 GiB total capacity; 21.12 MiB free; 9.88 GiB reserved in total by PyTorch)",
        ],
        &["\"already allocated\""],
    );
}

#[test]
fn a_device_on_the_command_line_decides_a_tensorflow_message() {
    // 500·17·17·4032 floats = 2,330,496,000 bytes: more than a 2 GiB device, less than an H100
    let tf = "ResourceExhaustedError: OOM when allocating tensor with shape[500,17,17,4032] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc";
    assert_eq!(json(&["explain", tf])["cause"], "undecided");
    assert_eq!(
        json(&["explain", tf, "--capacity", "2GiB"])["cause"],
        "exceeds_device"
    );
    let big = json(&["explain", tf, "--gpu", "h100-80gb"]);
    assert_eq!(big["cause"], "undecided");
    assert_eq!(
        big["possible_causes"],
        serde_json::json!(["fragmentation", "capacity"])
    );
}

#[test]
fn with_a_model_only_the_remedies_that_fit_are_listed() {
    // vramsim's own message for GPT-2, batch 64 × 512 on a 4 GiB device
    let predicted = json(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "64",
        "--seq",
        "512",
        "--capacity",
        "4GiB",
    ]);
    let message = predicted["oom"]["message"]
        .as_str()
        .expect("it runs out of memory");
    let doc = json(&[
        "explain", message, "--model", "gpt2", "--batch", "64", "--seq", "512",
    ]);
    let checked = &doc["checked"];
    assert_eq!(checked["fits"], false);
    // the device is the message's: 4.00 GiB
    assert_eq!(checked["device_total_bytes"], 4u64 << 30);
    let total = checked["device_total_bytes"].as_u64().unwrap();
    let replayed: Vec<&serde_json::Value> = doc["remedies"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == "whatif" || r["kind"] == "max_batch")
        .collect();
    assert!(!replayed.is_empty(), "{doc}");
    for r in replayed {
        assert!(r["peak_device_used_bytes"].as_u64().unwrap() <= total);
        // the command it gives is predict's, and predict agrees that it fits
        let command = r["command"].as_str().unwrap();
        let words: Vec<String> = command
            .split_whitespace()
            .skip(1)
            .map(|w| w.trim_matches('\'').to_string())
            .collect();
        let mut args: Vec<&str> = words.iter().map(String::as_str).collect();
        args.retain(|w| !w.is_empty());
        let p = json(&args);
        assert_eq!(p["fits"], true, "{command}");
    }
}

#[test]
fn with_a_recorded_run_only_the_allocator_settings_that_fit_are_listed() {
    // tests/data/oom/fragmented.jsonl: a 60 MiB block is cached, then split by a 20 MiB and a 30 MiB
    // tensor; the 20 MiB one is freed and 45 MiB is asked for on a 100 MiB device. By hand: the
    // request's segment is 46 MiB (2 MiB rounding, §1.4); 40 MiB are free and 30 MiB are cached in
    // the split segment, so 46 ≤ 70: fragmentation. Replayed: with expandable_segments the 10 MiB
    // free at the segment's end grows by 36 MiB of the 40 free (§7.2); with max_split_size_mb:46 the
    // 60 MiB block serves no smaller request (§3.1), the 20 MiB tensor gets its own segment, the cached
    // block is released when the 30 MiB one needs room (§5.2), and the 46 MiB segment then fits in the
    // 50 MiB left; with 128 or 512 the block splits as by default.
    let run = "api/tests/data/oom/fragmented.jsonl";
    let replayed = json(&["replay", run, "--capacity", "100MiB"]);
    let message = replayed["oom"]["message"]
        .as_str()
        .expect("it runs out of memory");
    let doc = json(&["explain", message, "--snapshot", run]);
    assert_eq!(doc["cause"], "fragmentation");
    assert_eq!(doc["checked_snapshot"]["fits"], false);
    let fitting: Vec<&str> = doc["remedies"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == "allocator_whatif")
        .map(|r| r["command"].as_str().unwrap().rsplit(' ').next().unwrap())
        .collect();
    assert_eq!(
        fitting,
        ["expandable_segments:True", "max_split_size_mb:46"]
    );
    assert_eq!(doc["checked_snapshot"]["settings_tried"], 4);
}
