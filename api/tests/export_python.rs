//! `vramsim replay --snapshot-out` read by Python and by PyTorch's own `torch/cuda/_memory_viz.py`:
//! `tools/memory_viz/check_memory_viz.py` loads each exported pickle with `pickle.load`, checks its
//! shape and that its trace replays to its segments, then runs `segsum` (`stats`), `trace`,
//! `trace_plot` and `segment_plot` and compares segsum's totals with the replay's `--json` report.
//!
//! The interpreter is `$VRAMSIM_PYTHON` or `python3`; without one the test is skipped with the reason
//! printed. `_memory_viz.py` is `$VRAMSIM_MEMORY_VIZ` (CI fetches it with
//! `tools/memory_viz/fetch_memory_viz.py`) or the installed torch's; with neither, the pickle checks
//! still run and the `_memory_viz` part is skipped with the reason printed.

use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const CHECK: &str = "tools/memory_viz/check_memory_viz.py";
/// `check_memory_viz.py`'s exit status when the pickle checks passed but `_memory_viz` is absent.
const SKIPPED: i32 = 77;

fn python() -> Option<String> {
    let python = std::env::var("VRAMSIM_PYTHON").unwrap_or_else(|_| "python3".to_string());
    match Command::new(&python).arg("--version").output() {
        Ok(out) if out.status.success() => Some(python),
        _ => {
            eprintln!("skipping: {python} is not available (set VRAMSIM_PYTHON to an interpreter)");
            None
        }
    }
}

fn dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("export_python");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Replays `trace` with `args`, exporting to `name`; returns (snapshot, report) paths.
fn export(trace: &Path, name: &str, args: &[&str]) -> (PathBuf, PathBuf) {
    let snapshot = dir().join(name);
    let report = dir().join(format!("{name}.json"));
    let mut all = vec![
        "replay",
        trace.to_str().unwrap(),
        "--json",
        "--snapshot-out",
        snapshot.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let out = Command::new(env!("CARGO_BIN_EXE_vramsim"))
        .args(&all)
        .current_dir(ROOT)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "vramsim {all:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&report, &out.stdout).unwrap();
    (snapshot, report)
}

fn trace_file(name: &str, lines: &[&str]) -> PathBuf {
    let path = dir().join(name);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// Runs the Python check on an export; panics with its output unless it passed (or skipped the
/// `_memory_viz` part for want of PyTorch).
fn check(python: &str, snapshot: &Path, report: &Path) {
    let out = Command::new(python)
        .args([CHECK, snapshot.to_str().unwrap(), "--report"])
        .arg(report)
        .current_dir(ROOT)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{}: {stdout}", snapshot.display());
    match out.status.code() {
        Some(0) => assert!(stdout.contains("ok: _memory_viz"), "{stdout}"),
        Some(SKIPPED) => {
            assert!(stdout.contains("ok: pickle.load"), "{stdout}");
            eprintln!("skipped the _memory_viz part: {}", stdout.trim_end());
        }
        _ => panic!(
            "{CHECK} failed on {}:\n{stdout}\n{stderr}",
            snapshot.display()
        ),
    }
}

#[test]
fn the_shipped_example_exports_a_snapshot_memory_viz_reads() {
    let Some(python) = python() else { return };
    let trace = Path::new(ROOT).join("examples/cs336-medium-train-step.jsonl");
    for name in ["example.pickle", "example.pickle.gz"] {
        let (snapshot, report) = export(&trace, name, &["--gpu", "rtx4090"]);
        check(&python, &snapshot, &report);
    }
}

#[test]
fn pending_frees_streams_ooms_and_expandable_segments_export_too() {
    let Some(python) = python() else { return };
    // A block freed while stream 7 still has work queued stays active_pending_free (segsum's totals
    // then differ from requested_bytes); allocations on stream 3 make a segment of their own.
    let pending = trace_file(
        "pending.jsonl",
        &[
            r#"{"op":"alloc","id":1,"size":8388508}"#,
            r#"{"op":"alloc","id":2,"size":3000000,"stream":3}"#,
            r#"{"op":"alloc","id":3,"size":700}"#,
            r#"{"op":"record_stream","id":1,"stream":7}"#,
            r#"{"op":"compute","stream":7,"us":500}"#,
            r#"{"op":"free","id":1}"#,
            r#"{"op":"free","id":3}"#,
        ],
    );
    let (snapshot, report) = export(&pending, "pending.pickle", &[]);
    check(&python, &snapshot, &report);

    // An OOM ends the trace with an `oom` entry keyed `device_free`.
    let oom = trace_file(
        "oom.jsonl",
        &[
            r#"{"op":"alloc","id":1,"size":31456280}"#,
            r#"{"op":"alloc","id":2,"size":31456280}"#,
            r#"{"op":"alloc","id":3,"size":31456280}"#,
        ],
    );
    let (snapshot, report) = export(
        &oom,
        "oom.pickle",
        &["--capacity", "64MiB", "--context", "0"],
    );
    check(&python, &snapshot, &report);

    // Expandable segments: segment_map/segment_unmap entries and is_expandable segments.
    let expandable = trace_file(
        "expandable.jsonl",
        &[
            r#"{"op":"alloc","id":1,"size":8388508}"#,
            r#"{"op":"alloc","id":2,"size":8388508}"#,
            r#"{"op":"alloc","id":3,"size":8388508}"#,
            r#"{"op":"free","id":3}"#,
            r#"{"op":"empty_cache"}"#,
            r#"{"op":"alloc","id":4,"size":1000}"#,
        ],
    );
    let (snapshot, report) = export(
        &expandable,
        "expandable.pickle.gz",
        &["--alloc-conf", "expandable_segments:True"],
    );
    check(&python, &snapshot, &report);
}
