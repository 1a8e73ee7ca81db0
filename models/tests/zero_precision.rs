//! DeepSpeed ZeRO 1–3 in its fp32 mode (`--precision fp32`: no `bf16`/`fp16` section in the
//! config), against closed forms derived by hand from DeepSpeed's source (`deepspeed/runtime`,
//! read at edaa722), never from vramsim's output:
//!
//! * `engine.py` `_configure_distributed_model` casts the module only in the bf16/fp16 modes, so
//!   the parameters, the flat group (`bit16_groups_flat`, stages 1/2) and the partitions
//!   (`lp_param_buffer`, stage 3) are fp32: 4 bytes per element;
//! * the gradient-accumulation dtype defaults to the model's (`get_data_types`): fp32 gradients,
//!   `grads_in_partition` (stage 2) and `grad_partitions_flat_buffer` (stage 3) 4 bytes each;
//! * stages 1/2: `weights_partition = partition.detach().clone().to(dtype=fp32)` is one fp32
//!   clone (the `.to` of an fp32 tensor returns it), 4Ψ'/N; stage 3 (`_create_fp32_partitions`):
//!   the fp32 sub-group partition is the master itself ("we don't need another copy of the
//!   weights"), no bytes beyond the parameters';
//! * Adam's two fp32 moments of the partition: 8Ψ'/N;
//! * the IPG buffer: `reduce_bucket_size` = 5e8 elements in the optimizer's dtype (stages 1/2,
//!   `setup_buckets`) or the communication dtype (stage 3, fp32 without a bf16/fp16 section,
//!   `engine.py` `communication_data_type`): 2 GB;
//! * `check_grad_overflow` is False (`_configure_zero_optimizer`): no overflow check.

mod common;
use common::{live_at_phase, zero3_partition, zero3_persistent};

use vramsim_models::{
    lower, zoo, Offload, OptimizerImpl, OptimizerKind, Parallel, Precision, Recipe, Shard,
};
use vramsim_traces::{Category, Event, Trace};

/// The models and data-parallel degrees checked (64 ranks do not divide GPT-2's parameters).
const CASES: [(&str, u64); 3] = [("gpt2", 8), ("gpt2", 64), ("bert-base", 16)];

/// `reduce_bucket_size` (5e8 elements) of fp32.
const IPG_FP32: u64 = 2_000_000_000;

fn fp32_recipe(n: u64, shard: Shard) -> Recipe {
    Recipe {
        precision: Precision::Fp32,
        optimizer: OptimizerKind::AdamW,
        parallel: Parallel {
            dp: n as u32,
            shard,
            ..Parallel::default()
        },
        ..Recipe::new(1, 128)
    }
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

/// Stages 1 and 2, fp32 AdamW, Ψ parameters padded to Ψ' (a multiple of 2N,
/// `flatten_dense_tensors_aligned`): stage 1 holds 4Ψ' + 4Ψ + 12Ψ'/N bytes of model states when
/// it reduces at the boundary (the full fp32 gradients still exist), stage 2 4Ψ' + 16Ψ'/N before
/// the step. The ZeRO paper's mixed-precision 2Ψ + 2Ψ + 12Ψ/N becomes 4Ψ + 4Ψ + 12Ψ/N: the
/// 16-bit parameters and gradients are fp32, the optimizer states (fp32 master and moments) the
/// same.
#[test]
fn zero12_fp32_model_states_follow_deepspeed() {
    for shard in [Shard::Zero1, Shard::Zero2] {
        for (name, n) in CASES {
            let r = fp32_recipe(n, shard);
            r.validate().unwrap();
            let g = zoo::build(name, &r).unwrap();
            let psi = g.param_count();
            let padded = psi.div_ceil(2 * n) * 2 * n;
            let t = lower(&g, &r).unwrap();
            let at = format!("{name} {shard} N={n}");
            let (live, grads, ipg) = match shard {
                Shard::Zero1 => (live_at_phase(&t, "reduce_gradients", 1), 4 * psi, IPG_FP32),
                _ => (live_at_phase(&t, "optimizer", 1), 4 * padded / n, 0),
            };
            let get = |c| live.get(&c).copied().unwrap_or(0);
            assert_eq!(get(Category::Parameter), 4 * padded, "{at}");
            assert_eq!(get(Category::Gradient), grads, "{at}");
            assert_eq!(get(Category::OptimizerState), 12 * padded / n, "{at}");
            assert_eq!(get(Category::Communication), ipg, "{at}: IPG buffer");
            // The master is one fp32 clone of the partition, made once.
            assert_eq!(
                tagged_bytes(&t, "single_partition_of_fp32_groups"),
                4 * padded / n,
                "{at}"
            );
        }
    }
}

/// Stage 3, fp32 AdamW: with Ψ'' = Σ⌈numel/N⌉ (each parameter's padded partition), the
/// partitions 4Ψ'' (also the master), `grad_partitions_flat_buffer` 4Ψ'' and Adam's moments 8Ψ''
/// = 16Ψ'', the paper's 16Ψ/N when N divides every parameter; plus the persistent parameters
/// (numel ≤ 1e5) whole, 4 bytes × their padded numel, and the fp32 IPG buffer.
#[test]
fn zero3_fp32_model_states_follow_deepspeed() {
    for (name, n) in CASES {
        let r = fp32_recipe(n, Shard::Zero3);
        r.validate().unwrap();
        let g = zoo::build(name, &r).unwrap();
        let part = zero3_partition(&g, n);
        let psi_p: u64 = part.iter().sum();
        let persistent = zero3_persistent(&g, &part, n);
        let t = lower(&g, &r).unwrap();
        let live = live_at_phase(&t, "optimizer", 1);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        let at = format!("{name} N={n}");
        assert_eq!(get(Category::Parameter), 4 * psi_p + 4 * persistent, "{at}");
        assert_eq!(get(Category::Gradient), 4 * psi_p, "{at}");
        assert_eq!(get(Category::OptimizerState), 8 * psi_p, "{at}");
        assert_eq!(get(Category::Communication), IPG_FP32, "{at}: IPG buffer");
        let partitioned = get(Category::Parameter) - 4 * persistent
            + get(Category::Gradient)
            + get(Category::OptimizerState);
        assert_eq!(partitioned, 16 * psi_p, "{at}");
        if g.params
            .iter()
            .all(|p| p.shape.iter().product::<u64>() % n == 0)
        {
            assert_eq!(partitioned, 16 * g.param_count() / n, "{at}");
        }
    }
}

/// The step of stage 2 in fp32 mode: `flat_grad_partition.to(fp32)` is the flattened gradient
/// itself, so the step makes one fp32 partition (4Ψ'/N), no 16-bit flat and no fp32 copy; the
/// setup's master is one fp32 clone. With the fused AdamW (no per-step temporaries of the
/// partition's size), the allocations of exactly 4Ψ'/N bytes are, by hand: the master clone, the
/// zero gradient of `initialize_optimizer_states` and the two moments (4, once), then per
/// iteration `grads_in_partition` (made by the first reduction, dropped by the step) and the
/// flat gradient: 4 + 2 × 2 over two iterations. No allocation of 2Ψ'/N bytes (a 16-bit
/// partition) is made at all.
#[test]
fn zero2_fp32_step_flattens_without_a_copy() {
    let n = 8u64;
    let mut r = fp32_recipe(n, Shard::Zero2);
    r.optimizer_impl = OptimizerImpl::Fused;
    r.iterations = 2;
    let g = zoo::build("gpt2", &r).unwrap();
    let padded = g.param_count().div_ceil(2 * n) * 2 * n;
    let part = padded / n;
    let t = lower(&g, &r).unwrap();
    let count = |bytes: u64| {
        t.events
            .iter()
            .filter(|e| matches!(e, Event::Alloc { size, .. } if *size == bytes))
            .count()
    };
    assert_eq!(count(4 * part), 4 + 2 * 2, "4Ψ'/N = {} bytes", 4 * part);
    assert_eq!(count(2 * part), 0, "2Ψ'/N = {} bytes", 2 * part);
}

/// ZeRO-Offload in fp32 mode (stage 2): the bf16 mode's GPU terms with fp32 sizes, less what
/// fp32 makes a no-op: `weights_partition`'s GPU clone is fp32 (4Ψ'/N), the staging buffer
/// `temp_grad_buffer_for_gpu_offload` fp32 (4 B × the largest parameter); `_has_inf_or_nan`'s
/// `x.float()` and `async_inplace_copy_grad_to_fp32_buffer_from_gpu`'s `.to(fp32)` (only `if
/// src_tensor.dtype != master_weights_and_grads_dtype`) make nothing, and without
/// `check_grad_overflow` the step's `has_overflow` ByteTensor is not made.
#[test]
fn zero_offload_fp32_makes_no_upcasts() {
    let n = 8u64;
    let mut r = fp32_recipe(n, Shard::Zero2);
    r.parallel.offload = Offload::Optimizer;
    r.validate().unwrap();
    let g = zoo::build("gpt2", &r).unwrap();
    let psi = g.param_count();
    let padded = psi.div_ceil(2 * n) * 2 * n;
    let largest = g
        .params
        .iter()
        .map(|p| p.shape.iter().product::<u64>())
        .max()
        .unwrap();
    let t = lower(&g, &r).unwrap();
    assert_eq!(tagged_bytes(&t, "weights_partition:clone"), 4 * padded / n);
    assert_eq!(
        tagged_bytes(&t, "temp_grad_buffer_for_gpu_offload"),
        4 * largest
    );
    assert_eq!(tagged_bytes(&t, "_has_inf_or_nan:float_x"), 0);
    assert_eq!(
        tagged_bytes(
            &t,
            "async_inplace_copy_grad_to_fp32_buffer_from_gpu:src_tensor"
        ),
        0
    );
    assert_eq!(tagged_bytes(&t, "has_overflow:overflow_gpu"), 0);
    let live = live_at_phase(&t, "optimizer", 1);
    let get = |c| live.get(&c).copied().unwrap_or(0);
    assert_eq!(get(Category::Parameter), 4 * padded);
    assert_eq!(get(Category::OptimizerState), 0);
    assert_eq!(get(Category::Gradient), 0);
}

/// DeepSpeed's `torch_autocast` mode stays refused under ZeRO, with the reason.
#[test]
fn zero_with_autocast_is_refused() {
    for p in [Precision::AmpFp16, Precision::AmpBf16] {
        for shard in [Shard::Zero1, Shard::Zero2, Shard::Zero3] {
            let mut r = fp32_recipe(2, shard);
            r.precision = p;
            let e = r.validate().unwrap_err().to_string();
            assert!(e.contains("torch_autocast"), "{e}");
            assert!(e.contains("fp32"), "{e}");
        }
    }
}
