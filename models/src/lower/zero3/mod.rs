//! DeepSpeed ZeRO stage 3 on one rank (`--shard zero3`), bf16 parameters with an fp32 master
//! partition, at DeepSpeed's defaults. Sources (deepspeedai/DeepSpeed @ edaa722):
//! `deepspeed/runtime/zero/stage3.py` (`DeepSpeedZeroOptimizer_Stage3`),
//! `partition_parameters.py` (`Init`, `_partition_param`, `all_gather_coalesced`,
//! `AllGatherCoalescedHandle`), `partitioned_param_coordinator.py`
//! (`PartitionedParameterCoordinator`), `parameter_offload.py` (`mark_persistent_parameters`),
//! `deepspeed/runtime/comm/coalesced_collectives.py` (`reduce_scatter_coalesced`),
//! `deepspeed/runtime/zero/utils.py` (`defragment`); summarised in
//! `../shared/parallel_training.md` §5.
//!
//! Every rank holds partitions of the same sizes (each parameter padded to a multiple of N
//! elements), so rank 0's trace stands for all.
//!
//! * **Construction** (`zero.Init`): each parameter is created whole, its partition
//!   (`ds_tensor`, ⌈numel/N⌉ elements) allocated and the whole tensor freed. Parameters of at most
//!   `stage3_param_persistence_threshold` (1e5) elements are *persistent* (`ds_persist`).
//! * **Optimizer setup**: `defragment` moves every partition to host memory, frees them,
//!   `empty_cache()`s and copies them back as one flat buffer (`lp_param_buffer`, 2Ψ'/N bytes);
//!   per sub-group (`sub_group_size` 1e9 elements) the fp32 master `fp16_flat.to(fp32).clone()`
//!   (the `.to()` result lives until the next sub-group's, or the function's end);
//!   `initialize_optimizer_states` zero-fills an fp32 gradient buffer of the largest sub-group
//!   and drops it (no optimizer step: Adam's state comes at the first real step); then one IPG
//!   buffer of `reduce_bucket_size` (5e8 elements, bf16: 1 GB), kept for good, and
//!   `grad_partitions_flat_buffer` (Σ partitions, the gradient-accumulation dtype: bf16 by default,
//!   `engine.get_data_types`), kept too. `create_reduce_and_remove_grad_hooks` all-gathers each
//!   parameter (one aligned buffer) and partitions it again, one at a time.
//! * **Submodules**: DeepSpeed hooks every module and fetches its direct parameters
//!   (`iter_params(module, recurse=False)`) before it runs and releases them after; every fetch,
//!   with parameters or not, is a step of the trace and an occasion to prefetch. Here a module's
//!   parameters are those its own ops take as inputs (a tied head fetches the embedding's weight,
//!   as `lm_head.weight` is the same `Parameter`); a module is entered at the first op of its
//!   subtree (ancestors first) and left at the first op outside it. In backward the
//!   autograd nodes' modules play the part of the pre- and post-backward hooks; a checkpointed
//!   region's recomputation enters and leaves its submodules as a forward does.
//! * **Fetch** (`fetch_sub_module`): the parameters not available are all-gathered on the
//!   all-gather stream (`overlap_comm`, True for stage 3): several at once through
//!   `_all_gather_coalesced` — one flat buffer of Σ⌈numel/N⌉·N elements, and at `wait()` each
//!   parameter of the handle gets its own `torch.cat` of the rank slices (allocated on the
//!   all-gather stream, under which `wait()` runs), the flat buffer dying once every parameter of
//!   the handle has left the in-flight registry (the transient 2×); one alone through
//!   `_all_gather_sequential` — one aligned buffer, the parameter a view of it.
//! * **Trace** (`reset_step` at every forward's start): the first forward and backward record the
//!   submodule order; from the second on the trace is complete, and after each fetch the
//!   coordinator prefetches the next parameters of the trace up to
//!   min(`stage3_prefetch_bucket_size` 5e7, `stage3_max_live_parameters` 1e9 − available) elements.
//! * **Release** (`release_sub_module`, `free_param`): without a complete trace every parameter
//!   the submodule used (persistent ones too); with one, the non-persistent ones not used again
//!   within `stage3_max_reuse_distance` (1e9) elements of the trace and not fetched for a later
//!   step (`__params_to_release`). A parameter in use by another active submodule stays.
//! * **Gradients** (the post-accumulate-grad hook, `__add_grad_to_ipg_bucket`): each gradient is
//!   copied into the IPG buffer on `reduce_and_partition_stream` (the autograd gradient
//!   `record_stream`ed there and dropped); when the next one does not fit, the bucket is
//!   reduce-scattered (`reduce_scatter=True`: `__avg_scatter_grads` → `reduce_scatter_coalesced`,
//!   whose interleaved, padded `torch.cat` is a new tensor of Σ⌈numel/N⌉·N elements, with an
//!   `empty` per short rank chunk, unless one divisible tensor is reduced in place) and the own
//!   chunks copied into `grad_partitions_flat_buffer` (`partition_grads`); the epilogue at the end
//!   of backward reduces the rest.
//! * **Step** (`step`): `_partition_all_parameters` releases everything gathered (persistent
//!   parameters too); the gradient norm takes an fp64 copy of each gradient partition in turn
//!   (`get_grad_norm_direct`); per sub-group the gradient partitions are flattened (bf16), converted
//!   `.to(fp32)` as the master's `.grad` (the bf16 copy dies), the torch optimizer steps (its state
//!   at the first step), the fp32 gradient dies and the master is copied into the bf16 partitions;
//!   `_post_step` all-gathers the persistent parameters back (`_allgather_params_coalesced`, one
//!   aligned buffer each, on the current stream), where they stay until the next step.
//! * **Offload** (`_configure_offloading`): `--offload optimizer` (`offload_optimizer`, device cpu)
//!   keeps the fp32 master, its gradient, the optimizer state and `grad_partitions_flat_buffer` in
//!   host memory (`self.device`), so `partition_grads` copies each chunk through a GPU copy and, at
//!   the accumulation boundary, its fp64 norm and fp32 conversion; `--offload params`
//!   (`offload_param` too) keeps the partitions in host memory, so every all-gather first copies
//!   its inputs to the GPU (`ds_tensor.to(device)`). The IPG buffer stays on the GPU.
//! * **Fine-tuning** (`--freeze`, `--lora`): `zero.Init` partitions every parameter, frozen or
//!   not, and the coordinator fetches a submodule's parameters whatever their `requires_grad`;
//!   the optimizer is built over `trainable_param_groups` (`_get_trainable_parameter_groups`), so
//!   a frozen partition stays where `zero.Init` made it, with no gradient partition, master or
//!   state. Each partition keeps its parameter's dtype (the engine casts no parameter of a
//!   `zero.Init` model: PEFT's float32 adapters stay float32, their flat group its own master,
//!   `_create_fp32_partitions`), and `_all_gather_coalesced` gathers each dtype through its own
//!   flat buffer.
//! * **QLoRA** (`--quant`, [`crate::parallel::zero3_without_init`]): transformers builds a
//!   quantized model outside `zero.Init`, so the whole model (PEFT's float32 adapters included)
//!   is on the GPU first; the engine casts the floating parameters of another dtype to the
//!   bf16/fp16 mode's (`_cast_module_mixed_precision`: the adapters, which then train as bf16/fp16
//!   partitions) and `Init(module=...)` partitions each parameter in its own dtype, bitsandbytes'
//!   packed codes in their `quant_storage` (uint8 or the compute dtype). The quant state is no
//!   parameter: the graph's buffers, whole.
//!
//! Simplified (documented in `models/README.md`): module hooks are placed at module-path
//! boundaries of the op sequence (two back-to-back calls of one module are one); a submodule
//! active in the backward keeps its parameters through a recomputation of it (DeepSpeed's
//! `ds_active_sub_modules` is a set of module ids, shared by both); the event-count throttles
//! (`__max_ongoing_fetch_events`, `max_param_reduce_events`) and the scalar bookkeeping of the
//! gradient norm are not modelled; the whole-parameter transient of `zero.Init` is per
//! parameter, not per module.

mod setup;
mod step;

use std::collections::VecDeque;

use super::{Kind, Lowering, NodeKind, Rt};
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::layout::Layout;
use crate::parallel::{
    Offload, Shard, DS_MAX_LIVE_PARAMETERS, DS_MAX_REUSE_DISTANCE, DS_PREFETCH_BUCKET_ELEMENTS,
};
use vramsim_traces::Event;

/// The trace's stream id of `DeepSpeedZeRoOffload`'s all-gather stream.
const ALL_GATHER_STREAM: u64 = 2;
/// The trace's stream id of `reduce_and_partition_stream`.
const REDUCE_STREAM: u64 = 3;

/// `ZeroParamStatus`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
enum Status {
    #[default]
    NotAvailable,
    Inflight,
    Available,
}

/// `ZeRoTraceMode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
enum Mode {
    #[default]
    Invalid,
    Record,
    Complete,
}

/// Who entered a submodule: the forward, the backward, or a recomputation during the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ctx {
    Forward,
    Backward,
    Recompute,
}

/// An all-gather handle in the in-flight registry.
struct Handle {
    /// A sequential all-gather's input copied from host memory (`offload_param`).
    input: Option<Rt>,
    /// The coalesced flat buffers, one per dtype (none for a sequential all-gather).
    flats: Vec<Rt>,
    params: Vec<usize>,
    /// Registry entries still pointing at the handle.
    registered: usize,
    /// Coalesced: `wait()` has copied every parameter out.
    complete: bool,
}

/// ZeRO-3 state of the lowering.
#[derive(Default)]
pub(crate) struct Zero3State {
    /// Each submodule's parameters (sorted: `ds_id` order).
    unit_params: Vec<Vec<usize>>,
    /// Per module id: the submodules it is inside (itself included), outermost first.
    module_units: Vec<Vec<usize>>,
    /// Per parameter: ⌈numel/N⌉.
    partition: Vec<u64>,
    persist: Vec<bool>,
    status: Vec<Status>,
    /// The gathered parameter's storage (the sequential buffer, or the `torch.cat` copy).
    data: Vec<Option<Rt>>,
    inflight: Vec<Option<usize>>,
    handles: Vec<Handle>,
    /// Per parameter: active submodules using it (`ds_active_sub_modules`).
    active: Vec<u32>,
    ctx_forward: Vec<usize>,
    ctx_backward: Vec<usize>,
    ctx_recompute: Vec<usize>,
    mode: Mode,
    /// The recorded submodule order.
    order: Vec<usize>,
    /// (parameter, step) of the complete trace (`__param_order`).
    param_order: Vec<(usize, usize)>,
    queue: VecDeque<(usize, usize)>,
    most_recent: Vec<i64>,
    step: usize,
    n_available: i64,
    /// `lp_param_buffer`.
    flat: Option<Rt>,
    /// The frozen parameters' partitions on the GPU, where `zero.Init` left them.
    frozen: Vec<Rt>,
    /// Elements of each sub-group's partitions.
    sub_groups: Vec<u64>,
    master: Vec<Rt>,
    state: Vec<Vec<Rt>>,
    ipg: Option<Rt>,
    ipg_elements: u64,
    ipg_params: Vec<usize>,
    /// Gradients too large for the IPG buffer, kept as they are until reduced.
    ipg_own: Vec<Rt>,
    grad_flat: Option<Rt>,
    /// The optimizer's `inf_or_nan_tracker`, on the GPU unless the optimizer is offloaded.
    tracker: Option<Rt>,
}

impl<'g> Lowering<'g> {
    /// Whether the layout is ZeRO-3.
    pub(super) fn zero3_on(&self) -> bool {
        self.r.parallel.shard == Shard::Zero3
    }

    /// `offload_optimizer`: the fp32 master, its gradient, the optimizer state and
    /// `grad_partitions_flat_buffer` live in host memory (`self.device = cpu`).
    fn z3_offload_optimizer(&self) -> bool {
        self.r.parallel.offload != Offload::None
    }

    /// `offload_param`: the partitions live in host memory (persistent ones too, once the
    /// optimizer moves them into its host flat buffer).
    fn z3_offload_params(&self) -> bool {
        self.r.parallel.offload == Offload::Params
    }

    /// Whether parameter `p`'s partition lives in host memory: with `offload_param` every
    /// trainable one (moved into the optimizer's host flat buffer, `_move_to_flat_buffer`) and
    /// every non-persistent one (`_partition_param` makes it on the host); a frozen persistent
    /// partition stays on the GPU, where `_partition_param` made it.
    fn z3_on_host(&self, p: usize) -> bool {
        self.z3_offload_params() && (self.g.params[p].trainable || !self.zero3.persist[p])
    }

    /// A GPU temporary of `elems` elements of `dtype` on `stream` (a host tensor's `.to(device)`).
    fn z3_temp(&mut self, elems: u64, dtype: DType, stream: u64, op: &str) -> Rt {
        let prev = self.kind_now;
        self.kind_now = Kind::Temporary;
        let t = self.alloc(Layout::contiguous(&[elems]), dtype, ModuleId(0), op);
        self.kind_now = prev;
        self.set_stream(&t, stream);
        t
    }

    /// Parameter `p`'s partition dtype: the model's, or its own (PEFT's float32 adapters, which
    /// the engine does not cast in a `zero.Init` model: `engine.py`
    /// `_cast_module_mixed_precision` skips `is_zero_init_model`).
    fn z3_dtype(&self, p: usize) -> DType {
        self.params[p].dtype
    }

    fn z3_numel(&self, p: usize) -> u64 {
        self.params[p].layout.numel()
    }

    // ------------------------------------------------------------------ the coordinator

    /// `reset_step`, at the start of every forward: the in-flight registry cleaned, the trace
    /// recorded by the previous forward and backward completed (or recording started).
    pub(super) fn zero3_reset_step(&mut self) {
        self.z3_clean_inflight();
        let z = &mut self.zero3;
        match z.mode {
            Mode::Record => {
                z.param_order = z
                    .order
                    .iter()
                    .enumerate()
                    .flat_map(|(s, &u)| z.unit_params[u].iter().map(move |&p| (p, s)))
                    .collect();
                z.mode = Mode::Complete;
            }
            Mode::Invalid => {
                z.order.clear();
                z.mode = Mode::Record;
            }
            Mode::Complete => {}
        }
        z.queue = z.param_order.iter().copied().collect();
        z.most_recent.iter_mut().for_each(|m| *m = i64::MIN / 2);
        z.step = 0;
        z.n_available = 0;
    }

    /// `_clean_inflight_param_registry`: every in-flight parameter waited for and released.
    fn z3_clean_inflight(&mut self) {
        for p in 0..self.zero3.inflight.len() {
            if self.zero3.inflight[p].is_some() {
                self.z3_pop_wait(p);
                self.z3_release_param(p);
            }
        }
    }

    /// `_invalidate_trace`: a submodule out of the recorded order.
    fn z3_invalidate(&mut self) {
        let z = &mut self.zero3;
        z.mode = Mode::Invalid;
        z.order.clear();
        z.param_order.clear();
        z.queue.clear();
        self.z3_clean_inflight();
    }

    /// Before forward op `i` (or its recomputation): the submodules entered and left.
    pub(super) fn zero3_op(&mut self, i: usize) {
        if !self.zero3_on() {
            return;
        }
        let ctx = if self.in_backward {
            Ctx::Recompute
        } else {
            Ctx::Forward
        };
        let m = self.g.ops[i].module.0 as usize;
        let units = self.zero3.module_units[m].clone();
        self.z3_transition(ctx, units);
    }

    /// Before backward node `n` runs: its module's pre-backward hooks, and the post-backward
    /// hooks of the submodules the backward leaves.
    pub(super) fn zero3_backward_node(&mut self, n: u32) {
        if !self.zero3_on() {
            return;
        }
        let node = &self.nodes[n as usize];
        if matches!(node.kind, NodeKind::Accumulate(_) | NodeKind::Leaf(_)) {
            return;
        }
        let units = self
            .zero3
            .module_units
            .get(node.module.0 as usize)
            .cloned()
            .unwrap_or_default();
        self.z3_transition(Ctx::Backward, units);
    }

    /// The end of the forward: the last submodules' post-forward hooks.
    pub(super) fn zero3_post_forward(&mut self) {
        if self.zero3_on() {
            self.z3_transition(Ctx::Forward, Vec::new());
        }
    }

    /// The end of a checkpointed region's recomputation.
    pub(super) fn zero3_end_recompute(&mut self) {
        if self.zero3_on() {
            self.z3_transition(Ctx::Recompute, Vec::new());
        }
    }

    /// The end of the backward: the last post-backward hooks, then
    /// `independent_gradient_partition_epilogue` reduces what the IPG bucket still holds.
    pub(super) fn zero3_post_backward(&mut self) {
        self.z3_transition(Ctx::Backward, Vec::new());
        self.z3_transition(Ctx::Recompute, Vec::new());
        self.z3_reduce_ipg();
    }

    fn z3_ctx(&mut self, ctx: Ctx) -> &mut Vec<usize> {
        match ctx {
            Ctx::Forward => &mut self.zero3.ctx_forward,
            Ctx::Backward => &mut self.zero3.ctx_backward,
            Ctx::Recompute => &mut self.zero3.ctx_recompute,
        }
    }

    /// Leaves the submodules of `ctx` not in `now` (innermost first), enters those of `now` not
    /// active (outermost first).
    fn z3_transition(&mut self, ctx: Ctx, now: Vec<usize>) {
        let old = std::mem::take(self.z3_ctx(ctx));
        for &u in old.iter().rev() {
            if !now.contains(&u) {
                self.z3_release_sub_module(u);
            }
        }
        for &u in &now {
            if !old.contains(&u) {
                self.z3_fetch_sub_module(u);
            }
        }
        *self.z3_ctx(ctx) = now;
    }

    /// `fetch_sub_module`: record or check the trace, all-gather what is not available, wait for
    /// what is in flight, then (complete trace) prefetch.
    fn z3_fetch_sub_module(&mut self, u: usize) {
        match self.zero3.mode {
            Mode::Record => self.zero3.order.push(u),
            Mode::Complete if self.zero3.order.get(self.zero3.step) != Some(&u) => {
                self.z3_invalidate()
            }
            _ => {}
        }
        let ps = self.zero3.unit_params[u].clone();
        let missing: Vec<usize> = ps
            .iter()
            .copied()
            .filter(|&p| self.zero3.status[p] == Status::NotAvailable)
            .collect();
        if !missing.is_empty() {
            self.z3_all_gather(&missing);
        }
        for &p in &ps {
            self.zero3.active[p] += 1;
            if self.zero3.inflight[p].is_some() {
                self.z3_pop_wait(p);
            }
        }
        if self.zero3.mode == Mode::Complete {
            self.z3_prefetch(&ps);
        }
        self.zero3.step += 1;
    }

    /// The prefetch of `_fetch_sub_module_impl` with a complete trace.
    fn z3_prefetch(&mut self, ps: &[usize]) {
        let step = self.zero3.step as i64;
        let z = &mut self.zero3;
        let not_fetched = ps.iter().filter(|&&p| z.most_recent[p] < step).count();
        let mut discarded: Vec<usize> = Vec::new();
        while discarded.len() < not_fetched {
            let Some((p, s)) = z.queue.pop_front() else {
                break;
            };
            z.most_recent[p] = s as i64;
            if !discarded.contains(&p) {
                discarded.push(p);
            }
        }
        let max =
            (DS_MAX_LIVE_PARAMETERS as i64 - z.n_available).min(DS_PREFETCH_BUCKET_ELEMENTS as i64);
        let mut chosen: Vec<usize> = Vec::new();
        let mut numel = 0i64;
        while numel < max {
            let Some((p, s)) = z.queue.pop_front() else {
                break;
            };
            let fetch = z.status[p] == Status::NotAvailable && !chosen.contains(&p);
            z.most_recent[p] = z.most_recent[p].max(s as i64);
            if fetch {
                chosen.push(p);
                numel += self.params[p].layout.numel() as i64;
            }
        }
        if !chosen.is_empty() {
            chosen.sort_unstable();
            self.z3_all_gather(&chosen);
        }
    }

    /// `__all_gather_params` → `all_gather_coalesced` on the all-gather stream. Each parameter
    /// is gathered in its own dtype (the partition's: the model's, or PEFT's float32 adapters').
    fn z3_all_gather(&mut self, ps: &[usize]) {
        let n = u64::from(self.r.parallel.dp);
        let prev = self.kind_now;
        for &p in ps {
            self.zero3.n_available += self.z3_numel(p) as i64;
            self.zero3.status[p] = Status::Inflight;
        }
        let h = self.zero3.handles.len();
        let mut input = None;
        let mut flats = Vec::new();
        let mut params = ps.to_vec();
        if n == 1 {
            // `_no_gather_coalesced`: one rank's partition is the parameter (`param.data =
            // ds_tensor.data.to(device).view(ds_shape)`): nothing allocated, unless the partition
            // is in host memory.
            for &p in ps {
                if self.z3_on_host(p) {
                    let t = self.z3_temp(
                        self.zero3.partition[p],
                        self.z3_dtype(p),
                        0,
                        "aten._to_copy",
                    );
                    self.retag(&t, format!("{}:gathered", self.g.params[p].name));
                    self.zero3.data[p] = Some(t);
                }
            }
        } else if ps.len() == 1 {
            // `_all_gather_sequential`: `param.data` is a view of the aligned buffer.
            let p = ps[0];
            let dtype = self.z3_dtype(p);
            self.kind_now = Kind::Param;
            let t = self.alloc(
                Layout::contiguous(&[self.zero3.partition[p] * n]),
                dtype,
                ModuleId(0),
                "aten.empty",
            );
            self.set_stream(&t, ALL_GATHER_STREAM);
            self.retag(&t, format!("{}:gathered", self.g.params[p].name));
            self.zero3.data[p] = Some(t);
            if self.z3_on_host(p) {
                // The input `ds_tensor.to(device)`, held by the process group until `wait()`.
                input = Some(self.z3_temp(
                    self.zero3.partition[p],
                    dtype,
                    ALL_GATHER_STREAM,
                    "aten._to_copy",
                ));
            }
        } else {
            // `_all_gather_coalesced`: the parameters grouped by dtype (`dtype_params`), the
            // groups in `sort_dtypes` order (by `str(dtype)`), each through `_all_gather_dtype`:
            // one flat buffer of Σ partition × N elements; the handles waited for together
            // (`MultipleAllGatherHandles`), in that order.
            params.sort_by_key(|&p| self.z3_dtype(p).name());
            let mut at = 0;
            while at < params.len() {
                let dtype = self.z3_dtype(params[at]);
                let group: Vec<usize> = params[at..]
                    .iter()
                    .copied()
                    .take_while(|&p| self.z3_dtype(p) == dtype)
                    .collect();
                at += group.len();
                let elems: u64 = group.iter().map(|&p| self.zero3.partition[p] * n).sum();
                let t = self.comm_alloc(elems, dtype, "allgather_coalesced_flat".into());
                self.set_stream(&t, ALL_GATHER_STREAM);
                // `torch.cat([p.ds_tensor.to(device) ...], out=own slice)`: the copies of the
                // partitions in host memory die after the cat.
                let host: Vec<usize> = group
                    .iter()
                    .copied()
                    .filter(|&p| self.z3_on_host(p))
                    .collect();
                let ins: Vec<Rt> = host
                    .into_iter()
                    .map(|p| {
                        self.z3_temp(
                            self.zero3.partition[p],
                            dtype,
                            ALL_GATHER_STREAM,
                            "aten._to_copy",
                        )
                    })
                    .collect();
                for i in ins {
                    self.drop_rt(i);
                }
                flats.push(t);
            }
        }
        self.kind_now = prev;
        let coalesced = !flats.is_empty();
        self.zero3.handles.push(Handle {
            input,
            flats,
            params,
            registered: ps.len(),
            complete: !coalesced,
        });
        for &p in ps {
            self.zero3.inflight[p] = Some(h);
        }
    }

    /// `__inflight_param_registry.pop(param).wait()`: the handle's first `wait()` copies every
    /// parameter out of the flat buffer (`torch.cat` of its rank slices, under the all-gather
    /// stream); the buffer dies with the last registry entry.
    fn z3_pop_wait(&mut self, p: usize) {
        let Some(h) = self.zero3.inflight[p].take() else {
            return;
        };
        if let Some(i) = self.zero3.handles[h].input.take() {
            self.drop_rt(i);
        }
        if !self.zero3.handles[h].complete {
            self.zero3.handles[h].complete = true;
            let prev = self.kind_now;
            self.kind_now = Kind::Param;
            for q in self.zero3.handles[h].params.clone() {
                let t = self.alloc(
                    Layout::contiguous(&[self.z3_numel(q)]),
                    self.z3_dtype(q),
                    ModuleId(0),
                    "aten.cat",
                );
                self.set_stream(&t, ALL_GATHER_STREAM);
                self.retag(&t, format!("{}:gathered", self.g.params[q].name));
                self.zero3.data[q] = Some(t);
            }
            self.kind_now = prev;
        }
        for q in self.zero3.handles[h].params.clone() {
            if self.zero3.status[q] == Status::Inflight {
                self.zero3.status[q] = Status::Available;
            }
        }
        let hd = &mut self.zero3.handles[h];
        hd.registered -= 1;
        if hd.registered == 0 {
            for f in std::mem::take(&mut hd.flats) {
                self.drop_rt(f);
            }
        }
    }

    /// `release_sub_module`.
    fn z3_release_sub_module(&mut self, u: usize) {
        let ps = self.zero3.unit_params[u].clone();
        let release: Vec<usize> = if self.zero3.mode == Mode::Complete {
            self.z3_params_to_release(&ps)
        } else {
            ps.clone()
        };
        for &p in &ps {
            self.zero3.active[p] = self.zero3.active[p].saturating_sub(1);
            if release.contains(&p) {
                self.z3_release_param(p);
            }
        }
    }

    /// `__params_to_release`: the non-persistent parameters not fetched for a later step and not
    /// used by the submodules of the next `max_reuse_distance` elements of the trace.
    fn z3_params_to_release(&self, ps: &[usize]) -> Vec<usize> {
        let z = &self.zero3;
        let step = z.step;
        let mut out: Vec<usize> = ps
            .iter()
            .copied()
            .filter(|&p| !z.persist[p] && z.most_recent[p] <= step as i64)
            .collect();
        let mut traversed = 0u64;
        for &m in z.order.iter().skip(step) {
            if traversed >= DS_MAX_REUSE_DISTANCE || out.is_empty() {
                break;
            }
            for &p in &z.unit_params[m] {
                out.retain(|&q| q != p);
                traversed += self.z3_numel(p);
            }
        }
        out
    }

    /// `__release_param` → `partition` → `free_param`: `param.data.record_stream(current)` and
    /// an empty tensor in its place.
    fn z3_release_param(&mut self, p: usize) {
        let z = &self.zero3;
        if z.status[p] != Status::Available || z.active[p] > 0 {
            return;
        }
        if let Some(d) = self.zero3.data[p].take() {
            if let Some(id) = self.alloc_id(&d) {
                self.events.push(Event::RecordStream { id, stream: 0 });
            }
            self.drop_rt(d);
        }
        self.zero3.status[p] = Status::NotAvailable;
        self.zero3.n_available -= self.z3_numel(p) as i64;
    }
}
