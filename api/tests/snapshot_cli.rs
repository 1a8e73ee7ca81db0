//! `vramsim import`, `vramsim check-snapshot` and `vramsim replay SNAPSHOT` end to end, on the shipped
//! snapshots of `testdata/snapshots/` (a missing file fails the test) and on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The path of a shipped snapshot; the test fails if the file is missing.
fn snapshot(name: &str) -> PathBuf {
    let path = Path::new(DIR).join(name);
    assert!(
        path.exists(),
        "{} is missing: the test data is not there",
        path.display()
    );
    path
}

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("snapshot_cli");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A clean failure: exit status 2, an `error:` line with every fragment, no panic.
fn assert_fails(output: &Output, fragments: &[&str]) {
    let err = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for f in fragments {
        assert!(err.contains(f), "{f:?} not in {err}");
    }
}

#[test]
fn check_snapshot_prints_the_required_json() {
    let path = snapshot(NESTA);
    let output = vramsim(&["check-snapshot", path.to_str().unwrap(), "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    for key in [
        "alloc_events",
        "segment_events_recorded",
        "segment_events_matched",
        "same_offset_allocs",
        "final_reserved_recorded",
        "final_reserved_simulated",
        "first_divergence",
    ] {
        assert!(json.get(key).is_some(), "{key} missing: {json}");
    }
    assert_eq!(json["first_divergence"], serde_json::Value::Null);
    assert_eq!(json["ooms_matched"], 1);
    // the table says the same in words
    let output = vramsim(&["check-snapshot", path.to_str().unwrap()]);
    let table = text(&output.stdout);
    assert!(table.contains("first divergence: none"), "{table}");
    assert!(table.contains("reproduced at the same request"), "{table}");
}

#[test]
fn a_snapshot_replays_from_its_recorded_state_and_says_if_its_oom_still_happens() {
    let path = snapshot(NESTA);
    let output = vramsim(&["replay", path.to_str().unwrap(), "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let verdict = json["snapshot"]["verdict"].as_str().unwrap();
    assert!(
        verdict.contains("still happens at the same request"),
        "{verdict}"
    );
    // on a bigger device it does not
    let output = vramsim(&["replay", path.to_str().unwrap(), "--capacity", "40GiB"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(text(&output.stdout).contains("does not happen"));
    // several devices: --device is needed, and an absent one is named
    let multi = snapshot(CONSTRUCTOR);
    assert_fails(
        &vramsim(&["replay", multi.to_str().unwrap()]),
        &["the snapshot holds devices 0, 1, 2: choose one with --device N"],
    );
    assert_fails(
        &vramsim(&["replay", multi.to_str().unwrap(), "--device", "9"]),
        &["the snapshot has no device 9: it holds devices 0, 1, 2, 3"],
    );
    assert_fails(
        &vramsim(&["check-snapshot", multi.to_str().unwrap(), "--device", "9"]),
        &["the snapshot has no device 9: it holds devices 0, 1, 2, 3"],
    );
}

#[test]
fn import_writes_one_trace_per_device() {
    let path = snapshot(CONSTRUCTOR);
    let out = tmp("constructor.jsonl");
    let output = vramsim(&[
        "import",
        path.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    for device in 0..3 {
        let file = tmp(&format!("constructor.device{device}.jsonl"));
        let trace = vramsim_traces::read_trace(&file).unwrap();
        assert_eq!(trace.meta["device"], device);
        assert_eq!(trace.meta["source"], "pytorch-snapshot");
        // the imported trace replays like the snapshot (device 1 ends in its OOM)
        let replayed = vramsim(&[
            "replay",
            file.to_str().unwrap(),
            "--alloc-conf",
            "expandable_segments:True",
            "--json",
        ]);
        assert!(replayed.status.success(), "{}", text(&replayed.stderr));
    }
    let one = tmp("device1.jsonl.gz");
    let output = vramsim(&[
        "import",
        path.to_str().unwrap(),
        "-o",
        one.to_str().unwrap(),
        "--device",
        "1",
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(
        vramsim_traces::read_trace(&one).unwrap().events.len(),
        199 + 175 + 1
    );
}

#[test]
fn foreign_and_broken_pickles_are_errors() {
    // protocol 4: [1, 2, 3]
    let list = tmp("list.pickle");
    std::fs::write(
        &list,
        b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K\x02K\x03e.",
    )
    .unwrap();
    for command in ["check-snapshot", "replay", "import"] {
        let mut args = vec![command, list.to_str().unwrap()];
        if command == "import" {
            args.extend(["-o", "unused.jsonl"]);
        }
        assert_fails(
            &vramsim(&args),
            &[
                "[0]: expected dict, got int",
                "expected a PyTorch memory snapshot",
            ],
        );
    }
    let truncated = tmp("truncated.pickle");
    std::fs::write(
        &truncated,
        b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00}\x94(",
    )
    .unwrap();
    assert_fails(
        &vramsim(&["check-snapshot", truncated.to_str().unwrap()]),
        &["truncated"],
    );
}

#[test]
fn a_replayed_snapshot_names_its_own_device_in_the_oom_message() {
    // The recorded OOM of Constructor-Sun happened on device 1 (its `oom` trace entry is in
    // device_traces[1]): PyTorch's message names "GPU 1".
    let path = snapshot(CONSTRUCTOR);
    let output = vramsim(&["replay", path.to_str().unwrap(), "--device", "1", "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let message = json["oom"]["message"]
        .as_str()
        .expect("the recorded OOM happens");
    assert!(
        message.contains(". GPU 1 has a total capacity of"),
        "{message}"
    );
}
