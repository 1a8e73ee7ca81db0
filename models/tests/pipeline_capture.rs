//! Each rank of a real `torch.distributed.pipelining` run against the lowering of the same rank.
//! `models/tools/capture_pipeline.py` ran PyTorch 2.15's own `Schedule1F1B` and `ScheduleGPipe` on
//! the CPU with gloo (one process per rank) over an HF GPT-2 (6 layers, 128 wide, vocab 1024,
//! eager attention, fp32, AdamW foreach, `use_cache=False`, CUDA's fused dropout, seq 64, micro-batch
//! size 1) split as torchtitan splits it, and recorded every storage each rank allocated, two
//! steps each (`tests/fixtures/pipeline/SCHEDULE-ppN-mM/rankR.jsonl.gz`). The peak of live requested
//! bytes of every rank, computed from each trace's events, over the whole trace and over the first
//! step's schedule (before any optimizer state), must be PyTorch's to the byte: the
//! micro-batches in flight, the receive buffers, the outputs held for their sends and the gradients
//! sent back are where the schedule puts them.
//!
//! With `--dp 2` the same tool ran `pp × 2` processes on torchtitan's `("pp", "dp")` mesh, each
//! stage `fully_shard` per block and at its root (`reshard_after_forward=False`, optionally
//! torchtitan's `MixedPrecisionPolicy(bf16, fp32)`), and recorded the first data-parallel rank of
//! each stage for one step (`tests/fixtures/pipeline/*fsdp2*`): the first step's schedule (the
//! unsharded parameters, the unsharded gradients accumulated over the micro-batches, the
//! interleaved runtime's UNSHARD/RESHARD/REDUCE_GRAD, the reduce-scatters) is compared.

use std::collections::HashMap;
use std::path::Path;

use vramsim_models::hf::{read, ImportOptions};
use vramsim_models::pipeline::rank_graph;
use vramsim_models::{
    lower, Attention, CheckpointImpl, Checkpointing, Fidelity, Parallel, PpSchedule, Recipe,
};
use vramsim_traces::{read_trace, Event, Trace};

/// Max over the trace of live requested bytes (no allocator), and the max before the first
/// optimizer step (the first step's schedule alone, before any optimizer state).
fn peak(t: &Trace) -> Peaks {
    let mut live: HashMap<String, u64> = HashMap::new();
    let (mut now, mut max, mut first) = (0u64, 0u64, None);
    for e in &t.events {
        match e {
            Event::Alloc { id, size, .. } => {
                live.insert(id.to_string(), *size);
                now += size;
                max = max.max(now);
            }
            Event::Free { id } => {
                if let Some(s) = live.remove(&id.to_string()) {
                    now -= s;
                }
            }
            Event::Phase { name } if &**name == "optimizer" && first.is_none() => {
                first = Some(max);
            }
            _ => {}
        }
    }
    (max, first.expect("an optimizer step"))
}

fn check(dir: &str, schedule: PpSchedule, pp: u32, m: u32) {
    check_with(dir, schedule, pp, m, Checkpointing::None);
}

fn check_with(dir: &str, schedule: PpSchedule, pp: u32, m: u32, checkpointing: Checkpointing) {
    for (rank, (ours, theirs)) in peaks(dir, schedule, pp, m, checkpointing)
        .into_iter()
        .enumerate()
    {
        assert_eq!(ours, theirs, "{dir} rank {rank}");
    }
}

/// A trace's peaks: (whole trace, first step's schedule).
type Peaks = (u64, u64);

/// Per rank: (the lowering's peaks, PyTorch's peaks).
fn peaks(
    dir: &str,
    schedule: PpSchedule,
    pp: u32,
    m: u32,
    checkpointing: Checkpointing,
) -> Vec<(Peaks, Peaks)> {
    peaks_with(dir, schedule, pp, m, checkpointing, |_| {})
}

/// [`peaks`] with the layout changed by `layout` (FSDP2 over the stages).
fn peaks_with(
    dir: &str,
    schedule: PpSchedule,
    pp: u32,
    m: u32,
    checkpointing: Checkpointing,
    layout: impl Fn(&mut Parallel),
) -> Vec<(Peaks, Peaks)> {
    let mut out = Vec::new();
    let base = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pipeline")
        .join(dir);
    let cfg = read(&base.join("config.json"), &ImportOptions::default()).expect("config");
    for rank in 0..pp {
        let path = base.join(format!("rank{rank}.jsonl.gz"));
        let captured = read_trace(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut r = Recipe::new(u64::from(m), 64);
        r.attention = Attention::Eager;
        r.use_cache = Some(false);
        r.checkpointing = checkpointing;
        r.checkpoint_impl = CheckpointImpl::NonReentrant;
        // The recording has no cuBLAS workspaces and sums gradients as a dispatch mode sees them.
        r.fidelity = Fidelity::MetaCapture;
        r.parallel = Parallel {
            pp,
            pp_schedule: schedule,
            microbatches: Some(m),
            stage: rank,
            ..Parallel::default()
        };
        layout(&mut r.parallel);
        let mut gr = r.clone();
        gr.batch = r.parallel.replica_batch(r.batch);
        let g = cfg.arch.build(&gr).expect("builds");
        let t = lower(&rank_graph(&g, &r.parallel).expect("splits"), &r).expect("lowers");
        let (ours, theirs) = (peak(&t), peak(&captured));
        eprintln!(
            "{dir} rank {rank}: vramsim {} B (first schedule {} B), PyTorch {} B ({} B)",
            ours.0, ours.1, theirs.0, theirs.1
        );
        out.push((ours, theirs));
    }
    out
}

#[test]
fn one_f_one_b_pp2_m4() {
    check("1f1b-pp2-m4", PpSchedule::OneFOneB, 2, 4);
}

#[test]
fn gpipe_pp2_m1() {
    check("gpipe-pp2-m1", PpSchedule::GPipe, 2, 1);
}

#[test]
fn one_f_one_b_pp4_m8() {
    check("1f1b-pp4-m8", PpSchedule::OneFOneB, 4, 8);
}

#[test]
fn gpipe_pp4_m4() {
    check("gpipe-pp4-m4", PpSchedule::GPipe, 4, 4);
}

#[test]
fn interleaved_pp2_v2_m4() {
    check("interleaved2-pp2-m4", PpSchedule::Interleaved(2), 2, 4);
}

#[test]
fn interleaved_pp2_v3_m4() {
    check("interleaved3-pp2-m4", PpSchedule::Interleaved(3), 2, 4);
}

#[test]
fn interleaved_pp2_v2_m6() {
    check("interleaved2-pp2-m6", PpSchedule::Interleaved(2), 2, 6);
}

/// HF's non-reentrant activation checkpointing on every block: each micro-batch in flight keeps
/// only its blocks' inputs, and its backward reruns them.
#[test]
fn one_f_one_b_pp2_m4_checkpointed() {
    check_with(
        "1f1b-pp2-m4-ckpt",
        PpSchedule::OneFOneB,
        2,
        4,
        Checkpointing::Full,
    );
}

#[test]
fn interleaved_pp2_v2_m4_checkpointed() {
    check_with(
        "interleaved2-pp2-m4-ckpt",
        PpSchedule::Interleaved(2),
        2,
        4,
        Checkpointing::Full,
    );
}

/// HF Llama (GQA, RMSNorm, rotary tables every stage makes from its own activation's dtype): the
/// first stage matches to the byte; on the last stage the lowering's first step peaks 256 bytes
/// (one `[1, 64, 1]` fp32 tensor of the norm/loss arithmetic) above the CPU recording with a
/// single micro-batch already, so the claim checked there is the pipeline's: with 4 micro-batches
/// in flight (1F1B) each rank differs from PyTorch by exactly what it differs with one (GPipe, M 1).
#[test]
fn llama_micro_batches_in_flight_add_what_pytorch_adds() {
    let one = peaks(
        "llama-gpipe-pp2-m1",
        PpSchedule::GPipe,
        2,
        1,
        Checkpointing::None,
    );
    let four = peaks(
        "llama-1f1b-pp2-m4",
        PpSchedule::OneFOneB,
        2,
        4,
        Checkpointing::None,
    );
    assert_eq!(one[0].0, one[0].1, "rank 0, one micro-batch");
    assert_eq!(four[0].0, four[0].1, "rank 0, 1F1B");
    for rank in 0..2 {
        let d = |p: &[(Peaks, Peaks)]| p[rank].0 .1 as i64 - p[rank].1 .1 as i64;
        assert_eq!(d(&four), d(&one), "rank {rank}: first step's schedule");
        assert!(d(&one).abs() <= 256, "rank {rank}: {}", d(&one));
    }
}

/// FSDP2 inside the stages with torchtitan's mixed precision (`capture_pipeline.py --dp 2
/// --fsdp-param-dtype bf16 --fsdp-reduce-dtype fp32`): HF Llama (fp32 model, bf16 compute) in 2
/// stages over 2 data-parallel ranks, 1F1B over 4 micro-batches and GPipe over 1. The first
/// stage's first-step peak (at the first reduce-scatter input, with every unsharded gradient
/// accumulated in fp32) is PyTorch's to the byte with both; with GPipe it includes the received
/// output gradient, which `ScheduleGPipe._step_microbatches` keeps past `backward_one_chunk` (its
/// loop variable `work` still holds the receive's `Work`, and the first stage sends nothing back
/// to rebind it) until the step returns, after the reduce. On the last stage the lowering keeps,
/// with one micro-batch as with four, the first layer's `input_layernorm` fp32 copy and `rsqrt`
/// (`[1, 64, 128]` and `[1, 64, 1]` fp32: 33,024 bytes) that the CPU recording does not: the
/// difference Llama's last stage shows without FSDP (`llama_micro_batches_in_flight_add_what_
/// pytorch_adds`, there 256 bytes: in fp32 the copy is no copy), so the claim checked there is that
/// four micro-batches under FSDP2 add what PyTorch adds.
#[test]
fn llama_fsdp2_mixed_precision_1f1b() {
    let fsdp = |par: &mut Parallel| {
        fsdp2(par);
        par.fsdp_param_dtype = Some(vramsim_models::DType::BF16);
        par.fsdp_reduce_dtype = Some(vramsim_models::DType::F32);
    };
    let one = peaks_with(
        "llama-fsdp2-mp-gpipe-pp2-dp2-m1",
        PpSchedule::GPipe,
        2,
        1,
        Checkpointing::None,
        fsdp,
    );
    let four = peaks_with(
        "llama-fsdp2-mp-1f1b-pp2-dp2-m4",
        PpSchedule::OneFOneB,
        2,
        4,
        Checkpointing::None,
        fsdp,
    );
    let d = |p: &[(Peaks, Peaks)], rank: usize| p[rank].0 .1 as i64 - p[rank].1 .1 as i64;
    assert_eq!(d(&four, 0), 0, "rank 0, 1F1B");
    assert_eq!(d(&one, 0), 0, "rank 0, GPipe, one micro-batch");
    assert_eq!(d(&one, 1), 64 * 128 * 4 + 64 * 4, "rank 1, one micro-batch");
    assert_eq!(d(&four, 1), d(&one, 1), "rank 1, 1F1B");
}

/// FSDP2 over 2 data-parallel ranks inside each stage: HF GPT-2 (fp32, no mixed precision).
fn fsdp2(par: &mut Parallel) {
    par.dp = 2;
    par.shard = vramsim_models::Shard::Fsdp2;
}

#[test]
fn fsdp2_one_f_one_b_pp2_m4() {
    for (rank, (ours, theirs)) in peaks_with(
        "fsdp2-1f1b-pp2-dp2-m4",
        PpSchedule::OneFOneB,
        2,
        4,
        Checkpointing::None,
        fsdp2,
    )
    .into_iter()
    .enumerate()
    {
        assert_eq!(ours.1, theirs.1, "rank {rank}");
    }
}

#[test]
fn fsdp2_interleaved_pp2_v2_m4() {
    for (rank, (ours, theirs)) in peaks_with(
        "fsdp2-interleaved2-pp2-dp2-m4",
        PpSchedule::Interleaved(2),
        2,
        4,
        Checkpointing::None,
        fsdp2,
    )
    .into_iter()
    .enumerate()
    {
        assert_eq!(ours.1, theirs.1, "rank {rank}");
    }
}

#[test]
fn fsdp2_interleaved_pp2_v4_m4() {
    for (rank, (ours, theirs)) in peaks_with(
        "fsdp2-interleaved4-pp2-dp2-m4-l14",
        PpSchedule::Interleaved(4),
        2,
        4,
        Checkpointing::None,
        fsdp2,
    )
    .into_iter()
    .enumerate()
    {
        assert_eq!(ours.1, theirs.1, "rank {rank}");
    }
}

/// torchtitan's mixed precision with `interleaved:2` (Llama, 4 stages over pp 2, dp 2, 4
/// micro-batches): every stage but stage 0 is a non-first stage, where Llama's first RMSNorm of a
/// micro-batch in flight keeps 33,024 bytes the CPU recording does not (above); each rank's
/// first-step peak is PyTorch's plus a whole number of those, at most one per micro-batch its
/// non-first stages hold at once. By hand from `ScheduleInterleaved1F1B` (2 micro-batches a round,
/// warm-up `(V − 1)·2 + 2·(pp − 1 − rank)` forwards): rank 0 runs F0.0 F0.1 F2.0 F2.1, then 1F1B,
/// so stage 2 holds at most 2; rank 1 runs F1.0 F1.1 then F3.0 before any backward: 3.
#[test]
fn llama_fsdp2_mixed_precision_interleaved() {
    let p = peaks_with(
        "llama-fsdp2-mp-interleaved2-pp2-dp2-m4",
        PpSchedule::Interleaved(2),
        2,
        4,
        Checkpointing::None,
        |par| {
            fsdp2(par);
            par.fsdp_param_dtype = Some(vramsim_models::DType::BF16);
            par.fsdp_reduce_dtype = Some(vramsim_models::DType::F32);
        },
    );
    let norm = 64 * 128 * 4 + 64 * 4;
    for (rank, ((ours, theirs), most)) in p.into_iter().zip([2, 3]).enumerate() {
        let d = ours.1 - theirs.1;
        assert!(d % norm == 0 && d / norm <= most, "rank {rank}: {d}");
    }
}
