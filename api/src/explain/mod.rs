//! `vramsim explain`: reads a pasted out-of-memory message (PyTorch of any version, Ascend's torch_npu,
//! TensorFlow, JAX/XLA), gives its figures as bytes with the interval their rounding leaves, says what
//! decided the failure by a stated rule ([`verdict`]), and lists the remedies for that cause
//! ([`remedies`]); with a model and recipe it replays the what-ifs on the message's device and lists
//! those that fit ([`checks`]). The parser is `vramsim_sim::oom_text`.

pub mod checks;
pub mod figures;
pub mod remedies;
pub mod verdict;

use std::fmt::Write as _;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::{json, Value};
use vramsim_sim::format::format_size;
use vramsim_sim::oom_text::{self, ParsedOom, Size};

use crate::machine::MachineArgs;
use crate::sweep::{FixedOptions, OptionSet};
use figures::{Figures, Range};
use remedies::Remedy;
use verdict::{Verdict, RULE};

/// Options of `vramsim explain`.
#[derive(Args, Debug)]
pub struct ExplainArgs {
    /// The message (quote it), or `-` to read it from standard input (the default when no text is
    /// given), for multi-line pastes.
    #[arg(value_name = "TEXT | -")]
    pub text: Option<String>,
    /// Print the explanation as JSON.
    #[arg(long)]
    pub json: bool,
    /// A trace or PyTorch memory snapshot of the run that failed: its allocator settings
    /// (expandable_segments, max_split_size_mb) are replayed on the message's device and those under
    /// which it no longer runs out of memory are listed.
    #[arg(long, value_name = "FILE")]
    pub snapshot: Option<std::path::PathBuf>,
    /// The options of `vramsim predict`: with --model, --hf-config or --graph and the recipe (--batch,
    /// ...), the remedies are replayed on the message's device and only those that fit are listed;
    /// --gpu or --capacity give the device when the message does not (TensorFlow, XLA).
    #[command(flatten)]
    pub predict: FixedOptions,
}

/// The explanation of one message.
pub struct Explained {
    /// What the message says.
    pub parsed: ParsedOom,
    /// Its figures and what follows from them.
    pub figures: Figures,
    /// The rule's outcome.
    pub verdict: Verdict,
    /// What to do.
    pub remedies: Vec<Remedy>,
    /// The replayed what-ifs, when a model was given.
    pub checked: Option<checks::Checked>,
    /// The recorded run replayed under other allocator settings, when `--snapshot` was given.
    pub checked_run: Option<checks::RunChecked>,
}

/// The device capacity the command line gives (`--gpu`, `--capacity`, `--calibration`), if any.
fn command_line_capacity(fixed: &FixedOptions) -> Result<Option<u64>> {
    let set = OptionSet::predict();
    let args: Vec<String> = fixed
        .given
        .iter()
        .filter(|(k, _)| set.find(k).is_some_and(|o| o.machine))
        .map(|(k, v)| match v {
            Some(v) => format!("--{k}={v}"),
            None => format!("--{k}"),
        })
        .collect();
    if !["gpu", "capacity", "calibration"]
        .iter()
        .any(|k| fixed.has(k))
    {
        return Ok(None);
    }
    let machine: MachineArgs = crate::parse_args("explain", &args)?;
    let calibration = machine.calibration()?;
    Ok(Some(machine.device(calibration.as_ref())?.total_memory))
}

/// `vramsim explain` without the printing: parses `text`, applies the rule, lists the remedies, and
/// replays the what-ifs when `args` name a model.
pub fn explain(text: &str, args: &ExplainArgs) -> Result<Explained> {
    let parsed = oom_text::parse(text)?;
    let given_capacity = command_line_capacity(&args.predict)?;
    let figures = Figures::of(&parsed, given_capacity);
    let verdict = verdict::decide(&figures);
    let with_model = checks::has_model(&args.predict) || args.snapshot.is_some();
    let mut remedies = remedies::for_verdict(&parsed, &figures, &verdict, with_model);
    let checked = if checks::has_model(&args.predict) {
        let fixed = checks::on_device(&args.predict, figures.capacity.map(|c| c.bytes));
        let checked = checks::check(&fixed).context("checking the remedies")?;
        remedies.extend(checked.fitting.iter().cloned());
        remedies.extend(checked.max_batch.iter().cloned());
        Some(checked)
    } else {
        None
    };
    let checked_run = match &args.snapshot {
        Some(path) => {
            let c = checks::check_run(
                path,
                &args.predict,
                figures.capacity.map(|c| c.bytes),
                figures.requested.bytes,
            )
            .with_context(|| format!("replaying {}", path.display()))?;
            remedies.extend(c.fitting.iter().cloned());
            Some(c)
        }
        None => None,
    };
    Ok(Explained {
        parsed,
        figures,
        verdict,
        remedies,
        checked,
        checked_run,
    })
}

/// Runs `vramsim explain`: the text from the argument, or standard input for `-` or none.
pub fn run(args: ExplainArgs) -> Result<()> {
    let text = match args.text.as_deref() {
        Some("-") | None => {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                .context("cannot read the message from standard input")?;
            s
        }
        Some(t) => t.to_string(),
    };
    let explained = explain(&text, &args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&explained.to_json())?);
    } else {
        print!("{}", explained.to_table());
    }
    Ok(())
}

fn range_json(r: Option<Range>) -> Value {
    r.map_or(Value::Null, |r| json!(r.bytes))
}

fn bound_json(r: Option<Range>, printed: Option<&Size>) -> Value {
    match r {
        None => Value::Null,
        Some(r) => {
            let mut o = json!({"min": r.min, "max": r.max});
            if let Some(s) = printed {
                o["printed"] = json!(s.printed);
                o["exact_rounding_rule"] = json!(s.exact);
            }
            o
        }
    }
}

impl Explained {
    /// `vramsim explain --json`'s document. Byte fields hold the value the printed figures give; `bounds`
    /// holds, for each, the interval of byte counts that print the same (`min`, `max`).
    pub fn to_json(&self) -> Value {
        let p = &self.parsed;
        let f = &self.figures;
        let v = &self.verdict;
        let remedies: Vec<Value> = self
            .remedies
            .iter()
            .map(|r| {
                json!({
                    "kind": r.kind,
                    "text": r.text,
                    "command": r.command,
                    "peak_device_used_bytes": r.peak_device_used_bytes,
                })
            })
            .collect();
        let bounds = json!({
            "requested_bytes": bound_json(Some(f.requested), Some(&p.requested)),
            "capacity_bytes": bound_json(f.capacity, p.capacity.as_ref()),
            "free_bytes": bound_json(f.free, p.free.as_ref()),
            "allowed_bytes": bound_json(p.allowed.as_ref().map(Range::of), p.allowed.as_ref()),
            "pytorch_allocated_bytes": bound_json(f.allocated, p.allocated.as_ref()),
            "pytorch_reserved_bytes": bound_json(f.reserved, p.reserved.as_ref()),
            "pytorch_reserved_unallocated_bytes": bound_json(f.reserved_unallocated, p.reserved_unallocated.as_ref()),
            "this_process_bytes": bound_json(f.this_process, p.this_process.as_ref()),
            "non_pytorch_bytes": bound_json(f.non_pytorch, None),
            "other_processes_bytes": bound_json(f.other_processes, None),
            "shortfall_bytes": bound_json(v.shortfall, None),
        });
        json!({
            "framework": p.format.framework(),
            "format": p.format.name(),
            "backend": p.backend,
            "device": p.device,
            "requested_bytes": f.requested.bytes,
            "capacity_bytes": range_json(f.capacity),
            "free_bytes": range_json(f.free),
            "allowed_bytes": p.allowed.as_ref().map(|s| s.bytes),
            "pytorch_allocated_bytes": range_json(f.allocated),
            "pytorch_reserved_bytes": range_json(f.reserved),
            "pytorch_reserved_unallocated_bytes": range_json(f.reserved_unallocated),
            "private_pool_bytes": p.private_pools.as_ref().map(|s| s.bytes),
            "active_bytes": p.active.as_ref().map(|s| s.bytes),
            "this_process_bytes": range_json(f.this_process),
            "processes": p.processes.iter().map(|q| json!({"pid": q.pid, "bytes": q.bytes.bytes, "min": q.bytes.min, "max": q.bytes.max})).collect::<Vec<_>>(),
            "other_processes_bytes": range_json(f.other_processes),
            "non_pytorch_bytes": range_json(f.non_pytorch),
            "tensor": p.tensor.as_ref().map(|t| json!({"shape": t.shape, "dtype": t.dtype, "element_bytes": t.element_bytes})),
            "allocator": p.allocator,
            "capacty_spelling": p.capacty_spelling,
            "cause": v.cause.map_or("undecided", |c| c.name()),
            "possible_causes": v.possible.iter().map(|c| c.name()).collect::<Vec<_>>(),
            "undecided_because": v.undecided,
            "cause_rule": RULE,
            "shortfall_bytes": range_json(v.shortfall),
            "bounds": bounds,
            "remedies": remedies,
            "checked": self.checked.as_ref().map(|c| json!({
                "command": c.base_command,
                "fits": c.base.fits(),
                "peak_device_used_bytes": c.base.report.peak_device_used(),
                "device_total_bytes": c.base.report.device.total_memory,
                "changes_tried": c.tried,
                "changes_that_fit": c.fitting.len(),
            })),
            "checked_snapshot": self.checked_run.as_ref().map(|c| json!({
                "path": c.path,
                "fits": c.base_fits,
                "settings_tried": c.tried,
                "settings_that_fit": c.fitting.len(),
            })),
            "notes": f.notes,
        })
    }

    /// `vramsim explain`'s table.
    pub fn to_table(&self) -> String {
        let p = &self.parsed;
        let f = &self.figures;
        let v = &self.verdict;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "message    {} ({}){}{}",
            p.format.framework(),
            p.format.name(),
            if p.backend.is_empty() {
                String::new()
            } else {
                format!(", {}", p.backend)
            },
            p.device
                .as_ref()
                .map_or(String::new(), |d| format!(", {d}"))
        );
        let row = |out: &mut String, label: &str, r: Option<Range>, printed: Option<&Size>| {
            let Some(r) = r else { return };
            let text = printed.map_or_else(|| format_size(r.bytes), |s| s.printed.clone());
            let span = if r.is_exact() {
                format!("{} bytes", vramsim_sim::report::group_digits(r.bytes))
            } else {
                format!(
                    "{}..={} bytes",
                    vramsim_sim::report::group_digits(r.min),
                    vramsim_sim::report::group_digits(r.max)
                )
            };
            let _ = writeln!(out, "  {label:<30} {text:>20}   {span}");
        };
        row(&mut out, "requested", Some(f.requested), Some(&p.requested));
        row(&mut out, "device capacity", f.capacity, p.capacity.as_ref());
        row(
            &mut out,
            "memory-fraction limit",
            p.allowed.as_ref().map(Range::of),
            p.allowed.as_ref(),
        );
        row(&mut out, "free on the device", f.free, p.free.as_ref());
        row(
            &mut out,
            "allocated by PyTorch",
            f.allocated,
            p.allocated.as_ref(),
        );
        row(
            &mut out,
            "reserved by PyTorch",
            f.reserved,
            p.reserved.as_ref(),
        );
        row(
            &mut out,
            "reserved but unallocated",
            f.reserved_unallocated,
            p.reserved_unallocated.as_ref(),
        );
        row(
            &mut out,
            "this process (NVML)",
            f.this_process,
            p.this_process.as_ref(),
        );
        row(
            &mut out,
            "outside PyTorch, this process",
            f.non_pytorch,
            None,
        );
        for q in &p.processes {
            row(
                &mut out,
                &format!("process {}", q.pid),
                Some(Range::of(&q.bytes)),
                Some(&q.bytes),
            );
        }
        out.push('\n');
        let cause = match v.cause {
            Some(c) => c.name().to_string(),
            None => format!(
                "undecided between {}",
                v.possible
                    .iter()
                    .map(|c| c.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let _ = writeln!(out, "cause      {cause}");
        if let Some(s) = v.shortfall {
            let _ = writeln!(
                out,
                "shortfall  {} ({}..={} bytes)",
                format_size(s.bytes),
                vramsim_sim::report::group_digits(s.min),
                vramsim_sim::report::group_digits(s.max)
            );
        }
        if let Some(why) = &v.undecided {
            let _ = writeln!(out, "undecided  {why}");
        }
        let _ = writeln!(out, "rule       {RULE}");
        if let Some(c) = &self.checked {
            let _ = writeln!(
                out,
                "replayed   {}: peak device use {} of {} ({}); {} of {} changes fit",
                c.base_command,
                format_size(c.base.report.peak_device_used()),
                format_size(c.base.report.device.total_memory),
                if c.base.fits() {
                    "fits"
                } else {
                    "out of memory"
                },
                c.fitting.len(),
                c.tried
            );
        }
        if let Some(c) = &self.checked_run {
            let _ = writeln!(
                out,
                "replayed   {}: {} as given; {} of {} allocator settings fit",
                c.path,
                if c.base_fits { "fits" } else { "out of memory" },
                c.fitting.len(),
                c.tried
            );
        }
        out.push_str("\nremedies\n");
        for r in &self.remedies {
            let _ = writeln!(out, "  - [{}] {}", r.kind, r.text);
            if let Some(cmd) = &r.command {
                let _ = writeln!(out, "      {cmd}");
            }
        }
        for note in &f.notes {
            let _ = writeln!(out, "note: {note}");
        }
        out
    }
}
