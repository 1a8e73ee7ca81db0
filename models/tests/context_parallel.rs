//! Context parallelism (`--cp`) lowered per rank, against closed forms derived by hand from the
//! sources' rules (never from vramsim's output):
//!
//! * FSDP2 shards over dp × cp ranks (torchtitan's `fsdp` mesh is `dp_shard * cp`,
//!   `parallel_dims.py`): after the backward a rank holds the padded shards ⌈dim0/N⌉ × rest of
//!   every parameter, gradient and AdamW moment with N = dp·cp (`FSDPParam._init_sharded_param`).
//! * The ring's buffers (`_templated_ring_attention`, `_AllGatherRotater`, `_AllToAllRotater`):
//!   in the forward one `all_gather_single(cat([k, v]))` of cp × (|k| + |v|) elements in the
//!   model dtype at a time; in the backward the same gathered K/V plus the float32
//!   `all_to_all_single` outputs of `cat([dk, dv])`, two of them live when the next step's is
//!   made (the rotater's buffer is replaced after its new output exists).
//! * Activations: every op outside attention runs on the rank's seq/cp tokens, and the ring's
//!   results have a kernel's bytes (output in the model dtype, logsumexp float32 [B, H, L], step
//!   0's rng state), so the activations a rank keeps after its forward are those of the
//!   single-rank step at seq/cp — plus, on every rank but the last, one copy of each layer's
//!   attention output: `_partial_update`'s `torch.cat` makes the merged output contiguous
//!   [B, H, L, D], so HF's `attn_output.transpose(1, 2).contiguous()` copies (B·L·hidden
//!   elements), while the last rank never takes a partial step and keeps the kernel's [B, L, H, D]
//!   order, whose transpose is contiguous already.
//! * With a pipeline, the same ring inside every stage, at the micro-batch size.

mod common;
use common::live_at_phase;
use std::collections::HashMap;

use vramsim_models::pipeline::rank_graph;
use vramsim_models::{lower, zoo, Parallel, Precision, Recipe, Shard};
use vramsim_traces::{Category, Event, Trace};

fn recipe(batch: u64, seq: u64, dp: u32, cp: u32, cp_rank: u32) -> Recipe {
    Recipe {
        precision: Precision::Bf16,
        parallel: Parallel {
            dp,
            shard: Shard::Fsdp2,
            cp,
            cp_rank,
            ..Parallel::default()
        },
        ..Recipe::new(batch, seq)
    }
}

fn step(name: &str, r: &Recipe) -> Trace {
    let g = zoo::build(name, r).unwrap_or_else(|e| panic!("{name}: {e}"));
    lower(&g, r).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The most bytes live at once, over events `[from, to)`, of allocations whose tag contains
/// `what`.
fn max_tagged(t: &Trace, what: &str, from: usize, to: usize) -> u64 {
    let mut live: HashMap<String, u64> = HashMap::new();
    let (mut now, mut max) = (0u64, 0u64);
    for (i, e) in t.events.iter().enumerate().take(to) {
        match e {
            Event::Alloc { id, size, tag, .. }
                if tag.as_deref().is_some_and(|t| t.contains(what)) =>
            {
                live.insert(id.to_string(), *size);
                now += size;
                if i >= from {
                    max = max.max(now);
                }
            }
            Event::Free { id } => {
                if let Some(s) = live.remove(&id.to_string()) {
                    now -= s;
                }
            }
            _ => {}
        }
    }
    max
}

fn phase(t: &Trace, name: &str, nth: usize) -> usize {
    common::phase_index(t, name, nth)
}

#[test]
fn model_states_per_rank_are_fsdp2_shards_over_dp_times_cp() {
    for (name, dp, cp) in [("gpt2", 1u32, 2u32), ("gpt2", 2, 4), ("llama2-7b", 4, 4)] {
        let n = u64::from(dp * cp);
        let r = recipe(1, 256, dp, cp, 0);
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
        // bf16 parameters and gradients (2 B), AdamW's two bf16 moments (4 B).
        assert_eq!(
            get(Category::Parameter),
            2 * shard_elems,
            "{name} dp {dp} cp {cp}"
        );
        assert_eq!(
            get(Category::Gradient),
            2 * shard_elems,
            "{name} dp {dp} cp {cp}"
        );
        assert_eq!(
            get(Category::OptimizerState),
            4 * shard_elems,
            "{name} dp {dp} cp {cp}"
        );
        assert_eq!(get(Category::Communication), 0, "{name} dp {dp} cp {cp}");
    }
}

#[test]
fn ring_buffers_are_the_gathered_kv_and_the_rotated_kv_gradients() {
    // GPT-2: 12 heads × 64 = 768; LLaMA-2-7B: 32 heads × 128 = 4096 (no GQA).
    for (name, hidden, batch, seq, cp) in [
        ("gpt2", 768u64, 2u64, 512u64, 2u32),
        ("gpt2", 768, 1, 1024, 4),
        ("llama2-7b", 4096, 1, 256, 2),
    ] {
        for rank in 0..cp {
            let t = step(name, &recipe(batch, seq, 1, cp, rank));
            let local = seq / u64::from(cp);
            // |k| + |v| elements on a rank, bf16.
            let kv = 2 * batch * local * hidden;
            let (f0, b0) = (phase(&t, "forward", 1), phase(&t, "backward", 1));
            let end = phase(&t, "optimizer", 1);
            assert_eq!(
                max_tagged(&t, "_c10d_functional", f0, b0),
                u64::from(cp) * kv * 2,
                "{name} cp {cp} rank {rank}: forward"
            );
            assert_eq!(
                max_tagged(&t, "_c10d_functional", b0, end),
                u64::from(cp) * kv * 2 + 2 * kv * 4,
                "{name} cp {cp} rank {rank}: backward"
            );
        }
    }
}

#[test]
fn activations_are_the_seq_over_cp_step_plus_the_attention_output_copy() {
    let (batch, seq, layers, hidden) = (2u64, 1024u64, 12u64, 768u64);
    for cp in [2u32, 4] {
        let local = seq / u64::from(cp);
        // The same FSDP2 world (dp·cp ranks) without context parallelism, at seq/cp.
        let single = step("gpt2", &recipe(batch, local, cp, 1, 0));
        let base = live_at_phase(&single, "backward", 1)[&Category::Activation];
        for rank in 0..cp {
            let t = step("gpt2", &recipe(batch, seq, 1, cp, rank));
            let act = live_at_phase(&t, "backward", 1)[&Category::Activation];
            let copy = if rank + 1 < cp {
                layers * batch * local * hidden * 2
            } else {
                0
            };
            assert_eq!(act, base + copy, "cp {cp} rank {rank}");
        }
    }
}

/// With a pipeline (torchtitan applies context parallelism inside each stage): every stage rank
/// runs the ring on its micro-batch's seq/cp tokens, one ring live at a time (each frees its
/// buffers before it returns, and a rank runs one micro-batch's forward or backward at a time), so
/// the ring's buffers peak as in the backward of one call at the micro-batch size; FSDP2 shards
/// the stage's parameters over dp × cp ranks.
#[test]
fn pipeline_stages_run_the_ring_and_shard_over_dp_times_cp() {
    let (batch, m, seq, hidden, dp, cp) = (4u64, 2u32, 512u64, 768u64, 2u32, 2u32);
    let n = u64::from(dp * cp);
    for stage in 0..2 {
        for rank in 0..cp {
            let mut r = recipe(batch, seq, dp, cp, rank);
            r.parallel.pp = 2;
            r.parallel.microbatches = Some(m);
            r.parallel.stage = stage;
            let mut gr = r.clone();
            gr.batch = r.parallel.replica_batch(r.batch);
            let g = zoo::build("gpt2", &gr).unwrap();
            let h = rank_graph(&g, &r.parallel).unwrap();
            let t = lower(&h, &r).unwrap();
            let what = format!("stage {stage} cp rank {rank}");
            // |k| + |v| of one micro-batch on a rank, bf16
            let kv = 2 * (batch / u64::from(m)) * (seq / u64::from(cp)) * hidden;
            assert_eq!(
                max_tagged(&t, "_c10d_functional", 0, t.events.len()),
                u64::from(cp) * kv * 2 + 2 * kv * 4,
                "{what}"
            );
            let shard_elems: u64 = h
                .params
                .iter()
                .map(|p| match p.shape.split_first() {
                    Some((d0, rest)) => d0.div_ceil(n) * rest.iter().product::<u64>(),
                    None => 1,
                })
                .sum();
            let live = live_at_phase(&t, "optimizer", 1);
            assert_eq!(live[&Category::OptimizerState], 4 * shard_elems, "{what}");
            assert_eq!(live[&Category::Gradient], 2 * shard_elems, "{what}");
        }
    }
}

#[test]
fn layouts_context_parallelism_does_not_model_are_refused_with_the_reason() {
    let err = |r: &Recipe, model: &str| match zoo::build(model, r) {
        Ok(g) => lower(&g, r).map(|_| ()).unwrap_err().to_string(),
        Err(e) => e.to_string(),
    };
    let base = recipe(1, 256, 1, 2, 0);
    let mut ddp = base.clone();
    ddp.parallel.shard = Shard::Ddp;
    assert!(err(&ddp, "gpt2").contains("--shard fsdp2"));
    let mut odd = base.clone();
    odd.seq = 250;
    assert!(err(&odd, "gpt2").contains("multiple of 2 × cp"));
    assert!(err(&base, "bert-base").contains("causal"));
    let mut fp32 = base.clone();
    fp32.precision = Precision::Fp32;
    assert!(err(&fp32, "gpt2").contains("memory-efficient"));
    let mut eager = base.clone();
    eager.attention = vramsim_models::Attention::Eager;
    assert!(err(&eager, "gpt2").contains("eager"));
    let mut world = base.clone();
    world.parallel.world_size = Some(4);
    assert!(err(&world, "gpt2").contains("cp 2 = 2 ranks"));
}
