//! FSDP2 (`torch.distributed.fsdp.fully_shard`) on one rank: `fully_shard` on every block (the
//! graph's `Block` regions: transformer layers, ResNet stages' blocks) and on the root module, as
//! torchtitan and the FSDP2 tutorial apply it, with the blocks' `reshard_after_forward` of the
//! recipe (True by default; the root's is None, which lazy init turns into False), the
//! `offload_policy` of the recipe (`CPUOffloadPolicy` with `--offload params`) and the
//! `MixedPrecisionPolicy` of the recipe (`param_dtype`: the
//! unsharded parameters and the compute; `reduce_dtype`: the reduce-scatter; either `None` by
//! default: the model's dtype). Sources: `torch/distributed/fsdp/_fully_shard/`
//! (`_fsdp_param.py`, `_fsdp_param_group.py`, `_fsdp_collectives.py`, `_fsdp_state.py`), as
//! summarised in `../shared/parallel_training.md` §7.
//!
//! * **Sharded parameters** (`FSDPParam._init_sharded_param`): each parameter is chunked on dim 0,
//!   every shard padded to ⌈dim0/N⌉ rows and kept as its own 1-D tensor. The model is taken to be
//!   built on the meta device and materialised sharded (`to_empty` after `fully_shard`, torchtitan's
//!   flow), so full parameters are never allocated. Rank 0 holds the largest chunk (`torch.chunk`),
//!   so its trace is the worst data-parallel rank's.
//! * **Unshard** of a group: the flat all-gather output (Σ padded unsharded numel, on the
//!   all-gather copy-in stream), then the copy-out on the current stream: each parameter's
//!   unsharded storage re-allocated (`resize_` to its padded numel) and filled. In forward the flat
//!   output is parked (`all_gather_state`) and freed when the next group's copy-out begins (2.15's
//!   `wait_for_unshard` calls `release_all_gather_state_for_comm_reuse` before
//!   `foreach_all_gather_copy_out`), the root's post-forward dropping the last; in backward it is
//!   freed right after its own copy-out.
//! * **Reshard** (`resize_(0)` of the unsharded storages): after a block's forward (not the root's),
//!   and after each group's backward. `reshard_after_forward=False` keeps a block unsharded from
//!   its forward to its backward (its pre-backward unshard and the prefetch of it are no-ops). An
//!   int N (`FSDPParam.to_sharded_post_forward`, parameter by parameter): a clone of the rank's
//!   1/N slice of the unsharded parameter (padded numel / N, param dtype, current stream), then
//!   the unsharded storage freed; the backward all-gathers those slices over the N ranks (with a
//!   `param_dtype`, through the foreach-copy flat temporary of their size) and frees each slice
//!   after the copy-out (`to_unsharded`).
//! * **Backward prefetch**: a group's pre-backward unshards it, then issues the all-gather of the
//!   group that ran before it in forward; its copy-out waits for that group's own pre-backward.
//! * **Reduce-scatter** in a group's post-backward: the previous group's reduce-scatter input is
//!   dropped, the group resharded, the input allocated on the current stream (Σ padded unsharded
//!   numel) and filled by `chunk_cat` from the unsharded gradients, which then die; the output (the
//!   padded shards) allocated on the reduce-scatter stream is the sharded gradient (its parameters'
//!   `.grad` are views of it) until `zero_grad`. With accumulation the new output is added into the
//!   existing sharded gradient and dies. The last input dies at the end of the backward.
//! * **Mixed precision** (`_fsdp_param.py` `init_dtype_attrs`: a `param_dtype` equal to the
//!   model's is dropped): the copy-in first casts the shards into one flat temporary of the param
//!   dtype (freed once copied into the all-gather input). The unsharded gradient dtype
//!   (`unsharded_grad_dtype`: `reduce_dtype`, else the model's) is the unsharded parameter's
//!   `grad_dtype` (`init_unsharded_param`), to which the engine casts the incoming gradient; one
//!   wider than the param dtype is cleared by `pre_backward` when the group reduces this backward
//!   or a gradient exists (`_set_unsharded_grad_dtypes(defer_upcast=True)`), so the gradients stay
//!   in the param dtype then. The reduce-scatter input and output are in the reduce dtype, else
//!   the model's (`_get_reduce_dtype`; `chunk_cat` casts the gradients into the input), and an
//!   output whose dtype is not the model's is cast into a new tensor on the reduce-scatter stream,
//!   which becomes the sharded gradient. Module buffers are left in the model's dtype by FSDP2 but
//!   follow the compute dtype here.
//! * **Optimizer**: the torch optimizer steps the sharded parameters (state of the shards' sizes
//!   and dtypes).
//! * **Parameters of their own dtype** (`FSDPParam.orig_dtype` is the sharded parameter's dtype,
//!   `init_dtype_attrs`): PEFT's float32 adapters on a 16-bit model and, under FSDP-QLoRA,
//!   bitsandbytes' packed 4-bit codes in their `quant_storage` (`--quant-storage bf16`: a
//!   `[(n+1)//4, 1]` bfloat16 tensor, chunked on dim 0 and padded like any weight) keep their
//!   dtype in the shard and the unsharded parameter. A group whose all-gather inputs differ in
//!   dtype is all-gathered as bytes (`_get_all_gather_input_metadatas`: `torch.uint8` views,
//!   `foreach_all_gather`); `_init_mp_dtypes` asks a uniform dtype of the trainable parameters
//!   only, whose gradients are reduce-scattered in it (`_get_reduce_dtype`: the promotion of
//!   their `unsharded_grad_dtype`s, the original dtype without a `reduce_dtype`). The quant state
//!   (absmax, code, nested statistics) is neither parameter nor buffer of the `Linear4bit`: it
//!   stays whole on every rank (bitsandbytes `fix_4bit_weight_quant_state_from_module` hands it
//!   back to the unsharded weight in forward), as the graph's quant-state buffers are allocated.
//!   With the default uint8 storage accelerate leaves the packed codes out of `fully_shard`
//!   (`ignored_params`, [`Lowering::fsdp_ignored`]): whole on every rank.
//! * **CPU offload** (`CPUOffloadPolicy(pin_memory=True)`): the padded shards live in pinned host
//!   memory (`_init_sharded_param`), so the GPU holds no shard, no sharded gradient and no
//!   optimizer state: the optimizer steps on the CPU. Each all-gather's copy-in moves every shard
//!   to the GPU (`FSDPParam.all_gather_inputs`: `.to(device, non_blocking=True)`, one temporary per
//!   parameter in the model's dtype, then its cast to the param dtype, which replaces it; the
//!   foreach-copy fast path is off with offload), all alive until the flat all-gather output exists
//!   and freed when `foreach_all_gather` returns. The reduce-scatter output (or its cast) is copied
//!   to the host (`foreach_reduce`: `new_sharded_grad.to("cpu")`) and freed on the GPU when
//!   `foreach_reduce` returns. Shards resharded to a post-forward mesh stay on the GPU.
//! * **Under a pipeline schedule** (`--pp`): the rank's graph is its stages', each stage's blocks
//!   and root its own `fully_shard` modules (torchtitan's `apply_fsdp` on each model part; one root
//!   per stage, so `interleaved:V` gives V roots). torchtitan's `reshard_after_forward_policy`
//!   "default" is `not pp_enabled`, so the blocks keep their unsharded parameters after forward,
//!   and `_PipelineStageBase.backward_maybe_with_nosync` (`torch/distributed/pipelining/stage.py`)
//!   runs every micro-batch's backward with `set_reshard_after_backward(False)` and
//!   `set_requires_gradient_sync(False)`: `FSDPParamGroup.post_backward` then only marks the group
//!   pending, so parameters stay unsharded and the unsharded gradients accumulate over the
//!   micro-batches, in the unsharded gradient dtype (with `reduce_grads` off the `grad_dtype` of a
//!   wider one is kept for the first micro-batch, whose gradient the engine casts; the later ones
//!   are added in place). `ScheduleGPipe`/`Schedule1F1B`: each group is unsharded by its first
//!   forward; after the schedule's last action `perform_reduce_grad` → `start_gradient_reduction`
//!   turns sync back on and calls `FSDPModule.finalize_backward`, whose
//!   `FSDPState.finalize_backward` runs each pending group's `post_backward` in
//!   `reversed(all_states)` order (the blocks from the last, then the root): reshard and
//!   reduce-scatter as above; the last input dies in `_end_backward_iteration`.
//!   `_PipelineScheduleRuntime` (interleaved) drives the stages with its own actions
//!   (`schedules.py` `_add_unshard_reshard`, `_add_reduce_grad`, `_perform_action`): `UNSHARD`
//!   all-gathers every group of the stage at once (`unshard(async_op=True)`: current stream), the
//!   stage's next compute waits for them in `modules()` order (root first: copy-out, then the
//!   output freed), `RESHARD` evicts a stage (unsharded parameters freed, gradients kept; a no-op
//!   once reduced), `REDUCE_GRAD` is the stage's `finalize_backward` and `WAIT_REDUCE_GRAD` drops
//!   its last reduce-scatter input.

use super::{Kind, Lowering, Rt};
use crate::dtype::DType;
use crate::graph::{DTypeSpec, ModuleId, RegionKind};
use crate::layout::Layout;
use crate::recipe::Precision;

/// The stream id of FSDP2's all-gather copy-in stream in the trace.
const ALL_GATHER_STREAM: u64 = 2;
/// The stream id of FSDP2's reduce-scatter stream in the trace.
const REDUCE_SCATTER_STREAM: u64 = 3;

/// One `fully_shard` group.
#[derive(Default)]
struct Group {
    params: Vec<usize>,
    /// The flat all-gather output while it lives.
    flat: Option<Rt>,
    /// The unsharded parameter storages while unsharded.
    unsharded: Vec<u32>,
    /// The post-forward slices (`_sharded_post_forward_param_data`) of an int
    /// `reshard_after_forward`, while resharded to the post-forward mesh.
    post_forward: Vec<Rt>,
}

/// One `fully_shard` root of the rank (one per pipeline stage it runs: torchtitan's
/// `apply_fsdp` on each model part) and its blocks.
struct StageGroups {
    /// Global stage index (0 without a pipeline).
    stage: u32,
    /// The root's group.
    root: usize,
    /// The blocks' groups in forward order (`root.modules()` order after the root).
    blocks: Vec<usize>,
}

/// FSDP2 state of the lowering.
#[derive(Default)]
pub(crate) struct FsdpState {
    /// Groups: the blocks in forward order, then each stage's root (one, last, without a
    /// pipeline or with one stage per rank).
    groups: Vec<Group>,
    /// The rank's roots (stages) with their groups.
    stages: Vec<StageGroups>,
    /// Op index → block group.
    op_group: Vec<Option<usize>>,
    /// Module id → block group (by module path).
    module_group: Vec<Option<usize>>,
    /// Sharded parameter of each graph parameter.
    shards: Vec<Option<Rt>>,
    /// Sharded gradients (views of a reduce-scatter output), until the optimizer takes them.
    sharded_grads: Vec<Option<Rt>>,
    /// The unsharded parameter handles the forward uses (storage without events), while the
    /// optimizer runs on the shards.
    unsharded_handles: Vec<Option<Rt>>,
    /// The block whose forward or backward is running.
    current: Option<usize>,
    /// The flat output parked by the last forward copy-out.
    parked: Option<Rt>,
    /// The previous reduce-scatter input.
    rs_input: Option<Rt>,
}

impl<'g> Lowering<'g> {
    fn fsdp_on(&self) -> bool {
        self.r.parallel.shard == crate::parallel::Shard::Fsdp2
    }

    /// FSDP2 on a pipeline stage: gradient sync and reshard-after-backward off for every
    /// micro-batch, one reduce after the schedule (`stage.py` `backward_maybe_with_nosync`).
    fn fsdp_pp(&self) -> bool {
        self.fsdp_on() && self.pp_on()
    }

    /// FSDP2 with `CPUOffloadPolicy`: shards, sharded gradients and the optimizer on the host.
    pub(super) fn fsdp_offloaded(&self) -> bool {
        self.fsdp_on() && self.r.parallel.offload == crate::parallel::Offload::Params
    }

    /// The model's own dtype: the shards', the optimizer's and the sharded gradients'.
    fn fsdp_orig_dtype(&self) -> DType {
        match self.r.precision {
            Precision::Bf16 => DType::BF16,
            _ => DType::F32,
        }
    }

    /// Graph parameter `p`'s dtype when `fully_shard` runs (`FSDPParam.orig_dtype`, the sharded
    /// parameter's): its own for a parameter with one (PEFT's float32 adapters, bitsandbytes'
    /// packed codes in their `quant_storage`), else the model's.
    fn fsdp_param_orig_dtype(&self, p: usize) -> DType {
        match self.g.values[self.g.params[p].value.0 as usize].dtype {
            DTypeSpec::Fixed(d) => d,
            DTypeSpec::Model => self.fsdp_orig_dtype(),
        }
    }

    /// The unsharded gradients' accumulation dtype of `p` (`FSDPParam.unsharded_grad_dtype`:
    /// `reduce_dtype`, else the parameter's original dtype), which is also the reduce-scatter's
    /// (`FSDPParamGroup._get_reduce_dtype`: `reduce_dtype`, else the promotion of the
    /// parameters' `unsharded_grad_dtype`s, one dtype since `_init_mp_dtypes` asks the trainable
    /// parameters of a group for a uniform original dtype).
    fn fsdp_reduce_dtype(&self, p: usize) -> DType {
        self.r
            .parallel
            .fsdp_reduce_dtype
            .unwrap_or(self.fsdp_param_orig_dtype(p))
    }

    /// The dtype the engine gives graph parameter `p`'s incoming gradient before its
    /// `AccumulateGrad` (the unsharded parameter's `grad_dtype`, which the engine's
    /// `validate_outputs` casts to; `None`: any dtype, no cast). `init_unsharded_param` sets it to
    /// `unsharded_grad_dtype`; for a parameter whose `unsharded_grad_dtype` is wider than its
    /// compute dtype (`_fsdp_params_with_wider_grad_dtype`) `pre_backward` →
    /// `_set_unsharded_grad_dtypes(defer_upcast=True)` clears it when the gradient exists or
    /// the group reduces this backward, so the gradient stays in the compute dtype (added in
    /// place into a wider one). Under a pipeline (`reduce_grads` off) the first micro-batch's
    /// gradient is therefore cast to the wider dtype and accumulates there over the step.
    pub(super) fn fsdp_grad_dtype(&self, p: usize) -> Option<DType> {
        if !self.fsdp_on() || !self.params[p].dtype.is_float() {
            return None;
        }
        let target = self.fsdp_reduce_dtype(p);
        if target.size() > self.params[p].dtype.size() {
            (self.fsdp_pp() && self.param_grads[p].is_none()).then_some(target)
        } else {
            Some(target)
        }
    }

    /// `⌈dim0/N⌉` rows × the other dimensions: the padded shard of a parameter of `shape`.
    fn shard_shape(&self, shape: &[u64]) -> Vec<u64> {
        let n = u64::from(self.r.parallel.fsdp_world());
        match shape.split_first() {
            Some((d0, rest)) => {
                let mut s = vec![d0.div_ceil(n)];
                s.extend_from_slice(rest);
                s
            }
            None => vec![1],
        }
    }

    /// Whether FSDP2 shards graph parameter `p` (then `setup` allocates nothing for it): every
    /// parameter but the [`Self::fsdp_ignored`] ones.
    pub(super) fn fsdp_shards(&self, p: usize) -> bool {
        self.fsdp_on() && !self.fsdp_ignored(p)
    }

    /// A frozen bitsandbytes weight whose packed codes are not floating-point (the default uint8
    /// `quant_storage`): accelerate's `fsdp2_prepare_model` passes these Params4bit to
    /// `fully_shard` as `ignored_params` ("Default uint8 quant_storage cannot survive
    /// fully_shard's DTensor conversion", accelerate PR #3987, v1.14), so they stay whole on every
    /// rank, outside every group's all-gather, as on one GPU.
    fn fsdp_ignored(&self, p: usize) -> bool {
        let param = &self.g.params[p];
        param.logical_shape.is_some()
            && !param.trainable
            && matches!(self.g.values[param.value.0 as usize].dtype,
                DTypeSpec::Fixed(d) if !d.is_float())
    }

    /// `fully_shard(block)` for every block, then `fully_shard(model)`: the groups, and each
    /// parameter's padded shard.
    pub(super) fn fsdp_setup(&mut self) {
        if !self.fsdp_on() {
            return;
        }
        let g = self.g;
        let blocks: Vec<_> = g
            .regions
            .iter()
            .filter(|r| r.kind == RegionKind::Block)
            .collect();
        let mut op_group = vec![None; g.ops.len()];
        let mut module_group = vec![None; g.modules.len()];
        for (b, r) in blocks.iter().enumerate() {
            for slot in &mut op_group[r.start..r.end] {
                *slot = Some(b);
            }
            let path = &g.modules[r.module.0 as usize];
            for (m, p) in g.modules.iter().enumerate() {
                if p == path || p.starts_with(&format!("{path}.")) {
                    module_group[m] = Some(b);
                }
            }
        }
        // One root per stage of the rank (`apply_fsdp` on each model part); without a pipeline
        // the whole graph is one. A block, and a root parameter, belong to the stage of the
        // (first) op using them.
        let chunks = crate::pipeline::chunks(g);
        let stage_of = |op: usize| {
            chunks
                .iter()
                .position(|c| (c.start..c.end).contains(&op))
                .unwrap_or(0)
        };
        let n_roots = chunks.len().max(1);
        let root0 = blocks.len();
        let mut stages: Vec<StageGroups> = (0..n_roots)
            .map(|c| StageGroups {
                stage: chunks.get(c).map_or(0, |c| c.stage),
                root: root0 + c,
                blocks: Vec::new(),
            })
            .collect();
        for (b, r) in blocks.iter().enumerate() {
            stages[stage_of(r.start)].blocks.push(b);
        }
        // A parameter belongs to the one block all its uses are in, else to its stage's root.
        let mut groups: Vec<Group> = (0..root0 + n_roots).map(|_| Group::default()).collect();
        for (p, param) in g.params.iter().enumerate() {
            if self.fsdp_ignored(p) {
                continue;
            }
            let mut owner: Option<Option<usize>> = None;
            let mut first_use = None;
            for (i, op) in g.ops.iter().enumerate() {
                if op.inputs.contains(&param.value) {
                    first_use.get_or_insert(i);
                    owner = match owner {
                        None => Some(op_group[i]),
                        Some(o) if o == op_group[i] => Some(o),
                        Some(_) => Some(None),
                    };
                }
            }
            let root = root0 + first_use.map_or(0, stage_of);
            groups[owner.flatten().unwrap_or(root)].params.push(p);
        }
        self.fsdp.stages = stages;
        self.fsdp.groups = groups;
        self.fsdp.op_group = op_group;
        self.fsdp.module_group = module_group;
        self.fsdp.shards = vec![None; g.params.len()];
        self.fsdp.sharded_grads = vec![None; g.params.len()];
        self.fsdp.unsharded_handles = vec![None; g.params.len()];
        if self.fsdp_offloaded() {
            // The padded shards are made on the CPU and pinned (`_init_sharded_param`).
            return;
        }
        for p in 0..g.params.len() {
            if !self.fsdp_shards(p) {
                continue;
            }
            let shape = self.shard_shape(&self.params[p].layout.shape);
            let dtype = self.fsdp_param_orig_dtype(p);
            self.kind_now = Kind::Param;
            let t = self.alloc(Layout::contiguous(&shape), dtype, ModuleId(0), "aten.empty");
            self.retag(&t, format!("{}:shard", g.params[p].name));
            self.kind_now = Kind::Other;
            self.fsdp.shards[p] = Some(t);
        }
    }

    fn padded_numel(&self, p: usize) -> u64 {
        let n = u64::from(self.r.parallel.fsdp_world());
        let s = self.shard_shape(&self.params[p].layout.shape);
        s.iter().product::<u64>() * n
    }

    /// The all-gather of group `gi` (the flat output on the copy-in stream), unless unsharded or
    /// already gathered. Its inputs (`_get_param_all_gather_inputs`): the GPU shards themselves,
    /// or with a `param_dtype` one flat foreach-copy temporary of the param dtype; with offload one
    /// H2D copy per parameter (cast per parameter with a `param_dtype`); resharded to a
    /// post-forward mesh, the post-forward slices (already in the param dtype). `stream`: the
    /// all-gather streams of an implicit prefetch, or the current stream (0) of an explicit
    /// `unshard(async_op=True)` (`FSDPCommContext.get_all_gather_streams`).
    fn fsdp_all_gather(&mut self, gi: usize, stream: u64) {
        let grp = &self.fsdp.groups[gi];
        if grp.flat.is_some() || !grp.unsharded.is_empty() || grp.params.is_empty() {
            return;
        }
        let params = grp.params.clone();
        let post_forward = !grp.post_forward.is_empty();
        // `_get_all_gather_input_metadatas`: the inputs' common dtype, or bytes (`torch.uint8`
        // views of every input) when their dtypes differ.
        let dtype = self.params[params[0]].dtype;
        let (numel, dtype) = if params.iter().all(|&p| self.params[p].dtype == dtype) {
            (params.iter().map(|&p| self.padded_numel(p)).sum(), dtype)
        } else {
            let bytes = params
                .iter()
                .map(|&p| self.padded_numel(p) * self.params[p].dtype.size())
                .sum();
            (bytes, DType::U8)
        };
        // A `param_dtype` cast of some parameter (`init_dtype_attrs`: none where it equals the
        // original dtype).
        let cast = params
            .iter()
            .any(|&p| self.params[p].dtype != self.fsdp_param_orig_dtype(p));
        let prev = self.kind_now;
        self.kind_now = Kind::Temporary;
        let mut inputs = Vec::new();
        if self.fsdp_offloaded() && !post_forward {
            for &p in &params {
                let shard = self.padded_numel(p) / u64::from(self.r.parallel.fsdp_world());
                let (orig, param_dtype) = (self.fsdp_param_orig_dtype(p), self.params[p].dtype);
                let h2d = self.alloc(
                    Layout::contiguous(&[shard]),
                    orig,
                    ModuleId(0),
                    "aten._to_copy",
                );
                self.set_stream(&h2d, stream);
                let input = if param_dtype != orig {
                    let c = self.alloc(
                        Layout::contiguous(&[shard]),
                        param_dtype,
                        ModuleId(0),
                        "aten._to_copy",
                    );
                    self.set_stream(&c, stream);
                    self.drop_rt(h2d);
                    c
                } else {
                    h2d
                };
                inputs.push(input);
            }
        } else if cast && !(self.fsdp_offloaded() && post_forward) {
            // The foreach-copy fast path: one flat temporary of the inputs, in the param dtype.
            let world = if post_forward {
                self.post_forward_world()
            } else {
                u64::from(self.r.parallel.fsdp_world())
            };
            let c = self.alloc(
                Layout::contiguous(&[numel / world]),
                dtype,
                ModuleId(0),
                "aten._to_copy",
            );
            self.set_stream(&c, stream);
            inputs.push(c);
        }
        self.kind_now = Kind::Comm;
        let t = self.alloc(
            Layout::contiguous(&[numel]),
            dtype,
            ModuleId(0),
            "aten.empty",
        );
        self.kind_now = prev;
        self.retag(&t, format!("fsdp_all_gather_output:group{gi}"));
        self.set_stream(&t, stream);
        for c in inputs {
            self.drop_rt(c);
        }
        self.fsdp.groups[gi].flat = Some(t);
    }

    /// The world size of the post-forward mesh of an int `reshard_after_forward`.
    fn post_forward_world(&self) -> u64 {
        let dp = self.r.parallel.fsdp_world();
        u64::from(
            self.r
                .parallel
                .reshard_after_forward
                .post_forward_world(dp)
                .unwrap_or(dp),
        )
    }

    /// The copy-out of group `gi` (`FSDPParamGroup.wait_for_unshard`): in forward the parked
    /// output of the previous group freed first (`release_all_gather_state_for_comm_reuse`), each
    /// parameter's unsharded storage, then the flat output freed (backward) or parked (forward).
    fn fsdp_copy_out(&mut self, gi: usize, forward: bool) {
        self.fsdp_all_gather(gi, ALL_GATHER_STREAM);
        let Some(flat) = self.fsdp.groups[gi].flat.take() else {
            return;
        };
        if forward {
            if let Some(old) = self.fsdp.parked.take() {
                self.drop_rt(old);
            }
        }
        let params = self.fsdp.groups[gi].params.clone();
        for p in params {
            let bytes = self.padded_numel(p) * self.params[p].dtype.size();
            let name = self.g.params[p].name.clone();
            let st = self.alloc_raw(bytes, Kind::Param, format!("{name}:unsharded").into());
            self.fsdp.groups[gi].unsharded.push(st);
        }
        // `to_unsharded`: the post-forward slices die once copied out.
        for t in std::mem::take(&mut self.fsdp.groups[gi].post_forward) {
            self.drop_rt(t);
        }
        if forward {
            self.fsdp.parked = Some(flat);
        } else {
            self.drop_rt(flat);
        }
    }

    /// `resize_(0)` of group `gi`'s unsharded storages.
    fn fsdp_reshard(&mut self, gi: usize) {
        for st in std::mem::take(&mut self.fsdp.groups[gi].unsharded) {
            self.release(st);
        }
    }

    /// A block's post-forward `reshard()` (`FSDPParamGroup.reshard` in forward): nothing with
    /// `reshard_after_forward=False`, the full reshard with True, with an int N each parameter's
    /// 1/N slice cloned before its unsharded storage is freed (`to_sharded_post_forward`).
    fn fsdp_reshard_after_forward(&mut self, gi: usize) {
        if self.fsdp_pp() {
            // torchtitan `apply_fsdp`: `reshard_after_forward = not pp_enabled`.
            return;
        }
        let dp = self.r.parallel.fsdp_world();
        match self.r.parallel.reshard_after_forward.post_forward_world(dp) {
            None => {}
            Some(n) if n == dp => self.fsdp_reshard(gi),
            Some(n) => {
                let params = self.fsdp.groups[gi].params.clone();
                let unsharded = std::mem::take(&mut self.fsdp.groups[gi].unsharded);
                let prev = self.kind_now;
                self.kind_now = Kind::Param;
                for (p, st) in params.into_iter().zip(unsharded) {
                    let numel = self.padded_numel(p) / u64::from(n);
                    let dtype = self.params[p].dtype;
                    let t = self.alloc(
                        Layout::contiguous(&[numel]),
                        dtype,
                        ModuleId(0),
                        "aten.clone",
                    );
                    let name = &self.g.params[p].name;
                    self.retag(&t, format!("{name}:sharded_post_forward"));
                    self.fsdp.groups[gi].post_forward.push(t);
                    self.release(st);
                }
                self.kind_now = prev;
            }
        }
    }

    /// Before forward op `i`: leaving a block reshards it; entering one unshards it; the root is
    /// unsharded at the start of the forward.
    pub(super) fn fsdp_forward_op(&mut self, i: usize) {
        if !self.fsdp_on() {
            return;
        }
        let root = self.fsdp.groups.len() - 1;
        // A pipeline stage's root unshards in `fsdp_pp_pre_forward` (its ops need not start at 0).
        if i == 0 && !self.pp_on() {
            self.fsdp_copy_out(root, true);
        }
        let g = self.fsdp.op_group[i];
        if g != self.fsdp.current {
            if let Some(c) = self.fsdp.current {
                self.fsdp_reshard_after_forward(c);
            }
            if let Some(b) = g {
                self.fsdp_copy_out(b, true);
            }
            self.fsdp.current = g;
        }
    }

    /// The end of the forward: the last block resharded, the root's post-forward drops the
    /// parked all-gather output; the root stays unsharded.
    pub(super) fn fsdp_post_forward(&mut self) {
        if !self.fsdp_on() {
            return;
        }
        if let Some(c) = self.fsdp.current.take() {
            self.fsdp_reshard_after_forward(c);
        }
        if let Some(old) = self.fsdp.parked.take() {
            self.drop_rt(old);
        }
    }

    /// Before backward node `n` runs: entering a block's backward runs the previous block's
    /// post-backward and this block's pre-backward (unshard, then prefetch the block before it);
    /// leaving the blocks for root nodes runs the last block's post-backward.
    pub(super) fn fsdp_backward_node(&mut self, n: u32) {
        if !self.fsdp_on() {
            return;
        }
        let node = &self.nodes[n as usize];
        if matches!(
            node.kind,
            super::NodeKind::Accumulate(_) | super::NodeKind::Leaf(_)
        ) {
            return;
        }
        let g = self
            .fsdp
            .module_group
            .get(node.module.0 as usize)
            .copied()
            .flatten();
        if g == self.fsdp.current {
            return;
        }
        if let Some(c) = self.fsdp.current {
            // Under a pipeline `reduce_grads` is off: `post_backward` only marks the group
            // pending (`_fsdp_param_group.py`), the reduce waits for `fsdp_pp_reduce`.
            if !self.fsdp_pp() {
                self.fsdp_post_backward_group(c);
            }
        }
        if let Some(b) = g {
            self.fsdp_copy_out(b, false);
            // Under a pipeline every group of the stage is unsharded: no prefetch (and the
            // group before may be another stage's).
            if b > 0 && !self.fsdp_pp() {
                self.fsdp_all_gather(b - 1, ALL_GATHER_STREAM);
            }
        }
        self.fsdp.current = g;
    }

    /// A group's post-backward: reshard, then reduce-scatter its gradients.
    fn fsdp_post_backward_group(&mut self, gi: usize) {
        if let Some(t) = self.fsdp.rs_input.take() {
            self.drop_rt(t);
        }
        self.fsdp_reshard(gi);
        let params: Vec<usize> = self.fsdp.groups[gi]
            .params
            .iter()
            .copied()
            .filter(|&p| self.param_grads[p].is_some())
            .collect();
        if params.is_empty() {
            return;
        }
        let numel: u64 = params.iter().map(|&p| self.padded_numel(p)).sum();
        let dtype = self.fsdp_reduce_dtype(params[0]);
        let prev = self.kind_now;
        self.kind_now = Kind::Comm;
        let input = self.alloc(
            Layout::contiguous(&[numel]),
            dtype,
            ModuleId(0),
            "aten.empty",
        );
        self.retag(&input, format!("fsdp_reduce_scatter_input:group{gi}"));
        for &p in &params {
            if let Some(g) = self.param_grads[p].take() {
                self.drop_rt(g);
            }
        }
        self.kind_now = Kind::Temporary;
        let n = u64::from(self.r.parallel.fsdp_world());
        let mut out = self.alloc(
            Layout::contiguous(&[numel / n]),
            dtype,
            ModuleId(0),
            "aten.empty",
        );
        self.set_stream(&out, REDUCE_SCATTER_STREAM);
        let orig = self.fsdp_param_orig_dtype(params[0]);
        if dtype != orig {
            // `foreach_reduce`: the output cast to the parameters' dtype (a new tensor).
            let c = self.alloc(
                Layout::contiguous(&[numel / n]),
                orig,
                ModuleId(0),
                "aten._to_copy",
            );
            self.set_stream(&c, REDUCE_SCATTER_STREAM);
            let bf = std::mem::replace(&mut out, c);
            self.drop_rt(bf);
        }
        self.kind_now = prev;
        if self.fsdp_offloaded() {
            // CPUOffloadPolicy: the sharded gradients are copied to the host; the GPU output
            // dies when `foreach_reduce` returns.
            self.retag(&out, format!("fsdp_reduce_scatter_output:group{gi}"));
            self.drop_rt(out);
            self.fsdp.rs_input = Some(input);
            return;
        }
        self.mark_grad(&out);
        self.retag(&out, format!("fsdp_sharded_grads:group{gi}"));
        if params.iter().all(|&p| self.fsdp.sharded_grads[p].is_none()) {
            for &p in &params {
                let shape = self.shard_shape(&self.params[p].layout.shape);
                let v = Rt {
                    dtype: orig,
                    ..self.view(&out, Layout::contiguous(&shape))
                };
                self.fsdp.sharded_grads[p] = Some(v);
            }
        }
        // The views hold the output; accumulation adds it into the existing ones and drops it.
        self.drop_rt(out);
        self.fsdp.rs_input = Some(input);
    }

    /// The end of the backward: the last block's and the root's post-backward, then the last
    /// reduce-scatter input dies (the end-of-backward callback).
    pub(super) fn fsdp_end_backward(&mut self) {
        if !self.fsdp_on() {
            return;
        }
        if let Some(c) = self.fsdp.current.take() {
            self.fsdp_post_backward_group(c);
        }
        let root = self.fsdp.groups.len() - 1;
        self.fsdp_post_backward_group(root);
        // A prefetch whose group never ran its backward (a frozen prefix: no input of its
        // blocks requires grad, so autograd never reaches their pre-backward hooks) is a
        // "mistargeted unshard without a corresponding wait": after the groups' post-backward,
        // the root's `_root_post_backward_final_callback` → `wait_for_gradient_reduction` →
        // `_end_backward_iteration` (`_fsdp_state.py`) runs every group's
        // `FSDPParamGroup.finalize_backward`, which drops its `_all_gather_result`
        // (`_fsdp_param_group.py`), before the last reduce-scatter input is released.
        for gi in 0..self.fsdp.groups.len() {
            if let Some(t) = self.fsdp.groups[gi].flat.take() {
                self.drop_rt(t);
            }
        }
        if let Some(t) = self.fsdp.rs_input.take() {
            self.drop_rt(t);
        }
    }

    /// The groups of the rank's stage `stage` (its root and blocks), if FSDP2 runs on it.
    fn fsdp_stage(&self, stage: u32) -> Option<&StageGroups> {
        self.fsdp.stages.iter().find(|s| s.stage == stage)
    }

    /// The groups of `stage` in `stage.submod.modules()` order (its root, then its blocks), for the
    /// pipeline runtime's actions on a stage; none outside FSDP2 under `--pp`.
    fn fsdp_stage_modules(&self, stage: u32) -> Vec<usize> {
        if !self.fsdp_pp() {
            return Vec::new();
        }
        self.fsdp_stage(stage)
            .map(|st| {
                [st.root]
                    .into_iter()
                    .chain(st.blocks.iter().copied())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A pipeline stage's micro-batch forward begins: its root's pre-forward unshards it (a
    /// no-op once unsharded in the step).
    pub(super) fn fsdp_pp_pre_forward(&mut self, stage: u32) {
        if !self.fsdp_pp() {
            return;
        }
        if let Some(root) = self.fsdp_stage(stage).map(|s| s.root) {
            self.fsdp_copy_out(root, true);
        }
    }

    /// A pipeline stage's micro-batch backward ends: nothing is resharded or reduced
    /// (`set_reshard_after_backward(False)`, `set_requires_gradient_sync(False)`).
    pub(super) fn fsdp_pp_end_backward(&mut self) {
        if self.fsdp_pp() {
            self.fsdp.current = None;
        }
    }

    /// After the schedule's actions (`ScheduleGPipe`, `Schedule1F1B`), `perform_reduce_grad`
    /// of the rank's one stage.
    pub(super) fn fsdp_pp_reduce(&mut self) {
        if !self.fsdp_pp() {
            return;
        }
        let stages: Vec<u32> = self.fsdp.stages.iter().map(|s| s.stage).collect();
        for stage in stages {
            self.fsdp_reduce_stage(stage);
            self.fsdp_wait_reduce();
        }
    }

    /// `perform_reduce_grad` / `REDUCE_GRAD` of `stage` (`start_gradient_reduction` →
    /// `FSDPModule.finalize_backward` on its root): each pending group's `post_backward` in
    /// `reversed(all_states)` order (the stage's blocks from the last, then its root): reshard
    /// and reduce-scatter.
    pub(super) fn fsdp_reduce_stage(&mut self, stage: u32) {
        if !self.fsdp_pp() {
            return;
        }
        let Some(st) = self.fsdp_stage(stage) else {
            return;
        };
        let order: Vec<usize> = st.blocks.iter().rev().copied().chain([st.root]).collect();
        for gi in order {
            self.fsdp_post_backward_group(gi);
        }
    }

    /// `wait_for_gradient_reduction` (`WAIT_REDUCE_GRAD`): `_end_backward_iteration` drops the
    /// last reduce-scatter input.
    pub(super) fn fsdp_wait_reduce(&mut self) {
        if let Some(t) = self.fsdp.rs_input.take() {
            self.drop_rt(t);
        }
    }

    /// `UNSHARD` of `stage` (`_PipelineScheduleRuntime._perform_action`): `unshard(async_op=True)`
    /// of every `FSDPModule` in `stage.submod.modules()` (the root, then its blocks): each
    /// group's all-gather on the current stream, its output held until the stage's next
    /// compute action waits for it ([`Self::fsdp_assert_unsharded`]).
    pub(super) fn fsdp_unshard_stage(&mut self, stage: u32) {
        for gi in self.fsdp_stage_modules(stage) {
            self.fsdp_all_gather(gi, 0);
        }
    }

    /// `_assert_unsharded(stage)` before a compute action: each pending unshard handle waited
    /// in order (`wait_for_unshard` outside forward: the copy-out, then the all-gather output
    /// freed at once).
    pub(super) fn fsdp_assert_unsharded(&mut self, stage: u32) {
        for gi in self.fsdp_stage_modules(stage) {
            if self.fsdp.groups[gi].flat.is_some() {
                self.fsdp_copy_out(gi, false);
            }
        }
    }

    /// `RESHARD` of `stage`: `reshard()` of every `FSDPModule` of the stage (its unsharded
    /// parameters freed; the unsharded gradients stay on the parameters); a no-op for a stage
    /// whose `REDUCE_GRAD` already ran (`_finalized_stages`), which resharded it.
    pub(super) fn fsdp_reshard_stage(&mut self, stage: u32) {
        for gi in self.fsdp_stage_modules(stage) {
            self.fsdp_reshard(gi);
        }
    }

    /// Before the optimizer: the parameters are the shards and their gradients the sharded ones.
    pub(super) fn fsdp_before_step(&mut self) {
        if !self.fsdp_on() {
            return;
        }
        for p in 0..self.params.len() {
            if let Some(s) = self.fsdp.shards[p].clone() {
                let shard = Rt {
                    edge: None,
                    ..self.dup(&s)
                };
                let unsharded = std::mem::replace(&mut self.params[p], shard);
                self.fsdp.unsharded_handles[p] = Some(unsharded);
            }
            self.param_grads[p] = self.fsdp.sharded_grads[p].take();
        }
    }

    /// After `zero_grad`: the forward's parameters are the unsharded handles again.
    pub(super) fn fsdp_after_step(&mut self) {
        if !self.fsdp_on() {
            return;
        }
        for p in 0..self.params.len() {
            if let Some(u) = self.fsdp.unsharded_handles[p].take() {
                let shard = std::mem::replace(&mut self.params[p], u);
                self.drop_rt(shard);
            }
            // `zero_grad(set_to_none=False)` keeps the sharded gradients.
            if let Some(g) = self.param_grads[p].take() {
                self.fsdp.sharded_grads[p] = Some(g);
            }
        }
    }
}
