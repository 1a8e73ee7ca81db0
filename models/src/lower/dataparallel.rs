//! `torch.nn.DataParallel` on one device of the layout (`Parallel::device`): the rules of
//! `crate::dataparallel`, as allocations of that device's trace. The graph is the replica's (its
//! chunk of the batch); with one device nothing here runs (`DataParallel.forward` calls the
//! module directly).
//!
//! Two shapes of training step, as the graph says (`crate::dataparallel::META_KEY`):
//!
//! * the model returns its loss (transformers' heads with labels, nanoGPT): the replica is the
//!   whole graph; each replica's loss is gathered as a vector on the output device and the loop
//!   averages it;
//! * the loop's criterion is outside the model (`loss = criterion(model(x), y)`): each replica's
//!   graph stops at the model's output; the output device gathers the outputs of the whole batch
//!   (`comm.cpp` `gather`, a `Gather` node whose backward is `Scatter`: a narrow view of the
//!   gradient for its own chunk, `comm.cpp` `scatter`) and runs the criterion once over them;
//!   every other device's backward starts from the copy of its chunk of that gradient.

use super::{Kind, Lowering, Rt};
use crate::dataparallel::{chunk_sizes, cpp_take_tensors, py_take_tensors, COALESCE_BYTES};
use crate::dtype::DType;
use crate::graph::{ModuleId, ValueId};
use crate::layout::Layout;
use crate::ops::OpKind;
use crate::parallel::Shard;

/// DataParallel state of one device's lowering.
#[derive(Default)]
pub(crate) struct DpState {
    /// Device ≥ 1: the 0-byte handles `setup` made for the parameters, while the replica's
    /// broadcast views stand in for them.
    orig_params: Vec<(usize, Rt)>,
    /// Device ≥ 1: the 0-byte handles of the buffers (value, handle).
    orig_buffers: Vec<(ValueId, Rt)>,
    /// The output device: the gathered loss vector and its mean, until the loss dies.
    gathered: Vec<Rt>,
    /// How this device's graph runs the step (read from the graph's meta once).
    mode: Option<DpMode>,
    /// The inputs `DataParallel.forward` scatters (the model's; not the loop's targets).
    scattered: Vec<ValueId>,
    /// The output device with the criterion outside the model: the op before which the
    /// outputs are gathered ([`DpMode::Output`]'s `from`).
    gather_at: Option<usize>,
}

/// What this device's graph holds of the step (`crate::dataparallel::META_KEY`).
#[derive(Clone, Debug, PartialEq)]
enum DpMode {
    /// The model returns its loss: the replica is the whole graph.
    Whole,
    /// The criterion runs on the output device: this graph is the replica's forward.
    Replica,
    /// The output device with the criterion outside the model: before op `from`, each
    /// (replica output, gathered value) pair is gathered.
    Output {
        from: usize,
        gathered: Vec<(ValueId, ValueId)>,
    },
}

impl<'g> Lowering<'g> {
    /// Whether DataParallel with two or more devices shapes this trace.
    pub(super) fn dp_on(&self) -> bool {
        self.r.parallel.shard == Shard::DataParallel && self.r.parallel.dp > 1
    }

    /// Device ≥ 1: the parameters and buffers are replica copies made each forward, not
    /// allocated by `model.to(device)`.
    pub(super) fn dp_copy(&self) -> bool {
        self.dp_on() && self.r.parallel.device != 0
    }

    fn dp_devices_used(&self) -> u64 {
        chunk_sizes(self.r.batch, self.r.parallel.dp).len() as u64
    }

    fn dp_alloc(&mut self, bytes: u64, kind: Kind, tag: String) -> Rt {
        let prev = self.kind_now;
        self.kind_now = kind;
        let t = self.alloc(
            Layout::contiguous(&[bytes]),
            DType::U8,
            ModuleId(0),
            "aten.empty",
        );
        self.kind_now = prev;
        self.retag(&t, tag);
        t
    }

    /// `Scatter` of the inputs (`comm.cpp` `scatter`): on device 0 the chunk is a view of the
    /// caller's full-batch tensor (`.to()` of a tensor already there returns it), which the
    /// training loop holds to the end of the step; on the other devices `make_inputs` already
    /// made the chunk's copy.
    pub(super) fn dp_scatter(&mut self, inputs: &[ValueId]) {
        if !self.dp_on() {
            return;
        }
        let mode = self.dp_mode().clone();
        if let DpMode::Output { from, .. } = &mode {
            self.dp.gather_at = Some(*from);
        }
        // The loop's targets (read by the criterion only) stay where the loop put them.
        self.dp.scattered = match &mode {
            DpMode::Output { from, .. } => inputs
                .iter()
                .copied()
                .filter(|v| self.g.ops[..*from].iter().any(|op| op.inputs.contains(v)))
                .collect(),
            _ => inputs.to_vec(),
        };
        if self.r.parallel.device != 0 {
            return;
        }
        let chunk = self.g.batch.max(1);
        let scattered = self.dp.scattered.clone();
        for &v in &scattered {
            let Some(rt) = self.vals[v.0 as usize].take() else {
                continue;
            };
            let bytes = rt.layout.numel() * rt.dtype.size();
            if rt.shape().first() != Some(&self.g.batch) {
                self.vals[v.0 as usize] = Some(rt);
                continue;
            }
            let full_bytes = bytes / chunk * self.r.batch;
            let name = self.tags[rt.st as usize].clone();
            let full = self.dp_alloc(full_bytes, Kind::Input, name.to_string());
            let mut view = self.view(&full, rt.layout.clone());
            view.dtype = rt.dtype;
            self.drop_rt(full);
            self.drop_rt(rt);
            self.vals[v.0 as usize] = Some(view);
        }
    }

    /// `replicate` (`replicate.py`): `broadcast_coalesced` of the parameters, then of the buffers,
    /// in `take_tensors` groups of `COALESCE_BYTES`. Device 0 flattens each group (a temporary
    /// that dies at the end of its loop iteration) and keeps its own tensors; another device gets
    /// one flat copy per group, and its replica's tensors are views of it.
    pub(super) fn dp_replicate(&mut self) {
        if !self.dp_on() {
            return;
        }
        let copy = self.dp_copy();
        // Parameters (`_broadcast_coalesced_reshape(params, devices, detach)`).
        let params: Vec<usize> = (0..self.params.len()).collect();
        let sizes: Vec<(u64, u8)> = params
            .iter()
            .map(|&p| {
                let numel = Layout::contiguous(&self.g.params[p].shape).numel();
                (
                    numel * self.param_dtype.size(),
                    self.param_dtype.size() as u8,
                )
            })
            .collect();
        for (gi, group) in cpp_take_tensors(&sizes, COALESCE_BYTES)
            .into_iter()
            .enumerate()
        {
            let bytes: u64 = group.iter().map(|&i| sizes[i].0).sum();
            if !copy {
                let flat = self.dp_alloc(bytes, Kind::Temporary, format!("dp_broadcast_flat{gi}"));
                self.drop_rt(flat);
                continue;
            }
            let flat = self.dp_alloc(bytes, Kind::Param, format!("dp_replica_params{gi}"));
            for &i in &group {
                let p = params[i];
                let orig = self.params[p].clone();
                let mut v = self.view(&flat, orig.layout.clone());
                v.dtype = orig.dtype;
                v.edge = orig.edge;
                let value = self.g.params[p].value.0 as usize;
                let d = self.dup(&v);
                self.vals[value] = Some(d);
                self.params[p] = v;
                self.dp.orig_params.push((p, orig));
            }
            self.drop_rt(flat);
        }
        // Buffers (`broadcast_coalesced(buffers_not_rg, devices)`, detached).
        let bufs: Vec<ValueId> = self.g.buffers.iter().map(|b| b.value).collect();
        let sizes: Vec<(u64, u8)> = bufs
            .iter()
            .map(|v| {
                let val = &self.g.values[v.0 as usize];
                let d = self.resolve(val.dtype);
                (
                    Layout::contiguous(&val.shape).numel() * d.size(),
                    d.size() as u8,
                )
            })
            .collect();
        for (gi, group) in cpp_take_tensors(&sizes, COALESCE_BYTES)
            .into_iter()
            .enumerate()
        {
            let bytes: u64 = group.iter().map(|&i| sizes[i].0).sum();
            if bytes == 0 {
                continue;
            }
            if !copy {
                let flat =
                    self.dp_alloc(bytes, Kind::Temporary, format!("dp_broadcast_buffers{gi}"));
                self.drop_rt(flat);
                continue;
            }
            let flat = self.dp_alloc(bytes, Kind::Buffer, format!("dp_replica_buffers{gi}"));
            for &i in &group {
                let v = bufs[i];
                let Some(orig) = self.vals[v.0 as usize].take() else {
                    continue;
                };
                let mut view = self.view(&flat, orig.layout.clone());
                view.dtype = orig.dtype;
                self.vals[v.0 as usize] = Some(view);
                self.dp.orig_buffers.push((v, orig));
            }
            self.drop_rt(flat);
        }
    }

    /// This device's [`DpMode`], from the graph's meta (`crate::dataparallel::replica_graph`,
    /// `output_device_graph`); a graph without the mark is the whole step's.
    fn dp_mode(&mut self) -> &DpMode {
        if self.dp.mode.is_none() {
            let m = self.g.meta.get(crate::dataparallel::META_KEY);
            let role = m.and_then(|m| m.get("role")).and_then(|r| r.as_str());
            let from = m
                .and_then(|m| m.get("criterion_from"))
                .and_then(|f| f.as_u64())
                .unwrap_or(0) as usize;
            let pairs = m
                .and_then(|m| m.get("gathered"))
                .and_then(|g| g.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|p| {
                            let l = p.get(0)?.as_u64()? as u32;
                            let g = p.get(1)?.as_u64()? as u32;
                            Some((ValueId(l), ValueId(g)))
                        })
                        .collect()
                })
                .unwrap_or_default();
            self.dp.mode = Some(match role {
                Some("replica") => DpMode::Replica,
                Some("output") => DpMode::Output {
                    from,
                    gathered: pairs,
                },
                _ => DpMode::Whole,
            });
        }
        self.dp.mode.as_ref().expect("set")
    }

    /// Before op `i` of the forward: on the output device with the criterion outside the model,
    /// the criterion's first op follows `DataParallel.forward`'s return, so the gather and the
    /// return happen here.
    pub(super) fn dp_forward_op(&mut self, i: usize) {
        if self.dp.gather_at != Some(i) {
            return;
        }
        let DpMode::Output { gathered, .. } = self.dp_mode().clone() else {
            return;
        };
        // `gather` → `Gather.apply` per returned tensor (`scatter_gather.py` `gather_map`):
        // `comm.cpp` `gather` makes `at::empty` of the whole batch on the output device and
        // copies each replica's output in; autograd records `Gather`, whose backward scatters
        // the gradient (this device's chunk a `narrow` view of it: `comm.cpp` `scatter`'s
        // `.to()` of a tensor already on the device returns it), as `cat`'s does.
        for (l, gv) in gathered {
            let Some(out) = self.vals[l.0 as usize].take() else {
                continue;
            };
            let g = self
                .exec(
                    &OpKind::Cat { dim: 0 },
                    std::slice::from_ref(&out),
                    &[gv],
                    ModuleId(0),
                    None,
                )
                .pop()
                .expect("one output");
            self.retag(&g, "dp_gather:output".into());
            // A returned tensor the criterion never reads (BertModel's pooler output under a
            // loss on the hidden state) dies with the returned object, as on one GPU.
            let read = self.g.ops[i..].iter().any(|op| op.inputs.contains(&gv))
                || self.g.holds.iter().any(|&(v, _)| v == gv);
            if read {
                self.vals[gv.0 as usize] = Some(g);
            } else {
                self.drop_rt(g);
            }
            // `outputs`, a local of `DataParallel.forward`, dies when it returns.
            self.drop_rt(out);
        }
        self.dp_forward_returns();
    }

    /// When `DataParallel.forward` returns: the replicas and the scattered inputs, its locals,
    /// die (their tensors live on where autograd saved them).
    fn dp_forward_returns(&mut self) {
        if !self.dp_copy() {
            return;
        }
        for (p, orig) in std::mem::take(&mut self.dp.orig_params) {
            let value = self.g.params[p].value.0 as usize;
            if let Some(v) = self.vals[value].replace(orig.clone()) {
                self.drop_rt(v);
            }
            let v = std::mem::replace(&mut self.params[p], orig);
            self.drop_rt(v);
        }
        for (v, orig) in std::mem::take(&mut self.dp.orig_buffers) {
            if let Some(b) = self.vals[v.0 as usize].replace(orig) {
                self.drop_rt(b);
            }
        }
        for v in std::mem::take(&mut self.dp.scattered).into_iter().rev() {
            if let Some(rt) = self.vals[v.0 as usize].take() {
                self.drop_rt(rt);
            }
        }
    }

    /// After the forward. With the model returning its loss, `gather` concatenates the replicas'
    /// outputs on the output device (the loss of each replica, unsqueezed: a vector of one per
    /// device, then the loop's `.mean()`; the model's other returned tensors at the whole batch,
    /// alive until the loss is computed); then `DataParallel.forward` returns. On a replica
    /// device of a loop whose criterion runs elsewhere, only the return; on that output device
    /// [`Self::dp_forward_op`] did both before the criterion.
    pub(super) fn dp_gather(&mut self) {
        if !self.dp_on() {
            return;
        }
        if matches!(self.dp_mode(), DpMode::Output { .. }) {
            return;
        }
        let g = self.g;
        if *self.dp_mode() == DpMode::Whole
            && self.r.parallel.device == self.r.parallel.output_device
        {
            let n = self.dp_devices_used();
            let out = g.output.expect("checked");
            let d = self.resolve(g.values[out.0 as usize].dtype);
            let vec = self.dp_alloc(n * d.size(), Kind::Temporary, "dp_gather:loss".into());
            // Other returned tensors (logits): full batch, as long as the criterion needs them.
            let mut transient = Vec::new();
            for &(v, _) in &g.kept_outputs {
                if v == out {
                    continue;
                }
                let val = &g.values[v.0 as usize];
                if val.shape.first() != Some(&g.batch) || g.batch == 0 {
                    continue;
                }
                let bytes = Layout::contiguous(&val.shape).numel() / g.batch
                    * self.r.batch
                    * self.resolve(val.dtype).size();
                transient.push(self.dp_alloc(bytes, Kind::Activation, "dp_gather:output".into()));
            }
            let mean = self.dp_alloc(d.size(), Kind::Temporary, "dp_gather:loss.mean".into());
            for t in transient {
                self.drop_rt(t);
            }
            self.dp.gathered = vec![vec, mean];
        }
        self.dp_forward_returns();
    }

    /// Whether this device runs a replica but not the loop's criterion (it is on the output
    /// device): its step is [`Self::dp_replica_backward`] after the forward.
    pub(super) fn dp_criterion_elsewhere(&mut self) -> bool {
        self.dp_on() && *self.dp_mode() == DpMode::Replica
    }

    /// A replica device's backward when the criterion runs on the output device: the replica's
    /// output (`out`) died when `DataParallel.forward` returned (a local `outputs` list; the
    /// output device holds the gathered copy); `Gather.backward` → `Scatter.apply` copies this
    /// device's chunk of the gathered output's gradient here (`comm.cpp` `scatter`: `.to(device)`
    /// of a `narrow` of it), which goes into the input buffer of the replica's last node and dies
    /// once that node has run; then the replica's backward and the reduce.
    pub(super) fn dp_replica_backward(&mut self, out: Rt) {
        let root = out.edge;
        let (layout, dtype) = (Layout::contiguous(out.shape()), out.dtype);
        self.drop_rt(out);
        self.phase("backward");
        self.par_pre_backward();
        if let Some(root) = root {
            self.kind_now = Kind::Comm;
            let grad = self.alloc(layout, dtype, ModuleId(0), "aten._to_copy");
            self.kind_now = Kind::Temporary;
            self.retag(&grad, "dp_scatter:grad_output".into());
            self.backward_seeded(root, grad, None);
        }
        self.fsdp_end_backward();
        self.par_post_backward(true);
        self.dp_reduce();
    }

    /// The end of the backward: `Broadcast.backward` (it ran once every replica gradient was in
    /// its input buffer) calls `reduce_add_coalesced(grads, 0)`: per `_take_tensors` group each
    /// device flattens its gradients (the previous group's flats die when the next list is
    /// made), and device 0 gets `torch.empty_like` of its flat as the `nccl.reduce` output; the
    /// input buffer (the replica gradients) dies when the function returns, and `AccumulateGrad`
    /// on device 0 steals the views of the results as `.grad`. Then the gathered loss dies.
    pub(super) fn dp_reduce(&mut self) {
        if !self.dp_on() {
            return;
        }
        let ps: Vec<usize> = (0..self.param_grads.len())
            .filter(|&p| self.param_grads[p].is_some())
            .collect();
        let sizes: Vec<(u64, u8)> = ps
            .iter()
            .map(|&p| {
                let g = self.param_grads[p].as_ref().expect("filtered");
                (g.layout.numel() * g.dtype.size(), g.dtype.size() as u8)
            })
            .collect();
        let root = self.r.parallel.device == 0;
        let mut prev: Option<Rt> = None;
        let mut results: Vec<(usize, Rt)> = Vec::new();
        for (gi, group) in py_take_tensors(&sizes, COALESCE_BYTES)
            .into_iter()
            .enumerate()
        {
            let bytes: u64 = group.iter().map(|&i| sizes[i].0).sum();
            let flat = self.dp_alloc(bytes, Kind::Comm, format!("dp_reduce_flat{gi}"));
            if let Some(old) = prev.replace(flat) {
                self.drop_rt(old);
            }
            if root {
                let res = self.dp_alloc(bytes, Kind::Comm, format!("dp_reduce_result{gi}"));
                self.mark_grad(&res);
                for &i in &group {
                    let p = ps[i];
                    let g = self.param_grads[p].as_ref().expect("filtered");
                    let (layout, dtype) = (g.layout.clone(), g.dtype);
                    let mut v = self.view(&res, layout);
                    v.dtype = dtype;
                    results.push((p, v));
                }
                self.drop_rt(res);
            }
        }
        if let Some(old) = prev {
            self.drop_rt(old);
        }
        for &p in &ps {
            if let Some(g) = self.param_grads[p].take() {
                self.drop_rt(g);
            }
        }
        for (p, v) in results {
            self.param_grads[p] = Some(v);
        }
        for t in std::mem::take(&mut self.dp.gathered) {
            self.drop_rt(t);
        }
    }
}

/// `lower`'s check of a DataParallel graph over two or more devices: one whose training loop
/// runs the criterion outside the model must be the device's graph
/// (`crate::dataparallel::device_graph`), not the replica's whole step.
pub(super) fn check_graph(
    g: &crate::graph::Graph,
    r: &crate::recipe::Recipe,
) -> Result<(), super::LowerError> {
    let p = &r.parallel;
    if p.shard != Shard::DataParallel || p.dp < 2 {
        return Ok(());
    }
    // `replicate(self.module, self.device_ids[:len(inputs)])`: a batch smaller than the devices
    // leaves the last ones without a replica; an output device among them would hold the
    // gathered outputs (and the loop's criterion) with no replica, which is not modelled.
    let chunks = chunk_sizes(r.batch, p.dp);
    if p.output_device as usize >= chunks.len() {
        return Err(super::LowerError::DataParallel(format!(
            "--output-device {} gets no chunk of batch {} over {} devices (torch.chunk makes {:?}): an output device without a replica is not modelled; give --output-device 0..{} or a batch of at least {}",
            p.output_device,
            r.batch,
            p.dp,
            chunks,
            chunks.len() - 1,
            p.output_device + 1
        )));
    }
    if g.meta.contains_key(crate::dataparallel::META_KEY) {
        return Ok(());
    }
    match crate::dataparallel::criterion_split(g) {
        Ok(None) => Ok(()),
        Ok(Some(_)) => Err(super::LowerError::DataParallel(format!(
            "{}: the training loop's criterion is outside the model, so under DataParallel it runs once on the output device over the gathered outputs: lower the device's graph from vramsim_models::dataparallel::device_graph",
            g.name
        ))),
        Err(e) => Err(super::LowerError::DataParallel(e.to_string())),
    }
}
