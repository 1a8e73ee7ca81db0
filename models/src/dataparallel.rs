//! `torch.nn.DataParallel` (`--shard dataparallel`): one process drives the devices `0..N-1`,
//! and every device plays its own role. The rules, each from the source of PyTorch 2.15:
//!
//! * **Scatter** (`scatter_gather.py` `scatter` → `_functions.py` `Scatter.forward` →
//!   `torch/csrc/cuda/comm.cpp` `scatter`): the inputs are cut along dim 0 by `tensor.chunk(N)`
//!   ([`chunk_sizes`]); a chunk already on its device is a view (`.to()` returns `self`), the
//!   others are copies on their device. Fewer chunks than devices (a batch smaller than N) leave
//!   the last devices out: `replicate(self.module, self.device_ids[:len(inputs)])`.
//! * **Replicate** (`replicate.py` `replicate` → `_broadcast_coalesced_reshape` → `Broadcast` →
//!   `comm.cpp` `broadcast_coalesced` with `comm.py`'s `buffer_size=10485760`): every forward,
//!   the parameters (then the buffers) are grouped by `take_tensors` into flat buffers of at least
//!   [`COALESCE_BYTES`] (a group closes once it reaches the limit), each flattened on device 0
//!   (`flatten_dense_tensors`, a temporary that dies at the end of the loop iteration) and
//!   broadcast into one new flat tensor per other device; the replica's tensors there are views of
//!   it (`unflatten_dense_tensors`), so a flat copy lives until its last view dies. Device 0's
//!   replica gets the original tensors (`outputs[0] = tensors.vec()`): no copy.
//! * **Gather** (`scatter_gather.py` `gather` → `Gather.forward` → `comm.gather`): the outputs
//!   are concatenated on the output device (`at::empty` of the summed size, each replica's
//!   output copied in); scalar outputs (a loss) are unsqueezed first, so N of them make a vector.
//! * **Where the loss is computed** ([`criterion_split`]): a model that returns its loss
//!   (transformers' heads with labels, nanoGPT) computes it in every replica, and the loop
//!   averages the gathered vector; a loop that applies its criterion to the model's output
//!   (`loss = criterion(model(x), y)`: torchvision's and timm's references) applies it once, on
//!   the output device, to the gathered outputs of the whole batch. Then each replica's graph
//!   stops at the model's output ([`replica_graph`]), and the output device's graph adds the
//!   gather and the criterion at the whole batch ([`output_device_graph`]).
//! * **Backward**: `Gather.backward` scatters the output gradient back (`Scatter.apply` →
//!   `comm.cpp` `scatter`: a `narrow` of it per replica, `.to(device)`: a view on the output
//!   device, a copy elsewhere); each replica's backward runs on its device from its chunk; the
//!   parameters' gradients reach `Broadcast.backward`,
//!   which runs once all of them are there (they wait in its input buffer) and calls
//!   `ReduceAddCoalesced` → `comm.py` `reduce_add_coalesced(grads, destination=0,
//!   buffer_size=10485760)`: per `_take_tensors` group (a group is yielded *before* a tensor
//!   that would take it past the limit, [`py_take_tensors`]) each device flattens its gradients,
//!   `reduce_add` makes `torch.empty_like` of device 0's flat and `nccl.reduce`s into it; the
//!   summed gradients are views of these results, which `AccumulateGrad` on device 0 steals as
//!   `.grad` (`output.append(t.data)`: a view with the layout of the parameter).
//! * **Optimizer**: the user's optimizer holds the original parameters, on device 0 only.
//!
//! With one device `DataParallel.forward` calls `self.module(*inputs[0])` directly (no replicate,
//! no gather), and the scatter of one chunk on its own device is a view: the single-GPU step.

use crate::graph::{Graph, OpId, Source, ValueId};

/// `comm.py`: `broadcast_coalesced(tensors, devices, buffer_size=10485760)` and
/// `reduce_add_coalesced(inputs, destination=None, buffer_size=10485760)` (10 MiB); `Broadcast`
/// and `ReduceAddCoalesced` (`_functions.py`) call them with this default.
pub const COALESCE_BYTES: u64 = 10_485_760;

/// The chunk sizes `tensor.chunk(n, 0)` cuts a batch of `batch` into
/// (`aten/src/ATen/native/TensorShape.cpp` `chunk`: `split_size = ceil(batch / n)`, then
/// `split`: `max(ceil(batch / split_size), 1)` pieces, the last one what is left). There can be
/// fewer pieces than `n` (batch 5 on 4 devices: 2, 2, 1).
pub fn chunk_sizes(batch: u64, n: u32) -> Vec<u64> {
    let n = u64::from(n.max(1));
    let split = batch.div_ceil(n);
    if split == 0 {
        return vec![0];
    }
    let pieces = batch.div_ceil(split).max(1);
    (0..pieces).map(|i| split.min(batch - i * split)).collect()
}

/// `torch/_utils.py` `_take_tensors(tensors, size_limit)`: per dtype key, a group is yielded
/// before a tensor that would take it past `limit` (unless the group is empty); the groups still
/// open are yielded at the end, in the order their dtype first appeared. `tensors`: (bytes, dtype
/// key). Returns the indices of each group, in the order they are yielded.
pub fn py_take_tensors(tensors: &[(u64, u8)], limit: u64) -> Vec<Vec<usize>> {
    let mut open: Vec<(u8, Vec<usize>, u64)> = Vec::new();
    let mut out = Vec::new();
    for (i, &(bytes, key)) in tensors.iter().enumerate() {
        let slot = match open.iter().position(|o| o.0 == key) {
            Some(s) => s,
            None => {
                open.push((key, Vec::new(), 0));
                open.len() - 1
            }
        };
        let o = &mut open[slot];
        if o.2 + bytes > limit && o.2 > 0 {
            out.push(std::mem::take(&mut o.1));
            o.2 = 0;
        }
        o.1.push(i);
        o.2 += bytes;
    }
    out.extend(open.into_iter().map(|o| o.1).filter(|g| !g.is_empty()));
    out
}

/// `torch/csrc/utils/tensor_flatten.cpp` `take_tensors(tensors, size_limit)` (what
/// `broadcast_coalesced` groups with): a group of one type closes once its size reaches the limit
/// (after the tensor that reached it); open groups close at the end. The same rule as DDP's bucket
/// assignment with one limit and no sorting.
pub fn cpp_take_tensors(tensors: &[(u64, u8)], limit: u64) -> Vec<Vec<usize>> {
    crate::parallel::bucket_assignment(tensors, &[limit], false)
}

/// The `Graph::meta` key under which [`replica_graph`] and [`output_device_graph`] mark a
/// device's graph (and the lowering finds how to run it): `{"role": "replica" | "output",
/// "criterion_from": op, "gathered": [[replica output, gathered value], ...]}`.
pub const META_KEY: &str = "dataparallel";

/// Where the training loop's criterion starts in a graph whose model returns its outputs and
/// whose loss is computed by the loop (`output = model(images)`, `loss = criterion(output,
/// target)`: torchvision's and timm's reference loops, the zoo's `classifier_loss`, a base
/// model's `last_hidden_state.mean()`, a captured module whose loss function ran outside it).
/// Under `nn.DataParallel` that criterion runs once, on the output device, over the gathered
/// outputs of the whole batch (`data_parallel.py` `DataParallel.forward` returns
/// `self.gather(outputs, self.output_device)`; the loop applies the criterion to that).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CriterionSplit {
    /// The first op of the criterion: ops before it are the model's forward (the replica's).
    pub from: usize,
    /// What the model returns (the training loop's name binds it when op `from - 1` returns):
    /// `gather` concatenates each of them over the replicas.
    pub outputs: Vec<ValueId>,
    /// The one returned tensor the criterion reads: the gradient `Gather.backward` scatters to
    /// the replicas is this one's.
    pub seeded: ValueId,
    /// Inputs the criterion reads and the model does not (the targets): the loop's full-batch
    /// tensors, never scattered.
    pub targets: Vec<ValueId>,
}

/// A graph DataParallel cannot split as the source does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// The criterion reads something other than the model's returned tensors and the targets.
    #[error("{0}")]
    Unsupported(String),
}

/// The criterion of `g` outside its model, or `None` when the model returns its own loss (the
/// training loop binds the model's return after the graph's last op: transformers' heads with
/// labels, nanoGPT's `GPT.forward`), or when the graph says nothing of what the loop holds
/// ([`Graph::kept_outputs`] empty). The model's return is the first assignment the loop makes:
/// the earliest op of [`Graph::kept_outputs`].
pub fn criterion_split(g: &Graph) -> Result<Option<CriterionSplit>, SplitError> {
    let Some(ret) = g.kept_outputs.iter().map(|&(_, op)| op.0 as usize).min() else {
        return Ok(None);
    };
    let from = ret + 1;
    if from >= g.ops.len() {
        return Ok(None);
    }
    let mut outputs: Vec<ValueId> = Vec::new();
    for &(v, op) in &g.kept_outputs {
        if op.0 as usize == ret && !outputs.contains(&v) {
            outputs.push(v);
        }
    }
    let made_in_criterion = |v: ValueId| matches!(g.values[v.0 as usize].source, Source::Op { op, .. } if op.0 as usize >= from);
    let used_by_model = |v: ValueId| g.ops[..from].iter().any(|op| op.inputs.contains(&v));
    let mut read: Vec<ValueId> = Vec::new();
    let mut targets: Vec<ValueId> = Vec::new();
    for op in &g.ops[from..] {
        for &v in &op.inputs {
            if made_in_criterion(v) {
                continue;
            }
            if outputs.contains(&v) {
                if !read.contains(&v) {
                    read.push(v);
                }
                continue;
            }
            match g.values[v.0 as usize].source {
                Source::Input(_) if !used_by_model(v) => {
                    if !targets.contains(&v) {
                        targets.push(v);
                    }
                }
                _ => {
                    return Err(SplitError::Unsupported(format!(
                        "{}: the training loop's criterion reads value {} of the model (neither a returned tensor nor a target), which DataParallel would give it as a chunk: not modelled",
                        g.name, v.0
                    )))
                }
            }
        }
    }
    let seeded = match read.as_slice() {
        [one] => *one,
        _ => {
            return Err(SplitError::Unsupported(format!(
                "{}: the training loop's criterion reads {} of the model's returned tensors; DataParallel with a criterion outside the model is modelled for one",
                g.name,
                read.len()
            )))
        }
    };
    if outputs
        .iter()
        .any(|&v| g.values[v.0 as usize].shape.is_empty())
    {
        return Err(SplitError::Unsupported(format!(
            "{}: the model returns a 0-dim tensor and the training loop's criterion runs outside it: DataParallel's gather of scalars is modelled for a model that returns its loss",
            g.name
        )));
    }
    Ok(Some(CriterionSplit {
        from,
        outputs,
        seeded,
        targets,
    }))
}

/// The graph of a device that runs a replica but not the criterion (every device but the
/// output device, when the loop's criterion is outside the model): the model's forward only
/// (ops before `s.from`), its output the returned tensor the criterion reads, whose gradient
/// (this device's chunk of the one `Gather.backward` scatters, `_functions.py`) starts its
/// backward; the targets are not its inputs (the loop keeps them on the output device).
pub fn replica_graph(g: &Graph, s: &CriterionSplit) -> Graph {
    let mut t = g.clone();
    t.ops.truncate(s.from);
    t.output = Some(s.seeded);
    t.holds.retain(|&(_, op)| (op.0 as usize) < s.from);
    t.kept_outputs.retain(|&(_, op)| (op.0 as usize) < s.from);
    t.regions.retain(|r| r.end <= s.from);
    t.inputs.retain(|i| !s.targets.contains(&i.value));
    for (k, inp) in t.inputs.iter().enumerate() {
        t.values[inp.value.0 as usize].source = Source::Input(k);
    }
    t.meta.insert(
        META_KEY.into(),
        serde_json::json!({"role": "replica", "criterion_from": s.from}),
    );
    t
}

/// The graph of the output device when the loop's criterion is outside the model: the replica's
/// forward at its chunk (`replica`, ops before `s.from`), then, when `DataParallel.forward`
/// returns, one gathered tensor per returned one (`comm.cpp` `gather`: `at::empty` of the summed
/// size on the output device, each replica's output copied in; appended values, made when op
/// `s.from - 1` returns), then the criterion over the gathered tensors and the full-batch
/// targets, as `full` (the same model built for the whole batch) has it. The replica's returned
/// tensors live until the gather (the `outputs` list of `DataParallel.forward`).
pub fn output_device_graph(
    replica: &Graph,
    full: &Graph,
    s: &CriterionSplit,
) -> Result<Graph, SplitError> {
    let alike =
        replica.ops.len() == full.ops.len()
            && replica.values.len() == full.values.len()
            && replica.modules == full.modules
            && replica.holds == full.holds
            && replica.kept_outputs == full.kept_outputs
            && replica.ops.iter().zip(&full.ops).all(|(a, b)| {
                a.inputs == b.inputs && a.outputs == b.outputs && a.module == b.module
            });
    if !alike {
        return Err(SplitError::Unsupported(format!(
            "{}: the graph built for the whole batch ({}) is not the chunk's ({}) with other shapes, so the criterion cannot be placed on the output device",
            replica.name, full.batch, replica.batch
        )));
    }
    let mut h = replica.clone();
    let last = OpId(s.from as u32 - 1);
    let mut gathered: Vec<(ValueId, ValueId)> = Vec::new();
    for &l in &s.outputs {
        let v = ValueId(h.values.len() as u32);
        let mut val = replica.values[l.0 as usize].clone();
        val.shape = full.values[l.0 as usize].shape.clone();
        val.source = Source::Op {
            op: last,
            index: replica.ops[s.from - 1].outputs.len() + gathered.len(),
        };
        h.values.push(val);
        gathered.push((l, v));
    }
    let remap = |v: ValueId| {
        gathered
            .iter()
            .find(|(l, _)| *l == v)
            .map_or(v, |&(_, g)| g)
    };
    for i in s.from..h.ops.len() {
        let mut op = full.ops[i].clone();
        for v in &mut op.inputs {
            *v = remap(*v);
        }
        for &v in &op.outputs {
            h.values[v.0 as usize] = full.values[v.0 as usize].clone();
        }
        h.ops[i] = op;
    }
    for &v in &s.targets {
        h.values[v.0 as usize].shape = full.values[v.0 as usize].shape.clone();
    }
    // The loop's names bind the gathered tensors; the replica's outputs stay alive until the
    // gather, which runs before op `s.from` (the lowering's hook takes them then).
    for (v, op) in h.holds.iter_mut() {
        if op.0 as usize >= s.from {
            *v = remap(*v);
        }
    }
    for (v, _) in h.kept_outputs.iter_mut() {
        *v = remap(*v);
    }
    for &(l, _) in &gathered {
        h.holds.push((l, OpId(s.from as u32)));
    }
    h.meta.insert(
        META_KEY.into(),
        serde_json::json!({
            "role": "output",
            "criterion_from": s.from,
            "gathered": gathered.iter().map(|(l, g)| [l.0, g.0]).collect::<Vec<_>>(),
        }),
    );
    Ok(h)
}

/// The graph the lowering of `p.device` takes under DataParallel: `replica` (built for the
/// device's chunk) itself when the model returns its loss or with one device; otherwise the
/// replica's forward ([`replica_graph`]) or, on the output device, the forward, the gather and
/// the criterion over the whole batch ([`output_device_graph`], `full()` building the model for
/// the whole batch).
pub fn device_graph<E>(
    replica: Graph,
    p: &crate::Parallel,
    full: impl FnOnce() -> Result<Graph, E>,
) -> Result<Graph, E>
where
    E: From<SplitError>,
{
    if p.shard != crate::Shard::DataParallel || p.dp < 2 {
        return Ok(replica);
    }
    let Some(s) = criterion_split(&replica)? else {
        return Ok(replica);
    };
    if p.device == p.output_device {
        let full = full()?;
        Ok(output_device_graph(&replica, &full, &s)?)
    } else {
        Ok(replica_graph(&replica, &s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_as_torch_chunk() {
        assert_eq!(chunk_sizes(8, 4), vec![2, 2, 2, 2]);
        assert_eq!(chunk_sizes(10, 4), vec![3, 3, 3, 1]);
        assert_eq!(chunk_sizes(5, 4), vec![2, 2, 1]);
        assert_eq!(chunk_sizes(3, 8), vec![1, 1, 1]);
        assert_eq!(chunk_sizes(7, 1), vec![7]);
    }

    #[test]
    fn take_tensors_rules() {
        // Python: yield before the tensor that would pass the limit.
        let t = [(6, 0), (6, 0), (3, 0), (20, 0)];
        assert_eq!(py_take_tensors(&t, 10), vec![vec![0], vec![1, 2], vec![3]]);
        // C++: close after the tensor that reaches it.
        assert_eq!(cpp_take_tensors(&t, 10), vec![vec![0, 1], vec![2, 3]]);
    }
}
