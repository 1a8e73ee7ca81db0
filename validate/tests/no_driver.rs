//! Without an NVIDIA driver every command exits with status 2 and prints exactly one line saying so —
//! never a panic. These run in CI (which has no GPU); on a machine with a driver they are skipped, since
//! the driver is then found.

use std::process::Command;

use vramsim_validate::driver::driver_library_present;

const LINE: &str = "error: no CUDA driver found: the CUDA driver library (libcuda.so) could not be loaded; validation needs an NVIDIA GPU";

fn trace() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/cs336-medium-train-step.jsonl"
    )
    .to_string()
}

/// Every command line, each of which would touch the GPU.
fn commands() -> Vec<Vec<String>> {
    let t = trace();
    let calibration = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../sim/tests/data/calibration/synthetic-h100.json"
    );
    let out = concat!(env!("CARGO_TARGET_TMPDIR"), "/no-driver-calibration.json");
    [
        vec!["probe"],
        vec!["probe", "--json", "--device", "1"],
        vec!["calibrate"],
        vec!["calibrate", "--out", out],
        vec!["replay", &t, "--backend", "raw"],
        vec![
            "replay",
            &t,
            "--backend",
            "raw",
            "--alloc-conf",
            "max_split_size_mb:128",
            "--json",
        ],
        vec!["replay", &t, "--backend", "vmm"],
        vec!["replay", &t, "--backend", "async"],
        vec![
            "replay",
            &t,
            "--backend",
            "async",
            "--release-threshold",
            "0",
            "--calibration",
            calibration,
        ],
        // Even a missing trace: the driver is what is missing first.
        vec!["replay", "/nonexistent.jsonl", "--backend", "raw"],
    ]
    .into_iter()
    .map(|args| args.into_iter().map(String::from).collect())
    .collect()
}

#[test]
fn every_command_exits_2_with_one_clear_line() {
    if driver_library_present() {
        eprintln!("skipped: a CUDA driver library is present on this machine");
        return;
    }
    for args in commands() {
        let output = Command::new(env!("CARGO_BIN_EXE_vramsim-validate"))
            .args(&args)
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr, format!("{LINE}\n"), "{args:?}");
        assert!(output.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn the_library_call_says_the_same_without_panicking() {
    if driver_library_present() {
        eprintln!("skipped: a CUDA driver library is present on this machine");
        return;
    }
    let error = vramsim_validate::driver::Gpu::open(0)
        .err()
        .expect("no GPU here");
    assert_eq!(format!("error: {error}"), LINE);
    assert!(matches!(
        error,
        vramsim_validate::error::ValidateError::NoDriver { .. }
    ));
}

#[test]
fn help_and_bad_arguments_need_no_driver() {
    let help = Command::new(env!("CARGO_BIN_EXE_vramsim-validate"))
        .args(["replay", "--help"])
        .output()
        .unwrap();
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).contains("--backend <BACKEND>"));
    let bad = Command::new(env!("CARGO_BIN_EXE_vramsim-validate"))
        .args(["replay", "t.jsonl", "--backend", "cuda"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("possible values: raw, async, vmm"));
}
