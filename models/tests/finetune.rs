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

/// Bytes allocated before the first forward (the model on the device).
fn setup_bytes(t: &vramsim_traces::Trace) -> u64 {
    let end = t
        .events
        .iter()
        .position(|e| matches!(e, vramsim_traces::Event::Phase { name } if &**name == "forward"))
        .unwrap();
    common::live_by_category(t, end).values().sum()
}

/// QLoRA storage (Dettmers et al. 2023, §3; bitsandbytes `quantize_4bit`): a linear weight of n
/// elements takes n/2 bytes of 4-bit codes plus one float32 absmax per 64-block (0.5 bits per
/// parameter), or with double quantization one uint8 absmax per 64-block plus a float32 constant
/// per 256 of those (8/64 + 32/(64·256) = 0.127 bits per parameter), a 256-entry float32 map and
/// the float32 offset; every layer keeps its 16-entry float32 NF4 table. Everything else (the
/// embedding, the norms, lm_head) stays in bf16.
#[test]
fn nf4_storage_is_the_qlora_closed_form() {
    let (h, ff, layers, vocab) = (4096u64, 11008u64, 32u64, 32000u64);
    let linears: Vec<u64> = (0..layers)
        .flat_map(|_| [h * h, h * h, h * h, h * h, h * ff, h * ff, ff * h])
        .collect();
    let psi_linear: u64 = linears.iter().sum();
    let rest = 2 * vocab * h + (2 * layers + 1) * h;
    assert_eq!(
        psi_linear + rest,
        6_738_415_616,
        "Llama 2 7B's parameter count"
    );
    let inv_freq = 64 * 4; // the rotary buffer, float32 [head_dim / 2]
    let setup = |q: &str| {
        let mut r = Recipe::new(1, 64);
        r.precision = Precision::Bf16;
        r.quant = Some(q.parse().unwrap());
        let g = zoo::build("llama2-7b", &r).unwrap();
        // Counts stay the unquantized ones (PEFT counts a Params4bit twice its uint8 numel).
        assert_eq!(g.total_param_count(), psi_linear + rest);
        setup_bytes(&lower(&g, &r).unwrap())
    };
    let per = |n: u64, dq: bool| {
        let blocks = n.div_ceil(64);
        let absmax = if dq {
            blocks + 4 * blocks.div_ceil(256) + 256 * 4 + 4
        } else {
            4 * blocks
        };
        n.div_ceil(2) + absmax + 16 * 4
    };
    let nf4: u64 = linears.iter().map(|&n| per(n, false)).sum();
    let dq: u64 = linears.iter().map(|&n| per(n, true)).sum();
    assert_eq!(setup("nf4"), 2 * rest + inv_freq + nf4);
    assert_eq!(setup("nf4-dq"), 2 * rest + inv_freq + dq);
    // LLM.int8: int8 CB [out, in] and float32 SCB [out] per layer.
    let outs: u64 = (0..layers).map(|_| 4 * h + 2 * ff + h).sum();
    assert_eq!(setup("int8"), 2 * rest + inv_freq + psi_linear + 4 * outs);
    // Double quantization saves ≈ 0.373 bits per linear parameter (0.5 − 0.127), about 0.30 GB
    // on Llama 2 7B: LitGPT's nf4 and nf4-dq rows differ by 14.14 − 13.84 = 0.30 GB.
    let saved = (nf4 - dq) as f64 / 1e9;
    assert!((saved - 0.30).abs() < 0.01, "{saved}");
}

/// `--quant` on a model whose only linear layer is the output layer (which bitsandbytes leaves
/// in 16 bits), and an unknown format, are errors.
#[test]
fn quant_errors() {
    let mut r = Recipe::new(1, 0);
    r.quant = Some("nf4".parse().unwrap());
    let e = zoo::build("resnet18", &r).unwrap_err().to_string();
    assert!(e.contains("no linear layer"), "{e}");
    assert!("nf5".parse::<vramsim_models::finetune::Quant>().is_err());
}

/// bitsandbytes' AdamW8bit (`Optimizer2State.init_state`): uint8 `state1`/`state2` plus float32
/// `absmax1`/`absmax2` per 256-element block for tensors of 4096 elements or more, float32 states
/// below that, and the two 256-entry float32 quantization maps once: 2 × (1 + 4/256) bytes per
/// parameter against AdamW's 8. Paged variants take `state1`/`state2` of tensors of 1e5 elements
/// or more from CUDA managed memory, which vramsim does not count against the device.
#[test]
fn bitsandbytes_optimizer_states() {
    let state = |opt: &str| {
        let mut r = Recipe::new(1, 64);
        r.precision = Precision::Bf16;
        r.optimizer = opt.parse().unwrap();
        let g = zoo::build("tinyllama-1.1b", &r).unwrap();
        let t = lower(&g, &r).unwrap();
        let live = common::live_by_category(&t, t.events.len());
        let paged = t.meta.get("paged_optimizer_bytes").and_then(|v| v.as_u64());
        let sizes: Vec<u64> = g.params.iter().map(|p| p.shape.iter().product()).collect();
        (live[&Category::OptimizerState], paged, sizes)
    };
    let (adamw8, paged, sizes) = state("adamw8bit");
    assert_eq!(paged, None);
    let eight = |n: u64| 2 * n + 2 * 4 * n.div_ceil(256);
    let want: u64 = sizes
        .iter()
        .map(|&n| if n >= 4096 { eight(n) } else { 8 * n })
        .sum::<u64>()
        + 2 * 256 * 4;
    assert_eq!(adamw8, want);
    // About a quarter of AdamW's (bf16 model: AdamW's states are bf16, 4 bytes per parameter).
    let (adamw, _, _) = state("adamw");
    assert_eq!(adamw, 4 * sizes.iter().sum::<u64>());
    let (p32, paged32, _) = state("paged-adamw");
    let big: u64 = sizes.iter().filter(|&&n| n >= 100_000).sum();
    assert_eq!(paged32, Some(8 * big));
    assert_eq!(p32, 8 * (sizes.iter().sum::<u64>() - big));
    let (p8, paged8, _) = state("paged-adamw8bit");
    assert_eq!(paged8, Some(2 * big));
    assert_eq!(p8, want - 2 * big);
}

/// A bitsandbytes 4-bit layer's forward, by hand from `MatMul4Bit.forward` /
/// `dequantize_4bit` (bitsandbytes 0.49): with double quantization a float32 absmax of n/64
/// entries, the dequantized `[out, in]` weight in the model dtype, the absmax freed when
/// `dequantize_4bit` returns, the GEMM's output, then the weight freed; nothing kept. The MLP's
/// first layer (1024 → 4096, float32, batch 8) under the meta capture (no cuBLAS workspaces).
#[test]
fn a_4bit_layer_dequantizes_into_a_temporary() {
    let mut r = Recipe::new(8, 0);
    r.quant = Some("nf4-dq".parse().unwrap());
    r.fidelity = vramsim_models::Fidelity::MetaCapture;
    let g = zoo::build("mlp", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    let (_, fwd) = common::signed_sizes(&t, "forward", Some(1));
    let n = 1024 * 4096i64;
    let want = [
        8 * 1024 * 4, // the input batch
        8 * 8,        // the labels
        n / 64 * 4,   // absmax, float32
        n * 4,        // the dequantized weight
        -(n / 64 * 4),
        8 * 4096 * 4, // the layer's output
        -(n * 4),
    ];
    assert_eq!(&fwd[..want.len()], &want);
}
