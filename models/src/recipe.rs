//! [`Recipe`]: everything about a training step that is not the model, and its validation.

use std::fmt;
use std::str::FromStr;

/// Numeric precision of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything float32.
    #[default]
    Fp32,
    /// `model.to(torch.bfloat16)`: parameters, gradients, optimizer state and activations in
    /// bfloat16, except where the model code upcasts explicitly.
    Bf16,
    /// float32 parameters, `torch.autocast(dtype=torch.float16)` forward, `GradScaler`.
    AmpFp16,
    /// float32 parameters, `torch.autocast(dtype=torch.bfloat16)` forward, no scaler.
    AmpBf16,
    /// DeepSpeed's fp16 mode (`"fp16": {"enabled": true}`, only under `--shard zero1|zero2|zero3`):
    /// float16 parameters, gradients and activations (`engine.py` `_configure_distributed_model`:
    /// `module.half()`), an fp32 master partition and DeepSpeed's dynamic loss scaler (no
    /// autocast, no torch `GradScaler`).
    Fp16,
}

/// Which blocks `torch.utils.checkpoint` wraps (its implementation: [`CheckpointImpl`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Checkpointing {
    /// No recomputation.
    #[default]
    None,
    /// Every block (HF `gradient_checkpointing_enable()`).
    Full,
    /// Every K-th block (blocks 0, K, 2K, ...).
    Every(u32),
    /// Only the attention core of each block (Korthikanti et al.'s selective recomputation).
    Selective,
    /// `checkpoint_sequential(blocks, segments=round(√n))`: the blocks in √n segments, the last
    /// segment not checkpointed.
    Sqrt,
    /// torchtitan's op-level selective activation checkpointing (`activation_checkpoint.mode =
    /// "selective"`, `selective_ac_option = "op"`): every block wrapped in non-reentrant
    /// `torch.utils.checkpoint` with `context_fn=create_selective_checkpoint_contexts(policy)`,
    /// the policy saving the outputs of `aten.mm` (every other one, counted per block), of the
    /// flash and memory-efficient SDPA kernels and of `aten.abs`/`aten.max`/`reduce_scatter_tensor`
    /// (torchtitan 9dec370 `parallelize_llama.py` `_save_list`), recomputing the rest.
    SelectiveOp,
}

/// Which `torch.utils.checkpoint` implementation `--checkpoint` uses (`use_reentrant`).
///
/// transformers 5.23's `activation_checkpointing_enable(None)` (and the deprecated
/// `gradient_checkpointing_enable`) passes `{"use_reentrant": False}` (`modeling_utils.py`
/// `_activation_checkpointing_enable`), so non-reentrant is what an HF user gets today. A bare
/// `torch.utils.checkpoint.checkpoint(fn, x)` in PyTorch 2.15 warns and takes `use_reentrant=True`
/// (`torch/utils/checkpoint.py` `checkpoint`); PyTorch ≤ 1.10 had only the reentrant version, which
/// transformers ≤ 4.34 called.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CheckpointImpl {
    /// `use_reentrant=False` (`_checkpoint_without_reentrant_generator`): the region's forward
    /// builds its graph with pack hooks that keep only the inputs; the first backward node that
    /// unpacks reruns the region up to its last saving op, each recomputed tensor going when its
    /// node has run.
    #[default]
    NonReentrant,
    /// `use_reentrant=True` (`CheckpointFunction`): the forward runs under `torch.no_grad()`
    /// keeping the inputs (`ctx.save_for_backward`); its backward reruns the whole region with grad
    /// on detached inputs, then `torch.autograd.backward(outputs, grads)` runs the region's own graph
    /// inside the outer backward node, and returns the detached inputs' `.grad`.
    Reentrant,
}

/// The PyTorch release whose rules the lowering follows where they changed (`--torch-version`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TorchVersion {
    /// PyTorch 2.15, the reference version.
    #[default]
    V2_15,
    /// PyTorch 1.10 (late 2021), where it differs from 2.15 in what the lowering models:
    ///
    /// * `_softmax`/`_log_softmax` backward formulas take `self` (derivatives.yaml
    ///   `_softmax_backward_data(grad, result, dim, self)`), so autograd saves the input besides the
    ///   result (pytorch/pytorch#64000; `self` was dropped by #65242, in 1.11);
    /// * ATen never gives cuBLAS a workspace (`cublasSetWorkspace` came with #83461, in 2.0;
    ///   #95668: "1.13 does not have this issue"), and `addmm` has no cuBLASLt path: GEMMs take
    ///   nothing from the caching allocator; each cuBLAS handle (one per thread that runs a GEMM)
    ///   uses the default workspace pool cuBLAS allocates itself (see
    ///   [`Workspaces::cublas_own_pool_bytes`]).
    V1_10,
}

/// The transformers release whose model code the HF families follow where it changed memory
/// (`--transformers-version`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransformersVersion {
    /// transformers 5.23, the reference version.
    #[default]
    V5_23,
    /// transformers 4.16 (early 2022). BERT: `BertModel.forward` makes
    /// `attention_mask = torch.ones((B, S))` when none is given and
    /// `get_extended_attention_mask` turns it into `(1.0 - mask[:, None, None, :].to(self.dtype)) *
    /// -10000.0`, which every eager `BertSelfAttention` adds to its scaled scores (5.23 skips an
    /// all-ones mask). Under float16 autocast that float32 mask promotes the scores to float32.
    V4_16,
}

/// The optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OptimizerKind {
    /// `torch.optim.SGD(lr)`.
    Sgd,
    /// `torch.optim.SGD(lr, momentum=0.9)`.
    SgdMomentum,
    /// `torch.optim.SGD(lr, momentum=0.9, nesterov=True)`: the momentum buffers of `sgd-momentum`;
    /// the for-loop implementation also makes one `grad.add(buf, alpha=momentum)` per parameter.
    SgdNesterov,
    /// `torch.optim.Adam`.
    Adam,
    /// `torch.optim.AdamW(weight_decay=0.01)`.
    #[default]
    AdamW,
    /// `torch.optim.Adafactor` (PyTorch's, foreach or for-loop).
    Adafactor,
    /// HuggingFace's `transformers.optimization.Adafactor` as HF Trainer builds it for
    /// `optim="adafactor"` (`scale_parameter=False, relative_step=False`, `beta1=None`,
    /// `weight_decay=0`): a Python loop over the parameters, with factored second moments
    /// `exp_avg_sq_row`/`exp_avg_sq_col` for tensors of 2 or more dimensions, float32 state and
    /// float32 copies of 16-bit gradients and parameters.
    AdafactorHf,
    /// HuggingFace's own `transformers.optimization.AdamW` (HF Trainer's `optim="adamw_hf"`, its
    /// default before transformers 4.x moved to `adamw_torch`): a Python loop over the parameters
    /// that creates each parameter's `exp_avg`/`exp_avg_sq` when it first reaches it and makes one
    /// temporary per parameter, `denom = exp_avg_sq.sqrt().add_(eps)`.
    AdamWHf,
    /// bitsandbytes `bnb.optim.AdamW8bit` (transformers' `optim="adamw_8bit"`): block-wise 8-bit
    /// states, see [`crate::lower`]'s optimizer module (`bnb_step`).
    AdamW8bit,
    /// bitsandbytes `bnb.optim.PagedAdamW` (32-bit states; `optim="paged_adamw_32bit"`): the
    /// states of parameters of 1e5 elements or more live in CUDA unified memory.
    PagedAdamW,
    /// bitsandbytes `bnb.optim.PagedAdamW8bit` (`optim="paged_adamw_8bit"`).
    PagedAdamW8bit,
}

/// How the optimizer runs its math (`foreach`/`fused` arguments).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OptimizerImpl {
    /// `foreach=True`: PyTorch's default on CUDA; `_foreach_*` ops allocate intermediate lists.
    #[default]
    Foreach,
    /// `fused=True` (SGD, Adam, AdamW): one kernel, no intermediates, `step` on the device.
    Fused,
    /// `foreach=False`: a Python loop over parameters (intermediates one parameter at a time).
    ForLoop,
}

/// Whether `zero_grad` frees the gradients (`set_to_none=True`, the default) or zeroes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ZeroGrad {
    /// `optimizer.zero_grad(set_to_none=True)`.
    #[default]
    SetToNone,
    /// `optimizer.zero_grad(set_to_none=False)`: gradients stay allocated.
    Zero,
}

/// Attention implementation (`--attention`): what transformers' `attn_implementation` and
/// PyTorch's SDPA backend choice give by default, or one of them forced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Attention {
    /// What a user gets by default: transformers' `attn_implementation=None` → `"sdpa"` for
    /// classes with `_supports_sdpa` (GPT-2, BERT, LLaMA, Mistral, Qwen2 do), and PyTorch's
    /// backend choice for the recipe's GPU ([`crate::sdpa::select`]). torchvision's
    /// `nn.MultiheadAttention` always calls SDPA in training. `sdpa` (transformers'
    /// `attn_implementation="sdpa"`) parses to this: the same for these families.
    #[default]
    Auto,
    /// `eager`: HF's explicit matmuls, softmax and dropout (ViT: as `auto`, torchvision has no
    /// eager path).
    Eager,
    /// SDPA forced to FlashAttention-2 (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`).
    SdpaFlash,
    /// SDPA forced to the memory-efficient kernel.
    SdpaMemEfficient,
    /// SDPA forced to the composite math implementation.
    SdpaMath,
    /// SDPA forced to cuDNN attention.
    SdpaCudnn,
}

impl fmt::Display for Attention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Attention::Auto => "auto",
            Attention::Eager => "eager",
            Attention::SdpaFlash => "sdpa-flash",
            Attention::SdpaMemEfficient => "sdpa-mem-efficient",
            Attention::SdpaMath => "sdpa-math",
            Attention::SdpaCudnn => "sdpa-cudnn",
        })
    }
}

/// How faithfully to follow a dispatch-mode capture rather than CUDA eager PyTorch.
///
/// Under a `TorchDispatchMode` (and on meta tensors) `at::isTensorSubclassLike` is true, so the
/// autograd engine never accumulates gradients in place (`InputBuffer::accumulate` takes
/// `old_var + var`). On CUDA without a mode it reuses a buffer it holds the last reference to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Fidelity {
    /// Eager PyTorch on CUDA.
    #[default]
    Cuda,
    /// What `traces/python/vramsim_capture.py` records on the meta device.
    MetaCapture,
}

/// The GPU a step runs on, as far as the kernels PyTorch picks depend on it (SDPA backends, cuBLAS
/// workspace sizes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// `torch.cuda.get_device_capability()`: (major, minor).
    pub compute_capability: (u32, u32),
}

impl Default for Target {
    /// vramsim's default device, an 80 GB H100 (sm 9.0).
    fn default() -> Self {
        Target {
            compute_capability: (9, 0),
        }
    }
}

/// How long ATen's cuBLAS workspaces live (`aten/src/ATen/cuda/CublasHandlePool.cpp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CublasWorkspaceMode {
    /// PyTorch 2.15's default on CUDA (`TORCH_CUBLAS_WORKSPACE_CACHE` unset):
    /// `getCurrentCUDABlasHandleWithWorkspace` allocates a workspace of the chosen size from the caching
    /// allocator for every cuBLAS GEMM and frees it when the call returns; a cuBLASLt GEMM
    /// (`CublasLtWorkspace` in `CUDABlas.cpp`) allocates its own `CUBLASLT_WORKSPACE_SIZE` (1 MiB) the
    /// same way.
    #[default]
    PerCall,
    /// PyTorch ≤ 2.14, or 2.15 with `TORCH_CUBLAS_WORKSPACE_CACHE=1`: `setWorkspaceForHandle` allocates
    /// one workspace per (cuBLAS handle, stream) at the first GEMM and keeps it in a map until
    /// `torch._C._cuda_clearCublasWorkspaces()`. Handles are per thread, and the autograd engine runs
    /// CUDA backward on its own device thread, so a training step holds two: one for the forward (the
    /// main thread) and one for the backward. cuBLASLt GEMMs share the handle's workspace (2.15's
    /// unified workspaces, the default when caching is on).
    Persistent,
}

/// The default cuBLAS workspace of `parseChosenWorkspaceSize` (`CublasHandlePool.cpp`): `:4096:2:16:8`,
/// i.e. 2 × 4 MiB + 8 × 16 KiB = 8,519,680 bytes.
pub const CUBLAS_DEFAULT_WORKSPACE: u64 = 4096 * 1024 * 2 + 16 * 1024 * 8;

/// The cuBLAS workspace on compute capability major 9, 10, 11 and 12 (Hopper, Blackwell):
/// `4096 * 8 * 1024` = 32 MiB (`parseChosenWorkspaceSize`; in the 2.15 binary the test is
/// `major - 9 < 4`).
pub const CUBLAS_LARGE_WORKSPACE: u64 = 4096 * 8 * 1024;

/// `CUBLASLT_WORKSPACE_SIZE`'s default, 1024 KiB (`parseCUDABlasLtWorkspaceSize`, "according to #73328").
pub const CUBLASLT_DEFAULT_WORKSPACE: u64 = 1024 * 1024;

/// Library workspaces that kernels take from the caching allocator (category `workspace`).
///
/// None of them is visible to the meta-device capture, so a [`Fidelity::MetaCapture`] lowering emits
/// none.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Workspaces {
    /// Lifetime of the cuBLAS workspaces.
    pub cublas_mode: CublasWorkspaceMode,
    /// The `CUBLAS_WORKSPACE_CONFIG` environment variable (`":4096:8"`), if set; `None` takes PyTorch's
    /// default for the target GPU.
    pub cublas_workspace_config: Option<String>,
    /// The `CUBLASLT_WORKSPACE_SIZE` environment variable in KiB, if set; `None` takes 1024 KiB
    /// ([`CUBLASLT_DEFAULT_WORKSPACE`]).
    pub cublaslt_workspace_kib: Option<u64>,
    /// `torch.backends.cudnn.benchmark = True`: each new convolution configuration is benchmarked once,
    /// and the benchmark ends with `emptyCache()` (`Conv_v8.cpp` `run_single_conv`).
    pub cudnn_benchmark: bool,
}

impl Workspaces {
    /// The cuBLAS workspace in bytes for a GPU of `compute_capability`: `CUBLAS_WORKSPACE_CONFIG` as
    /// `parseChosenWorkspaceSize` reads it (every `:SIZE:COUNT` match adds SIZE KiB × COUNT; a value with
    /// no match gives the default, with PyTorch's warning as the second element), else the default:
    /// [`CUBLAS_LARGE_WORKSPACE`] on compute capability major 9–12, [`CUBLAS_DEFAULT_WORKSPACE`]
    /// elsewhere.
    pub fn cublas_workspace_bytes(&self, compute_capability: (u32, u32)) -> (u64, Option<String>) {
        let default = if (9..=12).contains(&compute_capability.0) {
            CUBLAS_LARGE_WORKSPACE
        } else {
            CUBLAS_DEFAULT_WORKSPACE
        };
        match &self.cublas_workspace_config {
            None => (default, None),
            Some(config) => match parse_cublas_workspace_config(config) {
                Ok(Some(bytes)) => (bytes, None),
                Ok(None) | Err(_) => (
                    default,
                    Some(format!(
                        "Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size of {default} bytes."
                    )),
                ),
            },
        }
    }
}

impl Workspaces {
    /// The default workspace pool cuBLAS allocates itself (`cudaMalloc`, outside PyTorch's caching
    /// allocator) for a handle no workspace was set on, used under PyTorch ≤ 1.13, which set none
    /// ([`TorchVersion::V1_10`]): taken as [`CUBLAS_DEFAULT_WORKSPACE`] (`:4096:2:16:8`, 8,519,680 B),
    /// [`CUBLAS_LARGE_WORKSPACE`] on compute capability 9 or more. Sources: pytorch/pytorch#89027
    /// (NVIDIA's eqy: the first explicit default, 4 MiB, "appears to be too small to match selected
    /// cuBLAS kernels before the explicit allocation change", hence `:4096:2:16:8`), and cuBLAS's
    /// "Results reproducibility" note that `CUBLAS_WORKSPACE_CONFIG=:4096:8` (32 MiB) "will increase
    /// library footprint in GPU memory by approximately 24MiB" (a default of about 8 MiB). NVIDIA's
    /// `cublasSetWorkspace` page only recommends "at least 4MiB (to match cuBLAS' default workspace
    /// pool)" (as #74159 quotes it). The driver's rounding of that allocation is not modelled.
    pub fn cublas_own_pool_bytes(compute_capability: (u32, u32)) -> u64 {
        if compute_capability.0 >= 9 {
            CUBLAS_LARGE_WORKSPACE
        } else {
            CUBLAS_DEFAULT_WORKSPACE
        }
    }

    /// The cuBLASLt workspace of one per-call GEMM in bytes (`CublasLtWorkspace`).
    pub fn cublaslt_workspace_bytes(&self) -> u64 {
        self.cublaslt_workspace_kib
            .map_or(CUBLASLT_DEFAULT_WORKSPACE, |kib| kib.saturating_mul(1024))
    }
}

/// Reads `CUBLAS_WORKSPACE_CONFIG` as `parseChosenWorkspaceSize` does: the sum of SIZE KiB × COUNT over
/// every match of the regex `:([0-9]+):([0-9]+)` anywhere in the string (`:4096:8` = 32 MiB,
/// `:4096:2:16:8` = 8,519,680 B, `:0:0` = no workspace). `Ok(None)` when nothing matches (PyTorch then
/// warns and takes its default); an error when a number does not fit in 64 bits (`std::stoull` throws).
pub fn parse_cublas_workspace_config(config: &str) -> Result<Option<u64>, RecipeError> {
    let bad = || RecipeError::Invalid {
        field: "cublas-workspace-config",
        msg: format!("{config:?}: a SIZE or COUNT does not fit in 64 bits"),
    };
    let b = config.as_bytes();
    let digits = |from: usize| b[from..].iter().take_while(|c| c.is_ascii_digit()).count();
    let mut total: u64 = 0;
    let mut matched = false;
    let mut i = 0;
    // std::regex_search semantics: leftmost match, then continue after it; `[0-9]+` is greedy.
    while i < b.len() {
        if b[i] == b':' {
            let n1 = digits(i + 1);
            if n1 > 0 && b.get(i + 1 + n1) == Some(&b':') {
                let n2 = digits(i + 2 + n1);
                if n2 > 0 {
                    let size: u64 = config[i + 1..i + 1 + n1].parse().map_err(|_| bad())?;
                    let count: u64 = config[i + 2 + n1..i + 2 + n1 + n2]
                        .parse()
                        .map_err(|_| bad())?;
                    let add = size
                        .checked_mul(1024)
                        .and_then(|x| x.checked_mul(count))
                        .ok_or_else(bad)?;
                    total = total.checked_add(add).ok_or_else(bad)?;
                    matched = true;
                    i += 2 + n1 + n2;
                    continue;
                }
            }
        }
        i += 1;
    }
    Ok(matched.then_some(total))
}

/// The head an HF model is built with (which `*For...` class), `--head`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// Causal language modelling: `GPT2LMHeadModel`, `LlamaForCausalLM` (`ForCausalLMLoss`).
    Lm,
    /// Masked language modelling: `BertForMaskedLM`.
    MaskedLm,
    /// `*ForSequenceClassification` with `num_labels = N`: one prediction per sequence (BERT's
    /// pooler output, GPT-2/LLaMA's last non-padding token); MSE regression for N = 1, cross-entropy
    /// otherwise.
    SeqCls(u64),
    /// `*ForTokenClassification` with `num_labels = N`: one prediction per token.
    TokenCls(u64),
    /// The base model (`GPT2Model`, `LlamaModel`, `BertModel`) with the training loop's loss
    /// `last_hidden_state.mean()`.
    None,
}

/// How a language model's loss is computed from its logits, `--loss`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Loss {
    /// The model computes it from `labels` with HF's loss functions (`loss_utils.py`):
    /// `ForCausalLMLoss` upcasts `logits.float()` and shifts the labels; token classification of
    /// the generic (LLaMA) heads upcasts too; BERT's and GPT-2's classification heads call
    /// `CrossEntropyLoss` on the logits as they are.
    #[default]
    Hf,
    /// The training loop calls the model without labels and takes
    /// `F.cross_entropy(logits.view(-1, V), targets.view(-1))` on the logits as they are (no float
    /// copy, no shift: the targets come shifted, as nanoGPT's do).
    Plain,
}

/// Everything about a training step that is not the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    /// Micro-batch size.
    pub batch: u64,
    /// Sequence length (language models).
    pub seq: u64,
    /// Precision.
    pub precision: Precision,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Optimizer implementation.
    pub optimizer_impl: OptimizerImpl,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub accum: u32,
    /// `zero_grad` mode.
    pub zero_grad: ZeroGrad,
    /// Optimizer steps to lower (2 or more to see the steady state).
    pub iterations: u32,
    /// Inference (`torch.no_grad()`, `model.eval()`): forward only, nothing saved.
    pub inference: bool,
    /// Attention implementation for the HF models.
    pub attention: Attention,
    /// CUDA eager semantics or the meta-device capture's.
    pub fidelity: Fidelity,
    /// The GPU the step runs on.
    pub target: Target,
    /// Input images of image models as (height, width); `None`: the model's default (224 × 224).
    pub image_size: Option<(u64, u64)>,
    /// Classes of an image model's classifier; `None`: the model's default (1000).
    pub num_classes: Option<u64>,
    /// `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` between backward and the
    /// optimizer step (after `scaler.unscale_` with a GradScaler); `None`: no clipping.
    pub clip_grad_norm: Option<f64>,
    /// `torch.amp.GradScaler` around the step; `None`: what a user gets by default (on for
    /// `amp-fp16`, as HF Trainer and PyTorch's AMP recipe do, off otherwise). See
    /// [`Recipe::uses_grad_scaler`].
    pub grad_scaler: Option<bool>,
    /// cuBLAS / cuBLASLt / cuDNN workspaces.
    pub workspaces: Workspaces,
    /// The head of an HF model (`--head`); `None`: the family's own (`lm` for GPT-2 and LLaMA,
    /// `masked-lm` for BERT).
    pub head: Option<Head>,
    /// How the loss is computed from the logits (`--loss`).
    pub loss: Loss,
    /// The training loop keeps the model's outputs (logits, loss) until the next forward returns
    /// and rebinds them (`--keep-outputs`).
    pub keep_outputs: bool,
    /// The `torch.utils.checkpoint` implementation of `checkpointing` (`--checkpoint-impl`).
    pub checkpoint_impl: CheckpointImpl,
    /// The PyTorch release whose rules apply (`--torch-version`).
    pub torch_version: TorchVersion,
    /// The transformers release whose model code applies (`--transformers-version`).
    pub transformers_version: TransformersVersion,
    /// `use_cache` of an HF decoder (GPT-2, LLaMA family) (`--use-cache`); `None`: the config's
    /// (`use_cache` of an imported config.json, else transformers' default True). The forward then
    /// builds a `DynamicCache` unless gradient checkpointing is on in training: see
    /// [`crate::zoo::use_cache`].
    pub use_cache: Option<bool>,
    /// Module paths whose parameters are frozen (`requires_grad_(False)`), `--freeze`: see
    /// [`crate::finetune::freeze`].
    pub freeze: Vec<String>,
    /// PEFT LoRA adapters (`--lora`): see [`crate::finetune::lora`].
    pub lora: Option<crate::finetune::LoraConfig>,
    /// bitsandbytes-quantized linear layers (`--quant`): see [`crate::finetune::quant`].
    pub quant: Option<crate::finetune::Quant>,
    /// The parallel layout (`--dp`, `--shard`, `--world-size`); the default is one GPU.
    pub parallel: crate::parallel::Parallel,
    /// The dtype the 4-bit codes are packed into (`--quant-storage`, transformers'
    /// `bnb_4bit_quant_storage`; uint8 by default): see [`crate::finetune::quant`].
    pub quant_storage: crate::dtype::DType,
}

impl Default for Recipe {
    fn default() -> Self {
        Recipe {
            batch: 1,
            seq: 1024,
            precision: Precision::Fp32,
            optimizer: OptimizerKind::AdamW,
            optimizer_impl: OptimizerImpl::Foreach,
            checkpointing: Checkpointing::None,
            accum: 1,
            zero_grad: ZeroGrad::SetToNone,
            iterations: 2,
            inference: false,
            attention: Attention::Auto,
            fidelity: Fidelity::Cuda,
            target: Target::default(),
            image_size: None,
            num_classes: None,
            clip_grad_norm: None,
            grad_scaler: None,
            workspaces: Workspaces::default(),
            head: None,
            loss: Loss::Hf,
            keep_outputs: false,
            checkpoint_impl: CheckpointImpl::NonReentrant,
            torch_version: TorchVersion::V2_15,
            transformers_version: TransformersVersion::V5_23,
            use_cache: None,
            freeze: Vec::new(),
            lora: None,
            quant: None,
            parallel: crate::parallel::Parallel::default(),
            quant_storage: crate::dtype::DType::U8,
        }
    }
}

impl Recipe {
    /// A default recipe (fp32, AdamW foreach, no checkpointing, 2 iterations) at `batch` × `seq`.
    pub fn new(batch: u64, seq: u64) -> Recipe {
        Recipe {
            batch,
            seq,
            ..Recipe::default()
        }
    }

    /// Whether the step runs under a `GradScaler`: [`Recipe::grad_scaler`] when given, else only
    /// for `amp-fp16` (HF Trainer creates one for `fp16=True` only; PyTorch's AMP recipe pairs it
    /// with float16 autocast).
    pub fn uses_grad_scaler(&self) -> bool {
        self.grad_scaler
            .unwrap_or(self.precision == Precision::AmpFp16)
    }

    /// Checks the fields that do not depend on the model.
    pub fn validate(&self) -> Result<(), RecipeError> {
        if self.batch == 0 {
            return Err(RecipeError::ZeroBatch);
        }
        if self.accum == 0 {
            return Err(RecipeError::Invalid {
                field: "accum",
                msg: "must be 1 or more".into(),
            });
        }
        if self.iterations == 0 {
            return Err(RecipeError::Invalid {
                field: "iterations",
                msg: "must be 1 or more".into(),
            });
        }
        // `torch.utils.checkpoint.checkpoint`: "Passing `context_fn` or `debug` is only supported
        // when use_reentrant=False" (a ValueError).
        if self.checkpointing == Checkpointing::SelectiveOp
            && self.checkpoint_impl == CheckpointImpl::Reentrant
        {
            return Err(RecipeError::Invalid {
                field: "checkpoint",
                msg: "selective-op (a context_fn) needs the non-reentrant checkpoint: PyTorch refuses context_fn with use_reentrant=True".into(),
            });
        }
        if let Checkpointing::Every(0) = self.checkpointing {
            return Err(RecipeError::Invalid {
                field: "checkpoint",
                msg: "every:K needs K ≥ 1".into(),
            });
        }
        if let Some(Head::SeqCls(0) | Head::TokenCls(0)) = self.head {
            return Err(RecipeError::Invalid {
                field: "head",
                msg: "seq-cls:N and token-cls:N need N ≥ 1 labels".into(),
            });
        }
        if let Some((h, w)) = self.image_size {
            if h == 0 || w == 0 {
                return Err(RecipeError::Invalid {
                    field: "image-size",
                    msg: format!("{h}x{w}: both sides must be 1 or more"),
                });
            }
        }
        if self.num_classes == Some(0) {
            return Err(RecipeError::Invalid {
                field: "num-classes",
                msg: "must be 1 or more".into(),
            });
        }
        if let Some(config) = &self.workspaces.cublas_workspace_config {
            parse_cublas_workspace_config(config)?;
        }
        if self.optimizer_impl == OptimizerImpl::Fused
            && matches!(
                self.optimizer,
                OptimizerKind::Adafactor
                    | OptimizerKind::AdafactorHf
                    | OptimizerKind::AdamWHf
                    | OptimizerKind::AdamW8bit
                    | OptimizerKind::PagedAdamW
                    | OptimizerKind::PagedAdamW8bit
            )
        {
            return Err(RecipeError::Invalid {
                field: "optimizer",
                msg: "Adafactor, transformers' AdamW and bitsandbytes' optimizers have no fused implementation (use foreach or for-loop; bitsandbytes runs its own kernel either way)".into(),
            });
        }
        if let Some(m) = self.clip_grad_norm {
            if !(m.is_finite() && m > 0.0) {
                return Err(RecipeError::Invalid {
                    field: "clip-grad-norm",
                    msg: format!("max_norm must be a positive finite number, got {m}"),
                });
            }
        }
        // transformers passes `bnb_4bit_quant_storage` to `Linear4bit` only
        // (`integrations/bitsandbytes.py` `replace_with_bnb_linear`).
        if self.quant_storage != crate::dtype::DType::U8
            && !matches!(self.quant, Some(q) if q != crate::finetune::Quant::Int8)
        {
            return Err(RecipeError::Invalid {
                field: "quant-storage",
                msg: format!(
                    "{} is bitsandbytes' 4-bit quant_storage: give --quant nf4, fp4, nf4-dq or fp4-dq{}",
                    crate::finetune::quant::quant_storage_name(self.quant_storage),
                    if self.quant.is_some() { " (LLM.int8's weights are always int8)" } else { "" }
                ),
            });
        }
        self.parallel.validate(self)?;
        Ok(())
    }

    /// The short name the capture fixtures use (`fp32-adamw-ckptfull-accum2`).
    pub fn name(&self) -> String {
        let mut s = format!("{}-{}", self.precision, self.optimizer);
        match self.checkpointing {
            Checkpointing::None => {}
            c => s.push_str(&format!("-ckpt{}", c.to_string().replace(':', ""))),
        }
        if self.accum != 1 {
            s.push_str(&format!("-accum{}", self.accum));
        }
        s
    }
}

/// A recipe that cannot be lowered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecipeError {
    /// `batch` is 0.
    #[error("batch must be 1 or more, got 0")]
    ZeroBatch,
    /// A field has a value out of range.
    #[error("invalid {field}: {msg}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// An option string names no known value.
    #[error("unknown {field} {value:?}: valid values are {valid}")]
    Unknown {
        /// The option.
        field: &'static str,
        /// What was given.
        value: String,
        /// The valid values, comma-separated.
        valid: &'static str,
    },
}

macro_rules! named_enum {
    ($ty:ty, $field:literal, $valid:literal, [$($name:literal => $val:expr),+ $(,)?]) => {
        impl FromStr for $ty {
            type Err = RecipeError;
            fn from_str(s: &str) -> Result<Self, RecipeError> {
                match s {
                    $($name => Ok($val),)+
                    _ => Err(RecipeError::Unknown { field: $field, value: s.to_string(), valid: $valid }),
                }
            }
        }
    };
}

named_enum!(Precision, "precision", "fp32, bf16, amp-fp16, amp-bf16, fp16",
    ["fp32" => Precision::Fp32, "bf16" => Precision::Bf16, "amp-fp16" => Precision::AmpFp16, "amp-bf16" => Precision::AmpBf16, "fp16" => Precision::Fp16]);
named_enum!(OptimizerKind, "optimizer", "adamw, adam, sgd, sgd-momentum, sgd-nesterov, adafactor, adafactor-hf, adamw-hf, adamw8bit, paged-adamw, paged-adamw8bit",
    ["adamw" => OptimizerKind::AdamW, "adam" => OptimizerKind::Adam, "sgd" => OptimizerKind::Sgd,
     "sgd-momentum" => OptimizerKind::SgdMomentum, "sgd-nesterov" => OptimizerKind::SgdNesterov,
     "adafactor" => OptimizerKind::Adafactor, "adafactor-hf" => OptimizerKind::AdafactorHf,
     "adamw-hf" => OptimizerKind::AdamWHf, "adamw8bit" => OptimizerKind::AdamW8bit,
     "paged-adamw" => OptimizerKind::PagedAdamW, "paged-adamw8bit" => OptimizerKind::PagedAdamW8bit]);
named_enum!(OptimizerImpl, "optimizer implementation", "foreach, fused, for-loop",
    ["foreach" => OptimizerImpl::Foreach, "fused" => OptimizerImpl::Fused, "for-loop" => OptimizerImpl::ForLoop]);
named_enum!(ZeroGrad, "zero_grad mode", "none, zero",
    ["none" => ZeroGrad::SetToNone, "zero" => ZeroGrad::Zero]);
named_enum!(Attention, "attention", "auto, eager, sdpa, sdpa-flash, sdpa-mem-efficient, sdpa-math, sdpa-cudnn",
    ["auto" => Attention::Auto, "eager" => Attention::Eager, "sdpa" => Attention::Auto,
     "sdpa-flash" => Attention::SdpaFlash, "sdpa-mem-efficient" => Attention::SdpaMemEfficient,
     "sdpa-math" => Attention::SdpaMath, "sdpa-cudnn" => Attention::SdpaCudnn]);

named_enum!(Loss, "loss", "hf, plain", ["hf" => Loss::Hf, "plain" => Loss::Plain]);

impl FromStr for Head {
    type Err = RecipeError;
    fn from_str(s: &str) -> Result<Self, RecipeError> {
        let unknown = || RecipeError::Unknown {
            field: "head",
            value: s.to_string(),
            valid: "lm, masked-lm, seq-cls:N, token-cls:N, none",
        };
        match s {
            "lm" => Ok(Head::Lm),
            "masked-lm" => Ok(Head::MaskedLm),
            "none" => Ok(Head::None),
            _ => {
                let (kind, n) = s.split_once(':').ok_or_else(unknown)?;
                let n: u64 = n.trim().parse().map_err(|_| unknown())?;
                if n == 0 {
                    return Err(RecipeError::Invalid {
                        field: "head",
                        msg: format!(
                            "{s}: {kind}:N needs N ≥ 1 labels (valid heads: lm, masked-lm, seq-cls:N, token-cls:N, none)"
                        ),
                    });
                }
                match kind {
                    "seq-cls" => Ok(Head::SeqCls(n)),
                    "token-cls" => Ok(Head::TokenCls(n)),
                    _ => Err(unknown()),
                }
            }
        }
    }
}

impl fmt::Display for Head {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Head::Lm => f.write_str("lm"),
            Head::MaskedLm => f.write_str("masked-lm"),
            Head::SeqCls(n) => write!(f, "seq-cls:{n}"),
            Head::TokenCls(n) => write!(f, "token-cls:{n}"),
            Head::None => f.write_str("none"),
        }
    }
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Loss::Hf => "hf",
            Loss::Plain => "plain",
        })
    }
}

/// Parses `--image-size`: `H` (a square) or `HxW`, each side 1 or more.
pub fn parse_image_size(s: &str) -> Result<(u64, u64), RecipeError> {
    let invalid = |msg: &str| RecipeError::Invalid {
        field: "image-size",
        msg: format!("{s:?}: {msg}"),
    };
    let side = |t: &str| -> Result<u64, RecipeError> {
        match t.trim().parse::<u64>() {
            Ok(0) => Err(invalid("sides must be 1 or more")),
            Ok(n) => Ok(n),
            Err(_) => Err(invalid("expected H or HxW in pixels (e.g. 384 or 384x256)")),
        }
    };
    match s.split_once(['x', 'X', '×']) {
        Some((h, w)) => Ok((side(h)?, side(w)?)),
        None => {
            let n = side(s)?;
            Ok((n, n))
        }
    }
}

impl FromStr for Checkpointing {
    type Err = RecipeError;
    fn from_str(s: &str) -> Result<Self, RecipeError> {
        let unknown = || RecipeError::Unknown {
            field: "checkpoint",
            value: s.to_string(),
            valid: "none, full, every:K, selective, sqrt, selective-op",
        };
        match s {
            "none" => Ok(Checkpointing::None),
            "full" => Ok(Checkpointing::Full),
            "selective" => Ok(Checkpointing::Selective),
            "sqrt" => Ok(Checkpointing::Sqrt),
            "selective-op" => Ok(Checkpointing::SelectiveOp),
            _ => {
                let k = s.strip_prefix("every:").ok_or_else(unknown)?;
                let k: u32 = k.parse().map_err(|_| unknown())?;
                if k == 0 {
                    return Err(RecipeError::Invalid {
                        field: "checkpoint",
                        msg: "every:K needs K ≥ 1".into(),
                    });
                }
                Ok(Checkpointing::Every(k))
            }
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::AmpFp16 => "amp-fp16",
            Precision::AmpBf16 => "amp-bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

impl fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::SgdMomentum => "sgd-momentum",
            OptimizerKind::SgdNesterov => "sgd-nesterov",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Adafactor => "adafactor",
            OptimizerKind::AdafactorHf => "adafactor-hf",
            OptimizerKind::AdamWHf => "adamw-hf",
            OptimizerKind::AdamW8bit => "adamw8bit",
            OptimizerKind::PagedAdamW => "paged-adamw",
            OptimizerKind::PagedAdamW8bit => "paged-adamw8bit",
        })
    }
}

named_enum!(CheckpointImpl, "checkpoint-impl", "non-reentrant, reentrant",
    ["non-reentrant" => CheckpointImpl::NonReentrant, "reentrant" => CheckpointImpl::Reentrant]);

named_enum!(TorchVersion, "torch-version", "2.15, 1.10",
    ["2.15" => TorchVersion::V2_15, "1.10" => TorchVersion::V1_10]);

named_enum!(TransformersVersion, "transformers-version", "5.23, 4.16",
    ["5.23" => TransformersVersion::V5_23, "4.16" => TransformersVersion::V4_16]);

impl fmt::Display for TransformersVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransformersVersion::V5_23 => "5.23",
            TransformersVersion::V4_16 => "4.16",
        })
    }
}

impl fmt::Display for TorchVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TorchVersion::V2_15 => "2.15",
            TorchVersion::V1_10 => "1.10",
        })
    }
}

impl fmt::Display for CheckpointImpl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CheckpointImpl::NonReentrant => "non-reentrant",
            CheckpointImpl::Reentrant => "reentrant",
        })
    }
}

impl fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpointing::None => f.write_str("none"),
            Checkpointing::Full => f.write_str("full"),
            Checkpointing::Every(k) => write!(f, "every:{k}"),
            Checkpointing::Selective => f.write_str("selective"),
            Checkpointing::Sqrt => f.write_str("sqrt"),
            Checkpointing::SelectiveOp => f.write_str("selective-op"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_lists_valid_values() {
        assert_eq!(
            "every:2".parse::<Checkpointing>().unwrap(),
            Checkpointing::Every(2)
        );
        let e = "adamx".parse::<OptimizerKind>().unwrap_err();
        assert_eq!(e.to_string(), "unknown optimizer \"adamx\": valid values are adamw, adam, sgd, sgd-momentum, sgd-nesterov, adafactor, adafactor-hf, adamw-hf, adamw8bit, paged-adamw, paged-adamw8bit");
        assert!("every:0".parse::<Checkpointing>().is_err());
        assert!("fp64"
            .parse::<Precision>()
            .unwrap_err()
            .to_string()
            .contains("fp32, bf16, amp-fp16, amp-bf16"));
    }

    #[test]
    fn heads_losses_and_image_sizes_parse_with_their_valid_values() {
        assert_eq!("seq-cls:2".parse::<Head>().unwrap(), Head::SeqCls(2));
        assert_eq!("token-cls:9".parse::<Head>().unwrap(), Head::TokenCls(9));
        assert_eq!("none".parse::<Head>().unwrap(), Head::None);
        assert_eq!(Head::SeqCls(3).to_string(), "seq-cls:3");
        let e = "seq-cls:0".parse::<Head>().unwrap_err().to_string();
        assert!(e.contains("N ≥ 1"), "{e}");
        let e = "classifier".parse::<Head>().unwrap_err().to_string();
        assert!(
            e.contains("lm, masked-lm, seq-cls:N, token-cls:N, none"),
            "{e}"
        );
        assert!("plain".parse::<Loss>().is_ok());
        assert!("mse"
            .parse::<Loss>()
            .unwrap_err()
            .to_string()
            .contains("hf, plain"));
        assert_eq!(parse_image_size("384").unwrap(), (384, 384));
        assert_eq!(parse_image_size("384x256").unwrap(), (384, 256));
        assert!(parse_image_size("0").is_err());
        assert!(parse_image_size("224x0").is_err());
        assert!(parse_image_size("big").is_err());
        let mut r = Recipe::new(1, 8);
        r.head = Some(Head::SeqCls(0));
        assert!(r.validate().is_err());
    }

    #[test]
    fn names_match_the_fixtures() {
        let mut r = Recipe::new(2, 128);
        r.checkpointing = Checkpointing::Full;
        r.accum = 2;
        assert_eq!(r.name(), "fp32-adamw-ckptfull-accum2");
    }
}
