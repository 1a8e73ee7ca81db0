//! Where each recorded allocation came from: the stack `frames` of a snapshot's trace entries, reduced
//! to one *site* per entry. [`crate::snapshot`] drops frames (they are most of a snapshot's bytes); this
//! reads them when a caller asks who allocated what (`vramsim diagnose`).
//!
//! PyTorch records frames innermost first: the C++ of the allocator and the interpreter, then Python
//! frames up to the script. The site is the innermost Python frame outside PyTorch's own package (the
//! user's line that made the tensor); failing that the innermost Python frame, failing that the innermost
//! named frame. It is written `file:line in function`, the file without its directories.

use std::path::Path;

use crate::pickle::Value;
use crate::snapshot::{load_value_file, SnapshotError};

/// The site of one stack (see the module documentation), or `None` for an empty stack.
pub fn site_of(frames: &[Value]) -> Option<String> {
    let parsed: Vec<(&str, i64, &str)> = frames
        .iter()
        .map(|f| {
            (
                f.get("filename").and_then(Value::as_str).unwrap_or(""),
                f.get("line").and_then(Value::as_int).unwrap_or(0),
                f.get("name").and_then(Value::as_str).unwrap_or(""),
            )
        })
        .collect();
    let python = |(file, _, _): &&(&str, i64, &str)| file.ends_with(".py");
    let in_torch = |file: &str| file.contains("/torch/") || file.starts_with("torch/");
    let chosen = parsed
        .iter()
        .filter(python)
        .find(|(file, _, _)| !in_torch(file))
        .or_else(|| parsed.iter().find(python))
        .or_else(|| parsed.iter().find(|(_, _, name)| !name.is_empty()))?;
    let (file, line, name) = chosen;
    let short = file.rsplit('/').next().unwrap_or(file);
    Some(if short.is_empty() || *line == 0 {
        name.to_string()
    } else {
        format!("{short}:{line} in {name}")
    })
}

/// For each device of the snapshot at `path`, the site of each of its trace entries (in order).
pub fn load_trace_sites(path: impl AsRef<Path>) -> Result<Vec<Vec<Option<String>>>, SnapshotError> {
    let value = load_value_file(path)?;
    let traces = value
        .get("device_traces")
        .and_then(Value::as_sequence)
        .unwrap_or(&[]);
    Ok(traces
        .iter()
        .map(|device| {
            device
                .as_sequence()
                .unwrap_or(&[])
                .iter()
                .map(|entry| {
                    entry
                        .get("frames")
                        .and_then(Value::as_sequence)
                        .and_then(site_of)
                })
                .collect()
        })
        .collect())
}
