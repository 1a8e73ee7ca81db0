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

/// Attention implementation of the HF models (`attn_implementation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Attention {
    /// `eager`: explicit matmuls, softmax and dropout.
    #[default]
    Eager,
    /// `sdpa` with the FlashAttention-2 backend.
    SdpaFlash,
    /// `sdpa` with the memory-efficient backend.
    SdpaMemEfficient,
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

/// The head an HF model is built with (which `*For...` class), `--head`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// Causal language modelling: `GPT2LMHeadModel`, `LlamaForCausalLM` (`ForCausalLMLoss`).
    Lm,
    /// Masked language modelling: `BertForMaskedLM`.
    MaskedLm,
    /// `*ForSequenceClassification` with `num_labels = N`: one prediction per sequence (BERT's
    /// pooler output, GPT-2/LLaMA's last non-padding token); MSE regression for N = 1, cross-entropy
    /// otherwise.
    SeqCls(u64),
    /// `*ForTokenClassification` with `num_labels = N`: one prediction per token.
    TokenCls(u64),
    /// The base model (`GPT2Model`, `LlamaModel`, `BertModel`) with the training loop's loss
    /// `last_hidden_state.mean()`.
    None,
}

/// How a language model's loss is computed from its logits, `--loss`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Loss {
    /// The model computes it from `labels` with HF's loss functions (`loss_utils.py`):
    /// `ForCausalLMLoss` upcasts `logits.float()` and shifts the labels; token classification of
    /// the generic (LLaMA) heads upcasts too; BERT's and GPT-2's classification heads call
    /// `CrossEntropyLoss` on the logits as they are.
    #[default]
    Hf,
    /// The training loop calls the model without labels and takes
    /// `F.cross_entropy(logits.view(-1, V), targets.view(-1))` on the logits as they are (no float
    /// copy, no shift: the targets come shifted, as nanoGPT's do).
    Plain,
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
    /// The head of an HF model (`--head`); `None`: the family's own (`lm` for GPT-2 and LLaMA,
    /// `masked-lm` for BERT).
    pub head: Option<Head>,
    /// How the loss is computed from the logits (`--loss`).
    pub loss: Loss,
    /// The training loop keeps the model's outputs (logits, loss) until the next forward returns
    /// and rebinds them (`--keep-outputs`).
    pub keep_outputs: bool,
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
            attention: Attention::Eager,
            fidelity: Fidelity::Cuda,
            target: Target::default(),
            image_size: None,
            num_classes: None,
            head: None,
            loss: Loss::Hf,
            keep_outputs: false,
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
        if let Some(Head::SeqCls(0) | Head::TokenCls(0)) = self.head {
            return Err(RecipeError::Invalid {
                field: "head",
                msg: "seq-cls:N and token-cls:N need N ≥ 1 labels".into(),
            });
        }
        if let Some((h, w)) = self.image_size {
            if h == 0 || w == 0 {
                return Err(RecipeError::Invalid {
                    field: "image-size",
                    msg: format!("{h}x{w}: both sides must be 1 or more"),
                });
            }
        }
        if self.num_classes == Some(0) {
            return Err(RecipeError::Invalid {
                field: "num-classes",
                msg: "must be 1 or more".into(),
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
named_enum!(Attention, "attention", "eager, sdpa-flash, sdpa-mem-efficient",
    ["eager" => Attention::Eager, "sdpa-flash" => Attention::SdpaFlash, "sdpa" => Attention::SdpaFlash,
     "sdpa-mem-efficient" => Attention::SdpaMemEfficient]);

named_enum!(Loss, "loss", "hf, plain", ["hf" => Loss::Hf, "plain" => Loss::Plain]);

impl FromStr for Head {
    type Err = RecipeError;
    fn from_str(s: &str) -> Result<Self, RecipeError> {
        let unknown = || RecipeError::Unknown {
            field: "head",
            value: s.to_string(),
            valid: "lm, masked-lm, seq-cls:N, token-cls:N, none",
        };
        match s {
            "lm" => Ok(Head::Lm),
            "masked-lm" => Ok(Head::MaskedLm),
            "none" => Ok(Head::None),
            _ => {
                let (kind, n) = s.split_once(':').ok_or_else(unknown)?;
                let n: u64 = n.trim().parse().map_err(|_| unknown())?;
                if n == 0 {
                    return Err(RecipeError::Invalid {
                        field: "head",
                        msg: format!(
                            "{s}: {kind}:N needs N ≥ 1 labels (valid heads: lm, masked-lm, seq-cls:N, token-cls:N, none)"
                        ),
                    });
                }
                match kind {
                    "seq-cls" => Ok(Head::SeqCls(n)),
                    "token-cls" => Ok(Head::TokenCls(n)),
                    _ => Err(unknown()),
                }
            }
        }
    }
}

impl fmt::Display for Head {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Head::Lm => f.write_str("lm"),
            Head::MaskedLm => f.write_str("masked-lm"),
            Head::SeqCls(n) => write!(f, "seq-cls:{n}"),
            Head::TokenCls(n) => write!(f, "token-cls:{n}"),
            Head::None => f.write_str("none"),
        }
    }
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Loss::Hf => "hf",
            Loss::Plain => "plain",
        })
    }
}

/// Parses `--image-size`: `H` (a square) or `HxW`, each side 1 or more.
pub fn parse_image_size(s: &str) -> Result<(u64, u64), RecipeError> {
    let invalid = |msg: &str| RecipeError::Invalid {
        field: "image-size",
        msg: format!("{s:?}: {msg}"),
    };
    let side = |t: &str| -> Result<u64, RecipeError> {
        match t.trim().parse::<u64>() {
            Ok(0) => Err(invalid("sides must be 1 or more")),
            Ok(n) => Ok(n),
            Err(_) => Err(invalid("expected H or HxW in pixels (e.g. 384 or 384x256)")),
        }
    };
    match s.split_once(['x', 'X', '×']) {
        Some((h, w)) => Ok((side(h)?, side(w)?)),
        None => {
            let n = side(s)?;
            Ok((n, n))
        }
    }
}

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
    fn heads_losses_and_image_sizes_parse_with_their_valid_values() {
        assert_eq!("seq-cls:2".parse::<Head>().unwrap(), Head::SeqCls(2));
        assert_eq!("token-cls:9".parse::<Head>().unwrap(), Head::TokenCls(9));
        assert_eq!("none".parse::<Head>().unwrap(), Head::None);
        assert_eq!(Head::SeqCls(3).to_string(), "seq-cls:3");
        let e = "seq-cls:0".parse::<Head>().unwrap_err().to_string();
        assert!(e.contains("N ≥ 1"), "{e}");
        let e = "classifier".parse::<Head>().unwrap_err().to_string();
        assert!(
            e.contains("lm, masked-lm, seq-cls:N, token-cls:N, none"),
            "{e}"
        );
        assert!("plain".parse::<Loss>().is_ok());
        assert!("mse"
            .parse::<Loss>()
            .unwrap_err()
            .to_string()
            .contains("hf, plain"));
        assert_eq!(parse_image_size("384").unwrap(), (384, 384));
        assert_eq!(parse_image_size("384x256").unwrap(), (384, 256));
        assert!(parse_image_size("0").is_err());
        assert!(parse_image_size("224x0").is_err());
        assert!(parse_image_size("big").is_err());
        let mut r = Recipe::new(1, 8);
        r.head = Some(Head::SeqCls(0));
        assert!(r.validate().is_err());
    }

    #[test]
    fn names_match_the_fixtures() {
        let mut r = Recipe::new(2, 128);
        r.checkpointing = Checkpointing::Full;
        r.accum = 2;
        assert_eq!(r.name(), "fp32-adamw-ckptfull-accum2");
    }
}
