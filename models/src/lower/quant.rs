//! bitsandbytes' quantized linear layers ([`OpKind::QuantLinear`], see
//! [`crate::finetune::quant`]): the temporaries of their forward and backward.
//!
//! 4-bit, bitsandbytes 0.49 `autograd/_functions.py` `MatMul4Bit` (0.50's `gemm_4bit` takes the
//! same dequantize-then-`F.linear` fallback for more than 1536 tokens, i.e. in training):
//! forward `F.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)`; backward
//! `grad_A = torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype).t())`.
//! `dequantize_4bit` (`functional.py`) first dequantizes a double-quantized absmax to float32
//! `[nb]` (`dequantize_blockwise`, then `+= offset` in place), then writes the `[out, in]` weight
//! in `quant_state.dtype` (the model's dtype at quantization); the float32 absmax dies when it
//! returns. Only the packed weight is saved for backward: **the input is not**.
//!
//! 8-bit, `MatMul8bitLt` with `has_fp16_weights=False` (0.49 `autograd/_functions.py`,
//! `backends/cuda/ops.py`): `A.to(float16)` (a copy for bf16/fp32 inputs), `int8_vectorwise_quant`
//! → `SCA` float32 `[T]`, `CA` int8 `[T, in]` and the outlier search of `threshold=6.0`; the int8
//! GEMM's int32 `[T, out]` is dequantized into a float16 output, cast to the input's dtype.
//! Outlier columns depend on the data: none are modelled (their `subA` is `[T, n_outliers]`, and
//! the order of `int8_mixed_scaled_mm`'s allocations is unconfirmed). Saved: `A`, the input.
//! Backward: `CB.to(dtype_A, copy=True).mul_(SCB.unsqueeze(1).mul(1/127))` (an `[out, in]` copy
//! and an `[out, 1]` float32 scale), then `matmul(grad_output, CB)`.

use super::fwd::{Fwd, Save};
use super::{Lowering, NodeKind, Rt};
use crate::dtype::DType;
use crate::finetune::quant::{Quant, BLOCK_4BIT};
use crate::graph::ModuleId;
use crate::layout::Layout;
use crate::ops::OpKind;

impl<'g> Lowering<'g> {
    /// `F.dequantize_4bit(B, quant_state).to(dtype)`: the `[out, in]` weight in `dtype`.
    fn dequantize_4bit(&mut self, q: Quant, out: u64, inp: u64, dtype: DType, m: ModuleId) -> Rt {
        let absmax = q.double().then(|| {
            let nb = (out * inp).div_ceil(BLOCK_4BIT);
            self.alloc(
                Layout::contiguous(&[nb]),
                DType::F32,
                m,
                "bitsandbytes.dequantize_blockwise",
            )
        });
        let w = self.alloc(
            Layout::contiguous(&[out, inp]),
            self.param_dtype,
            m,
            "bitsandbytes.dequantize_4bit",
        );
        if let Some(a) = absmax {
            self.drop_rt(a);
        }
        if dtype == w.dtype {
            return w;
        }
        let c = self.alloc(Layout::contiguous(&[out, inp]), dtype, m, "aten._to_copy");
        self.drop_rt(w);
        c
    }

    /// The forward of a [`OpKind::QuantLinear`] over `x = [input, packed weight, bias?]`.
    pub(super) fn quant_linear_fwd(
        &mut self,
        kind: &OpKind,
        x: &[Rt],
        out_shape: &[u64],
        m: ModuleId,
    ) -> Fwd {
        let OpKind::QuantLinear {
            quant,
            in_features,
            out_features,
        } = *kind
        else {
            unreachable!("quant_linear_fwd of {kind:?}")
        };
        let a = &x[0];
        let tokens = a.layout.numel() / in_features.max(1);
        let bias = x.len() > 2;
        if quant == Quant::Int8 {
            let t2 = |s: &mut Self, cols: u64, d: DType, op: &str| {
                s.alloc(Layout::contiguous(&[tokens, cols]), d, m, op)
            };
            // `A.to(torch.float16)` (a copy unless A is float16).
            let a16 =
                (a.dtype != DType::F16).then(|| t2(self, in_features, DType::F16, "aten._to_copy"));
            // backends/cuda/ops.py `int8_vectorwise_quant`: row_stats, out_row, then with
            // threshold 6.0 `outliers = A.abs() >= threshold` (the abs dies at once) and
            // `outliers.any()`; no outlier column (data-dependent) is modelled.
            let sca = self.alloc(
                Layout::contiguous(&[tokens]),
                DType::F32,
                m,
                "bitsandbytes.int8_vectorwise_quant",
            );
            let ca = t2(
                self,
                in_features,
                DType::U8,
                "bitsandbytes.int8_vectorwise_quant",
            );
            let abs = t2(self, in_features, DType::F16, "aten.abs");
            let outliers = t2(self, in_features, DType::Bool, "aten.ge");
            self.drop_rt(abs);
            let any = self.alloc(Layout::contiguous(&[]), DType::Bool, m, "aten.any");
            self.drop_rt(any);
            self.drop_rt(outliers);
            if let Some(t) = a16 {
                self.drop_rt(t);
            }
            // int8_scaled_mm: int8_linear_matmul's int32 [T, out], int8_mm_dequant's float16
            // output (bias added in place), `.to(A.dtype)` when A is not float16.
            let acc = t2(
                self,
                out_features,
                DType::I32,
                "bitsandbytes.int8_linear_matmul",
            );
            let o16 = self.alloc(
                Layout::contiguous(out_shape),
                DType::F16,
                m,
                "bitsandbytes.int8_mm_dequant",
            );
            let o = if a.dtype == DType::F16 {
                o16
            } else {
                let o = self.alloc(Layout::contiguous(out_shape), a.dtype, m, "aten._to_copy");
                self.drop_rt(o16);
                o
            };
            self.drop_rt(acc);
            self.drop_rt(ca);
            self.drop_rt(sca);
            // ctx.tensors = (CAt, subA, A): the input is kept.
            let saves = if a.requires_grad() {
                vec![Save::In(0)]
            } else {
                vec![]
            };
            return Fwd::New(vec![o], NodeKind::Op(kind.clone()), saves);
        }
        let w = self.dequantize_4bit(quant, out_features, in_features, a.dtype, m);
        let o = self.alloc(
            Layout::contiguous(out_shape),
            a.dtype,
            m,
            if bias { "aten.addmm" } else { "aten.mm" },
        );
        self.gemm_workspace(bias, m);
        self.drop_rt(w);
        // ctx.tensors = (None, B): the packed weight only.
        let saves = if a.requires_grad() {
            vec![Save::In(1)]
        } else {
            vec![]
        };
        Fwd::New(vec![o], NodeKind::Op(kind.clone()), saves)
    }

    /// The backward of a [`OpKind::QuantLinear`]: the input's gradient (and the bias's, when it
    /// is trained).
    pub(super) fn quant_linear_bwd(
        &mut self,
        kind: &OpKind,
        g: &Rt,
        x_layout: Option<Layout>,
        need_bias: bool,
        m: ModuleId,
    ) -> (Option<Rt>, Option<Rt>) {
        let OpKind::QuantLinear {
            quant,
            in_features,
            out_features,
        } = *kind
        else {
            unreachable!("quant_linear_bwd of {kind:?}")
        };
        // `grad_output.sum(0, dtype=ctx.dtype_bias)` first.
        let gb = need_bias.then(|| {
            self.alloc(
                Layout::contiguous(&[out_features]),
                self.param_dtype,
                m,
                "aten.sum",
            )
        });
        let Some(xl) = x_layout else {
            return (None, gb);
        };
        let shape = xl.shape.clone();
        let ga = if quant == Quant::Int8 {
            let cb = self.alloc(
                Layout::contiguous(&[out_features, in_features]),
                g.dtype,
                m,
                "aten._to_copy",
            );
            let scale = self.alloc(
                Layout::contiguous(&[out_features, 1]),
                DType::F32,
                m,
                "aten.mul",
            );
            self.drop_rt(scale);
            let ga = self.alloc(Layout::contiguous(&shape), g.dtype, m, "aten.mm");
            self.gemm_workspace(false, m);
            self.drop_rt(cb);
            ga
        } else {
            let w = self.dequantize_4bit(quant, out_features, in_features, g.dtype, m);
            let ga = self.alloc(Layout::contiguous(&shape), g.dtype, m, "aten.mm");
            self.gemm_workspace(false, m);
            self.drop_rt(w);
            ga
        };
        (Some(ga), gb)
    }
}
