//! LLaMA-style decoders as HF transformers' `LlamaForCausalLM` (transformers 5.23,
//! `modeling_llama.py`) runs them in training: `LlamaRMSNorm` in float32, SwiGLU MLP, rotary
//! embeddings computed once per forward (`cos`/`sin` `[1, S, D]`), grouped-query attention with
//! `repeat_kv` (`expand` + `reshape`, which copies) in eager mode, softmax in float32, no dropout
//! (`attention_dropout = 0`), untied `lm_head` unless `tie_word_embeddings`, and the loss on
//! `logits.float()`. With SDPA on CUDA and no padding mask, HF passes `enable_gqa` instead of
//! repeating K/V.

use super::nn::AttnImpl;
use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind};

/// A LLaMA configuration (`LlamaConfig` fields from the model's config.json).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Zoo name.
    pub name: &'static str,
    /// `hidden_size`.
    pub hidden: u64,
    /// `intermediate_size`.
    pub intermediate: u64,
    /// `num_hidden_layers`.
    pub layers: u64,
    /// `num_attention_heads`.
    pub heads: u64,
    /// `num_key_value_heads`.
    pub kv_heads: u64,
    /// `vocab_size`.
    pub vocab: u64,
    /// `max_position_embeddings`.
    pub positions: u64,
    /// `tie_word_embeddings`.
    pub tie_embeddings: bool,
}

/// `TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T`.
pub const TINYLLAMA: LlamaConfig = LlamaConfig {
    name: "tinyllama-1.1b",
    hidden: 2048,
    intermediate: 5632,
    layers: 22,
    heads: 32,
    kv_heads: 4,
    vocab: 32000,
    positions: 2048,
    tie_embeddings: false,
};
/// `meta-llama/Llama-2-7b-hf`.
pub const LLAMA2_7B: LlamaConfig = LlamaConfig {
    name: "llama2-7b",
    hidden: 4096,
    intermediate: 11008,
    layers: 32,
    heads: 32,
    kv_heads: 32,
    vocab: 32000,
    positions: 4096,
    tie_embeddings: false,
};
/// `meta-llama/Llama-2-13b-hf`.
pub const LLAMA2_13B: LlamaConfig = LlamaConfig {
    name: "llama2-13b",
    hidden: 5120,
    intermediate: 13824,
    layers: 40,
    heads: 40,
    kv_heads: 40,
    vocab: 32000,
    positions: 4096,
    tie_embeddings: false,
};
/// `meta-llama/Llama-2-70b-hf`.
pub const LLAMA2_70B: LlamaConfig = LlamaConfig {
    name: "llama2-70b",
    hidden: 8192,
    intermediate: 28672,
    layers: 80,
    heads: 64,
    kv_heads: 8,
    vocab: 32000,
    positions: 4096,
    tie_embeddings: false,
};
/// `meta-llama/Meta-Llama-3-8B`.
pub const LLAMA3_8B: LlamaConfig = LlamaConfig {
    name: "llama3-8b",
    hidden: 4096,
    intermediate: 14336,
    layers: 32,
    heads: 32,
    kv_heads: 8,
    vocab: 128256,
    positions: 8192,
    tie_embeddings: false,
};

/// Builds `LlamaForCausalLM(cfg)` at `batch` × `seq` with the loss from `labels`.
pub fn llama(cfg: &LlamaConfig, batch: u64, seq: u64, attn: AttnImpl) -> Result<Graph, GraphError> {
    let (h, nh, nkv) = (cfg.hidden, cfg.heads, cfg.kv_heads);
    let hd = h / nh;
    let mut b = GraphBuilder::new(cfg.name, batch, seq);
    b.meta(
        "reference",
        "transformers 5.23 LlamaForCausalLM (modeling_llama.py)".into(),
    );
    let i64t = DTypeSpec::Fixed(DType::I64);
    let ids = b.input("input_ids", &[batch, seq], i64t);
    let am = b.input("attention_mask", &[batch, seq], i64t);
    let labels = b.input("labels", &[batch, seq], i64t);
    let (hidden, embed_w) = b.module("model", |b| {
        let (emb, w) = b.module("embed_tokens", |b| {
            let w = b.param("weight", &[cfg.vocab, h]);
            (b.embedding_op(w, ids), w)
        });
        // position_ids = (arange(S) + past).unsqueeze(0): [1, S] int64.
        let pos = b.factory(
            "aten.add",
            &[],
            &[1, seq],
            i64t,
            vec![(vec![seq], DType::I64)],
        );
        b.hold(pos);
        let mask = match attn {
            AttnImpl::Eager => {
                let m = b.causal_mask(am, batch, seq);
                b.hold(m);
                Some(m)
            }
            AttnImpl::Sdpa(_) => None,
        };
        // LlamaRotaryEmbedding (no_grad): inv_freq buffers, cos/sin [1, S, D] in float32, then
        // .to(x.dtype).
        let (cos, sin) = b.module("rotary_emb", |b| {
            let _inv = b.buffer("inv_freq", &[hd / 2], DTypeSpec::Model);
            let _orig = b.buffer("original_inv_freq", &[hd / 2], DTypeSpec::Model);
            let temps = vec![
                (vec![1, seq, 1], DType::F32),
                (vec![1, seq, hd / 2], DType::F32),
                (vec![1, seq, hd], DType::F32),
            ];
            let cos = b.factory(
                "aten.mul",
                &[pos],
                &[1, seq, hd],
                DTypeSpec::Fixed(DType::F32),
                temps.clone(),
            );
            let sin = b.factory(
                "aten.mul",
                &[pos],
                &[1, seq, hd],
                DTypeSpec::Fixed(DType::F32),
                vec![],
            );
            let cos = b.to_dtype_of(cos, emb);
            let sin = b.to_dtype_of(sin, emb);
            (cos, sin)
        });
        b.hold(cos);
        b.hold(sin);
        let mut x = emb;
        for l in 0..cfg.layers {
            x = b.region(RegionKind::Block, &format!("layers.{l}"), |b| {
                let residual = x;
                let y = b.rms_norm("input_layernorm", x);
                let a = b.module("self_attn", |b| {
                    let shp = [batch as i64, seq as i64, -1, hd as i64];
                    let q = b.linear("q_proj", y, nh * hd, false);
                    let q = b.view(q, &shp);
                    let q = b.transpose(q, 1, 2);
                    let k = b.linear("k_proj", y, nkv * hd, false);
                    let k = b.view(k, &shp);
                    let k = b.transpose(k, 1, 2);
                    let v = b.linear("v_proj", y, nkv * hd, false);
                    let v = b.view(v, &shp);
                    let v = b.transpose(v, 1, 2);
                    b.hold(v);
                    // apply_rotary_pos_emb: q*cos + rotate_half(q)*sin, same for k.
                    let c = b.unsqueeze(cos, 1);
                    let s = b.unsqueeze(sin, 1);
                    let rope = |x: T2, b: &mut GraphBuilder| {
                        let xc = b.mul(x, c);
                        let x1 = b.slice(x, -1, 0, hd / 2);
                        let x2 = b.slice(x, -1, hd / 2, hd);
                        let nx2 = b.neg(x2);
                        let rh = b.cat(&[nx2, x1], -1);
                        let rs = b.mul(rh, s);
                        b.add(xc, rs)
                    };
                    let q = rope(q, b);
                    let k = rope(k, b);
                    b.hold(q);
                    b.hold(k);
                    let o = b.attention_core(q, k, v, mask, 0.0, true, attn);
                    let o = b.contiguous(o);
                    let o = b.reshape(o, &[batch as i64, seq as i64, -1]);
                    let o = b.contiguous(o);
                    b.linear("o_proj", o, h, false)
                });
                let x = b.add(residual, a);
                let residual = x;
                let y = b.rms_norm("post_attention_layernorm", x);
                let f = b.module("mlp", |b| {
                    let g = b.linear("gate_proj", y, cfg.intermediate, false);
                    let g = b.module("act_fn", |b| b.silu(g));
                    let u = b.linear("up_proj", y, cfg.intermediate, false);
                    let m = b.mul(g, u);
                    b.linear("down_proj", m, h, false)
                });
                b.add(residual, f)
            });
        }
        (b.rms_norm("norm", x), w)
    });
    let logits = b.module("lm_head", |b| {
        let w = if cfg.tie_embeddings {
            embed_w
        } else {
            b.param("weight", &[cfg.vocab, h])
        };
        b.linear_op(hidden, w, None)
    });
    b.hold(logits);
    let loss = b.causal_lm_loss(logits, labels);
    b.set_output(loss);
    b.finish()
}

type T2 = crate::graph::ValueId;
