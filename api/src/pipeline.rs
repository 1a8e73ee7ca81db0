//! `--pp N` (pipeline parallelism, `vramsim_models::pipeline`), rank by rank: each pipeline rank
//! holds its own stages (the first the embeddings, the last the head and the loss), runs its own
//! schedule (1F1B: `min(m, pp − stage)` micro-batches in flight) and so plays its own role: every
//! rank is lowered and replayed once, and the layout fits only if every rank fits. The top-level
//! report is the worst rank's (an out-of-memory one first, then the largest peak reserved).
//! Sweeps (`whatif`, `max-batch`) take the rank with the largest peak allocated, which the trace
//! alone decides (each allocation's size rounded as the caching allocator rounds it).

use std::fmt::Write as _;

use anyhow::Result;
use rayon::prelude::*;
use serde_json::{json, Value};
use vramsim_models::pipeline::{self, rank_actions};
use vramsim_models::zoo::Arch;
use vramsim_models::{Graph, Recipe};
use vramsim_traces::{Event, Trace};

use crate::predict::{replay_step, Lowered, PredictArgs};
use crate::ranks::RankRole;

/// Whether `recipe` is a pipeline of two or more stages.
pub fn is_pipeline(recipe: &Recipe) -> bool {
    recipe.parallel.pp > 1
}

/// Whether `recipe`'s ranks play different roles that are each lowered and replayed: the
/// pipeline ranks, or the context-parallel ranks (`crate::context_parallel`).
pub fn is_rank_by_rank(recipe: &Recipe) -> bool {
    is_pipeline(recipe) || crate::context_parallel::is_context_parallel(recipe)
}

/// How many ranks `args` lowers one by one: the pipeline's times the context-parallel ones
/// (rank `r` is pipeline rank `r / cp`, cp rank `r % cp`: `predict`'s `assemble`).
fn rank_count(args: &PredictArgs) -> u32 {
    args.pp.max(1) * args.cp.max(1)
}

/// The graph of pipeline rank `recipe.parallel.stage`: the model built for one micro-batch, cut
/// to the rank's stages (`vramsim_models::pipeline::rank_graph`).
pub fn rank_graph(arch: &Arch, recipe: &Recipe) -> Result<Graph> {
    let mut r = recipe.clone();
    r.batch = recipe.parallel.replica_batch(recipe.batch);
    let g = arch.build(&r)?;
    Ok(pipeline::rank_graph(&g, &recipe.parallel)?)
}

/// The most bytes a trace holds allocated at once, each request rounded as the caching
/// allocator rounds it by default (`round_size`): its peak allocated.
fn peak_allocated(t: &Trace) -> u64 {
    let config = vramsim_sim::config::AllocatorConfig::default();
    let mut live: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    let (mut now, mut max) = (0u64, 0u64);
    for e in &t.events {
        match e {
            Event::Alloc { id, size, .. } => {
                let s = vramsim_sim::rounding::round_size(*size, &config);
                live.insert(id.to_string(), s);
                now += s;
                max = max.max(now);
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

/// Every rank's lowering, by rank (in parallel: each pipeline rank is lowered on its own).
fn lower_ranks(args: &PredictArgs, pp: u32) -> Result<Vec<Lowered>> {
    (0..pp)
        .into_par_iter()
        .map(|rank| crate::predict::lower_step_device(args, rank))
        .collect()
}

/// The global ranks that play pipeline rank `rank`'s role: torchtitan's device mesh puts `pp`
/// outermost (`ParallelDims._build_mesh_without_ep`, `torchtitan/distributed/parallel_dims.py`:
/// `["pp", "dp_replicate", "dp_shard", "cp", "tp"]`), so
/// pipeline rank `r` is the block `r·dp·tp .. (r + 1)·dp·tp`; its tensor-parallel ranks hold equal
/// shards of the same stage (one role).
/// With context parallelism the block is `dp·cp·tp` and rank `r` is pipeline rank `r / cp`, cp rank
/// `r % cp` (`crate::context_parallel::cp_ranks` inside the block).
fn stage_ranks(recipe: &Recipe, rank: u32) -> Vec<u32> {
    let p = &recipe.parallel;
    if crate::context_parallel::is_context_parallel(recipe) {
        let cp = p.cp.max(1);
        let block = p.dp.max(1) * cp * p.tp.max(1);
        let stage = rank / cp;
        return crate::context_parallel::cp_ranks(recipe, rank % cp)
            .into_iter()
            .map(|r| stage * block + r)
            .collect();
    }
    let block = p.dp.max(1) * p.tp.max(1);
    (rank * block..(rank + 1) * block).collect()
}

/// The rank a sweep evaluates: the one with the largest peak allocated.
pub fn lower_worst_rank(args: &PredictArgs) -> Result<Lowered> {
    let ranks = lower_ranks(args, rank_count(args))?;
    let worst = (0..ranks.len())
        .max_by_key(|&i| (peak_allocated(ranks[i].trace()), std::cmp::Reverse(i)))
        .unwrap_or(0);
    Ok(ranks.into_iter().nth(worst).expect("one rank at least"))
}

/// What one rank holds, in words.
fn role_name(recipe: &Recipe, rank: u32) -> String {
    if crate::context_parallel::is_context_parallel(recipe) {
        let cp = recipe.parallel.cp;
        let ring = crate::context_parallel::role_name(recipe, rank % cp);
        if !is_pipeline(recipe) {
            return ring;
        }
        let mut single = recipe.clone();
        single.parallel.cp = 1;
        single.parallel.tp = 1;
        return format!("{} × {ring}", role_name(&single, rank / cp));
    }
    let p = &recipe.parallel;
    let stages: Vec<u32> = (0..pipeline::chunks_per_rank(p.pp_schedule))
        .map(|k| rank + k * p.pp)
        .collect();
    let n = pipeline::num_stages(p);
    let m = pipeline::microbatches(p, recipe.batch).unwrap_or(1);
    let in_flight = pipeline::max_in_flight(&rank_actions(p.pp_schedule, p.pp, rank, m));
    let mut what = Vec::new();
    if stages.contains(&0) {
        what.push("embeddings");
    }
    if stages.contains(&(n - 1)) {
        what.push("head and loss");
    }
    let holds = if what.is_empty() {
        String::new()
    } else {
        format!(", {}", what.join(", "))
    };
    let tp = if p.tp > 1 {
        format!(" × {}", crate::ranks::tp_role(p))
    } else {
        String::new()
    };
    format!(
        "pipeline rank {rank} (stage{} {}{holds}; {in_flight} micro-batch{} in flight){tp}",
        if stages.len() > 1 { "s" } else { "" },
        stages
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        if in_flight == 1 { "" } else { "es" }
    )
}

/// Lowers and replays every pipeline rank of `args`; returns the worst rank's lowering (an
/// out-of-memory rank first, then the largest peak reserved) and every rank's role. The ranks run
/// in parallel and each lowering is dropped once replayed unless it is the worst so far (a
/// 126-layer stage's trace is large; holding all of them is what would cost time).
pub fn rank_roles(args: &PredictArgs) -> Result<(Lowered, Vec<RankRole>)> {
    type Key = (bool, u64, std::cmp::Reverse<u32>);
    let worst: std::sync::Mutex<Option<(Key, Lowered)>> = std::sync::Mutex::new(None);
    let roles = (0..rank_count(args))
        .into_par_iter()
        .map(|rank| {
            let lowered = crate::predict::lower_step_device(args, rank)?;
            let (report, _) = replay_step(&lowered, &args.machine, 0, false)?;
            let role = RankRole::of(
                &report,
                role_name(&lowered.recipe, rank),
                stage_ranks(&lowered.recipe, rank),
            );
            let key = (!role.fits, role.peak_reserved, std::cmp::Reverse(rank));
            let mut w = worst.lock().unwrap_or_else(|e| e.into_inner());
            if w.as_ref().is_none_or(|(k, _)| key > *k) {
                *w = Some((key, lowered));
            }
            Ok(role)
        })
        .collect::<Result<Vec<_>>>()?;
    let (_, lowered) = worst
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .expect("one rank at least");
    Ok((lowered, roles))
}

/// The layout's data- and tensor-parallel dimensions besides the pipeline, with the world size
/// (empty for a pipeline alone).
fn other_dims(recipe: &Recipe) -> String {
    let p = &recipe.parallel;
    let mut out = String::new();
    if p.dp > 1 {
        let _ = write!(out, " × dp {} --shard {}", p.dp, p.shard);
    }
    if p.tp > 1 {
        let _ = write!(out, " × tp {}{}", p.tp, if p.sp { " --sp" } else { "" });
    }
    if p.cp > 1 {
        let _ = write!(
            out,
            " × cp {} ({} tokens of {} per rank, ring attention)",
            p.cp,
            p.local_seq(recipe.seq),
            recipe.seq
        );
    }
    if !out.is_empty() {
        let _ = write!(out, " ({} ranks)", p.world_size());
    }
    out
}

/// `predict`'s lines for a pipeline layout: the split and schedule, then one line per rank.
pub fn to_table(recipe: &Recipe, roles: &[RankRole]) -> String {
    let p = &recipe.parallel;
    let mut out = String::new();
    let m = pipeline::microbatches(p, recipe.batch).unwrap_or(1);
    let _ = writeln!(
        out,
        "layout     pp {} × {} ({} stages){}, {} micro-batches of {} (batch {}); each rank replayed; fits only if every rank fits",
        p.pp,
        p.pp_schedule,
        pipeline::num_stages(p),
        other_dims(recipe),
        m,
        recipe.batch / u64::from(m),
        recipe.batch
    );
    out.push_str(&crate::ranks::to_table_lines(roles));
    out.push_str(&crate::ranks::decides_line(roles));
    out
}

/// The `pipeline` object of `predict --json`.
pub fn to_json(recipe: &Recipe, roles: &[RankRole]) -> Value {
    let p = &recipe.parallel;
    let m = pipeline::microbatches(p, recipe.batch).unwrap_or(1);
    let worst = roles
        .iter()
        .max_by_key(|r| (!r.fits, r.peak_reserved))
        .map(|r| r.ranks.clone())
        .unwrap_or_default();
    json!({
        "pp": p.pp,
        "schedule": p.pp_schedule.to_string(),
        "stages": pipeline::num_stages(p),
        "microbatches": m,
        "microbatch_size": recipe.batch / u64::from(m),
        "in_flight": (0..p.pp).map(|r| pipeline::max_in_flight(&rank_actions(p.pp_schedule, p.pp, r, m))).collect::<Vec<_>>(),
        "fits": roles.iter().all(|r| r.fits),
        "deciding_ranks": worst,
        "loop": p.pp_loop.to_string(),
    })
}

/// The layouts `vramsim bench --layouts` times through `predict` (issue 12, "Scale on paper"):
/// name and `predict` arguments. Llama-3.1-405B at seq 8192 on H100s, bf16, full activation
/// checkpointing, TP 8 with sequence parallelism × PP 8 (1F1B, 32 micro-batches of 1): 64 ranks,
/// eight roles (one per pipeline stage; the tensor-parallel ranks of a stage share its role).
/// torchtitan's published layout adds FSDP 8 over these (512 GPUs, FSDP2 inside each stage:
/// `vramsim_models::lower`'s `fsdp.rs`); its ranks of one stage are one role.
pub const BENCH_LAYOUTS: [(&str, &[&str]); 2] = [
    (
        "llama3-405b tp 8 --sp × pp 8 (64 ranks)",
        &[
            "--model",
            "llama3-405b",
            "--seq",
            "8192",
            "--batch",
            "32",
            "--precision",
            "bf16",
            "--checkpoint",
            "full",
            "--tp",
            "8",
            "--sp",
            "--pp",
            "8",
            "--gpu",
            "h100-80gb",
        ],
    ),
    (
        "llama3-405b fsdp2 8 × tp 8 --sp × pp 8 (512 ranks)",
        &[
            "--model",
            "llama3-405b",
            "--seq",
            "8192",
            "--batch",
            "32",
            "--precision",
            "bf16",
            "--checkpoint",
            "full",
            "--dp",
            "8",
            "--shard",
            "fsdp2",
            "--tp",
            "8",
            "--sp",
            "--pp",
            "8",
            "--gpu",
            "h100-80gb",
        ],
    ),
];

/// One timed layout of [`BENCH_LAYOUTS`].
#[derive(Debug, Clone)]
pub struct LayoutBench {
    /// The layout's name.
    pub name: &'static str,
    /// World size.
    pub ranks: u32,
    /// Roles replayed.
    pub roles: usize,
    /// Wall time of `predict` (best of three), seconds.
    pub seconds: f64,
    /// The worst rank's peak reserved, bytes.
    pub worst_peak_reserved: u64,
    /// The worst rank's peak allocated, bytes.
    pub worst_peak_allocated: u64,
    /// Whether every rank fits.
    pub fits: bool,
}

/// Times `predict` on each of [`BENCH_LAYOUTS`] (best of three runs; target < 1 s on 2 cores).
pub fn bench_layouts() -> Result<Vec<LayoutBench>> {
    let mut out = Vec::new();
    for (name, argv) in BENCH_LAYOUTS {
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        let args: PredictArgs = crate::parse_args("predict", &argv)?;
        let mut best = f64::INFINITY;
        let mut last = None;
        for _ in 0..3 {
            let t0 = std::time::Instant::now();
            let p = crate::predict::predict(&args)?;
            best = best.min(t0.elapsed().as_secs_f64());
            last = Some(p);
        }
        let p = last.expect("three runs");
        out.push(LayoutBench {
            name,
            ranks: p.lowered.recipe.parallel.world_size(),
            roles: p.stages.len(),
            seconds: best,
            worst_peak_reserved: p.report.peak_reserved(),
            worst_peak_allocated: p.report.peak_allocated(),
            fits: p.stages.iter().all(|r| r.fits),
        });
    }
    Ok(out)
}

/// `vramsim bench --layouts`: each layout's wall time and its worst rank's peaks.
pub fn print_layout_bench(as_json: bool) -> Result<()> {
    let results = bench_layouts()?;
    if as_json {
        let list: Vec<Value> = results
            .iter()
            .map(|b| {
                json!({
                    "layout": b.name,
                    "ranks": b.ranks,
                    "roles": b.roles,
                    "seconds": b.seconds,
                    "worst_peak_reserved_bytes": b.worst_peak_reserved,
                    "worst_peak_allocated_bytes": b.worst_peak_allocated,
                    "fits": b.fits,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "layouts": list }))?
        );
        return Ok(());
    }
    println!("predict on large layouts, best of 3 (target on 2 cores: < 1 s)");
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    for b in &results {
        println!(
            "  {:<52} {:>6.3} s, {} roles replayed for {} ranks; worst rank: peak allocated {:.2} GiB, reserved {:.2} GiB; {}",
            b.name,
            b.seconds,
            b.roles,
            b.ranks,
            gib(b.worst_peak_allocated),
            gib(b.worst_peak_reserved),
            if b.fits { "every rank fits" } else { "out of memory" }
        );
    }
    Ok(())
}
