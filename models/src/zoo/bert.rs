//! BERT as HF transformers' `BertForMaskedLM` (transformers 5.23, `modeling_bert.py`) runs it in
//! training, from `input_ids` and `labels` (no `attention_mask`: with an all-ones mask HF skips it on
//! CUDA, which is what no mask does; no `token_type_ids`: the registered all-zero buffer is used):
//!
//! * `BertEmbeddings`: `torch.gather` of the `token_type_ids` buffer at the `position_ids` buffer
//!   slice (an int64 `[1, S]`), word + token-type embeddings, + position embeddings, `LayerNorm`,
//!   dropout 0.1; the three embedding outputs are locals alive to the end of the module;
//! * `BertLayer` × L: q/k/v `nn.Linear`s, eager attention (`matmul`, `* scaling`, `softmax`,
//!   dropout 0.1, `matmul`, `transpose(1, 2).contiguous()`) or SDPA, `dense` + dropout +
//!   `LayerNorm(h + input)`, `intermediate.dense` + exact GELU, `output.dense` + dropout +
//!   `LayerNorm(h + input)`;
//! * `BertOnlyMLMHead`: `transform` (dense, GELU, LayerNorm), `decoder` tied to the word
//!   embeddings with the head's own bias, and `CrossEntropyLoss` over all `B·S` positions on the
//!   logits as they are (no float upcast). No pooler (`add_pooling_layer=False`).

use super::heads;
use super::nn::{Activation, AttnImpl};
use super::tp::TpPlan;
use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind};
use crate::recipe::Head;
use std::borrow::Cow;

/// A BERT configuration (`BertConfig` fields from the model's config.json).
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    /// Zoo name (or the name given to an imported config).
    pub name: Cow<'static, str>,
    /// `hidden_size`.
    pub hidden: u64,
    /// `num_hidden_layers`.
    pub layers: u64,
    /// `num_attention_heads`.
    pub heads: u64,
    /// `intermediate_size`.
    pub intermediate: u64,
    /// `vocab_size`.
    pub vocab: u64,
    /// `max_position_embeddings`.
    pub positions: u64,
    /// `type_vocab_size`.
    pub type_vocab: u64,
    /// `hidden_dropout_prob`.
    pub hidden_dropout: f64,
    /// `attention_probs_dropout_prob`.
    pub attention_dropout: f64,
    /// `hidden_act` (of `intermediate` and of the MLM head's `transform`).
    pub activation: Activation,
    /// `tie_word_embeddings` (default true): `cls.predictions.decoder.weight` is the word embeddings
    /// and `decoder.bias` is `cls.predictions.bias`. False: transformers 5.23 ties neither
    /// (`get_expanded_tied_weights_keys` returns nothing), so the decoder has its own weight and
    /// bias, and `cls.predictions.bias` stays a parameter the forward never uses (no gradient).
    pub tie_embeddings: bool,
}

/// `google-bert/bert-base-uncased`: 109,514,298 parameters with the MLM head.
pub const BERT_BASE: BertConfig = BertConfig {
    name: Cow::Borrowed("bert-base"),
    hidden: 768,
    layers: 12,
    heads: 12,
    intermediate: 3072,
    vocab: 30522,
    positions: 512,
    type_vocab: 2,
    hidden_dropout: 0.1,
    attention_dropout: 0.1,
    activation: Activation::Gelu,
    tie_embeddings: true,
};

/// `google-bert/bert-large-uncased`: 335,174,458 parameters with the MLM head.
pub const BERT_LARGE: BertConfig = BertConfig {
    name: Cow::Borrowed("bert-large"),
    hidden: 1024,
    layers: 24,
    heads: 16,
    intermediate: 4096,
    ..BERT_BASE
};

/// Builds `BertForMaskedLM(cfg)` at `batch` × `seq` with the MLM loss over every position.
pub fn bert(cfg: &BertConfig, batch: u64, seq: u64, attn: AttnImpl) -> Result<Graph, GraphError> {
    bert_with_head(cfg, batch, seq, attn, Head::MaskedLm)
}

/// Builds BERT with `head` (see [`super::heads`]) at `batch` × `seq`. Every BERT head computes
/// its loss with `CrossEntropyLoss` (`MSELoss` for `seq-cls:1`) on the logits as they are, so
/// `--loss` changes nothing here. `BertModel` has its pooler (dense + tanh on `[CLS]`) under
/// `seq-cls` and `none` (`add_pooling_layer=True`, `AutoModel`'s default), not under
/// `masked-lm` and `token-cls` (`add_pooling_layer=False`).
pub fn bert_with_head(
    cfg: &BertConfig,
    batch: u64,
    seq: u64,
    attn: AttnImpl,
    head: Head,
) -> Result<Graph, GraphError> {
    bert_with_head_mask(cfg, batch, seq, attn, head, false, TpPlan::NONE)
}

/// [`bert_with_head`], and with `all_ones_mask` as transformers 4.16's `BertModel.forward` runs
/// without an `attention_mask`: `attention_mask = torch.ones((B, S))` (float32), then
/// `get_extended_attention_mask`: `mask[:, None, None, :]`, `.to(dtype=self.dtype)`, `(1.0 - m) *
/// -10000.0` (two new `[B, 1, 1, S]` tensors, the first dying with the expression); the result is
/// a local of `BertModel.forward` and every layer's eager attention adds it to its scaled scores
/// (transformers 4.16 had no other BERT attention; SDPA ignores it here).
/// `tp`: as one rank of a tensor-parallel group sees it (see [`super::tp`]; the masked-LM head
/// only): Megatron's BERT split, column-parallel q/k/v and `intermediate.dense`, row-parallel
/// `attention.output.dense` and `output.dense`, vocabulary-parallel word embeddings and decoder.
#[allow(clippy::too_many_arguments)]
pub fn bert_with_head_mask(
    cfg: &BertConfig,
    batch: u64,
    seq: u64,
    attn: AttnImpl,
    head: Head,
    all_ones_mask: bool,
    tp: TpPlan,
) -> Result<Graph, GraphError> {
    let (h, nh) = (cfg.hidden, cfg.heads);
    let hd = h / nh;
    let mut b = GraphBuilder::new(&cfg.name, batch, seq);
    let class = match head {
        Head::Lm | Head::MaskedLm => "BertForMaskedLM",
        Head::SeqCls(_) => "BertForSequenceClassification",
        Head::TokenCls(_) => "BertForTokenClassification",
        Head::None => "BertModel",
    };
    b.meta(
        "reference",
        format!("transformers 5.23 {class} (modeling_bert.py)").into(),
    );
    let i64t = DTypeSpec::Fixed(DType::I64);
    let ids = b.input("input_ids", &[batch, seq], i64t);
    let labels = heads::labels_input(&mut b, head, batch, seq);
    let pooler = matches!(head, Head::SeqCls(_) | Head::None);
    let prefix = if head == Head::None { "" } else { "bert" };
    let (x, word_w, pooled) = b.module(prefix, |b| {
        let (x, word_w) = b.module("embeddings", |b| {
            let word_w = b.param("word_embeddings.weight", &[tp.local_vocab(cfg.vocab), h]);
            let pos_w = b.param("position_embeddings.weight", &[cfg.positions, h]);
            let tt_w = b.param("token_type_embeddings.weight", &[cfg.type_vocab, h]);
            let ln_w = b.param("LayerNorm.weight", &[h]);
            let ln_b = b.param("LayerNorm.bias", &[h]);
            let pos_ids = b.buffer("position_ids", &[1, cfg.positions], i64t);
            let tt_ids = b.buffer("token_type_ids", &[1, cfg.positions], i64t);
            // position_ids = self.position_ids[:, :S]; token_type_ids =
            // gather(self.token_type_ids.expand(1, -1), 1, position_ids).expand(B, S).
            let pos = b.slice(pos_ids, 1, 0, seq);
            let tt = b.factory("aten.gather", &[tt_ids, pos], &[1, seq], i64t, vec![]);
            let tt = b.expand(tt, &[batch, seq]);
            let we = b.module("word_embeddings", |b| {
                if tp.on() {
                    // With token types, Megatron's LanguageModelEmbedding all-reduces the word
                    // embeddings (no `reduce_scatter_embeddings`).
                    b.vocab_parallel_embedding(tp, word_w, ids, false)
                } else {
                    b.embedding_op(word_w, ids)
                }
            });
            let te = b.module("token_type_embeddings", |b| b.embedding_op(tt_w, tt));
            let x = b.add(we, te);
            let pe = b.module("position_embeddings", |b| b.embedding_op(pos_w, pos));
            let x = b.add(x, pe);
            for t in [we, te, pe] {
                b.hold(t);
            }
            // Sequence parallelism: the rank's shard of the summed embeddings
            // (`scatter_to_sequence_parallel_region` and its clone) taken as the LayerNorm's first
            // step, LayerNorm and dropout on it; `embeddings = self.LayerNorm(embeddings)` keeps the
            // full sum alive until the LayerNorm returns.
            let x = if tp.sp {
                let full = x;
                let y = b.module("LayerNorm", |b| {
                    let shard = b.tp_scatter(tp, full);
                    b.layer_norm_op(shard, ln_w, ln_b)
                });
                b.hold_through(full);
                y
            } else {
                b.module("LayerNorm", |b| b.layer_norm_op(x, ln_w, ln_b))
            };
            (
                b.module("dropout", |b| b.dropout(x, cfg.hidden_dropout)),
                word_w,
            )
        });
        let mut x = x;
        let ext_mask = if all_ones_mask && matches!(attn, AttnImpl::Eager) {
            let ones = b.factory(
                "aten.ones",
                &[],
                &[batch, seq],
                DTypeSpec::Fixed(DType::F32),
                vec![],
            );
            let m = b.view(ones, &[batch as i64, 1, 1, seq as i64]);
            let m = b.to_dtype_of(m, word_w);
            let m = b.add_scalar(m); // 1.0 - m
            let m = b.mul_scalar(m); // * -10000.0
            b.hold(m);
            Some(m)
        } else {
            None
        };
        b.push_module("encoder");
        for l in 0..cfg.layers {
            x = b.region(RegionKind::Block, &format!("layer.{l}"), |b| {
                let input = x;
                let (a, probs) = b.module("attention", |b| {
                    let (o, probs) = b.module("self", |b| {
                        let shp = [batch as i64, seq as i64, -1, hd as i64];
                        // Column-parallel q/k/v: the rank's heads.
                        let input = if tp.on() {
                            b.tp_column_input(tp, input)
                        } else {
                            input
                        };
                        let h = h / tp.t;
                        let q = b.linear("query", input, h, true);
                        let q = b.view(q, &shp);
                        let q = b.transpose(q, 1, 2);
                        let k = b.linear("key", input, h, true);
                        let k = b.view(k, &shp);
                        let k = b.transpose(k, 1, 2);
                        let v = b.linear("value", input, h, true);
                        let v = b.view(v, &shp);
                        let v = b.transpose(v, 1, 2);
                        for t in [q, k, v] {
                            b.hold(t);
                        }
                        let (o, probs) = b.attention_core_probs_with(
                            q,
                            k,
                            v,
                            ext_mask,
                            cfg.attention_dropout,
                            false,
                            attn,
                            false,
                        );
                        let o = b.contiguous(o);
                        let o = b.reshape(o, &[batch as i64, seq as i64, -1]);
                        (b.contiguous(o), probs)
                    });
                    // `attention_output = self.output(attention_output, hidden_states)`.
                    let out = b.module("output", |b| self_output(b, cfg, o, input, tp));
                    b.hold_through(o);
                    (out, probs)
                });
                // `self_attention_output, _ = self.attention(...)`: the probabilities (and the
                // layer's argument and attention output) live to the end of the layer.
                b.hold_opt(probs);
                b.hold(a);
                b.hold(input);
                let i = b.module("intermediate", |b| {
                    let a = if tp.on() { b.tp_column_input(tp, a) } else { a };
                    let i = b.linear("dense", a, cfg.intermediate / tp.t, true);
                    b.activation("intermediate_act_fn", i, cfg.activation)
                });
                // feed_forward_chunk: `intermediate_output` lives until it returns.
                let out = b.module("output", |b| self_output(b, cfg, i, a, tp));
                b.hold_through(i);
                out
            });
        }
        b.pop_module("encoder");
        // A replicated head (pooler, classifiers) reads the whole sequence; the MLM head is
        // vocabulary-parallel and gathers in its own linear.
        let x = if head == Head::MaskedLm {
            x
        } else {
            b.tp_gather_for_replicated(tp, x)
        };
        // `sequence_output` is a local of BertModel.forward; BertPooler: `hidden[:, 0]`, dense,
        // tanh.
        b.hold(x);
        let pooled = pooler.then(|| {
            b.module("pooler", |b| {
                let first = b.select(x, 1, 0);
                let p = b.linear("dense", first, h, true);
                b.module("activation", |b| b.tanh(p))
            })
        });
        (x, word_w, pooled)
    });
    let out = match (head, labels) {
        (Head::SeqCls(n), Some(labels)) => {
            // `outputs` (last_hidden_state, pooler_output) is a local of forward.
            b.hold(x);
            let pooled = pooled.expect("seq-cls builds the pooler");
            b.hold(pooled);
            let d = b.module("dropout", |b| b.dropout(pooled, cfg.hidden_dropout));
            b.hold(d);
            let logits = b.linear("classifier", d, n, true);
            b.hold(logits);
            let loss = heads::sequence_classification_loss(
                &mut b,
                logits,
                labels,
                n,
                ("MSELoss", "CrossEntropyLoss"),
            );
            b.keep_output(logits);
            loss
        }
        (Head::TokenCls(n), Some(labels)) => {
            b.hold(x);
            let logits =
                heads::token_classifier(&mut b, x, cfg.hidden_dropout, "classifier", n, true);
            b.hold(logits);
            let loss = heads::plain_cross_entropy(&mut b, "CrossEntropyLoss", logits, labels);
            b.keep_output(logits);
            loss
        }
        (Head::None, _) | (_, None) => {
            // `out = model(...)` holds last_hidden_state and pooler_output; the loss does not
            // reach the pooler, whose autograd nodes die with `out` when the forward returns.
            b.keep_output(x);
            if let Some(p) = pooled {
                b.keep_output(p);
            }
            heads::hidden_state_loss(&mut b, x)
        }
        (_, Some(labels)) => {
            // BertForMaskedLM.forward: `sequence_output = outputs[0]` (and `outputs`) are locals
            // until forward returns, through the loss. Under autocast `transform.dense` saves its
            // 16-bit copy, not this float32 tensor, so only these references keep it alive.
            b.hold(x);
            masked_lm_head(&mut b, cfg, x, word_w, labels, tp)
        }
    };
    b.keep_output(out);
    b.set_output(out);
    b.finish()
}

/// `BertOnlyMLMHead` and `CrossEntropyLoss()(prediction_scores.view(-1, V), labels.view(-1))`.
fn masked_lm_head(
    b: &mut GraphBuilder,
    cfg: &BertConfig,
    x: crate::graph::ValueId,
    word_w: crate::graph::ValueId,
    labels: crate::graph::ValueId,
    tp: TpPlan,
) -> crate::graph::ValueId {
    let h = cfg.hidden;
    let vocab = tp.local_vocab(cfg.vocab);
    let logits = b.module("cls.predictions", |b| {
        // BertLMPredictionHead registers its own `bias` (tied to decoder.bias) before its children.
        // Tensor parallelism: the transform stays whole (Megatron's BertLMHead dense is not
        // split; on the sequence shard under --sp), the decoder is column-parallel over the
        // rank's vocabulary with its share of the bias.
        let bias = b.param("bias", &[vocab]);
        let y = b.module("transform", |b| {
            let y = b.linear("dense", x, h, true);
            let y = b.activation("transform_act_fn", y, cfg.activation);
            b.layer_norm("LayerNorm", y)
        });
        b.module("decoder", |b| {
            let y = if tp.on() { b.tp_column_input(tp, y) } else { y };
            if cfg.tie_embeddings {
                b.linear_op(y, word_w, Some(bias))
            } else {
                let w = b.param("weight", &[vocab, h]);
                let bb = b.param("bias", &[vocab]);
                b.linear_op(y, w, Some(bb))
            }
        })
    });
    b.hold(logits);
    // CrossEntropyLoss()(prediction_scores.view(-1, V), labels.view(-1))
    let loss = b.module("CrossEntropyLoss", |b| {
        let flat = b.view(logits, &[-1, vocab as i64]);
        let tgt = b.view(labels, &[-1]);
        if tp.on() {
            // Megatron's BERT loss: `vocab_parallel_cross_entropy` on the rank's logits.
            b.vocab_parallel_loss(flat, tgt)
        } else {
            b.cross_entropy(flat, tgt)
        }
    });
    b.keep_output(logits);
    loss
}

/// `BertSelfOutput` / `BertOutput`: `h = dense(h)`, `h = dropout(h)`, `h = LayerNorm(h + input)`;
/// the dropout output is rebound only when the LayerNorm returns. Under tensor parallelism
/// `dense` is row-parallel.
fn self_output(
    b: &mut GraphBuilder,
    cfg: &BertConfig,
    h: crate::graph::ValueId,
    input: crate::graph::ValueId,
    tp: TpPlan,
) -> crate::graph::ValueId {
    let o = if tp.on() {
        b.row_parallel_linear(tp, "dense", h, cfg.hidden, true)
    } else {
        b.linear("dense", h, cfg.hidden, true)
    };
    let o = b.module("dropout", |b| b.dropout(o, cfg.hidden_dropout));
    let s = b.add(o, input);
    let y = b.layer_norm("LayerNorm", s);
    b.hold_through(o);
    y
}
