//! `torch.nn.DataParallel` on one device of the layout (`Parallel::device`): the rules of
//! `crate::dataparallel`, as allocations of that device's trace. The graph is the replica's (its
//! chunk of the batch); with one device nothing here runs (`DataParallel.forward` calls the
//! module directly).
//!
//! The replica is the whole graph, criterion included (the loss of every replica is gathered as
//! a vector and averaged on the output device, as with a model that returns its loss).

use super::{Kind, Lowering, Rt};
use crate::dataparallel::{chunk_sizes, cpp_take_tensors, py_take_tensors, COALESCE_BYTES};
use crate::dtype::DType;
use crate::graph::{ModuleId, ValueId};
use crate::layout::Layout;
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
        if !self.dp_on() || self.r.parallel.device != 0 {
            return;
        }
        let chunk = self.g.batch.max(1);
        for &v in inputs {
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

    /// When `DataParallel.forward` returns: `gather` concatenates the replicas' outputs on the
    /// output device (the loss of each replica, unsqueezed: a vector of one per device, then the
    /// loop's `.mean()`; the model's other returned tensors at the whole batch, alive until the
    /// loss is computed); then the replicas and the scattered inputs, locals of the forward, die
    /// (their tensors live on where autograd saved them).
    pub(super) fn dp_gather(&mut self, inputs: &[ValueId]) {
        if !self.dp_on() {
            return;
        }
        let g = self.g;
        if self.r.parallel.device == self.r.parallel.output_device {
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
        if self.dp_copy() {
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
            for &v in inputs.iter().rev() {
                if let Some(rt) = self.vals[v.0 as usize].take() {
                    self.drop_rt(rt);
                }
            }
        }
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
