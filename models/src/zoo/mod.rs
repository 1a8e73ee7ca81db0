//! The model zoo: graphs of the models users train, each following a named reference
//! implementation.
//!
//! | name | reference |
//! | --- | --- |
//! | `mlp` | `nn.Sequential(Linear(1024,4096), ReLU, Linear(4096,4096), ReLU, Linear(4096,4096), ReLU, Linear(4096,1000))` |
//! | `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl` | transformers 5.23 `GPT2LMHeadModel` |
//! | `tinyllama-1.1b`, `llama2-7b`, `llama2-13b`, `llama2-70b`, `llama3-8b` | transformers 5.23 `LlamaForCausalLM` |
//!
//! Still to come (issue 4): ResNet-18/34/50/101/152, VGG-16, ViT-B/16, BERT-base/large, and HF
//! `config.json` import.

pub mod gpt2;
pub mod llama;
pub mod mlp;
pub mod nn;

use crate::graph::{Graph, GraphError};
use crate::ops::SdpaBackend;
use crate::recipe::{Attention, Recipe};
pub use nn::AttnImpl;

/// Every zoo name, in the order `vramsim predict` lists them.
pub const NAMES: [&str; 10] = [
    "mlp",
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "tinyllama-1.1b",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
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
    /// The graph could not be built.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// The attention implementation a recipe asks for.
pub fn attn_impl(r: &Recipe) -> AttnImpl {
    match r.attention {
        Attention::Eager => AttnImpl::Eager,
        Attention::SdpaFlash => AttnImpl::Sdpa(SdpaBackend::Flash),
        Attention::SdpaMemEfficient => AttnImpl::Sdpa(SdpaBackend::MemEfficient),
    }
}

/// Builds zoo model `name` at the recipe's batch and sequence length.
pub fn build(name: &str, recipe: &Recipe) -> Result<Graph, ZooError> {
    if recipe.batch == 0 {
        return Err(ZooError::ZeroBatch);
    }
    let attn = attn_impl(recipe);
    let check_seq = |model: &str, max: u64| -> Result<(), ZooError> {
        if recipe.seq == 0 {
            return Err(ZooError::ZeroSeq(model.to_string()));
        }
        if recipe.seq > max {
            return Err(ZooError::SeqTooLong {
                model: model.to_string(),
                seq: recipe.seq,
                max,
            });
        }
        Ok(())
    };
    let gpt = |c: &gpt2::GptConfig| -> Result<Graph, ZooError> {
        check_seq(c.name, c.positions)?;
        Ok(gpt2::gpt2(c, recipe.batch, recipe.seq, attn)?)
    };
    let lla = |c: &llama::LlamaConfig| -> Result<Graph, ZooError> {
        check_seq(c.name, c.positions)?;
        Ok(llama::llama(c, recipe.batch, recipe.seq, attn)?)
    };
    match name {
        "mlp" => Ok(mlp::mlp(&mlp::MLP_DIMS, recipe.batch)?),
        "gpt2" => gpt(&gpt2::GPT2),
        "gpt2-medium" => gpt(&gpt2::GPT2_MEDIUM),
        "gpt2-large" => gpt(&gpt2::GPT2_LARGE),
        "gpt2-xl" => gpt(&gpt2::GPT2_XL),
        "tinyllama-1.1b" => lla(&llama::TINYLLAMA),
        "llama2-7b" => lla(&llama::LLAMA2_7B),
        "llama2-13b" => lla(&llama::LLAMA2_13B),
        "llama2-70b" => lla(&llama::LLAMA2_70B),
        "llama3-8b" => lla(&llama::LLAMA3_8B),
        _ => Err(ZooError::Unknown(name.to_string())),
    }
}
