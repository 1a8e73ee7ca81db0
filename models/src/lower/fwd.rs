//! The forward pass: op execution, autocast, autograd node creation, checkpoint frames and
//! recomputation.

use super::{Edge, Frame, Kind, LowerError, Lowering, Meta, NodeKind, ReentrantFwd, Rt};
use crate::autocast::{policy, Policy};
use crate::dtype::DType;
use crate::graph::{DTypeSpec, ModuleId, ValueId};
use crate::layout::{elementwise_layout, Layout};
use crate::ops::{FusedSdpa, OpKind};
use crate::recipe::{CheckpointImpl, Fidelity, TorchVersion};
use rustc_hash::FxHashMap;

/// A tensor an autograd node saves: input `j` or output `k` of its op, or a tensor the
/// autograd wrapper made for the node (`Extra`: the `original_self = self.clone()` of an
/// in-place op whose derivative formula uses `self`; the rule's reference is dropped once the
/// node has saved it).
#[derive(Clone, Debug)]
pub(crate) enum Save {
    In(usize),
    Out(usize),
    Extra(Rt),
}

/// What an op's forward rule produced.
pub(crate) enum Fwd {
    /// The op returned its input (`contiguous()` of a contiguous tensor, `.to()` to the same
    /// dtype): no allocation, no autograd node.
    Alias(Rt),
    /// New outputs (allocated or views), the backward node's kind and what it saves.
    New(Vec<Rt>, NodeKind, Vec<Save>),
}

/// derivatives.yaml mm/bmm/addmm: mat2 saved for mat1's grad and mat1 for mat2's (addmm's
/// matrices are its inputs 1 and 2).
pub(super) fn gemm_saves(kind: &OpKind, x: &[Rt]) -> Vec<Save> {
    let (a, b) = if matches!(kind, OpKind::Addmm) {
        (1, 2)
    } else {
        (0, 1)
    };
    let mut saves = Vec::new();
    if x[a].requires_grad() {
        saves.push(Save::In(b));
    }
    if x[b].requires_grad() {
        saves.push(Save::In(a));
    }
    saves
}

/// derivatives.yaml `_scaled_dot_product_{flash,efficient,cudnn}_attention`: query, key, value,
/// output and logsumexp saved, with flash's and cuDNN's philox seed and offset (outputs 2 and 3).
pub(super) fn sdpa_saves(backend: FusedSdpa) -> Vec<Save> {
    let mut saves = vec![
        Save::In(0),
        Save::In(1),
        Save::In(2),
        Save::Out(0),
        Save::Out(1),
    ];
    if matches!(backend, FusedSdpa::Flash | FusedSdpa::Cudnn) {
        saves.extend([Save::Out(2), Save::Out(3)]);
    }
    saves
}

fn ceil_to(x: u64, m: u64) -> u64 {
    x.div_ceil(m) * m
}

impl<'g> Lowering<'g> {
    /// One fused SDPA kernel call's outputs (`_scaled_dot_product_{flash,efficient,cudnn}_attention`
    /// on `q`, `k`, `v`): the output, the logsumexp and the kernel's small tensors, in the order
    /// the lowering's `Sdpa` op lists them.
    pub(super) fn sdpa_kernel_fwd(
        &mut self,
        backend: FusedSdpa,
        q: &Rt,
        v: &Rt,
        m: ModuleId,
        name: &str,
    ) -> Vec<Rt> {
        let s = q.shape().to_vec();
        let (b, h, sq, d) = (s[0], s[1], s[2], s[3]);
        let dv = v.shape()[3];
        // `compute_logsumexp` (mem-efficient, cuDNN) is `should_compute_logsumexp`: an
        // input requires grad with grad mode on; not under no_grad.
        let lse_rows = if self.r.inference { 0 } else { sq };
        match backend {
            // _flash_attention_forward (flash_api.cpp mha_fwd): output in q's memory order
            // ([B, L, H, D] for HF's transposed q), returned as [B, H, L, D]; softmax_lse float32 [B, H, L]; rng_state
            // uint64 [2] and an unused uint64 0-d tensor on the device, always (2.15 meta
            // kernels); both saved (philox_seed, philox_offset).
            FusedSdpa::Flash => {
                // `out = empty_like(q_t)` with q_t = q.transpose(1, 2): q's stride order (for a
                // q that is not dense, a ring attention's half, q_t's contiguous order).
                let o = self.alloc(
                    q.layout.transpose(1, 2).empty_like().transpose(1, 2),
                    q.dtype,
                    m,
                    name,
                );
                let lse = self.alloc(Layout::contiguous(&[b, h, sq]), DType::F32, m, name);
                let rng = self.alloc(Layout::contiguous(&[2]), DType::I64, m, name);
                let unused = self.alloc(Layout::contiguous(&[]), DType::I64, m, name);
                vec![o, lse, rng, unused]
            }
            // _efficient_attention_forward: output BMHK, logsumexp float32
            // [B, H, ceil(L/32)*32] (kAlignLSE) when an input requires grad (else
            // [B, H, 0]); the philox
            // seed and offset are CPU tensors outside graph capture (no device memory).
            FusedSdpa::MemEfficient => {
                let o = self.alloc(
                    Layout::contiguous(&[b, sq, h, d]).transpose(1, 2),
                    q.dtype,
                    m,
                    name,
                );
                let lse = self.alloc(
                    Layout::contiguous(&[b, h, ceil_to(lse_rows, 32)]),
                    DType::F32,
                    m,
                    name,
                );
                vec![o, lse]
            }
            // _scaled_dot_product_cudnn_attention_cuda (native/cudnn/MHA.cpp
            // run_cudnn_SDP_fprop): the seed and offset int64 `zeros({1})` on q's device
            // first, then the output `alloc_with_matching_layout(q, ...)` (q's stride
            // order) and the softmax stats float32 [B, H, L, 1] (only with
            // compute_logsumexp: none under no_grad). cuDNN's per-call
            // workspace (`mha_graph->get_workspace_size()`, from the caching allocator) is
            // whatever the cuDNN frontend's execution plan asks for: not knowable without
            // cuDNN, so not modelled.
            FusedSdpa::Cudnn => {
                let seed = self.alloc(Layout::contiguous(&[1]), DType::I64, m, name);
                let offset = self.alloc(Layout::contiguous(&[1]), DType::I64, m, name);
                let ql = &q.layout;
                let mut order: Vec<usize> = (0..4).collect();
                order.sort_by(|&i, &j| ql.strides[j].cmp(&ql.strides[i]));
                let o = self.alloc(
                    crate::layout::dense_in_order(&[b, h, sq, dv], &order),
                    q.dtype,
                    m,
                    name,
                );
                let lse = self.alloc(
                    Layout::contiguous(&[b, h, lse_rows, 1]),
                    DType::F32,
                    m,
                    name,
                );
                vec![o, lse, seed, offset]
            }
        }
    }

    /// Runs the graph's forward; returns the output's handle (its Python reference).
    pub(super) fn forward(&mut self) -> Result<Rt, LowerError> {
        let out = self.g.output.expect("checked");
        self.forward_ops(0..self.g.ops.len(), out)
    }

    /// Runs the forward of ops `ops` (a pipeline stage's, `pipeline.rs`, or all of them) and
    /// returns the handle of `out`, what that forward returns.
    pub(super) fn forward_ops(
        &mut self,
        ops: std::ops::Range<usize>,
        out: ValueId,
    ) -> Result<Rt, LowerError> {
        self.kind_now = Kind::Pending;
        let start = self.storages.len();
        let first_node = self.nodes.len();
        let reentrant = self.r.checkpoint_impl == CheckpointImpl::Reentrant;
        for i in ops {
            self.fsdp_forward_op(i);
            self.dp_forward_op(i);
            let region = self.op_region[i];
            if reentrant {
                if let Some(rf) = &self.reentrant_fwd {
                    if region != Some(rf.range) {
                        self.reentrant_end();
                    }
                }
                if let Some(r) = region {
                    if self.reentrant_fwd.is_none() {
                        self.reentrant_begin(r);
                    }
                }
                self.exec_graph_op(i);
                continue;
            }
            if let Some(f) = self.active_frame {
                if region != Some(self.frames[f as usize].range) {
                    self.end_frame(f);
                }
            }
            if let Some(r) = region {
                if self.active_frame.is_none() {
                    self.begin_frame(r);
                }
            }
            self.exec_graph_op(i);
        }
        if let Some(f) = self.active_frame {
            self.end_frame(f);
        }
        if self.reentrant_fwd.is_some() {
            self.reentrant_end();
        }
        self.clear_autocast_cache();
        // Kept outputs whose rebinding op did not run (none in a well-formed graph) go now; this
        // forward's outputs are what the loop holds from here on.
        for (_, rt) in std::mem::take(&mut self.kept) {
            self.drop_rt(rt);
        }
        self.kept = std::mem::take(&mut self.kept_next);
        self.settle_pending(start);
        let rt = self.vals[out.0 as usize]
            .take()
            .expect("the output is alive");
        self.release_dead_branches(first_node, &rt);
        self.kind_now = Kind::Temporary;
        Ok(rt)
    }

    /// Autograd nodes of this forward that the loss does not reach (BertModel's pooler under a
    /// loss on the hidden state) live only as long as the tensors they made: those die with the
    /// model's output object when the forward returns (`loss = model(...).loss`), so the nodes go
    /// then, newest first, and release what they saved. Nodes the training loop still reaches
    /// through kept outputs (`--keep-outputs`) stay to the end of backward, as all nodes do.
    fn release_dead_branches(&mut self, first_node: usize, loss: &Rt) {
        if first_node >= self.nodes.len() {
            return;
        }
        let mut reached = vec![false; self.nodes.len()];
        let mut stack: Vec<u32> = loss.edge.iter().map(|e| e.node).collect();
        stack.extend(
            self.kept
                .iter()
                .filter_map(|(_, rt)| rt.edge.map(|e| e.node)),
        );
        while let Some(n) = stack.pop() {
            let Some(seen) = reached.get_mut(n as usize) else {
                continue;
            };
            if std::mem::replace(seen, true) {
                continue;
            }
            stack.extend(self.nodes[n as usize].next.iter().flatten().map(|e| e.node));
        }
        for n in (first_node..self.nodes.len()).rev() {
            let node = &self.nodes[n];
            if reached[n] || node.ckpt.is_some() || !matches!(node.kind, NodeKind::Op(_)) {
                continue;
            }
            for t in std::mem::take(&mut self.nodes[n].saved) {
                self.drop_rt(t);
            }
        }
    }

    /// `output.requires_grad_(True)` on value `v` when it does not require grad yet (a leaf then:
    /// its `AccumulateGrad` node holds the tensor, and the tensor's `.grad`, until the graph
    /// dies at the end of backward).
    fn require_grad_leaf(&mut self, v: ValueId) {
        if !self.grad_mode || self.recompute_saved.is_some() || self.in_reentrant_recompute {
            return;
        }
        let Some(rt) = self.vals[v.0 as usize].clone() else {
            return;
        };
        if rt.requires_grad() || !rt.dtype.is_float() {
            return;
        }
        let (leaf, _) = self.new_leaf(&rt);
        let held = self.dup(&rt);
        self.nodes[leaf as usize].saved.push(held);
        if let Some(x) = self.vals[v.0 as usize].as_mut() {
            x.edge = Some(Edge { node: leaf, nr: 0 });
        }
    }

    pub(super) fn exec_graph_op(&mut self, i: usize) {
        self.zero3_op(i);
        let g = self.g;
        let op = &g.ops[i];
        // The inputs' handles, in a buffer reused from op to op (ops do not nest).
        let mut ins = std::mem::take(&mut self.scratch_ins);
        ins.extend(op.inputs.iter().map(|v| {
            self.vals[v.0 as usize]
                .clone()
                .unwrap_or_else(|| panic!("value {} of op {i} ({:?}) is not alive", v.0, op.kind))
        }));
        let outs = self.exec(&op.kind, &ins, &op.outputs, op.module, Some(i));
        ins.clear();
        self.scratch_ins = ins;
        let mut it = outs.into_iter();
        for &v in &op.outputs {
            if let Some(rt) = it.next() {
                self.vals[v.0 as usize] = Some(rt);
            }
        }
        // Outputs the graph does not name die with the op's returned tuple.
        for rt in it {
            self.drop_rt(rt);
        }
        if let Some(h) = self.input_grad_hook.filter(|h| op.outputs.contains(h)) {
            self.require_grad_leaf(h);
        }
        self.pp_hold_outputs(&op.outputs);
        // `--keep-outputs` (not in a checkpoint's recomputation): the training loop's names take
        // one more reference on what the model returns.
        if self.r.keep_outputs && self.recompute_saved.is_none() && !self.in_reentrant_recompute {
            for &(v, rebind) in &g.kept_outputs {
                if op.outputs.contains(&v) {
                    if let Some(rt) = self.vals[v.0 as usize].clone() {
                        let d = self.dup(&rt);
                        self.kept_next.push((rebind.0 as usize, d));
                    }
                }
            }
        }
        let rel = std::mem::take(&mut self.release_after[i]);
        for &v in &rel {
            if let Some(rt) = self.vals[v.0 as usize].take() {
                self.drop_rt(rt);
            }
        }
        self.release_after[i] = rel;
        // The assignment that rebinds a kept name runs when op `i` returns (after the callee's
        // locals are gone): the previous step's tensor loses its last Python reference.
        if !self.kept.is_empty() && self.recompute_saved.is_none() && !self.in_reentrant_recompute {
            let mut k = 0;
            while k < self.kept.len() {
                if self.kept[k].0 == i {
                    let (_, rt) = self.kept.remove(k);
                    self.drop_rt(rt);
                } else {
                    k += 1;
                }
            }
        }
    }

    /// Runs one op on `ins` (borrowed handles); returns owned output handles.
    pub(crate) fn exec(
        &mut self,
        kind: &OpKind,
        ins: &[Rt],
        outs: &[ValueId],
        m: ModuleId,
        gop: Option<usize>,
    ) -> Vec<Rt> {
        // Softmax/log_softmax with dtype=float32 on a bfloat16 input: `input.toType(float)` first
        // (`aten/src/ATen/native/SoftMax.cpp`); CUDA's half_to_float path only exists for float16.
        // Ops of a composite run under autocast's ExcludeDispatchKeyGuard see no autocast.
        let autocast = match gop {
            Some(i) if !self.g.ops[i].autocast => None,
            _ => self.autocast,
        };
        // `fp32_set_opt_dtype` (`aten/src/ATen/autocast_mode.h`, `set_opt_dtype`): `dtype` becomes
        // float32 only when the caller left it unset; an explicit dtype is kept and the input is
        // not cast (`cross_entropy_loss` calls `log_softmax(self, dim, self.scalar_type())`).
        let ac_f32 = autocast.is_some()
            && matches!(
                kind,
                OpKind::Softmax { .. }
                    | OpKind::LogSoftmax {
                        explicit_dtype: false,
                        ..
                    }
            );
        if let OpKind::Softmax { dim, to_f32 } = *kind {
            // `softmax(x, dtype=torch.float32)` converts a 16-bit input first (a float16 one
            // outside autocast: `--precision fp16`'s `module.half()`).
            let half = ins[0].dtype == DType::BF16
                || (ins[0].dtype == DType::F16 && self.autocast.is_none());
            if (to_f32 || ac_f32) && half {
                let conv = self.exec(&OpKind::ToDtype(DType::F32), &ins[..1], &[], m, None);
                let out = self.exec(&OpKind::Softmax { dim, to_f32: false }, &conv, outs, m, gop);
                for c in conv {
                    self.drop_rt(c);
                }
                return out;
            }
            if ac_f32 && !to_f32 && ins[0].dtype == DType::F16 {
                return self.exec(&OpKind::Softmax { dim, to_f32: true }, ins, outs, m, gop);
            }
        }
        if let OpKind::LogSoftmax {
            dim,
            explicit_dtype: false,
        } = *kind
        {
            if ac_f32 && ins[0].dtype != DType::F32 {
                let conv = self.exec(&OpKind::ToDtype(DType::F32), &ins[..1], &[], m, None);
                let out = self.exec(
                    &OpKind::LogSoftmax {
                        dim,
                        explicit_dtype: true,
                    },
                    &conv,
                    outs,
                    m,
                    gop,
                );
                for c in conv {
                    self.drop_rt(c);
                }
                return out;
            }
        }
        // Autocast: cast float inputs as the op's list says.
        let pol = match (autocast, kind) {
            (None, _) => Policy::None,
            (Some(_), OpKind::AutocastLower) => Policy::Lower,
            (Some(_), k) if ac_f32 => {
                let _ = k;
                Policy::None
            }
            (Some(_), k) => policy(k),
        };
        let promote_to = if pol == Policy::Promote {
            ins.iter()
                .filter(|x| x.dtype.is_float())
                .map(|x| x.dtype)
                .reduce(|a, b| a.promote(b))
        } else {
            None
        };
        // A buffer reused from op to op (a nested `exec`, an autocast cast, makes its own).
        let mut casted = std::mem::take(&mut self.scratch_casted);
        // autocast_mode.h: the casts are the arguments of the redispatch (`cached_cast(...)...`), an
        // order C++ leaves open; GCC, which builds PyTorch's Linux wheels, evaluates them last to
        // first (measured on an H100: addmm's weight copy before its input's). Meta captures cast
        // first to last (their autocast is Python's).
        let last_first = self.r.fidelity == Fidelity::Cuda && pol != Policy::None;
        let order: &mut dyn Iterator<Item = &Rt> = if last_first {
            &mut ins.iter().rev()
        } else {
            &mut ins.iter()
        };
        for x in order {
            let target = match pol {
                Policy::Lower => autocast.filter(|&d| x.dtype.is_float() && x.dtype != d),
                Policy::Fp32 => {
                    Some(DType::F32).filter(|_| matches!(x.dtype, DType::F16 | DType::BF16))
                }
                Policy::Promote => promote_to.filter(|&d| x.dtype.is_float() && x.dtype != d),
                Policy::None => None,
            };
            let c = match target {
                Some(d) => self.autocast_cast(x, d, m),
                None => self.dup(x),
            };
            casted.push(c);
        }
        if last_first {
            casted.reverse();
        }
        let g = self.g;
        let mut out_specs = std::mem::take(&mut self.scratch_specs);
        out_specs.extend(outs.iter().map(|v| {
            let val = &g.values[v.0 as usize];
            (val.shape.as_slice(), val.dtype)
        }));
        // Selective checkpointing's dispatch mode sits below autograd and autocast: it sees the op
        // with its cast inputs and, in the recomputation, answers a saved op from its storage.
        let sac = self.sac_policy(kind);
        let result = match sac {
            Some(d) if d.recompute && d.save => self.sac_cached(kind, &casted, d),
            _ => self.fwd_rule(kind, &casted, &out_specs, m),
        };
        if let (Some(d), Fwd::New(outs, ..)) = (sac, &result) {
            if !d.recompute {
                self.sac_store(d, outs);
            }
        }
        out_specs.clear();
        self.scratch_specs = out_specs;
        let outs = match result {
            Fwd::Alias(rt) => vec![rt],
            Fwd::New(mut outs, nk, saves) => {
                let needs_grad = self.grad_mode
                    && casted.iter().enumerate().any(|(j, x)| {
                        x.requires_grad()
                            && !(matches!(kind, OpKind::ToDtypeOf | OpKind::AsStridedInplace)
                                && j == 1)
                    });
                // A factory, or a recorded call the capture saw no node for, is not differentiable.
                let differentiable = match kind {
                    OpKind::Factory { .. } => false,
                    OpKind::Recorded(r) => r.grad,
                    _ => true,
                };
                if needs_grad && differentiable {
                    let dtype_only_arg1 =
                        matches!(kind, OpKind::ToDtypeOf | OpKind::AsStridedInplace);
                    self.record_node(nk, &casted, &mut outs, &saves, m, gop, dtype_only_arg1);
                }
                for s in saves {
                    if let Save::Extra(t) = s {
                        self.drop_rt(t);
                    }
                }
                outs
            }
        };
        for c in casted.drain(..) {
            self.drop_rt(c);
        }
        self.scratch_casted = casted;
        outs
    }

    #[allow(clippy::too_many_arguments)]
    fn record_node(
        &mut self,
        nk: NodeKind,
        ins: &[Rt],
        outs: &mut [Rt],
        saves: &[Save],
        m: ModuleId,
        gop: Option<usize>,
        dtype_only_arg1: bool,
    ) {
        fn pick<'a>(s: &'a Save, ins: &'a [Rt], outs: &'a [Rt]) -> &'a Rt {
            match s {
                Save::In(j) => &ins[*j],
                Save::Out(k) => &outs[*k],
                Save::Extra(t) => t,
            }
        }
        if let Some(map) = self.recompute_saved.as_mut() {
            // Recomputation: the node itself is thrown away; what it saves is kept for the
            // original node (`frame.recomputed`).
            let _ = map;
            let orig =
                gop.and_then(|i| self.recompute_ops.as_ref().and_then(|o| o.get(&i).copied()));
            if let Some(node) = orig {
                let mut kept = Vec::new();
                for s in saves {
                    kept.push(self.dup(pick(s, ins, outs)));
                }
                self.recompute_saved
                    .as_mut()
                    .unwrap()
                    .entry(node)
                    .or_default()
                    .extend(kept);
            }
            for (k, o) in outs.iter_mut().enumerate() {
                if o.dtype.is_float() {
                    o.edge = Some(Edge {
                        node: u32::MAX,
                        nr: k as u32,
                    });
                }
            }
            return;
        }
        self.seq += 1;
        let seq = self.seq;
        let node = self.new_node(nk, seq, m);
        let n = &mut self.nodes[node as usize];
        // `x.to(other.dtype)` takes a dtype, not a tensor: no edge to `other`.
        let diff = |j: usize| !(dtype_only_arg1 && j == 1);
        n.ins = ins
            .iter()
            .enumerate()
            .map(|(j, x)| {
                if x.dtype.is_float() && diff(j) {
                    Some(Meta {
                        layout: x.layout.clone(),
                        dtype: x.dtype,
                    })
                } else {
                    None
                }
            })
            .collect();
        n.next = ins
            .iter()
            .enumerate()
            .map(|(j, x)| if diff(j) { x.edge } else { None })
            .collect();
        n.outs = outs
            .iter()
            .map(|o| Meta {
                layout: o.layout.clone(),
                dtype: o.dtype,
            })
            .collect();
        for (k, o) in outs.iter_mut().enumerate() {
            if o.dtype.is_float() {
                o.edge = Some(Edge { node, nr: k as u32 });
            }
        }
        if saves.is_empty() {
            return;
        }
        if let Some(f) = self.active_frame {
            // Inside torch.utils.checkpoint: the pack hook keeps nothing but a handle.
            self.nodes[node as usize].ckpt = Some(f);
            let fr = &mut self.frames[f as usize];
            fr.pending += 1;
            if let Some(i) = gop {
                fr.op_nodes.insert(i, node);
                fr.last_saving_op = Some(fr.last_saving_op.map_or(i, |x| x.max(i)));
            }
            return;
        }
        let mut saved = Vec::with_capacity(saves.len());
        for s in saves {
            saved.push(self.dup(pick(s, ins, outs)));
        }
        self.nodes[node as usize].saved = saved;
    }

    /// Autocast's `cached_cast`: a cast of a leaf that requires grad (a parameter) is cached
    /// until autocast exits.
    fn autocast_cast(&mut self, x: &Rt, d: DType, m: ModuleId) -> Rt {
        let leaf_param = self.param_index(x);
        if let Some(p) = leaf_param {
            if let Some(c) = self.autocast_cache.get(&p).cloned() {
                return self.dup(&c);
            }
        }
        let out = self
            .exec(&OpKind::ToDtype(d), std::slice::from_ref(x), &[], m, None)
            .pop()
            .expect("one output");
        let out = match &self
            .nodes
            .get(out.edge.map_or(usize::MAX, |e| e.node as usize))
        {
            Some(_) => {
                if let Some(e) = out.edge {
                    self.nodes[e.node as usize].kind = NodeKind::Cast;
                }
                out
            }
            None => out,
        };
        if let Some(p) = leaf_param {
            let c = self.dup(&out);
            self.autocast_cache.insert(p, c);
        }
        out
    }

    fn param_index(&self, x: &Rt) -> Option<usize> {
        let e = x.edge?;
        match self.nodes.get(e.node as usize)?.kind {
            NodeKind::Accumulate(p)
                if self.params[p].st == x.st && x.layout == self.params[p].layout =>
            {
                Some(p)
            }
            _ => None,
        }
    }

    pub(super) fn clear_autocast_cache(&mut self) {
        for c in std::mem::take(&mut self.autocast_cache).into_values() {
            self.drop_rt(c);
        }
    }

    // ------------------------------------------------------------------ checkpoint frames

    fn begin_frame(&mut self, range: u32) {
        let ids: Vec<ValueId> = self.ck_ranges[range as usize].inputs.clone();
        let mut inputs = Vec::with_capacity(ids.len());
        for v in ids {
            if let Some(rt) = self.vals[v.0 as usize].clone() {
                let d = self.dup(&rt);
                inputs.push((v, d));
            }
        }
        self.frames.push(Frame {
            range,
            inputs,
            pending: 0,
            recomputed: false,
            saved: FxHashMap::default(),
            op_nodes: FxHashMap::default(),
            last_saving_op: None,
            sac: self.sac_contexts(),
        });
        self.active_frame = Some((self.frames.len() - 1) as u32);
    }

    fn end_frame(&mut self, f: u32) {
        self.active_frame = None;
        if self.frames[f as usize].pending == 0 {
            self.free_frame(f);
        }
    }

    pub(super) fn free_frame(&mut self, f: u32) {
        let inputs = std::mem::take(&mut self.frames[f as usize].inputs);
        for (_, rt) in inputs {
            self.drop_rt(rt);
        }
        self.sac_release(f);
    }

    /// What `SoftmaxBackward0`/`LogSoftmaxBackward0` save: the result, and in PyTorch 1.10 the
    /// input first (`self` precedes `result` in the generated node's saved variables).
    fn softmax_saves(&self) -> Vec<Save> {
        match self.r.torch_version {
            TorchVersion::V2_15 => vec![Save::Out(0)],
            TorchVersion::V1_10 => vec![Save::In(0), Save::Out(0)],
        }
    }

    /// `CheckpointFunction.forward` (reentrant `torch.utils.checkpoint`, `torch/utils/checkpoint.py`):
    /// `ctx.save_for_backward(*tensor_inputs)` keeps the region's inputs, then
    /// `with torch.no_grad(): outputs = run_function(*args)`: the region's ops record no node and
    /// save nothing, each intermediate dying after its last use.
    fn reentrant_begin(&mut self, range: u32) {
        let ids = self.ck_ranges[range as usize].inputs.clone();
        let mut inputs = Vec::with_capacity(ids.len());
        for v in ids {
            if let Some(rt) = self.vals[v.0 as usize].clone() {
                let d = self.dup(&rt);
                inputs.push((v, d));
            }
        }
        self.reentrant_fwd = Some(ReentrantFwd { range, inputs });
        self.grad_mode = false;
    }

    /// The end of `CheckpointFunction.apply`: one `CheckpointFunctionBackward` node with an edge to
    /// every input that requires grad, holding the saved inputs, becomes the outputs' `grad_fn`. When
    /// no input requires grad, `Function.apply` records no node: the outputs do not require grad and
    /// the region's parameters get no gradient (PyTorch warns "None of the inputs have
    /// requires_grad=True").
    fn reentrant_end(&mut self) {
        let Some(rf) = self.reentrant_fwd.take() else {
            return;
        };
        self.grad_mode = true;
        let range = rf.range as usize;
        let any_grad = rf
            .inputs
            .iter()
            .any(|(_, rt)| rt.dtype.is_float() && rt.requires_grad());
        if !any_grad {
            for (_, rt) in rf.inputs {
                self.drop_rt(rt);
            }
            return;
        }
        let m = self.g.ops[self.ck_ranges[range].start].module;
        self.seq += 1;
        let node = self.new_node(NodeKind::Reentrant(rf.range), self.seq, m);
        let outputs = self.ck_ranges[range].outputs.clone();
        let mut out_meta = Vec::new();
        for (k, v) in outputs.iter().enumerate() {
            if let Some(rt) = self.vals[v.0 as usize].as_mut() {
                out_meta.push(Meta {
                    layout: rt.layout.clone(),
                    dtype: rt.dtype,
                });
                if rt.dtype.is_float() {
                    rt.edge = Some(Edge { node, nr: k as u32 });
                }
            }
        }
        let n = &mut self.nodes[node as usize];
        n.outs = out_meta;
        for (_, rt) in &rf.inputs {
            let g = rt.dtype.is_float() && rt.requires_grad();
            n.ins.push(g.then(|| Meta {
                layout: rt.layout.clone(),
                dtype: rt.dtype,
            }));
            n.next.push(if g { rt.edge } else { None });
        }
        self.reentrant_inputs
            .insert(node, rf.inputs.iter().map(|(v, _)| *v).collect());
        self.nodes[node as usize].saved = rf.inputs.into_iter().map(|(_, rt)| rt).collect();
    }

    /// Reruns a checkpointed region's forward (non-reentrant `torch.utils.checkpoint`), keeping what
    /// its nodes save, and stops after the last op that saves something (early stop).
    pub(super) fn recompute(&mut self, f: u32) {
        let g = self.g;
        let range = self.frames[f as usize].range as usize;
        let (start, _end) = (self.ck_ranges[range].start, self.ck_ranges[range].end);
        let Some(stop) = self.frames[f as usize].last_saving_op else {
            self.frames[f as usize].recomputed = true;
            return;
        };
        let saved_kind = self.kind_now;
        self.kind_now = Kind::Pending;
        let st_start = self.storages.len();
        let inputs: Vec<(ValueId, Rt)> = self.frames[f as usize]
            .inputs
            .iter()
            .map(|(v, r)| (*v, r.clone()))
            .collect();
        // The region function's arguments (values Python still holds, like the inputs, stay as
        // they are).
        let mut placed = Vec::new();
        for (v, rt) in &inputs {
            if self.vals[v.0 as usize].is_none() {
                let d = self.dup(rt);
                self.vals[v.0 as usize] = Some(d);
                placed.push(*v);
            }
        }
        self.recompute_saved = Some(FxHashMap::default());
        self.recompute_ops = Some(std::mem::take(&mut self.frames[f as usize].op_nodes));
        let saved_grad = self.grad_mode;
        self.grad_mode = true;
        // `recompute_fn` runs the region under the recompute context (`sac.rs`).
        self.recompute_frame = Some(f);
        for i in start..=stop {
            self.exec_graph_op(i);
        }
        self.recompute_frame = None;
        self.zero3_end_recompute();
        self.grad_mode = saved_grad;
        // _StopRecomputationError: the region function's locals die.
        for i in start..=stop {
            for &v in &g.ops[i].outputs {
                if let Some(rt) = self.vals[v.0 as usize].take() {
                    self.drop_rt(rt);
                }
            }
        }
        for v in placed {
            if let Some(rt) = self.vals[v.0 as usize].take() {
                self.drop_rt(rt);
            }
        }
        self.clear_autocast_cache();
        let saved = self.recompute_saved.take().unwrap_or_default();
        let ops = self.recompute_ops.take().unwrap_or_default();
        let fr = &mut self.frames[f as usize];
        fr.saved = saved;
        fr.op_nodes = ops;
        fr.recomputed = true;
        self.settle_pending(st_start);
        self.kind_now = saved_kind;
    }

    // ------------------------------------------------------------------ forward rules

    /// Outputs of one op: layouts and dtypes as PyTorch's kernels make them, allocated or viewed.
    fn fwd_rule(
        &mut self,
        kind: &OpKind,
        x: &[Rt],
        outs: &[(&[u64], DTypeSpec)],
        m: ModuleId,
    ) -> Fwd {
        use OpKind::*;
        let name = kind.aten_name();
        let op_kind = NodeKind::Op(kind.clone());
        let shape0 = || outs.first().map_or(&[][..], |o| o.0);
        match kind {
            QuantLinear { .. } => self.quant_linear_fwd(kind, x, shape0(), m),
            // Megatron-LM's tensor-parallel collectives and loss (`tp.rs`).
            TpComm(c) => self.tp_comm_fwd(*c, &x[0], shape0(), m),
            VocabParallelCrossEntropy => self.vocab_ce_fwd(x, m),
            // `x.masked_fill_(mask, 0.0)`: in place; derivatives.yaml saves the mask.
            MaskedFillInplace => {
                let v = self.view(&x[0], x[0].layout.clone());
                Fwd::New(vec![v], op_kind, vec![Save::In(1)])
            }
            AutocastLower => Fwd::Alias(self.dup(&x[0])),
            // aten reshape (TensorShape.cpp): a view when computeStride allows, else
            // `_unsafe_view(clone(contiguous))`; views save nothing.
            View | UnsafeView | Reshape => {
                let s = shape0();
                match x[0].layout.view_strides(s) {
                    Some(strides) => {
                        let v = self.view(
                            &x[0],
                            Layout {
                                shape: s.into(),
                                strides,
                            },
                        );
                        Fwd::New(vec![v], NodeKind::Op(View), vec![])
                    }
                    None => {
                        // reshape: `_unsafe_view(self.clone(at::MemoryFormat::Contiguous), shape)`
                        let c = self.alloc(Layout::contiguous(s), x[0].dtype, m, "aten.clone");
                        Fwd::New(vec![c], NodeKind::ReshapeCopy, vec![])
                    }
                }
            }
            Transpose(a, b) => {
                let l = x[0].layout.transpose(*a, *b);
                Fwd::New(vec![self.view(&x[0], l)], op_kind, vec![])
            }
            T => {
                let l = if x[0].layout.dim() == 2 {
                    x[0].layout.transpose(0, 1)
                } else {
                    x[0].layout.clone()
                };
                Fwd::New(vec![self.view(&x[0], l)], op_kind, vec![])
            }
            Permute(p) => {
                let l = x[0].layout.permute(p);
                Fwd::New(vec![self.view(&x[0], l)], op_kind, vec![])
            }
            Expand => {
                let l = x[0].layout.expand(shape0());
                Fwd::New(vec![self.view(&x[0], l)], op_kind, vec![])
            }
            Unsqueeze(d) => {
                let l = x[0].layout.unsqueeze(*d);
                Fwd::New(vec![self.view(&x[0], l)], op_kind, vec![])
            }
            // AdaptiveAveragePooling.cpp: `out.as_strided_(...)` only when the pooled input (the
            // second argument) suggests channels-last; otherwise `out` is returned as it is.
            AsStridedInplace => {
                if x[1].layout.is_channels_last_2d() {
                    let l = x[0].layout.clone();
                    Fwd::New(vec![self.view(&x[0], l)], op_kind, vec![])
                } else {
                    Fwd::Alias(self.dup(&x[0]))
                }
            }
            Slice { dim, .. } => {
                let len = shape0()[*dim];
                let l = x[0].layout.narrow(*dim, len);
                Fwd::New(vec![self.view(&x[0], l)], op_kind, vec![])
            }
            Split { dim } => {
                let mut vs = Vec::new();
                for (s, _) in outs {
                    let l = x[0].layout.narrow(*dim, s[*dim]);
                    vs.push(self.view(&x[0], l));
                }
                Fwd::New(vs, op_kind, vec![])
            }
            Clone { contiguous } => {
                if *contiguous && x[0].layout.is_contiguous() {
                    return Fwd::Alias(self.dup(&x[0]));
                }
                let l = if *contiguous {
                    Layout::contiguous(x[0].shape())
                } else {
                    x[0].layout.empty_like()
                };
                Fwd::New(vec![self.alloc(l, x[0].dtype, m, name)], op_kind, vec![])
            }
            ToDtype(d) => self.copy_to_dtype(&x[0], *d, m),
            ToDtypeOf => {
                let d = x[1].dtype;
                self.copy_to_dtype(&x[0], d, m)
            }
            Add | Sub | Mul | Div => {
                let s = shape0();
                let dt = x[0].dtype.promote(x[1].dtype);
                let l = elementwise_layout(s, &[&x[0].layout, &x[1].layout]);
                let o = self.alloc(l, dt, m, name);
                // derivatives.yaml mul.Tensor saves other if self needs grad and self if other does;
                // div.Tensor saves other (and self for other's grad); add/sub save nothing.
                let saves = match kind {
                    Mul => {
                        let mut v = Vec::new();
                        if x[0].requires_grad() {
                            v.push(Save::In(1));
                        }
                        if x[1].requires_grad() {
                            v.push(Save::In(0));
                        }
                        v
                    }
                    Div => {
                        let mut v = Vec::new();
                        if x[0].requires_grad() || x[1].requires_grad() {
                            v.push(Save::In(1));
                        }
                        if x[1].requires_grad() {
                            v.push(Save::In(0));
                        }
                        v
                    }
                    _ => vec![],
                };
                Fwd::New(vec![o], op_kind, saves)
            }
            AddScalar
            | MulScalar
            | DivScalar
            | Neg
            | PowScalar(_)
            | Rsqrt
            | Tanh
            | Sigmoid
            | Relu
            | Hardtanh
            | Gelu { .. }
            | Silu
            | Hardswish
            | Hardsigmoid => {
                let l = elementwise_layout(x[0].shape(), &[&x[0].layout]);
                let o = self.alloc(l, x[0].dtype, m, name);
                // derivatives.yaml: pow.Tensor_Scalar, gelu, silu save self; rsqrt, tanh, sigmoid,
                // relu save result; hardtanh, hardswish, hardsigmoid save self (`hardtanh_backward(grad, self, min_val,
                // max_val)`); add/mul/div by a scalar and neg save nothing on the device.
                let saves = match kind {
                    PowScalar(_) | Gelu { .. } | Silu | Hardtanh | Hardswish | Hardsigmoid => {
                        vec![Save::In(0)]
                    }
                    Rsqrt | Tanh | Sigmoid | Relu => vec![Save::Out(0)],
                    _ => vec![],
                };
                Fwd::New(vec![o], op_kind, saves)
            }
            // derivatives.yaml mean.dim: only sizes are saved.
            MeanDim { .. } => {
                let o = self.alloc(Layout::contiguous(shape0()), x[0].dtype, m, name);
                Fwd::New(vec![o], op_kind, vec![])
            }
            // derivatives.yaml mm/bmm/addmm: mat2 saved for mat1's grad and mat1 for mat2's.
            Mm | Bmm | Addmm => {
                let (a, b) = if matches!(kind, Addmm) {
                    (1, 2)
                } else {
                    (0, 1)
                };
                let dt = x[a].dtype.promote(x[b].dtype);
                let o = self.alloc(Layout::contiguous(shape0()), dt, m, name);
                // addmm_out_cuda_impl (`native/cuda/Blas.cpp`): the cuBLASLt path
                // (`isInputCompliesAddmmCudaLt`) takes beta 1 with a contiguous bias that squeezes
                // to 1-D of mat2's column count, a float/half/bfloat16 problem, and every dimension
                // of mat1 and mat2 above 1; `mm`/`bmm` and every other `addmm` use cuBLAS.
                let lt = matches!(kind, Addmm) && {
                    let bias = x[0].shape();
                    let (m1, m2) = (x[1].shape(), x[2].shape());
                    x[0].layout.is_contiguous()
                        && (bias.len() == 1 || bias.iter().filter(|&&d| d != 1).count() == 1)
                        && bias.last() == m2.get(1)
                        && matches!(x[1].dtype, DType::F32 | DType::F16 | DType::BF16)
                        && m1.len() == 2
                        && m2.len() == 2
                        && m1.iter().chain(m2).all(|&d| d > 1)
                };
                self.gemm_workspace(lt, m);
                Fwd::New(vec![o], op_kind, gemm_saves(kind, x))
            }
            // derivatives.yaml _softmax / _log_softmax: result saved. PyTorch 1.10's formulas,
            // `_softmax_backward_data(grad, result, dim, self)`, also save the input
            // (pytorch/pytorch#64000, fixed by #65242 in 1.11).
            Softmax { to_f32, .. } => {
                let dt = if *to_f32 { DType::F32 } else { x[0].dtype };
                let o = self.alloc(Layout::contiguous(x[0].shape()), dt, m, name);
                Fwd::New(vec![o], op_kind, self.softmax_saves())
            }
            LogSoftmax { .. } => {
                let o = self.alloc(Layout::contiguous(x[0].shape()), x[0].dtype, m, name);
                Fwd::New(vec![o], op_kind, self.softmax_saves())
            }
            // derivatives.yaml nll_loss_forward: self, target and total_weight saved.
            NllLoss => {
                let o = self.alloc(Layout::contiguous(&[]), x[0].dtype, m, name);
                let w = self.alloc(Layout::contiguous(&[]), x[0].dtype, m, name);
                Fwd::New(
                    vec![o, w],
                    op_kind,
                    vec![Save::In(0), Save::In(1), Save::Out(1)],
                )
            }
            // derivatives.yaml native_layer_norm: input, weight, bias, mean and rstd saved (mean/rstd
            // float32 for 16-bit input, `acc_type` on CUDA).
            LayerNorm => {
                // layer_norm_cuda: `X = input.expect_contiguous()` (a copy of a non-contiguous input,
                // freed when the kernel returns), Y = empty_like(X, contiguous), mean, rstd. The copy
                // is inside the CUDA kernel: a dispatch-mode capture does not see it.
                let xc = if x[0].layout.is_contiguous() || self.r.fidelity != Fidelity::Cuda {
                    None
                } else {
                    Some(self.alloc(
                        Layout::contiguous(x[0].shape()),
                        x[0].dtype,
                        m,
                        "aten.clone",
                    ))
                };
                let o = self.alloc(Layout::contiguous(x[0].shape()), x[0].dtype, m, name);
                let stat_dt = if matches!(x[0].dtype, DType::F16 | DType::BF16) {
                    DType::F32
                } else {
                    x[0].dtype
                };
                let mut stat = x[0].shape().to_vec();
                if let Some(l) = stat.last_mut() {
                    *l = 1;
                }
                let mean = self.alloc(Layout::contiguous(&stat), stat_dt, m, name);
                let rstd = self.alloc(Layout::contiguous(&stat), stat_dt, m, name);
                if let Some(t) = xc {
                    self.drop_rt(t);
                }
                // A LayerNorm without bias (`F.layer_norm(x, shape, w, None)`) saves no bias.
                let mut saves = vec![Save::In(0), Save::In(1)];
                if x.len() > 2 {
                    saves.push(Save::In(2));
                }
                saves.extend([Save::Out(1), Save::Out(2)]);
                Fwd::New(vec![o, mean, rstd], op_kind, saves)
            }
            // derivatives.yaml native_dropout: the bool mask (result1) saved; output new.
            Dropout { .. } => {
                if self.r.inference {
                    // model.eval(): F.dropout(training=False) returns its input.
                    return Fwd::Alias(self.dup(&x[0]));
                }
                let l = x[0].layout.empty_like();
                let (o, mask) = if self.r.fidelity == Fidelity::Cuda {
                    // Dropout.cu, dropout_cuda: `Tensor mask = at::empty_like(self, bool)` before
                    // `Tensor ret = at::empty_like(self)`; the meta kernel makes the output first.
                    let mask = self.alloc(l.clone(), DType::Bool, m, name);
                    (self.alloc(l, x[0].dtype, m, name), mask)
                } else {
                    let o = self.alloc(l.clone(), x[0].dtype, m, name);
                    (o, self.alloc(l, DType::Bool, m, name))
                };
                Fwd::New(vec![o, mask], op_kind, vec![Save::Out(1)])
            }
            // derivatives.yaml embedding: indices saved (and weight's size).
            Embedding => {
                let o = self.alloc(Layout::contiguous(shape0()), x[0].dtype, m, name);
                Fwd::New(vec![o], op_kind, vec![Save::In(1)])
            }
            // derivatives.yaml cat: only sizes and dtypes saved.
            Cat { .. } => {
                let dt = x
                    .iter()
                    .map(|t| t.dtype)
                    .reduce(|a, b| a.promote(b))
                    .unwrap_or(DType::F32);
                let o = self.alloc(Layout::contiguous(shape0()), dt, m, name);
                Fwd::New(vec![o], op_kind, vec![])
            }
            // derivatives.yaml _scaled_dot_product_{flash,efficient,cudnn}_attention: the node
            // saves q, k, v, the output, the logsumexp and the kernel's random-number state.
            Sdpa { backend } => {
                let saves = sdpa_saves(*backend);
                // `--cp`: the context-parallel dispatcher runs PyTorch's ring attention instead
                // of one kernel call (`lower/cp.rs`).
                let outs = if self.r.parallel.cp > 1 {
                    self.ring_attention_fwd(*backend, &x[0], &x[1], &x[2], m, name)
                } else {
                    self.sdpa_kernel_fwd(*backend, &x[0], &x[2], m, name)
                };
                Fwd::New(outs, op_kind, saves)
            }
            // In place: the output is the input's own storage, under a new autograd node.
            // derivatives.yaml relu_ (threshold_): the result is saved; add_: nothing is saved.
            ReluInplace => {
                let v = self.view(&x[0], x[0].layout.clone());
                Fwd::New(vec![v], NodeKind::Op(Relu), vec![Save::Out(0)])
            }
            // hardtanh_ has no derivatives.yaml entry of its own in PyTorch 2.15: autograd's
            // codegen reuses hardtanh's `hardtanh_backward(grad, self, ...)`, and as that formula
            // reads `self`, which the op overwrites, the generated VariableType kernel saves
            // `original_self = self.clone()` (preserve format) before running it in place — on
            // CPU, `F.relu6(h, inplace=True).grad_fn` is `HardtanhBackward0` whose `_saved_self`
            // is not `h`'s storage.
            HardtanhInplace => {
                let c = self.alloc(x[0].layout.empty_like(), x[0].dtype, m, "aten.clone");
                let v = self.view(&x[0], x[0].layout.clone());
                Fwd::New(vec![v], NodeKind::Op(Hardtanh), vec![Save::Extra(c)])
            }
            // silu_ likewise (derivatives.yaml silu: `silu_backward(grad, self)`, no silu_ entry;
            // on CPU `F.silu(h, inplace=True).grad_fn._saved_self` is not `h`'s storage).
            SiluInplace => {
                let c = self.alloc(x[0].layout.empty_like(), x[0].dtype, m, "aten.clone");
                let v = self.view(&x[0], x[0].layout.clone());
                Fwd::New(vec![v], NodeKind::Op(Silu), vec![Save::Extra(c)])
            }
            // hardswish_ / hardsigmoid_ likewise: no entry of their own in derivatives.yaml, the
            // formulas read `self`, so `original_self = self.clone()` is saved (on CPU,
            // `F.hardsigmoid(h, inplace=True)` dispatches `aten.clone` then `aten.hardsigmoid_`).
            HardswishInplace | HardsigmoidInplace => {
                let c = self.alloc(x[0].layout.empty_like(), x[0].dtype, m, "aten.clone");
                let v = self.view(&x[0], x[0].layout.clone());
                let nk = if matches!(kind, HardswishInplace) {
                    Hardswish
                } else {
                    Hardsigmoid
                };
                Fwd::New(vec![v], NodeKind::Op(nk), vec![Save::Extra(c)])
            }
            // Dropout.cpp `_dropout_impl<inplace=true>`: `noise = at::empty_like(input)` (the
            // input's dtype and memory format), bernoulli_ and div_ into it, then
            // `input.mul_(noise)`; MulBackward0 saves `other`, the noise (`self` only if the noise
            // required grad). In eval mode `dropout_` returns its input.
            DropoutInplace { .. } => {
                if self.r.inference {
                    return Fwd::Alias(self.dup(&x[0]));
                }
                let noise = self.alloc(x[0].layout.empty_like(), x[0].dtype, m, "aten.empty_like");
                let v = self.view(&x[0], x[0].layout.clone());
                Fwd::New(vec![v], op_kind, vec![Save::Extra(noise)])
            }
            // derivatives.yaml avg_pool2d: self saved; the output a new tensor.
            AvgPool2d { .. } => {
                let o = self.alloc(Layout::contiguous(shape0()), x[0].dtype, m, name);
                Fwd::New(vec![o], op_kind, vec![Save::In(0)])
            }
            // What the capture recorded (`vramsim.from_module`'s fallback): the new tensors
            // autograd saved (only when a node is made: under no_grad nothing is saved), then the
            // outputs, views of an input or new contiguous tensors.
            Recorded(rec) => {
                let dtype_of = |s: &mut Self, d: &crate::ops::RecordedDType| match d {
                    crate::ops::RecordedDType::Like(j) => x[*j].dtype,
                    crate::ops::RecordedDType::Spec(spec) => s.resolve(*spec),
                };
                let node = rec.grad && self.grad_mode && x.iter().any(Rt::requires_grad);
                let mut saves = Vec::new();
                if node {
                    for sv in &rec.saves {
                        saves.push(match sv {
                            crate::ops::RecordedSave::In(j) => Save::In(*j),
                            crate::ops::RecordedSave::Out(k) => Save::Out(*k),
                            crate::ops::RecordedSave::New(shape, d) => {
                                let dt = dtype_of(self, d);
                                Save::Extra(self.alloc(Layout::contiguous(shape), dt, m, name))
                            }
                        });
                    }
                }
                let mut vs = Vec::new();
                for (k, (shape, spec)) in outs.iter().enumerate() {
                    vs.push(match rec.outs.get(k) {
                        // In place: the argument's own layout.
                        Some(crate::ops::RecordedOut::InPlace(j)) => {
                            self.view(&x[*j], x[*j].layout.clone())
                        }
                        // A view: the strides the capture saw (contiguous when not recorded), so
                        // a later reshape copies where PyTorch's does.
                        Some(crate::ops::RecordedOut::View(j)) => {
                            let l = match rec.view_strides.get(k).cloned().flatten() {
                                Some(strides) if strides.len() == shape.len() => Layout {
                                    shape: (*shape).into(),
                                    strides: strides.into(),
                                },
                                _ => Layout::contiguous(shape),
                            };
                            self.view(&x[*j], l)
                        }
                        Some(crate::ops::RecordedOut::New(d)) => {
                            let dt = dtype_of(self, d);
                            self.alloc(Layout::contiguous(shape), dt, m, name)
                        }
                        None => {
                            let dt = self.resolve(*spec);
                            self.alloc(Layout::contiguous(shape), dt, m, name)
                        }
                    });
                }
                Fwd::New(vs, op_kind, saves)
            }
            AddInplace { composite } => {
                if *composite && self.r.fidelity == Fidelity::MetaCapture {
                    // at::linear: `isTensorSubclassLike` is true under a dispatch mode, so the
                    // bias goes in with an out-of-place `at::add(output, bias)`.
                    let s = x[0].shape().to_vec();
                    let dt = x[0].dtype.promote(x[1].dtype);
                    let l = elementwise_layout(&s, &[&x[0].layout, &x[1].layout]);
                    let o = self.alloc(l, dt, m, "aten.add");
                    return Fwd::New(vec![o], NodeKind::Op(Add), vec![]);
                }
                let v = self.view(&x[0], x[0].layout.clone());
                Fwd::New(vec![v], NodeKind::Op(Add), vec![])
            }
            // derivatives.yaml convolution: input and weight saved. cuDNN allocates the output and
            // adds the bias in place (`output.add_(reshape_bias(...))`); its workspace comes from
            // the caching allocator too but is not modelled (it depends on the algorithm cuDNN
            // picks).
            //
            // Memory format (`aten/src/ATen/native/Convolution.cpp` `_convolution` with
            // `cudnn_conv_suggest_memory_format`, `ConvUtils.h`): channels-last when the input or
            // the weight suggests it (a `permute(0, 3, 1, 2)` of a contiguous NHWC tensor does),
            // else contiguous; the input is made `contiguous(that format)` first (a copy freed on
            // return when it is in neither), and the output is allocated in that format. The copy
            // happens inside the CUDA kernel, which a dispatch-mode capture does not see.
            Conv2d { .. } => {
                let dt = x[0].dtype.promote(x[1].dtype);
                let cl = conv_channels_last(&x[0].layout, &x[1].layout);
                let copy = if self.r.fidelity != Fidelity::Cuda || in_conv_format(&x[0].layout, cl)
                {
                    None
                } else {
                    Some(self.alloc(conv_layout(x[0].shape(), cl), x[0].dtype, m, "aten.clone"))
                };
                // The meta kernel (a dispatch-mode capture) returns a contiguous output whatever
                // the input's format (observed with torch 2.15 on the meta device).
                let out_cl = cl && self.r.fidelity == Fidelity::Cuda;
                let o = self.alloc(conv_layout(shape0(), out_cl), dt, m, name);
                let key = format!("fwd {kind:?} {:?} {:?} {dt:?}", x[0].shape(), x[1].shape());
                self.conv_benchmark(key);
                if let Some(t) = copy {
                    self.drop_rt(t);
                }
                Fwd::New(vec![o], op_kind, vec![Save::In(0), Save::In(1)])
            }
            // derivatives.yaml native_batch_norm / cudnn_batch_norm: input, weight, running_mean,
            // running_var, save_mean and save_invstd saved. Statistics `[C]` in `acc_type` (float32
            // for 16-bit input); empty in eval mode.
            BatchNorm => {
                let o = self.alloc(Layout::contiguous(x[0].shape()), x[0].dtype, m, name);
                let c = if self.r.inference {
                    0
                } else {
                    x[0].shape().get(1).copied().unwrap_or(0)
                };
                let stat_dt = if matches!(x[0].dtype, DType::F16 | DType::BF16) {
                    DType::F32
                } else {
                    x[0].dtype
                };
                let mean = self.alloc(Layout::contiguous(&[c]), stat_dt, m, name);
                let invstd = self.alloc(Layout::contiguous(&[c]), stat_dt, m, name);
                Fwd::New(
                    vec![o, mean, invstd],
                    op_kind,
                    vec![
                        Save::In(0),
                        Save::In(1),
                        Save::In(3),
                        Save::In(4),
                        Save::Out(1),
                        Save::Out(2),
                    ],
                )
            }
            // derivatives.yaml max_pool2d_with_indices: self and the indices (result1) saved.
            MaxPool2d { .. } => {
                let s = shape0();
                let o = self.alloc(Layout::contiguous(s), x[0].dtype, m, name);
                let idx = self.alloc(Layout::contiguous(s), DType::I64, m, name);
                Fwd::New(vec![o, idx], op_kind, vec![Save::In(0), Save::Out(1)])
            }
            // derivatives.yaml mean.dim: only sizes saved.
            MeanDims { .. } => {
                let o = self.alloc(Layout::contiguous(shape0()), x[0].dtype, m, name);
                Fwd::New(vec![o], op_kind, vec![])
            }
            // derivatives.yaml _adaptive_avg_pool2d: self saved.
            AdaptiveAvgPool2d { .. } => {
                let o = self.alloc(Layout::contiguous(shape0()), x[0].dtype, m, name);
                Fwd::New(vec![o], op_kind, vec![Save::In(0)])
            }
            // select: a view without the dimension; only sizes saved.
            Select { dim, .. } => {
                let mut l = x[0].layout.clone();
                l.shape.remove(*dim);
                l.strides.remove(*dim);
                Fwd::New(vec![self.view(&x[0], l)], op_kind, vec![])
            }
            // aten.index (advanced indexing): a new tensor; derivatives.yaml index.Tensor saves
            // the indices (and self's sizes).
            Index => {
                let o = self.alloc(Layout::contiguous(shape0()), x[0].dtype, m, name);
                let saves = (1..x.len()).map(Save::In).collect();
                Fwd::New(vec![o], op_kind, saves)
            }
            // derivatives.yaml sum.dim_IntList: only sizes are saved.
            SumDim { .. } => {
                let o = self.alloc(Layout::contiguous(shape0()), x[0].dtype, m, name);
                Fwd::New(vec![o], op_kind, vec![])
            }
            // aten.topk: values and int64 indices (TensorCompare/Sorting: `values`, `indices` out
            // tensors); derivatives.yaml topk saves the indices.
            TopK { .. } => {
                let l = Layout::contiguous(shape0());
                let v = self.alloc(l.clone(), x[0].dtype, m, name);
                let i = self.alloc(l, DType::I64, m, name);
                Fwd::New(vec![v, i], op_kind, vec![Save::Out(1)])
            }
            // aten._grouped_mm: a new `[M, N]` tensor; derivatives.yaml saves self, mat2 and offs
            // (`_grouped_mm_mat1_backward(grad, mat2, ..., offs, 1)`, `_mat2_backward(grad, self, ..., offs, 1)`).
            GroupedMm => {
                let o = self.alloc(Layout::contiguous(shape0()), x[0].dtype, m, name);
                Fwd::New(
                    vec![o],
                    op_kind,
                    vec![Save::In(0), Save::In(1), Save::In(2)],
                )
            }
            // mse_loss (aten/src/ATen/native/Loss.cpp, structured): the meta function's
            // `build_borrowing_binary_op` gives the scalar result the promoted dtype; then the
            // elementwise loss (promoted dtype) is reduced into it by `mean_out` and freed.
            // derivatives.yaml mse_loss: self and target saved.
            MseLoss => {
                let dt = x[0].dtype.promote(x[1].dtype);
                let o = self.alloc(Layout::contiguous(&[]), dt, m, name);
                // (The meta device runs the meta function only: no elementwise temporary.)
                if self.r.fidelity == Fidelity::Cuda {
                    let l = elementwise_layout(x[0].shape(), &[&x[0].layout, &x[1].layout]);
                    let t = self.alloc(l, dt, m, name);
                    self.drop_rt(t);
                }
                Fwd::New(vec![o], op_kind, vec![Save::In(0), Save::In(1)])
            }
            // masked_fill (TensorAdvancedIndexing.cpp): `self.clone(at::MemoryFormat::Contiguous)`
            // then `masked_fill_` on the copy; derivatives.yaml saves the mask.
            MaskedFill => {
                let o = self.alloc(Layout::contiguous(x[0].shape()), x[0].dtype, m, name);
                Fwd::New(vec![o], op_kind, vec![Save::In(1)])
            }
            Factory { temps, .. } => {
                for (s, d) in temps {
                    let t = self.alloc(Layout::contiguous(s), *d, m, name);
                    self.drop_rt(t);
                }
                let mut vs = Vec::new();
                for (s, d) in outs {
                    let dt = self.resolve(*d);
                    vs.push(self.alloc(Layout::contiguous(s), dt, m, name));
                }
                Fwd::New(vs, op_kind, vec![])
            }
        }
    }

    fn copy_to_dtype(&mut self, x: &Rt, d: DType, m: ModuleId) -> Fwd {
        if x.dtype == d {
            return Fwd::Alias(self.dup(x));
        }
        let o = self.alloc(x.layout.empty_like(), d, m, "aten._to_copy");
        Fwd::New(vec![o], NodeKind::Op(OpKind::ToDtype(d)), vec![])
    }

    /// `loss / accum` for gradient accumulation, and `scaler.scale(loss)` (`loss * scaler._scale`)
    /// when the step runs under a GradScaler ([`crate::Recipe::uses_grad_scaler`]). Returns the
    /// tensor `backward` starts from and, under a scaler, the caller's unscaled `loss`: in
    /// `scaler.scale(loss).backward()` (`torch/amp/grad_scaler.py`, `GradScaler.scale` returns
    /// `outputs * self._scale`, a new tensor) the Python name `loss` still references it, so it
    /// lives through backward until the training loop's `del loss`.
    pub(super) fn finish_loss(&mut self, loss: Rt) -> (Rt, Option<Rt>) {
        let mut loss = loss;
        if self.r.accum > 1 {
            let out = self
                .exec(
                    &OpKind::DivScalar,
                    std::slice::from_ref(&loss),
                    &[],
                    ModuleId(0),
                    None,
                )
                .pop()
                .expect("one output");
            self.drop_rt(loss);
            loss = out;
        }
        if self.r.uses_grad_scaler() {
            if self.scaler.is_empty() {
                // GradScaler._lazy_init_scale_growth_tracker: float32 scale, int32 growth tracker.
                self.kind_now = Kind::Other;
                let s = self.alloc(
                    Layout::contiguous(&[]),
                    DType::F32,
                    ModuleId(0),
                    "GradScaler._scale",
                );
                let t = self.alloc(
                    Layout::contiguous(&[]),
                    DType::I32,
                    ModuleId(0),
                    "GradScaler._growth_tracker",
                );
                self.scaler = vec![s, t];
                self.kind_now = Kind::Temporary;
            }
            let scale = self.scaler[0].clone();
            let out = self
                .exec(&OpKind::Mul, &[loss.clone(), scale], &[], ModuleId(0), None)
                .pop()
                .expect("one output");
            return (out, Some(loss));
        }
        (loss, None)
    }
}

/// Whether cuDNN runs a convolution over `input` and `weight` channels-last
/// (`cudnn_conv_suggest_memory_format`: either suggests `ChannelsLast`).
pub(super) fn conv_channels_last(input: &Layout, weight: &Layout) -> bool {
    input.is_channels_last_2d() || weight.is_channels_last_2d()
}

/// A dense layout of `shape` in the convolution's memory format.
pub(super) fn conv_layout(shape: &[u64], channels_last: bool) -> Layout {
    if channels_last && shape.len() == 4 {
        Layout::channels_last(shape)
    } else {
        Layout::contiguous(shape)
    }
}

/// Whether `l` is already `contiguous(memory_format)` for the convolution's format.
pub(super) fn in_conv_format(l: &Layout, channels_last: bool) -> bool {
    if channels_last {
        l.is_channels_last_contiguous()
    } else {
        l.is_contiguous()
    }
}
