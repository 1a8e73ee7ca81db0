//! LLaMA-style decoders as HF transformers' `LlamaForCausalLM` (transformers 5.23,
//! `modeling_llama.py`) runs them in training: `LlamaRMSNorm` in float32, SwiGLU MLP, rotary
//! embeddings computed once per forward (`cos`/`sin` `[1, S, D]`), grouped-query attention with
//! `repeat_kv` (`expand` + `reshape`, which copies) in eager mode, softmax in float32, dropout on the
//! probabilities only when `attention_dropout` > 0 (0 in every preset), untied `lm_head` unless `tie_word_embeddings`, and the loss on
//! `logits.float()`. With SDPA on CUDA and no padding mask, HF passes `enable_gqa` instead of
//! repeating K/V.

use super::heads;
use super::nn::{Activation, AttnImpl};
use super::tp::TpPlan;
use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind};
use crate::recipe::{Head, Loss};
use std::borrow::Cow;

/// A LLaMA-style configuration (`LlamaConfig` fields from the model's config.json; Mistral and
/// Qwen2 are the same graph with other biases and windows).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Zoo name (or the name given to an imported config).
    pub name: Cow<'static, str>,
    /// The reference implementation, for the trace metadata.
    pub reference: &'static str,
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
    /// `head_dim` when the config gives one (default `hidden_size / num_attention_heads`).
    pub head_dim: Option<u64>,
    /// Biases on `q_proj`, `k_proj`, `v_proj` (`attention_bias`; always for Qwen2).
    pub qkv_bias: bool,
    /// Bias on `o_proj` (`attention_bias` for Llama; never for Qwen2 and Mistral).
    pub o_bias: bool,
    /// Biases on `gate_proj`, `up_proj`, `down_proj` (`mlp_bias`).
    pub mlp_bias: bool,
    /// `hidden_act` of the gated MLP (`silu`).
    pub activation: Activation,
    /// The attention window of every layer (Mistral's `sliding_window`; Qwen2's when
    /// `use_sliding_window`); `None`: full causal attention.
    pub sliding_window: Option<u64>,
    /// `attention_dropout` (0 by default): `F.dropout` on the attention probabilities of eager
    /// attention (`eager_attention_forward`), `dropout_p` of SDPA; 0 is no op at all.
    pub attention_dropout: f64,
}

impl LlamaConfig {
    /// Size of one attention head.
    pub fn head_dim(&self) -> u64 {
        self.head_dim
            .unwrap_or_else(|| self.hidden.checked_div(self.heads).unwrap_or(0))
    }
}

const LLAMA_REFERENCE: &str = "transformers 5.23 LlamaForCausalLM (modeling_llama.py)";

/// A preset from its config.json's shape fields (the order of `LlamaConfig`'s fields).
#[allow(clippy::too_many_arguments)]
const fn preset(
    name: &'static str,
    hidden: u64,
    intermediate: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    vocab: u64,
    positions: u64,
) -> LlamaConfig {
    LlamaConfig {
        name: Cow::Borrowed(name),
        reference: LLAMA_REFERENCE,
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads,
        vocab,
        positions,
        tie_embeddings: false,
        head_dim: None,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        activation: Activation::Silu,
        sliding_window: None,
        attention_dropout: 0.0,
    }
}

/// `TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T`.
pub const TINYLLAMA: LlamaConfig = preset("tinyllama-1.1b", 2048, 5632, 22, 32, 4, 32000, 2048);
/// `meta-llama/Llama-2-7b-hf`.
pub const LLAMA2_7B: LlamaConfig = preset("llama2-7b", 4096, 11008, 32, 32, 32, 32000, 4096);
/// `meta-llama/Llama-2-13b-hf`.
pub const LLAMA2_13B: LlamaConfig = preset("llama2-13b", 5120, 13824, 40, 40, 40, 32000, 4096);
/// `meta-llama/Llama-2-70b-hf`.
pub const LLAMA2_70B: LlamaConfig = preset("llama2-70b", 8192, 28672, 80, 64, 8, 32000, 4096);
/// `meta-llama/Meta-Llama-3-8B`.
pub const LLAMA3_8B: LlamaConfig = preset("llama3-8b", 4096, 14336, 32, 32, 8, 128256, 8192);
/// `meta-llama/Llama-3.1-405B` (its config.json: hidden 16384, 126 layers, 128 heads, 8 KV heads,
/// FFN 53248, vocabulary 128256, 131072 positions; `rope_theta` 500000 and the `llama3` RoPE
/// scaling change values, not shapes).
pub const LLAMA3_405B: LlamaConfig =
    preset("llama3-405b", 16384, 53248, 126, 128, 8, 128256, 131072);

/// Builds `LlamaForCausalLM(cfg)` at `batch` × `seq` with the loss from `labels`.
pub fn llama(cfg: &LlamaConfig, batch: u64, seq: u64, attn: AttnImpl) -> Result<Graph, GraphError> {
    llama_with_head(
        cfg,
        batch,
        seq,
        attn,
        Head::Lm,
        Loss::Hf,
        false,
        TpPlan::NONE,
    )
}

/// The dropout of `GenericForTokenClassification` when the config has neither
/// `classifier_dropout` nor `hidden_dropout` (LLaMA's, Mistral's and Qwen2's have neither).
pub const CLASSIFIER_DROPOUT: f64 = 0.1;

/// Builds the LLaMA-style decoder with `head` (see [`super::heads`]) at `batch` × `seq`, its loss
/// computed as `loss` says; `use_cache`: the forward builds a `DynamicCache` (see
/// [`super::nn`]'s `kv_cache_update`) that the model output carries; as one rank of `tp` sees
/// it (see [`super::tp`]; the causal-LM head only).
#[allow(clippy::too_many_arguments)]
pub fn llama_with_head(
    cfg: &LlamaConfig,
    batch: u64,
    seq: u64,
    attn: AttnImpl,
    head: Head,
    loss: Loss,
    use_cache: bool,
    tp: TpPlan,
) -> Result<Graph, GraphError> {
    let (h, nh, nkv) = (cfg.hidden, cfg.heads / tp.t, cfg.kv_heads / tp.t);
    let hd = cfg.head_dim();
    let mut b = GraphBuilder::new(&cfg.name, batch, seq);
    let reference = match head {
        Head::Lm | Head::MaskedLm => cfg.reference.to_string(),
        _ => {
            let class = match head {
                Head::SeqCls(_) => "ForSequenceClassification (modeling_layers.py GenericForSequenceClassification)",
                Head::TokenCls(_) => "ForTokenClassification (modeling_layers.py GenericForTokenClassification)",
                _ => "Model",
            };
            // "transformers 5.23 LlamaForCausalLM (modeling_llama.py)" → "... LlamaModel (...)".
            let (base, file) = cfg
                .reference
                .split_once(" (")
                .unwrap_or((cfg.reference, ""));
            let base = base.strip_suffix("ForCausalLM").unwrap_or(base);
            if class == "Model" && !file.is_empty() {
                format!("{base}Model ({file}")
            } else {
                format!("{base}{class}")
            }
        }
    };
    b.meta("reference", reference.into());
    let i64t = DTypeSpec::Fixed(DType::I64);
    let ids = b.input("input_ids", &[batch, seq], i64t);
    let am = b.input("attention_mask", &[batch, seq], i64t);
    let labels = heads::labels_input(&mut b, head, batch, seq);
    // The base model's parameters: `model.*` under a head, top-level for `LlamaModel`.
    let prefix = if head == Head::None { "" } else { "model" };
    let (hidden, embed_w, cache) = b.module(prefix, |b| {
        let (emb, w) = b.module("embed_tokens", |b| {
            if tp.on() {
                // Without position embeddings Megatron's LanguageModelEmbedding reduce-scatters
                // the word embeddings straight into the sequence shard under --sp
                // (`reduce_scatter_embeddings`).
                let w = b.param("weight", &[tp.local_vocab(cfg.vocab), h]);
                return (b.vocab_parallel_embedding(tp, w, ids, tp.sp), w);
            }
            let w = b.param("weight", &[cfg.vocab, h]);
            (b.embedding_op(w, ids), w)
        });
        // `inputs_embeds` is a local of LlamaModel.forward: alive until it returns.
        b.hold(emb);
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
        let mut cache = Vec::new();
        let mut x = emb;
        for l in 0..cfg.layers {
            x = b.region(RegionKind::Block, &format!("layers.{l}"), |b| {
                // `decoder_layer(hidden_states, attention_mask=..., position_ids=position_ids,
                // ...)`: the layer never reads position_ids (cos/sin come in as
                // position_embeddings), but HF's GradientCheckpointingLayer hands
                // `partial(super().__call__, **kwargs)` to the checkpoint, which keeps it.
                b.region_arg(pos);
                // LlamaModel.forward's loop (`hidden_states = decoder_layer(hidden_states, ...)`)
                // keeps the layer's input until the layer returns: what holds it when nothing
                // saves it (frozen layers, no grad).
                b.hold(x);
                let residual = x;
                let y = b.rms_norm("input_layernorm", x);
                let (a, probs) = b.module("self_attn", |b| {
                    // Column-parallel q/k/v (the rank's heads) share one input (one all-gather
                    // under --sp: the buffer is reused), row-parallel o_proj.
                    let y = if tp.on() { b.tp_column_input(tp, y) } else { y };
                    let shp = [batch as i64, seq as i64, -1, hd as i64];
                    let q = b.linear("q_proj", y, nh * hd, cfg.qkv_bias);
                    let q = b.view(q, &shp);
                    let q = b.transpose(q, 1, 2);
                    let k = b.linear("k_proj", y, nkv * hd, cfg.qkv_bias);
                    let k = b.view(k, &shp);
                    let k = b.transpose(k, 1, 2);
                    let v = b.linear("v_proj", y, nkv * hd, cfg.qkv_bias);
                    let v = b.view(v, &shp);
                    let v = b.transpose(v, 1, 2);
                    if !use_cache {
                        b.hold(v);
                    }
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
                    let (k, v) = if use_cache {
                        let (k, v) = b.kv_cache_update(k, v);
                        cache.extend([k, v]);
                        (k, v)
                    } else {
                        (k, v)
                    };
                    b.hold(k);
                    let (o, probs) =
                        b.attention_core_probs(q, k, v, mask, cfg.attention_dropout, true, attn);
                    let o = b.contiguous(o);
                    let o = b.reshape(o, &[batch as i64, seq as i64, -1]);
                    let o = b.contiguous(o);
                    let o = if tp.on() {
                        b.row_parallel_linear(tp, "o_proj", o, h, cfg.o_bias)
                    } else {
                        b.linear("o_proj", o, h, cfg.o_bias)
                    };
                    (o, probs)
                });
                // `hidden_states, _ = self.self_attn(...)`: the probabilities live to the end.
                b.hold_opt(probs);
                let x = b.add(residual, a);
                let residual = x;
                let y = b.rms_norm("post_attention_layernorm", x);
                let f = b.module("mlp", |b| {
                    let y = if tp.on() { b.tp_column_input(tp, y) } else { y };
                    let inter = cfg.intermediate / tp.t;
                    let g = b.linear("gate_proj", y, inter, cfg.mlp_bias);
                    let g = b.activation("act_fn", g, cfg.activation);
                    let u = b.linear("up_proj", y, inter, cfg.mlp_bias);
                    let m = b.mul(g, u);
                    if tp.on() {
                        b.row_parallel_linear(tp, "down_proj", m, h, cfg.mlp_bias)
                    } else {
                        b.linear("down_proj", m, h, cfg.mlp_bias)
                    }
                });
                b.add(residual, f)
            });
        }
        // `hidden_states = self.norm(hidden_states)`: the last layer's output is rebound when
        // the norm returns.
        let out = b.rms_norm("norm", x);
        b.hold_through(x);
        // A replicated head reads the whole sequence (the LM head gathers in its own linear).
        let out = if head == Head::Lm {
            out
        } else {
            b.tp_gather_for_replicated(tp, out)
        };
        (out, w, cache)
    });
    let tied = cfg.tie_embeddings.then_some(embed_w);
    if let (true, Head::Lm, Some(labels)) = (tp.on(), head, labels) {
        b.hold(hidden);
        let (logits, loss) =
            b.tp_causal_lm_head(tp, hidden, labels, tied, tp.local_vocab(cfg.vocab));
        b.keep_output(logits);
        b.keep_output(loss);
        b.set_output(loss);
        return b.finish();
    }
    let out = heads::decoder_head(
        &mut b,
        heads::Decoder::Llama,
        head,
        hidden,
        ids,
        labels,
        tied,
        cfg.vocab,
        loss,
    );
    b.hold_cache(&cache);
    b.keep_output(out);
    b.set_output(out);
    b.finish()
}

type T2 = crate::graph::ValueId;
