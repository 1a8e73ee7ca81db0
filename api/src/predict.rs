//! `vramsim predict`: a model's training step (or inference) lowered to an allocation trace by
//! `vramsim-models` and replayed through an allocator model: peaks, whether it fits (or PyTorch's
//! out-of-memory message and the op that raises it), what is live at the peak by category and by
//! module, and the phase of the peak.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{ArgGroup, Args};
use serde_json::{json, Map, Value};
use vramsim_models::compact::{lower_compact, CompactTrace, ReplayPiece};
use vramsim_models::hf::{self, ImportOptions};
use vramsim_models::template::StepTemplate;
use vramsim_models::zoo::{Arch, KernelChoice};
use vramsim_models::PpLoop;
use vramsim_models::{
    parse_image_size, Attention, Checkpointing, Graph, Head, Loss, OptimizerImpl, OptimizerKind,
    PeakBreakdown, Precision, Recipe, Target, ZeroGrad,
};
use vramsim_models::{
    CheckpointImpl, CublasWorkspaceMode, TorchVersion, TransformersVersion, Workspaces,
};
use vramsim_models::{DType, Offload, Parallel, PpSchedule, ReshardAfterForward, Shard};
use vramsim_sim::device::{find_preset, ContextChoice, UnknownGpu, DEFAULT_GPU};
use vramsim_sim::format::format_size;
use vramsim_sim::report::{group_digits, Report};
use vramsim_traces::Trace;

use crate::machine::MachineArgs;
pub use crate::step_replay::{replay_step, replay_step_variants};

/// Module groups listed in the table (`--json` has them all).
const TOP_MODULES: usize = 8;
/// Largest allocations listed in the table.
const TOP_ALLOCATIONS: usize = 5;
/// Sequence length of a language model when `--seq` is not given (capped at its positions).
const DEFAULT_SEQ: u64 = 1024;

/// Options of `vramsim predict`.
#[derive(Args, Debug)]
#[command(group(ArgGroup::new("what").required(true).args(["model", "hf_config", "graph"])))]
pub struct PredictArgs {
    /// A zoo model: mlp, resnet18, resnet34, resnet50, resnet101, resnet152, vgg16, vit-b-16,
    /// bert-base, bert-large, gpt2, gpt2-medium, gpt2-large, gpt2-xl, tinyllama-1.1b, llama2-7b,
    /// llama2-13b, llama2-70b, llama3-8b, llama3-405b; timm 0.6 models under timm's names: timm/resnet18,
    /// timm/resnet26, timm/resnet34, timm/resnet50, timm/resnet101, timm/resnet152,
    /// timm/vit_tiny_patch16_224, timm/vit_small_patch16_224, timm/vit_base_patch32_224,
    /// timm/vit_base_patch16_224, timm/vit_base_patch16_384, timm/vit_large_patch16_224,
    /// timm/deit_tiny_patch16_224, timm/deit_small_patch16_224, timm/deit_base_patch16_224,
    /// timm/efficientnet_b0, timm/convnext_nano, timm/convnext_tiny, timm/convnext_small,
    /// timm/convnext_base, timm/convnext_large; karpathy/nanoGPT's GPT (vocab 50304, 1024
    /// positions, dropout 0, its own plain cross-entropy): nanogpt, nanogpt-medium, nanogpt-large,
    /// nanogpt-xl (GPTConfig's bias=True), each also as -nobias (bias=False, train.py's default);
    /// --attention eager is its manual path with the float32 `bias` mask buffers, auto its SDPA.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// A HuggingFace config.json (model_type gpt2, bert, llama, mistral or qwen2) instead of a zoo
    /// model.
    #[arg(long, value_name = "FILE")]
    pub hf_config: Option<PathBuf>,
    /// Accept config.json fields vramsim does not know (reported as warnings) instead of failing.
    #[arg(long, requires = "hf_config")]
    pub hf_allow_unknown: bool,
    /// Micro-batch size (sequences, or images).
    #[arg(long, value_name = "B", value_parser = count("batch"), allow_negative_numbers = true)]
    pub batch: u64,
    /// Tokens per sequence for language models (default: 1024, or the model's positions if fewer;
    /// a --graph captured with a sequence variable: its example length); image models take
    /// --image-size images and ignore it.
    #[arg(long, value_name = "S", value_parser = count("seq"), allow_negative_numbers = true)]
    pub seq: Option<u64>,
    /// fp32, bf16 (model.to(bfloat16)), amp-fp16 (autocast + GradScaler), amp-bf16 (autocast).
    #[arg(long, default_value = "fp32", value_parser = named::<Precision>)]
    pub precision: Precision,
    /// adamw, adam, sgd, sgd-momentum (momentum=0.9), sgd-nesterov (momentum=0.9, nesterov=True),
    /// adafactor (torch.optim.Adafactor), adafactor-hf (transformers' Adafactor, a per-parameter
    /// loop, as HF Trainer's optim="adafactor" builds it), adamw-hf (transformers' own AdamW, a
    /// per-parameter loop: HF Trainer's optim="adamw_hf", its default in transformers 4.x up to 4.3x).
    #[arg(long, default_value = "adamw", value_parser = named::<OptimizerKind>)]
    pub optimizer: OptimizerKind,
    /// How the optimizer runs: foreach (PyTorch's default on CUDA), fused, for-loop.
    #[arg(long, default_value = "foreach", value_parser = named::<OptimizerImpl>)]
    pub optimizer_impl: OptimizerImpl,
    /// Activation checkpointing (non-reentrant): none, full, every:K, selective, sqrt, selective-op.
    #[arg(long, default_value = "none", value_parser = named::<Checkpointing>)]
    pub checkpoint: Checkpointing,
    /// Gradient accumulation: micro-batches per optimizer step.
    #[arg(long, default_value_t = 1, value_parser = count32("accum"), allow_negative_numbers = true)]
    pub accum: u32,
    /// Optimizer steps to simulate (2 or more reach the steady state).
    #[arg(long, default_value_t = 2, value_parser = count32("iterations"), allow_negative_numbers = true)]
    pub iterations: u32,
    /// Attention: auto (transformers' default "sdpa" and the kernel PyTorch picks for the --gpu:
    /// cuDNN on H100/H200/B200, FlashAttention-2 on A100/Ada/Blackwell consumer cards for 16-bit
    /// inputs, memory-efficient for fp32, math where no fused kernel runs), eager (HF's explicit
    /// attention; ViT has none and chooses as auto), or a forced SDPA kernel: sdpa-flash,
    /// sdpa-mem-efficient, sdpa-cudnn, sdpa-math (an error when it cannot run the step's inputs).
    #[arg(long, default_value = "auto", value_parser = named::<Attention>)]
    pub attention: Attention,
    /// Inference: model.eval() under torch.no_grad(), forward only.
    #[arg(long)]
    pub inference: bool,
    #[command(flatten)]
    pub machine: MachineArgs,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Draw allocated and reserved memory over the step to a .png or .svg file.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Also write the lowered trace (vramsim JSON, or JSON Lines for .jsonl; gzip for .gz).
    #[arg(long, value_name = "FILE")]
    pub trace_out: Option<PathBuf>,
    /// CUBLAS_WORKSPACE_CONFIG, e.g. ":4096:8" (32 MiB): the cuBLAS workspace of every GEMM (default
    /// :4096:2:16:8 = 8,519,680 B, 32 MiB on compute capability 9-12).
    #[arg(long, value_name = "CONFIG", allow_hyphen_values = true)]
    pub cublas_workspace_config: Option<String>,
    /// TORCH_CUBLAS_WORKSPACE_CACHE=1 (also PyTorch ≤ 2.14): one cuBLAS workspace per thread kept for
    /// good (forward and backward threads: two), instead of 2.15's one per GEMM call.
    #[arg(long)]
    pub cublas_workspace_cache: bool,
    /// CUBLASLT_WORKSPACE_SIZE in KiB: the cuBLASLt workspace of each fused-bias addmm (default 1024).
    #[arg(long, value_name = "KIB")]
    pub cublaslt_workspace_size: Option<u64>,
    /// torch.backends.cudnn.benchmark = True: each new convolution shape is benchmarked once and the
    /// allocator's cache emptied after it (its benchmark workspace is not modelled).
    #[arg(long)]
    pub cudnn_benchmark: bool,
    /// optimizer.zero_grad(set_to_none=...): none (True, PyTorch's default: gradients freed after
    /// each step) or zero (False, zeroed in place: gradients stay allocated across steps).
    #[arg(long, default_value = "none", value_parser = named::<ZeroGrad>)]
    pub zero_grad: ZeroGrad,
    /// torch.nn.utils.clip_grad_norm_(model.parameters(), MAX) between backward and the optimizer
    /// step (foreach norms on CUDA; after scaler.unscale_ with a GradScaler).
    #[arg(long, value_name = "MAX", value_parser = max_norm, allow_negative_numbers = true)]
    pub clip_grad_norm: Option<f64>,
    /// torch.amp.GradScaler around the step: true or false (default: true for amp-fp16, as HF
    /// Trainer and PyTorch's AMP recipe do; false otherwise).
    #[arg(long, value_name = "BOOL", value_parser = boolean("grad-scaler"))]
    pub grad_scaler: Option<bool>,
    /// Head of a language model: lm (GPT-2, LLaMA), masked-lm (BERT), seq-cls:N, token-cls:N,
    /// none (the base model; the loop's loss is last_hidden_state.mean()). Default: the family's
    /// own (lm, or masked-lm for BERT).
    #[arg(long, value_name = "HEAD", value_parser = named::<Head>)]
    pub head: Option<Head>,
    /// Loss: hf (HF's loss functions: logits.float() and shifted labels for causal LMs) or plain
    /// (F.cross_entropy on the logits as they are, nanoGPT-style).
    #[arg(long, default_value = "hf", value_parser = named::<Loss>)]
    pub loss: Loss,
    /// The training loop keeps the model's outputs (logits, loss) until the next forward returns.
    #[arg(long)]
    pub keep_outputs: bool,
    /// Input images of an image model: H (square) or HxW (default 224).
    #[arg(long, value_name = "H[xW]", value_parser = image_size)]
    pub image_size: Option<(u64, u64)>,
    /// Classes of an image model's classifier (default 1000).
    #[arg(long, value_name = "N", value_parser = count("num-classes"), allow_negative_numbers = true)]
    pub num_classes: Option<u64>,
    /// The torch.utils.checkpoint implementation of --checkpoint: non-reentrant (use_reentrant=False,
    /// what transformers 5.23's gradient checkpointing passes) or reentrant (use_reentrant=True:
    /// PyTorch ≤ 1.10 and transformers ≤ 4.34, and a bare torch.utils.checkpoint call in 2.15).
    #[arg(long, default_value = "non-reentrant", value_parser = named::<CheckpointImpl>)]
    pub checkpoint_impl: CheckpointImpl,
    /// The PyTorch release whose rules apply where they changed: 2.15 (the reference) or 1.10
    /// (softmax saves its input too; cuBLAS's own workspace pools, one per handle outside the
    /// allocator, instead of workspaces from the caching allocator).
    #[arg(long, default_value = "2.15", value_parser = named::<TorchVersion>)]
    pub torch_version: TorchVersion,
    /// The transformers release whose model code applies where it changed: 5.23 (the reference) or
    /// 4.16 (BERT without an attention_mask adds an all-ones float32 extended mask to its eager
    /// attention scores).
    #[arg(long, default_value = "5.23", value_parser = named::<TransformersVersion>)]
    pub transformers_version: TransformersVersion,
    /// A graph captured from your own nn.Module by vramsim.from_module (JSON, format vramsim-graph)
    /// instead of a zoo model: lowered like one, with the batch a variable (--batch).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["model", "hf_config"])]
    pub graph: Option<PathBuf>,
    /// `use_cache` passed to an HF decoder's forward (GPT-2, LLaMA family): false for a loop that
    /// calls `model(..., use_cache=False)`. Default: the config's (`use_cache` of --hf-config, else
    /// transformers' True), with which the forward builds a KV cache (a copy of every layer's keys
    /// and values, alive as long as the model output) unless gradient checkpointing is on in
    /// training.
    #[arg(long, value_name = "BOOL", value_parser = boolean("use-cache"))]
    pub use_cache: Option<bool>,
    /// Freeze (`requires_grad_(False)`) the parameters under these module paths, comma-separated:
    /// `model.embed_tokens,model.layers.0-15` (a component `A-B` is a range of layer numbers).
    /// Frozen parameters get no gradient, no AccumulateGrad and no optimizer state; ops save
    /// activations only where some input still needs a gradient. A pattern that matches nothing
    /// is an error listing the model's modules.
    #[arg(long, value_name = "PATHS", value_delimiter = ',')]
    pub freeze: Vec<String>,
    /// PEFT LoRA adapters: `r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj` (PEFT's
    /// defaults: r 8, alpha 8, dropout 0; `targets=all-linear`: every linear layer but the output
    /// head; `dtype=model` keeps the adapters in the model's dtype instead of PEFT's float32).
    /// Every base parameter is frozen.
    #[arg(long, value_name = "SPEC", value_parser = lora_spec)]
    pub lora: Option<vramsim_models::finetune::LoraConfig>,
    /// bitsandbytes-quantized linear layers, as transformers' BitsAndBytesConfig loads them:
    /// nf4, fp4 (4-bit, float32 absmax per 64-block), nf4-dq, fp4-dq (double quantization, the
    /// QLoRA setting), int8 (LLM.int8). The output layer, embeddings, norms and biases stay in
    /// the model's dtype; each 4-bit layer dequantizes its weight into a temporary in forward and
    /// backward.
    #[arg(long, value_name = "FORMAT", value_parser = quant_arg)]
    pub quant: Option<QuantArg>,
    /// A fine-tuning tool's defaults: peft-lora (PEFT's LoraConfig()), torchtune-qlora
    /// (torchtune's llama3_1/8B_qlora_single_device.yaml), litgpt-lora (LitGPT's
    /// finetune/lora.py). Options given explicitly (--lora, --quant, or --precision, --optimizer,
    /// --checkpoint, --accum changed from their defaults) override the preset.
    #[arg(long = "recipe", value_name = "PRESET")]
    pub preset: Option<crate::presets::Preset>,
    /// LoRA rank: overrides r of --lora (or of the preset); alone, PEFT's defaults with this rank.
    /// `--vary lora.r=8,16,64` varies it.
    #[arg(long, value_name = "R", value_parser = lora_rank)]
    pub lora_r: Option<u64>,
    /// Data-parallel ranks: the step is lowered and replayed per rank (ranks that play the same
    /// role once). Needs --shard ddp, zero1, zero2, zero3, zero1-torch or fsdp2 above 1.
    #[arg(long, default_value_t = 1, value_parser = count32("dp"), allow_negative_numbers = true)]
    pub dp: u32,
    /// How the data-parallel ranks share the model states: none (one GPU), ddp
    /// (DistributedDataParallel: gradient buckets), zero1 / zero2 / zero3 (DeepSpeed ZeRO stages
    /// 1, 2 and 3, bf16 with an fp32 master partition; zero3 gathers parameters per submodule),
    /// zero1-torch (torch's ZeroRedundancyOptimizer over DDP: whole parameters' optimizer state
    /// partitioned greedily; the rank with the most is reported), fsdp2 (fully_shard on every
    /// block and the root), dataparallel (nn.DataParallel over devices 0..dp-1: a report per
    /// device). --tp adds Megatron tensor parallelism; --pp is modelled without a --shard.
    #[arg(long, default_value = "none", value_parser = named::<Shard>)]
    pub shard: Shard,
    /// The world size the job is launched with: an error unless it equals the layout's ranks (dp).
    #[arg(long, value_name = "N", value_parser = count32("world-size"), allow_negative_numbers = true)]
    pub world_size: Option<u32>,
    /// FSDP2's MixedPrecisionPolicy(param_dtype=...): bf16, fp16 or fp32, the dtype of the
    /// all-gathered parameters and the compute (shards and optimizer keep the model's dtype).
    #[arg(long, value_name = "DTYPE", value_parser = float_dtype("fsdp-param-dtype"))]
    pub fsdp_param_dtype: Option<DType>,
    /// FSDP2's MixedPrecisionPolicy(reduce_dtype=...): fp32, bf16 or fp16, the dtype of the
    /// gradient reduce-scatter (default: the param dtype).
    #[arg(long, value_name = "DTYPE", value_parser = float_dtype("fsdp-reduce-dtype"))]
    pub fsdp_reduce_dtype: Option<DType>,
    /// DistributedDataParallel(gradient_as_bucket_view=True): gradients become views of the
    /// buckets instead of a second copy (with --shard ddp or zero1-torch).
    #[arg(long)]
    pub ddp_bucket_view: bool,
    /// DataParallel(output_device=...): the device the outputs are gathered on (with --shard
    /// dataparallel; default 0).
    #[arg(long, default_value_t = 0)]
    pub output_device: u32,
    /// Tensor-parallel ranks (Megatron-style column/row-parallel linear layers). The world size
    /// is dp × tp × pp × cp.
    #[arg(long, default_value_t = 1, value_parser = count32("tp"), allow_negative_numbers = true)]
    pub tp: u32,
    /// Sequence parallelism over the tensor-parallel group (with --tp 2 or more).
    #[arg(long)]
    pub sp: bool,
    /// Pipeline stages (torch.distributed.pipelining as torchtitan drives it): the layers split
    /// evenly over the stages, the first holding the embeddings and the last the norm, head and
    /// loss; every rank is its own role, lowered and replayed once.
    #[arg(long, default_value_t = 1, value_parser = count32("pp"), allow_negative_numbers = true)]
    pub pp: u32,
    /// The pipeline schedule: gpipe (ScheduleGPipe), 1f1b (Schedule1F1B) or interleaved:V
    /// (ScheduleInterleaved1F1B with V model chunks per rank).
    #[arg(long, default_value = "1f1b", value_parser = named::<PpSchedule>)]
    pub pp_schedule: PpSchedule,
    /// Micro-batches per pipeline step: must divide --batch; 1f1b needs at least --pp, interleaved
    /// a multiple of max(1, M / pp). Default: --batch (torchtitan's micro-batch size 1).
    #[arg(long, value_name = "M", value_parser = count32("microbatches"), allow_negative_numbers = true)]
    pub microbatches: Option<u32>,
    /// CPU offload: none, optimizer (DeepSpeed ZeRO-Offload, offload_optimizer: with --shard zero1
    /// or zero2 and adamw/adam, the fp32 master, optimizer state and gradient partition in host
    /// memory) or params (with --shard fsdp2: CPUOffloadPolicy, shards, sharded gradients and the
    /// optimizer on the host).
    #[arg(long, default_value = "none", value_parser = named::<Offload>)]
    pub offload: Offload,
    /// FSDP2's reshard_after_forward for the blocks (with --shard fsdp2): true (the default),
    /// false (every block stays unsharded from its forward to its backward) or N (after forward
    /// each rank keeps 1/N of a block's parameters: N divides --dp and is below it). The root
    /// module's stays False.
    #[arg(long, default_value = "true", value_parser = named::<ReshardAfterForward>)]
    pub reshard_after_forward: ReshardAfterForward,
    /// Context-parallel ranks (torch.distributed.tensor.experimental.context_parallel, as
    /// torchtitan lays it out): each rank holds seq/cp tokens (head-tail load balanced: --seq a
    /// multiple of 2 × cp), attention runs as ring attention (all-gathered K/V, K/V gradients
    /// passed round the ring), and FSDP2 (--shard fsdp2) shards the model states over dp × cp
    /// ranks. The world size is dp × tp × pp × cp; every cp rank is its own role.
    #[arg(long, default_value_t = 1, value_parser = count32("cp"), allow_negative_numbers = true)]
    pub cp: u32,
    /// bitsandbytes' quant_storage for the 4-bit layers of --quant (transformers'
    /// bnb_4bit_quant_storage): uint8 (the default), bf16, fp16 or fp32, the dtype the packed
    /// codes are stored in ((n+1)//(2·itemsize) elements). FSDP-QLoRA (--shard fsdp2) needs a
    /// floating-point storage, normally the model's dtype (bf16).
    #[arg(long, default_value = "uint8", value_parser = vramsim_models::finetune::quant::parse_quant_storage)]
    pub quant_storage: DType,
    /// The training loop around a pipeline's schedule (with --pp): torchtitan (the default:
    /// Trainer.train_step keeps torch.sum(torch.stack(losses)), and through its graph the last
    /// stage's M received activations, until after the optimizer step) or plain (a loop that
    /// drops the losses when schedule.step returns, as models/tools/capture_pipeline.py).
    #[arg(long, default_value = "torchtitan", value_parser = named::<PpLoop>)]
    pub pp_loop: PpLoop,
}

/// `--quant`'s value: a bitsandbytes format, or `none` (what no `--quant` gives; for `--vary
/// quant=none,nf4`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantArg(pub Option<vramsim_models::finetune::Quant>);

/// A parser for `--quant`.
fn quant_arg(s: &str) -> Result<QuantArg, String> {
    if s == "none" {
        return Ok(QuantArg(None));
    }
    s.parse::<vramsim_models::finetune::Quant>()
        .map(|q| QuantArg(Some(q)))
        .map_err(|e| format!("{e}, none"))
}

/// A parser for `--lora-r`: an integer ≥ 1.
fn lora_rank(s: &str) -> Result<u64, String> {
    s.parse::<i64>()
        .ok()
        .filter(|&r| r > 0)
        .map(|r| r as u64)
        .ok_or_else(|| format!("{s}: the LoRA rank must be an integer ≥ 1"))
}

/// A parser for `--lora`.
fn lora_spec(s: &str) -> Result<vramsim_models::finetune::LoraConfig, String> {
    s.parse()
}

/// A parser for a `MixedPrecisionPolicy` dtype.
fn float_dtype(what: &'static str) -> impl Fn(&str) -> Result<DType, String> + Clone {
    move |s: &str| vramsim_models::parallel::parse_float_dtype(what, s).map_err(|e| e.to_string())
}

/// A parser for `--image-size` (`H` or `HxW`).
fn image_size(s: &str) -> Result<(u64, u64), String> {
    parse_image_size(s).map_err(|e| e.to_string())
}

/// A parser for `--clip-grad-norm`: a positive finite `max_norm`.
fn max_norm(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!(
            "clip-grad-norm takes max_norm, a positive number (e.g. 1.0), got {s}"
        )),
    }
}

/// A parser for an option that takes `true` or `false`.
fn boolean(what: &'static str) -> impl Fn(&str) -> Result<bool, String> + Clone {
    move |s: &str| match s.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!("{what} must be true or false, got {s}")),
    }
}

/// A parser for a count of 1 or more.
fn count(what: &'static str) -> impl Fn(&str) -> Result<u64, String> + Clone {
    move |s: &str| match s.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "{what} must be a whole number from 1 to {}, got {s}",
            u64::MAX
        )),
    }
}

/// [`count`] for 32-bit options.
fn count32(what: &'static str) -> impl Fn(&str) -> Result<u32, String> + Clone {
    move |s: &str| match s.trim().parse::<u32>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "{what} must be a whole number from 1 to {}, got {s}",
            u32::MAX
        )),
    }
}

/// A parser for the models crate's named options (their errors list the valid values).
fn named<T>(s: &str) -> Result<T, String>
where
    T: FromStr,
    T::Err: std::fmt::Display,
{
    s.parse::<T>().map_err(|e| e.to_string())
}

/// The GPU the step's kernels are chosen for: the `--gpu` preset, else vramsim's default device
/// (`--capacity` and `--calibration` describe memory only, so kernels are chosen as on the default).
pub fn target(machine: &MachineArgs) -> Result<Target> {
    let name = machine.gpu.as_deref().unwrap_or(DEFAULT_GPU);
    let preset = find_preset(name).ok_or_else(|| UnknownGpu {
        name: name.to_string(),
    })?;
    Ok(Target {
        compute_capability: preset.compute_capability,
    })
}

/// A lowered step: the model, the recipe and the trace, ready to replay on any machine.
pub struct Lowered {
    /// The architecture (a zoo entry or an imported config).
    pub arch: Arch,
    /// Its reference implementation.
    pub reference: String,
    /// The recipe the step was lowered under.
    pub recipe: Recipe,
    /// The graph the trace was lowered from.
    pub graph: std::sync::Arc<Graph>,
    /// Whether `--seq` was given (else the default was taken).
    pub seq_given: bool,
    /// The trace, with repeated micro-batches written once (its `meta` is the whole step's).
    pub compact: CompactTrace,
    /// The whole trace, expanded when first asked for ([`Lowered::trace`]).
    expanded: std::sync::OnceLock<Trace>,
    /// The events as a replay takes them, made at the first replay and shared by the others.
    pieces: std::sync::OnceLock<Vec<ReplayPiece>>,
    /// Time to build and lower, in milliseconds.
    pub lower_ms: f64,
    /// Whether the step was written by a template of its structure ([`lower_step_instance`]) rather
    /// than lowered.
    pub from_template: bool,
    /// Notes for the user (ignored options, unknown config fields, the config's dtype).
    pub warnings: Vec<String>,
    /// The attention kernel and why (`None` for models without attention).
    pub attention: Option<KernelChoice>,
    /// The breakdown at the trace's peak, which no machine changes: computed at the first replay that
    /// does not run out of memory, shared by the others (sweeps replay one lowering on many machines).
    pub peak: std::sync::OnceLock<PeakBreakdown>,
}

impl Lowered {
    /// The whole trace, as [`vramsim_models::lower`] writes it (expanded from the compact form the
    /// first time it is asked for).
    pub fn trace(&self) -> &Trace {
        self.expanded.get_or_init(|| self.compact.expand())
    }

    /// The same step with `accum` micro-batches per optimizer step, without lowering again, where one
    /// lowering serves both counts (a compact lowering, of more than three micro-batches, serves
    /// every count from two: [`CompactTrace::with_accum`]); `None` otherwise.
    pub fn with_accum(&self, accum: u32) -> Option<Lowered> {
        let mut recipe = self.recipe.clone();
        recipe.accum = accum;
        let compact = self.compact.with_accum(&recipe)?;
        Some(Lowered {
            arch: self.arch.clone(),
            reference: self.reference.clone(),
            recipe,
            graph: self.graph.clone(),
            seq_given: self.seq_given,
            compact,
            expanded: std::sync::OnceLock::new(),
            pieces: std::sync::OnceLock::new(),
            lower_ms: self.lower_ms,
            from_template: self.from_template,
            warnings: self.warnings.clone(),
            attention: self.attention.clone(),
            peak: std::sync::OnceLock::new(),
        })
    }

    /// The events as a replay takes them.
    pub(crate) fn pieces(&self) -> &[ReplayPiece] {
        self.pieces.get_or_init(|| self.compact.replay_pieces())
    }
}

/// What `predict` measured, besides the replay's report.
pub struct Prediction {
    /// The architecture.
    pub arch: Arch,
    /// Its reference implementation.
    pub reference: String,
    /// Parameters, frozen ones included (PEFT's "all params").
    pub params: u64,
    /// The recipe.
    pub recipe: Recipe,
    /// Whether `--seq` was given.
    pub seq_given: bool,
    /// Events of the lowered trace.
    pub events: usize,
    /// Time to build and lower, in milliseconds.
    pub lower_ms: f64,
    /// Whether the step was written by a template of its structure rather than lowered.
    pub from_template: bool,
    /// Time to replay and break down, in milliseconds.
    pub replay_ms: f64,
    /// What is live at the peak (or at the out-of-memory error).
    pub breakdown: PeakBreakdown,
    /// The tag (`module:aten.op`) of the allocation that ran out of memory.
    pub oom_tag: Option<String>,
    /// Notes for the user.
    pub warnings: Vec<String>,
    /// The CUDA context the machine got and where its figure comes from.
    pub context: ContextChoice,
    /// The attention kernel and why (`None` for models without attention).
    pub attention: Option<KernelChoice>,
    /// Trainable parameters (`requires_grad`); [`Prediction::params`] counts every parameter.
    pub trainable_params: u64,
    /// NCCL's own device memory on the rank (none on one GPU), counted with the context.
    pub nccl: crate::nccl::NcclMemory,
    /// The kernels the step loads into the context at first use (lazy module loading), counted
    /// with it, and where the figure comes from; `None` where not measured.
    pub step_modules: Option<ContextChoice>,
}

/// A finished `predict`: the lowered step, the replay's report and what `predict` adds to it.
pub struct Predicted {
    /// The lowered step.
    pub lowered: Lowered,
    /// The replay's report.
    pub report: Report,
    /// The prediction (breakdown at the peak, recipe, warnings, ...).
    pub prediction: Prediction,
    /// DataParallel over two or more devices: every distinct device role (device 0 first, whose
    /// replay is `report`); empty otherwise.
    pub devices: Vec<crate::ranks::RankRole>,
    /// A pipeline (`--pp` 2 or more): every rank's role, by rank (`report` is the worst rank's);
    /// empty otherwise.
    pub stages: Vec<crate::ranks::RankRole>,
}

impl Predicted {
    /// `vramsim predict --json`'s document.
    pub fn to_json(&self) -> Value {
        let mut j = to_json(&self.report, &self.prediction, &self.lowered.compact.meta);
        if !self.devices.is_empty() {
            j["devices"] = crate::dataparallel::to_json(&self.lowered.recipe, &self.devices);
        }
        if !self.stages.is_empty() {
            j["ranks"] = crate::ranks::to_json(&self.stages);
            if crate::context_parallel::is_context_parallel(&self.lowered.recipe) {
                j["context_parallel"] =
                    crate::context_parallel::to_json(&self.lowered.recipe, &self.stages);
            }
            if crate::pipeline::is_pipeline(&self.lowered.recipe) {
                j["pipeline"] = crate::pipeline::to_json(&self.lowered.recipe, &self.stages);
            }
        }
        j
    }

    /// `vramsim predict`'s table.
    pub fn to_table(&self) -> String {
        let mut t = to_table(&self.report, &self.prediction);
        if !self.devices.is_empty() {
            t.push_str(&crate::dataparallel::to_table(
                &self.lowered.recipe,
                &self.devices,
            ));
        }
        if crate::context_parallel::is_context_parallel(&self.lowered.recipe)
            && !crate::pipeline::is_pipeline(&self.lowered.recipe)
        {
            t.push_str(&crate::context_parallel::to_table(
                &self.lowered.recipe,
                &self.stages,
            ));
        } else if !self.stages.is_empty() {
            t.push_str(&crate::pipeline::to_table(
                &self.lowered.recipe,
                &self.stages,
            ));
        }
        t
    }
}

/// `vramsim predict` without the printing: lowers and replays the step, writes `--trace-out` and
/// draws `--plot` when given.
pub fn predict(args: &PredictArgs) -> Result<Predicted> {
    // A pipeline or context parallelism: every rank replayed, the worst one reported in full.
    let (lowered, stages) = if args.pp > 1 || args.cp > 1 {
        crate::pipeline::rank_roles(args)?
    } else {
        (lower_step(args)?, Vec::new())
    };
    if let Some(path) = &args.trace_out {
        vramsim_traces::write_trace(path, lowered.trace())
            .map_err(|e| anyhow::anyhow!("cannot write the trace: {e}"))?;
    }
    let points = crate::replay::timeline_points(&args.plot);
    let (report, prediction) = replay_step(&lowered, &args.machine, points, true)?;
    let devices = if crate::dataparallel::is_multi(&lowered.recipe) {
        crate::dataparallel::device_roles(args, &lowered.recipe, &report)?
    } else {
        Vec::new()
    };
    if let Some(path) = &args.plot {
        draw_layout(args, &report, &prediction, &devices, &stages, path)?;
    }
    Ok(Predicted {
        lowered,
        report,
        prediction,
        devices,
        stages,
    })
}

/// Runs `vramsim predict`.
pub fn run(args: PredictArgs) -> Result<()> {
    let predicted = predict(&args)?;
    for w in &predicted.prediction.warnings {
        eprintln!("warning: {w}");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&predicted.to_json())?);
    } else {
        print!("{}", predicted.to_table());
        if let Some(path) = &args.plot {
            println!("plot       {}", path.display());
            if !predicted.lowered.recipe.parallel.is_single() {
                println!(
                    "plot       {} (a bar per role)",
                    crate::ranks::roles_plot_path(path).display()
                );
            }
        }
        if let Some(path) = &args.trace_out {
            println!("trace out  {}", path.display());
        }
    }
    Ok(())
}

/// Builds the model `args` name (zoo or config.json) and lowers its step under their recipe
/// (for a pipeline, the rank with the largest peak allocated: `pipeline::lower_worst_rank`).
pub fn lower_step(args: &PredictArgs) -> Result<Lowered> {
    if args.pp > 1 || args.cp > 1 {
        return crate::pipeline::lower_worst_rank(args);
    }
    lower_step_device(args, 0)
}

/// [`lower_step`] for one device of a DataParallel layout, or one rank of a pipeline (`device`
/// 0 otherwise): the graph is built for the device's chunk of the batch, or the rank's stages.
pub fn lower_step_device(args: &PredictArgs, device: u32) -> Result<Lowered> {
    assemble(args, device, |arch, recipe| {
        let graph = step_graph(arch, recipe)?;
        let compact = lower_compact(&graph, recipe)?;
        Ok((graph, compact))
    })
}

/// [`lower_step`] without lowering (lowering once per structure): the step written by `template` at
/// this configuration's batch ([`vramsim_models::template::BatchTemplate`]) or batch and sequence
/// length ([`vramsim_models::seq_template::SeqBatchTemplate`]), or lowered afresh where the template
/// does not reach (a size that would leave the range of bytes, a length of another residue). The caller
/// checked that the template is this configuration's structure (the same options but the batch and
/// length, and a fresh lowering it reproduced).
pub fn lower_step_instance(args: &PredictArgs, template: &dyn StepTemplate) -> Result<Lowered> {
    let mut instantiated = false;
    let mut lowered = assemble(args, 0, |arch, recipe| {
        let Some(compact) = template.instantiate_for(recipe) else {
            let graph = step_graph(arch, recipe)?;
            let compact = lower_compact(&graph, recipe)?;
            return Ok((graph, compact));
        };
        instantiated = true;
        // the template's graph too, where it writes one (of a plain layout)
        let graph = match template.graph_for(recipe) {
            Some(graph)
                if !crate::pipeline::is_pipeline(recipe)
                    && !crate::dataparallel::is_multi(recipe) =>
            {
                graph
            }
            _ => step_graph(arch, recipe)?,
        };
        Ok((graph, compact))
    })?;
    lowered.from_template = instantiated;
    Ok(lowered)
}

/// The model graph of `recipe`'s step: the replica's chunk of the batch for a DataParallel device,
/// the stages of a pipeline rank.
fn step_graph(arch: &Arch, recipe: &Recipe) -> Result<Graph> {
    if crate::pipeline::is_pipeline(recipe) {
        crate::pipeline::rank_graph(arch, recipe)
    } else {
        crate::dataparallel::device_graph(arch, recipe)
    }
}

/// The step of `args` (for `device` of a DataParallel layout or a pipeline) as `step` makes its graph
/// and lowering, with what `predict` reports beside them.
fn assemble(
    args: &PredictArgs,
    device: u32,
    step: impl FnOnce(&Arch, &Recipe) -> Result<(Graph, CompactTrace)>,
) -> Result<Lowered> {
    let (arch, mut recipe, warnings) = step_recipe(args)?;
    if recipe.parallel.pp > 1 && recipe.parallel.cp > 1 {
        // pipeline rank `device / cp`, context-parallel rank `device % cp`
        // (`pipeline::rank_count`)
        recipe.parallel.stage = device / recipe.parallel.cp;
        recipe.parallel.cp_rank = device % recipe.parallel.cp;
    } else if recipe.parallel.pp > 1 {
        recipe.parallel.stage = device;
    } else if recipe.parallel.cp > 1 {
        recipe.parallel.cp_rank = device;
    } else {
        recipe.parallel.device = device;
    }
    let t0 = Instant::now();
    let attention = arch.attention_kernel(&recipe)?;
    let (graph, compact) = step(&arch, &recipe)?;
    let lower_ms = t0.elapsed().as_secs_f64() * 1e3;
    let reference = graph
        .meta
        .get("reference")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    Ok(Lowered {
        arch,
        reference,
        recipe,
        graph: std::sync::Arc::new(graph),
        seq_given: args.seq.is_some(),
        compact,
        expanded: std::sync::OnceLock::new(),
        pieces: std::sync::OnceLock::new(),
        lower_ms,
        from_template: false,
        warnings,
        attention,
        peak: std::sync::OnceLock::new(),
    })
}

/// The architecture `args` name (zoo or config.json), the recipe they describe, and notes for the
/// user (ignored options, unknown config fields, the config's dtype).
pub fn step_recipe(args: &PredictArgs) -> Result<(Arch, Recipe, Vec<String>)> {
    let mut warnings = Vec::new();
    // `use_cache` of an imported config.json (None: absent, transformers' default).
    let mut config_use_cache = None;
    let arch = match (&args.model, &args.hf_config) {
        _ if args.graph.is_some() => {
            let path = args.graph.as_deref().unwrap_or(std::path::Path::new(""));
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the graph {}", path.display()))?;
            let g = vramsim_models::imported::ImportedGraph::parse(&text)
                .with_context(|| format!("cannot import the graph {}", path.display()))?;
            let recorded = g.recorded();
            if !recorded.is_empty() {
                warnings.push(format!(
                    "{}: calls without a rule use the behaviour recorded at capture (outputs, what autograd saved, their backward's allocations, autocast's policy of the ATen op of that name; temporaries inside their forward are not modelled): {}",
                    g.name,
                    vramsim_models::imported::list_calls(&recorded)
                ));
            }
            if args.checkpoint != Checkpointing::None && g.blocks().is_empty() {
                warnings.push(format!(
                    "{}: a captured module has no checkpointable blocks marked, so --checkpoint {} checkpoints nothing",
                    g.name, args.checkpoint
                ));
            }
            Arch::Imported(std::sync::Arc::new(g))
        }
        (Some(name), _) => Arch::from_name(name)?,
        (None, Some(path)) => {
            let opts = ImportOptions {
                name: config_name(path),
                allow_unknown_fields: args.hf_allow_unknown,
            };
            let cfg = hf::read(path, &opts)
                .with_context(|| format!("cannot import {}", path.display()))?;
            warnings.extend(cfg.warnings);
            config_use_cache = cfg.use_cache;
            if let Some(dtype) = cfg.torch_dtype {
                if args.precision.to_string() != short_dtype(&dtype) {
                    warnings.push(format!(
                        "the config's torch_dtype is {dtype}; the step runs at --precision {} (parameters in {})",
                        args.precision,
                        if args.precision == Precision::Bf16 { "bfloat16" } else { "float32" }
                    ));
                }
            }
            cfg.arch
        }
        (None, None) => {
            anyhow::bail!("give a model: --model NAME, --hf-config FILE or --graph FILE")
        }
    };
    let seq = match (arch.max_positions(), args.seq) {
        (Some(_), Some(s)) => s,
        (Some(max), None) => DEFAULT_SEQ.min(max),
        // A captured module whose sequence length is a variable: the example's by default.
        (None, given) if arch.dynamic_seq().is_some() => given.or(arch.dynamic_seq()).unwrap_or(0),
        (None, given) => {
            if given.is_some() {
                warnings.push(format!(
                    "{} takes images (or features), not sequences: --seq is ignored",
                    arch.name()
                ));
            }
            0
        }
    };
    let recipe = Recipe {
        batch: args.batch,
        seq,
        precision: args.precision,
        optimizer: args.optimizer,
        optimizer_impl: args.optimizer_impl,
        checkpointing: args.checkpoint,
        accum: args.accum,
        iterations: args.iterations,
        inference: args.inference,
        attention: args.attention,
        target: target(&args.machine)?,
        zero_grad: args.zero_grad,
        clip_grad_norm: args.clip_grad_norm,
        grad_scaler: args.grad_scaler,
        workspaces: Workspaces {
            cublas_mode: if args.cublas_workspace_cache {
                CublasWorkspaceMode::Persistent
            } else {
                CublasWorkspaceMode::PerCall
            },
            cublas_workspace_config: args.cublas_workspace_config.clone(),
            cublaslt_workspace_kib: args.cublaslt_workspace_size,
            cudnn_benchmark: args.cudnn_benchmark,
        },
        head: args.head,
        loss: args.loss,
        keep_outputs: args.keep_outputs,
        image_size: args.image_size,
        num_classes: args.num_classes,
        checkpoint_impl: args.checkpoint_impl,
        torch_version: args.torch_version,
        transformers_version: args.transformers_version,
        use_cache: args.use_cache.or(config_use_cache),
        freeze: args.freeze.clone(),
        lora: args.lora.clone(),
        quant: args.quant.and_then(|q| q.0),
        parallel: Parallel {
            dp: args.dp,
            shard: args.shard,
            world_size: args.world_size,
            fsdp_param_dtype: args.fsdp_param_dtype,
            fsdp_reduce_dtype: args.fsdp_reduce_dtype,
            gradient_as_bucket_view: args.ddp_bucket_view,
            output_device: args.output_device,
            device: 0,
            tp: args.tp,
            sp: args.sp,
            pp: args.pp,
            pp_schedule: args.pp_schedule,
            microbatches: args.microbatches,
            stage: 0,
            offload: args.offload,
            reshard_after_forward: args.reshard_after_forward,
            cp: args.cp,
            cp_rank: 0,
            pp_loop: args.pp_loop,
        },
        quant_storage: args.quant_storage,
        ..Recipe::default()
    };
    let mut recipe = recipe;
    if let Some(preset) = args.preset {
        let defaults = crate::presets::Defaults {
            precision: args.precision == Precision::Fp32,
            optimizer: args.optimizer == OptimizerKind::AdamW,
            optimizer_impl: args.optimizer_impl == OptimizerImpl::Foreach,
            checkpoint: args.checkpoint == Checkpointing::None,
            accum: args.accum == 1,
        };
        warnings.extend(crate::presets::apply(
            preset,
            &arch,
            &mut recipe,
            &defaults,
        )?);
    }
    if let Some(r) = args.lora_r {
        recipe.lora.get_or_insert_with(Default::default).r = r;
    }
    recipe.validate()?;
    let (_, cublas_warning) = recipe
        .workspaces
        .cublas_workspace_bytes(recipe.target.compute_capability);
    // PyTorch's own TORCH_WARN for a CUBLAS_WORKSPACE_CONFIG with no `:SIZE:COUNT`.
    warnings.extend(cublas_warning);
    Ok((arch, recipe, warnings))
}

/// The name a config.json gets in reports: its directory's name for `.../NAME/config.json`, else
/// the file's stem (`_name_or_path` is taken when neither says anything).
fn config_name(path: &Path) -> Option<String> {
    let stem = path.file_stem()?.to_string_lossy().into_owned();
    if stem == "config" {
        let dir = path.parent()?.file_name()?.to_string_lossy().into_owned();
        return Some(dir).filter(|d| !d.is_empty() && d != ".");
    }
    Some(stem)
}

/// `bfloat16` → `bf16`, `float32` → `fp32`: to compare a config's dtype with `--precision`.
fn short_dtype(dtype: &str) -> &str {
    match dtype {
        "float32" => "fp32",
        "bfloat16" => "bf16",
        "float16" => "fp16",
        other => other,
    }
}

/// What the library workspaces are: the cuBLAS size and lifetime, cuBLASLt's, cudnn.benchmark.
fn workspace_line(r: &Recipe) -> String {
    let w = &r.workspaces;
    if r.torch_version == TorchVersion::V1_10 {
        return format!(
            "PyTorch 1.10: no workspace from the caching allocator; cuBLAS's own pool of {} per handle (forward and backward threads), counted with the context; cudnn.benchmark {}",
            format_size(Workspaces::cublas_own_pool_bytes(r.target.compute_capability)),
            if w.cudnn_benchmark { "on" } else { "off" }
        );
    }
    let (cublas, _) = w.cublas_workspace_bytes(r.target.compute_capability);
    let mode = match w.cublas_mode {
        CublasWorkspaceMode::PerCall => "per GEMM call (PyTorch 2.15's default)",
        CublasWorkspaceMode::Persistent => "kept per thread (TORCH_CUBLAS_WORKSPACE_CACHE=1)",
    };
    // With the cache on, cuBLASLt shares its handle's workspace (2.15's unified workspaces).
    let lt = match w.cublas_mode {
        CublasWorkspaceMode::PerCall => format!(
            "cuBLASLt {} per fused-bias addmm",
            format_size(w.cublaslt_workspace_bytes())
        ),
        CublasWorkspaceMode::Persistent => "cuBLASLt shares it".to_string(),
    };
    format!(
        "cuBLAS workspace {} {mode}, {lt}; cudnn.benchmark {} (category workspace)",
        format_size(cublas),
        if w.cudnn_benchmark { "on" } else { "off" }
    )
}

fn recipe_line(p: &Prediction) -> String {
    let r = &p.recipe;
    let mut s = format!("batch {}", r.batch);
    if r.seq > 0 {
        let _ = write!(
            s,
            " × seq {}{}",
            r.seq,
            if p.seq_given { "" } else { " (default)" }
        );
    }
    let _ = write!(s, ", {}", r.precision);
    if r.inference {
        s.push_str(", inference (eval, no_grad)");
    } else {
        let imp = match (r.optimizer, r.optimizer_impl) {
            // transformers' Adafactor has only its Python loop
            (OptimizerKind::AdafactorHf | OptimizerKind::AdamWHf, _) => "for-loop",
            // bitsandbytes: one fused kernel per parameter
            (
                OptimizerKind::AdamW8bit
                | OptimizerKind::PagedAdamW
                | OptimizerKind::PagedAdamW8bit,
                _,
            ) => "bitsandbytes",
            (_, OptimizerImpl::Foreach) => "foreach",
            (_, OptimizerImpl::Fused) => "fused",
            (_, OptimizerImpl::ForLoop) => "for-loop",
        };
        let _ = write!(
            s,
            ", {} ({imp}), checkpoint {}, accum {}",
            r.optimizer, r.checkpointing, r.accum
        );
        if r.checkpointing != Checkpointing::None && r.checkpoint_impl == CheckpointImpl::Reentrant
        {
            s.push_str(" (reentrant)");
        }
        if let Some(q) = r.quant {
            let _ = write!(s, ", {q} weights");
        }
        if let Some(l) = &r.lora {
            let _ = write!(s, ", LoRA {l}");
        }
        if !r.freeze.is_empty() {
            let _ = write!(s, ", frozen {}", r.freeze.join(","));
        }
        if r.zero_grad == ZeroGrad::Zero {
            s.push_str(", zero_grad(set_to_none=False)");
        }
        if let Some(m) = r.clip_grad_norm {
            let _ = write!(s, ", clip_grad_norm {m}");
        }
        if r.uses_grad_scaler() {
            s.push_str(", GradScaler");
        }
    }
    let _ = write!(s, ", {} iterations", r.iterations);
    if r.torch_version != TorchVersion::V2_15 {
        let _ = write!(s, ", PyTorch {} rules", r.torch_version);
    }
    if r.transformers_version != TransformersVersion::V5_23 {
        let _ = write!(s, ", transformers {} model code", r.transformers_version);
    }
    if let Some(k) = &p.attention {
        let _ = write!(s, ", {} attention", k.kernel.name());
        if r.attention != Attention::Auto && r.attention.to_string() != k.kernel.name() {
            let _ = write!(s, " (--attention {})", r.attention);
        }
    }
    let _ = write!(s, "{}", head_text(p));
    if r.keep_outputs {
        s.push_str(", loop keeps outputs");
    }
    s
}

/// The head and loss of a language model (`, head seq-cls:2, hf loss`), or the images and classes
/// of an image model (`, 3×384×384 images, 10 classes`), as the step was built.
fn head_text(p: &Prediction) -> String {
    let r = &p.recipe;
    if let Ok(Some(head)) = p.arch.head(r) {
        // nanoGPT's GPT.forward computes its own plain cross-entropy whatever --loss says.
        if matches!(p.arch, Arch::NanoGpt(_)) {
            return format!(", head {head}, nanoGPT's plain loss");
        }
        return format!(", head {head}, {} loss", r.loss);
    }
    let mut s = String::new();
    if let Ok((h, w)) = p.arch.image_size(r) {
        if h > 0 {
            let _ = write!(s, ", 3×{h}×{w} images");
        }
    }
    if let Ok(n) = p.arch.num_classes(r) {
        let _ = write!(s, ", {n} classes");
    }
    s
}

fn phase_text(b: &PeakBreakdown) -> String {
    match (&b.phase, b.iteration) {
        (Some(p), Some(i)) => format!("{p} of iteration {i}"),
        (Some(p), None) => p.clone(),
        (None, _) => "(no phase)".into(),
    }
}

fn category_summary(cats: &[(vramsim_traces::Category, u64)]) -> String {
    let mut sorted = cats.to_vec();
    sorted.sort_by_key(|c| std::cmp::Reverse(c.1));
    sorted
        .iter()
        .take(3)
        .map(|(c, b)| format!("{} {}", c.name(), format_size(*b)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The human-readable report: the model and recipe, the replay's own table, then what is live at
/// the peak and where an out-of-memory error is raised.
pub fn to_table(report: &Report, p: &Prediction) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model      {}: {}, {} parameters{}",
        p.arch.name(),
        p.reference,
        group_digits(p.params),
        if p.trainable_params == p.params {
            String::new()
        } else {
            format!(" ({} trainable)", group_digits(p.trainable_params))
        }
    );
    let _ = writeln!(out, "recipe     {}", recipe_line(p));
    let _ = writeln!(out, "kernels    {}", workspace_line(&p.recipe));
    let mut with = Vec::new();
    if let Some(m) = &p.step_modules {
        with.push(format!(
            "{} of kernels: see the modules line",
            format_size(m.bytes)
        ));
    }
    if p.nccl.bytes > 0 {
        with.push(format!(
            "NCCL's {}: see the nccl line",
            format_size(p.nccl.bytes)
        ));
    }
    let _ = writeln!(
        out,
        "context    {}, CUDA {}: {}{}",
        format_size(report.device.context_bytes),
        p.context.cuda,
        p.context.source,
        if with.is_empty() {
            String::new()
        } else {
            format!(" (with {})", with.join("; "))
        }
    );
    if let Some(m) = &p.step_modules {
        let _ = writeln!(
            out,
            "modules    {} of kernels and cuBLAS handles the step loads at their first call (lazy module loading), outside the allocator: {}",
            format_size(m.bytes),
            m.source
        );
    }
    if let Some(k) = &p.attention {
        let _ = writeln!(out, "attention  {}", k.reason);
    }
    let _ = writeln!(
        out,
        "lowered    {} events in {:.1} ms, replayed in {:.1} ms",
        group_digits(p.events as u64),
        p.lower_ms,
        p.replay_ms
    );
    out.push_str(&report.to_table());
    if !p.recipe.parallel.is_single()
        && !crate::dataparallel::is_multi(&p.recipe)
        && !crate::pipeline::is_rank_by_rank(&p.recipe)
    {
        let roles = crate::ranks::roles(&p.recipe.parallel, report);
        out.push_str(&crate::ranks::to_table(&p.recipe.parallel, &roles));
        out.push_str(&crate::ranks::nccl_line(&p.nccl));
    }
    let b = &p.breakdown;
    out.push('\n');
    let at = if report.outcome.oom.is_some() {
        let _ = writeln!(
            out,
            "oom phase  {} ({} requested live with the failing allocation, event {})",
            phase_text(b),
            format_size(b.peak_requested),
            group_digits(b.event_index as u64)
        );
        "at the out-of-memory error"
    } else {
        let _ = writeln!(
            out,
            "peak phase {} (peak requested {} at event {})",
            phase_text(b),
            format_size(b.peak_requested),
            group_digits(b.event_index as u64)
        );
        "at peak requested"
    };
    if b.peak_requested > 0 {
        let pct = |x: u64| x as f64 * 100.0 / b.peak_requested as f64;
        let _ = writeln!(out, "\n{at}, by category");
        for (c, bytes) in &b.by_category {
            let _ = writeln!(
                out,
                "  {:<20}{:>14}{:>8.1}%",
                c.name(),
                format_size(*bytes),
                pct(*bytes)
            );
        }
        let _ = writeln!(out, "\n{at}, top modules");
        for m in b.by_module.iter().take(TOP_MODULES) {
            let _ = writeln!(
                out,
                "  {:<34}{:>12}{:>7.1}%  {}",
                m.module,
                format_size(m.bytes),
                pct(m.bytes),
                category_summary(&m.by_category)
            );
        }
        if b.by_module.len() > TOP_MODULES {
            let rest: u64 = b.by_module[TOP_MODULES..].iter().map(|m| m.bytes).sum();
            let _ = writeln!(
                out,
                "  {:<34}{:>12}{:>7.1}%",
                format!("({} more)", b.by_module.len() - TOP_MODULES),
                format_size(rest),
                pct(rest)
            );
        }
        let _ = writeln!(out, "\n{at}, largest allocations");
        for a in b.largest.iter().take(TOP_ALLOCATIONS) {
            let _ = writeln!(
                out,
                "  {:>12}  {:<16}{}",
                format_size(a.bytes),
                a.category.name(),
                a.tag
            );
        }
    }
    if let Some(oom) = &report.outcome.oom {
        out.push('\n');
        let _ = writeln!(
            out,
            "oom op     {} (event {}, {})",
            p.oom_tag.as_deref().unwrap_or("(untagged)"),
            group_digits(oom.event_index),
            report
                .outcome
                .phase_marks
                .iter()
                .rev()
                .find(|(i, _)| *i <= oom.event_index)
                .map(|(_, n)| n.as_str())
                .unwrap_or("no phase")
        );
    }
    out
}

/// The machine-readable report: the replay's JSON with the prediction's fields added.
pub fn to_json(report: &Report, p: &Prediction, meta: &Map<String, Value>) -> Value {
    let mut j = report.to_json();
    let b = &p.breakdown;
    let cats = |c: &[(vramsim_traces::Category, u64)]| -> Value {
        Value::Object(
            c.iter()
                .map(|(c, bytes)| (c.name().to_string(), json!(bytes)))
                .collect(),
        )
    };
    let r = &p.recipe;
    j["model"] = json!(p.arch.name());
    j["reference"] = json!(p.reference);
    j["params"] = json!(p.params);
    j["trainable_params"] = json!(p.trainable_params);
    // bitsandbytes paged optimizer states: CUDA managed memory, outside the device figures.
    j["paged_optimizer_bytes"] = meta
        .get("paged_optimizer_bytes")
        .cloned()
        .unwrap_or(json!(0));
    j["recipe"] = json!({
        "batch": r.batch,
        "seq": if r.seq > 0 { json!(r.seq) } else { Value::Null },
        "precision": r.precision.to_string(),
        "optimizer": r.optimizer.to_string(),
        "optimizer_impl": match r.optimizer_impl {
            OptimizerImpl::Foreach => "foreach",
            OptimizerImpl::Fused => "fused",
            OptimizerImpl::ForLoop => "for-loop",
        },
        "checkpoint": r.checkpointing.to_string(),
        "checkpoint_impl": r.checkpoint_impl.to_string(),
        "torch_version": r.torch_version.to_string(),
        "transformers_version": r.transformers_version.to_string(),
        "accum": r.accum,
        "iterations": r.iterations,
        "inference": r.inference,
        "attention": r.attention.to_string(),
        "fidelity": meta.get("fidelity").cloned().unwrap_or(Value::Null),
        "zero_grad": match r.zero_grad {
            ZeroGrad::SetToNone => "none",
            ZeroGrad::Zero => "zero",
        },
        "clip_grad_norm": r.clip_grad_norm,
        "grad_scaler": r.uses_grad_scaler(),
        "head": p.arch.head(r).ok().flatten().map(|h| h.to_string()),
        // `--loss` applies to the HF language models; nanoGPT computes its own plain loss and the
        // image models take nn.CrossEntropyLoss.
        "loss": match (&p.arch, p.arch.family()) {
            (Arch::NanoGpt(_), _) => Some("plain".to_string()),
            (_, Some(_)) => Some(r.loss.to_string()),
            (_, None) => None,
        },
        "keep_outputs": r.keep_outputs,
        "image_size": p.arch.image_size(r).ok().filter(|s| s.0 > 0).map(|(h, w)| json!([h, w])),
        "num_classes": p.arch.num_classes(r).ok().filter(|&n| n > 0),
        "freeze": r.freeze,
        "lora": r.lora.as_ref().map(|l| l.to_string()),
        "quant": r.quant.map(|q| q.to_string()),
        "quant_storage": r.quant.map(|_| vramsim_models::finetune::quant::quant_storage_name(r.quant_storage)),
    });
    let w = &r.workspaces;
    j["workspaces"] = json!({
        "cublas_bytes": w.cublas_workspace_bytes(r.target.compute_capability).0,
        "cublaslt_bytes": w.cublaslt_workspace_bytes(),
        "cublas_mode": match w.cublas_mode {
            CublasWorkspaceMode::PerCall => "per-call",
            CublasWorkspaceMode::Persistent => "persistent",
        },
        "cudnn_benchmark": w.cudnn_benchmark,
    });
    j["context"] = json!({
        "bytes": report.device.context_bytes,
        "cuda": p.context.cuda,
        "source": p.context.source,
        "step_modules_bytes": p.step_modules.as_ref().map(|m| m.bytes),
        "step_modules_source": p.step_modules.as_ref().map(|m| m.source.as_str()),
    });
    j["attention"] = match &p.attention {
        Some(k) => json!({
            "kernel": k.kernel.name(),
            "reason": k.reason,
        }),
        None => Value::Null,
    };
    j["peak_phase"] = json!(b.phase);
    j["breakdown"] = json!({
        "at": if report.outcome.oom.is_some() { "oom" } else { "peak_requested" },
        "event_index": b.event_index,
        "iteration": b.iteration,
        "peak_requested_bytes": b.peak_requested,
        "by_category": cats(&b.by_category),
        "by_module": b.by_module.iter().map(|m| json!({
            "module": m.module,
            "bytes": m.bytes,
            "allocations": m.allocations,
            "by_category": cats(&m.by_category),
        })).collect::<Vec<_>>(),
        "largest": b.largest.iter().map(|a| json!({
            "tag": a.tag,
            "bytes": a.bytes,
            "category": a.category.name(),
        })).collect::<Vec<_>>(),
    });
    if let Some(oom) = j.get_mut("oom").filter(|o| o.is_object()) {
        oom["tag"] = json!(p.oom_tag);
    }
    j["timing"] = json!({
        "events": p.events,
        "lower_ms": p.lower_ms,
        "from_template": p.from_template,
        "replay_ms": p.replay_ms,
    });
    j["warnings"] = json!(p.warnings);
    if let Arch::Imported(g) = &p.arch {
        // A captured module's calls lowered from their recording (from_module's fallback).
        j["recorded_calls"] = json!(g
            .recorded()
            .iter()
            .map(|(op, module, count)| json!({"op": op, "module": module, "count": count}))
            .collect::<Vec<_>>());
    }
    let par = &p.recipe.parallel;
    if !par.is_single() {
        // The top-level peaks are the worst rank's (one role for data parallelism).
        j["layout"] = json!({
            "dp": par.dp,
            "tp": par.tp,
            "sp": par.sp,
            "pp": par.pp,
            "cp": par.cp,
            "pp_schedule": par.pp_schedule.to_string(),
            "microbatches": par.microbatches,
            "offload": par.offload.to_string(),
            "shard": par.shard.to_string(),
            "world_size": par.world_size(),
            "fsdp_param_dtype": par.fsdp_param_dtype.map(|d| d.name()),
            "fsdp_reduce_dtype": par.fsdp_reduce_dtype.map(|d| d.name()),
            "gradient_as_bucket_view": par.gradient_as_bucket_view,
            "nccl": {
                "bytes": p.nccl.bytes,
                "given": p.nccl.given,
                "channels": p.nccl.channels,
                "communicators": p.nccl.communicators.iter().map(|(d, n)| json!({"group": d, "ranks": n})).collect::<Vec<_>>(),
            },
            "reshard_after_forward": par.reshard_after_forward.to_string(),
        });
        if !crate::dataparallel::is_multi(&p.recipe) {
            j["ranks"] = crate::ranks::to_json(&crate::ranks::roles(par, report));
        }
    }
    j
}

fn draw(report: &Report, p: &Prediction, path: &Path) -> Result<()> {
    let title = format!("{} · {}", p.arch.name(), recipe_line(p));
    report
        .plot_timeline(&title, path)
        .with_context(|| format!("cannot draw {}", path.display()))
}

/// `--plot`: the step's timeline at `path`; for a parallel layout, the worst role's step there
/// (the highest device use; DataParallel's other devices are replayed again with a timeline; a
/// pipeline's `report` is already its worst rank's), and a bar per role at `NAME-roles.EXT` beside
/// it.
fn draw_layout(
    args: &PredictArgs,
    report: &Report,
    p: &Prediction,
    devices: &[crate::ranks::RankRole],
    stages: &[crate::ranks::RankRole],
    path: &Path,
) -> Result<()> {
    let par = &p.recipe.parallel;
    if par.is_single() {
        return draw(report, p, path);
    }
    let roles = match (devices.is_empty(), stages.is_empty()) {
        (false, _) => devices.to_vec(),
        (true, false) => stages.to_vec(),
        (true, true) => crate::ranks::roles(par, report),
    };
    // DataParallel: the device whose trace stands for the worst role
    let worst = if devices.is_empty() {
        0
    } else {
        roles
            .iter()
            .max_by_key(|r| (!r.fits, r.peak_device_used))
            .map(|r| r.ranks[0])
            .unwrap_or(0)
    };
    if worst == 0 {
        draw(report, p, path)?;
    } else {
        let lowered = lower_step_device(args, worst)?;
        let points = crate::replay::timeline_points(&args.plot);
        let (r, mut q) = replay_step(&lowered, &args.machine, points, false)?;
        q.recipe.parallel.device = worst;
        let title = format!(
            "{} · {} · device {worst}, the worst",
            q.arch.name(),
            recipe_line(&q)
        );
        r.plot_timeline(&title, path)
            .with_context(|| format!("cannot draw {}", path.display()))?;
    }
    let bars_path = crate::ranks::roles_plot_path(path);
    crate::ranks::plot_roles(
        &format!("{} · {} · peak per role", p.arch.name(), recipe_line(p)),
        &roles,
        report.device.total_memory,
        &bars_path,
    )
    .with_context(|| format!("cannot draw {}", bars_path.display()))
}
