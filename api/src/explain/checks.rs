//! The what-ifs of a training step, replayed on the device of an out-of-memory message: with the model
//! and recipe (`--model`/`--hf-config`/`--graph` and `predict`'s options), each single change that could
//! shed memory (mixed precision, checkpointing, a smaller micro-batch with accumulation keeping the
//! effective batch, expandable segments) is evaluated by `predict`'s own code through the sweep
//! machinery of `whatif` ([`crate::sweep::evaluate`]), and the largest batch that fits is found by
//! `max-batch`'s search ([`crate::maxbatch::search`]); only the changes whose peak fits the device are
//! listed. With a trace or PyTorch snapshot of the run instead, its allocator settings are replayed
//! ([`crate::replay::replay`]) and those under which it no longer runs out of memory are listed.

use anyhow::{bail, Result};
use vramsim_sim::format::format_size;

use super::remedies::Remedy;
use crate::maxbatch;
use crate::replay::{self, ReplayArgs};
use crate::sweep::{self, Evaluated, FixedOptions, Progress, Setting, Wants};

/// What the replays said.
pub struct Checked {
    /// The recipe as given, replayed on the device.
    pub base: Evaluated,
    /// Its `vramsim predict` command.
    pub base_command: String,
    /// The changes that fit, lowest peak first.
    pub fitting: Vec<Remedy>,
    /// Changes tried.
    pub tried: usize,
    /// The largest batch that fits with everything else as given (when the recipe as given does not).
    pub max_batch: Option<Remedy>,
}

/// The options a model is given by.
pub fn has_model(fixed: &FixedOptions) -> bool {
    ["model", "hf-config", "graph"].iter().any(|k| fixed.has(k))
}

/// `fixed` on the message's device: its capacity unless the command line names a device.
pub fn on_device(fixed: &FixedOptions, capacity: Option<u64>) -> FixedOptions {
    let mut fixed = fixed.clone();
    let named = ["gpu", "capacity", "calibration"]
        .iter()
        .any(|k| fixed.has(k));
    if let (false, Some(c)) = (named, capacity) {
        fixed.given.push(("capacity".into(), Some(c.to_string())));
    }
    fixed
}

/// The single changes worth trying from the recipe `fixed` describes.
fn candidates(fixed: &FixedOptions) -> Vec<Vec<Setting>> {
    let set = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
    let mut out = Vec::new();
    let precision = fixed.value("precision").unwrap_or("fp32");
    for p in ["amp-bf16", "amp-fp16", "bf16"] {
        if p != precision && precision != "bf16" {
            out.push(set("precision", p));
        }
    }
    let checkpoint = fixed.value("checkpoint").unwrap_or("none");
    for c in ["selective", "sqrt", "full"] {
        if c != checkpoint && checkpoint != "full" {
            out.push(set("checkpoint", c));
        }
    }
    let batch: u64 = fixed
        .value("batch")
        .and_then(|b| b.parse().ok())
        .unwrap_or(1);
    let accum: u64 = fixed
        .value("accum")
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    for k in [2u64, 4, 8] {
        if batch.is_multiple_of(k) && batch / k >= 1 {
            out.push(vec![
                ("batch".to_string(), (batch / k).to_string()),
                ("accum".to_string(), (accum * k).to_string()),
            ]);
        }
    }
    let conf = fixed.value("alloc-conf").unwrap_or("");
    if !conf.contains("expandable_segments") {
        let with = if conf.is_empty() {
            "expandable_segments:True".to_string()
        } else {
            format!("{conf},expandable_segments:True")
        };
        out.push(set("alloc-conf", &with));
    }
    out
}

/// Replays the recipe and its single changes on the device.
pub fn check(fixed: &FixedOptions) -> Result<Checked> {
    if !fixed.has("batch") {
        bail!("checking remedies replays the training step: give --batch (and the recipe) with --model");
    }
    let changes = candidates(fixed);
    let mut configs = vec![fixed.args(&[])];
    configs.extend(changes.iter().map(|c| fixed.args(c)));
    let mut results = sweep::evaluate(&configs, Wants::default(), &Progress::hidden()).into_iter();
    let base = match results.next() {
        Some(Ok(e)) => e,
        Some(Err(message)) => bail!("predict refused the recipe: {message}"),
        None => bail!("nothing evaluated"),
    };
    let total = base.report.device.total_memory;
    let mut fitting: Vec<(u64, Remedy)> = Vec::new();
    for (change, result) in changes.iter().zip(results) {
        let Ok(e) = result else { continue };
        if !e.fits() {
            continue;
        }
        let used = e.report.peak_device_used();
        let what = change
            .iter()
            .map(|(k, v)| format!("--{k} {v}"))
            .collect::<Vec<_>>()
            .join(" ");
        fitting.push((
            used,
            Remedy {
                kind: "whatif",
                text: format!(
                    "{what}: peak device use {} of {} (replayed: fits)",
                    format_size(used),
                    format_size(total)
                ),
                command: Some(fixed.command_line(change)),
                peak_device_used_bytes: Some(used),
            },
        ));
    }
    fitting.sort_by_key(|(used, _)| *used);
    let max_batch = if base.fits() {
        None
    } else {
        let without_batch = FixedOptions {
            given: fixed
                .given
                .iter()
                .filter(|(k, _)| k != "batch")
                .cloned()
                .collect(),
        };
        maxbatch::search(&without_batch, "batch", &[], None, None)
            .ok()
            .map(|s| {
                let used = s.largest.evaluated.report.peak_device_used();
                let setting = vec![("batch".to_string(), s.largest.size.to_string())];
                Remedy {
                    kind: "max_batch",
                    text: format!(
                        "the largest micro-batch that fits with the rest as given is {} (peak device use \
                         {}; max-batch's search)",
                        s.largest.size,
                        format_size(used)
                    ),
                    command: Some(without_batch.command_line(&setting)),
                    peak_device_used_bytes: Some(used),
                }
            })
    };
    Ok(Checked {
        base_command: fixed.command_line(&[]),
        base,
        tried: changes.len(),
        fitting: fitting.into_iter().map(|(_, r)| r).collect(),
        max_batch,
    })
}

/// What replaying a recorded run under other allocator settings said.
pub struct RunChecked {
    /// The run's file.
    pub path: String,
    /// Whether the run, with the settings as given, runs out of memory on the device.
    pub base_fits: bool,
    /// Settings tried.
    pub tried: usize,
    /// The settings under which it fits.
    pub fitting: Vec<Remedy>,
}

/// Replays the trace or snapshot at `path` on the device (`fixed`'s machine options, else `capacity`)
/// with the allocator settings as given, then with `expandable_segments:True` and `max_split_size_mb`
/// at the request's size (blocks that large stay whole, §12.3) and at 128 and 512 MiB.
pub fn check_run(
    path: &std::path::Path,
    fixed: &FixedOptions,
    capacity: Option<u64>,
    requested: u64,
) -> Result<RunChecked> {
    let set = crate::sweep::OptionSet::predict();
    let on = on_device(fixed, capacity);
    let machine: Vec<(String, Option<String>)> = on
        .given
        .iter()
        .filter(|(k, _)| k != "alloc-conf" && set.find(k).is_some_and(|o| o.machine))
        .cloned()
        .collect();
    let given_conf = fixed.value("alloc-conf").unwrap_or("").to_string();
    let run = |conf: &str| -> Result<bool> {
        let mut args: Vec<String> = vec![path.display().to_string()];
        for (k, v) in &machine {
            args.push(match v {
                Some(v) => format!("--{k}={v}"),
                None => format!("--{k}"),
            });
        }
        if !conf.is_empty() {
            args.push(format!("--alloc-conf={conf}"));
        }
        let a: ReplayArgs = crate::parse_args("replay", &args)?;
        Ok(replay::replay(a)?.report.fits())
    };
    let base_fits = run(&given_conf)?;
    let with = |extra: &str| {
        if given_conf.is_empty() {
            extra.to_string()
        } else {
            format!("{given_conf},{extra}")
        }
    };
    // §12.3: max_split_size_mb must exceed 20 MiB
    let mut splits: Vec<u64> = vec![(requested >> 20).max(21), 128, 512];
    splits.dedup();
    let mut confs = vec![with("expandable_segments:True")];
    confs.extend(
        splits
            .iter()
            .map(|n| with(&format!("max_split_size_mb:{n}"))),
    );
    let mut fitting = Vec::new();
    for conf in &confs {
        if run(conf)? {
            let mut command = format!("vramsim replay {}", path.display());
            for (k, v) in &machine {
                command.push_str(&format!(" --{k} {}", v.as_deref().unwrap_or("")));
            }
            command.push_str(&format!(" --alloc-conf {conf}"));
            fitting.push(Remedy {
                kind: "allocator_whatif",
                text: format!(
                    "--alloc-conf {conf}: the recorded run, replayed on the device, no longer runs out \
                     of memory"
                ),
                command: Some(command),
                peak_device_used_bytes: None,
            });
        }
    }
    Ok(RunChecked {
        path: path.display().to_string(),
        base_fits,
        tried: confs.len(),
        fitting,
    })
}
