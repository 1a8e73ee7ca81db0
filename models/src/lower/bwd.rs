//! The backward pass: the autograd engine's scheduling (`torch/csrc/autograd/engine.cpp`) and each
//! node's gradient formula (`tools/autograd/derivatives.yaml`, `FunctionsManual.cpp`) as
//! allocations.

use super::{Edge, Kind, Lowering, Meta, NodeKind, Rt};
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::graph::ValueId;
use crate::layout::{elementwise_layout, numel, Layout};
use crate::ops::{FusedSdpa, OpKind, RecordedDType, RecordedGrad, RecordedOut, RecordedStep};
use crate::recipe::Fidelity;
use std::collections::BinaryHeap;

fn round_up(x: u64, m: u64) -> u64 {
    x.div_ceil(m) * m
}

impl<'g> Lowering<'g> {
    /// `loss.backward()`: seeds `ones_like(loss)` and runs the engine to completion.
    pub(super) fn backward(&mut self, loss: &Rt) {
        if self.backward_run(loss) {
            self.release_graph();
        }
    }

    /// `loss.backward()` without the graph's release (a pipeline stage releases the graph of its
    /// micro-batch only, `pipeline.rs`); false when the loss requires no grad.
    pub(super) fn backward_run(&mut self, loss: &Rt) -> bool {
        self.kind_now = Kind::Temporary;
        let Some(root) = loss.edge else { return false };
        // torch.autograd.backward: grad_tensors = ones_like(loss), held until backward returns.
        let seed = self.alloc(
            Layout::contiguous(loss.shape()),
            loss.dtype,
            ModuleId(0),
            "aten.ones_like",
        );
        let s = self.dup(&seed);
        self.run_backward(root, s, Some(seed));
        true
    }

    /// The engine's run from `root` with gradient `grad` (its input buffer's reference), then the
    /// graph's release; `held`: the caller's reference on the gradient, dropped when the engine
    /// is done (`loss.backward()`'s `grad_tensors`).
    pub(super) fn backward_seeded(&mut self, root: Edge, grad: Rt, held: Option<Rt>) {
        self.run_backward(root, grad, held);
        self.release_graph();
    }

    /// [`Self::backward_seeded`] without the graph's release.
    pub(super) fn run_backward(&mut self, root: Edge, grad: Rt, held: Option<Rt>) {
        // CUDA backward runs on the autograd engine's device thread (its own cuBLAS handle).
        self.in_backward = true;
        self.run_engine(vec![(root, grad)]);
        self.in_backward = false;
        if let Some(seed) = held {
            self.drop_rt(seed);
        }
    }

    /// The node index below which the nodes outlive a backward (the `AccumulateGrad` nodes).
    pub(super) fn persistent_nodes(&self) -> usize {
        self.acc_nodes
            .iter()
            .flatten()
            .map(|&n| n + 1)
            .max()
            .unwrap_or(0) as usize
    }

    /// The graph is freed after its backward: only the `AccumulateGrad` nodes stay.
    fn release_graph(&mut self) {
        let keep = self.persistent_nodes();
        self.release_nodes(keep..self.nodes.len());
        self.nodes.truncate(keep);
        self.seq = 0;
        // `.grad` of leaves made by `enable_input_require_grads` dies with their AccumulateGrad.
        self.release_leaves(0..self.leaf_grads.len());
        self.leaf_grads.clear();
        self.reentrant_inputs.clear();
        self.release_frames(0..self.frames.len());
        self.frames.clear();
    }

    /// What the nodes `range` saved.
    pub(super) fn release_nodes(&mut self, range: std::ops::Range<usize>) {
        for n in range {
            for t in std::mem::take(&mut self.nodes[n].saved) {
                self.drop_rt(t);
            }
            self.reentrant_inputs.remove(&(n as u32));
        }
    }

    /// `.grad` of the leaves of slots `range`.
    pub(super) fn release_leaves(&mut self, range: std::ops::Range<usize>) {
        for i in range {
            if let Some(t) = self.leaf_grads[i].take() {
                self.drop_rt(t);
            }
        }
    }

    /// Checkpoint frames `range` whose nodes never ran.
    pub(super) fn release_frames(&mut self, range: std::ops::Range<usize>) {
        for f in range {
            let saved: Vec<Rt> = self.frames[f].saved.drain().flat_map(|(_, v)| v).collect();
            for t in saved {
                self.drop_rt(t);
            }
            // The frame's inputs and its selective-checkpoint storage (both idempotent).
            self.free_frame(f as u32);
        }
    }

    /// One graph task of the engine (`Engine::execute`): `roots` are the edges the gradients start
    /// at (the `GraphRoot`'s next edges) with their gradients. Dependencies count the edges that
    /// reach each node from the roots (`compute_dependencies`); the ready queue runs the ready node
    /// with the highest sequence number. A reentrant call (`torch.autograd.backward` inside a node,
    /// on the same device thread) runs its own task to completion before the outer one goes on: the
    /// device thread's ready queue puts deeper reentrant tasks first.
    fn run_engine(&mut self, roots: Vec<(Edge, Rt)>) {
        // Per-node state indexed by node number (nodes are numbered densely; a node made while the
        // task runs, by a reentrant task, gets its slot when first touched).
        let n_nodes = self.nodes.len();
        let mut deps: Vec<u32> = vec![0; n_nodes];
        let mut seen: Vec<bool> = vec![false; n_nodes];
        let mut stack: Vec<u32> = Vec::new();
        let mark = |seen: &mut Vec<bool>, n: u32| -> bool {
            let i = n as usize;
            if i >= seen.len() {
                seen.resize(i + 1, false);
            }
            !std::mem::replace(&mut seen[i], true)
        };
        for (e, _) in &roots {
            if mark(&mut seen, e.node) {
                stack.push(e.node);
            }
        }
        let root_nodes = stack.clone();
        while let Some(n) = stack.pop() {
            for e in self.nodes[n as usize].next.iter().flatten() {
                let i = e.node as usize;
                if i >= deps.len() {
                    deps.resize(i + 1, 0);
                }
                deps[i] += 1;
                if mark(&mut seen, e.node) {
                    stack.push(e.node);
                }
            }
        }
        let mut buffers: Vec<Option<Vec<Option<Rt>>>> = Vec::new();
        buffers.resize_with(n_nodes, || None);
        let mut ready: BinaryHeap<(u64, u32)> = BinaryHeap::new();
        for (e, g) in roots {
            self.buffer_add(&mut buffers, e, g);
        }
        for n in root_nodes {
            if deps.get(n as usize).copied().unwrap_or(0) == 0 {
                ready.push((self.nodes[n as usize].seq, n));
            }
        }
        while let Some((_, n)) = ready.pop() {
            let inputs = buffers
                .get_mut(n as usize)
                .and_then(Option::take)
                .unwrap_or_default();
            self.fsdp_backward_node(n);
            self.zero3_backward_node(n);
            let outputs = self.evaluate(n, inputs);
            for (i, out) in outputs.into_iter().enumerate() {
                let Some(out) = out else { continue };
                match self.nodes[n as usize].next.get(i).copied().flatten() {
                    Some(e) => {
                        self.buffer_add(&mut buffers, e, out);
                        let d = &mut deps[e.node as usize];
                        *d = d.checked_sub(1).expect("dependency counted");
                        if *d == 0 {
                            ready.push((self.nodes[e.node as usize].seq, e.node));
                        }
                    }
                    None => self.drop_rt(out),
                }
            }
        }
        // Anything left in buffers (nodes never made ready) dies with the graph task.
        for b in buffers.into_iter().flatten() {
            for t in b.into_iter().flatten() {
                self.drop_rt(t);
            }
        }
    }

    /// `CheckpointFunction.backward` (reentrant `torch.utils.checkpoint`, `torch/utils/checkpoint.py`)
    /// for region `range`, called with the gradients of the region's outputs (`args`):
    ///
    /// 1. `detached_inputs = detach_variable(tuple(inputs))`: views of the saved inputs; those that
    ///    required grad become leaves (their `AccumulateGrad` stores `.grad`).
    /// 2. `with torch.enable_grad(), autocast(...): outputs = ctx.run_function(*detached_inputs)`:
    ///    the whole region again, building its graph and saving what its nodes save (no early
    ///    stop); the region function's locals die as it returns, leaving `outputs`; leaving the
    ///    autocast context on the engine's thread empties that thread's cast cache.
    /// 3. `torch.autograd.backward(outputs_with_grad, args_with_grad)`: a reentrant graph task over
    ///    the region's graph, down to the detached inputs, each node releasing what it saved.
    /// 4. `grads = tuple(inp.grad ...)` is returned; `detached_inputs` and `outputs` die with the
    ///    frame, and with `outputs` the rest of the region's graph. The caller
    ///    ([`Self::evaluate`]) then releases `args` and the saved inputs.
    fn reentrant_backward(&mut self, n: u32, range: u32, grads: &[Option<Rt>]) -> Vec<Option<Rt>> {
        let ck = &self.ck_ranges[range as usize];
        let (start, end) = (ck.start, ck.end);
        let outputs = ck.outputs.clone();
        let g = self.g;
        let ids = self.reentrant_inputs.get(&n).cloned().unwrap_or_default();
        let saved: Vec<Rt> = self.nodes[n as usize].saved.clone();
        let kind_before = self.kind_now;
        self.kind_now = Kind::Pending;
        let st_start = self.storages.len();
        // The values the rerun binds: whatever the lowering holds under those ids is set aside.
        let mut restore = Vec::new();
        for &v in ids
            .iter()
            .chain(g.ops[start..end].iter().flat_map(|op| op.outputs.iter()))
        {
            if let Some(rt) = self.vals[v.0 as usize].take() {
                restore.push((v, rt));
            }
        }
        // detach_variable: `x = inp.detach(); x.requires_grad = inp.requires_grad`.
        let mut detached: Vec<(ValueId, Rt, Option<u32>)> = Vec::new();
        for (v, rt) in ids.iter().zip(&saved) {
            let mut d = self.dup(rt);
            d.edge = None;
            let mut slot = None;
            if rt.dtype.is_float() && rt.requires_grad() {
                let (leaf, sl) = self.new_leaf(rt);
                d.edge = Some(Edge { node: leaf, nr: 0 });
                slot = Some(sl);
            }
            detached.push((*v, d, slot));
        }
        let first_node = self.nodes.len();
        // run_function(*detached_inputs)
        for (v, d, _) in &detached {
            let a = self.dup(d);
            self.vals[v.0 as usize] = Some(a);
        }
        let saved_grad = self.grad_mode;
        self.grad_mode = true;
        self.in_reentrant_recompute = true;
        for i in start..end {
            self.exec_graph_op(i);
        }
        self.zero3_end_recompute();
        self.in_reentrant_recompute = false;
        self.grad_mode = saved_grad;
        let outs: Vec<Option<Rt>> = outputs
            .iter()
            .map(|v| self.vals[v.0 as usize].take())
            .collect();
        for i in start..end {
            for &v in &g.ops[i].outputs {
                if let Some(rt) = self.vals[v.0 as usize].take() {
                    self.drop_rt(rt);
                }
            }
        }
        for (v, _, _) in &detached {
            if let Some(rt) = self.vals[v.0 as usize].take() {
                self.drop_rt(rt);
            }
        }
        self.clear_autocast_cache();
        self.settle_pending(st_start);
        self.kind_now = kind_before;
        // torch.autograd.backward(outputs_with_grad, args_with_grad)
        let mut roots = Vec::new();
        for (k, o) in outs.iter().enumerate() {
            if let (Some(o), Some(Some(gr))) = (o, grads.get(k)) {
                if let Some(e) = o.edge {
                    let a = self.dup(gr);
                    roots.push((e, a));
                }
            }
        }
        self.run_engine(roots);
        // grads = tuple(inp.grad for inp in detached_inputs), returned; then the frame's locals go.
        let mut result: Vec<Option<Rt>> = Vec::with_capacity(detached.len());
        for (_, _, slot) in &detached {
            result.push(slot.and_then(|s| self.leaf_grads[s as usize].take()));
        }
        for (_, d, _) in detached {
            self.drop_rt(d);
        }
        for o in outs.into_iter().flatten() {
            self.drop_rt(o);
        }
        // The region's graph dies with `outputs`: nodes that did not run release what they saved.
        for i in first_node..self.nodes.len() {
            for t in std::mem::take(&mut self.nodes[i].saved) {
                self.drop_rt(t);
            }
        }
        for (v, rt) in restore {
            self.vals[v.0 as usize] = Some(rt);
        }
        result
    }

    /// `AccumulateGrad` of a detached input (a leaf that is not a parameter): the first gradient
    /// is stolen when the engine holds its only reference and it obeys the input's layout
    /// (`AccumulateGrad::accumulateGrad`), else cloned; a later one is added in place.
    fn leaf_accumulate(&mut self, n: u32, slot: u32, g: Rt) {
        if self.leaf_grads[slot as usize].is_some() {
            self.drop_rt(g);
            return;
        }
        let meta = self.nodes[n as usize].ins[0].clone().expect("float leaf");
        let l = &meta.layout;
        let obeys = g.layout.shape == l.shape
            && (0..l.dim()).all(|d| {
                if l.shape[d] != 1 {
                    g.layout.strides[d] == l.strides[d]
                } else {
                    g.layout.strides[d] != 0
                }
            });
        let grad = if self.refs(&g) == 1 && obeys && g.dtype == meta.dtype {
            g
        } else {
            let c = self.alloc(
                Layout::contiguous(&l.shape),
                g.dtype,
                self.nodes[n as usize].module,
                "aten.clone",
            );
            self.drop_rt(g);
            c
        };
        self.leaf_grads[slot as usize] = Some(Rt { edge: None, ..grad });
    }

    /// `InputBuffer::add`: the first gradient is stored, later ones are summed
    /// (`InputBuffer::accumulate`, in place on CUDA when the engine holds the last reference to a
    /// gradient that is not a view).
    fn buffer_add(&mut self, buffers: &mut Vec<Option<Vec<Option<Rt>>>>, e: Edge, g: Rt) {
        let n_in = self.nodes[e.node as usize]
            .outs
            .len()
            .max(self.nodes[e.node as usize].ins.len())
            .max(e.nr as usize + 1);
        let i = e.node as usize;
        if i >= buffers.len() {
            buffers.resize_with(i + 1, || None);
        }
        let buf = buffers[i].get_or_insert_with(|| vec![None; n_in]);
        if buf.len() <= e.nr as usize {
            buf.resize(e.nr as usize + 1, None);
        }
        let old = buf[e.nr as usize].take();
        let new = match old {
            None => g,
            Some(old) => self.accumulate(old, g, self.nodes[e.node as usize].module),
        };
        buffers[i].as_mut().expect("inserted")[e.nr as usize] = Some(new);
    }

    fn accumulate(&mut self, old: Rt, new: Rt, m: ModuleId) -> Rt {
        // input_buffer.cpp, accumulate: `old_var.add_(var)` when can_accumulate_inplace(old_var) —
        // dense, and the buffer holds the last reference to it and to its storage — else
        // `old_var + var` (a dense `var` is never the one reused). A view gradient (`grad.t()`,
        // `grad.view(...)`) keeps its base alive (`ViewInfo::base_`), a second holder of the storage,
        // so it is summed out of place: measured on an H100 with PyTorch 2.11 (a tied embedding's
        // two gradients, `validate/README.md`).
        if self.r.fidelity == Fidelity::Cuda
            && !old.view
            && self.refs(&old) == 1
            && old.layout.is_non_overlapping_and_dense()
            && old.layout.shape == new.layout.shape
        {
            self.drop_rt(new);
            return old;
        }
        let l = elementwise_layout(old.shape(), &[&old.layout, &new.layout]);
        let out = self.alloc(l, old.dtype.promote(new.dtype), m, "aten.add");
        let edge = old.edge;
        self.drop_rt(old);
        self.drop_rt(new);
        Rt { edge, ..out }
    }

    /// `Engine::evaluate_function` for node `n`: recompute if checkpointed, apply the formula,
    /// `validate_outputs`, release the incoming gradients, then the saved tensors.
    fn evaluate(&mut self, n: u32, inputs: Vec<Option<Rt>>) -> Vec<Option<Rt>> {
        if let Some(f) = self.nodes[n as usize].ckpt {
            if !self.frames[f as usize].recomputed {
                self.recompute(f);
            }
        }
        if let NodeKind::Leaf(slot) = self.nodes[n as usize].kind {
            let mut inputs = inputs;
            if let Some(g) = inputs.first_mut().and_then(|g| g.take()) {
                self.leaf_accumulate(n, slot, g);
            }
            for t in inputs.into_iter().flatten() {
                self.drop_rt(t);
            }
            return vec![];
        }
        if let NodeKind::Accumulate(p) = self.nodes[n as usize].kind {
            // AccumulateGrad takes the buffer's gradient itself (std::move(grads[0])).
            let mut inputs = inputs;
            if let Some(g) = inputs.first_mut().and_then(|g| g.take()) {
                self.accumulate_grad(p, g);
            }
            return vec![];
        }
        let mut outs = self.apply(n, &inputs);
        // A Python `autograd.Function` (Megatron's collectives and loss): `PyNode::apply` moves
        // the engine's inputs into its Python argument tuple (`inputs.clear()`), which dies when
        // the call returns, so the incoming gradients go before `validate_outputs`
        // (`torch/csrc/autograd/python_function.cpp`); a C++ node keeps them until
        // `call_function` returns (`engine.cpp`), after it.
        let mut inputs = inputs;
        if matches!(
            self.nodes[n as usize].kind,
            NodeKind::Op(OpKind::TpComm(_) | OpKind::VocabParallelCrossEntropy)
        ) {
            for t in inputs.drain(..).flatten() {
                self.drop_rt(t);
            }
        }
        // Checkpointed node: the unpack hook hands over the recomputed tensors (dropping the
        // frame's entry), and they die with `apply`'s locals, in reverse order of unpacking,
        // before `validate_outputs`.
        if let Some(f) = self.nodes[n as usize].ckpt {
            let kept = self.frames[f as usize].saved.remove(&n).unwrap_or_default();
            for t in kept.into_iter().rev() {
                self.drop_rt(t);
            }
        }
        // validate_outputs: reduce broadcast gradients (sum_to) and cast to the input's dtype.
        let m = self.nodes[n as usize].module;
        // The node's input metadata, borrowed while the gradients are conformed (`conform` does
        // not read nodes) and put back after.
        let ins = std::mem::take(&mut self.nodes[n as usize].ins);
        for (i, slot) in outs.iter_mut().enumerate() {
            let Some(g) = slot.take() else { continue };
            let meta = ins.get(i).and_then(Option::as_ref);
            let has_edge = self.nodes[n as usize]
                .next
                .get(i)
                .copied()
                .flatten()
                .is_some();
            let g = match (meta, has_edge) {
                (Some(meta), true) => self.conform(g, meta, m),
                (_, true) => g,
                (_, false) => {
                    self.drop_rt(g);
                    continue;
                }
            };
            // An FSDP2 unsharded parameter's `grad_dtype` is the next node's input dtype.
            let acc = self.nodes[n as usize].next[i].and_then(|e| {
                match self.nodes[e.node as usize].kind {
                    NodeKind::Accumulate(p) => Some(p),
                    _ => None,
                }
            });
            let g = match acc.and_then(|p| self.fsdp_grad_dtype(p)) {
                Some(d) if d != g.dtype => {
                    let o = self.alloc(g.layout.empty_like(), d, m, "aten._to_copy");
                    self.drop_rt(g);
                    o
                }
                _ => g,
            };
            *slot = Some(g);
        }
        self.nodes[n as usize].ins = ins;
        for t in inputs.into_iter().flatten() {
            self.drop_rt(t);
        }
        let saved = std::mem::take(&mut self.nodes[n as usize].saved);
        for t in saved {
            self.drop_rt(t);
        }
        if let Some(f) = self.nodes[n as usize].ckpt.take() {
            let fr = &mut self.frames[f as usize];
            fr.pending = fr.pending.saturating_sub(1);
            if fr.pending == 0 {
                self.free_frame(f);
            }
        }
        outs
    }

    fn conform(&mut self, g: Rt, meta: &Meta, m: ModuleId) -> Rt {
        let mut g = g;
        if g.layout.shape != meta.layout.shape {
            // at::sum_to(grad, shape)
            let o = self.alloc(
                Layout::contiguous(&meta.layout.shape),
                g.dtype,
                m,
                "aten.sum",
            );
            self.drop_rt(g);
            g = o;
        }
        if g.dtype != meta.dtype {
            let o = self.alloc(g.layout.empty_like(), meta.dtype, m, "aten._to_copy");
            self.drop_rt(g);
            g = o;
        }
        g
    }

    /// `grad.reshape(shape)`: a view when the strides allow, else a contiguous copy.
    fn reshape_grad(&mut self, g: &Rt, shape: &[u64], m: ModuleId) -> Rt {
        match g.layout.view_strides(shape) {
            Some(strides) => self.view(
                g,
                Layout {
                    shape: shape.into(),
                    strides,
                },
            ),
            None => self.alloc(Layout::contiguous(shape), g.dtype, m, "aten.clone"),
        }
    }

    /// The layout `mm_mat1_backward`/`mm_mat2_backward` give: column-major when the input was.
    fn mm_grad_layout(meta: &Meta) -> Layout {
        let l = &meta.layout;
        if l.dim() == 2 && l.strides[0] == 1 && l.strides[1] == l.shape[0] && l.shape[1] > 1 {
            Layout::contiguous(&[l.shape[1], l.shape[0]]).transpose(0, 1)
        } else {
            Layout::contiguous(&l.shape)
        }
    }

    /// One fused SDPA backward kernel call on `q`, `k`, `v` (their layouts): grad_q/k/v in their
    /// inputs' stride order — flash `empty_like(q)`, mem-efficient `empty_strided(query.sizes(),
    /// query.strides())`, cuDNN `empty_like(query)` — plus the kernel's float32 workspaces,
    /// freed before it returns.
    pub(super) fn sdpa_kernel_bwd(
        &mut self,
        backend: FusedSdpa,
        q: &Meta,
        kk: &Meta,
        v: &Meta,
        m: ModuleId,
    ) -> [Rt; 3] {
        let (b, h, s, d) = (
            q.layout.shape[0],
            q.layout.shape[1],
            q.layout.shape[2],
            q.layout.shape[3],
        );
        let name = match backend {
            FusedSdpa::Flash => "aten._scaled_dot_product_flash_attention_backward",
            FusedSdpa::MemEfficient => "aten._scaled_dot_product_efficient_attention_backward",
            FusedSdpa::Cudnn => "aten._scaled_dot_product_cudnn_attention_backward",
        };
        // Flash's `mha_bwd` works on the transposed q_t = q.transpose(1, 2) ([B, L, H, D]):
        // `empty_like(q_t)`, which for a q that is not dense (a ring attention's half) is
        // contiguous in q_t's order.
        let like = |l: &Layout| match backend {
            FusedSdpa::Flash => l.transpose(1, 2).empty_like().transpose(1, 2),
            _ => l.empty_like(),
        };
        let dq = self.alloc(like(&q.layout), q.dtype, m, name);
        let dk = self.alloc(like(&kk.layout), kk.dtype, m, name);
        let dv = self.alloc(like(&v.layout), v.dtype, m, name);
        // The key's length (a ring attention's half of the key differs from the query's).
        let sk = kk.layout.shape[2];
        let mut ws = Vec::new();
        match backend {
            FusedSdpa::Flash => {
                // mha_bwd: softmax_d [B, H, round(S, 128)] and dq_accum
                // [B, round(S, 128), H, round(D, 32)] in float32; dk/dv expanded to H heads
                // for grouped-query attention.
                let sr = round_up(s, 128);
                let dr = if d <= 192 { round_up(d, 32) } else { 256 };
                ws.push(self.alloc(Layout::contiguous(&[b, h, sr]), DType::F32, m, name));
                ws.push(self.alloc(Layout::contiguous(&[b, sr, h, dr]), DType::F32, m, name));
                if kk.layout.shape[1] != h {
                    ws.push(self.alloc(Layout::contiguous(&[b, sk, h, d]), kk.dtype, m, name));
                    ws.push(self.alloc(Layout::contiguous(&[b, sk, h, d]), v.dtype, m, name));
                }
            }
            FusedSdpa::MemEfficient => {
                // _efficient_attention_backward: delta [B, H, S] float32.
                ws.push(self.alloc(Layout::contiguous(&[b, h, s]), DType::F32, m, name));
            }
            FusedSdpa::Cudnn => {
                // run_cudnn_SDP_bprop: cuDNN handles GQA itself (dk/dv at the kv heads)
                // and asks for a workspace of `mha_graph->get_workspace_size()` bytes
                // from the caching allocator, which depends on the execution plan the
                // cuDNN frontend picks at run time: not modelled. grad_output already
                // has the output's strides here, so no matching copy is made.
            }
        }
        for w in ws.into_iter().rev() {
            self.drop_rt(w);
        }
        [dq, dk, dv]
    }

    /// One node's gradient formula. Returns one gradient per forward input (owned handles).
    fn apply(&mut self, n: u32, grads: &[Option<Rt>]) -> Vec<Option<Rt>> {
        // The node's input metadata and edges, lent to the formula (which reads no node's: a
        // reentrant region's backward runs a graph of newer nodes) and put back.
        let ins = std::mem::take(&mut self.nodes[n as usize].ins);
        let next = std::mem::take(&mut self.nodes[n as usize].next);
        let out = self.apply_formula(n, grads, &ins, &next);
        let node = &mut self.nodes[n as usize];
        node.ins = ins;
        node.next = next;
        out
    }

    /// [`Self::apply`] with the node's `ins` and `next` borrowed.
    fn apply_formula(
        &mut self,
        n: u32,
        grads: &[Option<Rt>],
        ins: &[Option<Meta>],
        next: &[Option<Edge>],
    ) -> Vec<Option<Rt>> {
        let node = &self.nodes[n as usize];
        let m = node.module;
        let kind = node.kind.clone();
        let k = ins.len();
        let mut out: Vec<Option<Rt>> = vec![None; k];
        let need = |i: usize| next.get(i).is_some_and(Option::is_some);
        let meta = |i: usize| ins[i].clone().expect("float input");
        match kind {
            NodeKind::Accumulate(_) => return vec![],
            NodeKind::Cast => {
                if let Some(g) = grads[0].as_ref() {
                    out[0] = Some(self.cast_grad(g, meta(0).dtype, m));
                }
                return out;
            }
            NodeKind::ReshapeCopy => {
                if let Some(g) = grads[0].as_ref() {
                    // CloneBackward0 passes through; UnsafeViewBackward0: grad.reshape(sizes).
                    out[0] = Some(self.reshape_grad(g, &meta(0).layout.shape, m));
                }
                return out;
            }
            NodeKind::Reentrant(r) => return self.reentrant_backward(n, r, grads),
            NodeKind::Leaf(_) => return out,
            NodeKind::Op(_) => {}
        }
        let NodeKind::Op(op) = kind else {
            unreachable!()
        };
        // Split: undefined gradients are zero-filled before the cat.
        if let OpKind::Split { dim } = op {
            if grads.iter().all(|g| g.is_none()) {
                return out;
            }
            let outs_meta = self.nodes[n as usize].outs.clone();
            let mut zeros = Vec::new();
            for (i, g) in grads.iter().enumerate() {
                if g.is_none() {
                    let z = self.alloc(
                        Layout::contiguous(&outs_meta[i].layout.shape),
                        outs_meta[i].dtype,
                        m,
                        "aten.zeros",
                    );
                    zeros.push(z);
                }
            }
            // split_backward -> at::cat(grads, dim)
            let _ = dim;
            let c = self.alloc(
                Layout::contiguous(&meta(0).layout.shape),
                outs_meta[0].dtype,
                m,
                "aten.cat",
            );
            for z in zeros {
                self.drop_rt(z);
            }
            out[0] = Some(c);
            return out;
        }
        let Some(g) = grads.first().cloned().flatten() else {
            return out;
        };
        use OpKind::*;
        match op {
            // derivatives.yaml view / _unsafe_view / _reshape_alias: grad.reshape(self.sizes()).
            View | UnsafeView | Reshape => {
                out[0] = Some(self.reshape_grad(&g, &meta(0).layout.shape, m))
            }
            TpComm(c) => out[0] = Some(self.tp_comm_bwd(c, &g, &meta(0), m)),
            VocabParallelCrossEntropy => out[0] = self.vocab_ce_bwd(n, m),
            // derivatives.yaml masked_fill_.Scalar: `grad.masked_fill(mask, 0)`, out of place.
            MaskedFillInplace => {
                out[0] = Some(self.alloc(g.layout.empty_like(), g.dtype, m, "aten.masked_fill"))
            }
            // derivatives.yaml transpose.int: grad.transpose(dim0, dim1) (a view).
            Transpose(a, b) => out[0] = Some(self.view(&g, g.layout.transpose(a, b))),
            // derivatives.yaml t: grad.t() (a view).
            T => {
                let l = if g.layout.dim() == 2 {
                    g.layout.transpose(0, 1)
                } else {
                    g.layout.clone()
                };
                out[0] = Some(self.view(&g, l));
            }
            // derivatives.yaml permute: permute_backwards, the inverse permutation (a view).
            Permute(p) => {
                let mut inv = vec![0; p.len()];
                for (i, &d) in p.iter().enumerate() {
                    inv[d] = i;
                }
                out[0] = Some(self.view(&g, g.layout.permute(&inv)));
            }
            // derivatives.yaml unsqueeze: grad.squeeze(dim) (a view).
            Unsqueeze(d) => {
                let mut l = g.layout.clone();
                l.shape.remove(d);
                l.strides.remove(d);
                out[0] = Some(self.view(&g, l));
            }
            Expand => {
                // at::sum_to(grad, self.sizes())
                let s = meta(0).layout.shape;
                out[0] = Some(if s == g.layout.shape {
                    self.dup(&g)
                } else {
                    self.alloc(Layout::contiguous(&s), g.dtype, m, "aten.sum")
                });
            }
            // as_strided_backward: `grad.new_zeros(storage size)`, the gradient scattered into it,
            // returned as the input's gradient.
            AsStridedInplace => {
                let s = meta(0).layout.shape;
                out[0] = Some(self.alloc(Layout::contiguous(&s), g.dtype, m, "aten.new_zeros"));
            }
            Slice { .. } => {
                let s = meta(0).layout.shape;
                out[0] = Some(if s == g.layout.shape {
                    self.dup(&g)
                } else {
                    // slice_backward: zeros(input_sizes) then copy the slice in.
                    self.alloc(Layout::contiguous(&s), g.dtype, m, "aten.slice_backward")
                });
            }
            Split { .. } => unreachable!(),
            // derivatives.yaml clone: grad, passed through.
            Clone { .. } | AutocastLower => out[0] = Some(self.dup(&g)),
            // derivatives.yaml _to_copy: _to_copy_backward = grad.to(self's dtype).
            ToDtype(_) | ToDtypeOf => out[0] = Some(self.cast_grad(&g, meta(0).dtype, m)),
            Add | AddInplace { .. } => {
                // AddBackward0: both inputs get `grad` itself (alpha = 1).
                for (i, o) in out.iter_mut().enumerate().take(2) {
                    if need(i) {
                        *o = Some(self.dup(&g));
                    }
                }
            }
            // derivatives.yaml add.Scalar: grad.
            AddScalar => out[0] = Some(self.dup(&g)),
            // derivatives.yaml sub.Tensor: grad, and -grad for other.
            Sub => {
                if need(0) {
                    out[0] = Some(self.dup(&g));
                }
                if need(1) {
                    out[1] = Some(self.alloc(g.layout.empty_like(), g.dtype, m, "aten.neg"));
                }
            }
            Mul => {
                // MulBackward0 computes `other` first, then `self` (each `grad * the other input`).
                let s = g.layout.shape.clone();
                if need(1) {
                    let l = elementwise_layout(&s, &[&g.layout, &meta(0).layout]);
                    out[1] = Some(self.alloc(l, g.dtype.promote(meta(0).dtype), m, "aten.mul"));
                }
                if need(0) {
                    let l = elementwise_layout(&s, &[&g.layout, &meta(1).layout]);
                    out[0] = Some(self.alloc(l, g.dtype.promote(meta(1).dtype), m, "aten.mul"));
                }
            }
            // derivatives.yaml div.Tensor: div_tensor_self_backward, div_tensor_other_backward.
            Div => {
                let s = g.layout.shape.clone();
                if need(0) {
                    out[0] = Some(self.alloc(Layout::contiguous(&s), g.dtype, m, "aten.div"));
                }
                if need(1) {
                    // -grad * ((self / other) / other)
                    let t1 = self.alloc(Layout::contiguous(&s), g.dtype, m, "aten.neg");
                    let t2 = self.alloc(Layout::contiguous(&s), g.dtype, m, "aten.div");
                    let t3 = self.alloc(Layout::contiguous(&s), g.dtype, m, "aten.div");
                    self.drop_rt(t2);
                    out[1] = Some(self.alloc(Layout::contiguous(&s), g.dtype, m, "aten.mul"));
                    self.drop_rt(t3);
                    self.drop_rt(t1);
                }
            }
            // derivatives.yaml mul.Tensor with a wrapped number: grad * other.
            MulScalar => out[0] = Some(self.alloc(g.layout.empty_like(), g.dtype, m, "aten.mul")),
            // derivatives.yaml div.Tensor with a wrapped number: grad / other.
            DivScalar => out[0] = Some(self.alloc(g.layout.empty_like(), g.dtype, m, "aten.div")),
            // derivatives.yaml neg: grad.neg().
            Neg => out[0] = Some(self.alloc(g.layout.empty_like(), g.dtype, m, "aten.neg")),
            PowScalar(e) => {
                let x = meta(0);
                if e == 0.0 {
                    out[0] = Some(self.alloc(
                        Layout::contiguous(&x.layout.shape),
                        x.dtype,
                        m,
                        "aten.zeros_like",
                    ));
                } else {
                    // pow_backward: grad * (exponent * self.pow(exponent - 1))
                    let t1 = self.alloc(x.layout.empty_like(), x.dtype, m, "aten.pow");
                    let t2 = self.alloc(x.layout.empty_like(), x.dtype, m, "aten.mul");
                    let l = elementwise_layout(&g.layout.shape, &[&g.layout, &t2.layout]);
                    out[0] = Some(self.alloc(l, g.dtype.promote(x.dtype), m, "aten.mul"));
                    self.drop_rt(t2);
                    self.drop_rt(t1);
                }
            }
            Rsqrt => {
                // -0.5 * grad * result.pow(3)
                let r = self.nodes[n as usize].outs[0].clone();
                let t1 = self.alloc(r.layout.empty_like(), r.dtype, m, "aten.pow");
                let t2 = self.alloc(g.layout.empty_like(), g.dtype, m, "aten.mul");
                out[0] = Some(self.alloc(g.layout.empty_like(), g.dtype, m, "aten.mul"));
                self.drop_rt(t2);
                self.drop_rt(t1);
            }
            // derivatives.yaml tanh/relu/gelu/silu: tanh_backward(grad, result), threshold_backward(grad, result, 0),
            // gelu_backward(grad, self), silu_backward(grad, self).
            // hardtanh/hardtanh_: hardtanh_backward(grad, self or original_self, min_val, max_val);
            // silu_: silu_backward(grad, original_self).
            Tanh
            | Sigmoid
            | Relu
            | ReluInplace
            | Hardtanh
            | HardtanhInplace
            | SiluInplace
            | Gelu { .. }
            | Silu
            | Hardswish
            | Hardsigmoid
            | HardswishInplace
            | HardsigmoidInplace => {
                let name = match op {
                    Hardtanh | HardtanhInplace => "aten.hardtanh_backward",
                    Hardswish | HardswishInplace => "aten.hardswish_backward",
                    Hardsigmoid | HardsigmoidInplace => "aten.hardsigmoid_backward",
                    Tanh => "aten.tanh_backward",
                    Sigmoid => "aten.sigmoid_backward",
                    Relu | ReluInplace => "aten.threshold_backward",
                    Gelu { .. } => "aten.gelu_backward",
                    _ => "aten.silu_backward",
                };
                let l = elementwise_layout(&g.layout.shape, &[&g.layout, &meta(0).layout]);
                out[0] = Some(self.alloc(l, g.dtype, m, name));
            }
            // sum_backward: grad.expand(sizes), a view materialised by the formula reading it
            // (a `view`/`reshape` of the expanded gradient copies): allocated here.
            SumDim { .. } => {
                let x = meta(0);
                out[0] = Some(self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    g.dtype,
                    m,
                    "aten.sum_backward",
                ));
            }
            // value_selecting_reduction_backward: `zeros(sizes, grad.options()).scatter_(dim,
            // indices, grad)`.
            TopK { .. } => {
                let x = meta(0);
                out[0] = Some(self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    g.dtype,
                    m,
                    "aten.zeros",
                ));
            }
            // _grouped_mm_mat2_backward (`_grouped_mm(self.transpose(-2, -1), grad, offs)`,
            // transposed back to mat2's layout) first, then _grouped_mm_mat1_backward
            // (`_grouped_mm(grad, mat2.transpose(-2, -1), offs)`).
            GroupedMm => {
                if need(1) {
                    let b = meta(1);
                    let l = &b.layout;
                    let n = l.dim();
                    let layout = if n == 3 && l.strides[n - 2] == 1 {
                        let mut t = l.shape.clone();
                        t.swap(n - 2, n - 1);
                        Layout::contiguous(&t).transpose(n - 2, n - 1)
                    } else {
                        Layout::contiguous(&l.shape)
                    };
                    out[1] = Some(self.alloc(layout, g.dtype, m, "aten._grouped_mm"));
                }
                if need(0) {
                    let a = meta(0);
                    out[0] = Some(self.alloc(
                        Layout::contiguous(&a.layout.shape),
                        g.dtype,
                        m,
                        "aten._grouped_mm",
                    ));
                }
            }
            MeanDim { .. } => {
                // mean_backward: grad.expand(sizes) / n
                let x = meta(0);
                out[0] =
                    Some(self.alloc(Layout::contiguous(&x.layout.shape), g.dtype, m, "aten.div"));
            }
            // Every gradient GEMM is an `mm`/`bmm` (beta 0: the cuBLAS path), each with its workspace.
            Mm => {
                // MmBackward0 computes mat2's gradient first, then self's.
                if need(1) {
                    let l = Self::mm_grad_layout(&meta(1));
                    out[1] = Some(self.alloc(l, g.dtype, m, "aten.mm"));
                    self.gemm_workspace(false, m);
                }
                if need(0) {
                    let l = Self::mm_grad_layout(&meta(0));
                    out[0] = Some(self.alloc(l, g.dtype, m, "aten.mm"));
                    self.gemm_workspace(false, m);
                }
            }
            Addmm => {
                // AddmmBackward0: mat1, mat2, then self = grad (reduced by validate_outputs).
                if need(1) {
                    let l = Self::mm_grad_layout(&meta(1));
                    out[1] = Some(self.alloc(l, g.dtype, m, "aten.mm"));
                    self.gemm_workspace(false, m);
                }
                if need(2) {
                    let l = Self::mm_grad_layout(&meta(2));
                    out[2] = Some(self.alloc(l, g.dtype, m, "aten.mm"));
                    self.gemm_workspace(false, m);
                }
                if need(0) {
                    out[0] = Some(self.dup(&g));
                }
            }
            Bmm => {
                // BmmBackward0: mat2 first (self^T @ grad), then self (grad @ mat2^T).
                if need(1) {
                    out[1] = Some(self.alloc(
                        Layout::contiguous(&meta(1).layout.shape),
                        g.dtype,
                        m,
                        "aten.bmm",
                    ));
                    self.gemm_workspace(false, m);
                }
                if need(0) {
                    out[0] = Some(self.alloc(
                        Layout::contiguous(&meta(0).layout.shape),
                        g.dtype,
                        m,
                        "aten.bmm",
                    ));
                    self.gemm_workspace(false, m);
                }
            }
            // derivatives.yaml _softmax: _softmax_backward_data(grad, result, dim, self's dtype).
            Softmax { .. } => {
                let x = meta(0);
                let grad_input = self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    x.dtype,
                    m,
                    "aten._softmax_backward_data",
                );
                if self.r.fidelity == Fidelity::Cuda {
                    // SoftMax.cu, softmax_backward_cuda_out: `Tensor tmp = grad * output;` (grad's
                    // dtype: the output's, float for half_to_float), made after the structured
                    // grad_input and freed when the kernel returns. Meta runs only the meta function.
                    let tmp = self.alloc(g.layout.empty_like(), g.dtype, m, "aten.mul");
                    self.drop_rt(tmp);
                }
                out[0] = Some(grad_input);
            }
            // derivatives.yaml _log_softmax: _log_softmax_backward_data(grad, result, dim, self's dtype).
            LogSoftmax { .. } => {
                let x = meta(0);
                out[0] = Some(self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    x.dtype,
                    m,
                    "aten._log_softmax_backward_data",
                ));
            }
            // derivatives.yaml nll_loss_forward: nll_loss_backward (zeros of self's shape, scattered).
            NllLoss => {
                let x = meta(0);
                out[0] = Some(self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    x.dtype,
                    m,
                    "aten.nll_loss_backward",
                ));
            }
            LayerNorm => {
                // layer_norm_backward_cuda: `X = input.expect_contiguous()` (a copy of a saved
                // non-contiguous input), grad_input, grad_weight, grad_bias, then `dY.contiguous()`
                // for the kernel; the copies go when it returns (inside the CUDA kernel: not in a
                // dispatch-mode capture).
                let cuda = self.r.fidelity == Fidelity::Cuda;
                let xc = if meta(0).layout.is_contiguous() || !cuda {
                    None
                } else {
                    let x = meta(0);
                    Some(self.alloc(
                        Layout::contiguous(&x.layout.shape),
                        x.dtype,
                        m,
                        "aten.clone",
                    ))
                };
                for (i, o) in out.iter_mut().enumerate().take(3) {
                    if need(i) {
                        let x = meta(i);
                        *o = Some(self.alloc(
                            Layout::contiguous(&x.layout.shape),
                            x.dtype,
                            m,
                            "aten.native_layer_norm_backward",
                        ));
                    }
                }
                if !g.layout.is_contiguous() && cuda {
                    let t = self.alloc(
                        Layout::contiguous(&g.layout.shape),
                        g.dtype,
                        m,
                        "aten.clone",
                    );
                    self.drop_rt(t);
                }
                if let Some(t) = xc {
                    self.drop_rt(t);
                }
            }
            // convolution_backward (cuDNN: backward_input, then backward_weight; the bias gradient
            // `grad.sum([0, 2, 3])` after both), each only when its input needs it.
            //
            // Memory format (`Convolution.cpp` `convolution_backward`): the backend format of the
            // forward (channels-last when the input or weight suggested it); cuDNN's
            // `cudnn_convolution_backward` (`ConvShared.cpp`) takes
            // `grad_output_t.to(input.suggest_memory_format())` (a copy when the gradient arrives in
            // another layout, e.g. through ViT's `flatten(2).transpose(1, 2)` or `LayerNorm2d`'s
            // permute, freed on return; inside the CUDA kernel, so not in a dispatch-mode capture),
            // grad_input and grad_weight allocated in it (`cudnn_convolution_backward_input` /
            // `_weight`: `cudnn_conv_suggest_memory_format`); the bias gradient is `[C]`.
            Conv2d { .. } => {
                let cl = super::fwd::conv_channels_last(&meta(0).layout, &meta(1).layout);
                let gcopy = if self.r.fidelity != Fidelity::Cuda
                    || super::fwd::in_conv_format(&g.layout, cl)
                {
                    None
                } else {
                    Some(self.alloc(
                        super::fwd::conv_layout(&g.layout.shape, cl),
                        g.dtype,
                        m,
                        "aten.clone",
                    ))
                };
                for (i, o) in out.iter_mut().enumerate().take(3) {
                    if need(i) {
                        let x = meta(i);
                        *o = Some(self.alloc(
                            super::fwd::conv_layout(&x.layout.shape, cl),
                            x.dtype,
                            m,
                            "aten.convolution_backward",
                        ));
                        // grad_input and grad_weight are cuDNN convolutions of their own
                        // (backward data, backward filter); the bias gradient is a sum.
                        if i < 2 {
                            let key = format!(
                                "bwd{i} {op:?} {:?} {:?} {:?}",
                                meta(0).layout.shape,
                                meta(1).layout.shape,
                                g.dtype
                            );
                            self.conv_benchmark(key);
                        }
                    }
                }
                if let Some(t) = gcopy {
                    self.drop_rt(t);
                }
            }
            // cudnn_batch_norm_backward / native_batch_norm_backward: grad_input, grad_weight and
            // grad_bias, all three whatever needs them (cuDNN takes no output mask).
            BatchNorm => {
                for (i, o) in out.iter_mut().enumerate().take(3) {
                    if let Some(x) = ins[i].clone() {
                        *o = Some(self.alloc(
                            Layout::contiguous(&x.layout.shape),
                            x.dtype,
                            m,
                            "aten.native_batch_norm_backward",
                        ));
                    }
                }
            }
            // derivatives.yaml max_pool2d_with_indices: max_pool2d_with_indices_backward (input-sized).
            MaxPool2d { .. } => {
                let x = meta(0);
                out[0] = Some(self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    g.dtype,
                    m,
                    "aten.max_pool2d_with_indices_backward",
                ));
            }
            // mean_backward: grad.expand(sizes) / n, full size.
            MeanDims { .. } => {
                let x = meta(0);
                out[0] =
                    Some(self.alloc(Layout::contiguous(&x.layout.shape), g.dtype, m, "aten.div"));
            }
            // derivatives.yaml _adaptive_avg_pool2d: _adaptive_avg_pool2d_backward (input-sized).
            AdaptiveAvgPool2d { .. } => {
                let x = meta(0);
                out[0] = Some(self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    g.dtype,
                    m,
                    "aten._adaptive_avg_pool2d_backward",
                ));
            }
            // derivatives.yaml select.int: select_backward, zeros of the input's size.
            Select { .. } => {
                let x = meta(0);
                out[0] = Some(self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    g.dtype,
                    m,
                    "aten.select_backward",
                ));
            }
            // derivatives.yaml index.Tensor: `index_backward(zeros_like(self), indices, grad)`
            // (FunctionsManual.cpp): `_index_put_impl_(zeros_like_self, indices, grad,
            // accumulate=true)` in place; with subclass-like tensors (a dispatch mode) the
            // out-of-place `zeros_like_self.index_put(...)`. The int64 sort buffers of CUDA's
            // accumulating `index_put_` (a few of the index count) are not modelled.
            Index => {
                let x = meta(0);
                let z = self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    g.dtype,
                    m,
                    "aten.zeros_like",
                );
                out[0] = Some(if self.r.fidelity == Fidelity::MetaCapture {
                    let o = self.alloc(
                        Layout::contiguous(&x.layout.shape),
                        g.dtype,
                        m,
                        "aten.index_put",
                    );
                    self.drop_rt(z);
                    o
                } else {
                    z
                });
            }
            // derivatives.yaml mse_loss: mse_loss_backward (Loss.cpp) = zeros_like(self), then
            // mse_loss_backward_out into it: the input's dtype on CUDA. The meta device has no
            // native kernel and its registration returns the promoted dtype (a float32 gradient
            // for a bfloat16 input and float32 targets, cast back by validate_outputs).
            MseLoss => {
                let x = meta(0);
                let dt = match (self.r.fidelity, ins.get(1).cloned().flatten()) {
                    (Fidelity::MetaCapture, Some(t)) => x.dtype.promote(t.dtype),
                    _ => x.dtype,
                };
                out[0] = Some(self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    dt,
                    m,
                    "aten.mse_loss_backward",
                ));
            }
            // derivatives.yaml native_dropout: native_dropout_backward(grad, mask, scale).
            Dropout { .. } => {
                out[0] = Some(self.alloc(
                    g.layout.empty_like(),
                    g.dtype,
                    m,
                    "aten.native_dropout_backward",
                ))
            }
            // derivatives.yaml embedding: embedding_dense_backward, [num_weights, h] in grad's dtype.
            Embedding => {
                let w = meta(0);
                out[0] = Some(self.alloc(
                    Layout::contiguous(&w.layout.shape),
                    g.dtype,
                    m,
                    "aten.embedding_dense_backward",
                ));
            }
            Cat { dim } => {
                // cat_tensors_backward: narrow views of grad.
                for (i, o) in out.iter_mut().enumerate() {
                    if need(i) {
                        let len = ins[i].as_ref().map(|x| x.layout.shape[dim]).unwrap_or(0);
                        let l = g.layout.narrow(dim, len);
                        self.storages[g.st as usize].refs += 1;
                        *o = Some(Rt {
                            layout: l,
                            dtype: g.dtype,
                            st: g.st,
                            edge: None,
                            view: true,
                        });
                    }
                }
            }
            // derivatives.yaml _scaled_dot_product_{flash,efficient,cudnn}_attention: the fused
            // backward (grad_q/k/v in their inputs' stride order — flash `empty_like(q)`,
            // mem-efficient `empty_strided(query.sizes(), query.strides())`, cuDNN
            // `empty_like(query)` — plus the kernel's float32 workspaces).
            Sdpa { backend } => {
                let (q, kk, v) = (meta(0), meta(1), meta(2));
                // `--cp`: the ring attention's backward (`lower/cp.rs`).
                let [dq, dk, dv] = if self.r.parallel.cp > 1 {
                    self.ring_attention_bwd(backend, &q, &kk, &v, m)
                } else {
                    self.sdpa_kernel_bwd(backend, &q, &kk, &v, m)
                };
                out[0] = Some(dq);
                out[1] = Some(dk);
                out[2] = Some(dv);
            }
            // derivatives.yaml masked_fill.Scalar: `grad.masked_fill(mask, 0)`, a new tensor of
            // grad's shape (the mask gets none).
            MaskedFill => {
                if need(0) {
                    out[0] = Some(self.alloc(
                        Layout::contiguous(&g.layout.shape),
                        g.dtype,
                        m,
                        "aten.masked_fill",
                    ));
                }
            }
            // MulBackward0 of dropout_'s `input.mul_(noise)`: `grad * noise`, the noise laid out
            // as the input (`empty_like`).
            DropoutInplace { .. } => {
                let l = elementwise_layout(&g.layout.shape, &[&g.layout, &meta(0).layout]);
                out[0] = Some(self.alloc(l, g.dtype, m, "aten.mul"));
            }
            // derivatives.yaml avg_pool2d: avg_pool2d_backward, a tensor of the input's shape.
            AvgPool2d { .. } => {
                let x = meta(0);
                out[0] = Some(self.alloc(
                    Layout::contiguous(&x.layout.shape),
                    g.dtype,
                    m,
                    "aten.avg_pool2d_backward",
                ));
            }
            // A recorded call: one new gradient per differentiable input, of its shape and dtype
            // (the engine's `validate_outputs` gives each the input's dtype).
            // A recorded backward: its allocations and frees in order; the gradients are the
            // allocations (or the incoming gradient) the capture saw returned; the rest is freed.
            Recorded(rec) if rec.backward.is_some() => {
                let bw = rec.backward.as_ref().expect("checked");
                let mut live: Vec<Option<Rt>> = Vec::new();
                for st in &bw.steps {
                    match st {
                        RecordedStep::Alloc(n, d) => {
                            let dt = match d {
                                RecordedDType::Like(j) => {
                                    ins.get(*j).cloned().flatten().map_or(g.dtype, |x| x.dtype)
                                }
                                RecordedDType::Spec(s) => self.resolve(*s),
                            };
                            live.push(Some(self.alloc(Layout::contiguous(&[*n]), dt, m, rec.name)));
                        }
                        RecordedStep::Free(k) => {
                            if let Some(t) = live.get_mut(*k).and_then(Option::take) {
                                self.drop_rt(t);
                            }
                        }
                    }
                }
                for (j, o) in out.iter_mut().enumerate() {
                    let Some(x) = ins.get(j).cloned().flatten().filter(|_| need(j)) else {
                        continue;
                    };
                    let storage = match bw.grads.get(j).cloned().flatten() {
                        Some(RecordedGrad::Alloc(k)) => live.get_mut(k).and_then(Option::take),
                        Some(RecordedGrad::GradOutput) => Some(self.dup(&g)),
                        None => None,
                    };
                    // The gradient as a tensor of the input's shape on the recorded storage.
                    *o = Some(match storage {
                        Some(t) => {
                            let v = self.view(&t, Layout::contiguous(&x.layout.shape));
                            self.drop_rt(t);
                            v
                        }
                        None => {
                            self.alloc(Layout::contiguous(&x.layout.shape), x.dtype, m, rec.name)
                        }
                    });
                }
                for t in live.into_iter().flatten() {
                    self.drop_rt(t);
                }
            }
            Recorded(rec) => {
                // A view of input `j` of the same size (`squeeze`, `narrow`'s full range, ...):
                // its backward is the gradient viewed back to the input's shape, as the
                // derivatives.yaml formulas of views are (`grad.reshape(self.sizes())`).
                if let Some(RecordedOut::View(j)) = rec.outs.first() {
                    let x = ins.get(*j).cloned().flatten();
                    if let (true, Some(x)) = (need(*j), x) {
                        if numel(&x.layout.shape) == numel(&g.layout.shape) {
                            out[*j] = Some(self.reshape_grad(&g, &x.layout.shape, m));
                        }
                    }
                }
                for (j, o) in out.iter_mut().enumerate() {
                    if o.is_some() {
                        continue;
                    }
                    if let (true, Some(x)) = (need(j), ins[j].clone()) {
                        *o = Some(self.alloc(
                            Layout::contiguous(&x.layout.shape),
                            x.dtype,
                            m,
                            rec.name,
                        ));
                    }
                }
            }
            // Not differentiable: no node is ever made.
            Factory { .. } => {}
            QuantLinear { .. } => {
                let xl = need(0).then(|| meta(0).layout);
                let (ga, gb) = self.quant_linear_bwd(&op, &g, xl, k > 2 && need(2), m);
                out[0] = ga;
                if k > 2 {
                    out[2] = gb;
                }
            }
        }
        out
    }

    fn cast_grad(&mut self, g: &Rt, to: DType, m: ModuleId) -> Rt {
        if g.dtype == to {
            self.dup(g)
        } else {
            self.alloc(g.layout.empty_like(), to, m, "aten._to_copy")
        }
    }

    /// `AccumulateGrad::accumulateGrad`: steal a gradient the engine holds the only reference to
    /// and that obeys the layout contract, else clone it; add later ones in place.
    fn accumulate_grad(&mut self, p: usize, g: Rt) {
        if self.param_grads[p].is_some() {
            // variable_grad += new_grad (grad mode off): in place.
            self.drop_rt(g);
            self.par_grad_ready(p);
            return;
        }
        let param = self.params[p].layout.clone();
        let obeys = g.layout.shape == param.shape
            && (0..param.dim()).all(|d| {
                if param.shape[d] != 1 {
                    g.layout.strides[d] == param.strides[d]
                } else {
                    g.layout.strides[d] != 0
                }
            });
        // The parameter's dtype, or the FSDP2 unsharded gradient's (`fsdp.rs`).
        let pd = self.fsdp_grad_dtype(p).unwrap_or(self.params[p].dtype);
        let grad = if self.refs(&g) == 1 && obeys && g.dtype == pd {
            g
        } else {
            let c = self.alloc(
                Layout::contiguous(&param.shape),
                g.dtype,
                ModuleId(0),
                "aten.clone",
            );
            self.drop_rt(g);
            c
        };
        self.mark_grad(&grad);
        let name = self.g.params[p].name.clone();
        self.retag(&grad, format!("grad:{name}"));
        self.param_grads[p] = Some(Rt { edge: None, ..grad });
        // The data-parallel hooks registered on the AccumulateGrad node run after it.
        self.par_grad_ready(p);
    }
}
