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
//! 8-bit, `MatMul8bitLt` with `has_fp16_weights=False`: `A.to(float16)` (a copy for bf16/fp32
//! inputs), `int8_vectorwise_quant` → `CA` int8 `[T, in]`, `SCA` float32 `[T]`; the int8 GEMM's
//! int32 `[T, out]` is dequantized into the output. Outlier columns (`threshold=6.0`) depend on
//! the data: none are modelled (their `subA` is `[T, n_outliers]`). Saved: `A`, the input.
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
        out_shape: Vec<u64>,
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
            let a16 = (a.dtype != DType::F16)
                .then(|| self.alloc(a.layout.empty_like(), DType::F16, m, "aten._to_copy"));
            let ca = self.alloc(
                Layout::contiguous(&[tokens, in_features]),
                DType::U8,
                m,
                "bitsandbytes.int8_vectorwise_quant",
            );
            let sca = self.alloc(
                Layout::contiguous(&[tokens]),
                DType::F32,
                m,
                "bitsandbytes.int8_vectorwise_quant",
            );
            if let Some(t) = a16 {
                self.drop_rt(t);
            }
            let acc = self.alloc(
                Layout::contiguous(&[tokens, out_features]),
                DType::I32,
                m,
                "bitsandbytes.int8_linear_matmul",
            );
            let o = self.alloc(
                Layout::contiguous(&out_shape),
                a.dtype,
                m,
                "bitsandbytes.int8_mm_dequant",
            );
            self.drop_rt(acc);
            self.drop_rt(sca);
            self.drop_rt(ca);
            let saves = if a.requires_grad() {
                vec![Save::In(0)]
            } else {
                vec![]
            };
            return Fwd::New(vec![o], NodeKind::Op(kind.clone()), saves);
        }
        let w = self.dequantize_4bit(quant, out_features, in_features, a.dtype, m);
        let o = self.alloc(
            Layout::contiguous(&out_shape),
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
