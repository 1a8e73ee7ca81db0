//! Closed forms of fine-tuning, derived by hand from the models' shapes (not from vramsim):
//! LoRA's trainable parameters (PEFT's `print_trainable_parameters`: `r × (in + out)` per adapted
//! layer) and their AdamW state, and what freezing leaves to train.

mod common;

use vramsim_models::finetune::LoraConfig;
use vramsim_models::{lower, zoo, Precision, Recipe};
use vramsim_traces::Category;

fn lora_graph(model: &str, spec: &str) -> vramsim_models::Graph {
    let mut r = Recipe::new(1, 128);
    r.lora = Some(spec.parse::<LoraConfig>().unwrap());
    zoo::build(model, &r).unwrap()
}

/// `r × (in + out)` summed over layers `(in, out)`, times the layer count.
fn lora_params(r: u64, layers: u64, shapes: &[(u64, u64)]) -> u64 {
    layers * shapes.iter().map(|(i, o)| r * (i + o)).sum::<u64>()
}

#[test]
fn trainable_counts_match_peft() {
    // LitGPT's resource table prints these for Llama 2 7B / 13B (r 8, query and value).
    assert_eq!(
        lora_graph("llama2-7b", "r=8,alpha=16,targets=q_proj,v_proj").param_count(),
        4_194_304
    );
    assert_eq!(
        lora_graph("llama2-13b", "r=8,alpha=16,targets=q_proj,v_proj").param_count(),
        6_553_600
    );
    // Llama 3 8B, all-linear, r 16: q, k, v, o, gate, up, down of hidden 4096, kv 1024 (8 KV
    // heads × 128), intermediate 14336; lm_head is left out by PEFT.
    let (h, kv, ff) = (4096, 1024, 14336);
    let want = lora_params(
        16,
        32,
        &[(h, h), (h, kv), (h, kv), (h, h), (h, ff), (h, ff), (ff, h)],
    );
    assert_eq!(want, 41_943_040);
    assert_eq!(
        lora_graph("llama3-8b", "r=16,alpha=32,targets=all-linear").param_count(),
        want
    );
    // GPT-2's fused c_attn (Conv1D 768 → 2304), r 8.
    assert_eq!(
        lora_graph("gpt2", "r=8,targets=c_attn").param_count(),
        lora_params(8, 12, &[(768, 2304)])
    );
    // Every base parameter stays, frozen: "all params" is the base count plus the adapters.
    let g = lora_graph("gpt2", "r=8,targets=c_attn");
    assert_eq!(g.total_param_count(), 124_439_808 + g.param_count());
}

/// AdamW keeps `exp_avg` and `exp_avg_sq` per trainable element: with PEFT's float32 adapters
/// (on a bf16 model too) that is 8 bytes per LoRA parameter and nothing for the frozen base.
#[test]
fn adamw_state_is_eight_bytes_per_adapter_parameter() {
    let mut r = Recipe::new(1, 64);
    r.precision = Precision::Bf16;
    r.lora = Some("r=16,alpha=32,targets=all-linear".parse().unwrap());
    let g = zoo::build("tinyllama-1.1b", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    let live = common::live_by_category(&t, t.events.len());
    let adapters = lora_params(
        16,
        22,
        &[
            (2048, 2048),
            (2048, 256),
            (2048, 256),
            (2048, 2048),
            (2048, 5632),
            (2048, 5632),
            (5632, 2048),
        ],
    );
    assert_eq!(g.param_count(), adapters);
    // AdamW's `step` counters are host tensors unless capturable or fused (`torch/optim/adam.py`
    // `_init_group`), so the device holds exp_avg and exp_avg_sq only.
    assert_eq!(live[&Category::OptimizerState], 8 * adapters);
    // Base parameters in bf16, adapters in float32.
    let base = 1_100_048_384u64;
    assert_eq!(live[&Category::Parameter], 2 * base + 4 * adapters);
}

/// Freezing everything but the head: the optimizer keeps state for the head only.
#[test]
fn frozen_parameters_have_no_optimizer_state() {
    let mut r = Recipe::new(1, 64);
    r.freeze = vec!["transformer".into()];
    let g = zoo::build("gpt2", &r).unwrap();
    // GPT-2's head is tied to wte, which `transformer` freezes: nothing is left to train.
    assert_eq!(g.param_count(), 0);
    let mut r = Recipe::new(1, 64);
    r.freeze = vec!["model.embed_tokens".into(), "model.layers.0-21".into()];
    let g = zoo::build("tinyllama-1.1b", &r).unwrap();
    // Left: the final norm (2048) and lm_head (32000 × 2048).
    assert_eq!(g.param_count(), 2048 + 32000 * 2048);
    let t = lower(&g, &r).unwrap();
    let live = common::live_by_category(&t, t.events.len());
    assert_eq!(live[&Category::OptimizerState], 8 * g.param_count());
}

#[test]
fn bad_input_is_an_error() {
    let mut r = Recipe::new(1, 64);
    r.freeze = vec!["model.layers.99".into()];
    let e = zoo::build("tinyllama-1.1b", &r).unwrap_err().to_string();
    assert!(e.contains("model.layers.0-21.self_attn.q_proj"), "{e}");
    let mut r = Recipe::new(1, 64);
    r.lora = Some("targets=query".parse().unwrap());
    let e = zoo::build("tinyllama-1.1b", &r).unwrap_err().to_string();
    assert!(e.contains("model.layers.0-21.mlp.down_proj"), "{e}");
    assert!("r=0".parse::<LoraConfig>().is_err());
    assert!("r=-4".parse::<LoraConfig>().is_err());
}
