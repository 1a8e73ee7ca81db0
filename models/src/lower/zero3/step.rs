//! ZeRO-3's gradients and step (`stage3.py`): the IPG bucket and `reduce_scatter_coalesced`,
//! `partition_grads` (with `offload_optimizer`'s copies), the gradient norm, the step per
//! sub-group and `_post_step`'s persistent all-gather. The rules are listed in the parent
//! module's doc.

use super::{Status, REDUCE_STREAM};
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::layout::Layout;
use crate::lower::{Kind, Lowering, Rt};
use crate::parallel::DS_REDUCE_BUCKET_ELEMENTS;
use vramsim_traces::Event;

impl<'g> Lowering<'g> {
    // ------------------------------------------------------------------ gradients

    /// The post-accumulate-grad hook (`reduce_independent_p_g_buckets_and_remove_grads`).
    pub(in crate::lower) fn zero3_grad_ready(&mut self, p: usize) {
        let Some(g) = self.param_grads[p].take() else {
            return;
        };
        let numel = g.layout.numel();
        let z = &self.zero3;
        if z.ipg_elements + numel > DS_REDUCE_BUCKET_ELEMENTS && z.ipg_elements > 0 {
            self.z3_reduce_ipg();
        }
        if self.zero3.ipg_elements + numel <= DS_REDUCE_BUCKET_ELEMENTS {
            // Copied into the IPG buffer on the reduce stream; `param.grad.data` re-pointed.
            if let Some(id) = self.alloc_id(&g) {
                self.events.push(Event::RecordStream {
                    id,
                    stream: REDUCE_STREAM,
                });
            }
            self.drop_rt(g);
        } else {
            self.zero3.ipg_own.push(g);
        }
        self.zero3.ipg_params.push(p);
        self.zero3.ipg_elements += numel;
    }

    /// `__reduce_and_partition_ipg_grads` (`reduce_scatter=True`): `reduce_scatter_coalesced` of
    /// the bucket's gradients, the own chunks copied into `grad_partitions_flat_buffer`.
    pub(super) fn z3_reduce_ipg(&mut self) {
        if self.zero3.ipg_params.is_empty() {
            return;
        }
        let mut ps = std::mem::take(&mut self.zero3.ipg_params);
        ps.sort_unstable();
        if let Some(ipg) = self.zero3.ipg.clone() {
            self.collective_uses(&ipg);
        }
        let n = u64::from(self.r.parallel.dp);
        let numels: Vec<u64> = ps.iter().map(|&p| self.z3_numel(p)).collect();
        let dtype = self.param_dtype;
        let prev = self.kind_now;
        self.kind_now = Kind::Comm;
        let in_place = numels.len() == 1 && numels[0].is_multiple_of(n);
        if !in_place {
            // The interleaved list: each rank's chunk of each tensor, an `empty` for the padding
            // of a short chunk; then one `torch.cat`.
            let mut pads = Vec::new();
            for r in 0..n {
                for &e in &numels {
                    let chunk = e.div_ceil(n);
                    let have = e.saturating_sub(r * chunk).min(chunk);
                    if chunk > have {
                        let t = self.alloc(
                            Layout::contiguous(&[chunk - have]),
                            dtype,
                            ModuleId(0),
                            "aten.empty",
                        );
                        self.set_stream(&t, REDUCE_STREAM);
                        pads.push(t);
                    }
                }
            }
            let total: u64 = numels.iter().map(|e| e.div_ceil(n) * n).sum();
            let cat = self.alloc(Layout::contiguous(&[total]), dtype, ModuleId(0), "aten.cat");
            self.set_stream(&cat, REDUCE_STREAM);
            self.retag(&cat, "reduce_scatter_coalesced".into());
            // The list dies when `reduce_scatter_coalesced` returns; the outputs (views of the
            // cat) when the own chunks are in `grad_partitions_flat_buffer`.
            for t in pads {
                self.drop_rt(t);
            }
            self.z3_partition_grads(&ps);
            self.drop_rt(cat);
        } else {
            self.z3_partition_grads(&ps);
        }
        self.kind_now = prev;
        for g in std::mem::take(&mut self.zero3.ipg_own) {
            self.drop_rt(g);
        }
        self.zero3.ipg_elements = 0;
    }

    /// `partition_grads` with `offload_optimizer`: the gradient partition buffer is in host
    /// memory, so each parameter's chunk is copied there and back (`grad_buffer.to(device)`: a GPU
    /// copy that the next parameter's rebinding frees); at the accumulation boundary
    /// `_offload_grad_partition_at_boundary` takes its norm (`_constant_buffered_norm2`:
    /// `.double()`) and copies `.to(fp32)` into the host fp32 gradient. On the GPU (no offload)
    /// the chunks are copied into `grad_partitions_flat_buffer` in place.
    fn z3_partition_grads(&mut self, ps: &[usize]) {
        if !self.z3_offload_optimizer() {
            return;
        }
        let boundary = self.micro + 1 == self.r.accum;
        let dtype = self.param_dtype;
        let mut copy: Option<Rt> = None;
        for &p in ps {
            if let Some(c) = copy.take() {
                self.drop_rt(c);
            }
            let elems = self.zero3.partition[p];
            let c = self.z3_temp(elems, dtype, REDUCE_STREAM, "aten._to_copy");
            if boundary {
                let d = self.z3_temp(elems, DType::F64, REDUCE_STREAM, "aten._to_copy");
                self.drop_rt(d);
                if self.ds_upcasts() {
                    let f = self.z3_temp(elems, DType::F32, REDUCE_STREAM, "aten._to_copy");
                    self.drop_rt(f);
                }
            }
            copy = Some(c);
        }
        if let Some(c) = copy {
            self.drop_rt(c);
        }
    }

    // ------------------------------------------------------------------ the step

    /// `_get_norm_groups` → `get_grad_norm_direct` (before the sub-groups are stepped): per
    /// parameter `g.double().norm(2)` (an fp64 copy of its gradient partition, dying with the
    /// expression, and a 0-dim fp64 norm kept in `grad_norms`), then
    /// `torch.sum(torch.pow(torch.stack(grad_norms), 2))`; the list dies when the function returns.
    /// The scalar bookkeeping after it (`isinf`, `isnan`, `where`, `vector_norm` of the groups) is
    /// left out.
    fn z3_grad_norm(&mut self) {
        let mut norms = Vec::new();
        for p in self.trainable() {
            let elems = self.zero3.partition[p];
            let d = self.z3_temp(elems, DType::F64, 0, "aten._to_copy");
            norms.push(self.z3_temp(1, DType::F64, 0, "aten.linalg_vector_norm"));
            self.drop_rt(d);
        }
        let k = norms.len() as u64;
        let stack = self.z3_temp(k, DType::F64, 0, "aten.stack");
        let pow = self.z3_temp(k, DType::F64, 0, "aten.pow");
        self.drop_rt(stack);
        let sum = self.z3_temp(1, DType::F64, 0, "aten.sum");
        self.drop_rt(pow);
        self.drop_rt(sum);
        for t in norms {
            self.drop_rt(t);
        }
    }

    /// DeepSpeed's fp16 mode: `_overflow_check_and_loss_scale_update` → `check_overflow` (only
    /// `if self.dtype == torch.float16`) → `has_overflow`, on `reduce_and_partition_stream`:
    /// `inf_or_nan_tracker.logical_or_(torch.isinf(grad_partitions_flat_buffer).any())` (a bool
    /// of the buffer's size, freed after `.any()`, the 1-element `any` after the in-place
    /// `logical_or_`), the same with `isnan`, then `overflow_gpu =
    /// inf_or_nan_tracker.clone().to(device).to(torch.uint8)` (the clone dies with the
    /// statement), all-reduced (MAX), freed at return. The loss scaler holds Python floats only
    /// (`fp16/loss_scaler.py`).
    fn z3_fp16_overflow_check(&mut self) {
        let total = self
            .zero3
            .grad_flat
            .as_ref()
            .map_or(0, |g| g.layout.numel());
        for (op, tag) in [
            ("aten.isinf", "has_overflow:isinf"),
            ("aten.isnan", "has_overflow:isnan"),
        ] {
            let mask = self.z3_temp(total, DType::Bool, REDUCE_STREAM, op);
            self.retag(&mask, tag.into());
            let any = self.z3_temp(1, DType::Bool, REDUCE_STREAM, "aten.any");
            self.retag(&any, "has_overflow:any".into());
            self.drop_rt(mask);
            self.drop_rt(any);
        }
        self.z3_overflow_flag("aten.clone", "has_overflow:clone");
    }

    /// [`z3_fp16_overflow_check`](Self::z3_fp16_overflow_check) with `offload_optimizer`:
    /// `self.device` is the host (`stage3.py` `__init__`), so `grad_partitions_flat_buffer`,
    /// `inf_or_nan_tracker`, the `isinf`/`isnan` masks and the tracker's `clone()` are host
    /// tensors; `.to(device)` makes the 1-byte bool on the GPU (on `reduce_and_partition_stream`)
    /// and `.to(torch.uint8)` the 1-byte `overflow_gpu` (the bool dies with the statement),
    /// all-reduced (MAX), freed at return.
    fn z3_fp16_offload_overflow_check(&mut self) {
        self.z3_overflow_flag("aten._to_copy", "has_overflow:to_device");
    }

    /// The end of `has_overflow`: the tracker's 1-byte bool on the GPU (made by `op`, tagged
    /// `tag`), its `.to(torch.uint8)` `overflow_gpu` (the bool dying with the statement),
    /// all-reduced (MAX) on `reduce_and_partition_stream`, freed at return.
    fn z3_overflow_flag(&mut self, op: &str, tag: &str) {
        let flag = self.z3_temp(1, DType::Bool, REDUCE_STREAM, op);
        self.retag(&flag, tag.into());
        let byte = self.z3_temp(1, DType::U8, REDUCE_STREAM, "aten._to_copy");
        self.retag(&byte, "has_overflow:overflow_gpu".into());
        self.drop_rt(flag);
        self.collective_uses(&byte);
        self.drop_rt(byte);
    }

    /// `DeepSpeedZeroOptimizer_Stage3.step` (bf16 or fp16, no offload).
    pub(in crate::lower) fn zero3_step(&mut self) {
        // `_partition_all_parameters` → `release_and_reset_all`.
        for p in 0..self.params.len() {
            if self.zero3.inflight[p].is_some() {
                self.z3_pop_wait(p);
            }
            self.zero3.active[p] = 0;
            self.z3_release_param(p);
        }
        self.kind_now = Kind::Temporary;
        // Only fp16 checks: `stage3.py` `_overflow_check_and_loss_scale_update` calls
        // `check_overflow` only `if self.dtype == torch.float16`, and `engine.py`
        // `_configure_zero_optimizer` passes `check_grad_overflow` (True by default in bf16,
        // `precision_config.py` `DeepSpeedBF16Config`) to the stage-1/2 optimizer only, not to
        // `DeepSpeedZeroOptimizer_Stage3`: bf16 and fp32 stage 3 make no overflow check.
        if self.r.precision == crate::recipe::Precision::Fp16 {
            if self.z3_offload_optimizer() {
                self.z3_fp16_offload_overflow_check();
            } else {
                self.z3_fp16_overflow_check();
            }
        }
        if !self.z3_offload_optimizer() {
            self.z3_grad_norm();
        }
        // With `offload_optimizer` the step runs on the host (`_prepare_sub_group` does nothing,
        // the fp32 gradients are already there) and the master is copied into the bf16
        // partitions (converted on the host, then copied).
        let groups = if self.z3_offload_optimizer() {
            0
        } else {
            self.zero3.sub_groups.len()
        };
        for i in 0..groups {
            let elems = self.zero3.sub_groups[i];
            // `_prepare_fp32_grad_for_sub_group`: `self.flatten(averaged_gradients).to(fp32)`.
            // In fp32 mode the `.to(fp32)` is the flattened gradient itself (`ds_upcasts`).
            let fp32 = self.ds_fp32_flat_grad(elems);
            let first = self.zero3.state[i].is_empty();
            let st = self.ds_optimizer_step(elems, first);
            self.zero3.state[i].extend(st);
            // `_release_sub_group`: the fp32 gradient dropped; the master copied into the bf16
            // partitions in place.
            self.drop_rt(fp32);
        }
        self.kind_now = Kind::Other;
        // `_post_step`: the persistent parameters all-gathered back, one aligned buffer each
        // (`_allgather_params_coalesced`; `_allgather_params_sequential` for a single one).
        // `persistent_parameters` are `mark_persistent_parameters`' over
        // `module.named_parameters()`: frozen ones too.
        let n = u64::from(self.r.parallel.dp);
        let persistent: Vec<usize> = (0..self.params.len())
            .filter(|&p| self.zero3.persist[p])
            .collect();
        let prev = self.kind_now;
        self.kind_now = Kind::Param;
        // One rank: `_allgather_params_coalesced` takes `_no_gather_coalesced` (a view of the
        // partition); `_allgather_params_sequential` (a single parameter) allocates anyway.
        let no_gather = n == 1 && persistent.len() > 1;
        // With `offload_param`, `local_tensors` holds each host partition's `.to(device)` (or
        // `_no_gather_coalesced` makes it the parameter) until the function returns; a frozen
        // partition on the GPU is its own `.to(device)`.
        let mut inputs = Vec::new();
        if persistent.len() > 1 {
            let host: Vec<usize> = persistent
                .iter()
                .copied()
                .filter(|&p| self.z3_on_host(p))
                .collect();
            for p in host {
                let t = self.z3_temp(
                    self.zero3.partition[p],
                    self.z3_dtype(p),
                    0,
                    "aten._to_copy",
                );
                if no_gather {
                    self.retag(&t, format!("{}:gathered", self.g.params[p].name));
                    self.zero3.data[p] = Some(t);
                } else {
                    inputs.push(t);
                }
            }
        }
        for p in persistent {
            if no_gather {
                self.zero3.status[p] = Status::Available;
                continue;
            }
            let t = self.alloc(
                Layout::contiguous(&[self.zero3.partition[p] * n]),
                self.z3_dtype(p),
                ModuleId(0),
                "aten.empty",
            );
            self.retag(&t, format!("{}:gathered", self.g.params[p].name));
            self.zero3.data[p] = Some(t);
            self.zero3.status[p] = Status::Available;
        }
        for t in inputs {
            self.drop_rt(t);
        }
        self.kind_now = prev;
    }
}
