//! ResNets as torchvision 0.29 defines them (`torchvision/models/resnet.py`, ResNet v1.5: the
//! stride of a bottleneck sits in its 3×3 convolution), trained on `(batch, 3, 224, 224)` images
//! with a 1000-class `F.cross_entropy`:
//!
//! * stem: `conv1` 7×7/2 (no bias), `bn1`, `ReLU(inplace=True)`, `maxpool` 3×3/2;
//! * `layer1`..`layer4` of `BasicBlock`s (ResNet-18/34) or `Bottleneck`s (50/101/152), each block
//!   ending in `out += identity` and an in-place ReLU, with a `downsample` (1×1 conv + BN) where
//!   the shape changes;
//! * `avgpool` (`AdaptiveAvgPool2d(1)`, which ATen runs as `mean((-1, -2), keepdim=True)`),
//!   `torch.flatten(x, 1)`, `fc`.
//!
//! Every block is a checkpointable region (what the capture tool wraps in
//! `torch.utils.checkpoint` for `ckptfull`).

use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind, T};

/// The residual block of a ResNet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// `BasicBlock` (expansion 1): 3×3, BN, ReLU, 3×3, BN.
    Basic,
    /// `Bottleneck` (expansion 4): 1×1, BN, ReLU, 3×3 (stride), BN, ReLU, 1×1, BN.
    Bottleneck,
}

impl Block {
    /// Output channels per `planes` (`block.expansion`).
    pub fn expansion(self) -> u64 {
        match self {
            Block::Basic => 1,
            Block::Bottleneck => 4,
        }
    }
}

/// A ResNet configuration (`torchvision.models.resnet._resnet` arguments).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResNetConfig {
    /// Zoo name.
    pub name: &'static str,
    /// Block type.
    pub block: Block,
    /// Blocks in `layer1`..`layer4`.
    pub layers: [u64; 4],
    /// Classes of `fc`.
    pub classes: u64,
    /// Input image side (224).
    pub image: u64,
}

const fn cfg(name: &'static str, block: Block, layers: [u64; 4]) -> ResNetConfig {
    ResNetConfig {
        name,
        block,
        layers,
        classes: 1000,
        image: 224,
    }
}

/// `torchvision.models.resnet18()`: 11,689,512 parameters.
pub const RESNET18: ResNetConfig = cfg("resnet18", Block::Basic, [2, 2, 2, 2]);
/// `torchvision.models.resnet34()`: 21,797,672 parameters.
pub const RESNET34: ResNetConfig = cfg("resnet34", Block::Basic, [3, 4, 6, 3]);
/// `torchvision.models.resnet50()`: 25,557,032 parameters.
pub const RESNET50: ResNetConfig = cfg("resnet50", Block::Bottleneck, [3, 4, 6, 3]);
/// `torchvision.models.resnet101()`: 44,549,160 parameters.
pub const RESNET101: ResNetConfig = cfg("resnet101", Block::Bottleneck, [3, 4, 23, 3]);
/// `torchvision.models.resnet152()`: 60,192,808 parameters.
pub const RESNET152: ResNetConfig = cfg("resnet152", Block::Bottleneck, [3, 8, 36, 3]);

/// The image and label inputs of a torchvision classifier: `(batch, 3, side, side)` in the model
/// dtype and `(batch,)` int64.
pub(crate) fn image_inputs(b: &mut GraphBuilder, batch: u64, side: u64) -> (T, T) {
    image_inputs_hw(b, batch, (side, side))
}

/// [`image_inputs`] for `(batch, 3, height, width)` images.
pub(crate) fn image_inputs_hw(b: &mut GraphBuilder, batch: u64, (h, w): (u64, u64)) -> (T, T) {
    let x = b.input("images", &[batch, 3, h, w], DTypeSpec::Model);
    let labels = b.input("labels", &[batch], DTypeSpec::Fixed(DType::I64));
    (x, labels)
}

/// `output = model(images)` then `loss = F.cross_entropy(output, target)` (torchvision's
/// reference `train_one_epoch`): the logits live until `cross_entropy` returns; with
/// `--keep-outputs` the loop's `output` and `loss` are rebound when each statement returns.
pub(crate) fn classifier_loss(b: &mut GraphBuilder, logits: T, labels: T) {
    b.keep_output(logits);
    b.push_module("");
    b.hold(logits);
    let loss = b.cross_entropy(logits, labels);
    b.pop_module("");
    b.keep_output(loss);
    b.set_output(loss);
}

/// Builds `torchvision.models.resnetN()` for `batch` images with the cross-entropy loss.
pub fn resnet(cfg: &ResNetConfig, batch: u64) -> Result<Graph, GraphError> {
    resnet_hw(cfg, batch, (cfg.image, cfg.image))
}

/// [`resnet`] on `(height, width)` images (torchvision's ResNets take any size: `avgpool` is
/// adaptive).
pub fn resnet_hw(cfg: &ResNetConfig, batch: u64, hw: (u64, u64)) -> Result<Graph, GraphError> {
    let mut b = GraphBuilder::new(cfg.name, batch, 0);
    b.meta(
        "reference",
        format!(
            "torchvision 0.29 {}(num_classes={}) (torchvision/models/resnet.py), 3x{}x{} images, F.cross_entropy",
            cfg.name, cfg.classes, hw.0, hw.1
        )
        .into(),
    );
    let (images, labels) = image_inputs_hw(&mut b, batch, hw);
    let x = features(&mut b, cfg.block, cfg.layers, images, ActNames::Shared);
    let x = b.module("avgpool", |b| b.adaptive_avg_pool2d(x, [1, 1]));
    let x = b.flatten(x, 1);
    let logits = b.linear("fc", x, cfg.classes, true);
    classifier_loss(&mut b, logits, labels);
    b.finish()
}

/// How a ResNet names its ReLU modules (the same ops either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActNames {
    /// torchvision: one `self.relu` module, called after each BN and after the add.
    Shared,
    /// timm: one module per call, `act1`, `act2` (and `act3` in `Bottleneck`).
    Numbered,
}

impl ActNames {
    /// The name of the `i`-th (from 1) activation of a block or the stem.
    fn name(self, i: u32) -> String {
        match self {
            ActNames::Shared => "relu".to_string(),
            ActNames::Numbered => format!("act{i}"),
        }
    }
}

/// The stem and `layer1`..`layer4` of `ResNet.forward` (`_forward_impl` in torchvision,
/// `forward_features` in timm: the same ops): `conv1` (7×7, stride 2), `bn1`, ReLU, `maxpool`
/// (3×3, stride 2), then the blocks, the first of each stage after `layer1` with stride 2.
pub(crate) fn features(
    b: &mut GraphBuilder,
    kind: Block,
    layers: [u64; 4],
    images: T,
    acts: ActNames,
) -> T {
    let x = b.conv2d("conv1", images, 64, 7, 2, 3, false);
    let x = b.batch_norm2d("bn1", x);
    let x = b.module(&acts.name(1), |b| b.relu_(x));
    let mut x = b.module("maxpool", |b| b.max_pool2d(x, [3, 3], [2, 2], [1, 1]));
    let mut inplanes = 64;
    for (i, &blocks) in layers.iter().enumerate() {
        let planes = 64 << i;
        let stride = if i == 0 { 1 } else { 2 };
        for j in 0..blocks {
            let s = if j == 0 { stride } else { 1 };
            let name = format!("layer{}.{j}", i + 1);
            let input = x;
            x = b.region(RegionKind::Block, &name, |b| {
                // forward(self, x): x is an argument, alive until the block returns.
                b.hold(input);
                block(b, kind, input, inplanes, planes, s, acts)
            });
            inplanes = planes * kind.expansion();
        }
    }
    x
}

/// One `BasicBlock` or `Bottleneck` (`forward` as torchvision and timm write it; timm's without
/// drop_block, aa, se or drop_path), its activations named as `acts` says.
fn block(
    b: &mut GraphBuilder,
    kind: Block,
    x: T,
    inplanes: u64,
    planes: u64,
    stride: u64,
    acts: ActNames,
) -> T {
    let out_ch = planes * kind.expansion();
    let out = match kind {
        Block::Basic => {
            let o = b.conv2d("conv1", x, planes, 3, stride, 1, false);
            let o = b.batch_norm2d("bn1", o);
            let o = b.module(&acts.name(1), |b| b.relu_(o));
            let o = b.conv2d("conv2", o, planes, 3, 1, 1, false);
            b.batch_norm2d("bn2", o)
        }
        Block::Bottleneck => {
            let o = b.conv2d("conv1", x, planes, 1, 1, 0, false);
            let o = b.batch_norm2d("bn1", o);
            let o = b.module(&acts.name(1), |b| b.relu_(o));
            let o = b.conv2d("conv2", o, planes, 3, stride, 1, false);
            let o = b.batch_norm2d("bn2", o);
            let o = b.module(&acts.name(2), |b| b.relu_(o));
            let o = b.conv2d("conv3", o, out_ch, 1, 1, 0, false);
            b.batch_norm2d("bn3", o)
        }
    };
    let identity = if stride != 1 || inplanes != out_ch {
        // downsample (timm's downsample_conv): Conv2d(1x1, stride) + BatchNorm2d.
        b.module("downsample", |b| {
            let d = b.conv2d("0", x, out_ch, 1, stride, 0, false);
            b.batch_norm2d("1", d)
        })
    } else {
        x
    };
    let out = b.add_(out, identity);
    let last = if kind == Block::Basic { 2 } else { 3 };
    b.module(&acts.name(last), |b| b.relu_(out))
}
