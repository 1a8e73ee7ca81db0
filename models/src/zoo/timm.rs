//! timm's image models as timm 0.6.x (2022, the code of timm's RTX 3090 benchmark CSVs; read at
//! `huggingface/pytorch-image-models` commit c865028c, version 0.6.6) builds them with
//! `timm.create_model(name)`, trained on `(batch, 3, H, W)` images with `nn.CrossEntropyLoss`.
//! Zoo names are `timm/<timm's name>`.
//!
//! * **Vision Transformers** (`timm/models/vision_transformer.py`, `VisionTransformer`; DeiT's
//!   non-distilled models in `deit.py` are the same class): `PatchEmbed` (`proj` conv p×p/p,
//!   `flatten(2).transpose(1, 2)`), `torch.cat((cls_token.expand(B, -1, -1), x), 1)`,
//!   `+ pos_embed`, `pos_drop` (p = 0: identity), blocks, `norm`, `x[:, 0]` (`global_pool='token'`),
//!   `head`. `Block.forward`: `x = x + drop_path1(ls1(attn(norm1(x))))`,
//!   `x = x + drop_path2(ls2(mlp(norm2(x))))` with `init_values=None` (`ls1`/`ls2` are
//!   `nn.Identity`, no layer scale) and `drop_path_rate=0` (identity). `Attention.forward` is explicit
//!   (timm 0.6 has no SDPA path): `qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)`,
//!   `unbind(0)`, `attn = (q @ k.transpose(-2, -1)) * scale`, `attn.softmax(-1)`, `attn_drop` (p = 0),
//!   `(attn @ v).transpose(1, 2).reshape(B, N, C)`, `proj`. `Mlp`: `fc1`, exact `nn.GELU`, `fc2`
//!   (dropouts p = 0). LayerNorm eps 1e-6, `qkv_bias=True`. Another image size is
//!   `create_model(name, img_size=...)`: the same model with `pos_embed` for the new grid.
//! * **ConvNeXt** (`timm/models/convnext.py`; `conv_mlp=False` for tiny/small/base/large, `True` for
//!   nano, whose blocks use `LayerNorm2d` and `ConvMlp`'s 1×1 convolutions instead):
//!   stem `Conv2d(3, d0, 4, 4)` + `LayerNorm2d` (`F.layer_norm(x.permute(0, 2, 3, 1)).permute(0, 3,
//!   1, 2)`); stages with a downsample (`LayerNorm2d`, `Conv2d(k=2, s=2)`) from the second on;
//!   `ConvNeXtBlock.forward`: `shortcut = x`, `conv_dw` (7×7 depthwise, `groups=dim`, bias),
//!   `permute(0, 2, 3, 1)`, `nn.LayerNorm` (channels-last), `Mlp` of `nn.Linear`s with exact GELU,
//!   `permute(0, 3, 1, 2)`, `x.mul(gamma.reshape(1, -1, 1, 1))` (layer scale 1e-6: a parameter, an
//!   out-of-place `mul`), `drop_path` (rate 0: identity), `+ shortcut`; head `global_pool`
//!   (`SelectAdaptivePool2d('avg')`: `adaptive_avg_pool2d` to 1×1), `LayerNorm2d`, `flatten(1)`,
//!   `drop` (p = 0), `fc`. After the stem's `LayerNorm2d` every feature map is a channels-last
//!   permutation of a contiguous NHWC tensor, so cuDNN runs the convolutions channels-last and the
//!   block's `permute`s cost nothing (see the `Conv2d` rule of the lowering).
//! * **ResNet** (`timm/models/resnet.py`, `ResNet` with `BasicBlock`/`Bottleneck`, the plain
//!   `resnet18/26/34/50/101/152`: 7×7 stem, no deep stem, no `avg_down`): `conv1`, `bn1`, `act1`
//!   (`nn.ReLU(inplace=True)`), `maxpool`; blocks `conv1, bn1, act1, conv2, bn2, drop_block (None),
//!   act2, aa (None), conv3, bn3, se (None), drop_path (None), x += shortcut, act3`;
//!   `global_pool` (`SelectAdaptivePool2d('avg', flatten=True)`: `adaptive_avg_pool2d` + `flatten`),
//!   `fc`. `zero_init_last` only initialises the last BN to zero: no memory effect.

use super::resnet::{classifier_loss, features, ActNames, Block};
use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind, T};

/// A timm 0.6 `VisionTransformer` (no layer scale, class token, `global_pool='token'`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VitConfig {
    /// Zoo name (`timm/...`).
    pub name: &'static str,
    /// timm's registered function (`vit_base_patch16_224`, ...) and its file.
    pub function: &'static str,
    /// Default image side (`img_size`).
    pub image: u64,
    /// Patch side.
    pub patch: u64,
    /// Blocks (`depth`).
    pub depth: u64,
    /// Heads.
    pub heads: u64,
    /// `embed_dim`.
    pub dim: u64,
}

/// A timm 0.6 `ConvNeXt` with `conv_mlp=False`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvNextConfig {
    /// Zoo name (`timm/...`).
    pub name: &'static str,
    /// timm's registered function.
    pub function: &'static str,
    /// Blocks per stage.
    pub depths: [u64; 4],
    /// Channels per stage.
    pub dims: [u64; 4],
    /// `conv_mlp`: the block's norm is `LayerNorm2d` and its MLP `ConvMlp` (1×1 convolutions on
    /// the NCHW map) instead of a channels-last `nn.LayerNorm` and `Mlp` of `nn.Linear`s.
    pub conv_mlp: bool,
}

/// A timm 0.6 plain `ResNet` (7×7 stem).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResNetConfig {
    /// Zoo name (`timm/...`).
    pub name: &'static str,
    /// timm's registered function.
    pub function: &'static str,
    /// Block type.
    pub block: Block,
    /// Blocks per stage.
    pub layers: [u64; 4],
}

/// One stage of a timm 0.6 EfficientNet (`decode_arch_def`'s block strings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EffStage {
    /// `ds` (`DepthwiseSeparableConv`) when false, `ir` (`InvertedResidual`) when true.
    pub inverted: bool,
    /// Blocks (`r`).
    pub repeats: u64,
    /// Depthwise kernel (`k`).
    pub kernel: u64,
    /// Stride of the first block (`s`).
    pub stride: u64,
    /// Expansion (`e`).
    pub expand: u64,
    /// Output channels (`c`).
    pub out: u64,
}

/// A timm 0.6 `EfficientNet` (`_gen_efficientnet`, channel and depth multipliers 1.0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EfficientNetConfig {
    /// Zoo name (`timm/...`).
    pub name: &'static str,
    /// timm's registered function.
    pub function: &'static str,
    /// `stem_size`.
    pub stem: u64,
    /// The stages of `arch_def` (all with `se0.25`).
    pub stages: &'static [EffStage],
    /// `num_features` of `conv_head`.
    pub features: u64,
}

/// A timm model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TimmConfig {
    /// `VisionTransformer`.
    Vit(VitConfig),
    /// `ConvNeXt`.
    ConvNext(ConvNextConfig),
    /// `ResNet`.
    ResNet(ResNetConfig),
    /// `EfficientNet`.
    EfficientNet(EfficientNetConfig),
}

const fn eff(
    inverted: bool,
    repeats: u64,
    kernel: u64,
    stride: u64,
    expand: u64,
    out: u64,
) -> EffStage {
    EffStage {
        inverted,
        repeats,
        kernel,
        stride,
        expand,
        out,
    }
}

const fn vit(
    name: &'static str,
    function: &'static str,
    image: u64,
    patch: u64,
    depth: u64,
    heads: u64,
    dim: u64,
) -> TimmConfig {
    TimmConfig::Vit(VitConfig {
        name,
        function,
        image,
        patch,
        depth,
        heads,
        dim,
    })
}

const fn convnext(
    name: &'static str,
    function: &'static str,
    depths: [u64; 4],
    dims: [u64; 4],
    conv_mlp: bool,
) -> TimmConfig {
    TimmConfig::ConvNext(ConvNextConfig {
        name,
        function,
        depths,
        dims,
        conv_mlp,
    })
}

const fn resnet(
    name: &'static str,
    function: &'static str,
    block: Block,
    layers: [u64; 4],
) -> TimmConfig {
    TimmConfig::ResNet(ResNetConfig {
        name,
        function,
        block,
        layers,
    })
}

/// Every timm model of the zoo, with its timm 0.6 definition (`file: function`).
pub const MODELS: [TimmConfig; 21] = [
    resnet(
        "timm/resnet18",
        "resnet.py: resnet18 (BasicBlock, [2, 2, 2, 2])",
        Block::Basic,
        [2, 2, 2, 2],
    ),
    resnet(
        "timm/resnet26",
        "resnet.py: resnet26 (Bottleneck, [2, 2, 2, 2])",
        Block::Bottleneck,
        [2, 2, 2, 2],
    ),
    resnet(
        "timm/resnet34",
        "resnet.py: resnet34 (BasicBlock, [3, 4, 6, 3])",
        Block::Basic,
        [3, 4, 6, 3],
    ),
    resnet(
        "timm/resnet50",
        "resnet.py: resnet50 (Bottleneck, [3, 4, 6, 3])",
        Block::Bottleneck,
        [3, 4, 6, 3],
    ),
    resnet(
        "timm/resnet101",
        "resnet.py: resnet101 (Bottleneck, [3, 4, 23, 3])",
        Block::Bottleneck,
        [3, 4, 23, 3],
    ),
    resnet(
        "timm/resnet152",
        "resnet.py: resnet152 (Bottleneck, [3, 8, 36, 3])",
        Block::Bottleneck,
        [3, 8, 36, 3],
    ),
    vit(
        "timm/vit_tiny_patch16_224",
        "vision_transformer.py: vit_tiny_patch16_224 (patch 16, dim 192, depth 12, 3 heads)",
        224,
        16,
        12,
        3,
        192,
    ),
    vit(
        "timm/vit_small_patch16_224",
        "vision_transformer.py: vit_small_patch16_224 (patch 16, dim 384, depth 12, 6 heads)",
        224,
        16,
        12,
        6,
        384,
    ),
    vit(
        "timm/vit_base_patch32_224",
        "vision_transformer.py: vit_base_patch32_224 (patch 32, dim 768, depth 12, 12 heads)",
        224,
        32,
        12,
        12,
        768,
    ),
    vit(
        "timm/vit_base_patch16_224",
        "vision_transformer.py: vit_base_patch16_224 (patch 16, dim 768, depth 12, 12 heads)",
        224,
        16,
        12,
        12,
        768,
    ),
    vit(
        "timm/vit_base_patch16_384",
        "vision_transformer.py: vit_base_patch16_384 (patch 16, dim 768, depth 12, 12 heads, 384×384)",
        384,
        16,
        12,
        12,
        768,
    ),
    vit(
        "timm/vit_large_patch16_224",
        "vision_transformer.py: vit_large_patch16_224 (patch 16, dim 1024, depth 24, 16 heads)",
        224,
        16,
        24,
        16,
        1024,
    ),
    vit(
        "timm/deit_tiny_patch16_224",
        "deit.py: deit_tiny_patch16_224 (VisionTransformer: patch 16, dim 192, depth 12, 3 heads)",
        224,
        16,
        12,
        3,
        192,
    ),
    vit(
        "timm/deit_small_patch16_224",
        "deit.py: deit_small_patch16_224 (VisionTransformer: patch 16, dim 384, depth 12, 6 heads)",
        224,
        16,
        12,
        6,
        384,
    ),
    vit(
        "timm/deit_base_patch16_224",
        "deit.py: deit_base_patch16_224 (VisionTransformer: patch 16, dim 768, depth 12, 12 heads)",
        224,
        16,
        12,
        12,
        768,
    ),
    TimmConfig::EfficientNet(EfficientNetConfig {
        name: "timm/efficientnet_b0",
        function: "efficientnet.py: efficientnet_b0 (_gen_efficientnet: ds_r1_k3_s1_e1_c16_se0.25, ir_r2_k3_s2_e6_c24_se0.25, ir_r2_k5_s2_e6_c40_se0.25, ir_r3_k3_s2_e6_c80_se0.25, ir_r3_k5_s1_e6_c112_se0.25, ir_r4_k5_s2_e6_c192_se0.25, ir_r1_k3_s1_e6_c320_se0.25, SiLU)",
        stem: 32,
        stages: &[
            eff(false, 1, 3, 1, 1, 16),
            eff(true, 2, 3, 2, 6, 24),
            eff(true, 2, 5, 2, 6, 40),
            eff(true, 3, 3, 2, 6, 80),
            eff(true, 3, 5, 1, 6, 112),
            eff(true, 4, 5, 2, 6, 192),
            eff(true, 1, 3, 1, 6, 320),
        ],
        features: 1280,
    }),
    convnext(
        "timm/convnext_nano",
        "convnext.py: convnext_nano (depths [2, 2, 8, 2], dims [80, 160, 320, 640], conv_mlp=True)",
        [2, 2, 8, 2],
        [80, 160, 320, 640],
        true,
    ),
    convnext(
        "timm/convnext_tiny",
        "convnext.py: convnext_tiny (depths [3, 3, 9, 3], dims [96, 192, 384, 768])",
        [3, 3, 9, 3],
        [96, 192, 384, 768],
        false,
    ),
    convnext(
        "timm/convnext_small",
        "convnext.py: convnext_small (depths [3, 3, 27, 3], dims [96, 192, 384, 768])",
        [3, 3, 27, 3],
        [96, 192, 384, 768],
        false,
    ),
    convnext(
        "timm/convnext_base",
        "convnext.py: convnext_base (depths [3, 3, 27, 3], dims [128, 256, 512, 1024])",
        [3, 3, 27, 3],
        [128, 256, 512, 1024],
        false,
    ),
    convnext(
        "timm/convnext_large",
        "convnext.py: convnext_large (depths [3, 3, 27, 3], dims [192, 384, 768, 1536])",
        [3, 3, 27, 3],
        [192, 384, 768, 1536],
        false,
    ),
];

impl TimmConfig {
    /// The timm model called `name` (`timm/...`).
    pub fn from_name(name: &str) -> Option<TimmConfig> {
        MODELS.iter().find(|m| m.name() == name).cloned()
    }

    /// Zoo name.
    pub fn name(&self) -> &'static str {
        match self {
            TimmConfig::Vit(c) => c.name,
            TimmConfig::ConvNext(c) => c.name,
            TimmConfig::ResNet(c) => c.name,
            TimmConfig::EfficientNet(c) => c.name,
        }
    }

    /// timm's definition (`file: function (arguments)`).
    pub fn function(&self) -> &'static str {
        match self {
            TimmConfig::Vit(c) => c.function,
            TimmConfig::ConvNext(c) => c.function,
            TimmConfig::ResNet(c) => c.function,
            TimmConfig::EfficientNet(c) => c.function,
        }
    }

    /// The default input size (timm's `default_cfg['input_size']`): 384×384 for the `_384` ViTs,
    /// else 224×224.
    pub fn default_image(&self) -> (u64, u64) {
        match self {
            TimmConfig::Vit(c) => (c.image, c.image),
            _ => (224, 224),
        }
    }

    /// Checks that the image size works with the model (a ViT's patch grid must tile it; the CNNs
    /// need 32 pixels for their five stride-2 stages) and returns an explanation otherwise.
    pub fn check_image(&self, (h, w): (u64, u64)) -> Result<(), String> {
        match self {
            TimmConfig::Vit(c) => {
                if h < c.patch || w < c.patch {
                    return Err(format!(
                        "{h}x{w} is smaller than the {p}x{p} patch (PatchEmbed)",
                        p = c.patch
                    ));
                }
            }
            _ => {
                if h < 32 || w < 32 {
                    return Err(format!(
                        "{h}x{w} is smaller than 32x32, the network's total stride"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The shapes of the largest tensors a step at `batch` makes (for the size check before
    /// building).
    pub fn largest_tensors(&self, b: u64, (h, w): (u64, u64), classes: u64) -> Vec<Vec<u64>> {
        match self {
            TimmConfig::Vit(c) => {
                let n = (h / c.patch.max(1)) * (w / c.patch.max(1)) + 1;
                vec![
                    vec![b, c.heads, n, n],
                    vec![b, n, 4 * c.dim],
                    vec![b, n, 3 * c.dim],
                    vec![b, classes],
                    vec![classes, c.dim],
                ]
            }
            TimmConfig::ConvNext(c) => vec![
                vec![b, 4 * c.dims[0], h / 4, w / 4],
                vec![b, c.dims[0], h / 4, w / 4],
                vec![b, classes],
                vec![classes, c.dims[3]],
            ],
            TimmConfig::ResNet(c) => vec![
                vec![b, 64 * c.block.expansion(), h / 4, w / 4],
                vec![b, 64, h / 2, w / 2],
                vec![b, classes],
                vec![classes, 512 * c.block.expansion()],
            ],
            TimmConfig::EfficientNet(c) => vec![
                vec![b, 6 * c.stages[0].out, h / 2, w / 2],
                vec![b, c.stem, h / 2, w / 2],
                vec![b, classes],
                vec![classes, c.features],
            ],
        }
    }

    /// Builds the model for `batch` images of `image` (height, width) and `classes` classes, with
    /// `nn.CrossEntropyLoss`.
    pub fn build(&self, batch: u64, image: (u64, u64), classes: u64) -> Result<Graph, GraphError> {
        let mut b = GraphBuilder::new(self.name(), batch, 0);
        b.meta(
            "reference",
            format!(
                "timm 0.6 {} (huggingface/pytorch-image-models timm/models/{}), 3x{}x{} images, {classes}-class nn.CrossEntropyLoss",
                self.name().trim_start_matches("timm/"),
                self.function(),
                image.0,
                image.1
            )
            .into(),
        );
        let images = b.input("images", &[batch, 3, image.0, image.1], DTypeSpec::Model);
        let labels = b.input("labels", &[batch], DTypeSpec::Fixed(DType::I64));
        let logits = match self {
            TimmConfig::Vit(c) => vit_forward(&mut b, c, images, image, classes),
            TimmConfig::ConvNext(c) => convnext_forward(&mut b, c, images, classes),
            TimmConfig::ResNet(c) => resnet_forward(&mut b, c, images, classes),
            TimmConfig::EfficientNet(c) => efficientnet_forward(&mut b, c, images, classes),
        };
        classifier_loss(&mut b, logits, labels);
        b.finish()
    }
}

// ------------------------------------------------------------------------------------ ViT

/// `VisionTransformer.forward` (`forward_features` then `forward_head`).
fn vit_forward(
    b: &mut GraphBuilder,
    c: &VitConfig,
    images: T,
    (h, w): (u64, u64),
    classes: u64,
) -> T {
    let batch = b.shape(images)[0];
    let (gh, gw) = (h / c.patch, w / c.patch);
    let n = gh * gw + 1;
    // model.parameters(): the module's own cls_token and pos_embed first, then its children's.
    let cls_token = b.param("cls_token", &[1, 1, c.dim]);
    let pos_embed = b.param("pos_embed", &[1, n, c.dim]);
    // PatchEmbed: proj, x.flatten(2).transpose(1, 2), norm (Identity).
    let x = b.module("patch_embed", |b| {
        let x = b.conv2d("proj", images, c.dim, c.patch, c.patch, 0, true);
        let x = b.flatten(x, 2);
        b.transpose(x, 1, 2)
    });
    // _pos_embed: torch.cat((cls_token.expand(B, -1, -1), x), dim=1) + pos_embed; pos_drop p=0.
    // forward_features' local `x` keeps the patch embedding alive until _pos_embed returns.
    b.push_module("");
    b.hold(x);
    let cls = b.expand(cls_token, &[batch, 1, c.dim]);
    let x = b.cat(&[cls, x], 1);
    let mut x = b.add(x, pos_embed);
    b.pop_module("");
    b.push_module("blocks");
    for l in 0..c.depth {
        let input = x;
        x = b.region(RegionKind::Block, &l.to_string(), |b| {
            // nn.Sequential keeps the block's input until the block returns.
            b.hold(input);
            vit_block(b, c, input)
        });
    }
    b.pop_module("blocks");
    let x = b.layer_norm("norm", x);
    // forward_head: global_pool 'token' (x[:, 0]), fc_norm Identity, head.
    let x = b.select(x, 1, 0);
    b.linear("head", x, classes, true)
}

/// timm 0.6 `Block.forward` (no layer scale, no drop path).
fn vit_block(b: &mut GraphBuilder, c: &VitConfig, x: T) -> T {
    let y = b.layer_norm("norm1", x);
    let a = b.module("attn", |b| vit_attention(b, c, y));
    let x = b.add(x, a);
    let y = b.layer_norm("norm2", x);
    let y = b.module("mlp", |b| {
        let y = b.linear("fc1", y, 4 * c.dim, true);
        let y = b.module("act", |b| b.gelu(y, false));
        b.linear("fc2", y, c.dim, true)
    });
    b.add(x, y)
}

/// timm 0.6 `Attention.forward`: explicit attention.
fn vit_attention(b: &mut GraphBuilder, c: &VitConfig, x: T) -> T {
    let s = b.shape(x);
    let (bs, n, dim) = (s[0] as i64, s[1] as i64, s[2] as i64);
    let (h, d) = (c.heads as i64, (c.dim / c.heads) as i64);
    // The argument lives until the method returns.
    b.hold(x);
    let qkv = b.linear("qkv", x, 3 * c.dim, true);
    let qkv = b.reshape(qkv, &[bs, n, 3, h, d]);
    let qkv = b.permute(qkv, &[2, 0, 3, 1, 4]);
    b.hold(qkv);
    // q, k, v = qkv.unbind(0): three views; UnbindBackward stacks the three gradients into one
    // [3, B, H, N, D] tensor, which is what split's CatBackward allocates too.
    let parts = b.split(qkv, &[1, 1, 1], 0);
    let s4 = [bs, h, n, d];
    let q = b.view(parts[0], &s4);
    let k = b.view(parts[1], &s4);
    let v = b.view(parts[2], &s4);
    let o = b.region(RegionKind::AttentionCore, "", |b| {
        let kt = b.transpose(k, -2, -1);
        let attn = b.matmul(q, kt);
        let attn = b.mul_scalar(attn);
        // attn.softmax(dim=-1): float32 under autocast (fp32_set_opt_dtype).
        let attn = b.softmax(attn, -1, false);
        b.hold(attn);
        // attn_drop: p = 0, identity.
        b.matmul(attn, v)
    });
    let o = b.transpose(o, 1, 2);
    let o = b.reshape(o, &[bs, n, dim]);
    // proj_drop: p = 0.
    b.linear("proj", o, c.dim, true)
}

// ------------------------------------------------------------------------------------ ConvNeXt

/// timm's `LayerNorm2d`: `F.layer_norm(x.permute(0, 2, 3, 1), ...).permute(0, 3, 1, 2)`.
fn layer_norm_2d(b: &mut GraphBuilder, name: &str, x: T) -> T {
    b.module(name, |b| {
        let c = b.shape(x)[1];
        let w = b.param("weight", &[c]);
        let bias = b.param("bias", &[c]);
        let y = b.permute(x, &[0, 2, 3, 1]);
        let y = b.layer_norm_op(y, w, bias);
        b.permute(y, &[0, 3, 1, 2])
    })
}

/// `ConvNeXt.forward`.
fn convnext_forward(b: &mut GraphBuilder, c: &ConvNextConfig, images: T, classes: u64) -> T {
    let x = b.module("stem", |b| {
        let x = b.conv2d("0", images, c.dims[0], 4, 4, 0, true);
        layer_norm_2d(b, "1", x)
    });
    let mut x = x;
    b.push_module("stages");
    for (i, (&depth, &dim)) in c.depths.iter().zip(&c.dims).enumerate() {
        b.push_module(&i.to_string());
        if i > 0 {
            // downsample: LayerNorm2d, Conv2d(k=2, s=2).
            x = b.module("downsample", |b| {
                let y = layer_norm_2d(b, "0", x);
                b.conv2d("1", y, dim, 2, 2, 0, true)
            });
        }
        b.push_module("blocks");
        for j in 0..depth {
            let input = x;
            x = b.region(RegionKind::Block, &j.to_string(), |b| {
                b.hold(input);
                convnext_block(b, dim, c.conv_mlp, input)
            });
        }
        b.pop_module("blocks");
        b.pop_module(&i.to_string());
    }
    b.pop_module("stages");
    // norm_pre: Identity (head_norm_first=False). forward() keeps the features (its `x`) alive
    // until forward_head returns.
    b.module("head", |b| {
        b.hold(x);
        // F.adaptive_avg_pool2d to 1x1: `mean((-1, -2), keepdim)`, plus an in-place
        // `as_strided_` on a channels-last input (ConvNeXt's features on CUDA), whose backward
        // allocates zeros of the output.
        let x = b.module("global_pool", |b| b.adaptive_avg_pool2d(x, [1, 1]));
        let x = layer_norm_2d(b, "norm", x);
        let x = b.flatten(x, 1);
        // drop: p = 0.
        b.linear("fc", x, classes, true)
    })
}

/// `ConvNeXtBlock.forward`.
fn convnext_block(b: &mut GraphBuilder, dim: u64, conv_mlp: bool, shortcut: T) -> T {
    // The block's own gamma comes first in model.parameters().
    let gamma = b.param("gamma", &[dim]);
    // conv_dw: create_conv2d(..., depthwise=True), groups = dim, bias.
    let x = b.conv2d_grouped("conv_dw", shortcut, dim, 7, 1, 3, dim, true);
    let x = if conv_mlp {
        // LayerNorm2d, then ConvMlp: fc1 (1x1 conv), norm (Identity), act, drop (p = 0), fc2.
        let x = layer_norm_2d(b, "norm", x);
        b.module("mlp", |b| {
            let y = b.conv2d("fc1", x, 4 * dim, 1, 1, 0, true);
            let y = b.module("act", |b| b.gelu(y, false));
            b.conv2d("fc2", y, dim, 1, 1, 0, true)
        })
    } else {
        let x = b.permute(x, &[0, 2, 3, 1]);
        let x = b.layer_norm("norm", x);
        let x = b.module("mlp", |b| {
            let y = b.linear("fc1", x, 4 * dim, true);
            let y = b.module("act", |b| b.gelu(y, false));
            b.linear("fc2", y, dim, true)
        });
        b.permute(x, &[0, 3, 1, 2])
    };
    let g = b.reshape(gamma, &[1, -1, 1, 1]);
    let x = b.mul(x, g);
    // drop_path: rate 0, Identity.
    b.add(x, shortcut)
}

// ------------------------------------------------------------------------------------ ResNet

/// `ResNet.forward` (timm's module names).
fn resnet_forward(b: &mut GraphBuilder, c: &ResNetConfig, images: T, classes: u64) -> T {
    let x = features(b, c.block, c.layers, images, ActNames::Numbered);
    // forward() keeps the features (its `x`) alive until forward_head returns.
    b.push_module("");
    b.hold(x);
    // global_pool: SelectAdaptivePool2d('avg', flatten=True) = AdaptiveAvgPool2d(1) + Flatten(1).
    let x = b.module("global_pool", |b| {
        let x = b.module("pool", |b| b.adaptive_avg_pool2d(x, [1, 1]));
        b.module("flatten", |b| b.flatten(x, 1))
    });
    // drop_rate 0: no dropout.
    let logits = b.linear("fc", x, classes, true);
    b.pop_module("");
    logits
}

// ------------------------------------------------------------------------------------ EfficientNet

/// timm's `BatchNormAct2d.forward`: `self.num_batches_tracked = self.num_batches_tracked + 1`
/// (out of place, unlike `nn.BatchNorm2d`'s `add_`: a new int64 scalar, the old one freed when
/// the attribute is rebound; modelled as a new scalar freed at once, the same sizes in the same
/// order), `F.batch_norm`, then with `act` `nn.SiLU(inplace=True)`. In-place `silu_` saves a
/// clone of its input (autograd's rule for an in-place op whose formula reads `self`) and writes
/// the result into the input's storage: the same bytes, at the same times, as the out-of-place
/// `silu` modelled here.
fn bn_act(b: &mut GraphBuilder, name: &str, x: T, act: bool) -> T {
    let c = b.shape(x)[1];
    let y = b.module(name, |b| {
        let w = b.param("weight", &[c]);
        let bias = b.param("bias", &[c]);
        let rm = b.buffer("running_mean", &[c], DTypeSpec::Model);
        let rv = b.buffer("running_var", &[c], DTypeSpec::Model);
        let n = b.buffer("num_batches_tracked", &[], DTypeSpec::Fixed(DType::I64));
        let _bumped = b.factory("aten.add", &[n], &[], DTypeSpec::Fixed(DType::I64), vec![]);
        b.batch_norm_op(x, w, bias, rm, rv)
    });
    if act {
        b.module(name, |b| b.module("act", |b| b.silu(y)))
    } else {
        y
    }
}

/// A bias-free `create_conv2d` with timm's symmetric padding `((s - 1) + (k - 1)) // 2`.
fn eff_conv(b: &mut GraphBuilder, name: &str, x: T, out: u64, k: u64, s: u64, groups: u64) -> T {
    let pad = ((s - 1) + (k - 1)) / 2;
    b.conv2d_grouped(name, x, out, k, s, pad, groups, false)
}

/// `SqueezeExcite.forward`: `x * gate(conv_expand(act1(conv_reduce(x.mean((2, 3), keepdim)))))`.
fn squeeze_excite(b: &mut GraphBuilder, x: T, rd: u64) -> T {
    b.module("se", |b| {
        let c = b.shape(x)[1];
        let s = b.mean_dims(x, &[2, 3], true);
        let s = b.conv2d("conv_reduce", s, rd, 1, 1, 0, true);
        let s = b.module("act1", |b| b.silu(s));
        let s = b.conv2d("conv_expand", s, c, 1, 1, 0, true);
        // The local x_se holds conv_expand's output until the method returns.
        b.hold(s);
        let g = b.module("gate", |b| b.sigmoid(s));
        b.mul(x, g)
    })
}

/// `EfficientNet.forward` (drop_rate and drop_path_rate 0).
fn efficientnet_forward(
    b: &mut GraphBuilder,
    c: &EfficientNetConfig,
    images: T,
    classes: u64,
) -> T {
    let x = eff_conv(b, "conv_stem", images, c.stem, 3, 2, 1);
    let mut x = bn_act(b, "bn1", x, true);
    let mut cin = c.stem;
    b.push_module("blocks");
    for (i, st) in c.stages.iter().enumerate() {
        b.push_module(&i.to_string());
        for j in 0..st.repeats {
            let s = if j == 0 { st.stride } else { 1 };
            let input = x;
            // SqueezeExcite channels: round(in_chs * 0.25) (se_ratio / exp_ratio of mid_chs).
            let rd = (cin as f64 * 0.25).round() as u64;
            let skip = s == 1 && cin == st.out;
            x = b.region(RegionKind::Block, &j.to_string(), |b| {
                b.hold(input);
                let y = if st.inverted {
                    // InvertedResidual: conv_pw, bn1, conv_dw, bn2, se, conv_pwl, bn3 (no act).
                    let mid = cin * st.expand;
                    let y = eff_conv(b, "conv_pw", input, mid, 1, 1, 1);
                    let y = bn_act(b, "bn1", y, true);
                    let y = eff_conv(b, "conv_dw", y, mid, st.kernel, s, mid);
                    let y = bn_act(b, "bn2", y, true);
                    let y = squeeze_excite(b, y, rd);
                    let y = eff_conv(b, "conv_pwl", y, st.out, 1, 1, 1);
                    bn_act(b, "bn3", y, false)
                } else {
                    // DepthwiseSeparableConv: conv_dw, bn1, se, conv_pw, bn2 (no act).
                    let y = eff_conv(b, "conv_dw", input, cin, st.kernel, s, cin);
                    let y = bn_act(b, "bn1", y, true);
                    let y = squeeze_excite(b, y, rd);
                    let y = eff_conv(b, "conv_pw", y, st.out, 1, 1, 1);
                    bn_act(b, "bn2", y, false)
                };
                // x = drop_path(x) + shortcut (drop_path Identity).
                if skip {
                    b.add(y, input)
                } else {
                    y
                }
            });
            cin = st.out;
        }
        b.pop_module(&i.to_string());
    }
    b.pop_module("blocks");
    let x = eff_conv(b, "conv_head", x, c.features, 1, 1, 1);
    let x = bn_act(b, "bn2", x, true);
    // forward() keeps the features alive until forward_head returns.
    b.push_module("");
    b.hold(x);
    let x = b.module("global_pool", |b| {
        let x = b.module("pool", |b| b.adaptive_avg_pool2d(x, [1, 1]));
        b.module("flatten", |b| b.flatten(x, 1))
    });
    let logits = b.linear("classifier", x, classes, true);
    b.pop_module("");
    logits
}
