//! nanoGPT against PyTorch itself: every capture in models/tests/captures/nanogpt/ (recorded by
//! models/tools/make_nanogpt_captures.py: nanoGPT's model.py modules with the manual attention and its
//! float32 `bias` buffers, `logits, loss = model(X, Y)` kept or not; fp32/bf16 on the meta device,
//! amp-fp16 on fake CPU tensors with CUDA's autocast policy and a GradScaler) is lowered with the same
//! recipe under `Fidelity::MetaCapture`, and the parameter count, the peak of live requested bytes and
//! the peak of every phase segment must equal PyTorch's to the byte.

mod common;

use vramsim_models::{Attention, Fidelity, Recipe};

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
    common::check_captures("captures/nanogpt", 4, recipe_of);
}
