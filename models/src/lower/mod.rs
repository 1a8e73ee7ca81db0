//! `lower(graph, recipe) -> Trace`: a training step as eager PyTorch runs it, allocation by
//! allocation.
//!
//! # How
//!
//! The lowering *executes* the graph symbolically, keeping what PyTorch keeps:
//!
//! * **Storages with reference counts.** Every tensor handle (a Python variable, a tensor saved for
//!   backward, a gradient waiting in the autograd engine's input buffer, `.grad`, the autocast cache,
//!   optimizer state) holds one reference on its storage; views share the storage of their base.
//!   An `alloc` event is written when a storage is created and a `free` when its last reference
//!   goes, which is when `c10::StorageImpl` dies and the caching allocator's `free` runs.
//! * **Forward.** Ops run in program order. A value's Python reference goes after its last use
//!   (or at the end of the module whose local holds it); what autograd saves stays. With
//!   `keep_outputs`, the training loop's names hold what [`Graph::kept_outputs`] lists (logits,
//!   loss) until the op of the next forward whose return rebinds them. When the forward ends,
//!   autograd nodes the loss does not reach (an unused pooler) die with the outputs that made
//!   them, and release what they saved.
//! * **Backward** runs the autograd engine's algorithm (`torch/csrc/autograd/engine.cpp`): one node
//!   per differentiable op, with the op's sequence number; a ready queue that always runs the ready
//!   node with the highest sequence number (`AccumulateGrad` first); per node, the formula of
//!   `derivatives.yaml` allocates its gradients (`bwd.rs`), `validate_outputs` reduces broadcast
//!   gradients and casts dtypes, then the node's incoming gradients and saved tensors are released,
//!   and its outputs go to the next nodes' input buffers, where several gradients for one input are
//!   summed (`InputBuffer::accumulate`). `AccumulateGrad` steals a gradient it holds the only
//!   reference to and that has the parameter's layout, else clones it; later gradients are added in
//!   place.
//! * **Checkpointing** is `torch.utils.checkpoint(use_reentrant=False)`: inside a checkpointed
//!   region nothing is saved but the region's inputs; the first backward node of the region that
//!   unpacks a saved tensor reruns the region's forward, keeping what it saves (stopping early once
//!   all are recomputed), and each recomputed tensor goes when its node has run. Under
//!   `selective-op` a selective-checkpoint policy also caches the outputs of the ops it saves
//!   through the forward and hands them back in the recomputation instead of rerunning them
//!   (`sac.rs`).
//! * **Optimizer** steps follow `torch/optim` (`optim.rs`).
//!
//! Allocation sizes are exact: `numel × element size`, unrounded, as PyTorch asks the allocator.

mod bwd;
mod dataparallel;
mod fsdp;
mod fwd;
mod offload;
mod optim;
mod parallel;
mod pipeline;
mod quant;
mod sac;
pub use sac::selective_op_saves;
mod cp;
mod ddp_sync;
mod tp;
mod zero3;

use crate::dtype::DType;
use crate::graph::{Graph, ModuleId, RegionKind, Source, ValueId};
use crate::layout::Layout;
use crate::ops::OpKind;
use crate::recipe::{
    Checkpointing, CublasWorkspaceMode, Fidelity, Precision, Recipe, RecipeError, TorchVersion,
    ZeroGrad,
};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::sync::Arc;
use vramsim_traces::{AllocId, Category, Event, Trace};

/// Why a graph could not be lowered under a recipe.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LowerError {
    /// The recipe is invalid on its own.
    #[error(transparent)]
    Recipe(#[from] RecipeError),
    /// The graph was built for another batch or sequence length.
    #[error("the graph of {model} was built for batch {graph_batch} × seq {graph_seq}, the recipe asks for batch {batch} × seq {seq}: build the graph with the recipe's shapes")]
    ShapeMismatch {
        /// Model name.
        model: String,
        /// Graph batch.
        graph_batch: u64,
        /// Graph sequence length.
        graph_seq: u64,
        /// Recipe batch.
        batch: u64,
        /// Recipe sequence length.
        seq: u64,
    },
    /// A tensor's byte size is beyond [`crate::graph::MAX_TENSOR_BYTES`].
    #[error("tensor {what} of shape {shape:?} would take more than 2^50 bytes (1 PiB), more than any device holds")]
    Overflow {
        /// Which tensor.
        what: String,
        /// Its shape.
        shape: Vec<u64>,
    },
    /// The graph has no output to differentiate.
    #[error("the graph of {0} has no output (set one with GraphBuilder::set_output)")]
    NoOutput(String),
    /// The graph's ops are not in a topological order.
    #[error("the graph of {0} is not a DAG in program order (op {1} uses a value made later)")]
    NotTopological(String, usize),
    /// A DataParallel layout over two or more devices got a graph it cannot run as it is (the
    /// training loop's criterion is outside the model: the device's graph must come from
    /// `dataparallel::device_graph`).
    #[error("{0}")]
    DataParallel(String),
    /// A pipeline layout the model or the schedule cannot take (`crate::pipeline`), or a graph
    /// that is not a pipeline rank's.
    #[error(transparent)]
    Pipeline(#[from] crate::pipeline::PipelineError),
}

/// A handle on a tensor: its layout, dtype, storage, and where its gradient goes.
#[derive(Clone, Debug)]
pub(crate) struct Rt {
    pub layout: Layout,
    pub dtype: DType,
    pub st: u32,
    pub edge: Option<Edge>,
    /// A view made by a view op (`Lowering::view`): PyTorch keeps its base alive
    /// (`ViewInfo::base_`), so its storage has another holder while it lives.
    pub view: bool,
}

impl Rt {
    pub fn shape(&self) -> &[u64] {
        &self.layout.shape
    }
    pub fn requires_grad(&self) -> bool {
        self.edge.is_some()
    }
}

/// An autograd edge: the node that receives a gradient, and which of its inputs it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Edge {
    pub node: u32,
    pub nr: u32,
}

/// Shape and dtype of a tensor as a node remembers it (`InputMetadata`).
#[derive(Clone, Debug)]
pub(crate) struct Meta {
    pub layout: Layout,
    pub dtype: DType,
}

/// What kind of allocation a storage is, to choose its category at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Param,
    Buffer,
    Input,
    /// Made in a forward or a recomputation: an activation if still alive at its end.
    Pending,
    Activation,
    Temporary,
    OptimState,
    /// A cuBLAS / cuBLASLt / cuDNN workspace.
    Workspace,
    Other,
    /// A buffer of a collective (DDP bucket, ZeRO IPG buffer).
    Comm,
}

/// `Storage::ev` of a 0-byte storage, which has no event.
const NO_EVENT: u32 = u32::MAX;

struct Storage {
    size: u64,
    refs: u32,
    ev: u32,
    kind: Kind,
    grad: bool,
    live: bool,
}

/// The backward function of a node.
#[derive(Clone, Debug)]
pub(crate) enum NodeKind {
    /// The backward of a graph op (or a synthetic one).
    Op(OpKind),
    /// `AccumulateGrad` of parameter `usize`.
    Accumulate(usize),
    /// `ToCopyBackward0` of an autocast cast.
    Cast,
    /// `CloneBackward0` + `UnsafeViewBackward0` of a reshape that copied (`grad.reshape(sizes)`).
    ReshapeCopy,
    /// `CheckpointFunctionBackward` of reentrant checkpoint region `u32` (its `saved` are the
    /// region's inputs, `ctx.save_for_backward`).
    Reentrant(u32),
    /// `AccumulateGrad` of a detached input of a reentrant recomputation: its `.grad` goes to
    /// [`Lowering::leaf_grads`] slot `u32`.
    Leaf(u32),
}

pub(crate) struct Node {
    pub seq: u64,
    pub kind: NodeKind,
    pub ins: Vec<Option<Meta>>,
    pub outs: Vec<Meta>,
    pub next: Vec<Option<Edge>>,
    pub saved: Vec<Rt>,
    pub ckpt: Option<u32>,
    pub module: ModuleId,
}

/// A checkpointed op range and its inputs.
struct CkRange {
    start: usize,
    end: usize,
    inputs: Vec<ValueId>,
    /// Values made in the region and used after it (the region function's return).
    outputs: Vec<ValueId>,
}

/// A reentrant checkpoint region whose no-grad forward is running.
struct ReentrantFwd {
    range: u32,
    /// `ctx.save_for_backward(*tensor_inputs)`.
    inputs: Vec<(ValueId, Rt)>,
}

/// One `torch.utils.checkpoint` call of one forward (`_CheckpointFrame`).
struct Frame {
    range: u32,
    inputs: Vec<(ValueId, Rt)>,
    /// Nodes of the region whose saved tensors the frame stands for, not yet run.
    pending: u32,
    recomputed: bool,
    /// Saved tensors recomputed for each node.
    saved: FxHashMap<u32, Vec<Rt>>,
    /// Node made by each op of the region in the first forward (ops that save something).
    op_nodes: FxHashMap<usize, u32>,
    /// The last op of the region that saves a tensor: recomputation stops after it.
    last_saving_op: Option<usize>,
    /// The selective-checkpoint contexts' storage and policy state (`selective-op` only).
    sac: Option<sac::SacStorage>,
}

/// The lowering state: storages, events, autograd nodes.
pub(crate) struct Lowering<'g> {
    pub g: &'g Graph,
    pub r: &'g Recipe,
    pub param_dtype: DType,
    pub autocast: Option<DType>,
    pub grad_mode: bool,
    storages: Vec<Storage>,
    events: Vec<Event>,
    tags: Vec<Arc<str>>,
    /// The tags made so far, by module and op: a step makes the same tags again in every
    /// micro-batch and iteration, and shares them (each event's tag an `Arc` of one string).
    tag_cache: FxHashMap<u32, FxHashMap<Box<str>, Arc<str>>>,
    next_id: u64,
    pub nodes: Vec<Node>,
    seq: u64,
    /// Python references of graph values in the running forward.
    vals: Vec<Option<Rt>>,
    params: Vec<Rt>,
    param_grads: Vec<Option<Rt>>,
    acc_nodes: Vec<Option<u32>>,
    /// Autocast's cast cache (`autocast_mode.cpp` `cached_casts`), keyed by parameter index. PyTorch's
    /// map frees its entries together, in hash order, when the outermost autocast exits; a BTreeMap
    /// frees them in parameter order, so the lowering stays deterministic (the order of frees made at
    /// one point changes neither the allocator's final state nor its statistics).
    autocast_cache: BTreeMap<usize, Rt>,
    frames: Vec<Frame>,
    ck_ranges: Vec<CkRange>,
    /// Region index of each op when its region is checkpointed.
    op_region: Vec<Option<u32>>,
    active_frame: Option<u32>,
    recompute_saved: Option<FxHashMap<u32, Vec<Rt>>>,
    recompute_ops: Option<FxHashMap<usize, u32>>,
    /// The frame whose region is being recomputed.
    recompute_frame: Option<u32>,
    pub(crate) kind_now: Kind,
    /// Values released after each op (Python lifetimes).
    release_after: Vec<Vec<ValueId>>,
    pub live_bytes: u64,
    pub optim_state: Vec<Vec<Rt>>,
    pub optim_steps: u32,
    phase_info: Vec<serde_json::Value>,
    iteration: u32,
    micro: u32,
    pub scaler: Vec<Rt>,
    /// The autograd engine's device thread is running (backward, and the recomputation of
    /// checkpointed regions): GEMMs use that thread's cuBLAS handle.
    in_backward: bool,
    /// The cuBLAS workspace size (`CUBLAS_WORKSPACE_CONFIG` or the target's default).
    cublas_ws: u64,
    /// Persistent mode: whether the (main thread, backward thread) handle holds its workspace.
    ws_held: [bool; 2],
    /// PyTorch 1.10: whether the (main thread, backward thread) cuBLAS handle exists, with the
    /// workspace pool cuBLAS allocated for it.
    cublas_own_handles: [bool; 2],
    /// `cudnn.benchmark`: convolution configurations benchmarked already (`benchmark_cache` keys).
    conv_benchmarked: FxHashSet<String>,
    /// `--keep-outputs`: the previous step's outputs the training loop still holds, each with the
    /// op of the forward whose return rebinds its name.
    kept: Vec<(usize, Rt)>,
    /// The outputs of the running forward, kept once it ends.
    kept_next: Vec<(usize, Rt)>,
    /// The reentrant checkpoint region whose forward is running.
    reentrant_fwd: Option<ReentrantFwd>,
    /// A reentrant region's recomputation is running (the training loop's names are not involved).
    in_reentrant_recompute: bool,
    /// `.grad` of the detached inputs of reentrant recomputations, by [`NodeKind::Leaf`] slot.
    leaf_grads: Vec<Option<Rt>>,
    /// The region input values of each `CheckpointFunctionBackward` node, in `saved` order.
    reentrant_inputs: FxHashMap<u32, Vec<ValueId>>,
    /// The input embedding's output that `enable_input_require_grads` marks as requiring grad
    /// ([`input_grad_hook`]).
    input_grad_hook: Option<ValueId>,
    /// bitsandbytes' 8-bit quantization maps are on the device.
    bnb_qmaps: bool,
    /// Bytes of paged optimizer state (CUDA managed memory, outside the caching allocator).
    paged_bytes: u64,
    /// Buffers lent to each op's execution (`exec_graph_op`'s inputs, `exec`'s cast inputs and
    /// output shapes), kept empty between ops so that an op allocates no vectors for them.
    scratch_ins: Vec<Rt>,
    scratch_casted: Vec<Rt>,
    scratch_specs: Vec<(&'g [u64], crate::graph::DTypeSpec)>,
    /// The data-parallel mechanisms' state (`parallel.rs`).
    par: parallel::ParState,
    /// FSDP2's state (`fsdp.rs`).
    fsdp: fsdp::FsdpState,
    /// DataParallel's state on this device (`dataparallel.rs`).
    dp: dataparallel::DpState,
    /// DeepSpeed ZeRO-3's state (`zero3/`).
    zero3: zero3::Zero3State,
    /// Tensor/sequence parallelism's state (`tp.rs`).
    tp: tp::TpState,
    /// The pipeline rank's state (`pipeline.rs`).
    pp: pipeline::PpState,
}

/// `PreTrainedModel.enable_input_require_grads`: a forward hook on `get_input_embeddings()` that
/// calls `output.requires_grad_(True)`. transformers 5.23's `activation_checkpointing_enable`
/// (`modeling_utils.py`) registers it for every model whose `main_input_name` is `input_ids`, so
/// with gradient checkpointing a frozen embedding's output is a leaf that requires grad (its
/// `AccumulateGrad` keeps it and its `.grad` until the graph dies) and the frozen layers after it
/// keep their checkpoint inputs. Not in transformers 4.16. Returns the output of the embedding
/// lookup of the `input_ids` input.
fn input_grad_hook(g: &Graph, r: &Recipe) -> Option<ValueId> {
    if r.checkpointing == Checkpointing::None
        || r.inference
        || r.transformers_version == crate::recipe::TransformersVersion::V4_16
    {
        return None;
    }
    let ids = g.inputs.iter().find(|i| i.name == "input_ids")?.value;
    if r.parallel.tp < 2 {
        return g
            .ops
            .iter()
            .find(|op| op.kind == OpKind::Embedding && op.inputs.contains(&ids))
            .and_then(|op| op.outputs.first().copied());
    }
    // Under --tp the input embedding is `VocabParallelEmbedding` (the module of the first op
    // reading the ids: its range mask), which looks up the masked ids and returns the lookup
    // after `masked_fill_` and the all-reduce (or, LLaMA with --sp, the copy reduce-scattered):
    // the hook marks that output.
    let m = g.ops.iter().find(|op| op.inputs.contains(&ids))?.module;
    let k = g
        .ops
        .iter()
        .position(|op| op.kind == OpKind::Embedding && op.module == m)?;
    let mut out = *g.ops[k].outputs.first()?;
    {
        for op in &g.ops[k + 1..] {
            let follows = matches!(
                op.kind,
                OpKind::MaskedFillInplace | OpKind::TpComm(_) | OpKind::Clone { .. }
            );
            if op.module != g.ops[k].module || !follows || op.inputs.first() != Some(&out) {
                break;
            }
            out = *op.outputs.first()?;
        }
    }
    Some(out)
}

/// The tag of an allocation made by `name` in module `path`: `path:name`, or `name` at the root.
fn scoped_tag(path: &str, name: &str) -> Arc<str> {
    if path.is_empty() {
        return name.into();
    }
    let mut tag = String::with_capacity(path.len() + 1 + name.len());
    tag.push_str(path);
    tag.push(':');
    tag.push_str(name);
    tag.into()
}

/// Lowers a training step (or inference, per the recipe) of `graph` to an allocation trace.
///
/// The trace holds `recipe.iterations` optimizer steps of `recipe.accum` micro-batches each, with
/// `phase` markers `setup`, `forward`, `backward`, `optimizer` and `zero_grad` (the capture tool's
/// names; `meta.phases` gives the iteration and micro-batch of each marker), allocation categories
/// and tags (`module.path:aten.op`, `grad:param`, `exp_avg:param`).
pub fn lower(graph: &Graph, recipe: &Recipe) -> Result<Trace, LowerError> {
    recipe.validate()?;
    // DataParallel: the graph is the replica's, built for this device's chunk of the batch.
    if graph.batch != recipe.parallel.replica_batch(recipe.batch)
        || (graph.seq != 0 && graph.seq != recipe.parallel.local_seq(recipe.seq))
    {
        return Err(LowerError::ShapeMismatch {
            model: graph.name.clone(),
            graph_batch: graph.batch,
            graph_seq: graph.seq,
            batch: recipe.batch,
            seq: recipe.seq,
        });
    }
    check_graph(graph)?;
    dataparallel::check_graph(graph, recipe)?;
    if recipe.parallel.pp > 1 && !graph.meta.contains_key(crate::pipeline::META_KEY) {
        return Err(crate::pipeline::PipelineError::Invalid(format!(
            "{}: a pipeline rank lowers the graph of its stages: build it with vramsim_models::pipeline::rank_graph",
            graph.name
        ))
        .into());
    }
    let mut l = Lowering::new(graph, recipe);
    l.run()?;
    Ok(l.finish())
}

fn check_graph(g: &Graph) -> Result<(), LowerError> {
    if g.output.is_none() {
        return Err(LowerError::NoOutput(g.name.clone()));
    }
    for (i, op) in g.ops.iter().enumerate() {
        for &v in &op.inputs {
            if let Source::Op { op: p, .. } = g.values[v.0 as usize].source {
                if p.0 as usize >= i {
                    return Err(LowerError::NotTopological(g.name.clone(), i));
                }
            }
        }
    }
    // Byte sizes must stay within MAX_TENSOR_BYTES at the widest element type used (8 bytes).
    for (i, v) in g.values.iter().enumerate() {
        if !crate::graph::fits_in_memory(&v.shape) {
            return Err(LowerError::Overflow {
                what: format!("value {i}"),
                shape: v.shape.clone(),
            });
        }
    }
    Ok(())
}

impl<'g> Lowering<'g> {
    fn new(g: &'g Graph, r: &'g Recipe) -> Self {
        let param_dtype = match r.precision {
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
            _ => DType::F32,
        };
        // FSDP2's MixedPrecisionPolicy: the unsharded parameters, and so the compute, in its
        // param_dtype (the shards keep the model's dtype: `fsdp.rs`).
        let param_dtype = match (r.parallel.shard, r.parallel.fsdp_param_dtype) {
            (crate::parallel::Shard::Fsdp2, Some(d)) => d,
            _ => param_dtype,
        };
        let autocast = match r.precision {
            Precision::AmpFp16 => Some(DType::F16),
            Precision::AmpBf16 => Some(DType::BF16),
            _ => None,
        };
        // Python lifetimes: after its last use, or the end of the module holding it.
        let mut last: Vec<Option<usize>> = vec![None; g.values.len()];
        for (i, op) in g.ops.iter().enumerate() {
            for &v in &op.inputs {
                last[v.0 as usize] = Some(i);
            }
            for &v in &op.outputs {
                if last[v.0 as usize].is_none() {
                    last[v.0 as usize] = Some(i);
                }
            }
        }
        // Held locals that outlive their last use die at the end of their module's forward.
        // `held[v]`: the index in `g.holds` that keeps v longest (inner functions return first,
        // and their holds are registered first).
        let mut held: Vec<Option<usize>> = vec![None; g.values.len()];
        for (k, &(v, op)) in g.holds.iter().enumerate() {
            let e = &mut last[v.0 as usize];
            let end = op.0 as usize;
            if e.is_none_or(|x| x < end) {
                *e = Some(end);
                held[v.0 as usize] = Some(k);
            }
        }
        let mut release_after: Vec<Vec<ValueId>> = vec![Vec::new(); g.ops.len()];
        // What a pipeline stage's forward returns stays, like the graph's output.
        let stage_outputs: Vec<ValueId> = crate::pipeline::chunks(g)
            .iter()
            .map(|c| c.output)
            .collect();
        for (v, l) in last.iter().enumerate() {
            let val = &g.values[v];
            if !matches!(val.source, Source::Op { .. })
                || Some(ValueId(v as u32)) == g.output
                || stage_outputs.contains(&ValueId(v as u32))
            {
                continue;
            }
            if let Some(op) = l {
                release_after[*op].push(ValueId(v as u32));
            }
        }
        // Outputs of an op that nothing uses die with its returned tuple, then the Python
        // variables whose last use it was (`out = self.bn1(out)`: save_mean and save_invstd go,
        // then the old `out`), then, when the op ends a module's forward, its locals.
        for (i, rel) in release_after.iter_mut().enumerate() {
            rel.sort_by_key(|v| {
                match (g.values[v.0 as usize].source.clone(), held[v.0 as usize]) {
                    (Source::Op { op, .. }, None) if op.0 as usize == i => (0, 0),
                    (_, None) => (1, 0),
                    (_, Some(k)) => (2, k),
                }
            });
        }
        // Room for the events, storages and nodes a step usually makes (about six events per op
        // and micro-batch, eight per parameter and optimizer step), so that the vectors rarely
        // grow; more is allocated when needed.
        let micro_batches = r.iterations as usize * r.accum as usize;
        let events = (g.ops.len() * 6 * micro_batches + g.params.len() * 8 * r.iterations as usize)
            .min(1 << 24);
        let storages = events / 2 + g.params.len() + g.buffers.len();
        Lowering {
            g,
            r,
            param_dtype,
            autocast,
            grad_mode: !r.inference,
            storages: Vec::with_capacity(storages),
            events: Vec::with_capacity(events),
            tags: Vec::with_capacity(storages),
            tag_cache: FxHashMap::default(),
            next_id: 0,
            nodes: Vec::with_capacity(g.ops.len() + g.params.len()),
            seq: 0,
            vals: vec![None; g.values.len()],
            params: Vec::new(),
            param_grads: vec![None; g.params.len()],
            acc_nodes: vec![None; g.params.len()],
            autocast_cache: BTreeMap::new(),
            frames: Vec::new(),
            ck_ranges: Vec::new(),
            op_region: vec![None; g.ops.len()],
            active_frame: None,
            recompute_saved: None,
            recompute_ops: None,
            recompute_frame: None,
            kind_now: Kind::Other,
            release_after,
            live_bytes: 0,
            optim_state: vec![Vec::new(); g.params.len()],
            optim_steps: 0,
            phase_info: Vec::new(),
            iteration: 0,
            micro: 0,
            scaler: Vec::new(),
            in_backward: false,
            cublas_ws: r
                .workspaces
                .cublas_workspace_bytes(r.target.compute_capability)
                .0,
            ws_held: [false; 2],
            cublas_own_handles: [false; 2],
            conv_benchmarked: FxHashSet::default(),
            kept: Vec::new(),
            kept_next: Vec::new(),
            reentrant_fwd: None,
            in_reentrant_recompute: false,
            leaf_grads: Vec::new(),
            reentrant_inputs: FxHashMap::default(),
            input_grad_hook: input_grad_hook(g, r),
            bnb_qmaps: false,
            paged_bytes: 0,
            scratch_ins: Vec::new(),
            scratch_casted: Vec::new(),
            scratch_specs: Vec::new(),
            par: parallel::ParState::default(),
            fsdp: fsdp::FsdpState::default(),
            dp: dataparallel::DpState::default(),
            zero3: zero3::Zero3State::default(),
            tp: tp::TpState::default(),
            pp: pipeline::PpState::default(),
        }
    }

    // ------------------------------------------------------------------ library workspaces

    /// The workspace one GEMM takes from the caching allocator (`aten/src/ATen/cuda/CUDABlas.cpp`,
    /// `CublasHandlePool.cpp` of PyTorch 2.15), called after the GEMM's output is allocated. `lt`: the
    /// cuBLASLt path (`addmm` with a 1-D bias, `gemm_and_bias`); otherwise cuBLAS (`mm`, `bmm`, `addmm`
    /// without a fusable bias, every backward GEMM, whose beta is 0).
    ///
    /// * Per call (2.15's default): cuBLAS GEMMs take `getCurrentCUDABlasHandleWithWorkspace()`, which
    ///   allocates the chosen size and frees it when the scoped handle dies at the end of the call;
    ///   `CublasLtWorkspace` does the same with `getCUDABlasLtWorkspaceSize()` (`CUBLASLT_WORKSPACE_SIZE`,
    ///   1 MiB by default, not clamped:
    ///   Lt and cuBLAS are only unified when caching is on).
    /// * Persistent (`TORCH_CUBLAS_WORKSPACE_CACHE=1`, or ≤ 2.14): `setWorkspaceForHandle` allocates
    ///   the chosen size once per (handle, stream) and never frees it; handles are per thread, so the
    ///   forward (main thread) and the backward (the autograd engine's device thread) hold one each. A
    ///   cuBLASLt GEMM first on a handle allocates `max(Lt size, chosen size)` into the same map
    ///   (`getCUDABlasLtWorkspace`, unified), i.e. the same single workspace.
    ///
    /// The meta-device capture sees none of this: nothing under [`Fidelity::MetaCapture`].
    pub(crate) fn gemm_workspace(&mut self, lt: bool, m: ModuleId) {
        if self.r.fidelity == Fidelity::MetaCapture {
            return;
        }
        if self.r.torch_version == TorchVersion::V1_10 {
            // PyTorch 1.10 sets no workspace: cuBLAS uses its own pool, made when the thread's
            // handle is created (`cublasCreate` in `CublasHandlePool.cpp`), outside the allocator.
            self.cublas_own_handles[usize::from(self.in_backward)] = true;
            return;
        }
        let (size, name, persistent) = match self.r.workspaces.cublas_mode {
            CublasWorkspaceMode::PerCall if lt => (
                self.r.workspaces.cublaslt_workspace_bytes(),
                "cublaslt_workspace",
                false,
            ),
            CublasWorkspaceMode::PerCall => (self.cublas_ws, "cublas_workspace", false),
            CublasWorkspaceMode::Persistent => {
                let thread = usize::from(self.in_backward);
                if self.ws_held[thread] {
                    return;
                }
                self.ws_held[thread] = true;
                (self.cublas_ws, "cublas_workspace", true)
            }
        };
        if size == 0 {
            // CUBLAS_WORKSPACE_CONFIG=:0:0: the allocator hands out nothing for 0 bytes.
            return;
        }
        let tag = self.tag_of(m, name);
        let st = self.alloc_raw(size, Kind::Workspace, tag);
        if !persistent {
            self.release(st);
        }
    }

    /// `torch.backends.cudnn.benchmark = True`: the first convolution of a configuration (`key`: the
    /// pass and the shapes, dtypes and parameters of `CacheKeyWrapper`) runs `get_plans_from_find`, and
    /// `run_single_conv` (`native/cudnn/Conv_v8.cpp`, the default cuDNN v8 API) then calls
    /// `emptyCache()` because `_cudnn_get_conv_benchmark_empty_cache()` is true by default. The
    /// `benchmark_cache` is `thread_local`: the autograd engine's thread benchmarks the forward
    /// convolutions it recomputes for checkpointing again. The benchmark's own workspace (the largest
    /// candidate plan's, up to the largest cached block or the free memory) is cuDNN's and not
    /// modelled; it is freed before the `emptyCache`.
    pub(crate) fn conv_benchmark(&mut self, key: String) {
        if self.r.fidelity == Fidelity::MetaCapture || !self.r.workspaces.cudnn_benchmark {
            return;
        }
        let key = format!("thread{} {key}", u8::from(self.in_backward));
        if self.conv_benchmarked.insert(key) {
            self.events.push(Event::EmptyCache);
        }
    }

    // ------------------------------------------------------------------ storages and events

    /// Allocates a new storage for a tensor of `layout`/`dtype` (one reference, the caller's).
    pub(crate) fn alloc(&mut self, layout: Layout, dtype: DType, module: ModuleId, op: &str) -> Rt {
        let size = layout.numel() * dtype.size();
        let tag = self.tag_of(module, op);
        let st = self.alloc_raw(size, self.kind_now, tag);
        Rt {
            layout,
            dtype,
            st,
            edge: None,
            view: false,
        }
    }

    /// The tag of an allocation made by `op` in `module` ([`scoped_tag`]), shared with the earlier
    /// allocations of the same op in the same module.
    fn tag_of(&mut self, module: ModuleId, op: &str) -> Arc<str> {
        let by_op = self.tag_cache.entry(module.0).or_default();
        if let Some(tag) = by_op.get(op) {
            return tag.clone();
        }
        let tag = scoped_tag(&self.g.modules[module.0 as usize], op);
        by_op.insert(op.into(), tag.clone());
        tag
    }

    fn alloc_raw(&mut self, size: u64, kind: Kind, tag: Arc<str>) -> u32 {
        let st = self.storages.len() as u32;
        if size == 0 {
            // A 0-byte storage: the caching allocator hands out no block and the capture tool
            // records nothing, so no event either.
            self.tags.push(tag);
            self.storages.push(Storage {
                size,
                refs: 1,
                ev: NO_EVENT,
                kind,
                grad: false,
                live: true,
            });
            return st;
        }
        let ev = self.events.len() as u32;
        self.events.push(Event::Alloc {
            id: AllocId::Int(self.next_id),
            size,
            stream: 0,
            category: Category::Other,
            tag: None,
        });
        self.tags.push(tag);
        self.next_id += 1;
        self.live_bytes = self.live_bytes.saturating_add(size);
        self.storages.push(Storage {
            size,
            refs: 1,
            ev,
            kind,
            grad: false,
            live: true,
        });
        st
    }

    /// One more reference on `t`'s storage.
    pub(crate) fn dup(&mut self, t: &Rt) -> Rt {
        self.storages[t.st as usize].refs += 1;
        t.clone()
    }

    /// A view of `t` with another layout (one more reference on the storage).
    pub(crate) fn view(&mut self, t: &Rt, layout: Layout) -> Rt {
        self.storages[t.st as usize].refs += 1;
        Rt {
            layout,
            dtype: t.dtype,
            st: t.st,
            edge: t.edge,
            view: true,
        }
    }

    /// Drops a reference; frees the storage with its last one.
    pub(crate) fn drop_rt(&mut self, t: Rt) {
        self.release(t.st);
    }

    fn release(&mut self, st: u32) {
        let s = &mut self.storages[st as usize];
        debug_assert!(s.refs > 0, "double release");
        s.refs -= 1;
        if s.refs == 0 {
            s.live = false;
            self.live_bytes = self.live_bytes.saturating_sub(s.size);
            if s.ev == NO_EVENT {
                return;
            }
            let id = match &self.events[s.ev as usize] {
                Event::Alloc { id, .. } => id.clone(),
                _ => unreachable!(),
            };
            self.events.push(Event::Free { id });
        }
    }

    /// The trace id of `t`'s allocation (`None` for a 0-byte storage, which has no event).
    pub(crate) fn alloc_id(&self, t: &Rt) -> Option<AllocId> {
        let s = &self.storages[t.st as usize];
        match self.events.get(s.ev as usize) {
            Some(Event::Alloc { id, .. }) if s.ev != NO_EVENT => Some(id.clone()),
            _ => None,
        }
    }

    /// Puts `t`'s allocation on `stream` (a collective's side stream).
    pub(crate) fn set_stream(&mut self, t: &Rt, stream: u64) {
        let s = &self.storages[t.st as usize];
        if s.ev == NO_EVENT {
            return;
        }
        if let Some(Event::Alloc { stream: st, .. }) = self.events.get_mut(s.ev as usize) {
            *st = stream;
        }
    }

    /// References on `t`'s storage.
    pub(crate) fn refs(&self, t: &Rt) -> u32 {
        self.storages[t.st as usize].refs
    }

    fn phase(&mut self, name: &str) {
        self.events.push(Event::Phase { name: name.into() });
        self.phase_info.push(serde_json::json!({
            "phase": name, "iteration": self.iteration, "micro_batch": self.micro,
            "event": self.events.len() - 1,
        }));
    }

    /// End of a forward or recomputation: what it made and is still alive is an activation.
    fn settle_pending(&mut self, from: usize) {
        let inference = self.r.inference;
        for s in &mut self.storages[from..] {
            if s.kind == Kind::Pending {
                s.kind = if s.live && !inference {
                    Kind::Activation
                } else {
                    Kind::Temporary
                };
            }
        }
    }

    /// Marks `t`'s storage as a parameter's gradient.
    pub(crate) fn mark_grad(&mut self, t: &Rt) {
        self.storages[t.st as usize].grad = true;
    }

    /// Sets the tag of `t`'s allocation.
    pub(crate) fn retag(&mut self, t: &Rt, tag: String) {
        self.tags[t.st as usize] = tag.into();
    }

    /// Marks `t`'s storage as optimizer state.
    pub(crate) fn mark_state(&mut self, t: &Rt) {
        self.storages[t.st as usize].kind = Kind::OptimState;
    }

    pub(crate) fn new_node(&mut self, kind: NodeKind, seq: u64, module: ModuleId) -> u32 {
        self.nodes.push(Node {
            seq,
            kind,
            ins: Vec::new(),
            outs: Vec::new(),
            next: Vec::new(),
            saved: Vec::new(),
            ckpt: None,
            module,
        });
        (self.nodes.len() - 1) as u32
    }

    /// A leaf node for a tensor of `rt`'s layout and dtype that autograd treats as a leaf (its
    /// gradient lands in a slot of `leaf_grads`, not on a parameter): (node, slot).
    pub(crate) fn new_leaf(&mut self, rt: &Rt) -> (u32, u32) {
        let slot = self.leaf_grads.len() as u32;
        self.leaf_grads.push(None);
        let leaf = self.new_node(NodeKind::Leaf(slot), u64::MAX, ModuleId(0));
        self.nodes[leaf as usize].ins.push(Some(Meta {
            layout: rt.layout.clone(),
            dtype: rt.dtype,
        }));
        self.nodes[leaf as usize].next.push(None);
        (leaf, slot)
    }

    // ------------------------------------------------------------------ the step

    fn run(&mut self) -> Result<(), LowerError> {
        self.phase("setup");
        self.setup();
        self.plan_checkpoints();
        for it in 0..self.r.iterations {
            self.iteration = it;
            // A pipeline rank: `schedule.step` once per gradient-accumulation step (torchtitan's
            // `forward_backward_step`).
            for _ in 0..self.r.accum * u32::from(self.pp_on()) {
                self.pp_step()?;
            }
            for micro in 0..self.r.accum * u32::from(!self.pp_on()) {
                self.micro = micro;
                self.phase("forward");
                let inputs = self.make_inputs();
                self.par_pre_forward();
                self.dp_scatter(&inputs);
                self.dp_replicate();
                let loss = self.forward()?;
                self.dp_gather();
                self.fsdp_post_forward();
                self.zero3_post_forward();
                if self.r.inference {
                    self.drop_rt(loss);
                    self.drop_inputs(inputs);
                    continue;
                }
                if self.dp_criterion_elsewhere() {
                    // DataParallel, the loop's criterion on the output device: `loss` is this
                    // replica's output, and its backward starts from a chunk of the gradient.
                    self.dp_replica_backward(loss);
                    self.drop_inputs(inputs);
                    continue;
                }
                let (loss, unscaled) = self.finish_loss(loss);
                self.phase("backward");
                self.par_pre_backward();
                self.backward(&loss);
                self.fsdp_end_backward();
                self.par_post_backward(micro + 1 == self.r.accum);
                self.dp_reduce();
                // `scaler.scale(loss).backward()`: the scaled temporary dies when the statement
                // ends, then `del loss` frees the caller's unscaled loss (held through backward).
                self.drop_rt(loss);
                if let Some(u) = unscaled {
                    self.drop_rt(u);
                }
                self.drop_inputs(inputs);
            }
            if self.r.inference {
                continue;
            }
            self.micro = 0;
            self.phase("optimizer");
            self.fsdp_before_step();
            if self.dp_copy() {
                // DataParallel: the optimizer holds device 0's parameters only.
            } else if self.r.parallel.shard == crate::parallel::Shard::Zero3 {
                self.zero3_step();
            } else if self.r.parallel.shard.is_zero() {
                self.zero_step();
            } else if self.fsdp_offloaded() {
                // CPUOffloadPolicy: the optimizer steps the host shards (`fsdp.rs`).
            } else {
                self.optimizer_step();
                self.zero_redundancy_sync();
            }
            self.pp_end_train_step();
            self.phase("zero_grad");
            self.zero_grad();
            self.fsdp_after_step();
        }
        Ok(())
    }

    fn setup(&mut self) {
        let g = self.g;
        // `model.to(device)` moves each module's parameters, then its buffers: buffers go in
        // after the parameters created before them.
        let mut next_buffer = 0;
        for (i, p) in g.params.iter().enumerate() {
            while next_buffer < g.buffers.len() && g.buffers[next_buffer].after_params <= i {
                self.setup_buffer(next_buffer);
                next_buffer += 1;
            }
            let layout = Layout::contiguous(&p.shape);
            // The model dtype, or the parameter's own (PEFT's fp32 LoRA adapters).
            let dtype = self.resolve(g.values[p.value.0 as usize].dtype);
            // FSDP2 materialises only the shards (`fsdp.rs`): the handle has no storage of its own.
            // ZeRO-3 under `zero.Init` materialises only the partitions (`zero3/`).
            let size = if self.fsdp_shards(i) || self.zero3_on() || self.dp_copy() {
                0
            } else {
                layout.numel() * dtype.size()
            };
            let st = self.alloc_raw(size, Kind::Param, p.name.as_str().into());
            let mut rt = Rt {
                layout,
                dtype,
                st,
                edge: None,
                view: false,
            };
            if p.trainable && self.grad_mode {
                let node = self.new_node(NodeKind::Accumulate(i), u64::MAX, ModuleId(0));
                self.nodes[node as usize].ins.push(Some(Meta {
                    layout: rt.layout.clone(),
                    dtype: rt.dtype,
                }));
                self.nodes[node as usize].next.push(None);
                self.acc_nodes[i] = Some(node);
                rt.edge = Some(Edge { node, nr: 0 });
            }
            self.vals[p.value.0 as usize] = Some(rt.clone());
            self.params.push(rt);
        }
        for b in next_buffer..g.buffers.len() {
            self.setup_buffer(b);
        }
        self.par_setup();
        self.fsdp_setup();
        self.pp_setup();
    }

    fn setup_buffer(&mut self, i: usize) {
        let b = &self.g.buffers[i];
        let v = &self.g.values[b.value.0 as usize];
        let dtype = self.resolve(v.dtype);
        let layout = Layout::contiguous(&v.shape);
        // DataParallel devices ≥ 1 hold only the per-forward replica copies (`dataparallel.rs`).
        let size = if self.dp_copy() {
            0
        } else {
            layout.numel() * dtype.size()
        };
        let st = self.alloc_raw(size, Kind::Buffer, format!("buffer:{}", b.name).into());
        self.vals[b.value.0 as usize] = Some(Rt {
            layout,
            dtype,
            st,
            edge: None,
            view: false,
        });
    }

    pub(crate) fn resolve(&self, d: crate::graph::DTypeSpec) -> DType {
        match d {
            crate::graph::DTypeSpec::Model => self.param_dtype,
            crate::graph::DTypeSpec::Fixed(d) => d,
        }
    }

    fn make_inputs(&mut self) -> Vec<ValueId> {
        let g = self.g;
        let mut out = Vec::new();
        for inp in &g.inputs {
            let v = &g.values[inp.value.0 as usize];
            let dtype = self.resolve(v.dtype);
            let layout = Layout::contiguous(&v.shape);
            let size = layout.numel() * dtype.size();
            let st = self.alloc_raw(size, Kind::Input, format!("input:{}", inp.name).into());
            self.vals[inp.value.0 as usize] = Some(Rt {
                layout,
                dtype,
                st,
                edge: None,
                view: false,
            });
            out.push(inp.value);
        }
        out
    }

    fn drop_inputs(&mut self, inputs: Vec<ValueId>) {
        // `del inputs`: a tuple/dict of inputs dies last element first.
        for v in inputs.into_iter().rev() {
            if let Some(rt) = self.vals[v.0 as usize].take() {
                self.drop_rt(rt);
            }
        }
    }

    /// Which op ranges are checkpointed under the recipe.
    fn plan_checkpoints(&mut self) {
        if self.r.inference {
            return;
        }
        let g = self.g;
        let ranges = checkpointed_ranges(g, self.r.checkpointing);
        if ranges.is_empty() {
            return;
        }
        // The last op that reads each value (`used_after` below asks whether one at or after a
        // region's end does: one pass instead of a scan of the later ops per value).
        let mut last_read: Vec<Option<usize>> = vec![None; g.values.len()];
        for (i, op) in g.ops.iter().enumerate() {
            for &v in &op.inputs {
                last_read[v.0 as usize] = Some(i);
            }
        }
        for (start, end) in ranges {
            let id = self.ck_ranges.len() as u32;
            // The region's inputs: values made before it and used in it (parameters and buffers
            // live anyway).
            let mut inputs = Vec::new();
            for op in &g.ops[start..end] {
                for &v in &op.inputs {
                    let made_before = match g.values[v.0 as usize].source {
                        Source::Op { op, .. } => (op.0 as usize) < start,
                        Source::Input(_) => true,
                        _ => false,
                    };
                    if made_before && !inputs.contains(&v) {
                        inputs.push(v);
                    }
                }
            }
            // Arguments of the checkpointed call that no op reads: the checkpoint's recompute
            // closure holds them too (`_checkpoint_without_reentrant_generator`'s `recompute_fn`
            // captures `fn`, `args` and `kwargs`; the frame lives until the backward).
            for r in g
                .regions
                .iter()
                .filter(|r| r.start >= start && r.end <= end)
            {
                for &v in &r.args {
                    if !inputs.contains(&v) {
                        inputs.push(v);
                    }
                }
            }
            // Its outputs: values made in it that a later op, the graph's output or the training
            // loop's kept outputs use.
            let mut outputs = Vec::new();
            let used_after = |v: ValueId| {
                last_read[v.0 as usize].is_some_and(|i| i >= end)
                    || g.output == Some(v)
                    || g.kept_outputs.iter().any(|&(k, _)| k == v)
            };
            for op in &g.ops[start..end] {
                for &v in &op.outputs {
                    if used_after(v) && !outputs.contains(&v) {
                        outputs.push(v);
                    }
                }
            }
            self.ck_ranges.push(CkRange {
                start,
                end,
                inputs,
                outputs,
            });
            for i in start..end {
                self.op_region[i] = Some(id);
            }
        }
    }

    fn finish(mut self) -> Trace {
        // Categories, decided now that lifetimes are known.
        for (i, s) in self.storages.iter().enumerate() {
            if s.ev == NO_EVENT {
                continue;
            }
            let cat = match s.kind {
                Kind::Param => Category::Parameter,
                Kind::Buffer => Category::Other,
                Kind::Input => Category::Input,
                Kind::Pending | Kind::Activation => Category::Activation,
                Kind::Temporary => Category::Temporary,
                Kind::OptimState => Category::OptimizerState,
                Kind::Workspace => Category::Workspace,
                Kind::Other => Category::Other,
                Kind::Comm => Category::Communication,
            };
            let cat = if s.grad { Category::Gradient } else { cat };
            let tag = std::mem::take(&mut self.tags[i]);
            if let Event::Alloc {
                category, tag: t, ..
            } = &mut self.events[s.ev as usize]
            {
                *category = cat;
                *t = Some(tag);
            }
        }
        let mut trace = Trace::from_events(self.events);
        let m = &mut trace.meta;
        m.insert("tool".into(), "vramsim-models".into());
        m.insert("model".into(), self.g.name.clone().into());
        m.insert("batch".into(), self.r.batch.into());
        m.insert("seq".into(), self.g.seq.into());
        m.insert("recipe".into(), self.r.name().into());
        m.insert("precision".into(), self.r.precision.to_string().into());
        m.insert("optimizer".into(), self.r.optimizer.to_string().into());
        m.insert("checkpoint".into(), self.r.checkpointing.to_string().into());
        if self.r.torch_version != TorchVersion::V2_15 {
            m.insert(
                "torch_version".into(),
                self.r.torch_version.to_string().into(),
            );
        }
        // Device memory cuBLAS allocated itself (PyTorch 1.10): one default pool per handle.
        let handles = self.cublas_own_handles.iter().filter(|&&h| h).count() as u64;
        if handles > 0 {
            let pool =
                crate::recipe::Workspaces::cublas_own_pool_bytes(self.r.target.compute_capability);
            m.insert("cublas_own_bytes".into(), (handles * pool).into());
        }
        m.insert("accum".into(), self.r.accum.into());
        m.insert("iterations".into(), self.r.iterations.into());
        m.insert(
            "zero_grad".into(),
            match self.r.zero_grad {
                ZeroGrad::SetToNone => "none",
                ZeroGrad::Zero => "zero",
            }
            .into(),
        );
        m.insert("clip_grad_norm".into(), self.r.clip_grad_norm.into());
        m.insert("grad_scaler".into(), self.r.uses_grad_scaler().into());
        m.insert("params".into(), self.g.param_count().into());
        if self.paged_bytes > 0 {
            m.insert("paged_optimizer_bytes".into(), self.paged_bytes.into());
        }
        m.insert(
            "fidelity".into(),
            match self.r.fidelity {
                Fidelity::Cuda => "cuda",
                Fidelity::MetaCapture => "meta-capture",
            }
            .into(),
        );
        for (k, v) in &self.g.meta {
            m.insert(k.clone(), v.clone());
        }
        m.insert("phases".into(), serde_json::Value::Array(self.phase_info));
        trace
    }

    fn zero_grad(&mut self) {
        if self.r.zero_grad == ZeroGrad::SetToNone {
            for i in 0..self.param_grads.len() {
                if let Some(g) = self.param_grads[i].take() {
                    self.drop_rt(g);
                }
            }
        }
    }
}

/// The op ranges `[start, end)` that `checkpointing` wraps in non-reentrant `torch.utils.checkpoint`
/// (and so reruns in backward): every block (`full`), blocks 0, K, 2K, ... (`every:K`), attention cores
/// (`selective`), or `checkpoint_sequential(blocks, round(√n))`'s segments but the last (`sqrt`);
/// `selective-op` wraps every block too, with torchtitan's op policy deciding inside (`sac.rs`).
pub fn checkpointed_ranges(g: &Graph, checkpointing: Checkpointing) -> Vec<(usize, usize)> {
    let blocks: Vec<(usize, usize)> = g
        .regions
        .iter()
        .filter(|r| r.kind == RegionKind::Block)
        .map(|r| (r.start, r.end))
        .collect();
    match checkpointing {
        Checkpointing::None => vec![],
        Checkpointing::Full | Checkpointing::SelectiveOp => blocks,
        Checkpointing::Every(k) => blocks
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % (k as usize).max(1) == 0)
            .map(|(_, range)| range)
            .collect(),
        Checkpointing::Selective => g
            .regions
            .iter()
            .filter(|r| r.kind == RegionKind::AttentionCore)
            .map(|r| (r.start, r.end))
            .collect(),
        Checkpointing::Sqrt => {
            // torch.utils.checkpoint.checkpoint_sequential(blocks, segments=round(sqrt(n))):
            // segments of n // segments blocks, every segment but the last checkpointed.
            let n = blocks.len();
            let segments = ((n as f64).sqrt().round() as usize).max(1);
            let size = (n / segments).max(1);
            (0..segments.saturating_sub(1))
                .filter(|s| s * size < n)
                .map(|s| (blocks[s * size].0, blocks[((s + 1) * size).min(n) - 1].1))
                .collect()
        }
    }
}
