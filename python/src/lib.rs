//! `vramsim._vramsim`: the native module of the `vramsim` Python package, a thin shell over
//! `vramsim-api` (no subprocess: the Rust library is called in-process).
//!
//! The Python side (`python/vramsim/__init__.py`) turns keyword arguments into the command line's
//! arguments and calls [`run`], which parses them with the command's own clap definition (same names,
//! defaults, parsers and messages as `vramsim COMMAND`), computes with the GIL released, and returns the
//! command's `--json` document and its table. [`options`] lists each command's options, read from the
//! same clap definitions, so the Python keyword arguments are derived from them, never written twice.

use clap::{ArgAction, Args, Command};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use vramsim_api::check::{self, CheckArgs};
use vramsim_api::diagnose::{self, DiagnoseArgs};
use vramsim_api::explain::{self, ExplainArgs};
use vramsim_api::import::{self, ImportArgs};
use vramsim_api::maxbatch::{self, MaxBatchArgs};
use vramsim_api::predict::{self, PredictArgs};
use vramsim_api::recommend::{self, RecommendArgs};
use vramsim_api::replay::{self, ReplayArgs};
use vramsim_api::steptime;
use vramsim_api::sweep::Progress;
use vramsim_api::whatif::{self, WhatifArgs};
use vramsim_api::{machine, parse_args};

create_exception!(
    _vramsim,
    VramsimError,
    PyException,
    "Base class of vramsim's errors."
);
create_exception!(
    _vramsim,
    ConfigError,
    VramsimError,
    "An invalid option or configuration (the command line's exit status 2), with its message."
);
create_exception!(
    _vramsim,
    TraceError,
    VramsimError,
    "A trace or snapshot that cannot be read, imported or replayed, with its message."
);

/// The commands the package calls, with their options structs.
const COMMANDS: &[&str] = &[
    "predict",
    "whatif",
    "max-batch",
    "recommend",
    "replay",
    "import",
    "check-snapshot",
    "explain",
    "diagnose",
];

/// The clap definition of `command`'s options.
fn definition(command: &str) -> Option<Command> {
    let c = Command::new("vramsim");
    Some(match command {
        "predict" => PredictArgs::augment_args(c),
        "whatif" => WhatifArgs::augment_args(c),
        "max-batch" => MaxBatchArgs::augment_args(c),
        "recommend" => RecommendArgs::augment_args(c),
        "replay" => ReplayArgs::augment_args(c),
        "import" => ImportArgs::augment_args(c),
        "check-snapshot" => CheckArgs::augment_args(c),
        "explain" => ExplainArgs::augment_args(c),
        "diagnose" => DiagnoseArgs::augment_args(c),
        _ => return None,
    })
}

fn unknown_command(command: &str) -> PyErr {
    ConfigError::new_err(format!(
        "unknown command {command:?}; valid: {}",
        COMMANDS.join(", ")
    ))
}

/// One option as [`options`] describes it: (long name, kind, default, help, required).
type OptionRow = (String, String, Option<String>, String, bool);

/// The options of `command` as the command line defines them: one [`OptionRow`] per option, kind
/// being "flag", "value", "values" (repeatable) or "positional".
#[pyfunction]
fn options(command: &str) -> PyResult<Vec<OptionRow>> {
    let def = definition(command).ok_or_else(|| unknown_command(command))?;
    Ok(def
        .get_arguments()
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .map(|a| {
            let long = a
                .get_long()
                .map(str::to_string)
                .unwrap_or_else(|| a.get_id().to_string());
            let kind = if a.is_positional() {
                "positional"
            } else {
                match a.get_action() {
                    ArgAction::SetTrue => "flag",
                    ArgAction::Append => "values",
                    _ => "value",
                }
            };
            let default = a
                .get_default_values()
                .first()
                .map(|v| v.to_string_lossy().into_owned());
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            (long, kind.to_string(), default, help, a.is_required_set())
        })
        .collect())
}

/// What a command returns: its `--json` document and its table (text).
type Output = (serde_json::Value, String);

fn compute(command: &str, args: &[String]) -> anyhow::Result<Output> {
    Ok(match command {
        "predict" => {
            let a: PredictArgs = parse_args("predict", args)?;
            let p = predict::predict(&a)?;
            (p.to_json(), p.to_table())
        }
        "whatif" => {
            let a: WhatifArgs = parse_args("whatif", args)?;
            let w = whatif::whatif(&a, true, |_| Progress::hidden())?;
            (w.to_json(), w.to_csv())
        }
        "max-batch" => {
            let a: MaxBatchArgs = parse_args("max-batch", args)?;
            let m = maxbatch::max_batch(&a)?;
            (m.to_json(), m.to_text())
        }
        "recommend" => {
            let a: RecommendArgs = parse_args("recommend", args)?;
            let r = recommend::recommend(&a)?;
            (r.to_json(), r.to_table())
        }
        "replay" => {
            let a: ReplayArgs = parse_args("replay", args)?;
            let r = replay::replay(a)?;
            (r.to_json(), r.to_table())
        }
        "import" => {
            let a: ImportArgs = parse_args("import", args)?;
            let done = import::import_snapshot(&a)?;
            (
                serde_json::Value::Array(done.iter().map(|d| d.to_json()).collect()),
                done.iter().map(|d| d.to_text()).collect(),
            )
        }
        "check-snapshot" => {
            let a: CheckArgs = parse_args("check-snapshot", args)?;
            let reports = check::check_snapshot(&a)?;
            (
                check::reports_json(&reports),
                reports.iter().map(|r| r.to_table()).collect(),
            )
        }
        "explain" => {
            let a: ExplainArgs = parse_args("explain", args)?;
            let Some(text) = a.text.as_deref() else {
                anyhow::bail!("explain needs the message: explain(exception or text)");
            };
            let e = explain::explain(text, &a)?;
            (e.to_json(), e.to_table())
        }
        "diagnose" => {
            let a: DiagnoseArgs = parse_args("diagnose", args)?;
            let d = diagnose::diagnose(&a)?;
            (d.to_json(), d.to_table())
        }
        _ => anyhow::bail!(
            "unknown command {command:?}; valid: {}",
            COMMANDS.join(", ")
        ),
    })
}

/// Whether an error comes from reading, importing or replaying a trace or snapshot (else it is about
/// the options): a trace, snapshot, import or replay error, or, for the commands that take a trace or
/// snapshot file, an I/O error (a file that cannot be read or written).
fn is_trace_error(command: &str, error: &anyhow::Error) -> bool {
    let file_command = matches!(command, "replay" | "import" | "check-snapshot" | "diagnose");
    error.chain().any(|e| {
        (file_command && e.is::<std::io::Error>())
            || e.is::<vramsim_traces::TraceError>()
            || e.is::<vramsim_traces::snapshot::SnapshotError>()
            || e.is::<import::NotASnapshot>()
            || e.is::<vramsim_sim::engine::ReplayError>()
            || e.is::<vramsim_sim::import::ImportError>()
            || e.is::<diagnose::NoHistory>()
    })
}

/// Runs `command` with the command line's `args` (the GIL released while it computes) and returns its
/// `--json` document (as JSON text) and its table. Errors carry the command line's message.
#[pyfunction]
fn run(py: Python<'_>, command: &str, args: Vec<String>) -> PyResult<(String, String)> {
    if definition(command).is_none() {
        return Err(unknown_command(command));
    }
    let result = py.detach(|| compute(command, &args));
    match result {
        Ok((json, text)) => Ok((json.to_string(), text)),
        Err(error) => {
            let message = format!("{error:#}");
            Err(if is_trace_error(command, &error) {
                TraceError::new_err(message)
            } else {
                ConfigError::new_err(message)
            })
        }
    }
}

/// The GPU presets, as JSON text (`vramsim gpus --sources` as data).
#[pyfunction]
fn gpus() -> String {
    machine::gpus_json().to_string()
}

/// The step-time model's description: what `vramsim whatif --help` and `vramsim recommend --help`
/// print after their options (`vramsim_api::steptime::HELP`).
#[pyfunction]
fn step_time_model() -> &'static str {
    steptime::HELP
}

/// The native module.
/// The calls `from_module`'s graphs have a rule for (`vramsim_models::imported::SUPPORTED`): the
/// capture records the backward of the others, for their fallback.
#[pyfunction]
fn graph_rules() -> Vec<&'static str> {
    vramsim_models::imported::rules()
}

#[pymodule]
fn _vramsim(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(options, m)?)?;
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_function(wrap_pyfunction!(gpus, m)?)?;
    m.add_function(wrap_pyfunction!(step_time_model, m)?)?;
    m.add_function(wrap_pyfunction!(graph_rules, m)?)?;
    m.add("VramsimError", m.py().get_type::<VramsimError>())?;
    m.add("ConfigError", m.py().get_type::<ConfigError>())?;
    m.add("TraceError", m.py().get_type::<TraceError>())?;
    Ok(())
}
