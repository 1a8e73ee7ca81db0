//! Which kernel `F.scaled_dot_product_attention` runs, and why: PyTorch's backend choice
//! (`aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`, `select_sdp_backend` and the
//! `can_use_*` filters; `sdp_utils_cpp.h` for the shared ones) as a pure function of the call's
//! arguments and the GPU's compute capability, with the reason in words.
//!
//! The build modelled is PyTorch 2.15's CUDA 12 wheel with its bundled cuDNN (newer than 9.15.0,
//! so `check_prefer_cudnn_attention` passes on sm 9.0/10.0/10.3; older than the 9.22 and frontend
//! 1.24 that lift cuDNN's head-dim limit to 256), FlashAttention-2 and memory-efficient attention
//! compiled in, all four backends enabled (`torch.backends.cuda.enable_*_sdp` defaults),
//! deterministic algorithms off and `TORCH_CUDNN_SDPA_DEPRIORITIZED` unset. Storage offsets of
//! q/k/v are taken as aligned (`check_data_ptr_alignment_mem_efficient`: the models here slice q,
//! k and v at multiples of the head size). ROCm builds (AOTriton/CK) are not modelled.
//!
//! Order (`priority_order`): the global list of `ATen/Context.h`, flash → efficient → math →
//! cuDNN, so cuDNN is never reached while math is enabled; except when
//! `check_prefer_cudnn_attention()` holds (runtime cuDNN > 9.15.0, GPU major 9 or 10, and on
//! CUDA < 13 builds minor 0 or 3): cuDNN → flash → efficient → math. The first backend whose
//! filters all pass runs; math always can.

use std::fmt;

use crate::dtype::DType;
use crate::recipe::{Attention, Target};

/// An SDPA backend (`torch.nn.attention.SDPBackend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SdpaBackend {
    /// FlashAttention-2 (`_scaled_dot_product_flash_attention`).
    Flash,
    /// Memory-efficient attention (`_scaled_dot_product_efficient_attention`, xFormers' CUTLASS
    /// kernel).
    MemEfficient,
    /// cuDNN attention (`_scaled_dot_product_cudnn_attention`, cuDNN's fused flash kernel).
    Cudnn,
    /// The composite math implementation (`_scaled_dot_product_attention_math`).
    Math,
}

impl SdpaBackend {
    /// The `--attention` value forcing this backend (`sdpa-flash`, ...).
    pub fn option_name(self) -> &'static str {
        match self {
            SdpaBackend::Flash => "sdpa-flash",
            SdpaBackend::MemEfficient => "sdpa-mem-efficient",
            SdpaBackend::Cudnn => "sdpa-cudnn",
            SdpaBackend::Math => "sdpa-math",
        }
    }
}

impl fmt::Display for SdpaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SdpaBackend::Flash => "FlashAttention-2",
            SdpaBackend::MemEfficient => "memory-efficient attention",
            SdpaBackend::Cudnn => "cuDNN attention",
            SdpaBackend::Math => "math attention (composite)",
        })
    }
}

/// The arguments of one `F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
/// enable_gqa=...)` call, as `sdp_params` sees them (dense 4-D tensors `[B, H, L, D]` on CUDA with
/// a unit last stride).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SdpaCall {
    /// Element type of q, k and v when the call runs (after autocast's cast).
    pub dtype: DType,
    /// Batch size.
    pub batch: u64,
    /// Query heads.
    pub heads_q: u64,
    /// Key and value heads.
    pub heads_kv: u64,
    /// Query length.
    pub seq_q: u64,
    /// Key and value length.
    pub seq_kv: u64,
    /// Head size of q and k.
    pub head_dim: u64,
    /// Head size of v.
    pub head_dim_v: u64,
    /// An `attn_mask` is passed.
    pub mask: bool,
    /// `dropout_p`.
    pub dropout: f64,
    /// `is_causal`.
    pub is_causal: bool,
    /// `enable_gqa`.
    pub enable_gqa: bool,
    /// Some input requires grad (training).
    pub requires_grad: bool,
}

/// A backend PyTorch chose (or was told to use) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The kernel.
    pub backend: SdpaBackend,
    /// Why, in words, naming the PyTorch checks.
    pub reason: String,
}

/// A forced backend that cannot run the call: PyTorch warns why and raises
/// `No available kernel. Aborting execution.`
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--attention {option}: {backend} cannot run this attention call on sm {major}.{minor}: {why}; PyTorch would raise \"No available kernel. Aborting execution.\" (choose --attention auto, or another of eager, sdpa-flash, sdpa-mem-efficient, sdpa-cudnn, sdpa-math)", option = backend.option_name(), major = cc.0, minor = cc.1)]
pub struct Unavailable {
    /// The backend asked for.
    pub backend: SdpaBackend,
    /// The compute capability.
    pub cc: (u32, u32),
    /// The first filter that fails, in PyTorch's words.
    pub why: String,
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "fp32",
        DType::F16 => "fp16",
        DType::BF16 => "bf16",
        other => other.name(),
    }
}

fn sm(cc: (u32, u32)) -> String {
    format!("sm {}.{}", cc.0, cc.1)
}

fn in_range(cc: (u32, u32), lo: (u32, u32), hi: (u32, u32)) -> bool {
    cc >= lo && cc <= hi
}

/// `check_prefer_cudnn_attention()` for the modelled build: bundled cuDNN > 9.15.0, major 9 or
/// 10, minor 0 or 3 (the `CUDA_VERSION < 13000` branch; CUDA 13 builds drop the minor test, which
/// changes nothing for the CUDA presets: all their sm 9.x/10.x parts are x.0).
pub fn prefers_cudnn(target: Target) -> bool {
    let (major, minor) = target.compute_capability;
    (major == 9 || major == 10) && (minor == 0 || minor == 3)
}

/// The order `select_sdp_backend` tries the backends in on this GPU (`priority_order`).
pub fn priority(target: Target) -> [SdpaBackend; 4] {
    use SdpaBackend::*;
    if prefers_cudnn(target) {
        [Cudnn, Flash, MemEfficient, Math]
    } else {
        [Flash, MemEfficient, Math, Cudnn]
    }
}

/// `check_batch_size_and_num_heads_dense<supports_gqa=true, ...>`: without `enable_gqa` all head
/// counts must agree; with it (`check_grouped_query_attention`), q's must be a multiple of k's and
/// v's (flash and mem-efficient also need k and v to have as many heads, which a call with one
/// `heads_kv` always has).
fn check_heads(c: &SdpaCall) -> Result<(), String> {
    if c.enable_gqa {
        if c.heads_kv == 0 || !c.heads_q.is_multiple_of(c.heads_kv) {
            return Err(format!(
                "the number of heads in key/value ({}) must divide the number of heads in query ({}) (check_grouped_query_attention)",
                c.heads_kv, c.heads_q
            ));
        }
    } else if c.heads_q != c.heads_kv {
        return Err(format!(
            "query has {} heads and key/value {} without enable_gqa: fused kernels need the same num_heads (check_batch_size_and_num_heads_dense)",
            c.heads_q, c.heads_kv
        ));
    }
    Ok(())
}

fn nonzero_seq(c: &SdpaCall) -> Result<(), String> {
    if c.seq_q == 0 || c.seq_kv == 0 {
        return Err("fused kernels do not support zero seq_len_q or seq_len_kv (check_nonzero_sequence_lengths_dense)".into());
    }
    Ok(())
}

/// `can_use_flash_attention`, in its filter order: why the call passes (the facts that matter),
/// or the first filter that fails.
pub fn can_use_flash(c: &SdpaCall, target: Target) -> Result<String, String> {
    let cc = target.compute_capability;
    if c.mask {
        return Err("Flash attention does not support an attn_mask (check_for_attn_mask)".into());
    }
    if !(c.head_dim == c.head_dim_v && c.head_dim <= 256) {
        return Err(format!(
            "Flash attention requires q, k, v to have the same last dimension ≤ 256, got {} and {} (check_head_dim_size_flash)",
            c.head_dim, c.head_dim_v
        ));
    }
    if !in_range(cc, (8, 0), (12, 1)) {
        return Err(format!(
            "Flash attention only supports gpu architectures in the range [sm80, sm121], not {} (check_flash_attention_hardware_support)",
            sm(cc)
        ));
    }
    let sm86_89 = in_range(cc, (8, 6), (8, 9));
    let sm120_121 = in_range(cc, (12, 0), (12, 1));
    if c.requires_grad && (sm86_89 || sm120_121) {
        let ok = c.head_dim <= 192 || (c.dropout == 0.0 && c.head_dim > 224);
        if !ok {
            return Err(format!(
                "Flash attention does not support training with head_dim in (192, 224], or (224, 256] with dropout, on {} (check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120); head_dim is {}",
                sm(cc),
                c.head_dim
            ));
        }
    }
    if c.is_causal && c.seq_q != c.seq_kv {
        return Err(format!(
            "Flash attention does not support is_causal when seqlen_q ({}) != seqlen_k ({}) (check_flash_causal_non_square_seqlens)",
            c.seq_q, c.seq_kv
        ));
    }
    if !matches!(c.dtype, DType::F16 | DType::BF16) {
        return Err(format!(
            "Flash attention needs fp16 or bf16 inputs, got {} (check_dtypes_flash_attention)",
            dtype_name(c.dtype)
        ));
    }
    check_heads(c)?;
    nonzero_seq(c)?;
    Ok(format!(
        "{}, head dim {} ≤ 256, no mask",
        dtype_name(c.dtype),
        c.head_dim
    ))
}

/// `minimum_gemm_alignment`: the head-dim alignment memory-efficient attention needs (sm80+: 8
/// for 16-bit, 4 for fp32; sm7x: 8 for 16-bit, 1 for fp32; below: 1).
fn mem_efficient_alignment(c: &SdpaCall, cc: (u32, u32)) -> u64 {
    let half = matches!(c.dtype, DType::F16 | DType::BF16);
    let use_tc = cc.0 >= 8 || (cc.0 >= 7 && half);
    let mut mn = if cc.0 >= 8 { 4 } else { 1 };
    if use_tc {
        mn = mn.max(128 / if half { 16 } else { 32 });
    }
    mn
}

/// `can_use_mem_efficient_attention`, in its filter order.
pub fn can_use_mem_efficient(c: &SdpaCall, target: Target) -> Result<String, String> {
    let cc = target.compute_capability;
    if !in_range(cc, (5, 0), (12, 1)) {
        return Err(format!(
            "Mem Efficient Attention only supports gpu architectures in the range [sm50, sm121], not {} (check_mem_efficient_hardware_support)",
            sm(cc)
        ));
    }
    let align = mem_efficient_alignment(c, cc);
    if c.head_dim == 0
        || c.head_dim_v == 0
        || !c.head_dim.is_multiple_of(align)
        || !c.head_dim_v.is_multiple_of(align)
    {
        return Err(format!(
            "Mem efficient attention requires the last dimension of the inputs to be divisible by {align}, got {} and {} (check_head_dim_size_mem_efficient)",
            c.head_dim, c.head_dim_v
        ));
    }
    nonzero_seq(c)?;
    check_heads(c)?;
    let ok = if cc.0 >= 8 {
        matches!(c.dtype, DType::F16 | DType::BF16 | DType::F32)
    } else {
        matches!(c.dtype, DType::F16 | DType::F32)
    };
    if !ok {
        return Err(format!(
            "Mem efficient attention takes {} on {}, not {} (check_tensor_dtype)",
            if cc.0 >= 8 {
                "fp16, fp32 or bf16"
            } else {
                "fp16 or fp32"
            },
            sm(cc),
            dtype_name(c.dtype)
        ));
    }
    Ok(format!(
        "{}, head dim {} a multiple of {align}{}",
        dtype_name(c.dtype),
        c.head_dim,
        if c.mask { ", with the mask" } else { "" }
    ))
}

/// cuDNN's head-dim limit for the modelled build: 128, or (192, 128) on sm 9.0/10.x (cuDNN ≥
/// 9.11); 256 needs cuDNN > 9.22 and frontend ≥ 1.24, newer than the bundled one.
fn cudnn_head_dims_ok(c: &SdpaCall, cc: (u32, u32)) -> bool {
    let sm90_or_10x = (cc.0 == 9 && cc.1 == 0) || cc.0 == 10;
    (c.head_dim <= 128 && c.head_dim_v <= 128)
        || (sm90_or_10x && c.head_dim == 192 && c.head_dim_v == 128)
}

/// `can_use_cudnn_attention`, in its filter order.
pub fn can_use_cudnn(c: &SdpaCall, target: Target) -> Result<String, String> {
    let cc = target.compute_capability;
    let low = if cc.0 >= 8 {
        matches!(c.dtype, DType::F16 | DType::BF16)
    } else {
        c.dtype == DType::F16
    };
    if !low {
        return Err(format!(
            "cuDNN attention needs {} inputs on {}, got {} (check_dtypes_low_precision)",
            if cc.0 >= 8 { "fp16 or bf16" } else { "fp16" },
            sm(cc),
            dtype_name(c.dtype)
        ));
    }
    if !in_range(cc, (8, 0), (12, 1)) {
        return Err(format!(
            "cuDNN MHA only supports gpu architectures in the range [sm80, sm121], not {} (check_cudnn_hardware_support)",
            sm(cc)
        ));
    }
    if c.dropout * 16.0 != (c.dropout * 16.0).floor() {
        return Err(format!(
            "dropout {} is not a multiple of 1/16, cuDNN's dropout resolution (check_cudnn_dropout)",
            c.dropout
        ));
    }
    nonzero_seq(c)?;
    check_heads(c)?;
    if c.batch > 65535 || c.heads_q > 65535 {
        return Err(format!(
            "cuDNN SDPA does not support batch size or num_heads greater than 65535, got {} and {} (check_cudnn_tensor_shapes)",
            c.batch, c.heads_q
        ));
    }
    if !cudnn_head_dims_ok(c, cc) {
        return Err(format!(
            "head_dim should be no more than 128 for the bundled cuDNN, got {} and {} (check_cudnn_tensor_shapes)",
            c.head_dim, c.head_dim_v
        ));
    }
    if !c.head_dim.is_multiple_of(8) || !c.head_dim_v.is_multiple_of(8) {
        return Err(format!(
            "head_dim should be a multiple of 8, got {} and {} (check_cudnn_tensor_shapes)",
            c.head_dim, c.head_dim_v
        ));
    }
    if c.seq_kv == 1 {
        return Err(
            "cudnn SDPA does not support key/value sequence length 1 (check_cudnn_tensor_shapes)"
                .into(),
        );
    }
    if c.dropout != 0.0 && c.seq_q == 1 {
        return Err("cudnn SDPA does not support query sequence length 1 with dropout (check_cudnn_tensor_shapes)".into());
    }
    Ok(format!(
        "{}, head dim {} ≤ 128{}",
        dtype_name(c.dtype),
        c.head_dim,
        if c.dropout > 0.0 {
            format!(", dropout {} a multiple of 1/16", c.dropout)
        } else {
            String::new()
        }
    ))
}

/// Whether `backend` can run the call on `target` (`can_use_*`; math always can).
pub fn can_use(backend: SdpaBackend, c: &SdpaCall, target: Target) -> Result<String, String> {
    match backend {
        SdpaBackend::Flash => can_use_flash(c, target),
        SdpaBackend::MemEfficient => can_use_mem_efficient(c, target),
        SdpaBackend::Cudnn => can_use_cudnn(c, target),
        SdpaBackend::Math => Ok(format!(
            "{} upcast to fp32 when 16-bit, scores [B, H, L, S] materialized",
            dtype_name(c.dtype)
        )),
    }
}

/// `select_sdp_backend`: the first backend of [`priority`] whose filters pass, with the reason
/// (the order, why earlier backends were passed over, what the chosen one accepts).
pub fn select(c: &SdpaCall, target: Target) -> Choice {
    let cc = target.compute_capability;
    let order = if prefers_cudnn(target) {
        format!(
            "{} prefers cuDNN (check_prefer_cudnn_attention: cuDNN > 9.15, sm 9.x/10.x)",
            sm(cc)
        )
    } else {
        format!("{}: default order flash → efficient → math → cuDNN", sm(cc))
    };
    let mut passed_over = Vec::new();
    for backend in priority(target) {
        match can_use(backend, c, target) {
            Ok(why) => {
                let mut reason = format!("{backend}: {order}");
                for (b, why_not) in &passed_over {
                    reason.push_str(&format!("; not {b}: {why_not}"));
                }
                reason.push_str(&format!("; {why}"));
                return Choice { backend, reason };
            }
            Err(why_not) => passed_over.push((backend, why_not)),
        }
    }
    // Math accepts every call, so the loop always returns.
    Choice {
        backend: SdpaBackend::Math,
        reason: format!("{}: {order}", SdpaBackend::Math),
    }
}

/// A forced backend (`with sdpa_kernel(backend)`): the backend if it can run the call, else
/// PyTorch's error.
pub fn force(backend: SdpaBackend, c: &SdpaCall, target: Target) -> Result<Choice, Unavailable> {
    match can_use(backend, c, target) {
        Ok(why) => Ok(Choice {
            backend,
            reason: format!(
                "{backend}: forced (--attention {}; torch.nn.attention.sdpa_kernel); {why}",
                backend.option_name()
            ),
        }),
        Err(why) => Err(Unavailable {
            backend,
            cc: target.compute_capability,
            why,
        }),
    }
}

/// The backend an `--attention` value asks for: `None` for `auto` and `eager` (PyTorch chooses,
/// or no SDPA at all).
pub fn forced_backend(a: Attention) -> Option<SdpaBackend> {
    match a {
        Attention::Auto | Attention::Eager => None,
        Attention::SdpaFlash => Some(SdpaBackend::Flash),
        Attention::SdpaMemEfficient => Some(SdpaBackend::MemEfficient),
        Attention::SdpaCudnn => Some(SdpaBackend::Cudnn),
        Attention::SdpaMath => Some(SdpaBackend::Math),
    }
}

/// The SDPA choice for a call under an `--attention` value: forced backends are checked, `auto`
/// (and `eager` where a model has no eager path) is PyTorch's selection.
pub fn choose(a: Attention, c: &SdpaCall, target: Target) -> Result<Choice, Unavailable> {
    match forced_backend(a) {
        Some(b) => force(b, c, target),
        None => Ok(select(c, target)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SdpaBackend::*;

    /// Llama-3-8B's call: 32 query heads, 8 kv heads, head dim 128, causal, no mask, GQA.
    fn llama(dtype: DType) -> SdpaCall {
        SdpaCall {
            dtype,
            batch: 2,
            heads_q: 32,
            heads_kv: 8,
            seq_q: 8192,
            seq_kv: 8192,
            head_dim: 128,
            head_dim_v: 128,
            mask: false,
            dropout: 0.0,
            is_causal: true,
            enable_gqa: true,
            requires_grad: true,
        }
    }

    /// GPT-2's call in training: 12 heads of 64, causal, attn_pdrop 0.1.
    fn gpt2(dtype: DType) -> SdpaCall {
        SdpaCall {
            heads_q: 12,
            heads_kv: 12,
            seq_q: 1024,
            seq_kv: 1024,
            head_dim: 64,
            head_dim_v: 64,
            dropout: 0.1,
            enable_gqa: false,
            ..llama(dtype)
        }
    }

    fn t(major: u32, minor: u32) -> Target {
        Target {
            compute_capability: (major, minor),
        }
    }

    /// The selection table, each row derived by hand from `sdp_utils.cpp`'s filters.
    #[test]
    fn selection_follows_pytorch_rules() {
        let mask = |mut c: SdpaCall| {
            c.mask = true;
            c.is_causal = false;
            c.enable_gqa = false;
            c.heads_kv = c.heads_q;
            c
        };
        let no_drop = |mut c: SdpaCall| {
            c.dropout = 0.0;
            c
        };
        let dropout_eighth = |mut c: SdpaCall| {
            c.dropout = 0.125;
            c
        };
        let hd = |mut c: SdpaCall, d: u64| {
            c.head_dim = d;
            c.head_dim_v = d;
            c
        };
        let rows: Vec<(&str, SdpaCall, Target, SdpaBackend)> = vec![
            // H100/H200/B200: cuDNN first; bf16, head dim 128, no dropout.
            ("llama bf16 H100", llama(DType::BF16), t(9, 0), Cudnn),
            ("llama bf16 B200", llama(DType::BF16), t(10, 0), Cudnn),
            ("llama fp16 H100", llama(DType::F16), t(9, 0), Cudnn),
            // A100, L4/4090 (sm 8.9), 5090 (sm 12.0): default order, flash first.
            ("llama bf16 A100", llama(DType::BF16), t(8, 0), Flash),
            ("llama bf16 4090", llama(DType::BF16), t(8, 9), Flash),
            ("llama bf16 5090", llama(DType::BF16), t(12, 0), Flash),
            // fp32: neither cuDNN nor flash take it; mem-efficient does on every arch ≥ sm50.
            ("llama fp32 H100", llama(DType::F32), t(9, 0), MemEfficient),
            ("llama fp32 A100", llama(DType::F32), t(8, 0), MemEfficient),
            ("llama fp32 V100", llama(DType::F32), t(7, 0), MemEfficient),
            // V100/T4: no flash (sm80+), mem-efficient takes fp16 but not bf16 below sm80 → math.
            ("llama fp16 V100", llama(DType::F16), t(7, 0), MemEfficient),
            ("llama bf16 V100", llama(DType::BF16), t(7, 0), Math),
            ("llama bf16 T4", llama(DType::BF16), t(7, 5), Math),
            // GPT-2 training: dropout 0.1 is not a multiple of 1/16 → cuDNN passed over → flash.
            (
                "gpt2 bf16 H100 dropout 0.1",
                gpt2(DType::BF16),
                t(9, 0),
                Flash,
            ),
            (
                "gpt2 bf16 H100 dropout 1/8",
                dropout_eighth(gpt2(DType::BF16)),
                t(9, 0),
                Cudnn,
            ),
            (
                "gpt2 bf16 H100 eval",
                no_drop(gpt2(DType::BF16)),
                t(9, 0),
                Cudnn,
            ),
            ("gpt2 fp32 H100", gpt2(DType::F32), t(9, 0), MemEfficient),
            // A mask rules flash out; cuDNN takes it on H100, mem-efficient elsewhere.
            (
                "masked bf16 A100",
                mask(llama(DType::BF16)),
                t(8, 0),
                MemEfficient,
            ),
            ("masked bf16 H100", mask(llama(DType::BF16)), t(9, 0), Cudnn),
            // Head dims: 256 exceeds cuDNN's 128 (flash takes ≤ 256); 80 on sm 8.9 is fine for
            // flash; 250 is not a multiple of 8 → flash still (≤ 256, same dims); 264 → none of
            // the fused kernels for bf16 on H100 except mem-efficient (multiple of 8).
            (
                "hd 256 bf16 H100",
                hd(llama(DType::BF16), 256),
                t(9, 0),
                Flash,
            ),
            (
                "hd 264 bf16 H100",
                hd(llama(DType::BF16), 264),
                t(9, 0),
                MemEfficient,
            ),
            (
                "hd 262 bf16 H100",
                hd(llama(DType::BF16), 262),
                t(9, 0),
                Math,
            ),
            // sm 8.6 training with head dim 200: flash refuses (192, 224] → mem-efficient.
            (
                "hd 200 bf16 3090",
                hd(llama(DType::BF16), 200),
                t(8, 6),
                MemEfficient,
            ),
            // sm 9.4 (CUDA < 13 wheel): not minor 0 or 3 → default order.
            ("llama bf16 sm 9.4", llama(DType::BF16), t(9, 4), Flash),
            // Pascal: only mem-efficient (sm50+) for fp32/fp16.
            ("llama fp16 P100", llama(DType::F16), t(6, 0), MemEfficient),
        ];
        for (name, call, target, want) in rows {
            let got = select(&call, target);
            assert_eq!(got.backend, want, "{name}: {}", got.reason);
        }
    }

    #[test]
    fn reasons_name_the_rule() {
        let c = select(&llama(DType::BF16), t(9, 0));
        assert!(
            c.reason
                .starts_with("cuDNN attention: sm 9.0 prefers cuDNN"),
            "{}",
            c.reason
        );
        assert!(c.reason.contains("check_prefer_cudnn_attention"));
        assert!(
            c.reason.contains("bf16, head dim 128 ≤ 128"),
            "{}",
            c.reason
        );
        let g = select(&gpt2(DType::BF16), t(9, 0));
        assert!(g.reason.contains("check_cudnn_dropout"), "{}", g.reason);
        let a = select(&llama(DType::BF16), t(8, 0));
        assert!(a.reason.contains("default order"), "{}", a.reason);
        let f = select(&llama(DType::F32), t(9, 0));
        assert!(f.reason.contains("not FlashAttention-2"), "{}", f.reason);
    }

    #[test]
    fn forced_backends_run_or_say_why_not() {
        let c = llama(DType::F32);
        let e = force(Flash, &c, t(9, 0)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("--attention sdpa-flash"), "{msg}");
        assert!(msg.contains("fp32"), "{msg}");
        assert!(msg.contains("No available kernel"), "{msg}");
        assert!(force(Cudnn, &llama(DType::BF16), t(8, 0)).is_ok());
        assert!(force(Cudnn, &llama(DType::BF16), t(7, 0)).is_err());
        assert!(force(Math, &c, t(7, 0)).is_ok());
        let m = force(MemEfficient, &llama(DType::BF16), t(7, 5)).unwrap_err();
        assert!(m.why.contains("fp16 or fp32"), "{}", m.why);
    }

    #[test]
    fn gqa_needs_enable_gqa() {
        let mut c = llama(DType::BF16);
        c.enable_gqa = false;
        assert!(can_use_flash(&c, t(8, 0)).is_err());
        assert!(can_use_cudnn(&c, t(9, 0)).is_err());
        assert_eq!(select(&c, t(9, 0)).backend, Math);
    }
}
