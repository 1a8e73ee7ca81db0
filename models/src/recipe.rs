//! [`Recipe`]: everything about a training step that is not the model, and its validation.

use std::fmt;
use std::str::FromStr;

/// Numeric precision of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything float32.
    #[default]
    Fp32,
    /// `model.to(torch.bfloat16)`: parameters, gradients, optimizer state and activations in
    /// bfloat16, except where the model code upcasts explicitly.
    Bf16,
    /// float32 parameters, `torch.autocast(dtype=torch.float16)` forward, `GradScaler`.
    AmpFp16,
    /// float32 parameters, `torch.autocast(dtype=torch.bfloat16)` forward, no scaler.
    AmpBf16,
}

/// Which blocks `torch.utils.checkpoint` (non-reentrant) wraps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Checkpointing {
    /// No recomputation.
    #[default]
    None,
    /// Every block (HF `gradient_checkpointing_enable()`).
    Full,
    /// Every K-th block (blocks 0, K, 2K, ...).
    Every(u32),
    /// Only the attention core of each block (Korthikanti et al.'s selective recomputation).
    Selective,
    /// `checkpoint_sequential(blocks, segments=round(√n))`: the blocks in √n segments, the last
    /// segment not checkpointed.
    Sqrt,
}

/// The optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OptimizerKind {
    /// `torch.optim.SGD(lr)`.
    Sgd,
    /// `torch.optim.SGD(lr, momentum=0.9)`.
    SgdMomentum,
    /// `torch.optim.Adam`.
    Adam,
    /// `torch.optim.AdamW(weight_decay=0.01)`.
    #[default]
    AdamW,
    /// `torch.optim.Adafactor`.
    Adafactor,
}

/// How the optimizer runs its math (`foreach`/`fused` arguments).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OptimizerImpl {
    /// `foreach=True`: PyTorch's default on CUDA; `_foreach_*` ops allocate intermediate lists.
    #[default]
    Foreach,
    /// `fused=True` (SGD, Adam, AdamW): one kernel, no intermediates, `step` on the device.
    Fused,
    /// `foreach=False`: a Python loop over parameters (intermediates one parameter at a time).
    ForLoop,
}

/// Whether `zero_grad` frees the gradients (`set_to_none=True`, the default) or zeroes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ZeroGrad {
    /// `optimizer.zero_grad(set_to_none=True)`.
    #[default]
    SetToNone,
    /// `optimizer.zero_grad(set_to_none=False)`: gradients stay allocated.
    Zero,
}

/// Attention implementation (`--attention`): what transformers' `attn_implementation` and
/// PyTorch's SDPA backend choice give by default, or one of them forced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Attention {
    /// What a user gets by default: transformers' `attn_implementation=None` → `"sdpa"` for
    /// classes with `_supports_sdpa` (GPT-2, BERT, LLaMA, Mistral, Qwen2 do), and PyTorch's
    /// backend choice for the recipe's GPU ([`crate::sdpa::select`]). torchvision's
    /// `nn.MultiheadAttention` always calls SDPA in training. `sdpa` (transformers'
    /// `attn_implementation="sdpa"`) parses to this: the same for these families.
    #[default]
    Auto,
    /// `eager`: HF's explicit matmuls, softmax and dropout (ViT: as `auto`, torchvision has no
    /// eager path).
    Eager,
    /// SDPA forced to FlashAttention-2 (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`).
    SdpaFlash,
    /// SDPA forced to the memory-efficient kernel.
    SdpaMemEfficient,
    /// SDPA forced to the composite math implementation.
    SdpaMath,
    /// SDPA forced to cuDNN attention.
    SdpaCudnn,
}

impl fmt::Display for Attention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Attention::Auto => "auto",
            Attention::Eager => "eager",
            Attention::SdpaFlash => "sdpa-flash",
            Attention::SdpaMemEfficient => "sdpa-mem-efficient",
            Attention::SdpaMath => "sdpa-math",
            Attention::SdpaCudnn => "sdpa-cudnn",
        })
    }
}

/// How faithfully to follow a dispatch-mode capture rather than CUDA eager PyTorch.
///
/// Under a `TorchDispatchMode` (and on meta tensors) `at::isTensorSubclassLike` is true, so the
/// autograd engine never accumulates gradients in place (`InputBuffer::accumulate` takes
/// `old_var + var`). On CUDA without a mode it reuses a buffer it holds the last reference to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Fidelity {
    /// Eager PyTorch on CUDA.
    #[default]
    Cuda,
    /// What `traces/python/vramsim_capture.py` records on the meta device.
    MetaCapture,
}

/// The GPU a step runs on, as far as the kernels PyTorch picks depend on it (SDPA backends, cuBLAS
/// workspace sizes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// `torch.cuda.get_device_capability()`: (major, minor).
    pub compute_capability: (u32, u32),
}

impl Default for Target {
    /// vramsim's default device, an 80 GB H100 (sm 9.0).
    fn default() -> Self {
        Target {
            compute_capability: (9, 0),
        }
    }
}

/// Everything about a training step that is not the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    /// Micro-batch size.
    pub batch: u64,
    /// Sequence length (language models).
    pub seq: u64,
    /// Precision.
    pub precision: Precision,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Optimizer implementation.
    pub optimizer_impl: OptimizerImpl,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub accum: u32,
    /// `zero_grad` mode.
    pub zero_grad: ZeroGrad,
    /// Optimizer steps to lower (2 or more to see the steady state).
    pub iterations: u32,
    /// Inference (`torch.no_grad()`, `model.eval()`): forward only, nothing saved.
    pub inference: bool,
    /// Attention implementation for the HF models.
    pub attention: Attention,
    /// CUDA eager semantics or the meta-device capture's.
    pub fidelity: Fidelity,
    /// The GPU the step runs on.
    pub target: Target,
    /// Input images of image models as (height, width); `None`: the model's default (224 × 224).
    pub image_size: Option<(u64, u64)>,
    /// Classes of an image model's classifier; `None`: the model's default (1000).
    pub num_classes: Option<u64>,
}

impl Default for Recipe {
    fn default() -> Self {
        Recipe {
            batch: 1,
            seq: 1024,
            precision: Precision::Fp32,
            optimizer: OptimizerKind::AdamW,
            optimizer_impl: OptimizerImpl::Foreach,
            checkpointing: Checkpointing::None,
            accum: 1,
            zero_grad: ZeroGrad::SetToNone,
            iterations: 2,
            inference: false,
            attention: Attention::Auto,
            fidelity: Fidelity::Cuda,
            target: Target::default(),
            image_size: None,
            num_classes: None,
        }
    }
}

impl Recipe {
    /// A default recipe (fp32, AdamW foreach, no checkpointing, 2 iterations) at `batch` × `seq`.
    pub fn new(batch: u64, seq: u64) -> Recipe {
        Recipe {
            batch,
            seq,
            ..Recipe::default()
        }
    }

    /// Checks the fields that do not depend on the model.
    pub fn validate(&self) -> Result<(), RecipeError> {
        if self.batch == 0 {
            return Err(RecipeError::ZeroBatch);
        }
        if self.accum == 0 {
            return Err(RecipeError::Invalid {
                field: "accum",
                msg: "must be 1 or more".into(),
            });
        }
        if self.iterations == 0 {
            return Err(RecipeError::Invalid {
                field: "iterations",
                msg: "must be 1 or more".into(),
            });
        }
        if let Checkpointing::Every(0) = self.checkpointing {
            return Err(RecipeError::Invalid {
                field: "checkpoint",
                msg: "every:K needs K ≥ 1".into(),
            });
        }
        if self.optimizer_impl == OptimizerImpl::Fused && self.optimizer == OptimizerKind::Adafactor
        {
            return Err(RecipeError::Invalid {
                field: "optimizer",
                msg: "Adafactor has no fused implementation (use foreach or for-loop)".into(),
            });
        }
        Ok(())
    }

    /// The short name the capture fixtures use (`fp32-adamw-ckptfull-accum2`).
    pub fn name(&self) -> String {
        let mut s = format!("{}-{}", self.precision, self.optimizer);
        match self.checkpointing {
            Checkpointing::None => {}
            c => s.push_str(&format!("-ckpt{}", c.to_string().replace(':', ""))),
        }
        if self.accum != 1 {
            s.push_str(&format!("-accum{}", self.accum));
        }
        s
    }
}

/// A recipe that cannot be lowered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecipeError {
    /// `batch` is 0.
    #[error("batch must be 1 or more, got 0")]
    ZeroBatch,
    /// A field has a value out of range.
    #[error("invalid {field}: {msg}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// An option string names no known value.
    #[error("unknown {field} {value:?}: valid values are {valid}")]
    Unknown {
        /// The option.
        field: &'static str,
        /// What was given.
        value: String,
        /// The valid values, comma-separated.
        valid: &'static str,
    },
}

macro_rules! named_enum {
    ($ty:ty, $field:literal, $valid:literal, [$($name:literal => $val:expr),+ $(,)?]) => {
        impl FromStr for $ty {
            type Err = RecipeError;
            fn from_str(s: &str) -> Result<Self, RecipeError> {
                match s {
                    $($name => Ok($val),)+
                    _ => Err(RecipeError::Unknown { field: $field, value: s.to_string(), valid: $valid }),
                }
            }
        }
    };
}

named_enum!(Precision, "precision", "fp32, bf16, amp-fp16, amp-bf16",
    ["fp32" => Precision::Fp32, "bf16" => Precision::Bf16, "amp-fp16" => Precision::AmpFp16, "amp-bf16" => Precision::AmpBf16]);
named_enum!(OptimizerKind, "optimizer", "adamw, adam, sgd, sgd-momentum, adafactor",
    ["adamw" => OptimizerKind::AdamW, "adam" => OptimizerKind::Adam, "sgd" => OptimizerKind::Sgd,
     "sgd-momentum" => OptimizerKind::SgdMomentum, "adafactor" => OptimizerKind::Adafactor]);
named_enum!(OptimizerImpl, "optimizer implementation", "foreach, fused, for-loop",
    ["foreach" => OptimizerImpl::Foreach, "fused" => OptimizerImpl::Fused, "for-loop" => OptimizerImpl::ForLoop]);
named_enum!(ZeroGrad, "zero_grad mode", "none, zero",
    ["none" => ZeroGrad::SetToNone, "zero" => ZeroGrad::Zero]);
named_enum!(Attention, "attention", "auto, eager, sdpa, sdpa-flash, sdpa-mem-efficient, sdpa-math, sdpa-cudnn",
    ["auto" => Attention::Auto, "eager" => Attention::Eager, "sdpa" => Attention::Auto,
     "sdpa-flash" => Attention::SdpaFlash, "sdpa-mem-efficient" => Attention::SdpaMemEfficient,
     "sdpa-math" => Attention::SdpaMath, "sdpa-cudnn" => Attention::SdpaCudnn]);

impl FromStr for Checkpointing {
    type Err = RecipeError;
    fn from_str(s: &str) -> Result<Self, RecipeError> {
        let unknown = || RecipeError::Unknown {
            field: "checkpoint",
            value: s.to_string(),
            valid: "none, full, every:K, selective, sqrt",
        };
        match s {
            "none" => Ok(Checkpointing::None),
            "full" => Ok(Checkpointing::Full),
            "selective" => Ok(Checkpointing::Selective),
            "sqrt" => Ok(Checkpointing::Sqrt),
            _ => {
                let k = s.strip_prefix("every:").ok_or_else(unknown)?;
                let k: u32 = k.parse().map_err(|_| unknown())?;
                if k == 0 {
                    return Err(RecipeError::Invalid {
                        field: "checkpoint",
                        msg: "every:K needs K ≥ 1".into(),
                    });
                }
                Ok(Checkpointing::Every(k))
            }
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::AmpFp16 => "amp-fp16",
            Precision::AmpBf16 => "amp-bf16",
        })
    }
}

impl fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::SgdMomentum => "sgd-momentum",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Adafactor => "adafactor",
        })
    }
}

impl fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpointing::None => f.write_str("none"),
            Checkpointing::Full => f.write_str("full"),
            Checkpointing::Every(k) => write!(f, "every:{k}"),
            Checkpointing::Selective => f.write_str("selective"),
            Checkpointing::Sqrt => f.write_str("sqrt"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_lists_valid_values() {
        assert_eq!(
            "every:2".parse::<Checkpointing>().unwrap(),
            Checkpointing::Every(2)
        );
        let e = "adamx".parse::<OptimizerKind>().unwrap_err();
        assert_eq!(e.to_string(), "unknown optimizer \"adamx\": valid values are adamw, adam, sgd, sgd-momentum, adafactor");
        assert!("every:0".parse::<Checkpointing>().is_err());
        assert!("fp64"
            .parse::<Precision>()
            .unwrap_err()
            .to_string()
            .contains("fp32, bf16, amp-fp16, amp-bf16"));
    }

    #[test]
    fn names_match_the_fixtures() {
        let mut r = Recipe::new(2, 128);
        r.checkpointing = Checkpointing::Full;
        r.accum = 2;
        assert_eq!(r.name(), "fp32-adamw-ckptfull-accum2");
    }
}
