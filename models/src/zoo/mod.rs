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
//! | `nanogpt`, `nanogpt-medium`, `nanogpt-large`, `nanogpt-xl` (and `-nobias`) | karpathy/nanoGPT `model.py` `GPT` (`f08abb45`) |
//! | `tinyllama-1.1b`, `llama2-7b`, `llama2-13b`, `llama2-70b`, `llama3-8b`, `llama3-405b` | transformers 5.23 `LlamaForCausalLM` |
//! | `timm/resnet18` ... `timm/convnext_large` ([`timm::MODELS`]) | timm 0.6 `timm.create_model(name)` |
//!
//! Image models take `(batch, 3, H, W)` inputs (the recipe's `image_size`, 224 × 224 by default)
//! and a `num_classes`-class cross-entropy (1000 by default; the recipe's `seq` is ignored);
//! language models take `seq` tokens and compute their loss from labels with the recipe's head
//! (the family's own by default) and loss ([`heads`]). [`Arch`] is a buildable architecture with its configuration, which is also what
//! [`crate::hf`] makes of a `config.json`.

pub mod bert;
pub mod gpt2;
pub mod heads;
pub mod llama;
pub mod mlp;
pub mod nanogpt;
pub mod nn;
pub mod resnet;
pub mod timm;
pub mod tp;
pub mod vgg;
pub mod vit;

use crate::dtype::DType;
use crate::graph::{Graph, GraphError};
use crate::ops::SdpaBackend;
use crate::recipe::{Attention, Head, Precision, Recipe};
use crate::sdpa::{self, SdpaCall, Unavailable};
use heads::Family;
pub use nn::{Activation, AttnImpl};

/// Every zoo name, in the order `vramsim predict` lists them.
pub const NAMES: [&str; 49] = [
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
    "llama3-405b",
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
    "nanogpt",
    "nanogpt-medium",
    "nanogpt-large",
    "nanogpt-xl",
    "nanogpt-nobias",
    "nanogpt-medium-nobias",
    "nanogpt-large-nobias",
    "nanogpt-xl-nobias",
];

/// Why a zoo model could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZooError {
    /// A captured module's graph that cannot be built.
    #[error(transparent)]
    Imported(#[from] crate::imported::ImportError),
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
    /// The forced SDPA backend cannot run the model's attention.
    #[error("{0}")]
    Attention(#[from] Unavailable),
    /// A fine-tuning option (`--freeze`, `--lora`) does not fit the model.
    #[error(transparent)]
    Finetune(#[from] crate::finetune::FinetuneError),
}

/// The attention kernel a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// HF's `eager_attention_forward`.
    Eager,
    /// `F.scaled_dot_product_attention` on this backend.
    Sdpa(SdpaBackend),
}

impl Kernel {
    /// The `--attention` value that forces this kernel (`eager`, `sdpa-cudnn`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Eager => "eager",
            Kernel::Sdpa(b) => b.option_name(),
        }
    }
}

/// The attention kernel of a step and why it is the one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelChoice {
    /// The kernel.
    pub kernel: Kernel,
    /// Why, naming transformers' and PyTorch's rules.
    pub reason: String,
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
    /// karpathy/nanoGPT's `GPT`.
    NanoGpt(nanogpt::NanoGptConfig),
    /// A user's `nn.Module` captured by `vramsim.from_module` ([`crate::imported`]).
    Imported(std::sync::Arc<crate::imported::ImportedGraph>),
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
            "llama3-405b" => Arch::Llama(llama::LLAMA3_405B),
            _ => match (
                timm::TimmConfig::from_name(name),
                nanogpt::NanoGptConfig::from_name(name),
            ) {
                (Some(c), _) => Arch::Timm(c),
                (None, Some(c)) => Arch::NanoGpt(c),
                (None, None) => return Err(ZooError::Unknown(name.to_string())),
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
            Arch::NanoGpt(c) => c.name,
            Arch::Imported(g) => &g.name,
        }
    }

    /// The longest sequence a language model takes (`max_position_embeddings`); `None` for the
    /// models without a sequence (images, the MLP), which ignore the recipe's `seq`.
    pub fn max_positions(&self) -> Option<u64> {
        match self {
            Arch::Mlp
            | Arch::ResNet(_)
            | Arch::Vgg16
            | Arch::Vit(_)
            | Arch::Timm(_)
            | Arch::Imported(_) => None,
            Arch::Bert(c) => Some(c.positions),
            Arch::Gpt2(c) => Some(c.positions),
            Arch::Llama(c) => Some(c.positions),
            // `assert t <= self.config.block_size` in GPT.forward.
            Arch::NanoGpt(c) => Some(c.block_size),
        }
    }

    /// The example sequence length of a captured module whose sequence length is a variable
    /// (`from_module(..., dynamic_dims=...)`): the default of `--seq` for it. `None` otherwise.
    pub fn dynamic_seq(&self) -> Option<u64> {
        match self {
            Arch::Imported(g) => g.example_seq,
            _ => None,
        }
    }

    /// The `F.scaled_dot_product_attention` call the model's attention makes under `recipe`
    /// (`None` for models without attention): dtype after autocast, heads, lengths, head
    /// sizes, and HF's `sdpa_attention_forward` arguments — no mask (HF drops an all-ones mask,
    /// `masking_utils._ignore_causal_mask_sdpa`), `is_causal = q_len > 1 and module.is_causal`,
    /// `dropout_p` the attention dropout in training, `enable_gqa=True` for modules with
    /// `num_key_value_groups` (LLaMA family) when there is no mask. torchvision's
    /// `F.multi_head_attention_forward` calls it with `attn_mask=None`, `is_causal=False` and its
    /// `dropout` (0 for ViT-B/16).
    pub fn sdpa_call(&self, recipe: &Recipe) -> Option<SdpaCall> {
        let dtype = match (recipe.precision, recipe.parallel.fsdp_param_dtype) {
            // FSDP2's MixedPrecisionPolicy(param_dtype): the unsharded parameters, and with them
            // the activations, are in param_dtype (`_fsdp_param.py` casts the all-gathered
            // parameters; the root casts its floating inputs, `cast_forward_inputs`)
            (Precision::Fp32 | Precision::Bf16, Some(d))
                if recipe.parallel.shard == crate::parallel::Shard::Fsdp2 =>
            {
                d
            }
            (Precision::Fp32, _) => DType::F32,
            (Precision::Bf16 | Precision::AmpBf16, _) => DType::BF16,
            (Precision::AmpFp16 | Precision::Fp16, _) => DType::F16,
        };
        // A context-parallel rank's attention runs on its `seq/cp` shard of the sequence.
        let (b, s) = (recipe.batch, recipe.parallel.local_seq(recipe.seq));
        let training = !recipe.inference;
        let drop = |p: f64| if training { p } else { 0.0 };
        let call = |heads: u64, kv: u64, seq: u64, hd: u64, dropout: f64, causal: bool| SdpaCall {
            dtype,
            batch: b,
            heads_q: heads,
            heads_kv: kv,
            seq_q: seq,
            seq_kv: seq,
            head_dim: hd,
            head_dim_v: hd,
            mask: false,
            dropout,
            is_causal: causal && seq > 1,
            enable_gqa: false,
            requires_grad: training,
        };
        match self {
            // timm 0.6's models run explicit attention (`q @ k.transpose(-2, -1)`), no SDPA.
            Arch::Mlp | Arch::ResNet(_) | Arch::Vgg16 | Arch::Timm(_) => None,
            // A captured module's SDPA comes from `F.multi_head_attention_forward` (the only
            // attention call the importer maps).
            Arch::Imported(g) => g.sdpa_call(recipe),
            Arch::Vit(c) => {
                let l = (c.image / c.patch).pow(2) + 1;
                Some(call(
                    c.heads,
                    c.heads,
                    l,
                    c.hidden / c.heads.max(1),
                    0.0,
                    false,
                ))
            }
            Arch::Bert(c) => Some(call(
                c.heads,
                c.heads,
                s,
                c.hidden / c.heads.max(1),
                drop(c.attention_dropout),
                false,
            )),
            Arch::Gpt2(c) => Some(call(
                c.heads,
                c.heads,
                s,
                c.hidden / c.heads.max(1),
                drop(c.attn_dropout),
                true,
            )),
            Arch::Llama(c) => Some(SdpaCall {
                enable_gqa: true,
                ..call(c.heads, c.kv_heads, s, c.head_dim(), 0.0, true)
            }),
            // CausalSelfAttention (flash): attn_mask=None, dropout_p=self.dropout if
            // self.training else 0, is_causal=True.
            Arch::NanoGpt(c) => Some(call(
                c.heads,
                c.heads,
                s,
                c.hidden / c.heads.max(1),
                drop(c.dropout),
                true,
            )),
        }
    }

    /// The attention kernel the step runs under `recipe` on `recipe.target`, and why; `None` for
    /// models without attention. `auto` follows transformers' default `attn_implementation`
    /// (`modeling_utils.get_correct_attn_implementation`: `None` → `"sdpa"` for classes with
    /// `_supports_sdpa`, which GPT-2, BERT and LLaMA/Mistral/Qwen2 have) and PyTorch's backend
    /// choice ([`sdpa::select`]); a forced backend that cannot run the call is an error.
    pub fn attention_kernel(&self, recipe: &Recipe) -> Result<Option<KernelChoice>, ZooError> {
        let Some(call) = self.sdpa_call(recipe) else {
            return self.attention_without_sdpa(recipe);
        };
        let vit = matches!(self, Arch::Vit(_) | Arch::Imported(_));
        let nano = matches!(self, Arch::NanoGpt(_));
        if recipe.attention == Attention::Eager && nano {
            return Ok(Some(KernelChoice {
                kernel: Kernel::Eager,
                reason: "eager: --attention eager (nanoGPT's manual path, flash = False: q @ kᵀ, masked_fill from the float32 `bias` buffer, softmax, att @ v)".into(),
            }));
        }
        if recipe.attention == Attention::Eager && !vit {
            return Ok(Some(KernelChoice {
                kernel: Kernel::Eager,
                reason: "eager: --attention eager (HF eager_attention_forward: explicit matmuls, softmax, dropout)".into(),
            }));
        }
        let choice = sdpa::choose(recipe.attention, &call, recipe.target)?;
        let captured_sdpa = matches!(self, Arch::Imported(g) if g.calls_sdpa());
        let why = match (vit, recipe.attention) {
            (true, Attention::Eager) if captured_sdpa => "the captured module calls F.scaled_dot_product_attention (its attn_implementation decides, not --attention eager); ",
            (true, _) if captured_sdpa => "the captured module calls F.scaled_dot_product_attention; ",
            (true, Attention::Eager) => "torchvision nn.MultiheadAttention has no eager path (need_weights=False calls SDPA in training); ",
            (true, _) => "torchvision nn.MultiheadAttention calls SDPA in training; ",
            (false, Attention::Auto) if nano => "nanoGPT flash = hasattr(F, 'scaled_dot_product_attention') (PyTorch ≥ 2.0); ",
            (false, Attention::Auto) => "transformers attn_implementation None → \"sdpa\" (_supports_sdpa); ",
            (false, _) => "",
        };
        Ok(Some(KernelChoice {
            kernel: Kernel::Sdpa(choice.backend),
            reason: format!("{why}{}", choice.reason),
        }))
    }

    /// The attention of a model that never calls SDPA: timm 0.6's ViTs compute it explicitly
    /// (`Attention.forward`: `q @ k.transpose(-2, -1) * scale`, softmax, `@ v`), the CNNs and the MLP
    /// have none. `auto` and `eager` describe what such a model runs; a forced SDPA kernel is refused
    /// with the valid choices, as no option of the model's code would call it.
    fn attention_without_sdpa(&self, recipe: &Recipe) -> Result<Option<KernelChoice>, ZooError> {
        let explicit = matches!(self, Arch::Timm(timm::TimmConfig::Vit(_)));
        match recipe.attention {
            Attention::Auto | Attention::Eager if explicit => Ok(Some(KernelChoice {
                kernel: Kernel::Eager,
                reason: "eager: timm 0.6 Attention.forward computes attention explicitly (q @ kᵀ · scale, softmax, attn_drop, @ v; no SDPA)".into(),
            })),
            Attention::Auto | Attention::Eager => Ok(None),
            forced => Err(ZooError::Unsupported {
                model: self.name().to_string(),
                field: "attention",
                msg: if explicit {
                    format!("{forced}: timm 0.6's Attention never calls scaled_dot_product_attention; valid values are auto, eager")
                } else {
                    format!("{forced}: the model has no attention; valid values are auto (or eager, the same)")
                },
            }),
        }
    }

    /// Everything the graph and its lowering take from `recipe.target`: two recipes that differ
    /// only in their target and agree on this lower to the same trace (sweeps share one lowering
    /// between such GPUs). Today that is the attention kernel; a new choice made from the target
    /// belongs here too.
    pub fn target_choices(&self, recipe: &Recipe) -> Result<TargetChoices, ZooError> {
        Ok(TargetChoices {
            attention: self.attention_kernel(recipe)?.map(|k| k.kernel),
            cublas_workspace: recipe
                .workspaces
                .cublas_workspace_bytes(recipe.target.compute_capability)
                .0,
        })
    }

    /// Builds the graph at the recipe's batch (and sequence length, for language models).
    pub fn build(&self, recipe: &Recipe) -> Result<Graph, ZooError> {
        if recipe.batch == 0 {
            return Err(ZooError::ZeroBatch);
        }
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
        if let Arch::Imported(g) = self {
            self.tp_plan(recipe, Head::None)?;
            self.image_size(recipe)?;
            self.num_classes(recipe)?;
            if recipe.head.is_some() {
                return Err(ZooError::Unsupported {
                    model: g.name.clone(),
                    field: "head",
                    msg: "a captured module's head is the one captured".into(),
                });
            }
            let g = g.build_for(batch, recipe)?;
            return Ok(crate::finetune::apply(g, recipe)?);
        }
        // A context-parallel rank's graph holds its `seq/cp` tokens (`context_parallel`).
        let seq = recipe.parallel.local_seq(recipe.seq);
        let head = self.head(recipe)?;
        let image = self.image_size(recipe)?;
        let classes = self.num_classes(recipe)?;
        let layers = match self {
            Arch::Bert(c) => c.layers,
            Arch::Gpt2(c) => c.layers,
            Arch::Llama(c) => c.layers,
            Arch::NanoGpt(c) => c.layers,
            _ => 0,
        };
        if layers > MAX_LAYERS {
            return Err(ZooError::Unsupported {
                model: self.name().to_string(),
                field: "num_hidden_layers",
                msg: format!("{layers} is more than the {MAX_LAYERS} layers vramsim builds"),
            });
        }
        for shape in self.largest_tensors(batch, seq, image, classes) {
            if !crate::graph::fits_in_memory(&shape) {
                return Err(ZooError::TooLarge {
                    model: self.name().to_string(),
                    shape,
                });
            }
        }
        let attn = attn_impl(self, recipe)?;
        let head = head.unwrap_or(Head::None);
        let tp = self.tp_plan(recipe, head)?;
        if recipe.parallel.cp > 1 {
            crate::context_parallel::check_model(self, recipe, head, attn)?;
        }
        let g = match self {
            Arch::Mlp => {
                let mut dims = mlp::MLP_DIMS;
                dims[dims.len() - 1] = classes;
                mlp::mlp(&dims, batch)?
            }
            Arch::ResNet(c) => {
                let c = resnet::ResNetConfig {
                    classes,
                    ..c.clone()
                };
                resnet::resnet_hw(&c, batch, image)?
            }
            Arch::Vgg16 => vgg::vgg16_with(batch, image, classes)?,
            Arch::Vit(c) => {
                let c = vit::VitConfig {
                    image: image.0,
                    classes,
                    ..c.clone()
                };
                vit::vit(&c, batch, vit_backend(self, recipe)?)?
            }
            Arch::Bert(c) => bert::bert_with_head_mask(
                c,
                batch,
                seq,
                attn,
                head,
                recipe.transformers_version == crate::recipe::TransformersVersion::V4_16,
                tp,
            )?,
            Arch::Gpt2(c) => gpt2::gpt2_with_head(
                c,
                batch,
                seq,
                attn,
                head,
                recipe.loss,
                use_cache(recipe),
                tp,
            )?,
            // The loss is GPT.forward's own (plain cross-entropy): `--loss` does not apply.
            Arch::NanoGpt(c) => nanogpt::nanogpt(c, batch, seq, attn)?,
            Arch::Timm(c) => c.build(batch, image, classes)?,
            Arch::Llama(c) => {
                if let (Some(w), AttnImpl::Sdpa(_)) = (c.sliding_window, attn) {
                    if recipe.seq > w {
                        return Err(ZooError::Unsupported {
                            model: c.name.to_string(),
                            field: "sliding_window",
                            msg: format!(
                                "{w} is shorter than seq {}: with SDPA, HF then passes an explicit [B, 1, S, S] window mask and PyTorch leaves the causal fused kernel, which vramsim does not model; use --attention eager (the same [B, 1, S, S] additive mask as full causal attention) or seq ≤ {w}",
                                recipe.seq
                            ),
                        });
                    }
                }
                llama::llama_with_head(
                    c,
                    batch,
                    seq,
                    attn,
                    head,
                    recipe.loss,
                    use_cache(recipe),
                    tp,
                )?
            }
            // Built above, before the zoo's checks of heads and attention.
            Arch::Imported(g) => g.build_for(batch, recipe)?,
        };
        Ok(crate::finetune::apply(g, recipe)?)
    }

    /// The tensor-parallel split of the recipe's layout for this model (`--tp`, `--sp`; see
    /// [`tp`]): the GPT-2, LLaMA and BERT families, whose heads, KV heads and FFN width `--tp`
    /// divides, with their vocabulary-parallel language-model head or a replicated head
    /// (classifiers, the base model); any other model, or the plain causal-LM loss, is refused
    /// with the reason.
    pub fn tp_plan(&self, recipe: &Recipe, head: Head) -> Result<tp::TpPlan, ZooError> {
        let plan = tp::TpPlan::of(recipe);
        if !plan.on() {
            return Ok(plan);
        }
        let unsupported = |msg: String| ZooError::Unsupported {
            model: self.name().to_string(),
            field: "tp",
            msg,
        };
        let (dims, lm): (Vec<(&str, u64)>, Head) = match self {
            Arch::Gpt2(c) => (vec![("n_head", c.heads), ("n_inner", c.inner)], Head::Lm),
            Arch::Bert(c) => (
                vec![
                    ("num_attention_heads", c.heads),
                    ("intermediate_size", c.intermediate),
                ],
                Head::MaskedLm,
            ),
            Arch::Llama(c) => (
                vec![
                    ("num_attention_heads", c.heads),
                    ("num_key_value_heads", c.kv_heads),
                    ("intermediate_size", c.intermediate),
                ],
                Head::Lm,
            ),
            _ => {
                return Err(unsupported(format!(
                    "{}: tensor parallelism is modelled for the GPT-2, LLaMA and BERT families (Megatron-style column/row-parallel attention and MLP, vocabulary-parallel embedding and loss); {} has no such split modelled: give --tp 1",
                    recipe.parallel.tp,
                    self.name()
                )))
            }
        };
        if head == lm && lm == Head::Lm && recipe.loss != crate::recipe::Loss::Hf {
            return Err(unsupported(format!(
                "{}: the tensor-parallel language-model head is vocabulary-parallel, its loss Megatron's vocab_parallel_cross_entropy on the rank's logits (HF's ForCausalLMLoss steps): give --loss hf",
                recipe.parallel.tp
            )));
        }
        // Any other head (classifiers, the base model) is replicated on every rank on the
        // hidden state every rank holds whole (gathered first under --sp:
        // `GraphBuilder::tp_gather_for_replicated`): a plain `nn.Linear` (Megatron's
        // `get_linear_layer`, as its classification and pooler heads are), its gradient the same
        // on each rank.
        plan.check(&dims, recipe.parallel.local_seq(recipe.seq))
            .map_err(|(field, msg)| ZooError::Unsupported {
                model: self.name().to_string(),
                field,
                msg,
            })?;
        Ok(plan)
    }

    /// The HF family of a language model (`None` for the image models and the MLP).
    pub fn family(&self) -> Option<Family> {
        match self {
            Arch::Gpt2(_) => Some(Family::Gpt2),
            Arch::Llama(_) => Some(Family::Llama),
            Arch::Bert(_) => Some(Family::Bert),
            Arch::NanoGpt(_) => Some(Family::NanoGpt),
            Arch::Mlp
            | Arch::ResNet(_)
            | Arch::Vgg16
            | Arch::Vit(_)
            | Arch::Timm(_)
            | Arch::Imported(_) => None,
        }
    }

    /// The head the recipe builds on a language model (`recipe.head`, else the family's own);
    /// `None` for the image models and the MLP, which take no `--head`.
    pub fn head(&self, recipe: &Recipe) -> Result<Option<Head>, ZooError> {
        let unsupported = |msg: String| ZooError::Unsupported {
            model: self.name().to_string(),
            field: "head",
            msg,
        };
        match (self.family(), recipe.head) {
            (Some(f), None) => Ok(Some(f.default_head())),
            (Some(f), Some(h)) if f.accepts(h) => Ok(Some(h)),
            (Some(f), Some(h)) => Err(unsupported(format!(
                "{h} is not built for this family: valid heads are {}",
                heads::valid_heads(f)
            ))),
            (None, None) => Ok(None),
            (None, Some(h)) => Err(unsupported(format!(
                "{h}: --head applies to the language models (gpt2 and llama: lm, seq-cls:N, token-cls:N, none; bert: masked-lm, seq-cls:N, token-cls:N, none); {} keeps its classifier: set its classes with --num-classes N",
                self.name()
            ))),
        }
    }

    /// The input images `(height, width)` of an image model under the recipe (its default
    /// 224 × 224 when `recipe.image_size` is `None`), checked against what the model accepts;
    /// `(0, 0)` for the other models, which take no `--image-size`.
    pub fn image_size(&self, recipe: &Recipe) -> Result<(u64, u64), ZooError> {
        let bad = |msg: String| ZooError::Unsupported {
            model: self.name().to_string(),
            field: "image-size",
            msg,
        };
        let default = match self {
            Arch::ResNet(c) => (c.image, c.image),
            Arch::Vit(c) => (c.image, c.image),
            Arch::Vgg16 => (224, 224),
            Arch::Timm(c) => {
                let size = recipe.image_size.unwrap_or_else(|| c.default_image());
                return c.check_image(size).map(|()| size).map_err(bad);
            }
            Arch::Imported(g) => {
                return match recipe.image_size {
                    Some((h, w)) => Err(bad(format!(
                        "{h}x{w}: {} is a captured module: its input shapes are the example inputs' (only the batch varies)",
                        g.name
                    ))),
                    None => Ok((0, 0)),
                }
            }
            Arch::Mlp => {
                return match recipe.image_size {
                    Some((h, w)) => Err(bad(format!(
                        "{h}x{w}: the MLP takes {} features per sample, not images",
                        mlp::MLP_DIMS[0]
                    ))),
                    None => Ok((0, 0)),
                }
            }
            Arch::Bert(_) | Arch::Gpt2(_) | Arch::Llama(_) | Arch::NanoGpt(_) => {
                return match recipe.image_size {
                    Some((h, w)) => Err(bad(format!(
                        "{h}x{w}: language models take --seq, not images"
                    ))),
                    None => Ok((0, 0)),
                }
            }
        };
        let (h, w) = recipe.image_size.unwrap_or(default);
        if h == 0 || w == 0 {
            return Err(bad(format!("{h}x{w}: both sides must be 1 or more")));
        }
        match self {
            // F.batch_norm in training (`_verify_batch_size`): "Expected more than 1 value per
            // channel when training" when N·H·W is 1; layer4's map is the smallest. Each stride-2
            // stage (conv1, maxpool, layer2..4) maps a side n to ⌊(n - 1) / 2⌋ + 1.
            Arch::ResNet(_)
                if !recipe.inference
                    && recipe
                        .batch
                        .saturating_mul(resnet_side(h))
                        .saturating_mul(resnet_side(w))
                        == 1 =>
            {
                return Err(bad(format!(
                    "{h}x{w} at batch {}: layer4's BatchNorm sees one value per channel, and PyTorch raises \"Expected more than 1 value per channel when training\" (use a larger batch or image)",
                    recipe.batch
                )));
            }
            // Five MaxPool2d(2, 2): a side under 32 pools to 0 ("Output size is too small").
            Arch::Vgg16 if h < 32 || w < 32 => {
                return Err(bad(format!(
                    "{h}x{w}: VGG-16's five 2x2 max pools need 32 pixels or more on each side"
                )));
            }
            Arch::Vit(c) => {
                // VisionTransformer takes one `image_size` and `_process_input` asserts
                // `h == w == image_size`; `__init__` asserts image_size % patch_size == 0.
                if h != w {
                    return Err(bad(format!(
                        "{h}x{w}: torchvision's VisionTransformer takes square images (one image_size; _process_input asserts h == w == image_size)"
                    )));
                }
                if h % c.patch != 0 {
                    return Err(bad(format!(
                        "{h}: not a multiple of the patch size {} (\"Input shape indivisible by patch size!\")",
                        c.patch
                    )));
                }
            }
            _ => {}
        }
        Ok((h, w))
    }

    /// The classes of an image model's (or the MLP's) classifier under the recipe (1000 by
    /// default); 0 for the language models, which take `--head seq-cls:N` instead.
    pub fn num_classes(&self, recipe: &Recipe) -> Result<u64, ZooError> {
        let default = match self {
            Arch::ResNet(c) => c.classes,
            Arch::Vit(c) => c.classes,
            Arch::Vgg16 | Arch::Timm(_) => 1000,
            Arch::Mlp => mlp::MLP_DIMS[mlp::MLP_DIMS.len() - 1],
            Arch::Imported(g) => {
                return match recipe.num_classes {
                    Some(n) => Err(ZooError::Unsupported {
                        model: g.name.clone(),
                        field: "num-classes",
                        msg: format!("{n}: a captured module's classifier is the one captured"),
                    }),
                    None => Ok(0),
                }
            }
            Arch::Bert(_) | Arch::Gpt2(_) | Arch::Llama(_) | Arch::NanoGpt(_) => {
                return match recipe.num_classes {
                    Some(n) => Err(ZooError::Unsupported {
                        model: self.name().to_string(),
                        field: "num-classes",
                        msg: format!(
                            "{n}: --num-classes applies to image models; a language model takes --head seq-cls:{n} or token-cls:{n}"
                        ),
                    }),
                    None => Ok(0),
                }
            }
        };
        match recipe.num_classes {
            Some(0) => Err(ZooError::Unsupported {
                model: self.name().to_string(),
                field: "num-classes",
                msg: "must be 1 or more".into(),
            }),
            Some(n) => Ok(n),
            None => Ok(default),
        }
    }
}

/// A ResNet's layer4 side for an input side `n`: five stride-2 stages, each `⌊(n - 1) / 2⌋ + 1`.
fn resnet_side(n: u64) -> u64 {
    (0..5).fold(n, |n, _| (n.max(1) - 1) / 2 + 1)
}

/// What a step's lowering takes from the GPU it runs on ([`Arch::target_choices`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TargetChoices {
    /// The attention kernel (`None` for models without attention).
    pub attention: Option<Kernel>,
    /// The cuBLAS workspace size (`parseChosenWorkspaceSize`: 32 MiB on sm 9–12, 8,519,680 B
    /// elsewhere, unless `CUBLAS_WORKSPACE_CONFIG` says otherwise).
    pub cublas_workspace: u64,
}

/// The most layers a language model may have (the graph is built op by op, in host memory).
pub const MAX_LAYERS: u64 = 4096;

impl Arch {
    /// The shapes of the largest tensors a step makes (`[B, H, S, S]` scores, `[B, S, V]` logits, the
    /// first feature maps, ...): if they fit in [`crate::graph::MAX_TENSOR_BYTES`], so does every
    /// tensor of the graph, and no shape arithmetic can overflow while building it.
    fn largest_tensors(&self, b: u64, s: u64, (ih, iw): (u64, u64), classes: u64) -> Vec<Vec<u64>> {
        match self {
            // The graph builder checks each tensor of an imported graph as it makes it.
            Arch::Imported(_) => vec![],
            Arch::Mlp => vec![vec![b, 4096]],
            Arch::ResNet(_) => vec![
                vec![b, 256, ih.div_ceil(4), iw.div_ceil(4)],
                vec![b, 64, ih.div_ceil(2), iw.div_ceil(2)],
                vec![b, 3, ih, iw],
            ],
            Arch::Vgg16 => vec![vec![b, 64, ih, iw], vec![25088, 4096]],
            Arch::Vit(c) => {
                let l = (ih / c.patch)
                    .saturating_mul(iw / c.patch)
                    .saturating_add(1);
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
            Arch::Timm(c) => c.largest_tensors(b, (ih, iw), classes),
            Arch::NanoGpt(c) => vec![
                vec![b, c.heads, s, s],
                vec![b, s, c.vocab],
                vec![b, s, c.hidden.saturating_mul(4)],
                vec![b, s, c.hidden.saturating_mul(3)],
                vec![c.vocab, c.hidden],
                vec![c.block_size, c.block_size],
            ],
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

/// How the step's attention core runs ([`Arch::attention_kernel`]); eager for models without
/// attention.
pub fn attn_impl(arch: &Arch, r: &Recipe) -> Result<AttnImpl, ZooError> {
    Ok(match arch.attention_kernel(r)? {
        Some(KernelChoice {
            kernel: Kernel::Sdpa(b),
            ..
        }) => AttnImpl::Sdpa(b),
        _ => AttnImpl::Eager,
    })
}

/// The SDPA kernel torchvision's `nn.MultiheadAttention` gets: the same selection as the HF
/// models ([`Arch::attention_kernel`]; `eager` chooses as `auto` does, torchvision having no eager
/// path): memory-efficient attention for float32, FlashAttention-2 or cuDNN for 16-bit inputs
/// depending on the GPU. An error for an architecture without torchvision attention.
pub fn vit_backend(arch: &Arch, r: &Recipe) -> Result<SdpaBackend, ZooError> {
    match arch.attention_kernel(r)? {
        Some(KernelChoice {
            kernel: Kernel::Sdpa(b),
            ..
        }) if matches!(arch, Arch::Vit(_)) => Ok(b),
        _ => Err(ZooError::Unsupported {
            model: arch.name().to_string(),
            field: "attention",
            msg: "is not torchvision's nn.MultiheadAttention".into(),
        }),
    }
}

/// Builds a timm model at the recipe's batch, `image_size` (default: the model's, 224×224 or
/// 384×384) and `num_classes` (default 1000), checking both and the tensor sizes first.
/// Whether an HF decoder's forward builds a `DynamicCache`: `use_cache` is the loop's
/// [`Recipe::use_cache`] or else the config's (`PretrainedConfig.use_cache`, True by default), and
/// transformers 5.23 turns it off when gradient checkpointing is on and the model trains
/// (`utils/generic.py` `merge_with_config_defaults`, applied to `LlamaModel.forward` /
/// `GPT2Model.forward`); then `if use_cache and past_key_values is None: past_key_values =
/// DynamicCache(config=self.config)`.
pub fn use_cache(recipe: &Recipe) -> bool {
    // Only `Checkpointing::Full` is HF's `gradient_checkpointing_enable()` (which sets the
    // model's `gradient_checkpointing` flag); the other modes wrap blocks from the loop.
    let hf_checkpointing = recipe.checkpointing == crate::recipe::Checkpointing::Full;
    let training = !recipe.inference;
    recipe.use_cache.unwrap_or(true) && !(hf_checkpointing && training)
}

/// Builds zoo model `name` at the recipe's batch and sequence length.
pub fn build(name: &str, recipe: &Recipe) -> Result<Graph, ZooError> {
    Arch::from_name(name)?.build(recipe)
}
