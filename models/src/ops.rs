//! The op library: ATen-level ops ([`OpKind`]) and the builder methods that append them with
//! PyTorch's shape rules. Their memory behaviour (outputs, saved tensors, backward allocations)
//! lives in the lowering (`lower/fwd.rs`, `lower/bwd.rs`); their autocast policy in
//! [`crate::autocast`].
//!
//! Composite PyTorch functions are written as the ATen ops they decompose into in eager mode, in
//! the same order, because autograd records one node per ATen op and frees by node:
//! `F.linear` → `t` + `addmm` (2-D or contiguous 3-D input with bias) or `t` + `matmul`;
//! `torch.matmul` → `expand`/`reshape`/`bmm`/`_unsafe_view` (`aten/src/ATen/native/LinearAlgebra.cpp`
//! `_matmul_impl`); `F.cross_entropy` → `_log_softmax` + `nll_loss_forward`.

use crate::dtype::DType;
use crate::graph::{DTypeSpec, GraphBuilder, T};
use crate::layout::numel;

pub use crate::sdpa::SdpaBackend;

/// A fused SDPA kernel: one ATen op with its own outputs, saved tensors and backward (the math
/// backend is written as its composite ops instead, see [`GraphBuilder::sdpa_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedSdpa {
    /// FlashAttention-2 (`_scaled_dot_product_flash_attention`).
    Flash,
    /// Memory-efficient attention (`_scaled_dot_product_efficient_attention`).
    MemEfficient,
    /// cuDNN attention (`_scaled_dot_product_cudnn_attention`).
    Cudnn,
}

/// An ATen-level op and its attributes.
#[derive(Clone, Debug, PartialEq)]
pub enum OpKind {
    // ---- views: share the input's storage ----
    /// `view(shape)`: must alias.
    View,
    /// `reshape(shape)`: a view when strides allow, else `clone(contiguous)` + `_unsafe_view`.
    Reshape,
    /// `_unsafe_view(shape)` (matmul's output reshape): a view.
    UnsafeView,
    /// `transpose(d0, d1)`.
    Transpose(usize, usize),
    /// `t()` of a matrix.
    T,
    /// `permute(dims)`.
    Permute(Vec<usize>),
    /// `expand(shape)`.
    Expand,
    /// `unsqueeze(dim)`.
    Unsqueeze(usize),
    /// `slice(dim, start, end)` (basic indexing `x[..., a:b]`).
    Slice {
        /// Dimension.
        dim: usize,
        /// First index.
        start: u64,
    },
    /// `x.as_strided_(sizes, strides)` with the same sizes, when the second input suggests
    /// channels-last (the restride of `adaptive_avg_pool2d`'s 1×1 output): a view; its backward
    /// (`as_strided_backward`) scatters the gradient into zeros of the storage. Otherwise `x`.
    AsStridedInplace,
    /// `split_with_sizes(sizes, dim)`: one view per output.
    Split {
        /// Dimension.
        dim: usize,
    },
    // ---- copies ----
    /// `clone()`; `contiguous: true` is `contiguous()`/`clone(memory_format=contiguous)`, which
    /// allocates only when the input is not contiguous already.
    Clone {
        /// `contiguous()` semantics (no copy when already contiguous).
        contiguous: bool,
    },
    /// `x.to(dtype)` (`_to_copy`); no copy when the dtype is already right.
    ToDtype(DType),
    /// `x.to(other.dtype)` (`hidden_states.to(input_dtype)`): input 1 gives the dtype only.
    ToDtypeOf,
    // ---- elementwise ----
    /// `add.Tensor` (broadcasting).
    Add,
    /// `sub.Tensor`.
    Sub,
    /// `mul.Tensor` between two tensors.
    Mul,
    /// `div.Tensor` between two tensors.
    Div,
    /// `add` with a Python scalar.
    AddScalar,
    /// `mul` with a Python scalar (a wrapped number: nothing saved on the device).
    MulScalar,
    /// `div` with a Python scalar.
    DivScalar,
    /// `neg`.
    Neg,
    /// `pow(x, exponent)` with a scalar exponent.
    PowScalar(f64),
    /// `rsqrt`.
    Rsqrt,
    /// `tanh`.
    Tanh,
    /// `sigmoid` (saves its result).
    Sigmoid,
    /// `relu` (out of place).
    Relu,
    /// `hardtanh(x, min_val, max_val)` out of place (`nn.Hardtanh`, `nn.ReLU6`): saves its input.
    Hardtanh,
    /// `gelu(approximate=...)` as one ATen op (`nn.GELU`).
    Gelu {
        /// `approximate="tanh"`.
        tanh: bool,
    },
    /// `silu`.
    Silu,
    // ---- reductions ----
    /// `mean(dim, keepdim)`.
    MeanDim {
        /// Reduced dimension.
        dim: usize,
        /// Whether the dimension is kept with size 1.
        keepdim: bool,
    },
    // ---- matrix products ----
    /// `mm(a, b)`.
    Mm,
    /// `addmm(bias, a, b)` (bias broadcast).
    Addmm,
    /// `bmm(a, b)`.
    Bmm,
    // ---- nn ----
    /// `_softmax(x, dim)`; `to_f32` is `softmax(x, dim, dtype=torch.float32)`.
    Softmax {
        /// Dimension.
        dim: usize,
        /// Compute and return float32 (the `dtype=torch.float32` argument).
        to_f32: bool,
    },
    /// `_log_softmax(x, dim)`.
    LogSoftmax {
        /// Dimension.
        dim: usize,
        /// Called as `log_softmax(x, dim, dtype)` with the dtype given (`cross_entropy_loss` passes
        /// the input's own): autocast's `fp32_set_opt_dtype` keeps it (see [`crate::autocast`]).
        explicit_dtype: bool,
    },
    /// `nll_loss_forward(logp, target)` with mean reduction: outputs `(loss, total_weight)`.
    NllLoss,
    /// `native_layer_norm(x, shape, weight, bias)`: outputs `(y, mean, rstd)`.
    LayerNorm,
    /// `native_dropout(x, p, train)`: outputs `(y, mask)`; the mask is `bool`.
    Dropout {
        /// Drop probability.
        p: f64,
    },
    /// `embedding(weight, indices)`.
    Embedding,
    /// `cat(tensors, dim)`.
    Cat {
        /// Dimension.
        dim: usize,
    },
    /// `scaled_dot_product_attention(q, k, v)` with a fused backend (no mask).
    Sdpa {
        /// The kernel.
        backend: FusedSdpa,
    },
    // ---- in place (PyTorch's autograd rules for in-place ops; version counters aside) ----
    /// `relu_` (`nn.ReLU(inplace=True)`): no allocation; the node (`ReluBackward0`) saves the
    /// result, which is the mutated input's storage.
    ReluInplace,
    /// `hardtanh_` (`nn.ReLU6(inplace=True)`): writes into its input; autograd first saves
    /// `original_self = self.clone()` for `HardtanhBackward0` (PyTorch 2.15 has no formula of its
    /// own for `hardtanh_`, and hardtanh's reads `self`).
    HardtanhInplace,
    /// `silu_` (`nn.SiLU(inplace=True)`): writes into its input; autograd first saves
    /// `original_self = self.clone()` for `SiluBackward0` (silu's formula reads `self`).
    SiluInplace,
    /// `add_(other)` (`out += identity`): no allocation, nothing saved. `composite` marks the
    /// `output.add_(bias)` inside `at::linear`, which ATen replaces by an out-of-place `add` when the
    /// tensor is subclass-like — always under a dispatch mode, so in the meta-device capture
    /// ([`crate::Fidelity::MetaCapture`]).
    AddInplace {
        /// The add_ of a C++ composite (out of place under a dispatch mode).
        composite: bool,
    },
    // ---- convolutional networks ----
    /// `convolution(x, w, b, stride, padding, dilation, transposed=False, groups)` on NCHW input
    /// (cuDNN on CUDA: output, then `add_` of the bias in place). Saves input and weight.
    Conv2d {
        /// Stride (H, W).
        stride: [u64; 2],
        /// Padding (H, W).
        padding: [u64; 2],
        /// Dilation (H, W).
        dilation: [u64; 2],
        /// Groups.
        groups: u64,
    },
    /// `native_batch_norm(x, w, b, running_mean, running_var, training=True)` (`cudnn_batch_norm`
    /// on CUDA for float32/float16, the native kernel for bfloat16): outputs `(y, save_mean,
    /// save_invstd)`, the statistics `[C]` in float32 for 16-bit input (`acc_type`); cuDNN's
    /// `reserve` buffer (0 bytes without a fused activation) is not modelled. In eval mode the
    /// statistics are empty.
    BatchNorm,
    /// `max_pool2d_with_indices(x, kernel, stride, padding)`: outputs `(y, indices)`, the indices
    /// int64; saves the input and the indices.
    MaxPool2d {
        /// Kernel size (H, W).
        kernel: [u64; 2],
        /// Stride (H, W).
        stride: [u64; 2],
        /// Padding (H, W).
        padding: [u64; 2],
    },
    /// `mean(dims, keepdim)` over several dimensions (`adaptive_avg_pool2d` to 1×1 runs
    /// `input.mean({-1, -2}, keepdim=True)`).
    MeanDims {
        /// Reduced dimensions.
        dims: Vec<usize>,
        /// Whether they are kept with size 1.
        keepdim: bool,
    },
    /// `_adaptive_avg_pool2d(x, output_size)` (any output size but 1×1): saves the input.
    AdaptiveAvgPool2d {
        /// Output size (H, W).
        out: [u64; 2],
    },
    /// `select(dim, index)` (`x[:, 0]`): a view; its backward allocates zeros of the input's size.
    Select {
        /// Dimension.
        dim: usize,
        /// Index.
        index: u64,
    },
    /// `x[rows, cols]`: advanced indexing of the first two dimensions of `x` by two int64 index
    /// tensors of one shape (`aten.index`), a new tensor. Saves the indices (`IndexBackward0`);
    /// its backward is `index_put_` (accumulate) into zeros of the input's size.
    Index,
    /// `F.mse_loss(input, target)` with mean reduction (`aten.mse_loss`): a scalar; saves input
    /// and target.
    MseLoss,
    /// `x.masked_fill(mask, value)` with a Python scalar value (`aten.masked_fill.Scalar`): the
    /// bool mask broadcasts to `x`; out of place, a contiguous copy of `x` filled in place
    /// (`TensorAdvancedIndexing.cpp` `masked_fill`). derivatives.yaml saves the mask
    /// (`self: grad.masked_fill(mask, 0)`); the mask is not differentiable.
    MaskedFill,
    /// `F.hardswish(x)` (`nn.Hardswish`, MobileNetV3): derivatives.yaml `hardswish: self:
    /// hardswish_backward(grad, self)` saves its input.
    Hardswish,
    /// `F.hardsigmoid(x)` (`nn.Hardsigmoid`): derivatives.yaml `hardsigmoid_backward(grad, self)`
    /// saves its input.
    Hardsigmoid,
    /// `F.hardswish(x, inplace=True)` (`hardswish_`): writes into its input; as for `silu_`, the
    /// formula reads `self`, so autograd first saves `original_self = self.clone()`.
    HardswishInplace,
    /// `F.hardsigmoid(x, inplace=True)` (`hardsigmoid_`, torchvision's `SqueezeExcitation` in
    /// MobileNetV3): likewise a clone of the input saved, no output allocated.
    HardsigmoidInplace,
    /// `F.dropout(x, p, training=True, inplace=True)` (`_VF.dropout_`, EfficientNet's classifier):
    /// ATen's `dropout_` always takes `_dropout_impl<inplace=true>` (`aten/src/ATen/native/
    /// Dropout.cpp`; the fused `native_dropout` is only for the out-of-place `dropout`, on CUDA as
    /// elsewhere): `noise = at::empty_like(input)`, `noise.bernoulli_(1 - p)`, `noise.div_(1 - p)`,
    /// `input.mul_(noise)`. The noise, in the input's dtype, is what `MulBackward0` saves (`other`);
    /// nothing else is allocated.
    DropoutInplace {
        /// Drop probability.
        p: f64,
    },
    /// `F.avg_pool2d(x, kernel, stride, padding)` (DenseNet's transitions): derivatives.yaml
    /// `avg_pool2d: self: avg_pool2d_backward(grad, self, ...)` saves the input; the output is a
    /// new contiguous tensor.
    AvgPool2d {
        /// Kernel size (H, W).
        kernel: [u64; 2],
        /// Stride (H, W).
        stride: [u64; 2],
    },
    /// A call without a rule, lowered from what the capture recorded of it
    /// (`vramsim.from_module`'s fallback, see [`crate::imported`]): each output a view of an input
    /// or a new contiguous tensor, the tensors autograd packed for its node (inputs, outputs, or
    /// new tensors the call made), and a backward that allocates one gradient per differentiable
    /// input, of the input's shape. Temporaries inside the call are not recorded.
    Recorded(Box<Recorded>),
    /// `x.sum(dim, keepdim)` over the listed dims (`aten.sum.dim_IntList`): a new tensor; saves
    /// nothing (derivatives.yaml `sum_backward(grad, self.sym_sizes(), dim, keepdim)` is
    /// `grad.expand(sizes)`, a view that the next backward formula reading it materialises: allocated
    /// here, as `mean`'s backward allocates its quotient).
    SumDim {
        /// Dimensions reduced (normalised).
        dims: Vec<usize>,
        /// Whether they are kept as size 1.
        keepdim: bool,
    },
    /// `torch.topk(x, k, dim)` (`aten.topk`): values (x's dtype) and int64 indices; saves the
    /// indices (derivatives.yaml `value_selecting_reduction_backward_symint`: `zeros(sizes).scatter_(dim,
    /// indices, grad)`, one allocation of the input's size).
    TopK {
        /// Dimension.
        dim: usize,
    },
    /// `torch._grouped_mm(a, b, offs)` (`F.grouped_mm`: transformers' MoE experts): `a` `[M, K]`
    /// rows grouped by `offs`, `b` `[E, K, N]` → `[M, N]`; saves both and `offs` (derivatives.yaml
    /// `_grouped_mm_mat1_backward`/`_mat2_backward`: `b`'s gradient `[E, K, N]` in `b`'s layout first,
    /// then `a`'s `[M, K]`). The allocations do not depend on `offs` (the routing).
    GroupedMm,
    /// Autocast's `lower_precision_fp` cast of a composite's argument (`linear`, `matmul` are in
    /// the list, so their arguments are cast, and cached when they are parameters, before the
    /// ATen ops they decompose into): identity when autocast is off.
    AutocastLower,
    /// bitsandbytes' quantized linear layer (`Linear4bit` → `MatMul4Bit`, `Linear8bitLt` →
    /// `MatMul8bitLt`): inputs `[x, packed weight, bias?]`, output `[.., out_features]` in x's
    /// dtype; see [`crate::finetune::quant`] and the lowering's rules.
    QuantLinear {
        /// The weight format.
        quant: crate::finetune::Quant,
        /// `in_features`.
        in_features: u64,
        /// `out_features`.
        out_features: u64,
    },
    // ---- no autograd ----
    /// A non-differentiable computation that makes its outputs from its inputs (mask building,
    /// position ids, label shifting) with the given short-lived temporaries, allocated and freed
    /// in order before the outputs. `name` is the ATen op the trace tags it with.
    Factory {
        /// Op name for the tag (`aten.where`).
        name: &'static str,
        /// Temporaries (shape, dtype), allocated and freed before the outputs.
        temps: Vec<(Vec<u64>, DType)>,
    },
    /// A collective of Megatron-LM's tensor-parallel regions (`--tp`, `--sp`; see [`TpComm`]).
    TpComm(TpComm),
    /// `x[mask, :] = 0.0` with a bool mask and a Python scalar: `at::indexing::set_item`
    /// (`ATen/TensorIndexing.h`) dispatches it to `x.masked_fill_(mask.unsqueeze(-1), 0.0)`
    /// (`try_dispatch_masked_fill_`, `canDispatchToMaskedFill`: one bool index on the tensor's
    /// device) — in place, no allocation; Megatron's `VocabParallelEmbedding` zeroes the rows of
    /// tokens outside its vocabulary range with it. derivatives.yaml `masked_fill_.Scalar` saves
    /// the mask; its backward `grad.masked_fill(mask, 0)` is an out-of-place copy of the gradient.
    MaskedFillInplace,
    /// Megatron-LM's `vocab_parallel_cross_entropy(logits, target)`
    /// (`megatron/core/tensor_parallel/cross_entropy.py`, `_VocabParallelCrossEntropy`) on
    /// float32 logits `[N, V/t]` and int64 targets `[N]`: per-token losses `[N]` (float32).
    VocabParallelCrossEntropy,
}

/// A collective of Megatron-LM's tensor-parallel mappings (`megatron/core/tensor_parallel/
/// mappings.py`, `layers.py`), on one rank of the tensor-parallel group. The sequence dimension
/// of a sequence-parallel tensor is dimension 1 of the zoo's batch-first `[B, S, H]` (Megatron's
/// `[S, B, H]` splits dimension 0): the same bytes per rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpComm {
    /// `copy_to_tensor_model_parallel_region` (`_CopyToModelParallelRegion`): the input itself
    /// forward; backward all-reduces the gradient in place (`_reduce`: `all_reduce` of the
    /// contiguous gradient).
    Copy,
    /// `reduce_from_tensor_model_parallel_region` (`_ReduceFromModelParallelRegion`): `_reduce`
    /// all-reduces the (contiguous) input in place and returns it; backward passes the gradient.
    Reduce,
    /// The sequence-parallel all-gather of `LinearWithGradAccumulationAndAsyncCommunication`
    /// (`ColumnParallelLinear` with `sequence_parallel`): into the persistent
    /// `get_global_memory_buffer().get_tensor(..., "mpu")`; autograd keeps the local shard
    /// (`ctx.save_for_backward(input, weight)`), and backward reduce-scatters the input's
    /// gradient into a new `torch.empty` shard (`sub_grad_input`).
    GatherToBuffer,
    /// `reduce_scatter_to_sequence_parallel_region` (`_reduce_scatter_along_first_dim`): a new
    /// `torch.empty` shard forward; backward all-gathers into a new full tensor
    /// (`_gather_along_first_dim`).
    ReduceScatter,
    /// `scatter_to_sequence_parallel_region` (`_split_along_first_dim`) followed by the clone of
    /// `LanguageModelEmbedding` (`clone_scatter_output_in_embedding`): a new shard; backward
    /// all-gathers into a new full tensor.
    Scatter,
    /// `gather_from_sequence_parallel_region` (`_GatherFromSequenceParallelRegion`,
    /// `_gather_along_first_dim`): a new `torch.empty` full-sequence tensor forward; backward
    /// reduce-scatters the gradient into a new shard (`tensor_parallel_output_grad=True`).
    SeqGather,
    /// `gather_from_tensor_model_parallel_region` (`_GatherFromModelParallelRegion`,
    /// `_gather_along_last_dim`): `torch.empty` of t × the input, all-gathered into, then
    /// `torch.cat(output.chunk(t), dim=-1)` (the output); backward keeps the rank's slice of the
    /// gradient's last dimension (`_split_along_last_dim`: `input_list[rank].contiguous()`, a copy).
    GatherLast,
    /// `scatter_to_sequence_parallel_region` without a clone (`_split_along_first_dim`): on
    /// Megatron's sequence-first `[s, b, h]` the rank's slice of the first dimension is already
    /// contiguous, so `.contiguous()` returns a view of the full tensor; backward all-gathers into
    /// a new full tensor.
    SeqSplitView,
    /// `gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)` before a
    /// module replicated on every rank (Megatron's `Pooler`): a new full-sequence tensor forward;
    /// backward keeps the rank's slice of the gradient (`_split_along_first_dim`, a view of
    /// Megatron's sequence-first tensor: nothing allocated, the full gradient kept alive by it).
    SeqGatherReplicated,
}

impl TpComm {
    /// The name the trace tags its allocations with.
    pub fn name(self) -> &'static str {
        match self {
            TpComm::Copy => "megatron.copy_to_tensor_model_parallel_region",
            TpComm::Reduce => "megatron.all_reduce",
            TpComm::GatherToBuffer => "megatron.all_gather_into_tensor",
            TpComm::ReduceScatter => "megatron.reduce_scatter_tensor",
            TpComm::Scatter => "megatron.scatter_to_sequence_parallel_region",
            TpComm::SeqGather => "megatron.gather_from_sequence_parallel_region",
            TpComm::GatherLast => "megatron.gather_from_tensor_model_parallel_region",
            TpComm::SeqSplitView => "megatron.split_along_first_dim",
            TpComm::SeqGatherReplicated => "megatron.gather_from_sequence_parallel_region",
        }
    }
}

impl OpKind {
    /// The ATen name used in trace tags (`aten.addmm`).
    pub fn aten_name(&self) -> &'static str {
        use OpKind::*;
        match self {
            View => "aten.view",
            Reshape => "aten.clone",
            UnsafeView => "aten._unsafe_view",
            Transpose(..) => "aten.transpose",
            T => "aten.t",
            Permute(_) => "aten.permute",
            Expand => "aten.expand",
            Unsqueeze(_) => "aten.unsqueeze",
            Slice { .. } => "aten.slice",
            AsStridedInplace => "aten.as_strided_",
            Split { .. } => "aten.split_with_sizes",
            Clone { .. } => "aten.clone",
            ToDtype(_) | ToDtypeOf => "aten._to_copy",
            Add | AddScalar => "aten.add",
            Sub => "aten.sub",
            Mul | MulScalar => "aten.mul",
            Div | DivScalar => "aten.div",
            Neg => "aten.neg",
            PowScalar(_) => "aten.pow",
            Rsqrt => "aten.rsqrt",
            Tanh => "aten.tanh",
            Sigmoid => "aten.sigmoid",
            Relu => "aten.relu",
            Hardtanh => "aten.hardtanh",
            Gelu { .. } => "aten.gelu",
            Silu => "aten.silu",
            MeanDim { .. } => "aten.mean",
            Mm => "aten.mm",
            Addmm => "aten.addmm",
            Bmm => "aten.bmm",
            Softmax { .. } => "aten._softmax",
            LogSoftmax { .. } => "aten._log_softmax",
            NllLoss => "aten.nll_loss_forward",
            LayerNorm => "aten.native_layer_norm",
            Dropout { .. } => "aten.native_dropout",
            Embedding => "aten.embedding",
            Cat { .. } => "aten.cat",
            Sdpa {
                backend: FusedSdpa::Flash,
            } => "aten._scaled_dot_product_flash_attention",
            Sdpa {
                backend: FusedSdpa::MemEfficient,
            } => "aten._scaled_dot_product_efficient_attention",
            Sdpa {
                backend: FusedSdpa::Cudnn,
            } => "aten._scaled_dot_product_cudnn_attention",
            AutocastLower => "aten._to_copy",
            ReluInplace => "aten.relu_",
            HardtanhInplace => "aten.hardtanh_",
            SiluInplace => "aten.silu_",
            AddInplace { .. } => "aten.add_",
            Conv2d { .. } => "aten.convolution",
            BatchNorm => "aten.native_batch_norm",
            MaxPool2d { .. } => "aten.max_pool2d_with_indices",
            MeanDims { .. } => "aten.mean",
            AdaptiveAvgPool2d { .. } => "aten._adaptive_avg_pool2d",
            Select { .. } => "aten.select",
            Index => "aten.index",
            MseLoss => "aten.mse_loss",
            MaskedFill => "aten.masked_fill",
            Hardswish => "aten.hardswish",
            Hardsigmoid => "aten.hardsigmoid",
            HardswishInplace => "aten.hardswish_",
            HardsigmoidInplace => "aten.hardsigmoid_",
            DropoutInplace { .. } => "aten.mul_",
            AvgPool2d { .. } => "aten.avg_pool2d",
            Recorded(r) => r.name,
            SumDim { .. } => "aten.sum",
            TopK { .. } => "aten.topk",
            GroupedMm => "aten._grouped_mm",
            Factory { name, .. } => name,
            QuantLinear {
                quant: crate::finetune::Quant::Int8,
                ..
            } => "bitsandbytes.matmul",
            QuantLinear { .. } => "bitsandbytes.matmul_4bit",
            TpComm(c) => c.name(),
            MaskedFillInplace => "aten.masked_fill_",
            VocabParallelCrossEntropy => "megatron.vocab_parallel_cross_entropy",
        }
    }

    /// Whether the op is a view (its outputs alias input 0; `reshape` may copy instead).
    pub fn is_view(&self) -> bool {
        use OpKind::*;
        matches!(
            self,
            View | Reshape
                | UnsafeView
                | Transpose(..)
                | T
                | Permute(_)
                | Expand
                | Unsqueeze(_)
                | Slice { .. }
                | AsStridedInplace
                | Split { .. }
                | Select { .. }
        )
    }

    /// Whether the op writes into its first input instead of allocating (`relu_`, `add_`).
    pub fn is_inplace(&self) -> bool {
        matches!(
            self,
            OpKind::ReluInplace
                | OpKind::HardtanhInplace
                | OpKind::SiluInplace
                | OpKind::HardswishInplace
                | OpKind::HardsigmoidInplace
                | OpKind::DropoutInplace { .. }
                | OpKind::AddInplace { .. }
        )
    }
}

/// Where a recorded call's output or new saved tensor takes its dtype from.
#[derive(Clone, Debug, PartialEq)]
pub enum RecordedDType {
    /// The dtype input `j` has when the op runs (the capture saw them equal; under autocast the
    /// input may be 16-bit, and so is the result).
    Like(usize),
    /// A dtype of its own (`model`: the parameters' dtype).
    Spec(DTypeSpec),
}

/// An output of a recorded call.
#[derive(Clone, Debug, PartialEq)]
pub enum RecordedOut {
    /// A view of input `j` (the capture saw the output on that input's storage): its backward
    /// views the gradient back when the sizes agree.
    View(usize),
    /// Input `j` itself, written in place (the call returned its argument): no allocation; its
    /// backward allocates the input's gradient.
    InPlace(usize),
    /// A new contiguous tensor.
    New(RecordedDType),
}

/// A tensor autograd saved for a recorded call's node.
#[derive(Clone, Debug, PartialEq)]
pub enum RecordedSave {
    /// Input `j` (or a view of its storage): kept alive, nothing allocated.
    In(usize),
    /// Output `k`.
    Out(usize),
    /// A tensor the call made and only autograd keeps: allocated (before the outputs), then held
    /// by the node.
    New(Vec<u64>, RecordedDType),
}

/// What the capture recorded of a call without a rule ([`OpKind::Recorded`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    /// The call's name (the trace tag of what it allocates).
    pub name: &'static str,
    /// Its outputs.
    pub outs: Vec<RecordedOut>,
    /// The strides (in elements) the capture saw on each output that is a view, where recorded.
    pub view_strides: Vec<Option<Vec<u64>>>,
    /// What its autograd node saved (in packing order, one per storage).
    pub saves: Vec<RecordedSave>,
    /// Whether the capture saw an autograd node on its outputs (false: not differentiable).
    pub grad: bool,
    /// Its backward as the capture ran it, when recorded (else one new gradient per
    /// differentiable input, of the input's shape).
    pub backward: Option<RecordedBackward>,
    /// What autocast does with its floating arguments (its `AutocastCUDA` kernel's policy, read
    /// by the capture off the installed wheel; [`crate::autocast::Policy::None`] without one).
    pub autocast: crate::autocast::Policy,
}

/// One step of a recorded backward.
#[derive(Clone, Debug, PartialEq)]
pub enum RecordedStep {
    /// A new storage of `numel` elements.
    Alloc(u64, RecordedDType),
    /// Allocation `k` (in the order of the `Alloc` steps) died.
    Free(usize),
}

/// Where a recorded backward's gradient of one input comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum RecordedGrad {
    /// Allocation `k` of the steps.
    Alloc(usize),
    /// The incoming gradient itself (passed through).
    GradOutput,
}

/// What the capture recorded of a call's backward (`torch.autograd.grad` of its output under a
/// dispatch mode): the storages it allocated and freed, in order, and which became the inputs'
/// gradients.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedBackward {
    /// Allocations and frees, in order.
    pub steps: Vec<RecordedStep>,
    /// Per input of the call: where its gradient comes from (`None`: none was recorded).
    pub grads: Vec<Option<RecordedGrad>>,
}

/// A `'static` copy of a call's name (the trace tag of an [`OpKind::Recorded`] op), made once per
/// distinct name for the life of the process.
pub fn intern(name: &str) -> &'static str {
    use std::collections::BTreeSet;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<BTreeSet<&'static str>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(&n) = names.get(name) {
        return n;
    }
    let n: &'static str = Box::leak(name.to_string().into_boxed_str());
    names.insert(n);
    n
}

fn norm_dim(d: isize, n: usize) -> usize {
    if d < 0 {
        (n as isize + d) as usize
    } else {
        d as usize
    }
}

/// Builder methods, one per ATen op or eager composite; shapes follow PyTorch's rules.
impl GraphBuilder {
    // ---------------------------------------------------------------- views

    /// `x.view(shape)`; one entry may be `-1`.
    pub fn view(&mut self, x: T, shape: &[i64]) -> T {
        let s = self.infer_shape("view", x, shape);
        let d = self.dtype(x);
        self.op1(OpKind::View, &[x], s, d)
    }

    /// `x.reshape(shape)` (a view when possible, else a contiguous copy).
    pub fn reshape(&mut self, x: T, shape: &[i64]) -> T {
        let s = self.infer_shape("reshape", x, shape);
        let d = self.dtype(x);
        self.op1(OpKind::Reshape, &[x], s, d)
    }

    fn unsafe_view(&mut self, x: T, shape: Vec<u64>) -> T {
        let d = self.dtype(x);
        self.op1(OpKind::UnsafeView, &[x], shape, d)
    }

    fn infer_shape(&mut self, op: &str, x: T, shape: &[i64]) -> Vec<u64> {
        let n = numel(&self.shape(x));
        let known: u64 = shape
            .iter()
            .filter(|&&d| d >= 0)
            .fold(1u64, |a, &d| a.saturating_mul(d as u64));
        let out: Vec<u64> = shape
            .iter()
            .map(|&d| {
                if d < 0 {
                    n.checked_div(known).unwrap_or(0)
                } else {
                    d as u64
                }
            })
            .collect();
        if numel(&out) != n {
            self.fail(
                op,
                format!("shape {shape:?} is invalid for input of size {n}"),
            );
        }
        out
    }

    /// `x.transpose(d0, d1)` (negative dims count from the end).
    pub fn transpose(&mut self, x: T, d0: isize, d1: isize) -> T {
        let mut s = self.shape(x);
        let n = s.len();
        let (a, b) = (norm_dim(d0, n), norm_dim(d1, n));
        s.swap(a, b);
        let d = self.dtype(x);
        self.op1(OpKind::Transpose(a, b), &[x], s, d)
    }

    /// `w.t()` of a matrix.
    pub fn t(&mut self, x: T) -> T {
        let mut s = self.shape(x);
        s.reverse();
        let d = self.dtype(x);
        self.op1(OpKind::T, &[x], s, d)
    }

    /// `x.permute(dims)`.
    pub fn permute(&mut self, x: T, dims: &[usize]) -> T {
        let s0 = self.shape(x);
        let s = dims.iter().map(|&p| s0[p]).collect();
        let d = self.dtype(x);
        self.op1(OpKind::Permute(dims.to_vec()), &[x], s, d)
    }

    /// `x.expand(shape)`.
    pub fn expand(&mut self, x: T, shape: &[u64]) -> T {
        let d = self.dtype(x);
        self.op1(OpKind::Expand, &[x], shape.to_vec(), d)
    }

    /// `x.unsqueeze(dim)` / `x[:, None]`.
    pub fn unsqueeze(&mut self, x: T, dim: usize) -> T {
        let mut s = self.shape(x);
        s.insert(dim, 1);
        let d = self.dtype(x);
        self.op1(OpKind::Unsqueeze(dim), &[x], s, d)
    }

    /// `x[..., start:end]` along `dim` (negative dims count from the end).
    pub fn slice(&mut self, x: T, dim: isize, start: u64, end: u64) -> T {
        let mut s = self.shape(x);
        let dim = norm_dim(dim, s.len());
        s[dim] = end.min(s[dim]).saturating_sub(start);
        let d = self.dtype(x);
        self.op1(OpKind::Slice { dim, start }, &[x], s, d)
    }

    /// `if input.suggest_memory_format() == ChannelsLast: x.as_strided_(x.size(), strides)`:
    /// restrides `x` in place without changing its sizes (no memory) when `input` — the tensor `x`
    /// was pooled from — suggests channels-last (decided at lowering, where strides are known);
    /// the gradient then goes through `as_strided_backward`, which allocates zeros of the storage
    /// (see [`OpKind::AsStridedInplace`]). Otherwise `x` itself.
    pub fn as_strided_if_channels_last(&mut self, x: T, input: T) -> T {
        let (s, d) = (self.shape(x), self.dtype(x));
        self.op1(OpKind::AsStridedInplace, &[x, input], s, d)
    }

    /// `x.split(sizes, dim)` (`split_with_sizes`): views.
    pub fn split(&mut self, x: T, sizes: &[u64], dim: isize) -> Vec<T> {
        let s = self.shape(x);
        let dim = norm_dim(dim, s.len());
        if sizes.iter().sum::<u64>() != s[dim] {
            self.fail(
                "split",
                format!("sizes {sizes:?} do not add up to {}", s[dim]),
            );
        }
        let d = self.dtype(x);
        let outs: Vec<(Vec<u64>, DTypeSpec)> = sizes
            .iter()
            .map(|&n| {
                let mut o = s.clone();
                o[dim] = n;
                (o, d)
            })
            .collect();
        self.op(OpKind::Split { dim }, &[x], &outs)
    }

    // ---------------------------------------------------------------- copies

    /// `x.contiguous()`: a copy only when `x` is not contiguous.
    pub fn contiguous(&mut self, x: T) -> T {
        let (s, d) = (self.shape(x), self.dtype(x));
        self.op1(OpKind::Clone { contiguous: true }, &[x], s, d)
    }

    /// `x.clone()`.
    pub fn clone_t(&mut self, x: T) -> T {
        let (s, d) = (self.shape(x), self.dtype(x));
        self.op1(OpKind::Clone { contiguous: false }, &[x], s, d)
    }

    /// `x.to(dtype)` (`x.float()` is `to(F32)`): a copy only when the dtype changes.
    pub fn to_dtype(&mut self, x: T, dtype: DType) -> T {
        let s = self.shape(x);
        self.op1(OpKind::ToDtype(dtype), &[x], s, DTypeSpec::Fixed(dtype))
    }

    /// `x.to(other.dtype)`.
    pub fn to_dtype_of(&mut self, x: T, other: T) -> T {
        let s = self.shape(x);
        let d = self.dtype(other);
        self.op1(OpKind::ToDtypeOf, &[x, other], s, d)
    }

    // ---------------------------------------------------------------- elementwise

    fn binary(&mut self, kind: OpKind, name: &str, a: T, b: T) -> T {
        let s = self.broadcast_shape(name, a, b);
        let d = self.result_dtype(&[a, b]);
        self.op1(kind, &[a, b], s, d)
    }

    fn unary(&mut self, kind: OpKind, x: T) -> T {
        let (s, d) = (self.shape(x), self.dtype(x));
        self.op1(kind, &[x], s, d)
    }

    /// `a + b`.
    pub fn add(&mut self, a: T, b: T) -> T {
        self.binary(OpKind::Add, "add", a, b)
    }
    /// `a - b`.
    pub fn sub(&mut self, a: T, b: T) -> T {
        self.binary(OpKind::Sub, "sub", a, b)
    }
    /// `a * b`.
    pub fn mul(&mut self, a: T, b: T) -> T {
        self.binary(OpKind::Mul, "mul", a, b)
    }
    /// `a / b`.
    pub fn div(&mut self, a: T, b: T) -> T {
        self.binary(OpKind::Div, "div", a, b)
    }
    /// `x + c` for a Python number `c`.
    pub fn add_scalar(&mut self, x: T) -> T {
        self.unary(OpKind::AddScalar, x)
    }
    /// `x * c` (or `c * x`) for a Python number `c`.
    pub fn mul_scalar(&mut self, x: T) -> T {
        self.unary(OpKind::MulScalar, x)
    }
    /// `x / c` for a Python number `c`.
    pub fn div_scalar(&mut self, x: T) -> T {
        self.unary(OpKind::DivScalar, x)
    }
    /// `-x`.
    pub fn neg(&mut self, x: T) -> T {
        self.unary(OpKind::Neg, x)
    }
    /// `x.pow(e)` / `torch.pow(x, e)`.
    pub fn pow(&mut self, x: T, e: f64) -> T {
        self.unary(OpKind::PowScalar(e), x)
    }
    /// `torch.rsqrt(x)`.
    pub fn rsqrt(&mut self, x: T) -> T {
        self.unary(OpKind::Rsqrt, x)
    }
    /// `torch.tanh(x)`.
    pub fn tanh(&mut self, x: T) -> T {
        self.unary(OpKind::Tanh, x)
    }
    /// `torch.sigmoid(x)` (`nn.Sigmoid`).
    pub fn sigmoid(&mut self, x: T) -> T {
        self.unary(OpKind::Sigmoid, x)
    }
    /// `F.relu(x)` (not in place).
    pub fn relu(&mut self, x: T) -> T {
        self.unary(OpKind::Relu, x)
    }
    /// `F.hardtanh(x, min_val, max_val)` (`nn.ReLU6()` is `hardtanh(x, 0, 6)`), not in place.
    pub fn hardtanh(&mut self, x: T) -> T {
        self.unary(OpKind::Hardtanh, x)
    }
    /// `F.hardtanh(x, min_val, max_val, inplace=True)` (`nn.ReLU6(inplace=True)`): writes into
    /// `x`; use the returned handle afterwards.
    pub fn hardtanh_(&mut self, x: T) -> T {
        self.unary(OpKind::HardtanhInplace, x)
    }
    /// `F.silu(x, inplace=True)` (`nn.SiLU(inplace=True)`): writes into `x`; use the returned
    /// handle afterwards.
    pub fn silu_(&mut self, x: T) -> T {
        self.unary(OpKind::SiluInplace, x)
    }
    /// `F.gelu(x, approximate=...)` (one ATen op).
    pub fn gelu(&mut self, x: T, tanh: bool) -> T {
        self.unary(OpKind::Gelu { tanh }, x)
    }
    /// `F.silu(x)`.
    pub fn silu(&mut self, x: T) -> T {
        self.unary(OpKind::Silu, x)
    }

    /// `F.hardswish(x)`.
    pub fn hardswish(&mut self, x: T) -> T {
        self.unary(OpKind::Hardswish, x)
    }
    /// `F.hardsigmoid(x)`.
    pub fn hardsigmoid(&mut self, x: T) -> T {
        self.unary(OpKind::Hardsigmoid, x)
    }
    /// `F.hardswish(x, inplace=True)`: writes into `x`; use the returned handle afterwards.
    pub fn hardswish_(&mut self, x: T) -> T {
        self.unary(OpKind::HardswishInplace, x)
    }
    /// `F.hardsigmoid(x, inplace=True)`: writes into `x`; use the returned handle afterwards.
    pub fn hardsigmoid_(&mut self, x: T) -> T {
        self.unary(OpKind::HardsigmoidInplace, x)
    }
    /// `F.dropout(x, p, training=True, inplace=True)` for `0 < p < 1` (see
    /// [`OpKind::DropoutInplace`]): writes into `x`; `p == 0` returns `x` itself.
    pub fn dropout_(&mut self, x: T, p: f64) -> T {
        if p <= 0.0 {
            return x;
        }
        self.unary(OpKind::DropoutInplace { p }, x)
    }

    /// `x.relu_()` (`nn.ReLU(inplace=True)`): writes into `x`; use the returned handle afterwards
    /// (it carries the new autograd history, as the Python object does).
    pub fn relu_(&mut self, x: T) -> T {
        self.unary(OpKind::ReluInplace, x)
    }

    /// `a += b` (`a.add_(b)`): `b` broadcasts to `a`'s shape and `a` keeps its dtype; use the
    /// returned handle afterwards.
    pub fn add_(&mut self, a: T, b: T) -> T {
        self.add_inplace(a, b, false)
    }

    fn add_inplace(&mut self, a: T, b: T, composite: bool) -> T {
        let (sa, sb) = (self.shape(a), self.shape(b));
        if broadcast(&sa, &sb).as_ref() != Some(&sa) {
            self.fail(
                "add_",
                format!("{sb:?} does not broadcast to the in-place operand's {sa:?}"),
            );
        }
        let d = self.dtype(a);
        self.op1(OpKind::AddInplace { composite }, &[a, b], sa, d)
    }

    /// `x.mean(dims, keepdim)` over several dimensions (negative dims count from the end).
    pub fn mean_dims(&mut self, x: T, dims: &[isize], keepdim: bool) -> T {
        let s0 = self.shape(x);
        let mut dims: Vec<usize> = dims.iter().map(|&d| norm_dim(d, s0.len())).collect();
        dims.sort_unstable();
        dims.dedup();
        let s: Vec<u64> = s0
            .iter()
            .enumerate()
            .filter_map(|(i, &n)| match (dims.contains(&i), keepdim) {
                (false, _) => Some(n),
                (true, true) => Some(1),
                (true, false) => None,
            })
            .collect();
        let d = self.dtype(x);
        self.op1(OpKind::MeanDims { dims, keepdim }, &[x], s, d)
    }

    /// `x.mean(dim, keepdim)`.
    pub fn mean_dim(&mut self, x: T, dim: isize, keepdim: bool) -> T {
        let mut s = self.shape(x);
        let dim = norm_dim(dim, s.len());
        if keepdim {
            s[dim] = 1;
        } else {
            s.remove(dim);
        }
        let d = self.dtype(x);
        self.op1(OpKind::MeanDim { dim, keepdim }, &[x], s, d)
    }

    /// `x.sum(dims, keepdim)`.
    pub fn sum_dims(&mut self, x: T, dims: &[isize], keepdim: bool) -> T {
        let s = self.shape(x);
        let mut dims: Vec<usize> = dims.iter().map(|&d| norm_dim(d, s.len())).collect();
        dims.sort_unstable();
        dims.dedup();
        let out: Vec<u64> = s
            .iter()
            .enumerate()
            .filter_map(|(i, &d)| match (dims.contains(&i), keepdim) {
                (false, _) => Some(d),
                (true, true) => Some(1),
                (true, false) => None,
            })
            .collect();
        let d = self.dtype(x);
        self.op1(OpKind::SumDim { dims, keepdim }, &[x], out, d)
    }

    /// `torch.topk(x, k, dim)`: `(values, indices)`.
    pub fn topk(&mut self, x: T, k: u64, dim: isize) -> (T, T) {
        let mut s = self.shape(x);
        let dim = norm_dim(dim, s.len());
        if s.get(dim).is_none_or(|&n| k > n) {
            self.fail("topk", format!("k {k} is larger than dim {dim} of {s:?}"));
        } else {
            s[dim] = k;
        }
        let d = self.dtype(x);
        let o = self.op(
            OpKind::TopK { dim },
            &[x],
            &[
                (s.clone(), d),
                (s, DTypeSpec::Fixed(crate::dtype::DType::I64)),
            ],
        );
        (o[0], o[1])
    }

    /// `torch._grouped_mm(a, b, offs)`: `a` `[M, K]`, `b` `[E, K, N]` → `[M, N]` in `a`'s dtype
    /// (`offs`, an int32 `[E]`, is read only).
    pub fn grouped_mm(&mut self, a: T, b: T, offs: T) -> T {
        let (sa, sb) = (self.shape(a), self.shape(b));
        if sa.len() != 2 || sb.len() != 3 || sa[1] != sb[1] {
            self.fail(
                "grouped_mm",
                format!("{sa:?} by {sb:?}: expected [M, K] by [E, K, N]"),
            );
        }
        let out = vec![sa[0], *sb.last().unwrap_or(&0)];
        let d = self.dtype(a);
        self.op1(OpKind::GroupedMm, &[a, b, offs], out, d)
    }

    /// `x[idx]` with one int64 index tensor over the first dimension (`aten.index`): `[idx.shape,
    /// x.shape[1..]]`, a new tensor.
    pub fn index1(&mut self, x: T, idx: T) -> T {
        let s = self.shape(x);
        let mut out = self.shape(idx);
        out.extend(s.iter().skip(1));
        let d = self.dtype(x);
        self.op1(OpKind::Index, &[x, idx], out, d)
    }

    // ---------------------------------------------------------------- matrix products

    /// `torch.mm(a, b)`.
    pub fn mm(&mut self, a: T, b: T) -> T {
        let (sa, sb) = (self.shape(a), self.shape(b));
        if sa.len() != 2 || sb.len() != 2 || sa[1] != sb[0] {
            self.fail("mm", format!("cannot multiply {sa:?} by {sb:?}"));
        }
        let d = self.result_dtype(&[a, b]);
        self.op1(OpKind::Mm, &[a, b], vec![sa[0], sb[sb.len() - 1]], d)
    }

    /// `torch.addmm(bias, a, b)`.
    pub fn addmm(&mut self, bias: T, a: T, b: T) -> T {
        let (sa, sb) = (self.shape(a), self.shape(b));
        if sa.len() != 2 || sb.len() != 2 || sa[1] != sb[0] {
            self.fail("addmm", format!("cannot multiply {sa:?} by {sb:?}"));
        }
        let d = self.result_dtype(&[a, b]);
        self.op1(OpKind::Addmm, &[bias, a, b], vec![sa[0], sb[1]], d)
    }

    /// `torch.bmm(a, b)`.
    pub fn bmm(&mut self, a: T, b: T) -> T {
        let (sa, sb) = (self.shape(a), self.shape(b));
        if sa.len() != 3 || sb.len() != 3 || sa[2] != sb[1] || sa[0] != sb[0] {
            self.fail("bmm", format!("cannot multiply {sa:?} by {sb:?}"));
        }
        let d = self.result_dtype(&[a, b]);
        self.op1(OpKind::Bmm, &[a, b], vec![sa[0], sa[1], sb[2]], d)
    }

    /// `torch.matmul(a, b)` as ATen's `_matmul_impl` runs it: `mm` for matrices, a folded `mm`
    /// for N-D × matrix, and `expand` + `reshape` + `bmm` + `_unsafe_view` for batched operands
    /// (the reshapes copy when the operands are transposed views).
    pub fn matmul(&mut self, a: T, b: T) -> T {
        let a = self.autocast_lower(a);
        let b = self.autocast_lower(b);
        let (sa, sb) = (self.shape(a), self.shape(b));
        match (sa.len(), sb.len()) {
            (2, 2) => self.mm(a, b),
            (n, 2) if n >= 3 => {
                let k = sa[n - 1];
                let folded = self.reshape(a, &[-1, k as i64]);
                let out = self.mm(folded, b);
                let mut shape = sa[..n - 1].to_vec();
                shape.push(sb[1]);
                self.unsafe_view(out, shape)
            }
            (na, nb) if na >= 3 && nb >= 3 => {
                let (n, m1) = (sa[na - 2], sa[na - 1]);
                let (m2, p) = (sb[nb - 2], sb[nb - 1]);
                if m1 != m2 {
                    self.fail("matmul", format!("cannot multiply {sa:?} by {sb:?}"));
                }
                let batch = match broadcast(&sa[..na - 2], &sb[..nb - 2]) {
                    Some(s) => s,
                    None => {
                        self.fail(
                            "matmul",
                            format!("batch dims of {sa:?} and {sb:?} do not broadcast"),
                        );
                        sa[..na - 2].to_vec()
                    }
                };
                let bp: u64 = numel(&batch);
                let mut e1 = batch.clone();
                e1.extend([n, m1]);
                let mut e2 = batch.clone();
                e2.extend([m2, p]);
                let a1 = self.expand(a, &e1);
                let a2 = self.reshape(a1, &[bp as i64, n as i64, m1 as i64]);
                let b1 = self.expand(b, &e2);
                let b2 = self.reshape(b1, &[bp as i64, m2 as i64, p as i64]);
                let out = self.bmm(a2, b2);
                let mut shape = batch;
                shape.extend([n, p]);
                self.unsafe_view(out, shape)
            }
            _ => {
                self.fail(
                    "matmul",
                    format!("unsupported operand ranks {sa:?} @ {sb:?}"),
                );
                a
            }
        }
    }

    /// `F.linear(x, w, b)` as `at::linear` runs it: `addmm(b, x, w.t())` for 2-D input with bias,
    /// `_flatten_nd_linear` (`reshape` + `addmm` + `view`) for N-D input with bias, and
    /// `matmul(x, w.t())` without bias.
    pub fn linear_op(&mut self, x: T, w: T, bias: Option<T>) -> T {
        let x = self.autocast_lower(x);
        let w = self.autocast_lower(w);
        let bias = bias.map(|b| self.autocast_lower(b));
        let sx = self.shape(x);
        match bias {
            Some(b) if sx.len() == 2 => {
                let wt = self.t(w);
                self.addmm(b, x, wt)
            }
            Some(b) => {
                let k = sx[sx.len() - 1];
                let flat = self.reshape(x, &[-1, k as i64]);
                let wt = self.t(w);
                let out = self.addmm(b, flat, wt);
                let mut shape: Vec<i64> = sx[..sx.len() - 1].iter().map(|&d| d as i64).collect();
                shape.push(self.shape(w)[0] as i64);
                self.view(out, &shape)
            }
            None => {
                let wt = self.t(w);
                self.matmul(x, wt)
            }
        }
    }

    // ---------------------------------------------------------------- nn

    /// Autocast's cast of a `lower_precision_fp` composite's argument (see [`OpKind::AutocastLower`]).
    pub fn autocast_lower(&mut self, x: T) -> T {
        let (s, d) = (self.shape(x), self.dtype(x));
        if !self.g_value_differentiable(x) {
            return x;
        }
        self.op1(OpKind::AutocastLower, &[x], s, d)
    }

    /// `F.softmax(x, dim)`; `to_f32` is `dtype=torch.float32`.
    pub fn softmax(&mut self, x: T, dim: isize, to_f32: bool) -> T {
        let s = self.shape(x);
        let dim = norm_dim(dim, s.len());
        let d = if to_f32 {
            DTypeSpec::Fixed(DType::F32)
        } else {
            self.dtype(x)
        };
        self.op1(OpKind::Softmax { dim, to_f32 }, &[x], s, d)
    }

    /// `F.log_softmax(x, dim)`.
    pub fn log_softmax(&mut self, x: T, dim: isize) -> T {
        self.log_softmax_op(x, dim, false)
    }

    /// `_log_softmax(x, dim)`; `explicit_dtype`: called with `dtype=x.dtype` given.
    fn log_softmax_op(&mut self, x: T, dim: isize, explicit_dtype: bool) -> T {
        let s = self.shape(x);
        let dim = norm_dim(dim, s.len());
        let d = self.dtype(x);
        self.op1(
            OpKind::LogSoftmax {
                dim,
                explicit_dtype,
            },
            &[x],
            s,
            d,
        )
    }

    /// `F.nll_loss(logp, target)` (mean reduction): the scalar loss.
    pub fn nll_loss(&mut self, logp: T, target: T) -> T {
        let d = self.dtype(logp);
        self.op(
            OpKind::NllLoss,
            &[logp, target],
            &[(vec![], d), (vec![], d)],
        )[0]
    }

    /// `x[rows, cols]` with two int64 index tensors of shape `[N]`: `[N, x.shape[2..]]`.
    pub fn index2(&mut self, x: T, rows: T, cols: T) -> T {
        let s = self.shape(x);
        let n = self.shape(rows);
        if s.len() < 2 || n != self.shape(cols) {
            self.fail(
                "aten.index",
                format!(
                    "indices {n:?} and {:?} into {s:?}: two index tensors of one shape over the first two dimensions",
                    self.shape(cols)
                ),
            );
        }
        let mut out = n.clone();
        out.extend(s.iter().skip(2));
        let d = self.dtype(x);
        self.op1(OpKind::Index, &[x, rows, cols], out, d)
    }

    /// `F.mse_loss(input, target)` (mean reduction): the scalar loss, in the input's dtype.
    pub fn mse_loss(&mut self, input: T, target: T) -> T {
        let d = self.dtype(input);
        self.op1(OpKind::MseLoss, &[input, target], vec![], d)
    }

    /// `F.cross_entropy(logits, target)` = `log_softmax` + `nll_loss`: `cross_entropy_loss`
    /// (`aten/src/ATen/native/LossNLL.cpp`, class-index targets) calls
    /// `at::log_softmax(self, class_dim, self.scalar_type())`, with an explicit dtype (the logits'
    /// own), then `at::nll_loss_nd`. `cross_entropy_loss` has no autocast kernel of its own, so under
    /// autocast the log-softmax stays in the logits' dtype and `nll_loss` (fp32 list) casts it.
    pub fn cross_entropy(&mut self, logits: T, target: T) -> T {
        let lp = self.log_softmax_op(logits, -1, true);
        self.nll_loss(lp, target)
    }

    /// `x.masked_fill(mask, value)` for a bool `mask` that broadcasts to `x` and a scalar value.
    pub fn masked_fill(&mut self, x: T, mask: T) -> T {
        let s = self.shape(x);
        if broadcast(&s, &self.shape(mask)).as_ref() != Some(&s) {
            self.fail(
                "masked_fill",
                format!(
                    "mask {:?} does not broadcast to the input's {s:?}",
                    self.shape(mask)
                ),
            );
        }
        let d = self.dtype(x);
        self.op1(OpKind::MaskedFill, &[x, mask], s, d)
    }

    /// `F.layer_norm(x, [h], w, b)` (`native_layer_norm`: mean and rstd are float32 when x is 16-bit
    /// on CUDA, shape `[..., 1]`).
    pub fn layer_norm_op(&mut self, x: T, w: T, b: T) -> T {
        self.layer_norm_op_opt(x, w, Some(b))
    }

    /// [`GraphBuilder::layer_norm_op`] with an optional bias (`F.layer_norm(x, [h], w, None)`,
    /// nanoGPT's `LayerNorm(ndim, bias=False)`): without one the op has two inputs.
    pub fn layer_norm_op_opt(&mut self, x: T, w: T, b: Option<T>) -> T {
        let s = self.shape(x);
        let mut stat = s.clone();
        if let Some(l) = stat.last_mut() {
            *l = 1;
        }
        let d = self.dtype(x);
        let inputs: Vec<T> = [Some(x), Some(w), b].into_iter().flatten().collect();
        self.op(
            OpKind::LayerNorm,
            &inputs,
            &[
                (s, d),
                (stat.clone(), DTypeSpec::Fixed(DType::F32)),
                (stat, DTypeSpec::Fixed(DType::F32)),
            ],
        )[0]
    }

    /// `F.dropout(x, p, training=True)`: `native_dropout` on CUDA for `0 < p < 1`, identity for
    /// `p == 0` (`aten/src/ATen/native/Dropout.cpp`).
    pub fn dropout(&mut self, x: T, p: f64) -> T {
        if p <= 0.0 {
            return x;
        }
        let (s, d) = (self.shape(x), self.dtype(x));
        self.op(
            OpKind::Dropout { p },
            &[x],
            &[(s.clone(), d), (s, DTypeSpec::Fixed(DType::Bool))],
        )[0]
    }

    /// `F.embedding(ids, weight)`.
    pub fn embedding_op(&mut self, weight: T, ids: T) -> T {
        let mut s = self.shape(ids);
        s.push(self.shape(weight)[1]);
        let d = self.dtype(weight);
        self.op1(OpKind::Embedding, &[weight, ids], s, d)
    }

    /// `torch.cat(tensors, dim)`.
    pub fn cat(&mut self, xs: &[T], dim: isize) -> T {
        let mut s = self.shape(xs[0]);
        let dim = norm_dim(dim, s.len());
        s[dim] = xs.iter().map(|&x| self.shape(x)[dim]).sum();
        let d = self.result_dtype(xs);
        self.op1(OpKind::Cat { dim }, xs, s, d)
    }

    /// `F.scaled_dot_product_attention(q, k, v)` without mask or dropout on `backend`: see
    /// [`GraphBuilder::sdpa_with`].
    pub fn sdpa(&mut self, q: T, k: T, v: T, backend: SdpaBackend) -> T {
        self.sdpa_with(q, k, v, backend, false, 0.0)
    }

    /// `F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)` (no mask;
    /// `enable_gqa=True` when k and v have fewer heads) on `backend`; `q` is `[B, H, L, D]`,
    /// `k`/`v` `[B, Hkv, S, D]`. A fused backend is one op (output and logsumexp; the other
    /// outputs are allocated by the lowering); the math backend is its composite.
    pub fn sdpa_with(
        &mut self,
        q: T,
        k: T,
        v: T,
        backend: SdpaBackend,
        causal: bool,
        dropout: f64,
    ) -> T {
        let fused = match backend {
            SdpaBackend::Flash => FusedSdpa::Flash,
            SdpaBackend::MemEfficient => FusedSdpa::MemEfficient,
            SdpaBackend::Cudnn => FusedSdpa::Cudnn,
            SdpaBackend::Math => return self.sdpa_math(q, k, v, causal, dropout),
        };
        let s = self.shape(q);
        let d = self.dtype(q);
        let lse = vec![s[0], s[1], s[2]];
        // Outputs (attn_output, logsumexp); the logsumexp's padding and the kernels' small
        // outputs (rng state, seed, offset) are the lowering's.
        self.op(
            OpKind::Sdpa { backend: fused },
            &[q, k, v],
            &[(s, d), (lse, DTypeSpec::Fixed(DType::F32))],
        )[0]
    }

    /// `x` `[B, Hkv, S, D]` with each head repeated to `h` heads, `[B, h, S, D]`:
    /// `x[:, :, None].expand(B, Hkv, h / Hkv, S, D).reshape(B, h, S, D)` (HF's `repeat_kv`; ATen's
    /// `repeat_interleave` of k and v in SDPA's math path amounts to the same copy). The reshape
    /// of the expanded view copies.
    pub fn repeat_heads(&mut self, x: T, h: u64) -> T {
        let xs = self.shape(x);
        let (bsz, hkv, s, d) = (xs[0], xs[1], xs[2], xs[3]);
        let u = self.unsqueeze(x, 2);
        let e = self.expand(u, &[bsz, hkv, h / hkv, s, d]);
        self.reshape(e, &[bsz as i64, h as i64, s as i64, d as i64])
    }

    /// `_scaled_dot_product_attention_math` (`aten/src/ATen/native/transformers/attention.cpp`),
    /// the composite every other backend falls back to, as its ATen ops run with autocast
    /// excluded (the autocast wrapper of `scaled_dot_product_attention` casts q, k, v to the
    /// autocast dtype and calls it under `ExcludeDispatchKeyGuard(Autocast)`):
    /// 16-bit q, k, v `.to(float32)` (`allow_fp16_bf16_reduction_math_sdp` is off by default),
    /// `q * √scale`; with `is_causal` a `[L, S]` boolean `ones().tril()` turned into an additive
    /// mask of q's dtype (`convert_boolean_attn_mask`: `where(mask.logical_not(), -inf, 0)`);
    /// for GQA `repeat_interleave` of k and v (`pre_process_group_query_attention_input`,
    /// written as the expand-and-copy it amounts to); `matmul(q, kᵀ * √scale)`; `attn.add_(mask)`;
    /// `_safe_softmax`; `dropout`; `matmul(attn, v).to(origin_dtype)` and the discarded
    /// `attn.to(origin_dtype)` of the returned tuple (made first: GCC evaluates the tuple's
    /// arguments right to left). The C++ locals (`query_acc`, `key_acc`, `value_acc`, the mask,
    /// the tuple) live until the function returns.
    fn sdpa_math(&mut self, q: T, k: T, v: T, causal: bool, dropout: f64) -> T {
        let (qs, ks) = (self.shape(q), self.shape(k));
        let (h, l) = (qs[1], qs[2]);
        let (hkv, s) = (ks[1], ks[2]);
        // The autocast wrapper's casts, held until the call returns.
        self.push_module("");
        let q = self.autocast_lower(q);
        let k = self.autocast_lower(k);
        let v = self.autocast_lower(v);
        for t in [q, k, v] {
            self.hold(t);
        }
        let out = self.without_autocast(|b| {
            let q_acc = b.to_dtype(q, DType::F32);
            let k_acc = b.to_dtype(k, DType::F32);
            let v_acc = b.to_dtype(v, DType::F32);
            for t in [q_acc, k_acc, v_acc] {
                b.hold(t);
            }
            let query = b.mul_scalar(q_acc);
            let mask = if causal {
                // at::ones({L, S}, bool).tril(), then convert_boolean_attn_mask: where(
                // mask.logical_not(), -inf, 0) in q's dtype. The boolean temporaries are
                // written as the factory's short-lived ones, each freed before the next; in
                // PyTorch the tril'd mask is still held while logical_not and where run (L·S
                // bytes more for that moment, not modelled).
                let m = b.factory(
                    "aten.where",
                    &[],
                    &[l, s],
                    DTypeSpec::Fixed(DType::F32),
                    vec![(vec![l, s], DType::Bool), (vec![l, s], DType::Bool)],
                );
                b.hold(m);
                Some(m)
            } else {
                None
            };
            let (k_e, v_e) = if hkv != h && hkv > 0 {
                let ke = b.repeat_heads(k_acc, h);
                let ve = b.repeat_heads(v_acc, h);
                (ke, ve)
            } else {
                (k_acc, v_acc)
            };
            let kt = b.transpose(k_e, -2, -1);
            let kt = b.mul_scalar(kt);
            let attn = b.matmul(query, kt);
            let attn = match mask {
                Some(m) => b.add_(attn, m),
                None => attn,
            };
            let attn = b.softmax(attn, -1, false);
            let attn = b.dropout(attn, dropout);
            let discarded = b.to_dtype_of(attn, q);
            b.hold(discarded);
            let o = b.matmul(attn, v_e);
            b.to_dtype_of(o, q)
        });
        self.pop_module("");
        out
    }
    /// `F.conv2d(x, w, b, stride, padding, dilation, groups)` on `x` `[N, C, H, W]` and `w`
    /// `[O, C/groups, kH, kW]`: output `[N, O, H', W']` with
    /// `H' = ⌊(H + 2·pad − dil·(kH − 1) − 1) / stride⌋ + 1`.
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d_op(
        &mut self,
        x: T,
        w: T,
        bias: Option<T>,
        stride: [u64; 2],
        padding: [u64; 2],
        dilation: [u64; 2],
        groups: u64,
    ) -> T {
        let (sx, sw) = (self.shape(x), self.shape(w));
        let mut out = vec![0u64; 4];
        if sx.len() != 4
            || sw.len() != 4
            || groups == 0
            || sx[1] != sw[1] * groups
            || sw[0] % groups != 0
            || stride.contains(&0)
            || dilation.contains(&0)
        {
            self.fail(
                "conv2d",
                format!("input {sx:?} and weight {sw:?} (groups {groups}, stride {stride:?}, dilation {dilation:?}) do not fit"),
            );
        } else {
            out[0] = sx[0];
            out[1] = sw[0];
            for d in 0..2 {
                let span = dilation[d] * (sw[2 + d] - 1) + 1;
                let padded = sx[2 + d] + 2 * padding[d];
                if padded < span {
                    self.fail(
                        "conv2d",
                        format!(
                            "input {sx:?} padded by {padding:?} is smaller than the kernel {sw:?}"
                        ),
                    );
                } else {
                    out[2 + d] = (padded - span) / stride[d] + 1;
                }
            }
        }
        let mut ins = vec![x, w];
        ins.extend(bias);
        let d = self.result_dtype(&[x, w]);
        self.op1(
            OpKind::Conv2d {
                stride,
                padding,
                dilation,
                groups,
            },
            &ins,
            out,
            d,
        )
    }

    /// `F.batch_norm(x, running_mean, running_var, w, b, training=True)` on `[N, C, ...]`: the
    /// output (statistics `save_mean`/`save_invstd` `[C]` are outputs 1 and 2).
    pub fn batch_norm_op(&mut self, x: T, w: T, b: T, running_mean: T, running_var: T) -> T {
        let s = self.shape(x);
        if s.len() < 2 || self.shape(w) != [s[1]] {
            let sw = self.shape(w);
            self.fail(
                "batch_norm",
                format!("input {s:?} and weight {sw:?} do not fit"),
            );
        }
        let c = s.get(1).copied().unwrap_or(0);
        let d = self.dtype(x);
        self.op(
            OpKind::BatchNorm,
            &[x, w, b, running_mean, running_var],
            &[
                (s, d),
                (vec![c], DTypeSpec::Fixed(DType::F32)),
                (vec![c], DTypeSpec::Fixed(DType::F32)),
            ],
        )[0]
    }

    /// `F.max_pool2d(x, kernel, stride, padding)` in training (`max_pool2d_with_indices`, floor
    /// mode, dilation 1): the output (the int64 indices are output 1).
    pub fn max_pool2d(&mut self, x: T, kernel: [u64; 2], stride: [u64; 2], padding: [u64; 2]) -> T {
        self.max_pool2d_ceil(x, kernel, stride, padding, false)
    }

    /// [`GraphBuilder::max_pool2d`] with `ceil_mode` (SqueezeNet's `MaxPool2d(3, 2,
    /// ceil_mode=True)`): the output size of [`pool_out`].
    pub fn max_pool2d_ceil(
        &mut self,
        x: T,
        kernel: [u64; 2],
        stride: [u64; 2],
        padding: [u64; 2],
        ceil_mode: bool,
    ) -> T {
        let out = self.pool_shape("max_pool2d", x, kernel, stride, padding, ceil_mode);
        let dt = self.dtype(x);
        self.op(
            OpKind::MaxPool2d {
                kernel,
                stride,
                padding,
            },
            &[x],
            &[(out.clone(), dt), (out, DTypeSpec::Fixed(DType::I64))],
        )[0]
    }

    /// `F.avg_pool2d(x, kernel, stride, padding, ceil_mode)` (see [`OpKind::AvgPool2d`]).
    pub fn avg_pool2d(
        &mut self,
        x: T,
        kernel: [u64; 2],
        stride: [u64; 2],
        padding: [u64; 2],
        ceil_mode: bool,
    ) -> T {
        let out = self.pool_shape("avg_pool2d", x, kernel, stride, padding, ceil_mode);
        let dt = self.dtype(x);
        self.op1(OpKind::AvgPool2d { kernel, stride }, &[x], out, dt)
    }

    /// The output shape of a 2-D pooling of `x` (NCHW), each spatial size by [`pool_out`].
    fn pool_shape(
        &mut self,
        op: &str,
        x: T,
        kernel: [u64; 2],
        stride: [u64; 2],
        padding: [u64; 2],
        ceil_mode: bool,
    ) -> Vec<u64> {
        let s = self.shape(x);
        let mut out = s.clone();
        if s.len() != 4
            || stride.contains(&0)
            || (0..2).any(|d| s[2 + d] + 2 * padding[d] < kernel[d])
        {
            self.fail(
                op,
                format!("input {s:?} does not fit kernel {kernel:?}, stride {stride:?}, padding {padding:?}"),
            );
        } else {
            for d in 0..2 {
                out[2 + d] = pool_out(s[2 + d], kernel[d], stride[d], padding[d], ceil_mode);
            }
        }
        out
    }

    /// A call without a rule, as the capture recorded it (see [`OpKind::Recorded`]): `outs` are
    /// the outputs' shapes and graph dtypes.
    pub fn recorded(
        &mut self,
        rec: Recorded,
        inputs: &[T],
        outs: &[(Vec<u64>, DTypeSpec)],
    ) -> Vec<T> {
        self.op(OpKind::Recorded(Box::new(rec)), inputs, outs)
    }

    /// `F.adaptive_avg_pool2d(x, out)`: `x.mean((-1, -2), keepdim=True)` for a 1×1 output (ATen's
    /// shortcut; `as_strided_` to channels-last strides when `x` suggests channels-last), else
    /// `_adaptive_avg_pool2d`.
    pub fn adaptive_avg_pool2d(&mut self, x: T, out: [u64; 2]) -> T {
        if out == [1, 1] {
            // AdaptiveAveragePooling.cpp: `input.mean({-1, -2}, keepdim=true)`, restrided in place
            // to channels-last when the input suggests it.
            let m = self.mean_dims(x, &[-1, -2], true);
            return self.as_strided_if_channels_last(m, x);
        }
        let mut s = self.shape(x);
        if s.len() != 4 {
            self.fail("adaptive_avg_pool2d", format!("input {s:?} is not 4-D"));
            return x;
        }
        s[2] = out[0];
        s[3] = out[1];
        let d = self.dtype(x);
        self.op1(OpKind::AdaptiveAvgPool2d { out }, &[x], s, d)
    }

    /// `torch.flatten(x, start_dim)`: a `reshape` (a view when the strides allow).
    pub fn flatten(&mut self, x: T, start_dim: usize) -> T {
        let s = self.shape(x);
        let start = start_dim.min(s.len());
        let mut shape: Vec<i64> = s[..start].iter().map(|&d| d as i64).collect();
        shape.push(numel(&s[start..]).min(i64::MAX as u64) as i64);
        self.reshape(x, &shape)
    }

    /// `x.select(dim, index)` / `x[:, index]` (a view; negative dims count from the end).
    pub fn select(&mut self, x: T, dim: isize, index: u64) -> T {
        let mut s = self.shape(x);
        let dim = norm_dim(dim, s.len());
        if dim >= s.len() || index >= s[dim] {
            self.fail(
                "select",
                format!("index {index} of dim {dim} is out of {s:?}"),
            );
            return x;
        }
        s.remove(dim);
        let d = self.dtype(x);
        self.op1(OpKind::Select { dim, index }, &[x], s, d)
    }

    /// `F.linear(x, w, b)` for an N-D input that is not contiguous (`at::linear`'s fallback):
    /// `matmul(x, w.t())` then `output.add_(bias)` — an out-of-place `add` under a dispatch mode.
    pub fn linear_strided(&mut self, x: T, w: T, bias: Option<T>) -> T {
        let x = self.autocast_lower(x);
        let w = self.autocast_lower(w);
        let bias = bias.map(|b| self.autocast_lower(b));
        let wt = self.t(w);
        let out = self.matmul(x, wt);
        match bias {
            Some(b) => self.add_inplace(out, b, true),
            None => out,
        }
    }

    /// A non-differentiable computation (`name` for the tag) making one output of `shape`/`dtype`
    /// from `inputs`, with short-lived `temps` along the way.
    pub fn factory(
        &mut self,
        name: &'static str,
        inputs: &[T],
        shape: &[u64],
        dtype: DTypeSpec,
        temps: Vec<(Vec<u64>, DType)>,
    ) -> T {
        self.op1(
            OpKind::Factory { name, temps },
            inputs,
            shape.to_vec(),
            dtype,
        )
    }
}

use crate::layout::broadcast;

/// `pooling_output_shape` (`aten/src/ATen/native/Pool.h`) with dilation 1:
/// `⌊(size + 2·pad − kernel + (ceil ? stride − 1 : 0)) / stride⌋ + 1`, less one when ceil mode
/// would start the last window in the right padding (`(out − 1)·stride ≥ size + pad`).
pub fn pool_out(size: u64, kernel: u64, stride: u64, pad: u64, ceil_mode: bool) -> u64 {
    let span = size + 2 * pad - kernel + if ceil_mode { stride - 1 } else { 0 };
    let mut out = span / stride + 1;
    if ceil_mode && (out - 1) * stride >= size + pad {
        out -= 1;
    }
    out
}
