//! ViT-B/16 as torchvision 0.29 defines it (`torchvision/models/vision_transformer.py`,
//! `vit_b_16()`: patch 16, 12 layers, 12 heads, hidden 768, MLP 3072, dropout 0, LayerNorm eps
//! 1e-6), trained on `(batch, 3, 224, 224)` images with a 1000-class `F.cross_entropy`.
//!
//! The forward as eager PyTorch runs it: `conv_proj` (16×16/16 with bias), `reshape` to
//! `(n, 768, 196)` and `permute(0, 2, 1)` (a view), `torch.cat` with the expanded `class_token`,
//! `+ pos_embedding`, twelve `EncoderBlock`s, the final `ln`, `x[:, 0]` and `heads.head`.
//!
//! `nn.MultiheadAttention(batch_first=True)` in training takes `F.multi_head_attention_forward`
//! (its fast path is inference-only): the input is transposed to `(L, N, E)`, so `in_proj` is
//! `at::linear` on a non-contiguous 3-D tensor (`matmul` — which folds it with a copy — then
//! `add_(bias)`), `_in_projection_packed` makes a contiguous `(3, L, N, E)` copy and selects q, k
//! and v from it (each `select` backward allocates zeros of that size), and with
//! `need_weights=False` the core is `F.scaled_dot_product_attention` on the backend PyTorch picks
//! for the GPU (`crate::sdpa`: memory-efficient for float32, FlashAttention-2 or cuDNN for 16-bit),
//! or the recipe's `sdpa-*` choice. The output is
//! `permute(2, 0, 1, 3).reshape(L·N, E)` (a copy), `out_proj` (`addmm`) and a transpose back, so
//! the residual `x + input` and both LayerNorm inputs of the next block are non-contiguous, and
//! `layer_norm` copies them (`expect_contiguous`).

use super::resnet::{classifier_loss, image_inputs};
use crate::graph::{Graph, GraphBuilder, GraphError, RegionKind, T};
use crate::ops::SdpaBackend;

/// A ViT configuration (`VisionTransformer` arguments).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VitConfig {
    /// Zoo name.
    pub name: &'static str,
    /// Image side.
    pub image: u64,
    /// Patch side.
    pub patch: u64,
    /// Encoder layers.
    pub layers: u64,
    /// Attention heads.
    pub heads: u64,
    /// Hidden size.
    pub hidden: u64,
    /// MLP size.
    pub mlp: u64,
    /// Classes.
    pub classes: u64,
}

/// `torchvision.models.vit_b_16()`: 86,567,656 parameters.
pub const VIT_B_16: VitConfig = VitConfig {
    name: "vit-b-16",
    image: 224,
    patch: 16,
    layers: 12,
    heads: 12,
    hidden: 768,
    mlp: 3072,
    classes: 1000,
};

/// Builds `torchvision.models.vit_b_16()` for `batch` images with the cross-entropy loss; the
/// attention core runs on `backend`.
pub fn vit(cfg: &VitConfig, batch: u64, backend: SdpaBackend) -> Result<Graph, GraphError> {
    let mut b = GraphBuilder::new(cfg.name, batch, 0);
    b.meta(
        "reference",
        format!(
            "torchvision 0.29 {}(image_size={s}, num_classes={}) (torchvision/models/vision_transformer.py), 3x{s}x{s} images, F.cross_entropy",
            cfg.name.replace('-', "_"),
            cfg.classes,
            s = cfg.image
        )
        .into(),
    );
    let (images, labels) = image_inputs(&mut b, batch, cfg.image);
    let (n, e) = (batch, cfg.hidden);
    let grid = cfg.image / cfg.patch;
    let seq = grid * grid + 1;
    // model.parameters(): the module's own class_token first, then its children's.
    let class_token = b.param("class_token", &[1, 1, e]);
    // _process_input: conv_proj, reshape(n, hidden, n_h * n_w), permute(0, 2, 1).
    let x = b.conv2d("conv_proj", images, e, cfg.patch, cfg.patch, 0, true);
    let x = b.reshape(x, &[n as i64, e as i64, (grid * grid) as i64]);
    let x = b.permute(x, &[0, 2, 1]);
    let cls = b.expand(class_token, &[n, 1, e]);
    let x = b.cat(&[cls, x], 1);
    let x = b.module("encoder", |b| {
        // VisionTransformer.forward: `x = torch.cat(...)`, then `x = self.encoder(x)`: the caller's
        // `x` (and Encoder.forward's argument until its `input = input + self.pos_embedding`)
        // keeps the cat output alive until the encoder returns.
        b.hold(x);
        let pos = b.param("pos_embedding", &[1, seq, e]);
        let mut x = b.add(x, pos);
        b.push_module("layers");
        for l in 0..cfg.layers {
            let input = x;
            x = b.region(RegionKind::Block, &format!("encoder_layer_{l}"), |b| {
                b.hold(input);
                encoder_block(b, cfg, input, backend)
            });
        }
        b.pop_module("layers");
        b.layer_norm("ln", x)
    });
    let x = b.select(x, 1, 0);
    let logits = b.module("heads", |b| b.linear("head", x, cfg.classes, true));
    // `x = x[:, 0]; x = self.heads(x)`: the class-token view (and with it the encoder's output
    // storage) is rebound only when the head returns (under autocast `head` saves its 16-bit
    // copy, not the view).
    b.hold_until_last_op(x);
    classifier_loss(&mut b, logits, labels);
    b.finish()
}

/// `EncoderBlock.forward`: `x = ln_1(input)`, self-attention, `x = x + input`,
/// `y = mlp(ln_2(x))`, `x + y` (the dropouts have p = 0: identity).
fn encoder_block(b: &mut GraphBuilder, cfg: &VitConfig, input: T, backend: SdpaBackend) -> T {
    let x = b.layer_norm("ln_1", input);
    let a = b.module("self_attention", |b| mha(b, cfg, x, backend));
    let x = b.add(a, input);
    let y0 = b.layer_norm("ln_2", x);
    let y = b.module("mlp", |b| {
        let y = b.linear("0", y0, cfg.mlp, true);
        let y = b.module("1", |b| b.gelu(y, false));
        b.linear("3", y, cfg.hidden, true)
    });
    // `y = self.mlp(y)`: the name `y` is rebound only when the MLP returns, so the ln_2 output
    // lives through the whole MLP (under autocast `mlp.0` saves its 16-bit copy, not this).
    b.hold_until_last_op(y0);
    b.add(x, y)
}

/// `nn.MultiheadAttention(E, H, batch_first=True)(x, x, x, need_weights=False)` in training.
fn mha(b: &mut GraphBuilder, cfg: &VitConfig, x: T, backend: SdpaBackend) -> T {
    let e = b.shape(x)[2];
    let w = b.param("in_proj_weight", &[3 * e, e]);
    let bias = b.param("in_proj_bias", &[3 * e]);
    // query = key = value = x.transpose(1, 0): the arguments live until the function returns.
    let q0 = b.transpose(x, 1, 0);
    b.hold(q0);
    let o = multi_head_attention_forward(b, q0, cfg.heads, w, bias, 0.0, backend, |b, o| {
        b.linear("out_proj", o, e, true)
    });
    b.transpose(o, 1, 0)
}

/// `F.multi_head_attention_forward(q0, q0, q0, E, heads, in_proj_weight, in_proj_bias, None,
/// None, False, dropout, out_proj.weight, out_proj.bias, training=True, need_weights=False)`
/// (torch/nn/functional.py) on one `(L, N, E)` tensor used as query, key and value (self-attention,
/// no masks, packed in-projection): the output is `(L, N, E)`. `out_proj` applies the output
/// projection to the `(L·N, E)` attention output (`F.linear(attn_output, out_proj_weight,
/// out_proj_bias)`); the zoo's ViT builds its parameters there, an imported graph passes its own.
/// Shared by the zoo's ViT and `vramsim.from_module` ([`crate::imported`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn multi_head_attention_forward(
    b: &mut GraphBuilder,
    q0: T,
    heads: u64,
    w: T,
    bias: T,
    dropout: f64,
    backend: SdpaBackend,
    out_proj: impl FnOnce(&mut GraphBuilder, T) -> T,
) -> T {
    let s = b.shape(q0);
    let (l, n, e) = (s[0], s[1], s[2]);
    let (h, hd) = (heads, e / heads.max(1));
    let (ni, li, ei, hi, hdi) = (n as i64, l as i64, e as i64, h as i64, hd as i64);
    // _in_projection_packed: linear, then unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2)
    // .squeeze(-2).contiguous(), and proj[0], proj[1], proj[2].
    let proj = b.linear_strided(q0, w, Some(bias));
    let p = b.view(proj, &[li, ni, 3, ei]);
    let p = b.unsqueeze(p, 0);
    let p = b.transpose(p, 0, -2);
    let p = b.view(p, &[3, li, ni, ei]);
    let p = b.contiguous(p);
    let heads = |b: &mut GraphBuilder, i: u64| {
        let t = b.select(p, 0, i);
        let t = b.view(t, &[li, ni * hi, hdi]);
        let t = b.transpose(t, 0, 1);
        b.view(t, &[ni, hi, li, hdi])
    };
    let q = heads(b, 0);
    let k = heads(b, 1);
    let v = heads(b, 2);
    // `dropout_p = 0.0 if not training else dropout_p`, `is_causal=False`, no mask.
    let o = b.region(RegionKind::AttentionCore, "", |b| {
        b.sdpa_with(q, k, v, backend, false, dropout)
    });
    let o = b.permute(o, &[2, 0, 1, 3]);
    let o = b.reshape(o, &[li * ni, ei]);
    let o = out_proj(b, o);
    b.view(o, &[li, ni, ei])
}
