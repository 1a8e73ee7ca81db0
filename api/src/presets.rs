//! `--recipe peft-lora|torchtune-qlora|litgpt-lora`: the defaults of the fine-tuning tools people
//! use, each from the file named below. A preset sets a field only where its option was left at
//! `predict`'s default (an explicit `--lora`, `--quant`, `--precision`, ... wins); what a tool
//! does that vramsim does not model is returned as a note.

use anyhow::{bail, Result};
use vramsim_models::finetune::{LoraConfig, LoraTargets, Quant};
use vramsim_models::zoo::heads::Family;
use vramsim_models::zoo::Arch;
use vramsim_models::{Checkpointing, OptimizerImpl, OptimizerKind, Precision, Recipe};

/// A fine-tuning tool's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// HuggingFace PEFT's `LoraConfig()` (`peft/tuners/lora/config.py`): r 8, lora_alpha 8,
    /// dropout 0, `target_modules=None` → the model type's entry of
    /// `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING` (`peft/utils/constants.py`: llama,
    /// mistral, qwen2 `q_proj, v_proj`; gpt2 `c_attn`; bert `query, value`), float32 adapters
    /// (`autocast_adapter_dtype=True`).
    PeftLora,
    /// torchtune's `recipes/configs/llama3_1/8B_qlora_single_device.yaml`: `qlora_llama3_1_8b`
    /// (NF4 base weights via torchao, block 64 with 8-bit scalers per 256 blocks: the `nf4-dq`
    /// layout), LoRA on q, k, v, output projections and the MLP, rank 8, alpha 16, dropout 0,
    /// adapters in the model dtype; `dtype: bf16`, `enable_activation_checkpointing: True`,
    /// `torch.optim.AdamW(fused=True)`, `gradient_accumulation_steps: 16`.
    TorchtuneQlora,
    /// LitGPT's `finetune/lora.py` (Lightning-AI/litgpt @8641822, the script of its resource
    /// tables): `lora_r=8, lora_alpha=16, lora_dropout=0.05`, query and value only,
    /// `--precision bf16-true` (adapters in bf16 too), `torch.optim.AdamW`, no checkpointing.
    LitgptLora,
}

impl Preset {
    /// Every preset, in `--recipe` order.
    pub const ALL: [Preset; 3] = [Preset::PeftLora, Preset::TorchtuneQlora, Preset::LitgptLora];

    /// The `--recipe` name.
    pub fn name(self) -> &'static str {
        match self {
            Preset::PeftLora => "peft-lora",
            Preset::TorchtuneQlora => "torchtune-qlora",
            Preset::LitgptLora => "litgpt-lora",
        }
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown --recipe {s:?}: use one of {}",
                    Preset::ALL.map(|p| p.name()).join(", ")
                )
            })
    }
}

/// PEFT's default LoRA targets of a model family (`peft/utils/constants.py`).
fn peft_targets(arch: &Arch) -> Result<Vec<String>> {
    let names: &[&str] = match arch.family() {
        Some(Family::Llama) => &["q_proj", "v_proj"],
        Some(Family::Gpt2) => &["c_attn"],
        Some(Family::Bert) => &["query", "value"],
        _ => bail!(
            "--recipe peft-lora: PEFT has no default target_modules for {} (it raises \"Please specify `target_modules` in `peft_config`\"): give --lora targets=...",
            arch.name()
        ),
    };
    Ok(names.iter().map(|s| s.to_string()).collect())
}

/// The query and value projections of a model family, under its module names.
fn query_value(arch: &Arch, preset: Preset) -> Result<Vec<String>> {
    Ok(match arch.family() {
        Some(Family::Llama) => vec!["q_proj".into(), "v_proj".into()],
        Some(Family::Bert) => vec!["query".into(), "value".into()],
        // GPT-2's fused c_attn holds q, k and v.
        Some(Family::Gpt2) => vec!["c_attn".into()],
        _ => bail!(
            "--recipe {preset}: {} has no attention projections to adapt",
            arch.name()
        ),
    })
}

/// What each option's default is in `predict` (a preset only fills options left there).
pub struct Defaults {
    /// `--precision` was left at fp32.
    pub precision: bool,
    /// `--optimizer` was left at adamw.
    pub optimizer: bool,
    /// `--optimizer-impl` was left at foreach.
    pub optimizer_impl: bool,
    /// `--checkpoint` was left at none.
    pub checkpoint: bool,
    /// `--accum` was left at 1.
    pub accum: bool,
}

/// Applies `preset` to `recipe` for `arch` where the options were left at their defaults.
/// Returns notes on what the tool does that the step does not model.
pub fn apply(
    preset: Preset,
    arch: &Arch,
    recipe: &mut Recipe,
    d: &Defaults,
) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    match preset {
        Preset::PeftLora => {
            if recipe.lora.is_none() {
                recipe.lora = Some(LoraConfig {
                    targets: LoraTargets::Names(peft_targets(arch)?),
                    ..LoraConfig::default()
                });
            }
        }
        Preset::TorchtuneQlora => {
            if arch.family() != Some(Family::Llama) {
                bail!(
                    "--recipe torchtune-qlora: torchtune's QLoRA builders are LLaMA models; {} is not one",
                    arch.name()
                );
            }
            if recipe.lora.is_none() {
                recipe.lora = Some(LoraConfig {
                    r: 8,
                    alpha: 16.0,
                    dropout: 0.0,
                    targets: LoraTargets::Names(
                        [
                            "q_proj",
                            "k_proj",
                            "v_proj",
                            "o_proj",
                            "gate_proj",
                            "up_proj",
                            "down_proj",
                        ]
                        .map(String::from)
                        .to_vec(),
                    ),
                    dtype: None,
                });
            }
            if recipe.quant.is_none() {
                recipe.quant = Some(Quant::Nf4Dq);
            }
            if d.precision {
                recipe.precision = Precision::Bf16;
            }
            if d.checkpoint {
                recipe.checkpointing = Checkpointing::Full;
            }
            if d.optimizer_impl && d.optimizer {
                recipe.optimizer = OptimizerKind::AdamW;
                recipe.optimizer_impl = OptimizerImpl::Fused;
            }
            if d.accum {
                recipe.accum = 16;
            }
            notes.push("torchtune-qlora: torchtune's CEWithChunkedOutputLoss (logits in 8 chunks) is not modelled (HF's loss is: float32 logits of the whole sequence); torchao's NF4 dequantization is modelled as bitsandbytes' nf4-dq; the model code is transformers', which under checkpointing marks the embedding output as requiring grad where torchtune does not".into());
        }
        Preset::LitgptLora => {
            if recipe.lora.is_none() {
                recipe.lora = Some(LoraConfig {
                    r: 8,
                    alpha: 16.0,
                    dropout: 0.05,
                    targets: LoraTargets::Names(query_value(arch, preset)?),
                    dtype: None,
                });
            }
            if d.precision {
                recipe.precision = Precision::Bf16;
            }
            if recipe.quant.is_some() && d.optimizer {
                // finetune/lora.py: bnb.optim.PagedAdamW when quantizing.
                recipe.optimizer = OptimizerKind::PagedAdamW;
            }
            notes.push("litgpt-lora: LitGPT's chunked cross-entropy (lm_head_chunk_size=128) and its own GPT modules are not modelled (HF's model and loss are)".into());
        }
    }
    Ok(notes)
}
