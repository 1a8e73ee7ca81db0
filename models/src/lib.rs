//! # vramsim-models
//!
//! Model graphs lowered to allocation traces: what a PyTorch training step asks of GPU memory,
//! op by op, without PyTorch or a GPU.
//!
//! ```
//! use vramsim_models::{lower, zoo, Recipe};
//! let recipe = Recipe::new(2, 128); // batch 2, seq 128, fp32, AdamW (foreach), 2 iterations
//! let graph = zoo::build("gpt2", &recipe).unwrap();
//! let trace = lower(&graph, &recipe).unwrap();
//! assert_eq!(graph.param_count(), 124_439_808);
//! println!("peak requested: {} bytes", vramsim_models::peak_requested(&trace));
//! ```
//!
//! Pieces: [`graph`] (the IR: a petgraph DAG of ATen-level ops over tensors, with parameters,
//! buffers, module paths and checkpointable regions, and the [`GraphBuilder`] that writes it like
//! module code), [`ops`] (the op library and its shape rules, in-place ops included), [`lower()`]
//! (the step as eager PyTorch runs it: forward, autograd engine, checkpointing, optimizer; the
//! autograd memory rules of each op live in `lower/fwd.rs` and `lower/bwd.rs`), [`recipe`]
//! ([`Recipe`]: batch, precision, optimizer, checkpointing, accumulation, attention, target GPU),
//! [`sdpa`] (PyTorch's SDPA backend choice and its reasons), [`autocast`] (the CUDA autocast op
//! lists), [`zoo`] (MLP, ResNet-18/34/50/101/152, VGG-16, ViT-B/16, BERT-base/large,
//! GPT-2, LLaMA; [`zoo::Arch`]), [`hf`] (HuggingFace `config.json` import for the gpt2, bert,
//! llama, mistral and qwen2 families), [`breakdown`] (what is live at a trace's peak, by category
//! and module), [`layout`] (strides: which views alias, which reshapes copy).
//!
//! The rules follow PyTorch 2.x eager on CUDA (the checks ran against torch 2.15, torchvision 0.29
//! and transformers 5.23 on the meta device) and the model code of the reference implementations
//! named in each zoo entry. This crate deliberately knows nothing of allocators: it says what is
//! allocated and freed, in order; `vramsim-sim` says what the caching allocator makes of it. It
//! does not model kernel-internal workspaces (cuBLAS, cuDNN), which no dispatch mode sees either.

#![warn(missing_docs)]

pub mod autocast;
pub mod breakdown;
pub mod compact;
pub mod context_parallel;
pub mod dataparallel;
pub mod dtype;
pub mod finetune;
pub mod graph;
pub mod graph_template;
pub mod hf;
pub mod imported;
pub mod layout;
mod lower;
pub mod ops;
pub mod parallel;
pub mod pipeline;
pub mod recipe;
pub mod sdpa;
pub mod seq_template;
pub mod template;
pub mod zoo;

pub use breakdown::{peak_breakdown, peak_breakdown_until, PeakBreakdown};
pub use dtype::DType;
pub use graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind, ValueId, T};
pub use lower::{checkpointed_ranges, lower, selective_op_saves, LowerError};
pub use ops::{FusedSdpa, OpKind};
pub use parallel::{Offload, Parallel, PpLoop, PpSchedule, ReshardAfterForward, Shard};
pub use recipe::{parse_image_size, Head, Loss};
pub use recipe::{
    Attention, Checkpointing, Fidelity, OptimizerImpl, OptimizerKind, Precision, Recipe,
    RecipeError, Target, ZeroGrad,
};
pub use recipe::{
    CheckpointImpl, CublasWorkspaceMode, TorchVersion, TransformersVersion, Workspaces,
};
pub use sdpa::{SdpaBackend, SdpaCall};

use vramsim_traces::{Event, Trace};

/// The largest sum of live requested (unrounded) bytes over the trace: PyTorch's
/// `requested_bytes.all.peak`. Frees of unknown ids are ignored.
pub fn peak_requested(trace: &Trace) -> u64 {
    peak_requested_events(&trace.events)
}

/// [`peak_requested`] over a slice of events.
pub fn peak_requested_events(events: &[Event]) -> u64 {
    let mut live: std::collections::HashMap<&vramsim_traces::AllocId, u64> =
        std::collections::HashMap::new();
    let (mut cur, mut peak) = (0u64, 0u64);
    for e in events {
        match e {
            Event::Alloc { id, size, .. } => {
                live.insert(id, *size);
                cur += size;
                peak = peak.max(cur);
            }
            Event::Free { id } => {
                if let Some(s) = live.remove(id) {
                    cur -= s;
                }
            }
            _ => {}
        }
    }
    peak
}
