//! Fine-tuning (`--freeze`, `--lora`) under DeepSpeed ZeRO-3 and with CPU offload, per rank,
//! against closed forms derived by hand from the frameworks' sources (never from vramsim's
//! output):
//!
//! * ZeRO-3 (deepspeedai/DeepSpeed `partition_parameters.py` `Init`/`_partition_param`): every
//!   parameter, frozen or not, is partitioned, ⌈numel/N⌉ 16-bit elements per rank, and the
//!   persistent ones (numel ≤ `stage3_param_persistence_threshold` = 1e5,
//!   `parameter_offload.py` `mark_persistent_parameters` over `named_parameters()`) are held whole
//!   between steps (`_post_step`); only `trainable_param_groups` (`stage3.py`
//!   `_get_trainable_parameter_groups` skips `not param.requires_grad`) get the flat
//!   `lp_param_buffer`, the gradient partitions (`grad_partitions_flat_buffer`), the fp32 master
//!   and Adam's moments. Per rank, with Ψ'ₓ = Σ⌈numel/N⌉ over x: 2Ψ'_all + (2 + 12)Ψ'_train
//!   bytes of partitioned model states — the ZeRO paper's 16Ψ/N with the frozen parameters
//!   keeping only their 2Ψ/N — plus the persistent parameters whole and the 1 GB IPG buffer
//!   (`reduce_bucket_size` 5e8 bf16 elements).
//! * ZeRO-Offload (`offload_optimizer`): the trainable partitions' master, gradients and state go
//!   to the host; `offload_param` makes every non-persistent partition on the host
//!   (`_partition_param`: `device = self.local_device if param.ds_persist else remote_device`),
//!   and the trainable ones move into the optimizer's host flat buffer (`_move_to_flat_buffer`),
//!   so only the frozen persistent partitions stay on the GPU.
//! * ZeRO-1/2 with `offload_optimizer` and FSDP2's `CPUOffloadPolicy` follow `requires_grad` as
//!   their GPU-resident forms do.

mod common;
use common::live_at_phase;

use vramsim_models::finetune::LoraConfig;
use vramsim_models::{
    lower, zoo, Graph, Offload, OptimizerKind, Parallel, Precision, Recipe, Shard,
};
use vramsim_traces::Category;

/// `stage3_param_persistence_threshold`'s default.
const PERSIST: u64 = 100_000;
/// The IPG buffer: `reduce_bucket_size` 5e8 elements of bf16.
const IPG_BYTES: u64 = 1_000_000_000;

fn recipe(n: u32, shard: Shard) -> Recipe {
    Recipe {
        parallel: Parallel {
            dp: n,
            shard,
            ..Parallel::default()
        },
        precision: Precision::Bf16,
        optimizer: OptimizerKind::AdamW,
        ..Recipe::new(1, 128)
    }
}

fn numel(p: &vramsim_models::graph::Param) -> u64 {
    p.shape.iter().product()
}

/// Σ⌈numel/N⌉ over the parameters `keep` selects.
fn partitions(g: &Graph, n: u64, keep: impl Fn(&vramsim_models::graph::Param) -> bool) -> u64 {
    g.params
        .iter()
        .filter(|p| keep(p))
        .map(|p| numel(p).div_ceil(n))
        .sum()
}

/// Bytes of the persistent parameters held whole (aligned to N), bf16.
fn persistent_whole(g: &Graph, n: u64) -> u64 {
    2 * g
        .params
        .iter()
        .filter(|p| numel(p) <= PERSIST)
        .map(|p| numel(p).div_ceil(n) * n)
        .sum::<u64>()
}

/// GPT-2 with its embeddings and first six blocks frozen; TinyLlama with PEFT LoRA (r=8 on
/// q_proj, v_proj) in the model's dtype.
fn cases(shard: Shard, n: u32) -> Vec<(String, Recipe)> {
    let mut a = recipe(n, shard);
    a.freeze = ["transformer.wte", "transformer.wpe", "transformer.h.0-5"]
        .map(String::from)
        .to_vec();
    let mut b = recipe(n, shard);
    b.lora = Some(
        "r=8,targets=q_proj,v_proj,dtype=model"
            .parse::<LoraConfig>()
            .unwrap(),
    );
    vec![("gpt2".into(), a), ("tinyllama-1.1b".into(), b)]
}

/// ZeRO-3 with frozen parameters, after the second backward (before the step).
#[test]
fn zero3_partitions_frozen_parameters_but_keeps_states_of_trainable_ones() {
    for n in [4u64, 8] {
        for (name, r) in cases(Shard::Zero3, n as u32) {
            let g = zoo::build(&name, &r).unwrap();
            let all = partitions(&g, n, |_| true);
            let train = partitions(&g, n, |p| p.trainable);
            assert!(train < all / 2, "{name}: a frozen majority");
            let t = lower(&g, &r).unwrap();
            let live = live_at_phase(&t, "optimizer", 1);
            let get = |c| live.get(&c).copied().unwrap_or(0);
            let at = format!("{name} N={n}");
            assert_eq!(
                get(Category::Parameter),
                2 * all + persistent_whole(&g, n),
                "{at}"
            );
            assert_eq!(get(Category::Gradient), 2 * train, "{at}");
            assert_eq!(get(Category::OptimizerState), 12 * train, "{at}");
            assert_eq!(get(Category::Communication), IPG_BYTES, "{at}");
        }
    }
}

/// A fine-tuning recipe whose graph has every parameter trainable lowers exactly as plain
/// ZeRO-3 does (the frozen-parameter rules change nothing when nothing is frozen).
#[test]
fn zero3_finetune_with_nothing_frozen_equals_zero3() {
    for offload in [Offload::None, Offload::Optimizer, Offload::Params] {
        let mut plain = recipe(4, Shard::Zero3);
        plain.parallel.offload = offload;
        let mut ft = plain.clone();
        ft.freeze = vec!["transformer.wte".into()];
        let base = zoo::build("gpt2", &plain).unwrap();
        let mut g = zoo::build("gpt2", &ft).unwrap();
        assert!(g.params.iter().any(|p| !p.trainable));
        g.params.iter_mut().for_each(|p| p.trainable = true);
        assert_eq!(
            lower(&g, &ft).unwrap(),
            lower(&base, &plain).unwrap(),
            "{offload}"
        );
    }
}

/// ZeRO-3 with frozen parameters and CPU offload, after the second backward.
#[test]
fn zero3_offload_with_frozen_parameters() {
    let n = 8u64;
    for offload in [Offload::Optimizer, Offload::Params] {
        for (name, mut r) in cases(Shard::Zero3, n as u32) {
            r.parallel.offload = offload;
            let g = zoo::build(&name, &r).unwrap();
            let on_gpu = match offload {
                Offload::Params => partitions(&g, n, |p| !p.trainable && numel(p) <= PERSIST),
                _ => partitions(&g, n, |_| true),
            };
            let t = lower(&g, &r).unwrap();
            let live = live_at_phase(&t, "optimizer", 1);
            let get = |c| live.get(&c).copied().unwrap_or(0);
            let at = format!("{name} {offload}");
            assert_eq!(
                get(Category::Parameter),
                2 * on_gpu + persistent_whole(&g, n),
                "{at}"
            );
            assert_eq!(get(Category::Gradient), 0, "{at}");
            assert_eq!(get(Category::OptimizerState), 0, "{at}");
            assert_eq!(get(Category::Communication), IPG_BYTES, "{at}");
        }
    }
}

/// ZeRO-2 with `offload_optimizer` (`stage_1_and_2.py` flattens `trainable_parameters` into
/// `bit16_groups_flat`, padded to 2N; the frozen ones stay the module's 16-bit parameters; the
/// GPU staging buffer `temp_grad_buffer_for_gpu_offload` is the largest trainable parameter) and
/// FSDP2 with `CPUOffloadPolicy` (every shard on the host, frozen or not), between steps.
#[test]
fn zero2_and_fsdp2_offload_with_frozen_parameters() {
    let n = 4u64;
    for (name, mut r) in cases(Shard::Zero2, n as u32) {
        r.parallel.offload = Offload::Optimizer;
        let g = zoo::build(&name, &r).unwrap();
        let total: u64 = g.params.iter().map(numel).sum();
        let train: u64 = g.params.iter().filter(|p| p.trainable).map(numel).sum();
        let largest = g
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(numel)
            .max()
            .unwrap();
        let padded = train.div_ceil(2 * n) * 2 * n;
        let t = lower(&g, &r).unwrap();
        let live = live_at_phase(&t, "optimizer", 1);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(
            get(Category::Parameter),
            2 * (total - train + padded),
            "{name}"
        );
        assert_eq!(get(Category::Gradient), 0, "{name}");
        assert_eq!(get(Category::OptimizerState), 0, "{name}");
        assert_eq!(get(Category::Communication), 2 * largest, "{name}");
    }
    for (name, mut r) in cases(Shard::Fsdp2, n as u32) {
        r.parallel.offload = Offload::Params;
        let g = zoo::build(&name, &r).unwrap();
        let t = lower(&g, &r).unwrap();
        for nth in [0, 1] {
            let live = live_at_phase(&t, "optimizer", nth);
            for c in [
                Category::Parameter,
                Category::Gradient,
                Category::OptimizerState,
                Category::Communication,
            ] {
                assert_eq!(live.get(&c).copied().unwrap_or(0), 0, "{name} {nth} {c:?}");
            }
        }
    }
}

/// PEFT's float32 adapters (`autocast_adapter_dtype=True`, the default) under ZeRO-3: the engine
/// casts no parameter of a `zero.Init` model (`engine.py` `_cast_module_mixed_precision` skips
/// `is_zero_init_model`), so the adapters' partitions stay float32 beside the bf16 frozen ones.
/// By hand from `stage3.py`: `lp_param_buffer` is the trainable partitions' dtype, float32
/// (4Ψ'_a); `_create_fp32_partitions` makes no master copy of a flat group already in float32
/// on the device (it is its own master); `grad_partitions_flat_buffer` is in the
/// gradient-accumulation dtype, the model's (`engine.py` `get_data_types`: 2Ψ'_a); Adam's two
/// moments 8Ψ'_a: 14 bytes per trainable element instead of bf16's 16. Frozen partitions 2Ψ'_f;
/// the persistent parameters whole in their own dtype (the adapters' A and B, ≤ 1e5 elements:
/// 4 bytes each). TinyLlama, LoRA r 8 on `q_proj`/`v_proj`, N = 8, after the second backward;
/// with `--offload optimizer` the gradients and moments leave the GPU.
#[test]
fn zero3_keeps_pefts_float32_adapters_in_float32() {
    let n = 8u64;
    for offload in [Offload::None, Offload::Optimizer] {
        let mut r = recipe(n as u32, Shard::Zero3);
        r.parallel.offload = offload;
        r.lora = Some("r=8,targets=q_proj,v_proj".parse::<LoraConfig>().unwrap());
        let g = zoo::build("tinyllama-1.1b", &r).unwrap();
        let adapters = partitions(&g, n, |p| p.trainable);
        assert_eq!(
            adapters,
            22 * 8 * (2048 + 2048 + 2048 + 256) / n,
            "Ψ_a = 22 × 8 × (2048 + 2048 + 2048 + 256), each divisible by 8"
        );
        let frozen = partitions(&g, n, |p| !p.trainable);
        let whole = |p: &vramsim_models::graph::Param| numel(p).div_ceil(n) * n;
        let persistent: u64 = g
            .params
            .iter()
            .filter(|p| numel(p) <= PERSIST)
            .map(|p| if p.trainable { 4 } else { 2 } * whole(p))
            .sum();
        let t = lower(&g, &r).unwrap();
        let live = live_at_phase(&t, "optimizer", 1);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        let (grads, state) = match offload {
            Offload::None => (2 * adapters, 8 * adapters),
            _ => (0, 0),
        };
        assert_eq!(
            get(Category::Parameter),
            2 * frozen + 4 * adapters + persistent,
            "{offload}"
        );
        assert_eq!(get(Category::Gradient), grads, "{offload}");
        assert_eq!(get(Category::OptimizerState), state, "{offload}");
        assert_eq!(get(Category::Communication), IPG_BYTES, "{offload}");
        // `_all_gather_coalesced` gathers each dtype through its own flat buffer: a prefetch
        // spanning a base weight and a non-persistent adapter (r 64 on the MLP: B of 5632 × 64
        // elements > 1e5) makes two where the adapters in the model's dtype make one.
        let flats = |spec: &str| {
            let mut r = r.clone();
            r.lora = Some(spec.parse::<LoraConfig>().unwrap());
            let t = lower(&zoo::build("tinyllama-1.1b", &r).unwrap(), &r).unwrap();
            t.events
                .iter()
                .filter(|e| {
                    matches!(e, vramsim_traces::Event::Alloc { tag: Some(x), .. }
                        if &**x == "allgather_coalesced_flat")
                })
                .count()
        };
        let (fp32, model) = (
            flats("r=64,targets=up_proj"),
            flats("r=64,targets=up_proj,dtype=model"),
        );
        assert!(fp32 > model, "{offload}: {fp32} flat buffers, {model}");
    }
}

/// What stays refused: nn.DataParallel with frozen parameters.
#[test]
fn dataparallel_with_frozen_parameters_is_refused() {
    let mut r = recipe(2, Shard::DataParallel);
    r.precision = Precision::Fp32;
    r.freeze = vec!["transformer.wte".into()];
    let e = r.validate().unwrap_err().to_string();
    assert!(e.contains("--shard dataparallel"), "{e}");
    assert!(e.contains("zero3"), "{e}: the modelled list names zero3");
}

/// How many times `tag` is allocated between the `nth` markers of `from` and `to`.
fn allocs_between(
    t: &vramsim_traces::Trace,
    tag: &str,
    from: (&str, usize),
    to: (&str, usize),
) -> usize {
    let (a, b) = (
        common::phase_index(t, from.0, from.1),
        common::phase_index(t, to.0, to.1),
    );
    t.events[a..b]
        .iter()
        .filter(|e| matches!(e, vramsim_traces::Event::Alloc { tag: Some(x), .. } if &**x == tag))
        .count()
}

/// ZeRO-3 fetches a submodule's parameters whatever their `requires_grad`
/// (`fetch_sub_module` over `iter_params(module, recurse=False)`): a frozen weight is all-gathered
/// for the forward, and for the backward only when autograd reaches its module (the pre-backward
/// hook rides on the module's outputs that require grad): a LoRA layer's frozen base weight is
/// gathered again for the input's gradient, a frozen prefix's weight is not. The first iteration
/// records the trace, so every parameter is released after its submodule (`release_sub_module`
/// without a complete trace) and each use is a gather.
#[test]
fn zero3_gathers_frozen_weights_where_forward_and_backward_use_them() {
    let n = 4u32;
    let cs = cases(Shard::Zero3, n);
    // (case, a frozen weight, gathered in the backward)
    for ((name, r), weight, in_backward) in [
        (&cs[0], "transformer.h.0.attn.c_attn.weight", false),
        (&cs[1], "model.layers.3.self_attn.q_proj.weight", true),
    ] {
        let g = zoo::build(name, r).unwrap();
        let p = g
            .params
            .iter()
            .find(|p| p.name == weight)
            .unwrap_or_else(|| panic!("{name}: no {weight}"));
        assert!(!p.trainable, "{weight}");
        let t = lower(&g, r).unwrap();
        let tag = format!("{weight}:gathered");
        let fwd = allocs_between(&t, &tag, ("forward", 0), ("backward", 0));
        let bwd = allocs_between(&t, &tag, ("backward", 0), ("optimizer", 0));
        assert_eq!(fwd, 1, "{name}: forward gathers {weight}");
        assert_eq!(
            bwd,
            usize::from(in_backward),
            "{name}: backward gathers {weight}"
        );
    }
}

/// The sweep's shortcuts hold with frozen parameters under ZeRO-3 and offload: the compact
/// lowering of six accumulated micro-batches expands to the full one, and the batch template
/// fitted at batches 2 and 3 gives the fresh lowering at 4 and 7.
#[test]
fn zero3_and_offload_finetuning_lower_compactly_and_by_template() {
    use vramsim_models::compact::lower_compact;
    use vramsim_models::template::BatchTemplate;
    for (shard, offload) in [
        (Shard::Zero3, Offload::None),
        (Shard::Zero3, Offload::Optimizer),
        (Shard::Zero3, Offload::Params),
        (Shard::Zero2, Offload::Optimizer),
        (Shard::Fsdp2, Offload::Params),
    ] {
        let mut all = cases(shard, 4);
        if shard == Shard::Zero3 {
            // PEFT's float32 adapters beside the bf16 frozen weights.
            let mut r = recipe(4, shard);
            r.lora = Some("r=8,targets=q_proj,v_proj".parse::<LoraConfig>().unwrap());
            all.push(("tinyllama-1.1b".into(), r));
        }
        for (name, r) in all {
            let at = format!("{name} {shard} {offload} {:?}", r.lora);
            let with = |batch: u64, accum: u32| {
                let mut r = r.clone();
                r.parallel.offload = offload;
                r.batch = batch;
                r.seq = 64;
                r.accum = accum;
                r
            };
            let r6 = with(1, 6);
            let g = zoo::build(&name, &r6).unwrap();
            let full = lower(&g, &r6).unwrap();
            assert!(lower_compact(&g, &r6).unwrap().expand() == full, "{at}");
            let lowered = |batch: u64| {
                let r = with(batch, 1);
                lower_compact(&zoo::build(&name, &r).unwrap(), &r).unwrap()
            };
            let t = BatchTemplate::fit(&lowered(2), 2, &lowered(3), 3)
                .unwrap_or_else(|| panic!("{at}: no template"));
            for batch in [4, 7] {
                assert!(
                    t.instantiate(batch).unwrap().same_as(&lowered(batch)),
                    "{at} batch {batch}"
                );
            }
        }
    }
}
