//! Real training steps measured on an H100 (`testdata/h100-train-steps/`, recorded by
//! `validate/python/train_step_gpu.py`): the capture zoo's models run for real with PyTorch 2.11 and
//! CUDA 13 (21 recipes and 3 PEFT LoRA fine-tunings with the default allocator settings, 10 of
//! the recipes again with `expandable_segments:True`), their allocator peaks read with
//! `torch.cuda.max_memory_allocated/reserved` per phase, and their memory histories dumped as
//! snapshots.
//!
//! Two claims are checked against the hardware, not against vramsim's own output:
//!
//! * the caching-allocator model replays every snapshot's history segment for segment
//!   (`check-snapshot`: every `cudaMalloc`/`cudaFree` the GPU made, at its size and in its order);
//! * `predict` of the same recipe gives the measured peaks. The measured runs differ from vramsim's
//!   reference versions in a few known, unmodelled ways, which set the tolerances:
//!   - PyTorch 2.11 keeps its cuBLASLt workspace (1 MiB) apart from the cuBLAS one, where 2.15's
//!     persistent workspaces are unified (`--cublas-workspace-cache`): −1 MiB on every step;
//!   - transformers 5.17 (measured) against 5.23 (modelled) makes its masks and position ids with
//!     a few other small temporaries;
//!   - cuDNN's convolution workspaces are cuDNN-internal and not modelled: a ResNet's predicted peak
//!     is below the measured one (by 2.4% here), never above.
//!
//!   So: every phase's peak allocated within 0.25% of the step's measured peak for the transformers
//!   and the MLP (the largest difference measured is 16 MiB in a 7.6 GB step), the step's peak
//!   reserved within 1.5%; for the ResNet every phase's peak within 3% of the step's and at most the
//!   measured one, and the peak reserved at most the measured one (its workspaces' segments are
//!   missing: 24% in fp32). Before the lowering followed CUDA's
//!   dropout mask order, softmax backward's `grad * output` temporary and the out-of-place sum of a
//!   tied embedding's view gradient, GPT-2's backward peak was 148 MiB (7%) low and its reserved peak
//!   up to 1.6 GB low: these bounds fail on that code.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/h100-train-steps");

const MIB: f64 = 1024.0 * 1024.0;

/// The measured steps: (name, the measurement's JSON).
fn measurements() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(DIR).expect("testdata/h100-train-steps is missing") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".json") {
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((stem.to_string(), serde_json::from_str(&text).unwrap()));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        out.len() >= 34,
        "expected the 34 measured steps in {DIR}, found {}",
        out.len()
    );
    out
}

fn vramsim(args: &[String]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_vramsim"))
        .args(args)
        .output()
        .expect("the vramsim binary runs");
    assert!(
        out.status.success(),
        "vramsim {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints JSON")
}

/// `vramsim predict` options for the recipe a measurement ran (what `train_step_gpu.py compare` uses).
fn predict_args(m: &Value) -> Vec<String> {
    let r = &m["recipe"];
    let s = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut args: Vec<String> = vec![
        "predict".into(),
        "--model".into(),
        s(&r["model"]),
        "--batch".into(),
        s(&r["batch"]),
        "--precision".into(),
        s(&r["dtype"]),
        "--optimizer".into(),
        s(&r["optimizer"]),
        "--checkpoint".into(),
        s(&r["checkpoint"]),
        "--accum".into(),
        s(&r["accum"]),
        "--iterations".into(),
        s(&m["iterations"]),
        "--gpu".into(),
        "h100".into(),
        "--context".into(),
        s(&m["context_bytes"]),
        "--json".into(),
    ];
    if let Some(lora) = r["lora"].as_str() {
        args.extend(["--lora".into(), lora.into()]);
    }
    if let Some(conf) = r["alloc_conf"].as_str() {
        args.extend(["--alloc-conf".into(), conf.into()]);
    }
    let torch = m["versions"]["torch"].as_str().unwrap();
    let mut parts = torch
        .split(['.', '+'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let version = (parts.next().unwrap(), parts.next().unwrap());
    if version < (2, 15) {
        // PyTorch <= 2.14 keeps one cuBLAS workspace per (handle, stream) (CublasHandlePool.cpp).
        args.push("--cublas-workspace-cache".into());
    }
    let model = r["model"].as_str().unwrap();
    if model != "mlp" && model != "resnet18" {
        let attention = match r["attention"].as_str().unwrap() {
            "sdpa" => "auto".to_string(), // PyTorch's own choice, as transformers' default
            other => other.to_string(),
        };
        args.extend([
            "--seq".into(),
            s(&r["seq"]),
            "--use-cache".into(),
            "false".into(),
            "--attention".into(),
            attention,
        ]);
    }
    args
}

/// Each phase's peak allocated bytes, the largest over its occurrences.
fn measured_phases(m: &Value) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for p in m["phases"].as_array().unwrap() {
        let e = out
            .entry(p["phase"].as_str().unwrap().to_string())
            .or_insert(0);
        *e = (*e).max(p["peak_allocated"].as_u64().unwrap());
    }
    out
}

fn predicted_phases(p: &Value) -> BTreeMap<String, u64> {
    p["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ph| {
            (
                ph["name"].as_str().unwrap().to_string(),
                ph["peak_allocated_bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn rel(predicted: u64, measured: u64) -> f64 {
    (predicted as f64 - measured as f64) / measured as f64
}

#[test]
fn predictions_match_the_peaks_measured_on_an_h100() {
    let mut failures = Vec::new();
    for (name, m) in measurements() {
        let p = vramsim(&predict_args(&m));
        let conv = m["recipe"]["model"].as_str() == Some("resnet18");
        let phase_tol = if conv { 0.03 } else { 0.0025 };
        let step_peak = m["peak_allocated"].as_u64().unwrap();
        let measured = measured_phases(&m);
        for (phase, predicted) in predicted_phases(&p) {
            let Some(&real) = measured.get(&phase) else {
                failures.push(format!("{name}: phase {phase} was not measured"));
                continue;
            };
            // relative to the step's peak: the error budget of the step, whatever the phase
            let d = rel(predicted, real) * real as f64 / step_peak as f64;
            println!(
                "{name:<54} {phase:<10} measured {real:>14} predicted {predicted:>14} ({:+.2} MiB, {:+.3}% of the step's peak)",
                (predicted as f64 - real as f64) / MIB,
                100.0 * d
            );
            if d.abs() > phase_tol || (conv && predicted > real) {
                failures.push(format!(
                    "{name}: {phase} peak allocated {predicted} vs measured {real} ({:+.3}% of the step's peak)",
                    100.0 * d
                ));
            }
        }
        let (real, predicted) = (
            m["peak_reserved"].as_u64().unwrap(),
            p["peak_reserved_bytes"].as_u64().unwrap(),
        );
        let d = rel(predicted, real);
        println!(
            "{name:<54} reserved   measured {real:>14} predicted {predicted:>14} ({:+.3}%)",
            100.0 * d
        );
        if (conv && predicted > real) || (!conv && d.abs() > 0.015) {
            failures.push(format!(
                "{name}: peak reserved {predicted} vs measured {real} ({:+.3}%)",
                100.0 * d
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn snapshot_path(name: &str) -> PathBuf {
    Path::new(DIR).join(format!("{name}.snapshot.pickle.gz"))
}

#[test]
fn the_allocator_model_replays_every_measured_step_segment_for_segment() {
    for (name, _) in measurements() {
        let path = snapshot_path(&name);
        let r = vramsim(&[
            "check-snapshot".into(),
            path.to_string_lossy().into_owned(),
            "--json".into(),
        ]);
        let recorded = r["segment_events_recorded"].as_u64().unwrap();
        assert!(recorded > 0, "{name}: no segment event in the history");
        assert_eq!(
            r["segment_events_matched"], recorded,
            "{name}: first divergence {}",
            r["first_divergence"]
        );
        assert_eq!(
            r["final_reserved_simulated"], r["final_reserved_recorded"],
            "{name}"
        );
        assert_eq!(
            r["final_allocated_simulated"], r["final_allocated_recorded"],
            "{name}"
        );
        assert!(r["first_divergence"].is_null(), "{name}");
    }
}

/// The "this process has X GiB memory in use" figure of an out-of-memory message, and the message
/// without it.
fn split_in_use(message: &str) -> (String, f64) {
    let (head, tail) = message
        .split_once("this process has ")
        .expect("the message names the memory in use");
    let (figure, rest) = tail.split_once(" GiB memory in use").unwrap();
    (format!("{head}{rest}"), figure.parse().unwrap())
}

#[test]
fn the_largest_batch_and_the_out_of_memory_message_are_the_h100s() {
    // Measured: GPT-2 at 1024 tokens, fp32, AdamW, eager attention: batch 25 ran (its peaks are one of
    // the measurements above), batch 26 ran out of memory with this message.
    let real =
        std::fs::read_to_string(Path::new(DIR).join("gpt2__b26s1024__fp32-adamw.oom.txt")).unwrap();
    let args: Vec<String> = [
        "max-batch",
        "--model",
        "gpt2",
        "--seq",
        "1024",
        "--precision",
        "fp32",
        "--optimizer",
        "adamw",
        "--attention",
        "eager",
        "--use-cache",
        "false",
        "--gpu",
        "h100",
        "--cublas-workspace-cache",
        "--iterations",
        "2",
        "--json",
    ]
    .map(String::from)
    .into();
    let r = vramsim(&args);
    assert_eq!(r["max_batch"], 25);
    assert_eq!(r["first_failure"]["batch"], 26);
    let predicted = r["first_failure"]["message"].as_str().unwrap();
    // Everything the allocator decides (the request, the total, what is free, what PyTorch holds) is
    // the same text; the memory in use outside it may differ by 0.01 GiB: the out-of-memory error comes
    // in the first iteration, before the optimizer's kernels are loaded, and vramsim counts the kernels
    // a whole step loads (sim's MODULE_MEASUREMENTS).
    let (real_rest, real_in_use) = split_in_use(real.trim());
    let (predicted_rest, predicted_in_use) = split_in_use(predicted);
    assert_eq!(predicted_rest, real_rest);
    assert!(
        (predicted_in_use - real_in_use).abs() <= 0.011,
        "{predicted_in_use} vs {real_in_use}"
    );
}
