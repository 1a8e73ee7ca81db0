//! The remedies `vramsim diagnose` tries: each candidate replays the same history with one setting
//! changed, and is reported with what the replay says (whether the OOM disappears, the new peaks).
//!
//! PyTorch's caching allocator: `expandable_segments:True` (no fragmentation across segments),
//! `max_split_size_mb` 128/256/512 (large cached blocks are not split for small requests),
//! `garbage_collection_threshold:0.6` (with `set_per_process_memory_fraction(1.0)` where no fraction is
//! set, since PyTorch only collects under a fraction), and `torch.cuda.empty_cache()` at every iteration
//! start (or phase start). TensorFlow's BFC: `TF_GPU_ALLOCATOR=cuda_malloc_async`, memory growth. JAX:
//! `XLA_PYTHON_CLIENT_MEM_FRACTION=.95` (the default preallocation leaves a quarter of the device
//! unused), `XLA_PYTHON_CLIENT_ALLOCATOR=platform`.

use anyhow::Result;
use serde_json::{json, Value};
use vramsim_sim::engine::ReplayOutcome;
use vramsim_sim::format::format_size;
use vramsim_traces::Event;

use super::history::Iterations;
use super::{peaks_json, replay_events};
use crate::machine::{AllocatorKind, MachineArgs};

/// One candidate, replayed.
#[derive(Clone, Debug)]
pub struct Remedy {
    /// What it is.
    pub name: String,
    /// The setting that applies it (an environment variable or a call).
    pub setting: String,
    /// When the original replay ran out of memory: whether this one does not.
    pub avoids_oom: Option<bool>,
    /// The replay with it.
    pub outcome: ReplayOutcome,
}

impl Remedy {
    /// The remedy as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "name": self.name,
            "setting": self.setting,
            "avoids_oom": self.avoids_oom,
            "peaks": peaks_json(&self.outcome),
            "oom": self.outcome.oom.as_ref().map(|o| o.message.clone()),
        })
    }

    /// One line of the table.
    pub fn to_line(&self, had_oom: bool) -> String {
        let verdict = match (had_oom, self.outcome.oom.is_none()) {
            (true, true) => "avoids the OOM",
            (true, false) => "still OOMs   ",
            (false, true) => "fits         ",
            (false, false) => "OOMs         ",
        };
        format!(
            "remedy     {verdict} peak reserved {:>10}, allocated {:>10}: {} ({})",
            format_size(self.outcome.stats.reserved_bytes.all.peak.max(0) as u64),
            format_size(self.outcome.stats.allocated_bytes.all.peak.max(0) as u64),
            self.name,
            self.setting
        )
    }
}

/// A candidate: the machine to replay on and whether to empty the cache at iteration starts.
struct Candidate {
    name: String,
    setting: String,
    machine: MachineArgs,
    empty_cache: bool,
}

/// `base` with one more `PYTORCH_CUDA_ALLOC_CONF` option.
fn with_option(base: &str, option: &str) -> String {
    if base.is_empty() {
        option.to_string()
    } else {
        format!("{base},{option}")
    }
}

fn candidates(machine: &MachineArgs, iterations: &Option<Iterations>) -> Vec<Candidate> {
    let mut out = Vec::new();
    let mut add = |name: &str, setting: String, machine: MachineArgs, empty_cache: bool| {
        out.push(Candidate {
            name: name.to_string(),
            setting,
            machine,
            empty_cache,
        })
    };
    match machine.allocator {
        AllocatorKind::Pytorch => {
            let base = machine.alloc_conf.as_str();
            let conf = |option: &str| MachineArgs {
                alloc_conf: with_option(base, option),
                ..machine.clone()
            };
            let env =
                |option: &str| format!("PYTORCH_CUDA_ALLOC_CONF={}", with_option(base, option));
            if !base
                .to_ascii_lowercase()
                .contains("expandable_segments:true")
            {
                let o = "expandable_segments:True";
                add("expandable segments", env(o), conf(o), false);
            }
            for mb in [128, 256, 512] {
                let o = format!("max_split_size_mb:{mb}");
                add(&format!("max_split_size_mb {mb}"), env(&o), conf(&o), false);
            }
            let o = "garbage_collection_threshold:0.6";
            let mut gc = conf(o);
            let mut setting = env(o);
            if gc.memory_fraction.is_none() {
                gc.memory_fraction = Some(1.0);
                setting.push_str(" with torch.cuda.set_per_process_memory_fraction(1.0)");
            }
            add("garbage collection threshold 0.6", setting, gc, false);
            if iterations.is_some() {
                add(
                    "empty_cache at each iteration",
                    "torch.cuda.empty_cache() at the start of each iteration".to_string(),
                    machine.clone(),
                    true,
                );
            }
        }
        AllocatorKind::TfBfc => {
            let mut env = machine.env.clone();
            env.push("TF_GPU_ALLOCATOR=cuda_malloc_async".into());
            add(
                "CUDA's stream-ordered allocator",
                "TF_GPU_ALLOCATOR=cuda_malloc_async".into(),
                MachineArgs {
                    env,
                    ..machine.clone()
                },
                false,
            );
            if !machine.allow_growth {
                add(
                    "memory growth",
                    "tf.config.experimental.set_memory_growth(gpu, True)".into(),
                    MachineArgs {
                        allow_growth: true,
                        ..machine.clone()
                    },
                    false,
                );
            }
        }
        AllocatorKind::Jax => {
            for (name, var) in [
                (
                    "a larger preallocation",
                    "XLA_PYTHON_CLIENT_MEM_FRACTION=.95",
                ),
                ("no caching", "XLA_PYTHON_CLIENT_ALLOCATOR=platform"),
            ] {
                let mut env = machine.env.clone();
                env.push(var.into());
                add(
                    name,
                    var.into(),
                    MachineArgs {
                        env,
                        ..machine.clone()
                    },
                    false,
                );
            }
        }
        AllocatorKind::CudaMalloc | AllocatorKind::CudaAsync => {}
    }
    out
}

/// `events` with an `empty_cache` before every iteration start after the first.
fn with_empty_cache(events: &[Event], iterations: &Iterations) -> Vec<Event> {
    let mut out = Vec::with_capacity(events.len() + iterations.starts.len());
    let mut starts = iterations.starts.iter().skip(1).peekable();
    for (i, e) in events.iter().enumerate() {
        while starts.peek().is_some_and(|&&s| s == i as u64) {
            out.push(Event::EmptyCache);
            starts.next();
        }
        out.push(e.clone());
    }
    out
}

/// Replays every candidate for `machine` (see the module documentation).
pub fn try_all(
    events: &[Event],
    machine: &MachineArgs,
    iterations: &Option<Iterations>,
    had_oom: bool,
) -> Result<Vec<Remedy>> {
    let mut out = Vec::new();
    for c in candidates(machine, iterations) {
        let outcome = match (c.empty_cache, iterations) {
            (true, Some(it)) => {
                replay_events(&with_empty_cache(events, it), &c.machine, 0)?.outcome
            }
            _ => replay_events(events, &c.machine, 0)?.outcome,
        };
        out.push(Remedy {
            name: c.name,
            setting: c.setting,
            avoids_oom: had_oom.then_some(outcome.oom.is_none()),
            outcome,
        });
    }
    Ok(out)
}

/// `predict`'s options that a lowered trace's `meta` records, as (meta key, option).
const RECIPE_KEYS: &[(&str, &str)] = &[
    ("model", "--model"),
    ("seq", "--seq"),
    ("precision", "--precision"),
    ("optimizer", "--optimizer"),
    ("checkpoint", "--checkpoint"),
    ("accum", "--accum"),
    ("iterations", "--iterations"),
];

/// For a trace `vramsim predict --trace-out` wrote (a known model step: its `meta` names the model and
/// batch): the same recipe at ¾ and ½ of the recorded batch, lowered and replayed on `machine`. Tried
/// only when lowering the recorded batch gives back a trace of the same length (the meta describes the
/// trace); otherwise, as for any other trace, there is no batch to scale and no candidate.
pub fn smaller_batches(
    meta: &vramsim_traces::Meta,
    events: usize,
    machine: &MachineArgs,
    had_oom: bool,
) -> Result<Vec<Remedy>> {
    let Some(batch) = meta.get("batch").and_then(Value::as_u64) else {
        return Ok(Vec::new());
    };
    if meta.get("tool").and_then(Value::as_str) != Some("vramsim-models") || batch < 2 {
        return Ok(Vec::new());
    }
    let recipe: Vec<String> = RECIPE_KEYS
        .iter()
        .filter_map(|(key, option)| {
            let v = meta.get(*key)?;
            let text = match v {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                _ => return None,
            };
            Some([option.to_string(), text])
        })
        .flatten()
        .collect();
    let lower = |b: u64| -> Result<ReplayOutcome> {
        let mut args: Vec<String> = recipe.clone();
        args.extend(["--batch".to_string(), b.to_string()]);
        let mut a: crate::predict::PredictArgs = crate::parse_args("predict", &args)?;
        a.machine = machine.clone();
        let p = crate::predict::predict(&a)?;
        if b == batch && p.lowered.compact.events != events {
            anyhow::bail!("the trace's meta does not describe it");
        }
        Ok(p.report.outcome)
    };
    if lower(batch).is_err() {
        return Ok(Vec::new());
    }
    let mut sizes: Vec<u64> = [batch * 3 / 4, batch / 2]
        .into_iter()
        .filter(|&b| b >= 1 && b < batch)
        .collect();
    sizes.dedup();
    let mut out = Vec::new();
    for b in sizes {
        let outcome = lower(b)?;
        out.push(Remedy {
            name: format!("batch {b} instead of {batch}"),
            setting: format!(
                "batch size {b} (vramsim predict {} --batch {b})",
                recipe.join(" ")
            ),
            avoids_oom: had_oom.then_some(outcome.oom.is_none()),
            outcome,
        });
    }
    Ok(out)
}
