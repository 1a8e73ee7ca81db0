//! Probe reports → derived figures → calibration → the cuda-async model, on committed probe output.
//!
//! `data/probe-synthetic-h100.json` is SYNTHETIC (`"synthetic": true`): no GPU was available when it was
//! written. Its pool samples follow the model's own documented rules, so agreement here checks the
//! pipeline, not the model; a real `probe --json` output dropped next to it is checked the same way, and
//! `compare_async_model` then shows where the driver departs from the model.

use std::path::Path;

use vramsim_sim::calibration::Calibration;
use vramsim_validate::probe::{compare_async_model, parse_nvidia_smi_used, ProbeReport};

const MIB: u64 = 1 << 20;

/// A committed probe report of `tests/data/`.
fn probe(file: &str) -> ProbeReport {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(file);
    ProbeReport::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn fixture() -> ProbeReport {
    probe("probe-synthetic-h100.json")
}

#[test]
fn derived_figures_of_the_synthetic_probe() {
    let probe = fixture();
    assert!(probe.synthetic && probe.note.starts_with("SYNTHETIC"));
    assert_eq!(probe.context_bytes(), 85_017_755_648 - 84_490_059_776);
    assert_eq!(probe.context_bytes_nvidia_smi(), Some(480 * MIB));
    assert_eq!(probe.cu_mem_alloc_granularity(), Some(2 * MIB));
    assert_eq!(probe.async_page_size(), Some(2 * MIB));
    assert_eq!(probe.async_alignment(), Some(512));
    assert_eq!(probe.used_after_one_byte(), Some(1));
}

#[test]
fn the_calibration_it_gives_reads_back_and_configures_the_model() {
    let probe = fixture();
    let calibration = probe.to_calibration().unwrap();
    assert!(calibration.synthetic);
    assert!(calibration.note.starts_with("SYNTHETIC probe: SYNTHETIC"));
    let again = Calibration::from_json(&calibration.to_json(), "calibration.json").unwrap();
    assert_eq!(again, calibration);
    assert_eq!(calibration.context_bytes, probe.context_bytes());
    assert_eq!(calibration.granularity.cu_mem_alloc, 2 * MIB);
    let pool = calibration.async_pool.as_ref().unwrap();
    assert_eq!(
        (pool.page_size, pool.alignment, pool.used_after_one_byte),
        (2 * MIB, 512, 1)
    );
    assert_eq!(calibration.latencies.cu_mem_alloc.len(), 4);
}

#[test]
fn the_model_reproduces_the_synthetic_pool_samples() {
    let comparisons = compare_async_model(&fixture());
    assert_eq!(comparisons.len(), 11);
    for c in &comparisons {
        assert!(c.agrees(), "{c:?}");
    }
    assert_eq!(comparisons.last().unwrap().predicted_reserved, 96 * MIB);
}

#[test]
fn a_driver_that_counts_rounded_bytes_as_used_is_flagged() {
    // The same probe, had the driver counted 512-byte-rounded sizes in USED_MEM_CURRENT.
    let mut probe = fixture();
    let mut used = 0;
    for sample in &mut probe.async_pool {
        used += sample.requested.div_ceil(512) * 512;
        sample.used_after = used;
    }
    let differ: Vec<u64> = compare_async_model(&probe)
        .iter()
        .filter(|c| !c.agrees())
        .map(|c| c.requested)
        .collect();
    assert_eq!(
        differ,
        [1, 1, 100, 4096, 524288, 1048576, 1048577, 2097152, 3145728, 20971521, 67108864]
    );
    assert_eq!(probe.used_after_one_byte(), Some(512));
}

#[test]
fn a_pool_growing_in_32_mib_chunks_is_measured_as_such() {
    // Had the first 1-byte allocation reserved 32 MiB and later growth come in 32 MiB steps.
    let mut probe = fixture();
    for sample in &mut probe.async_pool {
        sample.reserved_after = sample.reserved_after.div_ceil(32 * MIB) * 32 * MIB;
    }
    assert_eq!(probe.async_page_size(), Some(32 * MIB));
    let calibration = probe.to_calibration().unwrap();
    assert_eq!(calibration.async_pool.unwrap().page_size, 32 * MIB);
}

#[test]
fn nvidia_smi_output_is_read_in_mib() {
    assert_eq!(parse_nvidia_smi_used("503\n"), Some(503 * MIB));
    assert_eq!(parse_nvidia_smi_used(" 0 MiB\n"), Some(0));
    assert_eq!(parse_nvidia_smi_used("[N/A]\n"), None);
    assert_eq!(parse_nvidia_smi_used(""), None);
}

#[test]
fn bad_probe_reports_are_refused() {
    let mut probe = fixture();
    for step in &mut probe.cu_mem_alloc_steps {
        step.free_delta = 0;
    }
    let err = probe.to_calibration().unwrap_err();
    assert!(err.to_string().contains("no granularity to infer"), "{err}");
    let mut probe = fixture();
    probe.device.name.clear();
    let err = probe.to_calibration().unwrap_err();
    assert!(err.to_string().contains("`gpu.name` is empty"), "{err}");
    assert!(ProbeReport::from_json("{\"format\":\"vramsim-probe\"}").is_err());
}

/// `data/probe-h100-measured.json`: `vramsim-validate calibrate --probe-out` on a real H100 80GB HBM3
/// (driver 580.159.04, CUDA 13.0; 2026-11-24, `testdata/h100-train-steps/README.md`).
fn measured_h100() -> ProbeReport {
    probe("probe-h100-measured.json")
}

#[test]
fn a_real_h100_probe_and_the_pool_model_agree() {
    let probe = measured_h100();
    assert!(!probe.synthetic);
    // the CUDA context of cuInit + cuCtxCreate, as torch.cuda.mem_get_info() measured it in a fresh
    // process on the same machine (552,402,944 B: sim's CONTEXT_MEASUREMENTS for h100-80gb, CUDA 13)
    assert_eq!(probe.context_bytes(), 552_402_944);
    assert_eq!(probe.cu_mem_alloc_granularity(), Some(2 * MIB));
    assert_eq!(probe.async_alignment(), Some(512));
    assert_eq!(probe.used_after_one_byte(), Some(1));
    // every pool sample the driver gave is what the cuda-async model predicts
    let comparisons = compare_async_model(&probe);
    assert_eq!(comparisons.len(), 11);
    for c in &comparisons {
        assert!(c.agrees(), "{c:?}");
    }
}
