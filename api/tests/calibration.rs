//! Calibration files: the reader's checks and messages, and what `--calibration` changes in a replay.
//!
//! `data/calibration/synthetic-h100.json` is SYNTHETIC (hand-made, marked `"synthetic": true`): no GPU was
//! available when these tests were written. A real `vramsim-validate calibrate` output has the same shape.

mod common;
use common::{json, vramsim};

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use vramsim_sim::allocator::cuda_async::CudaAsyncConfig;
use vramsim_sim::allocator::cuda_malloc::CudaMallocAllocator;
use vramsim_sim::allocator::Allocator;
use vramsim_sim::calibration::{
    Calibration, CalibrationError, LatencyCurve, LatencyPoint, TimedAllocator,
};
use vramsim_sim::device::Device;
use vramsim_sim::timeline::Timeline;

const MIB: u64 = 1 << 20;

fn fixture_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../sim/tests/data/calibration/synthetic-h100.json")
}

fn fixture_value() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_path()).unwrap()).unwrap()
}

#[test]
fn the_synthetic_fixture_reads_and_says_it_is_synthetic() {
    let calibration = Calibration::read(&fixture_path()).unwrap();
    assert!(calibration.synthetic);
    assert!(calibration.note.starts_with("SYNTHETIC"));
    let device = calibration.device();
    assert_eq!(device.name, "NVIDIA H100 80GB HBM3");
    assert_eq!(device.total_memory, 85_017_755_648);
    assert_eq!(device.context_bytes, 527_695_872);
    assert!(device.other_processes.is_empty());
    let pool = calibration.async_config(CudaAsyncConfig::pytorch());
    assert_eq!(pool.page_size, 32 * MIB);
    assert_eq!(pool.alignment, 512);
    assert_eq!(
        pool.release_threshold,
        u64::MAX,
        "PyTorch's threshold is kept"
    );
    // Written back, it reads the same.
    let again = Calibration::from_json(&calibration.to_json(), "again.json").unwrap();
    assert_eq!(again, calibration);
}

/// (JSON pointer to change, new value, expected error message after the file name).
#[test]
fn bad_values_are_named_with_what_would_be_valid() {
    let cases: &[(&str, Value, &str)] = &[
        ("/format", json!("vramsim-trace"), "`format` is \"vramsim-trace\"; a calibration file has \"vramsim-calibration\""),
        ("/version", json!(2), "`version` is 2; this vramsim reads version 1"),
        ("/gpu/name", json!(" "), "`gpu.name` is empty; give the device name cuDeviceGetName reported"),
        ("/gpu/total_memory", json!(0), "`gpu.total_memory` is 0; it is cuMemGetInfo's total, in bytes"),
        ("/gpu/free_after_context", json!(85017755649u64), "`gpu.free_after_context` is 85017755649 bytes, more than gpu.total_memory (85017755648 bytes)"),
        ("/context_bytes", json!(85017755648u64), "`context_bytes` is 85017755648 bytes, not less than gpu.total_memory (85017755648 bytes)"),
        ("/granularity/cu_mem_alloc", json!(3000000), "`granularity.cu_mem_alloc` is 3000000; a granularity is a power of two bytes (e.g. 2097152)"),
        ("/granularity/cu_mem_create_minimum", json!(0), "`granularity.cu_mem_create_minimum` is 0; a granularity is a power of two bytes (e.g. 2097152)"),
        ("/async_pool/page_size", json!(0), "`async_pool.page_size` is 0; it is the pool's growth unit in bytes (e.g. 2097152)"),
        ("/async_pool/alignment", json!(100), "`async_pool.alignment` is 100; an alignment is a power of two bytes (e.g. 256)"),
        ("/async_pool/alignment", json!(1u64 << 26), "`async_pool.alignment` is 67108864 bytes, larger than async_pool.page_size (33554432 bytes)"),
        ("/latencies/map/1/bytes", json!(2097152), "`latencies.map[1].bytes` is 2097152; sizes must be positive and increasing within a curve (the previous one is 2097152)"),
        ("/latencies/cu_mem_alloc/0/bytes", json!(0), "`latencies.cu_mem_alloc[0].bytes` is 0; sizes must be positive and increasing within a curve (the previous one is 0)"),
        ("/latencies/unmap/0/median_us", json!(-1.0), "`latencies.unmap[0].median_us` is -1; a latency is a finite number of microseconds, 0 or more"),
    ];
    for (pointer, value, expected) in cases {
        let mut doc = fixture_value();
        *doc.pointer_mut(pointer).unwrap() = value.clone();
        let err = Calibration::from_json(&doc.to_string(), "cal.json").unwrap_err();
        assert!(
            matches!(err, CalibrationError::Invalid { .. }),
            "{pointer}: {err}"
        );
        assert_eq!(
            err.to_string(),
            format!("cal.json: {expected}"),
            "{pointer}"
        );
    }
}

#[test]
fn shape_errors_give_file_line_and_column() {
    let cases: &[(&str, &str)] = &[
        ("{", "cal.json:1:1: EOF while parsing an object"),
        (
            "{\"format\":\"vramsim-calibration\",\n\"version\":1,\n\"gpus\":{}}",
            "cal.json:3:6: unknown field `gpus`",
        ),
    ];
    for (text, expected) in cases {
        let err = Calibration::from_json(text, "cal.json").unwrap_err();
        let message = err.to_string();
        assert!(message.starts_with(expected), "{message}");
    }
    let mut doc = fixture_value();
    doc.as_object_mut().unwrap().remove("context_bytes");
    let err = Calibration::from_json(&doc.to_string(), "cal.json").unwrap_err();
    assert!(
        err.to_string().contains("missing field `context_bytes`"),
        "{err}"
    );
    let err = Calibration::read(Path::new("/nonexistent/calibration.json")).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("/nonexistent/calibration.json: cannot read the calibration file: "),
        "{err}"
    );
}

#[test]
fn latency_curves_interpolate_between_and_extend_beyond_measured_sizes() {
    let curve = LatencyCurve::new(&[
        LatencyPoint {
            bytes: 2 * MIB,
            median_us: 20.0,
            samples: 1,
        },
        LatencyPoint {
            bytes: 22 * MIB,
            median_us: 40.0,
            samples: 1,
        },
    ]);
    let cases = [
        (2 * MIB, 20_000),
        (12 * MIB, 30_000), // half-way
        (22 * MIB, 40_000),
        (42 * MIB, 60_000), // the last segment's line, extended
        (1, 18_000),        // the first segment's line, extended down (never negative)
    ];
    for (bytes, ns) in cases {
        assert_eq!(curve.at(bytes), ns, "{bytes} bytes");
    }
    let single = LatencyCurve::new(&[LatencyPoint {
        bytes: 2 * MIB,
        median_us: 7.5,
        samples: 1,
    }]);
    assert_eq!(single.at(100 * MIB), 7_500);
}

#[test]
fn timed_allocators_charge_device_calls_to_the_host_clock() {
    let calibration = Calibration::read(&fixture_path()).unwrap();
    let latency = calibration.latency_model(false).unwrap();
    let mut alloc = TimedAllocator::new(
        CudaMallocAllocator::new(Device::with_capacity(1 << 30)),
        latency,
    );
    let mut tl = Timeline::new();
    let block = alloc.malloc(20 * MIB, 0, &mut tl).unwrap();
    assert_eq!(tl.now(), 40_000, "cuMemAlloc of 20 MiB: 40 µs");
    alloc.free(block, &mut tl);
    // cuMemFree of 20 MiB between (2 MiB, 10 µs) and (2 GiB, 1000 µs).
    let expected_free = 10_000.0 + 990_000.0 * (18.0 * MIB as f64) / (2046.0 * MIB as f64);
    assert_eq!(tl.now(), 40_000 + expected_free.round() as u64);
    assert!(
        calibration.latency_model(true).is_some(),
        "map/unmap curves for expandable segments"
    );
    let mut bare = fixture_value();
    bare["latencies"] = json!({});
    let bare = Calibration::from_json(&bare.to_string(), "bare.json").unwrap();
    assert!(bare.latency_model(false).is_none(), "no curves, no timing");
}

fn trace_file(name: &str, text: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("calibration");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

const TRACE: &str = "{\"op\":\"alloc\",\"id\":1,\"size\":3145728}\n\
                     {\"op\":\"alloc\",\"id\":2,\"size\":100}\n\
                     {\"op\":\"free\",\"id\":1}\n";

fn replay_json(args: &[&str]) -> Value {
    // One file per call: tests run in parallel.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let trace = trace_file(&format!("t{n}.jsonl"), TRACE);
    let mut all = vec!["replay", trace.to_str().unwrap()];
    all.extend_from_slice(args);
    json(&all)
}

#[test]
fn replay_with_a_calibration_uses_the_measured_device_and_timing() {
    let fixture = fixture_path();
    let report = replay_json(&["--calibration", fixture.to_str().unwrap()]);
    assert_eq!(report["device"]["name"], "NVIDIA H100 80GB HBM3");
    assert_eq!(report["device"]["total_memory_bytes"], 85_017_755_648u64);
    assert_eq!(report["device"]["context_bytes"], 527_695_872u64);
    // Two segments (the 4 MiB large one and the 2 MiB small one): cuMemAlloc at 4 MiB and 2 MiB.
    let plain = replay_json(&[]);
    assert_eq!(plain["host_time_us"], 0.0);
    assert!(report["host_time_us"].as_f64().unwrap() > 0.0);
    // --context still overrides the measured context.
    let report = replay_json(&[
        "--calibration",
        fixture.to_str().unwrap(),
        "--context",
        "1GiB",
    ]);
    assert_eq!(report["device"]["context_bytes"], 1u64 << 30);
}

#[test]
fn cuda_async_is_an_allocator_and_backend_cuda_malloc_async_selects_it() {
    let fixture = fixture_path();
    // Pool model: 3 MiB takes two 2 MiB pages, 100 B opens a shared page; used = requested bytes.
    let report = replay_json(&["--allocator", "cuda-async"]);
    assert_eq!(report["allocator"], "cuda-async");
    assert_eq!(report["peak_reserved_bytes"], 6 * MIB);
    assert_eq!(report["peak_allocated_bytes"], 3 * MIB + 100);
    assert_eq!(
        report["final_reserved_bytes"],
        6 * MIB,
        "UINT64_MAX threshold: nothing trimmed"
    );
    let via_conf = replay_json(&["--alloc-conf", "backend:cudaMallocAsync"]);
    assert_eq!(via_conf["peak_reserved_bytes"], 6 * MIB);
    // The calibrated pool grows by its measured 32 MiB page: both allocations are smaller than a page and
    // share one.
    let calibrated = replay_json(&[
        "--allocator",
        "cuda-async",
        "--calibration",
        fixture.to_str().unwrap(),
    ]);
    assert_eq!(calibrated["peak_reserved_bytes"], 32 * MIB);
}

#[test]
fn a_bad_calibration_is_a_clear_error() {
    let bad = trace_file(
        "bad-calibration.json",
        "{\"format\":\"vramsim-calibration\"}",
    );
    let trace = trace_file("t2.jsonl", TRACE);
    let output = vramsim(&[
        "replay",
        trace.to_str().unwrap(),
        "--calibration",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with("error: invalid --calibration: "),
        "{stderr}"
    );
    assert!(stderr.contains("missing field `version`"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let output = vramsim(&[
        "replay",
        trace.to_str().unwrap(),
        "--calibration",
        "x.json",
        "--gpu",
        "t4",
    ]);
    assert_eq!(
        output.status.code(),
        Some(2),
        "--calibration and --gpu conflict"
    );
}
