//! GPT-2 as HF transformers' `GPT2LMHeadModel` (transformers 5.23, `modeling_gpt2.py`) runs it in
//! training: tied `wte`/`lm_head`, learned positions, dropout 0.1 on embeddings, attention
//! probabilities and residuals, `Conv1D` projections, `gelu_new` decomposed into eight eager ops,
//! eager attention with an additive `[B, 1, S, S]` causal mask (or SDPA), and the loss on
//! `logits.float()` (`ForCausalLMLoss`).

use super::heads;
use super::nn::{Activation, AttnImpl};
use super::tp::TpPlan;
use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind};
use crate::recipe::{Head, Loss};
use std::borrow::Cow;

/// A GPT-2 configuration (`GPT2Config` fields).
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    /// Zoo name (or the name given to an imported config).
    pub name: Cow<'static, str>,
    /// `n_embd`.
    pub hidden: u64,
    /// `n_layer`.
    pub layers: u64,
    /// `n_head`.
    pub heads: u64,
    /// `vocab_size`.
    pub vocab: u64,
    /// `n_positions`.
    pub positions: u64,
    /// `n_inner` (default `4 * n_embd`).
    pub inner: u64,
    /// `embd_pdrop` (0.1 by default).
    pub embd_dropout: f64,
    /// `attn_pdrop` (0.1 by default).
    pub attn_dropout: f64,
    /// `resid_pdrop` (0.1 by default).
    pub resid_dropout: f64,
    /// `activation_function`: HF's eight-op `gelu_new` by default; [`Activation::GeluTanh`] (one
    /// fused `gelu(approximate="tanh")`, `gelu_pytorch_tanh`) is what Korthikanti et al.'s
    /// accounting assumes.
    pub activation: Activation,
    /// `tie_word_embeddings` (default true): `lm_head.weight` is `transformer.wte.weight`; false:
    /// `lm_head` is its own `nn.Linear(n_embd, vocab_size, bias=False)` (`_tied_weights_keys`
    /// applies only when the config ties).
    pub tie_embeddings: bool,
}

impl GptConfig {
    const fn new(name: &'static str, hidden: u64, layers: u64, heads: u64) -> GptConfig {
        GptConfig {
            name: Cow::Borrowed(name),
            hidden,
            layers,
            heads,
            vocab: 50257,
            positions: 1024,
            inner: 4 * hidden,
            embd_dropout: 0.1,
            attn_dropout: 0.1,
            resid_dropout: 0.1,
            activation: Activation::GeluNew,
            tie_embeddings: true,
        }
    }
}

/// `gpt2` (124M), from the `openai-community/gpt2` config.json.
pub const GPT2: GptConfig = GptConfig::new("gpt2", 768, 12, 12);
/// `gpt2-medium` (355M).
pub const GPT2_MEDIUM: GptConfig = GptConfig::new("gpt2-medium", 1024, 24, 16);
/// `gpt2-large` (774M).
pub const GPT2_LARGE: GptConfig = GptConfig::new("gpt2-large", 1280, 36, 20);
/// `gpt2-xl` (1.5B).
pub const GPT2_XL: GptConfig = GptConfig::new("gpt2-xl", 1600, 48, 25);

/// Builds `GPT2LMHeadModel(cfg)` at `batch` × `seq` with the loss from `labels`.
pub fn gpt2(cfg: &GptConfig, batch: u64, seq: u64, attn: AttnImpl) -> Result<Graph, GraphError> {
    gpt2_with_head(
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

/// The dropout of `GPT2ForTokenClassification` when the config has neither `classifier_dropout`
/// nor `hidden_dropout` (GPT-2's configs have neither).
pub const CLASSIFIER_DROPOUT: f64 = 0.1;

/// Builds GPT-2 with `head` (see [`super::heads`]) at `batch` × `seq`, its loss computed as
/// `loss` says, as one rank of `tp` sees it (see [`super::tp`]; the causal-LM head only).
#[allow(clippy::too_many_arguments)]
pub fn gpt2_with_head(
    cfg: &GptConfig,
    batch: u64,
    seq: u64,
    attn: AttnImpl,
    head: Head,
    loss: Loss,
    use_cache: bool,
    tp: TpPlan,
) -> Result<Graph, GraphError> {
    let (h, nh) = (cfg.hidden, cfg.heads);
    let hd = h / nh;
    let mut b = GraphBuilder::new(&cfg.name, batch, seq);
    let class = match head {
        Head::Lm | Head::MaskedLm => "GPT2LMHeadModel",
        Head::SeqCls(_) => "GPT2ForSequenceClassification",
        Head::TokenCls(_) => "GPT2ForTokenClassification",
        Head::None => "GPT2Model",
    };
    b.meta(
        "reference",
        format!("transformers 5.23 {class} (modeling_gpt2.py)").into(),
    );
    let i64t = DTypeSpec::Fixed(DType::I64);
    let ids = b.input("input_ids", &[batch, seq], i64t);
    let am = b.input("attention_mask", &[batch, seq], i64t);
    let labels = heads::labels_input(&mut b, head, batch, seq);
    // The base model's parameters: `transformer.*` under a head, top-level for `GPT2Model`.
    let prefix = if head == Head::None {
        ""
    } else {
        "transformer"
    };
    let (hidden, wte, cache) = b.module(prefix, |b| {
        let (emb, wte) = b.module("wte", |b| {
            if tp.on() {
                // Megatron's LanguageModelEmbedding with learned positions all-reduces the word
                // embeddings (`reduce_scatter_embeddings` needs no position embedding).
                let w = b.param("weight", &[tp.local_vocab(cfg.vocab), h]);
                return (b.vocab_parallel_embedding(tp, w, ids, false), w);
            }
            let w = b.param("weight", &[cfg.vocab, h]);
            (b.embedding_op(w, ids), w)
        });
        b.hold(emb);
        // position_ids = arange(S) + past_length, unsqueezed: [1, S] int64 (saved by wpe).
        let pos = b.factory(
            "aten.add",
            &[],
            &[1, seq],
            i64t,
            vec![(vec![seq], DType::I64)],
        );
        // `position_ids`, a local of GPT2Model.forward until it returns.
        b.hold(pos);
        let pemb = b.embedding("wpe", pos, cfg.positions, h);
        b.hold(pemb);
        let x = b.add(emb, pemb);
        let mask = match attn {
            AttnImpl::Eager => {
                let m = b.causal_mask(am, batch, seq);
                b.hold(m);
                Some(m)
            }
            AttnImpl::Sdpa(_) => None,
        };
        // Sequence parallelism: the sequence shard (`scatter_to_sequence_parallel_region` and
        // its clone, as LanguageModelEmbedding.forward before the embedding dropout) taken as
        // the dropout's first step; `hidden_states = self.drop(hidden_states)` keeps the full
        // sum alive until the dropout returns.
        let mut x = if tp.sp {
            let full = x;
            let y = b.module("drop", |b| {
                let shard = b.tp_scatter(tp, full);
                b.dropout(shard, cfg.embd_dropout)
            });
            b.hold_through(full);
            y
        } else {
            b.module("drop", |b| b.dropout(x, cfg.embd_dropout))
        };
        let mut cache = Vec::new();
        for l in 0..cfg.layers {
            x = b.region(RegionKind::Block, &format!("h.{l}"), |b| {
                // GPT2Model.forward passes `position_ids=position_ids` to every block (5.23,
                // unread there): a non-reentrant checkpoint keeps it, which matters once the
                // frozen wpe no longer saves it.
                b.region_arg(pos);
                // GPT2Model.forward's loop (`hidden_states = block(hidden_states, ...)[0]`) keeps
                // the block's input until the block returns: what holds it when nothing saves it
                // (frozen blocks, no grad).
                b.hold(x);
                let residual = x;
                let y = b.layer_norm("ln_1", x);
                let (a, probs) = b.module("attn", |b| {
                    // Column-parallel c_attn (the rank's heads), row-parallel c_proj.
                    let y = if tp.on() { b.tp_column_input(tp, y) } else { y };
                    let h = h / tp.t;
                    let qkv = b.conv1d("c_attn", y, 3 * h);
                    b.hold(qkv);
                    let parts = b.split(qkv, &[h, h, h], 2);
                    let shp = [batch as i64, seq as i64, -1, hd as i64];
                    let k = b.view(parts[1], &shp);
                    let k = b.transpose(k, 1, 2);
                    let v = b.view(parts[2], &shp);
                    let v = b.transpose(v, 1, 2);
                    let q = b.view(parts[0], &shp);
                    let q = b.transpose(q, 1, 2);
                    let (k, v) = if use_cache {
                        let (k, v) = b.kv_cache_update(k, v);
                        cache.extend([k, v]);
                        (k, v)
                    } else {
                        (k, v)
                    };
                    let (o, probs) =
                        b.attention_core_probs(q, k, v, mask, cfg.attn_dropout, false, attn);
                    let o = b.reshape(o, &[batch as i64, seq as i64, -1]);
                    let o = b.contiguous(o);
                    let o = if tp.on() {
                        b.row_parallel_conv1d(tp, "c_proj", o, cfg.hidden)
                    } else {
                        b.conv1d("c_proj", o, cfg.hidden)
                    };
                    (
                        b.module("resid_dropout", |b| b.dropout(o, cfg.resid_dropout)),
                        probs,
                    )
                });
                // `attn_output, _ = self.attn(...)`: the probabilities live to the block's end.
                b.hold(a);
                b.hold_opt(probs);
                let x = b.add(a, residual);
                // `hidden_states = self.ln_1(hidden_states)` holds the norm's output until
                // `hidden_states = attn_output + residual` rebinds it (GPT2Block.forward): under
                // autocast c_attn saves its bf16 copy, and the float32 output lives to this add.
                b.hold_through(y);
                let residual = x;
                let y = b.layer_norm("ln_2", x);
                let f = b.module("mlp", |b| {
                    if tp.on() {
                        let y = b.tp_column_input(tp, y);
                        let y = b.conv1d("c_fc", y, cfg.inner / tp.t);
                        let y = b.activation("act", y, cfg.activation);
                        let y = b.row_parallel_conv1d(tp, "c_proj", y, h);
                        return b.module("dropout", |b| b.dropout(y, cfg.resid_dropout));
                    }
                    let y = b.conv1d("c_fc", y, cfg.inner);
                    let y = b.activation("act", y, cfg.activation);
                    let y = b.conv1d("c_proj", y, h);
                    b.module("dropout", |b| b.dropout(y, cfg.resid_dropout))
                });
                b.hold(f);
                let x = b.add(residual, f);
                // Likewise `ln_2`'s output until `hidden_states = residual + feed_forward_hidden_states`.
                b.hold_through(y);
                x
            });
        }
        let y = b.layer_norm("ln_f", x);
        // A replicated head reads the whole sequence (the LM head gathers in its own linear).
        let y = if head == Head::Lm {
            y
        } else {
            b.tp_gather_for_replicated(tp, y)
        };
        (y, wte, cache)
    });
    let tied = cfg.tie_embeddings.then_some(wte);
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
        heads::Decoder::Gpt2,
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
