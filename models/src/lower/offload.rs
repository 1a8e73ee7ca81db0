//! DeepSpeed ZeRO-Offload on one rank (`--offload optimizer` with `--shard zero1|zero2`):
//! `DeepSpeedZeroOptimizer` with `cpu_offload` (`deepspeed/runtime/zero/stage_1_and_2.py`, read at
//! edaa722), the defaults `offload_optimizer.pin_memory=True` and `check_grad_overflow=True` (bf16; fp16
//! always checks, with the same GPU work: its loss scaler unscales the host gradients),
//! stepping with `DeepSpeedCPUAdam`. What stays on the GPU, and what the offload path adds there:
//!
//! * `bit16_groups_flat`, the flat bf16 parameters (2Ψ'), and the IPG buffer of each backward, as
//!   without offload (`lower/parallel.rs`; `contiguous_gradients` is forced on by `cpu_offload`);
//! * `__init__`: `weights_partition = bit16_partition.detach().clone().to(device='cpu',
//!   dtype=fp32)`: the clone is a GPU temporary (2Ψ'/N), the fp32 master partition and its
//!   gradient are host tensors (pinned), and so is the bf16 buffer of the step
//!   (`param_buffer_of_bit16_for_cpu_offload_groups`). `temp_grad_buffer_for_gpu_offload =
//!   torch.zeros(largest_param_numel, dtype=bf16)` on the GPU is the one persistent buffer the
//!   offload adds (its host twin is pinned host memory);
//! * `copy_grads_in_partition` at the accumulation boundary, for each parameter in the rank's
//!   partition (`grads_in_partition` is never made): `set_norm_for_param_grad_in_gpu` (the owned
//!   slice `.double()`, its `.norm(2)` kept in `norm_for_param_grads` until the step),
//!   `update_offload_overflow_tracker_for_param_grad` (`_has_inf_or_nan` of the whole gradient:
//!   `.float()`, `isnan`, `isinf`, `logical_or`, `.float().max()`), and
//!   `async_inplace_copy_grad_to_fp32_buffer_from_gpu` (the owned slice `.to(fp32)`, copied to the
//!   host). Before the boundary (accumulation) the gradients are added into host buffers through the
//!   persistent staging buffer, in place;
//! * `step`: `has_overflow` all-reduces a 1-byte `ByteTensor`, the norm a 1-element `FloatTensor`;
//!   `DeepSpeedCPUAdam` steps the host partition (no optimizer state on the GPU), the bf16 copy is
//!   copied into the flat parameters' own partition (in place), `reset_cpu_buffers` drops the norms,
//!   and the all-gather fills `bit16_groups_flat` in place.
//!
//! Gone from the GPU: the fp32 master partition (4Ψ'/N), the optimizer state (8Ψ'/N for Adam),
//! `grads_in_partition` (2Ψ'/N) and the fp32 gradient of the step (4Ψ'/N).

use super::{Kind, Lowering};
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::layout::Layout;
use crate::parallel::{Offload, Shard};

impl<'g> Lowering<'g> {
    /// Whether the ZeRO-1/2 optimizer runs with `offload_optimizer` (device cpu).
    pub(super) fn zero_offloads(&self) -> bool {
        self.r.parallel.offload == Offload::Optimizer
            && matches!(self.r.parallel.shard, Shard::Zero1 | Shard::Zero2)
    }

    /// A tensor of `elems` made by `op`, tagged with the DeepSpeed function and variable it is.
    fn offload_temp(&mut self, elems: &[u64], dtype: DType, op: &str, tag: &str) -> super::Rt {
        let t = self.alloc(Layout::contiguous(elems), dtype, ModuleId(0), op);
        self.retag(&t, tag.into());
        t
    }

    /// `DeepSpeedZeroOptimizer.__init__` with `cpu_offload`, after the flat bf16 parameters:
    /// the partition's GPU clone on its way to the host, the GPU staging buffer, and the rank's
    /// partition (`get_partition_info`; rank 0 without `round_robin_gradients`, the default: the
    /// first `partition_size` elements of the flat group, `first_offset` 0). `ps`: the trainable
    /// parameters in flattening order.
    pub(super) fn zero_offload_setup(&mut self, ps: &[usize]) {
        let part = self.par.partition;
        let prev = self.kind_now;
        self.kind_now = Kind::Temporary;
        let clone = self.offload_temp(
            &[part],
            self.param_dtype,
            "aten.clone",
            "weights_partition:clone",
        );
        self.drop_rt(clone);
        let largest = ps
            .iter()
            .map(|&p| self.params[p].layout.numel())
            .max()
            .unwrap_or(0);
        self.kind_now = Kind::Comm;
        let staging = self.offload_temp(
            &[largest],
            self.param_dtype,
            "aten.zeros",
            "temp_grad_buffer_for_gpu_offload",
        );
        self.par.staging = Some(staging);
        self.kind_now = prev;
        let mut owned = vec![0; self.params.len()];
        let mut start = 0u64;
        for &p in ps {
            let numel = self.params[p].layout.numel();
            owned[p] = part.min(start + numel).saturating_sub(start);
            start += numel;
        }
        self.par.owned = owned;
    }

    /// `copy_grads_in_partition` with `cpu_offload` for parameter `p`, after its bucket's
    /// reduction: nothing on the GPU for a parameter outside the partition or before the
    /// accumulation boundary; at the boundary the norm, the overflow check and the fp32 copy of the
    /// owned slice (module doc).
    pub(super) fn zero_offload_copy_grad(&mut self, p: usize) {
        let owned = self.par.owned.get(p).copied().unwrap_or(0);
        if owned == 0 || self.micro + 1 != self.r.accum {
            return;
        }
        let numel = self.params[p].layout.numel();
        let prev = self.kind_now;
        self.kind_now = Kind::Temporary;
        // `set_norm_for_param_grad_in_gpu`: `accumulated_grad.view(-1).narrow(0, start,
        // num_elements).data.double().norm(2)`; the fp64 copy dies, the 0-d norm is kept.
        let norm_of = "set_norm_for_param_grad_in_gpu:double";
        let double = self.offload_temp(&[owned], DType::F64, "aten._to_copy", norm_of);
        let norm = self.offload_temp(
            &[],
            DType::F64,
            "aten.linalg_vector_norm",
            "norm_for_param_grads",
        );
        self.drop_rt(double);
        self.par.norms.push(norm);
        // `update_offload_overflow_tracker_for_param_grad`: `_has_inf_or_nan` of the whole
        // gradient, whatever `check_grad_overflow` says (it gates only `step`'s `check_overflow`).
        self.ds_has_inf_or_nan(numel);
        // `async_inplace_copy_grad_to_fp32_buffer_from_gpu`: the owned slice
        // `.to(master_weights_and_grads_dtype)` (fp32; only `if src_tensor.dtype !=
        // self.master_weights_and_grads_dtype`), copied into the host fp32 gradient.
        if self.ds_upcasts() {
            let fp32 = self.offload_temp(
                &[owned],
                DType::F32,
                "aten._to_copy",
                "async_inplace_copy_grad_to_fp32_buffer_from_gpu:src_tensor",
            );
            self.drop_rt(fp32);
        }
        self.kind_now = prev;
    }

    /// `DeepSpeedZeroOptimizer.step` with `cpu_offload` (module doc).
    pub(super) fn zero_offload_step(&mut self) {
        let prev = self.kind_now;
        self.kind_now = Kind::Temporary;
        // `has_overflow`: `get_accelerator().ByteTensor([overflow])`, all-reduced, `.item()`;
        // only `if self.check_grad_overflow` (`ds_checks_grad_overflow`).
        if self.ds_checks_grad_overflow() {
            let overflow =
                self.offload_temp(&[1], DType::U8, "aten.empty", "has_overflow:overflow_gpu");
            self.collective_uses(&overflow);
            self.drop_rt(overflow);
        }
        // `complete_grad_norm_calculation_for_cpu_offload`: `FloatTensor([float(total_norm)])`,
        // all-reduced, `.item()`.
        let total = self.offload_temp(
            &[1],
            DType::F32,
            "aten.empty",
            "complete_grad_norm_calculation_for_cpu_offload:total_dev_norm",
        );
        self.collective_uses(&total);
        self.drop_rt(total);
        self.kind_now = prev;
        // `DeepSpeedCPUAdam` and the bf16 copy run on the host; `bit16_partitions[partition_id]
        // .data.copy_(bit16_partition_buffer, non_blocking=True)` writes the flat parameters.
        // `reset_cpu_buffers`: `norm_for_param_grads = {}`.
        for n in std::mem::take(&mut self.par.norms) {
            self.drop_rt(n);
        }
        if let Some(f) = self.par.flat.clone() {
            self.collective_uses(&f);
        }
    }
}
