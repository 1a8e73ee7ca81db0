//! Data-parallel layouts lowered per rank, against closed forms derived from the frameworks'
//! rules and the ZeRO paper (never from vramsim's output):
//!
//! * DDP (`gradient_as_bucket_view=False`): the Reducer's bucket tensors hold exactly the
//!   gradients' bytes, Ψ × 4 B in fp32, once buckets exist (iteration 1's single bucket and the
//!   rebuilt 1 MiB + 25 MiB ones alike).
//! * ZeRO (Rajbhandari et al., SC'20, §5 and Figure 1), mixed-precision Adam, Ψ parameters, N ranks:
//!   stage 1 holds 2Ψ + 2Ψ + 12Ψ/N bytes of model states per rank, stage 2 2Ψ + 14Ψ/N. DeepSpeed
//!   pads the flat bf16 group to a multiple of 2N elements (`stage_1_and_2.py`,
//!   `flatten_dense_tensors_aligned(..., 2 * dp_world_size)`), so Ψ' (padded) stands for Ψ in the
//!   partitioned terms and in the flat parameters.

mod common;
use common::{live_at, live_at_phase, max_live, phase_index, zero3_partition, zero3_persistent};
use std::collections::HashMap;

use vramsim_models::{
    lower, zoo, DType, Offload, OptimizerKind, Parallel, Precision, Recipe, ReshardAfterForward,
    Shard,
};
use vramsim_traces::{Category, Event, Trace};

fn recipe(batch: u64, seq: u64, dp: u32, shard: Shard) -> Recipe {
    Recipe {
        parallel: Parallel {
            dp,
            shard,
            ..Parallel::default()
        },
        ..Recipe::new(batch, seq)
    }
}

#[test]
fn ddp_buckets_hold_the_gradients_bytes() {
    for (name, batch, seq) in [("gpt2", 2, 128), ("resnet18", 4, 0), ("bert-base", 2, 128)] {
        let r = recipe(batch, seq, 4, Shard::Ddp);
        let g = zoo::build(name, &r).unwrap();
        let psi = g.param_count();
        let t = lower(&g, &r).unwrap();
        // After each backward (the optimizer marker) every gradient exists: iteration 0 with the
        // constructor's bucket, iteration 1 with the rebuilt ones.
        for it in 0..2 {
            let live = live_at_phase(&t, "optimizer", it);
            let comm = live.get(&Category::Communication).copied().unwrap_or(0);
            assert_eq!(comm, 4 * psi, "{name}: bucket bytes, iteration {it}");
            assert_eq!(
                live.get(&Category::Gradient).copied().unwrap_or(0),
                4 * psi,
                "{name}: gradient bytes, iteration {it}"
            );
        }
        // The rebuilt buckets: a first one of at least 1 MiB unless the model is smaller, then
        // buckets of ≥ 25 MiB but the last (`compute_bucket_assignment_by_size`).
        let buckets: Vec<u64> = t
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Alloc { size, tag, .. }
                    if tag.as_deref().is_some_and(|t| t.starts_with("ddp_bucket")) =>
                {
                    Some(*size)
                }
                _ => None,
            })
            .collect();
        assert_eq!(buckets[0], 4 * psi, "{name}: iteration 1 has one bucket");
        let rebuilt = &buckets[1..];
        assert_eq!(rebuilt.iter().sum::<u64>(), 4 * psi, "{name}");
        assert!(rebuilt[0] >= 1 << 20, "{name}: {rebuilt:?}");
        for b in &rebuilt[1..rebuilt.len() - 1] {
            assert!(*b >= 25 << 20, "{name}: {rebuilt:?}");
        }
        // A bucket closes on the parameter that reaches its limit: it exceeds the limit by less
        // than the largest parameter.
        let largest = g
            .params
            .iter()
            .map(|p| 4 * p.shape.iter().product::<u64>())
            .max()
            .unwrap();
        assert!(rebuilt[0] < (1 << 20) + largest, "{name}: {rebuilt:?}");
    }
}

/// The models and data-parallel degrees the ZeRO tests check (whole and padded partitions: 64
/// ranks do not divide GPT-2's parameters evenly).
const ZERO_CASES: [(&str, u64); 4] = [
    ("gpt2", 8),
    ("gpt2", 64),
    ("bert-base", 16),
    ("tinyllama-1.1b", 4),
];

/// (stage, ranks): the model states per rank by the ZeRO paper's formula, against the trace.
#[test]
fn zero_model_states_per_rank_match_the_paper() {
    // DeepSpeed's bf16 and fp16 modes keep the same sizes (16-bit parameters and gradients, fp32
    // master and Adam moments); the paper's figures are for fp16 mixed precision.
    for (shard, precision) in [Shard::Zero1, Shard::Zero2]
        .into_iter()
        .flat_map(|s| [(s, Precision::Bf16), (s, Precision::Fp16)])
    {
        for (name, n) in ZERO_CASES {
            let mut r = recipe(1, 128, n as u32, shard);
            r.precision = precision;
            r.optimizer = OptimizerKind::AdamW;
            let g = zoo::build(name, &r).unwrap();
            let psi = g.param_count();
            let padded = psi.div_ceil(2 * n) * 2 * n;
            let t = lower(&g, &r).unwrap();
            let (params, grads, optim) = match shard {
                // Full bf16 gradients exist until `reduce_gradients` at the boundary.
                Shard::Zero1 => (2 * padded, 2 * psi, 12 * padded / n),
                _ => (2 * padded, 2 * padded / n, 12 * padded / n),
            };
            let live = match shard {
                Shard::Zero1 => live_at_phase(&t, "reduce_gradients", 1),
                _ => live_at_phase(&t, "optimizer", 1),
            };
            let get = |c| live.get(&c).copied().unwrap_or(0);
            assert_eq!(get(Category::Parameter), params, "{name} {shard} N={n}");
            assert_eq!(get(Category::Gradient), grads, "{name} {shard} N={n}");
            assert_eq!(get(Category::OptimizerState), optim, "{name} {shard} N={n}");
            // The paper's totals, 2Ψ+2Ψ+12Ψ/N and 2Ψ+14Ψ/N, with Ψ' for the padded terms.
            let total =
                get(Category::Parameter) + get(Category::Gradient) + get(Category::OptimizerState);
            let paper = match shard {
                Shard::Zero1 => 2 * padded + 2 * psi + 12 * padded / n,
                _ => 2 * padded + 14 * padded / n,
            };
            assert_eq!(total, paper, "{name} {shard} N={n}");
            // The IPG buffer: reduce_bucket_size = 5e8 elements of bf16.
            assert_eq!(
                get(Category::Communication),
                match shard {
                    Shard::Zero1 => 1_000_000_000,
                    _ => 0,
                },
                "{name} {shard} N={n}: IPG buffer"
            );
        }
    }
}

/// FSDP2 without a `MixedPrecisionPolicy`, fp32 AdamW: after the backward every rank holds its
/// padded shards of the parameters (4 B each), of the gradients (the reduce-scatter outputs, 4 B)
/// and of Adam's two moments (8 B): 16Ψ'/N, where each parameter is padded to ⌈dim0/N⌉ rows
/// (`_fsdp_param.py`, `FSDPParam._init_sharded_param`); nothing unsharded and no collective
/// buffer is left (the root reshards after its backward, the last reduce-scatter input dies with
/// the backward's final callback).
#[test]
fn fsdp2_model_states_per_rank_are_the_padded_shards() {
    for (name, n) in [
        ("gpt2", 8u64),
        ("llama2-7b", 64),
        ("resnet18", 4),
        ("bert-base", 16),
    ] {
        let seq = if name == "resnet18" { 0 } else { 128 };
        let r = recipe(2, seq, n as u32, Shard::Fsdp2);
        let g = zoo::build(name, &r).unwrap();
        let shard_elems: u64 = g
            .params
            .iter()
            .map(|p| match p.shape.split_first() {
                Some((d0, rest)) => d0.div_ceil(n) * rest.iter().product::<u64>(),
                None => 1,
            })
            .sum();
        let t = lower(&g, &r).unwrap();
        let live = live_at_phase(&t, "optimizer", 1);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(get(Category::Parameter), 4 * shard_elems, "{name} N={n}");
        assert_eq!(get(Category::Gradient), 4 * shard_elems, "{name} N={n}");
        assert_eq!(
            get(Category::OptimizerState),
            8 * shard_elems,
            "{name} N={n}"
        );
        assert_eq!(get(Category::Communication), 0, "{name} N={n}");
        // Without padding (every dim 0 divisible by N) this is the ZeRO paper's 16Ψ/N.
        if g.params
            .iter()
            .all(|p| p.shape.first().is_none_or(|d| d % n == 0))
        {
            assert_eq!(
                get(Category::Parameter) + get(Category::Gradient) + get(Category::OptimizerState),
                16 * g.param_count() / n,
                "{name} N={n}"
            );
        }
    }
}

/// FSDP2's default `reshard_after_forward` (None: True for the blocks, False for the root): when
/// the forward ends, the blocks hold only their shards, the root (embedding, final norm, head of a
/// LLaMA) stays unsharded at its padded size, and the root's post-forward dropped the last parked
/// all-gather output.
#[test]
fn fsdp2_keeps_only_the_root_unsharded_after_forward() {
    let n = 8u64;
    let r = recipe(1, 128, n as u32, Shard::Fsdp2);
    let g = zoo::build("llama2-7b", &r).unwrap();
    let padded = |shape: &[u64]| match shape.split_first() {
        Some((d0, rest)) => d0.div_ceil(n) * rest.iter().product::<u64>(),
        None => 1,
    };
    let shards: u64 = g.params.iter().map(|p| padded(&p.shape)).sum();
    let root: u64 = g
        .params
        .iter()
        .filter(|p| !p.name.contains(".layers."))
        .map(|p| padded(&p.shape) * n)
        .sum();
    assert_eq!(root, 2 * 32000 * 4096 + 4096, "embed_tokens, lm_head, norm");
    let t = lower(&g, &r).unwrap();
    for it in 0..2 {
        let live = live_at_phase(&t, "backward", it);
        assert_eq!(
            live.get(&Category::Parameter).copied().unwrap_or(0),
            4 * (shards + root),
            "iteration {it}"
        );
        assert_eq!(live.get(&Category::Communication).copied().unwrap_or(0), 0);
    }
}

/// torchtitan's FSDP2 policy, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` on an fp32
/// LLaMA: the shards, the sharded gradients (reduced in fp32, the model's dtype: no cast) and Adam's
/// moments stay fp32 (4 + 4 + 8 bytes per padded shard element), while the unsharded root at the end
/// of the forward is bf16 (2 bytes per padded element).
#[test]
fn fsdp2_mixed_precision_keeps_fp32_shards_and_bf16_unsharded_parameters() {
    let n = 8u64;
    let mut r = recipe(1, 128, n as u32, Shard::Fsdp2);
    r.parallel.fsdp_param_dtype = Some(DType::BF16);
    r.parallel.fsdp_reduce_dtype = Some(DType::F32);
    let g = zoo::build("llama2-7b", &r).unwrap();
    let padded = |shape: &[u64]| match shape.split_first() {
        Some((d0, rest)) => d0.div_ceil(n) * rest.iter().product::<u64>(),
        None => 1,
    };
    let shards: u64 = g.params.iter().map(|p| padded(&p.shape)).sum();
    let root: u64 = 2 * 32000 * 4096 + 4096;
    let t = lower(&g, &r).unwrap();
    let live = live_at_phase(&t, "backward", 1);
    assert_eq!(
        live.get(&Category::Parameter).copied().unwrap_or(0),
        4 * shards + 2 * root
    );
    let live = live_at_phase(&t, "optimizer", 1);
    let get = |c| live.get(&c).copied().unwrap_or(0);
    assert_eq!(get(Category::Parameter), 4 * shards);
    assert_eq!(get(Category::Gradient), 4 * shards);
    assert_eq!(get(Category::OptimizerState), 8 * shards);
}

/// DDP's `gradient_as_bucket_view=True`: after each backward the gradients are views of the
/// buckets, so gradients and buckets together hold Ψ × 4 B once (the default holds them twice).
#[test]
fn ddp_bucket_view_keeps_one_copy_of_the_gradients() {
    let mut r = recipe(2, 128, 4, Shard::Ddp);
    r.parallel.gradient_as_bucket_view = true;
    let g = zoo::build("gpt2", &r).unwrap();
    let psi = g.param_count();
    let t = lower(&g, &r).unwrap();
    for it in 0..2 {
        let live = live_at_phase(&t, "optimizer", it);
        assert_eq!(live.get(&Category::Communication).copied(), Some(4 * psi));
        assert_eq!(live.get(&Category::Gradient).copied().unwrap_or(0), 0);
    }
}

/// The allocations whose tag starts with `prefix`: (live at most at once, made in all).
fn tagged(t: &Trace, prefix: &str) -> (usize, usize) {
    let mut live: Vec<String> = Vec::new();
    let (mut max, mut made) = (0, 0);
    for e in &t.events {
        match e {
            Event::Alloc { id, tag, .. }
                if tag.as_deref().is_some_and(|t| t.starts_with(prefix)) =>
            {
                live.push(id.to_string());
                made += 1;
                max = max.max(live.len());
            }
            Event::Free { id } => live.retain(|l| *l != id.to_string()),
            _ => {}
        }
    }
    (max, made)
}

/// The bytes of every allocation tagged `tag`, summed over the trace.
fn tagged_bytes(t: &Trace, tag: &str) -> u64 {
    t.events
        .iter()
        .filter_map(|e| match e {
            Event::Alloc {
                size, tag: Some(x), ..
            } if &**x == tag => Some(*size),
            _ => None,
        })
        .sum()
}

/// `⌈dim0/N⌉` rows × the other dimensions (`FSDPParam._init_sharded_param`'s padded shard).
fn padded_shard(shape: &[u64], n: u64) -> u64 {
    match shape.split_first() {
        Some((d0, rest)) => d0.div_ceil(n) * rest.iter().product::<u64>(),
        None => 1,
    }
}

/// DeepSpeed ZeRO-Offload (`offload_optimizer` device cpu), bf16 AdamW, Ψ parameters, N ranks.
/// `estimate_zero2_model_states_mem_needs(cpu_offload=True)` (`stage_1_and_2.py`) puts 2Ψ on the
/// GPU: the bf16 parameters, here the flat group padded to a multiple of 2N elements (Ψ'). Each
/// other term is read off `DeepSpeedZeroOptimizer` with `cpu_offload`:
///
/// * no fp32 master partition, no Adam state (DeepSpeedCPUAdam on host tensors), no
///   `grads_in_partition` (`copy_grads_in_partition` returns before making it): 0 B of gradients
///   and optimizer state once the backward is over (stage 2);
/// * `temp_grad_buffer_for_gpu_offload`: `torch.zeros(largest_param_numel)` in bf16, kept: 2 B × the
///   largest parameter, with the IPG buffer (5e8 bf16 elements) on top during a backward;
/// * `norm_for_param_grads`: one 0-d fp64 norm (8 B) per parameter in the rank's partition
///   (rank 0: the parameters starting in the first Ψ'/N elements), from the boundary to the step's
///   `reset_cpu_buffers`;
/// * per step and parameter in the partition, at the boundary: its owned slice in fp64 for the norm
///   and in fp32 for the host copy (8 and 4 B × Ψ'/N over the partition), and the overflow check
///   over its whole gradient (`isnan`: 1 B per element of each such parameter).
#[test]
fn zero_offload_keeps_only_the_bf16_parameters_of_the_model_states() {
    for shard in [Shard::Zero1, Shard::Zero2] {
        for (name, n) in ZERO_CASES {
            let mut r = recipe(1, 128, n as u32, shard);
            r.precision = Precision::Bf16;
            r.optimizer = OptimizerKind::AdamW;
            r.parallel.offload = Offload::Optimizer;
            let g = zoo::build(name, &r).unwrap();
            let psi = g.param_count();
            let padded = psi.div_ceil(2 * n) * 2 * n;
            let numels: Vec<u64> = g.params.iter().map(|p| p.shape.iter().product()).collect();
            let largest = *numels.iter().max().unwrap();
            let mut start = 0;
            let (mut in_partition, mut in_partition_numel) = (0, 0);
            for numel in &numels {
                if start < padded / n {
                    in_partition += 1;
                    in_partition_numel += numel;
                }
                start += numel;
            }
            let t = lower(&g, &r).unwrap();
            let (live, grads, ipg) = match shard {
                // Stage 1 reduces at the boundary: the full bf16 gradients and the IPG buffer
                // exist when `reduce_gradients` starts.
                Shard::Zero1 => (
                    live_at_phase(&t, "reduce_gradients", 1),
                    2 * psi,
                    1_000_000_000,
                ),
                _ => (live_at_phase(&t, "optimizer", 1), 0, 0),
            };
            let get = |c| live.get(&c).copied().unwrap_or(0);
            let at = format!("{name} {shard} N={n}");
            assert_eq!(get(Category::Parameter), 2 * padded, "{at}");
            assert!(
                2 * padded - 2 * psi < 4 * n,
                "{at}: DeepSpeed's estimate, 2Ψ"
            );
            assert_eq!(get(Category::Gradient), grads, "{at}");
            assert_eq!(get(Category::OptimizerState), 0, "{at}");
            assert_eq!(get(Category::Communication), ipg + 2 * largest, "{at}");
            if shard == Shard::Zero2 {
                assert_eq!(get(Category::Temporary), 8 * in_partition, "{at}: norms");
            }
            // One norm per parameter in the partition and step, none left after the step.
            let (_, norms) = tagged(&t, "norm_for_param_grads");
            assert_eq!(norms as u64, 2 * in_partition, "{at}");
            let live = live_at_phase(&t, "zero_grad", 1);
            assert_eq!(
                live.get(&Category::Temporary).copied().unwrap_or(0),
                0,
                "{at}"
            );
            // Two steps of boundary work.
            let double = tagged_bytes(&t, "set_norm_for_param_grad_in_gpu:double");
            assert_eq!(double, 2 * 8 * padded / n, "{at}");
            let fp32 = tagged_bytes(
                &t,
                "async_inplace_copy_grad_to_fp32_buffer_from_gpu:src_tensor",
            );
            assert_eq!(fp32, 2 * 4 * padded / n, "{at}");
            let nan = tagged_bytes(&t, "_has_inf_or_nan:nan");
            assert_eq!(nan, 2 * in_partition_numel, "{at}");
        }
    }
}

/// ZeRO-Offload under gradient accumulation (2 micro-batches, stage 2): `copy_grads_in_partition`
/// adds a non-boundary micro-batch's gradients into host buffers through the staging buffer, in
/// place, and only `is_gradient_accumulation_boundary()` runs the norm, the overflow check and the
/// fp32 copy on the GPU: once per step, as without accumulation.
#[test]
fn zero_offload_works_on_the_gpu_only_at_the_boundary() {
    let n = 8u64;
    let mut r = recipe(1, 128, n as u32, Shard::Zero2);
    r.precision = Precision::Bf16;
    r.optimizer = OptimizerKind::AdamW;
    r.parallel.offload = Offload::Optimizer;
    r.accum = 2;
    let g = zoo::build("gpt2", &r).unwrap();
    let padded = g.param_count().div_ceil(2 * n) * 2 * n;
    let t = lower(&g, &r).unwrap();
    assert_eq!(
        tagged_bytes(&t, "set_norm_for_param_grad_in_gpu:double"),
        2 * 8 * padded / n
    );
    assert_eq!(
        tagged_bytes(
            &t,
            "async_inplace_copy_grad_to_fp32_buffer_from_gpu:src_tensor"
        ),
        2 * 4 * padded / n
    );
    // Between the micro-batches (the second forward of each step) no gradient is left on the GPU.
    let live = live_at_phase(&t, "forward", 1);
    assert_eq!(live.get(&Category::Gradient).copied().unwrap_or(0), 0);
}

/// FSDP2 with `CPUOffloadPolicy` (fp32 LLaMA-2 7B, 8 ranks): the padded shards, the sharded
/// gradients and the optimizer live on the host, so between steps the GPU holds no parameter,
/// gradient, optimizer or collective bytes; during the step only what the unshard rules allow:
/// the root (embedding, final norm, head: never resharded after forward) and one block at a time
/// (a block is resharded before the next one's copy-out, in forward and in backward), so at most
/// the root plus one block; at most two flat all-gather outputs (the current or parked one and
/// the prefetched one). Every all-gather copies each parameter's shard to the GPU first: per
/// iteration the forward gathers every group and the backward every block again, so the copy-in
/// temporaries total 4 B × (all shards + the blocks' shards).
#[test]
fn fsdp2_cpu_offload_keeps_no_shards_on_the_gpu() {
    let n = 8u64;
    let mut r = recipe(1, 128, n as u32, Shard::Fsdp2);
    r.parallel.offload = Offload::Params;
    let g = zoo::build("llama2-7b", &r).unwrap();
    let unsharded = |p: &vramsim_models::graph::Param| padded_shard(&p.shape, n) * n;
    let root: u64 = g
        .params
        .iter()
        .filter(|p| !p.name.contains(".layers."))
        .map(unsharded)
        .sum();
    let block: u64 = g
        .params
        .iter()
        .filter(|p| p.name.contains(".layers.0."))
        .map(unsharded)
        .sum();
    assert_eq!(block, 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096);
    let shards: u64 = g.params.iter().map(|p| padded_shard(&p.shape, n)).sum();
    let block_shards: u64 = g
        .params
        .iter()
        .filter(|p| p.name.contains(".layers."))
        .map(|p| padded_shard(&p.shape, n))
        .sum();
    let t = lower(&g, &r).unwrap();
    for (phase, nth) in [("optimizer", 0), ("forward", 1), ("optimizer", 1)] {
        let live = live_at_phase(&t, phase, nth);
        for c in [
            Category::Parameter,
            Category::Gradient,
            Category::OptimizerState,
            Category::Communication,
        ] {
            assert_eq!(live.get(&c).copied().unwrap_or(0), 0, "{phase} {nth} {c:?}");
        }
    }
    let live = live_at_phase(&t, "backward", 1);
    assert_eq!(live.get(&Category::Parameter).copied(), Some(4 * root));
    assert_eq!(max_live(&t, Category::Parameter), 4 * (root + block));
    assert_eq!(tagged(&t, "fsdp_all_gather_output").0, 2);
    let copy_in: u64 = t
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Alloc {
                size,
                stream: 2,
                category: Category::Temporary,
                ..
            } => Some(*size),
            _ => None,
        })
        .sum();
    assert_eq!(copy_in, 2 * 4 * (shards + block_shards));
}

/// `fully_shard(block, reshard_after_forward=False)`: every block keeps its unsharded parameters
/// from its forward to its backward, so when the forward ends each rank holds its shards plus
/// every parameter unsharded at its padded size (`⌈dim0/N⌉·N` rows), and the backward all-gathers
/// nothing (one flat all-gather output per group and iteration: the forward's).
#[test]
fn fsdp2_without_reshard_after_forward_keeps_every_block_unsharded() {
    for (name, n) in [("llama2-7b", 8u64), ("gpt2", 8)] {
        let mut r = recipe(1, 128, n as u32, Shard::Fsdp2);
        r.parallel.reshard_after_forward = ReshardAfterForward::False;
        let g = zoo::build(name, &r).unwrap();
        let shards: u64 = g.params.iter().map(|p| padded_shard(&p.shape, n)).sum();
        let unsharded = shards * n;
        let t = lower(&g, &r).unwrap();
        for it in 0..2 {
            let live = live_at_phase(&t, "backward", it);
            assert_eq!(
                live.get(&Category::Parameter).copied(),
                Some(4 * (shards + unsharded)),
                "{name} iteration {it}"
            );
        }
        let groups = g
            .regions
            .iter()
            .filter(|r| r.kind == vramsim_models::graph::RegionKind::Block)
            .count()
            + 1;
        assert_eq!(tagged(&t, "fsdp_all_gather_output").1, 2 * groups, "{name}");
        // After the backward every group is resharded again.
        let live = live_at_phase(&t, "optimizer", 1);
        assert_eq!(live.get(&Category::Parameter).copied(), Some(4 * shards));
    }
}

/// `reshard_after_forward=2` on 8 ranks: after its forward each block keeps a clone of its rank's
/// half of every unsharded parameter (`to_sharded_post_forward`: padded numel / 2), so the end of
/// the forward holds the shards, the unsharded root and half of every block's padded parameters;
/// the backward frees each block's slices once it is unsharded again.
#[test]
fn fsdp2_reshard_after_forward_to_a_smaller_world_keeps_a_slice() {
    let n = 8u64;
    let mut r = recipe(1, 128, n as u32, Shard::Fsdp2);
    r.parallel.reshard_after_forward = ReshardAfterForward::To(2);
    let g = zoo::build("llama2-7b", &r).unwrap();
    let shards: u64 = g.params.iter().map(|p| padded_shard(&p.shape, n)).sum();
    let (blocks, root): (Vec<_>, Vec<_>) =
        g.params.iter().partition(|p| p.name.contains(".layers."));
    let root: u64 = root.iter().map(|p| padded_shard(&p.shape, n) * n).sum();
    let halves: u64 = blocks
        .iter()
        .map(|p| padded_shard(&p.shape, n) * n / 2)
        .sum();
    let t = lower(&g, &r).unwrap();
    let live = live_at_phase(&t, "backward", 1);
    assert_eq!(
        live.get(&Category::Parameter).copied(),
        Some(4 * (shards + root + halves))
    );
    let live = live_at_phase(&t, "optimizer", 1);
    assert_eq!(live.get(&Category::Parameter).copied(), Some(4 * shards));
}

/// ⌈numel/N⌉ elements of each parameter: its ZeRO-3 partition (`ds_tensor`), every parameter
/// padded to a multiple of N (`partition_parameters.py` `_aligned_size`, `_partition_param`).
fn zero3_recipe(batch: u64, seq: u64, n: u32) -> Recipe {
    let mut r = recipe(batch, seq, n, Shard::Zero3);
    r.precision = Precision::Bf16;
    r.optimizer = OptimizerKind::AdamW;
    r
}

/// ZeRO-3 model states per rank, bf16 with AdamW, after the second backward (before the step):
///
/// * the paper (Rajbhandari et al., SC'20, Figure 1): 16Ψ/N, i.e. 2Ψ/N bf16 parameters + 2Ψ/N bf16
///   gradients + 12Ψ/N optimizer states (4 fp32 master + 8 Adam moments);
/// * DeepSpeed's mechanism, by hand from its buffers: with Ψ' = Σ⌈numel/N⌉ (each parameter's
///   padded partition), `lp_param_buffer` 2Ψ' + `grad_partitions_flat_buffer` 2Ψ' (bf16, the
///   gradient-accumulation dtype defaults to the model's) + `fp32_partitioned_groups_flat` 4Ψ' +
///   `exp_avg`/`exp_avg_sq` 8Ψ' = 16Ψ'; plus what the paper does not count: the persistent
///   parameters (numel ≤ `stage3_param_persistence_threshold` = 1e5) held whole, 2 bytes × their
///   aligned numel, gathered again after every step (`_post_step`), and the IPG buffer of
///   `reduce_bucket_size` = 5e8 bf16 elements (1 GB), allocated at optimizer setup and kept. The
///   non-persistent parameters are all released by the end of the backward (the trace is
///   complete, and none is used again within `stage3_max_reuse_distance` of the trace's end).
///
/// 16Ψ' equals the paper's 16Ψ/N when N divides every parameter, and exceeds it by less than 16
/// bytes per parameter tensor otherwise (pitfall 15 of the fact sheet: ZeRO-3 pads per parameter);
/// the persistent parameters and the IPG buffer are why DeepSpeed's per-rank model states differ
/// from the paper's figure (pitfall 10: name the formula a test compares against).
#[test]
fn zero3_model_states_per_rank_match_the_paper() {
    for (precision, (name, n)) in [Precision::Bf16, Precision::Fp16]
        .into_iter()
        .flat_map(|p| ZERO_CASES.map(|c| (p, c)))
    {
        let mut r = zero3_recipe(1, 128, n as u32);
        r.precision = precision;
        let g = zoo::build(name, &r).unwrap();
        let psi = g.param_count();
        let part = zero3_partition(&g, n);
        let psi_p: u64 = part.iter().sum();
        let persistent = zero3_persistent(&g, &part, n);
        let t = lower(&g, &r).unwrap();
        let live = live_at_phase(&t, "optimizer", 1);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(
            get(Category::Parameter),
            2 * psi_p + 2 * persistent,
            "{name} N={n}"
        );
        assert_eq!(get(Category::Gradient), 2 * psi_p, "{name} N={n}");
        assert_eq!(get(Category::OptimizerState), 12 * psi_p, "{name} N={n}");
        assert_eq!(
            get(Category::Communication),
            1_000_000_000,
            "{name} N={n}: IPG buffer"
        );
        // The partitioned model states against the paper's 16Ψ/N.
        let partitioned = get(Category::Parameter) - 2 * persistent
            + get(Category::Gradient)
            + get(Category::OptimizerState);
        assert_eq!(partitioned, 16 * psi_p, "{name} N={n}");
        assert!(16 * psi_p >= 16 * psi / n, "{name} N={n}");
        assert!(
            16 * psi_p - 16 * psi / n < 16 * g.params.len() as u64,
            "{name} N={n}"
        );
        if g.params
            .iter()
            .all(|p| p.shape.iter().product::<u64>() % n == 0)
        {
            assert_eq!(partitioned, 16 * psi / n, "{name} N={n}");
        }
    }
}

/// Live bytes of each tagged allocation just before the `nth` marker of `phase`.
fn live_tags_at_phase(t: &Trace, phase: &str, nth: usize) -> HashMap<String, u64> {
    let mut live: HashMap<String, (String, u64)> = HashMap::new();
    let mut seen = 0;
    for e in &t.events {
        match e {
            Event::Alloc { id, size, tag, .. } => {
                live.insert(
                    id.to_string(),
                    (tag.as_deref().unwrap_or("").to_string(), *size),
                );
            }
            Event::Free { id } => {
                live.remove(&id.to_string());
            }
            Event::Phase { name } if &**name == phase => {
                if seen == nth {
                    return live.into_values().collect();
                }
                seen += 1;
            }
            _ => {}
        }
    }
    panic!("no phase {phase} #{nth}");
}

/// `stage3_param_persistence_threshold` (1e5 elements, `ds_numel <= threshold`): between two
/// steps exactly the parameters at or below it are whole on the rank (2 bytes × their numel
/// padded to a multiple of N), the others only as partitions.
#[test]
fn zero3_keeps_small_parameters_whole() {
    let n = 8u64;
    for name in ["gpt2", "bert-base"] {
        let r = zero3_recipe(1, 128, n as u32);
        let g = zoo::build(name, &r).unwrap();
        let t = lower(&g, &r).unwrap();
        // Before the second forward: after the first step's `_post_step`.
        let live = live_tags_at_phase(&t, "forward", 1);
        let whole: HashMap<String, u64> = live
            .into_iter()
            .filter_map(|(tag, size)| tag.strip_suffix(":gathered").map(|p| (p.to_string(), size)))
            .collect();
        let expected: HashMap<String, u64> = g
            .params
            .iter()
            .filter(|p| p.shape.iter().product::<u64>() <= 100_000)
            .map(|p| {
                (
                    p.name.clone(),
                    2 * p.shape.iter().product::<u64>().div_ceil(n) * n,
                )
            })
            .collect();
        assert!(!expected.is_empty(), "{name}");
        assert_eq!(whole, expected, "{name}");
    }
}

/// The peak of gathered (whole) parameters during a forward, against the coordinator's rules, for
/// Llama-2-7B over 8 ranks (every submodule holds one parameter: its Linear's or RMSNorm's weight,
/// the embedding, the head):
///
/// * forward 1 (no trace yet: no prefetch, every parameter released after its submodule): one
///   submodule at a time, each a single all-gathered buffer (`_all_gather_sequential`: ⌈numel/N⌉·N
///   elements, the parameter a view of it): the peak is the largest, the 32000 × 4096 embedding or
///   head, 2 × 131,072,000 bytes; no coalesced flat buffer exists;
/// * forward 2 (trace complete): after each fetch the coordinator prefetches the next parameters
///   of the trace while fewer than `stage3_max_live_parameters` = 1e9 elements are gathered or in
///   flight, at most min(`stage3_prefetch_bucket_size` = 5e7, 1e9 − available) elements plus the
///   parameter that crosses the limit; a submodule's own fetch is not limited (one parameter
///   here), and parameters used again within `stage3_max_reuse_distance` count as available until
///   released. So at most 1e9 + 2 × the largest parameter elements are available or in flight,
///   each held by a whole copy (2 bytes) and, until its bucket's last parameter is consumed, a
///   slot of its coalesced flat buffer (2 bytes): both peaks are at most 2 × (1e9 + 2 × 131,072,000)
///   bytes, and the parameters' peak is above forward 1's (prefetching and reuse keep more).
#[test]
fn zero3_forward_parameters_follow_the_prefetch_rules() {
    let n = 8u64;
    let r = zero3_recipe(1, 128, n as u32);
    let g = zoo::build("llama2-7b", &r).unwrap();
    let largest = g
        .params
        .iter()
        .map(|p| p.shape.iter().product::<u64>().div_ceil(n) * n)
        .max()
        .unwrap();
    assert_eq!(largest, 32000 * 4096);
    let t = lower(&g, &r).unwrap();
    let gathered = |tag: &Option<String>| tag.as_deref().is_some_and(|t| t.ends_with(":gathered"));
    let flat_tag = |tag: &Option<String>| tag.as_deref() == Some("allgather_coalesced_flat");
    // (peak gathered, peak coalesced flat) per forward.
    let mut peaks = [(0u64, 0u64); 2];
    let mut live: HashMap<String, (u64, bool, bool)> = HashMap::new();
    let (mut cur_g, mut cur_f) = (0u64, 0u64);
    let mut fwd: Option<usize> = None;
    let mut forwards = 0;
    for e in &t.events {
        match e {
            Event::Alloc { id, size, tag, .. } => {
                let tag = tag.as_ref().map(|t| t.to_string());
                let (is_g, is_f) = (gathered(&tag), flat_tag(&tag));
                live.insert(id.to_string(), (*size, is_g, is_f));
                cur_g += if is_g { size } else { &0 };
                cur_f += if is_f { size } else { &0 };
            }
            Event::Free { id } => {
                if let Some((s, is_g, is_f)) = live.remove(&id.to_string()) {
                    cur_g -= if is_g { s } else { 0 };
                    cur_f -= if is_f { s } else { 0 };
                }
            }
            Event::Phase { name } => {
                fwd = (&**name == "forward").then(|| {
                    forwards += 1;
                    forwards - 1
                });
            }
            _ => {}
        }
        if let Some(i) = fwd.filter(|&i| i < 2) {
            peaks[i].0 = peaks[i].0.max(cur_g);
            peaks[i].1 = peaks[i].1.max(cur_f);
        }
    }
    assert_eq!(peaks[0], (2 * largest, 0), "forward 1");
    let bound = 2 * (1_000_000_000 + 2 * largest);
    assert!(peaks[1].0 <= bound, "forward 2: {:?} > {bound}", peaks[1]);
    assert!(peaks[1].1 <= bound, "forward 2: {:?} > {bound}", peaks[1]);
    assert!(peaks[1].0 > peaks[0].0, "forward 2: {:?}", peaks[1]);
}

/// `ZeroRedundancyOptimizer` (`zero1-torch`) over DDP, fp32 AdamW: DDP's buckets and gradients
/// stay whole (4Ψ each), and the lowered rank (the one owning the most elements) keeps Adam's two
/// moments (8 bytes per element) of its parameters only. GPT-2 over 4 ranks by hand: the greedy
/// partition (largest first, to the least-loaded rank) gives rank 0 the 50257 × 768 token
/// embedding first; the other 85,842,432 elements fill ranks 1-3 to about 28.6M each, never above
/// rank 0's 38,597,376, so rank 0 owns the embedding alone: 8 × 38,597,376 bytes of state.
#[test]
fn zero_redundancy_state_is_the_greedy_partition() {
    let r = {
        let mut r = recipe(2, 128, 4, Shard::ZeroRedundancy);
        r.optimizer = OptimizerKind::AdamW;
        r
    };
    let g = zoo::build("gpt2", &r).unwrap();
    let psi = g.param_count();
    let t = lower(&g, &r).unwrap();
    let live = live_at_phase(&t, "optimizer", 1);
    assert_eq!(
        live.get(&Category::OptimizerState).copied(),
        Some(8 * 38_597_376)
    );
    assert_eq!(live.get(&Category::Communication).copied(), Some(4 * psi));
    assert_eq!(live.get(&Category::Gradient).copied(), Some(4 * psi));
    // BERT-base over 3 and 8 ranks and ResNet-50 over 8: the same greedy rule written out here
    // (Python's stable sort, `_get_min_index`: the first least-loaded rank), the lowered rank the
    // fullest.
    for (name, n) in [("bert-base", 3usize), ("bert-base", 8), ("resnet50", 8)] {
        let seq = if name == "resnet50" { 0 } else { 128 };
        let mut r = recipe(2, seq, n as u32, Shard::ZeroRedundancy);
        r.optimizer = OptimizerKind::AdamW;
        let g = zoo::build(name, &r).unwrap();
        let numels: Vec<u64> = g.params.iter().map(|p| p.shape.iter().product()).collect();
        let mut idx: Vec<usize> = (0..numels.len()).collect();
        idx.sort_by(|a, b| numels[*b].cmp(&numels[*a]));
        let mut sizes = vec![0u64; n];
        for i in idx {
            let mut best = 0;
            for k in 1..n {
                if sizes[k] < sizes[best] {
                    best = k;
                }
            }
            sizes[best] += numels[i];
        }
        let worst = *sizes.iter().max().unwrap();
        // PyTorch 2.15's own `ZeroRedundancyOptimizer._partition_parameters`, run on
        // `BertForMaskedLM(BertConfig())` built on the meta device (transformers 5.23): the fullest
        // rank holds 36,569,088 elements over 3 ranks (rank 1), 23,440,896 over 8 (rank 0).
        match (name, n) {
            ("bert-base", 3) => assert_eq!(worst, 36_569_088),
            ("bert-base", 8) => assert_eq!(worst, 23_440_896),
            _ => {}
        }
        let t = lower(&g, &r).unwrap();
        let live = live_at_phase(&t, "optimizer", 1);
        assert_eq!(
            live.get(&Category::OptimizerState).copied(),
            Some(8 * worst),
            "{name} N={n}: {sizes:?}"
        );
    }
}

/// ZeRO-3 with CPU offload (`offload_optimizer`, and `offload_param` with it), after the second
/// backward: DeepSpeed's estimator (`estimate_zero3_model_states_mem_needs`) keeps 2Ψ/N on the GPU
/// with the optimizer offloaded and no model states with the parameters offloaded too; by the
/// mechanism the GPU holds the bf16 partitions 2Ψ' (none with `offload_param`: they move into the
/// host flat buffer), the persistent parameters whole, the IPG buffer (always on the GPU), and no
/// fp32 master, optimizer state or `grad_partitions_flat_buffer` (on `self.device`, the host).
#[test]
fn zero3_offload_keeps_only_partitions_or_nothing_on_the_gpu() {
    let n = 8u64;
    for offload in [
        vramsim_models::Offload::Optimizer,
        vramsim_models::Offload::Params,
    ] {
        for name in ["gpt2", "tinyllama-1.1b"] {
            let mut r = zero3_recipe(1, 128, n as u32);
            r.parallel.offload = offload;
            let g = zoo::build(name, &r).unwrap();
            let part = zero3_partition(&g, n);
            let psi_p: u64 = part.iter().sum();
            let persistent = zero3_persistent(&g, &part, n);
            let t = lower(&g, &r).unwrap();
            let live = live_at_phase(&t, "optimizer", 1);
            let get = |c| live.get(&c).copied().unwrap_or(0);
            let partitions = match offload {
                vramsim_models::Offload::Params => 0,
                _ => 2 * psi_p,
            };
            assert_eq!(
                get(Category::Parameter),
                partitions + 2 * persistent,
                "{name} {offload}"
            );
            assert_eq!(get(Category::Gradient), 0, "{name} {offload}");
            assert_eq!(get(Category::OptimizerState), 0, "{name} {offload}");
            assert_eq!(get(Category::Communication), 1_000_000_000, "{name}");
        }
    }
}

/// Accumulation over many micro-batches is lowered compactly (`compact.rs`: three micro-batches,
/// the third standing for the rest when it repeats the second). ZeRO-3's first micro-batch records
/// the trace and the later ones prefetch from it, so the second and third are alike: the compact
/// form expands to the full lowering, byte for byte, with and without offload, and for
/// `zero1-torch`.
#[test]
fn zero3_and_zero_redundancy_lower_compactly() {
    use vramsim_models::Offload;
    for (shard, offload) in [
        (Shard::Zero3, Offload::None),
        (Shard::Zero3, Offload::Params),
        (Shard::ZeroRedundancy, Offload::None),
    ] {
        let mut r = zero3_recipe(2, 64, 4);
        r.parallel.shard = shard;
        r.parallel.offload = offload;
        r.accum = 6;
        let g = zoo::build("gpt2", &r).unwrap();
        let full = lower(&g, &r).unwrap();
        let compact = vramsim_models::compact::lower_compact(&g, &r).unwrap();
        assert!(compact.expand() == full, "{shard} {offload}");
    }
}

/// ZeRO-3's coalesced all-gather holds a fetched submodule twice for a moment: the flat buffer of
/// Σ⌈numel/N⌉·N elements (`_all_gather_dtype`) and, from the handle's `wait()`, one `torch.cat`
/// copy per parameter, the flat buffer dying with the handle's last registry entry. ResNet-50 over
/// 8 ranks, first forward (no prefetch, one submodule at a time): the largest submodule is `fc`
/// (2048 × 1000 weight + 1000 bias, both divisible by 8), coalesced, so the peak of gathered
/// parameters and flat buffers together is 2 bytes × 2,049,000 × 2 = 8,196,000 bytes, above the
/// largest single-parameter fetch (`layer4.0.conv2`, 512 × 512 × 3 × 3: one aligned buffer of
/// 2 × 2,359,296 bytes, no copy).
#[test]
fn zero3_coalesced_fetch_holds_the_submodule_twice() {
    let r = zero3_recipe(2, 0, 8);
    let g = zoo::build("resnet50", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    let mut live: HashMap<String, u64> = HashMap::new();
    let (mut cur, mut peak) = (0u64, 0u64);
    let mut forwards = 0;
    for e in &t.events {
        match e {
            Event::Alloc { id, size, tag, .. }
                if tag.as_deref().is_some_and(|t| {
                    t.ends_with(":gathered") || t == "allgather_coalesced_flat"
                }) =>
            {
                live.insert(id.to_string(), *size);
                cur += size;
            }
            Event::Free { id } => cur -= live.remove(&id.to_string()).unwrap_or(0),
            Event::Phase { name } if &**name == "forward" => forwards += 1,
            Event::Phase { name } if &**name == "backward" && forwards == 1 => break,
            _ => {}
        }
        if forwards == 1 {
            peak = peak.max(cur);
        }
    }
    assert_eq!(peak, 2 * 2 * 2_049_000);
    assert!(peak > 2 * 2_359_296);
}

/// `MixedPrecisionPolicy(param_dtype=bf16)` alone on an fp32 model: PyTorch 2.15's
/// `FSDPParamGroup._get_reduce_dtype` reduces in the promotion of the parameters'
/// `unsharded_grad_dtype`s (the model's dtype without a `reduce_dtype`: `_fsdp_param.py`), so every
/// reduce-scatter input is fp32 (4 bytes × the group's padded numel: Σ over a step = 4 × N × the
/// padded shards' numel; `chunk_cat` upcasts the bf16 gradients) and its output is the sharded
/// gradient itself (no cast: 4 bytes × the shards' numel a step). GPT-2 at N = 4, 2 steps.
#[test]
fn fsdp2_param_dtype_alone_reduces_in_the_models_dtype() {
    let n = 4u64;
    let mut r = recipe(2, 128, n as u32, Shard::Fsdp2);
    r.parallel.fsdp_param_dtype = Some(DType::BF16);
    let g = zoo::build("gpt2", &r).unwrap();
    let padded = |shape: &[u64]| match shape.split_first() {
        Some((d0, rest)) => d0.div_ceil(n) * rest.iter().product::<u64>(),
        None => 1,
    };
    let shards: u64 = g.params.iter().map(|p| padded(&p.shape)).sum();
    let t = lower(&g, &r).unwrap();
    let sizes = |prefix: &str| -> u64 {
        t.events
            .iter()
            .filter_map(|e| match e {
                Event::Alloc { size, tag, .. }
                    if tag.as_deref().is_some_and(|x| x.starts_with(prefix)) =>
                {
                    Some(*size)
                }
                _ => None,
            })
            .sum()
    };
    assert_eq!(sizes("fsdp_reduce_scatter_input"), 2 * 4 * n * shards);
    assert_eq!(sizes("fsdp_sharded_grads"), 2 * 4 * shards);
}

/// Fine-tuning with data parallelism, no tensor parallelism: GPT-2 with the embeddings and
/// blocks 0–5 frozen trains blocks 6–11 and `ln_f`, by hand 6 × (12h² + 13h) + 2h = 42,528,768
/// of its 124,439,808 elements (h = 768). By the frameworks' rules over 4 ranks:
///
/// * DDP (`reducer.cpp` buckets only parameters that require grad): buckets and gradients of the
///   trainable elements only (4 B each in fp32), AdamW's two moments of them, every parameter whole;
/// * DeepSpeed ZeRO-1/2 (`stage_1_and_2.py` flattens `trainable_parameters` only): the frozen
///   parameters stay as they are next to the flat bf16 group of the trainable ones padded to a
///   multiple of 2·n, fp32 master and moments of 1/n of it, the gradients whole (ZeRO-1, until
///   `reduce_gradients`) or their partition (ZeRO-2);
/// * `zero1-torch` (`ZeroRedundancyOptimizer._partition_parameters` over the parameters it is
///   given, the trainable ones): DDP's buckets, the moments of the rank's partition;
/// * FSDP2 (`fully_shard` shards every parameter; `foreach_reduce` reduces those with a
///   gradient): the padded shards of every parameter, sharded gradients and AdamW state of the
///   trainable ones' shards only.
#[test]
fn frozen_parameters_under_data_parallelism_hold_no_gradients_or_state() {
    let (h, n) = (768u64, 4u64);
    let trainable = 6 * (12 * h * h + 13 * h) + 2 * h;
    assert_eq!(trainable, 42_528_768);
    let total = 124_439_808u64;
    let frozen = ["transformer.wte", "transformer.wpe", "transformer.h.0-5"].map(String::from);
    let recipe_for = |shard: Shard| {
        let mut r = recipe(2, 128, n as u32, shard);
        r.freeze = frozen.to_vec();
        if matches!(shard, Shard::Zero1 | Shard::Zero2) {
            r.precision = Precision::Bf16;
        }
        r
    };
    // DDP, fp32.
    let r = recipe_for(Shard::Ddp);
    let g = zoo::build("gpt2", &r).unwrap();
    assert_eq!(g.param_count(), trainable);
    let t = lower(&g, &r).unwrap();
    for it in 0..2 {
        let live = live_at_phase(&t, "optimizer", it);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(get(Category::Communication), 4 * trainable, "ddp it {it}");
        assert_eq!(get(Category::Gradient), 4 * trainable, "ddp it {it}");
        assert_eq!(get(Category::Parameter), 4 * total, "ddp it {it}");
    }
    let live = live_at_phase(&t, "forward", 1);
    assert_eq!(live[&Category::OptimizerState], 8 * trainable, "ddp");
    // ZeRO-1 and ZeRO-2, bf16.
    let padded = trainable.div_ceil(2 * n) * 2 * n;
    for shard in [Shard::Zero1, Shard::Zero2] {
        let r = recipe_for(shard);
        let g = zoo::build("gpt2", &r).unwrap();
        let t = lower(&g, &r).unwrap();
        let (live, grads) = match shard {
            Shard::Zero1 => (live_at_phase(&t, "reduce_gradients", 1), 2 * trainable),
            _ => (live_at_phase(&t, "optimizer", 1), 2 * padded / n),
        };
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(
            get(Category::Parameter),
            2 * (total - trainable + padded),
            "{shard}"
        );
        assert_eq!(get(Category::Gradient), grads, "{shard}");
        assert_eq!(get(Category::OptimizerState), 12 * padded / n, "{shard}");
    }
    // `zero1-torch`, fp32 AdamW: the optimizer is given the trainable parameters, which the
    // greedy partition (largest first, to the first least-loaded rank) spreads evenly by hand:
    // the twelve 2,359,296-element MLP weights 3 per rank; the six 1,769,472 `c_attn` weights to
    // ranks 0, 1, 2, 3, 0, 1; the six 589,824 `attn.c_proj` weights to ranks 2, 3, 2, 3, 2, 3 (all
    // at 10,616,832); the six 3,072 `c_fc` biases to 0, 1, 2, 3, 0, 1; the six 2,304 `c_attn` biases
    // to 2, 3, 2, 3, 0, 1 (ranks 0-1 at 10,625,280, 2-3 at 10,624,512); of the 38 768-element
    // tensors two to ranks 2 and 3, then 9 each: every rank 10,632,192 = 42,528,768 / 4. Rank 0
    // holds Adam's two fp32 moments of those; DDP's buckets and gradients stay the trainable 4Ψ.
    let r = recipe_for(Shard::ZeroRedundancy);
    let g = zoo::build("gpt2", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    let live = live_at_phase(&t, "optimizer", 1);
    let get = |c| live.get(&c).copied().unwrap_or(0);
    assert_eq!(get(Category::OptimizerState), 8 * 10_632_192, "zero1-torch");
    assert_eq!(4 * 10_632_192, trainable);
    assert_eq!(get(Category::Communication), 4 * trainable, "zero1-torch");
    assert_eq!(get(Category::Gradient), 4 * trainable, "zero1-torch");
    // FSDP2, fp32.
    let r = recipe_for(Shard::Fsdp2);
    let g = zoo::build("gpt2", &r).unwrap();
    let shard_of = |shape: &[u64]| match shape.split_first() {
        Some((d0, rest)) => d0.div_ceil(n) * rest.iter().product::<u64>(),
        None => 1,
    };
    let all: u64 = g.params.iter().map(|p| shard_of(&p.shape)).sum();
    let tr: u64 = g
        .params
        .iter()
        .filter(|p| p.trainable)
        .map(|p| shard_of(&p.shape))
        .sum();
    let t = lower(&g, &r).unwrap();
    // The backward all-gathers blocks 11..6 and prefetches block 5, which autograd never
    // reaches: 7 all-gather outputs, the last dropped by `finalize_backward` (PyTorch 2.15 on
    // two gloo ranks, `models/tools/check_fsdp_frozen_prefetch.py`: the last frozen block is
    // unsharded in PRE_BACKWARD state and reaches `finalize_backward` with its
    // `_all_gather_result` set, no other group does).
    let (b0, o0) = (
        common::phase_index(&t, "backward", 0),
        common::phase_index(&t, "optimizer", 0),
    );
    let gathers = t.events[b0..o0]
        .iter()
        .filter(|e| {
            matches!(e, Event::Alloc { tag, .. }
                if tag.as_deref().is_some_and(|t| t.starts_with("fsdp_all_gather_output")))
        })
        .count();
    assert_eq!(gathers, 7, "fsdp2: backward all-gathers");
    let live = live_at_phase(&t, "optimizer", 1);
    let get = |c| live.get(&c).copied().unwrap_or(0);
    assert_eq!(get(Category::Parameter), 4 * all, "fsdp2");
    assert_eq!(get(Category::Gradient), 4 * tr, "fsdp2");
    assert_eq!(get(Category::OptimizerState), 8 * tr, "fsdp2");
    assert_eq!(get(Category::Communication), 0, "fsdp2");
}

/// QLoRA under DDP (`--quant nf4 --lora r=8 --dp 2 --shard ddp`), TinyLlama 1.1B in bf16, by hand:
/// `DistributedDataParallel._build_params_for_reducer` keeps the parameters with `requires_grad`,
/// PEFT's adapters (float32, `autocast_adapter_dtype=True`) on `q_proj` (2048 → 2048) and `v_proj`
/// (2048 → 256, four KV heads of 64) of 22 layers: Ψa = 22 × 8 × (2048 + 2048 + 2048 + 256) =
/// 1,126,400, so the Reducer's buckets and the gradients are 4Ψa bytes each, and the frozen
/// Params4bit weights get neither. Every rank holds the whole quantized model, as one GPU does:
/// the packed codes `ceil(n/2)` uint8 per linear weight (q, k, v, o, gate, up, down), embedding,
/// lm_head and norms in bf16, the adapters in float32 (bitsandbytes `quantize_4bit`).
#[test]
fn qlora_under_ddp_buckets_only_the_adapters() {
    let (h, kv, ff, layers, vocab) = (2048u64, 256u64, 5632u64, 22u64, 32000u64);
    let adapters = layers * 8 * (h + h + h + kv);
    assert_eq!(adapters, 1_126_400);
    let linears = [h * h, h * kv, h * kv, h * h, h * ff, h * ff, ff * h];
    let codes: u64 = layers * linears.iter().map(|n| n.div_ceil(2)).sum::<u64>();
    let bf16 = 2 * (2 * vocab * h + (2 * layers + 1) * h);
    let recipe_for = |dp: u32, shard: Shard| {
        let mut r = recipe(4, 512, dp, shard);
        r.precision = Precision::Bf16;
        r.quant = Some("nf4".parse().unwrap());
        r.lora = Some("r=8".parse().unwrap());
        r
    };
    let r = recipe_for(2, Shard::Ddp);
    let g = zoo::build("tinyllama-1.1b", &r).unwrap();
    assert_eq!(g.param_count(), adapters);
    let t = lower(&g, &r).unwrap();
    let single = {
        let r = recipe_for(1, Shard::None);
        lower(&zoo::build("tinyllama-1.1b", &r).unwrap(), &r).unwrap()
    };
    for it in 0..2 {
        let live = live_at_phase(&t, "optimizer", it);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(get(Category::Communication), 4 * adapters, "it {it}");
        assert_eq!(get(Category::Gradient), 4 * adapters, "it {it}");
        assert_eq!(
            get(Category::Parameter),
            codes + bf16 + 4 * adapters,
            "it {it}"
        );
        // The quant states, a float32 absmax per 64-block and the 16-entry float32 NF4 code per
        // weight, and the rotary `inv_freq` buffer (float32 [head_dim / 2 = 32]) are the single
        // GPU's too.
        let states: u64 =
            layers * linears.iter().map(|n| 4 * n.div_ceil(64) + 64).sum::<u64>() + 32 * 4;
        assert_eq!(get(Category::Other), states, "it {it}");
        let one = live_at_phase(&single, "optimizer", it);
        assert_eq!(one.get(&Category::Other).copied(), Some(states), "it {it}");
        assert_eq!(
            one.get(&Category::Parameter).copied(),
            Some(codes + bf16 + 4 * adapters)
        );
    }
    // The constructor's one bucket (`_ddp_init_helper`: one dtype, limits `[sys.maxsize]`).
    let first = t.events.iter().find_map(|e| match e {
        Event::Alloc {
            size, tag: Some(x), ..
        } if x.starts_with("ddp_bucket") => Some(*size),
        _ => None,
    });
    assert_eq!(first, Some(4 * adapters));
}

/// Requested sizes of every allocation of a trace, counted.
fn alloc_sizes(t: &Trace) -> HashMap<u64, i64> {
    let mut m = HashMap::new();
    for e in &t.events {
        if let Event::Alloc { size, .. } = e {
            *m.entry(*size).or_insert(0) += 1;
        }
    }
    m
}

/// The allocations an fp16 trace has beyond the bf16 one (sizes counted), negative for fewer.
fn fp16_extra(r: &Recipe) -> HashMap<u64, i64> {
    let mut r = r.clone();
    r.precision = Precision::Bf16;
    let g = zoo::build("gpt2", &r).unwrap();
    let bf16 = alloc_sizes(&lower(&g, &r).unwrap());
    r.precision = Precision::Fp16;
    let g = zoo::build("gpt2", &r).unwrap();
    let mut extra = alloc_sizes(&lower(&g, &r).unwrap());
    for (k, v) in bf16 {
        *extra.entry(k).or_insert(0) -= v;
    }
    extra.retain(|_, v| *v != 0);
    extra
}

/// Whether an allocation's tag names DeepSpeed's overflow check (`has_overflow*`,
/// `_has_inf_or_nan:*`).
fn is_check_tag(tag: &str) -> bool {
    tag.starts_with("has_overflow") || tag.starts_with("_has_inf_or_nan:")
}

/// The sizes of every allocation of DeepSpeed's overflow check ([`is_check_tag`]), counted.
fn overflow_check_sizes(t: &Trace) -> HashMap<u64, i64> {
    let mut m = HashMap::new();
    for e in &t.events {
        if let Event::Alloc {
            size, tag: Some(x), ..
        } = e
        {
            if is_check_tag(x) {
                *m.entry(*size).or_insert(0) += 1;
            }
        }
    }
    m
}

/// The allocations of one overflow check of `DeepSpeedZeroOptimizer.step` (stages 1/2), by hand
/// from `stage_1_and_2.py` `has_overflow_partitioned_grads_serial` / `_has_inf_or_nan`: a 4-byte
/// counter, then per gradient piece of rank 0's partition (each parameter's overlap with the
/// first Ψ'/N elements, in parameter order) `x.float()` (4n: the pieces are 16-bit in bf16 and
/// fp16 alike), `isnan`, `isinf`, `logical_or` (n each), `.float()` (4n) and the 4-byte `max`;
/// then the 1-byte `.bool()` and `.byte()`. Each size is counted `times` times.
fn zero12_overflow_check(g: &vramsim_models::Graph, n: u64, times: i64) -> HashMap<u64, i64> {
    let mut want: HashMap<u64, i64> = HashMap::new();
    let mut add = |size: u64, k: i64| *want.entry(size).or_insert(0) += k * times;
    let sizes: Vec<u64> = g
        .params
        .iter()
        .map(|p| p.shape.iter().product::<u64>())
        .collect();
    let psi: u64 = sizes.iter().sum();
    let part = psi.div_ceil(2 * n) * 2 * n / n;
    add(4, 1);
    let mut start = 0;
    for s in sizes {
        let piece = (start + s).min(part).saturating_sub(start.min(part));
        if piece > 0 {
            add(4 * piece, 2);
            add(piece, 3);
            add(4, 1);
        }
        start += s;
    }
    add(1, 2);
    want
}

/// DeepSpeed's bf16 mode runs the stage-1/2 overflow check as its fp16 mode does:
/// `engine.py` `_configure_zero_optimizer` passes the bf16 section's `check_grad_overflow`,
/// True by default since DeepSpeed 0.19.3 (`precision_config.py` `DeepSpeedBF16Config`), and
/// `stage_1_and_2.py` `step` checks `if self.check_grad_overflow`. Once per iteration, the
/// allocations of [`zero12_overflow_check`]; the temporaries die within the step, so the ZeRO
/// paper's model states (`zero_model_states_per_rank_match_the_paper`, bf16 and fp16) hold.
#[test]
fn deepspeed_bf16_and_fp16_run_the_stage12_overflow_check() {
    let (n, iters) = (4u64, 2u32);
    for shard in [Shard::Zero1, Shard::Zero2] {
        for precision in [Precision::Bf16, Precision::Fp16] {
            let mut r = recipe(1, 128, n as u32, shard);
            r.optimizer = OptimizerKind::AdamW;
            r.precision = precision;
            r.iterations = iters;
            let g = zoo::build("gpt2", &r).unwrap();
            let t = lower(&g, &r).unwrap();
            let want = zero12_overflow_check(&g, n, i64::from(iters));
            assert_eq!(overflow_check_sizes(&t), want, "{shard} {precision:?}");
            // Transient: none of the check's allocations outlives its step.
            for at in [phase_index(&t, "optimizer", 1), t.events.len()] {
                assert!(
                    live_at(&t, at).iter().all(|(_, _, tag)| !is_check_tag(tag)),
                    "{shard} {precision:?}: live at event {at}"
                );
            }
        }
        // Both modes check with the same sizes: fp16 adds nothing to bf16's trace.
        let mut r = recipe(1, 128, n as u32, shard);
        r.optimizer = OptimizerKind::AdamW;
        r.iterations = iters;
        assert_eq!(fp16_extra(&r), HashMap::new(), "{shard}");
    }
}

/// ZeRO-3 checks for overflow in fp16 mode only (`stage3.py`
/// `_overflow_check_and_loss_scale_update`: `if self.dtype == torch.float16`; `engine.py` gives
/// `check_grad_overflow` to stages 1/2 only), so fp16 adds the check to the bf16 mode's step,
/// once per iteration (`stage3.py` `has_overflow`): `isinf`/`isnan` of
/// `grad_partitions_flat_buffer` (Σ partitions bytes each) with a 1-byte `any`, then a 1-byte
/// clone and its uint8 copy; bf16 makes none of these.
#[test]
fn deepspeed_zero3_checks_overflow_in_fp16_only() {
    let (n, iters) = (4u64, 2u32);
    let mut r = recipe(1, 128, n as u32, Shard::Zero3);
    r.optimizer = OptimizerKind::AdamW;
    r.iterations = iters;
    let g = zoo::build("gpt2", &r).unwrap();
    let total: u64 = zero3_partition(&g, n).iter().sum();
    let want = HashMap::from([(total, 2 * i64::from(iters)), (1, 4 * i64::from(iters))]);
    assert_eq!(fp16_extra(&r), want);
    let bf16 = lower(&g, &r).unwrap();
    assert_eq!(overflow_check_sizes(&bf16), HashMap::new());
    r.precision = Precision::Fp16;
    let g = zoo::build("gpt2", &r).unwrap();
    assert_eq!(overflow_check_sizes(&lower(&g, &r).unwrap()), want);
}

/// The stage-3 optimizer keeps a one-element bool `inf_or_nan_tracker` on its device from its
/// `__init__` on (`stage3.py`: `torch.zeros(1, dtype=torch.bool, device=self.device)`, the host with
/// `offload_optimizer`): one allocation of 1 byte, never freed, in every precision.
#[test]
fn deepspeed_zero3_keeps_its_inf_or_nan_tracker() {
    let trackers = |r: &vramsim_models::Recipe| -> Vec<(u64, bool)> {
        let g = zoo::build("gpt2", r).unwrap();
        let t = lower(&g, r).unwrap();
        t.events
            .iter()
            .filter_map(|e| match e {
                Event::Alloc { id, size, tag, .. }
                    if tag.as_deref() == Some("inf_or_nan_tracker") =>
                {
                    let freed = t
                        .events
                        .iter()
                        .any(|f| matches!(f, Event::Free { id: i } if i == id));
                    Some((*size, freed))
                }
                _ => None,
            })
            .collect()
    };
    for precision in [Precision::Bf16, Precision::Fp16, Precision::Fp32] {
        let mut r = recipe(1, 128, 4, Shard::Zero3);
        r.optimizer = OptimizerKind::AdamW;
        r.precision = precision;
        assert_eq!(trackers(&r), [(1, false)], "{precision}");
    }
    let mut r = recipe(1, 128, 4, Shard::Zero3);
    r.optimizer = OptimizerKind::AdamW;
    r.parallel.offload = Offload::Optimizer;
    assert_eq!(trackers(&r), []);
}

/// `--precision fp16` is DeepSpeed's mode only: without ZeRO, and autocast under ZeRO, are
/// refused with the reason; with ZeRO and an offload it is modelled.
#[test]
fn fp16_outside_deepspeed_and_autocast_under_zero_are_refused() {
    let mut r = recipe(1, 128, 2, Shard::Ddp);
    r.precision = Precision::Fp16;
    let e = r.validate().unwrap_err().to_string();
    assert!(
        e.contains("DeepSpeed's fp16 mode") && e.contains("zero1"),
        "{e}"
    );
    for p in [Precision::AmpFp16, Precision::AmpBf16] {
        let mut r = recipe(1, 128, 2, Shard::Zero2);
        r.precision = p;
        let e = r.validate().unwrap_err().to_string();
        assert!(e.contains("torch_autocast"), "{e}");
    }
    let mut r = recipe(1, 128, 2, Shard::Zero2);
    r.precision = Precision::Fp16;
    r.parallel.offload = Offload::Optimizer;
    r.validate().unwrap();
}

/// FSDP-QLoRA (`--quant nf4 --quant-storage bf16 --lora r=8 --dp 3 --shard fsdp2`), TinyLlama 1.1B
/// in bf16, by hand from the rules: bitsandbytes `quantize_4bit` packs a weight of n elements into
/// `(n + 1) // (2 · itemsize)` rows of one `quant_storage` element (bf16: four codes per element);
/// `FSDPParam._init_sharded_param` chunks every parameter on dim 0 and pads each shard to ⌈rows/N⌉
/// rows, in the parameter's own dtype (the codes bf16, the base weights bf16, PEFT's adapters
/// float32); the optimizer (AdamW) and the reduce-scatter see only the adapters (Ψa = 22 × 8 ×
/// (2048 + 2048 + 2048 + 256)); the quant state (float32 absmax per 64-block, the 16-entry
/// float32 code) is no parameter and stays whole on every rank, as on one GPU. A block's
/// all-gather mixes bf16 codes and norms with float32 adapters, so it runs on bytes
/// (`_get_all_gather_input_metadatas`: `torch.uint8`), Σ padded numel × itemsize.
#[test]
fn fsdp_qlora_shards_the_packed_codes_and_keeps_the_quant_state_whole() {
    let (h, kv, ff, layers, vocab, r) = (2048u64, 256u64, 5632u64, 22u64, 32000u64, 8u64);
    let n = 3u64;
    let linears = [h * h, h * kv, h * kv, h * h, h * ff, h * ff, ff * h];
    let rows = |numel: u64| (numel + 1) / 4;
    let code_shard = |numel: u64| 2 * rows(numel).div_ceil(n);
    let codes: u64 = layers * linears.iter().map(|&x| code_shard(x)).sum::<u64>();
    // embed_tokens and lm_head [32000, 2048], two RMSNorms per layer and the final one [2048].
    let bf16 = 2 * (2 * vocab.div_ceil(n) * h + (2 * layers + 1) * h.div_ceil(n));
    // lora_A [8, 2048] and lora_B [out, 8] on q_proj (out 2048) and v_proj (out 256).
    let a_shard = r.div_ceil(n) * h;
    let adapters = 4 * layers * (2 * a_shard + h.div_ceil(n) * r + kv.div_ceil(n) * r);
    let states: u64 =
        layers * linears.iter().map(|x| 4 * x.div_ceil(64) + 64).sum::<u64>() + 32 * 4;
    let recipe_for = |dp: u32, shard: Shard, storage: DType| {
        let mut rc = recipe(4, 512, dp, shard);
        rc.precision = Precision::Bf16;
        rc.quant = Some("nf4".parse().unwrap());
        rc.lora = Some("r=8".parse().unwrap());
        rc.quant_storage = storage;
        rc
    };
    let rc = recipe_for(3, Shard::Fsdp2, DType::BF16);
    let g = zoo::build("tinyllama-1.1b", &rc).unwrap();
    assert_eq!(g.param_count(), layers * r * (h + h + h + kv));
    let t = lower(&g, &rc).unwrap();
    for it in 0..2 {
        let live = live_at_phase(&t, "optimizer", it);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(get(Category::Parameter), codes + bf16 + adapters, "it {it}");
        assert_eq!(get(Category::Gradient), adapters, "it {it}");
        assert_eq!(get(Category::Other), states, "it {it}");
    }
    let live = live_at_phase(&t, "forward", 1);
    assert_eq!(live[&Category::OptimizerState], 2 * adapters);
    assert_eq!(
        tagged_bytes(&t, "model.layers.0.self_attn.q_proj.weight:shard"),
        code_shard(h * h)
    );
    assert_eq!(
        tagged_bytes(&t, "model.layers.0.mlp.down_proj.weight:shard"),
        code_shard(ff * h)
    );
    // Block 0's all-gather output, bytes: the codes, two norms, the four adapters (all padded).
    let padded = |rows: u64| rows.div_ceil(n) * n;
    let block: u64 = linears.iter().map(|&x| 2 * padded(rows(x))).sum::<u64>()
        + 2 * 2 * padded(h)
        + 4 * (2 * padded(r) * h + padded(h) * r + padded(kv) * r);
    let first = t.events.iter().find_map(|e| match e {
        Event::Alloc {
            size, tag: Some(x), ..
        } if &**x == "fsdp_all_gather_output:group0" => Some(*size),
        _ => None,
    });
    assert_eq!(first, Some(block));
    // On one GPU the bf16 storage holds the same bytes as uint8 (every n here a multiple of 4).
    let one = |storage| {
        let rc = recipe_for(1, Shard::None, storage);
        let t = lower(&zoo::build("tinyllama-1.1b", &rc).unwrap(), &rc).unwrap();
        live_at_phase(&t, "optimizer", 1)
    };
    let (u8s, bf16s) = (one(DType::U8), one(DType::BF16));
    assert_eq!(
        u8s[&Category::Parameter],
        layers * linears.iter().map(|x| x / 2).sum::<u64>()
            + 2 * (2 * vocab * h + (2 * layers + 1) * h)
            + 4 * layers * r * (h + h + h + kv)
    );
    assert_eq!(bf16s[&Category::Parameter], u8s[&Category::Parameter]);
    assert_eq!(bf16s[&Category::Other], states);
    // The default uint8 storage: accelerate passes the frozen non-floating Params4bit to
    // `fully_shard` as `ignored_params` (PR #3987): every rank holds them whole (⌈n/2⌉ bytes
    // each), only the rest is sharded, and a block's all-gather carries its norms and adapters.
    let rc = recipe_for(3, Shard::Fsdp2, DType::U8);
    let t = lower(&zoo::build("tinyllama-1.1b", &rc).unwrap(), &rc).unwrap();
    let whole: u64 = layers * linears.iter().map(|x| x.div_ceil(2)).sum::<u64>();
    for it in 0..2 {
        let live = live_at_phase(&t, "optimizer", it);
        assert_eq!(
            live[&Category::Parameter],
            whole + bf16 + adapters,
            "it {it}"
        );
        assert_eq!(live[&Category::Other], states, "it {it}");
    }
    assert_eq!(
        tagged_bytes(&t, "model.layers.0.self_attn.q_proj.weight:shard"),
        0
    );
    let first = t.events.iter().find_map(|e| match e {
        Event::Alloc {
            size, tag: Some(x), ..
        } if &**x == "fsdp_all_gather_output:group0" => Some(*size),
        _ => None,
    });
    assert_eq!(
        first,
        Some(2 * 2 * padded(h) + 4 * (2 * padded(r) * h + padded(h) * r + padded(kv) * r))
    );
}

/// What FSDP-QLoRA does not run as modelled is refused with the reason: LLM.int8, a
/// MixedPrecisionPolicy (it would cast the codes), a `quant_storage` without a 4-bit `--quant`,
/// and QLoRA under ZeRO.
#[test]
fn fsdp_qlora_refusals_name_the_reason() {
    let with = |quant: &str, storage: DType, mp: bool| {
        let mut rc = recipe(2, 128, 2, Shard::Fsdp2);
        rc.precision = Precision::Bf16;
        rc.quant = Some(quant.parse().unwrap());
        rc.lora = Some("r=8".parse().unwrap());
        rc.quant_storage = storage;
        if mp {
            rc.parallel.fsdp_reduce_dtype = Some(DType::F32);
        }
        rc.validate().unwrap_err().to_string()
    };
    let e = with("int8", DType::U8, false);
    assert!(e.contains("LLM.int8") && e.contains("--quant nf4"), "{e}");
    let e = with("nf4", DType::BF16, true);
    assert!(
        e.contains("MixedPrecisionPolicy") && e.contains("init_dtype_attrs"),
        "{e}"
    );
    let e = with("int8", DType::BF16, false);
    assert!(e.contains("4-bit quant_storage"), "{e}");
    let mut rc = recipe(2, 128, 1, Shard::None);
    rc.quant_storage = DType::BF16;
    let e = rc.validate().unwrap_err().to_string();
    assert!(e.contains("give --quant nf4, fp4, nf4-dq or fp4-dq"), "{e}");
    // ZeRO keeps its refusal.
    let mut rc = recipe(2, 128, 2, Shard::Zero2);
    rc.precision = Precision::Bf16;
    rc.quant = Some("nf4".parse().unwrap());
    rc.quant_storage = DType::BF16;
    rc.lora = Some("r=8".parse().unwrap());
    let e = rc.validate().unwrap_err().to_string();
    assert!(e.contains("_configure_distributed_model"), "{e}");
    // ZeRO-3 QLoRA is lowered (`zero3_qlora_*`).
    rc.parallel.shard = Shard::Zero3;
    assert!(rc.validate().is_ok());
}

/// ZeRO-3 QLoRA (`--quant nf4 --lora r=8 --dp 3 --shard zero3`, PEFT docs "DeepSpeed ZeRO-3 +
/// QLoRA"), TinyLlama 1.1B in bf16 with AdamW, by hand from the rules, after the second backward
/// (before the step):
///
/// * transformers skips `zero.Init` for a quantized model, so `deepspeed.initialize` first casts
///   every floating parameter to bf16 (`_cast_module_mixed_precision`: PEFT's float32 adapters
///   become bf16, bf16-stored codes are unchanged, uint8 ones are not floating) and then
///   partitions every parameter in its own dtype, ⌈numel/N⌉ elements (`_partition_param`): the
///   packed codes `(n + 1) // (2 · itemsize)` elements of their storage (bf16: 2⌈(n/4)/3⌉ bytes,
///   uint8: ⌈(n/2)/3⌉ bytes), the embeddings and norms bf16;
/// * the optimizer sees only the adapters (Ψa' = Σ⌈numel/3⌉ of lora_A [8, 2048] ×2, lora_B
///   [2048, 8] and [256, 8] per layer): `lp_param_buffer` 2Ψa', `grad_partitions_flat_buffer`
///   2Ψa', fp32 master 4Ψa' and Adam's moments 8Ψa', the IPG buffer 5e8 bf16 elements;
/// * every parameter of at most 1e5 elements is persistent (the norms, every adapter; no packed
///   code tensor: the smallest, k_proj's, holds 131,072 bf16 or 262,144 uint8 elements), whole
///   on the rank (⌈numel/3⌉·3 elements) besides its partition;
/// * the quant state (float32 absmax per 64-block, the 16-entry code) is no parameter: whole.
#[test]
fn zero3_qlora_partitions_the_packed_codes_and_keeps_the_quant_state_whole() {
    let (h, kv, ff, layers, vocab, r) = (2048u64, 256u64, 5632u64, 22u64, 32000u64, 8u64);
    let n = 3u64;
    let linears = [h * h, h * kv, h * kv, h * h, h * ff, h * ff, ff * h];
    let part = |numel: u64| numel.div_ceil(n);
    let adapters = [r * h, h * r, r * h, kv * r];
    let psi_a: u64 = layers * adapters.iter().map(|&x| part(x)).sum::<u64>();
    let persistent: u64 = (2 * layers + 1) * 2 * part(h) * n
        + layers * adapters.iter().map(|&x| 2 * part(x) * n).sum::<u64>();
    let bf16_frozen = 2 * (2 * part(vocab * h) + (2 * layers + 1) * part(h));
    let states: u64 =
        layers * linears.iter().map(|x| 4 * x.div_ceil(64) + 64).sum::<u64>() + 32 * 4;
    for (storage, code_bytes) in [
        (
            DType::BF16,
            (|x: u64| 2 * ((x + 1) / 4).div_ceil(3)) as fn(u64) -> u64,
        ),
        (DType::U8, |x: u64| x.div_ceil(2).div_ceil(3)),
    ] {
        let mut rc = zero3_recipe(4, 512, n as u32);
        rc.quant = Some("nf4".parse().unwrap());
        rc.lora = Some("r=8".parse().unwrap());
        rc.quant_storage = storage;
        rc.validate().unwrap();
        let g = zoo::build("tinyllama-1.1b", &rc).unwrap();
        // The engine's cast: the adapters are bf16 parameters of the graph.
        assert_eq!(g.param_count(), layers * r * (h + h + h + kv));
        let codes: u64 = layers * linears.iter().map(|&x| code_bytes(x)).sum::<u64>();
        let t = lower(&g, &rc).unwrap();
        let live = live_at_phase(&t, "optimizer", 1);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(
            get(Category::Parameter),
            codes + bf16_frozen + 2 * psi_a + persistent,
            "{storage:?}"
        );
        assert_eq!(get(Category::Gradient), 2 * psi_a, "{storage:?}");
        assert_eq!(get(Category::OptimizerState), 12 * psi_a, "{storage:?}");
        assert_eq!(get(Category::Communication), 1_000_000_000, "{storage:?}");
        // the quant states, and the stage-3 optimizer's 1-byte `inf_or_nan_tracker`
        assert_eq!(get(Category::Other), states + 1, "{storage:?}");
        assert_eq!(
            tagged_bytes(&t, "model.layers.0.mlp.down_proj.weight:ds_tensor"),
            code_bytes(ff * h),
            "{storage:?}"
        );
        // No `zero.Init`: `from_pretrained` and `get_peft_model` leave the whole model on every
        // rank (the codes `(n + 1) // (2 · itemsize)` elements, the base weights bf16, PEFT's
        // adapters float32) before the engine casts the adapters to bf16 and partitions it.
        let whole_codes: u64 = layers
            * linears
                .iter()
                .map(|&x| (x + 1) / (2 * storage.size()) * storage.size())
                .sum::<u64>();
        let whole = whole_codes
            + 2 * (2 * vocab * h + (2 * layers + 1) * h)
            + 4 * layers * adapters.iter().sum::<u64>();
        assert_eq!(max_tag_suffix(&t, ":from_pretrained"), whole, "{storage:?}");
        assert_eq!(
            max_tag_suffix(&t, ":_cast_module_mixed_precision"),
            2 * layers * adapters.iter().sum::<u64>(),
            "{storage:?}"
        );
        assert_eq!(tagged_suffix_count(&t, ":zero.Init"), 0, "{storage:?}");
    }
}

/// The most bytes of allocations whose tag ends with `suffix` live at once.
fn max_tag_suffix(t: &Trace, suffix: &str) -> u64 {
    let mut live: HashMap<String, u64> = HashMap::new();
    let (mut now, mut max) = (0u64, 0u64);
    for e in &t.events {
        match e {
            Event::Alloc {
                id,
                size,
                tag: Some(x),
                ..
            } if x.ends_with(suffix) => {
                live.insert(id.to_string(), *size);
                now += size;
                max = max.max(now);
            }
            Event::Free { id } => {
                now -= live.remove(&id.to_string()).unwrap_or(0);
            }
            _ => {}
        }
    }
    max
}

/// How many allocations have a tag ending with `suffix`.
fn tagged_suffix_count(t: &Trace, suffix: &str) -> usize {
    t.events
        .iter()
        .filter(|e| matches!(e, Event::Alloc { tag: Some(x), .. } if x.ends_with(suffix)))
        .count()
}

/// What ZeRO-3 QLoRA does not run as modelled is refused with the reason: LLM.int8 (its `CB`
/// aliases the data ZeRO-3 would partition), and codes stored in a float dtype other than the
/// bf16/fp16 mode's (the engine would cast them).
#[test]
fn zero3_qlora_refusals_name_the_reason() {
    let with = |quant: &str, storage: DType, precision: Precision| {
        let mut rc = zero3_recipe(2, 128, 2);
        rc.precision = precision;
        rc.quant = Some(quant.parse().unwrap());
        rc.lora = Some("r=8".parse().unwrap());
        rc.quant_storage = storage;
        rc.validate().map_err(|e| e.to_string())
    };
    let e = with("int8", DType::U8, Precision::Bf16).unwrap_err();
    assert!(e.contains("Int8Params") && e.contains("--quant nf4"), "{e}");
    for (storage, precision, want) in [
        (DType::F32, Precision::Bf16, "give --quant-storage bf16"),
        (DType::F16, Precision::Bf16, "give --quant-storage bf16"),
        (DType::BF16, Precision::Fp16, "give --quant-storage fp16"),
    ] {
        let e = with("nf4-dq", storage, precision).unwrap_err();
        assert!(
            e.contains("_cast_module_mixed_precision") && e.contains(want),
            "{storage:?} {precision:?}: {e}"
        );
    }
    // What runs, and lowers: the storage the mode's dtype, uint8, and any storage in fp32 mode
    // (no cast: PEFT's float32 adapters stay float32).
    for (storage, precision) in [
        (DType::BF16, Precision::Bf16),
        (DType::F16, Precision::Fp16),
        (DType::U8, Precision::Fp16),
        (DType::BF16, Precision::Fp32),
    ] {
        assert!(
            with("fp4", storage, precision).is_ok(),
            "{storage:?} {precision:?}"
        );
        let mut rc = zero3_recipe(1, 64, 2);
        rc.precision = precision;
        rc.quant = Some("fp4".parse().unwrap());
        rc.lora = Some("r=8,targets=c_attn".parse().unwrap());
        rc.quant_storage = storage;
        let g = zoo::build("gpt2", &rc).unwrap();
        let adapter = g.params.iter().find(|p| p.name.contains("lora_A")).unwrap();
        let want = match precision {
            Precision::Fp32 => "float32",
            _ => "model",
        };
        let got = match g.values[adapter.value.0 as usize].dtype {
            vramsim_models::graph::DTypeSpec::Fixed(DType::F32) => "float32",
            vramsim_models::graph::DTypeSpec::Model => "model",
            d => panic!("{d:?}"),
        };
        assert_eq!(got, want, "{storage:?} {precision:?}");
        lower(&g, &rc).unwrap();
    }
}

/// FSDP-QLoRA's batch templates (what `max-batch` and sweeps instantiate) equal fresh lowerings,
/// for float-stored (sharded) and uint8 (ignored) codes.
#[test]
fn fsdp_qlora_batch_templates_equal_fresh_lowerings() {
    use vramsim_models::compact::lower_compact;
    use vramsim_models::template::BatchTemplate;
    for storage in [DType::BF16, DType::U8] {
        let lowered = |batch: u64| {
            let mut rc = recipe(batch, 64, 2, Shard::Fsdp2);
            rc.precision = Precision::Bf16;
            rc.quant = Some("nf4-dq".parse().unwrap());
            rc.lora = Some("r=8,targets=c_attn".parse().unwrap());
            rc.quant_storage = storage;
            lower_compact(&zoo::build("gpt2", &rc).unwrap(), &rc).unwrap()
        };
        let t = BatchTemplate::fit(&lowered(2), 2, &lowered(3), 3)
            .unwrap_or_else(|| panic!("{storage:?}: no template"));
        for batch in [4, 7] {
            let inst = t.instantiate(batch).unwrap();
            assert!(inst.same_as(&lowered(batch)), "{storage:?} batch {batch}");
        }
    }
}

/// ZeRO-3 QLoRA's compact lowering of accumulated micro-batches expands to the full one, and its
/// batch templates (what `max-batch` and sweeps instantiate) equal fresh lowerings, for bf16- and
/// uint8-stored codes, with and without `--offload`.
#[test]
fn zero3_qlora_lowers_compactly_and_by_template() {
    use vramsim_models::compact::lower_compact;
    use vramsim_models::template::BatchTemplate;
    use vramsim_models::Offload;
    for (storage, offload) in [
        (DType::BF16, Offload::None),
        (DType::U8, Offload::None),
        (DType::BF16, Offload::Optimizer),
        (DType::U8, Offload::Params),
    ] {
        let with = |batch: u64, accum: u32| {
            let mut rc = zero3_recipe(batch, 64, 2);
            rc.accum = accum;
            rc.parallel.offload = offload;
            rc.quant = Some("nf4-dq".parse().unwrap());
            rc.lora = Some("r=8,targets=c_attn".parse().unwrap());
            rc.quant_storage = storage;
            rc
        };
        let r6 = with(1, 6);
        let g = zoo::build("gpt2", &r6).unwrap();
        assert!(
            lower_compact(&g, &r6).unwrap().expand() == lower(&g, &r6).unwrap(),
            "{storage:?} {offload}"
        );
        let lowered = |batch: u64| {
            let rc = with(batch, 1);
            lower_compact(&zoo::build("gpt2", &rc).unwrap(), &rc).unwrap()
        };
        let t = BatchTemplate::fit(&lowered(2), 2, &lowered(3), 3)
            .unwrap_or_else(|| panic!("{storage:?} {offload}: no template"));
        for batch in [4, 7] {
            let inst = t.instantiate(batch).unwrap();
            assert!(
                inst.same_as(&lowered(batch)),
                "{storage:?} {offload} batch {batch}"
            );
        }
    }
}

/// `DistributedDataParallel.__init__` → `_sync_module_states` → `dist._broadcast_coalesced` with
/// `broadcast_bucket_size` = 250 MiB (`c10d/comm.cpp` `broadcast_coalesced`): each dtype bucket of
/// several tensors flattened into one new tensor (`at::cat`), at most two in flight, all freed
/// before the Reducer's bucket is made. The bucket sizes are PyTorch's own: 2.15's
/// `dist._compute_bucket_assignment_by_size(states, [250 * 1024 * 1024])` over HF
/// `GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24, n_head=16))`'s `named_parameters()`
/// (292 fp32 tensors, no buffers, the tied `lm_head` once) gives buckets of 17, 66, 62, 64, 66 and
/// 17 tensors; by hand the first is wte + wpe + block 0 + block 1's `ln_1` and `c_attn.weight`:
/// 4 × (50257·1024 + 1024² + 12,596,224 + 2·1024 + 1024·3072) = 273,022,976 B.
#[test]
fn ddp_construction_broadcasts_the_module_states_in_250_mib_buckets() {
    let r = Recipe {
        precision: Precision::Fp32,
        ..recipe(1, 64, 2, Shard::Ddp)
    };
    let g = zoo::build("gpt2-medium", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    let flats: Vec<(vramsim_traces::AllocId, u64)> = t
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Alloc { id, size, tag, .. }
                if tag
                    .as_deref()
                    .is_some_and(|t| t.starts_with("ddp_sync_flat")) =>
            {
                Some((id.clone(), *size))
            }
            _ => None,
        })
        .collect();
    let sizes: Vec<u64> = flats.iter().map(|f| f.1).collect();
    assert_eq!(
        sizes,
        [273022976, 272920576, 268718080, 264519680, 272920576, 67190784]
    );
    // Two in flight: bucket k + 2 is allocated after bucket k is freed, and every flat tensor
    // is freed before the Reducer's first bucket is allocated.
    let at = |pred: &dyn Fn(&Event) -> bool| t.events.iter().position(pred).unwrap();
    let alloc_of =
        |id: &vramsim_traces::AllocId| at(&|e| matches!(e, Event::Alloc { id: i, .. } if i == id));
    let free_of =
        |id: &vramsim_traces::AllocId| at(&|e| matches!(e, Event::Free { id: i } if i == id));
    let first_bucket = at(
        &|e| matches!(e, Event::Alloc { tag, .. } if tag.as_deref().is_some_and(|t| t.starts_with("ddp_bucket"))),
    );
    for (k, (id, _)) in flats.iter().enumerate() {
        assert!(
            free_of(id) < first_bucket,
            "flat {k} outlives the construction"
        );
        if let Some((next, _)) = flats.get(k + 1) {
            assert!(
                alloc_of(next) < free_of(id),
                "flat {k} and {} in flight",
                k + 1
            );
        }
        if let Some((later, _)) = flats.get(k + 2) {
            assert!(free_of(id) < alloc_of(later), "three in flight at flat {k}");
        }
    }
}

/// ZeRO-Offload in fp16 mode (stages 1/2): `has_overflow` reads `self.local_overflow`, set at the
/// accumulation boundary by `update_offload_overflow_tracker_for_param_grad` →
/// `_has_inf_or_nan` of each partition parameter's whole gradient on the GPU
/// (`stage_1_and_2.py`), then all-reduces `ByteTensor([overflow])` (1 byte); the loss scaler
/// unscales the host fp32 gradients. By hand, per iteration and per parameter overlapping rank 0's
/// first Ψ'/N elements (n elements): `x.float()` and `.float()` (4n each), `isnan`, `isinf`,
/// `logical_or` (n each), the 4-byte `max`; then the 1-byte flag. bf16 (whose default
/// `check_grad_overflow` is True) runs the same.
#[test]
fn deepspeed_fp16_offload_checks_the_gradients_on_the_gpu() {
    let (n, iters) = (4u64, 2u32);
    for shard in [Shard::Zero1, Shard::Zero2] {
        for precision in [Precision::Fp16, Precision::Bf16] {
            let mut r = recipe(1, 128, n as u32, shard);
            r.optimizer = OptimizerKind::AdamW;
            r.precision = precision;
            r.iterations = iters;
            r.parallel.offload = Offload::Optimizer;
            r.validate().unwrap();
            let g = zoo::build("gpt2", &r).unwrap();
            let t = lower(&g, &r).unwrap();
            let sizes: Vec<u64> = g
                .params
                .iter()
                .map(|p| p.shape.iter().product::<u64>())
                .collect();
            let psi: u64 = sizes.iter().sum();
            let part = psi.div_ceil(2 * n) * 2 * n / n;
            let mut want: HashMap<u64, i64> = HashMap::new();
            let times = i64::from(iters);
            let mut add = |size: u64, k: i64| *want.entry(size).or_insert(0) += k * times;
            let mut start = 0;
            for s in sizes {
                if start < part {
                    add(4 * s, 2);
                    add(s, 3);
                    add(4, 1);
                }
                start += s;
            }
            add(1, 1);
            assert_eq!(overflow_check_sizes(&t), want, "{shard} {precision:?}");
        }
    }
}

/// ZeRO-3 with `offload_optimizer` in fp16 mode: `self.device` is the host (`stage3.py`), so
/// `has_overflow`'s `isinf`/`isnan` of `grad_partitions_flat_buffer` and the tracker's clone run
/// there; the GPU sees only `.to(device)` (1-byte bool) and `.to(torch.uint8)` (1-byte
/// `overflow_gpu`), once per iteration. bf16 makes no check (`_overflow_check_and_loss_scale_update`:
/// `if self.dtype == torch.float16`).
#[test]
fn deepspeed_zero3_fp16_offload_checks_overflow_on_the_host() {
    let (n, iters) = (4u32, 2u32);
    for offload in [Offload::Optimizer, Offload::Params] {
        for (precision, want) in [
            (
                Precision::Fp16,
                HashMap::from([(1u64, 2 * i64::from(iters))]),
            ),
            (Precision::Bf16, HashMap::new()),
        ] {
            let mut r = zero3_recipe(1, 128, n);
            r.precision = precision;
            r.iterations = iters;
            r.parallel.offload = offload;
            r.validate().unwrap();
            let g = zoo::build("gpt2", &r).unwrap();
            let t = lower(&g, &r).unwrap();
            assert_eq!(overflow_check_sizes(&t), want, "{offload} {precision:?}");
        }
    }
}
