//! VGG-16 as torchvision 0.29 defines it (`torchvision/models/vgg.py`, configuration "D", no batch
//! norm), trained on `(batch, 3, 224, 224)` images with a 1000-class `F.cross_entropy`:
//! `features` = thirteen 3×3 convolutions (bias, padding 1) each followed by `ReLU(inplace=True)`,
//! with a 2×2 max pool after each of the five stages; `avgpool` = `AdaptiveAvgPool2d((7, 7))`
//! (a real `_adaptive_avg_pool2d` kernel, even on a 7×7 map); `torch.flatten(x, 1)`;
//! `classifier` = Linear(25088, 4096), ReLU(inplace), Dropout(0.5), Linear(4096, 4096),
//! ReLU(inplace), Dropout(0.5), Linear(4096, 1000).
//!
//! torchvision's VGG has no blocks; for checkpointing each of the five stages (its convolutions,
//! ReLUs and pool) is a block.

use super::resnet::{classifier_loss, image_inputs_hw};
use crate::graph::{Graph, GraphBuilder, GraphError, RegionKind};

/// VGG configuration "D" (VGG-16): output channels of each convolution, 0 for a max pool.
pub const VGG16_CFG: [u64; 18] = [
    64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0,
];

/// Builds `torchvision.models.vgg16()` (138,357,544 parameters) for `batch` images with the
/// cross-entropy loss.
pub fn vgg16(batch: u64) -> Result<Graph, GraphError> {
    vgg16_with(batch, (224, 224), 1000)
}

/// `torchvision.models.vgg16(num_classes=classes)` on `(height, width)` images (32 or more on each
/// side: five 2×2 max pools; `avgpool` adapts any map to 7×7).
pub fn vgg16_with(batch: u64, hw: (u64, u64), classes: u64) -> Result<Graph, GraphError> {
    let mut b = GraphBuilder::new("vgg16", batch, 0);
    b.meta(
        "reference",
        format!(
            "torchvision 0.29 vgg16(num_classes={classes}) (torchvision/models/vgg.py, cfg D), 3x{}x{} images, F.cross_entropy",
            hw.0, hw.1
        )
        .into(),
    );
    let (images, labels) = image_inputs_hw(&mut b, batch, hw);
    let x = b.module("features", |b| {
        let mut x = images;
        let mut idx = 0;
        let stages: Vec<&[u64]> = VGG16_CFG.split_inclusive(|&c| c == 0).collect();
        for stage in stages {
            x = b.region(RegionKind::Block, "", |b| {
                let mut y = x;
                for &c in stage {
                    if c == 0 {
                        y = b.module(&idx.to_string(), |b| {
                            b.max_pool2d(y, [2, 2], [2, 2], [0, 0])
                        });
                        idx += 1;
                    } else {
                        y = b.conv2d(&idx.to_string(), y, c, 3, 1, 1, true);
                        y = b.module(&(idx + 1).to_string(), |b| b.relu_(y));
                        idx += 2;
                    }
                }
                y
            });
        }
        x
    });
    let x = b.module("avgpool", |b| b.adaptive_avg_pool2d(x, [7, 7]));
    let x = b.flatten(x, 1);
    let logits = b.module("classifier", |b| {
        let y = b.linear("0", x, 4096, true);
        let y = b.module("1", |b| b.relu_(y));
        let y = b.module("2", |b| b.dropout(y, 0.5));
        let y = b.linear("3", y, 4096, true);
        let y = b.module("4", |b| b.relu_(y));
        let y = b.module("5", |b| b.dropout(y, 0.5));
        b.linear("6", y, classes, true)
    });
    classifier_loss(&mut b, logits, labels);
    b.finish()
}
