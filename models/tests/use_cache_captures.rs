//! transformers' default `use_cache=True` against PyTorch itself: every capture in
//! models/tests/captures/use_cache/ (recorded on the meta device by
//! models/tools/make_use_cache_captures.py with transformers 5.23, the configs' `use_cache` left at
//! its default) is lowered with the same recipe under `Fidelity::MetaCapture`, and the parameter
//! count, the peak of live requested bytes and the peak of every phase segment must equal PyTorch's
//! to the byte.

mod common;

use vramsim_models::{Attention, Checkpointing, Fidelity, Recipe};

fn recipe_of(fx: &serde_json::Value) -> Recipe {
    let rc = &fx["recipe"];
    let mut r = Recipe::new(rc["batch"].as_u64().unwrap(), rc["seq"].as_u64().unwrap());
    r.precision = rc["dtype"].as_str().unwrap().parse().unwrap();
    r.optimizer = rc["optimizer"].as_str().unwrap().parse().unwrap();
    r.iterations = rc["iterations"].as_u64().unwrap() as u32;
    if rc["checkpoint"].as_str() == Some("full") {
        r.checkpointing = Checkpointing::Full;
    }
    r.use_cache = rc["use_cache"].as_bool();
    r.keep_outputs = rc["keep_outputs"].as_bool().unwrap();
    r.fidelity = Fidelity::MetaCapture;
    r.attention = rc["attention"]
        .as_str()
        .unwrap()
        .parse::<Attention>()
        .unwrap();
    r
}

#[test]
fn default_use_cache_agrees_with_pytorch_captures() {
    common::check_captures("captures/use_cache", 7, recipe_of);
}

/// The captures see the cache: lowered with `use_cache=False` (what the capture tool's own
/// fixtures run), TinyLlama's forward peak is lower by the cache's copies that are alive at the
/// forward's peak.
#[test]
fn tinyllama_cache_is_visible_in_the_forward() {
    let fx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/captures/use_cache/tinyllama-1.1b__b2s128__fp32-adamw__use-cache.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut r = recipe_of(&fx);
    r.use_cache = Some(false);
    let g = vramsim_models::zoo::build("tinyllama-1.1b", &r).unwrap();
    let t = vramsim_models::lower(&g, &r).unwrap();
    let ours = common::segments(&t);
    let theirs = fx["peak_by_phase_segment"].as_array().unwrap();
    // Every layer's cached keys and values, [B, Hkv, S, D] float32 each, alive when the forward
    // peaks (at the loss): 22 layers × 2 × (2 × 4 × 128 × 64 × 4 bytes). Without the cache, the
    // RoPE'd keys and the value projection die with the attention (eager attention saves
    // repeat_kv's copies instead).
    let cache = 22 * 2 * (2 * 4 * 128 * 64 * 4);
    assert_eq!(ours[1].0, "forward");
    assert_eq!(ours[1].1 + cache, theirs[1][1].as_u64().unwrap());
}

/// `--inference` (no_grad, eval): no activation is saved, so without the cache each layer's keys
/// and values die with its attention; with transformers' default cache every layer's copies
/// accumulate until the model output dies. float32 at B 2, S 1024: the step peaks in the last
/// layer's eager attention (the scores [B, 32, S, S] and their scaled copy, 2 × 268 MB, above the
/// head's logits and log-probabilities, 2 × 262 MB), where that layer's own keys and values are
/// alive either way, so the peak grows by the 21 earlier layers' copies, 2 × [B, Hkv, S, D]
/// (Hkv 4, D 64) each. Gradient checkpointing does not turn the cache off in eval mode
/// (`self.training` is False).
#[test]
fn inference_accumulates_every_layers_cache() {
    let peak = |use_cache: Option<bool>, ckpt: Checkpointing| {
        let mut r = Recipe::new(2, 1024);
        r.inference = true;
        r.attention = Attention::Eager;
        r.checkpointing = ckpt;
        r.use_cache = use_cache;
        let g = vramsim_models::zoo::build("tinyllama-1.1b", &r).unwrap();
        let t = vramsim_models::lower(&g, &r).unwrap();
        common::segments(&t).iter().map(|s| s.1).max().unwrap()
    };
    let cache = 21 * 2 * (2 * 4 * 1024 * 64 * 4);
    let without = peak(Some(false), Checkpointing::None);
    assert_eq!(peak(None, Checkpointing::None), without + cache);
    assert_eq!(peak(Some(true), Checkpointing::Full), without + cache);
}
