//! Megatron-LM's tensor- and sequence-parallel collectives on one rank (`--tp`, `--sp`): what
//! `megatron/core/tensor_parallel/mappings.py`, `layers.py` and `cross_entropy.py` allocate, and
//! when. Every rank of the tensor-parallel group holds equal shards, so one rank's trace stands for
//! all. The collectives are synchronous (`async_op=False`, or waited before the tensors are read),
//! so in PyTorch 2.15 they run on the current stream and hold nothing beyond their tensors (under
//! `--torch-version 1.10`, `record_stream` on the NCCL stream). The persistent all-gather buffer is a
//! communication allocation ([`Kind::Comm`]); the other collectives' outputs are the model's
//! activations and gradients. Megatron's functions are Python `autograd.Function`s: their incoming
//! gradients die before `validate_outputs` (`bwd.rs`).

use super::fwd::{Fwd, Save};
use super::{Kind, Lowering, Meta, NodeKind, Rt};
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::layout::Layout;
use crate::ops::{OpKind, TpComm};

/// Tensor parallelism's state of the lowering.
#[derive(Default)]
pub(crate) struct TpState {
    /// `GlobalMemoryBuffer.buffer[("mpu", dtype)]` (`megatron/core/utils.py`): one persistent
    /// buffer per dtype, replaced by a larger one when a request does not fit, never freed.
    mpu: Vec<Rt>,
}

impl<'g> Lowering<'g> {
    /// `get_global_memory_buffer().get_tensor(shape, dtype, "mpu")`: a view of the persistent
    /// buffer of `dtype`, which is (re)made with `torch.empty(required_len)` when missing or too
    /// small (the old one dies with its last view). The one communication buffer of tensor
    /// parallelism ([`Kind::Comm`]); the other collectives' outputs are the model's tensors
    /// (activations, gradients) and are counted as such.
    fn tp_mpu_view(&mut self, shape: &[u64], dtype: DType, m: ModuleId) -> Rt {
        let need = Layout::contiguous(shape).numel();
        let slot = self.tp.mpu.iter().position(|b| b.dtype == dtype);
        let fits = slot.is_some_and(|i| self.tp.mpu[i].layout.numel() >= need);
        if !fits {
            let prev = self.kind_now;
            self.kind_now = Kind::Comm;
            let buf = self.alloc(
                Layout::contiguous(&[need]),
                dtype,
                m,
                "megatron.GlobalMemoryBuffer",
            );
            self.kind_now = prev;
            match slot {
                Some(i) => {
                    let old = std::mem::replace(&mut self.tp.mpu[i], buf);
                    self.drop_rt(old);
                }
                None => self.tp.mpu.push(buf),
            }
        }
        let i = self
            .tp
            .mpu
            .iter()
            .position(|b| b.dtype == dtype)
            .unwrap_or(0);
        let buf = self.tp.mpu[i].clone();
        self.view(&buf, Layout::contiguous(shape))
    }

    /// The forward of a [`TpComm`] on `x` giving `out` (its shape).
    pub(super) fn tp_comm_fwd(&mut self, c: TpComm, x: &Rt, out: &[u64], m: ModuleId) -> Fwd {
        let nk = NodeKind::Op(OpKind::TpComm(c));
        match c {
            // `_CopyToModelParallelRegion.forward` returns its input (and so does
            // ColumnParallelLinear with `allreduce_dgrad`, which all-reduces the input gradient
            // in its backward instead).
            TpComm::Copy => {
                let v = self.view(x, x.layout.clone());
                Fwd::New(vec![v], nk, vec![])
            }
            // `_reduce` all-reduces the (contiguous) input in place and returns it.
            TpComm::Reduce => {
                self.collective_uses(x);
                let v = self.view(x, x.layout.clone());
                Fwd::New(vec![v], nk, vec![])
            }
            // `LinearWithGradAccumulationAndAsyncCommunication.forward`: `all_gather_buffer =
            // get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")`, gathered
            // into; `ctx.save_for_backward(input, weight)` keeps the local shard.
            TpComm::GatherToBuffer => {
                let v = self.tp_mpu_view(out, x.dtype, m);
                self.collective_uses(&v);
                self.collective_uses(x);
                Fwd::New(vec![v], nk, vec![Save::In(0)])
            }
            // `_reduce_scatter_along_first_dim`: `output = torch.empty(dim_size / world_size)`,
            // reduce-scattered into; the input dies with its last reference.
            TpComm::ReduceScatter => {
                let o = self.alloc(Layout::contiguous(out), x.dtype, m, c.name());
                self.collective_uses(&o);
                self.collective_uses(x);
                Fwd::New(vec![o], nk, vec![])
            }
            // `_split_along_first_dim` (`input_[offset:offset + n].contiguous()`) and the
            // embedding's `embeddings.clone()`: a new shard.
            TpComm::Scatter => {
                let o = self.alloc(Layout::contiguous(out), x.dtype, m, "aten.clone");
                Fwd::New(vec![o], nk, vec![])
            }
            // `_gather_along_first_dim`: `output = torch.empty(dim_size)`, all-gathered into.
            TpComm::SeqGather | TpComm::SeqGatherReplicated => {
                let o = self.alloc(Layout::contiguous(out), x.dtype, m, c.name());
                self.collective_uses(&o);
                self.collective_uses(x);
                Fwd::New(vec![o], nk, vec![])
            }
            // `_gather_along_last_dim`: `output = torch.empty(dim_size)` (t × the input along the
            // first dimension), all-gathered into, then `torch.cat(output.chunk(t, dim=0),
            // dim=-1)`; the gathered buffer dies when the function returns.
            TpComm::GatherLast => {
                let t = Layout::contiguous(out).numel() / x.layout.numel().max(1);
                let n = x.layout.numel() * t;
                let buf = self.alloc(
                    Layout::contiguous(&[n]),
                    x.dtype,
                    m,
                    "megatron.all_gather_into_tensor",
                );
                self.collective_uses(&buf);
                self.collective_uses(x);
                let o = self.alloc(Layout::contiguous(out), x.dtype, m, "aten.cat");
                self.drop_rt(buf);
                Fwd::New(vec![o], nk, vec![])
            }
            // `input_[offset:offset + n].contiguous()` on a sequence-first tensor: a view.
            TpComm::SeqSplitView => {
                let v = self.view(x, Layout::contiguous(out));
                Fwd::New(vec![v], nk, vec![])
            }
        }
    }

    /// The backward of a [`TpComm`]: the gradient of its input from `g`, its output's.
    pub(super) fn tp_comm_bwd(&mut self, c: TpComm, g: &Rt, input: &Meta, m: ModuleId) -> Rt {
        match c {
            // `_reduce(grad_output)` in place (or the linear's `allreduce_dgrad`).
            TpComm::Copy => {
                self.collective_uses(g);
                self.dup(g)
            }
            // `return grad_output`.
            TpComm::Reduce => self.dup(g),
            // Backward of the sequence-parallel linear: the input is re-gathered into the same
            // persistent buffer (no allocation), and `sub_grad_input = torch.empty(dim_size)`
            // receives the reduce-scatter of the input's gradient.
            // `_split_along_first_dim(grad_output)`: on sequence-first tensors a view.
            TpComm::SeqGatherReplicated => self.view(g, Layout::contiguous(&input.layout.shape)),
            // `_split_along_last_dim(grad_output)`: the rank's slice, made contiguous (a copy).
            TpComm::GatherLast => self.alloc(
                Layout::contiguous(&input.layout.shape),
                g.dtype,
                m,
                "aten.clone",
            ),
            // The other three: `_reduce_scatter_along_first_dim` of the gradient (SeqGather, and
            // GatherToBuffer's `sub_grad_input`) or `_gather_along_first_dim` (ReduceScatter,
            // Scatter, SeqSplitView), each into a new `torch.empty` tensor.
            TpComm::GatherToBuffer
            | TpComm::ReduceScatter
            | TpComm::Scatter
            | TpComm::SeqGather
            | TpComm::SeqSplitView => {
                let (name, shape) = match c {
                    TpComm::GatherToBuffer | TpComm::SeqGather => {
                        ("megatron.reduce_scatter_tensor", &input.layout.shape)
                    }
                    // `_gather_along_first_dim(grad_output)`: `torch.empty(dim_size * world_size)`.
                    _ => ("megatron.all_gather_into_tensor", &input.layout.shape),
                };
                let o = self.alloc(Layout::contiguous(shape), g.dtype, m, name);
                self.collective_uses(&o);
                self.collective_uses(g);
                o
            }
        }
    }

    /// `_VocabParallelCrossEntropy.forward` on `x[0]` (logits `[N, V/t]`) and `x[1]` (targets
    /// `[N]`), allocation by allocation; the function runs without autograd inside, and saves
    /// `(exp_logits, target_mask, masked_target_1d)`.
    pub(super) fn vocab_ce_fwd(&mut self, x: &[Rt], m: ModuleId) -> Fwd {
        let n = x[1].layout.numel();
        let rows = [n];
        let f32 = DType::F32;
        let a = |s: &mut Self, d: DType, op: &str| s.alloc(Layout::contiguous(&rows), d, m, op);
        // calculate_logits_max: `vocab_parallel_logits.float()` (the logits themselves when
        // float32 already), `torch.max(..., dim=-1)[0]` (values and indices; the indices die).
        let logits = if x[0].dtype == f32 {
            None
        } else {
            Some(self.alloc(Layout::contiguous(x[0].shape()), f32, m, "aten._to_copy"))
        };
        let logits_max = a(self, f32, "aten.max");
        let idx = a(self, DType::I64, "aten.max");
        self.drop_rt(idx);
        // all_reduce(MAX) and `vocab_parallel_logits -= logits_max.unsqueeze(-1)`: in place.
        // calculate_predicted_logits: `target_mask = (target < start) | (target >= end)`.
        let lt = a(self, DType::Bool, "aten.lt");
        let ge = a(self, DType::Bool, "aten.ge");
        let target_mask = a(self, DType::Bool, "aten.bitwise_or");
        self.drop_rt(ge);
        self.drop_rt(lt);
        // `masked_target = target.clone() - vocab_start_index`; `masked_target[target_mask] = 0`
        // (`masked_fill_` in place: `at::indexing::set_item`'s `try_dispatch_masked_fill_`).
        let cl = a(self, DType::I64, "aten.clone");
        let masked_target = a(self, DType::I64, "aten.sub");
        self.drop_rt(cl);
        // `arange_1d`, `logits_2d[arange_1d, masked_target_1d]`, `.clone().contiguous()`.
        let arange = a(self, DType::I64, "aten.arange");
        let picked = a(self, f32, "aten.index");
        let predicted = a(self, f32, "aten.clone");
        self.drop_rt(picked);
        // `predicted_logits[target_mask] = 0.0` (`masked_fill_`), `torch.exp(..., out=exp_logits)`
        // in place;
        // `sum_exp_logits = exp_logits.sum(dim=-1)`; two all-reduces in place.
        let sum_exp = a(self, f32, "aten.sum");
        // calculate_cross_entropy_loss: `torch.log(sum_exp_logits) - predicted_logits`, then
        // `exp_logits.div_(...)` in place.
        let log = a(self, f32, "aten.log");
        let loss = a(self, f32, "aten.sub");
        self.drop_rt(log);
        for t in [logits_max, arange, predicted, sum_exp] {
            self.drop_rt(t);
        }
        let softmax = match logits {
            Some(l) => Save::Extra(l),
            None => Save::In(0),
        };
        Fwd::New(
            vec![loss],
            NodeKind::Op(OpKind::VocabParallelCrossEntropy),
            vec![
                softmax,
                Save::Extra(target_mask),
                Save::Extra(masked_target),
            ],
        )
    }

    /// `_VocabParallelCrossEntropy.backward` of node `n`: the gradient is the saved softmax,
    /// updated in place (`grad_input = softmax`, `grad_2d[arange_1d, masked_target_1d] -=
    /// softmax_update`, `grad_input.mul_(grad_output.unsqueeze(-1))`).
    pub(super) fn vocab_ce_bwd(&mut self, n: u32, m: ModuleId) -> Option<Rt> {
        let softmax = self.nodes[n as usize].saved.first()?.clone();
        let rows = [softmax.shape().first().copied().unwrap_or(0)];
        let a = |s: &mut Self, d: DType, op: &str| s.alloc(Layout::contiguous(&rows), d, m, op);
        let arange = a(self, DType::I64, "aten.arange");
        // `softmax_update = 1.0 - target_mask.view(-1).float()`.
        let fl = a(self, DType::F32, "aten._to_copy");
        let update = a(self, DType::F32, "aten.rsub");
        self.drop_rt(fl);
        // `grad_2d[arange_1d, masked_target_1d] -= softmax_update`: index, `-=` on the copy,
        // index_put_ back.
        let picked = a(self, DType::F32, "aten.index");
        self.drop_rt(picked);
        self.drop_rt(arange);
        self.drop_rt(update);
        Some(self.dup(&softmax))
    }
}
