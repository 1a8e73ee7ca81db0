//! Each rank of a real `torch.distributed.pipelining` run against the lowering of the same rank.
//! `models/tools/capture_pipeline.py` ran PyTorch 2.15's own `Schedule1F1B` and `ScheduleGPipe` on
//! the CPU with gloo (one process per rank) over an HF GPT-2 (6 layers, 128 wide, vocab 1024,
//! eager attention, fp32, AdamW foreach, `use_cache=False`, CUDA's fused dropout, seq 64, micro-batch
//! size 1) split as torchtitan splits it, with every received activation requiring grad (as
//! metadata inference gives a training run), and recorded every storage each rank allocated, two
//! steps each (`tests/fixtures/pipeline/SCHEDULE-ppN-mM/rankR.jsonl.gz`). The peak of live requested
//! bytes of every rank, computed from each trace's events, over the whole trace and over the first
//! step's schedule (before any optimizer state), must be PyTorch's to the byte: the
//! micro-batches in flight, the receive buffers (the last stage's kept until the step ends by the
//! losses, through each input leaf's `AccumulateGrad`), the outputs held for their sends and the
//! gradients sent back are where the schedule puts them.
//!
//! With `--dp 2 --shard fsdp2` the same tool ran `pp × 2` processes on torchtitan's `("pp", "dp")`
//! mesh, each stage `fully_shard` per block and at its root (`reshard_after_forward=False`,
//! optionally torchtitan's `MixedPrecisionPolicy(bf16, fp32)`: `--fsdp-param-dtype bf16
//! --fsdp-reduce-dtype fp32`), and recorded the first data-parallel rank of each stage for one step
//! (`tests/fixtures/pipeline/*fsdp2*/rankR.jsonl.gz`): the first step's schedule (the unsharded
//! parameters, the unsharded gradients accumulated over the micro-batches, the interleaved
//! runtime's UNSHARD/RESHARD/REDUCE_GRAD, the reduce-scatters) is compared.
//!
//! The `ddp2-*` and `zero1torch2-*` recordings run pp 2 × dp 2 (four gloo processes, torchtitan's
//! mesh order `pp, dp`) with every stage module in `DistributedDataParallel` over its data-parallel
//! group: `capture_pipeline.py OUT --dp 2 --shard ddp|zero1-torch [--bucket-view]
//! [--schedule gpipe --m 2 | --schedule interleaved:2]`, one file per global rank
//! (`rank{pp_rank}.dp{dp_rank}.jsonl.gz`).
//!
//! The `freeze*` recordings fine-tune (`capture_pipeline.py OUT --freeze-blocks K [--schedule ...]
//! [--pp N --m M]`): the embeddings and the first K blocks frozen, with the stage metadata
//! `PipelineStage`'s inference gives such a split (a stage input requires grad only when the
//! previous stage's output does).
//!
//! The `titan-*` recordings run torchtitan's loop around the schedule (`capture_pipeline.py OUT
//! --loop torchtitan [--schedule ...] [--pp N --m M]`: `Trainer.train_step` keeps
//! `torch.sum(torch.stack(losses))` until after the optimizer step) and are lowered with
//! `--pp-loop torchtitan`; the others ran the plain loop (`pp_loop` in their metadata, or none) and
//! are lowered with `--pp-loop plain`.

use std::collections::HashMap;
use std::path::Path;

use vramsim_models::hf::{read, ImportOptions};
use vramsim_models::pipeline::rank_graph;
use vramsim_models::{
    lower, Attention, CheckpointImpl, Checkpointing, DType, Fidelity, Parallel, PpLoop, PpSchedule,
    Recipe, Shard,
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
    peaks_dp(dir, schedule, pp, m, checkpointing, &Dp::none())
}

/// The data-parallel side of a recording: `--dp`, `--shard` and its options, and the
/// data-parallel rank whose file is compared.
#[derive(Clone, Copy)]
struct Dp {
    dp: u32,
    shard: Shard,
    /// DDP's `gradient_as_bucket_view` (`--ddp-bucket-view`).
    bucket_view: bool,
    /// FSDP2's `MixedPrecisionPolicy` (`param_dtype`, `reduce_dtype`).
    mixed: Option<(DType, DType)>,
    /// The data-parallel rank whose file (`rankR.dpD.jsonl.gz`) is compared; `None`: the file
    /// `rankR.jsonl.gz` (no data parallelism, or an FSDP2 recording, which keeps the first
    /// data-parallel rank of each stage only).
    rank: Option<u32>,
}

impl Dp {
    fn none() -> Self {
        Dp {
            dp: 1,
            shard: Shard::None,
            bucket_view: false,
            mixed: None,
            rank: None,
        }
    }

    /// FSDP2 over 2 data-parallel ranks inside each stage (`--dp 2 --shard fsdp2`).
    fn fsdp2(mixed: Option<(DType, DType)>) -> Self {
        Dp {
            dp: 2,
            shard: Shard::Fsdp2,
            mixed,
            ..Dp::none()
        }
    }

    /// Each stage in `DistributedDataParallel` over 2 data-parallel ranks (`--dp 2 --shard
    /// ddp|zero1-torch`), data-parallel rank `rank`'s file.
    fn ddp(shard: Shard, bucket_view: bool, rank: u32) -> Self {
        Dp {
            dp: 2,
            shard,
            bucket_view,
            rank: Some(rank),
            ..Dp::none()
        }
    }
}

/// [`peaks`] of a recording with data parallelism inside the stages (`dp`).
fn peaks_dp(
    dir: &str,
    schedule: PpSchedule,
    pp: u32,
    m: u32,
    checkpointing: Checkpointing,
    dp: &Dp,
) -> Vec<(Peaks, Peaks)> {
    let mut out = Vec::new();
    for (rank, (t, captured)) in traces(dir, schedule, pp, m, checkpointing, dp)
        .into_iter()
        .enumerate()
    {
        let (ours, theirs) = (peak(&t), peak(&captured));
        let file = dp.rank.map_or(String::new(), |d| format!(".dp{d}"));
        eprintln!(
            "{dir} rank {rank}{file}: vramsim {} B (first schedule {} B), PyTorch {} B ({} B)",
            ours.0, ours.1, theirs.0, theirs.1
        );
        out.push((ours, theirs));
    }
    out
}

/// Per rank: (the lowering, the recording).
fn traces(
    dir: &str,
    schedule: PpSchedule,
    pp: u32,
    m: u32,
    checkpointing: Checkpointing,
    dp: &Dp,
) -> Vec<(Trace, Trace)> {
    let mut out = Vec::new();
    let base = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pipeline")
        .join(dir);
    let cfg = read(&base.join("config.json"), &ImportOptions::default()).expect("config");
    for rank in 0..pp {
        let path = match dp.rank {
            None => base.join(format!("rank{rank}.jsonl.gz")),
            Some(d) => base.join(format!("rank{rank}.dp{d}.jsonl.gz")),
        };
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
            dp: dp.dp,
            shard: dp.shard,
            gradient_as_bucket_view: dp.bucket_view,
            fsdp_param_dtype: dp.mixed.map(|(param, _)| param),
            fsdp_reduce_dtype: dp.mixed.map(|(_, reduce)| reduce),
            // The tool's loop (`--loop`, recorded in the metadata; plain before it had one).
            pp_loop: captured
                .meta
                .get("pp_loop")
                .and_then(|v| v.as_str())
                .map_or(PpLoop::Plain, |s| s.parse().expect("a loop vramsim knows")),
            ..Parallel::default()
        };
        // `--freeze-blocks K`: the embeddings and blocks 0..K-1 frozen (GPT-2's tied head too).
        if let Some(k) = captured.meta.get("freeze_blocks").and_then(|k| k.as_u64()) {
            r.freeze = vec![
                "transformer.wte".into(),
                "transformer.wpe".into(),
                format!("transformer.h.0-{}", k - 1),
            ];
        }
        let mut gr = r.clone();
        gr.batch = r.parallel.replica_batch(r.batch);
        let g = cfg.arch.build(&gr).expect("builds");
        let t = lower(&rank_graph(&g, &r.parallel).expect("splits"), &r).expect("lowers");
        out.push((t, captured));
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

/// Fine-tuning under the pipeline (`capture_pipeline.py --freeze-blocks K`: the embeddings and
/// blocks 0..K-1 of the 6 frozen, GPT-2's tied head with `wte`). With K 3 over 2 stages the first
/// stage (embeddings, blocks 0–2) trains nothing: no gradient, no optimizer state, no gradient
/// receive buffer, a backward with nothing to run, and the second stage receives a hidden state that
/// does not require grad and sends nothing back. With K 1 the first stage trains blocks 1–2 and
/// gets its gradients as in full training. Also GPipe, the interleaved runtime (4 stages: rank 0
/// holds the frozen stage 0 and the training stage 2, rank 1 the frozen stage 1 and the last stage
/// 3), and pp 4 (stages 0–1 frozen, stage 2 frozen in part).
///
/// Every rank's peaks are PyTorch's to the byte. Where the last stage's received activation
/// requires grad, its receive buffers live until the step ends (each micro-batch's loss, kept
/// until then, reaches through its `grad_fn` chain the input's `AccumulateGrad` node, which holds
/// the leaf); where it does not (`freeze3`), each dies after its micro-batch's backward.
#[test]
fn frozen_prefix_one_f_one_b_pp2_m4() {
    // Stage 1's input (stage 0's output, blocks 0–2 frozen) does not require grad.
    check("freeze3-1f1b-pp2-m4", PpSchedule::OneFOneB, 2, 4);
    // Stage 0 trains blocks 1–2: stage 1's input requires grad.
    check("freeze1-1f1b-pp2-m4", PpSchedule::OneFOneB, 2, 4);
}

#[test]
fn frozen_prefix_gpipe_pp2_m1() {
    check("freeze3-gpipe-pp2-m1", PpSchedule::GPipe, 2, 1);
}

#[test]
fn frozen_prefix_interleaved_pp2_v2_m4() {
    // Stages 0: block 0, 1: blocks 1–2 (both frozen), 2: blocks 3–4 (training), 3: block 5.
    check(
        "freeze3-interleaved2-pp2-m4",
        PpSchedule::Interleaved(2),
        2,
        4,
    );
}

#[test]
fn frozen_prefix_one_f_one_b_pp4_m8() {
    // Stages 0: block 0, 1: blocks 1–2 (both frozen), 2: blocks 3–4 (4 trains), 3: block 5.
    check("freeze4-1f1b-pp4-m8", PpSchedule::OneFOneB, 4, 8);
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

/// HF Llama (GQA, RMSNorm, rotary tables every stage makes from its own activation's dtype): every
/// rank to the byte, with one micro-batch (GPipe) and four in flight (1F1B). The last stage's first
/// RMSNorm saves its fp32 input and `rsqrt` only because the received hidden state requires grad
/// (recordings made with inputs without `requires_grad` came out 256 bytes, one `[1, 64, 1]` fp32
/// tensor, below the lowering).
#[test]
fn llama_micro_batches_in_flight() {
    check("llama-gpipe-pp2-m1", PpSchedule::GPipe, 2, 1);
    check("llama-1f1b-pp2-m4", PpSchedule::OneFOneB, 2, 4);
}

/// FSDP2 inside the stages with torchtitan's mixed precision (`capture_pipeline.py --dp 2 --shard
/// fsdp2 --fsdp-param-dtype bf16 --fsdp-reduce-dtype fp32`): HF Llama (fp32 model, bf16 compute)
/// in 2 stages over 2 data-parallel ranks, 1F1B over 4 micro-batches, GPipe over 1 and
/// `interleaved:2` (4 stages) over 4. Every rank's first-step peak is PyTorch's to the byte. The
/// first stage's (at the first reduce-scatter input, with every unsharded gradient accumulated in
/// fp32) includes with GPipe the received output gradient, which `ScheduleGPipe._step_microbatches`
/// keeps past `backward_one_chunk` (its loop variable `work` still holds the receive's `Work`, and
/// the first stage sends nothing back to rebind it) until the step returns, after the reduce. A
/// non-first stage's first RMSNorm keeps its fp32 copy of the received bf16 hidden state and its
/// `rsqrt` (`[1, 64, 128]` and `[1, 64, 1]` fp32: 33,024 bytes per micro-batch in flight) because
/// that hidden state requires grad; recordings made with inputs without `requires_grad` lacked
/// them.
#[test]
fn llama_fsdp2_mixed_precision() {
    let fsdp = Dp::fsdp2(Some((DType::BF16, DType::F32)));
    for (dir, schedule, m) in [
        ("llama-fsdp2-mp-gpipe-pp2-dp2-m1", PpSchedule::GPipe, 1),
        ("llama-fsdp2-mp-1f1b-pp2-dp2-m4", PpSchedule::OneFOneB, 4),
        (
            "llama-fsdp2-mp-interleaved2-pp2-dp2-m4",
            PpSchedule::Interleaved(2),
            4,
        ),
    ] {
        let p = peaks_dp(dir, schedule, 2, m, Checkpointing::None, &fsdp);
        for (rank, (ours, theirs)) in p.into_iter().enumerate() {
            assert_eq!(ours.1, theirs.1, "{dir} rank {rank}");
        }
    }
}

/// FSDP2 over 2 data-parallel ranks inside each stage: HF GPT-2 (fp32, no mixed precision).
#[test]
fn fsdp2_one_f_one_b_pp2_m4() {
    for (rank, (ours, theirs)) in peaks_dp(
        "fsdp2-1f1b-pp2-dp2-m4",
        PpSchedule::OneFOneB,
        2,
        4,
        Checkpointing::None,
        &Dp::fsdp2(None),
    )
    .into_iter()
    .enumerate()
    {
        assert_eq!(ours.1, theirs.1, "rank {rank}");
    }
}

#[test]
fn fsdp2_interleaved_pp2_v2_m4() {
    for (rank, (ours, theirs)) in peaks_dp(
        "fsdp2-interleaved2-pp2-dp2-m4",
        PpSchedule::Interleaved(2),
        2,
        4,
        Checkpointing::None,
        &Dp::fsdp2(None),
    )
    .into_iter()
    .enumerate()
    {
        assert_eq!(ours.1, theirs.1, "rank {rank}");
    }
}

#[test]
fn fsdp2_interleaved_pp2_v4_m4() {
    for (rank, (ours, theirs)) in peaks_dp(
        "fsdp2-interleaved4-pp2-dp2-m4-l14",
        PpSchedule::Interleaved(4),
        2,
        4,
        Checkpointing::None,
        &Dp::fsdp2(None),
    )
    .into_iter()
    .enumerate()
    {
        assert_eq!(ours.1, theirs.1, "rank {rank}");
    }
}

/// Each stage wrapped in `DistributedDataParallel` over its data-parallel group (pp 2 × dp 2,
/// gloo; `stage.py` `forward_maybe_with_nosync` / `backward_maybe_with_nosync`): the Reducer's
/// bucket (all the stage's fp32 gradients) from the constructor on, the micro-batches' backwards
/// but the last under `no_sync()` (gradients accumulated in `.grad` only), the last one filling
/// the buckets, and the buckets rebuilt (1 MiB first, 25 MiB cap) at the next step's first
/// forward. Both data-parallel ranks of each stage play one role.
fn check_ddp(dir: &str, schedule: PpSchedule, m: u32, shard: Shard, bucket_view: bool) {
    for dp_rank in 0..2 {
        let dp = Dp::ddp(shard, bucket_view, dp_rank);
        let got = peaks_dp(dir, schedule, 2, m, Checkpointing::None, &dp);
        for (rank, (ours, theirs)) in got.into_iter().enumerate() {
            assert_eq!(ours, theirs, "{dir} rank {rank}.dp{dp_rank}");
        }
    }
}

#[test]
fn ddp_one_f_one_b_pp2_m4() {
    check_ddp(
        "ddp2-1f1b-pp2-m4",
        PpSchedule::OneFOneB,
        4,
        Shard::Ddp,
        false,
    );
}

#[test]
fn ddp_gpipe_pp2_m2() {
    check_ddp("ddp2-gpipe-pp2-m2", PpSchedule::GPipe, 2, Shard::Ddp, false);
}

/// `gradient_as_bucket_view=True`: the last backward's hook copies each accumulated `.grad`
/// into its bucket view and re-points `.grad` there (`mark_variable_ready_dense`).
#[test]
fn ddp_bucket_view_one_f_one_b_pp2_m4() {
    check_ddp(
        "ddp2-bucketview-1f1b-pp2-m4",
        PpSchedule::OneFOneB,
        4,
        Shard::Ddp,
        true,
    );
}

/// `ZeroRedundancyOptimizer(AdamW, process_group=dp group)` over DDP stages: DDP's buckets and
/// `no_sync()` as above; each data-parallel rank's AdamW holds the state of its greedy share of
/// the stage's parameters (`_partition_parameters`), and the lowering writes the rank holding
/// the most (the larger of the two recorded peaks; the first step's schedule, before any state,
/// is the same on both).
#[test]
fn zero1_torch_one_f_one_b_pp2_m4() {
    let dir = "zero1torch2-1f1b-pp2-m4";
    let per_dp: Vec<Vec<(Peaks, Peaks)>> = (0..2)
        .map(|dp_rank| {
            let dp = Dp::ddp(Shard::ZeroRedundancy, false, dp_rank);
            peaks_dp(dir, PpSchedule::OneFOneB, 2, 4, Checkpointing::None, &dp)
        })
        .collect();
    for rank in 0..2 {
        let ours = per_dp[0][rank].0;
        let theirs: Vec<Peaks> = per_dp.iter().map(|p| p[rank].1).collect();
        assert_eq!(
            theirs[0].1, theirs[1].1,
            "rank {rank}: first step's schedule"
        );
        let worst = *theirs.iter().max().expect("two ranks");
        assert_eq!(ours, worst, "{dir} rank {rank}");
    }
}

/// `ScheduleInterleaved1F1B` with DDP stages (pp 2 × V 2 × dp 2): each of a rank's two stages is
/// its own `DistributedDataParallel` with its own Reducer and bucket, whose hooks run in that
/// stage's last backward only (`_PipelineScheduleRuntime`: `last_backward =
/// backward_counter[stage_idx] == n_microbatches`), and whose buckets are rebuilt at that stage's
/// next forward.
#[test]
fn ddp_interleaved_pp2_v2_m4() {
    check_ddp(
        "ddp2-interleaved2-pp2-m4",
        PpSchedule::Interleaved(2),
        4,
        Shard::Ddp,
        false,
    );
    // The buckets themselves, in the order they are made: in the recording the Reducers' flat
    // `at::empty` tensors are its only `aten.empty.memory_format` allocations above 64 KiB (the
    // others are masks and shape metadata): per stage module one at construction (its gradients'
    // bytes), then the rebuilt ones (1 MiB first, 25 MiB cap) at that stage's next forward.
    let dp = Dp::ddp(Shard::Ddp, false, 0);
    let sizes = |t: &Trace, pick: &dyn Fn(&str, u64) -> bool| -> Vec<u64> {
        t.events
            .iter()
            .filter_map(|e| match e {
                Event::Alloc { size, tag, .. } if pick(tag.as_deref().unwrap_or(""), *size) => {
                    Some(*size)
                }
                _ => None,
            })
            .collect()
    };
    let got = traces(
        "ddp2-interleaved2-pp2-m4",
        PpSchedule::Interleaved(2),
        2,
        4,
        Checkpointing::None,
        &dp,
    );
    for (rank, (ours, theirs)) in got.iter().enumerate() {
        let a = sizes(ours, &|tag, _| tag.starts_with("ddp_stage"));
        let b = sizes(theirs, &|tag, size| {
            tag == "aten.empty.memory_format" && size > 64 * 1024
        });
        assert_eq!(a, b, "rank {rank}: bucket sizes");
        assert!(a.len() >= 4, "rank {rank}: {a:?}");
    }
}

/// `zero1-torch` with the interleaved schedule: one `ZeroRedundancyOptimizer` over the rank's
/// two stage modules' parameters, each stage its own DDP module.
#[test]
fn zero1_torch_interleaved_pp2_v2_m4() {
    let dir = "zero1torch2-interleaved2-pp2-m4";
    let per_dp: Vec<Vec<(Peaks, Peaks)>> = (0..2)
        .map(|dp_rank| {
            let dp = Dp::ddp(Shard::ZeroRedundancy, false, dp_rank);
            peaks_dp(
                dir,
                PpSchedule::Interleaved(2),
                2,
                4,
                Checkpointing::None,
                &dp,
            )
        })
        .collect();
    for rank in 0..2 {
        let ours = per_dp[0][rank].0;
        let theirs: Vec<Peaks> = per_dp.iter().map(|p| p[rank].1).collect();
        assert_eq!(
            theirs[0].1, theirs[1].1,
            "rank {rank}: first step's schedule"
        );
        let worst = *theirs.iter().max().expect("two ranks");
        assert_eq!(ours, worst, "{dir} rank {rank}");
    }
}

/// Per `optimizer` phase of a trace (up to its `zero_grad`): the live requested bytes as it
/// starts, the most within it, and as it ends.
fn optimizer_phases(t: &Trace) -> Vec<(u64, u64, u64)> {
    let mut live: HashMap<String, u64> = HashMap::new();
    let mut now = 0u64;
    let mut open: Option<(u64, u64)> = None;
    let mut out = Vec::new();
    for e in &t.events {
        match e {
            Event::Alloc { id, size, .. } => {
                live.insert(id.to_string(), *size);
                now += size;
            }
            Event::Free { id } => {
                if let Some(s) = live.remove(&id.to_string()) {
                    now -= s;
                }
            }
            Event::Phase { name } if &**name == "optimizer" => open = Some((now, now)),
            Event::Phase { name } if &**name == "zero_grad" => {
                if let Some((start, max)) = open.take() {
                    out.push((start, max, now));
                }
            }
            _ => {}
        }
        if let Some((_, max)) = open.as_mut() {
            *max = (*max).max(now);
        }
    }
    out
}

/// torchtitan's loop (`capture_pipeline.py --loop torchtitan`: `Trainer.train_step` keeps
/// `torch.sum(torch.stack(losses))` until after `optimizers.step()`) against the lowering's default
/// `--pp-loop torchtitan`: every rank's peaks and every optimizer phase (live bytes at its start,
/// its peak, at its end) to the byte; and the recordings against the plain loop's by hand: the
/// last stage enters the optimizer step holding its `M` receive buffers (1 × seq 64 × 128 fp32 each,
/// the losses' graph reaching their `AccumulateGrad` nodes) and the 4-byte summed loss, the other
/// stages the 4-byte `torch.tensor([-1.0])`; both die before `zero_grad` (`train_step` returns).
fn check_titan(dir: &str, plain: &str, schedule: PpSchedule, pp: u32, m: u32) {
    check(dir, schedule, pp, m);
    let titan = traces(dir, schedule, pp, m, Checkpointing::None, &Dp::none());
    let base = traces(plain, schedule, pp, m, Checkpointing::None, &Dp::none());
    for (rank, ((ours, theirs), (_, plain_theirs))) in titan.iter().zip(&base).enumerate() {
        let (o, t, p) = (
            optimizer_phases(ours),
            optimizer_phases(theirs),
            optimizer_phases(plain_theirs),
        );
        eprintln!("{dir} rank {rank}: vramsim {o:?}, PyTorch {t:?}, plain loop {p:?}");
        assert_eq!(o, t, "{dir} rank {rank}: optimizer phases");
        let kept = if rank as u32 + 1 == pp {
            u64::from(m) * 64 * 128 * 4 + 4
        } else {
            4
        };
        assert_eq!(t.len(), p.len());
        for ((ts, tm, te), (ps, pm, pe)) in t.iter().zip(&p) {
            assert_eq!(
                ts - ps,
                kept,
                "{dir} rank {rank}: kept at the optimizer step"
            );
            assert_eq!(
                tm - pm,
                kept,
                "{dir} rank {rank}: kept through the optimizer step"
            );
            assert_eq!(te, pe, "{dir} rank {rank}: freed when train_step returns");
        }
    }
}

#[test]
fn torchtitan_loop_one_f_one_b_pp2_m4() {
    check_titan(
        "titan-1f1b-pp2-m4",
        "1f1b-pp2-m4",
        PpSchedule::OneFOneB,
        2,
        4,
    );
}

#[test]
fn torchtitan_loop_interleaved_pp2_v2_m4() {
    check_titan(
        "titan-interleaved2-pp2-m4",
        "interleaved2-pp2-m4",
        PpSchedule::Interleaved(2),
        2,
        4,
    );
}

#[test]
fn torchtitan_loop_gpipe_pp4_m4() {
    check_titan(
        "titan-gpipe-pp4-m4",
        "gpipe-pp4-m4",
        PpSchedule::GPipe,
        4,
        4,
    );
}

/// `DistributedDataParallel.__init__`'s `_sync_module_states` on every stage module
/// (`_broadcast_coalesced`, `c10d/comm.cpp` `broadcast_coalesced`): the recordings' only
/// `aten.cat`s before the first forward are its flat buckets (each stage's fp32 parameters, under
/// 250 MiB: one bucket per stage module), made in stage order, each before that stage's Reducer
/// bucket. gloo frees the flat tensor once its worker thread drops the work: on the
/// interleaved recordings at once (before the Reducer's bucket, as `ProcessGroupNCCL` does at
/// `wait()`), on some others only in the first forward, which changes no recorded peak.
#[test]
fn ddp_constructor_broadcasts_each_stage_module_flat() {
    for (dir, schedule, m, shard) in [
        ("ddp2-1f1b-pp2-m4", PpSchedule::OneFOneB, 4, Shard::Ddp),
        ("ddp2-gpipe-pp2-m2", PpSchedule::GPipe, 2, Shard::Ddp),
        (
            "ddp2-interleaved2-pp2-m4",
            PpSchedule::Interleaved(2),
            4,
            Shard::Ddp,
        ),
        (
            "zero1torch2-interleaved2-pp2-m4",
            PpSchedule::Interleaved(2),
            4,
            Shard::ZeroRedundancy,
        ),
    ] {
        for dp_rank in 0..2 {
            let dp = Dp::ddp(shard, false, dp_rank);
            let got = traces(dir, schedule, 2, m, Checkpointing::None, &dp);
            for (rank, (ours, theirs)) in got.iter().enumerate() {
                let before_forward = |t: &Trace, pick: &dyn Fn(&str) -> bool| -> Vec<u64> {
                    t.events
                        .iter()
                        .take_while(|e| !matches!(e, Event::Phase { name } if &**name == "forward"))
                        .filter_map(|e| match e {
                            Event::Alloc { size, tag, .. }
                                if pick(tag.as_deref().unwrap_or("")) =>
                            {
                                Some(*size)
                            }
                            _ => None,
                        })
                        .collect()
                };
                let a = before_forward(ours, &|tag| tag.starts_with("ddp_sync"));
                let b = before_forward(theirs, &|tag| tag == "aten.cat");
                assert_eq!(a, b, "{dir} rank {rank}.dp{dp_rank}: flat buckets");
                assert!(!a.is_empty(), "{dir} rank {rank}.dp{dp_rank}");
            }
        }
    }
}
