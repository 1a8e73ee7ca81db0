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

use vramsim_models::{lower, zoo, DType, OptimizerKind, Parallel, Precision, Recipe, Shard};
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
