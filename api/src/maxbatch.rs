//! `vramsim max-batch`: the largest batch (or, with `--max-seq`, sequence length) whose training step
//! fits the device under the allocator model, found by doubling then bisection with `predict`'s own
//! evaluation, with the first size that does not fit and PyTorch's out-of-memory message for it.
//!
//! The search assumes that memory grows with the size, which the caching allocator does not strictly
//! promise (rounding and fragmentation can make a size fit where a smaller one did not); whatever the
//! curve, the answer holds for its neighbours: the size returned was replayed and fits, and the next one
//! was replayed and does not.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use rayon::prelude::*;
use serde_json::{json, Value};
use vramsim_sim::format::format_size;
use vramsim_sim::plot::{
    plot_category_timeline, plot_size_curve, CategorySample, CategoryTimelinePlot, SizeCurvePlot,
    SizePoint,
};

use vramsim_models::graph_template::GraphTemplate;
use vramsim_models::template::BatchTemplate;

use crate::predict::{self, Lowered};
use crate::sweep::{self, Evaluated, FixedOptions, Headroom, OptionSet, Progress, Setting, Wants};
use crate::whatif::step_json;

/// Largest batch tried when no `--limit` is given.
const DEFAULT_BATCH_LIMIT: u64 = 1 << 16;
/// Largest sequence tried for models without a position limit.
const DEFAULT_SEQ_LIMIT: u64 = 1 << 20;
/// Timeline points kept for `--timeline`.
const TIMELINE_POINTS: usize = 4000;
/// Sizes evaluated for the `--plot` curve, besides those the search tried.
const CURVE_POINTS: u64 = 12;

/// Options of `vramsim max-batch`.
#[derive(Args, Debug)]
pub struct MaxBatchArgs {
    /// Search the longest sequence instead, at --batch (default 1).
    #[arg(long)]
    pub max_seq: bool,
    /// Memory a fit must leave free on the device: a percentage (5%), a fraction (0.05) or a size
    /// (2GiB). Without it, a size fits when its step raises no out-of-memory error.
    #[arg(long, value_parser = Headroom::parse)]
    pub headroom: Option<Headroom>,
    /// Largest size to try (default: 65536 for the batch, the model's positions for the sequence).
    #[arg(long, value_name = "N")]
    pub limit: Option<u64>,
    /// Print the answer as JSON: {"max_batch": B, ...} (or "max_seq").
    #[arg(long)]
    pub json: bool,
    /// Draw peak device memory against the size to a .png or .svg file.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Draw one step at the largest size that fits, by category, to a .png or .svg file.
    #[arg(long, value_name = "FILE")]
    pub timeline: Option<PathBuf>,
    /// The options of `vramsim predict` (`--model` or `--hf-config` is required; not --batch, which is
    /// searched, unless --max-seq).
    #[command(flatten)]
    pub predict: FixedOptions,
}

/// One size tried.
pub struct Probe {
    /// The size.
    pub size: u64,
    /// What `predict` made of it.
    pub evaluated: Evaluated,
    /// Whether it fits (no out-of-memory error, and within the headroom).
    pub fits: bool,
    /// Why it does not fit.
    pub reason: Option<String>,
}

/// Why a size does not fit, or `None` when it does.
pub fn misfit(evaluated: &Evaluated, headroom: Option<Headroom>) -> Option<String> {
    if let Some(message) = evaluated.oom_message() {
        return Some(message.to_string());
    }
    let headroom = headroom?;
    let total = evaluated.report.device.total_memory;
    let limit = total.saturating_sub(headroom.bytes(total));
    let used = evaluated.report.peak_device_used();
    (used > limit).then(|| {
        format!(
            "peak device use {} is above the limit of {} ({} total less {} headroom)",
            format_size(used),
            format_size(limit),
            format_size(total),
            format_size(headroom.bytes(total))
        )
    })
}

/// The result of a search.
pub struct Search {
    /// `batch` or `seq`.
    pub key: &'static str,
    /// The largest size that fits.
    pub largest: Probe,
    /// The first size above it that does not, unless the limit was reached.
    pub first_failure: Option<Probe>,
    /// Every size tried: (size, peak device use, fits).
    pub tried: Vec<(u64, u64, bool)>,
    /// The largest size the search could try.
    pub limit: u64,
}

/// Evaluates sizes of one search: `fixed` with `key` set to each size (and `extra`). A batch search
/// lowers once per structure: the lowerings of the first two batches of at least 2 it tries fit a
/// [`BatchTemplate`], trusted once it reproduces the next fresh lowering byte for byte (the search
/// tries next the bound the candidate gives, [`Prober::bound`]); later batches are written by it (`predict::lower_step_instance`) instead of being lowered.
struct Prober<'a> {
    fixed: &'a FixedOptions,
    key: &'a str,
    extra: &'a [Setting],
    headroom: Option<Headroom>,
    /// Fresh lowerings of batches of at least 2, by batch, until the template is trusted.
    fresh: Vec<(u64, Lowered)>,
    /// A template fitted through the last two fresh lowerings, not yet checked (with the model
    /// graphs' template, where they fit one).
    candidate: Option<(BatchTemplate, Option<GraphTemplate>)>,
    template: Option<BatchTemplate>,
    /// The batches the search walks, `min + (size − 1)·step` for search size `size`: the
    /// multiples of a pipeline's `--microbatches` (`vramsim_models::pipeline::batch_grid`);
    /// `(1, 1)` otherwise, and for a sequence search.
    grid: (u64, u64),
}

impl<'a> Prober<'a> {
    fn new(
        fixed: &'a FixedOptions,
        key: &'a str,
        extra: &'a [Setting],
        headroom: Option<Headroom>,
    ) -> Self {
        Prober {
            fixed,
            key,
            extra,
            headroom,
            fresh: Vec::new(),
            candidate: None,
            template: None,
            grid: (1, 1),
        }
    }

    /// The value of `key` at search size `size` (sizes count from 1).
    fn value(&self, size: u64) -> u64 {
        let (min, step) = self.grid;
        min.saturating_add((size.max(1) - 1).saturating_mul(step))
    }

    /// Evaluates the search's configuration at `size`, keeping `timeline_points` timeline points.
    fn probe(&mut self, size: u64, timeline_points: usize) -> Result<Probe> {
        let (probe, fresh) = self.attempt(size, timeline_points)?;
        if let Some(lowered) = fresh {
            self.learn(size, lowered);
        }
        Ok(probe)
    }

    /// [`Prober::probe`] of several sizes at once, in parallel (each a lowering and a replay of its
    /// own), learning from the fresh lowerings in the order of `sizes`.
    fn probe_many(&mut self, sizes: &[u64]) -> Result<Vec<Probe>> {
        let attempts: Vec<Result<(Probe, Option<Lowered>)>> = sizes
            .par_iter()
            .map(|&size| self.attempt(size, 0))
            .collect();
        let mut probes = Vec::with_capacity(sizes.len());
        for attempt in attempts {
            let (probe, fresh) = attempt?;
            if let Some(lowered) = fresh {
                self.learn(probe.size, lowered);
            }
            probes.push(probe);
        }
        Ok(probes)
    }

    /// The probe at `size`, with the lowering when it was fresh (not from the template).
    fn attempt(&self, size: u64, timeline_points: usize) -> Result<(Probe, Option<Lowered>)> {
        let mut settings = self.extra.to_vec();
        settings.push((self.key.to_string(), self.value(size).to_string()));
        let args = OptionSet::predict().parse(&self.fixed.args(&settings))?;
        let (lowered, fresh) = match &self.template {
            Some(t) if size >= 2 => (predict::lower_step_instance(&args, t)?, false),
            _ => (predict::lower_step(&args)?, true),
        };
        let wants = Wants {
            json: false,
            timeline_points,
        };
        let evaluated = sweep::evaluate_lowered(&lowered, &args, wants).map_err(|e| anyhow!(e))?;
        let reason = misfit(&evaluated, self.headroom);
        let probe = Probe {
            size,
            fits: reason.is_none(),
            reason,
            evaluated,
        };
        Ok((probe, fresh.then_some(lowered)))
    }

    /// Once two batches are lowered, the largest batch that can fit at all: above it the step holds
    /// more requested bytes at once than the device has (less the headroom), which no allocator
    /// serves ([`BatchTemplate::largest_batch_within`]). `fitted` is a probe that fits (its device).
    /// From a candidate not yet checked, the bound only chooses the next size to try, which is then
    /// lowered afresh (and checks the candidate).
    fn bound(&self, fitted: &Probe) -> Option<u64> {
        let total = fitted.evaluated.report.device.total_memory;
        let room = total.saturating_sub(self.headroom.map_or(0, |h| h.bytes(total)));
        self.template
            .as_ref()
            .or(self.candidate.as_ref().map(|(t, _)| t))?
            .largest_batch_within(room)
    }

    /// Takes a fresh lowering at `size` into the template: the last two fit a candidate, the next
    /// one checks it (the candidate is trusted when it writes that lowering byte for byte).
    fn learn(&mut self, size: u64, lowered: Lowered) {
        // batch 1 is a structure of its own (dimensions of 1 change kernels and copies), and
        // DataParallel's devices take chunks of the batch
        if self.key != "batch"
            || size < 2
            || crate::dataparallel::is_multi(&lowered.recipe)
            || crate::pipeline::is_rank_by_rank(&lowered.recipe)
        {
            return;
        }
        if let Some((candidate, graph)) = self.candidate.take() {
            if candidate
                .instantiate(size)
                .is_some_and(|made| made.same_as(&lowered.compact))
            {
                // the graphs' template is checked against this fresh graph too
                let graph = graph.filter(|g| g.writes(&lowered.graph));
                self.template = Some(candidate.with_graph(graph));
                self.fresh.clear();
                return;
            }
        }
        // no candidate yet, or a structure that changed: fit again from the last two
        self.fresh.push((size, lowered));
        if self.fresh.len() > 2 {
            self.fresh.remove(0);
        }
        if let [(b0, l0), (b1, l1)] = &self.fresh[..] {
            self.candidate = BatchTemplate::fit(&l0.compact, *b0, &l1.compact, *b1)
                .map(|t| (t, GraphTemplate::fit(&l0.graph, &l1.graph)));
        }
    }
}

/// Finds the largest `key` (batch or seq) that fits: 1, 2, 4, ... until one does not fit or `limit`,
/// then bisection between the last that fit and the first that did not. A batch search starts at 2
/// (1 only when 2 does not fit: batch 1 is a structure of its own, whose lowering a template of the
/// larger batches cannot use) and, once two batches fit a template, bisects below the bound of the
/// requested bytes ([`Prober::bound`]) instead of doubling on.
pub fn search(
    fixed: &FixedOptions,
    key: &'static str,
    extra: &[Setting],
    headroom: Option<Headroom>,
    limit: Option<u64>,
) -> Result<Search> {
    let what = if key == "seq" { "sequence" } else { "batch" };
    let mut prober = Prober::new(fixed, key, extra, headroom);
    if key == "batch" {
        // a pipeline's schedule accepts only some batches: the search walks those
        let mut settings = extra.to_vec();
        settings.push(("batch".to_string(), "1".to_string()));
        let args = OptionSet::predict().parse(&fixed.args(&settings))?;
        let layout = vramsim_models::Parallel {
            pp: args.pp,
            pp_schedule: args.pp_schedule,
            microbatches: args.microbatches,
            ..vramsim_models::Parallel::default()
        };
        prober.grid = vramsim_models::pipeline::batch_grid(&layout).ok_or_else(|| {
            anyhow!(
                "max-batch with --pp {} needs --microbatches M: the batch is then searched as M micro-batches of batch/M samples (with one sample per micro-batch, the default, a rank's memory barely grows with the batch)",
                args.pp
            )
        })?;
    }
    let (grid_min, grid_step) = prober.grid;
    // `limit` is a batch; the search counts sizes of the grid
    if let Some(l) = limit.filter(|&l| l < grid_min) {
        bail!("--limit {l} is below batch {grid_min}, one sample for each of the pipeline's --microbatches");
    }
    let limit = limit.map(|l| (l - grid_min) / grid_step + 1);
    let mut tried = Vec::new();
    let mut failure: Option<Probe> = None;
    let mut fitted: Option<Probe> = None;
    if key == "batch" && limit.is_none_or(|l| l >= 2) {
        // 2 and 4 at once: the two lowerings that fit the template
        let sizes: &[u64] = if limit.is_none_or(|l| l >= 4) {
            &[2, 4]
        } else {
            &[2]
        };
        for p in prober.probe_many(sizes)? {
            tried.push((p.size, p.evaluated.report.peak_device_used(), p.fits));
            match (&failure, p.fits) {
                // a size above a failure says nothing more
                (Some(_), _) => {}
                (None, true) => fitted = Some(p),
                (None, false) => failure = Some(p),
            }
        }
    }
    let first = match fitted {
        Some(p) => p,
        None => {
            let p = prober.probe(1, 0)?;
            tried.insert(0, (1, p.evaluated.report.peak_device_used(), p.fits));
            p
        }
    };
    if !first.fits {
        let device = &first.evaluated.report.device;
        bail!(
            "even {what} {} does not fit on {} ({} total): {}",
            prober.value(1),
            device.name,
            format_size(device.total_memory),
            first.reason.as_deref().unwrap_or("")
        );
    }
    // a sequence cannot exceed the model's positions, whatever --limit says
    let positions = first.evaluated.prediction.arch.max_positions();
    let limit = match (limit, key) {
        (Some(limit), "seq") => limit.max(1).min(positions.unwrap_or(u64::MAX)),
        (Some(limit), _) => limit.max(1),
        (None, "seq") => positions.unwrap_or(DEFAULT_SEQ_LIMIT),
        (None, _) => DEFAULT_BATCH_LIMIT,
    };
    if key == "seq" && first.evaluated.prediction.arch.max_positions().is_none() {
        bail!(
            "{} takes images (or features), not sequences: --max-seq needs a language model",
            first.evaluated.prediction.arch.name()
        );
    }
    let mut largest = first;
    let mut bounded = false;
    // doubling, until the batch's structure is known: then the requested bytes bound the answer
    // from above, and bisection takes over below that bound
    while largest.size < limit && failure.is_none() {
        let mut try_size = |size: u64, prober: &mut Prober| -> Result<Probe> {
            let p = prober.probe(size, 0)?;
            tried.push((size, p.evaluated.report.peak_device_used(), p.fits));
            Ok(p)
        };
        if let Some(up) = prober.bound(&largest).filter(|&up| !bounded && up < limit) {
            bounded = true;
            let p = try_size(up.max(largest.size) + 1, &mut prober)?;
            if p.fits {
                // cannot happen (the bound is sure); carry on doubling from there
                largest = p;
                continue;
            }
            failure = Some(p);
            break;
        }
        let size = (largest.size * 2).min(limit);
        let p = try_size(size, &mut prober)?;
        if p.fits {
            largest = p;
        } else {
            failure = Some(p);
            break;
        }
    }
    // bisection: `largest` fits, `failure` does not; with two threads, two sizes at once (thirds)
    while let Some(f) = &failure {
        let gap = f.size - largest.size;
        if gap <= 1 {
            break;
        }
        let sizes: Vec<u64> = if gap >= 3 && rayon::current_num_threads() > 1 {
            vec![largest.size + gap / 3, largest.size + 2 * gap / 3]
        } else {
            vec![largest.size + gap / 2]
        };
        let mut failed = false;
        for p in prober.probe_many(&sizes)? {
            tried.push((p.size, p.evaluated.report.peak_device_used(), p.fits));
            match (failed, p.fits) {
                (true, _) => {}
                (false, true) => largest = p,
                (false, false) => {
                    failed = true;
                    failure = Some(p);
                }
            }
        }
    }
    // back from grid sizes to batches
    let to_value = |p: &mut Probe| p.size = prober.value(p.size);
    to_value(&mut largest);
    if let Some(f) = failure.as_mut() {
        to_value(f);
    }
    for t in &mut tried {
        t.0 = prober.value(t.0);
    }
    Ok(Search {
        key,
        largest,
        first_failure: failure,
        tried,
        limit: prober.value(limit),
    })
}

/// The answer of `vramsim max-batch`.
pub struct MaxBatch {
    /// `batch` or `seq`: what was searched.
    pub key: &'static str,
    /// The search: the largest size that fits, the first that does not, every size tried.
    pub found: Search,
    /// The `vramsim predict` command line of the largest size that fits.
    pub command: String,
    /// Seconds the search took.
    pub seconds: f64,
    /// The headroom a fit had to leave.
    pub headroom: Option<Headroom>,
    /// Whether the sequence was searched (`--max-seq`).
    pub max_seq: bool,
}

impl MaxBatch {
    /// `vramsim max-batch --json`'s document.
    pub fn to_json(&self) -> Value {
        let key = self.key;
        let found = &self.found;
        let command = &self.command;
        let seconds = self.seconds;
        let best = &found.largest.evaluated;
        let device = &best.report.device;
        let headroom_bytes = self.headroom.map_or(0, |h| h.bytes(device.total_memory));
        let mut doc = serde_json::Map::new();
        doc.insert(format!("max_{key}"), json!(found.largest.size));
        doc.insert("searched".into(), json!(key));
        doc.insert("model".into(), json!(best.prediction.arch.name()));
        doc.insert(
            "device".into(),
            json!({
                "name": device.name,
                "total_memory_bytes": device.total_memory,
                "context_bytes": device.context_bytes,
            }),
        );
        doc.insert("headroom_bytes".into(), json!(headroom_bytes));
        doc.insert(
            "limit_bytes".into(),
            json!(device.total_memory - headroom_bytes),
        );
        doc.insert(
            "peak_allocated_bytes".into(),
            json!(best.report.peak_allocated()),
        );
        doc.insert(
            "peak_reserved_bytes".into(),
            json!(best.report.peak_reserved()),
        );
        doc.insert(
            "peak_device_used_bytes".into(),
            json!(best.report.peak_device_used()),
        );
        doc.insert(
            "peak_requested_bytes".into(),
            json!(best.report.peak_requested()),
        );
        doc.insert("effective_batch".into(), json!(best.effective_batch()));
        doc.insert("step_time".into(), step_json(best));
        doc.insert(
            "first_failure".into(),
            match &found.first_failure {
                None => Value::Null,
                Some(f) => json!({
                    key: f.size,
                    "reason": if f.evaluated.oom_message().is_some() { "oom" } else { "headroom" },
                    "message": f.reason,
                    "peak_device_used_bytes": f.evaluated.report.peak_device_used(),
                }),
            },
        );
        doc.insert("limit_reached".into(), json!(found.first_failure.is_none()));
        doc.insert("search_limit".into(), json!(found.limit));
        doc.insert(
        "tried".into(),
        found
            .tried
            .iter()
            .map(|&(size, used, fits)| json!({key: size, "fits": fits, "peak_device_used_bytes": used}))
            .collect(),
    );
        doc.insert("command".into(), json!(command));
        doc.insert("seconds".into(), json!(seconds));
        Value::Object(doc)
    }

    /// `vramsim max-batch`'s text.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let key = self.key;
        let found = &self.found;
        let command = &self.command;
        let seconds = self.seconds;
        let best = &found.largest.evaluated;
        let device = &best.report.device;
        let headroom_bytes = self.headroom.map_or(0, |h| h.bytes(device.total_memory));
        let what = if self.max_seq { "sequence" } else { "batch" };
        let _ = writeln!(
            out,
            "model       {}, {}",
            best.prediction.arch.name(),
            recipe_text(best, key)
        );
        let _ = writeln!(
            out,
            "device      {}, {} total{}",
            device.name,
            format_size(device.total_memory),
            match self.headroom {
                Some(_) => format!(
                    ", {} kept free (fits below {})",
                    format_size(headroom_bytes),
                    format_size(device.total_memory - headroom_bytes)
                ),
                None => String::new(),
            }
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
        "{:<31}{:>7}   peak device used {} (allocated {}, reserved {}), estimated step {:.1} ms",
        format!("largest {what} that fits"),
        found.largest.size,
        format_size(best.report.peak_device_used()),
        format_size(best.report.peak_allocated()),
        format_size(best.report.peak_reserved()),
        best.step.step_ms
    );
        let _ = match &found.first_failure {
            Some(f) => writeln!(
                out,
                "{:<31}{:>7}   {}",
                format!("first {what} that does not fit"),
                f.size,
                f.reason.as_deref().unwrap_or("")
            ),
            None if self.max_seq && Some(found.limit) == best.prediction.arch.max_positions() => {
                writeln!(
                    out,
                    "every sequence up to the model's {} positions fits",
                    found.limit
                )
            }
            None => writeln!(
                out,
                "every {what} up to the search limit {} fits (raise --limit to look further)",
                found.limit
            ),
        };
        let mut sizes: Vec<String> = found
            .tried
            .iter()
            .map(|(s, _, fits)| format!("{s}{}", if *fits { "" } else { "✗" }))
            .collect();
        sizes.dedup();
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "tried       {} ({} replays, {:.2} s)",
            sizes.join(" "),
            found.tried.len(),
            seconds
        );
        let _ = writeln!(out, "command     {command}");
        out
    }
}

/// `vramsim max-batch` without the printing: the search, and `--plot` and `--timeline` drawn when
/// given.
pub fn max_batch(args: &MaxBatchArgs) -> Result<MaxBatch> {
    let key: &'static str = if args.max_seq { "seq" } else { "batch" };
    if args.predict.has(key) {
        bail!(
            "--{key} is what max-batch searches{}; leave it out",
            if args.max_seq { " with --max-seq" } else { "" }
        );
    }
    let extra: Vec<Setting> = if args.max_seq && !args.predict.has("batch") {
        vec![("batch".to_string(), "1".to_string())]
    } else {
        Vec::new()
    };
    let t0 = Instant::now();
    let found = search(&args.predict, key, &extra, args.headroom, args.limit)?;
    let seconds = t0.elapsed().as_secs_f64();
    let mut curve: Vec<(u64, u64, bool)> = found.tried.clone();
    if let Some(path) = &args.plot {
        curve.extend(curve_points(&args.predict, &found, &extra, args.headroom)?);
        draw_curve(args, &found, &curve, path)?;
    }
    if let Some(path) = &args.timeline {
        let p = Prober::new(&args.predict, key, &extra, args.headroom)
            .probe(found.largest.size, TIMELINE_POINTS)?;
        draw_timeline(&p, key, path)?;
    }
    let mut settings = extra.clone();
    settings.push((key.to_string(), found.largest.size.to_string()));
    let command = args.predict.command_line(&settings);
    Ok(MaxBatch {
        key,
        found,
        command,
        seconds,
        headroom: args.headroom,
        max_seq: args.max_seq,
    })
}

/// Runs `vramsim max-batch`.
pub fn run(args: MaxBatchArgs) -> Result<()> {
    let answer = max_batch(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&answer.to_json())?);
        return Ok(());
    }
    print!("{}", answer.to_text());
    if let Some(path) = &args.plot {
        println!("plot        {}", path.display());
    }
    if let Some(path) = &args.timeline {
        println!("timeline    {}", path.display());
    }
    Ok(())
}

/// The recipe of an evaluation, without the searched size.
fn recipe_text(e: &Evaluated, key: &str) -> String {
    let r = &e.prediction.recipe;
    let mut parts = Vec::new();
    if key != "batch" {
        parts.push(format!("batch {}", r.batch));
    }
    if key != "seq" && r.seq > 0 {
        parts.push(format!("seq {}", r.seq));
    }
    parts.push(r.precision.to_string());
    if r.inference {
        parts.push("inference".into());
    } else {
        parts.push(format!(
            "{} ({})",
            r.optimizer,
            optimizer_impl(r.optimizer_impl)
        ));
        parts.push(format!("checkpoint {}", r.checkpointing));
        parts.push(format!("accum {}", r.accum));
    }
    if !e.report.alloc_conf.is_empty() {
        parts.push(e.report.alloc_conf.clone());
    }
    parts.join(", ")
}

/// The recipe in a few words for titles: what differs from `predict`'s defaults.
fn short_recipe(e: &Evaluated, key: &str) -> String {
    let r = &e.prediction.recipe;
    let mut parts = vec![r.precision.to_string()];
    if key != "batch" {
        parts.push(format!("batch {}", r.batch));
    }
    if key != "seq" && r.seq > 0 {
        parts.push(format!("seq {}", r.seq));
    }
    if r.checkpointing != vramsim_models::Checkpointing::None {
        parts.push(format!("checkpoint {}", r.checkpointing));
    }
    if r.accum > 1 {
        parts.push(format!("accum {}", r.accum));
    }
    if r.inference {
        parts.push("inference".into());
    }
    if !e.report.alloc_conf.is_empty() {
        parts.push(e.report.alloc_conf.clone());
    }
    parts.join(", ")
}

fn optimizer_impl(i: vramsim_models::OptimizerImpl) -> &'static str {
    match i {
        vramsim_models::OptimizerImpl::Foreach => "foreach",
        vramsim_models::OptimizerImpl::Fused => "fused",
        vramsim_models::OptimizerImpl::ForLoop => "for-loop",
    }
}

/// More sizes for the curve: evenly spaced up to the first failure (or the largest fit), evaluated in
/// parallel.
fn curve_points(
    fixed: &FixedOptions,
    found: &Search,
    extra: &[Setting],
    headroom: Option<Headroom>,
) -> Result<Vec<(u64, u64, bool)>> {
    let top = found
        .first_failure
        .as_ref()
        .map_or(found.largest.size, |f| f.size);
    let step = (top / CURVE_POINTS).max(1);
    let sizes: Vec<u64> = (1..=CURVE_POINTS)
        .map(|i| i * step)
        .filter(|s| *s < top && !found.tried.iter().any(|t| t.0 == *s))
        .collect();
    let configs: Vec<Vec<String>> = sizes
        .iter()
        .map(|s| {
            let mut settings = extra.to_vec();
            settings.push((found.key.to_string(), s.to_string()));
            fixed.args(&settings)
        })
        .collect();
    let results = sweep::evaluate(&configs, Wants::default(), &Progress::hidden());
    Ok(sizes
        .into_iter()
        .zip(results)
        .filter_map(|(s, r)| {
            let e = r.ok()?;
            let fits = misfit(&e, headroom).is_none();
            Some((s, e.report.peak_device_used(), fits))
        })
        .collect())
}

fn draw_curve(
    args: &MaxBatchArgs,
    found: &Search,
    curve: &[(u64, u64, bool)],
    path: &Path,
) -> Result<()> {
    let best = &found.largest.evaluated;
    let device = &best.report.device;
    let points: Vec<SizePoint> = curve
        .iter()
        .map(|&(size, device_used, fits)| SizePoint {
            size,
            device_used,
            fits,
        })
        .collect();
    let what = if args.max_seq {
        "sequence length"
    } else {
        "batch size"
    };
    let title = format!(
        "{} ({}) on {}: peak memory against {what}",
        best.prediction.arch.name(),
        short_recipe(best, found.key),
        device.name,
    );
    plot_size_curve(
        &SizeCurvePlot {
            title: &title,
            x_label: what,
            points: &points,
            capacity: Some(device.total_memory),
            limit: args
                .headroom
                .map(|h| device.total_memory - h.bytes(device.total_memory)),
        },
        path,
    )
    .with_context(|| format!("cannot draw {}", path.display()))
}

/// Draws one step of `p` (the last iteration) as stacked categories.
pub fn draw_timeline(p: &Probe, key: &str, path: &Path) -> Result<()> {
    let e = &p.evaluated;
    let samples: Vec<CategorySample> = e
        .last_step_timeline()
        .map(|t| CategorySample {
            x: t.event_index as f64,
            categories: t.categories,
            reserved: t.reserved,
        })
        .collect();
    let start = e.last_iteration_start;
    let phases: Vec<(f64, String)> = e
        .report
        .outcome
        .phase_marks
        .iter()
        .filter(|(i, _)| *i >= start)
        .map(|(i, n)| (*i as f64, n.clone()))
        .collect();
    let device = &e.report.device;
    let title = format!(
        "{} · {key} {} · {} · one step on {}",
        e.prediction.arch.name(),
        p.size,
        short_recipe(e, key),
        device.name
    );
    plot_category_timeline(
        &CategoryTimelinePlot {
            title: &title,
            x_label: "event",
            samples: &samples,
            capacity: Some(e.report.usable_capacity()),
            oom_at: e.report.outcome.oom.as_ref().map(|o| o.event_index as f64),
            phases: &phases,
        },
        path,
    )
    .with_context(|| format!("cannot draw {}", path.display()))
}
