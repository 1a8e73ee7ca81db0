//! A step-time estimate for comparing recipes: a FLOP/bandwidth (roofline) model of one training step
//! on a GPU preset. It ranks what-ifs ("full checkpointing costs about a third more"); it does not
//! predict wall-clock time to better than a factor of two, and nothing in vramsim's memory answers
//! depends on it.
//!
//! # The model
//!
//! Every op of the model graph gets a forward time
//!
//! ```text
//! t(op) = max( FLOPs / (peak FLOP/s × 0.6),  bytes / (HBM bandwidth × 0.75),  5 µs )
//! ```
//!
//! * **FLOPs** count only the matrix products: `mm`, `addmm`, `bmm`, `linear` (2·M·N·K), convolutions
//!   (2 × output elements × input channels per group × kernel area) and fused attention
//!   (4·B·H·S_q·S_k·D, no causal discount). Everything else is memory-bound.
//! * **bytes** are the op's inputs and outputs, read and written once, at the width the recipe gives
//!   them: float32 for `fp32`; 16-bit for `bf16` and for AMP, except the ops autocast runs in float32
//!   (layer norm, softmax, log-softmax, the loss, `pow`, `rsqrt`); fixed dtypes (token ids, masks) at
//!   their own width. Views, reshapes and `split`s move nothing.
//! * **peak FLOP/s** is the preset's dense rate for the precision the product runs in: bf16 or fp16
//!   tensor cores for `bf16`, `amp-bf16`, `amp-fp16`; for `fp32`, plain FP32 for matrix products
//!   (PyTorch's default `torch.backends.cuda.matmul.allow_tf32 = False`) and TF32 tensor cores for
//!   convolutions (`torch.backends.cudnn.allow_tf32 = True` by default). Without bf16 hardware (V100,
//!   T4) bf16 runs at the FP32 rate.
//! * **0.6 and 0.75** are the shares of peak compute and bandwidth that large eager-mode kernels reach
//!   (cuBLAS GEMMs typically run at 60–80% of the datasheet's dense peak, streaming kernels at 75–90%
//!   of HBM bandwidth); **5 µs** is the floor of one eager op (launch and host dispatch), so small
//!   models and micro-batches do not look free.
//!
//! From the forward time `F` of one micro-batch:
//!
//! * **backward** takes `2F` (each product needs two of the same size, for the input's and the weight's
//!   gradients; memory-bound ops read the gradient and what they saved and write a gradient), op by
//!   op: a product with a frozen weight (`--freeze`, LoRA's base layers, bitsandbytes layers) takes
//!   its forward time once (the input's gradient only), an op none of whose inputs requires grad
//!   (a frozen prefix) takes none;
//! * **recomputation** takes the forward time of the ops that checkpointing reruns: every block for
//!   `full`, every K-th for `every:K`, the attention cores for `selective`, all segments but the last
//!   for `sqrt` (the regions the lowering checkpoints);
//! * **accumulation** runs `accum` micro-batches of `F + 2F + recomputation` per optimizer step, plus an
//!   in-place gradient add per micro-batch after the first;
//! * **the optimizer** is memory-bound: its passes over parameter-sized tensors (fused AdamW reads the
//!   parameter, gradient and both moments and writes three: 7 passes; the foreach implementation's
//!   list ops make about 20; SGD 3 or 4; momentum 5 or 8; Adafactor about 14), at the parameters'
//!   width, plus one 5 µs launch per op and 64 tensors (foreach, fused) or per op and tensor
//!   (for-loop); a GradScaler (`amp-fp16` by default, `--grad-scaler`) adds an unscale pass over the
//!   gradients, `--clip-grad-norm` three (a norm read, an in-place scale), `zero_grad` with `zero` a
//!   memset of them;
//! * **inference** is one forward.
//! * **a pipeline rank** (`--pp`): its graph is its stages at one micro-batch; a step runs `M`
//!   micro-batches in `M + (pp − 1) / V` micro-batch times (the schedule's bubble, Narayanan et al.
//!   SC'21: `p − 1` for GPipe and 1F1B, divided by `V` interleaved), priced on the reported rank's
//!   stages as if every stage took as long; sends and receives are not priced.
//!
//! The **step-time factor** is the step's time over that of one plain micro-step (forward, backward and
//! optimizer, no recomputation, no accumulation) of the same recipe: full checkpointing comes out near
//! 1.33, accumulation over K micro-batches near K (the step also processes K times the samples, which
//! `samples_per_s` accounts for).
//!
//! A parallel layout adds its communication and its pipeline bubble ([`crate::commtime`]):
//! `step = max(compute × bubble, overlapped communication) + exposed communication`.
//! A context-parallel rank (`--cp`) adds, per attention call, the ring's `cp − 1` later steps
//! (half of step 0's kernel each, forward and backward) and the K/V traffic its kernels do not
//! hide ([`crate::commtime::RingCall`]).
//!
//! Not modelled: data loading, CPU-bound Python overhead beyond the per-op floor, kernel
//! fusion (`torch.compile`), cuDNN algorithm choice, clocks under power limits.
//!
//! # The GPU figures
//!
//! [`GPU_PERF`] gives each preset of `vramsim gpus` its dense (no sparsity) peak rates and memory
//! bandwidth from the vendor's datasheet or architecture whitepaper, named in each entry. GeForce cards
//! are listed at their rate with FP32 accumulation, which is what PyTorch's matrix products use (half
//! the "FP16 accumulate" figure on those boards).

use crate::commtime::{CommWork, RingCall};
use std::fmt::Write as _;

use vramsim_models::{
    Checkpointing, DTypeSpec, Graph, OpKind, OptimizerImpl, OptimizerKind, Precision, Recipe,
    ZeroGrad,
};
use vramsim_sim::device::{find_preset, Device, DEFAULT_GPU};

/// The step-time model in a few lines, for `--help` of the commands that show step times.
pub const HELP: &str = "\
Step time: a FLOP/bandwidth (roofline) estimate that ranks recipes; it does not time them.
  each forward op takes max(FLOPs / (peak × 0.6), bytes / (HBM bandwidth × 0.75), 5 µs): FLOPs of the
  matrix products, convolutions and attention at the precision's dense tensor-core rate (fp32: plain
  FP32 for matmuls, TF32 for convolutions, PyTorch's defaults); every other op moves its inputs and
  outputs once;
  backward = 2 × forward; checkpointing reruns the forward of the regions it wraps; accumulation runs
  `accum` micro-batches per optimizer step; the optimizer is memory-bound (AdamW foreach ≈ 20 passes over
  the parameters, fused 7);
  × plain = step time over one micro-batch's forward + backward + optimizer without recomputation.
  Per-GPU peak rates and bandwidths, with their sources: vramsim whatif --gpu-figures.";

/// Share of the dense peak FLOP rate that the model's matrix products reach.
pub const COMPUTE_EFFICIENCY: f64 = 0.6;
/// Share of the HBM bandwidth that memory-bound kernels reach.
pub const BANDWIDTH_EFFICIENCY: f64 = 0.75;
/// The shortest an eager op can take (launch and host dispatch), in seconds.
pub const OP_FLOOR_S: f64 = 5e-6;

/// Peak throughput of one GPU preset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuPerf {
    /// The preset's name (`h100-80gb`), as in `vramsim gpus`.
    pub preset: &'static str,
    /// Dense FP32 (non-tensor) TFLOP/s.
    pub fp32_tflops: f64,
    /// Dense TF32 tensor-core TFLOP/s (the FP32 rate where there are none).
    pub tf32_tflops: f64,
    /// Dense bf16 tensor-core TFLOP/s with FP32 accumulation (the FP32 rate without bf16 hardware).
    pub bf16_tflops: f64,
    /// Dense fp16 tensor-core TFLOP/s with FP32 accumulation.
    pub fp16_tflops: f64,
    /// Memory bandwidth in GB/s (10⁹ bytes per second).
    pub bandwidth_gbs: f64,
    /// Where the figures come from.
    pub source: &'static str,
}

/// Dense peak rates and bandwidth for every GPU preset.
pub const GPU_PERF: &[GpuPerf] = &[
    GpuPerf {
        preset: "h100-80gb",
        fp32_tflops: 67.0,
        tf32_tflops: 494.7,
        bf16_tflops: 989.4,
        fp16_tflops: 989.4,
        bandwidth_gbs: 3350.0,
        source: "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (sparse figures halved)",
    },
    GpuPerf {
        preset: "h100-pcie",
        fp32_tflops: 51.0,
        tf32_tflops: 378.0,
        bf16_tflops: 756.0,
        fp16_tflops: 756.0,
        bandwidth_gbs: 2000.0,
        source: "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column (sparse figures halved)",
    },
    GpuPerf {
        preset: "h100-nvl",
        fp32_tflops: 60.0,
        tf32_tflops: 417.5,
        bf16_tflops: 835.5,
        fp16_tflops: 835.5,
        bandwidth_gbs: 3900.0,
        source: "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column (sparse figures halved)",
    },
    GpuPerf {
        preset: "h200",
        fp32_tflops: 67.0,
        tf32_tflops: 494.7,
        bf16_tflops: 989.4,
        fp16_tflops: 989.4,
        bandwidth_gbs: 4800.0,
        source: "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (sparse figures halved)",
    },
    GpuPerf {
        preset: "b200",
        fp32_tflops: 75.0,
        tf32_tflops: 1125.0,
        bf16_tflops: 2250.0,
        fp16_tflops: 2250.0,
        bandwidth_gbs: 8000.0,
        source: "NVIDIA HGX B200 specifications (8-GPU totals divided by 8, sparse figures halved)",
    },
    GpuPerf {
        preset: "a100-40gb",
        fp32_tflops: 19.5,
        tf32_tflops: 156.0,
        bf16_tflops: 312.0,
        fp16_tflops: 312.0,
        bandwidth_gbs: 1555.0,
        source: "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM column",
    },
    GpuPerf {
        preset: "a100-80gb",
        fp32_tflops: 19.5,
        tf32_tflops: 156.0,
        bf16_tflops: 312.0,
        fp16_tflops: 312.0,
        bandwidth_gbs: 2039.0,
        source: "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column",
    },
    GpuPerf {
        preset: "v100-16gb",
        fp32_tflops: 15.7,
        tf32_tflops: 15.7,
        bf16_tflops: 15.7,
        fp16_tflops: 125.0,
        bandwidth_gbs: 900.0,
        source: "NVIDIA Tesla V100 datasheet, SXM2 column (no TF32 or bf16 hardware: FP32 rate)",
    },
    GpuPerf {
        preset: "v100-32gb",
        fp32_tflops: 15.7,
        tf32_tflops: 15.7,
        bf16_tflops: 15.7,
        fp16_tflops: 125.0,
        bandwidth_gbs: 900.0,
        source: "NVIDIA Tesla V100 datasheet, SXM2 column (no TF32 or bf16 hardware: FP32 rate)",
    },
    GpuPerf {
        preset: "a10g",
        fp32_tflops: 35.0,
        tf32_tflops: 35.0,
        bf16_tflops: 70.0,
        fp16_tflops: 70.0,
        bandwidth_gbs: 600.0,
        source: "approximate: NVIDIA publishes no A10G datasheet; figures as AWS G5 documentation and \
                 Baseten's 'NVIDIA A10 vs A10G for ML model inference' give them",
    },
    GpuPerf {
        preset: "a10",
        fp32_tflops: 31.2,
        tf32_tflops: 62.5,
        bf16_tflops: 125.0,
        fp16_tflops: 125.0,
        bandwidth_gbs: 600.0,
        source: "NVIDIA A10 Tensor Core GPU datasheet (sparse figures halved)",
    },
    GpuPerf {
        preset: "l4",
        fp32_tflops: 30.3,
        tf32_tflops: 60.0,
        bf16_tflops: 121.0,
        fp16_tflops: 121.0,
        bandwidth_gbs: 300.0,
        source: "NVIDIA L4 Tensor Core GPU datasheet (sparse figures halved)",
    },
    GpuPerf {
        preset: "l40s",
        fp32_tflops: 91.6,
        tf32_tflops: 183.0,
        bf16_tflops: 362.05,
        fp16_tflops: 362.05,
        bandwidth_gbs: 864.0,
        source: "NVIDIA L40S datasheet (sparse figures halved)",
    },
    GpuPerf {
        preset: "a40",
        fp32_tflops: 37.4,
        tf32_tflops: 74.8,
        bf16_tflops: 149.7,
        fp16_tflops: 149.7,
        bandwidth_gbs: 696.0,
        source: "NVIDIA A40 datasheet (dense figures)",
    },
    GpuPerf {
        preset: "a6000",
        fp32_tflops: 38.7,
        tf32_tflops: 77.4,
        bf16_tflops: 154.8,
        fp16_tflops: 154.8,
        bandwidth_gbs: 768.0,
        source: "NVIDIA RTX A6000 datasheet (sparse tensor figure 309.7 halved)",
    },
    GpuPerf {
        preset: "rtx6000-ada",
        fp32_tflops: 91.1,
        tf32_tflops: 182.1,
        bf16_tflops: 364.2,
        fp16_tflops: 364.2,
        bandwidth_gbs: 960.0,
        source: "NVIDIA RTX 6000 Ada Generation datasheet and Ada architecture whitepaper (dense figures)",
    },
    GpuPerf {
        preset: "t4",
        fp32_tflops: 8.1,
        tf32_tflops: 8.1,
        bf16_tflops: 8.1,
        fp16_tflops: 65.0,
        bandwidth_gbs: 320.0,
        source: "NVIDIA T4 datasheet (no TF32 or bf16 hardware: FP32 rate)",
    },
    GpuPerf {
        preset: "rtx3090",
        fp32_tflops: 35.6,
        tf32_tflops: 35.6,
        bf16_tflops: 71.0,
        fp16_tflops: 71.0,
        bandwidth_gbs: 936.0,
        source: "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix: RTX 3090, tensor rates with \
                 FP32 accumulate, dense",
    },
    GpuPerf {
        preset: "rtx4090",
        fp32_tflops: 82.6,
        tf32_tflops: 82.6,
        bf16_tflops: 165.2,
        fp16_tflops: 165.2,
        bandwidth_gbs: 1008.0,
        source: "NVIDIA Ada GPU architecture whitepaper, appendix: RTX 4090, tensor rates with FP32 \
                 accumulate, dense",
    },
    GpuPerf {
        preset: "rtx5090",
        fp32_tflops: 104.8,
        tf32_tflops: 104.8,
        bf16_tflops: 209.5,
        fp16_tflops: 209.5,
        bandwidth_gbs: 1792.0,
        source: "NVIDIA RTX Blackwell GPU architecture whitepaper: RTX 5090, tensor rates with FP32 \
                 accumulate, dense",
    },
    GpuPerf {
        preset: "mi300x",
        fp32_tflops: 163.4,
        tf32_tflops: 163.4,
        bf16_tflops: 1307.4,
        fp16_tflops: 1307.4,
        bandwidth_gbs: 5300.0,
        source: "AMD Instinct MI300X data sheet (dense; PyTorch's ROCm build does not use TF32/XF32 by \
                 default: FP32 rate)",
    },
];

/// The figures for a device: its preset's (matched by preset or device name), or the default
/// preset's when the device is a bare capacity. The flag says whether they are the device's own.
pub fn perf_for(device: &Device) -> (&'static GpuPerf, bool) {
    let own = GPU_PERF
        .iter()
        .find(|p| find_preset(p.preset).is_some_and(|preset| preset.device_name == device.name));
    match own {
        Some(perf) => (perf, true),
        None => (
            GPU_PERF
                .iter()
                .find(|p| p.preset == DEFAULT_GPU)
                .expect("the default GPU has figures"),
            false,
        ),
    }
}

/// The work of one micro-batch's forward pass and of the optimizer, read from the graph once; cheap to
/// price on any GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct StepWork {
    /// Per forward op: (FLOPs, bytes moved, whether its product runs on the convolution path).
    ops: Vec<OpWork>,
    /// Op index ranges that checkpointing reruns.
    recomputed: Vec<(usize, usize)>,
    /// Trainable parameter elements.
    params: u64,
    /// Trainable parameter tensors.
    param_tensors: u64,
    precision: Precision,
    optimizer: OptimizerKind,
    optimizer_impl: OptimizerImpl,
    zero_grad: ZeroGrad,
    accum: u32,
    inference: bool,
    grad_scaler: bool,
    clip_grad_norm: bool,
    /// The layout's communication ([`crate::commtime`]).
    comm: CommWork,
    /// A pipeline rank (`--pp`): its micro-batches per step and the schedule's bubble, in
    /// micro-batch times (`pipeline_slots`); the graph is the rank's stages at one micro-batch.
    pipeline: Option<(f64, f64)>,
    /// A context-parallel rank's ring-attention calls (`--cp`, [`crate::commtime::RingCall`]):
    /// the SDPA op's index (step 0's kernel), the call, and whether checkpointing reruns it (its
    /// recomputation runs the ring's forward again).
    ring: Vec<(usize, RingCall, bool)>,
}

/// A pipeline rank's step in micro-batch times of its stages: `M + (pp − 1) / V` (Narayanan et al.,
/// SC'21, §2.2: the bubble of GPipe and 1F1B is `(p − 1)` micro-batch times of a stage, interleaving
/// divides it by `V`), and the micro-batches `M` whose gradients accumulate. Balanced stages
/// assumed; communication not priced.
fn pipeline_slots(recipe: &Recipe) -> Option<(f64, f64)> {
    let p = &recipe.parallel;
    if p.pp < 2 {
        return None;
    }
    let m = f64::from(vramsim_models::pipeline::microbatches(p, recipe.batch).ok()?);
    let v = f64::from(vramsim_models::pipeline::chunks_per_rank(p.pp_schedule));
    Some((m + f64::from(p.pp - 1) / v, m))
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct OpWork {
    flops: f64,
    bytes: f64,
    conv: bool,
    /// Backward time over forward time: 2 by default (see the module doc), 1 for a matrix
    /// product whose weight is frozen (only the input's gradient) or a bitsandbytes layer, 0 for
    /// an op none of whose inputs requires grad.
    bwd: f64,
    /// `--checkpoint selective-op` keeps its output: the recomputation does not run it.
    kept: bool,
}

/// The estimate for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTime {
    /// Forward pass of one micro-batch, ms.
    pub forward_ms: f64,
    /// Backward pass of one micro-batch, ms.
    pub backward_ms: f64,
    /// Recomputation in one micro-batch's backward, ms.
    pub recompute_ms: f64,
    /// The optimizer step (with gradient unscaling and zeroing), ms.
    pub optimizer_ms: f64,
    /// One optimizer step: `accum` micro-batches and the optimizer, ms.
    pub step_ms: f64,
    /// `step_ms` over one plain micro-step (forward, backward, optimizer).
    pub factor: f64,
    /// Matrix-product FLOPs of the whole step (recomputation included).
    pub flops: f64,
    /// Communication the step waits for (a parallel layout's exposed collectives, and what
    /// overlapped traffic takes beyond the compute it hides behind), ms.
    pub comm_ms: f64,
}

impl StepWork {
    /// The work of the same step with `recipe`'s accumulation count (`recipe` differing from the one
    /// this was read under in nothing else): the ops as read, the communication read again (a layout
    /// reduces gradients once per micro-batch or once per step).
    pub fn with_accum(&self, graph: &Graph, recipe: &Recipe) -> StepWork {
        StepWork {
            accum: recipe.accum,
            comm: CommWork::of(graph, recipe),
            ..self.clone()
        }
    }

    /// Reads the work of `graph` under `recipe`.
    pub fn of(graph: &Graph, recipe: &Recipe) -> StepWork {
        let width = |spec: DTypeSpec, f32_op: bool| -> f64 {
            match spec {
                DTypeSpec::Fixed(dtype) => dtype.size() as f64,
                DTypeSpec::Model => match recipe.precision {
                    Precision::Fp32 => 4.0,
                    Precision::Bf16 | Precision::Fp16 => 2.0,
                    Precision::AmpBf16 | Precision::AmpFp16 if f32_op => 4.0,
                    Precision::AmpBf16 | Precision::AmpFp16 => 2.0,
                },
            }
        };
        let numel = |v: vramsim_models::ValueId| -> f64 {
            graph.values[v.0 as usize].shape.iter().product::<u64>() as f64
        };
        let bytes_of = |v: vramsim_models::ValueId, f32_op: bool| -> f64 {
            numel(v) * width(graph.values[v.0 as usize].dtype, f32_op)
        };
        // Which values require grad (trainable parameters and what is computed from them), and
        // which are frozen parameters (followed through transposes and autocast casts).
        let mut rg = vec![false; graph.values.len()];
        let mut frozen = vec![false; graph.values.len()];
        for p in &graph.params {
            rg[p.value.0 as usize] = p.trainable;
            frozen[p.value.0 as usize] = !p.trainable;
        }
        for op in &graph.ops {
            let any = op.inputs.iter().any(|v| rg[v.0 as usize]);
            let through = matches!(
                op.kind,
                OpKind::T | OpKind::Transpose(..) | OpKind::AutocastLower
            ) && op.inputs.first().is_some_and(|v| frozen[v.0 as usize]);
            for o in &op.outputs {
                rg[o.0 as usize] = any;
                frozen[o.0 as usize] = through;
            }
        }
        let ops = graph
            .ops
            .iter()
            .map(|op| {
                use OpKind::*;
                let bwd = if !op.inputs.iter().any(|v| rg[v.0 as usize]) {
                    0.0
                } else if matches!(op.kind, QuantLinear { .. })
                    || (matches!(op.kind, Mm | Addmm)
                        && op.inputs.iter().any(|v| frozen[v.0 as usize]))
                {
                    1.0
                } else {
                    2.0
                };
                let f32_op = matches!(
                    op.kind,
                    LayerNorm | Softmax { .. } | LogSoftmax { .. } | NllLoss | PowScalar(_) | Rsqrt
                );
                let moved = || -> f64 {
                    op.inputs
                        .iter()
                        .chain(&op.outputs)
                        .map(|&v| bytes_of(v, f32_op))
                        .sum()
                };
                let product = |a: Option<&vramsim_models::ValueId>| -> f64 {
                    let k = a
                        .and_then(|&a| graph.values[a.0 as usize].shape.last().copied())
                        .unwrap_or(0) as f64;
                    2.0 * op.outputs.first().map_or(0.0, |&o| numel(o)) * k
                };
                let (flops, bytes, conv) = match &op.kind {
                    // views (and reshapes, whose copies the memory model counts) move no data here
                    kind if kind.is_view() => (0.0, 0.0, false),
                    Mm | Bmm => (product(op.inputs.first()), moved(), false),
                    Addmm => (product(op.inputs.get(1)), moved(), false),
                    // a bitsandbytes layer: the GEMM, and the dequantized weight written and read
                    QuantLinear {
                        in_features,
                        out_features,
                        ..
                    } => (
                        product(op.inputs.first()),
                        moved()
                            + 2.0
                                * (in_features * out_features) as f64
                                * width(DTypeSpec::Model, false),
                        false,
                    ),
                    Conv2d { .. } => {
                        // weight [C_out, C_in/groups, kh, kw]
                        let per_output = op.inputs.get(1).map_or(0.0, |&w| {
                            let shape = &graph.values[w.0 as usize].shape;
                            shape.iter().skip(1).product::<u64>() as f64
                        });
                        let out = op.outputs.first().map_or(0.0, |&o| numel(o));
                        (2.0 * out * per_output, moved(), true)
                    }
                    Sdpa { .. } => {
                        // q, k, v as [B, H, S, D]: QKᵀ and PV, 2·B·H·S_q·S_k·D each.
                        let q = op.inputs.first().map_or(0.0, |&q| numel(q));
                        let s_k = op
                            .inputs
                            .get(1)
                            .and_then(|&k| {
                                let shape = &graph.values[k.0 as usize].shape;
                                shape.len().checked_sub(2).map(|i| shape[i])
                            })
                            .unwrap_or(0) as f64;
                        (4.0 * q * s_k, moved(), false)
                    }
                    AutocastLower => match recipe.precision {
                        // the cast of a float32 argument to 16 bits
                        Precision::AmpBf16 | Precision::AmpFp16 => (
                            0.0,
                            op.inputs.first().map_or(0.0, |&v| numel(v) * 6.0),
                            false,
                        ),
                        _ => (0.0, 0.0, false),
                    },
                    Factory { .. } => (
                        0.0,
                        op.outputs.iter().map(|&v| bytes_of(v, false)).sum(),
                        false,
                    ),
                    ToDtype(dtype) => (
                        0.0,
                        op.inputs.first().map_or(0.0, |&v| {
                            numel(v)
                                * (width(graph.values[v.0 as usize].dtype, false)
                                    + dtype.size() as f64)
                        }),
                        false,
                    ),
                    _ => (0.0, moved(), false),
                };
                OpWork {
                    flops,
                    bytes,
                    conv,
                    bwd,
                    kept: false,
                }
            })
            .collect();
        let trainable: Vec<&vramsim_models::graph::Param> =
            graph.params.iter().filter(|p| p.trainable).collect();
        let params = trainable
            .iter()
            .map(|p| p.shape.iter().product::<u64>())
            .sum();
        let recomputed = if recipe.inference {
            Vec::new()
        } else {
            vramsim_models::checkpointed_ranges(graph, recipe.checkpointing)
        };
        let mut ops: Vec<OpWork> = ops;
        if recipe.checkpointing == Checkpointing::SelectiveOp {
            for &(a, b) in &recomputed {
                let kept = vramsim_models::selective_op_saves(
                    graph.ops[a..b].iter().map(|op| op.kind.clone()),
                );
                for (w, k) in ops[a..b].iter_mut().zip(kept) {
                    w.kept = k;
                }
            }
        }
        let ring: Vec<(usize, RingCall, bool)> = crate::commtime::ring_calls(graph, recipe)
            .into_iter()
            .map(|(i, call)| {
                let rerun = recomputed.iter().any(|&(a, b)| (a..b).contains(&i)) && !ops[i].kept;
                (i, call, rerun)
            })
            .collect();
        StepWork {
            ops,
            recomputed,
            params,
            param_tensors: trainable.len() as u64,
            precision: recipe.precision,
            optimizer: recipe.optimizer,
            optimizer_impl: recipe.optimizer_impl,
            zero_grad: recipe.zero_grad,
            accum: recipe.accum,
            inference: recipe.inference,
            grad_scaler: recipe.uses_grad_scaler(),
            clip_grad_norm: recipe.clip_grad_norm.is_some(),
            comm: CommWork::of(graph, recipe),
            pipeline: pipeline_slots(recipe),
            ring,
        }
    }

    /// Prices the work on `gpu`.
    pub fn time(&self, gpu: &GpuPerf) -> StepTime {
        let (matmul_tflops, conv_tflops) = match self.precision {
            Precision::Fp32 => (gpu.fp32_tflops, gpu.tf32_tflops),
            Precision::Bf16 | Precision::AmpBf16 => (gpu.bf16_tflops, gpu.bf16_tflops),
            Precision::AmpFp16 | Precision::Fp16 => (gpu.fp16_tflops, gpu.fp16_tflops),
        };
        let bandwidth = gpu.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY;
        let op_time = |w: &OpWork| -> f64 {
            let rate = if w.conv { conv_tflops } else { matmul_tflops } * 1e12 * COMPUTE_EFFICIENCY;
            let compute = if w.flops > 0.0 { w.flops / rate } else { 0.0 };
            (compute.max(w.bytes / bandwidth)).max(if w.flops > 0.0 || w.bytes > 0.0 {
                OP_FLOOR_S
            } else {
                0.0
            })
        };
        let links = crate::links::links(Some(gpu.preset));
        // The ring's later steps and the traffic it waits for, per call (`RingCall::time`);
        // a recomputed call runs its forward again.
        let cp_gbs = self.comm.cp_gbs(links);
        let mut ring = crate::commtime::RingTime::default();
        let mut ring_recompute = 0.0;
        let mut ring_flops = 0.0;
        let mut ring_recompute_flops = 0.0;
        for &(i, call, rerun) in &self.ring {
            let t = call.time(self.comm.cp, cp_gbs, op_time(&self.ops[i]));
            ring.forward_compute_s += t.forward_compute_s;
            ring.backward_compute_s += t.backward_compute_s;
            ring.forward_exposed_s += t.forward_exposed_s;
            ring.backward_exposed_s += t.backward_exposed_s;
            // the later steps' FLOPs: half of step 0's each
            let later_flops = f64::from(self.comm.cp - 1) * self.ops[i].flops / 2.0;
            ring_flops += later_flops;
            if rerun {
                ring_recompute += t.forward_compute_s;
                ring_recompute_flops += later_flops;
                ring.forward_exposed_s += t.forward_exposed_s;
            }
        }
        let forward: f64 = self.ops.iter().map(op_time).sum::<f64>() + ring.forward_compute_s;
        let forward_flops: f64 = self.ops.iter().map(|w| w.flops).sum::<f64>() + ring_flops;
        if self.inference {
            return StepTime {
                forward_ms: forward * 1e3,
                backward_ms: 0.0,
                recompute_ms: 0.0,
                optimizer_ms: 0.0,
                step_ms: forward * 1e3,
                factor: 1.0,
                flops: forward_flops,
                comm_ms: 0.0,
            };
        }
        let recompute: f64 = self
            .recomputed
            .iter()
            .map(|&(a, b)| {
                self.ops[a..b]
                    .iter()
                    .filter(|w| !w.kept)
                    .map(op_time)
                    .sum::<f64>()
            })
            .sum::<f64>()
            + ring_recompute;
        let recompute_flops: f64 = self
            .recomputed
            .iter()
            .map(|&(a, b)| {
                self.ops[a..b]
                    .iter()
                    .filter(|w| !w.kept)
                    .map(|w| w.flops)
                    .sum::<f64>()
            })
            .sum::<f64>()
            + ring_recompute_flops;
        let backward: f64 =
            self.ops.iter().map(|w| w.bwd * op_time(w)).sum::<f64>() + ring.backward_compute_s;
        // parameters, gradients and optimizer state: float32 except under bf16 (and fp16)
        let width = if matches!(self.precision, Precision::Bf16 | Precision::Fp16) {
            2.0
        } else {
            4.0
        };
        let params = self.params as f64;
        let (passes, ops_per_tensor) = match (self.optimizer, self.optimizer_impl) {
            (OptimizerKind::Sgd, OptimizerImpl::Fused) => (3.0, 1.0),
            (OptimizerKind::Sgd, _) => (4.0, 2.0),
            (OptimizerKind::SgdMomentum | OptimizerKind::SgdNesterov, OptimizerImpl::Fused) => {
                (5.0, 1.0)
            }
            (OptimizerKind::SgdMomentum, _) => (8.0, 4.0),
            // the in-place `_foreach_add_(grads, bufs)` (for-loop: `grad.add(buf)`) reads two, writes one
            (OptimizerKind::SgdNesterov, _) => (11.0, 5.0),
            (OptimizerKind::Adam | OptimizerKind::AdamW, OptimizerImpl::Fused) => (7.0, 1.0),
            (OptimizerKind::Adam | OptimizerKind::AdamW, _) => (20.0, 9.0),
            (OptimizerKind::Adafactor, _) => (14.0, 12.0),
            // transformers' loop: ~16 ops per parameter, each launched per tensor
            (OptimizerKind::AdafactorHf, _) => (16.0, 16.0),
            // transformers' AdamW loop: mul_, add_, mul_, addcmul_, sqrt, add_, addcdiv_ per tensor
            (OptimizerKind::AdamWHf, _) => (20.0, 7.0),
            // bitsandbytes: one fused kernel per parameter reading grad, param and two states
            // (1 or 4 bytes each), writing param and states
            (
                OptimizerKind::AdamW8bit
                | OptimizerKind::PagedAdamW
                | OptimizerKind::PagedAdamW8bit,
                _,
            ) => (7.0, 1.0),
        };
        let launches = match self.optimizer_impl {
            _ if matches!(
                self.optimizer,
                OptimizerKind::AdafactorHf
                    | OptimizerKind::AdamWHf
                    | OptimizerKind::AdamW8bit
                    | OptimizerKind::PagedAdamW
                    | OptimizerKind::PagedAdamW8bit
            ) =>
            {
                ops_per_tensor * self.param_tensors as f64
            }
            OptimizerImpl::ForLoop => ops_per_tensor * self.param_tensors as f64,
            _ => ops_per_tensor * (self.param_tensors as f64 / 64.0).ceil(),
        };
        let mut optimizer = passes * params * width / bandwidth + launches * OP_FLOOR_S;
        if self.grad_scaler {
            optimizer += 2.0 * params * width / bandwidth; // GradScaler unscale_
        }
        if self.clip_grad_norm {
            // clip_grad_norm_: _foreach_norm reads the gradients, _foreach_mul_ reads and writes them
            optimizer += 3.0 * params * width / bandwidth;
        }
        if self.zero_grad == ZeroGrad::Zero {
            optimizer += params * width / bandwidth; // memset of the gradients
        }
        let accum = f64::from(self.accum.max(1));
        // A pipeline rank runs M micro-batches per accumulation step, in M + bubble slots.
        let (slots, micro_batches) = self.pipeline.unwrap_or((1.0, 1.0));
        // after the first micro-batch, AccumulateGrad adds into .grad in place (read two, write one)
        let accumulate = (accum * micro_batches - 1.0) * 3.0 * params * width / bandwidth;
        let micro = forward + backward + recompute;
        let compute = accum * slots * micro + accumulate + optimizer;
        let comm = self.comm.time(links);
        // the ring's waits, every micro-batch (a pipeline rank's `M` per accumulation step)
        let ring_exposed =
            accum * micro_batches * (ring.forward_exposed_s + ring.backward_exposed_s);
        let step = compute.max(comm.overlapped_s) + comm.exposed_s + ring_exposed;
        let plain = forward + backward + optimizer;
        StepTime {
            forward_ms: forward * 1e3,
            backward_ms: backward * 1e3,
            recompute_ms: recompute * 1e3,
            optimizer_ms: optimizer * 1e3,
            step_ms: step * 1e3,
            factor: if plain > 0.0 { step / plain } else { 1.0 },
            flops: accum * micro_batches * (3.0 * forward_flops + recompute_flops),
            comm_ms: (step - compute) * 1e3,
        }
    }
}

/// [`GPU_PERF`] as a table (`vramsim whatif --gpu-figures`).
pub fn perf_table() -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<13}{:>8}{:>8}{:>8}{:>8}{:>9}  source",
        "preset", "fp32", "tf32", "bf16", "fp16", "GB/s"
    );
    for p in GPU_PERF {
        let _ = writeln!(
            out,
            "{:<13}{:>8}{:>8}{:>8}{:>8}{:>9}  {}",
            p.preset,
            p.fp32_tflops,
            p.tf32_tflops,
            p.bf16_tflops,
            p.fp16_tflops,
            p.bandwidth_gbs,
            p.source
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use vramsim_models::{zoo, Checkpointing};

    #[test]
    fn every_preset_has_figures() {
        for preset in vramsim_sim::device::PRESETS {
            assert!(
                GPU_PERF.iter().any(|p| p.preset == preset.name),
                "{} has no compute figures",
                preset.name
            );
        }
        for p in GPU_PERF {
            assert!(find_preset(p.preset).is_some(), "{} is no preset", p.preset);
            assert!(p.bf16_tflops >= p.fp32_tflops && p.bandwidth_gbs > 0.0);
        }
    }

    #[test]
    fn recomputation_costs_about_a_forward_and_accumulation_a_step() {
        let gpu = GPU_PERF.iter().find(|p| p.preset == "h100-80gb").unwrap();
        let time = |f: &dyn Fn(&mut Recipe)| {
            let mut recipe = Recipe::new(8, 1024);
            recipe.precision = Precision::AmpBf16;
            f(&mut recipe);
            let graph = zoo::build("gpt2-medium", &recipe).unwrap();
            StepWork::of(&graph, &recipe).time(gpu)
        };
        let plain = time(&|_| {});
        let full = time(&|r| r.checkpointing = Checkpointing::Full);
        let accum = time(&|r| r.accum = 4);
        // GPT-2 medium: 6·N·tokens ≈ 6 × 355M × 8192 ≈ 17.5 TFLOP (plus attention and the head)
        assert!(plain.flops > 1.7e13 && plain.flops < 2.6e13, "{plain:?}");
        assert!((full.recompute_ms - plain.forward_ms).abs() < 0.2 * plain.forward_ms);
        assert!(full.factor > 1.2 && full.factor < 1.4, "{full:?}");
        assert!(accum.factor > 3.5 && accum.factor < 4.1, "{accum:?}");
        assert!((plain.factor - 1.0).abs() < 1e-9);
        // bf16 tensor cores beat FP32 by far on an H100
        let fp32 = time(&|r| r.precision = Precision::Fp32);
        assert!(fp32.step_ms > 3.0 * plain.step_ms);
    }
}
