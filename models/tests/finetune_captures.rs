//! Fine-tuning against PyTorch itself: every capture in models/tests/captures/finetune/ (recorded
//! on the meta device by models/tools/make_finetune_captures.py: models with parameters frozen by
//! `requires_grad_(False)` under `--freeze` patterns, and models wrapped by PEFT's
//! `get_peft_model` with a `LoraConfig`) is lowered with the same recipe under
//! `Fidelity::MetaCapture`; the parameter count, the trainable count, the peak of live requested
//! bytes and the peak of every phase segment must equal PyTorch's to the byte.

mod common;

use vramsim_models::finetune::LoraConfig;
use vramsim_models::{Attention, CheckpointImpl, Checkpointing, Fidelity, Recipe};

fn recipe_of(fx: &serde_json::Value) -> Recipe {
    let rc = &fx["recipe"];
    let mut r = Recipe::new(
        rc["batch"].as_u64().unwrap(),
        rc["seq"].as_u64().unwrap_or(0),
    );
    r.precision = rc["dtype"].as_str().unwrap().parse().unwrap();
    r.optimizer = rc["optimizer"].as_str().unwrap().parse().unwrap();
    r.iterations = rc["iterations"].as_u64().unwrap() as u32;
    r.fidelity = Fidelity::MetaCapture;
    r.attention = Attention::Eager;
    r.use_cache = Some(false);
    if rc["checkpoint"].as_str() == Some("full") {
        // HF's own per-layer wrapper, use_reentrant=False.
        r.checkpointing = Checkpointing::Full;
        r.checkpoint_impl = CheckpointImpl::NonReentrant;
    }
    if let Some(f) = rc["freeze"].as_str() {
        r.freeze = f.split(',').map(String::from).collect();
    }
    if let Some(l) = rc["lora"].as_str() {
        r.lora = Some(l.parse::<LoraConfig>().unwrap());
    }
    r
}

#[test]
fn finetuning_agrees_with_pytorch_captures() {
    common::check_captures("captures/finetune", 15, recipe_of);
}
