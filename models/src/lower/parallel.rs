//! The data-parallel mechanisms of one rank's step (`Recipe::parallel`): what
//! `DistributedDataParallel`'s `Reducer` and DeepSpeed's ZeRO-1/2 optimizer allocate, and when.
//! Every data-parallel rank plays the same role (same shapes, equal padded partitions), so the
//! lowering writes rank 0's trace.
//!
//! Collectives: PyTorch 2.15's `ProcessGroupNCCL` runs `async_op=True` collectives on its side
//! stream and keeps their tensors alive by stashing references until `wait()` (PRs #148590,
//! #150398); PyTorch ≤ 2.7 (here `--torch-version 1.10`) instead called `recordStream(nccl_stream)`
//! on them, which the trace writes as a `record_stream` event on [`NCCL_STREAM`].

use super::{Kind, Lowering, Rt};
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::layout::Layout;
use crate::parallel::{
    bucket_assignment, Shard, DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES,
    DS_REDUCE_BUCKET_ELEMENTS,
};
use crate::recipe::{OptimizerImpl, OptimizerKind, Precision, TorchVersion};
use vramsim_traces::Event;

/// The stream id the trace gives the process group's NCCL stream.
pub(crate) const NCCL_STREAM: u64 = 1;

/// One DDP bucket: its parameters, its flat `gradients` tensor, gradients still pending.
struct Bucket {
    params: Vec<usize>,
    grads: Rt,
    pending: usize,
}

/// One `DistributedDataParallel` module of the rank.
struct DdpModule {
    /// Its pipeline stage, under a pipeline.
    stage: Option<u32>,
    /// Its trainable parameters (what the Reducer buckets), in registration order.
    params: Vec<usize>,
    /// Its module states: every parameter, then every buffer (what `_sync_module_states` broadcasts).
    states: Vec<Rt>,
}

/// One `DistributedDataParallel` module's `Reducer`: the whole model's, or under an interleaved
/// pipeline each of the rank's stage modules' (torchtitan wraps every model part).
#[derive(Default)]
struct Reducer {
    /// The pipeline stage whose module it reduces (`None`: the rank's whole model).
    stage: Option<u32>,
    /// Its trainable parameters, in registration order.
    params: Vec<usize>,
    /// Its buckets, in reduction order.
    buckets: Vec<Bucket>,
    /// The next bucket to all-reduce (`next_bucket_`).
    next_bucket: usize,
    /// Parameters in the order their gradients became ready in the first backward that ran its
    /// hooks (`rebuilt_params_`).
    ready_order: Vec<usize>,
    /// The buckets were rebuilt (`has_rebuilt_bucket_`).
    rebuilt: bool,
    /// It expects no autograd hooks (`expect_autograd_hooks_` false): a pipeline stage's backward
    /// under `no_sync()` (`stage.py` `backward_maybe_with_nosync`).
    no_sync: bool,
}

/// Parallel state of the lowering.
#[derive(Default)]
pub(crate) struct ParState {
    /// DDP: the Reducers (one per DDP module).
    reducers: Vec<Reducer>,
    /// DDP: the Reducer of each parameter.
    reducer_of: Vec<Option<usize>>,
    /// ZeRO: `bit16_groups_flat`, the flat padded bf16 parameters.
    pub(super) flat: Option<Rt>,
    /// ZeRO: elements of one partition (`partition_size`).
    pub(super) partition: u64,
    /// ZeRO: `single_partition_of_fp32_groups`.
    master: Option<Rt>,
    /// ZeRO: the optimizer state of the partition.
    state: Vec<Rt>,
    /// ZeRO: the IPG buffer of the running backward and its used elements.
    ipg: Option<Rt>,
    ipg_used: u64,
    /// ZeRO: `grads_in_partition`.
    grads_partition: Option<Rt>,
    /// ZeRO: the parameters whose gradients the running IPG bucket holds (`bucket.params`).
    ipg_params: Vec<usize>,
    /// ZeRO-Offload: the elements of each parameter in this rank's partition (0: not in it).
    pub(super) owned: Vec<u64>,
    /// ZeRO-Offload: `temp_grad_buffer_for_gpu_offload`.
    pub(super) staging: Option<Rt>,
    /// ZeRO-Offload: `norm_for_param_grads`, one 0-d fp64 norm per parameter in the partition.
    pub(super) norms: Vec<Rt>,
    /// `zero1-torch`: whether this rank's `ZeroRedundancyOptimizer` steps each parameter.
    pub(super) zr_owned: Vec<bool>,
}

impl<'g> Lowering<'g> {
    fn shard(&self) -> Shard {
        self.r.parallel.shard
    }

    /// Trainable parameters that take part in the step, in registration order.
    pub(super) fn trainable(&self) -> Vec<usize> {
        (0..self.params.len())
            .filter(|&p| self.g.params[p].trainable)
            .collect()
    }

    /// Whether DeepSpeed's `.to(master_weights_and_grads_dtype)` (fp32) of a tensor in the
    /// parameters' dtype copies: not in its fp32 mode (no bf16/fp16 section, `engine.py`
    /// `_configure_distributed_model` leaves the module fp32), where `Tensor.to` of an fp32
    /// tensor to fp32 returns the tensor itself (`stage_1_and_2.py` `weights_partition`, the
    /// step's `single_grad_partition`; `stage3.py` `_create_fp32_partitions` takes the fp32
    /// partition itself as the master, `_prepare_fp32_grad_for_sub_group`).
    pub(super) fn ds_upcasts(&self) -> bool {
        self.param_dtype != DType::F32
    }

    /// Whether `DeepSpeedZeroOptimizer.step` (stages 1/2) runs its overflow check: `if
    /// self.check_grad_overflow: self.check_overflow(...)` (`stage_1_and_2.py` `step`), with
    /// `check_grad_overflow` from `engine.py` `_configure_zero_optimizer`: the bf16 section's
    /// `check_grad_overflow` in bf16 mode, True in fp16 mode, False otherwise (fp32 mode).
    /// `DeepSpeedBF16Config.check_grad_overflow` (`precision_config.py`) defaults to True since
    /// DeepSpeed 0.19.3 (#8035, "Enable bf16 check_grad_overflow by default (matching fp16)";
    /// read at edaa722, 0.19.6), so the default bf16 config checks as fp16 does. Stage 3 is not
    /// given the flag: it checks only `if self.dtype == torch.float16` (`stage3.py`
    /// `_overflow_check_and_loss_scale_update`), see `zero3_step`.
    pub(super) fn ds_checks_grad_overflow(&self) -> bool {
        matches!(self.r.precision, Precision::Bf16 | Precision::Fp16)
    }

    /// `_has_inf_or_nan(x)` of an `n`-element 16-bit gradient (`stage_1_and_2.py`): `float_x =
    /// x.float()` (`x` itself in fp32 mode, `ds_upcasts`), `nan = float_x.isnan()`, `inf =
    /// float_x.isinf()`, `inf_or_nan = nan.logical_or(inf)`, `return inf_or_nan.float().max()`:
    /// `inf_or_nan.float()` dies with the statement, the locals at the return, the result once
    /// the caller has added or tested it.
    pub(super) fn ds_has_inf_or_nan(&mut self, n: u64) {
        let s = [n];
        let temp = |me: &mut Self, s: &[u64], dtype: DType, op: &str, tag: &str| {
            let t = me.alloc(Layout::contiguous(s), dtype, ModuleId(0), op);
            me.retag(&t, tag.into());
            t
        };
        let float_x = self.ds_upcasts().then(|| {
            temp(
                self,
                &s,
                DType::F32,
                "aten._to_copy",
                "_has_inf_or_nan:float_x",
            )
        });
        let nan = temp(self, &s, DType::Bool, "aten.isnan", "_has_inf_or_nan:nan");
        let inf = temp(self, &s, DType::Bool, "aten.isinf", "_has_inf_or_nan:inf");
        let inf_or_nan = temp(
            self,
            &s,
            DType::Bool,
            "aten.logical_or",
            "_has_inf_or_nan:inf_or_nan",
        );
        let as_float = temp(
            self,
            &s,
            DType::F32,
            "aten._to_copy",
            "_has_inf_or_nan:float",
        );
        let max = temp(self, &[], DType::F32, "aten.max", "_has_inf_or_nan:max");
        self.drop_rt(as_float);
        for t in float_x.into_iter().chain([nan, inf, inf_or_nan, max]) {
            self.drop_rt(t);
        }
    }

    /// A ZeRO step's flattened gradient partition of `elems` elements in fp32: the flatten
    /// (`torch.cat`, in the model's dtype), then its `.to(fp32)` copy, the flat one freed — itself in
    /// DeepSpeed's fp32 mode ([`Lowering::ds_upcasts`]).
    pub(super) fn ds_fp32_flat_grad(&mut self, elems: u64) -> Rt {
        let flat = self.alloc(
            Layout::contiguous(&[elems]),
            self.param_dtype,
            ModuleId(0),
            "aten.cat",
        );
        if !self.ds_upcasts() {
            return flat;
        }
        let fp32 = self.alloc(
            Layout::contiguous(&[elems]),
            DType::F32,
            ModuleId(0),
            "aten._to_copy",
        );
        self.drop_rt(flat);
        fp32
    }

    pub(super) fn comm_alloc(&mut self, elems: u64, dtype: DType, tag: String) -> Rt {
        let prev = self.kind_now;
        self.kind_now = Kind::Comm;
        let t = self.alloc(
            Layout::contiguous(&[elems]),
            dtype,
            ModuleId(0),
            "aten.empty",
        );
        self.kind_now = prev;
        self.retag(&t, tag);
        t
    }

    /// `tensor.record_stream(nccl_stream)` in the record-stream era of `ProcessGroupNCCL`.
    pub(super) fn collective_uses(&mut self, t: &Rt) {
        if self.r.torch_version != TorchVersion::V1_10 {
            return;
        }
        if let Some(id) = self.alloc_id(t) {
            self.events.push(Event::RecordStream {
                id,
                stream: NCCL_STREAM,
            });
        }
    }

    /// After `model.to(device)`: DDP's constructor builds the Reducer's buckets; DeepSpeed's ZeRO
    /// optimizer flattens the parameters and makes the fp32 master partition and the optimizer state.
    pub(super) fn par_setup(&mut self) {
        match self.shard() {
            Shard::None | Shard::Fsdp2 | Shard::DataParallel => {}
            Shard::Zero3 => self.zero3_setup(),
            Shard::Ddp | Shard::ZeroRedundancy => {
                if self.shard() == Shard::ZeroRedundancy {
                    self.zero_redundancy_setup();
                }
                // `_ddp_init_helper`: without find_unused_parameters (and without static_graph)
                // the limits are `[sys.maxsize]`, one bucket per dtype; the Reducer gets the
                // buckets reversed ("approximate the order in which their gradients are produced").
                // One DDP module per stage of the rank, in stage order, under a pipeline.
                self.par.reducer_of = vec![None; self.params.len()];
                for DdpModule {
                    stage,
                    params: ps,
                    states,
                } in self.ddp_modules()
                {
                    // `DistributedDataParallel.__init__`: `_sync_module_states` before the
                    // Reducer is built (`_ddp_init_helper`).
                    self.ddp_sync_module_states(stage, &states);
                    let r = self.par.reducers.len();
                    for &p in &ps {
                        self.par.reducer_of[p] = Some(r);
                    }
                    // Before PyTorch 1.12 (PR #72843, "Disable DDP bucketing for the first
                    // iteration") the constructor's limits were `[_DEFAULT_FIRST_BUCKET_BYTES,
                    // bucket_bytes_cap]`, as the rebuild's are.
                    let limits: &[u64] = if self.r.torch_version == TorchVersion::V1_10 {
                        &[DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES]
                    } else {
                        &[u64::MAX]
                    };
                    let buckets = self.assign(&ps, limits, true);
                    self.par.reducers.push(Reducer {
                        stage,
                        params: ps,
                        ..Reducer::default()
                    });
                    self.make_buckets(r, buckets.into_iter().rev().collect());
                }
            }
            Shard::Zero1 | Shard::Zero2 => self.zero_setup(),
        }
    }

    /// The DDP modules of the rank: the whole model, or under a pipeline each of the rank's stages
    /// (the parameters and buffers its ops read), in stage order.
    fn ddp_modules(&self) -> Vec<DdpModule> {
        let all = self.trainable();
        let chunks = crate::pipeline::chunks(self.g);
        // `module.named_parameters()` then `module.named_buffers()`: frozen parameters too.
        let states = |read: Option<&std::collections::HashSet<u32>>| -> Vec<Rt> {
            let keep = |v: u32| read.is_none_or(|r| r.contains(&v));
            let mut out: Vec<Rt> = (0..self.params.len())
                .filter(|&p| keep(self.g.params[p].value.0))
                .map(|p| self.params[p].clone())
                .collect();
            out.extend(
                self.g
                    .buffers
                    .iter()
                    .filter(|b| keep(b.value.0))
                    .filter_map(|b| self.vals[b.value.0 as usize].clone()),
            );
            out
        };
        if chunks.len() < 2 {
            return vec![DdpModule {
                stage: chunks.first().map(|c| c.stage),
                params: all,
                states: states(None),
            }];
        }
        chunks
            .iter()
            .map(|c| {
                let read: std::collections::HashSet<u32> = self.g.ops[c.start..c.end]
                    .iter()
                    .flat_map(|op| op.inputs.iter().map(|v| v.0))
                    .collect();
                let params = all
                    .iter()
                    .copied()
                    .filter(|&p| read.contains(&self.g.params[p].value.0))
                    .collect();
                DdpModule {
                    stage: Some(c.stage),
                    params,
                    states: states(Some(&read)),
                }
            })
            .collect()
    }

    /// `compute_bucket_assignment_by_size` over `ps` (parameter indices), as parameter lists.
    fn assign(&self, ps: &[usize], limits: &[u64], sort: bool) -> Vec<Vec<usize>> {
        let sizes: Vec<(u64, u8)> = ps
            .iter()
            .map(|&p| {
                let t = &self.params[p];
                (t.layout.numel() * t.dtype.size(), t.dtype.size() as u8)
            })
            .collect();
        bucket_assignment(&sizes, limits, sort)
            .into_iter()
            .map(|b| b.into_iter().map(|i| ps[i]).collect())
            .collect()
    }

    /// `Reducer::initialize_buckets`: `buckets_.clear()` first (the old gradients tensors die:
    /// nothing else holds them without `gradient_as_bucket_view`), then per bucket one flat
    /// `at::empty({Σ numel})` in the parameters' dtype.
    fn make_buckets(&mut self, r: usize, assignment: Vec<Vec<usize>>) {
        for b in std::mem::take(&mut self.par.reducers[r].buckets) {
            self.drop_rt(b.grads);
        }
        let interleaved = crate::pipeline::chunks_per_rank(self.r.parallel.pp_schedule) > 1;
        let prefix = match self.par.reducers[r].stage {
            Some(s) if interleaved => format!("ddp_stage{s}_bucket"),
            _ => "ddp_bucket".to_string(),
        };
        for (i, params) in assignment.into_iter().enumerate() {
            let numel: u64 = params.iter().map(|&p| self.params[p].layout.numel()).sum();
            let dtype = self.params[params[0]].dtype;
            let grads = self.comm_alloc(numel, dtype, format!("{prefix}{i}"));
            self.par.reducers[r].buckets.push(Bucket {
                pending: params.len(),
                params,
                grads,
            });
        }
        self.par.reducers[r].next_bucket = 0;
        // With gradient_as_bucket_view, `initialize_bucket_views` copies gradients that exist into
        // the new views and re-points `.grad` (the old views, and with them the old buckets, die).
        if self.r.parallel.gradient_as_bucket_view {
            for p in self.par.reducers[r].params.clone() {
                if self.param_grads[p].is_some() {
                    self.ddp_grad_to_view(p);
                }
            }
        }
    }

    /// `gradient_as_bucket_view=True`: `.grad` of `p` re-pointed to its bucket view; the gradient
    /// it held dies (`mark_variable_ready_dense`: `bucket_view.copy_(grad); grad = bucket_view`, when
    /// the gradient is not already an alias of the view).
    fn ddp_grad_to_view(&mut self, p: usize) {
        let Some(r) = self.par.reducer_of.get(p).copied().flatten() else {
            return;
        };
        let Some(b) = self.par.reducers[r]
            .buckets
            .iter()
            .position(|b| b.params.contains(&p))
        else {
            return;
        };
        let bucket = self.par.reducers[r].buckets[b].grads.clone();
        let Some(old) = self.param_grads[p].take() else {
            return;
        };
        if old.st == bucket.st {
            self.param_grads[p] = Some(old);
            return;
        }
        let layout = self.params[p].layout.clone();
        let view = self.view(&bucket, layout);
        self.param_grads[p] = Some(view);
        self.drop_rt(old);
    }

    /// Before the model's forward: DDP's `_pre_forward` rebuilds the buckets once, after the first
    /// backward (`_rebuild_buckets` → `Reducer::rebuild_buckets`), over the parameters in
    /// gradient-ready order with limits `[1 MiB, bucket_cap]`, keeping that order.
    pub(super) fn par_pre_forward(&mut self) {
        if self.shard() == Shard::Zero3 {
            self.zero3_reset_step();
            return;
        }
        if self.shard().uses_ddp() {
            for r in 0..self.par.reducers.len() {
                self.ddp_rebuild(r);
            }
        }
    }

    /// A pipeline stage's DDP module's `_pre_forward` (under `no_sync()`, which does not keep
    /// it from rebuilding its buckets).
    pub(super) fn ddp_stage_pre_forward(&mut self, stage: u32) {
        if let Some(r) = self.ddp_reducer_of_stage(stage) {
            self.ddp_rebuild(r);
        }
    }

    /// The Reducer of a pipeline stage's DDP module.
    fn ddp_reducer_of_stage(&self, stage: u32) -> Option<usize> {
        if !self.shard().uses_ddp() {
            return None;
        }
        self.par
            .reducers
            .iter()
            .position(|r| r.stage == Some(stage))
    }

    /// `_rebuild_buckets` → `Reducer::rebuild_buckets` of Reducer `r`, once it has the order.
    fn ddp_rebuild(&mut self, r: usize) {
        let red = &mut self.par.reducers[r];
        if red.rebuilt || red.ready_order.is_empty() {
            return;
        }
        red.rebuilt = true;
        let mut order = std::mem::take(&mut red.ready_order);
        // Parameters whose gradient never came (none with find_unused_parameters=False in a model
        // that uses all of them; DDP would raise otherwise) keep registration order at the end.
        for &p in &red.params {
            if !order.contains(&p) {
                order.push(p);
            }
        }
        let buckets = self.assign(
            &order,
            &[DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES],
            false,
        );
        self.make_buckets(r, buckets);
    }

    /// After `AccumulateGrad` stored parameter `p`'s gradient: DDP's autograd hook
    /// (`mark_variable_ready_dense` copies it into its bucket view, no allocation; a bucket whose
    /// gradients are all ready is all-reduced in place, in index order); ZeRO-2's hook copies it into
    /// the IPG bucket (`reduce_independent_p_g_buckets_and_remove_grads`).
    pub(super) fn par_grad_ready(&mut self, p: usize) {
        match self.shard() {
            Shard::None | Shard::Zero1 | Shard::Fsdp2 | Shard::DataParallel => {}
            Shard::Zero3 => self.zero3_grad_ready(p),
            Shard::Ddp | Shard::ZeroRedundancy => {
                // `Reducer::autograd_hook`: `if (!expect_autograd_hooks_) return;` comes before
                // anything else (the gradient stays where AccumulateGrad put it).
                let Some(r) = self.par.reducer_of.get(p).copied().flatten() else {
                    return;
                };
                if self.par.reducers[r].no_sync {
                    return;
                }
                let red = &mut self.par.reducers[r];
                if !red.rebuilt && !red.ready_order.contains(&p) {
                    red.ready_order.push(p);
                }
                if self.r.parallel.gradient_as_bucket_view {
                    self.ddp_grad_to_view(p);
                }
                let red = &mut self.par.reducers[r];
                if let Some(b) = red.buckets.iter().position(|b| b.params.contains(&p)) {
                    red.buckets[b].pending -= 1;
                }
                loop {
                    let red = &mut self.par.reducers[r];
                    let ready = red
                        .buckets
                        .get(red.next_bucket)
                        .is_some_and(|b| b.pending == 0);
                    if !ready {
                        break;
                    }
                    let grads = red.buckets[red.next_bucket].grads.clone();
                    red.next_bucket += 1;
                    self.collective_uses(&grads);
                }
            }
            Shard::Zero2 => self.zero_ipg_add(p),
        }
    }

    /// Before `loss.backward()`: DeepSpeed's `DeepSpeedZeroOptimizer.backward` makes the IPG buffer
    /// (`contiguous_gradients`, the default, on stages 1 and 2) before running autograd.
    pub(super) fn par_pre_backward(&mut self) {
        if matches!(self.shard(), Shard::Zero1 | Shard::Zero2) {
            self.zero_ipg();
        }
    }

    /// The end of a backward: DDP's `finalize_backward` waits for the buckets and copies them back
    /// into `.grad` (in place) and re-arms the buckets; ZeRO reduces what is left (stage 1: every
    /// gradient, at the accumulation boundary) and releases its IPG buffer.
    pub(super) fn par_post_backward(&mut self, boundary: bool) {
        match self.shard() {
            Shard::None | Shard::Fsdp2 | Shard::DataParallel => {}
            Shard::Zero3 => self.zero3_post_backward(),
            Shard::Ddp | Shard::ZeroRedundancy => {
                for r in 0..self.par.reducers.len() {
                    self.ddp_finalize_backward(r);
                }
            }
            Shard::Zero1 => {
                if boundary {
                    // `reduce_gradients` without overlap_comm: every gradient through the IPG path.
                    self.phase("reduce_gradients");
                    for p in self.trainable() {
                        self.zero_ipg_add(p);
                    }
                    self.zero_ipg_reduce();
                }
                self.zero_release_ipg();
            }
            Shard::Zero2 => {
                self.zero_ipg_reduce();
                self.zero_release_ipg();
            }
        }
    }

    /// `Reducer::finalize_backward`: the buckets' all-reduces waited for and copied back into
    /// `.grad` in place; the buckets re-armed for the next backward.
    fn ddp_finalize_backward(&mut self, r: usize) {
        let red = &mut self.par.reducers[r];
        for b in &mut red.buckets {
            b.pending = b.params.len();
        }
        red.next_bucket = 0;
    }

    /// A DDP pipeline stage's `backward_one_chunk` begins (`stage.py`
    /// `backward_maybe_with_nosync`): the last micro-batch's backward calls
    /// `reducer.prepare_for_backward` (hooks expected: buckets filled and all-reduced as its
    /// gradients become ready, the first one also recording the ready order the buckets are
    /// rebuilt in); every other runs under `no_sync()`, its gradients only accumulating in
    /// `.grad`. The stage's forwards all run under `no_sync()` too (`forward_maybe_with_nosync`),
    /// which changes nothing in memory: `_pre_forward` rebuilds the buckets either way.
    pub(super) fn ddp_pp_pre_backward(&mut self, stage: u32, last: bool) {
        if let Some(r) = self.ddp_reducer_of_stage(stage) {
            self.par.reducers[r].no_sync = !last;
        }
    }

    /// A DDP pipeline stage's backward ends: after the last micro-batch's, the Reducer's
    /// `finalize_backward` (queued by its last bucket); then `no_sync()` again.
    pub(super) fn ddp_pp_post_backward(&mut self, stage: u32, last: bool) {
        if let Some(r) = self.ddp_reducer_of_stage(stage) {
            if last {
                self.ddp_finalize_backward(r);
            }
            self.par.reducers[r].no_sync = true;
        }
    }

    // ------------------------------------------------------------------ DeepSpeed ZeRO-1/2

    /// `DeepSpeedZeroOptimizer.__init__` (`stage_1_and_2.py`), one parameter group:
    ///
    /// * `flatten_dense_tensors_aligned`: the bf16 parameters copied into one flat tensor padded to a
    ///   multiple of `2 × dp` elements, then `_update_model_bit16_weights` re-points each parameter
    ///   into it (its own storage dies): the parameters live twice for a moment;
    /// * `single_partition_of_fp32_groups`: `partition.clone().float()` (a bf16 clone of the own
    ///   partition, then its fp32 copy; the clone dies);
    /// * `initialize_optimizer_states`: a zero fp32 gradient of the partition, one `optimizer.step()`
    ///   that creates the state, then the gradient is dropped.
    fn zero_setup(&mut self) {
        let n = u64::from(self.r.parallel.dp);
        let ps = self.trainable();
        let total: u64 = ps.iter().map(|&p| self.params[p].layout.numel()).sum();
        let align = 2 * n;
        let padded = total.div_ceil(align) * align;
        self.par.partition = padded / n;
        let dtype = self.param_dtype;
        let prev = self.kind_now;
        self.kind_now = Kind::Param;
        let flat = self.alloc(
            Layout::contiguous(&[padded]),
            dtype,
            ModuleId(0),
            "aten.cat",
        );
        self.kind_now = prev;
        self.retag(&flat, "bit16_groups_flat".into());
        for &p in &ps {
            let old = self.params[p].clone();
            let new = Rt {
                edge: old.edge,
                ..self.view(&flat, old.layout.clone())
            };
            let v = self.g.params[p].value.0 as usize;
            self.vals[v] = Some(new.clone());
            self.params[p] = new;
            self.drop_rt(old);
        }
        self.par.flat = Some(flat);
        if self.zero_offloads() {
            self.zero_offload_setup(&ps);
            self.kind_now = prev;
            return;
        }
        let part = self.par.partition;
        // `weights_partition = partition.detach().clone().to(dtype=master_weights_and_grads_dtype)`:
        // in DeepSpeed's fp32 mode (`ds_upcasts` false) the `.to` returns the clone itself, the
        // master; otherwise the 16-bit clone dies once converted.
        let upcasts = self.ds_upcasts();
        self.kind_now = if upcasts {
            Kind::Temporary
        } else {
            Kind::OptimState
        };
        let clone = self.alloc(
            Layout::contiguous(&[part]),
            dtype,
            ModuleId(0),
            "aten.clone",
        );
        let master = if upcasts {
            self.kind_now = Kind::OptimState;
            let master = self.alloc(
                Layout::contiguous(&[part]),
                DType::F32,
                ModuleId(0),
                "aten._to_copy",
            );
            self.drop_rt(clone);
            master
        } else {
            clone
        };
        self.mark_state(&master);
        self.retag(&master, "single_partition_of_fp32_groups".into());
        self.par.master = Some(master);
        self.kind_now = Kind::Temporary;
        let grad = self.alloc(
            Layout::contiguous(&[part]),
            DType::F32,
            ModuleId(0),
            "aten.zeros",
        );
        self.zero_optimizer_step();
        self.drop_rt(grad);
        self.kind_now = prev;
    }

    /// `self.optimizer.step()` of the wrapped torch optimizer on the one fp32 partition tensor:
    /// the state at its first step (`exp_avg`, `exp_avg_sq`; a momentum buffer) and the
    /// implementation's temporaries (foreach `_foreach_sqrt`, for-loop `sqrt` and `div`), as
    /// `optim.rs` does for a parameter of that size.
    fn zero_optimizer_step(&mut self) {
        let part = self.par.partition;
        let first = self.par.state.is_empty();
        let state = self.ds_optimizer_step(part, first);
        self.par.state.extend(state);
    }

    /// The wrapped torch optimizer's step on one flat fp32 tensor of `part` elements (DeepSpeed's
    /// partition or sub-group): the state it creates at its `first` step (returned), then the
    /// implementation's temporaries.
    pub(super) fn ds_optimizer_step(&mut self, part: u64, first: bool) -> Vec<Rt> {
        let s = [part];
        let mut state = Vec::new();
        match self.r.optimizer {
            OptimizerKind::Adam | OptimizerKind::AdamW => {
                if first {
                    self.kind_now = Kind::OptimState;
                    if self.r.optimizer_impl == OptimizerImpl::Fused {
                        let st = self.alloc(
                            Layout::contiguous(&[]),
                            DType::F32,
                            ModuleId(0),
                            "aten.zeros",
                        );
                        self.mark_state(&st);
                        state.push(st);
                    }
                    for name in ["exp_avg", "exp_avg_sq"] {
                        let t = self.alloc(
                            Layout::contiguous(&s),
                            DType::F32,
                            ModuleId(0),
                            "aten.zeros_like",
                        );
                        self.mark_state(&t);
                        self.retag(&t, format!("{name}:fp32_partition"));
                        state.push(t);
                    }
                    self.kind_now = Kind::Temporary;
                }
                let wd = self.r.optimizer == OptimizerKind::Adam && self.adam_weight_decay() != 0.0;
                match self.r.optimizer_impl {
                    OptimizerImpl::Fused => {}
                    OptimizerImpl::Foreach => {
                        if wd {
                            let t = self.alloc(
                                Layout::contiguous(&s),
                                DType::F32,
                                ModuleId(0),
                                "aten._foreach_add",
                            );
                            self.drop_rt(t);
                        }
                        let t = self.alloc(
                            Layout::contiguous(&s),
                            DType::F32,
                            ModuleId(0),
                            "aten._foreach_sqrt",
                        );
                        self.drop_rt(t);
                    }
                    OptimizerImpl::ForLoop => {
                        let g2 = wd.then(|| {
                            self.alloc(Layout::contiguous(&s), DType::F32, ModuleId(0), "aten.add")
                        });
                        let sq = self.alloc(
                            Layout::contiguous(&s),
                            DType::F32,
                            ModuleId(0),
                            "aten.sqrt",
                        );
                        let dv =
                            self.alloc(Layout::contiguous(&s), DType::F32, ModuleId(0), "aten.div");
                        self.drop_rt(sq);
                        self.drop_rt(dv);
                        if let Some(g2) = g2 {
                            self.drop_rt(g2);
                        }
                    }
                }
            }
            OptimizerKind::SgdMomentum | OptimizerKind::SgdNesterov => {
                if first {
                    self.kind_now = Kind::OptimState;
                    let t = self.alloc(
                        Layout::contiguous(&s),
                        DType::F32,
                        ModuleId(0),
                        "aten.clone",
                    );
                    self.mark_state(&t);
                    self.retag(&t, "momentum_buffer:fp32_partition".into());
                    state.push(t);
                    self.kind_now = Kind::Temporary;
                }
                if self.r.optimizer == OptimizerKind::SgdNesterov
                    && self.r.optimizer_impl != OptimizerImpl::Fused
                {
                    let t = self.alloc(Layout::contiguous(&s), DType::F32, ModuleId(0), "aten.add");
                    self.drop_rt(t);
                }
            }
            // `Parallel::validate` refuses the others with ZeRO.
            _ => {}
        }
        state
    }

    // ------------------------------------------------------------------ ZeroRedundancyOptimizer

    /// `ZeroRedundancyOptimizer(params, optimizer_class)` over a DDP model: the parameters this
    /// rank's local optimizer holds (`_partition_parameters`, greedy by numel), for the rank with
    /// the most of them (`zero_redundancy_worst_rank`: the most optimizer state). `params` are the
    /// trainable ones (every parameter without fine-tuning; under it the optimizer is given those
    /// that require grad, as for one GPU), so frozen parameters are in no rank's partition.
    fn zero_redundancy_setup(&mut self) {
        let ps = self.trainable();
        let numels: Vec<u64> = ps.iter().map(|&p| self.params[p].layout.numel()).collect();
        let world = self.r.parallel.dp;
        let rank = crate::parallel::zero_redundancy_worst_rank(&numels, world);
        let ranks = crate::parallel::zero_redundancy_partition(&numels, world);
        self.par.zr_owned = vec![false; self.params.len()];
        for (&p, r) in ps.iter().zip(ranks) {
            self.par.zr_owned[p] = r == rank;
        }
    }

    /// Whether this rank's optimizer steps parameter `p` (every parameter but under `zero1-torch`).
    pub(super) fn steps_param(&self, p: usize) -> bool {
        self.par.zr_owned.get(p).copied().unwrap_or(true)
    }

    /// After the local step, `ZeroRedundancyOptimizer._sync_params` broadcasts every parameter
    /// from its owner, in place (`_broadcast_params_from_rank`, one `dist.broadcast` per parameter
    /// with `parameters_as_bucket_view=False`): no allocation; the record-stream era marks each on
    /// the NCCL stream.
    pub(super) fn zero_redundancy_sync(&mut self) {
        if self.shard() != Shard::ZeroRedundancy {
            return;
        }
        // `_sync_params` broadcasts the optimizer's parameters (`_all_params`): the trainable ones.
        for p in self.trainable() {
            let t = self.params[p].clone();
            self.collective_uses(&t);
        }
    }

    /// The IPG buffer of a backward (`DeepSpeedZeroOptimizer.backward` with `contiguous_gradients`:
    /// `torch.empty(reduce_bucket_size)` in the parameters' dtype, one without `overlap_comm`).
    fn zero_ipg(&mut self) -> Rt {
        if self.par.ipg.is_none() {
            let t = self.comm_alloc(
                DS_REDUCE_BUCKET_ELEMENTS,
                self.param_dtype,
                "ipg_buffer".into(),
            );
            self.par.ipg = Some(t);
            self.par.ipg_used = 0;
        }
        self.par.ipg.clone().expect("made above")
    }

    /// `reduce_independent_p_g_buckets_and_remove_grads`: when the gradient does not fit in the
    /// bucket, the bucket is reduced first; the gradient is copied into the bucket and `.grad`
    /// re-pointed there, so its own storage dies.
    fn zero_ipg_add(&mut self, p: usize) {
        let Some(g) = self.param_grads[p].take() else {
            return;
        };
        let numel = g.layout.numel();
        if numel > DS_REDUCE_BUCKET_ELEMENTS {
            // An extra-large parameter bypasses the bucket (`extra_large_param_to_reduce`).
            if self.zero_offloads() {
                self.zero_offload_copy_grad(p);
            } else {
                self.zero_reduce_owned(numel);
            }
            self.drop_rt(g);
            return;
        }
        self.zero_ipg();
        if self.par.ipg_used + numel > DS_REDUCE_BUCKET_ELEMENTS {
            self.zero_ipg_reduce();
        }
        self.par.ipg_used += numel;
        self.par.ipg_params.push(p);
        self.drop_rt(g);
    }

    /// `reduce_ipg_grads` with `contiguous_gradients` and `reduce_scatter` (defaults): the bucket
    /// is reduced in place (`average_tensor`), and the rank's own part copied into
    /// `grads_in_partition` (`copy_grads_in_partition`, allocated at its first use: one flat buffer of
    /// the partition in the parameters' dtype).
    fn zero_ipg_reduce(&mut self) {
        if self.par.ipg_used == 0 {
            return;
        }
        if let Some(ipg) = self.par.ipg.clone() {
            self.collective_uses(&ipg);
        }
        let used = self.par.ipg_used;
        let params = std::mem::take(&mut self.par.ipg_params);
        if self.zero_offloads() {
            // `copy_grads_in_partition` per parameter of the bucket, in bucket order.
            for p in params {
                self.zero_offload_copy_grad(p);
            }
        } else {
            self.zero_reduce_owned(used);
        }
        self.par.ipg_used = 0;
    }

    fn zero_reduce_owned(&mut self, _elements: u64) {
        if self.par.grads_partition.is_none() {
            let part = self.par.partition;
            let prev = self.kind_now;
            self.kind_now = Kind::Temporary;
            let t = self.alloc(
                Layout::contiguous(&[part]),
                self.param_dtype,
                ModuleId(0),
                "aten.empty",
            );
            self.kind_now = prev;
            self.mark_grad(&t);
            self.retag(&t, "grads_in_partition".into());
            self.par.grads_partition = Some(t);
        }
    }

    /// `_release_ipg_buffers`: `self.ipg_buffer = None` at the end of the backward.
    fn zero_release_ipg(&mut self) {
        if let Some(t) = self.par.ipg.take() {
            self.drop_rt(t);
        }
        self.par.ipg_used = 0;
        self.par.ipg_params.clear();
    }

    /// The overflow check, first thing in `DeepSpeedZeroOptimizer.step` when
    /// [`ds_checks_grad_overflow`](Self::ds_checks_grad_overflow) (bf16 and fp16 modes):
    /// `has_overflow` → `has_overflow_partitioned_grads_serial`, a `torch.zeros([1], float)`
    /// counter, then for each gradient piece of the partition (`averaged_gradients[i]`: rank 0's
    /// piece of every parameter in `[0, partition)`) `_has_inf_or_nan` (`ds_has_inf_or_nan`, its
    /// result dropped after `+=`); the counter's `.bool()` (the counter dies), `.byte()`,
    /// all-reduced (MAX), freed at return. The loss scaler itself holds Python floats only
    /// (`fp16/loss_scaler.py`: `cur_scale`), and `scale_loss` is `loss * self.loss_scale` in bf16
    /// mode too (scale 1.0).
    fn zero_overflow_check(&mut self) {
        let part = self.par.partition;
        let mut pieces = Vec::new();
        let mut start = 0u64;
        for p in self.trainable() {
            let end = start + self.params[p].layout.numel();
            let n = end.min(part).saturating_sub(start.min(part));
            if n > 0 {
                pieces.push(n);
            }
            start = end;
        }
        let scalar = |me: &mut Self, dtype: DType, op: &str, tag: &str| {
            let t = me.alloc(Layout::contiguous(&[1]), dtype, ModuleId(0), op);
            me.retag(&t, tag.into());
            t
        };
        let count = scalar(
            self,
            DType::F32,
            "aten.zeros",
            "has_overflow_partitioned_grads_serial:invalid_grad_count",
        );
        for n in pieces {
            self.ds_has_inf_or_nan(n);
        }
        let flag = scalar(
            self,
            DType::Bool,
            "aten._to_copy",
            "has_overflow_partitioned_grads_serial:bool",
        );
        self.drop_rt(count);
        let byte = scalar(
            self,
            DType::U8,
            "aten._to_copy",
            "has_overflow:overflow_gpu",
        );
        self.collective_uses(&byte);
        self.drop_rt(flag);
        self.drop_rt(byte);
    }

    /// `DeepSpeedZeroOptimizer.step` (bf16 or fp16; with `offload_optimizer`, `offload.rs`): the partition's gradient flattened
    /// (`flatten_dense_tensors_aligned` of the averaged gradients: a new bf16 tensor of the
    /// partition), converted `.to(fp32)` and set as the master's `.grad` (the bf16 copy and
    /// `grads_in_partition` go), the wrapped optimizer's step, the fp32 gradient dropped, the master
    /// copied into the bf16 partition and all-gathered in place into `bit16_groups_flat`.
    pub(super) fn zero_step(&mut self) {
        if self.zero_offloads() {
            self.zero_offload_step();
            return;
        }
        self.kind_now = Kind::Temporary;
        let part = self.par.partition;
        if self.ds_checks_grad_overflow() {
            self.zero_overflow_check();
        }
        // `flat_grad_partition.to(single_partition_of_fp32_groups[i].dtype)`
        let fp32 = self.ds_fp32_flat_grad(part);
        if let Some(g) = self.par.grads_partition.take() {
            self.drop_rt(g);
        }
        self.zero_optimizer_step();
        self.drop_rt(fp32);
        if let Some(f) = self.par.flat.clone() {
            self.collective_uses(&f);
        }
    }
}
