//! ZeRO-3's setup: the submodules and their parameters, `zero.Init`'s partitions and the
//! stage-3 optimizer's buffers (`stage3.py` `__init__`, `_setup_for_real_optimizer`). The rules
//! are listed in the parent module's doc.

use super::Status;
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::layout::Layout;
use crate::lower::{Kind, Lowering, Rt};
use crate::parallel::{
    DS_PARAM_PERSISTENCE_THRESHOLD, DS_REDUCE_BUCKET_ELEMENTS, DS_SUB_GROUP_SIZE,
};
use vramsim_traces::Event;

impl<'g> Lowering<'g> {
    /// The submodules and their parameters; `zero.Init`; the stage-3 optimizer's setup.
    pub(in crate::lower) fn zero3_setup(&mut self) {
        let g = self.g;
        let n = u64::from(self.r.parallel.dp);
        // Submodules: every module (DeepSpeed hooks them all: each one's fetch is a step of the
        // trace and an occasion to prefetch, with or without parameters of its own); a module's
        // parameters are those its own ops take, frozen or not (`fetch_sub_module` gathers
        // `iter_params(module, recurse=False)`, whatever their `requires_grad`).
        let mut param_of_value = vec![None; g.values.len()];
        for (p, param) in g.params.iter().enumerate() {
            param_of_value[param.value.0 as usize] = Some(p);
        }
        let mut unit_params: Vec<Vec<usize>> = vec![Vec::new(); g.modules.len()];
        for op in &g.ops {
            for v in &op.inputs {
                let Some(p) = param_of_value[v.0 as usize] else {
                    continue;
                };
                let ps = &mut unit_params[op.module.0 as usize];
                if !ps.contains(&p) {
                    ps.push(p);
                }
            }
        }
        for ps in &mut unit_params {
            ps.sort_unstable();
        }
        // Each module's ancestors and itself, outermost (the root) first.
        let id_of_path: rustc_hash::FxHashMap<&str, usize> = g
            .modules
            .iter()
            .enumerate()
            .map(|(m, path)| (path.as_str(), m))
            .collect();
        let module_units = g
            .modules
            .iter()
            .map(|path| {
                let mut us = Vec::new();
                let mut at = path.as_str();
                loop {
                    if let Some(&m) = id_of_path.get(at) {
                        us.push(m);
                    }
                    if at.is_empty() {
                        break;
                    }
                    at = at.rsplit_once('.').map_or("", |(parent, _)| parent);
                }
                us.reverse();
                us
            })
            .collect();
        let np = g.params.len();
        let z = &mut self.zero3;
        z.unit_params = unit_params;
        z.module_units = module_units;
        z.status = vec![Status::NotAvailable; np];
        z.data = vec![None; np];
        z.inflight = vec![None; np];
        z.active = vec![0; np];
        z.most_recent = vec![i64::MIN / 2; np];
        z.partition = (0..np)
            .map(|p| g.params[p].shape.iter().product::<u64>().div_ceil(n))
            .collect();
        // `mark_persistent_parameters`: `ds_numel <= param_threshold`
        // (`stage3_model_persistence_threshold` is unbounded by default).
        z.persist = (0..np)
            .map(|p| g.params[p].shape.iter().product::<u64>() <= DS_PARAM_PERSISTENCE_THRESHOLD)
            .collect();
        // The gradient-accumulation and communication dtypes: the model's (`engine.py`
        // `get_data_types`, `communication_data_type`).
        let dtype = self.param_dtype;
        let ps = self.trainable();
        // The trainable partitions' dtype, one for all (`defragment` asserts it; the validation
        // refuses a mix): the model's, or PEFT's float32 adapters'.
        let lp_dtype = ps.first().map_or(dtype, |&p| self.z3_dtype(p));
        // `zero.Init`: each parameter, frozen or not, made whole, partitioned (`_partition_param`:
        // `torch.empty(partition_size)`, the own slice copied), and freed (`free_param`).
        let prev = self.kind_now;
        self.kind_now = Kind::Param;
        // With `offload_param` the partition is made on the host, a persistent one on the GPU
        // (`_partition_param`: `device = self.local_device if param.ds_persist`).
        let off_param = self.z3_offload_params();
        let mut parts = Vec::new();
        // A quantized model is not a `zero.Init` one (`parallel::zero3_without_init`):
        // `from_pretrained` leaves every parameter whole on each GPU, and `deepspeed.initialize`
        // then partitions them one by one (`Init(module=...)` → `_convert_to_zero_parameters` →
        // `_zero_init_param`: the partition made, the whole freed), the packed 4-bit codes in
        // their storage dtype (`_partition_param`: `torch.empty(..., dtype=param.dtype)`).
        // Before that the engine casts each floating parameter of another dtype to the training
        // dtype (`_cast_module_mixed_precision`: `p.data = p.data.to(param_dtype)`, the new
        // tensor made, the old freed): PEFT's float32 adapters, which `get_peft_model` made on
        // the base layer's device, become the graph's bf16/fp16 ones.
        let mut loaded: Vec<Option<Rt>> = vec![None; np];
        if crate::parallel::zero3_without_init(self.r) {
            let peft = self.r.lora.as_ref().and_then(|c| c.dtype);
            let cast =
                |p: usize| peft.filter(|&d| self.g.params[p].trainable && d != self.z3_dtype(p));
            let casts: Vec<Option<DType>> = (0..np).map(cast).collect();
            for (p, slot) in loaded.iter_mut().enumerate() {
                let d = casts[p].unwrap_or(self.z3_dtype(p));
                *slot = Some(self.z3_whole(p, d, "from_pretrained"));
            }
            for (p, slot) in loaded.iter_mut().enumerate() {
                if casts[p].is_some() {
                    let cast = self.z3_whole(p, self.z3_dtype(p), "_cast_module_mixed_precision");
                    if let Some(old) = slot.replace(cast) {
                        self.drop_rt(old);
                    }
                }
            }
        }
        for (p, loaded) in loaded.into_iter().enumerate() {
            let name = self.g.params[p].name.clone();
            let whole = match loaded {
                Some(w) => w,
                None => self.z3_whole(p, self.z3_dtype(p), "zero.Init"),
            };
            if !off_param || self.zero3.persist[p] {
                let part = self.alloc(
                    Layout::contiguous(&[self.zero3.partition[p]]),
                    self.z3_dtype(p),
                    ModuleId(0),
                    "aten.empty",
                );
                self.retag(&part, format!("{name}:ds_tensor"));
                if self.g.params[p].trainable {
                    parts.push(part);
                } else {
                    // A frozen parameter's partition stays where `zero.Init` made it: the
                    // optimizer flattens only `trainable_param_groups`
                    // (`_get_trainable_parameter_groups` skips `not param.requires_grad`).
                    self.zero3.frozen.push(part);
                }
            }
            self.drop_rt(whole);
        }
        // The stage-3 optimizer's `__init__`, after `initialize_ds_offload` and before the
        // partitions are flattened: `self.inf_or_nan_tracker = torch.zeros(1, dtype=torch.bool,
        // device=self.device)`, kept (`self.device` is the host with `offload_optimizer`).
        if !self.z3_offload_optimizer() {
            // the loss scaler's bookkeeping: neither optimizer state nor a gradient
            self.kind_now = Kind::Other;
            let tracker = self.alloc(
                Layout::contiguous(&[1]),
                DType::Bool,
                ModuleId(0),
                "aten.zeros",
            );
            self.retag(&tracker, "inf_or_nan_tracker".into());
            self.zero3.tracker = Some(tracker);
            self.kind_now = Kind::Param;
        }
        // `_create_fp16_partitions_with_defragmentation(self.trainable_param_groups)` →
        // `defragment(_get_parameter_partitions())` (the trainable ones): the partitions go to
        // host memory and are freed, `empty_cache()`, then come back as one flat buffer. With
        // `offload_param` they move into the host flat buffer (`_move_to_flat_buffer`) instead.
        for t in parts {
            self.drop_rt(t);
        }
        let total: u64 = ps.iter().map(|&p| self.zero3.partition[p]).sum();
        if !off_param {
            self.events.push(Event::EmptyCache);
            let flat = self.alloc(
                Layout::contiguous(&[total]),
                lp_dtype,
                ModuleId(0),
                "aten._to_copy",
            );
            self.retag(&flat, "lp_param_buffer".into());
            self.zero3.flat = Some(flat);
        }
        // `_create_fp16_sub_groups`: a sub-group closes once it reaches `sub_group_size`.
        let mut groups = Vec::new();
        let mut open = 0u64;
        if total <= DS_SUB_GROUP_SIZE {
            groups.push(total);
        } else {
            for (i, &p) in ps.iter().enumerate() {
                open += self.zero3.partition[p];
                if open >= DS_SUB_GROUP_SIZE || i + 1 == ps.len() {
                    groups.push(open);
                    open = 0;
                }
            }
        }
        // `_create_fp32_partitions`: `converted = fp16_flat.to(fp32)`, kept by the local until
        // the next sub-group's, then `converted.clone().detach()` is the master. Partitions
        // already in fp32 on the device (DeepSpeed's fp32 mode; PEFT's float32 adapters) are their
        // own master ("we don't need another copy of the weights").
        self.kind_now = Kind::OptimState;
        let off_opt = self.z3_offload_optimizer();
        let copies = !off_opt && self.ds_upcasts() && lp_dtype != DType::F32;
        let mut converted: Option<Rt> = None;
        for (i, &elems) in groups.iter().enumerate().filter(|_| copies) {
            let c = self.alloc(
                Layout::contiguous(&[elems]),
                DType::F32,
                ModuleId(0),
                "aten._to_copy",
            );
            if let Some(old) = converted.replace(c.clone()) {
                self.drop_rt(old);
            }
            let master = self.alloc(
                Layout::contiguous(&[elems]),
                DType::F32,
                ModuleId(0),
                "aten.clone",
            );
            self.mark_state(&master);
            self.retag(&master, format!("fp32_partitioned_groups_flat{i}"));
            self.zero3.master.push(master);
        }
        if let Some(c) = converted {
            self.drop_rt(c);
        }
        self.zero3.state = vec![Vec::new(); groups.len()];
        // `initialize_optimizer_states`: a zero fp32 gradient buffer of the largest sub-group,
        // dropped when the function returns.
        self.kind_now = Kind::Temporary;
        let largest = groups.iter().copied().max().unwrap_or(0);
        if !off_opt {
            let gb = self.alloc(
                Layout::contiguous(&[largest]),
                DType::F32,
                ModuleId(0),
                "aten.zeros",
            );
            self.drop_rt(gb);
        }
        self.zero3.sub_groups = groups;
        // The IPG buffer (`contiguous_gradients`), one per communication dtype, kept.
        let ipg = self.comm_alloc(DS_REDUCE_BUCKET_ELEMENTS, dtype, "ipg_buffer".into());
        self.zero3.ipg = Some(ipg);
        // `grad_partitions_flat_buffer`, zero-filled, kept (on `self.device`: the host with
        // `offload_optimizer`).
        if !off_opt {
            let gf = self.alloc(
                Layout::contiguous(&[total]),
                dtype,
                ModuleId(0),
                "aten.zeros",
            );
            self.mark_grad(&gf);
            self.retag(&gf, "grad_partitions_flat_buffer".into());
            self.zero3.grad_flat = Some(gf);
        }
        // `create_reduce_and_remove_grad_hooks`: `param.all_gather()` (one parameter:
        // `_allgather_params_sequential`, an aligned buffer) then `param.partition()`.
        self.kind_now = Kind::Param;
        for &p in &ps {
            let t = self.alloc(
                Layout::contiguous(&[self.zero3.partition[p] * n]),
                lp_dtype,
                ModuleId(0),
                "aten.empty",
            );
            if off_param {
                // `param.ds_tensor.to(device)`, the all-gather's input.
                let i = self.z3_temp(self.zero3.partition[p], lp_dtype, 0, "aten._to_copy");
                self.drop_rt(i);
            }
            self.drop_rt(t);
        }
        self.kind_now = prev;
    }

    /// Parameter `p` whole in `dtype`, tagged `{name}:{how}`.
    fn z3_whole(&mut self, p: usize, dtype: DType, how: &str) -> Rt {
        let whole = self.alloc(
            Layout::contiguous(&[self.z3_numel(p)]),
            dtype,
            ModuleId(0),
            "aten.empty",
        );
        self.retag(&whole, format!("{}:{how}", self.g.params[p].name));
        whole
    }
}
