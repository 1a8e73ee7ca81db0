//! Fine-tuning: frozen parameters ([`freeze`]) and PEFT's LoRA adapters ([`lora`]), applied to a
//! built [`Graph`] as the recipe asks ([`apply`]).
//!
//! Both only change which parameters require grad and (LoRA) add ops and parameters; the
//! lowering's autograd rules do the rest exactly as PyTorch does: a frozen parameter has no
//! `AccumulateGrad`, no `.grad` and no optimizer state, an op records a node (and saves inputs)
//! only if some input requires grad, and a generated node saves an input only where another
//! input's gradient needs it (`derivatives.yaml`).

pub mod freeze;
pub mod lora;
pub mod lora_tp;
pub mod quant;
pub mod tp_frozen;

use crate::graph::Graph;
use crate::recipe::Recipe;

pub use freeze::{freeze, module_listing};
pub use lora::{apply_lora, apply_lora_tp, linear_modules, LoraConfig, LoraTargets};
pub use quant::{apply_quant, Quant};

/// Why a fine-tuning option cannot apply to a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FinetuneError {
    /// A `--freeze` pattern matches no parameter.
    #[error("--freeze {pattern}: matches no parameter of {model}; its modules with parameters are: {}", modules.join(", "))]
    FreezeNoMatch {
        /// Model.
        model: String,
        /// The pattern.
        pattern: String,
        /// The model's modules with parameters (numbered components condensed to ranges).
        modules: Vec<String>,
    },
    /// A `--lora` target matches no linear layer.
    #[error("--lora targets={target}: matches no linear layer of {model}; its linear layers are: {}", linear.join(", "))]
    LoraNoTarget {
        /// Model.
        model: String,
        /// The target name.
        target: String,
        /// The model's linear layers (numbered components condensed to ranges).
        linear: Vec<String>,
    },
    /// The model has no linear layer to adapt.
    #[error("{model} has no linear layer (nn.Linear or Conv1D): {what} needs one")]
    NoLinear {
        /// Model.
        model: String,
        /// The option (`--lora`, `--quant nf4`).
        what: String,
    },
    /// A fine-tuning option that the tensor-parallel split does not take as given.
    #[error("{model}: {msg}")]
    Tp {
        /// Model.
        model: String,
        /// Why, and what to give instead.
        msg: String,
    },
    /// The adapters' ops do not fit the layer's shapes.
    #[error(transparent)]
    Graph(#[from] crate::graph::GraphError),
}

/// Applies the recipe's fine-tuning options to `g`: quantized linear layers (as
/// `from_pretrained(quantization_config=...)` loads them), LoRA adapters (which freeze every base
/// parameter, as `get_peft_model` does), then the `--freeze` patterns; under `--tp --sp`, the
/// gathers of frozen column-parallel layers become Megatron's frozen-weight path
/// ([`tp_frozen`]).
pub fn apply(mut g: Graph, recipe: &Recipe) -> Result<Graph, FinetuneError> {
    if let Some(q) = recipe.quant {
        g = apply_quant(g, q, recipe.quant_storage)?;
    }
    if let Some(cfg) = &recipe.lora {
        // ZeRO-3 QLoRA: the engine casts PEFT's float32 adapters of the non-`zero.Init`
        // quantized model to the bf16/fp16 mode's dtype (`_cast_module_mixed_precision`), so
        // they train in the model's dtype.
        let mut cfg = cfg.clone();
        if crate::parallel::zero3_without_init(recipe)
            && crate::parallel::ds_param_dtype(recipe.precision).is_some()
        {
            cfg.dtype = None;
        }
        g = apply_lora_tp(g, &cfg, crate::zoo::tp::TpPlan::of(recipe))?;
    }
    if !recipe.freeze.is_empty() {
        freeze(&mut g, &recipe.freeze)?;
    }
    let plan = crate::zoo::tp::TpPlan::of(recipe);
    if plan.sp && (recipe.lora.is_some() || !recipe.freeze.is_empty()) {
        tp_frozen::frozen_gathers(&mut g);
    }
    Ok(g)
}
