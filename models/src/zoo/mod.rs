//! The model zoo: graphs of the models users train, each following a named reference
//! implementation.
//!
//! | name | reference |
//! | --- | --- |
//! | `mlp` | `nn.Sequential(Linear(1024,4096), ReLU, Linear(4096,4096), ReLU, Linear(4096,4096), ReLU, Linear(4096,1000))` |
//! | `resnet18`, `resnet34`, `resnet50`, `resnet101`, `resnet152` | torchvision 0.29 `resnetN()` |
//! | `vgg16` | torchvision 0.29 `vgg16()` |
//! | `vit-b-16` | torchvision 0.29 `vit_b_16()` |
//! | `bert-base`, `bert-large` | transformers 5.23 `BertForMaskedLM` |
//! | `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl` | transformers 5.23 `GPT2LMHeadModel` |
//! | `tinyllama-1.1b`, `llama2-7b`, `llama2-13b`, `llama2-70b`, `llama3-8b` | transformers 5.23 `LlamaForCausalLM` |
//! | `timm/resnet18` ... `timm/convnext_large` ([`timm::MODELS`]) | timm 0.6 `timm.create_model(name)` |
//!
//! Image models take `(batch, 3, 224, 224)` inputs and a 1000-class cross-entropy (the recipe's
//! `seq` is ignored); language models take `seq` tokens and compute their own loss from labels, as
//! HF does. [`Arch`] is a buildable architecture with its configuration, which is also what
//! [`crate::hf`] makes of a `config.json`.

pub mod bert;
pub mod gpt2;
pub mod llama;
pub mod mlp;
pub mod nn;
pub mod resnet;
pub mod timm;
pub mod vgg;
pub mod vit;

use crate::graph::{Graph, GraphError};
use crate::ops::SdpaBackend;
use crate::recipe::{Attention, Precision, Recipe};
pub use nn::{Activation, AttnImpl};

/// Every zoo name, in the order `vramsim predict` lists them.
pub const NAMES: [&str; 40] = [
    "mlp",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "vgg16",
    "vit-b-16",
    "bert-base",
    "bert-large",
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "tinyllama-1.1b",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "timm/resnet18",
    "timm/resnet26",
    "timm/resnet34",
    "timm/resnet50",
    "timm/resnet101",
    "timm/resnet152",
    "timm/vit_tiny_patch16_224",
    "timm/vit_small_patch16_224",
    "timm/vit_base_patch32_224",
    "timm/vit_base_patch16_224",
    "timm/vit_base_patch16_384",
    "timm/vit_large_patch16_224",
    "timm/deit_tiny_patch16_224",
    "timm/deit_small_patch16_224",
    "timm/deit_base_patch16_224",
    "timm/efficientnet_b0",
    "timm/convnext_nano",
    "timm/convnext_tiny",
    "timm/convnext_small",
    "timm/convnext_base",
    "timm/convnext_large",
];

/// Why a zoo model could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZooError {
    /// No such model.
    #[error("unknown model {0:?}: the zoo has {names}", names = NAMES.join(", "))]
    Unknown(String),
    /// Batch size 0.
    #[error("batch must be 1 or more, got 0")]
    ZeroBatch,
    /// Sequence length 0.
    #[error("seq must be 1 or more for {0}, got 0")]
    ZeroSeq(String),
    /// Longer than the model's learned or trained positions.
    #[error("seq {seq} is longer than {model}'s {max} positions (max_position_embeddings)")]
    SeqTooLong {
        /// Model.
        model: String,
        /// Asked.
        seq: u64,
        /// Allowed.
        max: u64,
    },
    /// The configuration asks for something the lowering does not model under this recipe.
    #[error("{model}: {field} {msg}")]
    Unsupported {
        /// Model.
        model: String,
        /// The configuration field.
        field: &'static str,
        /// What is not modelled and what would be.
        msg: String,
    },
    /// A tensor of the step would be larger than any device.
    #[error("{model}: a tensor of shape {shape:?} would take more than 2^50 bytes (1 PiB), more than any device holds: batch, sequence or model sizes out of range")]
    TooLarge {
        /// Model.
        model: String,
        /// The tensor's shape.
        shape: Vec<u64>,
    },
    /// The graph could not be built.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// A buildable architecture with its configuration: a zoo entry or an imported `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub enum Arch {
    /// The capture tool's MLP.
    Mlp,
    /// A torchvision ResNet.
    ResNet(resnet::ResNetConfig),
    /// torchvision VGG-16.
    Vgg16,
    /// A torchvision Vision Transformer.
    Vit(vit::VitConfig),
    /// HF `BertForMaskedLM`.
    Bert(bert::BertConfig),
    /// HF `GPT2LMHeadModel`.
    Gpt2(gpt2::GptConfig),
    /// HF `LlamaForCausalLM` (and Mistral, Qwen2).
    Llama(llama::LlamaConfig),
    /// A timm 0.6 model (`timm/<name>`).
    Timm(timm::TimmConfig),
}

impl Arch {
    /// The zoo entry `name`.
    pub fn from_name(name: &str) -> Result<Arch, ZooError> {
        Ok(match name {
            "mlp" => Arch::Mlp,
            "resnet18" => Arch::ResNet(resnet::RESNET18),
            "resnet34" => Arch::ResNet(resnet::RESNET34),
            "resnet50" => Arch::ResNet(resnet::RESNET50),
            "resnet101" => Arch::ResNet(resnet::RESNET101),
            "resnet152" => Arch::ResNet(resnet::RESNET152),
            "vgg16" => Arch::Vgg16,
            "vit-b-16" => Arch::Vit(vit::VIT_B_16),
            "bert-base" => Arch::Bert(bert::BERT_BASE),
            "bert-large" => Arch::Bert(bert::BERT_LARGE),
            "gpt2" => Arch::Gpt2(gpt2::GPT2),
            "gpt2-medium" => Arch::Gpt2(gpt2::GPT2_MEDIUM),
            "gpt2-large" => Arch::Gpt2(gpt2::GPT2_LARGE),
            "gpt2-xl" => Arch::Gpt2(gpt2::GPT2_XL),
            "tinyllama-1.1b" => Arch::Llama(llama::TINYLLAMA),
            "llama2-7b" => Arch::Llama(llama::LLAMA2_7B),
            "llama2-13b" => Arch::Llama(llama::LLAMA2_13B),
            "llama2-70b" => Arch::Llama(llama::LLAMA2_70B),
            "llama3-8b" => Arch::Llama(llama::LLAMA3_8B),
            _ => match timm::TimmConfig::from_name(name) {
                Some(c) => Arch::Timm(c),
                None => return Err(ZooError::Unknown(name.to_string())),
            },
        })
    }

    /// The model's name (zoo name, or the name an imported config was given).
    pub fn name(&self) -> &str {
        match self {
            Arch::Mlp => "mlp",
            Arch::ResNet(c) => c.name,
            Arch::Vgg16 => "vgg16",
            Arch::Vit(c) => c.name,
            Arch::Bert(c) => &c.name,
            Arch::Gpt2(c) => &c.name,
            Arch::Llama(c) => &c.name,
            Arch::Timm(c) => c.name(),
        }
    }

    /// The longest sequence a language model takes (`max_position_embeddings`); `None` for the
    /// models without a sequence (images, the MLP), which ignore the recipe's `seq`.
    pub fn max_positions(&self) -> Option<u64> {
        match self {
            Arch::Mlp | Arch::ResNet(_) | Arch::Vgg16 | Arch::Vit(_) | Arch::Timm(_) => None,
            Arch::Bert(c) => Some(c.positions),
            Arch::Gpt2(c) => Some(c.positions),
            Arch::Llama(c) => Some(c.positions),
        }
    }

    /// Builds the graph at the recipe's batch (and sequence length, for language models).
    pub fn build(&self, recipe: &Recipe) -> Result<Graph, ZooError> {
        if recipe.batch == 0 {
            return Err(ZooError::ZeroBatch);
        }
        let attn = attn_impl(recipe);
        let batch = recipe.batch;
        if let Some(max) = self.max_positions() {
            if recipe.seq == 0 {
                return Err(ZooError::ZeroSeq(self.name().to_string()));
            }
            if recipe.seq > max {
                return Err(ZooError::SeqTooLong {
                    model: self.name().to_string(),
                    seq: recipe.seq,
                    max,
                });
            }
        }
        let seq = recipe.seq;
        let layers = match self {
            Arch::Bert(c) => c.layers,
            Arch::Gpt2(c) => c.layers,
            Arch::Llama(c) => c.layers,
            _ => 0,
        };
        if layers > MAX_LAYERS {
            return Err(ZooError::Unsupported {
                model: self.name().to_string(),
                field: "num_hidden_layers",
                msg: format!("{layers} is more than the {MAX_LAYERS} layers vramsim builds"),
            });
        }
        if let Arch::Timm(c) = self {
            return build_timm(c, recipe);
        }
        for shape in self.largest_tensors(batch, seq) {
            if !crate::graph::fits_in_memory(&shape) {
                return Err(ZooError::TooLarge {
                    model: self.name().to_string(),
                    shape,
                });
            }
        }
        Ok(match self {
            Arch::Mlp => mlp::mlp(&mlp::MLP_DIMS, batch)?,
            Arch::ResNet(c) => resnet::resnet(c, batch)?,
            Arch::Vgg16 => vgg::vgg16(batch)?,
            Arch::Vit(c) => vit::vit(c, batch, vit_backend(recipe))?,
            Arch::Timm(c) => return build_timm(c, recipe),
            Arch::Bert(c) => bert::bert(c, batch, seq, attn)?,
            Arch::Gpt2(c) => gpt2::gpt2(c, batch, seq, attn)?,
            Arch::Llama(c) => {
                if let (Some(w), AttnImpl::Sdpa(_)) = (c.sliding_window, attn) {
                    if seq > w {
                        return Err(ZooError::Unsupported {
                            model: c.name.to_string(),
                            field: "sliding_window",
                            msg: format!(
                                "{w} is shorter than seq {seq}: with SDPA, HF then passes an explicit [B, 1, S, S] window mask and PyTorch leaves the causal fused kernel, which vramsim does not model; use --attention eager (the same [B, 1, S, S] additive mask as full causal attention) or seq ≤ {w}"
                            ),
                        });
                    }
                }
                llama::llama(c, batch, seq, attn)?
            }
        })
    }
}

/// The most layers a language model may have (the graph is built op by op, in host memory).
pub const MAX_LAYERS: u64 = 4096;

impl Arch {
    /// The shapes of the largest tensors a step makes (`[B, H, S, S]` scores, `[B, S, V]` logits, the
    /// first feature maps, ...): if they fit in [`crate::graph::MAX_TENSOR_BYTES`], so does every
    /// tensor of the graph, and no shape arithmetic can overflow while building it.
    fn largest_tensors(&self, b: u64, s: u64) -> Vec<Vec<u64>> {
        match self {
            Arch::Mlp => vec![vec![b, 4096]],
            Arch::ResNet(c) => vec![
                vec![b, 256, c.image / 4, c.image / 4],
                vec![b, 64, c.image / 2, c.image / 2],
            ],
            Arch::Vgg16 => vec![vec![b, 64, 224, 224], vec![25088, 4096]],
            Arch::Vit(c) => {
                let l = (c.image / c.patch).pow(2) + 1;
                vec![
                    vec![3, l, b, c.hidden],
                    vec![b, l, c.mlp],
                    vec![b, c.heads, l, 32],
                ]
            }
            Arch::Bert(c) => vec![
                vec![b, c.heads, s, s],
                vec![b, s, c.vocab],
                vec![b, s, c.intermediate],
                vec![c.vocab, c.hidden],
                vec![c.intermediate, c.hidden],
            ],
            Arch::Gpt2(c) => vec![
                vec![b, c.heads, s, s],
                vec![b, s, c.vocab],
                vec![b, s, c.inner],
                vec![b, s, c.hidden.saturating_mul(3)],
                vec![c.vocab, c.hidden],
                vec![c.inner, c.hidden],
            ],
            Arch::Timm(c) => c.largest_tensors(b, c.default_image(), 1000),
            Arch::Llama(c) => vec![
                vec![b, c.heads, s, s],
                vec![b, s, c.vocab],
                vec![b, s, c.intermediate],
                vec![b, c.heads, s, c.head_dim()],
                vec![c.vocab, c.hidden],
                vec![c.intermediate, c.hidden],
                vec![c.heads, c.head_dim(), c.hidden],
            ],
        }
    }
}

/// The attention implementation a recipe asks for.
pub fn attn_impl(r: &Recipe) -> AttnImpl {
    match r.attention {
        Attention::Eager => AttnImpl::Eager,
        Attention::SdpaFlash => AttnImpl::Sdpa(SdpaBackend::Flash),
        Attention::SdpaMemEfficient => AttnImpl::Sdpa(SdpaBackend::MemEfficient),
    }
}

/// The SDPA kernel torchvision's `nn.MultiheadAttention` gets on CUDA: the recipe's `sdpa-*`
/// choice, else memory-efficient attention for float32 (FlashAttention needs 16-bit inputs) and
/// FlashAttention-2 for 16-bit ones.
pub fn vit_backend(r: &Recipe) -> SdpaBackend {
    match r.attention {
        Attention::SdpaFlash => SdpaBackend::Flash,
        Attention::SdpaMemEfficient => SdpaBackend::MemEfficient,
        Attention::Eager if r.precision == Precision::Fp32 => SdpaBackend::MemEfficient,
        Attention::Eager => SdpaBackend::Flash,
    }
}

/// Builds a timm model at the recipe's batch, `image_size` (default: the model's, 224×224 or
/// 384×384) and `num_classes` (default 1000), checking both and the tensor sizes first.
fn build_timm(c: &timm::TimmConfig, recipe: &Recipe) -> Result<Graph, ZooError> {
    let image = recipe.image_size.unwrap_or_else(|| c.default_image());
    let classes = recipe.num_classes.unwrap_or(1000);
    let unsupported = |field: &'static str, msg: String| ZooError::Unsupported {
        model: c.name().to_string(),
        field,
        msg,
    };
    if classes == 0 {
        return Err(unsupported(
            "num_classes",
            "must be 1 or more (timm's num_classes=0 drops the head and the loss)".into(),
        ));
    }
    c.check_image(image)
        .map_err(|msg| unsupported("image_size", msg))?;
    for shape in c.largest_tensors(recipe.batch, image, classes) {
        if !crate::graph::fits_in_memory(&shape) {
            return Err(ZooError::TooLarge {
                model: c.name().to_string(),
                shape,
            });
        }
    }
    Ok(c.build(recipe.batch, image, classes)?)
}

/// Builds zoo model `name` at the recipe's batch and sequence length.
pub fn build(name: &str, recipe: &Recipe) -> Result<Graph, ZooError> {
    Arch::from_name(name)?.build(recipe)
}
