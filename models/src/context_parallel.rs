//! Context parallelism (`--cp N`): the layout's checks, as PyTorch 2.15's
//! `torch.distributed.tensor.experimental.context_parallel` runs it under torchtitan's layout.
//!
//! What is modelled, with the rule each follows:
//!
//! * **The sequence is sharded** over the `cp` ranks: `context_parallel(mesh, buffers=[inputs,
//!   labels, positions], buffer_seq_dims=...)` shards each buffer's sequence dimension
//!   (`_context_parallel_buffers`: `distribute_tensor(..., [Shard(seq_dim)])`), after the
//!   head-tail load balancer's reordering (`_HeadTailLoadBalancer`, made by
//!   `_create_default_load_balancer` when `seq % (2·cp) == 0`, which this module requires: the
//!   unbalanced ring skips steps by rank and is not modelled). Every op outside attention runs
//!   on the rank's `seq/cp` tokens, so a rank's graph is built at `seq/cp`
//!   ([`crate::parallel::Parallel::local_seq`]).
//! * **Attention is PyTorch's ring attention** (`_templated_ring_attention` and its backward,
//!   `lower/cp.rs`), which the dispatcher substitutes for the fused SDPA kernels
//!   (`_sdpa_handler`'s `call_maps`: flash, memory-efficient and cuDNN attention; any other call
//!   raises "CP only supports flash attention and memory efficient attention now"). Flash and
//!   cuDNN are modelled; the memory-efficient path is refused (its logsumexp is padded to 32 rows,
//!   `kAlignLSE`, and its backward gives the K/V gradients one shared chunk when k and v alias —
//!   which the gathered K/V always do — neither modelled here), and so are the math and eager
//!   paths (no ring: the dispatcher does not take them). The ring needs `is_causal=True` with load
//!   balancing ("Load balancing requires `is_causal=True`") and no mask (`attn_bias` raises), so
//!   the causal language models without a mask are the ones modelled (GPT-2, LLaMA family,
//!   nanoGPT).
//! * **FSDP shards over dp × cp**: torchtitan's `fsdp` mesh is `dp_shard * cp`
//!   (`distributed/parallel_dims.py`), so parameters, gradients and optimizer states are FSDP2's
//!   over dp·cp ranks ([`crate::parallel::Parallel::fsdp_world`]); `--cp` therefore needs
//!   `--shard fsdp2`.
//! * **With a pipeline** (`--pp`; torchtitan's `train.py` `forward_backward_step` runs
//!   `self.pp_schedule.step(...)` inside `train_context(optional_context_parallel_ctx)`, the CP
//!   buffers being the inputs, labels and every stage's `freqs_cis`):
//!   each stage's attention runs the ring over the same cp ranks, the stages send and receive the
//!   rank's `seq/cp` tokens, and every (stage, cp rank) pair is its own role.
//!
//! torchtitan's own models (since its ShardingConfig refactor) refuse context parallelism with
//! SDPA and use FlexAttention's all-gather instead (`models/common/decoder.py`); the SDPA ring
//! modelled here is what `context_parallel` does for a model that calls
//! `F.scaled_dot_product_attention`, which the HF models of the zoo do.

use crate::parallel::{Parallel, ReshardAfterForward, Shard};
use crate::recipe::{Head, Recipe, RecipeError};
use crate::sdpa::SdpaBackend;
use crate::zoo::{Arch, AttnImpl, ZooError};

/// Checks `--cp` against the rest of the layout and the recipe (the model's side is
/// [`check_model`]'s); the message says why and what is valid.
pub fn validate(p: &Parallel, r: &Recipe) -> Result<(), RecipeError> {
    let bad = |msg: String| RecipeError::Invalid { field: "cp", msg };
    if p.cp < 2 {
        if p.cp_rank != 0 {
            return Err(bad(format!(
                "context-parallel rank {} without --cp 2 or more",
                p.cp_rank
            )));
        }
        return Ok(());
    }
    if p.cp_rank >= p.cp {
        return Err(bad(format!(
            "rank {} is not one of the context-parallel ranks 0..{}",
            p.cp_rank,
            p.cp - 1
        )));
    }
    if p.shard != Shard::Fsdp2 {
        return Err(bad(format!(
            "--cp {} shards the model states with FSDP2 over dp × cp ranks (torchtitan's fsdp mesh is dp_shard * cp, parallel_dims.py): give --shard fsdp2, not {}",
            p.cp, p.shard
        )));
    }
    if let ReshardAfterForward::To(n) = p.reshard_after_forward {
        if n > 1 {
            return Err(bad(format!(
                "--cp {} with --reshard-after-forward {n} is not modelled; give true or false",
                p.cp
            )));
        }
    }
    if r.inference {
        return Err(bad(format!(
            "--cp {} is modelled for a training step (the ring attention's forward and backward); --inference is not",
            p.cp
        )));
    }
    let unit = 2 * u64::from(p.cp);
    if !r.seq.is_multiple_of(unit) {
        return Err(bad(format!(
            "--seq {} is not a multiple of 2 × cp = {unit}: context_parallel's head-tail load balancer needs it (_create_default_load_balancer), and the ring without load balancing is not modelled; give a --seq divisible by {unit}",
            r.seq
        )));
    }
    Ok(())
}

/// The model's side of `--cp`: a causal language model without a mask whose attention runs a
/// fused kernel the context-parallel dispatcher takes (flash or cuDNN); `attn` is the attention
/// the recipe gives it.
pub fn check_model(arch: &Arch, r: &Recipe, head: Head, attn: AttnImpl) -> Result<(), ZooError> {
    let cp = r.parallel.cp;
    let unsupported = |msg: String| ZooError::Unsupported {
        model: arch.name().to_string(),
        field: "cp",
        msg,
    };
    let causal_lm = match arch {
        Arch::Gpt2(_) | Arch::Llama(_) => head == Head::Lm,
        Arch::NanoGpt(_) => true,
        _ => false,
    };
    if !causal_lm {
        return Err(unsupported(format!(
            "{cp}: context parallelism's load-balanced ring attention needs causal attention without a mask (is_causal=True), which the GPT-2, LLaMA and nanoGPT language models run (with --head lm); give --cp 1"
        )));
    }
    match attn {
        AttnImpl::Sdpa(SdpaBackend::Flash | SdpaBackend::Cudnn) => Ok(()),
        AttnImpl::Sdpa(SdpaBackend::MemEfficient) => Err(unsupported(format!(
            "{cp}: the ring over memory-efficient attention (chosen for float32 or on this GPU) is not modelled (its logsumexp rows are padded to 32 and its backward gives k and v one gradient chunk when they alias); give --precision bf16 (flash or cuDNN attention) or --attention sdpa-flash"
        ))),
        AttnImpl::Sdpa(SdpaBackend::Math) | AttnImpl::Eager => Err(unsupported(format!(
            "{cp}: the context-parallel dispatcher replaces only the fused SDPA kernels (flash, memory-efficient, cuDNN: _sdpa_handler's call_maps) with ring attention; this step's attention is {} — give --attention auto, sdpa-flash or sdpa-cudnn with --precision bf16",
            match attn {
                AttnImpl::Eager => "eager",
                _ => "SDPA's math path",
            }
        ))),
    }
}
