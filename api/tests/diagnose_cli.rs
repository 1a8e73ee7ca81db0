//! `vramsim diagnose` end to end: a synthetic leak (one activation kept per iteration) with and without
//! phases, a steady training step, a fragmentation OOM that the replay shows two remedies avoid, the real
//! snapshots of `testdata/snapshots/` that end in an OOM, and a snapshot without history. Every expected
//! figure is derived here from the trace's construction or from the snapshot's own entries.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{json, Value};

const MIB: u64 = 1 << 20;
const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/snapshots");
const NESTA: &str = "Nesta-gitU__discrete_diffusion__memory_snapshot.json__1ab3368e.pickle.gz";
const CONSTRUCTOR: &str =
    "Constructor-Sun__code_location__memory_snapshot.pickle__b5ef67ce.pickle.gz";

fn vramsim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vramsim"))
        .args(args)
        .output()
        .expect("the vramsim binary runs")
}

fn diagnose(args: &[&str]) -> Value {
    let mut all = vec!["diagnose"];
    all.extend_from_slice(args);
    all.push("--json");
    let output = vramsim(&all);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("diagnose_cli");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write_trace(name: &str, events: &[Value]) -> PathBuf {
    let path = tmp(name);
    let mut text = json!({"format": "vramsim-trace", "version": 1, "meta": {}}).to_string();
    for e in events {
        text.push('\n');
        text.push_str(&e.to_string());
    }
    std::fs::write(&path, text).unwrap();
    path
}

fn snapshot(name: &str) -> PathBuf {
    let path = Path::new(DIR).join(name);
    assert!(
        path.exists(),
        "{} is missing: the test data is not there",
        path.display()
    );
    path
}

/// The kept activation: 1 MiB + 512 bytes, so that no rounding hides it.
const KEPT: u64 = MIB + 512;
const ITERATIONS: u64 = 6;

/// A training loop of [`ITERATIONS`] iterations over 10 MiB of parameters whose loss keeps one
/// activation alive per iteration (`losses.append(loss)` without `.item()`).
fn leaky_loop(phases: bool) -> Vec<Value> {
    let mut e = vec![
        json!({"op": "alloc", "id": "params", "size": 10 * MIB, "category": "parameter", "tag": "model.weight"}),
    ];
    for k in 0..ITERATIONS {
        if phases {
            e.push(json!({"op": "phase", "name": "forward"}));
        }
        e.push(json!({"op": "alloc", "id": format!("act1.{k}"), "size": 4 * MIB, "category": "activation", "tag": "layer1"}));
        e.push(json!({"op": "alloc", "id": format!("act2.{k}"), "size": 8 * MIB, "category": "activation", "tag": "layer2"}));
        e.push(json!({"op": "alloc", "id": format!("loss.{k}"), "size": KEPT, "category": "activation", "tag": "train.py:42 losses.append(loss)"}));
        if phases {
            e.push(json!({"op": "phase", "name": "backward"}));
        }
        e.push(json!({"op": "free", "id": format!("act1.{k}")}));
        e.push(json!({"op": "free", "id": format!("act2.{k}")}));
    }
    e
}

#[test]
fn a_leak_of_one_activation_per_iteration_is_found_exactly() {
    for phases in [true, false] {
        let path = write_trace(&format!("leak_{phases}.jsonl"), &leaky_loop(phases));
        let d = diagnose(&[
            path.to_str().unwrap(),
            "--allocator",
            "cuda-malloc",
            "--capacity",
            "64MiB",
        ]);
        assert_eq!(d["iterations"]["count"], ITERATIONS, "{d}");
        if !phases {
            assert_eq!(
                d["iterations"]["detected_by"],
                "a repeating pattern of 3 allocations"
            );
        }
        assert_eq!(d["growth_bytes_per_iteration"], KEPT);
        let leaks = d["leaks"].as_array().unwrap();
        assert_eq!(leaks.len(), 1, "{leaks:?}");
        assert_eq!(leaks[0]["site"], "train.py:42 losses.append(loss)");
        // the inner iterations (the first and last are left out): 4 of 6
        assert_eq!(leaks[0]["bytes"], KEPT * (ITERATIONS - 2));
        assert_eq!(leaks[0]["iterations"], ITERATIONS - 2);
        // no caching (cuda-malloc): the peak is 10 MiB + 12 MiB + 6 kept in the last iteration; each
        // later iteration adds one more, and iteration n (0-based) peaks at 22 MiB + (n + 1) × KEPT:
        // the first over 64 MiB is n = 6 + floor((64 MiB − peak) / KEPT)
        let peak = 22 * MIB + ITERATIONS * KEPT;
        assert_eq!(d["peaks"]["allocated_bytes"], peak);
        let n = ITERATIONS + (64 * MIB - peak) / KEPT;
        assert_eq!(d["projected_oom_iteration"], n);
        assert!(22 * MIB + (n + 1) * KEPT > 64 * MIB && 22 * MIB + n * KEPT <= 64 * MIB);
    }
}

#[test]
fn a_steady_training_step_has_no_growth() {
    let trace = tmp("steady.jsonl");
    let output = vramsim(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--iterations",
        "4",
        "--trace-out",
        trace.to_str().unwrap(),
    ]);
    assert!(output.status.success());
    let d = diagnose(&[trace.to_str().unwrap()]);
    assert_eq!(d["iterations"]["count"], 4);
    assert_eq!(d["iterations"]["detected_by"], "phase 'forward'");
    assert_eq!(d["growth_bytes_per_iteration"], 0);
    assert_eq!(d["leaks"], json!([]));
    assert_eq!(d["projected_oom_iteration"], Value::Null);
    assert_eq!(d["oom"], Value::Null);
    // with growth zero, the live bytes at each iteration start after the first are the same
    let live = d["iterations"]["live_bytes_at_start"].as_array().unwrap();
    assert!(live[1..].iter().all(|v| v == &live[1]), "{live:?}");
}

#[test]
fn fragmentation_is_named_and_the_remedies_that_avoid_it_are_verified() {
    // 1 GiB device. A 600 MiB segment is freed, then cut for two 200 MiB tensors; one is freed. 700 MiB
    // fits no cached block, the device has 424 MiB free, and the segment cannot be released (a tensor
    // lives in it): OOM with 200 MiB live and 400 MiB reserved but unallocated. 200 + 700 fit 1 GiB:
    // fragmentation decides. With max_split_size_mb below 600, the 600 MiB block is not cut for 200 MiB
    // requests (they get their own segments: 600 + 200 + 200 = 1000 MiB reserved), and the OOM path
    // releases the two free segments: 700 MiB fits.
    let path = write_trace(
        "frag.jsonl",
        &[
            json!({"op": "alloc", "id": "a", "size": 600 * MIB}),
            json!({"op": "free", "id": "a"}),
            json!({"op": "alloc", "id": "b", "size": 200 * MIB}),
            json!({"op": "alloc", "id": "c", "size": 200 * MIB, "tag": "model.py:7"}),
            json!({"op": "free", "id": "b"}),
            json!({"op": "alloc", "id": "d", "size": 700 * MIB}),
        ],
    );
    let png = tmp("frag.png");
    let d = diagnose(&[
        path.to_str().unwrap(),
        "--capacity",
        "1GiB",
        "--plot",
        png.to_str().unwrap(),
    ]);
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    let cause = &d["oom_cause"];
    assert_eq!(cause["decided_by"], "fragmentation");
    assert_eq!(cause["live_tensor_bytes"], 200 * MIB);
    assert_eq!(cause["reserved_unallocated_bytes"], 400 * MIB);
    assert_eq!(cause["requested_bytes"], 700 * MIB);
    assert_eq!(
        cause["live_by_site"][0],
        json!({"site": "model.py:7", "bytes": 200 * MIB})
    );
    assert_eq!(
        cause["live_by_category"],
        json!([{"category": "other", "bytes": 200 * MIB}])
    );
    let remedies = d["remedies"].as_array().unwrap();
    for mb in [128, 256, 512] {
        let r = remedies
            .iter()
            .find(|r| r["setting"] == format!("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:{mb}"))
            .unwrap();
        assert_eq!(r["avoids_oom"], true);
        assert_eq!(r["peaks"]["reserved_bytes"], 1000 * MIB);
        assert_eq!(r["peaks"]["allocated_bytes"], 900 * MIB);
    }
}

#[test]
fn the_real_snapshots_that_end_in_an_oom_are_explained() {
    // Both recorded OOMs: the request (the snapshot's `oom` entry) on top of the live tensors exceeds the
    // device (total = what the history implies), so no allocator setting can avoid them.
    for (name, device, request) in [
        (NESTA, None, 402653184u64),
        (CONSTRUCTOR, Some("1"), 5308694528),
    ] {
        let path = snapshot(name);
        let mut args = vec![path.to_str().unwrap()];
        if let Some(d) = device {
            args.extend(["--device", d]);
        }
        let d = diagnose(&args);
        let cause = &d["oom_cause"];
        assert_eq!(cause["requested_bytes"], request, "{name}");
        assert_eq!(cause["decided_by"], "live_tensors", "{name}");
        let live = cause["live_tensor_bytes"].as_u64().unwrap();
        assert!(live + request > cause["total_memory_bytes"].as_u64().unwrap());
        assert!(!cause["live_by_site"].as_array().unwrap().is_empty());
        // the sites are the user's Python lines, not PyTorch's internals
        let top = cause["live_by_site"][0]["site"].as_str().unwrap();
        assert!(top.contains(".py:") && !top.contains("torch/"), "{top}");
        let remedies = d["remedies"].as_array().unwrap();
        assert!(!remedies.is_empty());
        assert!(remedies.iter().all(|r| r["avoids_oom"] == false), "{name}");
        // the table says so
        let mut table_args = vec!["diagnose"];
        table_args.extend(args.iter().copied());
        let table = String::from_utf8(vramsim(&table_args).stdout).unwrap();
        assert!(table.contains("none of the candidates avoids the out-of-memory error"));
        assert!(table.contains("cause    live_tensors"));
    }
}

#[test]
fn a_snapshot_without_history_is_refused_with_how_to_record_one() {
    let mut snap = vramsim_traces::snapshot::load_snapshot_file(snapshot(NESTA)).unwrap();
    for t in &mut snap.device_traces {
        t.clear();
    }
    let path = tmp("no_history.pickle");
    vramsim_traces::snapshot::write_snapshot_file(&path, &snap).unwrap();
    let output = vramsim(&["diagnose", path.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("no trace recorded"), "{err}");
    assert!(err.contains("_record_memory_history"), "{err}");
    assert!(!err.contains("panicked"));
}

#[test]
fn a_known_model_step_is_retried_with_smaller_batches() {
    // gpt2 at batch 8 and 4: a capacity between their peaks makes 8 fail and 4 fit.
    let peak = |batch: &str| -> u64 {
        let out = vramsim(&[
            "predict",
            "--model",
            "gpt2",
            "--batch",
            batch,
            "--seq",
            "256",
            "--capacity",
            "80GiB",
            "--json",
        ]);
        assert!(out.status.success());
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        json["peak_device_used_bytes"].as_u64().unwrap()
    };
    let (p8, p4) = (peak("8"), peak("4"));
    assert!(p4 < p8);
    let capacity = ((p4 + p8) / 2).to_string();
    let trace = tmp("gpt2_b8.jsonl");
    let out = vramsim(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "8",
        "--seq",
        "256",
        "--trace-out",
        trace.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let d = diagnose(&[trace.to_str().unwrap(), "--capacity", &capacity]);
    assert!(d["oom"].is_object(), "{d}");
    let remedies = d["remedies"].as_array().unwrap();
    let b4 = remedies
        .iter()
        .find(|r| r["name"] == "batch 4 instead of 8")
        .expect("the half batch is tried");
    assert_eq!(b4["avoids_oom"], true);
    assert!(b4["peaks"]["device_used_bytes"].as_u64().unwrap() <= p4);
    assert!(remedies.iter().any(|r| r["name"] == "batch 6 instead of 8"));
}

#[test]
fn a_bfc_memory_limit_is_named_and_no_remedy_is_claimed() {
    // TF BFC preallocating a 100 MiB limit on a 1 GiB device: the first 60 MiB takes the whole 100 MiB
    // chunk (100 < 2 × 60 and 40 MiB < 128 MiB: not split); the second 60 MiB finds no chunk and no
    // room to extend. 100 + 60 MiB fit the device but not the limit. With growth, the region for the
    // first is 64 MiB (2 MiB doubled until it holds 60) and the 36 MiB left cannot hold the second;
    // cuda_malloc_async's pool is held to the same 100 MiB.
    let path = write_trace(
        "bfc_limit.jsonl",
        &[
            json!({"op": "alloc", "id": 1, "size": 60 * MIB}),
            json!({"op": "alloc", "id": 2, "size": 60 * MIB}),
        ],
    );
    let d = diagnose(&[
        path.to_str().unwrap(),
        "--allocator",
        "tf-bfc",
        "--capacity",
        "1GiB",
        "--memory-limit",
        "100MiB",
    ]);
    let cause = &d["oom_cause"];
    assert_eq!(cause["decided_by"], "memory_limit");
    assert_eq!(cause["memory_limit_bytes"], 100 * MIB);
    assert_eq!(cause["live_tensor_bytes"], 100 * MIB);
    let remedies = d["remedies"].as_array().unwrap();
    let settings: Vec<&str> = remedies
        .iter()
        .map(|r| r["setting"].as_str().unwrap())
        .collect();
    assert_eq!(
        settings,
        [
            "TF_GPU_ALLOCATOR=cuda_malloc_async",
            "tf.config.experimental.set_memory_growth(gpu, True)"
        ]
    );
    assert!(remedies.iter().all(|r| r["avoids_oom"] == false));
}
