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
//! * **Backward**: `Gather.backward` scatters the output gradient back (`Scatter.apply`); each
//!   replica's backward runs on its device; the parameters' gradients reach `Broadcast.backward`,
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
