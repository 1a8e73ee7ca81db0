//! The communication term of the step-time estimate ([`crate::steptime`]) for a parallel layout:
//! the bytes one rank sends per optimizer step in each process group, priced at the bandwidth of the
//! links that group spans ([`crate::links`]), and the pipeline's bubble. Like the rest of the
//! step-time model it ranks layouts; it does not time them.
//!
//! # Volumes (bytes one rank sends; ring algorithms)
//!
//! An all-reduce of `B` bytes over `n` ranks sends `2(n−1)/n·B`; an all-gather or reduce-scatter whose
//! full tensor is `B` bytes sends `(n−1)/n·B` (NCCL's ring algorithms, the bus-bandwidth convention
//! of nccl-tests' `PERFORMANCE.md`). `Ψ` is the rank's trainable parameters (already divided by
//! tensor and pipeline parallelism: the rank's graph holds its shard or stage), `w` their width.
//!
//! | layout | per micro-batch | per step | overlaps compute |
//! |---|---|---|---|
//! | DDP | all-reduce of the gradients, `2(n−1)/n·Ψw` (no `no_sync`: every backward syncs) | — | yes (buckets during backward) |
//! | ZeRO-1 | — | reduce-scatter of the gradients at the boundary, all-gather of the bf16 parameters: `2(n−1)/n·Ψw` | no |
//! | ZeRO-2 | reduce-scatter of the gradients, `(n−1)/n·Ψw` | all-gather of the parameters, `(n−1)/n·Ψw` | no (`overlap_comm` is off below stage 3) |
//! | `zero1-torch` | DDP's all-reduce | the broadcast of the stepped parameters, `(n−1)/n·Ψw` | the all-reduce only |
//! | ZeRO-3, FSDP2 | all-gather in forward and in backward, reduce-scatter of the gradients: `3(n−1)/n·Ψw` (FSDP2's all-gathers carry the frozen parameters too under fine-tuning, `Ψ_all`; without the backward's all-gather under `reshard_after_forward=False`, over `k` ranks under `=k`) | — | yes (prefetch) |
//! | TP (Megatron) | every collective of the rank's graph (`TpComm` ops): per layer two all-reduces in forward, two in backward of the `b·s·h` activations, `4·2(t−1)/t·bshw` (sequence parallelism trades each for an all-gather and a reduce-scatter, and gathers the linear's input again in backward) | — | no |
//! | PP | each stage boundary sends the activation forward and its gradient back: `2·bshw` | — | no |
//! | CP (ring attention) | per attention call: the K/V all-gather in forward and again in backward, `(c−1)·(|k|+|v|)·w` each; `c` rotations of the float32 K/V gradients in backward, `4·(|k|+|v|)` each | — | partly ([`RingCall`]) |
//!
//! **Bandwidth.** Ranks are laid out tensor-parallel innermost, then context-parallel, then
//! data-parallel, then pipeline (torchtitan's device mesh order `pp, dp_replicate, dp_shard, cp,
//! tp`, `ParallelDims` in `distributed/parallel_dims.py`; FSDP2 shards over the flattened
//! `dp_shard, cp`), `gpus_per_node` (8) to a node: a group whose span (its size times the sizes of
//! the dimensions inside it) fits in a node runs at the node's link bandwidth, else at the
//! network's.
//!
//! **CPU offload** sends the rank's partition over its PCIe link to the host ([`Links::host_gbs`]):
//! ZeRO-Offload the fp32 gradient slice out and the bf16 partition back at the step (exposed);
//! FSDP2's `CPUOffloadPolicy` and ZeRO-3's `offload_param` the shards in for every all-gather and
//! the gradients out (on side streams: overlapped); the offloaded optimizer then streams its fp32
//! state through host memory (7 passes of 4 B per element, exposed).
//!
//! **Step.** `step = max(compute, overlapped) + exposed`, the compute including the pipeline's
//! bubble ([`crate::steptime`]).

use vramsim_models::ops::TpComm;
use vramsim_models::{
    DTypeSpec, Graph, Offload, OpKind, Precision, Recipe, RegionKind, ReshardAfterForward, Shard,
    ValueId,
};

use crate::links::Links;

/// GPUs per node (DGX/HGX systems have 8).
pub const GPUS_PER_NODE: u32 = 8;

/// Host memory bandwidth one GPU's offloaded optimizer gets, GB/s: a two-socket host with eight
/// DDR5-4800 channels per socket (2 × 8 × 38.4 = 614 GB/s) shared by 8 GPUs, at the same 75%
/// streaming efficiency the step-time model gives HBM ([`crate::steptime::BANDWIDTH_EFFICIENCY`]).
pub const HOST_MEMORY_GBS_PER_GPU: f64 = 614.4 / 8.0 * 0.75;

/// Bytes one rank sends per optimizer step, by process group.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommWork {
    /// Data-parallel traffic that overlaps compute (DDP buckets, ZeRO-3/FSDP2 prefetch).
    pub dp_overlapped: f64,
    /// Data-parallel traffic that does not (ZeRO-1/2).
    pub dp_exposed: f64,
    /// Tensor-parallel traffic.
    pub tp: f64,
    /// Pipeline send/recv traffic.
    pub pp: f64,
    /// Host-link traffic of CPU offload that overlaps compute (FSDP2's copy-in of offloaded
    /// shards on the all-gather stream).
    pub host_overlapped: f64,
    /// Host-link traffic of CPU offload that does not (gradient partitions to the host, updated
    /// parameters back, at the step).
    pub host_exposed: f64,
    /// Bytes the offloaded optimizer reads and writes in host memory.
    pub cpu_optimizer: f64,
    /// The layout's degrees (dp, tp, pp).
    pub dims: (u32, u32, u32),
    /// Context-parallel ranks (`--cp`; 1 without): their ring traffic is priced per attention
    /// call ([`RingCall`]), and FSDP2's group spans dp × cp.
    pub cp: u32,
}

/// Seconds of each kind for one step on given links.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommTime {
    /// Communication hidden behind compute when compute is longer, s.
    pub overlapped_s: f64,
    /// Communication that adds to the step, s.
    pub exposed_s: f64,
}

impl CommWork {
    /// The traffic of one rank of `recipe`'s layout, whose graph (its shard or stage) is `graph`.
    pub fn of(graph: &Graph, recipe: &Recipe) -> CommWork {
        let par = &recipe.parallel;
        let mut work = CommWork {
            dims: (par.dp, par.tp, par.pp),
            cp: par.cp.max(1),
            ..CommWork::default()
        };
        if par.is_single() || par.shard == Shard::DataParallel {
            return work;
        }
        let psi: f64 = graph
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.shape.iter().product::<u64>() as f64)
            .sum();
        // FSDP2 shards and all-gathers every parameter, frozen ones too (`fully_shard` wraps all
        // of the module's parameters, `_fsdp_param.py`), but reduce-scatters only those with a
        // gradient (`foreach_reduce` over `fsdp_params_with_grad`): under fine-tuning the
        // gathers carry `Ψ_all`, the reduce-scatter `Ψ`.
        let psi_all: f64 = graph
            .params
            .iter()
            .map(|p| p.shape.iter().product::<u64>() as f64)
            .sum();
        let width = match recipe.precision {
            Precision::Bf16 | Precision::Fp16 => 2.0,
            _ => 4.0,
        };
        // FSDP2 reduces in `reduce_dtype`, else in the model's dtype (2.15's
        // `FSDPParamGroup._get_reduce_dtype`, `lower/fsdp.rs`).
        let reduce_width = match (par.shard, par.fsdp_reduce_dtype) {
            (Shard::Fsdp2, Some(d)) => d.size() as f64,
            _ => width,
        };
        let gather_width = match (par.shard, par.fsdp_param_dtype) {
            (Shard::Fsdp2, Some(d)) => d.size() as f64,
            _ => width,
        };
        let accum = f64::from(recipe.accum.max(1));
        // FSDP2 shards over dp × cp (torchtitan's `dp_shard_cp` mesh); cp is 1 for the others
        let n = f64::from(par.fsdp_world());
        let share = (n - 1.0) / n;
        match par.shard {
            // no data parallelism (tensor or pipeline parallelism alone), or one device's
            // DataParallel (returned above)
            Shard::None | Shard::DataParallel => {}
            Shard::Ddp => work.dp_overlapped = accum * 2.0 * share * psi * reduce_width,
            Shard::Zero1 => work.dp_exposed = 2.0 * share * psi * width,
            Shard::Zero2 => work.dp_exposed = (accum + 1.0) * share * psi * width,
            Shard::Fsdp2 => {
                // the backward's all-gather: none when the blocks stay unsharded (always under
                // --pp: torchtitan's `reshard_after_forward = not pp_enabled`, and the stage stays
                // unsharded over every micro-batch, `lower/fsdp.rs`), over the post-forward mesh
                // of N ranks with `reshard_after_forward=N`
                let backward_gather = match par.reshard_after_forward {
                    _ if par.pp > 1 => 0.0,
                    ReshardAfterForward::True => share,
                    ReshardAfterForward::False => 0.0,
                    ReshardAfterForward::To(k) => (f64::from(k) - 1.0) / f64::from(k),
                };
                work.dp_overlapped = accum
                    * ((share + backward_gather) * psi_all * gather_width
                        + share * psi * reduce_width);
            }
            // torch's ZeroRedundancyOptimizer: DDP's all-reduce, then every rank broadcasts the
            // parameters it stepped (each rank receives the others': (n−1)/n of them)
            Shard::ZeroRedundancy => {
                work.dp_overlapped = accum * 2.0 * share * psi * width;
                work.dp_exposed = share * psi * width;
            }
            // ZeRO-3 (`overlap_comm` on at stage 3): parameters gathered in forward and in
            // backward, gradients reduce-scattered, every micro-batch
            _ => work.dp_overlapped = accum * 3.0 * share * psi * width,
        }
        // CPU offload: the rank's partition crosses the host link, and the optimizer (fp32
        // master and Adam moments: reads parameter, gradient and two moments, writes three,
        // 4 B each) runs in host memory
        let partition = psi / n;
        let offloaded_step = 7.0 * 4.0 * partition;
        match (par.offload, par.shard) {
            (Offload::None, _) => {}
            (Offload::Optimizer, _) => {
                // the fp32 gradient slice to the host, the updated bf16 partition back
                work.host_exposed = (4.0 + 2.0) * partition;
                work.cpu_optimizer = offloaded_step;
            }
            (Offload::Params, Shard::Fsdp2) => {
                // every micro-batch: the shards copied in for the forward's and the backward's
                // all-gathers, the reduce-scatter output copied out
                work.host_overlapped = accum * 3.0 * partition * width;
                work.cpu_optimizer = offloaded_step;
            }
            (Offload::Params, _) => {
                // ZeRO-3 offload_param: the partitions copied in for each gather, the gradient
                // chunk out, the updated partition back
                work.host_overlapped = accum * 3.0 * partition * width;
                work.host_exposed = 2.0 * partition;
                work.cpu_optimizer = offloaded_step;
            }
        }
        if par.tp > 1 {
            work.tp = accum * tp_bytes(graph, recipe);
        }
        if par.pp > 1 {
            // the graph is one micro-batch of the rank's stages; a step runs `m` of them, each
            // sending its activation forward and receiving its gradient (the bubble is the
            // step-time model's: `crate::steptime`)
            let m = vramsim_models::pipeline::microbatches(par, recipe.batch).unwrap_or(1);
            work.pp = accum * f64::from(m) * 2.0 * residual_bytes(graph, recipe);
        }
        work
    }

    /// Prices the traffic on `links`.
    pub fn time(&self, links: &Links) -> CommTime {
        let (dp, tp, pp) = self.dims;
        let node = GPUS_PER_NODE;
        let gbs = |span: u32| -> f64 {
            if span <= node {
                links.intra_gbs
            } else {
                links.inter_gbs
            }
        };
        let seconds = |bytes: f64, span: u32| bytes / (gbs(span) * 1e9);
        let dp_span = dp.saturating_mul(self.cp).saturating_mul(tp);
        let pp_span = dp_span.saturating_mul(pp);
        let host = |bytes: f64| bytes / (links.host_gbs * 1e9);
        CommTime {
            overlapped_s: seconds(self.dp_overlapped, dp_span) + host(self.host_overlapped),
            exposed_s: seconds(self.dp_exposed, dp_span)
                + seconds(self.tp, tp)
                + seconds(self.pp, pp_span)
                + host(self.host_exposed)
                + self.cpu_optimizer / (HOST_MEMORY_GBS_PER_GPU * 1e9),
        }
    }
}

impl CommWork {
    /// The bandwidth of the context-parallel group's links, GB/s: the group spans `cp × tp`
    /// ranks (cp sits just outside tp in torchtitan's mesh order), inside a node when that fits.
    pub fn cp_gbs(&self, links: &Links) -> f64 {
        if self.cp.saturating_mul(self.dims.1) <= GPUS_PER_NODE {
            links.intra_gbs
        } else {
            links.inter_gbs
        }
    }
}

/// One ring-attention call of a context-parallel rank (`--cp`, `vramsim_models::lower::cp`): the
/// rank's key and value at `seq/cp` tokens. PyTorch 2.15's `_templated_ring_attention` (default
/// `rotate_method` all-gather, torchtitan's `"allgather"`) all-gathers `cat([k, v])` once: issued
/// at step 0 before its kernel, waited at step 1 (`_AllGatherRotater.next_buffer`), so step 0's
/// kernel (causal on the local q, k, v: the graph's own SDPA op at `seq/cp`) hides it and the later
/// steps wait for the rest. `_templated_ring_attention_backward` all-gathers the K/V again the same
/// way, and passes the float32 `cat([dk, dv])` to the next rank after every step
/// (`dkv_rotater.exchange_buffers`: `_AllToAllRotater`, `permute_tensor`, the whole buffer to one
/// neighbour): each rotation is waited after the next step's kernel, the last one right after the
/// loop. With the head-tail load balancer, the `cp − 1` later steps each run on half the keys or
/// half the queries: half of step 0's work.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RingCall {
    /// Elements of the rank's key and value, `|k| + |v|`.
    pub kv: f64,
    /// Their width in bytes.
    pub width: f64,
}

/// What one ring-attention call adds to a step, s.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RingTime {
    /// The forward's later steps (the graph prices step 0 only): `(cp − 1)` half kernels.
    pub forward_compute_s: f64,
    /// The backward's later steps, twice the forward's.
    pub backward_compute_s: f64,
    /// The forward's all-gather beyond step 0's kernel.
    pub forward_exposed_s: f64,
    /// The backward's all-gather beyond step 0's backward kernel, each rotation beyond the next
    /// step's kernel, and the last rotation whole.
    pub backward_exposed_s: f64,
}

impl RingCall {
    /// Bytes one rank sends for one all-gather of the K/V over `cp` ranks (ring algorithm: the
    /// full `cp·(|k| + |v|)·w` tensor less the rank's own share).
    pub fn gather_bytes(&self, cp: u32) -> f64 {
        f64::from(cp.saturating_sub(1)) * self.kv * self.width
    }

    /// Bytes one rank sends per rotation of the K/V gradients: the float32 `cat([dk, dv])`
    /// (`convert_to_f32` accumulators).
    pub fn rotation_bytes(&self) -> f64 {
        4.0 * self.kv
    }

    /// Bytes one rank sends for one micro-batch's forward and backward of this call: two
    /// all-gathers and `cp` rotations.
    pub fn bytes(&self, cp: u32) -> f64 {
        2.0 * self.gather_bytes(cp) + f64::from(cp) * self.rotation_bytes()
    }

    /// The call's added time on links of `gbs` GB/s, given step 0's forward kernel time `t0`
    /// (the backward kernel of a step takes twice its forward, [`crate::steptime`]).
    pub fn time(&self, cp: u32, gbs: f64, t0: f64) -> RingTime {
        if cp < 2 {
            return RingTime::default();
        }
        let later = f64::from(cp - 1);
        let gather = self.gather_bytes(cp) / (gbs * 1e9);
        let rotation = self.rotation_bytes() / (gbs * 1e9);
        // a later step's backward kernel: twice half of step 0's forward
        let later_bwd = t0;
        RingTime {
            forward_compute_s: later * t0 / 2.0,
            backward_compute_s: later * later_bwd,
            forward_exposed_s: (gather - t0).max(0.0),
            backward_exposed_s: (gather - 2.0 * t0).max(0.0)
                + later * (rotation - later_bwd).max(0.0)
                + rotation,
        }
    }
}

/// The ring-attention calls of a context-parallel rank's graph (none without `--cp`): one per
/// fused SDPA op, with its op index, from the shapes of its key and value (`[B, H, seq/cp, D]`)
/// at the activations' width.
pub fn ring_calls(graph: &Graph, recipe: &Recipe) -> Vec<(usize, RingCall)> {
    if recipe.parallel.cp < 2 {
        return Vec::new();
    }
    let numel = |v: ValueId| graph.values[v.0 as usize].shape.iter().product::<u64>() as f64;
    let width = |v: ValueId| match graph.values[v.0 as usize].dtype {
        DTypeSpec::Fixed(d) => d.size() as f64,
        DTypeSpec::Model => match recipe.precision {
            Precision::Fp32 => 4.0,
            _ => 2.0,
        },
    };
    graph
        .ops
        .iter()
        .enumerate()
        .filter(|(_, op)| matches!(op.kind, OpKind::Sdpa { .. }))
        .filter_map(|(i, op)| {
            let (&k, &v) = (op.inputs.get(1)?, op.inputs.get(2)?);
            Some((
                i,
                RingCall {
                    kv: numel(k) + numel(v),
                    width: width(k),
                },
            ))
        })
        .collect()
}

/// Bytes one rank sends in its tensor-parallel group for one micro-batch: every collective of the
/// rank's graph ([`TpComm`]), forward and backward, the full tensor `B` of each at the
/// activations' width: `Copy` all-reduces the gradient in backward and `Reduce` the input in
/// forward (`2(t−1)/t·B` each); `GatherToBuffer` all-gathers forward, gathers again and
/// reduce-scatters backward (`3(t−1)/t·B`); `ReduceScatter` reduce-scatters forward and all-gathers
/// backward, `Scatter` all-gathers backward (`(t−1)/t·B` per collective). Megatron's
/// vocab-parallel cross-entropy adds three all-reduces of one float per token.
fn tp_bytes(graph: &Graph, recipe: &Recipe) -> f64 {
    let t = f64::from(recipe.parallel.tp);
    let share = (t - 1.0) / t;
    let width = |v: ValueId| -> f64 {
        match graph.values[v.0 as usize].dtype {
            DTypeSpec::Fixed(d) => d.size() as f64,
            DTypeSpec::Model => match recipe.precision {
                Precision::Bf16 | Precision::Fp16 => 2.0,
                _ => 4.0,
            },
        }
    };
    let full = |v: ValueId| -> f64 {
        graph.values[v.0 as usize].shape.iter().product::<u64>() as f64 * width(v)
    };
    graph
        .ops
        .iter()
        .map(|op| {
            let largest = op
                .inputs
                .iter()
                .chain(&op.outputs)
                .map(|&v| full(v))
                .fold(0.0, f64::max);
            match &op.kind {
                OpKind::TpComm(c) => {
                    let collectives = match c {
                        TpComm::Copy | TpComm::Reduce => 2.0,
                        TpComm::GatherToBuffer => 3.0,
                        TpComm::ReduceScatter => 2.0,
                        TpComm::Scatter => 1.0,
                        // LoRA's adapters under --tp: all-gather forward and reduce-scatter
                        // backward; all-gather forward only (backward slices); all-gather
                        // backward only (forward is a view).
                        TpComm::SeqGather => 2.0,
                        TpComm::GatherLast | TpComm::SeqSplitView => 1.0,
                        // the gather before a replicated head (backward slices)
                        TpComm::SeqGatherReplicated => 1.0,
                    };
                    // the collective's full tensor is its largest operand (a sequence shard
                    // is 1/t of it)
                    collectives * share * largest
                }
                OpKind::VocabParallelCrossEntropy => {
                    let tokens = op.outputs.first().map_or(0.0, |&v| {
                        graph.values[v.0 as usize].shape.iter().product::<u64>() as f64
                    });
                    3.0 * 2.0 * share * tokens * 4.0
                }
                _ => 0.0,
            }
        })
        .sum()
}

/// Bytes of one micro-batch's residual stream (`b·s·h` elements at the activations' width): the
/// input of the first transformer block, or 0 for a model without blocks. A pipeline stage sends it
/// forward and receives its gradient.
fn residual_bytes(graph: &Graph, recipe: &Recipe) -> f64 {
    let width = match recipe.precision {
        Precision::Fp32 => 4.0,
        _ => 2.0,
    };
    let Some(first) = graph.regions.iter().find(|r| r.kind == RegionKind::Block) else {
        return 0.0;
    };
    graph.ops[first.start]
        .inputs
        .iter()
        .map(|v| graph.values[v.0 as usize].shape.iter().product::<u64>())
        .max()
        .unwrap_or(0) as f64
        * width
}

#[cfg(test)]
mod tests {
    use super::*;
    use vramsim_models::{zoo, Precision, Recipe, Shard};

    /// LLaMA-2-7B at seq 4096 over cp 4: each rank's key and value are `[1, 32, 1024, 128]`
    /// (32 heads of 128, no GQA; 4096 / 4 tokens), bf16.
    #[test]
    fn ring_volumes_by_hand() {
        let mut recipe = Recipe::new(1, 4096);
        recipe.precision = Precision::Bf16;
        recipe.parallel.dp = 2;
        recipe.parallel.cp = 4;
        recipe.parallel.shard = Shard::Fsdp2;
        let graph = zoo::build("llama2-7b", &recipe).unwrap();
        let calls = ring_calls(&graph, &recipe);
        assert_eq!(calls.len(), 32, "one ring per layer");
        let kv = 2.0 * 32.0 * 1024.0 * 128.0;
        for (_, call) in &calls {
            assert_eq!(call.kv, kv);
            assert_eq!(call.width, 2.0);
            // forward: the all-gather of cat([k, v]) over 4 ranks sends 3 of its 4 shares
            assert_eq!(call.gather_bytes(4), 3.0 * kv * 2.0); // 48 MiB
                                                              // backward: the same all-gather, and 4 rotations of the float32 K/V gradients
            assert_eq!(call.rotation_bytes(), 4.0 * kv); // 32 MiB
            assert_eq!(
                call.bytes(4),
                2.0 * 48.0 * 1048576.0 + 4.0 * 32.0 * 1048576.0
            );
        }
        // FSDP2 over dp × cp = 8 ranks, one node: tp 1 × cp 4 and dp 2 × cp 4 × tp 1 fit
        let work = CommWork::of(&graph, &recipe);
        assert_eq!(work.cp, 4);
        let links = crate::links::links(Some("h100-80gb"));
        assert_eq!(work.cp_gbs(links), links.intra_gbs);
        // without --cp there is no ring
        let mut single = recipe.clone();
        single.parallel.cp = 1;
        let g1 = zoo::build("llama2-7b", &single).unwrap();
        assert!(ring_calls(&g1, &single).is_empty());
    }

    /// The ring's overlap by hand: at 100 GB/s, with step 0's kernel `t0`.
    #[test]
    fn ring_time_by_hand() {
        let call = RingCall {
            kv: 1e9,
            width: 2.0,
        };
        // cp 2: gather 2 GB = 20 ms, rotation 4 GB = 40 ms
        let t = call.time(2, 100.0, 0.005);
        assert!((t.forward_compute_s - 0.0025).abs() < 1e-12);
        assert!((t.backward_compute_s - 0.005).abs() < 1e-12);
        assert!((t.forward_exposed_s - 0.015).abs() < 1e-12);
        // gather beyond 2·t0, one rotation beyond the next step's kernel t0, the last whole
        assert!((t.backward_exposed_s - (0.010 + 0.035 + 0.040)).abs() < 1e-12);
        // kernels long enough hide all but the last rotation
        let t = call.time(2, 100.0, 1.0);
        assert_eq!(t.forward_exposed_s, 0.0);
        assert!((t.backward_exposed_s - 0.040).abs() < 1e-12);
        assert_eq!(call.time(1, 100.0, 1.0), RingTime::default());
    }
}
