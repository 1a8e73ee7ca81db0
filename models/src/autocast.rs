//! Autocast (`torch.autocast("cuda", dtype=...)`): which ops run in 16-bit and which in float32.
//!
//! Mirrors the CUDA op lists of `aten/src/ATen/autocast_mode.cpp` for the ops this crate models:
//! `lower_precision_fp` (cast float inputs to the autocast dtype) holds `linear`, `matmul`, `mm`,
//! `addmm`, `bmm`, `baddbmm`, the convolutions and `scaled_dot_product_attention`; `fp32` holds
//! `layer_norm`/`native_layer_norm`, `pow`, `rsqrt`, `nll_loss`, `mse_loss` and the losses; `fp32_set_opt_dtype`
//! holds `softmax`, `log_softmax`, `sum`, `prod`, `cumsum`; `promote` holds `cat`, `stack`,
//! `addcmul`, `addcdiv`, `index_put`. Ops in no list run in whatever dtype their inputs have
//! (type promotion). Casts of leaf tensors that require grad (the parameters) are cached for the
//! life of the autocast region (`cached_cast`), so each weight is copied once per forward and the
//! copy lives until autocast exits, and beyond while autograd saves it.
//!
//! The meta device does not run autocast, so these rules are not checked by the capture fixtures;
//! they were read from `autocast_mode.cpp` (PyTorch 2.x) and are checked in this crate's tests on
//! the dtypes they give (16-bit matmul outputs, float32 softmax/layer-norm/loss).

use crate::ops::OpKind;

/// What autocast does with an op's floating inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// `lower_precision_fp`: cast to the autocast dtype.
    Lower,
    /// `fp32` / `fp32_set_opt_dtype`: cast to float32.
    Fp32,
    /// `promote`: cast to the widest input dtype.
    Promote,
    /// Not in any list: no cast.
    None,
}

/// The autocast policy of an op (CUDA lists of `autocast_mode.cpp`).
pub fn policy(kind: &OpKind) -> Policy {
    use OpKind::*;
    match kind {
        // fp32_set_opt_dtype with the dtype given: `set_opt_dtype` keeps it
        // (`dtype.has_value() ? dtype : at::kFloat`, `autocast_mode.h`) and the op runs uncast.
        LogSoftmax {
            explicit_dtype: true,
            ..
        } => Policy::None,
        Mm | Addmm | Bmm | Sdpa { .. } | Conv2d { .. } => Policy::Lower,
        Softmax { .. }
        | LogSoftmax { .. }
        | NllLoss
        | MseLoss
        | LayerNorm
        | PowScalar(_)
        | Rsqrt => Policy::Fp32,
        Cat { .. } => Policy::Promote,
        // A call lowered from its recording: the policy the capture read off its kernel.
        Recorded(r) => r.autocast,
        _ => Policy::None,
    }
}
