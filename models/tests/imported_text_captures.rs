//! transformers models outside the zoo, captured by `vramsim.from_module` (`tests/imported/NAME.json`)
//! and lowered by the op library, against the capture tool's CUDA-flavoured recording of the same
//! step (`tests/captures/fromtext/`, both written by `tools/make_fromtext_captures.py`: fused dropout,
//! CUDA's autocast policy for AMP). The lowering runs with `Fidelity::MetaCapture` (the recording's
//! own rules: gradients summed out of place, no kernel workspaces); the peak of live requested bytes
//! must be within 1% of the recording's, overall and in every phase segment.

use vramsim_models::imported::ImportedGraph;
use vramsim_models::{lower, Fidelity, Recipe};

mod common;

#[test]
fn t5_and_mixtral_match_their_recordings_within_one_percent() {
    let dir = format!("{}/tests/captures/fromtext", env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/captures/fromtext/ (tools/make_fromtext_captures.py)")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "recordings missing: {}", files.len());
    for path in files {
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let graph = format!(
            "{}/tests/{}",
            env!("CARGO_MANIFEST_DIR"),
            fx["graph"].as_str().unwrap()
        );
        let g = ImportedGraph::parse(&std::fs::read_to_string(graph).unwrap()).unwrap();
        let rc = &fx["recipe"];
        let batch = rc["batch"].as_u64().unwrap();
        let mut r = Recipe::new(batch, 0);
        r.precision = rc["dtype"].as_str().unwrap().parse().unwrap();
        r.iterations = rc["iterations"].as_u64().unwrap() as u32;
        r.fidelity = Fidelity::MetaCapture;
        let graph = g.build_for(batch, &r).unwrap();
        assert_eq!(graph.param_count(), fx["params"].as_u64().unwrap());
        let t = lower(&graph, &r).unwrap();
        let ours = common::segments(&t);
        let theirs = fx["peak_by_phase_segment"].as_array().unwrap();
        assert_eq!(ours.len(), theirs.len(), "{path:?}: phase segments");
        let within = |a: u64, b: u64| (a as f64 - b as f64).abs() <= 0.01 * b as f64;
        for ((phase, peak), s) in ours.iter().zip(theirs) {
            let want = s[1].as_u64().unwrap();
            println!(
                "{}: {phase} {peak} (recorded {want}, {:+.3}%)",
                path.file_name().unwrap().to_string_lossy(),
                100.0 * (*peak as f64 - want as f64) / want as f64
            );
            assert_eq!(phase, s[0].as_str().unwrap());
            assert!(within(*peak, want), "{path:?}: {phase} {peak} vs {want}");
        }
        let peak = ours.iter().map(|s| s.1).max().unwrap();
        let want = fx["peak_requested_bytes"].as_u64().unwrap();
        assert!(within(peak, want), "{path:?}: peak {peak} vs {want}");
    }
}
