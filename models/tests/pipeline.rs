//! Pipeline parallelism per rank (`--pp`), against the schedules' own rules (PyTorch 2.15
//! `torch/distributed/pipelining/schedules.py`), never against vramsim's output: the number of
//! micro-batches whose activations a rank holds at once is the schedule's in-flight count
//! (1F1B: `min(m, pp − stage)`, GPipe: `m`, interleaved: PyTorch's warm-up + 1), times one
//! micro-batch's activations of that stage, measured on a lowering of the same stage that runs a
//! single micro-batch.

mod common;
use common::{live_at_phase, max_live};
use std::collections::HashMap;

use vramsim_models::pipeline::{self, rank_graph};
use vramsim_models::{lower, zoo, Parallel, PpLoop, PpSchedule, Precision, Recipe};
use vramsim_traces::{Category, Event, Trace};

fn recipe(batch: u64, seq: u64, pp: u32, schedule: PpSchedule, m: u32, rank: u32) -> Recipe {
    Recipe {
        precision: Precision::Bf16,
        parallel: Parallel {
            pp,
            pp_schedule: schedule,
            microbatches: Some(m),
            stage: rank,
            ..Parallel::default()
        },
        ..Recipe::new(batch, seq)
    }
}

/// The trace of pipeline rank `rank`.
fn lower_rank(name: &str, r: &Recipe) -> Trace {
    let mut gr = r.clone();
    gr.batch = r.parallel.replica_batch(r.batch);
    let g = zoo::build(name, &gr).expect("builds");
    let h = rank_graph(&g, &r.parallel).expect("splits");
    lower(&h, r).expect("lowers")
}

/// Why `rank_graph` refuses `g` under `r`.
fn refusal(g: &vramsim_models::Graph, r: &Recipe) -> String {
    match rank_graph(g, &r.parallel) {
        Ok(_) => panic!("{}: not refused", g.name),
        Err(e) => e.to_string(),
    }
}

/// The most allocations whose tag starts with `prefix` live at once, and their bytes then.
fn max_live_tagged(t: &Trace, prefix: &str) -> (usize, u64) {
    let mut live: HashMap<String, u64> = HashMap::new();
    let mut best = (0usize, 0u64);
    for e in &t.events {
        match e {
            Event::Alloc { id, size, tag, .. }
                if tag.as_deref().is_some_and(|x| x.starts_with(prefix)) =>
            {
                live.insert(id.to_string(), *size);
                let bytes: u64 = live.values().sum();
                if live.len() > best.0 {
                    best = (live.len(), bytes);
                }
            }
            Event::Free { id } => {
                live.remove(&id.to_string());
            }
            _ => {}
        }
    }
    best
}

/// Bytes of one micro-batch's hidden state (batch 1 × seq × hidden, bf16): what a stage sends
/// and the next receives, by hand.
fn hidden_bytes(seq: u64, hidden: u64) -> u64 {
    seq * hidden * 2
}

/// 1F1B keeps `min(m, pp − stage)` micro-batches' saved activations on each stage, GPipe `m`;
/// one micro-batch's activations of a stage measured on the same stage running one micro-batch.
/// Besides the saved activations, a non-last stage holds the outputs whose sends are not waited
/// for yet (`Schedule1F1B`: the previous warm-up forward's until after the next forward: two at
/// the end of a warm-up forward; GPipe: every forward's until the last), and the last stage every
/// earlier micro-batch's fp32 loss (`_internal_losses`) and, through each loss's `grad_fn` chain
/// (the input leaf's `AccumulateGrad` node), its received hidden state.
#[test]
fn in_flight_activations_follow_the_schedule() {
    let (pp, m, seq, hidden) = (4u32, 8u32, 128u64, 768u64);
    let out = hidden_bytes(seq, hidden);
    for rank in 0..pp {
        let last = rank + 1 == pp;
        let one = lower_rank("gpt2", &recipe(1, seq, pp, PpSchedule::GPipe, 1, rank));
        // One micro-batch: its saved activations and, on a non-last stage, its output.
        let a1 = max_live(&one, Category::Activation);
        let saved1 = if last { a1 } else { a1 - out };
        // 1F1B: warm-up min(m, pp − stage) (`Schedule1F1B._step_microbatches`).
        let w = u64::from(m.min(pp - rank));
        let t = lower_rank(
            "gpt2",
            &recipe(u64::from(m), seq, pp, PpSchedule::OneFOneB, m, rank),
        );
        let peak = max_live(&t, Category::Activation);
        let (sends, losses) = if last {
            (0, u64::from(m - 1) * (4 + out))
        } else {
            (w.min(2) * out, 0)
        };
        assert_eq!(peak - sends - losses, w * saved1, "1F1B stage {rank}");
        // GPipe: every forward before any backward, every output until the last forward.
        let t = lower_rank(
            "gpt2",
            &recipe(u64::from(m), seq, pp, PpSchedule::GPipe, m, rank),
        );
        let peak = max_live(&t, Category::Activation);
        let sends = if last { 0 } else { u64::from(m) * out };
        assert_eq!(peak - sends, u64::from(m) * saved1, "GPipe stage {rank}");
    }
}

/// The first stage holds the embeddings and no receive buffer; the last the final norm, the
/// head (tied to the embeddings in GPT-2: its own copy on that stage) and the loss; the middle
/// stages only their layers. torchtitan's split of 12 layers over 4 stages: 3, 4, 3, 2.
#[test]
fn stages_hold_their_layers() {
    let g = zoo::build("gpt2", &Recipe::new(1, 64)).unwrap();
    let names = |rank: u32| -> Vec<String> {
        let r = recipe(4, 64, 4, PpSchedule::OneFOneB, 4, rank);
        rank_graph(&g, &r.parallel)
            .unwrap()
            .params
            .iter()
            .map(|p| p.name.clone())
            .collect()
    };
    let layers = |ps: &[String]| -> Vec<String> {
        let mut l: Vec<String> = ps
            .iter()
            .filter_map(|n| {
                n.strip_prefix("transformer.h.")
                    .and_then(|x| x.split('.').next())
                    .map(String::from)
            })
            .collect();
        l.dedup();
        l
    };
    let p0 = names(0);
    assert!(
        p0.iter().any(|n| n == "transformer.wte.weight")
            && p0.iter().any(|n| n == "transformer.wpe.weight")
    );
    assert_eq!(layers(&p0), ["0", "1", "2"]);
    let p1 = names(1);
    assert_eq!(layers(&p1), ["3", "4", "5", "6"]);
    assert!(!p1.iter().any(|n| n.contains("wte") || n.contains("ln_f")));
    let p3 = names(3);
    assert_eq!(layers(&p3), ["10", "11"]);
    assert!(p3.iter().any(|n| n == "transformer.ln_f.weight"));
    assert!(
        p3.iter()
            .any(|n| n.contains("wte") || n.contains("lm_head")),
        "{p3:?}"
    );
    // The last stage computes the loss: its graph's output is the model's.
    let r = recipe(4, 64, 4, PpSchedule::OneFOneB, 4, 3);
    assert_eq!(rank_graph(&g, &r.parallel).unwrap().output, g.output);
}

/// A non-first stage allocates one receive buffer per micro-batch in flight (`_RecvInfo.
/// allocate_buffer` before each forward receive, kept as the stage input until its backward;
/// on the last stage until the step ends, held by the micro-batch's loss through its leaf's
/// `AccumulateGrad` node: all `m`), and one buffer for each received output gradient; the first
/// stage none.
#[test]
fn receive_buffers_per_micro_batch() {
    let (pp, m, seq) = (4u32, 8u32, 64u64);
    for rank in 0..pp {
        let r = recipe(u64::from(m), seq, pp, PpSchedule::OneFOneB, m, rank);
        assert_eq!(r.iterations, 2);
        let t = lower_rank("gpt2", &r);
        let (n, bytes) = max_live_tagged(&t, "pp_recv_activation");
        let w = if rank + 1 == pp { m } else { m.min(pp - rank) };
        if rank == 0 {
            assert_eq!(n, 0);
        } else {
            assert_eq!(
                (n as u32, bytes),
                (w, u64::from(w) * hidden_bytes(seq, 768)),
                "stage {rank}"
            );
        }
        let grads = t
            .events
            .iter()
            .filter(
                |e| matches!(e, Event::Alloc { tag: Some(x), .. } if x.starts_with("pp_recv_grad")),
            )
            .count() as u32;
        // One per micro-batch of each of the recipe's iterations.
        let per_step = if rank + 1 == pp { 0 } else { m * 2 };
        assert_eq!(grads, per_step, "stage {rank}");
    }
}

/// `ScheduleInterleaved1F1B`: rank r runs `min((V − 1)·mpr + 2(pp − 1 − r), m·V)` warm-up
/// forwards and then a forward before each backward, over its V stages (1 and 3 of 4 for rank 1
/// of pp 2 × V 2): the forwards begun and not yet backwarded, read off the trace's phase markers,
/// peak at that count plus one, and each of them holds its received activation (the runtime posts
/// receives ahead of their forwards, so there can be more buffers, never fewer).
#[test]
fn interleaved_in_flight_count() {
    let (pp, v, m, seq) = (2u32, 2u32, 4u32, 64u64);
    for rank in 0..pp {
        let r = recipe(u64::from(m), seq, pp, PpSchedule::Interleaved(v), m, rank);
        let t = lower_rank("gpt2", &r);
        let mpr = m / (m / pp).max(1);
        let warmup = ((v - 1) * mpr + 2 * (pp - 1 - rank)).min(m * v);
        let expect = if warmup < m * v { warmup + 1 } else { warmup };
        // One step's forwards and backwards (the recipe runs two).
        let (mut now, mut max) = (0i64, 0i64);
        for e in &t.events {
            if let Event::Phase { name } = e {
                match &**name {
                    "forward" => now += 1,
                    "backward" => now -= 1,
                    "optimizer" => break,
                    _ => {}
                }
                max = max.max(now);
            }
        }
        assert_eq!(max as u32, expect, "rank {rank}");
        if rank > 0 {
            assert!(max_live_tagged(&t, "pp_recv_activation").0 as u32 >= expect);
        }
        let g = zoo::build("gpt2", &recipe(1, seq, 1, PpSchedule::OneFOneB, 1, 0)).unwrap();
        let stages: Vec<u32> = pipeline::chunks(&rank_graph(&g, &r.parallel).unwrap())
            .iter()
            .map(|c| c.stage)
            .collect();
        assert_eq!(stages, [rank, rank + 2]);
    }
}

/// Llama (rotary tables recomputed on every stage from `x.to(hidden.dtype)`) and BERT (the
/// extended attention mask recomputed) split and lower; a graph without blocks marked is refused
/// with the reason, as are more stages than layers.
#[test]
fn families_split_or_are_refused() {
    for name in ["tinyllama-1.1b", "bert-base", "gpt2-medium"] {
        for rank in 0..2 {
            let t = lower_rank(name, &recipe(4, 64, 2, PpSchedule::OneFOneB, 4, rank));
            assert!(t.events.len() > 100, "{name}");
        }
    }
    // A graph without blocks marked (a captured module without them).
    let mut g = zoo::build("gpt2", &Recipe::new(1, 64)).unwrap();
    g.regions.clear();
    let r = recipe(4, 64, 2, PpSchedule::OneFOneB, 4, 0);
    let e = refusal(&g, &r);
    assert!(e.contains("no stack of repeated blocks"), "{e}");
    // More stages than layers.
    let g = zoo::build("gpt2", &Recipe::new(1, 64)).unwrap();
    let r = recipe(16, 64, 13, PpSchedule::GPipe, 16, 0);
    let e = refusal(&g, &r);
    assert!(e.contains("13 stages for 12 layers"), "{e}");
}

/// The schedules' own checks on the micro-batches, with their messages.
#[test]
fn micro_batch_checks() {
    let check = |batch: u64, pp: u32, s: PpSchedule, m: Option<u32>| {
        let r = Recipe {
            parallel: Parallel {
                pp,
                pp_schedule: s,
                microbatches: m,
                ..Parallel::default()
            },
            ..Recipe::new(batch, 64)
        };
        r.validate().map_err(|e| e.to_string())
    };
    assert!(check(8, 2, PpSchedule::OneFOneB, None).is_ok());
    assert!(check(8, 2, PpSchedule::OneFOneB, Some(3))
        .unwrap_err()
        .contains("must divide the batch"));
    assert!(check(2, 4, PpSchedule::OneFOneB, None)
        .unwrap_err()
        .contains("greater than or equal to the number of stages"));
    assert!(check(2, 4, PpSchedule::GPipe, None).is_ok());
    // 12 micro-batches over pp 8: rounds 1 → fine; 10 over 4: rounds 2 → fine; 9 over 4: rounds 2 → refused.
    assert!(check(10, 4, PpSchedule::Interleaved(2), None).is_ok());
    assert!(check(9, 4, PpSchedule::Interleaved(2), None)
        .unwrap_err()
        .contains("multiple of the number of rounds (2)"));
}

/// Every allocation of the step but the model states is freed by its end: nothing of a
/// micro-batch outlives its backward (the graph of each is released on its own).
#[test]
fn step_frees_its_micro_batches() {
    for sched in [
        PpSchedule::OneFOneB,
        PpSchedule::GPipe,
        PpSchedule::Interleaved(2),
    ] {
        for rank in 0..2 {
            let mut r = recipe(4, 64, 2, sched, 4, rank);
            r.iterations = 2;
            let t = lower_rank("gpt2", &r);
            let mut live: HashMap<String, Category> = HashMap::new();
            for e in &t.events {
                match e {
                    Event::Alloc { id, category, .. } => {
                        live.insert(id.to_string(), *category);
                    }
                    Event::Free { id } => {
                        live.remove(&id.to_string());
                    }
                    _ => {}
                }
            }
            let left: Vec<Category> = live
                .values()
                .copied()
                .filter(|c| {
                    !matches!(
                        c,
                        Category::Parameter | Category::OptimizerState | Category::Gradient
                    )
                })
                .collect();
            assert!(left.is_empty(), "{sched} rank {rank}: {left:?}");
        }
    }
}

/// `--pp` with `--tp [--sp]`: each stage is cut from the tensor-parallel rank's graph. Its
/// parameters are, by hand, the TP shards of its layers (TinyLlama, t = 2: q `[h/t·…]`, k and v
/// `[kv·d/t, h]`, o `[h, h/t]`, gate and up `[I/t, h]`, down `[h, I/t]`, both RMSNorms whole),
/// the first stage's vocabulary-parallel embedding `[Vp/t, h]` and the last stage's final norm and
/// head `[Vp/t, h]` (Vp: 32000 padded to a multiple of 128·t, `calculate_padded_vocab_size`); the
/// activation a stage receives per micro-batch is one hidden state, its sequence shard `s/t` with
/// `--sp` (Megatron sends `[s/t, b, h]`: `get_tensor_shapes`, `pipeline_parallel/schedules.py`).
#[test]
fn tensor_parallel_stages() {
    let (h, inter, heads, kv, vocab, layers) = (2048u64, 5632u64, 32u64, 4u64, 32000u64, 22u64);
    let d = h / heads;
    let (t, pp, m, seq) = (2u64, 2u32, 4u32, 128u64);
    let vp = vocab.div_ceil(128 * t) * 128 * t;
    let layer = h * (heads / t) * d
        + 2 * h * (kv / t) * d
        + (heads / t) * d * h
        + 3 * h * (inter / t)
        + 2 * h;
    // torchtitan's split of 22 layers over 2 stages: 24 effective, 12 each: 11 layers + embeddings,
    // 11 layers + norm and head.
    let per = (layers + 2) / 2 - 1;
    let expect = [per * layer + vp / t * h, per * layer + h + vp / t * h];
    for sp in [false, true] {
        for rank in 0..pp {
            let mut r = recipe(u64::from(m), seq, pp, PpSchedule::OneFOneB, m, rank);
            r.parallel.tp = t as u32;
            r.parallel.sp = sp;
            let mut gr = r.clone();
            gr.batch = r.parallel.replica_batch(r.batch);
            let g = zoo::build("tinyllama-1.1b", &gr).expect("builds");
            let stage = rank_graph(&g, &r.parallel).expect("splits");
            let numel: u64 = stage
                .params
                .iter()
                .map(|p| {
                    stage.values[p.value.0 as usize]
                        .shape
                        .iter()
                        .product::<u64>()
                })
                .sum();
            assert_eq!(numel, expect[rank as usize], "sp {sp} stage {rank}");
            // One hidden state received per micro-batch in flight (1F1B: min(m, pp − stage)), on
            // the last stage per micro-batch of the step (each loss keeps its input leaf).
            let t_rank = lower(&stage, &r).expect("lowers");
            let (n, bytes) = max_live_tagged(&t_rank, "pp_recv_activation");
            if rank == 0 {
                assert_eq!(n, 0);
            } else {
                let s_local = if sp { seq / t } else { seq };
                let w = u64::from(if rank + 1 == pp { m } else { m.min(pp - rank) });
                assert_eq!(
                    (n as u64, bytes),
                    (w, w * hidden_bytes(s_local, h)),
                    "sp {sp}"
                );
            }
        }
    }
}

/// With `--tp 2 --sp`, 1F1B still holds `min(m, pp − stage)` micro-batches of the stage's saved
/// activations — now the tensor-parallel stage's, measured on the same TP stage running one
/// micro-batch — plus the outputs waiting for their sends, each the sequence shard
/// `s/t × h × 2` bytes by hand, and the last stage's fp32 losses with the received hidden state
/// each keeps (its leaf's `AccumulateGrad` node).
#[test]
fn tensor_parallel_in_flight_activations() {
    let (pp, m, seq, hidden, t) = (4u32, 8u32, 128u64, 768u64, 2u32);
    let out = hidden_bytes(seq / u64::from(t), hidden);
    let with_tp = |mut r: Recipe| {
        r.parallel.tp = t;
        r.parallel.sp = true;
        r
    };
    for rank in 0..pp {
        let last = rank + 1 == pp;
        let one = lower_rank(
            "gpt2",
            &with_tp(recipe(1, seq, pp, PpSchedule::GPipe, 1, rank)),
        );
        let a1 = max_live(&one, Category::Activation);
        let saved1 = if last { a1 } else { a1 - out };
        let w = u64::from(m.min(pp - rank));
        let tr = lower_rank(
            "gpt2",
            &with_tp(recipe(u64::from(m), seq, pp, PpSchedule::OneFOneB, m, rank)),
        );
        let peak = max_live(&tr, Category::Activation);
        let (sends, losses) = if last {
            (0, u64::from(m - 1) * (4 + out))
        } else {
            (w.min(2) * out, 0)
        };
        assert_eq!(
            peak - sends - losses,
            w * saved1,
            "1F1B tp {t} --sp stage {rank}"
        );
    }
}

/// FSDP2 on a pipeline stage (torchtitan with PP, PyTorch 2.15 `stage.py`
/// `backward_maybe_with_nosync` / `perform_reduce_grad`), by hand for TinyLlama split in 2 stages
/// at dp 2 (bf16, 4 micro-batches; 1F1B, and GPipe with full checkpointing): every micro-batch's backward keeps the parameters
/// unsharded and accumulates unsharded gradients, so the most gradient bytes live are the stage's
/// parameters' numel × 2 (bf16, the model's dtype: no wider `reduce_dtype`); the most parameter
/// bytes are the padded shards plus every unsharded parameter at its padded size (`⌈dim0/2⌉·2`
/// rows, all unsharded from the first forward to the reduce); one reduce-scatter per group and
/// step, after the last backward; between steps (at the next optimizer step) only the padded
/// shards, the sharded gradients and Adam's two moments (bf16) and no communication buffer.
#[test]
fn fsdp2_stage_accumulates_unsharded_gradients_and_reduces_once() {
    let n = 2u64;
    let cases = [
        (PpSchedule::OneFOneB, vramsim_models::Checkpointing::None),
        (PpSchedule::GPipe, vramsim_models::Checkpointing::Full),
    ];
    for (schedule, checkpointing, rank) in cases
        .into_iter()
        .flat_map(|(s, c)| (0..2).map(move |rank| (s, c, rank)))
    {
        let mut r = recipe(8, 64, 2, schedule, 4, rank);
        r.checkpointing = checkpointing;
        r.parallel.dp = n as u32;
        r.parallel.shard = vramsim_models::Shard::Fsdp2;
        r.iterations = 2;
        let mut gr = r.clone();
        gr.batch = r.parallel.replica_batch(r.batch);
        let g = zoo::build("tinyllama-1.1b", &gr).expect("builds");
        let h = rank_graph(&g, &r.parallel).expect("splits");
        let numel: u64 = h
            .params
            .iter()
            .map(|p| p.shape.iter().product::<u64>())
            .sum();
        let shard = |s: &[u64]| match s.split_first() {
            Some((d0, rest)) => d0.div_ceil(n) * rest.iter().product::<u64>(),
            None => 1,
        };
        let shards: u64 = h.params.iter().map(|p| shard(&p.shape)).sum();
        let t = lower(&h, &r).expect("lowers");
        assert_eq!(
            max_live(&t, Category::Gradient),
            2 * numel,
            "{schedule:?} stage {rank}"
        );
        assert_eq!(
            max_live(&t, Category::Parameter),
            2 * shards + 2 * n * shards,
            "{schedule:?} stage {rank}"
        );
        let blocks = h
            .regions
            .iter()
            .filter(|x| x.kind == vramsim_models::RegionKind::Block)
            .count();
        let reduces = t
            .events
            .iter()
            .filter(|e| {
                matches!(e, Event::Alloc { tag, .. }
                    if tag.as_deref().is_some_and(|x| x.starts_with("fsdp_reduce_scatter_input")))
            })
            .count();
        // Each block and the stage's root (its embedding or norm + head) once per step.
        assert_eq!(reduces, 2 * (blocks + 1), "{schedule:?} stage {rank}");
        let live = live_at_phase(&t, "optimizer", 1);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(
            get(Category::Parameter),
            2 * shards,
            "{schedule:?} stage {rank}"
        );
        assert_eq!(
            get(Category::Gradient),
            2 * shards,
            "{schedule:?} stage {rank}"
        );
        assert_eq!(
            get(Category::OptimizerState),
            4 * shards,
            "{schedule:?} stage {rank}"
        );
        assert_eq!(get(Category::Communication), 0, "{schedule:?} stage {rank}");
    }
}

/// A TinyLlama pipeline rank under FSDP2 at dp `n` (`r` already has its schedule), with the rank's
/// graph: its parameters' numel, their padded shards' numel (`⌈dim0/n⌉` rows), its blocks, and
/// the lowered trace.
fn fsdp_rank(r: &Recipe, n: u64) -> (u64, u64, usize, Trace) {
    let mut r = r.clone();
    r.parallel.dp = n as u32;
    r.parallel.shard = vramsim_models::Shard::Fsdp2;
    let mut gr = r.clone();
    gr.batch = r.parallel.replica_batch(r.batch);
    let g = zoo::build("tinyllama-1.1b", &gr).expect("builds");
    let h = rank_graph(&g, &r.parallel).expect("splits");
    let numel: u64 = h
        .params
        .iter()
        .map(|p| p.shape.iter().product::<u64>())
        .sum();
    let shard = |s: &[u64]| match s.split_first() {
        Some((d0, rest)) => d0.div_ceil(n) * rest.iter().product::<u64>(),
        None => 1,
    };
    let shards: u64 = h.params.iter().map(|p| shard(&p.shape)).sum();
    let blocks = h
        .regions
        .iter()
        .filter(|x| x.kind == vramsim_models::RegionKind::Block)
        .count();
    let t = lower(&h, &r).expect("lowers");
    (numel, shards, blocks, t)
}

/// The allocations whose tag starts with `prefix`: their count and sizes.
fn tagged_sizes(t: &Trace, prefix: &str) -> Vec<u64> {
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
        .collect()
}

/// torchtitan's FSDP2 + PP recipe: an fp32 model with `MixedPrecisionPolicy(param_dtype=bf16,
/// reduce_dtype=fp32)`, and with `param_dtype=bf16` alone, by hand from PyTorch 2.15's rules for
/// TinyLlama split in 2 stages at dp 2 (4 micro-batches, 2 steps). The unsharded parameter's
/// `grad_dtype` is `unsharded_grad_dtype` (`_fsdp_param.py` `init_unsharded_param`: the reduce
/// dtype, else the model's, fp32 both times), wider than the bf16 compute: with
/// `reduce_grads` off (`stage.py` `backward_maybe_with_nosync`), `pre_backward`'s
/// `_set_unsharded_grad_dtypes(defer_upcast=True)` keeps it for the first micro-batch, so the
/// engine casts that gradient to fp32 and every later one is added in place: every stored
/// gradient is fp32 (4 bytes × the parameter's numel), the most gradient bytes are 4 × the
/// stage's numel; parameters: the fp32 padded shards plus the bf16 unsharded parameters (padded);
/// the reduce-scatter runs in fp32 (`_get_reduce_dtype`: the reduce dtype, else the promotion of
/// the `unsharded_grad_dtype`s), once per group and step, input 4 bytes × the group's padded
/// numel, output the fp32 sharded gradient with no cast (the model's dtype); at the second
/// optimizer step the fp32 shards, their fp32 gradients and AdamW's two fp32 moments.
#[test]
fn fsdp2_stage_mixed_precision_accumulates_in_the_reduce_dtype() {
    use vramsim_models::DType;
    let n = 2u64;
    let cases = [
        (PpSchedule::OneFOneB, Some(DType::F32)),
        (PpSchedule::GPipe, None),
    ];
    for (schedule, reduce) in cases {
        for rank in 0..2 {
            let mut r = recipe(8, 64, 2, schedule, 4, rank);
            r.precision = Precision::Fp32;
            r.iterations = 2;
            r.parallel.fsdp_param_dtype = Some(DType::BF16);
            r.parallel.fsdp_reduce_dtype = reduce;
            let (numel, shards, blocks, t) = fsdp_rank(&r, n);
            let what = format!("{schedule:?} reduce {reduce:?} stage {rank}");
            assert_eq!(max_live(&t, Category::Gradient), 4 * numel, "{what}");
            assert_eq!(
                max_live(&t, Category::Parameter),
                4 * shards + 2 * n * shards,
                "{what}"
            );
            // Each stored unsharded gradient is the fp32 cast of the first micro-batch's.
            let grads = tagged_sizes(&t, "grad:");
            assert_eq!(grads.iter().sum::<u64>(), 2 * 4 * numel, "{what}");
            let rs = tagged_sizes(&t, "fsdp_reduce_scatter_input");
            assert_eq!(rs.len(), 2 * (blocks + 1), "{what}");
            assert_eq!(rs.iter().sum::<u64>(), 2 * 4 * n * shards, "{what}");
            let out = tagged_sizes(&t, "fsdp_sharded_grads");
            assert_eq!(out.iter().sum::<u64>(), 2 * 4 * shards, "{what}");
            let live = live_at_phase(&t, "optimizer", 1);
            let get = |c| live.get(&c).copied().unwrap_or(0);
            assert_eq!(get(Category::Parameter), 4 * shards, "{what}");
            assert_eq!(get(Category::Gradient), 4 * shards, "{what}");
            assert_eq!(get(Category::OptimizerState), 8 * shards, "{what}");
            assert_eq!(get(Category::Communication), 0, "{what}");
        }
    }
}

/// `--pp-schedule interleaved:2` with FSDP2 (torchtitan's `apply_fsdp` on each model part: each
/// of a rank's two stages is its own `fully_shard` root), by hand from PyTorch 2.15's
/// `_PipelineScheduleRuntime` for TinyLlama in 4 stages over pp 2 at dp 2 (bf16, 4 micro-batches,
/// 2 steps). `_add_unshard_reshard` (`max_active_stages` 3) puts an `UNSHARD` of both of a rank's
/// stages before its first action: `unshard(async_op=True)` of every group, so every group's
/// all-gather output (2 bytes × its padded numel) is live at once, n × the shards' numel × 2 bytes
/// in all, until each stage's first compute waits for its handles; each group is gathered once a
/// step. Nothing is resharded or reduced until the stage's `REDUCE_GRAD` after its last backward
/// (`_add_reduce_grad`), which reduce-scatters each of its groups once: blocks + one root per
/// stage with parameters (the first stage's embedding on rank 0, the last's norm and head on
/// rank 1; the middle stages' roots hold none). Parameters peak at the shards plus every
/// unsharded parameter, gradients at the rank's numel × 2.
#[test]
fn fsdp2_interleaved_stages_are_roots_unsharded_and_reduced_by_the_runtime() {
    let n = 2u64;
    for rank in 0..2 {
        let mut r = recipe(8, 64, 2, PpSchedule::Interleaved(2), 4, rank);
        r.iterations = 2;
        let (numel, shards, blocks, t) = fsdp_rank(&r, n);
        let what = format!("stage rank {rank}");
        let groups = blocks + 1;
        assert_eq!(
            max_live_tagged(&t, "fsdp_all_gather_output"),
            (groups, 2 * n * shards),
            "{what}"
        );
        assert_eq!(
            tagged_sizes(&t, "fsdp_all_gather_output").len(),
            2 * groups,
            "{what}"
        );
        assert_eq!(
            tagged_sizes(&t, "fsdp_reduce_scatter_input").len(),
            2 * groups,
            "{what}"
        );
        assert_eq!(max_live(&t, Category::Gradient), 2 * numel, "{what}");
        assert_eq!(
            max_live(&t, Category::Parameter),
            2 * shards + 2 * n * shards,
            "{what}"
        );
        let live = live_at_phase(&t, "optimizer", 1);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(get(Category::Parameter), 2 * shards, "{what}");
        assert_eq!(get(Category::Gradient), 2 * shards, "{what}");
        assert_eq!(get(Category::Communication), 0, "{what}");
    }
}

/// FSDP2's `CPUOffloadPolicy` on a pipeline stage (TinyLlama, 2 stages, dp 2, bf16, 1F1B, 4
/// micro-batches, 2 steps), by hand: the padded shards, their gradients and the optimizer live on
/// the host (`_init_sharded_param`, `foreach_reduce`'s `.to("cpu")`), so the GPU's parameter
/// bytes peak at the unsharded parameters alone (2 bytes × n × the shards' numel, all unsharded
/// from the step's first forward to the reduce), gradients at the accumulated unsharded ones
/// (numel × 2), and nothing of the model's states is on the GPU at the optimizer step.
#[test]
fn fsdp2_stage_with_cpu_offload_keeps_only_unsharded_states_on_the_gpu() {
    let n = 2u64;
    for rank in 0..2 {
        let mut r = recipe(8, 64, 2, PpSchedule::OneFOneB, 4, rank);
        r.iterations = 2;
        r.parallel.offload = vramsim_models::Offload::Params;
        let (numel, shards, blocks, t) = fsdp_rank(&r, n);
        let what = format!("stage {rank}");
        assert_eq!(max_live(&t, Category::Parameter), 2 * n * shards, "{what}");
        assert_eq!(max_live(&t, Category::Gradient), 2 * numel, "{what}");
        assert_eq!(
            tagged_sizes(&t, "fsdp_reduce_scatter_input").len(),
            2 * (blocks + 1),
            "{what}"
        );
        let live = live_at_phase(&t, "optimizer", 1);
        let get = |c| live.get(&c).copied().unwrap_or(0);
        assert_eq!(get(Category::Parameter), 0, "{what}");
        assert_eq!(get(Category::Gradient), 0, "{what}");
        assert_eq!(get(Category::OptimizerState), 0, "{what}");
        assert_eq!(get(Category::Communication), 0, "{what}");
    }
}

/// `interleaved:4` with FSDP2: four stages per rank, more than `_add_unshard_reshard`'s
/// `max_active_stages` (3), so the runtime's `RESHARD` evicts a stage (freeing its unsharded
/// parameters; its unsharded gradients stay) before the `UNSHARD` of the next one it fetches:
/// never more than three stages unsharded. By hand for TinyLlama (22 layers) in 8 stages over pp 2
/// at dp 2 (bf16, 8 micro-batches): torchtitan's split gives stages 0 and 7 two layers (plus the
/// embedding, resp. the norm and head), the others three; each rank's peak of parameters is its
/// shards plus the unsharded parameters of all its stages but one three-layer stage (rank 0
/// fetches stages 0, 2, 4 first; rank 1 holds 3, 5, 7 after evicting 1). A layer's numel:
/// q, o 2048², k, v 256 × 2048, gate, up, down 5632 × 2048, two norms 2048, all rows even (the
/// shard of a layer is half of it).
#[test]
fn fsdp2_interleaved_four_stages_keeps_three_unsharded() {
    let n = 2u64;
    let layer: u64 = 2 * 2048 * 2048 + 2 * 256 * 2048 + 3 * 5632 * 2048 + 2 * 2048;
    for rank in 0..2 {
        let r = recipe(8, 64, 2, PpSchedule::Interleaved(4), 8, rank);
        let (numel, shards, _, t) = fsdp_rank(&r, n);
        let evicted = 3 * layer / 2;
        assert_eq!(
            max_live(&t, Category::Parameter),
            2 * shards + 2 * n * (shards - evicted),
            "rank {rank}"
        );
        assert_eq!(max_live(&t, Category::Gradient), 2 * numel, "rank {rank}");
    }
}

/// DDP on a pipeline stage (PyTorch 2.15 `stage.py` `forward_maybe_with_nosync` /
/// `backward_maybe_with_nosync`), by hand for GPT-2 split over 2 stages (bf16, 4 micro-batches,
/// dp 2, two steps), Ψs the stage's parameter count:
/// * the Reducer's buckets hold the stage's gradient bytes, 2Ψs, from the DDP constructor on
///   (`initialize_buckets` at setup; rebuilt, same total, at the second step's first forward):
///   the closed form, bucket bytes = gradient bytes;
/// * without `gradient_as_bucket_view`, the optimizer sees 2Ψs of gradients (accumulated in
///   `.grad` under `no_sync()`, the buckets copied back in place) beside the 2Ψs of buckets;
/// * with it, the gradients accumulated under `no_sync()` are AccumulateGrad's own tensors until
///   the last micro-batch's backward, whose hooks copy each into its bucket view and re-point
///   `.grad` there (`mark_variable_ready_dense`): at most 2Ψs of gradient storage during the
///   schedule, none of their own at the optimizer.
///
/// With `interleaved:2` each of the rank's two stages is its own DDP module: the same totals over
/// the rank's parameters, made as one constructor bucket per stage.
#[test]
fn ddp_stage_buckets_hold_the_stage_gradients() {
    let cases = [
        (PpSchedule::OneFOneB, false),
        (PpSchedule::OneFOneB, true),
        (PpSchedule::Interleaved(2), false),
    ];
    for (schedule, bucket_view) in cases {
        for rank in 0..2 {
            let mut r = recipe(8, 64, 2, schedule, 4, rank);
            r.parallel.dp = 2;
            r.parallel.shard = vramsim_models::Shard::Ddp;
            r.parallel.gradient_as_bucket_view = bucket_view;
            r.iterations = 2;
            let mut gr = r.clone();
            gr.batch = r.parallel.replica_batch(r.batch);
            let g = zoo::build("gpt2", &gr).expect("builds");
            let h = rank_graph(&g, &r.parallel).expect("splits");
            let psi: u64 = h
                .params
                .iter()
                .map(|p| p.shape.iter().product::<u64>())
                .sum();
            let t = lower(&h, &r).expect("lowers");
            let at = |phase: &str, it: usize| live_at_phase(&t, phase, it);
            let get = |m: &HashMap<Category, u64>, c| m.get(&c).copied().unwrap_or(0);
            let label = format!("{schedule}, bucket view {bucket_view}, rank {rank}");
            if let PpSchedule::Interleaved(v) = schedule {
                let made = t
                    .events
                    .iter()
                    .take_while(|e| !matches!(e, Event::Phase { name } if &**name == "forward"))
                    .filter(|e| {
                        matches!(e, Event::Alloc { tag: Some(x), .. } if x.starts_with("ddp_stage"))
                    })
                    .count();
                assert_eq!(
                    made, v as usize,
                    "{label}: one constructor bucket per stage"
                );
            }
            // The constructor's bucket, before any step.
            let first_forward = at("forward", 0);
            assert_eq!(
                get(&first_forward, Category::Communication),
                2 * psi,
                "{label}"
            );
            assert_eq!(get(&first_forward, Category::Gradient), 0, "{label}");
            for it in 0..2 {
                let opt = at("optimizer", it);
                // Buckets (and, on the first stage, no receive buffer; the last stage none
                // either): the communication category is the buckets alone.
                assert_eq!(
                    get(&opt, Category::Communication),
                    2 * psi,
                    "{label} it {it}"
                );
                let grads = if bucket_view { 0 } else { 2 * psi };
                assert_eq!(get(&opt, Category::Gradient), grads, "{label} it {it}");
            }
            assert_eq!(max_live(&t, Category::Gradient), 2 * psi, "{label}");
        }
    }
}

/// torchtitan's loop (`--pp-loop torchtitan`, the default) against the plain one, by hand
/// (`torchtitan/trainer.py`): `pp_forward_backward_step` returns `torch.sum(torch.stack(losses))`
/// on the last stage, whose graph reaches every micro-batch's received activation (a bf16
/// `[1, seq, 768]` leaf per micro-batch: `M × seq × 768 × 2` B) and is itself a 0-dim fp32 (4 B);
/// `train_step` keeps it in `loss` through the optimizer step, and with `--accum 2` until the next
/// accumulation step's `loss = self.forward_backward_step(...)` rebinds it: the second schedule
/// starts holding the first's, and the optimizer step holds only the second's. Every other rank
/// keeps a one-element fp32 `torch.tensor([-1.0])` (4 B).
#[test]
fn torchtitan_loop_keeps_the_losses_through_the_optimizer_step() {
    let (m, seq) = (4u32, 64u64);
    for rank in 0..2 {
        let mut r = recipe(4, seq, 2, PpSchedule::OneFOneB, m, rank);
        r.accum = 2;
        assert_eq!(r.parallel.pp_loop, PpLoop::Torchtitan, "the default loop");
        let titan = lower_rank("gpt2", &r);
        r.parallel.pp_loop = PpLoop::Plain;
        let plain = lower_rank("gpt2", &r);
        let total = |t: &Trace, phase: &str, nth: usize| -> u64 {
            live_at_phase(t, phase, nth).values().sum()
        };
        let kept = if rank == 1 {
            u64::from(m) * hidden_bytes(seq, 768) + 4
        } else {
            4
        };
        // The second accumulation step's first forward (the rank runs `m` per step).
        let second = m as usize;
        assert_eq!(
            total(&titan, "forward", second) - total(&plain, "forward", second),
            kept,
            "rank {rank}: the first schedule's loss kept through the second"
        );
        assert_eq!(
            total(&titan, "optimizer", 0) - total(&plain, "optimizer", 0),
            kept,
            "rank {rank}: the second schedule's loss kept through the optimizer step"
        );
        assert_eq!(
            total(&titan, "zero_grad", 0),
            total(&plain, "zero_grad", 0),
            "rank {rank}: freed when train_step returns"
        );
    }
}
