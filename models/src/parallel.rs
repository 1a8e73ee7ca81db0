//! Data-parallel layouts of a training step (`--dp`, `--shard`, `--world-size`): which framework
//! mechanism shards what, and the checks a layout must pass before it is lowered per rank.
//!
//! What is modelled (the lowering's `lower/parallel.rs` does it, rule by rule):
//!
//! * `ddp`: `torch.nn.parallel.DistributedDataParallel` with its defaults (`bucket_cap_mb=25`, the
//!   1 MiB first bucket, `gradient_as_bucket_view=False`, `find_unused_parameters=False`,
//!   `static_graph=False`): the `Reducer`'s gradient buckets.
//! * `zero1`, `zero2`: DeepSpeed ZeRO stages 1 and 2 (`deepspeed/runtime/zero/stage_1_and_2.py`)
//!   with bf16 parameters and an fp32 master partition, at DeepSpeed's defaults.
//! * `zero3`: DeepSpeed ZeRO stage 3 (`deepspeed/runtime/zero/stage3.py`,
//!   `partition_parameters.py`, `partitioned_param_coordinator.py`), bf16, at DeepSpeed's defaults
//!   (`lower/zero3/`).
//! * `zero1-torch`: `torch.distributed.optim.ZeroRedundancyOptimizer` over DDP: whole parameters
//!   partitioned greedily, each rank keeping the optimizer state of its own
//!   ([`zero_redundancy_partition`]).
//! * `fsdp2`: `fully_shard` on every block and the root, the blocks' `reshard_after_forward`
//!   (`--reshard-after-forward`, True by default; the root's stays False), with an optional
//!   `MixedPrecisionPolicy(param_dtype, reduce_dtype)` (`lower/fsdp.rs`).
//! * `--offload optimizer` with `zero1`/`zero2`: DeepSpeed's ZeRO-Offload (`offload_optimizer`,
//!   `lower/offload.rs`); `--offload params` with `fsdp2`: `CPUOffloadPolicy` (`lower/fsdp.rs`).
//!
//! * `--tp`/`--sp`: Megatron-LM's tensor and sequence parallelism on the zoo's GPT-2, LLaMA and
//!   BERT families, built into the rank's graph (`zoo/tp.rs`) and lowered with Megatron's collectives
//!   (`lower/tp.rs`); the data-parallel modes above then act on the rank's sharded parameters.
//!
//! * `--pp` with `--dp`: FSDP2, DDP and `zero1-torch` inside the stages, as `torch.distributed.
//!   pipelining`'s `stage.py` drives them (`lower/pipeline.rs`); DeepSpeed's ZeRO and a
//!   GradScaler under the schedule are refused with the source's reason.
//!
//! The layout's other dimensions and options are parsed and checked here (`--pp`,
//! `--pp-schedule`, `--microbatches`); a combination whose mechanism is not modelled
//! yet is refused with the reason rather than approximated.

use std::fmt;
use std::str::FromStr;

use crate::dtype::DType;
use crate::recipe::{OptimizerKind, Precision, Recipe, RecipeError, ZeroGrad};

/// How the data-parallel ranks share the model states (`--shard`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Shard {
    /// One GPU, no data parallelism (the single-GPU step).
    #[default]
    None,
    /// `DistributedDataParallel`: every rank holds everything, plus the gradient buckets.
    Ddp,
    /// DeepSpeed ZeRO stage 1: fp32 master weights and optimizer state partitioned.
    Zero1,
    /// DeepSpeed ZeRO stage 2: gradients partitioned too.
    Zero2,
    /// DeepSpeed ZeRO stage 3: parameters partitioned too, gathered per submodule.
    Zero3,
    /// `torch.distributed.optim.ZeroRedundancyOptimizer` with DDP: optimizer state of whole
    /// parameters partitioned (`zero1-torch`).
    ZeroRedundancy,
    /// FSDP2 (`fully_shard` on every block and the root): parameters, gradients and optimizer
    /// state sharded; parameters all-gathered per block.
    Fsdp2,
    /// `torch.nn.DataParallel`: one process, device 0 holds the model, its gradients and the
    /// optimizer; the others get per-forward replicas (`crate::dataparallel`).
    DataParallel,
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Shard::None => "none",
            Shard::Ddp => "ddp",
            Shard::Zero1 => "zero1",
            Shard::Zero2 => "zero2",
            Shard::Zero3 => "zero3",
            Shard::ZeroRedundancy => "zero1-torch",
            Shard::Fsdp2 => "fsdp2",
            Shard::DataParallel => "dataparallel",
        })
    }
}

impl FromStr for Shard {
    type Err = RecipeError;
    fn from_str(s: &str) -> Result<Self, RecipeError> {
        match s {
            "none" => Ok(Shard::None),
            "ddp" => Ok(Shard::Ddp),
            "zero1" => Ok(Shard::Zero1),
            "zero2" => Ok(Shard::Zero2),
            "zero3" => Ok(Shard::Zero3),
            "zero1-torch" => Ok(Shard::ZeroRedundancy),
            "fsdp2" => Ok(Shard::Fsdp2),
            "dataparallel" => Ok(Shard::DataParallel),
            _ => Err(RecipeError::Unknown {
                field: "shard",
                value: s.to_string(),
                valid: "none, ddp, zero1, zero2, zero3, zero1-torch, fsdp2, dataparallel",
            }),
        }
    }
}

impl Shard {
    /// Whether this is a DeepSpeed ZeRO stage (1, 2 or 3).
    pub fn is_zero(self) -> bool {
        matches!(self, Shard::Zero1 | Shard::Zero2 | Shard::Zero3)
    }

    /// Whether DDP's `Reducer` reduces the gradients (`ddp`, and `zero1-torch`, whose
    /// `ZeroRedundancyOptimizer` wraps a DDP model).
    pub fn uses_ddp(self) -> bool {
        matches!(self, Shard::Ddp | Shard::ZeroRedundancy)
    }
}

/// The parallel layout of a step: data-parallel degree and sharding mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parallel {
    /// Data-parallel ranks (`--dp`).
    pub dp: u32,
    /// The sharding mode (`--shard`).
    pub shard: Shard,
    /// The world size the user launched (`--world-size`), checked against the layout's product.
    pub world_size: Option<u32>,
    /// FSDP2's `MixedPrecisionPolicy.param_dtype` (`--fsdp-param-dtype`): the dtype of the
    /// all-gathered (unsharded) parameters and of the compute; `None`: the model's.
    pub fsdp_param_dtype: Option<DType>,
    /// FSDP2's `MixedPrecisionPolicy.reduce_dtype` (`--fsdp-reduce-dtype`): the dtype of the
    /// reduce-scatter; `None`: the param dtype.
    pub fsdp_reduce_dtype: Option<DType>,
    /// DDP's `gradient_as_bucket_view=True` (`--ddp-bucket-view`): `.grad` becomes a view of its
    /// bucket instead of a second copy.
    pub gradient_as_bucket_view: bool,
    /// `DataParallel(output_device=...)` (`--output-device`): where the outputs are gathered.
    pub output_device: u32,
    /// DataParallel: the device whose trace the lowering writes (each device plays its own role;
    /// the graph is built for that device's chunk of the batch).
    pub device: u32,
    /// Tensor-parallel ranks (`--tp`): Megatron-style column/row-parallel linear layers.
    pub tp: u32,
    /// Sequence parallelism over the tensor-parallel group (`--sp`).
    pub sp: bool,
    /// Pipeline stages (`--pp`).
    pub pp: u32,
    /// The pipeline schedule (`--pp-schedule`).
    pub pp_schedule: PpSchedule,
    /// Micro-batches per step of a pipeline (`--microbatches`); `None`: the schedule's default.
    pub microbatches: Option<u32>,
    /// The pipeline stage whose trace the lowering writes (each stage plays its own role).
    pub stage: u32,
    /// What is kept in host memory instead of on the GPU (`--offload`).
    pub offload: Offload,
    /// FSDP2's `reshard_after_forward` of the blocks (`--reshard-after-forward`).
    pub reshard_after_forward: ReshardAfterForward,
    /// Context-parallel ranks (`--cp`): the sequence sharded over them, attention as PyTorch's
    /// ring attention (`crate::context_parallel`).
    pub cp: u32,
    /// The context-parallel rank whose trace the lowering writes (each plays its own role: the
    /// load-balanced ring's steps differ by rank).
    pub cp_rank: u32,
    /// The training loop around a pipeline's `schedule.step` (`--pp-loop`): what keeps the
    /// last stage's losses after the schedule returns.
    pub pp_loop: PpLoop,
}

/// FSDP2's `fully_shard(block, reshard_after_forward=...)` (`--reshard-after-forward`), passed to
/// every block; the root's stays `None`, which lazy init turns into False (`_fsdp_state.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ReshardAfterForward {
    /// `True`: a block's unsharded parameters are freed after its forward and all-gathered
    /// again in backward.
    #[default]
    True,
    /// `False`: a block keeps its unsharded parameters from its forward to its backward.
    False,
    /// An int N: after forward each rank keeps a clone of its 1/N slice of every unsharded
    /// parameter (the post-forward mesh of N ranks, `FSDPParam.to_sharded_post_forward`), and
    /// the backward all-gathers over those N ranks.
    To(u32),
}

impl fmt::Display for ReshardAfterForward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReshardAfterForward::True => f.write_str("true"),
            ReshardAfterForward::False => f.write_str("false"),
            ReshardAfterForward::To(n) => write!(f, "{n}"),
        }
    }
}

impl FromStr for ReshardAfterForward {
    type Err = RecipeError;
    fn from_str(s: &str) -> Result<Self, RecipeError> {
        match s {
            "true" => Ok(ReshardAfterForward::True),
            "false" => Ok(ReshardAfterForward::False),
            _ => s
                .parse::<u32>()
                .map(ReshardAfterForward::To)
                .map_err(|_| RecipeError::Unknown {
                    field: "reshard-after-forward",
                    value: s.to_string(),
                    valid: "true, false, N (the world size to reshard to after forward: a divisor of --dp below it)",
                }),
        }
    }
}

impl ReshardAfterForward {
    /// The post-forward world size of `_get_post_forward_mesh_info` (`_fsdp_init.py`): `None`
    /// when the unsharded parameters are kept (False, or the int 1, which PyTorch turns into
    /// False with a warning), `dp` when they are resharded (True), N for an int N.
    pub fn post_forward_world(self, dp: u32) -> Option<u32> {
        match self {
            ReshardAfterForward::True => Some(dp),
            ReshardAfterForward::False | ReshardAfterForward::To(1) => None,
            ReshardAfterForward::To(n) => Some(n),
        }
    }
}

/// A pipeline schedule (`--pp-schedule`), as `torch.distributed.pipelining.schedules` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PpSchedule {
    /// `ScheduleGPipe`: every micro-batch's forward, then every backward.
    GPipe,
    /// `Schedule1F1B`: warm-up forwards, then one forward and one backward alternately.
    #[default]
    OneFOneB,
    /// `ScheduleInterleaved1F1B` with this many model chunks (virtual stages) per rank.
    Interleaved(u32),
}

impl fmt::Display for PpSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PpSchedule::GPipe => f.write_str("gpipe"),
            PpSchedule::OneFOneB => f.write_str("1f1b"),
            PpSchedule::Interleaved(v) => write!(f, "interleaved:{v}"),
        }
    }
}

impl FromStr for PpSchedule {
    type Err = RecipeError;
    fn from_str(s: &str) -> Result<Self, RecipeError> {
        let unknown = || RecipeError::Unknown {
            field: "pp-schedule",
            value: s.to_string(),
            valid: "gpipe, 1f1b, interleaved:V (V model chunks per rank, 2 or more)",
        };
        match s {
            "gpipe" => Ok(PpSchedule::GPipe),
            "1f1b" => Ok(PpSchedule::OneFOneB),
            _ => match s.strip_prefix("interleaved:").map(str::parse::<u32>) {
                Some(Ok(v)) if v >= 2 => Ok(PpSchedule::Interleaved(v)),
                _ => Err(unknown()),
            },
        }
    }
}

/// The training loop that drives a pipeline's `schedule.step` (`--pp-loop`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PpLoop {
    /// torchtitan's `Trainer.train_step` (`trainer.py`): `pp_forward_backward_step` returns
    /// `torch.sum(torch.stack(losses))`, whose graph reaches every micro-batch's loss, and
    /// `train_step` keeps it in `loss` until it returns, after `optimizers.step()`.
    #[default]
    Torchtitan,
    /// A loop that drops the `losses` list when `schedule.step` returns (the recordings'
    /// `models/tools/capture_pipeline.py`).
    Plain,
}

impl fmt::Display for PpLoop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PpLoop::Torchtitan => "torchtitan",
            PpLoop::Plain => "plain",
        })
    }
}

impl FromStr for PpLoop {
    type Err = RecipeError;
    fn from_str(s: &str) -> Result<Self, RecipeError> {
        match s {
            "torchtitan" => Ok(PpLoop::Torchtitan),
            "plain" => Ok(PpLoop::Plain),
            _ => Err(RecipeError::Unknown {
                field: "pp-loop",
                value: s.to_string(),
                valid: "torchtitan, plain",
            }),
        }
    }
}

/// What CPU offload keeps in host memory (`--offload`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Offload {
    /// Nothing: every model state on the GPU.
    #[default]
    None,
    /// The optimizer state and the fp32 master weights (DeepSpeed's `offload_optimizer`).
    Optimizer,
    /// The parameters too (DeepSpeed ZeRO-3's `offload_param`, FSDP2's `CPUOffloadPolicy`).
    Params,
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::Params => "params",
        })
    }
}

impl FromStr for Offload {
    type Err = RecipeError;
    fn from_str(s: &str) -> Result<Self, RecipeError> {
        match s {
            "none" => Ok(Offload::None),
            "optimizer" => Ok(Offload::Optimizer),
            "params" => Ok(Offload::Params),
            _ => Err(RecipeError::Unknown {
                field: "offload",
                value: s.to_string(),
                valid: "none, optimizer, params",
            }),
        }
    }
}

/// Reads a floating dtype of `MixedPrecisionPolicy` (`fp32`, `bf16`, `fp16`).
pub fn parse_float_dtype(field: &'static str, s: &str) -> Result<DType, RecipeError> {
    match s {
        "fp32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "fp16" | "float16" => Ok(DType::F16),
        _ => Err(RecipeError::Unknown {
            field,
            value: s.to_string(),
            valid: "fp32, bf16, fp16",
        }),
    }
}

impl Default for Parallel {
    /// One GPU: `--dp 1 --shard none`.
    fn default() -> Self {
        Parallel {
            dp: 1,
            shard: Shard::None,
            world_size: None,
            fsdp_param_dtype: None,
            fsdp_reduce_dtype: None,
            gradient_as_bucket_view: false,
            output_device: 0,
            device: 0,
            tp: 1,
            sp: false,
            pp: 1,
            pp_schedule: PpSchedule::default(),
            microbatches: None,
            stage: 0,
            offload: Offload::None,
            reshard_after_forward: ReshardAfterForward::True,
            cp: 1,
            cp_rank: 0,
            pp_loop: PpLoop::default(),
        }
    }
}

/// `dist._DEFAULT_FIRST_BUCKET_BYTES` (`torch/csrc/distributed/c10d/reducer.hpp`
/// `kDefaultFirstBucketBytes`): 1 MiB.
pub const DDP_FIRST_BUCKET_BYTES: u64 = 1024 * 1024;

/// `DistributedDataParallel(bucket_cap_mb=None)` → 25 MiB (`torch/nn/parallel/distributed.py`
/// `__init__`: `bucket_cap_mb = 25` when None; `self.bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024)`).
pub const DDP_BUCKET_CAP_BYTES: u64 = 25 * 1024 * 1024;

/// DeepSpeed's `reduce_bucket_size` default, in elements (`deepspeed/runtime/zero/config.py`:
/// `reduce_bucket_size: int = Field(pp_int(5e8), ge=0)`).
pub const DS_REDUCE_BUCKET_ELEMENTS: u64 = 500_000_000;

/// ZeRO-3's `stage3_prefetch_bucket_size` default, in elements (`deepspeed/runtime/zero/config.py`:
/// `prefetch_bucket_size: int = Field(pp_int(5e7), ge=0, alias="stage3_prefetch_bucket_size")`).
pub const DS_PREFETCH_BUCKET_ELEMENTS: u64 = 50_000_000;

/// ZeRO-3's `stage3_param_persistence_threshold` default, in elements (`config.py`:
/// `Field(pp_int(1e5), ...)`): a parameter of at most this many elements stays whole on every rank
/// (`parameter_offload.py` `mark_persistent_parameters`: `param.ds_numel <= param_threshold`).
pub const DS_PARAM_PERSISTENCE_THRESHOLD: u64 = 100_000;

/// ZeRO-3's `stage3_max_live_parameters` default, in elements (`config.py`: `Field(pp_int(1e9))`).
pub const DS_MAX_LIVE_PARAMETERS: u64 = 1_000_000_000;

/// ZeRO-3's `stage3_max_reuse_distance` default, in elements (`config.py`: `Field(pp_int(1e9))`).
pub const DS_MAX_REUSE_DISTANCE: u64 = 1_000_000_000;

/// ZeRO-3's `sub_group_size` default, in elements (`config.py`: `sub_group_size: int =
/// Field(pp_int(1e9), ge=0)`).
pub const DS_SUB_GROUP_SIZE: u64 = 1_000_000_000;

/// Whether ZeRO-3 gets a model that is not a `zero.Init` one: transformers' `from_pretrained`
/// skips `deepspeed.zero.Init` for a quantized model (`needs_zero3_init = ... and not
/// _is_quantized`, PR #29587), so every parameter is made whole on each GPU and
/// `deepspeed.initialize` partitions them (`DeepSpeedZeRoOffload._convert_to_zero_parameters` →
/// `Init(module=...)`), after its engine has cast the floating ones to [`ds_param_dtype`]
/// (`engine.py` `_cast_module_mixed_precision`, skipped only for `is_zero_init_model`).
pub fn zero3_without_init(r: &Recipe) -> bool {
    r.parallel.shard == Shard::Zero3 && r.quant.is_some()
}

/// The dtype DeepSpeed's engine casts the floating parameters of a non-`zero.Init` model to
/// (`engine.py` `_mixed_precision_dtypes`: half in fp16 mode, bfloat16 in bf16 mode, none in
/// fp32 mode).
pub fn ds_param_dtype(precision: Precision) -> Option<DType> {
    match precision {
        Precision::Bf16 => Some(DType::BF16),
        Precision::Fp16 => Some(DType::F16),
        _ => None,
    }
}

impl Parallel {
    /// The number of ranks the layout needs: dp × tp × pp × cp (saturating; `validate` refuses a
    /// product above `u32::MAX`).
    pub fn world_size(&self) -> u32 {
        self.dp
            .saturating_mul(self.tp)
            .saturating_mul(self.pp)
            .saturating_mul(self.cp)
    }

    /// The ranks FSDP2 shards the model states over: dp × cp (torchtitan's `fsdp` mesh is
    /// `dp_shard * cp`, `distributed/parallel_dims.py`: the context-parallel ranks hold the same
    /// parameters, so FSDP shards over them too).
    pub fn fsdp_world(&self) -> u32 {
        self.dp.saturating_mul(self.cp)
    }

    /// The sequence length a rank's graph is built for: `seq / cp` (each context-parallel rank
    /// holds its shard of the sequence dimension of the inputs, labels and positions,
    /// `context_parallel(buffers=...)`), `seq` itself without context parallelism.
    pub fn local_seq(&self, seq: u64) -> u64 {
        if self.cp > 1 {
            seq / u64::from(self.cp)
        } else {
            seq
        }
    }

    /// Whether this is the single-GPU step (no parallel mechanism at all).
    pub fn is_single(&self) -> bool {
        self.shard == Shard::None
            && self.dp == 1
            && self.tp == 1
            && self.pp == 1
            && self.cp == 1
            && self.offload == Offload::None
    }

    /// Checks the layout against the rest of the recipe; the message says why and what is valid.
    pub fn validate(&self, r: &Recipe) -> Result<(), RecipeError> {
        let bad = |msg: String| RecipeError::Invalid {
            field: "shard",
            msg,
        };
        // `--precision fp16` is DeepSpeed's fp16 mode: its loss scaler and overflow check are
        // the ZeRO optimizer's (`stage_1_and_2.py`, `stage3.py`); pure float16 training without
        // it is not modelled.
        if r.precision == Precision::Fp16 && !self.shard.is_zero() {
            return Err(RecipeError::Invalid {
                field: "precision",
                msg: format!(
                    "fp16 is DeepSpeed's fp16 mode (float16 parameters, fp32 master partition, DeepSpeed's loss scaler): give --shard zero1, zero2 or zero3, not {} (or --precision amp-fp16 for torch.autocast with a GradScaler)",
                    self.shard
                ),
            });
        }
        for (field, n) in [
            ("dp", self.dp),
            ("tp", self.tp),
            ("pp", self.pp),
            ("cp", self.cp),
        ] {
            if n == 0 {
                return Err(RecipeError::Invalid {
                    field,
                    msg: "must be 1 or more".into(),
                });
            }
        }
        let ranks =
            u64::from(self.dp) * u64::from(self.tp) * u64::from(self.pp) * u64::from(self.cp);
        if ranks > u64::from(u32::MAX) {
            return Err(RecipeError::Invalid {
                field: "dp",
                msg: format!(
                    "dp {} × tp {} × pp {} × cp {} = {ranks} ranks, more than {}",
                    self.dp,
                    self.tp,
                    self.pp,
                    self.cp,
                    u32::MAX
                ),
            });
        }
        if let Some(w) = self.world_size {
            if w != self.world_size() {
                return Err(RecipeError::Invalid {
                    field: "world-size",
                    msg: format!(
                        "{w} does not match the layout: dp {} × tp {} × pp {} × cp {} = {} ranks",
                        self.dp,
                        self.tp,
                        self.pp,
                        self.cp,
                        self.world_size()
                    ),
                });
            }
        }
        self.validate_model_parallel()?;
        crate::context_parallel::validate(self, r)?;
        self.validate_pipeline(r)?;
        self.validate_offload()?;
        self.validate_reshard()?;
        if self.shard == Shard::None && self.dp > 1 {
            return Err(bad(format!(
                "--dp {} needs a data-parallel mode: --shard ddp, zero1, zero2, zero3, zero1-torch or fsdp2",
                self.dp
            )));
        }
        if self.shard != Shard::None && r.inference {
            return Err(bad(format!(
                "--shard {} shards a training step; --inference has no gradients or optimizer",
                self.shard
            )));
        }
        let mixed = self.fsdp_param_dtype.is_some() || self.fsdp_reduce_dtype.is_some();
        if mixed && self.shard != Shard::Fsdp2 {
            return Err(bad(format!(
                "--fsdp-param-dtype and --fsdp-reduce-dtype are FSDP2's MixedPrecisionPolicy: give --shard fsdp2, not {}",
                self.shard
            )));
        }
        if mixed && matches!(r.precision, Precision::AmpFp16 | Precision::AmpBf16) {
            return Err(bad(format!(
                "FSDP2's MixedPrecisionPolicy with autocast (--precision {}) is not modelled: give --precision fp32 (or bf16) and the policy's dtypes",
                r.precision
            )));
        }
        // Fine-tuning (frozen parameters, LoRA adapters) composes with --tp (a rank's shards are
        // frozen as the whole model's parameters are, `finetune::freeze`; LoRA's adapters are
        // Megatron-Bridge's ParallelLinearAdapter, `finetune::lora_tp`) and with the
        // data-parallel modes whose lowerings follow `requires_grad`: DDP buckets only the
        // parameters that require grad (`reducer.cpp`; Megatron-core's `DistributedDataParallel.
        // __init__` skips `not param.requires_grad` before building its grad buffers), DeepSpeed's
        // ZeRO-1/2 flattens and partitions only `trainable_parameters` (`stage_1_and_2.py`, as
        // Megatron's distributed optimizer shards the grad buffer's, i.e. trainable, parameters'
        // fp32 master and moments over the dp group), and FSDP2 shards every parameter but
        // reduce-scatters only those with a gradient (`foreach_reduce` over
        // `fsdp_params_with_grad`); `zero1-torch`'s ZeroRedundancyOptimizer partitions the
        // parameters it is given, the trainable ones (`_partition_parameters` over
        // `param_groups`). What is still not lowered is refused by `validate_finetune`.
        let finetune = !r.freeze.is_empty() || r.lora.is_some() || r.quant.is_some();
        if self.tp > 1 {
            if let Some(q) = r.quant {
                return Err(RecipeError::Invalid {
                    field: "tp",
                    msg: format!(
                        "--tp {} with --quant {q} is not something a framework runs: bitsandbytes quantizes whole nn.Linear layers (Linear4bit/Linear8bitLt from from_pretrained), Megatron-core's ColumnParallelLinear/RowParallelLinear shards are never quantized by it, and neither Megatron-Bridge's LoRA nor PEFT's LoraParallelLinear wraps a quantized parallel layer; give --tp 1 for QLoRA, or LoRA without --quant under --tp",
                        self.tp
                    ),
                });
            }
        }
        if finetune {
            self.validate_finetune(r)?;
        }
        if self.gradient_as_bucket_view && !self.shard.uses_ddp() {
            return Err(bad(format!(
                "--ddp-bucket-view is DistributedDataParallel's gradient_as_bucket_view: give --shard ddp (or zero1-torch, over DDP), not {}",
                self.shard
            )));
        }
        if self.shard == Shard::DataParallel {
            self.validate_dataparallel(r)?;
        } else if self.output_device != 0 {
            return Err(RecipeError::Invalid {
                field: "output-device",
                msg: format!(
                    "is DataParallel's output_device: give --shard dataparallel, not {}",
                    self.shard
                ),
            });
        }
        // CPUOffloadPolicy's sharded gradients are on the host: GradScaler's unscale_ of CPU
        // gradients against its CUDA scale is not modelled.
        if self.offload == Offload::Params && r.uses_grad_scaler() {
            return Err(RecipeError::Invalid {
                field: "offload",
                msg: "--offload params with a GradScaler (--grad-scaler, or --precision amp-fp16) is not modelled: give --precision bf16, fp32 or amp-bf16".into(),
            });
        }
        if self.shard == Shard::ZeroRedundancy && r.optimizer == OptimizerKind::Sgd {
            return Err(bad(
                "--shard zero1-torch (ZeroRedundancyOptimizer) partitions optimizer state, and sgd (no momentum) keeps none: use --shard ddp, or an optimizer with state (adamw, adam, sgd-momentum, sgd-nesterov)".into(),
            ));
        }
        if self.shard.is_zero() {
            // ZeRO partitions optimizer state (and the fp32 master weights of mixed precision).
            let stateful = match r.optimizer {
                OptimizerKind::Sgd => {
                    return Err(bad(format!(
                        "--shard {} partitions optimizer state, and sgd (no momentum) keeps none: use --shard ddp, or an optimizer with state (adamw, adam, sgd-momentum, sgd-nesterov)",
                        self.shard
                    )))
                }
                OptimizerKind::Adam
                | OptimizerKind::AdamW
                | OptimizerKind::SgdMomentum
                | OptimizerKind::SgdNesterov => true,
                _ => false,
            };
            if !stateful {
                return Err(bad(format!(
                    "--shard {} is modelled with adamw, adam, sgd-momentum and sgd-nesterov, not {}",
                    self.shard, r.optimizer
                )));
            }
            // DeepSpeed's `bf16` and `fp16` modes cast the module's parameters (`engine.py`
            // `_configure_distributed_model`, `_cast_module_mixed_precision`); without either
            // section the module stays fp32 (`--precision fp32`: the ZeRO optimizer's fp32
            // master partition is the fp32 parameters' own clone, `ds_upcasts`). Its
            // `torch_autocast` mode keeps the parameters fp32 under `torch.autocast`, but gives
            // the parameters of `torch.nn.Linear`/`Conv1d`/`Conv2d`/`Conv3d` modules the autocast
            // dtype as communication dtype (`torch_autocast.py` `init_autocast_params`,
            // `lower_precision_safe_modules`), and the ZeRO optimizers keep one IPG bucket per
            // communication dtype (`stage_1_and_2.py` `ipg_buckets`, each an fp32 buffer of
            // `reduce_bucket_size` in `setup_buckets`; `stage3.py`, in the bucket's dtype) plus,
            // for float16, their own `torch.amp.GradScaler`: which parameters belong to those
            // module classes is not recorded in the graph, so the mode is not modelled.
            if !matches!(
                r.precision,
                Precision::Bf16 | Precision::Fp16 | Precision::Fp32
            ) {
                return Err(bad(format!(
                    "--shard {} is modelled as DeepSpeed's bf16 mode (--precision bf16), fp16 mode (--precision fp16) or fp32 mode (--precision fp32, no bf16/fp16 section); --precision {} would be DeepSpeed's torch_autocast mode, which is not modelled: it reduces the gradients of torch.nn.Linear/Conv modules' parameters in the autocast dtype and the others in fp32, one IPG bucket per dtype (torch_autocast.py lower_precision_safe_modules), and vramsim's graphs do not record module classes",
                    self.shard, r.precision
                )));
            }
            // fp16 with an offload is modelled: the overflow check's GPU work is the bf16 mode's
            // (stages 1/2: `_has_inf_or_nan` of each gradient on the GPU into `local_overflow`,
            // `lower/offload.rs`), or two 1-byte tensors (stage 3: the tracker and the flat
            // gradient partitions are host tensors, `lower/zero3/step.rs`); the loss scaler holds
            // Python floats and unscales the host fp32 gradients.
            // ZeRO-Offload steps with DeepSpeedCPUAdam: the engine raises for another client
            // optimizer unless `zero_force_ds_cpu_optimizer` is false (`engine.py`,
            // `_configure_basic_optimizer`).
            if self.offload == Offload::Optimizer
                && !matches!(r.optimizer, OptimizerKind::Adam | OptimizerKind::AdamW)
            {
                return Err(RecipeError::Invalid {
                    field: "offload",
                    msg: format!(
                        "--offload optimizer steps with DeepSpeedCPUAdam: give --optimizer adamw or adam, not {}",
                        r.optimizer
                    ),
                });
            }
            if r.clip_grad_norm.is_some() || r.uses_grad_scaler() || r.zero_grad == ZeroGrad::Zero {
                return Err(bad(format!(
                    "--shard {}: DeepSpeed clips, scales and zeroes gradients itself; --clip-grad-norm, --grad-scaler and --zero-grad zero are not modelled with it",
                    self.shard
                )));
            }
        }
        Ok(())
    }
}

impl Parallel {
    /// The batch the graph of `device`'s replica is built for: its `torch.chunk` piece of
    /// `batch` (0 for a device the batch does not reach); `batch` itself for other layouts.
    pub fn replica_batch(&self, batch: u64) -> u64 {
        if self.pp > 1 {
            // A pipeline stage's graph runs one micro-batch.
            return match crate::pipeline::microbatches(self, batch) {
                Ok(m) => batch / u64::from(m),
                Err(_) => batch,
            };
        }
        if self.shard != Shard::DataParallel {
            return batch;
        }
        crate::dataparallel::chunk_sizes(batch, self.dp)
            .get(self.device as usize)
            .copied()
            .unwrap_or(0)
    }

    /// How many times `--batch` is taken per micro-step: once per data-parallel rank (the ranks
    /// of a tensor-parallel group, or of a pipeline, work on the same samples), but once in all
    /// for DataParallel (one process scatters its batch over the devices).
    pub fn batch_copies(&self) -> u32 {
        if self.shard == Shard::DataParallel {
            1
        } else {
            self.dp
        }
    }

    /// Fine-tuning (`--freeze`, `--lora`, `--quant`) with a parallel layout: the layouts whose
    /// lowerings hold frozen parameters as the frameworks do pass (`--tp`/`--sp`, `--dp` with
    /// `--shard ddp`, `zero1`, `zero2`, `zero3`, `zero1-torch` or `fsdp2`, and their `--offload`);
    /// the rest are refused with what to give.
    fn validate_finetune(&self, r: &Recipe) -> Result<(), RecipeError> {
        let bad = |field: &'static str, msg: String| RecipeError::Invalid { field, msg };
        let how = "fine-tuning (--freeze, --lora) is modelled on one GPU, with --tp/--sp, --pp, --cp, and with --dp and --shard ddp, zero1, zero2, zero3, zero1-torch or fsdp2 (with their --offload)";
        // A pipeline cuts the fine-tuned model as it cuts the whole one (`pipeline::rank_graph`:
        // each stage keeps its frozen parameters and adapters; a frozen prefix's hidden state is
        // received without requiring grad). QLoRA is not: bitsandbytes' quantized weights are
        // not split into stages here.
        if self.pp > 1 {
            if let Some(q) = r.quant {
                return Err(bad(
                    "pp",
                    format!(
                        "--pp {} with --quant {q} is not modelled yet (bitsandbytes' 4-/8-bit layers are not cut into pipeline stages here): {how}; QLoRA with --pp 1",
                        self.pp
                    ),
                ));
            }
        }
        // `--offload` follows `requires_grad` as the sharding does: ZeRO-Offload's host fp32
        // master, gradients and optimizer state are those of the trainable partitions
        // (`stage_1_and_2.py`/`stage3.py` build them over `trainable_param_groups`);
        // `offload_param` makes every non-persistent partition, frozen or not, on the host
        // (`_partition_param`); FSDP2's `CPUOffloadPolicy` keeps every shard on the host and
        // copies to it only the sharded gradients there are (`foreach_reduce` over
        // `fsdp_params_with_grad`).
        // --cp runs the ring attention whatever trains (the ring's forward is the SDPA kernel's
        // substitute; autograd keeps what it saves only where an input requires grad, as on one
        // GPU), and --cp needs --shard fsdp2: frozen parameters and adapters follow FSDP2's rules
        // over the dp × cp ranks (`Parallel::fsdp_world`). FSDP-QLoRA over a context-parallel
        // mesh is not lowered.
        if self.cp > 1 {
            if let Some(q) = r.quant {
                return Err(bad(
                    "cp",
                    format!(
                        "--cp {} with --quant {q} is not modelled yet (FSDP-QLoRA over the dp × cp mesh is not lowered): {how}; QLoRA with --cp 1",
                        self.cp
                    ),
                ));
            }
        }
        // QLoRA under DDP: `DistributedDataParallel._build_params_for_reducer` keeps only the
        // parameters with `requires_grad` (the adapters; bitsandbytes' Params4bit/Int8Params
        // weights are frozen), so the Reducer's buckets hold the adapters' gradients and each
        // rank keeps the whole quantized model, as one GPU does. `_sync_module_states`
        // broadcasts parameters and buffers through `_broadcast_coalesced`, whose flat
        // temporaries are not modelled under DDP with or without --quant (models/README.md).
        // QLoRA under FSDP2 (FSDP-QLoRA): bitsandbytes' `quant_storage` in a floating dtype
        // (transformers' `bnb_4bit_quant_storage`, docs `fsdp_qlora.md`; bitsandbytes PR #970)
        // makes the packed codes a float tensor that `fully_shard` chunks on dim 0 like any
        // weight (`FSDPParam._init_sharded_param`), while the quant state (absmax, code, nested
        // state) is an attribute of the `Linear4bit` module, neither parameter nor buffer, kept
        // whole on every rank and picked up again in forward (`fix_4bit_weight_quant_state_from_module`:
        // "the quant state got lost when the parameter got converted. This happens for example
        // for fsdp"). With the default uint8 storage, accelerate (PR #3987, v1.14) leaves the
        // frozen non-floating Params4bit out of `fully_shard` (`ignored_params`): whole on every
        // rank. Both lowered in `lower/fsdp.rs`.
        // QLoRA under ZeRO-3 (PEFT's "DeepSpeed ZeRO-3 + QLoRA"): no `zero.Init` for a quantized
        // model, the engine's cast of the floating parameters, then every parameter partitioned in
        // its own dtype ([`zero3_without_init`], `lower/zero3/setup.rs`); `_all_gather_coalesced`
        // gathers each dtype on its own (`dtype_params`), so uint8 codes run as well as bf16 ones.
        if let Some(q) = r.quant {
            let why = match self.shard {
                Shard::None | Shard::Ddp => None,
                Shard::Fsdp2 if q == crate::finetune::Quant::Int8 => Some(
                    "LLM.int8's Int8Params are int8 with no quant_storage (transformers passes `bnb_4bit_quant_storage` to Linear4bit only), and FSDP-QLoRA is the 4-bit path (docs `fsdp_qlora.md`); give --quant nf4, fp4, nf4-dq or fp4-dq with --quant-storage bf16".to_string(),
                ),
                Shard::Fsdp2 if self.fsdp_param_dtype.is_some() || self.fsdp_reduce_dtype.is_some() => Some(
                    "FSDP2's MixedPrecisionPolicy casts every floating-point parameter to param_dtype (`FSDPParam.init_dtype_attrs` spares only non-floating ones), which would rewrite the packed 4-bit codes stored as floats, and a reduce_dtype is not lowered with them; give --precision bf16 and --quant-storage bf16 without --fsdp-param-dtype/--fsdp-reduce-dtype".to_string(),
                ),
                Shard::Fsdp2 => None,
                Shard::Zero1 | Shard::Zero2 => Some(
                    "DeepSpeed's engine casts the whole module to the training dtype (`_configure_distributed_model`: `module.half()`/`module.bfloat16()`), whose effect on bitsandbytes' Params4bit/Int8Params is not lowered".to_string(),
                ),
                Shard::Zero3 if q == crate::finetune::Quant::Int8 => Some(
                    "LLM.int8's Int8Params keeps its int8 data aliased as the `CB` attribute (bitsandbytes `Int8Params._quantize`: `self.data = CB; self.CB = CB`), and `Linear8bitLt.forward` moves it into its matmul state and sets `self.weight.data = self.state.CB` again after each matmul, so ZeRO-3's partition of `param.data` would neither free the whole int8 weight nor be what the layer reads, which is not lowered; ZeRO-3 QLoRA is the 4-bit path (PEFT docs \"DeepSpeed ZeRO-3 + QLoRA\"): give --quant nf4, fp4, nf4-dq or fp4-dq".to_string(),
                ),
                Shard::Zero3 => match ds_param_dtype(r.precision) {
                    // `_cast_module_mixed_precision` casts every floating parameter of a model
                    // that is not a `zero.Init` one to the bf16/fp16 mode's dtype: packed codes
                    // stored in another float dtype would be converted value by value.
                    Some(d) if r.quant_storage.is_float() && r.quant_storage != d => Some(format!(
                        "a quantized model is not a `zero.Init` model (transformers `from_pretrained`: `not _is_quantized`), so `deepspeed.initialize` casts every floating-point parameter to the training dtype (`engine.py` `_cast_module_mixed_precision`, `p.data.to(param_dtype)`), which would convert the 4-bit codes packed in --quant-storage {} value by value; give --quant-storage {} (the compute dtype, as PEFT's docs do) or uint8",
                        crate::finetune::quant::quant_storage_name(r.quant_storage),
                        crate::finetune::quant::quant_storage_name(d),
                    )),
                    _ => None,
                },
                Shard::ZeroRedundancy => Some(
                    "only DDP's and FSDP2's paths are lowered and tested with bitsandbytes' quantized weights, not ZeroRedundancyOptimizer's partition over them".to_string(),
                ),
                Shard::DataParallel => Some(
                    "nn.DataParallel replicates every parameter with `broadcast_coalesced` each forward, and bitsandbytes' Params4bit/Int8Params replicas (their quant state) are not lowered".to_string(),
                ),
            };
            if let Some(why) = why {
                return Err(bad(
                    "shard",
                    format!(
                        "--quant {q} with --shard {} is not modelled yet: {why}; QLoRA is modelled on one GPU, with --dp N --shard ddp, with --dp N --shard fsdp2 (FSDP-QLoRA: --quant-storage bf16 shards the 4-bit weights) and with --dp N --shard zero3 (ZeRO-3 partitions the 4-bit weights in their storage dtype)",
                        self.shard
                    ),
                ));
            }
        }
        // ZeRO-3 partitions and gathers every parameter, frozen or not, each in its own dtype:
        // the engine casts no parameter of a `zero.Init` model (`engine.py`
        // `_cast_module_mixed_precision` skips `is_zero_init_model`), so PEFT's float32 adapters
        // stay float32 partitions (`lower/zero3/`).
        match self.shard {
            Shard::None
            | Shard::Ddp
            | Shard::Zero1
            | Shard::Zero2
            | Shard::Zero3
            | Shard::ZeroRedundancy
            | Shard::Fsdp2 => Ok(()),
            // nn.DataParallel replicates the parameters every forward: not lowered with frozen
            // parameters.
            _ => Err(bad(
                "shard",
                format!(
                    "--shard {} with fine-tuning (--freeze, --lora, --quant) is not modelled yet: {how}",
                    self.shard
                ),
            )),
        }
    }

    /// `--tp`, `--sp`, `--pp`, `--pp-schedule`, `--microbatches`: the options each needs, and
    /// what is not modelled yet.
    fn validate_model_parallel(&self) -> Result<(), RecipeError> {
        if self.shard == Shard::DataParallel && (self.tp > 1 || self.pp > 1) {
            return Err(RecipeError::Invalid {
                field: "shard",
                msg: format!(
                    "--shard dataparallel is nn.DataParallel: one process replicates the whole model on every device each forward, so it cannot be split by tensor (--tp {}) or pipeline (--pp {}) parallelism, which run one process per rank; use --shard ddp or fsdp2 with --tp/--pp",
                    self.tp, self.pp
                ),
            });
        }
        if self.sp && self.tp < 2 {
            return Err(RecipeError::Invalid {
                field: "sp",
                msg: "sequence parallelism shards the sequence over the tensor-parallel group: give --tp 2 or more".into(),
            });
        }
        if self.pp < 2 && (self.pp_schedule != PpSchedule::default() || self.microbatches.is_some())
        {
            return Err(RecipeError::Invalid {
                field: "pp-schedule",
                msg: "--pp-schedule and --microbatches schedule a pipeline: give --pp 2 or more"
                    .into(),
            });
        }
        if self.pp < 2 && self.pp_loop != PpLoop::default() {
            return Err(RecipeError::Invalid {
                field: "pp-loop",
                msg: "--pp-loop is the loop around a pipeline's schedule: give --pp 2 or more"
                    .into(),
            });
        }
        // --tp is lowered per rank for the zoo's GPT-2, LLaMA and BERT families; the model builder
        // (`zoo::Arch::tp_plan`) refuses other models and checks what --tp must divide.
        Ok(())
    }

    /// `--pp`: what the pipeline is modelled with (`crate::pipeline`), and the micro-batches the
    /// schedule accepts; the layers a split needs are checked against the model when its rank's
    /// graph is built (`pipeline::rank_graph`).
    fn validate_pipeline(&self, r: &Recipe) -> Result<(), RecipeError> {
        if self.pp < 2 {
            return Ok(());
        }
        let bad = |msg: String| RecipeError::Invalid { field: "pp", msg };
        // A stage is cut from the tensor-parallel rank's graph (`pipeline::rank_graph` on the
        // `--tp`/`--sp` build), so --tp composes with --pp. FSDP2 over the stages is lowered as
        // torchtitan runs it (`lower/fsdp.rs`: parameters kept unsharded from the first forward,
        // unsharded gradients accumulated over the micro-batches, one reduce-scatter per group
        // after the last backward: `stage.py` `backward_maybe_with_nosync`,
        // `perform_reduce_grad`). A DDP stage (`ddp`, and `zero1-torch`'s DDP model) runs its
        // forwards and non-last backwards under `no_sync()` and all-reduces its buckets in the
        // last backward (`forward_maybe_with_nosync`, `backward_maybe_with_nosync`: lowered in
        // `lower/parallel.rs`).
        match self.shard {
            Shard::None | Shard::Fsdp2 => {}
            // Each of a rank's stages (interleaved) is its own DDP module with its own Reducer and
            // buckets (torchtitan wraps every model part); `zero1-torch` is one
            // ZeroRedundancyOptimizer over the rank's parameters.
            Shard::Ddp | Shard::ZeroRedundancy => {}
            // DeepSpeed's pipeline engine refuses stages 2 and 3 (`deepspeed/runtime/pipe/
            // engine.py`, `PipelineEngine.__init__`: `assert self.zero_optimization_stage() <
            // ZeroStageEnum.gradients, "ZeRO-2 and ZeRO-3 are incompatible with pipeline
            // parallelism"`).
            Shard::Zero2 | Shard::Zero3 => {
                return Err(bad(format!(
                    "--pp {} with --shard {}: DeepSpeed refuses it (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\", deepspeed/runtime/pipe/engine.py PipelineEngine.__init__); give --shard zero1-torch, ddp or fsdp2, or --pp 1",
                    self.pp, self.shard
                )));
            }
            // ZeRO-1 under a pipeline is DeepSpeed's own runtime, not `torch.distributed.
            // pipelining`: `PipelineEngine` (a `PipelineModule`) runs `TrainSchedule`, whose
            // in-flight micro-batches are 1F1B's (`num_pipe_buffers`: `min(stages - stage_id,
            // micro_batches)`, at least 2), but on `PipelineModule`'s partition
            // (`partition_method="parameters"`), with its own pipe buffers (`_exec_recv_*`), its
            // backward outside `DeepSpeedZeroOptimizer.backward` on all but the last stage
            // (`_exec_backward_pass`: `torch.autograd.backward(tensors, grad_tensors)`), and its
            // reduce at the boundary (`_exec_reduce_grads`); in bf16 with an fp32
            // `grad_accum_dtype` it is `BF16_Optimizer`, not the ZeRO optimizer (`engine.py`
            // `_do_optimizer_sanity_check`).
            Shard::Zero1 => {
                return Err(bad(format!(
                    "--pp {} with --shard zero1 is DeepSpeed's PipelineEngine, which is not modelled: its TrainSchedule keeps 1F1B's micro-batches in flight, but on PipelineModule's partition (partition_method \"parameters\"), with DeepSpeed's pipe buffers, its backward outside the ZeRO optimizer's on all but the last stage and its reduce at the batch's end (deepspeed/runtime/pipe/engine.py), none of which --pp lowers (torch.distributed.pipelining under torchtitan's split); give --shard zero1-torch (ZeroRedundancyOptimizer over DDP stages), ddp or fsdp2",
                    self.pp
                )));
            }
            // Refused with --pp by `validate_model_parallel`.
            Shard::DataParallel => {}
        }
        if self.shard == Shard::Fsdp2 {
            // A MixedPrecisionPolicy (the unsharded gradients accumulate in the reduce dtype
            // over the micro-batches: `_set_unsharded_grad_dtypes`), the interleaved schedule
            // (each of a rank's stages its own root, all-gathered, resharded and reduced by the
            // runtime's UNSHARD/RESHARD/REDUCE_GRAD actions) and CPUOffloadPolicy are lowered
            // (`lower/fsdp.rs`).
            // torchtitan (`parallelize.py` `apply_fsdp`, `reshard_after_forward_policy`
            // "default": `reshard_after_forward = not pp_enabled`) keeps the blocks unsharded
            // after forward under a pipeline; the default `true` is read as that policy. Its
            // policy is "always", "never" or "default", a bool each: no torchtitan run passes an
            // int. FSDP2 itself would take one: every micro-batch's forward ends in
            // `FSDPParamGroup.post_forward` → `reshard()` → `_to_sharded_post_forward()` (the
            // blocks kept as N-way post-forward shards), each backward all-gathers them again
            // from those, and `stage.py` `backward_maybe_with_nosync` sets
            // `set_reshard_after_backward(False)`, so they stay unsharded until the next forward
            // reshards them: an all-gather and a post-forward shard per micro-batch that the
            // pipeline's FSDP2 lowering (unsharded over the step) does not make.
            if let ReshardAfterForward::To(n) = self.reshard_after_forward {
                if n > 1 {
                    return Err(bad(format!(
                        "--pp {} --shard fsdp2 with --reshard-after-forward {n} is not modelled: torchtitan's fsdp_reshard_after_forward policy under a pipeline is \"default\" (blocks unsharded after forward) or \"always\"/\"never\", never an int; FSDP2 given one would reshard each stage's blocks to {n}-way post-forward shards after every micro-batch's forward (FSDPParamGroup.post_forward -> _to_sharded_post_forward) and all-gather them again for its backward, which the pipeline lowering does not make; give --reshard-after-forward false",
                        self.pp
                    )));
                }
            }
        }
        if r.inference {
            return Err(bad("--pp models a training step's schedule (forwards and backwards of micro-batches); --inference is not modelled with it".into()));
        }
        if r.keep_outputs {
            return Err(bad("--keep-outputs is the single-GPU training loop's names; the pipeline schedule holds the outputs itself (give it without --keep-outputs)".into()));
        }
        // A GradScaler cannot run under the schedule as it is: the schedule calls `loss_fn` on
        // the last stage only (`schedules.py` `_maybe_compute_loss`: `if stage.is_last and
        // self._loss_fn is not None`), so a `loss_fn` returning `scaler.scale(loss)` makes the
        // scale on that rank alone, and every other rank's `unscale_`/`step`/`update` raise
        // (`torch/amp/grad_scaler.py` `_check_scale_growth_tracker`; `ShardedGradScaler` too);
        // nor do the stages' scalers share `found_inf` (GradScaler has no process group).
        if r.uses_grad_scaler() {
            return Err(bad(format!(
                "a GradScaler (--precision {} or --grad-scaler) does not run under torch.distributed.pipelining's schedule: it calls loss_fn on the last stage only (schedules.py _maybe_compute_loss: `if stage.is_last and self._loss_fn is not None`), so scaler.scale(loss) in the loss_fn makes the scale on that rank alone, and every other rank's scaler.unscale_/step/update raise \"Attempted unscale_ but _scale is None.  This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration.\" (torch/amp/grad_scaler.py _check_scale_growth_tracker), nor do the stages' scalers share found_inf; give --precision bf16, amp-bf16 or fp32",
                r.precision
            )));
        }
        if self.stage >= self.pp {
            return Err(RecipeError::Invalid {
                field: "stage",
                msg: format!(
                    "{} is not one of the pipeline ranks 0..{}",
                    self.stage,
                    self.pp - 1
                ),
            });
        }
        crate::pipeline::microbatches(self, r.batch).map_err(|e| RecipeError::Invalid {
            field: "microbatches",
            msg: e.to_string(),
        })?;
        Ok(())
    }

    /// `--offload`: which sharding modes offload what.
    fn validate_offload(&self) -> Result<(), RecipeError> {
        let bad = |msg: String| RecipeError::Invalid {
            field: "offload",
            msg,
        };
        match self.offload {
            Offload::None => Ok(()),
            // ZeRO-3's `offload_optimizer` and `offload_param` (`lower/zero3/`).
            Offload::Optimizer | Offload::Params if self.shard == Shard::Zero3 => Ok(()),
            // DeepSpeed's `offload_param` is a ZeRO-3 option (`DeepSpeedZeroOffloadParamConfig`
            // is read only by stage 3); FSDP2's `CPUOffloadPolicy` offloads the sharded parameters.
            Offload::Params if self.shard != Shard::Fsdp2 => Err(bad(format!(
                "--offload params keeps sharded parameters in host memory, which ZeRO-3 and FSDP2 do; give --shard zero3 or fsdp2, not {}",
                self.shard
            ))),
            // FSDP2 has no optimizer-only offload: `CPUOffloadPolicy` moves the sharded
            // parameters and gradients to the host, and the optimizer steps them there.
            Offload::Optimizer if self.shard == Shard::Fsdp2 => Err(bad(
                "FSDP2's CPUOffloadPolicy offloads the sharded parameters, their gradients and the optimizer step together: give --offload params".into(),
            )),
            Offload::Optimizer if !self.shard.is_zero() => Err(bad(format!(
                "--offload optimizer is DeepSpeed ZeRO's offload_optimizer (fp32 master weights and optimizer state in host memory): give --shard zero1, zero2 or zero3, not {}",
                self.shard
            ))),
            _ => Ok(()),
        }
    }

    /// `--reshard-after-forward`: FSDP2's, and an int must be a post-forward world size
    /// (`_fsdp_init.py` `_get_post_forward_mesh_info`: a factor of the shard mesh size; N = dp
    /// is True, so it is asked for as `true`).
    fn validate_reshard(&self) -> Result<(), RecipeError> {
        let bad = |msg: String| RecipeError::Invalid {
            field: "reshard-after-forward",
            msg,
        };
        if self.reshard_after_forward == ReshardAfterForward::default() {
            return Ok(());
        }
        if self.shard != Shard::Fsdp2 {
            return Err(bad(format!(
                "is FSDP2's fully_shard(reshard_after_forward=...): give --shard fsdp2, not {}",
                self.shard
            )));
        }
        if let ReshardAfterForward::To(n) = self.reshard_after_forward {
            if n == 0 || !self.dp.is_multiple_of(n) || n >= self.dp {
                return Err(bad(format!(
                    "{n} is not a world size to reshard to: N must divide --dp {} and be below it (--reshard-after-forward true reshards over all {} ranks)",
                    self.dp, self.dp
                )));
            }
        }
        Ok(())
    }

    fn validate_dataparallel(&self, r: &Recipe) -> Result<(), RecipeError> {
        let bad = |msg: String| RecipeError::Invalid {
            field: "shard",
            msg,
        };
        if self.fsdp_param_dtype.is_some() || self.fsdp_reduce_dtype.is_some() {
            return Err(bad("--shard dataparallel replicates the whole model on every device each forward; --fsdp-param-dtype and --fsdp-reduce-dtype are FSDP2's (give --shard fsdp2)".into()));
        }
        if self.gradient_as_bucket_view {
            return Err(bad("--shard dataparallel has no DDP buckets; --ddp-bucket-view is DistributedDataParallel's (give --shard ddp)".into()));
        }
        if self.output_device >= self.dp {
            return Err(RecipeError::Invalid {
                field: "output-device",
                msg: format!(
                    "{} is not one of the devices 0..{}",
                    self.output_device,
                    self.dp - 1
                ),
            });
        }
        if self.device >= self.dp {
            return Err(RecipeError::Invalid {
                field: "device",
                msg: format!(
                    "{} is not one of the devices 0..{}",
                    self.device,
                    self.dp - 1
                ),
            });
        }
        if self.dp > 1 && r.accum > 1 {
            return Err(bad("--shard dataparallel with --accum above 1 is not modelled yet (the reduced gradients would be added into .grad)".into()));
        }
        if self.dp > 1 && r.zero_grad == ZeroGrad::Zero {
            return Err(bad("--shard dataparallel with --zero-grad zero is not modelled yet: give --zero-grad none (set_to_none, the default)".into()));
        }
        if self.dp > 1 && r.keep_outputs {
            return Err(bad(
                "--shard dataparallel with --keep-outputs is not modelled yet".into(),
            ));
        }
        Ok(())
    }
}

/// `compute_bucket_assignment_by_size` (`torch/csrc/distributed/c10d/reducer.cpp`): tensors, in
/// the order given, join the open bucket of their dtype key; a bucket closes once its size reaches
/// its limit (overshooting by at most one tensor), and each dtype walks `limits`, repeating the last.
/// Open buckets are closed at the end. When `sort_by_first_index` (the constructor's call, no
/// `tensor_indices`), buckets are sorted by the smallest tensor index they hold; the rebuild passes
/// the tensors in gradient-ready order and keeps that order.
///
/// `tensors`: (bytes, dtype key) per tensor. Returns the tensor indices of each bucket.
pub fn bucket_assignment(
    tensors: &[(u64, u8)],
    limits: &[u64],
    sort_by_first_index: bool,
) -> Vec<Vec<usize>> {
    // One open bucket per dtype key: (indices, bytes, position in `limits`).
    let mut open: Vec<(u8, Vec<usize>, u64, usize)> = Vec::new();
    let mut result: Vec<Vec<usize>> = Vec::new();
    for (i, &(bytes, key)) in tensors.iter().enumerate() {
        let slot = match open.iter().position(|o| o.0 == key) {
            Some(s) => s,
            None => {
                open.push((key, Vec::new(), 0, 0));
                open.len() - 1
            }
        };
        let o = &mut open[slot];
        o.1.push(i);
        o.2 += bytes;
        let limit = limits[o.3.min(limits.len() - 1)];
        if o.2 >= limit {
            result.push(std::mem::take(&mut o.1));
            o.2 = 0;
            if o.3 + 1 < limits.len() {
                o.3 += 1;
            }
        }
    }
    for o in open {
        if !o.1.is_empty() {
            result.push(o.1);
        }
    }
    if sort_by_first_index {
        result.sort_by_key(|b| b.iter().copied().min().unwrap_or(usize::MAX));
    }
    result
}

/// `ZeroRedundancyOptimizer._partition_parameters` (`torch/distributed/optim/
/// zero_redundancy_optimizer.py`): the parameters sorted by `numel()`, largest first (Python's
/// stable sort keeps registration order among equals), each given to the rank with the smallest
/// running total (`_get_min_index`: the first such rank). Returns the rank of each parameter.
pub fn zero_redundancy_partition(numels: &[u64], world: u32) -> Vec<u32> {
    let mut order: Vec<usize> = (0..numels.len()).collect();
    order.sort_by(|&a, &b| numels[b].cmp(&numels[a]));
    let mut sizes = vec![0u64; world.max(1) as usize];
    let mut rank = vec![0u32; numels.len()];
    for i in order {
        let r = (0..sizes.len()).min_by_key(|&r| (sizes[r], r)).unwrap_or(0);
        rank[i] = r as u32;
        sizes[r] += numels[i];
    }
    rank
}

/// The rank whose trace a `zero1-torch` layout lowers: the one owning the most parameter elements
/// (so the most optimizer state; the lowest such rank on a tie).
pub fn zero_redundancy_worst_rank(numels: &[u64], world: u32) -> u32 {
    let ranks = zero_redundancy_partition(numels, world);
    let mut sizes = vec![0u64; world.max(1) as usize];
    for (i, &r) in ranks.iter().enumerate() {
        sizes[r as usize] += numels[i];
    }
    (0..sizes.len())
        .max_by_key(|&r| (sizes[r], std::cmp::Reverse(r)))
        .unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ComputeBucketAssignmentTest` of `test/distributed/test_c10d_common.py`.
    #[test]
    fn bucket_assignment_as_pytorch_tests_it() {
        // test_single_limit_single_dtype: float32 tensors of 100, 200, 100, 50 elements, limit 400 B.
        let t = [(400, 0), (800, 0), (400, 0), (200, 0)];
        assert_eq!(
            bucket_assignment(&t, &[400], true),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        // test_single_limit_multi_dtype: float 50 / double 25 elements alternating, limit 400 B.
        let t = [(200, 0), (200, 1), (200, 0), (200, 1), (200, 0), (200, 1)];
        assert_eq!(
            bucket_assignment(&t, &[400], true),
            vec![vec![0, 2], vec![1, 3], vec![4], vec![5]]
        );
        // test_multi_limit_single_dtype: 4 float tensors of 10 elements, limits [40, 80] B.
        let t = [(40, 0), (40, 0), (40, 0), (40, 0)];
        assert_eq!(
            bucket_assignment(&t, &[40, 80], true),
            vec![vec![0], vec![1, 2], vec![3]]
        );
        // test_multi_limit_multi_dtype: float 50 / double 25 elements alternating, limits [200, 400].
        let t = [(200, 0), (200, 1), (200, 0), (200, 1), (200, 0), (200, 1)];
        assert_eq!(
            bucket_assignment(&t, &[200, 400], true),
            vec![vec![0], vec![1], vec![2, 4], vec![3, 5]]
        );
    }
}
