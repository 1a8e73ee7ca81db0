//! `vramsim recommend --gpus N`: the parallel layouts of N GPUs that reach a global batch, fastest
//! first under the step-time model (compute, communication and pipeline bubble: [`crate::steptime`],
//! [`crate::commtime`]).
//!
//! # The search
//!
//! * **Layouts**: every `dp × tp × pp × cp = N` with the tensor-parallel group inside a node (`tp`
//!   ≤ 8, [`crate::commtime::GPUS_PER_NODE`]) and context parallelism `cp` ∈ {1, 2, 4, 8}; with `dp`
//!   above 1 every data-parallel mode vramsim models (`ddp`, `zero1`, `zero2`, `zero3`, `fsdp2`)
//!   and their offloads, `none` otherwise. `cp` above 1 goes with FSDP2 over dp × cp (and its
//!   parameter offload), the layouts `--cp` models
//!   (`vramsim_models::context_parallel::validate`); the model's and the sequence's checks (a
//!   causal LM on flash or cuDNN attention, `--seq` a multiple of `2·cp`) refuse the rest with
//!   their reasons. The `cp` ranks of a data-parallel rank share its samples (each holds
//!   `seq/cp` tokens of them).
//! * **Recipes**: precision `amp-bf16` and `bf16` (what multi-GPU training runs in; `--precision`
//!   fixes one), checkpointing `none`, `selective` and `full` (`--checkpoint` fixes one).
//! * Each data-parallel rank takes `global batch / dp` samples per step as micro-batch ×
//!   accumulation; the largest micro-batch that fits is found by bisection over the divisors, as
//!   `recommend` does for one GPU.
//! * **Branch and bound**: a candidate's step at its largest conceivable micro-batch (no
//!   accumulation) is a lower bound of its step time (a smaller micro-batch repeats the same work in
//!   more, smaller kernels, and syncs DDP more often). Candidates are searched in the order of that
//!   bound, a few at a time in parallel, until the bound of the next is slower than the `--top`-th
//!   layout found: the layouts listed are exactly the fastest that fit, without replaying the rest.
//! * Candidates a check refuses (a tensor-parallel size that does not divide the heads, ZeRO without
//!   bf16, ...) are counted and their reasons listed, never dropped silently.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{bail, Result};
use rayon::prelude::*;
use serde_json::{json, Value};
use vramsim_models::{Graph, Shard};
use vramsim_sim::format::format_size;

use crate::commtime::GPUS_PER_NODE;
use crate::predict::{step_recipe, PredictArgs};
use crate::recommend::{largest_that_fits, Recipe, RecommendArgs};
use crate::steptime::{perf_for, GpuPerf, StepWork};
use crate::sweep::{FixedOptions, Setting};

/// Precisions searched when `--precision` is not given.
const PRECISIONS: &[&str] = &["amp-bf16", "bf16"];
/// Checkpointing policies searched when `--checkpoint` is not given.
const CHECKPOINTS: &[&str] = &["none", "selective", "full"];
/// Data-parallel modes and offloads tried when `dp` is above 1.
const MODES: &[(&str, &str)] = &[
    ("ddp", "none"),
    ("zero1", "none"),
    ("zero1", "optimizer"),
    ("zero2", "none"),
    ("zero2", "optimizer"),
    ("zero3", "none"),
    ("zero3", "optimizer"),
    ("zero3", "params"),
    ("fsdp2", "none"),
    ("fsdp2", "params"),
];

/// Context-parallel degrees searched (`--cp`): powers of two up to a node, as torchtitan's
/// head-tail load balancer pairs the sequence's `2·cp` chunks.
const CPS: &[u32] = &[1, 2, 4, 8];
/// Data-parallel modes and offloads tried with `cp` above 1: FSDP2 shards over dp × cp
/// (`vramsim_models::context_parallel::validate`).
const CP_MODES: &[(&str, &str)] = &[("fsdp2", "none"), ("fsdp2", "params")];

/// One layout and recipe of the search, before its micro-batch is chosen.
#[derive(Clone, Debug)]
struct Candidate {
    /// dp, tp, pp, shard, offload, precision, checkpoint, cp.
    settings: Vec<Setting>,
    /// Samples per data-parallel rank per step.
    per_rank: u64,
    /// Its step time at micro-batch `per_rank` without accumulation (a lower bound), ms.
    bound_ms: f64,
}

/// The answer of `vramsim recommend --gpus N`.
pub struct LayoutSearch {
    /// GPUs.
    pub gpus: u32,
    /// Samples per optimizer step over all ranks.
    pub global_batch: u64,
    /// The layouts that fit, fastest first (at most `top`).
    pub found: Vec<Recipe>,
    /// Candidates (layout × mode × precision × checkpointing) considered.
    pub candidates: usize,
    /// Candidates searched for their largest micro-batch.
    pub searched: usize,
    /// Candidates skipped because their lower bound could not enter the list.
    pub pruned: usize,
    /// Candidates a check refused: (reason, how many).
    pub refused: Vec<(String, usize)>,
    /// The fixed options, less those a candidate sets.
    pub base: FixedOptions,
}

/// Options a candidate sets, dropped from the fixed ones.
const SET: &[&str] = &[
    "dp",
    "tp",
    "pp",
    "shard",
    "offload",
    "precision",
    "checkpoint",
    "batch",
    "accum",
    "cp",
];

/// Runs the search of `recommend --gpus N`.
pub fn search(args: &RecommendArgs, gpus: u32) -> Result<LayoutSearch> {
    search_with(args, gpus, true)
}

/// [`search`], with `prune` false searching every candidate instead of stopping at the lower bound
/// (the same answer, slower: for tests and audits of the bound).
pub fn search_with(args: &RecommendArgs, gpus: u32, prune: bool) -> Result<LayoutSearch> {
    let g = args.global_batch;
    if g == 0 {
        bail!("--global-batch must be 1 or more");
    }
    if gpus == 0 {
        bail!("--gpus must be 1 or more");
    }
    let fixed = &args.predict;
    for key in [
        "dp",
        "tp",
        "pp",
        "shard",
        "offload",
        "world-size",
        "batch",
        "accum",
        "cp",
    ] {
        if fixed.has(key) {
            bail!("recommend --gpus searches --{key} itself: leave it out");
        }
    }
    if fixed.has("inference") {
        bail!("recommend plans training steps; --inference has no global batch to reach");
    }
    let value = |key: &str| fixed.value(key).map(str::to_string);
    let precisions: Vec<String> = match value("precision") {
        Some(p) => vec![p],
        None => PRECISIONS.iter().map(|s| s.to_string()).collect(),
    };
    let checkpoints: Vec<String> = match value("checkpoint") {
        Some(c) => vec![c],
        None => CHECKPOINTS.iter().map(|s| s.to_string()).collect(),
    };
    let base = FixedOptions {
        given: fixed
            .given
            .iter()
            .filter(|(k, _)| !SET.contains(&k.as_str()))
            .cloned()
            .collect(),
    };
    let mut refused: HashMap<String, usize> = HashMap::new();
    let mut settings = Vec::new();
    for (dp, tp, pp, cp) in layouts(gpus) {
        if !g.is_multiple_of(u64::from(dp)) {
            *refused
                .entry(format!(
                    "global batch {g} does not split over {dp} data-parallel ranks"
                ))
                .or_default() += 1;
            continue;
        }
        let modes: Vec<(&str, &str)> = if cp > 1 {
            CP_MODES.to_vec()
        } else if dp == 1 {
            vec![("none", "none")]
        } else {
            MODES
                .iter()
                .copied()
                .filter(|(shard, _)| shard.parse::<Shard>().is_ok())
                .collect()
        };
        for (shard, offload) in modes {
            for p in &precisions {
                for c in &checkpoints {
                    // predict's defaults are left out of the candidate's command line
                    let layout = [
                        ("dp", dp.to_string(), "1"),
                        ("tp", tp.to_string(), "1"),
                        ("pp", pp.to_string(), "1"),
                        ("shard", shard.to_string(), "none"),
                        ("offload", offload.to_string(), "none"),
                        ("cp", cp.to_string(), "1"),
                    ];
                    let mut s: Vec<Setting> = layout
                        .into_iter()
                        .filter(|(_, v, default)| v != default)
                        .map(|(k, v, _)| (k.to_string(), v))
                        .collect();
                    s.push(("precision".to_string(), p.clone()));
                    s.push(("checkpoint".to_string(), c.clone()));
                    settings.push((s, g / u64::from(dp)));
                }
            }
        }
    }
    let candidates_considered = settings.len() + refused.values().sum::<usize>();
    // Lower bounds, graphs shared by the candidates that build the same one.
    let graphs: Mutex<HashMap<String, Arc<Graph>>> = Mutex::new(HashMap::new());
    let perf: OnceLock<&'static GpuPerf> = OnceLock::new();
    let bounded: Vec<Result<Candidate, String>> = settings
        .into_par_iter()
        .map(|(s, per_rank)| {
            bound_ms(&base, &s, per_rank, &graphs, &perf).map(|bound_ms| Candidate {
                settings: s,
                per_rank,
                bound_ms,
            })
        })
        .collect();
    let mut candidates = Vec::new();
    for b in bounded {
        match b {
            Ok(c) => candidates.push(c),
            Err(reason) => *refused.entry(reason).or_default() += 1,
        }
    }
    candidates.sort_by(|a, b| a.bound_ms.total_cmp(&b.bound_ms));

    let top = args.top.max(1);
    let wave = rayon::current_num_threads().max(2);
    let mut found: Vec<Recipe> = Vec::new();
    let mut searched = 0;
    let mut next = 0;
    while next < candidates.len() {
        let threshold = if prune && found.len() >= top {
            found[top - 1].evaluated.step.step_ms
        } else {
            f64::INFINITY
        };
        let batch: Vec<&Candidate> = candidates[next..]
            .iter()
            .take(wave)
            // a bound equal to the threshold may still tie and win on memory
            .take_while(|c| c.bound_ms <= threshold)
            .collect();
        if batch.is_empty() {
            break;
        }
        next += batch.len();
        searched += batch.len();
        let outcomes: Vec<Result<Option<Recipe>, String>> = batch
            .par_iter()
            .map(|c| {
                let divisors: Vec<u64> = (1..=c.per_rank)
                    .filter(|d| c.per_rank.is_multiple_of(*d))
                    .collect();
                let settings_for = |b: u64| {
                    let mut s = c.settings.clone();
                    s.push(("batch".to_string(), b.to_string()));
                    s.push(("accum".to_string(), (c.per_rank / b).to_string()));
                    s
                };
                largest_that_fits(&base, &settings_for, &divisors, args.headroom, 0).map(|r| r.ok())
            })
            .collect();
        for o in outcomes {
            match o {
                Ok(Some(r)) => found.push(r),
                Ok(None) => {}
                Err(reason) => *refused.entry(reason).or_default() += 1,
            }
        }
        found.sort_by(Recipe::faster_first);
        found.truncate(top);
    }
    let mut refused: Vec<(String, usize)> = refused.into_iter().collect();
    refused.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    if found.is_empty() {
        bail!(
            "no layout of {gpus} GPUs reaches global batch {g}: {} candidates searched, none fits{}",
            searched,
            match refused.first() {
                Some((reason, n)) => format!("; {n} refused, e.g.: {reason}"),
                None => String::new(),
            }
        );
    }
    Ok(LayoutSearch {
        gpus,
        global_batch: g,
        found,
        candidates: candidates_considered,
        searched,
        pruned: candidates.len() - next,
        refused,
        base,
    })
}

/// Every `(dp, tp, pp, cp)` with `dp × tp × pp × cp = gpus`, `tp` within a node and `cp` one of
/// [`CPS`].
fn layouts(gpus: u32) -> Vec<(u32, u32, u32, u32)> {
    let divisors = |n: u32| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = Vec::new();
    for &cp in CPS.iter().filter(|&&c| gpus.is_multiple_of(c)) {
        let rest = gpus / cp;
        for tp in divisors(rest).filter(|&t| t <= GPUS_PER_NODE) {
            for pp in divisors(rest / tp) {
                out.push((rest / tp / pp, tp, pp, cp));
            }
        }
    }
    out
}

/// A candidate's step time at micro-batch `per_rank` without accumulation: a lower bound of its
/// step at any micro-batch (see the module doc), or the reason a check refuses it.
fn bound_ms(
    base: &FixedOptions,
    settings: &[Setting],
    per_rank: u64,
    graphs: &Mutex<HashMap<String, Arc<Graph>>>,
    perf: &OnceLock<&'static GpuPerf>,
) -> Result<f64, String> {
    let mut s = settings.to_vec();
    s.push(("batch".to_string(), per_rank.to_string()));
    s.push(("accum".to_string(), "1".to_string()));
    let args: PredictArgs =
        crate::parse_args("predict", &base.args(&s)).map_err(|e| format!("{e:#}"))?;
    let (arch, recipe, _) = step_recipe(&args).map_err(|e| format!("{e:#}"))?;
    // the graph depends on the shapes (batch, tp, pp stage), the precision's casts and the
    // checkpointing (a checkpointed model's graph differs) and the rank's sequence (cp), not on
    // the data-parallel mode
    let key = format!(
        "{}/{}/{}/{}/{}/{}",
        recipe.batch,
        recipe.parallel.tp,
        recipe.parallel.pp,
        recipe.precision,
        recipe.checkpointing,
        recipe.parallel.cp
    );
    let cached = graphs.lock().ok().and_then(|g| g.get(&key).cloned());
    let graph = match cached {
        Some(g) => g,
        None => {
            let g = Arc::new(
                crate::dataparallel::device_graph(&arch, &recipe).map_err(|e| format!("{e:#}"))?,
            );
            if let Ok(mut map) = graphs.lock() {
                map.insert(key, g.clone());
            }
            g
        }
    };
    // the machine options are the same for every candidate: the GPU's figures are read once
    let perf = match perf.get() {
        Some(p) => *p,
        None => {
            let device = args
                .machine
                .build()
                .map_err(|e| format!("{e:#}"))?
                .allocator
                .device()
                .clone();
            *perf.get_or_init(|| perf_for(&device).0)
        }
    };
    Ok(StepWork::of(&graph, &recipe).time(perf).step_ms)
}

impl LayoutSearch {
    /// `recommend --gpus N --json`'s document.
    pub fn to_json(&self) -> Value {
        let first = &self.found[0].evaluated;
        json!({
            "gpus": self.gpus,
            "global_batch": self.global_batch,
            "model": first.prediction.arch.name(),
            "device": {"name": first.report.device.name, "total_memory_bytes": first.report.device.total_memory},
            "candidates": self.candidates,
            "searched": self.searched,
            "pruned": self.pruned,
            "refused": self.refused.iter().map(|(r, n)| json!({"reason": r, "count": n})).collect::<Vec<_>>(),
            "layouts": self.found.iter().enumerate().map(|(i, r)| {
                let e = &r.evaluated;
                let rec = &e.prediction.recipe;
                let par = &rec.parallel;
                json!({
                    "rank": i + 1,
                    "dp": par.dp,
                    "tp": par.tp,
                    "pp": par.pp,
                    "cp": par.cp,
                    "shard": par.shard.to_string(),
                    "offload": par.offload.to_string(),
                    "precision": rec.precision.to_string(),
                    "checkpoint": rec.checkpointing.to_string(),
                    "batch": rec.batch,
                    "accum": rec.accum,
                    "peak_device_used_bytes": e.report.peak_device_used(),
                    "step_ms": e.step.step_ms,
                    "comm_ms": e.step.comm_ms,
                    "samples_per_s": self.global_batch as f64 / (e.step.step_ms / 1e3),
                    "command": self.base.command_line(&r.settings),
                })
            }).collect::<Vec<_>>(),
        })
    }

    /// `recommend --gpus N`'s table.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let first = &self.found[0].evaluated;
        let device = &first.report.device;
        let _ = writeln!(
            out,
            "recommend  {} to global batch {} on {} × {} ({} each): {} candidate layouts × recipes, {} searched, {} pruned by their lower bound",
            first.prediction.arch.name(),
            self.global_batch,
            self.gpus,
            device.name,
            format_size(device.total_memory),
            self.candidates,
            self.searched,
            self.pruned
        );
        let _ = writeln!(
            out,
            "           each with its largest micro-batch that fits; fastest first by estimated step time (compute, communication, pipeline bubble)\n"
        );
        let _ = writeln!(
            out,
            "{:>4}  {:<22} {:<16} {:<9} {:<10} {:>13}  {:>12}  {:>9}  {:>8}  {:>10}",
            "rank",
            "dp × tp × pp × cp",
            "shard / offload",
            "precision",
            "checkpoint",
            "batch × accum",
            "device used",
            "step (ms)",
            "comm",
            "samples/s"
        );
        for (i, r) in self.found.iter().enumerate() {
            let e = &r.evaluated;
            let rec = &e.prediction.recipe;
            let par = &rec.parallel;
            let _ = writeln!(
                out,
                "{:>4}  {:<22} {:<16} {:<9} {:<10} {:>13}  {:>12}  {:>9.1}  {:>8.1}  {:>10.1}",
                i + 1,
                format!("{} × {} × {} × {}", par.dp, par.tp, par.pp, par.cp),
                format!("{} / {}", par.shard, par.offload),
                rec.precision.to_string(),
                rec.checkpointing.to_string(),
                format!("{} × {}", rec.batch, rec.accum),
                format_size(e.report.peak_device_used()),
                e.step.step_ms,
                e.step.comm_ms,
                self.global_batch as f64 / (e.step.step_ms / 1e3)
            );
            let _ = writeln!(out, "      {}", self.base.command_line(&r.settings));
        }
        if !self.refused.is_empty() {
            let _ = writeln!(
                out,
                "\nrefused ({} candidates):",
                self.refused.iter().map(|(_, n)| n).sum::<usize>()
            );
            const SHOWN: usize = 6;
            for (reason, n) in self.refused.iter().take(SHOWN) {
                let _ = writeln!(out, "  {n:>4} × {reason}");
            }
            if self.refused.len() > SHOWN {
                let _ = writeln!(
                    out,
                    "  ({} more reasons, {} candidates: --json lists them all)",
                    self.refused.len() - SHOWN,
                    self.refused[SHOWN..].iter().map(|(_, n)| n).sum::<usize>()
                );
            }
        }
        let _ = writeln!(
            out,
            "\nstep times come from a FLOP/bandwidth model with ring collectives over the preset's links (see `vramsim whatif --help`); they rank layouts, they do not time them"
        );
        out
    }
}
