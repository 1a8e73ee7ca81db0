//! Import of a HuggingFace `config.json`: the `gpt2`, `bert`, `llama`, `mistral` and `qwen2`
//! families (by `model_type`), mapped onto the zoo's builders ([`Arch`]) as transformers 5.23 builds
//! them (`GPT2LMHeadModel`, `BertForMaskedLM`, `LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`).
//!
//! ```
//! let text = r#"{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
//!   "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
//!   "vocab_size": 32000, "max_position_embeddings": 2048, "hidden_act": "silu"}"#;
//! let cfg = vramsim_models::hf::parse(text, &Default::default()).unwrap();
//! let graph = cfg.arch.build(&vramsim_models::Recipe::new(1, 128)).unwrap();
//! assert_eq!(graph.param_count(), 1_100_048_384);
//! ```
//!
//! # Which fields count
//!
//! Every field of the file falls in one of three sets, per family:
//!
//! * **mapped**: the shape fields (`hidden_size`, `intermediate_size`, `num_hidden_layers`,
//!   `num_attention_heads`, `num_key_value_heads`, `vocab_size`, `max_position_embeddings`, `head_dim`,
//!   GPT-2's `n_*` names), `tie_word_embeddings`, the activation (`hidden_act`, GPT-2's
//!   `activation_function`: `silu`, `gelu`, `gelu_new`, `gelu_pytorch_tanh`), the dropout
//!   probabilities (GPT-2's `embd_pdrop`, `attn_pdrop`, `resid_pdrop`; BERT's `hidden_dropout_prob`,
//!   `attention_probs_dropout_prob`; the LLaMA family's `attention_dropout`: 0 means no dropout op at
//!   all, since ATen's `dropout` returns its input for `p == 0` and runs `native_dropout` with its
//!   mask only for `0 < p < 1` on CUDA), the biases (`attention_bias`, `mlp_bias`; Qwen2's q/k/v
//!   biases are built in) and the attention window (Mistral's `sliding_window`). A value the
//!   lowering cannot honour is an error naming the field: an unknown activation,
//!   `pretraining_tp` ≠ 1, `position_embedding_type` other than `absolute`, `chunk_size_feed_forward`
//!   ≠ 0 for BERT, `is_decoder`/`add_cross_attention`/`is_encoder_decoder` true, Qwen2's
//!   `use_sliding_window` true (two masks of different kinds), a `rope_scaling`
//!   type outside `default`, `linear`, `dynamic`, `yarn`, `longrope`, `llama3`, `proportional`.
//! * **memory-neutral, ignored** (an explicit allow-list): token ids, `initializer_range`, the norms'
//!   epsilons (`rms_norm_eps`, `layer_norm_eps`, `layer_norm_epsilon`), `rope_theta` and the rope
//!   scaling parameters (all rope types only rescale the `[D/2]` frequency buffer), generation
//!   settings, labels, `architectures`, versions, GPT-2's `summary_*` (double-heads only) and
//!   `n_ctx`, `gradient_checkpointing` and
//!   `attn_implementation` (the recipe decides both), and `torch_dtype`/`dtype`, which is
//!   informational: the recipe's precision decides ([`HfConfig::torch_dtype`] keeps it).
//! * **`use_cache`** (GPT-2, LLaMA family; transformers' default True) is kept in
//!   [`HfConfig::use_cache`]: the decoders' forward then builds a `DynamicCache` even in training
//!   (unless gradient checkpointing is on), see [`crate::zoo::use_cache`]. BERT reads it only as a
//!   decoder, which the import refuses.
//! * **anything else** is an error naming every such field ([`HfError::UnknownFields`]), because a
//!   field vramsim does not know may change memory (`quantization_config`, `num_experts`, ...).
//!   [`ImportOptions::allow_unknown_fields`] turns that error into warnings
//!   ([`HfConfig::warnings`]) for a user who knows the fields are harmless.
//!
//! Mistral's `sliding_window` changes no allocation with eager attention (the window mask is the
//! same `[B, 1, S, S]` additive mask as the causal one) and none with SDPA while `seq` fits in the
//! window (HF then drops the mask and runs the causal kernel); with SDPA and a longer `seq`, HF
//! passes an explicit mask and PyTorch leaves the fused causal kernel, which is not modelled:
//! [`Arch::build`] says so (with FlashAttention-2 proper the window only changes compute).

use crate::zoo::bert::BertConfig;
use crate::zoo::gpt2::GptConfig;
use crate::zoo::llama::LlamaConfig;
use crate::zoo::{Activation, Arch};
use serde_json::{Map, Value};
use std::borrow::Cow;
use std::path::Path;

/// The `model_type`s this module imports.
pub const FAMILIES: [&str; 5] = ["gpt2", "bert", "llama", "mistral", "qwen2"];

/// How to import.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// The model's name in reports (default: `_name_or_path`, else `hf-MODEL_TYPE`).
    pub name: Option<String>,
    /// Warn about fields outside the allow-lists instead of failing.
    pub allow_unknown_fields: bool,
}

/// An imported configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// The architecture, ready to build.
    pub arch: Arch,
    /// `model_type`.
    pub model_type: String,
    /// `torch_dtype` (or transformers 5's `dtype`): the dtype the weights were saved in. The
    /// recipe's precision decides the lowering.
    pub torch_dtype: Option<String>,
    /// Fields outside the allow-lists, when [`ImportOptions::allow_unknown_fields`] let them pass.
    pub warnings: Vec<String>,
    /// `use_cache`; `None` when the file has none (transformers' default, True). A recipe takes
    /// it as [`crate::Recipe::use_cache`] unless the loop passes its own.
    pub use_cache: Option<bool>,
}

/// Why a `config.json` could not be imported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HfError {
    /// The file could not be read.
    #[error("cannot read {path}: {msg}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        msg: String,
    },
    /// Not JSON.
    #[error("not valid JSON at line {line}, column {column}: {msg}")]
    Json {
        /// Line (1-based).
        line: usize,
        /// Column (1-based).
        column: usize,
        /// What is wrong.
        msg: String,
    },
    /// The document is not a JSON object.
    #[error("a config.json is a JSON object, this is {0}")]
    NotAnObject(&'static str),
    /// No `model_type`.
    #[error("no \"model_type\" field: supported model types are {}", FAMILIES.join(", "))]
    MissingModelType,
    /// A `model_type` this module does not import.
    #[error("model_type {0:?} is not supported: supported model types are {families}", families = FAMILIES.join(", "))]
    UnknownModelType(String),
    /// A required field is absent.
    #[error("field {field:?} is missing (a {model_type} config needs it)")]
    Missing {
        /// The field.
        field: &'static str,
        /// The family.
        model_type: String,
    },
    /// A field has the wrong JSON type or an impossible value.
    #[error("field {field:?}: expected {expected}, found {found}")]
    Type {
        /// The field.
        field: String,
        /// What was expected.
        expected: &'static str,
        /// What the file holds.
        found: String,
    },
    /// A value vramsim's lowering cannot honour.
    #[error("field {field:?} = {value}: {msg}")]
    Unsupported {
        /// The field.
        field: String,
        /// Its value.
        value: String,
        /// Why, and what would be accepted.
        msg: String,
    },
    /// Fields outside the allow-lists.
    #[error("{model_type} config has fields vramsim does not know, which may change memory: {}; remove them, or allow them (`--hf-allow-unknown`) if they do not", fields.join(", "))]
    UnknownFields {
        /// The family.
        model_type: String,
        /// The fields.
        fields: Vec<String>,
    },
}

/// Reads and imports `path`.
pub fn read(path: &Path, opts: &ImportOptions) -> Result<HfConfig, HfError> {
    let text = std::fs::read_to_string(path).map_err(|e| HfError::Io {
        path: path.display().to_string(),
        msg: e.to_string(),
    })?;
    parse(&text, opts)
}

/// Imports the text of a `config.json`.
pub fn parse(text: &str, opts: &ImportOptions) -> Result<HfConfig, HfError> {
    let v: Value = serde_json::from_str(text).map_err(|e| HfError::Json {
        line: e.line(),
        column: e.column(),
        msg: e.to_string(),
    })?;
    let obj = match &v {
        Value::Object(o) => o,
        other => return Err(HfError::NotAnObject(json_kind(other))),
    };
    let model_type = match obj.get("model_type") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(HfError::Type {
                field: "model_type".into(),
                expected: "a string",
                found: other.to_string(),
            })
        }
        None => return Err(HfError::MissingModelType),
    };
    let mut r = Reader {
        obj,
        model_type: model_type.clone(),
        seen: Vec::new(),
    };
    let name: Cow<'static, str> = Cow::Owned(
        opts.name
            .clone()
            .or_else(|| {
                obj.get("_name_or_path")
                    .and_then(|v| v.as_str())
                    .map(String::from)
            })
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| format!("hf-{model_type}")),
    );
    let use_cache = match obj.get("use_cache") {
        None | Some(Value::Null) => None,
        Some(_) => Some(r.bool_or("use_cache", true)?),
    };
    let arch = match model_type.as_str() {
        "gpt2" => Arch::Gpt2(gpt2(&mut r, name)?),
        "bert" => Arch::Bert(bert(&mut r, name)?),
        "llama" | "mistral" | "qwen2" => Arch::Llama(llama(&mut r, name)?),
        other => return Err(HfError::UnknownModelType(other.to_string())),
    };
    let torch_dtype = ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| obj.get(*k).and_then(|v| v.as_str()).map(String::from));
    let mut unknown: Vec<String> = obj
        .keys()
        .filter(|k| !r.seen.contains(&k.as_str()) && !NEUTRAL.contains(&k.as_str()))
        .cloned()
        .collect();
    unknown.sort();
    let mut warnings = Vec::new();
    if !unknown.is_empty() {
        if !opts.allow_unknown_fields {
            return Err(HfError::UnknownFields {
                model_type,
                fields: unknown,
            });
        }
        for f in unknown {
            warnings.push(format!(
                "field {f:?} is not known to vramsim and was ignored (assumed memory-neutral)"
            ));
        }
    }
    Ok(HfConfig {
        arch,
        model_type,
        torch_dtype,
        warnings,
        use_cache,
    })
}

/// Fields that never change what a training step allocates (all families).
const NEUTRAL: &[&str] = &[
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "initializer_range",
    "initializer_factor",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "tokenizer_class",
    "task_specific_params",
    "id2label",
    "label2id",
    "problem_type",
    "num_labels",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "torchscript",
    "finetuning_task",
    "prefix",
    "max_length",
    "min_length",
    "do_sample",
    "num_beams",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "num_return_sequences",
    "early_stopping",
    "gradient_checkpointing",
    "attn_implementation",
    "_attn_implementation",
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rope_theta",
    "classifier_dropout",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "n_ctx",
];

/// Reads typed fields and remembers which it looked at.
struct Reader<'a> {
    obj: &'a Map<String, Value>,
    model_type: String,
    seen: Vec<&'static str>,
}

impl Reader<'_> {
    /// The first of `names` present (a field and its aliases), marking all of them as seen.
    fn get(&mut self, names: &[&'static str]) -> Option<(&'static str, &Value)> {
        self.seen.extend_from_slice(names);
        names
            .iter()
            .find_map(|n| self.obj.get(*n).filter(|v| !v.is_null()).map(|v| (*n, v)))
    }

    fn u64_opt(&mut self, names: &[&'static str]) -> Result<Option<u64>, HfError> {
        match self.get(names) {
            None => Ok(None),
            Some((n, v)) => match v.as_u64() {
                Some(x) if x > 0 => Ok(Some(x)),
                _ => Err(HfError::Type {
                    field: n.into(),
                    expected: "a positive integer",
                    found: v.to_string(),
                }),
            },
        }
    }

    fn u64(&mut self, names: &[&'static str]) -> Result<u64, HfError> {
        self.u64_opt(names)?.ok_or_else(|| HfError::Missing {
            field: names[0],
            model_type: self.model_type.clone(),
        })
    }

    fn bool_or(&mut self, name: &'static str, default: bool) -> Result<bool, HfError> {
        match self.get(&[name]) {
            None => Ok(default),
            Some((_, Value::Bool(b))) => Ok(*b),
            Some((_, v)) => Err(HfError::Type {
                field: name.into(),
                expected: "true or false",
                found: v.to_string(),
            }),
        }
    }

    /// A boolean that must have one value.
    fn require_bool(&mut self, name: &'static str, want: bool, msg: &str) -> Result<(), HfError> {
        let b = self.bool_or(name, want)?;
        if b != want {
            return Err(HfError::Unsupported {
                field: name.into(),
                value: b.to_string(),
                msg: msg.into(),
            });
        }
        Ok(())
    }

    /// A probability: 0 (no dropout op) or in (0, 1).
    fn prob(&mut self, name: &'static str, default: f64) -> Result<f64, HfError> {
        match self.get(&[name]) {
            None => Ok(default),
            Some((_, v)) => match v.as_f64() {
                Some(p) if (0.0..1.0).contains(&p) => Ok(p),
                _ => Err(HfError::Type {
                    field: name.into(),
                    expected: "a probability in [0, 1)",
                    found: v.to_string(),
                }),
            },
        }
    }

    fn activation(
        &mut self,
        names: &[&'static str],
        default: Activation,
    ) -> Result<Activation, HfError> {
        match self.get(names) {
            None => Ok(default),
            Some((n, Value::String(s))) => {
                Activation::from_hf(s).ok_or_else(|| HfError::Unsupported {
                    field: n.into(),
                    value: format!("{s:?}"),
                    msg: format!("activation not modelled; supported: {}", Activation::NAMES),
                })
            }
            Some((n, v)) => Err(HfError::Type {
                field: n.into(),
                expected: "an activation name",
                found: v.to_string(),
            }),
        }
    }

    /// `rope_scaling` / `rope_parameters`: every type rescales only the `[D/2]` frequencies.
    fn rope(&mut self) -> Result<(), HfError> {
        for field in ["rope_scaling", "rope_parameters"] {
            let Some((_, v)) = self.get(&[field]) else {
                continue;
            };
            let Value::Object(o) = v else {
                return Err(HfError::Type {
                    field: field.into(),
                    expected: "an object or null",
                    found: v.to_string(),
                });
            };
            let kind = o
                .get("rope_type")
                .or_else(|| o.get("type"))
                .and_then(|t| t.as_str())
                .unwrap_or("default");
            const TYPES: [&str; 7] = [
                "default",
                "linear",
                "dynamic",
                "yarn",
                "longrope",
                "llama3",
                "proportional",
            ];
            if !TYPES.contains(&kind) {
                return Err(HfError::Unsupported {
                    field: format!("{field}.rope_type"),
                    value: format!("{kind:?}"),
                    msg: format!(
                        "not known to vramsim; memory-neutral types: {}",
                        TYPES.join(", ")
                    ),
                });
            }
        }
        Ok(())
    }

    /// `chunk_size_feed_forward` (BERT chunks its feed-forward when it is not 0; others ignore it).
    fn no_chunking(&mut self, used: bool) -> Result<(), HfError> {
        if let Some((_, v)) = self.get(&["chunk_size_feed_forward"]) {
            if used && v.as_u64() != Some(0) {
                return Err(HfError::Unsupported {
                    field: "chunk_size_feed_forward".into(),
                    value: v.to_string(),
                    msg: "feed-forward chunking is not modelled (use 0)".into(),
                });
            }
        }
        Ok(())
    }

    fn encoder_only(&mut self) -> Result<(), HfError> {
        self.require_bool(
            "is_encoder_decoder",
            false,
            "encoder-decoder models are not modelled",
        )?;
        self.require_bool(
            "is_decoder",
            false,
            "only the encoder-only (MLM) model is modelled",
        )?;
        self.require_bool(
            "add_cross_attention",
            false,
            "cross-attention is not modelled",
        )
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn check_heads(hidden: u64, heads: u64, field: &'static str) -> Result<(), HfError> {
    if !hidden.is_multiple_of(heads) {
        return Err(HfError::Unsupported {
            field: field.into(),
            value: heads.to_string(),
            msg: format!("the hidden size {hidden} is not a multiple of it"),
        });
    }
    Ok(())
}

fn gpt2(r: &mut Reader, name: Cow<'static, str>) -> Result<GptConfig, HfError> {
    let hidden = r.u64(&["n_embd", "hidden_size"])?;
    let layers = r.u64(&["n_layer", "num_hidden_layers"])?;
    let heads = r.u64(&["n_head", "num_attention_heads"])?;
    check_heads(hidden, heads, "n_head")?;
    let cfg = GptConfig {
        name,
        hidden,
        layers,
        heads,
        vocab: r.u64(&["vocab_size"])?,
        positions: r.u64(&["n_positions", "max_position_embeddings"])?,
        inner: r.u64_opt(&["n_inner"])?.unwrap_or(hidden.saturating_mul(4)),
        embd_dropout: r.prob("embd_pdrop", 0.1)?,
        attn_dropout: r.prob("attn_pdrop", 0.1)?,
        resid_dropout: r.prob("resid_pdrop", 0.1)?,
        activation: r.activation(&["activation_function"], Activation::GeluNew)?,
        tie_embeddings: r.bool_or("tie_word_embeddings", true)?,
    };
    r.require_bool(
        "scale_attn_weights",
        true,
        "attention without the 1/sqrt(d) scaling op is not modelled",
    )?;
    r.require_bool(
        "scale_attn_by_inverse_layer_idx",
        false,
        "the extra per-layer division of the attention scores is not modelled",
    )?;
    r.require_bool(
        "reorder_and_upcast_attn",
        false,
        "the upcast baddbmm attention path is not modelled",
    )?;
    r.require_bool(
        "add_cross_attention",
        false,
        "cross-attention is not modelled",
    )?;
    r.require_bool(
        "is_encoder_decoder",
        false,
        "encoder-decoder models are not modelled",
    )?;
    r.no_chunking(false)?;
    Ok(cfg)
}

fn bert(r: &mut Reader, name: Cow<'static, str>) -> Result<BertConfig, HfError> {
    let hidden = r.u64(&["hidden_size"])?;
    let heads = r.u64(&["num_attention_heads"])?;
    check_heads(hidden, heads, "num_attention_heads")?;
    let cfg = BertConfig {
        name,
        hidden,
        layers: r.u64(&["num_hidden_layers"])?,
        heads,
        intermediate: r.u64(&["intermediate_size"])?,
        vocab: r.u64(&["vocab_size"])?,
        positions: r.u64(&["max_position_embeddings"])?,
        type_vocab: r.u64_opt(&["type_vocab_size"])?.unwrap_or(2),
        hidden_dropout: r.prob("hidden_dropout_prob", 0.1)?,
        attention_dropout: r.prob("attention_probs_dropout_prob", 0.1)?,
        activation: r.activation(&["hidden_act"], Activation::Gelu)?,
        tie_embeddings: r.bool_or("tie_word_embeddings", true)?,
    };
    if let Some((_, v)) = r.get(&["position_embedding_type"]) {
        if v.as_str() != Some("absolute") {
            return Err(HfError::Unsupported {
                field: "position_embedding_type".into(),
                value: v.to_string(),
                msg: "only \"absolute\" position embeddings are modelled".into(),
            });
        }
    }
    r.encoder_only()?;
    r.no_chunking(true)?;
    Ok(cfg)
}

fn llama(r: &mut Reader, name: Cow<'static, str>) -> Result<LlamaConfig, HfError> {
    let family = r.model_type.clone();
    let hidden = r.u64(&["hidden_size"])?;
    let heads = r.u64(&["num_attention_heads"])?;
    let head_dim = r.u64_opt(&["head_dim"])?;
    if head_dim.is_none() {
        check_heads(hidden, heads, "num_attention_heads")?;
    }
    let kv_heads = r.u64_opt(&["num_key_value_heads"])?.unwrap_or(heads);
    if !heads.is_multiple_of(kv_heads) {
        return Err(HfError::Unsupported {
            field: "num_key_value_heads".into(),
            value: kv_heads.to_string(),
            msg: format!("num_attention_heads {heads} is not a multiple of it"),
        });
    }
    let (reference, qkv_bias, o_bias, mlp_bias) = match family.as_str() {
        "llama" => {
            let ab = r.bool_or("attention_bias", false)?;
            let mb = r.bool_or("mlp_bias", false)?;
            (
                "transformers 5.23 LlamaForCausalLM (modeling_llama.py)",
                ab,
                ab,
                mb,
            )
        }
        "mistral" => (
            "transformers 5.23 MistralForCausalLM (modeling_mistral.py)",
            false,
            false,
            false,
        ),
        _ => (
            "transformers 5.23 Qwen2ForCausalLM (modeling_qwen2.py)",
            true,
            false,
            false,
        ),
    };
    let sliding_window = match family.as_str() {
        "mistral" => r.u64_opt(&["sliding_window"])?,
        "qwen2" => {
            // Qwen2 has a window only where `use_sliding_window` (layers from max_window_layers on).
            let _ = r.get(&["sliding_window", "max_window_layers"]);
            r.require_bool(
                "use_sliding_window",
                false,
                "Qwen2 with sliding-window layers builds two masks (full and windowed), which is not modelled",
            )?;
            if let Some((_, Value::Array(types))) = r.get(&["layer_types"]) {
                if types.iter().any(|t| t.as_str() != Some("full_attention")) {
                    return Err(HfError::Unsupported {
                        field: "layer_types".into(),
                        value: Value::Array(types.clone()).to_string(),
                        msg: "only \"full_attention\" layers are modelled for qwen2".into(),
                    });
                }
            }
            None
        }
        _ => None,
    };
    if family != "qwen2" {
        if let Some((_, v)) = r.get(&["layer_types"]) {
            let ok = v.as_array().is_some_and(|a| {
                a.iter().all(|t| {
                    t.as_str() == Some("full_attention")
                        || (family == "mistral" && t.as_str() == Some("sliding_attention"))
                })
            });
            if !ok {
                return Err(HfError::Unsupported {
                    field: "layer_types".into(),
                    value: v.to_string(),
                    msg: "mixed attention layer types are not modelled".into(),
                });
            }
        }
    }
    let cfg = LlamaConfig {
        name,
        reference,
        hidden,
        intermediate: r.u64(&["intermediate_size"])?,
        layers: r.u64(&["num_hidden_layers"])?,
        heads,
        kv_heads,
        vocab: r.u64(&["vocab_size"])?,
        positions: r.u64(&["max_position_embeddings"])?,
        tie_embeddings: r.bool_or("tie_word_embeddings", false)?,
        head_dim,
        qkv_bias,
        o_bias,
        mlp_bias,
        activation: r.activation(&["hidden_act"], Activation::Silu)?,
        sliding_window,
        attention_dropout: r.prob("attention_dropout", 0.0)?,
    };
    if let Some(tp) = r.u64_opt(&["pretraining_tp"])? {
        if tp != 1 {
            return Err(HfError::Unsupported {
                field: "pretraining_tp".into(),
                value: tp.to_string(),
                msg: "split projections (tensor-parallel emulation) are not modelled (use 1)"
                    .into(),
            });
        }
    }
    r.require_bool(
        "use_mrope",
        false,
        "multimodal rotary embeddings are not modelled",
    )?;
    r.require_bool(
        "is_encoder_decoder",
        false,
        "encoder-decoder models are not modelled",
    )?;
    r.rope()?;
    r.no_chunking(false)?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_type_lists_the_supported_ones() {
        let e = parse(r#"{"model_type": "t5"}"#, &ImportOptions::default()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "model_type \"t5\" is not supported: supported model types are gpt2, bert, llama, mistral, qwen2"
        );
    }

    #[test]
    fn json_errors_say_where() {
        let e = parse("{\n  \"model_type\": ,\n}", &ImportOptions::default()).unwrap_err();
        assert!(matches!(e, HfError::Json { line: 2, .. }), "{e}");
    }
}
