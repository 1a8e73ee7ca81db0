//! `vramsim recommend`: the recipes that reach a global batch on a device, fastest first.
//!
//! For every precision and checkpointing policy not fixed on the command line (fp32, bf16, amp-fp16,
//! amp-bf16 × none, selective, sqrt, full), the largest micro-batch that divides the global batch and
//! fits is found by bisection over the divisors, with accumulation making up the rest
//! (`batch × accum = global batch`); the largest is the fastest of its recipe under the step-time model,
//! which then orders the recipes (see [`crate::steptime`]).

use std::fmt::Write as _;

use anyhow::{bail, Result};
use clap::Args;
use rayon::prelude::*;
use serde_json::{json, Value};
use vramsim_sim::format::format_size;

use crate::maxbatch::misfit;
use crate::sweep::{self, Evaluated, FixedOptions, Headroom, Setting, Wants};
use crate::whatif::step_json;

/// Precisions tried when `--precision` is not given.
const PRECISIONS: &[&str] = &["fp32", "bf16", "amp-fp16", "amp-bf16"];
/// Checkpointing policies tried when `--checkpoint` is not given.
const CHECKPOINTS: &[&str] = &["none", "selective", "sqrt", "full"];

/// The predict settings a fine-tuning method adds (`("quant", "nf4-dq")`, ...).
type Method = &'static [(&'static str, &'static str)];

/// Fine-tuning methods `--finetune` adds: every parameter trained, PEFT's LoRA (`--recipe
/// peft-lora`), and QLoRA (the same adapters on NF4 double-quantized base weights, the QLoRA
/// paper's setting): `(name, predict settings)`.
const METHODS: &[(&str, Method)] = &[
    ("full", &[]),
    ("lora", &[("recipe", "peft-lora")]),
    ("qlora", &[("recipe", "peft-lora"), ("quant", "nf4-dq")]),
];

/// Options of `vramsim recommend`.
#[derive(Args, Debug)]
pub struct RecommendArgs {
    /// Samples per optimizer step to reach: micro-batch × gradient accumulation.
    #[arg(long, value_name = "N")]
    pub global_batch: u64,
    /// Memory a recipe must leave free: a percentage (5%), a fraction (0.05) or a size (2GiB).
    #[arg(long, value_parser = Headroom::parse)]
    pub headroom: Option<Headroom>,
    /// Recipes listed at most.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print the recipes as JSON.
    #[arg(long)]
    pub json: bool,
    /// The options of `vramsim predict` (`--model` or `--hf-config` is required); --precision,
    /// --checkpoint, --batch or --accum, when given, are kept instead of searched.
    #[command(flatten)]
    pub predict: FixedOptions,
    /// Also propose fine-tuning methods: full fine-tuning, LoRA (PEFT's defaults, `--recipe
    /// peft-lora`) and QLoRA (LoRA on nf4-dq weights), each with every precision and checkpointing
    /// (not with --lora, --quant or --recipe given: those fix the method).
    #[arg(long)]
    pub finetune: bool,
    /// Search the parallel layouts of N GPUs instead (dp × tp × pp, data-parallel modes and
    /// offloads, precision, checkpointing, micro-batch), ranked by a step time with
    /// communication (`vramsim_api::layouts`).
    #[arg(long, value_name = "N")]
    pub gpus: Option<u32>,
}

/// A recipe that reaches the global batch.
pub struct Recipe {
    /// Its settings (precision, checkpoint, batch, accum).
    pub settings: Vec<Setting>,
    /// The evaluation.
    pub evaluated: Evaluated,
}

impl Recipe {
    /// The order recommendations are listed in: fastest estimated step first, then the least
    /// device memory, then the settings (so that ties list the same way every time).
    pub fn faster_first(a: &Recipe, b: &Recipe) -> std::cmp::Ordering {
        a.evaluated
            .step
            .step_ms
            .total_cmp(&b.evaluated.step.step_ms)
            .then(
                a.evaluated
                    .report
                    .peak_device_used()
                    .cmp(&b.evaluated.report.peak_device_used()),
            )
            .then(a.settings.cmp(&b.settings))
    }
}

/// The best that did not fit, for the error when nothing does.
pub(crate) struct Miss {
    /// Its settings.
    pub settings: Vec<Setting>,
    /// Why it does not fit.
    pub reason: String,
    /// How little memory its options need, in the usual order (higher is less).
    pub frugality: usize,
    /// Its peak device use.
    pub device_used: u64,
}

/// The answer of `vramsim recommend`: the recipes that reach the global batch, fastest first.
pub struct Recommendation {
    /// The global batch.
    pub global_batch: u64,
    /// Every recipe that fits, fastest first.
    pub recipes: Vec<Recipe>,
    /// The fixed options, less those a recipe sets.
    pub base: FixedOptions,
    /// Combinations of precision and checkpointing tried.
    pub tried: usize,
    /// Recipes listed at most (`--top`).
    pub top: usize,
}

impl Recommendation {
    /// The recipes listed (the first `top`).
    pub fn shown(&self) -> &[Recipe] {
        &self.recipes[..self.recipes.len().min(self.top.max(1))]
    }

    /// `vramsim recommend --json`'s document.
    pub fn to_json(&self) -> Value {
        let list: Vec<Value> = self
            .shown()
            .iter()
            .enumerate()
            .map(|(i, r)| recipe_json(i + 1, r, &self.base))
            .collect();
        let device = &self.recipes[0].evaluated.report.device;
        json!({
            "global_batch": self.global_batch,
            "model": self.recipes[0].evaluated.prediction.arch.name(),
            "device": {"name": device.name, "total_memory_bytes": device.total_memory},
            "recipes_that_fit": self.recipes.len(),
            "recipes_tried": self.tried,
            "recipes": list,
        })
    }

    /// `vramsim recommend`'s table.
    pub fn to_table(&self) -> String {
        to_table(
            &self.recipes,
            self.shown(),
            &self.base,
            self.global_batch,
            self.tried,
        )
    }
}

/// Runs `vramsim recommend`.
pub fn run(args: RecommendArgs) -> Result<()> {
    // `--shard dataparallel`: DataParallel against DDP on the same devices and global batch.
    if args.predict.value("shard").map(str::trim) == Some("dataparallel") {
        let c = crate::dataparallel::compare_with_ddp(&args.predict, args.global_batch)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&c.to_json())?);
        } else {
            print!("{}", c.to_table());
        }
        return Ok(());
    }
    if let Some(gpus) = args.gpus {
        if args.finetune {
            bail!("--finetune searches one GPU's fine-tuning methods; --gpus searches layouts of full training: give one of them");
        }
        let found = crate::layouts::search(&args, gpus)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&found.to_json())?);
        } else {
            print!("{}", found.to_table());
        }
        return Ok(());
    }
    let answer = recommend(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&answer.to_json())?);
    } else {
        print!("{}", answer.to_table());
    }
    Ok(())
}

/// `vramsim recommend` without the printing.
pub fn recommend(args: &RecommendArgs) -> Result<Recommendation> {
    let n = args.global_batch;
    if n == 0 {
        bail!("--global-batch must be 1 or more");
    }
    let fixed = &args.predict;
    let value = |key: &str| fixed.value(key).map(str::to_string);
    let precisions: Vec<String> = match value("precision") {
        Some(p) => vec![p],
        None => PRECISIONS.iter().map(|s| s.to_string()).collect(),
    };
    let checkpoints: Vec<String> = match value("checkpoint") {
        Some(c) => vec![c],
        None => CHECKPOINTS.iter().map(|s| s.to_string()).collect(),
    };
    if fixed.has("inference") {
        bail!("recommend plans training steps; --inference has no global batch to reach");
    }
    // The search is over one GPU's recipe: `--gpus N` searches layouts (`crate::layouts`).
    let layout = value("dp").is_some_and(|d| d.trim() != "1")
        || value("shard").is_some_and(|s| s.trim() != "none")
        || value("pp").is_some_and(|p| p.trim() != "1")
        || [
            "world-size",
            "fsdp-param-dtype",
            "fsdp-reduce-dtype",
            "ddp-bucket-view",
        ]
        .iter()
        .any(|k| fixed.has(k));
    if layout {
        bail!("recommend searches one GPU's recipe; give --gpus N to search parallel layouts (--dp, --shard, ... are then searched), or evaluate one with predict or whatif (--shard dataparallel compares DataParallel with DDP)");
    }
    let divisors: Vec<u64> = match (value("batch"), value("accum")) {
        (Some(_), Some(_)) => {
            bail!("give --batch or --accum, not both: the other is --global-batch divided by it")
        }
        (Some(b), None) => {
            let b: u64 = b
                .parse()
                .map_err(|_| anyhow::anyhow!("--batch {b:?} is not a whole number"))?;
            if b == 0 || !n.is_multiple_of(b) {
                bail!("--batch {b} does not divide --global-batch {n}");
            }
            vec![b]
        }
        (None, Some(a)) => {
            let a: u64 = a
                .parse()
                .map_err(|_| anyhow::anyhow!("--accum {a:?} is not a whole number"))?;
            if a == 0 || !n.is_multiple_of(a) {
                bail!("--accum {a} does not divide --global-batch {n}");
            }
            vec![n / a]
        }
        (None, None) => (1..=n).filter(|d| n.is_multiple_of(*d)).collect(),
    };
    // batch and accum are set per candidate; drop fixed ones of those names
    let base = FixedOptions {
        given: fixed
            .given
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "batch" | "accum" | "precision" | "checkpoint"))
            .cloned()
            .collect(),
    };
    // check the fixed options once (a bad model or GPU is one error, not one per recipe)
    let probe_settings = candidate(&precisions[0], &checkpoints[0], &[], divisors[0], n);
    let parsed = sweep::OptionSet::predict().parse(&base.args(&probe_settings))?;
    sweep::check(&parsed)?;

    let methods: Vec<Method> = if args.finetune {
        if ["lora", "quant", "recipe", "lora-r"]
            .iter()
            .any(|k| fixed.has(k))
        {
            bail!("--finetune tries full fine-tuning, LoRA and QLoRA itself: leave out --lora, --quant, --recipe and --lora-r");
        }
        METHODS.iter().map(|(_, m)| *m).collect()
    } else {
        vec![&[]]
    };
    let combos: Vec<(&String, &String, Method)> = precisions
        .iter()
        .flat_map(|p| checkpoints.iter().map(move |c| (p, c)))
        .flat_map(|(p, c)| methods.iter().map(move |m| (p, c, *m)))
        .collect();
    let outcomes: Vec<Result<Result<Recipe, Miss>, String>> = combos
        .par_iter()
        .map(|(p, c, m)| best_for(&base, p, c, m, &divisors, n, args.headroom))
        .collect();
    let mut recipes = Vec::new();
    let mut misses = Vec::new();
    for outcome in outcomes {
        match outcome {
            Ok(Ok(r)) => recipes.push(r),
            Ok(Err(m)) => misses.push(m),
            Err(e) => bail!("{e}"),
        }
    }
    recipes.sort_by(Recipe::faster_first);
    if recipes.is_empty() {
        // the error quotes the recipe that needs the least memory
        misses.sort_by_key(|m| (std::cmp::Reverse(m.frugality), m.device_used));
        let closest = misses.first();
        bail!(
            "no recipe reaches global batch {n}: every precision and checkpointing tried ({}) runs out of memory even at micro-batch {}{}",
            combos.len(),
            divisors[0],
            match closest {
                Some(m) => format!(
                    "; with {}: {}",
                    describe(&m.settings),
                    m.reason
                ),
                None => String::new(),
            }
        );
    }
    Ok(Recommendation {
        global_batch: n,
        recipes,
        base,
        tried: combos.len(),
        top: args.top,
    })
}

fn candidate(
    precision: &str,
    checkpoint: &str,
    method: &[(&str, &str)],
    batch: u64,
    n: u64,
) -> Vec<Setting> {
    let mut v = vec![
        ("precision".to_string(), precision.to_string()),
        ("checkpoint".to_string(), checkpoint.to_string()),
        ("batch".to_string(), batch.to_string()),
        ("accum".to_string(), (n / batch).to_string()),
    ];
    v.extend(
        method
            .iter()
            .map(|(k, val)| (k.to_string(), val.to_string())),
    );
    v
}

/// The fine-tuning method of a candidate's settings (`full`, `lora`, `qlora`).
fn method_name(settings: &[Setting]) -> &'static str {
    let has = |k: &str| settings.iter().any(|(key, _)| key == k);
    match (has("recipe"), has("quant")) {
        (true, true) => "qlora",
        (true, false) => "lora",
        _ => "full",
    }
}

/// `amp-bf16, checkpoint full, batch 8 × accum 4`.
fn describe(settings: &[Setting]) -> String {
    let get = |k: &str| {
        settings
            .iter()
            .find(|(key, _)| key == k)
            .map_or("", |(_, v)| v.as_str())
    };
    let method = match method_name(settings) {
        "full" => String::new(),
        m => format!(", {m}"),
    };
    format!(
        "{}, checkpoint {}, batch {} × accum {}{method}",
        get("precision"),
        get("checkpoint"),
        get("batch"),
        get("accum")
    )
}

/// The largest divisor micro-batch that fits with this precision and checkpointing, by bisection over
/// the divisors from the largest down (the small micro-batches, with many accumulation steps, are the
/// longest to lower), or the smallest's failure when none fits.
#[allow(clippy::too_many_arguments)]
fn best_for(
    base: &FixedOptions,
    precision: &str,
    checkpoint: &str,
    method: &[(&str, &str)],
    divisors: &[u64],
    n: u64,
    headroom: Option<Headroom>,
) -> Result<Result<Recipe, Miss>, String> {
    let settings_for = |batch: u64| candidate(precision, checkpoint, method, batch, n);
    let frugal = frugality(
        precision,
        checkpoint,
        method_name(&candidate(precision, checkpoint, method, 1, 1)),
    );
    largest_that_fits(base, &settings_for, divisors, headroom, frugal)
}

/// The largest micro-batch among `divisors` (ascending) whose settings (`settings_for(batch)`) fit,
/// by bisection from the largest down, or the smallest's failure (with `frugality`) when none fits.
pub(crate) fn largest_that_fits(
    base: &FixedOptions,
    settings_for: &(dyn Fn(u64) -> Vec<Setting> + Sync),
    divisors: &[u64],
    headroom: Option<Headroom>,
    frugality: usize,
) -> Result<Result<Recipe, Miss>, String> {
    type Probe = (Vec<Setting>, Evaluated, Option<String>);
    let eval = |i: usize| -> Result<Probe, String> {
        let settings = settings_for(divisors[i]);
        let evaluated = sweep::evaluate_one(&base.args(&settings), Wants::default())
            .map_err(|e| format!("{e:#}"))?;
        let reason = misfit(&evaluated, headroom);
        Ok((settings, evaluated, reason))
    };
    // invariant: every divisor below `lo` is unknown or fits (`best` is the largest that does), every
    // one from `hi` on does not fit
    let (mut lo, mut hi) = (0, divisors.len());
    let mut best: Option<Probe> = None;
    let mut smallest_failure: Option<Probe> = None;
    while lo < hi {
        // the largest untried first, then halves
        let i = if best.is_none() && hi == divisors.len() {
            hi - 1
        } else {
            lo + (hi - lo) / 2
        };
        let probe = eval(i)?;
        if probe.2.is_none() {
            lo = i + 1;
            best = Some(probe);
        } else {
            hi = i;
            if i == 0 {
                smallest_failure = Some(probe);
            }
        }
    }
    match (best, smallest_failure) {
        (Some((settings, evaluated, _)), _) => Ok(Ok(Recipe {
            settings,
            evaluated,
        })),
        (None, Some((settings, evaluated, reason))) => Ok(Err(Miss {
            settings,
            reason: reason.unwrap_or_default(),
            frugality,
            device_used: evaluated.report.peak_device_used(),
        })),
        (None, None) => Err("no micro-batch was tried".to_string()),
    }
}

/// How little memory a precision, checkpointing policy and fine-tuning method need, in the usual
/// order (higher is less).
fn frugality(precision: &str, checkpoint: &str, method: &str) -> usize {
    let m = ["full", "lora", "qlora"]
        .iter()
        .position(|x| *x == method)
        .unwrap_or(0);
    let p = ["fp32", "amp-fp16", "amp-bf16", "bf16"]
        .iter()
        .position(|x| *x == precision)
        .unwrap_or(0);
    let c = ["none", "selective", "sqrt", "full"]
        .iter()
        .position(|x| *x == checkpoint)
        .unwrap_or(0);
    16 * m + 4 * c + p
}

fn recipe_json(rank: usize, r: &Recipe, base: &FixedOptions) -> Value {
    let e = &r.evaluated;
    let rec = &e.prediction.recipe;
    json!({
        "rank": rank,
        "method": method_name(&r.settings),
        "precision": rec.precision.to_string(),
        "checkpoint": rec.checkpointing.to_string(),
        "batch": rec.batch,
        "accum": rec.accum,
        "effective_batch": e.effective_batch(),
        "peak_allocated_bytes": e.report.peak_allocated(),
        "peak_reserved_bytes": e.report.peak_reserved(),
        "peak_device_used_bytes": e.report.peak_device_used(),
        "step_time": step_json(e),
        "command": base.command_line(&r.settings),
    })
}

fn to_table(all: &[Recipe], shown: &[Recipe], base: &FixedOptions, n: u64, tried: usize) -> String {
    let mut out = String::new();
    let first = &all[0].evaluated;
    let device = &first.report.device;
    let _ = writeln!(
        out,
        "recommend  {} to global batch {n} on {} ({} total): {} of {tried} precision × checkpointing{} recipes fit",
        first.prediction.arch.name(),
        device.name,
        format_size(device.total_memory),
        all.len(),
        if all.iter().any(|r| method_name(&r.settings) != "full") {
            " × method"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "           each with its largest micro-batch that fits; fastest first by estimated step time\n"
    );
    let _ = writeln!(
        out,
        "{:>4}  {:<6} {:<9} {:<10} {:>13}  {:>12}  {:>10}  {:>10}",
        "rank",
        "method",
        "precision",
        "checkpoint",
        "batch × accum",
        "device used",
        "step (ms)",
        "samples/s"
    );
    for (i, r) in shown.iter().enumerate() {
        let e = &r.evaluated;
        let rec = &e.prediction.recipe;
        let _ = writeln!(
            out,
            "{:>4}  {:<6} {:<9} {:<10} {:>13}  {:>12}  {:>10.1}  {:>10.1}",
            i + 1,
            method_name(&r.settings),
            rec.precision.to_string(),
            rec.checkpointing.to_string(),
            format!("{} × {}", rec.batch, rec.accum),
            format_size(e.report.peak_device_used()),
            e.step.step_ms,
            e.samples_per_s()
        );
        let _ = writeln!(out, "      {}", base.command_line(&r.settings));
    }
    if shown.len() < all.len() {
        let _ = writeln!(
            out,
            "\n({} more; --top N lists more)",
            all.len() - shown.len()
        );
    }
    out.push('\n');
    if shown
        .iter()
        .any(|r| r.evaluated.prediction.recipe.precision == vramsim_models::Precision::Bf16)
    {
        let _ = writeln!(
            out,
            "bf16 is model.to(torch.bfloat16): no float32 master weights, which changes the training numerics; amp-* keep them"
        );
    }
    let _ = writeln!(
        out,
        "step times come from a FLOP/bandwidth model (see `vramsim whatif --help`); they rank recipes, they do not time them"
    );
    out
}
