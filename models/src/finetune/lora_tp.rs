//! `--lora` under tensor parallelism (`--tp`, `--sp`): the adapters of NVIDIA Megatron-Bridge's
//! `LoRA` transform (`megatron/bridge/peft/lora.py`), a `LoRALinear` wrapper
//! (`lora_layers.py`: `linear_output, bias = to_wrap(x)`, `adapter_output = adapter(x.contiguous())`,
//! `linear_output + adapter_output.reshape(linear_output.shape)`) around each tensor-parallel
//! linear layer with a `ParallelLinearAdapter` (`peft/utils.py`), whose split follows the base
//! layer (`get_adapter_attributes_from_linear`: `input_is_parallel` for a row-parallel base):
//!
//! * **column-parallel base** (`linear_qkv`, `linear_fc1`; here `c_attn`, `c_fc`, `q/k/v_proj`,
//!   `gate/up_proj`, BERT's `query/key/value`, `intermediate.dense`): the adapter reads the base's
//!   input before its collective (the LayerNorm output); `linear_in = ColumnParallelLinear(in, r,
//!   gather_output=True, disable_grad_reduce=sequence_parallel)`: weight `[r/t, in]`, its output
//!   all-gathered along the last dimension to `[.., r]`; `linear_out = ColumnParallelLinear(r, out,
//!   gather_output=False)`: weight `[out/t, r]`, output `[.., out/t]` like the base's. With
//!   `--sp`, `gather_from_sequence_parallel_region(x)` first ("layernorm before lora is impacted
//!   by sequence parallel, hence seq dim need to be gathered right before lora linear layers");
//! * **row-parallel base** (`linear_proj`, `linear_fc2`; here `c_proj`, `o_proj`, `down_proj`,
//!   BERT's output denses): `linear_in = RowParallelLinear(in, r, input_is_parallel=True)`: weight
//!   `[r, in/t]`, output all-reduced; `linear_out = ColumnParallelLinear(r, out,
//!   gather_output=True)`: weight `[out/t, r]`, output gathered to `[.., out]`; with `--sp`,
//!   `scatter_to_sequence_parallel_region` after it (a view of Megatron's sequence-first tensor);
//! * both: the adapter's linears run without sequence parallelism (`model_parallel_config.
//!   sequence_parallel = False  # SP is irrelevant for the lora linear layer`), dropout before
//!   `linear_in` (`dropout_position="pre"`, `nn.Identity` for p = 0), the output times
//!   `alpha / dim`, the weights in the model's dtype (`if model_parallel_config.bf16:
//!   self.bfloat16()`; `lora_dtype` applies only to plain `nn.Linear` targets), the base frozen
//!   (`PEFT.freeze_model`).
//!
//! The adapters' `ColumnParallelLinear`s without `disable_grad_reduce` all-reduce their input's
//! gradient (`allreduce_dgrad`): a [`TpComm::Copy`] before the product, as the base layers have.
//!
//! PEFT's own `LoraParallelLinear` (`peft/tuners/lora/tp_layer.py`, lora_A replicated on a
//! column-parallel base, lora_B replicated on a row-parallel one) is not what is modelled: since
//! PEFT 0.14 (`338aeff`, "Faster DoRA") its forward is `lora_B(lora_A(dropout(x)))`, which hands
//! Megatron's `(output, bias)` tuple to the next layer, so it does not run on Megatron-core's
//! parallel layers.
//!
//! Only the tensor-parallel layers get adapters (Megatron-Bridge's default targets are the four
//! parallel linears); a replicated layer named in `targets=` is refused with the reason.

use super::lora::{LinearLayer, LoraConfig, LoraTargets};
use super::FinetuneError;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, Source, ValueId};
use crate::ops::{OpKind, TpComm};
use crate::zoo::tp::TpPlan;

/// How a linear layer is split over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpSide {
    /// Column-parallel: its input comes through `copy_to_tensor_model_parallel_region` (or the
    /// sequence-parallel all-gather); `input` is the value before that collective.
    Column {
        /// The layer's input before the collective (what the adapter reads).
        input: ValueId,
    },
    /// Row-parallel: its product is all-reduced (or reduce-scattered) inside the layer.
    Row,
}

/// The split of layer `l` of `g` (`None`: replicated on every rank).
pub fn tp_side(g: &Graph, l: &LinearLayer) -> Option<TpSide> {
    let row = g.ops[l.ops.0..=l.ops.1].iter().any(|o| {
        matches!(
            o.kind,
            OpKind::TpComm(TpComm::Reduce | TpComm::ReduceScatter)
        )
    });
    if row {
        return Some(TpSide::Row);
    }
    let (x, _) = l.input_output(g)?;
    match g.values[x.0 as usize].source {
        Source::Op { op, .. } => {
            let op = &g.ops[op.0 as usize];
            match op.kind {
                OpKind::TpComm(TpComm::Copy | TpComm::GatherToBuffer) => Some(TpSide::Column {
                    input: *op.inputs.first()?,
                }),
                _ => None,
            }
        }
        _ => None,
    }
}

/// The tensor-parallel layers `cfg` targets (with their split), or an error naming a target that
/// matches nothing or a replicated layer, or a rank the group does not divide.
pub fn targets(
    g: &Graph,
    cfg: &LoraConfig,
    plan: TpPlan,
) -> Result<Vec<(LinearLayer, TpSide)>, FinetuneError> {
    let all = super::lora::targets(g, cfg)?;
    let mut out = Vec::new();
    for l in all {
        match tp_side(g, &l) {
            Some(side) => out.push((l, side)),
            None if cfg.targets == LoraTargets::AllLinear => {}
            None => {
                return Err(FinetuneError::Tp {
                    model: g.name.clone(),
                    msg: format!(
                        "--lora targets {}, which is replicated on every tensor-parallel rank: under --tp {} the adapters are Megatron-Bridge's ParallelLinearAdapter on the column- and row-parallel layers (attention and MLP projections); leave it out of targets",
                        l.path, plan.t
                    ),
                });
            }
        }
    }
    if out.is_empty() {
        return Err(FinetuneError::NoLinear {
            model: g.name.clone(),
            what: format!("--lora under --tp {} (a tensor-parallel layer)", plan.t),
        });
    }
    // `ColumnParallelLinear(in, r)` (linear_in of a column-parallel base) and
    // `ColumnParallelLinear(r, out)` divide their outputs by the group (`divide` asserts).
    if out.iter().any(|(_, s)| matches!(s, TpSide::Column { .. })) && !cfg.r.is_multiple_of(plan.t)
    {
        return Err(FinetuneError::Tp {
            model: g.name.clone(),
            msg: format!(
                "--lora r={} under --tp {}: the adapter of a column-parallel layer is ColumnParallelLinear(in, r), which splits r over the ranks (megatron.core.utils.divide asserts r % tp == 0); give r a multiple of {}",
                cfg.r, plan.t, plan.t
            ),
        });
    }
    Ok(out)
}

/// `x`'s shape with its sequence dimension (1) multiplied by `mul` and divided by `div`.
fn seq_scaled(b: &GraphBuilder, x: ValueId, mul: u64, div: u64) -> Vec<u64> {
    let mut s = b.shape(x);
    if let Some(d) = s.get_mut(1) {
        *d = *d * mul / div;
    }
    s
}

/// `x`'s shape with its last dimension `n`.
fn last_dim(b: &GraphBuilder, x: ValueId, n: u64) -> Vec<u64> {
    let mut s = b.shape(x);
    if let Some(d) = s.last_mut() {
        *d = n;
    }
    s
}

/// Appends the `ParallelLinearAdapter` of layer `l` (base input `x`, output `y`) and the
/// wrapper's sum; returns the sum, which the layer's users take instead of `y`.
pub fn adapter(
    b: &mut GraphBuilder,
    l: &LinearLayer,
    side: TpSide,
    (x, y): (ValueId, ValueId),
    cfg: &LoraConfig,
    plan: TpPlan,
) -> ValueId {
    let (r, t) = (cfg.r, plan.t);
    let path = |s: &str| format!("{}.adapter{s}", l.path);
    let x = match side {
        TpSide::Column { input } => input,
        TpSide::Row => x,
    };
    b.set_path(&path(".linear_in"));
    let a_shape = match side {
        TpSide::Column { .. } => [r / t, l.in_features],
        TpSide::Row => [r, l.in_features],
    };
    let a = b.param_typed("weight", &a_shape, DTypeSpec::Model);
    b.set_path(&path(".linear_out"));
    let out_local = match side {
        TpSide::Column { .. } => l.out_features,
        TpSide::Row => l.out_features / t,
    };
    let bw = b.param_typed("weight", &[out_local, r], DTypeSpec::Model);
    b.set_path(&path(".dropout"));
    let xd = b.dropout(x, cfg.dropout);
    b.set_path(&path(""));
    let h = match side {
        TpSide::Column { .. } => {
            let xin = if plan.sp {
                let s = seq_scaled(b, xd, t, 1);
                b.tp_comm(TpComm::SeqGather, xd, s)
            } else {
                xd
            };
            b.set_path(&path(".linear_in"));
            let xin = if plan.sp {
                xin
            } else {
                let s = b.shape(xin);
                b.tp_comm(TpComm::Copy, xin, s)
            };
            let h = b.linear_op(xin, a, None);
            let s = last_dim(b, h, r);
            b.tp_comm(TpComm::GatherLast, h, s)
        }
        TpSide::Row => {
            b.set_path(&path(".linear_in"));
            let h = b.linear_op(xd, a, None);
            let s = b.shape(h);
            b.tp_comm(TpComm::Reduce, h, s)
        }
    };
    b.set_path(&path(".linear_out"));
    let s = b.shape(h);
    let hc = b.tp_comm(TpComm::Copy, h, s);
    let mut o = b.linear_op(hc, bw, None);
    if side == TpSide::Row {
        let s = last_dim(b, o, l.out_features);
        o = b.tp_comm(TpComm::GatherLast, o, s);
        if plan.sp {
            b.set_path(&path(""));
            let s = seq_scaled(b, o, 1, t);
            o = b.tp_comm(TpComm::SeqSplitView, o, s);
        }
    }
    b.set_path(&path(""));
    let scaled = b.mul_scalar(o);
    b.set_path(&l.path);
    b.add(y, scaled)
}
