//! Heads, losses, kept outputs and image sizes against PyTorch itself: every capture in
//! models/tests/captures/heads/ (recorded on the meta device by models/tools/make_head_captures.py
//! with transformers 5.23 and torchvision 0.29, each case built as a user writes it) is lowered with
//! the same recipe under `Fidelity::MetaCapture`, and the parameter count, the peak of live
//! requested bytes and the peak of every phase segment (setup, each forward, backward, optimizer
//! step and zero_grad of both iterations) must equal PyTorch's to the byte.

mod common;

use vramsim_models::{Attention, Fidelity, Head, Loss, Recipe};

fn recipe_of(fx: &serde_json::Value) -> Recipe {
    let rc = &fx["recipe"];
    let mut r = Recipe::new(
        rc["batch"].as_u64().unwrap(),
        rc["seq"].as_u64().unwrap_or(0),
    );
    r.precision = rc["dtype"].as_str().unwrap().parse().unwrap();
    r.optimizer = rc["optimizer"].as_str().unwrap().parse().unwrap();
    r.iterations = rc["iterations"].as_u64().unwrap() as u32;
    r.head = rc["head"].as_str().map(|h| h.parse::<Head>().unwrap());
    r.loss = rc["loss"].as_str().unwrap().parse::<Loss>().unwrap();
    r.keep_outputs = rc["keep_outputs"].as_bool().unwrap();
    r.image_size = rc["image_size"]
        .as_array()
        .map(|a| (a[0].as_u64().unwrap(), a[1].as_u64().unwrap()));
    r.num_classes = rc["num_classes"].as_u64();
    r.fidelity = Fidelity::MetaCapture;
    // The capture tool builds its HF configs with `use_cache=False`.
    r.use_cache = Some(false);
    // The captures ran HF's eager attention (the capture tool's `attn_implementation="eager"`).
    r.attention = Attention::Eager;
    r
}

#[test]
fn heads_losses_and_image_sizes_agree_with_pytorch_captures() {
    common::check_captures("captures/heads", 17, recipe_of);
}
