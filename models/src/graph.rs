//! The model IR: a DAG of ATen-level ops over tensors, with parameters, buffers, inputs, module
//! paths and checkpointable regions, and the [`GraphBuilder`] that writes it like PyTorch module code.
//!
//! A [`Graph`] is built for one batch and sequence length (shapes are concrete), but not for one
//! precision: floating tensors carry no dtype until [`crate::lower`] applies the recipe (model cast,
//! autocast), because PyTorch decides each op's dtype at run time too. Ops are stored in program
//! order (the order eager PyTorch runs them), which is a topological order of the DAG; the
//! petgraph view ([`Graph::dag`]) has one node per op and one edge per tensor passed between ops.

use crate::dtype::DType;
use crate::layout::{broadcast, numel};
use crate::ops::OpKind;
use petgraph::graph::{DiGraph, NodeIndex};

/// A tensor of the graph (an op output, a parameter, a buffer or an input).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

/// An op of the graph, by its position in program order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u32);

/// A module path (`transformer.h.3.attn`), interned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModuleId(pub u32);

/// The element type a value is declared with: floating tensors follow the recipe's precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DTypeSpec {
    /// A floating tensor in the model's dtype (`float32`, or `bfloat16` after `model.to(bfloat16)`).
    Model,
    /// A fixed element type (token ids, masks, an explicit `.float()`).
    Fixed(DType),
}

/// Where a value comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// A parameter (`nn.Parameter`), index into [`Graph::params`].
    Param(usize),
    /// A module buffer, index into [`Graph::buffers`].
    Buffer(usize),
    /// A model input (token ids, labels, images), index into [`Graph::inputs`].
    Input(usize),
    /// Output `index` of op `op`.
    Op {
        /// The producing op.
        op: OpId,
        /// Which of its outputs.
        index: usize,
    },
}

/// A tensor of the graph: its shape and where it comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    /// Sizes, outermost first.
    pub shape: Vec<u64>,
    /// Declared element type class.
    pub dtype: DTypeSpec,
    /// Producer.
    pub source: Source,
    /// Whether this value is a floating tensor that can carry a gradient.
    pub differentiable: bool,
}

/// A parameter (`nn.Parameter`): a leaf that requires grad and gets a `.grad`.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// Full name as `model.named_parameters()` gives it (`transformer.h.0.attn.c_attn.weight`).
    pub name: String,
    /// The value holding it.
    pub value: ValueId,
    /// Sizes.
    pub shape: Vec<u64>,
    /// Whether it is trained (`requires_grad`).
    pub trainable: bool,
    /// The weight's shape before quantization when `shape` is its packed storage (bitsandbytes
    /// `Params4bit`, `Int8Params`): what parameter counts use, as PEFT's
    /// `get_nb_trainable_parameters` does. `None`: `shape`.
    pub logical_shape: Option<Vec<u64>>,
}

/// A module buffer (BatchNorm running stats, rotary `inv_freq`): on the device, never trained.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    /// Full name (`model.rotary_emb.inv_freq`).
    pub name: String,
    /// The value holding it.
    pub value: ValueId,
    /// How many parameters were registered before it: `model.to(device)` moves a module's
    /// parameters, then its buffers, so setup allocates it after those parameters.
    pub after_params: usize,
}

/// A model input made for each micro-batch (category `input` in the trace).
#[derive(Clone, Debug, PartialEq)]
pub struct Input {
    /// Name (`input_ids`, `labels`).
    pub name: String,
    /// The value holding it.
    pub value: ValueId,
}

/// One op: its kind (with attributes), inputs, outputs and module path.
#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    /// What it computes.
    pub kind: OpKind,
    /// Input tensors, in the ATen argument order.
    pub inputs: Vec<ValueId>,
    /// Output tensors.
    pub outputs: Vec<ValueId>,
    /// The module whose forward runs it.
    pub module: ModuleId,
    /// Whether autocast applies (false inside a composite that autocast's wrapper calls with
    /// autocast excluded, such as SDPA's math backend).
    pub autocast: bool,
}

/// What a region is, for activation checkpointing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionKind {
    /// A repeated block (`GPT2Block`, `LlamaDecoderLayer`): what `full`, `every:K` and `sqrt`
    /// checkpoint.
    Block,
    /// The attention core (`QKᵀ`, softmax, dropout, `·V`): what `selective` checkpoints
    /// (Korthikanti et al.'s selective recomputation).
    AttentionCore,
}

/// A contiguous range of ops that checkpointing may wrap (one `torch.utils.checkpoint` call).
#[derive(Clone, Debug, PartialEq)]
pub struct Region {
    /// Block or attention core.
    pub kind: RegionKind,
    /// Module path of the region (`transformer.h.3`).
    pub module: ModuleId,
    /// First op.
    pub start: usize,
    /// One past the last op.
    pub end: usize,
    /// Tensors passed to the region's call that no op in it reads (HF passes `position_ids` to
    /// every decoder layer): a non-reentrant checkpoint of the region keeps them alive, since its
    /// recompute closure holds the call's arguments (`torch/utils/checkpoint.py`).
    pub args: Vec<ValueId>,
}

/// A model graph for one batch size and sequence length.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    /// Model name (`gpt2`).
    pub name: String,
    /// Batch size the shapes were built for.
    pub batch: u64,
    /// Sequence length the shapes were built for (0 for models without one).
    pub seq: u64,
    /// Every tensor.
    pub values: Vec<Value>,
    /// Ops in program order.
    pub ops: Vec<Op>,
    /// Parameters in registration order (`model.parameters()`; tied weights appear once).
    pub params: Vec<Param>,
    /// Buffers.
    pub buffers: Vec<Buffer>,
    /// Inputs, in the order the data loader makes them.
    pub inputs: Vec<Input>,
    /// The scalar loss (training) or the model output (inference).
    pub output: Option<ValueId>,
    /// Module paths, indexed by [`ModuleId`].
    pub modules: Vec<String>,
    /// Checkpointable regions, in program order.
    pub regions: Vec<Region>,
    /// Values that Python keeps alive to the end of a module's forward (locals), with the op after
    /// which they are released; others die after their last use.
    pub holds: Vec<(ValueId, OpId)>,
    /// Free-form facts about the model for trace metadata (the reference implementation, ...).
    pub meta: serde_json::Map<String, serde_json::Value>,
    /// What the training loop holds of the model's outputs (`logits, loss = model(x, y)`), in the
    /// order its names are rebound, each with the op of the forward after which the assignment
    /// runs: with [`crate::Recipe::keep_outputs`], the previous step's tensor stays alive until
    /// that op of the next forward.
    pub kept_outputs: Vec<(ValueId, OpId)>,
}

impl Graph {
    /// The op DAG as petgraph sees it: node weights are ops, edge weights the tensors passed.
    pub fn dag(&self) -> DiGraph<OpId, ValueId> {
        let mut g = DiGraph::with_capacity(self.ops.len(), self.ops.len() * 2);
        let nodes: Vec<NodeIndex> = (0..self.ops.len())
            .map(|i| g.add_node(OpId(i as u32)))
            .collect();
        for (i, op) in self.ops.iter().enumerate() {
            for &v in &op.inputs {
                if let Source::Op { op: p, .. } = self.values[v.0 as usize].source {
                    g.add_edge(nodes[p.0 as usize], nodes[i], v);
                }
            }
        }
        g
    }

    /// Number of parameter elements, frozen ones included (`sum(p.numel() for p in
    /// model.parameters())`, PEFT's "all params").
    pub fn total_param_count(&self) -> u64 {
        self.params
            .iter()
            .map(|p| numel(p.logical_shape.as_deref().unwrap_or(&p.shape)))
            .sum()
    }

    /// Orders the buffers by the parameters registered before them (what the setup's
    /// interleaving expects), keeping their order otherwise, and renumbers [`Source::Buffer`].
    pub(crate) fn sort_buffers(&mut self) {
        let mut order: Vec<usize> = (0..self.buffers.len()).collect();
        order.sort_by_key(|&i| self.buffers[i].after_params);
        let mut new_of = vec![0usize; order.len()];
        for (new, &old) in order.iter().enumerate() {
            new_of[old] = new;
        }
        let old = std::mem::take(&mut self.buffers);
        let mut slots: Vec<Option<Buffer>> = old.into_iter().map(Some).collect();
        self.buffers = order
            .iter()
            .map(|&i| slots[i].take().expect("once"))
            .collect();
        for v in &mut self.values {
            if let Source::Buffer(i) = &mut v.source {
                *i = new_of[*i];
            }
        }
    }

    /// Number of trainable parameter elements (`sum(p.numel() for p in model.parameters() if
    /// p.requires_grad)`, PEFT's "trainable params").
    pub fn param_count(&self) -> u64 {
        self.params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| numel(&p.shape))
            .sum()
    }

    /// The module path of an op.
    pub fn module_of(&self, op: OpId) -> &str {
        &self.modules[self.ops[op.0 as usize].module.0 as usize]
    }

    /// The value's shape.
    pub fn shape(&self, v: ValueId) -> &[u64] {
        &self.values[v.0 as usize].shape
    }
}

/// Errors building a graph: shapes that do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    /// An op was given shapes it cannot take.
    #[error("{}{op}: {msg}", if module.is_empty() { String::new() } else { format!("{module}: ") })]
    Shape {
        /// Module path.
        module: String,
        /// Op name.
        op: String,
        /// What is wrong.
        msg: String,
    },
}

/// Writes a [`Graph`] the way PyTorch module code reads: `b.linear("c_fc", x, 3072)`.
///
/// Module scopes ([`GraphBuilder::module`]) give each op its path; [`GraphBuilder::hold`] keeps a
/// Python local alive to the end of the current module's forward; [`GraphBuilder::region`] marks
/// blocks that checkpointing may wrap. Shape errors are collected and returned by
/// [`GraphBuilder::finish`], so model code stays free of `?`.
pub struct GraphBuilder {
    g: Graph,
    stack: Vec<String>,
    /// The id of `stack`'s path, once asked for (cleared whenever `stack` changes).
    module_now: Option<ModuleId>,
    module_ids: std::collections::HashMap<String, ModuleId>,
    hold_stack: Vec<Vec<ValueId>>,
    /// [`GraphBuilder::region_arg`]s of the regions being built, innermost last.
    region_args: Vec<Vec<ValueId>>,
    no_autocast: bool,
    error: Option<GraphError>,
    /// Regions started by [`GraphBuilder::begin_region`]: kind, module, first op, name.
    open_regions: Vec<(RegionKind, ModuleId, usize, String)>,
}

/// The largest tensor a graph may hold: 2^50 bytes (1 PiB) at 8 bytes per element. Larger shapes
/// are a [`GraphError`] (and a lowering error), which also keeps every byte sum of a trace far from
/// `u64` overflow.
pub const MAX_TENSOR_BYTES: u64 = 1 << 50;

/// Whether a tensor of `shape` stays within [`MAX_TENSOR_BYTES`] at 8 bytes per element.
pub fn fits_in_memory(shape: &[u64]) -> bool {
    shape
        .iter()
        .try_fold(8u64, |a, &d| a.checked_mul(d))
        .is_some_and(|b| b <= MAX_TENSOR_BYTES)
}

/// A tensor handle in model code (alias of [`ValueId`]).
pub type T = ValueId;

impl GraphBuilder {
    /// A builder for model `name` at `batch` × `seq` (use `seq = 0` for models without one).
    pub fn new(name: &str, batch: u64, seq: u64) -> GraphBuilder {
        let mut b = GraphBuilder {
            g: Graph {
                name: name.to_string(),
                batch,
                seq,
                values: Vec::new(),
                ops: Vec::new(),
                params: Vec::new(),
                buffers: Vec::new(),
                inputs: Vec::new(),
                output: None,
                modules: Vec::new(),
                regions: Vec::new(),
                holds: Vec::new(),
                meta: serde_json::Map::new(),
                kept_outputs: Vec::new(),
            },
            stack: Vec::new(),
            module_now: None,
            module_ids: Default::default(),
            hold_stack: vec![Vec::new()],
            region_args: Vec::new(),
            no_autocast: false,
            error: None,
            open_regions: Vec::new(),
        };
        b.intern(String::new());
        b
    }

    fn intern(&mut self, path: String) -> ModuleId {
        if let Some(&id) = self.module_ids.get(&path) {
            return id;
        }
        let id = ModuleId(self.g.modules.len() as u32);
        self.g.modules.push(path.clone());
        self.module_ids.insert(path, id);
        id
    }

    /// The current module path (`transformer.h.0.attn`).
    pub fn path(&self) -> String {
        self.stack.join(".")
    }

    fn child_name(&self, name: &str) -> String {
        if self.stack.is_empty() {
            name.to_string()
        } else if name.is_empty() {
            self.path()
        } else {
            format!("{}.{}", self.path(), name)
        }
    }

    fn current_module(&mut self) -> ModuleId {
        if let Some(id) = self.module_now {
            return id;
        }
        let p = self.path();
        let id = self.intern(p);
        self.module_now = Some(id);
        id
    }

    /// Enter submodule `name` (a relative path: `"h.0"`, `"attn"`).
    pub fn push_module(&mut self, name: &str) {
        for part in name.split('.').filter(|s| !s.is_empty()) {
            self.stack.push(part.to_string());
        }
        self.module_now = None;
        self.hold_stack.push(Vec::new());
    }

    /// Leave the submodule entered by the matching [`GraphBuilder::push_module`] with `name`:
    /// values held in it are released after its last op.
    pub fn pop_module(&mut self, name: &str) {
        let n = name.split('.').filter(|s| !s.is_empty()).count();
        for _ in 0..n {
            self.stack.pop();
        }
        self.module_now = None;
        let held = self.hold_stack.pop().unwrap_or_default();
        if let Some(last) = self.g.ops.len().checked_sub(1) {
            for v in held {
                self.g.holds.push((v, OpId(last as u32)));
            }
        }
    }

    /// Run `f` inside submodule `name`.
    pub fn module<R>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> R) -> R {
        self.push_module(name);
        let r = f(self);
        self.pop_module(name);
        r
    }

    /// Run `f` inside submodule `name` and mark its ops as a checkpointable region of `kind`.
    pub fn region<R>(&mut self, kind: RegionKind, name: &str, f: impl FnOnce(&mut Self) -> R) -> R {
        self.push_module(name);
        let module = self.current_module();
        let start = self.g.ops.len();
        self.region_args.push(Vec::new());
        let r = f(self);
        let args = self.region_args.pop().unwrap_or_default();
        let end = self.g.ops.len();
        self.pop_module(name);
        if end > start {
            self.g.regions.push(Region {
                kind,
                module,
                start,
                end,
                args,
            });
        }
        r
    }

    /// [`GraphBuilder::region`] for code that cannot be a closure (an importer's loop): enter
    /// submodule `name` and start a region of `kind`; [`GraphBuilder::end_region`] ends it.
    pub fn begin_region(&mut self, kind: RegionKind, name: &str) {
        self.push_module(name);
        self.region_args.push(Vec::new());
        let module = self.current_module();
        self.open_regions
            .push((kind, module, self.g.ops.len(), name.to_string()));
    }

    /// Ends the region the matching [`GraphBuilder::begin_region`] started.
    pub fn end_region(&mut self) {
        let Some((kind, module, start, name)) = self.open_regions.pop() else {
            return;
        };
        let args = self.region_args.pop().unwrap_or_default();
        let end = self.g.ops.len();
        self.pop_module(&name);
        if end > start {
            self.g.regions.push(Region {
                kind,
                module,
                start,
                end,
                args,
            });
        }
    }

    /// Inside [`GraphBuilder::region`]: `v` is an argument of the region's call that none of its
    /// ops reads (see [`Region::args`]).
    pub fn region_arg(&mut self, v: T) {
        if let Some(top) = self.region_args.last_mut() {
            top.push(v);
        }
    }

    /// Run `f` with autocast excluded for the ops it appends (ATen's `ExcludeDispatchKeyGuard`
    /// around a composite autocast already cast the arguments of).
    pub fn without_autocast<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = std::mem::replace(&mut self.no_autocast, true);
        let r = f(self);
        self.no_autocast = before;
        r
    }

    /// Keep `v` alive until the end of the current module's forward (a Python local variable).
    pub fn hold(&mut self, v: T) {
        if let Some(top) = self.hold_stack.last_mut() {
            top.push(v);
        }
    }

    /// [`GraphBuilder::hold`] for an optional value.
    pub fn hold_opt(&mut self, v: Option<T>) {
        if let Some(v) = v {
            self.hold(v);
        }
    }

    /// Keep `v` alive until the last op appended so far has run.
    pub fn hold_until_last_op(&mut self, v: T) {
        if let Some(last) = self.g.ops.len().checked_sub(1) {
            self.g.holds.push((v, OpId(last as u32)));
        }
    }

    /// Record a shape error (the first one is reported by [`GraphBuilder::finish`]).
    pub fn fail(&mut self, op: &str, msg: String) {
        if self.error.is_none() {
            self.error = Some(GraphError::Shape {
                module: self.path(),
                op: op.to_string(),
                msg,
            });
        }
    }

    fn new_value(&mut self, shape: Vec<u64>, dtype: DTypeSpec, source: Source) -> T {
        if !fits_in_memory(&shape) {
            self.fail(
                &format!("tensor of shape {shape:?}"),
                "would take more than 2^50 bytes (1 PiB), more than any device holds: batch, sequence or model sizes out of range".into(),
            );
        }
        let differentiable = match dtype {
            DTypeSpec::Model => true,
            DTypeSpec::Fixed(d) => d.is_float(),
        };
        let id = ValueId(self.g.values.len() as u32);
        self.g.values.push(Value {
            shape,
            dtype,
            source,
            differentiable,
        });
        id
    }

    /// A builder that appends to `g` (for graph rewrites such as LoRA, [`crate::finetune`]): the
    /// module stack is empty; set it with [`GraphBuilder::set_path`].
    pub(crate) fn resume(g: Graph) -> GraphBuilder {
        let mut b = GraphBuilder::new(&g.name, g.batch, g.seq);
        b.module_ids = g
            .modules
            .iter()
            .enumerate()
            .map(|(i, m)| (m.clone(), ModuleId(i as u32)))
            .collect();
        b.g = g;
        b
    }

    /// Parameter `idx` becomes the packed storage of a quantized weight: `shape` of `dtype`,
    /// frozen, its unquantized shape kept in [`Param::logical_shape`].
    pub(crate) fn quantize_param(
        &mut self,
        idx: usize,
        shape: &[u64],
        dtype: DType,
        logical: Vec<u64>,
    ) {
        let p = &mut self.g.params[idx];
        p.shape = shape.to_vec();
        p.trainable = false;
        p.logical_shape = Some(logical);
        let v = &mut self.g.values[p.value.0 as usize];
        v.shape = shape.to_vec();
        v.dtype = DTypeSpec::Fixed(dtype);
        v.differentiable = false;
    }

    /// [`GraphBuilder::buffer`] that setup allocates after the first `after_params` parameters
    /// (call [`Graph::sort_buffers`] when done).
    pub(crate) fn buffer_after(
        &mut self,
        name: &str,
        shape: &[u64],
        dtype: DTypeSpec,
        after_params: usize,
    ) -> T {
        let v = self.buffer(name, shape, dtype);
        if let Some(b) = self.g.buffers.last_mut() {
            b.after_params = after_params;
        }
        v
    }

    /// The graph built so far.
    pub(crate) fn graph(&self) -> &Graph {
        &self.g
    }

    /// The parameters registered so far.
    pub(crate) fn params_mut(&mut self) -> &mut [Param] {
        &mut self.g.params
    }

    /// Sets the current module path (`model.layers.0.self_attn.q_proj`) for the ops that follow.
    pub(crate) fn set_path(&mut self, path: &str) {
        self.stack = path
            .split('.')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        self.module_now = None;
    }

    /// [`GraphBuilder::param_with`] of a given dtype class (PEFT's fp32 adapters on a bf16 model).
    pub(crate) fn param_typed(&mut self, name: &str, shape: &[u64], dtype: DTypeSpec) -> T {
        let v = self.param_with(name, shape, true);
        self.g.values[v.0 as usize].dtype = dtype;
        v
    }

    /// A trainable parameter `name` of the current module, in the model dtype.
    pub fn param(&mut self, name: &str, shape: &[u64]) -> T {
        self.param_with(name, shape, true)
    }

    /// A parameter with `trainable` (`requires_grad`) given.
    pub fn param_with(&mut self, name: &str, shape: &[u64], trainable: bool) -> T {
        let full = self.child_name(name);
        let idx = self.g.params.len();
        let v = self.new_value(shape.to_vec(), DTypeSpec::Model, Source::Param(idx));
        self.g.params.push(Param {
            name: full,
            value: v,
            shape: shape.to_vec(),
            trainable,
            logical_shape: None,
        });
        v
    }

    /// A module buffer `name` (never trained) of `dtype`.
    pub fn buffer(&mut self, name: &str, shape: &[u64], dtype: DTypeSpec) -> T {
        let full = self.child_name(name);
        let idx = self.g.buffers.len();
        let v = self.new_value(shape.to_vec(), dtype, Source::Buffer(idx));
        let after_params = self.g.params.len();
        self.g.buffers.push(Buffer {
            name: full,
            value: v,
            after_params,
        });
        v
    }

    /// A model input `name` (made by the data loader for each micro-batch).
    pub fn input(&mut self, name: &str, shape: &[u64], dtype: DTypeSpec) -> T {
        let idx = self.g.inputs.len();
        let v = self.new_value(shape.to_vec(), dtype, Source::Input(idx));
        self.g.inputs.push(Input {
            name: name.to_string(),
            value: v,
        });
        v
    }

    /// The value's shape.
    pub fn shape(&self, v: T) -> Vec<u64> {
        self.g.values[v.0 as usize].shape.clone()
    }

    /// Whether the value is a floating tensor (autocast and autograd apply to it).
    pub fn g_value_differentiable(&self, v: T) -> bool {
        self.g.values[v.0 as usize].differentiable
    }

    /// The value's declared dtype class.
    pub fn dtype(&self, v: T) -> DTypeSpec {
        self.g.values[v.0 as usize].dtype
    }

    /// Append an op with explicit output shapes and dtypes (the general entry point the typed
    /// helpers use).
    pub fn op(&mut self, kind: OpKind, inputs: &[T], outs: &[(Vec<u64>, DTypeSpec)]) -> Vec<T> {
        let op = self.push_op(kind, inputs, outs.iter().cloned());
        self.g.ops[op.0 as usize].outputs.clone()
    }

    /// Append a one-output op.
    pub fn op1(&mut self, kind: OpKind, inputs: &[T], shape: Vec<u64>, dtype: DTypeSpec) -> T {
        let op = self.push_op(kind, inputs, std::iter::once((shape, dtype)));
        self.g.ops[op.0 as usize].outputs[0]
    }

    /// Appends an op making one value per entry of `outs` (shapes taken as they are).
    fn push_op(
        &mut self,
        kind: OpKind,
        inputs: &[T],
        outs: impl ExactSizeIterator<Item = (Vec<u64>, DTypeSpec)>,
    ) -> OpId {
        let module = self.current_module();
        let op = OpId(self.g.ops.len() as u32);
        let mut outputs = Vec::with_capacity(outs.len());
        for (i, (s, d)) in outs.enumerate() {
            outputs.push(self.new_value(s, d, Source::Op { op, index: i }));
        }
        self.g.ops.push(Op {
            kind,
            inputs: inputs.to_vec(),
            outputs,
            module,
            autocast: !self.no_autocast,
        });
        op
    }

    /// The dtype class of an elementwise result over `inputs` (floats promote; the model dtype
    /// stands for itself).
    pub fn result_dtype(&self, inputs: &[T]) -> DTypeSpec {
        let mut out: Option<DTypeSpec> = None;
        for &v in inputs {
            let d = self.dtype(v);
            out = Some(match (out, d) {
                (None, d) => d,
                (Some(DTypeSpec::Fixed(a)), DTypeSpec::Fixed(b)) => DTypeSpec::Fixed(a.promote(b)),
                (Some(DTypeSpec::Fixed(a)), DTypeSpec::Model)
                    if a == DType::F32 || a == DType::F64 =>
                {
                    DTypeSpec::Fixed(a)
                }
                (Some(DTypeSpec::Fixed(a)), DTypeSpec::Model) if !a.is_float() => DTypeSpec::Model,
                (Some(DTypeSpec::Model), DTypeSpec::Fixed(b))
                    if b == DType::F32 || b == DType::F64 =>
                {
                    DTypeSpec::Fixed(b)
                }
                (Some(x), _) => x,
            });
        }
        out.unwrap_or(DTypeSpec::Model)
    }

    /// Broadcast shapes of `a` and `b`, recording an error if they do not broadcast.
    pub fn broadcast_shape(&mut self, op: &str, a: T, b: T) -> Vec<u64> {
        let (sa, sb) = (self.shape(a), self.shape(b));
        match broadcast(&sa, &sb) {
            Some(s) => s,
            None => {
                self.fail(op, format!("shapes {sa:?} and {sb:?} do not broadcast"));
                sa
            }
        }
    }

    /// The training loop binds `v` to a Python name when the last op appended so far returns
    /// (`logits, loss = model(x, y)` after the forward, `loss = criterion(output, y)` after the
    /// loss): see [`Graph::kept_outputs`].
    pub fn keep_output(&mut self, v: T) {
        if let Some(last) = self.g.ops.len().checked_sub(1) {
            self.g.kept_outputs.push((v, OpId(last as u32)));
        }
    }

    /// Mark `v` as the graph's output (the loss in training).
    pub fn set_output(&mut self, v: T) {
        self.g.output = Some(v);
    }

    /// Add a metadata entry (e.g. `reference`: the implementation the graph follows).
    pub fn meta(&mut self, key: &str, value: serde_json::Value) {
        self.g.meta.insert(key.to_string(), value);
    }

    /// Finish: the graph, or the first shape error.
    pub fn finish(mut self) -> Result<Graph, GraphError> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        // Locals held at the top level live to the end of the forward.
        let held = std::mem::take(&mut self.hold_stack);
        if let Some(last) = self.g.ops.len().checked_sub(1) {
            for level in held {
                for v in level {
                    self.g.holds.push((v, OpId(last as u32)));
                }
            }
        }
        Ok(self.g)
    }
}
