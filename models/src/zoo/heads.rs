//! The heads and losses of the HF families (`--head`, `--loss`), as transformers 5.23 writes them
//! (`modeling_gpt2.py`, `modeling_bert.py`, `modeling_layers.py` `GenericFor*`, `loss/loss_utils.py`).
//!
//! | head | GPT-2 | LLaMA | BERT |
//! | --- | --- | --- | --- |
//! | `lm` | `GPT2LMHeadModel` (default) | `LlamaForCausalLM` (default) | — |
//! | `masked-lm` | — | — | `BertForMaskedLM` (default) |
//! | `seq-cls:N` | `GPT2ForSequenceClassification` | `LlamaForSequenceClassification` | `BertForSequenceClassification` |
//! | `token-cls:N` | `GPT2ForTokenClassification` | `LlamaForTokenClassification` | `BertForTokenClassification` |
//! | `none` | `GPT2Model` | `LlamaModel` | `BertModel` |
//!
//! Losses: `ForCausalLMLoss` (`logits.float()`, labels padded and shifted) for `lm` under
//! `--loss hf`; `F.cross_entropy(logits.view(-1, V), targets.view(-1))` on the logits as they are
//! under `--loss plain`. The classification heads of GPT-2 and BERT call `CrossEntropyLoss` (or
//! `MSELoss` for one label: `problem_type = "regression"`) on the logits as they are; LLaMA's
//! `GenericForSequenceClassification` calls `ForSequenceClassificationLoss` (the same, no upcast)
//! and `GenericForTokenClassification` calls `ForTokenClassification`, which upcasts
//! `logits.float()` first (`--loss plain` drops that copy). The base models have no loss: the
//! training loop takes `last_hidden_state.mean()` (one documented choice; any scalar reduction
//! of the hidden state allocates the same). Every case is checked against a meta-device capture
//! (`tests/captures/heads/`).

use crate::dtype::DType;
use crate::graph::{DTypeSpec, GraphBuilder, T};
use crate::recipe::{Head, Loss};

/// The labels input a head trains from (`None` for the base model, which has none): `[B, S]`
/// int64 tokens (`lm`, `masked-lm`, `token-cls`), `[B]` int64 classes (`seq-cls:N`, N ≥ 2) or
/// `[B]` float32 targets (`seq-cls:1`, regression: a data loader's float32 column).
pub fn labels_input(b: &mut GraphBuilder, head: Head, batch: u64, seq: u64) -> Option<T> {
    let i64t = DTypeSpec::Fixed(DType::I64);
    match head {
        Head::Lm | Head::MaskedLm | Head::TokenCls(_) => {
            Some(b.input("labels", &[batch, seq], i64t))
        }
        Head::SeqCls(1) => Some(b.input("labels", &[batch], DTypeSpec::Fixed(DType::F32))),
        Head::SeqCls(_) => Some(b.input("labels", &[batch], i64t)),
        Head::None => None,
    }
}

/// `F.cross_entropy(logits.view(-1, C), labels.view(-1))` in module `name` (`""`: the training
/// loop; `CrossEntropyLoss`: a head's `loss_fct`), on the logits as they are.
pub fn plain_cross_entropy(b: &mut GraphBuilder, name: &str, logits: T, labels: T) -> T {
    let c = *b.shape(logits).last().unwrap_or(&0);
    b.module(name, |b| {
        let flat = b.view(logits, &[-1, c as i64]);
        let tgt = b.view(labels, &[-1]);
        b.cross_entropy(flat, tgt)
    })
}

/// The causal-LM loss of `lm` under `loss`: HF's `ForCausalLMLoss` or the plain cross-entropy.
pub fn causal_lm_loss(b: &mut GraphBuilder, logits: T, labels: T, loss: Loss) -> T {
    match loss {
        Loss::Hf => b.causal_lm_loss(logits, labels),
        Loss::Plain => plain_cross_entropy(b, "", logits, labels),
    }
}

/// The loss of a sequence-classification head on `pooled` `[B, N]` (`ForSequenceClassificationLoss`
/// and the GPT-2/BERT copies of it): `MSELoss()(pooled.squeeze(), labels.squeeze())` for one label
/// (`problem_type = "regression"`), `CrossEntropyLoss()(pooled.view(-1, N), labels.view(-1))`
/// for int64 labels. `modules`: the names of the MSE and cross-entropy scopes (`MSELoss` and
/// `CrossEntropyLoss` where the head instantiates them; `""` for `ForSequenceClassificationLoss`).
pub fn sequence_classification_loss(
    b: &mut GraphBuilder,
    pooled: T,
    labels: T,
    n: u64,
    modules: (&str, &str),
) -> T {
    if n == 1 {
        b.module(modules.0, |b| {
            let s = b.shape(pooled);
            // squeeze(): [B, 1] → [B] (a scalar for B = 1), a view.
            let squeezed: Vec<i64> = s.iter().filter(|&&d| d != 1).map(|&d| d as i64).collect();
            let p = b.view(pooled, &squeezed);
            let l = b.view(labels, &squeezed);
            b.mse_loss(p, l)
        })
    } else {
        plain_cross_entropy(b, modules.1, pooled, labels)
    }
}

/// The last-non-padding-token pooling of GPT-2's and LLaMA's sequence classifiers, with
/// `config.pad_token_id` set (without one, HF raises for batches larger than 1):
///
/// ```text
/// non_pad_mask = (input_ids != pad_token_id).to(logits.device, torch.int32)
/// token_indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
/// last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)
/// pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_non_pad_token]
/// ```
///
/// `non_pad_mask`, `token_indices` and `last_non_pad_token` are locals of `forward` (held to its
/// end); the boolean comparison and the product are temporaries; `IndexBackward0` saves both
/// index tensors.
pub fn last_token_pool(b: &mut GraphBuilder, logits: T, ids: T) -> T {
    let s = b.shape(ids);
    let (bsz, seq) = (s[0], s[1]);
    let ne = b.factory(
        "aten.ne",
        &[ids],
        &[bsz, seq],
        DTypeSpec::Fixed(DType::Bool),
        vec![],
    );
    let non_pad = b.factory(
        "aten._to_copy",
        &[ne],
        &[bsz, seq],
        DTypeSpec::Fixed(DType::I32),
        vec![],
    );
    b.hold(non_pad);
    let token_indices = b.factory(
        "aten.arange",
        &[],
        &[seq],
        DTypeSpec::Fixed(DType::I32),
        vec![],
    );
    b.hold(token_indices);
    let prod = b.factory(
        "aten.mul",
        &[token_indices, non_pad],
        &[bsz, seq],
        DTypeSpec::Fixed(DType::I32),
        vec![],
    );
    let last = b.factory(
        "aten.argmax",
        &[prod],
        &[bsz],
        DTypeSpec::Fixed(DType::I64),
        vec![],
    );
    b.hold(last);
    let rows = b.factory(
        "aten.arange",
        &[],
        &[bsz],
        DTypeSpec::Fixed(DType::I64),
        vec![],
    );
    b.index2(logits, rows, last)
}

/// `self.dropout(hidden)` then the classifier `nn.Linear(H, N, bias)` named `name` on every token
/// (`*ForTokenClassification`).
pub fn token_classifier(
    b: &mut GraphBuilder,
    hidden: T,
    dropout: f64,
    name: &str,
    n: u64,
    bias: bool,
) -> T {
    let x = b.module("dropout", |b| b.dropout(hidden, dropout));
    b.hold(x);
    b.linear(name, x, n, bias)
}

/// `ForTokenClassification` (`loss_utils.py`, LLaMA's generic head): `logits.view(-1, N)`,
/// `labels.view(-1)`, `logits.float()`, `cross_entropy`; the float copy is a local of the loss
/// function. `--loss plain` takes the cross-entropy on the logits as they are.
pub fn for_token_classification_loss(b: &mut GraphBuilder, logits: T, labels: T, loss: Loss) -> T {
    if loss == Loss::Plain {
        return plain_cross_entropy(b, "", logits, labels);
    }
    let n = *b.shape(logits).last().unwrap_or(&0);
    b.module("", |b| {
        let flat = b.view(logits, &[-1, n as i64]);
        let tgt = b.view(labels, &[-1]);
        let lf = b.to_dtype(flat, DType::F32);
        b.hold(lf);
        b.cross_entropy(lf, tgt)
    })
}

/// The base model's loss in the training loop: `loss = outputs.last_hidden_state.mean()`.
pub fn hidden_state_loss(b: &mut GraphBuilder, hidden: T) -> T {
    let dims: Vec<isize> = (0..b.shape(hidden).len() as isize).collect();
    b.module("", |b| b.mean_dims(hidden, &dims, false))
}

/// The decoder-only families whose heads [`decoder_head`] builds: where their heads differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoder {
    /// GPT-2 (`modeling_gpt2.py`): `GPT2ForSequenceClassification` instantiates `MSELoss` /
    /// `CrossEntropyLoss`; `GPT2ForTokenClassification` names its linear `classifier` and calls
    /// `CrossEntropyLoss` on the logits as they are.
    Gpt2,
    /// LLaMA (`modeling_layers.py` `GenericFor*`): `ForSequenceClassificationLoss` (no module
    /// scope); `GenericForTokenClassification` names its linear `score` and calls
    /// `ForTokenClassification` (see [`for_token_classification_loss`]).
    Llama,
}

/// The head of GPT-2 or LLaMA on the final hidden state `hidden` `[B, S, H]`, with its loss (the
/// scalar the training loop calls `backward` on). `ids`: the `input_ids` input (the sequence
/// classifier pools at the last non-padding token); `labels`: from [`labels_input`] (`None`: the
/// base model); `tied`: the embedding weight `lm_head` shares (`tie_word_embeddings`), `None`
/// for an untied `lm_head` of `[vocab, H]`.
///
/// In every head `hidden` (`transformer_outputs[0]` / `outputs.last_hidden_state`) and the
/// logits are locals of the head's `forward` until it returns, through its loss: under autocast
/// the head's linear saves its 16-bit copy, so only those references keep them alive.
#[allow(clippy::too_many_arguments)]
pub fn decoder_head(
    b: &mut GraphBuilder,
    family: Decoder,
    head: Head,
    hidden: T,
    ids: T,
    labels: Option<T>,
    tied: Option<T>,
    vocab: u64,
    loss: Loss,
) -> T {
    match (head, labels) {
        (Head::SeqCls(n), Some(labels)) => {
            b.hold(hidden);
            let logits = b.linear("score", hidden, n, false);
            b.hold(logits);
            let pooled = last_token_pool(b, logits, ids);
            b.hold(pooled);
            let modules = match family {
                Decoder::Gpt2 => ("MSELoss", "CrossEntropyLoss"),
                Decoder::Llama => ("", ""),
            };
            let loss = sequence_classification_loss(b, pooled, labels, n, modules);
            b.keep_output(pooled);
            loss
        }
        (Head::TokenCls(n), Some(labels)) => {
            b.hold(hidden);
            // GPT-2: `classifier = nn.Linear(H, N)`; LLaMA: `score = nn.Linear(H, N,
            // bias=config.token_classification_bias)` (default True).
            let (name, dropout) = match family {
                Decoder::Gpt2 => ("classifier", super::gpt2::CLASSIFIER_DROPOUT),
                Decoder::Llama => ("score", super::llama::CLASSIFIER_DROPOUT),
            };
            let logits = token_classifier(b, hidden, dropout, name, n, true);
            b.hold(logits);
            let loss = match family {
                Decoder::Gpt2 => plain_cross_entropy(b, "CrossEntropyLoss", logits, labels),
                Decoder::Llama => for_token_classification_loss(b, logits, labels, loss),
            };
            b.keep_output(logits);
            loss
        }
        (Head::None, _) | (_, None) => {
            // `out = model(...)`, then `loss = out.last_hidden_state.mean()`.
            b.keep_output(hidden);
            hidden_state_loss(b, hidden)
        }
        (_, Some(labels)) => {
            b.hold(hidden);
            // lm_head: nn.Linear(H, V, bias=False), tied to the token embedding unless the
            // config unties it.
            let h = *b.shape(hidden).last().unwrap_or(&0);
            let logits = b.module("lm_head", |b| {
                let w = match tied {
                    Some(w) => w,
                    None => b.param("weight", &[vocab, h]),
                };
                b.linear_op(hidden, w, None)
            });
            b.hold(logits);
            let loss = causal_lm_loss(b, logits, labels, loss);
            b.keep_output(logits);
            loss
        }
    }
}

/// The heads a family builds, for error messages.
pub fn valid_heads(family: Family) -> &'static str {
    match family {
        Family::Gpt2 | Family::Llama => "lm, seq-cls:N, token-cls:N, none",
        Family::Bert => "masked-lm, seq-cls:N, token-cls:N, none",
        Family::NanoGpt => "lm (nanoGPT's GPT has no other head)",
    }
}

/// An HF family with heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// GPT-2.
    Gpt2,
    /// LLaMA (and Mistral, Qwen2).
    Llama,
    /// BERT.
    Bert,
    /// karpathy/nanoGPT's `GPT` (its only head: `lm_head`).
    NanoGpt,
}

impl Family {
    /// The family's own head (what its zoo entries build without `--head`).
    pub fn default_head(self) -> Head {
        match self {
            Family::Gpt2 | Family::Llama | Family::NanoGpt => Head::Lm,
            Family::Bert => Head::MaskedLm,
        }
    }

    /// Whether the family builds `head`.
    pub fn accepts(self, head: Head) -> bool {
        if self == Family::NanoGpt {
            return head == Head::Lm;
        }
        !matches!(
            (self, head),
            (Family::Gpt2 | Family::Llama, Head::MaskedLm) | (Family::Bert, Head::Lm)
        )
    }
}
