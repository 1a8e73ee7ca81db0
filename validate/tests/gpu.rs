//! On a real GPU: `cargo test -p vramsim-validate -- --ignored`. Each test needs an NVIDIA driver and a
//! device with a few GiB free; none runs in CI.
//!
//! What they assert is what the simulator claims and the hardware can confirm: that device free memory
//! moves by exactly the segment sizes the simulated caching allocator decides (raw, vmm — all of them are
//! multiples of 2 MiB), and that the pool's used high-water mark is the sum of requested bytes (async).
//! The pool's reserved memory is printed next to the model's, not asserted: the model's page rules are
//! the unconfirmed part this replay exists to measure.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard};

use vramsim_sim::calibration::Calibration;
use vramsim_validate::driver::Gpu;
use vramsim_validate::probe::{compare_async_model, run_probe};
use vramsim_validate::replay::{replay, report_text, Backend, ReplayOptions};

const TRACE: &str = r#"{"format":"vramsim-trace","version":1,"meta":{"note":"validate/tests/gpu.rs"}}
{"op":"alloc","id":1,"size":1000}
{"op":"alloc","id":2,"size":5242880}
{"op":"alloc","id":3,"size":31457281,"stream":7}
{"op":"record_stream","id":2,"stream":7}
{"op":"alloc","id":4,"size":100}
{"op":"free","id":3}
{"op":"sync"}
{"op":"alloc","id":5,"size":31457281}
{"op":"free","id":2}
{"op":"empty_cache"}
{"op":"free","id":1}
{"op":"free","id":4}
{"op":"free","id":5}
{"op":"empty_cache"}
"#;

/// Every test reads device free memory around its own calls, so no two may run at once: cargo runs a
/// file's tests on parallel threads, and on an H100 (2026-11-24) the raw and vmm tests then saw the
/// probe's and the binary's contexts come and go. Each test holds this lock for its whole run.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn exclusive() -> MutexGuard<'static, ()> {
    // A test that panicked while holding the lock poisons it; the device is still usable.
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The trace in a file of its own (tests run in parallel).
fn trace_file(test: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("gpu-{test}.jsonl"));
    std::fs::write(&path, TRACE).unwrap();
    path
}

fn options(backend: Backend) -> ReplayOptions {
    ReplayOptions {
        backend,
        alloc_conf: String::new(),
        release_threshold: u64::MAX,
        async_config: None,
        max_events: None,
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn probe_measures_a_consistent_device() {
    let _one = exclusive();
    let gpu = Gpu::open(0).expect("a GPU");
    let probe = run_probe(&gpu, None, 5).unwrap();
    println!("{}", vramsim_validate::probe::probe_text(&probe));
    assert!(probe.device.total_memory > probe.device.free_after_context);
    assert!(probe.vmm_granularity.minimum.is_power_of_two());
    assert!(probe.cu_mem_alloc_granularity().is_some());
    assert!(probe.async_page_size().is_some());
    let calibration = probe.to_calibration().unwrap();
    assert!(!calibration.synthetic);
    assert_eq!(compare_async_model(&probe).len(), probe.async_pool.len());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn raw_replay_moves_free_memory_by_the_simulated_segments() {
    let _one = exclusive();
    let gpu = Gpu::open(0).expect("a GPU");
    let report = replay(&gpu, &trace_file("raw"), &options(Backend::Raw)).unwrap();
    println!("{}", report_text(&report, true));
    assert_eq!(report.stopped, None);
    assert_eq!(report.events, 14);
    assert!(report.device_calls >= 4);
    assert_eq!(
        report.max_abs_deviation, 0,
        "device memory moved by other amounts than the segments"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn vmm_replay_moves_free_memory_by_the_simulated_pages() {
    let _one = exclusive();
    let gpu = Gpu::open(0).expect("a GPU");
    let report = replay(&gpu, &trace_file("vmm"), &options(Backend::Vmm)).unwrap();
    println!("{}", report_text(&report, true));
    assert_eq!(report.stopped, None);
    assert_eq!(
        report.max_abs_deviation, 0,
        "device memory moved by other amounts than the pages"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn async_replay_reports_the_pool_high_water_marks() {
    let _one = exclusive();
    let gpu = Gpu::open(0).expect("a GPU");
    for threshold in [u64::MAX, 0] {
        let options = ReplayOptions {
            release_threshold: threshold,
            ..options(Backend::Async)
        };
        let report = replay(&gpu, &trace_file("async"), &options).unwrap();
        println!("{}", report_text(&report, true));
        assert_eq!(report.stopped, None);
        let pool = report.pool.expect("pool highs");
        assert_eq!(
            pool.predicted_used_high,
            1000 + 5_242_880 + 31_457_281 + 100
        );
        assert_eq!(
            pool.measured_used_high, pool.predicted_used_high,
            "USED_MEM_HIGH = Σ requested bytes"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_binary_calibrates_and_replays_every_backend() {
    let _one = exclusive();
    let exe = env!("CARGO_BIN_EXE_vramsim-validate");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gpu-calibration.json");
    let status = Command::new(exe)
        .args(["calibrate", "--reps", "3", "--out", out.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    let calibration = Calibration::read(&out).unwrap();
    assert!(!calibration.synthetic);
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/cs336-medium-train-step.jsonl"
    );
    for backend in ["raw", "vmm", "async"] {
        let output = Command::new(exe)
            .args(["replay", trace, "--backend", backend, "--json"])
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{backend}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        assert!(report["events"].as_u64().unwrap() > 0, "{backend}");
    }
}
