//! `DistributedDataParallel.__init__`'s `_sync_module_states` (`torch/distributed/utils.py`): every
//! parameter and buffer of the module broadcast from rank 0 before the Reducer is built, through
//! `dist._broadcast_coalesced(process_group, module_states, broadcast_bucket_size, src)`
//! (`_sync_params_and_buffers`, skipped only when `module_states` is empty; no world-size guard,
//! and `init_sync=True` by default). Its temporaries all die before the Reducer's buckets are made.

use std::collections::VecDeque;

use super::{Lowering, Rt};
use crate::dtype::DType;
use crate::parallel::bucket_assignment;

/// `DistributedDataParallel.broadcast_bucket_size = 250 * 1024 * 1024` (`torch/nn/parallel/
/// distributed.py`, "used for intra-node param sync and inter-node sync as well").
pub(crate) const DDP_BROADCAST_BUCKET_BYTES: u64 = 250 * 1024 * 1024;

/// `broadcast_coalesced` keeps at most this many `BroadcastWork`s in flight (`constexpr auto
/// max_in_flight = 2` in `torch/csrc/distributed/c10d/comm.cpp`).
const MAX_IN_FLIGHT: usize = 2;

impl<'g> Lowering<'g> {
    /// `c10d::broadcast_coalesced` (`torch/csrc/distributed/c10d/comm.cpp`) over `states`, the DDP
    /// module's parameters then buffers: `compute_bucket_assignment_by_size(tensors,
    /// {broadcast_bucket_size})` groups them by dtype into buckets closed once they reach 250 MiB
    /// (sorted by their first tensor); each bucket's `BroadcastWork` flattens it
    /// (`at::flatten_dense_tensors`: `at::cat` of the tensors, one new tensor of the bucket's bytes;
    /// a bucket of one tensor is a `view(-1)` of it, nothing allocated) and broadcasts it on the
    /// NCCL stream. Before a third is started the oldest is finished (`work_->wait()`, the result
    /// copied back in place through `unflatten_dense_tensors` views) and dropped, freeing its flat
    /// tensor; the last two are finished in order after the loop.
    pub(super) fn ddp_sync_module_states(&mut self, stage: Option<u32>, states: &[Rt]) {
        if states.is_empty() {
            return;
        }
        // The bucket key is (dtype, device): every state is on the rank's GPU.
        let mut dtypes: Vec<DType> = Vec::new();
        let sizes: Vec<(u64, u8)> = states
            .iter()
            .map(|t| {
                let key = match dtypes.iter().position(|&d| d == t.dtype) {
                    Some(k) => k,
                    None => {
                        dtypes.push(t.dtype);
                        dtypes.len() - 1
                    }
                };
                (t.layout.numel() * t.dtype.size(), key as u8)
            })
            .collect();
        let interleaved = crate::pipeline::chunks_per_rank(self.r.parallel.pp_schedule) > 1;
        let prefix = match stage {
            Some(s) if interleaved => format!("ddp_sync_stage{s}_flat"),
            _ => "ddp_sync_flat".to_string(),
        };
        let mut in_flight: VecDeque<Option<Rt>> = VecDeque::new();
        for (i, bucket) in bucket_assignment(&sizes, &[DDP_BROADCAST_BUCKET_BYTES], true)
            .into_iter()
            .enumerate()
        {
            if in_flight.len() >= MAX_IN_FLIGHT {
                if let Some(Some(done)) = in_flight.pop_front() {
                    self.drop_rt(done);
                }
            }
            let flat = (bucket.len() > 1).then(|| {
                let numel = bucket.iter().map(|&t| states[t].layout.numel()).sum();
                let flat = self.comm_alloc(numel, states[bucket[0]].dtype, format!("{prefix}{i}"));
                self.collective_uses(&flat);
                flat
            });
            in_flight.push_back(flat);
        }
        while let Some(work) = in_flight.pop_front() {
            if let Some(done) = work {
                self.drop_rt(done);
            }
        }
    }
}
