//! `torch.nn` and HF modules as builder helpers: each writes the ATen ops the module's eager
//! forward runs, in order, with the Python locals it keeps alive.

use crate::dtype::DType;
use crate::graph::{DTypeSpec, GraphBuilder, RegionKind, T};
use crate::ops::SdpaBackend;

/// An activation function, by HF's `ACT2FN` name (`hidden_act`, GPT-2's `activation_function`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu` (`nn.SiLU`): one op, saves its input.
    Silu,
    /// `gelu` (`GELUActivation`: exact `F.gelu`): one op, saves its input.
    Gelu,
    /// `gelu_pytorch_tanh` (`F.gelu(approximate="tanh")`): one op, saves its input.
    GeluTanh,
    /// `gelu_new` (`NewGELUActivation`): eight eager ops, five tensors saved.
    GeluNew,
    /// `relu` (`nn.ReLU()`, not in place): one op, saves its result.
    Relu,
}

impl Activation {
    /// The HF names accepted, comma-separated.
    pub const NAMES: &'static str = "silu, gelu, gelu_pytorch_tanh, gelu_new, relu";

    /// The activation HF calls `name`, if modelled.
    pub fn from_hf(name: &str) -> Option<Activation> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu" => Some(Activation::Gelu),
            "gelu_pytorch_tanh" => Some(Activation::GeluTanh),
            "gelu_new" => Some(Activation::GeluNew),
            "relu" => Some(Activation::Relu),
            _ => None,
        }
    }
}

/// How a decoder's attention core runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnImpl {
    /// HF `eager_attention_forward`.
    Eager,
    /// `F.scaled_dot_product_attention` (no mask, HF's `is_causal`, `dropout_p` in training) on
    /// this backend ([`crate::sdpa`] says which one PyTorch picks).
    Sdpa(SdpaBackend),
}

impl GraphBuilder {
    /// `nn.Linear(in, out, bias)` named `name` applied to `x` (parameters `name.weight`
    /// `[out, in]` and `name.bias`).
    pub fn linear(&mut self, name: &str, x: T, out: u64, bias: bool) -> T {
        let k = *self.shape(x).last().unwrap_or(&0);
        self.module(name, |b| {
            let w = b.param("weight", &[out, k]);
            let bb = if bias {
                Some(b.param("bias", &[out]))
            } else {
                None
            };
            b.linear_op(x, w, bb)
        })
    }

    /// HF `Conv1D(nf, nx)` (GPT-2): weight `[nx, nf]`, `addmm(bias, x.view(-1, nx), weight)` then a
    /// view back.
    pub fn conv1d(&mut self, name: &str, x: T, nf: u64) -> T {
        let s = self.shape(x);
        let nx = *s.last().unwrap_or(&0);
        self.module(name, |b| {
            let w = b.param("weight", &[nx, nf]);
            let bias = b.param("bias", &[nf]);
            let flat = b.view(x, &[-1, nx as i64]);
            let out = b.addmm(bias, flat, w);
            let mut shape: Vec<i64> = s[..s.len() - 1].iter().map(|&d| d as i64).collect();
            shape.push(nf as i64);
            b.view(out, &shape)
        })
    }

    /// `nn.Conv2d(in, out, kernel, stride, padding, bias)` named `name` (square kernel, dilation 1,
    /// groups 1) applied to `x` `[N, in, H, W]`.
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d(
        &mut self,
        name: &str,
        x: T,
        out: u64,
        kernel: u64,
        stride: u64,
        padding: u64,
        bias: bool,
    ) -> T {
        self.conv2d_grouped(name, x, out, kernel, stride, padding, 1, bias)
    }

    /// [`GraphBuilder::conv2d`] with `groups` (`nn.Conv2d(..., groups=groups)`: weight
    /// `[out, in / groups, kernel, kernel]`; timm's `create_conv2d(..., depthwise=True)` has
    /// `groups = in`).
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d_grouped(
        &mut self,
        name: &str,
        x: T,
        out: u64,
        kernel: u64,
        stride: u64,
        padding: u64,
        groups: u64,
        bias: bool,
    ) -> T {
        let cin = self.shape(x).get(1).copied().unwrap_or(0);
        self.module(name, |b| {
            let w = b.param("weight", &[out, cin / groups, kernel, kernel]);
            let bb = if bias {
                Some(b.param("bias", &[out]))
            } else {
                None
            };
            b.conv2d_op(x, w, bb, [stride; 2], [padding; 2], [1, 1], groups)
        })
    }

    /// `nn.BatchNorm2d(C)` named `name` in training mode: parameters `weight`, `bias`, buffers
    /// `running_mean`, `running_var` (model dtype) and `num_batches_tracked` (int64 scalar, bumped
    /// in place each forward).
    pub fn batch_norm2d(&mut self, name: &str, x: T) -> T {
        let c = self.shape(x).get(1).copied().unwrap_or(0);
        self.module(name, |b| {
            let w = b.param("weight", &[c]);
            let bias = b.param("bias", &[c]);
            let rm = b.buffer("running_mean", &[c], DTypeSpec::Model);
            let rv = b.buffer("running_var", &[c], DTypeSpec::Model);
            let _n = b.buffer("num_batches_tracked", &[], DTypeSpec::Fixed(DType::I64));
            b.batch_norm_op(x, w, bias, rm, rv)
        })
    }

    /// Keeps `v` alive through the last op appended so far: a Python variable that is rebound only
    /// when its statement ends (`h = self.LayerNorm(h + x)` frees the old `h` after the LayerNorm).
    pub fn hold_through(&mut self, v: T) {
        self.hold_until_last_op(v);
    }

    /// `key_states, value_states = past_key_values.update(key_states, value_states, layer_idx)`
    /// of a `DynamicCache` (transformers 5.23 `cache_utils.py`, `DynamicLayer.update`): the first
    /// update of a layer stores `torch.cat([self.keys, key_states], dim=-2)` with `self.keys` the
    /// empty `torch.tensor([])` of `lazy_initialization`, so the cache holds a new copy of `k`
    /// and of `v`, and attention receives those copies. The caller's `k`, `v` stay alive until
    /// both copies exist (the tuple assignment rebinds them after `update` returns).
    /// `lazy_initialization` makes both empties in `key_states.dtype`, and `cat` promotes over every
    /// input: under autocast, where RoPE's float32 `cos`/`sin` make LLaMA's keys float32 while the
    /// values stay bfloat16, the value cache is a float32 copy (a 0-byte empty `to` the keys' dtype
    /// joins the values' `cat`).
    pub fn kv_cache_update(&mut self, k: T, v: T) -> (T, T) {
        let kc = self.cat(&[k], -2);
        let empty = self.factory("aten.tensor", &[], &[0], DTypeSpec::Model, vec![]);
        let empty = self.to_dtype_of(empty, k);
        let shape = self.shape(v);
        let dim = shape.len().saturating_sub(2);
        let d = self.result_dtype(&[empty, v]);
        let vc = self.op1(crate::ops::OpKind::Cat { dim }, &[empty, v], shape, d);
        self.hold_until_last_op(k);
        self.hold_until_last_op(v);
        (kc, vc)
    }

    /// The model output's `past_key_values` (`DynamicCache`) holds `cache` (the copies of
    /// [`GraphBuilder::kv_cache_update`]) as long as the output: until the loss is read from it
    /// (the op appended last), or with `--keep-outputs` until the loop rebinds the output.
    pub fn hold_cache(&mut self, cache: &[T]) {
        for &v in cache {
            self.hold_until_last_op(v);
            self.keep_output(v);
        }
    }

    /// `nn.LayerNorm(h)` named `name`.
    pub fn layer_norm(&mut self, name: &str, x: T) -> T {
        let h = *self.shape(x).last().unwrap_or(&0);
        self.module(name, |b| {
            let w = b.param("weight", &[h]);
            let bias = b.param("bias", &[h]);
            b.layer_norm_op(x, w, bias)
        })
    }

    /// HF `LlamaRMSNorm`: `x.to(float32)`, `pow(2).mean(-1, keepdim)`, `rsqrt(var + eps)`,
    /// `x * rsqrt`, `weight * h.to(input_dtype)`.
    pub fn rms_norm(&mut self, name: &str, x: T) -> T {
        let h = *self.shape(x).last().unwrap_or(&0);
        self.module(name, |b| {
            let w = b.param("weight", &[h]);
            let x32 = b.to_dtype(x, DType::F32);
            let p = b.pow(x32, 2.0);
            let var = b.mean_dim(p, -1, true);
            b.hold(var);
            let a = b.add_scalar(var);
            let r = b.rsqrt(a);
            let hs = b.mul(x32, r);
            // `hidden_states` (the float32 product) is a local until forward returns, after
            // `self.weight * hidden_states.to(input_dtype)`.
            b.hold(hs);
            let hs = b.to_dtype_of(hs, x);
            b.mul(w, hs)
        })
    }

    /// `nn.Embedding(n, h)` named `name` looking up `ids`.
    pub fn embedding(&mut self, name: &str, ids: T, n: u64, h: u64) -> T {
        self.module(name, |b| {
            let w = b.param("weight", &[n, h]);
            b.embedding_op(w, ids)
        })
    }

    /// The activation module `name` applied to `x`.
    pub fn activation(&mut self, name: &str, x: T, act: Activation) -> T {
        match act {
            Activation::Silu => self.module(name, |b| b.silu(x)),
            Activation::Gelu => self.module(name, |b| b.gelu(x, false)),
            Activation::GeluTanh => self.module(name, |b| b.gelu(x, true)),
            Activation::GeluNew => self.gelu_new(name, x),
            Activation::Relu => self.module(name, |b| b.relu(x)),
        }
    }

    /// HF `NewGELUActivation` (`gelu_new`, GPT-2): `0.5 * x * (1 + tanh(√(2/π) (x + 0.044715 x³)))`
    /// in eager, one ATen op per operator: 8 ops, 5 tensors saved.
    pub fn gelu_new(&mut self, name: &str, x: T) -> T {
        self.module(name, |b| {
            let half = b.mul_scalar(x);
            let cube = b.pow(x, 3.0);
            let c = b.mul_scalar(cube);
            let inner = b.add(x, c);
            let s = b.mul_scalar(inner);
            let t = b.tanh(s);
            let one = b.add_scalar(t);
            b.mul(half, one)
        })
    }

    /// HF `ForCausalLMLoss` on `logits` `[B, S, V]`: `logits.float()`, labels padded by one and
    /// shifted (`labels[..., 1:].contiguous()`), `cross_entropy(logits.view(-1, V), labels.view(-1))`.
    pub fn causal_lm_loss(&mut self, logits: T, labels: T) -> T {
        self.causal_lm_loss_with(logits, labels, false, |b, flat, tgt| {
            b.cross_entropy(flat, tgt)
        })
    }

    /// [`Self::causal_lm_loss`] with `criterion` in place of `cross_entropy` on the flattened
    /// float32 logits and targets; `hold_shift_labels`: keep `shift_labels` until the loss
    /// returns (a criterion that saves only its own copy of the targets).
    pub fn causal_lm_loss_with(
        &mut self,
        logits: T,
        labels: T,
        hold_shift_labels: bool,
        criterion: impl FnOnce(&mut Self, T, T) -> T,
    ) -> T {
        let s = self.shape(logits);
        let (bsz, seq, v) = (s[0], s[1], s[2]);
        self.push_module("");
        let lf = self.to_dtype(logits, DType::F32);
        let padded = self.factory(
            "aten.constant_pad_nd",
            &[labels],
            &[bsz, seq + 1],
            DTypeSpec::Fixed(DType::I64),
            vec![],
        );
        let shifted = self.slice(padded, -1, 1, seq + 1);
        let shift_labels = self.contiguous(shifted);
        let flat = self.view(lf, &[-1, v as i64]);
        let tgt = self.view(shift_labels, &[-1]);
        let loss = criterion(self, flat, tgt);
        // `logits` (as float), the padded labels (and `shift_labels`) are locals of
        // ForCausalLMLoss until it returns
        self.hold(lf);
        self.hold(padded);
        if hold_shift_labels {
            self.hold(shift_labels);
        }
        self.pop_module("");
        loss
    }

    /// HF's 4-D additive causal mask `[B, 1, S, S]` in the model dtype (`create_causal_mask` for
    /// eager attention), built from the 2-D `attention_mask`, with its largest temporary (the
    /// boolean mask `[B, 1, S, S]`).
    pub fn causal_mask(&mut self, attention_mask: T, bsz: u64, seq: u64) -> T {
        self.factory(
            "aten.where",
            &[attention_mask],
            &[bsz, 1, seq, seq],
            DTypeSpec::Model,
            vec![(vec![bsz, 1, seq, seq], DType::Bool)],
        )
    }

    /// HF `eager_attention_forward` (GPT-2 and LLaMA flavours) or SDPA on `q` `[B, H, S, D]`,
    /// `k`/`v` `[B, Hkv, S, D]`; returns `[B, S, H, D]` (the transposed output, before the
    /// module's reshape). Marks the core as an [`RegionKind::AttentionCore`] region. The
    /// attention probabilities are held to the end of the calling module; HF returns them up to
    /// the decoder layer (`attn_output, _ = self.attn(...)`): use
    /// [`GraphBuilder::attention_core_probs`] and hold them there.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_core(
        &mut self,
        q: T,
        k: T,
        v: T,
        mask: Option<T>,
        dropout: f64,
        softmax_f32: bool,
        imp: AttnImpl,
    ) -> T {
        let (o, p) = self.attention_core_probs(q, k, v, mask, dropout, softmax_f32, imp);
        if let Some(p) = p {
            self.hold(p);
        }
        o
    }

    /// [`GraphBuilder::attention_core`], also returning the (dropped-out) attention probabilities
    /// of eager attention, which the caller keeps alive as long as HF's code does. A decoder's
    /// core: SDPA runs with `is_causal=True` (HF's `sdpa_attention_forward` without a mask).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_core_probs(
        &mut self,
        q: T,
        k: T,
        v: T,
        mask: Option<T>,
        dropout: f64,
        softmax_f32: bool,
        imp: AttnImpl,
    ) -> (T, Option<T>) {
        self.attention_core_probs_with(q, k, v, mask, dropout, softmax_f32, imp, true)
    }

    /// [`GraphBuilder::attention_core_probs`] with SDPA's `is_causal` given: `false` for an
    /// encoder (BERT's `is_causal` is `config.is_decoder`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_core_probs_with(
        &mut self,
        q: T,
        k: T,
        v: T,
        mask: Option<T>,
        dropout: f64,
        softmax_f32: bool,
        imp: AttnImpl,
        causal: bool,
    ) -> (T, Option<T>) {
        let qs = self.shape(q);
        let ks = self.shape(k);
        let (h, s) = (qs[1], qs[2]);
        let hkv = ks[1];
        self.region(RegionKind::AttentionCore, "", |b| match imp {
            AttnImpl::Sdpa(backend) => {
                // sdpa_attention_forward: is_causal = q_len > 1 and no mask and module.is_causal;
                // dropout_p = the module's attention dropout in training, 0 in eval (the
                // lowering drops dropout in inference).
                let o = b.sdpa_with(q, k, v, backend, causal && s > 1, dropout);
                (b.transpose(o, 1, 2), None)
            }
            AttnImpl::Eager => {
                let (k, v) = if hkv != h {
                    // repeat_kv: x[:, :, None].expand(...).reshape(B, H, S, D) — the reshape copies.
                    let k2 = b.repeat_heads(k, h);
                    let v2 = b.repeat_heads(v, h);
                    (k2, v2)
                } else {
                    (k, v)
                };
                let kt = b.transpose(k, -1, -2);
                let w = b.matmul(q, kt);
                let w = b.mul_scalar(w);
                let w = match mask {
                    Some(m) => b.add(w, m),
                    None => w,
                };
                let p = b.softmax(w, -1, softmax_f32);
                let p = if softmax_f32 { b.to_dtype_of(p, q) } else { p };
                let p = b.dropout(p, dropout);
                let o = b.matmul(p, v);
                (b.transpose(o, 1, 2), Some(p))
            }
        })
    }
}
