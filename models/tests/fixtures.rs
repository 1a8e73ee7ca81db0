//! Agreement with PyTorch itself: every capture fixture of a zoo model (models/tests/fixtures/
//! capture/*.json, recorded by traces/python/vramsim_capture.py on the meta device, and
//! models/tests/captures/*.json, recorded by models/tools/make_captures.py for the zoo models the
//! capture tool's own zoo lacks) is lowered with the same recipe, and the peak of live requested
//! bytes of our trace, computed here directly from the events, must be within 1% of PyTorch's.
//!
//! The comparison uses `Fidelity::MetaCapture` (gradients summed out of place, as the autograd
//! engine does under a dispatch mode); the CUDA-semantics figure is printed beside it.

use std::collections::HashMap;
use std::path::Path;
use vramsim_models::{
    lower, zoo, Attention, CheckpointImpl, Checkpointing, Fidelity, OptimizerKind, Precision,
    Recipe,
};
use vramsim_traces::{AllocId, Event, Trace};

/// Max over the trace of live requested bytes, computed from scratch (no allocator).
fn peak(trace: &Trace) -> u64 {
    let mut live: HashMap<&AllocId, u64> = HashMap::new();
    let (mut cur, mut peak) = (0u64, 0u64);
    for e in &trace.events {
        match e {
            Event::Alloc { id, size, .. } => {
                assert!(live.insert(id, *size).is_none(), "id {id} allocated twice");
                cur += size;
                peak = peak.max(cur);
            }
            Event::Free { id } => {
                cur -= live
                    .remove(id)
                    .unwrap_or_else(|| panic!("free of unknown id {id}"))
            }
            _ => {}
        }
    }
    peak
}

fn recipe_of(fx: &serde_json::Value) -> Option<Recipe> {
    let rc = &fx["recipe"];
    let mut r = Recipe::new(rc["batch"].as_u64()?, rc["seq"].as_u64().unwrap_or(0));
    r.precision = match rc["dtype"].as_str()? {
        "fp32" => Precision::Fp32,
        "bf16" => Precision::Bf16,
        _ => return None,
    };
    r.optimizer = rc["optimizer"].as_str()?.parse::<OptimizerKind>().ok()?;
    r.checkpointing = match rc["checkpoint"].as_str()? {
        "none" => Checkpointing::None,
        "full" => Checkpointing::Full,
        _ => return None,
    };
    r.accum = rc["accum"].as_u64()? as u32;
    r.iterations = rc["iterations"].as_u64()? as u32;
    // The captures checkpointed with use_reentrant=False: pin it, whatever the default is.
    r.checkpoint_impl = CheckpointImpl::NonReentrant;
    // The captures ran HF's eager attention (and the meta device sees no SDPA backend choice):
    // pin it, whatever the default is.
    r.attention = Attention::Eager;
    if rc
        .get("attn_implementation")
        .and_then(|a| a.as_str())
        .is_some_and(|a| a != "eager")
    {
        return None;
    }
    Some(r)
}

#[test]
fn peaks_agree_with_pytorch_captures() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<_> = [
        "tests/fixtures/capture",
        "tests/captures",
        "tests/captures_timm",
    ]
    .iter()
    .filter_map(|d| std::fs::read_dir(root.join(d)).ok())
    .flat_map(|entries| entries.flatten().map(|e| e.path()))
    .filter(|p| p.extension().is_some_and(|x| x == "json"))
    .collect();
    files.sort();
    assert!(files.len() >= 72, "fixtures missing: {} found", files.len());
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for path in files {
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        if fx["format"] != "vramsim-capture-fixture" {
            continue;
        }
        let model = fx["model"].as_str().unwrap_or("");
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        if !zoo::NAMES.contains(&model) {
            rows.push(format!(
                "| {file} | skipped: {model} is not in the zoo yet | | | |"
            ));
            continue;
        }
        let Some(mut r) = recipe_of(&fx) else {
            rows.push(format!("| {file} | skipped: recipe not modelled | | | |"));
            continue;
        };
        let theirs = fx["peak_requested_bytes"].as_u64().unwrap();
        r.fidelity = Fidelity::MetaCapture;
        // The capture tool builds its HF configs with `use_cache=False`.
        r.use_cache = Some(false);
        let g = zoo::build(model, &r).unwrap();
        let ours = peak(&lower(&g, &r).unwrap());
        r.fidelity = Fidelity::Cuda;
        let cuda = peak(&lower(&g, &r).unwrap());
        let err = (ours as f64 - theirs as f64) / theirs as f64 * 100.0;
        let cerr = (cuda as f64 - theirs as f64) / theirs as f64 * 100.0;
        rows.push(format!(
            "| {file} | {theirs} | {ours} | {err:+.3}% | {cuda} ({cerr:+.2}%) |"
        ));
        if err.abs() > 1.0 {
            failures.push(format!(
                "{file}: ours {ours}, PyTorch {theirs} ({err:+.3}%)"
            ));
        }
    }
    println!("| fixture | PyTorch peak_requested | vramsim (meta-capture) | error | vramsim (CUDA semantics) |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!("{r}");
    }
    assert!(
        failures.is_empty(),
        "peaks off by more than 1%:\n{}",
        failures.join("\n")
    );
}
