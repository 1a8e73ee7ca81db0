//! What `whatif`, `max-batch` and `recommend` share: `predict`'s options as a set that can be fixed or
//! varied, grids over them, and the parallel evaluation of many configurations through `predict`'s own
//! code ([`crate::predict::lower_step`], [`crate::predict::replay_step`]).
//!
//! The option set is read from `predict`'s command-line definition, so every option `predict` has can
//! be varied and takes the values `predict` accepts, checked by the same parsers. A configuration is an
//! argument list for `predict` (the options given on the command line, then the varied ones), parsed as
//! `predict` parses it. Configurations that differ only in machine options (`--gpu`, `--alloc-conf`,
//! ...) share one lowering when what the lowering takes from their GPUs' compute capability agrees
//! (`Recipe.target`: the kernels PyTorch picks, such as the SDPA backend; `Arch::target_choices`): GPUs
//! of one capability always share, others when they get the same kernels. The model is built and
//! lowered once per recipe and set of kernels, then replayed once per machine.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::{ArgAction, Args, Command, FromArgMatches};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use serde_json::Value;
use vramsim_models::graph_template::GraphTemplate;
use vramsim_models::seq_template::{seq_class, SeqBatchTemplate, SeqGraphTemplate};
use vramsim_models::template::BatchTemplate;
use vramsim_models::zoo::{Arch, TargetChoices};
use vramsim_sim::engine::TimelinePoint;
use vramsim_sim::report::Report;

use crate::machine::MachineArgs;
use crate::predict::{self, Lowered, PredictArgs, Prediction};
use crate::steptime::{perf_for, StepTime, StepWork};

/// The most configurations one sweep evaluates.
pub const MAX_POINTS: u128 = 1_000_000;

/// `predict`'s options that only shape its output; a sweep has its own.
const OUTPUT_OPTIONS: &[&str] = &["json", "plot", "trace_out", "help", "version"];

/// One option of `predict`.
#[derive(Clone, Debug)]
pub struct OptionInfo {
    /// The long name (`alloc-conf`).
    pub long: String,
    /// clap's id (`alloc_conf`).
    pub id: String,
    /// A flag: present or not, varied over `true`/`false`.
    pub flag: bool,
    /// An option of the machine (`--gpu`, `--alloc-conf`, ...), which changes the lowering only
    /// through the GPU's compute capability.
    pub machine: bool,
}

/// `predict`'s options, as a sweep sees them.
#[derive(Debug)]
pub struct OptionSet {
    command: Command,
    options: Vec<OptionInfo>,
}

impl OptionSet {
    /// The option set of `vramsim predict`, read once from its definition.
    pub fn predict() -> &'static OptionSet {
        static SET: OnceLock<OptionSet> = OnceLock::new();
        SET.get_or_init(|| {
            let command = PredictArgs::augment_args(Command::new("predict"));
            let machine: Vec<String> = MachineArgs::augment_args(Command::new("machine"))
                .get_arguments()
                .map(|a| a.get_id().to_string())
                .collect();
            let options = command
                .get_arguments()
                .filter(|a| !OUTPUT_OPTIONS.contains(&a.get_id().as_str()))
                .filter_map(|a| {
                    Some(OptionInfo {
                        long: a.get_long()?.to_string(),
                        id: a.get_id().to_string(),
                        flag: matches!(a.get_action(), ArgAction::SetTrue),
                        machine: machine.iter().any(|m| m == a.get_id().as_str()),
                    })
                })
                .collect();
            OptionSet { command, options }
        })
    }

    /// The option called `key` (`alloc-conf`, `alloc_conf` or `--alloc-conf`).
    pub fn find(&self, key: &str) -> Option<&OptionInfo> {
        // `lora.r` names `--lora-r`.
        let key = key.trim().trim_start_matches("--").replace(['_', '.'], "-");
        self.options.iter().find(|o| o.long == key)
    }

    /// Every option's long name, comma-separated (for error messages).
    pub fn names(&self) -> String {
        self.options
            .iter()
            .map(|o| o.long.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Parses `predict`'s arguments (without the program name) as `predict` would.
    pub fn parse(&self, args: &[String]) -> Result<PredictArgs> {
        let matches = self
            .command
            .clone()
            .try_get_matches_from(
                std::iter::once("predict".to_string()).chain(args.iter().cloned()),
            )
            .map_err(|e| anyhow::anyhow!(clap_message(&e)))?;
        PredictArgs::from_arg_matches(&matches).map_err(|e| anyhow::anyhow!(clap_message(&e)))
    }
}

/// clap's error without the `error: ` prefix, the usage and the `--help` tip, on one line.
pub fn clap_message(error: &clap::Error) -> String {
    let text = error.render().to_string();
    text.lines()
        .map(str::trim)
        .take_while(|line| !line.is_empty() && !line.starts_with("Usage:"))
        .map(|line| line.strip_prefix("error: ").unwrap_or(line))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A setting of one option: its long name and value (`true`/`false` for flags).
pub type Setting = (String, String);

/// The `predict` options given on a sweep command's line; there every one is optional, and the
/// sweep's own options (`--vary`, `--json`, ...) sit beside them.
#[derive(Clone, Debug, Default)]
pub struct FixedOptions {
    /// The options given, in `predict`'s order, with their raw values (`None` for flags).
    pub given: Vec<(String, Option<String>)>,
}

impl FromArgMatches for FixedOptions {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let mut given = Vec::new();
        for option in &OptionSet::predict().options {
            if matches.value_source(&option.id) != Some(clap::parser::ValueSource::CommandLine) {
                continue;
            }
            if option.flag {
                if matches.get_flag(&option.id) {
                    given.push((option.long.clone(), None));
                }
                continue;
            }
            for value in matches.get_raw(&option.id).into_iter().flatten() {
                given.push((
                    option.long.clone(),
                    Some(value.to_string_lossy().into_owned()),
                ));
            }
        }
        Ok(FixedOptions { given })
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = FixedOptions::from_arg_matches(matches)?;
        Ok(())
    }
}

impl Args for FixedOptions {
    fn augment_args(mut cmd: Command) -> Command {
        let set = OptionSet::predict();
        for arg in set.command.get_arguments() {
            if set.options.iter().any(|o| o.id == arg.get_id().as_str()) {
                // the sweep supplies what it varies; `predict` checks the whole at each point
                cmd = cmd.arg(
                    arg.clone()
                        .required(false)
                        .help_heading("Options of predict"),
                );
            }
        }
        cmd
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FixedOptions {
    /// Whether `--long` was given.
    pub fn has(&self, long: &str) -> bool {
        self.given.iter().any(|(l, _)| l == long)
    }

    /// The value given to `--long`, if any.
    pub fn value(&self, long: &str) -> Option<&str> {
        self.given
            .iter()
            .find(|(l, _)| l == long)
            .and_then(|(_, v)| v.as_deref())
    }

    /// `predict`'s arguments for the fixed options with `settings` added (replacing fixed ones of the
    /// same name).
    pub fn args(&self, settings: &[Setting]) -> Vec<String> {
        let set = OptionSet::predict();
        let mut args = Vec::new();
        for (long, value) in &self.given {
            if settings.iter().any(|(l, _)| l == long) {
                continue;
            }
            match value {
                None => args.push(format!("--{long}")),
                Some(v) => args.push(format!("--{long}={v}")),
            }
        }
        for (long, value) in settings {
            match set.find(long) {
                Some(o) if o.flag => {
                    if value == "true" {
                        args.push(format!("--{long}"));
                    }
                }
                _ => args.push(format!("--{long}={value}")),
            }
        }
        args
    }

    /// The `vramsim predict` command line for the fixed options with `settings` (shell-quoted).
    pub fn command_line(&self, settings: &[Setting]) -> String {
        let mut line = String::from("vramsim predict");
        for arg in self.args(settings) {
            line.push(' ');
            match arg.split_once('=') {
                Some((key, value)) => {
                    line.push_str(key);
                    line.push(' ');
                    line.push_str(&shell_quote(value));
                }
                None => line.push_str(&arg),
            }
        }
        line
    }
}

/// `value` as a POSIX shell word.
fn shell_quote(value: &str) -> String {
    if !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/=,+@%".contains(c))
    {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', r"'\''"))
    }
}

/// Checks what `predict` would reject only once it runs, without lowering: the machine and the model
/// name.
pub fn check(args: &PredictArgs) -> Result<()> {
    args.machine.build()?;
    if let Some(name) = &args.model {
        Arch::from_name(name)?;
    }
    Ok(())
}

/// What a sweep needs besides the peaks.
#[derive(Clone, Copy, Debug, Default)]
pub struct Wants {
    /// `predict --json`'s document for each configuration (and so the breakdown at the peak, which is
    /// left empty otherwise).
    pub json: bool,
    /// Timeline points to keep (for plots; 0: none).
    pub timeline_points: usize,
}

impl Wants {
    /// Whether the breakdown at the peak (or at the out-of-memory error) is wanted: only
    /// `predict --json`'s document shows it.
    pub fn breakdown(&self) -> bool {
        self.json
    }
}

/// One configuration, evaluated by `predict`'s code.
pub struct Evaluated {
    /// The replay's report.
    pub report: Report,
    /// What `predict` adds to it.
    pub prediction: Prediction,
    /// `predict --json`'s document, when asked for.
    pub json: Option<Value>,
    /// The step-time estimate.
    pub step: StepTime,
    /// The GPU preset whose figures priced the step.
    pub perf_preset: &'static str,
    /// Whether those are the device's own figures (not the default preset's, for a bare capacity).
    pub perf_own: bool,
    /// Event index where the last iteration starts (for a plot of one step).
    pub last_iteration_start: u64,
}

impl Evaluated {
    /// Whether the step fits (no out-of-memory error).
    pub fn fits(&self) -> bool {
        self.report.fits()
    }

    /// Samples per optimizer step: micro-batch × accumulation × data-parallel ranks (the step-time
    /// model has no communication term yet).
    pub fn effective_batch(&self) -> u64 {
        let r = &self.prediction.recipe;
        r.batch * u64::from(r.accum) * u64::from(r.parallel.batch_copies())
    }

    /// Samples per second at the estimated step time.
    pub fn samples_per_s(&self) -> f64 {
        if self.step.step_ms > 0.0 {
            self.effective_batch() as f64 * 1e3 / self.step.step_ms
        } else {
            0.0
        }
    }

    /// The out-of-memory message, if any.
    pub fn oom_message(&self) -> Option<&str> {
        self.report.outcome.oom.as_ref().map(|o| o.message.as_str())
    }

    /// The timeline of the last iteration (the steady-state step).
    pub fn last_step_timeline(&self) -> impl Iterator<Item = &TimelinePoint> {
        let start = self.last_iteration_start;
        let oom = self.report.outcome.oom.is_some();
        self.report
            .outcome
            .timeline
            .iter()
            .filter(move |p| oom || p.event_index >= start)
    }
}

/// Evaluates each configuration (`predict`'s arguments) in parallel, in order. Configurations that
/// share everything but machine options, on GPUs for which the lowering makes the same choices
/// (`Arch::target_choices`: same compute capability, or the same kernels), are lowered once. A
/// configuration that `predict` rejects gets its error message.
pub fn evaluate(
    configs: &[Vec<String>],
    wants: Wants,
    progress: &Progress,
) -> Vec<Result<Evaluated, String>> {
    let set = OptionSet::predict();
    let parsed: Vec<Result<PredictArgs, String>> = configs
        .par_iter()
        .map(|args| set.parse(args).map_err(|e| format!("{e:#}")))
        .collect();
    // configurations grouped by everything that shapes the lowering: the recipe's options and what
    // the lowering takes from the GPU (or its compute capability, where that cannot be told); the
    // groups that differ only in the batch form a family, lowered once per structure
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut families: Vec<Vec<usize>> = Vec::new();
    // (options but the machine's, the accumulation and the batch, what the lowering takes from the
    // GPU, the accumulation or 0 for every count a compact lowering serves)
    type Key<'a> = (Vec<&'a str>, TargetKey, u32);
    let mut by_key: HashMap<(Key, u64), usize> = HashMap::new();
    let mut by_family: HashMap<Key, usize> = HashMap::new();
    let target_keys: Vec<TargetKey> = parsed
        .par_iter()
        .map(|p| match p {
            Ok(p) => target_key(p),
            Err(_) => TargetKey::Unknown(None),
        })
        .collect();
    for (i, args) in configs.iter().enumerate() {
        let Ok(p) = &parsed[i] else { continue };
        let cc = target_keys[i];
        let options = lowering_options(args, &["accum", "batch"]);
        let key = (options, cc, accum_key(p));
        let family = *by_family.entry(key.clone()).or_insert_with(|| {
            families.push(Vec::new());
            families.len() - 1
        });
        let slot = *by_key.entry((key, p.batch)).or_insert_with(|| {
            groups.push(Vec::new());
            families[family].push(groups.len() - 1);
            groups.len() - 1
        });
        groups[slot].push(i);
    }
    let args_of = |i: usize| parsed[i].as_ref().expect("grouped configurations parse");
    // each group lowered for its largest accumulation count: the compact form of more than three
    // serves the smaller ones too
    for members in &mut groups {
        members.sort_by_key(|&i| (std::cmp::Reverse(args_of(i).accum), i));
    }
    // family by family, each group replayed as soon as it is lowered, its lowering dropped once
    // replayed: the sweep holds the lowerings of the families in flight, not of the whole grid
    let evaluate_group = |members: &Vec<usize>, lowered: Result<Lowered, String>| {
        let first = args_of(members[0]);
        // the other accumulation counts of the group: the same compact lowering where it serves
        // them, else their own
        let mut accums: Vec<u32> = members.iter().map(|&i| args_of(i).accum).collect();
        accums.sort_unstable();
        accums.dedup();
        let variants: Vec<(u32, Result<Lowered, String>)> = accums
            .into_par_iter()
            .filter(|&a| a != first.accum)
            .map(|a| {
                let member = members
                    .iter()
                    .map(|&i| args_of(i))
                    .find(|p| p.accum == a)
                    .expect("a member has it");
                let shared = lowered.as_ref().ok().and_then(|l| l.with_accum(a));
                let l = match shared {
                    Some(l) => Ok(l),
                    None => predict::lower_step(member).map_err(|e| format!("{e:#}")),
                };
                (a, l)
            })
            .collect();
        let work = lowered.as_ref().ok().map(prepare);
        // a variant made from the group's lowering prices the same ops
        let variant_work: Vec<Option<StepWork>> = variants
            .iter()
            .map(|(_, l)| {
                let l = l.as_ref().ok()?;
                Some(match (&lowered, &work) {
                    (Ok(own), Some(w)) if Arc::ptr_eq(&own.graph, &l.graph) => {
                        w.with_accum(&l.graph, &l.recipe)
                    }
                    _ => prepare(l),
                })
            })
            .collect();
        let chosen = |i: usize| -> (&Result<Lowered, String>, &Option<StepWork>) {
            match variants.iter().position(|(a, _)| *a == args_of(i).accum) {
                Some(v) => (&variants[v].1, &variant_work[v]),
                None => (&lowered, &work),
            }
        };
        // the members on one machine replay their accumulation counts together
        let mut by_machine: Vec<(Vec<&str>, Vec<usize>)> = Vec::new();
        for &i in members {
            let machine = machine_options(&configs[i]);
            match by_machine.iter_mut().find(|(m, _)| *m == machine) {
                Some((_, list)) => list.push(i),
                None => by_machine.push((machine, vec![i])),
            }
        }
        let out: Vec<(usize, Result<Evaluated, String>)> = by_machine
            .par_iter()
            .flat_map_iter(|(_, on_machine)| {
                let out = replay_on_machine(on_machine, &chosen, &args_of, wants);
                for _ in on_machine {
                    progress.inc();
                }
                out
            })
            .collect();
        out
    };
    // the families that differ only in a sequence length of one residue form a family over both,
    // lowered once per structure where that saves lowerings (`lower_seq_family`)
    let mut seq_families: Vec<Vec<usize>> = Vec::new();
    let mut by_seq_family: HashMap<(Key, u64), usize> = HashMap::new();
    for (f, family) in families.iter().enumerate() {
        let i = groups[family[0]][0];
        let p = args_of(i);
        let key = match p.seq {
            Some(seq) if p.graph.is_none() => {
                let options = lowering_options(&configs[i], &["accum", "batch", "seq"]);
                Some(((options, target_keys[i], accum_key(p)), seq_class(seq)))
            }
            _ => None,
        };
        match key {
            Some(key) => {
                let s = *by_seq_family.entry(key).or_insert_with(|| {
                    seq_families.push(Vec::new());
                    seq_families.len() - 1
                });
                seq_families[s].push(f);
            }
            None => seq_families.push(vec![f]),
        }
    }
    let mut results: Vec<(usize, Result<Evaluated, String>)> = seq_families
        .par_iter()
        .flat_map_iter(|seq_family| {
            let members: Vec<&[usize]> = seq_family.iter().map(|&f| &families[f][..]).collect();
            lower_seq_family(&members, &groups, configs, &args_of)
                .into_par_iter()
                .flat_map_iter(|(g, lowered)| evaluate_group(&groups[g], lowered))
                .collect::<Vec<_>>()
        })
        .collect();
    for (i, p) in parsed.into_iter().enumerate() {
        if let Err(e) = p {
            results.push((i, Err(e)));
            progress.inc();
        }
    }
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// What every replay of `lowered` shares: the step-time model's work.
fn prepare(lowered: &Lowered) -> StepWork {
    StepWork::of(&lowered.graph, &lowered.recipe)
}

/// Evaluates one configuration (`args`, parsed) on a lowering made for it: [`evaluate`]'s work for
/// one point, for searches that make their lowerings themselves (`max-batch` from a template).
pub fn evaluate_lowered(
    lowered: &Lowered,
    args: &PredictArgs,
    wants: Wants,
) -> Result<Evaluated, String> {
    replay_one(lowered, &prepare(lowered), args, wants)
}

/// Batches of one family (configurations that differ only in the batch) from which on its lowering is
/// made from a template ([`BatchTemplate`]): two lowerings fit it, a third checks it, so a family
/// needs this many batches of at least 2 for the template to save a lowering.
const TEMPLATE_FROM_BATCHES: usize = 4;

/// One lowering per group of `family` (`groups[g]`'s first configuration, for each `g` of it), by
/// group: lowered afresh, or, in a family of
/// [`TEMPLATE_FROM_BATCHES`] batches or more, written by the family's [`BatchTemplate`] — fitted
/// through its two smallest batches of at least 2 (batch 1 is a structure of its own: dimensions of 1
/// change kernels and copies) and trusted only when it reproduces a fresh lowering of its largest
/// batch, byte for byte. A structure that changes inside the range (a kernel chosen by size) fails
/// that check, and the family is lowered afresh. DataParallel layouts, whose devices take chunks of
/// the batch, are always lowered afresh.
fn lower_family<'a>(
    family: &[usize],
    groups: &[Vec<usize>],
    args_of: &(dyn Fn(usize) -> &'a PredictArgs + Sync),
) -> Vec<(usize, Result<Lowered, String>)> {
    let first = |g: usize| args_of(groups[g][0]);
    let fresh = |g: usize| predict::lower_step(first(g)).map_err(|e| format!("{e:#}"));
    let mut sized: Vec<(u64, usize)> = family
        .iter()
        .map(|&g| (first(g).batch, g))
        .filter(|&(batch, _)| batch >= 2)
        .collect();
    sized.sort_unstable();
    if sized.len() < TEMPLATE_FROM_BATCHES {
        return family.par_iter().map(|&g| (g, fresh(g))).collect();
    }
    let ends = [sized[0], sized[1], sized[sized.len() - 1]];
    let mut out: Vec<(usize, Result<Lowered, String>)> =
        ends.par_iter().map(|&(_, g)| (g, fresh(g))).collect();
    let template = match (&out[0].1, &out[1].1, &out[2].1) {
        (Ok(a), Ok(b), Ok(last))
            if !crate::dataparallel::is_multi(&a.recipe)
                && !crate::pipeline::is_rank_by_rank(&a.recipe) =>
        {
            BatchTemplate::fit(&a.compact, ends[0].0, &b.compact, ends[1].0)
                .filter(|t| {
                    t.instantiate(ends[2].0)
                        .is_some_and(|made| made.same_as(&last.compact))
                })
                .map(|t| {
                    // the model graphs' template too, trusted where it writes the largest's graph
                    let graph =
                        GraphTemplate::fit(&a.graph, &b.graph).filter(|g| g.writes(&last.graph));
                    t.with_graph(graph)
                })
        }
        _ => None,
    };
    let rest: Vec<usize> = family
        .iter()
        .copied()
        .filter(|g| !ends.iter().any(|(_, e)| e == g))
        .collect();
    out.par_extend(rest.into_par_iter().map(|g| {
        let made = match &template {
            Some(t) if first(g).batch >= 2 => {
                predict::lower_step_instance(first(g), t).map_err(|e| format!("{e:#}"))
            }
            _ => fresh(g),
        };
        (g, made)
    }));
    out
}

/// One lowering per group of `families` (families of one structure that differ only in a sequence
/// length of one residue modulo [`vramsim_models::seq_template::SEQ_CLASS`], each a list of groups
/// that differ only in the batch), by group. Where it saves lowerings, the groups of batch 2 and more
/// (and lengths within the model's positions) are written by one
/// [`SeqBatchTemplate`] fitted through fresh lowerings at the family's two smallest batches of at least
/// 2 × its three shortest lengths (configurations of the grid where it has them, else made for the
/// fit) and trusted only when it reproduces, byte for byte, a fresh lowering at the fourth length
/// (the grid's largest batch there); a point the template does not reach is lowered afresh, and so is
/// everything when the fit or the check fails, or for DataParallel and rank-by-rank layouts.
/// Otherwise each family is lowered as [`lower_family`] lowers it.
fn lower_seq_family<'a>(
    families: &[&[usize]],
    groups: &[Vec<usize>],
    configs: &[Vec<String>],
    args_of: &(dyn Fn(usize) -> &'a PredictArgs + Sync),
) -> Vec<(usize, Result<Lowered, String>)> {
    let by_batch = || -> Vec<(usize, Result<Lowered, String>)> {
        families
            .par_iter()
            .flat_map_iter(|f| lower_family(f, groups, args_of))
            .collect()
    };
    let first = |g: usize| args_of(groups[g][0]);
    let fresh = |args: &PredictArgs| predict::lower_step(args).map_err(|e| format!("{e:#}"));
    // (batch, length, group) of the groups of batch 2 and more within the model's positions, which
    // a template serves (a longer length is an error, lowered afresh to give it)
    let positions = |g: usize| {
        predict::step_recipe(first(g))
            .ok()
            .and_then(|(arch, _, _)| arch.max_positions())
            .unwrap_or(u64::MAX)
    };
    let Some(&any) = families.first().and_then(|f| f.first()) else {
        return Vec::new();
    };
    let max_seq = positions(any);
    let points: Vec<(u64, u64, usize)> = families
        .iter()
        .flat_map(|f| f.iter())
        .map(|&g| (first(g).batch, first(g).seq.unwrap_or(0), g))
        .filter(|&(batch, seq, _)| batch >= 2 && seq <= max_seq)
        .collect();
    let distinct = |of: fn(&(u64, u64, usize)) -> u64| {
        let mut v: Vec<u64> = points.iter().map(of).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let (batches, seqs) = (distinct(|p| p.0), distinct(|p| p.1));
    // what lowering each family's points by the batch costs: three lowerings for a family of a
    // batch template, one per batch otherwise
    let by_batch_cost: usize = families
        .iter()
        .map(|f| {
            let n = f
                .iter()
                .filter(|&&g| points.iter().any(|p| p.2 == g))
                .count();
            if n >= TEMPLATE_FROM_BATCHES {
                3
            } else {
                n
            }
        })
        .sum();
    let one_accum = points
        .iter()
        .all(|p| first(p.2).accum == first(points[0].2).accum);
    if seqs.len() < 4 || batches.len() < 2 || !one_accum || by_batch_cost <= SEQ_TEMPLATE_COST {
        return by_batch();
    }
    let fit_batches = [batches[0], batches[1]];
    let fit_seqs = [seqs[0], seqs[1], seqs[2]];
    // the check: the largest batch at the fourth length
    let check = points
        .iter()
        .filter(|p| p.1 == seqs[3])
        .max_by_key(|p| p.0)
        .map(|p| (p.0, p.1))
        .expect("a fourth length");
    let wanted: Vec<(u64, u64)> = fit_batches
        .iter()
        .flat_map(|&b| fit_seqs.iter().map(move |&s| (b, s)))
        .chain([check])
        .collect();
    // each lowering of the fit and the check: the grid's own configuration there, or one made
    let made: Vec<(Option<usize>, Result<Lowered, String>)> = wanted
        .par_iter()
        .map(
            |&(b, s)| match points.iter().find(|p| (p.0, p.1) == (b, s)) {
                Some(&(_, _, g)) => (Some(g), fresh(first(g))),
                None => {
                    let lowered = OptionSet::predict()
                        .parse(&with_batch_and_seq(&configs[groups[points[0].2][0]], b, s))
                        .map_err(|e| format!("{e:#}"))
                        .and_then(|args| fresh(&args));
                    (None, lowered)
                }
            },
        )
        .collect();
    let compact = |k: usize| made[k].1.as_ref().ok().map(|l| &l.compact);
    let layout_ok = made[0].1.as_ref().is_ok_and(|l| {
        !crate::dataparallel::is_multi(&l.recipe) && !crate::pipeline::is_rank_by_rank(&l.recipe)
    });
    let template = (0..7)
        .map(compact)
        .collect::<Option<Vec<_>>>()
        .filter(|_| layout_ok)
        .and_then(|c| {
            SeqBatchTemplate::fit(
                [[c[0], c[1], c[2]], [c[3], c[4], c[5]]],
                fit_batches,
                fit_seqs,
            )
            .ok()
            .filter(|t| {
                t.instantiate(check.0, check.1)
                    .is_some_and(|instance| instance.same_as(c[6]))
            })
        })
        .map(|t| {
            // the model graphs' template too, trusted where it writes the check's graph
            let graph = |k: usize| made[k].1.as_ref().ok().map(|l| &*l.graph);
            let graphs = (0..7).map(graph).collect::<Option<Vec<_>>>();
            let template = graphs.and_then(|g| {
                SeqGraphTemplate::fit(
                    [[g[0], g[1], g[2]], [g[3], g[4], g[5]]],
                    fit_batches,
                    fit_seqs,
                )
                .filter(|t| t.writes(g[6]))
            });
            t.with_graph(template)
        });
    let Some(template) = template else {
        return by_batch();
    };
    let mut out: Vec<(usize, Result<Lowered, String>)> = Vec::new();
    let mut lowered_groups = Vec::new();
    for (g, lowered) in made {
        if let Some(g) = g {
            lowered_groups.push(g);
            out.push((g, lowered));
        }
    }
    let rest: Vec<usize> = families
        .iter()
        .flat_map(|f| f.iter().copied())
        .filter(|g| !lowered_groups.contains(g))
        .collect();
    out.par_extend(rest.into_par_iter().map(|g| {
        let lowered = if points.iter().any(|p| p.2 == g) {
            predict::lower_step_instance(first(g), &template).map_err(|e| format!("{e:#}"))
        } else {
            fresh(first(g))
        };
        (g, lowered)
    }));
    out
}

/// Fresh lowerings a [`SeqBatchTemplate`] costs: six to fit it (two batches × three lengths), one to
/// check it.
const SEQ_TEMPLATE_COST: usize = 7;

/// `args` (a configuration) at `batch` and `seq`.
fn with_batch_and_seq(args: &[String], batch: u64, seq: u64) -> Vec<String> {
    args.iter()
        .filter(|a| !a.starts_with("--batch=") && !a.starts_with("--seq="))
        .cloned()
        .chain([format!("--batch={batch}"), format!("--seq={seq}")])
        .collect()
}

/// The options of `args` (a configuration) that shape its lowering, but `without` and the
/// machine's.
fn lowering_options<'a>(args: &'a [String], without: &[&str]) -> Vec<&'a str> {
    let set = OptionSet::predict();
    args.iter()
        .map(String::as_str)
        .filter(|a| {
            let long = a.trim_start_matches("--").split('=').next().unwrap_or("");
            !without.contains(&long) && !set.find(long).is_some_and(|o| o.machine)
        })
        .collect()
}

/// The accumulation count that keys a lowering: the count, or 0 for every count a compact lowering
/// serves ([`SHARED_ACCUM_FROM`]).
fn accum_key(args: &PredictArgs) -> u32 {
    if args.accum >= SHARED_ACCUM_FROM {
        0
    } else {
        args.accum
    }
}

/// Accumulation counts from this on share one lowering ([`vramsim_models::compact`]: three
/// micro-batches lowered, the third standing for the third to the last, or for none with two), made
/// for the largest count of a group (a count of three or fewer alone is lowered as it is, and its
/// group gets its own lowerings).
const SHARED_ACCUM_FROM: u32 = 2;

/// What a configuration's lowering takes from its GPU: the choices the models crate makes from the
/// target, or, when they cannot be told here (the error then comes from the lowering), the compute
/// capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum TargetKey {
    /// `Arch::target_choices` of the configuration's recipe.
    Choices(TargetChoices),
    /// The compute capability, if the GPU is known.
    Unknown(Option<(u32, u32)>),
}

fn target_key(args: &PredictArgs) -> TargetKey {
    match predict::step_recipe(args) {
        Ok((arch, recipe, _)) => match arch.target_choices(&recipe) {
            Ok(choices) => TargetKey::Choices(choices),
            Err(_) => TargetKey::Unknown(Some(recipe.target.compute_capability)),
        },
        Err(_) => TargetKey::Unknown(
            predict::target(&args.machine)
                .ok()
                .map(|t| t.compute_capability),
        ),
    }
}

/// The options of `args` (a configuration) that set the machine.
fn machine_options(args: &[String]) -> Vec<&str> {
    let set = OptionSet::predict();
    args.iter()
        .map(String::as_str)
        .filter(|a| {
            let long = a.trim_start_matches("--").split('=').next().unwrap_or("");
            set.find(long).is_some_and(|o| o.machine)
        })
        .collect()
}

/// The lowering chosen for a configuration, with its step-time work.
type Chosen<'l> = (&'l Result<Lowered, String>, &'l Option<StepWork>);

/// Evaluates configurations of one machine (`members`, by index) whose lowerings `chosen` gives:
/// the accumulation counts of one lowering in one replay ([`predict::replay_step_variants`]) where no
/// timeline is kept, else one replay each.
fn replay_on_machine<'l, 'a>(
    members: &[usize],
    chosen: &(dyn Fn(usize) -> Chosen<'l> + Sync),
    args_of: &(dyn Fn(usize) -> &'a PredictArgs + Sync),
    wants: Wants,
) -> Vec<(usize, Result<Evaluated, String>)> {
    let ready: Option<Vec<(&Lowered, &StepWork)>> = members
        .iter()
        .map(|&i| match chosen(i) {
            (Ok(l), Some(w)) => Some((l, w)),
            _ => None,
        })
        .collect();
    match ready {
        Some(ready) if members.len() > 1 && wants.timeline_points == 0 => {
            let lowered: Vec<&Lowered> = ready.iter().map(|(l, _)| *l).collect();
            match predict::replay_step_variants(
                &lowered,
                &args_of(members[0]).machine,
                wants.breakdown(),
            ) {
                Ok(replayed) => members
                    .iter()
                    .zip(ready)
                    .zip(replayed)
                    .map(|((&i, (l, w)), r)| (i, evaluated(l, w, args_of(i), wants, r)))
                    .collect(),
                Err(e) => members
                    .iter()
                    .map(|&i| (i, Err(format!("{e:#}"))))
                    .collect(),
            }
        }
        _ => members
            .iter()
            .map(|&i| {
                let result = match chosen(i) {
                    (Ok(lowered), Some(work)) => replay_one(lowered, work, args_of(i), wants),
                    (Err(e), _) => Err(e.clone()),
                    (Ok(_), None) => unreachable!("work exists for every lowering"),
                };
                (i, result)
            })
            .collect(),
    }
}

fn replay_one(
    lowered: &predict::Lowered,
    work: &StepWork,
    args: &PredictArgs,
    wants: Wants,
) -> Result<Evaluated, String> {
    let replayed = predict::replay_step(
        lowered,
        &args.machine,
        wants.timeline_points,
        wants.breakdown(),
    )
    .map_err(|e| format!("{e:#}"))?;
    evaluated(lowered, work, args, wants, replayed)
}

/// A configuration's evaluation from its replay.
fn evaluated(
    lowered: &predict::Lowered,
    work: &StepWork,
    args: &PredictArgs,
    wants: Wants,
    (report, mut prediction): (Report, Prediction),
) -> Result<Evaluated, String> {
    // The shared lowering was made for the group's first GPU: this configuration's own GPU gets the
    // same kernels, but its own reasons (its compute capability).
    let target = predict::target(&args.machine).map_err(|e| format!("{e:#}"))?;
    if target != prediction.recipe.target {
        prediction.recipe.target = target;
        prediction.attention = lowered
            .arch
            .attention_kernel(&prediction.recipe)
            .map_err(|e| format!("{e:#}"))?;
    }
    let (perf, perf_own) = perf_for(&report.device);
    let step = work.time(perf);
    let json = wants
        .json
        .then(|| predict::to_json(&report, &prediction, &lowered.compact.meta));
    Ok(Evaluated {
        report,
        prediction,
        json,
        step,
        perf_preset: perf.preset,
        perf_own,
        last_iteration_start: last_iteration_start(&lowered.compact.meta),
    })
}

/// The event index where the trace's last iteration begins, from `meta.phases` (0 if unknown).
fn last_iteration_start(meta: &serde_json::Map<String, Value>) -> u64 {
    let Some(phases) = meta.get("phases").and_then(Value::as_array) else {
        return 0;
    };
    let iteration = |p: &Value| p.get("iteration").and_then(Value::as_u64);
    let last = phases.iter().filter_map(iteration).max();
    phases
        .iter()
        .find(|p| iteration(p) == last && last.is_some())
        .and_then(|p| p.get("event").and_then(Value::as_u64))
        .unwrap_or(0)
}

/// Evaluates one configuration (`predict`'s arguments).
pub fn evaluate_one(args: &[String], wants: Wants) -> Result<Evaluated> {
    let mut results = evaluate(&[args.to_vec()], wants, &Progress::hidden());
    match results.pop() {
        Some(Ok(evaluated)) => Ok(evaluated),
        Some(Err(message)) => bail!("{message}"),
        None => bail!("nothing was evaluated"),
    }
}

/// A progress bar on stderr that appears only when the work takes longer than a moment and both stdout
/// and stderr are terminals.
pub struct Progress {
    bar: ProgressBar,
    start: Instant,
    enabled: bool,
    shown: AtomicBool,
}

/// How long work runs before its progress bar appears.
const PROGRESS_DELAY: Duration = Duration::from_millis(400);

impl Progress {
    /// A bar for `len` steps, described by `message`.
    pub fn new(len: u64, message: &str) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
        if let Ok(style) = ProgressStyle::with_template(
            "{msg} [{bar:40.cyan/blue}] {pos}/{len} ({elapsed}, about {eta} left)",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(message.to_string());
        Progress {
            bar,
            start: Instant::now(),
            enabled: std::io::stdout().is_terminal() && std::io::stderr().is_terminal(),
            shown: AtomicBool::new(false),
        }
    }

    /// A bar that never shows.
    pub fn hidden() -> Progress {
        Progress {
            enabled: false,
            ..Progress::new(0, "")
        }
    }

    /// One step done.
    pub fn inc(&self) {
        self.bar.inc(1);
        if self.enabled
            && !self.shown.load(Ordering::Relaxed)
            && self.start.elapsed() > PROGRESS_DELAY
            && !self.shown.swap(true, Ordering::Relaxed)
        {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    }

    /// Removes the bar (if it was shown).
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// A `--headroom`: a share of the device's memory (`5%`) or a size (`2GiB`) that a fit must leave free.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Headroom {
    /// A fraction of the total memory, 0 ≤ f < 1.
    Fraction(f64),
    /// Bytes.
    Bytes(u64),
}

impl Headroom {
    /// Reads `5%`, `0.05`, `2GiB`.
    pub fn parse(text: &str) -> Result<Headroom, String> {
        let t = text.trim();
        if let Some(percent) = t.strip_suffix('%') {
            let p: f64 = percent
                .trim()
                .parse()
                .map_err(|_| format!("headroom {text:?} is not a percentage like 5%"))?;
            if !(0.0..100.0).contains(&p) {
                return Err(format!("headroom {text:?} must be from 0% to below 100%"));
            }
            return Ok(Headroom::Fraction(p / 100.0));
        }
        if let Ok(f) = t.parse::<f64>() {
            if (0.0..1.0).contains(&f) {
                return Ok(Headroom::Fraction(f));
            }
        }
        vramsim_sim::device::parse_size(t)
            .map(Headroom::Bytes)
            .map_err(|e| format!("headroom {text:?}: give a percentage (5%), a fraction (0.05) or a size (2GiB): {e}"))
    }

    /// Bytes it keeps free on a device of `total` bytes.
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            Headroom::Fraction(f) => (total as f64 * f).round() as u64,
            Headroom::Bytes(b) => b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_predict_option_but_the_output_ones_can_be_set() {
        let set = OptionSet::predict();
        for key in [
            "model",
            "batch",
            "precision",
            "checkpoint",
            "accum",
            "gpu",
            "alloc-conf",
            "head",
            "loss",
            "keep-outputs",
            "image-size",
            "num-classes",
        ] {
            assert!(set.find(key).is_some(), "{key}");
        }
        assert!(set
            .find("keep-outputs")
            .is_some_and(|o| o.flag && !o.machine));
        assert!(set.find("head").is_some_and(|o| !o.flag && !o.machine));
        assert!(set.find("alloc_conf").is_some_and(|o| o.machine));
        assert!(set.find("--gpu").is_some_and(|o| o.machine));
        assert!(set.find("batch").is_some_and(|o| !o.machine));
        assert!(set.find("inference").is_some_and(|o| o.flag));
        for output in ["json", "plot", "trace-out", "help"] {
            assert!(set.find(output).is_none(), "{output}");
        }
    }

    #[test]
    fn arguments_replace_fixed_options_and_quote_for_the_shell() {
        let fixed = FixedOptions {
            given: vec![
                ("model".into(), Some("gpt2".into())),
                ("batch".into(), Some("4".into())),
                ("inference".into(), None),
            ],
        };
        let settings = vec![
            ("batch".to_string(), "8".to_string()),
            ("alloc-conf".to_string(), String::new()),
        ];
        assert_eq!(
            fixed.args(&settings),
            ["--model=gpt2", "--inference", "--batch=8", "--alloc-conf="]
        );
        assert_eq!(
            fixed.command_line(&settings),
            "vramsim predict --model gpt2 --inference --batch 8 --alloc-conf ''"
        );
        let args = OptionSet::predict().parse(&fixed.args(&settings)).unwrap();
        assert_eq!(args.batch, 8);
        assert!(args.inference);
    }

    #[test]
    fn lowerings_are_shared_only_where_the_gpus_get_the_same_kernels() {
        // bf16 Llama attention: cuDNN on sm 9.0 (H100, H200), FlashAttention-2 on sm 8.0 (A100) and
        // sm 8.9 (RTX 4090): sdp_utils.cpp's priority order.
        let configs: Vec<Vec<String>> = ["h100-80gb", "a100-80gb", "h200", "rtx4090"]
            .iter()
            .map(|gpu| {
                [
                    "--model=tinyllama-1.1b",
                    "--batch=1",
                    "--seq=64",
                    "--precision=bf16",
                    &format!("--gpu={gpu}"),
                ]
                .iter()
                .map(|s| s.to_string())
                .collect()
            })
            .collect();
        let results = evaluate(&configs, Wants::default(), &Progress::hidden());
        let attention = |i: usize| {
            let e = results[i].as_ref().expect("evaluates");
            e.prediction.attention.clone().expect("attention")
        };
        use vramsim_models::zoo::Kernel;
        use vramsim_models::SdpaBackend;
        assert_eq!(attention(0).kernel, Kernel::Sdpa(SdpaBackend::Cudnn));
        assert_eq!(attention(1).kernel, Kernel::Sdpa(SdpaBackend::Flash));
        assert_eq!(attention(2).kernel, Kernel::Sdpa(SdpaBackend::Cudnn));
        assert_eq!(attention(3).kernel, Kernel::Sdpa(SdpaBackend::Flash));
        // Each configuration gets its own GPU's reason, shared lowering or not.
        assert!(
            attention(3).reason.contains("sm 8.9"),
            "{}",
            attention(3).reason
        );
        assert!(
            attention(1).reason.contains("sm 8.0"),
            "{}",
            attention(1).reason
        );
        // H100 and H200 share one lowering (timed once), A100 and RTX 4090 another; the two
        // lowerings differ (cuDNN's and flash's allocations).
        let e = |i: usize| results[i].as_ref().unwrap();
        assert_eq!(e(0).prediction.lower_ms, e(2).prediction.lower_ms);
        assert_eq!(e(1).prediction.lower_ms, e(3).prediction.lower_ms);
        assert_ne!(e(0).prediction.events, e(1).prediction.events);
    }

    #[test]
    fn headroom_reads_percentages_fractions_and_sizes() {
        assert_eq!(Headroom::parse("5%"), Ok(Headroom::Fraction(0.05)));
        assert_eq!(Headroom::parse("0.1"), Ok(Headroom::Fraction(0.1)));
        assert_eq!(Headroom::parse("2GiB"), Ok(Headroom::Bytes(2 << 30)));
        assert!(Headroom::parse("120%").is_err());
        assert!(Headroom::parse("lots").is_err());
        assert_eq!(Headroom::Fraction(0.05).bytes(1000), 50);
    }
}
