//! `--checkpoint selective-op`: torchtitan's op-level selective activation checkpointing
//! (`_apply_ac_to_transformer_block`'s policy over `torch.utils.checkpoint`'s
//! `create_selective_checkpoint_contexts`), checked against byte counts derived by hand.

mod common;
use common::live_at;

use std::collections::HashMap;
use vramsim_models::{
    lower, zoo, Attention, CheckpointImpl, Checkpointing, Fidelity, OptimizerKind, Precision,
    Recipe,
};
use vramsim_traces::{Category, Event, Trace};

/// Index of the first `backward` phase marker: the end of the forward.
fn end_of_forward(t: &Trace) -> usize {
    t.events
        .iter()
        .position(|e| matches!(e, Event::Phase { name } if &**name == "backward"))
        .expect("a backward phase")
}

/// Activation bytes allocated by ops of `prefix` (a block's module path) alive when the forward
/// ends.
fn block_bytes(t: &Trace, prefix: &str) -> u64 {
    live_at(t, end_of_forward(t))
        .iter()
        .filter(|x| x.1 == Category::Activation && x.2.starts_with(prefix))
        .map(|x| x.0)
        .sum()
}

fn recipe(c: Checkpointing) -> Recipe {
    let mut r = Recipe::new(2, 128);
    r.precision = Precision::Bf16;
    r.attention = Attention::SdpaFlash;
    r.checkpointing = c;
    r.iterations = 1;
    // torchtitan's Llama keeps no KV cache; the loop passes use_cache=False.
    r.use_cache = Some(false);
    r
}

#[test]
fn a_llama_block_keeps_its_input_and_the_saved_ops_outputs() {
    // TinyLlama: hidden 2048, intermediate 5632, 32 heads of 64, 4 KV heads; bf16 weights and
    // activations, FlashAttention-2. Batch b = 2, sequence s = 128.
    let (b, s, h, i, heads, kv) = (2u64, 128u64, 2048u64, 5632u64, 32u64, 4u64 * 64);
    let r = recipe(Checkpointing::SelectiveOp);
    let g = zoo::build("tinyllama-1.1b", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    // LlamaDecoderLayer.forward's aten.mm calls, in order: q_proj (1, saved), k_proj (2),
    // v_proj (3, saved), o_proj (4), gate_proj (5, saved), up_proj (6), down_proj (7, saved):
    // torchtitan saves the odd-numbered ones.
    let mms = 2 * b * s * (h + kv + i + h);
    // _scaled_dot_product_flash_attention's whole return tuple is cached: the output (bf16
    // [b, heads, s, 64]), logsumexp (float32 [b, heads, s]), rng_state (int64 [2]) and the unused
    // int64 0-d tensor.
    let sdpa = 2 * b * s * h + 4 * b * heads * s + 16 + 8;
    // Layer 5's output (its second residual add, bf16 [b, s, h]): layer 6's checkpoint input.
    let output = 2 * b * s * h;
    assert_eq!(block_bytes(&t, "model.layers.5"), mms + sdpa + output);
    // Full checkpointing keeps only the output (layer 6's input).
    let r = recipe(Checkpointing::Full);
    let g = zoo::build("tinyllama-1.1b", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    assert_eq!(block_bytes(&t, "model.layers.5"), output);
}

#[test]
fn a_policy_that_saves_nothing_is_full_checkpointing() {
    // GPT-2's Conv1D calls addmm and its eager attention matmuls 4-D tensors (bmm): no op of a
    // block is aten.mm or an SDPA kernel, so the policy saves nothing and the step is full
    // checkpointing's, event for event.
    let run = |c| {
        let mut r = recipe(c);
        r.precision = Precision::Fp32;
        r.attention = Attention::Eager;
        let g = zoo::build("gpt2", &r).unwrap();
        lower(&g, &r).unwrap()
    };
    let (sac, full) = (run(Checkpointing::SelectiveOp), run(Checkpointing::Full));
    assert!(!sac.events.is_empty());
    assert_eq!(sac.events, full.events);
}

#[test]
fn selective_op_parses_and_needs_the_non_reentrant_checkpoint() {
    assert_eq!(
        "selective-op".parse::<Checkpointing>().unwrap(),
        Checkpointing::SelectiveOp
    );
    assert_eq!(Checkpointing::SelectiveOp.to_string(), "selective-op");
    let err = "selective-opp".parse::<Checkpointing>().unwrap_err();
    assert!(err.to_string().contains("selective-op"));
    let mut r = recipe(Checkpointing::SelectiveOp);
    r.checkpoint_impl = vramsim_models::CheckpointImpl::Reentrant;
    assert!(r.validate().is_err());
}

#[test]
fn the_recomputation_takes_the_saved_outputs_instead_of_rerunning_their_ops() {
    // Allocations of layer 5's flash attention (output, logsumexp, rng_state, unused: 4 per run)
    // and of its v_proj output (bf16 [b, s, 4 × 64] = 131,072 B; v_proj's backward allocates
    // [b, s, 2048] and [256, 2048] gradients, not this size): the forward runs them once and full
    // checkpointing's recomputation once more; under selective-op the recomputation takes them
    // from the storage.
    let count = |c| {
        let r = recipe(c);
        let g = zoo::build("tinyllama-1.1b", &r).unwrap();
        let t = lower(&g, &r).unwrap();
        let tagged = |tag: &str, size: Option<u64>| {
            t.events
                .iter()
                .filter(|e| {
                    matches!(e, Event::Alloc { tag: Some(x), size: n, .. }
                        if &**x == tag && size.is_none_or(|s| s == *n))
                })
                .count()
        };
        (
            tagged(
                "model.layers.5.self_attn:aten._scaled_dot_product_flash_attention",
                None,
            ),
            tagged("model.layers.5.self_attn.v_proj:aten.mm", Some(131_072)),
            tagged("model.layers.5.self_attn.k_proj:aten.mm", Some(131_072)),
        )
    };
    // k_proj is the block's second mm: recomputed under both.
    assert_eq!(count(Checkpointing::Full), (8, 2, 2));
    assert_eq!(count(Checkpointing::SelectiveOp), (4, 1, 2));
}

#[test]
fn selective_op_agrees_with_a_pytorch_recording() {
    // models/tools/make_amp_captures.py: TinyLlama (transformers 5.23 LlamaForCausalLM), batch 2 ×
    // 128, autocast bf16, SGD, two iterations, every decoder layer run under
    // `checkpoint(..., use_reentrant=False, context_fn=<torchtitan 9dec370's op-level policy>,
    // preserve_rng_state=False)` on fake CPU tensors with CUDA's kernel and autocast rules,
    // PyTorch 2.15. amp_fixtures.rs compares its peaks (the step's and each phase's); here the
    // second backward (recomputations included) allocates and frees the same sizes, as many
    // times each. Not in the same order: the lowering frees a decoder layer's normalized input
    // after its last use where PyTorch's recomputation keeps it in `LlamaDecoderLayer.forward`'s
    // local until the attention returns (and the q_proj output likewise), as it does under
    // `full` (the ckptfull recording) — not a selective-checkpointing rule. The forwards differ
    // in the mask's temporaries, which the lowering summarizes (see loop_knobs.rs).
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/amp");
    let theirs = vramsim_traces::read_trace(
        dir.join("tinyllama-1.1b__b2s128__amp-bf16-sgd-ckptselective-op.jsonl.gz"),
    )
    .unwrap();
    let mut r = Recipe::new(2, 128);
    r.precision = Precision::AmpBf16;
    r.optimizer = OptimizerKind::Sgd;
    r.attention = Attention::Eager;
    r.checkpointing = Checkpointing::SelectiveOp;
    r.checkpoint_impl = CheckpointImpl::NonReentrant;
    r.iterations = 2;
    r.fidelity = Fidelity::MetaCapture;
    r.use_cache = Some(false);
    let ours = lower(&zoo::build("tinyllama-1.1b", &r).unwrap(), &r).unwrap();
    let (_, ab) = common::signed_sizes(&ours, "backward", Some(1));
    let (_, bb) = common::signed_sizes(&theirs, "backward", Some(1));
    let mut diff: HashMap<i64, i64> = HashMap::new();
    for x in &ab {
        *diff.entry(*x).or_default() += 1;
    }
    for x in &bb {
        *diff.entry(*x).or_default() -= 1;
    }
    diff.retain(|_, c| *c != 0);
    assert!(diff.is_empty(), "(size, ours - theirs): {diff:?}");
    assert_eq!(ab.len(), bb.len());
    let peak = |t: &Trace| common::peak_between(t, 0, t.events.len());
    assert_eq!(peak(&ours), peak(&theirs));
    // By hand, from the two recordings: the forward's peak (at its end) is full checkpointing's
    // plus, in each of the 22 layers, the cached outputs of the 1st, 3rd, 5th and 7th mm (bf16
    // under autocast): q_proj [256, 2048], v_proj [256, 256], gate_proj [256, 5632], down_proj
    // [256, 2048].
    let fwd_peak = |file: &str| {
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap();
        fx["peak_by_phase"]["forward"].as_u64().unwrap()
    };
    let per_layer = 2 * 256 * (2048 + 256 + 5632 + 2048);
    assert_eq!(
        fwd_peak("tinyllama-1.1b__b2s128__amp-bf16-sgd-ckptselective-op.json"),
        fwd_peak("tinyllama-1.1b__b2s128__amp-bf16-sgd-ckptfull.json") + 22 * per_layer
    );
}
