//! nanoGPT's `GPT` as karpathy/nanoGPT's `model.py` writes it (commit `f08abb45`, 2023-06-14; the
//! file is unchanged since, and differs from the 2023-05-17 version erees measured only by a merge
//! of the same `nn.GELU` change) trained by its `train.py` loop:
//!
//! - `GPTConfig(block_size=1024, vocab_size=50304, n_layer, n_head, n_embd, dropout=0.0,
//!   bias=True)`; `nn.Linear` projections (not HF's `Conv1D`), `LayerNorm(ndim, bias)` calling
//!   `F.layer_norm(x, w.shape, w, b_or_None, 1e-5)`, exact `nn.GELU()`, `lm_head` an
//!   `nn.Linear(n_embd, vocab, bias=False)` whose weight is `transformer.wte.weight`.
//! - `CausalSelfAttention`: `flash = hasattr(F, 'scaled_dot_product_attention')` (PyTorch ≥ 2.0)
//!   calls `F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout if training
//!   else 0, is_causal=True)`; otherwise (`--attention eager`) it registers the float32 buffer
//!   `bias = torch.tril(torch.ones(T, T)).view(1, 1, T, T)` per layer (moved to the GPU by
//!   `model.to(device)`) and runs `att = (q @ k.transpose(-2, -1)) * (1 / sqrt(hs))`,
//!   `att.masked_fill(self.bias[:, :, :T, :T] == 0, -inf)`, `F.softmax(att, -1)`,
//!   `attn_dropout`, `att @ v`.
//! - `forward(idx, targets)`: `pos = arange(t)` (`[t]` int64), `drop(wte(idx) + wpe(pos))`, the
//!   blocks, `ln_f`, `logits = lm_head(x)` on every position and
//!   `F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1)`: the loss is the
//!   model's own, on the logits as they are (`--loss` does not apply), and `train.py` keeps
//!   `logits, loss = model(X, Y)` (`--keep-outputs`).

use super::nn::{Activation, AttnImpl};
use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind, T};

/// A nanoGPT `GPTConfig`.
#[derive(Clone, Debug, PartialEq)]
pub struct NanoGptConfig {
    /// Zoo name.
    pub name: &'static str,
    /// `n_embd`.
    pub hidden: u64,
    /// `n_layer`.
    pub layers: u64,
    /// `n_head`.
    pub heads: u64,
    /// `vocab_size` (50304: GPT-2's 50257 padded to a multiple of 64).
    pub vocab: u64,
    /// `block_size`: the learned positions and the side of the causal-mask buffer.
    pub block_size: u64,
    /// `dropout` (embeddings, attention probabilities, residuals; 0.0 by default).
    pub dropout: f64,
    /// `bias`: biases in every `nn.Linear` but `lm_head` and in every `LayerNorm` (`GPTConfig`'s
    /// default True; `train.py`'s default False).
    pub bias: bool,
}

impl NanoGptConfig {
    const fn new(name: &'static str, layers: u64, heads: u64, hidden: u64, bias: bool) -> Self {
        NanoGptConfig {
            name,
            hidden,
            layers,
            heads,
            vocab: 50304,
            block_size: 1024,
            dropout: 0.0,
            bias,
        }
    }

    /// The zoo entry `name`: `nanogpt`, `nanogpt-medium`, `nanogpt-large`, `nanogpt-xl`
    /// (`GPTConfig`'s `bias=True`), each also with `-nobias` (`bias=False`).
    pub fn from_name(name: &str) -> Option<NanoGptConfig> {
        let (base, bias) = match name.strip_suffix("-nobias") {
            Some(b) => (b, false),
            None => (name, true),
        };
        // model.py `from_pretrained`'s config_args: 12/12/768, 24/16/1024, 36/20/1280, 48/25/1600.
        let (layers, heads, hidden) = match base {
            "nanogpt" => (12, 12, 768),
            "nanogpt-medium" => (24, 16, 1024),
            "nanogpt-large" => (36, 20, 1280),
            "nanogpt-xl" => (48, 25, 1600),
            _ => return None,
        };
        let full = super::NAMES.iter().find(|n| **n == name)?;
        Some(NanoGptConfig::new(full, layers, heads, hidden, bias))
    }

    /// `sum(p.numel() for p in model.parameters())` (the tied head counted once):
    /// `L·(12d² + [bias] 13d + 4d) + d·(V + T) + d + [bias] d`.
    pub fn param_count(&self) -> u64 {
        let (d, l) = (self.hidden, self.layers);
        let lin_bias = if self.bias { 3 * d + d + 4 * d + d } else { 0 };
        let ln = if self.bias { 4 * d } else { 2 * d };
        let per_layer = 12 * d * d + lin_bias + ln;
        let ln_f = if self.bias { 2 * d } else { d };
        l * per_layer + d * (self.vocab + self.block_size) + ln_f
    }
}

impl GraphBuilder {
    /// nanoGPT's `LayerNorm(ndim, bias)` named `name`.
    fn nanogpt_layer_norm(&mut self, name: &str, x: T, bias: bool) -> T {
        let h = *self.shape(x).last().unwrap_or(&0);
        self.module(name, |b| {
            let w = b.param("weight", &[h]);
            let bb = bias.then(|| b.param("bias", &[h]));
            b.layer_norm_op_opt(x, w, bb)
        })
    }
}

/// Builds nanoGPT's `GPT(cfg)` training on `idx`, `targets` `[batch, seq]` with its attention on
/// `attn` (`Eager`: the manual path with the `bias` buffers; `Sdpa`: `flash`).
pub fn nanogpt(
    cfg: &NanoGptConfig,
    batch: u64,
    seq: u64,
    attn: AttnImpl,
) -> Result<Graph, GraphError> {
    let (h, nh, bias) = (cfg.hidden, cfg.heads, cfg.bias);
    let hd = h / nh.max(1);
    let mut b = GraphBuilder::new(cfg.name, batch, seq);
    b.meta(
        "reference",
        "karpathy/nanoGPT model.py GPT (f08abb45), train.py loop".into(),
    );
    let i64t = DTypeSpec::Fixed(DType::I64);
    let idx = b.input("idx", &[batch, seq], i64t);
    let targets = b.input("targets", &[batch, seq], i64t);
    // GPT.forward's locals (pos, tok_emb, pos_emb, logits) live until it returns; the
    // `transformer` ModuleDict is never called itself, so they are held at the top level.
    let wte = b.module("transformer.wte", |b| b.param("weight", &[cfg.vocab, h]));
    let wpe = b.module("transformer.wpe", |b| {
        b.param("weight", &[cfg.block_size, h])
    });
    // pos = torch.arange(0, t, dtype=torch.long): [t] (saved by wpe).
    let pos = b.factory("aten.arange", &[], &[seq], i64t, vec![]);
    b.hold(pos);
    let tok = b.module("transformer.wte", |b| b.embedding_op(wte, idx));
    b.hold(tok);
    let pe = b.module("transformer.wpe", |b| b.embedding_op(wpe, pos));
    b.hold(pe);
    let x = b.add(tok, pe);
    let mut x = b.module("transformer.drop", |b| b.dropout(x, cfg.dropout));
    for l in 0..cfg.layers {
        x = b.region(RegionKind::Block, &format!("transformer.h.{l}"), |b| {
            let y = b.nanogpt_layer_norm("ln_1", x, bias);
            let a = b.module("attn", |b| {
                let lin = |b: &mut GraphBuilder, name: &str, out: u64, inp: u64| {
                    b.module(name, |b| {
                        let w = b.param("weight", &[out, inp]);
                        let bb = bias.then(|| b.param("bias", &[out]));
                        (w, bb)
                    })
                };
                // Registration order, which `model.to(device)` follows (`Module._apply`: the
                // children's parameters, then the module's own buffers): c_attn, c_proj, then
                // the `bias` buffer of the manual path.
                let (wa, ba) = lin(b, "c_attn", 3 * h, h);
                let (wp, bp) = lin(b, "c_proj", h, h);
                // A float32 buffer that `model.to(dtype)` converts like the parameters.
                let mask_buf = match attn {
                    AttnImpl::Eager => Some(b.buffer(
                        "bias",
                        &[1, 1, cfg.block_size, cfg.block_size],
                        DTypeSpec::Model,
                    )),
                    AttnImpl::Sdpa(_) => None,
                };
                // forward(self, x): its argument lives until forward returns (under autocast the
                // projections save 16-bit copies, not it).
                b.hold(y);
                let qkv = b.module("c_attn", |b| b.linear_op(y, wa, ba));
                let parts = b.split(qkv, &[h, h, h], 2);
                let shp = [batch as i64, seq as i64, nh as i64, hd as i64];
                let k = b.view(parts[1], &shp);
                let k = b.transpose(k, 1, 2);
                let q = b.view(parts[0], &shp);
                let q = b.transpose(q, 1, 2);
                let v = b.view(parts[2], &shp);
                let v = b.transpose(v, 1, 2);
                // q, k, v are locals to the end of forward (views of c_attn's output).
                b.hold(q);
                b.hold(k);
                b.hold(v);
                let y = b.region(RegionKind::AttentionCore, "", |b| match attn {
                    AttnImpl::Sdpa(backend) => b.sdpa_with(q, k, v, backend, seq > 1, cfg.dropout),
                    AttnImpl::Eager => {
                        let kt = b.transpose(k, -2, -1);
                        let att = b.matmul(q, kt);
                        let att = b.mul_scalar(att);
                        // self.bias[:, :, :T, :T] == 0: a bool [1, 1, T, T] temporary.
                        let att = match mask_buf {
                            Some(buf) => {
                                let s2 = b.slice(buf, 2, 0, seq);
                                let s3 = b.slice(s2, 3, 0, seq);
                                let m = b.factory(
                                    "aten.eq",
                                    &[s3],
                                    &[1, 1, seq, seq],
                                    DTypeSpec::Fixed(DType::Bool),
                                    vec![],
                                );
                                b.masked_fill(att, m)
                            }
                            None => att,
                        };
                        let att = b.softmax(att, -1, false);
                        let att = b.module("attn_dropout", |b| b.dropout(att, cfg.dropout));
                        // `att` is a local to the end of forward.
                        b.hold(att);
                        b.matmul(att, v)
                    }
                });
                let y = b.transpose(y, 1, 2);
                let y = b.contiguous(y);
                let y = b.view(y, &[batch as i64, seq as i64, h as i64]);
                let y = b.module("c_proj", |b| b.linear_op(y, wp, bp));
                b.module("resid_dropout", |b| b.dropout(y, cfg.dropout))
            });
            let x = b.add(x, a);
            let y = b.nanogpt_layer_norm("ln_2", x, bias);
            let f = b.module("mlp", |b| {
                b.hold(y);
                let y = b.linear("c_fc", y, 4 * h, bias);
                let y = b.activation("gelu", y, Activation::Gelu);
                let y = b.linear("c_proj", y, h, bias);
                b.module("dropout", |b| b.dropout(y, cfg.dropout))
            });
            b.add(x, f)
        });
    }
    let x = b.nanogpt_layer_norm("transformer.ln_f", x, bias);
    // `x = self.transformer.ln_f(x)`: a local to the end of forward, through the loss.
    b.hold(x);
    // lm_head: nn.Linear(n_embd, vocab, bias=False) whose weight is transformer.wte.weight.
    let logits = b.module("lm_head", |b| b.linear_op(x, wte, None));
    b.hold(logits);
    let v = cfg.vocab as i64;
    let loss = {
        let flat = b.view(logits, &[-1, v]);
        let tgt = b.view(targets, &[-1]);
        b.cross_entropy(flat, tgt)
    };
    // `logits, loss = model(X, Y)` in train.py.
    b.keep_output(logits);
    b.keep_output(loss);
    b.set_output(loss);
    b.finish()
}
