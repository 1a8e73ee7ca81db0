//! nanoGPT against PyTorch itself: every capture in models/tests/captures/nanogpt/ (recorded by
//! models/tools/make_nanogpt_captures.py: nanoGPT's model.py modules with the manual attention and its
//! float32 `bias` buffers, `logits, loss = model(X, Y)` kept or not; fp32/bf16 on the meta device,
//! amp-fp16 on fake CPU tensors with CUDA's autocast policy and a GradScaler) is lowered with the same
//! recipe under `Fidelity::MetaCapture`, and the parameter count, the peak of live requested bytes and
//! the peak of every phase segment must equal PyTorch's to the byte.

use std::collections::HashMap;
use std::path::Path;
use vramsim_models::{lower, zoo, Attention, Fidelity, Recipe};
use vramsim_traces::{AllocId, Event, Trace};

/// `(phase, peak of live requested bytes)` of each phase segment, as `summarize()` of
/// traces/python/vramsim_capture.py computes it.
fn segments(t: &Trace) -> Vec<(String, u64)> {
    let mut live: HashMap<&AllocId, u64> = HashMap::new();
    let (mut cur, mut out) = (0u64, Vec::<(String, u64)>::new());
    for e in &t.events {
        match e {
            Event::Phase { name } => out.push((name.to_string(), cur)),
            Event::Alloc { id, size, .. } => {
                assert!(live.insert(id, *size).is_none(), "{id} allocated twice");
                cur += size;
                if let Some(s) = out.last_mut() {
                    s.1 = s.1.max(cur);
                }
            }
            Event::Free { id } => cur -= live.remove(id).expect("freed once"),
            _ => {}
        }
    }
    out
}

fn recipe_of(fx: &serde_json::Value) -> Recipe {
    let rc = &fx["recipe"];
    let mut r = Recipe::new(rc["batch"].as_u64().unwrap(), rc["seq"].as_u64().unwrap());
    r.precision = rc["dtype"].as_str().unwrap().parse().unwrap();
    r.optimizer = rc["optimizer"].as_str().unwrap().parse().unwrap();
    r.iterations = rc["iterations"].as_u64().unwrap() as u32;
    r.keep_outputs = rc["keep_outputs"].as_bool().unwrap();
    r.fidelity = Fidelity::MetaCapture;
    // nanoGPT's manual path (flash = False), with the `bias` buffers.
    r.attention = Attention::Eager;
    r
}

#[test]
fn nanogpt_steps_agree_with_pytorch_captures() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/captures/nanogpt");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "captures missing: {} found", files.len());
    let mut failures = Vec::new();
    for path in files {
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        let r = recipe_of(&fx);
        let g = zoo::build(fx["model"].as_str().unwrap(), &r).unwrap();
        let t = lower(&g, &r).unwrap();
        let ours = segments(&t);
        let theirs: Vec<(String, u64)> = fx["peak_by_phase_segment"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s[0].as_str().unwrap().to_string(), s[1].as_u64().unwrap()))
            .collect();
        let peak = ours.iter().map(|s| s.1).max().unwrap_or(0);
        println!(
            "{file}: params {} peak {peak} (PyTorch {})",
            g.param_count(),
            fx["peak_requested_bytes"]
        );
        if g.param_count() != fx["params"].as_u64().unwrap() {
            failures.push(format!("{file}: params {}", g.param_count()));
        }
        if peak != fx["peak_requested_bytes"].as_u64().unwrap() {
            failures.push(format!("{file}: peak {peak}"));
        }
        if ours != theirs {
            failures.push(format!(
                "{file}: phase segments differ:\n  ours   {ours:?}\n  theirs {theirs:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
