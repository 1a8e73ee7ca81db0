//! Helpers shared by the models tests: reading a lowered trace the way the capture tools summarize
//! PyTorch's, and checking a folder of meta-device captures against the lowering.
// Each test crate uses a different subset of these helpers.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use vramsim_models::{lower, zoo, Recipe};
use vramsim_traces::{AllocId, Category, Event, Trace};

/// `(phase, peak of live requested bytes)` of each phase segment, as `summarize()` of
/// traces/python/vramsim_capture.py computes it.
pub fn segments(t: &Trace) -> Vec<(String, u64)> {
    let mut live: HashMap<&AllocId, u64> = HashMap::new();
    let (mut cur, mut out) = (0u64, Vec::<(String, u64)>::new());
    for e in &t.events {
        match e {
            Event::Phase { name } => out.push((name.to_string(), cur)),
            Event::Alloc { id, size, .. } => {
                assert!(live.insert(id, *size).is_none(), "{id} allocated twice");
                cur += size;
                if let Some(s) = out.last_mut() {
                    s.1 = s.1.max(cur);
                }
            }
            Event::Free { id } => cur -= live.remove(id).expect("freed once"),
            _ => {}
        }
    }
    out
}

/// The largest sum of live requested bytes over events `[from, to)` (counting what was live
/// before `from`).
pub fn peak_between(t: &Trace, from: usize, to: usize) -> u64 {
    let mut live: HashMap<&AllocId, u64> = HashMap::new();
    let (mut cur, mut peak) = (0u64, 0u64);
    for (i, e) in t.events.iter().enumerate().take(to) {
        match e {
            Event::Alloc { id, size, .. } => {
                live.insert(id, *size);
                cur += size;
            }
            Event::Free { id } => cur -= live.remove(id).unwrap(),
            _ => {}
        }
        if i >= from {
            peak = peak.max(cur);
        }
    }
    peak
}

/// Requested bytes live just before event `end`, by category.
pub fn live_by_category(t: &Trace, end: usize) -> HashMap<Category, u64> {
    let mut live: HashMap<&AllocId, (u64, Category)> = HashMap::new();
    for e in &t.events[..end] {
        match e {
            Event::Alloc {
                id, size, category, ..
            } => {
                live.insert(id, (*size, *category));
            }
            Event::Free { id } => {
                live.remove(id);
            }
            _ => {}
        }
    }
    let mut by = HashMap::new();
    for (s, c) in live.into_values() {
        *by.entry(c).or_insert(0) += s;
    }
    by
}

/// `(+size | -size)` of every alloc and free from the first `forward` marker on, and the same for
/// the events of the `phase` segments only: every one (`nth` `None`) or the `nth` (from 1).
pub fn signed_sizes(t: &Trace, phase: &str, nth: Option<u32>) -> (Vec<i64>, Vec<i64>) {
    let mut sizes: HashMap<&AllocId, u64> = HashMap::new();
    let (mut all, mut inside) = (Vec::new(), Vec::new());
    let (mut started, mut seen, mut in_phase) = (false, 0u32, false);
    for e in &t.events {
        let x = match e {
            Event::Phase { name } => {
                started |= &**name == "forward";
                in_phase = &**name == phase;
                if in_phase {
                    seen += 1;
                    in_phase = nth.is_none_or(|n| n == seen);
                }
                continue;
            }
            Event::Alloc { id, size, .. } => {
                sizes.insert(id, *size);
                *size as i64
            }
            Event::Free { id } => -(sizes[id] as i64),
            _ => continue,
        };
        if started {
            all.push(x);
        }
        if in_phase {
            inside.push(x);
        }
    }
    (all, inside)
}

/// The `*.json` files in `tests/<dir>` of this crate, sorted.
pub fn json_files(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(dir);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

/// Lowers every capture (`*.json`) in `tests/<dir>` with the recipe `recipe_of` reads from it
/// and asserts the parameter count, the peak of live requested bytes and the peak of every phase
/// segment equal PyTorch's to the byte (at least `min_files` captures must be there).
pub fn check_captures(dir: &str, min_files: usize, recipe_of: fn(&serde_json::Value) -> Recipe) {
    let files = json_files(dir);
    assert!(
        files.len() >= min_files,
        "captures missing: {} found",
        files.len()
    );
    let mut failures = Vec::new();
    for path in files {
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        let r = recipe_of(&fx);
        let g = zoo::build(fx["model"].as_str().unwrap(), &r).unwrap();
        let t = lower(&g, &r).unwrap();
        let ours = segments(&t);
        let theirs: Vec<(String, u64)> = fx["peak_by_phase_segment"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s[0].as_str().unwrap().to_string(), s[1].as_u64().unwrap()))
            .collect();
        let peak = ours.iter().map(|s| s.1).max().unwrap_or(0);
        println!(
            "{file}: params {} peak {peak} (PyTorch {})",
            g.param_count(),
            fx["peak_requested_bytes"]
        );
        if g.total_param_count() != fx["params"].as_u64().unwrap() {
            failures.push(format!("{file}: params {}", g.total_param_count()));
        }
        if let Some(t) = fx["recipe"]["trainable_params"].as_u64() {
            if g.param_count() != t {
                failures.push(format!("{file}: trainable params {}", g.param_count()));
            }
        }
        if peak != fx["peak_requested_bytes"].as_u64().unwrap() {
            failures.push(format!("{file}: peak {peak}"));
        }
        if ours != theirs {
            failures.push(format!(
                "{file}: phase segments differ:\n  ours   {ours:?}\n  theirs {theirs:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Live allocations (size, category, tag) just before event index `at`.
pub fn live_at(t: &Trace, at: usize) -> Vec<(u64, Category, String)> {
    let mut live: HashMap<&AllocId, (u64, Category, String)> = HashMap::new();
    for e in &t.events[..at] {
        match e {
            Event::Alloc {
                id,
                size,
                category,
                tag,
                ..
            } => {
                live.insert(
                    id,
                    (*size, *category, tag.as_deref().unwrap_or("").to_string()),
                );
            }
            Event::Free { id } => {
                live.remove(id);
            }
            _ => {}
        }
    }
    live.into_values().collect()
}

/// Index of the `n`-th phase marker named `name`.
pub fn phase_index(t: &Trace, name: &str, n: usize) -> usize {
    t.events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, Event::Phase { name: p } if &**p == name))
        .nth(n)
        .map(|(i, _)| i)
        .unwrap_or_else(|| panic!("no phase {name} #{n}"))
}

/// Live bytes by category just before the `nth` (0-based) `phase` marker named `phase`.
pub fn live_at_phase(t: &Trace, phase: &str, nth: usize) -> HashMap<Category, u64> {
    let mut live: HashMap<String, (u64, Category)> = HashMap::new();
    let mut seen = 0;
    for e in &t.events {
        match e {
            Event::Alloc {
                id, size, category, ..
            } => {
                live.insert(id.to_string(), (*size, *category));
            }
            Event::Free { id } => {
                live.remove(&id.to_string());
            }
            Event::Phase { name } if &**name == phase => {
                if seen == nth {
                    let mut by = HashMap::new();
                    for (size, c) in live.values() {
                        *by.entry(*c).or_insert(0) += size;
                    }
                    return by;
                }
                seen += 1;
            }
            _ => {}
        }
    }
    panic!("no phase {phase} #{nth}");
}

/// The most bytes of `category` live at once over the trace.
pub fn max_live(t: &Trace, category: Category) -> u64 {
    let mut live: HashMap<String, (u64, Category)> = HashMap::new();
    let (mut now, mut max) = (0u64, 0u64);
    for e in &t.events {
        match e {
            Event::Alloc {
                id,
                size,
                category: c,
                ..
            } => {
                live.insert(id.to_string(), (*size, *c));
                if *c == category {
                    now += size;
                    max = max.max(now);
                }
            }
            Event::Free { id } => {
                if let Some((size, c)) = live.remove(&id.to_string()) {
                    if c == category {
                        now -= size;
                    }
                }
            }
            _ => {}
        }
    }
    max
}

/// ZeRO-3's partition of each parameter over `n` ranks: ⌈numel/N⌉ elements (`_partition_param`
/// pads every parameter to a multiple of the world size).
pub fn zero3_partition(g: &vramsim_models::Graph, n: u64) -> Vec<u64> {
    g.params
        .iter()
        .map(|p| p.shape.iter().product::<u64>().div_ceil(n))
        .collect()
}

/// Elements ZeRO-3 keeps whole on every rank: the persistent parameters
/// (`stage3_param_persistence_threshold` 1e5: `ds_numel <= param_threshold`), each its padded
/// partition × N, given `part` from [`zero3_partition`].
pub fn zero3_persistent(g: &vramsim_models::Graph, part: &[u64], n: u64) -> u64 {
    g.params
        .iter()
        .zip(part)
        .filter(|(p, _)| p.shape.iter().product::<u64>() <= 100_000)
        .map(|(_, k)| k * n)
        .sum()
}

/// Batches at which templates fitted at batch 2 and 3 are checked against fresh lowerings or builds
/// (batch 1 is a structure of its own: dimensions of 1 change kernels and copies, e.g. cuBLASLt's
/// `addmm` needs every dimension above 1).
pub const TEMPLATE_BATCHES: [u64; 4] = [4, 5, 8, 13];

/// The recipes a zoo model's templates are checked under: batch 1 at two shapes (sequence 32 and 80
/// for language models, two image sizes for convolutional ones).
pub fn template_recipes(name: &str) -> Vec<Recipe> {
    let language = zoo::Arch::from_name(name)
        .unwrap()
        .max_positions()
        .is_some();
    let convolutional = ["resnet", "vgg", "efficientnet", "convnext"]
        .iter()
        .any(|family| name.contains(family));
    [0usize, 1]
        .into_iter()
        .map(|shape| {
            let mut r = Recipe::new(1, [32, 80][shape]);
            if !language {
                r.seq = 0;
                if convolutional {
                    r.image_size = Some([(64, 64), (96, 80)][shape]);
                }
            }
            r
        })
        .collect()
}

/// Calls `check` with every zoo model and each of its [`template_recipes`].
pub fn for_every_template_recipe(check: impl Fn(&str, &Recipe)) {
    for name in zoo::NAMES {
        for r in template_recipes(name) {
            check(name, &r);
        }
    }
}
