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

use std::collections::HashMap;

use vramsim_models::{
    lower, zoo, DType, Offload, OptimizerKind, Parallel, Precision, Recipe, ReshardAfterForward,
    Shard,
};
use vramsim_traces::{Category, Event, Trace};

/// Live bytes by category just before the `nth` (0-based) `phase` marker named `phase`.
fn live_at_phase(t: &Trace, phase: &str, nth: usize) -> HashMap<Category, u64> {
    let mut live: HashMap<String, (u64, Category)> = HashMap::new();
    let mut seen = 0;
    for e in &t.events {
        match e {
            Event::Alloc {
                id, size, category, ..
            } => {
                live.insert(id.to_string(), (*size, *category));
            }
            Event::Free { id } => {
                live.remove(&id.to_string());
            }
            Event::Phase { name } if &**name == phase => {
                if seen == nth {
                    let mut by = HashMap::new();
                    for (size, c) in live.values() {
                        *by.entry(*c).or_insert(0) += size;
                    }
                    return by;
                }
                seen += 1;
            }
            _ => {}
        }
    }
    panic!("no phase {phase} #{nth}");
}

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

/// (stage, ranks): the model states per rank by the ZeRO paper's formula, against the trace.
#[test]
fn zero_model_states_per_rank_match_the_paper() {
    for shard in [Shard::Zero1, Shard::Zero2] {
        for (name, n) in [
            ("gpt2", 8u64),
            ("gpt2", 64),
            ("bert-base", 16),
            ("tinyllama-1.1b", 4),
        ] {
            let mut r = recipe(1, 128, n as u32, shard);
            r.precision = Precision::Bf16;
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

/// The most bytes of `category` live at once over the trace.
fn max_live(t: &Trace, category: Category) -> u64 {
    let mut live: HashMap<String, (u64, Category)> = HashMap::new();
    let (mut now, mut max) = (0u64, 0u64);
    for e in &t.events {
        match e {
            Event::Alloc {
                id,
                size,
                category: c,
                ..
            } => {
                live.insert(id.to_string(), (*size, *c));
                if *c == category {
                    now += size;
                    max = max.max(now);
                }
            }
            Event::Free { id } => {
                if let Some((size, c)) = live.remove(&id.to_string()) {
                    if c == category {
                        now -= size;
                    }
                }
            }
            _ => {}
        }
    }
    max
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
        for (name, n) in [
            ("gpt2", 8u64),
            ("gpt2", 64),
            ("bert-base", 16),
            ("tinyllama-1.1b", 4),
        ] {
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
